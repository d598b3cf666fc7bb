//! rdist_options_*: key/value settings for rdist_init / rdist_comm_init_rank.

use super::types::{rdist_options_t, rdist_result_t};
use super::{boundary, check_out, handle, handles, write_out};
use crate::error::{Error, Result};
use crate::options::Options;
use std::ffi::{c_char, CStr};

/// Reads a C string argument, refusing NULL and invalid UTF-8.
pub(crate) fn c_str<'a>(p: *const c_char, name: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::invalid_argument(format!("{name} is NULL")));
    }
    // SAFETY: non-NULL, and per the contract a NUL-terminated string.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::invalid_argument(format!("{name} is not valid UTF-8")))
}

/// Creates an empty option set (every key at its default / environment
/// value). On failure *out is left unchanged.
#[no_mangle]
pub extern "C" fn rdist_options_create(out: *mut *mut rdist_options_t) -> rdist_result_t {
    boundary("rdist_options_create", None, || {
        check_out(out, "out")?;
        write_out(out, "out", rdist_options_t::create(Options::default()))
    })
}

/// Sets `key` to `value` (both NUL-terminated). Keys: backend, transport,
/// algo, timeout_ms, local_rank, device, ifname, auth_token, debug,
/// trace_file, single_copy_min (bytes from which shared-memory payloads are
/// read straight from the sender's memory: 65536, 64K, 1M; auto or off;
/// default auto, the tuning model's choice, see docs/options.md), host_id
/// (ranks with equal ids share memory; default: hostname, boot id and
/// network namespace), peer_check_ms (silence before a wait asks whether
/// the ranks it waits for still run; 0: never; default 3000). Unknown
/// keys and unparsable values give
/// RDIST_ERR_INVALID_ARGUMENT and leave the set unchanged. An explicit
/// option wins over its environment variable.
#[no_mangle]
pub extern "C" fn rdist_options_set(
    opts: *mut rdist_options_t,
    key: *const c_char,
    value: *const c_char,
) -> rdist_result_t {
    boundary("rdist_options_set", None, || {
        let o = handle(opts, "opts")?;
        let (k, v) = (c_str(key, "key")?, c_str(value, "value")?);
        let mut updated = (*o.opts).clone();
        updated.set(k, v)?;
        // SAFETY: handle() checked it is live; the caller owns it exclusively.
        unsafe { *(&mut *opts).opts = updated };
        Ok(())
    })
}

/// Frees an option set; NULL is a no-op. Communicators created with it
/// keep their own copy.
#[no_mangle]
pub extern "C" fn rdist_options_destroy(opts: *mut rdist_options_t) {
    super::free_quietly("rdist_options_destroy", || handles::retire(opts, "opts"));
}
