#!/usr/bin/env python3
"""torch.distributed's gloo backend under torchrun, timed like native_bench.c
(same warm-up, batches, max over ranks, median batch), for the cluster
comparison (scripts/cluster_compare.py runs one torchrun per host).

Env as native_bench.c: OUT=file.jsonl AR_SIZES BC_SIZES AG_SIZES RS_SIZES (allgather
output sizes; each rank gives 1/world of it) BATCH REPS; torchrun sets RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT. GLOO_SOCKET_IFNAME picks the NIC.
"""
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()

    def max_across(vals):
        t = torch.tensor(vals, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def measure(op, nbytes, batch, reps):
        n = max(1, nbytes // 4)
        if op == "allgather":
            n = max(1, n // world) * world
            out = torch.zeros(n)
            inp = torch.zeros(n // world)
            fn = lambda: dist.all_gather_into_tensor(out, inp)
        elif op == "reduce_scatter":
            n = max(1, n // world) * world
            whole = torch.zeros(n)
            mine = torch.zeros(n // world)
            fn = lambda: dist.reduce_scatter_tensor(mine, whole)
        elif op == "allreduce":
            buf = torch.zeros(n)
            fn = lambda: dist.all_reduce(buf)
        elif op == "broadcast":
            buf = torch.zeros(n)
            fn = lambda: dist.broadcast(buf, 0)
        else:
            fn = dist.barrier
        pc = time.perf_counter
        fn()
        t0 = pc()
        for _ in range(3):
            fn()
        est = max(max_across([(pc() - t0) / 3])[0], 1e-7)
        extra = min(20000, int(0.1 / est))
        if extra >= 3:
            t0 = pc()
            for _ in range(extra):
                fn()
            est = max(max_across([(pc() - t0) / extra])[0], 1e-7)
        iters = max(1, min(100000, round(batch / est)))
        per = []
        for _ in range(reps):
            dist.barrier()
            a = pc()
            for _ in range(iters):
                fn()
            per.append((pc() - a) / iters)
        per = max_across(per)
        return {"op": op, "bytes": nbytes, "iters_per_batch": iters, "reps": reps,
                "t_med_s": statistics.median(per), "t_min_s": min(per), "t_max_s": max(per)}

    # Correctness first, as native_bench.c.
    v = torch.ones(1024)
    dist.all_reduce(v)
    assert bool((v == world).all()), "allreduce check failed"
    v = torch.full((1024,), 7.0 if rank == 0 else 0.0)
    dist.broadcast(v, 0)
    assert bool((v == 7.0).all()), "broadcast check failed"

    batch = float(os.environ.get("BATCH", "0.2"))
    reps = int(os.environ.get("REPS", "7"))
    sizes = lambda k: [int(x) for x in os.environ.get(k, "").split(",") if x]
    recs = [measure("allreduce", b, batch, reps) for b in sizes("AR_SIZES")]
    recs += [measure("broadcast", b, batch, reps) for b in sizes("BC_SIZES")]
    recs += [measure("allgather", b, batch, reps) for b in sizes("AG_SIZES")]
    recs += [measure("reduce_scatter", b, batch, reps) for b in sizes("RS_SIZES")]
    recs.append(measure("barrier", 0, batch, reps))
    dist.barrier()
    if rank == 0:
        with open(os.environ["OUT"], "w") as f:
            for r in recs:
                r["versions"] = {"torch": torch.__version__}
                f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
