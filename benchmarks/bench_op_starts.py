"""Five starts alternating between an activated venv (its ninja first on PATH) and a plain
`.venv/bin/python` (the system's ninja), each loading DeepSpeed's CPU all-reduce op, side by side
in one run: with torch's one shared extensions directory as DeepSpeed leaves it, and with
lmrepo's pin (lmrepo/utils/ops.py: a directory per interpreter, the interpreter's ninja first).

    python benchmarks/bench_op_starts.py [--starts 5] [--save]    # ~5 min on 2 cores

Each arm starts from an empty directory. A start that compiled is one whose load took over
10 s (a load of a built op takes well under one); the op's .so modification time says the same.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

from common import Report, add_save_flag, run_measured  # benchmarks/common.py

LOAD = "from deepspeed.ops.op_builder import ShareMemCommBuilder as B; B().load(verbose=False)"
PIN = "from lmrepo.utils import ops; ops.pin_builds(); "
BIN = str(Path(sys.executable).parent)


def start(pinned: bool, activated: bool, home: Path, run_dir: Path) -> float:
    """Seconds one process took to load the op, started activated or plain."""
    path = os.environ["PATH"].split(os.pathsep)
    path = [p for p in path if p != BIN]
    env = {
        "PATH": os.pathsep.join([BIN, *path] if activated else path),
        "XDG_CACHE_HOME": str(home),  # where lmrepo's pin puts its directory
        "TORCH_EXTENSIONS_DIR": "" if pinned else str(home / "torch_extensions" / "shared"),
        "CXX": "c++",  # DeepSpeed's own compiler, as a user's run has it
    }
    wall, _ = run_measured([sys.executable, "-c", (PIN if pinned else "") + LOAD], run_dir, env)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5)
    add_save_flag(parser)
    args = parser.parse_args()
    if not Path(BIN, "ninja").is_file():
        sys.exit(f"no ninja in {BIN}: run from lmrepo's .venv (make setup)")
    report = Report(__file__, device="cpu")
    out = Path(tempfile.mkdtemp(prefix="lmrepo-bench-op-starts-"))
    shared, pinned = "torch's shared directory", "lmrepo's pin"
    starts = {}
    for name in (shared, pinned):
        home = out / ("pinned" if name == pinned else "shared")
        starts[name] = []
        for i in range(args.starts):
            run_dir = home / f"start{i}"
            run_dir.mkdir(parents=True)
            starts[name].append(start(name == pinned, activated=i % 2 == 0, home=home, run_dir=run_dir))
    report.print(f"{args.starts} starts loading deepspeed_shm_comm, alternating activated / plain\n")
    report.print("| arm | seconds per start | builds |\n| --- | --- | --- |")
    builds = {name: sum(s > 10 for s in runs) for name, runs in starts.items()}
    for name, runs in starts.items():
        report.print(f"| {name} | {' / '.join(f'{s:.1f}' for s in runs)} | {builds[name]} |")
    total = {name: sum(runs) for name, runs in starts.items()}
    report.print(
        f"\n- {pinned}: {builds[pinned]} build(s) in {args.starts} starts, against {builds[shared]}; "
        f"all starts took {total[pinned] / total[shared]:.2f}x the time"
    )
    report.save(args.save, {"starts_s": starts, "builds": builds, "total_s": total})


if __name__ == "__main__":
    main()
