"""Every check of a composed config, run before any process group starts.

`validate(cfg, world_size)` returns the final DeepSpeed dict (ours, with the user's JSON laid
over it) or raises ConfigError with one line naming the keys to change.
"""
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from lmrepo.ds_config import build_ds_config, merge_user_config
from lmrepo.errors import ConfigError


# pipeline.schedule -> the engine that runs it: DeepSpeed's PipelineEngine, or torch.distributed.pipelining.
PIPELINE_ENGINES = {"none": None, "1f1b": "deepspeed", "gpipe": "torch", "1f1b_torch": "torch", "interleaved": "torch"}
PIPELINE_SCHEDULES = tuple(PIPELINE_ENGINES)
PIPELINE_FAMILIES = ("gpt2", "bert")


@dataclass(frozen=True)
class Device:
    type: str            # "cuda", "cpu", ...
    fp16: bool
    bf16: bool


def detect_device(requested: str) -> Device:
    """The accelerator DeepSpeed will use. `trainer.device=cpu` forces DeepSpeed's CPU accelerator."""
    if requested == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if requested == "cuda" and acc.device_name() != "cuda":
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible: set trainer.device=auto or cpu")
    return Device(acc.device_name(), bool(acc.is_fp16_supported()), bool(acc.is_bf16_supported()))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_missing(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    _require(not missing, f"{', '.join(missing)} must be set on the command line (e.g. {missing[0] if missing else ''}=...)")


# Keys compared as numbers below: a string there ("trainer.lr=abc") gets its own message.
NUMERIC_KEYS = {
    "trainer": ("max_steps", "micro_batch_size", "grad_accum", "global_batch_size", "lr", "min_lr_ratio",
                "warmup_steps", "weight_decay", "eps", "grad_clip", "seed", "log_every", "eval_every",
                "eval_batches", "save_every", "keep_last"),
    "model": ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "dropout"),
    "data": ("block_size", "val_fraction"),
    "pipeline": ("stages",),
    "tp": ("size",),
}


def check_types(cfg: DictConfig) -> None:
    for group, keys in NUMERIC_KEYS.items():
        for key in keys:
            value = cfg[group].get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{group}.{key}={value!r} must be a number")


def check_trainer(t: DictConfig) -> None:
    _require(t.max_steps > 0, "trainer.max_steps must be > 0")
    _require(t.micro_batch_size is None or t.micro_batch_size >= 1, "trainer.micro_batch_size must be >= 1")
    _require(t.grad_accum is None or t.grad_accum >= 1, "trainer.grad_accum must be >= 1")
    _require(t.global_batch_size is None or t.global_batch_size >= 1,
             "trainer.global_batch_size must be >= 1 (or null to derive it)")
    _require(t.lr > 0, "trainer.lr must be > 0")
    _require(0 <= t.warmup_steps < t.max_steps,
             f"trainer.warmup_steps={t.warmup_steps} must be in [0, trainer.max_steps={t.max_steps})")
    _require(t.lr_decay in ("cosine", "linear", "constant"), "trainer.lr_decay must be cosine, linear or constant")
    _require(0 <= t.min_lr_ratio <= 1, "trainer.min_lr_ratio must be in [0, 1]")
    _require(t.grad_clip >= 0, "trainer.grad_clip must be >= 0 (0 disables clipping)")
    for key in ("log_every", "eval_batches"):
        _require(t[key] >= 1, f"trainer.{key} must be >= 1")
    for key in ("eval_every", "save_every", "keep_last"):
        _require(t[key] >= 0, f"trainer.{key} must be >= 0 (0 = off)")
    _require(t.device in ("auto", "cpu", "cuda"), "trainer.device must be auto, cpu or cuda")


def model_shape(model: DictConfig) -> dict:
    """The architecture that will be built: the preset's, or the pretrained directory's."""
    shape = {k: model[k] for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}
    if model.pretrained is None:
        return shape
    config_file = Path(model.pretrained) / "config.json"
    _require(config_file.is_file(), f"model.pretrained={model.pretrained} has no config.json: "
                                    "point it at a Hugging Face model directory")
    hf = json.loads(config_file.read_text())
    names = {"n_layer": ("n_layer", "num_hidden_layers"), "n_head": ("n_head", "num_attention_heads"),
             "n_embd": ("n_embd", "hidden_size"), "n_positions": ("n_positions", "max_position_embeddings"),
             "vocab_size": ("vocab_size",)}
    for key, candidates in names.items():
        shape[key] = next((hf[c] for c in candidates if c in hf), shape[key])
    return shape


def check_model(model: DictConfig, data: DictConfig) -> None:
    _require(model.family in ("gpt2", "bert", "llama"), f"model.family={model.family} is not gpt2, bert or llama")
    shape = model_shape(model)
    _require(shape["n_embd"] % shape["n_head"] == 0,
             f"model.n_head={shape['n_head']} does not divide model.n_embd={shape['n_embd']}: change one of them")
    _require(model.pretrained or "n_kv_head" not in model or shape["n_head"] % model.n_kv_head == 0,
             f"model.n_kv_head={model.get('n_kv_head')} does not divide model.n_head={shape['n_head']} "
             "(each key/value head serves a group of query heads): change one of them")
    _require(data.block_size <= shape["n_positions"],
             f"data.block_size={data.block_size} is longer than the model's {shape['n_positions']} positions: "
             f"lower data.block_size or raise model.n_positions")
    _require(data.block_size >= 8, "data.block_size must be >= 8")
    _require(0 < data.val_fraction < 0.5, "data.val_fraction must be in (0, 0.5)")


def check_vocab(model: DictConfig, tokenizer_size: int) -> None:
    """The embedding table must cover every id the tokenizer produces."""
    vocab = model_shape(model)["vocab_size"]
    _require(vocab >= tokenizer_size, f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer_size} tokens: "
                                      f"set model.vocab_size={tokenizer_size} or change model.tokenizer")


def check_layout(cfg: DictConfig, world_size: int) -> int:
    """Returns the data-parallel size: world = pipeline stages x data-parallel degree."""
    pipe = cfg.pipeline
    stages = pipe.stages
    _require(pipe.schedule in PIPELINE_SCHEDULES,
             f"pipeline.schedule={pipe.schedule} is not one of {', '.join(PIPELINE_SCHEDULES)}: choose a pipeline= option")
    _require(pipe.get("engine") == PIPELINE_ENGINES[pipe.schedule],
             f"pipeline.engine={pipe.get('engine')} does not run pipeline.schedule={pipe.schedule}: "
             f"choose the pipeline={pipe.schedule} option as it is")
    _require(stages >= 1, "pipeline.stages must be >= 1")
    _require(pipe.schedule != "none" or stages == 1,
             f"pipeline.stages={stages} needs a pipeline schedule: choose a pipeline= option or set pipeline.stages=1")
    _require(world_size % stages == 0,
             f"pipeline.stages={stages} does not divide the world size {world_size}: change pipeline.stages or the rank count")
    if pipe.schedule != "none":
        check_pipeline(cfg)
    return world_size // stages


def check_pipeline(cfg: DictConfig) -> None:
    pipe, model = cfg.pipeline, cfg.model
    _require(model.family in PIPELINE_FAMILIES,
             f"pipeline={pipe.schedule} splits {' and '.join(PIPELINE_FAMILIES)} models, not model.family={model.family}: "
             "choose pipeline=none")
    virtual = pipe.virtual_stages
    _require(isinstance(virtual, int) and virtual >= 1, "pipeline.virtual_stages must be an integer >= 1")
    _require(pipe.schedule == "interleaved" or virtual == 1,
             f"pipeline.virtual_stages={virtual} needs pipeline=interleaved (the other schedules hold one chunk per rank)")
    _require(pipe.schedule != "interleaved" or virtual >= 2,
             "pipeline=interleaved needs pipeline.virtual_stages >= 2 (model chunks per rank)")
    chunks, layers = pipe.stages * virtual, model_shape(model)["n_layer"]
    _require(chunks <= layers, f"pipeline.stages={pipe.stages} x pipeline.virtual_stages={virtual} = {chunks} pipeline stages "
                               f"for a model of {layers} layers: every stage needs a transformer layer; lower pipeline.stages")
    partition = str(pipe.partition)
    _require(partition in ("parameters", "uniform") or partition.startswith("type:"),
             f"pipeline.partition={partition} is not parameters, uniform or type:<layer class regex>")
    if partition.startswith("type:"):
        from lmrepo.models.pipe import layer_class_names

        regex = partition.removeprefix("type:")
        matched = sum(1 for name in layer_class_names(model.family, layers) if re.search(regex, name, re.IGNORECASE))
        _require(matched >= chunks, f"pipeline.partition={partition} matches {matched} layers, fewer than the {chunks} "
                                    f"pipeline stages: use type:{'GPT2Block' if model.family == 'gpt2' else 'BertLayer'}")
    micro_batches = cfg.trainer.grad_accum or 1
    if pipe.schedule in ("1f1b_torch", "interleaved"):
        _require(micro_batches >= pipe.stages,
                 f"pipeline={pipe.schedule} needs at least as many micro-batches as stages: trainer.grad_accum={micro_batches} "
                 f"< pipeline.stages={pipe.stages}; raise trainer.grad_accum")
    if pipe.schedule == "interleaved":
        rounds = max(1, micro_batches // pipe.stages)
        _require(micro_batches % rounds == 0,
                 f"pipeline=interleaved needs trainer.grad_accum={micro_batches} to be a multiple of the "
                 f"{rounds} rounds of {pipe.stages} micro-batches: use a multiple of pipeline.stages")
    _require(not cfg.trainer.compile, f"trainer.compile=true is not supported with pipeline={pipe.schedule}: "
                                      "set trainer.compile=false")


def check_tensor_parallel(cfg: DictConfig, dp_size: int) -> int:
    """tp=auto: world = tp.size x data-parallel ranks. Returns the data-parallel size. The model
    is asked up front (on the meta device) whether DeepSpeed's AutoTP can shard it."""
    tp = cfg.tp
    _require(tp.mode in ("none", "auto"), f"tp.mode={tp.mode} is not none or auto: choose tp=none or tp=auto")
    if tp.mode == "none":
        _require(tp.size == 1, f"tp.size={tp.size} needs tp=auto: set tp=auto or tp.size=1")
        return dp_size
    _require(tp.size >= 2, f"tp.size={tp.size} must be >= 2 with tp=auto (or choose tp=none)")
    from lmrepo.estimate import meta_model
    from lmrepo.tp import autotp_refusal

    model = meta_model(cfg.model)
    refusal = autotp_refusal(model)
    _require(refusal is None, f"tp=auto: DeepSpeed's AutoTP refuses {type(model).__name__} (\"{refusal}\"): "
                              "use tp=none (ZeRO shards its states instead) or a model=llama-* preset")
    heads = {"attention heads": model.config.num_attention_heads,
             "key/value heads": getattr(model.config, "num_key_value_heads", model.config.num_attention_heads)}
    for what, count in heads.items():
        _require(count % tp.size == 0, f"tp.size={tp.size} does not divide the model's {count} {what}: change tp.size")
    _require(dp_size % tp.size == 0,
             f"tp.size={tp.size} does not divide the {dp_size} rank(s) (world = tp.size x data-parallel ranks): "
             "change tp.size or the rank count")
    _require(cfg.pipeline.schedule == "none", "tp=auto does not combine with a pipeline here: choose tp=none or pipeline=none")
    return dp_size // tp.size


def check_deepspeed(ds: dict, cfg: DictConfig, device: Device) -> None:
    """Checks on the final DeepSpeed dict, so a user's JSON is held to the same rules."""
    if ds.get("fp16", {}).get("enabled"):
        where = "set by deepspeed_config: disable fp16 there" if cfg.precision.dtype != "fp16" else "use precision=bf16"
        _require(device.fp16, f"fp16 is not supported on this {device.type} device: {where} "
                              "(fp16 with dynamic loss scaling needs a GPU)")
    if ds.get("bf16", {}).get("enabled"):
        _require(device.bf16, f"bf16 is not supported on this {device.type} device: use precision=fp16 or fp32")
    _require(not (ds.get("fp16", {}).get("enabled") and ds.get("bf16", {}).get("enabled")),
             "fp16 and bf16 are both enabled: choose one precision=")
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    _require(stage in (0, 1, 2, 3), f"zero.stage={stage} is not 0-3: choose zero=stage0..stage3")
    optimizer_offload = zero.get("offload_optimizer", {}).get("device", "none")
    param_offload = zero.get("offload_param", {}).get("device", "none")
    _require(optimizer_offload != "nvme" or stage == 3,
             f"NVMe offload (ZeRO-Infinity) needs ZeRO-3: set zero=stage3 (it is stage {stage}), or offload=cpu")
    _require(optimizer_offload == "none" or stage >= 1,
             f"optimizer offload to {optimizer_offload} needs ZeRO stage >= 1: set zero=stage1, stage2 or stage3, or offload=none")
    _require(param_offload == "none" or stage == 3,
             f"parameter offload to {param_offload} needs ZeRO-3 (zero=stage3): set zero=stage3, or offload.params=false")
    nvme_paths = {o.get("nvme_path") for o in (zero.get("offload_optimizer", {}), zero.get("offload_param", {}))
                  if o.get("device") == "nvme"}
    if nvme_paths:
        for path in nvme_paths:
            check_nvme_path(path)
        check_libaio()
    engine = PIPELINE_ENGINES.get(cfg.pipeline.schedule)
    if engine == "deepspeed":
        _require(stage <= 1, f"the DeepSpeed pipeline (pipeline={cfg.pipeline.schedule}) supports ZeRO stage 0 or 1, "
                             f"not {stage}: set zero=stage0 or stage1")
    if engine == "torch":
        where = f"pipeline={cfg.pipeline.schedule} (torch.distributed.pipelining)"
        _require(stage == 0, f"{where} supports ZeRO stage 0 only, not {stage}: set zero=stage0, "
                             "or pipeline=1f1b for DeepSpeed's pipeline with ZeRO-1")
        _require(optimizer_offload == "none", f"{where} does not offload: set offload=none, or pipeline=1f1b")
        _require(not ds.get("fp16", {}).get("enabled"), f"{where} runs fp32 or bf16: set precision=bf16, or pipeline=1f1b for fp16")


def check_nvme_path(path: str | None) -> None:
    _require(bool(path), "offload.nvme_path must be set for offload=nvme")
    p = Path(path)
    _require(not p.exists() or p.is_dir(), f"offload.nvme_path={path} is a file, not a directory: choose a directory")
    parent = p if p.exists() else p.parent
    _require(parent.is_dir(), f"offload.nvme_path={path}: {parent} is not an existing directory: create it or choose another path")
    _require(os.access(parent, os.W_OK), f"offload.nvme_path={path} is not writable: choose a writable path")


def check_libaio() -> None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    _require(AsyncIOBuilder().is_compatible(verbose=False),
             "offload=nvme needs libaio: install it (apt-get install libaio-dev) or use offload=cpu")


def check_checkpointing(ckpt: DictConfig, model: DictConfig) -> None:
    if not ckpt.enabled:
        return
    _require(ckpt.impl in ("deepspeed", "torch"), "checkpointing.impl must be deepspeed or torch")
    layers = model_shape(model)["n_layer"]
    _require(1 <= ckpt.every_n_layers <= layers,
             f"checkpointing.every_n_layers={ckpt.every_n_layers} must be in [1, {layers}] (the model's layers)")
    if ckpt.impl == "deepspeed":
        _require(not ckpt.cpu_checkpointing or ckpt.partition_activations,
                 "checkpointing.cpu_checkpointing needs checkpointing.partition_activations=true")
        _require(not ckpt.contiguous_memory_optimization or (ckpt.number_checkpoints and ckpt.partition_activations),
                 "checkpointing.contiguous_memory_optimization needs checkpointing.partition_activations=true "
                 "and checkpointing.number_checkpoints")


def load_user_deepspeed_config(path: str) -> dict:
    p = Path(path)
    _require(p.is_file(), f"deepspeed_config={path} does not exist")
    try:
        user = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"deepspeed_config={path} is not valid JSON ({err})") from None
    _require(isinstance(user, dict), f"deepspeed_config={path} must hold a JSON object")
    return user


def validate(cfg: DictConfig, world_size: int, device: Device) -> tuple[dict, list[str]]:
    """All checks; returns (DeepSpeed dict, keys the user's JSON changed)."""
    try:
        check_missing(cfg)
        check_types(cfg)
        check_trainer(cfg.trainer)
        check_model(cfg.model, cfg.data)
        check_checkpointing(cfg.checkpointing, cfg.model)
        _require(cfg.logger.name in ("wandb", "tensorboard", "jsonl", "none"),
                 f"logger.name={cfg.logger.name} is not wandb, tensorboard, jsonl or none")
        _require(cfg.offload.target in ("none", "cpu", "nvme"), "offload.target must be none, cpu or nvme")
        dp_size = check_layout(cfg, world_size)
        dp_size = check_tensor_parallel(cfg, dp_size)
        ds = build_ds_config(cfg, dp_size)
        changed = []
        if cfg.deepspeed_config:
            ds, changed = merge_user_config(ds, load_user_deepspeed_config(cfg.deepspeed_config), dp_size)
        check_deepspeed(ds, cfg, device)
    except MissingMandatoryValue as err:
        raise ConfigError(f"{err.full_key} must be set") from None
    return ds, changed
