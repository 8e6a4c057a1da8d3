"""The typed schema of a training job, and its one validation pass.

Each config group is a dataclass (model.py, data.py, training.py, parallel.py, output.py) whose
fields carry their type, default and a one-line docstring; `TrainConfig` joins them and is
registered in Hydra's ConfigStore as the schema conf/train.yaml composes over, so Hydra
type-checks every YAML file and command-line override. `load()` turns the composed config into
a TrainConfig object after every range and combination rule has passed: a wrong value is one
ConfigError naming the key, before anything is written or any process group starts.
"""

import math
from dataclasses import dataclass, field, fields
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lmrepo.config.data import DataConfig, Source, SourceConfig
from lmrepo.config.evaluation import EvalConfig
from lmrepo.config.messages import describe_omegaconf_error, more_ranks
from lmrepo.config.model import Family, ModelConfig
from lmrepo.config.output import LauncherConfig, LoggerConfig, LoggerName, RunConfig
from lmrepo.config.parallel import (
    BLOCK_CLASSES,
    PIPELINE_FAMILIES,
    CheckpointingConfig,
    EngineConfig,
    EngineName,
    ExpertParallelConfig,
    OffloadConfig,
    OffloadTarget,
    PipelineConfig,
    Schedule,
    SequenceParallelConfig,
    TPConfig,
    TPMode,
    ZeroConfig,
)
from lmrepo.config.training import (
    Decay,
    Dtype,
    MetricsConfig,
    OptimizerConfig,
    PrecisionConfig,
    ScheduleConfig,
    TrainerConfig,
)
from lmrepo.errors import ConfigError, require

__all__ = [
    "TrainConfig",
    "load",
    "register",
    "layout_check",
    "to_dict",
    "from_dict",
    "ModelConfig",
    "DataConfig",
    "SourceConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "TrainerConfig",
    "PrecisionConfig",
    "MetricsConfig",
    "ZeroConfig",
    "EngineConfig",
    "EngineName",
    "OffloadConfig",
    "PipelineConfig",
    "SequenceParallelConfig",
    "TPConfig",
    "ExpertParallelConfig",
    "CheckpointingConfig",
    "LoggerConfig",
    "RunConfig",
    "LauncherConfig",
    "Family",
    "Source",
    "Decay",
    "Dtype",
    "OffloadTarget",
    "Schedule",
    "TPMode",
    "LoggerName",
]


@dataclass
class TrainConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    sequence_parallel: SequenceParallelConfig = field(default_factory=SequenceParallelConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    run: RunConfig = field(default_factory=RunConfig)
    deepspeed_config: Optional[str] = None
    """PATH of your own DeepSpeed JSON, laid over lmrepo's: the keys it sets win ("auto" keeps lmrepo's)"""


SCHEMA_NAME = "lmrepo_schema"


def register() -> None:
    """conf/train.yaml's first default: every group composes over its dataclass. Also the
    resolver behind `python train.py --help` (conf/hydra/help/lmrepo.yaml)."""
    from lmrepo.config.reference import register_help_resolver

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
    register_help_resolver()


def load(cfg: DictConfig) -> TrainConfig:
    """The composed config as a checked TrainConfig: types (again, for keys added with `+`),
    missing values, then each component's rules and the rules between components."""
    try:
        # As a plain container: a config Hydra composed over the schema is already a TrainConfig,
        # and OmegaConf keeps the keys `+key=value` added to it when merging same-typed configs.
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.to_container(cfg, resolve=False))
        config: TrainConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(describe_omegaconf_error(err)) from None
    for part in (
        config.model,
        config.data,
        config.optimizer,
        config.trainer,
        config.precision,
        config.zero,
        config.offload,
        config.pipeline,
        config.tp,
        config.sequence_parallel,
        config.expert_parallel,
        config.metrics,
        config.launcher,
        config.run,
    ):
        part.check()
    config.schedule.check(config.trainer.max_steps)
    config.schedule.warmup_steps = config.schedule.resolved_warmup(config.trainer.max_steps)
    config.checkpointing.check(config.model.shape()["n_layer"])
    if config.engine.name == EngineName.fsdp2:
        fsdp2_check(config)
    if not config.data.cross_document_attention:
        documents_check(config)
    if config.sequence_parallel.size > 1:
        sequence_parallel_check(config)
    if config.trainer.loss_tiles > 1:
        require(
            config.model.family != Family.bert,
            f"trainer.loss_tiles={config.trainer.loss_tiles} tiles a causal LM's loss, not model.family=bert's "
            "masked one: set trainer.loss_tiles=1",
        )
        require(
            config.pipeline.schedule == "none",
            f"trainer.loss_tiles={config.trainer.loss_tiles} does not combine with pipeline={config.pipeline.schedule} "
            "(its last stage computes the loss in the pipeline's layer list): set trainer.loss_tiles=1",
        )
    moe_check(config)
    n_positions = config.model.shape()["n_positions"]
    require(
        config.data.block_size <= n_positions,
        f"data.block_size={config.data.block_size} is longer than the model's {n_positions} positions: "
        "lower data.block_size or raise model.n_positions",
    )
    return config


def documents_check(config: TrainConfig) -> None:
    """Where data.cross_document_attention=false cannot be carried (docs/data.md#document-masking)."""
    require(
        config.model.family != Family.bert,
        "data.cross_document_attention=false keeps causal documents apart; model.family=bert attends both ways "
        "and has no per-document mask here: choose a gpt2 or llama model, or set data.cross_document_attention=true",
    )


def fsdp2_check(config: TrainConfig) -> None:
    """What engine=fsdp2 cannot mean, each one line naming the key (engines/fsdp2.py maps the rest)."""
    other = "or choose engine=deepspeed"
    stage = config.zero.stage
    require(
        stage >= 2,
        f"engine=fsdp2 has no counterpart of zero=stage{stage} (FSDP2 shards parameters, gradients and optimizer "
        f"states together): choose zero=stage3 (parameters resharded after forward) or zero=stage2 (kept "
        f"gathered until backward), {other}",
    )
    require(
        config.offload.target != OffloadTarget.nvme,
        f"engine=fsdp2 offloads to CPU memory only: choose offload=cpu or offload=none, {other}",
    )
    require(
        config.offload.target == OffloadTarget.none or config.offload.params is not False,
        "engine=fsdp2 offloads parameters, gradients and optimizer states together (CPUOffloadPolicy): "
        f"drop offload.params=false, {other}",
    )
    require(config.pipeline.schedule == "none", f"engine=fsdp2 runs without a pipeline: choose pipeline=none, {other}")
    require(
        config.optimizer.name != "muon",
        "optimizer=muon orthogonalises whole matrices and engine=fsdp2 keeps each one sharded across the ranks "
        f"(not offered yet): choose optimizer=adamw, {other}",
    )
    require(
        config.tp.mode == TPMode.none,
        f"engine=fsdp2 with tensor parallelism (a 2-D mesh) is not offered: choose tp=none, {other}",
    )
    require(
        config.deepspeed_config is None,
        f"deepspeed_config={config.deepspeed_config} configures DeepSpeed's engine, not FSDP2: drop it, {other}",
    )
    require(
        config.precision.dtype != Dtype.fp16,
        "engine=fsdp2 trains in fp32 or bf16 (fp16 would need a sharded gradient scaler): choose precision=bf16, "
        + other,
    )
    require(not config.model.zero_init, f"model.zero_init is DeepSpeed's zero.Init: set it to false, {other}")
    zero_r = [
        key
        for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
        if getattr(config.checkpointing, key)
    ]
    require(
        not (config.checkpointing.enabled and zero_r),
        f"checkpointing.{zero_r[0] if zero_r else ''} is a ZeRO-R option of DeepSpeed's activation checkpointing; "
        f"under engine=fsdp2 blocks recompute with torch.utils.checkpoint: drop it, {other}",
    )


def sequence_parallel_check(config: TrainConfig) -> None:
    """What sequence_parallel.size=N cannot mean, each one line naming the key."""
    size = config.sequence_parallel.size
    key = f"sequence_parallel.size={size}"
    off = "or set sequence_parallel.size=1"
    require(
        config.model.family != Family.bert,
        f"{key} splits causal models (GPT-2, Llama), not model.family=bert (bidirectional): {off}",
    )
    require(config.engine.name == EngineName.deepspeed, f"{key} runs on engine=deepspeed (Ulysses): choose it, {off}")
    require(config.pipeline.schedule == "none", f"{key} does not combine with a pipeline: choose pipeline=none, {off}")
    require(config.tp.mode == TPMode.none, f"{key} does not combine with tensor parallelism: choose tp=none, {off}")
    shape = config.model.shape()
    for what, count in (("attention heads", shape["n_head"]), ("key/value heads", shape["n_kv_head"])):
        require(count % size == 0, f"{key} does not divide the model's {count} {what}: change sequence_parallel.size")
    require(
        config.data.block_size % size == 0,
        f"{key} does not divide data.block_size={config.data.block_size} (each rank holds an equal slice of every "
        "sequence): change data.block_size or sequence_parallel.size",
    )
    require(
        not config.eval.tasks,
        f"{key}: eval.tasks runs lm-eval on whole sequences, which a sequence-parallel model cannot take: run "
        "scripts/evaluate.py on a checkpoint instead (drop eval.tasks), " + off,
    )
    require(not config.trainer.compile, f"{key} is not tested with trainer.compile=true: set it to false, {off}")
    if config.zero.stage == 3:
        # DeepSpeed 0.19's ZeRO-3 reduce-scatter divides sequence-parallel gradients by the group size;
        # its all-reduce path is right, for buckets within reduce_bucket_size (lmrepo/ds_config.py).
        why = f"(DeepSpeed's reduce-scatter divides the sequence-parallel gradients by {size})"
        require(
            config.zero.reduce_scatter is not True,
            f"{key} with zero=stage3 reduces gradients without "
            f"zero.reduce_scatter {why}: drop zero.reduce_scatter=true",
        )
        require(
            config.zero.contiguous_gradients is not False,
            f"{key} with zero=stage3 needs zero.contiguous_gradients {why}: drop zero.contiguous_gradients=false",
        )
        bucket = config.zero.reduce_bucket_size or 5e8  # DeepSpeed's default
        largest = shape["vocab_size"] * shape["n_embd"]
        require(
            largest <= bucket,
            f"{key} with zero=stage3: the embedding's {largest} elements exceed zero.reduce_bucket_size={bucket:.0f}, "
            "which sends it through DeepSpeed's reduce-scatter (gradients divided by the group size): raise "
            "zero.reduce_bucket_size",
        )


def moe_check(config: TrainConfig) -> None:
    """What a mixture-of-experts model (DeepSpeed-MoE) combines with, each refusal one line."""
    size = config.expert_parallel.size
    if config.model.family != Family.mixtral:
        require(
            size == 1, f"expert_parallel.size={size} splits experts: choose a model=mixtral-* preset or set it to 1"
        )
        return
    moe = config.model.moe
    require(
        moe.experts % size == 0,
        f"expert_parallel.size={size} does not divide model.moe.experts={moe.experts}: every rank holds the same "
        "number of experts; change one of them",
    )
    require(
        config.engine.name == EngineName.deepspeed,
        f"model.family=mixtral runs on DeepSpeed-MoE: choose engine=deepspeed (engine={config.engine.name} has no "
        "expert parallelism here)",
    )
    require(
        config.zero.stage != 3,
        "model.family=mixtral with zero=stage3: DeepSpeed refuses its native MoE under ZeRO-3; choose zero=stage1 "
        "or zero=stage2 (optimizer states, gradients partitioned)",
    )
    require(
        config.zero.stage != 0 or size == 1,
        f"expert_parallel.size={size} with zero=stage0: DeepSpeed's ZeRO-0 clips with a gradient norm that "
        "leaves out the other ranks' experts (its ZeRO-1/2 norm counts them); choose zero=stage1 or zero=stage2, "
        "or expert_parallel.size=1",
    )
    require(
        config.pipeline.schedule == "none",
        f"model.family=mixtral with pipeline={config.pipeline.schedule}: DeepSpeed-MoE layers are not split into "
        "pipeline stages here; choose pipeline=none",
    )
    require(
        config.tp.mode == TPMode.none,
        "model.family=mixtral with tp=auto: AutoTP does not split DeepSpeed-MoE experts; choose tp=none "
        "(expert_parallel.size splits the experts)",
    )
    # Each of these replaces or splits the loss that carries the load-balancing term: not built for MoE yet.
    require(
        config.sequence_parallel.size == 1,
        f"model.family=mixtral with sequence_parallel.size={config.sequence_parallel.size}: not supported for "
        "mixture-of-experts models yet; set sequence_parallel.size=1",
    )
    require(
        config.trainer.loss_tiles == 1,
        f"model.family=mixtral with trainer.loss_tiles={config.trainer.loss_tiles}: the tiled loss does not carry "
        "the experts' load-balancing loss; set trainer.loss_tiles=1",
    )
    require(
        config.optimizer.name != "muon",
        "model.family=mixtral with optimizer=muon: Muon is not verified with DeepSpeed-MoE's expert parameter "
        "groups; choose optimizer=adamw",
    )


def layout_check(config: TrainConfig, world_size: int) -> int:
    """The rules of the rank layout; returns the data-parallel size. world = pipeline stages x
    tensor-parallel size x data-parallel degree."""
    pipe = config.pipeline
    require(
        world_size % pipe.stages == 0,
        f"pipeline.stages={pipe.stages} does not divide the world size "
        f"{world_size}: change pipeline.stages, or {more_ranks(math.lcm(world_size, pipe.stages))}",
    )
    if pipe.schedule != "none":
        _pipeline_check(config)
    dp_size = world_size // pipe.stages
    if config.tp.mode == TPMode.auto:
        tp = config.tp.size
        require(
            pipe.schedule == "none", "tp=auto does not combine with a pipeline here: choose tp=none or pipeline=none"
        )
        shape = config.model.shape()
        for what, count in (("attention heads", shape["n_head"]), ("key/value heads", shape["n_kv_head"])):
            require(count % tp == 0, f"tp.size={tp} does not divide the model's {count} {what}: change tp.size")
        _groups_divide(dp_size, "tp.size", tp, "rank(s) (world = tp.size x data-parallel ranks)", world_size)
        dp_size //= tp
    sp = config.sequence_parallel.size
    _groups_divide(
        dp_size,
        "sequence_parallel.size",
        sp,
        "rank(s) (world = sequence_parallel.size x data-parallel ranks)",
        world_size,
    )
    dp_size //= sp
    ep = config.expert_parallel.size
    _groups_divide(
        dp_size,
        "expert_parallel.size",
        ep,
        "data-parallel rank(s) (each group of expert_parallel.size ranks holds every expert once)",
        world_size,
    )
    return dp_size


def _groups_divide(ranks: int, key: str, size: int, which: str, world_size: int) -> None:
    """Groups of `size` ranks (tensor, sequence or expert parallel) must tile the `ranks` (of
    `world_size`); the way out names the smallest world that they tile."""
    needed = world_size // ranks * math.lcm(ranks, size)
    require(
        ranks % size == 0, f"{key}={size} does not divide the {ranks} {which}: change {key}, or {more_ranks(needed)}"
    )


def _pipeline_check(config: TrainConfig) -> None:
    import re

    pipe, model = config.pipeline, config.model
    require(
        model.family in PIPELINE_FAMILIES,
        f"pipeline={pipe.schedule} splits {', '.join(PIPELINE_FAMILIES)} "
        f"models, not model.family={model.family}: choose pipeline=none",
    )
    chunks, layers = pipe.stages * pipe.virtual_stages, model.shape()["n_layer"]
    require(
        chunks <= layers,
        f"pipeline.stages={pipe.stages} x pipeline.virtual_stages={pipe.virtual_stages} = {chunks} "
        f"pipeline stages for a model of {layers} layers: every stage needs a transformer layer; "
        "lower pipeline.stages",
    )
    if pipe.partition.startswith("type:"):
        from lmrepo.models.pipe import layer_class_names

        regex = pipe.partition.removeprefix("type:")
        matched = sum(1 for name in layer_class_names(model.family, layers) if re.search(regex, name, re.IGNORECASE))
        require(
            matched >= chunks,
            f"pipeline.partition={pipe.partition} matches {matched} layers, fewer than the {chunks} "
            f"pipeline stages: use type:{BLOCK_CLASSES[model.family]}",
        )
    micro_batches = config.trainer.grad_accum or 1
    if pipe.schedule in ("1f1b_torch", "interleaved"):
        require(
            micro_batches >= pipe.stages,
            f"pipeline={pipe.schedule} needs at least as many micro-batches as stages: trainer.grad_accum="
            f"{micro_batches} < pipeline.stages={pipe.stages}; raise trainer.grad_accum",
        )
    if pipe.schedule == "dualpipev":  # DeepSeek's DualPipeV fills its V with one micro-batch per stage
        require(
            micro_batches >= chunks,
            f"pipeline=dualpipev needs at least as many micro-batches as its {chunks} stages (pipeline.stages="
            f"{pipe.stages} x 2): trainer.grad_accum={micro_batches}; raise trainer.grad_accum",
        )
    if pipe.schedule in ("interleaved", "interleaved_zb"):
        rounds = max(1, micro_batches // pipe.stages)
        require(
            micro_batches % rounds == 0,
            f"pipeline={pipe.schedule} needs trainer.grad_accum={micro_batches} to be a "
            f"multiple of the {rounds} rounds of {pipe.stages} micro-batches: use a "
            "multiple of pipeline.stages",
        )
    require(
        not config.trainer.compile,
        f"trainer.compile=true is not supported with pipeline={pipe.schedule}: set trainer.compile=false",
    )


def from_dict(cls, data: dict):
    """A saved section (a checkpoint's config) as its dataclass: keys the schema no longer has
    are dropped, keys it gained take their defaults, so older checkpoints still load."""
    known = {f.name for f in fields(cls)}
    try:
        return OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(cls), {k: v for k, v in data.items() if k in known})
        )
    except OmegaConfBaseException as err:
        raise ConfigError(
            f"a saved {cls.__name__} does not fit this version's schema: {describe_omegaconf_error(err)}"
        ) from None


def to_dict(node) -> dict:
    """A config (or one of its slices) as plain Python: for JSON, YAML, W&B and checkpoints."""
    return OmegaConf.to_container(OmegaConf.structured(node), resolve=True, enum_to_str=True)
