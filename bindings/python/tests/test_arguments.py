"""Argument handling that needs no peer, on a one-rank communicator in this
process: buffer kinds and dtype inference, bad dtypes/ops, non-contiguous,
read-only and wrongly sized buffers, options, lifecycle, requests, groups."""

import array
import ctypes

import numpy as np
import pytest

import rdist
from rdist import _buffers
from jobs import free_port


def test_properties_and_repr(solo):
    assert (solo.rank, solo.size, solo.local_rank) == (0, 1, 0)
    assert solo.backend is rdist.Backend.SOCKET and str(solo.backend) == "socket"
    assert solo.handle != 0 and not solo.destroyed
    assert repr(solo) == "<rdist.Comm rank 0 of 1 (socket)>"


@pytest.mark.parametrize(
    "make, dtype",
    [
        (lambda: np.zeros(3, np.int8), "int8"),
        (lambda: np.zeros(3, np.uint64), "uint64"),
        (lambda: np.zeros(3, np.float16), "float16"),
        (lambda: np.zeros((2, 3), np.float64), "float64"),
        (lambda: bytearray(4), "uint8"),
        (lambda: array.array("b", [1]), "int8"),
        (lambda: array.array("i", [1]), "int32"),
        (lambda: array.array("I", [1]), "uint32"),
        (lambda: array.array("q", [1]), "int64"),
        (lambda: array.array("L", [1]), "uint64"),
        (lambda: array.array("f", [1]), "float32"),
        (lambda: array.array("d", [1]), "float64"),
        (lambda: (ctypes.c_float * 4)(), "float32"),
        (lambda: memoryview(np.zeros(4, np.float16)), "float16"),
        (lambda: memoryview(np.zeros(4, np.uint32)), "uint32"),
    ],
)
def test_dtype_is_inferred_from_numpy_and_buffer_formats(make, dtype):
    pinned = _buffers.pin(make(), "buf", writable=True)
    try:
        assert pinned.dtype == rdist.DType[dtype.upper()]
    finally:
        pinned.release()


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros(3, np.complex64),
        lambda: np.zeros(3, ">f4"),  # foreign byte order
    ],
)
def test_types_without_an_rdist_dtype_ask_for_dtype(solo, make):
    with pytest.raises(rdist.InvalidArgumentError, match="no rdist dtype; pass dtype="):
        solo.allreduce(make())


def test_explicit_dtype_reinterprets_raw_bits(solo):
    bits = np.array([0x3F80, 0x4000], np.uint16)  # bfloat16 1.0 and 2.0
    assert solo.allreduce(bits, dtype="bfloat16") is bits
    assert solo.allreduce(bits, dtype=rdist.DType.BFLOAT16, op=rdist.Op.MAX) is bits
    assert solo.allreduce(bytearray(8), dtype=np.float32) is not None
    with pytest.raises(rdist.InvalidArgumentError, match="not a whole number of float16"):
        solo.allreduce(bytearray(3), dtype="float16")


def test_bad_dtype_and_op_names(solo):
    x = np.zeros(4, np.float32)
    with pytest.raises(rdist.InvalidArgumentError, match=r"unknown dtype 'float128'.*bfloat16"):
        solo.allreduce(x, dtype="float128")
    with pytest.raises(ValueError, match=r"unknown reduction op 'mean_square'.*avg"):
        solo.allreduce(x, op="mean_square")
    with pytest.raises(rdist.InvalidArgumentError, match="unknown reduction op 7"):
        solo.reduce(x, op=7)
    for name in ("SUM", "prod", "Max", "min", "avg"):
        solo.allreduce(x, op=name)


def test_non_contiguous_buffers_are_refused(solo):
    matrix = np.zeros((4, 4), np.float32)
    with pytest.raises(rdist.InvalidArgumentError, match=r"allreduce: buf must be C-contiguous.*ascontiguousarray"):
        solo.allreduce(matrix[:, 1])
    with pytest.raises(rdist.InvalidArgumentError, match="out must be C-contiguous"):
        solo.allgather(np.zeros(2, np.float32), matrix.T)
    with pytest.raises(rdist.InvalidArgumentError, match="C-contiguous"):
        solo.broadcast(memoryview(bytearray(8))[::2])


def test_read_only_outputs_are_refused_but_read_only_inputs_are_fine(solo):
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(rdist.InvalidArgumentError, match="read-only numpy array"):
        solo.allreduce(frozen)
    with pytest.raises(rdist.InvalidArgumentError, match="out is a read-only bytes"):
        solo.allreduce(bytearray(4), out=b"abcd")
    out = bytearray(4)
    assert solo.allreduce(b"abcd", out=out) == b"abcd"
    assert solo.allreduce(frozen, out=np.ones(4, np.float32)).sum() == 0


def test_objects_without_the_buffer_protocol_are_type_errors(solo):
    with pytest.raises(TypeError, match="allreduce: buf must be a numpy array or a buffer-protocol object"):
        solo.allreduce([1.0, 2.0])


def test_wrong_sizes_are_refused_with_the_expected_count(solo):
    with pytest.raises(rdist.InvalidArgumentError, match=r"out holds 3 float32 elements, but needs 4"):
        solo.allreduce(np.zeros(4, np.float32), out=np.zeros(3, np.float32))
    with pytest.raises(rdist.InvalidArgumentError, match=r"allgather: out holds 5 .* needs 4 \(size \* len\(send\) = 1 \* 4\)"):
        solo.allgather(np.zeros(4, np.int32), np.zeros(5, np.int32))
    with pytest.raises(rdist.InvalidArgumentError, match=r"reduce_scatter: send holds 2 .* needs 3"):
        solo.reduce_scatter(np.zeros(2, np.int32), np.zeros(3, np.int32))
    with pytest.raises(rdist.InvalidArgumentError, match=r"alltoall: out holds 1 .* needs 2"):
        solo.alltoall(np.zeros(2, np.int32), np.zeros(1, np.int32))
    with pytest.raises(rdist.InvalidArgumentError, match="the root .* needs out"):
        solo.gather(np.zeros(2, np.int32), None, root=0)
    with pytest.raises(rdist.InvalidArgumentError, match="send is float32 but out is float64"):
        solo.allgather(np.zeros(2, np.float32), np.zeros(2, np.float64))


def test_library_argument_errors_name_function_and_rank(solo):
    x = np.zeros(2, np.float32)
    with pytest.raises(rdist.InvalidArgumentError, match=r"rdist_broadcast: rank 0: .*root 3"):
        solo.broadcast(x, root=3)
    with pytest.raises(rdist.InvalidArgumentError, match=r"rdist_send: rank 0: peer 5"):
        solo.send(x, 5)
    with pytest.raises(rdist.InvalidArgumentError) as caught:
        solo.recv(x, -2)
    assert caught.value.code is rdist.Result.INVALID_ARGUMENT


def test_counts_of_zero_and_every_call_on_one_rank(solo):
    empty = np.zeros(0, np.float64)
    for call in (
        lambda: solo.allreduce(empty),
        lambda: solo.broadcast(empty),
        lambda: solo.reduce(empty, "max"),
        lambda: solo.allgather(empty, np.zeros(0)),
        lambda: solo.reduce_scatter(empty, np.zeros(0)),
        lambda: solo.gather(empty, np.zeros(0)),
        lambda: solo.scatter(empty, np.zeros(0)),
        lambda: solo.alltoall(empty, np.zeros(0)),
        solo.barrier,
    ):
        call()
    values = np.arange(5, dtype=np.int64)
    assert solo.allgather(values, np.zeros(5, np.int64)).tolist() == list(range(5))
    assert solo.scatter(values, np.zeros(5, np.int64)).tolist() == list(range(5))
    assert solo.reduce(values.copy(), "sum", 0, out=np.zeros(5, np.int64)).tolist() == list(range(5))


def test_requests(solo):
    x = np.arange(4, dtype=np.float32)
    request = solo.iallreduce(x, op="avg")
    assert request.wait() is x and request.done and request.test()
    assert request.wait() is x  # waiting again is harmless
    assert repr(request) == "<rdist.Request allreduce done>"
    with solo.ibarrier() as barrier:
        pass
    assert barrier.done and barrier.wait() is None
    failed = solo.ibroadcast(x, root=0)
    failed.free()
    assert failed.done
    with pytest.raises(rdist.InvalidArgumentError):
        solo.iallgather(x, np.zeros(1, np.float32))  # refused before anything starts


def test_group_on_one_rank_and_group_end_without_start(solo):
    mine, theirs = np.arange(3, dtype=np.int32), np.zeros(3, np.int32)
    with rdist.group():
        solo.send(mine, 0)
        solo.recv(theirs, 0)
    assert theirs.tolist() == [0, 1, 2]
    with pytest.raises(rdist.InvalidUsageError, match="without a matching group_start"):
        rdist.group_end()


def test_split_on_one_rank(solo):
    with solo.split(color=3, key=0) as child:
        assert (child.rank, child.size) == (0, 1)
        assert child.allreduce(np.ones(2, np.int8)).tolist() == [1, 1]
    assert child.destroyed
    assert solo.split(None) is None
    assert solo.split(rdist.SPLIT_NOCOLOR) is None


def test_options_are_checked_by_the_library():
    with pytest.raises(rdist.InvalidArgumentError, match=r"unknown option 'timeout'.*timeout_ms"):
        rdist.init(f"tcp://127.0.0.1:{free_port()}", 0, 1, timeout=5)
    with pytest.raises(rdist.InvalidArgumentError, match=r"option 'backend': 'mpi'"):
        rdist.init(f"tcp://127.0.0.1:{free_port()}", 0, 1, backend="mpi")
    with rdist.init(f"tcp://127.0.0.1:{free_port()}", 0, 1, backend="socket", transport="tcp",
                    timeout_ms=5000, algo="ring", debug=None) as comm:
        assert comm.allreduce(np.ones(3, np.float32)).tolist() == [1, 1, 1]


def test_destroyed_communicators_refuse_calls():
    comm = rdist.init(f"tcp://127.0.0.1:{free_port()}", 0, 1, timeout_ms=5000)
    with comm:
        pass
    assert comm.destroyed and comm.handle == 0
    comm.destroy()  # idempotent
    comm.abort()  # a no-op now
    with pytest.raises(rdist.InvalidUsageError, match="allreduce: the communicator was destroyed"):
        comm.allreduce(np.zeros(1, np.float32))
    with pytest.raises(rdist.InvalidUsageError):
        comm.split(0)
    assert repr(comm) == "<rdist.Comm rank 0 of 1 (destroyed)>"


def test_unique_id_bootstrap_checks_the_id_length():
    uid = rdist.unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(rdist.InvalidArgumentError, match="128 bytes"):
        rdist.init_rank(1, uid[:10], 0)
    with rdist.init_rank(1, uid, 0, timeout_ms=5000) as comm:
        assert comm.size == 1


def test_bound_on_rendezvous_raises_the_timeout_error():
    # A two-rank job whose second rank never comes: init gives up at timeout_ms.
    with pytest.raises(rdist.CommTimeoutError) as caught:
        rdist.init(f"tcp://127.0.0.1:{free_port()}", 0, 2, timeout_ms=300)
    assert "rank 1" in str(caught.value), caught.value
    assert isinstance(caught.value, TimeoutError)


# The 0.2 element types: inferred from numpy, the buffer protocol and torch.
NEW_TYPES = [
    (lambda: np.array([1, 0, 1], bool), "bool"),
    (lambda: np.array([1, -2, 3], np.int16), "int16"),
    (lambda: np.array([1, 2, 65535], np.uint16), "uint16"),
    (lambda: array.array("h", [1, -1]), "int16"),
    (lambda: array.array("H", [1, 2]), "uint16"),
]


@pytest.mark.parametrize("make, name", NEW_TYPES)
def test_0_2_types_are_inferred(make, name):
    pinned = rdist._buffers.pin(make(), "buf", True)
    try:
        assert str(pinned.dtype) == name
    finally:
        pinned.release()


@pytest.mark.skipif(rdist.library_version() >= (0, 2, 0), reason="the library has the 0.2 types")
@pytest.mark.parametrize("make, name", NEW_TYPES)
def test_0_2_types_on_an_older_library_say_so(solo, make, name):
    with pytest.raises(rdist.UnavailableError, match=f"{name} element type needs librdist 0.2"):
        solo.allreduce(make())


@pytest.mark.needs_0_2
@pytest.mark.parametrize("make, name", NEW_TYPES)
def test_0_2_types_reduce(solo, make, name):
    buf = make()
    before = bytes(memoryview(buf))
    solo.allreduce(buf, op="max")  # one rank: the identity
    assert bytes(memoryview(buf)) == before
