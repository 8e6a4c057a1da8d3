"""The models lmrepo trains: plain transformers models built from a preset (random init, or a
pretrained directory), on the meta device to plan with, split into pipeline layers, with lmrepo's
causal-LM loss."""

import os
from types import ModuleType

import torch
from transformers import PreTrainedModel

from lmrepo.models import bert, causal_loss, gpt2, llama, mixtral

FAMILIES: dict[str, ModuleType] = {"gpt2": gpt2, "bert": bert, "llama": llama, "mixtral": mixtral}


def build_model(
    model, loss_tiles: int | None = None, expert_parallel_size: int = 1, expert_parallel_rank: int | None = None
) -> PreTrainedModel:
    """loss_tiles None: transformers' own loss; a number: lmrepo's (models/causal_loss.py) in that
    many chunks of the sequence (causal families only). `expert_parallel_size`: how many ranks split
    a mixture of experts' experts; this rank builds the share of `expert_parallel_rank` (default:
    RANK modulo the size, DeepSpeed-MoE's groups of consecutive ranks). Dense families ignore both."""
    family = FAMILIES[model.family]
    if model.pretrained:
        net = family.MODEL_CLASS.from_pretrained(model.pretrained, **family.dropout_overrides(model))
    else:
        hf_config = family.hf_config(model)
        if hasattr(hf_config, "moe"):
            hf_config.moe["expert_parallel_size"] = expert_parallel_size
            if expert_parallel_rank is None:
                expert_parallel_rank = int(os.environ.get("RANK", "0")) % expert_parallel_size
            hf_config.moe["expert_parallel_rank"] = expert_parallel_rank
        net = family.MODEL_CLASS._from_config(hf_config)
    if hasattr(family, "prepare"):
        family.prepare(net)
    # Training never reuses attention key/value caches.
    net.config.use_cache = False
    # Named, transformers does not warn from inside forward (a graph break under torch.compile).
    net.loss_type = family.LOSS_TYPE
    if loss_tiles is not None:
        causal_loss.install(net, loss_tiles)
    # The LM head says what it is to code that sees a piece of the model (a pipeline stage: Muon
    # gives it AdamW, as the whole model's get_output_embeddings tells)
    head = net.get_output_embeddings()
    if head is not None:
        head.is_output_embedding = True
    return net.train()  # from_pretrained returns a model in eval mode


def hf_config(model_cfg):
    """The transformers config of the model train.py builds (a fresh object each call)."""
    family = FAMILIES[model_cfg.family]
    if model_cfg.pretrained:
        return family.MODEL_CLASS.config_class.from_pretrained(model_cfg.pretrained)
    return family.hf_config(model_cfg)


def meta_model(model_cfg, expert_parallel_size: int = 1, expert_parallel_rank: int = 0) -> torch.nn.Module:
    """The model train.py builds, on the meta device: every shape, no memory, no init time. A
    mixture of experts with every expert, or the share of them `expert_parallel_rank` of
    `expert_parallel_size` builds."""
    config = hf_config(model_cfg)
    if hasattr(config, "moe"):
        config.moe.update(expert_parallel_size=expert_parallel_size, expert_parallel_rank=expert_parallel_rank)
    with torch.device("meta"):
        return FAMILIES[model_cfg.family].MODEL_CLASS._from_config(config)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks transformers itself keeps whole when it splits a model (`_no_split_modules`):
    GPT2Block, LlamaDecoderLayer, BertLayer."""
    names = set(model._no_split_modules or ())
    return [module for module in model.modules() if type(module).__name__ in names]
