"""Tokenize a data option into its cached token files ahead of training (train.py does the same on first use).

    python scripts/prepare_data.py                                   # data=shakespeare with GPT-2's tokenizer
    python scripts/prepare_data.py data=text 'data.paths=[corpus/*.txt]'
    python scripts/prepare_data.py data=json data.paths=[docs.jsonl] data.text_field=body model=bert-base
    python scripts/prepare_data.py data=mixture \
        'data.sources=[{source:shakespeare,weight:0.7},{source:text,paths:[a.txt],weight:0.3}]'

Arguments are train.py's Hydra overrides; the tokenizer is the one `model=` (model.tokenizer,
model.pretrained) would train with. Prints each source's directory and what it holds, and
whether it was reused from the cache. A bad argument or corpus: one line on stderr, exit 2.
"""

import sys
import time
from pathlib import Path

from lmrepo.data.prepare import load_meta, prepare_sources
from lmrepo.data.tokenizer import load_tokenizer
from lmrepo.plan.compose import load_config
from lmrepo.utils.errors import ConfigError, exit_error


def describe(directory: Path, reused: bool, weight: float | None) -> str:
    meta = load_meta(directory)
    share = f", weight {weight:g}" if weight is not None else ""
    return (
        f"{directory}\n  {meta['source']}{share}: {meta['documents']:,} documents, {meta['train_tokens']:,} train + "
        f"{meta['val_tokens']:,} val tokens, {meta['dtype']}, tokenizer {meta['tokenizer']} "
        f"({meta['vocab_size']:,} tokens), {'reused from the cache' if reused else 'built'}"
    )


def main(argv: list[str]) -> None:
    try:
        config = load_config(argv)
        try:
            tokenizer = load_tokenizer(config.model.tokenizer, config.model.pretrained)
        except OSError as err:
            raise ConfigError(f"model.tokenizer={config.model.tokenizer}: {str(err).splitlines()[0][:200]}") from None
        started = time.time()
        prepared = prepare_sources(config.data, tokenizer)
    except ConfigError as err:
        exit_error(str(err))
    for directory, weight in prepared:
        # A directory prepare() built now has a meta.json written after we started.
        reused = (directory / "meta.json").stat().st_mtime < started
        print(describe(directory, reused, weight if config.data.source == "mixture" else None))


if __name__ == "__main__":
    main(sys.argv[1:])
