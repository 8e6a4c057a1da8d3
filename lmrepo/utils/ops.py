"""DeepSpeed's C++ ops, compiled on first use: where the builds live, one line before a build, and
no build a job does not use.

DeepSpeed JIT-compiles an op (its CPU all-reduce, CPU Adam, async I/O) the first time a process
loads it, with ninja, into torch's extensions directory (~/.cache/torch_extensions), which every
checkout and interpreter of the user shares. Two checkouts (different DeepSpeed sources, so
different compile commands) rebuilt each other's ops, and so did one checkout started with its
venv activated and without: ninja then comes from the venv (pip's ninja) or from the system, and
a ninja of another version discards the other's build log and builds everything again (measured:
32 s for every start, alternating, against 0 once built). `pin_builds` gives each interpreter
(a venv is one) a directory of its own and the same ninja however it was started; `announce_builds`
says what is compiled before the minutes of silence; `skip_unused_ops` keeps a single-process run
from building the all-reduce it never calls.

A build is then kept once per machine, as pip keeps a wheel: `machine_cache` holds each op's
library under a key of what makes it (DeepSpeed's and torch's versions, Python's, the compiler's,
the CPU's flags, for `-march=native`), and every later checkout or venv with the same key loads
it from there instead of compiling it again (ninja alone cannot: the sources' paths are in its
commands, and they differ between checkouts).
"""

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Each op DeepSpeed builds on a CPU: the name scripts/build_ops.py takes (None: built along with
# another), what it is for, and its build time measured on 2 cores (seconds, low to high: a loaded
# machine takes the high end); an op is one or a few compiles, so more cores help little.
OPS = {
    "deepspeed_shm_comm": ("shm", "CPU all-reduce between ranks", (30, 190)),
    "cpu_adam": ("cpu_adam", "CPU Adam, for offload=cpu and offload=nvme", (60, 280)),
    "async_io": ("async_io", "file I/O for offload=nvme", (120, 510)),
    "fused_adam": ("fused_adam", "DeepSpeed's own Adam, for a DeepSpeed JSON that asks for its keys", (40, 180)),
    "pin_memory": (None, "pinned buffers for offload=nvme", (20, 60)),
}
# scripts/build_ops.py's names -> DeepSpeed's builder classes (NVMe offload loads both of its ops)
BUILDERS = {
    "shm": ("ShareMemCommBuilder",),
    "cpu_adam": ("CPUAdamBuilder",),
    "async_io": ("AsyncIOBuilder", "PinMemoryBuilder"),
    "fused_adam": ("FusedAdamBuilder",),
}


def build_root() -> Path:
    """This interpreter's extensions directory: the user's TORCH_EXTENSIONS_DIR when set, else one
    beside torch's default, named after the interpreter's prefix (its venv), so that checkouts and
    interpreters never share a build."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    prefix = str(Path(sys.prefix).resolve())
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-{hashlib.sha1(prefix.encode()).hexdigest()[:10]}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "torch_extensions" / tag


def pin_builds() -> None:
    """Before DeepSpeed loads an op: this interpreter's build directory, and this interpreter's
    ninja first on PATH (inherited by the ranks a launcher starts, and by the compiles)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(build_root())
    interpreter_ninja_first()


def interpreter_ninja_first() -> None:
    """This interpreter's ninja (pip's, in its venv) first on PATH, for this process and those it
    starts: another ninja version discards the build log and rebuilds every op."""
    bin_dir = str(Path(sys.executable).parent)
    if Path(bin_dir, "ninja").is_file() and os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def is_built(name: str) -> bool:
    """Whether torch has a build of op `name` for this interpreter (a changed compile command
    still rebuilds it, quietly: that is rare once the checkout exists)."""
    return any(Path(build_root(), name).glob(f"{name}*.so"))


def machine_cache() -> Path | None:
    """Where builds are kept for every checkout of this machine: LMREPO_OPS_CACHE (empty: nowhere,
    every environment builds its own), else lmrepo-ops in the user's cache directory."""
    if "LMREPO_OPS_CACHE" in os.environ:
        return Path(os.environ["LMREPO_OPS_CACHE"]) if os.environ["LMREPO_OPS_CACHE"] else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmrepo-ops"


@functools.cache
def compiler_identity() -> str:
    """The compiler torch's builder will call (CXX, else c++), as it names itself: a wrapper that
    hands `--version` to c++ (the tests' g++ without debug information) is the same compiler."""
    compiler = os.environ.get("CXX") or "c++"
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return compiler


def cpu_flags() -> str:
    """The CPU's feature flags (x86's `flags`, Arm's `Features`): what `-march=native` compiles for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cache_key(name: str) -> str:
    import deepspeed
    import torch

    made_of = [
        name,
        deepspeed.__version__,
        torch.__version__,
        str(torch.version.git_version),
        sys.version,
        compiler_identity(),
        cpu_flags(),
    ]
    return f"{name}-{hashlib.sha1(chr(0).join(made_of).encode()).hexdigest()[:16]}"


def cached_build(name: str) -> Path | None:
    """This machine's kept build of op `name`, when there is one for this environment's key."""
    cache = machine_cache()
    path = cache / cache_key(name) / f"{name}.so" if cache else None
    return path if path and path.is_file() else None


def keep_build(name: str, module) -> None:
    """Copies the library just built (or loaded from this environment's own build) into the
    machine's cache: written aside, then renamed, so that another process never loads half."""
    cache, built = machine_cache(), Path(getattr(module, "__file__", "") or "")
    if cache is None or built.name != f"{name}.so" or cached_build(name):
        return
    target = cache / cache_key(name) / built.name
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        shutil.copyfile(built, partial)
        partial.replace(target)
    except OSError as err:  # a read-only or full cache: this environment's build still serves
        print(
            f"lmrepo: could not keep DeepSpeed's {name} op in {cache} ({err.strerror}); it is built per environment",
            file=sys.stderr,
        )


def load_kept_build(path: Path):
    """The op's Python module from a kept library (as torch's builder imports its own)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_note(name: str) -> str:
    ours, purpose, (low, high) = OPS.get(name, (None, "a DeepSpeed op", (30, 300)))
    # make setup alone builds them all; it says so itself (LMREPO_BUILDING_AHEAD)
    ahead = f"; make setup OPS={ours} builds it ahead" if ours and not os.environ.get("LMREPO_BUILDING_AHEAD") else ""
    low, high = max(1, low // 60), -(-high // 60)
    minutes = f"{low}-{high} min" if low < high else f"about {high} min"
    return f"lmrepo: compiling DeepSpeed's {name} op ({purpose}) once for this machine: {minutes} on 2 cores{ahead}"


def wait_note(name: str, lock: Path) -> str:
    """What a process that finds another's build lock says: that it waits for that build (the
    usual case: another rank or job started it moments ago), or, once the lock is older than a
    build ever takes, that an interrupted build may have left it."""
    _, _, (_, high) = OPS.get(name, (None, None, (30, 300)))
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:  # the build just finished
        age = 0.0
    if age <= 2 * high:
        return (
            f"lmrepo: another process is building DeepSpeed's {name} op (for {age:.0f} s so far); "
            "this one waits for it and then loads the same build"
        )
    return (
        f"lmrepo: waiting for a build of DeepSpeed's {name} op whose lock is {age / 60:.0f} min old, longer than "
        f"a build takes: if no build is running, an interrupted one left {lock}; remove it"
    )


def announce_builds() -> None:
    """One line before each op DeepSpeed compiles in this process, from the node's first rank
    (the others wait for its build), and no compile where the machine's cache has the op; after
    `pin_builds`."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if getattr(OpBuilder.jit_load, "_lmrepo_announces", False):
        return
    jit_load = OpBuilder.jit_load

    def announced_jit_load(self, verbose=True):
        if kept := cached_build(self.name):
            module = load_kept_build(kept)
            OpBuilder._loaded_ops[self.name] = module  # as DeepSpeed's load keeps it
            return module
        if os.environ.get("LOCAL_RANK", "0") == "0" and not is_built(self.name):
            lock = build_root() / self.name / "lock"
            # stderr: DeepSpeed's start runs inside quiet_prints, which holds stdout back until its end.
            # A lock: torch waits for the builder holding it, without a word.
            print(wait_note(self.name, lock) if lock.exists() else build_note(self.name), file=sys.stderr, flush=True)
        module = jit_load(self, verbose)
        keep_build(self.name, module)
        return module

    announced_jit_load._lmrepo_announces = True
    OpBuilder.jit_load = announced_jit_load


def skip_unused_ops(world_size: int, all_reduce_kernel: bool = False) -> None:
    """DeepSpeed loads its CPU all-reduce op (shm comm) whenever it starts its communication
    backend, and each rank then writes and maps a 66 MiB buffer in /dev/shm and spins until every
    peer's exists. Only DeepSpeed-Inference's all-reduce uses it (`all_reduce_kernel`: generation on
    CPU ranks, of two or more); training's collectives, AutoTP's included, go through
    torch.distributed. Elsewhere it is marked unavailable, as DeepSpeed marks an op this machine
    cannot build (an inference all-reduce would then run torch's)."""
    if all_reduce_kernel and world_size > 1:
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def load_ops_as_ranks_do(world_size: int, all_reduce_kernel: bool = False) -> None:
    """What a process that starts DeepSpeed does before its first op (train.py's ranks, the
    bench's workers, generation's ranks): announce_builds (the machine's kept builds, a line before
    any compile) and skip_unused_ops (DeepSpeed's CPU all-reduce kernel only where
    `all_reduce_kernel` asks for it); after `pin_builds`."""
    announce_builds()
    skip_unused_ops(world_size, all_reduce_kernel)


def builders(name: str) -> list:
    """DeepSpeed's builders of our op `name` (BUILDERS), for this machine's accelerator."""
    import deepspeed.ops.op_builder as op_builder

    return [getattr(op_builder, cls)() for cls in BUILDERS[name]]


def missing(names: list[str]) -> list[str]:
    """Those of our ops (BUILDERS' names) that this environment would have to compile."""
    cache = machine_cache()
    return [
        name for name in names if not all(cached_build(b.name) if cache else is_built(b.name) for b in builders(name))
    ]


def build(name: str) -> None:
    """Compiles op `name` now, or finds it in the machine's cache (scripts/build_ops.py)."""
    for builder in builders(name):
        if not builder.is_compatible(verbose=False):
            print(
                f"lmrepo: {builder.name} cannot be built on this machine (DeepSpeed says it is incompatible); skipped"
            )
            continue
        builder.load(verbose=False)
        kept = cached_build(builder.name)
        print(f"lmrepo: {builder.name} ready: {kept.parent if kept else build_root() / builder.name}", flush=True)
