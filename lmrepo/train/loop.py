"""The training loop: steps until trainer.max_steps or a stop, the loss read back from the device
only where a hook acts on it, and the hooks (lmrepo.train.hooks: metrics, evaluation, downstream
tasks, checkpoints, the bar) called at their named points. Techniques live in the engine and the
DeepSpeed config, not here: the loop is the same for every engine, ZeRO stage, precision and offload."""

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lmrepo.config import TrainerConfig
from lmrepo.distributed.launch import host_group
from lmrepo.engines.base import Engine
from lmrepo.train.stop import StopRequest
from lmrepo.utils.errors import TrainingError


@dataclass
class TrainState:
    """Where training is: checkpointed, and all a resumed run needs to continue exactly."""

    step: int = 0  # optimizer steps done
    consumed: int = 0  # samples consumed, all ranks together (the data order's position)


def sum_over_ranks(values: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, group=group)
    return values


class StopFlags:
    """Whether any rank was asked to stop, agreed on by all ranks at every step, without waiting for
    the device: the flags are host tensors reduced over a gloo group (on CUDA a group of its own,
    since NCCL reduces device tensors only, and reading one back would wait for the step's kernels)."""

    def __init__(self, stop: "StopRequest | None"):
        self.stop = stop
        self.ranks = dist.get_world_size() if dist.is_initialized() else 1
        self.group = None
        if self.ranks > 1 and dist.get_backend() != "gloo":
            self.group = host_group()

    def any_rank(self) -> bool:
        mine = self.stop is not None and self.stop.signal_name is not None
        if self.ranks == 1:
            return mine
        flags = torch.tensor([float(mine)])
        return sum_over_ranks(flags, self.group).item() > 0


@dataclass
class Window:
    """The training steps and seconds since the last metrics line (its throughput): the seconds
    are counted up to each read-back, when the device has finished the window's steps, and
    restart after the hooks, so evaluation and checkpoints are not training time."""

    steps: int = 0
    seconds: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def restart(self) -> None:
        self.steps, self.seconds = 0, 0.0


@dataclass
class Step:
    """A step whose loss was read back: what the hooks act on."""

    number: int
    loss: float  # the mean over every rank
    lr: float  # the rate the step used
    consumed: int  # samples consumed so far, all ranks together
    stopped: str | None  # the signal a rank was asked to stop by
    final: bool  # trainer.max_steps reached, or stopped
    window: Window


def read_back(unread: list[tuple[int, torch.Tensor]], hooks) -> float:
    """The mean over ranks of each unread step's loss (one all-reduce); the last one's value. A loss
    that is not finite ends training, after the hooks hear of it."""
    steps, losses = zip(*unread)
    unread.clear()
    means = sum_over_ranks(torch.stack(losses).float()).cpu() / dist.get_world_size()
    bad = [(step, value) for step, value in zip(steps, means.tolist()) if not math.isfinite(value)]
    if bad:
        for hook in hooks:
            hook.loss_not_finite()
        raise TrainingError(
            f"the loss became {bad[0][1]} at step {bad[0][0]}: lower optimizer.lr or raise "
            "schedule.warmup_steps (fp16: use precision=bf16); the last sound checkpoint is kept"
        )
    return means[-1].item()


def fit(
    engine: Engine, data, trainer: TrainerConfig, state: TrainState, hooks: list, stop=None, beat=None
) -> str | None:
    """Trains until trainer.max_steps or a stop request (`stop`: lmrepo.train.stop.StopRequest,
    agreed on by every rank at every step); `beat(step)` (the watchdog's heartbeat) at every step;
    `hooks` (lmrepo.train.hooks) at their points. Returns the stop signal's name, or None.

    The loss stays on the device between the steps a hook is due at: reading it back (or anything
    else the step computed) makes the host wait for the device, and a host that waits cannot queue
    the next step's kernels meanwhile."""
    window, unread, stopped = Window(), [], None
    stop_flags = StopFlags(stop)
    try:
        while state.step < trainer.max_steps and not stopped:
            if beat is not None:
                beat(state.step)
            lr = engine.lr()  # the rate this step uses (the scheduler advances inside the step)
            loss = engine.train_step(data.train_step(state.consumed))
            state.step += 1
            state.consumed += data.layout.global_batch
            window.steps += 1
            unread.append((state.step, loss.detach()))
            if stop_flags.any_rank():
                stopped = stop.signal_name if stop is not None and stop.signal_name else "SIGTERM"
            final = state.step == trainer.max_steps or stopped is not None
            if not final and not any(hook.due(state.step, stopped) for hook in hooks):
                continue
            loss_value = read_back(unread, hooks)
            window.seconds += time.perf_counter() - window.start  # the device has finished the window's steps
            step = Step(state.step, loss_value, lr, state.consumed, stopped, final, window)
            for hook in hooks:
                hook.loss_read(step)
            for hook in hooks:
                hook.after_step(step)
            window.start = time.perf_counter()
    finally:
        for hook in hooks:
            hook.end()
    return stopped
