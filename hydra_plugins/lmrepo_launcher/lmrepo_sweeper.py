"""`hydra/sweeper=lmrepo` (train.py's default, through `hparams_search=none`): Hydra's
BasicSweeper (the grid of the command line's and hydra.sweeper.params' values, in batches of
hydra.sweeper.max_batch_size) that runs every batch. BasicSweeper stops at the first batch with
a failed job; a sweep of training jobs goes on (a refused combination or an OOM says nothing
about the next job), and the lmrepo launcher reports the failures at the end, in its summary
and exit status.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf


@dataclass
class LmrepoSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.lmrepo_launcher.lmrepo_sweeper.LmrepoSweeper"


ConfigStore.instance().store(group="hydra/sweeper", name="lmrepo", node=LmrepoSweeperConf, provider="lmrepo")


class LmrepoSweeper(BasicSweeper):
    def sweep(self, arguments: list[str]) -> Any:
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        self.overrides = self.split_arguments(overrides, self.max_batch_size)
        # Every job composes before any starts: a bad value in the last batch stops the sweep
        # now, not after hours of the batches before it.
        self.validate_batch_is_legal([job for batch in self.overrides for job in batch])

        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns, initial_job_idx = [], 0
        while not self.is_done():
            batch = self.get_job_batch()
            returns.append(self.launcher.launch(batch, initial_job_idx=initial_job_idx))
            initial_job_idx += len(batch)
        if not getattr(self.launcher, "reports_failures", False):
            # A launcher that reports no failures itself (hydra/launcher=submitit_local): as BasicSweeper
            # does, the first failed job's error ends the command, now after every batch ran.
            for ret in (ret for batch in returns for ret in batch):
                _ = ret.return_value
        return returns
