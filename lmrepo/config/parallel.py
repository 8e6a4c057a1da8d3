"""`zero`, `offload`, `pipeline`, `tp`, `checkpointing`: how the model and its states are split and saved."""

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

from lmrepo.utils.errors import ConfigError, require


class EngineName(StrEnum):
    deepspeed = "deepspeed"
    fsdp2 = "fsdp2"


@dataclass
class EngineConfig:
    """Which library shards and steps the model. The groups mean the same under both engines, or
    are refused in one line (lmrepo/engines/fsdp2.py says what each becomes under FSDP2)."""

    name: EngineName = EngineName.deepspeed
    """deepspeed (ZeRO 0-3, offload, pipelines, AutoTP) | fsdp2 (PyTorch FSDP2: fully_shard per block; tp=auto
    with torch's tensor-parallel styles)"""
    replicate: int | str = 1
    """fsdp2: HSDP, the data-parallel ranks as this many replicas, each sharding the model over the rest;
    nodes: one replica per node (the launcher's node count), sharding within each node"""

    def check(self) -> None:
        require(
            self.replicate == "nodes" or (str(self.replicate).isdigit() and int(self.replicate) >= 1),
            f"engine.replicate={self.replicate} must be a count >= 1 (1 = shard over every rank) or nodes "
            "(one replica per node)",
        )


@dataclass
class ZeroConfig:
    """DeepSpeed's `zero_optimization` keys, named as DeepSpeed names them; null = DeepSpeed's default."""

    stage: int = 0
    """0 (plain data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters) partitioned"""
    allgather_partitions: Optional[bool] = None
    """stages 1-2: all-gather updated parameters (else broadcast)"""
    allgather_bucket_size: Optional[float] = None
    """stages 1-2: elements per all-gather"""
    reduce_scatter: Optional[bool] = None
    """stage 2: reduce-scatter gradients instead of all-reduce"""
    reduce_bucket_size: Optional[float] = None
    """elements per gradient reduction"""
    overlap_comm: Optional[bool] = None
    """reduce gradients while backward still runs"""
    contiguous_gradients: Optional[bool] = None
    """copy gradients into one buffer: less fragmentation"""
    sub_group_size: Optional[float] = None
    """stage 3: elements per optimizer sub-group (bounds optimizer temporaries)"""
    stage3_prefetch_bucket_size: Optional[float] = None
    """stage 3: elements fetched ahead of use"""
    stage3_param_persistence_threshold: Optional[float] = None
    """stage 3: parameters with fewer elements stay gathered"""
    stage3_max_live_parameters: Optional[float] = None
    """stage 3: gathered elements held at once"""
    stage3_max_reuse_distance: Optional[float] = None
    """stage 3: keep a parameter gathered if reused within this many elements"""
    stage3_gather_16bit_weights_on_model_save: Optional[bool] = None
    """stage 3: save_16bit_model writes whole weights"""

    # Counts of elements, typed float so that 5e8 is accepted as DeepSpeed's docs write it.
    SIZES = (
        "allgather_bucket_size",
        "reduce_bucket_size",
        "sub_group_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
    )

    def check(self) -> None:
        require(self.stage in (0, 1, 2, 3), f"zero.stage={self.stage} is not 0-3: choose zero=stage0..stage3")
        for key in self.SIZES:
            value = getattr(self, key)
            require(
                value is None or (value >= 0 and value == int(value)),
                f"zero.{key}={value} must be a whole number of elements >= 0",
            )


class OffloadTarget(StrEnum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


@dataclass
class AioConfig:
    """DeepSpeed's `aio` section (NVMe reads and writes through libaio)."""

    block_size: int = 1048576
    """bytes per I/O request"""
    queue_depth: int = 8
    """requests in flight"""
    thread_count: int = 1
    """I/O threads per rank"""
    single_submit: bool = False
    """submit requests one at a time"""
    overlap_events: bool = True
    """overlap submitting and waiting"""


@dataclass
class OffloadConfig:
    target: OffloadTarget = OffloadTarget.none
    """none | cpu (ZeRO-Offload, stage >= 1) | nvme (ZeRO-Infinity, stage 3, needs libaio)"""
    params: Any = "auto"
    """offload parameters too: auto (at ZeRO-3) | true | false"""
    pin_memory: bool = True
    """page-locked host buffers: faster copies to and from the GPU"""
    nvme_path: Optional[str] = None
    """nvme: a directory on a fast local disk with room for the model states"""
    buffer_count: int = 5
    """nvme: parameter swap buffers"""
    buffer_size: float = 1.0e8
    """nvme: elements per parameter swap buffer"""
    aio: AioConfig = field(default_factory=AioConfig)
    """nvme: DeepSpeed's `aio` section"""

    def check(self) -> None:
        require(self.params in ("auto", True, False), f"offload.params={self.params} must be auto, true or false")
        require(
            self.target != OffloadTarget.nvme or bool(self.nvme_path), "offload.nvme_path must be set for offload=nvme"
        )
        require(
            self.buffer_count >= 1 and self.buffer_size >= 1,
            f"offload.buffer_count={self.buffer_count} and offload.buffer_size={self.buffer_size} must be >= 1",
        )

    def offloads_params(self, stage: int) -> bool:
        return self.target != OffloadTarget.none and (self.params is True or (self.params == "auto" and stage == 3))


# The engine that runs each schedule: DeepSpeed's PipelineEngine, or torch.distributed.pipelining.
PIPELINE_ENGINES = {
    "none": None,
    "1f1b": "deepspeed",
    "gpipe": "torch",
    "1f1b_torch": "torch",
    "interleaved": "torch",
    "interleaved_zb": "torch",
    "zbv": "torch",
    "dualpipev": "torch",
}
# OmegaConf matches an enum by member name, and "1f1b" is no Python identifier: the functional API.
Schedule = StrEnum("Schedule", {name: name for name in PIPELINE_ENGINES})
PIPELINE_FAMILIES = ("gpt2", "llama", "bert")
# a pipeline's transformer blocks (a mixture of experts' are Llama layers with an MoE MLP)
BLOCK_CLASSES = {"gpt2": "GPT2Block", "llama": "LlamaLayer", "mixtral": "LlamaLayer", "bert": "BertLayer"}
# Schedules whose ranks hold several model chunks: looped placement (rank r: chunks r, r + stages, ...).
LOOPED_SCHEDULES = ("interleaved", "interleaved_zb")
# the schedules that split a backward into its input- and weight-gradient halves
ZERO_BUBBLE_SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")
# Schedules of two chunks per rank in a V (rank r: chunks r and 2 x stages - 1 - r), Qi et al.'s ZB-V
# and DeepSeek's DualPipeV: the first and last chunk on one rank.
V_SCHEDULES = ("zbv", "dualpipev")


@dataclass
class PipelineConfig:
    schedule: Schedule = Schedule["none"]
    """none | 1f1b (DeepSpeed) | gpipe, 1f1b_torch, interleaved, interleaved_zb, zbv, dualpipev
    (torch.distributed.pipelining)"""
    stages: int = 1
    """pipeline ranks; world = stages x data-parallel degree"""
    partition: str = "blocks"
    """blocks (every stage an equal share of the transformer blocks) | parameters (balance parameter counts) |
    uniform (layer counts) | type:<layer class regex>"""
    virtual_stages: int = 1
    """model chunks per rank: interleaved, interleaved_zb >= 2; zbv, dualpipev exactly 2"""

    @property
    def engine(self) -> str | None:
        return PIPELINE_ENGINES[self.schedule]

    @property
    def partition_method(self) -> str:
        """What DeepSpeed's partitioner takes: `blocks` is a type: regex of every family's block
        class (a model's layer list holds its own family's only)."""
        return "type:" + "|".join(BLOCK_CLASSES.values()) if self.partition == "blocks" else self.partition

    def check(self) -> None:
        require(self.stages >= 1, f"pipeline.stages={self.stages} must be >= 1")
        require(
            self.schedule != "none" or self.stages == 1,
            f"pipeline.stages={self.stages} needs a pipeline schedule: choose a pipeline= option or set "
            "pipeline.stages=1",
        )
        require(self.virtual_stages >= 1, f"pipeline.virtual_stages={self.virtual_stages} must be >= 1")
        multi_chunk = self.schedule in LOOPED_SCHEDULES + V_SCHEDULES
        require(
            multi_chunk or self.virtual_stages == 1,
            f"pipeline.virtual_stages={self.virtual_stages} needs pipeline=interleaved, interleaved_zb, zbv "
            "or dualpipev (the other schedules hold one chunk per rank)",
        )
        require(
            self.schedule not in LOOPED_SCHEDULES or self.virtual_stages >= 2,
            f"pipeline={self.schedule} needs pipeline.virtual_stages >= 2 (model chunks per rank)",
        )
        require(
            self.schedule not in V_SCHEDULES or self.virtual_stages == 2,
            f"pipeline={self.schedule} places exactly two chunks per rank in a V: set pipeline.virtual_stages=2",
        )
        require(
            self.partition in ("blocks", "parameters", "uniform") or self.partition.startswith("type:"),
            f"pipeline.partition={self.partition} is not blocks, parameters, uniform or type:<layer class regex>",
        )
        if self.partition.startswith("type:"):
            try:
                re.compile(self.partition.removeprefix("type:"))
            except re.error as err:
                raise ConfigError(f"pipeline.partition={self.partition}: not a regular expression ({err})") from None


@dataclass
class ExpertParallelConfig:
    """How a mixture-of-experts model's experts are split (model.family=mixtral)."""

    size: int = 1
    """ranks that split each MoE layer's experts between them (DeepSpeed-MoE's ep_size); the
    data-parallel ranks are groups of this many, each group holding every expert once"""

    def check(self) -> None:
        require(self.size >= 1, f"expert_parallel.size={self.size} must be >= 1")


class TPMode(StrEnum):
    none = "none"
    auto = "auto"


@dataclass
class TPConfig:
    mode: TPMode = TPMode.none
    """none | auto (each layer's matrices split over tp.size ranks: DeepSpeed's AutoTP, or torch's
    tensor-parallel styles under engine=fsdp2)"""
    size: int = 1
    """tensor-parallel ranks per group; world = size x data-parallel ranks"""
    sequence_parallel: Optional[bool] = None
    """engine=fsdp2: Megatron's sequence parallelism, the norms and the residual stream between the
    split linears split by tokens over the tp ranks (their activations / tp, the same traffic);
    null = on where it runs (engine=fsdp2 without a pipeline, data.block_size divisible by
    tp.size, no eval.tasks). Not the sequence_parallel group (DeepSpeed Ulysses)"""
    loss_parallel: Optional[bool] = None
    """engine=fsdp2: the LM head split by vocabulary over the tp ranks and the cross-entropy taken
    on the split logits (torch's loss_parallel: the logits / tp, never gathered); null = on where
    it runs (engine=fsdp2 without a pipeline, untied embeddings)"""

    def check(self) -> None:
        if self.mode == TPMode.none:
            require(self.size == 1, f"tp.size={self.size} needs tp=auto: set tp=auto or tp.size=1")
        else:
            require(self.size >= 2, f"tp.size={self.size} must be >= 2 with tp=auto (or choose tp=none)")


@dataclass
class SequenceParallelConfig:
    """DeepSpeed Ulysses (Arctic Long Sequence Training): every sequence split over `size` ranks,
    swapped from tokens to heads around attention (lmrepo/distributed/sequence_parallel.py)."""

    size: int = 1
    """ranks that split each sequence (GPT-2, Llama); world = size x data-parallel ranks; 1 = off"""

    def check(self) -> None:
        require(self.size >= 1, f"sequence_parallel.size={self.size} must be >= 1 (1 = off)")


class CheckpointingImpl(StrEnum):
    deepspeed = "deepspeed"
    torch = "torch"


@dataclass
class CheckpointingConfig:
    """Activation checkpointing: blocks recompute their activations in backward."""

    enabled: bool = False
    """recompute activations in backward (~1/3 more compute, far less activation memory)"""
    every_n_layers: int = 1
    """checkpoint every n-th transformer block"""
    impl: CheckpointingImpl = CheckpointingImpl.deepspeed
    """deepspeed (deepspeed.checkpointing, ZeRO-R options) | torch (torch.utils.checkpoint)"""
    partition_activations: bool = False
    """ZeRO-R: split checkpoints across model-parallel ranks"""
    cpu_checkpointing: bool = False
    """ZeRO-R: keep checkpoints in CPU memory (needs partition_activations)"""
    contiguous_memory_optimization: bool = False
    """ZeRO-R: checkpoints into one buffer (needs number_checkpoints)"""
    number_checkpoints: Optional[int] = None
    """ZeRO-R: checkpoints per step, for the contiguous buffer"""
    synchronize_checkpoint_boundary: bool = False
    """ZeRO-R: synchronize at each checkpoint boundary"""

    def check(self, n_layer: int) -> None:
        if not self.enabled:
            return
        require(
            1 <= self.every_n_layers <= n_layer,
            f"checkpointing.every_n_layers={self.every_n_layers} must be in [1, {n_layer}] (the model's layers)",
        )
        if self.impl == CheckpointingImpl.deepspeed:
            self.check_zero_r(
                self.partition_activations,
                self.cpu_checkpointing,
                self.contiguous_memory_optimization,
                self.number_checkpoints,
                prefix="checkpointing.",
            )

    @staticmethod
    def check_zero_r(partition: bool, cpu: bool, contiguous: bool, number, prefix: str) -> None:
        """DeepSpeed's own rules for the ZeRO-R options, for lmrepo's keys and a user JSON's alike."""
        require(not cpu or partition, f"{prefix}cpu_checkpointing needs {prefix}partition_activations=true")
        require(
            not contiguous or (number and partition),
            f"{prefix}contiguous_memory_optimization needs {prefix}partition_activations=true "
            f"and {prefix}number_checkpoints",
        )
