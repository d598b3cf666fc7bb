//! The C ABI: the only `extern "C"` code. It translates pointers, enums
//! and errors into the safe API and back, and nothing else. Every export
//! runs its body through `boundary`, which catches panics and records the
//! thread-local `rdist_last_error()` text.

#![allow(non_camel_case_types)]
// C callers can't see `unsafe`: pointer validity is the documented C
// contract, and every pointer is checked for NULL before use.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

// In the order of the generated header, the order a reader learns the
// API in (cbindgen follows it; keep rustfmt from sorting it).
pub mod types;
// Version and errors.
pub mod version;
// Options.
pub mod options;
// Init, then the communicator.
pub mod comm;
// Collectives.
pub mod collectives;
// Point-to-point.
pub mod p2p;
// Requests.
pub mod requests;
// Groups.
pub mod groups;
// The handles' liveness (nothing of it is in the header).
pub(crate) mod handles;

use crate::error::{Error, Result};
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use types::{rdist_comm_t, rdist_result_t};

thread_local! {
    // Const-initialised (every call clears it); None reads as "".
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Whether any thread ever set a last error: until one does, clearing
/// needs no look at the thread's own (a thread-local access from a
/// shared library is a call, on every call that could not fail).
static ANY_LAST_ERROR: AtomicBool = AtomicBool::new(false);

fn set_last_error(text: String) {
    let c = CString::new(text.replace('\0', " ")).unwrap_or_default();
    ANY_LAST_ERROR.store(true, Ordering::Relaxed);
    LAST_ERROR.with(|e| *e.borrow_mut() = Some(c));
}

/// Empties the last error without allocating (every call starts so).
#[inline]
fn clear_last_error() {
    if !ANY_LAST_ERROR.load(Ordering::Relaxed) {
        return;
    }
    LAST_ERROR.with(|e| {
        if e.borrow().is_some() {
            *e.borrow_mut() = None;
        }
    });
}

/// Pointer to this thread's last error text (valid until the next call).
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ref().map_or(c"".as_ptr(), |c| c.as_ptr()))
}

/// The panic boundary every export goes through: runs `body`, maps its
/// error to a result code and a message "FUNC: rank R: cause", and turns
/// a panic into RDIST_ERR_INTERNAL.
pub(crate) fn boundary(
    func: &str,
    rank: Option<usize>,
    body: impl FnOnce() -> Result<()>,
) -> rdist_result_t {
    boundary_naming(func, || rank, body)
}

/// `boundary` for a call on `comm`, whose rank the message names (looked
/// up only when the call fails: `comm` is live until it returns).
#[inline]
pub(crate) fn boundary_on(
    func: &str,
    comm: *const rdist_comm_t,
    body: impl FnOnce() -> Result<()>,
) -> rdist_result_t {
    boundary_naming(func, || comm::rank_of(comm), body)
}

/// `boundary`, with the rank for the message from `rank` (on failure).
#[inline]
fn boundary_naming(
    func: &str,
    rank: impl FnOnce() -> Option<usize>,
    body: impl FnOnce() -> Result<()>,
) -> rdist_result_t {
    clear_last_error();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => rdist_result_t::RDIST_SUCCESS,
        Ok(Err(e)) => {
            set_last_error(format!("{}: {}", who(func, rank()), e.message()));
            rdist_result_t::from(e.kind())
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(format!(
                "{}: internal error (a bug in rdist, please report it): {what}",
                who(func, rank())
            ));
            rdist_result_t::RDIST_ERR_INTERNAL
        }
    }
}

/// The panic boundary of a call that frees a handle and returns nothing
/// (`rdist_request_free`, `rdist_options_destroy`): unlike `boundary` it
/// leaves the last error alone (freeing right after a failed call must not
/// erase why it failed), and sets it only when the handle was freed before.
pub(crate) fn free_quietly(func: &str, free: impl FnOnce() -> Result<()>) {
    if let Ok(Err(e)) = catch_unwind(AssertUnwindSafe(free)) {
        set_last_error(format!("{func}: {}", e.message()));
    }
}

/// "FUNC: rank R" (or just FUNC before a rank is known).
fn who(func: &str, rank: Option<usize>) -> String {
    match rank {
        Some(r) => format!("{func}: rank {r}"),
        None => func.to_string(),
    }
}

/// Borrows a handle, refusing NULL and one already destroyed or freed
/// (see `handles`).
pub(crate) fn handle<'a, T: handles::Handle>(p: *const T, name: &str) -> Result<&'a T> {
    handles::get(p, name)
}

/// Writes an out-parameter (only ever on success), refusing NULL.
pub(crate) fn write_out<T>(p: *mut T, name: &str, value: T) -> Result<()> {
    if p.is_null() {
        return Err(Error::invalid_argument(format!(
            "{name} (an out-pointer) is NULL"
        )));
    }
    // SAFETY: non-NULL and, per the contract, pointing at a writable T.
    unsafe { p.write(value) };
    Ok(())
}

/// Checks an out-pointer before any work is done.
pub(crate) fn check_out<T>(p: *mut T, name: &str) -> Result<()> {
    if p.is_null() {
        return Err(Error::invalid_argument(format!(
            "{name} (an out-pointer) is NULL"
        )));
    }
    Ok(())
}
