"""Hydra's own launcher tests (hydra.test_utils.launcher_common_tests, shipped with hydra-core;
its pytest plugin provides the fixtures) against hydra/launcher=lmrepo.

IntegrationTestSuite runs generated apps as a user would (`python task.py -m ...`, no
`launcher:` key, no metrics.jsonl), so the launcher re-runs each job in its own process: job
names from the command line and the config, hydra.job.chdir, run directories from the config,
the command line and `${hydra.job.override_dirname}` (`a=1,b=2`), the original cwd.

LauncherTestSuite and BatchedSweeperTestSuite are not run: they call an in-memory task function
inside the test process (Hydra's `a_module` with pytest as sys.argv[0]), which a launcher that
starts a process per job cannot re-run (docs/sweeps.md).
"""

from hydra.test_utils.launcher_common_tests import IntegrationTestSuite
from pytest import mark


@mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [({}, ["-m", "hydra/launcher=lmrepo", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled"])],
)
class TestLmrepoLauncherIntegration(IntegrationTestSuite):
    pass
