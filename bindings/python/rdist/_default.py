"""A module-level default communicator, as torch.distributed has, and
creating communicators through a key-value store (a torch ``Store``).

::

    import rdist

    rdist.init_process_group()                 # env:// (rdistrun, torchrun, Slurm)
    rdist.all_reduce(grad, op="avg")           # on the default communicator
    evens = rdist.new_group([0, 2])            # rdist_comm_split underneath
    if evens is not rdist.NON_GROUP_MEMBER:
        rdist.broadcast(grad, src=0, group=evens)
    try:
        rdist.all_reduce(grad)
    except rdist.PeerLostError:
        rdist.shrink_group()                   # the survivors go on as the default
    rdist.destroy_process_group()
"""

import itertools
import operator
import threading

from ._comm import SHRINK_DEFAULT, SPLIT_NOCOLOR, Comm, init, init_rank, unique_id
from ._errors import InvalidArgumentError, InvalidUsageError

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
]


class _NonGroupMember:
    """What :func:`new_group` returns on ranks outside the group (torch's
    ``GroupMember.NON_GROUP_MEMBER``): collectives given it do nothing and
    return None, and ``get_rank(group)`` is -1."""

    rank = -1
    size = -1

    def __repr__(self):
        return "rdist.NON_GROUP_MEMBER"

    def __bool__(self):
        return False


#: Returned by :func:`new_group` on ranks that are not in the group.
NON_GROUP_MEMBER = _NonGroupMember()

_lock = threading.Lock()
_default = None
_groups = []  # communicators new_group made from the default one


def init_process_group(init_method="env://", rank=-1, world_size=-1, **options):
    """Creates the default communicator (as :func:`rdist.init`, same
    arguments and options) and returns it. Raises InvalidUsageError if one
    exists; :func:`destroy_process_group` first."""
    global _default
    with _lock:
        if _default is not None:
            raise InvalidUsageError(
                "rdist.init_process_group: the default communicator already exists; "
                "call rdist.destroy_process_group() first"
            )
        _default = init(init_method, rank, world_size, **options)
        return _default


def is_initialized():
    """Whether the default communicator exists."""
    return _default is not None


def get_default_comm():
    """The default :class:`Comm`; InvalidUsageError before init_process_group."""
    comm = _default
    if comm is None:
        raise InvalidUsageError(
            "rdist: no default communicator; call rdist.init_process_group() first"
        )
    return comm


def _comm(group):
    return get_default_comm() if group is None else group


def get_rank(group=None):
    """This process's rank in ``group`` (the default communicator when None);
    -1 on a rank outside it."""
    return _comm(group).rank


def get_world_size(group=None):
    """The number of ranks in ``group``; -1 on a rank outside it."""
    return _comm(group).size


def destroy_process_group(group=None):
    """Destroys ``group``, or with None the default communicator and every
    group made from it by :func:`new_group`."""
    global _default
    if group is NON_GROUP_MEMBER:
        return
    if group is not None:
        if group in _groups:
            _groups.remove(group)
        group.destroy()
        return
    with _lock:
        comm, _default = _default, None
        groups, _groups[:] = list(_groups), []
    for child in groups:
        child.destroy()
    if comm is not None:
        comm.destroy()


def new_group(ranks=None):
    """A communicator of the default communicator's ``ranks`` (all when
    None), ordered as listed. Collective over the default communicator: every
    rank calls it, members or not (as torch's ``new_group``). Ranks outside
    the group get :data:`NON_GROUP_MEMBER`."""
    parent = get_default_comm()
    if ranks is None:
        ranks = range(parent.size)
    ranks = [operator.index(r) for r in ranks]
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < parent.size for r in ranks):
        raise InvalidArgumentError(
            f"rdist.new_group: ranks must be distinct ranks of 0..{parent.size - 1}, got {ranks}"
        )
    if parent.rank in ranks:
        child = parent.split(0, ranks.index(parent.rank))
    else:
        child = parent.split(SPLIT_NOCOLOR)
    if child is None:
        return NON_GROUP_MEMBER
    _groups.append(child)
    return child


def shrink_group(ranks_to_exclude=None, group=None, shrink_flags=SHRINK_DEFAULT, **options):
    """torch.distributed.shrink_group's counterpart: a communicator of
    ``group``'s ranks (the default communicator's when None) but
    ``ranks_to_exclude`` and those that failed (see :meth:`Comm.shrink`;
    None: the survivors agree which failed). Every rank that stays calls it.
    The old group is destroyed; shrinking the default communicator makes the
    new one the default and destroys the groups made from the old one, as
    torch does. Returns the new communicator."""
    global _default
    old = _comm(group)
    if old is NON_GROUP_MEMBER:
        raise InvalidUsageError("rdist.shrink_group: this rank is not in the group")
    new = old.shrink(ranks_to_exclude, shrink_flags, **options)
    if group is not None and group is not _default:
        if group in _groups:
            _groups[_groups.index(group)] = new
        old.destroy()
        return new
    with _lock:
        _default = new
        groups, _groups[:] = list(_groups), []
    for child in groups:
        child.destroy()
    old.destroy()
    return new


# ---------------------------------------------------------------------------
# Creating a communicator through a store (torch.distributed's Store)
# ---------------------------------------------------------------------------

_store_calls = itertools.count()


def init_from_store(store, rank, world_size, prefix="rdist", **options):
    """Creates a :class:`Comm` of ``world_size`` ranks through ``store``, a
    key-value store with ``set(key, bytes)`` and a blocking ``get(key)``
    (a ``torch.distributed`` Store: TCPStore, FileStore, PrefixStore, the
    default group's store...). Collective: every rank calls it.

    Rank 0 makes an rdist unique id (and hosts the rendezvous until every
    rank has joined) and publishes it under ``{prefix}/unique_id/{n}``; the
    others read it (``store.get`` waits, bounded by the store's timeout),
    then all join with :func:`rdist.init_rank`. ``n`` counts this process's
    calls, so repeated calls use distinct keys (every rank must make the
    same calls in the same order, as with torch's groups). ``options`` as
    for :func:`rdist.init`.
    """
    rank = operator.index(rank)
    world_size = operator.index(world_size)
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"rdist.init_from_store: rank {rank} is not in 0..{world_size - 1}"
        )
    key = f"{prefix}/unique_id/{next(_store_calls)}"
    if rank == 0:
        uid = unique_id()
        store.set(key, uid)
    else:
        uid = bytes(store.get(key))
    return init_rank(world_size, uid, rank, **options)


# ---------------------------------------------------------------------------
# Collectives on the default communicator (torch.distributed's names)
# ---------------------------------------------------------------------------


def _run(comm, name, args, kwargs, async_op):
    if comm is NON_GROUP_MEMBER:
        return None
    method = getattr(comm, ("i" + name) if async_op else name)
    result = method(*args, **kwargs)
    return result if async_op else None


def all_reduce(tensor, op="sum", group=None, async_op=False):
    """In-place allreduce of ``tensor`` over ``group``; with ``async_op`` a
    :class:`Request` to wait on."""
    return _run(_comm(group), "allreduce", (tensor, op), {}, async_op)


def broadcast(tensor, src=0, group=None, async_op=False):
    """``tensor`` of rank ``src`` (a rank of ``group``) to every rank, in place."""
    return _run(_comm(group), "broadcast", (tensor, src), {}, async_op)


def reduce(tensor, dst=0, op="sum", group=None, async_op=False):
    """Reduces into ``tensor`` on rank ``dst`` (others' are left as they were)."""
    return _run(_comm(group), "reduce", (tensor, op, dst), {}, async_op)


def all_gather_into_tensor(output, input, group=None, async_op=False):
    """Every rank's ``input`` concatenated into ``output`` in rank order."""
    return _run(_comm(group), "allgather", (input, output), {}, async_op)


def reduce_scatter_tensor(output, input, op="sum", group=None, async_op=False):
    """Reduces ``input`` (size x len(output)) and leaves block rank in ``output``."""
    return _run(_comm(group), "reduce_scatter", (input, output, op), {}, async_op)


def gather(tensor, gather_tensor=None, dst=0, group=None, async_op=False):
    """Every rank's ``tensor`` concatenated into ``gather_tensor`` on ``dst``."""
    return _run(_comm(group), "gather", (tensor, gather_tensor, dst), {}, async_op)


def scatter(tensor, scatter_tensor=None, src=0, group=None, async_op=False):
    """Block r of ``scatter_tensor`` on ``src`` into rank r's ``tensor``."""
    return _run(_comm(group), "scatter", (scatter_tensor, tensor, src), {}, async_op)


def all_to_all_single(output, input, group=None, async_op=False):
    """Block j of ``input`` to rank j; block i of ``output`` from rank i."""
    return _run(_comm(group), "alltoall", (input, output), {}, async_op)


def send(tensor, dst, group=None):
    """Sends ``tensor`` to rank ``dst``."""
    return _run(_comm(group), "send", (tensor, dst), {}, False)


def recv(tensor, src, group=None):
    """Receives into ``tensor`` from rank ``src``."""
    return _run(_comm(group), "recv", (tensor, src), {}, False)


def barrier(group=None, async_op=False):
    """Returns when every rank of ``group`` has entered the barrier."""
    return _run(_comm(group), "barrier", (), {}, async_op)
