"""What a rank does before its first step, made cheaper without changing what it does: py-cpuinfo
asked once per machine (DeepSpeed asks it at every CPU-op load), and train.py's imports without
the cyclic collector, which is on again (with the imports frozen) before training starts."""

import json
import os
import subprocess

import cpuinfo
import pytest

from harness import PYTHON, REPO, TINY
from lmrepo.utils import cpuinfo_cache


@pytest.fixture
def counted_asks():
    """py-cpuinfo's real get_cpu_info, counting its asks."""
    asks = []

    def ask():
        asks.append(1)
        return cpuinfo.get_cpu_info()

    return ask, asks


def test_the_cpu_is_asked_once_and_the_answer_kept(tmp_path, monkeypatch, counted_asks):
    monkeypatch.setenv("LMREPO_CACHE", str(tmp_path))
    ask, asks = counted_asks
    first = cpuinfo_cache.cached_answer(ask)
    assert cpuinfo_cache.cached_answer(ask) == first and len(asks) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"cpuinfo-{cpuinfo_cache.processor_key()}.json"]
    assert first["arch"] and first["flags"], "what DeepSpeed reads: the architecture and the flags"


def test_a_torn_cache_file_is_asked_again_and_rewritten(tmp_path, monkeypatch, counted_asks):
    monkeypatch.setenv("LMREPO_CACHE", str(tmp_path))
    path = tmp_path / f"cpuinfo-{cpuinfo_cache.processor_key()}.json"
    path.write_text('{"arch": "X86_')  # a rank killed mid-write (the rename makes this unlikely)
    ask, asks = counted_asks
    answer = cpuinfo_cache.cached_answer(ask)
    assert len(asks) == 1 and json.loads(path.read_text()) == answer


def test_an_unwritable_cache_still_answers(tmp_path, monkeypatch, counted_asks):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LMREPO_CACHE", str(blocker / "cache"))
    ask, asks = counted_asks
    assert cpuinfo_cache.cached_answer(ask)["arch"] and len(asks) == 1


def test_deepspeeds_op_builders_read_the_cached_answer(tmp_path):
    """The path DeepSpeed takes (`from cpuinfo import get_cpu_info` inside its builders) reads the
    file: a processor recorded without SIMD flags makes cpu_adam's builder pick scalar code."""
    (tmp_path / f"cpuinfo-{cpuinfo_cache.processor_key()}.json").write_text(json.dumps({"arch": "X86_64", "flags": []}))
    code = (
        "from lmrepo.utils import cpuinfo_cache; cpuinfo_cache.install(); "
        "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder; print(CPUAdamBuilder().simd_width())"
    )
    proc = subprocess.run(
        [PYTHON, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "LMREPO_CACHE": str(tmp_path), "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "-D__SCALAR__"


def test_train_py_collects_again_once_its_imports_are_done(tmp_path):
    """A refusal after the imports (an unreadable tokenizer is found in train()), run through
    train.py's __main__: the collector is on, and the imports' objects are frozen out of it."""
    code = (
        "import gc, runpy, sys; sys.argv = sys.argv[1:]\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
        "print(code, gc.isenabled(), gc.get_freeze_count())"
    )
    proc = subprocess.run(
        [
            PYTHON,
            "-c",
            code,
            str(REPO / "train.py"),
            *TINY,
            f"model.tokenizer={tmp_path / 'none'}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    code, enabled, frozen = proc.stdout.split()[-3:]
    assert code == "2" and "model.tokenizer" in proc.stderr, proc.stderr[-2000:]
    assert enabled == "True" and int(frozen) > 100_000
