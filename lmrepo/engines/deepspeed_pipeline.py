"""DeepSpeed's PipelineModule and PipelineEngine (`pipeline=1f1b`): GPT-2 / BERT split into
pipeline layers (lmrepo.models.pipe), 1F1B over trainer.grad_accum micro-batches per step."""

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

from lmrepo.config import TrainConfig
from lmrepo.distributed.layout import ParallelLayout
from lmrepo.engines.base import pipeline_inputs
from lmrepo.engines.deepspeed_runtime import DeepSpeedEngine, initialize
from lmrepo.engines.pipeline_timeline import Timeline, watch_deepspeed_pipeline
from lmrepo.engines.recompute import enable_activation_checkpointing
from lmrepo.models import build_model, pipe


def count_every_stage_in_clip_norm(module: PipelineModule) -> None:
    """DeepSpeed's fp32 ZeRO-0 gradient clipping (deepspeed.runtime.utils.clip_grad_norm_) counts a
    gradient when `mpu.get_model_parallel_rank() == 0` or the parameter is marked model-parallel;
    a pipeline's grid answers that rank with the stage index, so only the first stage's gradients
    made the norm, and the clip factor was too large (tests/test_ds_pipeline.py checks it).
    Marking each stage's own parameters counts them all once; the tied copies DeepSpeed marks
    `ds_pipe_replicated` stay unmarked, so only the first stage counts them. Every other
    DeepSpeed use of the mark tests the tensor-parallel rank, which is 0 here: no other effect."""
    for param in module.parameters():
        if not getattr(param, "ds_pipe_replicated", False):
            param.model_parallel = True


class DeepSpeedPipelineEngine(DeepSpeedEngine):
    """lmrepo's Engine over DeepSpeed's PipelineEngine: a step is one train_batch."""

    def __init__(self, ds_engine, layout: ParallelLayout):
        self.ds, self.device = ds_engine, ds_engine.device
        self.dp_rank, self.dp_size = layout.dp_rank(dist.get_rank()), layout.dp
        self.timeline = Timeline()  # this rank's instructions of the last train_batch
        watch_deepspeed_pipeline(self.timeline, ds_engine)
        self.last_bubble: float | None = None

    def train_step(self, batches: list[dict]) -> torch.Tensor:
        self.timeline.begin_step()
        loss = self.ds.train_batch(pipeline_inputs(batches)).detach().float()
        self.timeline.end_step()
        # bf16 and ZeRO-1 keep the global norm; fp32 ZeRO-0 clips inside train_batch and keeps none
        self.last_grad_norm = self.ds.get_global_grad_norm()
        # the bubble of the step, averaged over the pipeline ranks (the optimizer step left out)
        bubble = torch.tensor([self.timeline.bubble()], device=self.device)
        dist.all_reduce(bubble, group=self.ds.grid.get_pipe_parallel_group())
        self.last_bubble = bubble.item() / self.ds.num_stages
        return loss

    def step_record(self) -> dict:
        record = super().step_record()
        if self.last_bubble is not None:
            record["bubble"] = self.last_bubble
        return record

    @torch.no_grad()
    def eval_loss(self, batches: list[dict]) -> torch.Tensor:
        self.ds.eval()
        mean = self.ds.eval_batch(pipeline_inputs(batches), num_micro_batches=len(batches)).float()
        self.ds.train()
        return mean


def build(config: TrainConfig, layout: ParallelLayout, ds_config: dict) -> DeepSpeedPipelineEngine:
    """The whole transformers model is built on every rank first (the same seeded weights as a
    non-pipelined run); each rank then keeps only its stage's layers. DeepSpeed's grid numbers
    the ranks pipe-major, as the layout does."""
    net = build_model(config.model)
    enable_activation_checkpointing(net, config.checkpointing, ds_config)  # the blocks checkpoint themselves
    module = PipelineModule(
        layers=pipe.pipeline_layers(net, config.model.family),
        num_stages=layout.pp,
        loss_fn=pipe.LMLoss(config.model.family, net.config.vocab_size),
        partition_method=config.pipeline.partition_method,
    )  # type:GPT2Block also matches GPT2BlockPipe
    if dist.get_rank() == 0:
        names = [getattr(spec, "typename", type(spec)).__name__ for spec in module._layer_specs]
        if (note := pipe.balance_note(names, list(module.parts), config.pipeline.partition)) is not None:
            print(note, flush=True)
    count_every_stage_in_clip_norm(module)
    return DeepSpeedPipelineEngine(initialize(module, ds_config), layout)
