#!/usr/bin/env bash
# The test suite's Slurm cluster (tests/test_slurm.py starts slurmctld and two slurmd on this
# machine): Debian's daemons and client tools, installed where we can (root with apt-get). Without
# them the Slurm tests skip, saying why.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "lmrepo: Slurm is not installed and this is not root with apt-get: tests/test_slurm.py will skip"
  exit 0
fi
echo "lmrepo: installing Slurm (slurmctld, slurmd, its client tools) with apt-get, for the suite's two-node cluster"
export DEBIAN_FRONTEND=noninteractive
PACKAGES="slurmctld slurmd slurm-client"
# Best effort: a failed install leaves the Slurm tests skipping, never the setup failing.
if ! apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null 2>&1; then
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null; } 2>/dev/null; then
    echo "lmrepo: apt-get could not install $PACKAGES: tests/test_slurm.py will skip"
  fi
fi
