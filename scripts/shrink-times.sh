#!/usr/bin/env bash
# Times recovery from a lost rank: examples/c/train_through_failure.c on
# N ranks of this machine (loopback, the socket transport), through
# rdistrun --on-failure continue, with rank 0 (the rendezvous store's host)
# killed, then rank N/2. Prints, per run, the slowest survivor's
# rdist_comm_shrink and its time from the last good step to the first step
# on the shrunk communicator (detection, shrink, agreeing on the step, and
# the step), and checks that every survivor's weights equal the reference.
#   bash scripts/shrink-times.sh [N ...]      (default: 4 8 16)
set -euo pipefail
cd "$(dirname "$0")/.."
worlds=("$@")
[ ${#worlds[@]} -gt 0 ] || worlds=(4 8 16)
cargo build -q --release
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cc -std=c11 -O2 -Iinclude examples/c/train_through_failure.c -o "$out/train" \
  -Ltarget/release -lrdist -lm -Wl,-rpath,"$PWD/target/release"
echo "host: $(nproc) cores, $(uname -r)"
printf "%6s %7s %10s %18s %s\n" ranks killed "shrink ms" "kill->step ms" verdict
for n in "${worlds[@]}"; do
  for victim in 0 $((n / 2)); do
    log="$out/run-$n-$victim.log"
    RDIST_TIMEOUT_MS=60000 timeout 120 target/release/rdistrun --on-failure continue \
      --nproc-per-node "$n" "$out/train" "$victim" >"$log" 2>&1 || true
    shrink=$(grep -o 'shrink [0-9.]* ms' "$log" | awk '{ if ($2 > m) m = $2 } END { print m + 0 }')
    step=$(grep -o 'communicator [0-9.]* ms' "$log" | awk '{ if ($2 > m) m = $2 } END { print m + 0 }')
    verdict=$(grep -q "all $((n - 1)) survivors' weights equal the reference" "$log" && echo ok || echo FAILED)
    printf "%6s %7s %10s %18s %s\n" "$n" "$victim" "$shrink" "$step" "$verdict"
    if [ "$verdict" != ok ]; then
      tail -20 "$log" >&2
      exit 1
    fi
  done
done
