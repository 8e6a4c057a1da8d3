"""lmrepo's Engine over DeepSpeed's runtime engine, shared by both DeepSpeed engines (data parallel:
engines/deepspeed.py; pipeline: engines/deepspeed_pipeline.py): deepspeed.initialize with lmrepo's
parameter groups and scheduler, and the step, evaluation and checkpoint calls the loop makes."""

import contextlib
import math
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.utils import clip_grad_norm_

from lmrepo.distributed.layout import ParallelLayout
from lmrepo.distributed.sequence_parallel import Slicer
from lmrepo.engines.base import to_device
from lmrepo.models.mixtral import balance_experts, moe_record
from lmrepo.optim.muon import compile_muon_update, muon_roles
from lmrepo.optim.optimizer import param_groups
from lmrepo.optim.schedules import client_scheduler
from lmrepo.utils.errors import ConfigError


def initialize(model: torch.nn.Module, ds_config: dict, mpu=None, compile_muon: bool = False):
    """deepspeed.initialize with lmrepo's parameter groups (the weight decay is the final dict's),
    lmrepo's Muon/AdamW split when the optimizer is Muon, for a scheduler type DeepSpeed does
    not have, lmrepo's scheduler, and one read of the overflow check without ZeRO."""
    weight_decay = ds_config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
    muon = str(ds_config.get("optimizer", {}).get("type", "")).lower() == "muon"
    if muon:
        compile_muon_update(compile_muon)
    with muon_roles(model) if muon else contextlib.nullcontext():
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, weight_decay),
            config=ds_config,
            mpu=mpu,
            lr_scheduler=client_scheduler(ds_config),
        )
    read_overflow_once(engine.optimizer)
    skip_the_all_reduce_of_one_process(engine)
    return engine


def read_overflow_once(optimizer) -> None:
    """Without ZeRO, DeepSpeed 0.19.8's fp16 and bf16 optimizers (FP16_Optimizer, and
    FP16_UnfusedOptimizer for any optimizer but its FusedAdam) test each gradient for inf/NaN before
    a step and read each answer back into Python (`CheckOverflow.has_overflow_serial`): on a GPU a
    wait for the device per gradient, 148 a step for GPT-2. ZeRO 1-2 already combine the answers on
    the device (DeepSpeed's `has_overflow_partitioned_grads_serial`); here too: the same test of
    every gradient, combined on the device, read once."""
    checker = getattr(optimizer, "overflow_checker", None)
    if checker is None:
        return

    def has_overflow_serial(params) -> bool:
        flags = [checker._has_inf_or_nan(p.grad.data, i) for i, p in enumerate(params) if p.grad is not None]
        return bool(torch.stack(flags).any()) if flags else False

    checker.has_overflow_serial = has_overflow_serial


def skip_the_all_reduce_of_one_process(engine) -> None:
    """Without ZeRO, DeepSpeed's engine all-reduces the gradients at every accumulation boundary,
    on one process too: it copies them all into one flat buffer, averages it over one rank, and
    copies it back: passes over every gradient and a copy per parameter (on a CPU, GPT-2 124M's
    depth at width 64, `bench_throughput.py --host`: over a quarter of the backward). Averaging
    over one rank multiplies by 1, so the step is the same to the bit without it. The switch is
    DeepSpeed's own, which its pipeline engine turns off too. ZeRO 1-3 move the gradients into
    their partitions in that reduction, so they keep it."""
    if engine.zero_optimization_stage() == 0 and dist.get_world_size() == 1:
        engine.enable_backward_allreduce = False


class DeepSpeedEngine:
    """lmrepo's Engine over a DeepSpeedEngine (`self.ds`)."""

    background_save = False

    def __init__(self, ds_engine, layout: ParallelLayout, slicer: Slicer | None = None):
        self.ds, self.device, self.slicer = ds_engine, ds_engine.device, slicer
        # a sequence- or tensor-parallel group (consecutive ranks) reads the same samples
        self.dp_rank, self.dp_size = layout.dp_rank(dist.get_rank()), layout.dp
        # DeepSpeed's ZeRO optimizers write Muon's orthogonalised update into the gradient before
        # they take the norm: not the gradient's norm, so the metrics line leaves grad_norm out.
        self.norm_is_the_update = type(ds_engine.basic_optimizer).__name__ == "MuonWithAuxAdam" and type(
            ds_engine.optimizer
        ).__name__ in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def _inputs(self, batch: dict) -> dict:
        return to_device(self.slicer(batch) if self.slicer else batch, self.device)

    def _whole(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro batch's loss: under sequence parallelism, the sum of the ranks' shares."""
        return self.slicer.whole_loss(loss) if self.slicer else loss.detach()

    def train_step(self, batches: list[dict]) -> torch.Tensor:
        losses = []
        for index, batch in enumerate(batches):
            loss = self.ds(**self._inputs(batch)).loss
            self.ds.backward(loss)  # at the accumulation boundary this also reduces the gradients
            if index == len(batches) - 1 and self._norm_before_step():
                # kept on the device: read back only when a metrics line asks for it
                self.last_grad_norm = clip_grad_norm_(self.ds.module.parameters(), math.inf, mpu=self.ds.mpu)
            self.ds.step()  # DeepSpeed steps the optimizer at the accumulation boundary
            losses.append(self._whole(loss).float())
        if not self._norm_before_step():
            self.last_grad_norm = None if self.norm_is_the_update else self.ds.get_global_grad_norm()
        balance_experts(self.module)  # model.moe.balance=aux_free: the router biases
        return torch.stack(losses).mean()

    def _norm_before_step(self) -> bool:
        """fp32 without ZeRO: DeepSpeed clips the gradients itself and keeps no norm, so lmrepo
        measures it the same way (its clip_grad_norm_ with no limit) before the step; its ZeRO,
        bf16 and fp16 optimizers keep the norm they computed."""
        return not (self.ds.zero_optimization() or self.ds.bfloat16_enabled() or self.ds.fp16_enabled())

    @torch.no_grad()
    def eval_loss(self, batches: list[dict]) -> torch.Tensor:
        self.ds.eval()
        mean = torch.stack([self._whole(self.ds(**self._inputs(batch)).loss).float() for batch in batches]).mean()
        self.ds.train()
        return mean

    def lr(self) -> float:
        return self.ds.get_lr()[0]

    def step_record(self) -> dict:
        """The global gradient norm before clipping; with fp16 (GPU) the dynamic loss scale and how
        many steps overflowed and were skipped."""
        norm = getattr(self, "last_grad_norm", None)
        record = {"grad_norm": float(norm)} if norm is not None else {}
        if self.ds.fp16_enabled():
            record.update(loss_scale=float(self.ds.optimizer.loss_scale), skipped_steps=int(self.ds.skipped_steps))
        record.update(moe_record(self.module))  # a mixture of experts' aux_loss and expert load
        return record

    def save(self, directory: Path, tag: str, client_state: dict) -> None:
        self.ds.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)

    def finish_save(self) -> None:
        pass  # save_checkpoint returns with the files written

    def optimizer_groups(self) -> list[dict]:
        return self.ds.optimizer.param_groups  # the wrapped optimizer's, under every ZeRO stage

    def load(self, directory: Path, tag: str) -> dict:
        path, client_state = self.ds.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise ConfigError(f"DeepSpeed could not load {directory / tag}: check run.resume")
        return client_state or {}
