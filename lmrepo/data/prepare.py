"""Tokenize a corpus once into memory-mappable token files, reused while corpus and tokenizer are unchanged.

Layout: <cache_dir>/<source>-<fingerprint>/{train.bin, val.bin, train.docs.npy, val.docs.npy,
meta.json}. Documents are joined with the tokenizer's end-of-text (GPT-2) or [SEP] (BERT) token;
the last `val_fraction` of the stream is held out. `<split>.docs.npy` holds the offset of every
document start within its split (after 0), as the tokenizer saw the documents: the separator
token is not trusted to mark them, since a document's own text may contain it. Files are
written under a temporary name and renamed, so an interrupted preparation leaves nothing that looks complete.

A mixture (`data=mixture`) is a list of sources, each prepared and cached on its own exactly as
that data option would be (so a source shared by a plain run and a mixture is tokenized once);
training draws from them by weight (batches.MixtureOrder).
"""

import hashlib
import itertools
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from filelock import FileLock
from tokenizers import Tokenizer

from lmrepo.data.corpus import load_documents, source_files
from lmrepo.utils.errors import ConfigError, disk_error

# 2: adds <split>.docs.npy (document starts). The version is part of the fingerprint, so a
# directory written by an earlier version (without them) is never read as if it had them.
FORMAT_VERSION = 2


def separator_id(tokenizer) -> int:
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if sep is None:
        raise ConfigError(
            f"tokenizer {tokenizer.name_or_path} has neither an EOS nor a SEP token: choose another model.tokenizer"
        )
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
    spec = {
        "format": FORMAT_VERSION,
        "source": data.source,
        "files": files,
        "val_fraction": data.val_fraction,
        "tokenizer": tokenizer_identity(tokenizer),
    }
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
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not (out / "meta.json").exists():
                build(data, tokenizer, out)
    except Exception as err:
        if (reason := disk_error(err)) is None:
            raise
        raise ConfigError(
            f"data.cache_dir={data.cache_dir}: {reason}: point data.cache_dir at a writable "
            "directory with room for the token files"
        ) from None
    return out


# Text per tokenizer call: enough that the call's fixed cost vanishes, little enough that a
# worker's encodings stay small (the Rust encodings take ~80 bytes per token, ~4 characters).
BATCH_CHARS = 1 << 20


def build(data, tokenizer, out: Path) -> None:
    """Tokenizes into <out>.tmp, renamed to <out> when complete. The documents and their token
    ids pass through Arrow files on disk (<out>.tmp/work, deleted at the end), a batch at a
    time: memory does not grow with the corpus."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        meta = tokenize(data, tokenizer, tmp, out.name)
        shutil.rmtree(tmp / "work")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def tokenize(data, tokenizer, directory: Path, name: str) -> dict:
    """Writes train.bin, val.bin and their document starts into `directory`; returns their metadata. `name` (the token
    directory's, which carries the fingerprint) spares datasets from hashing the tokenizer."""
    import pyarrow.compute as pc

    work = directory / "work"
    docs = load_documents(data, work)
    sep = separator_id(tokenizer)
    dtype = token_dtype(id_bound(tokenizer))
    # Each worker process runs the Rust tokenizer itself on whole batches of documents and returns a
    # batch as one array of ids (EOS-joined): no per-token Python work beyond reading its id lists.
    backend = tokenizer.backend_tokenizer
    if backend.padding or backend.truncation:  # left by an earlier call: not for this one (nor changed for it)
        backend = Tokenizer.from_str(backend.to_str())
        backend.no_padding()
        backend.no_truncation()
    tokens = docs.map(
        encode,
        batched=True,
        batch_size=batch_rows(docs),
        fn_kwargs={"backend": backend, "sep": sep},
        remove_columns=docs.column_names,
        features=encoded_features(),
        writer_batch_size=1,
        num_proc=min(data.num_proc, len(docs)) if len(docs) > 1 else None,
        cache_file_name=str(work / "tokens.arrow"),
        new_fingerprint=name,
        desc="tokenizing",
    )
    total = pc.sum(pc.list_value_length(tokens.data.column("ids"))).as_py() or 0
    if total == 0:
        raise ConfigError(f"data={data.source}: the corpus has no text: check data.paths")
    n_val = max(1, int(total * data.val_fraction))
    tokenizer_name = tokenizer.name_or_path or type(tokenizer).__name__
    write_stream(tokens, directory, dtype, total - n_val, n_val, tokenizer_name)
    return {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer_name,
        "tokenizer_id": tokenizer_identity(tokenizer),
        "vocab_size": len(tokenizer),
        "dtype": np.dtype(dtype).name,
        "separator_id": sep,
        "documents": pc.sum(tokens.data.column("documents")).as_py(),
        "train_tokens": total - n_val,
        "val_tokens": n_val,
        "source": data.source,
    }


def encoded_features():
    """One row per batch: its ids, how many documents they hold (an empty document adds no EOS), and
    the offset just past each of those documents' EOS within the batch's ids.
    uint32 here; write_stream checks each id against the token file's dtype. (datasets and pyarrow
    are imported only to tokenize: a run whose tokens are cached starts half a second sooner.)"""
    import datasets

    return datasets.Features(
        {
            "ids": datasets.List(datasets.Value("uint32")),
            "documents": datasets.Value("int64"),
            "ends": datasets.List(datasets.Value("int64")),
        }
    )


def encode(batch: dict, backend: Tokenizer, sep: int) -> dict:
    texts = batch["text"]
    # text files arrive in pieces (corpus.read_pieces): EOS after a document's last piece only
    starts, ends = batch.get("start", [True] * len(texts)), batch.get("end", [True] * len(texts))
    # encode_batch_fast: the ids without character offsets, which we would throw away
    encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    pieces, document_ends, count = [], [], 0
    for encoding, start, end in zip(encodings, starts, ends):
        piece = encoding.ids
        pieces.append(piece)
        count += len(piece)
        if end and (piece or not start):
            pieces.append([sep])
            count += 1
            document_ends.append(count)
    return {
        "ids": [np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.uint32, count=count)],
        "documents": [len(document_ends)],
        "ends": [document_ends],
    }


def batch_rows(docs) -> int:
    """Rows per tokenizer call for about BATCH_CHARS of text, from the mean row size (the text
    column's offsets: nothing is read)."""
    import pyarrow.compute as pc

    size = pc.sum(pc.binary_length(docs.data.column("text"))).as_py() or 0
    return int(np.clip(BATCH_CHARS * len(docs) // max(size, 1), 1, 1000))


def write_stream(tokens, directory: Path, dtype, n_train: int, n_val: int, tokenizer_name: str) -> None:
    """Streams the tokenized batches into train.bin then val.bin, one batch (an Arrow array
    memory-mapped from disk) at a time, and the document starts of each split into <split>.docs.npy."""
    import pyarrow.compute as pc

    train = np.memmap(directory / "train.bin", dtype=dtype, mode="w+", shape=(n_train,))
    val = np.memmap(directory / "val.bin", dtype=dtype, mode="w+", shape=(n_val,))
    limit = np.iinfo(dtype).max
    offset, starts = 0, [np.empty(0, dtype=np.int64)]
    for table in tokens.with_format("arrow").iter(batch_size=1):
        ids = pc.list_flatten(table.column("ids")).to_numpy()
        starts.append(offset + pc.list_flatten(table.column("ends")).to_numpy().astype(np.int64))
        if len(ids) and ids.max() > limit:
            raise ConfigError(
                f"tokenizer {tokenizer_name} produced token id {ids.max()}, which does not fit the "
                f"{np.dtype(dtype).name} token file: its vocabulary is larger than it reports; use another "
                "model.tokenizer"
            )
        chunk = ids.astype(dtype)
        end = offset + len(chunk)
        if offset < n_train:
            train[offset : min(end, n_train)] = chunk[: n_train - offset]
        if end > n_train:
            start = max(offset, n_train)
            val[start - n_train : end - n_train] = chunk[start - offset :]
        offset = end
    train.flush()
    val.flush()
    starts = np.concatenate(starts)
    # Starts strictly inside a split: 0 starts every split, and the stream's end starts nothing.
    np.save(directory / "train.docs.npy", starts[(starts > 0) & (starts < n_train)])
    np.save(directory / "val.docs.npy", starts[(starts > n_train) & (starts < n_train + n_val)] - n_train)


def load_meta(directory: Path) -> dict:
    return json.loads((directory / "meta.json").read_text())


def open_tokens(directory: Path, split: str) -> np.ndarray:
    meta = load_meta(directory)
    return np.memmap(directory / f"{split}.bin", dtype=meta["dtype"], mode="r")


def open_document_starts(directory: Path, split: str) -> np.ndarray:
    """The sorted token offsets at which a document starts within the split (0 left implicit)."""
    path = directory / f"{split}.docs.npy"
    if load_meta(directory)["format"] < 2 or not path.exists():
        raise ConfigError(
            f"{directory} holds tokens without document boundaries (an older lmrepo wrote it): delete it "
            "so that it is prepared again, or set data.cross_document_attention=true"
        )
    return np.load(path, mmap_mode="r")


def prepare_sources(data, tokenizer) -> list[tuple[Path, float]]:
    """prepare() for every source: [(token directory, weight), ...] (one entry unless a mixture)."""
    if data.source != "mixture":
        return [(prepare(data, tokenizer), 1.0)]
    entries = data.mixture_sources()
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
