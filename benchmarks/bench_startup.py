"""What a rank spends before its first step, side by side in one run (rounds interleaved):

1. train.py's imports (torch, transformers, lmrepo) with the cyclic collector as Python leaves
   it, against off during the import and the result frozen (what train.py does).
2. py-cpuinfo asked as DeepSpeed asks it (a probe process that times the clock), against
   lmrepo.utils.cpuinfo_cache's kept answer; and how many asks loading DeepSpeed's CPU Adam makes.
3. A whole tiny `offload=cpu` run of train.py, before (the two changes undone from outside:
   gc.disable/gc.freeze and cpuinfo_cache.install made no-ops) and after: the CPU seconds of the
   process and the seconds from its start to its first step.

Also what the collector has to walk: how often it runs during the import, and the objects the
import leaves behind.

    python benchmarks/bench_startup.py [--rounds 3] [--save]   # ~2.5 min on 2 cores

CPU seconds are the child's own (getrusage), so the figures hold on a busy machine too.
"""

import argparse
import json
import os
import resource
import statistics
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

IMPORTS = {
    "collector on (Python's default)": "import lmrepo.run",
    "off, then frozen (train.py)": "import gc; gc.disable(); import lmrepo.run; gc.freeze(); gc.enable()",
}
COUNT_COLLECTIONS = (
    "import gc; import lmrepo.run\nprint(sum(s['collections'] for s in gc.get_stats()), len(gc.get_objects()))"
)
ASKS = {
    "py-cpuinfo (DeepSpeed's ask)": "import cpuinfo; cpuinfo.get_cpu_info()",
    "lmrepo.utils.cpuinfo_cache (kept)": "from lmrepo.utils import cpuinfo_cache; cpuinfo_cache.install(); "
    "import cpuinfo; cpuinfo.get_cpu_info()",
}
COUNT_ASKS = (
    "import cpuinfo, torch; asks = []; ask = cpuinfo.get_cpu_info\n"
    "cpuinfo.get_cpu_info = lambda: asks.append(1) or ask()\n"
    "from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
    "DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(1))]); print(len(asks))"
)
# train.py as it was before both changes: the same file, the two start-up savings made no-ops
BEFORE = (
    "import gc, runpy, sys; gc.disable = gc.freeze = lambda: None\n"
    "from lmrepo.utils import cpuinfo_cache; cpuinfo_cache.install = lambda: None\n"
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
AFTER = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
TINY = [
    *TINY_JOB,
    "trainer.max_steps=3",
    "schedule.warmup_steps=1",
    "trainer.eval_batches=1",
    "precision=fp32",
    "zero=stage2",
    "offload=cpu",
]


def cpu_seconds(args: list[str], env: dict) -> tuple[float, float, str]:
    """(CPU seconds of the child, its wall seconds, its stdout)."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"bench_startup: {' '.join(args)[:200]} failed:\n{proc.stderr[-2000:]}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, time.time() - start, proc.stdout


def side_by_side(arms: dict[str, list[str]], rounds: int, env: dict, after_each=None) -> dict[str, list[float]]:
    """Median CPU seconds (and wall, first step...) per arm, the arms interleaved round by round."""
    seen = {name: [] for name in arms}
    for _ in range(rounds):
        for name, args in arms.items():
            started = time.time()
            cpu, wall, _ = cpu_seconds(args, env)
            seen[name].append((cpu, wall, after_each(started) if after_each else None))
    return seen


def pair_table(report: Report, title: str, seen: dict, unit: str = "CPU s") -> dict:
    """Prints the arms' medians, each round's figure and the second arm's ratio to the first;
    returns the medians."""
    report.print(f"\n## {title}\n")
    report.print(f"| arm | median {unit} | rounds |\n| --- | --- | --- |")
    medians = {name: statistics.median(c for c, *_ in rows) for name, rows in seen.items()}
    for name, rows in seen.items():
        report.print(f"| {name} | {medians[name]:.2f} | {', '.join(f'{c:.2f}' for c, *_ in rows)} |")
    first, second = medians.values()
    report.print(f"\nRatio {second / first:.2f} ({first - second:+.2f} {unit} a process).")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__)
    figures = {"rounds": args.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "LMREPO_CACHE": tmp, "PYTHONPATH": str(REPO)}
        imports = side_by_side({k: ["-c", v] for k, v in IMPORTS.items()}, args.rounds, env)
        figures["imports_cpu_s"] = pair_table(report, "1. Importing torch, transformers and lmrepo.run", imports)
        collections, objects = map(int, cpu_seconds(["-c", COUNT_COLLECTIONS], env)[2].split()[-2:])
        figures.update(collections_during_import=collections, objects_after_import=objects)
        report.print(
            f"\nWith the collector on, it runs {collections:,} times during that import, over a heap that ends "
            f"with {objects:,} tracked objects."
        )
        cpu_seconds(
            ["-c", ASKS["lmrepo.utils.cpuinfo_cache (kept)"]], env
        )  # the first process asks and keeps the answer
        asks = side_by_side({k: ["-c", v] for k, v in ASKS.items()}, args.rounds, env)
        figures["cpuinfo_cpu_s"] = pair_table(
            report, "2. What is this CPU? (one ask; each process also pays `import cpuinfo`)", asks
        )
        counted = int(cpu_seconds(["-c", COUNT_ASKS], {**env, "DS_ACCELERATOR": "cpu"})[2].split()[-1])
        figures["cpuinfo_asks_cpu_adam"] = counted
        report.print(
            f"\nLoading DeepSpeed's CPU Adam (offload=cpu) asks {counted} times: each rank of an offload run paid "
            "the first arm that often; with the cache, the machine's first process asks once."
        )

        def first_step(started: float) -> float:
            run_dir = Path(tmp) / "run"
            seconds = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["time"] - started
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            return seconds

        train = [str(REPO / "train.py"), *TINY, f"hydra.run.dir={Path(tmp) / 'run'}"]
        runs = side_by_side(
            {"before (both undone)": ["-c", BEFORE, *train], "after": ["-c", AFTER, *train]},
            args.rounds,
            env,
            after_each=first_step,
        )
        figures["train_cpu_s"] = pair_table(
            report, "3. python train.py (tiny GPT-2, zero=stage2 offload=cpu, 3 steps): the whole process", runs
        )
        seconds = {name: statistics.median(s for *_, s in rows) for name, rows in runs.items()}
        figures["train_first_step_s"] = seconds
        report.print(
            "\nStart to first step: "
            + ", ".join(f"{name} {s:.2f} s" for name, s in seconds.items())
            + f"; ratio {seconds['after'] / seconds['before (both undone)']:.2f}."
        )
    # each arm's rounds: (CPU s, wall s, start to first step s or None)
    figures["rounds_raw"] = {"imports": imports, "cpuinfo": asks, "train": runs}
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
