"""`model`: which transformers architecture is built, its shape, tokenizer and starting weights."""

import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from lmrepo.utils.errors import ConfigError, require
from lmrepo.utils.hub import hub_file, is_hub_id


class Family(StrEnum):
    gpt2 = "gpt2"
    bert = "bert"
    llama = "llama"
    mixtral = "mixtral"


class Balance(StrEnum):
    aux_loss = "aux_loss"
    aux_free = "aux_free"


def aux_loss_weight(moe) -> float:
    """The load-balancing loss's weight (of a MoEConfig, or its node in a composed config):
    aux_loss_coef, or by default 0.01 with balance=aux_loss and 0 with aux_free."""
    if moe.aux_loss_coef is not None:
        return moe.aux_loss_coef
    return 0.0 if str(moe.balance) == Balance.aux_free else 0.01


@dataclass
class MoEConfig:
    """mixtral: the mixture-of-experts MLP (DeepSpeed-MoE, deepspeed.moe.layer.MoE, of SwiGLU experts)."""

    experts: int = 8
    """experts per MoE layer"""
    top_k: int = 2
    """experts each token is routed to; their softmax weights renormalised to sum to 1 (k >= 2, as Mixtral)"""
    every: int = 1
    """every k-th block's MLP is an MoE layer (the others stay dense SwiGLU); 1 = all, as Mixtral"""
    drop_tokens: bool = False
    """drop the tokens past an expert's capacity (Switch/GShard); false = no dropping, exact routing"""
    capacity_factor: float = 1.0
    """with drop_tokens: an expert takes capacity_factor x top_k x tokens / experts tokens per batch"""
    min_capacity: int = 4
    """with drop_tokens: an expert takes at least this many tokens per batch"""
    balance: Balance = Balance.aux_loss
    """how the experts' load is balanced: aux_loss (a load-balancing loss term, Switch/GShard) | aux_free
    (DeepSeek-V3: a per-expert bias on the router's scores that picks the experts, not their weights,
    raised for the underloaded and lowered for the overloaded experts after every step)"""
    bias_update_rate: float = 0.001
    """with balance=aux_free: how far each step moves an expert's bias (DeepSeek-V3's gamma)"""
    aux_loss_coef: Optional[float] = None
    """weight of the load-balancing loss (Switch/GShard) added to the loss that is optimised; null = 0.01
    with balance=aux_loss, 0 with aux_free (DeepSeek-V3 keeps a tiny one: 0.0001)"""
    shared_experts: int = 0
    """experts every token passes through beside its routed ones (DeepSeek-MoE): one SwiGLU MLP
    shared_experts x n_inner wide, added to the routed experts' output"""

    def check(self) -> None:
        require(self.experts >= 2, f"model.moe.experts={self.experts} must be >= 2")
        require(
            1 <= self.top_k <= self.experts,
            f"model.moe.top_k={self.top_k} must be in [1, model.moe.experts={self.experts}]",
        )
        require(self.every >= 1, f"model.moe.every={self.every} must be >= 1")
        require(self.capacity_factor > 0, f"model.moe.capacity_factor={self.capacity_factor} must be > 0")
        require(self.min_capacity >= 0, f"model.moe.min_capacity={self.min_capacity} must be >= 0")
        require(aux_loss_weight(self) >= 0, f"model.moe.aux_loss_coef={self.aux_loss_coef} must be >= 0")
        require(self.bias_update_rate >= 0, f"model.moe.bias_update_rate={self.bias_update_rate} must be >= 0")
        require(self.shared_experts >= 0, f"model.moe.shared_experts={self.shared_experts} must be >= 0")


@dataclass
class ModelConfig:
    family: Family = MISSING
    """architecture: gpt2 (causal LM), bert (masked LM), llama (causal LM: RMSNorm, rotary, SwiGLU), mixtral
    (llama with mixture-of-experts MLPs)"""
    name: str = MISSING
    """the preset's name, for tags and tables"""
    n_layer: int = MISSING
    """transformer blocks"""
    n_head: int = MISSING
    """attention (query) heads per block"""
    n_embd: int = MISSING
    """hidden size (channels)"""
    n_positions: int = MISSING
    """longest sequence in tokens (learned positions; rotary for llama)"""
    vocab_size: int = MISSING
    """embedding rows; at least the tokenizer's size"""
    n_inner: Optional[int] = None
    """MLP width in channels; null = the family's default (4 x n_embd for GPT-2)"""
    n_kv_head: Optional[int] = None
    """llama: key/value heads (grouped-query attention when fewer than n_head); null = n_head"""
    rope_theta: float = 10000.0
    """llama: rotary base"""
    tie_embeddings: bool = True
    """llama: share input and output embeddings (GPT-2 and BERT always do)"""
    dropout: float = 0.0
    """dropout probability; 0 for pretraining (nanoGPT, Llama)"""
    tokenizer: str = "gpt2"
    """gpt2 (GPT-2 BPE), bytes (GPT-2's 256 bytes and <|endoftext|>: set vocab_size=257), bert (uncased WordPiece), or
    any Hugging Face name or path"""
    pretrained: Optional[str] = None
    """a Hugging Face model directory or Hub repository id (owner/name): its architecture and weights replace the
    preset's"""
    zero_init: bool = False
    """ZeRO-3: build the model already partitioned (deepspeed.zero.Init) when it does not fit one rank"""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """mixtral: the mixture-of-experts keys (read by family=mixtral only)"""

    def shape(self) -> dict:
        """The architecture that will be built: the preset's, or the pretrained directory's."""
        shape = {k: getattr(self, k) for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}
        shape["n_kv_head"] = self.n_kv_head or self.n_head
        if self.pretrained is None:
            return shape
        config_file = Path(self.pretrained) / "config.json"
        if is_hub_id(self.pretrained):
            config_file = hub_file(self.pretrained, "config.json")
        require(
            config_file is not None and config_file.is_file(),
            f"model.pretrained={self.pretrained} has no config.json: point it at a Hugging Face model directory "
            "or Hub repository",
        )
        try:
            hf = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"model.pretrained={self.pretrained}: config.json is not valid JSON ({err})") from None
        # transformers builds a family's model from another's config and initializes every weight
        # whose name does not match at random: a silent fresh start the user believes pretrained
        model_type = hf.get("model_type")
        presets = {"gpt2": "model=gpt2", "bert": "model=bert-base", "llama": "model=llama-1b"}
        require(
            model_type in (None, self.family.value) or self.family == Family.mixtral,
            f"model.pretrained={self.pretrained} holds a {model_type} model (its config.json's model_type) and "
            f"model= chose the {self.family.value} family, which would load none of its weights: "
            + (
                f"choose {presets[model_type]} (the directory gives the sizes)"
                if model_type in presets
                else "lmrepo loads gpt2, bert and llama models"
            ),
        )
        names = {
            "n_layer": ("n_layer", "num_hidden_layers"),
            "n_head": ("n_head", "num_attention_heads"),
            "n_embd": ("n_embd", "hidden_size"),
            "n_positions": ("n_positions", "max_position_embeddings"),
            "vocab_size": ("vocab_size",),
        }
        for key, candidates in names.items():
            shape[key] = next((hf[c] for c in candidates if c in hf), shape[key])
        shape["n_kv_head"] = hf.get("num_key_value_heads") or shape["n_head"]
        return shape

    def check(self) -> None:
        for key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
            require(getattr(self, key) >= 1, f"model.{key}={getattr(self, key)} must be >= 1")
        for key in ("n_inner", "n_kv_head"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"model.{key}={value} must be >= 1 (or null)")
        require(0 <= self.dropout < 1, f"model.dropout={self.dropout} must be in [0, 1)")
        require(self.rope_theta > 0, f"model.rope_theta={self.rope_theta} must be > 0")
        if self.family == Family.mixtral:
            self.moe.check()
            require(
                self.pretrained is None,
                f"model.pretrained={self.pretrained}: family=mixtral trains from random init here (loading a "
                "transformers Mixtral directory is not offered): set model.pretrained=null",
            )
        else:
            self.dense_check()
        shape = self.shape()
        require(
            shape["n_embd"] % shape["n_head"] == 0,
            f"model.n_head={shape['n_head']} does not divide model.n_embd={shape['n_embd']}: change one of them",
        )
        require(
            self.pretrained or self.n_kv_head is None or shape["n_head"] % self.n_kv_head == 0,
            f"model.n_kv_head={self.n_kv_head} does not divide model.n_head={shape['n_head']} "
            "(each key/value head serves a group of query heads): change one of them",
        )

    def dense_check(self) -> None:
        """A dense family builds no experts: a model.moe key set on it would train a dense model
        the user believes has experts."""
        default = MoEConfig()
        changed = [
            f"model.moe.{key}={json.dumps(value)}"  # as typed: true, 4, 0.1
            for key, value in vars(self.moe).items()
            if value != getattr(default, key)
        ]
        require(
            not changed,
            f"{changed[0] if changed else ''} configures a mixture of experts, and model.family={self.family} is "
            "dense (only family=mixtral reads the model.moe keys): choose model=mixtral-tiny (or another "
            f"model=mixtral-* preset), or drop {', '.join(changed)}",
        )

    def check_vocab(self, tokenizer_size: int) -> None:
        """The embedding table must cover every id the tokenizer produces."""
        vocab = self.shape()["vocab_size"]
        require(
            vocab >= tokenizer_size,
            f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer_size} "
            f"tokens: set model.vocab_size={tokenizer_size} or change model.tokenizer",
        )
