"""`python train.py --help` and the option reference page come from the schema: every key, its
type and docstring; docs/reference/options.md is the generated page."""

import os
import re
import subprocess

from harness import PYTHON, REPO
from lmrepo.config import TrainConfig
from lmrepo.config.reference import OPTIONS_PAGE, SWEEPS_PAGE, markdown, recipes_table, rows, with_generated_tables
from lmrepo.plan.compose import compose_config


def test_option_reference_page_is_the_generated_one():
    expected = markdown(compose_config([], run_dir="${hydra:runtime.output_dir}"))
    assert OPTIONS_PAGE.read_text() == expected, (
        "docs/reference/options.md is stale: run python scripts/options_reference.py --write"
    )


def test_the_recipes_table_is_the_generated_one():
    """docs/sweeps.md's generated tables (the recipes of conf/experiment/, the figures of
    lmrepo/observability/figures.py) are current, and the recipes table lists every recipe with its
    grid, as the YAML has it."""
    page = SWEEPS_PAGE.read_text()
    assert page == with_generated_tables(page), (
        "docs/sweeps.md's generated tables are stale: run python scripts/options_reference.py --write"
    )
    table = recipes_table()
    for path in (REPO / "conf" / "experiment").glob("*.yaml"):
        assert f"| `{path.stem}` |" in table
    assert "`pipeline=1f1b,gpipe,1f1b_torch,interleaved,interleaved_zb,zbv,dualpipev`" in table


def test_every_key_has_a_docstring():
    assert all(doc for _, _, doc, _ in rows(TrainConfig)), [key for key, _, doc, _ in rows(TrainConfig) if not doc]


def test_help_lists_every_key_with_the_chosen_values(tmp_path):
    proc = subprocess.run(
        [PYTHON, str(REPO / "train.py"), "model=llama-tiny", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        # no terminal, no COLUMNS: 120 columns. (pytest's readline exports COLUMNS=80 to the
        # processes it starts without an env of their own.)
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
    )
    assert proc.returncode == 0, proc.stderr
    words = " ".join(proc.stdout.split())  # a long meaning wraps onto the next lines
    for key, _, doc, _ in rows(TrainConfig):
        assert f"  {key} " in proc.stdout and " ".join(doc.split()) in words, key
    assert max(len(line) for line in proc.stdout.splitlines()) <= 120
    assert "llama-tiny*" in proc.stdout and "model.n_kv_head" in proc.stdout
    assert [line for line in proc.stdout.splitlines() if line.strip().startswith("model.tie_embeddings")][0].split(";")[
        1
    ].strip() == "false"
    assert list(tmp_path.iterdir()) == [], "--help writes nothing"


def test_help_fits_the_terminal(tmp_path):
    """A 72-column terminal (COLUMNS, as shells export it) gets 72-column help, every key in it;
    its first line says what lmrepo trains, with which engines."""
    proc = subprocess.run(
        [PYTHON, str(REPO / "train.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "72"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 72, max(lines, key=len)
    # a key longer than the narrow terminal's key column has its type on the next line
    assert all(re.search(rf"^  {re.escape(key)}( |$)", proc.stdout, re.M) for key, *_ in rows(TrainConfig))
    assert "FSDP2" in " ".join(lines[:3]) and "Mixtral" in " ".join(lines[:3])
