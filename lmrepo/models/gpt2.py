"""GPT-2 as transformers builds it: a causal LM with tied input/output embeddings."""

from transformers import GPT2Config, GPT2LMHeadModel

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
    )


def dropout_overrides(model) -> dict:
    return {"resid_pdrop": model.dropout, "embd_pdrop": model.dropout, "attn_pdrop": model.dropout}
