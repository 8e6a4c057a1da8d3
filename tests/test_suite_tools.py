"""The suite's own tools: `--cpu-report=FILE` (tests/README.md) writes one line per test with its
CPU seconds, counting the processes it ran, its wall seconds, its worker and when it ended; the
numeric comparison every test uses (tests/numerics.py) bounds what fp32 sums in another order
differ by, and its `--tolerance-report` lines; tools/start_ranks.py starts the ranks of the tests
that are not about a launcher, and must end them as a launcher does, whether the worker's fork
server (tools/fork_server.py) forks them or it starts them itself."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

import numerics
from harness import PYTHON, REPO, fork_server_listening, launcher
from numerics import VOCAB, assert_close, relative_difference, reordered_sum

IN_PROCESS = "tests/test_reference.py::test_every_key_has_a_docstring"
# runs scripts/estimate.py, which imports torch: a second of CPU or so, all of it in the child
WITH_A_CHILD = "tests/test_estimate.py::test_script_prints_the_estimate"


def test_cpu_report_counts_each_tests_processes(tmp_path):
    report = tmp_path / "cpu.tsv"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}  # one process: no worker of `make test`'s
    env["LMREPO_TEST_FORK_SERVER"] = "off"  # WITH_A_CHILD starts its process itself
    proc = subprocess.run(
        [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", IN_PROCESS, WITH_A_CHILD, f"--cpu-report={report}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = {
        test: (float(cpu), float(wall), worker, float(end))
        for cpu, wall, test, worker, end in (line.split("\t") for line in report.read_text().splitlines())
    }
    assert sorted(rows) == sorted([IN_PROCESS, WITH_A_CHILD])
    assert all(cpu >= 0 and wall >= 0 and worker == "-" and end > 1e9 for cpu, wall, worker, end in rows.values())
    assert rows[WITH_A_CHILD][0] > rows[IN_PROCESS][0] + 0.5, rows  # the child imports torch: a second or more


def test_reordered_sum_bounds_an_fp32_sum_in_any_order():
    """The longest sum of a training step: the LM head's backward into the hidden states (softmax
    minus one-hot, times the head's weights), 50,257 terms. Summed one term after another in fp32
    (numpy's accumulate), in a shuffled order and by torch's blocked matmul, each is within
    reordered_sum(VOCAB) of the exact sum and of the others, by the norm."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 0.1, (4, VOCAB))
    dlogits = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    dlogits[np.arange(4), rng.integers(0, VOCAB, 4)] -= 1
    dlogits, weights = dlogits.astype(np.float32), rng.normal(0, 0.02, (VOCAB, 32)).astype(np.float32)
    exact = torch.from_numpy(dlogits.astype(np.float64) @ weights.astype(np.float64))
    terms = dlogits.T[:, :, None] * weights[:, None, :]  # (VOCAB, 4, 32), each product rounded to fp32
    orders = {
        "one after another": np.add.accumulate(terms, axis=0)[-1],
        "shuffled": np.add.accumulate(terms[rng.permutation(VOCAB)], axis=0)[-1],
        "matmul": (torch.from_numpy(dlogits) @ torch.from_numpy(weights)).numpy(),
    }
    sums = {name: torch.from_numpy(np.asarray(s, dtype=np.float32)) for name, s in orders.items()}
    assert_close(sums, dict.fromkeys(sums, exact.float()), reordered_sum(VOCAB), "sums against the exact one")
    assert_close(sums["shuffled"], sums["one after another"], reordered_sum(VOCAB), "two orders")
    assert relative_difference(sums["matmul"], sums["one after another"]) > 0  # the orders do round differently


def test_assert_close_compares_each_tensor_by_its_norm_and_reports(tmp_path, monkeypatch):
    """An element whose relative error is large inside a tensor that is close passes; a tensor twice
    the size fails and is named; every comparison is a line of the tolerance report."""
    report = tmp_path / "tolerances.tsv"
    monkeypatch.setattr(numerics, "REPORT", report)
    grads = {"w": torch.tensor([1.0, -2.0, 3e-9]), "b": torch.ones(3)}
    cancelled = {"w": torch.tensor([1.0, -2.0, -3e-9]), "b": torch.ones(3)}  # a near-zero element changed sign
    assert assert_close(cancelled, grads, 1e-8, "gradients") < 1e-8
    with pytest.raises(AssertionError, match=r"gradients\['b'\] differ by 1 relative \(> 1e-08\)"):
        assert_close({"w": grads["w"], "b": 2 * grads["b"]}, grads, 1e-8, "gradients")
    with pytest.raises(AssertionError, match=r"losses\[1\] differ by 0.1 relative"):
        assert_close([1.0, 1.1], [1.0, 1.0], 1e-5, "losses")
    test = "tests/test_suite_tools.py::test_assert_close_compares_each_tensor_by_its_norm_and_reports"
    rows = [line.split("\t") for line in report.read_text().splitlines()]
    assert [(row[1], row[3], row[4]) for row in rows] == [
        ("1e-08", test, "gradients"),
        ("1e-08", test, "gradients"),
        ("1e-05", test, "losses"),
    ]


RANK_SCRIPT = """
import json, os, sys, time
from pathlib import Path
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
env = {k: os.environ[k] for k in names}
Path(f"rank{env['RANK']}.json").write_text(json.dumps({**env, "parent": os.getppid(), "pid": os.getpid()}))
if sys.argv[1] == "all-succeed":
    sys.exit(0)
if env["RANK"] == sys.argv[1]:
    sys.exit(3)
time.sleep(600)  # a rank waiting in a collective for the one that failed
"""


def server_or_not(how: str, fork_server) -> dict:
    """The environment of a launch that the worker's fork server runs ("forked"), or that
    start_ranks.py starts itself ("started")."""
    if how == "started":
        return {**os.environ, "LMREPO_TEST_FORK_SERVER": "off"}
    assert fork_server_listening(fork_server), "the worker's fork server is not listening"
    return dict(os.environ)


@pytest.mark.parametrize("how", ["forked", "started"])
def test_ranks_started_directly_get_their_rendezvous_and_end_with_the_first_failure(tmp_path, how, fork_server):
    """Each rank has its own RANK and LOCAL_RANK, and all share the world size, the local size and
    one free master port. When a rank fails, the others (blocked in a collective, as a real job's
    would be) are ended and the launch exits with the failed rank's status: without that, the
    launch would sleep out the subprocess timeout below and fail."""
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    env = server_or_not(how, fork_server)
    clients = []

    def start(ranks: int, how: str) -> int:
        proc = subprocess.Popen([*launcher(ranks), "rank.py", how], cwd=tmp_path, env=env)
        clients.append(proc.pid)
        return proc.wait(timeout=120)

    assert start(3, "all-succeed") == 0
    envs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    parents = {e.pop("parent") for e in envs}
    assert len(parents) == 1 and (parents == {clients[0]}) == (how == "started"), (parents, clients)
    for e in envs:
        e.pop("pid")
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "1"), ("2", "2")]
    port = envs[0]["MASTER_PORT"]
    assert {tuple(e[k] for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) for e in envs} == {
        ("3", "3", "127.0.0.1", port)
    }
    assert start(3, "2") == 3


JOB_SCRIPT = """
import atexit, os, sys, threading, time
sys.stdout.reconfigure(line_buffering=False, write_through=False)  # buffered also under PYTHONUNBUFFERED
atexit.register(lambda: print("atexit ran"))  # left in the buffer: flushed at the end
threading.Thread(target=lambda: (time.sleep(0.5), print("thread joined", flush=True))).start()
print("argv", sys.argv[1:], "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)), __name__)
print("cwd", os.getcwd(), "mine", os.environ.get("MINE"), "rank", os.environ.get("RANK"))
print("pid", os.getpid(), "offline", os.environ.get("HF_HUB_OFFLINE"))
if sys.argv[1] == "fail":
    raise ValueError("the job's own error")
if sys.argv[1] == "interrupt":
    raise KeyboardInterrupt
if sys.argv[1] == "message":
    sys.exit("the job's own last words")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("ending", ["0", "5", "fail", "interrupt", "message"])
def test_a_forked_process_runs_its_script_as_plain_python_does(tmp_path, ending, fork_server):
    """One process (0 ranks) from the fork server and from plain `python`: the same output (what it
    left in stdout's buffer too), exit status (an uncaught KeyboardInterrupt's SIGINT, SystemExit's
    message and 1) and last line of stderr; its threads joined and atexit run at the end."""
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    assert fork_server_listening(fork_server)
    forked = subprocess.run(
        [*launcher(0), str(script), ending], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    plain = subprocess.run([PYTHON, str(script), ending], cwd=tmp_path, capture_output=True, text=True, timeout=120)

    def same(out: str) -> list[str]:
        return [line for line in out.splitlines() if not line.startswith("pid ")]

    assert (forked.returncode, same(forked.stdout)) == (plain.returncode, same(plain.stdout))
    assert "thread joined" in forked.stdout and forked.stdout.rstrip().endswith("atexit ran")
    assert forked.stderr.splitlines()[-1:] == plain.stderr.splitlines()[-1:]
    if ending == "fail":
        assert "ValueError: the job's own error" in forked.stderr


def test_a_launch_in_another_environment_is_started_by_its_client(tmp_path, fork_server):
    """The server imported torch and transformers in the session's environment: a launch that sets
    a variable they read at import otherwise (Hugging Face's offline switch) runs in a process of
    its own, which sees it; a variable no import of the server reads (a test's own) is forked
    and seen."""
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    assert fork_server_listening(fork_server)

    def run(**extra: str) -> tuple[int, str]:
        env = {**os.environ, **extra}
        proc = subprocess.Popen(
            [*launcher(0), str(script), "0"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
        )
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        return proc.pid, out

    offline = "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"
    client, out = run(HF_HUB_OFFLINE=offline)
    assert f"pid {client} offline {offline}" in out, "not a process of its own"
    client, out = run(MINE="set")
    assert "mine set" in out and f"pid {client} " not in out, "not forked"


def test_the_ranks_of_a_killed_client_end_with_it(tmp_path, fork_server):
    """A test's timeout kills start_ranks.py: the ranks the server forked for it end too, instead
    of holding their port and cores until the session ends."""
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    assert fork_server_listening(fork_server)
    proc = subprocess.Popen([*launcher(2), "rank.py", "none-fails"], cwd=tmp_path)
    files = [tmp_path / f"rank{r}.json" for r in range(2)]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    pids = [json.loads(f.read_text())["pid"] for f in files]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "ranks outlived their killed client"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
