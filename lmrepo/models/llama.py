"""Llama as transformers builds it (RMSNorm, rotary positions, SwiGLU MLP, grouped-query
attention), with the GPT-2 BPE vocabulary. Llama is the family DeepSpeed's AutoTP trains
(`tp=auto`): transformers ships a tensor-parallel plan for it, GPT-2 has none."""

from transformers import LlamaConfig, LlamaForCausalLM

from lmrepo.data.tokenizer import end_of_text_id

LOSS_TYPE = "ForCausalLM"
MODEL_CLASS = LlamaForCausalLM


def hf_config(model) -> LlamaConfig:
    return LlamaConfig(
        num_hidden_layers=model.n_layer,
        num_attention_heads=model.n_head,
        num_key_value_heads=model.n_kv_head,
        hidden_size=model.n_embd,
        intermediate_size=model.n_inner,
        max_position_embeddings=model.n_positions,
        vocab_size=model.vocab_size,
        rope_theta=model.rope_theta,
        tie_word_embeddings=model.tie_embeddings,
        attention_dropout=model.dropout,
        # the GPT-2 BPE's one special token <|endoftext|> is begin, end and padding
        bos_token_id=end_of_text_id(model.tokenizer),
        eos_token_id=end_of_text_id(model.tokenizer),
        pad_token_id=end_of_text_id(model.tokenizer),
    )


def dropout_overrides(model) -> dict:
    return {"attention_dropout": model.dropout}
