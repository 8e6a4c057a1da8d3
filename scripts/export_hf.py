"""Export a training checkpoint (any ZeRO stage) to a Hugging Face model directory.

    python scripts/export_hf.py outputs/2026-11-21/12-00-00 exported/       # the run's latest checkpoint
    python scripts/export_hf.py RUN/checkpoints/step_00000400 exported/     # a given one

Then: AutoModelForCausalLM.from_pretrained("exported/") (GPT-2) or AutoModelForMaskedLM (BERT).
"""

import argparse
from pathlib import Path

from lmrepo.utils import quiet

quiet.install()  # before DeepSpeed is imported: its accelerator notice is no line for the user

from lmrepo.export import export  # noqa: E402
from lmrepo.utils.errors import ConfigError, exit_error  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run directory, its checkpoints/ directory, or checkpoints/<tag>")
    parser.add_argument("out", type=Path, help="the Hugging Face model directory to write")
    args = parser.parse_args()
    try:
        out = export(args.source, args.out)
    except ConfigError as err:
        exit_error(str(err))
    print(f"export_hf: wrote {out}")


if __name__ == "__main__":
    main()
