"""Benchmarks of lmrepo on this machine, measured side by side in one run and printed as a
markdown table of ratios. Nothing here asserts a time: the ratios are printed next to their
targets.

    python benchmarks/bench.py          # the default job: gpt2-tiny, precision=auto, ZeRO-0, 1 rank (~10 min, 2 cores)
    python benchmarks/bench.py --quick  # smoke run of every measurement: 2 x 64 model, fp32, 4 steps (~1 min)
    python benchmarks/bench.py model.n_layer=8   # train.py's overrides choose the job (GPT-2 models)
    python benchmarks/bench.py --save   # also writes benchmarks/results/bench_<machine>_<yyyy-mm>.md and .json

precision=auto trains in bf16 where the CPU computes it natively, else in fp32. --quick is a
smoke run: it proves every measurement runs and prints sane figures, not how fast the machine is.

Every arm trains the same model (same preset and seed) on the same batches (the blocks train.py
reads, materialized before a bare loop's clock starts) with the ds_config.json train.py wrote, on
1 rank, for the same number of steps. Other processes on a shared machine swing step times far
more than the few percent asked about, so the comparisons are paired step by step in one process,
with the bare loop of the DeepSpeed tutorials this project grew from as the common ruler:

1. train.py against the tutorials' bare DeepSpeed loop (`engine(batch).loss; engine.backward(loss);
   engine.step()`): `lmrepo.train.loop.fit`, wired as lmrepo.run.train wires it, with a bare step right
   after each of its steps (inside its metrics sink); fit's step is the wall time between its
   consecutive metrics lines (everything the loop does, logging included) less that bare step.
   The ratio is the median of the per-step ratios. Also `python train.py` against the bare loop
   alone in separate processes, runs interleaved (train.py, bare, fit, HF, HF, fit, bare, train.py).
2. train.py against Hugging Face Trainer with the same DeepSpeed config: the Trainer's process
   steps the same bare loop after each of its steps (a callback); train.py / HF =
   (fit / bare) / (HF / bare).
3. Model-state memory per rank for ZeRO stages 0-3 on 2 ranks (`torchrun --nproc-per-node 2`): the
   bytes of the tensors each rank holds for parameters, gradients and optimizer states, against
   lmrepo.estimate's theoretical division.
4. torch.compile through DeepSpeed's `engine.compile()` against eager: an eager and a compiled
   bare engine in one process, taking turns of a few steps.
The noise floor of the paired ratios: the bare loop on two identically built engines in one process.
Also the CPU's measured matmul peak (bf16, fp32), and the train.py runs' TFLOP/s and MFU against it.

--quick: one run per arm of 4 steps (2 timed) of a 2-layer, 64-wide model on micro batches of
2 x 32 tokens in fp32; the memory table in bf16 (its theory is mixed precision's) on 1 x 8 tokens
per step, the bench model only; 512 x 512 matmuls for the peak; the twin engine of the noise floor
stepped in the torch.compile process (one process start fewer).

Medians of the steps after the first --warmup of each run. Results also go to <out>/results.md
and results.json. Exit 0 when every measurement ran, 1 when one failed (its reason is printed).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import arms  # benchmarks/arms.py: the worker arms

import common  # benchmarks/common.py: this script's folder is first on sys.path; it puts the repository next
from common import REPO, Report, add_save_flag
from lmrepo.distributed.launch import launch_command

PYTHON = sys.executable

# Every train.py run of the bench: metrics every step, no evaluation until the end, no checkpoints.
BENCH_KEYS = [
    "logger=jsonl",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.eval_batches=1",
    "trainer.save_every=0",
]
# The smoke run: a tiny model in fp32 (a CPU without native bf16 computes bf16 matmuls ~70x slower).
QUICK_JOB = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "data.block_size=32",
    "trainer.micro_batch_size=2",
    "precision=fp32",
]
# The smoke run's memory table: the section checks mixed precision's 2+2+12 bytes per parameter, so
# bf16, on 1 x 8 tokens per step (model states do not depend on the batch; a CPU without native
# bf16 computes bf16 matmuls slowly).
QUICK_MEMORY, QUICK_MEMORY_TOKENS = ["precision=bf16"], [1, 8]
# A second model for the memory table, of a real model's shape: GPT-2 124M, whose token embedding
# is 31% of it (gpt2-tiny's is 80%: see the table's note).
REFERENCE_MODEL = ("GPT-2 124M", "model=gpt2")


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke run")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (30; quick 4)")
    parser.add_argument("--warmup", type=int, help="first steps of each run left out of the medians (5; quick 2)")
    parser.add_argument("--rounds", type=int, help="runs of each arm, interleaved (2; quick 1)")
    parser.add_argument("--peak-seconds", type=float, help="seconds per matmul-peak measurement (2; quick 0.1)")
    parser.add_argument("--peak-size", type=int, help="n of the n x n matmuls of the peak (2048; quick 512)")
    parser.add_argument("--out", help="directory for runs, logs and results (a new temporary one)")
    add_save_flag(parser)
    for hidden in ("--worker", "--spec", "--result", "--local_rank"):  # worker processes (and the launcher's flag)
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    return parser.parse_known_args()


# ---- worker side: one measurement in this process ----


def run_worker(args: argparse.Namespace) -> None:
    from lmrepo.distributed.launch import world_size
    from lmrepo.utils import ops

    # The bare and HF arms start DeepSpeed themselves (deepspeed.initialize, the Trainer): as train.py's
    # ranks, they load the machine's kept ops and leave DeepSpeed's CPU all-reduce kernel unused
    ops.load_ops_as_ranks_do(world_size())
    spec = json.loads(Path(args.spec).read_text())
    workers = {
        "bare": arms.bare_loop,
        "fit": arms.fit_and_bare,
        "hf": arms.hf_trainer,
        "memory": arms.model_state_memory,
    }
    result = workers[args.worker](spec)
    suffix = f".rank{os.environ['RANK']}" if args.worker == "memory" else ""
    Path(args.result + suffix).write_text(json.dumps(result))


# ---- orchestrator side ----


def child_env(ranks: int = 1) -> dict:
    """Every arm's process alike: no inherited rank variables (each single-rank process sets its own),
    the same thread count (accelerate would otherwise set OMP_NUM_THREADS in the HF arm only).
    Several ranks (the memory count, which times nothing) share the threads out."""
    import torch

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    if ranks > 1:
        env["OMP_NUM_THREADS"] = str(max(1, int(env["OMP_NUM_THREADS"]) // ranks))
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    return env


def run_logged(cmd: list[str], log: Path, cwd: Path, timeout: int = 1800, ranks: int = 1) -> str | None:
    """Runs cmd with its output in `log`. None when it succeeded, else the reason in one line."""
    with open(log, "w") as f:
        try:
            proc = subprocess.run(
                cmd, cwd=cwd, env=child_env(ranks), stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout} s (log: {log})"
    if proc.returncode == 0:
        return None
    lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()]
    errors = [l for l in lines if "Error" in l or "error:" in l]
    return f"exit {proc.returncode}: {(errors or lines or ['no output'])[-1][:300]} (log: {log})"


class Bench:
    def __init__(self, args: argparse.Namespace, overrides: list[str]):
        self.quick = args.quick
        self.steps = args.steps or (4 if self.quick else 30)
        # the first 2 steps of an engine allocate (~20x a steady step of the smoke run's model)
        self.warmup = args.warmup if args.warmup is not None else (2 if self.quick else 5)
        self.rounds = args.rounds or (1 if self.quick else 2)
        self.block = 2 if self.quick else 5  # compile vs eager: steps per turn
        self.peak_seconds = args.peak_seconds or (0.1 if self.quick else 2.0)
        self.peak_size = args.peak_size or (512 if self.quick else 2048)
        self.out = Path(args.out or tempfile.mkdtemp(prefix="lmrepo-bench-")).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.job = [*(QUICK_JOB if self.quick else []), *overrides, *BENCH_KEYS, f"trainer.max_steps={self.steps}"]
        self.failures: list[str] = []

    def compose(self, extra: list[str] = (), job: list[str] | None = None):
        from lmrepo.plan.compose import compose_config

        job = self.job if job is None else job
        cfg = compose_config([*job, *extra], run_dir=self.out / "unused")
        warmup = cfg.schedule.warmup_steps  # null: a share of the run, always valid
        if (
            warmup is not None and warmup >= self.steps
        ):  # train.py requires warmup < max_steps; lr does not change speed
            job.append(f"schedule.warmup_steps={self.steps // 2}")
            return self.compose(extra, job)
        return cfg

    def spec(self, name: str, **fields) -> Path:
        path = self.out / f"{name}.spec.json"
        path.write_text(
            json.dumps(
                {
                    "model": self.model,
                    "sources": [[str(d), w] for d, w in self.sources],
                    "block_size": self.config.data.block_size,
                    "seed": self.config.trainer.seed,
                    "steps": self.steps,
                    "out_dir": str(self.out / name),
                    **fields,
                }
            )
        )
        return path

    def worker(self, kind: str, name: str, spec: Path, ranks: int = 0) -> tuple[object, str | None]:
        result = self.out / f"{name}.result.json"
        # torchrun: what is measured is the ranks' tensors; DeepSpeed's launcher adds 3 s (bench_launchers.py)
        error = run_logged(
            [
                *launch_command(ranks, "torchrun"),
                str(Path(__file__).resolve()),
                "--worker",
                kind,
                "--spec",
                str(spec),
                "--result",
                str(result),
            ],
            self.out / f"{name}.log",
            self.out,
            ranks=max(1, ranks),
        )
        if error:
            return None, error
        if ranks:
            return [json.loads((self.out / f"{result.name}.rank{r}").read_text()) for r in range(ranks)], None
        return json.loads(result.read_text()), None

    def train_run(self, name: str) -> tuple[dict | None, str | None]:
        run_dir = self.out / name
        error = run_logged(
            [PYTHON, str(REPO / "train.py"), *self.job, f"hydra.run.dir={run_dir}"], self.out / f"{name}.log", self.out
        )
        if error:
            return None, error
        ds_config = json.loads((run_dir / "ds_config.json").read_text())
        lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = sorted((l for l in lines if "loss" in l), key=lambda l: l["step"])
        elapsed = [0.0] + [l["elapsed_s"] for l in steps]
        tokens_per_step = ds_config["train_batch_size"] * self.config.data.block_size
        return {
            "times": [b - a for a, b in zip(elapsed, elapsed[1:])],
            "losses": [l["loss"] for l in steps],
            "window_times": [tokens_per_step / l["tokens_per_s"] for l in steps],
            "ds_config": ds_config,
        }, None

    # ---- the measurements ----

    def run(self) -> dict:
        from lmrepo.config import to_dict
        from lmrepo.data.prepare import prepare_sources
        from lmrepo.data.tokenizer import load_tokenizer
        from lmrepo.distributed.device import detect_device
        from lmrepo.plan.job import plan
        from lmrepo.utils.errors import ConfigError, exit_error

        try:
            self.cfg = self.compose()
            self.device = detect_device(self.cfg.trainer.device)
            self.config = plan(self.cfg, 1, self.device).config  # train.py's checks; precision and warmup resolved
        except ConfigError as err:
            exit_error(str(err))
        if self.config.model.family != "gpt2" or self.config.pipeline.schedule != "none":
            exit_error(
                "benchmarks/bench.py measures GPT-2 models without a pipeline: choose model=gpt2* and pipeline=none"
            )
        self.model = to_dict(self.config.model)
        tokenizer = load_tokenizer(self.config.model.tokenizer, self.config.model.pretrained)
        self.sources = prepare_sources(self.config.data, tokenizer)
        results = {
            "machine": common.machine(),
            "job": self.job,
            "block_size": self.config.data.block_size,
            "steps": self.steps,
            "warmup": self.warmup,
            "rounds": self.rounds,
            "quick": self.quick,
            "out": str(self.out),
        }

        def log(message: str) -> None:
            print(f"bench: {message}", file=sys.stderr, flush=True)

        log(f"CPU matmul peak ({self.peak_size} x {self.peak_size}, {self.peak_seconds} s per dtype)")
        results["peak_size"] = self.peak_size
        results["peak"] = {
            d: common.measure_cpu_peak_tflops(d, self.peak_seconds, self.peak_size) for d in ("bf16", "fp32")
        }

        # 1, 2: the runs, interleaved A B C D D C B A ... so drifting load reaches every arm
        arms = {"train": [], "bare": [], "fit": [], "hf": []}
        errors = {}
        kinds = ("train", "fit", "hf") if self.quick else ("train", "bare", "fit", "hf")
        order = [arm for r in range(self.rounds) for arm in (kinds if r % 2 == 0 else kinds[::-1])]
        ds_config = None
        for i, arm in enumerate(order):
            name = f"{arm}{len(arms[arm])}"
            log(f"run {i + 1}/{len(order)}: {name}")
            if arm == "train":
                result, error = self.train_run(name)
                if result and ds_config is None:
                    ds_config = result["ds_config"]
            elif ds_config is None:
                result, error = None, "no ds_config.json: the train.py run before it failed"
            elif arm == "bare":
                result, error = self.worker("bare", name, self.spec(name, ds_config=ds_config, arms=["eager"]))
                if result:
                    bare = result["bare"]
                    result = {"times": bare["times"]["eager"], "losses": bare["losses"]["eager"]}
            elif arm == "fit":
                result, error = self.worker(
                    "fit", name, self.spec(name, ds_config=ds_config, arms=["eager"], config=to_dict(self.config))
                )
                if result:
                    bare = result["bare"]
                    result = {
                        **result["fit"],
                        "bare_times": bare["times"]["eager"],
                        "bare_losses": bare["losses"]["eager"],
                    }
            else:
                result, error = self.worker("hf", name, self.spec(name, ds_config=ds_config, arms=["eager"]))
                if result:
                    result = {**result["hf"], "bare_times": result["bare"]["times"]["eager"]}
            if error:
                errors.setdefault(arm, error)
            else:
                arms[arm].append(result)
        results["arms"], results["arm_errors"], results["ds_config"] = arms, errors, ds_config
        self.failures += [f"{arm}: {e}" for arm, e in errors.items()]

        # 4: torch.compile against eager, in one process (in turns of a few steps). The smoke run
        # steps the noise floor's twin engine in that process too: one process start fewer.
        twin = ["twin"] if self.quick else []
        if ds_config is None:
            results["compile_error"] = "no ds_config.json: the train.py run failed"
        else:
            log("torch.compile vs eager" + (" (and the noise floor's twin engine)" if twin else ""))
            result, error = self.worker(
                "bare",
                "compile",
                self.spec("compile", ds_config=ds_config, arms=["eager", "compiled", *twin], block=self.block),
            )
            results["compile"], results["compile_error"] = result and result["bare"], error
            if twin:
                results["twins"], results["twins_error"] = result and result["bare"], error
            if error:
                self.failures.append(f"compile: {error}")

        # The noise floor of a paired ratio: the same bare loop on two identically built engines.
        if ds_config is not None and not twin:
            log("noise floor: the bare loop on two identical engines")
            result, error = self.worker(
                "bare", "twins", self.spec("twins", ds_config=ds_config, arms=["eager", "twin"])
            )
            results["twins"], results["twins_error"] = result and result["bare"], error
            if error:
                self.failures.append(f"twins: {error}")

        # 3: model-state memory on 2 ranks, after the timing runs (not to disturb them)
        log("model-state memory, ZeRO stages 0-3 on 2 ranks")
        results["memory"], results["memory_error"] = self.memory()
        if results["memory_error"]:
            self.failures.append(f"memory: {results['memory_error']}")

        if arms["train"] and ds_config is not None:
            from lmrepo.run import throughput_of

            dtype = "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"
            throughput = replace(throughput_of(self.config, ds_config, self.device), peak_tflops=results["peak"][dtype])
            record = throughput.record(1, median_of(arms["train"], "times", self.warmup))
            results["mfu"] = {
                "dtype": dtype,
                "peak": results["peak"][dtype],
                "tflops": record["tflops"],
                "mfu": record["mfu"],
                "tokens_per_s": record["tokens_per_s"],
                "params": self.params(self.model),
            }
        results["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        return results

    def meta(self, model: dict):
        from lmrepo.config import ModelConfig, from_dict
        from lmrepo.models import meta_model

        return meta_model(from_dict(ModelConfig, model))

    def params(self, model: dict) -> int:
        from lmrepo.estimate import count_parameters

        return count_parameters(self.meta(model))

    def memory(self) -> tuple[list | None, str | None]:
        from lmrepo.config import to_dict
        from lmrepo.estimate import count_parameters, optimizer_group_sizes
        from lmrepo.plan.job import plan
        from lmrepo.utils.errors import ConfigError

        models = [("bench model", [*self.job, *(QUICK_MEMORY if self.quick else [])])]
        if not self.quick:  # the job's other keys, the reference model's own shape
            label, choice = REFERENCE_MODEL
            models.append((label, [o for o in self.job if not o.startswith(("model.", "model="))] + [choice]))
        spec_models = []
        try:
            for label, job in models:
                plans = {
                    stage: plan(self.compose([f"zero=stage{stage}", "offload=none"], job), 2, self.device)
                    for stage in range(4)
                }
                configs = {stage: job_plan.ds_config for stage, job_plan in plans.items()}
                model = to_dict(plans[0].config.model)
                net = self.meta(model)
                spec_models.append(
                    {
                        "label": label,
                        "model": model,
                        "params": count_parameters(net),
                        "group_sizes": optimizer_group_sizes(net),
                        "ds_configs": configs,
                    }
                )
        except ConfigError as err:
            return None, str(err)
        tokens = QUICK_MEMORY_TOKENS if self.quick else None  # None: the job's micro batch x block
        per_rank, error = self.worker(
            "memory", "memory", self.spec("memory", models=spec_models, tokens=tokens), ranks=2
        )
        return (None if error else [row for rows in per_rank for row in rows]), error


# ---- the table ----


def steady(times: list[float], warmup: int) -> list[float]:
    return times[warmup:] or times[-1:]


def median_of(runs: list[dict], key: str, warmup: int) -> float:
    """Median step time over the steady steps of every run."""
    return statistics.median(t for run in runs for t in steady(run[key], warmup))


def ratios(runs: list[dict], key: str, reference: str, warmup: int) -> list[float]:
    """Each steady step's time over the reference's step time right next to it."""
    return [a / b for run in runs for a, b in zip(steady(run[key], warmup), steady(run[reference], warmup))]


def paired(runs: list[dict], key: str, reference: str, warmup: int) -> float:
    return statistics.median(ratios(runs, key, reference, warmup))


def interval(samples: list[list[float]], combine=lambda median: median) -> tuple[float, float]:
    """95% bootstrap interval of combine(the median of each sample), each sample resampled on its own."""
    rng = random.Random(0)
    values = sorted(combine(*(statistics.median(rng.choices(x, k=len(x))) for x in samples)) for _ in range(2000))
    return values[50], values[1949]


def per_run(runs: list[dict], warmup: int) -> str:
    return ", ".join(f"{statistics.median(steady(run['times'], warmup)):.4f}" for run in runs)


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def verdict(value: float, low: float, high: float, target: float) -> str:
    if value <= target:
        word = "**met**"
    elif low <= target:
        word = f"**equal within noise**: above {target}, but its 95% interval reaches it"
    else:
        word = "**not met**"
    return f"{word} ({value:.3f}, 95% interval {low:.3f}-{high:.3f})"


def report(r: dict) -> str:
    m, w, lines = r["machine"], r["warmup"], []
    add = lines.append
    add("# lmrepo bench" + (" (--quick: a smoke run; its ratios mean little)" if r["quick"] else ""))
    add("")
    add("## Machine")
    add("")
    add(f"- CPU: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, ISA: {', '.join(m['isa']) or '?'}")
    add(
        f"- {m['os']}, Python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}, "
        f"transformers {m['transformers']}, accelerate {m['accelerate']}"
    )
    add(
        f"- load average at start {m['load_average']}, at end {m.get('load_average_end')} "
        "(other processes on the machine add noise: arms are paired step by step or interleaved to share it)"
    )
    add(
        f"- job: `{' '.join(r['job'])}`; {r['steps']} steps per run, the first {w} left out, "
        f"{r['rounds']} run(s) per arm; medians of the remaining steps"
    )
    add("")
    add("## CPU matmul peak")
    add("")
    n = r.get("peak_size", 2048)
    add(f"| dtype | TFLOP/s (best {n}x{n} torch.matmul, {m['torch_threads']} threads) |")
    add("| --- | --- |")
    for dtype, tflops in r["peak"].items():
        add(f"| {dtype} | {tflops:.3f} |")
    if "mfu" in r:
        f = r["mfu"]
        add("")
        add(
            f"The bench's train.py runs ({f['params'] / 1e6:.1f}M params, median step): "
            f"{f['tokens_per_s']:.0f} tokens/s, {f['tflops']:.3f} TFLOP/s, MFU {100 * f['mfu']:.1f}% of the measured "
            f"{f['dtype']} peak {f['peak']:.3f} TFLOP/s."
        )
    add("")

    arms, errors = r["arms"], r["arm_errors"]
    fit, train, bare, hf = arms["fit"], arms["train"], arms["bare"], arms["hf"]
    add("## 1. train.py vs bare DeepSpeed loop")
    add("")
    add("| measurement | train.py loop: median step (s) | bare loop: median step (s) | train.py / bare |")
    add("| --- | --- | --- | --- |")
    if fit:
        add(
            f"| one process, steps paired: `lmrepo.train.loop.fit` with a bare step right after each of its steps | "
            f"{median_of(fit, 'times', w):.4f} | {median_of(fit, 'bare_times', w):.4f} | "
            f"**{paired(fit, 'times', 'bare_times', w):.3f}** (median of per-step ratios) |"
        )
    if train and bare:
        add(
            f"| separate processes, runs interleaved: `python train.py` vs the bare loop alone | "
            f"{median_of(train, 'times', w):.4f} | {median_of(bare, 'times', w):.4f} | "
            f"{median_of(train, 'times', w) / median_of(bare, 'times', w):.3f} (ratio of medians) |"
        )
    add("")
    if fit:
        ratio = paired(fit, "times", "bare_times", w)
        extra = statistics.median(a - b for x in fit for a, b in zip(steady(x["times"], w), steady(x["bare_times"], w)))
        low, high = interval([ratios(fit, "times", "bare_times", w)])
        add(
            f"Target train.py / bare <= 1.05: {verdict(ratio, low, high, 1.05)}; train.py's step takes "
            f"{1000 * extra:+.1f} ms more (median of the paired differences). "
            "train.py's step is the wall time between its consecutive metrics lines (logged every step): "
            "data, forward, backward, step, the loss all-reduce, metrics, logging, progress bar."
        )
        add(
            f"Same work: in each process the two loops' losses differ by at most "
            f"{max(max_diff(x['losses'], x['bare_losses']) for x in fit):.2e}"
            + (
                f"; `python train.py` and the bare loop alone by {max_diff(train[0]['losses'], bare[0]['losses']):.2e}"
                if train and bare
                else ""
            )
            + "."
        )
    if train:
        add(
            f"`python train.py` per-run medians (s): {per_run(train, w)}; its own tokens_per_s metric gives "
            f"{median_of(train, 'window_times', w):.4f} s per step"
            + (f"; the bare loop alone: {per_run(bare, w)}" if bare else "")
            + "."
        )
    for arm in ("train", "bare", "fit"):
        if arm in errors:
            add(f"{arm} run failed: {errors[arm]}")
    add("")

    add("## 2. train.py vs Hugging Face Trainer")
    add("")
    if fit and hf:
        fit_ratio, hf_ratio = paired(fit, "times", "bare_times", w), paired(hf, "times", "bare_times", w)
        add("| measurement | train.py | HF Trainer + DeepSpeed | train.py / HF |")
        add("| --- | --- | --- | --- |")
        add(
            "| step time / the bare loop's paired step (the same bare loop runs in both processes) | "
            f"{fit_ratio:.3f} | "
            f"{hf_ratio:.3f} | **{fit_ratio / hf_ratio:.3f}** |"
        )
        add(
            f"| median step (s) | {median_of(fit, 'times', w):.4f} | {median_of(hf, 'times', w):.4f} | "
            f"{median_of(fit, 'times', w) / median_of(hf, 'times', w):.3f} |"
        )
        add("")
        s = r["block_size"]
        low, high = interval(
            [ratios(fit, "times", "bare_times", w), ratios(hf, "times", "bare_times", w)], lambda a, b: a / b
        )
        add(
            f"Target: at least as fast (<= 1.0): {verdict(fit_ratio / hf_ratio, low, high, 1.0)}. "
            "Mean training loss: train.py "
            f"{statistics.fmean(fit[0]['losses']):.4f}, HF Trainer {hf[0]['mean_loss']:.4f}, which is "
            f"{hf[0]['mean_loss'] * s / (s - 1):.4f} x {s}/{s - 1}: the Trainer divides the summed token losses by "
            f"every label token (`num_items_in_batch`), {s} per sequence, where the shifted causal loss has {s - 1}. "
            "The rest differs because DeepSpeed builds the Trainer's AdamW from one parameter group, weight decay "
            "on every parameter; train.py exempts biases and norms. The Trainer ran a "
            f"`{hf[0]['engine']}`"
            + (
                " with `use_cpu=True`: without it TrainingArguments refuses bf16 on a machine without a GPU"
                if hf[0]["use_cpu"]
                else ""
            )
            + "; its step is the wall time between step ends (a callback), its logging off; train.py logs every step."
        )
    if "hf" in errors:
        add(f"HF Trainer could not be measured: {errors['hf']}")
    add("")

    if r.get("twins"):
        twin_ratios = ratios([r["twins"]["times"]], "twin", "eager", w)
        low, high = interval([twin_ratios])
        add(
            f"Noise floor of these paired ratios: the same bare loop on two identically built engines in one "
            f"process, steps alternating, gives twin / eager = {statistics.median(twin_ratios):.3f} (95% interval "
            f"{low:.3f}-{high:.3f}): paired ratios no farther from 1 than this are no difference between the loops."
        )
        add("")
    elif r.get("twins_error"):
        add(f"The noise floor could not be measured: {r['twins_error']}")
        add("")

    add("## 3. Model-state memory per rank")
    add("")
    if r.get("memory"):
        add(memory_table(r["memory"]))
    if r.get("memory_error"):
        add(f"Memory could not be measured: {r['memory_error']}")
    add("")

    add("## 4. torch.compile")
    add("")
    c = r.get("compile")
    if c:
        runs = [{"eager": c["times"]["eager"], "compiled": c["times"]["compiled"]}]
        add("| arm (bare loop, one process, turns of a few steps) | first step (s) | median step (s) |")
        add("| --- | --- | --- |")
        add(f"| eager | {c['times']['eager'][0]:.2f} | {median_of(runs, 'eager', w):.4f} |")
        add(
            f"| `engine.compile()` (inductor) | {c['times']['compiled'][0]:.2f} | "
            f"{median_of(runs, 'compiled', w):.4f} |"
        )
        add("")
        low, high = interval([ratios(runs, "compiled", "eager", w)])
        add(
            f"**compiled / eager step time = {paired(runs, 'compiled', 'eager', w):.3f}** (95% interval {low:.3f}-"
            f"{high:.3f}; median of the ratios of the n-th steps; the first compiled step includes compilation). "
            "Losses differ by at most "
            f"{max_diff(c['losses']['compiled'], c['losses']['eager']):.2e}. Both arms use the same model with "
            "`model.loss_type` set: unset, transformers logs a warning inside forward, a graph break."
        )
    if r.get("compile_error"):
        add(f"torch.compile could not be measured: {r['compile_error']}")
    return "\n".join(lines) + "\n"


def memory_table(rows: list[dict]) -> str:
    from lmrepo.estimate import model_state_bytes, zero12_model_state_bytes

    dtype = rows[0]["dtype"]

    def mb(b: float) -> str:
        return f"{b / 1e6:.1f}"

    out = [
        f"Measured after the second backward, before its optimizer step, on {rows[0]['world']} ranks ({dtype}); "
        "MB = 1e6 bytes. Theory: lmrepo.estimate.model_state_bytes (ZeRO paper, 2+2+12 bytes per parameter "
        "in mixed precision, divided per stage). DeepSpeed's layout: lmrepo.estimate.zero12_model_state_bytes, "
        "the same with ZeRO-1/2's gradients held by whole tensor, rank by rank. Measured: the storages of the "
        "engine's own tensors (parameters or their ZeRO-3 partitions, gradients and gradient partition buffers, "
        "the fp32 master copy and Adam moments), not RSS. Buffers (communication buckets) are not model states: "
        "listed apart.",
        "",
        "| model (params) | stage | theory | rank: params + grads + optimizer = total | error (worst rank) "
        "| within 10% | DeepSpeed's layout, per rank: error (worst rank) | buffers |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, stage in dict.fromkeys((row["model"], row["stage"]) for row in rows):
        ranks = sorted((row for row in rows if (row["model"], row["stage"]) == (model, stage)), key=lambda x: x["rank"])
        params, world = ranks[0]["n_params"], ranks[0]["world"]
        theory = model_state_bytes(params, stage, world, dtype=dtype).gpu
        totals = [x["params"] + x["grads"] + x["optimizer"] for x in ranks]
        worst = max((t / theory - 1 for t in totals), key=abs)
        held = "; ".join(
            f"{x['rank']}: {mb(x['params'])} + {mb(x['grads'])} + {mb(x['optimizer'])} = {mb(t)}"
            for x, t in zip(ranks, totals)
        )
        layout = "= theory"
        if stage in (1, 2):
            expected = zero12_model_state_bytes(params, ranks[0]["group_sizes"], stage, world, dtype)
            off = max((t / expected[x["rank"]] - 1 for x, t in zip(ranks, totals)), key=abs)
            layout = f"{' / '.join(mb(e) for e in expected)}: {100 * off:+.1f}%"
        out.append(
            f"| {model} ({params / 1e6:.1f}M) | {stage} | {mb(theory)} | {held} | "
            f"{100 * worst:+.1f}% | {'yes' if abs(worst) <= 0.10 else 'no'} | {layout} | "
            f"{' / '.join(mb(x['buffers']) for x in ranks)} |"
        )
    out += [
        "",
        "Where measured and theory part: DeepSpeed's ZeRO-1/2 hold gradients by whole tensor: a rank's "
        "gradient buffer holds in full every parameter its partition touches (`get_partition_info`, "
        "`grads_in_partition`), so a tensor that straddles a partition boundary is held whole on both sides "
        "(GPT-2's token embedding is 80% of gpt2-tiny: one rank holds every gradient). DeepSpeed's layout "
        "column counts exactly that. Its ZeRO-1 keeps only those gradients once backward ends (whole "
        "gradients live per reduce bucket during backward), where the ZeRO paper's stage 1, and the theory, "
        "keep all of them. ZeRO-3 keeps parameters under `stage3_param_persistence_threshold` whole on every "
        "rank, and its reduce bucket (`reduce_bucket_size` elements) is allocated up front: the buffers column.",
    ]
    return "\n".join(out)


def main() -> None:
    args, overrides = parse_args()
    if args.worker:
        run_worker(args)
        return
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        from lmrepo.utils.errors import exit_error

        exit_error(f"unknown option {bad[0]}")
    saved = Report(__file__)
    bench = Bench(args, overrides)
    started = time.perf_counter()
    results = bench.run()
    results["wall_s"] = time.perf_counter() - started
    (bench.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = report(results) + f"\n(bench wall time {results['wall_s']:.0f} s; runs, logs and results in {bench.out})\n"
    (bench.out / "results.md").write_text(text)
    saved.print(text)
    saved.save(args.save, results)
    for failure in bench.failures:
        print(f"lmrepo: bench: {failure}", file=sys.stderr)
    raise SystemExit(1 if bench.failures else 0)


if __name__ == "__main__":
    main()
