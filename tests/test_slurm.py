"""Slurm, for real: a two-node cluster on this machine (conftest.slurm_cluster: slurmctld and two
slurmd, node names that are no host names, no accounting), and lmrepo's own `hydra/launcher=slurm`
submitting to it as a user types it."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from harness import (
    PYTHON,
    REPO,
    TINY,
    assert_ok,
    cancel_slurm_jobs,
    logged_steps,
    queued_slurm_jobs,
    read_metrics,
    run_train,
    train_losses,
    wait_for,
)
from numerics import STEPS_FP32, assert_close

pytestmark = pytest.mark.distributed

STEPS = ["trainer.max_steps=4", "zero=stage3", "schedule=constant"]
SWEEPS: list[subprocess.Popen] = []  # every sweep start_sweep started, ended after its test


@pytest.fixture(autouse=True)
def nothing_left_on_the_cluster(request):
    """After each test of the cluster: its sweep ended and every job cancelled. A test that fails
    while its job runs (or a sweep that ends before its job) leaves nothing to the next test, which
    expects its own job alone on the cluster, nor to the rest of the suite."""
    yield
    while SWEEPS:
        sweep = SWEEPS.pop()
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.communicate()
    if (conf := request.node.funcargs.get("slurm_cluster")) is not None:  # not where the cluster was skipped
        cancel_slurm_jobs(conf)


def test_a_sweep_on_two_nodes_trains_as_one_machine_does(slurm_cluster, tmp_path):
    """`-m engine=deepspeed,fsdp2` (ZeRO-3 and its FSDP2 equivalent), each job on 2 nodes x 1 rank:
    both train, every rank meeting at the first node's address (Slurm's NodeAddr: `node1` is no host
    name), and each job's losses equal the same job's on one machine (its ranks
    started directly, as the suite starts them). The partition
    has no GPUs, so none are asked for; no line per status poll."""
    proc, run_dir, _ = start_sweep(slurm_cluster, tmp_path, ["engine=deepspeed,fsdp2", *STEPS])
    console, sweep = proc.communicate(timeout=900)[0], run_dir.parent
    assert proc.returncode == 0, console[-3000:]
    # the jobs' states as they change, from squeue on this cluster without accounting; nothing per poll
    assert "Bypassing sacct error" not in console and "accounting storage is disabled" not in console, console
    assert all(f"job #{job} (Slurm " in console for job in (0, 1)) and "RUNNING" in console, console
    for job, engine in enumerate(("deepspeed", "fsdp2")):
        status = json.loads((sweep / str(job) / "status.json").read_text())
        assert status["status"] == "completed" and status["setting"]["ranks"] == 2, status
        local = run_train([*TINY, *STEPS, f"engine={engine}"], tmp_path / f"local-{engine}", ranks=2)
        assert_ok(local)
        assert_close(train_losses(sweep / str(job)), train_losses(tmp_path / f"local-{engine}"), STEPS_FP32, engine)
        assert [m["step"] for m in read_metrics(sweep / str(job)) if "loss" in m] == [1, 2, 3, 4]


def test_gpus_are_asked_for_only_where_the_partition_has_them(slurm_cluster):
    """sinfo's generic resources of the partition decide: none on this CPU cluster (Slurm refuses a
    GPU request there, "Invalid generic resource"), the ranks per node where it lists GPUs."""
    from lmrepo.distributed.launch import slurm_gpus

    os.environ["SLURM_CONF"] = str(slurm_cluster)
    assert slurm_gpus("debug", 8) is None
    assert slurm_gpus(None, 8) is None


def test_the_first_node_is_reached_at_its_slurm_address(slurm_cluster):
    """A node name that is no host name is reached at the NodeAddr Slurm knows it by; a name Slurm
    does not know either is one line, not a rendezvous retried until it times out."""
    from lmrepo.distributed.launch import node_address
    from lmrepo.utils.errors import ConfigError

    os.environ["SLURM_CONF"] = str(slurm_cluster)
    assert node_address("node1") == "127.0.0.1"
    assert node_address("localhost") == "localhost"
    with pytest.raises(ConfigError, match="no-such-node.*no host name"):
        node_address("no-such-node")


@pytest.mark.parametrize(
    "overrides, path, says",
    [
        (["hydra.launcher.partition=nosuch"], None, "Slurm refused the job: invalid partition specified: nosuch"),
        ([], "venv", "which this machine does not have"),  # no sbatch, no srun: not a Slurm machine
    ],
)
def test_a_submission_slurm_refuses_or_cannot_make_is_one_line(slurm_cluster, tmp_path, overrides, path, says):
    env = {**os.environ, "SLURM_CONF": str(slurm_cluster)}
    if path == "venv":
        env["PATH"] = os.path.dirname(PYTHON)
    command = [
        *(PYTHON, str(REPO / "train.py"), "-m", "hydra/launcher=slurm", "launcher.ranks=1", *TINY, *overrides),
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmrepo: error:")]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-3000:]


# --- a job's life on the cluster: its time limit, scancel, a node that dies ---------------------


def start_sweep(conf: Path, tmp_path: Path, overrides: list[str]) -> tuple[subprocess.Popen, Path, dict]:
    """One job of `hydra/launcher=slurm` on 2 nodes x 1 rank, left running: (the sweep, its job's run
    directory, the environment that reaches the cluster)."""
    env = {**os.environ, "SLURM_CONF": str(conf)}
    sweep = tmp_path / "sweep"
    command = [
        *(PYTHON, str(REPO / "train.py"), "-m", "hydra/launcher=slurm", "hydra.launcher.partition=debug"),
        *("hydra.launcher.cpus_per_task=1", "launcher.ranks=1", "launcher.nodes=2", *TINY, *overrides),
        f"hydra.sweep.dir={sweep}",
    ]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    SWEEPS.append(proc)
    return proc, sweep / "0", env


def slurm_job(env: dict) -> str:
    """The id of the one job on the test cluster."""
    (job,) = queued_slurm_jobs(env)
    return job


def task_logs(run_dir: Path) -> str:
    """Everything the job's tasks printed, every attempt (submitit's logs under the sweep)."""
    return "".join(path.read_text(errors="replace") for path in sorted(run_dir.parent.glob(".submitit/*/*_log.*")))


def test_a_job_at_its_time_limit_saves_is_requeued_and_continues_exactly(slurm_cluster, tmp_path):
    """The warning before a time limit (SIGUSR2 to every task: what `--signal=USR2@120` makes slurmctld
    send; sent here with scancel when the test says, not when slurmctld's 30-s timer does) makes every
    rank save; submitit requeues the job (`scontrol requeue`; Slurm holds a requeued job two minutes,
    which the test cuts to three seconds), and the same command continues from that checkpoint: every step's loss
    equals one uninterrupted run's, logged once, in the one W&B run of the job (one id), grouped by the sweep."""
    steps = ["engine=fsdp2", "zero=stage3", "schedule=constant", "trainer.max_steps=400"]
    proc, run_dir, env = start_sweep(slurm_cluster, tmp_path, [*steps, "logger=wandb", "hydra.launcher.timeout_min=5"])
    wait_for(lambda: logged_steps(run_dir) >= 3, proc)
    job = slurm_job(env)
    subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)

    def shown() -> str:
        return subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout

    def settled(state: str) -> bool:  # requeued (REQUEUED, then held PENDING until its BeginTime) or beyond
        return "Restarts=1" in state and any(f"JobState={s} " in state for s in ("PENDING", "RUNNING", "COMPLETED"))

    deadline = time.monotonic() + 600
    while not settled(now := shown()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if "JobState=PENDING" in now:
        # Not at once: the requeue revoked the job's credential, and an attempt Slurm started in
        # that same second was killed at launch ("Killing non-startable batch JobId=3: Job
        # credential revoked"), which ended the sweep. Slurm's own hold is for that.
        subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now+3"], env=env, check=True)
    output = proc.communicate(timeout=900)[0]
    logs = task_logs(run_dir)
    controller = slurm_cluster.parent / "slurmctld.log"  # read only when the assertion fails
    assert proc.returncode == 0, (
        f"{output[-3000:]}\n--- the tasks' logs:\n{logs[-5000:]}\n"
        f"--- slurmctld:\n{controller.read_text(errors='replace')[-2000:]}"
    )

    saved = int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert "Slurm restarted this job (1 time(s))" in logs and "lmrepo: resumed from" in logs, logs[-3000:]
    assert 3 <= saved <= 400 and json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == list(range(1, 401))
    local = run_train([*TINY, *steps], tmp_path / "uninterrupted", ranks=2)
    assert_ok(local)
    assert_close(train_losses(run_dir), train_losses(tmp_path / "uninterrupted"), STEPS_FP32, "requeued")
    attempts = sorted((run_dir / "wandb").glob("offline-run-*/*.wandb"))  # W&B offline: a folder per attempt
    assert len(attempts) == 2 and len({path.parent.name.rsplit("-", 1)[1] for path in attempts}) == 1  # one run id
    sweep = run_dir.parent
    assert all(f"{sweep.parent.name}_{sweep.name}".encode() in path.read_bytes() for path in attempts)  # the group
    assert "completed" in output and "best: #0" in output  # the sweep's summary


# A Hydra app whose first attempt has Slurm requeue its job and then ends as a success (what an
# attempt at its time limit can do: its requeue's SIGTERM, here ignored, can end the `scontrol` that
# asked for it before submitit's handler exits), writing submitit's result file; the next attempt
# (SLURM_RESTART_COUNT=1) leaves a file and ends.
REQUEUED_APP = """import os, signal, subprocess, hydra

@hydra.main(version_base="1.3")
def main(cfg):
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    if attempt == "0":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # and in the scontrol calls: they must not die of it
        job = os.environ["SLURM_JOB_ID"]
        subprocess.run(["scontrol", "requeue", job], check=True)
        # Slurm holds a requeued job for two minutes: three seconds here (not at once: see above)
        subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now+3"], check=True)
    open(f"attempt-{attempt}", "w").close()

main()
"""


def test_a_job_requeued_after_its_attempt_wrote_a_result_is_waited_for(slurm_cluster, tmp_path):
    """An attempt's result file is not its job's end while Slurm has the job queued again: the sweep
    waits for the next attempt and reports how that one ended, not the first one's result (the
    sweep had ended there, leaving the job to run unwatched)."""
    (tmp_path / "app.py").write_text(REQUEUED_APP)
    command = [
        *(PYTHON, "app.py", "-m", "hydra/launcher=submitit_slurm"),
        "hydra.launcher._target_=hydra_plugins.lmrepo_launcher.lmrepo_slurm.LmrepoSlurmLauncher",
        *("hydra.launcher.partition=debug", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=5"),
        *("+x=1", "hydra.sweep.dir=sweep"),
    ]
    env = {**os.environ, "SLURM_CONF": str(slurm_cluster)}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert (tmp_path / "attempt-0").exists() and (tmp_path / "attempt-1").exists(), output[-3000:]
    assert "REQUEUED" in output or "PENDING" in output, output[-3000:]  # the sweep saw the job queued again
    assert not (queued := queued_slurm_jobs(env)), queued


def test_scancel_loses_no_checkpoint_the_job_wrote(slurm_cluster, tmp_path):
    """scancel sends SIGTERM to every task: each rank saves once more and stops; every checkpoint
    written before is still there and loads, and the sweep's summary says how to continue."""
    from lmrepo.train.checkpoint import check_files

    overrides = [
        "engine=deepspeed",
        "zero=stage2",
        "schedule=constant",
        "trainer.save_every=5",
        "trainer.max_steps=100000",
    ]
    proc, run_dir, env = start_sweep(slurm_cluster, tmp_path, overrides)
    checkpoints = run_dir / "checkpoints"
    wait_for(lambda: len(list(checkpoints.glob("step_*/manifest.json"))) >= 2, proc)
    before = sorted(path.parent.name for path in checkpoints.glob("step_*/manifest.json"))
    subprocess.run(["scancel", slurm_job(env)], env=env, check=True)
    output = proc.communicate(timeout=600)[0]

    assert proc.returncode == 1, output[-3000:]  # the job did not complete: the sweep says so
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "stopped" and status["signal"] == "SIGTERM", status
    assert "from outside the sweep (scancel" in output and "run.resume=auto" in output, output[-3000:]
    for tag in before:
        check_files(checkpoints / tag)
    saved = int((checkpoints / "latest").read_text().strip().removeprefix("step_"))
    assert saved >= int(before[-1].removeprefix("step_"))
    resumed = run_train([*TINY, *overrides[:-1], f"trainer.max_steps={saved + 1}", "run.resume=auto"], run_dir, ranks=2)
    assert_ok(resumed)
    assert f"resumed from {checkpoints / f'step_{saved:08d}'}" in resumed.stdout


def test_a_job_whose_node_dies_ends_in_one_line_naming_the_node(slurm_cluster, tmp_path):
    """node2's task killed (SIGKILL, as a node that dies takes it): the rank left on node1 ends at
    once with the lost rank and its node named, the sweep reports that line, and nothing waits on."""
    proc, run_dir, env = start_sweep(slurm_cluster, tmp_path, ["engine=deepspeed", "trainer.max_steps=100000"])
    wait_for(lambda: logged_steps(run_dir) >= 3, proc)
    job = slurm_job(env)
    task = slurm_task(job, "1")
    os.kill(task, signal.SIGKILL)
    killed_at = time.monotonic()
    output = proc.communicate(timeout=900)[0]  # a guard against a hang, not a speed limit
    assert proc.returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines() if "lmrepo: job #0" in line and "died" in line]
    assert len(errors) == 1 and f"rank 1 (pid {task} on node2) is gone" in errors[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    print(f"the sweep ended {time.monotonic() - killed_at:.1f} s after node2's task was killed")


def slurm_task(job: str, task: str) -> int:
    """The pid of task `task` (SLURM_PROCID) of Slurm job `job`: the submitit process Slurm started."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            environ = process.environ()
        except psutil.Error:
            continue
        if environ.get("SLURM_JOB_ID") == job and environ.get("SLURM_PROCID") == task:
            found += [process.pid] if "submitit" in " ".join(process.info["cmdline"] or []) else []
    (pid,) = found
    return pid
