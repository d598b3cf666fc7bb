#!/usr/bin/env bash
# Runs every test of rdist: formatting, lints, the Rust unit and
# integration tests (real ranks on loopback, fault injection, the C program
# through rdistrun, header freshness), then the native (ctest) and Python
# (pytest) suites when present. Sets up what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# NCCL's library, installed by setup.sh for tests/nccl.rs.
export RDIST_TEST_NCCL_DIR="$PWD/build/nccl"
export CARGO_TERM_COLOR=never
start=$(date +%s)

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy -q --all-targets -- -D warnings
echo "== cargo build (librdist.so and the binaries the C tests use)"
cargo build -q
echo "== cargo test"
# --show-output keeps what passing tests print in the log, so that their
# `skipped:` lines (no torch, no GPU, no namespaces) are shown here.
cargo test -- --show-output 2>&1 | tee target/cargo-test.log \
  | grep -E "^(test result|running|     Running)|FAILED|skipped:" || true
if grep -q -E "FAILED|error: test failed|could not compile" target/cargo-test.log || ! grep -q "^test result" target/cargo-test.log; then
  echo "cargo test failed; see target/cargo-test.log" >&2
  tail -50 target/cargo-test.log >&2
  exit 1
fi
passed=$(grep -E '^test result' target/cargo-test.log | sed -E 's/.* ([0-9]+) passed.*/\1/' | awk '{s+=$1} END {print s}')
echo "cargo test: $passed passed in $(( $(date +%s) - start )) s"

total=$passed
for extra in scripts/test-native.sh scripts/test-python.sh; do
  if [ -f "$extra" ]; then
    echo "== $extra"
    log=target/$(basename "$extra" .sh).log
    bash "$extra" 2>&1 | tee "$log"
    # ctest: "100% tests passed, 0 tests failed out of N"; pytest: "N passed in ..."
    n=$(grep -E -o "tests failed out of [0-9]+|^[0-9]+ passed" "$log" | tail -1 | grep -E -o "[0-9]+$|^[0-9]+" | head -1)
    total=$((total + ${n:-0}))
  fi
done
# The GPU checks as a GPU machine with no Rust runs them (a bundle): here,
# with no GPU, the checks that need none run and the rest say `skipped:`.
echo "== scripts/gpu-check.sh on a bundle from scripts/gpu-bundle.sh"
bash scripts/gpu-bundle.sh --debug-only target/gpu-bundle >target/gpu-bundle.log 2>&1 \
  || { tail -30 target/gpu-bundle.log >&2; exit 1; }
GPU_CHECK_PREBUILT=target/gpu-bundle GPU_CHECK_FORCE=1 bash scripts/gpu-check.sh >target/gpu-check.log 2>&1 \
  || { cat target/gpu-check.log >&2; exit 1; }
# (Not added to the total: these tests also ran above, built by cargo.)
sed -n '/== gpu-check report/,$p' target/gpu-check.log
# The CPU comparison as the GPU machine's host runs it (a bundle with the
# release binaries, torch, no Rust): a smoke run, 2 ranks, that fails
# when a peer produced nothing.
echo "== scripts/host-compare.sh on a bundle (smoke run: 2 ranks)"
bash scripts/gpu-bundle.sh target/host-bundle >target/host-bundle.log 2>&1 \
  || { tail -30 target/host-bundle.log >&2; exit 1; }
HOST_COMPARE_BUNDLE=target/host-bundle HOST_COMPARE_PYTHON="$(bash scripts/torch-env.sh)" \
  HOST_COMPARE_WORLDS=2 QUICK=1 bash scripts/host-compare.sh >target/host-compare.log 2>&1 \
  || { cat target/host-compare.log >&2; exit 1; }
grep -E "^(== host-compare|skipped:|cache-line trip)|Cells where" target/host-compare.log
echo "every suite passed in $(( $(date +%s) - start )) s"
echo "all: $total passed, 0 failed"
