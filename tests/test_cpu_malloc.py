"""lmrepo.utils.cpu_malloc: glibc keeps a step's freed memory for the next one (the speed is measured by
benchmarks/bench_malloc.py, not here), unless the user chose the allocator."""

import os
import subprocess

import pytest

from harness import PYTHON, REPO
from lmrepo.utils.cpu_malloc import is_glibc, user_chose_allocator

# Allocates and frees 200 MB five times, writing every page, after one warm-up allocation; prints
# whether lmrepo set the thresholds and the page faults of the five.
PROBE = """
import resource, sys
from lmrepo.utils.cpu_malloc import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
x = b"\\1" * (200 << 20); del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    x = b"\\1" * (200 << 20); del x
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def probe(arm: str, **env: str) -> tuple[str, int]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")
    }
    out = subprocess.run(
        [PYTHON, "-c", PROBE, arm], env={**clean, **env}, cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


# five 200 MB allocations mapped anew: at least half their pages fault
FRESH_PAGES = 5 * (200 << 20) // os.sysconf("SC_PAGE_SIZE") // 2


@pytest.mark.skipif(not is_glibc(), reason="glibc's malloc only")
def test_freed_memory_is_reused_without_new_page_faults():
    kept, kept_faults = probe("keep")
    _, glibc_faults = probe("glibc")
    assert kept == "True"
    assert glibc_faults > FRESH_PAGES, "glibc maps every 200 MB anew"
    assert kept_faults < glibc_faults / 20, (kept_faults, glibc_faults)


@pytest.mark.skipif(not is_glibc(), reason="glibc's malloc only")
def test_a_threshold_the_user_set_is_kept():
    kept, faults = probe("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert kept == "False" and faults > FRESH_PAGES


@pytest.mark.parametrize(
    "env, chosen",
    [
        ({}, False),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, True),
        ({"LD_PRELOAD": "/opt/conda/lib/libtcmalloc.so"}, True),
        ({"LD_PRELOAD": "/opt/intel/lib/libiomp5.so"}, False),  # not an allocator
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, True),
        ({"MALLOC_ARENA_MAX": "2"}, False),  # arenas, not the thresholds
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True),
        ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}, False),
    ],
)
def test_the_users_allocator_choice_is_recognised(env, chosen):
    assert user_chose_allocator(env) is chosen
