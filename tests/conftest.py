"""Shared test helpers: compose real configs, and launch real train.py runs on the CPU.

Every run uses TINY (a 2-layer, 64-wide GPT-2 on 32-token blocks of GPT-2's bytes, fp32: a test that
is about a precision or a vocabulary says so) and a token cache shared by the whole session, so the
Shakespeare corpus is tokenized once.
"""

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmrepo.distributed.device import Device
from lmrepo.distributed.launch import free_port, launch_command  # noqa: F401  (tests import free_port from here)
from lmrepo.plan.compose import compose_config  # noqa: F401  (tests import it from here)

# Devices as DeepSpeed's accelerators describe them, for checks that depend on the hardware.
CPU = Device("cpu", fp16=False, bf16=True, native_bf16=True, description="CPU (test)")
CPU_WITHOUT_BF16 = Device("cpu", fp16=False, bf16=True, native_bf16=False, description="CPU (test, AVX2)")
GPU = Device("cuda", fp16=True, bf16=True, native_bf16=True, description="GPU (test, compute capability 8.0)")

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
START_RANKS = REPO / "tests" / "tools" / "start_ranks.py"
FORK_SERVER = REPO / "tests" / "tools" / "fork_server.py"


def pin_op_builds() -> None:
    """Where this session's runs find DeepSpeed's ops (shm all-reduce, CPU Adam, async I/O), fixed
    once in the environment every run inherits, also runs given another HOME (rebuilding under it
    would add a minute to every process): the machine's cache, where `make setup` built them
    (scripts/build_ops.py, with tools/g++-for-tests), and train.py's build directory for any op
    the cache lacks. CXX is left alone: inductor compiles with it too, and the wrapper, a Python
    script, cost a process start per compile of every compiled case."""
    from lmrepo.utils import ops

    if (cache := ops.machine_cache()) is not None:
        os.environ["LMREPO_OPS_CACHE"] = str(cache)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ops.build_root())  # train.py's, for this interpreter
    # This interpreter's ninja first on PATH for every process the tests start, as train.py's
    # pin_builds does for its own: a process that builds an op without it (a benchmark's worker,
    # a probe) took the system's ninja when the suite ran without the venv activated, and two
    # ninja versions rebuild each other's ops (measured: the shm op built 3 times in one suite).
    ops.interpreter_ninja_first()


def wait_passively_for_openmp_work() -> None:
    """`make test` runs two test files at once on as many cores, and a single-process run takes a
    thread per core: libgomp's idle threads spin between parallel regions (with OMP_WAIT_POLICY
    unset), burning the core the other worker's processes need. Passive waiting gives it back,
    with the same results. Unless the user chose a policy."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def share_the_cores_between_workers() -> None:
    """`make test` runs two test files at once (pytest-xdist's workers) on a machine of as many
    cores: each worker, and every process its tests start, takes its share of the cores, as CPU
    ranks do (lmrepo.distributed.launch.share_cpu_cores). Otherwise each single-process run takes a thread per
    core beside the other worker's processes: three files (test_train, test_checkpoint,
    test_evaluate) took 546 s against 414 s with one thread each, on a 2-core EPYC. Unless the user
    set OMP_NUM_THREADS; without xdist's workers nothing changes."""
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


pin_op_builds()
wait_passively_for_openmp_work()
share_the_cores_between_workers()


# The files that launch the most runs (and the JIT builds of DeepSpeed's ops), heaviest first, as
# measured with --cpu-report (tests/README.md). `make test` hands whole files to its two workers in
# collection order (--dist loadfile --no-loadscope-reorder): long files first, the short in-process
# ones last, so both workers finish together instead of one running a long file alone at the end.
# Only the order changes; a file missing here runs after these.
HEAVIEST_FIRST = (
    "test_composition.py",  # one launch of every pair: the suite's largest item (~17 min of a worker on an EPYC)
    "test_distributed.py",
    "test_ds_configs.py",
    "test_checkpoint.py",
    "test_moe.py",
    "test_sweep.py",
    "test_evaluate.py",
    "test_faults.py",
    "test_fsdp2.py",
    "test_optimizers.py",
    "test_pipeline.py",
    "test_documents.py",
    "test_readme.py",
    "test_train.py",
    "test_bench.py",
    "test_pipelining.py",
    "test_zero_bubble.py",
    "test_generate.py",
    "test_long_context.py",
    "test_tp.py",
    "test_search.py",
    "test_compare.py",
)


# `make test-quick` (-m quick): the files that check in process (configs, rules, arithmetic, data,
# messages, the suite's own tools), and one real case of each engine and of a single process.
QUICK_FILES = (
    "test_architecture.py",
    "test_config.py",
    "test_cpu_malloc.py",
    "test_data.py",
    "test_estimate.py",
    "test_ops.py",
    "test_ports.py",
    "test_reference.py",
    "test_startup.py",
    "test_suite_tools.py",
)
ONE_CASE_EACH = (
    "test_train.py::test_default_job_writes_the_run_directory_contract",  # one process
    "test_distributed.py::test_zero_stages_agree_fp32[2]",  # DeepSpeed ZeRO-2 against ZeRO-0, 2 ranks
    "test_fsdp2.py::test_fsdp2_equals_one_process",  # FSDP2, 2 ranks
    "test_pipeline.py::test_gpt2_pipeline_matches_data_parallel",  # DeepSpeed's PipelineModule
    "test_pipelining.py::test_schedule_matches_no_pipeline[gpipe]",  # torch's pipelining
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        if item.path.name in QUICK_FILES or item.nodeid.split("/")[-1] in ONE_CASE_EACH:
            item.add_marker(pytest.mark.quick)


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-report",
        metavar="FILE",
        help="append one line per test to FILE: CPU seconds (its own and its processes'), wall seconds, "
        "test id, pytest-xdist worker, end time (Unix seconds)",
    )
    parser.addoption(
        "--tolerance-report",
        metavar="FILE",
        help="append one line per numeric comparison (tests/numerics.py): the worst relative difference, "
        "the tolerance, their ratio, test id, what was compared",
    )


def pytest_configure(config):
    import numerics

    if report := config.getoption("tolerance_report"):
        numerics.REPORT = Path(report).resolve()


def cpu_seconds() -> float:
    """User + system CPU of this process and of every child process it (or they) waited for, and
    of the launches the fork server ran for it (its launchers count them in a file)."""
    own = sum(
        u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )
    try:
        tally = Path(os.environ.get("LMREPO_TEST_FORK_SERVER", "") + ".cpu").read_text().split()
    except OSError:
        tally = []
    return own + sum(map(float, tally))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """--cpu-report: where the suite's time goes. The suite is CPU-bound, and with two workers on
    two cores a test's wall time also counts the other worker's load; its CPU seconds include the
    runs it launched (every rank, the launcher, their JIT builds). Fixture setup is charged to the
    first test that uses it."""
    if not (report := item.config.getoption("cpu_report")):
        yield
        return
    start_cpu, start = cpu_seconds(), time.time()
    yield
    end, worker = time.time(), os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(report, "a") as f:  # one short appended line per test: whole even with two workers
        f.write(f"{cpu_seconds() - start_cpu:.1f}\t{end - start:.1f}\t{item.nodeid}\t{worker}\t{end:.1f}\n")


TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "data.block_size=32",
    "trainer.micro_batch_size=4",
    "trainer.max_steps=6",
    "schedule.warmup_steps=1",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.eval_batches=2",
    "logger=jsonl",
    "precision=fp32",
    "model.tokenizer=bytes",
    "model.vocab_size=257",
]
# TINY tokenizes by GPT-2's bytes (257 tokens: lmrepo.data.tokenizer.gpt2_bytes); GPT2 puts its BPE back,
# for a test about that vocabulary (50,257 rows: the embedding is then 97% of TINY's parameters).
GPT2 = ("model.tokenizer=gpt2", "model.vocab_size=50257")
BERT = ("model=bert-tiny", "model.tokenizer=bert", "model.vocab_size=30522")  # after TINY: its WordPiece back
# TINY in bf16, one sequence per micro batch: on a CPU without native bf16 every bf16 matmul takes a
# slow path (~70x fp32), so a TINY step costs by the token. The parity and resume checks hold at any
# batch size.
BF16 = ("precision=bf16", "trainer.micro_batch_size=1")


@pytest.fixture(scope="session", autouse=True)
def shm_buffers():
    """Runs killed on purpose (kill -9 tests) cannot unlink DeepSpeed's /dev/shm all-reduce
    buffers themselves: at the end, remove those no live process maps, as a run's start does
    (lmrepo.distributed.launch.remove_stale_shm: a minute old, so that the buffers another pytest worker's run
    is creating right now stay; removing those once hung that run's ranks in DeepSpeed's init)."""
    from lmrepo.distributed.launch import remove_stale_shm

    yield
    remove_stale_shm()


def shared_temp(tmp_path_factory) -> Path:
    """The session's temporary root that every pytest-xdist worker shares (each worker's own
    basetemp is inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """One lmrepo cache for the session, across workers too: Shakespeare is tokenized once (the
    prepare step holds a file lock) and the CPU asked about once (lmrepo.utils.cpuinfo_cache)."""
    cache = os.environ.get("LMREPO_TEST_CACHE") or str(shared_temp(tmp_path_factory) / "lmrepo-cache")
    Path(cache).mkdir(exist_ok=True)
    os.environ["LMREPO_CACHE"] = cache
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return Path(cache)


@pytest.fixture(scope="session", autouse=True)
def fork_server(token_cache, tmp_path_factory):
    """The worker's fork server (tests/tools/fork_server.py): torch and transformers imported once,
    every direct launch's processes forked from it. Started once the session's environment is set
    (token_cache), since a launch in another environment is refused by it and started the old way;
    until it is listening, launches start the old way too. LMREPO_TEST_FORK_SERVER=off: none."""
    import shutil
    import tempfile

    if os.environ.get("LMREPO_TEST_FORK_SERVER") == "off":
        yield None
        return
    folder = tempfile.mkdtemp(prefix="lmrepo-forks-")  # short: a socket's path has at most 107 bytes
    path = os.path.join(folder, "socket")
    os.environ["LMREPO_TEST_FORK_SERVER"] = path
    # Its log (each launch it left to start_ranks.py, and why) stays with the session's temporary files.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(shared_temp(tmp_path_factory) / f"fork-server-{worker}.log", "w") as log:
        server = subprocess.Popen([PYTHON, str(FORK_SERVER), path], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    yield path
    server.terminate()
    server.wait(timeout=60)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def environment_as_it_was():
    """Each test leaves the worker's environment as it found it. In-process code sets variables for
    good (lmrepo's evaluation sets HF_HUB_OFFLINE, lm-eval's import KMP_DUPLICATE_LIB_OK,
    huggingface_hub's HF_XET_HIGH_PERFORMANCE): every later test's runs would inherit them, other
    runs than the same test run alone gets, and the fork server refuses launches whose import-time
    variables differ from its own. pytest's own variable stays pytest's to remove."""
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[name]
    for name, value in before.items():
        if name != "PYTEST_CURRENT_TEST" and os.environ.get(name) != value:
            os.environ[name] = value


def fork_server_listening(path: str | None, timeout: float = 120) -> bool:
    """Waits until the fork server at `path` is listening (for a test of the server itself)."""
    deadline = time.monotonic() + timeout
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)
    return bool(path) and os.path.exists(path)


def launcher(ranks: int, via: str = "direct") -> list[str]:
    """The command that starts a script on `ranks` CPU ranks (0: one process, as plain `python`):
    the ranks started directly, one process each with the env:// variables, as srun starts them
    (tests/tools/start_ranks.py, forked from the worker's fork server), or `torchrun` or
    `deepspeed`, the launchers users type, under
    which the ranks run the same way (lmrepo.distributed.launch gives DeepSpeed's shared-memory all-reduce
    LOCAL_SIZE under each). A launcher only where the test is about it (a signal it forwards, a rank
    it ends, its exit code on a refusal, `--local_rank`, a command a user types): torchrun's agent
    imports torch before the first rank starts, and DeepSpeed's runner and launch.py each import
    all of DeepSpeed (benchmarks/bench_launchers.py measures the three)."""
    if via == "direct":
        return [PYTHON, str(START_RANKS), str(ranks)]
    return launch_command(ranks, via)


# `python`, forked from the worker's fork server (launcher(0)): for the scripts the tests run
# (export, generate, compare, estimate), which import torch as train.py does.
FORKED_PYTHON = [PYTHON, str(START_RANKS), "0"]


def run_train(
    overrides: list[str],
    run_dir: Path,
    ranks: int = 0,
    timeout: int = 900,
    env: dict | None = None,
    via: str = "direct",
) -> subprocess.CompletedProcess:
    """`python train.py` (ranks=0), or train.py on `ranks` ranks started by `via` (see launcher)."""
    cwd = next(p for p in run_dir.parents if p.is_dir())
    return subprocess.run(
        [*launcher(ranks, via), str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def popen_train(overrides: list[str], run_dir: Path, ranks: int = 0) -> subprocess.Popen:
    """A TINY run left running (its own process group): for tests that signal or race it. Ranks
    start under DeepSpeed's launcher: what it does with a signal or a dead rank is under test."""
    return subprocess.Popen(
        [*launcher(ranks, "deepspeed"), str(REPO / "train.py"), *TINY, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=next(p for p in run_dir.parents if p.is_dir()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 900) -> None:
    """Until `predicate()` holds; fails with the run's output if the run ends first, or ends it and
    fails after `timeout` seconds (the bound every launch of the suite has: a hung run fails its
    test, not the whole suite)."""
    import signal

    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no progress in {timeout:.0f} s: {proc.communicate()[0][-3000:]}")
        time.sleep(0.2)


def logged_train_steps(run_dir: Path) -> list[int]:
    """The step of each whole training line a running job has written (its last line may be half
    written)."""
    steps = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in record:
            steps.append(record["step"])
    return steps


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def kill_9_after_a_save(overrides: list[str], run_dir: Path, logged: int, steps_after: bool = False) -> str:
    """A 2-rank TINY run killed (SIGKILL to the launcher's process group, as an OOM killer or a lost
    node ends a job) once `latest` exists and `logged` lines are in its metrics; with `steps_after`,
    also once it has logged a step past `latest` that is not a save step (so that no save can
    complete between the check and the kill and move `latest` past every logged step: `logged`
    lines alone were reached at a save step once, with its checkpoint's line). Returns the
    checkpoint `latest` names then."""
    import signal

    def ready() -> bool:
        latest = run_dir / "checkpoints" / "latest"
        if not latest.exists() or logged_steps(run_dir) < logged:
            return False
        if not steps_after:
            return True
        every = int(next(w for w in reversed(overrides) if w.startswith("trainer.save_every=")).split("=")[1])
        last = max(logged_train_steps(run_dir), default=0)
        return last > int(latest.read_text().split("_")[1]) and last % every != 0

    proc = popen_train(overrides, run_dir, ranks=2)
    while True:
        wait_for(ready, proc)
        # Checked again with every process of the job stopped: a TINY step takes milliseconds, and
        # between a check of the running job and the kill a save could complete and move `latest`
        # past every logged step (a test process descheduled for a few steps' time).
        os.killpg(proc.pid, signal.SIGSTOP)
        if ready():
            break
        os.killpg(proc.pid, signal.SIGCONT)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return (run_dir / "checkpoints" / "latest").read_text()


def stop_with_signal(signum: int, overrides: list[str], run_dir: Path) -> tuple[int, str]:
    """A 2-rank TINY run signalled after 3 logged steps, as Slurm's pre-emption and a terminal's
    Ctrl-C do (the signal reaches every process of the job): it must save, say so in status.json
    and point `latest` at the save. Returns (the step it stopped at, its output)."""
    import signal

    proc = popen_train(overrides, run_dir, ranks=2)
    wait_for(lambda: logged_steps(run_dir) >= 3, proc)
    os.killpg(proc.pid, signum)
    output, _ = proc.communicate(timeout=300)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "stopped" and status["signal"] == signal.Signals(signum).name, output[-3000:]
    step = status["final"]["step"]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{step:08d}"
    return step, output


@pytest.fixture(scope="session")
def launch2(tmp_path_factory):
    """Runs a 2-rank TINY job once per set of overrides for the whole session, across pytest-xdist
    workers too (the parity, resume, pipeline and evaluation tests share them), and returns its
    run directory. Every run checkpoints at step 3."""
    import functools
    import hashlib

    from filelock import FileLock

    root = shared_temp(tmp_path_factory) / "ranks2"
    root.mkdir(exist_ok=True)

    @functools.cache
    def run(*overrides: str) -> Path:
        run_dir = root / hashlib.sha1("\0".join(overrides).encode()).hexdigest()[:12]
        done, failed = run_dir.with_suffix(".done"), run_dir.with_suffix(".failed")
        with FileLock(run_dir.with_suffix(".lock")):
            if not done.exists() and not failed.exists():
                proc = run_train([*TINY, "trainer.save_every=3", *overrides], run_dir, ranks=2)
                try:
                    assert_ok(proc)
                    done.write_text(" ".join(overrides))
                except AssertionError as err:
                    failed.write_text(str(err))
        assert not failed.exists(), failed.read_text()
        return run_dir

    return run


def env_without_wandb_key(home: Path) -> dict:
    """The environment of a user with no W&B key: no WANDB_* variables and a HOME without
    ~/.netrc. DeepSpeed's compiled ops stay where they are (pin_op_builds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(home)
    return env


def validate(cfg, world: int, device: Device) -> tuple[dict, list[str]]:
    """train.py's checks of a composed config for `world` ranks on `device`: (DeepSpeed dict,
    keys the user's JSON changed), or a ConfigError."""
    from lmrepo.plan.job import plan

    job = plan(cfg, world, device)
    return job.ds_config, job.user_changed


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    )


def summary_rows(stdout: str) -> dict[str, dict]:
    """The sweep launcher's closing table, by job number: {"0": {"overrides": ..., "status": ...}}
    (cells apart by two spaces or more; an empty last cell as "")."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("job  "))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 1 :]:
        if not line.startswith("#"):
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0][1:]] = dict(zip(header, cells + [""] * (len(header) - len(cells))))
    return rows
