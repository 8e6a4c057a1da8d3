"""The suite's own measuring tool: `--cpu-report=FILE` (tests/README.md) writes one line per test
with its CPU seconds, counting the processes it ran, its wall seconds, its worker and when it
ended."""

import os
import subprocess

from conftest import PYTHON, REPO

IN_PROCESS = "tests/test_reference.py::test_every_key_has_a_docstring"
# runs scripts/estimate.py, which imports torch: a second of CPU or so, all of it in the child
WITH_A_CHILD = "tests/test_estimate.py::test_script_prints_the_estimate"


def test_cpu_report_counts_each_tests_processes(tmp_path):
    report = tmp_path / "cpu.tsv"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}  # one process: no worker of `make test`'s
    proc = subprocess.run(
        [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", IN_PROCESS, WITH_A_CHILD, f"--cpu-report={report}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = {
        test: (float(cpu), float(wall), worker, float(end))
        for cpu, wall, test, worker, end in (line.split("\t") for line in report.read_text().splitlines())
    }
    assert sorted(rows) == sorted([IN_PROCESS, WITH_A_CHILD])
    assert all(cpu >= 0 and wall >= 0 and worker == "-" and end > 1e9 for cpu, wall, worker, end in rows.values())
    assert rows[WITH_A_CHILD][0] > 0.3 > rows[IN_PROCESS][0], rows
