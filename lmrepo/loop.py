"""The training loop: steps, evaluation, checkpoint cadence, metrics. Techniques live in the
DeepSpeed config, not here: the loop is the same for every ZeRO stage, precision and offload."""
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from lmrepo.errors import TrainingError
from lmrepo.metrics import memory_gb


@dataclass
class Throughput:
    tokens_per_step: int      # global: all data-parallel ranks
    flops_per_token: float    # executed (with recomputation) FLOPs per token
    model_flops_per_token: float  # without recomputation: the MFU numerator (PaLM's convention)
    world_size: int
    peak_tflops: float | None
    device_type: str

    def record(self, steps: int, seconds: float) -> dict:
        tokens_per_s = self.tokens_per_step * steps / seconds
        per_device = tokens_per_s / self.world_size
        mfu = per_device * self.model_flops_per_token / 1e12 / self.peak_tflops if self.peak_tflops else None
        return {"tokens_per_s": tokens_per_s, "tflops": per_device * self.flops_per_token / 1e12, "mfu": mfu,
                "mem_gb": memory_gb(self.device_type)}


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


@torch.no_grad()
def evaluate(engine, data) -> float:
    engine.eval()
    losses = [engine(**_to_device(batch, engine.device)).loss.float() for batch in data.eval_batches()]
    engine.train()
    return _mean_over_ranks(torch.stack(losses).mean())


def fit(engine, data, trainer, throughput: Throughput, sinks, start_step: int = 0, save=None, is_rank0=True) -> dict:
    """Trains from `start_step` to trainer.max_steps. `save(step)` is called on every rank at the
    checkpoint cadence. Returns the last logged record."""
    engine.train()
    tokens_per_step = throughput.tokens_per_step
    bar = tqdm(total=trainer.max_steps, initial=start_step, disable=not is_rank0, dynamic_ncols=True, desc="train")
    # Throughput counts training steps only: evaluation and checkpoint time stay out of the window.
    window_seconds, window_steps, last = 0.0, 0, {}
    fit_start = time.perf_counter()
    for step in range(start_step, trainer.max_steps):
        step_start = time.perf_counter()
        lr = engine.get_lr()[0]  # the rate this step uses (the scheduler advances inside engine.step)
        # forward / backward over the micro batches; DeepSpeed steps the optimizer at the boundary
        micro_losses = []
        for batch in data.train_step(step):
            loss = engine(**_to_device(batch, engine.device)).loss
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.detach().float())
        step_loss = torch.stack(micro_losses).mean()
        done = step + 1
        window_steps += 1
        window_seconds += time.perf_counter() - step_start

        # log: loss averaged over data-parallel ranks, throughput over the window since the last log
        if done % trainer.log_every == 0 or done in (1, trainer.max_steps):
            loss_value = _mean_over_ranks(step_loss)
            if not math.isfinite(loss_value):
                raise TrainingError(f"the loss became {loss_value} at step {done}: lower trainer.lr, "
                                    "or use precision=bf16/fp32; the last checkpoint is kept")
            last = {"step": done, "loss": loss_value, "lr": lr, "tokens": done * tokens_per_step,
                    **throughput.record(window_steps, window_seconds), "elapsed_s": time.perf_counter() - fit_start}
            if is_rank0:
                sinks.log(last)
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{last['tokens_per_s']:.0f}")
            window_seconds, window_steps = 0.0, 0

        # evaluate on the held-out split
        if (trainer.eval_every and done % trainer.eval_every == 0) or done == trainer.max_steps:
            eval_loss = evaluate(engine, data)
            if is_rank0:
                sinks.log({"step": done, "eval_loss": eval_loss, "tokens": done * tokens_per_step,
                           "elapsed_s": time.perf_counter() - fit_start})
                bar.write(f"step {done}: eval_loss {eval_loss:.4f}")
            last = {**last, "eval_loss": eval_loss}

        # checkpoint
        if save and trainer.save_every and done % trainer.save_every == 0:
            save(done)
        bar.update(1)
    bar.close()
    return last
