#!/usr/bin/env bash
# rdist against torch's gloo on this machine's CPUs, side by side in one
# run (bench/peers/peer_bench.py: the same timing for both, median of
# batches, slowest rank): shared memory and TCP forced, 2, 3, 4, 8 and 16
# ranks (those the cores allow): allreduce, allgather and reduce_scatter
# up to 256 MiB, broadcast, barrier, ping-pong and ring exchange. Needs no Rust and no network,
# only a Python with torch, so that it runs on the GPU machine's host
# from a bundle built here:
#
#   scripts/gpu-bundle.sh DIR                     here (builds DIR/bench, DIR/lib)
#   HOST_COMPARE_BUNDLE=DIR scripts/host-compare.sh   there, after gpu-check.sh
#
# Without HOST_COMPARE_BUNDLE it builds the bundle first (cargo needed).
# HOST_COMPARE_PYTHON: the Python with torch (default python3; here the
# tests' venv, scripts/torch-env.sh, serves). HOST_COMPARE_WORLDS overrides
# the worlds; QUICK=1 makes a smoke run. Takes under 5 minutes on 16 cores,
# then the large cells again with data just made (a second table;
# HOST_COMPARE_FRESH=0 skips it).
# Writes build/host-compare/: tuning.txt (the tuning model's inputs and
# choices), core-trips.txt (a cache line's trip between CPU pairs),
# memory-model.txt (64 MiB allreduce against the model),
# results-<date>.{json,md} (every number) and
# performance.md (each cell's ratio to torch gloo, as scripts/compare.sh
# writes docs/performance.md), busbw.png when matplotlib is there.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/build/host-compare
py=${HOST_COMPARE_PYTHON:-python3}
if ! "$py" -c "import torch.distributed" 2>/dev/null; then
  echo "skipped: host-compare: $py has no torch (set HOST_COMPARE_PYTHON)"
  exit 0
fi
bundle=${HOST_COMPARE_BUNDLE:-}
if [ -z "$bundle" ]; then
  bundle=$root/build/host-bundle
  bash scripts/gpu-bundle.sh "$bundle" >/dev/null
fi
bundle=$(cd "$bundle" && pwd)
worker=$bundle/bench/rdist_bench
[ -x "$worker" ] || { echo "host-compare: $worker is missing (scripts/gpu-bundle.sh DIR builds it)" >&2; exit 2; }

cores=$(nproc)
worlds=${HOST_COMPARE_WORLDS:-}
if [ -z "$worlds" ]; then
  for w in 2 3 4 8 16; do
    [ "$w" -le "$cores" ] && worlds=${worlds:+$worlds,}$w
  done
fi
mib=$((1 << 20))
ar=8,65536,$mib,$((16 * mib)),$((256 * mib))
bc=8,$mib,$((16 * mib))
ag=1024,$mib,$((16 * mib)),$((256 * mib))
p2p=8,65536,$mib,$((16 * mib))
batch=0.05 reps=3
if [ -n "${QUICK:-}" ]; then
  ar=8,65536,$mib bc=8,$mib ag=1024,$mib p2p=8,65536 reps=2
fi
mkdir -p "$out"
echo "== host-compare: $cores cores, worlds $worlds, rdist from $bundle, torch from $py"
# The tuning model's inputs (this machine's measured profile, cached) and
# its choices at each world size, as RDIST_DEBUG=INFO prints them: rank
# 0's line of one tiny run per world, into tuning.txt.
: > "$out/tuning.txt"
for w in ${worlds//,/ }; do
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  pids=()
  for ((r = 0; r < w; r++)); do
    RANK=$r SIZE=$w PORT=$port OUT=/dev/null AR_SIZES=8 BATCH=0.01 REPS=1 RDIST_DEBUG=INFO \
      timeout 60 "$worker" > "$out/tuning-$r.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}" || true
  { echo "$w ranks:"; grep -h -m1 -o "tuning: .*" "$out/tuning-0.log" || echo "(no tuning line)"; } >> "$out/tuning.txt"
  rm -f "$out"/tuning-*.log
done
cat "$out/tuning.txt"
# The cache-line trip from the first allowed CPU to each other one, into
# core-trips.txt: on a host whose cores are not all equally near (other
# sockets, other core complexes), the shared-memory rings can slow down
# far more between far cores than reading the peer's memory does (on
# this project's EPYC VM, point-to-point up to 15x against about 1x when
# its two vCPUs move apart; a 1 MiB allreduce 4-6x whichever path), so
# the tuner's choice, made from one pair's figures, may be wrong for
# ranks placed far apart.
: > "$out/core-trips.txt"
if [ -x "$bundle/bench/core_trip" ] && command -v taskset >/dev/null; then
  allowed=$("$py" -c 'import os; print(" ".join(map(str, sorted(os.sched_getaffinity(0)))))')
  first=${allowed%% *}
  for c in $allowed; do
    [ "$c" = "$first" ] && continue
    t=$(timeout 20 taskset -c "$first,$c" "$bundle/bench/core_trip" 2>/dev/null | tail -1 || true)
    if [[ $t =~ ^[0-9]+(\.[0-9]+)?$ ]]; then t="$t ns"; else t=failed; fi
    echo "cpu $first - cpu $c: $t" >> "$out/core-trips.txt"
  done
  summary=$(awk '$(NF-1) ~ /^[0-9.]+$/ {print $(NF-1)}' "$out/core-trips.txt" | sort -n |
    awk '{a[NR]=$1} END {if (NR) print "min", a[1], "median", a[int((NR+1)/2)], "max", a[NR], "over", NR, "cpus"}')
  echo "cache-line trip from cpu $first, ns: ${summary:-none measured (one CPU, or core_trip failed)}"
else
  echo "skipped: core trips (no core_trip in the bundle, or no taskset)" | tee "$out/core-trips.txt"
fi
# 64 MiB allreduce on shared memory against the memory-bandwidth model
# (rdist-bench prints the model under its table), per world, into
# memory-model.txt.
: > "$out/memory-model.txt"
launcher=$bundle/target/release/rdistrun bench_bin=$bundle/target/release/rdist-bench
if [ -x "$launcher" ] && [ -x "$bench_bin" ]; then
  for w in ${worlds//,/ }; do
    timeout 120 "$launcher" --nproc-per-node "$w" --no-prefix --no-tty "$bench_bin" --op allreduce \
      --min-bytes 64M --max-bytes 64M --reps 3 --seconds 0.2 --no-check 2>&1 \
      | grep -m1 "memory model" >> "$out/memory-model.txt" || echo "$w ranks: (no model line)" >> "$out/memory-model.txt"
  done
  cat "$out/memory-model.txt"
fi
# Each launch is bounded; peer_bench names one that did not finish.
PEERS_PYTHON=$(command -v "$py") RDIST_BENCH_BIN=$worker CORE_TRIP_BIN=$bundle/bench/core_trip PEERS_HOME=$out \
  "$py" bench/peers/peer_bench.py --peers rdist,rdist-tcp,torch-gloo --worlds "$worlds" \
  --ar-sizes "$ar" --bc-sizes "$bc" --ag-sizes "$ag" --rs-sizes "$ag" --pp-sizes "$p2p" --ex-sizes "$p2p" \
  --batch "$batch" --reps "$reps" --repeat 1 --no-ref --timeout 120 --outdir "$out" | tail -3
latest=$(ls -t "$out"/results-*.json | grep -v -- -fresh | head -1)
# The large cells again with data just made (each call writes its input
# first, as scripts/compare.sh's second table), unless HOST_COMPARE_FRESH=0.
fresh_table=()
if [ "${HOST_COMPARE_FRESH:-1}" != 0 ]; then
  big=$((16 * mib)) fresh_p2p=$mib,$((16 * mib))
  [ -n "${QUICK:-}" ] && big=$mib fresh_p2p=$mib
  PEERS_PYTHON=$(command -v "$py") RDIST_BENCH_BIN=$worker CORE_TRIP_BIN=$bundle/bench/core_trip PEERS_HOME=$out \
    "$py" bench/peers/peer_bench.py --fresh --peers rdist,rdist-tcp,torch-gloo --worlds "$worlds" \
    --ar-sizes "$big" --bc-sizes "$big" --ag-sizes "$big" --rs-sizes "$big" \
    --pp-sizes "$fresh_p2p" --ex-sizes "$fresh_p2p" \
    --batch "$batch" --reps "$reps" --repeat 1 --no-ref --timeout 120 --outdir "$out" | tail -2
  fresh_table=(--fresh "$(ls -t "$out"/results-*-fresh.json | head -1)")
fi
# Every peer measured every world, or the run says which did not.
"$py" - "$latest" "$worlds" <<'CHECK'
import json, sys
data = json.load(open(sys.argv[1]))
worlds = [int(w) for w in sys.argv[2].split(",")]
have = {(r["peer"], r["world"]) for r in data["records"]}
missing = [f"{p} at {w} ranks" for w in worlds for p in ("rdist", "rdist-tcp", "torch-gloo") if (p, w) not in have]
if missing:
    sys.exit("host-compare: no results from " + ", ".join(missing))
CHECK
"$py" scripts/compare.py "$latest" "$out/performance.md" "$out/busbw.png" "${fresh_table[@]}" \
  --title "rdist vs. torch gloo on this machine" --producer scripts/host-compare.sh
cat "$out/performance.md"
