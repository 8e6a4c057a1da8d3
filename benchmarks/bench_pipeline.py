"""Pipeline schedules side by side on 2 CPU ranks: step time, measured bubble against the
schedules' theory, and activations held for backward per stage (GPipe against 1F1B).

    python benchmarks/bench_pipeline.py          # GPT-2 8x128, vocab 2048, 64 tokens x 4 per micro-batch (~3 min)
    python benchmarks/bench_pipeline.py --steps 12 --save   # more timed steps; writes benchmarks/results/
    python benchmarks/bench_pipeline.py --quick  # smoke run: 4 layers, m = 2 and 4, 1 + 2 steps (<1 min)
    python benchmarks/bench_pipeline.py model.n_embd=256     # train.py's overrides change the model

One `deepspeed --num_gpus 2` launch; in it, for each schedule (pipeline=1f1b: DeepSpeed's
PipelineEngine; gpipe, 1f1b_torch, interleaved: torch.distributed.pipelining via
lmrepo.engines.torch_pipeline) and m = 2, 4, 8 micro-batches, an engine is built exactly as
train.py builds it (lmrepo.plan.job.plan -> lmrepo.engines.build_engine), fp32, on synthetic token blocks:

- step: the median over timed steps of the slowest rank's train_batch wall time;
- t_micro: forward + backward of one micro-batch through one rank's layers alone (no pipeline,
  no communication), on both ranks at once, the slower rank's; timed right after each timed
  step, so both see the same load of a shared machine;
- bubble: 1 - m x t_micro / step for each timed step and the micro-batch timed right after it,
  the median over those pairs (it also holds the optimizer step and the communication),
  against (p-1)/(m+p-1) (interleaved with v chunks per rank: (p-1)/(v m+p-1));
- saved MB: the peak bytes of tensors saved for backward alive at once on each stage
  (torch.autograd.graph.saved_tensors_hooks; a weakref finalizer on each saved tensor's holder
  tells when backward released it; parameters are not counted); "in flight" divides that by
  one micro-batch's saved bytes: GPipe holds all m micro-batches, 1F1B at most p.

Each rank runs one torch thread (2 ranks on 2 cores). Nothing here asserts a time.
"""

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

from common import (  # benchmarks/common.py, first on sys.path: puts the repository on it
    Report,
    add_save_flag,
    rows_from_two_ranks,
)

SCHEDULES = ["1f1b", "gpipe", "1f1b_torch", "interleaved"]
MICRO_BATCHES, QUICK_MICRO_BATCHES = [2, 4, 8], [2, 4]
MODEL = [
    "model.n_layer=8",
    "model.n_head=4",
    "model.n_embd=128",
    "model.vocab_size=2048",
    "data.block_size=64",
    "trainer.micro_batch_size=4",
]
QUICK_MODEL = [
    "model.n_layer=4",
    "model.n_head=2",
    "model.n_embd=64",
    "model.vocab_size=1024",
    "data.block_size=32",
    "trainer.micro_batch_size=4",
]


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps: a smoke run")
    parser.add_argument("--steps", type=int, help="timed steps per schedule and m (8; quick 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (2; quick 1)")
    add_save_flag(parser)
    parser.add_argument("--local_rank", help=argparse.SUPPRESS)  # the deepspeed launcher's flag
    parser.add_argument("--rows", help=argparse.SUPPRESS)  # where rank 0 writes the table and its rows
    return parser.parse_known_args()


# ---- activations saved for backward --------------------------------------------------------


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedTensors:
    """Bytes of the storages autograd holds for backward, at once: counted when a forward saves
    a tensor, released when backward drops its holder. One storage saved twice counts once."""

    def __init__(self, parameters):
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self.live, self.current, self.peak = {}, 0, 0

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda holder: holder.tensor)

    def _pack(self, tensor):
        holder = _Holder(tensor)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.excluded or tensor.device.type == "meta":
            return holder
        if ptr not in self.live:
            self.live[ptr] = [storage.nbytes(), 0]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.live[ptr][1] += 1
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]


# ---- worker: every measurement, on every rank ----------------------------------------------


def rank_layers(cfg):
    """This rank's chunks as the torch engine cuts them (the DeepSpeed split is the same: one chunk per rank)."""
    import torch.distributed as dist

    from lmrepo.engines.torch_pipeline import Chunk, build_layer, partition
    from lmrepo.models import build_model, pipe

    net = build_model(cfg.model)
    layers = pipe.pipeline_layers(net, cfg.model.family)
    stages, virtual = cfg.pipeline.stages, cfg.pipeline.virtual_stages
    parts = partition(layers, stages * virtual, cfg.pipeline.partition_method)
    rank = dist.get_rank() // (dist.get_world_size() // stages)
    chunks = [
        (c, Chunk({i: build_layer(layers[i]) for i in range(parts[c], parts[c + 1])}))
        for c in range(rank, stages * virtual, stages)
    ]
    return chunks, len(parts) - 1, pipe.LMLoss(cfg.model.family, net.config.vocab_size)


def micro_step(cfg, ids):
    """(run, saved bytes): `run()` is forward + backward of one micro-batch through this rank's
    layers alone (every chunk's forward, then the backwards: all its activations held at once)."""
    import torch

    chunks, n_chunks, loss_fn = rank_layers(cfg)
    hidden_shape = (*ids.shape, cfg.model.n_embd)

    def run():
        outputs = [(c, chunk(ids if c == 0 else torch.randn(hidden_shape, requires_grad=True))) for c, chunk in chunks]
        for c, out in reversed(outputs):
            if c == n_chunks - 1:
                loss_fn(out, ids).backward()
            else:
                out.backward(torch.randn_like(out))

    tracker = SavedTensors([p for _, chunk in chunks for p in chunk.parameters()])
    run()
    with tracker.hooks():
        run()
    return run, tracker.peak


def slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    elapsed = torch.tensor(seconds)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def timed(function) -> float:
    """Wall seconds of function() on the slowest rank, all ranks starting together."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    function()
    return slowest(time.perf_counter() - start)


def measure(schedule: str, m: int, overrides: list[str], steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import set_seed

    from lmrepo.distributed.device import detect_device
    from lmrepo.engines import build_engine
    from lmrepo.engines.deepspeed_pipeline import DeepSpeedPipelineEngine
    from lmrepo.engines.torch_pipeline import TorchPipelineEngine
    from lmrepo.plan.compose import compose_config
    from lmrepo.plan.job import plan

    job = plan(
        compose_config(
            [
                *overrides,
                f"pipeline={schedule}",
                f"trainer.grad_accum={m}",
                "precision=fp32",
                "trainer.device=cpu",
                "logger=none",
            ]
        ),
        dist.get_world_size(),
        detect_device("cpu"),
    )
    cfg = job.config
    generator = torch.Generator().manual_seed(0)
    shape = (cfg.trainer.micro_batch_size, cfg.data.block_size)
    # GPT-2's loss shifts the labels itself; a pipeline feeds its first stage the inputs, its last the labels
    batches = [
        {"input_ids": ids, "labels": ids}
        for ids in (torch.randint(0, cfg.model.vocab_size, shape, generator=generator) for _ in range(m))
    ]

    set_seed(cfg.trainer.seed)
    engine = build_engine(job)
    assert isinstance(engine, (DeepSpeedPipelineEngine, TorchPipelineEngine)), type(engine)
    (engine.ds if isinstance(engine, DeepSpeedPipelineEngine) else engine).train()
    micro, micro_bytes = micro_step(cfg, batches[0]["input_ids"])
    for _ in range(warmup):
        engine.train_step(batches)  # one train_batch of the m micro-batches
    # Paired in time: each step is followed by one micro-batch through this rank's layers alone,
    # so a busy moment of a shared machine slows both.
    step_times, micro_times = [], []
    for _ in range(steps):
        step_times.append(timed(lambda: engine.train_step(batches)))
        micro_times.append(timed(micro))
    params = engine.module.parameters() if isinstance(engine, DeepSpeedPipelineEngine) else engine.chunks.parameters()
    tracker = SavedTensors(list(params))
    with tracker.hooks():
        engine.train_step(batches)

    saved = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(saved, torch.tensor([float(tracker.peak), float(micro_bytes)]))
    p, v = cfg.pipeline.stages, cfg.pipeline.virtual_stages
    bubbles = [1 - m * micro / step for step, micro in zip(step_times, micro_times)]
    return {
        "schedule": schedule,
        "m": m,
        "p": p,
        "v": v,
        "step": statistics.median(step_times),
        "t_micro": statistics.median(micro_times),
        "bubble": statistics.median(bubbles),
        "theory": (p - 1) / (v * m + p - 1),
        "saved": [s[0].item() for s in saved],
        "micro_saved": [s[1].item() for s in saved],
    }


def run_worker(args, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from lmrepo.distributed.launch import init_distributed

    torch.set_num_threads(1)
    init_distributed()
    steps = args.steps or (2 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    model = [*(QUICK_MODEL if args.quick else MODEL), *overrides]
    rows, load = [], os.getloadavg()[0]
    for schedule in SCHEDULES:
        for m in QUICK_MICRO_BATCHES if args.quick else MICRO_BATCHES:
            rows.append(measure(schedule, m, model, steps, warmup))
            if dist.get_rank() == 0:
                r = rows[-1]
                print(f"bench: {schedule} m={m}: step {r['step'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        text = report(rows, model, (load, os.getloadavg()[0]))
        Path(args.rows).write_text(json.dumps({"text": text, "rows": rows, "model": model}))
    dist.destroy_process_group()


# ---- the table -------------------------------------------------------------------------------

ENGINES = {
    "1f1b": "DeepSpeed PipelineEngine",
    "gpipe": "torch ScheduleGPipe",
    "1f1b_torch": "torch Schedule1F1B",
    "interleaved": "torch ScheduleInterleaved1F1B",
}


def report(rows: list[dict], model: list[str], load: tuple[float, float]) -> str:
    mb = 2**20
    lines = [
        f"\n## Pipeline schedules, 2 CPU ranks x 1 thread, p = 2 stages, fp32 ({' '.join(model)})\n",
        f"Machine load (1-minute average) {load[0]:.1f} at the start, {load[1]:.1f} at the end, on "
        f"{os.cpu_count()} cores.\n",
        "| schedule | engine | m | step ms | t_micro ms | bubble measured | bubble theory "
        "| saved MB stage 0 / 1 | in flight stage 0 / 1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        flight = [s / u if u else float("nan") for s, u in zip(r["saved"], r["micro_saved"])]
        name = r["schedule"] + (f" (v={r['v']})" if r["v"] > 1 else "")
        lines.append(
            f"| {name} | {ENGINES[r['schedule']]} | {r['m']} | {r['step'] * 1e3:.0f} | {r['t_micro'] * 1e3:.1f} "
            f"| {r['bubble']:.2f} | {r['theory']:.2f} | {r['saved'][0] / mb:.1f} / {r['saved'][-1] / mb:.1f} "
            f"| {flight[0]:.1f} / {flight[-1]:.1f} |"
        )
    by = {(r["schedule"], r["m"]): r for r in rows}
    lines += [
        "\nPeak saved activations, GPipe / 1F1B (torch, same run):\n",
        "| m | stage 0 | stage 1 |",
        "| --- | --- | --- |",
    ]
    for m in sorted({r["m"] for r in rows}):
        g, f = by.get(("gpipe", m)), by.get(("1f1b_torch", m))
        if g and f:
            lines.append(f"| {m} | {g['saved'][0] / f['saved'][0]:.2f} | {g['saved'][-1] / f['saved'][-1]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    args, overrides = parse_args()
    if "RANK" in os.environ:
        run_worker(args, overrides)
        return
    saved = Report(__file__)
    result = rows_from_two_ranks(__file__, sys.argv[1:])
    saved.print(result.pop("text"))
    saved.save(args.save, result)


if __name__ == "__main__":
    main()
