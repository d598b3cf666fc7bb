#!/usr/bin/env bash
# Wide jobs on this one machine: for each world size (default 64 128 256
# 512), every rank joins, runs a 4 KiB allreduce and broadcast and a
# barrier (checked), and leaves; prints a markdown table of init time
# (slowest rank and mean), descriptors and resident memory per rank, and
# the time of each collective. Ranks far outnumber cores here, so the
# collective times measure the scheduler more than rdist.
#
#   scripts/wide.sh [SIZES...]        e.g. scripts/wide.sh 64 128 256 512 1024
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(64 128 256 512)
cargo build --release --bins -q
mkdir -p build/wide
: >build/wide/runs.txt
# Every rank holds a few descriptors per peer; the store one per rank.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
for n in "${sizes[@]}"; do
  log=build/wide/ranks-$n.log
  start=$SECONDS
  # Init grows with the square of the ranks (every pair connects): give
  # wide jobs the time they need rather than the default 300 s.
  if RDIST_TIMEOUT_MS=$((600 * 1000)) target/release/rdistrun --nproc-per-node "$n" \
      target/release/rdist-bench --op allreduce,broadcast,barrier --min-bytes 4K --max-bytes 4K \
      --seconds 0.01 --reps 1 --resources --json "build/wide/ranks-$n.json" >"$log" 2>&1; then
    status=ok
  else
    status="failed ($(grep -m1 -o 'rdistrun: .*' "$log" | cut -c1-200))"
  fi
  echo "$n $((SECONDS - start)) $status" >>build/wide/runs.txt
  echo "wide: $n ranks: $status" >&2
done
python3 - "${sizes[@]}" <<'PY'
import json, os, re, sys
rows = ["| ranks | init, slowest (s) | init, mean (s) | fds per rank (max) | RSS per rank, MiB (max) | allreduce 4 KiB (ms) | broadcast 4 KiB (ms) | barrier (ms) | whole run (s) |",
        "|---|---|---|---|---|---|---|---|---|"]
runs = {}
for line in open("build/wide/runs.txt"):
    n, secs, status = line.split(" ", 2)
    runs[n] = (float(secs), status.strip())
for n in sys.argv[1:]:
    text = open(f"build/wide/ranks-{n}.log").read()
    m = re.search(r"init ([\d.]+) s \(slowest rank\), ([\d.]+) s mean; .*?after the run (\d+) fds \((\d+) max\), ([\d.]+) MiB RSS \(([\d.]+) max\)", text)
    secs, status = runs.get(n, (0, "?"))
    if not m or status != "ok":
        rows.append(f"| {n} | {status} | | | | | | | {secs:.0f} |")
        continue
    times = {}
    path = f"build/wide/ranks-{n}.json"
    if os.path.exists(path):
        for r in json.load(open(path)):
            times[r["op"]] = r["time_us"] / 1000
    t = lambda op: f"{times[op]:.1f}" if op in times else "n/a"
    rows.append(f"| {n} | {m[1]} | {m[2]} | {m[3]} ({m[4]}) | {m[5]} ({m[6]}) | {t('allreduce')} | {t('broadcast')} | {t('barrier')} | {secs:.0f} |")
print("\n".join(rows))
PY
