"""all_reduce latency and bandwidth through torch.distributed: backend
"rdist" against "gloo" in the same run, on one machine (loopback).

    python bindings/python/bench/torch_allreduce.py [--ranks 2] [--seconds 0.3]

Spawns the ranks itself (ports from the OS). For each backend and size
(4 B, 64 KiB, 1 MiB, 16 MiB float32) it warms up, then times batches of
about --seconds each (a barrier before each); a batch's time is the
maximum over ranks, the figure the median of --reps batches. Prints a
table and the ratio rdist/gloo (below 1: rdist is faster); --json writes
the numbers. Also times the rdist binding without torch (rdist.Comm on
numpy and on torch tensors) for the per-call overhead.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

SIZES = [4, 64 << 10, 1 << 20, 16 << 20]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, barrier, seconds, reps, maxover):
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    iters = maxover(max(1, min(100000, int(seconds / one))))
    for _ in range(min(iters, 20)):
        fn()
    results = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        results.append(maxover((time.perf_counter() - t0) / iters))
    return statistics.median(results)


def worker(rank, size, port, args, queue):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import rdist
    import rdist.torch  # noqa: F401

    torch.set_num_threads(1)
    out = {}
    for backend in args.backends:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
        port += 1

        def maxover(x):
            t = torch.tensor([float(x)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return type(x)(t.item())

        for nbytes in SIZES:
            t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            out[(backend, nbytes)] = timed(lambda: dist.all_reduce(t), dist.barrier,
                                           args.seconds, args.reps, maxover)
        dist.destroy_process_group()
    if "rdist" in args.backends:
        import numpy as np

        comm = rdist.init(f"tcp://127.0.0.1:{port}", rank, size)

        def maxover(x):
            a = np.array([x], np.float64)
            comm.allreduce(a, op="max")
            return type(x)(a[0])

        a = np.ones(1, np.float32)
        out[("rdist.Comm numpy", 4)] = timed(lambda: comm.allreduce(a), comm.barrier, args.seconds, args.reps, maxover)
        t = torch.ones(1)
        out[("rdist.Comm torch", 4)] = timed(lambda: comm.allreduce(t), comm.barrier, args.seconds, args.reps, maxover)
        comm.destroy()
    queue.put((rank, {f"{k[0]}|{k[1]}": v for k, v in out.items()}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backends", default="rdist,gloo")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.backends = args.backends.split(",")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    res = results[0]
    print(f"all_reduce (float32 sum), {args.ranks} ranks, torch.distributed, median batch time")
    print(f"{'bytes':>10} " + " ".join(f"{b + ' us':>12} {b + ' GB/s':>11}" for b in args.backends)
          + ("  rdist/gloo" if set(args.backends) >= {"rdist", "gloo"} else ""))
    for nbytes in SIZES:
        row = f"{nbytes:>10} "
        for b in args.backends:
            t = res[f"{b}|{nbytes}"]
            row += f"{t * 1e6:>12.1f} {nbytes / t / 1e9:>11.3f} "
        if set(args.backends) >= {"rdist", "gloo"}:
            row += f" {res[f'rdist|{nbytes}'] / res[f'gloo|{nbytes}']:>10.2f}"
        print(row)
    for k in ("rdist.Comm numpy|4", "rdist.Comm torch|4"):
        if k in res:
            print(f"{k.split('|')[0]}: 4 B allreduce {res[k] * 1e6:.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
