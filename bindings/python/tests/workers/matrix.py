"""A rank of the collective matrix job: runs every collective over every
dtype, op, count and placement (in place / out of place), compares each
result with a numpy reference and reports one `RESULT` line:

    {"rank": r, "size": n, "cases": [ids...], "failures": {id: why}}

Every rank walks the same case list in the same order (a requirement of
collectives), and can compute every rank's input, since inputs are seeded
by (case, rank). Values are chosen so that every result is exact whatever
the reduction order (small integers for floats; integers wrap in both rdist
and numpy), so results are compared bit for bit.

usage: matrix.py [--collectives a,b] [--large-bytes N] [--option key=value ...]
"""

import argparse
import time

import numpy as np

import rdist
from _worker import bf16_bits_to_f32, error_fields, f32_to_bf16_bits, report

DTYPES = [
    "int8", "uint8", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "bfloat16",
]
OPS = ["sum", "prod", "max", "min", "avg"]
COLLECTIVES = [
    "allreduce", "reduce", "broadcast", "allgather",
    "reduce_scatter", "gather", "scatter", "alltoall",
]
REDUCING = {"allreduce", "reduce", "reduce_scatter"}
# Where the binding accepts an in-place form, both placements are run.
IN_PLACE = {"allreduce", "reduce", "broadcast", "allgather"}


def storage(dtype):
    """The numpy dtype holding `dtype` (bfloat16 travels as raw uint16 bits)."""
    return np.dtype("uint16") if dtype == "bfloat16" else np.dtype(dtype)


def make_input(case, rank, count, dtype, op):
    """Rank `rank`'s input for case number `case`."""
    rng = np.random.default_rng([case, rank])
    kind = storage(dtype)
    if op is None:
        # Data movement only: any bit pattern, NaNs included.
        return rng.integers(0, 256, count * kind.itemsize, dtype=np.uint8).view(kind)
    if dtype in ("float16", "float32", "float64", "bfloat16"):
        # Small integers: every sum, product and order of evaluation is exact.
        if op == "prod":
            values = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), count)
        else:
            values = rng.integers(-4, 5, count).astype(np.float64)
        if dtype == "bfloat16":
            return f32_to_bf16_bits(values.astype(np.float32))
        return values.astype(kind)
    info = np.iinfo(kind)
    if op == "avg":
        low, high = (0, 100) if info.min == 0 else (-50, 51)
        return rng.integers(low, high, count).astype(kind)
    # Full range: sums and products wrap, identically in rdist and numpy.
    return rng.integers(info.min, info.max, count, dtype=kind, endpoint=True)


def reduce_reference(inputs, dtype, op):
    """Element-wise `op` over the ranks' inputs, as rdist defines it."""
    n = len(inputs)
    if dtype in ("float16", "bfloat16"):
        # rdist combines in float32 and rounds back; exact here, except AVG's
        # one division, which both sides do in float32.
        wide = [bf16_bits_to_f32(x) if dtype == "bfloat16" else x.astype(np.float32) for x in inputs]
        result = _reduce_same_type(np.stack(wide), np.float32, op, n)
        return f32_to_bf16_bits(result) if dtype == "bfloat16" else result.astype(np.float16)
    kind = storage(dtype)
    return _reduce_same_type(np.stack(inputs), kind, op, n)


def _reduce_same_type(stack, kind, op, n):
    kind = np.dtype(kind)
    with np.errstate(over="ignore"):
        if op in ("sum", "avg"):
            total = np.add.reduce(stack, axis=0, dtype=kind)
        elif op == "prod":
            total = np.multiply.reduce(stack, axis=0, dtype=kind)
        elif op == "max":
            return np.maximum.reduce(stack, axis=0)
        else:
            return np.minimum.reduce(stack, axis=0)
    if op != "avg":
        return total
    if kind.kind == "f":
        return (total / kind.type(n)).astype(kind)
    if kind.kind == "u":
        return (total // n).astype(kind)
    # Signed integers: truncating division (numpy's // floors).
    wide = total.astype(np.int64)
    return (np.sign(wide) * (np.abs(wide) // n)).astype(kind)


def describe_difference(got, expected):
    got_bytes = np.ascontiguousarray(got).view(np.uint8)
    want_bytes = np.ascontiguousarray(expected).view(np.uint8)
    if got_bytes.shape != want_bytes.shape:
        return f"shape {got.shape} != expected {expected.shape}"
    if np.array_equal(got_bytes, want_bytes):
        return None
    mismatched = np.flatnonzero(
        (got_bytes.reshape(len(got), -1) != want_bytes.reshape(len(expected), -1)).any(axis=1)
    )
    index = int(mismatched[0])
    return (
        f"{len(mismatched)} of {len(got)} elements differ; first at {index}: "
        f"got {got[index]!r}, expected {expected[index]!r}"
    )


def as_argument(array, count):
    """Odd small counts go through a memoryview, exercising the
    buffer-protocol path (formats 'b', 'e', 'H', ...) instead of numpy's."""
    return memoryview(array) if count == 7 else array


def run_case(comm, case, collective, dtype, count, op, placement):
    """Runs one case; returns None on success, else what went wrong."""
    size, rank = comm.size, comm.rank
    root = case % size
    override = "bfloat16" if dtype == "bfloat16" else None
    per_rank = count * size if collective in ("reduce_scatter", "alltoall") else count
    if collective == "scatter":
        per_rank = count * size  # only the root's is sent
    inputs = [make_input(case, r, per_rank, dtype, op) for r in range(size)]
    mine = inputs[rank].copy()
    kind = storage(dtype)

    def blank(n):
        """An output buffer of n elements, pre-filled with a recognisable pattern."""
        return np.full(n * kind.itemsize, 0x5A, np.uint8).view(kind)

    in_place = placement == "inplace"
    if collective == "allreduce":
        expected = reduce_reference(inputs, dtype, op)
        if in_place:
            comm.allreduce(as_argument(mine, count), op, dtype=override)
            return describe_difference(mine, expected)
        out = blank(count)
        comm.allreduce(mine, op, out=as_argument(out, count), dtype=override)
        return describe_difference(out, expected) or describe_difference(mine, inputs[rank])
    if collective == "reduce":
        expected = reduce_reference(inputs, dtype, op)
        if in_place:
            comm.reduce(mine, op, root, dtype=override)
            return describe_difference(mine, expected if rank == root else inputs[rank])
        out = blank(count)
        comm.reduce(mine, op, root, out=as_argument(out, count), dtype=override)
        return describe_difference(out, expected) if rank == root else None
    if collective == "broadcast":
        if in_place:
            comm.broadcast(as_argument(mine, count), root, dtype=override)
            return describe_difference(mine, inputs[root])
        out = blank(count)
        comm.broadcast(mine, root, out=as_argument(out, count), dtype=override)
        return describe_difference(out, inputs[root])
    if collective == "allgather":
        expected = np.concatenate(inputs)
        out = blank(count * size)
        if in_place:
            out[rank * count:(rank + 1) * count] = mine
            comm.allgather(out[rank * count:(rank + 1) * count], out, dtype=override)
        else:
            comm.allgather(mine, as_argument(out, count), dtype=override)
        return describe_difference(out, expected)
    if collective == "reduce_scatter":
        expected = reduce_reference(inputs, dtype, op)[rank * count:(rank + 1) * count]
        out = blank(count)
        comm.reduce_scatter(mine, as_argument(out, count), op, dtype=override)
        return describe_difference(out, expected)
    if collective == "gather":
        out = blank(count * size) if rank == root else None
        comm.gather(mine, out, root, dtype=override)
        return describe_difference(out, np.concatenate(inputs)) if rank == root else None
    if collective == "scatter":
        out = blank(count)
        comm.scatter(mine if rank == root else None, as_argument(out, count), root, dtype=override)
        return describe_difference(out, inputs[root][rank * count:(rank + 1) * count])
    if collective == "alltoall":
        out = blank(count * size)
        comm.alltoall(mine, as_argument(out, count), dtype=override)
        expected = np.concatenate([x[rank * count:(rank + 1) * count] for x in inputs])
        return describe_difference(out, expected)
    raise AssertionError(collective)


def cases(collectives, large_bytes):
    """Every (collective, dtype, count, op, placement), in one fixed order.
    Counts: none, one, odd, and an odd count of more than `large_bytes`
    (beyond 64 KiB, large allreduces switch to the ring algorithm)."""
    for collective in collectives:
        for dtype in DTYPES:
            for count in [0, 1, 7, large_bytes // storage(dtype).itemsize + 1]:
                for op in OPS if collective in REDUCING else [None]:
                    placements = ["inplace", "out"] if collective in IN_PLACE else ["out"]
                    for placement in placements:
                        yield collective, dtype, count, op, placement


def case_id(collective, dtype, count, op, placement):
    return f"{collective}/{dtype}/n{count}/{op or '-'}/{placement}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--large-bytes", type=int, default=80 * 1024)
    parser.add_argument("--option", action="append", default=[])
    args = parser.parse_args()
    options = dict(item.split("=", 1) for item in args.option)
    options.setdefault("timeout_ms", "20000")
    started = time.monotonic()
    with rdist.init(**options) as comm:
        ids, failures = [], {}
        for number, case in enumerate(cases(args.collectives.split(","), args.large_bytes)):
            name = case_id(*case)
            ids.append(name)
            try:
                problem = run_case(comm, number, *case)
            except rdist.Error as error:
                problem = "{error}: {message}".format(**error_fields(error))
            if problem:
                failures[name] = problem
        comm.barrier()
    report(
        rank=comm.rank,
        size=comm.size,
        cases=ids,
        failures=failures,
        seconds=round(time.monotonic() - started, 2),
    )


if __name__ == "__main__":
    main()
