#!/usr/bin/env bash
# How allreduce time grows with message size and world size (2, 4, 8 ranks
# on this machine), from rdist-bench; writes docs/scaling.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins -q
mkdir -p build/scaling
for n in 2 4 8; do
  target/release/rdistrun --nproc-per-node "$n" target/release/rdist-bench --op allreduce,broadcast,barrier \
    --min-bytes 8 --max-bytes 64M --factor 8 --seconds 0.1 --reps 3 --json "build/scaling/ranks-$n.json" >/dev/null
done
python3 - <<'PY'
import json
runs = {n: json.load(open(f"build/scaling/ranks-{n}.json")) for n in (2, 4, 8)}
import datetime, os
out = [f"# rdist scaling on this machine ({os.cpu_count()} cores; more ranks than cores oversubscribe them)", "",
       "Produced by `scripts/scaling.sh` (rdist-bench, default transport, float32 sum) on "
       + datetime.datetime.now().strftime("%Y-%m-%d %H:%M") + ". Time per op in us, busbw in GB/s.", ""]
for op in ("allreduce", "broadcast", "barrier"):
    out += [f"## {op}", "", "| size | 2 ranks | 4 ranks | 8 ranks |", "|---|---|---|---|"]
    sizes = sorted({r["bytes"] for r in runs[2] if r["op"] == op})
    for s in sizes:
        cells = []
        for n in (2, 4, 8):
            r = next((r for r in runs[n] if r["op"] == op and r["bytes"] == s), None)
            cells.append("n/a" if r is None else f"{r['time_us']:.1f} us ({r['busbw_GBps']:.2f})")
        out.append(f"| {s} B | " + " | ".join(cells) + " |")
    out.append("")
open("docs/scaling.md", "w").write("\n".join(out))
print("\n".join(out))
PY
