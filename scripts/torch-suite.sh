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
text = open(log, errors="replace").read()
ran = re.findall(r"^Ran (\d+) tests? in", text, re.M)
summary = re.findall(r"^(?:OK|FAILED) ?\((.*)\)$", text, re.M)
counts = dict(failures=0, errors=0, skipped=0, expected_failures=0)
for part in (summary[-1].split(", ") if summary else []):
    key, _, value = part.partition("=")
    counts[key] = int(value)
failed = sorted(set(re.findall(r"^(?:FAIL|ERROR): (test_\w+)", text, re.M)))
total = int(ran[-1]) if ran else 0
passed = total - counts["failures"] - counts["errors"] - counts["skipped"] - counts["expected_failures"]
print(f"{backend} at {world} ranks: {total} tests, {passed} pass, {counts['skipped']} skipped, "
      f"{counts['failures']} fail, {counts['errors']} error ({took} s; {log})"
      + ("" if ran else " -- the run did not finish"))
with open(log + ".failed", "w") as f:
    f.write("".join(name + "\n" for name in failed))
PY
  done
  if [ -s "$out/rdist-$world.log.failed" ]; then
    echo "failing on rdist at $world ranks (gloo's result from $out/gloo-$world.log when it ran):"
    while read -r name; do
      state="gloo: not run"
      if [ -f "$out/gloo-$world.log.failed" ]; then
        if grep -qx "$name" "$out/gloo-$world.log.failed"; then state="fails on gloo too"; else state="passes or skips on gloo"; fi
      fi
      echo "  $name ($state)"
    done < "$out/rdist-$world.log.failed"
  fi
done
