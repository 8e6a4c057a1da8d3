"""Pre-flight estimate of a training job: parameters, memory per rank, FLOPs per step, days to train.

    python scripts/estimate.py model=gpt2-xl zero=stage3 offload=cpu trainer.micro_batch_size=4 world=64
    python scripts/estimate.py model=gpt2-large checkpointing=full world=16 tokens=300e9 tflops=150

Arguments are train.py's Hydra overrides plus the keys of the estimate itself:
    world=N          ranks (GPUs) of the job (1)
    shards=RANKS     engine=fsdp2: the ranks whose real shards are built, comma-separated ("first,last":
                     the first and the last rank; "none": no build), on the meta device over torch's
                     fake process group of `world` ranks, in this process
    gpus_per_node=N  ranks per node: host memory per node, DeepSpeed's estimators (min(8, world))
    tokens=T         tokens to train on (300e9, as in the worked examples of the 8TP/(nX) arithmetic)
    tflops=X         achieved TFLOP/s per device counting recomputation, lmrepo's `tflops` metric;
    gpu=NAME mfu=F   otherwise X comes from NAME's peak (A100; or metrics.peak_tflops=) x MFU F (0.4,
                     about what the 18B GPT of those examples reaches: 50.5% of an A100's peak
                     with recomputation, 38% counting model FLOPs only)
No GPU and nothing written; the only process group is torch's fake one, in this process, for the
real shards. The job is held to train.py's rules for `world` ranks, the final DeepSpeed dict's
included. A bad argument, or a job the rules refuse: one line on stderr, exit 2.
"""

import os
import sys
from dataclasses import dataclass

from lmrepo.utils import quiet

quiet.install()  # before DeepSpeed is imported: its accelerator notice is no line for the user

from lmrepo import estimate  # noqa: E402
from lmrepo.config import TrainConfig  # noqa: E402
from lmrepo.distributed import tp  # noqa: E402
from lmrepo.distributed.layout import ParallelLayout  # noqa: E402
from lmrepo.models import meta_model  # noqa: E402
from lmrepo.observability.metrics import executed_flops_per_token, flops_per_token, peak_tflops  # noqa: E402
from lmrepo.plan import rules  # noqa: E402
from lmrepo.plan.compose import load_config  # noqa: E402
from lmrepo.plan.ds_config import build_ds_config, resolve_batch  # noqa: E402
from lmrepo.plan.job import layout_check  # noqa: E402
from lmrepo.utils.errors import ConfigError, exit_error  # noqa: E402

OWN_KEYS = {
    "world": (int, 1),
    "gpus_per_node": (int, None),
    "tokens": (float, 300e9),
    "tflops": (float, None),
    "gpu": (str, "A100"),
    "mfu": (float, 0.4),
    "shards": (str, "first,last"),
}
OFFLOADS = ("none", "cpu", "nvme")
GIB = 2**30


fail = exit_error


def split_args(argv: list[str]) -> tuple[dict, list[str]]:
    """The estimate's own keys out of argv; the rest are Hydra overrides."""
    own, overrides = {k: default for k, (_, default) in OWN_KEYS.items()}, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in OWN_KEYS:
            overrides.append(arg)
            continue
        kind = OWN_KEYS[key][0]
        if kind is str:
            own[key] = value
            continue
        try:
            number = float(value)
        except ValueError:
            fail(f"{key}={value} is not a number")
        if not number > 0 or (kind is int and not number.is_integer()):
            fail(f"{key}={value} must be a positive {'integer' if kind is int else 'number'}")
        own[key] = kind(number)
    own["gpus_per_node"] = own["gpus_per_node"] or min(8, own["world"])
    if own["world"] % own["gpus_per_node"]:
        fail(f"gpus_per_node={own['gpus_per_node']} does not divide world={own['world']}")
    if own["mfu"] > 1:
        fail(f"mfu={own['mfu']} must be a fraction in (0, 1]")
    return own, overrides


@dataclass
class Job:
    cfg: TrainConfig
    own: dict
    shape: dict
    layout: ParallelLayout
    dp: int
    global_batch: int
    micro: int
    grad_accum: int  # micro batches per step on each data-parallel rank (a pipeline's)
    offload_params: bool


def load_job(argv: list[str]) -> Job:
    """The composed config, held to train.py's checks that do not need a device or the data."""
    own, overrides = split_args(argv)
    try:
        cfg = load_config(overrides)
        if cfg.precision.dtype == "auto":  # planning for GPUs of compute capability >= 8.0, where auto is bf16
            cfg.precision.dtype = "bf16"
        layout = layout_check(cfg, own["world"])
        dp = layout.dp
        rules.check(rules.Job(cfg, build_ds_config(cfg, dp)))  # the rows that read the final DeepSpeed dict
        global_batch, micro, grad_accum = resolve_batch(
            cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size, cfg.trainer.grad_accum, dp
        )
        return Job(
            cfg,
            own,
            cfg.model.shape(),
            layout,
            dp,
            global_batch,
            micro,
            grad_accum,
            offload_params=cfg.offload.offloads_params(cfg.zero.stage),
        )
    except ConfigError as err:
        fail(str(err))


def deepspeed_figures(
    params: int,
    largest: int,
    stage: int,
    offload: str,
    offload_params: bool,
    gpus_per_node: int,
    nodes: int,
    zero_init: bool,
) -> tuple[float, float] | None:
    """(GPU per rank, CPU per node) bytes from DeepSpeed's own estimators, for the cases they cover."""
    if offload == "nvme" or stage < 2:
        return None
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    cpu_offload = offload == "cpu"
    if stage == 2:
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload)
    else:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            params, largest, gpus_per_node, nodes, cpu_offload, offload_params, zero_init
        )
    return gpu, cpu


def print_model_states(job: Job, params: int, largest: int) -> None:
    cfg, gpn = job.cfg, job.own["gpus_per_node"]
    dtype, stage, target = cfg.precision.dtype, cfg.zero.stage, cfg.offload.target
    param_b, grad_b, optim_b = estimate.bytes_per_param(dtype)
    print(
        f"\nModel states per rank, GiB ({dtype} + Adam: {param_b} params + {grad_b} grads + {optim_b} optimizer "
        f"bytes/param; ZeRO over {job.dp} ranks; offloaded grads fp32)"
    )
    print(
        f"    {'zero':<7}{'offload':<9}{'GPU':>9}{'CPU':>9}{'NVMe':>9}{'CPU/node':>10} | "
        f"{'DeepSpeed: GPU':>14}{'CPU/node':>10}"
    )
    for st in range(4):
        for off in OFFLOADS:
            this_job = (st, off) == (stage, target) and job.cfg.engine.name == "deepspeed"
            # Other rows take the offload group's default: parameters offloaded too at stage 3.
            off_params = job.offload_params if this_job else off != "none" and st == 3
            try:
                ours = estimate.model_state_bytes(params, st, job.dp, off, off_params, dtype)
            except ValueError:
                continue
            # DeepSpeed's multipliers assume 16-bit training.
            theirs = (
                None
                if dtype == "fp32"
                else deepspeed_figures(
                    params, largest, st, off, off_params, gpn, job.own["world"] // gpn, cfg.model.zero_init
                )
            )
            ds = f"{theirs[0] / GIB:>14.2f}{theirs[1] / GIB:>10.2f}" if theirs else f"{'-':>14}{'-':>10}"
            print(
                f"  {'* ' if this_job else '  '}{'stage' + str(st):<7}{off:<9}{ours.gpu / GIB:>9.2f}"
                f"{ours.cpu / GIB:>9.2f}{ours.nvme / GIB:>9.2f}{ours.cpu * gpn / GIB:>10.2f} | {ds}"
            )
    print(
        "  * = this job. DeepSpeed's estimators (16-bit, stages 2-3, no or cpu offload) also count the fp32\n"
        "  gradient partition its step makes (+4 bytes/param/dp at stage 2, +2 at stage 3), 4 bytes x the\n"
        "  largest module at stage 3, a x1.5 host buffer factor and\n  "
        + (
            "(model.zero_init) no model copy at start."
            if cfg.model.zero_init
            else "(no model.zero_init) a full fp32 model per rank in host memory at start; their stage-2\n"
            "  figure puts all ranks' copies on every node."
        )
    )


def print_fsdp2_states(job: Job, net) -> None:
    """engine=fsdp2: every state sharded at both stages; zero=stage2 keeps the gathered weights. On
    this job's layout: each pipeline rank's layers, tensor-parallel slices and FSDP2 shards."""
    dtype, gpn, layout = job.cfg.precision.dtype, job.own["gpus_per_node"], job.layout
    if job.cfg.engine.name == "fsdp2":
        ranks = estimate.fsdp2_rank_parameters(net, job.cfg, layout)
    else:  # what FSDP2 would hold over this job's data-parallel ranks
        layout = ParallelLayout(world=job.dp, dp_shard=job.dp)
        ranks = [estimate.RankParameters(estimate.count_parameters(net))]
    worst = max(range(len(ranks)), key=lambda stage: ranks[stage].per_rank(layout.shards))
    held = ranks[worst]
    where = f"; pipeline rank {worst} of {layout.pp}, the largest" if len(ranks) > 1 else ""
    print(f"\nModel states per rank under engine=fsdp2 ({dtype}; {layout.describe()}{where}), GiB")
    before, after = held.per_rank(1), held.per_rank(layout.shards)
    print(f"  {before:,.0f} parameters on the rank before sharding, {after:,.0f} after")
    print(f"  {'layout':<16}{'offload':<9}{'GPU':>9}{'CPU':>9}{'CPU/node':>10}")
    for stage, keep in ((3, False), (2, True)):
        for off in ("none", "cpu"):
            ours = estimate.fsdp2_state_bytes(held.sharded, layout.shards, dtype, off, keep_gathered=keep)
            if held.whole:  # a weight two of the rank's chunks share: FSDP2 leaves it whole, on the device
                whole = estimate.fsdp2_state_bytes(held.whole, 1, dtype).gpu
                ours = estimate.ModelStates(ours.gpu + whole, ours.cpu, 0.0)
            this_job = job.cfg.engine.name == "fsdp2" and job.cfg.zero.stage == stage and job.cfg.offload.target == off
            print(
                f"  {'* ' if this_job else '  '}{'zero=stage' + str(stage):<14}{off:<9}{ours.gpu / GIB:>9.2f}"
                f"{ours.cpu / GIB:>9.2f}{ours.cpu * gpn / GIB:>10.2f}"
            )
    print(
        "  FSDP2 shards fp32 parameters, gradients and Adam's moments at both stages (16 bytes x params / shards);\n"
        "  zero=stage2 (no reshard after forward) also holds the rank's whole share gathered in the compute\n"
        "  precision from forward to backward; zero=stage3 gathers one block at a time (not counted, as for ZeRO-3).\n"
        "  A pipeline rank holds its stage's layers, tensor parallelism 1/tp of each block's linears (a\n"
        "  mixture of experts' experts whole), HSDP's replicas each a copy of the shards."
    )


def shard_ranks(spec: str, world: int) -> list[int]:
    """The ranks `shards=` names: "first,last", numbers, or "none"."""
    if spec == "none":
        return []
    ranks = []
    for word in spec.split(","):
        rank = {"first": 0, "last": world - 1}.get(word)
        if rank is None:
            if not word.isdigit() or int(word) >= world:
                fail(f"shards={spec}: {word} is not first, last or a rank below world={world}")
            rank = int(word)
        ranks.append(rank)
    return sorted(set(ranks))


def print_real_shards(job: Job) -> None:
    """engine=fsdp2's shards as the engine cuts them, built for the chosen ranks on the meta device
    over torch's fake process group, next to the arithmetic above."""
    ranks = shard_ranks(job.own["shards"], job.own["world"])
    if not ranks:
        return
    if job.cfg.engine.name != "fsdp2":
        print(
            "\nReal shards: not built for engine=deepspeed (DeepSpeed's ZeRO needs a real process group for its "
            "collectives, not torch's fake one): its arithmetic above is the plan"
        )
        return
    layout = job.layout
    print(
        f"\nReal shards per rank (engine=fsdp2 built on the meta device over torch's fake process group of "
        f"{layout.world} ranks: {layout.describe()}), GiB"
    )
    print(f"  {'rank':<6}{'coordinates':<34}{'parameters':>14}{'params':>8}{'grads':>8}{'Adam':>8}  arithmetic")
    for planned in estimate.planned_shards(job.cfg, layout, ranks):
        place = " ".join(f"{k} {v}" for k, v in planned.coordinates.items() if layout.sizes[k] > 1) or "-"
        fp32 = 4 * planned.held / GIB  # FSDP2 keeps fp32 shards of the parameters, gradients and both moments
        same = "equal" if planned.held == planned.arithmetic else f"{planned.arithmetic:,} (differs: a defect)"
        print(f"  {planned.rank:<6}{place:<34}{planned.held:>14,}{fp32:>8.2f}{fp32:>8.2f}{2 * fp32:>8.2f}  {same}")
    print(
        "  parameters: the elements of the rank's shards (and of what it keeps whole), fp32: 4 bytes each for\n"
        "  the parameters and the gradients, 8 for Adam's moments. arithmetic: estimate.ShardArithmetic,\n"
        "  the same cut from the shapes alone (tensor parallelism, then fully_shard's first dimension, both\n"
        "  in torch.chunk's pieces: ceil(rows / ranks) a rank, the last ranks the rest); the table above\n"
        "  counts an even share"
    )


def print_moe_states(job: Job, params: int) -> None:
    """model.family=mixtral: the experts split over expert_parallel.size ranks, ZeRO 0-2."""
    cfg, dtype = job.cfg, job.cfg.precision.dtype
    experts, ep = estimate.expert_parameters(cfg.model), cfg.expert_parallel.size
    print(
        f"\nModel states per rank with the experts split (DeepSpeed-MoE; {experts:,} expert parameters of "
        f"{params:,}; {dtype}; {job.dp} data-parallel ranks), GiB"
    )
    print(f"    {'zero':<7}{'offload':<9}" + "".join(f"{f'ep={size}':>9}" for size in moe_sizes(job.dp, cfg)))
    for stage in range(3):
        for off in ("none", "cpu"):
            if off != "none" and stage == 0:
                continue
            this = (stage, off) == (cfg.zero.stage, cfg.offload.target)
            cells = "".join(
                f"{estimate.moe_state_bytes(params, experts, stage, job.dp, size, off, dtype).gpu / GIB:>9.2f}"
                for size in moe_sizes(job.dp, cfg)
            )
            print(f"  {'* ' if this else '  '}{'stage' + str(stage):<7}{off:<9}{cells}")
    print(
        f"  * = this job (expert_parallel.size={ep}). Each rank holds 1/ep of the experts; ZeRO partitions their\n"
        "  states over the dp/ep ranks that hold the same experts, the rest over all ranks. ZeRO-3 does not run\n"
        "  DeepSpeed-MoE. Memory on the accelerator (GPU column of the table above); offloaded states go to the host."
    )


def moe_sizes(dp: int, cfg) -> list[int]:
    """The expert-parallel sizes this job could use: those dividing the ranks and the experts."""
    return [size for size in range(1, dp + 1) if dp % size == 0 and cfg.model.moe.experts % size == 0]


def print_gradient_layout(job: Job, params: int, group_sizes: list[list[int]]) -> None:
    """ZeRO-1/2 as DeepSpeed holds them: gradients by whole tensor, the worst rank against the division."""
    if job.dp == 1:
        return
    dtype, grad_b = job.cfg.precision.dtype, estimate.bytes_per_param(job.cfg.precision.dtype)[1]
    held = estimate.zero12_gradient_elements(group_sizes, job.dp)
    worst = max(range(job.dp), key=held.__getitem__)
    stage2 = estimate.model_state_bytes(params, 2, job.dp, dtype=dtype).gpu
    print(
        f"  DeepSpeed's ZeRO-1/2 (no offload) keep each gradient whole on every rank whose partition it touches:\n"
        f"  over {job.dp} ranks the worst (rank {worst}) holds {grad_b * held[worst] / GIB:.2f} GiB of gradients, "
        f"the division {grad_b * params / job.dp / GIB:.2f}: stage 2 takes "
        f"{estimate.zero12_model_state_bytes(params, group_sizes, 2, job.dp, dtype)[worst] / GIB:.2f} GiB there, "
        f"not {stage2 / GIB:.2f}"
    )


def print_activations(job: Job, net, checkpointed: int) -> None:
    cfg, layout = job.cfg, job.layout
    l, a, h, V = (job.shape[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size"))
    s, b = cfg.data.block_size, job.micro
    print(f"\nActivations per rank, GiB (Korthikanti et al. 2022; micro batch {b} x {s} tokens, one rank of the model)")
    print(f"    {'one layer s*b*h*(34 + 5*a*s/h)':<45}{estimate.activation_bytes_per_layer(s, b, h, a) / GIB:>9.2f}")
    rows = [("no checkpointing", 0), ("full checkpointing (2*s*b*h per layer)", l)]
    if checkpointed not in (0, l):
        every = cfg.checkpointing.every_n_layers
        rows.append((f"every {every} layers ({checkpointed} checkpointed)", checkpointed))
    for label, n in rows:
        total = estimate.activation_bytes(l, h, a, V, s, b, n, cfg.precision.dtype)
        print(f"  {'* ' if n == checkpointed else '  '}{label:<45}{total / GIB:>9.2f}")
    print(
        "  totals include the output layer, 4sbh(1 + V/h) with fp32 logits; an upper bound for GPT's layer under\n"
        "  fused attention (no s x s scores) and dropout 0 (no masks), not for transformers' unfused norms and GELU"
    )
    microbatches = job.grad_accum
    counted = estimate.layout_activations(cfg, layout, b, microbatches)
    if counted is None:
        print("  (a mixture of experts: no count per layout; DeepSpeed-MoE's layers need process groups to be built)")
        return
    count, held = counted
    pipelined = cfg.pipeline.schedule != "none"
    print(
        f"\nActivations per rank on this job's layout ({layout.describe()}), counted from the forward of "
        f"{'its pipeline layers' if pipelined else 'its model'}, GiB"
    )
    slice_ = f", 1/{layout.tp} of each block" if layout.tp > 1 else ""
    if layout.tp > 1 and tp.sequence_parallel(cfg):
        slice_ += " and of its norms' tokens (tp.sequence_parallel)"
    if layout.tp > 1 and tp.loss_parallel(cfg):
        slice_ += f", 1/{layout.tp} of the vocabulary (tp.loss_parallel)"
    print(
        f"  one micro batch of {b} x {s // layout.sp} tokens{slice_}: a block {count.block / GIB:.3f}, "
        f"the embeddings {count.first / GIB:.3f}, the head and loss {count.last / GIB:.3f}"
    )
    for rank, total in enumerate(held):
        flight = estimate.pipeline_in_flight(
            cfg.pipeline.schedule, layout.pp, microbatches, cfg.pipeline.virtual_stages, rank
        )
        where = f"pipeline rank {rank}" if pipelined else "each rank"
        print(f"  {where:<18}{total / GIB:>9.2f}   ({flight:g} of {microbatches} micro batches in flight)")
    print(
        "  counted on fake tensors (lmrepo.observability.saved_activations: what autograd keeps for backward,\n"
        "  the kernels a CPU run picks); a checkpointed block keeps its input, and one block is live again\n"
        "  while it is recomputed"
    )


def print_compute(job: Job, params: int, checkpointed: int, peak: float | None) -> None:
    l, h, V = (job.shape[k] for k in ("n_layer", "n_embd", "vocab_size"))
    s, world, tokens, dtype = job.cfg.data.block_size, job.own["world"], job.own["tokens"], job.cfg.precision.dtype
    model_flops = flops_per_token(l, h, s, V, recompute=False)
    executed = executed_flops_per_token(l, h, s, V, checkpointed)
    if job.own["tflops"] is not None:
        x, source = job.own["tflops"], "given"
    else:
        # MFU counts model FLOPs only: the executed rate also runs the recomputed forwards.
        x = peak * job.own["mfu"] * executed / model_flops
        source = f"{job.own['gpu']} {dtype} peak {peak:g} x MFU {job.own['mfu']:g}"
    step_flops = executed * job.global_batch * s
    by_formula = estimate.train_seconds(tokens, params, world, x, recompute=bool(checkpointed))
    print("\nCompute")
    print(
        f"  FLOPs per token: model {model_flops:.4g} (72 form), executed {executed:.4g}"
        + (f" (recomputing {checkpointed} layers)" if checkpointed else "")
    )
    print(f"  FLOPs per step:  {step_flops:.4g}")
    print(f"  X = {x:.1f} TFLOP/s per device ({source}): {step_flops / (world * x * 1e12):.3f} s per step")
    print(
        f"  {tokens:,.0f} tokens on {world} device(s): {tokens * executed / (world * x * 1e12) / 86400:,.1f} days "
        f"({8 if checkpointed else 6}TP/(nX), Narayanan et al. 2021: {by_formula / 86400:,.1f} days)"
    )


def main(argv: list[str]) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's estimators need no device: skip its probe
    job = load_job(argv)
    cfg, own = job.cfg, job.own
    model = meta_model(cfg.model)
    params, largest = estimate.count_parameters(model), estimate.largest_module_parameters(model)
    try:
        estimate.model_state_bytes(params, cfg.zero.stage, job.dp, cfg.offload.target, job.offload_params)
    except ValueError as err:
        fail(f"zero=stage{cfg.zero.stage} offload={cfg.offload.target}: {err}")
    peak = peak_tflops(own["gpu"], cfg.precision.dtype, cfg.metrics.peak_tflops)
    if own["tflops"] is None and peak is None:
        fail(f"gpu={own['gpu']} has no known {cfg.precision.dtype} peak: set tflops=X, or metrics.peak_tflops=")

    l, h = job.shape["n_layer"], job.shape["n_embd"]
    checkpointed = estimate.checkpointed_layers(l, cfg.checkpointing)
    ckpt = (
        "none"
        if not checkpointed
        else "full"
        if checkpointed == l
        else f"every {cfg.checkpointing.every_n_layers} layers"
    )
    s, world, gpn = cfg.data.block_size, own["world"], own["gpus_per_node"]
    print(
        f"{cfg.model.name} ({type(model).__name__}): engine={cfg.engine.name} zero=stage{cfg.zero.stage} "
        f"offload={cfg.offload.target} "
        f"precision={cfg.precision.dtype} checkpointing={ckpt}"
    )
    print(
        f"{world} rank(s) = {world // gpn} node(s) x {gpn}, {job.dp} data-parallel; {job.global_batch} sequences "
        f"({job.micro} per rank per micro batch) x {s} tokens = {job.global_batch * s:,} tokens per step"
    )

    formula = estimate.formula_parameters(l, h, job.shape["vocab_size"], job.shape["n_positions"])
    print("\nParameters")
    print(f"  exact (transformers, tied embedding once)      {params:>16,}")
    print(
        f"  12lh^2(1 + 13/12h + (V+s)/12lh) (Narayanan)    {formula:>16,.0f}   ({formula - params:+,.0f}; l={l} "
        f"h={h} V={job.shape['vocab_size']} s={job.shape['n_positions']})"
    )
    if cfg.model.family in ("llama", "mixtral"):
        print(
            "  (that formula and the FLOPs below are GPT-2's; Llama's SwiGLU MLP (3 n_embd x n_inner "
            "matrices), untied output embedding and rotary positions do not follow them: trust the exact count)"
        )
    print(f"  largest module (ZeRO-3 gathers it whole)       {largest:>16,}")
    print_model_states(job, params, largest)
    if cfg.model.family == "mixtral" and cfg.engine.name == "deepspeed":
        print_moe_states(job, params)
    print_fsdp2_states(job, model)
    print_real_shards(job)
    print_gradient_layout(job, params, estimate.optimizer_group_sizes(model))
    print_activations(job, model, checkpointed)
    print_compute(job, params, checkpointed, peak)


if __name__ == "__main__":
    main(sys.argv[1:])
