"""Tokenizers, token-file preparation, the step order of blocks, mixtures, and BERT masking, in
process; scripts/prepare_data.py as a subprocess (benchmarks/bench_data.py --quick: test_bench.py)."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import FORKED_PYTHON, REPO
from lmrepo.data.batches import MixtureOrder, SampleOrder, eval_indices
from lmrepo.data.corpus import read_pieces, shakespeare_files
from lmrepo.data.loader import Layout, LMData, MaskedInputs
from lmrepo.data.prepare import load_meta, open_tokens, prepare, prepare_sources
from lmrepo.data.tokenizer import load_tokenizer
from lmrepo.plan.compose import load_config
from lmrepo.utils.errors import ConfigError

DOCS = ["First document.\nIt has two lines.\n", "Second one, with  double spaces\n\n", "third: no final newline"]


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def bert():
    return load_tokenizer("bert")


def write_corpus(directory: Path, docs: list[str]) -> list[Path]:
    directory.mkdir(exist_ok=True)
    paths = [directory / f"doc{i}.txt" for i in range(len(docs))]
    for path, doc in zip(paths, docs):
        path.write_text(doc)
    return paths


def data_cfg(tmp_path: Path, paths, source: str = "text", *extra: str):
    listed = ",".join(str(p) for p in paths)
    return load_config(
        [f"data={source}", f"data.paths=[{listed}]", f"data.cache_dir={tmp_path / 'cache'}", *extra]
    ).data


def token_dirs(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.is_dir()] if cache.exists() else []


def decoded(tokenizer, token_dir: Path) -> str:
    ids = np.concatenate([open_tokens(token_dir, "train"), open_tokens(token_dir, "val")])
    return tokenizer.decode(ids.tolist())


# --- tokenizers ------------------------------------------------------------------------------


def test_gpt2_tokenizer(gpt2):
    assert len(gpt2) == 50257
    assert gpt2("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]


def test_gpt2_bytes_are_gpt2s_byte_tokens_and_round_trip(gpt2):
    """model.tokenizer=bytes: every byte one token, with the id GPT-2's BPE gives that byte alone
    (its first 256 ids), <|endoftext|> as 256; any text (accents, emoji, control bytes) decodes back."""
    from lmrepo.data.tokenizer import end_of_text_id

    tokens = load_tokenizer("bytes")
    assert len(tokens) == 257 and tokens.eos_token_id == end_of_text_id("bytes") == 256
    text = "ROMEO: héllo,\tworld \U0001f600\x00!"
    ids = tokens(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode()) and tokens.decode(ids) == text
    for byte in range(256):  # GPT-2's symbol for id `byte` is the bytes tokenizer's id `byte`
        assert tokens.convert_tokens_to_ids(gpt2.convert_ids_to_tokens(byte)) == byte, byte
    assert tokens.decode([tokens.eos_token_id]) == gpt2.decode([end_of_text_id("gpt2")]) == "<|endoftext|>"


def test_bert_tokenizer(bert):
    assert len(bert) == 30522
    assert (bert.cls_token_id, bert.sep_token_id, bert.mask_token_id) == (101, 102, 103)


# --- prepare ---------------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path, gpt2):
    paths = write_corpus(tmp_path / "corpus", DOCS)
    data = data_cfg(tmp_path, paths)
    return data, paths, prepare(data, gpt2)


def test_prepare_round_trip(prepared, gpt2):
    _, _, token_dir = prepared
    assert decoded(gpt2, token_dir) == "".join(doc + "<|endoftext|>" for doc in DOCS)


def test_prepare_meta(prepared, gpt2):
    _, _, token_dir = prepared
    meta = json.loads((token_dir / "meta.json").read_text())
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16" and meta["documents"] == len(DOCS)
    assert meta["train_tokens"] == len(open_tokens(token_dir, "train")) > 0
    assert meta["val_tokens"] == len(open_tokens(token_dir, "val")) >= 1
    expected = sum(len(gpt2(doc)["input_ids"]) + 1 for doc in DOCS)
    assert meta["train_tokens"] + meta["val_tokens"] == expected


def test_prepare_reuses_cache(prepared, gpt2):
    data, _, token_dir = prepared
    before = {f: (token_dir / f).stat().st_mtime_ns for f in ("train.bin", "val.bin", "meta.json")}
    assert prepare(data, gpt2) == token_dir
    assert {f: (token_dir / f).stat().st_mtime_ns for f in before} == before


def test_prepare_rebuilds_when_a_file_changes(prepared, gpt2, tmp_path):
    data, paths, token_dir = prepared
    paths[0].write_text("A completely different first document.\n")
    rebuilt = prepare(data, gpt2)
    assert rebuilt != token_dir
    assert decoded(gpt2, rebuilt).startswith("A completely different first document.\n<|endoftext|>")


def test_prepare_leaves_no_tmp_dir(prepared, tmp_path):
    assert list((tmp_path / "cache").glob("*.tmp")) == []


def test_prepare_rebuilds_on_same_size_edit_with_same_mtime(prepared, gpt2):
    data, paths, token_dir = prepared
    stat = paths[0].stat()
    paths[0].write_text(DOCS[0].upper())
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert prepare(data, gpt2) != token_dir


def test_bad_path_matches_no_file(tmp_path, gpt2):
    with pytest.raises(ConfigError, match="data.paths: .*matches no file"):
        prepare(data_cfg(tmp_path, [tmp_path / "nothing-*.txt"]), gpt2)
    assert token_dirs(tmp_path / "cache") == []


def test_empty_corpus(tmp_path, gpt2):
    paths = write_corpus(tmp_path / "corpus", [""])
    with pytest.raises(ConfigError, match="no text"):
        prepare(data_cfg(tmp_path, paths), gpt2)
    assert token_dirs(tmp_path / "cache") == []


def test_non_utf8_file(tmp_path, gpt2):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"\xff\xfe bad")
    with pytest.raises(ConfigError, match="not UTF-8") as err:
        prepare(data_cfg(tmp_path, [path]), gpt2)
    assert str(path) in str(err.value)
    assert token_dirs(tmp_path / "cache") == []


def test_json_missing_text_field(tmp_path, gpt2):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    with pytest.raises(ConfigError, match="data.text_field=body is not a field"):
        prepare(data_cfg(tmp_path, [path], "json", "data.text_field=body"), gpt2)
    assert token_dirs(tmp_path / "cache") == []


@pytest.mark.parametrize(
    "records, says",
    [
        (['{"text": 100000}'] * 3, "docs.jsonl line 1: text is a int (100000), not text"),
        (['{"text": "one"}', '{"text": "two"}', '{"text": 7}'], "docs.jsonl line 3: text is a int (7), not text"),
        (['{"text": "one"}', '{"text": ["a", "b"]}'], "docs.jsonl line 2: text is a list"),
        (['{"text": "one"}', '{"text": "two"'], "docs.jsonl line 2: not JSON (Expecting ',' delimiter)"),
    ],
    ids=["numbers", "a-number-among-texts", "a-list", "a-broken-line"],
)
def test_json_text_that_is_not_text_is_one_line_naming_file_and_line(tmp_path, gpt2, records, says, capfd):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(records) + "\n")
    with pytest.raises(ConfigError) as err:
        prepare(data_cfg(tmp_path, [path], "json", "data.num_proc=1"), gpt2)
    assert says in str(err.value) and "\n" not in str(err.value)
    assert "Failed to load JSON" not in capfd.readouterr().err, "datasets' own log of the error: lmrepo's line says it"
    assert token_dirs(tmp_path / "cache") == []


def test_json_records_without_text_are_left_out_and_counted(tmp_path, gpt2, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one"}\n{}\n{"text": null}\n{"text": "two"}\n')
    token_dir = prepare(data_cfg(tmp_path, [path], "json", "data.num_proc=1"), gpt2)
    assert decoded(gpt2, token_dir) == "one<|endoftext|>two<|endoftext|>"
    assert "left out 2 of 4 records without text in data.text_field=text (missing or null)" in capsys.readouterr().out


def test_json_with_no_text_at_all_is_one_line(tmp_path, gpt2):
    path = tmp_path / "docs.jsonl"
    path.write_text('{}\n{"text": null}\n')
    with pytest.raises(ConfigError, match="no record has text in data.text_field=text"):
        prepare(data_cfg(tmp_path, [path], "json", "data.num_proc=1"), gpt2)


def test_json_round_trip(tmp_path, gpt2):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"body": "one"}\n{"body": "two"}\n')
    token_dir = prepare(data_cfg(tmp_path, [path], "json", "data.text_field=body", "data.num_proc=1"), gpt2)
    assert decoded(gpt2, token_dir) == "one<|endoftext|>two<|endoftext|>"


def test_a_document_read_in_pieces_tokenizes_as_a_whole(gpt2, bert):
    """Text files are read in bounded pieces (one huge file never sits in memory); cut at word
    boundaries, the pieces' tokens are the whole document's (a Shakespeare play, ~2,000-char pieces)."""
    play = shakespeare_files()[0]
    text = Path(play).read_text()
    pieces = list(read_pieces([play], piece_chars=2000))
    assert len(pieces) > 50 and "".join(p["text"] for p in pieces) == text
    assert [(p["start"], p["end"]) for p in pieces] == [
        (True, False),
        *[(False, False)] * (len(pieces) - 2),
        (False, True),
    ]
    for tokenizer in (gpt2, bert):
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert [i for p in pieces for i in tokenizer(p["text"], add_special_tokens=False)["input_ids"]] == whole


def test_prepare_joins_the_pieces_of_each_document(tmp_path, gpt2, monkeypatch):
    """Small pieces spread each document over both tokenizer processes: one EOS per document, after
    its last piece; a line longer than the pieces is cut inside and still round-trips."""
    import lmrepo.data.corpus as corpus_module

    monkeypatch.setattr(corpus_module, "PIECE_CHARS", 2000)
    docs = [Path(shakespeare_files()[0]).read_text(), "one line without a break " * 400, "short\n"]
    token_dir = prepare(data_cfg(tmp_path, write_corpus(tmp_path / "corpus", docs), "text", "data.num_proc=2"), gpt2)
    assert load_meta(token_dir)["documents"] == 3
    assert decoded(gpt2, token_dir) == "".join(doc + "<|endoftext|>" for doc in docs)
    first = gpt2(docs[0], add_special_tokens=False)["input_ids"] + [gpt2.eos_token_id]
    assert stored_ids(token_dir)[: len(first)] == first


# --- SampleOrder -----------------------------------------------------------------------------

N_BLOCKS, SEED = 103, 1234


def step_set(step: int, micro: int, dp: int, global_batch: int = 8, seed: int = SEED) -> list[int]:
    """All ranks' block indices of one optimizer step, in rank then micro-batch order."""
    return [
        int(i)
        for rank in range(dp)
        for batch in SampleOrder(N_BLOCKS, global_batch, micro, rank, dp, seed).micro_batches(step * global_batch)
        for i in batch
    ]


@pytest.mark.parametrize("dp, micro", [(2, 2), (3, 2), (3, 4)])
def test_ranks_split_the_global_batch(dp, micro):
    global_batch = 12
    ranks = [
        {int(i) for b in SampleOrder(N_BLOCKS, global_batch, micro, r, dp, SEED).micro_batches(60) for i in b}
        for r in range(dp)
    ]
    assert sum(len(r) for r in ranks) == len(set().union(*ranks)) == global_batch
    assert set().union(*ranks) == set(step_set(5, global_batch, 1, global_batch))


def test_each_epoch_covers_every_block_once():
    order = SampleOrder(N_BLOCKS, 8, 2, 0, 1, SEED)
    for epoch in range(3):
        assert sorted(order.stream(epoch * N_BLOCKS, N_BLOCKS)) == list(range(N_BLOCKS))
    # Steps straddle epoch boundaries instead of dropping the remainder of an epoch.
    seen = [i for step in range(N_BLOCKS // 8) for i in step_set(step, 2, 2)]
    assert len(seen) == len(set(seen)) == (N_BLOCKS // 8) * 8


def test_each_epoch_is_the_seeded_permutation_drawn_once():
    # The order is numpy's permutation seeded with (seed, epoch), as it always was; each stream keeps
    # only the permutation it drew last, so epochs after epochs hold one in memory.
    from lmrepo.data import batches

    seed = SEED + 7
    order = SampleOrder(N_BLOCKS, 8, 8, 0, 1, seed)
    for epoch in range(5):
        expected = np.random.default_rng([seed, epoch]).permutation(N_BLOCKS)
        assert order.stream(epoch * N_BLOCKS, N_BLOCKS).tolist() == expected.tolist()
    kept = [key for key in batches._LATEST_PERMUTATION if key == (N_BLOCKS, (seed,))]
    assert kept == [(N_BLOCKS, (seed,))] and batches._LATEST_PERMUTATION[kept[0]][0] == 4
    assert order.stream(0, 4).tolist() == np.random.default_rng([seed, 0]).permutation(N_BLOCKS)[:4].tolist()


@pytest.mark.parametrize("step", [0, 3, 12, 30])
def test_same_samples_per_step_in_every_layout(step):
    # global batch 8 as (micro 4, dp 2, accum 1), (micro 2, dp 2, accum 2), (micro 8, dp 1, accum 1)
    assert sorted(step_set(step, 4, 2)) == sorted(step_set(step, 2, 2)) == sorted(step_set(step, 8, 1))


def test_order_depends_only_on_seed_and_position():
    assert step_set(17, 2, 2) == step_set(17, 2, 2)
    assert step_set(17, 2, 2) != step_set(17, 2, 2, seed=SEED + 1)


def test_resume_after_a_batch_size_change_neither_replays_nor_skips():
    """4 steps of global batch 8, then global batch 12 from the saved position: the stream continues."""
    first = [i for step in range(4) for i in step_set(step, 4, 2)]
    later = SampleOrder(N_BLOCKS, 12, 6, 0, 2, SEED), SampleOrder(N_BLOCKS, 12, 6, 1, 2, SEED)
    after = [int(i) for order in later for b in order.micro_batches(32) for i in b]
    assert sorted(first + after) == sorted(SampleOrder(N_BLOCKS, 8, 8, 0, 1, SEED).stream(0, 44).tolist())


def test_new_permutation_each_epoch():
    order = SampleOrder(N_BLOCKS, 8, 8, 0, 1, SEED)
    assert order.stream(0, N_BLOCKS).tolist() != order.stream(N_BLOCKS, N_BLOCKS).tolist()
    assert order.epoch_of(N_BLOCKS) == 1 and order.epoch_of(N_BLOCKS - 1) == 0


# --- BERT masking ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_blocks():
    return torch.randint(1000, 30000, (16, 126), generator=torch.Generator().manual_seed(0))


def test_masked_inputs_frame_each_row(bert, bert_blocks):
    out = MaskedInputs(bert)(bert_blocks, list(range(16)))
    assert out["input_ids"].shape == out["labels"].shape == (16, 128)
    assert (out["input_ids"][:, 0] == 101).all() and (out["input_ids"][:, -1] == 102).all()


def test_masked_inputs_mask_about_15_percent(bert, bert_blocks):
    out = MaskedInputs(bert)(bert_blocks, list(range(16)))
    masked = out["labels"] != -100
    assert 0.08 <= masked[:, 1:-1].float().mean().item() <= 0.22
    assert not masked[:, 0].any() and not masked[:, -1].any()
    assert torch.equal(out["labels"][masked], bert_blocks[masked[:, 1:-1]])
    assert torch.equal(out["input_ids"][:, 1:-1][~masked[:, 1:-1]], bert_blocks[~masked[:, 1:-1]])


def test_masked_inputs_deterministic_per_seed(bert, bert_blocks):
    inputs = MaskedInputs(bert)
    first, again = inputs(bert_blocks, list(range(16))), inputs(bert_blocks, list(range(16)))
    other = inputs(bert_blocks, list(range(100, 116)))
    assert torch.equal(first["input_ids"], again["input_ids"]) and torch.equal(first["labels"], again["labels"])
    assert not torch.equal(first["labels"], other["labels"])


# --- vocabularies beyond uint16 --------------------------------------------------------------


def word_level(vocab: dict[str, int]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]")


@pytest.fixture(scope="module")
def big_vocab():
    """70,000 tokens: ids up to 69,999 do not fit uint16."""
    return word_level({"[UNK]": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(69998)}})


def stored_ids(token_dir: Path) -> list[int]:
    return np.concatenate([open_tokens(token_dir, "train"), open_tokens(token_dir, "val")]).tolist()


def test_large_vocabulary_is_stored_as_uint32(tmp_path, big_vocab):
    docs = ["w0 w65534 w65535 w69997\n" * 3, "w12345 w70000 w1"]  # w70000 is not a word: [UNK]
    token_dir = prepare(
        data_cfg(tmp_path, write_corpus(tmp_path / "corpus", docs), "text", "data.num_proc=1"), big_vocab
    )
    assert load_meta(token_dir)["dtype"] == "uint32" and load_meta(token_dir)["vocab_size"] == 70000
    expected = [i for doc in docs for i in [*big_vocab(doc, add_special_tokens=False)["input_ids"], 1]]
    assert max(expected) == 69999 and stored_ids(token_dir) == expected


def test_dtype_follows_the_largest_id_not_the_length(tmp_path):
    sparse = word_level({"[UNK]": 0, "<eos>": 1, "big": 70000})  # 3 tokens, one id above uint16
    assert len(sparse) == 3
    token_dir = prepare(
        data_cfg(tmp_path, write_corpus(tmp_path / "corpus", ["big big big"]), "text", "data.num_proc=1"), sparse
    )
    assert load_meta(token_dir)["dtype"] == "uint32" and stored_ids(token_dir) == [70000, 70000, 70000, 1]


def test_an_id_beyond_the_dtype_is_refused_not_truncated(tmp_path, monkeypatch):
    """A tokenizer whose vocabulary under-reports its ids: writing stops instead of wrapping around."""
    import lmrepo.data.prepare as prepare_module

    sparse = word_level({"[UNK]": 0, "<eos>": 1, "big": 70000})
    monkeypatch.setattr(prepare_module, "id_bound", len)
    data = data_cfg(tmp_path, write_corpus(tmp_path / "corpus", ["big"]), "text", "data.num_proc=1")
    with pytest.raises(
        ConfigError, match=r"tokenizer \w+ produced token id 70000, which does not fit the uint16 token file"
    ):
        prepare(data, sparse)
    assert token_dirs(tmp_path / "cache") == []


# --- mixtures: the order -----------------------------------------------------------------------

SIZES, WEIGHTS = (40, 300, 7), (0.5, 0.3, 0.2)
OFFSETS = np.cumsum([0, *SIZES])


def mixture(global_batch=8, micro=8, rank=0, dp=1, seed=SEED, sizes=SIZES, weights=WEIGHTS) -> MixtureOrder:
    return MixtureOrder(sum(sizes), global_batch, micro, rank, dp, seed, sizes=sizes, weights=weights)


def source_of(indices) -> np.ndarray:
    return np.searchsorted(OFFSETS, indices, side="right") - 1


def test_mixture_draws_sources_in_proportion_to_the_weights():
    stream = mixture().stream(0, 60_000)
    fractions = np.bincount(source_of(stream), minlength=3) / len(stream)
    assert np.allclose(fractions, WEIGHTS, atol=0.01)
    # also over a short window that is not aligned to anything
    window = np.bincount(source_of(mixture().stream(12_345, 2_000)), minlength=3) / 2_000
    assert np.allclose(window, WEIGHTS, atol=0.04)


def test_mixture_each_source_runs_through_its_blocks_once_per_epoch():
    stream = mixture().stream(0, 30_000)
    for k, size in enumerate(SIZES):
        drawn = stream[source_of(stream) == k] - OFFSETS[k]
        epochs = [drawn[e * size : (e + 1) * size] for e in range(len(drawn) // size)]
        assert len(epochs) >= 2 and all(sorted(e) == list(range(size)) for e in epochs)
        assert epochs[0].tolist() != epochs[1].tolist()


def test_mixture_order_depends_only_on_seed_and_position():
    whole = mixture().stream(0, 40_000)  # crosses two mixture periods
    pieces = [mixture().stream(a, b - a) for a, b in [(0, 5), (5, 16_380), (16_380, 16_390), (16_390, 40_000)]]
    assert np.array_equal(np.concatenate(pieces), whole)
    assert not np.array_equal(mixture(seed=SEED + 1).stream(0, 1_000), whole[:1_000])


def mixture_step(step: int, micro: int, dp: int, global_batch: int = 12) -> list[int]:
    return [
        int(i)
        for rank in range(dp)
        for batch in mixture(global_batch, micro, rank, dp).micro_batches(step * global_batch)
        for i in batch
    ]


@pytest.mark.parametrize("dp, micro", [(2, 2), (3, 2), (3, 4)])
def test_mixture_ranks_split_each_step_without_overlap(dp, micro):
    for step in (0, 7, 40):
        ranks = [{int(i) for b in mixture(12, micro, r, dp).micro_batches(step * 12) for i in b} for r in range(dp)]
        assert sum(len(r) for r in ranks) == 12 and set().union(*ranks) == set(mixture_step(step, 12, 1))


def test_mixture_resume_after_a_batch_size_change_neither_replays_nor_skips():
    first = [i for step in range(5) for i in mixture_step(step, 2, 2)]
    after = [int(i) for r in range(2) for b in mixture(8, 4, r, 2).micro_batches(60) for i in b]
    assert sorted(first + after) == sorted(mixture().stream(0, 68).tolist())


def test_mixture_eval_takes_each_source_in_proportion():
    batches = [eval_indices([30, 30, 3], WEIGHTS, 4, rank, 2, 5) for rank in range(2)]
    chosen = np.concatenate([b for rank in batches for b in rank])
    assert len(chosen) == 40 and all(len(b) == 4 for rank in batches for b in rank)
    # the first blocks of each source's held-out split, 20/12/8 of 40; a source with fewer
    # held-out blocks than its share repeats them
    assert chosen.tolist() == [*range(20), *range(30, 42), 60, 61, 62, 60, 61, 62, 60, 61]
    # one source: rank 1's share of the first 3 x 4 x 2 held-out blocks, as before mixtures
    assert [b.tolist() for b in eval_indices([50], [1.0], 4, 1, 2, 3)] == [
        [12, 13, 14, 15],
        [16, 17, 18, 19],
        [20, 21, 22, 23],
    ]


# --- mixtures: configuration, preparation, batches ---------------------------------------------


def source_docs(word: str, count: int) -> list[str]:
    return [" ".join(f"{word}{j % 10}" for j in range(i, i + 300)) + "\n" for i in range(count)]


@pytest.fixture
def two_corpora(tmp_path):
    return write_corpus(tmp_path / "alpha", source_docs("alpha", 4)), write_corpus(
        tmp_path / "beta", source_docs("beta", 4)
    )


def mixture_cfg(tmp_path, sources: str, *extra: str):
    return load_config(
        [
            "data=mixture",
            f"data.sources={sources}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.block_size=16",
            "data.val_fraction=0.1",
            "data.num_proc=1",
            *extra,
        ]
    ).data


def listing(paths) -> str:
    return "[" + ",".join(str(p) for p in paths) + "]"


def test_mixture_prepares_each_source_as_its_own_option(tmp_path, gpt2, two_corpora):
    alpha, beta = two_corpora
    data = mixture_cfg(
        tmp_path, f"[{{source:text,paths:{listing(alpha)},weight:3}},{{source:text,paths:{listing(beta)},weight:1}}]"
    )
    (alpha_dir, alpha_weight), (beta_dir, beta_weight) = prepare_sources(data, gpt2)
    assert (alpha_weight, beta_weight) == (3.0, 1.0)
    assert decoded(gpt2, alpha_dir).startswith("alpha0 alpha1") and "beta" not in decoded(gpt2, alpha_dir)
    # the same cache as data=text on those files, with the mixture's shared keys
    assert prepare(data_cfg(tmp_path, alpha, "text", "data.val_fraction=0.1"), gpt2) == alpha_dir

    layout = Layout(global_batch=8, micro_batch=4, dp_rank=0, dp_size=1)
    lm = LMData([(alpha_dir, 3.0), (beta_dir, 1.0)], 16, "gpt2", gpt2, layout, SEED, eval_batches=4)
    texts = [gpt2.decode(row) for step in range(100) for batch in lm.train_step(step * 8) for row in batch["input_ids"]]
    from_alpha = sum("alpha" in t for t in texts) / len(texts)
    assert all(("alpha" in t) != ("beta" in t) for t in texts) and abs(from_alpha - 0.75) < 0.05
    evals = [gpt2.decode(row) for batch in lm.eval_batches() for row in batch["input_ids"]]
    assert len(evals) == 16 and sum("alpha" in t for t in evals) == 12


def test_a_one_source_mixture_is_that_source(tmp_path, gpt2, two_corpora):
    alpha, _ = two_corpora
    [(token_dir, _)] = prepare_sources(
        mixture_cfg(tmp_path, f"[{{source:text,paths:{listing(alpha)},weight:2}}]"), gpt2
    )
    layout = Layout(global_batch=4, micro_batch=4, dp_rank=0, dp_size=1)
    plain, mixed = (LMData(sources, 16, "gpt2", gpt2, layout, SEED, 2) for sources in (token_dir, [(token_dir, 2.0)]))
    assert torch.equal(plain.train_step(8)[0]["input_ids"], mixed.train_step(8)[0]["input_ids"])


@pytest.mark.parametrize(
    "sources, message",
    [
        ("[]", r"data.sources must list at least one source"),
        ("[{source:shakespeare,weight:0}]", r"data.sources\[0\].weight=0 must be a number > 0"),
        (
            "[{source:shakespeare,weight:1},{source:shakespeare,weight:-2}]",
            r"data.sources\[1\].weight=-2 must be a number > 0",
        ),
        (
            "[{source:shakespeare,weight:abc}]",
            r"data.sources=.*: weight: Value 'abc' of type 'str' could not be converted",
        ),
        ("[{source:shakespeare}]", r"data.sources\[0\].weight must be set"),
        (
            "[{source:shakespeare,weight:1},{source:wiki,weight:1}]",
            r"data.sources=.*: source: Invalid value 'wiki', expected one of \[shakespeare, text, json, hf",
        ),
        ("[{source:mixture,weight:1}]", r"data.sources\[0\].source=mixture: a mixture entry is one source"),
        ("[{source:text,weight:1}]", r"data.sources\[0\].paths must be set for a text source"),
        ("[{source:hf,weight:1}]", r"data.sources\[0\].name must be set for a hf source"),
        (
            "[{source:shakespeare,weight:1,block_size:64}]",
            r"block_size is not a key of a mixture source: set data.block_size",
        ),
        (
            "[{source:text,paths:[a.txt],text_field:body,weight:1}]",
            r"data.sources\[0\].text_field is not a key of a text source",
        ),
        (
            "[shakespeare]",
            r"data.sources=\[shakespeare\]: data.sources\[0\]: "
            r"Invalid type assigned: str is not a subclass of SourceConfig",
        ),
        (
            "[{source:shakespeare,weight:1},{source:shakespeare,weight:1e-5}]",
            r"data.sources\[1\].weight=1e-05 is below 1/16384",
        ),
        (
            "[{source:shakespeare,weight:1},{source:text,paths:[/nonexistent/*.txt],weight:1}]",
            r"data.sources\[1\] \(text\): data.paths: /nonexistent/\*.txt matches no file",
        ),
    ],
)
def test_mixture_config_errors_name_the_key(tmp_path, gpt2, sources, message):
    with pytest.raises(ConfigError, match=message):
        prepare_sources(mixture_cfg(tmp_path, sources), gpt2)
    assert token_dirs(tmp_path / "cache") == []


def test_mixture_with_a_source_too_small_for_a_block(tmp_path, gpt2, two_corpora):
    alpha, _ = two_corpora
    tiny = write_corpus(tmp_path / "tiny", ["just a few words"])
    data = mixture_cfg(
        tmp_path, f"[{{source:text,paths:{listing(alpha)},weight:1}},{{source:text,paths:{listing(tiny)},weight:1}}]"
    )
    with pytest.raises(ConfigError, match=r"data.sources\[1\] \(text-\w+\) has 0 training and 0 held-out blocks"):
        LMData(prepare_sources(data, gpt2), 16, "gpt2", gpt2, Layout(4, 4, 0, 1), SEED, 2)


# --- scripts -----------------------------------------------------------------------------------


def run_script(name: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / name), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_prepare_data_script(tmp_path, two_corpora):
    alpha, beta = two_corpora
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    first = run_script("prepare_data.py", "data=text", f"data.paths={listing(alpha)}", cache)
    assert first.returncode == 0, first.stderr[-2000:]
    [alpha_dir] = token_dirs(tmp_path / "cache")
    assert first.stdout.splitlines()[0] == str(alpha_dir)
    assert "text: 4 documents" in first.stdout and "uint16" in first.stdout and first.stdout.rstrip().endswith("built")

    # a mixture that shares the first source: that one is reused, the other built
    mixed = run_script(
        "prepare_data.py",
        "data=mixture",
        cache,
        f"data.sources=[{{source:text,paths:{listing(alpha)},weight:0.7}},"
        f"{{source:text,paths:{listing(beta)},weight:0.3}}]",
    )
    assert mixed.returncode == 0, mixed.stderr[-2000:]
    lines = mixed.stdout.splitlines()
    assert lines[0] == str(alpha_dir) and "weight 0.7" in lines[1] and lines[1].endswith("reused from the cache")
    assert "weight 0.3" in lines[3] and lines[3].endswith("built") and len(token_dirs(tmp_path / "cache")) == 2

    bad = run_script("prepare_data.py", "data=text", f"data.paths=[{tmp_path}/missing-*.txt]", cache)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [f"lmrepo: error: data.paths: {tmp_path}/missing-*.txt matches no file"]
