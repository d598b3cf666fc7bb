"""A rank of a torch job on CUDA tensors through the "rdist" backend (NCCL
under rdist on one rank per device; staged through rdist's sockets when
ranks share a device). Every call is checked against a reference computed
on the CPU here (small integers: exact whatever the reduction order) and,
at world size 1, against torch's own nccl backend on the same tensors,
bitwise. Inputs are made by kernels still running on the current stream
when the call is issued, and results are read by kernels queued after it,
with no synchronize in between: the calls must keep torch's stream order,
as torch's nccl backend does. Every case runs on the current stream and
again under a side stream (a stream of its own, not the legacy default
one, whose implicit synchronization could hide a missing wait). At world
size 1 the in-place calls (all_reduce, broadcast) leave their buffer as
it is whatever the stream order; the out-of-place ones (all_gather,
reduce_scatter, all_to_all) show it there.

Reports one `RESULT` line:
    {"rank", "size", "device", "compiled", "cases": [ids],
     "failures": {id: why}, "per_call_us": {"rdist"|"nccl": {bytes: us}}}
("per_call_us": `all_reduce` of 4 B, 1 MiB and 64 MiB back to back on one
stream, synchronized once per batch; nccl only at world size 1.)
Without a CUDA device it reports `skipped` and exits 0, unless
RDIST_CUDA_WORKER_ON_CPU=1: then it runs the same cases on CPU tensors
(no streams, no timings, no nccl), which checks the worker's own
references wherever the tests run.
"""

import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import rdist.torch as rtorch
from _worker import exit_without_teardown, report

ON_CPU = os.environ.get("RDIST_CUDA_WORKER_ON_CPU") == "1"
if not ON_CPU and (not torch.cuda.is_available() or torch.cuda.device_count() == 0):
    report(skipped="no CUDA device visible to torch")
    sys.exit(0)

RANK, SIZE = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if ON_CPU:
    DEVICE = torch.device("cpu")
    torch.set_num_threads(1)
else:
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", RANK)) % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)
dist.init_process_group("rdist", timeout=timedelta(seconds=60))
RED = dist.ReduceOp
NCCL = dist.new_group(backend="nccl") if SIZE == 1 and not ON_CPU else None

cases, failures = [], {}


def data(rank, n, dtype=torch.float32, salt=0):
    """Rank `rank`'s input on the CPU: small values, exact in every dtype."""
    return ((torch.arange(n, dtype=torch.int64) + 3 * rank + salt) % 7 + 1).to(dtype)


def late(cpu):
    """`cpu` on the device, still being made by kernels on the current
    stream when this returns: a call that does not wait for the stream
    reads zeros or halves (the sleep keeps the stream busy)."""
    if ON_CPU:
        return cpu.clone()
    ready = cpu.to(DEVICE)
    out = torch.zeros(cpu.shape, dtype=cpu.dtype, device=DEVICE)
    torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time, queued before the copy
    out.copy_(ready)  # device to device, on the current stream
    return out


def read(t):
    """`t` as the current stream sees it after everything queued so far."""
    return (t * 1).cpu()


def on_side_stream(fn):
    """`fn()` issued under a side stream that follows the current one."""
    side = torch.cuda.Stream(device=DEVICE)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = fn()
    torch.cuda.current_stream().wait_stream(side)
    return result


def check(case, run, nccl_too=True):
    """Runs `run(group)` (returns the result read through `read`) on rdist
    and, at world size 1, on torch's nccl backend, on the current stream
    and (on a GPU) under a side stream; the reference comes from
    `run.reference`."""
    for variant in ("",) if ON_CPU else ("", "/side_stream"):
        name = case + variant
        issue = on_side_stream if variant else (lambda fn: fn())
        cases.append(name)
        try:
            got = issue(lambda: run(None))
            want = run.reference
            if not torch.equal(got, want):
                raise AssertionError(f"rdist gave {got.tolist()[:12]}, the reference {want.tolist()[:12]}")
            if NCCL is not None and nccl_too:
                theirs = issue(lambda: run(NCCL))
                if not torch.equal(got, theirs):
                    raise AssertionError(f"rdist gave {got.tolist()[:12]}, nccl {theirs.tolist()[:12]}")
        except Exception:  # noqa: BLE001 - reported, the next case runs
            failures[name] = traceback.format_exc()[-2000:]


def case(reference):
    def wrap(fn):
        fn.reference = reference
        return fn

    return wrap


N = 1000
for dtype in (torch.float32, torch.bfloat16, torch.int64):
    for op, op_name in ((RED.SUM, "sum"), (RED.MAX, "max")):
        name = f"all_reduce/{str(dtype).replace('torch.', '')}/{op_name}"
        ref = data(0, N, dtype)
        for r in range(1, SIZE):
            other = data(r, N, dtype)
            ref = ref + other if op == RED.SUM else torch.maximum(ref, other)

        @case(ref)
        def all_reduce(group, dtype=dtype, op=op):
            t = late(data(RANK, N, dtype))
            dist.all_reduce(t, op=op, group=group)
            return read(t)

        check(name, all_reduce)


@case(torch.stack([data(r, N) for r in range(SIZE)]).sum(0) / SIZE)
def average(group):
    t = late(data(RANK, N))
    work = dist.all_reduce(t, op=RED.AVG, group=group, async_op=True)
    work.wait()
    return read(t)


if SIZE in (1, 2, 4):  # an average of small integers divided by 3 is not exact
    check("all_reduce/avg/async", average)

ROOT = SIZE - 1


@case(data(ROOT, N))
def broadcast(group):
    t = late(data(RANK, N))
    dist.broadcast(t, src=ROOT, group=group)
    return read(t)


check("broadcast", broadcast)


@case(torch.cat([data(r, N) for r in range(SIZE)]))
def all_gather(group):
    out = torch.empty(SIZE * N, device=DEVICE)
    dist.all_gather_into_tensor(out, late(data(RANK, N)), group=group)
    return read(out)


check("all_gather_into_tensor", all_gather)


@case(torch.stack([data(r, SIZE * N) for r in range(SIZE)]).sum(0)[RANK * N:(RANK + 1) * N])
def reduce_scatter(group):
    out = torch.empty(N, device=DEVICE)
    dist.reduce_scatter_tensor(out, late(data(RANK, SIZE * N)), group=group)
    return read(out)


check("reduce_scatter_tensor", reduce_scatter)


@case(torch.cat([data(r, SIZE * N)[RANK * N:(RANK + 1) * N] for r in range(SIZE)]))
def all_to_all(group):
    out = torch.empty(SIZE * N, device=DEVICE)
    dist.all_to_all_single(out, late(data(RANK, SIZE * N)), group=group)
    return read(out)


check("all_to_all_single", all_to_all)


@case(data(0, N) + 5)
def other_stream(group):
    """A call issued under another stream waits for that stream and is
    waited for by it, not by the default one."""
    side = torch.cuda.Stream(device=DEVICE)
    t = late(data(RANK, N) + 5 if RANK == 0 else torch.zeros(N))
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.broadcast(t, src=0, group=group)
        result = t * 1
    torch.cuda.current_stream().wait_stream(side)
    return result.cpu()


if not ON_CPU:
    check("broadcast/another_stream", other_stream)

if SIZE >= 2:
    # Ranks 2i and 2i+1 swap their inputs; a last odd rank keeps its own.
    PARTNER = RANK ^ 1 if (RANK ^ 1) < SIZE else RANK

    @case(data(PARTNER, N, salt=9))
    def send_recv(group):
        t = late(data(RANK, N, salt=9))
        if RANK % 2 == 0 and RANK + 1 < SIZE:
            dist.send(t, RANK + 1, group=group)
            got = torch.empty(N, device=DEVICE)
            dist.recv(got, RANK + 1, group=group)
            return read(got)
        if RANK % 2 == 1:
            got = torch.empty(N, device=DEVICE)
            dist.recv(got, RANK - 1, group=group)
            dist.send(t, RANK - 1, group=group)
            return read(got)
        return read(t)

    check("send_recv", send_recv)


def per_call_us(group, nbytes):
    t = torch.ones(max(1, nbytes // 4), device=DEVICE)
    for _ in range(3):
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    calls = 200 if nbytes <= 1 << 20 else 20
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t, group=group)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return round(best, 2)


timings = {}
for label, group in (("rdist", None), ("nccl", NCCL)):
    if ON_CPU or (label == "nccl" and group is None):
        continue
    timings[label] = {str(n): per_call_us(group, n) for n in (4, 1 << 20, 64 << 20)}

report(rank=RANK, size=SIZE, device="cpu" if ON_CPU else torch.cuda.get_device_name(DEVICE),
       torch=torch.__version__, compiled=rtorch.compiled_backend() is not None,
       cases=cases, failures=failures, per_call_us=timings)
dist.destroy_process_group()
exit_without_teardown()
