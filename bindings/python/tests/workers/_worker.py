"""Shared by the worker scripts that the tests start as ranks: reporting
results to the test as `RESULT {json}` lines, and numpy reference helpers."""

import json
import os
import sys

try:
    import numpy as np
except ImportError:  # the numpy_free scenario hides numpy on purpose
    np = None


def report(**fields):
    """One machine-readable line for the test to parse."""
    print("RESULT " + json.dumps(fields), flush=True)


def error_fields(error):
    """How a caught rdist.Error is reported."""
    return {
        "error": type(error).__name__,
        "code": int(getattr(error, "code", -1)),
        "message": str(error),
    }


def f32_to_bf16_bits(values):
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even
    (as rdist and the `half` crate do; no NaNs expected)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits):
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def exit_without_teardown():
    """Ends a torch rank that is done (results reported, process groups
    destroyed) without the interpreter's teardown. torch 2.4's gloo frees a
    finished collective's tensors on its own thread, which must take the
    GIL; while the interpreter finalizes, that thread is ended from inside
    a destructor and the process aborts ("terminate called without an
    active exception", exit -6) after every result was right: seen about
    once in 14 runs of torch_ops.py at 3 ranks, with any librdist."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fail(message):
    """Reports a failure and exits non-zero."""
    report(ok=False, message=message)
    sys.exit(1)
