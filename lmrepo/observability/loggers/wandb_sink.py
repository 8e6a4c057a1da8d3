"""Weights & Biases: online when a key and the server are there, offline files otherwise, never a hang."""

import netrc
import os
import secrets
import socket
from pathlib import Path
from urllib.parse import urlparse

import wandb

from lmrepo.observability.loggers import scalars


def server_url() -> str:
    """W&B's own default (it has changed between releases), or WANDB_BASE_URL."""
    return os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(server_url()).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def server_reachable(timeout: float = 3.0) -> bool:
    url = urlparse(server_url())
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_mode(requested: str) -> str:
    """WANDB_MODE wins; `auto` is online only with an API key and a reachable server."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if requested != "auto":
        return requested
    return "online" if has_api_key() and server_reachable() else "offline"


def technique_tags(config: dict) -> list[str]:
    """One tag per technique choice, so W&B can filter and group by them."""
    tags = [
        config["model"]["name"],
        f"zero{config['zero']['stage']}",
        config["precision"]["dtype"],
        f"offload-{config['offload']['target']}",
        f"pipeline-{config['pipeline']['schedule']}",
    ]
    if config["checkpointing"]["enabled"]:
        tags.append(f"act-ckpt-every{config['checkpointing']['every_n_layers']}")
    return tags


def run_id(run_dir: Path) -> str:
    """The same W&B run across resumes of one run directory."""
    path = run_dir / "wandb_run_id"
    if not path.exists():
        path.write_text(secrets.token_hex(4))
    return path.read_text().strip()


class WandbSink:
    """One W&B run per job. In a sweep the lmrepo launcher sets LMREPO_SWEEP_GROUP (the group:
    the sweep, or a search's study) and LMREPO_JOB_NAME (the job's own choices, the run's name);
    the run's summary gets `objective`, the value the launcher returns to the sweeper."""

    def __init__(self, logger, run_dir: Path, config: dict, ds_config: dict):
        self.objective_key, self.objective = config["launcher"]["objective"], None
        self.mode = resolve_mode(logger.mode)
        self.run = wandb.init(
            project=logger.project,
            entity=logger.entity,
            group=logger.group or os.environ.get("LMREPO_SWEEP_GROUP"),
            name=os.environ.get("LMREPO_JOB_NAME") or run_dir.name,
            tags=[*logger.tags, *technique_tags(config)],
            id=run_id(run_dir),
            resume="allow",
            dir=str(run_dir),
            mode=self.mode,
            config={**config, "ds_config": ds_config},
            settings=wandb.Settings(init_timeout=60, console="off", silent=True),
        )

    def log(self, record: dict) -> None:
        if isinstance(record.get(self.objective_key), (int, float)):
            self.objective = record[self.objective_key]
        self.run.log(
            {k: v for k, v in scalars(record).items() if k not in ("step", "time") and v is not None},
            step=record["step"],
        )

    def summarize(self, figures: dict) -> None:
        """W&B's run summary keeps each key's last logged value: the last logging window's tokens/s,
        not the run's. The figures compare.py and the sweep's summary show replace them, so W&B's
        runs table ranks the runs as they do (lmrepo.observability.figures)."""
        for key, value in figures.items():
            if isinstance(value, (int, float)) and key != "step":
                self.run.summary[key] = value
        if isinstance(figures.get(self.objective_key), (int, float)):
            self.objective = figures[self.objective_key]  # as the launcher returns it (lmrepo.observability.figures)

    def finish(self) -> None:
        if self.objective is not None:
            # launcher.objective's last value, as the launcher reads it from metrics.jsonl: W&B
            # sorts and compares a study's trials by one summary key whatever the objective is.
            self.run.summary["objective"] = self.objective
        self.run.finish()
