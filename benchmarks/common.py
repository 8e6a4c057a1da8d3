"""What the benchmarks in this folder share: the repository's paths (and the repository on sys.path),
the machine, the CPU's matmul peak, the results files, timed runs of the default job and 2-rank
arms. bench.py's worker arms are arms.py's. Not part of the lmrepo package: the benchmarks import
it as `common` (a script's own folder is first on its sys.path).

- `machine`: what the figures were measured on; `measure_cpu_peak_tflops`: the CPU's matmul
  peak, the denominator of the CPU's MFU.
- `Report`, `add_save_flag`: every script prints through a Report and ends with `report.save(args.save,
  figures)`; with --save that writes benchmarks/results/<benchmark>_<machine>_<yyyy-mm>.md and .json.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # lmrepo and hydra_plugins/ (conf/train.yaml names its launcher) as train.py finds them
    sys.path.insert(1, str(REPO))

from lmrepo.compare import read_metrics  # noqa: E402
from lmrepo.utils import ops  # noqa: E402  (after the path above)

# train.py's build directory and ninja for DeepSpeed's ops, also in a worker that never starts
# lmrepo's process group: a benchmark started without the venv on PATH would otherwise build
# them with the system's ninja, and each ninja then rebuilds what the other built (lmrepo/utils/ops.py).
ops.pin_builds()

# What hides native bf16 from torch, as on an AMD Zen 3: oneDNN's kernels and ATen's dispatch capped at AVX2.
NO_BF16 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


# ---- the default job, timed (bench_precision.py, bench_malloc.py) ----

DEFAULT_JOB_TOKENS_PER_STEP = 8 * 128  # micro batch 8, 128-token blocks, one rank


def run_measured(cmd: list[str], run_dir: Path, env: dict | None = None) -> tuple[float, "os.struct_rusage"]:
    """Runs `cmd` for the run in `run_dir` (its output in run_dir.log); stops the benchmark if it
    fails. Returns its wall seconds and the kernel's account of it and every process it waited
    for (a launcher's ranks): CPU seconds, peak resident memory."""
    with open(run_dir.with_suffix(".log"), "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=run_dir.parent, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{run_dir.name} failed: see {run_dir.with_suffix('.log')}")
    return wall, usage


def time_default_job(run_dir: Path, overrides: list[str], steps: int, env: dict, untimed: int) -> dict:
    """`python train.py` (the default job with `overrides`) for `steps` steps, each one logged, its
    output in run_dir.log. Returns the median step time over the logged steps after the first
    `untimed` (they build kernels), the last loss, and the kernel's account of the process: system
    and user CPU seconds, peak resident memory."""
    _, usage = run_measured(
        [
            sys.executable,
            str(REPO / "train.py"),
            *overrides,
            f"trainer.max_steps={steps}",
            "trainer.log_every=1",
            "trainer.eval_every=0",
            "trainer.eval_batches=1",
            "logger=jsonl",
            f"hydra.run.dir={run_dir}",
        ],
        run_dir,
        env,
    )
    logged = [m for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m][untimed:]
    return {
        "step_s": statistics.median(DEFAULT_JOB_TOKENS_PER_STEP / m["tokens_per_s"] for m in logged),
        "sys_s": usage.ru_stime,
        "user_s": usage.ru_utime,
        "peak_gb": usage.ru_maxrss / 2**20,
        "loss": logged[-1]["loss"],
    }


# ---- the machine ----

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_fp16")  # what decides torch's CPU kernels here
# The first Xeon generation with each feature: Granite Rapids (AMX-FP16), Sapphire Rapids (AMX-BF16),
# Cooper Lake (AVX512-BF16); AVX-512 alone: Skylake to Ice Lake.
XEON_GENERATIONS = (("amx_fp16", "gnr"), ("amx_bf16", "spr"), ("avx512_bf16", "cpx"), ("avx512f", "avx512"))


def cpu_info() -> dict:
    """The CPU as Linux describes it (the first processor of /proc/cpuinfo): model name, vendor,
    family and model numbers, which of ISA_FLAGS it has, and the kernels torch dispatches to."""
    names = {"model name": "model", "vendor_id": "vendor", "cpu family": "family", "model": "number", "flags": "flags"}
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines():
            key, _, value = line.partition(":")
            if key.strip() in names:
                fields[names[key.strip()]] = value.strip()
    except OSError:  # not Linux: the model name is all there is
        pass
    flags = fields.get("flags", "").split()
    return {
        "model": fields.get("model") or platform.processor() or platform.machine(),
        "vendor": fields.get("vendor", ""),
        "family": int(fields["family"]) if fields.get("family", "").isdigit() else None,
        "number": int(fields["number"]) if fields.get("number", "").isdigit() else None,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def slug(text: str) -> str:
    """Lower case, runs of anything but letters and digits as one hyphen."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def machine_slug(cpu: dict, gpu: str | None = None) -> str:
    """The <machine> of a results file's name: the GPU's model (`h100`, `a100`, `rtx-4090`) when
    one was measured, else the CPU's family and generation (`xeon-spr`, `epyc-zen4`), else a
    slug of the CPU's model name."""
    if gpu:
        words = slug(re.sub(r"\b(nvidia|geforce|tesla|quadro)\b", " ", gpu, flags=re.I)).split("-")
        first_with_digit = next((i for i, w in enumerate(words) if re.search(r"\d", w)), len(words) - 1)
        return "-".join(words[: first_with_digit + 1]) or "gpu"
    name, isa, family, number = cpu["model"].lower(), set(cpu["isa"]), cpu["family"], cpu["number"] or 0
    if "xeon" in name:
        for flag, generation in XEON_GENERATIONS:
            if flag in isa:
                return f"xeon-{generation}"
        return "xeon"
    if "epyc" in name:
        zen = {23: "zen2" if number >= 0x30 else "zen1", 25: "zen4" if "avx512f" in isa else "zen3", 26: "zen5"}
        return f"epyc-{zen[family]}" if family in zen else "epyc"
    words = slug(re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b|@.*", " ", name)).split("-")
    return "-".join(words[:4]) or platform.machine().lower()


def machine() -> dict:
    """What bench.py's and bench_eval.py's tables were measured on (their own report; --save
    also writes the results-file header, `provenance`)."""
    import accelerate
    import deepspeed
    import transformers

    cpu = cpu_info()
    numbers = f" (family {cpu['family']}, model {cpu['number']})" if cpu["family"] is not None else ""
    return {
        "cpu": cpu["model"] + numbers,
        "isa": cpu["isa"],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


# ---- results files: what a benchmark printed, and where, when and how it was measured ----

RESULTS = Path(__file__).resolve().parent / "results"
# Environment variables that change what a run measures; the header lists those that were set.
MEASURED_ENV = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "ONEDNN_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "CUDA_VISIBLE_DEVICES",
    "LD_PRELOAD",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "GLIBC_TUNABLES",
    "TORCH_EXTENSIONS_DIR",
    "CXX",
)


# The tiny GPT-2 job the launch and start-up benchmarks time (tests/conftest.py's TINY, which the
# benchmarks do not import): each script adds its own step count and layout.
TINY_JOB = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "data.block_size=32",
    "trainer.micro_batch_size=4",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "logger=jsonl",
]


def add_save_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--save",
        action="store_true",
        help="also write benchmarks/results/<benchmark>_<machine>_<yyyy-mm>.md and .json "
        "(this machine's file of this month is overwritten)",
    )


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _command() -> str:
    """The command line as typed, the interpreter's path relative to the repository when it is inside it."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    try:
        argv[0] = str(Path(argv[0]).relative_to(REPO))
    except ValueError:
        pass
    return shlex.join(argv)


def _versions() -> dict:
    from importlib import metadata

    found = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("deepspeed", "transformers"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


class Report:
    """What a benchmark prints, kept for its results file. `report.print(...)` prints markdown
    and keeps it; `report.save(args.save, figures)`, the last call of the script's main(), writes
    benchmarks/results/<benchmark>_<machine>_<yyyy-mm>.md (a provenance header, then what was
    printed) and .json (the provenance and the raw figures) when --save was given. Created when the
    benchmark starts: the date, the command and the first load average are the start's. `device`
    "cpu" names the file after the CPU even where a GPU is visible (a benchmark of the CPU); `name`
    replaces the script's name in the file's (one script, two kinds of measurement)."""

    def __init__(self, script: str, device: str = "auto", name: str | None = None):
        self.benchmark = name or Path(script).stem
        self.lines: list[str] = []
        cpu = cpu_info()
        gpu = torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else None
        status = _git("status", "--porcelain", "--untracked-files=no").splitlines()
        self.provenance = {
            "benchmark": self.benchmark,
            "machine": machine_slug(cpu, gpu),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _git("rev-parse", "HEAD").strip() or None,
            "dirty": bool(status),
            "changed": [line[3:] for line in status],
            "command": _command(),
            "environment": {k: os.environ[k] for k in MEASURED_ENV if k in os.environ},
            "cpu": cpu,
            "gpu": gpu,
            "cores": {"os_cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))},
            "load_average": {"start": [round(x, 2) for x in os.getloadavg()], "end": None},
            "versions": _versions(),
        }

    def print(self, *values: object) -> None:
        text = " ".join(str(v) for v in values)
        print(text, flush=True)
        self.lines.append(text)

    def save(self, save: bool, figures: dict) -> None:
        if not save:
            return
        p = self.provenance
        p["load_average"]["end"] = [round(x, 2) for x in os.getloadavg()]
        name = f"{self.benchmark}_{p['machine']}_{p['date'][:7]}"
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps({"provenance": p, "figures": figures}, indent=1, default=str))
        (RESULTS / f"{name}.md").write_text(self.markdown())
        print(f"{self.benchmark}: wrote benchmarks/results/{name}.md and .json", file=sys.stderr)

    def markdown(self) -> str:
        p, cpu = self.provenance, self.provenance["cpu"]
        dirty = (
            f" (dirty: {len(p['changed'])} tracked files changed, listed in the .json)" if p["dirty"] else " (clean)"
        )
        commit = (p["commit"] or "unknown")[:12] + dirty
        load = p["load_average"]
        numbers = f" (family {cpu['family']}, model {cpu['number']})" if cpu["family"] is not None else ""
        rows = [
            ("date", p["date"]),
            ("commit", commit),
            ("command", f"`{p['command']}`"),
            ("environment", ", ".join(f"`{k}={v}`" for k, v in p["environment"].items()) or "none of note"),
            (
                "CPU",
                f"{cpu['model']}{numbers}; flags {' '.join(cpu['isa']) or 'none of ' + ', '.join(ISA_FLAGS)}; "
                f"torch CPU capability {cpu['capability']}",
            ),
            ("GPU", p["gpu"] or "none"),
            ("cores", f"{p['cores']['os_cpu_count']} (os.cpu_count), {p['cores']['affinity']} usable (affinity)"),
            ("load average", f"{' '.join(map(str, load['start']))} at start, {' '.join(map(str, load['end']))} at end"),
            ("versions", ", ".join(f"{k} {v}" for k, v in p["versions"].items())),
        ]
        header = [f"# {self.benchmark} on {p['machine']}, {p['date'][:7]}", "", "| | |", "| --- | --- |"]
        header += [f"| {k} | {v} |" for k, v in rows]
        # the script's own headings one level down, under this file's title
        body = [("#" + line) if line.startswith("#") else line for line in "\n".join(self.lines).splitlines()]
        return "\n".join([*header, "", "## Results", "", *body]).rstrip() + "\n"


def measure_cpu_peak_tflops(dtype: str, seconds: float = 2.0, n: int = 2048) -> float:
    """The CPU's matmul peak in `dtype` (fp32, bf16, fp16), measured: the best TFLOP/s of repeated
    square n x n torch.matmul with torch's current thread count, over about `seconds`.
    The best run, not the mean: MFU is measured against what the CPU can reach, and other
    processes on the machine only ever slow a run down. A smoke run passes a small n: a CPU
    without native bf16 computes a 2048 x 2048 bf16 matmul in about 17 s."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a, b = torch.randn(n, n).to(torch_dtype), torch.randn(n, n).to(torch_dtype)
    out = torch.empty(n, n, dtype=torch_dtype)
    torch.matmul(a, b, out=out)  # the first call picks and packs the kernel (oneDNN / MKL)
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        end = time.perf_counter()
        best = max(best, 2 * n**3 / (end - start) / 1e12)
        if end >= deadline:
            return best


# ---- the same batches for every arm ----


# ---- workers ----


# ---- model-state memory: an accounting of the tensors each rank holds ----


def two_rank_arm(overrides: list[str], steps: int, workdir: Path) -> dict:
    """One real `torchrun --nproc-per-node 2 train.py` run (fp32, logger=jsonl) of `overrides`:
    its step times (each logged step's tokens over its tokens/s), last loss, mem_gb and the peak
    resident set of its largest rank. Run it in a fresh interpreter (`two_rank_arm_in_child`):
    getrusage's ru_maxrss of children is the largest child so far, so a run that peaks lower
    than an earlier one of the same process would hide behind it."""
    import resource
    import tempfile

    from lmrepo.distributed.launch import launch_command

    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    cmd = [
        *launch_command(2, "torchrun"),
        str(REPO / "train.py"),
        *overrides,
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.eval_batches=1",
        "schedule.warmup_steps=1",
        "precision=fp32",
        "logger=jsonl",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
    logged = [m for m in read_metrics(run_dir / "metrics.jsonl") if "tokens_per_s" in m]
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "step_times": [(b["tokens"] - a["tokens"]) / b["tokens_per_s"] for a, b in zip(logged, logged[1:])],
        "loss": logged[-1]["loss"],
        "mem_gb": logged[-1]["mem_gb"],
        "tokens_per_step": logged[-1]["tokens"] / logged[-1]["step"],
        "peak_rss_gib": peak_kb / 2**20 if peak_kb > before else None,
    }


def two_rank_arm_in_child(overrides: list[str], steps: int, workdir: Path) -> dict:
    """`two_rank_arm` in a fresh interpreter (this file run as a script), so its peak memory is its own."""
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one-arm",
            json.dumps(overrides),
            "--steps",
            str(steps),
            "--workdir",
            str(workdir),
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:] or out.stdout[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def rows_from_two_ranks(script: str, argv: list[str]) -> dict:
    """Runs `script` on 2 ranks (torchrun, one thread each) with `argv` and `--rows FILE`, and
    returns what its rank 0 wrote there (the benchmarks whose ranks measure themselves)."""
    import tempfile

    from lmrepo.distributed.launch import launch_command

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix=f"lmrepo-{Path(script).stem}-") as tmp:
        rows = Path(tmp) / "rows.json"
        cmd = [*launch_command(2), str(Path(script).resolve()), *argv, "--rows", str(rows)]
        code = subprocess.run(cmd, cwd=REPO, env=env).returncode
        if code:
            raise SystemExit(code)
        return json.loads(rows.read_text())


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description="one arm of a two-rank benchmark (two_rank_arm_in_child)")
    _parser.add_argument("--one-arm", required=True)
    _parser.add_argument("--steps", type=int, required=True)
    _parser.add_argument("--workdir", required=True)
    _args = _parser.parse_args()
    print(json.dumps(two_rank_arm(json.loads(_args.one_arm), _args.steps, Path(_args.workdir))))
