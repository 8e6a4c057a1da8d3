"""The composed config outside a running train.py (scripts, tests): Hydra's compose API over conf/."""

import os

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lmrepo.config import TrainConfig, register
from lmrepo.config.messages import describe_hydra_error
from lmrepo.config.reference import CONF_DIR
from lmrepo.distributed.launch import register_resolvers
from lmrepo.plan.rules import load_checked
from lmrepo.utils.errors import ConfigError


def compose_config(overrides=(), run_dir: str | os.PathLike = "/nonexistent/lmrepo-run") -> DictConfig:
    """What train.py would see for these overrides. run.dir is pinned: it interpolates
    ${hydra:...}, which only a running Hydra app resolves."""
    register_resolvers()
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, f"run.dir={run_dir}"])


def compose_checked(overrides=(), run_dir: str | os.PathLike = "/nonexistent/lmrepo-run") -> DictConfig:
    """compose_config, with Hydra's composition errors (a wrong type, an unknown key or option)
    as the one-line ConfigError train.py prints."""
    try:
        return compose_config(overrides, run_dir)
    except Exception as err:
        line = describe_hydra_error(err)
        if line is None:
            raise
        raise ConfigError(line) from None


def load_config(overrides=(), run_dir: str | os.PathLike = "/nonexistent/lmrepo-run") -> TrainConfig:
    """compose_checked, then train.py's validation (lmrepo.plan.rules.load_checked): a script's bad
    argument is one ConfigError."""
    return load_checked(compose_checked(overrides, run_dir))
