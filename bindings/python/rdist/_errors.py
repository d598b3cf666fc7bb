"""Result codes and the exception raised for each."""

import enum

from ._library import lib

__all__ = [
    "AbortedError",
    "AuthError",
    "BackendError",
    "CommTimeoutError",
    "Error",
    "InternalError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "MismatchError",
    "PeerLostError",
    "Result",
    "SystemCallError",
    "UnavailableError",
]


class Result(enum.IntEnum):
    """rdist_result_t: what a call returned (values equal the C enum)."""

    SUCCESS = 0
    INVALID_ARGUMENT = 1
    INVALID_USAGE = 2
    TIMEOUT = 3
    PEER_LOST = 4
    MISMATCH = 5
    ABORTED = 6
    UNAVAILABLE = 7
    SYSTEM = 8
    BACKEND = 9
    AUTH = 10
    INTERNAL = 11

    @property
    def description(self):
        """The library's short text for this code (rdist_result_string)."""
        return lib.rdist_result_string(int(self)).decode("utf-8", "replace")


class Error(Exception):
    """Base of every rdist failure.

    ``code`` is the :class:`Result`; ``str(error)`` is the library's detail
    text (``rdist_last_error()``), naming the function, the rank and the cause.
    Catch a subclass (e.g. :class:`PeerLostError`) to handle one kind.
    """

    #: The Result this class stands for (subclasses override it).
    default_code = Result.INTERNAL

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = Result(code) if code is not None else self.default_code

    @property
    def message(self):
        """The detail text."""
        return self.args[0] if self.args else ""


class InvalidArgumentError(Error, ValueError):
    """Bad buffer, count, rank, dtype, op or option (also a ValueError)."""

    default_code = Result.INVALID_ARGUMENT


class InvalidUsageError(Error):
    """The call is not allowed in this state (e.g. a destroyed communicator)."""

    default_code = Result.INVALID_USAGE


class CommTimeoutError(Error, TimeoutError):
    """A bounded wait (the ``timeout_ms`` option) ran out; also the builtin
    TimeoutError. The message names the ranks that did not answer."""

    default_code = Result.TIMEOUT


class PeerLostError(Error):
    """A rank exited, crashed or disconnected."""

    default_code = Result.PEER_LOST


class MismatchError(Error):
    """Ranks called different collectives, counts or dtypes."""

    default_code = Result.MISMATCH


class AbortedError(Error):
    """The communicator was aborted (here or on another rank)."""

    default_code = Result.ABORTED


class UnavailableError(Error):
    """The requested backend is not usable here."""

    default_code = Result.UNAVAILABLE


class SystemCallError(Error):
    """An OS or network call failed."""

    default_code = Result.SYSTEM


class BackendError(Error):
    """NCCL or CUDA reported an error."""

    default_code = Result.BACKEND


class AuthError(Error):
    """A peer failed the job's authentication."""

    default_code = Result.AUTH


class InternalError(Error):
    """A bug in rdist."""

    default_code = Result.INTERNAL


_ERROR_CLASSES = {
    cls.default_code: cls
    for cls in (
        InvalidArgumentError,
        InvalidUsageError,
        CommTimeoutError,
        PeerLostError,
        MismatchError,
        AbortedError,
        UnavailableError,
        SystemCallError,
        BackendError,
        AuthError,
        InternalError,
    )
}


def error_for(code, message):
    """The exception for a failed call's result code and detail text."""
    try:
        result = Result(code)
    except ValueError:
        return InternalError(f"{message} (unknown result code {code})")
    if not message:
        message = result.description
    return _ERROR_CLASSES[result](message, result)


def last_error_text():
    """This thread's rdist_last_error() text."""
    return lib.rdist_last_error().decode("utf-8", "replace")


def check(code):
    """Raises the matching Error when a C call returned a failure code.

    Must be called on the thread that made the call, before any other rdist
    call: the detail text is thread-local and replaced by the next call.
    """
    if code != 0:
        raise error_for(code, last_error_text())
