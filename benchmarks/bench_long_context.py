"""Long sequences on 2 ranks, side by side in one run: peak memory per rank and step time against
the block size, for sequence parallelism off (N=1: each rank trains whole sequences) and on (N=2:
the two ranks split every sequence, DeepSpeed Ulysses), each with and without the tiled loss.

    python benchmarks/bench_long_context.py            # blocks of 1k and 4k tokens, 8 runs (~7 min on 2 cores)
    python benchmarks/bench_long_context.py --quick    # smoke run: blocks of 256 and 512, 2 steps
    python benchmarks/bench_long_context.py --save     # also write benchmarks/results/bench_long_context_<...>.md

Every arm is a real `torchrun --nproc-per-node 2 train.py` run of the same small Llama (2 layers,
128 wide, the GPT-2 vocabulary of 50,257 tokens, whose logits are the largest tensor of a long
step), fp32, ZeRO-0, one sequence per micro batch. N=1 trains 2 sequences a step (one per rank),
N=2 one sequence: compare tokens/s, and memory per rank at the same block size. Peak memory per
rank is the largest resident set (getrusage's ru_maxrss) of the run's ranks, each arm run from a
fresh interpreter so an earlier arm's peak cannot hide a later one's; it counts everything a rank
holds (torch, the data, the model and optimizer states, activations). The default blocks stop at
4k tokens, to fit 10 minutes on a 2-core CPU shared with other work (attention's time grows with the square of the
block, the untiled N=1 arm's memory with the block times the vocabulary); --blocks picks others.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import Report, add_save_flag, two_rank_arm_in_child  # benchmarks/common.py

MODEL = [
    "model=llama-tiny",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_kv_head=4",
    "model.n_embd=128",
    "model.n_inner=352",
    "model.n_positions=16384",
    "trainer.micro_batch_size=1",
]
ARMS = {
    "N=1": [],
    "N=1, tiled loss": ["trainer.loss_tiles=8"],
    "N=2": ["sequence_parallel.size=2"],
    "N=2, tiled loss": ["sequence_parallel.size=2", "trainer.loss_tiles=8"],
}
BLOCKS, QUICK_BLOCKS = (1024, 4096), (256, 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="blocks of 256 and 512 tokens, 2 steps")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS), help="block sizes in tokens")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="the memory budget per rank of the last table")
    add_save_flag(parser)
    args = parser.parse_args()
    blocks = QUICK_BLOCKS if args.quick else tuple(args.blocks)
    steps = 2 if args.quick else args.steps
    report = Report(__file__)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_long_context-") as workdir:
        for block in blocks:  # the arms alternate within each block size: a shared machine's load falls on all
            for arm, arm_overrides in ARMS.items():
                print(f"bench_long_context: block {block}, {arm}", file=sys.stderr, flush=True)
                overrides = [*MODEL, f"data.block_size={block}", *arm_overrides]
                results[f"{block} / {arm}"] = two_rank_arm_in_child(overrides, steps, Path(workdir))
    report.print("## Peak memory per rank and step time against the block size, 2 ranks, fp32")
    report.print("")
    report.print("| block | arm | peak RSS per rank | / N=1 | step time | tokens/s | loss |")
    report.print("| --- | --- | --- | --- | --- | --- | --- |")
    figures = {}
    for block in blocks:
        base = results[f"{block} / N=1"]["peak_rss_gib"]
        for arm in ARMS:
            run = results[f"{block} / {arm}"]
            step = statistics.median(run["step_times"])
            figures[f"{block} / {arm}"] = {**run, "step_s": step, "tokens_per_s": run["tokens_per_step"] / step}
            peak = run["peak_rss_gib"]
            report.print(
                f"| {block} | {arm} | {peak:.2f} GiB | {peak / base:.2f} | {step:.2f} s | "
                f"{run['tokens_per_step'] / step:.0f} | {run['loss']:.4f} |"
            )
    report.print("")
    report.print(f"## The longest block that trained within {args.budget_gib} GiB per rank (of those measured)")
    report.print("")
    report.print("| arm | longest block | its peak RSS per rank |")
    report.print("| --- | --- | --- |")
    for arm in ARMS:
        fits = [b for b in blocks if results[f"{b} / {arm}"]["peak_rss_gib"] <= args.budget_gib]
        longest = max(fits) if fits else None
        peak = f"{results[f'{longest} / {arm}']['peak_rss_gib']:.2f} GiB" if longest else "-"
        report.print(f"| {arm} | {longest or f'none (< {min(blocks)})'} | {peak} |")
        figures[f"longest within budget / {arm}"] = longest
    report.print("")
    report.print(
        "N=1 trains one sequence per rank (2 a step), N=2 one sequence split over both ranks (1 a step). "
        "Tiled loss: trainer.loss_tiles=8. Peak RSS is the largest rank's resident set over the whole run."
    )
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
