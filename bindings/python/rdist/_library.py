"""Finding and loading librdist, and the ctypes declaration of every function
in include/rdist.h.

Search order (first hit wins):

1. ``RDIST_LIBRARY``: an explicit path; if it cannot be loaded that is an
   error, never a silent fallback to some other copy.
2. Next to the package: ``rdist/lib/librdist.so``, then ``rdist/librdist.so``
   (``pip install ./bindings/python`` builds the library with cargo and
   bundles it as ``rdist/lib/librdist.so``: an installed package needs
   nothing else).
3. From a source checkout (``bindings/python/rdist`` inside the repository):
   ``target/release/librdist.so`` and ``target/debug/librdist.so``, the one
   built last first (a release build left from before a change must not
   shadow the debug build that has it).
4. The system's library search path: ``ctypes.util.find_library("rdist")``,
   then ``librdist.so.0`` and ``librdist.so`` through the dynamic loader
   (``LD_LIBRARY_PATH``, ``ldconfig``).
"""

import ctypes
import ctypes.util
import os
import sys
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int,
    c_size_t,
    c_void_p,
)
from pathlib import Path

__all__ = ["LibraryNotFoundError", "has", "lib", "library_path"]

#: Bytes in an rdist_unique_id_t.
UNIQUE_ID_BYTES = 128


class LibraryNotFoundError(ImportError):
    """librdist could not be found or loaded; the message lists every place
    that was tried and why each failed."""


if sys.platform == "darwin":
    _FILE_NAME = "librdist.dylib"
    _SYSTEM_NAMES = ("librdist.0.dylib", "librdist.dylib")
else:
    _FILE_NAME = "librdist.so"
    _SYSTEM_NAMES = ("librdist.so.0", "librdist.so")

_PACKAGE_DIR = Path(__file__).resolve().parent


def _checkout_root():
    """The repository root when this package runs from a source checkout
    (bindings/python/rdist), else None."""
    root = _PACKAGE_DIR.parent.parent.parent
    cargo_toml = root / "Cargo.toml"
    try:
        if cargo_toml.is_file() and 'name = "rdist"' in cargo_toml.read_text():
            return root
    except OSError:
        pass
    return None


def _candidates():
    """Yields (description, Path or loader name) in search order, after
    RDIST_LIBRARY. A generator: find_library may run ldconfig or a compiler,
    so it only runs when nothing earlier was found."""
    yield "next to the package", _PACKAGE_DIR / "lib" / _FILE_NAME
    yield "next to the package", _PACKAGE_DIR / _FILE_NAME
    root = _checkout_root()
    if root is not None:
        builds = [root / "target" / profile / _FILE_NAME for profile in ("release", "debug")]

        def built_at(path):
            try:
                return path.stat().st_mtime
            except OSError:
                return float("-inf")

        for path in sorted(builds, key=built_at, reverse=True):
            yield "source checkout", path
    # None (nothing found) is reported as such in the error message.
    yield "system (find_library)", ctypes.util.find_library("rdist")
    for name in _SYSTEM_NAMES:
        yield "system (dynamic loader)", name


def _load():
    """Returns (CDLL, path) or raises LibraryNotFoundError."""
    explicit = os.environ.get("RDIST_LIBRARY")
    if explicit:
        try:
            return ctypes.CDLL(explicit), explicit
        except OSError as error:
            raise LibraryNotFoundError(
                f"rdist: cannot load the library named by RDIST_LIBRARY={explicit!r}: "
                f"{error}. Point RDIST_LIBRARY at a built librdist "
                f"(cargo build puts it in target/debug/{_FILE_NAME}) or unset it "
                "to search the default places."
            ) from None
    tried = []
    for where, path in _candidates():
        if path is None:
            tried.append(f'  find_library("rdist") ({where}): nothing found')
            continue
        if isinstance(path, Path) and not path.is_file():
            tried.append(f"  {path} ({where}): not found")
            continue
        try:
            return ctypes.CDLL(str(path)), str(path)
        except OSError as error:
            tried.append(f"  {path} ({where}): {error}")
    root = _checkout_root()
    if root is not None:
        # Running from a source checkout (PYTHONPATH=bindings/python, pip -e).
        what_to_do = (
            f"Build it with `cargo build` (or `cargo build --release`) in {root}, "
            f"or set RDIST_LIBRARY to the path of a built {_FILE_NAME}."
        )
    else:
        # An installed package whose wheel did not bundle the library.
        what_to_do = (
            f"This installed rdist package ({_PACKAGE_DIR}) has no bundled library. "
            "Reinstall it from an rdist checkout, which builds and bundles librdist "
            "(needs Rust's cargo): `pip install --force-reinstall /path/to/rdist/bindings/python`. "
            f"Or set RDIST_LIBRARY to a built {_FILE_NAME} (`cargo build --release` in the "
            f"rdist repository gives target/release/{_FILE_NAME}), or install rdist where "
            "the dynamic loader finds it (`cmake --install`, then ldconfig or LD_LIBRARY_PATH)."
        )
    raise LibraryNotFoundError(
        "rdist: cannot find the rdist shared library. Looked in:\n"
        "  RDIST_LIBRARY: not set\n"
        + "\n".join(tried)
        + "\n"
        + what_to_do
    )


class _Opaque(Structure):
    """Base of the opaque handle structs (never instantiated by Python)."""


class CommStruct(_Opaque):
    """rdist_comm_t."""


class RequestStruct(_Opaque):
    """rdist_request_t."""


class OptionsStruct(_Opaque):
    """rdist_options_t."""


# Distinct pointer types, so that ctypes refuses e.g. a request handle where
# a communicator is expected.
CommHandle = POINTER(CommStruct)
RequestHandle = POINTER(RequestStruct)
OptionsHandle = POINTER(OptionsStruct)


class Status(Structure):
    """rdist_status_t (since 0.2): who sent a received message, its tag and
    its element count."""

    _fields_ = [("source", c_int), ("tag", c_int), ("count", c_size_t)]


class UniqueId(Structure):
    """rdist_unique_id_t: opaque bytes, passed by value."""

    _fields_ = [("internal", c_char * UNIQUE_ID_BYTES)]


# Enum arguments travel as C ints (the header's enums are int-sized).
_result = c_int
_dtype = c_int
_op = c_int
_backend = c_int
_buf = c_void_p  # buffer addresses, as Python ints or None
_stream = c_void_p

_sizes = POINTER(c_size_t)

# Every function of include/rdist.h: name -> (restype, argtypes).
# tests/test_library.py checks this table against the header.
SIGNATURES = {
    # Collectives: blocking (stream last) and non-blocking (request last).
    "rdist_allreduce": (_result, [_buf, _buf, c_size_t, _dtype, _op, CommHandle, _stream]),
    "rdist_iallreduce": (
        _result,
        [_buf, _buf, c_size_t, _dtype, _op, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_broadcast": (_result, [_buf, _buf, c_size_t, _dtype, c_int, CommHandle, _stream]),
    "rdist_ibroadcast": (
        _result,
        [_buf, _buf, c_size_t, _dtype, c_int, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_reduce": (
        _result,
        [_buf, _buf, c_size_t, _dtype, _op, c_int, CommHandle, _stream],
    ),
    "rdist_ireduce": (
        _result,
        [_buf, _buf, c_size_t, _dtype, _op, c_int, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_allgather": (_result, [_buf, _buf, c_size_t, _dtype, CommHandle, _stream]),
    "rdist_iallgather": (
        _result,
        [_buf, _buf, c_size_t, _dtype, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_reduce_scatter": (
        _result,
        [_buf, _buf, c_size_t, _dtype, _op, CommHandle, _stream],
    ),
    "rdist_ireduce_scatter": (
        _result,
        [_buf, _buf, c_size_t, _dtype, _op, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_gather": (_result, [_buf, _buf, c_size_t, _dtype, c_int, CommHandle, _stream]),
    "rdist_igather": (
        _result,
        [_buf, _buf, c_size_t, _dtype, c_int, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_scatter": (_result, [_buf, _buf, c_size_t, _dtype, c_int, CommHandle, _stream]),
    "rdist_iscatter": (
        _result,
        [_buf, _buf, c_size_t, _dtype, c_int, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_alltoall": (_result, [_buf, _buf, c_size_t, _dtype, CommHandle, _stream]),
    "rdist_ialltoall": (
        _result,
        [_buf, _buf, c_size_t, _dtype, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_barrier": (_result, [CommHandle]),
    "rdist_ibarrier": (_result, [CommHandle, POINTER(RequestHandle)]),
    # Point to point and groups.
    "rdist_send": (_result, [_buf, c_size_t, _dtype, c_int, CommHandle, _stream]),
    "rdist_recv": (_result, [_buf, c_size_t, _dtype, c_int, CommHandle, _stream]),
    "rdist_isend": (
        _result,
        [_buf, c_size_t, _dtype, c_int, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_irecv": (
        _result,
        [_buf, c_size_t, _dtype, c_int, CommHandle, POINTER(RequestHandle)],
    ),
    # Since 0.2 (optional: see OPTIONAL below).
    "rdist_send_tagged": (_result, [_buf, c_size_t, _dtype, c_int, c_int, CommHandle, _stream]),
    "rdist_recv_tagged": (
        _result,
        [_buf, c_size_t, _dtype, c_int, c_int, CommHandle, _stream, POINTER(Status)],
    ),
    "rdist_isend_tagged": (
        _result,
        [_buf, c_size_t, _dtype, c_int, c_int, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_irecv_tagged": (
        _result,
        [_buf, c_size_t, _dtype, c_int, c_int, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_allgatherv": (
        _result,
        [_buf, c_size_t, _buf, _sizes, _sizes, _dtype, CommHandle, _stream],
    ),
    "rdist_iallgatherv": (
        _result,
        [_buf, c_size_t, _buf, _sizes, _sizes, _dtype, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_alltoallv": (
        _result,
        [_buf, _sizes, _sizes, _buf, _sizes, _sizes, _dtype, CommHandle, _stream],
    ),
    "rdist_ialltoallv": (
        _result,
        [_buf, _sizes, _sizes, _buf, _sizes, _sizes, _dtype, CommHandle, POINTER(RequestHandle)],
    ),
    "rdist_group_start": (_result, []),
    "rdist_group_end": (_result, []),
    # Requests.
    "rdist_wait": (_result, [RequestHandle]),
    "rdist_test": (_result, [RequestHandle, POINTER(c_int)]),
    "rdist_request_free": (None, [RequestHandle]),
    "rdist_request_status": (_result, [RequestHandle, POINTER(Status)]),
    # Communicators.
    "rdist_init": (_result, [POINTER(CommHandle), c_char_p, c_int, c_int, OptionsHandle]),
    "rdist_get_unique_id": (_result, [POINTER(UniqueId)]),
    "rdist_comm_init_rank": (
        _result,
        [POINTER(CommHandle), c_int, UniqueId, c_int, OptionsHandle],
    ),
    "rdist_comm_rank": (_result, [CommHandle, POINTER(c_int)]),
    "rdist_comm_size": (_result, [CommHandle, POINTER(c_int)]),
    "rdist_comm_local_rank": (_result, [CommHandle, POINTER(c_int)]),
    "rdist_comm_backend": (_result, [CommHandle, POINTER(_backend)]),
    "rdist_nccl_version": (_result, [POINTER(c_int)]),
    "rdist_comm_split": (_result, [CommHandle, c_int, c_int, POINTER(CommHandle)]),
    "rdist_comm_shrink": (
        _result,
        [CommHandle, POINTER(c_int), c_int, POINTER(CommHandle), OptionsHandle, c_int],
    ),
    "rdist_comm_abort": (_result, [CommHandle]),
    "rdist_comm_failed_ranks": (_result, [CommHandle, POINTER(c_int), c_int, POINTER(c_int)]),
    "rdist_comm_destroy": (_result, [CommHandle]),
    # Options.
    "rdist_options_create": (_result, [POINTER(OptionsHandle)]),
    "rdist_options_set": (_result, [OptionsHandle, c_char_p, c_char_p]),
    "rdist_options_destroy": (None, [OptionsHandle]),
    # Library.
    "rdist_version": (c_int, []),
    "rdist_result_string": (c_char_p, [_result]),
    "rdist_last_error": (c_char_p, []),
}


#: Functions added in 0.2 (docs/api.md, "since 0.2"): a 0.1 library lacks
#: them, and the binding then raises UnavailableError when one is needed
#: (see :func:`has`).
OPTIONAL = frozenset({
    "rdist_send_tagged", "rdist_recv_tagged", "rdist_isend_tagged", "rdist_irecv_tagged",
    "rdist_allgatherv", "rdist_iallgatherv", "rdist_alltoallv", "rdist_ialltoallv",
    "rdist_request_status",
})

_present = set()


def has(name):
    """Whether the loaded library exports ``name`` (e.g. "rdist_alltoallv")."""
    return name in _present


def _declare(cdll, path):
    missing = []
    for name, (restype, argtypes) in SIGNATURES.items():
        try:
            function = getattr(cdll, name)
        except AttributeError:
            if name not in OPTIONAL:
                missing.append(name)
            continue
        _present.add(name)
        function.restype = restype
        function.argtypes = argtypes
    if missing:
        raise LibraryNotFoundError(
            f"rdist: {path} lacks {', '.join(missing)}; it is not a librdist matching "
            "this binding (rebuild it, or point RDIST_LIBRARY at a current build)"
        )


lib, library_path = _load()
_declare(lib, library_path)
