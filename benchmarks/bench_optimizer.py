"""DeepSpeed's FusedAdam op against torch's fused AdamW on this CPU, side by side in one run: the
optimizer step time on GPT-2 tiny's and GPT-2 small's parameter shapes, how far the two updates
drift apart, and what loading DeepSpeed's op costs a process before its first step.

    python benchmarks/bench_optimizer.py [--steps 5] [--build] [--save]   # ~1 min on 2 cores; --build ~1 min more

lmrepo uses torch's (torch_adam + fused in DeepSpeed's optimizer params) on a CPU without
optimizer offload (lmrepo.plan.ds_config.prefer_torch_adam_on_cpu). --build also times compiling the op
from nothing (a fresh TORCH_EXTENSIONS_DIR): what the first run on a new machine paid.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from common import Report, add_save_flag  # benchmarks/common.py (it also puts the repository on sys.path)

# (layers, width) of the GPT-2 shapes; vocabulary 50,257 and 1,024 positions.
MODELS = {"gpt2-tiny": (4, 256), "gpt2": (12, 768)}
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
LOAD_OP = "from deepspeed.ops.adam import FusedAdam; import torch; FusedAdam([torch.nn.Parameter(torch.ones(1))])"


def parameters(n_layer: int, width: int, seed: int = 0) -> list[torch.nn.Parameter]:
    block = [
        (width, 3 * width),
        (3 * width,),
        (width, width),
        (width,),
        (width, 4 * width),
        (4 * width,),
        (4 * width, width),
        (width,),
        (width,),
        (width,),
        (width,),
        (width,),
    ]
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(50257, width), (1024, width), *block * n_layer]:
        p = torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02)
        p.grad = torch.randn(shape, generator=generator) * 1e-3
        params.append(p)
    return params


def optimizer(kind: str, params):
    if kind == "deepspeed FusedAdam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, adam_w_mode=True, **HYPER)
    return torch.optim.AdamW(params, fused=True, **HYPER)


def step_time(kind: str, n_layer: int, width: int, steps: int) -> tuple[float, list[torch.Tensor]]:
    params = parameters(n_layer, width)
    opt = optimizer(kind, params)
    opt.step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - start) / steps, [p.detach() for p in params]


def seconds(code: str, env: dict | None = None) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--build", action="store_true", help="also time compiling FusedAdam from nothing")
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__, device="cpu")
    report.print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; {args.steps} timed steps after one warm-up step.\n"
    )
    report.print(
        "| model | params | FusedAdam ms | torch fused ms | torch / FusedAdam | max abs diff |\n"
        "| --- | --- | --- | --- | --- | --- |"
    )
    figures = {"steps": args.steps, "threads": torch.get_num_threads(), "models": {}}
    for name, (n_layer, width) in MODELS.items():
        ds_s, ds_params = step_time("deepspeed FusedAdam", n_layer, width, args.steps)
        torch_s, torch_params = step_time("torch fused AdamW", n_layer, width, args.steps)
        diff = max((a - b).abs().max().item() for a, b in zip(ds_params, torch_params))
        count = sum(p.numel() for p in ds_params) / 1e6
        figures["models"][name] = {"params_m": count, "fused_adam_s": ds_s, "torch_s": torch_s, "max_abs_diff": diff}
        report.print(
            f"| {name} | {count:.1f}M | {ds_s * 1e3:.1f} | {torch_s * 1e3:.1f} | {torch_s / ds_s:.2f}x | {diff:.2e} |"
        )
    python_s = seconds("import deepspeed, torch")
    load_s = seconds(LOAD_OP)
    figures.update(import_deepspeed_s=python_s, load_fused_adam_s=load_s - python_s)
    report.print(
        f"\nLoading FusedAdam (built already) costs a process {load_s - python_s:.1f} s "
        f"(import deepspeed: {python_s:.1f} s; DeepSpeed probes the CPU in a subprocess to hash the build flags)."
    )
    if args.build:
        with tempfile.TemporaryDirectory() as fresh:
            build_s = seconds(LOAD_OP, env={**os.environ, "TORCH_EXTENSIONS_DIR": fresh})
        figures["build_s"] = build_s
        report.print(f"\nCompiling FusedAdam from nothing: {build_s:.0f} s.")
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
