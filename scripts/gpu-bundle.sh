#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs: the GPU test binaries
# (tests/gpu_stub.rs, tests/nccl.rs), the debug library and launcher they
# use, and the release launcher and benchmark.
#
#   scripts/gpu-bundle.sh --build-only   build in place; print one line
#                                        `test-binary FILE PATH` per test file
#   scripts/gpu-bundle.sh DIR            build, then copy all of it (debug
#                                        info stripped) into DIR, for a GPU
#                                        machine with no Rust toolchain:
#                                        GPU_CHECK_PREBUILT=DIR scripts/gpu-check.sh
#   --debug-only (first)                 without the release binaries (the
#                                        benchmark check then has none: for
#                                        machines with no GPU, as in CI)
#
# With the release binaries, the bundle also holds what the CPU
# comparison there needs (scripts/host-compare.sh): the harness's native C
# worker (bench/rdist_bench, finding lib/librdist.so.0 beside it); and the
# compiled torch backend (rdist-cache/), built against the torch release
# GPU_BUNDLE_TORCH names (default 2.11.0, the GPU machine's; `none`: not
# built) for CPython 3.12 where this machine has one (the image's;
# GPU_BUNDLE_TORCH_PYTHON: another), in scripts/torch-env.sh's venv of
# it, for gpu-check.sh's torch check (it saves building it there).
#
# The bundle runs on a machine of the same architecture with a glibc at
# least as new as this one's.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
target="${CARGO_TARGET_DIR:-$root/target}"

release=1
if [ "${1:-}" = --debug-only ]; then
  release=0
  shift
fi
if [ $# -ne 1 ]; then
  echo "usage: $0 [--debug-only] --build-only | DIR" >&2
  exit 2
fi

cargo build
# The test executables, from cargo's own account of what it built.
tests_json="$(cargo test --no-run --test gpu_stub --test nccl --message-format=json)"
[ $release = 1 ] && cargo build --release --bins --lib
binaries="$(grep '"kind":\["test"\]' <<<"$tests_json" | grep '"executable":"' \
  | sed -n 's/.*"target":{[^}]*"name":"\([a-z_]*\)".*"executable":"\([^"]*\)".*/\1 \2/p')"
for file in gpu_stub nccl; do
  grep -q "^$file " <<<"$binaries" || { echo "cargo built no test binary for tests/$file.rs" >&2; exit 1; }
done

if [ "$1" = --build-only ]; then
  sed 's/^/test-binary /' <<<"$binaries"
  exit 0
fi

out="$1"
rm -rf "$out"
mkdir -p "$out/target/debug/deps" "$out/target/release"
copy() { cp "$1" "$2" && strip --strip-debug "$2"; }
for f in librdist.so rdistrun rdist-bench; do copy "$target/debug/$f" "$out/target/debug/$f"; done
if [ $release = 1 ]; then
  for f in rdistrun rdist-bench; do copy "$target/release/$f" "$out/target/release/$f"; done
  mkdir -p "$out/lib" "$out/bench"
  copy "$target/release/librdist.so" "$out/lib/librdist.so.0"
  cc -O2 -DUSE_RDIST -I include bench/peers/native_bench.c -L "$target/release" -lrdist \
    -Wl,-rpath,'$ORIGIN/../lib' -lm -o "$out/bench/rdist_bench"
  cc -O2 -pthread bench/peers/core_trip.c -o "$out/bench/core_trip"
  torch_release="${GPU_BUNDLE_TORCH:-2.11.0}"
  # The image's python3 is 3.12 (the module is built per CPython): a 3.12
  # here if there is one (GPU_BUNDLE_TORCH_PYTHON names another).
  base_python="${GPU_BUNDLE_TORCH_PYTHON:-}"
  if [ -z "$base_python" ]; then
    for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3; do
      if "$candidate" -c 'import venv' >/dev/null 2>&1; then base_python="$candidate"; break; fi
    done
  fi
  tag=$("$base_python" -c 'import sys; print(sys.implementation.cache_tag)' 2>/dev/null || echo unknown)
  [ "$tag" = cpython-312 ] || echo "gpu-bundle: no CPython 3.12 here: the torch backend is built for $tag, which the GPU image's python3 (3.12) cannot load; gpu-check.sh builds it there if it can" >&2
  venv="${XDG_CACHE_HOME:-$HOME/.cache}/rdist/torch-$torch_release-$tag-venv"
  if [ "$torch_release" = none ]; then
    echo "gpu-bundle: no compiled torch backend (GPU_BUNDLE_TORCH=none)"
  elif torch_python=$(PYTHON="$base_python" RDIST_TORCH_VENV="$venv" RDIST_TORCH_VERSION="$torch_release" \
    bash scripts/torch-env.sh); then
    RDIST_CACHE_DIR="$out/rdist-cache" PYTHONPATH=bindings/python "$torch_python" -m rdist.torch_build \
      || echo "gpu-bundle: the compiled torch backend did not build for torch $torch_release" >&2
  else
    echo "gpu-bundle: no torch $torch_release for $base_python here (scripts/torch-env.sh failed): no compiled torch backend" >&2
  fi
fi
: >"$out/test-binaries"
while read -r file path; do
  copy "$path" "$out/target/debug/deps/$(basename "$path")"
  echo "$file target/debug/deps/$(basename "$path")" >>"$out/test-binaries"
done <<<"$binaries"
# The crate root compiled into the tests (env!("CARGO_MANIFEST_DIR")).
echo "$root" >"$out/build-root"
du -sh "$out"
