"""A rank with device arrays: objects exposing __cuda_array_interface__ over
memory from the CUDA driver this process loaded (rdist's GPU test doubles,
whose device memory the CPU cannot touch, or on a GPU machine the real
driver). Checks the binding's device path against numpy references."""

import ctypes

import numpy as np

import rdist
from _worker import report

cuda = ctypes.CDLL("libcuda.so.1")


def ok(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def use_device(ordinal=0):
    ok(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ok(cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    ok(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def new_stream():
    s = ctypes.c_void_p()
    ok(cuda.cuStreamCreate(ctypes.byref(s), 0), "cuStreamCreate")
    return s.value


class DeviceArray:
    """A C-contiguous device array, as CuPy or PyTorch would expose one."""

    def __init__(self, host, stream=None):
        self.dtype = host.dtype
        self.shape = host.shape
        self.nbytes = host.nbytes
        self.stream = stream
        ptr = ctypes.c_uint64()
        ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(max(host.nbytes, 1))), "cuMemAlloc")
        self.ptr = ptr.value
        if host.nbytes:
            ok(cuda.cuMemcpyHtoD_v2(ctypes.c_uint64(self.ptr), host.ctypes.data_as(ctypes.c_void_p),
                                    ctypes.c_size_t(host.nbytes)), "cuMemcpyHtoD")

    @property
    def __cuda_array_interface__(self):
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
            "stream": self.stream,
        }

    def get(self):
        out = np.empty(self.shape, self.dtype)
        if self.nbytes:
            ok(cuda.cuMemcpyDtoH_v2(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(self.ptr),
                                    ctypes.c_size_t(self.nbytes)), "cuMemcpyDtoH")
        return out


def main():
    use_device(0)
    stream = new_stream()
    with rdist.init() as comm:
        rank, size = comm.rank, comm.size
        checked = []
        for dtype in (np.float32, np.float16, np.int64, np.uint8):
            values = (np.arange(1000) % 7 + rank).astype(dtype)
            want = sum((np.arange(1000) % 7 + r).astype(np.float64) for r in range(size)).astype(dtype)
            buf = DeviceArray(values, stream)
            comm.allreduce(buf)  # in place, on the array's stream
            assert np.array_equal(buf.get(), want), (dtype, buf.get()[:5], want[:5])
            out = DeviceArray(np.zeros(1000, dtype))
            comm.allreduce(DeviceArray(values), out=out, op="max")
            assert np.array_equal(out.get(), (np.arange(1000) % 7 + size - 1).astype(dtype))
            checked.append(np.dtype(dtype).name)
        # Broadcast from the last rank and allgather into a device array.
        b = DeviceArray(np.full(16, rank, np.int32), stream)
        comm.broadcast(b, root=size - 1)
        assert (b.get() == size - 1).all()
        g = DeviceArray(np.zeros(4 * size, np.float64))
        comm.allgather(DeviceArray(np.full(4, rank, np.float64)), out=g)
        assert np.array_equal(g.get(), np.repeat(np.arange(size, dtype=np.float64), 4))
        # A strided device array is refused, clearly.
        class Strided(DeviceArray):
            @property
            def __cuda_array_interface__(self):
                cai = dict(DeviceArray.__cuda_array_interface__.fget(self))
                cai["strides"] = (8,)
                return cai
        try:
            comm.allreduce(Strided(np.zeros(4, np.float32)))
            refused = ""
        except rdist.InvalidArgumentError as error:
            refused = str(error)
        # A non-blocking call (no stream of its own: the default stream)
        # must wait for the stream its array names: with that stream's
        # work held back (the doubles stall it), the default stream must
        # stall too, until the producer's work is done. A real driver
        # cannot be stalled so: there the call just has to be right
        # (ordered is None).
        producer = new_stream()
        x = DeviceArray(np.full(8, rank + 1, np.int32), producer)
        if hasattr(cuda, "rdist_stub_stall_stream"):  # the GPU test doubles
            stall = cuda.rdist_stub_stall_stream
            stall.argtypes = [ctypes.c_void_p, ctypes.c_int]
            is_stalled = cuda.rdist_stub_stream_is_stalled
            is_stalled.argtypes = [ctypes.c_void_p]
            stall(producer, 1)
            request = comm.iallreduce(x)
            ordered = is_stalled(None) == 1
            stall(producer, 0)
            stall(None, 0)
        else:
            request = comm.iallreduce(x)
            ordered = None
        request.wait()
        assert (x.get() == size * (size + 1) // 2).all(), x.get()
        report(rank=rank, checked=checked, refused=refused, backend=str(comm.backend), ordered=ordered)


main()
