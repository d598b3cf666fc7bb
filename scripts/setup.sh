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
# Debian's python3-* packages serve /usr/bin/python3, which need not be the
# `python3` on PATH (e.g. a pyenv one): check the interpreter they serve.
debian_python=/usr/bin/python3
[ -x "$debian_python" ] || debian_python=python3
"$debian_python" -c "import numpy" 2>/dev/null || need+=(python3-numpy)
"$debian_python" -c "import pytest" 2>/dev/null || need+=(python3-pytest)
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
