"""What a GPU step's speed rests on, checked on the CPU: GPT-2's fused GELU is the function it
replaces, trainer.compile=null compiles where it should, FLOPs count the model that is built, the
training loop reads nothing back on a step that does not log, and the throughput ruler
(benchmarks/bench_throughput.py) runs end to end at a smoke size."""

import json
import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.activations import ACT2FN

from harness import CPU, FORKED_PYTHON, GPU, PYTHON, REPO
from lmrepo.config import compile_by_default
from lmrepo.estimate import active_block_params
from lmrepo.models import build_model
from lmrepo.plan.compose import compose_config, load_config
from lmrepo.plan.job import plan


def test_fused_gelu_is_gpt2s_gelu_new_within_float_rounding():
    """Both compute 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) in fp32. Rounding the inputs of
    that formula moves it by about eps * max(|x|, 1) (for x < 0 the 1 + tanh cancels, so the error
    is absolute, not relative to the tiny result): each is within 2 of those of the float64 value
    (0.94 measured for both), where a changed function (the erf GELU) is off by ~1e-3."""
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0)) * 4
    exact = ACT2FN["gelu_new"](x.double())
    scale = torch.finfo(torch.float32).eps * x.double().abs().clamp_min(1)
    for name in ("gelu_new", "gelu_pytorch_tanh"):
        assert ((ACT2FN[name](x).double() - exact).abs() <= 2 * scale).all(), name
    assert not ((ACT2FN["gelu"](x).double() - exact).abs() <= 2 * scale).all()  # the check can fail


def test_gpt2_trains_with_the_fused_gelu_also_from_a_gelu_new_checkpoint(tmp_path):
    built = build_model(load_config(["model.n_layer=2", "model.n_embd=64", "model.n_head=2"]).model)
    assert built.config.activation_function == "gelu_pytorch_tanh"
    # GPT-2's own checkpoints name gelu_new: the loaded model computes the same function, fused.
    torch.manual_seed(0)
    original = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, activation_function="gelu_new"))
    original.save_pretrained(tmp_path)
    loaded = build_model(load_config([f"model.pretrained={tmp_path}"]).model)
    assert loaded.config.activation_function == "gelu_pytorch_tanh"
    assert type(loaded.transformer.h[0].mlp.act) is type(ACT2FN["gelu_pytorch_tanh"])
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = loaded(input_ids=ids).logits, original.eval()(input_ids=ids).logits
    # fp32 through 2 blocks: differences of rounding, far below a changed function's (1e-1 and up)
    assert (ours - theirs).norm() <= 1e-5 * theirs.norm()


@pytest.mark.parametrize(
    "overrides, instead",
    [
        (["zero=stage3"], "zero=stage0"),
        (["zero=stage1"], "zero=stage0"),
        (["engine=fsdp2"], "engine=deepspeed zero=stage0"),
    ],
)
def test_sharding_over_one_rank_is_said_to_save_nothing_with_the_choice_that_trains_faster(overrides, instead):
    """On one data-parallel rank ZeRO and FSDP2 partition nothing and still pay their hooks and
    bookkeeping (on a GPU, GPT-2 124M's ZeRO-3 ran at 0.18x the hand-tuned loop): the start says
    so and names a choice the engine takes."""

    def said(words: list[str], ranks: int) -> list[str]:
        return [line for line in plan(compose_config(words), ranks, GPU).notes if "partitions nothing" in line]

    lines = said(overrides, 1)
    assert len(lines) == 1 and f"({instead} trains the same model faster" in lines[0]
    assert not said(instead.split(), 1)  # accepted, and nothing to say of it
    assert not said(overrides, 2)  # over 2 data-parallel ranks it partitions


@pytest.mark.parametrize(
    "overrides, device, expected",
    [
        ([], GPU, True),
        (["engine=fsdp2"], GPU, True),
        (["zero=stage2", "checkpointing=full", "checkpointing.impl=torch"], GPU, True),
        ([], CPU, False),
        (["zero=stage3"], GPU, False),
        (["checkpointing=full"], GPU, False),  # DeepSpeed's reentrant checkpointing
        (["model=mixtral-tiny", "zero=stage1"], GPU, False),
        (["offload=cpu", "zero=stage2"], GPU, False),
        (["trainer.compile=false"], GPU, False),
        (["trainer.compile=true"], CPU, True),
    ],
)
def test_trainer_compile_null_compiles_on_a_gpu_where_the_layout_suits_it(overrides, device, expected):
    job = plan(compose_config(overrides), 1, device)
    assert job.config.trainer.compile is expected
    said = [line for line in job.notes if "trainer.compile=null" in line]
    if "trainer.compile=" in " ".join(overrides) or device is CPU:
        assert not said  # a choice the user made, or a CPU: nothing to say
    else:
        assert len(said) == 1 and ("-> on" in said[0]) is expected


def test_compile_by_default_names_the_reason_it_stays_off():
    config = load_config(["zero=stage3"])
    assert compile_by_default(config, "cuda") == (
        False,
        "lmrepo: trainer.compile=null -> off for DeepSpeed's zero=stage3 (its parameter hooks break the graph); "
        "trainer.compile=true compiles anyway",
    )
    for layout, reason in (
        (["pipeline=gpipe"], "pipeline=gpipe"),
        (["sequence_parallel.size=2", "model=llama-tiny"], "sequence_parallel.size=2"),
        (["tp=auto", "model=llama-tiny"], "tp=auto"),
    ):
        compiles, line = compile_by_default(load_config(layout), "cuda")
        assert not compiles and f"off for {reason};" in line


def test_compile_with_deepspeeds_checkpoint_says_the_blocks_stay_uncompiled():
    """DeepSpeed's checkpoint turns torch.compile off inside it: trainer.compile=true compiles the
    rest of the model and the start says so, naming the implementation that compiles the blocks
    (the composition matrix's compile x activation checkpointing pair runs it, in one graph)."""

    def said(words):
        return [n for n in plan(compose_config(["trainer.compile=true", *words]), 1, CPU).notes if "uncompiled" in n]

    (line,) = said(["checkpointing=full"])
    assert line.startswith(
        "lmrepo: note: trainer.compile=true with checkpointing.impl=deepspeed leaves the checkpointed"
    )
    assert "checkpointing.impl=torch compiles them" in line
    assert said(["checkpointing=every_n", "checkpointing.every_n_layers=2"])
    for words in (["checkpointing=full", "checkpointing.impl=torch"], ["checkpointing=full", "engine=fsdp2"], []):
        assert not said(words), words
    assert not [n for n in plan(compose_config(["checkpointing=full"]), 1, CPU).notes if "uncompiled" in n]


def test_llama_flops_count_grouped_query_attention_and_swiglu():
    """Llama 1B's blocks as built: q and o h x h, k and v h x (kv heads x head size), three
    h x n_inner SwiGLU matrices; GPT's 12*l*h^2 overstates them by 14%."""
    model = load_config(["model=llama-1b"]).model
    h, kv, inner = 2048, 4 * 2048 // 32, 5632
    assert active_block_params(model) == 22 * (2 * h * h + 2 * h * kv + 3 * h * inner)
    assert active_block_params(load_config(["model=gpt2"]).model) is None  # 12*l*h^2 exact for GPT-2


@pytest.fixture(scope="module")
def ruler(tmp_path_factory):
    """benchmarks/bench_throughput.py --quick: R0, R1 and train.py's ZeRO-0 and FSDP2 arms, one
    process each, on a 2 x 64 GPT-2 in fp32 (~1 min on 2 cores)."""
    import subprocess

    out = tmp_path_factory.mktemp("ruler")
    proc = subprocess.run(
        [*FORKED_PYTHON, str(REPO / "benchmarks" / "bench_throughput.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, {
        name: json.loads((out / f"{name}.result.json").read_text()) for name in ("R0", "R1", "ds-z0", "fsdp2")
    }


def test_the_ruler_runs_every_kind_of_arm_on_the_same_batches(ruler):
    stdout, results = ruler
    assert "| R0 | 2 |" in stdout and "| ds-z0 | 2 |" in stdout and "| fsdp2 | 2 |" in stdout and "| R1 | 2 |" in stdout
    # Same model, seed and batches in fp32: R0 (torch AdamW), DeepSpeed's engine (torch's AdamW on a
    # CPU) and FSDP2 take the same steps; step 6's loss agrees to fp32 rounding of another
    # summation order (a different step or batch would differ by > 1e-3).
    reference = results["R0"]["losses"][5]
    assert results["R1"]["losses"][5] == pytest.approx(reference, rel=1e-5)
    for arm in ("ds-z0", "fsdp2"):
        assert results[arm]["losses"]["6"] == pytest.approx(reference, rel=1e-5)
    for figures in results.values():
        assert figures["step_s"] > 0 and figures["peak_gb"] > 0


def test_a_step_that_does_not_log_reads_at_most_one_value_back(ruler):
    """train.py's steps between logging steps read nothing the step computed back into Python, on
    one rank (lmrepo.observability.host_syncs counts tensor reads: on a GPU each waits for the device). The one
    read a step makes is transformers' own: GPT-2's mask code checks the position ids for packed
    sequences in eager mode (`find_packed_sequence_indices`; compiled, it skips the check).
    A logging step reads the loss, the gradient norm and the rest of the metrics line."""
    _, results = ruler
    for arm in ("ds-z0", "fsdp2"):
        assert results[arm]["syncs_max"] <= 1, arm
        assert results[arm]["syncs_log_step"] > results[arm]["syncs_max"], arm


def test_the_overflow_check_without_zero_reads_once_and_answers_as_deepspeeds():
    """lmrepo.engines.deepspeed_runtime.read_overflow_once: DeepSpeed's check before an fp16 or bf16 step
    without ZeRO, each gradient tested on the device and the answers read back once (DeepSpeed reads
    each), gives DeepSpeed's answer for every placement of a non-finite value."""
    from types import SimpleNamespace

    from deepspeed.runtime.utils import CheckOverflow

    from lmrepo.engines.deepspeed_runtime import read_overflow_once
    from lmrepo.observability.host_syncs import ValueReads

    def params(bad_at: int | None, bad: float, missing_grad: int | None = None) -> list:
        out = []
        for i in range(30):
            p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))
            p.grad = None if i == missing_grad else torch.randn(4, 3, dtype=torch.bfloat16)
            if i == bad_at:
                p.grad[1, 2] = bad
            out.append(p)
        return out

    cases = [params(None, 0.0), params(None, 0.0, missing_grad=0), params(0, math.nan), params(29, math.inf)]
    cases += [params(13, -math.inf, missing_grad=12), params(None, 0.0, missing_grad=29), []]
    checker = CheckOverflow()
    read_overflow_once(SimpleNamespace(overflow_checker=checker))
    for case in cases:
        with ValueReads() as reads:
            answer = checker.has_overflow_serial(case)
        assert answer is CheckOverflow.has_overflow_serial(CheckOverflow(), case)
        assert reads.count <= 1
    assert [checker.has_overflow_serial(case) for case in cases] == [False, False, True, True, True, False, False]


def test_deepspeeds_bf16_step_without_zero_reads_a_few_values_not_one_per_gradient(tmp_path):
    """train.py in bf16 at ZeRO-0 (the GPU's default job), 2-layer GPT-2 with 28 gradients: a step
    that does not log reads 7 values (measured), none of them per gradient: the overflow check's
    answer (2: lmrepo's combined read and DeepSpeed's reduced flag), the gradient norm of each of
    the two parameter groups (2 each, DeepSpeed's get_weight_norm) and transformers' mask check
    (1). DeepSpeed's own check read 28 more."""
    import subprocess

    command = [*FORKED_PYTHON, str(REPO / "benchmarks" / "bench_throughput.py"), "--quick", "--arms", "ds-z0"]
    proc = subprocess.run(
        [*command, "--out", str(tmp_path), "precision=bf16"], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "ds-z0.result.json").read_text())
    assert figures["syncs_max"] <= 7


# One process, DeepSpeed's engine as lmrepo builds it, 3 steps of 2 micro batches of a tiny GPT-2:
# each case once as built and once with DeepSpeed's gradient all-reduce turned back on.
ONE_PROCESS_STEPS = """
import json, os, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from lmrepo.engines.deepspeed_runtime import initialize
from lmrepo.utils import ops

# DeepSpeed's ops (its CPU all-reduce, its Adam) from the machine's cache, as train.py's ranks load
# them: otherwise this process compiles both in a fresh clone (~45 s of the suite)
ops.pin_builds()
ops.announce_builds()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
batches = torch.randint(0, 128, (6, 2, 16), generator=torch.Generator().manual_seed(1))

def steps(precision, stage, all_reduce):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16))
    engine = initialize(model, {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "bf16": {"enabled": precision == "bf16"}, "zero_optimization": {"stage": stage},
    })
    reduces = engine.enable_backward_allreduce
    engine.enable_backward_allreduce = engine.enable_backward_allreduce or all_reduce
    for batch in batches:
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    return reduces, [p.detach().float() for p in engine.module.parameters()]

out = {}
for precision, stage in (("fp32", 0), ("bf16", 0), ("fp32", 1)):
    reduces, skipped = steps(precision, stage, all_reduce=False)
    _, reduced = steps(precision, stage, all_reduce=True)
    out[f"{precision} stage {stage}"] = {"reduces": reduces, "same": all(map(torch.equal, skipped, reduced))}
print(json.dumps(out))
"""


def test_one_process_without_zero_skips_the_gradient_all_reduce_and_steps_the_same_to_the_bit():
    """lmrepo.engines.deepspeed_runtime.skip_the_all_reduce_of_one_process: without ZeRO, DeepSpeed's engine
    on one process no longer copies every gradient out, averages it over one rank and back. That
    average multiplies by 1, so the parameters after 3 steps (with gradient accumulation and
    clipping) equal those of the engine that reduces, to the bit, in fp32 and in bf16. ZeRO-1 keeps
    the reduction (it moves the gradients into the optimizer's partitions)."""
    import subprocess

    from lmrepo.distributed.launch import free_port

    proc = subprocess.run(
        [PYTHON, "-c", ONE_PROCESS_STEPS, str(free_port())], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert cases == {
        "fp32 stage 0": {"reduces": False, "same": True},
        "bf16 stage 0": {"reduces": False, "same": True},
        "fp32 stage 1": {"reduces": True, "same": True},
    }
