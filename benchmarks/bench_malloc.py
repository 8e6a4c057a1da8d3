"""The default job with glibc keeping freed memory (lmrepo.utils.cpu_malloc, the default on a CPU)
against glibc's own thresholds (`run.cpu_keep_freed_memory=false`), side by side in one run, on
this CPU as it is and with its native bf16 hidden (as on an AMD Zen 3: precision=auto picks fp32).

    python benchmarks/bench_malloc.py [--steps 20] [--rounds 2] [--out DIR] [--save]   # ~5 min on 2 cores

Each arm is `python train.py` (the default job) for --steps steps, the arms alternating for
--rounds rounds. Step time: the median over the logged steps after the first two (the first
builds kernels). Per process, from the kernel: system CPU seconds (page faults and zeroing) and
peak resident memory. Prints a table per CPU mode and the ratios keep / glibc.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from common import DEFAULT_JOB_TOKENS_PER_STEP as TOKENS_PER_STEP  # benchmarks/common.py
from common import NO_BF16, Report, add_save_flag, time_default_job


def run(run_dir: Path, keep: bool, steps: int, env: dict) -> dict:
    return time_default_job(run_dir, [f"run.cpu_keep_freed_memory={str(keep).lower()}"], steps, env, untimed=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__, device="cpu")
    if args.steps < 4:
        raise SystemExit("--steps must be >= 4 (the first two steps are not timed)")
    out = args.out or Path(tempfile.mkdtemp(prefix="lmrepo-bench-malloc-"))
    out.mkdir(parents=True, exist_ok=True)
    report.print(
        f"{args.steps} steps of the default job per process, {args.rounds} processes per arm, arms alternating.\n"
    )
    report.print(
        "| CPU | malloc | step s | tokens/s | system CPU s | user CPU s | peak RSS GB | last loss |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    figures = {"steps": args.steps, "rounds": args.rounds, "modes": {}}
    for mode, env in (("as it is", {}), ("native bf16 hidden (AVX2)", NO_BF16)):
        arms = {"keep": [], "glibc": []}
        for r in range(args.rounds):
            for arm in arms:
                arms[arm].append(run(out / f"{arm}-{len(env)}-{r}", arm == "keep", args.steps, env))
        median = {arm: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for arm, runs in arms.items()}
        for arm, m in median.items():
            label = "kept (lmrepo's default)" if arm == "keep" else "glibc's thresholds"
            report.print(
                f"| {mode} | {label} | {m['step_s']:.3f} | {TOKENS_PER_STEP / m['step_s']:,.0f} | {m['sys_s']:.1f} | "
                f"{m['user_s']:.1f} | {m['peak_gb']:.2f} | {m['loss']:.4f} |"
            )
        keep, glibc = median["keep"], median["glibc"]
        figures["modes"][mode] = {"runs": arms, "median": median}
        report.print(
            f"| {mode} | keep / glibc | **{keep['step_s'] / glibc['step_s']:.2f}x** step time | | "
            f"{keep['sys_s'] / glibc['sys_s']:.2f}x | {keep['user_s'] / glibc['user_s']:.2f}x | "
            f"**{keep['peak_gb'] / glibc['peak_gb']:.2f}x** | |"
        )
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
