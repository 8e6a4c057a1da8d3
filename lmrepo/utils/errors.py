"""The exception types for what the user must change, and the one way such a mistake ends a command."""

import os
import sys
import time
from typing import NoReturn


class ConfigError(Exception):
    """A configuration or input the user must change; the message names what to change."""


class TrainingError(Exception):
    """A run that cannot go on (a non-finite loss, ...); the message says what to change."""


def require(condition: bool, message: str) -> None:
    """Every rule of the config reads as one line: require(rule, what to change)."""
    if not condition:
        raise ConfigError(message)


# How long the other ranks give rank 0 to say a verdict they all reached (see exit_error).
RANK0_GRACE_S = 5.0


def exit_error(message: str, code: int = 2, every_rank: bool = False) -> NoReturn:
    """One `lmrepo: error:` line on stderr (rank 0 only: every rank reaches the same verdict), then
    exit. `every_rank`: a verdict one rank may reach alone (its own disk), said by that rank.
    The other ranks wait a little first: DeepSpeed's launcher and torchrun end every rank once one
    exits, and a rank 0 a second behind (two jobs on two cores) was ended before it said why.
    Rank 0's exit ends their wait."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or every_rank:
        print(f"lmrepo: error: {f'rank {rank}: ' if rank else ''}{message}", file=sys.stderr, flush=True)
    else:
        time.sleep(RANK0_GRACE_S)
    raise SystemExit(code)


def disk_error(err: BaseException | None) -> str | None:
    """What went wrong with a file ("no space left on device", "permission denied", ...), from
    the OSError in an exception chain (libraries wrap their workers' errors), or None."""
    seen = set()
    while err is not None and id(err) not in seen and not (isinstance(err, OSError) and err.strerror):
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    if err is None or id(err) in seen:
        return None
    return err.strerror.lower() + (f" ({err.filename})" if err.filename else "")
