"""The process group's start on 2 CPU ranks as training starts it (without DeepSpeed's CPU
all-reduce kernel) and as generation starts it (with it: each rank writes and maps a 66 MiB buffer
in /dev/shm and spins until its peer's exists), side by side in one run, alternating.

    python benchmarks/bench_rank_start.py [--starts 8] [--save]    # ~2 min on 2 cores

Each start is 2 fresh ranks on this machine; each rank measures its own CPU seconds (user +
system) and wall seconds from just before `lmrepo.distributed.launch.init_distributed` to just
after a barrier, so its imports are not counted. The table gives medians over the starts of the
two ranks' sum (CPU) and of the slower rank (wall).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from common import Report, add_save_flag  # benchmarks/common.py

ARMS = {"training (no kernel)": False, "generation (the kernel)": True}


def cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def rank(kernel: bool) -> None:
    """One rank: the measured start, then one JSON line."""
    import torch.distributed as dist

    from lmrepo.distributed import launch

    if kernel:
        launch.prepare_shm()
    cpu, wall = cpu_s(), time.perf_counter()
    launch.init_distributed(all_reduce_kernel=kernel)
    dist.barrier()
    cpu, wall = cpu_s() - cpu, time.perf_counter() - wall
    if kernel:
        launch.release_shm_buffer()
    dist.destroy_process_group()
    print(json.dumps({"cpu_s": cpu, "wall_s": wall}), flush=True)


def start(kernel: bool) -> tuple[float, float]:
    """One 2-rank start: (both ranks' CPU seconds, the slower rank's wall seconds)."""
    from lmrepo.distributed.launch import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env |= {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", "kernel" if kernel else "none"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    lines = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("a rank failed (above)")
    return sum(x["cpu_s"] for x in lines), max(x["wall_s"] for x in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=8)
    parser.add_argument("--rank", choices=["kernel", "none"], help=argparse.SUPPRESS)  # a rank of a start
    add_save_flag(parser)
    args = parser.parse_args()
    if args.rank:
        rank(args.rank == "kernel")
        return
    report = Report(__file__, device="cpu")
    starts = {name: [] for name in ARMS}
    start(False)  # untimed: the first start reads what the later ones find in the page cache
    for _ in range(args.starts):
        for name, kernel in ARMS.items():
            starts[name].append(start(kernel))
    medians = {
        name: {"cpu_s": statistics.median(c for c, _ in runs), "wall_s": statistics.median(w for _, w in runs)}
        for name, runs in starts.items()
    }
    report.print(f"{args.starts} starts of 2 CPU ranks each way, alternating: init_distributed to a barrier\n")
    report.print("| start | CPU-s, both ranks (median) | wall s, slower rank (median) |\n| --- | ---: | ---: |")
    for name, m in medians.items():
        report.print(f"| {name} | {m['cpu_s']:.3f} | {m['wall_s']:.3f} |")
    no, yes = medians["training (no kernel)"], medians["generation (the kernel)"]
    report.print(
        f"\n- without the kernel: {no['cpu_s'] / yes['cpu_s']:.2f}x the CPU seconds, "
        f"{no['wall_s'] / yes['wall_s']:.2f}x the wall seconds of a start with it"
    )
    report.save(args.save, {"starts": starts, "medians": medians})


if __name__ == "__main__":
    main()
