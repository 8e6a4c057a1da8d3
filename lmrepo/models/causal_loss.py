"""lmrepo's own causal-LM loss, in place of the one transformers computes inside the model's forward,
for three reasons:

- Tiles (`trainer.loss_tiles`): the LM head and the cross-entropy run on one chunk of the sequence
  at a time, each chunk under non-reentrant activation checkpointing, so neither forward nor
  backward ever holds more than one chunk's logits (tokens x vocabulary, the largest tensor of a
  long-sequence step) instead of the whole block's. The head is called as a module, so ZeRO-3's
  gather hooks and FSDP2's unsharded root parameters serve it as they serve the untiled head.
- Sequence parallelism: a rank holds a slice of each sequence (lmrepo/distributed/sequence_parallel.py), and
  the right loss to back-propagate is its slice's token sum divided by the number of scored tokens
  of the whole sequence (`scored_tokens`, given with the batch). DeepSpeed sums the gradients over
  the sequence-parallel group, so the group's gradient is exactly the unsplit one; the loss as
  transformers' DeepSpeed integration builds it (a differentiable all-gather of the per-rank
  losses) makes every gradient x the group size.
- A head split by vocabulary (engine=fsdp2's tp.loss_parallel): its logits stay split, and the
  cross-entropy runs on them under torch's loss_parallel (no rank holds every logit).

All take labels already shifted (`shift_labels`, -100 = not scored) or unshifted `labels`
(shifted here, as transformers does); a call without labels (generation, lm-eval) is the model's
own forward, logits and all (gathered whole from a head split by vocabulary)."""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast

IGNORE = -100  # transformers' and torch's label of a token that is not scored


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """The target of each position: the next token's label; the last position has none."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def _tile_loss_sum(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # transformers' loss upcasts the logits too
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    # A head split by vocabulary (engine=fsdp2 tp.loss_parallel) gives logits split by vocabulary,
    # whose cross-entropy torch's loss_parallel takes: a loss every rank holds whole
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def loss_sum(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, tiles: int) -> torch.Tensor:
    """Sum of the cross-entropy over the scored tokens of `hidden` (batch, tokens, width); with
    tiles > 1 in that many chunks of the tokens, each chunk's logits recomputed in backward."""
    if tiles == 1:
        return _tile_loss_sum(head, hidden, labels)
    pieces = zip(hidden.chunk(tiles, dim=1), labels.chunk(tiles, dim=1))
    return sum(checkpoint(_tile_loss_sum, head, h, y, use_reentrant=False) for h, y in pieces)


def install(model, tiles: int) -> None:
    """Replaces `model.forward` (a transformers causal LM) with one that computes lmrepo's loss:
    the same weights and parameter names, so checkpoints and export are unchanged."""
    original = model.forward

    def forward(input_ids=None, labels=None, shift_labels=None, scored_tokens=None, position_ids=None, **kwargs):
        if labels is None and shift_labels is None:
            output = original(input_ids=input_ids, position_ids=position_ids, **kwargs)
            if isinstance(output.logits, DTensor):  # a head split by vocabulary: every rank gets them whole
                output.logits = output.logits.full_tensor()
            return output
        if shift_labels is None:
            shift_labels = shifted(labels)
        # The head looked up at each call: an engine may have replaced it since (DeepSpeed's AutoTP
        # swaps the LM head for a tensor-parallel layer that gathers the vocabulary, and the old
        # module keeps only this rank's rows of the weight)
        base, head = model.base_model, model.get_output_embeddings()
        hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).last_hidden_state
        if scored_tokens is None:
            scored_tokens = (shift_labels != IGNORE).sum()
        loss = loss_sum(head, hidden, shift_labels, tiles) / scored_tokens
        if hasattr(model, "with_aux_loss"):  # a mixture of experts' load-balancing loss (models/mixtral.py)
            loss = model.with_aux_loss(loss)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = forward
