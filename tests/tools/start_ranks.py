"""Starts a script on N ranks of this machine as Slurm's srun or a cluster's own launcher does: one
process per rank, each given the variables torch.distributed's env:// rendezvous reads (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and no agent between them.

The test suite starts the ranks of the tests that are not about a launcher this way: torchrun's
agent imports torch before it starts the first rank, and DeepSpeed's runner and launch.py all of
DeepSpeed (benchmarks/bench_launchers.py measures the three). The tests of torchrun and DeepSpeed's
launcher (their signals, exit codes, --local_rank, the sweeps and README commands that type them)
keep them.

What a launcher owes its ranks, as torchrun does it: when a rank fails, the others are ended
(SIGTERM, then SIGKILL after GRACE_S) instead of waiting in a collective for it, and the exit status
is the first failed rank's; SIGTERM and SIGINT to this process are passed on to every rank; a rank
dies with this process if it is killed (a test's timeout), not left behind holding the port.

In the test suite the ranks come from the worker's fork server (tools/fork_server.py, named by
LMREPO_TEST_FORK_SERVER), which has imported torch and transformers once: this process hands it
its standard streams and the launch, passes signals on, and exits with the launch's status. A
launch the server refuses (another environment), or with no server, starts its ranks here.

Usage: python start_ranks.py N SCRIPT [ARGS...]   (N = 0: one process without rank variables, as
plain `python SCRIPT`)
"""

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time

GRACE_S = 30  # torchrun's and DeepSpeed's launcher's wait between SIGTERM and SIGKILL
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In each rank, before it runs: SIGKILL when this launcher dies (Linux's PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def end(ranks: list[subprocess.Popen], signum: int = signal.SIGTERM) -> None:
    """Sends `signum` to the ranks still running, then SIGKILL to those alive after GRACE_S."""
    for proc in ranks:
        if proc.poll() is None:
            proc.send_signal(signum)
    deadline = time.monotonic() + GRACE_S
    for proc in ranks:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_starting(path: str, limit_s: float = 300) -> None:
    """Waits while the worker's fork server is still importing (its socket not there yet, its
    process alive: LMREPO_TEST_FORK_SERVER_PID): the session's first launches came before it
    listened, and started every rank afresh, paying the imports again beside the server's own.
    Only for the server of that variable's path: a test's own server, or none, is not waited for."""
    pid, _, server_path = os.environ.get("LMREPO_TEST_FORK_SERVER_PID", "").partition(":")
    if server_path != path:
        return
    from lmrepo.train.watchdog import process_state

    deadline = time.monotonic() + limit_s
    while pid and not os.path.exists(path) and time.monotonic() < deadline:
        if process_state(int(pid)) == "gone":  # died at its start: no server
            return
        time.sleep(0.1)


def through_fork_server(n: int, command: list[str], port: str) -> int | None:
    """The launch run by the fork server: its exit status, or None when there is no server or it
    refused the launch (nothing has started then)."""
    path = os.environ.get("LMREPO_TEST_FORK_SERVER")
    if not path or command[0].startswith("-"):  # the server runs script files, not -c or -m
        return None
    server_starting(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    request = {"argv": command, "ranks": n, "env": dict(os.environ), "cwd": os.getcwd(), "port": port}
    try:
        server.connect(path)
        socket.send_fds(server, [json.dumps(request).encode()], [0, 1, 2])  # a closed stream: EBADF
        answer = server.recv(64).decode()
    except OSError:  # no server listening (yet), or it went: nothing has started
        return None
    if not answer.startswith("pid "):
        return None
    launcher = int(answer.split()[1])
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, _frame: os.kill(launcher, signum))
    answer = server.recv(64).decode()
    if not answer.startswith("exit "):
        print("start_ranks: the fork server's launcher ended without an exit status", file=sys.stderr)
        return 1
    code = int(answer.split()[1])
    if code < 0:  # one process killed by a signal: end the same way, as plain `python` would have
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def main(n: int, command: list[str]) -> int:
    from lmrepo.distributed.launch import free_port  # here: the fork server imports this file's helpers, not lmrepo

    port = str(free_port()) if n else ""
    code = through_fork_server(n, command, port)
    if code is not None:
        return code
    if n == 0:
        os.execv(sys.executable, [sys.executable, *command])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    env |= {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
    ranks = [
        subprocess.Popen(
            [sys.executable, *command],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            preexec_fn=die_with_parent,
        )
        for rank in range(n)
    ]

    def pass_on(signum, _frame):
        end(ranks, signum)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    while True:
        codes = [proc.poll() for proc in ranks]
        failed = next((code for code in codes if code), None)
        if failed is not None:
            end(ranks)
            return failed if failed > 0 else 128 - failed  # a rank killed by signal S: 128 + S, as a shell says
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
