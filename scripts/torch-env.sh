#!/usr/bin/env bash
# Prints the path of a Python that has PyPI's torch (used on CPU: the
# torch.distributed interop tests and examples), numpy and pytest, setting
# up a cached venv the first time. The venv lives outside the checkout so
# that clean clones on one machine share it:
#   $RDIST_TORCH_VENV, else ${XDG_CACHE_HOME:-~/.cache}/rdist/torch-venv
# (torch-<version>-venv for a torch other than the newest).
# PyPI has only the CUDA build of torch for x86_64 Linux (~4 GB with its
# nvidia-* wheels, which torch imports even on CPU); triton and
# cuda-bindings are not needed and are removed. Progress goes to stderr.
set -euo pipefail
# The newest torch rdist is tested on; `--oldest` (or RDIST_TORCH_VERSION)
# asks for another, in a venv of its own beside it.
NEWEST=2.15.0
OLDEST=2.4.1
if [ "${1:-}" = "--oldest" ]; then
  RDIST_TORCH_VERSION=$OLDEST
  RDIST_TORCH_VENV=
fi
TORCH_VERSION=${RDIST_TORCH_VERSION:-$NEWEST}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/rdist
if [ "$TORCH_VERSION" = "$NEWEST" ]; then
  venv=${RDIST_TORCH_VENV:-$cache/torch-venv}
else
  venv=${RDIST_TORCH_VENV:-$cache/torch-$TORCH_VERSION-venv}
fi
py="$venv/bin/python"
ready() {
  [ -x "$py" ] && "$py" -c "import torch, numpy, pytest, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" >/dev/null 2>&1
}
if ! ready; then
  echo "torch-env: installing torch $TORCH_VERSION into $venv (first time only; ~4 GB)" >&2
  base=${PYTHON:-python3}
  mkdir -p "$(dirname "$venv")"
  # One installer at a time (test suites may start in parallel).
  exec 9>"$venv.lock"
  flock 9
  if ! ready; then
    [ -x "$py" ] || "$base" -m venv "$venv" >&2
    "$py" -m pip install -q --upgrade pip >&2
    "$py" -m pip install -q "torch==$TORCH_VERSION" numpy pytest >&2
    "$py" -m pip uninstall -y -q triton cuda-bindings >&2 || true
  fi
  ready || { echo "torch-env: torch did not install into $venv" >&2; exit 1; }
fi
echo "$py"
