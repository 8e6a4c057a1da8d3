"""Data-pipeline benchmark: preparation speed, padding, data wait and preparation memory, each
side by side in one run, printed as ratios.

    python benchmarks/bench_data.py          # the default corpus, 3 rounds, 20 training steps (~5 min on 2 cores)
    python benchmarks/bench_data.py --quick  # smoke run: 2 plays, 1 round, 2 steps of a 2 x 64 model in fp32 (<1 min)
    python benchmarks/bench_data.py --save   # also writes benchmarks/results/bench_data_<machine>_<yyyy-mm>.md

1. Preparation: lmrepo's prepare() (tokenize once with datasets.map, pack, memmap) against the
   approach of the DeepSpeed tutorials this project grew from, on the same text with the same
   GPT-2 tokenizer (the Rust one: transformers 5's GPT2Tokenizer). The tutorials call
   `tokenizer(batch, padding=True, truncation=True, max_length=1024)` on every DataLoader batch
   of 8 samples, a sample being one SQuAD context (a paragraph); here a sample is a paragraph
   (blank-line separated) of the Shakespeare plays. Both sides count the tokens the tokenizer
   produced (the tutorials' pad tokens not included) per second of wall time, the best of 3
   alternating rounds (a shared machine slows some runs), and per CPU-second (all threads and
   worker processes: what the work costs, whatever else runs); and the tokenizer alone, one call
   on the whole documents, whose cost per token no preparation can go below. Then: the rate at
   which training reads lmrepo's token file (LMData.train_step), the ratio over several epochs
   (the tutorials tokenize every epoch, lmrepo once), and the tutorials' padding waste (lmrepo: 0%).
2. Data wait: the share of a training step of the default job (gpt2-tiny, precision=auto: bf16
   where the CPU computes it natively, else fp32; micro batch 8 of 128 tokens, the real
   DeepSpeed engine in this process, one rank) spent in LMData.train_step. --quick times a
   2-layer, 64-wide model on micro batches of 4 x 32 tokens in fp32 instead.
3. Memory: peak memory (PSS, sampled) of preparation of the corpus and of 10 copies of it,
   each in a fresh process with empty caches, datasets.map's workers included: flat, not 10x.
"""

import argparse
import json
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from common import Report, add_save_flag  # benchmarks/common.py, first on sys.path
from lmrepo.plan.compose import compose_config

# The tutorials' data loop: DataLoader(batch_size=8), tokenizer(..., max_length=1024) per batch.
TUTORIAL_BATCH, TUTORIAL_MAX_LENGTH = 8, 1024
# The smoke run's training job: a tiny model in fp32 (a CPU without native bf16 computes bf16 matmuls ~70x slower).
QUICK_JOB = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "data.block_size=32",
    "trainer.micro_batch_size=4",
    "precision=fp32",
]


def text_overrides(corpus: Path, cache: Path) -> list[str]:
    return ["data=text", f"data.paths=[{corpus}/*.txt]", f"data.cache_dir={cache}"]


def pss_mb(pid: int) -> tuple[float, float]:
    """(anonymous, all) proportional set size of a process: PSS shares the copy-on-write pages of
    forked workers out fairly; "anonymous" leaves out mapped files (the Arrow files datasets
    memory-maps, which the kernel drops under pressure), so it is the memory a corpus could exhaust."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":")
        fields[key] = int(value.split()[0]) / 1024
    return fields.get("Pss_Anon", fields["Pss"]), fields["Pss"]


class PeakMemory(threading.Thread):
    """Samples this process and its children (datasets.map's workers) every 50 ms.
    (ru_maxrss would not do: Linux carries it over fork and exec from the parent.)"""

    def __init__(self):
        super().__init__(daemon=True)
        self.me, self.peak, self.done = (
            psutil.Process(),
            {"anon_mb": 0.0, "pss_mb": 0.0, "main_anon_mb": 0.0},
            threading.Event(),
        )

    def run(self):
        while not self.done.wait(0.05):
            try:
                readings = [pss_mb(p.pid) for p in (self.me, *self.me.children(recursive=True))]
            except (OSError, psutil.Error):  # a worker exited between the listing and the reading
                continue
            now = {
                "anon_mb": sum(r[0] for r in readings),
                "pss_mb": sum(r[1] for r in readings),
                "main_anon_mb": readings[0][0],
            }
            self.peak = {key: max(value, now[key]) for key, value in self.peak.items()}

    def stop(self) -> dict:
        self.done.set()
        self.join()
        return self.peak


def prepare_child(corpus: Path, cache: Path, sample_memory: bool) -> None:
    """In a fresh process: prepare() the corpus, print seconds, tokens and (sampled) peak memory as
    JSON. Sampling is for memory runs only: reading smaps of a process with torch loaded takes
    ~10 ms, 3 processes every 50 ms would take most of one of the two cores from the timing."""
    from lmrepo.data.prepare import load_meta, prepare
    from lmrepo.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("gpt2")
    data = compose_config(text_overrides(corpus, cache)).data
    memory = PeakMemory()
    if sample_memory:
        memory.start()
    start, cpu = time.perf_counter(), cpu_seconds()
    meta = load_meta(prepare(data, tokenizer))
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_s": cpu,
                "tokens": meta["train_tokens"] + meta["val_tokens"],
                "documents": meta["documents"],
                **(memory.stop() if sample_memory else {}),
            }
        )
    )


def cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its finished children (datasets.map's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_prepare(corpus: Path, cache: Path, sample_memory: bool = False) -> dict:
    shutil.rmtree(cache, ignore_errors=True)  # a build from scratch every time
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache / "hf")}  # no reuse of datasets' own cache either
    proc = subprocess.run(
        [sys.executable, __file__, "--prepare-child", str(corpus), str(cache), str(int(sample_memory))],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode:
        raise SystemExit(f"preparing {corpus} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_corpus(plays: list[str], directory: Path, copies: int) -> int:
    directory.mkdir(parents=True)
    for copy in range(copies):
        for play in plays:
            shutil.copyfile(play, directory / f"{copy:02d}-{Path(play).name}")
    return sum(f.stat().st_size for f in directory.iterdir())


def tutorial_tokenize(tokenizer, corpus: Path) -> dict:
    """The tutorials' loop body without the model: tokenize and pad each batch of 8 samples."""
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    samples = [p for t in texts for p in re.split(r"\n\s*\n", t) if p.strip()]
    tokenizer.pad_token = tokenizer.eos_token  # as the tutorials do
    real = padded = at_cap = 0
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(samples), TUTORIAL_BATCH):
        batch = tokenizer(
            samples[i : i + TUTORIAL_BATCH],
            return_tensors="pt",
            truncation=True,
            padding=True,
            max_length=TUTORIAL_MAX_LENGTH,
        )
        lengths = batch["attention_mask"].sum(dim=1)
        real += int(lengths.sum())
        padded += batch["input_ids"].numel()
        at_cap += int((lengths == TUTORIAL_MAX_LENGTH).sum())
    return {
        "seconds": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu,
        "tokens": real,
        "padded": padded,
        "samples": len(samples),
        "mean_sample": real / len(samples),
        "at_cap": at_cap,
    }


def tokenizer_alone(tokenizer, corpus: Path) -> dict:
    """The Rust tokenizer by itself on the whole documents in one call (its threads on all cores),
    no datasets, no files: about the most any preparation with this tokenizer reaches here."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()  # tutorial_tokenize's padding stays on the tokenizer
    backend.no_truncation()
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=False))
    return {"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "tokens": tokens}


def layout(ds_config: dict):
    from lmrepo.data.loader import Layout

    return Layout(
        global_batch=ds_config["train_batch_size"],
        micro_batch=ds_config["train_micro_batch_size_per_gpu"],
        dp_rank=0,
        dp_size=1,
    )


def supply_rate(token_dir: Path, tokenizer, steps: int = 300) -> float:
    """Tokens per second LMData.train_step hands to training from the token file (default layout)."""
    from lmrepo.data.loader import LMData
    from lmrepo.distributed.device import detect_device
    from lmrepo.plan.job import plan

    job = plan(compose_config([]), 1, detect_device("cpu"))
    config = job.config
    data = LMData(
        token_dir,
        config.data.block_size,
        config.model.family,
        tokenizer,
        layout(job.ds_config),
        config.trainer.seed,
        config.trainer.eval_batches,
    )
    start = time.perf_counter()
    for step in range(steps):
        data.train_step(step * data.layout.global_batch)
    return steps * data.layout.global_batch * data.block_tokens / (time.perf_counter() - start)


def data_wait(token_dir: Path, tokenizer, steps: int, warmup: int, overrides: list[str]) -> dict:
    """Times the job's steps (the default job, plus `overrides`), the data part (train_step and
    the move to the device) apart."""
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    from lmrepo.data.loader import LMData
    from lmrepo.distributed.launch import init_distributed
    from lmrepo.engines import build_engine
    from lmrepo.engines.base import to_device
    from lmrepo.plan.job import plan

    ds_logger.setLevel(logging.WARNING)
    job = plan(compose_config([*overrides, "logger=none"]), 1)
    config, ds_config = job.config, job.ds_config
    init_distributed()
    engine = build_engine(job).ds  # DeepSpeed's engine, stepped as the tutorials step it
    data = LMData(
        token_dir,
        config.data.block_size,
        config.model.family,
        tokenizer,
        layout(ds_config),
        config.trainer.seed,
        config.trainer.eval_batches,
    )
    engine.train()
    waited = total = 0.0
    for step in range(warmup + steps):
        start = time.perf_counter()
        batches = [to_device(b, engine.device) for b in data.train_step(step * data.layout.global_batch)]
        fetched = time.perf_counter()
        for batch in batches:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
        loss.item()
        end = time.perf_counter()
        if step >= warmup:
            waited += fetched - start
            total += end - start
    dist.destroy_process_group()
    return {
        "steps": steps,
        "step_s": total / steps,
        "data_s": waited / steps,
        "device": job.device.type,
        "precision": str(config.precision.dtype),
        "micro": ds_config["train_micro_batch_size_per_gpu"],
        "block": config.data.block_size,
        "model": config.model.name,
        "overrides": overrides,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 plays, 2 steps of a tiny model: a smoke run")
    parser.add_argument(
        "--prepare-child", nargs=3, metavar=("CORPUS", "CACHE", "SAMPLE_MEMORY"), help=argparse.SUPPRESS
    )
    add_save_flag(parser)
    args = parser.parse_args()
    if args.prepare_child:
        corpus, cache, sample_memory = args.prepare_child
        prepare_child(Path(corpus), Path(cache), sample_memory == "1")
        return

    from lmrepo.data.corpus import shakespeare_files
    from lmrepo.data.prepare import prepare
    from lmrepo.data.tokenizer import load_tokenizer

    report = Report(__file__)
    plays = shakespeare_files()[:2] if args.quick else shakespeare_files()
    steps = 2 if args.quick else 20
    with tempfile.TemporaryDirectory(prefix="lmrepo-bench-data-") as tmp:
        tmp = Path(tmp)
        one, ten = tmp / "x1", tmp / "x10"
        size1, size10 = write_corpus(plays, one, 1), write_corpus(plays, ten, 10)
        report.print(
            f"Corpus: {len(plays)} Shakespeare plays ({size1 / 1e6:.1f} MB; the default data=shakespeare"
            f"{' is all 42' if args.quick else ''}), GPT-2 tokenizer, "
            f"{os.cpu_count()} CPU cores (shared with whatever else runs)."
        )

        # 1. preparation against the tutorials' approach on the same text, alternating
        tokenizer = load_tokenizer("gpt2")
        rounds = [
            (run_prepare(one, tmp / "cache1"), tutorial_tokenize(tokenizer, one), tokenizer_alone(tokenizer, one))
            for _ in range(1 if args.quick else 3)
        ]
        (prepared, tutorial, alone), (ours_cpu, tutorial_cpu, alone_cpu) = zip(
            *[
                (max(runs, key=lambda r: r["tokens"] / r["seconds"]), max(r["tokens"] / r["cpu_s"] for r in runs))
                for runs in zip(*rounds)
            ]
        )
        ours_rate, tutorial_rate = prepared["tokens"] / prepared["seconds"], tutorial["tokens"] / tutorial["seconds"]
        alone_rate = alone["tokens"] / alone["seconds"]
        token_dir = prepare(
            compose_config(text_overrides(one, tmp / "cache1")).data, tokenizer
        )  # the last round's, reused
        supply = supply_rate(token_dir, tokenizer)
        waste = 1 - tutorial["tokens"] / tutorial["padded"]
        report.print(
            "\n## 1. Preparation\n\nTokens the tokenizer produced (the tutorials' pad tokens not counted), "
            f"best of {len(rounds)} alternating rounds. The tutorials' sample unit here: a paragraph (theirs: a "
            f"SQuAD context), {tutorial['samples']:,} of them, {tutorial['mean_sample']:.0f} tokens on average; "
            f"batches of {TUTORIAL_BATCH}, padding=True, truncation at {TUTORIAL_MAX_LENGTH} "
            f"({tutorial['at_cap']} samples reach it).\n"
        )
        report.print("| preparation | tokens/s | tokens/CPU-s | tokens | seconds | cores busy |")
        report.print("| --- | --- | --- | --- | --- | --- |")
        for name, run, rate, per_cpu in (
            (
                "lmrepo prepare, once (datasets.map, num_proc=2; loading and writing included)",
                prepared,
                ours_rate,
                ours_cpu,
            ),
            ("the tutorials, tokenize + pad every batch, every epoch", tutorial, tutorial_rate, tutorial_cpu),
            ("the Rust tokenizer alone, one call, no datasets", alone, alone_rate, alone_cpu),
        ):
            report.print(
                f"| {name} | {rate:,.0f} | {per_cpu:,.0f} | {run['tokens']:,} | {run['seconds']:.1f} | "
                f"{run['cpu_s'] / run['seconds']:.1f} |"
            )
        # No preparation with this tokenizer costs less CPU per token than the tokenizer alone; with all
        # cores busy against the tutorials' measured share, that bounds the one-pass ratio.
        bound = alone_cpu / tutorial_cpu * os.cpu_count() / (tutorial["cpu_s"] / tutorial["seconds"])
        epochs = {e: e / tutorial_rate / (1 / ours_rate + e / supply) for e in (1, 3, 10)}
        report.print(
            f"\n- ratio prepare / tutorials, one pass: **{ours_rate / tutorial_rate:.2f}x** (tokens per wall second; "
            "target >= 5x)\n"
            f"- ratio prepare / tutorials, per CPU-second: {ours_cpu / tutorial_cpu:.2f}x (what a token costs, "
            "whatever else runs)\n"
            f"- ratio tokenizer alone / tutorials, per CPU-second: {alone_cpu / tutorial_cpu:.2f}x (the floor of a "
            f"token's cost; with all {os.cpu_count()} cores against the tutorials' share, one pass stays below "
            f"{bound:.1f}x)\n"
            f"- lmrepo training reads from the token file: {supply:,.0f} tokens/s (LMData.train_step)\n"
            f"- ratio train_step supply / tutorials: {supply / tutorial_rate:.0f}x (per epoch after the first, "
            "and per run after the first: the tutorials tokenize again)\n"
            "- ratio over E epochs (tutorials: E tokenizations; lmrepo: one preparation + E reads): "
            + "; ".join(f"{e} epochs {ratio:.2f}x" for e, ratio in epochs.items())
            + f"\n- padding waste: the tutorials' {waste:.1%} of the tokens in their batches "
            f"({tutorial['padded'] - tutorial['tokens']:,} pad tokens); lmrepo 0.0% (packed blocks)"
        )

        # 2. data wait in the default job
        # The first steps allocate and JIT: not the steady state.
        wait = data_wait(
            token_dir, tokenizer, steps, warmup=1 if args.quick else 2, overrides=QUICK_JOB if args.quick else []
        )
        job = f"the smoke run's job ({' '.join(wait['overrides'])})" if wait["overrides"] else "the default job"
        report.print(
            f"\n## 2. Data wait\n\n{job.capitalize()} ({wait['model']}, {wait['precision']}, micro batch "
            f"{wait['micro']} x {wait['block']} tokens, {wait['device']}, 1 rank, {wait['steps']} steps): "
            f"step {wait['step_s'] * 1e3:.0f} ms, train_step {wait['data_s'] * 1e3:.2f} ms.\n\n"
            f"- fraction of a step waiting for data: **{wait['data_s'] / wait['step_s']:.3%}** (target < 1%)"
        )

        # 3. peak memory, x1 and x10
        single, tenfold = (
            run_prepare(one, tmp / "cache1", sample_memory=True),
            run_prepare(ten, tmp / "cache10", sample_memory=True),
        )
        report.print(
            "\n## 3. Peak memory of preparation\n\nA fresh process each, with its datasets.map workers; PSS "
            "sampled every 50 ms.\n\n"
            "| corpus | MB of text | tokens | MB anonymous | of which main process | MB with mapped files |\n"
            "| --- | --- | --- | --- | --- | --- |"
        )
        for name, size, run in (("x1", size1, single), ("x10", size10, tenfold)):
            report.print(
                f"| {name} | {size / 1e6:.1f} | {run['tokens']:,} | {run['anon_mb']:.0f} | "
                f"{run['main_anon_mb']:.0f} | {run['pss_mb']:.0f} |"
            )
        report.print(
            f"\n- ratio x10 / x1 peak memory: **{tenfold['anon_mb'] / single['anon_mb']:.2f}x** "
            f"(anonymous; {tenfold['pss_mb'] / single['pss_mb']:.2f}x with mapped files; flat ~1, not ~10)"
        )
    report.save(
        args.save,
        {
            "quick": args.quick,
            "plays": len(plays),
            "rounds": [dict(zip(("prepare", "tutorial", "tokenizer_alone"), r)) for r in rounds],
            "tokens_per_s": {"prepare": ours_rate, "tutorial": tutorial_rate, "tokenizer_alone": alone_rate},
            "tokens_per_cpu_s": {"prepare": ours_cpu, "tutorial": tutorial_cpu, "tokenizer_alone": alone_cpu},
            "train_step_supply_tokens_per_s": supply,
            "ratio_over_epochs": epochs,
            "tutorial_padding_waste": waste,
            "data_wait": wait,
            "peak_memory": {"x1": {"text_mb": size1 / 1e6, **single}, "x10": {"text_mb": size10 / 1e6, **tenfold}},
        },
    )


if __name__ == "__main__":
    main()
