"""scripts/compare.py on a real sweep directory: two short trainings and one rejected job."""

import json
import os
import subprocess

import pytest

from conftest import PYTHON, REPO, TINY, assert_ok, read_metrics, run_train

COMPARE = str(REPO / "scripts" / "compare.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def compare(*args, timeout=120, env=None):
    return subprocess.run([PYTHON, COMPARE, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sweep dir laid out like a Hydra multirun: jobs 0 and 1 train; job 2 is rejected, and
    (as the sweep launcher does) its dir gets a status.json with the error line."""
    sweep = tmp_path_factory.mktemp("compare") / "sweep"
    assert_ok(run_train([*TINY, "zero=stage0"], sweep / "0"))
    assert_ok(run_train([*TINY, "zero=stage1", "precision=bf16"], sweep / "1"))
    proc = run_train([*TINY, "zero=stage2", "offload=cpu", "offload.params=true"], sweep / "2")
    assert proc.returncode == 2
    error = next(line for line in proc.stderr.splitlines() if line.startswith("lmrepo: error:"))
    (sweep / "2").mkdir()
    (sweep / "2" / "status.json").write_text(json.dumps({"status": "failed", "error": error}))
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep


def table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")][2:]  # skip header, rule
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def test_compare_writes_table_and_plots(sweep, tmp_path):
    out = tmp_path / "report"
    proc = compare(sweep, "--out", out)
    assert_ok(proc)
    markdown = (out / "compare.md").read_text()
    assert markdown.splitlines()[0] in proc.stdout  # the table is printed too
    rows = table_rows(markdown)
    assert [row[0] for row in rows] == ["zero=stage0", "zero=stage1 precision=bf16", "sweep/2"]

    for row, job in zip(rows, ["0", "1"]):
        metrics = read_metrics(sweep / job)
        train = [m for m in metrics if "loss" in m]
        evals = [m for m in metrics if "eval_loss" in m]
        job, final_loss, eval_loss, grad_norm, tokens_s, tflops, mfu, mem, steps, wall, status = row
        assert final_loss == f"{train[-1]['loss']:.4f}"
        assert eval_loss == f"{evals[-1]['eval_loss']:.4f}"
        assert grad_norm == f"{train[-1]['grad_norm']:.4g}"  # the last step's, before clipping
        # the median over the 5 steps after the first (warm-up)
        speeds = sorted(m["tokens_per_s"] for m in train[1:])
        assert len(speeds) == 5 and tokens_s == f"{speeds[2]:.0f}"
        assert mfu == "-"  # no known peak on the CPU
        assert mem == f"{max(m['mem_gb'] for m in train):.2f}"
        assert steps == "6" and status == "completed" and float(wall) > 0

    failed = rows[2]
    assert failed[-1].startswith("failed: lmrepo: error:") and "zero=stage3" in failed[-1]
    assert failed[1:10] == ["-"] * 9

    for name in ("loss_vs_step.png", "loss_vs_time.png", "tokens_per_s.png", "memory.png", "lr_vs_step.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


def test_default_out_is_the_first_dir(sweep):
    assert_ok(compare(sweep / "0"))
    rows = table_rows((sweep / "0" / "compare.md").read_text())
    assert len(rows) == 1 and rows[0][-1] == "completed"


@pytest.mark.parametrize("make", [lambda tmp: tmp / "missing", lambda tmp: tmp])
def test_bad_dir_exits_2_with_one_line(tmp_path, make):
    proc = compare(make(tmp_path))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("compare: error:")


def test_wandb_without_a_server_fails_fast_with_one_line(tmp_path):
    # a key, so the API really tries the network (without one it stops at "no API key")
    env = {**os.environ, "WANDB_API_KEY": "0" * 40}
    env.pop("WANDB_MODE", None)
    proc = compare("--wandb", "someone/project/group", "--out", tmp_path, env=env, timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--wandb someone/project/group" in proc.stderr
