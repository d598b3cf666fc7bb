"""rdist as a torch.distributed backend.

``import rdist.torch`` registers a backend named ``"rdist"``, so that
unchanged torch programs run on rdist::

    import torch.distributed as dist
    import rdist.torch  # noqa: F401  (registers the "rdist" backend)

    dist.init_process_group(backend="rdist")            # or "cpu:rdist,cuda:nccl"
    dist.all_reduce(tensor)

The backend rendezvouses through torch's own store (:func:`rdist.init_from_store`)
and is a pure-Python subclass of ``torch._C._distributed_c10d.Backend``: each
collective goes to librdist through the binding's one call path
(``rdist._issue``) with the tensors' data pointers. Calls whose options say
the caller waits at once (``opts.asyncOp`` False: torch.distributed's
``async_op=False``) run as rdist's blocking calls; every other call
(``async_op=True``, DDP's buckets, send/recv) runs as rdist's non-blocking
call and returns a :class:`Work` whose ``wait()`` waits in rdist with the
GIL released, and whose ``get_future()`` completes from rdist's completion
(a waiter thread per backend). What a C++ extension would add is in
bindings/python/README.md.
"""

import ctypes
import os
import threading
import warnings
import weakref
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from ._buffers import HAS_0_2, NEW_IN_0_2, DType, Op, torch_dtypes, torch_stream
from ._default import init_from_store
from ._errors import InvalidArgumentError, PeerLostError, UnavailableError, error_for, last_error_text
from ._issue import available, issue
from ._library import Status, lib, library_path

__all__ = [
    "BACKEND_NAME",
    "RdistBackend",
    "Work",
    "compiled_backend",
    "compiled_unavailable",
    "create_backend",
    "register",
]

#: The name ``init_process_group(backend=...)`` takes.
BACKEND_NAME = "rdist"

_RedOpType = dist.ReduceOp.RedOpType
_OPS = {
    _RedOpType.SUM: Op.SUM,
    _RedOpType.AVG: Op.AVG,
    _RedOpType.PRODUCT: Op.PROD,
    _RedOpType.MIN: Op.MIN,
    _RedOpType.MAX: Op.MAX,
    _RedOpType.BAND: 64,
    _RedOpType.BOR: 65,
    _RedOpType.BXOR: 66,
}
_BITWISE = {_RedOpType.BAND, _RedOpType.BOR, _RedOpType.BXOR}
_PREMUL_SUM = _RedOpType.PREMUL_SUM

_wait, _free = lib.rdist_wait, lib.rdist_request_free
_byref = ctypes.byref


def _caller_waits(opts):
    """Whether the caller waits for the call at once (torch.distributed
    with ``async_op=False`` says so in the options), so that rdist's
    blocking call, which runs on the calling thread, is the cheaper one.
    Anything else (C++ callers such as DDP's reducer, ``async_op=True``,
    options without the field) gets the non-blocking call."""
    return getattr(opts, "asyncOp", True) is False


def _dtype(tensor, moving_only):
    """(rdist dtype, elements per tensor element) of a tensor. Types the
    loaded library lacks move as bytes when the call only moves data."""
    found = torch_dtypes().get(tensor.dtype)
    if found is None:
        if moving_only:
            return DType.UINT8, tensor.element_size()
        raise InvalidArgumentError(f"rdist has no reduction for {tensor.dtype} tensors")
    if found in NEW_IN_0_2 and not HAS_0_2:
        if moving_only:
            return DType.UINT8, tensor.element_size()
        raise UnavailableError(
            f"reductions on {tensor.dtype} tensors need librdist 0.2 (RDIST_BOOL/INT16/UINT16)"
        )
    return found, 1


def _flat(tensor, what):
    """A tensor as dense memory rdist can use: complex as its real pairs."""
    if tensor.layout is not torch.strided:
        raise InvalidArgumentError(f"rdist: {what} is {tensor.layout}; only dense tensors")
    if not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"rdist: {what} (shape {tuple(tensor.shape)}, strides {tensor.stride()}) is not "
            "contiguous; pass .contiguous() and copy the result back"
        )
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"rdist: {what} is on {tensor.device}; CPU and CUDA only")
    return tensor


class _StreamOf:
    """What rdist._streams.order_after takes: an object with .stream."""

    __slots__ = ("stream",)

    def __init__(self, stream):
        self.stream = stream


def _order_after(tensors):
    cuda = [t for t in tensors if t is not None and t.is_cuda]
    if cuda:
        from ._streams import order_after

        order_after([_StreamOf(torch_stream(t)) for t in cuda])


def _stream(tensor):
    return torch_stream(tensor) if tensor.is_cuda else None


class Work(dist._Work):
    """A call in flight on rdist (or already complete).

    ``wait()`` blocks in ``rdist_wait`` (ctypes releases the GIL) and then
    runs any copy-out; ``get_future()`` returns a ``torch.futures.Future``
    completed from rdist's completion by the backend's waiter thread, with
    the output tensors as its value. ``source_rank`` is the sender of a
    receive (after completion)."""

    def __init__(self, backend, requests, result, keep=None, post=None, status=None):
        super().__init__()
        self._backend = backend
        self._requests = requests  # list of RequestHandle, or None when complete
        self._result = result
        self._keep = keep  # buffers rdist uses until completion
        self._post = post  # run after success (copy-out), on the completing thread
        self._status = status  # (Status, RequestHandle) of a receive
        self._future = None
        self._error = None
        self._lock = threading.Lock()
        self.source_rank = -1
        if requests is None and post is not None:
            post()
            self._post = None

    def _complete(self):
        """Waits for the requests (once, on whichever thread comes first),
        then marks the future outside the lock."""
        with self._lock:
            requests = self._requests
            if requests is None:
                return
            error = None
            for request in requests:
                code = _wait(request)
                if code and error is None:
                    error = error_for(code, last_error_text())
            if error is None and self._status is not None:
                status, request = self._status
                if lib.rdist_request_status(request, _byref(status)) == 0:
                    self.source_rank = status.source
            for request in requests:
                _free(request)
            self._requests = None
            self._keep = None
            if error is None and self._post is not None:
                try:
                    self._post()
                except Exception as exc:  # noqa: BLE001 - reported through wait/future
                    error = exc
            self._post = None
            self._error = error
            future = self._future
        if future is not None:
            self._mark(future)

    def _mark(self, future):
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._result)

    def wait(self, timeout=None):  # noqa: ARG002 - rdist's own timeout_ms bounds it
        self._complete()
        if self._error is not None:
            raise self._error
        return True

    def get_future(self):
        with self._lock:
            future = self._future
            if future is None:
                future = self._future = torch.futures.Future()
                if self._requests is None:
                    self._mark(future)
                else:
                    self._backend._watch(self)
        return future

    def is_completed(self):
        with self._lock:
            return self._requests is None

    def is_success(self):
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return self._result

    def __del__(self):
        try:
            self._complete()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class RdistBackend(_C10dBackend):
    """torch.distributed backend on an rdist communicator (:class:`rdist.Comm`)."""

    def __init__(self, comm, rank, size):
        super().__init__(rank, size)
        self.comm = comm
        self._handle = comm._handle
        self._rank = rank
        self._size = size
        self._queue = deque()
        self._queue_changed = threading.Condition()
        self._waiter = None
        self._closed = False

    def getBackendName(self):  # noqa: N802 - torch's name
        return BACKEND_NAME

    # Capabilities torch asks for as properties. Defined here because the
    # inherited C++ ones ask the Python object again (endless recursion in
    # a Python subclass that does not override them).
    @property
    def supports_coalescing(self):
        return False

    @property
    def supports_splitting(self):
        return False

    @property
    def supports_shrinking(self):
        return True

    @property
    def supports_reconfigure(self):
        return False

    @property
    def supports_window(self):
        return False

    @property
    def _supports_time_estimate(self):
        return False

    # -- completion ----------------------------------------------------------

    def _watch(self, work):
        with self._queue_changed:
            self._queue.append(work)
            if self._waiter is None:
                self._waiter = threading.Thread(
                    target=self._wait_loop, name=f"rdist-waiter-{self._rank}", daemon=True
                )
                self._waiter.start()
            self._queue_changed.notify()

    def _wait_loop(self):
        while True:
            with self._queue_changed:
                while not self._queue:
                    if self._closed:
                        return
                    self._queue_changed.wait()
                work = self._queue.popleft()
            work._complete()

    def _drain(self):
        with self._queue_changed:
            self._closed = True
            self._queue_changed.notify()
            waiter = self._waiter
        if waiter is not None and waiter is not threading.current_thread():
            waiter.join()

    def shutdown(self):
        self._drain()
        self.comm.destroy()

    def abort(self):
        self.comm.abort()

    def shrink(self, ranks_to_exclude, shrink_flags=0, opts_override=None):
        """torch.distributed.shrink_group's call (``supports_shrinking``): a
        backend on the survivors (:meth:`rdist.Comm.shrink`): every rank of
        this one but ``ranks_to_exclude`` (this group's ranks) and any other
        that failed, which the survivors find out and agree on among
        themselves. Needs no store (the store's host may be the rank that
        died). ``shrink_flags`` SHRINK_ABORT aborts this backend's calls in
        flight first; ``opts_override``'s timeout, when set, bounds the
        shrink and the new backend."""
        options = {}
        timeout = getattr(opts_override, "_timeout", None)
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            options["timeout_ms"] = int(timeout.total_seconds() * 1000)
        excluded = list(ranks_to_exclude)
        child = self.comm.shrink(excluded, int(shrink_flags), **options)
        if child.size != self._size - len(excluded):
            # torch numbers the new group from ranks_to_exclude alone: a
            # rank that also failed would leave its numbering wrong.
            lost = sorted(set(self.comm.failed_ranks()) - set(excluded))
            child.destroy()
            raise PeerLostError(
                f"rdist: shrink_group left out more ranks than ranks_to_exclude {excluded} "
                f"(the survivors found {self._size - child.size} failed; this rank knows of "
                f"{lost or 'none beyond the list'}): pass every failed rank, e.g. the backend's "
                "failed_ranks() after a barrier that failed"
            )
        return RdistBackend(child, child.rank, child.size)

    def failed_ranks(self):
        """The ranks of this group that this rank knows failed (for
        ``shrink_group``'s ``ranks_to_exclude``)."""
        return self.comm.failed_ranks()

    # -- issuing ---------------------------------------------------------------

    def _run(self, base, args, opts, result, keep, post=None, stream=None):
        """Issues one call: blocking when torch waits at once, else
        non-blocking (a Work to wait on)."""
        if _caller_waits(opts):
            issue(self._handle, base, args, False, stream)
            return Work(self, None, result, post=post)
        if stream is not None:
            _order_after(keep)
        request = issue(self._handle, base, args, True)
        return Work(self, [request], result, keep, post)

    def _many(self, issued, result, keep, post=None):
        """One Work for several non-blocking calls issued here."""
        requests = []
        try:
            for base, args in issued:
                requests.append(issue(self._handle, base, args, True))
        except BaseException:
            for request in requests:
                _free(request)
            raise
        return Work(self, requests, result, keep, post)

    @staticmethod
    def _op(opts, tensor):
        """(rdist op, input to use) for a ReduceOp; PREMUL_SUM scales a copy."""
        red = opts.reduceOp
        kind = red.op
        if kind == _PREMUL_SUM:
            factor = red.factor if hasattr(red, "factor") else None
            return Op.SUM, factor
        found = _OPS.get(kind)
        if found is None:
            raise InvalidArgumentError(f"rdist: unsupported reduction {kind}")
        if kind in _BITWISE and not HAS_0_2:
            raise UnavailableError(f"ReduceOp.{kind.name} needs librdist 0.2 (RDIST_BAND/BOR/BXOR)")
        return found, None

    # -- collectives -----------------------------------------------------------

    def allreduce(self, tensors, opts):
        op, factor = self._op(opts, tensors[0])
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        tensor = _flat(tensors[0], "tensor")
        if factor is not None:
            tensor.mul_(factor)
        dtype, scale = _dtype(tensor, False)
        ptr = tensor.data_ptr()
        args = (ptr, ptr, tensor.numel() * scale, dtype, op)
        return self._run("allreduce", args, opts, tensors, [tensor], stream=_stream(tensor))

    def allreduce_coalesced(self, tensors, opts):
        op, factor = self._op(opts, tensors[0])
        issued, flats = [], []
        for tensor in tensors:
            flat = _flat(tensor, "tensor")
            if factor is not None:
                flat.mul_(factor)
            dtype, scale = _dtype(flat, False)
            ptr = flat.data_ptr()
            issued.append(("allreduce", (ptr, ptr, flat.numel() * scale, dtype, op)))
            flats.append(flat)
        _order_after(flats)
        return self._many(issued, tensors, flats)

    def broadcast(self, tensors, opts):
        root = opts.rootRank
        issued, flats = [], []
        for tensor in tensors:
            flat = _flat(tensor, "tensor")
            dtype, scale = _dtype(flat, True)
            ptr = flat.data_ptr()
            issued.append((ptr, ptr, flat.numel() * scale, dtype, root))
            flats.append(flat)
        if len(issued) == 1:
            return self._run("broadcast", issued[0], opts, tensors, flats,
                             stream=_stream(flats[0]))
        _order_after(flats)
        return self._many([("broadcast", a) for a in issued], tensors, flats)

    def reduce(self, tensors, opts):
        op, factor = self._op(opts, tensors[0])
        tensor = _flat(tensors[0], "tensor")
        send = tensor
        if factor is not None:
            send = tensor * factor
        dtype, scale = _dtype(tensor, False)
        recv = tensor.data_ptr() if self._rank == opts.rootRank else None
        args = (send.data_ptr(), recv, tensor.numel() * scale, dtype, op, opts.rootRank)
        return self._run("reduce", args, opts, tensors, [tensor, send], stream=_stream(tensor))

    def _gather_into(self, inputs, outputs, what):
        """A flat output for ``outputs`` (list of equal tensors): itself
        when they already are consecutive blocks of one buffer, else a
        temporary and a copy-out."""
        first = outputs[0]
        step = first.numel() * first.element_size()
        consecutive = all(
            o.is_contiguous() and o.dtype == first.dtype and o.numel() == first.numel()
            and o.data_ptr() == first.data_ptr() + i * step and o.device == first.device
            for i, o in enumerate(outputs)
        )
        if consecutive and first.numel():
            flat = first.view(-1)
            base = torch.as_strided(flat, (len(outputs) * first.numel(),), (1,))
            return base, None
        for o in outputs:
            if o.numel() != inputs.numel() or o.dtype != inputs.dtype:
                raise InvalidArgumentError(
                    f"rdist {what}: every output must match the input ({inputs.numel()} x "
                    f"{inputs.dtype}); uneven sizes are not supported"
                )
        temp = torch.empty((len(outputs), *inputs.shape), dtype=inputs.dtype, device=inputs.device)

        def post():
            for o, block in zip(outputs, temp):
                o.copy_(block)

        return temp, post

    def allgather(self, output_tensors, input_tensors, opts):
        if len(input_tensors) != 1:
            return self.allgather_coalesced(output_tensors, input_tensors, opts)
        inp = _flat(input_tensors[0], "input")
        out, post = self._gather_into(inp, output_tensors[0], "allgather")
        out = _flat(out, "output")
        dtype, scale = _dtype(inp, True)
        args = (inp.data_ptr(), out.data_ptr(), inp.numel() * scale, dtype)
        return self._run("allgather", args, opts, output_tensors, [inp, out], post,
                         stream=_stream(inp))

    def allgather_coalesced(self, output_lists, input_tensors, opts):
        """``output_lists`` is [rank][tensor], as torch passes it:
        ``output_lists[r][j]`` receives rank r's ``input_tensors[j]``. The
        inputs go as one all_gather of their concatenation."""
        n = self._size
        if len(output_lists) != n or any(len(lst) != len(input_tensors) for lst in output_lists):
            raise InvalidArgumentError(
                f"rdist all_gather_coalesced: needs {n} output lists (one per rank) of "
                f"{len(input_tensors)} tensors (one per input)"
            )
        first = input_tensors[0]
        for j, inp in enumerate(input_tensors):
            if inp.dtype != first.dtype or inp.device != first.device:
                raise InvalidArgumentError("rdist all_gather_coalesced: inputs differ in dtype or device")
            for lst in output_lists:
                if lst[j].numel() != inp.numel() or lst[j].dtype != inp.dtype:
                    raise InvalidArgumentError(
                        f"rdist all_gather_coalesced: output for input {j} must have its "
                        f"{inp.numel()} x {inp.dtype}"
                    )
        send = _flat(torch.cat([t.reshape(-1) for t in input_tensors]), "input")
        gathered = torch.empty((n, *send.shape), dtype=send.dtype, device=send.device)
        dtype, scale = _dtype(send, True)

        def post():
            rows = torch.view_as_complex(gathered) if first.is_complex() else gathered
            for r, lst in enumerate(output_lists):
                offset = 0
                for out in lst:
                    out.copy_(rows[r][offset:offset + out.numel()].view(out.shape))
                    offset += out.numel()

        args = (send.data_ptr(), gathered.data_ptr(), send.numel() * scale, dtype)
        return self._run("allgather", args, opts, output_lists, [send, gathered], post,
                         stream=_stream(send))

    def all_gather_single(self, output, input, opts):  # noqa: A002 - torch's name
        inp = _flat(input, "input")
        out = _flat(output, "output")
        if out.numel() != inp.numel() * self._size:
            raise InvalidArgumentError(
                f"rdist all_gather_into_tensor: output has {out.numel()} elements, needs "
                f"{self._size} x {inp.numel()}"
            )
        dtype, scale = _dtype(inp, True)
        args = (inp.data_ptr(), out.data_ptr(), inp.numel() * scale, dtype)
        return self._run("allgather", args, opts, [output], [inp, out], stream=_stream(inp))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        issued, keep = [], []
        for output, inp in zip(outputs, inputs):
            inp, out = _flat(inp, "input"), _flat(output, "output")
            dtype, scale = _dtype(inp, True)
            issued.append(("allgather", (inp.data_ptr(), out.data_ptr(), inp.numel() * scale, dtype)))
            keep += [inp, out]
        _order_after(keep)
        return self._many(issued, outputs, keep)

    def gather(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        inp = _flat(input_tensors[0], "input")
        dtype, scale = _dtype(inp, True)
        out, post = None, None
        if self._rank == root:
            out, post = self._gather_into(inp, output_tensors[0], "gather")
        args = (inp.data_ptr(), None if out is None else out.data_ptr(), inp.numel() * scale, dtype, root)
        return self._run("gather", args, opts, output_tensors, [inp, out], post, stream=_stream(inp))

    def scatter(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        out = _flat(output_tensors[0], "output")
        dtype, scale = _dtype(out, True)
        send = None
        if self._rank == root:
            send = torch.cat([_flat(t, "input").reshape(-1) for t in input_tensors[0]])
            if send.numel() != out.numel() * self._size:
                raise InvalidArgumentError(
                    f"rdist scatter: the root's inputs hold {send.numel()} elements, need "
                    f"{self._size} x {out.numel()}"
                )
        args = (None if send is None else send.data_ptr(), out.data_ptr(), out.numel() * scale, dtype, root)
        return self._run("scatter", args, opts, output_tensors, [send, out], stream=_stream(out))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        op, factor = self._op(opts, output_tensors[0])
        out = _flat(output_tensors[0], "output")
        send = torch.cat([t.reshape(-1) for t in input_tensors[0]])
        if factor is not None:
            send.mul_(factor)
        send = _flat(send, "input")
        dtype, scale = _dtype(out, False)
        args = (send.data_ptr(), out.data_ptr(), out.numel() * scale, dtype, op)
        return self._run("reduce_scatter", args, opts, output_tensors, [send, out],
                         stream=_stream(out))

    def reduce_scatter_single(self, output, input, opts):  # noqa: A002 - torch's name
        op, factor = self._op(opts, output)
        out = _flat(output, "output")
        send = _flat(input, "input")
        if factor is not None:
            send = send * factor
        if send.numel() != out.numel() * self._size:
            raise InvalidArgumentError(
                f"rdist reduce_scatter_tensor: input has {send.numel()} elements, needs "
                f"{self._size} x {out.numel()}"
            )
        dtype, scale = _dtype(out, False)
        args = (send.data_ptr(), out.data_ptr(), out.numel() * scale, dtype, op)
        return self._run("reduce_scatter", args, opts, [output], [send, out],
                         stream=_stream(out))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _AllOf(self, works, outputs)

    def _alltoallv(self, send, send_counts, recv, recv_counts, dtype, opts, result, keep, post=None):
        if not available("alltoallv"):
            raise UnavailableError(
                "uneven all_to_all needs librdist 0.2 (rdist_alltoallv); this library lacks it"
            )
        n = self._size
        counts = (ctypes.c_size_t * n)
        sc, rc = counts(*send_counts), counts(*recv_counts)
        sd, rd = counts(), counts()
        for i in range(1, n):
            sd[i] = sd[i - 1] + sc[i - 1]
            rd[i] = rd[i - 1] + rc[i - 1]
        args = (send.data_ptr(), sc, sd, recv.data_ptr(), rc, rd, dtype)
        # The blocking call reads the count arrays during the call only and
        # the non-blocking one copies them (docs/api.md), so they may go.
        return self._run("alltoallv", args, opts, result, keep, post, stream=_stream(send))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):  # noqa: A002
        out, inp = _flat(output, "output"), _flat(input, "input")
        n = self._size
        dtype, scale = _dtype(inp, True)
        if not output_split_sizes and not input_split_sizes:
            if inp.numel() % n or out.numel() != inp.numel():
                raise InvalidArgumentError(
                    f"rdist all_to_all_single: {inp.numel()} input / {out.numel()} output "
                    f"elements do not split evenly over {n} ranks"
                )
            args = (inp.data_ptr(), out.data_ptr(), inp.numel() // n * scale, dtype)
            return self._run("alltoall", args, opts, [output], [inp, out], stream=_stream(inp))
        row_in = inp.numel() // max(1, inp.shape[0]) if inp.dim() else 1
        row_out = out.numel() // max(1, out.shape[0]) if out.dim() else 1
        in_splits = list(input_split_sizes) or [inp.shape[0] // n] * n
        out_splits = list(output_split_sizes) or [out.shape[0] // n] * n
        return self._alltoallv(
            inp, [s * row_in * scale for s in in_splits], out,
            [s * row_out * scale for s in out_splits], dtype, opts, [output], [inp, out],
        )

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts):
        first = _flat(input_tensors[0], "input")
        dtype, scale = _dtype(first, True)
        send = torch.cat([_flat(t, "input").reshape(-1) for t in input_tensors])
        sizes_in = [t.numel() for t in input_tensors]
        sizes_out = [t.numel() for t in output_tensors]
        recv = torch.empty(sum(sizes_out), dtype=first.dtype, device=first.device)
        recv_flat = _flat(recv, "output")
        send_flat = _flat(send, "input")

        def post():
            offset = 0
            for t, k in zip(output_tensors, sizes_out):
                t.copy_(recv[offset:offset + k].view(t.shape))
                offset += k

        # The v-form whenever the library has it: every rank must make the
        # same call, whatever its own sizes look like.
        if not available("alltoallv"):
            args = (send_flat.data_ptr(), recv_flat.data_ptr(), send_flat.numel() // self._size * scale, dtype)
            return self._run("alltoall", args, opts, output_tensors, [send_flat, recv_flat], post,
                             stream=_stream(send_flat))
        per = 2 if first.is_complex() else 1
        return self._alltoallv(
            send_flat, [k * per * scale for k in sizes_in], recv_flat,
            [k * per * scale for k in sizes_out], dtype, opts, output_tensors, [send_flat, recv_flat],
            post,
        )

    def barrier(self, opts):
        return self._run("barrier", (), opts, [], [])

    def monitored_barrier(self, opts, wait_all_ranks=False):
        # rdist's barrier is bounded by timeout_ms and names the ranks it
        # waited for when it times out.
        issue(self._handle, "barrier", (), False)

    # -- point to point ----------------------------------------------------------

    def _p2p(self, tensors, peer, tag, receiving):
        tensor = _flat(tensors[0], "tensor")
        dtype, scale = _dtype(tensor, True)
        count = tensor.numel() * scale
        status = None
        if available("send_tagged"):
            base = "recv_tagged" if receiving else "send_tagged"
            request = issue(self._handle, base, (tensor.data_ptr(), count, dtype, peer, tag), True)
            if receiving:
                status = (Status(), request)
        elif tag == 0 and peer >= 0:
            base = "recv" if receiving else "send"
            request = issue(self._handle, base, (tensor.data_ptr(), count, dtype, peer), True)
        else:
            raise UnavailableError(
                "tagged send/recv and receiving from any source need librdist 0.2 "
                "(rdist_send_tagged/rdist_recv_tagged); this library lacks them"
            )
        work = Work(self, [request], tensors, [tensor], status=status)
        if receiving and peer >= 0:
            work.source_rank = peer
        return work

    def send(self, tensors, dst_rank, tag):
        return self._p2p(tensors, dst_rank, tag, False)

    def recv(self, tensors, src_rank, tag):
        return self._p2p(tensors, src_rank, tag, True)

    def recv_anysource(self, tensors, tag):
        return self._p2p(tensors, -1, tag, True)  # RDIST_ANY_SOURCE


class _AllOf(Work):
    """One Work over several."""

    def __init__(self, backend, works, result):
        super().__init__(backend, None, result)
        self._works = works

    def wait(self, timeout=None):
        for work in self._works:
            work.wait()
        return True

    def get_future(self):
        futures = [w.get_future() for w in self._works]
        result = self._result
        return torch.futures.collect_all(futures).then(lambda _: result)


def _python_backend_refused():
    """Why this torch does not let Python subclass its c10d ``Backend``
    (torch 2.11, seen on the GPU image, binds it with no constructor:
    pybind's bare "No constructor defined!"), or None when it does."""

    class _Probe(_C10dBackend):
        pass

    try:
        _Probe(0, 1)
    except TypeError as error:
        return str(error)
    return None


_compiled = None  # the compiled backend's module, False where it cannot be had
_compiled_why = None
_shared = None  # (store, rank, size, backend) of the last group made


def _choice():
    """RDIST_TORCH_BACKEND: "compiled", "python", or unset (compiled where
    it can be built, else Python)."""
    choice = os.environ.get("RDIST_TORCH_BACKEND", "").strip().lower() or "auto"
    if choice not in ("auto", "compiled", "python"):
        raise InvalidArgumentError(
            f"RDIST_TORCH_BACKEND={choice!r}: use compiled, python, or leave it unset"
        )
    return choice


def compiled_backend():
    """The compiled backend's module (rdist/csrc, built for this torch on
    first use and cached; see rdist._extension), or None where it cannot
    be built here (:data:`compiled_unavailable` says why)."""
    global _compiled, _compiled_why
    if _compiled is None:
        from . import _extension

        try:
            _compiled = _extension.load()
        except _extension.BuildError as error:
            _compiled, _compiled_why = False, str(error)
    return _compiled or None


def compiled_unavailable():
    """Why the compiled backend is not in use (None when it is)."""
    return _compiled_why


def _timeout_ms(timeout):
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return int(timeout.total_seconds() * 1000)
    return None


def create_backend(store, rank, size, timeout):
    """The creator torch.distributed calls (``register_backend``): an rdist
    communicator made through torch's store, bounded by torch's timeout,
    under the compiled backend (the pure-Python one where nothing can be
    compiled). torch calls it once per device type of a group ("cpu",
    "cuda"): both get the one backend."""
    global _shared
    underlying = getattr(store, "underlying_store", None)
    if _shared is not None and underlying is not None and _shared[0] is underlying \
            and _shared[1:3] == (rank, size):
        backend = _shared[3]()
        _shared = None
        if backend is not None:
            return backend
    choice = _choice()
    module = compiled_backend() if choice != "python" else None
    if module is None and choice == "compiled":
        raise UnavailableError(f"rdist.torch: the compiled backend is unavailable: {_compiled_why}")
    if module is None:
        refused = _python_backend_refused()
        if refused:
            # Before the rendezvous, so that no communicator is left behind.
            raise UnavailableError(
                f"rdist.torch: the compiled backend could not be built ({_compiled_why}), and "
                f"torch {torch.__version__} does not let Python subclass its c10d Backend "
                f"({refused}), so the pure-Python fallback cannot run either"
            )
        if choice == "auto":
            warnings.warn(
                f"rdist.torch: using the pure-Python backend: the compiled one could not be "
                f"built ({_compiled_why}). Install a C++ compiler and run "
                "`python -m rdist.torch_build` for the compiled backend.",
                RuntimeWarning,
                stacklevel=2,
            )
    timeout_ms = _timeout_ms(timeout)
    comm = init_from_store(store, rank, size, prefix="rdist", timeout_ms=timeout_ms)
    if module is not None:
        backend = module.RdistBackend(library_path, comm._release(), timeout_ms or 1_800_000)
    else:
        backend = RdistBackend(comm, rank, size)
    # Weakly: the group owns its backend, this only lets its next device
    # type find it.
    _shared = (underlying, rank, size, _weak(backend)) if underlying is not None else None
    return backend


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


# -- torch's recv(src=None) asks the Work for the source rank, which a Python
#    backend cannot answer through torch's C++ Work wrapper (it forwards only
#    wait and get_future); for rdist groups it is answered here.
_torch_recv = dist.distributed_c10d.recv


def _recv(tensor, src=None, group=None, tag=0, **more):
    if src is None and more.get("group_src") is None:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        try:
            backend = pg._get_backend(tensor.device)
        except RuntimeError:
            backend = None
        if isinstance(backend, RdistBackend):
            work = backend.recv_anysource([tensor], tag)
            work.wait()
            return dist.get_global_rank(pg, work.source_rank)
    return _torch_recv(tensor, src=src, group=group, tag=tag, **more)


_recv.__doc__ = _torch_recv.__doc__
_recv.__wrapped__ = _torch_recv


def register():
    """Registers the "rdist" backend with torch.distributed (idempotent;
    importing this module does it). torch calls it through the
    ``torch.distributed.backends`` entry point of an installed rdist."""
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.Backend.register_backend(BACKEND_NAME, create_backend, devices=["cpu", "cuda"])
    dist.distributed_c10d.recv = _recv
    dist.recv = _recv


register()
