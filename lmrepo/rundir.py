"""The run directory contract (DESIGN.md): .hydra/ config, ds_config.json, metrics.jsonl, checkpoints/."""
import json
import time
from pathlib import Path
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from lmrepo.errors import exit_error


def write_config_files(run_dir: Path, config: dict, ds_config: dict) -> None:
    """Rank 0, after validation: so a rejected config leaves nothing behind. `config` is the
    loaded config with its autos resolved (precision, warmup): what the run really used."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), hydra_dir / "config.yaml")
    if HydraConfig.initialized():
        hydra = HydraConfig.get()
        OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(hydra, resolve=False)}), hydra_dir / "hydra.yaml")
        OmegaConf.save(OmegaConf.create(list(hydra.overrides.task)), hydra_dir / "overrides.yaml")
    (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drops metrics.jsonl lines past `step`: a resumed run logs those steps again."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def write_status(run_dir: Path, status: str, started: float, **details) -> None:
    """status.json: how the job ended (completed / failed with its error), for sweeps and compare.py."""
    record = {"status": status, "wall_s": time.time() - started, **details}
    (run_dir / "status.json").write_text(json.dumps(record, indent=2))


def refuse(message: str, run_dir: Path | None, code: int = 2) -> NoReturn:
    """A job that cannot run: one `lmrepo: error:` line, and the empty directory Hydra made for it gone."""
    if run_dir is not None:
        remove_if_empty(run_dir)
    exit_error(message, code)


def remove_if_empty(run_dir: Path) -> None:
    """Undo the empty directory Hydra makes before the job runs, and its empty parents."""
    run_dir = run_dir.resolve()
    for directory in (run_dir, *run_dir.parents):
        if directory == Path.cwd() or directory == Path(directory.anchor):
            return
        try:
            directory.rmdir()
        except OSError:
            return
