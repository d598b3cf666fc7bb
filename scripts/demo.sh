#!/usr/bin/env bash
# The main job: builds rdist and runs a 4-rank benchmark on loopback
# through the rdistrun launcher (no GPU needed), printing nccl-tests-style
# tables for allreduce, broadcast and barrier. Extra arguments go to
# rdist-bench (e.g. --op all, --max-bytes 16M).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ranks=${RANKS:-4}
cargo build --release --bins -q
echo "== $ranks ranks on this machine, over loopback (rdistrun --nproc-per-node $ranks)"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--op allreduce,broadcast,barrier --min-bytes 8 --max-bytes 16M --factor 8 --seconds 0.1 --reps 3)
exec target/release/rdistrun --nproc-per-node "$ranks" target/release/rdist-bench "${args[@]}"
