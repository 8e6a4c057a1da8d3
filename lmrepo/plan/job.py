"""The job's plan: the composed config checked against the device and the world size, and
turned into the DeepSpeed dict. No files, no data, no process group, and no transformers:
train.py makes it before importing lmrepo.run, so a job refused here costs torch and DeepSpeed's
accelerator alone (~2 s of imports, against ~4 s for all of training's)."""

import re
from dataclasses import dataclass

from omegaconf import DictConfig

from lmrepo.config import TrainConfig, compile_by_default, deepspeed_checkpointed_blocks
from lmrepo.config.messages import more_ranks
from lmrepo.config.parallel import BLOCK_CLASSES, TPMode
from lmrepo.config.reference import CONF_DIR
from lmrepo.distributed.device import Device, choose_precision, detect_device
from lmrepo.distributed.layout import ParallelLayout
from lmrepo.models.pipe import layer_class_names
from lmrepo.plan.ds_config import build_ds_config, prefer_torch_adam_on_cpu, resolve_batch
from lmrepo.plan.preflight import check_deepspeed
from lmrepo.plan.rules import load_checked
from lmrepo.plan.user_config import UserConfig, lay_over
from lmrepo.utils.errors import ConfigError, require


@dataclass
class Plan:
    config: TrainConfig  # loaded, its autos resolved (precision, warmup)
    device: Device
    ds_config: dict  # the final DeepSpeed dict: lmrepo's with the user's JSON laid over it
    layout: ParallelLayout  # every parallel size and rank order (lmrepo.distributed.layout)
    user_changed: list[str]  # the keys the user's JSON changed
    notes: list[str]  # what to say at start: the precision (auto's choice, or bf16's cost here), JSON deprecations


def check_launcher_ranks(config: TrainConfig, world_size: int) -> None:
    """launcher.ranks is what each job of a -m sweep is launched with. A recipe that sets it
    (experiment=long_context) or a command line, run as one process without -m, would otherwise
    train on one rank without a word."""
    ranks = config.launcher.ranks * config.launcher.nodes
    if world_size == 1 and ranks > 1:
        raise ConfigError(
            f"launcher.ranks={config.launcher.ranks}{recipe_note()} sets the ranks of each job of a -m sweep, and "
            f"this is one process: add -m (python train.py -m ...), or {more_ranks(ranks)}"
        )


def recipe_note() -> str:
    """` (set by experiment=NAME)` when a recipe was chosen, for a message about a value it may set."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ""
    from omegaconf import OmegaConf

    experiment = HydraConfig.get().runtime.choices.get("experiment")
    recipe = CONF_DIR / "experiment" / f"{experiment}.yaml"
    sets = recipe.is_file() and OmegaConf.select(OmegaConf.load(recipe), "launcher.ranks") is not None
    return f" (experiment={experiment} sets it)" if sets else ""


def plan(cfg: DictConfig, world_size: int, device: Device | None = None) -> Plan:
    """The composed config checked and turned into the job's DeepSpeed dict, for `world_size`
    ranks on `device` (default: the one trainer.device picks here): no files, no data, no
    process group."""
    config = load_checked(cfg)
    device = device or detect_device(config.trainer.device)
    config.precision.dtype, precision_line = choose_precision(config.precision.dtype, device)
    check_launcher_ranks(config, world_size)
    layout = layout_check(config, world_size)
    dp_size = layout.dp
    config.eval.check(dp_size)
    ds_config, user_changed, user = build_ds_config(config, dp_size), [], None
    notes = [precision_line] if precision_line else []
    if config.trainer.compile is None:
        config.trainer.compile, compile_line = compile_by_default(config, device.type)
        notes += [compile_line] if compile_line else []
    elif config.trainer.compile and deepspeed_checkpointed_blocks(config):
        notes.append(
            "lmrepo: note: trainer.compile=true with checkpointing.impl=deepspeed leaves the checkpointed blocks "
            "uncompiled: DeepSpeed's checkpoint turns torch.compile off inside it (the embeddings, the final norm "
            "and the head compile); checkpointing.impl=torch compiles them, recompute included"
        )
    if config.engine.replicate == "nodes":
        notes.append(
            f"lmrepo: engine.replicate=nodes: {layout.dp_replicate} replica(s), one per node, each sharding over "
            f"its node's {layout.dp_shard} data-parallel rank(s)"
        )
    if config.pipeline.schedule != "none" and config.pipeline.stages == 1:
        notes.append(
            f"lmrepo: note: pipeline={config.pipeline.schedule} with pipeline.stages=1 is a one-stage pipeline: "
            "one rank runs every layer and nothing overlaps (no bubble to measure); pipeline.stages=2 or more "
            "splits the model"
        )
    if dp_size == 1 and config.zero.stage > 0 and config.offload.target == "none" and config.tp.mode == "none":
        sharding, unsharded = f"zero=stage{config.zero.stage}", "zero=stage0"
        if config.engine.name == "fsdp2":
            sharding, unsharded = "engine=fsdp2", "engine=deepspeed zero=stage0"
        notes.append(
            f"lmrepo: note: {sharding} over 1 data-parallel rank partitions nothing: it saves no memory and costs "
            f"its bookkeeping ({unsharded} trains the same model faster; offload=cpu saves memory)"
        )
    if config.deepspeed_config:
        user = UserConfig(config.deepspeed_config)
        ds_config, user_changed = lay_over(ds_config, user, config, dp_size)
        notes += [f"lmrepo: warning: deepspeed_config={user.path}: {line}" for line in user.warnings]
    prefer_torch_adam_on_cpu(ds_config, device.type)
    check_deepspeed(ds_config, config, device, user)
    if user is not None and user.sets("activation_checkpointing") and not config.checkpointing.enabled:
        notes.append(
            f"lmrepo: deepspeed_config={user.path}: its activation_checkpointing section is not used: activation "
            "checkpointing is off (checkpointing=full or every_n turns it on)"
        )
    return Plan(config, device, ds_config, layout, user_changed, notes)


def layout_check(config: TrainConfig, world_size: int) -> ParallelLayout:
    """The job's parallel layout on `world_size` ranks (lmrepo.distributed.layout), after the rules a layout
    puts on the model: a pipeline's stages, tensor-parallel heads."""
    if config.pipeline.schedule != "none":
        _pipeline_check(config)
    if config.tp.mode == TPMode.auto:
        shape = config.model.shape()
        for what, count in (("attention heads", shape["n_head"]), ("key/value heads", shape["n_kv_head"])):
            require(
                count % config.tp.size == 0,
                f"tp.size={config.tp.size} does not divide the model's {count} {what}: change tp.size",
            )
    layout = ParallelLayout.of(config, world_size)
    if config.pipeline.schedule != "none":
        _micro_batch_check(config, _micro_batches(config, layout.dp))
    return layout


def _micro_batches(config: TrainConfig, dp: int) -> int:
    """A step's micro-batches per replica: trainer.grad_accum, or what the global batch makes it on
    `dp` data-parallel ranks (grad_accum=null)."""
    trainer = config.trainer
    try:
        return resolve_batch(trainer.global_batch_size, trainer.micro_batch_size, trainer.grad_accum, dp)[2]
    except ConfigError:  # a batch that does not add up is refused later, in its own words
        return trainer.grad_accum or 1


def _pipeline_check(config: TrainConfig) -> None:
    pipe, model = config.pipeline, config.model
    chunks, layers = pipe.stages * pipe.virtual_stages, model.shape()["n_layer"]
    require(
        chunks <= layers,
        f"pipeline.stages={pipe.stages} x pipeline.virtual_stages={pipe.virtual_stages} = {chunks} "
        f"pipeline stages for a model of {layers} layers: every stage needs a transformer layer; "
        "lower pipeline.stages",
    )
    if pipe.partition.startswith("type:"):
        regex = pipe.partition.removeprefix("type:")
        matched = sum(1 for name in layer_class_names(model.family, layers) if re.search(regex, name, re.IGNORECASE))
        require(
            matched >= chunks,
            f"pipeline.partition={pipe.partition} matches {matched} layers, fewer than the {chunks} "
            f"pipeline stages: use type:{BLOCK_CLASSES[model.family]}",
        )


def _micro_batch_check(config: TrainConfig, micro_batches: int) -> None:
    pipe, chunks = config.pipeline, config.pipeline.stages * config.pipeline.virtual_stages
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
