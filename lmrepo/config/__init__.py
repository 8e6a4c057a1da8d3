"""The typed schema of a training job, each component's own checks, and the words a user reads
about it (one-line errors, --help, the options reference).

Each config group is a dataclass (model.py, data.py, training.py, parallel.py, output.py) whose
fields carry their type, default and a one-line docstring; `TrainConfig` joins them and is
registered in Hydra's ConfigStore as the schema conf/train.yaml composes over, so Hydra
type-checks every YAML file and command-line override. `load()` turns the composed config into
a TrainConfig object after every component's range rules have passed: a wrong value is one
ConfigError naming the key, before anything is written or any process group starts. What lmrepo
refuses to combine is the rules table's (lmrepo.plan.rules), one layer up.
"""

import functools
from dataclasses import dataclass, field, fields
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lmrepo.config.data import DataConfig, Source, SourceConfig
from lmrepo.config.evaluation import EvalConfig
from lmrepo.config.messages import describe_omegaconf_error
from lmrepo.config.model import Family, ModelConfig
from lmrepo.config.output import LauncherConfig, LoggerConfig, LoggerName, RunConfig
from lmrepo.config.parallel import (
    CheckpointingConfig,
    CheckpointingImpl,
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
from lmrepo.utils.errors import ConfigError, require

__all__ = [
    "TrainConfig",
    "load",
    "register",
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

    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.repo:  # once a process: storing builds the schema anew (~15 ms)
        store.store(name=SCHEMA_NAME, node=TrainConfig)
    register_help_resolver()


@functools.cache
def schema() -> DictConfig:
    """TrainConfig as OmegaConf's structured config, built once a process (~20 ms each time):
    OmegaConf.merge copies its first config, so load() never changes it."""
    return OmegaConf.structured(TrainConfig)


def load(cfg: DictConfig) -> TrainConfig:
    """The composed config as a checked TrainConfig: types (again, for keys added with `+`),
    missing values, then each component's own rules. What lmrepo refuses to combine is the rules
    table's (lmrepo.plan.rules.load_checked reads it next)."""
    try:
        # As a plain container: a config Hydra composed over the schema is already a TrainConfig,
        # and OmegaConf keeps the keys `+key=value` added to it when merging same-typed configs.
        merged = OmegaConf.merge(schema(), OmegaConf.to_container(cfg, resolve=False))
        config: TrainConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(describe_omegaconf_error(err)) from None
    for part in (
        config.engine,
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
    if config.sequence_parallel.size > 1:
        sequence_parallel_check(config)
    moe_check(config)
    n_positions = config.model.shape()["n_positions"]
    require(
        config.data.block_size <= n_positions,
        f"data.block_size={config.data.block_size} is longer than the model's {n_positions} positions: "
        "lower data.block_size or raise model.n_positions",
    )
    return config


def deepspeed_checkpointed_blocks(config: TrainConfig) -> bool:
    """Whether DeepSpeed's engine (no pipeline) checkpoints the blocks with DeepSpeed's checkpoint,
    which is `torch.compiler.disable`d (DeepSpeed 0.19.8): a compiled model runs them eager. (The
    torch pipelines recompute through torch's checkpoint; DeepSpeed's PipelineModule refuses compile.)"""
    return (
        config.engine.name == EngineName.deepspeed
        and config.pipeline.schedule == "none"
        and config.checkpointing.enabled
        and config.checkpointing.impl == CheckpointingImpl.deepspeed
    )


def compile_by_default(config: TrainConfig, device_type: str) -> tuple[bool, str | None]:
    """trainer.compile=null: (whether to compile, the line that says so). On a GPU a step of a small
    model is mostly kernel launches, and compiling fuses them (benchmarks/bench_gpu.py measures
    it); compiled are the layouts whose compiled step lmrepo runs in its benchmarks: DeepSpeed ZeRO 0-2
    and FSDP2, dense models, no pipeline, tensor or sequence parallelism, no DeepSpeed (reentrant)
    activation checkpointing. On a CPU the first step's compile costs more than a short run saves."""
    if device_type != "cuda":
        return False, None
    layout = [
        (config.pipeline.schedule != "none", f"pipeline={config.pipeline.schedule}"),
        (config.sequence_parallel.size > 1, f"sequence_parallel.size={config.sequence_parallel.size}"),
        (config.tp.mode != TPMode.none, f"tp={config.tp.mode}"),
        (config.model.family == Family.mixtral, "a mixture of experts (its routing breaks the graph)"),
        (
            config.engine.name == EngineName.deepspeed and config.zero.stage == 3,
            "DeepSpeed's zero=stage3 (its parameter hooks break the graph)",
        ),
        (deepspeed_checkpointed_blocks(config), "DeepSpeed's activation checkpointing (reentrant)"),
        (config.offload.target != OffloadTarget.none, f"offload={config.offload.target}"),
    ]
    reasons = [why for applies, why in layout if applies]
    if reasons:
        return False, f"lmrepo: trainer.compile=null -> off for {reasons[0]}; trainer.compile=true compiles anyway"
    return True, (
        "lmrepo: trainer.compile=null -> on (GPU): the first step compiles the model (about a minute; inductor "
        "caches it for the next run of the same shapes); trainer.compile=false turns it off"
    )


def sequence_parallel_check(config: TrainConfig) -> None:
    """What sequence_parallel.size > 1 needs of the model and the data (its combinations with other
    techniques: lmrepo/plan/rules.py)."""
    key, size = f"sequence_parallel.size={config.sequence_parallel.size}", config.sequence_parallel.size
    shape = config.model.shape()
    for what, count in (("attention heads", shape["n_head"]), ("key/value heads", shape["n_kv_head"])):
        require(count % size == 0, f"{key} does not divide the model's {count} {what}: change sequence_parallel.size")
    require(
        config.data.block_size % size == 0,
        f"{key} does not divide data.block_size={config.data.block_size} (each rank holds an equal slice of every "
        "sequence): change data.block_size or sequence_parallel.size",
    )


def moe_check(config: TrainConfig) -> None:
    """What expert parallelism needs of the model (its combinations with other techniques:
    lmrepo/plan/rules.py)."""
    size = config.expert_parallel.size
    if config.model.family != Family.mixtral:
        require(
            size == 1, f"expert_parallel.size={size} splits experts: choose a model=mixtral-* preset or set it to 1"
        )
        return
    require(
        config.model.moe.experts % size == 0,
        f"expert_parallel.size={size} does not divide model.moe.experts={config.model.moe.experts}: every rank holds "
        "the same number of experts; change one of them",
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
