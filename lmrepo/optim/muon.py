"""Muon's two halves, by the role a parameter plays (and DeepSpeed's engine told so), and the
compile choice of DeepSpeed's Muon.

Muon (Keller Jordan, 2024) orthogonalises the momentum of hidden weight matrices; embeddings, the
LM head, norms and biases take AdamW. DeepSpeed tells them apart by name (2-D and no "embed" or
"lm_head" in it), which sends GPT-2's `wte`/`wpe` and BERT's tied `cls.predictions.decoder` to
Muon; lmrepo decides from what each parameter is instead."""

import contextlib

import torch
from torch import nn


def muon_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters Muon steps: the matrices of the hidden layers. Not an nn.Embedding's
    weight (token, position and type embeddings), not the output embedding (the LM head, tied to
    the input embedding or not: transformers' get_output_embeddings), nothing below 2-D (norms,
    biases). GPT-2's Conv1D weights are hidden matrices stored transposed (in x out): Muon."""
    excluded = {id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        excluded |= {id(p) for p in head.parameters()}
    return {
        id(p)
        for p in model.parameters()
        # Under ZeRO-3's zero.Init a parameter is an empty placeholder; ds_shape is its real shape.
        if len(getattr(p, "ds_shape", p.shape)) >= 2 and id(p) not in excluded
    }


def compile_muon_update(enabled: bool) -> None:
    """DeepSpeed's Newton-Schulz update is torch.compile'd at import; the first step compiles it
    for every matrix shape, which pays back only where steps are many and matrices large (a GPU).
    Off: the same functions, eager (their originals, which the compiled wrappers keep)."""
    if enabled:
        return
    from deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    for name in ("muon_update", "zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz"):
        compiled = getattr(original_muon, name)
        eager = getattr(compiled, "_torchdynamo_orig_callable", None) or getattr(compiled, "__wrapped__", compiled)
        setattr(original_muon, name, eager)
        if hasattr(muon_optimizer, name):  # imported by name there
            setattr(muon_optimizer, name, eager)


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def compile_muon(choice: bool | None) -> bool:
    """optimizer.compile: null compiles Muon's update on CUDA only, where its steps are many and
    its matrices large; on a CPU the first step's compile costs more than it saves."""
    if choice is not None:
        return choice
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cuda"


@contextlib.contextmanager
def muon_roles(model: torch.nn.Module):
    """While deepspeed.initialize runs, each parameter's `use_muon` (which DeepSpeed's ZeRO and
    Muon read to pick the update) is lmrepo's role-based choice (lmrepo.optim.muon), set right after
    DeepSpeed's own by-name tagging."""
    import deepspeed

    tag_by_name = deepspeed.set_optimizer_flags
    matrices = muon_parameters(model)

    def tag_by_role(config_class, tagged_model):
        tag_by_name(config_class, tagged_model)
        for param in tagged_model.parameters():
            param.use_muon = id(param) in matrices

    deepspeed.set_optimizer_flags = tag_by_role
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = tag_by_name
