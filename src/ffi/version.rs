//! Version and error text.

use super::last_error_ptr;
use super::types::RawResult;
use std::ffi::{c_char, c_int, CStr};

/// Major version of this header.
pub const RDIST_VERSION_MAJOR: c_int = 0;
/// Minor version of this header.
pub const RDIST_VERSION_MINOR: c_int = 2;
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

/// NCCL's version as NCCL encodes it (e.g. 22105 for 2.21.5), from the
/// library rdist loads for its NCCL backend (RDIST_NCCL_LIBRARY,
/// libnccl.so.2, libnccl.so, a pip-installed nvidia-nccl-cu12). Needs no
/// GPU. RDIST_ERR_UNAVAILABLE, with what was tried in rdist_last_error(),
/// when no NCCL can be loaded.
#[no_mangle]
pub extern "C" fn rdist_nccl_version(version: *mut c_int) -> super::types::rdist_result_t {
    super::boundary("rdist_nccl_version", None, || {
        super::check_out(version, "version")?;
        let lib = crate::backend::nccl::loader::load()
            .map_err(|why| crate::error::Error::new(crate::error::ErrorKind::Unavailable, why))?;
        super::write_out(version, "version", lib.version_code as c_int)
    })
}
