"""A wrong value anywhere is one `lmrepo: error:` line naming the key, exit 2, before anything
is written: no run directory, no token cache, no W&B run. Each case is a `python train.py`
command line as a user would type it, run through train.py's __main__; for every group a wrong
type, an out-of-range value and an unknown key (and the enum choices, the moved keys, the
unknown options)."""

import json
import os
import subprocess

import pytest

from harness import FORKED_PYTHON, PYTHON, REPO

CASES = [
    # model
    ("model.n_layer=two", "model.n_layer=two"),
    ("model.n_layer=0", "model.n_layer=0"),
    ("model.n_head=0", "model.n_head=0"),
    ("model.family=t5", "model.family=t5"),
    ("model.dropout=1.5", "model.dropout=1.5"),
    ("model.n_heads=4", "model.n_heads"),
    ("model=gpt5", "model=gpt5"),
    # data
    ("data.block_size=16.5", "data.block_size=16.5"),
    ("data.block_size=4", "data.block_size=4"),
    ("data.val_fraction=0.9", "data.val_fraction=0.9"),
    ("data.num_proc=-1", "data.num_proc=-1"),
    ("data.pathz=[a.txt]", "data.pathz"),
    ("data=text", "data.paths"),
    ("data.cross_document_attention=maybe", "data.cross_document_attention=maybe"),
    ("model=bert-tiny data.cross_document_attention=false", "data.cross_document_attention"),
    ("data.paths=corpus.txt", "data.paths"),
    # optimizer
    ("optimizer.lr=abc", "optimizer.lr=abc"),
    ("optimizer.lr=-1", "optimizer.lr=-1"),
    ("optimizer.betas=0.9", "optimizer.betas=0.9"),
    ("optimizer.betas=[0.9]", "optimizer.betas"),
    ("optimizer.name=lion", "optimizer.name=lion"),
    ("optimizer.momentum=1.5", "optimizer.momentum=1.5"),
    ("optimizer.nesterov=false", "optimizer.nesterov"),
    # schedule
    ("schedule.warmup_steps=1.5", "schedule.warmup_steps=1.5"),
    ("schedule.warmup_steps=-1", "schedule.warmup_steps=-1"),
    ("schedule.min_lr_ratio=2", "schedule.min_lr_ratio=2"),
    ("schedule.decay_fraction=1.5", "schedule.decay_fraction=1.5"),
    ("schedule.decay_shape=sqrt", "schedule.decay_shape=sqrt"),
    ("schedule.decay=cosine", "schedule.decay"),
    ("schedule=step", "schedule=step"),
    # trainer (and the keys that moved out of it)
    ("trainer.micro_batch_size=2.5", "trainer.micro_batch_size=2.5"),
    ("trainer.seed=-1", "trainer.seed=-1"),
    ("trainer.max_steps=0", "trainer.max_steps=0"),
    ("trainer.device=tpu", "trainer.device=tpu"),
    ("trainer.grad_clip=-1", "trainer.grad_clip=-1"),
    ("trainer.lr=0.1", "optimizer.lr"),
    ("trainer.warmup_steps=10", "schedule.warmup_steps"),
    ("trainer.max_step=5", "trainer.max_step"),
    # precision
    ("precision.dtype=fp8", "precision.dtype=fp8"),
    ("precision.loss_scale=-1", "precision.loss_scale=-1"),
    ("precision.scale=2", "precision.scale"),
    # zero
    ("zero.stage=5", "zero.stage=5"),
    ("zero.stage=two", "zero.stage=two"),
    ("zero.reduce_bucket_size=-5", "zero.reduce_bucket_size=-5"),
    ("zero.overlap=true", "zero.overlap"),
    # offload
    ("offload.params=maybe", "offload.params=maybe"),
    ("offload.target=disk", "offload.target=disk"),
    ("offload.pin=true", "offload.pin"),
    # pipeline
    ("pipeline.stages=0", "pipeline.stages=0"),
    ("pipeline.schedule=zb", "pipeline.schedule=zb"),
    ("pipeline.virtual_stages=x", "pipeline.virtual_stages=x"),
    ("pipeline.engine=torch", "pipeline.engine"),
    # tp
    ("tp.mode=megatron", "tp.mode=megatron"),
    ("tp.size=0", "tp.size=0"),
    ("tp.degree=2", "tp.degree"),
    # sequence_parallel
    ("sequence_parallel.size=x", "sequence_parallel.size=x"),
    ("sequence_parallel.size=0", "sequence_parallel.size=0"),
    ("sequence_parallel.ranks=2", "sequence_parallel.ranks"),
    ("trainer.loss_tiles=0", "trainer.loss_tiles=0"),
    # expert_parallel and mixture-of-experts models: the combinations DeepSpeed-MoE does not run
    ("expert_parallel.size=2", "expert_parallel.size=2"),
    ("model=mixtral-tiny expert_parallel.size=3", "expert_parallel.size=3"),
    ("model=mixtral-tiny model.moe.top_k=9", "model.moe.top_k=9"),
    ("model=mixtral-tiny model.moe.capacity_factor=0", "model.moe.capacity_factor=0"),
    ("model=mixtral-tiny zero=stage3", "zero=stage3"),
    ("model=mixtral-tiny engine=fsdp2 expert_parallel.size=2", "does not divide the 1 data-parallel rank(s)"),
    ("model=mixtral-tiny tp=auto tp.size=2", "tp=none"),
    ("model=mixtral-tiny pipeline=1f1b", "choose a torch pipeline"),
    ("model=mixtral-tiny pipeline=gpipe expert_parallel.size=2", "choose expert_parallel.size=1"),
    ("model=mixtral-tiny model.pretrained=/tmp", "model.pretrained=/tmp"),
    ("model=mixtral-tiny sequence_parallel.size=2", "sequence_parallel.size=2"),
    ("model=mixtral-tiny optimizer=muon", "choose engine=fsdp2 (Muon over the sharded experts"),
    ("model=mixtral-tiny model.moe.shared_experts=-1", "model.moe.shared_experts=-1"),
    ("model=mixtral-tiny model.moe.bias_update_rate=-0.1", "model.moe.bias_update_rate=-0.1"),
    ("model=mixtral-tiny model.moe.balance=aux_free model.moe.aux_loss_coef=-1", "model.moe.aux_loss_coef=-1"),
    ("model=mixtral-tiny model.moe.balance=bias", "model.moe.balance"),
    ("model=llama-tiny model.moe.balance=aux_free", "choose model=mixtral-tiny"),
    # the moe keys on a dense family (it would train without experts)
    ("model.moe.experts=4", "model.moe.experts=4 configures a mixture of experts, and model.family=gpt2 is dense"),
    ("model=llama-tiny model.moe.aux_loss_coef=0.1", "choose model=mixtral-tiny"),
    # a tokenizer without [MASK] for BERT's masked-LM (was transformers' ValueError in every rank)
    ("model=bert-tiny model.tokenizer=bytes model.vocab_size=257", "model.tokenizer=bytes has no mask token"),
    # checkpointing
    ("checkpointing.every_n_layers=x", "checkpointing.every_n_layers=x"),
    ("checkpointing.impl=fast", "checkpointing.impl=fast"),
    ("checkpointing=full checkpointing.every_n_layers=99", "checkpointing.every_n_layers=99"),
    # logger
    ("logger.mode=sometimes", "logger.mode=sometimes"),
    ("logger.tags=5", "logger.tags=5"),
    ("logger.projekt=x", "logger.projekt"),
    # metrics, launcher, run, the user's JSON, unknown keys anywhere
    ("metrics.peak_tflops=-3", "metrics.peak_tflops=-3"),
    ("launcher.ranks=0", "launcher.ranks=0"),
    # more ranks than this one process: the message names the launchers that start them
    ("launcher.ranks=2", "add -m (python train.py -m ...), or start 2 ranks: torchrun --nproc-per-node 2"),
    ("experiment=long_context", "launcher.ranks=2 (experiment=long_context sets it)"),
    ("sequence_parallel.size=2", "or start 2 ranks: torchrun --nproc-per-node 2 train.py ..., deepspeed --num_gpus 2"),
    ("pipeline=gpipe trainer.grad_accum=2", "python train.py -m launcher.ranks=2"),
    ("run.resumee=auto", "run.resumee"),
    ("deepspeed_config=/nonexistent/ds.json", "deepspeed_config=/nonexistent/ds.json"),
    ("foo=1", "foo"),
    ("+foo=1", "foo"),
    ("+trainer.foo=1", "trainer.foo"),
]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """Every case through train.py's __main__, each in a fresh environment, in one interpreter
    (tests/probes/bad_value_driver.py), from an empty working directory with an empty token cache."""
    root = tmp_path_factory.mktemp("bad-values")
    work, cache = root / "work", root / "cache"
    work.mkdir()
    (root / "cases.json").write_text(json.dumps([overrides.split() for overrides, _ in CASES]))
    env = dict(os.environ, LMREPO_CACHE=str(cache), WANDB_MODE="offline")
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "tests" / "probes" / "bad_value_driver.py"), str(root / "cases.json")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {" ".join(r["args"]): r for r in map(json.loads, proc.stdout.splitlines())}
    return results, work, cache


@pytest.mark.parametrize("overrides, key", CASES, ids=[c[0] for c in CASES])
def test_bad_value_is_one_line_naming_the_key(verdicts, overrides, key):
    results, work, cache = verdicts
    result = results[overrides]
    errors = [line for line in result["stderr"].splitlines() if line.startswith("lmrepo: error:")]
    assert result["code"] == 2, result["stderr"][-2000:]
    assert len(errors) == 1 and key in errors[0], result["stderr"][-2000:]
    assert "Traceback" not in result["stderr"]


def test_nothing_is_left_behind(verdicts):
    _, work, cache = verdicts
    assert list(work.iterdir()) == [], "nothing written where the jobs ran (no outputs/, no wandb/)"
    assert not cache.exists() or list(cache.iterdir()) == [], "no token cache"


def test_a_bad_value_is_one_line_from_a_fresh_process_too(tmp_path):
    """The battery runs in one interpreter; this is the same as its own process."""
    proc = subprocess.run(
        [PYTHON, str(REPO / "train.py"), "trainer.micro_batch_size=2.5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "lmrepo: error: trainer.micro_batch_size=2.5: Value '2.5' of type 'float' could not be converted to Integer"
    ]
    assert list(tmp_path.iterdir()) == []


def test_export_of_a_run_without_a_checkpoint_says_how_to_get_one(tmp_path):
    """scripts/export_hf.py on a run directory that saved no checkpoint: the cause (no checkpoint)
    and the way out (trainer.save_every), not a run.resume= the user never typed."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 10.0}\n')
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "export_hf.py"), str(run_dir), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"lmrepo: error: {run_dir} holds no checkpoint: a run saves one with trainer.save_every=N (and at its "
        "end); train with it, then export the run directory"
    ]
    assert proc.stdout == "", "nothing else on the terminal (DeepSpeed's accelerator notice is dropped)"
    assert not (tmp_path / "hf").exists()


def test_a_global_batch_derives_the_accumulation_on_any_rank_count():
    """trainer.global_batch_size set and trainer.grad_accum left out: the accumulation follows the
    rank count (as DeepSpeed derives it from train_batch_size), so a run resumed on fewer ranks keeps
    its global batch; a grad_accum given on the command line is still checked."""
    from harness import CPU, validate
    from lmrepo.plan.compose import compose_config
    from lmrepo.utils.errors import ConfigError

    for ranks, accum in ((1, 4), (2, 2), (4, 1)):
        ds, _ = validate(compose_config(["trainer.global_batch_size=32", "trainer.micro_batch_size=8"]), ranks, CPU)
        assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (32, accum)
    with pytest.raises(ConfigError, match="set trainer.grad_accum=4"):
        validate(compose_config(["trainer.global_batch_size=32", "trainer.grad_accum=2"]), 1, CPU)


def test_a_one_stage_pipeline_is_said():
    from harness import CPU
    from lmrepo.plan.compose import compose_config
    from lmrepo.plan.job import plan

    notes = plan(compose_config(["pipeline=gpipe", "pipeline.stages=1"]), 1, CPU).notes
    assert any(
        n.startswith("lmrepo: note: pipeline=gpipe with pipeline.stages=1 is a one-stage pipeline") for n in notes
    )
    assert not any("one-stage" in n for n in plan(compose_config(["pipeline=gpipe"]), 2, CPU).notes)


def test_the_battery_covers_every_group():
    groups = {c[0].split("=")[0].lstrip("+").split(".")[0] for c in CASES}
    assert {
        "model",
        "data",
        "optimizer",
        "schedule",
        "trainer",
        "precision",
        "zero",
        "offload",
        "pipeline",
        "tp",
        "sequence_parallel",
        "expert_parallel",
        "checkpointing",
        "logger",
        "metrics",
        "launcher",
        "run",
    } <= groups
    assert len(CASES) >= 30
