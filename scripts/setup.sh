#!/usr/bin/env bash
# Installs what building and testing rdist needs on a fresh Debian machine
# (idempotent; quick when everything is there). Rust itself must exist
# (rustup); everything else comes from Debian's packages.
set -euo pipefail
need=()
command -v cc >/dev/null || need+=(gcc)
command -v c++ >/dev/null || need+=(g++)
command -v cmake >/dev/null || need+=(cmake)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v make >/dev/null || need+=(make)
# The namespace cluster's loss and delay on kernels without netem
# (scripts/cluster.sh: the statistic match and NFQUEUE).
command -v iptables >/dev/null || need+=(iptables)
# A real Slurm (slurmctld, slurmd, srun) for tests/slurm.rs, which starts
# its own on loopback.
command -v slurmd >/dev/null || need+=(slurm-wlm)
# Debian's python3-* packages serve /usr/bin/python3, which need not be the
# `python3` on PATH (e.g. a pyenv one): check the interpreter they serve.
debian_python=/usr/bin/python3
[ -x "$debian_python" ] || debian_python=python3
"$debian_python" -c "import numpy" 2>/dev/null || need+=(python3-numpy)
"$debian_python" -c "import pytest" 2>/dev/null || need+=(python3-pytest)
# venv with pip (ensurepip), for the wheel test (bindings/python/tests/test_wheel.py).
"$debian_python" -c "import ensurepip" 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found; install Rust with rustup (https://rustup.rs) first" >&2
  exit 1
fi
# NCCL's real library, for the tests that find and load it (no GPU needed):
# the nvidia-nccl-cu12 wheel unpacked into build/nccl (git-ignored), once;
# later runs on the same machine reuse it. Nothing is exported: the tests
# look there (scripts/test.sh passes the folder as RDIST_TEST_NCCL_DIR).
# When pip fails, those tests print "skipped: NCCL not installed".
root="$(cd "$(dirname "$0")/.." && pwd)"
nccl_dir="$root/build/nccl"
if [ ! -f "$nccl_dir/nvidia/nccl/lib/libnccl.so.2" ]; then
  echo "setup: installing NCCL (PyPI's nvidia-nccl-cu12, ~350 MB download) into build/nccl"
  rm -rf "$nccl_dir.partial"
  if PIP_ROOT_USER_ACTION=ignore timeout 300 python3 -m pip install -q --no-deps --disable-pip-version-check \
      --no-warn-script-location --target "$nccl_dir.partial" nvidia-nccl-cu12 \
      && [ -f "$nccl_dir.partial/nvidia/nccl/lib/libnccl.so.2" ]; then
    rm -rf "$nccl_dir" && mv "$nccl_dir.partial" "$nccl_dir"
  else
    rm -rf "$nccl_dir.partial"
    echo "setup: could not install nvidia-nccl-cu12 with pip; the tests that load NCCL will be skipped" >&2
  fi
fi
