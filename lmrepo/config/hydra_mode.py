"""Hydra's run-or-sweep probe, skipped where nothing on the command line can ask for a sweep.

`@hydra.main` composes the whole config twice in every process: once only to read `hydra.mode`
(a recipe may turn a plain command into a sweep: `experiment=zero_sweep` sets MULTIRUN), then for
the job. In lmrepo only the recipes of `experiment` and `hparams_search` set that key, so a command
line that names neither of them, nor `hydra.mode`, nor a `hydra/...` group, nor another primary
config has no mode in its config: Hydra's probe would answer None, and it is answered so without
composing. Every `train.py` process, each rank of every launch, composed its config once more
than it used (~0.1 CPU-s); the answer is Hydra's own wherever the probe could find a mode.
"""

import sys

from hydra._internal.hydra import Hydra

PRIMARY = "train"  # conf/train.yaml, the config train.py's @hydra.main names
# The overrides through which a mode can reach the composed config.
CAN_SET_MODE = ("experiment", "hparams_search", "hydra.mode", "hydra/")
# Command-line flags that change the primary config or where configs are searched for.
OTHER_CONFIGS = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")


def may_set_mode(config_name: str | None, overrides: list[str]) -> bool:
    """Whether composing `config_name` with `overrides` could set hydra.mode."""
    if config_name != PRIMARY or any(arg.split("=")[0] in OTHER_CONFIGS for arg in sys.argv[1:]):
        return True
    return any(word.lstrip("+~").startswith(CAN_SET_MODE) for word in overrides)


def skip_needless_mode_probe() -> None:
    """Installs the shortcut on Hydra's probe (once per process: train.py may be run again in it)."""
    probe = Hydra.get_mode
    if getattr(probe, "lmrepo_shortcut", False):
        return

    def get_mode(self, config_name, overrides):
        return probe(self, config_name, overrides) if may_set_mode(config_name, overrides) else None

    get_mode.lmrepo_shortcut = True
    Hydra.get_mode = get_mode
