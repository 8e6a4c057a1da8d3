"""Sweep overhead, measured side by side: a direct `deepspeed --num_gpus 2 train.py` run against
the same job inside a `-m` sweep of 4 jobs through lmrepo's launcher.

    python benchmarks/bench_sweep.py [--ranks 2] [--out DIR] [--save]   # ~1.5 min on 2 cores

Prints the sweep's wall time and, per job, the time from its start to its first training step
against the direct run's (the launcher's overhead per job is the difference).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (  # benchmarks/common.py, first on sys.path: puts the repository on it
    REPO,
    TINY_JOB,
    Report,
    add_save_flag,
)
from lmrepo.distributed.launch import launch_command

TINY = [*TINY_JOB, "trainer.max_steps=6", "schedule.warmup_steps=1", "trainer.eval_batches=2"]


def first_step_time(run_dir: Path) -> float:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["time"]


def direct_run(out: Path, ranks: int) -> float:
    run_dir = out / "direct"
    started = time.time()
    subprocess.run(
        [*launch_command(ranks), str(REPO / "train.py"), *TINY, "zero=stage1", f"hydra.run.dir={run_dir}"],
        check=True,
        capture_output=True,
        cwd=out,
    )
    return first_step_time(run_dir) - started


def sweep_run(out: Path, ranks: int) -> tuple[float, list[tuple[str, float]]]:
    sweep_dir = out / "sweep"
    started = time.time()
    subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "-m",
            "zero=stage1,stage2",
            "precision=fp32,bf16",
            f"launcher.ranks={ranks}",
            *TINY,
            f"hydra.sweep.dir={sweep_dir}",
        ],
        check=True,
        capture_output=True,
        cwd=out,
    )
    wall = time.time() - started
    jobs = sorted((d for d in sweep_dir.iterdir() if d.is_dir()), key=lambda d: int(d.name))
    per_job = []
    for job in jobs:
        meta = json.loads((job / "job.json").read_text())
        per_job.append((meta["name"], first_step_time(job) - meta["started"]))
    return wall, per_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__)
    out = args.out or Path(tempfile.mkdtemp(prefix="lmrepo-bench-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    direct = direct_run(out, args.ranks)
    wall, per_job = sweep_run(out, args.ranks)
    mean = sum(s for _, s in per_job) / len(per_job)
    report.print(f"Direct `deepspeed` run, start to first step: {direct:.1f} s.")
    report.print(f"4-job sweep ({args.ranks} ranks per job): {wall:.1f} s wall.\n")
    report.print("| job | start to first step (s) | minus direct (s) |\n| --- | --- | --- |")
    for name, seconds in per_job:
        report.print(f"| {name} | {seconds:.1f} | {seconds - direct:+.1f} |")
    report.print(f"\nLauncher overhead per job (mean): {mean - direct:+.1f} s on {direct:.1f} s of start-up.")
    report.save(
        args.save,
        {
            "ranks": args.ranks,
            "direct_first_step_s": direct,
            "sweep_wall_s": wall,
            "jobs_first_step_s": dict(per_job),
            "overhead_per_job_s": mean - direct,
        },
    )


if __name__ == "__main__":
    main()
