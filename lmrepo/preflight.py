"""What is checked before any process group starts, beyond the config's own rules: the final
DeepSpeed dict (lmrepo's, with a user's JSON laid over it) against this machine and DeepSpeed."""

import os
from pathlib import Path

from lmrepo.config import CheckpointingConfig, ModelConfig, PipelineConfig, TPConfig, TPMode
from lmrepo.device import Device
from lmrepo.errors import ConfigError, require
from lmrepo.user_config import UserConfig, enabled


def check_deepspeed(
    ds: dict,
    pipeline: PipelineConfig,
    device: Device,
    user: UserConfig | None = None,
    activation_checkpointing: bool = True,
) -> None:
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
            f"a GPU or a CPU with AMX-FP16): {fix('fp16.enabled', 'use precision=auto, bf16 or fp32')}",
        )
    if bf16:
        require(
            device.bf16,
            f"bf16 is not supported on this {device.type} device: {fix('bf16.enabled', 'use precision=auto or fp32')}",
        )
    require(not (fp16 and bf16), f"fp16 and bf16 are both enabled: {fix('fp16.enabled', 'choose one precision=')}")
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    stage_fix = fix("zero_optimization.stage", "")
    require(stage in (0, 1, 2, 3), f"zero.stage={stage} is not 0-3: {stage_fix or 'choose zero=stage0..stage3'}")
    optimizer_offload = zero.get("offload_optimizer", {}).get("device", "none")
    param_offload = zero.get("offload_param", {}).get("device", "none")
    require(
        optimizer_offload != "nvme" or stage == 3,
        f"NVMe offload (ZeRO-Infinity) needs ZeRO-3 (it is stage {stage}): "
        f"{stage_fix or 'set zero=stage3, or offload=cpu'}",
    )
    require(
        optimizer_offload == "none" or stage >= 1,
        f"optimizer offload to {optimizer_offload} needs ZeRO stage >= 1: "
        + fix("zero_optimization.offload_optimizer", stage_fix or "set zero=stage1, stage2 or stage3, or offload=none"),
    )
    require(
        param_offload == "none" or stage == 3,
        f"parameter offload to {param_offload} needs ZeRO-3: "
        f"{fix('zero_optimization.offload_param', stage_fix or 'set zero=stage3, or offload.params=false')}",
    )
    for section in ("offload_optimizer", "offload_param"):
        if zero.get(section, {}).get("device") == "nvme":
            key = f"zero_optimization.{section}.nvme_path"
            check_nvme_path(
                zero[section].get("nvme_path"), key if user is not None and user.sets(key) else "offload.nvme_path"
            )
    if optimizer_offload == "nvme" or param_offload == "nvme":
        check_libaio()
    if user is not None and user.sets("activation_checkpointing") and activation_checkpointing:
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
    if str(ds.get("optimizer", {}).get("type", "")).lower() == "muon":
        check_muon(ds, pipeline, fix)
    schedule = pipeline.schedule
    if pipeline.engine == "deepspeed":
        require(
            stage <= 1,
            f"the DeepSpeed pipeline (pipeline={schedule}) supports ZeRO stage 0 or 1, not {stage}: "
            f"{stage_fix or 'set zero=stage0 or stage1'}",
        )
    if pipeline.engine == "torch":
        where = f"pipeline={schedule} (torch.distributed.pipelining)"
        require(
            user is None,
            f"{where} is not a DeepSpeed engine: deepspeed_config does not apply to it; "
            "use pipeline=1f1b, or leave deepspeed_config out",
        )
        require(
            stage == 0,
            f"{where} supports ZeRO stage 0 only, not {stage}: set zero=stage0, "
            "or pipeline=1f1b for DeepSpeed's pipeline with ZeRO-1",
        )
        require(optimizer_offload == "none", f"{where} does not offload: set offload=none, or pipeline=1f1b")
        require(not fp16, f"{where} runs fp32 or bf16: set precision=bf16, or pipeline=1f1b for fp16")


def check_muon(ds: dict, pipeline: PipelineConfig, fix) -> None:
    """DeepSpeed's Muon (lmrepo's optimizer=muon, or a JSON's "Muon") where it means what lmrepo
    says: whole matrices orthogonalised, trainer.grad_clip clipping the gradient at every stage,
    each half of the parameters at its own learning rate."""
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    other = "or optimizer=adamw"
    require(
        pipeline.schedule == "none",
        f"optimizer=muon runs on DeepSpeed's engine without a pipeline (each stage would need its own "
        f"Muon/AdamW split and checkpoint layout, not offered yet): choose pipeline=none, {other}",
    )
    require(
        ds.get("tensor_parallel", {}).get("autotp_size", 1) <= 1,
        f"optimizer=muon with tp=auto would orthogonalise each rank's shard of a matrix, not the matrix: "
        f"choose tp=none, {other}",
    )
    require(
        stage == 0 or not ds.get("gradient_clipping"),
        f"optimizer=muon with ZeRO stage {stage}: DeepSpeed's ZeRO clips Muon's orthogonalised update there, "
        f"not the gradient, so trainer.grad_clip would not mean what it means at stage 0: "
        f"{fix('gradient_clipping', 'set trainer.grad_clip=0, or zero=stage0')}",
    )
    require(
        stage != 3 or not ds["zero_optimization"].get("reduce_scatter", True),
        f"DeepSpeed's Muon under ZeRO-3 needs whole gradients (no reduce-scatter): "
        f"{fix('zero_optimization.reduce_scatter', 'set zero.reduce_scatter=false, or leave it null')}",
    )
    scheduler = ds.get("scheduler", {}).get("type")
    require(
        scheduler not in ("WarmupLR", "WarmupDecayLR"),
        f"{scheduler} sets one absolute learning rate for every parameter group, and Muon's two halves have "
        f"their own (optimizer.lr, optimizer.adam_lr): "
        f"{fix('scheduler', 'choose schedule=cosine or schedule=wsd (decay_fraction=0: constant, 1: linear decay)')}",
    )


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


def check_tensor_parallel(tp: TPConfig, model_cfg: ModelConfig) -> None:
    """tp=auto: DeepSpeed's AutoTP is asked up front, on a meta-device model, whether it can shard it."""
    if tp.mode != TPMode.auto:
        return
    from lmrepo.estimate import meta_model
    from lmrepo.tp import autotp_refusal

    model = meta_model(model_cfg)
    refusal = autotp_refusal(model)
    require(
        refusal is None,
        f'tp=auto: DeepSpeed\'s AutoTP refuses {type(model).__name__} ("{refusal}"): '
        "use tp=none (ZeRO shards its states instead) or a model=llama-* preset",
    )
