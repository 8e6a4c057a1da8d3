"""Tensor parallelism as DeepSpeed's AutoTP does it, asked before any process group starts.

AutoTP shards a Hugging Face model two ways: by the `tp_plan` transformers ships for some
families (Llama, ...), else by DeepSpeed's own parser, which finds the row-parallel linears of
each block. The parser refuses models it has a kernel-injection policy for (GPT-2). Both are
pure functions of the module structure, so a model on the meta device answers for the real one.
"""

import torch


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
