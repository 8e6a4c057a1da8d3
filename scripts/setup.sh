#!/usr/bin/env bash
# Creates .venv with everything lmrepo needs. Idempotent: a second run only checks.
#   LMREPO_TORCH   torch requirement to install (default torch==2.13.0, the CPU build here).
#                  For your own CUDA build: LMREPO_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
#                  or create .venv yourself with --system-site-packages over an existing torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# libaio: ZeRO-Infinity's NVMe offload (DeepSpeed async_io). Installed when we can (root).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libaio-dev >/dev/null 2>&1; then
  echo "lmrepo: installing libaio-dev with apt-get (NVMe offload's file I/O)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "lmrepo: creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip --disable-pip-version-check"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "lmrepo: installing ${LMREPO_TORCH:-torch==2.13.0} into .venv (the largest download; pip is quiet meanwhile)"
  $PIP install -q ${LMREPO_TORCH:-torch==2.13.0}
fi
# uv installs requirements.txt several times faster than pip (the same versions).
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set nothing writes .pyc files
# later, and every process would compile transformers anew (over a second a rank).
# pip is the fallback: uv does not read pip.conf, so a machine that needs its index settings
# (a mirror, no route to PyPI) gets pip's install.
echo "lmrepo: requirements.txt (DeepSpeed, transformers, Hydra, ...): installing what .venv lacks, with uv"
$PIP install -q uv==0.13.9
if ! .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -r requirements.txt; then
  echo "lmrepo: uv could not install requirements.txt; installing with pip" >&2
  $PIP install -q -r requirements.txt
fi
echo "lmrepo: requirements-nodeps.txt and lmrepo itself (editable): installing what .venv lacks"
$PIP install -q --no-deps -r requirements-nodeps.txt
$PIP install -q --no-deps --no-build-isolation -e .
# versions from the package metadata: importing deepspeed would print its accelerator notice here
echo "lmrepo: environment ready in .venv ($(.venv/bin/python -c 'from importlib.metadata import version as v; print("torch", v("torch"), "deepspeed", v("deepspeed"))'))"
