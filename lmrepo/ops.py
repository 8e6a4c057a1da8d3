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
"""

import hashlib
import os
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
    "pin_memory": (None, "pinned buffers for offload=nvme", (20, 60)),
}
# scripts/build_ops.py's names -> DeepSpeed's builder classes
BUILDERS = {
    "shm": "ShareMemCommBuilder",
    "cpu_adam": "CPUAdamBuilder",
    "async_io": "AsyncIOBuilder",
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


def build_note(name: str) -> str:
    ours, purpose, (low, high) = OPS.get(name, (None, "a DeepSpeed op", (30, 300)))
    ahead = f"; make setup OPS={ours} builds it ahead" if ours else ""
    low, high = max(1, low // 60), -(-high // 60)
    minutes = f"{low}-{high} min" if low < high else f"about {high} min"
    return f"lmrepo: compiling DeepSpeed's {name} op ({purpose}) once for this environment: {minutes} on 2 cores{ahead}"


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
    (the others wait for its build); after `pin_builds`."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if getattr(OpBuilder.jit_load, "_lmrepo_announces", False):
        return
    jit_load = OpBuilder.jit_load

    def announced_jit_load(self, verbose=True):
        if os.environ.get("LOCAL_RANK", "0") == "0" and not is_built(self.name):
            lock = build_root() / self.name / "lock"
            # stderr: DeepSpeed's start runs inside quiet_prints, which holds stdout back until its end.
            # A lock: torch waits for the builder holding it, without a word.
            print(wait_note(self.name, lock) if lock.exists() else build_note(self.name), file=sys.stderr, flush=True)
        return jit_load(self, verbose)

    announced_jit_load._lmrepo_announces = True
    OpBuilder.jit_load = announced_jit_load


def skip_unused_ops(world_size: int) -> None:
    """DeepSpeed builds its CPU all-reduce op whenever it starts its communication backend, also
    in a single process, which never all-reduces with anyone: there, it is marked unavailable
    (DeepSpeed then all-reduces with torch, a no-op for one rank)."""
    if world_size > 1:
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def build(names: list[str]) -> None:
    """Compiles the named ops now (scripts/build_ops.py, make setup OPS=...)."""
    import deepspeed.ops.op_builder as op_builder

    for name in names:
        builder = getattr(op_builder, BUILDERS[name])()
        if not builder.is_compatible(verbose=False):
            print(f"lmrepo: {name} cannot be built on this machine (DeepSpeed says it is incompatible); skipped")
            continue
        builder.load(verbose=False)
        print(f"lmrepo: {name} built in {build_root()}")
