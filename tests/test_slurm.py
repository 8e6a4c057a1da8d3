"""Slurm, for real: a two-node cluster on this machine (conftest.slurm_cluster: slurmctld and two
slurmd, node names that are no host names, no accounting), and lmrepo's own `hydra/launcher=slurm`
submitting to it as a user types it."""

import json
import os
import subprocess

import pytest

from harness import PYTHON, REPO, TINY, assert_ok, read_metrics, run_train, train_losses
from numerics import STEPS_FP32, assert_close

pytestmark = pytest.mark.distributed

STEPS = ["trainer.max_steps=4", "zero=stage3", "schedule=constant"]


def test_a_sweep_on_two_nodes_trains_as_torchrun_on_one_machine(slurm_cluster, tmp_path):
    """`-m engine=deepspeed,fsdp2` (ZeRO-3 and its FSDP2 equivalent), each job on 2 nodes x 1 rank:
    both train, every rank meeting at the first node's address (Slurm's NodeAddr: `node1` is no host
    name), and each job's losses equal the same job started by torchrun on one machine. The partition
    has no GPUs, so none are asked for; no line per status poll."""
    sweep = tmp_path / "sweep"
    command = [
        *(PYTHON, str(REPO / "train.py"), "-m", "hydra/launcher=slurm", "hydra.launcher.partition=debug"),
        *("hydra.launcher.cpus_per_task=1", "launcher.ranks=1", "launcher.nodes=2", "engine=deepspeed,fsdp2"),
        *TINY,
        *STEPS,
        f"hydra.sweep.dir={sweep}",
    ]
    env = {**os.environ, "SLURM_CONF": str(slurm_cluster)}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert_ok(proc)
    assert "Bypassing sacct error" not in proc.stdout + proc.stderr
    for job, engine in enumerate(("deepspeed", "fsdp2")):
        status = json.loads((sweep / str(job) / "status.json").read_text())
        assert status["status"] == "completed" and status["setting"]["ranks"] == 2, status
        local = run_train([*TINY, *STEPS, f"engine={engine}"], tmp_path / f"torchrun-{engine}", ranks=2, via="torchrun")
        assert_ok(local)
        assert_close(train_losses(sweep / str(job)), train_losses(tmp_path / f"torchrun-{engine}"), STEPS_FP32, engine)
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
