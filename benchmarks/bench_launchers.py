"""The same 2-rank run started by DeepSpeed's launcher, by torchrun and with no launcher (the ranks
started directly, as srun starts them: tests/tools/start_ranks.py, which the test suite uses where
the launcher is not under test), side by side in one run: what each launcher adds around the ranks,
in wall time and CPU time.

    python benchmarks/bench_launchers.py [--rounds 3] [--ranks 2] [--out DIR] [--save]   # ~3 min on 2 cores

Each arm is a tiny GPT-2 (2 layers, 64 wide, 32-token blocks, fp32, 6 steps) on --ranks CPU
ranks; the arms alternate for --rounds rounds. Wall: from the launcher's start to its exit. CPU:
the kernel's account of the launcher and every process it waited for (ranks included). DeepSpeed's
runner and its launch.py each import all of DeepSpeed before a rank starts, and launch.py polls
its ranks once a second; torchrun imports torch once and polls every 0.1 s; the direct start imports
neither. The ranks run alike under all three (lmrepo.distributed.launch gives DeepSpeed's shared-memory
all-reduce LOCAL_SIZE where DeepSpeed's launcher does not).
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import REPO, TINY_JOB, Report, add_save_flag, run_measured  # benchmarks/common.py
from lmrepo.distributed.launch import launch_command

TINY = [*TINY_JOB, "trainer.max_steps=6", "trainer.eval_batches=2", "precision=fp32"]
START_RANKS = REPO / "tests" / "tools" / "start_ranks.py"


def command(launcher: str, ranks: int) -> list[str]:
    if launcher == "direct":
        return [sys.executable, str(START_RANKS), str(ranks)]
    return launch_command(ranks, launcher)


def run(launcher: str, ranks: int, run_dir: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one launch."""
    wall, usage = run_measured(
        [*command(launcher, ranks), str(REPO / "train.py"), *TINY, f"hydra.run.dir={run_dir}"], run_dir
    )
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__)
    out = args.out or Path(tempfile.mkdtemp(prefix="lmrepo-bench-launchers-"))
    out.mkdir(parents=True, exist_ok=True)
    arms = {"deepspeed": [], "torchrun": [], "direct": []}
    run("torchrun", args.ranks, out / "warmup")  # builds DeepSpeed's ops and tokenizes once, untimed
    for r in range(args.rounds):
        for launcher in arms if r % 2 == 0 else reversed(arms):
            arms[launcher].append(run(launcher, args.ranks, out / f"{launcher}{r}"))
    report.print(
        f"A {args.ranks}-rank TINY run (6 steps), {args.rounds} launches per launcher, alternating; medians.\n"
    )
    report.print("| launcher | wall s | CPU s |\n| --- | --- | --- |")
    medians = {}
    for launcher, runs in arms.items():
        medians[launcher] = [statistics.median(x) for x in zip(*runs)]
        name = "none (the ranks started directly)" if launcher == "direct" else launcher
        report.print(f"| {name} | {medians[launcher][0]:.2f} | {medians[launcher][1]:.2f} |")
    base_wall, base_cpu = medians["direct"]
    report.print("")
    for launcher in ("deepspeed", "torchrun"):
        wall, cpu = medians[launcher]
        report.print(
            f"{launcher} / ranks started directly: wall {wall / base_wall:.2f}x (+{wall - base_wall:.2f} s), "
            f"CPU {cpu / base_cpu:.2f}x (+{cpu - base_cpu:.2f} s) per launch"
        )
    report.save(
        args.save,
        {
            "ranks": args.ranks,
            "rounds": args.rounds,
            "launches": {k: [{"wall_s": w, "cpu_s": c} for w, c in runs] for k, runs in arms.items()},
            "median": {k: {"wall_s": w, "cpu_s": c} for k, (w, c) in medians.items()},
        },
    )


if __name__ == "__main__":
    main()
