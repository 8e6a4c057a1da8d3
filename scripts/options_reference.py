"""The option reference page, generated from the typed schema.

python scripts/options_reference.py            # print docs/reference/options.md as it should be
python scripts/options_reference.py --write    # write it
"""

import sys

from lmrepo.compose import compose_config
from lmrepo.config.reference import OPTIONS_PAGE, markdown


def options_page() -> str:
    # run.dir as train.py's defaults write it, not the pinned path compose_config uses by default
    return markdown(compose_config([], run_dir="${hydra:runtime.output_dir}"))


if __name__ == "__main__":
    if "--write" in sys.argv:
        OPTIONS_PAGE.write_text(options_page())
        print(f"wrote {OPTIONS_PAGE}")
    else:
        print(options_page(), end="")
