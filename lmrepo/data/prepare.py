"""Tokenize a corpus once into memory-mappable token files, reused while corpus and tokenizer are unchanged.

Layout: <cache_dir>/<source>-<fingerprint>/{train.bin, val.bin, meta.json}. Documents are
joined with the tokenizer's end-of-text (GPT-2) or [SEP] (BERT) token; the last
`val_fraction` of the stream is held out. Files are written under a temporary name and
renamed, so an interrupted preparation leaves nothing that looks complete.
"""
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
from filelock import FileLock

from lmrepo.data.corpus import load_documents, source_files
from lmrepo.errors import ConfigError

FORMAT_VERSION = 1


def separator_id(tokenizer) -> int:
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if sep is None:
        raise ConfigError(f"tokenizer {tokenizer.name_or_path} has neither an EOS nor a SEP token: choose another model.tokenizer")
    return sep


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def tokenizer_identity(tokenizer) -> str:
    """Changes whenever the token ids would: vocabulary, merges, normalization."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def file_digest(path: str) -> str:
    """Content hash (blake2b runs at about 1 GB/s): a copy that keeps mtimes still invalidates."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()[:32]


def fingerprint(data, tokenizer) -> str:
    files = [(f, file_digest(f)) for f in source_files(data)]
    spec = {"format": FORMAT_VERSION, "source": data.source, "files": files,
            "hub": [data.get("name"), data.get("config"), data.get("split")],
            "text_field": data.get("text_field"), "val_fraction": data.val_fraction,
            "tokenizer": tokenizer_identity(tokenizer)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def prepare(data, tokenizer) -> Path:
    """Returns the directory holding train.bin, val.bin and meta.json, building it if needed.
    Safe to call from every rank at once: one builds, the others wait on the lock and reuse it."""
    out = Path(data.cache_dir).expanduser() / f"{data.source}-{fingerprint(data, tokenizer)}"
    if (out / "meta.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "meta.json").exists():
            build(data, tokenizer, out)
    return out


def build(data, tokenizer, out: Path) -> None:
    docs = load_documents(data)
    sep = separator_id(tokenizer)
    vocab = len(tokenizer)
    dtype = token_dtype(vocab)

    def encode(batch):
        ids = [doc + [sep] for doc in tokenizer(batch["text"], add_special_tokens=False)["input_ids"] if doc]
        return {"ids": ids, "n": [len(doc) for doc in ids]}

    # Batched map over documents; each worker process runs the fast (Rust) tokenizer.
    tokens = docs.map(encode, batched=True, batch_size=64, remove_columns=docs.column_names,
                      num_proc=min(data.num_proc, len(docs)) if len(docs) > 1 else None, desc="tokenizing")
    total = int(np.sum(tokens["n"], dtype=np.int64)) if len(tokens) else 0
    if total == 0:
        raise ConfigError(f"data={data.source}: the corpus has no text: check data.paths")
    n_val = max(1, int(total * data.val_fraction))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_stream(tokens, tmp, dtype, total - n_val, n_val)
    meta = {"format": FORMAT_VERSION, "tokenizer": tokenizer.name_or_path or type(tokenizer).__name__, "tokenizer_id": tokenizer_identity(tokenizer),
            "vocab_size": vocab, "dtype": np.dtype(dtype).name, "separator_id": sep, "documents": len(tokens),
            "train_tokens": total - n_val, "val_tokens": n_val, "source": data.source}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def write_stream(tokens, directory: Path, dtype, n_train: int, n_val: int) -> None:
    """Streams the tokenized documents into train.bin then val.bin: memory stays flat in corpus size."""
    train = np.memmap(directory / "train.bin", dtype=dtype, mode="w+", shape=(n_train,))
    val = np.memmap(directory / "val.bin", dtype=dtype, mode="w+", shape=(n_val,))
    offset = 0
    for batch in tokens.iter(batch_size=256):
        chunk = np.concatenate([np.asarray(doc, dtype=dtype) for doc in batch["ids"]])
        end = offset + len(chunk)
        if offset < n_train:
            train[offset:min(end, n_train)] = chunk[:n_train - offset]
        if end > n_train:
            start = max(offset, n_train)
            val[start - n_train:end - n_train] = chunk[start - offset:]
        offset = end
    train.flush()
    val.flush()


def load_meta(directory: Path) -> dict:
    return json.loads((directory / "meta.json").read_text())


def open_tokens(directory: Path, split: str) -> np.ndarray:
    meta = load_meta(directory)
    return np.memmap(directory / f"{split}.bin", dtype=meta["dtype"], mode="r")
