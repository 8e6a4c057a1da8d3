"""Compare finished runs: a markdown table (compare.md), what differs unasked, and plots.

python scripts/compare.py multirun/2026-11-21/23-07-59          # a sweep: one row per job
python scripts/compare.py outputs/a outputs/b --out reports/ab  # single runs side by side
python scripts/compare.py multirun/lr_optuna                    # a search: the runs, then the trials
python scripts/compare.py --wandb ENTITY/PROJECT/GROUP --out reports/g   # from W&B
"""

import argparse
import os
import sys
from pathlib import Path

from lmrepo.compare import PLOTS, CompareError, load_dirs, load_wandb, report, trials_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="*", type=Path, metavar="DIR", help="run dirs or sweep dirs")
    parser.add_argument("--out", type=Path, help="where compare.md and the plots go (default: the first DIR)")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT[/GROUP]", help="also read these runs from W&B")
    args = parser.parse_args()
    if not args.dirs and not args.wandb:
        parser.error("give at least one DIR or --wandb")
    if not args.dirs and not args.out:
        parser.error("--wandb without a DIR needs --out")
    try:
        jobs = load_dirs(args.dirs) + (load_wandb(args.wandb) if args.wandb else [])
    except CompareError as err:
        print(f"compare: error: {err}", file=sys.stderr, flush=True)
        if args.wandb:
            # A W&B service process that could not reach its server can block the interpreter's
            # exit (seen here: the error printed, then a hang in wandb's atexit teardown).
            os._exit(2)
        raise SystemExit(2) from None
    out = args.out or args.dirs[0]
    table, differences = report(jobs, out)
    print(table, end="")
    for line in differences:
        print(f"compare: not like for like: {line}")
    studies = trials_report(args.dirs, out)  # a search's sweep dir (hparams_search=...): its trials too
    print("".join(studies), end="")
    print(f"compare: wrote {out / 'compare.md'} and {len(PLOTS) + len(studies)} plots")


if __name__ == "__main__":
    main()
