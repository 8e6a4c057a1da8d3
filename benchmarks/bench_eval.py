"""Downstream evaluation, measured: lmrepo's lm-eval wrapper against the harness's own `hf` model
(HFLM) on the same weights and requests, and the in-loop evaluation's share of a training run.

    python benchmarks/bench_eval.py              # the default job (300 steps) with eval.tasks=[shakespeare] (~9-11 min)
    python benchmarks/bench_eval.py --quick      # 30 steps, limit 64: a smoke run (~2 min)
    python benchmarks/bench_eval.py --save       # also writes benchmarks/results/bench_eval_<machine>_<yyyy-mm>.md

1. train.py at its defaults plus `eval.tasks=[shakespeare]` (lmrepo's four local tasks, every
   document, at eval.every/limit/batch_size's defaults: once, at the end): the evaluation's
   seconds (downstream_s) against the run's wall time (status.json).
2. The run's last checkpoint, consolidated in memory (lmrepo's wrapper) and exported to a
   Hugging Face directory (HFLM, batch size equal): each request type's requests timed on both
   in alternating rounds in this process (the better of the rounds per side), requests per
   second and their ratio, and how far the answers are apart (the largest log-likelihood
   difference; whether every greedy flag and every generation is the same).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    REPO,
    Report,
    add_save_flag,
    machine,
)  # benchmarks/common.py, first on sys.path: puts the repository on it
from lmrepo.utils.errors import exit_error

TYPES = {
    "loglikelihood": ["shakespeare_lastword", "shakespeare_cloze"],
    "loglikelihood_rolling": ["shakespeare_speeches"],
    "generate_until": ["shakespeare_lastword_gen"],
}


def train(run_dir: Path, steps: int) -> dict:
    overrides = [
        "eval.tasks=[shakespeare]",
        f"trainer.max_steps={steps}",
        f"trainer.save_every={steps}",
        "logger=jsonl",
    ]
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        cwd=run_dir.parent,
    )
    if proc.returncode != 0:
        exit_error(f"bench_eval: train.py failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}", code=1)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    status = json.loads((run_dir / "status.json").read_text())
    downstream = sum(line.get("downstream_s", 0) for line in lines)
    return {
        "steps": steps,
        "wall_s": status["wall_s"],
        "downstream_s": downstream,
        "share": downstream / status["wall_s"],
        "metrics": {k: v for line in lines for k, v in line.items() if k.startswith("eval/")},
    }


def requests_of(limit: int) -> dict[str, list]:
    """Each request type's lm-eval Instances, built by the harness from lmrepo's local tasks."""
    from lmrepo.evaluation.tasks import TaskSet

    tasks = TaskSet([name for names in TYPES.values() for name in names]).load()["tasks"]
    built = {}
    for kind, names in TYPES.items():
        built[kind] = []
        for name in names:
            tasks[name].build_all_requests(limit=limit, rank=0, world_size=1)
            built[kind] += [instance for instance in tasks[name].instances for _ in range(instance.repeats)]
    return built


def timed(lm, kind: str, requests: list) -> tuple[float, list]:
    start = time.perf_counter()
    answers = getattr(lm, kind)(requests)
    return time.perf_counter() - start, answers


def agreement(kind: str, ours: list, theirs: list) -> dict:
    if kind == "generate_until":
        return {"max_abs_dll": None, "same": ours == theirs}
    if kind == "loglikelihood_rolling":
        return {"max_abs_dll": max(abs(a - b) for a, b in zip(ours, theirs)), "same": True}
    return {
        "max_abs_dll": max(abs(a[0] - b[0]) for a, b in zip(ours, theirs)),
        "same": [a[1] for a in ours] == [b[1] for b in theirs],
    }


def compare(run_dir: Path, limit: int, rounds: int, batch_size: int) -> dict:
    import torch
    from lm_eval.models.huggingface import HFLM

    from lmrepo.data.tokenizer import load_tokenizer
    from lmrepo.evaluation.lm import LmrepoLM
    from lmrepo.export import consolidate, export

    whole = consolidate(str(run_dir))
    hf_dir = export(str(run_dir), run_dir / "hf")
    ours = LmrepoLM(whole.model.eval(), load_tokenizer(whole.config.tokenizer), batch_size, torch.device("cpu"))
    theirs = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=batch_size)
    rows = {}
    for kind, requests in requests_of(limit).items():
        best, answers = {"lmrepo": float("inf"), "hf": float("inf")}, {}
        for round_ in range(rounds):  # alternating, each side first in turn: a busy machine slows both alike
            order = [("lmrepo", ours), ("hf", theirs)][:: 1 if round_ % 2 == 0 else -1]
            for name, lm in order:
                seconds, answers[name] = timed(lm, kind, requests)
                best[name] = min(best[name], seconds)
        rows[kind] = {
            "requests": len(requests),
            "lmrepo_rps": len(requests) / best["lmrepo"],
            "hf_rps": len(requests) / best["hf"],
            "ratio": best["hf"] / best["lmrepo"],
            **agreement(kind, answers["lmrepo"], answers["hf"]),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (300: the default job)")
    parser.add_argument("--limit", type=int, default=200, help="documents per task for the side-by-side timing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="30 steps, limit 64, 2 rounds")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__)
    if args.quick:
        args.steps, args.limit, args.rounds = 30, 64, 2
    with tempfile.TemporaryDirectory(prefix="bench_eval-") as tmp:
        run_dir = Path(tmp) / "run"
        in_loop = train(run_dir, args.steps)
        side_by_side = compare(run_dir, args.limit, args.rounds, args.batch_size)
    figures = {
        "machine": machine(),
        "in_loop": in_loop,
        "side_by_side": side_by_side,
        "limit": args.limit,
        "batch_size": args.batch_size,
    }
    report.print(
        f"In-loop evaluation, train.py defaults + eval.tasks=[shakespeare], {args.steps} steps: "
        f"{in_loop['downstream_s']:.1f} s of {in_loop['wall_s']:.1f} s wall = {in_loop['share']:.1%}."
    )
    report.print(
        f"\nSide by side, {args.limit} documents per task, batch size {args.batch_size}, "
        f"best of {args.rounds} rounds:\n"
    )
    report.print(
        "| request type | requests | lmrepo req/s | HFLM req/s | lmrepo / HFLM | max abs log-lik diff | same "
        "greedy answers |"
    )
    report.print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind, row in side_by_side.items():
        diff = "-" if row["max_abs_dll"] is None else f"{row['max_abs_dll']:.2e}"
        report.print(
            f"| {kind} | {row['requests']} | {row['lmrepo_rps']:.1f} | {row['hf_rps']:.1f} | {row['ratio']:.3f} | "
            f"{diff} | {row['same']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
