"""Long sequences: sequence parallelism (`sequence_parallel.size`, DeepSpeed Ulysses) against data
parallelism on the same global batch, with gradient clipping on, so a gradient off by the group
size shows in the logged norm; the tiled loss (`trainer.loss_tiles`) against transformers' own
loss and gradients, in process and on the engines; the refusals."""

import json
import subprocess

import pytest
import torch

from harness import FORKED_PYTHON, REPO, read_metrics, train_losses, validate
from lmrepo.config import ModelConfig
from lmrepo.distributed.device import detect_device
from lmrepo.models import build_model
from lmrepo.plan.compose import compose_checked
from lmrepo.utils.errors import ConfigError
from numerics import NORM_STEPS, STEPS_FP32, VOCAB, assert_close, reordered_sum

FIRST = "checkpoints/step_00000003"
LLAMA = ["model=llama-tiny", "model.n_kv_head=2", "model.n_inner=128", "precision=fp32", "trainer.max_steps=10"]
# TINY's data-parallel run reads 2 x 4 sequences a step; one sequence-parallel group of the same 2
# ranks reads all 8 in one micro batch, each rank holding half of every sequence.
SP = ["sequence_parallel.size=2", "trainer.micro_batch_size=8"]
# fp32, the same samples and weights: only summation orders differ (the attention all-to-all, the
# loss summed in slices or tiles): losses to STEPS_FP32, norms to NORM_STEPS (tests/numerics.py).
# Measured here: losses within 2e-7, norms within 1e-7 relative; a gradient off by the group size
# moves the norm by 100% and, through the clip, the loss by far more.


def steps(run_dir) -> list[dict]:
    return [m for m in read_metrics(run_dir) if "loss" in m]


def assert_same_training(run_dir, reference) -> None:
    ran, ref = steps(run_dir), steps(reference)
    assert len(ran) == len(ref) > 0
    # the data-parallel size, hence tokens and tokens_per_s, counted right
    assert [m["tokens"] for m in ran] == [m["tokens"] for m in ref]
    assert_close([m["loss"] for m in ran], [m["loss"] for m in ref], STEPS_FP32, "losses")
    assert_close([m["grad_norm"] for m in ran], [m["grad_norm"] for m in ref], NORM_STEPS, "gradient norms")
    evals = [[m["eval_loss"] for m in read_metrics(d) if "eval_loss" in m] for d in (run_dir, reference)]
    assert evals[0] and evals[1]
    assert_close(evals[0][-1], evals[1][-1], STEPS_FP32, "eval loss")


@pytest.mark.distributed
def test_sequence_parallel_equals_data_parallel_and_resumes(launch2, tmp_path):
    """Llama, ZeRO-2 with the tiled loss, and GPT-2 on ZeRO-3 (whose reduce-scatter would divide the
    gradients by the group size: lmrepo reduces without it) against data parallelism; a resume;
    an export."""
    reference = launch2(*LLAMA, "zero=stage2")
    assert all(m["grad_norm"] > 1.0 for m in steps(reference))  # trainer.grad_clip=1.0 clips every step
    split = launch2(*LLAMA, "zero=stage2", *SP, "trainer.loss_tiles=2")
    assert_same_training(split, reference)
    ds = json.loads((split / "ds_config.json").read_text())
    assert ds["sequence_parallel_size"] == 2 and ds["train_batch_size"] == 8

    gpt2 = launch2("zero=stage3", "precision=fp32", *SP)
    assert json.loads((gpt2 / "ds_config.json").read_text())["zero_optimization"]["reduce_scatter"] is False
    assert_same_training(gpt2, launch2("zero=stage3", "precision=fp32"))

    resumed = launch2(*LLAMA, "zero=stage2", *SP, "trainer.loss_tiles=2", f"run.resume={split / FIRST}")
    assert train_losses(resumed) == train_losses(split)[3:]  # bit for bit

    out = tmp_path / "hf"
    export = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "export_hf.py"), str(split), str(out)], capture_output=True, text=True
    )
    assert export.returncode == 0, export.stderr[-2000:]
    from transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(out)  # one whole model, no sequence-parallel trace
    assert exported.config.num_hidden_layers == 2 and not hasattr(exported.config, "sequence_parallel_size")


@pytest.mark.distributed
def test_tiled_loss_on_fsdp2_equals_untiled(launch2):
    assert_same_training(
        launch2("engine=fsdp2", "zero=stage3", "trainer.loss_tiles=3"), launch2("engine=fsdp2", "zero=stage3")
    )


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tiled_loss_equals_transformers_loss(family):
    """lmrepo's loss in 3 uneven tiles (32 tokens), with unscored (-100) labels, against the loss and
    gradients transformers computes on the whole logits tensor, in fp32: the same per-token losses
    summed in tiles (another order of 58 terms) and each tile's LM head backward, whose sums over the
    vocabulary are blocked otherwise for another row count (each gradient by its norm). A token
    scored twice or not at all moves the loss by 1/58 of it (1.7e-2)."""
    shape = dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=50257)
    extra = dict(n_kv_head=2, n_inner=128, tie_embeddings=False) if family == "llama" else {}
    config = ModelConfig(family=family, name="t", **shape, **extra)
    torch.manual_seed(0)
    ids = torch.randint(0, 50257, (2, 32))
    labels = ids.clone()
    labels[:, [0, 7, 19]] = -100  # document starts under document masking
    results = []
    for tiles in (None, 3):
        torch.manual_seed(1)
        model = build_model(config, loss_tiles=tiles)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (tiled, tiled_grads) = results
    assert_close(float(tiled), float(plain), reordered_sum(int((labels != -100).sum())), "loss")
    assert_close(tiled_grads, plain_grads, reordered_sum(VOCAB), "gradients")


def ds_or_error(overrides, world):
    try:
        return validate(compose_checked(overrides), world, detect_device("cpu"))[0]
    except ConfigError as err:
        return str(err)


def test_sequence_parallel_config_and_refusals():
    ds = ds_or_error(["model=llama-tiny", "sequence_parallel.size=2", "trainer.micro_batch_size=2"], 4)
    assert ds["sequence_parallel_size"] == 2 and ds["train_batch_size"] == 2 * 2  # world 4 = sp 2 x dp 2
    assert "sequence_parallel_size" not in ds_or_error(["model=llama-tiny"], 2)
    sp, sp4 = "sequence_parallel.size=2", "sequence_parallel.size=4"
    refusals = [  # (overrides, world size, the message's start)
        ([sp], 3, "sequence_parallel.size=2 does not divide the 3 rank(s)"),
        (["model=bert-tiny", sp], 2, "sequence_parallel.size=2 splits causal models (GPT-2, Llama), not model.family"),
        ([sp, "pipeline=1f1b", "pipeline.stages=2"], 4, "sequence_parallel.size=2 does not combine with DeepSpeed's"),
        (["model=llama-tiny", sp, "tp=auto"], 4, "sequence_parallel.size=2 does not combine with tensor parallel"),
        ([sp4, "model.n_head=6", "model.n_embd=96"], 4, f"{sp4} does not divide the model's 6 attention heads"),
        (["model=llama-tiny", sp4, "model.n_kv_head=2"], 4, f"{sp4} does not divide the model's 2 key/value heads"),
        ([sp, "data.block_size=33"], 2, "sequence_parallel.size=2 does not divide data.block_size=33"),
        ([sp, "eval.tasks=[shakespeare_cloze]"], 2, "sequence_parallel.size=2: eval.tasks runs lm-eval on whole"),
        ([sp, "zero=stage3", "zero.reduce_scatter=true"], 2, "sequence_parallel.size=2 with zero=stage3 reduces"),
        ([sp, "zero=stage3", "zero.reduce_bucket_size=1000"], 2, f"{sp} with zero=stage3: the embedding's"),
        (["sequence_parallel.size=0"], 1, "sequence_parallel.size=0 must be >= 1"),
        (["trainer.loss_tiles=0"], 1, "trainer.loss_tiles=0 must be >= 1"),
        (["model=bert-tiny", "trainer.loss_tiles=2"], 1, "trainer.loss_tiles=2 tiles a causal LM's loss"),
        (["trainer.loss_tiles=2", "pipeline=1f1b", "pipeline.stages=2"], 2, "trainer.loss_tiles=2 does not combine"),
    ]  # fmt: skip
    for overrides, world, message in refusals:
        error = ds_or_error(overrides, world)
        assert isinstance(error, str) and error.startswith(message), (overrides, error)


def test_sequence_parallel_attention_keeps_packed_documents_apart():
    """Under sequence parallelism DeepSpeed's wrapper drops the model's mask and hands SDPA the whole
    sequence's position ids: with packed documents (ids restarting at 0) lmrepo's SDPA attends within
    each document, as each document alone; a row of one document gets the causal mask (the mask is
    built without reading the tensor on the host, which would break a compiled model's graph)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lmrepo.distributed.sequence_parallel import document_aware, document_mask

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    module = SimpleNamespace(is_causal=True)
    attend = document_aware(sdpa_attention_forward)
    packed = torch.cat([torch.arange(10), torch.arange(6)])[None]
    together, _ = attend(module, q, k, v, None, position_ids=packed)
    alone = [
        sdpa_attention_forward(module, *(t[:, :, part] for t in (q, k, v)), None)[0]
        for part in (slice(0, 10), slice(10, 16))
    ]
    # The softmax and the weighted sum over at most 16 keys, reordered by the mask; attention
    # across the documents moves the output by its whole size.
    assert_close(together, torch.cat(alone, dim=1), reordered_sum(16), "attention output")
    assert torch.equal(document_mask(torch.arange(16)[None]), torch.ones(16, 16, dtype=torch.bool).tril()[None, None])
    one, _ = attend(module, q, k, v, None, position_ids=torch.arange(16)[None])
    assert_close(one, sdpa_attention_forward(module, q, k, v, None)[0], reordered_sum(16), "one document")
