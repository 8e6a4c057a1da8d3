"""BERT as transformers builds it: masked-LM head tied to the word embeddings."""

from transformers import BertConfig, BertForMaskedLM

LOSS_TYPE = "ForMaskedLM"
MODEL_CLASS = BertForMaskedLM


def hf_config(model) -> BertConfig:
    return BertConfig(
        num_hidden_layers=model.n_layer,
        num_attention_heads=model.n_head,
        hidden_size=model.n_embd,
        intermediate_size=model.n_inner,
        max_position_embeddings=model.n_positions,
        vocab_size=model.vocab_size,
        hidden_dropout_prob=model.dropout,
        attention_probs_dropout_prob=model.dropout,
    )


def dropout_overrides(model) -> dict:
    return {"hidden_dropout_prob": model.dropout, "attention_probs_dropout_prob": model.dropout}
