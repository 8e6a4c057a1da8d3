"""Tokenize a corpus once into memory-mappable token files, reused while corpus and tokenizer are unchanged.

Layout: <cache_dir>/<source>-<fingerprint>/{train.bin, val.bin, meta.json}. Documents are
joined with the tokenizer's end-of-text (GPT-2) or [SEP] (BERT) token; the last
`val_fraction` of the stream is held out. Files are written under a temporary name and
renamed, so an interrupted preparation leaves nothing that looks complete.

A mixture (`data=mixture`) is a list of sources, each prepared and cached on its own exactly as
that data option would be (so a source shared by a plain run and a mixture is tokenized once);
training draws from them by weight (batches.MixtureOrder).
"""
import hashlib
import json
import math
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from filelock import FileLock
from omegaconf import DictConfig, ListConfig, OmegaConf

from lmrepo.data.batches import MIXTURE_PERIOD
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


def id_bound(tokenizer) -> int:
    """One past the largest id the tokenizer can produce: its length, unless its ids have gaps."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def tokenizer_identity(tokenizer) -> str:
    """Changes whenever the token ids would: vocabulary, merges, normalization."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def file_digest(path: str) -> str:
    """Content hash (blake2b runs at about 1 GB/s): a copy that keeps mtimes still invalidates."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()[:32]


def fingerprint(data, tokenizer) -> str:
    """Covers exactly what decides the tokens, so the same source reached through another
    option (a plain run, a mixture) maps to the same files."""
    files = [(f, file_digest(f)) for f in source_files(data)]
    spec = {"format": FORMAT_VERSION, "source": data.source, "files": files, "val_fraction": data.val_fraction,
            "tokenizer": tokenizer_identity(tokenizer)}
    if data.source in ("json", "hf"):
        spec["text_field"] = data.text_field
    if data.source == "hf":
        spec["hub"] = [data.name, data.config, data.split]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def token_dir(data, tokenizer) -> Path:
    """Where prepare() keeps (or will build) the token files of one source."""
    return Path(data.cache_dir).expanduser() / f"{data.source}-{fingerprint(data, tokenizer)}"


def prepare(data, tokenizer) -> Path:
    """Returns the directory holding train.bin, val.bin and meta.json, building it if needed.
    Safe to call from every rank at once: one builds, the others wait on the lock and reuse it."""
    out = token_dir(data, tokenizer)
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
    dtype = token_dtype(id_bound(tokenizer))

    def encode(batch):
        ids = [doc + [sep] for doc in tokenizer(batch["text"], add_special_tokens=False)["input_ids"] if doc]
        return {"ids": ids, "n": [len(doc) for doc in ids]}

    # Batched map over documents; each worker process runs the fast (Rust) tokenizer. A batch's
    # token lists are what a worker holds at once: a few documents keep memory flat in corpus size.
    tokens = docs.map(encode, batched=True, batch_size=16, remove_columns=docs.column_names,
                      num_proc=min(data.num_proc, len(docs)) if len(docs) > 1 else None, desc="tokenizing")
    total = int(np.sum(tokens["n"], dtype=np.int64)) if len(tokens) else 0
    if total == 0:
        raise ConfigError(f"data={data.source}: the corpus has no text: check data.paths")
    n_val = max(1, int(total * data.val_fraction))
    name = tokenizer.name_or_path or type(tokenizer).__name__
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_stream(tokens, tmp, dtype, total - n_val, n_val, name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta = {"format": FORMAT_VERSION, "tokenizer": name, "tokenizer_id": tokenizer_identity(tokenizer),
            "vocab_size": vocab, "dtype": np.dtype(dtype).name, "separator_id": sep, "documents": len(tokens),
            "train_tokens": total - n_val, "val_tokens": n_val, "source": data.source}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def write_stream(tokens, directory: Path, dtype, n_train: int, n_val: int, tokenizer_name: str) -> None:
    """Streams the tokenized documents into train.bin then val.bin: memory stays flat in corpus
    size (a few documents at a time, as Arrow arrays, never as Python lists)."""
    train = np.memmap(directory / "train.bin", dtype=dtype, mode="w+", shape=(n_train,))
    val = np.memmap(directory / "val.bin", dtype=dtype, mode="w+", shape=(n_val,))
    limit = np.iinfo(dtype).max
    offset = 0
    for table in tokens.with_format("arrow").iter(batch_size=16):
        ids = pc.list_flatten(table.column("ids")).to_numpy()
        if len(ids) and ids.max() > limit:
            raise ConfigError(f"tokenizer {tokenizer_name} produced token id {ids.max()}, which does not fit the "
                              f"{np.dtype(dtype).name} token file: its vocabulary is larger than it reports; use another model.tokenizer")
        chunk = ids.astype(dtype)
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


# --- mixtures ---------------------------------------------------------------------------------

# The keys each source of a mixture may set, with the defaults of conf/data/<source>.yaml; the
# mixture's own block_size, val_fraction, num_proc and cache_dir apply to every source.
SOURCE_KEYS = {"shakespeare": {}, "text": {"paths": None}, "json": {"paths": None, "text_field": "text"},
               "hf": {"name": None, "config": None, "split": "train", "text_field": "text"}}
REQUIRED = {"text": "paths", "json": "paths", "hf": "name"}
SHARED_KEYS = ("block_size", "val_fraction", "num_proc", "cache_dir")
EXAMPLE = "data.sources=[{source:shakespeare,weight:0.7},{source:text,paths:[a.txt],weight:0.3}]"


def mixture_sources(data) -> list[tuple[DictConfig, float]]:
    """(data config, weight) of each entry of a mixture's data.sources, the entry made a data
    option of its own. Raises ConfigError naming the entry's key."""
    entries = data.get("sources")
    if not isinstance(entries, ListConfig) or len(entries) == 0:
        raise ConfigError(f"data.sources must list at least one source with a weight, e.g. {EXAMPLE}")
    out = []
    for k, entry in enumerate(entries):
        key = f"data.sources[{k}]"
        if not isinstance(entry, DictConfig):
            raise ConfigError(f"{key}={entry} must be a mapping like {{source: text, paths: [a.txt], weight: 0.3}}")
        source = entry.get("source")
        if source not in SOURCE_KEYS:
            raise ConfigError(f"{key}.source={source} must be one of {', '.join(SOURCE_KEYS)}")
        for name in entry:
            if name in SHARED_KEYS:
                raise ConfigError(f"{key}.{name}: {name} is shared by all sources of a mixture: set data.{name} instead")
            if name not in ("source", "weight", *SOURCE_KEYS[source]):
                raise ConfigError(f"{key}.{name} is not a key of a {source} source (it takes: "
                                  f"{', '.join(['weight', *SOURCE_KEYS[source]])})")
        weight = entry.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"{key}.weight={weight} must be a number > 0")
        if source in REQUIRED and entry.get(REQUIRED[source]) is None:
            raise ConfigError(f"{key}.{REQUIRED[source]} must be set for a {source} source")
        fields = {**SOURCE_KEYS[source], **OmegaConf.to_container(entry, resolve=True), **{s: data[s] for s in SHARED_KEYS}}
        del fields["weight"]
        out.append((OmegaConf.create(fields), float(weight)))
    total = sum(w for _, w in out)
    for k, (_, weight) in enumerate(out):
        if weight / total * MIXTURE_PERIOD < 1:
            raise ConfigError(f"data.sources[{k}].weight={weight} is below 1/{MIXTURE_PERIOD} of the total weight: "
                              "raise it or leave the source out")
    return out


def prepare_sources(data, tokenizer) -> list[tuple[Path, float]]:
    """prepare() for every source: [(token directory, weight), ...] (one entry unless a mixture)."""
    if data.source != "mixture":
        return [(prepare(data, tokenizer), 1.0)]
    entries = mixture_sources(data)
    for k, (source, _) in enumerate(entries):
        with named_source(k, source):
            source_files(source)  # a mistyped path stops the job before any source is tokenized
    prepared = []
    for k, (source, weight) in enumerate(entries):
        with named_source(k, source):
            prepared.append((prepare(source, tokenizer), weight))
    return prepared


@contextmanager
def named_source(k: int, source):
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"data.sources[{k}] ({source.source}): {err}") from None
