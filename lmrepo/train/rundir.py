"""The run directory contract (docs/run-directory.md): .hydra/ config,
ds_config.json, metrics.jsonl, status.json, checkpoints/; one run owns it at a time."""

import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from filelock import FileLock, Timeout
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lmrepo.plan.user_config import redact
from lmrepo.utils.errors import ConfigError, exit_error

LOCK = ".lmrepo.lock"
CREATED = "LMREPO_CREATED_DIRS"  # the directories Hydra creates for this run: the only ones a refusal removes


class RecordCreatedDirs(Callback):
    """Before Hydra makes the run directory (and any missing parents), note which do not exist
    yet: a refused job removes those, never a directory the user had."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        run_dir = Path(str(config.hydra.run.dir)).resolve()
        missing = [str(d) for d in (run_dir, *run_dir.parents) if not d.exists()]
        os.environ[CREATED] = json.dumps(missing)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Atomic and on disk: a temporary file, synced, renamed over the old one, the directory synced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def own(run_dir: Path) -> FileLock:
    """The run's lock on its directory, held until the process ends (the OS releases it on any
    death, kill -9 included): a second run into the same directory is refused."""
    lock = FileLock(str(run_dir / LOCK), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError(
            f"run.dir={run_dir} is in use by another run right now: wait for it to end, or choose another run.dir"
        ) from None
    return lock


def check_unused(run_dir: Path, resuming: bool, owner: bool) -> None:
    """A fresh run never writes into another run's files, and no run into a live one's. Only
    the owner (rank 0) probes the lock: the other ranks would find their own rank 0 holding it."""
    if owner and (run_dir / LOCK).exists():  # a run was here: is it still running?
        own(run_dir).release()
    previous = [name for name in ("metrics.jsonl", "checkpoints") if (run_dir / name).exists()]
    if previous and not resuming:
        raise ConfigError(
            f"run.dir={run_dir} already holds a run ({', '.join(previous)}): continue it with "
            "run.resume=auto, or choose another run.dir"
        )


def write_config_files(run_dir: Path, config: dict, ds_config: dict) -> None:
    """Rank 0, after validation: so a rejected config leaves nothing behind. `config` is the
    loaded config with its autos resolved (precision, warmup): what the run really used."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), hydra_dir / "config.yaml")
    if HydraConfig.initialized():
        hydra = HydraConfig.get()
        OmegaConf.save(
            OmegaConf.create({"hydra": OmegaConf.to_container(hydra, resolve=False)}), hydra_dir / "hydra.yaml"
        )
        OmegaConf.save(OmegaConf.create(list(hydra.overrides.task)), hydra_dir / "overrides.yaml")
    (run_dir / "ds_config.json").write_text(json.dumps(redact(ds_config), indent=2))


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drops metrics.jsonl lines past `step`: a resumed run logs those steps again. A torn line
    (a run killed while writing it) is dropped too."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        write_durably(
            path,
            "".join(
                line + "\n"
                for line in path.read_text(errors="replace").splitlines()
                if (record := parse(line)) is not None and record.get("step", 0) <= step
            ),
        )


def parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def write_status(run_dir: Path, status: str, started: float, **details) -> None:
    """status.json: how the job ended (completed / failed with its error), for sweeps and compare.py.
    Best effort: on a full disk the job's own error line is what matters."""
    record = {"status": status, "wall_s": time.time() - started, **details}
    try:
        write_durably(run_dir / "status.json", json.dumps(record, indent=2))
    except OSError as err:
        print(
            f"lmrepo: warning: could not write {run_dir / 'status.json'}: {err.strerror}", file=sys.stderr, flush=True
        )


def refuse(message: str, run_dir: Path | None, code: int = 2) -> NoReturn:
    """A job that cannot run: one `lmrepo: error:` line, and the empty directory Hydra made for it gone."""
    if run_dir is not None:
        remove_if_empty(run_dir)
    exit_error(message, code)


def remove_if_empty(run_dir: Path) -> None:
    """Undo the empty directories Hydra made for this job (RecordCreatedDirs): the run directory
    and the parents it created, nothing that existed before. Without the record (the compose
    API), the run directory alone."""
    run_dir = run_dir.resolve()
    created = set(json.loads(os.environ.get(CREATED, "[]"))) or {str(run_dir)}
    for directory in (run_dir, *run_dir.parents):
        if str(directory) not in created:
            return
        try:
            directory.rmdir()
        except OSError:
            return
