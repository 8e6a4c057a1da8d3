"""The benchmarks of benchmarks/ as smoke runs: benchmarks/bench.py --quick runs end to end
(timings are printed, never asserted), the model-state memory it measures on 2 ranks is what
lmrepo.estimate predicts, the CPU matmul peak MFU is measured against is a positive number, and
benchmarks/bench_data.py --quick prints every ratio. A smoke run proves a benchmark runs and its
output is sane, not how fast the machine is: tiny models in fp32 (bf16 only where a section is
about it), few steps, small matrices."""

import json
import os
import subprocess
import sys

import pytest

from harness import FORKED_PYTHON, REPO, assert_ok
from lmrepo.estimate import model_state_bytes, zero12_model_state_bytes

BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import their helpers as `common`, not as a package
from common import measure_cpu_peak_tflops  # noqa: E402

HEADINGS = (
    "## Machine",
    "## CPU matmul peak",
    "## 1. train.py vs bare DeepSpeed loop",
    "## 2. train.py vs Hugging Face Trainer",
    "## 3. Model-state memory per rank",
    "## 4. torch.compile",
)


def run_benchmark(name: str, *args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*FORKED_PYTHON, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


def test_measure_cpu_peak_tflops_is_positive():
    for dtype in ("bf16", "fp32"):
        assert measure_cpu_peak_tflops(dtype, seconds=0.01, n=128) > 0


@pytest.mark.distributed
def test_bench_quick_prints_every_section(tmp_path):
    from lmrepo.utils import ops

    # Its workers start DeepSpeed themselves (a bare deepspeed.initialize, HF's Trainer): where the
    # machine keeps every op, none is built, here in a build directory of its own
    builds, out = tmp_path / "builds", tmp_path / "out"
    proc = run_benchmark(
        "bench.py", "--quick", "--out", str(out), env={**os.environ, "TORCH_EXTENSIONS_DIR": str(builds)}
    )
    assert_ok(proc)
    if all(ops.cached_build(name) for name in ("deepspeed_shm_comm", "fused_adam")):
        assert not list(builds.glob("*/*.so")), sorted(builds.glob("*/*.so"))
    for heading in HEADINGS:
        assert heading in proc.stdout
    assert "could not be measured" not in proc.stdout and "failed" not in proc.stdout
    assert "Noise floor of these paired ratios" in proc.stdout
    assert (out / "results.md").read_text() in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert all(value > 0 for value in results["peak"].values())

    # What the engines held, counted from their tensors on each rank, against the estimator: the
    # ZeRO division at stages 0 and 3 (ZeRO-3 also keeps small parameters whole), DeepSpeed's
    # whole-tensor gradient layout at stages 1 and 2, in mixed precision (bf16: the smoke run's table).
    rows = results["memory"]
    assert sorted((row["stage"], row["rank"]) for row in rows) == [(s, r) for s in range(4) for r in range(2)]
    for row in rows:
        assert row["dtype"] == "bf16", row
        held = row["params"] + row["grads"] + row["optimizer"]
        if row["stage"] in (1, 2):
            expected = zero12_model_state_bytes(row["n_params"], row["group_sizes"], row["stage"], 2, row["dtype"])[
                row["rank"]
            ]
            assert held == pytest.approx(expected, rel=1e-3), row
        else:
            expected = model_state_bytes(row["n_params"], row["stage"], 2, dtype=row["dtype"]).gpu
            assert held == pytest.approx(expected, rel=0.02), row


def test_bench_data_quick():
    proc = run_benchmark("bench_data.py", "--quick", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in (
        "ratio prepare / tutorials, one pass:",
        "ratio prepare / tutorials, per CPU-second:",
        "ratio tokenizer alone / tutorials, per CPU-second:",
        "ratio train_step supply / tutorials:",
        "ratio over E epochs",
        "padding waste: the tutorials'",
        "fraction of a step waiting for data:",
        "ratio x10 / x1 peak memory:",
    ):
        assert line in proc.stdout
