"""Loading a checkpoint never runs code.

Every file is read with torch's weights-only unpickler: tensors, plain containers, numbers and
strings, plus the few DeepSpeed classes its optimizer files hold (allow-listed below). DeepSpeed
itself calls torch.load(weights_only=False) everywhere (engine.load_checkpoint, zero_to_fp32,
ds_to_universal); TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 makes torch ignore that argument, so those
loads are weights-only too while `weights_only_loads()` is active. A file whose pickle would
call anything else is refused with one line.

    python -m lmrepo.utils.safe_load deepspeed.checkpoint.ds_to_universal --input_folder ...  # weights-only
"""

import contextlib
import os
import pickle
import runpy
import sys
from pathlib import Path

import torch

from lmrepo.utils.errors import ConfigError


def deepspeed_globals() -> list:
    """The classes DeepSpeed 0.19 pickles into its optimizer files (ZeRO 1-3, bf16, fp16, universal)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def refusal(path, err: Exception) -> ConfigError:
    reason = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), str(err).splitlines()[0][:200])
    return ConfigError(
        f"{path} holds more than weights ({reason}): lmrepo loads weights only, so it was not written "
        "by lmrepo or DeepSpeed, or was tampered with; resume from another checkpoint"
    )


def load(path: Path, map_location="cpu", extra_globals: tuple = ()):
    """torch.load with the weights-only unpickler; a pickle that would run code is one ConfigError."""
    try:
        with torch.serialization.safe_globals([*deepspeed_globals(), *extra_globals]):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise refusal(path, err) from None


@contextlib.contextmanager
def weights_only_loads(where: Path):
    """DeepSpeed's own torch.load calls inside the block are weights-only, with its classes allowed;
    `where` (the checkpoint being read) names the culprit of a refusal."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(deepspeed_globals()):
            yield
    except pickle.UnpicklingError as err:
        raise refusal(f"a file of {where}", err) from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


if __name__ == "__main__":
    # A DeepSpeed command-line tool (module name, then its own arguments), its loads weights-only.
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"  # inherited by the tool's worker processes
    torch.serialization.add_safe_globals(deepspeed_globals())
    runpy.run_module(module, run_name="__main__", alter_sys=True)
