"""Checkpoints that never lose work, on real 2-rank CPU runs: resumed equals uninterrupted,
kill -9 during a save keeps a loadable `latest`, SIGTERM saves and stops, a different
data-parallel size resumes through the universal format, export to Hugging Face."""

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness import (
    BF16,
    FORKED_PYTHON,
    GPT2,
    REPO,
    TINY,
    assert_ok,
    kill_9_after_a_save,
    read_metrics,
    run_train,
    stop_with_signal,
)
from numerics import STEPS_FP32, assert_close, reordered_sum

pytestmark = pytest.mark.distributed

FIRST = "checkpoints/step_00000003"


def trajectory(run_dir: Path, after: int = 0) -> list[tuple]:
    """(step, loss, lr) and (step, eval_loss) lines past `after`: what must match exactly."""
    return [
        (m["step"], m.get("loss"), m.get("lr"), m.get("eval_loss"))
        for m in read_metrics(run_dir)
        if m["step"] > after and ("loss" in m or "eval_loss" in m)
    ]


# One layout per optimizer DeepSpeed builds: ZeRO-0 fp32, ZeRO-1/2's (with CPU offload, and bf16
# with accumulation), ZeRO-3's. (ZeRO-1 and ZeRO-3 fp32 also resumed bit for bit when measured.)
@pytest.mark.parametrize(
    "overrides",
    [
        ("zero=stage0", "precision=fp32"),
        ("zero=stage2", "precision=fp32", "offload=cpu"),
        ("zero=stage2", *BF16, "trainer.grad_accum=2"),
        ("zero=stage3", *BF16),
    ],
    ids=["stage0-fp32", "stage2-fp32-cpu", "stage2-bf16-2", "stage3-bf16"],
)
def test_resumed_run_equals_uninterrupted(launch2, overrides):
    uninterrupted = launch2(*overrides)
    resumed = launch2(*overrides, f"run.resume={uninterrupted / FIRST}")
    assert trajectory(resumed) == trajectory(uninterrupted, after=3)  # bit for bit: loss, lr, eval loss


def test_resume_on_other_rank_counts_through_the_universal_checkpoint(launch2, tmp_path):
    """2 ranks -> 1 rank -> 3 ranks, ZeRO-2, global batch 12 throughout (micro 2 x accum 3/6/2):
    the partitions are re-cut automatically and the loss continues where it was."""
    batch = ["zero=stage2", "precision=fp32", "trainer.micro_batch_size=2", "trainer.max_steps=8"]
    two_ranks = launch2(*batch, "trainer.grad_accum=3")
    one_rank = tmp_path / "one"
    assert_ok(
        run_train(
            [*TINY, *batch, "trainer.grad_accum=6", "trainer.save_every=3", f"run.resume={two_ranks / FIRST}"], one_rank
        )
    )
    assert (two_ranks / (FIRST + "_universal")).is_dir()
    three_ranks = tmp_path / "three"
    assert_ok(
        run_train(
            [*TINY, *batch, "trainer.grad_accum=2", f"run.resume={one_rank / 'checkpoints/step_00000006'}"],
            three_ranks,
            ranks=3,
        )
    )
    reference = trajectory(two_ranks)
    for resumed, after in ((one_rank, 3), (three_ranks, 6)):
        ours, theirs = trajectory(resumed), [t for t in reference if t[0] > after]
        assert [t[0] for t in ours] == [t[0] for t in theirs]
        for (_, loss, lr, _), (_, ref_loss, ref_lr, _) in zip(ours, theirs):
            assert lr == ref_lr
            if loss is not None:  # other rank counts sum in another order
                assert_close(loss, ref_loss, STEPS_FP32, f"the loss after {after} steps on another rank count")


def test_sigterm_saves_and_stops_then_auto_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["zero=stage2", "precision=fp32", "trainer.max_steps=400", "schedule=constant"]
    stopped_at, output = stop_with_signal(signal.SIGTERM, overrides, run_dir)
    assert "run.resume=auto" in output
    resumed = run_train([*TINY, *overrides, f"trainer.max_steps={stopped_at + 2}", "run.resume=auto"], run_dir, ranks=2)
    assert_ok(resumed)
    steps = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
    assert steps == list(range(1, stopped_at + 3)), "no step replayed or skipped"


def test_a_checkpoint_resumes_with_the_adam_that_wrote_it(tmp_path):
    """A CPU checkpoint written by DeepSpeed's FusedAdam (lmrepo before it chose torch's fused
    AdamW on a CPU, or a JSON's torch_adam: false) continues with FusedAdam: torch's would read
    step 0 from its state and restart the bias correction (the loss was 0.3% off by step 5)."""
    fused = tmp_path / "fused.json"
    fused.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}}))
    written = tmp_path / "fused"
    assert_ok(run_train([*TINY, "trainer.save_every=3", f"deepspeed_config={fused}"], written))
    resumed = run_train([*TINY, f"run.resume={written / FIRST}"], tmp_path / "resumed")
    assert_ok(resumed)
    assert "resuming with DeepSpeed's FusedAdam" in resumed.stdout
    assert trajectory(tmp_path / "resumed") == trajectory(written, after=3)


@pytest.mark.parametrize("engine", ["zero=stage0", "zero=stage2", "engine=fsdp2"])
def test_a_resume_with_other_optimizer_settings_trains_with_them(tmp_path, engine):
    """torch's and DeepSpeed's optimizers load their groups' hyperparameters with the moments: a
    resume with another weight decay or betas trained on with the checkpoint's, while the run's
    config said the new ones. ZeRO-0 steps torch's AdamW itself, ZeRO-2 wraps it, FSDP2 loads it
    through DCP."""
    words = [*TINY, engine, "precision=fp32"]
    assert_ok(run_train([*words, "trainer.max_steps=2", "trainer.save_every=2"], tmp_path / "saved"))
    resumed = run_train(
        [*words, "trainer.max_steps=3", "trainer.save_every=1", "optimizer.weight_decay=0.3",
         "optimizer.betas=[0.8,0.9]", f"run.resume={tmp_path / 'saved' / 'checkpoints' / 'step_00000002'}"],
        tmp_path / "resumed",
    )  # fmt: skip
    assert_ok(resumed)
    assert "resuming with optimizer.weight_decay=0.3 (was 0.1), optimizer.betas=[0.8, 0.9] (was [0.9, 0.95])" in (
        resumed.stdout
    )
    tag_dir = tmp_path / "resumed" / "checkpoints" / "step_00000003"
    if engine == "zero=stage0":
        groups = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["optimizer"]["param_groups"]
    elif engine == "zero=stage2":
        optimizer = torch.load(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
        groups = optimizer["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(tag_dir, tmp_path / "fsdp2.pt")
        groups = torch.load(tmp_path / "fsdp2.pt", weights_only=False)["optimizer"]["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"])) for g in groups] == [(0.3, (0.8, 0.9)), (0.0, (0.8, 0.9))]


def test_kill_9_during_saves_keeps_latest_loadable(tmp_path):
    run_dir = tmp_path / "run"
    # A checkpoint every step: most of the run's time is spent saving, so the kill lands in one.
    overrides = ["zero=stage2", "precision=fp32", "trainer.max_steps=400", "trainer.save_every=1"]
    latest = kill_9_after_a_save(overrides, run_dir, logged=4)
    files = sorted(p.name for p in (run_dir / "checkpoints" / latest).iterdir())
    assert {"mp_rank_00_model_states.pt", "rng_rank00000.pt", "rng_rank00001.pt"} <= set(files)
    assert sum("zero_pp_rank" in f for f in files) == 2
    step = int(latest.split("_")[1])
    resumed = run_train(
        [*TINY, "zero=stage2", "precision=fp32", f"trainer.max_steps={step + 1}", "run.resume=auto"], run_dir, ranks=2
    )
    assert_ok(resumed)
    assert f"resumed from {run_dir / 'checkpoints' / latest} at step {step}" in resumed.stdout


@pytest.mark.parametrize("stage", [0, 3])
def test_export_loads_in_transformers_with_the_runs_eval_loss(launch2, tmp_path, stage):
    from transformers import AutoModelForCausalLM

    from lmrepo.data.loader import Layout, LMData
    from lmrepo.data.prepare import prepare
    from lmrepo.data.tokenizer import load_tokenizer

    run_dir = launch2(f"zero=stage{stage}", "precision=fp32")
    out = tmp_path / "hf"
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "export_hf.py"), str(run_dir), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    # The run evaluated 2 batches on each of 2 ranks: the same blocks are 4 batches on one.
    data = LMData(
        prepare(cfg.data, tokenizer),
        cfg.data.block_size,
        "gpt2",
        tokenizer,
        Layout(global_batch=4, micro_batch=4, dp_rank=0, dp_size=1),
        cfg.trainer.seed,
        eval_batches=4,
    )
    with torch.no_grad():
        eval_loss = torch.stack([model(**batch).loss for batch in data.eval_batches()]).mean().item()
    expected = [m["eval_loss"] for m in read_metrics(run_dir) if "eval_loss" in m][-1]
    # The same weights and blocks, the mean over 4 x 4 x 32 tokens taken in another grouping (4
    # batches here, 2 per rank there); the weights of another step are 1e-3 or more off.
    assert_close(eval_loss, expected, reordered_sum(4 * 4 * 32), "eval loss")


def test_corrupt_and_mismatched_checkpoints_stop_before_training(launch2, tmp_path):
    source = launch2("zero=stage0", "precision=fp32", *GPT2) / FIRST  # BERT's WordPiece fits its embedding
    broken = tmp_path / "broken" / "step_00000003"
    shutil.copytree(source, broken)
    states = broken / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    cases = [
        ([f"run.resume={broken}"], "truncated"),
        ([f"run.resume={source}", "model.n_embd=128"], "another model"),
        ([f"run.resume={source}", "model.tokenizer=bert", "model.vocab_size=50257"], "vocabulary"),
        # DeepSpeed looked for ZeRO-2's partitioned optimizer files and failed on a missing one
        ([f"run.resume={source}", "zero=stage2"], "saved at ZeRO stage 0 in fp32"),
        ([f"run.resume={source}", "optimizer=muon"], "saved with optimizer=adamw"),
    ]
    for number, (overrides, expected) in enumerate(cases):
        run_dir = tmp_path / "runs" / str(number)
        proc = run_train([*TINY, *GPT2, *overrides], run_dir)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert expected in proc.stderr and "Traceback" not in proc.stderr
        assert not run_dir.exists()
