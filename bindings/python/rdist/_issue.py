"""The one path every call takes into librdist, whoever makes it
(:class:`rdist.Comm`, the module's default group, ``rdist.torch``): the C
function of the operation, blocking or not; its arguments, already
resolved to addresses, counts and rdist enums; the CUDA stream a blocking
call's device buffers are ordered on; the result code turned into the
rdist exception. Callers pin their buffers and settle the dtype first
(``_buffers``); this module only issues.
"""

import ctypes

from ._errors import error_for, last_error_text
from ._library import RequestHandle, Status, has, lib

__all__ = ["check", "issue", "issue_recv_status", "available"]

_byref = ctypes.byref

# The operations and their C functions: blocking ones take the caller's
# stream last (barrier takes none), non-blocking ones a request.
_BASES = (
    "allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather",
    "scatter", "alltoall", "barrier", "send", "recv",
    # Since 0.2 (see _library.OPTIONAL).
    "send_tagged", "recv_tagged", "allgatherv", "alltoallv",
)
_BLOCKING = {b: getattr(lib, f"rdist_{b}") for b in _BASES if has(f"rdist_{b}")}
_NONBLOCKING = {b: getattr(lib, f"rdist_i{b}") for b in _BASES if has(f"rdist_i{b}")}
_BARRIER, _IBARRIER = lib.rdist_barrier, lib.rdist_ibarrier


def available(base):
    """Whether the loaded library has operation ``base`` (both forms)."""
    return base in _BLOCKING and base in _NONBLOCKING


def check(code):
    """Raises the rdist error for a non-zero result code."""
    if code:
        raise error_for(code, last_error_text())


def issue(handle, base, args, nonblocking, stream=None):
    """Runs ``rdist_<base>(*args, comm, stream)`` and returns None, or
    ``rdist_i<base>(*args, comm, &request)`` and returns the request
    handle. ``args`` are the C arguments before the communicator;
    ``stream`` orders a blocking call's device buffers (None: the legacy
    default stream; host buffers ignore it)."""
    if nonblocking:
        request = RequestHandle()
        if base == "barrier":
            code = _IBARRIER(handle, _byref(request))
        else:
            code = _NONBLOCKING[base](*args, handle, _byref(request))
        if code:
            check(code)
        return request
    if base == "barrier":
        code = _BARRIER(handle)
    else:
        code = _BLOCKING[base](*args, handle, stream)
    if code:
        check(code)
    return None


def issue_recv_status(handle, args, stream=None):
    """The blocking tagged receive, which also says who sent what:
    ``rdist_recv_tagged(*args, comm, stream, &status)``; returns the
    status."""
    status = Status()
    check(_BLOCKING["recv_tagged"](*args, handle, stream, _byref(status)))
    return status
