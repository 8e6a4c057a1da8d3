"""Muon's two halves, by the role a parameter plays (and DeepSpeed's engine told so), and the
compile choice of DeepSpeed's Muon.

Muon (Keller Jordan, 2024) orthogonalises the momentum of hidden weight matrices; embeddings, the
LM head, norms and biases take AdamW. DeepSpeed tells them apart by name (2-D and no "embed" or
"lm_head" in it), which sends GPT-2's `wte`/`wpe` and BERT's tied `cls.predictions.decoder` to
Muon; lmrepo decides from what each parameter is instead."""

import contextlib

import torch
from torch import nn

from lmrepo.config import OptimizerConfig


def muon_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters Muon steps: the matrices of the hidden layers. Not an nn.Embedding's
    weight (token, position and type embeddings), not the output embedding (the LM head, tied to
    the input embedding or not: transformers' get_output_embeddings, or in a pipeline stage the
    module build_model marked), nothing below 2-D (norms, biases). GPT-2's Conv1D weights are
    hidden matrices stored transposed (in x out): Muon."""
    excluded = {
        id(p)
        for module in model.modules()
        # an embedding, or the LM head (lmrepo.models.build_model marks it: a pipeline stage's chunks
        # have no get_output_embeddings)
        if isinstance(module, nn.Embedding) or getattr(module, "is_output_embedding", False)
        for p in module.parameters()
    }
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


def whole_matrix_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float, ns_method: str) -> torch.Tensor:
    """DeepSpeed's Muon update of one matrix (`muon_update`: Nesterov momentum, 5 Newton-Schulz
    steps, the aspect-ratio scale), with the orthogonalisation on the whole matrix where the
    matrix is sharded (a DTensor of FSDP2, HSDP or tensor parallelism): the momentum stays a shard
    as the parameter is, the Nesterov blend is gathered (`full_tensor`: an all-gather over the
    mesh), orthogonalised whole on every rank, and each rank keeps its own piece of the result (torch.chunk's
    pieces, as the shards are cut: no communication). Orthogonalising each shard alone would be
    another update, one per shard (Moonlight's distributed Muon gathers for the same reason).
    `momentum` is updated in place."""
    from deepspeed.runtime.zero.muon import original_muon
    from torch.distributed.tensor import DTensor, distribute_tensor

    momentum.lerp_(grad, 1 - beta)
    blend = grad.lerp(momentum, beta)
    whole = blend.full_tensor() if isinstance(blend, DTensor) else blend
    # The module's attributes, read now: compile_muon_update may have put the eager functions there.
    if ns_method == "gram":
        orthogonal = original_muon.zeropower_via_gram_newtonschulz(whole, steps=5)
    else:
        orthogonal = original_muon.zeropower_via_newtonschulz5(whole, steps=5)
    orthogonal = (orthogonal * original_muon._aspect_ratio_scale(whole.size(-2), whole.size(-1))).to(whole.dtype)
    if isinstance(blend, DTensor):
        return distribute_tensor(orthogonal, blend.device_mesh, blend.placements, src_data_rank=None)
    return orthogonal


class ShardedMuon(torch.optim.Optimizer):
    """DeepSpeed's Muon with its AdamW half (MuonWithAuxAdam's step; the AdamW half is torch's
    AdamW, as DeepSpeed runs it on a CPU) for the engines that step a torch optimizer over sharded
    parameters (FSDP2, HSDP): DeepSpeed's parameter groups (each of lmrepo's groups split into its
    Muon half at optimizer.lr and its AdamW half at optimizer.adam_lr, the group's weight decay on
    both), each matrix's update computed on the whole matrix (whole_matrix_update). One state dict
    for both halves, as DeepSpeed keeps it."""

    def __init__(self, groups: list[dict], matrices: set[int], optimizer: OptimizerConfig, adam_kwargs: dict):
        muon_half = {"lr": optimizer.lr, "momentum": optimizer.momentum, "ns_method": str(optimizer.ns_method)}
        adam_half = {"lr": optimizer.adam_lr, "betas": tuple(optimizer.betas), "eps": optimizer.eps}
        halves = []
        for group in groups:
            for use_muon in (True, False):
                params = [p for p in group["params"] if (id(p) in matrices) is use_muon]
                if params:
                    settings = {"use_muon": use_muon, "weight_decay": group["weight_decay"]}
                    halves.append({"params": params, **settings, **(muon_half if use_muon else adam_half)})
        super().__init__(halves, {})
        adam_groups = [group for group in self.param_groups if not group["use_muon"]]
        self.adam = torch.optim.AdamW(adam_groups, **adam_kwargs) if adam_groups else None
        self._share_with_adam()

    def _share_with_adam(self) -> None:
        """The AdamW half steps this optimizer's own groups and states (a schedule's rate reaches it)."""
        if self.adam is not None:
            self.adam.param_groups = [group for group in self.param_groups if not group["use_muon"]]
            self.adam.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's load_state_dict makes new groups and a new state: shared again, or the AdamW half
        # would step from the states it had before the load (a resumed run's moments lost)
        super().load_state_dict(state_dict)
        self._share_with_adam()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for param in group["params"]:
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                state = self.state[param]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                update = whole_matrix_update(grad, state["momentum_buffer"], group["momentum"], group["ns_method"])
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-group["lr"])
        if self.adam is not None:
            self.adam.step()
