"""The GPU-only paths, run where a GPU is (`pytest -m gpu`); skipped with the reason elsewhere.
fp16 with dynamic loss scaling also runs on a CPU whose DeepSpeed accelerator computes fp16
(AVX512-FP16, as a Xeon from Sapphire Rapids on has): that test asks the device, not the marker."""

import json
import subprocess

import pytest
import torch

from harness import PYTHON, REPO, TINY, assert_ok, read_metrics, run_train
from lmrepo.distributed.device import detect_device
from lmrepo.estimate import count_parameters, model_state_bytes
from lmrepo.models import meta_model
from lmrepo.plan.compose import load_config
from numerics import STEPS_FP32, assert_close

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (NCCL, CUDA memory, the GPU peak table)")


@pytest.mark.gpu
@pytest.mark.skipif(not detect_device("auto").fp16, reason="fp16 needs a GPU or a CPU with AVX512-FP16")
def test_fp16_dynamic_loss_scaling_logs_the_scale_and_skipped_steps(tmp_path):
    run_dir = tmp_path / "run"
    assert_ok(run_train([*TINY, "precision=fp16", "trainer.max_steps=12"], run_dir))
    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    assert all("loss_scale" in m and "skipped_steps" in m for m in steps)
    # Dynamic scaling starts at 2**16 and halves on each overflow: the scale never grows in 12 steps.
    scales = [m["loss_scale"] for m in steps]
    assert scales[0] <= 2**16 and scales == sorted(scales, reverse=True)
    assert steps[-1]["loss"] < steps[0]["loss"]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nccl_zero_stages_agree_on_every_visible_gpu(tmp_path, stage):
    ranks = torch.cuda.device_count()
    runs = {}
    for s in (0, stage):
        runs[s] = tmp_path / f"zero{s}"
        assert_ok(
            run_train(
                [*TINY, f"zero=stage{s}", "trainer.micro_batch_size=2"],
                runs[s],
                ranks=ranks if ranks > 1 else 0,
                via="deepspeed",
            )
        )
    reference = [m["loss"] for m in read_metrics(runs[0]) if "loss" in m]
    ours = [m["loss"] for m in read_metrics(runs[stage]) if "loss" in m]
    assert_close(ours, reference, STEPS_FP32, "losses")  # fp32: only summation order differs


@pytest.mark.gpu
@needs_gpu
def test_cuda_memory_covers_the_estimated_model_states_and_mfu_is_reported(tmp_path):
    run_dir = tmp_path / "run"
    assert_ok(run_train(["trainer.max_steps=4", "trainer.log_every=1", "logger=jsonl", "precision=bf16"], run_dir))
    last = [m for m in read_metrics(run_dir) if "loss" in m][-1]
    params = count_parameters(meta_model(load_config([]).model))  # the default gpt2-tiny
    states = model_state_bytes(params, stage=0, dp=1, dtype="bf16").gpu / 2**30
    assert states <= last["mem_gb"] <= states + 4, "max allocated = model states + activations of one micro batch"
    assert last["mfu"] is not None and 0 < last["mfu"] < 1, f"MFU against {torch.cuda.get_device_name()}'s peak"
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["bf16"]["enabled"]


@pytest.mark.gpu
@needs_gpu
def test_fsdp2_on_cuda_equals_deepspeed_zero3(tmp_path):
    """engine=fsdp2 on the CUDA mesh (NCCL) against DeepSpeed ZeRO-3, fp32, and its bf16
    MixedPrecisionPolicy run; on every visible GPU."""
    ranks = torch.cuda.device_count()
    launch = {"ranks": ranks if ranks > 1 else 0, "via": "deepspeed"}
    runs = {}
    for name, extra in (
        ("deepspeed", []),
        ("fsdp2", ["engine=fsdp2"]),
        ("fsdp2_bf16", ["engine=fsdp2", "precision=bf16"]),
    ):
        runs[name] = tmp_path / name
        assert_ok(run_train([*TINY, "zero=stage3", "trainer.micro_batch_size=2", *extra], runs[name], **launch))
    reference = [m["loss"] for m in read_metrics(runs["deepspeed"]) if "loss" in m]
    ours = [m["loss"] for m in read_metrics(runs["fsdp2"]) if "loss" in m]
    assert_close(ours, reference, STEPS_FP32, "losses")
    bf16 = [m for m in read_metrics(runs["fsdp2_bf16"]) if "loss" in m]
    assert bf16[-1]["loss"] < bf16[0]["loss"] and all("grad_norm" in m for m in bf16)


@pytest.mark.gpu
@needs_gpu
def test_muon_on_cuda_compiles_its_update_and_follows_the_reference(tmp_path):
    """optimizer=muon on one GPU: its update torch.compile'd (optimizer.compile=null on CUDA),
    four clipped steps against the plain-torch reference of tests/probes/muon_probe.py run on the CPU.
    Both orthogonalise in bf16, on other kernels: close, not equal (the CPU test is bit for bit)."""
    overrides = [*TINY, "trainer.max_steps=4", "optimizer=muon", "trainer.grad_clip=0.5"]
    overrides += ["schedule=wsd", "schedule.warmup_steps=0", "schedule.decay_fraction=0"]
    proc = subprocess.run(
        [PYTHON, str(REPO / "tests/probes/muon_probe.py"), str(tmp_path), *overrides], capture_output=True, text=True
    )
    assert_ok(proc)
    result = json.loads((tmp_path / "muon_probe.json").read_text())
    assert result["compiled"] is True
    # Each Newton-Schulz step rounds to bf16 (2**-8) on kernels that round otherwise, so the updates
    # differ by about that much relative; the loss moves by a learning-rate-sized fraction of it.
    assert_close(result["lmrepo"], result["reference"], 1e-3, "losses")
