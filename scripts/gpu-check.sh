#!/usr/bin/env bash
# Every check that needs a real GPU, in one command, with one report:
#
#   rust    tests/gpu_stub.rs real_gpu_*   every collective and dtype on NCCL
#                                          (1 rank); ranks sharing a device,
#                                          staged through the sockets
#   rust    tests/nccl.rs (all)            NCCL found and loaded, its ABI, the
#                                          backend choice; on a GPU NCCL must be
#                                          found (gpu_nccl_is_found_...)
#   python  tests/test_device.py           device arrays through the binding (the
#                                          test doubles, then real_gpu_*: the
#                                          real driver and NCCL)
#   bench   rdist-bench --device --nccl-direct
#                                          allreduce on device buffers through
#                                          rdist and through NCCL called directly,
#                                          one rank per GPU; every element checked
#   bench   host buffers, GPU present      2 ranks, allreduce and exchange of 8 B-4
#                                          KiB of host memory with the GPU visible
#                                          and hidden: the driver's pointer query
#   torch   tests/workers/torch_cuda.py    CUDA tensors through the "rdist" torch
#                                          backend at 1 and 2 ranks: every call
#                                          against a reference, in torch's stream
#                                          order, at 1 rank bitwise equal to
#                                          torch's nccl; all_reduce's cost per call
#                                          against torch's nccl (4 B, 1 MiB, 64 MiB)
#
# Needs only what scripts/setup.sh installs (it runs it: NCCL comes from
# pip into build/nccl) plus a CUDA driver. Prints one line per check,
# `passed: ...`, `failed: ...` or `skipped: <check>: <reason>`, then a
# summary; exits 1 if any check failed, else 0. With no CUDA device every
# check is `skipped:` (nothing is built) and it exits 0; GPU_CHECK_FORCE=1
# runs them anyway (each then skips itself or runs what needs no GPU).
# Logs: ${CARGO_TARGET_DIR:-target}/gpu-check/. GPU_CHECK_BENCH_MAX_BYTES
# (default 256M) bounds the benchmark's sizes. GPU_CHECK_TORCH_PYTHON: the
# Python with torch (default: the first of python3, /usr/bin/python3 that
# has it); the bundle's compiled torch backend (built for the release
# GPU_BUNDLE_TORCH names) serves that torch when it is the same release,
# else the backend is built there (a compiler needed).
#
# A GPU machine with no Rust toolchain (or no network for setup.sh):
# build a bundle where there is one, `bash scripts/gpu-bundle.sh DIR`, copy
# the checkout with DIR to the GPU machine and run
# `GPU_CHECK_PREBUILT=DIR bash scripts/gpu-check.sh` there: setup.sh and
# the build are skipped, NCCL is whatever the loader finds (an installed
# wheel, ldconfig) unless RDIST_TEST_NCCL_DIR names one.
set -uo pipefail
# The bundle's folder as given, relative to where this was started.
if [ -n "${GPU_CHECK_PREBUILT:-}" ]; then
  GPU_CHECK_PREBUILT="$(cd "$GPU_CHECK_PREBUILT" && pwd)" || exit 2
fi
cd "$(dirname "$0")/.."
root="$PWD"
target="${CARGO_TARGET_DIR:-$root/target}"
logs="$target/gpu-check"
mkdir -p "$logs"
rm -f "$logs"/*.log "$logs"/*.xml
export CARGO_TERM_COLOR=never
export RDIST_TEST_NCCL_DIR="${RDIST_TEST_NCCL_DIR:-$root/build/nccl}"
nccl_lib="$RDIST_TEST_NCCL_DIR/nvidia/nccl/lib/libnccl.so.2"

report=()
passed=0 failed=0 skipped=0
pass() { report+=("passed: $1${2:+ ($2)}"); passed=$((passed + 1)); }
fail() { report+=("failed: $1: $2"); failed=$((failed + 1)); }
skip() { report+=("skipped: $1: $2"); skipped=$((skipped + 1)); }

print_report() {
  echo
  echo "== gpu-check report: $gpu_line"
  printf '%s\n' "${report[@]}"
  echo "== gpu-check: $passed passed, $failed failed, $skipped skipped (logs in $logs)"
}

# The Python for the probe and the binding's tests: $PYTHON, else the first
# of python3 and /usr/bin/python3 (setup.sh's numpy and pytest) with both.
python=""
for candidate in ${PYTHON:-python3 /usr/bin/python3}; do
  if "$candidate" -c 'import numpy, pytest' >/dev/null 2>&1; then python="$candidate"; break; fi
done
probe_python="${python:-${PYTHON:-python3}}"

prebuilt="${GPU_CHECK_PREBUILT:-}"
if [ -n "$prebuilt" ]; then
  echo "== prebuilt: $prebuilt (scripts/gpu-bundle.sh); no setup.sh, no build"
  if ! [ -f "$prebuilt/test-binaries" ] || ! [ -f "$prebuilt/build-root" ]; then
    echo "$prebuilt is not a bundle made by scripts/gpu-bundle.sh" >&2
    exit 2
  fi
  # The test binaries hold the build checkout's absolute path (the crate
  # root, the launcher's path): make it lead here.
  build_root="$(cat "$prebuilt/build-root")"
  if [ "$(cd "$build_root" 2>/dev/null && pwd -P)" != "$(pwd -P)" ]; then
    if [ -e "$build_root" ]; then
      echo "the bundle was built in $build_root, which exists here and is another folder" >&2
      exit 2
    fi
    if ! { mkdir -p "$(dirname "$build_root")" && ln -s "$root" "$build_root"; }; then
      echo "cannot make $build_root lead to $root (the bundle's tests look there)" >&2
      exit 2
    fi
  fi
  # Where the bundle was built its test binaries are in target/ already
  # (left alone: they keep their debug info); elsewhere they are copied.
  while read -r _ path; do
    if ! [ -x "$target/${path#target/}" ]; then
      cp -a "$prebuilt/target/." "$target/"
      break
    fi
  done <"$prebuilt/test-binaries"
else
  echo "== scripts/setup.sh"
  if ! bash scripts/setup.sh >"$logs/setup.log" 2>&1; then
    echo "setup.sh failed (see $logs/setup.log); carrying on with what is there"
  fi
  cat "$logs/setup.log"
fi

# ---- is there a GPU? (the CUDA driver, as rdist loads it) ---------------------
gpu_reason="$("$probe_python" - 2>&1 <<'EOF'
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as error:
    sys.exit(f"no CUDA driver ({error})")
rc = cuda.cuInit(0)
if rc != 0:
    sys.exit(f"cuInit failed (CUresult {rc}: no usable device or driver)")
count = ctypes.c_int(0)
rc = cuda.cuDeviceGetCount(ctypes.byref(count))
if rc != 0 or count.value == 0:
    sys.exit(f"no CUDA device (cuDeviceGetCount: CUresult {rc}, {count.value} devices)")
names = []
for i in range(count.value):
    name = ctypes.create_string_buffer(256)
    cuda.cuDeviceGetName(name, 256, i)
    names.append(name.value.decode(errors="replace"))
print(f"DEVICES {count.value} {', '.join(names)}")
EOF
)"
devices=0
if [[ "$gpu_reason" =~ ^DEVICES\ ([0-9]+)\ (.*)$ ]]; then
  devices="${BASH_REMATCH[1]}"
  gpu_line="$devices CUDA device(s): ${BASH_REMATCH[2]}"
else
  gpu_reason="${gpu_reason##*$'\n'}"
  gpu_line="no GPU: ${gpu_reason:-the CUDA probe failed}"
fi
if [ -f "$nccl_lib" ]; then
  gpu_line+="; NCCL: $nccl_lib"
else
  gpu_line+="; NCCL: not installed ($nccl_lib missing)"
fi
echo "== $gpu_line"

checks=(
  "rust gpu_stub::real_gpu_* (collectives on real device buffers)"
  "rust nccl::* (tests/nccl.rs)"
  "python bindings/python/tests/test_device.py"
  "bench rdist-bench --device --nccl-direct"
  "torch CUDA tensors through rdist (tests/workers/torch_cuda.py)"
)
if [ "$devices" -eq 0 ] && [ "${GPU_CHECK_FORCE:-0}" != 1 ]; then
  for c in "${checks[@]}"; do skip "$c" "no GPU: $gpu_reason"; done
  print_report
  exit 0
fi

# ---- build ------------------------------------------------------------------------
# test_binaries: "FILE PATH" per line, the test executables to run.
if [ -n "$prebuilt" ]; then
  test_binaries="$(cat "$prebuilt/test-binaries")"
else
  echo "== bash scripts/gpu-bundle.sh (the build: tests, the library for Python, the release benchmark)"
  if ! bash scripts/gpu-bundle.sh --build-only >"$logs/build.log" 2>&1; then
    tail -30 "$logs/build.log"
    for c in "${checks[@]}"; do fail "$c" "the build failed (see $logs/build.log)"; done
    print_report
    exit 1
  fi
  test_binaries="$(grep '^test-binary ' "$logs/build.log" | cut -d' ' -f2-)"
fi

# ---- Rust tests, one by one: passed, failed, or skipped with the reason it printed -----
# run_rust FILE BINARY NAME: runs one test of tests/FILE.rs (as cargo test
# would: from the crate root).
run_rust() {
  local file="$1" bin="$2" name="$3" log start secs why
  log="$logs/rust-$file-$name.log"
  start=$(date +%s)
  echo "-- cargo test --test $file -- --exact $name"
  timeout 900 "$bin" --exact "$name" --nocapture --test-threads 1 >"$log" 2>&1
  local rc=$?
  secs=$(($(date +%s) - start))
  if [ $rc -ne 0 ]; then
    why=$(grep -m1 -E "panicked at|^thread .* panicked|error:" "$log" || true)
    [ $rc -eq 124 ] && why="timed out after 900 s"
    fail "rust $file::$name" "${why:-exit $rc} (${secs} s; log $log)"
  elif why=$(grep -m1 -o -E "skipped: .*" "$log"); then
    skip "rust $file::$name" "${why#skipped: }"
  else
    pass "rust $file::$name" "${secs} s"
  fi
}

for file in gpu_stub nccl; do
  bin=$(awk -v f="$file" '$1 == f { print $2 }' <<<"$test_binaries")
  case "$bin" in /*) ;; ?*) bin="$root/$bin" ;; esac
  if [ -z "$bin" ] || ! [ -x "$bin" ]; then
    fail "rust $file" "no test binary for tests/$file.rs (${bin:-none built})"
    continue
  fi
  names=$("$bin" --list 2>/dev/null | sed -n 's/: test$//p')
  [ "$file" = gpu_stub ] && names=$(grep '^real_gpu_' <<<"$names")
  names=$(grep -v '^worker_process$' <<<"$names")  # the child processes' body, not a test
  if [ -z "$names" ]; then
    fail "rust $file" "no tests listed (cargo test --test $file -- --list)"
    continue
  fi
  for name in $names; do run_rust "$file" "$bin" "$name"; done
done

# ---- the Python binding's device tests ---------------------------------------------------
check="python bindings/python/tests/test_device.py"
if [ -z "$python" ]; then
  skip "$check" "no Python with numpy and pytest (scripts/setup.sh installs them for /usr/bin/python3; or set PYTHON)"
else
  echo "-- $python -m pytest bindings/python/tests/test_device.py"
  xml="$logs/python-device.xml"
  RDIST_LIBRARY="$target/debug/librdist.so" timeout 900 "$python" -m pytest bindings/python/tests/test_device.py \
    -q -rs -p no:cacheprovider --junitxml="$xml" >"$logs/python-device.log" 2>&1
  rc=$?
  if [ ! -f "$xml" ]; then
    fail "$check" "pytest exited $rc with no results (log $logs/python-device.log)"
  else
    # One line per test case: STATUS<tab>name<tab>detail
    while IFS=$'\t' read -r status name detail; do
      case "$status" in
        passed) pass "python test_device.py::$name" "$detail" ;;
        skipped) skip "python test_device.py::$name" "$detail" ;;
        *) fail "python test_device.py::$name" "$detail (log $logs/python-device.log)" ;;
      esac
    done < <("$python" - "$xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    name, secs = case.get("name"), float(case.get("time") or 0)
    status, detail = "passed", f"{secs:.1f} s"
    for child in case:
        if child.tag == "skipped":
            status, detail = "skipped", child.get("message", "")
        elif child.tag in ("failure", "error"):
            status, detail = "failed", (child.get("message") or child.tag).splitlines()[0][:200]
    print(f"{status}\t{name}\t{detail}".replace("\n", " "))
EOF
)
    if [ $rc -ne 0 ] && ! grep -q '^failed: python' <(printf '%s\n' "${report[@]}"); then
      fail "$check" "pytest exited $rc (log $logs/python-device.log)"
    fi
  fi
fi

# ---- rdist against NCCL called directly, on device buffers -------------------------------
check="bench rdist-bench --device --nccl-direct"
release="$target/release"
[ -n "$prebuilt" ] && release="$prebuilt/target/release"
if [ "$devices" -eq 0 ]; then
  skip "$check" "no GPU: $gpu_reason"
elif ! [ -x "$release/rdist-bench" ] || ! [ -x "$release/rdistrun" ]; then
  skip "$check" "no release build in $release (scripts/gpu-bundle.sh --debug-only makes none)"
elif [ ! -f "$nccl_lib" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2 '; then
  skip "$check" "NCCL not installed ($nccl_lib missing; scripts/setup.sh installs it)"
else
  log="$logs/bench.log"
  [ -f "$nccl_lib" ] && export RDIST_NCCL_LIBRARY="$nccl_lib"
  echo "-- rdistrun --nproc-per-node $devices rdist-bench --device --nccl-direct (one rank per GPU)"
  start=$(date +%s)
  RDIST_TIMEOUT_MS=120000 timeout 600 "$release/rdistrun" --nproc-per-node "$devices" \
    "$release/rdist-bench" --device --nccl-direct --max-bytes "${GPU_CHECK_BENCH_MAX_BYTES:-256M}" \
    --seconds 0.2 --reps 3 >"$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  cat "$log"
  # Table rows (rank 0): size count rdist(us) algbw busbw nccl(us) nccl/rd #wrong
  rows=$(grep -v '#' "$log" | sed 's/^\[rank [0-9]*\] //' | awk 'NF == 8')
  bad=$(awk '$8 != "0" || $6 == "-"' <<<"$rows")
  if [ $rc -ne 0 ]; then
    fail "$check" "exit $rc$([ $rc -eq 124 ] && echo ' (timed out after 600 s)')$([ $rc -eq 3 ] && echo ': wrong elements') (log $log)"
  elif ! grep -q "rdist backend nccl" "$log"; then
    fail "$check" "rdist did not run on NCCL: $(grep -m1 'rdist backend' "$log" || echo 'no header line') (log $log)"
  elif [ -z "$rows" ] || [ -n "$bad" ]; then
    fail "$check" "rows with wrong elements or no direct NCCL time: ${bad:-no rows} (log $log)"
  else
    last=$(tail -1 <<<"$rows")
    read -r size _ rd _ busbw nccl ratio _ <<<"$last"
    pass "$check" "$devices rank(s), $(wc -l <<<"$rows") sizes, all elements right; at $size B: rdist $rd us ($busbw GB/s busbw), NCCL $nccl us, nccl/rdist $ratio; ${secs} s"
  fi
fi

# ---- host buffers with a GPU present: what telling host from device costs ----------------
# With a CUDA device, every buffer's kind is asked of the driver
# (cuPointerGetAttributes); with CUDA_VISIBLE_DEVICES empty rdist never
# asks. Two ranks, small host messages, both ways, side by side.
check="bench host buffers with a GPU present"
if [ "$devices" -eq 0 ]; then
  skip "$check" "no GPU: $gpu_reason"
elif ! [ -x "$release/rdist-bench" ] || ! [ -x "$release/rdistrun" ]; then
  skip "$check" "no release build in $release"
else
  host_bench() {
    timeout 120 "$release/rdistrun" --nproc-per-node 2 "$release/rdist-bench" --op allreduce,exchange \
      --min-bytes 8 --max-bytes 4K --factor 8 --seconds 0.1 --reps 5 2>&1 |
      grep -v '#' | sed 's/^\[rank [0-9]*\] //' | awk 'NF >= 9 {print $1, $6}'
  }
  seen=$(host_bench) && hidden=$(CUDA_VISIBLE_DEVICES= host_bench)
  echo "-- host buffers, 2 ranks (size us): with the GPU visible / hidden"
  paste <(echo "$seen") <(echo "$hidden")
  if [ -z "$seen" ] || [ -z "$hidden" ]; then
    fail "$check" "rdist-bench gave no rows"
  else
    pass "$check" "us with the GPU visible / hidden: $(paste -d/ <(awk '{print $2}' <<<"$seen") <(awk '{print $2}' <<<"$hidden") | head -4 | tr '\n' ' ')"
  fi
fi

# ---- torch: CUDA tensors through the "rdist" backend -------------------------------------
check="torch CUDA tensors through rdist"
torch_python=""
for candidate in ${GPU_CHECK_TORCH_PYTHON:-python3 /usr/bin/python3}; do
  if "$candidate" -c 'import torch' >/dev/null 2>&1; then torch_python="$candidate"; break; fi
done
rdist_lib="$target/release/librdist.so"
[ -n "$prebuilt" ] && rdist_lib="$prebuilt/lib/librdist.so.0"
if [ "$devices" -eq 0 ]; then
  skip "$check" "no GPU: $gpu_reason"
elif [ -z "$torch_python" ]; then
  skip "$check" "no Python with torch (set GPU_CHECK_TORCH_PYTHON)"
elif ! [ -f "$rdist_lib" ]; then
  skip "$check" "no release library ($rdist_lib; scripts/gpu-bundle.sh --debug-only makes none)"
else
  # The compiled backend: the bundle's where it was built for this torch
  # release (its local tag, e.g. +cu130, may differ), else built here.
  export RDIST_CACHE_DIR="$logs/rdist-cache"
  rm -rf "$RDIST_CACHE_DIR"  # an earlier run's builds: only this bundle's count
  mkdir -p "$RDIST_CACHE_DIR"
  if [ -n "$prebuilt" ] && [ -d "$prebuilt/rdist-cache" ]; then
    cp -a "$prebuilt/rdist-cache/." "$RDIST_CACHE_DIR/"
  fi
  PYTHONPATH="$root/bindings/python" "$torch_python" - >"$logs/torch-backend.log" 2>&1 <<'EOF'
import glob, os, shutil, sys, torch
from rdist import _extension as e
want = e.build_dir(torch)
if os.path.isfile(os.path.join(want, "_rdist_c10d.so")):
    print(f"torch {torch.__version__}: the bundle's compiled backend fits as it is")
    sys.exit(0)
release, tag = torch.__version__.split("+")[0], sys.implementation.cache_tag
near = glob.glob(os.path.join(e.cache_root(), "torch-backend", f"torch-{release}*-{tag}-*", "_rdist_c10d.so"))
if near:
    os.makedirs(want, exist_ok=True)
    shutil.copy2(near[0], os.path.join(want, "_rdist_c10d.so"))
    print(f"torch {torch.__version__}: the bundle's build for {os.path.basename(os.path.dirname(near[0]))}")
else:
    print(f"torch {torch.__version__} ({tag}): no build of it in the bundle, built here on first use")
EOF
  torch_line="$(tail -1 "$logs/torch-backend.log")"
  echo "-- $torch_line"
  for size in 1 2; do
    echo "-- $torch_python bindings/python/tests/workers/torch_cuda.py, $size rank(s)"
    port=$("$torch_python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    pids=()
    start=$(date +%s)
    for ((r = 0; r < size; r++)); do
      RANK=$r WORLD_SIZE=$size LOCAL_RANK=$r LOCAL_WORLD_SIZE=$size MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        PYTHONPATH="$root/bindings/python:$root/bindings/python/tests/workers" RDIST_LIBRARY="$rdist_lib" \
        timeout 600 "$torch_python" "$root/bindings/python/tests/workers/torch_cuda.py" \
        >"$logs/torch-cuda-$size-rank$r.log" 2>&1 &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    secs=$(($(date +%s) - start))
    verdict="$("$torch_python" - "$size" "$logs" <<'EOF'
import json, sys
size, logs = int(sys.argv[1]), sys.argv[2]
reports = []
for r in range(size):
    for line in open(f"{logs}/torch-cuda-{size}-rank{r}.log", errors="replace"):
        if line.startswith("RESULT "):
            reports.append(json.loads(line[7:]))
if len(reports) != size:
    print(f"failed|{len(reports)} of {size} ranks reported")
elif any("skipped" in r for r in reports):
    print(f"skipped|{reports[0]['skipped']}")
else:
    bad = [f"rank {r['rank']} {case}: {why.strip().splitlines()[-1]}"
           for r in reports for case, why in r["failures"].items()]
    if bad:
        print("failed|" + "; ".join(bad[:4]))
    else:
        r0 = reports[0]
        times = r0["per_call_us"]
        timing = "; ".join(
            f"{n} B rdist {us} us" + (f", nccl {times['nccl'][n]} us" if "nccl" in times else "")
            for n, us in times.get("rdist", {}).items())
        print(f"passed|{len(r0['cases'])} cases on {r0['device']}, torch {r0['torch']}, "
              f"{'compiled' if r0['compiled'] else 'pure-Python'} backend; all_reduce per call: {timing}")
EOF
)"
    status="${verdict%%|*}"
    detail="${verdict#*|}"
    name="$check, $size rank(s)"
    [ "$status" = passed ] && [ $rc -ne 0 ] && status=failed detail="exit $rc after every rank reported: $detail"
    case "$status" in
      passed) pass "$name" "$detail; ${secs} s" ;;
      skipped) skip "$name" "$detail" ;;
      *) fail "$name" "${detail:-no verdict} (exit $rc; logs $logs/torch-cuda-$size-rank*.log)" ;;
    esac
  done
fi

print_report
[ "$failed" -eq 0 ]
