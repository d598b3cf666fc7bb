"""A rank of the torch.distributed job on the "rdist" backend: every call
the backend implements, each checked against an independent reference
computed here (inputs are seeded by rank, small integers, so results are
exact whatever the reduction order) and, where gloo supports the call, the
same call on a gloo group in the same job. Reports one `RESULT` line:

    {"rank": r, "size": n, "cases": [ids], "failures": {id: why},
     "unavailable": {id: why}}

"unavailable" holds the cases whose C functions the loaded library lacks
(the 0.2 additions); the test marks those needs_0_2.
"""

import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import rdist
import rdist.torch  # noqa: F401 - registers the backend
from _worker import exit_without_teardown, report

torch.set_num_threads(1)
dist.init_process_group("rdist", timeout=timedelta(seconds=60))
RANK, SIZE = dist.get_rank(), dist.get_world_size()
GLOO = dist.new_group(backend="gloo")
RED = dist.ReduceOp
TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

cases, failures, unavailable = [], {}, {}

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
NEW = [torch.bool, torch.int16, torch.uint16]  # rdist 0.2 types
OTHER = [torch.uint32, torch.uint64]


def name(dtype):
    return str(dtype).replace("torch.", "")


def data(rank, n=5, dtype=torch.float32, salt=0):
    """Rank `rank`'s input: small values, exact in every dtype."""
    if dtype == torch.bool:
        return (torch.arange(n) + rank + salt) % 3 == 0
    base = (torch.arange(n, dtype=torch.int64) + 2 * rank + salt) % 5 + 1
    return base.to(dtype)


def reduce_ref(op, tensors):
    """The reduction of `tensors` computed in float64/int64 here."""
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(tensors)
        if op in (RED.SUM, RED.MAX, RED.BOR):
            return stack.any(0)
        if op in (RED.PRODUCT, RED.MIN, RED.BAND):
            return stack.all(0)
        if op == RED.BXOR:
            return stack.to(torch.int64).sum(0) % 2 == 1
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    stack = torch.stack([t.to(wide) for t in tensors])
    if op == RED.SUM:
        out = stack.sum(0)
    elif op == RED.PRODUCT:
        out = stack.prod(0)
    elif op == RED.MIN:
        out = stack.min(0).values
    elif op == RED.MAX:
        out = stack.max(0).values
    elif op == RED.AVG:
        out = stack.sum(0) / len(tensors) if dtype.is_floating_point else stack.sum(0) // len(tensors)
    else:
        out = stack[0]
        for t in stack[1:]:
            out = out & t if op == RED.BAND else out | t if op == RED.BOR else out ^ t
    return out.to(dtype)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


HAS_0_2 = rdist.library_version() >= (0, 2, 0) and all(
    rdist._library.has(f) for f in rdist._library.OPTIONAL
)
cases_0_2 = []


def opname(op):
    return str(op).split(".")[-1].lower()


def case(case_id, fn, gloo=True, new=False):
    """Runs `fn(group)` on rdist; it returns (got, expected). With `gloo`,
    also on the gloo group, whose result must equal rdist's. `new` cases
    need the 0.2 C API and run only when the library has it."""
    if new:
        cases_0_2.append(case_id)
        if not HAS_0_2:
            unavailable[case_id] = "the library lacks the 0.2 API"
            return
    else:
        cases.append(case_id)
    try:
        got, want = fn(dist.group.WORLD)
        if not same(got, want):
            failures[case_id] = f"rdist gave {got.tolist()}, expected {want.tolist()}"
            return
        if gloo:
            try:
                got_gloo, _ = fn(GLOO)
            except RuntimeError as error:
                if "not support" in str(error):
                    return  # an older torch's gloo lacks the call: the reference decides
                raise
            if not same(got, got_gloo):
                failures[case_id] = f"rdist gave {got.tolist()}, gloo {got_gloo.tolist()}"
    except Exception:  # noqa: BLE001 - reported
        failures[case_id] = traceback.format_exc()[-1500:]


# -- all_reduce: every dtype with SUM, every op on a few ---------------------------

def allreduce_case(dtype, op, n=5):
    def run(group):
        t = data(RANK, n, dtype)
        dist.all_reduce(t, op=op, group=group)
        return t, reduce_ref(op, [data(r, n, dtype) for r in range(SIZE)])
    return run


for dtype in FLOATS + INTS + NEW + OTHER:
    gloo_ok = dtype not in (torch.uint16, torch.uint32, torch.uint64, torch.int16)
    case(f"all_reduce/sum/{name(dtype)}", allreduce_case(dtype, RED.SUM),
         gloo=gloo_ok and dtype != torch.bool, new=dtype in NEW)
for dtype in (torch.float32, torch.int32, torch.float64, torch.int64):
    for op in (RED.PRODUCT, RED.MIN, RED.MAX):
        case(f"all_reduce/{opname(op)}/{name(dtype)}", allreduce_case(dtype, op))
    if dtype.is_floating_point:
        case(f"all_reduce/avg/{name(dtype)}", allreduce_case(dtype, RED.AVG), gloo=False)
for dtype in (torch.int32, torch.uint8, torch.int64, torch.bool):
    for op in (RED.BAND, RED.BOR, RED.BXOR):
        case(f"all_reduce/{opname(op)}/{name(dtype)}", allreduce_case(dtype, op),
             gloo=dtype != torch.bool, new=True)
for dtype in (torch.bool, torch.int16):
    for op in (RED.MIN, RED.MAX):
        case(f"all_reduce/{opname(op)}/{name(dtype)}", allreduce_case(dtype, op), gloo=False, new=True)


def premul(group):
    t = data(RANK, 5, torch.float32)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0), group=group)
    return t, reduce_ref(RED.SUM, [data(r) for r in range(SIZE)]) * 2


case("all_reduce/premul_sum/float32", premul, gloo=False)


def complex_sum(group):
    t = torch.complex(data(RANK, 4, torch.float32), data(RANK, 4, torch.float32, 1))
    dist.all_reduce(t, group=group)
    re = reduce_ref(RED.SUM, [data(r, 4) for r in range(SIZE)])
    im = reduce_ref(RED.SUM, [data(r, 4, salt=1) for r in range(SIZE)])
    return t, torch.complex(re, im)


case("all_reduce/sum/complex64", complex_sum)


def coalesced(group):
    ts = [data(RANK, 3), data(RANK, 4, salt=1)]
    dist.all_reduce_coalesced(ts, group=group)
    return torch.cat(ts), torch.cat([reduce_ref(RED.SUM, [data(r, 3) for r in range(SIZE)]),
                                     reduce_ref(RED.SUM, [data(r, 4, salt=1) for r in range(SIZE)])])


case("all_reduce_coalesced", coalesced)

# -- the other collectives -----------------------------------------------------

for root in sorted({0, SIZE - 1}):
    for dtype in (torch.float32, torch.int64, torch.bool, torch.int16, torch.bfloat16):
        def bcast(group, root=root, dtype=dtype):
            t = data(RANK, 6, dtype)
            dist.broadcast(t, src=root, group=group)
            return t, data(root, 6, dtype)
        case(f"broadcast/root{root}/{name(dtype)}", bcast, gloo=dtype not in (torch.int16,))

    for op in (RED.SUM, RED.MAX):
        def reduce(group, root=root, op=op):
            t = data(RANK, 5)
            dist.reduce(t, dst=root, op=op, group=group)
            if RANK != root:  # torch leaves other ranks' tensor unspecified (gloo writes it)
                return torch.zeros(1), torch.zeros(1)
            return t, reduce_ref(op, [data(r) for r in range(SIZE)])
        case(f"reduce/root{root}/{opname(op)}", reduce)

    def gather(group, root=root):
        out = [torch.empty(4) for _ in range(SIZE)] if RANK == root else None
        dist.gather(data(RANK, 4), out, dst=root, group=group)
        if RANK != root:
            return torch.zeros(1), torch.zeros(1)
        return torch.stack(out), torch.stack([data(r, 4) for r in range(SIZE)])
    case(f"gather/root{root}", gather)

    def scatter(group, root=root):
        out = torch.empty(4)
        chunks = [data(r, 4, salt=7) for r in range(SIZE)] if RANK == root else None
        dist.scatter(out, chunks, src=root, group=group)
        return out, data(RANK, 4, salt=7)
    case(f"scatter/root{root}", scatter)


for dtype in (torch.float32, torch.int8, torch.bool, torch.uint16):
    def allgather(group, dtype=dtype):
        out = [torch.empty(3, dtype=dtype) for _ in range(SIZE)]
        dist.all_gather(out, data(RANK, 3, dtype), group=group)
        return torch.stack(out), torch.stack([data(r, 3, dtype) for r in range(SIZE)])
    case(f"all_gather/list/{name(dtype)}", allgather, gloo=dtype not in (torch.uint16,))


def allgather_views(group):
    flat = torch.empty(SIZE * 3)
    dist.all_gather(list(flat.chunk(SIZE)), data(RANK, 3), group=group)
    return flat, torch.cat([data(r, 3) for r in range(SIZE)])


case("all_gather/list/views", allgather_views)


def allgather_coalesced(sizes):
    """torch lays the outputs out [rank][tensor]: outputs[r][j] is rank r's
    inputs[j] (inputs of different sizes allowed)."""
    def run(group):
        inputs = [data(RANK, k, salt=j) for j, k in enumerate(sizes)]
        outputs = [[torch.zeros(k) for k in sizes] for _ in range(SIZE)]
        dist.all_gather_coalesced(outputs, inputs, group=group)
        want = [data(r, k, salt=j) for r in range(SIZE) for j, k in enumerate(sizes)]
        return torch.cat([t for row in outputs for t in row]), torch.cat(want)
    return run


for sizes in ([2, 2], [3, 1, 2]):
    case(f"all_gather_coalesced/{'x'.join(map(str, sizes))}", allgather_coalesced(sizes))


def allgather_tensor(group):
    out = torch.empty(SIZE * 2, 3)
    dist.all_gather_into_tensor(out, data(RANK, 6).view(2, 3), group=group)
    return out, torch.cat([data(r, 6).view(2, 3) for r in range(SIZE)])


case("all_gather_into_tensor", allgather_tensor)


def reduce_scatter_list(group):
    out = torch.empty(3)
    dist.reduce_scatter(out, [data(RANK, 3, salt=j) for j in range(SIZE)], group=group)
    return out, reduce_ref(RED.SUM, [data(r, 3, salt=RANK) for r in range(SIZE)])


case("reduce_scatter/list", reduce_scatter_list)

for op in (RED.SUM, RED.MAX, RED.AVG):
    def reduce_scatter_tensor(group, op=op):
        out = torch.empty(4)
        dist.reduce_scatter_tensor(out, data(RANK, 4 * SIZE), op=op, group=group)
        want = reduce_ref(op, [data(r, 4 * SIZE) for r in range(SIZE)])[4 * RANK:4 * RANK + 4]
        return out, want
    # torch 2.4's gloo sums whatever the op: gloo is compared from the
    # releases seen right (the reference decides everywhere).
    gloo_right = op == RED.SUM or TORCH >= (2, 11)
    case(f"reduce_scatter_tensor/{opname(op)}", reduce_scatter_tensor,
         gloo=op != RED.AVG and gloo_right)


def alltoall_single(group):
    out = torch.empty(2 * SIZE)
    dist.all_to_all_single(out, data(RANK, 2 * SIZE), group=group)
    return out, torch.cat([data(r, 2 * SIZE)[2 * RANK:2 * RANK + 2] for r in range(SIZE)])


case("all_to_all_single/even", alltoall_single)


def splits(rank):
    """Rank `rank` sends j + rank % 2 rows (of 2) to rank j."""
    return [j + rank % 2 for j in range(SIZE)]


def alltoall_uneven(group):
    send_splits = splits(RANK)
    recv_splits = [splits(r)[RANK] for r in range(SIZE)]
    inp = data(RANK, 2 * sum(send_splits)).view(-1, 2)
    out = torch.empty(sum(recv_splits), 2)
    dist.all_to_all_single(out, inp, recv_splits, send_splits, group=group)
    want = []
    for r in range(SIZE):
        s = splits(r)
        start = sum(s[:RANK])
        want.append(data(r, 2 * sum(s)).view(-1, 2)[start:start + s[RANK]])
    return out, torch.cat(want)


case("all_to_all_single/uneven", alltoall_uneven, new=True)


def alltoall_list(group):
    out = [torch.empty(2) for _ in range(SIZE)]
    dist.all_to_all(out, [data(RANK, 2, salt=j) for j in range(SIZE)], group=group)
    return torch.stack(out), torch.stack([data(r, 2, salt=RANK) for r in range(SIZE)])


case("all_to_all/list/even", alltoall_list)


def alltoall_list_uneven(group):
    out = [torch.empty(splits(r)[RANK] + 1) for r in range(SIZE)]
    dist.all_to_all(out, [data(RANK, splits(RANK)[j] + 1, salt=j) for j in range(SIZE)], group=group)
    return torch.cat(out), torch.cat([data(r, splits(r)[RANK] + 1, salt=RANK) for r in range(SIZE)])


# gloo refuses uneven list all_to_all ("invalid tensor size"): the
# reference alone judges it.
case("all_to_all/list/uneven", alltoall_list_uneven, gloo=False, new=True)

# -- point to point ----------------------------------------------------------------

NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE


def ring(group):
    out = torch.empty(5)
    if RANK % 2 == 0:
        dist.send(data(RANK), NEXT, group=group)
        dist.recv(out, PREV, group=group)
    else:
        dist.recv(out, PREV, group=group)
        dist.send(data(RANK), NEXT, group=group)
    return out, data(PREV)


case("send_recv/ring", ring)


def isend_irecv(group):
    out = torch.empty(5)
    works = [dist.irecv(out, PREV, group=group), dist.isend(data(RANK), NEXT, group=group)]
    for w in works:
        w.wait()
    return out, data(PREV)


case("isend_irecv/ring", isend_irecv)


def batch(group):
    out = torch.empty(5)
    ops = [dist.P2POp(dist.irecv, out, PREV, group), dist.P2POp(dist.isend, data(RANK), NEXT, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out, data(PREV)


case("batch_isend_irecv/ring", batch)


def tagged(group):
    a, b = torch.empty(5), torch.empty(5)
    works = [dist.irecv(a, PREV, group=group, tag=7), dist.irecv(b, PREV, group=group, tag=3),
             dist.isend(data(RANK, salt=3), NEXT, group=group, tag=3),
             dist.isend(data(RANK, salt=7), NEXT, group=group, tag=7)]
    for w in works:
        w.wait()
    return torch.cat([a, b]), torch.cat([data(PREV, salt=7), data(PREV, salt=3)])


case("send_recv/tags", tagged, new=True)


def any_source(group):
    if RANK == 0:
        got = []
        for _ in range(SIZE - 1):
            t = torch.empty(5)
            src = dist.recv(t, group=group)
            got.append((src, t))
        got.sort(key=lambda x: x[0])
        return (torch.stack([t for _, t in got]) if got else torch.zeros(0),
                torch.stack([data(r) for r in range(1, SIZE)]) if got else torch.zeros(0))
    dist.send(data(RANK), 0, group=group)
    return torch.zeros(1), torch.zeros(1)


case("recv/any_source", any_source, gloo=False, new=True)


# -- barriers, groups, objects, async ------------------------------------------------

def barriers(group):
    dist.barrier(group=group)
    dist.barrier(group=group, async_op=True).wait()
    if group is not GLOO:
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=30))
        except ValueError as error:
            # torch before 2.5 lets only gloo groups reach a backend's
            # monitored barrier (its Python front refuses the others).
            if "only implemented for GLOO" not in str(error):
                raise
    return torch.ones(1), torch.ones(1)


case("barrier", barriers)


def subgroup(group):
    members = [0, SIZE - 1]
    sub = dist.new_group(members, backend="rdist" if group is not GLOO else "gloo")
    t = data(RANK)
    if RANK in members:
        dist.all_reduce(t, group=sub)
        return t, reduce_ref(RED.SUM, [data(r) for r in members])
    assert sub == dist.GroupMember.NON_GROUP_MEMBER
    return t, data(RANK)


case("new_group", subgroup)


def objects(group):
    got = [None] * SIZE
    dist.all_gather_object(got, {"rank": RANK, "tag": "x" * RANK}, group=group)
    objs = [f"from {RANK}", RANK] if RANK == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0, group=group)
    gathered = [None] * SIZE if RANK == 0 else None
    dist.gather_object(RANK * 10, gathered, dst=0, group=group)
    out = [None]
    dist.scatter_object_list(out, [f"o{r}" for r in range(SIZE)] if RANK == 0 else None, src=0, group=group)
    ok = (got == [{"rank": r, "tag": "x" * r} for r in range(SIZE)] and objs == ["from 0", 0]
          and (RANK != 0 or gathered == [r * 10 for r in range(SIZE)]) and out == [f"o{RANK}"])
    return torch.tensor([ok]), torch.tensor([True])


case("object_collectives", objects)


def async_ops(group):
    t = data(RANK)
    work = dist.all_reduce(t, async_op=True, group=group)
    chained = work.get_future().then(lambda fut: fut.value()[0] * 2)
    u = data(RANK, salt=1)
    work2 = dist.all_reduce(u, async_op=True, group=group)
    work2.wait()
    work.wait()
    doubled = chained.wait()
    want = reduce_ref(RED.SUM, [data(r) for r in range(SIZE)])
    want_u = reduce_ref(RED.SUM, [data(r, salt=1) for r in range(SIZE)])
    return torch.cat([t, doubled, u]), torch.cat([want, want * 2, want_u])


case("async/wait_and_future", async_ops)

dist.barrier(GLOO)
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
report(rank=RANK, size=SIZE, cases=cases, cases_0_2=cases_0_2, failures=failures,
       unavailable=unavailable, compiled=bool(getattr(backend, "compiled", False)))
dist.destroy_process_group()
exit_without_teardown()
