"""The figures a comparison cites, defined once. The sweep's summary, scripts/compare.py, the
done line, status.json and the W&B run summary all compute them here, from the same
metrics.jsonl records (or W&B's history of them), so one sweep ranks the same in every table.

Throughput is steady-state: a training record covers the steps since the previous one (its
logging window, training steps only: evaluation and checkpoints are outside the timer), and the
first window of each process (step 1 of a run, the first after a resume: allocation, kernel
selection, first-use compiles) is left out. The steady figure is the tokens of the remaining
windows over the seconds they took; its spread, the slowest and the fastest of those windows (a
range that always holds the figure, and shows a disturbed window as it is).
"""

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

# What each figure is, in the words of the column headers and the docs (docs/sweeps.md).
DEFINITIONS = {
    "final loss": "the training loss of the last logged step (mean over ranks)",
    "eval loss": "the last held-out evaluation",
    "grad norm": "the last logged step's global gradient norm, before clipping",
    "tokens/s (steady) [range]": "tokens trained after the first logging window over the training seconds they "
    "took (evaluation and checkpoints excluded), all ranks together; in brackets the slowest and the fastest "
    "logging window",
    "TFLOP/s (steady)": "per device, the steady tokens/s times the FLOPs a token costs (recomputation counted)",
    "MFU (steady)": "per device, the steady tokens/s times the model FLOPs per token, over the device's peak",
    "bubble (median)": "pipelines: the median over the steady windows of the fraction of a step no rank computed in",
    "peak mem GB (rank 0)": "rank 0's largest reading: CUDA memory allocated on a GPU, resident memory on a CPU",
    "steps": "the last step logged",
    "wall s": "the whole job: interpreter start, data, training, evaluation and checkpoints",
}


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl lines; a torn last line (a killed job) is skipped, not fatal."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def training_records(metrics: list[dict]) -> list[dict]:
    """The records of training steps (eval, checkpoint and downstream lines have no `loss`)."""
    return [m for m in metrics if m.get("loss") is not None]


@dataclass
class Window:
    """A logging window: the steps after `after` up to `record["step"]`."""

    record: dict
    after: int  # the step of the previous record
    tokens: float
    seconds: float


def steady_windows(metrics: list[dict]) -> list[Window]:
    """Every logging window after the first of its process. A window's tokens are its record's
    `tokens` less the previous record's; its seconds, those tokens over its `tokens_per_s`. A
    process starts again where `elapsed_s` (seconds since that process's first step) goes back:
    a resume."""
    windows, previous = [], None
    for record in training_records(metrics):
        fresh = previous is None or record.get("elapsed_s", 0.0) < previous.get("elapsed_s", 0.0)
        rate, tokens = record.get("tokens_per_s"), record.get("tokens")
        if not fresh and rate and tokens is not None and previous.get("tokens") is not None:
            done = tokens - previous["tokens"]
            if done > 0:
                windows.append(Window(record, previous["step"], done, done / rate))
        previous = record
    return windows


def steady_throughput(metrics: list[dict]) -> dict | None:
    """{"tokens_per_s", "min", "max", "first_step", "last_step", "windows"} over the steady windows,
    or None when the run logged no window after its first."""
    windows = steady_windows(metrics)
    if not windows:
        return None
    rates = [w.tokens / w.seconds for w in windows]
    return {
        "tokens_per_s": sum(w.tokens for w in windows) / sum(w.seconds for w in windows),
        "min": min(rates),
        "max": max(rates),
        "first_step": windows[0].after + 1,
        "last_step": windows[-1].record["step"],
        "windows": len(windows),
    }


def run_figures(metrics: list[dict]) -> dict:
    """Every figure of DEFINITIONS a run's records give (None where they give none), keyed as
    metrics.jsonl keys them, with `tokens_per_s_min`/`_max` the spread, `steady_steps` the steps
    the steady figures cover and `windows` how many logging windows those are."""
    train = training_records(metrics)
    evals = [m for m in metrics if m.get("eval_loss") is not None]
    steady = steady_throughput(metrics)
    last = train[-1] if train else {}
    figures = {
        "loss": last.get("loss"),
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "grad_norm": last.get("grad_norm"),
        "tokens_per_s": None,
        "tokens_per_s_min": None,
        "tokens_per_s_max": None,
        "steady_steps": None,
        "windows": 0,
        "tflops": None,
        "mfu": None,
        "bubble": None,
        "mem_gb": max((m["mem_gb"] for m in train if m.get("mem_gb") is not None), default=None),
        "step": max((m["step"] for m in metrics if m.get("step") is not None), default=None),
    }
    if steady is not None:
        rate = steady["tokens_per_s"]
        figures.update(
            tokens_per_s=rate,
            tokens_per_s_min=steady["min"],
            tokens_per_s_max=steady["max"],
            steady_steps=[steady["first_step"], steady["last_step"]],
            windows=steady["windows"],
        )
        # TFLOP/s and MFU are the tokens/s times a constant of the run (FLOPs per token, devices,
        # peak): the steady rate times the last record's ratio.
        for key in ("tflops", "mfu"):
            if last.get(key) is not None and last.get("tokens_per_s"):
                figures[key] = rate * last[key] / last["tokens_per_s"]
        bubbles = [w.record["bubble"] for w in steady_windows(metrics) if w.record.get("bubble") is not None]
        figures["bubble"] = statistics.median(bubbles) if bubbles else None
    return figures


def throughput_text(figures: dict) -> str:
    """The steady tokens/s as a table cell and the done line write it: `4181 [3855-4569]`."""
    rate = figures.get("tokens_per_s")
    if rate is None:
        return "-"
    return f"{rate:.0f} [{figures['tokens_per_s_min']:.0f}-{figures['tokens_per_s_max']:.0f}]"


def objective_value(metrics: list[dict], key: str) -> float | None:
    """A sweep job's objective (launcher.objective): the run's figure for `key` where this module
    defines one (tokens_per_s steady, mem_gb the peak, loss and eval_loss the last), so a search
    optimises what the tables show; else the last value metrics.jsonl logged for it."""
    figure = run_figures(metrics).get(key)
    if isinstance(figure, (int, float)):
        return float(figure)
    values = [float(m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
    return values[-1] if values else None
