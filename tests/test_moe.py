"""Mixture of experts (model=mixtral-*, DeepSpeed-MoE): expert-parallel size 2 equals size 1,
aux_loss and expert load in metrics.jsonl, exact resume after kill -9, the expert-parallel
layout a checkpoint fixes, export to transformers' Mixtral (from DeepSpeed's and from
engine=fsdp2's checkpoints), evaluate.py and generate.py on it."""

import json
import subprocess

import pytest
import torch

from harness import FORKED_PYTHON, PYTHON, REPO, TINY, assert_ok, kill_9_after_a_save, read_metrics, run_train
from lmrepo.plan.compose import compose_config
from numerics import STEPS_FP32, VOCAB, assert_close, reordered_sum

pytestmark = pytest.mark.distributed

# TINY's 2x64 shape with 4 experts of width 96, top-2, every block MoE; 10 steps.
MOE = ("model=mixtral-tiny", "model.n_kv_head=2", "model.n_inner=96", "model.moe.experts=4", "trainer.max_steps=10")
EP2 = (*MOE, "zero=stage2", "expert_parallel.size=2")
# Token dropping (half an expert's fair share fits) and a constant rate, for the resume test: a
# killed run of any length continues exactly the run of 10 steps.
# engine=fsdp2 on a tensor-parallel pair of ranks: the experts whole on each, attention split
FSDP2_TP = (*MOE, "engine=fsdp2", "zero=stage3", "tp=auto", "tp.size=2")
DROPPING = ("model.moe.drop_tokens=true", "model.moe.capacity_factor=0.5", "schedule=constant")


def train_lines(run_dir) -> list[dict]:
    return [m for m in read_metrics(run_dir) if "loss" in m]


def test_expert_parallel_2_equals_1_with_aux_loss_and_expert_load(launch2):
    """2 ranks, fp32, ZeRO-2, no dropping, deterministic routing: splitting the 4 experts over
    the 2 ranks (all-to-all) gives the losses and gradient norms of every rank holding all 4,
    over 10 steps: a factor-of-2 error in the expert gradients would show in grad_norm."""
    split, whole = train_lines(launch2(*EP2)), train_lines(launch2(*MOE, "zero=stage2"))
    assert [m["step"] for m in split] == list(range(1, 11))
    for key in ("loss", "grad_norm", "aux_loss"):
        assert_close([m[key] for m in split], [m[key] for m in whole], STEPS_FP32, key)
    for a, b in zip(split, whole):
        assert a["expert_tokens"] == b["expert_tokens"]
        # routes of one step: 2 ranks x 4 sequences x 32 tokens x top-2 x 2 MoE blocks
        assert sum(a["expert_tokens"]) == 2 * 4 * 32 * 2 * 2 and len(a["expert_tokens"]) == 4
        assert 0 < a["aux_loss"] < 1 and a["expert_load_max"] >= 1 and "dropped_frac" not in a


def test_kill_9_then_resume_is_bit_identical_with_dropping(launch2, tmp_path):
    reference = launch2(*EP2, *DROPPING)
    run_dir = tmp_path / "killed"
    latest = kill_9_after_a_save([*EP2, *DROPPING, "trainer.max_steps=400", "trainer.save_every=3"], run_dir, logged=5)
    files = {p.name for p in (run_dir / "checkpoints" / latest).iterdir()}
    # DeepSpeed-MoE writes one file per (MoE block, expert), whichever rank held it
    assert {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)} <= files
    step = int(latest.split("_")[1])
    assert_ok(run_train([*TINY, *EP2, *DROPPING, "run.resume=auto"], run_dir, ranks=2))
    # lmrepo cut the killed run's lines past its checkpoint from metrics.jsonl at the resume
    resumed = [m for m in read_metrics(run_dir) if m["step"] > step and ("loss" in m or "eval_loss" in m)]
    expected = [m for m in read_metrics(reference) if m["step"] > step and ("loss" in m or "eval_loss" in m)]
    keys = ("step", "loss", "lr", "grad_norm", "aux_loss", "expert_tokens", "dropped_frac", "eval_loss")
    assert [{k: m.get(k) for k in keys} for m in resumed] == [{k: m.get(k) for k in keys} for m in expected]
    assert all(0 < m["dropped_frac"] < 1 for m in expected if "loss" in m)

    # the checkpoint fixes the expert layout: another expert-parallel size is one line (before any process group)
    other = run_train(
        [*TINY, *MOE, *DROPPING, "zero=stage2", f"run.resume={reference}/checkpoints/step_00000003"],
        tmp_path / "other",
    )
    assert other.returncode == 2
    assert (
        other.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "lmrepo: error: this checkpoint was saved with expert_parallel.size=2, this run has expert_parallel.size=1"
        )
    ), other.stderr[-2000:]


@pytest.mark.parametrize("layout, data_ranks", [(EP2, 2), (FSDP2_TP, 1)], ids=["expert-parallel", "fsdp2-tensor"])
def test_export_is_transformers_mixtral_with_lmrepos_logits_and_scripts_run(launch2, tmp_path, layout, data_ranks):
    """DeepSpeed-MoE's checkpoint (one file per expert) and FSDP2's (DCP, attention split over 2
    tensor-parallel ranks, the experts whole on each) both export to transformers' Mixtral, and
    evaluate.py and generate.py run on them. The metrics line counted each step's routes once per
    data-parallel rank: 4 sequences x 32 tokens x top-2 x 2 MoE blocks each (a tp group's ranks
    route the same tokens)."""
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    from lmrepo.export import consolidate

    run_dir = launch2(*layout)
    assert all(sum(m["expert_tokens"]) == data_ranks * 4 * 32 * 2 * 2 for m in train_lines(run_dir))
    out = tmp_path / "hf"
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "export_hf.py"), str(run_dir), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(exported, MixtralForCausalLM)
    ours = consolidate(str(run_dir)).model.eval()
    ids = torch.randint(0, exported.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    # The same weights in transformers' Mixtral: its own expert and attention code, whose longest
    # sum (an expert's down projection, 96 terms) may be blocked otherwise. An expert's weights in
    # the wrong place or transposed move the logits by their whole size.
    with torch.no_grad():
        assert_close(exported(input_ids=ids).logits, ours(input_ids=ids).logits, reordered_sum(96), "logits")

    generated = tmp_path / "generated.json"
    proc = subprocess.run(
        [
            PYTHON,
            str(REPO / "scripts" / "generate.py"),
            f"run={run_dir}",
            "prompt=ROMEO:",
            "max_new_tokens=4",
            f"json={generated}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert_ok(proc)
    assert len(json.loads(generated.read_text())["new_tokens"]) == 4
    proc = subprocess.run(
        [
            PYTHON,
            str(REPO / "scripts" / "evaluate.py"),
            f"run={run_dir}",
            "tasks=shakespeare_lastword",
            "limit=4",
            "wandb=false",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert_ok(proc)
    assert (run_dir / "eval" / "step_00000010.json").is_file()


def test_a_run_with_no_mixtral_form_says_so_in_one_line(launch2, tmp_path):
    """Alternating dense and MoE blocks (model.moe.every=2) trains, but transformers' Mixtral has
    an MoE MLP in every block: export is one line."""
    run_dir = launch2(*MOE, "zero=stage1", "model.moe.every=2", "trainer.max_steps=3")
    assert len(train_lines(run_dir)[-1]["expert_tokens"]) == 4  # one MoE block of two
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "export_hf.py"), str(run_dir), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("lmrepo: error: transformers' Mixtral has")


def test_activation_checkpointing_keeps_the_load_balancing_gradient(tmp_path):
    """Activation checkpointing recomputes each block in backward and claims the run without it:
    DeepSpeed's (checkpointing.impl=deepspeed, reentrant: the block's forward under no_grad) and
    torch's must give every router the gradient of the load-balancing loss as well as the language
    model's. One process, fp32, ZeRO-0, 3 steps of each at a constant rate from the first (so steps
    2 and 3 follow updates), in one launch (tests/probes/moe_checkpointing_probe.py); the load-balancing
    term weighted 1 (model.moe.aux_loss_coef=1), a large part of each router's gradient, which
    DeepSpeed's checkpointing used to leave out."""
    overrides = [*TINY, *MOE, "model.moe.aux_loss_coef=1", "schedule=constant", "schedule.warmup_steps=0"]
    probe = [str(REPO / "tests" / "probes" / "moe_checkpointing_probe.py"), str(tmp_path), "3", *overrides]
    assert_ok(subprocess.run([PYTHON, *probe], capture_output=True, text=True))
    runs = torch.load(tmp_path / "moe_checkpointing.pt")
    assert all(step["lr"] > 0 for run in runs.values() for step in run)
    # The recompute repeats the forward's arithmetic; backward may add a router's two gradients
    # (through its block's output and through the aux loss) in another order, and steps 2-3 carry
    # that rounding through Adam: each router gradient (by its norm), loss, gradient norm and aux
    # loss within the rounding of the longest sum reordered, the LM head's over the vocabulary
    # (reordered_sum(VOCAB) = 5.4e-5). The defect this catches, the aux loss's gradient
    # lost in recompute, moved the third loss by 1.5e-3 at aux_loss_coef=0.01 (here 1: more).
    tolerance = reordered_sum(VOCAB)
    for impl in ("deepspeed", "torch"):
        for step, (a, b) in enumerate(zip(runs[impl], runs["none"]), 1):
            where = f"{impl} step {step}"
            assert len(a["router_grads"]) == len(b["router_grads"]) == 2, where  # one router per block
            assert_close(a["router_grads"], b["router_grads"], tolerance, f"{where} router gradients")
            for key in ("loss", "grad_norm", "aux_loss"):
                assert_close(a[key], b[key], tolerance, f"{where} {key}")


def test_flops_and_mfu_count_the_active_experts():
    """A token passes through top_k of the experts: the block parameters FLOPs and MFU count are
    the model's blocks less the experts it skips and the norms (which the 2-FLOPs rule leaves out)."""
    from lmrepo.config import load
    from lmrepo.estimate import active_block_params
    from lmrepo.models import meta_model
    from lmrepo.observability.metrics import flops_per_token

    model = load(compose_config(["model=mixtral-tiny"])).model
    blocks = sum(p.numel() for p in meta_model(model).model.layers.parameters())
    l, h, skipped = model.n_layer, model.n_embd, model.moe.experts - model.moe.top_k
    active = active_block_params(model)
    assert active == blocks - l * skipped * 3 * h * model.n_inner - l * 2 * h
    dense = load(compose_config(["model=gpt2-tiny"])).model
    assert active_block_params(dense) is None
    gpt = flops_per_token(l, h, 256, 50257, recompute=False)
    assert flops_per_token(l, h, 256, 50257, recompute=False, block_params=12 * l * h * h) == pytest.approx(gpt)
    assert flops_per_token(l, h, 256, 50257, False, active) - gpt == pytest.approx(6 * (active - 12 * l * h * h))
