"""The training loop: steps, evaluation, checkpoint cadence, metrics. Techniques live in the
DeepSpeed config, not here: the loop is the same for every ZeRO stage, precision and offload."""

import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from lmrepo.config import TrainerConfig
from lmrepo.distributed.launch import host_group
from lmrepo.engines.base import Engine
from lmrepo.observability.metrics import memory_gb
from lmrepo.train.stop import StopRequest
from lmrepo.utils.errors import TrainingError


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
class TrainState:
    """Where training is: checkpointed, and all a resumed run needs to continue exactly."""

    step: int = 0  # optimizer steps done
    consumed: int = 0  # samples consumed, all ranks together (the data order's position)


class Progress:
    """tqdm's bar where a terminal shows it; elsewhere (a file such as a sweep job's job.log, a
    pipe, a terminal of width 0, where tqdm draws nothing at all) one plain line per logged step."""

    MIN_COLUMNS = 40  # narrower, the bar has no room for its figures

    def __init__(self, total: int, initial: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.plain = enabled and not self.bar_fits()
        self.bar = tqdm(
            total=total, initial=initial, disable=not enabled or self.plain, dynamic_ncols=True, desc="train"
        )

    @classmethod
    def bar_fits(cls) -> bool:
        try:
            return sys.stderr.isatty() and os.get_terminal_size(sys.stderr.fileno()).columns >= cls.MIN_COLUMNS
        except (OSError, ValueError):
            return False

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

    def write(self, line: str) -> None:
        self.bar.write(line)

    @property
    def n(self) -> int:
        return self.bar.n

    def update(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def close(self) -> None:
        self.bar.close()


def _sum_over_ranks(values: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, group=group)
    return values


def evaluate(engine: Engine, data) -> float:
    """The held-out loss, averaged over every rank (reduced where it was computed: NCCL reduces
    device tensors only)."""
    mean = engine.eval_loss(data.eval_batches()).float().reshape(1)
    return (_sum_over_ranks(mean) / dist.get_world_size()).item()


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
        return _sum_over_ranks(flags, self.group).item() > 0


def fit(
    engine: Engine,
    data,
    trainer: TrainerConfig,
    throughput: Throughput,
    sinks,
    state: TrainState,
    checkpoints,
    stop: StopRequest | None,
    is_rank0: bool,
    beat=None,
    min_loss_scale: float | None = None,
    downstream=None,
) -> tuple[dict, str | None]:
    """Trains until trainer.max_steps or a stop request. `checkpoints` (a checkpoint.Checkpointer,
    or None) saves on every rank at the checkpoint cadence and before stopping, and learns from
    each step's loss whether the last checkpoint's weights are sound; `beat(step)` (the watchdog's
    heartbeat) runs at every step.
    `downstream` (lmrepo.evaluation.Downstream: lm-eval tasks) runs on every rank at its cadence.
    Returns (last record, the stop signal's name or None)."""
    bar = Progress(trainer.max_steps, state.step, enabled=is_rank0)
    # Throughput counts training steps only: evaluation and checkpoint time stay out of the window.
    # The loss stays on the device between logging steps: reading it back (or anything else the step
    # computed) makes the host wait for the device, and a host that waits cannot queue the next
    # step's kernels meanwhile. It is read where it decides something: the logging, evaluation and
    # checkpoint steps, the step after a save (whose loss vouches for the saved weights) and the last.
    window_seconds, window_steps, last, stopped = 0.0, 0, {}, None
    unread: list[tuple[int, torch.Tensor]] = []  # (step, loss) not yet read back
    stop_flags = StopFlags(stop)
    fit_start = time.perf_counter()
    window_start = fit_start
    try:  # the bar ends its line whatever happens: an error line never lands on it
        while state.step < trainer.max_steps and not stopped:
            if beat is not None:
                beat(state.step)
            lr = engine.lr()  # the rate this step uses (the scheduler advances inside the step)

            loss = engine.train_step(data.train_step(state.consumed))
            state.step += 1
            state.consumed += data.layout.global_batch
            window_steps += 1
            unread.append((state.step, loss.detach()))
            if stop_flags.any_rank():
                stopped = stop.signal_name if stop is not None and stop.signal_name else "SIGTERM"

            logging = state.step % trainer.log_every == 0 or state.step in (1, trainer.max_steps) or stopped
            saving = checkpoints is not None and (
                trainer.save_every
                and (state.step % trainer.save_every == 0 or state.step == trainer.max_steps)
                or stopped
            )
            evaluating = bool(trainer.eval_every and state.step % trainer.eval_every == 0)
            on_probation = checkpoints is not None and checkpoints.pending is not None
            due = downstream is not None and downstream.due(state.step, trainer.max_steps)
            if not (logging or saving or evaluating or on_probation or due or state.step == trainer.max_steps):
                continue

            # read back: the mean loss over ranks of each unread step (one all-reduce), all finite?
            steps, losses = zip(*unread)
            unread.clear()
            means = _sum_over_ranks(torch.stack(losses).float()).cpu() / dist.get_world_size()
            window_seconds += time.perf_counter() - window_start  # the device has finished the window's steps
            bad = [(step, value) for step, value in zip(steps, means.tolist()) if not math.isfinite(value)]
            if bad:
                if checkpoints is not None:
                    checkpoints.abandon()  # the last save holds the weights that gave this loss
                raise TrainingError(
                    f"the loss became {bad[0][1]} at step {bad[0][0]}: lower optimizer.lr or raise "
                    "schedule.warmup_steps (fp16: use precision=bf16); the last sound checkpoint is kept"
                )
            loss_value = means[-1].item()
            if checkpoints is not None:
                checkpoints.confirm()

            # log: throughput over the window since the last log
            if logging:
                last = {
                    "step": state.step,
                    "loss": loss_value,
                    "lr": lr,
                    "tokens": state.consumed * data.block_tokens,
                    **throughput.record(window_steps, window_seconds),
                    **engine.step_record(),
                    "elapsed_s": time.perf_counter() - fit_start,
                    "time": time.time(),
                }
                if (
                    min_loss_scale is not None
                    and last.get("loss_scale", float("inf")) <= min_loss_scale
                    and last["skipped_steps"] >= state.step // 2
                ):
                    raise TrainingError(
                        f"fp16 loss scale stuck at its minimum {min_loss_scale} with {last['skipped_steps']} "
                        f"of {state.step} steps skipped (overflow): use precision=bf16"
                    )
                if is_rank0:
                    sinks.log(last)
                    bar.logged(last)
                window_seconds, window_steps = 0.0, 0

            # evaluate on the held-out split
            if (trainer.eval_every and state.step % trainer.eval_every == 0) or state.step == trainer.max_steps:
                eval_loss = evaluate(engine, data)
                if is_rank0:
                    sinks.log(
                        {
                            "step": state.step,
                            "eval_loss": eval_loss,
                            "tokens": state.consumed * data.block_tokens,
                            "elapsed_s": time.perf_counter() - fit_start,
                        }
                    )
                    bar.write(f"step {state.step}: eval_loss {eval_loss:.4f}")
                last = {**last, "eval_loss": eval_loss}

            # downstream tasks on the live model: every rank runs them, rank 0 gets one line per task
            if downstream is not None and downstream.due(state.step, trainer.max_steps):
                for line in downstream(state.step, beat):
                    sinks.log(
                        {
                            **line,
                            "tokens": state.consumed * data.block_tokens,
                            "elapsed_s": time.perf_counter() - fit_start,
                        }
                    )
                    bar.write(
                        f"step {state.step}: "
                        + ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in line.items() if k != "step")
                    )
                    last = {**last, **line}

            # checkpoint: at the cadence, at the end, and when asked to stop (the end's evaluation, or
            # the stop, vouches for the weights at once)
            final = state.step == trainer.max_steps or stopped
            if checkpoints is not None and (
                trainer.save_every and (state.step % trainer.save_every == 0 or final) or stopped
            ):
                checkpoints.save(state)
                if final and math.isfinite(last.get("eval_loss", 0.0)):
                    checkpoints.confirm()
            bar.update(state.step - bar.n)
            window_start = time.perf_counter()  # evaluation and checkpoints are not training time
    finally:
        bar.close()
    return last, stopped
