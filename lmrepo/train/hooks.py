"""The training loop's concerns, each one hook the loop calls at its named points (OLMo-core's
callbacks are the model): the metrics line, the held-out evaluation, the downstream tasks, the
checkpoints and the progress bar. Each hook decides in one place (`due`) at which steps it acts;
the loop reads the loss back from the device only at a step some hook is due."""

import math
import os
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist
from tqdm import tqdm

from lmrepo.config import TrainerConfig
from lmrepo.engines.base import Engine
from lmrepo.observability.metrics import memory_gb
from lmrepo.train.loop import Step, TrainState, sum_over_ranks
from lmrepo.utils.errors import TrainingError


class Hook:
    """One concern of the loop. The named points, in the order the loop reaches them:
    `due(step, stopped)` after each step (does this hook act at it? then the loss is read back);
    `loss_read(step)` once the loss is read back and finite (`loss_not_finite()` when it is not);
    `after_step(step)` at each step a hook was due, every hook in the list's order; `end()` once,
    however the loop ends."""

    def due(self, step: int, stopped: str | None) -> bool:
        return False

    def loss_read(self, step: Step) -> None:
        pass

    def loss_not_finite(self) -> None:
        pass

    def after_step(self, step: Step) -> None:
        pass

    def end(self) -> None:
        pass


class Progress(Hook):
    """tqdm's bar where a terminal shows it; elsewhere (a file such as a sweep job's job.log, a
    pipe, a terminal of width 0, where tqdm draws nothing at all) one plain line per logged step.
    Also what the other hooks report through: the sinks (rank 0's), and the last record, which
    the run's status.json keeps."""

    MIN_COLUMNS = 40  # narrower, the bar has no room for its figures

    def __init__(self, sinks, total: int, initial: int, enabled: bool):
        self.sinks, self.total, self.enabled = sinks, total, enabled
        self.plain = enabled and not self.bar_fits()
        self.bar = tqdm(
            total=total, initial=initial, disable=not enabled or self.plain, dynamic_ncols=True, desc="train"
        )
        self.last: dict = {}
        self.start = time.perf_counter()

    @classmethod
    def bar_fits(cls) -> bool:
        try:
            return sys.stderr.isatty() and os.get_terminal_size(sys.stderr.fileno()).columns >= cls.MIN_COLUMNS
        except (OSError, ValueError):
            return False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, record: dict, line: str | None = None) -> None:
        """`record` to the sinks, `line` under the bar (rank 0's; the other ranks' are disabled)."""
        if self.enabled:
            self.sinks.log(record)
            if line is not None:
                self.bar.write(line)

    def logged(self, record: dict) -> None:
        if self.plain:
            print(
                f"train: step {record['step']}/{self.total}: loss {record['loss']:.4f}, "
                f"tokens/s {record['tokens_per_s']:.0f} (this logging window)",
                file=sys.stderr,
                flush=True,
            )
        elif self.enabled:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def after_step(self, step: Step) -> None:
        self.bar.update(step.number - self.bar.n)

    def end(self) -> None:
        self.bar.close()  # the bar ends its line whatever happens: an error line never lands on it


@dataclass
class Throughput:
    tokens_per_step: int  # global: all data-parallel ranks
    flops_per_token: float  # executed (with recomputation) FLOPs per token
    model_flops_per_token: float  # without recomputation: the MFU numerator (PaLM's convention)
    world_size: int
    peak_tflops: float | None
    device_type: str

    def record(self, steps: int, seconds: float) -> dict:
        tokens_per_s = self.tokens_per_step * steps / seconds
        per_device = tokens_per_s / self.world_size
        mfu = per_device * self.model_flops_per_token / 1e12 / self.peak_tflops if self.peak_tflops else None
        return {
            "tokens_per_s": tokens_per_s,
            "tflops": per_device * self.flops_per_token / 1e12,
            "mfu": mfu,
            "mem_gb": memory_gb(self.device_type),
        }


@dataclass
class LogMetrics(Hook):
    """The metrics line every trainer.log_every steps, at the first and the last step and at a stop:
    the loss, the learning rate and the throughput of the window since the last line (training
    time only: the loop keeps evaluation and checkpoints out of the window). With fp16, a loss
    scale stuck at its minimum is an error."""

    progress: Progress
    engine: Engine
    throughput: Throughput
    log_every: int
    max_steps: int
    block_tokens: int
    min_loss_scale: float | None = None

    def due(self, step: int, stopped: str | None) -> bool:
        return step % self.log_every == 0 or step in (1, self.max_steps) or stopped is not None

    def after_step(self, step: Step) -> None:
        if not self.due(step.number, step.stopped):
            return
        record = {
            "step": step.number,
            "loss": step.loss,
            "lr": step.lr,
            "tokens": step.consumed * self.block_tokens,
            **self.throughput.record(step.window.steps, step.window.seconds),
            **self.engine.step_record(),
            "elapsed_s": self.progress.elapsed(),
            "time": time.time(),
        }
        if (
            self.min_loss_scale is not None
            and record.get("loss_scale", float("inf")) <= self.min_loss_scale
            and record["skipped_steps"] >= step.number // 2
        ):
            raise TrainingError(
                f"fp16 loss scale stuck at its minimum {self.min_loss_scale} with {record['skipped_steps']} "
                f"of {step.number} steps skipped (overflow): use precision=bf16"
            )
        self.progress.last = record  # a metrics line starts the record status.json keeps
        self.progress.log(record)
        self.progress.logged(record)
        step.window.restart()


def evaluate(engine: Engine, data) -> float:
    """The held-out loss, averaged over every rank (reduced where it was computed: NCCL reduces
    device tensors only)."""
    mean = engine.eval_loss(data.eval_batches()).float().reshape(1)
    return (sum_over_ranks(mean) / dist.get_world_size()).item()


@dataclass
class EvaluateHeldOut(Hook):
    """The held-out loss every trainer.eval_every steps and at the last step."""

    progress: Progress
    engine: Engine
    data: object  # lmrepo.data.loader.LMData
    eval_every: int
    max_steps: int

    def due(self, step: int, stopped: str | None) -> bool:
        return bool(self.eval_every and step % self.eval_every == 0) or step == self.max_steps

    def after_step(self, step: Step) -> None:
        if not self.due(step.number, step.stopped):
            return
        eval_loss = evaluate(self.engine, self.data)
        record = {
            "step": step.number,
            "eval_loss": eval_loss,
            "tokens": step.consumed * self.data.block_tokens,
            "elapsed_s": self.progress.elapsed(),
        }
        self.progress.log(record, f"step {step.number}: eval_loss {eval_loss:.4f}")
        self.progress.last = {**self.progress.last, "eval_loss": eval_loss}


@dataclass
class DownstreamTasks(Hook):
    """lm-eval tasks on the live model at their cadence (lmrepo.evaluation.Downstream): every rank
    runs them, rank 0 gets one line per task."""

    progress: Progress
    downstream: object  # lmrepo.evaluation.Downstream
    max_steps: int
    block_tokens: int
    beat: object = None  # the watchdog's heartbeat, after every forward

    def due(self, step: int, stopped: str | None) -> bool:
        return self.downstream.due(step, self.max_steps)

    def after_step(self, step: Step) -> None:
        if not self.due(step.number, step.stopped):
            return
        for line in self.downstream(step.number, self.beat):
            words = ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in line.items() if k != "step")
            record = {**line, "tokens": step.consumed * self.block_tokens, "elapsed_s": self.progress.elapsed()}
            self.progress.log(record, f"step {step.number}: {words}")
            self.progress.last = {**self.progress.last, **line}


@dataclass
class SaveCheckpoints(Hook):
    """Checkpoints (lmrepo.train.checkpoint.Checkpointer) every trainer.save_every steps, at the end
    and when asked to stop. A save stays on probation until a later finite loss vouches for its
    weights (the end's evaluation, or the stop, vouches at once); a loss that is not finite
    abandons it."""

    checkpoints: object  # lmrepo.train.checkpoint.Checkpointer
    state: TrainState
    progress: Progress
    save_every: int
    max_steps: int

    def saving(self, step: int, stopped: str | None) -> bool:
        final = step == self.max_steps or stopped is not None
        return bool(self.save_every and (step % self.save_every == 0 or final)) or stopped is not None

    def due(self, step: int, stopped: str | None) -> bool:
        return self.saving(step, stopped) or self.checkpoints.pending is not None

    def loss_read(self, step: Step) -> None:
        self.checkpoints.confirm()

    def loss_not_finite(self) -> None:
        self.checkpoints.abandon()  # the last save holds the weights that gave this loss

    def after_step(self, step: Step) -> None:
        if not self.saving(step.number, step.stopped):
            return
        self.checkpoints.save(self.state)
        if step.final and math.isfinite(self.progress.last.get("eval_loss", 0.0)):
            self.checkpoints.confirm()


def training_hooks(
    progress: Progress,
    engine: Engine,
    data,
    trainer: TrainerConfig,
    throughput: Throughput,
    state: TrainState,
    checkpoints=None,
    downstream=None,
    beat=None,
    min_loss_scale: float | None = None,
) -> list[Hook]:
    """train.py's hooks, in the order they act at a step: the metrics line, the held-out loss, the
    downstream tasks, the checkpoint (after the evaluation that may vouch for it), the bar."""
    hooks: list[Hook] = [
        LogMetrics(
            progress, engine, throughput, trainer.log_every, trainer.max_steps, data.block_tokens, min_loss_scale
        ),
        EvaluateHeldOut(progress, engine, data, trainer.eval_every, trainer.max_steps),
    ]
    if downstream is not None:
        hooks.append(DownstreamTasks(progress, downstream, trainer.max_steps, data.block_tokens, beat))
    if checkpoints is not None:
        hooks.append(SaveCheckpoints(checkpoints, state, progress, trainer.save_every, trainer.max_steps))
    return [*hooks, progress]
