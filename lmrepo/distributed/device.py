"""The accelerator DeepSpeed will use, and which precisions it computes natively.

`precision=auto` picks bf16 only where bf16 matmuls run at full speed: CUDA GPUs of compute
capability 8.0 and newer (Ampere), CPUs whose bf16 matmuls go to oneDNN's native kernels
(AVX512-BF16 or AMX on x86; the BF16 extension on Arm). Elsewhere torch computes bf16 on a slow
path, many times slower than fp32 (benchmarks/results/bench_precision_xeon-spr_2026-11.md), while
DeepSpeed's CPU accelerator still reports bf16 as supported.
"""

import os
import platform
import time
from dataclasses import dataclass

import torch

from lmrepo.utils.errors import ConfigError

# The precision names of configs and options (precision.dtype, generate.py dtype=) as torch dtypes
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Device:
    type: str  # "cuda", "cpu", ...
    fp16: bool  # DeepSpeed accepts fp16 here (GPUs)
    bf16: bool  # DeepSpeed accepts bf16 here
    native_bf16: bool  # bf16 matmuls run at full speed
    description: str  # what the start-up line says about it, e.g. "NVIDIA A100 (compute capability 8.0)"


def detect_device(requested: str) -> Device:
    """`trainer.device=cpu` forces DeepSpeed's CPU accelerator; `cuda` insists on a GPU."""
    if requested == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    kind = acc.device_name()
    if requested == "cuda" and kind != "cuda":
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible: set trainer.device=auto or cpu")
    bf16 = bool(acc.is_bf16_supported())
    if kind == "cuda":
        major, minor = torch.cuda.get_device_capability()
        native, description = (
            bf16 and major >= 8,
            f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})",
        )
    elif kind == "cpu":
        native, description = bf16 and cpu_native_bf16(), cpu_description()
    else:  # XPU, HPU, NPU, MPS: their accelerators know
        native, description = bf16, kind
    return Device(kind, bool(acc.is_fp16_supported()), bf16, native, description)


def cpu_native_bf16() -> bool:
    """bf16 matmuls reach oneDNN's bf16 kernels (torch asks the same question before using them):
    on x86 that takes AVX512-BF16 or AMX; an x86 CPU with only AVX512 converts to fp32 inside them."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # honours ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY caps
        return False
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return True


def isolate_compile_cache() -> None:
    """Before torch.compile: under a capped CPU ISA (ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA set,
    e.g. to see a CPU without native bf16) inductor gets a cache of its own, unless the user chose
    one (TORCHINDUCTOR_CACHE_DIR). Its cache does not key what it compiled by ATen's capability: a
    graph compiled at the machine's own ISA, reused under `ATEN_CPU_CAPABILITY=avx2`, aborted in
    its kernel ("index out of bounds", then "terminate called recursively"; torch 2.13.0), where a
    fresh cache under the cap runs. Inductor reads the variable at each compile, and writes its
    default there when its config is imported (transformers does): that value is not a choice."""
    caps = [os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")]
    if any(caps):
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = "-".join([default_cache_dir(), *(c.lower() for c in caps if c)])


def cpu_description() -> str:
    features = [
        name
        for name, present in (
            ("AMX", torch.cpu._is_amx_tile_supported()),
            ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
        )
        if present
    ]
    isa = torch.backends.cpu.get_cpu_capability()
    native = "native bf16" if cpu_native_bf16() else "no native bf16"
    return f"CPU ({isa}{', ' + ', '.join(features) if features else ''}: {native})"


def matmul_tflops(dtype: torch.dtype, n: int = 256, repeats: int = 3) -> float:
    """Best TFLOP/s of a few n x n matmuls: enough to tell a native dtype from an emulated one."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # the first call picks the kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def choose_precision(requested: str, device: Device) -> tuple[str, str | None]:
    """(the dtype to train in, the line to print about it). `auto` never picks fp16: its loss
    scaling is a choice for the user to make."""
    if requested == "auto":
        if device.native_bf16:
            return "bf16", f"lmrepo: precision=auto -> bf16 ({device.description})"
        return "fp32", f"lmrepo: precision=auto -> fp32 ({device.description}; precision=bf16 would run on a slow path)"
    if requested == "bf16" and device.bf16 and not device.native_bf16:
        if device.type == "cpu":
            fp32, bf16 = matmul_tflops(torch.float32), matmul_tflops(torch.bfloat16)
            cost = f"bf16 matmuls run at {bf16:.4f} TFLOP/s here against {fp32:.4f} in fp32 (measured now)"
        else:
            cost = "bf16 is emulated there, slower than fp32"
        return (
            "bf16",
            f"lmrepo: warning: precision=bf16 on {device.description}: {cost}; precision=auto would train in fp32",
        )
    return requested, None
