"""DeepSpeed's JIT-built ops (lmrepo/utils/ops.py): a directory and a ninja per interpreter, each build
kept once per machine for every later environment, a line before a build, and no build a
single-process run does not use."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import PYTHON, REPO, TINY, assert_ok, run_train

BIN = str(Path(sys.executable).parent)


def python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, cwd=REPO)


def test_a_single_process_run_compiles_nothing(tmp_path):
    """Its CPU all-reduce has no one to reduce with: the op is not built (minutes on a new machine)."""
    proc = run_train(
        [*TINY, "trainer.max_steps=2", "logger=none"],
        tmp_path / "run",
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "LMREPO_OPS_CACHE": str(tmp_path / "kept")},
    )
    assert_ok(proc)
    for built in (tmp_path / "ext", tmp_path / "kept"):
        assert not built.exists() or not any(built.iterdir())
    assert "compiling" not in proc.stderr


def test_a_build_is_announced_before_it_compiles(tmp_path):
    """A real build of the CPU all-reduce with a compiler that fails at once: lmrepo's line comes
    first, naming the op and how to build it ahead."""
    code = (
        "from lmrepo.utils import ops; ops.pin_builds(); ops.announce_builds()\n"
        "from deepspeed.ops.op_builder import ShareMemCommBuilder as B; B().load(verbose=False)"
    )
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "LMREPO_OPS_CACHE": str(tmp_path / "kept")}
    proc = python(code, {**env, "CXX": "false", "LOCAL_RANK": "0"})
    assert proc.returncode != 0
    first = next(line for line in proc.stderr.splitlines() if line.startswith("lmrepo:"))
    assert first.startswith("lmrepo: compiling DeepSpeed's deepspeed_shm_comm op"), proc.stderr[-2000:]
    assert "make setup OPS=shm" in first


@pytest.mark.parametrize("age_s", [0, 7200], ids=["building", "stale"])
def test_a_wait_on_another_build_says_so_plainly(tmp_path, age_s):
    """Another process's build lock: a fresh one is that process building (another rank, another
    job), said as such; only a lock older than any build suggests removing it. The process waits
    until the lock goes, then builds (with a compiler that fails at once)."""
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    code = (
        "from lmrepo.utils import ops; ops.pin_builds(); ops.announce_builds()\n"
        "from deepspeed.ops.op_builder import ShareMemCommBuilder as B; B().load(verbose=False)"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "false", "LOCAL_RANK": "0"}
    env["LMREPO_OPS_CACHE"] = ""
    proc = subprocess.Popen([PYTHON, "-c", code], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    note = next(line for line in proc.stderr if line.startswith("lmrepo:"))
    lock.unlink()  # the other build ends
    proc.communicate(timeout=600)
    if age_s:
        assert "min old" in note and f"left {lock}; remove it" in note
    else:
        assert note.startswith("lmrepo: another process is building DeepSpeed's deepspeed_shm_comm op")
        assert "remove" not in note and "interrupted" not in note


def test_builds_are_per_interpreter_with_its_own_ninja(tmp_path):
    """Started without the venv on PATH (the system's ninja, another version), lmrepo still
    compiles with the venv's ninja, into a directory named after the venv: no rebuilds back and
    forth between activated and plain starts, or between checkouts."""
    if not Path(BIN, "ninja").is_file():
        pytest.skip("this interpreter has no ninja of its own")
    plain_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != BIN)
    code = (
        "import shutil; from lmrepo.utils import ops; ops.pin_builds(); print(shutil.which('ninja'), ops.build_root())"
    )
    env = {"PATH": plain_path, "TORCH_EXTENSIONS_DIR": "", "XDG_CACHE_HOME": str(tmp_path)}
    ninja, root = python(code, env).stdout.split()
    assert ninja == str(Path(BIN, "ninja"))
    assert Path(root).parent == tmp_path / "torch_extensions"
    other = python(code.replace("from lmrepo", "import sys; sys.prefix = '/another/venv'; from lmrepo"), env)
    assert other.stdout.split()[1] != root


def test_a_users_directory_is_kept(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "mine")}
    code = "import os; from lmrepo.utils import ops; ops.pin_builds(); print(os.environ['TORCH_EXTENSIONS_DIR'])"
    assert python(code, env).stdout.strip() == str(tmp_path / "mine")


LOAD_SHM = (
    "from lmrepo.utils import ops; ops.pin_builds(); ops.announce_builds()\n"
    "from deepspeed.ops.op_builder import ShareMemCommBuilder as B; m = B().load(verbose=False)\n"
    "print('loaded', m.__file__, callable(m.initialize))"
)


def test_a_build_is_kept_for_every_later_environment(tmp_path):
    """The CPU all-reduce built once (by make setup, or here) is loaded by an environment whose
    own build directory is empty, as a second checkout's: no compile, no line, the same library."""
    first = python(LOAD_SHM, {"LOCAL_RANK": "0"})
    assert first.returncode == 0, first.stderr[-2000:]
    fresh = tmp_path / "another-checkout"
    second = python(LOAD_SHM, {"TORCH_EXTENSIONS_DIR": str(fresh), "LOCAL_RANK": "0"})
    assert second.returncode == 0, second.stderr[-2000:]
    _, library, works = next(line for line in second.stdout.splitlines() if line.startswith("loaded ")).split()
    assert works == "True"
    assert not fresh.exists() or not any(fresh.rglob("*.so")), "compiled again"
    assert "compiling" not in second.stderr
    assert Path(library).parent.parent == Path(os.environ["LMREPO_OPS_CACHE"])


def test_the_cache_key_names_what_makes_the_build(monkeypatch):
    """Another CPU (its flags: -march=native), compiler, DeepSpeed or torch is another build."""
    from lmrepo.utils import ops

    key = ops.cache_key("cpu_adam")
    assert key.startswith("cpu_adam-") and key == ops.cache_key("cpu_adam")
    monkeypatch.setattr(ops, "cpu_flags", lambda: "sse sse2")
    assert ops.cache_key("cpu_adam") != key
    monkeypatch.undo()
    monkeypatch.setattr(ops, "compiler_identity", lambda: "clang version 19")
    assert ops.cache_key("cpu_adam") != key
    import deepspeed

    monkeypatch.undo()
    monkeypatch.setattr(deepspeed, "__version__", "0.0.1")
    assert ops.cache_key("cpu_adam") != key
