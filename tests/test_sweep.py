"""Sweeps and launchers, real runs on the CPU: a 2x2 multirun with 2 ranks per job and one
job that fails without stopping the others, W&B offline files per job (with the objective),
batches that go on past a failed one in directories named with `=` and `,`, a stop signal on
the sweep, timeouts (SIGTERM, then SIGKILL), torchrun and python launches, the Slurm
environment mapping."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import PYTHON, REPO, TINY, assert_ok, env_without_wandb_key, read_metrics, summary_rows
from lmrepo.distributed.launch import SLURM_MASTER_PORTS
from lmrepo.plan.compose import compose_config


def last_value(run_dir: Path, key: str) -> float:
    return [m[key] for m in read_metrics(run_dir) if m.get(key) is not None][-1]


def summary_item(record: bytes, key: str, value) -> bool:
    """Whether W&B's offline run file holds `key: value` in a run summary: a SummaryItem record,
    its key (protobuf field 1) then its value as JSON (field 16)."""
    key_bytes, value_bytes = key.encode(), json.dumps(value).encode()
    return (
        b"\n" + bytes([len(key_bytes)]) + key_bytes + b"\x82\x01" + bytes([len(value_bytes)]) + value_bytes
    ) in record


def wait_for(predicate, what: str, limit: float = 600) -> None:
    """Polls until `predicate()`; the limit only keeps a broken run from hanging the suite."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.2)


def logged(run_dir: Path, key: str = "loss") -> int:
    path = run_dir / "metrics.jsonl"
    return sum(f'"{key}"' in line for line in path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """zero=stage0,stage3 x offload=none,cpu with 2 ranks per job: stage0+cpu is refused
    (optimizer offload needs ZeRO >= 1) and recorded; the other three train."""
    root = tmp_path_factory.mktemp("sweep")
    env = env_without_wandb_key(root)  # W&B offline
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "-m",
            "zero=stage0,stage3",
            "offload=none,cpu",
            "launcher.ranks=2",
            *[o for o in TINY if not o.startswith("logger")],
            "logger=wandb",
            f"hydra.sweep.dir={root / 'sweep'}",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    return root / "sweep", proc


@pytest.mark.distributed
def test_sweep_runs_every_job_in_its_own_directory(sweep):
    sweep_dir, proc = sweep
    assert proc.returncode == 1, "a failed job makes the sweep exit non-zero"
    statuses = {d.name: json.loads((d / "status.json").read_text()) for d in sweep_dir.iterdir() if d.is_dir()}
    assert sorted(statuses) == ["0", "1", "2", "3"]
    failed = [n for n, s in statuses.items() if s["status"] == "failed"]
    assert failed == ["1"] and "zero=stage1" in statuses["1"]["error"]
    for job in ("0", "2", "3"):
        assert statuses[job]["status"] == "completed"
        assert len([m for m in read_metrics(sweep_dir / job) if "loss" in m]) == 6
        assert json.loads((sweep_dir / job / "ds_config.json").read_text())["train_batch_size"] == 8  # 2 ranks x 4
    assert (sweep_dir / "multirun.yaml").exists()
    rows = summary_rows(proc.stdout)
    assert rows["1"]["overrides"] == "zero=stage0 offload=cpu" and rows["1"]["status"] == "failed"
    assert [rows[job]["status"] for job in ("0", "2", "3")] == ["completed"] * 3
    # each job's objective (launcher.objective, eval_loss by default) as the sweeper got it
    assert rows["2"]["objective"] == f"{last_value(sweep_dir / '2', 'eval_loss'):.4g}"


@pytest.mark.distributed
def test_sweep_jobs_are_w_and_b_runs_named_and_grouped(sweep):
    sweep_dir, _ = sweep
    for job, name in (("0", "zero=stage0 offload=none"), ("3", "zero=stage3 offload=cpu")):
        runs = list((sweep_dir / job / "wandb").glob("offline-run-*/*.wandb"))
        assert len(runs) == 1
        record = runs[0].read_bytes()
        assert name.encode() in record
        assert f"{sweep_dir.parent.name}_{sweep_dir.name}".encode() in record  # the group
        assert b"zero3" in record or job == "0"  # technique tags
        assert summary_item(record, "objective", last_value(sweep_dir / job, "eval_loss"))


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """offload=cpu,none in batches of one job, each in a directory named by its overrides
    (`offload=cpu,trainer.seed=7`: `=` and `,`, which Hydra's override grammar treats specially):
    the first batch's job is refused (CPU offload needs ZeRO >= 1), the second must still run."""
    root = tmp_path_factory.mktemp("batched")
    kept_out = ",".join(o.split("=")[0] for o in TINY + ["launcher.objective=loss"])
    proc = subprocess.run(
        [
            PYTHON,
            str(REPO / "train.py"),
            "-m",
            "offload=cpu,none",
            "trainer.seed=7",
            *TINY,
            "launcher.objective=loss",
            "hydra.sweeper.max_batch_size=1",
            f"hydra.sweep.dir={root / 'sweep'}",
            "hydra.sweep.subdir=${hydra.job.override_dirname}",
            f"hydra.job.config.override_dirname.exclude_keys=[{kept_out}]",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return root / "sweep", proc


def test_a_failed_batch_does_not_stop_the_later_ones(batched):
    sweep_dir, proc = batched
    assert proc.returncode == 1, "a failed job makes the sweep exit non-zero, at its end"
    refused = json.loads((sweep_dir / "offload=cpu,trainer.seed=7" / "status.json").read_text())
    assert refused["status"] == "failed" and "zero=stage1" in refused["error"]
    assert "offload=cpu" in refused["overrides"]  # for scripts/compare.py: the job never wrote .hydra/
    rows = summary_rows(proc.stdout)
    assert (rows["0"]["status"], rows["1"]["status"]) == ("failed", "completed")
    assert (
        f"best: #1 offload=none (loss {last_value(sweep_dir / 'offload=none,trainer.seed=7', 'loss'):.6g}, min)"
        in proc.stdout
    )


def test_job_directories_named_with_equals_and_commas(batched):
    sweep_dir, proc = batched
    run_dir = sweep_dir / "offload=none,trainer.seed=7"
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed", proc.stdout[-3000:]
    assert len([m for m in read_metrics(run_dir) if "loss" in m]) == 6
    # the objective the sweeper got: launcher.objective=loss, the last logged loss
    assert summary_rows(proc.stdout)["1"]["objective"] == f"{last_value(run_dir, 'loss'):.4g}"


@pytest.mark.distributed
def test_sigterm_on_the_sweep_stops_its_jobs_with_a_checkpoint(tmp_path):
    """As Ctrl-C does: the running job's ranks save and stop, the next job never starts, the
    sweep exits 128 + SIGTERM."""
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen(
        [
            PYTHON,
            str(REPO / "train.py"),
            "-m",
            "trainer.seed=1,2",
            "launcher.ranks=2",
            *TINY,
            "trainer.max_steps=100000",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(lambda: logged(sweep_dir / "0") >= 2, "job 0 training")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    status = json.loads((sweep_dir / "0" / "status.json").read_text())
    assert status["status"] == "stopped" and status["signal"] == "SIGTERM"
    assert (sweep_dir / "0" / "checkpoints" / "latest").read_text() == f"step_{status['final']['step']:08d}"
    rows = summary_rows(output)
    assert (rows["0"]["status"], rows["1"]["status"]) == ("stopped", "not started")
    assert not (sweep_dir / "1").exists()


def test_timeout_sends_sigterm_so_the_job_saves(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # train.py answers SIGTERM from the first line of its main(), ~2 s after the job starts (5 s on a
    # loaded machine): 20 s lands past it, in start-up or in training; either way the job saves after
    # its first step at the latest and stops.
    proc = subprocess.run(
        [
            PYTHON,
            str(REPO / "train.py"),
            "-m",
            "trainer.seed=1",
            *TINY,
            "trainer.max_steps=10000000",
            "trainer.log_every=100",
            "hydra.launcher.timeout=20",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    status = json.loads((sweep_dir / "0" / "status.json").read_text())
    assert status["status"] == "stopped" and status["signal"] == "SIGTERM" and status["final"]["step"] >= 1
    assert (sweep_dir / "0" / "checkpoints" / "latest").read_text() == f"step_{status['final']['step']:08d}"
    assert status["error"].startswith("timed out after 20 s (hydra.launcher.timeout): stopped at step")


# A Hydra app that ignores SIGTERM (the first thing it does, before a timeout can come) when x=1.
STUBBORN_APP = """import signal, sys
if "+x=1" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
import time, hydra

@hydra.main(version_base="1.3")
def main(cfg):
    print(f"x={cfg.x}", flush=True)
    if cfg.x == 1:
        time.sleep(600)

main()
"""


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    """Any Hydra app works with the launcher (and lmrepo's sweeper): x=1 ignores the timeout's
    SIGTERM and is killed kill_grace_s later; x=2 exits 0 without a status.json, which counts as
    completed."""
    (tmp_path / "app.py").write_text(STUBBORN_APP)
    proc = subprocess.run(
        [
            PYTHON,
            "app.py",
            "-m",
            "hydra/launcher=lmrepo",
            "hydra/sweeper=lmrepo",
            "+x=1,2",
            # each job's time: x=2's Hydra start must fit in it (~1 s; 3 s on a loaded machine)
            "hydra.launcher.timeout=10",
            "hydra.launcher.kill_grace_s=1",
            "hydra.sweep.dir=sweep",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    status = json.loads((tmp_path / "sweep" / "0" / "status.json").read_text())
    assert status == {
        "status": "failed",
        "overrides": ["+x=1"],
        "error": "timed out after 10 s (hydra.launcher.timeout): killed (SIGKILL) after SIGTERM",
    }
    assert (tmp_path / "sweep" / "1" / "job.log").read_text().strip() == "x=2"
    rows = summary_rows(proc.stdout)
    assert (rows["0"]["status"], rows["1"]["status"]) == ("failed", "completed")


def test_a_job_needing_more_gpus_than_visible_is_refused_before_it_starts(tmp_path):
    """With max_parallel > 1 each job gets GPUs of its own: 4 ranks on a 2-GPU machine could
    never start, so it is refused with one line instead of waiting forever."""
    from hydra_plugins.lmrepo_launcher.lmrepo_launcher import Job, LmrepoLauncher

    launcher = LmrepoLauncher(max_parallel=2)
    jobs = [
        Job(0, ["launcher.ranks=4"], tmp_path / "0", 4, "launcher.ranks=4"),
        Job(1, [], tmp_path / "1", 2, "default"),
    ]
    launcher._refuse_impossible(jobs, gpus=2)
    assert jobs[0].error == (
        "launcher.ranks=4 needs 4 GPUs and 2 are visible (hydra.launcher.max_parallel=2 gives each job GPUs of its own)"
    )
    assert jobs[1].error is None


@pytest.mark.distributed
def test_torchrun_launch(tmp_path):
    run_dir = tmp_path / "run"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    proc = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            "2",
            str(REPO / "train.py"),
            *TINY,
            "zero=stage2",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert_ok(proc)
    assert json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"] == 8
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


def test_slurm_task_variables_become_a_torch_distributed_environment():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(
        {
            "SLURM_JOB_ID": "42",
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_JOB_NODELIST": "localhost,gpu02",
        }
    )
    env.pop("MASTER_PORT", None)
    script = (
        "import os; from lmrepo.distributed.launch import adopt_slurm_env; adopt_slurm_env(); "
        "print(*(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')))"
    )

    def adopted(**changes: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", script], env={**env, **changes}, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.split()

    *task, port = adopted()
    assert task == ["5", "8", "1", "localhost"]
    # Every task of an attempt computes one port, outside the kernel's own range; a requeued
    # attempt another (the last one's may still be held); a job's own address and port are kept.
    assert int(port) in SLURM_MASTER_PORTS and adopted()[-1] == port
    assert adopted(SLURM_RESTART_COUNT="1")[-1] != port and adopted(SLURM_JOB_ID="43")[-1] != port
    assert adopted(MASTER_ADDR="10.0.0.7", MASTER_PORT="29555")[-2:] == ["10.0.0.7", "29555"]
    # A first node whose name does not resolve, where no scontrol knows it: one line naming it
    # (tests/test_slurm.py reaches such a node at its Slurm NodeAddr)
    env.update(SLURM_JOB_NODELIST="gpu[01-02]", PATH=os.path.dirname(sys.executable))
    failed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert failed.returncode != 0 and "first node, gpu01, is no host name here" in failed.stderr


def test_slurm_launcher_config_composes():
    cfg = compose_config(["hydra/launcher=slurm", "launcher.ranks=8", "launcher.nodes=2"])
    assert cfg.launcher.ranks == 8  # the hydra part is checked by Hydra when a sweep starts
