#!/usr/bin/env bash
# Wide jobs on this one machine: for each world size (default 64 128 256
# 512), every rank joins, runs a 4 KiB allreduce and broadcast and a
# barrier (checked), and leaves; prints a markdown table of init time
# (slowest rank and mean; then the launch, from the first rank's call to
# init to the last's, and what init took after that last call),
# descriptors and resident memory per rank, and the time of each
# collective. With REPS=k each size runs k times and every column is the
# median of the k runs. Ranks far outnumber cores here, so the collective
# times measure the scheduler more than rdist.
#
#   scripts/wide.sh [SIZES...]        e.g. REPS=3 scripts/wide.sh 64 128 256 512 1024
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(64 128 256 512)
reps=${REPS:-1}
cargo build --release --bins -q
mkdir -p build/wide
rm -f build/wide/ranks-*
: >build/wide/runs.txt
# Every rank holds a few descriptors per peer; the store one per rank.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
for n in "${sizes[@]}"; do
  for k in $(seq "$reps"); do
    log=build/wide/ranks-$n-$k.log
    start=$SECONDS
    # Wide jobs on 2 cores take seconds to start: time enough for any.
    if RDIST_TIMEOUT_MS=$((600 * 1000)) target/release/rdistrun --nproc-per-node "$n" \
        target/release/rdist-bench --op allreduce,broadcast,barrier --min-bytes 4K --max-bytes 4K \
        --seconds 0.01 --reps 1 --resources --json "build/wide/ranks-$n-$k.json" >"$log" 2>&1; then
      status=ok
    else
      status="failed ($(grep -m1 -o 'rdistrun: .*' "$log" | cut -c1-200))"
    fi
    echo "$n $k $((SECONDS - start)) $status" >>build/wide/runs.txt
    echo "wide: $n ranks, run $k: $status" >&2
  done
done
python3 - "$reps" "${sizes[@]}" <<'PY'
import json, os, re, statistics, sys
reps, sizes = int(sys.argv[1]), sys.argv[2:]
rows = ["| ranks | init, slowest (s) | init, mean (s) | calls to init spread over (s) | init after the last call (s) | fds per rank (max) | RSS per rank, MiB (max) | allreduce 4 KiB (ms) | broadcast 4 KiB (ms) | barrier (ms) | whole run (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
runs = {}
for line in open("build/wide/runs.txt"):
    n, k, secs, status = line.split(" ", 3)
    runs[(n, k)] = (float(secs), status.strip())
pattern = re.compile(r"init ([\d.]+) s \(slowest rank\), ([\d.]+) s mean; calls to init over ([\d.]+) s, the last returned ([\d.]+) s after the last call; .*?after the run (\d+) fds \((\d+) max\), ([\d.]+) MiB RSS \(([\d.]+) max\)")
for n in sizes:
    got, failed = [], []
    for k in map(str, range(1, reps + 1)):
        secs, status = runs.get((n, k), (0, "?"))
        m = pattern.search(open(f"build/wide/ranks-{n}-{k}.log").read())
        if not m or status != "ok":
            failed.append(status)
            continue
        times = {}
        path = f"build/wide/ranks-{n}-{k}.json"
        if os.path.exists(path):
            for r in json.load(open(path)):
                times[r["op"]] = r["time_us"] / 1000
        got.append([float(x) for x in m.groups()] + [times.get(op, float("nan")) for op in ("allreduce", "broadcast", "barrier")] + [secs])
    if failed:
        rows.append(f"| {n} | {len(failed)} of {reps} failed: {failed[0]} | | | | | | | | | |")
        continue
    med = [statistics.median(col) for col in zip(*got)]
    rows.append(f"| {n} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {med[3]:.2f} | {med[4]:.0f} ({med[5]:.0f}) | {med[6]:.1f} ({med[7]:.1f}) | {med[8]:.1f} | {med[9]:.1f} | {med[10]:.1f} | {med[11]:.0f} |")
print("\n".join(rows))
if reps > 1:
    print(f"\n(median of {reps} runs each)")
PY
