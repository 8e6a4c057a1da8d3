"""Mixture of experts (model=mixtral-*, DeepSpeed-MoE): expert-parallel size 2 equals size 1,
aux_loss and expert load in metrics.jsonl, exact resume after kill -9, the expert-parallel
layout a checkpoint fixes, export to transformers' Mixtral (from DeepSpeed's and from
engine=fsdp2's checkpoints), evaluate.py and generate.py on it."""

import json
import subprocess

import pytest
import torch

from harness import FORKED_PYTHON, REPO, TINY, assert_ok, kill_9_after_a_save, read_metrics, run_train
from lmrepo.export import consolidate
from lmrepo.models.mixtral import to_transformers_mixtral
from lmrepo.plan.compose import compose_config
from lmrepo.utils.errors import ConfigError
from numerics import STEPS_FP32, VOCAB, assert_close, reordered_sum

pytestmark = pytest.mark.distributed

# TINY's 2x64 shape with 4 experts of width 96, top-2, every block MoE; 10 steps.
MOE = ("model=mixtral-tiny", "model.n_kv_head=2", "model.n_inner=96", "model.moe.experts=4", "trainer.max_steps=10")
EP2 = (*MOE, "zero=stage2", "expert_parallel.size=2")
# Token dropping (half an expert's fair share fits) and a constant rate, for the resume test: a
# killed run of any length continues exactly the run of 10 steps.
# engine=fsdp2 on a tensor-parallel pair of ranks: the experts whole on each, attention split
FSDP2_TP = (*MOE, "engine=fsdp2", "zero=stage3", "tp=auto", "tp.size=2")
# engine=fsdp2 with the experts split over the 2 ranks on its mesh (expert parallelism)
FSDP2_EP2 = (*MOE, "engine=fsdp2", "zero=stage3", "expert_parallel.size=2")
DROPPING = ("model.moe.drop_tokens=true", "model.moe.capacity_factor=0.5", "schedule=constant")
# DeepSeek-V3's routing: the router bias moved 0.01 a step (the router's probabilities at TINY's
# initialisation differ by ~1e-3, so the bias picks other experts from the second step on), one
# shared expert.
AUX_FREE = ("model.moe.balance=aux_free", "model.moe.bias_update_rate=0.01", "model.moe.shared_experts=1")
AUX_FREE_LAYOUTS = {
    "deepspeed-expert-parallel": (*EP2, *AUX_FREE),
    "fsdp2-expert-parallel": (*FSDP2_EP2, *AUX_FREE),
}


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


@pytest.mark.parametrize(
    "layout, data_ranks",
    [(EP2, 2), (FSDP2_TP, 1), (FSDP2_EP2, 2)],
    ids=["expert-parallel", "fsdp2-tensor", "fsdp2-expert-parallel"],
)
def test_export_is_transformers_mixtral_with_lmrepos_logits_and_scripts_run(launch2, tmp_path, layout, data_ranks):
    """DeepSpeed-MoE's checkpoint (one file per expert) and FSDP2's (DCP: attention split over 2
    tensor-parallel ranks, the experts whole on each; or the experts split over the 2 ranks by
    expert parallelism, each saved under its global index) export to transformers' Mixtral, and
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
            *FORKED_PYTHON,
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
            *FORKED_PYTHON,
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
    assert_ok(subprocess.run([*FORKED_PYTHON, *probe], capture_output=True, text=True))
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


def tiny_moe(*overrides: str):
    """A one-process TINY Mixtral (4 experts of width 96) built by lmrepo, in training mode."""
    from lmrepo.config import load
    from lmrepo.models import build_model

    torch.manual_seed(0)
    words = ["model=mixtral-tiny", *TINY[:4], *MOE[1:4], *TINY[-2:], *overrides]
    model = build_model(load(compose_config(words)).model)
    return model.train()


@pytest.mark.parametrize("top_k, drop", [(1, False), (2, False), (3, False), (1, True), (2, True)])
def test_the_aux_free_gate_with_a_zero_bias_is_deepspeeds_gate(top_k, drop):
    """The aux-free gate picks the routes from the biased scores through DeepSpeed's own top-1,
    top-2 and top-k gating: with a zero bias (and the same load-balancing weight) its loss, router
    gradient and dropped routes are DeepSpeed's gate's, for every k, with and without dropping
    (at top_k > 2 with dropping, DeepSpeed's capacity keeps the routes of the highest
    probabilities, the aux-free gate's those of the highest biased scores: not compared), within
    the rounding of two short sums taken in another order (below)."""
    from lmrepo.models.mixtral import balance_experts

    words = [f"model.moe.top_k={top_k}", f"model.moe.drop_tokens={str(drop).lower()}", "model.moe.capacity_factor=0.5"]
    plain, aux_free = tiny_moe(*words), tiny_moe(*words, "model.moe.balance=aux_free", "model.moe.aux_loss_coef=0.01")
    ids = torch.randint(0, 257, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = [model(input_ids=ids, labels=ids).loss for model in (plain, aux_free)]
    for loss in losses:
        loss.backward()
    # The two gates add the same numbers in another order in two short sums (the renormalising
    # sum over k routes, the balancing loss's over the experts): a token's weights and the loss by
    # a rounding or so. The loss is a mean over 4 x 32 tokens and each router gradient a sum over
    # them: within reordered_sum(128) = 2.7e-6, by the gradient's norm (an element may cancel).
    # Measured here: equal to the last bit for k <= 2; k = 3's router gradients 3.3e-7 (8x inside).
    tokens = ids.numel()
    assert_close(losses[1].item(), losses[0].item(), reordered_sum(tokens), "loss")
    routers = [[layer.mlp.moe.deepspeed_moe.gate.wg.weight.grad for layer in m.model.layers] for m in (plain, aux_free)]
    assert_close(routers[1], routers[0], reordered_sum(tokens), "router gradients")
    dropped = [[int(layer.mlp.dropped) for layer in m.model.layers] for m in (plain, aux_free)]
    assert dropped[0] == dropped[1] and (sum(dropped[0]) > 0) == drop

    # the bias picks the experts: a step's update moves each expert's bias by the rate, towards
    # the mean load, and the next forward routes otherwise; the weights stay the softmax's
    layers = aux_free.moe_layers()
    loads = [mlp.step_load.clone() for mlp in layers]
    assert all(int(load.sum()) == 4 * 32 * top_k for load in loads)
    balance_experts(aux_free)
    for mlp, load in zip(layers, loads):
        bias = mlp.moe.deepspeed_moe.gate.route_bias
        expected = 0.001 * torch.sign(load.double().mean() - load.double()).float()
        assert torch.equal(bias, expected) and int(mlp.step_load.sum()) == 0
    before = [mlp.routes.clone() for mlp in layers]
    aux_free(input_ids=ids, labels=ids)
    assert any(not torch.equal(a, mlp.routes) for a, mlp in zip(before, layers))
    # an engine's bf16 leaves the bias in fp32 (0.001 steps are below bf16's resolution at 0.1)
    assert aux_free.bfloat16().moe_layers()[0].moe.deepspeed_moe.gate.route_bias.dtype == torch.float32


def test_shared_experts_pass_every_token_and_count_as_active():
    """model.moe.shared_experts=2: one SwiGLU MLP of twice an expert's width beside the routed
    experts in every MoE block, added to their output (the block's output changes with its
    weights), and counted among the parameters a token passes through."""
    from lmrepo.config import load
    from lmrepo.estimate import active_block_params

    model = tiny_moe("model.moe.shared_experts=2")
    shared = model.model.layers[0].mlp.shared
    assert shared.gate_proj.weight.shape == (2 * 96, 64)
    assert 0.01 < shared.gate_proj.weight.std().item() < 0.03  # the initializer's 0.02, not nn.Linear's
    hidden = torch.randn(2, 8, 64)
    mlp = model.model.layers[0].mlp
    out = mlp(hidden)
    with torch.no_grad():
        shared.down_proj.weight.zero_()
    assert not torch.allclose(out, mlp(hidden))
    cfg = lambda *w: load(compose_config(["model=mixtral-tiny", *w])).model  # noqa: E731
    h, width = cfg().n_embd, cfg().n_inner
    extra = active_block_params(cfg("model.moe.shared_experts=2")) - active_block_params(cfg())
    assert extra == cfg().n_layer * 2 * 3 * h * width


@pytest.fixture(scope="module")
def one_rank_aux_free(tmp_path_factory):
    """The aux-free run on one process: the same global batch of 8 sequences as 2 ranks of 4, in
    2 micro batches (the bias update sums the load over both)."""
    run_dir = tmp_path_factory.mktemp("aux_free_one_rank")
    assert_ok(run_train([*TINY, *MOE, *AUX_FREE, "zero=stage2", "trainer.grad_accum=2"], run_dir))
    return run_dir


@pytest.mark.parametrize("layout", AUX_FREE_LAYOUTS.values(), ids=AUX_FREE_LAYOUTS.keys())
def test_aux_free_routing_with_shared_experts_on_2_ranks_equals_1_and_resumes(
    launch2, one_rank_aux_free, tmp_path, layout
):
    """model.moe.balance=aux_free with a shared expert, on 2 ranks (the experts split over them by
    DeepSpeed-MoE, or on FSDP2's mesh) against one process of the same global batch: the same
    losses and gradient norms for 10 steps. The bias moves from each step's load over every rank
    (a load summed on each rank alone moved step 3's gradient norm by 1.3e-3). It balances: the
    busiest expert's load over the mean, steps 6-10, below the unbiased router's (a bias moved the
    wrong way unbalances). The bias is in the checkpoint: a run resumed from step 3 continues the
    run (a bias left out of the checkpoint failed it)."""
    split, one = train_lines(launch2(*layout)), train_lines(one_rank_aux_free)
    for key in ("loss", "grad_norm"):
        assert_close([m[key] for m in split], [m[key] for m in one], STEPS_FP32, key)
    unbiased = train_lines(launch2(*layout, "model.moe.bias_update_rate=0"))
    assert abs(unbiased[1]["loss"] - split[1]["loss"]) > 1e-4  # the bias routes the second step otherwise
    load = lambda lines: sum(m["expert_load_max"] for m in lines[5:]) / 5  # noqa: E731
    assert load(split) < load(unbiased) - 0.05, (load(split), load(unbiased))

    checkpoint = launch2(*layout) / "checkpoints" / "step_00000003"
    # the checkpoint holds the bias (scripts/evaluate.py's model has it) and has no Mixtral form
    whole = consolidate(str(checkpoint)).model
    assert all(mlp.moe.deepspeed_moe.gate.route_bias.abs().sum() > 0 for mlp in whole.moe_layers())
    with pytest.raises(ConfigError, match="no router bias and no shared experts"):
        to_transformers_mixtral(whole)
    resumed = run_train([*TINY, *layout, f"run.resume={checkpoint}"], tmp_path / "resumed", ranks=2)
    assert_ok(resumed)
    after = [m for m in train_lines(tmp_path / "resumed") if m["step"] > 3]
    assert [m["step"] for m in after] == list(range(4, 11))
    for key in ("loss", "grad_norm"):
        assert_close([m[key] for m in after], [m[key] for m in split[3:]], STEPS_FP32, f"resumed {key}")


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
