"""The suite's harness: the real train.py (and the scripts) launched on CPU ranks, and what the tests
read back from a run. Every run uses TINY (a 2-layer, 64-wide GPT-2 on 32-token blocks of GPT-2's
bytes, fp32: a test that is about a precision or a vocabulary says so). pytest's hooks and the
session's fixtures (the token cache, the fork server) are conftest.py's."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from lmrepo.distributed.device import Device
from lmrepo.distributed.launch import launch_command

# Devices as DeepSpeed's accelerators describe them, for checks that depend on the hardware.
CPU = Device("cpu", fp16=False, bf16=True, native_bf16=True, description="CPU (test)")


CPU_WITHOUT_BF16 = Device("cpu", fp16=False, bf16=True, native_bf16=False, description="CPU (test, AVX2)")


GPU = Device("cuda", fp16=True, bf16=True, native_bf16=True, description="GPU (test, compute capability 8.0)")


REPO = Path(__file__).resolve().parents[1]


CONF = REPO / "conf"


PYTHON = sys.executable


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


START_RANKS = REPO / "tests" / "tools" / "start_ranks.py"


FORK_SERVER = REPO / "tests" / "tools" / "fork_server.py"


TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "data.block_size=32",
    "trainer.micro_batch_size=4",
    "trainer.max_steps=6",
    "schedule.warmup_steps=1",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.eval_batches=2",
    "logger=jsonl",
    "precision=fp32",
    "model.tokenizer=bytes",
    "model.vocab_size=257",
]


# TINY tokenizes by GPT-2's bytes (257 tokens: lmrepo.data.tokenizer.gpt2_bytes); GPT2 puts its BPE back,
# for a test about that vocabulary (50,257 rows: the embedding is then 97% of TINY's parameters).
GPT2 = ("model.tokenizer=gpt2", "model.vocab_size=50257")


BERT = ("model=bert-tiny", "model.tokenizer=bert", "model.vocab_size=30522")  # after TINY: its WordPiece back


# TINY in bf16, one sequence per micro batch: on a CPU without native bf16 every bf16 matmul takes a
# slow path (~70x fp32), so a TINY step costs by the token. The parity and resume checks hold at any
# batch size.
BF16 = ("precision=bf16", "trainer.micro_batch_size=1")


def launcher(ranks: int, via: str = "direct") -> list[str]:
    """The command that starts a script on `ranks` CPU ranks (0: one process, as plain `python`):
    the ranks started directly, one process each with the env:// variables, as srun starts them
    (tests/tools/start_ranks.py, forked from the worker's fork server), or `torchrun` or
    `deepspeed`, the launchers users type, under
    which the ranks run the same way (lmrepo.distributed.launch gives DeepSpeed's shared-memory all-reduce
    LOCAL_SIZE under each). A launcher only where the test is about it (a signal it forwards, a rank
    it ends, its exit code on a refusal, `--local_rank`, a command a user types): torchrun's agent
    imports torch before the first rank starts, and DeepSpeed's runner and launch.py each import
    all of DeepSpeed (benchmarks/bench_launchers.py measures the three)."""
    if via == "direct":
        return [PYTHON, str(START_RANKS), str(ranks)]
    return launch_command(ranks, via)


# `python`, forked from the worker's fork server (launcher(0)): for the scripts the tests run
# (export, generate, compare, estimate), which import torch as train.py does.
FORKED_PYTHON = [PYTHON, str(START_RANKS), "0"]


def run_train(
    overrides: list[str],
    run_dir: Path,
    ranks: int = 0,
    timeout: int = 900,
    env: dict | None = None,
    via: str = "direct",
) -> subprocess.CompletedProcess:
    """`python train.py` (ranks=0), or train.py on `ranks` ranks started by `via` (see launcher)."""
    cwd = next(p for p in run_dir.parents if p.is_dir())
    return subprocess.run(
        [*launcher(ranks, via), str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def env_without_fork_server() -> dict:
    """This environment without the worker's fork server (LMREPO_TEST_FORK_SERVER): a launch that
    starts its own interpreters."""
    return {k: v for k, v in os.environ.items() if k != "LMREPO_TEST_FORK_SERVER"}


def popen_train(overrides: list[str], run_dir: Path, ranks: int = 0, via: str = "deepspeed") -> subprocess.Popen:
    """A TINY run left running, every process of it in one process group of its own: for tests that
    signal or race it. Ranks start under DeepSpeed's launcher, where what it does with a signal or
    a dead rank is under test; `via="direct"` starts them with tools/start_ranks.py itself (not from
    the fork server, whose forks are outside the group), for a test that kills them all at once."""
    env = env_without_fork_server() if via == "direct" else None
    return subprocess.Popen(
        [*launcher(ranks, via), str(REPO / "train.py"), *TINY, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=next(p for p in run_dir.parents if p.is_dir()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 900) -> None:
    """Until `predicate()` holds; fails with the run's output if the run ends first, or ends it and
    fails after `timeout` seconds (the bound every launch of the suite has: a hung run fails its
    test, not the whole suite)."""
    import signal

    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no progress in {timeout:.0f} s: {proc.communicate()[0][-3000:]}")
        time.sleep(0.2)


def logged_train_steps(run_dir: Path) -> list[int]:
    """The step of each whole training line a running job has written (its last line may be half
    written)."""
    steps = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in record:
            steps.append(record["step"])
    return steps


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def kill_9_after_a_save(overrides: list[str], run_dir: Path, logged: int, steps_after: bool = False) -> str:
    """A 2-rank TINY run killed (SIGKILL to its process group, every rank at once, as an OOM killer
    or a lost node ends a job: no launcher's handling is under test, so the ranks start without
    one) once `latest` exists and `logged` lines are in its metrics; with `steps_after`,
    also once it has logged a step past `latest` that is not a save step (so that no save can
    complete between the check and the kill and move `latest` past every logged step: `logged`
    lines alone were reached at a save step once, with its checkpoint's line). Returns the
    checkpoint `latest` names then."""
    import signal

    def ready() -> bool:
        latest = run_dir / "checkpoints" / "latest"
        if not latest.exists() or logged_steps(run_dir) < logged:
            return False
        if not steps_after:
            return True
        every = int(next(w for w in reversed(overrides) if w.startswith("trainer.save_every=")).split("=")[1])
        last = max(logged_train_steps(run_dir), default=0)
        return last > int(latest.read_text().split("_")[1]) and last % every != 0

    proc = popen_train(overrides, run_dir, ranks=2, via="direct")
    while True:
        wait_for(ready, proc)
        # Checked again with every process of the job stopped: a TINY step takes milliseconds, and
        # between a check of the running job and the kill a save could complete and move `latest`
        # past every logged step (a test process descheduled for a few steps' time).
        os.killpg(proc.pid, signal.SIGSTOP)
        if ready():
            break
        os.killpg(proc.pid, signal.SIGCONT)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    group_gone(proc.pid)
    return (run_dir / "checkpoints" / "latest").read_text()


def group_gone(pgid: int, timeout: float = 60) -> None:
    """Waits until every process of group `pgid` has ended (a zombie has: its files, and their
    locks, are closed): the launcher ends before its ranks do, and a rank that is still dying holds
    the run directory's lock (a resume started at once was refused: "in use by another run right
    now")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive_in_group(stat, pgid) for stat in Path("/proc").glob("[0-9]*/stat")):
            return
        time.sleep(0.05)
    raise AssertionError(f"processes of group {pgid} still alive {timeout} s after SIGKILL")


def _alive_in_group(stat: Path, pgid: int) -> bool:
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return False  # gone meanwhile
    state, group = fields[0], int(fields[2])
    return group == pgid and state not in ("Z", "X")


def stop_with_signal(signum: int, overrides: list[str], run_dir: Path) -> tuple[int, str]:
    """A 2-rank TINY run signalled after 3 logged steps, as Slurm's pre-emption and a terminal's
    Ctrl-C do (the signal reaches every process of the job): it must save, say so in status.json
    and point `latest` at the save. Returns (the step it stopped at, its output)."""
    import signal

    proc = popen_train(overrides, run_dir, ranks=2)
    wait_for(lambda: logged_steps(run_dir) >= 3, proc)
    os.killpg(proc.pid, signum)
    output, _ = proc.communicate(timeout=300)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "stopped" and status["signal"] == signal.Signals(signum).name, output[-3000:]
    step = status["final"]["step"]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{step:08d}"
    return step, output


def env_without_wandb_key(home: Path) -> dict:
    """The environment of a user with no W&B key: no WANDB_* variables and a HOME without
    ~/.netrc. DeepSpeed's compiled ops stay where they are (pin_op_builds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(home)
    return env


def validate(cfg, world: int, device: Device) -> tuple[dict, list[str]]:
    """train.py's checks of a composed config for `world` ranks on `device`: (DeepSpeed dict,
    keys the user's JSON changed), or a ConfigError."""
    from lmrepo.plan.job import plan

    job = plan(cfg, world, device)
    return job.ds_config, job.user_changed


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    )


def summary_rows(stdout: str) -> dict[str, dict]:
    """The sweep launcher's closing table, by job number: {"0": {"overrides": ..., "status": ...}}
    (cells apart by two spaces or more; an empty last cell as "")."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("job  "))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 1 :]:
        if not line.startswith("#"):
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0][1:]] = dict(zip(header, cells + [""] * (len(header) - len(cells))))
    return rows


def fork_server_listening(path: str | None, timeout: float = 120) -> bool:
    """Waits until the fork server at `path` is listening (for a test of the server itself)."""
    deadline = time.monotonic() + timeout
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)
    return bool(path) and os.path.exists(path)


SLURM_CONF = """ClusterName=lmrepo-tests
SlurmctldHost=localhost
SlurmctldPort={controller}
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node1} CPUs=2 State=UNKNOWN
NodeName=node2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node2} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
"""


def start_slurm_cluster(root: Path) -> Path:
    """A Slurm cluster of two nodes on this machine, as a small site runs one: slurmctld and two
    slurmd (node1, node2: two CPUs each, so the two jobs of a sweep run side by side; reached at
    127.0.0.1, node names that are no host names), no munge (auth/none), no accounting, every
    file under `root`, every port free. Returns its slurm.conf (SLURM_CONF for sbatch and the
    rest) once both nodes are idle."""
    from lmrepo.distributed.launch import free_port

    for folder in ("state", "spool/node1", "spool/node2"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(root=root, controller=free_port(), node1=free_port(), node2=free_port()))
    subprocess.run(["slurmctld", "-f", str(conf), "-i"], check=True, timeout=60)
    for node in ("node1", "node2"):
        subprocess.run(["slurmd", "-f", str(conf), "-N", node], check=True, timeout=60)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listed = subprocess.run(["sinfo", "--noheader", "--format=%T %D"], env=env, capture_output=True, text=True)
        if listed.stdout.split() == ["idle", "2"]:
            return conf
        time.sleep(0.5)
    stop_slurm_cluster(root)
    raise AssertionError(f"the test cluster's nodes did not come up: {listed.stdout} {listed.stderr}")


def queued_slurm_jobs(env: dict) -> list[str]:
    """The ids of the jobs queued or running on the cluster `env` reaches (its SLURM_CONF)."""
    listed = subprocess.run(["squeue", "--noheader", "--format=%i"], env=env, capture_output=True, text=True)
    return listed.stdout.split()


def cancel_slurm_jobs(conf: Path, timeout: float = 120) -> None:
    """Every job on the test cluster cancelled (scancel sends SIGTERM, then SIGKILL after KillWait),
    waited for until squeue lists none: a test that fails while its job runs leaves nothing to the
    next test (which would find two jobs where it expects its one) or to the rest of the suite (a
    2-rank job of 100,000 steps left running took a core from every later test)."""
    env = {**os.environ, "SLURM_CONF": str(conf)}
    if left := queued_slurm_jobs(env):
        subprocess.run(["scancel", *left], env=env, capture_output=True, timeout=60)
        deadline = time.monotonic() + timeout
        while queued_slurm_jobs(env) and time.monotonic() < deadline:
            time.sleep(0.5)


def stop_slurm_cluster(root: Path) -> None:
    """Every job of the cluster under `root` cancelled, then every daemon ended (their pid files):
    a daemon's end does not end the jobs it started."""
    import signal

    if (root / "slurm.conf").exists() and _alive(root / "slurmctld.pid"):
        cancel_slurm_jobs(root / "slurm.conf")
    for pid_file in root.glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in root.glob("*.pid")):
        time.sleep(0.2)


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False
