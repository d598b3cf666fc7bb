"""rdist: collective communication for CPU (and NCCL) process groups.

A pure-ctypes binding of librdist's C API (include/rdist.h)::

    import numpy as np
    import rdist

    with rdist.init() as comm:              # env:// (rdistrun, torchrun, Slurm)
        grad = np.ones(1000, np.float32) * comm.rank
        comm.allreduce(grad, op="avg")      # in place
        comm.broadcast(grad, root=0)

The library is found through ``RDIST_LIBRARY``, next to this package, in a
source checkout's ``target/`` directory, or on the system library path (see
:mod:`rdist._library`); ``rdist.library_path`` says which was loaded.
numpy is optional: torch tensors (CPU and CUDA, by data pointer), DLPack
and C-contiguous buffer-protocol objects work too. ``rdist.init_process_group``
and friends keep a default communicator as torch.distributed does, and
``import rdist.torch`` registers rdist as a torch.distributed backend.
"""

from ._library import LibraryNotFoundError, lib as _lib, library_path
from ._errors import (
    AbortedError,
    AuthError,
    BackendError,
    CommTimeoutError,
    Error,
    InternalError,
    InvalidArgumentError,
    InvalidUsageError,
    MismatchError,
    PeerLostError,
    Result,
    SystemCallError,
    UnavailableError,
)
from ._buffers import DType, Op
from ._comm import (
    SHRINK_ABORT,
    SHRINK_DEFAULT,
    SPLIT_NOCOLOR,
    Backend,
    Comm,
    Request,
    group,
    group_end,
    group_start,
    init,
    init_rank,
    unique_id,
    wait_all,
)

from ._default import (
    NON_GROUP_MEMBER,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    destroy_process_group,
    gather,
    get_default_comm,
    get_rank,
    get_world_size,
    init_from_store,
    init_process_group,
    is_initialized,
    new_group,
    recv,
    reduce,
    reduce_scatter_tensor,
    scatter,
    send,
    shrink_group,
)

#: Version of this Python package.
__version__ = "0.2.0"


def library_version():
    """The loaded librdist's version as a (major, minor, patch) tuple."""
    packed = _lib.rdist_version()
    return (packed // 10000, packed // 100 % 100, packed % 100)


def nccl_version():
    """The version of the NCCL library rdist would drive, as a (major,
    minor, patch) tuple; needs no GPU. Raises UnavailableError, saying what
    was tried, when no NCCL can be loaded."""
    import ctypes

    from ._errors import check

    code = ctypes.c_int(-1)
    check(_lib.rdist_nccl_version(ctypes.byref(code)))
    packed = code.value
    if packed >= 10000:  # NCCL_VERSION since 2.9: X*10000 + Y*100 + Z
        return (packed // 10000, packed // 100 % 100, packed % 100)
    return (packed // 1000, packed // 100 % 10, packed % 100)


__all__ = [
    "NON_GROUP_MEMBER",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "gather",
    "get_default_comm",
    "get_rank",
    "get_world_size",
    "init_from_store",
    "init_process_group",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "shrink_group",
    "AbortedError",
    "AuthError",
    "Backend",
    "BackendError",
    "Comm",
    "CommTimeoutError",
    "DType",
    "Error",
    "InternalError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "LibraryNotFoundError",
    "MismatchError",
    "Op",
    "PeerLostError",
    "Request",
    "Result",
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "SPLIT_NOCOLOR",
    "SystemCallError",
    "UnavailableError",
    "group",
    "group_end",
    "group_start",
    "init",
    "init_rank",
    "library_path",
    "library_version",
    "nccl_version",
    "unique_id",
    "wait_all",
]
