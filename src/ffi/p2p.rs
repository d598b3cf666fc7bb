//! Point-to-point calls: send and receive, blocking and not, plain and
//! tagged.

use super::types::*;
use super::{boundary_on, check_out, handle, write_out};
use crate::backend::cuda::Stream;
use crate::call::{check_rank, Call, Data, RawBuf};
use crate::comm::Comm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::transport::tagged::Status;
use std::ffi::{c_int, c_void};

/// Sends count elements to `peer`; returns when buf may be reused.
/// A matching rdist_recv on `peer` must use the same count and dtype.
#[no_mangle]
pub extern "C" fn rdist_send(
    buf: *const c_void,
    count: usize,
    dtype: RawDType,
    peer: c_int,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    // Built here, not through the collectives' call builder: a small
    // send is a few hundred nanoseconds in all.
    boundary_on("rdist_send", comm, || {
        let c = &handle(comm, "comm")?.comm;
        let (buf, data) = message(buf, count, dtype)?;
        let peer = check_rank("peer", peer.into(), c.size())?;
        // SAFETY: the C contract: buf valid until this returns (or the group ends).
        unsafe { c.run_p2p(Call::Send { buf, data, peer }, Stream::from_ptr(stream)) }
    })
}

/// Receives count elements from `peer` into buf.
#[no_mangle]
pub extern "C" fn rdist_recv(
    buf: *mut c_void,
    count: usize,
    dtype: RawDType,
    peer: c_int,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    boundary_on("rdist_recv", comm, || {
        let c = &handle(comm, "comm")?.comm;
        let (buf, data) = message(buf, count, dtype)?;
        let peer = check_rank("peer", peer.into(), c.size())?;
        // SAFETY: the C contract: buf valid until this returns (or the group ends).
        unsafe { c.run_p2p(Call::Recv { buf, data, peer }, Stream::from_ptr(stream)) }
    })
}

/// Non-blocking send; buf must stay valid until the request completes.
/// On host memory it starts at once, in the point-to-point context (see
/// rdist_send_tagged). On device memory it is held until a request of
/// this communicator is waited on or tested (or another call is made on
/// it); then all held ones start together, so posting rdist_irecv before
/// rdist_isend, as MPI programs do, cannot deadlock.
#[no_mangle]
pub extern "C" fn rdist_isend(
    buf: *const c_void,
    count: usize,
    dtype: RawDType,
    peer: c_int,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    // Straight to the point-to-point context (tag 0), as a tagged send:
    // no collective's call description on the way (a small exchange is
    // a few hundred nanoseconds in all).
    boundary_on("rdist_isend", comm, || {
        let c = &handle(comm, "comm")?.comm;
        check_out(req, "req")?;
        let (buf, data) = message(buf, count, dtype)?;
        let peer = check_rank("peer", peer.into(), c.size())?;
        // SAFETY: the C contract: buf valid until the request completes.
        let r = unsafe { c.isend_message(buf, data, peer, 0) }?;
        write_out(req, "req", rdist_request_t::create(r))
    })
}

/// Non-blocking receive; buf must stay untouched until the request
/// completes. Started like rdist_isend.
#[no_mangle]
pub extern "C" fn rdist_irecv(
    buf: *mut c_void,
    count: usize,
    dtype: RawDType,
    peer: c_int,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    boundary_on("rdist_irecv", comm, || {
        let c = &handle(comm, "comm")?.comm;
        check_out(req, "req")?;
        let (buf, data) = message(buf, count, dtype)?;
        let peer = check_rank("peer", peer.into(), c.size())?;
        // SAFETY: the C contract: buf valid and untouched until the
        // request completes.
        let r = unsafe { c.irecv_exact(buf, data, peer) }?;
        write_out(req, "req", rdist_request_t::create(r))
    })
}

/// The buffer and element type of a point-to-point call, checked.
#[inline]
fn message(buf: *const c_void, count: usize, dtype: RawDType) -> Result<(RawBuf, Data)> {
    let fine = DType::from_c(dtype).and_then(|d| {
        let len = count.checked_mul(d.size())?;
        (len <= isize::MAX as usize && (len == 0 || !buf.is_null())).then_some((d, len))
    });
    match fine {
        Some((dtype, len)) => Ok((RawBuf::new(buf.cast(), len), Data { count, dtype })),
        None => refused_message(buf, count, dtype),
    }
}

/// Why `message` refuses its arguments.
#[cold]
#[inline(never)]
fn refused_message(buf: *const c_void, count: usize, dtype: RawDType) -> Result<(RawBuf, Data)> {
    let data = Data {
        count,
        dtype: DType::try_from(dtype)?,
    };
    let len = data.dtype.bytes(count).map_err(|e| e.context("buf"))?;
    if len > isize::MAX as usize {
        return Err(Error::invalid_argument(format!(
            "buf: {len} bytes is too large"
        )));
    }
    if buf.is_null() && len > 0 {
        return Err(Error::invalid_argument(format!(
            "buf is NULL but {count} elements of {} were given",
            data.dtype
        )));
    }
    Ok((RawBuf::new(buf.cast(), len), data))
}

/// A receive's source: a rank, or None for RDIST_ANY_SOURCE.
fn source(c: &Comm, peer: c_int) -> Result<Option<usize>> {
    if peer == RDIST_ANY_SOURCE {
        return Ok(None);
    }
    check_rank("peer", peer.into(), c.size()).map(Some)
}

/// A receive's tag: a tag, or None for RDIST_ANY_TAG.
fn tag_filter(tag: c_int) -> Option<i32> {
    (tag != RDIST_ANY_TAG).then_some(tag)
}

fn write_status(status: *mut rdist_status_t, s: Status) -> Result<()> {
    write_out(
        status,
        "status",
        rdist_status_t {
            source: s.source as c_int,
            tag: s.tag,
            count: s.count,
        },
    )
}

/// Sends count elements to `peer` with `tag` (>= 0); returns when buf may
/// be reused. Point-to-point has its own context, matched by source, tag
/// and order apart from the collectives; messages up to 64 MiB are sent
/// eagerly (the send can return before its receive is posted), larger
/// ones wait for their receive. On device memory only tag 0 is possible
/// (NCCL has no tags). Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_send_tagged(
    buf: *const c_void,
    count: usize,
    dtype: RawDType,
    peer: c_int,
    tag: c_int,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
) -> rdist_result_t {
    boundary_on("rdist_send_tagged", comm, || {
        let c = &handle(comm, "comm")?.comm;
        let (buf, data) = message(buf, count, dtype)?;
        let peer = check_rank("peer", peer.into(), c.size())?;
        // SAFETY: the C contract: buf valid until this returns (or the group ends).
        unsafe { c.send_message(buf, data, peer, tag, Stream::from_ptr(stream)) }
    })
}

/// Receives into buf (room for count elements) the oldest message from
/// `peer` (RDIST_ANY_SOURCE: any rank) with `tag` (RDIST_ANY_TAG: any
/// tag). A shorter message is received whole; a longer one, or one of
/// another dtype, fails with RDIST_ERR_MISMATCH (and is consumed). status
/// (may be NULL) says who sent what; inside a group it must be NULL.
/// Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_recv_tagged(
    buf: *mut c_void,
    count: usize,
    dtype: RawDType,
    peer: c_int,
    tag: c_int,
    comm: *mut rdist_comm_t,
    stream: *mut c_void,
    status: *mut rdist_status_t,
) -> rdist_result_t {
    boundary_on("rdist_recv_tagged", comm, || {
        let c = &handle(comm, "comm")?.comm;
        let (buf, data) = message(buf, count, dtype)?;
        let peer = source(c, peer)?;
        if !status.is_null() && crate::comm::group::active() {
            return Err(Error::invalid_usage(
                "status must be NULL inside a group (the receive completes when the group ends; use rdist_irecv_tagged and rdist_request_status for it)",
            ));
        }
        // SAFETY: the C contract: buf valid until this returns (or the group ends).
        let got =
            unsafe { c.recv_message(buf, data, peer, tag_filter(tag), Stream::from_ptr(stream)) }?;
        match (got, status.is_null()) {
            (Some(s), false) => write_status(status, s),
            _ => Ok(()),
        }
    })
}

/// Non-blocking rdist_send_tagged; it starts at once. buf must stay valid
/// until the request completes. Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_isend_tagged(
    buf: *const c_void,
    count: usize,
    dtype: RawDType,
    peer: c_int,
    tag: c_int,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    boundary_on("rdist_isend_tagged", comm, || {
        let c = &handle(comm, "comm")?.comm;
        check_out(req, "req")?;
        let (buf, data) = message(buf, count, dtype)?;
        let peer = check_rank("peer", peer.into(), c.size())?;
        // SAFETY: the C contract: buf valid until the request completes.
        let r = unsafe { c.isend_message(buf, data, peer, tag) }?;
        write_out(req, "req", rdist_request_t::create(r))
    })
}

/// Non-blocking rdist_recv_tagged; it is posted at once. buf must stay
/// untouched until the request completes; rdist_request_status then says
/// who sent what. Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_irecv_tagged(
    buf: *mut c_void,
    count: usize,
    dtype: RawDType,
    peer: c_int,
    tag: c_int,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    boundary_on("rdist_irecv_tagged", comm, || {
        let c = &handle(comm, "comm")?.comm;
        check_out(req, "req")?;
        let (buf, data) = message(buf, count, dtype)?;
        let peer = source(c, peer)?;
        // SAFETY: the C contract: buf valid and untouched until the request completes.
        let r = unsafe { c.irecv_message(buf, data, peer, tag_filter(tag)) }?;
        write_out(req, "req", rdist_request_t::create(r))
    })
}
