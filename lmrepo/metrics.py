"""Training-performance arithmetic (seed 003, Narayanan et al. 2021) and memory readings."""
import functools
import os
import time

import psutil
import torch

# Dense peak TFLOP/s per device (vendor datasheets, no sparsity), for MFU.
PEAK_TFLOPS = {
    "V100": {"fp32": 15.7, "fp16": 125.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
}


def flops_per_token(n_layer: int, n_embd: int, seq_len: int, vocab: int, recompute: bool) -> float:
    """Training FLOPs per token of a GPT-style transformer (4h MLP). Forward is
    24*l*h^2*(1 + s/(6h)) per token plus 2*h*V for the logits; backward costs twice the forward;
    activation recomputation runs the transformer forward once more (not the logits):
    without recompute 72*l*h^2*(1 + s/(6h) + V/(12*l*h)), with it 96*l*h^2*(1 + s/(6h) + V/(16*l*h))."""
    l, h, s, v = n_layer, n_embd, seq_len, vocab
    if recompute:
        return 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def executed_flops_per_token(n_layer: int, n_embd: int, seq_len: int, vocab: int, recomputed_layers: int) -> float:
    """FLOPs per token a step actually runs when `recomputed_layers` blocks are checkpointed: each
    reruns its forward, 24*h^2*(1 + s/(6h)) per token (the logits are not recomputed). With every
    block recomputed this is the 96 form above."""
    extra = 24 * recomputed_layers * n_embd * n_embd * (1 + seq_len / (6 * n_embd))
    return flops_per_token(n_layer, n_embd, seq_len, vocab, recompute=False) + extra


def peak_tflops(device_name: str, dtype: str, override: float | None) -> float | None:
    """The device's dense peak, or None when unknown (the CPU): MFU is then not reported."""
    if override:
        return float(override)
    for gpu, table in PEAK_TFLOPS.items():
        if gpu in device_name.upper():
            return table.get(dtype) or table.get("fp32")
    return None


def device_name(device_type: str) -> str:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return device_type


def memory_gb(device_type: str) -> float:
    """Peak CUDA memory allocated by this rank on a GPU; the process's resident memory on the CPU."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return _process(os.getpid()).memory_info().rss / 2**30


@functools.lru_cache(maxsize=1)
def _process(pid: int) -> psutil.Process:
    # One handle per process (keyed by pid: a forked child gets its own): psutil.Process() reads
    # /proc/<pid>/stat to identify the process, a third of a millisecond each logged step.
    return psutil.Process(pid)


def measure_cpu_peak_tflops(dtype: str, seconds: float = 2.0) -> float:
    """The CPU's matmul peak in `dtype` (fp32, bf16, fp16), measured: the best TFLOP/s of repeated
    square 2048 x 2048 torch.matmul with torch's current thread count, over about `seconds`.
    The best run, not the mean: MFU is measured against what the CPU can reach, and other
    processes on the machine only ever slow a run down."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    n = 2048
    a, b = torch.randn(n, n).to(torch_dtype), torch.randn(n, n).to(torch_dtype)
    out = torch.empty(n, n, dtype=torch_dtype)
    torch.matmul(a, b, out=out)  # the first call picks and packs the kernel (oneDNN / MKL)
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        end = time.perf_counter()
        best = max(best, 2 * n**3 / (end - start) / 1e12)
        if end >= deadline:
            return best
