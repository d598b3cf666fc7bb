#!/usr/bin/env bash
# The native suite: configures the CMake build in build/, builds librdist
# through cargo plus the C/C++ tests and examples, then runs them with
# ctest, each bounded by a timeout. Its last lines are ctest's summary. Run
# by scripts/test.sh; also works alone.
#
# A plain CMake build keeps cargo's output in its build directory
# (build/cargo); here the build is Debug and points RDIST_CARGO_TARGET_DIR
# at the target directory the rest of the suite built ($CARGO_TARGET_DIR,
# else target/), so cargo finds target/debug up to date instead of
# compiling everything a second time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CARGO_TERM_COLOR=never
cargo_target="${CARGO_TARGET_DIR:-$PWD/target}"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Debug -DRDIST_CARGO_TARGET_DIR="$cargo_target" >/dev/null
cmake --build build -j2
ctest --test-dir build --output-on-failure --timeout 120
