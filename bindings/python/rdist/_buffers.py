"""Element types, reductions, and turning Python buffers into (address,
count, dtype) for the C calls.

Buffers are numpy arrays, any object with the buffer protocol
(memoryview, bytearray, array.array, ctypes arrays, bytes for inputs), or
device arrays exposing ``__cuda_array_interface__`` (CuPy, PyTorch CUDA
tensors, Numba): those go to rdist as device pointers, on the stream the
interface names. They must be C-contiguous: a collective reads and writes them as one flat run of
elements, and copying silently would break in-place calls. numpy is only
imported by the caller: a numpy array is recognised when numpy is already
loaded, so this module works without it.
"""

import ctypes
import enum
import sys
from ctypes import c_char, c_int, c_void_p, py_object

from ._errors import InvalidArgumentError, UnavailableError
from ._library import lib

#: Whether the loaded library knows the 0.2 element types and reductions.
HAS_0_2 = lib.rdist_version() >= 200

__all__ = ["DType", "Op", "resolve_dtype", "resolve_op"]


class DType(enum.IntEnum):
    """rdist_dtype_t: element types (values equal NCCL's ncclDataType_t)."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    # Since 0.2 (rdist's own; NCCL has none of them).
    BOOL = 64
    INT16 = 65
    UINT16 = 66

    @property
    def itemsize(self):
        """Bytes per element."""
        return _ITEMSIZE[self]

    def __str__(self):
        return self.name.lower()


_ITEMSIZE = {
    DType.INT8: 1,
    DType.UINT8: 1,
    DType.INT32: 4,
    DType.UINT32: 4,
    DType.INT64: 8,
    DType.UINT64: 8,
    DType.FLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
    DType.BFLOAT16: 2,
    DType.BOOL: 1,
    DType.INT16: 2,
    DType.UINT16: 2,
}

#: Element types and reductions a library before 0.2 does not know.
NEW_IN_0_2 = frozenset({DType.BOOL, DType.INT16, DType.UINT16})


class Op(enum.IntEnum):
    """rdist_op_t: reductions (values equal NCCL's ncclRedOp_t). AVG is SUM
    divided by the group size (integers: truncating division)."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4
    # Since 0.2: bitwise, on integer and bool types only.
    BAND = 64
    BOR = 65
    BXOR = 66

    def __str__(self):
        return self.name.lower()


_DTYPE_BY_NAME = {str(d): d for d in DType}
_DTYPE_BY_NAME.update({"half": DType.FLOAT16, "bf16": DType.BFLOAT16})
_OP_BY_NAME = {str(o): o for o in Op}
_OP_BY_NAME.update({"mean": Op.AVG, "product": Op.PROD, "and": Op.BAND, "or": Op.BOR, "xor": Op.BXOR})


def resolve_dtype(dtype):
    """A DType from a DType, a name ("float32", "bfloat16", ...) or a numpy
    dtype / scalar type; InvalidArgumentError for anything else."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        name = dtype.lower()
    else:
        # numpy dtypes and scalar types (np.float32) name themselves this way.
        numpy = sys.modules.get("numpy")
        try:
            name = numpy.dtype(dtype).name if numpy is not None else None
        except TypeError:
            name = None
    found = _DTYPE_BY_NAME.get(name) if name else None
    if found is None:
        raise InvalidArgumentError(
            f"unknown dtype {dtype!r} (known: {', '.join(str(d) for d in DType)})"
        )
    return found


def _needs_0_2(what):
    packed = lib.rdist_version()
    return (
        f"{what} needs librdist 0.2 or later, but the loaded library is "
        f"{packed // 10000}.{packed // 100 % 100}.{packed % 100}"
    )


def check_dtype(dtype):
    """Raises UnavailableError for a 0.2 element type on an older library."""
    if dtype in NEW_IN_0_2 and not HAS_0_2:
        raise UnavailableError(_needs_0_2(f"the {dtype} element type"))
    return dtype


def resolve_op(op):
    """An Op from an Op or a name ("sum", "prod", "max", "min", "avg")."""
    if isinstance(op, Op):
        found = op
    else:
        found = _OP_BY_NAME.get(op.lower()) if isinstance(op, str) else None
    if found is not None:
        if found >= Op.BAND and not HAS_0_2:
            raise UnavailableError(_needs_0_2(f"the {found} reduction"))
        return found
    raise InvalidArgumentError(
        f"unknown reduction op {op!r} (known: {', '.join(str(o) for o in Op)})"
    )


# ---------------------------------------------------------------------------
# The buffer protocol through the C API (PEP 3118), for a raw address of any
# exporter, read-only ones included, and to pin the memory while rdist uses it.
# ---------------------------------------------------------------------------


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer (stable layout since 3.3)."""

    _fields_ = [
        ("buf", c_void_p),
        ("obj", c_void_p),  # owned reference; PyBuffer_Release drops it
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", c_int),
        ("ndim", c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", c_void_p),
    ]


_PyObject_GetBuffer = ctypes.pythonapi.PyObject_GetBuffer
_PyObject_GetBuffer.argtypes = [py_object, ctypes.POINTER(_PyBuffer), c_int]
_PyObject_GetBuffer.restype = c_int
_PyBuffer_Release = ctypes.pythonapi.PyBuffer_Release
_PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_PyBuffer_Release.restype = None
_PyBuffer_IsContiguous = ctypes.pythonapi.PyBuffer_IsContiguous
_PyBuffer_IsContiguous.argtypes = [ctypes.POINTER(_PyBuffer), c_char]
_PyBuffer_IsContiguous.restype = c_int

_PyBUF_FORMAT = 0x0004
_PyBUF_STRIDES = 0x0010 | 0x0008  # with PyBUF_ND
# Read-only request with strides and format: we check writability and
# contiguity ourselves, to say clearly what is wrong.
_PyBUF_RECORDS_RO = _PyBUF_STRIDES | _PyBUF_FORMAT

# struct-module format characters (native sizes) -> dtype, by item size.
_SIGNED_CODES = "bhilqn"
_UNSIGNED_CODES = "BHILQN"
_INT_BY_SIZE = {1: DType.INT8, 2: DType.INT16, 4: DType.INT32, 8: DType.INT64}
_UINT_BY_SIZE = {1: DType.UINT8, 2: DType.UINT16, 4: DType.UINT32, 8: DType.UINT64}
_FLOAT_CODES = {"e": DType.FLOAT16, "f": DType.FLOAT32, "d": DType.FLOAT64}
_NATIVE_ORDER = "<" if sys.byteorder == "little" else ">"

_NUMPY_DTYPES = {
    "bool": DType.BOOL,
    "int16": DType.INT16,
    "uint16": DType.UINT16,
    "int8": DType.INT8,
    "uint8": DType.UINT8,
    "int32": DType.INT32,
    "uint32": DType.UINT32,
    "int64": DType.INT64,
    "uint64": DType.UINT64,
    "float16": DType.FLOAT16,
    "float32": DType.FLOAT32,
    "float64": DType.FLOAT64,
    "bfloat16": DType.BFLOAT16,  # ml_dtypes' numpy extension type
}


def _dtype_of_format(fmt, itemsize):
    """The DType of a buffer-protocol format string, or None."""
    if fmt and fmt[0] in "@=<>!":
        order, fmt = fmt[0], fmt[1:]
        if order == "!":
            order = ">"
        if order in "<>" and order != _NATIVE_ORDER:
            return None  # foreign byte order: the sums would be garbage
    if len(fmt) != 1:
        return None
    if fmt in _SIGNED_CODES:
        return _INT_BY_SIZE.get(itemsize)
    if fmt in _UNSIGNED_CODES or fmt == "c":
        return _UINT_BY_SIZE.get(itemsize)
    if fmt == "?" and itemsize == 1:
        return DType.BOOL
    return _FLOAT_CODES.get(fmt)


class Pinned:
    """One buffer as the C call sees it: ``address``, ``nbytes`` and the
    inferred ``dtype`` (None when the type has no rdist equivalent). Holds the
    object (and, for buffer-protocol objects, an export that stops e.g. a
    bytearray from being resized) until :meth:`release`."""

    __slots__ = ("obj", "address", "nbytes", "dtype", "_type_name", "_view", "stream")

    def __init__(self, obj, address, nbytes, dtype, type_name, view=None, stream=None):
        self.obj = obj
        self.address = address
        self.nbytes = nbytes
        self.dtype = dtype
        self._type_name = type_name  # a str, or a numpy dtype (formatted on demand)
        self._view = view
        # For device arrays: the CUDA stream their data is valid on (an int
        # handle; 1 and 2 are CUDA's legacy and per-thread default streams).
        self.stream = stream

    @property
    def type_name(self):
        """What the buffer is, for messages."""
        name = self._type_name
        return name if isinstance(name, str) else f"numpy {name}"

    @type_name.setter
    def type_name(self, value):
        self._type_name = value

    def release(self):
        """Ends the export; idempotent."""
        view, self._view = self._view, None
        if view is not None:
            _PyBuffer_Release(ctypes.byref(view))
        self.obj = None

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to do
            pass


_numpy_by_dtype = {}


def _numpy_dtype(np_dtype):
    """The DType of a numpy dtype (cached by dtype object: numpy's .name is
    slow, and this runs on every call)."""
    try:
        return _numpy_by_dtype[np_dtype]
    except KeyError:
        pass
    found = _NUMPY_DTYPES.get(np_dtype.name) if np_dtype.isnative else None
    _numpy_by_dtype[np_dtype] = found
    return found


def _pin_numpy(array, what, writable):
    if not array.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{what} must be C-contiguous, but this numpy array (shape {array.shape}, "
            f"strides {array.strides}) is not; pass numpy.ascontiguousarray({what}) "
            "(and copy the result back if the call writes to it)"
        )
    if writable and not array.flags.writeable:
        raise InvalidArgumentError(f"{what} is a read-only numpy array, but the call writes to it")
    dtype = _numpy_dtype(array.dtype)
    address = array.__array_interface__["data"][0]
    return Pinned(array, address, array.nbytes, dtype, array.dtype)


def _pin_buffer(obj, what, writable):
    view = _PyBuffer()
    try:
        _PyObject_GetBuffer(obj, ctypes.byref(view), _PyBUF_RECORDS_RO)
    except TypeError:
        raise TypeError(
            f"{what} must be a numpy array or a buffer-protocol object "
            f"(memoryview, bytearray, array.array, ...), not {type(obj).__name__}"
        ) from None
    except BufferError:
        # A few exporters refuse strided requests; a plain one gives them the
        # chance to hand out contiguous memory (or to say why not).
        _PyObject_GetBuffer(obj, ctypes.byref(view), _PyBUF_FORMAT)
    pinned = Pinned(obj, view.buf, view.len, None, type(obj).__name__, view)
    try:
        if not _PyBuffer_IsContiguous(ctypes.byref(view), b"C"):
            raise InvalidArgumentError(
                f"{what} must be C-contiguous, but this {type(obj).__name__} is not "
                "(a strided view); copy it into a contiguous buffer first"
            )
        if writable and view.readonly:
            raise InvalidArgumentError(
                f"{what} is a read-only {type(obj).__name__}, but the call writes to it"
            )
        fmt = view.format.decode("ascii", "replace") if view.format else "B"
        pinned.dtype = _dtype_of_format(fmt, view.itemsize)
        pinned.type_name = f"{type(obj).__name__} of format {fmt!r}"
    except BaseException:
        pinned.release()
        raise
    return pinned


# __cuda_array_interface__ typestr -> dtype ("<V2"-style bfloat16 has no
# standard spelling, so it needs dtype=).
_CUDA_TYPESTR = {
    "i1": DType.INT8, "u1": DType.UINT8, "b1": DType.BOOL, "i2": DType.INT16, "u2": DType.UINT16,
    "i4": DType.INT32, "u4": DType.UINT32, "i8": DType.INT64, "u8": DType.UINT64,
    "f2": DType.FLOAT16, "f4": DType.FLOAT32, "f8": DType.FLOAT64,
}


def _pin_cuda(obj, what, writable):
    """A device array through ``__cuda_array_interface__`` (version 2 or 3)."""
    cai = obj.__cuda_array_interface__
    address, readonly = cai["data"]
    shape = tuple(cai["shape"])
    typestr = cai["typestr"]
    itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 0
    strides = cai.get("strides")
    if strides is not None:
        expected, step = [], itemsize
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        if tuple(strides) != tuple(reversed(expected)) and 0 not in shape:
            raise InvalidArgumentError(
                f"{what} must be C-contiguous, but this device array (shape {shape}, "
                f"strides {tuple(strides)}) is not; make a contiguous copy first"
            )
    if writable and readonly:
        raise InvalidArgumentError(f"{what} is a read-only device array, but the call writes to it")
    nbytes = itemsize
    for extent in shape:
        nbytes *= extent
    native = typestr[0] in "|" + _NATIVE_ORDER
    dtype = _CUDA_TYPESTR.get(typestr[1:]) if native else None
    # Version 3: None means "no synchronisation needed" (the default stream
    # serves); otherwise the producer's stream, on which rdist then runs.
    stream = cai.get("stream")
    return Pinned(obj, address or 0, nbytes, dtype, f"device array {typestr}", stream=stream)


# ---------------------------------------------------------------------------
# torch tensors: their data pointer, no copy and no numpy round trip
# ---------------------------------------------------------------------------

_torch_dtypes = None


def torch_dtypes():
    """torch dtype -> DType (built on first use; torch is never imported here)."""
    global _torch_dtypes
    if _torch_dtypes is None:
        torch = sys.modules["torch"]
        _torch_dtypes = {
            torch.bool: DType.BOOL, torch.int8: DType.INT8, torch.uint8: DType.UINT8,
            torch.int16: DType.INT16, torch.int32: DType.INT32, torch.int64: DType.INT64,
            torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
            torch.float32: DType.FLOAT32, torch.float64: DType.FLOAT64,
        }
        for name, dtype in (("uint16", DType.UINT16), ("uint32", DType.UINT32), ("uint64", DType.UINT64)):
            if hasattr(torch, name):  # torch >= 2.3
                _torch_dtypes[getattr(torch, name)] = dtype
    return _torch_dtypes


def torch_stream(tensor):
    """The CUDA stream a torch CUDA tensor's producer runs on (the current
    stream of its device), as the int __cuda_array_interface__ v3 gives: 1
    for the legacy default stream."""
    torch = sys.modules["torch"]
    handle = torch.cuda.current_stream(tensor.device).cuda_stream
    return handle or 1


def _pin_torch(tensor, what, writable):
    device = tensor.device.type
    if tensor.layout is not sys.modules["torch"].strided:
        raise InvalidArgumentError(
            f"{what} is a {tensor.layout} tensor; rdist takes dense (strided) tensors only"
        )
    if not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"{what} must be contiguous, but this tensor (shape {tuple(tensor.shape)}, "
            f"strides {tensor.stride()}) is not; pass {what}.contiguous() (and copy the "
            "result back with .copy_() if the call writes to it)"
        )
    dtype = torch_dtypes().get(tensor.dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if device == "cpu":
        return Pinned(tensor, tensor.data_ptr(), nbytes, dtype, f"tensor {tensor.dtype}")
    if device == "cuda":
        return Pinned(
            tensor, tensor.data_ptr(), nbytes, dtype, f"cuda tensor {tensor.dtype}",
            stream=torch_stream(tensor),
        )
    raise InvalidArgumentError(
        f"{what} is a tensor on {tensor.device}; rdist takes CPU and CUDA tensors"
    )


# ---------------------------------------------------------------------------
# DLPack (__dlpack__): JAX, CuPy, TensorFlow, ... host arrays
# ---------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.argtypes = [py_object, ctypes.c_char_p]
_PyCapsule_GetPointer.restype = c_void_p

_DL_CPU, _DL_CUDA_HOST = 1, 3  # kDLCPU, kDLCUDAHost
# (type code, bits) -> DType: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6.
_DLPACK_DTYPES = {
    (0, 8): DType.INT8, (0, 16): DType.INT16, (0, 32): DType.INT32, (0, 64): DType.INT64,
    (1, 8): DType.UINT8, (1, 16): DType.UINT16, (1, 32): DType.UINT32, (1, 64): DType.UINT64,
    (2, 16): DType.FLOAT16, (2, 32): DType.FLOAT32, (2, 64): DType.FLOAT64,
    (4, 16): DType.BFLOAT16, (6, 8): DType.BOOL,
}


def _pin_dlpack(obj, what, writable):
    """A host array through ``__dlpack__``. The capsule is kept (not
    consumed), so the producer's memory stays alive while rdist uses it.
    DLPack has no read-only flag before 1.0's versioned capsules: the
    producer promises a writable view when the call writes."""
    capsule = obj.__dlpack__()
    address = _PyCapsule_GetPointer(capsule, b"dltensor")
    tensor = _DLTensor.from_address(address)
    if tensor.device.device_type not in (_DL_CPU, _DL_CUDA_HOST):
        raise InvalidArgumentError(
            f"{what} is a DLPack array on device type {tensor.device.device_type}; only host "
            "arrays go through DLPack (device arrays need __cuda_array_interface__ or torch)"
        )
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    itemsize = (tensor.dtype.bits * tensor.dtype.lanes + 7) // 8
    count = 1
    for extent in shape:
        count *= extent
    if tensor.strides and count:
        expected, step = [], 1
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        expected.reverse()
        got = [tensor.strides[i] for i in range(tensor.ndim)]
        if any(g != e for g, e, n in zip(got, expected, shape) if n != 1):
            raise InvalidArgumentError(
                f"{what} must be C-contiguous, but this DLPack array (shape {tuple(shape)}, "
                f"strides {tuple(got)} elements) is not; make a contiguous copy first"
            )
    dtype = None
    if tensor.dtype.lanes == 1:
        dtype = _DLPACK_DTYPES.get((tensor.dtype.code, tensor.dtype.bits))
    return Pinned(
        (obj, capsule), (tensor.data or 0) + tensor.byte_offset, count * itemsize, dtype,
        f"DLPack array of {type(obj).__name__}",
    )


def fast_buffer(obj):
    """(address, nbytes, DType) of a writable, C-contiguous host numpy array
    or CPU torch tensor whose dtype the library knows, else None (the
    general path then pins it, or says what is wrong)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and type(obj) is numpy.ndarray:
        flags = obj.flags
        if not (flags.c_contiguous and flags.writeable):
            return None
        dtype = _numpy_dtype(obj.dtype)
        if dtype is None or (dtype in NEW_IN_0_2 and not HAS_0_2):
            return None
        return obj.__array_interface__["data"][0], obj.nbytes, dtype
    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor:
        if obj.device.type != "cpu" or obj.layout is not torch.strided or not obj.is_contiguous():
            return None
        dtype = torch_dtypes().get(obj.dtype)
        if dtype is None or (dtype in NEW_IN_0_2 and not HAS_0_2):
            return None
        return obj.data_ptr(), obj.numel() * obj.element_size(), dtype
    return None


def pin(obj, what, writable):
    """Pins ``obj`` for a C call; ``what`` names the argument in messages."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _pin_torch(obj, what, writable)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return _pin_numpy(obj, what, writable)
    # hasattr on the object, not its type: some exporters' property raises
    # AttributeError for host memory, which is then a host buffer.
    if hasattr(obj, "__cuda_array_interface__"):
        return _pin_cuda(obj, what, writable)
    if not isinstance(obj, (bytes, bytearray, memoryview)) and hasattr(obj, "__dlpack__"):
        try:
            memoryview(obj).release()
        except TypeError:
            return _pin_dlpack(obj, what, writable)
    return _pin_buffer(obj, what, writable)


def element_count(pinned, dtype, what):
    """How many ``dtype`` elements the pinned buffer holds."""
    if pinned.nbytes % dtype.itemsize:
        raise InvalidArgumentError(
            f"{what} holds {pinned.nbytes} bytes, not a whole number of {dtype} "
            f"elements ({dtype.itemsize} bytes each)"
        )
    return pinned.nbytes // dtype.itemsize


def common_dtype(pins, dtype):
    """The element type of a call: the explicit ``dtype`` if given, else the
    one all pinned buffers infer (they must agree). ``pins`` maps argument
    names to Pinned (or None for an absent buffer)."""
    if dtype is not None:
        return check_dtype(resolve_dtype(dtype))
    inferred = None
    first = None
    for what, pinned in pins.items():
        if pinned is None:
            continue
        if pinned.dtype is None:
            raise InvalidArgumentError(
                f"{what} ({pinned.type_name}) has no rdist dtype; pass dtype= "
                f"(one of {', '.join(str(d) for d in DType)}) to use its raw bits"
            )
        if inferred is None:
            inferred, first = pinned.dtype, what
        elif pinned.dtype != inferred:
            raise InvalidArgumentError(
                f"{first} is {inferred} but {what} is {pinned.dtype}; use one element "
                "type, or pass dtype= to reinterpret both"
            )
    if inferred is None:
        raise InvalidArgumentError("no buffer to infer the dtype from; pass dtype=")
    return check_dtype(inferred)
