"""A rank of a torch.distributed job on the "rdist" backend checking what
torch itself sees of the backend (beyond results, which torch_ops.py
checks): the compiled backend is in use, all_gather_coalesced's layout
(against gloo and an independent reference), Work's state after wait,
the sender of a receive from any source, coalescing, sparse all_reduce,
torch's exception types with rdist's message, monitored_barrier naming
the ranks that did not arrive, profiler names and DDP's logging.

argv[1] "detail": run under TORCH_DISTRIBUTED_DEBUG=DETAIL (set by the
test), where torch wraps every group to check calls across ranks.
Reports one `RESULT` line: {"rank", "size", "cases", "failures", "facts"}.
"""

import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import rdist.torch
from _worker import exit_without_teardown, report

torch.set_num_threads(1)
dist.init_process_group("rdist", timeout=timedelta(seconds=60))
RANK, SIZE = dist.get_rank(), dist.get_world_size()
GLOO = dist.new_group(backend="gloo")
DETAIL = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
cases, failures, facts = [], {}, {}


def case(case_id, fn):
    cases.append(case_id)
    try:
        problem = fn()
        if problem:
            failures[case_id] = problem
    except Exception:  # noqa: BLE001 - reported
        failures[case_id] = traceback.format_exc()[-2000:]


backend = dist.group.WORLD._get_backend(torch.device("cpu"))
facts["wrapped"] = type(backend).__name__ == "_ProcessGroupWrapper"  # DETAIL's checks
if facts["wrapped"]:
    backend = backend.wrapped_pg
facts["backend_class"] = type(backend).__name__
facts["compiled"] = bool(getattr(backend, "compiled", False))
facts["get_backend"] = str(dist.get_backend())


def coalesced_gather(group, sizes):
    inputs = [torch.full((k,), float(10 * RANK + j + 1)) for j, k in enumerate(sizes)]
    outputs = [[torch.zeros(k) for k in sizes] for _ in range(SIZE)]
    dist.all_gather_coalesced(outputs, inputs, group=group)
    return outputs


def all_gather_coalesced_layout():
    """outputs[r][j] is rank r's inputs[j], as gloo has it."""
    for sizes in ([2, 2], [3, 1, 2]):
        got = coalesced_gather(dist.group.WORLD, sizes)
        want = [[torch.full((k,), float(10 * r + j + 1)) for j, k in enumerate(sizes)]
                for r in range(SIZE)]
        flat = [[t.tolist() for t in row] for row in got]
        if flat != [[t.tolist() for t in row] for row in want]:
            return f"sizes {sizes}: rdist gave {flat}, expected {[[t.tolist() for t in row] for row in want]}"
        gloo = coalesced_gather(GLOO, sizes)
        if flat != [[t.tolist() for t in row] for row in gloo]:
            return f"sizes {sizes}: rdist gave {flat}, gloo {[[t.tolist() for t in row] for row in gloo]}"
    return None


case("all_gather_coalesced/layout", all_gather_coalesced_layout)


def work_state():
    t = torch.ones(8)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    try:
        no_exception = work.exception() is None
    except TypeError:  # torch 2.11's binding cannot return an empty exception_ptr
        no_exception = True
    if not (work.is_completed() and work.is_success() and no_exception):
        return f"after wait: is_completed {work.is_completed()}, is_success {work.is_success()}"
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    out = torch.zeros(4)
    works = [dist.irecv(out, prv), dist.isend(torch.full((4,), float(RANK)), nxt)]
    for w in works:
        w.wait()
    states = [w.is_completed() for w in works]
    if not all(states) or out.tolist() != [float(prv)] * 4:
        return f"isend/irecv after wait: is_completed {states}, received {out.tolist()}"
    return None


case("work/completed_after_wait", work_state)


def any_source():
    """Every rank but 0 sends its rank to 0, which receives from any source
    and asks each Work who sent it."""
    if RANK == 0:
        seen = []
        for _ in range(SIZE - 1):
            t = torch.zeros(1)
            work = dist.irecv(t)  # src=None: any source
            work.wait()
            sender = work._source_rank()
            if sender != int(t.item()):
                return f"Work says the sender is {sender}, the message says {int(t.item())}"
            seen.append(sender)
        if sorted(seen) != list(range(1, SIZE)):
            return f"senders {seen}"
    else:
        dist.send(torch.tensor([float(RANK)]), 0)
    return None


case("recv/any_source_work_names_sender", any_source)


def coalescing():
    a, b = torch.full((3,), float(RANK + 1)), torch.full((5,), float(2 * RANK))
    with dist._coalescing_manager(async_ops=True) as manager:
        dist.all_reduce(a)
        dist.all_reduce(b)
    manager.wait()
    want_a = float(sum(r + 1 for r in range(SIZE)))
    want_b = float(sum(2 * r for r in range(SIZE)))
    if a.tolist() != [want_a] * 3 or b.tolist() != [want_b] * 5:
        return f"coalesced all_reduce gave {a.tolist()} and {b.tolist()}"
    return None


case("coalescing/all_reduce", coalescing)


def callback_waits():
    """A future's callback that waits for another call (as torch's PowerSGD
    hook does) completes, rather than waiting for its own thread."""
    a, b = torch.ones(4), torch.full((4,), 2.0)

    def then(fut):
        return dist.all_reduce(b, async_op=True).get_future().wait()[0] + fut.value()[0]

    got = dist.all_reduce(a, async_op=True).get_future().then(then).wait()
    want = [float(SIZE) * 3] * 4
    return None if got.tolist() == want else f"the chained result {got.tolist()}, expected {want}"


case("future/callback_waits_for_another_call", callback_waits)


def alltoall_even_here_uneven_there():
    """Rank 0's own sizes look even, the others' do not: every rank must
    still make the same call."""
    def count(src, dst):
        return 1 + 3 * (src == dst == SIZE - 1)

    inputs = [torch.full((count(RANK, q),), float(10 * RANK + q)) for q in range(SIZE)]
    outputs = [torch.zeros(count(q, RANK)) for q in range(SIZE)]
    dist.all_to_all(outputs, inputs)
    want = [[float(10 * q + RANK)] * count(q, RANK) for q in range(SIZE)]
    got = [o.tolist() for o in outputs]
    return None if got == want else f"all_to_all gave {got}, expected {want}"


case("all_to_all/list/even_here_uneven_there", alltoall_even_here_uneven_there)


def coalesced_mixed():
    """Coalesced blocking calls (torch waits for each inside the block,
    before they run) complete at the block's end."""
    if TORCH < (2, 5):
        # torch 2.4's coalescing fast path ends in c10d's base Backend
        # ("does not support allgather_into_tensor_coalesced") before it
        # reaches rdist's; not understood yet.
        facts["coalescing_all_gather"] = "not reached on this torch"
        return None
    a, b = torch.zeros(SIZE * 3), torch.zeros(SIZE * 2)
    with dist._coalescing_manager():  # blocking: torch waits at its end
        dist.all_gather_into_tensor(a, torch.full((3,), float(RANK + 1)))
        dist.all_gather_into_tensor(b, torch.full((2,), float(RANK)))
    want_a = [float(r + 1) for r in range(SIZE) for _ in range(3)]
    want_b = [float(r) for r in range(SIZE) for _ in range(2)]
    if a.tolist() != want_a or b.tolist() != want_b:
        return f"coalesced: {a.tolist()} and {b.tolist()}, expected {want_a} and {want_b}"
    return None


case("coalescing/all_gather_blocking", coalesced_mixed)


def sparse():
    def make():
        if RANK == SIZE - 1:  # one rank holds no nonzeros
            return torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.long),
                                           torch.zeros((0, 2)), (SIZE + 1, 2))
        indices = torch.tensor([[RANK, RANK + 1, 0]])
        values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [float(RANK), 1.0]])
        return torch.sparse_coo_tensor(indices, values, (SIZE + 1, 2))

    dense_want = torch.zeros(SIZE + 1, 2)
    for r in range(SIZE - 1):
        dense_want.index_add_(0, torch.tensor([r, r + 1, 0]),
                              torch.tensor([[1.0, 2.0], [3.0, 4.0], [float(r), 1.0]]))
    ours = make()
    dist.all_reduce(ours)
    theirs = make()
    dist.all_reduce(theirs, group=GLOO)
    if not torch.equal(ours.to_dense(), dense_want):
        return f"rdist's sparse sum {ours.to_dense().tolist()}, expected {dense_want.tolist()}"
    if not torch.equal(ours.to_dense(), theirs.to_dense()):
        return f"rdist's sparse sum {ours.to_dense().tolist()}, gloo's {theirs.to_dense().tolist()}"
    return None


case("all_reduce/sparse", sparse)


def errors():
    """Ranks disagree on a call's count on a group: every rank gets torch's
    error type with rdist's message naming both calls (that group is
    unusable after it), and the other groups go on."""
    group = dist.new_group(backend="rdist")
    t = torch.ones(4 + (RANK == SIZE - 1))
    try:
        dist.all_reduce(t, group=group)
    except Exception as error:  # noqa: BLE001 - the point
        facts["mismatch_error"] = f"{type(error).__module__}.{type(error).__name__}: {error}"[:400]
        if not isinstance(error, RuntimeError):
            return f"{type(error)} is not a RuntimeError"
        if DETAIL:
            # torch's checking wrapper finds the mismatch before rdist does.
            if "mismatch" not in str(error).lower():
                return f"under DETAIL: {error}"
        elif type(error).__name__ != "DistBackendError":
            return f"{type(error).__name__}, not torch's DistBackendError"
        elif "mismatched calls" not in str(error) or "allreduce" not in str(error):
            return f"the message does not say what differed: {error}"
    else:
        return "the mismatched all_reduce succeeded"
    u = torch.ones(4)
    dist.all_reduce(u)
    if u.tolist() != [float(SIZE)] * 4:
        return f"the next all_reduce gave {u.tolist()}"
    return None


case("errors/torch_types_and_go_on", errors)


def profiler_names():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(16))
    names = {e.name for e in prof.events()}
    facts["profiler"] = sorted(n for n in names if "rdist" in n or "all_reduce" in n)[:10]
    if not any(n.startswith("rdist:") for n in names):
        return f"no rdist:* event among {sorted(names)[:30]}"
    return None


case("profiler/names", profiler_names)


def ddp_logging():
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(torch.nn.Linear(4, 2))
    net(torch.ones(3, 4)).sum().backward()
    # DDP logs the ProcessGroup's name, which torch fixes to "custom" for
    # every backend it does not ship; the backend itself says "rdist".
    facts["ddp_backend_name"] = net._get_ddp_logging_data().get("backend_name")
    name = backend.name() if hasattr(backend, "name") else backend.getBackendName()
    if name != "rdist":
        return f"the backend calls itself {name!r}"
    return None


case("backend/names_itself_rdist", ddp_logging)


def monitored():
    """Ranks other than 0 arrive late; rank 0's error names them (the
    first, or all with wait_all_ranks), within the call's timeout; the late
    ones, left without rank 0's answer, are told so in gloo's words."""
    late = list(range(1, SIZE))
    for wait_all in (False, True):
        dist.barrier()
        if RANK in late:
            time.sleep(1.5)
        started = time.monotonic()
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=0.5), wait_all_ranks=wait_all)
        except ValueError as error:
            # torch's Python front before 2.15 (2.11 here) refuses every
            # backend but gloo: the call never reaches rdist.
            if "only implemented for GLOO" not in str(error):
                raise
            facts["monitored_barrier"] = "refused by this torch's front for non-gloo backends"
            return None
        except RuntimeError as error:
            took = time.monotonic() - started
            text = str(error)
            if RANK == 0:
                named = "Ranks " + ", ".join(map(str, late)) if wait_all and len(late) > 1 else "Rank 1"
                if f"{named} failed to pass monitoredBarrier" not in text:
                    return f"wait_all_ranks={wait_all}: {text!r} does not name {named}"
                if took > 5:
                    return f"wait_all_ranks={wait_all}: the error took {took:.1f} s"
                facts[f"monitored_barrier_{wait_all}"] = text[:300]
            else:
                told = (f"Rank {RANK} successfully reached monitoredBarrier, but received errors"
                        " while waiting for send/recv from rank 0")
                if told not in text:
                    return f"wait_all_ranks={wait_all}: rank {RANK} was told {text!r}"
        else:
            if RANK == 0:
                return f"wait_all_ranks={wait_all}: no error while ranks {late} were late"
    return None


case("monitored_barrier/names_late_ranks", monitored)

dist.barrier()
report(rank=RANK, size=SIZE, cases=cases, failures=failures, facts=facts)
dist.destroy_process_group()
exit_without_teardown()
