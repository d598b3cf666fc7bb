"""What one torch.distributed call costs at world size 1, layer by layer:
the backend object's own allreduce (C++ through pybind), and
dist.all_reduce with torch's flight recorder on (its default) and off.
Backends: rdist (compiled), gloo, and torch's FakeProcessGroup ("fake",
which moves nothing and is never recorded: torch's own dispatch cost). Each
in a process of its own; best of 9 batches of 5000 calls, 4-byte float32 sum.

The recorder captures a Python stack per call for every backend it records,
gloo's included (gloo records itself; torch hooks backends it does not ship),
so the like-for-like overhead of a backend is its call with the recorder on
against fake's plus the recording's cost as gloo pays it; the last lines say
both.

    python bindings/python/bench/torch_call_cost.py [--backends fake,rdist,gloo]
"""

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
import rdist.torch  # noqa: F401
which, port = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
if which == "fake":
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
else:
    dist.init_process_group(which, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.ones(1)
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
opts = dist.AllreduceOptions()
opts.asyncOp = False
def best(fn, n=5000):
    runs = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return min(runs)
print(f"{best(lambda: backend.allreduce([t], opts)):.2f} {best(lambda: dist.all_reduce(t)):.2f}")
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="fake,rdist,gloo")
    parser.add_argument("--repeat", type=int, default=3,
                        help="processes per backend and setting; the best counts "
                             "(gloo's worker thread makes single runs vary by microseconds)")
    args = parser.parse_args()
    package = str(Path(__file__).resolve().parents[1])
    print(f"{'backend':>8} {'backend.allreduce':>18} {'dist.all_reduce':>16} {'... FR off':>11} {'recording':>10}  (us)")
    rows = {}
    for which in args.backends.split(","):
        row = []
        for fr in ("2000", "0"):
            env = dict(os.environ, TORCH_FR_BUFFER_SIZE=fr)
            runs = []
            for _ in range(args.repeat):
                done = subprocess.run([sys.executable, "-c", CHILD, which, str(free_port()), package],
                                      env=env, capture_output=True, text=True, timeout=600)
                if done.returncode:
                    raise SystemExit(done.stderr[-2000:])
                runs.append([float(x) for x in done.stdout.split()])
            row.append([min(r[0] for r in runs), min(r[1] for r in runs)])
        on, off = row[0][1], row[1][1]
        rows[which] = (on, off)
        print(f"{which:>8} {row[0][0]:>18.2f} {on:>16.2f} {off:>11.2f} {on - off:>10.2f}")
    if {"fake", "rdist", "gloo"} <= rows.keys():
        fake, (on, off), gloo = rows["fake"][1], rows["rdist"], rows["gloo"]
        print(f"rdist over torch's dispatch, recorder off: {off - fake:.2f} us")
        print(f"rdist over torch's dispatch plus gloo's recording, recorder on: "
              f"{on - fake - (gloo[0] - gloo[1]):.2f} us")


if __name__ == "__main__":
    main()
