"""Every engine's optimizer from one place: lmrepo's parameter groups (weight decay on the
matrices, a mixture of experts' expert weights in groups of their own) and the torch optimizer the
torch engines step over them (Adam or AdamW, fused where torch has it). DeepSpeed's engines hand
the same groups to deepspeed.initialize, which builds the optimizer the final DeepSpeed dict names
(AdamW, or Muon with lmrepo's role split: lmrepo.optim.muon)."""

import torch
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from torch.distributed.tensor import DTensor

from lmrepo.config import OptimizerConfig
from lmrepo.config.training import OptimizerName
from lmrepo.optim.muon import ShardedMuon, compile_muon, compile_muon_update, muon_parameters


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights), not on biases and norms (as nanoGPT).
    A mixture of experts' expert weights go in groups of their own: DeepSpeed reduces and
    partitions them over the expert-data-parallel ranks, not over all ranks."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            # Under ZeRO-3's zero.Init a parameter is an empty placeholder; ds_shape is its real shape.
            ndim = len(getattr(param, "ds_shape", param.shape))
            (decay if ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    if any(is_moe_param(param) for param in decay):
        return split_params_into_different_moe_groups_for_optimizer(groups)
    return [{k: v for k, v in group.items() if k != "name"} for group in groups]


# lmrepo's optimizer names -> torch's classes, for the engines that step a torch optimizer
# themselves (FSDP2, the torch pipeline); DeepSpeed's engines take lmrepo.plan.ds_config's section.
TORCH_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


def torch_optimizer(groups: list[dict], optimizer: OptimizerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """torch's Adam or AdamW over lmrepo's parameter groups, fused: one kernel for every parameter
    (CUDA and CPU); or Muon with that AdamW for its other half (lmrepo.optim.muon.ShardedMuon, the
    roles read from `model`). torch's default on a GPU is a few kernels per operation over lists of
    parameters, on a CPU a loop over the parameters; on FSDP2's sharded parameters each of those
    operations also goes through DTensor's dispatch in Python (on a CPU, 12-layer GPT-2 at width 64:
    45% of FSDP2's step). The update is the same within float rounding.

    Where the parameters mix DTensors and plain tensors (a torch pipeline under FSDP2 keeps a
    weight two of a rank's chunks share whole), neither the fused kernel nor torch's lists take
    them together: the loop over the parameters then."""
    kinds = {isinstance(p, DTensor) for group in groups for p in group["params"]}
    implementation = {"fused": True} if len(kinds) <= 1 else {"foreach": False}
    if optimizer.name == OptimizerName.muon:
        compile_muon_update(compile_muon(optimizer.compile))
        return ShardedMuon(groups, muon_parameters(model), optimizer, implementation)
    return TORCH_OPTIMIZERS[optimizer.name](
        groups, lr=optimizer.lr, betas=tuple(optimizer.betas), eps=optimizer.eps, **implementation
    )
