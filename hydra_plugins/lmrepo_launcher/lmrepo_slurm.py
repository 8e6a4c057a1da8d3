"""`hydra/launcher=slurm`: hydra-submitit-launcher's SlurmLauncher (one Slurm job per sweep job,
launcher.ranks tasks on each of launcher.nodes nodes, submitted with sbatch through submitit), with
what lmrepo's local launcher gives a sweep:

- the W&B group of the sweep and its directory in every job's environment (sbatch passes the
  submitting shell's environment on);
- a line per change of a job's Slurm state (PENDING, RUNNING, REQUEUED, ...), not a warning per poll;
  the states come from sacct, or from squeue where the cluster keeps no accounting (submitit asks
  only sacct, and without accounting it never sees a job end that wrote no result: a job killed
  with its node kept the sweep waiting forever);
- a failed job is its line in the summary table at the end and exit status 1, as for local
  sweeps, not the first failure's traceback.

A job's own lifecycle (the time limit's signal, the checkpoint, the requeue and the resume) is
train.py's and submitit's: see lmrepo.train.stop and lmrepo.run.prepare_job.
"""

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides, setup_globals
from omegaconf import OmegaConf

from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from hydra_plugins.lmrepo_launcher.lmrepo_launcher import (
    Job,
    SweepEnd,
    compose_job,
    job_return,
    last_error_line,
    read_objective,
    read_status,
    record_failure,
    sweep_group,
)

if TYPE_CHECKING:
    from submitit.slurm.slurm import SlurmJob

log = logging.getLogger(__name__)

POLL_S = 2.0  # how often the sweep looks at its jobs' result files; Slurm itself is asked less often
# How long after a job's train.py wrote its status.json (completed, stopped, failed) the sweep asks
# Slurm at every poll: its tasks end within seconds of that write. Otherwise submitit asks at 2, 4,
# 8, ... s after the submission and then every 10 minutes, so a sweep learnt of an hour-long job's
# end up to 10 minutes late (its next batch waited as long).
ENDING_S = 60.0


class LmrepoSlurmLauncher(SlurmLauncher):
    reports_failures = True  # the summary and the exit status at the sweep's end (SweepEnd)

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.jobs: list[Job] = []

    def setup(self, *, hydra_context, task_function, config) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        hydra_context.callbacks.callbacks.insert(0, SweepEnd(self))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from lmrepo.distributed.slurm import watch_states

        setup_globals()
        watch_states()
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        os.environ.update(LMREPO_SWEEP_GROUP=sweep_group(self.config, sweep_dir), LMREPO_SWEEP_DIR=str(sweep_dir))
        fixed = set(OmegaConf.to_container(self.config.hydra.overrides.task, resolve=False))
        jobs = [compose_job(self, initial_job_idx + i, list(o), sweep_dir, fixed) for i, o in enumerate(job_overrides)]
        log.info(f"lmrepo: {len(jobs)} Slurm job(s) in {sweep_dir}")
        submitted = self._submit([job for job in jobs if job.error is None])
        self._wait(submitted)
        for job in jobs:
            if job.error is not None:
                record_failure(job)
        self.jobs += jobs
        return [job_return(job) for job in jobs]

    def _submit(self, jobs: list[Job]) -> list[tuple[Job, "SlurmJob"]]:
        """One Slurm array job, as hydra-submitit-launcher submits: every job runs this launcher's
        __call__ (the app in RUN mode with its overrides) in each of its tasks."""
        if not jobs:
            return []
        executor = self._executor()
        for job in jobs:
            log.info(f"\t#{job.num} : {' '.join(filter_overrides(job.overrides))}")
        arguments = [
            (job.overrides, "hydra.sweep.dir", job.num, f"job_id_for_{job.num}", Singleton.get_state()) for job in jobs
        ]
        submitted = executor.map_array(self, *zip(*arguments))
        for job, slurm_job in zip(jobs, submitted):
            job.started = time.time()
            log.info(f"lmrepo: job #{job.num} ({job.name}) is Slurm job {slurm_job.job_id}")
        return list(zip(jobs, submitted))

    def _executor(self):
        """submitit's executor with this launcher's parameters, as hydra-submitit-launcher builds it."""
        import submitit

        init_keys = {"max_num_timeout", "submitit_folder"}
        executor = submitit.AutoExecutor(
            cluster="slurm",
            folder=self.params["submitit_folder"],
            slurm_max_num_timeout=self.params["max_num_timeout"],
        )
        queue_keys = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in queue_keys else f"slurm_{k}": v for k, v in self.params.items() if k not in init_keys}
        )
        return executor

    def _wait(self, submitted: list[tuple[Job, "SlurmJob"]]) -> None:
        """Until every job ended: a line when a job's Slurm state changes, then how it ended."""
        states: dict[str, str] = {}
        running = list(submitted)
        while running:
            for job, slurm_job in list(running):
                mode = "force" if ending(job) else "standard"
                state = slurm_job.watcher.get_state(slurm_job.job_id, mode=mode)
                if state != states.get(slurm_job.job_id, "UNKNOWN"):
                    states[slurm_job.job_id] = state
                    where = slurm_job.watcher.get_info(slurm_job.job_id, mode="cache").get("NodeList", "")
                    log.info(f"lmrepo: job #{job.num} (Slurm {slurm_job.job_id}): {state} {where}".rstrip())
                if over(slurm_job):
                    running.remove((job, slurm_job))
                    conclude(job, slurm_job)
            if running:
                time.sleep(POLL_S)


# Slurm's states of a job that will run (again): queued, requeued, held, running or ending its tasks
WILL_RUN = {
    "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RUNNING", "RESIZING",
    "SUSPENDED", "SIGNALING", "COMPLETING", "STAGE_OUT",
}  # fmt: skip


def over(slurm_job: "SlurmJob") -> bool:
    """submitit's end of a job (a result file, or a final state) that Slurm agrees with. A result
    file is an attempt's end, not always the job's: an attempt can end as a success while Slurm
    requeues its job (submitit's requeue at the time limit ends the step with SIGTERM, and the
    requeue's own `scontrol` may die of it), and the next attempt runs from its checkpoint. The
    sweep had reported such a job stopped and exited, leaving it to train unwatched. Asked of Slurm
    only once the file is there; a state Slurm no longer knows (UNKNOWN) leaves the file's word."""
    if not slurm_job.done():
        return False
    return slurm_job.watcher.get_state(slurm_job.job_id, mode="force").upper() not in WILL_RUN


def ending(job: Job) -> bool:
    """train.py wrote the job's status.json within ENDING_S, since the sweep submitted it."""
    try:
        written = (job.run_dir / "status.json").stat().st_mtime
    except OSError:
        return False
    return job.started <= written and time.time() - written < ENDING_S


def conclude(job: Job, slurm_job: "SlurmJob") -> None:
    """How a job ended: completed (its objective read), stopped with a checkpoint by a signal from
    outside the sweep (scancel, a pre-emption that was not requeued), or failed: train.py's own
    error (status.json), else the last `lmrepo: error:` line of its tasks' logs, else Slurm's state."""
    status = read_status(job.run_dir)
    ended = status.get("status")
    if ended not in ("failed", "stopped"):  # train.py's own verdict needs no result file from submitit
        try:
            slurm_job.results()  # waits up to 15 s for a result file a job that died never writes
        except Exception:  # submitit's UncompletedJobError and a task's exception, with Slurm's state in it
            ended = "failed"
    if ended == "stopped":
        job.error = (
            f"stopped at step {status.get('final', {}).get('step', 0)} by {status.get('signal', 'a signal')} "
            f"from outside the sweep (scancel, a pre-emption); continue it with run.dir={job.run_dir} run.resume=auto"
        )
    elif ended == "failed":
        job.error = status.get("error") or task_error(slurm_job)
        record_failure(job)
    elif job.objective is not None:
        job.value, job.error = read_objective(job.run_dir, job.objective)
    if job.error is not None:
        log.error(f"lmrepo: job #{job.num} ({job.name}): {job.error}")


def task_error(slurm_job: "SlurmJob") -> str:
    """The first task log with an `lmrepo: error:` line gives it; else Slurm's final state."""
    for task in range(slurm_job.num_tasks):
        line = last_error_line(slurm_job.task(task).paths.stderr, 1)
        if not line.startswith("exit code"):
            return line
    state = slurm_job.watcher.get_state(slurm_job.job_id, mode="cache")
    return f"Slurm job {slurm_job.job_id} ended {state} (its tasks' logs: {slurm_job.paths.folder})"
