"""PyTorch FSDP2 as lmrepo's second engine: the same job as DeepSpeed's, sharded by
`torch.distributed.fsdp.fully_shard` (torchtitan's recipe: each transformer block is an FSDP unit,
then the root). What the groups mean here:

- zero=stage3: parameters resharded after forward (FULL_SHARD); zero=stage2: kept gathered from
  forward to backward (SHARD_GRAD_OP). Gradients and optimizer states are sharded in both.
- precision=bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32 sharded
  parameters, as DeepSpeed's bf16 keeps fp32 masters; fp32: no policy.
- offload=cpu: CPUOffloadPolicy (sharded parameters, gradients and optimizer states in CPU memory).
- tp=auto tp.size=N: tensor parallelism on a (data x tensor) mesh, torchtitan's order: in each
  block the linears of transformers' tensor-parallel plan split by torch's ColwiseParallel (q, k,
  v, gate, up) and RowwiseParallel (o, down) over the tp ranks, then the rest below, then
  fully_shard over the data-parallel ranks. With tp.sequence_parallel (on by default here) the
  norms and the residual stream between them are split by tokens (torch's SequenceParallel; o and
  down reduce-scatter to the tokens, attention and the MLP all-gather them); with
  tp.loss_parallel the LM head is split by vocabulary and the cross-entropy runs under torch's
  loss_parallel. Without them the embeddings, norms and the LM head stay whole on every rank of a
  tp group; the embeddings always do.
- expert_parallel.size=E (a mixture of experts): each group of E data-parallel shards splits every
  MoE layer's experts and trades tokens by all-to-all; each layer's experts are an FSDP unit
  sharded over the ranks that hold the same ones (shard_experts), named by their global index.
- sequence_parallel.size=N: DeepSpeed's Ulysses attention; FSDP2 shards over the data x sequence
  ranks, the gradients summed over each sequence group and averaged over the data ranks.
- checkpointing=full|every_n: the blocks recompute with torch.utils.checkpoint (non-reentrant).
- trainer.compile: each block torch.compile'd before it is sharded.
- optimizer, schedule, trainer.grad_clip: torch's fused Adam/AdamW with lmrepo's parameter groups,
  DeepSpeed's own LR scheduler classes (the `scheduler` section lmrepo builds), the global norm
  clipped over every shard of every mesh dimension.
- checkpoints: torch.distributed.checkpoint (DCP), one file per rank, resharded on load to any
  rank count; the client state in `mp_rank_00_model_states.pt` as DeepSpeed's engines write it.
The rest is refused before launch (lmrepo.config.fsdp2_check).
"""

import contextlib
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    loss_parallel,
)

from lmrepo.config import OffloadTarget, OptimizerConfig, TrainConfig
from lmrepo.distributed import tp
from lmrepo.distributed.device import isolate_compile_cache
from lmrepo.distributed.grad_norm import by_mesh, divide_gradients, global_grad_norm
from lmrepo.distributed.launch import host_group
from lmrepo.distributed.layout import ParallelLayout
from lmrepo.distributed.sequence_parallel import Slicer, ulysses
from lmrepo.distributed.tp import parallelize_blocks
from lmrepo.engines.base import to_device
from lmrepo.engines.layer_files import CLIENT_KEYS as PIPELINE_CLIENT_KEYS
from lmrepo.engines.layer_files import (
    by_model_name,
    has_layer_optimizer_states,
    load_optimizer_states,
    optimizer_file,
    sliced_like,
)
from lmrepo.engines.recompute import enable_activation_checkpointing
from lmrepo.models import build_model, causal_loss, pipe, transformer_blocks
from lmrepo.models.mixtral import balance_experts, moe_record, place_experts
from lmrepo.optim.optimizer import param_groups, torch_optimizer
from lmrepo.optim.schedules import build_scheduler
from lmrepo.utils import safe_load
from lmrepo.utils.errors import ConfigError

CLIENT_STATE_FILE = "mp_rank_00_model_states.pt"  # the name lmrepo.train.checkpoint finds a checkpoint by


class FSDP2Engine:
    """lmrepo's Engine over a fully_shard'ed transformers model."""

    background_save = True  # dcp.async_save

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerConfig,
        scheduler: dict,
        grad_clip: float,
        micro_batches: int,
        device: torch.device,
        layout: ParallelLayout,
        mesh: DeviceMesh,
        family: str,
        vocabulary_parallel: bool = False,
        slicer: Slicer | None = None,
    ):
        self.device, self.family, self.slicer = device, family, slicer
        # torch's loss_parallel computes the cross-entropy of vocabulary-split logits, in forward
        # and in backward (its ops are DTensor's, dispatched while the context is open)
        self.loss_context = loss_parallel if vocabulary_parallel else contextlib.nullcontext
        self.dp_rank, self.dp_size = layout.dp_rank(dist.get_rank()), layout.dp
        dp_mesh = layout.data_mesh(mesh)
        # The ranks that read different samples, for lm-eval to deal documents over (a tp group's
        # ranks score the same ones); None: every rank reads its own.
        split = layout.tp > 1 or layout.sp > 1
        self.data_group = (dp_mesh._flatten() if dp_mesh.ndim > 1 else dp_mesh).get_group() if split else None
        self.module = model  # parallelized (parallelize): every block and the root fully_shard'ed
        # expert parallelism: each rank of an ep group holds other experts, whose gradients' squares
        # the norm sums over that group too
        self.expert_params, self.ep_group = expert_parallel_params(model, layout)
        groups = param_groups(self.module, optimizer.weight_decay)
        self.optimizer = torch_optimizer(groups, optimizer, self.module)
        # The scheduler of the section lmrepo builds for DeepSpeed's engines (DeepSpeed's class, or lmrepo's WSD).
        self.lr_scheduler = build_scheduler(self.optimizer, scheduler)
        self.grad_clip, self.micro_batches = grad_clip, micro_batches
        self.last_grad_norm: torch.Tensor | None = None
        self.global_steps = 0
        # DCP writes a checkpoint in a background thread while training goes on; its collectives
        # need a process group of their own (on the default one, gloo's messages of the two
        # threads interleave: "Received data size doesn't match expected size").
        self.save_group = host_group()
        self.writing = None  # the Future of the save being written

    # --- what the loop calls

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step_record(self) -> dict:
        record = {"grad_norm": float(self.last_grad_norm)} if self.last_grad_norm is not None else {}
        # a mixture of experts' aux_loss and expert load, over the ranks that read different
        # samples (a tp group's ranks route the same tokens)
        record.update(moe_record(self.module, self.data_group))
        return record

    def train_step(self, batches: list[dict]) -> torch.Tensor:
        """As DeepSpeed does: each micro batch's loss divided by the accumulation steps, gradients
        averaged over the ranks (FSDP2's reduce-scatter), clipped on their global norm, one step."""
        losses = []
        for batch in batches:
            with self.loss_context():
                loss = self.module(**self._inputs(batch)).loss
                (loss / len(batches)).backward()
            losses.append(self._whole(loss).float())
        # The global norm before clipping, over every shard of every mesh dimension.
        params = [p for p in self.module.parameters() if p.grad is not None]
        groups = by_mesh([p for p in params if p not in self.expert_params])
        expert_groups = by_mesh([p for p in params if p in self.expert_params])
        norm = global_grad_norm(groups, expert_groups, self.ep_group)
        if self.grad_clip > 0:
            for params in groups + expert_groups:
                torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm)
        self.last_grad_norm = norm.detach()  # read back only when a metrics line asks for it
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        balance_experts(self.module, self.data_group)  # model.moe.balance=aux_free: the router biases
        self.global_steps += 1
        return torch.stack(losses).mean().to(self.device)

    @torch.no_grad()
    def eval_loss(self, batches: list[dict]) -> torch.Tensor:
        self.eval()
        with self.loss_context():
            losses = [self._whole(self.module(**self._inputs(batch)).loss).float() for batch in batches]
        mean = torch.stack(losses).mean()
        self.train()
        return mean

    def _inputs(self, batch: dict) -> dict:
        """The micro batch as this rank computes it: under sequence parallelism, its slice."""
        return to_device(self.slicer(batch) if self.slicer else batch, self.device)

    def _whole(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro batch's loss: under sequence parallelism, the sum of the group's shares."""
        return self.slicer.whole_loss(loss) if self.slicer else loss.detach()

    # --- checkpoints: DCP for the sharded states, a torch.save file for the rest

    def save(self, directory: Path, tag: str, client_state: dict) -> None:
        """Copies the sharded states to host memory, then writes them in the background: the next
        steps train meanwhile, and lmrepo.train.checkpoint records and names the checkpoint only after
        finish_save()."""
        self.finish_save()  # one save in flight
        tag_dir = Path(directory, str(tag))
        tag_dir.mkdir(parents=True, exist_ok=True)  # the writer thread may not have made it yet
        model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
        self.writing = dcp.async_save(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tag_dir, process_group=self.save_group
        )
        if dist.get_rank() == 0:
            states = {
                "module": None,
                "engine": "fsdp2",
                "global_steps": self.global_steps,
                "lr_scheduler": self.lr_scheduler.state_dict(),
                **client_state,
            }
            torch.save(states, tag_dir / CLIENT_STATE_FILE)
        dist.barrier()

    def optimizer_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def finish_save(self) -> None:
        if self.writing is not None:
            writing, self.writing = self.writing, None
            writing.result()  # a failed write raises here, where lmrepo.train.checkpoint handles it

    def load(self, directory: Path, tag: str) -> dict:
        tag_dir = Path(directory, str(tag))
        states = safe_load.load(tag_dir / CLIENT_STATE_FILE)
        if has_layer_optimizer_states(tag_dir):  # a pipeline's checkpoint (engine=fsdp2 with a torch pipeline)
            return self._load_pipeline_checkpoint(tag_dir, states)
        if states.get("engine") != "fsdp2":
            raise ConfigError(
                f"{tag_dir} was written by DeepSpeed's engine: resume it with engine=deepspeed, or export it "
                "(scripts/export_hf.py) and start engine=fsdp2 from model.pretrained"
            )
        # get_state_dict gives a fresh optimizer its (zero) states, so DCP has tensors to load into.
        model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, storage_reader=WeightsOnlyReader(tag_dir))
        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        self.lr_scheduler.load_state_dict(states["lr_scheduler"])
        self.global_steps = states["global_steps"]
        engine_keys = {"module", "engine", "global_steps", "lr_scheduler"}
        return {k: v for k, v in states.items() if k not in engine_keys}

    def _load_pipeline_checkpoint(self, tag_dir: Path, states: dict) -> dict:
        """A pipeline's layer files (lmrepo.engines.layer_files) into the whole model: each layer's
        names mapped to the model's, each tensor sliced as this rank holds it."""
        params = dict(self.module.named_parameters())
        names = pipe.hf_names(self.module, self.family)
        weights, saved_states = by_model_name(tag_dir, names), by_model_name(tag_dir, names, optimizer_file)
        if missing := sorted(set(params) - set(weights)):
            raise ConfigError(f"{tag_dir} has no weights for {', '.join(missing[:3])}: resume from another checkpoint")
        # every parameter (checked); the buffers are the model's own
        self.module.load_state_dict({n: sliced_like(weights[n], p) for n, p in params.items()}, strict=False)
        load_optimizer_states(self.optimizer, [(p, saved_states[n]) for n, p in params.items()])
        self.lr_scheduler.load_state_dict(states["lr_scheduler"])
        self.global_steps = states["global_steps"]
        return {k: v for k, v in states.items() if k not in PIPELINE_CLIENT_KEYS}


def expert_parallel_params(model: torch.nn.Module, layout: ParallelLayout) -> tuple[set, dist.ProcessGroup | None]:
    """(the experts' parameters, the expert-parallel group) of a model that parallelize split by
    expert parallelism (shard_experts); (empty, None) otherwise."""
    if layout.ep == 1:
        return set(), None
    layers = [mlp.moe.deepspeed_moe for mlp in model.moe_layers()]
    return {p for layer in layers for p in layer.experts.parameters()}, layers[0].ep_group


class WeightsOnlyReader(dcp.FileSystemReader):
    """DCP (torch 2.13) reads tensors weights-only but its `.metadata` file with plain pickle,
    which runs any code a crafted file holds: here the metadata's pickle may name DCP's metadata
    classes and torch's value types, and nothing else."""

    ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a layout: by its name
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),  # the checkpoint's own path, in StorageMeta
    }

    def read_metadata(self, *args, **kwargs):
        reader = self

        class Restricted(pickle.Unpickler):
            def find_class(self, module: str, name: str):
                if (module, name) in reader.ALLOWED or _torch_value(module, name):
                    return super().find_class(module, name)
                if module in reader.ALLOWED_MODULES:  # a class of DCP's own metadata, not a name it imports
                    found = super().find_class(module, name)
                    if isinstance(found, type) and found.__module__ == module:
                        return found
                raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed in DCP metadata")

        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = Restricted(f).load()
        except pickle.UnpicklingError as err:
            raise safe_load.refusal(path, err) from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_full_weights(tag_dir: Path, model: torch.nn.Module) -> dict:
    """The whole fp32 weights of an FSDP2 checkpoint, joined in this process (no process group):
    for export, evaluation and generation."""
    state = {"model": {k: v.float() for k, v in model.state_dict().items()}}
    dcp.load(state, storage_reader=WeightsOnlyReader(tag_dir), no_dist=True)
    return state["model"]


def _torch_value(module: str, name: str) -> bool:
    """torch's dtypes, layouts and memory formats: what TensorProperties pickles."""
    if module != "torch":
        return False
    value = getattr(torch, name, None)
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


def parallelize(
    model: torch.nn.Module, config: TrainConfig, layout: ParallelLayout, mesh: DeviceMesh, device: torch.device
) -> None:
    """The job's layout applied to `model` in place, in torchtitan's order: tensor parallelism,
    activation checkpointing, compile, then fully_shard of each block and of the root (the
    embeddings, the final norm, the head). FSDP shards over the data-parallel ranks; with replicas
    (HSDP) over the ranks of one replica, each shard replicated across the replicas (a 2-D mesh:
    fully_shard's replicate x shard). The ranks of a tp group each shard their own slices (and their
    copies of the rest) over them. The engine calls it on the real model; a plan of any size calls
    it on the meta device over torch's fake process group (lmrepo.estimate.planned_shards)."""
    vocabulary_parallel = layout.tp > 1 and tp.loss_parallel(config)
    if layout.tp > 1:
        parallelize_blocks(model, mesh["tp"], tp.sequence_parallel(config), vocabulary_parallel)
    enable_activation_checkpointing(model, config.checkpointing)
    if config.trainer.compile:
        isolate_compile_cache()
        for block in transformer_blocks(model):
            # in place: parameter names, hence checkpoints, are unchanged
            block.compile(backend=str(config.trainer.compile_backend))
    offload = config.offload.target == OffloadTarget.cpu
    policy = {
        "mesh": layout.shard_mesh(mesh),
        "reshard_after_forward": config.zero.stage == 3,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if config.precision.dtype == "bf16"
        else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy(),
    }
    if layout.ep > 1:
        shard_experts(model, layout, mesh, policy)
    for module in [*transformer_blocks(model), model]:
        fully_shard(module, **policy)
        if layout.sp > 1:
            # Each rank of a sequence-parallel group back-propagates its slice's share of the
            # sequence's loss: summed over the group, averaged over the data-parallel ranks
            divide_gradients(module, layout.dp, policy["mesh"])


def shard_experts(model: torch.nn.Module, layout: ParallelLayout, mesh: DeviceMesh, policy: dict) -> None:
    """Expert parallelism (expert_parallel.size > 1), torchtitan's arrangement: each group of ep
    data-parallel shards splits every MoE layer's experts and trades tokens by all-to-all, and each
    layer's experts are an FSDP unit of their own, sharded over the ranks that hold the same
    experts. A rank's expert gradients already sum what the tokens of its whole ep group gave
    them: reduced over those ranks, they are divided by every data-parallel rank, as the rest of
    the model's are averaged over them."""
    experts_mesh = layout.expert_mesh(mesh)
    data_mesh = layout.expert_data_mesh(experts_mesh)
    for experts in place_experts(model, experts_mesh["ep"].get_group()):
        fully_shard(experts, **{**policy, "mesh": data_mesh})
        divide_gradients(experts, layout.dp, data_mesh)


def build(config: TrainConfig, layout: ParallelLayout, ds_config: dict) -> FSDP2Engine:
    """The model built and seeded as DeepSpeed's engine builds it, then sharded, on the device
    DeepSpeed's accelerator names for this rank (the same the DeepSpeed engines run on)."""
    from deepspeed.accelerator import get_accelerator

    from lmrepo.plan.ds_config import batch_of

    device = torch.device(get_accelerator().current_device_name())
    mesh = layout.mesh(device.type)
    tiles = config.trainer.loss_tiles
    own_loss = tiles > 1 or layout.sp > 1  # lmrepo's loss: tiled, or a sequence slice's share
    ep_rank = layout.ep_rank(dist.get_rank())
    model = build_model(config.model, tiles if own_loss else None, layout.ep, ep_rank)
    slicer = ulysses(model, config, ds_config["train_micro_batch_size_per_gpu"]) if layout.sp > 1 else None
    vocabulary_parallel = layout.tp > 1 and tp.loss_parallel(config)
    if vocabulary_parallel and not own_loss:
        causal_loss.install(model, 1)  # lmrepo's loss: a plain loss from the split logits, which it never returns
    if config.offload.target != OffloadTarget.cpu:
        model.to(device)
    parallelize(model, config, layout, mesh, device)
    return FSDP2Engine(
        model,
        config.optimizer,
        ds_config["scheduler"],
        config.trainer.grad_clip,
        batch_of(ds_config)[2],
        device=device,
        layout=layout,
        mesh=mesh,
        family=config.model.family,
        vocabulary_parallel=vocabulary_parallel,
        slicer=slicer,
    )
