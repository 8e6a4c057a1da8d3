"""scripts/bench.py runs end to end (a smoke run: timings are printed, never asserted), the
model-state memory it measures on 2 ranks is what lmrepo.estimate predicts, and the CPU matmul
peak MFU is measured against is a positive number."""
import json
import subprocess

import pytest

from conftest import PYTHON, REPO, assert_ok

from lmrepo.estimate import model_state_bytes, zero12_model_state_bytes
from lmrepo.metrics import measure_cpu_peak_tflops

HEADINGS = ("## Machine", "## CPU matmul peak", "## 1. train.py vs bare DeepSpeed loop",
            "## 2. train.py vs Hugging Face Trainer", "## 3. Model-state memory per rank", "## 4. torch.compile")


def test_measure_cpu_peak_tflops_is_positive():
    for dtype in ("bf16", "fp32"):
        assert measure_cpu_peak_tflops(dtype, seconds=0.05) > 0


def test_bench_quick_prints_every_section(tmp_path):
    proc = subprocess.run([PYTHON, str(REPO / "scripts" / "bench.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert_ok(proc)
    for heading in HEADINGS:
        assert heading in proc.stdout
    assert "could not be measured" not in proc.stdout and "failed" not in proc.stdout
    assert "Noise floor of these paired ratios" in proc.stdout
    assert (tmp_path / "results.md").read_text() in proc.stdout

    # What the engines held, counted from their tensors on each rank, against the estimator: the
    # ZeRO division at stages 0 and 3 (ZeRO-3 also keeps small parameters whole), DeepSpeed's
    # whole-tensor gradient layout at stages 1 and 2.
    rows = json.loads((tmp_path / "results.json").read_text())["memory"]
    assert sorted((row["stage"], row["rank"]) for row in rows) == [(s, r) for s in range(4) for r in range(2)]
    for row in rows:
        held = row["params"] + row["grads"] + row["optimizer"]
        if row["stage"] in (1, 2):
            expected = zero12_model_state_bytes(row["n_params"], row["group_sizes"], row["stage"], 2)[row["rank"]]
            assert held == pytest.approx(expected, rel=1e-3), row
        else:
            assert held == pytest.approx(model_state_bytes(row["n_params"], row["stage"], 2).gpu, rel=0.02), row
