"""The suite's own measuring tool: `--cpu-report=FILE` (README: Tests) writes one line per test
with its CPU seconds, counting the processes it ran."""
import subprocess

from conftest import PYTHON, REPO


def test_cpu_report_counts_each_tests_processes(tmp_path):
    report = tmp_path / "cpu.tsv"
    tests = ["tests/test_reference.py::test_every_key_has_a_docstring", "tests/test_compare.py::test_bad_dir_exits_2_with_one_line"]
    proc = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, f"--cpu-report={report}"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = [line.split("\t") for line in report.read_text().splitlines()]
    assert sorted(test.split("[")[0] for *_, test in lines) == sorted([tests[0], tests[1], tests[1]])
    for cpu, wall, test in lines:
        assert float(cpu) >= 0 and float(wall) >= 0
        if "compare" in test:  # each case runs scripts/compare.py: a Python process costs CPU
            assert float(cpu) > 0.05, lines
