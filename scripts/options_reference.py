"""The pages generated from the config: the option reference (from the typed schema) and the
recipes table of docs/sweeps.md (from conf/experiment/).

python scripts/options_reference.py            # print docs/reference/options.md as it should be
python scripts/options_reference.py --write    # write it, and the recipes table into docs/sweeps.md
"""

import sys

from lmrepo.compose import compose_config
from lmrepo.config.reference import OPTIONS_PAGE, SWEEPS_PAGE, markdown, with_recipes_table


def options_page() -> str:
    # run.dir as train.py's defaults write it, not the pinned path compose_config uses by default
    return markdown(compose_config([], run_dir="${hydra:runtime.output_dir}"))


if __name__ == "__main__":
    if "--write" in sys.argv:
        OPTIONS_PAGE.write_text(options_page())
        SWEEPS_PAGE.write_text(with_recipes_table(SWEEPS_PAGE.read_text()))
        print(f"wrote {OPTIONS_PAGE} and the recipes table of {SWEEPS_PAGE}")
    else:
        print(options_page(), end="")
