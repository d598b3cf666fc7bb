#!/usr/bin/env bash
# The native suite: configures the CMake build in build/ (Debug: it reuses
# cargo's target/debug), builds librdist through cargo plus the C/C++ tests
# and examples, then runs them with ctest, each bounded by a timeout. Its
# last lines are ctest's summary. Run by scripts/test.sh; also works alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CARGO_TERM_COLOR=never
cmake -S . -B build -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build -j2
ctest --test-dir build --output-on-failure --timeout 120
