"""Activation checkpointing for every engine: transformers' own per-block checkpointing, every n-th
block, and under DeepSpeed's engines and the torch pipeline (checkpointing.impl=deepspeed)
DeepSpeed's checkpoint function with the ZeRO-R options of the `activation_checkpointing` section."""

import deepspeed
import torch

from lmrepo.config import CheckpointingConfig


def enable_activation_checkpointing(
    model: torch.nn.Module, checkpointing: CheckpointingConfig, ds_config: dict | None = None
) -> None:
    """`ds_config` None: torch's checkpoint (FSDP2, whatever checkpointing.impl says); a dict (its
    `activation_checkpointing` section, possibly empty): DeepSpeed's for checkpointing.impl=deepspeed."""
    if not checkpointing.enabled:
        return
    model.activation_checkpointing_enable(every_n_layers=checkpointing.every_n_layers)
    if ds_config is not None and checkpointing.impl == "deepspeed":
        # transformers' checkpointed layers call `_gradient_checkpointing_func`; DeepSpeed's
        # version adds the ZeRO-R options of the `activation_checkpointing` section.
        # As keywords: configure(deepspeed_config=...) re-checks the batch keys against the
        # whole world, which a pipeline's data-parallel batch does not satisfy.
        section = ds_config.get("activation_checkpointing", {})
        deepspeed.checkpointing.configure(
            None,
            partition_activations=section.get("partition_activations"),
            contiguous_checkpointing=section.get("contiguous_memory_optimization"),
            num_checkpoints=section.get("number_checkpoints"),
            checkpoint_in_cpu=section.get("cpu_checkpointing"),
            synchronize=section.get("synchronize_checkpoint_boundary"),
        )
        for module in model.modules():
            if hasattr(module, "_gradient_checkpointing_func"):
                module._gradient_checkpointing_func = deepspeed.checkpointing.checkpoint
