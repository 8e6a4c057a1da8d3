"""`eval`: downstream tasks (lm-evaluation-harness) run on the live engine during training."""

from dataclasses import dataclass, field
from typing import List, Optional

from lmrepo.utils.errors import require


@dataclass
class EvalConfig:
    """The same tasks scripts/evaluate.py runs, on every rank through the training engine itself."""

    tasks: List[str] = field(default_factory=list)
    """lm-eval tasks: lmrepo's local ones (shakespeare_lastword, ...), task YAML paths, or harness names; [] = none"""
    every: int = 0
    """steps between downstream evaluations; 0 = only at the end of training"""
    limit: Optional[int] = None
    """documents per task (the first N); null = all"""
    batch_size: int = 8
    """requests per forward pass (every rank runs the same number of forwards: ZeRO-3 needs it)"""

    def check(self, dp_size: int) -> None:
        require(self.every >= 0, f"eval.every={self.every} must be >= 0 (0 = only at the end)")
        require(self.batch_size >= 1, f"eval.batch_size={self.batch_size} must be >= 1")
        require(
            self.limit is None or self.limit >= 1, f"eval.limit={self.limit} must be >= 1 (or null: every document)"
        )
        if not self.tasks:
            return
        # the harness deals documents round-robin: a rank without one would skip the forwards the others wait on
        require(
            self.limit is None or self.limit >= dp_size,
            f"eval.limit={self.limit} must be >= the {dp_size} data-parallel ranks (each needs a document), or null",
        )
