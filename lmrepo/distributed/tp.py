"""Tensor parallelism (tp=auto), asked before any process group starts: whether the engine can
split this model.

- engine=deepspeed: DeepSpeed's AutoTP shards a Hugging Face model two ways: by the `tp_plan`
  transformers ships for some families (Llama, ...), else by DeepSpeed's own parser, which finds
  the row-parallel linears of each block. The parser refuses models it has a kernel-injection
  policy for (GPT-2).
- engine=fsdp2: torch's ColwiseParallel and RowwiseParallel on the linears the plan transformers
  ships names (`base_model_tp_plan`: Llama's q/k/v/gate/up by columns, o/down by rows). GPT-2 and
  BERT ship none (GPT-2's fused `c_attn` holds q, k and v in one matrix: split by columns, a rank
  would get q and half of k).

  Where it runs (no pipeline), two more splits are on by default, as torchtitan turns them on
  with tensor parallelism: Megatron's sequence parallelism (the norms and the residual stream
  between the split linears split by tokens) and a vocabulary-parallel loss (the LM head split by
  vocabulary, the cross-entropy taken on the split logits).

The questions are pure functions of the module structure, so a model on the meta device answers
for the real one. `parallelize_blocks` (and `parallelize_block`, one pipeline stage's block at a
time) applies torch's plan to a model for the torch engines.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmrepo.models import hf_config, transformer_blocks

# The styles of transformers' plans that torch's ColwiseParallel / RowwiseParallel compute as
# written: each rank's q/k/v columns are whole heads, and transformers' Llama attention views its
# projections as (-1, head_dim), so it runs on the local heads unchanged.
TORCH_STYLES = ("colwise", "rowwise")
BLOCKS = "layers.*."  # the prefix of a plan's entries inside the decoder blocks
# The norms of a Llama decoder layer (transformers 5.23), which sequence parallelism splits by tokens
SEQUENCE_PARALLEL_NORMS = ("input_layernorm", "post_attention_layernorm")


def autotp_refusal(model: torch.nn.Module) -> str | None:
    """DeepSpeed's reason AutoTP cannot shard `model`, or None when it can."""
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    if _get_hf_tp_plan(model):
        return None
    try:
        AutoTP.tp_parser(model)
    except AssertionError as err:
        return str(err)
    return None


def count_every_shard_in_the_norm(ds_engine) -> None:
    """Under AutoTP, the gradient norm DeepSpeed 0.19.8 clips by (and lmrepo logs) in bf16 or fp16
    without ZeRO, through FP16_UnfusedOptimizer (torch's AdamW on a CPU, any optimizer but its
    FusedAdam on a GPU), must count every rank's shards. Its step takes the norm of the gradients
    (moe.utils.split_params_grads_into_shared_and_expert_params hands runtime.utils.get_weight_norm
    `p.grad`, not `p`), and get_weight_norm tells a shard from a replicated tensor by the
    `tensor_model_parallel` attribute AutoTP puts on the parameter: on a gradient it is missing, so
    every tensor-parallel rank but the first left its shards out (llama-tiny on 2 ranks: 21% low).
    Each shard's gradient carries the attribute too, set as autograd accumulates it (DeepSpeed's
    fused optimizer, ZeRO and fp32 read the parameters' own and were right)."""
    if ds_engine.autotp_size() <= 1 or type(ds_engine.optimizer).__name__ != "FP16_UnfusedOptimizer":
        return
    for param in ds_engine.module.parameters():
        if getattr(param, "tensor_model_parallel", False):
            param.register_post_accumulate_grad_hook(_mark_shard_gradient)


def _mark_shard_gradient(param: torch.nn.Parameter) -> None:
    param.grad.tensor_model_parallel = True


def block_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The linears of each transformer block that engine=fsdp2 splits, by their name inside the
    block ("self_attn.q_proj": "colwise"): transformers' `base_model_tp_plan` when it has only
    entries inside the blocks in the styles torch computes as written; {} for a model it has none for."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    inside = {name.removeprefix(BLOCKS): style for name, style in plan.items() if name.startswith(BLOCKS)}
    if len(inside) != len(plan) or any(style not in TORCH_STYLES for style in inside.values()):
        return {}
    return inside


def _splits_more(config) -> bool:
    """Where engine=fsdp2's sequence-parallel norms and vocabulary-parallel loss run: its tensor
    parallelism without a pipeline (a stage would pass token-split activations to the next)."""
    return config.engine.name == "fsdp2" and str(config.tp.mode) == "auto" and config.pipeline.schedule == "none"


def sequence_parallel(config) -> bool:
    """tp.sequence_parallel as the run applies it: null is on where it runs, each sequence splits
    evenly over the tp ranks, and no lm-eval task runs in the loop (its requests have any length,
    and generation feeds one token at a time)."""
    if config.tp.sequence_parallel is not None:
        return config.tp.sequence_parallel
    return _splits_more(config) and config.data.block_size % config.tp.size == 0 and not config.eval.tasks


def loss_parallel(config) -> bool:
    """tp.loss_parallel as the run applies it: null is on where it runs and the LM head's weight is
    its own (not the input embedding's, which stays whole)."""
    if config.tp.loss_parallel is not None:
        return config.tp.loss_parallel
    return _splits_more(config) and not tied_head(config)


def tied_head(config) -> bool:
    """Whether the model's LM head is its input embedding (a pretrained directory's config says)."""
    return bool(hf_config(config.model).tie_word_embeddings)


def parallelize_blocks(
    model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, vocabulary_parallel: bool = False
) -> None:
    """Tensor parallelism, applied before anything else touches the blocks: in each block the
    linears transformers' plan names (lmrepo.distributed.tp.block_tp_plan) split over the tp ranks, column-wise
    (q, k, v, gate, up: each rank computes its own heads and MLP columns) or row-wise (o, down: the
    partial sums reduced). Attention runs on the local heads of whole sequences, so transformers'
    rotary angles and causal mask, computed once before the blocks, serve it unchanged.

    `sequence_parallel` (Megatron's, torchtitan's plan): the residual stream split by tokens from
    the first block's input (a local slice, no traffic) to the final norm, whose output is gathered
    for the head; each norm runs on its rank's tokens. Otherwise the row-wise linears all-reduce
    and every rank holds every token between the blocks' linears.
    `vocabulary_parallel`: the LM head split by vocabulary, its logits left split for torch's
    loss_parallel (FSDP2Engine.loss_context)."""
    plan, blocks = block_tp_plan(model), transformer_blocks(model)
    for block in blocks:
        parallelize_module(block, tp_mesh, block_tp_plan_styles(own_plan(block, plan), sequence_parallel))
    if sequence_parallel:
        split_tokens = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        parallelize_module(blocks[0], tp_mesh, split_tokens)
        final_norm = model.base_model.norm
        parallelize_module(final_norm, tp_mesh, SequenceParallel())
        final_norm.register_forward_hook(_every_token)
    if vocabulary_parallel:
        head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model.get_output_embeddings(), tp_mesh, head)


def _every_token(module, args, output: DTensor) -> torch.Tensor:
    """The final norm's token-split output gathered: the head and the loss see whole sequences."""
    return output.redistribute(placements=[Replicate()]).to_local()


def own_plan(block: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The entries of `plan` this block has: a Mixtral-style block's MLP is a mixture of experts
    (its experts stay whole on every tp rank), not the gate, up and down linears of the plan."""
    names = {name for name, _ in block.named_modules()}
    return {name: style for name, style in plan.items() if name in names}


def block_tp_plan_styles(plan: dict[str, str], sequence_parallel: bool = False) -> dict:
    """torch's styles for one block's `plan` ({name: "colwise" | "rowwise"}). With
    `sequence_parallel`, for Llama's decoder layer (transformers 5.23: its two norms, attention
    called with hidden_states=..., the MLP with it positionally): the norms on token-split input,
    attention and the MLP gathering every token, the row-wise linears reduce-scattering to them. An
    MLP the plan does not split (a mixture of experts) runs whole on every token, and its output is
    sliced back to the rank's tokens (no traffic; in backward the tokens' gradients are gathered)."""
    if not sequence_parallel:
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        return {name: styles[style]() for name, style in plan.items()}
    tokens, whole = Shard(1), Replicate()
    styles = {
        name: ColwiseParallel() if style == "colwise" else RowwiseParallel(output_layouts=tokens)
        for name, style in plan.items()
    }
    gather_attention_input = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": tokens},
        desired_input_kwarg_layouts={"hidden_states": whole},
        use_local_output=True,
    )
    if any(name.startswith("mlp.") for name in plan):
        gather_mlp = PrepareModuleInput(input_layouts=(tokens,), desired_input_layouts=(whole,), use_local_output=True)
    else:  # an MLP left whole: its output sliced back to the rank's tokens
        gather_mlp = PrepareModuleInputOutput(
            input_layouts=(tokens,),
            desired_input_layouts=(whole,),
            use_local_input=True,
            output_layouts=(whole,),
            desired_output_layouts=(tokens,),
            use_local_output=True,
        )
    return {
        **styles,
        **{norm: SequenceParallel() for norm in SEQUENCE_PARALLEL_NORMS},
        "self_attn": gather_attention_input,
        "mlp": gather_mlp,
    }


def parallelize_block(block: torch.nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """One block's linears of `plan` ({name: "colwise" | "rowwise"}) split over the tp ranks."""
    parallelize_module(block, tp_mesh, block_tp_plan_styles(own_plan(block, plan)))
