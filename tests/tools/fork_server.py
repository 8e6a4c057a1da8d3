"""The suite's fork server: imports torch and transformers once per pytest worker, then forks the
processes of every launch that tools/start_ranks.py hands it, so that no test's ranks pay those
imports again (~3-7 CPU-s a process, most of a TINY rank's start: tests/README.md).

Each launch gets new processes, forked from a server that has imported and nothing more: no
model, engine, process group, thread pool or environment of an earlier test lives on in them
(the torch.multiprocessing "forkserver" idea; DeepSpeed's own tests reuse whole processes
instead, which lets one test's state reach the next). Per launch:

    client (start_ranks.py) --fds 0,1,2 + {argv, ranks, env, cwd}--> server
    server --fork--> launcher --fork--> rank 0 .. rank N-1  (runs the script as `python SCRIPT`)

The launcher does what start_ranks.py does for the ranks it starts itself: the rendezvous
variables, SIGTERM/SIGINT passed on to every rank, the others ended when one fails, the first
failure's exit status; it also ends the ranks when its client goes (a test's timeout killed it).
A rank runs the script at the top of this file's main module, after the server's frames have
returned, and ends as `python SCRIPT` ends (run_as_python_does): exit status, traceback,
non-daemon threads joined, atexit, the last collection, but not the interpreter's freeing of every
object still alive, which in a fork copies the pages of everything the server imported.

What a fork cannot give a launch is an environment other than the server's where it matters at
import: a launch whose environment differs from the server's in a variable that the imports here
could read (READ_AT_IMPORT: torch's, the thread pools', Hugging Face's, DeepSpeed's, HOME, ...) is
refused, and start_ranks.py starts it as before; other variables (a test's own, lmrepo's, W&B's:
read when called) are simply the launch's. What a library prints at import is printed once, into
the server's log, and never by a launch: DeepSpeed's accelerator notice among them, so the test of
train.py's quiet start runs its own process. DeepSpeed chooses its accelerator at import, once:
it and the lmrepo modules that import it are imported here only from a torch built without CUDA,
where every launch would choose the CPU (on a GPU machine a launch may ask for either).

Usage: python fork_server.py SOCKET   (conftest.py starts one per pytest worker)
"""

import gc
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time

from start_ranks import die_with_parent, end  # this folder: a launch is ended as start_ranks.py ends one

# The variables that the modules imported here (PREIMPORTED), or the libraries they load, could read
# at import: a launch that sets one of them otherwise than the server starts its own processes.
READ_AT_IMPORT = (
    *("TORCH", "PYTORCH", "ATEN", "ONEDNN", "DNNL", "CUDA", "NVIDIA", "NCCL", "XLA"),
    *("OMP_", "GOMP", "KMP_", "MKL", "OPENBLAS", "GOTO", "BLIS", "NPY", "NUMPY", "SCIPY"),
    *("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS", "USE_TORCH", "USE_TF", "USE_JAX"),
    *("DS_", "DEEPSPEED"),
    *("HOME", "XDG_", "TMP", "TEMP", "PYTHON", "LD_", "LC_", "LANG", "TZ"),
    *("CC", "CXX", "CFLAGS", "CPPFLAGS", "LDFLAGS"),  # DeepSpeed's probe of the ops it can build (below)
)
# ... of which these are read only when called (torch's compile cache, its CUDA check): no refusal.
READ_WHEN_CALLED = {"TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCH_EXTENSIONS_DIR"}
PREIMPORTED = ("torch", "transformers", "transformers.modeling_utils", "numpy", "scipy.stats", "hydra", "omegaconf")
# ... and what every train.py rank imports after them (~0.3 CPU-s a process), where torch has no CUDA.
# DeepSpeed's ZeRO checks its optimizer against its Muon, whose module compiles its update at import
# and so imports inductor: ~0.8 CPU-s in every rank of a ZeRO stage 1-3 run, paid here once.
CPU_ONLY_PREIMPORTED = (
    *("deepspeed", "lmrepo.run", "lmrepo.engines.deepspeed", "lmrepo.engines.fsdp2", "lmrepo.engines.torch_pipeline"),
    *("torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.distributed.tensor.parallel"),
    "deepspeed.runtime.zero.muon.muon_optimizer",
)


class Rank:
    """A forked process of a launch, with the part of subprocess.Popen's interface that
    start_ranks.end uses to end a launch."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode


class Job:
    """What a rank runs, set up in the forked process as `python SCRIPT ARGS` would find it."""

    def __init__(self, request: dict, env: dict, fds: list[int]):
        self.argv, self.env, self.cwd, self.fds = request["argv"], env, request["cwd"], fds

    def enter(self) -> None:
        die_with_parent()
        for target, fd in enumerate(self.fds):
            os.dup2(fd, target)
        for fd in self.fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.argv = list(self.argv)
        sys.path[0] = os.path.dirname(os.path.abspath(self.argv[0]))


def rank_envs(request: dict) -> list[dict]:
    """Each rank's environment: the client's, with the rendezvous variables of start_ranks.py
    (none for 0 ranks: one process, as plain `python`)."""
    written_by_imports = {k: v for k, v in os.environ.items() if k not in STARTED_WITH}
    env, n = {**written_by_imports, **request["env"]}, request["ranks"]
    if n == 0:
        return [env]
    shared = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": request["port"],
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
    }
    return [{**env, **shared, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(n)]


def launch(conn: socket.socket, request: dict, fds: list[int], cpu_tally: str) -> Job:
    """In the launcher: forks the ranks and supervises them until they end (then exits), or, in
    a rank, returns its job."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    ranks = []
    for env in rank_envs(request):
        pid = os.fork()
        if pid == 0:
            conn.close()
            return Job(request, env, fds)
        ranks.append(Rank(pid))
    for fd in fds:
        os.close(fd)

    def pass_on(signum, _frame):
        end(ranks, signum)
        finish(conn, 128 + signum, cpu_tally)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    conn.sendall(f"pid {os.getpid()}".encode())
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = next((code for code in codes if code), None)
        if failed is not None:
            end(ranks)
            if len(ranks) > 1 and failed < 0:
                failed = 128 - failed  # a rank killed by signal S: 128 + S, as a shell says (start_ranks.py)
            finish(conn, failed, cpu_tally)  # one process: as it ended (the client ends the same way)
        if all(code == 0 for code in codes):
            finish(conn, 0, cpu_tally)
        if select.select([conn], [], [], 0.1)[0] and not conn.recv(64):  # the client is gone
            end(ranks, signal.SIGKILL)
            finish(conn, 137, cpu_tally)


def finish(conn: socket.socket, code: int, cpu_tally: str) -> None:
    """The launch's end: its CPU seconds (its ranks', reaped here) counted for --cpu-report, its
    exit status to the client."""
    used = sum(
        u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )
    with open(cpu_tally, "a") as f:
        f.write(f"{used:.2f}\n")
    try:
        conn.sendall(f"exit {code}".encode())
    except OSError:
        pass
    os._exit(code & 0xFF)


STARTED_WITH = dict(os.environ)  # before the imports, some of which set variables (inductor its cache's)


def other_environment(env: dict) -> set[str]:
    """The variables in which a launch with `env` would see at import what the server did not."""
    changed = {k for k in STARTED_WITH.keys() | env.keys() if STARTED_WITH.get(k) != env.get(k)}
    return {k for k in changed if k.startswith(READ_AT_IMPORT) and k not in READ_WHEN_CALLED}


def serve(path: str) -> Job:
    """Answers launches until the pytest worker that started it goes; returns only in a rank."""
    for module in PREIMPORTED:
        __import__(module)
    import torch

    if not torch.backends.cuda.is_built():
        for module in CPU_ONLY_PREIMPORTED:
            __import__(module)
        # Which of its ops this machine can build: DeepSpeed probes them all the first time a process
        # asks (every rank that starts its communication), compiling and linking a test program
        # against libaio: ~0.09 CPU-s a process, asked here once.
        _ = sys.modules["deepspeed.ops"].__compatible_ops__  # computed and kept by the module on first access
    # The imports' ~600k objects out of every later collection, as train.py does after its imports:
    # a collection in a fork would otherwise touch, and so copy, every page of them.
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    parent, cpu_tally = os.getppid(), path + ".cpu"
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select; launchers are reaped below
    while os.getppid() == parent:
        while True:  # reap finished launchers
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        if len(fds) != 3 or (changed := other_environment(request["env"])):
            print(
                f"fork server: {request['argv'][0]} started by its client: "
                f"its environment differs in {sorted(changed)}",
                flush=True,
            )
            conn.sendall(b"start it yourself")
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            return launch(conn, request, fds, cpu_tally)
        for fd in fds:
            os.close(fd)
        conn.close()
    sys.exit(0)


def run_as_python_does(script: str) -> None:
    """Runs `script` as `python SCRIPT` runs it, then ends the process as the interpreter ends one:
    an uncaught exception's traceback, the exit status (SystemExit's, 1 after a traceback, SIGINT's
    after an uncaught KeyboardInterrupt), non-daemon threads joined, atexit handlers run (which flush
    logging, end W&B runs, remove temporary directories), unreachable objects collected, stdout and
    stderr flushed (120 when that fails). All but the interpreter's very last step, freeing every
    object still alive, which a program cannot observe: in a fork, it writes the reference count of
    every object the server imported and so copies their pages, ~220 MB (0.33 CPU-s a process,
    half of it the kernel's, measured: most of what an empty script's fork cost)."""
    import atexit
    import runpy
    import threading

    code, interrupted = 0, False
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as err:  # noqa: BLE001 (what the interpreter does with an uncaught one)
        interrupted = isinstance(err, KeyboardInterrupt)
        sys.excepthook(type(err), err, err.__traceback__)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    die_with_parent()
    job = serve(sys.argv[1])
    job.enter()
    del job
    run_as_python_does(sys.argv[0])
