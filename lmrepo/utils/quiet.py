"""A quiet start: what a person sees is lmrepo's own lines, the progress bar and real warnings.
Library notices that ask nothing of the user are dropped at their loggers (`hydra.verbose=true`
keeps them all); everything else, warnings included, passes.
"""

import contextlib
import io
import logging
import re
import sys
import warnings

# logger name -> messages that are noise on every start
NOISE = {
    "DeepSpeed": (
        # DeepSpeed's accelerator probe on a machine without a GPU, in every process
        r"^Setting accelerator to CPU",
        # lmrepo reads the rate of the first step before the scheduler's first step
        r"^Attempting to get learning rate from scheduler before it has started",
    ),
    # submitit's status poll on a cluster without job accounting (sacct), at every poll of a
    # Slurm sweep: it falls back to squeue's states, nothing is lost
    "submitit": (r"Bypassing sacct error",),
}
# Printed (not logged) by DeepSpeed each time it loads its CPU all-reduce op.
NOISE_PRINTS = (r"^DeepSpeed \S+ built successfully$",)
# Python warnings raised inside DeepSpeed about its own use of torch APIs, and inside Optuna
# about the arguments and distributions hydra-optuna-sweeper 1.3 gives it (hparams_search):
# nothing for the user to change.
OPTUNA_SWEEPER_DEPRECATIONS = (
    r"^(`(consider_prior|prior_weight|consider_magic_clip|consider_endpoints|"
    r"warn_independent_sampling)`|\w*UniformDistribution) has been deprecated"
)
NOISE_WARNINGS = (r"`torch\.distributed\.\w+` is deprecated", OPTUNA_SWEEPER_DEPRECATIONS)


class DropNoise(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p.search(record.getMessage()) for p in self.patterns)


_filters: dict[str, DropNoise] = {}


def install() -> None:
    """Before DeepSpeed is imported (its accelerator probe logs at import)."""
    for name, patterns in NOISE.items():
        if name not in _filters:
            _filters[name] = DropNoise(patterns)
            logging.getLogger(name).addFilter(_filters[name])
    for pattern in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)


def uninstall() -> None:
    """hydra.verbose: every library line again."""
    for name, noise in _filters.items():
        logging.getLogger(name).removeFilter(noise)
    _filters.clear()
    warnings.resetwarnings()


@contextlib.contextmanager
def quiet_prints():
    """Drops the known noise lines a library prints to stdout inside the block, passes the rest."""
    if not _filters:  # verbose
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        kept = [
            line
            for line in captured.getvalue().splitlines(keepends=True)
            if not any(re.search(p, line.rstrip("\n")) for p in NOISE_PRINTS)
        ]
        sys.stdout.write("".join(kept))
        sys.stdout.flush()
