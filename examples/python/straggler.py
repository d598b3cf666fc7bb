"""The bottleneck-node experiment: one rank (the straggler) is slow before
every step, and the others wait for it at every collective. Ten steps of
allreduce, then ten of reduce followed by broadcast; every rank records a
timeline (option trace_file), and rank 0 runs `rdist-trace` on them, which
names the straggler and how long the others waited for it.

Run from the repository root, after `cargo build`:

    PYTHONPATH=bindings/python target/debug/rdistrun --nproc-per-node 4 \\
        python3 examples/python/straggler.py

The same by hand with any program: set RDIST_TRACE_FILE=/tmp/t.{rank}.json,
run, then `rdist-trace -o merged.json /tmp/t.*.json`.
"""

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import rdist
from rdist import _library

STRAGGLER = 2  # the slow rank
DELAY = 0.02  # seconds it spends before each step
STEPS = 10


def trace_tool():
    """rdist-trace: $RDIST_TRACE_TOOL, on PATH, beside the library, or in
    the checkout's other build."""
    found = os.environ.get("RDIST_TRACE_TOOL") or shutil.which("rdist-trace")
    if found:
        return found
    beside = Path(_library.library_path).with_name("rdist-trace")
    others = [beside.parent.with_name(b) / "rdist-trace" for b in ("debug", "release")]
    return str(next((p for p in [beside, *others] if p.exists()), beside))


def main():
    # One directory for the job's traces (MASTER_PORT is the job's).
    directory = Path(tempfile.gettempdir(), f"rdist-straggler-{os.environ['MASTER_PORT']}")
    directory.mkdir(exist_ok=True)
    with rdist.init(trace_file=str(directory / "trace.{rank}.json")) as comm:
        rank, size = comm.rank, comm.size
        grads = np.ones(1 << 16, np.float32)
        for _ in range(STEPS):
            if rank == STRAGGLER:
                time.sleep(DELAY)  # a slow data loader, a busy host ...
            comm.allreduce(grads, op="avg")
        for _ in range(STEPS):
            if rank == STRAGGLER:
                time.sleep(DELAY)
            comm.reduce(grads, root=0)
            comm.broadcast(grads, root=0)
        comm.barrier()
    # Destroyed: each rank has written its trace.
    if rank != 0:
        return
    files = [directory / f"trace.{r}.json" for r in range(size)]
    deadline = time.monotonic() + 10
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.05)
    merged = directory / "merged.json"
    done = subprocess.run([trace_tool(), "-o", str(merged), *map(str, files)],
                          capture_output=True, text=True, check=True)
    print(done.stdout, end="")
    assert f"straggler: rank {STRAGGLER}" in done.stdout, done.stdout
    shutil.rmtree(directory)


if __name__ == "__main__":
    main()
