"""scripts/compare.py and the sweep's own summary on one real sweep, as a user types it: two
engines, each at its own default ZeRO stage (a difference the sweep did not ask for), and two
jobs refused before training."""

import json
import os
import subprocess

import pytest

from harness import FORKED_PYTHON, PYTHON, REPO, TINY, assert_ok, read_metrics, summary_rows

COMPARE = str(REPO / "scripts" / "compare.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOKENS = "tokens/s (steady) [range]"


def compare(*args, timeout=120, env=None):
    return subprocess.run(
        [*FORKED_PYTHON, COMPARE, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """`train.py -m engine=deepspeed,fsdp2 offload=none,nvme`: the two offload=none jobs train
    (DeepSpeed at its default ZeRO-0, FSDP2 at its ZeRO-3), W&B offline; the offload=nvme jobs are
    refused (no offload.nvme_path), and the launcher records them. Returns (dir, sweep output)."""
    root = tmp_path_factory.mktemp("compare")
    proc = subprocess.run(
        [
            PYTHON,
            str(REPO / "train.py"),
            "-m",
            "engine=deepspeed,fsdp2",
            "offload=none,nvme",
            *[o for o in TINY if not o.startswith("logger=")],
            "logger=wandb",
            f"hydra.sweep.dir={root / 'sweep'}",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # two jobs failed
    return root / "sweep", proc.stdout


def table_rows(markdown: str) -> list[dict]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split(" | ")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split(" | ")))) for line in lines[2:]]


def steady(records: list[dict]) -> tuple[float, float, float]:
    """The steady tokens/s as docs/sweeps.md defines it, computed here from the metrics lines:
    the windows after step 1 (TINY logs every step), their tokens over their seconds."""
    train = [m for m in records if "loss" in m]
    windows = [(b["tokens"] - a["tokens"], b["tokens_per_s"]) for a, b in zip(train, train[1:])]
    rates = [rate for _, rate in windows]
    return sum(t for t, _ in windows) / sum(t / rate for t, rate in windows), min(rates), max(rates)


def test_compare_writes_table_definitions_and_plots(sweep, tmp_path):
    sweep_dir, _ = sweep
    out = tmp_path / "report"
    proc = compare(sweep_dir, "--out", out)
    assert_ok(proc)
    markdown = (out / "compare.md").read_text()
    assert markdown.splitlines()[0] in proc.stdout  # the table is printed too
    rows = table_rows(markdown)
    assert [row["job"] for row in rows] == [
        "engine=deepspeed offload=none",
        "engine=deepspeed offload=nvme",
        "engine=fsdp2 offload=none",
        "engine=fsdp2 offload=nvme",
    ]
    for row, job in zip(rows[::2], ["0", "2"]):
        metrics = read_metrics(sweep_dir / job)
        train = [m for m in metrics if "loss" in m]
        rate, low, high = steady(metrics)
        assert row["final loss"] == f"{train[-1]['loss']:.4f}"
        assert row["eval loss"] == f"{[m for m in metrics if 'eval_loss' in m][-1]['eval_loss']:.4f}"
        assert row["grad norm"] == f"{train[-1]['grad_norm']:.4g}"  # the last step's, before clipping
        assert row[TOKENS] == f"{rate:.0f} [{low:.0f}-{high:.0f}]"
        assert row["TFLOP/s (steady)"] == f"{rate * train[-1]['tflops'] / train[-1]['tokens_per_s']:.4g}"
        assert row["MFU (steady)"] == "-"  # no known peak on the CPU
        assert row["peak mem GB (rank 0)"] == f"{max(m['mem_gb'] for m in train):.2f}"
        assert row["steps"] == "6" and row["status"] == "completed" and float(row["wall s"]) > 0

    for failed in rows[1::2]:
        assert failed["status"].startswith("failed: ") and "offload" in failed["status"].lower()  # its refusal
        assert {failed[c] for c in ("final loss", TOKENS, "steps")} == {"-"}

    # every column the table shows is defined under it; the jobs' unswept difference is said
    for column in rows[0]:
        assert column == "job" or column == "status" or f"- **{column}**: " in markdown, column
    difference = "zero differs although the sweep did not vary it: stage0 (engine=deepspeed offload=none); "
    difference += "stage3 (engine=fsdp2 offload=none): set zero= for every job to compare like for like"
    assert f"- {difference}\n" in markdown and f"compare: not like for like: {difference}\n" in proc.stdout
    for name in ("loss_vs_step.png", "loss_vs_time.png", "tokens_per_s.png", "memory.png", "lr_vs_step.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
        assert f"]({name})" in markdown, f"{name} embedded under the table"


def test_the_sweep_summary_the_done_line_and_wandb_say_what_compare_says(sweep, tmp_path):
    """One definition: the sweep's summary and compare.py's table give each job the same cells
    (so the same ranking), the job's done line and its W&B run summary the same tokens/s."""
    sweep_dir, stdout = sweep
    assert_ok(compare(sweep_dir, "--out", tmp_path))
    table = table_rows((tmp_path / "compare.md").read_text())
    summary = summary_rows(stdout)
    for number, row in zip("0123", table):
        for column in ("final loss", "eval loss", TOKENS):
            assert summary[number][column] == row[column], (number, column)
    assert summary["0"]["status"] == "completed" and summary["1"]["status"] == "failed"
    assert "not like for like: zero differs although the sweep did not vary it: stage0" in stdout

    for job in ("0", "2"):
        status = json.loads((sweep_dir / job / "status.json").read_text())
        value = status["summary"]["tokens_per_s"]
        rate, low, high = table[int(job)][TOKENS].replace("[", "").replace("]", "").replace("-", " ").split()
        assert f"{value:.0f}" == rate
        assert status["setting"]["ranks"] == 1 and status["setting"]["machine"]
        log = (sweep_dir / job / "job.log").read_text()
        assert f"tokens/s {rate} steady over steps 2-6 (windows {low}-{high})" in log
        (run,) = (sweep_dir / job / "wandb").glob("offline-run-*/*.wandb")
        assert b"tokens_per_s" in run.read_bytes() and json.dumps(value).encode() in run.read_bytes()


def test_default_out_is_the_first_dir(sweep):
    sweep_dir, _ = sweep
    assert_ok(compare(sweep_dir / "0"))
    rows = table_rows((sweep_dir / "0" / "compare.md").read_text())
    assert len(rows) == 1 and rows[0]["status"] == "completed"


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
