"""Runs train.py's __main__ once per command line in this one interpreter (a process per case
costs two seconds of imports); each case sees a fresh environment. Prints one JSON line per
case: the exit code and stderr. Used by tests/test_bad_values.py.

    python tests/probes/bad_value_driver.py CASES.json     (a list of argument lists)
"""

import contextlib
import io
import json
import os
import runpy
import sys
from pathlib import Path

TRAIN = str(Path(__file__).resolve().parents[2] / "train.py")


def run(args: list[str]) -> dict:
    environment = dict(os.environ)
    err = io.StringIO()
    sys.argv, code = [TRAIN, *args], 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(TRAIN, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
        finally:
            os.environ.clear()
            os.environ.update(environment)  # what train.py set (HYDRA_FULL_ERROR, ...) is the case's alone
    return {"args": args, "code": code, "stderr": err.getvalue()}


if __name__ == "__main__":
    for case in json.loads(Path(sys.argv[1]).read_text()):
        print(json.dumps(run(case)), flush=True)
