"""What the loop, checkpointing and evaluation ask of a training engine. DeepSpeed's engine
(engines/deepspeed.py), DeepSpeed's pipeline engine (engines/deepspeed_pipeline.py), PyTorch
FSDP2 (engines/fsdp2.py) and the torch.distributed.pipelining engine (engines/torch_pipeline.py)
each implement it, each built by its module's `build(config, layout, ds_config)`."""

from pathlib import Path
from typing import Protocol

import torch


class Engine(Protocol):
    device: torch.device
    dp_rank: int  # this rank's place among the ranks that read different samples
    dp_size: int  # how many such ranks (pipeline stages and tensor-parallel ranks of one replica read the same)
    background_save: bool  # save() returns before its files are written; finish_save() waits for them

    def train_step(self, batches: list[dict]) -> torch.Tensor:
        """Forward and backward over one optimizer step's micro batches, then the step; the mean
        loss of this rank's micro batches (a pipeline: of its replica's, on every stage)."""

    def eval_loss(self, batches: list[dict]) -> torch.Tensor:
        """Mean loss over `batches`, no gradients, the model left in training mode."""

    def lr(self) -> float:
        """The learning rate the next step uses."""

    def step_record(self) -> dict:
        """Engine-specific figures for the metrics line (fp16: loss_scale, skipped_steps)."""

    def save(self, directory: Path, tag: str, client_state: dict) -> None:
        """This rank's files of checkpoint `tag` under `directory` (every rank calls it)."""

    def finish_save(self) -> None:
        """Returns once this rank's files of the last save are written: an engine that writes them
        in the background (FSDP2's async DCP save) waits here; the others return at once."""

    def load(self, directory: Path, tag: str) -> dict:
        """Restores checkpoint `tag`; returns the client state saved with it."""

    def optimizer_groups(self) -> list[dict]:
        """The parameter groups of the optimizer this rank steps (their hyperparameters)."""


def to_device(batch: dict, device) -> dict:
    """The batch on `device`. To a GPU from page-locked memory, asynchronously: the copy queues behind
    the kernels already queued instead of making the host wait for them (a copy from pageable
    memory does), so the host prepares the next step's batches while the device computes."""
    if torch.device(device).type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def pipeline_inputs(batches: list[dict]):
    """A pipeline feeds its first stage the inputs and its last stage the labels. Packed documents
    kept apart (data.cross_document_attention=false) send their position ids along with the
    input ids, and each stage passes them on with the hidden states (lmrepo.models.pipe)."""
    return iter([(stage_inputs(batch), batch["labels"]) for batch in batches])


def stage_inputs(batch: dict):
    return (batch["input_ids"], batch["position_ids"]) if "position_ids" in batch else batch["input_ids"]
