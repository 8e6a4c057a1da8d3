"""The default job's speed with precision=bf16 (bf16 whatever the CPU) against precision=auto,
on this CPU as it is and on this CPU with its native bf16 hidden (oneDNN and ATen capped at AVX2,
as on an AMD Zen 3), side by side in one run.

    python benchmarks/bench_precision.py [--steps 4] [--out DIR] [--save]
    # ~10 min on a 2-core CPU with native bf16: the bf16 arm with it hidden takes ~100 s a step

Each arm is `python train.py` (the default job: gpt2-tiny, 128-token blocks, micro batch 8) for
--steps steps; the step time is the median of the logged steps after the first. Prints, per CPU
mode: the precision auto chose, step time and tokens/s of each arm, and their ratio.
"""

import argparse
import tempfile
from pathlib import Path

import yaml

from common import (  # benchmarks/common.py, first on sys.path: puts the repository on it
    DEFAULT_JOB_TOKENS_PER_STEP,
    NO_BF16,
    Report,
    add_save_flag,
    time_default_job,
)


def run(out: Path, name: str, precision: str, steps: int, env: dict) -> dict:
    run_dir = out / name
    result = time_default_job(run_dir, [f"precision={precision}"], steps, env, untimed=1)
    chosen = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    return {
        "precision": chosen["precision"]["dtype"],
        "step_s": result["step_s"],
        "tokens_per_s": DEFAULT_JOB_TOKENS_PER_STEP / result["step_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__, device="cpu")
    out = args.out or Path(tempfile.mkdtemp(prefix="lmrepo-bench-precision-"))
    out.mkdir(parents=True, exist_ok=True)
    report.print("| CPU | arm | precision | step s | tokens/s |\n| --- | --- | --- | --- | --- |")
    figures = {"steps": args.steps, "modes": {}}
    for mode, env in (("as it is", {}), ("native bf16 hidden (AVX2)", NO_BF16)):
        bf16 = run(out, f"bf16-{len(env)}", "bf16", args.steps, env)
        auto = run(out, f"auto-{len(env)}", "auto", args.steps, env)
        figures["modes"][mode] = {"precision=bf16": bf16, "precision=auto": auto}
        for arm, result in (("precision=bf16", bf16), ("precision=auto (the default)", auto)):
            report.print(
                f"| {mode} | {arm} | {result['precision']} | {result['step_s']:.3f} | {result['tokens_per_s']:,.0f} |"
            )
        report.print(f"| {mode} | bf16 / auto step time | | {bf16['step_s'] / auto['step_s']:.2f}x | |")
    report.save(args.save, figures)


if __name__ == "__main__":
    main()
