"""Sequence parallelism (`sequence_parallel.size`): DeepSpeed's Ulysses for Hugging Face models
(Arctic Long Sequence Training). Each group of `size` consecutive ranks holds one replica of the
model and splits every sequence of its micro batch into `size` slices; around attention,
DeepSpeed's UlyssesSPAttentionHF swaps the split from tokens to heads with an all-to-all, so each
rank attends over the whole sequence for its share of the heads. The ranks of one group read the
same samples: the data-parallel size is world / size.

The loss each rank back-propagates is its slice's token sum over the whole sequence's scored
tokens (lmrepo/models/causal_loss.py says why)."""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from lmrepo.models.causal_loss import IGNORE, shifted


def attention_shape(config) -> SimpleNamespace:
    """What UlyssesSPAttentionHF reads of a model's config, for GPT-2 too (its config has no
    num_key_value_heads: every head has its own keys and values)."""
    heads = config.num_attention_heads
    shape = SimpleNamespace(
        num_attention_heads=heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
        hidden_size=config.hidden_size,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        num_hidden_layers=config.num_hidden_layers,
    )
    return SimpleNamespace(_attn_implementation=config._attn_implementation, get_text_config=lambda: shape)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The causal mask of packed documents (position ids restarting at 0 within the sequence), as
    SDPA takes a boolean mask (True = attend); for a row of one document, the causal mask. Built
    for every batch, without asking whether it holds a boundary: that question reads the tensor on
    the host, a graph break in every attention call of a compiled model."""
    document = (positions == 0).cumsum(-1)
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool, device=positions.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def document_aware(attention):
    """SDPA that attends within each packed document: DeepSpeed's wrapper drops the model's mask (it
    was built for one slice) and hands the core attention the whole sequence's position ids."""

    def attend(module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is None and kwargs.get("position_ids") is not None:
            attention_mask = document_mask(kwargs["position_ids"])
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    return attend


def register(model, size: int, micro_batch: int, documents: bool):
    """Wraps the model's attention function (sdpa) in DeepSpeed's Ulysses all-to-all and makes the
    sequence-parallel process groups; returns them as the `mpu` deepspeed.initialize takes.
    documents: packed documents are kept apart (data.cross_document_attention=false); only then do
    batches carry restarting position ids, and only then is SDPA given their mask."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = model.config._attn_implementation
    if documents and implementation == "sdpa":  # flash attention finds the documents in the position ids itself
        # register_with_transformers wraps whatever the registry holds under this name.
        ALL_ATTENTION_FUNCTIONS[implementation] = document_aware(ALL_ATTENTION_FUNCTIONS[implementation])
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=SimpleNamespace(config=attention_shape(model.config)),
        core_attn_implementation=implementation,
        sequence_parallel_size=size,
        micro_batch_size=micro_batch,
        seq_length_is_variable=True,  # the length is read from each batch: one wrapper for any block size
    )
    ulysses = ALL_ATTENTION_FUNCTIONS[implementation]

    def attend(*args, **kwargs):
        # Ulysses returns (batch, tokens, width); GPT-2 flattens the last two dimensions of the
        # (batch, tokens, heads, head width) attention functions return (Llama reshapes either).
        output, weights = ulysses(*args, **kwargs)
        return output.unsqueeze(-2), weights

    ALL_ATTENTION_FUNCTIONS[implementation] = attend
    return mpu


def ulysses(model, config, micro_batch: int) -> "Slicer":
    """Ulysses on `model` for the job's sequence_parallel.size (register: its groups are
    consecutive ranks, the layout's sp), and the slicer of its batches (its `mpu` for
    deepspeed.initialize), as every engine sets it up."""
    documents = not config.data.cross_document_attention
    return Slicer(register(model, config.sequence_parallel.size, micro_batch, documents))


class Slicer:
    """This rank's slice of every batch, and the group's loss from this rank's share of it."""

    def __init__(self, mpu):
        self.mpu = mpu
        self.group = mpu.get_sequence_parallel_group()
        self.rank, self.size = mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()

    def __call__(self, batch: dict) -> dict:
        """Labels shifted before the split (the last token of a slice predicts the first of the
        next), position ids made (or kept: packed documents restart them) for the whole sequence,
        and the count of scored tokens taken over the whole sequence."""
        ids = batch["input_ids"]
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        targets = shifted(batch["labels"])
        width = ids.shape[1] // self.size
        part = slice(self.rank * width, (self.rank + 1) * width)
        return {
            "input_ids": ids[:, part],
            "position_ids": positions[:, part],
            "shift_labels": targets[:, part],
            "scored_tokens": (targets != IGNORE).sum(),
        }

    def whole_loss(self, share: torch.Tensor) -> torch.Tensor:
        """The sequence's loss from this rank's share of it (for the metrics, no gradient)."""
        share = share.detach().clone()
        dist.all_reduce(share, group=self.group)
        return share
