#!/usr/bin/env bash
# Builds the CUDA driver and NCCL test doubles into OUTDIR and runs the
# smoke test against them:
#   OUTDIR/libcuda.so.1 (+ libcuda.so -> libcuda.so.1)
#   OUTDIR/libnccl.so.2 (needs libcuda.so.1, found through rpath $ORIGIN)
#   OUTDIR/smoke
# Usage: tests/gpu_stub/build.sh OUTDIR. Idempotent; exits non-zero on failure.
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
CC="${CC:-cc}"
CFLAGS=(-O1 -g -fPIC -Wall -Wextra -Werror -pthread)
# nodelete: a dlclose (cudarc probes libcuda.so with open-then-close)
# must not drop the stubs' state.
LIBFLAGS=(-shared -Wl,--no-undefined -Wl,-z,nodelete)
# DT_RPATH, not DT_RUNPATH: it is searched before LD_LIBRARY_PATH, so the
# stub NCCL and the smoke test find the stub driver beside them even where
# LD_LIBRARY_PATH leads to a real libcuda.so.1 (as on GPU machines).
RPATH=(-Wl,--disable-new-dtags -Wl,-rpath,'$ORIGIN')

# Each output is written under a temporary name and renamed, so a failed
# or concurrent build never leaves a half-written library behind.
"$CC" "${CFLAGS[@]}" "${LIBFLAGS[@]}" -Wl,-soname,libcuda.so.1 \
    -o "$OUT/libcuda.so.1.tmp" "$SRC/cuda_stub.c"
mv -f "$OUT/libcuda.so.1.tmp" "$OUT/libcuda.so.1"
ln -sfn libcuda.so.1 "$OUT/libcuda.so"

"$CC" "${CFLAGS[@]}" "${LIBFLAGS[@]}" -Wl,-soname,libnccl.so.2 \
    -o "$OUT/libnccl.so.2.tmp" "$SRC/nccl_stub.c" \
    -L"$OUT" -lcuda "${RPATH[@]}"
mv -f "$OUT/libnccl.so.2.tmp" "$OUT/libnccl.so.2"

"$CC" "${CFLAGS[@]}" -o "$OUT/smoke.tmp" "$SRC/smoke.c" \
    -L"$OUT" -lcuda "$OUT/libnccl.so.2" -ldl "${RPATH[@]}"
mv -f "$OUT/smoke.tmp" "$OUT/smoke"

# Every entry point rdist (or cudarc) may resolve must be exported.
CUDA_SYMBOLS="cuInit cuDriverGetVersion cuDeviceGetCount cuDeviceGet cuDeviceGetName
  cuDeviceTotalMem_v2 cuDeviceGetAttribute cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease_v2
  cuCtxSetCurrent cuCtxGetCurrent cuCtxPushCurrent_v2 cuCtxPopCurrent_v2 cuCtxGetDevice
  cuCtxSynchronize cuMemAlloc_v2 cuMemFree_v2 cuMemsetD8_v2 cuMemsetD8Async cuMemcpy
  cuMemcpyDtoH_v2 cuMemcpyHtoD_v2 cuMemcpyDtoD_v2 cuMemcpyDtoHAsync_v2 cuMemcpyHtoDAsync_v2
  cuMemcpyDtoDAsync_v2 cuPointerGetAttribute cuPointerGetAttributes cuStreamCreate
  cuStreamDestroy_v2 cuStreamSynchronize cuStreamQuery cuStreamWaitEvent cuEventCreate
  cuEventDestroy_v2 cuEventRecord cuEventQuery cuEventSynchronize cuGetErrorString cuGetErrorName
  rdist_stub_stall_stream rdist_stub_shadow rdist_stub_current_device rdist_stub_stream_check
  rdist_stub_stream_is_stalled"
NCCL_SYMBOLS="ncclGetVersion ncclGetUniqueId ncclGetErrorString ncclGetLastError ncclCommInitRank
  ncclCommInitRankConfig ncclCommGetAsyncError ncclCommCount ncclCommUserRank ncclCommCuDevice
  ncclCommFinalize ncclCommDestroy ncclCommAbort ncclCommSplit ncclAllReduce ncclBroadcast
  ncclReduce ncclAllGather ncclReduceScatter ncclSend ncclRecv ncclGroupStart ncclGroupEnd"
check_exports() { # LIBRARY SYMBOLS...
    local lib="$1" defined missing=""
    shift
    defined="$(nm -D --defined-only "$lib" | awk '$2 == "T" { print $3 }')"
    for sym in "$@"; do
        grep -qx "$sym" <<<"$defined" || missing="$missing $sym"
    done
    if [ -n "$missing" ]; then
        echo "build.sh: $lib does not export:$missing" >&2
        exit 1
    fi
}
# shellcheck disable=SC2086 # the lists are meant to split
check_exports "$OUT/libcuda.so.1" $CUDA_SYMBOLS
# shellcheck disable=SC2086
check_exports "$OUT/libnccl.so.2" $NCCL_SYMBOLS

# The smoke test sets its own RDIST_STUB_* variables.
env -u RDIST_STUB_DEVICES -u RDIST_STUB_NCCL_HANG -u RDIST_STUB_NCCL_ASYNC_ERROR \
    -u RDIST_STUB_LOG "$OUT/smoke"
