"""all_reduce per-call time through torch.distributed: backend "rdist"
against "gloo" in the same run, on one machine (loopback), beside rdist
without torch: the Python binding (rdist.Comm on torch tensors) and the C
API called from C (bench/peers/native_bench.c, compiled here).

    python bindings/python/bench/torch_allreduce.py [--ranks 2] [--sizes 4,1M,64M]
        [--backends rdist,gloo,rdist-python,fake]
        [--seconds 0.3] [--reps 5] [--c-api] [--json FILE]

Backends: "rdist" (the compiled backend), "rdist-python" (its pure-Python
fallback), "gloo", and "fake" (torch's FakeProcessGroup, which moves
nothing: what torch's own dispatch of a call costs; world size 1 only).
Spawns the ranks itself (ports from the OS). For each way and size
(float32 sum) it warms up, then times batches of about --seconds each (a
barrier before each); a batch's time is the maximum over ranks, the
figure the median of --reps batches. Prints a table and the ratio
rdist/gloo (below 1: rdist is faster). Set RDIST_LIBRARY to time a
release build (cargo build --release: target/release/librdist.so).
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

SIZES = [4, 1 << 20, 64 << 20]


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


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
    for spec in args.backends:
        # "rdist-python": the backend's pure-Python fallback; "fake": torch's
        # FakeProcessGroup, which communicates nothing (torch's own dispatch
        # cost, world size 1 only).
        backend = "rdist" if spec == "rdist-python" else spec
        os.environ["RDIST_TORCH_BACKEND"] = "python" if spec == "rdist-python" else "auto"
        if spec == "fake":
            if size != 1:
                continue
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=size)
        port += 1

        def maxover(x):
            t = torch.tensor([float(x)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return type(x)(t.item())

        for nbytes in args.sizes:
            t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            out[(spec, nbytes)] = timed(lambda: dist.all_reduce(t), dist.barrier,
                                           args.seconds, args.reps, maxover)
        dist.destroy_process_group()
    if "rdist" in args.backends:
        import numpy as np

        comm = rdist.init(f"tcp://127.0.0.1:{port}", rank, size)

        def maxover(x):
            a = np.array([x], np.float64)
            comm.allreduce(a, op="max")
            return type(x)(a[0])

        for nbytes in args.sizes:
            t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            out[("rdist.Comm", nbytes)] = timed(lambda: comm.allreduce(t), comm.barrier,
                                                args.seconds, args.reps, maxover)
        comm.destroy()
    queue.put((rank, {f"{k[0]}|{k[1]}": v for k, v in out.items()}))


def c_api(args):
    """Runs bench/peers/native_bench.c (rdist's C API from C) on the same
    sizes; returns {bytes: seconds}."""
    import subprocess
    import tempfile

    repo = Path(__file__).resolve().parents[3]
    lib = Path(os.environ.get("RDIST_LIBRARY") or repo / "target/release/librdist.so")
    with tempfile.TemporaryDirectory() as scratch:
        binary, out = Path(scratch, "native_bench"), Path(scratch, "out.jsonl")
        subprocess.run(["cc", "-O2", "-DUSE_RDIST", f"-I{repo / 'include'}",
                        str(repo / "bench/peers/native_bench.c"), f"-L{lib.parent}", "-lrdist",
                        f"-Wl,-rpath,{lib.parent}", "-lm", "-o", str(binary)], check=True)
        port = str(free_port())
        env = dict(os.environ, SIZE=str(args.ranks), PORT=port, OUT=str(out), BC_SIZES="",
                   AR_SIZES=",".join(str(n) for n in args.sizes), BATCH=str(args.seconds),
                   REPS=str(args.reps), OMP_NUM_THREADS="1")
        ranks = [subprocess.Popen([str(binary)], env=dict(env, RANK=str(r)))
                 for r in range(args.ranks)]
        if any(p.wait(timeout=600) for p in ranks):
            raise SystemExit("native_bench failed")
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {r["bytes"]: r["t_med_s"] for r in records if r["op"] == "allreduce"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backends", default="rdist,gloo")
    parser.add_argument("--sizes", default="4,1M,64M")
    parser.add_argument("--c-api", action="store_true",
                        help="also time the C API from C (needs cc)")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.backends = args.backends.split(",")
    args.sizes = [parse_size(x) for x in args.sizes.split(",")]
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
    columns = [(f"dist.all_reduce {b}", b) for b in args.backends
               if f"{b}|{args.sizes[0]}" in res]
    if "rdist" in args.backends:
        columns.append(("rdist.Comm (Python)", "rdist.Comm"))
    if args.c_api:
        for nbytes, t in c_api(args).items():
            res[f"C API|{nbytes}"] = t
        columns.append(("C API (C)", "C API"))
    print(f"all_reduce (float32 sum), {args.ranks} rank(s), median batch time per call, us")
    print(f"{'bytes':>10} " + " ".join(f"{title:>22}" for title, _ in columns)
          + ("   rdist/gloo" if set(args.backends) >= {"rdist", "gloo"} else ""))
    for nbytes in args.sizes:
        row = f"{nbytes:>10} "
        for _, key in columns:
            row += f"{res[f'{key}|{nbytes}'] * 1e6:>22.1f} "
        if set(args.backends) >= {"rdist", "gloo"}:
            row += f" {res[f'rdist|{nbytes}'] / res[f'gloo|{nbytes}']:>11.2f}"
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
