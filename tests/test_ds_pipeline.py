"""Pipeline parallelism with DeepSpeed's PipelineModule (pipeline=1f1b): the pipelined model
is the same model, so with the same seed, data and global batch its training loss follows
the non-pipelined run's; its checkpoints export to the same transformers model; invalid
layouts stop before launch.

Layouts compared: a 2-stage pipeline on 2 ranks is one data-parallel replica taking the
global batch of 8 as 2 micro batches of 4; the reference is 2 data-parallel ranks of 4 (which
equals 1 rank accumulating 2 micro batches to the bit, measured). Both see the same 8 samples
per step and average the loss over them.

Tolerance, fp32: only the association of floating-point sums differs (the tied embedding's
gradient is (emb_1 + emb_2) + (head_1 + head_2) in a pipeline, each stage accumulating its own
use before the all-reduce adds them, and (emb_1 + head_1) + (emb_2 + head_2) without one):
PIPELINE_FP32, 1e-6 relative over 6 steps (tests/numerics.py; measured: 9e-8). This bar caught
DeepSpeed's fp32 pipeline clipping by the first stage's gradient norm alone (1.3e-5 at step 6; see
lmrepo.engines.deepspeed_pipeline.count_every_stage_in_clip_norm); the exact one-step gradient and clip factor are
checked separately (test_tied_embedding_gradients_and_clip_match_the_whole_model).
"""

import subprocess

import pytest
import torch
from safetensors.torch import load_file

from harness import BERT, CPU, GPU, REPO, TINY, assert_ok, launcher, read_metrics, run_train, train_losses, validate
from lmrepo.export import export
from lmrepo.plan.compose import compose_config, load_config
from lmrepo.utils.errors import ConfigError
from numerics import PIPELINE_FP32, VOCAB, assert_close, reordered_sum

PIPELINE = ["pipeline=1f1b", "precision=fp32", "trainer.grad_accum=2", "trainer.save_every=3"]


@pytest.fixture(scope="module")
def gpt2_pipeline(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pipe") / "gpt2"
    assert_ok(run_train([*TINY, *PIPELINE], run_dir, ranks=2))
    return run_dir


@pytest.mark.distributed
def test_gpt2_pipeline_matches_data_parallel(gpt2_pipeline, launch2):
    reference = launch2("zero=stage0", "precision=fp32")
    assert_close(train_losses(gpt2_pipeline), train_losses(reference), PIPELINE_FP32, "losses")
    first = read_metrics(gpt2_pipeline)[0]
    assert first["tokens"] == 8 * 32, "one step is the global batch of 8 blocks"
    # the step's bubble, from DeepSpeed's timed pipeline instructions, on every training line
    assert all(0 < m["bubble"] < 1 for m in read_metrics(gpt2_pipeline) if "loss" in m)


@pytest.mark.distributed
def test_bert_pipeline_matches_data_parallel(tmp_path, launch2):
    bert = [*BERT, "data.block_size=32"]
    reference = launch2(*bert, "zero=stage0", "precision=fp32")
    assert_ok(run_train([*TINY, *bert, *PIPELINE, "checkpointing=full"], tmp_path / "bert", ranks=2))
    assert_close(train_losses(tmp_path / "bert"), train_losses(reference), PIPELINE_FP32, "losses")


@pytest.mark.distributed
def test_data_x_pipeline_on_4_ranks(tmp_path, launch2):
    """2 stages x 2 data-parallel replicas: each replica takes its own half of the batch; the
    evaluation set (per data-parallel rank) is the reference's too, so eval losses agree."""
    reference = launch2("zero=stage0", "precision=fp32")
    assert_ok(run_train([*TINY, "pipeline=1f1b", "precision=fp32", "trainer.eval_every=6"], tmp_path / "dp2", ranks=4))
    assert_close(train_losses(tmp_path / "dp2"), train_losses(reference), PIPELINE_FP32, "losses")
    evals = [[m["eval_loss"] for m in read_metrics(run) if "eval_loss" in m] for run in (tmp_path / "dp2", reference)]
    assert_close(*evals, PIPELINE_FP32, "eval losses")


@pytest.mark.distributed
def test_resumed_pipeline_continues_exactly(gpt2_pipeline, tmp_path):
    resumed = tmp_path / "resumed"
    assert_ok(
        run_train([*TINY, *PIPELINE, f"run.resume={gpt2_pipeline / 'checkpoints/step_00000003'}"], resumed, ranks=2)
    )
    assert train_losses(resumed) == train_losses(gpt2_pipeline)[3:]


@pytest.mark.distributed
def test_pipeline_checkpoint_exports_the_same_model(gpt2_pipeline, launch2, tmp_path):
    """Step 3 of the pipelined run and of the data-parallel run: the same transformers weights."""
    piped = load_file(
        export(str(gpt2_pipeline / "checkpoints/step_00000003"), tmp_path / "piped") / "model.safetensors"
    )
    plain = load_file(
        export(str(launch2("zero=stage0", "precision=fp32") / "checkpoints/step_00000003"), tmp_path / "plain")
        / "model.safetensors"
    )
    # Each tensor by its norm: three Adam steps carry the gradients' rounding into the weights as
    # into the losses (PIPELINE_FP32); a layer exported under another's name is off by its whole size.
    assert_close(piped, plain, PIPELINE_FP32, "exported weights")


@pytest.mark.distributed
def test_tied_embedding_gradients_and_clip_match_the_whole_model(tmp_path):
    """After DeepSpeed all-reduces the tied embedding's gradient, the first stage (input
    embedding) and the last (LM head) hold the same gradient: the whole model's, whose
    embedding matrix receives both uses."""
    proc = subprocess.run(
        [
            *launcher(2),
            str(REPO / "tests/probes/pipeline_probe.py"),
            str(tmp_path),
            *TINY,
            "pipeline=1f1b",
            "precision=fp32",
            "trainer.grad_accum=2",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert_ok(proc)
    first, last = (torch.load(tmp_path / f"tied_rank{r}.pt") for r in (0, 1))
    reference = torch.load(tmp_path / "reference.pt")
    assert torch.equal(first["grad"], last["grad"]) and torch.equal(first["weight"], last["weight"])
    # The whole model's gradient, by its norm: both sum the LM head's backward over the vocabulary
    # (the longest sum), in other orders. Either stage's own use alone is 50% or more off.
    assert_close(first["grad"], reference["grad"], reordered_sum(VOCAB), "tied embedding gradient")
    # Clipping scales by the whole model's gradient norm (DeepSpeed alone counts the first stage's,
    # some 15% smaller): the norm of gradients as close as the one above.
    assert first["clip_coef"] == last["clip_coef"]
    assert_close(first["clip_coef"], reference["clip_coef"], reordered_sum(VOCAB), "clip factor")
    assert first["clip_coef"] < 1, "the step must clip for this to test anything"


@pytest.mark.distributed
def test_zero2_pipeline_refused_before_launch(tmp_path):
    proc = run_train([*TINY, "pipeline=1f1b", "zero=stage2"], tmp_path / "run", ranks=2, via="deepspeed")
    assert proc.returncode == 2 and "supports ZeRO stage 0 or 1" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


# --- invalid layouts: one line naming what to change, before any process group -----------


@pytest.mark.parametrize(
    "overrides, world, device, expected",
    [
        (["pipeline=1f1b", "pipeline.stages=2"], 3, CPU, "does not divide the world size 3"),
        (["pipeline=1f1b", "pipeline.stages=8"], 8, CPU, "for a model of 4 layers"),
        (["pipeline=interleaved", "trainer.grad_accum=2"], 2, CPU, None),  # 2 x 2 chunks of 4 layers: valid
        (["pipeline=interleaved", "pipeline.virtual_stages=4", "trainer.grad_accum=2"], 2, CPU, "8 pipeline stages"),
        (["pipeline=1f1b", "zero=stage2"], 2, CPU, "supports ZeRO stage 0 or 1, not 2"),
        (["pipeline=1f1b", "zero=stage3"], 2, CPU, "supports ZeRO stage 0 or 1, not 3"),
        (["pipeline=gpipe", "zero=stage1"], 2, CPU, "runs DeepSpeed's ZeRO stage 0 only"),
        # the pair's own row speaks first: no ZeRO stage would make the torch pipeline offload
        (
            ["pipeline=gpipe", "offload=cpu", "zero=stage0"],
            2,
            CPU,
            "on DeepSpeed's engine does not offload: set offload=none, choose engine=fsdp2",
        ),
        (["pipeline=gpipe", "precision=fp16"], 2, GPU, "runs fp32 or bf16"),
        (["pipeline=gpipe", "engine=fsdp2", "offload=nvme"], 2, CPU, "engine=fsdp2 offloads to CPU memory only"),
        (["pipeline=1f1b_torch", "trainer.grad_accum=1"], 2, CPU, "at least as many micro-batches as stages"),
        (["pipeline=interleaved", "trainer.grad_accum=1"], 2, CPU, "at least as many micro-batches as stages"),
        (["pipeline=interleaved", "trainer.grad_accum=5"], 2, CPU, "multiple of the 2 rounds"),
        (["pipeline=interleaved", "pipeline.virtual_stages=1", "trainer.grad_accum=2"], 2, CPU, "virtual_stages >= 2"),
        (["pipeline=gpipe", "pipeline.virtual_stages=2"], 2, CPU, "needs pipeline=interleaved"),
        (["pipeline=1f1b", "pipeline.partition=balanced"], 2, CPU, "pipeline.partition=balanced is not"),
        (["pipeline=1f1b", "pipeline.partition=type:Attention"], 2, CPU, "matches 0 layers"),
        (["pipeline=1f1b", "pipeline.partition=type:GPT2Block"], 2, CPU, None),
        (["pipeline=1f1b", "trainer.compile=true"], 2, CPU, "trainer.compile=true is not supported"),
        (["pipeline=1f1b", "model=bert-tiny", "pipeline.stages=4"], 4, CPU, "for a model of 2 layers"),
    ],
)
def test_pipeline_layout(overrides, world, device, expected):
    """In process: every layout's verdict before launch."""
    cfg = compose_config(overrides)
    if expected is None:
        ds, _ = validate(cfg, world, device)
        assert (
            ds["train_batch_size"]
            == cfg.trainer.micro_batch_size * (cfg.trainer.grad_accum or 1) * world // cfg.pipeline.stages
        )
        return
    with pytest.raises(ConfigError, match=expected):
        validate(cfg, world, device)


def test_micro_batches_of_a_derived_grad_accum_count_per_replica():
    """trainer.grad_accum=null: the micro-batches a schedule gets are what the global batch makes
    on the data-parallel ranks of the layout (16 sequences, 4 per micro batch, 1 replica: 4), not 1."""
    overrides = ["pipeline=1f1b_torch", "trainer.global_batch_size=16", "trainer.micro_batch_size=4"]
    ds, _ = validate(compose_config([*overrides, "trainer.grad_accum=null"]), 2, CPU)
    assert ds["gradient_accumulation_steps"] == 4
    with pytest.raises(ConfigError, match="trainer.grad_accum=1 < pipeline.stages=2"):
        validate(compose_config([*overrides, "trainer.global_batch_size=8"]), 4, CPU)


def test_pipeline_engine_key_is_gone():
    """The engine follows from pipeline.schedule; an old command that set it is told so."""
    with pytest.raises(ConfigError, match="pipeline.engine is gone: the engine follows from pipeline.schedule"):
        load_config(["pipeline=1f1b", "pipeline.engine=torch"])
