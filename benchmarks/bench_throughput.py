"""lmrepo's training step against a hand-tuned loop on the same model, data and device: the ruler
for throughput. Every arm trains the same model (train.py's preset and seed) on the same batches
(the blocks train.py reads) for the same steps, one process each, one after another:

- R0, the hand-tuned loop: the transformers model train.py builds (GPT-2 with the fused GELU),
  fp32 weights, bf16 autocast (when the job is bf16), torch.compile'd, torch's fused AdamW,
  clipping on the device, every batch on the device before the clock starts, nothing read back
  until the timing window ends; on a CPU, glibc's malloc keeping freed memory as train.py's does
  (lmrepo.utils.cpu_malloc). Run first and last: the two say how much the machine drifted.
- R1, the DeepSpeed tutorials' bare loop (`engine(**batch).loss; engine.backward(loss);
  engine.step()`) on the DeepSpeed engine and config train.py builds.
- train.py's arms: `python train.py` itself (in the worker process, unchanged) as shipped and
  with the overrides each arm names: ZeRO-0 as shipped (on a GPU trainer.compile=null compiles),
  eager, ZeRO-1 compiled, FSDP2 compiled, ZeRO-3 as shipped and with its parameters kept whole.

Per arm: tokens/s and ms/step (median over the timed steps: R0 and R1 time each step with CUDA
events, train.py arms over their logging windows), the ratio to R0 (the figure), MFU, peak
memory, the loss at a fixed step, the first step's extra seconds (compile, allocation), and the
host's waits for the device per step (lmrepo.observability.host_syncs: CUDA's own count on a GPU, reads of
tensor values on a CPU), counted over steps after the timed ones.

    python benchmarks/bench_throughput.py          # GPU: GPT-2 124M, bf16, 8 x 1024, then the largest micro batch
    python benchmarks/bench_throughput.py --quick  # smoke: a 2 x 64 GPT-2, fp32, eager, 10 steps (~1 min)
    python benchmarks/bench_throughput.py --host   # the host's work per step, on the CPU (~2 min)
    python benchmarks/bench_throughput.py --save   # also writes benchmarks/results/bench_throughput_*
    python benchmarks/bench_throughput.py --arms R0,ds-z0 model.n_layer=6   # some arms; train.py overrides

On a CPU without --quick: the default job (gpt2-tiny, precision=auto, 8 x 128), R0 compiled; the
bf16-autocast arm only where the CPU computes bf16 natively (elsewhere each bf16 matmul takes a
slow path, ~70x fp32, and the arm measures that). Exit 0 when every arm ran, 1 when one failed or
ran out of --budget (its reason printed).

--host measures, on the CPU, what a GPU step at a small micro batch is mostly made of: the host's
work per step (Python, torch's dispatch, DeepSpeed's and FSDP2's hooks, the optimizer's loops). The
model has GPT-2 124M's 12 layers at width 64 and reads 1 x 16 tokens, so a step computes almost
nothing; every arm is eager. CUDA's own launch costs are not in it, and torch's optimizers pick
another implementation on a CPU than on a GPU where lmrepo does not choose one.
"""

import argparse
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import arms  # benchmarks/arms.py: the worker arms bench.py shares

from common import REPO, Report, add_save_flag

PYTHON = sys.executable
PYTHONPATH = os.environ.get("PYTHONPATH")  # the workers' too (a GPU machine's carried packages are on it)
GPU_JOB = ["model=gpt2", "data.block_size=1024", "trainer.micro_batch_size=8", "precision=bf16"]
# The two CPU sizes share a narrow GPT-2 in fp32, eager.
NARROW_EAGER = ["model.n_head=2", "model.n_embd=64", "precision=fp32", "trainer.compile=false"]
QUICK_JOB = ["model.n_layer=2", *NARROW_EAGER, "data.block_size=32", "trainer.micro_batch_size=2"]
# --host: GPT-2 124M's depth (its 148 parameters, its operations per step) at width 64 and 1 x 16
# tokens, so that a step computes almost nothing and its time is the host's work per step.
HOST_JOB = ["model.n_layer=12", *NARROW_EAGER, "data.block_size=16", "trainer.micro_batch_size=1"]
# Every train.py arm: metrics at the logging interval as shipped, one evaluation batch at the end.
TRAIN_KEYS = ["logger=jsonl", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.save_every=0"]

# (name, kind, train.py overrides of the arm, what it is). Kinds: r0, r1 (bare loops), train.
ARMS = [
    ("R0", "r0", [], "hand-tuned loop: compiled (eager in --quick and --host), fused AdamW, nothing read back"),
    ("ds-z0", "train", [], "train.py as shipped (DeepSpeed ZeRO-0; trainer.compile=null)"),
    ("fsdp2", "train", ["engine=fsdp2", "trainer.compile=true"], "train.py engine=fsdp2 (ZeRO-3-like), compiled"),
    ("R1", "r1", [], "bare DeepSpeed loop (the tutorials'), ZeRO-0, eager"),
    ("ds-z1-compiled", "train", ["zero=stage1", "trainer.compile=true"], "train.py zero=stage1, compiled"),
    ("ds-z0-eager", "train", ["trainer.compile=false"], "train.py trainer.compile=false"),
    ("ds-z3", "train", ["zero=stage3"], "train.py zero=stage3 as shipped"),
    (
        "ds-z3-whole",
        "train",
        ["zero=stage3", "zero.stage3_param_persistence_threshold=1e12"],
        "train.py zero=stage3, every parameter kept whole (persistence threshold above the model)",
    ),
    (
        "ds-z0-autocast",
        "train",
        ["precision=fp32", f"deepspeed_config={Path(__file__).with_name('torch_autocast_bf16.json')}"],
        "train.py with DeepSpeed's torch_autocast (fp32 weights, bf16 autocast, as R0) in place of its bf16",
    ),
    ("R0-last", "r0", [], "R0 again: the drift of the machine over the run"),
]
# The smoke run: one arm of each kind, eager.
QUICK_ARMS = ("R0", "ds-z0", "fsdp2", "R1")
HOST_ARMS = ("R0", "ds-z0", "fsdp2", "R1", "ds-z3", "R0-last")
# At the largest micro batch: the ruler and the two defaults.
LARGE_ARMS = ("R0", "ds-z0", "fsdp2")
# The order the arms run in: what the figure needs first (R0, the defaults, the large micro batch),
# so that a --budget cut leaves the least of it out; R0 again last. (name, at the large micro batch)
RUN_ORDER = [
    ("R0", False),
    ("ds-z0", False),
    ("fsdp2", False),
    ("R0", True),
    ("ds-z0", True),
    ("R1", False),
    ("ds-z3", False),
    ("ds-z3-whole", False),
    ("ds-z0-autocast", False),
    ("ds-z1-compiled", False),
    ("ds-z0-eager", False),
    ("fsdp2", True),
    ("R0-last", False),
]


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, fp32, eager, few steps: a smoke run")
    parser.add_argument(
        "--host", action="store_true", help="on the CPU, a model too narrow to compute: the host's work per step"
    )
    parser.add_argument("--arms", help="comma-separated arm names (default: all)")
    parser.add_argument("--warmup", type=int, help="steps before timing (GPU 10, CPU 5, quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps (GPU 60, CPU 20, host 40, quick 4)")
    parser.add_argument("--count-steps", type=int, help="steps whose host syncs are counted, after the timed ones")
    parser.add_argument("--large", default="auto", help="the large micro batch: auto (fills 80%% of the GPU) | N | 0")
    parser.add_argument("--budget", type=float, default=0, help="seconds for all arms (0: no limit)")
    parser.add_argument("--arm-timeout", type=float, default=900, help="seconds an arm may take")
    parser.add_argument("--out", help="directory for runs, logs and results (a new temporary one)")
    add_save_flag(parser)
    for hidden in ("--worker", "--spec", "--result"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    return parser.parse_known_args()


# ---- worker side: one arm in this process ----


def timed_steps(step, spec: dict, device) -> dict:
    """Runs `step(i)` (one optimizer step on the i-th step's batches; returns the loss tensor) for
    warmup + timed + counted steps. Returns the median step seconds over the timed ones, the first
    step's extra seconds, the losses, peak memory and the host syncs per counted step."""
    import torch

    from lmrepo.observability.host_syncs import host_sync_counter

    cuda = device.type == "cuda"
    warmup, timed, counted = spec["warmup"], spec["timed"], spec["count_steps"]
    losses = []

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    synchronize()
    start = time.perf_counter()
    losses.append(step(0))
    synchronize()
    first = time.perf_counter() - start
    # after a whole step: weights, optimizer states and whatever the step keeps between steps
    resident_gb = torch.cuda.memory_allocated() / 2**30 if cuda else None
    for i in range(1, warmup):
        losses.append(step(i))
    synchronize()
    if cuda:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(timed + 1)]
        events[0].record()
        for i in range(timed):
            losses.append(step(warmup + i))
            events[i + 1].record()
        synchronize()
        times = [a.elapsed_time(b) / 1000 for a, b in zip(events, events[1:])]
    else:
        times = []
        for i in range(timed):
            start = time.perf_counter()
            losses.append(step(warmup + i))
            times.append(time.perf_counter() - start)
    counter, syncs = host_sync_counter(device.type).start(), []
    for i in range(counted):
        before = counter.count
        losses.append(step(warmup + timed + i))
        syncs.append(counter.count - before)
    synchronize()
    return {
        "step_s": statistics.median(times),
        "first_extra_s": first - statistics.median(times),
        "losses": [float(x) for x in losses],
        "peak_gb": memory_gb(device),
        "resident_gb": resident_gb,
        "syncs_per_step": statistics.median(syncs) if syncs else None,
        "syncs_max": max(syncs) if syncs else None,
    }


def memory_gb(device) -> float:
    import torch

    from lmrepo.observability.metrics import memory_gb as rank_memory_gb

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return rank_memory_gb("cpu")


def on_device(spec: dict, device) -> list[list[dict]]:
    """Every step's micro batches, already on the device."""
    return [[{k: v.to(device) for k, v in b.items()} for b in step] for step in arms.step_batches(spec)]


def run_r0(spec: dict) -> dict:
    """The hand-tuned loop."""
    import torch

    from lmrepo.optim.optimizer import param_groups
    from lmrepo.optim.schedules import build_scheduler

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if device.type == "cpu":  # tuned on a CPU as train.py is: freed memory kept for the next step
        from lmrepo.utils import cpu_malloc

        cpu_malloc.keep_freed_memory()
    model = arms.model_of(spec).to(device)
    opt = spec["optimizer"]
    groups = param_groups(model, opt["weight_decay"])
    optimizer = torch.optim.AdamW(groups, lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"], fused=True)
    scheduler = build_scheduler(optimizer, spec["ds_config"]["scheduler"])
    compiled = torch.compile(model) if spec["compile"] else model
    bf16 = spec["ds_config"].get("bf16", {}).get("enabled", False)
    clip, batches = spec["ds_config"]["gradient_clipping"], on_device(spec, device)

    def step(i: int):
        micro = batches[i]
        total = 0.0
        for batch in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = compiled(**batch).loss
            (loss / len(micro)).backward()
            total = total + loss.detach() / len(micro)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return total

    return timed_steps(step, spec, device)


def run_r1(spec: dict) -> dict:
    """The DeepSpeed tutorials' bare loop on train.py's DeepSpeed engine and config."""
    import torch

    from lmrepo.distributed.launch import ensure_single_process_env, init_distributed

    ensure_single_process_env()
    init_distributed()
    engine = arms.build(spec)
    batches = on_device(spec, engine.device)

    def step(i: int):
        losses = []
        for batch in batches[i]:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    return timed_steps(step, spec, engine.device)


def run_train(spec: dict) -> dict:
    """train.py itself with the arm's overrides, in this process, its host syncs counted over the
    last spec["count_steps"] steps from the step boundaries fit() marks (the watchdog's beat)."""
    import torch

    from lmrepo.observability.host_syncs import host_sync_counter
    from lmrepo.train import watchdog

    device_type = "cuda" if torch.cuda.is_available() and "trainer.device=cpu" not in spec["job"] else "cpu"
    first_counted = spec["warmup"] + spec["timed"]
    counts: dict[int, int] = {}
    state = {"counter": None}
    beat = watchdog.Watchdog.beat

    def counting_beat(self, step: int) -> None:
        if step >= first_counted and state["counter"] is None:
            state["counter"] = host_sync_counter(device_type).start()
        if state["counter"] is not None:
            counts[step] = state["counter"].count
        beat(self, step)

    watchdog.Watchdog.beat = counting_beat
    run_dir = Path(spec["out_dir"])
    sys.argv = [str(REPO / "train.py"), *spec["job"], f"hydra.run.dir={run_dir}"]
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    except SystemExit as err:
        if err.code:
            raise
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {m["step"]: m for m in metrics if "loss" in m}
    ds = json.loads((run_dir / "ds_config.json").read_text())
    tokens_per_step = ds["train_batch_size"] * spec["block_size"]
    # the logging windows that end inside the timed steps (the first window holds step 1 alone)
    timed = [m for s, m in steps.items() if spec["warmup"] < s <= first_counted and s > 1]
    log_every = spec["log_every"]
    per_step = [counts[s + 1] - counts[s] for s in sorted(counts) if s + 1 in counts]
    by_kind = {"log": [], "other": []}
    for s, n in zip(sorted(counts), per_step):  # counts[s]: at the start of step s + 1
        by_kind["log" if (s + 1) % log_every == 0 else "other"].append(n)
    return {
        "step_s": statistics.median(tokens_per_step / m["tokens_per_s"] for m in timed),
        "first_extra_s": tokens_per_step / steps[1]["tokens_per_s"]
        - statistics.median(tokens_per_step / m["tokens_per_s"] for m in timed),
        "losses": {s: m["loss"] for s, m in steps.items()},
        "peak_gb": max(m.get("mem_gb", 0.0) for m in steps.values()),
        "syncs_per_step": statistics.median(by_kind["other"]) if by_kind["other"] else None,
        "syncs_max": max(by_kind["other"]) if by_kind["other"] else None,
        "syncs_log_step": max(by_kind["log"]) if by_kind["log"] else None,
    }


def run_worker(args: argparse.Namespace) -> None:
    spec = json.loads(Path(args.spec).read_text())
    result = {"r0": run_r0, "r1": run_r1, "train": run_train}[args.worker](spec)
    Path(args.result).write_text(json.dumps(result))


# ---- orchestrator side ----


class Ruler:
    def __init__(self, args: argparse.Namespace, overrides: list[str]):
        import torch

        self.args, self.quick, self.host = args, args.quick, args.host
        self.mode = "quick" if self.quick else "host" if self.host else "full"
        self.eager = self.quick or self.host  # every arm: a compile costs ~30 s on 2 cores
        self.cuda = torch.cuda.is_available() and not self.eager
        defaults = (2, 4, 4) if self.quick else (5, 40, 4) if self.host else (10, 60, 10) if self.cuda else (5, 20, 10)
        self.warmup = args.warmup or defaults[0]
        self.steps = args.steps or defaults[1]
        self.count_steps = args.count_steps if args.count_steps is not None else defaults[2]
        self.log_every = 2 if self.quick else 10
        if self.fixed_step() <= max(self.warmup, 1):  # train.py's arms are timed over whole logging windows
            raise SystemExit(
                f"bench_throughput: no logging window of {self.log_every} steps ends inside the {self.steps} timed "
                f"steps after {self.warmup} warm-up: choose --steps {self.log_every} or more"
            )
        base = QUICK_JOB if self.quick else HOST_JOB if self.host else GPU_JOB if self.cuda else []
        self.job = [*base, *overrides]
        self.out = Path(args.out or tempfile.mkdtemp(prefix="lmrepo-ruler-")).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget if args.budget else math.inf
        arms = QUICK_ARMS if self.quick else HOST_ARMS if self.host else [n for n, *_ in ARMS]
        wanted = args.arms.split(",") if args.arms else list(arms)
        unknown = set(wanted) - {name for name, *_ in ARMS}
        if unknown:
            raise SystemExit(
                f"bench_throughput: no arm {', '.join(sorted(unknown))}: choose from "
                + ", ".join(name for name, *_ in ARMS)
            )
        if not args.arms and not self.cuda and not self.eager:
            from lmrepo.distributed.device import cpu_native_bf16

            if not cpu_native_bf16():
                wanted.remove("ds-z0-autocast")
                print("bench_throughput: ds-z0-autocast left out: this CPU has no native bf16 (--arms runs it)")
        self.arms = [arm for arm in ARMS if arm[0] in wanted]
        self.results: dict[str, dict] = {}
        self.failures: list[str] = []

    def log(self, message: str) -> None:
        print(f"bench_throughput: {message}", file=sys.stderr, flush=True)

    def plan(self, micro_batch: int | None):
        """train.py's plan of the job at this micro batch: config (autos resolved) and DeepSpeed dict."""
        from lmrepo.plan.compose import compose_config
        from lmrepo.plan.job import plan

        job = [*self.job, *([f"trainer.micro_batch_size={micro_batch}"] if micro_batch else [])]
        # one step more than the arms time and count: a step's syncs are counted up to the next
        # step's start, and the last step (the evaluation after it) has none
        max_steps = self.warmup + self.steps + self.count_steps + 1
        job += [f"trainer.max_steps={max_steps}", f"trainer.log_every={self.log_every}", *TRAIN_KEYS]
        return job, plan(compose_config(job, run_dir=self.out / "unused"), 1)

    def prepare(self) -> None:
        from lmrepo.config import to_dict
        from lmrepo.data.prepare import prepare_sources
        from lmrepo.data.tokenizer import load_tokenizer

        self.base_job, job_plan = self.plan(None)
        config = job_plan.config
        if config.model.family != "gpt2":
            raise SystemExit("bench_throughput measures GPT-2 models: choose model=gpt2*")
        self.config, self.model = config, to_dict(config.model)
        self.sources = prepare_sources(config.data, load_tokenizer(config.model.tokenizer, None))
        self.micro = job_plan.ds_config["train_micro_batch_size_per_gpu"]

    def spec(self, name: str, job: list[str], ds_config: dict, compile_r0: bool) -> Path:
        path = self.out / f"{name}.spec.json"
        path.write_text(
            json.dumps(
                {
                    "model": self.model,
                    "sources": [[str(d), w] for d, w in self.sources],
                    "block_size": self.config.data.block_size,
                    "seed": self.config.trainer.seed,
                    "warmup": self.warmup,
                    "timed": self.steps,
                    "count_steps": self.count_steps,
                    "steps": self.warmup + self.steps + self.count_steps + 1,  # every step's batches
                    "log_every": self.log_every,
                    "ds_config": ds_config,
                    "optimizer": {
                        "lr": self.config.optimizer.lr,
                        "betas": list(self.config.optimizer.betas),
                        "eps": self.config.optimizer.eps,
                        "weight_decay": self.config.optimizer.weight_decay,
                    },
                    "compile": compile_r0,
                    "job": job,
                    "out_dir": str(self.out / name),
                }
            )
        )
        return path

    def run_arm(self, name: str, kind: str, overrides: list[str], micro_batch: int | None) -> dict | None:
        label = name if micro_batch is None else f"{name}@{micro_batch}"
        left = self.deadline - time.monotonic()
        if left < 30:
            self.failures.append(f"{label}: skipped, out of --budget")
            self.log(f"{label}: skipped (out of budget)")
            return None
        job, job_plan = self.plan(micro_batch)
        if self.eager:
            overrides = [o for o in overrides if o != "trainer.compile=true"]
        job = [*job, *overrides]
        spec = self.spec(label, job, job_plan.ds_config, compile_r0=not self.eager)
        result = self.out / f"{label}.result.json"
        log = self.out / f"{label}.log"
        self.log(f"{label}: {kind} {' '.join(overrides)}")
        started = time.monotonic()
        with open(log, "w") as f:
            try:
                proc = subprocess.run(
                    [PYTHON, __file__, "--worker", kind, "--spec", str(spec), "--result", str(result)],
                    cwd=self.out,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), PYTHONPATH]))},
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=min(self.args.arm_timeout, max(30, left)),
                )
                error = None if proc.returncode == 0 else f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                error = "timed out"
        if error:
            tail = log.read_text().strip().splitlines()[-1:] or [""]
            self.failures.append(f"{label}: {error}: {tail[0][:200]} (log {log})")
            self.log(f"{label}: FAILED ({error}): {tail[0][:200]}")
            return None
        figures = json.loads(result.read_text())
        figures.update(kind=kind, overrides=overrides, micro_batch=micro_batch or self.micro)
        figures["wall_s"] = time.monotonic() - started
        self.results[label] = figures
        return figures

    def large_micro_batch(self) -> int | None:
        """--large: a number, 0 (none), or auto: the largest multiple of 8 (at most 64) whose
        activations, at R0's measured memory per sequence, fill 80% of the GPU."""
        if self.args.large != "auto":
            return int(self.args.large) or None
        r0 = self.results.get("R0")
        if not self.cuda or r0 is None or not r0.get("resident_gb"):
            return None
        import torch

        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        per_sequence = (r0["peak_gb"] - r0["resident_gb"]) / self.micro
        fits = int((0.8 * total - r0["resident_gb"]) / per_sequence) // 8 * 8
        return min(64, fits) if fits > self.micro else None

    def run(self) -> None:
        self.prepare()
        arms = {name: (kind, overrides) for name, kind, overrides, _ in self.arms}
        self.large = None
        for name, large in RUN_ORDER:
            if name not in arms:
                continue
            if large:
                if self.large is None:
                    self.large = self.large_micro_batch() or 0
                if not self.large:
                    continue
            self.run_arm(name, *arms[name], self.large if large else None)

    # ---- the report ----

    def figures(self) -> list[dict]:
        """One row per arm that ran: the measured figures with tokens/s, MFU and the ratio to R0 at
        the same micro batch."""
        from lmrepo.observability.metrics import device_name, flops_per_token, peak_tflops

        shape, block = self.config.model.shape(), self.config.data.block_size
        flops = flops_per_token(shape["n_layer"], shape["n_embd"], block, shape["vocab_size"], recompute=False)
        dtype = str(self.config.precision.dtype)
        peak = peak_tflops(device_name("cuda" if self.cuda else "cpu"), dtype, None)
        rows, descriptions = [], {name: what for name, _, _, what in ARMS}
        for label, r in self.results.items():
            name, _, _ = label.partition("@")
            tokens_per_s = r["micro_batch"] * block / r["step_s"]
            ruler = self.results.get("R0" if "@" not in label else f"R0@{r['micro_batch']}")
            losses = r["losses"]
            fixed = self.fixed_step()
            loss = losses.get(str(fixed)) if isinstance(losses, dict) else losses[fixed - 1]
            rows.append(
                {
                    "arm": label,
                    "what": descriptions[name],
                    "micro_batch": r["micro_batch"],
                    "tokens_per_s": tokens_per_s,
                    "ms_per_step": r["step_s"] * 1000,
                    "ratio_to_r0": ruler["step_s"] / r["step_s"] if ruler else None,
                    "mfu": tokens_per_s * flops / 1e12 / peak if peak else None,
                    "peak_gb": r["peak_gb"],
                    "loss_at_step": loss,
                    "first_step_extra_s": r["first_extra_s"],
                    "syncs_per_step": r.get("syncs_per_step"),
                    "syncs_max": r.get("syncs_max"),
                    "syncs_log_step": r.get("syncs_log_step"),
                    "wall_s": r["wall_s"],
                }
            )
        return rows

    def fixed_step(self) -> int:
        """The step whose loss the table shows: the last logging step of the timed ones (every
        train.py arm logs it)."""
        return (self.warmup + self.steps) // self.log_every * self.log_every

    def report(self, report: Report) -> dict:
        rows = self.figures()
        fixed = self.fixed_step()
        device = "GPU" if self.cuda else "CPU"
        counter = "CUDA synchronisations" if self.cuda else "reads of tensor values"
        report.print(f"## Throughput against the hand-tuned loop R0 ({device})")
        report.print("")
        report.print(
            f"Job: `{' '.join(self.base_job)}`{', every arm eager (compile overrides dropped)' if self.eager else ''}; "
            f"{self.warmup} warm-up steps, {self.steps} timed, "
            f"{self.count_steps} counted (host syncs: {counter} per step, median of the steps that do "
            "not log; a logging step's in brackets)."
        )
        report.print("")
        report.print(
            "| arm | micro batch | tokens/s | ms/step | / R0 | MFU | peak GB | loss at step "
            f"{fixed} | first step extra s | host syncs/step | what |"
        )
        report.print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")

        def num(value, digits: int = 2, percent: bool = False) -> str:
            if value is None:
                return "n/a"
            return f"{100 * value:.1f}%" if percent else f"{value:,.{digits}f}"

        for row in rows:
            syncs = num(row["syncs_per_step"], 0)
            if row["syncs_log_step"] is not None:
                syncs += f" ({row['syncs_log_step']})"
            report.print(
                f"| {row['arm']} | {row['micro_batch']} | {row['tokens_per_s']:,.0f} | {row['ms_per_step']:.2f} | "
                f"{num(row['ratio_to_r0'])} | {num(row['mfu'], percent=True)} | {num(row['peak_gb'])} | "
                f"{num(row['loss_at_step'], 4)} | {num(row['first_step_extra_s'], 1)} | {syncs} | {row['what']} |"
            )
        first, last = self.results.get("R0"), self.results.get("R0-last")
        if first and last:
            report.print("")
            report.print(f"Drift: R0 last / first step time = {last['step_s'] / first['step_s']:.3f}.")
        for failure in self.failures:
            report.print(f"- failed: {failure}")
        return {"rows": rows, "job": self.base_job, "large_micro_batch": self.large or None, "failures": self.failures}


def main() -> None:
    args, overrides = parse_args()
    if args.worker:
        run_worker(args)
        return
    ruler = Ruler(args, overrides)
    name = "bench_throughput_host" if ruler.host else None
    report = Report(__file__, device="auto" if ruler.cuda else "cpu", name=name)
    report.print(f"# bench_throughput ({ruler.mode})")
    ruler.run()
    figures = ruler.report(report)
    report.save(args.save, figures)
    print(f"bench_throughput: runs and logs under {ruler.out}", file=sys.stderr)
    sys.exit(1 if ruler.failures else 0)


if __name__ == "__main__":
    main()
