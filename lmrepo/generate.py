"""Look at what a model learned: sample text from a causal LM (GPT-2, Llama), fill [MASK]s with BERT.

The source is a Hugging Face directory, or a run directory / checkpoint, which is exported
once (lmrepo.export) to `RUN/export/<tag>/` and reused. Sampling is transformers' `generate`.
Under the deepspeed launcher (more than one rank) the model goes through
`deepspeed.init_inference`: kernel injection for the models DeepSpeed has inference kernels
for (GPT-2), on GPUs only; AutoTP sharding over the ranks for the models its parser or
transformers' tp_plan covers (Llama, BERT), which also runs on the CPU. Everything that can be
refused is checked before the process group starts.
"""

import json
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from filelock import FileLock

from lmrepo.distributed import launch
from lmrepo.distributed.device import TORCH_DTYPES
from lmrepo.train import checkpoint
from lmrepo.utils.errors import ConfigError, exit_error

TIMED_FORWARDS = 5  # fill-mask: one forward is too short to time alone


@dataclass
class Options:
    run: str = ""  # a run directory, checkpoints/<tag>, or a Hugging Face model directory
    prompt: str = ""  # causal LM: the text to continue; BERT: text with [MASK] tokens
    max_new_tokens: int = 50
    temperature: float = 0.0  # 0 = greedy; > 0 samples from softmax(logits / temperature)
    top_k: int = 0  # sampling: keep the k most likely tokens (0 = all); fill-mask: shown per mask (0 = 5)
    top_p: float = 1.0  # sampling: nucleus, the smallest set with this probability mass (1 = all)
    seed: int = 1234  # the same on every rank: sampled tokens agree across tensor-parallel ranks
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (fp16 on GPUs)
    json: str = ""  # also write the result as JSON to this path (rank 0)


def parse_args(argv: list[str]) -> Options:
    """key=value arguments (`run=outputs/... prompt="To be"`), each a field of Options."""
    options, kinds = Options(), {f.name: f.type for f in fields(Options)}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in kinds:
            raise ConfigError(f"unknown argument {arg!r}: expected key=value with key one of {', '.join(kinds)}")
        kind = kinds[key]
        try:
            setattr(options, key, kind(value))
        except ValueError:
            raise ConfigError(f"{key}={value} is not a{'n integer' if kind is int else ' number'}") from None
    if not options.run or not options.prompt:
        raise ConfigError('run=RUN_DIR_OR_HF_DIR and prompt="..." are required')
    if options.max_new_tokens < 1 or options.temperature < 0 or options.top_k < 0 or not 0 < options.top_p <= 1:
        raise ConfigError("max_new_tokens must be >= 1, temperature >= 0, top_k >= 0 and top_p in (0, 1]")
    if options.dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype={options.dtype} is not one of {', '.join(TORCH_DTYPES)}")
    return options


def model_directory(source: str) -> Path:
    """A Hugging Face directory as it is; a run or checkpoint exported once under RUN/export/<tag>."""
    path = Path(source)
    if (path / "config.json").is_file():
        return path
    if not path.exists():
        raise ConfigError(f"run={source} does not exist")
    try:
        directory, tag = checkpoint.find(source, path / "checkpoints")
    except ConfigError:
        raise ConfigError(
            f"run={source} is neither a Hugging Face model directory (no config.json) nor a run with a "
            "checkpoint: train with trainer.save_every=N, or point run= at a model directory"
        ) from None
    out = directory.parent / "export" / tag
    with FileLock(str(out) + ".lock"):  # every rank of a launch asks; one exports
        if not (out / "exported").exists():
            from lmrepo.export import export

            export(str(directory / tag), out)
            (out / "exported").write_text(f"{directory / tag}\n")
    return out


def load(model_dir: Path, dtype: torch.dtype):
    """(model, tokenizer, masked): a masked LM (BERT) fills masks, anything else generates."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(model_dir)
        masked = any(a.endswith("ForMaskedLM") for a in config.architectures or []) or config.model_type == "bert"
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model_class = AutoModelForMaskedLM if masked else AutoModelForCausalLM
        model = model_class.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{model_dir}: cannot load the model or its tokenizer ({str(err).splitlines()[0][:200]})"
        ) from None
    return model.eval(), tokenizer, masked


def inference_plan(model, world: int, device_type: str) -> bool:
    """Whether DeepSpeed-Inference injects its kernels (else AutoTP shards), or ConfigError
    with DeepSpeed's reason when neither can run here."""
    from deepspeed.module_inject.auto_tp import AutoTP

    from lmrepo.distributed.tp import autotp_refusal

    kernels = AutoTP.kernel_supported(AutoTP.get_module_list(model))
    if kernels and device_type == "cuda":
        return True
    if device_type == "cpu" and launch.local_size() != world:
        # Its all-reduce runs DeepSpeed's shared-memory kernel unchecked, and that kernel has no
        # buffer unless every rank shares the node: SIGSEGV on every rank (DeepSpeed 0.19.8).
        raise ConfigError(
            f"{world} ranks over several nodes: DeepSpeed-Inference on CPU ranks runs on one node only "
            f"(this one has {launch.local_size() or 'an unknown number of'} of them): launch every rank on one node"
        )
    refusal = autotp_refusal(model)
    if refusal is not None:
        why = (
            "DeepSpeed's inference kernels for it run on GPUs only (the cpu accelerator has no kernel injection)"
            if kernels
            else "DeepSpeed has no inference kernels for it"
        )
        raise ConfigError(
            f"{world} ranks: {type(model).__name__} cannot be split by DeepSpeed-Inference on this "
            f'{device_type} device: {why}, and AutoTP refuses it ("{refusal}"): run it in one process '
            "(python scripts/generate.py ...)"
        )
    heads = model.config.num_attention_heads
    if heads % world:
        raise ConfigError(
            f"AutoTP over {world} ranks needs the {heads} attention heads to divide: use a rank count that "
            f"divides {heads}"
        )
    return False


def sample(model, tokenizer, options: Options, device) -> dict:
    from transformers import set_seed

    inputs = tokenizer(options.prompt, return_tensors="pt").to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = {"do_sample": options.temperature > 0, "pad_token_id": pad}
    if options.temperature > 0:
        settings.update(temperature=options.temperature, top_k=options.top_k or None, top_p=options.top_p)
    else:  # greedy: the model's generation_config may carry sampling defaults that would warn
        settings.update(temperature=None, top_k=None, top_p=None)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, **settings)  # warm-up: first-call allocations stay out of the timing
        set_seed(options.seed)
        start = time.perf_counter()
        output = model.generate(**inputs, max_new_tokens=options.max_new_tokens, **settings)
        seconds = time.perf_counter() - start
    new = output[0, inputs["input_ids"].shape[1] :].tolist()
    return {
        "mode": "generate",
        "prompt": options.prompt,
        "text": tokenizer.decode(new),
        "new_tokens": new,
        "seconds": seconds,
        "tokens_per_s": len(new) / seconds,
        "ms_per_token": 1000 * seconds / len(new),
    }


def fill_mask(model, tokenizer, options: Options, device) -> dict:
    inputs = tokenizer(options.prompt, return_tensors="pt").to(device)
    ids = inputs["input_ids"][0]
    positions = (ids == tokenizer.mask_token_id).nonzero().flatten().tolist()
    if not positions:
        raise ConfigError(
            f"prompt has no {tokenizer.mask_token}: a masked LM fills masks, e.g. "
            f'prompt="the {tokenizer.mask_token} sat on the mat"'
        )
    k = options.top_k or 5
    with torch.no_grad():
        logits = model(**inputs).logits  # warm-up
        start = time.perf_counter()
        for _ in range(TIMED_FORWARDS):
            logits = model(**inputs).logits
        seconds = (time.perf_counter() - start) / TIMED_FORWARDS
    probs = logits[0, positions].float().softmax(-1)
    top = probs.topk(k)
    masks = [
        {"position": pos, "ids": i.tolist(), "tokens": tokenizer.convert_ids_to_tokens(i.tolist()), "probs": p.tolist()}
        for pos, i, p in zip(positions, top.indices, top.values)
    ]
    filled = ids.clone()
    filled[positions] = top.indices[:, 0]
    return {
        "mode": "fill-mask",
        "prompt": options.prompt,
        "text": tokenizer.decode(filled, skip_special_tokens=True),
        "masks": masks,
        "ms_per_forward": 1000 * seconds,
        "tokens_per_s": len(ids) / seconds,
    }


def report(result: dict, world: int) -> None:
    where = f"{world} ranks, DeepSpeed-Inference" if world > 1 else "1 process"
    if result["mode"] == "generate":
        print(result["prompt"] + result["text"])
        print(
            f"lmrepo: {len(result['new_tokens'])} new tokens in {result['seconds']:.3f} s: "
            f"{result['tokens_per_s']:.1f} tokens/s, {result['ms_per_token']:.2f} ms per token ({where})"
        )
        return
    print(result["text"])
    for m in result["masks"]:
        choices = ", ".join(f"{t} {p:.3f}" for t, p in zip(m["tokens"], m["probs"]))
        print(f"  [MASK] at {m['position']}: {choices}")
    print(
        f"lmrepo: fill-mask forward {result['ms_per_forward']:.2f} ms ({result['tokens_per_s']:.0f} tokens/s; {where})"
    )


def run(options: Options) -> dict:
    from deepspeed.accelerator import get_accelerator
    from transformers import set_seed

    world, dtype = launch.world_size(), TORCH_DTYPES[options.dtype]
    device_type = get_accelerator().device_name()
    if dtype == torch.float16 and not get_accelerator().is_fp16_supported():
        raise ConfigError(f"dtype=fp16 is not supported on this {device_type} device: use dtype=bf16 or fp32")
    model_dir = model_directory(options.run)
    set_seed(options.seed)  # weights a directory lacks (an untrained head) are drawn alike on every rank
    model, tokenizer, masked = load(model_dir, dtype)
    if world > 1:
        kernels = inference_plan(model, world, device_type)
        import deepspeed

        if device_type == "cpu":  # DeepSpeed-Inference's all-reduce: the one user of its CPU kernel
            launch.prepare_shm()
        launch.init_distributed(all_reduce_kernel=True)
        model = deepspeed.init_inference(
            model, tensor_parallel={"tp_size": world}, dtype=dtype, replace_with_kernel_inject=kernels
        )
        device = torch.device(get_accelerator().current_device_name())
    else:
        device = torch.device(f"{device_type}:{os.environ.get('LOCAL_RANK', 0)}" if device_type == "cuda" else "cpu")
        model.to(device)
    result = (fill_mask if masked else sample)(model, tokenizer, options, device)
    result.update(world=world, model_dir=str(model_dir))
    return result


def main(argv: list[str]) -> None:
    argv = launch.strip_local_rank_arg(argv)
    rank0 = launch.rank() == 0
    try:
        options = parse_args(argv)
        result = run(options)
    except ConfigError as err:
        exit_error(str(err))
    if rank0:
        report(result, result["world"])
        if options.json:
            Path(options.json).write_text(json.dumps(result, indent=1))
    if result["world"] > 1:
        import torch.distributed as dist

        launch.release_shm_buffer()
        dist.destroy_process_group()
