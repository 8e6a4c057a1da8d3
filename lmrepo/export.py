"""A DeepSpeed checkpoint of any ZeRO stage -> a Hugging Face model directory (config,
safetensors weights, tokenizer) that AutoModelForCausalLM / AutoModelForMaskedLM load."""
from pathlib import Path

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from transformers import AutoConfig

from lmrepo import checkpoint
from lmrepo.config import ModelConfig, from_dict
from lmrepo.errors import ConfigError
from lmrepo.models import FAMILIES, pipe
from lmrepo.tokenizer import load_tokenizer


def consolidated_state_dict(directory: Path, tag: str, states: dict) -> dict:
    """fp32 weights: from the (fp32 master) optimizer partitions when the optimizer state is
    partitioned (ZeRO 1-3, bf16), else the module weights saved whole (ZeRO-0 fp32)."""
    if any((directory / tag).glob("*zero_pp_rank_*optim_states.pt")):
        return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
    return {k: v.float() for k, v in states["module"].items()}


def pipeline_state_dict(tag_dir: Path, model, family: str) -> dict:
    """A pipeline checkpoint holds one file per layer (DeepSpeed's layout, and lmrepo's torch
    pipelines write the same): map each layer's parameter names back to the transformers names."""
    state = {}
    for index, names in pipe.hf_names(model, family).items():
        layer = torch.load(tag_dir / f"layer_{index:02d}-model_states.pt", map_location="cpu", weights_only=True)
        state.update({names[name]: tensor.float() for name, tensor in layer.items() if name in names})
    return state


def export(source: str, out: Path) -> Path:
    found = checkpoint.find(source, Path(source) / "checkpoints")
    if found is None:
        raise ConfigError(f"{source} holds no checkpoint: train with trainer.save_every=N first")
    directory, tag = found
    states = torch.load(checkpoint.check_files(directory / tag), map_location="cpu", weights_only=False)
    if "config" not in states:
        raise ConfigError(f"{directory / tag} was not written by lmrepo: no config to rebuild the model from")
    tp = states["config"].get("tp") or {}
    if tp.get("mode") == "auto":
        raise ConfigError(f"{directory / tag} is a tensor-parallel checkpoint (tp.size={tp.get('size')}): each rank saved "
                          "its own slice of the weights and export does not join them; export a tp=none run")
    model_cfg = from_dict(ModelConfig, states["config"]["model"])
    family = FAMILIES[model_cfg.family]
    hf_config = AutoConfig.from_pretrained(model_cfg.pretrained) if model_cfg.pretrained else family.hf_config(model_cfg)
    model = family.MODEL_CLASS(hf_config)
    if (directory / tag / "layer_00-model_states.pt").is_file():
        weights = pipeline_state_dict(directory / tag, model, model_cfg.family)
    else:
        weights = consolidated_state_dict(directory, tag, states)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if k in model._tied_weights_keys or k.endswith("lm_head.weight") or k.endswith("decoder.weight")}
    if set(missing) - tied or unexpected:
        raise ConfigError(f"{directory / tag}: weights do not fit the model (missing {sorted(set(missing) - tied)[:3]}, "
                          f"unexpected {unexpected[:3]})")
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    load_tokenizer(model_cfg.tokenizer, model_cfg.pretrained).save_pretrained(out)
    return out
