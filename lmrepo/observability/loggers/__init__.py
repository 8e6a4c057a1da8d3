"""Where metrics go: metrics.jsonl always (the run-directory contract), plus the chosen logger."""

import json
from pathlib import Path


def scalars(record: dict) -> dict:
    """A record for loggers that plot scalars: a list (a mixture of experts' `expert_tokens`)
    becomes one key per element, `expert_tokens/0`, `expert_tokens/1`, ..."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, list):
            flat.update({f"{key}/{i}": v for i, v in enumerate(value)})
        else:
            flat[key] = value
    return flat


class JsonlSink:
    def __init__(self, run_dir: Path):
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def summarize(self, figures: dict) -> None:
        """metrics.jsonl is what the figures are computed from: nothing more to write."""

    def finish(self) -> None:
        self.file.close()


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        for key, value in scalars(record).items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, record["step"])

    def summarize(self, figures: dict) -> None:
        """TensorBoard keeps scalars per step, no run summary: compare.py computes the figures."""

    def finish(self) -> None:
        self.writer.close()


class Sinks:
    """Fans each record out to every sink."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log(record)

    def summarize(self, figures: dict) -> None:
        """The run's figures (lmrepo.observability.figures.run_figures) at its end, for the sinks that
        keep a summary."""
        for sink in self.sinks:
            sink.summarize(figures)

    def finish(self) -> None:
        for sink in self.sinks:
            sink.finish()


def build_sinks(logger, run_dir: Path, config: dict, ds_config: dict) -> Sinks:
    sinks = [JsonlSink(run_dir)]
    if logger.name == "tensorboard":
        sinks.append(TensorBoardSink(run_dir))
    elif logger.name == "wandb":
        from lmrepo.observability.loggers.wandb_sink import WandbSink

        sinks.append(WandbSink(logger, run_dir, config, ds_config))
    return Sinks(sinks)
