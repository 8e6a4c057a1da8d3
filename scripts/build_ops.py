"""Compiles DeepSpeed's C++ ops for this machine now, side by side, so that no run waits for them.

    python scripts/build_ops.py                       # shm cpu_adam async_io fused_adam: what make setup runs
    python scripts/build_ops.py shm                   # or only some

shm: the CPU all-reduce every multi-rank CPU run uses; cpu_adam: offload=cpu and offload=nvme;
async_io: offload=nvme (needs libaio); fused_adam: a DeepSpeed JSON whose Adam asks for DeepSpeed's
own keys. Each takes one to a few minutes on 2 cores, once per
machine: the builds are kept in the machine's cache (lmrepo/utils/ops.py says where and under which
key), and every later checkout or venv with the same DeepSpeed, torch, compiler and CPU loads
them from there. A run that needs an op not built yet says so in one line before compiling it.

Unless CXX is set, the compiles go through tests/tools/g++-for-tests: the same sources, flags
and code, without debug information and with torch's header parsed once per op (about half the
time; benchmarks/bench_op_build.py measures it).
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

from lmrepo.utils import ops, quiet

REPO = Path(__file__).resolve().parents[1]
FAST_CXX = REPO / "tests" / "tools" / "g++-for-tests"


def build_one(name: str) -> None:
    quiet.install()  # not DeepSpeed's accelerator notice from each worker
    ops.pin_builds()
    ops.announce_builds()
    ops.build(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", metavar="OP", help=" | ".join(ops.BUILDERS) + " (default: all)")
    parser.add_argument("--one", choices=sorted(ops.BUILDERS), help=argparse.SUPPRESS)  # a worker of the parallel build
    args = parser.parse_args()
    if unknown := [name for name in args.ops if name not in ops.BUILDERS]:
        parser.error(
            f"unknown op {unknown[0]!r}: choose from {', '.join(ops.BUILDERS)}"
        )  # argparse's choices refuse []
    if args.one:
        build_one(args.one)
        return 0
    names = args.ops or list(ops.BUILDERS)
    to_build = missing(names)
    if to_build is None:
        print("lmrepo: DeepSpeed's accelerator here is not the CPU: its CPU ops are not built ahead")
        return 0
    if not to_build:
        print(f"lmrepo: DeepSpeed's ops ({', '.join(names)}) are built for this machine already")
        return 0
    high = max(ops.OPS[name][2][1] for name in ops.OPS if ops.OPS[name][0] in to_build)
    print(
        f"lmrepo: building DeepSpeed's {', '.join(to_build)} ops side by side, once for this machine "
        f"(up to ~{-(-high // 60)} min on 2 cores; kept in {ops.machine_cache() or ops.build_root()})",
        flush=True,
    )
    env = {**os.environ, "LMREPO_BUILDING_AHEAD": "1"}  # the workers' lines do not send the user to make setup
    env.setdefault("CXX", str(FAST_CXX))
    workers = [subprocess.Popen([sys.executable, __file__, "--one", name], env=env) for name in to_build]
    failed = [name for name, worker in zip(to_build, workers) if worker.wait() != 0]
    if failed:
        print(
            f"lmrepo: building {', '.join(failed)} failed (above); runs that need it build it on first use",
            file=sys.stderr,
        )
        return 1
    return 0


def missing(names: list[str]) -> list[str] | None:
    """The ops of `names` this machine has no build of (None: DeepSpeed runs on a GPU here, with
    other builders). Asked in a child whose output is dropped: importing DeepSpeed (for its
    version, in the cache's key) prints its accelerator notice."""
    code = (
        "from deepspeed.accelerator import get_accelerator; from lmrepo.utils import ops\n"
        f"print('ops:', *(ops.missing({names!r}) if get_accelerator().device_name() == 'cpu' else ['-']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    answer = next((line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("ops:")), names)
    return None if answer == ["-"] else answer


if __name__ == "__main__":
    sys.exit(main())
