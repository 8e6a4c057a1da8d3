"""Real 2-rank DeepSpeed runs on the CPU (gloo), started directly (conftest.launcher).

Same seed, data and global batch everywhere; every ZeRO stage, offload target and activation
checkpointing mode must give the same training loss. Tolerances (tests/numerics.py):
- fp32: the stages differ only in how gradients are reduced (all-reduce vs reduce-scatter,
  bucket order), i.e. float rounding: STEPS_FP32, 1e-5 relative over 6 steps (measured: ~1e-7).
- bf16: every stage keeps fp32 master weights, but gradients are reduced and activations
  computed in bf16, whose unit roundoff is 2**-8 = 0.4%; a different reduction order moves a
  gradient by up to that much and the difference compounds for a few steps: STEPS_BF16, 2e-2.
"""

import pytest

from harness import BF16, read_metrics, train_losses
from numerics import STEPS_BF16, STEPS_FP32, assert_close

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_agree_fp32(launch2, stage):
    reference = train_losses(launch2("zero=stage0", "precision=fp32"))
    assert_close(train_losses(launch2(f"zero=stage{stage}", "precision=fp32")), reference, STEPS_FP32, "losses")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_agree_bf16(launch2, stage):
    reference = train_losses(launch2("zero=stage0", *BF16))
    assert_close(train_losses(launch2(f"zero=stage{stage}", *BF16)), reference, STEPS_BF16, "losses")


def test_loss_falls_and_only_rank0_writes(launch2):
    run_dir = launch2("zero=stage0", "precision=fp32")
    losses = train_losses(run_dir)
    assert losses[-1] < losses[0]
    steps = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
    assert steps == sorted(set(steps)), "one metrics line per step: only rank 0 logs"
    assert [p.name for p in run_dir.parent.iterdir()].count(run_dir.name) == 1


def test_cpu_offload_matches_no_offload(launch2):
    for stage in (2, 3):
        reference = train_losses(launch2(f"zero=stage{stage}", "precision=fp32"))
        assert_close(
            train_losses(launch2(f"zero=stage{stage}", "precision=fp32", "offload=cpu")),
            reference,
            STEPS_FP32,
            "losses",
        )


def test_nvme_offload_matches_no_offload(launch2, tmp_path):
    # 3 steps, no checkpoint: every step through libaio is slow on this machine's disk.
    reference = train_losses(launch2("zero=stage3", "precision=fp32"))[:3]
    nvme = train_losses(
        launch2(
            "zero=stage3",
            "precision=fp32",
            "offload=nvme",
            f"offload.nvme_path={tmp_path}",
            "trainer.max_steps=3",
            "trainer.save_every=0",
        )
    )
    # Not rounding alone: the first step's loss, before any update, is already 3e-6 relative off
    # the in-memory run's (its gradient norm 1.3e-4; CPU offload is equal to the bit), the same on
    # AVX2 and SSE4.1 kernels. A gap this test shows, not explained yet; 0.3 of the tolerance.
    assert_close(nvme, reference, STEPS_FP32, "losses")


@pytest.mark.parametrize("mode", ["full", "every_n"])
def test_activation_checkpointing_matches_none(launch2, mode):
    reference = train_losses(launch2("zero=stage0", "precision=fp32"))
    assert_close(
        train_losses(
            launch2(
                "zero=stage0",
                "precision=fp32",
                f"checkpointing={mode}",
                "checkpointing.every_n_layers=1" if mode == "full" else "checkpointing.every_n_layers=2",
            )
        ),
        reference,
        STEPS_FP32,
        "losses",
    )
