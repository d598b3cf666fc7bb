#!/usr/bin/env bash
# Runs rdist and the peer libraries side by side, in one run on this
# machine, with the comparison harness in bench/peers (peer_bench.py, same
# timing method for everyone), then writes the ratio table and a chart:
#   build/compare/results-<date>.{json,md}   every peer's raw numbers
#   docs/performance.md, docs/busbw.png      ratios rdist / best peer
# Peers: Gloo (Debian's libgloo, native; and through torch when the peers'
# setup installed it), Open MPI (shared memory and TCP), MPICH from PyPI
# (shared memory and TCP) when it installs; 2, 3 and 4 ranks. Takes
# ~15 min (~20 with torch, which it uses when the tests' venv is there),
# then the large cells again with data just made (peer_bench.py --fresh,
# two launches each, far apart in time, the better kept: a VM's speed can
# change for minutes at a time; ~20 min more), as a second table.
#   QUICK=1 scripts/compare.sh   smoke run (~2 min)
#   scripts/compare.sh --cluster [--hosts 3] [--per-host 2] [--rate 1gbit] [--cc cubic]
#       across hosts instead: a namespace cluster (scripts/cluster.sh, root)
#       with shaped links (--cc: the hosts' TCP congestion control; by
#       default this machine's, which every table names); rdist, Gloo, Open MPI and MPICH native workers
#       and torch's gloo under torchrun per host (scripts/cluster_compare.py);
#       writes build/compare/cluster-<date>.* (~6 min for 3 hosts)
#   scripts/compare.sh --cluster --hosts 2 --per-host 1 --rate 10gbit --sizes '' \
#       --p2p-sizes 8,4096,65536,1048576,16777216 --peers rdist,openmpi-c,mpich-c
#       point-to-point between two hosts (ping-pong and ring exchange)
set -euo pipefail
cluster_args=()
if [ "${1:-}" = "--cluster" ]; then
  shift
  cluster_args=("$@")
  [ ${#cluster_args[@]} -gt 0 ] || cluster_args=(--hosts 3 --per-host 2 --rate 1gbit)
fi
cd "$(dirname "$0")/.."
root=$(pwd)
peers_src=$root/bench/peers
export PEERS_HOME=$root/build/peers
mkdir -p "$PEERS_HOME/build" build/compare docs
bash scripts/setup.sh
export DEBIAN_FRONTEND=noninteractive
need=()
command -v mpicc >/dev/null || need+=(openmpi-bin libopenmpi-dev)
[ -e /usr/include/gloo/allreduce.h ] || need+=(libgloo-dev)
/usr/bin/python3 -c "import matplotlib" 2>/dev/null || need+=(python3-matplotlib)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

peers=rdist,rdist-tcp,gloo-native,openmpi-c,openmpi-tcp-c
# MPICH comes from PyPI (as in bench/peers/setup.sh), in its own venv.
if [ ! -x "$PEERS_HOME/.venv-mpich/bin/mpicc" ]; then
  /usr/bin/python3 -m venv "$PEERS_HOME/.venv-mpich" 2>/dev/null || python3 -m venv "$PEERS_HOME/.venv-mpich" || true
  "$PEERS_HOME/.venv-mpich/bin/pip" install -q mpich==5.0.2 >/dev/null 2>&1 || echo "compare: MPICH did not install; running without it"
fi

cargo build --release -q
cc -O2 -DUSE_RDIST -I include "$peers_src/native_bench.c" -L target/release -lrdist \
  -Wl,-rpath,"$root/target/release" -lm -o "$PEERS_HOME/build/rdist_bench"
mpicc -O2 -DUSE_MPI -o "$PEERS_HOME/build/mpi_bench_openmpi" "$peers_src/native_bench.c" -lm
g++ -O2 -std=c++17 -o "$PEERS_HOME/build/gloo_bench" "$peers_src/gloo_bench.cc" -lgloo -lpthread
cc -O2 -pthread -o "$PEERS_HOME/build/core_trip" "$peers_src/core_trip.c"
if [ -x "$PEERS_HOME/.venv-mpich/bin/mpicc" ]; then
  "$PEERS_HOME/.venv-mpich/bin/mpicc" -O2 -DUSE_MPI -o "$PEERS_HOME/build/mpi_bench_mpich" "$peers_src/native_bench.c" -lm
  peers=$peers,mpich-c,mpich-tcp-c
fi

if [ ${#cluster_args[@]} -gt 0 ]; then
  # torch's gloo runs under torchrun on every host, from the venv the tests
  # use (scripts/torch-env.sh, ~4 GB) when it is there or WITH_TORCH=1 asks for it.
  torch_py=""
  venv=${RDIST_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rdist/torch-venv}
  if [ -n "${WITH_TORCH:-}" ] || [ -x "$venv/bin/python" ]; then
    torch_py=$(bash scripts/torch-env.sh) || { echo "compare: torch did not install; running without torch-gloo"; torch_py=""; }
  fi
  mpich_bin=""
  [ -x "$PEERS_HOME/build/mpi_bench_mpich" ] && mpich_bin=$PEERS_HOME/.venv-mpich/bin
  exec /usr/bin/python3 scripts/cluster_compare.py --bin "$PEERS_HOME/build" \
    --lib "$root/target/release" --outdir build/compare \
    --mpich "$mpich_bin" --torch-python "$torch_py" "${cluster_args[@]}"
fi

# Gloo through torch, the peer torch users have: the tests' torch venv
# (scripts/torch-env.sh, ~4 GB) when it is there or WITH_TORCH=1 asks for
# it, else the peers' own venv (bench/peers/setup.sh) if one was made.
venv=${RDIST_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rdist/torch-venv}
if [ -n "${WITH_TORCH:-}" ] || [ -x "$venv/bin/python" ]; then
  PEERS_PYTHON=$(bash scripts/torch-env.sh) && export PEERS_PYTHON || unset PEERS_PYTHON
fi
torch_py=${PEERS_PYTHON:-$PEERS_HOME/.venv/bin/python}
if [ -x "$torch_py" ] && "$torch_py" -c "import torch" 2>/dev/null; then
  peers=$peers,torch-gloo
else
  echo "compare: torch is not installed (WITH_TORCH=1 scripts/compare.sh installs it); running without torch-gloo"
fi

# 3 ranks: a world that is not a power of two.
mib=$((1 << 20))
args=(--peers "$peers" --worlds 2,3,4 --outdir build/compare --timeout 90 --no-ref
  --ag-sizes 65536,$((16 * mib)) --rs-sizes 65536,$((16 * mib)))
[ -n "${QUICK:-}" ] && args+=(--quick)
RDIST_BENCH_BIN=$PEERS_HOME/build/rdist_bench /usr/bin/python3 "$peers_src/peer_bench.py" "${args[@]}" | tail -5
latest=$(ls -t build/compare/results-*.json | grep -v -- -fresh | head -1)
# The large cells again with data just made: every call writes its input
# first (what a program sends was usually just computed), so a library
# that copies straight out of the sender's memory no longer finds an
# unchanged buffer in its own caches.
fresh_peers=$(echo "$peers" | tr ',' '\n' | grep -v '^gloo-native$' | paste -sd, -)
fresh_args=(--fresh --peers "$fresh_peers" --worlds 2,3,4 --outdir build/compare --timeout 90 --no-ref --repeat 2
  --ar-sizes $mib,$((16 * mib)),$((64 * mib)) --bc-sizes $mib,$((64 * mib))
  --ag-sizes $((16 * mib)) --rs-sizes $((16 * mib))
  --pp-sizes 65536,$mib,$((16 * mib)) --ex-sizes 65536,$mib,$((16 * mib)))
[ -n "${QUICK:-}" ] && fresh_args+=(--quick)
RDIST_BENCH_BIN=$PEERS_HOME/build/rdist_bench /usr/bin/python3 "$peers_src/peer_bench.py" "${fresh_args[@]}" | tail -3
fresh=$(ls -t build/compare/results-*-fresh.json | head -1)
/usr/bin/python3 scripts/compare.py "$latest" docs/performance.md docs/busbw.png --fresh "$fresh"
cat docs/performance.md
