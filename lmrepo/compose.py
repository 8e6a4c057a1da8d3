"""The composed config outside a running train.py (scripts, tests): Hydra's compose API over conf/."""
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lmrepo.launch import register_resolvers

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(overrides=(), run_dir: str | Path = "/nonexistent/lmrepo-run") -> DictConfig:
    """What train.py would see for these overrides. run.dir is pinned: it interpolates
    ${hydra:...}, which only a running Hydra app resolves."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, f"run.dir={run_dir}"])
