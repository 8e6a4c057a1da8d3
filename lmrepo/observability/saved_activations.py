"""What autograd keeps for the backward pass, counted as it happens: the activation memory of a
forward (or of a whole pipelined step, whose micro batches' activations come and go by schedule).

Inside `with SavedActivations() as saved:` every tensor autograd saves passes through a
`saved_tensors_hooks` pair; a storage counts once, whole (a view keeps all of it alive), from the
first tensor saved of it until the last one is released with its graph. Parameters (and views of
them) are model states, not activations, and are left out: FSDP2's gathered weights, a tensor-
parallel slice and DeepSpeed's parameters are `nn.Parameter`s as well. A DTensor counts as its
local shard. `saved.peak` is the most held at once, in bytes; `with saved.step():` counts one
training step's.

Works on fake tensors too (`torch._subclasses.FakeTensorMode`): lmrepo.estimate counts a model's
activations without memory or compute that way, with the kernels a real CPU run would choose.
Meta tensors hold no memory and are not counted, nor a tensor subclass without a storage.
torch's (non-reentrant) checkpoint saves through hooks of its own (the innermost pair applies) and
keeps its region's inputs outside autograd: the count sees neither; DeepSpeed's (reentrant) saves
the inputs through autograd, where they count.
"""

import contextlib

import torch


class _Held:
    """What the pack hook hands autograd for a counted tensor: autograd drops it with the graph,
    and the count lets the tensor go then."""

    __slots__ = ("tensor", "counter", "key")

    def __init__(self, tensor: torch.Tensor, counter: "SavedActivations", key: int):
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self):
        self.counter._release(self.key)


def _storage(tensor: torch.Tensor):
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.untyped_storage()


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


class SavedActivations:
    def __init__(self):
        self.live = 0  # bytes held now
        self.peak = 0
        self._count: dict[int, list[int]] = {}  # storage -> [tensors saved of it, its bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @contextlib.contextmanager
    def step(self):
        """Counts one step (inside the hooks): `last_step` is then the most it held at once above
        what was held before it."""
        start = self.peak = self.live
        with self:
            yield self
        self.last_step = self.peak - start

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        if _is_parameter(tensor) or tensor.device.type == "meta":  # meta: shapes only (a pipeline's inference)
            return tensor
        try:
            storage = _storage(tensor)
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
            return tensor
        key = storage._cdata  # one per storage, however many tensors view it
        entry = self._count.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Held(tensor, self, key)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, key: int) -> None:
        entry = self._count[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._count[key]
