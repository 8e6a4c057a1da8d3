"""torch.distributed.pipelining schedules (pipeline=gpipe, 1f1b_torch, interleaved; lmrepo/engines/torch_pipeline.py).

Real 2-rank launches (4 in all) against a 1-rank run without a pipeline, same seed, data and
global batch: with 2 stages on 2 ranks the data-parallel size is 1, so both read the same
samples and the same held-out batches; trainer.grad_accum=2 micro-batches per step on both.

Tolerance: STEPS_FP32, 1e-5 relative (tests/numerics.py). Both compute the same layers on the
same weights; what may differ is float rounding: the schedule scales the summed micro-batch
gradients by 1/2 where DeepSpeed scales each micro-batch loss, torch's AdamW against DeepSpeed's
FusedAdam, the clip norm summed per stage. That is ~1e-7 relative per step (measured here:
bit-identical over 6 steps), far below the ~1e-2 a single optimizer step moves the loss, so a
wrong gradient, a missing tied-weight reduction or a wrong LR would fail.
"""

import pytest
import torch

from harness import TINY, assert_ok, read_metrics, run_train, train_losses
from lmrepo.engines.torch_pipeline import partition, tied_owner
from lmrepo.models import build_model, pipe
from lmrepo.models.pipe import is_tied_copy
from lmrepo.plan.compose import compose_config
from numerics import STEPS_FP32, assert_close, reordered_sum

PIPE = ("trainer.grad_accum=2", "precision=fp32")  # 2 micro-batches: at least one per stage
LAYERS4 = ("model.n_layer=4",)  # interleaved: 2 ranks x 2 chunks, each chunk a transformer layer


def eval_loss(run_dir) -> float:
    return [m["eval_loss"] for m in read_metrics(run_dir) if "eval_loss" in m][-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1-rank runs without a pipeline, keyed by extra overrides."""
    root, runs = tmp_path_factory.mktemp("reference"), {}

    def run(*overrides: str):
        if overrides not in runs:
            run_dir = root / f"run{len(runs)}"
            assert_ok(run_train([*TINY, *PIPE, *overrides], run_dir))
            runs[overrides] = run_dir
        return runs[overrides]

    return run


# --- in-process: the split ----------------------------------------------------------------


def gpt2_layers(n_layer: int) -> list:
    cfg = compose_config([f"model.n_layer={n_layer}", "model.n_head=2", "model.n_embd=64", "data.block_size=32"])
    return pipe.pipeline_layers(build_model(cfg.model), "gpt2")


def test_partition_splits_where_deepspeed_does():
    layers = gpt2_layers(2)  # embed, block, block, norm, head (tied)
    # DeepSpeed's PipelineModule printed this split for the same model (pipeline=1f1b):
    # stage 0 = embed + block 0, stage 1 = block 1 + norm + head (the two vocabulary matrices balance).
    assert partition(layers, 2, "parameters") == [0, 2, 5]
    assert partition(layers, 2, "uniform") == [0, 3, 5]
    assert partition(layers, 2, "type:GPT2Block") == [0, 2, 5]


def test_interleaved_chunks_each_hold_one_block():
    layers = gpt2_layers(4)
    parts = partition(layers, 4, "type:GPT2Block")
    names = [[layers[i].typename.__name__ for i in range(a, b)] for a, b in zip(parts, parts[1:])]
    assert [n.count("GPT2BlockPipe") for n in names] == [1, 1, 1, 1]
    assert parts[0] == 0 and parts[-1] == len(layers)


def test_tied_head_is_a_copy_of_the_embedding():
    layers = gpt2_layers(2)
    assert [is_tied_copy(spec) for spec in layers] == [False, False, False, False, True]
    assert tied_owner(layers, 4) == 0 and tied_owner(layers, 2) == 2


# --- real launches ------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b_torch"])
def test_schedule_matches_no_pipeline(launch2, reference, schedule):
    run_dir = launch2(*PIPE, f"pipeline={schedule}")
    ref = reference()
    assert_close(train_losses(run_dir), train_losses(ref), STEPS_FP32, "losses")
    assert_close(eval_loss(run_dir), eval_loss(ref), STEPS_FP32, "eval loss")
    # The LR comes from DeepSpeed's own scheduler class: the same rate at every step.
    lrs = [[m["lr"] for m in read_metrics(d) if "lr" in m] for d in (run_dir, ref)]
    assert lrs[0] == lrs[1]


@pytest.mark.distributed
def test_interleaved_matches_no_pipeline(launch2, reference):
    run_dir = launch2(*PIPE, *LAYERS4, "pipeline=interleaved", "pipeline.partition=type:GPT2Block")
    ref = reference(*LAYERS4)
    losses = train_losses(run_dir)
    assert losses[-1] < losses[0]
    assert_close(losses, train_losses(ref), STEPS_FP32, "losses")
    assert_close(eval_loss(run_dir), eval_loss(ref), STEPS_FP32, "eval loss")


@pytest.mark.distributed
def test_checkpoint_has_deepspeeds_pipeline_layout(launch2):
    tag_dir = launch2(*PIPE, "pipeline=gpipe") / "checkpoints" / "step_00000006"
    files = {f.name for f in tag_dir.iterdir()}
    # One file per layer that owns parameters (the tied head has none), as DeepSpeed names them.
    assert {
        "layer_00-model_states.pt",
        "layer_01-model_states.pt",
        "layer_02-model_states.pt",
        "layer_03-model_states.pt",
    } <= files and "layer_04-model_states.pt" not in files
    # Beside each, its parameters' optimizer states by name: any pipeline split loads them.
    assert {"mp_rank_00_model_states.pt", *(f"layer_{i:02d}-optim_states.pt" for i in range(4))} <= files
    assert "layer_04-optim_states.pt" not in files and not any(name.startswith("torch_pipe_rank") for name in files)
    states = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["module"] is None and states["step"] == 6 and states["dp_size"] == 1
    assert set(torch.load(tag_dir / "layer_00-model_states.pt")) == {"wte.weight", "wpe.weight"}


@pytest.mark.distributed
def test_resume_continues_the_same_losses(launch2, tmp_path):
    original = launch2(*PIPE, "pipeline=1f1b_torch")
    resumed = tmp_path / "resumed"
    assert_ok(
        run_train(
            [*TINY, *PIPE, "pipeline=1f1b_torch", f"run.resume={original / 'checkpoints' / 'step_00000003'}"],
            resumed,
            ranks=2,
        )
    )
    after = {m["step"]: m["loss"] for m in read_metrics(resumed) if "loss" in m}
    before = {m["step"]: m["loss"] for m in read_metrics(original) if "loss" in m}
    assert sorted(after) == [4, 5, 6]
    # Weights, AdamW moments, LR schedule position and data position all come back: exactly. The
    # last stage's tied head loads the embedding's weights and moments from stage 0's file: equal
    # to its own only if every step gave both copies the same update (the sum of both ends').
    assert [after[s] for s in (4, 5, 6)] == [before[s] for s in (4, 5, 6)]
    assert eval_loss(resumed) == eval_loss(original)


# Muon on an untied Llama (its LM head a layer of the last stage), clipping on, the schedule's decay
# from step 3 (the checkpoint at step 3 resumes mid-decay).
MUON_LLAMA = (
    "model=llama-tiny",
    "model.n_kv_head=2",
    "optimizer=muon",
    "schedule=wsd",
    "schedule.decay_fraction=0.5",
    "trainer.grad_clip=0.5",
)


@pytest.mark.distributed
def test_muon_per_stage_equals_one_process_and_resumes_mid_decay(launch2, reference, tmp_path):
    """optimizer=muon with pipeline=gpipe: each stage splits its parameters by role (the LM head, a
    layer of the last stage, takes AdamW as in the whole model) and trains as DeepSpeed's Muon in
    one process: the first loss and gradient norm to fp32, then within composition's Muon
    tolerance (Newton-Schulz in bf16). Giving the head to Muon moved the sixth loss by 6e-3. Resumed
    from step 3, mid-decay, it continues bit for bit: the AdamW half steps the states and rates it
    loaded (it stepped the ones from before the load, fresh moments, before lmrepo shared them)."""
    from test_composition import MUON_UPDATED_LOSS

    run_dir, ref = launch2(*PIPE, *MUON_LLAMA, "pipeline=gpipe"), reference(*MUON_LLAMA)
    ours, theirs = [[m for m in read_metrics(d) if "loss" in m] for d in (run_dir, ref)]
    assert_close(ours[0]["loss"], theirs[0]["loss"], STEPS_FP32, "first loss")
    assert_close(ours[0]["grad_norm"], theirs[0]["grad_norm"], STEPS_FP32, "first gradient norm")
    assert_close([m["loss"] for m in ours], [m["loss"] for m in theirs], MUON_UPDATED_LOSS, "losses")

    resumed = tmp_path / "resumed"
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert_ok(run_train([*TINY, *PIPE, *MUON_LLAMA, "pipeline=gpipe", f"run.resume={checkpoint}"], resumed, ranks=2))
    after = [(m["step"], m["loss"], m["lr"]) for m in read_metrics(resumed) if "loss" in m]
    assert after == [(m["step"], m["loss"], m["lr"]) for m in ours[3:]]


def test_the_tiled_loss_applies_the_head_tile_by_tile():
    """trainer.loss_tiles with a torch pipeline: the last stage ends at the final norm and the loss
    calls the LM head on one tile of the sequence at a time (never the whole micro-batch's
    logits), with the untiled loss's value and gradients."""
    from lmrepo.models.pipe import LMLoss, TiledLMLoss

    torch.manual_seed(0)
    head, shapes = torch.nn.Linear(16, 257, bias=False), []
    head.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    hidden = torch.randn(2, 32, 16, requires_grad=True)
    labels = torch.randint(0, 257, (2, 32))
    tiled = TiledLMLoss(head, 4)(hidden, labels)
    assert shapes == [(2, 8, 16)] * 4
    (tiled_grad,) = torch.autograd.grad(tiled, hidden)
    whole = LMLoss("llama", 257)(head(hidden), labels)
    (whole_grad,) = torch.autograd.grad(whole, hidden)
    # the same head and cross-entropy on the same rows, in two tile shapes: a kernel may block the
    # head's matmul otherwise, and each token's softmax sums the 257-entry vocabulary: within
    # reordered_sum(257) = 3.8e-6, the gradient by its norm
    assert_close(tiled.item(), whole.item(), reordered_sum(257), "loss")
    assert_close(tiled_grad, whole_grad, reordered_sum(257), "gradient")


# One stage of two chunks on each of 2 data-parallel ranks (one micro-batch each: the global batch
# of the one process's two), embeddings tied: the head is the embedding both chunks of a rank
# share, and evaluation hands chunk 0's output to chunk 1 on the same rank (at step 3 and the end)
ONE_STAGE_TIED = (
    "pipeline=interleaved",
    "pipeline.stages=1",
    "pipeline.virtual_stages=2",
    "trainer.grad_accum=1",
    "model.tie_embeddings=true",
    "trainer.eval_every=3",
)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout, model",
    [
        (("pipeline=1f1b_torch",), ("model=llama-tiny", "model.n_kv_head=2")),
        (ONE_STAGE_TIED, ("model=llama-tiny", "model.n_kv_head=2", "model.tie_embeddings=true")),
    ],
    ids=["1f1b", "one-stage-tied"],
)
def test_tiled_loss_as_the_last_stage_under_fsdp2_equals_one_process(launch2, reference, layout, model):
    """trainer.loss_tiles=2 with a torch pipeline under FSDP2: the LM head, called by the loss
    outside its chunk's forward, is an FSDP unit of its own (its call gathers its weight; a tied
    head whose weight two chunks of the rank share keeps it whole); the losses, gradient norms and
    (with one data-parallel rank) evaluation losses equal one untiled process without a pipeline.
    The one-stage layout evaluates through ZB-V's schedule (LoopedBFS refused its same-rank
    handoff: "can't steal_bwd_input"). (The composition matrix
    runs the tiled pair on DeepSpeed's engine.)"""
    run_dir = launch2(*PIPE, *model, "engine=fsdp2", "zero=stage3", *layout, "trainer.loss_tiles=2")
    ref = reference(*model, *[w for w in layout if w.startswith("trainer.eval_every")])
    ours, theirs = [[m for m in read_metrics(d) if "loss" in m] for d in (run_dir, ref)]
    for key in ("loss", "grad_norm"):
        assert_close([m[key] for m in ours], [m[key] for m in theirs], STEPS_FP32, key)
    evals = [[m["eval_loss"] for m in read_metrics(d) if "eval_loss" in m] for d in (run_dir, ref)]
    assert len(evals[0]) == len(evals[1]) >= 1 and all(0 < loss < 10 for loss in evals[0])
    if "pipeline.stages=1" not in layout:  # 2 data-parallel ranks evaluate 2 ranks' held-out batches
        assert_close(evals[0], evals[1], STEPS_FP32, "eval losses")


# A mixture of experts (4 experts of width 96, top-2, in both blocks) with a weighty load-balancing
# loss, and with DeepSeek's routing (the router bias moved 0.01 a step, a shared expert) in
# blocks that recompute in backward
MOE = (
    "model=mixtral-tiny",
    "model.n_kv_head=2",
    "model.n_inner=96",
    "model.moe.experts=4",
    "model.moe.aux_loss_coef=0.1",
)
DEEPSEEK = (*MOE, "model.moe.balance=aux_free", "model.moe.bias_update_rate=0.01", "model.moe.shared_experts=1")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "model, schedule", [(MOE, "gpipe"), ((*DEEPSEEK, "checkpointing=full"), "1f1b_torch")], ids=["moe", "deepseek"]
)
def test_moe_stages_train_as_one_process(launch2, reference, tmp_path, model, schedule):
    """MoE blocks in torch pipeline stages: each block's load-balancing loss gets its gradient in
    its own stage's backward (the last stage's loss has no path to it) and joins the logged loss;
    the router biases move from the loads of every stage's layers. Against one process without a
    pipeline: the losses, gradient norms, load-balancing term, routes per expert and evaluation
    losses of 6 steps. A stage's first step runs one forward more (torch's shape inference on
    uninitialised inputs), which must not count: counted, it moved the first loss by 2%. The DeepSeek
    case resumes from step 3 (the router bias in the layer's file) and continues the run."""
    run_dir, ref = launch2(*PIPE, *model, f"pipeline={schedule}"), reference(*model)
    ours, theirs = [[m for m in read_metrics(d) if "loss" in m] for d in (run_dir, ref)]
    for key in ("loss", "grad_norm", "aux_loss"):
        assert_close([m[key] for m in ours], [m[key] for m in theirs], STEPS_FP32, key)
    assert [m["expert_tokens"] for m in ours] == [m["expert_tokens"] for m in theirs]
    assert_close(eval_loss(run_dir), eval_loss(ref), STEPS_FP32, "eval loss")
    if model[-1] != "checkpointing=full":
        return
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    bias = [v for k, v in torch.load(checkpoint / "layer_01-model_states.pt").items() if k.endswith("route_bias")]
    assert len(bias) == 1 and bias[0].abs().sum() > 0
    resumed = tmp_path / "resumed"
    assert_ok(run_train([*TINY, *PIPE, *model, f"pipeline={schedule}", f"run.resume={checkpoint}"], resumed, ranks=2))
    after = [m for m in read_metrics(resumed) if "loss" in m]
    assert [(m["step"], m["loss"], m["expert_tokens"]) for m in after] == [
        (m["step"], m["loss"], m["expert_tokens"]) for m in ours[3:]
    ]


@pytest.mark.distributed
def test_which_checkpoints_a_torch_pipeline_resumes(launch2, tmp_path):
    """A torch schedule's checkpoint holds nothing of its split: another split resumes it (here one
    stage of two looped chunks), and so does engine=fsdp2 without a pipeline. A checkpoint without
    a pipeline cannot be split into stages, nor can one whose optimizer states an older lmrepo wrote
    per rank: one line each, before any process group."""
    import json
    import shutil

    from lmrepo.plan.compose import load_config
    from lmrepo.train import checkpoint
    from lmrepo.utils.errors import ConfigError

    def inspect(source, *overrides):
        config = load_config([*TINY, *PIPE, *overrides])
        return checkpoint.inspect(
            source, "step_00000003", config.model, config.model.vocab_size, config.pipeline, config.engine.name
        )

    piped = launch2(*PIPE, "pipeline=gpipe") / "checkpoints"
    looped = ("pipeline=interleaved", "pipeline.stages=1", "pipeline.virtual_stages=2")
    assert inspect(piped, *looped).step == 3
    assert inspect(piped, "pipeline=none", "engine=fsdp2").step == 3
    with pytest.raises(ConfigError, match="saved with another pipeline layout"):
        inspect(piped, "pipeline=none")  # DeepSpeed's engine reads its own files only
    with pytest.raises(ConfigError, match="saved with another pipeline layout"):
        inspect(launch2("zero=stage0", "precision=fp32") / "checkpoints", "pipeline=gpipe")
    older = tmp_path / "checkpoints"
    tag = shutil.copytree(piped / "step_00000003", older / "step_00000003")
    for path in tag.glob("layer_*-optim_states.pt"):
        path.unlink()
    per_rank = tag / "torch_pipe_rank_00000_optim_states.pt"
    torch.save({"stage": 0}, per_rank)
    files = {name: record for name, record in checkpoint.read_manifest(tag).items() if "optim_states" not in name}
    files[per_rank.name] = checkpoint.file_record(per_rank)
    (tag / "manifest.json").write_text(json.dumps({"files": files}))  # as that lmrepo recorded its files
    with pytest.raises(ConfigError, match="optimizer states per rank, as an older lmrepo wrote them"):
        inspect(older, "pipeline=gpipe")
