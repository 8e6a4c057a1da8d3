"""Loaded config -> DeepSpeed config dict. Pure: no I/O, no process group, unit-tested per option."""

from lmrepo.config import (
    CheckpointingConfig,
    Decay,
    Dtype,
    OffloadConfig,
    OffloadTarget,
    OptimizerConfig,
    PrecisionConfig,
    ScheduleConfig,
    TPConfig,
    TPMode,
    TrainConfig,
    ZeroConfig,
    to_dict,
)
from lmrepo.config.parallel import CheckpointingImpl
from lmrepo.config.training import WSD, OptimizerName
from lmrepo.utils.errors import ConfigError


def resolve_batch(global_batch: int | None, micro: int | None, accum: int | None, dp_size: int) -> tuple[int, int, int]:
    """DeepSpeed's rule for the batch triple, checked before launch: any two of
    (global, micro, accum) give the third; all three must satisfy global = micro * accum * dp."""
    if micro is None and accum is None and global_batch is None:
        raise ConfigError("no batch size: set trainer.micro_batch_size")
    if global_batch is None:
        micro, accum = micro or 1, accum or 1
        return micro * accum * dp_size, micro, accum
    if micro is not None and accum is not None:
        if micro * accum * dp_size != global_batch:
            per_step = micro * dp_size
            hint = (
                f"set trainer.grad_accum={global_batch // per_step}"
                if global_batch % per_step == 0
                else "change trainer.micro_batch_size or trainer.global_batch_size"
            )
            raise ConfigError(
                f"trainer.global_batch_size={global_batch} != trainer.micro_batch_size={micro} x "
                f"trainer.grad_accum={accum} x {dp_size} data-parallel rank(s) = {micro * accum * dp_size}: {hint}"
            )
        return global_batch, micro, accum
    if micro is None and accum is None:
        accum = 1
    known = micro if micro is not None else accum
    if global_batch % (known * dp_size):
        raise ConfigError(
            f"global batch {global_batch} is not divisible by {known} x {dp_size} data-parallel rank(s): "
            "change trainer.global_batch_size, trainer.micro_batch_size or trainer.grad_accum"
        )
    other = global_batch // (known * dp_size)
    return (global_batch, known, other) if micro is not None else (global_batch, other, known)


def batch_of(ds: dict) -> tuple[int, int, int]:
    """(global batch, micro batch, gradient accumulation) of a final DeepSpeed dict."""
    return ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]


def precision_section(precision: PrecisionConfig) -> dict:
    """`precision.dtype` must be resolved (not auto) by now."""
    if precision.dtype == Dtype.fp16:
        return {
            "fp16": {
                "enabled": True,
                "loss_scale": precision.loss_scale,
                "initial_scale_power": precision.initial_scale_power,
                "loss_scale_window": precision.loss_scale_window,
                "hysteresis": precision.hysteresis,
                "min_loss_scale": precision.min_loss_scale,
            }
        }
    return {"bf16": {"enabled": precision.dtype == Dtype.bf16}}


def _whole(value):
    # Sizes are typed float so that 5e8 is accepted; DeepSpeed wants whole numbers.
    return int(value) if isinstance(value, float) else value


def zero_section(zero: ZeroConfig, offload: OffloadConfig, optimizer: OptimizerName = OptimizerName.adamw) -> dict:
    section = {k: _whole(v) for k, v in to_dict(zero).items() if v is not None}
    if optimizer == OptimizerName.muon and zero.stage == 3 and zero.reduce_scatter is None:
        section["reduce_scatter"] = False  # DeepSpeed's Muon under ZeRO-3 needs whole gradients
    if offload.target == OffloadTarget.none:
        return section
    device = {"device": str(offload.target), "pin_memory": offload.pin_memory}
    if offload.target == OffloadTarget.nvme:
        device["nvme_path"] = offload.nvme_path
    section["offload_optimizer"] = dict(device)
    if offload.offloads_params(zero.stage):
        param = dict(device)
        if offload.target == OffloadTarget.nvme:
            param.update(buffer_count=offload.buffer_count, buffer_size=_whole(offload.buffer_size))
        section["offload_param"] = param
    return section


# lmrepo's optimizer names -> DeepSpeed's `optimizer` section.
DEEPSPEED_OPTIMIZERS = {
    OptimizerName.adamw: ("AdamW", {}),
    OptimizerName.adam: ("Adam", {"adam_w_mode": False}),
    OptimizerName.muon: ("Muon", {}),
}


def optimizer_section(optimizer: OptimizerConfig) -> dict:
    kind, extra = DEEPSPEED_OPTIMIZERS[optimizer.name]
    if optimizer.name == OptimizerName.muon:
        # DeepSpeed's Muon: lr/momentum/ns_method for its Muon half, adam_lr/betas/eps for its AdamW
        # half, weight_decay for both (lmrepo's parameter groups keep it off biases and norms).
        extra = {"muon_lr": optimizer.lr, "adam_lr": optimizer.adam_lr, "momentum": optimizer.momentum}
        extra["ns_method"] = str(optimizer.ns_method)
    return {
        "type": kind,
        "params": {
            "lr": optimizer.lr,
            "betas": list(optimizer.betas),
            "eps": optimizer.eps,
            "weight_decay": optimizer.weight_decay,
            **extra,
        },
    }


# The optimizer params torch's Adam/AdamW take as DeepSpeed writes them. FusedAdam's
# bias_correction=true is what torch always does; other FusedAdam-only keys keep DeepSpeed's op.
TORCH_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad"}


def prefer_torch_adam_on_cpu(ds: dict, device_type: str) -> None:
    """On a CPU without optimizer offload, DeepSpeed's Adam/AdamW is its FusedAdam op: a C++
    extension compiled on first use (minutes on a small machine) whose loading probes the CPU in
    a subprocess. torch's fused AdamW computes the same update at the
    same speed on a CPU (benchmarks/bench_optimizer.py), so the CPU uses it. GPUs and CPU offload
    (DeepSpeedCPUAdam, what offload=cpu means) keep DeepSpeed's ops; a JSON that says torch_adam wins."""
    optimizer = ds.get("optimizer") or {}
    if device_type == "cpu" and str(optimizer.get("type", "")).lower() == "muon" and not _offloaded(ds):
        optimizer.setdefault("params", {}).setdefault("torch_adam", True)  # the AdamW half of Muon
        return
    params = _adam_params(ds) if device_type == "cpu" else None
    if params is None or "torch_adam" in params:
        return
    if params.get("bias_correction", True) is True:
        params.pop("bias_correction", None)
    if set(params) <= TORCH_ADAM_PARAMS:
        params.update(torch_adam=True, fused=True)


def _adam_params(ds: dict) -> dict | None:
    """The optimizer params of a non-offloaded Adam/AdamW section, or None."""
    optimizer = ds.get("optimizer") or {}
    if _offloaded(ds) or str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        return None
    return optimizer.setdefault("params", {})


def _offloaded(ds: dict) -> bool:
    return ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") not in ("none", None)


def continue_with_saved_adam(ds: dict, saved: dict) -> str | None:
    """A resumed run keeps the Adam its checkpoint was written by (`saved`: that run's DeepSpeed
    dict): DeepSpeed's FusedAdam counts steps per parameter group, torch's per parameter, so the
    other one would read step 0 and restart Adam's bias correction (the loss moves off the
    uninterrupted run's at once). Returns the line to say, or None when nothing changes."""
    ours, theirs = _adam_params(ds), _adam_params(dict(saved))
    if ours is None or theirs is None or bool(ours.get("torch_adam")) == bool(theirs.get("torch_adam")):
        return None
    if theirs.get("torch_adam"):
        ours.update(torch_adam=True, fused=bool(theirs.get("fused")))
        return "lmrepo: resuming with torch's AdamW, which wrote the checkpoint's optimizer state"
    ours.pop("torch_adam", None)
    ours.pop("fused", None)
    return "lmrepo: resuming with DeepSpeed's FusedAdam, which wrote the checkpoint's optimizer state"


# lmrepo's warmup-stable-decay scheduler (lmrepo.optim.schedules), named in DeepSpeed's style so that a
# user's JSON can name it as it names DeepSpeed's.


def scheduler_section(schedule: ScheduleConfig, lr: float, max_steps: int) -> dict:
    """`schedule.warmup_steps` must be resolved (not null) by now."""
    # DeepSpeed's schedulers need at least one warmup step: no warmup = one "warmup" step at full lr.
    warmup_steps = schedule.warmup_steps
    start_ratio = 0.0 if warmup_steps else 1.0
    warmup = {"warmup_num_steps": max(1, warmup_steps), "warmup_type": "linear"}
    if schedule.name == Decay.cosine:
        return {
            "type": "WarmupCosineLR",
            "params": {
                **warmup,
                "total_num_steps": max_steps,
                "warmup_min_ratio": start_ratio,
                "cos_min_ratio": schedule.min_lr_ratio,
            },
        }
    if schedule.name == Decay.wsd:
        # DeepSpeed has no warmup-stable-decay scheduler: every engine builds lmrepo's from this section.
        return {"type": WSD, "params": wsd_params(schedule, max_steps)}
    # WarmupLR / WarmupDecayLR take absolute learning rates.
    lrs = {"warmup_min_lr": start_ratio * lr, "warmup_max_lr": lr}
    if schedule.name == Decay.linear:
        return {"type": "WarmupDecayLR", "params": {**warmup, **lrs, "total_num_steps": max_steps}}
    return {"type": "WarmupLR", "params": {**warmup, **lrs}}


def wsd_params(schedule: ScheduleConfig, max_steps: int) -> dict:
    """WarmupStableDecayLR's params for a resolved schedule (also what a JSON's "auto" means)."""
    return {
        "total_num_steps": max_steps,
        "warmup_num_steps": schedule.warmup_steps,
        "decay_num_steps": schedule.decay_steps(max_steps),
        "decay_type": str(schedule.decay_shape),
        "warmup_min_ratio": 0.0,
        "min_ratio": schedule.min_lr_ratio,
    }


def activation_checkpointing_section(checkpointing: CheckpointingConfig) -> dict:
    if not checkpointing.enabled or checkpointing.impl != CheckpointingImpl.deepspeed:
        return {}
    keys = (
        "partition_activations",
        "cpu_checkpointing",
        "contiguous_memory_optimization",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
    )
    return {"activation_checkpointing": {k: getattr(checkpointing, k) for k in keys}}


def tensor_parallel_section(tp: TPConfig) -> dict:
    """tp=auto: DeepSpeed's AutoTP training shards the model's linears over tp.size ranks."""
    return {"tensor_parallel": {"autotp_size": tp.size}} if tp.mode == TPMode.auto else {}


def build_ds_config(config: TrainConfig, dp_size: int) -> dict:
    """The DeepSpeed dict of a loaded config (autos resolved), before a user's JSON is laid over it."""
    trainer = config.trainer
    global_batch, micro, accum = resolve_batch(
        trainer.global_batch_size, trainer.micro_batch_size, trainer.grad_accum, dp_size
    )
    ds = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": trainer.grad_clip,
        "optimizer": optimizer_section(config.optimizer),
        "scheduler": scheduler_section(config.schedule, config.optimizer.lr, trainer.max_steps),
        **precision_section(config.precision),
        "zero_optimization": zero_section(config.zero, config.offload, config.optimizer.name),
        **activation_checkpointing_section(config.checkpointing),
        **tensor_parallel_section(config.tp),
        # lmrepo logs its own metrics; DeepSpeed's periodic prints would interleave with them.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer waits for the device at every step to time it (its figures go
        # to its own prints, which lmrepo turns off): the host could queue the next step meanwhile.
        "timers": {"throughput": {"enabled": False}},
    }
    if config.sequence_parallel.size > 1:
        ds["sequence_parallel_size"] = config.sequence_parallel.size
        if config.zero.stage == 3:
            # ZeRO-3's reduce-scatter averages gradients over every rank, where sequence-parallel ranks'
            # gradients must be summed (each holds a share of the loss): gradients / size. Its
            # all-reduce path (taken without reduce_scatter, for buckets within reduce_bucket_size) sums them.
            ds["zero_optimization"]["reduce_scatter"] = False
    if config.offload.target == OffloadTarget.nvme:
        ds["aio"] = to_dict(config.offload.aio)
    return ds
