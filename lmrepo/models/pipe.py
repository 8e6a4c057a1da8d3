"""GPT-2, Llama and BERT as a sequence of pipeline layers (the usual split: pre-process, blocks,
post-process), built around the modules of an ordinary transformers model.

The layers wrap the transformers model's own modules, so a pipelined run starts from exactly
the weights a non-pipelined run with the same seed starts from, computes the same function,
and its checkpoints map back to the transformers parameter names (`hf_names`). The input and
output embeddings are one tied layer ("embed"): DeepSpeed keeps a copy on the first and the
last stage and all-reduces their gradients (TiedLayerSpec).

Every layer takes and returns one tensor, the pipeline sends it from stage to stage; except that
GPT-2's and Llama's layers up to the final norm take and return (tensor, position_ids) when the
batch keeps its documents apart (data.cross_document_attention=false): each block then builds
transformers' per-document mask from the restarting position ids, as GPT2Model and LlamaModel do.
"""

import re

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss
from transformers.masking_utils import create_causal_mask

# --- GPT-2 ---------------------------------------------------------------------------------


def with_positions(inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tensor, position_ids) from a layer's input: the pair, or one tensor (positions None)."""
    return inputs if isinstance(inputs, tuple) else (inputs, None)


class GPT2EmbeddingPipe(nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, inputs):
        input_ids, positions = with_positions(inputs)
        given = positions is not None
        if not given:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.drop(self.wte(input_ids) + self.wpe(positions))
        return (hidden, positions) if given else hidden


def gpt2_logits(embedding: GPT2EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head: the (tied) token embedding matrix, as GPT2LMHeadModel's lm_head."""
    return F.linear(hidden, embedding.wte.weight)


class GPT2BlockPipe(nn.Module):
    def __init__(self, block, config):
        super().__init__()
        self.block, self.config = block, config

    def forward(self, inputs):
        hidden, positions = with_positions(inputs)
        given = positions is not None
        if not given:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # The mask GPT2Model builds for an unpadded block (None under SDPA: is_causal does it), or
        # for packed documents (restarting positions: one causal span per document).
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=positions
        )
        out = self.block(hidden, None, mask, position_ids=positions)
        return (out, positions) if given else out


class NormPipe(nn.Module):
    """A layer that is one module applied to the hidden states: GPT-2's final LayerNorm, Llama's
    RMSNorm and untied LM head, BERT's MLM head transform (dense, GELU, LayerNorm)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, inputs) -> torch.Tensor:
        # the positions end here: the LM head and the loss need the hidden states only
        return self.norm(with_positions(inputs)[0])


def gpt2_layers(net) -> list:
    t = net.transformer
    return [
        TiedLayerSpec("embed", GPT2EmbeddingPipe, t, tied_weight_attr="wte.weight"),
        *[LayerSpec(GPT2BlockPipe, block, net.config) for block in t.h],
        LayerSpec(NormPipe, t.ln_f),
        TiedLayerSpec("embed", GPT2EmbeddingPipe, t, forward_fn=gpt2_logits, tied_weight_attr="wte.weight"),
    ]


# --- Llama ---------------------------------------------------------------------------------


class LlamaEmbeddingPipe(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.embed_tokens = model.embed_tokens

    def forward(self, inputs):
        input_ids, positions = with_positions(inputs)
        hidden = self.embed_tokens(input_ids)
        return (hidden, positions) if positions is not None else hidden


def llama_logits(embedding: LlamaEmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head of a Llama with tied embeddings (model.tie_embeddings=true)."""
    return F.linear(hidden, embedding.embed_tokens.weight)


class LlamaLayerPipe(nn.Module):
    """One decoder layer, with the rotary angles LlamaModel computes once and hands every layer
    (recomputed here per layer: only a tensor crosses a stage boundary; the rotary module has no
    parameters and its inv_freq buffer is not saved)."""

    def __init__(self, layer, rotary_emb, config):
        super().__init__()
        self.layer, self.rotary_emb, self.config = layer, rotary_emb, config
        self.moe = is_moe_layer(layer)  # a mixture of experts' block: its load-balancing loss rides on the output

    def forward(self, inputs):
        hidden, positions = with_positions(inputs)
        given = positions is not None
        if not given:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # restarting position ids (packed documents kept apart) give a per-document causal mask and
        # per-document rotary angles, as LlamaModel makes them
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=positions
        )
        out = self.layer(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=None,
            use_cache=False,
            position_embeddings=self.rotary_emb(hidden, position_ids=positions),
        )
        if self.training and self.moe:
            out = with_aux_loss(out, self.layer.mlp, self.config.moe["aux_loss_coef"])
        return (out, positions) if given else out


def is_moe_layer(layer: nn.Module) -> bool:
    from lmrepo.models.mixtral import MoEMLP

    return isinstance(getattr(layer, "mlp", None), MoEMLP)


def is_moe_spec(spec) -> bool:
    """A pipeline layer that is an MoE block (a Llama layer whose MLP is an MoEMLP)."""
    return getattr(spec, "typename", None) is LlamaLayerPipe and is_moe_layer(spec.module_args[0])


class _AuxLossGradient(torch.autograd.Function):
    """The hidden states unchanged; in backward, the gradient of a loss term `aux` as well (1, as
    if it were added to the stage's loss: Megatron's MoEAuxLossAutoScaler). A pipeline stage's
    backward starts from its output's gradient, so a load-balancing loss made inside the stage
    gets its gradient this way."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return hidden

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def with_aux_loss(out, mlp, coef: float):
    """An MoE block's output carrying coef x its load-balancing loss into the backward (the
    torch pipelines: the loss the last stage computes has no path to it). The term and the
    forward's routes are kept in `mlp.pipeline_forwards`, for the logged loss and the router bias."""
    aux = coef * mlp.aux_loss
    mlp.pipeline_forwards.append((aux.detach(), mlp.routes.detach()))
    return _AuxLossGradient.apply(out, aux)


def llama_layers(net) -> list:
    model = net.model
    blocks = [LayerSpec(LlamaLayerPipe, layer, model.rotary_emb, net.config) for layer in model.layers]
    if net.config.tie_word_embeddings:
        return [
            TiedLayerSpec("embed", LlamaEmbeddingPipe, model, tied_weight_attr="embed_tokens.weight"),
            *blocks,
            LayerSpec(NormPipe, model.norm),
            TiedLayerSpec(
                "embed", LlamaEmbeddingPipe, model, forward_fn=llama_logits, tied_weight_attr="embed_tokens.weight"
            ),
        ]
    # Untied (Llama's default): the head is a layer of its own, one module applied to the hidden states.
    return [
        LayerSpec(LlamaEmbeddingPipe, model),
        *blocks,
        LayerSpec(NormPipe, model.norm),
        LayerSpec(NormPipe, net.lm_head),
    ]


# --- BERT ----------------------------------------------------------------------------------


class BertEmbeddingPipe(nn.Module):
    def __init__(self, embeddings):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids=input_ids)


def bert_logits(embedding: BertEmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The MLM decoder: the (tied) word embedding matrix; its bias is the next layer."""
    return F.linear(hidden, embedding.embeddings.word_embeddings.weight)


class BertLayerPipe(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Packed blocks have no padding: BertModel's bidirectional mask is None for them too.
        return self.layer(hidden, None)


class BiasPipe(nn.Module):
    def __init__(self, bias: nn.Parameter):
        super().__init__()
        self.bias = bias

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.bias


def bert_layers(net) -> list:
    embeddings, predictions = net.bert.embeddings, net.cls.predictions
    return [
        TiedLayerSpec("embed", BertEmbeddingPipe, embeddings, tied_weight_attr="embeddings.word_embeddings.weight"),
        *[LayerSpec(BertLayerPipe, layer) for layer in net.bert.encoder.layer],
        LayerSpec(NormPipe, predictions.transform),
        TiedLayerSpec(
            "embed",
            BertEmbeddingPipe,
            embeddings,
            forward_fn=bert_logits,
            tied_weight_attr="embeddings.word_embeddings.weight",
        ),
        LayerSpec(BiasPipe, predictions.decoder.bias),
    ]


# --- both ----------------------------------------------------------------------------------

LAYERS = {"gpt2": gpt2_layers, "llama": llama_layers, "mixtral": llama_layers, "bert": bert_layers}


class LMLoss:
    """transformers' own loss functions (shifted for GPT-2), so both paths compute the same loss."""

    def __init__(self, family: str, vocab_size: int):
        self.function = ForMaskedLMLoss if family == "bert" else ForCausalLMLoss
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.function(logits, labels, self.vocab_size)


class TiledLMLoss:
    """The causal LM loss with the LM head applied one chunk of the sequence at a time
    (trainer.loss_tiles; lmrepo.models.causal_loss): the last stage ends at the final norm, and the
    loss calls the head layer, a module, on each tile, so no step holds the whole micro-batch's
    logits. The mean over the scored tokens, as LMLoss."""

    def __init__(self, head: nn.Module, tiles: int):
        self.head, self.tiles = head, tiles

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from lmrepo.models.causal_loss import IGNORE, loss_sum, shifted

        targets = shifted(labels)
        return loss_sum(self.head, hidden, targets, self.tiles) / (targets != IGNORE).sum()


class SequenceSliceLoss:
    """The causal LM loss of a sequence-parallel rank's slice in a pipeline's last stage (lmrepo's
    sequence parallelism: the slice's token sum over the whole sequences' scored tokens, which
    summed over the group is the unsplit loss). Its target holds the slice's labels, already
    shifted, and in a last column the whole micro-batch's scored-token count (each row the same):
    a pipeline's loss sees only its target. `head`: with trainer.loss_tiles, the LM head layer
    the loss applies tile by tile (the stage ends at the final norm); else the stage's output is
    the logits."""

    def __init__(self, head: nn.Module | None = None, tiles: int = 1):
        self.head, self.tiles = head, tiles

    @staticmethod
    def target(shift_labels: torch.Tensor, scored_tokens: torch.Tensor) -> torch.Tensor:
        count = scored_tokens.reshape(1, 1).expand(shift_labels.shape[0], 1).to(shift_labels)
        return torch.cat([shift_labels, count], dim=1)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from lmrepo.models.causal_loss import IGNORE, loss_sum

        labels, scored = target[:, :-1], target[0, -1]
        if self.head is not None:
            return loss_sum(self.head, output, labels, self.tiles) / scored
        logits = output.float()
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        return total / scored


def is_tied_copy(spec) -> bool:
    """A TiedLayerSpec that computes with forward_fn (the LM head): it reuses the module of its
    key's first layer and owns nothing of its own, so it has no checkpoint file (as DeepSpeed)."""
    return getattr(spec, "forward_fn", None) is not None


def pipeline_layers(net, family: str) -> list:
    return LAYERS[family](net)


def hf_names(net, family: str) -> dict[int, dict[str, str]]:
    """For each layer index that owns parameters: {name in the layer's state_dict: name in the
    transformers model}. Tied copies (forward_fn) own nothing of their own."""
    canonical = {id(p): name for name, p in net.named_parameters()}  # named_parameters lists a tied one once
    # and the buffers a checkpoint holds (a mixture of experts' router bias)
    saved = net.state_dict(keep_vars=True)
    canonical |= {id(b): name for name, b in net.named_buffers() if name in saved}
    names = {}
    for index, spec in enumerate(pipeline_layers(net, family)):
        if is_tied_copy(spec):
            continue
        layer = spec.build()
        tensors = [*layer.named_parameters(), *layer.named_buffers()]
        names[index] = {name: canonical[id(t)] for name, t in tensors if id(t) in canonical}
    return names


def layer_class_names(family: str, n_layer: int) -> list[str]:
    """The class name of every pipeline layer, in order, without building a model (for checks)."""
    if family == "gpt2":
        return ["GPT2EmbeddingPipe", *["GPT2BlockPipe"] * n_layer, "NormPipe", "GPT2EmbeddingPipe"]
    if family in ("llama", "mixtral"):  # untied: the head is a NormPipe (tied, a LlamaEmbeddingPipe: no block)
        return ["LlamaEmbeddingPipe", *["LlamaLayerPipe"] * n_layer, "NormPipe", "NormPipe"]
    return ["BertEmbeddingPipe", *["BertLayerPipe"] * n_layer, "NormPipe", "BertEmbeddingPipe", "BiasPipe"]


def balance_note(names: list[str], parts: list[int], partition: str) -> str | None:
    """A note when a split gives the stages unequal shares of the transformer blocks: a stage with
    none pipelines no transformer work, which hides what the schedule does. Whether it is slower
    depends on the model (a narrow model's LM head can outweigh its blocks): the note points at
    the measured bubble. `names`: each pipeline layer's class name; `parts`: the stage boundaries."""
    from lmrepo.config.parallel import BLOCK_CLASSES

    block = re.compile("|".join(BLOCK_CLASSES.values()), re.IGNORECASE)
    blocks = [sum(1 for name in names[a:b] if block.search(name)) for a, b in zip(parts, parts[1:])]
    if min(blocks) > 0 and max(blocks) - min(blocks) <= 1:
        return None
    return (
        f"lmrepo: note: pipeline.partition={partition} gives the {len(blocks)} stages "
        f"{', '.join(map(str, blocks))} transformer blocks (a stage without one holds only the embedding or the "
        "head); pipeline.partition=blocks gives each an equal share, and the metrics' bubble measures which "
        "split balances the compute"
    )
