"""FSDP2 against DeepSpeed ZeRO-2 and ZeRO-3 on the same job, side by side in one run: step time
and peak memory per rank, at two model sizes, on 2 ranks.

    python benchmarks/bench_fsdp2.py              # gpt2-tiny and GPT-2 124M, 2 rounds (~8 min on 2 cores)
    python benchmarks/bench_fsdp2.py --quick      # smoke run: a 2 x 64 model, 1 round, 4 steps (<1 min)
    python benchmarks/bench_fsdp2.py --save       # also write benchmarks/results/bench_fsdp2_<machine>_<month>.md

Each arm is a real `torchrun --nproc-per-node 2 train.py` run (fp32, logger=jsonl) of the same
model, data and global batch; the arms alternate within each round, so a shared machine's load
falls on all of them alike. Step time: the median over the logged steps after the first
`--warmup` (each step line's tokens over its tokens/s). Peak memory per rank: the largest
resident set of the run's ranks (getrusage of the waited-for children, which the launcher's
own small process does not reach), and `scripts/estimate.py`'s model-state figure for the same
layout beside it. On a GPU the `mem_gb` column (max allocated, rank 0) is the figure to read.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import Report, add_save_flag, two_rank_arm_in_child  # benchmarks/common.py

ARMS = {
    "DeepSpeed ZeRO-2": ["zero=stage2"],
    "DeepSpeed ZeRO-3": ["zero=stage3"],
    "FSDP2 (zero=stage2)": ["engine=fsdp2", "zero=stage2"],
    "FSDP2 (zero=stage3)": ["engine=fsdp2", "zero=stage3"],
}
MODELS = {
    "gpt2-tiny (16.1M)": ["model=gpt2-tiny", "data.block_size=128", "trainer.micro_batch_size=4"],
    "GPT-2 124M": ["model=gpt2", "data.block_size=128", "trainer.micro_batch_size=2"],
}
QUICK_MODELS = {"2 x 64 (3.3M)": ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "data.block_size=32"]}


def estimate_gib(model: list[str], arm: list[str]) -> float:
    """scripts/estimate.py's model-state memory per rank (fp32, 2 ranks) for the arm's layout."""
    from lmrepo.estimate import count_parameters, fsdp2_state_bytes, model_state_bytes
    from lmrepo.models import meta_model
    from lmrepo.plan.compose import load_config

    config = load_config([*model, *arm, "precision=fp32"])
    params = count_parameters(meta_model(config.model))
    if config.engine.name == "fsdp2":
        return fsdp2_state_bytes(params, 2, "fp32", keep_gathered=config.zero.stage == 2).gpu / 2**30
    return model_state_bytes(params, stage=config.zero.stage, dp=2, dtype="fp32").gpu / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 2 x 64 model, 1 round, 4 steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="step intervals left out of the median")
    add_save_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 4, 1
    models = QUICK_MODELS if args.quick else MODELS
    report = Report(__file__)
    results: dict = {model: {arm: [] for arm in ARMS} for model in models}
    with tempfile.TemporaryDirectory(prefix="bench_fsdp2-") as workdir:
        for model, model_overrides in models.items():
            for round_ in range(args.rounds):
                for arm, arm_overrides in ARMS.items():
                    print(f"bench_fsdp2: {model}, {arm}, round {round_ + 1}", file=sys.stderr, flush=True)
                    overrides = [*model_overrides, *arm_overrides]
                    results[model][arm].append(two_rank_arm_in_child(overrides, args.steps, Path(workdir)))
    figures = {}
    report.print(f"## FSDP2 against DeepSpeed ZeRO, 2 ranks, fp32, {args.rounds} round(s) of {args.steps} steps")
    report.print("")
    report.print("| model | arm | step time (median) | / ZeRO-3 | peak RSS per rank | model states (estimate) | loss |")
    report.print("| --- | --- | --- | --- | --- | --- | --- |")
    for model, arms in results.items():
        medians = {}
        for arm, runs in arms.items():
            times = [t for run in runs for t in run["step_times"][args.warmup :]]
            medians[arm] = statistics.median(times)
        for arm, runs in arms.items():
            peak = max((run["peak_rss_gib"] or 0) for run in runs)
            states = estimate_gib(models[model], ARMS[arm])
            ratio = medians[arm] / medians["DeepSpeed ZeRO-3"]
            report.print(
                f"| {model} | {arm} | {medians[arm]:.3f} s | {ratio:.2f} | {peak:.2f} GiB | {states:.3f} GiB | "
                f"{runs[-1]['loss']:.4f} |"
            )
            figures[f"{model} / {arm}"] = {
                "step_s": medians[arm],
                "ratio_to_zero3": ratio,
                "peak_rss_gib": peak,
                "model_states_gib": states,
                "runs": runs,
            }
    report.print("")
    report.print(
        "Peak RSS counts everything a rank holds (torch, its libraries, the data, activations), not only the "
        "sharded states; the estimate is the model states alone (parameters, gradients, optimizer states) as "
        "scripts/estimate.py counts them for each engine (FSDP2 at zero=stage2 with the whole model gathered)."
    )
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
