"""Composed config -> DeepSpeed config dict. Pure: no I/O, no process group, unit-tested per option."""
from omegaconf import DictConfig, OmegaConf

from lmrepo.errors import ConfigError


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
            hint = (f"set trainer.grad_accum={global_batch // per_step}" if global_batch % per_step == 0
                    else "change trainer.micro_batch_size or trainer.global_batch_size")
            raise ConfigError(
                f"trainer.global_batch_size={global_batch} != trainer.micro_batch_size={micro} x "
                f"trainer.grad_accum={accum} x {dp_size} data-parallel rank(s) = {micro * accum * dp_size}: {hint}")
        return global_batch, micro, accum
    if micro is None and accum is None:
        accum = 1
    known = micro if micro is not None else accum
    if global_batch % (known * dp_size):
        raise ConfigError(
            f"global batch {global_batch} is not divisible by {known} x {dp_size} data-parallel rank(s): "
            "change trainer.global_batch_size, trainer.micro_batch_size or trainer.grad_accum")
    other = global_batch // (known * dp_size)
    return (global_batch, known, other) if micro is not None else (global_batch, other, known)


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def precision_section(precision: DictConfig) -> dict:
    if precision.dtype == "fp16":
        fp16 = {k: v for k, v in _plain(precision).items() if k != "dtype"}
        return {"fp16": {"enabled": True, **fp16}}
    return {"bf16": {"enabled": precision.dtype == "bf16"}}


def zero_section(zero: DictConfig, offload: DictConfig) -> dict:
    section = _plain(zero)
    if offload.target == "none":
        return section
    device = {"device": offload.target, "pin_memory": offload.pin_memory}
    if offload.target == "nvme":
        device["nvme_path"] = offload.nvme_path
    section["offload_optimizer"] = dict(device)
    offload_params = offload.params is True or (offload.params == "auto" and zero.stage == 3)
    if offload_params:
        param = dict(device)
        if offload.target == "nvme":
            param.update(buffer_count=offload.buffer_count, buffer_size=offload.buffer_size)
        section["offload_param"] = param
    return section


def scheduler_section(trainer: DictConfig) -> dict:
    # DeepSpeed's schedulers need at least one warmup step: no warmup = one "warmup" step at full lr.
    start_ratio = 0.0 if trainer.warmup_steps else 1.0
    warmup = {"warmup_num_steps": max(1, trainer.warmup_steps), "warmup_type": "linear"}
    if trainer.lr_decay == "cosine":
        return {"type": "WarmupCosineLR", "params": {
            **warmup, "total_num_steps": trainer.max_steps, "warmup_min_ratio": start_ratio,
            "cos_min_ratio": trainer.min_lr_ratio}}
    # WarmupLR / WarmupDecayLR take absolute learning rates.
    lrs = {"warmup_min_lr": start_ratio * trainer.lr, "warmup_max_lr": trainer.lr}
    if trainer.lr_decay == "linear":
        return {"type": "WarmupDecayLR", "params": {**warmup, **lrs, "total_num_steps": trainer.max_steps}}
    return {"type": "WarmupLR", "params": {**warmup, **lrs}}


def activation_checkpointing_section(checkpointing: DictConfig) -> dict:
    if not checkpointing.enabled or checkpointing.impl != "deepspeed":
        return {}
    keys = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
            "number_checkpoints", "synchronize_checkpoint_boundary")
    return {"activation_checkpointing": {k: checkpointing[k] for k in keys}}


def tensor_parallel_section(tp: DictConfig) -> dict:
    """tp=auto: DeepSpeed's AutoTP training shards the model's linears over tp.size ranks."""
    return {"tensor_parallel": {"autotp_size": tp.size}} if tp.mode == "auto" else {}


def build_ds_config(cfg: DictConfig, dp_size: int) -> dict:
    trainer = cfg.trainer
    global_batch, micro, accum = resolve_batch(
        trainer.global_batch_size, trainer.micro_batch_size, trainer.grad_accum, dp_size)
    ds = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": trainer.grad_clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": trainer.lr, "betas": list(trainer.betas), "eps": trainer.eps,
            "weight_decay": trainer.weight_decay}},
        "scheduler": scheduler_section(trainer),
        **precision_section(cfg.precision),
        "zero_optimization": zero_section(cfg.zero, cfg.offload),
        **activation_checkpointing_section(cfg.checkpointing),
        **tensor_parallel_section(cfg.tp),
        # lmrepo logs its own metrics; DeepSpeed's periodic prints would interleave with them.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.offload.target == "nvme":
        ds["aio"] = _plain(cfg.offload.aio)
    return ds


def merge_user_config(ours: dict, user: dict, dp_size: int, prefix: str = "") -> tuple[dict, list[str]]:
    """Lay a user's DeepSpeed JSON over ours: what it sets wins, "auto" keeps ours (as in the
    Hugging Face integration). Returns the merged dict and the dotted keys the user changed."""
    merged, changed = dict(ours), []
    for key, value in user.items():
        path = f"{prefix}{key}"
        if value == "auto":
            continue
        # Another optimizer or scheduler type takes none of our params: the user's section replaces ours.
        replaces = isinstance(value, dict) and "type" in value and value["type"] != ours.get(key, {}).get("type")
        if isinstance(value, dict) and isinstance(ours.get(key), dict) and not replaces:
            merged[key], sub = merge_user_config(ours[key], value, dp_size, prefix=f"{path}.")
            changed += sub
        elif ours.get(key) != value:
            merged[key] = value
            changed.append(path)
    if not prefix:
        _exclusive_precision(merged, user)
        _reconcile_batch(merged, user, dp_size)
    return merged, changed


def _exclusive_precision(merged: dict, user: dict) -> None:
    """A JSON that enables fp16 (or bf16) chooses the precision: ours is switched off."""
    for chosen, other in (("fp16", "bf16"), ("bf16", "fp16")):
        if user.get(chosen, {}).get("enabled") is True and merged.get(other, {}).get("enabled"):
            merged[other] = {**merged[other], "enabled": False}


def _reconcile_batch(merged: dict, user: dict, dp_size: int) -> None:
    """A user JSON that sets only some of the batch keys (seed 004 sets only the micro batch)
    decides the batch: ours fill in only what it leaves open, as DeepSpeed derives them."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    given = {k: user[k] for k in keys if k in user and user[k] != "auto"}
    if not given:
        return
    if len(given) == 1:
        # One key alone: keep our micro batch and derive the rest from it.
        if "train_batch_size" not in given:
            given.setdefault("gradient_accumulation_steps", merged["gradient_accumulation_steps"])
        given.setdefault("train_micro_batch_size_per_gpu", merged["train_micro_batch_size_per_gpu"])
    try:
        triple = resolve_batch(given.get(keys[0]), given.get(keys[1]), given.get(keys[2]), dp_size)
    except ConfigError as err:
        raise ConfigError(f"deepspeed_config batch keys: {err}") from None
    merged.update(zip(keys, triple))
