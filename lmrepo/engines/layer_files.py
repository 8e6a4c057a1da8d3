"""A torch pipeline's checkpoint: one pair of files per pipeline layer, DeepSpeed's layout. The
layer's weights (`layer_XX-model_states.pt`) and its parameters' optimizer states with their
group's hyperparameters (`layer_XX-optim_states.pt`), whole tensors by parameter name. Nothing in
them depends on how the run was split (stages, virtual stages, data, tensor or FSDP2 sharding), so
any layout loads them: another pipeline split, or engine=fsdp2 without a pipeline, which maps the
layers' names to the model's (lmrepo.models.pipe.hf_names)."""

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lmrepo.utils import safe_load

# What the pipeline engine adds to the client state of mp_rank_00_model_states.pt (not the loop's)
CLIENT_KEYS = frozenset(
    ("module", "global_steps", "lr_scheduler")
    + ("dp_world_size", "mp_world_size", "tp_world_size", "torch_pipeline_parts")
)


def weights_file(tag_dir: Path, index: int) -> Path:
    return Path(tag_dir, f"layer_{index:02d}-model_states.pt")


def optimizer_file(tag_dir: Path, index: int) -> Path:
    return Path(tag_dir, f"layer_{index:02d}-optim_states.pt")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a tensor: its shard of a DTensor (the same storage), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(state: dict) -> dict:
    """A state dict with every DTensor gathered whole (a collective over its mesh: every rank of the
    mesh calls it, in the same order)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def sliced_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor as a DTensor placed as `like` (this rank's slice taken locally: every rank
    holds the whole), or `value` itself where `like` is not a DTensor."""
    if not isinstance(like, DTensor) or value.shape != like.shape:
        return value
    return distribute_tensor(value.to(local(like).device), like.device_mesh, like.placements, src_data_rank=None)


def optimizer_states(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer) -> dict:
    """{name: {"state": the parameter's optimizer states, whole; "group": its group's
    hyperparameters (the rate the schedule reached)}}. Collectives for sharded parameters: every
    rank of their mesh calls this with the same parameters in the same order."""
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    return {
        name: {
            "state": whole(optimizer.state.get(param, {})),
            "group": {k: v for k, v in groups[id(param)].items() if k != "params"},
        }
        for name, param in named_params
    }


def load_optimizer_states(optimizer: torch.optim.Optimizer, saved: list[tuple[nn.Parameter, dict]]) -> None:
    """Each parameter of `saved` gets its saved states (sliced as the parameter is placed) and its
    group the saved hyperparameters; `saved` holds (parameter, optimizer_states()'s entry)."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state_dict = optimizer.state_dict()
    group_of = {i: group for group in state_dict["param_groups"] for i in group["params"]}
    for param, entry in saved:
        i = index[id(param)]
        state_dict["state"][i] = {
            k: sliced_like(v, param) if torch.is_tensor(v) else v for k, v in entry["state"].items()
        }
        group_of[i].update(entry["group"])
    optimizer.load_state_dict(state_dict)


def load_layer(tag_dir: Path, index: int, device: torch.device) -> tuple[dict, dict]:
    """(weights, optimizer states) of layer `index`, read weights-only onto `device`."""
    weights = safe_load.load(weights_file(tag_dir, index), map_location=device)
    return weights, safe_load.load(optimizer_file(tag_dir, index), map_location=device)


def by_model_name(tag_dir: Path, names: dict[int, dict[str, str]], file=weights_file) -> dict:
    """What the layer files (`file`: weights_file or optimizer_file) hold, under the model's own
    names (`names`: lmrepo.models.pipe.hf_names), on the CPU."""
    found = {}
    for index, mapping in names.items():
        saved = safe_load.load(file(tag_dir, index))
        found.update({mapping[name]: value for name, value in saved.items() if name in mapping})
    return found


def has_layer_optimizer_states(tag_dir: Path) -> bool:
    """A checkpoint any layout loads (per-layer optimizer states), not one of a single split (an
    older lmrepo's per-stage optimizer files, DeepSpeed's pipeline engine)."""
    return optimizer_file(tag_dir, 0).is_file()
