"""`hydra/launcher=lmrepo` (the default of train.py): every job of a sweep runs as its own
`deepspeed --num_gpus <launcher.ranks> train.py <overrides>` (plain `python` for 1 rank) in its
own run directory under the sweep directory.

Why a separate process per job: a sweep inside one distributed launch makes every rank run
its own sweep, with diverging output directories, and one failed job deadlocks the others.
Here a job that fails (bad combination, crash, OOM) is recorded with its error in its
directory (status.json, job.log) and the sweep goes on; the end prints a summary table.
"""
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class LmrepoLauncherConf:
    _target_: str = "hydra_plugins.lmrepo_launcher.lmrepo_launcher.LmrepoLauncher"
    max_parallel: int = 1          # jobs at once; on GPUs each gets its own devices (launcher.ranks each)
    timeout: Optional[int] = None  # seconds per job; None = no limit


ConfigStore.instance().store(group="hydra/launcher", name="lmrepo", node=LmrepoLauncherConf, provider="lmrepo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_name(overrides: Sequence[str], varying: set[str]) -> str:
    """The choices that differ between the sweep's jobs, e.g. `zero=stage2 offload=cpu`."""
    chosen = [o for o in filter_overrides(overrides) if o.split("=", 1)[0].lstrip("+~") in varying]
    return " ".join(chosen) or "default"


def varying_keys(job_overrides: Sequence[Sequence[str]]) -> set[str]:
    values: dict[str, set[str]] = {}
    for overrides in job_overrides:
        for o in overrides:
            key, _, value = o.partition("=")
            values.setdefault(key.lstrip("+~"), set()).add(value)
    return {k for k, v in values.items() if len(v) > 1}


@dataclass
class Job:
    num: int
    overrides: list[str]
    run_dir: Path
    ranks: int
    name: str
    process: Optional[subprocess.Popen] = None
    started: float = 0.0
    devices: tuple = ()
    error: Optional[str] = None


class LmrepoLauncher(Launcher):
    def __init__(self, max_parallel: int = 1, timeout: Optional[int] = None) -> None:
        self.max_parallel, self.timeout = max(1, max_parallel), timeout
        self.config: Optional[DictConfig] = None
        self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        varying = varying_keys(job_overrides)
        jobs = [self._job(initial_job_idx + i, list(o), sweep_dir, varying) for i, o in enumerate(job_overrides)]
        log.info(f"lmrepo launcher: {len(jobs)} job(s) in {sweep_dir}, {self.max_parallel} at a time")
        self._run_all(jobs, sweep_dir)
        print_summary(jobs)
        failed = [job for job in jobs if job.error is not None]
        if failed:
            # Exit non-zero without Hydra's traceback: the summary above already names each error.
            log.error(f"{len(failed)} of {len(jobs)} job(s) failed; their errors are in <job dir>/status.json and job.log")
            raise SystemExit(1)
        return [self._job_return(job) for job in jobs]

    def _job(self, num: int, overrides: list[str], sweep_dir: Path, varying: set[str]) -> Job:
        """Composes the job's config (to read launcher.ranks and the run directory); a job whose
        overrides do not compose is recorded as failed here."""
        name = job_name(overrides, varying)
        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(cfg):
                cfg.hydra.job.num = num
                cfg.hydra.job.id = str(num)
            HydraConfig.instance().set_config(cfg)
            run_dir = sweep_dir / str(cfg.hydra.sweep.subdir)
            return Job(num, overrides, run_dir, int(cfg.launcher.ranks), name)
        except Exception as err:  # Hydra's composition errors: the job cannot start
            return Job(num, overrides, sweep_dir / str(num), 0, name, error=f"{type(err).__name__}: {str(err).splitlines()[0]}")

    def _command(self, job: Job) -> list[str]:
        script = os.path.abspath(sys.argv[0])
        # hydra.mode=RUN: a recipe that sets `hydra.mode: MULTIRUN` (experiment=zero_sweep) would
        # otherwise make every job start the whole sweep again, recursively.
        overrides = [*job.overrides, "hydra.mode=RUN", f"hydra.run.dir={job.run_dir}"]
        if job.ranks <= 1:
            return [sys.executable, script, *overrides]
        launcher = [str(Path(sys.executable).with_name("deepspeed")), "--master_port", str(free_port())]
        if job.devices:
            launcher += ["--include", "localhost:" + ",".join(map(str, job.devices))]
        else:
            launcher += ["--num_gpus", str(job.ranks)]
        return [*launcher, script, *overrides]

    def _run_all(self, jobs: list[Job], sweep_dir: Path) -> None:
        pending = [j for j in jobs if j.error is None]
        for job in jobs:
            if job.error is not None:
                record_failure(job)
        running: list[Job] = []
        free_gpus = list(range(_gpu_count()))
        while pending or running:
            while pending and len(running) < self.max_parallel and _fits(pending[0], free_gpus, self.max_parallel):
                job = pending.pop(0)
                if self.max_parallel > 1 and free_gpus:
                    job.devices, free_gpus[:] = tuple(free_gpus[:job.ranks]), free_gpus[job.ranks:]
                self._start(job, sweep_dir)
                running.append(job)
            time.sleep(0.5)
            for job in [j for j in running if self._finished(j)]:
                running.remove(job)
                free_gpus.extend(job.devices)

    def _start(self, job: Job, sweep_dir: Path) -> None:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, LMREPO_SWEEP_GROUP=f"{sweep_dir.parent.name}_{sweep_dir.name}",
                   LMREPO_SWEEP_DIR=str(sweep_dir), LMREPO_JOB_NAME=job.name)
        log.info(f"\t#{job.num} : {' '.join(filter_overrides(job.overrides))} ({job.ranks} rank(s))")
        command = self._command(job)
        job.started = time.time()
        # job.json: the exact command (to rerun one job by hand) and when it started.
        (job.run_dir / "job.json").write_text(json.dumps(
            {"num": job.num, "name": job.name, "command": command, "started": job.started}, indent=2))
        log_file = open(job.run_dir / "job.log", "w")
        job.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)

    def _finished(self, job: Job) -> bool:
        if job.process.poll() is None:
            if self.timeout and time.time() - job.started > self.timeout:
                os.killpg(job.process.pid, 9)
                job.process.wait()
                job.error = f"timed out after {self.timeout} s (hydra.launcher.timeout)"
            else:
                return False
        if job.process.returncode != 0 and job.error is None:
            # train.py records the error of a job that failed after starting; else the log's last word.
            job.error = read_status(job.run_dir).get("error") or last_error_line(job.run_dir / "job.log",
                                                                                 job.process.returncode)
        if job.error is not None:
            record_failure(job)
        return True

    def _job_return(self, job: Job) -> JobReturn:
        ret = JobReturn(overrides=job.overrides, working_dir=str(job.run_dir), task_name="train")
        ret.status, ret.return_value = JobStatus.COMPLETED, read_status(job.run_dir)
        return ret


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _fits(job: Job, free_gpus: list[int], max_parallel: int) -> bool:
    return max_parallel == 1 or not free_gpus and _gpu_count() == 0 or len(free_gpus) >= job.ranks


def last_error_line(log_file: Path, returncode: int) -> str:
    lines = log_file.read_text(errors="replace").splitlines() if log_file.exists() else []
    errors = [line for line in lines if line.startswith("lmrepo: error:")]
    if errors:
        return errors[-1].removeprefix("lmrepo: error: ")
    tail = [line for line in lines if line.strip() and "HYDRA_FULL_ERROR" not in line][-1:] or [""]
    return f"exit code {returncode}: {tail[0][-300:]}"


def read_status(run_dir: Path) -> dict:
    path = run_dir / "status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def record_failure(job: Job) -> None:
    """train.py writes its own status.json when it fails after starting; a job refused before
    it started (bad combination) gets one here, so the sweep keeps the error."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    status = read_status(job.run_dir)
    if status.get("status") != "failed":
        (job.run_dir / "status.json").write_text(json.dumps({"status": "failed", "error": job.error}, indent=2))


def print_summary(jobs: list[Job]) -> None:
    rows = []
    for job in jobs:
        status = read_status(job.run_dir)
        final = status.get("final", {})
        rows.append((f"#{job.num}", job.name, status.get("status", "failed"),
                     f"{final['loss']:.4f}" if "loss" in final else "-",
                     f"{final['eval_loss']:.4f}" if "eval_loss" in final else "-",
                     f"{final['tokens_per_s']:.0f}" if "tokens_per_s" in final else "-",
                     f"{status['wall_s']:.0f}" if "wall_s" in status else "-",
                     (job.error or "")[:80]))
    header = ("job", "overrides", "status", "loss", "eval_loss", "tokens/s", "wall s", "error")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(header, widths)), flush=True)
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)), flush=True)
