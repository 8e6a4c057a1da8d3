"""Sweeps and launchers, real runs on the CPU: a 2x2 multirun with 2 ranks per job and one
job that fails without stopping the others, W&B offline files per job, torchrun and python
launches, the Slurm environment mapping."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY, assert_ok, compose_config, env_without_wandb_key, read_metrics

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """zero=stage0,stage3 x offload=none,cpu with 2 ranks per job: stage0+cpu is refused
    (optimizer offload needs ZeRO >= 1) and recorded; the other three train."""
    root = tmp_path_factory.mktemp("sweep")
    env = env_without_wandb_key(root)  # W&B offline
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "zero=stage0,stage3", "offload=none,cpu",
                           "launcher.ranks=2", *[o for o in TINY if not o.startswith("logger")], "logger=wandb",
                           f"hydra.sweep.dir={root / 'sweep'}"], cwd=root, capture_output=True, text=True, env=env,
                          timeout=1200)
    return root / "sweep", proc


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
    summary = proc.stdout
    assert "zero=stage0 offload=cpu" in summary and "failed" in summary and summary.count("completed") == 3


def test_sweep_jobs_are_w_and_b_runs_named_and_grouped(sweep):
    sweep_dir, _ = sweep
    for job, name in (("0", "zero=stage0 offload=none"), ("3", "zero=stage3 offload=cpu")):
        runs = list((sweep_dir / job / "wandb").glob("offline-run-*/*.wandb"))
        assert len(runs) == 1
        record = runs[0].read_bytes()
        assert name.encode() in record
        assert f"{sweep_dir.parent.name}_{sweep_dir.name}".encode() in record  # the group
        assert b"zero3" in record or job == "0"  # technique tags


def test_torchrun_launch(tmp_path):
    run_dir = tmp_path / "run"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(REPO / "train.py"),
                           *TINY, "zero=stage2", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert_ok(proc)
    assert json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"] == 8
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


def test_slurm_task_variables_become_a_torch_distributed_environment():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update({"SLURM_JOB_ID": "42", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]"})
    script = ("import os; from lmrepo.launch import adopt_slurm_env; adopt_slurm_env(); "
              "print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], os.environ['MASTER_ADDR'])")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["5", "8", "1", "gpu01"]


def test_slurm_launcher_config_composes():
    cfg = compose_config(["hydra/launcher=slurm", "launcher.ranks=8", "launcher.nodes=2"])
    assert cfg.launcher.ranks == 8  # the hydra part is checked by Hydra when a sweep starts
