"""Mixtral-style mixture of experts: Llama blocks (RMSNorm, rotary, grouped-query attention) whose
MLP is a DeepSpeed-MoE layer (deepspeed.moe.layer.MoE) of SwiGLU experts, with softmax top-k
routing renormalised over the chosen experts (DeepSpeed's top-2 and top-k gates do; its top-1 gate
weights the expert by its probability, as Switch does).

DeepSpeed's MoE builds every local expert as a copy of one module; here each expert gets its own
initial weights, drawn from a generator seeded by (seed, layer, global expert index), so the model
is the same function whatever `expert_parallel.size` splits it. The loss that is optimised is
the language-model loss plus `aux_loss_coef` x the sum of the MoE layers' load-balancing losses;
in eval mode the loss is the language-model loss alone (comparable with a dense model's).

DeepSeek-V3's routing is two keys on top: `balance=aux_free` (a per-expert bias on the router's
scores picks the experts; the engines move it after each step from the load the step saw) and
`shared_experts=N` (an MLP every token passes through beside its routed experts)."""

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

from lmrepo.config.model import aux_loss_weight
from lmrepo.models import llama

LOSS_TYPE = "ForCausalLM"


def hf_config(model) -> LlamaConfig:
    """Llama's config with the MoE keys beside it (read by MixtralStyleForCausalLM)."""
    config = llama.hf_config(model)
    config.moe = {
        "experts": model.moe.experts,
        "top_k": model.moe.top_k,
        "every": model.moe.every,
        "drop_tokens": model.moe.drop_tokens,
        "capacity_factor": model.moe.capacity_factor,
        "min_capacity": model.moe.min_capacity,
        "aux_loss_coef": aux_loss_weight(model.moe),
        "balance": str(model.moe.balance),
        "bias_update_rate": model.moe.bias_update_rate,
        "shared_experts": model.moe.shared_experts,
        "expert_parallel_size": 1,  # build_model sets the run's
        "expert_parallel_rank": 0,  # which of them this rank is (it holds that share of the experts)
    }
    return config


dropout_overrides = llama.dropout_overrides


def is_moe_block(index: int, every: int) -> bool:
    """Block `index` (from 0) has an MoE MLP when it is every `every`-th: with every=2 the 2nd,
    4th, ... (as Switch and GShard alternate dense and MoE layers)."""
    return (index + 1) % every == 0


@functools.cache
def _aux_free_gate_class():
    # deepspeed is imported on first use (see MoEMLP)
    from deepspeed.moe.sharded_moe import TopKGate, top1gating, top2gating, topkgating

    class AuxFreeGate(TopKGate):
        """DeepSpeed's top-k gate with DeepSeek-V3's auxiliary-loss-free balancing: the experts a
        token goes to are the top k of softmax(logits) + route_bias, their weights those of the
        softmax alone (renormalised over the kept routes for k >= 2, as DeepSpeed's top-2 and
        top-k gates do; the probability itself for k = 1, as its top-1 gate does). The bias
        carries no gradient; `balance_experts` moves it after each step. DeepSpeed's own gating
        picks the routes from the biased scores (softmax keeps each token's order of them), so
        with a zero bias this is DeepSpeed's gate, its capacity and dropping included, except at
        top_k > 2 with drop_tokens=true: there an expert's capacity keeps the routes of the
        highest biased scores (DeepSpeed's top-k gate: of the highest probabilities)."""

        route_bias: torch.Tensor

        def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
            assert sparse_routes, "DeepSpeed's MOELayer asks its gate for sparse routes"
            logits = nn.functional.linear(input.float(), weight=self.wg.weight.float())
            probs = logits.softmax(dim=1)
            scores = (probs + self.route_bias).detach()
            capacity_factor = self.capacity_factor if self.training else self.eval_capacity_factor
            drop, cap = self.drop_tokens, self.min_capacity
            if self.k == 1:
                routes = top1gating(scores, capacity_factor, cap, used_token, None, drop, self.use_rts,
                                    self.ep_group, True, use_tutel)  # fmt: skip
            elif self.k == 2:
                routes = top2gating(scores, capacity_factor, cap, drop, self.ep_group, False, True)
            else:
                routes = topkgating(scores, self.k, capacity_factor, cap, drop, self.ep_group, sparse_routes=True)
            _, capacity, experts, indices, locations, _, counts = routes
            kept = indices >= 0  # [k, tokens]; a route past its expert's capacity is -1
            weights = probs.t().gather(0, indices.long().clamp(min=0)) * kept
            if self.k > 1:
                weights = weights / weights.sum(0, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
            return self.balance_loss(probs, scores, counts), capacity, experts, indices, locations, weights, counts

        def balance_loss(self, probs, scores, counts) -> torch.Tensor:
            """DeepSpeed's load-balancing loss of these routes: experts x sum(mean probability x
            fraction of the first choices) for k <= 2, of all routes / k for k > 2."""
            experts = probs.shape[1]
            if self.k <= 2:
                chosen = nn.functional.one_hot(scores.argmax(dim=1), experts).float().mean(0)
            else:
                chosen = counts.float() / probs.shape[0] / self.k
            return (probs.mean(0) * chosen).sum() * experts

        def _apply(self, fn, recurse=True):
            # an engine's bf16 casts a module's buffers with its parameters; the bias moves by
            # bias_update_rate a step, finer than bf16 resolves at its size: it stays fp32
            bias = self.route_bias
            super()._apply(fn, recurse)
            self.route_bias = bias.to(self.route_bias.device)
            return self

    return AuxFreeGate


class MoEMLP(nn.Module):
    """One block's MLP as a DeepSpeed-MoE layer (and, with shared experts, a SwiGLU MLP beside
    it). The last training forward's load-balancing loss, routes per expert and dropped routes
    are kept for the metrics line; with balance=aux_free the routes of every training forward
    since the last step are summed in `step_load`."""

    def __init__(self, config: LlamaConfig, layer_index: int):
        # imported here: deepspeed's import announces its accelerator on stdout, which the
        # estimate script (it counts this model's parameters) keeps for its own output
        from deepspeed.moe.layer import MoE

        super().__init__()
        moe = config.moe
        ep_size = moe["expert_parallel_size"]
        self.moe = MoE(
            hidden_size=config.hidden_size,
            expert=LlamaMLP(config),
            num_experts=moe["experts"],
            ep_size=ep_size,
            k=moe["top_k"],
            capacity_factor=moe["capacity_factor"],
            eval_capacity_factor=moe["capacity_factor"],
            min_capacity=moe["min_capacity"],
            drop_tokens=moe["drop_tokens"],
            # Deterministic routing: no random token selection when dropping, no sampled second
            # expert (DeepSpeed's default draws it, which changed a first step by 7e-4).
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        gate = self.moe.deepspeed_moe.gate
        self.aux_free = moe["balance"] == "aux_free"
        if self.aux_free:
            gate.__class__ = _aux_free_gate_class()  # the same gate and router weights, routing by biased scores
            gate.register_buffer("route_bias", torch.zeros(moe["experts"]))  # no "expert" in the name: see below
        # routes per expert since the last step; int64 (counts; no engine casts it to bf16)
        self.register_buffer("step_load", torch.zeros(moe["experts"], dtype=torch.int64), persistent=False)
        # Shared experts: not a sub-module of self.moe, whose keys with "expert" in them DeepSpeed
        # saves in the per-expert files only.
        self.shared = None
        if moe["shared_experts"]:
            shared = copy.copy(config)
            shared.intermediate_size = moe["shared_experts"] * config.intermediate_size
            self.shared = LlamaMLP(shared)
        self._init_weights(config, layer_index)
        self.aux_loss = self.routes = self.dropped = None
        # a torch pipeline's (load-balancing term, routes) of each forward (lmrepo.models.pipe.with_aux_loss)
        self.pipeline_forwards: list[tuple[torch.Tensor, torch.Tensor]] = []
        gate.register_forward_hook(self._count_dropped)

    @torch.no_grad()
    def _init_weights(self, config: LlamaConfig, layer_index: int) -> None:
        """The router from the global generator (every rank draws the same); each expert from its
        own generator, seeded by its global index: this rank holds experts ep_rank x local ...
        (ep_rank + 1) x local - 1."""
        std = config.initializer_range
        self.moe.deepspeed_moe.gate.wg.weight.normal_(0.0, std)
        experts = self.moe.deepspeed_moe.experts.deepspeed_experts
        ep_rank = config.moe["expert_parallel_rank"]
        for local, expert in enumerate(experts):
            index = ep_rank * len(experts) + local
            seed = (torch.initial_seed() * 1_000_003 + layer_index * 1_009 + index) % 2**63
            generator = torch.Generator().manual_seed(seed)
            for param in expert.parameters():
                if not param.is_meta:  # estimate.py's shapes-only model has nothing to draw
                    param.copy_(torch.empty(param.shape).normal_(0.0, std, generator=generator))
        if self.shared is not None:  # from the global generator, as the router: every rank holds it whole
            for param in self.shared.parameters():
                param.normal_(0.0, std)

    @torch.compiler.disable
    def _routed(self, hidden: torch.Tensor):
        """The routed experts, eager under trainer.compile (attention, the norms and a shared
        expert around them compile): DeepSpeed-MoE's dispatch reads the step's capacity on the host
        (a graph break) and its shapes follow each step's expert loads (a recompile). The 2-rank
        composition case of MoE with compile took 28 s for 3 steps with them compiled, 18 eager."""
        return self.moe(hidden)

    def _count_dropped(self, gate, inputs, output) -> None:
        # MOELayer asks its gate for sparse routes: (l_aux, capacity, experts, indices, ...); a
        # route that did not fit its expert's capacity has index -1.
        if self.training:
            self.dropped = (output[3] < 0).sum()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out, aux_loss, routes = self._routed(hidden)
        if self.training:
            self.aux_loss, self.routes = aux_loss, routes
            if self.aux_free:
                # a checkpointed block counts its recompute too: twice each route of the layer,
                # which moves no expert's bias the other way (the update reads the sign only)
                self.step_load.add_(routes.to(self.step_load.device))
        if self.shared is not None:
            out = out + self.shared(hidden)
        return out


@functools.cache
def _experts_by_global_index_class():
    from deepspeed.moe.experts import Experts

    class ExpertsByGlobalIndex(Experts):
        """DeepSpeed's experts of one MoE layer, this rank's share of them held under their global
        indices (a ModuleDict): their parameters' names are those of the model with every expert on
        one rank, which DCP saves and loads by, whatever expert_parallel.size splits them."""

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            chunks = inputs.chunk(self.num_local_experts, dim=1)
            experts = self.deepspeed_experts.values()
            return torch.cat([expert(chunk) for chunk, expert in zip(chunks, experts, strict=True)], dim=1)

    return ExpertsByGlobalIndex


def place_experts(model: nn.Module, ep_group: dist.ProcessGroup) -> list[nn.Module]:
    """Expert parallelism over a torch mesh (engine=fsdp2): each MoE layer dispatches its tokens to
    the ranks of `ep_group` and back with DeepSpeed's all-to-all (its MOELayer takes the group it
    is given), and names its experts by their global index. Returns each layer's experts module,
    for FSDP2 to shard over the ranks that hold the same experts. The model was built with this
    rank's share (build_model's expert_parallel_size and _rank)."""
    ep_rank = model.config.moe["expert_parallel_rank"]
    placed = []
    for mlp in model.moe_layers():
        layer = mlp.moe.deepspeed_moe
        experts = layer.experts
        local = list(experts.deepspeed_experts)
        first = ep_rank * len(local)  # as _init_weights numbers them
        experts.deepspeed_experts = nn.ModuleDict({str(first + i): expert for i, expert in enumerate(local)})
        experts.__class__ = _experts_by_global_index_class()
        layer._set_ep_group(ep_group)
        placed.append(experts)
    return placed


class MoEDecoderLayer(LlamaDecoderLayer):
    """A Llama block whose MLP is an MoEMLP. Checkpointed, it returns the MLP's load-balancing loss
    from the checkpoint beside the hidden states, as Megatron-DeepSpeed's checkpointed MoE layers
    return theirs: DeepSpeed's checkpoint (checkpointing.impl=deepspeed) is reentrant, runs the block
    under no_grad and back-propagates only into the tensors it returns, so the loss the MLP kept
    from that forward would give the router no gradient (the model trained without load balancing,
    whatever model.moe.aux_loss_coef said). torch's non-reentrant checkpoint takes the same path."""

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        block = super().forward  # LlamaDecoderLayer's; it leaves a subclass's block to the subclass
        if not (self.gradient_checkpointing and self.training):
            return block(hidden_states, **kwargs)

        def block_and_aux_loss(hidden: torch.Tensor):
            return block(hidden, **kwargs), self.mlp.aux_loss  # in the recompute too: the loss it made

        hidden_states, self.mlp.aux_loss = self._gradient_checkpointing_func(block_and_aux_loss, hidden_states)
        return hidden_states


# transformers wraps every layer class's forward in its own checkpointing (GradientCheckpointingLayer);
# this one checkpoints itself, so that the aux loss is one of the checkpoint's outputs.
MoEDecoderLayer.forward = MoEDecoderLayer.forward.__wrapped__


class MixtralStyleForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with MoEMLP in every `every`-th block; its loss adds the load-balancing term."""

    # the blocks kept whole when the model is split (engine=fsdp2 shards, splits and compiles by them)
    _no_split_modules = ["LlamaDecoderLayer", "MoEDecoderLayer"]

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            if is_moe_block(index, config.moe["every"]):
                layer.mlp = MoEMLP(config, index)
                layer.__class__ = MoEDecoderLayer  # the same block and weights, checkpointed as an MoE block
        self.aux_loss_coef = config.moe["aux_loss_coef"]
        self.bias_update_rate = config.moe["bias_update_rate"]
        self.last_aux_loss = None

    def moe_layers(self) -> list[MoEMLP]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEMLP)]

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        if output.loss is not None:
            output.loss = self.with_aux_loss(output.loss)
        return output

    def with_aux_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss optimised, from the language-model `loss` of this forward: in training it adds
        aux_loss_coef x the MoE layers' load-balancing losses (lmrepo's own loss, which replaces
        `forward` for the tiled or vocabulary-parallel loss, calls this too)."""
        if not self.training:
            return loss
        aux = self.aux_loss_coef * torch.stack([mlp.aux_loss for mlp in self.moe_layers()]).sum()
        self.last_aux_loss = aux.detach()
        return loss + aux.to(loss.dtype)


MODEL_CLASS = MixtralStyleForCausalLM


@torch.no_grad()
def balance_experts(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """balance=aux_free, after each optimizer step: balance_layers over the whole model's MoE layers.
    Nothing otherwise."""
    if isinstance(model, MixtralStyleForCausalLM) and model.config.moe["balance"] == "aux_free":
        layers = model.moe_layers()
        experts, device = model.config.moe["experts"], layers[0].step_load.device
        balance_layers(dict(enumerate(layers)), len(layers), experts, model.bias_update_rate, device, group)


@torch.no_grad()
def balance_layers(
    layers: dict[int, MoEMLP],
    rows: int,
    experts: int,
    rate: float,
    device,
    group: dist.ProcessGroup | None = None,
    step_loads: dict[int, torch.Tensor] | None = None,
) -> None:
    """DeepSeek-V3's update of the router biases (balance=aux_free), after each optimizer step: each
    MoE layer's routes per expert over the step's micro batches and the ranks of `group` (default
    every rank; a collective: each calls it, with the same `rows`), and + `rate` for an expert
    below the layer's mean load, - for one above. `layers`: this rank's MoE layers by their row
    among the model's `rows` (a pipeline stage holds some of them, or none; the others' rows are
    zeros here and summed in); `step_loads` their routes of the step where not their step_load.
    Every rank computes the same bias from the same sums."""
    loads = torch.zeros(rows, experts, dtype=torch.int64, device=device)
    for row, mlp in layers.items():
        loads[row] = mlp.step_load if step_loads is None else step_loads[row]
    if dist.is_initialized():
        dist.all_reduce(loads, group=group)
    for row, mlp in layers.items():
        load = loads[row].double()
        bias = mlp.moe.deepspeed_moe.gate.route_bias
        bias += rate * torch.sign(load.mean() - load).to(bias)
        mlp.step_load.zero_()


def moe_record(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict:
    """The metrics-line figures of the whole model's last training forward (layers_record), over
    the ranks of `group` (default: every rank; a collective). {} for a dense model."""
    if not isinstance(model, MixtralStyleForCausalLM) or model.last_aux_loss is None:
        return {}
    layers = model.moe_layers()
    device = model.last_aux_loss.device  # the backend's device (NCCL reduces CUDA tensors only)
    return layers_record(dict(enumerate(layers)), len(layers), model.config.moe, device, group)


def layers_record(
    layers: dict[int, MoEMLP],
    rows: int,
    moe: dict,
    device,
    group: dist.ProcessGroup | None = None,
    replicas: int | None = None,
    copies: int = 1,
) -> dict:
    """The metrics-line figures of the last training forward of the MoE layers `layers` (this
    rank's, by their row among the model's `rows`; a pipeline stage holds some, or none), over the
    ranks of `group` (default: every rank; a collective: each calls it): the load-balancing term
    added to the loss (the mean over the `replicas` ranks that hold each layer: default all of
    `group`), routes per expert summed over the layers and ranks (`copies`: how many ranks route
    the same tokens, a tensor-parallel group, counted once), the busiest expert's load over the
    mean in the least balanced layer (1 = balanced), and with token dropping the fraction of
    routes dropped. `moe`: the model's keys (its transformers config's `moe`)."""
    experts = moe["experts"]
    packed = torch.zeros(2 + rows * experts, dtype=torch.float64, device=device)
    for row, mlp in layers.items():
        packed[0] += moe["aux_loss_coef"] * mlp.aux_loss.detach().double()
        packed[1] += mlp.dropped.double()
        packed[2 + row * experts : 2 + (row + 1) * experts] = mlp.routes.double()
    world = 1
    if dist.is_initialized():
        world = dist.get_world_size(group)
        dist.all_reduce(packed, group=group)
    aux, dropped, routes = packed[0] / (replicas or world), packed[1] / copies, packed[2:].view(rows, experts) / copies
    record = {
        "aux_loss": aux.item(),
        "expert_tokens": [int(n) for n in routes.sum(0).tolist()],
        "expert_load_max": (routes.max(1).values / routes.mean(1)).max().item(),
    }
    if moe["drop_tokens"]:
        record["dropped_frac"] = (dropped / routes.sum()).item()
    return record


def to_transformers_mixtral(model: MixtralStyleForCausalLM):
    """The same function as transformers' MixtralForCausalLM (what scripts/export_hf.py writes):
    Mixtral has an MoE MLP in every block and renormalises the top-k weights for any k, so
    model.moe.every must be 1 and model.moe.top_k >= 2 (DeepSpeed's top-1 gate weights the expert
    by its probability, Mixtral's by 1). Each expert's gate and up projections become one row of
    `gate_up_proj`, its down projection one of `down_proj`; the router's matrix is `gate.weight`."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from lmrepo.utils.errors import ConfigError

    config, moe = model.config, model.config.moe
    if moe["balance"] == "aux_free" or moe["shared_experts"]:
        raise ConfigError(
            "transformers' Mixtral has no router bias and no shared experts: this run's "
            f"model.moe.balance={moe['balance']}, model.moe.shared_experts={moe['shared_experts']} has no Mixtral "
            "form; scripts/evaluate.py still evaluates it (in memory)"
        )
    if moe["every"] != 1 or moe["top_k"] < 2:
        raise ConfigError(
            f"transformers' Mixtral has an MoE MLP in every block and renormalises its top-k weights: this run's "
            f"model.moe.every={moe['every']}, model.moe.top_k={moe['top_k']} has no Mixtral form (it needs every=1 "
            "and top_k >= 2); scripts/evaluate.py still evaluates it (in memory)"
        )
    mixtral = MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=config.rope_parameters,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_dropout=config.attention_dropout,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        num_local_experts=moe["experts"],
        num_experts_per_tok=moe["top_k"],
        router_aux_loss_coef=moe["aux_loss_coef"],
    )
    state = {}
    for name, tensor in model.state_dict().items():
        if ".mlp.moe." not in name:
            state[name] = tensor
    for index, layer in enumerate(model.model.layers):
        prefix, moe_layer = f"model.layers.{index}.mlp.", layer.mlp.moe.deepspeed_moe
        experts = moe_layer.experts.deepspeed_experts
        state[prefix + "gate.weight"] = moe_layer.gate.wg.weight
        state[prefix + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts]
        )
        state[prefix + "experts.down_proj"] = torch.stack([e.down_proj.weight for e in experts])
    out = MixtralForCausalLM(mixtral)
    missing, unexpected = out.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(f"the Mixtral form does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    out.tie_weights()
    return out.eval()
