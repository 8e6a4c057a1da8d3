"""DeepSpeed's engine around a plain transformers model: ZeRO 0-3, offload, precision, AutoTP,
sequence parallelism (Ulysses)."""

import contextlib
import math
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.utils import clip_grad_norm_
from deepspeed.utils import set_z3_leaf_module
from transformers.integrations import HfDeepSpeedConfig

from lmrepo.config import CheckpointingConfig, TrainConfig
from lmrepo.distributed.device import isolate_compile_cache
from lmrepo.distributed.layout import ParallelLayout
from lmrepo.distributed.sequence_parallel import Slicer, register
from lmrepo.distributed.tp import count_every_shard_in_the_norm
from lmrepo.engines import compile_muon as compile_muon_choice
from lmrepo.engines.base import to_device
from lmrepo.models import build_model, transformer_blocks
from lmrepo.models.mixtral import moe_record
from lmrepo.optim.muon import compile_muon_update, muon_parameters
from lmrepo.optim.schedules import client_scheduler
from lmrepo.utils.errors import ConfigError


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights), not on biases and norms (as nanoGPT).
    A mixture of experts' expert weights go in groups of their own: DeepSpeed reduces and
    partitions them over the expert-data-parallel ranks, not over all ranks."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            # Under ZeRO-3's zero.Init a parameter is an empty placeholder; ds_shape is its real shape.
            ndim = len(getattr(param, "ds_shape", param.shape))
            (decay if ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    if any(is_moe_param(param) for param in decay):
        return split_params_into_different_moe_groups_for_optimizer(groups)
    return [{k: v for k, v in group.items() if k != "name"} for group in groups]


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


@contextlib.contextmanager
def muon_roles(model: torch.nn.Module):
    """While deepspeed.initialize runs, each parameter's `use_muon` (which DeepSpeed's ZeRO and
    Muon read to pick the update) is lmrepo's role-based choice (lmrepo.optim.muon), set right after
    DeepSpeed's own by-name tagging."""
    tag_by_name = deepspeed.set_optimizer_flags
    matrices = muon_parameters(model)

    def tag_by_role(config_class, tagged_model):
        tag_by_name(config_class, tagged_model)
        for param in tagged_model.parameters():
            param.use_muon = id(param) in matrices

    deepspeed.set_optimizer_flags = tag_by_role
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = tag_by_name


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


def fetch_blocks_whole(model: torch.nn.Module, ds_config: dict) -> None:
    """At ZeRO-3, DeepSpeed gathers and releases parameters from hooks on every module that holds
    some, and runs them in Python: 6 modules in each GPT-2 block (two norms, four linears). Marked as
    DeepSpeed leaf modules, the transformer blocks are fetched whole, from one pre-forward and one
    pre-backward hook each (FSDP2's unit, and the same all-gathered values): on a CPU, GPT-2 124M's
    depth at width 64 (`bench_throughput.py --host`) takes about 0.7x the time per step. Not where
    parameters are swapped from NVMe: its `offload.buffer_count` buffers hold that many parameters
    at once, fewer than a block has."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("stage") != 3 or zero.get("offload_param", {}).get("device") == "nvme":
        return
    for block in transformer_blocks(model):
        set_z3_leaf_module(block, True)


def enable_activation_checkpointing(model, checkpointing: CheckpointingConfig, ds_config: dict) -> None:
    if not checkpointing.enabled:
        return
    model.activation_checkpointing_enable(every_n_layers=checkpointing.every_n_layers)
    if checkpointing.impl == "deepspeed":
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


def tensor_parallel_groups(layout: ParallelLayout):
    """AutoTP's process groups, made before deepspeed.initialize and handed to it as `mpu`:
    without them DeepSpeed checks train_batch_size against the whole world, counting each
    tensor-parallel rank as a data-parallel one. DeepSpeed's mesh puts the tensor-parallel ranks
    innermost (consecutive), as the layout does."""
    if layout.tp <= 1:
        return None
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=layout.tp)
    return groups


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


def build(config: TrainConfig, layout: ParallelLayout, ds_config: dict) -> DeepSpeedEngine:
    zero3 = None
    if config.model.zero_init and ds_config.get("zero_optimization", {}).get("stage") == 3:
        # While this object lives, transformers builds (and loads) the model under
        # deepspeed.zero.Init: each rank materializes only its partition. Random init then
        # draws in another order, so the weights differ from a run of another stage.
        zero3 = HfDeepSpeedConfig(ds_config)
    tiles = config.trainer.loss_tiles
    own_loss = tiles > 1 or layout.sp > 1
    model = build_model(config.model, loss_tiles=tiles if own_loss else None, expert_parallel_size=layout.ep)
    enable_activation_checkpointing(model, config.checkpointing, ds_config)
    fetch_blocks_whole(model, ds_config)
    compile_muon = compile_muon_choice(config.optimizer.compile)
    if layout.sp > 1:
        documents = not config.data.cross_document_attention
        mpu = register(model, layout.sp, ds_config["train_micro_batch_size_per_gpu"], documents)
        engine = DeepSpeedEngine(initialize(model, ds_config, mpu=mpu, compile_muon=compile_muon), layout, Slicer(mpu))
    else:
        mpu = tensor_parallel_groups(layout)
        engine = DeepSpeedEngine(initialize(model, ds_config, mpu=mpu, compile_muon=compile_muon), layout)
        count_every_shard_in_the_norm(engine.ds)
    if config.trainer.compile:
        isolate_compile_cache()
        # in place: parameter names, hence checkpoints, are unchanged
        engine.ds.compile(backend=str(config.trainer.compile_backend))
    engine.zero3_hf_config = zero3  # keep alive for the engine's lifetime
    return engine
