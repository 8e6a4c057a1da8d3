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

import pytest
import torch

from conftest import (
    PYTHON,
    REPO,
    TINY,
    assert_ok,
    kill_9_after_a_save,
    launcher,
    read_metrics,
    run_train,
)
from lmrepo.compose import load_config
from lmrepo.errors import ConfigError
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
def test_fsdp2_resume_after_kill_9_is_bit_identical(tmp_path):
    """Killed mid-run (the launcher's process group, SIGKILL): `latest` names a whole DCP
    checkpoint, and resuming from it gives the killed run's own losses for the steps it had logged."""
    run_dir = tmp_path / "run"
    overrides = ["engine=fsdp2", "zero=stage2", "trainer.max_steps=400", "trainer.save_every=3", "schedule=constant"]
    latest = int(kill_9_after_a_save(overrides, run_dir, logged=8).split("_")[1])
    killed = {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}
    assert max(killed) > latest, (killed, latest)
    until = max(killed)
    resumed = run_train([*TINY, *overrides, f"trainer.max_steps={until}", "run.resume=auto"], run_dir, ranks=2)
    assert_ok(resumed)
    ours = {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m and m["step"] > latest}
    assert ours == {step: loss for step, loss in killed.items() if step > latest}


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
            [PYTHON, str(REPO / "scripts" / "export_hf.py"), str(run_dir), str(out)], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        models[name] = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = (models[n](tokens).logits for n in ("fsdp2", "deepspeed"))
    # Two runs whose gradient norms agree to NORM_STEPS: so do their weights, hence the logits (by
    # their norm). Shards joined wrongly are off by the logits' whole size.
    assert_close(ours, theirs, NORM_STEPS, "logits")


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["zero=stage1"], "engine=fsdp2 has no counterpart of zero=stage1"),
        (["zero=stage0"], "engine=fsdp2 has no counterpart of zero=stage0"),
        (["offload=nvme", "offload.nvme_path=/tmp"], "engine=fsdp2 offloads to CPU memory only"),
        (["offload=cpu", "offload.params=false"], "drop offload.params=false"),
        (["precision=fp16"], "choose precision=bf16"),
        (["pipeline=1f1b"], "choose pipeline=none"),
        (["tp=auto"], "GPT2LMHeadModel has none here: choose a model=llama-* preset, or tp=none"),
        (["model=bert-tiny", "tp=auto"], "BertForMaskedLM has none here"),
        (["deepspeed_config=ds.json"], "drop it, or choose engine=deepspeed"),
        (["model.zero_init=true"], "model.zero_init is DeepSpeed's zero.Init"),
        (["checkpointing=full", "checkpointing.partition_activations=true"], "checkpointing.partition_activations"),
    ],
)
def test_what_fsdp2_cannot_mean_is_one_line(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(["engine=fsdp2", *overrides])
    assert says in str(err.value) and "\n" not in str(err.value)


def test_fsdp2_defaults_to_full_sharding_and_keeps_a_chosen_stage():
    assert load_config(["engine=fsdp2"]).zero.stage == 3
    assert load_config(["engine=fsdp2", "zero=stage2"]).zero.stage == 2
    assert load_config([]).engine.name == "deepspeed" and load_config([]).zero.stage == 0


@pytest.mark.distributed
def test_a_checkpoint_of_the_other_engine_is_one_line(launch2):
    from lmrepo import checkpoint

    config = load_config(["engine=fsdp2", *TINY])
    source = launch2("zero=stage0", "precision=fp32") / "checkpoints"
    with pytest.raises(ConfigError, match="was written by engine=deepspeed, this run is engine=fsdp2"):
        checkpoint.inspect(source, "step_00000003", config.model, 50257, engine="fsdp2")


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


@pytest.mark.distributed
def test_fsdp2_model_states_per_rank_are_the_estimate(tmp_path):
    """The bytes each rank holds after a step (its shards of the fp32 parameters, the gradients
    they get, AdamW's two moments) against scripts/estimate.py's FSDP2 figure: 16 bytes x
    parameters / ranks, within FSDP2's padding of uneven shards."""
    from lmrepo.estimate import fsdp2_state_bytes

    proc = subprocess.run(
        [*launcher(2), str(REPO / "tests" / "fsdp2_probe.py"), str(tmp_path), *TINY, "engine=fsdp2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        held = json.loads((tmp_path / f"held_rank{rank}.json").read_text())
        measured = held["parameters"] + held["gradients"] + held["optimizer"]
        estimate = fsdp2_state_bytes(held["model_parameters"], 2, "fp32").gpu
        assert_close(measured, estimate, 0.01, f"rank {rank}'s model states")  # FSDP2 pads uneven shards


@pytest.mark.distributed
def test_generate_runs_on_an_fsdp2_run(launch2, tmp_path):
    run_dir = launch2("engine=fsdp2", "zero=stage3")
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [PYTHON, str(REPO / "scripts" / "generate.py"), f"run={run_dir}", "prompt=ROMEO:", "max_new_tokens=4",
         f"json={out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["prompt"] == "ROMEO:" and isinstance(result["text"], str)


@pytest.mark.distributed
def test_hsdp_on_a_2x2_mesh_equals_fsdp2_over_4_ranks(tmp_path):
    """engine.replicate=2 on 4 ranks: 2 replicas, each sharding the model over 2 ranks (FSDP2 on a
    replicate x shard mesh), trains as FSDP2 sharding over all 4 (the same global batch): fp32
    losses and gradient norms of 3 AdamW steps within the rounding of another reduction order
    (tests/test_composition.py's FP32 tolerances: the reasons are there)."""
    import composition
    from test_composition import FP32, close

    fsdp2 = [*composition.overrides("fsdp2"), "trainer.micro_batch_size=1"]  # the global batch of 4 over 4 ranks
    cases = [fsdp2, [*fsdp2, "engine.replicate=2"]]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    probe = [str(REPO / "tests" / "composition_probe.py"), str(tmp_path / "out.json"), str(tmp_path / "cases.json")]
    proc = subprocess.run([*launcher(4), *probe], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    sharded, hsdp = (results[composition.case_name(words)] for words in cases)
    assert "losses" in hsdp, hsdp
    for step, (ours, theirs) in enumerate(zip(hsdp["losses"], sharded["losses"])):
        assert close(ours, theirs, FP32["loss"]), (step, hsdp, sharded)
    assert close(hsdp["grad_norms"][0], sharded["grad_norms"][0], FP32["first_norm"]), (hsdp, sharded)
