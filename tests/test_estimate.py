"""The pre-flight estimator: formulas against hand-computed values and the worked examples of the
training-performance arithmetic (8TP/(nX)), exact parameter counts against transformers,
model-state memory against the ZeRO paper and DeepSpeed's own estimators, and
scripts/estimate.py as a user runs it."""

import importlib.util
import subprocess

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from harness import FORKED_PYTHON, REPO
from lmrepo import estimate
from lmrepo.models import meta_model
from lmrepo.observability.metrics import executed_flops_per_token, flops_per_token, peak_tflops
from lmrepo.plan.compose import compose_config, load_config

PRESETS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
# The well-known totals of the GPT-2 checkpoints as transformers counts them (tied head once).
PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}
DAY = 86400


def test_parameter_formula_gpt2_124m():
    # 12*12*768^2 + 13*12*768 + (50257 + 1024)*768, computed by hand.
    hand = 84_934_656 + 119_808 + 39_383_808
    assert estimate.formula_parameters(12, 768, 50257, 1024) == pytest.approx(hand, abs=1e-3)
    # The formula leaves out GPT-2's final layer norm (weight and bias, 2h).
    assert PUBLISHED["gpt2"] - 124_438_272 == 2 * 768


def test_flops_per_token_gpt2_124m():
    # Forward per token: per layer QKV 6h^2, scores and weighted values 4sh, projection 2h^2, MLP 16h^2;
    # logits 2hV. Backward is twice the forward; recomputation reruns the layers' forward once more.
    layers = 12 * (24 * 768**2 + 4 * 1024 * 768)  # 207,618,048
    logits = 2 * 768 * 50257  # 77,194,752
    assert layers == 207_618_048 and logits == 77_194_752
    assert flops_per_token(12, 768, 1024, 50257, recompute=False) == pytest.approx(3 * (layers + logits), rel=1e-12)
    assert flops_per_token(12, 768, 1024, 50257, recompute=True) == pytest.approx(4 * layers + 3 * logits, rel=1e-12)
    assert executed_flops_per_token(12, 768, 1024, 50257, 0) == pytest.approx(3 * (layers + logits), rel=1e-12)
    assert executed_flops_per_token(12, 768, 1024, 50257, 12) == pytest.approx(4 * layers + 3 * logits, rel=1e-12)
    assert executed_flops_per_token(12, 768, 1024, 50257, 6) == pytest.approx(3.5 * layers + 3 * logits, rel=1e-12)


def test_worked_18b_example():
    """The training-performance arithmetic's worked example (after Narayanan et al. 2021): l=40,
    h=6144, V=50257 and s=1048 (sic) give 18,437,806,080 parameters; batch 512 on 16 GPUs at
    32.09 s per iteration is 157.7296879710454 TFLOP/s per GPU, 50.554% of the A100's 312; 300B
    tokens then take 203 days (rounded). The example writes T = 300*10e09 and divides by
    PF*10e12: both are 10x too large and cancel."""
    l, h, V, s = 40, 6144, 50257, 1048
    assert int(estimate.formula_parameters(l, h, V, s)) == 18_437_806_080
    tflops = 512 * s * flops_per_token(l, h, s, V, recompute=True) / 32.09 / 16 / 1e12
    assert tflops == pytest.approx(157.7296879710454, rel=1e-12)
    peak = peak_tflops("NVIDIA A100-SXM4-80GB", "bf16", None)
    assert peak == 312.0
    assert 100 * tflops / peak == pytest.approx(50.55438717020686, rel=1e-12)
    P = estimate.formula_parameters(l, h, V, s)
    assert round(estimate.train_seconds(300e9, P, 16, tflops, recompute=True) / DAY) == 203
    # ...and its GPT-3 example: 175B parameters, 300B tokens, 1024 GPUs at 140 TFLOP/s: 34 days.
    assert round(estimate.train_seconds(300e9, 175e9, 1024, 140, recompute=True) / DAY) == 34


def test_train_seconds_and_mfu_arithmetic():
    # 6*T*P/(n*X) without recomputation: 6 * 1e9 * 1e8 / (2 * 100e12) = 3000 s.
    assert estimate.train_seconds(1e9, 1e8, 2, 100, recompute=False) == pytest.approx(3000)
    assert estimate.train_seconds(1e9, 1e8, 2, 100, recompute=True) == pytest.approx(4000)
    # MFU against an overridden peak: the override wins over the device table (and the CPU's unknown peak).
    assert peak_tflops("cpu", "bf16", None) is None
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16", 400.0) == 400.0
    tokens_per_s = 1e5
    model_tflops = tokens_per_s * flops_per_token(12, 768, 1024, 50257, recompute=False) / 1e12
    assert model_tflops / peak_tflops("cpu", "bf16", 400.0) == pytest.approx(85.4438400 / 400, rel=1e-9)


@pytest.mark.parametrize("preset", PRESETS)
def test_exact_parameters_of_every_preset(preset):
    cfg = compose_config([f"model={preset}"])
    model = meta_model(cfg.model)
    counted = estimate.count_parameters(model)
    # Unique by identity over all parameter references: the tied LM head is the embedding itself.
    unique = {id(p): p.numel() for _, p in model.named_parameters(remove_duplicate=False)}
    assert counted == sum(unique.values())
    m = cfg.model
    tied = m.family not in ("llama", "mixtral") or m.tie_embeddings
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    l, h, V, s = m.n_layer, m.n_embd, m.vocab_size, m.n_positions
    if m.family == "llama":
        # q and o are h x h, k and v h x (kv heads x head size), SwiGLU's three h x n_inner, two
        # RMSNorms per layer and a final one; no biases, rotary positions have no parameters.
        kv = m.n_kv_head * (h // m.n_head)
        expected = l * (2 * h * h + 2 * h * kv + 3 * h * m.n_inner + 2 * h) + V * h * (1 if tied else 2) + h
    elif m.family == "mixtral":
        # llama's blocks with every MLP an MoE layer: the experts' SwiGLU matrices and a router h x experts
        kv = m.n_kv_head * (h // m.n_head)
        experts = m.moe.experts * 3 * h * m.n_inner + h * m.moe.experts
        expected = l * (2 * h * h + 2 * h * kv + experts + 2 * h) + V * h * (1 if tied else 2) + h
    elif m.family == "gpt2":
        expected = round(estimate.formula_parameters(l, h, V, s)) + 2 * h  # + final layer norm
    else:
        # BERT: the same blocks (n_inner = 4h) and embeddings, plus 2 token types, the embedding
        # norm, and the MLM head's dense h x h, its norm and the decoder bias.
        assert m.n_inner == 4 * h
        expected = l * (12 * h * h + 13 * h) + (V + s + 2) * h + 2 * h + (h * h + h) + 2 * h + V
    assert counted == expected
    if preset in PUBLISHED:
        assert counted == PUBLISHED[preset]


def test_largest_module_is_the_token_embedding():
    model = meta_model(compose_config(["model=gpt2"]).model)
    assert estimate.largest_module_parameters(model) == 50257 * 768


def test_model_states_zero_paper_figure_1():
    """ZeRO (Rajbhandari et al. 2020) Fig. 1: 7.5B parameters, 64 ranks, K=12: 120, 31.4, 16.6 and
    1.9 GB per device for the baseline and stages 1, 2, 3."""
    psi = 7.5e9
    gb = [estimate.model_state_bytes(psi, stage, 64).gpu / 1e9 for stage in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)
    # The paper's rule: stage 1 cuts model states 4x, stage 2 8x (many ranks); stage 3 by the rank count.
    many = [estimate.model_state_bytes(psi, stage, 10**6).gpu for stage in range(4)]
    assert many[0] / many[1] == pytest.approx(4, rel=1e-4) and many[0] / many[2] == pytest.approx(8, rel=1e-4)
    assert estimate.model_state_bytes(psi, 3, 64).gpu == pytest.approx(16 * psi / 64)


def test_moe_states_split_the_experts_over_the_expert_parallel_ranks():
    """DeepSpeed-MoE: expert_parallel.size=1 is the dense arithmetic of the whole model; each rank
    holds 1/ep of the experts, and ZeRO partitions their states over the dp/ep ranks holding them."""
    from lmrepo.plan.compose import load_config

    model = load_config(["model=mixtral-1b"]).model
    experts, params = estimate.expert_parameters(model), estimate.count_parameters(meta_model(model))
    assert experts == 16 * 8 * 3 * 1024 * model.n_inner and 0 < experts < params
    assert estimate.expert_parameters(load_config([]).model) == 0
    for stage in range(3):
        whole = estimate.model_state_bytes(params, stage, 8).gpu
        assert estimate.moe_state_bytes(params, experts, stage, 8, 1).gpu == pytest.approx(whole)
    # ZeRO-0: the dense part whole (16 bytes), the experts' 16 bytes over ep ranks
    zero0 = estimate.moe_state_bytes(params, experts, 0, 8, 4).gpu
    assert zero0 == pytest.approx(16 * (params - experts + experts / 4))
    # ZeRO-2 with ep = dp: every expert on one rank, its states unpartitioned
    dense = estimate.model_state_bytes(params - experts, 2, 8).gpu
    assert estimate.moe_state_bytes(params, experts, 2, 8, 8).gpu == pytest.approx(dense + 16 * experts / 8)


def test_model_states_offload_placement():
    P, N = 1_000_000, 8
    assert estimate.model_state_bytes(P, 1, N, "cpu") == estimate.ModelStates(gpu=4 * P, cpu=16 * P / N, nvme=0)
    assert estimate.model_state_bytes(P, 2, N, "cpu") == estimate.ModelStates(gpu=2 * P, cpu=16 * P / N, nvme=0)
    assert estimate.model_state_bytes(P, 3, N, "cpu") == estimate.ModelStates(gpu=0, cpu=18 * P / N, nvme=0)
    assert estimate.model_state_bytes(P, 3, N, "cpu", offload_params=False) == estimate.ModelStates(
        gpu=2 * P / N, cpu=16 * P / N, nvme=0
    )
    assert estimate.model_state_bytes(P, 3, N, "nvme") == estimate.ModelStates(gpu=0, cpu=4 * P / N, nvme=14 * P / N)
    # fp32: 4 + 4 + 8 at stage 0; DeepSpeed's ZeRO-1/2 optimizer adds its own fp32 partition copy.
    assert estimate.model_state_bytes(P, 0, N, dtype="fp32").gpu == 16 * P
    assert estimate.model_state_bytes(P, 2, N, dtype="fp32").gpu == 4 * P + 16 * P / N
    assert estimate.model_state_bytes(P, 3, N, dtype="fp32").gpu == 16 * P / N
    for stage, offload, params in ((0, "cpu", None), (2, "nvme", None), (2, "cpu", True)):
        with pytest.raises(ValueError):
            estimate.model_state_bytes(P, stage, N, offload, params)


def test_zero12_gradient_layout_by_hand():
    # One group of 6 + 2 elements over 2 ranks: partitions [0, 4) and [4, 8); the 6-element tensor
    # straddles the boundary and is held whole on both ranks. A second group of 2: padded to 4, rank 1's half empty.
    assert estimate.zero12_gradient_elements([[6, 2], [2]], 2) == [6 + 2, 6 + 2 + 0]
    assert estimate.zero12_gradient_elements([[2, 2, 2, 2]], 2) == [4, 4]  # no tensor straddles: the division
    assert estimate.zero12_gradient_elements([[16]], 4) == [16] * 4  # one tensor: whole on every rank
    assert estimate.zero12_gradient_elements([[10]], 4) == [10, 10, 10, 0]  # padded to 16: the last part is padding
    params, groups = 8, [[6, 2]]
    # bf16 ZeRO-2 over 2 ranks: 2 bytes/param of parameters, 12/dp optimizer, gradients 2 x held (6, then 6 + 2).
    assert estimate.zero12_model_state_bytes(params, groups, 2, 2) == [2 * 8 + 2 * 6 + 12 * 4, 2 * 8 + 2 * 8 + 12 * 4]
    with pytest.raises(ValueError):
        estimate.zero12_model_state_bytes(params, groups, 3, 2)


@pytest.mark.parametrize("dp", [2, 3, 8])
def test_zero12_gradient_layout_matches_deepspeed_partition_info(dp):
    """The same partitions DeepSpeed's ZeRO-1/2 optimizer computes (`get_partition_info` over the
    group flattened and padded to a multiple of 2 x dp, split in dp equal parts), on the real
    parameter groups of two presets: the tiny one (the embedding is 80% of it) and GPT-2 124M."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for preset in ("gpt2-tiny", "gpt2"):
        groups = estimate.optimizer_group_sizes(meta_model(compose_config([f"model={preset}"]).model))
        theirs = [0] * dp
        for sizes in groups:
            tensors = [torch.empty(n, device="meta") for n in sizes]
            padded = -(-sum(sizes) // (2 * dp)) * 2 * dp
            for rank in range(dp):
                inside, _, _ = DeepSpeedZeroOptimizer.get_partition_info(None, tensors, padded // dp, rank)
                theirs[rank] += sum(t.numel() for t in inside)
        assert estimate.zero12_gradient_elements(groups, dp) == theirs
        assert max(theirs) > sum(map(sum, groups)) / dp  # whole tensors: more than the division somewhere


# DeepSpeed's estimators against ours. Their GPU figures add transients ours leave out on purpose
# (steady state, ZeRO paper): the fp32 copy of the gradient partition the optimizer step makes
# without offload (stage_1_and_2.py: `single_partition_of_fp32_groups[i].grad`; 4 bytes/param/dp on
# top of our 16-bit partition at ZeRO-2; in place of it, +2, at ZeRO-3) and at ZeRO-3 the gathered
# largest module (4 bytes: its 16-bit parameters and gradients). Their host figures are per node,
# times additional_buffer_factor=1.5 (a safety margin for pinned buffers and fragmentation), and
# without zero_init include the full fp32 model every local rank builds in host memory before it
# is partitioned (4 bytes/param per rank; ZeRO-2's version counts all ranks of all nodes).
P, LARGEST, BUFFER = 1_557_611_200, 80_411_200, 1.5


@pytest.mark.parametrize("gpus_per_node", [1, 2, 8])
def test_matches_deepspeed_zero2(gpus_per_node):
    N = gpus_per_node
    ours = estimate.model_state_bytes(P, 2, N)
    cpu, gpu = estimate_zero2_model_states_mem_needs(P, gpus_per_node, 1, cpu_offload=False)
    assert gpu == pytest.approx(ours.gpu + 4 * P / N, abs=1)
    assert ours.cpu == 0 and cpu == pytest.approx(BUFFER * 4 * P * gpus_per_node)
    ours = estimate.model_state_bytes(P, 2, N, "cpu")
    cpu, gpu = estimate_zero2_model_states_mem_needs(P, gpus_per_node, 1, cpu_offload=True)
    assert gpu == pytest.approx(ours.gpu, abs=1)
    assert cpu == pytest.approx(BUFFER * max(ours.cpu * gpus_per_node, 4 * P * N), abs=1)


@pytest.mark.parametrize("nodes,gpus_per_node", [(1, 1), (1, 8), (2, 8), (8, 8)])
@pytest.mark.parametrize("zero_init", [True, False])
def test_matches_deepspeed_zero3(nodes, gpus_per_node, zero_init):
    N = nodes * gpus_per_node
    init_copy = 0 if zero_init else 4 * P * gpus_per_node
    for offload, params in (("none", False), ("cpu", True), ("cpu", False)):
        ours = estimate.model_state_bytes(P, 3, N, offload, params)
        cpu, gpu, largest_memory = estimate_zero3_model_states_mem_needs(
            P,
            LARGEST,
            gpus_per_node,
            nodes,
            cpu_offload=offload == "cpu",
            cpu_offload_params=params,
            zero_init=zero_init,
        )
        assert largest_memory == 4 * LARGEST
        fp32_grads = 2 * P / N if offload == "none" else 0
        assert gpu == pytest.approx(ours.gpu + 4 * LARGEST + fp32_grads, abs=1), offload
        if offload == "none":
            # Their host figure is then only the model construction: the largest module with zero_init.
            assert cpu == pytest.approx(BUFFER * (4 * LARGEST * gpus_per_node if zero_init else init_copy))
        else:
            assert cpu == pytest.approx(BUFFER * max(ours.cpu * gpus_per_node, init_copy), abs=1), offload


def test_activation_memory_gpt2():
    # Korthikanti eq. 1, s=1024, b=4, h=768, a=12: sbh = 3,145,728; 34 + 5*12*1024/768 = 114.
    per_layer = 3_145_728 * 114
    assert estimate.activation_bytes_per_layer(1024, 4, 768, 12) == pytest.approx(per_layer)
    output = 4 * 3_145_728 * (1 + 50257 / 768)  # layer norm + projection inputs, fp32 logits
    assert estimate.activation_bytes(12, 768, 12, 50257, 1024, 4) == pytest.approx(12 * per_layer + output)
    # Full checkpointing: each layer keeps its 16-bit input (2sbh) and one layer is live in recompute.
    full = estimate.activation_bytes(12, 768, 12, 50257, 1024, 4, checkpointed_layers=12)
    assert full == pytest.approx(12 * 2 * 3_145_728 + per_layer + output)
    half = estimate.activation_bytes(12, 768, 12, 50257, 1024, 4, checkpointed_layers=6)
    assert half == pytest.approx(6 * per_layer + 6 * 2 * 3_145_728 + per_layer + output)
    ckpt = compose_config(["model=gpt2", "checkpointing=every_n", "checkpointing.every_n_layers=5"]).checkpointing
    assert estimate.checkpointed_layers(12, ckpt) == 3


SMALL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64", "data.block_size=32"]


@pytest.mark.parametrize(
    "family", [["model=llama-tiny", "model.n_kv_head=2", "model.n_inner=176"], ["model=gpt2-tiny"], ["model=bert-tiny"]]
)
def test_activations_counted_on_fake_tensors_are_a_real_forwards(family):
    """What a real CPU forward of the model train.py builds (and of its pipeline layers) saves for
    backward, counted by lmrepo.observability.saved_activations, equals estimate.counted_activations' count of
    the same forward on fake tensors, to the byte: block by block, before and after the blocks."""
    import torch

    from lmrepo.engines.torch_pipeline import build_layer
    from lmrepo.models import build_model, pipe, transformer_blocks
    from lmrepo.observability.saved_activations import SavedActivations

    config = load_config([*family, *SMALL, "precision=fp32"])
    torch.manual_seed(0)
    net = build_model(config.model, config.trainer.loss_tiles)
    ids = torch.randint(0, net.config.vocab_size, (2, 32))
    after = []
    hooks = [b.register_forward_hook(lambda *_: after.append(saved.live)) for b in transformer_blocks(net)]
    with SavedActivations() as saved:
        loss = net(input_ids=ids, labels=ids).loss
        after.append(saved.live)
    for hook in hooks:
        hook.remove()
    loss.backward()
    assert saved.live == 0  # released with the graph
    count = estimate.counted_activations(config.model, 2, 32, "fp32", loss_tiles=config.trainer.loss_tiles)
    block = after[1] - after[0]
    assert (count.block, count.first, count.last) == (block, after[0] - block, after[2] - after[1])

    held = []
    with SavedActivations() as saved:
        hidden = ids
        for spec in pipe.pipeline_layers(net, config.model.family):
            hidden = build_layer(spec)(hidden)
            held.append(saved.live)
        loss = pipe.LMLoss(config.model.family, net.config.vocab_size)(hidden, ids)
        held.append(saved.live)
    pipelined = estimate.counted_activations(config.model, 2, 32, "fp32", pipelined=True)
    assert (pipelined.block, pipelined.first, pipelined.last) == (held[2] - held[1], held[0], held[-1] - held[2])


def test_micro_batches_in_flight_by_schedule():
    """Narayanan et al. 2021 (1F1B: stage i of p holds p - i), Korthikanti et al. 2022 (interleaved:
    the first rank p + (p - 1)/v), GPipe all of them; never more than the step's micro batches."""
    flight = estimate.pipeline_in_flight
    assert [flight("1f1b_torch", 4, 8, 1, stage) for stage in range(4)] == [4, 3, 2, 1]
    assert flight("1f1b", 4, 2, 1, 0) == 2 and flight("gpipe", 4, 8, 1, 3) == 8
    assert flight("interleaved", 4, 16, 2, 0) == 4 + 3 / 2 and flight("interleaved", 4, 3, 2, 0) == 3
    assert flight("zbv", 4, 8, 2, 0) == 4 and flight("dualpipev", 4, 8, 2, 0) == 5 and flight("none", 1, 4, 1, 0) == 1


def test_activations_per_rank_follow_the_split_and_the_schedule_by_hand():
    """4 blocks on 2 pipeline ranks, 4 micro batches, a made-up count (a block 10 bytes, the
    embeddings 1, the head and loss 100): GPipe keeps every micro batch on both ranks, 1F1B 2 on
    the first and 1 on the last; without a pipeline one micro batch of everything. Full
    checkpointing keeps each block's input (micro x tokens x width x 4 bytes in fp32) and one
    block again while it is recomputed."""
    count = estimate.ActivationCount(block=10, first=1, last=100)
    base = ["model=llama-tiny", "model.n_layer=4", "model.n_embd=64", "model.n_head=4", "data.block_size=32"]
    base += ["trainer.micro_batch_size=4"]

    def per_rank(*overrides):
        config = load_config([*base, "precision=fp32", *overrides])
        layout = estimate_layout(config)
        return estimate.rank_activation_bytes(count, meta_model(config.model), config, layout, 4, 4)

    assert per_rank("pipeline=gpipe", "pipeline.stages=2") == [4 * (2 * 10 + 1), 4 * (2 * 10 + 100)]
    assert per_rank("pipeline=1f1b_torch", "pipeline.stages=2") == [2 * (2 * 10 + 1), 1 * (2 * 10 + 100)]
    assert per_rank() == [4 * 10 + 1 + 100]
    block_input = 4 * 32 * 64 * 4  # 4 sequences x 32 tokens x 64 wide, fp32
    assert per_rank("checkpointing=full") == [4 * block_input + 1 + 100 + 10]


def estimate_layout(config):
    from lmrepo.distributed.layout import ParallelLayout

    return ParallelLayout.of(config, config.pipeline.stages if config.pipeline.schedule != "none" else 1)


def run_estimate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*FORKED_PYTHON, str(REPO / "scripts" / "estimate.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_script_prints_the_estimate():
    proc = run_estimate(
        "model=gpt2-xl",
        "zero=stage3",
        "offload=cpu",
        "trainer.micro_batch_size=4",
        "world=64",
        "data.block_size=1024",
        "tflops=150",
        "checkpointing=full",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "1,557,611,200" in out and "1,557,608,000" in out and "80,411,200" in out
    chosen = next(line for line in out.splitlines() if line.strip().startswith("* stage3"))
    ours = estimate.model_state_bytes(P, 3, 64, "cpu")
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, LARGEST, 8, 8, True, True, False)
    figures = [ours.gpu, ours.cpu, ours.nvme, 8 * ours.cpu, gpu, cpu]
    assert chosen.split() == [
        "*",
        "stage3",
        "cpu",
        *(f"{b / 2**30:.2f}" for b in figures[:4]),
        "|",
        *(f"{b / 2**30:.2f}" for b in figures[4:]),
    ]
    assert "262,144 tokens per step" in out
    step_flops = 262_144 * flops_per_token(48, 1600, 1024, 50257, recompute=True)
    assert f"FLOPs per step:  {step_flops:.4g}" in out
    days = 300e9 * flops_per_token(48, 1600, 1024, 50257, recompute=True) / (64 * 150e12) / DAY
    assert f"{days:,.1f} days" in out
    assert proc.stderr == ""


def test_fsdp2_table_follows_the_layout_by_hand(capsys):
    """engine=fsdp2 on 2 stages x 2 data-parallel x 2 tensor-parallel ranks (8), Llama tiny (4
    layers of width h=256, SwiGLU width i=688, 4 heads of 4 key/value heads, V=50,257, untied): the
    last pipeline rank holds blocks 3-4, the final norm and the head; tensor parallelism halves
    each block's q, k, v, o, gate, up and down; FSDP2 shards the rest over 2. By hand."""
    h, i, vocab = 256, 688, 50257
    block = (4 * h * h + 3 * h * i) / 2 + 2 * h  # the split linears, then the two norms
    last = 2 * block + h + vocab * h
    load_script().main(["model=llama-tiny", "engine=fsdp2", "tp=auto", "tp.size=2", "pipeline=gpipe",
                        "pipeline.stages=2", "world=8"])  # fmt: skip
    out = capsys.readouterr().out
    assert "pp 2 x dp_shard 2 x tp 2; pipeline rank 1 of 2, the largest" in out
    assert f"{last:,.0f} parameters on the rank before sharding, {last / 2:,.0f} after" in out
    chosen = next(line for line in out.splitlines() if line.strip().startswith("* zero=stage3"))
    assert chosen.split()[3] == f"{16 * last / 2 / 2**30:.2f}"  # bf16: fp32 states, 16 bytes per element


def test_script_bad_input():
    proc = run_estimate("world=0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["lmrepo: error: world=0 must be a positive integer"]
    assert proc.stdout == ""


def load_script():
    spec = importlib.util.spec_from_file_location("estimate_script", REPO / "scripts" / "estimate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["model=gpt2-xl", "zero=stage3", "offload=cpu", "trainer.micro_batch_size=4", "world=64"],
        ["model=bert-tiny", "checkpointing=every_n", "precision=fp32"],
        ["zero=stage3", "offload=nvme", "gpu=H100", "mfu=0.5", "tokens=1e9"],
        ["model=mixtral-1b", "zero=stage2", "world=8", "expert_parallel.size=4"],
    ],
)
def test_script_in_process(args, capsys):
    load_script().main(args)
    out, err = capsys.readouterr()
    assert "Parameters" in out and "Model states" in out and "days" in out and err == ""
    assert ("experts split" in out) == ("model=mixtral-1b" in args)


@pytest.mark.parametrize(
    "args,key",
    [
        (["no_such_key=1"], "no_such_key"),
        (["model=gpt5"], "model=gpt5"),
        (["zero=stage1", "offload=nvme"], "needs ZeRO-3"),
        # a rule of the final DeepSpeed dict, at the planned size
        (["engine=fsdp2", "pipeline=zbv", "pipeline.stages=4", "trainer.grad_accum=8", "world=512"], "pipeline=zbv"),
        (["tflops=-3"], "tflops=-3"),
        (["world=6", "gpus_per_node=4"], "gpus_per_node"),
        (["model=gpt2", "data.block_size=2048"], "data.block_size=2048"),
    ],
)
def test_script_bad_input_in_process(args, key, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script().main(args)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and key in err


@pytest.mark.parametrize(
    "name, bf16",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_peak_table_tells_gpu_forms_apart(name, bf16):
    """torch.cuda.get_device_name() of each form: the SXM, PCIe and NVL H100 differ in clocks
    and power, and so in peak (datasheets: 989 / 756 / 835 dense bf16 TFLOP/s). The V100 has no
    bf16 units: bf16 runs at its fp32 peak there."""
    expected = bf16 if bf16 is not None else 15.7
    assert peak_tflops(name, "bf16", None) == expected


def test_a_tensor_split_unevenly_gives_each_rank_torch_chunks_share():
    """estimate.shard_rows: dim 0 split over ranks as Shard(0) (torch.chunk) splits it, which each
    tensor-parallel rank's activation count and each FSDP2 rank's model states use; the shares add
    up to the rows."""
    import torch

    for vocab, tp in ((257, 2), (257, 4), (50257, 2), (50257, 8), (6, 4)):
        shares = [estimate.shard_rows(vocab, tp, rank) for rank in range(tp)]
        chunks = [len(c) for c in torch.arange(vocab).chunk(tp)]
        assert shares == chunks + [0] * (tp - len(chunks)), (vocab, tp, shares)
        assert sum(shares) == vocab


# engine=fsdp2's layouts at a cluster's size: the shards the engine cuts, built on the meta device
# over torch's fake process group (lmrepo.estimate.planned_shards), against the same cut made from
# the shapes alone (lmrepo.estimate.ShardArithmetic).
LARGE_LAYOUTS = {
    "fsdp2": ["engine=fsdp2"],
    "hsdp": ["engine=fsdp2", "engine.replicate=8"],
    "fsdp2_tp": ["engine=fsdp2", "tp=auto", "tp.size=8"],
    "pipeline_fsdp2_tp": [
        *("engine=fsdp2", "tp=auto", "tp.size=8"),
        *("pipeline=1f1b_torch", "pipeline.stages=4", "trainer.grad_accum=8"),
    ],
}


@pytest.mark.parametrize("layout_name", LARGE_LAYOUTS)
@pytest.mark.parametrize("world", [64, 512, 1024])
@pytest.mark.parametrize("model", ["llama-3-8b", "llama-3-70b"])
def test_the_shards_of_a_large_layout_are_the_arithmetic(model, world, layout_name):
    """The first and the last rank hold, element for element, what the arithmetic says; and the
    arithmetic gives every parameter element to exactly one rank of each replica."""
    from lmrepo.plan.job import layout_check

    config = load_config([f"model={model}", *LARGE_LAYOUTS[layout_name]])
    layout = layout_check(config, world)
    # the last rank: the last stage, the last tp rank, the smallest pieces; the first one too at 1,024
    for planned in estimate.planned_shards(config, layout, [0, world - 1] if world == 1024 else [world - 1]):
        assert planned.held == planned.arithmetic, (planned.rank, planned.coordinates)
    net = meta_model(config.model)
    arithmetic = estimate.ShardArithmetic(net, config, layout)
    every_rank = sum(arithmetic.elements(rank) for rank in range(world))
    assert every_rank == sum(p.numel() * arithmetic.copies(p) for p in net.parameters()) * layout.dp_replicate


def test_the_script_prints_the_real_shards_of_a_1024_rank_70b_layout():
    proc = run_estimate("model=llama-3-70b", "engine=fsdp2", "tp=auto", "tp.size=8", "world=1024")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("  0 ", "  1023 "))]
    # rank 0: 1/128 of its tp rank's slice; the last rank: fewer rows of the vocabulary-split head
    assert [row[0] for row in rows] == ["0", "1023"] and all(row[-1] == "equal" for row in rows)
    assert rows[0][5] == "76,097,600" and rows[1][5] == "75,311,168"
    assert "dp_shard 128 x tp 8" in proc.stdout


def test_the_script_says_deepspeed_is_not_built_on_the_fake_group(capsys):
    load_script().main(["model=llama-3-8b", "zero=stage3", "world=64"])
    assert "Real shards: not built for engine=deepspeed" in capsys.readouterr().out
