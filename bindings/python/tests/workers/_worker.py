"""Shared by the worker scripts that the tests start as ranks: reporting
results to the test as `RESULT {json}` lines, and numpy reference helpers."""

import json
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


def fail(message):
    """Reports a failure and exits non-zero."""
    report(ok=False, message=message)
    sys.exit(1)
