"""DeepSpeed's Muon update compiled (torch.compile, as DeepSpeed decorates it) against the same
functions eager (lmrepo's optimizer.compile=false, the default on a CPU), side by side in one run:
the first step (which compiles, from an empty inductor cache) and the median later step, on the
hidden matrices of GPT-2 tiny (4 x 256) and of the suite's 2 x 64 model, each arm in a fresh
process.

    python benchmarks/bench_muon_compile.py [--steps 10] [--save]   # a few minutes on 2 cores

The break-even is the number of steps after which compiling has paid for itself (none where the
compiled step is not faster).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import Report, add_save_flag  # benchmarks/common.py (it also puts the repository on sys.path)

# (layers, width): GPT-2's hidden matrices per block, Conv1D's (in, out) layout.
MODELS = {"gpt2 2x64 (tests)": (2, 64), "gpt2-tiny 4x256": (4, 256)}


def matrices(n_layer: int, width: int) -> list[tuple[int, int]]:
    return [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)] * n_layer


def arm(compiled: bool, n_layer: int, width: int, steps: int) -> dict:
    """One process: DeepSpeed's muon_update on every hidden matrix, `steps` times."""
    from lmrepo.optim.muon import compile_muon_update

    compile_muon_update(compiled)
    from deepspeed.runtime.zero.muon import original_muon

    generator = torch.Generator().manual_seed(0)
    shapes = matrices(n_layer, width)
    momenta = [torch.zeros(shape) for shape in shapes]
    times = []
    for _ in range(steps):
        grads = [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]
        start = time.perf_counter()
        for grad, momentum in zip(grads, momenta):
            original_muon.muon_update(grad, momentum, 0.95, ns_method="standard")
        times.append(time.perf_counter() - start)
    return {"first_s": times[0], "step_s": statistics.median(times[1:])}


def run_arm(compiled: bool, n_layer: int, width: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:  # a cold compile, as on a fresh machine
        proc = subprocess.run(
            [sys.executable, __file__, "--arm", str(int(compiled)), str(n_layer), str(width), str(steps)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--arm", nargs=4, help=argparse.SUPPRESS)
    add_save_flag(parser)
    args = parser.parse_args()
    if args.arm:
        compiled, n_layer, width, steps = (int(x) for x in args.arm)
        print(json.dumps(arm(bool(compiled), n_layer, width, steps)))
        return
    report = Report(__file__, device="cpu")
    report.print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; DeepSpeed's muon_update (standard "
        f"Newton-Schulz) on every hidden matrix, {args.steps} steps per arm, each arm a fresh process with "
        "an empty inductor cache.\n"
    )
    report.print(
        "| matrices of | compiled first step s | eager first step s | compiled step ms | eager step ms "
        "| eager / compiled step | break-even steps |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    figures = {"steps": args.steps, "models": {}}
    for name, (n_layer, width) in MODELS.items():
        compiled, eager = (run_arm(c, n_layer, width, args.steps) for c in (True, False))
        saved = eager["step_s"] - compiled["step_s"]
        cost = compiled["first_s"] - eager["first_s"]
        even = cost / saved if saved > 0 else None
        figures["models"][name] = {"compiled": compiled, "eager": eager, "break_even_steps": even}
        report.print(
            f"| {name} | {compiled['first_s']:.1f} | {eager['first_s']:.2f} | {compiled['step_s'] * 1e3:.2f} "
            f"| {eager['step_s'] * 1e3:.2f} | {eager['step_s'] / compiled['step_s']:.2f}x "
            f"| {'never' if even is None else f'{even:.0f}'} |"
        )
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
