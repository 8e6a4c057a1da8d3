"""Checkpoint save and load time and size per ZeRO stage, on real 2-rank runs.

    python benchmarks/bench_checkpoint.py [--models gpt2-tiny gpt2] [--ranks 2] [--save]   # ~6 min on 2 cores
    python benchmarks/bench_checkpoint.py --models gpt2-tiny     # the smallest run (~2 min on 2 cores)

Each (model, stage): one step then a save (train.py logs checkpoint_save_s / checkpoint_gb),
then a resume from it (train.py logs checkpoint_load_s); checkpoint_sync_s is the part of the save
that makes it durable (every file fsynced and checksummed into manifest.json), read back from metrics.jsonl. The
precision is train.py's default, precision=auto: bf16 where the CPU computes it natively, else fp32.
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from common import REPO, Report, add_save_flag  # benchmarks/common.py, first on sys.path: puts the repository on it
from lmrepo.distributed.launch import launch_command
from lmrepo.utils.errors import exit_error

COMMON = [
    "trainer.micro_batch_size=1",
    "schedule.warmup_steps=0",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.eval_batches=1",
    "trainer.save_every=1",
    "logger=jsonl",
]


def launch(run_dir: Path, ranks: int, overrides: list[str]) -> dict:
    proc = subprocess.run(
        [*launch_command(ranks), str(REPO / "train.py"), *COMMON, *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        cwd=run_dir.parent,
    )
    if proc.returncode != 0:
        exit_error(
            f"bench_checkpoint: {' '.join(overrides)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}", code=1
        )
    merged = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        merged.update(json.loads(line))
    return merged


def precision(model: str, ranks: int) -> str:
    """What precision=auto trains in here."""
    from lmrepo.plan.compose import compose_config
    from lmrepo.plan.job import plan
    from lmrepo.utils.errors import ConfigError

    try:
        return str(
            plan(compose_config([*COMMON, f"model={model}", "trainer.max_steps=1"]), ranks).config.precision.dtype
        )
    except ConfigError as err:
        exit_error(str(err))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-tiny", "gpt2"])
    parser.add_argument("--ranks", type=int, default=2)
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__)
    dtype = precision(args.models[0], args.ranks)
    report.print(f"{args.ranks} ranks, {dtype}, AdamW, micro batch 1 x 128 tokens; one checkpoint each.\n")
    report.print(
        "| model | zero | size (GiB) | save (s) | of which fsync + checksums (s) | load (s) |\n"
        "| --- | --- | --- | --- | --- | --- |"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmrepo-bench-ckpt-") as tmp:  # the checkpoints: GBs, not kept
        out = Path(tmp)
        for model in args.models:
            for stage in range(4):
                first = out / f"{model}-{stage}-save"
                saved = launch(first, args.ranks, [f"model={model}", f"zero=stage{stage}", "trainer.max_steps=1"])
                loaded = launch(
                    out / f"{model}-{stage}-load",
                    args.ranks,
                    [f"model={model}", f"zero=stage{stage}", "trainer.max_steps=2", f"run.resume={first}"],
                )
                row = {
                    "model": model,
                    "zero": stage,
                    "gb": saved["checkpoint_gb"],
                    "save_s": saved["checkpoint_save_s"],
                    "sync_s": saved["checkpoint_sync_s"],
                    "load_s": loaded["checkpoint_load_s"],
                }
                rows.append(row)
                report.print(
                    f"| {model} | {stage} | {row['gb']:.3f} | {row['save_s']:.2f} | {row['sync_s']:.2f} "
                    f"({row['sync_s'] / row['save_s']:.0%}) | {row['load_s']:.2f} |"
                )
    report.save(args.save, {"ranks": args.ranks, "precision": dtype, "runs": rows})


if __name__ == "__main__":
    main()
