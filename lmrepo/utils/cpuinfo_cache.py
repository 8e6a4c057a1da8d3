"""py-cpuinfo's answer about this CPU, asked once per machine instead of several times per rank.

DeepSpeed asks py-cpuinfo what the CPU is whenever it loads a CPU op: cpu_adam's builder twice
(-march, SIMD width) and DeepSpeedCPUAdam once, async_io's builder twice more. Each ask starts a
Python process that times the clock for about a second, three times per rank of an
`offload=cpu` run. The answer only depends on the processor: it is kept in lmrepo's cache directory,
named after what /proc/cpuinfo says of the processor, and read back by every later process.
"""

import contextlib
import functools
import hashlib
import json
import os
import platform
from pathlib import Path

# /proc/cpuinfo lines that change while the machine runs: not part of what the processor is
VARYING = ("cpu mhz", "bogomips")


def cache_dir() -> Path:
    """lmrepo's cache (data.cache_dir's default): $LMREPO_CACHE, else ~/.cache/lmrepo."""
    return Path(os.environ.get("LMREPO_CACHE") or Path.home() / ".cache" / "lmrepo")


def processor_key() -> str | None:
    """A name for this processor as py-cpuinfo would describe it: its first /proc/cpuinfo entry
    without the clock readings, the architecture and py-cpuinfo's version. None without
    /proc/cpuinfo (not Linux): then every process asks once."""
    import cpuinfo

    try:
        entry = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return None
    lines = [line for line in entry.splitlines() if not line.lower().startswith(VARYING)]
    described = "\n".join([platform.machine(), cpuinfo.CPUINFO_VERSION_STRING, *lines])
    return hashlib.sha1(described.encode()).hexdigest()[:16]


def cached_answer(ask):
    """`ask` (py-cpuinfo's get_cpu_info) answered from the cache file, else asked and written."""
    key = processor_key()
    if key is None:
        return ask()
    path = cache_dir() / f"cpuinfo-{key}.json"
    with contextlib.suppress(OSError, ValueError):  # missing or torn: ask again
        return json.loads(path.read_text())
    info = ask()
    if info:  # {} when py-cpuinfo's own probe process failed: not worth keeping
        with contextlib.suppress(OSError):  # an unwritable cache only costs the next process an ask
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(info))
            partial.replace(path)  # whole or absent for a rank reading it meanwhile
    return info


def install() -> None:
    """Every later `from cpuinfo import get_cpu_info` in this process (DeepSpeed imports it at
    each call) gets the cached answer."""
    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "lmrepo_cached", False):
        return
    get_cpu_info = functools.cache(functools.partial(cached_answer, cpuinfo.get_cpu_info))
    get_cpu_info.lmrepo_cached = True
    cpuinfo.get_cpu_info = cpuinfo.cpuinfo.get_cpu_info = get_cpu_info
