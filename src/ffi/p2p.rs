//! Point-to-point calls: send and receive, blocking and not.

use super::collectives::{data_call, issue};
use super::types::*;
use crate::call::{Call, Data};
use crate::descriptor::OpKind;
use crate::dtype::DType;
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
    issue("rdist_send", comm, None, stream, |c| {
        data_call(
            c,
            OpKind::Send,
            buf,
            std::ptr::null_mut(),
            count,
            dtype,
            None,
            peer,
        )
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
    issue("rdist_recv", comm, None, stream, |c| {
        Call::recv(
            buf.cast(),
            Data {
                count,
                dtype: DType::try_from(dtype)?,
            },
            peer.into(),
            c.size(),
        )
    })
}

/// Non-blocking send; buf must stay valid until the request completes.
/// Non-blocking sends and receives are held until a request of this
/// communicator is waited on or tested (or another call is made on it);
/// then all held ones start together, so posting rdist_irecv before
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
    issue("rdist_isend", comm, Some(req), std::ptr::null_mut(), |c| {
        data_call(
            c,
            OpKind::Send,
            buf,
            std::ptr::null_mut(),
            count,
            dtype,
            None,
            peer,
        )
    })
}

/// Non-blocking receive; buf must stay untouched until the request
/// completes. Held and started like rdist_isend.
#[no_mangle]
pub extern "C" fn rdist_irecv(
    buf: *mut c_void,
    count: usize,
    dtype: RawDType,
    peer: c_int,
    comm: *mut rdist_comm_t,
    req: *mut *mut rdist_request_t,
) -> rdist_result_t {
    issue("rdist_irecv", comm, Some(req), std::ptr::null_mut(), |c| {
        Call::recv(
            buf.cast(),
            Data {
                count,
                dtype: DType::try_from(dtype)?,
            },
            peer.into(),
            c.size(),
        )
    })
}
