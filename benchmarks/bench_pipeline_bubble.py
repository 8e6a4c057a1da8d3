"""Every pipeline schedule's bubble on 2 CPU ranks, measured from timestamps around each action of
the schedule, beside the bubble its paper predicts from the measured F, B and W; a timeline per schedule.

    python benchmarks/bench_pipeline_bubble.py            # GPT-2 8x128, vocab 2048, m = 8, 4 timed steps (~3 min)
    python benchmarks/bench_pipeline_bubble.py --save     # writes benchmarks/results/ (.md, .json, .png)
    python benchmarks/bench_pipeline_bubble.py --quick    # smoke run: 4 layers, m = 4, 1 timed step

One launch; in it, for each schedule (pipeline=1f1b: DeepSpeed's PipelineEngine; gpipe,
1f1b_torch, interleaved, interleaved_zb, zbv, dualpipev: torch.distributed.pipelining via
lmrepo.engines.torch_pipeline) an engine is built exactly as train.py builds it, fp32, on the same
synthetic token blocks, p = 2 pipeline ranks (4 chunks, 2 per rank, for the multi-chunk schedules).
lmrepo.engines.pipeline_timeline times each action on each rank: F (forward, the loss included),
B (input-gradient backward), W (weight-gradient backward), BW (a full backward: schedules that do
not split it), comm (blocking waits on sends and receives); idle is the rest of the step. The
measured bubble is 1 - (F + B + W + BW) / step on each rank; the paper's, from the same step's
per-chunk, per-micro-batch F, B, W (bubble time, then over bubble + m v (F + B + W)):

- GPipe, 1F1B (DeepSpeed's and torch's): (p-1)/(m+p-1); interleaved 1F1B, v chunks: (p-1)/(v m+p-1);
- interleaved ZB (ZB-H1 / ZB1P, Qi et al. 2023, over v chunks): (p-1)(F + B - W);
- ZB-V (Qi et al. 2023, section 6): (p-1)(F + B - 2W), zero when F = B = W;
- DualPipeV (DeepSeek-V3 report, Table 2, DualPipe on 2p chunks): (p-1)(F&B + B_full - 3W), with
  F&B = F + B_full (no overlap of one micro-batch's forward with another's backward on a CPU).

Peak activations: the bytes of tensors autograd holds for backward at once on each rank during one
step (bench_pipeline.SavedTensors). Each rank runs one torch thread. Nothing here asserts a time.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from common import (  # benchmarks/common.py: puts the repository on sys.path
    RESULTS,
    Report,
    add_save_flag,
    rows_from_two_ranks,
)

SCHEDULES = ["1f1b", "gpipe", "1f1b_torch", "interleaved", "interleaved_zb", "zbv", "dualpipev"]
MODEL = [
    "model.n_layer=8",
    "model.n_head=4",
    "model.n_embd=128",
    "model.vocab_size=2048",
    "data.block_size=64",
    "trainer.micro_batch_size=4",
    "pipeline.partition=type:GPT2Block",
]
QUICK_MODEL = [
    "model.n_layer=4",
    "model.n_head=2",
    "model.n_embd=64",
    "model.vocab_size=1024",
    "data.block_size=32",
    "trainer.micro_batch_size=4",
    "pipeline.partition=type:GPT2Block",
]
KINDS = ("F", "B", "W", "BW", "comm")
COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#c44e52", "comm": "#bbbbbb"}


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, one timed step: a smoke run")
    parser.add_argument("--steps", type=int, help="timed steps per schedule (4; quick 1)")
    parser.add_argument("--micro-batches", type=int, help="micro-batches per step (8; quick 4)")
    add_save_flag(parser)
    parser.add_argument("--local_rank", help=argparse.SUPPRESS)  # the deepspeed launcher's flag
    parser.add_argument("--rows", help=argparse.SUPPRESS)  # where rank 0 writes the table and its rows
    return parser.parse_known_args()


# ---- worker: every measurement, on every rank ----------------------------------------------


def watch_waits(timeline) -> None:
    """torch's schedules wait on their sends and receives in one module function: time it as comm."""
    import torch.distributed.pipelining.schedules as schedules

    original = getattr(schedules._wait_batch_p2p, "__wrapped__", schedules._wait_batch_p2p)  # not the last one's
    schedules._wait_batch_p2p = timeline.timed(original, lambda a, k: ("comm", None, None))


def predicted(schedule: str, p: int, v: int, m: int, chunk: dict) -> float:
    """The paper's bubble fraction from one chunk's times for one micro-batch (F; B input-backward,
    W weight-backward, B + W the whole backward)."""
    if schedule in ("1f1b", "gpipe", "1f1b_torch", "interleaved"):
        return (p - 1) / (v * m + p - 1)
    f, b, w = chunk["F"], chunk["B"], chunk["W"]
    bubble = {
        "interleaved_zb": (p - 1) * (f + b - w),
        "zbv": (p - 1) * (f + b - 2 * w),
        "dualpipev": (p - 1) * ((f + b + w) + (b + w) - 3 * w),
    }[schedule]
    bubble = max(0.0, bubble)
    return bubble / (bubble + m * v * (f + b + w))


def measure(schedule: str, m: int, overrides: list[str], steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from bench_pipeline import SavedTensors
    from transformers import set_seed

    from lmrepo.distributed.device import detect_device
    from lmrepo.engines import build_engine
    from lmrepo.engines.deepspeed_pipeline import DeepSpeedPipelineEngine
    from lmrepo.plan.compose import compose_config
    from lmrepo.plan.job import plan

    chunks = [] if schedule in ("1f1b", "gpipe", "1f1b_torch") else ["pipeline.virtual_stages=2"]
    job = plan(
        compose_config(
            [*overrides, f"pipeline={schedule}", *chunks, f"trainer.grad_accum={m}", "precision=fp32", "logger=none"]
        ),
        dist.get_world_size(),
        detect_device("cpu"),
    )
    cfg = job.config
    generator = torch.Generator().manual_seed(0)
    shape = (cfg.trainer.micro_batch_size, cfg.data.block_size)
    batches = [
        {"input_ids": ids, "labels": ids}
        for ids in (torch.randint(0, cfg.model.vocab_size, shape, generator=generator) for _ in range(m))
    ]
    set_seed(cfg.trainer.seed)
    engine = build_engine(job)
    deepspeed = isinstance(engine, DeepSpeedPipelineEngine)
    if deepspeed:
        engine.ds.train()
    timeline = engine.timeline  # both pipeline engines time their schedule's actions
    watch_waits(timeline)

    def step():
        dist.barrier()  # every rank starts the step together
        engine.train_step(batches)

    step()  # warm-up: first-call allocations and the p2p handshakes
    records = []
    for _ in range(steps):
        step()
        seconds = {kind: timeline.seconds_in(kind) for kind in KINDS}
        seconds["step"] = timeline.span()
        seconds["idle"] = seconds["step"] - sum(seconds[k] for k in KINDS)
        seconds["bubble"] = timeline.bubble()
        records.append(seconds)
    actions = [(a.kind, a.start, a.end) for a in timeline.actions if a.kind in KINDS]  # the last step's
    params = engine.module.parameters() if deepspeed else engine.chunks.parameters()
    tracker = SavedTensors(list(params))
    with tracker.hooks():
        engine.train_step(batches)

    mine = {key: statistics.median(r[key] for r in records) for key in records[0]}
    mine["saved"], mine["actions"] = tracker.peak, actions
    mine["count"] = {kind: sum(1 for a in actions if a[0] == kind) for kind in ("B", "W", "BW")}  # every step alike
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    p, v = cfg.pipeline.stages, cfg.pipeline.virtual_stages

    # One chunk's times for one micro-batch, the mean over ranks: what the formulas take. F: every
    # chunk runs m forwards (a non-last chunk's loss call is a no-op); B, W, BW: the mean action,
    # DualPipeV mixing split and whole backwards.
    def per_action(kind: str) -> float:
        return statistics.mean(r[kind] / r["count"][kind] if r["count"][kind] else 0.0 for r in ranks)

    chunk = {"F": statistics.mean(r["F"] for r in ranks) / (m * v), **{k: per_action(k) for k in ("B", "W", "BW")}}
    return {
        "schedule": schedule,
        "m": m,
        "p": p,
        "v": v,
        "ranks": ranks,
        "chunk_ms": {k: x * 1e3 for k, x in chunk.items()},
        "predicted": predicted(schedule, p, v, m, chunk),
        "measured": statistics.mean(r["bubble"] for r in ranks),
    }


def run_worker(args, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from lmrepo.distributed.launch import init_distributed

    torch.set_num_threads(1)
    init_distributed()
    steps = args.steps or (1 if args.quick else 4)
    m = args.micro_batches or (4 if args.quick else 8)
    model = [*(QUICK_MODEL if args.quick else MODEL), *overrides]
    rows, load = [], os.getloadavg()[0]
    for schedule in SCHEDULES:
        rows.append(measure(schedule, m, model, steps))
        if dist.get_rank() == 0:
            print(f"bench: {schedule}: bubble {rows[-1]['measured']:.2f}", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        text = report(rows, model, (load, os.getloadavg()[0]))
        Path(args.rows).write_text(json.dumps({"text": text, "rows": rows, "model": model}))
    dist.destroy_process_group()


# ---- the table and the picture ------------------------------------------------------------


def report(rows: list[dict], model: list[str], load: tuple[float, float]) -> str:
    r0 = rows[0]
    lines = [
        f"\n## Bubble per schedule, 2 CPU ranks x 1 thread, p = {r0['p']}, m = {r0['m']}, fp32 ({' '.join(model)})\n",
        f"Machine load (1-minute average) {load[0]:.1f} at the start, {load[1]:.1f} at the end, on "
        f"{os.cpu_count()} cores. Times: the median over the timed steps, per rank, ms per step.\n",
        "| schedule | rank | F | B | W | BW | comm | idle | step | bubble measured | bubble paper | peak saved MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        name = r["schedule"] + (f" (v={r['v']})" if r["v"] > 1 else "")
        for rank, t in enumerate(r["ranks"]):
            cells = " | ".join(f"{t[k] * 1e3:.0f}" for k in (*KINDS, "idle", "step"))
            paper = f"{r['predicted']:.2f}" if rank == 0 else ""
            lines.append(f"| {name} | {rank} | {cells} | {t['bubble']:.2f} | {paper} | {t['saved'] / 2**20:.1f} |")
    lines += [
        "\nOne chunk's forward, input-backward, weight-backward and whole backward (BW, where not split) "
        "for one micro-batch (ms), the inputs of the papers' formulas, and the bubble averaged over the ranks:\n",
        "| schedule | F | B | W | BW | bubble measured | bubble paper |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        c = r["chunk_ms"]
        lines.append(
            f"| {r['schedule']} | {c['F']:.1f} | {c['B']:.1f} | {c['W']:.1f} | {c['BW']:.1f} "
            f"| {r['measured']:.2f} | {r['predicted']:.2f} |"
        )
    return "\n".join(lines)


IDLE = {"facecolor": "white", "edgecolor": "#999999", "hatch": "///", "linewidth": 0.5}  # what no action covers


def draw(rows: list[dict], path: Path) -> None:
    """One panel per schedule, one lane per rank, all on one time axis (ms since the step began):
    each action a bar in its kind's colour over a hatched lane, so idle time shows as hatching."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = len(rows[0]["ranks"])
    fig, axes = plt.subplots(
        len(rows), 1, figsize=(11, 0.55 * len(rows) * ranks + 1.6), sharex=True, layout="constrained"
    )
    for ax, r in zip(axes, rows):
        for rank, t in enumerate(r["ranks"]):
            # the step's span on this rank (the drawn step's actions may end past the median's): its idle time
            span = max([t["step"], *(end for _, _, end in t["actions"])]) * 1e3
            ax.barh(rank, span, left=0, height=0.8, **IDLE)
            for kind, start, end in t["actions"]:
                ax.barh(rank, (end - start) * 1e3, left=start * 1e3, color=COLOURS[kind], height=0.8)
        ax.set_yticks(range(ranks), [f"rank {i}" for i in range(ranks)], fontsize=8)
        ax.invert_yaxis()
        name = r["schedule"] + (f" (v={r['v']})" if r["v"] > 1 else "")
        ax.set_title(f"{name}: bubble {r['measured']:.2f} measured, {r['predicted']:.2f} paper", fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since the step began (one time axis for every schedule)")
    fig.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items()] + [Patch(label="idle", **IDLE)],
        loc="outside upper center",
        ncols=6,
        fontsize=8,
    )
    fig.savefig(path, dpi=110)


def main() -> None:
    args, overrides = parse_args()
    if "RANK" in os.environ:
        run_worker(args, overrides)
        return
    saved = Report(__file__)
    result = rows_from_two_ranks(__file__, sys.argv[1:])
    saved.print(result.pop("text"))
    p = saved.provenance
    picture = (
        RESULTS if args.save else Path(tempfile.gettempdir())
    ) / f"{saved.benchmark}_{p['machine']}_{p['date'][:7]}.png"
    picture.parent.mkdir(exist_ok=True)
    draw(result["rows"], picture)
    saved.print(f"\nTimeline of one step per schedule: {picture.name}")
    saved.save(args.save, result)  # with each rank's actions: the timeline can be drawn again from the .json


if __name__ == "__main__":
    main()
