"""The same model on 1-D, 2-D and 3-D layouts, side by side in one run: step time and memory per
rank, each beside scripts/estimate.py's figure for that layout.

    python benchmarks/bench_layouts.py            # a 4-block Llama, 4 and 8 ranks, 6 steps (~5 min on 2 cores)
    python benchmarks/bench_layouts.py --quick    # smoke run: 2 blocks of 64 tokens, 3 steps (~3.5 min)
    python benchmarks/bench_layouts.py --save     # also write benchmarks/results/bench_layouts_<machine>_<month>.md

engine=fsdp2, fp32, one global batch for every layout of a rank count: FSDP2 over all ranks, HSDP,
FSDP2 x tensor parallelism (as shipped: sequence-parallel norms and a vocabulary-parallel loss; and
the blocks' linears alone), a 1F1B pipeline x FSDP2 (4 ranks); FSDP2 over all, pipeline x data x
tensor and pipeline x HSDP (8 ranks). The ranks of one count start once and build, step and drop
one layout after another (as the suite's composition probe does); each layout's first step is not
timed. Per rank:

- activations: the most autograd kept during the last step, counted as it saves and frees
  (lmrepo.observability.saved_activations), beside lmrepo.estimate's count of the same layout (the forward of
  the model, or of the pipeline's layers, on fake tensors, times the micro batches in flight);
- model states: the parameter and Adam-state elements the rank holds, counted from its tensors
  (16 bytes each in fp32: parameter, gradient, two moments), beside the estimate's FSDP2 layout;
- peak resident set during the layout's steps (Linux: /proc/self/status VmHWM, reset per layout
  through clear_refs), which also holds torch, the data and the allocator's free memory; on a GPU
  CUDA's peak allocated memory instead.

Step time: the median of the timed steps, the slowest rank's (the ranks wait on each other).
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import REPO, Report, add_save_flag  # benchmarks/common.py

MODEL = [
    "model=llama-tiny",
    "model.n_layer=4",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.n_embd=128",
    "model.n_inner=352",
    "data.block_size=128",
    "trainer.micro_batch_size=1",
    "precision=fp32",
    "engine=fsdp2",
    "schedule=constant",
    "schedule.warmup_steps=0",
]
QUICK_MODEL = [*MODEL, "model.n_layer=2", "data.block_size=64"]
PIPELINE = ["pipeline=1f1b_torch", "pipeline.stages=2"]
TP_LINEARS = ["tp=auto", "tp.size=2", "tp.sequence_parallel=false", "tp.loss_parallel=false"]
LAYOUTS = {
    4: {
        "FSDP2 (dp_shard 4)": [],
        "HSDP (2 x 2)": ["engine.replicate=2"],
        "FSDP2 x TP (2 x 2)": ["tp=auto", "tp.size=2"],  # the norms split by tokens, the loss by vocabulary
        "FSDP2 x TP, linears only (2 x 2)": [*TP_LINEARS],
        "PP x FSDP2 (2 x 2)": PIPELINE,
    },
    8: {
        "FSDP2 (dp_shard 8)": [],
        "PP x FSDP2 x TP (2 x 2 x 2)": [*PIPELINE, "tp=auto", "tp.size=2"],
        "PP x HSDP (2 x 2 x 2)": [*PIPELINE, "engine.replicate=2"],
    },
}
GLOBAL_BATCH = 8
MIB = 2**20


# ---- the ranks: every layout of one rank count in one launch -------------------------------


def peak_resident_reset() -> None:
    """Linux: VmHWM restarts from the current resident set."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_resident_bytes() -> float | None:
    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return next(float(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))


def local_elements(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors)


def model_state_bytes(engine) -> float:
    """Parameters and Adam's moments this rank holds, counted from its tensors; gradients as many
    as parameters (they exist from backward to the optimizer step). fp32: 4 bytes each."""
    modules = getattr(engine, "chunks", None) or engine.module
    params = local_elements(modules.parameters())
    moments = local_elements(t for state in engine.optimizer.state.values() for t in state.values() if t.dim() > 0)
    return 4.0 * (2 * params + moments)


def run_layout(words: list[str], steps: int, tokenizer, sources) -> dict:
    import torch.distributed as dist
    from transformers import set_seed

    from lmrepo.distributed.launch import world_size
    from lmrepo.engines import build_engine
    from lmrepo.observability.saved_activations import SavedActivations
    from lmrepo.plan.compose import compose_config
    from lmrepo.plan.job import plan
    from lmrepo.run import engine_data

    job = plan(compose_config(words, run_dir=Path(tempfile.gettempdir()) / "bench_layouts-unused"), world_size())
    set_seed(job.config.trainer.seed)
    engine = build_engine(job)
    data = engine_data(job.config, job.ds_config, engine, sources, tokenizer)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    peak_resident_reset()
    saved, seconds, consumed = SavedActivations(), [], 0
    for _ in range(steps):
        batches = data.train_step(consumed)
        dist.barrier()
        start = time.perf_counter()
        with saved.step():
            engine.train_step(batches)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
        consumed += data.layout.global_batch
    row = {
        "seconds": seconds[1:],
        "activations": saved.last_step,
        "model_states": model_state_bytes(engine),
        "peak_resident": peak_resident_bytes(),
    }
    del engine, data
    gc.collect()
    return row


def ranks_main(cases_file: Path, out_file: Path, steps: int) -> None:
    import torch.distributed as dist

    from lmrepo.data.prepare import prepare_sources
    from lmrepo.data.tokenizer import load_tokenizer
    from lmrepo.distributed.launch import init_distributed, world_size
    from lmrepo.plan.compose import compose_config
    from lmrepo.plan.job import plan

    cases = json.loads(cases_file.read_text())
    init_distributed()
    first = compose_config(next(iter(cases.values())), run_dir=out_file.parent / "unused")
    tokenizer = load_tokenizer(first.model.tokenizer, None)
    sources = prepare_sources(plan(first, world_size()).config.data, tokenizer)
    gc.freeze()  # what the imports made stays out of the collections between layouts
    rows = {}
    for name, words in cases.items():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, run_layout(words, steps, tokenizer, sources))
        rows[name] = every
    if dist.get_rank() == 0:
        out_file.write_text(json.dumps(rows))
    dist.destroy_process_group()


# ---- the estimate of each layout --------------------------------------------------------------


def estimated(words: list[str], ranks: int) -> tuple:
    """(the layout, activations and model-state bytes per pipeline rank), as scripts/estimate.py
    plans the layout."""
    from lmrepo import estimate
    from lmrepo.distributed.layout import ParallelLayout
    from lmrepo.models import meta_model
    from lmrepo.plan.compose import load_config

    config = load_config(words)
    layout = ParallelLayout.of(config, ranks)
    micro = config.trainer.micro_batch_size
    _, activations = estimate.layout_activations(config, layout, micro, GLOBAL_BATCH // (micro * layout.dp))
    net = meta_model(config.model)
    states = [16 * held.per_rank(layout.dp_shard) for held in estimate.fsdp2_rank_parameters(net, config, layout)]
    return layout, activations, states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 blocks of 64 tokens, 3 steps")
    parser.add_argument("--steps", type=int, default=6, help="steps per layout (the first is not timed)")
    parser.add_argument("--ranks", type=int, nargs="+", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    parser.add_argument("--ranks-main", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    add_save_flag(parser)
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    if args.ranks_main:
        ranks_main(Path(args.ranks_main[0]), Path(args.ranks_main[1]), steps)
        return

    from lmrepo.distributed.launch import launch_command

    model = QUICK_MODEL if args.quick else MODEL
    report = Report(__file__)
    figures: dict = {}
    report.print(
        f"### Layouts of one model, engine=fsdp2, fp32, {GLOBAL_BATCH} sequences per step, {steps - 1} timed steps\n"
    )
    report.print(f"Model: `{' '.join(w for w in model if w.startswith(('model.', 'data.')))}`\n")
    report.print(
        "| ranks | layout | step time | rank | activations, measured | estimate | / estimate "
        "| model states, held | estimate | peak resident |"
    )
    report.print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for ranks in args.ranks:
        batch = f"trainer.global_batch_size={GLOBAL_BATCH}"
        cases = {name: [*model, batch, *words] for name, words in LAYOUTS[ranks].items()}
        with tempfile.TemporaryDirectory(prefix="bench_layouts-") as tmp:
            cases_file, out_file = Path(tmp) / "cases.json", Path(tmp) / "rows.json"
            cases_file.write_text(json.dumps(cases))
            command = [*launch_command(ranks, "torchrun"), __file__, "--ranks-main", str(cases_file), str(out_file)]
            code = subprocess.run([*command, "--steps", str(steps)], cwd=REPO, env=env).returncode
            if code:
                raise SystemExit(code)
            rows = json.loads(out_file.read_text())
        for name, words in cases.items():
            layout, activations, states = estimated(words, ranks)
            step = max(statistics.median(row["seconds"]) for row in rows[name])
            estimate = {"activations": activations, "model_states": states}
            figures[f"{ranks}: {name}"] = {"rows": rows[name], "estimate": estimate}
            for rank, row in enumerate(rows[name]):
                stage = layout.stage(rank)
                resident = f"{row['peak_resident'] / MIB:,.0f} MiB" if row["peak_resident"] else "n/a"
                report.print(
                    f"| {ranks} | {name} | {step * 1000:.0f} ms | {rank} | {row['activations'] / MIB:.2f} MiB "
                    f"| {activations[stage] / MIB:.2f} MiB | {row['activations'] / activations[stage]:.3f} "
                    f"| {row['model_states'] / MIB:.2f} MiB | {states[stage] / MIB:.2f} MiB | {resident} |"
                )
    report.print(
        "\nActivations: what autograd held for backward at its most during a step, counted on each rank;"
        " the estimate is scripts/estimate.py's for the layout. Model states: parameters, gradients and"
        " Adam's moments, 16 bytes per element the rank holds; the estimate divides each pipeline rank's"
        " share by its FSDP2 shards. The resident set also holds torch and the data."
    )
    report.save(args.save, figures)


if __name__ == "__main__":
    sys.exit(main())
