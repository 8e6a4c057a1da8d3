"""glibc's malloc set for a CPU training step: freed memory is kept for the next step.

A step allocates and frees the same large tensors again and again: the default job's logits alone
are 8 x 128 x 50,257 fp32 values (206 MB), then their gradient. glibc serves every allocation over
its mmap threshold (which grows to 32 MB at most) with a fresh mmap and unmaps it on free, and
hands the heap's freed top back to the OS once it exceeds 128 KB: each step faulted in hundreds of
MB of new zeroed pages, and the kernel's page zeroing took as much CPU as the training itself.
With both thresholds at 1 GiB the memory stays in the process and is reused (what PyTorch's CPU
tuning guide gets from jemalloc or tcmalloc, with glibc alone). `benchmarks/bench_malloc.py`
measures it: the default job's step and peak resident memory, side by side.

Left alone when the user chose the allocator: an allocator in LD_PRELOAD, glibc's malloc
thresholds in GLIBC_TUNABLES or MALLOC_*_THRESHOLD_, or `run.cpu_keep_freed_memory=false`.
"""

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # the largest allocation served from the heap, and the free top it keeps
THRESHOLD_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
THRESHOLD_TUNABLES = ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold")


def user_chose_allocator(env=os.environ) -> bool:
    return (
        "malloc" in env.get("LD_PRELOAD", "")  # jemalloc, tcmalloc, mimalloc
        or any(name in env for name in THRESHOLD_ENV)
        or any(name in env.get("GLIBC_TUNABLES", "") for name in THRESHOLD_TUNABLES)
    )


def is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # not glibc (macOS, musl)
        return False


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds; True when they were set (False: not glibc, or the user's choice)."""
    if user_chose_allocator() or not is_glibc():
        return False
    libc = ctypes.CDLL("libc.so.6")
    return bool(libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
