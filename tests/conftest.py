"""The suite's pytest hooks and session fixtures: threads shared between the workers, the order
and the quick selection of the files, the CPU report, one token cache for the session (so the
Shakespeare corpus is tokenized once), the fork server, each test's environment as it found it.
The harness the tests call (launching train.py, reading a run back) is harness.py."""

import os
import resource
import subprocess
import time
from pathlib import Path

import pytest

from harness import FORK_SERVER, PYTHON, TINY, assert_ok, run_train


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
# The files that mostly wait (on Slurm's scheduler, a signal's grace period, a rank killed on
# purpose: a fifth to a half of a core while they run) start beside the two launches that keep
# more than a core busy (the composition matrix on 2 ranks, FSDP2's 4- and 8-rank layouts), so
# that the cores they leave are used: run beside each other, as they had been, a waiting file and
# a one-process file left a core idle for minutes (tests/README.md). Only the order changes; a
# file missing here runs after these.
HEAVIEST_FIRST = (
    "test_composition.py",  # one launch of every pair: the suite's largest item (~3 min of a worker)
    "test_slurm.py",  # waits on Slurm's scheduler: beside the composition launch
    "test_fsdp2.py",  # 4- and 8-rank launches: the next worker free takes them
    "test_checkpoint.py",  # kill -9 and SIGTERM runs, which wait: beside FSDP2's launches
    "test_faults.py",
    "test_bench.py",
    "test_sweep.py",
    "test_distributed.py",
    "test_ds_configs.py",
    "test_moe.py",
    "test_evaluate.py",
    "test_optimizers.py",
    "test_ds_pipeline.py",
    "test_documents.py",
    "test_readme.py",
    "test_train.py",
    "test_throughput.py",  # its ruler's arms, ~30 s in one test
    "test_torch_pipeline.py",
    "test_zero_bubble.py",
    "test_generate.py",
    "test_long_context.py",
    "test_tp.py",
    "test_search.py",
    "test_compare.py",
    "test_suite_tools.py",
    "test_docs.py",
    "test_launcher_contract.py",
    "test_ops.py",
    "test_startup.py",
    # Last, the in-process files of many short tests (a second or less each): whichever worker
    # finishes first waits only seconds for the other. A file of a few long tests here (a 30-s
    # test in test_throughput had run last) left one core idle for the suite's last half-minute.
    "test_bad_values.py",
    "test_estimate.py",
    "test_data.py",
    "test_config.py",
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
    "test_ds_pipeline.py::test_gpt2_pipeline_matches_data_parallel",  # DeepSpeed's PipelineModule
    "test_torch_pipeline.py::test_schedule_matches_no_pipeline[gpipe]",  # torch's pipelining
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


def pytest_collection_finish(session):
    """What the collection imported (torch, transformers, Hydra, lmrepo: ~440k objects) out of
    every later collection of the worker's heap, as train.py and the fork server do after their
    imports: each full collection of the worker's in-process tests walked all of it again
    (test_config and test_estimate in one process: 38 full collections, 15.5 of its 109 CPU-s;
    after the freeze 7.2)."""
    import gc

    gc.collect()
    gc.freeze()


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
    while it imports, launches wait for it (tools/start_ranks.py; started the old way, each rank
    paid the imports again beside the server's). LMREPO_TEST_FORK_SERVER=off: none."""
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
    os.environ["LMREPO_TEST_FORK_SERVER_PID"] = f"{server.pid}:{path}"  # launches wait while it imports
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


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A two-node Slurm cluster on this machine for the session (harness.start_slurm_cluster), torn
    down after: its slurm.conf. Needs Debian's slurmctld and slurmd, which `make setup` installs as
    root, and root, as slurmd runs jobs as their users."""
    import shutil
    import tempfile

    from harness import start_slurm_cluster, stop_slurm_cluster

    if not all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "sinfo")):
        pytest.skip("Slurm's daemons are not installed (make setup installs Debian's slurmctld and slurmd as root)")
    if os.getuid() != 0:
        pytest.skip("slurmd runs jobs as their users: the test cluster needs root")
    root = Path(tempfile.mkdtemp(prefix="lmrepo-slurm-"))
    try:
        yield start_slurm_cluster(root)
    finally:
        stop_slurm_cluster(root)
        shutil.rmtree(root, ignore_errors=True)
