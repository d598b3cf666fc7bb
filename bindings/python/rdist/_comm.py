"""Communicators, requests and groups."""

import ctypes
import enum
import operator
import threading

from ._buffers import DType, common_dtype, element_count, fast_buffer, pin, resolve_op
from ._errors import (
    InvalidArgumentError,
    InvalidUsageError,
    check,
    error_for,
    last_error_text,
)
from ._issue import issue
from ._library import (
    UNIQUE_ID_BYTES,
    CommHandle,
    OptionsHandle,
    UniqueId,
    lib,
)
from ._streams import order_after

__all__ = [
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "SPLIT_NOCOLOR",
    "Backend",
    "Comm",
    "Request",
    "group",
    "group_end",
    "group_start",
    "init",
    "init_rank",
    "unique_id",
    "wait_all",
]

#: Pass as color to :meth:`Comm.split` (or pass None) to join no new communicator.
SPLIT_NOCOLOR = -1

#: :meth:`Comm.shrink` flags (NCCL's and torch's values): the parent's
#: queued calls finish first, or the parent is aborted first.
SHRINK_DEFAULT = 0
SHRINK_ABORT = 1


class Backend(enum.IntEnum):
    """rdist_backend_t: what a communicator runs on."""

    AUTO = 0
    SOCKET = 1
    NCCL = 2

    def __str__(self):
        return self.name.lower()


# ---------------------------------------------------------------------------
# Options and creation
# ---------------------------------------------------------------------------


class _Options:
    """An rdist_options_t filled from keyword arguments, for one creation call."""

    def __init__(self, options):
        self.handle = OptionsHandle()
        check(lib.rdist_options_create(ctypes.byref(self.handle)))
        try:
            for key, value in options.items():
                if value is None:
                    continue  # None means: the default / environment value
                if isinstance(value, bool):
                    value = int(value)
                check(lib.rdist_options_set(self.handle, key.encode(), str(value).encode()))
        except BaseException:
            self.close()
            raise

    def close(self):
        handle, self.handle = self.handle, None
        if handle:
            lib.rdist_options_destroy(handle)

    def __enter__(self):
        return self.handle

    def __exit__(self, *exc_info):
        self.close()


def _rank_arg(value):
    """-1 for None (read from the environment), else the int value."""
    return -1 if value is None else operator.index(value)


def init(init_method="env://", rank=-1, world_size=-1, **options):
    """Joins (or starts) a job, torch.distributed style, and returns its
    :class:`Comm`.

    ``init_method`` is ``"env://"`` (reads MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE, LOCAL_RANK as set by rdistrun, torchrun, Slurm or Open MPI),
    ``"tcp://HOST:PORT"`` or ``"file:///shared/path"``. ``rank`` and
    ``world_size`` of -1 (or None) are read from the environment.

    Keyword ``options`` are rdist options (see docs/options.md), e.g.
    ``backend="socket"``, ``timeout_ms=5000``, ``transport="tcp"``,
    ``algo="ring"``, ``debug="INFO"``; an explicit option wins over its
    environment variable. Blocks until every rank has joined, or raises
    :class:`CommTimeoutError` naming the ranks that never arrived.
    """
    with _Options(options) as opts:
        handle = CommHandle()
        check(
            lib.rdist_init(
                ctypes.byref(handle),
                str(init_method).encode(),
                _rank_arg(rank),
                _rank_arg(world_size),
                opts,
            )
        )
    return Comm(handle)


def unique_id():
    """Creates an NCCL-style unique id (``bytes``) and hosts its rendezvous in
    this process until every rank has joined (so keep this process alive
    until then). Ship the bytes to every rank by any means, then call
    :func:`init_rank` there. An id is good for one communicator."""
    uid = UniqueId()
    check(lib.rdist_get_unique_id(ctypes.byref(uid)))
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


def init_rank(world_size, uid, rank, **options):
    """Joins the communicator of a :func:`unique_id` as ``rank`` of
    ``world_size`` (as ``ncclCommInitRank``). ``options`` as for :func:`init`."""
    uid = bytes(uid)
    if len(uid) != UNIQUE_ID_BYTES:
        raise InvalidArgumentError(
            f"init_rank: uid must be the {UNIQUE_ID_BYTES} bytes from rdist.unique_id(), "
            f"got {len(uid)}"
        )
    packed = UniqueId()
    ctypes.memmove(ctypes.addressof(packed), uid, UNIQUE_ID_BYTES)
    with _Options(options) as opts:
        handle = CommHandle()
        check(
            lib.rdist_comm_init_rank(
                ctypes.byref(handle),
                operator.index(world_size),
                packed,
                operator.index(rank),
                opts,
            )
        )
    return Comm(handle)


# ---------------------------------------------------------------------------
# Groups: buffers of calls queued inside a group must outlive the group
# ---------------------------------------------------------------------------

_thread_group = threading.local()


def _group_state():
    state = _thread_group
    if not hasattr(state, "depth"):
        state.depth = 0
        state.pins = []
    return state


def _release_all(pins):
    for pinned in pins:
        if pinned is not None:
            pinned.release()


def _retire(pins):
    """After a blocking call returned successfully: inside a group the call
    only queued, so its buffers stay pinned until the group ends."""
    state = _group_state()
    if state.depth > 0:
        state.pins.extend(p for p in pins if p is not None)
    else:
        _release_all(pins)


def group_start():
    """Starts a group on this thread (prefer ``with rdist.group():``): calls
    until the matching :func:`group_end` only queue, and run together at the
    outermost end, so a rank can send to and receive from a peer without
    deadlock. Groups nest."""
    check(lib.rdist_group_start())
    _group_state().depth += 1


def group_end():
    """Ends a group; the outermost end runs every queued call, returns when
    all have completed and raises the first error."""
    state = _group_state()
    if state.depth == 0:
        raise InvalidUsageError("rdist.group_end() without a matching group_start()")
    state.depth -= 1
    code = lib.rdist_group_end()
    text = last_error_text() if code else ""
    if state.depth == 0:
        pins, state.pins = state.pins, []
        _release_all(pins)
    if code:
        raise error_for(code, text)


class group:  # noqa: N801 - used like a function: `with rdist.group():`
    """Context manager around :func:`group_start` / :func:`group_end`::

        with rdist.group():
            comm.send(mine, peer)
            comm.recv(theirs, peer)
        # both have completed here

    Blocking calls inside the block only queue; their buffers must not be
    modified until it ends (the binding keeps them alive). Non-blocking
    (``i*``) calls are refused inside a group by the library. If the block
    raises, the group is still ended (its queued calls run) and the block's
    exception propagates.
    """

    def __enter__(self):
        group_start()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            group_end()
        else:
            try:
                group_end()
            except Exception:  # noqa: BLE001 - the block's own error matters more
                pass
        return False


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


class Request:
    """A non-blocking operation in flight, returned by the ``i*`` methods.

    Holds references to its buffers until it completes, so temporaries are
    safe. :meth:`wait` blocks (bounded by ``timeout_ms``) and returns the
    output buffer; :meth:`test` polls. Use as a context manager to wait at the
    end of a block; an unwaited request waits when garbage collected.

    Calls on one communicator run in the order they were issued, except
    that non-blocking sends and receives are held until a request of the
    communicator is waited on or tested (or another call is made): then all
    held ones start together, so ``irecv`` before ``isend`` cannot deadlock.
    """

    def __init__(self, comm, handle, pins, result, what):
        self._comm = comm  # keeps the communicator alive while in flight
        self._handle = handle
        self._pins = pins
        self._result = result
        self._what = what
        self._error = None

    @property
    def done(self):
        """Whether the request is known to have completed (it never polls)."""
        return self._handle is None

    def _finish(self, code, text):
        handle, self._handle = self._handle, None
        lib.rdist_request_free(handle)
        _release_all(self._pins)
        self._pins = ()
        self._comm = None
        if code:
            self._error = error_for(code, text)

    def wait(self):
        """Blocks until the operation completes; returns its output buffer
        (``None`` for send and barrier) or raises its :class:`Error`."""
        if self._handle is not None:
            code = lib.rdist_wait(self._handle)
            self._finish(code, last_error_text() if code else "")
        if self._error is not None:
            raise self._error
        return self._result

    def test(self):
        """Never blocks: True once the operation has completed (raising its
        error if it failed), else False."""
        if self._handle is not None:
            done = ctypes.c_int(0)
            code = lib.rdist_test(self._handle, ctypes.byref(done))
            if code == 0 and not done.value:
                return False
            self._finish(code, last_error_text() if code else "")
        if self._error is not None:
            raise self._error
        return True

    def free(self):
        """Waits if still in flight and frees the request, discarding any
        error. Idempotent."""
        if self._handle is not None:
            self._finish(0, "")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.wait()
        else:
            self.free()
        return False

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self):
        state = "done" if self.done else "in flight"
        return f"<rdist.Request {self._what} {state}>"


def wait_all(requests):
    """Waits for every request (even after one failed); returns their
    outputs in order, or raises the first error."""
    first_error = None
    results = []
    for request in requests:
        try:
            results.append(request.wait())
        except Exception as error:  # noqa: BLE001 - re-raised below
            results.append(None)
            if first_error is None:
                first_error = error
    if first_error is not None:
        raise first_error
    return results


# ---------------------------------------------------------------------------
# Communicators
# ---------------------------------------------------------------------------


_ITEMSIZES = {d: d.itemsize for d in DType}


def _stream_of(pinned):
    """The CUDA stream a blocking call runs on: the one a device array's
    ``__cuda_array_interface__`` names (its data is valid there), else NULL
    (the legacy default stream; ignored for host buffers)."""
    for p in pinned:
        if p is not None and p.stream:
            return p.stream
    return None


class Comm:
    """A communicator: a group of ranks running collectives together.

    Create one with :func:`init` or :func:`init_rank` (or :meth:`split`).
    Every rank must call the same collectives in the same order. Buffers are
    numpy arrays or writable buffer-protocol objects, C-contiguous; the
    element type is inferred from them, or given as ``dtype=`` to reinterpret
    raw bits (e.g. a uint16 array holding bfloat16 values). Reductions take
    ``op`` as a name ("sum", "prod", "max", "min", "avg") or an :class:`Op`.

    Blocking methods return the output buffer. Each ``i``-prefixed twin
    returns a :class:`Request`. Use ``with rdist.init(...) as comm:`` or call
    :meth:`destroy`; a communicator still alive when garbage collected is
    destroyed then.

    One communicator is used by one thread at a time, except :meth:`abort`.
    """

    def __init__(self, handle, _parent=None):
        """Wraps a raw rdist_comm_t handle (use :func:`init` instead)."""
        self._handle = handle
        self._lock = threading.Lock()  # destroy vs. abort from another thread
        self._parent = _parent
        value = ctypes.c_int()
        check(lib.rdist_comm_rank(handle, ctypes.byref(value)))
        self._rank = value.value
        check(lib.rdist_comm_size(handle, ctypes.byref(value)))
        self._size = value.value
        check(lib.rdist_comm_local_rank(handle, ctypes.byref(value)))
        self._local_rank = value.value
        check(lib.rdist_comm_backend(handle, ctypes.byref(value)))
        self._backend = Backend(value.value)

    # -- properties ---------------------------------------------------------

    @property
    def rank(self):
        """This process's rank in the communicator (0 <= rank < size)."""
        return self._rank

    @property
    def size(self):
        """The number of ranks."""
        return self._size

    @property
    def local_rank(self):
        """This process's rank among the communicator's ranks on this host."""
        return self._local_rank

    @property
    def backend(self):
        """The :class:`Backend` in use (never AUTO); ``str()`` gives its name."""
        return self._backend

    @property
    def handle(self):
        """The raw ``rdist_comm_t*`` as an int, for passing to C code; 0 after
        :meth:`destroy`."""
        if self._handle is None:
            return 0
        return ctypes.cast(self._handle, ctypes.c_void_p).value or 0

    @property
    def destroyed(self):
        """Whether :meth:`destroy` has run."""
        return self._handle is None

    def _live_handle(self, what):
        handle = self._handle
        if handle is None:
            raise InvalidUsageError(f"{what}: the communicator was destroyed")
        return handle

    def __repr__(self):
        state = "destroyed" if self.destroyed else str(self._backend)
        return f"<rdist.Comm rank {self._rank} of {self._size} ({state})>"

    # -- lifecycle ----------------------------------------------------------

    def destroy(self):
        """Frees the communicator (local: needs no other rank). Queued
        non-blocking calls finish first; peers that later wait on this rank
        get :class:`PeerLostError`. Idempotent."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            check(lib.rdist_comm_destroy(handle))

    def _release(self):
        """Hands the raw handle (an int) over to its new owner (the
        compiled torch backend), which destroys it; this Comm is then
        destroyed as far as Python is concerned."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is None:
            raise InvalidUsageError("the communicator was destroyed")
        return ctypes.cast(handle, ctypes.c_void_p).value

    def failed_ranks(self):
        """The ranks this rank knows to have failed (their connection broke:
        they died or left, or their host or the network between failed), ascending.
        Safe to call from another thread, and after a call failed."""
        with self._lock:
            if self._handle is None:
                return []
            while True:
                count = ctypes.c_int(0)
                check(lib.rdist_comm_failed_ranks(self._handle, None, 0, ctypes.byref(count)))
                ranks = (ctypes.c_int * max(count.value, 1))()
                got = ctypes.c_int(0)
                check(
                    lib.rdist_comm_failed_ranks(
                        self._handle, ranks, count.value, ctypes.byref(got)
                    )
                )
                if got.value <= count.value:
                    return [ranks[i] for i in range(got.value)]

    def abort(self):
        """Makes every pending and future operation on this communicator, on
        every rank that can still be reached, fail promptly with
        :class:`AbortedError`. Safe to call from another thread while one is
        blocked in a collective. A no-op after :meth:`destroy`."""
        with self._lock:
            if self._handle is not None:
                check(lib.rdist_comm_abort(self._handle))

    def split(self, color, key=0):
        """Collective: ranks passing the same ``color`` form a new
        communicator, ordered by (``key``, old rank). ``color`` None (or
        :data:`SPLIT_NOCOLOR`) joins none and returns None."""
        handle = self._live_handle("split")
        color = SPLIT_NOCOLOR if color is None else operator.index(color)
        child = CommHandle()
        check(lib.rdist_comm_split(handle, color, operator.index(key), ctypes.byref(child)))
        return Comm(child, _parent=self) if child else None

    def shrink(self, exclude=None, flags=SHRINK_DEFAULT, **options):
        """A new communicator of this one's ranks but ``exclude`` and those
        that failed. Every rank that stays calls it; excluded and failed
        ranks do not. With ``exclude`` None (or empty) the survivors agree
        among themselves which ranks failed, whatever each had noticed, and
        leave exactly those out; the new ranks keep the old order. Works
        after a call failed with :class:`PeerLostError` (or the communicator
        was aborted, which is how one rank makes every other stop waiting on
        it); this communicator stays as it was, to destroy. ``flags``
        :data:`SHRINK_ABORT` aborts it first, ending its calls in flight.
        ``options``: ``timeout_ms`` bounds the shrink and the new
        communicator (default: this one's)."""
        handle = self._live_handle("shrink")
        ranks = [] if exclude is None else [operator.index(r) for r in exclude]
        bad = [r for r in ranks if not 0 <= r < self._size]
        if bad:
            raise InvalidArgumentError(
                f"Comm.shrink: exclude names {bad}, not ranks of 0..{self._size - 1}"
            )
        array = (ctypes.c_int * len(ranks))(*ranks) if ranks else None
        child = CommHandle()
        if options:
            with _Options(options) as opts:
                check(
                    lib.rdist_comm_shrink(
                        handle, array, len(ranks), ctypes.byref(child), opts, int(flags)
                    )
                )
        else:
            check(
                lib.rdist_comm_shrink(handle, array, len(ranks), ctypes.byref(child), None, int(flags))
            )
        return Comm(child, _parent=self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.destroy()
        return False

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - nothing to report to at collection time
            pass

    # -- plumbing -----------------------------------------------------------

    @staticmethod
    def _pin_all(method, specs):
        """Pins (name, object, writable) triples; None objects stay None.
        Argument errors are prefixed with the method name."""
        pins = {}
        try:
            for what, obj, writable in specs:
                pins[what] = None if obj is None else pin(obj, what, writable)
        except InvalidArgumentError as error:
            _release_all(pins.values())
            raise InvalidArgumentError(f"{method}: {error}") from None
        except TypeError as error:
            _release_all(pins.values())
            raise TypeError(f"{method}: {error}") from None
        except BaseException:
            _release_all(pins.values())
            raise
        return pins

    def _prepare(self, method, specs, dtype):
        """Pins the buffers and settles the dtype; returns (pins, DType)."""
        pins = self._pin_all(method, specs)
        try:
            return pins, common_dtype(pins, dtype)
        except InvalidArgumentError as error:
            _release_all(pins.values())
            raise InvalidArgumentError(f"{method}: {error}") from None

    def _count(self, method, pins, what, dtype):
        try:
            return element_count(pins[what], dtype, what)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{method}: {error}") from None

    def _expect_count(self, method, pins, what, dtype, expected, why):
        """Raises unless buffer ``what`` holds ``expected`` elements."""
        got = self._count(method, pins, what, dtype)
        if got != expected:
            raise InvalidArgumentError(
                f"{method}: {what} holds {got} {dtype} elements, but needs {expected} ({why})"
            )

    def _issue(self, base, nonblocking, args, pins, result):
        """Issues rdist_<base> (blocking) or rdist_i<base> (returning a
        Request) through the one call path (``_issue.issue``). ``args`` are
        the C arguments before the comm; pins are released, or handed to
        the request / the enclosing group."""
        pinned = list(pins.values())
        try:
            handle = self._handle
            if handle is None:
                self._live_handle(base)
            if nonblocking:
                order_after(pinned)
                request = issue(handle, base, args, True)
            else:
                issue(handle, base, args, False, _stream_of(pinned))
        except BaseException:
            _release_all(pinned)
            raise
        if nonblocking:
            return Request(self, request, pinned, result, base)
        _retire(pinned)
        return result

    @staticmethod
    def _address(pins, what):
        pinned = pins.get(what)
        return None if pinned is None else pinned.address

    # -- collectives --------------------------------------------------------

    def _allreduce(self, buf, op, out, dtype, nonblocking):
        method = "iallreduce" if nonblocking else "allreduce"
        op = resolve_op(op)
        pins, dtype = self._prepare(method, [("buf", buf, out is None), ("out", out, True)], dtype)
        try:
            count = self._count(method, pins, "buf", dtype)
            if out is not None:
                self._expect_count(method, pins, "out", dtype, count, "as many as buf")
        except BaseException:
            _release_all(pins.values())
            raise
        recv = "out" if out is not None else "buf"
        args = (pins["buf"].address, pins[recv].address, count, dtype, op)
        return self._issue("allreduce", nonblocking, args, pins, buf if out is None else out)

    def allreduce(self, buf, op="sum", out=None, *, dtype=None):
        """Element-wise ``op`` over every rank's ``buf``, into ``out`` or, when
        ``out`` is None, in place into ``buf``. Returns the result buffer."""
        if out is None and dtype is None:
            # The hot path (in place, inferred dtype, outside a group): no
            # pinning objects, for the smallest per-call overhead.
            found = fast_buffer(buf)
            if found is not None and self._handle is not None and not getattr(_thread_group, "depth", 0):
                address, nbytes, dtype = found
                args = (address, address, nbytes // _ITEMSIZES[dtype], dtype, resolve_op(op))
                issue(self._handle, "allreduce", args, False)
                return buf
        return self._allreduce(buf, op, out, dtype, False)

    def iallreduce(self, buf, op="sum", out=None, *, dtype=None):
        """Non-blocking :meth:`allreduce`; returns a :class:`Request`."""
        return self._allreduce(buf, op, out, dtype, True)

    def _broadcast(self, buf, root, out, dtype, nonblocking):
        method = "ibroadcast" if nonblocking else "broadcast"
        root = operator.index(root)
        if buf is None and out is None:
            raise InvalidArgumentError(f"{method}: buf is required")
        if buf is None and root == self._rank:
            raise InvalidArgumentError(f"{method}: the root needs buf (the data to send)")
        pins, dtype = self._prepare(
            method, [("buf", buf, out is None), ("out", out, True)], dtype
        )
        try:
            recv = "out" if out is not None else "buf"
            count = self._count(method, pins, recv, dtype)
            if out is not None and buf is not None:
                self._expect_count(method, pins, "buf", dtype, count, "as many as out")
        except BaseException:
            _release_all(pins.values())
            raise
        args = (self._address(pins, "buf"), pins[recv].address, count, dtype, root)
        return self._issue("broadcast", nonblocking, args, pins, buf if out is None else out)

    def broadcast(self, buf, root=0, out=None, *, dtype=None):
        """Copies ``buf`` of rank ``root`` to every rank: in place into
        ``buf``, or into ``out`` (then ``buf`` is only read, on the root, and
        may be None elsewhere). Returns the result buffer."""
        return self._broadcast(buf, root, out, dtype, False)

    def ibroadcast(self, buf, root=0, out=None, *, dtype=None):
        """Non-blocking :meth:`broadcast`; returns a :class:`Request`."""
        return self._broadcast(buf, root, out, dtype, True)

    def _reduce(self, buf, op, root, out, dtype, nonblocking):
        method = "ireduce" if nonblocking else "reduce"
        op = resolve_op(op)
        root = operator.index(root)
        is_root = root == self._rank
        pins, dtype = self._prepare(
            method,
            [("buf", buf, out is None and is_root), ("out", out, True)],
            dtype,
        )
        try:
            count = self._count(method, pins, "buf", dtype)
            if out is not None:
                self._expect_count(method, pins, "out", dtype, count, "as many as buf")
        except BaseException:
            _release_all(pins.values())
            raise
        if out is not None:
            recv = pins["out"].address
        else:
            # In place on the root; elsewhere there is no result to write
            # (NULL leaves the caller's buf untouched).
            recv = pins["buf"].address if is_root else None
        args = (pins["buf"].address, recv, count, dtype, op, root)
        return self._issue("reduce", nonblocking, args, pins, buf if out is None else out)

    def reduce(self, buf, op="sum", root=0, out=None, *, dtype=None):
        """Element-wise ``op`` over every rank's ``buf``, delivered on
        ``root`` only: into ``out``, or in place into the root's ``buf``
        (other ranks' ``buf`` is left as it was). Returns the result buffer
        (meaningful on the root)."""
        return self._reduce(buf, op, root, out, dtype, False)

    def ireduce(self, buf, op="sum", root=0, out=None, *, dtype=None):
        """Non-blocking :meth:`reduce`; returns a :class:`Request`."""
        return self._reduce(buf, op, root, out, dtype, True)

    def _allgather(self, send, out, dtype, nonblocking):
        method = "iallgather" if nonblocking else "allgather"
        pins, dtype = self._prepare(method, [("send", send, False), ("out", out, True)], dtype)
        try:
            count = self._count(method, pins, "send", dtype)
            self._expect_count(
                method, pins, "out", dtype, self._size * count,
                f"size * len(send) = {self._size} * {count}",
            )
        except BaseException:
            _release_all(pins.values())
            raise
        args = (pins["send"].address, pins["out"].address, count, dtype)
        return self._issue("allgather", nonblocking, args, pins, out)

    def allgather(self, send, out, *, dtype=None):
        """Every rank's ``send``, concatenated in rank order into ``out``
        (``size * len(send)`` elements). ``send`` may be ``out``'s own block
        ``rank`` (in place). Returns ``out``."""
        return self._allgather(send, out, dtype, False)

    def iallgather(self, send, out, *, dtype=None):
        """Non-blocking :meth:`allgather`; returns a :class:`Request`."""
        return self._allgather(send, out, dtype, True)

    def _reduce_scatter(self, send, out, op, dtype, nonblocking):
        method = "ireduce_scatter" if nonblocking else "reduce_scatter"
        op = resolve_op(op)
        pins, dtype = self._prepare(method, [("send", send, False), ("out", out, True)], dtype)
        try:
            count = self._count(method, pins, "out", dtype)
            self._expect_count(
                method, pins, "send", dtype, self._size * count,
                f"size * len(out) = {self._size} * {count}",
            )
        except BaseException:
            _release_all(pins.values())
            raise
        args = (pins["send"].address, pins["out"].address, count, dtype, op)
        return self._issue("reduce_scatter", nonblocking, args, pins, out)

    def reduce_scatter(self, send, out, op="sum", *, dtype=None):
        """Element-wise ``op`` over every rank's ``send`` (``size * len(out)``
        elements); rank r receives block r into ``out``. Returns ``out``."""
        return self._reduce_scatter(send, out, op, dtype, False)

    def ireduce_scatter(self, send, out, op="sum", *, dtype=None):
        """Non-blocking :meth:`reduce_scatter`; returns a :class:`Request`."""
        return self._reduce_scatter(send, out, op, dtype, True)

    def _gather(self, send, out, root, dtype, nonblocking):
        method = "igather" if nonblocking else "gather"
        root = operator.index(root)
        is_root = root == self._rank
        if is_root and out is None:
            raise InvalidArgumentError(f"{method}: the root (rank {root}) needs out")
        # Only the root's out is used: others' is neither checked nor written.
        pins, dtype = self._prepare(
            method, [("send", send, False), ("out", out if is_root else None, True)], dtype
        )
        try:
            count = self._count(method, pins, "send", dtype)
            if is_root:
                self._expect_count(
                    method, pins, "out", dtype, self._size * count,
                    f"size * len(send) = {self._size} * {count}",
                )
        except BaseException:
            _release_all(pins.values())
            raise
        args = (pins["send"].address, self._address(pins, "out"), count, dtype, root)
        return self._issue("gather", nonblocking, args, pins, out)

    def gather(self, send, out=None, root=0, *, dtype=None):
        """Every rank's ``send``, concatenated in rank order into ``out`` on
        ``root`` (``size * len(send)`` elements; other ranks may pass None).
        Returns ``out``."""
        return self._gather(send, out, root, dtype, False)

    def igather(self, send, out=None, root=0, *, dtype=None):
        """Non-blocking :meth:`gather`; returns a :class:`Request`."""
        return self._gather(send, out, root, dtype, True)

    def _scatter(self, send, out, root, dtype, nonblocking):
        method = "iscatter" if nonblocking else "scatter"
        root = operator.index(root)
        is_root = root == self._rank
        if is_root and send is None:
            raise InvalidArgumentError(f"{method}: the root (rank {root}) needs send")
        pins, dtype = self._prepare(
            method, [("send", send if is_root else None, False), ("out", out, True)], dtype
        )
        try:
            count = self._count(method, pins, "out", dtype)
            if is_root:
                self._expect_count(
                    method, pins, "send", dtype, self._size * count,
                    f"size * len(out) = {self._size} * {count}",
                )
        except BaseException:
            _release_all(pins.values())
            raise
        args = (self._address(pins, "send"), pins["out"].address, count, dtype, root)
        return self._issue("scatter", nonblocking, args, pins, out)

    def scatter(self, send, out, root=0, *, dtype=None):
        """Block r of ``send`` on ``root`` (``size * len(out)`` elements; other
        ranks may pass None) goes to rank r's ``out``. Returns ``out``."""
        return self._scatter(send, out, root, dtype, False)

    def iscatter(self, send, out, root=0, *, dtype=None):
        """Non-blocking :meth:`scatter`; returns a :class:`Request`."""
        return self._scatter(send, out, root, dtype, True)

    def _alltoall(self, send, out, dtype, nonblocking):
        method = "ialltoall" if nonblocking else "alltoall"
        pins, dtype = self._prepare(method, [("send", send, False), ("out", out, True)], dtype)
        try:
            total = self._count(method, pins, "send", dtype)
            if total % self._size:
                raise InvalidArgumentError(
                    f"{method}: send holds {total} {dtype} elements, not a multiple of "
                    f"the communicator size {self._size}"
                )
            self._expect_count(method, pins, "out", dtype, total, "as many as send")
        except BaseException:
            _release_all(pins.values())
            raise
        count = total // self._size
        args = (pins["send"].address, pins["out"].address, count, dtype)
        return self._issue("alltoall", nonblocking, args, pins, out)

    def alltoall(self, send, out, *, dtype=None):
        """Block j of ``send`` goes to rank j; block i of ``out`` comes from
        rank i (both hold ``size`` equal blocks). Returns ``out``."""
        return self._alltoall(send, out, dtype, False)

    def ialltoall(self, send, out, *, dtype=None):
        """Non-blocking :meth:`alltoall`; returns a :class:`Request`."""
        return self._alltoall(send, out, dtype, True)

    def barrier(self):
        """Returns when every rank has entered the barrier."""
        return self._issue("barrier", False, (), {}, None)

    def ibarrier(self):
        """Non-blocking :meth:`barrier`; returns a :class:`Request`."""
        return self._issue("barrier", True, (), {}, None)

    # -- point to point -----------------------------------------------------

    def _p2p(self, base, buf, peer, dtype, nonblocking):
        method = ("i" if nonblocking else "") + base
        peer = operator.index(peer)
        receiving = base == "recv"
        pins, dtype = self._prepare(method, [("buf", buf, receiving)], dtype)
        try:
            count = self._count(method, pins, "buf", dtype)
        except BaseException:
            _release_all(pins.values())
            raise
        args = (pins["buf"].address, count, dtype, peer)
        return self._issue(base, nonblocking, args, pins, buf if receiving else None)

    def send(self, buf, peer, *, dtype=None):
        """Sends ``buf`` to rank ``peer``, which must :meth:`recv` the same
        count and dtype. Returns when ``buf`` may be reused."""
        return self._p2p("send", buf, peer, dtype, False)

    def recv(self, buf, peer, *, dtype=None):
        """Receives from rank ``peer`` into ``buf``; returns ``buf``."""
        return self._p2p("recv", buf, peer, dtype, False)

    def isend(self, buf, peer, *, dtype=None):
        """Non-blocking :meth:`send`; returns a :class:`Request`."""
        return self._p2p("send", buf, peer, dtype, True)

    def irecv(self, buf, peer, *, dtype=None):
        """Non-blocking :meth:`recv`; returns a :class:`Request` whose
        ``wait()`` returns ``buf``."""
        return self._p2p("recv", buf, peer, dtype, True)
