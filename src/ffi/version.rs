//! Version and error text.

use super::last_error_ptr;
use super::types::RawResult;
use std::ffi::{c_char, c_int, CStr};

/// Major version of this header.
pub const RDIST_VERSION_MAJOR: c_int = 0;
/// Minor version of this header.
pub const RDIST_VERSION_MINOR: c_int = 1;
/// Patch version of this header.
pub const RDIST_VERSION_PATCH: c_int = 0;

/// The library's version as major*10000 + minor*100 + patch. Compare with
/// the RDIST_VERSION_* macros to detect a header/library mismatch.
#[no_mangle]
pub extern "C" fn rdist_version() -> c_int {
    (crate::VERSION_MAJOR * 10000 + crate::VERSION_MINOR * 100 + crate::VERSION_PATCH) as c_int
}

/// A short static description of a result code; never NULL (unknown codes
/// give "unknown result code").
#[no_mangle]
pub extern "C" fn rdist_result_string(result: RawResult) -> *const c_char {
    let text: &CStr = match result {
        0 => c"success",
        1 => c"invalid argument",
        2 => c"invalid usage",
        3 => c"timed out",
        4 => c"peer lost",
        5 => c"mismatched calls between ranks",
        6 => c"communicator aborted",
        7 => c"backend unavailable",
        8 => c"system error",
        9 => c"backend (NCCL/CUDA) error",
        10 => c"authentication failed",
        11 => c"internal error",
        _ => c"unknown result code",
    };
    text.as_ptr()
}

/// The calling thread's detail text for the last failed rdist call, naming
/// the function, the rank and the cause; "" after a successful call. Never
/// NULL; valid until the next rdist call on this thread.
#[no_mangle]
pub extern "C" fn rdist_last_error() -> *const c_char {
    last_error_ptr()
}
