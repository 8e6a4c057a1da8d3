"""engine=fsdp2 against engine=deepspeed on real 2-rank CPU runs (gloo, fp32): the same job gives
the same numbers at the matching ZeRO stage, its DCP checkpoints resume bit for bit (after
kill -9 too) and on another rank count, export to transformers, and what FSDP2 cannot mean is
refused in one line.

Tolerances, fp32 (tests/numerics.py): the engines differ in how gradients are reduced
(DeepSpeed's buckets, FSDP2's per-block reduce-scatter), i.e. float rounding. Losses: STEPS_FP32,
1e-5 relative over 20 steps with clipping and weight decay on (measured: 1e-7). The gradient norm
is more sensitive than the loss (NORM_STEPS): DeepSpeed's own 2-rank norms drift from its
1-process norms by 2.7e-4 over 8 steps with losses equal to 1e-7; FSDP2's stay within 2.6e-4 of
DeepSpeed's. 1e-3 still catches any gradient off by a factor (a rank count, an accumulation
count), which is what the norm is checked for."""

import json
import os
import pickle
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import composition
from harness import FORKED_PYTHON, PYTHON, REPO, TINY, assert_ok, kill_9_after_a_save, launcher, read_metrics, run_train
from lmrepo.plan.compose import load_config
from lmrepo.utils.errors import ConfigError
from numerics import NORM_STEPS, STEPS_FP32, assert_close

FIRST = "checkpoints/step_00000003"
# 20 steps of 2 micro batches: clipping (TINY's norms are 1.4-2.0, the clip 1.0) and weight decay on
LONG = ("precision=fp32", "trainer.max_steps=20", "trainer.grad_accum=2", "schedule.warmup_steps=2")
TOLERANCE = {"loss": STEPS_FP32, "eval_loss": STEPS_FP32, "grad_norm": NORM_STEPS}


def lines(run_dir, key: str) -> dict[int, float]:
    """Step -> the logged value."""
    return {m["step"]: m[key] for m in read_metrics(run_dir) if key in m}


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp2_equals_deepspeed_at_the_matching_stage(launch2, stage):
    """ZeRO-3 over 20 steps of 2 micro batches; ZeRO-2 on the 6-step runs the ZeRO tests share
    (test_distributed.py), which already clip and decay."""
    job = LONG if stage == 3 else ("precision=fp32",)
    deepspeed = launch2(f"zero=stage{stage}", *job)
    fsdp2 = launch2("engine=fsdp2", f"zero=stage{stage}", *job)
    for key in ("loss", "grad_norm", "eval_loss"):
        assert_close(lines(fsdp2, key), lines(deepspeed, key), TOLERANCE[key], f"{key}, zero=stage{stage}")
    assert all(m["lr"] == r["lr"] for m, r in zip(read_metrics(fsdp2), read_metrics(deepspeed)) if "lr" in m)
    config = json.loads((fsdp2 / "status.json").read_text())
    assert config["status"] == "completed"


@pytest.mark.distributed
def test_fsdp2_equals_one_process(launch2, tmp_path):
    """The same global batch (2 ranks x 4 x 2 micro batches = 1 process x 4 x 4) from one process."""
    fsdp2 = launch2("engine=fsdp2", "zero=stage3", *LONG)
    alone = tmp_path / "alone"
    assert_ok(run_train([*TINY, *LONG, "trainer.grad_accum=4"], alone))
    for key in ("loss", "grad_norm"):
        assert_close(lines(fsdp2, key), lines(alone, key), TOLERANCE[key], key)


@pytest.mark.distributed
def test_fsdp2_resumes_bit_for_bit(launch2):
    uninterrupted = launch2("engine=fsdp2", "zero=stage3")
    files = {p.name for p in (uninterrupted / FIRST).iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "mp_rank_00_model_states.pt", "manifest.json"} <= files
    resumed = launch2("engine=fsdp2", "zero=stage3", f"run.resume={uninterrupted / FIRST}")
    after = [m for m in read_metrics(uninterrupted) if m["step"] > 3 and ("loss" in m or "eval_loss" in m)]
    ours = [m for m in read_metrics(resumed) if "loss" in m or "eval_loss" in m]
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss")
    assert [[m.get(k) for k in keys] for m in ours] == [[m.get(k) for k in keys] for m in after]


@pytest.mark.distributed
def test_fsdp2_checkpoint_of_2_ranks_resumes_on_1(launch2, tmp_path):
    """DCP reshards on load: the 2-rank checkpoint continues on one process (global batch kept)."""
    two_ranks = launch2("engine=fsdp2", "zero=stage3")
    one = tmp_path / "one"
    overrides = ["engine=fsdp2", "zero=stage3", "trainer.micro_batch_size=8", f"run.resume={two_ranks / FIRST}"]
    assert_ok(run_train([*TINY, *overrides], one))
    reference = {m["step"]: m for m in read_metrics(two_ranks) if "loss" in m and m["step"] > 3}
    ours = {m["step"]: m for m in read_metrics(one) if "loss" in m}
    assert {s: m["lr"] for s, m in ours.items()} == {s: m["lr"] for s, m in reference.items()}
    losses = ({s: m["loss"] for s, m in run.items()} for run in (ours, reference))
    assert_close(*losses, STEPS_FP32, "losses on 1 rank against 2")


@pytest.mark.distributed
def test_fsdp2_export_gives_the_runs_logits(launch2, tmp_path):
    """scripts/export_hf.py joins the DCP shards: transformers loads the directory and its eval
    loss is the run's; the same weights as the DeepSpeed run of the same job."""
    from transformers import AutoModelForCausalLM

    fsdp2 = launch2("engine=fsdp2", "zero=stage3", *LONG)
    deepspeed = launch2("zero=stage3", *LONG)
    models = {}
    for name, run_dir in (("fsdp2", fsdp2), ("deepspeed", deepspeed)):
        out = tmp_path / name
        proc = subprocess.run(
            [*FORKED_PYTHON, str(REPO / "scripts" / "export_hf.py"), str(run_dir), str(out)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        models[name] = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, models["fsdp2"].config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = (models[n](tokens).logits for n in ("fsdp2", "deepspeed"))
    # Two runs whose gradient norms agree to NORM_STEPS: so do their weights, hence the logits (by
    # their norm). Shards joined wrongly are off by the logits' whole size.
    assert_close(ours, theirs, NORM_STEPS, "logits")


LLAMA_TP = ["model=llama-tiny", "tp=auto", "tp.size=2"]


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["zero=stage1"], "engine=fsdp2 has no counterpart of zero=stage1"),
        (["zero=stage0"], "engine=fsdp2 has no counterpart of zero=stage0"),
        (["offload=nvme", "offload.nvme_path=/tmp"], "engine=fsdp2 offloads to CPU memory only"),
        (["offload=cpu", "offload.params=false"], "drop offload.params=false"),
        (["precision=fp16"], "choose precision=bf16"),
        (["pipeline=1f1b"], "choose pipeline=none"),
        (["pipeline=zbv", "pipeline.virtual_stages=2"], "choose pipeline=gpipe, 1f1b_torch or interleaved"),
        (["tp=auto"], "GPT2LMHeadModel has none here: choose a model=llama-* preset, or tp=none"),
        (["model=bert-tiny", "tp=auto"], "BertForMaskedLM has none here"),
        (["deepspeed_config=ds.json"], "drop it, or choose engine=deepspeed"),
        (["model.zero_init=true"], "model.zero_init is DeepSpeed's zero.Init"),
        (["checkpointing=full", "checkpointing.partition_activations=true"], "checkpointing.partition_activations"),
        # tensor parallelism's further splits, asked for where they do not run
        (["engine=deepspeed", *LLAMA_TP, "tp.sequence_parallel=true"], "choose engine=fsdp2 tp=auto, or drop it"),
        (["model=llama-tiny", "tp.loss_parallel=true"], "choose engine=fsdp2 tp=auto, or drop it"),
        ([*LLAMA_TP, "pipeline=gpipe", "tp.loss_parallel=true"], "drop it, or choose pipeline=none"),
        ([*LLAMA_TP, "data.block_size=33", "tp.sequence_parallel=true"], "data.block_size=33 does not divide by it"),
        ([*LLAMA_TP, "eval.tasks=[shakespeare_cloze]", "tp.sequence_parallel=true"], "set tp.sequence_parallel=false"),
        ([*LLAMA_TP, "model.tie_embeddings=true", "tp.loss_parallel=true"], "set model.tie_embeddings=false"),
    ],
)
def test_what_fsdp2_cannot_mean_is_one_line(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(["engine=fsdp2", *overrides])
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, sequence, vocabulary",
    [
        ([], True, True),  # where they run, torchtitan's way
        (["data.block_size=33"], False, True),  # a sequence that does not split evenly
        (["eval.tasks=[shakespeare_cloze]"], False, True),  # lm-eval's requests of any length
        (["model.tie_embeddings=true"], True, False),  # the head is the input embedding, whole
        (["pipeline=gpipe"], False, False),
        (["tp.sequence_parallel=false", "tp.loss_parallel=false"], False, False),
    ],
)
def test_tensor_parallel_splits_the_norms_and_the_loss_where_they_run(overrides, sequence, vocabulary):
    from lmrepo.distributed import tp

    config = load_config(["engine=fsdp2", *LLAMA_TP, *overrides])
    assert tp.sequence_parallel(config) == sequence
    assert tp.loss_parallel(config) == vocabulary


def test_fsdp2_defaults_to_full_sharding_and_keeps_a_chosen_stage():
    assert load_config(["engine=fsdp2"]).zero.stage == 3
    assert load_config(["engine=fsdp2", "zero=stage2"]).zero.stage == 2
    assert load_config([]).engine.name == "deepspeed" and load_config([]).zero.stage == 0


@pytest.mark.distributed
def test_a_checkpoint_of_the_other_engine_is_one_line(launch2):
    from lmrepo.train import checkpoint

    config = load_config(["engine=fsdp2", *TINY])
    source = launch2("zero=stage0", "precision=fp32") / "checkpoints"
    with pytest.raises(ConfigError, match="was written by engine=deepspeed, this run is engine=fsdp2"):
        checkpoint.inspect(source, "step_00000003", config.model, config.model.vocab_size, engine="fsdp2")


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    """DCP reads its .metadata with plain pickle; lmrepo's reader allows DCP's classes only."""
    from lmrepo.engines.fsdp2 import WeightsOnlyReader

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ConfigError, match="holds more than weights"):
        WeightsOnlyReader(tmp_path).read_metadata()
    assert not marker.exists()


def test_fsdp2_model_states_per_rank_are_the_estimate(tmp_path):
    """The bytes the first and the last rank hold after a step, at 2, 8 and 64 ranks (the job built
    on torch's fake process group, one rank at a time, in one process: tests/probes/fsdp2_probe.py): their
    shards of the fp32 parameters, the gradients they get and AdamW's two moments, 16 bytes an
    element of each tensor's dim-0 rows that Shard(0) gives the rank (exactly), and
    scripts/estimate.py's FSDP2 figure (16 bytes x parameters / ranks) within one row of each
    tensor on rank 0, whose shards are the largest (50,257 embedding rows over 64 ranks: 786 on
    rank 0, 739 on rank 63). A shard over the wrong group, a moment kept whole or a gradient
    not sharded is off by a factor."""
    from lmrepo.estimate import fsdp2_state_bytes, shard_rows
    from lmrepo.models import meta_model
    from lmrepo.plan.compose import load_config

    overrides = [*TINY, "engine=fsdp2"]
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "tests" / "probes" / "fsdp2_probe.py"), str(tmp_path), "2,8,64", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensors = [(p.shape[0], p.numel() // p.shape[0]) for p in meta_model(load_config(overrides).model).parameters()]
    held = json.loads((tmp_path / "held.json").read_text())
    assert sorted(held) == ["2/0", "2/1", "64/0", "64/63", "8/0", "8/7"]
    for key, rank_held in held.items():
        world, rank = map(int, key.split("/"))
        measured = rank_held["parameters"] + rank_held["gradients"] + rank_held["optimizer"]
        assert measured == 16 * sum(shard_rows(rows, world, rank) * row for rows, row in tensors), key
        if rank == 0:
            estimate = fsdp2_state_bytes(rank_held["model_parameters"], world, "fp32").gpu
            assert 0 <= measured - estimate <= 16 * sum(row for _, row in tensors), (key, measured, estimate)


@pytest.mark.distributed
def test_generate_runs_on_an_fsdp2_run(launch2, tmp_path):
    run_dir = launch2("engine=fsdp2", "zero=stage3")
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "generate.py"), f"run={run_dir}", "prompt=ROMEO:", "max_new_tokens=4",
         f"json={out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["prompt"] == "ROMEO:" and isinstance(result["text"], str)


def probe(out, ranks: int, cases: list[list[str]]) -> dict:
    """Each job's losses and gradient norms by its overrides (tests/probes/composition_probe.py: the ranks
    start once for all of them)."""
    (out / "cases.json").write_text(json.dumps(cases))
    words = [str(REPO / "tests" / "probes" / "composition_probe.py"), str(out / "out.json"), str(out / "cases.json")]
    proc = subprocess.run([*launcher(ranks), *words], cwd=out, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "out.json").read_text())
    return {tuple(words): results[composition.case_name(words)] for words in cases}


# On 4 ranks, composition's base job (a tiny Llama of 4 heads and 2 key/value heads, fp32, a
# constant rate, clipping active) with its global batch of 4 sequences: FSDP2 over all 4 ranks (one
# sequence each), HSDP (2 replicas x 2 shards), tensor parallelism (2 data x 2 tensor-parallel
# ranks, two sequences per data-parallel rank) and a pipeline (2 stages x 2 data-parallel ranks,
# two micro batches of one sequence per replica), in one launch. 6 steps, each clipped (norms
# 1.5-1.9 against a clip of 0.5), compared within LAYOUT_FP32 (below: the reasons). Each step of a
# layout costs ~0.4-1 s of the 2 cores with 4 or 8 ranks on them: the launches' time is mostly steps.
STEPS = "trainer.max_steps=6"
FSDP2_4 = (*composition.overrides("fsdp2"), "trainer.micro_batch_size=1", STEPS)
HSDP_4 = (*FSDP2_4, "engine.replicate=2")
TP_4 = (*composition.overrides("fsdp2", "autotp"), STEPS)  # the norms split by tokens, the loss by vocabulary
TP_LINEARS_4 = (*TP_4, "tp.sequence_parallel=false", "tp.loss_parallel=false")  # the blocks' linears alone
# A Mixtral-style model of one dense block and one of experts (model.moe.every=2): FSDP2 over 4
# ranks, and data x tensor with the dense parts split (attention, the dense MLP; the experts whole
# on each tensor-parallel rank, sharded over the data-parallel ones), every rank holding every
# expert (expert_parallel.size=1). One sequence per micro batch in both (2 accumulated on each
# data-parallel rank of 2 x 2): the load-balancing loss is taken over the tokens of one forward, so
# two sequences in one would be another loss.


def moe_layout(*axes: str, ep: int) -> tuple[str, ...]:
    words = [w for w in composition.overrides("fsdp2", "moe", *axes) if not w.startswith("expert_parallel.size=")]
    return (*words, f"expert_parallel.size={ep}", "model.moe.every=2", "trainer.micro_batch_size=1", STEPS)


MOE_4, MOE_TP_4 = moe_layout(ep=1), moe_layout("autotp", ep=1)
# Expert parallelism on the mesh: the experts split over pairs of data-parallel shards (each
# expert sharded over the 2 ranks that hold it), over the 2 shards of each of 2 replicas (HSDP:
# each rank holds its experts whole), and over the 2 data-parallel ranks of a 2 x 2 data x tensor
# mesh (each tensor-parallel rank dispatches its own copy of the tokens)
MOE_EP_4, MOE_EP_TP_4 = moe_layout(ep=2), moe_layout("autotp", ep=2)
MOE_EP_HSDP_4 = (*MOE_EP_4, "engine.replicate=2")
# Ulysses sequence parallelism under fully_shard: 2 data-parallel ranks x 2 sequence-parallel ranks
# (each holding half of every sequence; FSDP2 shards over all 4), and as HSDP (2 replicas, each one
# sequence-parallel pair sharding between them)
SP_4 = (*FSDP2_4, "sequence_parallel.size=2")
SP_HSDP_4 = (*SP_4, "engine.replicate=2")
PP_4 = (*composition.overrides("fsdp2", "torch_pipeline"), "trainer.micro_batch_size=1", STEPS)
PP_1F1B_4 = (*PP_4, "pipeline=1f1b_torch", "zero=stage2", "checkpointing=full")
PP_TP_4 = (*composition.overrides("fsdp2", "torch_pipeline", "autotp"), "trainer.micro_batch_size=1", STEPS)
# Sequence parallelism inside the stages: 2 stages x 2 sequence-parallel ranks (one replica reading
# the whole batch, 4 micro batches of one sequence), under FSDP2 (each stage sharded over its pair)
# and on DeepSpeed's engine (each stage whole on both)
PP_SP_4 = (*PP_4, "sequence_parallel.size=2")
PP_SP_DS_4 = (*composition.overrides("torch_pipeline"), "trainer.micro_batch_size=1", STEPS, "sequence_parallel.size=2")
# Muon (its two halves at their own rates: wsd without decay is constant) over the same layouts:
# each matrix's update computed on the whole matrix however it is sharded
MUON = tuple(composition.OVERRIDES["muon"])
MUON_4, MUON_HSDP_4, MUON_TP_4 = ((*layout, *MUON) for layout in (FSDP2_4, HSDP_4, TP_4))
# and on the mixture of experts: its experts and routers cut over 4 ranks, or whole on each
# tensor-parallel rank and cut over 2 (attention and the dense MLP split by tensor parallelism)
MOE_MUON_4, MOE_MUON_TP_4, MOE_MUON_EP_4 = ((*layout, *MUON) for layout in (MOE_4, MOE_TP_4, MOE_EP_4))
# One stage of two looped chunks over 4 data-parallel ranks, embeddings tied: both chunks of a rank
# hold the one embedding matrix, which FSDP2 cannot put in two units
TIED = "model.tie_embeddings=true"
FSDP2_TIED_4 = (*FSDP2_4, TIED)
PP_SHARED_4 = (*PP_4, "pipeline=interleaved", "pipeline.stages=1", "pipeline.virtual_stages=2", TIED)


EIGHT = ["trainer.micro_batch_size=1", "trainer.global_batch_size=8", STEPS]
EIGHT_RANKS = {
    "flat": [*composition.overrides("fsdp2"), *EIGHT],
    "replicas": [*composition.overrides("fsdp2", "torch_pipeline"), *EIGHT, "engine.replicate=2"],
    "tensor": [*composition.overrides("fsdp2", "torch_pipeline", "autotp"), *EIGHT],
}
# HSDP and the 3-D layout with activation checkpointing and with bf16, 3 steps each
SHORT = "trainer.max_steps=3"
HSDP_CHECKPOINTED_4 = (*HSDP_4, "checkpointing=full", SHORT)
HSDP_BF16_4 = (*HSDP_4, "precision=bf16", SHORT)
EIGHT_RANKS["tensor, checkpointed"] = [*EIGHT_RANKS["tensor"], "checkpointing=full", SHORT]
EIGHT_RANKS["tensor, bf16"] = [*EIGHT_RANKS["tensor"], "precision=bf16", SHORT]


# Checkpoints of every layout, in the same launches: the saved layouts checkpoint at SAVE_AT and
# train on; a resumed case builds its engine afresh, loads one and trains the steps after it. On
# the layout that saved it, it must give those steps' losses and norms bit for bit; on another, the
# same within the rounding of another reduction order. A pipeline's checkpoint (one file per
# layer, whole tensors by name) loads into any split and into a model without a pipeline; DCP's
# (every layout without a pipeline) reshards on load.
SAVE_AT = 3
# FSDP2 over all ranks: test_fsdp2_resumes_bit_for_bit
SAVED_4 = [HSDP_4, TP_4, PP_4, PP_TP_4, PP_SP_4, MOE_TP_4, MOE_EP_4, SP_4, MUON_TP_4]
# (the layout that saved, the one that resumes); the experts' checkpoints across expert-parallel sizes
RESHARDED_4 = [
    (TP_4, FSDP2_4),
    (PP_TP_4, TP_4),
    (PP_4, HSDP_4),
    (MOE_TP_4, MOE_EP_4),
    (MOE_EP_4, MOE_4),
    (SP_4, HSDP_4),
]
# 2 x 2 -> 4 x 1 -> 1 rank: the 4 x 1 run that resumed the tensor-parallel checkpoint saves again here
CHAIN_AT = 4
SAVED_8 = ["flat", "replicas", "tensor"]
# One process, the global batches of the 4- and 8-rank runs (2 and 4 micro batches of 2 sequences)
ONE_4 = (*composition.overrides("fsdp2"), STEPS)
ONE_8 = (*composition.overrides("fsdp2"), "trainer.global_batch_size=8", STEPS)


@dataclass
class Probed:
    out: Path  # the probe's directory: each saving case's run directory under it (composition.case_dir)
    runs: dict  # a layout (its words, or its name in EIGHT_RANKS) -> its result over STEPS
    resumed: dict = field(default_factory=dict)  # (layout that saved, layout that resumed) -> the steps after

    def words(self, layout) -> list[str]:
        """The layout's words as the probe ran them (a saving layout's with probe.save_at)."""
        saving = [f"probe.save_at={SAVE_AT}"] if layout in SAVED_4 + SAVED_8 else []
        return [*overrides_of(layout), *saving]

    def resuming(self, saved, layout) -> list[str]:
        """`layout`'s words resuming the checkpoint `saved` wrote at SAVE_AT."""
        return [*overrides_of(layout), composition.saved(self.out, self.words(saved), SAVE_AT)]


def overrides_of(layout) -> list[str]:
    """A layout's overrides: its words, or its name in EIGHT_RANKS."""
    return list(EIGHT_RANKS[layout] if isinstance(layout, str) else layout)


def run_probe(out: Path, ranks: int, layouts: list, resumes: list[tuple]) -> Probed:
    probed = Probed(out, {})
    cases = [probed.words(layout) for layout in layouts]
    chain = [f"probe.save_at={CHAIN_AT}"]
    cases += [probed.resuming(*pair) + (chain if pair == (TP_4, FSDP2_4) else []) for pair in resumes]
    results = probe(out, ranks, cases)
    probed.runs = {layout: results[tuple(probed.words(layout))] for layout in layouts}
    probed.resumed = {pair: results[tuple(case)] for pair, case in zip(resumes, cases[len(layouts) :])}
    return probed


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory) -> Probed:
    """FSDP2 over 8 ranks and the two 3-D layouts, one sequence per micro batch, in one launch; each
    saved halfway and resumed on itself."""
    out = tmp_path_factory.mktemp("eight_ranks")
    return run_probe(out, 8, list(EIGHT_RANKS), [(name, name) for name in SAVED_8 if name != "flat"])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Probed:
    layouts = [
        FSDP2_4,
        HSDP_4,
        TP_4,
        TP_LINEARS_4,
        SP_4,
        SP_HSDP_4,
        MOE_4,
        MOE_TP_4,
        MOE_EP_4,
        MOE_EP_HSDP_4,
        MOE_EP_TP_4,
        PP_4,
        PP_1F1B_4,
        PP_TP_4,
        PP_SP_4,
        PP_SP_DS_4,
        FSDP2_TIED_4,
        PP_SHARED_4,
        HSDP_CHECKPOINTED_4,
        HSDP_BF16_4,
        MUON_4,
        MUON_HSDP_4,
        MUON_TP_4,
        MOE_MUON_4,
        MOE_MUON_TP_4,
        MOE_MUON_EP_4,
    ]
    resumes = [(layout, layout) for layout in SAVED_4] + RESHARDED_4 + [(MUON_TP_4, MUON_4)]
    return run_probe(tmp_path_factory.mktemp("four_ranks"), 4, layouts, resumes)


@pytest.fixture(scope="module")
def one_rank(four_ranks, eight_ranks, tmp_path_factory) -> dict:
    """One process training the 4- and the 8-rank runs' global batches from the start, and resuming
    the 4 x 1 run's step-4 checkpoint (the end of 2 x 2 -> 4 x 1 -> 1) and the 3-D pipeline x data x
    tensor checkpoint."""
    chain = four_ranks.resuming(TP_4, FSDP2_4) + [f"probe.save_at={CHAIN_AT}"]
    cases = {
        "alone 4": list(ONE_4),
        "alone 8": list(ONE_8),
        "chain": [*ONE_4, composition.saved(four_ranks.out, chain, CHAIN_AT)],
        "3-D": [*ONE_8, composition.saved(eight_ranks.out, eight_ranks.words("tensor"), SAVE_AT)],
    }
    results = probe(tmp_path_factory.mktemp("one_rank"), 0, list(cases.values()))
    return {name: results[tuple(words)] for name, words in cases.items()}


# One FSDP2 layout against another, fp32, 6 steps with clipping active. FSDP2 sums the norm's
# squares in float64 (lmrepo.distributed.grad_norm.global_grad_norm), so the norms differ only by the rounding of
# the gradients themselves: a few fp32 units (2^-24 = 6e-8) of each element, averaged over the
# model's elements. Measured between every pair of layouts here and one process, with GPT-2's BPE
# (3.3M elements): losses up to 2e-7 apart, first norms 3e-8, later norms 3.4e-6 (Adam amplifies
# the rounding step by step; a float32 sum of the 3.3M squares had moved them by up to 3e-4); the
# base model now tokenizes by GPT-2's bytes (125k elements). Held to: losses 1e-5, the first norm 1e-6, later
# norms 1e-4. A norm over a part of the shards, slices or stages, or a gradient off by a rank
# count, is off by percents.
LAYOUT_FP32 = {"loss": 1e-5, "first_norm": 1e-6, "norm": 1e-4}


def assert_trains_as(ours: dict, theirs: dict) -> None:
    """fp32 losses and gradient norms of every step within LAYOUT_FP32."""
    from test_composition import close

    assert "losses" in ours, ours
    for step, (loss, reference) in enumerate(zip(ours["losses"], theirs["losses"], strict=True)):
        assert close(loss, reference, LAYOUT_FP32["loss"]), (step, ours, theirs)
    assert close(ours["grad_norms"][0], theirs["grad_norms"][0], LAYOUT_FP32["first_norm"]), (ours, theirs)
    for step, (norm, reference) in enumerate(zip(ours["grad_norms"][1:], theirs["grad_norms"][1:]), 1):
        assert close(norm, reference, LAYOUT_FP32["norm"]), (step, ours, theirs)


@pytest.mark.distributed
def test_fsdp2_over_4_and_8_ranks_equals_one_process(four_ranks, eight_ranks, one_rank):
    """The layouts' common reference against one process on the same global batch (2 and 4 micro
    batches of 2 sequences): every layout below is held to it, so each equals one process within
    twice LAYOUT_FP32."""
    assert_trains_as(four_ranks.runs[FSDP2_4], one_rank["alone 4"])
    assert_trains_as(eight_ranks.runs["flat"], one_rank["alone 8"])


@pytest.mark.distributed
def test_hsdp_on_a_2x2_mesh_equals_fsdp2_over_4_ranks(four_ranks):
    """engine.replicate=2 on 4 ranks: 2 replicas, each sharding the model over 2 ranks (FSDP2 on a
    replicate x shard mesh), trains as FSDP2 sharding over all 4 (the same global batch)."""
    assert_trains_as(four_ranks.runs[HSDP_4], four_ranks.runs[FSDP2_4])


def test_one_replica_per_node_follows_the_launcher(monkeypatch):
    """engine.replicate=nodes: the launcher's node count (WORLD_SIZE over the ranks per node it set),
    launcher.nodes where no launcher started the world (a sweep's plan, an estimate); refused in
    one line under DeepSpeed, and a word that is neither a count nor `nodes` is one line too."""
    from lmrepo.distributed.layout import ParallelLayout

    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    config = load_config(["engine=fsdp2", "engine.replicate=nodes", "launcher.nodes=4"])
    assert (ParallelLayout.of(config, 16).dp_replicate, ParallelLayout.of(config, 16).dp_shard) == (2, 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert (ParallelLayout.of(config, 16).dp_replicate, ParallelLayout.of(config, 16).dp_shard) == (4, 4)
    with pytest.raises(ConfigError, match="engine.replicate=nodes replicates FSDP2's shards"):
        load_config(["engine=deepspeed", "engine.replicate=nodes"])
    with pytest.raises(ConfigError, match="must be a count >= 1 .* or nodes"):
        load_config(["engine=fsdp2", "engine.replicate=many"])


@pytest.mark.distributed
def test_hsdp_across_two_torchrun_nodes_equals_fsdp2_over_4_ranks(four_ranks, tmp_path):
    """Two nodes as two machines start them, here two `torchrun --nnodes 2 --nproc-per-node 2` on
    this one (c10d rendezvous, ranks over loopback): engine.replicate=nodes makes one replica per
    node, each sharding over its own node's 2 ranks, and trains as FSDP2 sharding over all 4."""
    from lmrepo.distributed.launch import free_port

    run_dir = tmp_path / "run"
    command = [
        *(PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d"),
        *(f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=lmrepo-two-nodes", str(REPO / "train.py")),
        *(*FSDP2_4, "engine.replicate=nodes", "trainer.log_every=1", "logger=jsonl", f"hydra.run.dir={run_dir}"),
    ]
    nodes = [
        subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(output[-3000:] for output in outputs)
    assert "2 replica(s), one per node, each sharding over its node's 2 data-parallel rank(s)" in "".join(outputs)
    logged = [m for m in read_metrics(run_dir) if "loss" in m]
    ours = {"losses": [m["loss"] for m in logged], "grad_norms": [m["grad_norm"] for m in logged]}
    assert_trains_as(ours, four_ranks.runs[FSDP2_4])


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout, reference",
    [(MUON_HSDP_4, MUON_4), (MUON_TP_4, MUON_4), (MOE_MUON_TP_4, MOE_MUON_4), (MOE_MUON_EP_4, MOE_MUON_4)],
    ids=["hsdp", "tensor-parallel", "experts", "expert-parallel"],
)
def test_muon_on_sharded_matrices_trains_as_muon_under_fsdp2(four_ranks, layout, reference):
    """optimizer=muon under HSDP (2 replicas x 2 shards) and under FSDP2 x tensor parallelism (each
    matrix cut over 2 data-parallel and 2 tensor-parallel ranks) trains as under FSDP2 over 4 ranks,
    which composition's pair checks against DeepSpeed's Muon: every matrix's update orthogonalised
    whole, whatever cuts it. So does a mixture of experts, its experts and routers in the Muon half
    (whole on each tensor-parallel rank and cut over 2, or split by expert parallelism, against cut
    over 4). Orthogonalising each
    rank's piece alone moves the second loss by ~1e-3 here. After the first update the losses are
    held to composition's Muon tolerance (its Newton-Schulz runs in bf16, where gradients summed in
    another order can round otherwise). The
    data x tensor checkpoint, Muon's momenta sharded over both dimensions, resumes bit for bit
    (test_every_layout_resumes_bit_for_bit) and continues under FSDP2 alone."""
    from test_composition import MUON_UPDATED_LOSS, close

    ours, theirs = four_ranks.runs[layout], four_ranks.runs[reference]
    assert "losses" in ours and "losses" in theirs, (ours, theirs)
    assert close(ours["losses"][0], theirs["losses"][0], LAYOUT_FP32["loss"]), (ours, theirs)
    assert close(ours["grad_norms"][0], theirs["grad_norms"][0], LAYOUT_FP32["first_norm"]), (ours, theirs)
    for step, (loss, expected) in enumerate(zip(ours["losses"][1:], theirs["losses"][1:], strict=True), 1):
        assert close(loss, expected, MUON_UPDATED_LOSS), (step, ours, theirs)
    if layout == MUON_TP_4:  # its checkpoint (each matrix's momentum sharded over both dimensions) on FSDP2 alone
        resumed = four_ranks.resumed[MUON_TP_4, MUON_4]
        assert "losses" in resumed, resumed
        for loss, expected in zip(resumed["losses"], ours["losses"][SAVE_AT:], strict=True):
            assert close(loss, expected, MUON_UPDATED_LOSS), (resumed, ours)


@pytest.mark.distributed
@pytest.mark.parametrize("tensor_parallel", [TP_4, TP_LINEARS_4], ids=["sequence-and-loss-parallel", "linears"])
def test_fsdp2_tensor_parallel_on_a_2x2_mesh_equals_fsdp2_over_4_ranks(four_ranks, tensor_parallel):
    """engine=fsdp2 tp=auto on 4 ranks: torch's Colwise/RowwiseParallel in every block over 2
    tensor-parallel ranks, fully_shard over the 2 data-parallel ones (a data x tensor mesh), trains
    as FSDP2 sharding over all 4: as shipped (the norms and the residual stream split by tokens,
    the head by vocabulary, the loss taken on the split logits) and with the linears split alone.
    Its gradient norm, logged and clipped by, is the whole model's: one that left out a tensor-
    parallel rank's shards (the head's half of the vocabulary, a norm weight's gradient from half
    the tokens) would be far outside the first norm's 1e-6."""
    assert_trains_as(four_ranks.runs[tensor_parallel], four_ranks.runs[FSDP2_4])


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [SP_4, SP_HSDP_4], ids=["fsdp2", "hsdp"])
def test_sequence_parallel_under_fully_shard_equals_fsdp2_over_4_ranks(four_ranks, sequence_parallel):
    """engine=fsdp2 sequence_parallel.size=2 on 4 ranks: Ulysses over each pair of ranks (each
    holding half of every sequence, attention's all-to-all swapping the split to heads), FSDP2
    sharding over all 4 (or HSDP: each pair one replica), trains as FSDP2 over 4 ranks reading
    whole sequences. Each rank back-propagates its slice's share of the sequence's loss, so the
    gradients are summed over a pair and averaged over the data-parallel ranks: averaged over all 4
    (FSDP2's default) they are half, far outside the first norm's 1e-6. Its checkpoint resumes
    under HSDP without sequence parallelism (test_checkpoints_reshard_from_2x2_to_4x1_to_one_rank)."""
    assert_trains_as(four_ranks.runs[sequence_parallel], four_ranks.runs[FSDP2_4])


@pytest.mark.distributed
def test_mixtral_dense_parts_tensor_parallel_on_a_2x2_mesh_equal_fsdp2_over_4_ranks(four_ranks):
    """A Mixtral-style model under engine=fsdp2 tp=auto: attention and the dense block's MLP split
    over 2 tensor-parallel ranks (with the token-split norms and the vocabulary-split loss), the
    experts whole on each, sharded with the rest over the 2 data-parallel ranks. It trains as FSDP2
    over all 4 (whose experts the composition matrix holds to DeepSpeed-MoE's), the load-balancing
    loss in it: a router that lost that loss's gradient, or an expert's gradient off by the tp
    size, moves the norm far past 1e-6. The metrics line counts the routes of each rank's last
    forward (one sequence) over the ranks that read different samples: 2 here against 4 there, not
    again on each tensor-parallel rank (which would make them equal). Its aux_loss, of those last
    forwards alone, is not compared: the two layouts' last forwards hold other sequences."""
    tensor, flat = four_ranks.runs[MOE_TP_4], four_ranks.runs[MOE_4]
    assert_trains_as(tensor, flat)
    assert 2 * sum(tensor["moe"]["expert_tokens"]) == sum(flat["moe"]["expert_tokens"]) > 0, (tensor, flat)


@pytest.mark.parametrize("replicas", [1, 2])
def test_expert_parallelism_gives_each_rank_its_share_of_the_experts(replicas):
    """What expert_parallel.size=2 builds on 4 ranks, planned on torch's fake process group (the
    engine's own parallelize, the model on the meta device): each rank holds the experts of its
    share alone (global indices 0-1 or 2-3 of 4, under those names, which its checkpoint saves
    them by), each sharded over the ranks that hold the same ones (or, with 2 replicas, whole on
    each and replicated across them), and each MoE layer dispatches over the rank's pair."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lmrepo.distributed.layout import ParallelLayout
    from lmrepo.engines import fsdp2
    from lmrepo.models import meta_model

    config = load_config([*MOE_EP_4, f"engine.replicate={replicas}"])
    for rank in range(4):
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
        try:
            layout = ParallelLayout.of(config, 4)
            net = meta_model(config.model, layout.ep, layout.ep_rank(rank))
            fsdp2.parallelize(net, config, layout, layout.mesh("cpu"), torch.device("cpu"))
            experts = {n: p for n, p in net.named_parameters() if ".deepspeed_experts." in n}
            held = {int(name.split(".deepspeed_experts.")[1].split(".")[0]) for name in experts}
            assert held == ({0, 1} if rank % 2 == 0 else {2, 3}), (rank, sorted(experts))
            for param in experts.values():
                holders = param.device_mesh.mesh.flatten().tolist()
                if replicas == 1:  # the ranks of the other pair that hold the same experts
                    assert holders == [rank % 2, rank % 2 + 2] and param.placements == (Shard(0),), param
                else:
                    assert holders == [rank % 2, rank % 2 + 2] and param.placements == (Replicate(), Shard(0))
                    assert param.to_local().shape == param.shape  # one rank per shard: whole
            pairs = {tuple(dist.get_process_group_ranks(m.moe.deepspeed_moe.ep_group)) for m in net.moe_layers()}
            assert pairs == {(rank // 2 * 2, rank // 2 * 2 + 1)}, pairs
        finally:
            dist.destroy_process_group()


def test_expert_groups_lie_within_a_replica():
    """With HSDP the ranks that split the experts are shards of one replica (the replicas hold
    copies of the same experts): 4 ranks as 2 replicas of 2 shards cannot split them 4 ways."""
    from lmrepo.distributed.layout import ParallelLayout

    config = load_config([*MOE_4, "engine.replicate=2", "expert_parallel.size=4", "model.moe.experts=4"])
    with pytest.raises(ConfigError, match=r"each replica's 2 shard\(s\) must hold every expert"):
        ParallelLayout.of(config, 4)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout, reference",
    [(MOE_EP_4, MOE_4), (MOE_EP_HSDP_4, MOE_4), (MOE_EP_TP_4, MOE_TP_4)],
    ids=["2-shards-each", "hsdp-whole-experts", "data-x-tensor"],
)
def test_experts_split_over_the_mesh_train_as_every_rank_holding_all(four_ranks, layout, reference):
    """engine=fsdp2 expert_parallel.size=2 on 4 ranks: each pair of data-parallel shards splits the
    experts (tokens traded by all-to-all), each expert sharded over the 2 ranks that hold it, or
    held whole by each (HSDP's 2 replicas of 2 shards), or beside tensor parallelism (data x tensor,
    the experts split over the data-parallel pair). Each trains as the layout with every expert on
    every rank: an expert's gradient divided by the ranks that hold it rather than by every
    data-parallel rank, or divided twice (FSDP2 divides a one-rank shard's gradient itself: told to
    sum and divide after, it did again; HSDP's norm was 0.2% off), or a norm that leaves out the
    other experts' squares, is far outside the first norm's 1e-6. The routes counted are the same."""
    ours, theirs = four_ranks.runs[layout], four_ranks.runs[reference]
    assert_trains_as(ours, theirs)
    assert ours["moe"]["expert_tokens"] == theirs["moe"]["expert_tokens"], (ours["moe"], theirs["moe"])


@pytest.mark.distributed
@pytest.mark.parametrize(
    "pipeline",
    [PP_4, PP_1F1B_4, PP_TP_4, PP_SP_4, PP_SP_DS_4],
    ids=["gpipe", "1f1b-checkpointed-stage2", "gpipe-tensor-parallel", "gpipe-sequence-parallel", "deepspeed-gpipe-sp"],
)
def test_fsdp2_pipeline_on_a_2x2_mesh_equals_fsdp2_over_4_ranks(four_ranks, pipeline):
    """engine=fsdp2 with a torch pipeline on 4 ranks: 2 stages, each fully_shard'ed over its 2
    data-parallel ranks (a pipeline x data mesh), or each block split over 2 tensor-parallel ranks
    (pipeline x tensor), or each stage's sequences split over 2 sequence-parallel ranks (Ulysses in
    its blocks, the last stage's loss each slice's share of the whole sequences'; under FSDP2, and
    on DeepSpeed's engine with the stages whole), trains as FSDP2 over all 4. The gradient norm is
    summed over both stages and both shards: one stage's or one shard's alone is off by far more
    than the first norm's 1e-6 (stage 0's alone: 0.89 of the whole, shared/DESIGN.md)."""
    assert_trains_as(four_ranks.runs[pipeline], four_ranks.runs[FSDP2_4])


@pytest.mark.distributed
def test_fsdp2_pipeline_keeps_a_weight_two_chunks_of_a_rank_share_whole(four_ranks):
    """A tied embedding that two chunks of one rank hold (one stage, two looped chunks) stays a
    whole tensor outside FSDP2, its gradient averaged over the data-parallel ranks by lmrepo:
    trains as FSDP2 over 4 ranks of the same tied model."""
    assert_trains_as(four_ranks.runs[PP_SHARED_4], four_ranks.runs[FSDP2_TIED_4])


@pytest.mark.distributed
@pytest.mark.parametrize("third", ["replicas", "tensor"])
def test_three_dimensions_on_8_ranks_equal_fsdp2_over_8(eight_ranks, third):
    """The 3-D layouts on 8 ranks against FSDP2 over all 8, on the same global batch of 8
    sequences: 2 pipeline stages x 2 data-parallel x 2 tensor-parallel ranks (torch's styles in
    each stage's blocks, then fully_shard), and 2 stages x 2 replicas x 2 shards (HSDP inside each
    stage). The norm is made whole over the shards, the tensor-parallel slices and the stages, and
    not summed over the replicas (which hold the same gradient): any of those wrong is off by far
    more than the first norm's 1e-6 (measured: losses 3e-7 apart, first norms 1e-8)."""
    assert_trains_as(eight_ranks.runs[third], eight_ranks.runs["flat"])


@pytest.mark.distributed
def test_hsdp_and_the_3d_layout_checkpointed_and_in_bf16(four_ranks, eight_ranks):
    """HSDP (4 ranks) and pipeline x data x tensor (8 ranks), 3 steps: checkpointing=full trains
    as the same layout without it (fp32: the same sums, recomputed), and precision=bf16 as it in
    fp32 within bf16's rounding (test_composition.py's BF16 tolerances: losses 2e-2, the first
    gradient norm 3e-2; a norm over a part of the shards or stages is off by far more)."""
    from test_composition import BF16, close

    def first_steps(run: dict) -> dict:
        return {**run, "losses": run["losses"][:3], "grad_norms": run["grad_norms"][:3]}

    hsdp, tensor = first_steps(four_ranks.runs[HSDP_4]), first_steps(eight_ranks.runs["tensor"])
    assert_trains_as(four_ranks.runs[HSDP_CHECKPOINTED_4], hsdp)
    assert_trains_as(eight_ranks.runs["tensor, checkpointed"], tensor)
    for ours, theirs in ((four_ranks.runs[HSDP_BF16_4], hsdp), (eight_ranks.runs["tensor, bf16"], tensor)):
        assert "losses" in ours, ours
        for loss, reference in zip(ours["losses"], theirs["losses"], strict=True):
            assert close(loss, reference, BF16["loss"]), (ours, theirs)
        assert close(ours["grad_norms"][0], theirs["grad_norms"][0], BF16["first_norm"]), (ours, theirs)


@pytest.mark.distributed
def test_the_estimate_counts_what_each_rank_holds_in_every_layout(four_ranks, eight_ranks):
    """lmrepo.estimate.fsdp2_rank_parameters (scripts/estimate.py's FSDP2 table) against the
    parameter elements each rank of every layout held: the ranks that shard one pipeline stage's
    tensor-parallel slice hold it exactly between them, and each holds its even share up to FSDP2's
    uneven split of dim 0 (at most one row of each tensor more or less). A stage counted whole, a
    slice not divided by tp or a shard not divided by dp_shard is off by a factor of 2 or more."""
    from lmrepo.distributed.layout import ParallelLayout
    from lmrepo.estimate import fsdp2_rank_parameters
    from lmrepo.models import meta_model

    runs = [(list(words), 4, result) for words, result in four_ranks.runs.items()]
    runs += [(EIGHT_RANKS[name], 8, result) for name, result in eight_ranks.runs.items()]
    for words, ranks, result in runs:
        config = load_config(words)
        if config.engine.name != "fsdp2":
            continue  # a torch pipeline on DeepSpeed's engine: each rank holds its stage whole
        layout = ParallelLayout.of(config, ranks)
        net = meta_model(config.model)
        rows = sum(p.numel() / p.shape[0] for p in net.parameters())  # one dim-0 row of every tensor
        held = result["parameters_held"]
        for rank in range(ranks):
            # a head split by vocabulary (tp.loss_parallel): 257 rows, one more on tp rank 0
            stage = fsdp2_rank_parameters(net, config, layout, layout.coordinates(rank)["tp"])[layout.stage(rank)]
            shard_group = layout.group(rank, ("dp_shard", "sp"))  # sequence-parallel ranks shard too
            together = sum(held[r] for r in shard_group) - (len(shard_group) - 1) * stage.whole
            assert together == stage.sharded + stage.whole, (words, rank, held, stage)
            assert abs(held[rank] - stage.per_rank(layout.shards)) <= rows, (words, rank, held, stage)


@pytest.mark.distributed
def test_the_estimate_counts_each_ranks_activations_in_every_layout(four_ranks, eight_ranks):
    """lmrepo.estimate's activations per rank (scripts/estimate.py's layout table: the model's, or
    the pipeline layers', forward counted on fake tensors, times the micro batches in flight)
    against what autograd kept on each rank of every layout in a training step, counted by
    lmrepo.observability.saved_activations. Measured: equal to the byte on every layout, but for 8 bytes (a
    scalar of the loss) under tensor parallelism, with each tensor-parallel rank's share of a
    vocabulary split unevenly (129 and 128 rows of 257); held to 1e-4. A block not split by tp is
    1.6x its slice, a schedule's micro batches in flight off by one 1.25x or more, the head on the
    wrong stage 1.3x (40x with GPT-2's 50,257-token BPE). Checkpointed layouts are left out: a
    checkpoint keeps its input outside autograd's saved tensors, where the count does not see it.
    So is a pipeline in bf16 (torch.autocast over fp32 weights): the count under the CPU's autocast
    was 1.35x what the 3-D layout's first stage kept (FSDP2's bf16, parameters cast, is compared:
    HSDP in bf16, equal to the byte). So are Ulysses' sequence-parallel layouts: the count is a
    plain model's at seq / sp tokens, without lmrepo's sliced loss and the all-to-all's buffers
    (the data 2 x sequence 2 layout kept 4% more)."""
    from lmrepo import estimate
    from lmrepo.distributed.layout import ParallelLayout

    runs = [(list(words), 4, result) for words, result in four_ranks.runs.items()]
    runs += [(EIGHT_RANKS[name], 8, result) for name, result in eight_ranks.runs.items()]
    compared = 0
    for words, ranks, result in runs:
        config = load_config(words)
        micro, pipelined = config.trainer.micro_batch_size, config.pipeline.schedule != "none"
        autocast = pipelined and config.precision.dtype != "fp32"
        if config.checkpointing.enabled or autocast or config.sequence_parallel.size > 1:
            continue  # the pipeline's bf16 is torch.autocast; Ulysses: see the docstring
        layout = ParallelLayout.of(config, ranks)
        microbatches = config.trainer.global_batch_size // (micro * layout.dp)
        # by tensor-parallel rank: a head split by vocabulary holds 129 rows of 257 on one, 128 on the other
        counted = [estimate.layout_activations(config, layout, micro, microbatches, t) for t in range(layout.tp)]
        if counted[0] is None:
            continue  # a mixture of experts: not counted (lmrepo.estimate.counted_activations)
        for rank, measured in enumerate(result["activations_peak"]):
            expected = counted[layout.coordinates(rank)["tp"]][1]
            assert measured["step"] == pytest.approx(expected[layout.stage(rank)], rel=1e-4), (words, rank, expected)
            # Nothing outlives a step, but on a torch pipeline's first stage: part of the graph of the
            # forward torch.distributed.pipelining infers the stage's shapes with (in the first step)
            # stays held for the run, with or without FSDP2 (this model: 62 KB, 37% of a micro batch's)
            if not pipelined:
                assert measured["between"] == 0, (words, rank, measured)
        compared += 1
    assert compared >= 11


def continues(result: dict, reference: dict, after: int) -> None:
    """A resumed run's steps against the uninterrupted run's steps after `after`: losses and norms
    within the rounding of another reduction order (the first resumed norm drifts as later norms
    do: Adam has amplified three steps of rounding by then)."""
    from test_composition import FP32, close

    assert "losses" in result, result
    theirs = {key: reference[key][after:] for key in ("losses", "grad_norms")}
    for step, (loss, norm, their_loss, their_norm) in enumerate(
        zip(result["losses"], result["grad_norms"], theirs["losses"], theirs["grad_norms"], strict=True), after + 1
    ):
        assert close(loss, their_loss, FP32["loss"]) and close(norm, their_norm, FP32["norm"]), (step, result, theirs)


@pytest.mark.distributed
def test_every_layout_resumes_bit_for_bit(four_ranks, eight_ranks):
    """HSDP, data x tensor (of Llama, of the Mixtral-style model, and with Muon), the experts split
    by expert parallelism, pipeline x data,
    pipeline x tensor (4 ranks) and both 3-D layouts (8
    ranks), each saved at step 3 and resumed on itself by a fresh engine: steps 4-6 give the
    uninterrupted run's losses and gradient norms exactly. A state restored approximately (a
    moment, the rate, the data position, a slice of a DTensor) moves them at once."""
    pairs = [(four_ranks, layout) for layout in SAVED_4] + [(eight_ranks, n) for n in SAVED_8 if n != "flat"]
    for probed, layout in pairs:
        resumed, run = probed.resumed[layout, layout], probed.runs[layout]
        assert "losses" in resumed, resumed
        assert resumed["losses"] == run["losses"][SAVE_AT:], layout
        assert resumed["grad_norms"] == run["grad_norms"][SAVE_AT:], layout


@pytest.mark.distributed
def test_checkpoints_reshard_from_2x2_to_4x1_to_one_rank(four_ranks, one_rank):
    """The data x tensor checkpoint resumed by FSDP2 over 4 ranks, whose step-4 checkpoint one
    process resumes: each continues the uninterrupted 2 x 2 run. A pipeline x tensor checkpoint
    resumed without the pipeline, and a pipeline x data one by HSDP: a pipeline's layer files load
    into a model that has no stages. The Mixtral-style data x tensor checkpoint (split attention,
    whole experts on each rank) resumed with the experts split by expert parallelism, whose
    checkpoint FSDP2 over 4 ranks (every expert on every rank) resumes: each expert is saved under
    its global index, whichever rank held it. A sequence-parallel checkpoint (FSDP2 over the data x
    sequence ranks) resumed by HSDP."""
    tensor = four_ranks.runs[TP_4]
    continues(four_ranks.resumed[TP_4, FSDP2_4], tensor, SAVE_AT)
    continues(one_rank["chain"], tensor, CHAIN_AT)
    for saved, layout in RESHARDED_4[1:]:
        continues(four_ranks.resumed[saved, layout], four_ranks.runs[saved], SAVE_AT)


@pytest.mark.distributed
def test_a_3d_checkpoint_resumes_exports_evaluates_and_generates_on_one_process(eight_ranks, one_rank, tmp_path):
    """The pipeline x data x tensor checkpoint (8 ranks): one process resumes it and continues the
    3-D run. scripts/export_hf.py writes a directory transformers loads with the weights of the
    8-rank FSDP2 run at the same step (NORM_STEPS: their gradient norms agree so far); lm-eval
    scores it as that run's weights; scripts/generate.py writes from it."""
    from test_evaluate import assert_same_results, in_process
    from transformers import AutoModelForCausalLM

    from lmrepo.data.tokenizer import load_tokenizer
    from lmrepo.export import consolidate

    continues(one_rank["3-D"], eight_ranks.runs["tensor"], SAVE_AT)
    tags = {
        name: composition.case_dir(eight_ranks.out, eight_ranks.words(name)) / "checkpoints" / f"step_{SAVE_AT:08d}"
        for name in ("tensor", "flat")
    }
    exported = tmp_path / "hf"
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "export_hf.py"), str(tags["tensor"]), str(exported)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    flat = consolidate(str(tags["flat"]))
    weights = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert_close(weights, flat.model.state_dict(), NORM_STEPS, "the exported 3-D weights")

    tokenizer = load_tokenizer(flat.config.tokenizer)
    scores = [in_process(consolidate(str(tags[n])).model, tokenizer, ["shakespeare_cloze"]) for n in tags]
    assert_same_results(*(score["results"] for score in scores))

    out = tmp_path / "out.json"
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "generate.py"), f"run={tags['tensor']}", "prompt=ROMEO:",
         "max_new_tokens=4", f"json={out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["prompt"] == "ROMEO:"


@pytest.mark.distributed
def test_a_tensor_parallel_run_killed_resumes_bit_for_bit(tmp_path):
    """engine=fsdp2 tp=auto on 2 ranks (a data 1 x tensor 2 mesh) killed with SIGKILL mid-run (the
    launcher's process group, as an OOM killer or a lost node ends a job): `latest` names a whole
    DCP checkpoint of the 2-D mesh (its last save may be half written, in the background), and
    resuming from it gives the killed run's own losses and norms for the steps it had logged.
    Every other layout's resume is bit for bit too (test_every_layout_resumes_bit_for_bit)."""
    run_dir = tmp_path / "run"
    overrides = [*composition.overrides("fsdp2", "autotp"), "trainer.max_steps=400", "trainer.save_every=3"]
    latest = int(kill_9_after_a_save(overrides, run_dir, logged=8, steps_after=True).split("_")[1])
    killed = {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(run_dir) if "loss" in m}
    assert max(killed) > latest, (killed, latest)
    until = max(killed)
    resumed = run_train([*TINY, *overrides, f"trainer.max_steps={until}", "run.resume=auto"], run_dir, ranks=2)
    assert_ok(resumed)
    ours = {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(run_dir) if "loss" in m and m["step"] > latest}
    assert ours == {step: logged for step, logged in killed.items() if step > latest}


@pytest.mark.distributed
def test_fsdp2_pipeline_checkpoint_resumes_on_one_process_without_stages(tmp_path):
    """A pipeline x data (2 x 2) checkpoint of engine=fsdp2, by train.py: whole tensors by name in one
    file per layer (each stage's shards gathered on save), so one process without a pipeline
    resumes it with the same global batch (run.resume, as a user types it). The steps after it are
    the uninterrupted run's within STEPS_FP32 (another reduction order); an optimizer state lost
    or mapped to the wrong parameter moves them by far more (Adam's steps restart)."""
    job = [*PP_4, "trainer.max_steps=6", "trainer.save_every=3", "trainer.eval_every=0"]
    four, one = tmp_path / "four", tmp_path / "one"
    assert_ok(run_train(job, four, ranks=4))
    files = {p.name for p in (four / FIRST).iterdir()}
    assert {"layer_00-model_states.pt", "layer_00-optim_states.pt"} <= files, files
    alone = [*composition.overrides("fsdp2"), "trainer.max_steps=6", f"run.resume={four / FIRST}"]
    assert_ok(run_train(alone, one))
    reference = {step: loss for step, loss in lines(four, "loss").items() if step > 3}
    assert sorted(lines(one, "loss")) == sorted(reference)
    assert_close(lines(one, "loss"), reference, STEPS_FP32, "losses on one process after a 2 x 2 checkpoint")


@pytest.mark.distributed
def test_fsdp2_tensor_parallel_equals_one_process_and_exports_whole(tmp_path):
    """engine=fsdp2 tp=auto on 2 ranks (data 1 x tensor 2: both ranks read the same samples) against
    one unsharded process on the same global batch: fp32, clipping at every step (norms 1.4-2 over
    a clip of 0.5), a constant rate. Losses of every step within the FP32 loss tolerance, the first
    gradient norm within 1e-4, the later ones 2e-3 (tests/test_composition.py says why). Its DCP
    checkpoints joined in one process (scripts/export_hf.py's consolidation: DCP reshards the 2-D
    sharded slices into whole tensors) are the one process's weights by norm (NORM_STEPS, as their
    gradient norms agree); slices joined wrongly or left out are off by their whole size."""
    from test_composition import FP32

    from lmrepo.export import consolidate

    llama = [*TINY, "model=llama-tiny", "model.n_kv_head=2", "model.n_inner=128", "trainer.save_every=3"]
    job = [*llama, "trainer.grad_clip=0.5", "schedule=constant", "schedule.warmup_steps=0"]
    sharded, one = tmp_path / "tp2", tmp_path / "one"
    assert_ok(run_train([*job, "engine=fsdp2", "tp=auto"], sharded, ranks=2))
    assert_ok(run_train(job, one))
    assert_close(lines(sharded, "loss"), lines(one, "loss"), FP32["loss"], "losses")
    norms = [lines(run_dir, "grad_norm") for run_dir in (sharded, one)]
    assert_close(norms[0][1], norms[1][1], FP32["first_norm"], "the first gradient norm")
    assert_close(norms[0], norms[1], FP32["norm"], "gradient norms")
    for tag in ("step_00000003", "step_00000006"):
        weights = [consolidate(str(run_dir / "checkpoints" / tag)).model.state_dict() for run_dir in (sharded, one)]
        assert_close(*weights, NORM_STEPS, f"weights at {tag}")
