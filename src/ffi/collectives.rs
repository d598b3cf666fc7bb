//! Collectives and their non-blocking twins. Argument order and enum
//! values are NCCL's. `stream` is for device buffers and ignored for host
//! buffers; host calls return when the result is in recvbuf.

use super::comm::rank_of;
use super::types::*;
use super::{boundary, check_out, handle, write_out};
use crate::call::{Call, Data};
use crate::comm::Comm;
use crate::dtype::DType;
use crate::error::Result;
use crate::op::OpKind;
use crate::reduce::ReduceOp;
use std::ffi::{c_int, c_void};

/// Validates a handle, builds the call and runs it (blocking) or starts it
/// (when `req` is given), writing the request handle on success only.
pub(crate) fn issue(
    func: &str,
    comm: *mut rdist_comm_t,
    req: Option<*mut *mut rdist_request_t>,
    build: impl FnOnce(&Comm) -> Result<Call>,
) -> rdist_result_t {
    boundary(func, rank_of(comm), || {
        let c = &handle(comm, "comm")?.comm;
        if let Some(r) = req {
            check_out(r, "req")?;
        }
        let call = build(c)?;
        match req {
            // SAFETY: the C contract: buffers valid until the call returns
            // (or the group ends).
            None => unsafe { c.run(call) },
            Some(r) => {
                // SAFETY: the C contract: buffers valid until the request completes.
                let request = unsafe { c.submit(call) }?;
                write_out(r, "req", Box::into_raw(Box::new(rdist_request_t { req: request })))
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
    let op = op.map(ReduceOp::try_from).transpose()?.unwrap_or(ReduceOp::Sum);
    Call::new(kind, send.cast(), recv.cast(), Data { count, dtype }, op, root.into(), c.rank(), c.size())
}

macro_rules! reduction_pair {
    ($(#[$doc:meta])* $name:ident, $iname:ident, $kind:expr) => {
        $(#[$doc])*
        #[no_mangle]
        pub extern "C" fn $name(sendbuf: *const c_void, recvbuf: *mut c_void, count: usize, dtype: RawDType, op: RawOp, comm: *mut rdist_comm_t, _stream: *mut c_void) -> rdist_result_t {
            issue(stringify!($name), comm, None, |c| data_call(c, $kind, sendbuf, recvbuf, count, dtype, Some(op), 0))
        }

        /// Non-blocking twin: same arguments, the request handle last.
        /// Buffers must stay valid and untouched until the request completes.
        #[no_mangle]
        pub extern "C" fn $iname(sendbuf: *const c_void, recvbuf: *mut c_void, count: usize, dtype: RawDType, op: RawOp, comm: *mut rdist_comm_t, req: *mut *mut rdist_request_t) -> rdist_result_t {
            issue(stringify!($iname), comm, Some(req), |c| data_call(c, $kind, sendbuf, recvbuf, count, dtype, Some(op), 0))
        }
    };
}

macro_rules! rooted_pair {
    ($(#[$doc:meta])* $name:ident, $iname:ident, $kind:expr) => {
        $(#[$doc])*
        #[no_mangle]
        pub extern "C" fn $name(sendbuf: *const c_void, recvbuf: *mut c_void, count: usize, dtype: RawDType, root: c_int, comm: *mut rdist_comm_t, _stream: *mut c_void) -> rdist_result_t {
            issue(stringify!($name), comm, None, |c| data_call(c, $kind, sendbuf, recvbuf, count, dtype, None, root))
        }

        /// Non-blocking twin: same arguments, the request handle last.
        /// Buffers must stay valid and untouched until the request completes.
        #[no_mangle]
        pub extern "C" fn $iname(sendbuf: *const c_void, recvbuf: *mut c_void, count: usize, dtype: RawDType, root: c_int, comm: *mut rdist_comm_t, req: *mut *mut rdist_request_t) -> rdist_result_t {
            issue(stringify!($iname), comm, Some(req), |c| data_call(c, $kind, sendbuf, recvbuf, count, dtype, None, root))
        }
    };
}

macro_rules! plain_pair {
    ($(#[$doc:meta])* $name:ident, $iname:ident, $kind:expr) => {
        $(#[$doc])*
        #[no_mangle]
        pub extern "C" fn $name(sendbuf: *const c_void, recvbuf: *mut c_void, count: usize, dtype: RawDType, comm: *mut rdist_comm_t, _stream: *mut c_void) -> rdist_result_t {
            issue(stringify!($name), comm, None, |c| data_call(c, $kind, sendbuf, recvbuf, count, dtype, None, 0))
        }

        /// Non-blocking twin: same arguments, the request handle last.
        /// Buffers must stay valid and untouched until the request completes.
        #[no_mangle]
        pub extern "C" fn $iname(sendbuf: *const c_void, recvbuf: *mut c_void, count: usize, dtype: RawDType, comm: *mut rdist_comm_t, req: *mut *mut rdist_request_t) -> rdist_result_t {
            issue(stringify!($iname), comm, Some(req), |c| data_call(c, $kind, sendbuf, recvbuf, count, dtype, None, 0))
        }
    };
}

reduction_pair!(
    /// recvbuf = element-wise `op` over every rank's sendbuf (count
    /// elements). sendbuf == recvbuf is in place.
    rdist_allreduce, rdist_iallreduce, OpKind::AllReduce
);
reduction_pair!(
    /// recvbuf (count elements) = block `rank` of the reduction of every
    /// rank's sendbuf (size*count elements).
    rdist_reduce_scatter, rdist_ireduce_scatter, OpKind::ReduceScatter
);
rooted_pair!(
    /// recvbuf on every rank = sendbuf of `root` (sendbuf is read on the
    /// root only; sendbuf == recvbuf is in place).
    rdist_broadcast, rdist_ibroadcast, OpKind::Broadcast
);
rooted_pair!(
    /// recvbuf (root only; may be NULL elsewhere) holds size*sendcount
    /// elements: every rank's sendbuf, rank-major.
    rdist_gather, rdist_igather, OpKind::Gather
);
rooted_pair!(
    /// sendbuf (root only; may be NULL elsewhere) holds size*recvcount
    /// elements; rank r receives block r into recvbuf.
    rdist_scatter, rdist_iscatter, OpKind::Scatter
);
plain_pair!(
    /// recvbuf holds size*sendcount elements: every rank's sendbuf,
    /// rank-major. sendbuf == recvbuf, or sendbuf == recvbuf + rank*sendcount
    /// elements, is in place.
    rdist_allgather, rdist_iallgather, OpKind::AllGather
);
plain_pair!(
    /// Block j (count elements) of sendbuf goes to rank j; block i of
    /// recvbuf comes from rank i. Both hold size*count elements.
    rdist_alltoall, rdist_ialltoall, OpKind::AllToAll
);

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
    _stream: *mut c_void,
) -> rdist_result_t {
    issue("rdist_reduce", comm, None, |c| {
        data_call(c, OpKind::Reduce, sendbuf, recvbuf, count, dtype, Some(op), root)
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
    issue("rdist_ireduce", comm, Some(req), |c| {
        data_call(c, OpKind::Reduce, sendbuf, recvbuf, count, dtype, Some(op), root)
    })
}

/// Returns when every rank of `comm` has entered the barrier.
#[no_mangle]
pub extern "C" fn rdist_barrier(comm: *mut rdist_comm_t) -> rdist_result_t {
    issue("rdist_barrier", comm, None, |_| Ok(Call::Barrier))
}

/// Non-blocking barrier: the request completes when every rank entered it.
#[no_mangle]
pub extern "C" fn rdist_ibarrier(comm: *mut rdist_comm_t, req: *mut *mut rdist_request_t) -> rdist_result_t {
    issue("rdist_ibarrier", comm, Some(req), |_| Ok(Call::Barrier))
}
