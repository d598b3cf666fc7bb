"""Orders a non-blocking call's device work after the streams its arrays
name. The C library's non-blocking calls take no stream: their device work
runs on the legacy default stream, which does not wait for streams created
non-blocking (PyTorch's and CuPy's side streams). A device array's
``__cuda_array_interface__`` stream is where its data becomes valid, so
the default stream is made to wait for it first (an event, no host wait)."""

import ctypes

from ._errors import BackendError

# Version 3 of the interface: 1 is the legacy default stream itself (no
# wait needed); 2 is the per-thread default stream.
_LEGACY_DEFAULT = 1
_EVENT_DISABLE_TIMING = 2

_driver = None


def _cuda():
    """The CUDA driver this process already loaded (device arrays exist)."""
    global _driver
    if _driver is None:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        cuda.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        cuda.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        cuda.cuEventDestroy_v2.argtypes = [ctypes.c_void_p]
        cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        _driver = cuda
    return _driver


def _ok(rc, what, stream):
    if rc != 0:
        raise BackendError(
            f"ordering a non-blocking call after stream {stream:#x}: {what} failed (CUresult {rc})"
        )


def order_after(pinned):
    """Makes the legacy default stream wait for every stream the pinned
    device arrays name. Without a current context (needed for an event),
    waits for those streams on the host instead."""
    streams = []
    for p in pinned:
        if p is not None and p.stream and p.stream != _LEGACY_DEFAULT and p.stream not in streams:
            streams.append(p.stream)
    if not streams:
        return
    cuda = _cuda()
    for stream in streams:
        event = ctypes.c_void_p()
        if cuda.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING) != 0:
            _ok(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize", stream)
            continue
        try:
            _ok(cuda.cuEventRecord(event, stream), "cuEventRecord", stream)
            _ok(cuda.cuStreamWaitEvent(None, event, 0), "cuStreamWaitEvent", stream)
        finally:
            # Freed once the wait is satisfied; the wait stays in place.
            cuda.cuEventDestroy_v2(event)
