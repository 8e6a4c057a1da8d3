"""Never lose work, never hang, never run a stranger's code, with real processes:
two runs into one run.dir, checkpoints damaged on disk, a pickle with a payload, a NaN at a save
step, a rank stopped with SIGSTOP, the Slurm pre-emption signal, full disks and unwritable
directories. Each fault is one `lmrepo: error:` line (or the run's own failure status), nothing
written or deleted beyond what lmrepo created."""

import errno
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from harness import (
    FORKED_PYTHON,
    GPT2,
    PYTHON,
    REPO,
    TINY,
    assert_ok,
    launcher,
    logged_steps,
    popen_train,
    read_metrics,
    run_train,
    stop_with_signal,
    wait_for,
)
from lmrepo.distributed.launch import free_port

pytestmark = pytest.mark.filterwarnings("ignore")


def one_error_line(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmrepo: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    return errors[0]


# --- one run per directory ----------------------------------------------------------------------


def test_one_run_owns_its_directory(tmp_path):
    run_dir = tmp_path / "run"
    # Steps enough to outlast the second run's start at any speed (a TINY step takes milliseconds): the
    # SIGTERM below ends it.
    first = popen_train(["trainer.max_steps=100000", "schedule=constant"], run_dir)
    wait_for(lambda: logged_steps(run_dir) >= 2, first)
    second = run_train([*TINY, "trainer.max_steps=500"], run_dir)
    assert second.returncode == 2 and "is in use by another run" in one_error_line(second)
    os.killpg(first.pid, signal.SIGTERM)  # the first saves and stops
    first.communicate(timeout=300)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "stopped", status
    steps = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
    assert steps == sorted(set(steps)), "the second run wrote nothing into the first's metrics"

    fresh = run_train(TINY, run_dir)  # a fresh run into a used directory
    assert fresh.returncode == 2 and "already holds a run" in one_error_line(fresh)
    assert "run.resume=auto" in one_error_line(fresh)
    resumed = run_train(
        [*TINY, f"trainer.max_steps={status['final']['step'] + 1}", "schedule=constant", "run.resume=auto"], run_dir
    )
    assert_ok(resumed)


def test_resume_auto_with_nothing_to_resume_starts_fresh(tmp_path):
    run_dir = tmp_path / "run"
    assert_ok(run_train([*TINY, "trainer.max_steps=2"], run_dir))  # no checkpoint
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.0, "lr"')  # a torn last line, as a kill mid-write leaves
    assert_ok(run_train([*TINY, "trainer.max_steps=2", "run.resume=auto"], run_dir))
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == [1, 2]


# --- checkpoints damaged on disk ----------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A finished 1-rank run with a checkpoint at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    assert_ok(run_train([*TINY, "trainer.max_steps=4", "trainer.save_every=2"], run_dir))
    return run_dir


def damaged_copy(saved: Path, tmp_path: Path, damage) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    damage(run_dir / "checkpoints" / "step_00000004")
    return run_dir


def zero_the_middle(tag_dir: Path) -> None:
    path = tag_dir / "mp_rank_00_model_states.pt"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(4096))
    assert path.stat().st_size == size


def truncate(tag_dir: Path) -> None:
    path = tag_dir / "mp_rank_00_model_states.pt"
    os.truncate(path, path.stat().st_size - 100)


def remove_rng(tag_dir: Path) -> None:
    (tag_dir / "rng_rank00000.pt").unlink()


@pytest.mark.parametrize(
    "damage, message",
    [
        (zero_the_middle, "differs from what was saved (checksum)"),
        (truncate, "were saved: it is truncated or overwritten"),
        (remove_rng, "rng_rank00000.pt is missing"),
    ],
)
def test_damaged_checkpoint_is_one_line(saved, tmp_path, damage, message):
    run_dir = damaged_copy(saved, tmp_path, damage)
    before = sorted(p.name for p in run_dir.iterdir())
    proc = run_train([*TINY, "trainer.max_steps=6", "trainer.save_every=2", "run.resume=auto"], run_dir)
    assert proc.returncode == 2 and message in one_error_line(proc)
    assert sorted(p.name for p in run_dir.iterdir()) == before, "nothing written"


class Payload:
    """What a malicious checkpoint would hold: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_with_a_payload_never_runs(saved, tmp_path):
    marker = tmp_path / "payload-ran"

    def poison(tag_dir: Path) -> None:
        states = tag_dir / "mp_rank_00_model_states.pt"
        real = torch.load(states, weights_only=True)
        torch.save({**real, "extra": Payload(marker)}, states, pickle_protocol=pickle.DEFAULT_PROTOCOL)
        # The attacker also rewrites the manifest: the sizes and checksums match the poisoned file.
        from lmrepo.train.checkpoint import MANIFEST, file_record

        manifest = json.loads((tag_dir / MANIFEST).read_text())
        manifest["files"][states.name] = list(file_record(states))
        (tag_dir / MANIFEST).write_text(json.dumps(manifest))

    run_dir = damaged_copy(saved, tmp_path, poison)
    resume = run_train([*TINY, "trainer.max_steps=6", "run.resume=auto"], run_dir)
    assert resume.returncode == 2 and "holds more than weights" in one_error_line(resume)
    export = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "export_hf.py"), str(run_dir), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
    )
    assert export.returncode == 2 and "holds more than weights" in one_error_line(export)
    assert not marker.exists(), "the payload ran"


# --- a NaN at a save step ------------------------------------------------------------------------


def test_a_non_finite_loss_never_becomes_latest(tmp_path):
    """An absurd learning rate: the weights blow up after the first steps. Every step saves, and
    keep_last=1 would prune the good checkpoint for a bad one if a save were trusted at once."""
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            *TINY,
            "trainer.max_steps=20",
            "trainer.save_every=1",
            "trainer.keep_last=1",
            "optimizer.lr=1e4",
            "schedule=constant",
            "schedule.warmup_steps=0",
            "trainer.grad_clip=0",
        ],
        run_dir,
    )
    assert proc.returncode == 1 and "the loss became" in one_error_line(proc)
    bad_step = int(one_error_line(proc).split(" at step ")[1].split(":")[0])
    tags = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    latest = run_dir / "checkpoints" / "latest"
    # The save that produced the non-finite loss is gone; latest (if any) names a checkpoint whose
    # next step's loss was finite, and it is the only one left.
    assert f"step_{bad_step - 1:08d}" not in tags
    if latest.exists():
        assert tags == [latest.read_text().strip()] and int(tags[0].split("_")[1]) < bad_step - 1
    assert json.loads((run_dir / "status.json").read_text())["status"] == "failed"


# --- no hang -------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_stopped_rank_ends_every_rank_with_its_name(tmp_path):
    run_dir = tmp_path / "run"
    proc = popen_train(["trainer.max_steps=100000", "run.hang_timeout_s=10"], run_dir, ranks=2)
    beat = run_dir / ".heartbeat" / "rank00001.json"
    wait_for(lambda: beat.exists() and json.loads(beat.read_text())["step"] >= 3, proc)
    stopped_at = time.monotonic()
    os.kill(json.loads(beat.read_text())["pid"], signal.SIGSTOP)
    proc.communicate(timeout=600)  # a guard against a hang, not a speed limit
    took = time.monotonic() - stopped_at
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and "rank 1" in status["error"] and "stopped" in status["error"], status
    print(f"every rank ended {took:.1f} s after rank 1 was stopped (run.hang_timeout_s=10)")


def test_the_rank_that_reports_a_stopped_peer_kills_it_and_no_running_one(tmp_path):
    """A peer stopped by job control takes no signal but SIGKILL, so the launcher's SIGTERM would
    wait out its grace period (30 s): the rank that names it in the failure ends it. A peer that is
    running is left alone (the launcher ends it)."""
    from lmrepo.train.watchdog import Watchdog, job_control_stopped

    stopped, running = (subprocess.Popen(["sleep", "600"]) for _ in range(2))
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        wait_for(lambda: job_control_stopped(stopped.pid), stopped)
        watchdog = Watchdog(tmp_path, 0, 3, 0, on_hang=None)
        watchdog.beat(5)
        for rank, peer in ((1, stopped), (2, running)):  # their heartbeats, as they write them
            beat = {"rank": rank, "step": 5, "time": time.time(), "pid": peer.pid, "host": socket.gethostname()}
            (tmp_path / ".heartbeat" / f"rank{rank:05d}.json").write_text(json.dumps({**beat, "node": "here"}))
        line = watchdog.describe(RuntimeError("Timed out waiting 10000ms for recv operation to complete"))
        assert f"rank 1 (pid {stopped.pid} on here) is stopped, at step 5" in line and "rank 2" not in line, line
        watchdog.end_stopped_peers()
        assert stopped.wait(timeout=60) == -signal.SIGKILL
        assert running.poll() is None
    finally:
        for peer in (stopped, running):
            peer.kill()
            peer.wait()


def test_a_rank_that_cannot_reach_the_rendezvous_ends_in_one_line(tmp_path):
    """A rank whose MASTER_ADDR:MASTER_PORT answers nothing (rank 0's node down, a wrong address)
    ends within run.hang_timeout_s with one line naming the address, not torch's traceback."""
    port = free_port()  # claimed for this test: nothing listens there
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2"}
    env["LOCAL_RANK"] = "1"
    proc = subprocess.run(
        [PYTHON, str(REPO / "train.py"), *TINY, "run.hang_timeout_s=5", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmrepo: error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert f"could not meet the other 1 rank(s) at 127.0.0.1:{port}" in errors[0], errors
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.distributed
def test_the_preemption_signal_saves_on_every_rank_then_resumes(tmp_path):
    """submitit's time-limit warning (SIGUSR2) reaches every task, as Slurm's --signal does."""
    run_dir = tmp_path / "run"
    step, _ = stop_with_signal(
        signal.SIGUSR2, ["trainer.max_steps=100000", "schedule=constant", "zero=stage2"], run_dir
    )
    resumed = run_train(
        [*TINY, f"trainer.max_steps={step + 1}", "schedule=constant", "zero=stage2", "run.resume=auto"],
        run_dir,
        ranks=2,
    )
    assert_ok(resumed)
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m][-1] == step + 1


@pytest.mark.parametrize("mode", ["train", "generate"])
def test_only_generation_maps_deepspeeds_cpu_all_reduce_buffer(mode):
    """DeepSpeed's CPU all-reduce kernel (66 MiB of /dev/shm per rank, each rank spinning until its
    peers' exist) serves DeepSpeed-Inference's all-reduce alone: training's ranks start without it
    (their collectives go through torch.distributed, and an inference all-reduce there still sums),
    generation's ranks with it, each releasing its buffer at the end."""
    proc = subprocess.run(
        [*launcher(2), str(REPO / "tests" / "probes" / "all_reduce_kernel_probe.py"), mode],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert_ok(proc)
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in ranks) == [0, 1], proc.stdout[-2000:]
    generating = mode == "generate"
    for rank in ranks:
        assert rank["kernel"] is generating and rank["buffer"] is generating, rank
        assert rank["sum"] == [3.0] * 4 and rank["buffer_after"] is False, rank


def test_start_up_removes_only_the_shm_buffers_left_by_dead_runs(monkeypatch):
    """What a killed run leaves in /dev/shm (66 MiB per rank) goes at the next start; a buffer
    another job is creating right now (not mapped yet, seconds old) stays."""
    from lmrepo.distributed import launch

    prefix = f"/dev/shm/{launch.SHM_PREFIX}{os.getuid()}_127.0.0.1_"
    left_over, being_created = Path(f"{prefix}1_0"), Path(f"{prefix}2_0")
    for path in (left_over, being_created):
        path.write_bytes(b"\0" * 1024)
    os.utime(left_over, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's word for it; DeepSpeed's launcher says LOCAL_SIZE
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    try:
        launch.prepare_shm()
        assert not left_over.exists() and being_created.exists()
    finally:
        left_over.unlink(missing_ok=True)
        being_created.unlink(missing_ok=True)


# --- disks and directories -----------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs: a disk that fills up (mounting needs root, which CI has)."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if mounted.returncode:  # mount's own words: not root, or root without CAP_SYS_ADMIN (a container)
        pytest.skip(
            f"mounting a small tmpfs needs root with CAP_SYS_ADMIN: {(mounted.stderr.strip().splitlines() or [''])[0]}"
        )
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_while_tokenizing_is_one_line(small_disk, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 100_000)  # ~4 MB of text, ~2 M tokens
    proc = run_train([*TINY, "data=text", f"data.paths=[{corpus}]", f"data.cache_dir={small_disk}"], tmp_path / "run")
    assert proc.returncode == 2 and "no space left on device" in one_error_line(proc)
    assert [p.name for p in small_disk.iterdir() if not p.name.endswith(".lock")] == [], "no partial token files"


def test_a_full_disk_at_save_keeps_the_last_checkpoint(small_disk, tmp_path):
    run_dir = small_disk / "run"
    proc = run_train([*TINY, *GPT2, "trainer.max_steps=4", "trainer.save_every=2"], run_dir)  # 13 MB a save
    assert proc.returncode == 1 and "no space left on device" in one_error_line(proc)
    assert "saving checkpoint" in one_error_line(proc)
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == [], "no half checkpoint"


def test_a_file_size_limit_at_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """`ulimit -f` (how a quota-managed file system or a batch system's limit answers: EFBIG): torch's
    zip writer fails without an errno ("unexpected pos"); the line names the limit, the partial
    checkpoint goes and status.json says why. The limit (8 MiB) is above the tokens and logs, below
    one TINY model-states file with GPT-2's BPE (~13 MB: the 50,257-row embedding in fp32)."""
    import resource

    limit = 8 * 2**20

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            PYTHON,
            str(REPO / "train.py"),
            *TINY,
            *GPT2,
            "trainer.max_steps=4",
            "trainer.save_every=2",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited,
    )
    line = one_error_line(proc)
    assert proc.returncode == 1 and "saving checkpoint" in line and "file-size limit of 8.0 MiB (ulimit -f)" in line
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == [], "no half checkpoint"
    assert not (run_dir / "checkpoints" / "latest").exists()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and "ulimit -f" in status["error"]


def test_a_master_port_another_job_holds_is_one_line(tmp_path):
    """Two `deepspeed train.py` on one machine both take port 29500: the second one's rank 0 says
    so, naming --master_port and a free port, where torch gave a traceback per rank. One rank: the
    check is rank 0's, and a second rank would only wait for the launcher to end it."""
    import socket

    with socket.socket() as other_job:
        other_job.bind(("127.0.0.1", 0))
        other_job.listen()
        port = other_job.getsockname()[1]
        run_dir = tmp_path / "run"
        proc = subprocess.run(
            [str(Path(PYTHON).with_name("deepspeed")), "--num_gpus", "1", "--master_port", str(port),
             str(REPO / "train.py"), *TINY, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    line = one_error_line(proc)
    assert proc.returncode != 0 and f"MASTER_PORT {port} is in use" in line and "--master_port" in line
    assert "DistNetworkError" not in proc.stderr


def test_a_disk_error_one_rank_meets_alone_is_said_by_that_rank(monkeypatch, capsys):
    """A file error on rank 1 only (its disk, or a race on a shared directory) ended that rank
    without a word: rank 0 could only report the peer gone. Now the rank says it."""
    from lmrepo.config.messages import one_line_disk_errors

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_, one_line_disk_errors():
        raise OSError(errno.ENOENT, "No such file or directory", "/runs/a/checkpoints/step_00000003/manifest.json.tmp")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "lmrepo: error: rank 1: no such file or directory (/runs/a/checkpoints/"
        "step_00000003/manifest.json.tmp): choose a writable run directory with room "
        "(run.dir=...)\n"
    )


@pytest.mark.parametrize("where", ["cache", "hydra.run.dir", "run.dir"])
def test_a_file_where_a_directory_belongs_is_one_line(tmp_path, where):
    """Hydra creating its run directory fails outside the job; the run writing into run.dir fails
    inside it, where Hydra would print its own "Error executing job" line before ours."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    overrides = {"cache": [f"data.cache_dir={blocker / 'cache'}"], "run.dir": [f"run.dir={blocker / 'run'}"]}
    run_dir = blocker / "run" if where == "hydra.run.dir" else tmp_path / "run"
    proc = run_train([*TINY, "data=text", f"data.paths=[{REPO / 'README.md'}]", *overrides.get(where, [])], run_dir)
    line = one_error_line(proc)
    assert proc.returncode == 2 and "not a directory" in line and str(blocker) in line
    assert "Error executing job" not in proc.stderr, proc.stderr[-3000:]
    if where != "cache":
        assert line.endswith(f"({where}=...)")


def test_a_sweep_job_reports_a_disk_error_in_one_line(tmp_path):
    """The sweep's parent sets HYDRA_FULL_ERROR for itself; its jobs inherit it and once took it
    for the user's wish for a traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = subprocess.run(
        [PYTHON, str(REPO / "train.py"), "-m", *TINY, f"run.dir={blocker / 'run'}",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    job_log = (tmp_path / "sweep" / "0" / "job.log").read_text()
    assert proc.returncode != 0 and "Traceback" not in job_log, job_log[-3000:]
    error = json.loads((tmp_path / "sweep" / "0" / "status.json").read_text())["error"]
    assert error == f"not a directory ({blocker / 'run'}): choose a writable run directory with room (run.dir=...)"


def test_a_refused_job_keeps_the_users_empty_directories(tmp_path):
    mine = tmp_path / "my-empty-dir"
    mine.mkdir()
    proc = run_train([*TINY, "trainer.seed=-1"], mine / "outputs" / "run")
    assert proc.returncode == 2 and mine.is_dir() and list(mine.iterdir()) == []


def test_secrets_in_a_user_json_are_not_written(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"comet": {"enabled": False, "api_key": "s3cr3t-key", "project": "p"}}))
    run_dir = tmp_path / "run"
    proc = run_train(
        [*TINY, "trainer.max_steps=2", f"deepspeed_config={user}", "logger=wandb"],
        run_dir,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert_ok(proc)
    written = json.loads((run_dir / "ds_config.json").read_text())
    assert written["comet"]["api_key"] == "***"
    everything = b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())
    assert b"s3cr3t-key" not in everything and "s3cr3t-key" not in proc.stdout + proc.stderr


@pytest.mark.distributed
def test_ranks_that_name_another_run_dir_use_rank_0s(tmp_path):
    """Two nodes whose launchers started a second apart name different run directories: every
    rank writes into rank 0's, and the other's empty directory is gone."""
    port, dirs = str(free_port()), [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    procs = []
    for rank, run_dir in enumerate(dirs):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        procs.append(
            subprocess.Popen(
                [
                    PYTHON,
                    str(REPO / "train.py"),
                    *TINY,
                    "zero=stage2",
                    "trainer.max_steps=2",
                    "trainer.save_every=2",
                    f"hydra.run.dir={run_dir}",
                ],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    shards = sorted(p.name for p in (dirs[0] / "checkpoints" / "step_00000002").glob("*optim_states.pt"))
    assert len(shards) == 2, "both ranks' optimizer shards are in rank 0's checkpoint"
    assert not dirs[1].exists()
