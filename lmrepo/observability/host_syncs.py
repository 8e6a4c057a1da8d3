"""Counting the places where the host waits for the device, per training step.

On a GPU a step is fast only while the host queues kernels ahead of the device; each read of a
value the device computed (`loss.item()`, `float(norm)`, `if torch.isinf(x).any():`) stops the
host until the device has caught up, and the queue runs dry. Two counters:

- `ValueReads` (any device): each read of a tensor's value into Python (`item`, `tolist`,
  `float()`, `int()`, `bool()`, `numpy()`, `.cpu()` of a device tensor), through a
  TorchFunctionMode. On a CPU nothing waits, but the same reads would wait on a GPU: the count says
  what a step would cost there. A compiled region under a new mode recompiles, so count after timing.
- `CudaSyncs` (CUDA): every synchronisation CUDA's runtime makes, reads inside C++ libraries
  included (`torch.cuda.set_sync_debug_mode("warn")` turns each into a warning, counted here).

Per step: read `count` at each step boundary (`lmrepo.train.loop.fit` calls `beat(step)` at each).
"""

import os
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode

READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
}


class ValueReads(TorchFunctionMode):
    """While active (`with ValueReads() as reads:` or `start()`), `reads.count` grows by one for each
    read of a tensor's value into Python."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS or (func is torch.Tensor.cpu and args and args[0].device.type != "cpu"):
            if not _from_torch_optimizer():
                self.count += 1
        return func(*args, **(kwargs or {}))

    def start(self) -> "ValueReads":
        self.__enter__()
        return self


def _from_torch_optimizer() -> bool:
    """torch's optimizers read their step counts, which they keep on the host (on a GPU too,
    unless fused or capturable): no wait for the device."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(("torch/overrides.py", "torch/_tensor.py")):
        frame = frame.f_back
    return frame is not None and f"torch{os.sep}optim{os.sep}" in frame.f_code.co_filename


class CudaSyncs:
    """While started, `count` is the number of times CUDA's runtime made the host wait for the
    device (torch's sync debug mode)."""

    def __init__(self):
        self.recorded: list = []
        self._catcher = None

    @property
    def count(self) -> int:
        return sum("synchronizing" in str(w.message).lower() for w in self.recorded)

    def start(self) -> "CudaSyncs":
        self._catcher = warnings.catch_warnings(record=True)
        self.recorded = self._catcher.__enter__()
        warnings.simplefilter("always")  # every one, not the first per line of code
        torch.cuda.set_sync_debug_mode("warn")
        return self


def host_sync_counter(device_type: str):
    """CUDA's own count on a GPU, value reads elsewhere."""
    return CudaSyncs() if device_type == "cuda" else ValueReads()
