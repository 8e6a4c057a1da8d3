"""DeepSpeed JSONs as the ecosystem writes them (tests/data/ds_configs/, copied verbatim, origins
in its README), each through `python train.py deepspeed_config=FILE` on a tiny GPT-2 for 2 steps:
it trains, or stops before launch with exactly one `lmrepo: error:` line naming the JSON key and
exit 2; never a traceback. Plus the 2-rank cases and a resume with a user JSON."""

import json
import subprocess
from pathlib import Path

import pytest

from harness import FORKED_PYTHON, REPO, TINY, read_metrics, run_train
from lmrepo.distributed.device import detect_device

CONFIGS = REPO / "tests" / "data" / "ds_configs"
FP16 = detect_device("cpu").fp16  # a CPU with AVX512-FP16 computes fp16; most CPUs do not

# file -> None (trains on one CPU process) or what the one error line must say
EXPECTED = {
    "hf_transformers_ds_config_zero2.json": None,
    "hf_transformers_ds_config_zero3.json": "zero_optimization.reduce_bucket_size: Input should be greater than 0",
    "accelerate_zero_stage2_offload_config.json": None if FP16 else "change fp16.enabled in deepspeed_config=",
    "accelerate_zero_stage3_offload_config.json": None if FP16 else "change fp16.enabled in deepspeed_config=",
    "llamafactory_ds_z0_config.json": None,
    "llamafactory_ds_z3_offload_config.json": None,
    # its activation_checkpointing section (ZeRO-R, no number_checkpoints) is unused: checkpointing is off
    "llamafactory_ds_z3_e11_act_ckpt.json": None,
    "llamafactory_ds_z2_autotp_config.json": "tensor_parallel: set tensor parallelism with tp=auto tp.size=2",
    "llamafactory_ds_z3_fp8_config.json": "comms_config: not a key DeepSpeed reads",
    "axolotl_zero3_bf16.json": None,
    "axolotl_zero3_bf16_cpuoffload_all.json": None,
    "axolotl_zero1_torch_compile.json": "compile.disable: Extra inputs are not permitted",
    "axolotl_ds_config_e65aeed_onecycle_zero3_offload.json": None,
    "axolotl_ds_config_05fffb5_trailing_comma.json": "is not valid JSON",
    "fastchat_deepspeed_config_s2.json": None,
    "fastchat_deepspeed_config_s3.json": None,
    "stanford_alpaca_default_offload_opt_param.json": None,
    "deepspeedexamples_pipeline_parallelism_ds_config.json": None,
    "deepspeedexamples_qanet_deepspeed_bsz512_1cycle.json": None,
    "deepspeedexamples_bingbertsquad_onebitadam_bsz96_config.json": "optimizer.type=OnebitAdam runs only on GPUs",
    "deepspeedexamples_bing_bert_lamb_sparse_attention_bsz64k_seq128.json": "Sparse Attention has been removed",
    "deepspeedexamples_megatron_zero3_infinity_nvme_config.json": "stage3_param_persitence_threshold: Extra inputs",
    "deepspeed_tests_bingbertsquad_bsz24_fp32_config.json": None,
    "deepspeed_tests_torch_compile_ds_config_z3.json": "bf16.loss_scale: Extra inputs are not permitted",
    "megatron_deepspeed_universal_checkpointing_ds_config.json": None,
    "megatron_deepspeed_compression_ds_config_gpt_TEMPLATE_compression.json": "is not valid JSON",
    "megatron_deepspeed_compression_ds_config_gpt_ca60eb9_2ranks.json": "do not fit 1 data-parallel rank(s)",
    "megatron_deepspeed_ds_zero2_config_bf16_legacy_bfloat16.json": "Invalid communication_data_type",
}
# Two steps on 16-token blocks: the JSONs' own batch sizes stand (qanet's is 512 sequences a step).
SHORT = [*TINY, "trainer.max_steps=2", "trainer.eval_batches=1", "data.block_size=16"]


def test_every_collected_file_has_a_verdict():
    assert sorted(EXPECTED) == sorted(p.name for p in CONFIGS.glob("*.json"))
    assert len(EXPECTED) >= 15


def assert_refused_in_one_line(proc, run_dir: Path, expected: str) -> None:  # a real process (2 ranks)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmrepo: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run_dir.exists(), "nothing written"


def assert_trained(proc, run_dir: Path) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == [1, 2]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert '"auto"' not in json.dumps(ds), 'every "auto" is resolved'
    return ds


TRAINS = sorted(name for name, expected in EXPECTED.items() if expected is None)
REFUSED = sorted(name for name, expected in EXPECTED.items() if expected is not None)


@pytest.mark.parametrize("name", TRAINS)
def test_real_config_trains(tmp_path, name):
    run_dir = tmp_path / "run"
    proc = run_train([*SHORT, f"deepspeed_config={CONFIGS / name}"], run_dir)
    ds = assert_trained(proc, run_dir)
    user = json.loads((CONFIGS / name).read_text())
    if isinstance(user.get("zero_optimization", {}).get("stage"), int):
        assert ds["zero_optimization"]["stage"] == user["zero_optimization"]["stage"]
    assert f"lmrepo: deepspeed_config={CONFIGS / name} sets" in proc.stdout
    if "activation_checkpointing" in user:
        assert "its activation_checkpointing section is not used: activation checkpointing is off" in proc.stdout


def test_an_unused_section_is_checked_once_its_feature_is_on():
    """With checkpointing on, the section's ZeRO-R rules hold (contiguous_memory_optimization needs
    number_checkpoints), said in one line that names the file once."""
    from harness import CPU, validate
    from lmrepo.plan.compose import compose_config
    from lmrepo.utils.errors import ConfigError

    path = CONFIGS / "llamafactory_ds_z3_e11_act_ckpt.json"
    with pytest.raises(ConfigError) as err:
        validate(compose_config([*SHORT, f"deepspeed_config={path}", "checkpointing=full"]), 1, CPU)
    message = str(err.value)
    assert "activation_checkpointing.contiguous_memory_optimization needs" in message
    assert message.count(str(path)) == 1 and "\n" not in message


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """The refused files through train.py's __main__ in one interpreter (tests/probes/bad_value_driver.py)."""
    root = tmp_path_factory.mktemp("refused")
    cases = [[*SHORT, f"deepspeed_config={CONFIGS / name}", f"hydra.run.dir={root / name}"] for name in REFUSED]
    (root / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "tests" / "probes" / "bad_value_driver.py"), str(root / "cases.json")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, {Path(r["args"][-2].split("=", 1)[1]).name: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("name", REFUSED)
def test_real_config_stops_in_one_line(refusals, name):
    root, results = refusals
    result = results[name]
    errors = [line for line in result["stderr"].splitlines() if line.startswith("lmrepo: error:")]
    assert result["code"] == 2 and len(errors) == 1 and EXPECTED[name] in errors[0], result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"]
    assert not (root / name).exists(), "nothing written"


@pytest.mark.distributed
def test_a_batch_that_fits_two_ranks_runs_on_two(tmp_path):
    """train_batch_size 2 = micro 1 x accumulation 1 x 2 ranks: refused on one rank (above), runs on
    two, unless the device lacks its fp16 ("enabled": 1), which is then the one line."""
    name = "megatron_deepspeed_compression_ds_config_gpt_ca60eb9_2ranks.json"
    run_dir = tmp_path / "run"
    proc = run_train([*SHORT, f"deepspeed_config={CONFIGS / name}"], run_dir, ranks=2, via="deepspeed")  # its exit code
    assert "[INFO]" not in proc.stdout + proc.stderr  # lmrepo starts the launcher at --log_level=warning
    if FP16:
        ds = assert_trained(proc, run_dir)
        assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
            2,
            1,
            1,
        )
    else:
        assert_refused_in_one_line(proc, run_dir, "change fp16.enabled in deepspeed_config=")


@pytest.mark.distributed
def test_json_batch_is_rederived_for_two_ranks_and_resumes(tmp_path):
    """BingBertSquad's 24 = micro 3 x accumulation x ranks: 8 steps of accumulation on one rank,
    4 on two. Saved, then resumed with the same JSON: the run continues where it stopped."""
    name = CONFIGS / "deepspeed_tests_bingbertsquad_bsz24_fp32_config.json"
    run_dir = tmp_path / "run"
    ds = assert_trained(
        run_train([*SHORT, f"deepspeed_config={name}", "trainer.save_every=2"], run_dir, ranks=2), run_dir
    )
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        24,
        3,
        4,
    )
    resumed = run_train([*TINY, "trainer.max_steps=3", f"deepspeed_config={name}", "run.resume=auto"], run_dir, ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == [1, 2, 3]
    assert "resumed from" in resumed.stdout
