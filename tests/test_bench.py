"""scripts/bench.py runs end to end (a smoke run: timings are printed, never asserted), and the
CPU matmul peak MFU is measured against is a positive number."""
import subprocess

from conftest import PYTHON, REPO, assert_ok

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
    assert (tmp_path / "results.md").read_text() in proc.stdout
