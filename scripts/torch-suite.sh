#!/usr/bin/env bash
# PyTorch's own generic distributed suite (distributed_test, as torch's
# test_distributed_spawn.py drives it) on gloo and on rdist (every gloo
# group swapped for rdist: bindings/python/suite/torch_suite.py), at each
# world size, with the torch venv of scripts/torch-env.sh (or
# $RDIST_TORCH_PYTHON). Prints one line per run with its counts, then the
# tests that pass on gloo and not on rdist; the logs go to
# build/torch-suite/. Long: about 20 minutes per run on 2 cores.
#
#   bash scripts/torch-suite.sh [--worlds "2 3"] [--backends "gloo rdist"] [-k PATTERN]
set -euo pipefail
cd "$(dirname "$0")/.."
worlds="2 3"
backends="gloo rdist"
filter=()
while [ $# -gt 0 ]; do
  case "$1" in
    --worlds) worlds=$2; shift 2 ;;
    --backends) backends=$2; shift 2 ;;
    -k) filter=(-k "$2"); shift 2 ;;
    *) echo "torch-suite: unknown argument $1" >&2; exit 2 ;;
  esac
done
py=${RDIST_TORCH_PYTHON:-$(bash scripts/torch-env.sh)}
"$py" -c "import expecttest" 2>/dev/null || "$py" -m pip install -q expecttest
[ -f target/release/librdist.so ] || cargo build --release -q
export RDIST_LIBRARY=$PWD/target/release/librdist.so PYTHONPATH=$PWD/bindings/python
PYTHONPATH=bindings/python "$py" -m rdist.torch_build
out=build/torch-suite
mkdir -p "$out"
for world in $worlds; do
  for backend in $backends; do
    log=$out/$backend-$world.log
    start=$(date +%s)
    set +e
    BACKEND=gloo WORLD_SIZE=$world RDIST_SUITE_BACKEND=$backend \
      timeout 7200 "$py" bindings/python/suite/torch_suite.py -v "${filter[@]}" >"$log" 2>&1
    set -e
    "$py" - "$log" "$backend" "$world" "$(( $(date +%s) - start ))" <<'PY'
import re, sys
log, backend, world, took = sys.argv[1:]
results = {}
for m in re.finditer(r"^(test_\w+) \([\w.]+\)(?:\n.*?)*? \.\.\. (ok|skipped.*|FAIL|ERROR)$", open(log).read(), re.M):
    results[m.group(1)] = m.group(2).split()[0].rstrip(":'\"")
counts = {k: sum(1 for v in results.values() if v == k) for k in ("ok", "skipped", "FAIL", "ERROR")}
print(f"{backend} at {world} ranks: {len(results)} tests, {counts['ok']} pass, {counts['skipped']} skipped, "
      f"{counts['FAIL']} fail, {counts['ERROR']} error ({took} s; {log})")
with open(log + ".results", "w") as f:
    for name, state in sorted(results.items()):
        f.write(f"{name} {state}\n")
PY
  done
  if [ -f "$out/gloo-$world.log.results" ] && [ -f "$out/rdist-$world.log.results" ]; then
    echo "passing on gloo, not on rdist, at $world ranks:"
    join "$out/gloo-$world.log.results" "$out/rdist-$world.log.results" | awk '$2 == "ok" && $3 != "ok" {print "  " $1 " (" $3 ")"}'
  fi
done
