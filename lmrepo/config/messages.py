"""Hydra's and OmegaConf's errors about a config, as one line that names the key to change."""

import os
from contextlib import contextmanager
from dataclasses import fields, is_dataclass

from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from lmrepo.utils.errors import disk_error, exit_error

# Keys that moved to a component of their own (lmrepo 0.2): a user's old command is told where.
MOVED = {
    old: f"{old} has moved: set {new}"
    for old, new in {
        "trainer.lr": "optimizer.lr",
        "trainer.betas": "optimizer.betas",
        "trainer.eps": "optimizer.eps",
        "trainer.weight_decay": "optimizer.weight_decay",
        "trainer.warmup_steps": "schedule.warmup_steps",
        "trainer.min_lr_ratio": "schedule.min_lr_ratio",
        "trainer.lr_decay": "schedule=cosine|linear|constant",
    }.items()
}
MOVED["pipeline.engine"] = (
    "pipeline.engine is gone: the engine follows from pipeline.schedule (pipeline=1f1b is "
    "DeepSpeed's; gpipe, 1f1b_torch and interleaved are torch.distributed.pipelining)"
)


def more_ranks(ranks: int) -> str:
    """How to start `ranks` ranks, for a message about the rank count: the launchers a user types."""
    return (
        f"start {ranks} ranks: torchrun --nproc-per-node {ranks} train.py ..., deepspeed --num_gpus {ranks} "
        f"train.py ..., or in a sweep python train.py -m launcher.ranks={ranks} ..."
    )


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def describe_omegaconf_error(err: OmegaConfBaseException, override: str | None = None) -> str:
    """`override` is the command-line override being merged, when Hydra says which."""
    key = getattr(err, "full_key", None) or ""
    # Inside a list (data.sources) OmegaConf names the key relative to its entry: keep the override too.
    where = f"{override}: " if override and override.partition("=")[0] != key else ""
    if isinstance(err, MissingMandatoryValue):
        return f"{where}{key} must be set (e.g. on the command line: {key}=...)"
    if isinstance(err, (ConfigAttributeError, ConfigKeyError)) and "not in" in str(err):
        if key in MOVED:
            return MOVED[key]
        return where + unknown_key(key, getattr(err, "object_type", None))
    reason = _first_line(getattr(err, "msg", None) or err)
    return f"{where}{key}: {reason}" if where else f"{override or key}: {reason}"


def unknown_key(key: str, owner) -> str:
    from lmrepo.config.data import DataConfig, SourceConfig

    name = key.rpartition(".")[2]
    if not is_dataclass(owner):
        return f"{key} is not a key of the config: check its spelling (python train.py --help lists every key)"
    known = [f.name for f in fields(owner)]
    if owner is SourceConfig and name in {f.name for f in fields(DataConfig)}:
        return f"{name} is not a key of a mixture source: set data.{name}, every source shares it"
    parent = key.rpartition(".")[0]
    return f"{key} is not a key of {parent or 'the config'} (its keys: {', '.join(known)})"


def describe_hydra_error(err: Exception) -> str | None:
    """One line for an error Hydra raised while composing the config, or None when it is not one."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    if isinstance(err, MissingConfigException):
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        if group and err.options:
            return f"{group}={option}: no such option; choose one of {', '.join(err.options)}"
        return _first_line(err)
    if isinstance(err, OverrideParseException):
        return f"cannot parse the override {err.override!r}: {_first_line(err.message)}"
    if isinstance(err, ConfigCompositionException):
        cause = err.__cause__
        message = _first_line(err)
        override = (
            message.removeprefix("Error merging override ").strip() if message.startswith("Error merging") else None
        )
        if isinstance(cause, OmegaConfBaseException):
            return describe_omegaconf_error(cause, override)
        # A YAML file's own value ("In 'pipeline/1f1b': ValidationError raised while composing
        # config:", the reason, then "full_key: ..."): name the file, the key and the reason.
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        key = next((line.removeprefix("full_key:").strip() for line in lines if line.startswith("full_key:")), None)
        where = message.split("'")[1] if message.startswith("In '") else None
        if key and where and len(lines) > 1:
            return f"{key} in conf/{where}.yaml: {lines[1]}"
        return message
    return None


# Set beside HYDRA_FULL_ERROR when lmrepo, not the user, set it: a sweep's jobs inherit both, and
# a job must not take its parent's setting for the user's wish for tracebacks.
SET_BY_LMREPO = "LMREPO_SET_HYDRA_FULL_ERROR"


def user_wants_traceback() -> bool:
    return bool(os.environ.get("HYDRA_FULL_ERROR")) and not os.environ.get(SET_BY_LMREPO)


@contextmanager
def one_line_config_errors():
    """Hydra prints its composition errors over several lines and exits 1; a wrong override is
    a user's mistake like any other: one `lmrepo: error:` line, exit 2. HYDRA_FULL_ERROR makes
    Hydra raise instead of printing, so the error can be read here (a user who set it keeps
    Hydra's full traceback)."""
    traceback_wanted = user_wants_traceback()
    if not traceback_wanted:
        os.environ.update({"HYDRA_FULL_ERROR": "1", SET_BY_LMREPO: "1"})
    try:
        yield
    except Exception as err:
        if traceback_wanted:
            raise
        line = describe_hydra_error(err) or describe_slurm_error(err)
        if line is not None:
            exit_error(line)
        if (reason := disk_error(err)) is not None:
            # Hydra creating the run directory it was given
            exit_error(f"{reason}: choose a writable run directory with room (hydra.run.dir=...)", every_rank=True)
        raise


def describe_slurm_error(err: Exception) -> str | None:
    """hydra/launcher=slurm's submission refused (submitit's FailedJobError carries sbatch's own
    words: a partition that does not exist, a request the partition cannot meet) or impossible (no
    Slurm here), as one line; None for anything else."""
    words = str(err).strip()
    if type(err).__name__ == "FailedJobError" and words.startswith("sbatch: error:"):
        said = words.splitlines()[0].removeprefix("sbatch: error:").strip()
        return (
            f"Slurm refused the job: {said}: check hydra.launcher.partition and what it asks of a node "
            "(launcher.ranks, launcher.nodes, hydra.launcher.cpus_per_task, hydra.launcher.mem_gb)"
        )
    if isinstance(err, RuntimeError) and 'Could not detect "srun"' in words:
        return (
            "hydra/launcher=slurm submits with Slurm's sbatch and srun, which this machine does not have: run the "
            "sweep on a login node of the cluster, or drop hydra/launcher=slurm to run the jobs here"
        )
    return None


@contextmanager
def one_line_disk_errors():
    """The run writing into its directory meets a full disk or a permission: one line, exit 2,
    from inside Hydra's job (its own report of a failed job would come first, as a second line).
    One rank can meet it alone (its own disk), so that rank says it."""
    try:
        yield
    except Exception as err:
        if not user_wants_traceback() and (reason := disk_error(err)) is not None:
            exit_error(f"{reason}: choose a writable run directory with room (run.dir=...)", every_rank=True)
        raise
