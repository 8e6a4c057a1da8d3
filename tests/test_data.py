"""Tokenizers, token-file preparation, the step order of blocks, and BERT masking, in process."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import compose_config
from lmrepo.data.batches import SampleOrder
from lmrepo.data.loader import MaskedInputs
from lmrepo.data.prepare import open_tokens, prepare
from lmrepo.errors import ConfigError
from lmrepo.tokenizer import load_tokenizer

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
    return compose_config([f"data={source}", f"data.paths=[{listed}]", f"data.cache_dir={tmp_path / 'cache'}", *extra]).data


def token_dirs(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.is_dir()] if cache.exists() else []


def decoded(tokenizer, token_dir: Path) -> str:
    ids = np.concatenate([open_tokens(token_dir, "train"), open_tokens(token_dir, "val")])
    return tokenizer.decode(ids.tolist())


# --- tokenizers ------------------------------------------------------------------------------

def test_gpt2_tokenizer(gpt2):
    assert len(gpt2) == 50257
    assert gpt2("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]


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


def test_json_round_trip(tmp_path, gpt2):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"body": "one"}\n{"body": "two"}\n')
    token_dir = prepare(data_cfg(tmp_path, [path], "json", "data.text_field=body", "data.num_proc=1"), gpt2)
    assert decoded(gpt2, token_dir) == "one<|endoftext|>two<|endoftext|>"


# --- SampleOrder -----------------------------------------------------------------------------

N_BLOCKS, SEED = 103, 1234


def step_set(step: int, micro: int, dp: int, global_batch: int = 8, seed: int = SEED) -> list[int]:
    """All ranks' block indices of one optimizer step, in rank then micro-batch order."""
    return [int(i) for rank in range(dp)
            for batch in SampleOrder(N_BLOCKS, global_batch, micro, rank, dp, seed).micro_batches(step * global_batch)
            for i in batch]


@pytest.mark.parametrize("dp, micro", [(2, 2), (3, 2), (3, 4)])
def test_ranks_split_the_global_batch(dp, micro):
    global_batch = 12
    ranks = [{int(i) for b in SampleOrder(N_BLOCKS, global_batch, micro, r, dp, SEED).micro_batches(60) for i in b}
             for r in range(dp)]
    assert sum(len(r) for r in ranks) == len(set().union(*ranks)) == global_batch
    assert set().union(*ranks) == set(step_set(5, global_batch, 1, global_batch))


def test_each_epoch_covers_every_block_once():
    order = SampleOrder(N_BLOCKS, 8, 2, 0, 1, SEED)
    for epoch in range(3):
        assert sorted(order.stream(epoch * N_BLOCKS, N_BLOCKS)) == list(range(N_BLOCKS))
    # Steps straddle epoch boundaries instead of dropping the remainder of an epoch.
    seen = [i for step in range(N_BLOCKS // 8) for i in step_set(step, 2, 2)]
    assert len(seen) == len(set(seen)) == (N_BLOCKS // 8) * 8


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
