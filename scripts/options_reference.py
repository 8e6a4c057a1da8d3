"""The pages generated from the config: the option reference (from the typed schema) and the
tables of docs/sweeps.md (the recipes in conf/experiment/, the figures of lmrepo/observability/figures.py).

python scripts/options_reference.py            # print docs/reference/options.md as it should be
python scripts/options_reference.py --write    # write it, and docs/sweeps.md's generated tables
"""

import sys

from lmrepo.config.reference import OPTIONS_PAGE, SWEEPS_PAGE, markdown, with_generated_tables
from lmrepo.plan.compose import compose_config


def options_page() -> str:
    # run.dir as train.py's defaults write it, not the pinned path compose_config uses by default
    return markdown(compose_config([], run_dir="${hydra:runtime.output_dir}"))


if __name__ == "__main__":
    if "--write" in sys.argv:
        OPTIONS_PAGE.write_text(options_page())
        SWEEPS_PAGE.write_text(with_generated_tables(SWEEPS_PAGE.read_text()))
        print(f"wrote {OPTIONS_PAGE} and the generated tables of {SWEEPS_PAGE}")
    else:
        print(options_page(), end="")
