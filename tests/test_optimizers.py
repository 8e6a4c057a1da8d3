"""optimizer=muon and schedule=wsd: the schedule's shape and its resume mid-decay, Muon's halves by
parameter role for every family, Muon against a plain-torch reference, ZeRO-2 against ZeRO-0, and
the combinations refused in one line."""

import copy
import json
import math
import subprocess

import pytest
import torch

from harness import CPU, FORKED_PYTHON, GPU, REPO, TINY, assert_ok, read_metrics, validate
from lmrepo.config import load
from lmrepo.models import build_model
from lmrepo.optim.muon import muon_parameters
from lmrepo.optim.schedules import build_scheduler
from lmrepo.plan.compose import compose_config
from lmrepo.utils.errors import ConfigError
from numerics import STEPS_FP32, assert_close

FIRST = "checkpoints/step_00000003"
# Muon on DeepSpeed with its gradient unclipped (ZeRO-1/2/3 refuse trainer.grad_clip with Muon),
# and a warmup-stable-decay schedule whose decay starts at step 3: the checkpoint at step 3 is
# mid-decay (3 of its 5 steps to go).
MUON_WSD = ("optimizer=muon", "trainer.grad_clip=0", "schedule=wsd", "schedule.decay_fraction=0.8")


# --- schedule=wsd ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, left",
    [
        ("linear", lambda p: 1 - p),
        ("cosine", lambda p: (1 + math.cos(math.pi * p)) / 2),
        ("one_minus_sqrt", lambda p: 1 - math.sqrt(p)),
    ],
)
def test_wsd_warms_up_holds_then_decays_in_its_shape(shape, left):
    overrides = ["schedule=wsd", "trainer.max_steps=20", "schedule.warmup_steps=4", "schedule.decay_fraction=0.25"]
    section = validate(
        compose_config([*overrides, "schedule.min_lr_ratio=0.1", f"schedule.decay_shape={shape}"]), 1, GPU
    )[0]["scheduler"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = build_scheduler(optimizer, section)
    lrs = []
    for _ in range(20):
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    # iteration i: warmup 0..3, stable 4..14, the last 5 (25% of 20) decay to 0.1 x lr at 19
    expected = [2.0 * i / 4 for i in range(4)] + [2.0] * 11
    expected += [2.0 * (0.1 + 0.9 * left((i - 15 + 1) / 5)) for i in range(15, 20)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    # A new scheduler given the saved state continues mid-decay where the first one is.
    resumed = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0), section)
    resumed.load_state_dict({"last_batch_iteration": 16})
    assert resumed.get_last_lr() == [lrs[16]]


# --- Muon's halves -----------------------------------------------------------------------------

ROLES = {
    # model: (parameters Muon steps, parameters AdamW steps), by name, as each family defines them
    "gpt2-tiny": (
        {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight", "transformer.h.0.mlp.c_fc.weight"},
        {
            "transformer.wte.weight",
            "transformer.wpe.weight",
            "transformer.h.0.ln_1.weight",
            "transformer.h.0.attn.c_attn.bias",
        },
    ),
    "llama-tiny": (
        {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"},
        {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"},
    ),
    "bert-tiny": (
        {"bert.encoder.layer.0.attention.self.query.weight", "cls.predictions.transform.dense.weight"},
        {
            "bert.embeddings.word_embeddings.weight",
            "bert.embeddings.position_embeddings.weight",
            "bert.embeddings.token_type_embeddings.weight",
            "cls.predictions.transform.LayerNorm.weight",
        },
    ),
}


@pytest.mark.parametrize("model", sorted(ROLES))
def test_muon_takes_the_hidden_matrices_of_every_family(model):
    """By role: embeddings (GPT-2's wte/wpe, which DeepSpeed's by-name rule would give Muon), the
    LM head (tied or not) and everything below 2-D take AdamW; GPT-2's Conv1D weights take Muon."""
    net = build_model(load(compose_config([f"model={model}", "model.n_layer=1"])).model)
    muon = muon_parameters(net)
    names = {name for name, p in net.named_parameters() if id(p) in muon}
    hidden, others = ROLES[model]
    assert hidden <= names and not (others & names)
    head = net.get_output_embeddings().weight
    assert id(head) not in muon
    assert all(p.ndim >= 2 for p in net.parameters() if id(p) in muon)


def test_the_torch_engines_muon_resumes_both_halves():
    """lmrepo's Muon for the torch engines (ShardedMuon: FSDP2, the torch pipelines) loaded from its
    state dict steps as the optimizer that saved it, both halves: torch's load_state_dict makes new
    groups and states, which the AdamW half must step (it stepped the ones from before the load:
    fresh moments, and a schedule's rate that never reached it)."""
    from lmrepo.optim.optimizer import param_groups, torch_optimizer

    words = ["model=llama-tiny", "model.n_layer=1", *TINY[1:3], "model.n_kv_head=2", *TINY[-2:], "optimizer=muon"]
    config = load(compose_config(words))
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(model, optimizer) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(0)
    model = build_model(config.model)
    optimizer = torch_optimizer(param_groups(model, 0.1), config.optimizer, model)
    step(model, optimizer)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved_states = copy.deepcopy(optimizer.state_dict())  # its tensors are the live states
    step(model, optimizer)
    resumed_model = build_model(config.model)
    resumed_model.load_state_dict(saved_weights)
    resumed = torch_optimizer(param_groups(resumed_model, 0.1), config.optimizer, resumed_model)
    resumed.load_state_dict(saved_states)
    step(resumed_model, resumed)
    for (name, a), b in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name


def test_muon_section_of_the_deepspeed_dict():
    ds, _ = validate(compose_config(["optimizer=muon", "trainer.grad_clip=0", "zero=stage3"]), 1, CPU)
    assert ds["optimizer"]["type"] == "Muon"
    params = ds["optimizer"]["params"]
    assert (params["muon_lr"], params["adam_lr"], params["momentum"], params["ns_method"]) == (
        0.02,
        1e-3,
        0.95,
        "standard",
    )
    assert params["torch_adam"] is True  # the AdamW half as torch's on a CPU (no FusedAdam build)
    assert ds["zero_optimization"]["reduce_scatter"] is False  # DeepSpeed's Muon under ZeRO-3


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["zero=stage2"], 1, "DeepSpeed's ZeRO clips Muon's orthogonalised update there, not the gradient"),
        (["zero=stage3", "trainer.grad_clip=0", "zero.reduce_scatter=true"], 1, "needs whole gradients"),
        (["pipeline=1f1b", "pipeline.stages=2"], 2, "builds no Muon/AdamW split per stage; choose a torch pipeline"),
        (["tp=auto", "model=llama-tiny"], 2, "each rank's shard of a matrix"),
        (["schedule=linear"], 1, "WarmupDecayLR sets one absolute learning rate"),
        (["schedule=constant"], 1, "WarmupLR sets one absolute learning rate"),
    ],
)
def test_muon_refusals(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(["optimizer=muon", *overrides]), world, CPU)


def test_muon_under_fsdp2_keeps_clipping_and_whole_gradients_to_deepspeed():
    """Under FSDP2 the refusals that are DeepSpeed's own do not apply: FSDP2 clips the gradient (not
    ZeRO's orthogonalised update), its Muon gathers each matrix whole (also one cut by tp=auto)."""
    for overrides in (["engine=fsdp2"], ["engine=fsdp2", "tp=auto", "model=llama-tiny"]):
        validate(compose_config(["optimizer=muon", *overrides]), 2, CPU)


def test_muon_compiles_on_cuda_only_unless_told():
    from lmrepo.optim.muon import compile_muon

    assert compile_muon(None) is False  # this CPU machine
    assert compile_muon(True) is True and compile_muon(False) is False


# --- Muon runs ----------------------------------------------------------------------------------


@pytest.mark.distributed
def test_muon_equals_a_plain_torch_reference(tmp_path):
    """Four steps of lmrepo's Muon (DeepSpeed's, ZeRO-0, fp32, the gradient clipped at 0.5, which
    clips every step here) against Keller Jordan's Muon and torch's AdamW written in
    tests/probes/muon_probe.py: the same operations in the same order, so equal bit for bit (a bf16
    rounding that differed would move a weight by ~1e-3)."""
    overrides = [*TINY, "trainer.max_steps=4", *MUON_WSD, "trainer.grad_clip=0.5"]
    overrides += ["schedule.warmup_steps=0", "schedule.decay_fraction=0"]  # constant learning rates
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "tests/probes/muon_probe.py"), str(tmp_path), *overrides],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert_ok(proc)
    result = json.loads((tmp_path / "muon_probe.json").read_text())
    assert result["lmrepo"] == result["reference"]
    assert result["max_weight_diff"] == 0.0
    use_muon = result["use_muon"]
    assert not use_muon["transformer.wte.weight"] and not use_muon["transformer.wpe.weight"]
    assert use_muon["transformer.h.0.attn.c_attn.weight"] and not use_muon["transformer.h.0.ln_1.weight"]
    assert result["compiled"] is False  # optimizer.compile=null on a CPU


@pytest.mark.distributed
def test_muon_zero2_equals_zero0_and_wsd_resumes_mid_decay(launch2):
    zero0 = launch2("zero=stage0", *MUON_WSD)
    zero2 = launch2("zero=stage2", *MUON_WSD)
    resumed = launch2("zero=stage2", *MUON_WSD, f"run.resume={zero2 / FIRST}")
    lines0, lines2 = ([m for m in read_metrics(run) if "loss" in m] for run in (zero0, zero2))
    for a, b in zip(lines0, lines2, strict=True):
        assert a["lr"] == b["lr"]
    # ZeRO-2 reduces the gradients in another order
    assert_close([m["loss"] for m in lines2], [m["loss"] for m in lines0], STEPS_FP32, "losses")
    # ZeRO-0 reports the gradient's norm; under ZeRO-2 DeepSpeed's norm is Muon's update's: left out.
    assert all("grad_norm" in m for m in lines0) and not any("grad_norm" in m for m in lines2)
    lrs = [m["lr"] for m in lines2]
    assert lrs[2] < 0.02 and lrs[2] > lrs[3] > lrs[4] > lrs[5]  # step 3, the checkpoint, is mid-decay
    after = [(m["step"], m["loss"], m["lr"]) for m in lines2 if m["step"] > 3]
    assert [(m["step"], m["loss"], m["lr"]) for m in read_metrics(resumed) if "loss" in m] == after  # bit for bit


def test_a_json_names_the_wsd_scheduler_with_lmrepos_autos(tmp_path):
    """DeepSpeed has no warmup-stable-decay scheduler; a user's JSON names lmrepo's as it names
    DeepSpeed's, "auto" standing for lmrepo's values (schedule=wsd's keys)."""
    section = {
        "type": "WarmupStableDecayLR",
        "params": {k: "auto" for k in ("total_num_steps", "warmup_num_steps", "decay_num_steps", "min_ratio")},
    }
    section["params"]["decay_type"] = "cosine"
    path = tmp_path / "wsd.json"
    path.write_text(json.dumps({"scheduler": section}))
    overrides = [f"deepspeed_config={path}", "trainer.max_steps=50", "schedule.warmup_steps=5"]
    ds, changed = validate(compose_config([*overrides, "schedule.decay_fraction=0.2"]), 1, CPU)
    assert ds["scheduler"] == {
        "type": "WarmupStableDecayLR",
        "params": {
            "total_num_steps": 50,
            "warmup_num_steps": 5,
            "decay_num_steps": 10,
            "min_ratio": 0.1,  # schedule=cosine's min_lr_ratio: the JSON chose the schedule
            "decay_type": "cosine",
        },
    }
    assert changed == ["scheduler"]
