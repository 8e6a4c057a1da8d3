"""A DeepSpeed checkpoint of any ZeRO stage -> a Hugging Face model directory (config,
safetensors weights, tokenizer) that AutoModelForCausalLM / AutoModelForMaskedLM load; or the
same model kept in memory (consolidate), for evaluation."""

from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from transformers import AutoConfig

from lmrepo.config import ModelConfig, from_dict
from lmrepo.data.tokenizer import load_tokenizer
from lmrepo.engines.layer_files import by_model_name, weights_file
from lmrepo.models import FAMILIES, mixtral, pipe
from lmrepo.train import checkpoint
from lmrepo.utils import safe_load
from lmrepo.utils.errors import ConfigError


def consolidated_state_dict(directory: Path, tag: str, states: dict, model: torch.nn.Module) -> dict:
    """fp32 weights: FSDP2's DCP shards joined (a mixture of experts' among them), DeepSpeed-MoE's
    module and expert files, the (fp32 master) optimizer partitions when the optimizer state is
    partitioned (ZeRO 1-3, bf16), else the module weights saved whole (ZeRO-0 fp32)."""
    if states.get("engine") == "fsdp2":
        from lmrepo.engines.fsdp2 import load_full_weights

        return load_full_weights(directory / tag, model)
    if isinstance(model, mixtral.MixtralStyleForCausalLM):  # DeepSpeed-MoE: the experts in files of their own
        return moe_state_dict(directory / tag, states)
    if any((directory / tag).glob("*zero_pp_rank_*optim_states.pt")):
        with safe_load.weights_only_loads(directory / tag):
            return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
    return {k: v.float() for k, v in states["module"].items()}


def moe_state_dict(tag_dir: Path, states: dict) -> dict:
    """DeepSpeed-MoE keeps the experts out of the module's state dict: one file per (MoE layer,
    expert) under the expert's global index, whichever rank held it. The module's weights are the
    run's own (fp32 in an fp32 run; a bf16 run's bf16 copies of its fp32 master weights)."""
    state = {k: v.float() for k, v in states["module"].items()}
    for path in sorted(tag_dir.glob("layer_*_expert_*_model_states.pt")):
        state.update({k: v.float() for k, v in safe_load.load(path).items()})
    return state


def pipeline_state_dict(tag_dir: Path, model, family: str) -> dict:
    """A pipeline checkpoint holds one file per layer (DeepSpeed's layout, and lmrepo's torch
    pipelines write the same): map each layer's parameter names back to the transformers names."""
    return {name: tensor.float() for name, tensor in by_model_name(tag_dir, pipe.hf_names(model, family)).items()}


@dataclass
class Consolidated:
    """A checkpoint's whole model in memory, whatever layout saved it."""

    model: torch.nn.Module  # the transformers model, fp32, every weight joined
    config: ModelConfig  # the run's model settings (its tokenizer, family)
    tag_dir: Path  # the checkpoint it came from
    step: int  # the optimizer step it was saved at


def consolidate(source: str) -> Consolidated:
    """A run directory, its checkpoints/ or a checkpoints/<tag> as one transformers model in
    memory: ZeRO partitions (any stage) and pipeline layer files joined on the CPU, nothing written."""
    if not Path(source).exists():
        raise ConfigError(f"{source}: no such directory: give a run directory, its checkpoints/ or a checkpoints/<tag>")
    try:
        found = checkpoint.find(source, Path(source) / "checkpoints")
    except ConfigError:  # find() words it for run.resume=, which the user of a script never typed
        found = None
    if found is None:
        raise ConfigError(
            f"{source} holds no checkpoint: a run saves one with trainer.save_every=N (and at its end); "
            "train with it, then export the run directory"
        )
    directory, tag = found
    states = safe_load.load(checkpoint.check_files(directory / tag))
    if "config" not in states:
        raise ConfigError(f"{directory / tag} was not written by lmrepo: no config to rebuild the model from")
    tp = states["config"].get("tp") or {}
    engine = (states["config"].get("engine") or {}).get("name", "deepspeed")
    if tp.get("mode") == "auto" and engine != "fsdp2":  # FSDP2's slices are joined (DCP, a pipeline's whole layers)
        raise ConfigError(
            f"{directory / tag} is a tensor-parallel checkpoint (tp.size={tp.get('size')}): each rank of DeepSpeed's "
            "AutoTP saved its own slice of the weights and lmrepo does not join them: export or evaluate a tp=none "
            "or engine=fsdp2 run (eval.tasks evaluates a tp=auto run during training, on its live engine)"
        )
    model_cfg = from_dict(ModelConfig, states["config"]["model"])
    family = FAMILIES[model_cfg.family]
    hf_config = (
        AutoConfig.from_pretrained(model_cfg.pretrained) if model_cfg.pretrained else family.hf_config(model_cfg)
    )
    model = family.MODEL_CLASS(hf_config)
    if weights_file(directory / tag, 0).is_file():
        weights = pipeline_state_dict(directory / tag, model, model_cfg.family)
    else:
        weights = consolidated_state_dict(directory, tag, states, model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {
        k
        for k in missing
        if k in model._tied_weights_keys or k.endswith("lm_head.weight") or k.endswith("decoder.weight")
    }
    if set(missing) - tied or unexpected:
        raise ConfigError(
            f"{directory / tag}: weights do not fit the model (missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    return Consolidated(model, model_cfg, directory / tag, int(states.get("step", 0)))


def export(source: str, out: Path) -> Path:
    whole = consolidate(source)
    model = mixtral.to_transformers_mixtral(whole.model) if whole.config.family == "mixtral" else whole.model
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    load_tokenizer(whole.config.tokenizer, whole.config.pretrained).save_pretrained(out)
    return out
