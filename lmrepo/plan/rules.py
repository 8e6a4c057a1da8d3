"""The one table of what lmrepo refuses to combine, and why.

Each row names the techniques it is about, when it applies, the one line a user reads, and its
reason: `Upstream` (a library refuses the combination or computes it wrongly: which library, which
version, where) or `NotYet` (lmrepo has not built it). Validation reads this table and nothing
else refuses a combination: `check(job)` raises the first row that applies. Rules about one
technique's own values (a size that must be >= 1, heads that must divide) stay with its config.

The composition matrix (docs/reference/composition.md, `scripts/composition_matrix.py`) is made
from AXES, this table and the pairs the test suite runs (tests/composition.py).

A row with `pair=True` refuses every combination of its two axes; otherwise it refuses a setting
inside an allowed pair (a ZeRO stage, a size, a key) and the pair stays allowed.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from omegaconf import DictConfig

from lmrepo.config import TrainConfig, load
from lmrepo.config.parallel import ZERO_BUBBLE_SCHEDULES
from lmrepo.utils.errors import ConfigError

# --- the technique axes of the composition matrix --------------------------------------------------


@dataclass(frozen=True)
class Axis:
    label: str
    on: Callable  # TrainConfig -> bool
    overrides: tuple[str, ...]  # train.py overrides that turn it on (the composition tests' base job adds a model)


def _pipeline(engine: str) -> Callable:
    return lambda c: c.pipeline.schedule != "none" and c.pipeline.engine == engine


AXES: dict[str, Axis] = {
    "fsdp2": Axis("FSDP2", lambda c: c.engine.name == "fsdp2", ("engine=fsdp2",)),
    "zero3": Axis("ZeRO-3", lambda c: c.engine.name == "deepspeed" and c.zero.stage == 3, ("zero=stage3",)),
    "offload": Axis("CPU/NVMe offload", lambda c: str(c.offload.target) != "none", ("offload=cpu", "zero=stage2")),
    "ds_pipeline": Axis("DeepSpeed pipeline", _pipeline("deepspeed"), ("pipeline=1f1b", "pipeline.stages=2")),
    "torch_pipeline": Axis("torch pipeline", _pipeline("torch"), ("pipeline=gpipe", "pipeline.stages=2")),
    "autotp": Axis("tensor parallel", lambda c: str(c.tp.mode) == "auto", ("tp=auto", "tp.size=2")),
    "sequence_parallel": Axis(
        "sequence parallel", lambda c: c.sequence_parallel.size > 1, ("sequence_parallel.size=2",)
    ),
    "moe": Axis("MoE / expert parallel", lambda c: c.model.family == "mixtral", ("model=mixtral-tiny",)),
    "deepseek_moe": Axis(
        "DeepSeek routing (aux-free bias, shared experts)",
        lambda c: c.model.family == "mixtral" and (c.model.moe.balance == "aux_free" or c.model.moe.shared_experts > 0),
        ("model=mixtral-tiny", "model.moe.balance=aux_free", "model.moe.shared_experts=1"),
    ),
    "muon": Axis("Muon", lambda c: str(c.optimizer.name) == "muon", ("optimizer=muon",)),
    "tiled_loss": Axis("tiled loss", lambda c: c.trainer.loss_tiles > 1, ("trainer.loss_tiles=2",)),
    "document_masking": Axis(
        "document masking", lambda c: not c.data.cross_document_attention, ("data.cross_document_attention=false",)
    ),
    "compile": Axis("compile", lambda c: bool(c.trainer.compile), ("trainer.compile=true",)),
    "activation_checkpointing": Axis(
        "activation checkpointing", lambda c: c.checkpointing.enabled, ("checkpointing=full",)
    ),
    "bf16": Axis("bf16", lambda c: str(c.precision.dtype) == "bf16", ("precision=bf16",)),
}
# Pairs that are one choice, not two techniques: a job has one pipeline engine; DeepSeek's routing
# is a way to route a mixture of experts.
EXCLUSIVE = {frozenset(("ds_pipeline", "torch_pipeline")), frozenset(("moe", "deepseek_moe"))}
# An axis that is a kind of another: the other's rows refuse it too (a DeepSeek-routed job is a
# mixture of experts: every row about "moe" reads it as one).
KIND_OF = {"deepseek_moe": "moe"}


# --- the reasons -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Upstream:
    """A library refuses it, or computes it wrongly."""

    library: str  # name and version, e.g. "DeepSpeed 0.19.8"
    where: str  # the place that refuses or breaks

    def __str__(self) -> str:
        return f"upstream: {self.library}, {self.where}"


@dataclass(frozen=True)
class NotYet:
    """lmrepo has not built it."""

    what: str

    def __str__(self) -> str:
        return f"not yet: {self.what}"


# --- the table -------------------------------------------------------------------------------------


@dataclass
class Job:
    """What a rule looks at: the loaded config, and (checked again before launch) the final
    DeepSpeed dict with a user's JSON laid over it."""

    config: object  # TrainConfig
    ds: dict | None = None
    fix: Callable[[str, str], str] = field(default=lambda json_key, lmrepo_fix: lmrepo_fix)

    @property
    def stage(self) -> int:
        """The ZeRO stage the engine will run: the final dict's where there is one (a JSON may set it)."""
        if self.ds is not None:
            return self.ds.get("zero_optimization", {}).get("stage", 0)
        return self.config.zero.stage


@dataclass(frozen=True)
class Rule:
    techniques: tuple[str, ...]  # axes (AXES) or other settings it is about
    refuses: Callable[[Job], bool]
    message: Callable[[Job], str]
    reason: Upstream | NotYet
    pair: bool = False  # refuses its two axes together, as the composition matrix turns them on
    final: bool = False  # reads the final DeepSpeed dict: checked before launch, not when the config loads


def on(job: Job, *axes: str) -> bool:
    return all(AXES[a].on(job.config) for a in axes)


def _c(job: Job):
    return job.config


PIPELINES = ("ds_pipeline", "torch_pipeline")


def _with_pipelines(
    technique: str,
    message: Callable[[Job], str],
    reason: "Upstream | NotYet",
    refuses: Callable[[Job, str], bool] | None = None,
    final: bool = False,
) -> list["Rule"]:
    """A technique neither pipeline engine takes: one row per pipeline (each pair refused by its
    own row) with the same message and reason. `refuses(job, pipeline)` where the technique is
    read otherwise than by its axis (Muon: from the final DeepSpeed dict)."""
    refuses = refuses or (lambda j, pipe: on(j, technique, pipe))
    return [
        Rule((technique, pipe), lambda j, pipe=pipe: refuses(j, pipe), message, reason, pair=True, final=final)
        for pipe in PIPELINES
    ]


DS = "DeepSpeed 0.19.8"
TORCH = "torch 2.13"
FSDP_OTHER = "or choose engine=deepspeed"
SP_OFF = "or set sequence_parallel.size=1"
MUON_OTHER = "or optimizer=adamw"
MUON_SCHEDULES = "choose schedule=cosine or schedule=wsd (decay_fraction=0: constant, 1: linear decay)"
TORCH_PIPE = "pipeline={s} (torch.distributed.pipelining)"


def _sp(job: Job) -> str:
    return f"sequence_parallel.size={_c(job).sequence_parallel.size}"


def _tiles(job: Job) -> str:
    return f"trainer.loss_tiles={_c(job).trainer.loss_tiles}"


def _torch_pipe(job: Job) -> str:
    return TORCH_PIPE.format(s=_c(job).pipeline.schedule)


def _embedding(job: Job) -> int:
    shape = _c(job).model.shape()
    return shape["vocab_size"] * shape["n_embd"]


def _bucket(job: Job) -> float:
    return _c(job).zero.reduce_bucket_size or 5e8  # DeepSpeed's default


def _zero_r(job: Job) -> list[str]:
    keys = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
    return [k for k in keys if getattr(_c(job).checkpointing, k)]


RULES: list[Rule] = [
    # --- FSDP2
    Rule(
        ("fsdp2", "zero"),
        lambda j: on(j, "fsdp2") and _c(j).zero.stage < 2,
        lambda j: (
            f"engine=fsdp2 has no counterpart of zero=stage{_c(j).zero.stage} (FSDP2 shards parameters, gradients "
            "and optimizer states together): choose zero=stage3 (parameters resharded after forward) or zero=stage2 "
            "(kept "
            f"gathered until backward), {FSDP_OTHER}"
        ),
        Upstream(TORCH, "fully_shard shards parameters, gradients and optimizer states together (no ZeRO-0/1 mode)"),
    ),
    Rule(
        ("fsdp2", "offload"),
        lambda j: on(j, "fsdp2") and str(_c(j).offload.target) == "nvme",
        lambda j: f"engine=fsdp2 offloads to CPU memory only: choose offload=cpu or offload=none, {FSDP_OTHER}",
        Upstream(TORCH, "FSDP2's OffloadPolicy has CPUOffloadPolicy only"),
    ),
    Rule(
        ("fsdp2", "offload"),
        lambda j: on(j, "fsdp2", "offload") and _c(j).offload.params is False,
        lambda j: (
            "engine=fsdp2 offloads parameters, gradients and optimizer states together (CPUOffloadPolicy): "
            f"drop offload.params=false, {FSDP_OTHER}"
        ),
        Upstream(TORCH, "CPUOffloadPolicy offloads the sharded parameters with their gradients and states"),
    ),
    Rule(
        ("fsdp2", "ds_pipeline"),
        lambda j: on(j, "fsdp2", "ds_pipeline"),
        lambda j: f"engine=fsdp2 runs without a pipeline: choose pipeline=none, {FSDP_OTHER}",
        Upstream(DS, "PipelineModule runs inside DeepSpeed's own engine"),
        pair=True,
    ),
    Rule(
        ("fsdp2", "zero-bubble pipeline"),
        lambda j: on(j, "fsdp2", "torch_pipeline") and _c(j).pipeline.schedule in ZERO_BUBBLE_SCHEDULES,
        lambda j: (
            f"engine=fsdp2 with pipeline={_c(j).pipeline.schedule}: FSDP2 reduces the gradients before this "
            "zero-bubble schedule's deferred weight gradients (a gradient norm 29% low, measured): choose "
            "pipeline=gpipe, 1f1b_torch or interleaved, or engine=deepspeed"
        ),
        Upstream(
            TORCH,
            "pipelining's zero-bubble schedules compute weight gradients past data parallelism's reduction "
            "(the mechanism of pytorch/pytorch#144530, open for DDP)",
        ),
    ),
    Rule(
        ("fsdp2", "deepspeed_config"),
        lambda j: on(j, "fsdp2") and _c(j).deepspeed_config is not None,
        lambda j: (
            f"deepspeed_config={_c(j).deepspeed_config} configures DeepSpeed's engine, not FSDP2: drop it, {FSDP_OTHER}"
        ),
        Upstream(TORCH, "FSDP2 reads no DeepSpeed JSON"),
    ),
    Rule(
        ("fsdp2", "fp16"),
        lambda j: on(j, "fsdp2") and str(_c(j).precision.dtype) == "fp16",
        lambda j: (
            "engine=fsdp2 trains in fp32 or bf16 (fp16 would need a sharded gradient scaler): choose "
            "precision=bf16, " + FSDP_OTHER
        ),
        NotYet("a sharded gradient scaler for fp16"),
    ),
    Rule(
        ("fsdp2", "zero_init"),
        lambda j: on(j, "fsdp2") and _c(j).model.zero_init,
        lambda j: f"model.zero_init is DeepSpeed's zero.Init: set it to false, {FSDP_OTHER}",
        Upstream(DS, "zero.Init partitions for DeepSpeed's ZeRO-3 engine"),
    ),
    Rule(
        ("fsdp2", "activation_checkpointing"),
        lambda j: on(j, "fsdp2", "activation_checkpointing") and bool(_zero_r(j)),
        lambda j: (
            f"checkpointing.{_zero_r(j)[0]} is a ZeRO-R option of DeepSpeed's activation checkpointing; under "
            f"engine=fsdp2 blocks recompute with torch.utils.checkpoint: drop it, {FSDP_OTHER}"
        ),
        Upstream(DS, "ZeRO-R's options belong to deepspeed.checkpointing"),
    ),
    Rule(
        ("hsdp", "deepspeed"),
        lambda j: _c(j).engine.replicate != 1 and _c(j).engine.name != "fsdp2",
        lambda j: (
            f"engine.replicate={_c(j).engine.replicate} replicates FSDP2's shards (HSDP): choose engine=fsdp2, "
            "or set engine.replicate=1 (DeepSpeed's ZeRO shards over every data-parallel rank)"
        ),
        NotYet("DeepSpeed's hierarchical partitioning (ZeRO++ hpZ) as a layout"),
    ),
    # --- document masking, the tiled loss
    Rule(
        ("document_masking", "bert"),
        lambda j: on(j, "document_masking") and _c(j).model.family == "bert",
        lambda j: (
            "data.cross_document_attention=false keeps causal documents apart; model.family=bert attends both "
            "ways and has no per-document mask here: choose a gpt2 or llama model, or set "
            "data.cross_document_attention=true"
        ),
        NotYet("a per-document bidirectional mask for BERT"),
    ),
    Rule(
        ("tiled_loss", "bert"),
        lambda j: on(j, "tiled_loss") and _c(j).model.family == "bert",
        lambda j: f"{_tiles(j)} tiles a causal LM's loss, not model.family=bert's masked one: set trainer.loss_tiles=1",
        NotYet("a tiled masked-LM loss"),
    ),
    Rule(
        ("tiled_loss", "ds_pipeline"),
        lambda j: on(j, "tiled_loss", "ds_pipeline"),
        lambda j: (
            f"{_tiles(j)} does not combine with pipeline={_c(j).pipeline.schedule} (DeepSpeed's PipelineModule "
            "computes the loss from its last layer's whole logits): set trainer.loss_tiles=1, or choose a torch "
            "pipeline (pipeline=gpipe, 1f1b_torch, interleaved), whose last stage applies the head by tiles"
        ),
        NotYet("the tiled loss as the last stage of DeepSpeed's PipelineModule"),
        pair=True,
    ),
    # --- sequence parallelism (Ulysses)
    Rule(
        ("sequence_parallel", "bert"),
        lambda j: on(j, "sequence_parallel") and _c(j).model.family == "bert",
        lambda j: f"{_sp(j)} splits causal models (GPT-2, Llama), not model.family=bert (bidirectional): {SP_OFF}",
        NotYet("the sliced sequence and loss of a bidirectional masked LM"),
    ),
    Rule(
        ("sequence_parallel", "ds_pipeline"),
        lambda j: on(j, "sequence_parallel", "ds_pipeline"),
        lambda j: (
            f"{_sp(j)} does not combine with DeepSpeed's pipeline=1f1b: choose a torch pipeline (pipeline=gpipe, "
            f"1f1b_torch, interleaved), or pipeline=none, {SP_OFF}"
        ),
        NotYet("sequence-parallel groups inside the stages of DeepSpeed's PipelineModule"),
        pair=True,
    ),
    Rule(
        ("sequence_parallel", "autotp"),
        lambda j: on(j, "sequence_parallel", "autotp"),
        lambda j: f"{_sp(j)} does not combine with tensor parallelism: choose tp=none, {SP_OFF}",
        NotYet("a sequence x tensor layout for Ulysses and AutoTP"),
        pair=True,
    ),
    Rule(
        ("sequence_parallel", "eval.tasks"),
        lambda j: on(j, "sequence_parallel") and bool(_c(j).eval.tasks),
        lambda j: (
            f"{_sp(j)}: eval.tasks runs lm-eval on whole sequences, which a sequence-parallel model cannot take: "
            "run scripts/evaluate.py on a checkpoint instead (drop eval.tasks), " + SP_OFF
        ),
        NotYet("lm-eval on a sequence-parallel model"),
    ),
    Rule(
        ("sequence_parallel", "zero3"),
        lambda j: on(j, "sequence_parallel", "zero3") and _c(j).zero.reduce_scatter is True,
        lambda j: (
            f"{_sp(j)} with zero=stage3 reduces gradients without zero.reduce_scatter (DeepSpeed's reduce-scatter "
            f"divides the sequence-parallel gradients by {_c(j).sequence_parallel.size}): drop zero.reduce_scatter=true"
        ),
        Upstream(DS, "stage3.py's reduce-scatter averages over every rank, where sequence-parallel gradients sum"),
    ),
    Rule(
        ("sequence_parallel", "zero3"),
        lambda j: on(j, "sequence_parallel", "zero3") and _c(j).zero.contiguous_gradients is False,
        lambda j: (
            f"{_sp(j)} with zero=stage3 needs zero.contiguous_gradients (DeepSpeed's reduce-scatter divides the "
            f"sequence-parallel gradients by {_c(j).sequence_parallel.size}): drop zero.contiguous_gradients=false"
        ),
        Upstream(DS, "stage3.py's reduce-scatter averages over every rank, where sequence-parallel gradients sum"),
    ),
    Rule(
        ("sequence_parallel", "zero3"),
        lambda j: on(j, "sequence_parallel", "zero3") and _embedding(j) > _bucket(j),
        lambda j: (
            f"{_sp(j)} with zero=stage3: the embedding's "
            f"{_embedding(j)} elements exceed zero.reduce_bucket_size={_bucket(j):.0f}, which sends it through "
            "DeepSpeed's reduce-scatter (gradients "
            "divided by the group size): raise zero.reduce_bucket_size"
        ),
        Upstream(DS, "stage3.py sends a gradient larger than reduce_bucket_size through its reduce-scatter"),
    ),
    # --- mixture of experts (DeepSpeed-MoE)
    Rule(
        ("moe", "zero3"),
        lambda j: on(j, "moe", "zero3"),
        lambda j: (
            "model.family=mixtral with zero=stage3: DeepSpeed refuses its native MoE under ZeRO-3; choose "
            "zero=stage1 or zero=stage2 (optimizer states, gradients partitioned)"
        ),
        Upstream(DS, "runtime/engine.py asserts that MoE layers are not used with ZeRO-3"),
        pair=True,
    ),
    Rule(
        ("moe", "torch_pipeline"),
        lambda j: on(j, "moe", "torch_pipeline") and _c(j).expert_parallel.size > 1,
        lambda j: (
            f"expert_parallel.size={_c(j).expert_parallel.size} with pipeline={_c(j).pipeline.schedule}: a torch "
            "pipeline's stages hold every expert of their MoE layers; choose expert_parallel.size=1, or "
            "pipeline=none"
        ),
        NotYet("expert parallelism inside pipeline stages"),
    ),
    Rule(
        ("moe", "zero"),
        lambda j: on(j, "moe") and _c(j).zero.stage == 0 and _c(j).expert_parallel.size > 1,
        lambda j: (
            f"expert_parallel.size={_c(j).expert_parallel.size} with zero=stage0: DeepSpeed's ZeRO-0 clips with a "
            "gradient norm that leaves out the other ranks' experts (its ZeRO-1/2 norm counts them); choose "
            "zero=stage1 or "
            "zero=stage2, or expert_parallel.size=1"
        ),
        Upstream(DS, "ZeRO-0's clip_grad_norm_ reduces the expert norm over the data-parallel group only"),
    ),
    Rule(
        ("moe", "ds_pipeline"),
        lambda j: on(j, "moe", "ds_pipeline"),
        lambda j: (
            f"model.family=mixtral with pipeline={_c(j).pipeline.schedule}: DeepSpeed's PipelineModule does not "
            "take DeepSpeed-MoE layers here; choose a torch pipeline (pipeline=gpipe, 1f1b_torch, interleaved), or "
            "pipeline=none"
        ),
        NotYet("MoE layers in the stages of DeepSpeed's PipelineModule"),
        pair=True,
    ),
    Rule(
        ("moe", "autotp"),
        lambda j: on(j, "moe", "autotp") and not on(j, "fsdp2"),
        lambda j: (
            "model.family=mixtral with tp=auto: AutoTP does not split DeepSpeed-MoE experts; choose tp=none "
            "(expert_parallel.size splits the experts), or engine=fsdp2 (torch's styles split attention and "
            "the dense MLPs)"
        ),
        Upstream(DS, "AutoTP's module inspection does not split deepspeed.moe.layer.MoE's experts"),
        pair=True,
    ),
    Rule(
        ("moe", "sequence_parallel"),
        lambda j: on(j, "moe", "sequence_parallel"),
        lambda j: (
            f"model.family=mixtral with {_sp(j)}: not supported for mixture-of-experts models yet; set "
            "sequence_parallel.size=1"
        ),
        NotYet("the load-balancing loss summed over a sequence-parallel group"),
        pair=True,
    ),
    Rule(
        ("moe", "muon"),
        lambda j: on(j, "moe", "muon") and not on(j, "fsdp2"),
        lambda j: (
            "model.family=mixtral with optimizer=muon on DeepSpeed's engine: its Muon is not verified with "
            "DeepSpeed-MoE's expert parameter groups; choose engine=fsdp2 (Muon over the sharded experts, each "
            "matrix orthogonalised whole), or optimizer=adamw"
        ),
        NotYet("Muon over DeepSpeed-MoE's expert parameter groups (engine=fsdp2 runs the pair)"),
    ),
    # --- tensor parallelism (AutoTP; torch's styles under engine=fsdp2), pipelines, compile
    Rule(
        ("autotp", "ds_pipeline"),
        lambda j: on(j, "autotp", "ds_pipeline"),
        lambda j: (
            "tp=auto does not combine with DeepSpeed's pipeline here: choose tp=none or pipeline=none, or a torch "
            "pipeline (pipeline=gpipe, 1f1b_torch, interleaved) with engine=fsdp2"
        ),
        NotYet("AutoTP groups inside the stages of DeepSpeed's PipelineModule"),
        pair=True,
    ),
    Rule(
        ("autotp", "torch_pipeline"),
        lambda j: on(j, "autotp", "torch_pipeline") and not on(j, "fsdp2"),
        lambda j: (
            f"tp=auto with {_torch_pipe(j)} on DeepSpeed's engine: choose engine=fsdp2 (torch's tensor-parallel "
            "styles inside the stages), tp=none or pipeline=none"
        ),
        NotYet("AutoTP groups inside torch pipeline stages on DeepSpeed's engine (engine=fsdp2 runs the pair)"),
    ),
    Rule(
        ("compile", "ds_pipeline"),
        lambda j: on(j, "compile", "ds_pipeline"),
        lambda j: (
            f"trainer.compile=true is not supported with pipeline={_c(j).pipeline.schedule} (DeepSpeed's "
            "PipelineModule): set trainer.compile=false, or choose a torch pipeline (pipeline=gpipe, 1f1b_torch, "
            "interleaved), whose stages compile block by block"
        ),
        NotYet("compiled stages of DeepSpeed's PipelineModule"),
        pair=True,
    ),
    # --- in-loop downstream evaluation (eval.tasks)
    Rule(
        ("eval.tasks", "bert"),
        lambda j: bool(_c(j).eval.tasks) and _c(j).model.family == "bert",
        lambda j: (
            "eval.tasks: lm-eval scores causal language models; BERT (a masked LM) is not supported: leave "
            "eval.tasks empty"
        ),
        Upstream("lm-evaluation-harness 0.4.13", "its loglikelihood requests score causal continuations"),
    ),
    Rule(
        ("eval.tasks", "pipeline"),
        lambda j: bool(_c(j).eval.tasks) and _c(j).pipeline.schedule != "none",
        lambda j: (
            f"eval.tasks with pipeline={_c(j).pipeline.schedule}: no stage holds the whole model to score "
            "with; evaluate a checkpoint after training (python scripts/evaluate.py run=RUN)"
        ),
        NotYet("lm-eval requests run through the pipeline's stages"),
    ),
    # --- the model AutoTP (under engine=fsdp2: transformers' tensor-parallel plan) is asked about,
    # on a meta-device copy (before the layout: more ranks would not help); then the rows checked
    # on the final DeepSpeed dict (a user's JSON may set the stage, the optimizer)
    Rule(
        ("autotp", "model family"),
        lambda j: on(j, "autotp") and not on(j, "fsdp2") and _autotp_refusal(j) is not None,
        lambda j: (
            f'tp=auto: DeepSpeed\'s AutoTP refuses {_autotp_refusal(j)[0]} ("{_autotp_refusal(j)[1]}"): use '
            "tp=none (ZeRO shards its states instead) or a model=llama-* preset"
        ),
        Upstream(DS, "module_inject/auto_tp.py refuses a model that has a kernel-injection policy (GPT-2, BERT)"),
    ),
    Rule(
        ("fsdp2", "autotp", "model family"),
        lambda j: on(j, "fsdp2", "autotp") and _torch_tp_refusal(j) is not None,
        lambda j: (
            f"engine=fsdp2 with tp=auto splits the linears of transformers' tensor-parallel plan, and "
            f"{_torch_tp_refusal(j)} has none here: choose a model=llama-* preset, or tp=none"
        ),
        NotYet("torch tensor-parallel plans for GPT-2 (its fused c_attn) and BERT; transformers 5.23 ships none"),
    ),
    # --- engine=fsdp2's further tensor-parallel splits (tp.sequence_parallel, tp.loss_parallel): on
    # by default where they run; set to true elsewhere, one line
    Rule(
        ("tp.sequence_parallel, tp.loss_parallel", "engine=deepspeed"),
        lambda j: bool(_asked_splits(j)) and not on(j, "fsdp2", "autotp"),
        lambda j: (
            f"{_asked_splits(j)} is a split of engine=fsdp2's tensor parallelism (torch's styles): choose "
            "engine=fsdp2 tp=auto, or drop it"
        ),
        NotYet("sequence-parallel norms and a vocabulary-parallel loss beside DeepSpeed's AutoTP (it splits linears)"),
    ),
    Rule(
        ("tp.sequence_parallel, tp.loss_parallel", "torch_pipeline"),
        lambda j: bool(_asked_splits(j)) and on(j, "torch_pipeline"),
        lambda j: f"{_asked_splits(j)} does not combine with a pipeline here: drop it, or choose pipeline=none",
        NotYet("token-split activations sent between pipeline stages, a vocabulary-split head on the last stage"),
    ),
    Rule(
        ("tp.sequence_parallel", "data.block_size"),
        lambda j: _c(j).tp.sequence_parallel is True and _c(j).data.block_size % _c(j).tp.size != 0,
        lambda j: (
            f"tp.sequence_parallel=true splits each sequence over tp.size={_c(j).tp.size} ranks, and "
            f"data.block_size={_c(j).data.block_size} does not divide by it: choose a block size divisible by "
            f"{_c(j).tp.size}, or tp.sequence_parallel=false"
        ),
        NotYet("uneven token splits (each rank's norms on its own token count)"),
    ),
    Rule(
        ("tp.sequence_parallel", "eval.tasks"),
        lambda j: _c(j).tp.sequence_parallel is True and bool(_c(j).eval.tasks),
        lambda j: (
            "tp.sequence_parallel=true splits every sequence evenly over the tp ranks, and eval.tasks' requests "
            "have any length (generation: one token at a time): set tp.sequence_parallel=false, or evaluate a "
            "checkpoint after training (python scripts/evaluate.py run=RUN)"
        ),
        NotYet("lm-eval requests of any length through token-split blocks"),
    ),
    Rule(
        ("tp.loss_parallel", "tied embeddings"),
        lambda j: _c(j).tp.loss_parallel is True and _tied_head(j),
        lambda j: (
            "tp.loss_parallel=true splits the LM head by vocabulary, and this model ties it to the input "
            "embedding, which stays whole: set model.tie_embeddings=false, or tp.loss_parallel=false"
        ),
        NotYet("a vocabulary-parallel input embedding, for a head tied to it"),
    ),
    Rule(
        ("ds_pipeline", "zero3"),
        lambda j: on(j, "ds_pipeline") and j.stage > 1,
        lambda j: (
            f"the DeepSpeed pipeline (pipeline={_c(j).pipeline.schedule}) supports ZeRO stage 0 or 1, not "
            f"{j.stage}: {j.fix('zero_optimization.stage', '') or 'set zero=stage0 or stage1'}"
        ),
        Upstream(DS, "runtime/pipe/engine.py asserts ZeRO stage < 2"),
        pair=True,
        final=True,
    ),
    Rule(
        ("torch_pipeline", "deepspeed_config"),
        lambda j: on(j, "torch_pipeline") and _c(j).deepspeed_config is not None,
        lambda j: (
            f"{_torch_pipe(j)} is not a DeepSpeed engine: deepspeed_config does not apply to it; use "
            "pipeline=1f1b, or leave deepspeed_config out"
        ),
        Upstream(TORCH, "torch.distributed.pipelining reads no DeepSpeed JSON"),
        final=True,
    ),
    Rule(
        ("torch_pipeline", "offload"),
        lambda j: (
            on(j, "torch_pipeline")
            and not on(j, "fsdp2")
            and j.ds is not None
            and j.ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
        ),
        lambda j: (
            f"{_torch_pipe(j)} on DeepSpeed's engine does not offload: set offload=none, choose engine=fsdp2 (each "
            "stage's shards offloaded to CPU memory), or pipeline=1f1b"
        ),
        NotYet("offloaded stages of torch's schedules on DeepSpeed's engine (engine=fsdp2 runs the pair)"),
        final=True,
    ),
    Rule(
        ("torch_pipeline", "zero3"),
        lambda j: on(j, "torch_pipeline") and not on(j, "fsdp2") and j.stage != 0,
        lambda j: (
            f"{_torch_pipe(j)} runs DeepSpeed's ZeRO stage 0 only, not {j.stage}: set zero=stage0, engine=fsdp2 "
            "(each stage sharded over its data-parallel ranks), or pipeline=1f1b for DeepSpeed's pipeline with ZeRO-1"
        ),
        NotYet("DeepSpeed's ZeRO optimizer under torch's schedules (engine=fsdp2 shards the stages)"),
        pair=True,
        final=True,
    ),
    Rule(
        ("torch_pipeline", "fp16"),
        lambda j: on(j, "torch_pipeline") and j.ds is not None and j.ds.get("fp16", {}).get("enabled") in (True, 1),
        lambda j: f"{_torch_pipe(j)} runs fp32 or bf16: set precision=bf16, or pipeline=1f1b for fp16",
        NotYet("a gradient scaler across pipeline stages"),
        final=True,
    ),
    # --- offload needs ZeRO: read from the final dict, where a user's JSON may set the stage or the device
    Rule(
        ("offload", "zero"),
        lambda j: _offloaded(j, "offload_optimizer") == "nvme" and j.stage != 3,
        lambda j: (
            f"NVMe offload (ZeRO-Infinity) needs ZeRO-3 (it is stage {j.stage}): "
            f"{j.fix('zero_optimization.stage', '') or 'set zero=stage3, or offload=cpu'}"
        ),
        Upstream(DS, "stage_1_and_2.py takes any offload_optimizer device for the CPU; NVMe is stage3.py's"),
        final=True,
    ),
    Rule(
        ("offload", "zero"),
        lambda j: _offloaded(j, "offload_optimizer") != "none" and j.stage == 0,
        lambda j: (
            f"optimizer offload to {_offloaded(j, 'offload_optimizer')} needs ZeRO stage >= 1: "
            + j.fix(
                "zero_optimization.offload_optimizer",
                j.fix("zero_optimization.stage", "") or "set zero=stage1, stage2 or stage3, or offload=none",
            )
        ),
        Upstream(DS, "engine.py builds ZeRO's optimizer, the one that offloads, for stage 1 and above only"),
        final=True,
    ),
    Rule(
        ("offload", "zero"),
        lambda j: _offloaded(j, "offload_param") != "none" and j.stage != 3,
        lambda j: (
            f"parameter offload to {_offloaded(j, 'offload_param')} needs ZeRO-3: "
            + j.fix(
                "zero_optimization.offload_param",
                j.fix("zero_optimization.stage", "") or "set zero=stage3, or offload.params=false",
            )
        ),
        Upstream(
            DS, "engine.py hands offload_param to stage3.py alone (ZeRO-3 is the stage that partitions parameters)"
        ),
        final=True,
    ),
    # --- Muon (DeepSpeed's, lmrepo's role split)
    Rule(
        ("muon", "ds_pipeline"),
        lambda j: _is_muon(j) and on(j, "ds_pipeline"),
        lambda j: (
            f"optimizer=muon with pipeline={_c(j).pipeline.schedule} (DeepSpeed's PipelineModule): its engine "
            "builds no Muon/AdamW split per stage; choose a torch pipeline (pipeline=gpipe, 1f1b_torch, "
            f"interleaved), whose stages split by role, or pipeline=none, {MUON_OTHER}"
        ),
        NotYet("a Muon/AdamW split per stage of DeepSpeed's PipelineModule"),
        pair=True,
        final=True,
    ),
    Rule(
        ("muon", "autotp"),
        lambda j: _is_muon(j) and not on(j, "fsdp2") and j.ds.get("tensor_parallel", {}).get("autotp_size", 1) > 1,
        lambda j: (
            "optimizer=muon with tp=auto on DeepSpeed's engine would orthogonalise each rank's shard of a matrix, "
            f"not the matrix: choose engine=fsdp2 (each matrix gathered whole), tp=none, {MUON_OTHER}"
        ),
        NotYet("gathering each AutoTP matrix for the orthogonalisation (engine=fsdp2 runs the pair)"),
        final=True,
    ),
    Rule(
        ("muon", "zero"),
        lambda j: _is_muon(j) and not on(j, "fsdp2") and j.stage != 0 and bool(j.ds.get("gradient_clipping")),
        lambda j: (
            f"optimizer=muon with ZeRO stage {j.stage}: DeepSpeed's ZeRO clips Muon's orthogonalised update "
            "there, not the gradient, so trainer.grad_clip would not mean what it means at stage 0: "
            f"{j.fix('gradient_clipping', 'set trainer.grad_clip=0, or zero=stage0')}"
        ),
        Upstream(DS, "ZeRO's Muon writes the orthogonalised update into the gradient before clipping"),
        final=True,
    ),
    Rule(
        ("muon", "zero3"),
        lambda j: (
            _is_muon(j)
            and not on(j, "fsdp2")
            and j.stage == 3
            and j.ds["zero_optimization"].get("reduce_scatter", True)
        ),
        lambda j: (
            "DeepSpeed's Muon under ZeRO-3 needs whole gradients (no reduce-scatter): "
            f"{j.fix('zero_optimization.reduce_scatter', 'set zero.reduce_scatter=false, or leave it null')}"
        ),
        Upstream(DS, "stage3.py's Muon orthogonalises the gradient partition a reduce-scatter leaves"),
        final=True,
    ),
    Rule(
        ("muon", "schedule"),
        lambda j: _is_muon(j) and j.ds.get("scheduler", {}).get("type") in ("WarmupLR", "WarmupDecayLR"),
        lambda j: (
            f"{j.ds['scheduler']['type']} sets one absolute learning rate for every parameter group, and Muon's two "
            "halves have their own (optimizer.lr, optimizer.adam_lr): "
            f"{j.fix('scheduler', MUON_SCHEDULES)}"
        ),
        Upstream(DS, "WarmupLR and WarmupDecayLR write absolute rates into every parameter group"),
        final=True,
    ),
]


def _autotp_refusal(job: Job) -> tuple[str, str] | None:
    """(the model class, AutoTP's words) when DeepSpeed's AutoTP refuses to shard this model, asked
    up front on a meta-device model; None when it shards it."""
    if not hasattr(job, "_autotp"):
        from lmrepo.distributed.tp import autotp_refusal
        from lmrepo.models import meta_model

        model = meta_model(_c(job).model)
        refusal = autotp_refusal(model)
        job._autotp = None if refusal is None else (type(model).__name__, refusal)
    return job._autotp


def _torch_tp_refusal(job: Job) -> str | None:
    """The model class when engine=fsdp2 has no tensor-parallel plan for it (lmrepo.distributed.tp.block_tp_plan),
    asked on a meta-device model; None when it has one."""
    if not hasattr(job, "_torch_tp"):
        from lmrepo.distributed.tp import block_tp_plan
        from lmrepo.models import meta_model

        model = meta_model(_c(job).model)
        job._torch_tp = None if block_tp_plan(model) else type(model).__name__
    return job._torch_tp


def _asked_splits(job: Job) -> str:
    """The tp.sequence_parallel / tp.loss_parallel a user set to true, as the words they wrote."""
    tp = _c(job).tp
    return " ".join(f"tp.{key}=true" for key in ("sequence_parallel", "loss_parallel") if getattr(tp, key) is True)


def _tied_head(job: Job) -> bool:
    from lmrepo.distributed.tp import tied_head  # torch, imported once a tensor-parallel rule asks

    return tied_head(_c(job))


def _offloaded(job: Job, section: str) -> str:
    """Where the final dict offloads `section` (offload_optimizer, offload_param): none, cpu or nvme."""
    return job.ds.get("zero_optimization", {}).get(section, {}).get("device", "none")


def _is_muon(job: Job) -> bool:
    return job.ds is not None and str(job.ds.get("optimizer", {}).get("type", "")).lower() == "muon"


def check(job: Job) -> None:
    """The first row of the table that refuses this job, as its one line (ConfigError). Rows that
    read the final DeepSpeed dict only when `job.ds` is given. A row that refuses a whole pair of
    techniques speaks first: no other value would make that pair run, so a line about one of its
    settings would only send the user round again."""
    for rule in sorted(RULES, key=lambda rule: not rule.pair):
        if rule.final and job.ds is None:
            continue
        if rule.refuses(job):
            refusal = ConfigError(rule.message(job))
            refusal.rule = rule  # which row refused (tests/test_composition.py asks)
            raise refusal


def pair_rules() -> dict[frozenset, Rule]:
    """The rows that refuse a whole pair of axes, by pair; a row about an axis refuses its kinds
    (KIND_OF) with the same other axis."""
    rows = {frozenset(rule.techniques): rule for rule in RULES if rule.pair}
    for kind, axis in KIND_OF.items():
        for pair, rule in list(rows.items()):
            if axis in pair and kind not in pair:
                rows.setdefault(frozenset((kind, *(pair - {axis}))), rule)
    return rows


def load_checked(cfg: DictConfig) -> TrainConfig:
    """The composed config loaded (types, each component's own rules) and held to this table's rows
    that read the config alone; the rows that read the final DeepSpeed dict wait for the plan."""
    config = load(cfg)
    check(Job(config))
    return config
