"""What the composition matrix (tests/test_composition.py) costs, and what its choice of compile
backends saves, measured side by side in one run:

1. the block-level pairs of compile (with Muon, the tiled loss, document masking, activation
   checkpointing, bf16) twice: compiled with inductor, and with the backend the suite gives each
   (tests/composition.py's COMPILE_BACKEND), each set in one launch from an empty inductor cache;
2. the whole matrix as the suite runs it: every allowed pair and its reference in one 2-rank
   launch from an empty inductor cache, its seconds by how a case was compiled (none,
   AOTAutograd without inductor, inductor) and the launch's own (start, imports, the data).

    python benchmarks/bench_composition.py [--save]   # ~10 min on 2 cores

DeepSpeed's ops the matrix loads (the CPU all-reduce, CPU Adam) are built first, untimed, in
train.py's build directory (benchmarks/common.py pins it): the test session builds them once for
all its tests, and the first offload case would otherwise hold a build.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Report, add_save_flag  # benchmarks/common.py

sys.path.insert(0, str(REPO / "tests"))
import composition  # noqa: E402  (tests/composition.py: the pairs and their overrides)
from lmrepo.distributed.launch import launch_command  # noqa: E402
from lmrepo.utils import ops  # noqa: E402

BLOCK_LEVEL = ["muon", "tiled_loss", "document_masking", "activation_checkpointing", "bf16"]


def probe_env(inductor_cache: Path) -> dict:
    """The ranks' environment: the probe imports tests/composition.py, and inductor starts empty."""
    path = os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}


def launch(cases: list[list[str]], workdir: Path) -> dict:
    """One 2-rank launch of the suite's probe over `cases`, from an empty inductor cache: its wall
    seconds and each case's result (seconds, step seconds, what compiled it)."""
    workdir.mkdir(parents=True)
    (workdir / "cases.json").write_text(json.dumps(cases))
    started = time.perf_counter()
    proc = subprocess.run(
        [
            *launch_command(2, "torchrun"),
            str(REPO / "tests" / "probes" / "composition_probe.py"),
            str(workdir / "results.json"),
            str(workdir / "cases.json"),
        ],
        cwd=workdir,
        env=probe_env(workdir / "inductor"),
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"the probe's launch in {workdir} ended with exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    wall = time.perf_counter() - started
    return {"wall_s": wall, "cases": json.loads((workdir / "results.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__, device="cpu")
    ops.build(["shm", "cpu_adam"])
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = composition.short_documents(tmp / "paragraphs.jsonl")

        chosen = [[*composition.overrides("compile", axis), *data] for axis in BLOCK_LEVEL]
        inductor = [[*words, "trainer.compile_backend=inductor"] for words in chosen]
        runs = {"inductor": launch(inductor, tmp / "inductor"), "suite": launch(chosen, tmp / "suite")}
        report.print(
            "#### The block-level pairs of compile, by backend\n\n"
            "Each column one 2-rank launch of the five cases in this order, from an empty inductor cache; "
            "seconds per case (its first step, which compiles, in brackets).\n\n"
            "| pair | inductor | the suite's backend | which | inductor / suite's |\n| --- | ---: | ---: | --- | ---: |"
        )
        figures["block_level"] = {}
        for axis, ours, theirs in zip(BLOCK_LEVEL, chosen, inductor):
            slow = runs["inductor"]["cases"][composition.case_name(theirs)]
            fast = runs["suite"]["cases"][composition.case_name(ours)]
            backend = composition.compile_backend("compile", axis)
            figures["block_level"][axis] = {"inductor": slow, "suite": fast, "suite_backend": backend}
            report.print(
                f"| compile + {axis} | {slow['seconds']:.1f} ({slow['step_seconds'][0]:.1f}) "
                f"| {fast['seconds']:.1f} ({fast['step_seconds'][0]:.1f}) | {backend} "
                f"| {slow['seconds'] / fast['seconds']:.1f}x |"
            )
        totals = {name: sum(c["seconds"] for c in run["cases"].values()) for name, run in runs.items()}
        report.print(
            f"| all five | {totals['inductor']:.1f} | {totals['suite']:.1f} | "
            f"| {totals['inductor'] / totals['suite']:.1f}x |\n"
        )

        allowed = composition.allowed_pairs()
        cases = composition.matrix_cases(allowed, data)
        matrix = launch(cases, tmp / "matrix")
        by_kind: dict[str, list[float]] = {}
        for result in matrix["cases"].values():
            by_kind.setdefault(result.get("compiled_by", "refused or broken"), []).append(result["seconds"])
        in_cases = sum(sum(seconds) for seconds in by_kind.values())
        figures["matrix"] = {
            "pairs": len(allowed),
            "cases": len(cases),
            "wall_s": matrix["wall_s"],
            "by_kind": {kind: {"cases": len(s), "seconds": sum(s)} for kind, s in by_kind.items()},
            "results": matrix["cases"],
        }
        report.print(
            f"#### The whole matrix, one 2-rank launch\n\n{len(allowed)} allowed pairs, "
            f"{len(cases)} cases (each pair and its reference, once each), from an empty inductor cache: "
            f"**{matrix['wall_s']:.0f} s**.\n\n"
            "| cases compiled by | cases | seconds | per case |\n| --- | ---: | ---: | ---: |"
        )
        for kind, seconds in sorted(by_kind.items(), key=lambda item: -sum(item[1])):
            report.print(f"| {kind} | {len(seconds)} | {sum(seconds):.1f} | {sum(seconds) / len(seconds):.2f} |")
        report.print(f"| the launch itself (start, imports, data, tear-down) | | {matrix['wall_s'] - in_cases:.1f} | |")
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
