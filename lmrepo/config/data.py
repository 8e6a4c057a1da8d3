"""`data`: which corpus is tokenized, and how it is cut into training samples."""

import math
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import List, Optional

from omegaconf import MISSING

from lmrepo.utils.errors import require

# Stream positions per mixture pattern (data.batches.MixtureOrder): each source's share is exact
# within every period (to 1/MIXTURE_PERIOD), so a source needs at least one sample per period.
MIXTURE_PERIOD = 2**14
MIXTURE_EXAMPLE = "data.sources=[{source:shakespeare,weight:0.7},{source:text,paths:[a.txt],weight:0.3}]"


class Source(StrEnum):
    shakespeare = "shakespeare"
    text = "text"
    json = "json"
    hf = "hf"
    mixture = "mixture"


# The keys each kind of source reads besides `source` (a mixture entry may set only these).
SOURCE_KEYS = {
    Source.shakespeare: (),
    Source.text: ("paths",),
    Source.json: ("paths", "text_field"),
    Source.hf: ("name", "config", "split", "text_field"),
}
REQUIRED = {Source.text: "paths", Source.json: "paths", Source.hf: "name"}


@dataclass
class SourceConfig:
    """One entry of a mixture: a data option's own keys plus its weight."""

    source: Source = MISSING
    """shakespeare | text | json | hf"""
    weight: float = MISSING
    """relative share of the training samples and eval batches (> 0)"""
    paths: Optional[List[str]] = None
    """text, json: files or glob patterns"""
    text_field: str = "text"
    """json, hf: the field holding each document's text"""
    name: Optional[str] = None
    """hf: the hub dataset"""
    config: Optional[str] = None
    """hf: the dataset's configuration"""
    split: str = "train"
    """hf: the split read"""


@dataclass
class DataConfig:
    source: Source = Source.shakespeare
    """shakespeare (offline plays), text, json (local files), hf (hub dataset), mixture (weighted sources)"""
    paths: Optional[List[str]] = None
    """text, json: files or glob patterns, e.g. [a.txt,'corpus/*.txt']"""
    text_field: str = "text"
    """json, hf: the field holding each document's text"""
    name: Optional[str] = None
    """hf: the hub dataset, e.g. Salesforce/wikitext"""
    config: Optional[str] = None
    """hf: the dataset's configuration, e.g. wikitext-103-raw-v1"""
    split: str = "train"
    """hf: the split read"""
    sources: Optional[List[SourceConfig]] = None
    """mixture: the weighted sources, e.g. [{source:shakespeare,weight:0.7},{source:text,paths:[a.txt],weight:0.3}]"""
    block_size: int = 128
    """tokens per training sample; at most the model's positions"""
    val_fraction: float = 0.05
    """tail of each source's token stream held out for eval_loss"""
    num_proc: int = 2
    """tokenizer processes (datasets.map)"""
    cache_dir: str = "${oc.env:LMREPO_CACHE,${oc.env:HOME}/.cache/lmrepo}"
    """where token files are kept and reused"""
    cross_document_attention: bool = True
    """false: each token attends only within its own document, position ids restart at each document
    and a document's first token is not predicted from the previous one (GPT-2, Llama; docs/data.md)"""

    def check(self) -> None:
        require(self.block_size >= 8, f"data.block_size={self.block_size} must be >= 8")
        require(0 < self.val_fraction < 0.5, f"data.val_fraction={self.val_fraction} must be in (0, 0.5)")
        require(self.num_proc >= 1, f"data.num_proc={self.num_proc} must be >= 1")
        if self.source == Source.mixture:
            self.mixture_sources()
        elif self.source in REQUIRED:
            key = REQUIRED[self.source]
            require(getattr(self, key) is not None, f"data.{key} must be set for data={self.source}")

    def mixture_sources(self) -> list[tuple["DataConfig", float]]:
        """(data config, weight) of each mixture entry, the entry made a data option of its own
        that shares this one's block_size, val_fraction, num_proc and cache_dir."""
        require(bool(self.sources), f"data.sources must list at least one source with a weight, e.g. {MIXTURE_EXAMPLE}")
        out = []
        for k, entry in enumerate(self.sources):
            key = f"data.sources[{k}]"
            require(entry.source != Source.mixture, f"{key}.source=mixture: a mixture entry is one source")
            allowed = SOURCE_KEYS[entry.source]
            for f in fields(SourceConfig):
                if f.name not in ("source", "weight", *allowed):
                    require(
                        getattr(entry, f.name) == f.default,
                        f"{key}.{f.name} is not a key of a {entry.source} source "
                        f"(it takes: {', '.join(['weight', *allowed])})",
                    )
            require(
                math.isfinite(entry.weight) and entry.weight > 0, f"{key}.weight={entry.weight:g} must be a number > 0"
            )
            if entry.source in REQUIRED:
                require(
                    getattr(entry, REQUIRED[entry.source]) is not None,
                    f"{key}.{REQUIRED[entry.source]} must be set for a {entry.source} source",
                )
            own = {name: getattr(entry, name) for name in allowed}
            out.append((replace(self, source=entry.source, sources=None, **own), entry.weight))
        total = sum(w for _, w in out)
        for k, (_, weight) in enumerate(out):
            require(
                weight / total * MIXTURE_PERIOD >= 1,
                f"data.sources[{k}].weight={weight:g} is below 1/{MIXTURE_PERIOD} "
                "of the total weight: raise it or leave the source out",
            )
        return out
