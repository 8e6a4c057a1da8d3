"""The final DeepSpeed dict (lmrepo's, with a user's JSON laid over it) checked before any process
group starts: its values, then the rules table's rows that read it (the only place a combination is
refused), then this machine (the precision it runs, the NVMe path, libaio)."""

import os
from pathlib import Path

from lmrepo.config import CheckpointingConfig, TrainConfig
from lmrepo.distributed.device import Device
from lmrepo.plan import rules
from lmrepo.plan.user_config import UserConfig, enabled
from lmrepo.utils.errors import ConfigError, require


def check_deepspeed(ds: dict, config: TrainConfig, device: Device, user: UserConfig | None = None) -> None:
    """The final dict's rules, so a user's JSON is held to the same ones as lmrepo's groups. Each
    message names what will fix it: the JSON's key when the JSON set the value, lmrepo's otherwise."""

    def fix(json_key: str, lmrepo_fix: str) -> str:
        if user is not None and user.sets(json_key):
            return f"change {json_key} in deepspeed_config={user.path}"
        return lmrepo_fix

    fp16, bf16 = enabled(ds.get("fp16", {}).get("enabled")), enabled(ds.get("bf16", {}).get("enabled"))
    if fp16:
        require(
            device.fp16,
            f"fp16 is not supported on this {device.type} device (fp16 with dynamic loss scaling needs "
            f"a GPU or a CPU with AVX512-FP16, such as a Xeon from Sapphire Rapids on): "
            f"{fix('fp16.enabled', 'use precision=auto, bf16 or fp32')}",
        )
    if bf16:
        require(
            device.bf16,
            f"bf16 is not supported on this {device.type} device: {fix('bf16.enabled', 'use precision=auto or fp32')}",
        )
    require(not (fp16 and bf16), f"fp16 and bf16 are both enabled: {fix('fp16.enabled', 'choose one precision=')}")
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    stage_fix = fix("zero_optimization.stage", "") or "choose zero=stage0..stage3"
    require(stage in (0, 1, 2, 3), f"zero.stage={stage} is not 0-3: {stage_fix}")
    rules.check(rules.Job(config, ds, fix))  # the combinations the final dict refuses (lmrepo/plan/rules.py)
    optimizer_offload = zero.get("offload_optimizer", {}).get("device", "none")
    param_offload = zero.get("offload_param", {}).get("device", "none")
    for section in ("offload_optimizer", "offload_param"):
        if zero.get(section, {}).get("device") == "nvme":
            key = f"zero_optimization.{section}.nvme_path"
            check_nvme_path(
                zero[section].get("nvme_path"), key if user is not None and user.sets(key) else "offload.nvme_path"
            )
    if optimizer_offload == "nvme" or param_offload == "nvme":
        check_libaio()
    if user is not None and user.sets("activation_checkpointing") and config.checkpointing.enabled:
        # The section only matters while blocks recompute (plan() says when it is not used).
        section = ds["activation_checkpointing"]
        try:
            CheckpointingConfig.check_zero_r(
                section.get("partition_activations"),
                section.get("cpu_checkpointing"),
                section.get("contiguous_memory_optimization"),
                section.get("number_checkpoints"),
                prefix="activation_checkpointing.",
            )
        except ConfigError as err:
            raise ConfigError(f"deepspeed_config={user.path}: {err}") from None


def check_nvme_path(path: str | None, key: str = "offload.nvme_path") -> None:
    require(bool(path), f"{key} must be set for NVMe offload")
    p = Path(path)
    require(not p.exists() or p.is_dir(), f"{key}={path} is a file, not a directory: choose a directory")
    parent = p if p.exists() else p.parent
    require(parent.is_dir(), f"{key}={path}: {parent} is not an existing directory: create it or choose another path")
    require(os.access(parent, os.W_OK), f"{key}={path} is not writable: choose a writable path")


def check_libaio() -> None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    require(
        AsyncIOBuilder().is_compatible(verbose=False),
        "offload=nvme needs libaio: install it (apt-get install libaio-dev) or use offload=cpu",
    )
