"""Pre-flight arithmetic: parameters, model-state and activation memory per rank, FLOPs, time to train.

Pure functions: no process group, no GPU. Sources:
- parameters: Narayanan et al. 2021, P = 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)),
  and the exact count of the transformers model train.py builds, made on the meta device;
- model states: ZeRO (Rajbhandari et al. 2020, Sec. 3 and Fig. 1), ZeRO-Offload
  (Ren et al. 2021) and ZeRO-Infinity (Rajbhandari et al. 2021);
- activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (its closed form: tensor parallel size 1, no sequence parallelism), and per layout the
  count of what the model's forward saves, on fake tensors (`counted_activations`);
- FLOPs and time: lmrepo.observability.metrics (the 72/96 forms of Narayanan et al. 2021) and its 8*T*P/(n*X).
"""

import contextlib
import math
from collections import Counter
from dataclasses import dataclass

import torch

from lmrepo.distributed import tp as tp_plans
from lmrepo.distributed.device import TORCH_DTYPES
from lmrepo.models import FAMILIES, causal_loss, hf_config, meta_model, pipe, transformer_blocks


def active_block_params(model_cfg) -> float | None:
    """The block parameters one token passes through (2 FLOPs each forward), for FLOPs and MFU:
    a mixture of experts' top_k experts, shared experts, router and attention; a Llama's matrices as built
    (grouped-query attention's narrower key/value projections, SwiGLU's three MLP matrices),
    counted on the meta model; None where GPT's 12*l*h^2 is exact (GPT-2, BERT)."""
    if model_cfg.family == "llama":
        blocks = meta_model(model_cfg).model.layers
        return float(sum(p.numel() for p in blocks.parameters() if p.dim() >= 2))
    if model_cfg.family != "mixtral":
        return None
    shape, moe = model_cfg.shape(), model_cfg.moe
    h, head = shape["n_embd"], shape["n_embd"] // shape["n_head"]
    attention = 2 * h * shape["n_head"] * head + 2 * h * shape["n_kv_head"] * head
    expert = 3 * h * model_cfg.n_inner
    from lmrepo.models.mixtral import is_moe_block

    routed = (moe.top_k + moe.shared_experts) * expert + h * moe.experts  # the shared MLP is shared_experts wide
    mlp = sum(routed if is_moe_block(i, moe.every) else expert for i in range(shape["n_layer"]))
    return shape["n_layer"] * attention + mlp


def count_parameters(model: torch.nn.Module) -> int:
    # parameters() yields a shared Parameter once, so the tied input/output embedding counts once
    # (DeepSpeed dedups by data_ptr(), which meta tensors do not have).
    return sum(p.numel() for p in model.parameters())


def largest_module_parameters(model: torch.nn.Module) -> int:
    """DeepSpeed's ZeRO-3 estimator's `largest_layer_params`: the most parameters one module owns
    directly, i.e. the most ZeRO-3 gathers at once (GPT-2's token embedding)."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def formula_parameters(n_layer: int, n_embd: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. 2021: each block has 12h^2 + 13h (QKV, projection and the 4h MLP with
    their biases, two layer norms), plus token and position embeddings (V+s)h. It leaves out
    GPT-2's final layer norm (2h) and BERT's token types, embedding norm and MLM head."""
    l, h = n_layer, n_embd
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states (parameters, gradients, optimizer states) held by one data-parallel rank."""

    gpu: float
    cpu: float
    nvme: float


def bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter with Adam: 16 in both cases.
    Mixed precision (ZeRO Sec. 3.1, K=12): 16-bit parameters 2 + gradients 2 + fp32 master copy,
    momentum and variance 12. fp32: 4 + 4 + 8 (the parameters can be their own master copy)."""
    return (4, 4, 8) if dtype == "fp32" else (2, 2, 12)


# An offloaded gradient partition is held in fp32 whatever the precision: DeepSpeed's CPU Adam
# reads fp32 gradients (stage_1_and_2.py keeps `single_partition_of_fp32_groups[i].grad` pinned
# in host memory; ZeRO-3 likewise).
OFFLOADED_GRAD_BYTES = 4


def model_state_bytes(
    params: int, stage: int, dp: int, offload: str = "none", offload_params: bool | None = None, dtype: str = "bf16"
) -> ModelStates:
    """Per-rank model states for ZeRO `stage` over `dp` data-parallel ranks (ZeRO Fig. 1): stage 0
    replicates everything; stage 1 partitions the optimizer states (/dp), stage 2 also the
    gradients, stage 3 also the parameters. Offload (ZeRO-Offload) moves the optimizer states and
    the gradient partition they update to the host (cpu) or the optimizer states to NVMe with the
    gradients in host memory (ZeRO-Infinity); at stage 3 the parameter partition goes too
    (`offload_params`, by default whenever offloading at stage 3, as the offload group does).
    Transient buffers (buckets, gathered layers, the step's fp32 gradient copy) are not counted."""
    if offload != "none" and stage == 0:
        raise ValueError("offload needs ZeRO stage >= 1")
    if offload == "nvme" and stage != 3:
        raise ValueError("NVMe offload needs ZeRO-3")
    if offload_params is None:
        offload_params = offload != "none" and stage == 3
    if offload_params and stage != 3:
        raise ValueError("parameter offload needs ZeRO-3")
    param_b, grad_b, optim_b = bytes_per_param(dtype)
    if dtype == "fp32" and (stage in (1, 2) or offload != "none"):
        # DeepSpeed's ZeRO-1/2 optimizer, and any offloaded one, steps its own fp32 clone of the
        # partition even when the parameters are fp32 (stage_1_and_2.py, stage3.py): 4 more bytes.
        optim_b += 4
    share = params / dp
    held = {"gpu": 0.0, "cpu": 0.0, "nvme": 0.0}
    away = "gpu" if offload == "none" else offload
    held[away if offload_params else "gpu"] += param_b * (share if stage == 3 else params)
    if offload == "none":
        held["gpu"] += grad_b * (share if stage >= 2 else params)
    else:
        held["cpu"] += OFFLOADED_GRAD_BYTES * share
        if stage == 1:  # stage 1 still accumulates every gradient on the accelerator before reducing
            held["gpu"] += grad_b * params
    held[away] += optim_b * (share if stage >= 1 else params)
    return ModelStates(**held)


def expert_parameters(model_cfg) -> int:
    """A mixture of experts' expert weights (every expert of every MoE block: SwiGLU's three
    matrices each); 0 for a dense model."""
    if model_cfg.family != "mixtral":
        return 0
    from lmrepo.models.mixtral import is_moe_block

    shape, moe = model_cfg.shape(), model_cfg.moe
    blocks = sum(is_moe_block(i, moe.every) for i in range(shape["n_layer"]))
    return blocks * moe.experts * 3 * shape["n_embd"] * model_cfg.n_inner


def moe_state_bytes(
    params: int, experts: int, stage: int, dp: int, ep: int, offload: str = "none", dtype: str = "bf16"
) -> ModelStates:
    """Per-rank model states of a DeepSpeed-MoE model (ZeRO 0-2) with `experts` of its `params` in
    expert weights: each rank holds 1/ep of the experts, and ZeRO partitions their states over the
    dp/ep ranks that hold the same experts (DeepSpeed's expert-data-parallel group), the other
    parameters' over all dp ranks."""
    dense = model_state_bytes(params - experts, stage, dp, offload, dtype=dtype)
    expert = model_state_bytes(experts // ep, stage, dp // ep, offload, dtype=dtype)
    return ModelStates(dense.gpu + expert.gpu, dense.cpu + expert.cpu, dense.nvme + expert.nvme)


def fsdp2_state_bytes(
    params: int, dp: int, dtype: str, offload: str = "none", keep_gathered: bool = False
) -> ModelStates:
    """Per-rank model states under FSDP2 (engine=fsdp2) over `dp` ranks: fp32 parameters, fp32
    gradients (reduced in fp32 under bf16's MixedPrecisionPolicy) and Adam's two fp32 moments,
    all sharded: 16 bytes x params / dp at any precision, in host memory with offload=cpu. With
    `keep_gathered` (zero=stage2: parameters not resharded after forward) every block's
    parameters stay gathered in the compute precision from forward to backward, which adds the
    whole model in that precision at the peak. One block gathered at a time (zero=stage3) is a
    transient, not counted, as for ZeRO-3."""
    share = 16 * params / dp
    gathered = (4 if dtype == "fp32" else 2) * params if keep_gathered else 0.0
    if offload == "cpu":
        return ModelStates(gpu=gathered, cpu=share, nvme=0.0)
    return ModelStates(gpu=share + gathered, cpu=0.0, nvme=0.0)


@dataclass
class RankParameters:
    """A pipeline rank's parameter elements under engine=fsdp2: those FSDP2 shards over the rank's
    dp_shard ranks, and those it keeps whole (a weight two of the rank's chunks share)."""

    sharded: float
    whole: float = 0.0

    def per_rank(self, dp_shard: int) -> float:
        return self.sharded / dp_shard + self.whole


def fsdp2_rank_parameters(net: torch.nn.Module, config, layout, tp_rank: int = 0) -> list[RankParameters]:
    """The parameters each pipeline rank holds under engine=fsdp2 on `layout`, before FSDP2 shards
    them over its dp_shard ranks (HSDP's replicas each hold a copy of the shard): the layers of its
    pipeline chunks as the torch pipeline splits them (a tied embedding on every rank that computes
    with it, whole where two of the rank's chunks share it), the block linears tensor parallelism
    splits counted 1/tp, the head a vocabulary-parallel loss splits as tensor-parallel rank `tp_rank`
    holds it (rank 0 holds the most where the vocabulary does not divide). One entry per pipeline
    rank (one without a pipeline). `net`: meta_model's."""
    styles = _tp_styles(net, config, layout)

    def share(p) -> float:
        if styles.get(id(p)) == "vocabulary":  # DTensor's Shard(0): ceil(rows / tp) rows a rank, the last one the rest
            return shard_rows(p.shape[0], layout.tp, tp_rank) * (p.numel() // p.shape[0])
        return p.numel() / (layout.tp if id(p) in styles else 1)

    def elements(params) -> float:
        return float(sum(share(p) for p in params))

    return [
        RankParameters(elements(sharded), elements(whole)) for sharded, whole in _stage_parameters(net, config, layout)
    ]


class ShardArithmetic:
    """The parameter elements each rank holds under engine=fsdp2 on `layout`, exactly: its pipeline
    rank's parameters (fsdp2_rank_parameters' split), each cut as torch cuts it: by tensor
    parallelism first (Shard(0) over the tp ranks for a column-wise linear and a vocabulary-split
    head, Shard(1) for a row-wise linear's weight), then fully_shard's Shard(0) of what is left over
    the rank's dp_shard ranks (times its sequence-parallel ranks: layout.shards), an expert's over
    the ranks that hold it; both in torch.chunk's pieces (shard_rows). A weight two of the rank's
    chunks share stays whole. `net`: meta_model's."""

    def __init__(self, net: torch.nn.Module, config, layout):
        self.layout = layout
        self.styles = _tp_styles(net, config, layout)
        self.stages = _stage_parameters(net, config, layout)
        self.experts = expert_indices(net)  # a parameter's expert, by its global index
        self.expert_count = len(set(self.experts.values()))

    def copies(self, param) -> int:
        """On how many ranks of one replica a parameter's pieces add up to it once: tp for a
        tensor tensor parallelism leaves whole (each tp rank holds and shards its own copy)."""
        return 1 if id(param) in self.styles else self.layout.tp

    def elements(self, rank: int) -> int:
        where, layout = self.layout.coordinates(rank), self.layout
        shard = layout.shard_index(rank)  # once a rank: a 70B model has ~700 tensors, a plan 1,024 ranks

        def local(p, sharded: bool) -> int:
            shape = list(p.shape)
            style = self.styles.get(id(p))
            if style in ("colwise", "vocabulary") or (style == "rowwise" and p.dim() == 1):
                shape[0] = shard_rows(shape[0], layout.tp, where["tp"])
            elif style == "rowwise":
                shape[1] = shard_rows(shape[1], layout.tp, where["tp"])
            if id(p) in self.experts and layout.ep > 1:
                # expert parallelism: the experts of the rank's ep share, sharded over the edp ranks
                edp_rank, ep_rank = divmod(where["dp_shard"], layout.ep)
                if self.experts[id(p)] // (self.expert_count // layout.ep) != ep_rank:
                    return 0
                shape[0] = shard_rows(shape[0], layout.dp_shard // layout.ep, edp_rank)
            elif sharded:
                shape[0] = shard_rows(shape[0], layout.shards, shard)
            return math.prod(shape)

        sharded, whole = self.stages[layout.stage(rank)]
        return sum(local(p, True) for p in sharded) + sum(local(p, False) for p in whole)


def expert_indices(net: torch.nn.Module) -> dict[int, int]:
    """Each expert parameter of a mixture of experts (built with every expert), by id: its
    expert's global index."""
    found = {}
    for name, param in net.named_parameters():
        head, marker, tail = name.partition(".deepspeed_experts.")
        if marker:
            found[id(param)] = int(tail.split(".", 1)[0])
    return found


def _tp_styles(net: torch.nn.Module, config, layout) -> dict[int, str]:
    """How tensor parallelism splits each parameter it splits, by id: "colwise" and "rowwise" as the
    blocks' plan names their linears (a mixture of experts' experts stay whole), "vocabulary" for
    the head a vocabulary-parallel loss splits."""
    if layout.tp <= 1:
        return {}
    from lmrepo.distributed.tp import block_tp_plan, own_plan
    from lmrepo.models import transformer_blocks

    styles = {}
    for block in transformer_blocks(net):
        for name, style in own_plan(block, block_tp_plan(net)).items():
            styles.update((id(p), style) for p in block.get_submodule(name).parameters())
    if tp_plans.loss_parallel(config):
        styles.update((id(p), "vocabulary") for p in net.get_output_embeddings().parameters())
    return styles


def _stage_parameters(net: torch.nn.Module, config, layout) -> list[tuple[list, list]]:
    """Per pipeline rank (one without a pipeline): (the parameters FSDP2 shards, those it keeps
    whole), the layers of the rank's chunks as the torch pipeline splits them; a parameter two of
    the rank's chunks share (a V placement's tied embedding) is kept whole."""
    if config.pipeline.engine != "torch":  # the whole model, one FSDP2 unit per block and the root
        return [(list(net.parameters()), [])]  # parameters() lists a tied weight once
    from lmrepo.engines.torch_pipeline import partition, placement, tied_owner
    from lmrepo.models import pipe

    pipeline = config.pipeline
    layers = pipe.pipeline_layers(net, config.model.family)
    bounds = partition(layers, layout.pp * pipeline.virtual_stages, pipeline.partition_method)
    chunks = [Counter() for _ in range(layout.pp)]  # per pipeline rank: how many of its chunks hold each parameter
    params = {}
    for chunk, rank in enumerate(placement(pipeline.schedule, layout.pp, pipeline.virtual_stages)):
        held = {}
        for index in range(bounds[chunk], bounds[chunk + 1]):
            held.update((id(p), p) for p in layers[tied_owner(layers, index)].build().parameters())
        params.update(held)
        chunks[rank].update(held.keys())
    return [
        ([params[key] for key, n in counts.items() if n == 1], [params[key] for key, n in counts.items() if n > 1])
        for counts in chunks
    ]


@dataclass
class PlannedRank:
    """One rank of an engine=fsdp2 job as the engine builds it (lmrepo.engines.fsdp2.parallelize, or
    the torch pipeline's stages), on the meta device over torch's fake process group."""

    rank: int
    coordinates: dict  # the rank's place on each dimension of the layout
    held: int  # the parameter elements of the rank's shards (and of what it keeps whole)
    arithmetic: int  # ShardArithmetic's: the same cut, from the shapes alone


def planned_shards(config, layout, ranks: list[int]) -> list[PlannedRank]:
    """engine=fsdp2's real shards of each of `ranks` of `layout`, at any world size and model size, in
    this process: for each rank, torch's fake process group of the layout's world (every collective a
    no-op), the layout's device mesh, the model train.py builds made on the meta device (shapes, no
    memory), then the engine's own parallelization of it (tensor parallelism, fully_shard; or the
    torch pipeline's chunks of the rank's stage, each block and chunk fully_shard'ed)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lmrepo.engines.layer_files import local  # a rank's own part of a (D)Tensor

    arithmetic = ShardArithmetic(meta_model(config.model), config, layout)
    planned = []
    for rank in ranks:
        dist.init_process_group("fake", rank=rank, world_size=layout.world, store=FakeStore())
        try:
            params = _parallelized_parameters(config, layout, layout.mesh("cpu"), rank)
            held = sum(local(p).numel() for p in params)
        finally:
            dist.destroy_process_group()
        planned.append(PlannedRank(rank, layout.coordinates(rank), held, arithmetic.elements(rank)))
    return planned


def _parallelized_parameters(config, layout, mesh, rank: int) -> list:
    """This rank's parameters once the engine has parallelized the model (the meta device's)."""
    net = meta_model(config.model, layout.ep, layout.ep_rank(rank))
    stage = layout.stage(rank)
    if config.pipeline.engine != "torch":
        from lmrepo.engines import fsdp2

        fsdp2.parallelize(net, config, layout, mesh, torch.device("cpu"))
        return list(net.parameters())
    from lmrepo.engines.torch_pipeline import partition, placement, rank_chunks, shard_chunks, stage_sharding
    from lmrepo.models import pipe

    pipeline = config.pipeline
    layers = pipe.pipeline_layers(net, config.model.family)
    parts = [int(p) for p in partition(layers, layout.pp * pipeline.virtual_stages, pipeline.partition_method)]
    _, chunks = rank_chunks(layers, parts, placement(pipeline.schedule, layout.pp, pipeline.virtual_stages), stage)
    shard_chunks(chunks, stage_sharding(net, config, layout, mesh))
    return list(chunks.parameters())


def optimizer_group_sizes(model: torch.nn.Module) -> list[list[int]]:
    """The element count of each parameter in each of the optimizer's groups, in the order train.py
    gives them to DeepSpeed (lmrepo.optim.optimizer.param_groups: matrices with weight decay, then the rest)."""
    from lmrepo.optim.optimizer import param_groups

    return [[p.numel() for p in group["params"]] for group in param_groups(model, weight_decay=0.0)]


# stage_1_and_2.py pads each flattened group to a multiple of 2 x dp elements (4-byte alignment of 16-bit values).
ZERO_ALIGNMENT = 2


def zero12_gradient_elements(group_sizes: list[list[int]], dp: int) -> list[int]:
    """Gradient elements each data-parallel rank holds when DeepSpeed's ZeRO-1/2 optimizer steps,
    rank by rank. DeepSpeed flattens each group, pads it and splits it into dp equal partitions,
    but keeps gradients by whole tensor: a rank's buffer (`grads_in_partition`, or the partition's
    list of gradient tensors at stage 1) holds in full every parameter its partition touches
    (`get_partition_info`). A tensor that straddles a partition boundary is held whole on both
    sides, so a tensor larger than a partition (a big vocabulary's embedding) costs its whole size
    on every rank it spans, where the ZeRO division counts 1/dp of the model."""
    held = [0] * dp
    for sizes in group_sizes:
        aligned = math.ceil(sum(sizes) / (ZERO_ALIGNMENT * dp)) * ZERO_ALIGNMENT * dp
        size = aligned // dp
        for rank in range(dp):
            start, end, offset = rank * size, (rank + 1) * size, 0
            for n in sizes:
                if offset < end and offset + n > start:
                    held[rank] += n
                offset += n
    return held


def zero12_model_state_bytes(
    params: int, group_sizes: list[list[int]], stage: int, dp: int, dtype: str = "bf16"
) -> list[float]:
    """Per-rank model states of DeepSpeed's ZeRO-1/2 without offload, rank by rank: the division of
    model_state_bytes with the gradients as DeepSpeed holds them (zero12_gradient_elements)."""
    if stage not in (1, 2):
        raise ValueError("DeepSpeed's whole-tensor gradient layout is ZeRO-1/2's")
    division = model_state_bytes(params, stage, dp, dtype=dtype).gpu
    grad_b = bytes_per_param(dtype)[1]
    divided_grads = grad_b * (params / dp if stage == 2 else params)
    return [division - divided_grads + grad_b * n for n in zero12_gradient_elements(group_sizes, dp)]


def activation_bytes_per_layer(seq: int, micro: int, hidden: int, heads: int) -> float:
    """Korthikanti et al. 2022, eq. 1: one transformer layer keeps s*b*h*(34 + 5*a*s/h) bytes of
    16-bit activations (and 1-byte dropout masks) for its backward: 34*sbh from the inputs of the
    linears, GeLU and layer norms and two dropout masks; 5*a*s^2*b from the attention scores,
    softmax and its dropout mask. Fused attention (SDPA/flash, transformers' default) keeps no
    s x s tensor and dropout 0 stores no masks, so this is an upper bound for lmrepo's runs."""
    return seq * micro * hidden * (34 + 5 * heads * seq / hidden)


def activation_bytes(
    n_layer: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq: int,
    micro: int,
    checkpointed_layers: int = 0,
    dtype: str = "bf16",
) -> float:
    """Activations one rank holds at the start of backward. A checkpointed layer keeps only its
    16-bit input, 2*sbh, and while it is recomputed one layer's full activations exist again
    (Korthikanti's full recomputation: 2*sbh*L). The output layer is never checkpointed: its
    layer norm and projection inputs 2sbh each and the fp32 logits 4sbV, 4sbh(1 + V/h) (Korthikanti).
    fp32 training doubles the layer terms."""
    scale = 2 if dtype == "fp32" else 1
    full = activation_bytes_per_layer(seq, micro, hidden, heads)
    kept = (n_layer - checkpointed_layers) * full + checkpointed_layers * 2 * seq * micro * hidden
    recompute = full if checkpointed_layers else 0.0
    return scale * (kept + recompute) + 4 * seq * micro * hidden * (1 + vocab / hidden)


@dataclass(frozen=True)
class ActivationCount:
    """Bytes autograd keeps for the backward of one micro batch on one rank, as counted from the
    forward of the model train.py builds (`counted_activations`)."""

    block: float  # one transformer block
    first: float  # what comes before the blocks (the embeddings): the first pipeline stage's
    last: float  # what comes after them (the final norm, the output layer, the loss): the last stage's


def shard_rows(rows: int, ranks: int, rank: int) -> int:
    """The rows of a tensor's dim 0 that `rank` holds when it is split over `ranks` as Shard(0)
    splits it (torch.chunk: ceil(rows / ranks) each, the last ranks what is left): a head split by
    vocabulary over tensor-parallel ranks (257 over 2: 129 and 128), a parameter fully_shard'ed
    over data-parallel ones (50,257 over 64: 786 each, 739 on the last)."""
    chunk = -(-rows // ranks)
    return max(0, min(chunk, rows - rank * chunk))


def counted_activations(
    model_cfg,
    micro: int,
    seq: int,
    dtype: str,
    tp: int = 1,
    sp: int = 1,
    loss_tiles: int | None = None,
    pipelined: bool = False,
    autocast: bool = False,
    sequence_parallel: bool = False,
    vocabulary_parallel: bool = False,
    tp_rank: int = 0,
) -> ActivationCount | None:
    """What one rank's forward of one micro batch saves for backward, counted on fake tensors (no
    memory, no compute; the kernels a CPU run picks, fused attention among them) by
    lmrepo.observability.saved_activations, on a model of 2 blocks: transformers' model as train.py builds it,
    or with `pipelined` the pipeline's layers (lmrepo.models.pipe) and its loss, layer by layer.
    Tensor parallelism over `tp` ranks: the block of one rank's slice (heads, key/value heads and
    the MLP's width / tp; the norms and the residual stream whole), as torch's and DeepSpeed's
    plans compute it; with `sequence_parallel` (engine=fsdp2's) what the norms keep is one rank's
    tokens of it (the blocks' linears keep their inputs whole, all-gathered), with
    `vocabulary_parallel` the head's and the loss's share of the vocabulary of tensor-parallel rank
    `tp_rank` (0's is the largest where the ranks' shares are uneven: shard_rows). Ulysses
    sequence parallelism over `sp` ranks: seq / sp tokens of everything (inside attention all seq
    tokens of heads / sp: the same bytes). None for a mixture of experts (DeepSpeed-MoE's layers
    need process groups to be built). A 16-bit `dtype` is the parameters' (DeepSpeed, FSDP2's mixed
    precision), or with `autocast` torch.autocast's over fp32 ones (the torch pipeline; the CPU's
    autocast lists, which differ a little from CUDA's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lmrepo.observability.saved_activations import SavedActivations

    if model_cfg.family == "mixtral":
        return None
    family, config = FAMILIES[model_cfg.family], _two_blocks(model_cfg, tp)
    default = torch.get_default_dtype()
    # the parameters, hence activations, of the run's compute dtype, or fp32 ones under autocast
    torch.set_default_dtype(torch.float32 if autocast else TORCH_DTYPES[dtype])
    casting = torch.autocast("cpu", dtype=TORCH_DTYPES[dtype], enabled=autocast and dtype != "fp32")
    try:
        with FakeTensorMode(), _as_real_tensors(), casting:
            net = family.MODEL_CLASS._from_config(config).train()
            net.config.use_cache = False
            net.loss_type = family.LOSS_TYPE
            ids = torch.zeros(micro, seq // sp, dtype=torch.long)
            with SavedActivations() as saved:
                if pipelined:
                    after, kept_by = _saved_by_pipeline_layers(net, model_cfg.family, ids, saved), {}
                else:
                    if vocabulary_parallel:  # the rank's rows of the head, lmrepo's loss as the engine runs it
                        rows = shard_rows(config.vocab_size, tp, tp_rank)
                        net.set_output_embeddings(torch.nn.Linear(config.hidden_size, rows, bias=False))
                        loss_tiles = loss_tiles or 1
                    if loss_tiles is not None:
                        causal_loss.install(net, loss_tiles)
                    after, kept_by = _saved_by_blocks(net, ids, saved, sequence_parallel)
    finally:
        torch.set_default_dtype(default)
    # Block 1 also saves what every block shares (transformers computes the rotary angles once): the first's
    block, last = after[1] - after[0], after[2] - after[1]
    first = after[0] - block
    if sequence_parallel:  # the norms keep 1/tp of it: one rank's tokens
        split = 1 - 1 / tp
        block -= split * sum(kept for norm, kept in kept_by.items() if norm is not net.base_model.norm)
        last -= split * kept_by[net.base_model.norm]
    return ActivationCount(block=block, first=first, last=last)


def _two_blocks(model_cfg, tp: int):
    """The model's transformers config with 2 blocks; with tensor parallelism over `tp` ranks, one
    rank's slice of a block (heads, key/value heads and the MLP's width / tp)."""
    config = hf_config(model_cfg)
    config.num_hidden_layers = 2
    if tp > 1:
        config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        config.num_attention_heads //= tp
        config.num_key_value_heads //= tp
        config.intermediate_size //= tp
    return config


def _saved_by_pipeline_layers(net, family: str, ids, saved) -> list[int]:
    """Bytes held after the embeddings, after the blocks and at the end (the loss included), the
    pipeline's layers (lmrepo.models.pipe) run one after another."""
    from lmrepo.engines.torch_pipeline import build_layer

    hidden, held = ids, []
    for spec in pipe.pipeline_layers(net, family):
        hidden = build_layer(spec)(hidden)
        held.append(saved.live)
    loss = pipe.LMLoss(family, net.config.vocab_size)(hidden, ids)  # held: its graph stays
    after = [held[1], held[2], saved.live]
    del loss
    return after


def _saved_by_blocks(net, ids, saved, sequence_parallel: bool) -> tuple[list[int], dict]:
    """Bytes held after block 1, after block 2 and at the end (the loss included), the model's own
    forward; with `sequence_parallel`, what block 2's norms and the final norm keep, by norm."""
    blocks = transformer_blocks(net)
    after = []
    hooks = [block.register_forward_hook(lambda *_: after.append(saved.live)) for block in blocks]
    norms = [getattr(blocks[1], name) for name in tp_plans.SEQUENCE_PARALLEL_NORMS if sequence_parallel]
    norms += [net.base_model.norm] if sequence_parallel else []
    kept_by = {}
    for norm in norms:
        hooks += _count_inside(norm, saved, kept_by)
    loss = net(input_ids=ids, labels=ids).loss  # held: its graph stays
    after.append(saved.live)
    for hook in hooks:
        hook.remove()
    del loss
    return after, kept_by


def _count_inside(module: torch.nn.Module, saved, kept_by: dict) -> list:
    """Hooks that set kept_by[module] to what `module`'s forward saves for backward."""
    return [
        module.register_forward_pre_hook(lambda m, _: kept_by.update({m: -saved.live})),
        module.register_forward_hook(lambda m, *_: kept_by.update({m: kept_by[m] + saved.live})),
    ]


@contextlib.contextmanager
def _as_real_tensors():
    """transformers' masks take a fake tensor for a graph being traced and build the causal mask
    that a real run leaves to SDPA's is_causal (no mask; grouped-query attention inside the
    kernel). For the count a fake tensor stands for a real one, and the ids of its one sequence
    hold no packed documents (the question transformers would read the data for)."""
    from transformers import masking_utils

    saved = masking_utils.is_tracing, masking_utils.find_packed_sequence_indices
    masking_utils.is_tracing = lambda tensor=None: saved[0](None)
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.is_tracing, masking_utils.find_packed_sequence_indices = saved


def pipeline_in_flight(schedule: str, stages: int, microbatches: int, virtual: int, stage: int) -> float:
    """How many micro batches' activations pipeline rank `stage` holds at its peak, in units of
    its blocks' for one micro batch. GPipe runs every forward first: all of them. 1F1B: stage i
    holds min(stages - i, micro batches) (Narayanan et al. 2021). Interleaved 1F1B with v chunks
    per rank: the first rank holds stages + (stages - 1) / v (Korthikanti et al. 2022, Sec. 4.2.3's
    factor 1 + (p - 1)/(p v) of 1F1B's), a bound for the other ranks. The zero-bubble schedules keep
    their base schedule's peak (ZB-V 1F1B's, Qi et al. 2024), DualPipeV one micro batch more
    (DeepSeek-V3's table). None: 1 (one micro batch at a time)."""
    if schedule == "none":
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule in ("1f1b", "1f1b_torch"):
        return min(stages - stage, microbatches)
    if schedule in ("interleaved", "interleaved_zb"):
        return min(stages + (stages - 1) / virtual, microbatches)
    if schedule == "zbv":
        return min(stages, microbatches)
    return min(stages + 1, microbatches)  # dualpipev


def layout_activations(
    config, layout, micro: int, microbatches: int, tp_rank: int = 0
) -> tuple[ActivationCount, list[float]] | None:
    """The count for `layout` (its tp, sp and pipeline) and what each pipeline rank holds from it,
    for micro batches of `micro` sequences, `microbatches` of them a step per data-parallel rank,
    on tensor-parallel rank `tp_rank` (0: the largest share of a vocabulary split unevenly); None
    for a mixture of experts."""
    pipelined = config.pipeline.schedule != "none"
    autocast = pipelined and config.pipeline.engine == "torch"  # the torch pipeline's bf16 is torch.autocast
    count = counted_activations(
        config.model, micro, config.data.block_size, config.precision.dtype, layout.tp, layout.sp,
        config.trainer.loss_tiles, pipelined, autocast,
        layout.tp > 1 and tp_plans.sequence_parallel(config), layout.tp > 1 and tp_plans.loss_parallel(config),
        tp_rank,
    )  # fmt: skip
    if count is None:
        return None
    return count, rank_activation_bytes(count, meta_model(config.model), config, layout, micro, microbatches)


def rank_activation_bytes(
    count: ActivationCount, net: torch.nn.Module, config, layout, micro: int, microbatches: int
) -> list[float]:
    """The activations each pipeline rank holds at its peak under `layout`, one entry per pipeline
    rank (one without a pipeline), from a count made for the layout's tp and sp (and pipelined
    with a pipeline): what the rank's layers keep for one micro batch (its blocks', the first
    stage's embeddings', the last stage's head and loss) times the micro batches in flight there
    (pipeline_in_flight). A checkpointed block keeps its input only, and one block's activations
    live again while it is recomputed. The torch pipeline's split of the layers (DeepSpeed's too)
    decides each rank's blocks. `net`: meta_model's."""
    model, pipeline, ckpt = config.model, config.pipeline, config.checkpointing
    n_layer = model.shape()["n_layer"]
    if pipeline.schedule == "none":
        rank_of = [0] * (n_layer + 2)
    else:
        from lmrepo.engines.torch_pipeline import partition, placement
        from lmrepo.models import pipe

        layers = pipe.pipeline_layers(net, model.family)
        bounds = partition(layers, layout.pp * pipeline.virtual_stages, pipeline.partition_method)
        ranks = placement(pipeline.schedule, layout.pp, pipeline.virtual_stages)
        rank_of = [ranks[chunk] for chunk in range(len(ranks)) for _ in range(bounds[chunk], bounds[chunk + 1])]
    owners = rank_of[1 : 1 + n_layer]  # every family's layers: the embeddings, the blocks, then the norm and head
    every = ckpt.every_n_layers if ckpt.enabled else 0
    element = TORCH_DTYPES[config.precision.dtype].itemsize
    block_input = micro * (config.data.block_size // layout.sp) * model.n_embd * element
    held = []
    for rank in range(layout.pp):
        blocks = [b for b in range(n_layer) if owners[b] == rank]
        checkpointed = sum(1 for b in blocks if every and b % every == 0)
        kept = (len(blocks) - checkpointed) * count.block + checkpointed * block_input
        kept += count.first * (rank_of[0] == rank) + count.last * (rank_of[-1] == rank)
        flight = pipeline_in_flight(pipeline.schedule, layout.pp, microbatches, pipeline.virtual_stages, rank)
        held.append(flight * kept + (count.block if checkpointed else 0.0))
    return held


def checkpointed_layers(n_layer: int, checkpointing) -> int:
    """Blocks transformers checkpoints for `checkpointing.every_n_layers` (every n-th, from the first)."""
    return math.ceil(n_layer / checkpointing.every_n_layers) if checkpointing.enabled else 0


def train_seconds(tokens: float, params: float, devices: int, tflops: float, recompute: bool) -> float:
    """Narayanan et al. 2021: 8*T*P/(n*X) with activation recomputation (forward
    2PT FLOPs, backward 4PT, recomputed forward 2PT), 6*T*P/(n*X) without; X in TFLOP/s per device."""
    return (8 if recompute else 6) * tokens * params / (devices * tflops * 1e12)
