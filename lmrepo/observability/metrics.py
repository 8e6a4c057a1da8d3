"""Training-performance arithmetic (Narayanan et al. 2021) and memory readings."""

import functools
import os
import platform
from pathlib import Path

import psutil
import torch

# Dense peak TFLOP/s per device (NVIDIA datasheets, half the "with sparsity" figures), for MFU.
# The H100 and H200 come in forms with other clocks and power: the first entry whose words all
# appear in torch.cuda.get_device_name() wins ("NVIDIA H100 PCIe", "NVIDIA H100 NVL",
# "NVIDIA H100 80GB HBM3" is the SXM module).
PEAK_TFLOPS = {
    ("H100", "PCIE"): {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    ("H100", "NVL"): {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    ("H100",): {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    ("H200", "NVL"): {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    ("H200",): {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    ("A100",): {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    ("V100",): {"fp32": 15.7, "fp16": 125.0},
}


def flops_per_token(
    n_layer: int, n_embd: int, seq_len: int, vocab: int, recompute: bool, block_params: float | None = None
) -> float:
    """Training FLOPs per token of a GPT-style transformer (4h MLP). Forward is
    24*l*h^2*(1 + s/(6h)) per token plus 2*h*V for the logits; backward costs twice the forward;
    activation recomputation runs the transformer forward once more (not the logits):
    without recompute 72*l*h^2*(1 + s/(6h) + V/(12*l*h)), with it 96*l*h^2*(1 + s/(6h) + V/(16*l*h)).
    `block_params`: the block parameters a token passes through, 2 FLOPs each forward, where the
    12*l*h^2 of GPT's blocks does not hold: a mixture of experts counts its top_k experts, not all
    (active_block_params); the attention scores, 4*l*s*h, stay."""
    forward = layer_forward_flops(n_layer, n_embd, seq_len, block_params) * n_layer
    return (4 if recompute else 3) * forward + 6 * n_embd * vocab


def layer_forward_flops(n_layer: int, n_embd: int, seq_len: int, block_params: float | None = None) -> float:
    """One block's forward FLOPs per token: 2 per parameter, 4*s*h for the attention scores."""
    params = 12 * n_layer * n_embd * n_embd if block_params is None else block_params
    return 2 * params / n_layer + 4 * seq_len * n_embd


def executed_flops_per_token(
    n_layer: int, n_embd: int, seq_len: int, vocab: int, recomputed_layers: int, block_params: float | None = None
) -> float:
    """FLOPs per token a step actually runs when `recomputed_layers` blocks are checkpointed: each
    reruns its forward, 24*h^2*(1 + s/(6h)) per token (the logits are not recomputed). With every
    block recomputed this is the 96 form above."""
    extra = recomputed_layers * layer_forward_flops(n_layer, n_embd, seq_len, block_params)
    return flops_per_token(n_layer, n_embd, seq_len, vocab, recompute=False, block_params=block_params) + extra


def peak_tflops(device_name: str, dtype: str, override: float | None) -> float | None:
    """The device's dense peak, or None when unknown (the CPU): MFU is then not reported."""
    if override:
        return float(override)
    name = device_name.upper()
    for words, table in PEAK_TFLOPS.items():
        if all(word in name for word in words):
            return table.get(dtype) or table.get("fp32")
    return None


def device_name(device_type: str) -> str:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return device_type


def machine_name(device_type: str) -> str:
    """What the run ran on, for a comparison's figures: the GPU's name, else the CPU's model and
    the cores this process may use (throughput on a CPU follows both)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


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
