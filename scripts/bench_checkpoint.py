"""Checkpoint save and load time and size per ZeRO stage, on real 2-rank runs.

    python scripts/bench_checkpoint.py [--models gpt2-tiny gpt2] [--ranks 2]

Each (model, stage): one step then a save (train.py logs checkpoint_save_s / checkpoint_gb),
then a resume from it (train.py logs checkpoint_load_s), read back from metrics.jsonl.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["trainer.micro_batch_size=1", "trainer.warmup_steps=0", "trainer.log_every=1", "trainer.eval_every=0",
          "trainer.eval_batches=1", "trainer.save_every=1", "logger=jsonl"]


def launch(run_dir: Path, ranks: int, overrides: list[str]) -> dict:
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    proc = subprocess.run([deepspeed, "--num_gpus", str(ranks), str(REPO / "train.py"), *COMMON, *overrides,
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, cwd=run_dir.parent)
    if proc.returncode != 0:
        raise SystemExit(f"bench_checkpoint: {' '.join(overrides)} failed:\n{proc.stdout[-2000:]}")
    merged = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        merged.update(json.loads(line))
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-tiny", "gpt2"])
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="lmrepo-bench-ckpt-"))
    print(f"{args.ranks} ranks, bf16, AdamW, micro batch 1 x 128 tokens; one checkpoint each")
    print("| model | zero | size (GiB) | save (s) | load (s) |\n| --- | --- | --- | --- | --- |")
    for model in args.models:
        for stage in range(4):
            first = out / f"{model}-{stage}-save"
            saved = launch(first, args.ranks, [f"model={model}", f"zero=stage{stage}", "trainer.max_steps=1"])
            loaded = launch(out / f"{model}-{stage}-load", args.ranks,
                            [f"model={model}", f"zero=stage{stage}", "trainer.max_steps=2", f"run.resume={first}"])
            print(f"| {model} | {stage} | {saved['checkpoint_gb']:.3f} | {saved['checkpoint_save_s']:.2f} | "
                  f"{loaded['checkpoint_load_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
