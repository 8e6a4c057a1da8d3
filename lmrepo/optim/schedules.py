"""Learning-rate schedulers by the `type` of a DeepSpeed `scheduler` section: DeepSpeed's own
classes (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, ...) and lmrepo's warmup-stable-decay,
which DeepSpeed does not have. Every engine builds its scheduler here from the same section, so
one schedule is one arithmetic whichever engine steps it."""

import math

from deepspeed.runtime import lr_schedules

from lmrepo.config.training import WSD, DecayShape

DECAY_SHAPES = tuple(str(shape) for shape in DecayShape)


class WarmupStableDecayLR:
    """Warmup, stable, decay (MiniCPM's WSD; Hägele et al. 2024, "Scaling Laws and Compute-Optimal
    Training Beyond Fixed Training Durations"): linear warmup from warmup_min_ratio to each group's
    own lr over warmup_num_steps, that lr held, then the last decay_num_steps steps of
    total_num_steps decay to min_ratio x lr in one of DECAY_SHAPES (1-sqrt is the paper's choice).

    Ratios of each parameter group's lr, as DeepSpeed's WarmupCosineLR: Muon's two groups (Muon
    and its AdamW) keep their own rates. DeepSpeed's conventions: step() after each optimizer
    step, the decay's progress counted as WarmupCosineLR counts its cosine's. State: the
    iteration only, so a resumed run continues mid-phase where it stopped."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_num_steps: int = 0,
        decay_num_steps: int = 0,
        decay_type: str = "one_minus_sqrt",
        warmup_min_ratio: float = 0.0,
        min_ratio: float = 0.0,
        last_batch_iteration: int = -1,
    ):
        if decay_type not in DECAY_SHAPES:
            raise ValueError(f"decay_type={decay_type!r} must be one of {', '.join(DECAY_SHAPES)}")
        if not 0 <= decay_num_steps <= total_num_steps or warmup_num_steps < 0:
            raise ValueError(
                f"decay_num_steps={decay_num_steps} must be in [0, total_num_steps={total_num_steps}] "
                f"and warmup_num_steps={warmup_num_steps} >= 0"
            )
        self.optimizer = lr_schedules.get_torch_optimizer(optimizer)
        self.total_num_steps, self.warmup_num_steps = total_num_steps, warmup_num_steps
        self.decay_num_steps, self.decay_type = decay_num_steps, decay_type
        self.warmup_min_ratio, self.min_ratio = warmup_min_ratio, min_ratio
        # The decay never starts inside the warmup.
        self.decay_start = max(warmup_num_steps, total_num_steps - decay_num_steps)
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = lr_schedules.update_lr(self.optimizer.param_groups, self.get_lr())

    def lr_ratio(self) -> float:
        step = max(0, self.last_batch_iteration)  # before the first step(): the first step's rate
        if step < self.warmup_num_steps:
            return self.warmup_min_ratio + (1 - self.warmup_min_ratio) * step / self.warmup_num_steps
        if step < self.decay_start or self.decay_num_steps == 0:
            return 1.0
        progress = min(1.0, (step - self.decay_start + 1) / (self.total_num_steps - self.decay_start))
        if self.decay_type == "linear":
            left = 1 - progress
        elif self.decay_type == "cosine":
            left = (1 + math.cos(math.pi * progress)) / 2
        else:
            left = 1 - math.sqrt(progress)
        return self.min_ratio + (1 - self.min_ratio) * left

    def get_lr(self) -> list[float]:
        ratio = self.lr_ratio()
        return [ratio * lr for lr in self.org_lrs]

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = lr_schedules.update_lr(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = lr_schedules.update_lr(self.optimizer.param_groups, self.get_lr())


def build_scheduler(optimizer, section: dict):
    """The scheduler a `scheduler` section names, on `optimizer`."""
    kind = WarmupStableDecayLR if section["type"] == WSD else getattr(lr_schedules, section["type"])
    return kind(optimizer, **section.get("params", {}))


def client_scheduler(ds_config: dict):
    """What deepspeed.initialize takes as `lr_scheduler` for this dict: a builder for lmrepo's own
    type (a client scheduler wins over the section, which DeepSpeed then never reads), else None
    (DeepSpeed builds its own class from the section)."""
    section = ds_config.get("scheduler") or {}
    if section.get("type") != WSD:
        return None
    return lambda optimizer: build_scheduler(optimizer, section)
