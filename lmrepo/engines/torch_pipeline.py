"""PyTorch's own pipeline schedules (torch.distributed.pipelining: ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, and the zero-bubble family ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV) as an lmrepo Engine, so that the loop and checkpointing
drive `pipeline=gpipe | 1f1b_torch | interleaved | interleaved_zb | zbv | dualpipev` exactly as
they drive `pipeline=1f1b`, and one sweep compares the schedules on one model.

What DeepSpeed's engine would do around the schedule is done here, with DeepSpeed's own parts
wherever they exist, so both paths train the same model the same way:
- ranks: DeepSpeed's PipelineParallelGrid (pipe-major: stage s, replica d = rank s * dp + d);
- the split: DeepSpeed's partition helpers over the same layer list (`partition`) into
  stages x virtual_stages chunks, placed as the schedule needs (`placement`): looped, chunk c on
  pipeline rank c % stages, or a V for ZB-V and DualPipeV (rank r: chunks r and 2 stages - 1 - r,
  so the first and the last chunk, and with them both copies of a tied embedding, share rank 0);
- the step: gradients averaged over the micro-batches (each parameter once) and the
  data-parallel replicas, the tied embedding's gradient summed between its first- and
  last-stage copies, the global gradient norm clipped (the tied weight counted once, as in
  the unsplit model), torch's fused AdamW / Adam with lmrepo's parameter groups, DeepSpeed's LR scheduler class;
- precision: fp32, or bf16 as torch.autocast (fp32 weights, gradients and optimizer state;
  matmuls in bf16). DeepSpeed's bf16 keeps bf16 weights with fp32 masters instead: the two agree
  to bf16 rounding, not bit for bit;
- checkpoints: DeepSpeed's pipeline layout (layer_NN-model_states.pt per layer, NN the layer index, the client state
  in mp_rank_00_model_states.pt) plus layer_NN-optim_states.pt per layer: whole tensors by name, which
  any split loads (lmrepo.engines.layer_files).

engine=fsdp2 shards each stage over its data-parallel ranks (a pipeline x data mesh, or pipeline x
replicate x shard: HSDP), torchtitan's way: in each transformer block of a stage, with tp=auto, the
linears of transformers' plan split over the tensor-parallel ranks (pipeline x data x tensor), then
each block, then each chunk, fully_shard'ed (zero=stage3: parameters resharded after each
micro-batch's forward; stage2: kept gathered). torch's PipelineStage holds FSDP's gradient
reduce-scatter back to the last micro-batch's backward. The gradients are then DTensor shards,
averaged over the data-parallel ranks by FSDP; the steps above run on them, the norm made whole
over every mesh dimension before the stages' are summed. Checkpoints keep the same files, with
whole tensors (gathered on save, sliced again on load), so a run resumes on another data-parallel
or tensor-parallel size. bf16 stays torch.autocast over fp32 weights, as without
FSDP2 (no MixedPrecisionPolicy), so the two agree within fp32 rounding.

DeepSpeed's ZeRO, offload and fp16 are not supported (the rules table refuses them up front).
"""

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
)
from deepspeed.runtime.utils import partition_balanced, partition_uniform
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from lmrepo.config import OffloadTarget, OptimizerConfig, PipelineConfig, TrainConfig
from lmrepo.config.parallel import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from lmrepo.distributed.device import isolate_compile_cache
from lmrepo.distributed.grad_norm import by_mesh, divide_gradients, float64_norm, global_grad_norm
from lmrepo.distributed.layout import ParallelLayout
from lmrepo.distributed.sequence_parallel import Slicer, ulysses
from lmrepo.distributed.tp import parallelize_block
from lmrepo.engines.base import pipeline_inputs
from lmrepo.engines.layer_files import (
    CLIENT_KEYS,
    load_layer,
    load_optimizer_states,
    local,
    optimizer_file,
    optimizer_states,
    sliced_like,
    weights_file,
    whole,
)
from lmrepo.engines.pipeline_timeline import Timeline, watch_torch_stages
from lmrepo.engines.recompute import enable_activation_checkpointing
from lmrepo.models import build_model, pipe, transformer_blocks
from lmrepo.models.mixtral import balance_layers, layers_record
from lmrepo.models.pipe import is_moe_spec, is_tied_copy
from lmrepo.optim.optimizer import param_groups, torch_optimizer
from lmrepo.optim.schedules import build_scheduler
from lmrepo.utils import safe_load

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b_torch": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


# --- the split -----------------------------------------------------------------------------


def partition(layers: list, parts: int, method: str) -> list[int]:
    """Chunk boundaries (parts + 1 layer indices), computed as PipelineModule._partition_layers
    does, with its own layer weights, so a torch pipeline splits the model where DeepSpeed's would."""
    method = method.lower()
    specs = SimpleNamespace(_layer_specs=layers)
    if method == "uniform":
        return partition_uniform(num_items=len(layers), num_parts=parts)
    if method == "parameters":
        weights = PipelineModule._count_layer_params(specs)
    else:  # type:<regex>; the config's checks refused anything else
        weights = [0] * len(layers)
        for index in PipelineModule._find_layer_type(specs, method.split(":", 1)[1]):
            weights[index] = 1
    return partition_balanced(weights=weights, num_parts=parts)


def placement(schedule: str, stages: int, virtual: int) -> list[int]:
    """The pipeline rank of each chunk: a V for ZB-V and DualPipeV (chunks 0..stages-1 down the
    ranks, then back up: torch's generate_stage_to_rank_mapping(style="v")), else looped."""
    chunks = range(stages * virtual)
    if schedule in V_SCHEDULES:
        return [c if c < stages else 2 * stages - 1 - c for c in chunks]
    return [c % stages for c in chunks]


def tied_owner(layers: list, index: int) -> int:
    """The layer whose parameters layer `index` holds: its key's first layer for a tied copy."""
    if not is_tied_copy(layers[index]):
        return index
    return next(i for i, spec in enumerate(layers) if getattr(spec, "key", None) == layers[index].key)


class TiedForward(nn.Module):
    def __init__(self, module: nn.Module, forward_fn):
        super().__init__()
        self.module, self.forward_fn = module, forward_fn

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.forward_fn(self.module, hidden)


class Chunk(nn.Module):
    """Consecutive pipeline layers: one torch pipeline stage."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({str(index): layer for index, layer in layers.items()})
        self.applied_by_loss: set[str] = set()  # the LM head, where the tiled loss calls it

    def forward(self, *inputs):
        # several inputs: (hidden states, position ids) of packed documents (lmrepo.models.pipe)
        hidden = inputs[0] if len(inputs) == 1 else inputs
        for index, layer in self.layers.items():
            if index not in self.applied_by_loss:
                hidden = layer(hidden)
        return hidden


def build_layer(spec) -> nn.Module:
    module = spec.build()
    return TiedForward(module, spec.forward_fn) if is_tied_copy(spec) else module


def print_split(layers: list, parts: list[int], ranks: list[int], schedule: str, micro_batches: int) -> None:
    """What DeepSpeed prints for its pipeline, plus the pipeline rank of each chunk."""
    print(
        f"torch.distributed.pipelining {SCHEDULES[schedule].__name__}: {len(parts) - 1} stages on "
        f"{max(ranks) + 1} pipeline ranks, {micro_batches} micro-batches per step"
    )
    for chunk in range(len(parts) - 1):
        start, stop = parts[chunk], parts[chunk + 1]
        print(f"stage={chunk} rank={ranks[chunk]} layers={stop - start}")
        for index in range(start, stop):
            print(f"    {index:2d}: {layers[index].typename.__name__}")


# --- FSDP2 over each stage (engine=fsdp2) ----------------------------------------------------


@dataclass(frozen=True)
class StageSharding:
    """How engine=fsdp2 shards the stages: over `mesh` (the data-parallel ranks of a stage, or its
    replicate x shard mesh), each module of `blocks` (transformer blocks) an FSDP unit of its own,
    with tensor parallelism first where `tp_mesh` is given (`tp_plan`: lmrepo.distributed.tp.block_tp_plan)."""

    mesh: DeviceMesh
    reshard_after_forward: bool
    blocks: frozenset
    tp_mesh: DeviceMesh | None = None
    tp_plan: dict | None = None
    offload: bool = False  # offload=cpu: the shards, their gradients and optimizer states in CPU memory
    # sequence parallelism: `mesh` holds the data x sequence ranks, whose gradients are summed over
    # the sequence ranks and divided by the data-parallel ones (this many)
    divide_by: int | None = None


def shard_chunks(chunks: nn.ModuleList, sharding: StageSharding, head: nn.Module | None = None) -> list[nn.Parameter]:
    """fully_shard each block of this rank's chunks, then each chunk (its embeddings, norms, head).
    A parameter two chunks of this rank share (a V placement's tied embedding: the first and the
    last chunk) stays whole, ignored by FSDP (one parameter cannot belong to two FSDP units): it is
    returned, its gradient averaged over the data-parallel ranks as without FSDP2. `head`: the LM
    head layer the tiled loss calls outside its chunk's forward, a unit of its own (its call
    gathers its weight)."""
    owners: dict[int, int] = {}
    for chunk in chunks:
        for param in chunk.parameters():
            owners[id(param)] = owners.get(id(param), 0) + 1
    shared = [p for p in chunks.parameters() if owners[id(p)] > 1]
    policy = {
        "mesh": sharding.mesh,
        "reshard_after_forward": sharding.reshard_after_forward,
        "ignored_params": set(shared),
        # as engine=fsdp2 offloads without a pipeline (a weight two chunks share stays whole, on the device)
        "offload_policy": CPUOffloadPolicy(pin_memory=sharding.mesh.device_type == "cuda")
        if sharding.offload
        else OffloadPolicy(),
    }
    units = []
    for chunk in chunks:
        for module in chunk.modules():
            if module in sharding.blocks:
                if sharding.tp_mesh is not None:
                    parallelize_block(module, sharding.tp_mesh, sharding.tp_plan)
                units.append(module)
            elif module is head:
                units.append(module)
        units.append(chunk)
    for unit in units:
        fully_shard(unit, **policy)
        if sharding.divide_by is not None:  # as lmrepo.engines.fsdp2.parallelize does under sequence parallelism
            divide_gradients(unit, sharding.divide_by, sharding.mesh)
    return shared


def rank_chunks(layers: list, parts: list[int], placement: list[int], stage: int) -> tuple[list[int], nn.ModuleList]:
    """(the indices, the modules) of the chunks pipeline rank `stage` runs: the layers between
    `parts`' bounds of each chunk `placement` gives it."""
    chunk_ids = [c for c, rank in enumerate(placement) if rank == stage]
    chunks = nn.ModuleList(Chunk({i: build_layer(layers[i]) for i in range(parts[c], parts[c + 1])}) for c in chunk_ids)
    return chunk_ids, chunks


def stage_sharding(net: nn.Module, config: TrainConfig, layout: ParallelLayout, mesh: DeviceMesh) -> StageSharding:
    """How engine=fsdp2 shards the stages of `net`'s pipeline on `layout`'s `mesh`."""
    from lmrepo.distributed.tp import block_tp_plan

    return StageSharding(
        layout.shard_mesh(mesh),
        config.zero.stage == 3,
        frozenset(transformer_blocks(net)),
        mesh["tp"] if layout.tp > 1 else None,
        block_tp_plan(net) if layout.tp > 1 else None,
        config.offload.target == OffloadTarget.cpu,
        layout.dp if layout.sp > 1 else None,
    )


# --- the engine ----------------------------------------------------------------------------


def non_reentrant_checkpointing(model: nn.Module) -> None:
    """torch's stages take input gradients with torch.autograd.grad, which DeepSpeed's checkpoint
    functions (checkpointing.impl=deepspeed) refuse ("Checkpointing is not compatible with .grad()"):
    those blocks recompute with torch's non-reentrant checkpoint instead, as impl=torch does. The
    same recomputation: DeepSpeed's ZeRO-R options partition activations across tensor-parallel
    ranks, and a pipeline here has none."""
    for module in model.modules():
        if getattr(module, "_gradient_checkpointing_func", None) is deepspeed.checkpointing.checkpoint:
            module._gradient_checkpointing_func = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


class TorchPipelineEngine:
    """lmrepo's Engine over a torch.distributed.pipelining schedule, with DeepSpeed's grid,
    partitioning and checkpoint layout."""

    background_save = False

    def __init__(
        self,
        layers: list,
        loss,
        pipeline: PipelineConfig,
        optimizer: OptimizerConfig,
        scheduler: dict,
        grad_clip: float,
        micro_batches: int,
        bf16: bool,
        layout: ParallelLayout,
        sharding: StageSharding | None = None,
        moe: dict | None = None,
        loss_tiles: int = 1,
        slicer: Slicer | None = None,
    ):
        self.device = torch.device(get_accelerator().current_device_name())
        self.stages, virtual = layout.pp, pipeline.virtual_stages
        # DeepSpeed's grid for its groups: pipe-major, tensor-parallel ranks innermost, as the layout numbers them
        # (sequence-parallel ranks, innermost without tensor parallelism, count among its "data" ranks:
        # they hold copies of the stage, as data-parallel ranks do)
        self.replicas = layout.dp * layout.sp  # the ranks of a stage that hold the same parameters (per tp rank)
        topology = (
            PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.dp)
            if layout.tp > 1
            else PipeDataParallelTopology(num_pp=layout.pp, num_dp=self.replicas)
        )
        self.grid = PipelineParallelGrid(topology)
        self.tp = layout.tp
        self.slicer = slicer
        # the one rank of a stage that writes its files: the first replica's (first tensor-parallel rank's)
        self.writer = self.grid.get_data_parallel_rank() == 0 and layout.coordinates(dist.get_rank())["tp"] == 0
        self.stage_id, self.dp = layout.stage(dist.get_rank()), layout.dp
        self.dp_rank, self.dp_size = layout.dp_rank(dist.get_rank()), layout.dp
        self.micro_batches = micro_batches
        self.loss, self.layer_specs = loss, layers
        # plain ints: DeepSpeed's partition gives numpy ints, which a weights-only load refuses
        self.parts = [int(p) for p in partition(layers, self.stages * virtual, pipeline.partition_method)]
        self.placement = placement(pipeline.schedule, self.stages, virtual)
        if dist.get_rank() == 0:
            print_split(layers, self.parts, self.placement, pipeline.schedule, self.micro_batches)
            names = [getattr(spec, "typename", type(spec)).__name__ for spec in layers]
            if (note := pipe.balance_note(names, self.parts, pipeline.partition)) is not None:
                print(note, flush=True)

        self.chunk_ids, self.chunks = rank_chunks(layers, self.parts, self.placement, self.stage_id)
        self.chunks.to(self.device)
        self.layers = {int(i): layer for chunk in self.chunks for i, layer in chunk.layers.items()}
        non_reentrant_checkpointing(self.chunks)
        # trainer.loss_tiles: the last stage ends at the final norm; the loss applies the head by tiles
        head = self.layers.get(len(layers) - 1) if loss_tiles > 1 else None
        if head is not None:
            next(c for c in self.chunks if head in c.layers.values()).applied_by_loss.add(str(len(layers) - 1))
            self.loss = pipe.TiledLMLoss(head, loss_tiles)
        if slicer is not None:  # a slice of each sequence: its share of the whole sequences' loss
            self.loss = pipe.SequenceSliceLoss(head, loss_tiles)
        self.sharding = sharding
        # parameters every data-parallel rank holds whole: all of them without FSDP2
        self.whole_params = shard_chunks(self.chunks, sharding, head) if sharding else list(self.chunks.parameters())
        if sharding and dist.get_rank() == 0:
            split = f", each block split over {layout.tp} tensor-parallel ranks" if layout.tp > 1 else ""
            print(f"FSDP2: each stage fully_shard'ed over its {self.dp} data-parallel ranks{split}", flush=True)
        self.schedule, stages = self._schedule(SCHEDULES[pipeline.schedule], self.micro_batches)
        self.timeline = Timeline()  # this rank's actions of the last training step
        watch_torch_stages(self.timeline, self.schedule, stages)
        self.last_bubble: float | None = None
        self.eval_schedules = {}  # micro-batch count -> a forward-only schedule over stages of its own
        self.v_placement, self.eval_kind = self._evaluation(pipeline.schedule)
        self.tied = self._tied_groups()
        self.moe_settings = moe or {}  # a mixture of experts' keys (its transformers config's `moe`)
        self.moe_rows, self.moe_layers = self._moe_layers()
        self.optimizer = torch_optimizer(param_groups(self.chunks, optimizer.weight_decay), optimizer, self.chunks)
        # The scheduler of the section lmrepo builds for DeepSpeed's engines (DeepSpeed's class, or lmrepo's WSD).
        self.lr_scheduler = build_scheduler(self.optimizer, scheduler)
        self.gradient_clipping, self.bf16 = grad_clip, bf16
        self.global_steps = 0
        self.last_grad_norm: float | None = None

    # --- pieces of __init__

    def _evaluation(self, schedule: str) -> tuple[bool, type]:
        """(whether evaluation runs with the backward, the schedule it runs). Any schedule of the
        same placement will do, run forward only: LoopedBFS takes any micro-batch count. A V, or
        two chunks of one stage on one rank (pipeline.stages=1), runs ZB-V's schedule with its
        backward (its gradients dropped: the next step zeroes them): torch's runtime hands a turn
        from chunk p-1 to p on the same rank through the backward, and refuses a forward-only
        schedule there ("can't steal_bwd_input if this stage doesn't have backward")."""
        if schedule in V_SCHEDULES or self.placement == [0, 0]:
            return True, ScheduleZBVZeroBubble
        return False, ScheduleGPipe if len(self.chunk_ids) == 1 else ScheduleLoopedBFS

    def _moe_layers(self) -> tuple[dict[int, int], dict[int, nn.Module]]:
        """A mixture of experts: (each MoE layer's row among the whole model's, by its layer index:
        every stage numbers them alike; this rank's MoE MLPs by their row)."""
        indices = [i for i, spec in enumerate(self.layer_specs) if is_moe_spec(spec)]
        rows = {index: row for row, index in enumerate(indices)}
        return rows, {rows[i]: layer.layer.mlp for i, layer in self.layers.items() if i in rows}

    def _schedule(self, schedule_class, micro_batches: int) -> tuple:
        """(the schedule over this rank's chunks, their PipelineStages)."""
        stages = [
            PipelineStage(chunk, c, len(self.parts) - 1, self.device, group=self.grid.pp_proc_group)
            for c, chunk in zip(self.chunk_ids, self.chunks)
        ]
        # scale_grads=False: the schedule would divide each stage's gradients by the micro-batch count,
        # twice for a parameter two stages of one rank share (a V's tied embedding); _scale_gradients
        # divides each parameter once.
        one_stage = schedule_class in (ScheduleGPipe, Schedule1F1B)
        schedule = schedule_class(
            stages[0] if one_stage else stages, n_microbatches=micro_batches, loss_fn=self.loss, scale_grads=False
        )
        return schedule, stages

    def _tied_groups(self) -> list[tuple]:
        """(process group, this rank's tied parameter, counted in the norm here) for each tied
        weight this rank holds; every rank creates every group, in the same order (new_group needs that)."""
        keys = sorted({spec.key for spec in self.layer_specs if hasattr(spec, "key")})
        tied = []
        for key in keys:
            indices = [i for i, spec in enumerate(self.layer_specs) if getattr(spec, "key", None) == key]
            holders = sorted({self.placement[self._chunk_of(i)] for i in indices})
            if len(holders) < 2:
                continue  # one rank holds every copy: they are one parameter
            for replica, t in [(d, t) for d in range(self.replicas) for t in range(self.tp)]:
                model = {"model": t} if self.tp > 1 else {}
                ranks = [self.grid.topology().get_rank(pipe=s, data=replica, **model) for s in holders]
                group = dist.new_group(ranks=ranks)
                if dist.get_rank() in ranks:
                    index = next(i for i in indices if i in self.layers)
                    module = self.layers[index].module if is_tied_copy(self.layer_specs[index]) else self.layers[index]
                    owner = self.placement[self._chunk_of(indices[0])] == self.stage_id
                    tied += [
                        (group, PipelineModule._recursive_getattr(module, attr), owner)
                        for attr in self.layer_specs[index].tied_weight_attr
                    ]
        return tied

    def _chunk_of(self, index: int) -> int:
        return next(c for c in range(len(self.parts) - 1) if self.parts[c] <= index < self.parts[c + 1])

    # --- what the loop calls

    def train(self):
        self.chunks.train()

    def eval(self):
        self.chunks.eval()

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step_record(self) -> dict:
        record = {"grad_norm": self.last_grad_norm} if self.last_grad_norm is not None else {}
        if self.moe_rows:
            record |= self._moe_record()
        return record | ({"bubble": self.last_bubble} if self.last_bubble is not None else {})

    def train_step(self, batches: list[dict]) -> torch.Tensor:
        return self.train_batch(self._inputs(batches))

    def eval_loss(self, batches: list[dict]) -> torch.Tensor:
        self.eval()
        loss = self.eval_batch(self._inputs(batches), num_micro_batches=len(batches))
        self.train()
        return loss

    def _inputs(self, batches: list[dict]):
        """The micro batches' (first stage's inputs, last stage's target); under sequence
        parallelism this rank's slice of each: its input ids and position ids, its shifted labels
        with the whole micro batch's scored-token count (pipe.SequenceSliceLoss)."""
        if self.slicer is None:
            return pipeline_inputs(batches)
        sliced = [self.slicer(batch) for batch in batches]
        target = pipe.SequenceSliceLoss.target
        return iter(
            [((s["input_ids"], s["position_ids"]), target(s["shift_labels"], s["scored_tokens"])) for s in sliced]
        )

    def _run(self, schedule, data_iter, micro_batches: int, train: bool, backward: bool | None = None) -> torch.Tensor:
        """One pass of `schedule` over `micro_batches` (inputs, labels) pairs, with the backward when
        training (or asked to); the mean loss of the micro-batches on the last stage, averaged over
        the replicas and sent to every stage."""
        pairs = [next(data_iter) for _ in range(micro_batches)]
        # inputs: input ids, or (input ids, position ids) of packed documents, as separate arguments
        inputs = [p[0] if isinstance(p[0], tuple) else (p[0],) for p in pairs]
        inputs = tuple(torch.cat(part).to(self.device) for part in zip(*inputs))
        labels = torch.cat([p[1] for p in pairs]).to(self.device)
        first, last = 0 in self.chunk_ids, len(self.parts) - 2 in self.chunk_ids
        args = inputs if first else ()
        losses = []
        if train:
            self.timeline.begin_step()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            run = schedule.step if (train if backward is None else backward) else schedule.eval
            run(*args, target=labels if last else None, losses=losses if last else None, return_outputs=False)
        if train:
            self.timeline.end_step()
        loss = torch.stack(losses).detach().float().mean() if last else torch.zeros((), device=self.device)
        if last and self.replicas > 1:  # the sequence-parallel ranks' shares summed, the replicas' averaged
            dist.all_reduce(loss, group=self.grid.get_data_parallel_group())
            loss /= self.dp
        src = self.grid.stage_to_global(self.placement[-1])  # the rank of the last chunk
        dist.broadcast(loss, src=src, group=self.grid.pp_proc_group)
        return loss

    def train_batch(self, data_iter) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._run(self.schedule, data_iter, self.micro_batches, train=True)  # grads: sum over micro-batches
        if self.moe_rows:
            terms = self._moe_forwards()
            loss = loss + self._moe_aux(terms)
        self._measure_bubble()
        self._scale_gradients()  # the mean over micro-batches
        self._reduce_gradients()
        self._clip_gradients(self.gradient_clipping)
        self.optimizer.step()
        self.lr_scheduler.step()
        if self.moe_rows and self.moe_settings["balance"] == "aux_free":
            moe, loads = self.moe_settings, {row: load for row, (_, load) in terms.items()}
            rows, experts, rate = len(self.moe_rows), moe["experts"], moe["bias_update_rate"]
            balance_layers(self.moe_layers, rows, experts, rate, self.device, step_loads=loads)
        self.global_steps += 1
        return loss

    # --- a mixture of experts in the stages

    def _moe_forwards(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's MoE layers' (load-balancing term, routes) of the step, summed over its
        micro-batches, by row: the last micro-batch count of their forwards (a stage's first step
        runs one forward more, torch's shape inference, on uninitialised inputs)."""
        terms = {}
        for row, mlp in self.moe_layers.items():
            forwards = mlp.pipeline_forwards[-self.micro_batches :]
            terms[row] = (sum(a.double() for a, _ in forwards), sum(r for _, r in forwards))
            mlp.pipeline_forwards.clear()
            mlp.step_load.zero_()  # MoEMLP's own count holds the shape inference's and recomputes' routes
        return terms

    def _moe_aux(self, terms: dict) -> torch.Tensor:
        """The step's load-balancing terms, as the loss without a pipeline holds them: each MoE
        layer's (aux_loss_coef x its loss) averaged over the micro-batches, summed over the stages,
        averaged over the replicas (a tensor-parallel group's ranks hold the same)."""
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for aux, _ in terms.values():
            local += aux
        dist.all_reduce(local)
        return (local / (self.micro_batches * self.dp * self.tp)).float()

    def _moe_record(self) -> dict:
        """The metrics-line figures of a mixture of experts for the last micro-batch, from every
        stage's layers (lmrepo.models.mixtral.layers_record): each layer held by a replica's
        data x tensor ranks, whose tensor-parallel groups route the same tokens."""
        rows = len(self.moe_rows)
        return layers_record(self.moe_layers, rows, self.moe_settings, self.device, None, self.dp * self.tp, self.tp)

    def eval_batch(self, data_iter, num_micro_batches: int) -> torch.Tensor:
        if num_micro_batches not in self.eval_schedules:
            # Stages of its own: a stage's buffers are sized for one schedule's micro-batch count.
            self.eval_schedules[num_micro_batches] = self._schedule(self.eval_kind, num_micro_batches)[0]
        schedule = self.eval_schedules[num_micro_batches]
        if self.v_placement:
            return self._run(schedule, data_iter, num_micro_batches, train=False, backward=True)
        with torch.no_grad():
            return self._run(schedule, data_iter, num_micro_batches, train=False)

    # --- the step's collectives

    def _measure_bubble(self) -> None:
        """The step's bubble, averaged over the pipeline ranks: the fraction of the schedule's wall
        time each spent in none of its forward and backward actions."""
        bubble = torch.tensor([self.timeline.bubble()], device=self.device)
        dist.all_reduce(bubble, group=self.grid.pp_proc_group)
        self.last_bubble = bubble.item() / self.stages

    def _gradients(self) -> list[torch.Tensor]:
        """This rank's gradients: the shards of them under FSDP2 (in place, they change the DTensors)."""
        return [local(p.grad) for p in self.chunks.parameters() if p.grad is not None]

    def _scale_gradients(self) -> None:
        """The micro-batch losses are means: the step's gradient is the mean of theirs (div_, as the
        schedule's own scale_grads, so the same rounding)."""
        for grad in self._gradients():
            grad.div_(self.micro_batches)

    def _reduce_gradients(self) -> None:
        # The first and last stage hold copies of the tied embedding: each copy gets the sum of
        # both gradients (the gradient of the one matrix of the unsplit model).
        # Under FSDP2 the copies' shards: the ranks of a tied group share a data-parallel index, so the same slice.
        for group, param, _ in self.tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local(param.grad), group=group)
        # FSDP2 has averaged its shards over the data-parallel ranks; the whole tensors are averaged
        # here (under sequence parallelism, summed over the sequence ranks too: their losses are shares)
        grads = [p.grad for p in self.whole_params if p.grad is not None]
        if self.replicas > 1 and grads:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.grid.get_data_parallel_group())
            flat /= self.dp
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)

    def _clip_gradients(self, max_norm: float) -> None:
        """The global norm over the whole model (every stage), each tied matrix counted once; the
        coefficient of torch's and DeepSpeed's clip_grad_norm_."""
        copies = {id(param) for _, param, owner in self.tied if not owner}
        counted = [p for p in self.chunks.parameters() if p.grad is not None and id(p) not in copies]
        total = self._squares([p.grad for p in counted if not isinstance(p.grad, DTensor)])
        sharded = [p for p in counted if isinstance(p.grad, DTensor)]
        if sharded:  # FSDP2's (and tensor parallelism's) shards, made whole over every mesh dimension
            total = total + global_grad_norm(by_mesh(sharded)).pow(2)
        dist.all_reduce(total, group=self.grid.pp_proc_group)
        self.last_grad_norm = total.sqrt().item()
        if max_norm <= 0:  # 0: clipping off, the norm still logged
            return
        coefficient = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)
        for grad in self._gradients():
            grad.mul_(coefficient)

    def _squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the squares of `grads`' elements, in float64 (global_grad_norm says why)."""
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return float64_norm(grads).square()

    # --- checkpoints (DeepSpeed's pipeline layout, lmrepo.engines.layer_files)

    def _saved_layers(self):
        """(global index, module) of each layer this rank writes: not the tied copies."""
        return [(i, layer) for i, layer in self.layers.items() if not is_tied_copy(self.layer_specs[i])]

    def save(self, save_dir: Path, tag: str, client_state: dict) -> None:
        directory = Path(save_dir, str(tag))
        directory.mkdir(parents=True, exist_ok=True)
        if dist.get_rank() == 0:
            torch.save(
                {
                    "module": None,
                    "global_steps": self.global_steps,
                    "dp_world_size": self.dp,
                    "mp_world_size": self.stages,
                    "tp_world_size": self.tp,
                    "torch_pipeline_parts": self.parts,
                    "lr_scheduler": self.lr_scheduler.state_dict(),  # one schedule: every stage's is equal
                    **client_state,
                },
                directory / "mp_rank_00_model_states.pt",
            )
        # The replicas hold the same weights and states: the first writes them. Under FSDP2 every
        # rank of the stage gathers its shards into whole tensors (collectives), the first writes them.
        for index, layer in self._saved_layers():
            if self.writer or self.sharding is not None:
                weights = whole(layer.state_dict())
                states = optimizer_states(list(layer.named_parameters()), self.optimizer)
                if self.writer:
                    torch.save(weights, weights_file(directory, index))
                    torch.save(states, optimizer_file(directory, index))
        dist.barrier()

    def optimizer_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def finish_save(self) -> None:
        pass  # save() returns with the files written

    def load(self, load_dir: Path, tag: str) -> dict:
        """Any split's checkpoint: each layer's weights and optimizer states by name, sliced as this
        rank holds them. A tied copy (the LM head of tied embeddings on the last stage) reads its
        owner's files."""
        directory = Path(load_dir, str(tag))
        states = safe_load.load(directory / "mp_rank_00_model_states.pt")  # an older format: refused by inspect
        saved_states = []
        for index, layer in self.layers.items():
            owner = tied_owner(self.layer_specs, index)
            target = layer.module if is_tied_copy(self.layer_specs[index]) else layer
            weights, optimizer = load_layer(directory, owner, self.device)
            mine = target.state_dict()
            target.load_state_dict({k: sliced_like(v, mine[k]) if k in mine else v for k, v in weights.items()})
            saved_states += [(param, optimizer[name]) for name, param in target.named_parameters()]
        load_optimizer_states(self.optimizer, saved_states)
        self.lr_scheduler.load_state_dict(states["lr_scheduler"])
        self.global_steps = states["global_steps"]
        return {k: v for k, v in states.items() if k not in CLIENT_KEYS}


def build(config: TrainConfig, layout: ParallelLayout, ds_config: dict) -> TorchPipelineEngine:
    """The same layer list DeepSpeed's pipeline splits, from the same seeded transformers model."""
    from lmrepo.plan.ds_config import batch_of

    net = build_model(config.model)
    enable_activation_checkpointing(net, config.checkpointing, {})  # the blocks checkpoint themselves
    if config.trainer.compile:
        # each block, as engine=fsdp2 compiles them (and torchtitan a pipeline's): the stages' layers
        # hold these modules, so a rank compiles the blocks of its own chunks, at their first call
        # (after tensor parallelism and fully_shard have wrapped them)
        isolate_compile_cache()
        for block in transformer_blocks(net):
            block.compile(backend=str(config.trainer.compile_backend))
        if config.pipeline.schedule in ZERO_BUBBLE_SCHEDULES:
            # the zero-bubble schedules take a block's input gradients first (retaining its graph)
            # and its weight gradients later: a compiled backward that donates its saved buffers
            # refuses the first ("requires retain_graph=False"), so they are kept
            torch._functorch.config.donated_buffer = False
    # Ulysses in the stages' attention, as without a pipeline
    slicer = ulysses(net, config, ds_config["train_micro_batch_size_per_gpu"]) if layout.sp > 1 else None
    layers = pipe.pipeline_layers(net, config.model.family)
    loss = pipe.LMLoss(config.model.family, net.config.vocab_size)
    sharding = None
    if config.engine.name == "fsdp2":
        sharding = stage_sharding(net, config, layout, layout.mesh(get_accelerator().device_name()))
    return TorchPipelineEngine(
        layers,
        loss,
        config.pipeline,
        config.optimizer,
        ds_config["scheduler"],
        config.trainer.grad_clip,
        batch_of(ds_config)[2],
        config.precision.dtype == "bf16",
        layout,
        sharding,
        getattr(net.config, "moe", None),
        config.trainer.loss_tiles,
        slicer,
    )
