"""`logger`, `run`, `launcher`: where a job writes and how a sweep starts it."""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import List, Optional

from lmrepo.utils.errors import require


class LoggerName(StrEnum):
    wandb = "wandb"
    tensorboard = "tensorboard"
    jsonl = "jsonl"
    none = "none"


class LoggerMode(StrEnum):
    auto = "auto"
    online = "online"
    offline = "offline"


@dataclass
class LoggerConfig:
    """metrics.jsonl is always written; this adds a logger beside it."""

    name: LoggerName = LoggerName.wandb
    """wandb | tensorboard | jsonl (metrics.jsonl only) | none"""
    project: str = "lmrepo"
    """wandb: the project"""
    entity: Optional[str] = None
    """wandb: the team or user; null = the key's default"""
    mode: LoggerMode = LoggerMode.auto
    """wandb: auto (online with an API key and a reachable server, else offline) | online | offline"""
    group: Optional[str] = None
    """wandb: the run group; null = the sweep's"""
    tags: List[str] = field(default_factory=list)
    """wandb: tags added to the technique tags"""


@dataclass
class RunConfig:
    dir: str = "${hydra:runtime.output_dir}"
    """the run directory (Hydra's outputs/<date>/<time> by default)"""
    resume: Optional[str] = None
    """null | auto (continue from run.dir's latest checkpoint) | PATH of a run, its checkpoints/ or a checkpoint"""
    hang_timeout_s: int = 600
    """seconds a collective waits for a stalled or dead peer before every rank stops; 0 = no watchdog"""
    cpu_keep_freed_memory: bool = True
    """on a CPU, glibc keeps a step's freed memory for the next step (faster, more memory held); false = glibc's own"""

    def check(self) -> None:
        require(self.hang_timeout_s >= 0, f"run.hang_timeout_s={self.hang_timeout_s} must be >= 0 (0 = off)")


class ObjectiveMode(StrEnum):
    min = "min"
    max = "max"


@dataclass
class LauncherConfig:
    ranks: int = 1
    """ranks per multirun job (per node with hydra/launcher=slurm)"""
    nodes: int = 1
    """nodes per job (hydra/launcher=slurm)"""
    objective: str = "eval_loss"
    """what a sweep job returns to the sweeper: the run's figure for this metrics.jsonl key as the tables show it
    (tokens_per_s: steady; mem_gb: peak), else its last logged value"""
    objective_mode: ObjectiveMode = ObjectiveMode.min
    """min | max: which objective is best; returned as logged, so a search sweeper's direction must agree"""

    def check(self) -> None:
        require(self.ranks >= 1, f"launcher.ranks={self.ranks} must be >= 1")
        require(self.nodes >= 1, f"launcher.nodes={self.nodes} must be >= 1")
        require(
            bool(self.objective.strip()),
            "launcher.objective must name a metric (a key of metrics.jsonl, e.g. eval_loss)",
        )
