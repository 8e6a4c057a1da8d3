"""GPT-2 as transformers builds it: a causal LM with tied input/output embeddings.

Its MLP's activation is GELU's tanh approximation, which GPT-2's configs name `gelu_new`: in
transformers an elementwise formula of eight kernels a call. `gelu_pytorch_tanh` is the same
function as one fused kernel (torch's `gelu(approximate="tanh")`), equal within float rounding
(tests/test_train.py): lmrepo builds GPT-2 with it, and gives a pretrained GPT-2 it too."""

from transformers import GPT2Config, GPT2LMHeadModel
from transformers.activations import ACT2FN

from lmrepo.data.tokenizer import end_of_text_id

LOSS_TYPE = "ForCausalLM"
MODEL_CLASS = GPT2LMHeadModel


def hf_config(model) -> GPT2Config:
    return GPT2Config(
        n_layer=model.n_layer,
        n_head=model.n_head,
        n_embd=model.n_embd,
        n_positions=model.n_positions,
        vocab_size=model.vocab_size,
        resid_pdrop=model.dropout,
        embd_pdrop=model.dropout,
        attn_pdrop=model.dropout,
        activation_function=FUSED_GELU,
        bos_token_id=end_of_text_id(model.tokenizer),
        eos_token_id=end_of_text_id(model.tokenizer),
    )


FUSED_GELU = "gelu_pytorch_tanh"


def prepare(net: GPT2LMHeadModel) -> None:
    """A model loaded with `gelu_new` (GPT-2's own checkpoints) computes it fused from now on."""
    if net.config.activation_function == "gelu_new":
        net.config.activation_function = FUSED_GELU
        for block in net.transformer.h:
            block.mlp.act = ACT2FN[FUSED_GELU]


def dropout_overrides(model) -> dict:
    return {"resid_pdrop": model.dropout, "embd_pdrop": model.dropout, "attn_pdrop": model.dropout}
