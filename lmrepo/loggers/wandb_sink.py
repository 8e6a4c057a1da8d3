"""Weights & Biases: online when a key and the server are there, offline files otherwise, never a hang."""
import netrc
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import wandb


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def server_reachable(timeout: float = 3.0) -> bool:
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
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


class WandbSink:
    def __init__(self, logger, run_dir: Path, config: dict, ds_config: dict):
        self.mode = resolve_mode(logger.mode)
        self.run = wandb.init(
            project=logger.project, entity=logger.entity, group=logger.group, tags=list(logger.tags),
            name=run_dir.name, dir=str(run_dir), mode=self.mode,
            config={**config, "ds_config": ds_config},
            settings=wandb.Settings(init_timeout=60, console="off", silent=True))

    def log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def finish(self) -> None:
        self.run.finish()
