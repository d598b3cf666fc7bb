//! Communicator creation, queries, split, shrink, abort and destroy.

use super::options::c_str;
use super::types::*;
use super::{boundary, check_out, handle, handles, write_out};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::options::Options;
use std::ffi::c_int;

/// The options of `opts`: NULL is the defaults.
fn options_of(opts: *const rdist_options_t) -> Result<Options> {
    if opts.is_null() {
        return Ok(Options::default());
    }
    Ok((*handle(opts, "opts")?.opts).clone())
}

fn publish(out: *mut *mut rdist_comm_t, comm: Comm) -> Result<()> {
    write_out(out, "out", rdist_comm_t::create(comm))
}

fn rank_hint(rank: c_int) -> Option<usize> {
    (rank >= 0).then_some(rank as usize)
}

/// torch.distributed-style creation. `init_method` is "env://",
/// "tcp://HOST:PORT" or "file:///path"; `rank`/`world_size` -1 read RANK /
/// WORLD_SIZE (falling back to Slurm's and Open MPI's variables). env://
/// reads MASTER_ADDR and MASTER_PORT (under srun without MASTER_ADDR: the
/// step's first node, and a port from the job and step ids unless
/// MASTER_PORT is set); with both -1 and none of those
/// variables set (no launcher), it is a world of one, as under MPI, and
/// needs neither. `opts` may be NULL. Blocks until all
/// world_size ranks have joined or timeout_ms passes; on timeout the error
/// names the ranks that never arrived. Returns on no rank before every
/// rank's communicator is set up (as NCCL's init); a rank that fails to
/// set up fails init on every rank, with its reason and its rank. On
/// failure *out is left unchanged.
#[no_mangle]
pub extern "C" fn rdist_init(
    out: *mut *mut rdist_comm_t,
    init_method: *const std::ffi::c_char,
    rank: c_int,
    world_size: c_int,
    opts: *const rdist_options_t,
) -> rdist_result_t {
    boundary("rdist_init", rank_hint(rank), || {
        check_out(out, "out")?;
        let method = c_str(init_method, "init_method")?;
        let comm = Comm::init(method, rank.into(), world_size.into(), &options_of(opts)?)?;
        publish(out, comm)
    })
}

/// NCCL-style bootstrap, step 1: creates an id and hosts its rendezvous in
/// this process until every rank has joined (or timeout_ms). Ship the
/// bytes to every rank by your own means; an id is good for one
/// communicator.
#[no_mangle]
pub extern "C" fn rdist_get_unique_id(out: *mut rdist_unique_id_t) -> rdist_result_t {
    boundary("rdist_get_unique_id", None, || {
        check_out(out, "out")?;
        let bytes = Comm::unique_id()?;
        let mut id = rdist_unique_id_t {
            internal: [0; RDIST_UNIQUE_ID_BYTES],
        };
        for (d, s) in id.internal.iter_mut().zip(bytes) {
            *d = s as std::ffi::c_char;
        }
        write_out(out, "out", id)
    })
}

/// NCCL-style bootstrap, step 2: joins the communicator of `id` as `rank`
/// of `world_size` (id by value, as ncclCommInitRank); returns once every
/// rank's communicator is set up, as rdist_init. On failure *out is left
/// unchanged.
#[no_mangle]
pub extern "C" fn rdist_comm_init_rank(
    out: *mut *mut rdist_comm_t,
    world_size: c_int,
    id: rdist_unique_id_t,
    rank: c_int,
    opts: *const rdist_options_t,
) -> rdist_result_t {
    boundary("rdist_comm_init_rank", rank_hint(rank), || {
        check_out(out, "out")?;
        let mut bytes = [0u8; RDIST_UNIQUE_ID_BYTES];
        for (d, s) in bytes.iter_mut().zip(id.internal) {
            *d = s as u8;
        }
        let comm = Comm::init_rank(&bytes, rank.into(), world_size.into(), &options_of(opts)?)?;
        publish(out, comm)
    })
}

/// A live communicator of this process (not of the one it was forked
/// from: docs/api.md, fork()).
fn usable<'a>(comm: *const rdist_comm_t) -> Result<&'a Comm> {
    let c = &handle(comm, "comm")?.comm;
    c.check_process()?;
    Ok(c)
}

/// A query into the out-parameter `name`.
fn query(
    func: &str,
    comm: *const rdist_comm_t,
    out: *mut c_int,
    name: &str,
    get: impl FnOnce(&Comm) -> usize,
) -> rdist_result_t {
    boundary(func, rank_of(comm), || {
        let c = usable(comm)?;
        write_out(out, name, get(c) as c_int)
    })
}

/// This process's rank in `comm`.
#[no_mangle]
pub extern "C" fn rdist_comm_rank(comm: *const rdist_comm_t, rank: *mut c_int) -> rdist_result_t {
    query("rdist_comm_rank", comm, rank, "rank", Comm::rank)
}

/// The number of ranks in `comm`.
#[no_mangle]
pub extern "C" fn rdist_comm_size(comm: *const rdist_comm_t, size: *mut c_int) -> rdist_result_t {
    query("rdist_comm_size", comm, size, "size", Comm::size)
}

/// This process's rank among the ranks of `comm` on the same host.
#[no_mangle]
pub extern "C" fn rdist_comm_local_rank(
    comm: *const rdist_comm_t,
    local_rank: *mut c_int,
) -> rdist_result_t {
    query(
        "rdist_comm_local_rank",
        comm,
        local_rank,
        "local_rank",
        Comm::local_rank,
    )
}

/// The backend `comm` runs on (never RDIST_BACKEND_AUTO).
#[no_mangle]
pub extern "C" fn rdist_comm_backend(
    comm: *const rdist_comm_t,
    backend: *mut rdist_backend_t,
) -> rdist_result_t {
    boundary("rdist_comm_backend", rank_of(comm), || {
        let c = usable(comm)?;
        check_out(backend, "backend")?;
        let value = match c.backend() {
            crate::options::Backend::Nccl => rdist_backend_t::RDIST_BACKEND_NCCL,
            _ => rdist_backend_t::RDIST_BACKEND_SOCKET,
        };
        write_out(backend, "backend", value)
    })
}

/// Collective over `comm`: ranks with equal `color` form a new
/// communicator, ordered by (key, old rank). `color` RDIST_SPLIT_NOCOLOR
/// yields *out = NULL. On failure *out is left unchanged.
#[no_mangle]
pub extern "C" fn rdist_comm_split(
    comm: *mut rdist_comm_t,
    color: c_int,
    key: c_int,
    out: *mut *mut rdist_comm_t,
) -> rdist_result_t {
    let rank = rank_of(comm);
    boundary("rdist_comm_split", rank, || {
        let c = handle(comm, "comm")?;
        check_out(out, "out")?;
        match c.comm.split(color, key)? {
            Some(child) => publish(out, child),
            None => write_out(out, "out", std::ptr::null_mut()),
        }
    })
}

/// A new communicator of `comm`'s ranks but the `exclude_count` ranks of
/// `exclude_ranks` and those that failed (NCCL's ncclCommShrink, with
/// agreement). Every rank that stays calls it; excluded and failed ranks
/// do not. With `exclude_ranks` NULL and `exclude_count` 0 the survivors
/// agree which ranks failed, whatever each had noticed, and leave exactly
/// those out; the new ranks keep the old order. Works on a communicator
/// that failed or was aborted, which stays usable for split, abort and
/// destroy. `opts` NULL keeps `comm`'s settings; otherwise its timeout
/// bounds the shrink and the new communicator. `flags`:
/// RDIST_SHRINK_DEFAULT (queued calls finish first) or RDIST_SHRINK_ABORT
/// (abort `comm` first, ending its calls in flight). On failure *out is
/// left unchanged. Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_comm_shrink(
    comm: *mut rdist_comm_t,
    exclude_ranks: *const c_int,
    exclude_count: c_int,
    out: *mut *mut rdist_comm_t,
    opts: *const rdist_options_t,
    flags: c_int,
) -> rdist_result_t {
    let rank = rank_of(comm);
    boundary("rdist_comm_shrink", rank, || {
        let c = handle(comm, "comm")?;
        check_out(out, "out")?;
        if exclude_count < 0 {
            return Err(Error::invalid_argument(format!(
                "exclude_count {exclude_count} is negative"
            )));
        }
        if exclude_count as usize >= c.comm.size() {
            return Err(Error::invalid_argument(format!(
                "exclude_count {exclude_count} leaves none of the communicator's {} ranks",
                c.comm.size()
            )));
        }
        if exclude_count > 0 && exclude_ranks.is_null() {
            return Err(Error::invalid_argument(format!(
                "exclude_ranks is NULL but exclude_count is {exclude_count}"
            )));
        }
        let abort_first = match flags {
            RDIST_SHRINK_DEFAULT => false,
            RDIST_SHRINK_ABORT => true,
            other => {
                return Err(Error::invalid_argument(format!(
                    "flags {other} is not RDIST_SHRINK_DEFAULT (0) or RDIST_SHRINK_ABORT (1)"
                )))
            }
        };
        let exclude: Vec<usize> = (0..exclude_count as usize)
            .map(|i| {
                // SAFETY: exclude_ranks holds exclude_count ints (the
                // contract), and i < exclude_count.
                let r = unsafe { exclude_ranks.add(i).read() };
                usize::try_from(r).map_err(|_| {
                    Error::invalid_argument(format!("exclude_ranks[{i}] is {r}, a negative rank"))
                })
            })
            .collect::<Result<_>>()?;
        let opts = match opts.is_null() {
            true => None,
            false => Some(options_of(opts)?),
        };
        let child = c.comm.shrink(&exclude, abort_first, opts.as_ref())?;
        publish(out, child)
    })
}

/// The ranks this rank knows to have failed in `comm` (their connection
/// broke: they died or left, or their host or the network between failed;
/// or, while this rank waited for them, their process stopped answering), in
/// ascending order: the first `capacity` of them go to `ranks` (which may
/// be NULL when `capacity` is 0), and `*count` is how many there are, so
/// a call with capacity 0 sizes the array. Callable from any thread, also
/// after a call failed. Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_comm_failed_ranks(
    comm: *const rdist_comm_t,
    ranks: *mut c_int,
    capacity: c_int,
    count: *mut c_int,
) -> rdist_result_t {
    boundary("rdist_comm_failed_ranks", rank_of(comm), || {
        let c = usable(comm)?;
        check_out(count, "count")?;
        if capacity < 0 {
            return Err(Error::invalid_argument(format!(
                "capacity {capacity} is negative"
            )));
        }
        if capacity > 0 && ranks.is_null() {
            return Err(Error::invalid_argument(format!(
                "ranks is NULL but capacity is {capacity}"
            )));
        }
        let failed = c.failed_ranks();
        for (i, r) in failed.iter().take(capacity as usize).enumerate() {
            // SAFETY: ranks holds `capacity` ints (the contract), and
            // i < capacity.
            unsafe { ranks.add(i).write(*r as c_int) };
        }
        write_out(count, "count", failed.len() as c_int)
    })
}

/// Makes every pending and future operation on `comm`, on every rank that
/// can still be reached, fail promptly with RDIST_ERR_ABORTED. Callable
/// from any thread while another thread is blocked in `comm`.
#[no_mangle]
pub extern "C" fn rdist_comm_abort(comm: *mut rdist_comm_t) -> rdist_result_t {
    let rank = rank_of(comm);
    boundary("rdist_comm_abort", rank, || {
        usable(comm)?.abort();
        Ok(())
    })
}

/// Local: needs no other rank. Finishes this rank's queued non-blocking
/// calls, lets data already handed to rdist reach the peers, then frees
/// every thread, socket and buffer of `comm`. A send still waiting for its
/// receive is waited for up to the timeout (said on stderr after
/// `peer_check_ms`); one to a rank whose process does not answer (stopped,
/// or its host gone) fails with RDIST_ERR_PEER_LOST within about 15 s.
/// A peer that later waits on this rank gets RDIST_ERR_PEER_LOST. NULL is
/// a no-op.
#[no_mangle]
pub extern "C" fn rdist_comm_destroy(comm: *mut rdist_comm_t) -> rdist_result_t {
    boundary("rdist_comm_destroy", rank_of(comm), || {
        handles::retire(comm, "comm")
    })
}

/// The rank of a communicator handle, for error messages.
pub(crate) fn rank_of(comm: *const rdist_comm_t) -> Option<usize> {
    handle(comm, "comm").ok().map(|c| c.comm.rank())
}
