#!/usr/bin/env bash
# Runs the Python binding's test suite (bindings/python/tests) against
# target/debug/librdist.so: real multi-process jobs through rdistrun and
# spawned ranks, the examples in examples/python, and the library search;
# tests/test_wheel.py also runs `pip install ./bindings/python` into a fresh
# venv (offline; cargo reuses target/debug) and a 2-rank job with the
# installed package from another directory, and checks that the source tree
# is left untouched. tests/test_torch.py runs rdist inside PyTorch (the
# "rdist" torch.distributed backend, DDP and ZeRO against gloo, torchrun)
# with the torch venv's Python from scripts/torch-env.sh (installed on first
# use, ~4 GB; RDIST_TORCH_PYTHON=/path/to/python picks another, and
# RDIST_SKIP_TORCH=1 skips them); when none can be had those tests print
# `skipped:` lines. The torch tests run again with the backend's
# pure-Python fallback, and with the oldest torch rdist supports
# (scripts/torch-env.sh --oldest; RDIST_SKIP_TORCH_OLDEST=1 skips that).
# Its last line counts the tests of every pytest run.
#
# Needs a Python >= 3.9 with numpy and pytest. It uses $PYTHON if set, else
# `python3` if it has both; /usr/bin/python3 if it has both (here
# `python3` may be a pyenv Python that cannot see Debian's python3-numpy);
# otherwise it installs python3-numpy and python3-pytest with apt (as
# scripts/setup.sh does) or, failing that, numpy and pytest with pip.
set -euo pipefail
cd "$(dirname "$0")/.."

has_test_deps() {
  "$1" -c 'import sys, numpy, pytest; sys.exit(sys.version_info < (3, 9))' >/dev/null 2>&1
}

find_python() {
  local candidate candidates=(python3 /usr/bin/python3)
  [ -z "${PYTHON:-}" ] || candidates=("$PYTHON")  # an explicit choice is the only one
  for candidate in "${candidates[@]}"; do
    if command -v "$candidate" >/dev/null 2>&1 && has_test_deps "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if ! python=$(find_python); then
  if command -v apt-get >/dev/null 2>&1; then
    echo "test-python: installing python3-numpy and python3-pytest (apt)"
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
    export DEBIAN_FRONTEND=noninteractive
    { $sudo apt-get update -q && $sudo apt-get install -y -q --no-install-recommends \
        python3 python3-numpy python3-pytest; } >/dev/null || echo "test-python: apt failed" >&2
  fi
  if ! python=$(find_python); then
    python=${PYTHON:-python3}
    echo "test-python: installing numpy and pytest for $python (pip)"
    "$python" -m pip install --quiet numpy pytest \
      || "$python" -m pip install --quiet --user numpy pytest \
      || true
    if ! has_test_deps "$python"; then
      echo "test-python: no Python >= 3.9 with numpy and pytest; set PYTHON=/path/to/python" >&2
      exit 1
    fi
  fi
fi

if [ ! -f target/debug/librdist.so ] || [ ! -x target/debug/rdistrun ]; then
  echo "test-python: building target/debug (cargo build)"
  cargo build -q
fi

# The torch tests' ranks run with the torch venv's Python (pytest itself may not have torch).
if [ -n "${RDIST_SKIP_TORCH:-}" ]; then
  echo "test-python: skipped: the torch tests (RDIST_SKIP_TORCH is set)"
  export RDIST_TORCH_PYTHON=
elif [ -z "${RDIST_TORCH_PYTHON:-}" ]; then
  if RDIST_TORCH_PYTHON=$(bash scripts/torch-env.sh); then
    export RDIST_TORCH_PYTHON
  else
    echo "test-python: skipped: torch could not be installed (scripts/torch-env.sh failed); the torch tests skip"
    export RDIST_TORCH_PYTHON=
  fi
fi
[ -z "${RDIST_TORCH_PYTHON:-}" ] || echo "test-python: torch tests with $RDIST_TORCH_PYTHON"

# Test exactly this build, never another librdist the search could find.
export RDIST_LIBRARY="$PWD/target/debug/librdist.so"
echo "test-python: $("$python" -c 'import sys; print(sys.executable, sys.version.split()[0])'), RDIST_LIBRARY=$RDIST_LIBRARY"

# The compiled torch backend, built for a torch Python before its ranks
# start (they would build it at init_process_group, one rank at a time).
prebuild() {
  PYTHONPATH=bindings/python "$1" -m rdist.torch_build \
    || echo "test-python: the compiled torch backend did not build for $1 (the tests say what fails)"
}

passed=0
started=$(date +%s)
# pytest exits 5 when it collects no tests; like any non-zero status that fails this script.
# -rs: each skipped test prints its reason (e.g. no CUDA device).
run_pytest() {
  local log rc=0
  log=$(mktemp)
  set +e
  "$python" -m pytest "$@" -q -rs -p no:cacheprovider 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  passed=$((passed + $(grep -E -o "^[0-9]+ passed" "$log" | tail -1 | grep -E -o "^[0-9]+" || echo 0)))
  rm -f "$log"
  return "$rc"
}

[ -z "${RDIST_TORCH_PYTHON:-}" ] || prebuild "$RDIST_TORCH_PYTHON"
run_pytest bindings/python/tests

if [ -n "${RDIST_TORCH_PYTHON:-}" ]; then
  # The pure-Python fallback (where nothing can be compiled): every call
  # against the reference and gloo.
  echo "test-python: the torch backend's pure-Python fallback (RDIST_TORCH_BACKEND=python)"
  RDIST_TORCH_BACKEND=python run_pytest bindings/python/tests/test_torch.py -k "every_call or 0_2_api"
  # The oldest torch rdist supports, as the newest ran above.
  if [ -n "${RDIST_SKIP_TORCH_OLDEST:-}" ]; then
    echo "test-python: skipped: the oldest torch's run (RDIST_SKIP_TORCH_OLDEST is set)"
  elif oldest=$(bash scripts/torch-env.sh --oldest); then
    echo "test-python: the torch tests with the oldest supported torch: $oldest"
    prebuild "$oldest"
    RDIST_TORCH_PYTHON=$oldest run_pytest bindings/python/tests/test_torch.py
  else
    echo "test-python: skipped: the oldest torch could not be installed (scripts/torch-env.sh --oldest failed)"
  fi
fi
# The last line counts every run's tests (scripts/test.sh reads it).
echo "$passed passed in $(( $(date +%s) - started )) s (every pytest run above)"
