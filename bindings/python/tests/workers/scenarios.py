"""A rank of one scenario job (non-blocking calls, groups, split, faults,
other bootstraps). Each scenario checks what it can locally with asserts and
reports one `RESULT` line per rank for the test to check across ranks.

usage: scenarios.py SCENARIO [ARGS...]   (rank and size from the environment)
"""

import gc
import os
import sys
import threading
import time

if sys.argv[1:2] == ["numpy_free"]:
    # Make `import numpy` fail, to prove the binding never needs it.
    sys.modules["numpy"] = None

import rdist  # noqa: E402
from _worker import error_fields, report  # noqa: E402


def nonblocking():
    import numpy as np

    with rdist.init(timeout_ms=20000) as comm:
        rank, size = comm.rank, comm.size
        # Several requests in flight at once, waited for in reverse order.
        big = np.full(100_003, rank + 1, np.float32)
        bcast = np.full(5, rank, np.int64)
        gathered = np.zeros(3 * size, np.int32)
        requests = [
            comm.iallreduce(big),
            comm.ibroadcast(bcast, root=size - 1),
            comm.iallgather(np.full(3, rank, np.int32), gathered),
            comm.ibarrier(),
        ]
        for request in reversed(requests):
            request.wait()
        assert all(r.done for r in requests)
        assert np.all(big == size * (size + 1) / 2), big[:4]
        assert np.all(bcast == size - 1), bcast
        assert np.array_equal(gathered, np.repeat(np.arange(size, dtype=np.int32), 3))

        # test() polls without blocking until the operation completes.
        polled = np.full(7, 2.0, np.float64)
        request = comm.iallreduce(polled, op="prod")
        deadline = time.monotonic() + 10
        polls = 0
        while not request.test():
            polls += 1
            assert time.monotonic() < deadline, "test() never reported completion"
            time.sleep(0.001)
        assert request.test() and request.wait() is polled
        assert np.all(polled == 2.0 ** size)

        # The request keeps a temporary input alive; wait() returns the output.
        request = comm.iallreduce(np.full(1000, float(rank), np.float64), op="max")
        gc.collect()
        result = request.wait()
        assert np.all(result == size - 1), result[:4]

        # Every other non-blocking twin, used as context managers.
        block = np.arange(size * 4, dtype=np.float64) + rank
        with comm.ireduce_scatter(block, np.zeros(4), op="sum") as request:
            pass
        expected = np.arange(rank * 4, rank * 4 + 4) * size + sum(range(size))
        assert np.array_equal(request.wait(), expected), request.wait()
        reduced = comm.ireduce(np.full(3, rank, np.int64), "sum", 0, out=np.zeros(3, np.int64)).wait()
        if rank == 0:
            assert np.all(reduced == sum(range(size))), reduced
        out = np.zeros(2 * size, np.uint8) if rank == 0 else None
        comm.igather(np.full(2, rank, np.uint8), out, 0).wait()
        if rank == 0:
            assert np.array_equal(out, np.repeat(np.arange(size, dtype=np.uint8), 2)), out
        send = np.arange(size, dtype=np.int32) * 10 if rank == 0 else None
        piece = comm.iscatter(send, np.zeros(1, np.int32), 0).wait()
        assert piece[0] == rank * 10, piece
        mixed = comm.ialltoall(np.arange(size, dtype=np.int64) + 100 * rank, np.zeros(size, np.int64)).wait()
        assert np.array_equal(mixed, np.arange(size) * 100 + rank), mixed

        # Point to point: rank 0 sends to every other rank at once. (Calls on
        # one communicator run in the order issued, so a ring of irecv-then-
        # isend would deadlock; exchanges belong in rdist.group().)
        if rank == 0:
            payloads = [np.full(10, peer, np.float32) for peer in range(1, size)]
            sent = rdist.wait_all([comm.isend(p, peer) for peer, p in enumerate(payloads, 1)])
            assert sent == [None] * (size - 1)
        else:
            incoming = np.zeros(10, np.float32)
            assert rdist.wait_all([comm.irecv(incoming, 0)])[0] is incoming
            assert np.all(incoming == rank), incoming

        # A request dropped without waiting is freed (after completing) by the
        # garbage collector, and the communicator carries on.
        comm.iallreduce(np.ones(16, np.float32))
        gc.collect()
        comm.barrier()
        report(rank=rank, ok=True, polls=polls)


def group_swap():
    import numpy as np

    with rdist.init(timeout_ms=20000) as comm:
        rank, size = comm.rank, comm.size
        # Pairwise exchange of messages far too big to be buffered: without a
        # group, send-then-recv on both sides could deadlock.
        peer = rank ^ 1
        n = 1 << 20
        mine = np.full(n, rank, np.float32)
        theirs = np.zeros(n, np.float32)
        with rdist.group():
            comm.send(mine, peer)
            comm.recv(theirs, peer)
        assert np.all(theirs == peer), theirs[:4]

        # A ring shift, with the send buffer a temporary: the group keeps it
        # alive until the queued calls have run.
        left_value = np.zeros(1000, np.int64)
        with rdist.group():
            comm.send(np.full(1000, rank, np.int64), (rank + 1) % size)
            gc.collect()
            comm.recv(left_value, (rank - 1) % size)
        assert np.all(left_value == (rank - 1) % size)

        # Nested groups run at the outermost end, collectives included.
        a, b = np.zeros(4, np.int32), np.zeros(4, np.int32)
        with rdist.group():
            with rdist.group():
                comm.send(np.full(4, rank, np.int32), peer)
            comm.recv(a, peer)
            comm.allreduce(np.full(4, 1, np.int32), out=b)
        assert np.all(a == peer) and np.all(b == size), (a, b)

        # Non-blocking calls are refused inside a group (the group itself is
        # the non-blocking unit), and the group still ends cleanly.
        with rdist.group():
            try:
                comm.irecv(a, peer)
                refused = None
            except rdist.InvalidUsageError as error:
                refused = str(error)
        assert refused and "group" in refused, refused
        report(rank=rank, ok=True)


def split():
    import numpy as np

    with rdist.init(timeout_ms=20000) as comm:
        rank = comm.rank
        # Even and odd ranks, each group ordered by descending old rank.
        sub = comm.split(rank % 2, key=-rank)
        members = [r for r in range(comm.size) if r % 2 == rank % 2]
        total = sub.allreduce(np.array([rank], np.int64))[0]
        gathered = np.zeros(sub.size, np.int32)
        sub.allgather(np.array([rank], np.int32), gathered)
        info = dict(sub_rank=sub.rank, sub_size=sub.size, total=int(total), order=gathered.tolist())
        assert sub.size == len(members)
        assert gathered.tolist() == sorted(members, reverse=True)
        sub.destroy()
        assert sub.destroyed
        # Rank 0 opts out of a second split; the parent still works throughout.
        others = comm.split(None if rank == 0 else 7)
        if rank == 0:
            assert others is None
        else:
            assert others.size == comm.size - 1
            assert others.allreduce(np.ones(1, np.int32))[0] == comm.size - 1
            others.destroy()
        assert comm.allreduce(np.ones(1, np.int32))[0] == comm.size
        report(rank=rank, ok=True, **info)


def mismatch():
    import numpy as np

    with rdist.init(timeout_ms=15000) as comm:
        buffer = np.zeros(10, np.float32)
        started = time.monotonic()
        try:
            if comm.rank == 0:
                comm.allreduce(buffer)
            else:
                comm.broadcast(buffer, root=0)
        except rdist.MismatchError as error:
            report(rank=comm.rank, elapsed=time.monotonic() - started, **error_fields(error))
        else:
            report(rank=comm.rank, error=None)


def timeout():
    import numpy as np

    comm = rdist.init(timeout_ms=600)
    if comm.rank == comm.size - 1:
        # Never joins the collective; exits after the others have given up.
        time.sleep(2.0)
        report(rank=comm.rank, absent=True)
        return
    started = time.monotonic()
    try:
        comm.allreduce(np.ones(8, np.int32))
    except rdist.CommTimeoutError as error:
        fields = error_fields(error)
        fields["builtin_timeout"] = isinstance(error, TimeoutError)
        report(rank=comm.rank, elapsed=time.monotonic() - started, **fields)
    else:
        report(rank=comm.rank, error=None)
    comm.destroy()


def crash():
    import numpy as np

    with rdist.init(timeout_ms=30000) as comm:
        comm.barrier()
        if comm.rank == 1:
            # Dies mid-job without any goodbye, as a segfault or OOM kill would.
            os._exit(7)
        time.sleep(0.2)  # let the crash happen first
        started = time.monotonic()
        try:
            comm.allreduce(np.ones(1000, np.float32))
        except rdist.Error as error:
            report(
                rank=comm.rank,
                elapsed=time.monotonic() - started,
                failed=comm.failed_ranks(),
                **error_fields(error),
            )
        else:
            report(rank=comm.rank, error=None)


def abort():
    import numpy as np

    with rdist.init(timeout_ms=30000) as comm:
        peer = 1 - comm.rank
        aborter = None
        if comm.rank == 0:
            aborter = threading.Timer(0.3, comm.abort)
            aborter.start()
        started = time.monotonic()
        try:
            comm.recv(np.zeros(16, np.uint8), peer)  # nobody sends
            fields = {"error": None}
        except rdist.Error as error:
            fields = error_fields(error)
        elapsed = time.monotonic() - started
        if aborter:
            aborter.join()
        try:
            comm.barrier()
            after = None
        except rdist.Error as error:
            after = type(error).__name__
        report(rank=comm.rank, elapsed=elapsed, after=after, **fields)


def unique_id(uid_hex):
    import numpy as np

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with rdist.init_rank(size, bytes.fromhex(uid_hex), rank, timeout_ms=15000) as comm:
        total = comm.allreduce(np.array([rank + 1], np.int64))[0]
        report(rank=comm.rank, size=comm.size, total=int(total))


def file_init(path):
    import numpy as np

    rank, size = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
    with rdist.init(f"file://{path}", rank=rank, world_size=size, timeout_ms=15000) as comm:
        total = comm.allreduce(np.array([rank + 1], np.int64))[0]
        report(rank=comm.rank, size=comm.size, total=int(total))


def numpy_free():
    import array

    with rdist.init(timeout_ms=15000) as comm:
        rank, size = comm.rank, comm.size
        values = array.array("d", [rank, 1.5])
        comm.allreduce(values, "sum")
        raw = bytearray(b"rdist!" if rank == 0 else bytes(6))
        comm.broadcast(raw, 0)
        halves = array.array("H", [0x3C00] * 4)  # float16 1.0, as raw bits
        comm.allreduce(halves, dtype="float16")
        gathered = array.array("i", [0] * size)
        comm.allgather(array.array("i", [rank * 3]), memoryview(gathered))
        report(
            rank=rank,
            numpy_loaded="numpy" in sys.modules and sys.modules["numpy"] is not None,
            values=list(values),
            raw=raw.decode(),
            halves=list(halves),
            gathered=list(gathered),
        )


def shrink(victim):
    """The default communicator loses rank `victim`; the survivors, which
    may not have noticed, shrink it (the default group's shrink_group) and
    go on on the new default."""
    import numpy as np

    victim = int(victim)
    rdist.init_process_group(timeout_ms=30000)
    old_rank = rdist.get_rank()
    rdist.barrier()
    if old_rank == victim:
        os._exit(7)
    time.sleep(0.2)
    try:
        rdist.all_reduce(np.ones(1000, np.float32))
        error = None
    except rdist.PeerLostError as e:
        error = type(e).__name__
    started = time.monotonic()
    comm = rdist.shrink_group()
    took = time.monotonic() - started
    total = np.array([old_rank + 1.0])
    rdist.all_reduce(total)
    report(
        rank=old_rank, new_rank=rdist.get_rank(), size=rdist.get_world_size(),
        default=comm is rdist.get_default_comm(), sum=float(total[0]), error=error, took=took,
    )
    rdist.destroy_process_group()


SCENARIOS = {
    f.__name__: f
    for f in (nonblocking, group_swap, split, mismatch, timeout, crash, abort, unique_id, file_init, numpy_free,
              shrink)
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
