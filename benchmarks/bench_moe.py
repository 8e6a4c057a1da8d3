"""A mixture of experts against the dense model of the same active parameters, side by side in
one run: step time and peak memory per rank on 2 ranks, with the experts on every rank
(expert_parallel.size=1) and split over both (2).

    python benchmarks/bench_moe.py              # mixtral-tiny and its dense twin, 2 rounds (~6 min on 2 cores)
    python benchmarks/bench_moe.py --quick      # smoke run: 1 round, 4 steps
    python benchmarks/bench_moe.py --save       # also write benchmarks/results/bench_moe_<machine>_<month>.md

The dense twin is llama-tiny with each block's SwiGLU as wide as the top_k experts a token runs
through (2 x 688): the same active parameters per token, the same FLOPs but the router's. Each
arm is a real `torchrun --nproc-per-node 2 train.py` run (fp32, ZeRO-2, logger=jsonl) of the same
data and global batch; arms alternate within each round. Step time: the median over the logged
steps after `--warmup`; peak memory: the largest rank's resident set (getrusage).
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import Report, add_save_flag, two_rank_arm_in_child  # benchmarks/common.py

SHARED = ["zero=stage2", "data.block_size=128", "trainer.micro_batch_size=4"]
ARMS = {
    "dense twin (llama-tiny, n_inner 1376)": ["model=llama-tiny", "model.n_inner=1376"],
    "MoE 8 experts, top-2, EP 1": ["model=mixtral-tiny"],
    "MoE 8 experts, top-2, EP 2": ["model=mixtral-tiny", "expert_parallel.size=2"],
}


def parameters(overrides: list[str]) -> tuple[int, int]:
    """(total, active per token) parameters of the arm's model: a token skips all but top_k experts."""
    from lmrepo.estimate import count_parameters
    from lmrepo.models import meta_model
    from lmrepo.plan.compose import load_config

    model = load_config([*SHARED, *overrides, "precision=fp32"]).model
    total = count_parameters(meta_model(model))
    if model.family != "mixtral":
        return total, total
    from lmrepo.models.mixtral import is_moe_block

    shape, moe = model.shape(), model.moe
    skipped_per_block = (moe.experts - moe.top_k) * 3 * shape["n_embd"] * model.n_inner
    return total, total - skipped_per_block * sum(is_moe_block(i, moe.every) for i in range(shape["n_layer"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round, 4 steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="step intervals left out of the median")
    add_save_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 4, 1
    report = Report(__file__)
    runs: dict = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="bench_moe-") as workdir:
        for round_ in range(args.rounds):
            for arm, overrides in ARMS.items():
                print(f"bench_moe: {arm}, round {round_ + 1}", file=sys.stderr, flush=True)
                runs[arm].append(two_rank_arm_in_child([*SHARED, *overrides], args.steps, Path(workdir)))
    dense = next(iter(ARMS))
    medians = {
        arm: statistics.median(t for run in rs for t in run["step_times"][args.warmup :]) for arm, rs in runs.items()
    }
    report.print(f"## MoE against its dense twin, 2 ranks, fp32, ZeRO-2, {args.rounds} round(s) of {args.steps} steps")
    report.print("")
    report.print("| arm | parameters (total / active) | step time (median) | / dense | peak RSS per rank | loss |")
    report.print("| --- | --- | --- | --- | --- | --- |")
    figures = {}
    for arm, rs in runs.items():
        total, active = parameters(ARMS[arm])
        peak = max((run["peak_rss_gib"] or 0) for run in rs)
        ratio = medians[arm] / medians[dense]
        report.print(
            f"| {arm} | {total / 1e6:.1f}M / {active / 1e6:.1f}M | {medians[arm]:.3f} s | {ratio:.2f} | "
            f"{peak:.2f} GiB | {rs[-1]['loss']:.4f} |"
        )
        figures[arm] = {"params": total, "active_params": active, "step_s": medians[arm], "ratio_to_dense": ratio,
                        "peak_rss_gib": peak, "runs": rs}  # fmt: skip
    report.print(
        "\nThe same active parameters do the same matrix FLOPs per token; an MoE step adds the router, the "
        "dispatch of tokens to experts (an all-to-all across the expert-parallel ranks) and more parameters "
        "in memory. On 2 CPU cores the experts' small matrices run below the dense layer's efficiency; "
        "grouped-GEMM expert kernels are GPU-only."
    )
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
