"""`optimizer`, `schedule`, `trainer`, `precision`, `metrics`: how the model is stepped."""

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import List, Optional

from lmrepo.utils.errors import require

# The `type` of the DeepSpeed scheduler section for schedule=wsd: lmrepo's own scheduler
# (lmrepo.optim.schedules), which DeepSpeed does not have.
WSD = "WarmupStableDecayLR"


class OptimizerName(StrEnum):
    adamw = "adamw"
    adam = "adam"
    muon = "muon"


class NSMethod(StrEnum):
    standard = "standard"
    gram = "gram"


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.adamw
    """adamw (decoupled weight decay) | adam (L2 penalty in the gradient) | muon (hidden matrices, AdamW the rest)"""
    lr: float = 1.0e-3
    """peak learning rate (muon: of the hidden matrices, in Keller Jordan's units)"""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam's moment decay rates [beta1, beta2] (muon: of its AdamW)"""
    eps: float = 1.0e-8
    """Adam's denominator epsilon (muon: of its AdamW)"""
    weight_decay: float = 0.1
    """decay on matrices (linear and embedding weights), not on biases and norms"""
    adam_lr: float = 1.0e-3
    """muon: peak learning rate of its AdamW (embeddings, LM head, norms, biases)"""
    momentum: float = 0.95
    """muon: momentum of the hidden matrices' updates (Nesterov, 5 Newton-Schulz steps: DeepSpeed's, fixed)"""
    ns_method: NSMethod = NSMethod.standard
    """muon: standard (Keller Jordan's quintic Newton-Schulz, bf16) | gram (DeepSpeed's Gram iteration, fp16)"""
    compile: Optional[bool] = None
    """muon: torch.compile its update; null = on CUDA only (on a CPU the compile costs more than it saves)"""

    def check(self) -> None:
        require(math.isfinite(self.lr) and self.lr > 0, f"optimizer.lr={self.lr} must be > 0")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optimizer.betas={list(self.betas)} must be two numbers in [0, 1), e.g. [0.9,0.95]",
        )
        require(self.eps > 0, f"optimizer.eps={self.eps} must be > 0")
        require(self.weight_decay >= 0, f"optimizer.weight_decay={self.weight_decay} must be >= 0")
        require(math.isfinite(self.adam_lr) and self.adam_lr > 0, f"optimizer.adam_lr={self.adam_lr} must be > 0")
        require(0 <= self.momentum < 1, f"optimizer.momentum={self.momentum} must be in [0, 1)")


class Decay(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"
    wsd = "wsd"


class DecayShape(StrEnum):
    linear = "linear"
    cosine = "cosine"
    one_minus_sqrt = "one_minus_sqrt"


# schedule.warmup_steps=null: this fraction of the run, at most WARMUP_CAP steps (the 300-step
# default job warms up over 30), so any trainer.max_steps >= 1 runs with the defaults.
WARMUP_FRACTION = 0.1
WARMUP_CAP = 30


@dataclass
class ScheduleConfig:
    name: Decay = Decay.cosine
    """after warmup: cosine (to lr x min_lr_ratio), linear (to 0), constant, wsd (stable, then decay_fraction decays)"""
    warmup_steps: Optional[int] = None
    """linear warmup from 0, in optimizer steps; null = 10% of trainer.max_steps, at most 30"""
    min_lr_ratio: float = 0.1
    """cosine, wsd: the final learning rate as a fraction of optimizer.lr"""
    decay_fraction: float = 0.2
    """wsd: the last fraction of trainer.max_steps, in which the rate decays (never inside the warmup)"""
    decay_shape: DecayShape = DecayShape.one_minus_sqrt
    """wsd: linear | cosine | one_minus_sqrt (1 - sqrt(progress), Hägele et al. 2024)"""

    def decay_steps(self, max_steps: int) -> int:
        return round(self.decay_fraction * max_steps)

    def resolved_warmup(self, max_steps: int) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(WARMUP_CAP, int(WARMUP_FRACTION * max_steps))

    def check(self, max_steps: int) -> None:
        require(
            self.warmup_steps is None or 0 <= self.warmup_steps < max_steps,
            f"schedule.warmup_steps={self.warmup_steps} must be in [0, trainer.max_steps={max_steps}): "
            "lower it, or leave it out (null: 10% of the run)",
        )
        require(0 <= self.min_lr_ratio <= 1, f"schedule.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        require(
            0 <= self.decay_fraction <= 1,
            f"schedule.decay_fraction={self.decay_fraction} must be in [0, 1] "
            "(0 = no decay, 1 = decay from the warmup's end)",
        )


class DeviceChoice(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class CompileBackend(StrEnum):
    inductor = "inductor"
    aot_eager = "aot_eager"
    aot_eager_decomp_partition = "aot_eager_decomp_partition"
    eager = "eager"


@dataclass
class TrainerConfig:
    max_steps: int = 300
    """optimizer steps"""
    micro_batch_size: Optional[int] = 8
    """sequences per rank per forward pass"""
    grad_accum: Optional[int] = None
    """micro batches per optimizer step; null = 1, or derived from global_batch_size (as DeepSpeed derives it)"""
    global_batch_size: Optional[int] = None
    """sequences per optimizer step, all ranks; null = micro x accum x data-parallel ranks, set = checked"""
    grad_clip: float = 1.0
    """global gradient-norm clip; 0 disables"""
    seed: int = 1234
    """seeds the weights, the data order and BERT's masking"""
    log_every: int = 10
    """steps between metrics lines"""
    eval_every: int = 100
    """steps between held-out evaluations; 0 = only at the end"""
    eval_batches: int = 8
    """micro batches per evaluation, per rank"""
    save_every: int = 0
    """steps between checkpoints (and one at the end); 0 = none"""
    keep_last: int = 0
    """checkpoints kept, newest first; 0 = all"""
    device: DeviceChoice = DeviceChoice.auto
    """auto (a GPU when one is visible) | cpu | cuda"""
    compile: Optional[bool] = None
    """torch.compile the model (the first step compiles); null = on a GPU for layouts it suits, CPU off"""
    compile_backend: CompileBackend = CompileBackend.inductor
    """torch.compile's backend: inductor (generated kernels) | aot_eager (the traced forward and backward run on
    ATen's kernels: for finding whether a problem is inductor's) | aot_eager_decomp_partition (inductor's graphs,
    decomposed and partitioned as inductor does, on ATen's kernels: whether it is inductor's kernels) | eager (the
    traced forward only)"""
    loss_tiles: int = 1
    """causal LMs: the LM head and loss in this many chunks of the sequence, logits recomputed in backward; 1 = off"""

    def check(self) -> None:
        require(self.max_steps >= 1, f"trainer.max_steps={self.max_steps} must be >= 1")
        for key in ("micro_batch_size", "grad_accum", "global_batch_size"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"trainer.{key}={value} must be >= 1 (or null to derive it)")
        require(
            self.micro_batch_size is not None or self.global_batch_size is not None,
            "trainer.micro_batch_size or trainer.global_batch_size must be set",
        )
        require(
            math.isfinite(self.grad_clip) and self.grad_clip >= 0,
            f"trainer.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)",
        )
        require(0 <= self.seed < 2**32, f"trainer.seed={self.seed} must be in [0, 2**32)")
        for key in ("log_every", "eval_batches", "loss_tiles"):
            require(getattr(self, key) >= 1, f"trainer.{key}={getattr(self, key)} must be >= 1")
        for key in ("eval_every", "save_every", "keep_last"):
            require(getattr(self, key) >= 0, f"trainer.{key}={getattr(self, key)} must be >= 0 (0 = off)")


class Dtype(StrEnum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


@dataclass
class PrecisionConfig:
    dtype: Dtype = Dtype.auto
    """auto (bf16 where the device computes it natively, else fp32) | fp32 | bf16 | fp16 (GPU, loss scaling)"""
    loss_scale: float = 0
    """fp16: 0 = dynamic loss scaling; > 0 a fixed scale"""
    initial_scale_power: int = 16
    """fp16: dynamic scaling starts at 2**this"""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the scale doubles"""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale halves"""
    min_loss_scale: float = 1
    """fp16: the scale never goes below this"""

    def check(self) -> None:
        require(self.loss_scale >= 0, f"precision.loss_scale={self.loss_scale} must be >= 0 (0 = dynamic)")
        require(
            0 <= self.initial_scale_power <= 64,
            f"precision.initial_scale_power={self.initial_scale_power} must be in [0, 64]",
        )
        for key in ("loss_scale_window", "hysteresis"):
            require(getattr(self, key) >= 1, f"precision.{key}={getattr(self, key)} must be >= 1")
        require(self.min_loss_scale > 0, f"precision.min_loss_scale={self.min_loss_scale} must be > 0")


@dataclass
class MetricsConfig:
    peak_tflops: Optional[float] = None
    """per-device dense peak TFLOP/s for MFU; null = from the GPU table (unknown on a CPU: MFU null)"""

    def check(self) -> None:
        require(self.peak_tflops is None or self.peak_tflops > 0, f"metrics.peak_tflops={self.peak_tflops} must be > 0")
