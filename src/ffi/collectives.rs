//! Collectives and their non-blocking twins. Argument order and enum
//! values are NCCL's. `stream` is for device buffers and ignored for host
//! buffers; host calls return when the result is in recvbuf, device calls
//! once enqueued on `stream` (NCCL) or finished (staged through host
//! memory on the socket backend).

use super::types::*;
use super::{boundary_on, check_out, handle, write_out};
use crate::backend::cuda::Stream;
use crate::call::{Call, Data, Layout};
use crate::comm::Comm;
use crate::descriptor::OpKind;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use std::ffi::{c_int, c_void};

/// Validates a handle, builds the call and runs it (blocking) or starts it
/// (when `req` is given), writing the request handle on success only.
pub(crate) fn issue(
    func: &str,
    comm: *mut rdist_comm_t,
    req: Option<*mut *mut rdist_request_t>,
    stream: *mut c_void,
    build: impl FnOnce(&Comm) -> Result<Call>,
) -> rdist_result_t {
    boundary_on(func, comm, || {
        let c = &handle(comm, "comm")?.comm;
        if let Some(r) = req {
            check_out(r, "req")?;
        }
        let call = build(c)?;
        match req {
            // SAFETY: the C contract: buffers valid until the call returns
            // (or the group ends).
            None => unsafe { c.run_on(call, Stream::from_ptr(stream)) },
            Some(r) => {
                // SAFETY: the C contract: buffers valid until the request completes.
                let request = unsafe { c.submit(call) }?;
                write_out(r, "req", rdist_request_t::create(request))
            }
        }
    })
}

/// Builds a data call from C arguments (op is ignored where there is no reduction).
#[allow(clippy::too_many_arguments)]
pub(crate) fn data_call(
    c: &Comm,
    kind: OpKind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: RawDType,
    op: Option<RawOp>,
    root: c_int,
) -> Result<Call> {
    let dtype = DType::try_from(dtype)?;
    let op = op
        .map(ReduceOp::try_from)
        .transpose()?
        .unwrap_or(ReduceOp::Sum);
    Call::new(
        kind,
        send.cast(),
        recv.cast(),
        Data { count, dtype },
        op,
        root.into(),
        c.rank(),
        c.size(),
    )
}

/// recvbuf = element-wise `op` over every rank's sendbuf (count elements).
/// sendbuf == recvbuf is in place.
#[no_mangle]
pub extern "C" fn rdist_allreduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    op: RawOp,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    issue("rdist_allreduce", comm, None, stream, |c| {
        data_call(
            c,
            OpKind::AllReduce,
            sendbuf,
            recvbuf,
            count,
            dtype,
            Some(op),
            0,
        )
    })
}

/// Non-blocking twin of rdist_allreduce: the request handle replaces the stream.
/// Buffers must stay valid and untouched until the request completes.
#[no_mangle]
pub extern "C" fn rdist_iallreduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    op: RawOp,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue(
        "rdist_iallreduce",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| {
            data_call(
                c,
                OpKind::AllReduce,
                sendbuf,
                recvbuf,
                count,
                dtype,
                Some(op),
                0,
            )
        },
    )
}

/// recvbuf on every rank = sendbuf of `root` (sendbuf is read on the root
/// only; sendbuf == recvbuf is in place).
#[no_mangle]
pub extern "C" fn rdist_broadcast(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    root: c_int,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    issue("rdist_broadcast", comm, None, stream, |c| {
        data_call(
            c,
            OpKind::Broadcast,
            sendbuf,
            recvbuf,
            count,
            dtype,
            None,
            root,
        )
    })
}

/// Non-blocking twin of rdist_broadcast: the request handle replaces the stream.
/// Buffers must stay valid and untouched until the request completes.
#[no_mangle]
pub extern "C" fn rdist_ibroadcast(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    root: c_int,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue(
        "rdist_ibroadcast",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| {
            data_call(
                c,
                OpKind::Broadcast,
                sendbuf,
                recvbuf,
                count,
                dtype,
                None,
                root,
            )
        },
    )
}

/// recvbuf holds size*count elements: every rank's sendbuf (count
/// elements), rank-major. sendbuf == recvbuf, or sendbuf == recvbuf +
/// rank*count elements, is in place.
#[no_mangle]
pub extern "C" fn rdist_allgather(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    issue("rdist_allgather", comm, None, stream, |c| {
        data_call(
            c,
            OpKind::AllGather,
            sendbuf,
            recvbuf,
            count,
            dtype,
            None,
            0,
        )
    })
}

/// Non-blocking twin of rdist_allgather: the request handle replaces the stream.
/// Buffers must stay valid and untouched until the request completes.
#[no_mangle]
pub extern "C" fn rdist_iallgather(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue(
        "rdist_iallgather",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| {
            data_call(
                c,
                OpKind::AllGather,
                sendbuf,
                recvbuf,
                count,
                dtype,
                None,
                0,
            )
        },
    )
}

/// recvbuf (count elements) = block `rank` of the element-wise `op` over
/// every rank's sendbuf (size*count elements).
#[no_mangle]
pub extern "C" fn rdist_reduce_scatter(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    op: RawOp,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    issue("rdist_reduce_scatter", comm, None, stream, |c| {
        data_call(
            c,
            OpKind::ReduceScatter,
            sendbuf,
            recvbuf,
            count,
            dtype,
            Some(op),
            0,
        )
    })
}

/// Non-blocking twin of rdist_reduce_scatter: the request handle replaces the stream.
/// Buffers must stay valid and untouched until the request completes.
#[no_mangle]
pub extern "C" fn rdist_ireduce_scatter(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    op: RawOp,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue(
        "rdist_ireduce_scatter",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| {
            data_call(
                c,
                OpKind::ReduceScatter,
                sendbuf,
                recvbuf,
                count,
                dtype,
                Some(op),
                0,
            )
        },
    )
}

/// recvbuf (root only; may be NULL elsewhere) receives size*count
/// elements: every rank's sendbuf, rank-major.
#[no_mangle]
pub extern "C" fn rdist_gather(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    root: c_int,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    issue("rdist_gather", comm, None, stream, |c| {
        data_call(
            c,
            OpKind::Gather,
            sendbuf,
            recvbuf,
            count,
            dtype,
            None,
            root,
        )
    })
}

/// Non-blocking twin of rdist_gather: the request handle replaces the stream.
/// Buffers must stay valid and untouched until the request completes.
#[no_mangle]
pub extern "C" fn rdist_igather(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    root: c_int,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue(
        "rdist_igather",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| {
            data_call(
                c,
                OpKind::Gather,
                sendbuf,
                recvbuf,
                count,
                dtype,
                None,
                root,
            )
        },
    )
}

/// sendbuf (root only; may be NULL elsewhere) holds size*count elements;
/// rank r receives block r into recvbuf (count elements).
#[no_mangle]
pub extern "C" fn rdist_scatter(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    root: c_int,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    issue("rdist_scatter", comm, None, stream, |c| {
        data_call(
            c,
            OpKind::Scatter,
            sendbuf,
            recvbuf,
            count,
            dtype,
            None,
            root,
        )
    })
}

/// Non-blocking twin of rdist_scatter: the request handle replaces the stream.
/// Buffers must stay valid and untouched until the request completes.
#[no_mangle]
pub extern "C" fn rdist_iscatter(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    root: c_int,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue(
        "rdist_iscatter",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| {
            data_call(
                c,
                OpKind::Scatter,
                sendbuf,
                recvbuf,
                count,
                dtype,
                None,
                root,
            )
        },
    )
}

/// Block j (count elements) of sendbuf goes to rank j; block i of recvbuf
/// comes from rank i. Both hold size*count elements.
#[no_mangle]
pub extern "C" fn rdist_alltoall(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    issue("rdist_alltoall", comm, None, stream, |c| {
        data_call(c, OpKind::AllToAll, sendbuf, recvbuf, count, dtype, None, 0)
    })
}

/// Non-blocking twin of rdist_alltoall: the request handle replaces the stream.
/// Buffers must stay valid and untouched until the request completes.
#[no_mangle]
pub extern "C" fn rdist_ialltoall(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue(
        "rdist_ialltoall",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| data_call(c, OpKind::AllToAll, sendbuf, recvbuf, count, dtype, None, 0),
    )
}

/// recvbuf on `root` (may be NULL elsewhere) = element-wise `op` over every
/// rank's sendbuf.
#[no_mangle]
pub extern "C" fn rdist_reduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    op: RawOp,
    root: c_int,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    issue("rdist_reduce", comm, None, stream, |c| {
        data_call(
            c,
            OpKind::Reduce,
            sendbuf,
            recvbuf,
            count,
            dtype,
            Some(op),
            root,
        )
    })
}

/// Non-blocking twin of rdist_reduce.
#[no_mangle]
pub extern "C" fn rdist_ireduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDType,
    op: RawOp,
    root: c_int,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue(
        "rdist_ireduce",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| {
            data_call(
                c,
                OpKind::Reduce,
                sendbuf,
                recvbuf,
                count,
                dtype,
                Some(op),
                root,
            )
        },
    )
}

/// Returns when every rank of `comm` has entered the barrier.
#[no_mangle]
pub extern "C" fn rdist_barrier(comm: *mut rdist_comm_t) -> rdist_result_t {
    issue("rdist_barrier", comm, None, std::ptr::null_mut(), |_| {
        Ok(Call::Barrier)
    })
}

/// Non-blocking barrier: the request completes when every rank entered it.
#[no_mangle]
pub extern "C" fn rdist_ibarrier(
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue(
        "rdist_ibarrier",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |_| Ok(Call::Barrier),
    )
}

/// Copies `n` counts and `n` displacements from C arrays (checked for
/// NULL) into one array: counts, then displacements.
fn counts_and_displs(
    counts: *const usize,
    displs: *const usize,
    n: usize,
    names: (&str, &str),
) -> Result<Vec<usize>> {
    if counts.is_null() || displs.is_null() {
        return Err(Error::invalid_argument(format!(
            "{} or {} is NULL (each holds one entry per rank)",
            names.0, names.1
        )));
    }
    let mut v = Vec::with_capacity(2 * n);
    // SAFETY: the C contract: each array holds `size` entries.
    unsafe {
        v.extend_from_slice(std::slice::from_raw_parts(counts, n));
        v.extend_from_slice(std::slice::from_raw_parts(displs, n));
    }
    Ok(v)
}

/// Builds an uneven collective; the returned array holds the layouts the
/// call points into (keep it until the call completes).
#[allow(clippy::too_many_arguments)]
fn uneven_call(
    c: &Comm,
    kind: OpKind,
    sendbuf: *const c_void,
    sendcount: usize,
    send_arrays: Option<(*const usize, *const usize)>,
    recvbuf: *mut c_void,
    recv_arrays: (*const usize, *const usize),
    dtype: RawDType,
) -> Result<(Call, Box<[usize]>)> {
    let dtype = DType::try_from(dtype)?;
    let n = c.size();
    let (names_r, names_s) = match kind {
        OpKind::AllGatherV => (("recvcounts", "displs"), ("", "")),
        _ => (("recvcounts", "rdispls"), ("sendcounts", "sdispls")),
    };
    let mut arrays = counts_and_displs(recv_arrays.0, recv_arrays.1, n, names_r)?;
    let in_place = std::ptr::eq(sendbuf, recvbuf);
    match send_arrays {
        Some((sc, sd)) if !in_place => {
            arrays.extend(counts_and_displs(sc, sd, n, names_s)?);
        }
        _ => arrays.extend_from_within(..2 * n),
    }
    let arrays = arrays.into_boxed_slice();
    // SAFETY: the layouts point into `arrays`, which the caller keeps
    // until the call completes (returned with it).
    let call = unsafe {
        let recv_layout = Layout::new(&arrays[..2 * n]);
        let send_layout = Layout::new(&arrays[2 * n..]);
        Call::uneven(
            kind,
            sendbuf.cast(),
            sendcount,
            send_layout,
            recvbuf.cast(),
            recv_layout,
            dtype,
            c.rank(),
        )?
    };
    Ok((call, arrays))
}

fn run_or_submit_uneven(
    func: &str,
    comm: *mut rdist_comm_t,
    req: Option<*mut *mut rdist_request_t>,
    stream: *mut c_void,
    build: impl FnOnce(&Comm) -> Result<(Call, Box<[usize]>)>,
) -> rdist_result_t {
    boundary_on(func, comm, || {
        let c = &handle(comm, "comm")?.comm;
        if let Some(r) = req {
            check_out(r, "req")?;
        }
        let (call, arrays) = build(c)?;
        match req {
            // SAFETY: the C contract: buffers valid until the call returns;
            // `arrays` lives until then.
            None => unsafe { c.run_uneven(call, Stream::from_ptr(stream)) },
            Some(r) => {
                // SAFETY: buffers valid until the request completes; the
                // request keeps `arrays`.
                let request = unsafe { c.submit_uneven(call, arrays) }?;
                write_out(r, "req", rdist_request_t::create(request))
            }
        }
    })
}

/// Allgather with a count per rank (as MPI_Allgatherv): rank i's sendcount
/// elements land at recvbuf + displs[i] elements; recvcounts[i] must equal
/// rank i's sendcount. recvcounts and displs hold one entry per rank, the
/// same on every rank, and are read during the call only. sendbuf ==
/// recvbuf + displs[rank] elements is in place. Ranks whose counts
/// disagree both fail with RDIST_ERR_MISMATCH. Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_allgatherv(
    sendbuf: *const c_void,
    sendcount: usize,
    recvbuf: *mut c_void,
    recvcounts: *const usize,
    displs: *const usize,
    dtype: RawDType,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    run_or_submit_uneven("rdist_allgatherv", comm, None, stream, |c| {
        uneven_call(
            c,
            OpKind::AllGatherV,
            sendbuf,
            sendcount,
            None,
            recvbuf,
            (recvcounts, displs),
            dtype,
        )
    })
}

/// Non-blocking rdist_allgatherv (the arrays are copied). Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_iallgatherv(
    sendbuf: *const c_void,
    sendcount: usize,
    recvbuf: *mut c_void,
    recvcounts: *const usize,
    displs: *const usize,
    dtype: RawDType,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    run_or_submit_uneven(
        "rdist_iallgatherv",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| {
            uneven_call(
                c,
                OpKind::AllGatherV,
                sendbuf,
                sendcount,
                None,
                recvbuf,
                (recvcounts, displs),
                dtype,
            )
        },
    )
}

/// Alltoall with counts and displacements per rank (as MPI_Alltoallv):
/// sendcounts[j] elements at sendbuf + sdispls[j] go to rank j;
/// recvcounts[i] elements from rank i land at recvbuf + rdispls[i].
/// sendcounts[j] on rank i must equal recvcounts[i] on rank j, or both
/// fail with RDIST_ERR_MISMATCH. The arrays hold one entry per rank and
/// are read during the call only. sendbuf == recvbuf is in place: then
/// recvcounts/rdispls describe both (sendcounts and sdispls are ignored).
/// Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_alltoallv(
    sendbuf: *const c_void,
    sendcounts: *const usize,
    sdispls: *const usize,
    recvbuf: *mut c_void,
    recvcounts: *const usize,
    rdispls: *const usize,
    dtype: RawDType,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    run_or_submit_uneven("rdist_alltoallv", comm, None, stream, |c| {
        uneven_call(
            c,
            OpKind::AllToAllV,
            sendbuf,
            0,
            Some((sendcounts, sdispls)),
            recvbuf,
            (recvcounts, rdispls),
            dtype,
        )
    })
}

/// Non-blocking rdist_alltoallv (the arrays are copied). Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_ialltoallv(
    sendbuf: *const c_void,
    sendcounts: *const usize,
    sdispls: *const usize,
    recvbuf: *mut c_void,
    recvcounts: *const usize,
    rdispls: *const usize,
    dtype: RawDType,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    run_or_submit_uneven(
        "rdist_ialltoallv",
        comm,
        Some(req),
        std::ptr::null_mut(),
        |c| {
            uneven_call(
                c,
                OpKind::AllToAllV,
                sendbuf,
                0,
                Some((sendcounts, sdispls)),
                recvbuf,
                (recvcounts, rdispls),
                dtype,
            )
        },
    )
}
