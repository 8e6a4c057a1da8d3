"""Model inputs from blocks: causal-LM pairs for GPT-2 and Llama (optionally one attention span
per document), dynamically masked MLM batches for BERT."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import DataCollatorForLanguageModeling

from lmrepo.data.batches import MixtureBlocks, MixtureOrder, SampleOrder, TokenBlocks, eval_indices
from lmrepo.data.prepare import open_document_starts, open_tokens
from lmrepo.utils.errors import ConfigError


class CausalInputs:
    def __call__(self, blocks: torch.Tensor, seeds: list[int]) -> dict:
        # transformers shifts the labels inside the model's loss.
        return {"input_ids": blocks, "labels": blocks}


def separate_documents(batch: dict, starts: list[np.ndarray]) -> dict:
    """A causal batch whose documents do not see each other (data.cross_document_attention=false).

    Position ids restart at 0 at every document start (and at the block's first token, which
    begins a document as far as the model can know). transformers reads restarting `position_ids`
    with no attention mask and no cache (build_model sets use_cache=False) as packed sequences and
    gives each its own causal span, for every attention implementation. The first token of each
    document gets label -100: the model, shifting labels, would otherwise learn to predict it from
    the previous document's last token. So each document's loss and gradients are exactly those
    of the document run alone (tests/test_documents.py), and GPT-2's position embeddings see
    the offsets a document alone would have."""
    ids = batch["input_ids"]
    begins = torch.zeros(ids.shape, dtype=torch.bool)
    for row, positions in enumerate(starts):
        begins[row, torch.from_numpy(positions)] = True
    index = torch.arange(ids.shape[1]).expand_as(ids)
    latest_start = torch.where(begins, index, 0).cummax(dim=1).values
    return {**batch, "labels": batch["labels"].masked_fill(begins, -100), "position_ids": index - latest_start}


class MaskedInputs:
    """[CLS] block [SEP], then BERT's 15% masking (80% [MASK], 10% random, 10% kept) by transformers."""

    def __init__(self, tokenizer):
        self.cls, self.sep = tokenizer.cls_token_id, tokenizer.sep_token_id
        self.collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15, return_tensors="pt")

    def __call__(self, blocks: torch.Tensor, seeds: list[int]) -> dict:
        n = blocks.shape[0]
        ids = torch.cat([torch.full((n, 1), self.cls), blocks, torch.full((n, 1), self.sep)], dim=1)
        # Each sample's mask depends only on its own seed (run seed, step, block index), so a
        # resumed run, or another rank layout of the same global batch, masks the same tokens.
        rows = []
        with torch.random.fork_rng(devices=[]):
            for row, seed in zip(ids, seeds):
                torch.manual_seed(seed)
                rows.append(self.collator([{"input_ids": row}]))
        return {key: torch.cat([r[key] for r in rows]) for key in ("input_ids", "labels")}


@dataclass
class Layout:
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int


class LMData:
    """What the loop asks for: the micro batches of a step, and the evaluation batches.
    `sources` is one prepared token directory, or a mixture's [(directory, weight), ...]."""

    def __init__(
        self,
        sources: Path | list[tuple[Path, float]],
        block_size: int,
        family: str,
        tokenizer,
        layout: Layout,
        seed: int,
        eval_batches: int,
        cross_document_attention: bool = True,
    ):
        sources = [(Path(sources), 1.0)] if isinstance(sources, (str, Path)) else [(Path(d), w) for d, w in sources]
        # BERT's block holds the [CLS] and [SEP] it adds: block_size is the model's sequence length.
        content = block_size - 2 if family == "bert" else block_size
        self.inputs = MaskedInputs(tokenizer) if family == "bert" else CausalInputs()
        # Document starts are read only when documents are kept apart (config refuses it for BERT).
        self.separate = not cross_document_attention
        train, val = (
            [
                TokenBlocks(open_tokens(d, split), content, open_document_starts(d, split) if self.separate else None)
                for d, _ in sources
            ]
            for split in ("train", "val")
        )
        weights = tuple(float(w) for _, w in sources)
        self.layout, self.seed, self.block_tokens = layout, seed, block_size
        if len(sources) > 1:
            for k, (blocks, held_out) in enumerate(zip(train, val)):
                if len(blocks) == 0 or len(held_out) == 0:
                    raise ConfigError(
                        f"data.sources[{k}] ({sources[k][0].name}) has {len(blocks)} training and "
                        f"{len(held_out)} held-out blocks of {block_size} tokens; every source needs at least one: "
                        "use a larger corpus for it or lower data.block_size"
                    )
            self.train_blocks, self.val_blocks = MixtureBlocks(train), MixtureBlocks(val)
        else:
            self.train_blocks, self.val_blocks = train[0], val[0]
        if len(self.train_blocks) < layout.global_batch:
            raise ConfigError(
                f"the training split has {len(self.train_blocks)} blocks of {block_size} tokens, fewer than "
                f"one global batch of {layout.global_batch}: use a larger corpus or lower data.block_size / the "
                "batch size"
            )
        if len(self.val_blocks) < layout.micro_batch * layout.dp_size:
            raise ConfigError(
                f"the held-out split has {len(self.val_blocks)} blocks, fewer than one micro batch per rank: "
                "raise data.val_fraction or use a larger corpus"
            )
        order = (layout.global_batch, layout.micro_batch, layout.dp_rank, layout.dp_size, seed)
        self.order = (
            MixtureOrder(len(self.train_blocks), *order, sizes=tuple(len(b) for b in train), weights=weights)
            if len(sources) > 1
            else SampleOrder(len(self.train_blocks), *order)
        )
        self.eval_order = eval_indices(
            [len(b) for b in val], weights, layout.micro_batch, layout.dp_rank, layout.dp_size, eval_batches
        )

    def train_step(self, consumed: int) -> list[dict]:
        """The micro batches of the optimizer step that starts after `consumed` samples."""
        return [self._batch(self.train_blocks, idx, consumed) for idx in self.order.micro_batches(consumed)]

    def eval_batches(self) -> list[dict]:
        return [self._batch(self.val_blocks, idx, -1) for idx in self.eval_order]

    def _batch(self, blocks: TokenBlocks, indices, position: int) -> dict:
        batch = self.inputs(blocks.get(indices), self._sample_seeds(position, indices))
        if self.separate:
            batch = separate_documents(batch, [blocks.document_starts(int(i)) for i in indices])
        return batch

    def _sample_seeds(self, position: int, indices) -> list[int]:
        # hash() of a tuple of ints does not depend on PYTHONHASHSEED.
        return [hash((self.seed, position, int(i))) & 0x7FFFFFFF for i in indices]
