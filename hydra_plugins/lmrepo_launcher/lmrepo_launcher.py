"""`hydra/launcher=lmrepo` (the default of train.py): every job of a sweep runs as its own
`deepspeed --num_gpus <launcher.ranks> train.py <overrides>` (plain `python` for 1 rank) in its
own run directory under the sweep directory.

Why a separate process per job: a sweep inside one distributed launch makes every rank run
its own sweep, with diverging output directories, and one failed job deadlocks the others.

Hydra's launcher contract, kept: each job is the app re-run in RUN mode with the sweep's Hydra
overrides (hydra.job.*, hydra.verbose, logging, env_set, callbacks), its config flags and its
job overrides, so it composes the config BasicLauncher's run_job would; `launch()` returns one
JobReturn per job: COMPLETED with the job's objective (a float, `launcher.objective` read from
its metrics.jsonl) or FAILED with the error, and never ends the sweep itself (search sweepers
call it batch after batch). The sweep's summary table and exit code come at its end, from the
callback the launcher adds to Hydra's (SweepEnd).
"""

import copy
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.types import Quote, QuotedString
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, setup_globals
from hydra.experimental.callback import Callback
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from lmrepo import compare
from lmrepo.compare import read_metrics
from lmrepo.distributed.launch import free_port
from lmrepo.observability.figures import objective_value

log = logging.getLogger(__name__)


@dataclass
class LmrepoLauncherConf:
    _target_: str = "hydra_plugins.lmrepo_launcher.lmrepo_launcher.LmrepoLauncher"
    max_parallel: int = 1  # jobs at once; on GPUs each gets its own devices (launcher.ranks each)
    timeout: int | None = None  # seconds per job, then SIGTERM (the job saves and stops); None = no limit
    kill_grace_s: int = 60  # seconds between that SIGTERM (or the sweep's) and SIGKILL


ConfigStore.instance().store(group="hydra/launcher", name="lmrepo", node=LmrepoLauncherConf, provider="lmrepo")


class JobFailed(Exception):
    """A failed job's JobReturn value: what a sweeper raises or records (Optuna: a failed trial)."""


@dataclass
class Job:
    num: int
    overrides: list[str]
    run_dir: Path
    ranks: int
    name: str
    cfg: DictConfig | None = None  # the job's composed config (None: it did not compose)
    process: subprocess.Popen | None = None
    started: float = 0.0
    devices: tuple = ()
    error: str | None = None
    value: float | None = None  # the objective, when the job completed
    stopping_since: float | None = None  # when SIGTERM went to its ranks
    timed_out: bool = False
    killed: bool = False
    signalled: set = field(default_factory=set)  # pids that got that SIGTERM

    @property
    def objective(self) -> str | None:
        """launcher.objective; None for an app without it (then the job returns no value)."""
        return OmegaConf.select(self.cfg, "launcher.objective", default=None) if self.cfg is not None else None


class StopSignals:
    """Ctrl-C (SIGINT) or SIGTERM on the sweep while jobs run: counted here, acted on by the
    launch loop. Jobs run in sessions of their own, so the terminal's Ctrl-C reaches only this
    process and the loop decides what each job gets (SIGTERM, a second signal: SIGKILL)."""

    def __enter__(self) -> "StopSignals":
        self.signum, self.count = None, 0
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame) -> None:
        self.signum, self.count = signum, self.count + 1

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


class LmrepoLauncher(Launcher):
    reports_failures = True  # the summary and the exit status at the sweep's end (SweepEnd)

    def __init__(self, max_parallel: int = 1, timeout: int | None = None, kill_grace_s: int = 60) -> None:
        self.max_parallel, self.timeout, self.kill_grace_s = max(1, max_parallel), timeout, kill_grace_s
        self.config: DictConfig | None = None
        self.hydra_context = None
        self.jobs: list[Job] = []  # every job of the sweep, all batches

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        check_direction(config)
        # A search sweeper may keep its state in the sweep dir (Optuna's sqlite storage) before the first launch.
        Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        # First in the list: on_multirun_end runs in reverse, so the verdict comes after the user's callbacks.
        hydra_context.callbacks.callbacks.insert(0, SweepEnd(self))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        fixed = set(OmegaConf.to_container(self.config.hydra.overrides.task, resolve=False))
        jobs = [compose_job(self, initial_job_idx + i, list(o), sweep_dir, fixed) for i, o in enumerate(job_overrides)]
        gpus = _gpu_count() if self.max_parallel > 1 else 0  # handed out per job only when jobs run side by side
        self._refuse_impossible(jobs, gpus)
        log.info(f"lmrepo launcher: {len(jobs)} job(s) in {sweep_dir}, {self.max_parallel} at a time")
        with StopSignals() as stop:
            self._run_all(jobs, sweep_dir, stop, gpus)
        self.jobs += jobs
        if stop.signum is not None:
            self._end_stopped(stop.signum)
        return [job_return(job) for job in jobs]

    def _refuse_impossible(self, jobs: list[Job], gpus: int) -> None:
        """With max_parallel > 1 each job gets GPUs of its own: one that needs more than the machine
        has would wait forever."""
        for job in jobs:
            if job.error is None and 0 < gpus < job.ranks:
                job.error = (
                    f"launcher.ranks={job.ranks} needs {job.ranks} GPUs and {gpus} are visible "
                    f"(hydra.launcher.max_parallel={self.max_parallel} gives each job GPUs of its own)"
                )

    def _command(self, job: Job) -> list[str]:
        # The sweep's Hydra overrides, unresolved (resolving would turn `${hydra.job.override_dirname}`
        # into this process's value), then the job's; hydra.mode=RUN last, so a recipe that sets
        # `hydra.mode: MULTIRUN` (experiment=zero_sweep) does not make every job start the sweep again.
        hydra_overrides = OmegaConf.to_container(self.config.hydra.overrides.hydra, resolve=False)
        run_dir = QuotedString(text=str(job.run_dir), quote=Quote.single).with_quotes()  # `=`, `,`, quotes: any path
        overrides = [
            *hydra_overrides,
            *job.overrides,
            "hydra.mode=RUN",
            f"hydra.run.dir={run_dir}",
            f"hydra.job.num={job.num}",
            f"hydra.job.id={job.num}",
        ]
        script = [os.path.abspath(sys.argv[0]), *config_flags(sys.argv[1:])]
        if job.ranks <= 1:
            return [sys.executable, *script, *overrides]
        deepspeed = str(Path(sys.executable).with_name("deepspeed"))
        launcher = [deepspeed, "--master_port", str(free_port()), "--log_level=warning"]  # not its INFO lines
        if job.devices:
            launcher += ["--include", "localhost:" + ",".join(map(str, job.devices))]
        else:
            launcher += ["--num_gpus", str(job.ranks)]
        return [*launcher, *script, *overrides]

    def _run_all(self, jobs: list[Job], sweep_dir: Path, stop: StopSignals, gpus: int) -> None:
        for job in jobs:
            if job.error is not None:
                record_failure(job)
        pending, running = [j for j in jobs if j.error is None], []
        free_gpus = list(range(gpus))
        while pending or running:
            if stop.signum is not None:
                pending.clear()  # the sweep was asked to stop: nothing new starts
            while pending and len(running) < self.max_parallel and len(free_gpus) >= (pending[0].ranks if gpus else 0):
                job = pending.pop(0)
                if gpus:
                    job.devices, free_gpus[:] = tuple(free_gpus[: job.ranks]), free_gpus[job.ranks :]
                self._start(job, sweep_dir)
                running.append(job)
            time.sleep(0.5)
            for job in [j for j in running if self._finished(j, stop)]:
                running.remove(job)
                free_gpus.extend(job.devices)

    def _start(self, job: Job, sweep_dir: Path) -> None:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ,
            LMREPO_SWEEP_GROUP=sweep_group(self.config, sweep_dir),
            LMREPO_SWEEP_DIR=str(sweep_dir),
            LMREPO_JOB_NAME=job.name,
        )
        log.info(f"\t#{job.num} : {' '.join(filter_overrides(job.overrides))} ({job.ranks} rank(s))")
        command = self._command(job)
        job.started = time.time()
        # job.json: the exact command (to rerun one job by hand) and when it started.
        (job.run_dir / "job.json").write_text(
            json.dumps({"num": job.num, "name": job.name, "command": command, "started": job.started}, indent=2)
        )
        with open(job.run_dir / "job.log", "w") as log_file:
            job.process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def _finished(self, job: Job, stop: StopSignals) -> bool:
        """Tends a running job (timeout, the sweep's stop) and, once it exited, records how it ended."""
        if job.process.poll() is None:
            self._tend(job, stop)
            return False
        self._conclude(job, stopped_by_sweep=stop.signum is not None)
        return True

    def _tend(self, job: Job, stop: StopSignals) -> None:
        now = time.time()
        if job.stopping_since is None and self.timeout and now - job.started > self.timeout:
            job.timed_out = True
        if job.timed_out or stop.signum is not None:
            job.stopping_since = job.stopping_since or now
            terminate_ranks(job)  # again each time: ranks the deepspeed launcher starts late get it too
        if job.stopping_since is not None and (now - job.stopping_since > self.kill_grace_s or stop.count > 1):
            kill_group(job)  # past the grace period, or a second Ctrl-C

    def _conclude(self, job: Job, stopped_by_sweep: bool) -> None:
        status = read_status(job.run_dir)
        job.error = job_error(job, status, stopped_by_sweep, self.timeout)
        if job.error is None and job.objective is not None and status.get("status") != "stopped":
            job.value, job.error = read_objective(job.run_dir, job.objective)
        if job.error is not None:
            record_failure(job)
        outcome = job.error or status.get("status", "completed")
        log.info(
            f"\t#{job.num} {job.name}: {outcome}"
            + (f", {job.objective} {job.value:.6g}" if job.value is not None else "")
        )

    def _end_stopped(self, signum: int) -> None:
        """Ctrl-C or SIGTERM on the sweep: its jobs saved and stopped; the sweep ends here, as the
        signal asked, whatever the sweeper would launch next."""
        print_summary(self.jobs)
        log.error(
            f"lmrepo launcher: {signal.Signals(signum).name} received: the sweep stopped; a stopped job "
            "continues with its command (job.json) plus run.resume=auto"
        )
        raise SystemExit(128 + signum)


class SweepEnd(Callback):
    """The end of a sweep, whatever the sweeper: the summary of every job of every batch, and
    exit status 1 when any failed (a sweeper that goes on past failures, such as hydra/sweeper=lmrepo
    or Optuna's with max_failure_rate, would otherwise end the command with 0)."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher  # lmrepo's local launcher or its Slurm one: its .jobs

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        jobs = self.launcher.jobs
        if not jobs:
            return
        print_summary(jobs)
        failed = [job for job in jobs if job.error is not None]
        if failed:
            log.error(
                f"{len(failed)} of {len(jobs)} job(s) failed; their errors are in <job dir>/status.json and job.log"
            )
            raise SystemExit(1)


def compose_job(launcher: Launcher, num: int, overrides: list[str], sweep_dir: Path, fixed: set[str]) -> Job:
    """Composes a sweep job's config as BasicLauncher does (launcher.ranks, the run directory,
    the objective); a job whose overrides do not compose is recorded as failed here."""
    name = job_name(overrides, fixed)
    hydra_config = HydraConfig.instance().cfg
    try:
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
        with open_dict(cfg):
            cfg.hydra.job.num = num
            cfg.hydra.job.id = num
        HydraConfig.instance().set_config(cfg)  # the subdir may read the job's own values: ${hydra:job.num}
        run_dir = sweep_dir / str(cfg.hydra.sweep.subdir)
        return Job(num, overrides, run_dir, int(OmegaConf.select(cfg, "launcher.ranks", default=1)), name, cfg)
    except Exception as err:  # Hydra's composition errors: the job cannot start
        return Job(
            num, overrides, sweep_dir / str(num), 0, name, error=f"{type(err).__name__}: {str(err).splitlines()[0]}"
        )
    finally:
        HydraConfig.instance().cfg = hydra_config


def job_return(job: Job) -> JobReturn:
    ret = JobReturn(overrides=job.overrides, working_dir=str(job.run_dir))
    if job.cfg is not None:
        task_cfg = copy.deepcopy(job.cfg)
        with read_write(task_cfg), open_dict(task_cfg):
            del task_cfg["hydra"]
        ret.cfg, ret.hydra_cfg = task_cfg, OmegaConf.create({"hydra": job.cfg.hydra})
        ret.task_name = job.cfg.hydra.job.name
        ret.working_dir = str(job.run_dir) if job.cfg.hydra.job.chdir else os.getcwd()
    if job.error is None:
        ret.status, ret.return_value = JobStatus.COMPLETED, job.value
    else:
        ret.status, ret.return_value = JobStatus.FAILED, JobFailed(f"job #{job.num} ({job.name}): {job.error}")
    return ret


def check_direction(config: DictConfig) -> None:
    """The launcher returns the objective as logged, never negated: a search sweeper's own
    direction must say which way is better, and it must agree with launcher.objective_mode."""
    mode = OmegaConf.select(config, "launcher.objective_mode", default=None)
    direction = OmegaConf.select(config, "hydra.sweeper.direction", default=None)
    if mode is None or not isinstance(direction, str):
        return
    expected = {"min": "minimize", "max": "maximize"}[str(mode)]
    if direction != expected:
        print(
            f"lmrepo: error: hydra.sweeper.direction={direction} but launcher.objective_mode={mode}: "
            f"set hydra.sweeper.direction={expected} (or the other objective_mode)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)


def config_flags(argv: list[str]) -> list[str]:
    """--config-path / --config-name / --config-dir as the sweep was given them (Hydra's own
    parser): every job composes from the same config sources."""
    args, _ = get_args_parser().parse_known_args(argv)
    flags = [
        ("--config-path", args.config_path),
        ("--config-name", args.config_name),
        ("--config-dir", args.config_dir),
    ]
    return [part for flag, value in flags if value is not None for part in (flag, value)]


def job_name(overrides: Sequence[str], fixed: set[str]) -> str:
    """The job's own choices, e.g. `zero=stage2 offload=cpu`: its overrides less those the whole
    sweep shares as given on the command line (a sweeper's values, Optuna's included, stay)."""
    return " ".join(o for o in filter_overrides(overrides) if o not in fixed) or "default"


def sweep_group(config: DictConfig, sweep_dir: Path) -> str:
    """The W&B group: the study (a search sweeper's study_name), else the sweep (`<date>_<time>`)."""
    study = OmegaConf.select(config, "hydra.sweeper.study_name", default=None)
    return str(study) if study else f"{sweep_dir.parent.name}_{sweep_dir.name}"


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def rank_processes(job: Job) -> list[psutil.Process]:
    """The processes that train: the job's own for one rank; under the deepspeed launcher the
    ranks (runner -> launch.py -> ranks), not the launcher: on SIGTERM it kills its ranks 30 s
    later, mid-save for a large model, while the ranks save, exit 0 and it then exits 0 itself."""
    try:
        root = psutil.Process(job.process.pid)
        return [root] if job.ranks <= 1 else [p for child in root.children() for p in child.children()]
    except psutil.NoSuchProcess:
        return []


def terminate_ranks(job: Job) -> None:
    for process in rank_processes(job):
        if process.pid not in job.signalled:
            job.signalled.add(process.pid)
            try:
                process.send_signal(signal.SIGTERM)  # train.py saves a checkpoint and stops
            except psutil.NoSuchProcess:
                pass


def kill_group(job: Job) -> None:
    job.killed = True
    try:
        os.killpg(job.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def how_it_stopped(job: Job, status: dict) -> str | None:
    """For a job that got a stop signal: saved and stopped, killed, or ended by the signal itself
    (train.py before its handler is in place, early in its start; an app without one); None if none."""
    if status.get("status") == "stopped":
        return f"stopped at step {status.get('final', {}).get('step', 0)} with a checkpoint"
    if job.killed:
        return "killed (SIGKILL) after SIGTERM"
    if job.process.returncode < 0:
        return f"ended by {signal.Signals(-job.process.returncode).name} without saving a checkpoint"
    return None


def job_error(job: Job, status: dict, stopped_by_sweep: bool, timeout: int | None) -> str | None:
    """None when the job completed (or saved and stopped when the sweep was stopped); else one
    line. A job that exits 0 without status.json (an app that is not train.py) completed."""
    stopped, returncode = how_it_stopped(job, status), job.process.returncode
    if job.timed_out:
        return f"timed out after {timeout} s (hydra.launcher.timeout): {stopped or f'exit code {returncode}'}"
    if status.get("status") == "stopped":
        return None if stopped_by_sweep else f"{stopped}: {status.get('signal', 'a signal')} from outside the sweep"
    if returncode == 0 and status.get("status") in (None, "completed"):
        return None
    if job.stopping_since is not None and stopped:
        return stopped
    # train.py records the error of a job that failed after starting; else the log's last word.
    return status.get("error") or last_error_line(job.run_dir / "job.log", returncode)


def read_objective(run_dir: Path, key: str) -> tuple[float | None, str | None]:
    """(the run's value for `key`, None) or (None, the error): its figure where lmrepo.observability.figures
    defines one (tokens_per_s: the steady figure the tables show), else the last value logged."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None, None  # an app that logs no metrics: a completed job without a value
    metrics = read_metrics(path)  # a torn last line skipped
    value = objective_value(metrics, key)
    if value is None:
        keys = sorted({k for record in metrics for k in record})
        return None, f"launcher.objective={key}: metrics.jsonl has no value for it (it logs {', '.join(keys)})"
    return value, None


def last_error_line(log_file: Path, returncode: int) -> str:
    lines = log_file.read_text(errors="replace").splitlines() if log_file.exists() else []
    errors = [line for line in lines if line.startswith("lmrepo: error:")]
    if errors:
        return errors[-1].removeprefix("lmrepo: error: ")
    tail = [line for line in lines if line.strip() and "HYDRA_FULL_ERROR" not in line][-1:] or [""]
    return f"exit code {returncode}: {tail[0][-300:]}"


def read_status(run_dir: Path) -> dict:
    path = run_dir / "status.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        return {}


def record_failure(job: Job) -> None:
    """train.py writes its own status.json when it fails after starting; a job refused before it
    started (bad combination), killed, or timed out gets its error here (and its overrides, for
    scripts/compare.py), so the sweep keeps it. A timed-out job's `stopped` record stays."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    status = read_status(job.run_dir)
    if status.get("status") not in ("failed", "stopped"):
        status = {"status": "failed"}
    status.setdefault("error", job.error)
    status.setdefault("overrides", job.overrides)
    (job.run_dir / "status.json").write_text(json.dumps(status, indent=2))


def print_summary(jobs: list[Job]) -> None:
    """One line per job, its figures computed and written as scripts/compare.py's table does
    (lmrepo.compare, lmrepo.observability.figures), then what differs between the jobs that the sweep did not
    vary, then the best job."""
    runs = []
    for job in jobs:
        run = compare.load_run(job.run_dir, str(job.num))
        run.name = job.name
        runs.append(run)
    figures = ["final loss", "eval loss", compare.TOKENS, "wall s"]
    rows = []
    for job, run in zip(jobs, runs):
        row = compare.summarize(run)
        status = run.status.get("status")
        state = (
            status if status != "unknown" else "failed" if job.error else "completed" if job.started else "not started"
        )
        rows.append(
            (
                f"#{job.num}",
                job.name,
                state,
                "-" if job.value is None else f"{job.value:.4g}",
                *(compare.cell(row, column) for column in figures),
                (job.error or "")[:100],
            )
        )
    header = ("job", "overrides", "status", "objective", *figures, "error")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), flush=True)
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip(), flush=True)
    for line in compare.unswept_differences(runs):
        print(f"not like for like: {line}", flush=True)
    best = best_job(jobs)
    if best is not None:
        print(
            f"best: #{best.num} {best.name} ({best.objective} {best.value:.6g}, "
            f"{OmegaConf.select(best.cfg, 'launcher.objective_mode', default='min')})",
            flush=True,
        )


def best_job(jobs: list[Job]) -> Job | None:
    """The job with the best objective, by launcher.objective_mode (min unless max)."""
    scored = [job for job in jobs if job.value is not None]
    if not scored:
        return None
    maximize = str(OmegaConf.select(scored[0].cfg, "launcher.objective_mode", default="min")) == "max"
    return (max if maximize else min)(scored, key=lambda job: job.value)
