"""One of DeepSpeed's CPU ops JIT-built from nothing three ways, side by side in one run:
DeepSpeed's own compile (c++, its -O3 -g flags), the test session's compiler
(tests/tools/g++-for-tests: no debug information, torch/extension.h precompiled once for an op
of many sources) and that compiler without the precompiled header (LMREPO_TEST_PCH=0).

    python benchmarks/bench_op_build.py [--op async_io] [--rounds 1] [--out DIR] [--save]   # ~7 min on 2 cores

Each build starts in an empty TORCH_EXTENSIONS_DIR; the arms alternate for --rounds rounds. Wall:
the building process from start to exit (ninja runs as many compiles as the machine has cores,
plus two); CPU: the kernel's account of it and every compile it waited for. async_io is what
the NVMe offload test builds (with pin_memory, built first); cpu_adam, fused_adam and shm
(ShareMemComm) have too few sources for a precompiled header and show the -g0 part alone.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import REPO, Report, add_save_flag, run_measured  # benchmarks/common.py

BUILDERS = {
    "async_io": "AsyncIOBuilder",
    "cpu_adam": "CPUAdamBuilder",
    "fused_adam": "FusedAdamBuilder",
    "shm": "ShareMemCommBuilder",
}
TESTS_CXX = str(REPO / "tests" / "tools" / "g++-for-tests")
ARMS = {
    "deepspeed (c++)": {"CXX": "c++"},
    "tests, -g0 only": {"CXX": TESTS_CXX, "LMREPO_TEST_PCH": "0"},
    "tests (g++-for-tests)": {"CXX": TESTS_CXX, "LMREPO_TEST_PCH": "1"},
}


def build(op: str, env: dict, out: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of building `op` with the compiler `env` names, in a fresh
    extensions dir."""
    load = f"from deepspeed.ops.op_builder import {BUILDERS[op]} as B; B().load(verbose=False)"
    wall, usage = run_measured(
        [sys.executable, "-c", load], out, {**env, "TORCH_EXTENSIONS_DIR": str(out / "extensions")}
    )
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(BUILDERS), default="async_io")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__, device="cpu")
    out = args.out or Path(tempfile.mkdtemp(prefix="lmrepo-bench-op-build-"))
    out.mkdir(parents=True, exist_ok=True)
    builds = {name: [] for name in ARMS}
    for r in range(args.rounds):
        for i, name in enumerate(ARMS if r % 2 == 0 else reversed(ARMS)):
            run_dir = out / f"round{r}-arm{i}"
            run_dir.mkdir()
            builds[name].append(build(args.op, ARMS[name], run_dir))
    report.print(f"DeepSpeed's {args.op} op built from nothing, {args.rounds} build(s) per compiler; medians.\n")
    report.print("| compiler | wall s | CPU s |\n| --- | --- | --- |")
    medians = {name: [statistics.median(x) for x in zip(*runs)] for name, runs in builds.items()}
    for name, (wall, cpu) in medians.items():
        report.print(f"| {name} | {wall:.1f} | {cpu:.1f} |")
    ds_wall, ds_cpu = medians["deepspeed (c++)"]
    report.print("")
    for name, (wall, cpu) in list(medians.items())[1:]:
        report.print(
            f"- {name} / deepspeed: wall {wall / ds_wall:.2f}x ({wall - ds_wall:+.1f} s), "
            f"CPU {cpu / ds_cpu:.2f}x ({cpu - ds_cpu:+.1f} s)"
        )
    report.save(
        args.save,
        {
            "op": args.op,
            "rounds": args.rounds,
            "builds": {name: [{"wall_s": w, "cpu_s": c} for w, c in runs] for name, runs in builds.items()},
            "median": {name: {"wall_s": w, "cpu_s": c} for name, (w, c) in medians.items()},
        },
    )


if __name__ == "__main__":
    main()
