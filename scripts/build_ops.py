"""Compiles DeepSpeed's C++ ops for this environment now, so that no run waits for them.

    python scripts/build_ops.py shm cpu_adam async_io      # or: make setup OPS="shm cpu_adam async_io"

shm: the CPU all-reduce every multi-rank CPU run uses; cpu_adam: offload=cpu and offload=nvme;
async_io: offload=nvme (needs libaio). Each takes one to a few minutes on 2 cores, once: the
builds live in this interpreter's own directory (lmrepo/ops.py says where and why). A run that
needs an op not built yet says so in one line before compiling it.
"""

import argparse

from lmrepo import ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="+", choices=sorted(ops.BUILDERS), metavar="OP", help=" | ".join(ops.BUILDERS))
    args = parser.parse_args()
    ops.pin_builds()
    ops.announce_builds()
    ops.build(args.ops)


if __name__ == "__main__":
    main()
