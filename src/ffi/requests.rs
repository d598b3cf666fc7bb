//! Completing non-blocking calls.

use super::types::*;
use super::{boundary, check_out, handle, handles, write_out};
use crate::error::Error;
use std::ffi::c_int;

/// Blocks until the request completes and returns its result (bounded by
/// the communicator's timeout_ms). The request stays valid: free it with
/// rdist_request_free.
#[no_mangle]
pub extern "C" fn rdist_wait(req: *mut rdist_request_t) -> rdist_result_t {
    boundary("rdist_wait", None, || handle(req, "req")?.req.wait())
}

/// Never blocks: *done = 1 when the request has completed (the call then
/// returns its result), else *done = 0 and RDIST_SUCCESS.
#[no_mangle]
pub extern "C" fn rdist_test(req: *mut rdist_request_t, done: *mut c_int) -> rdist_result_t {
    boundary("rdist_test", None, || {
        let r = handle(req, "req")?;
        super::check_out(done, "done")?;
        match r.req.test() {
            None => write_out(done, "done", 0),
            Some(result) => {
                write_out(done, "done", 1)?;
                result
            }
        }
    })
}

/// Frees a request, waiting first if it is still in flight. NULL is a no-op.
#[no_mangle]
pub extern "C" fn rdist_request_free(req: *mut rdist_request_t) {
    super::free_quietly("rdist_request_free", || {
        handles::retire_after(req, "req", |r| {
            // (In a fork() child it is settled: only let go.)
            if !r.req.settled() {
                let _ = r.req.wait();
            }
        })
    });
}

/// The status of a completed receive: who sent it, its tag, and how many
/// elements arrived (of a send: the rank it went to, its tag and count).
/// RDIST_ERR_INVALID_USAGE while the request is in flight, when it failed,
/// or for a request that is not a point-to-point receive or send on host
/// memory. Since 0.2.
#[no_mangle]
pub extern "C" fn rdist_request_status(
    req: *const rdist_request_t,
    status: *mut rdist_status_t,
) -> rdist_result_t {
    boundary("rdist_request_status", None, || {
        let r = handle(req, "req")?;
        r.req.check_process()?;
        check_out(status, "status")?;
        let s = r.req.status().ok_or_else(|| {
            Error::invalid_usage(
                "the request has no status: it is still in flight, it failed, or it is not a point-to-point call on host memory",
            )
        })?;
        write_out(
            status,
            "status",
            rdist_status_t {
                source: s.source as c_int,
                tag: s.tag,
                count: s.count,
            },
        )
    })
}
