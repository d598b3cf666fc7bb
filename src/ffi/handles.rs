//! The handles C holds (communicators, requests, option sets): boxes with
//! a liveness word, so that the commonest misuses of one (a call after its
//! destroy or free, a second destroy) are an error with a message, not a
//! crash. A retired handle's contents are dropped at once; its box stays
//! behind as a tombstone among the last `QUARANTINE` retired on the
//! thread, where a stale pointer still finds it dead. A pointer older than
//! that, or one that never was a handle, is not caught (docs/api.md).

use crate::error::{Error, Result};
use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};

/// The liveness word of a handle in use.
const LIVE: u32 = 0x7264_6973;
/// The liveness word of a retired one.
const RETIRED: u32 = 0xdead_0001;

/// Tombstones a thread keeps (a few tens of bytes each).
const QUARANTINE: usize = 4096;

thread_local! {
    static TOMBSTONES: RefCell<VecDeque<Box<dyn Any>>> = const { RefCell::new(VecDeque::new()) };
}

/// Whether a handle is in use: `Liveness::default()` is.
pub struct Liveness(AtomicU32);

impl Default for Liveness {
    fn default() -> Liveness {
        Liveness(AtomicU32::new(LIVE))
    }
}

/// A type C holds through a pointer from `create`.
pub trait Handle: Sized + 'static {
    /// The call that retires it, and what it does.
    const RETIRED_BY: &'static str;
    const RETIRES: &'static str;
    fn liveness(&self) -> &Liveness;
    /// Drops what the handle holds (once, when it is retired).
    ///
    /// # Safety
    /// Called once; nothing reads the value after.
    unsafe fn drop_value(&mut self);
}

/// The pointer C gets for `handle`.
pub fn create<T: Handle>(handle: T) -> *mut T {
    Box::into_raw(Box::new(handle))
}

/// Borrows a live handle; NULL, or one already retired, is an invalid
/// argument naming `name`.
pub fn get<'a, T: Handle>(p: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: NULL, or a pointer from `create`: its box lives until it
    // leaves the quarantine (a pointer used later than that is the
    // caller's undefined behaviour, as in C).
    let handle =
        unsafe { p.as_ref() }.ok_or_else(|| Error::invalid_argument(format!("{name} is NULL")))?;
    if handle.liveness().0.load(Ordering::Acquire) != LIVE {
        return Err(Error::invalid_argument(format!(
            "{name} was already passed to {}: a handle is not valid after it",
            T::RETIRED_BY
        )));
    }
    Ok(handle)
}

/// Drops what a live handle holds and leaves its box as a tombstone. NULL
/// is a no-op; a handle retired before is an invalid argument.
pub fn retire<T: Handle>(p: *mut T, name: &str) -> Result<()> {
    if p.is_null() {
        return Ok(());
    }
    // SAFETY: from `create`, and its box is not freed before it leaves the
    // quarantine.
    let handle = unsafe { &mut *p };
    if handle
        .liveness()
        .0
        .compare_exchange(LIVE, RETIRED, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return Err(Error::invalid_argument(format!(
            "{name} was already passed to {} before: it was {} twice",
            T::RETIRED_BY,
            T::RETIRES
        )));
    }
    // SAFETY: only the call that retired the handle gets here, and `get`
    // refuses it from now on.
    unsafe { handle.drop_value() };
    // SAFETY: from Box::into_raw in `create`; freed once, when it leaves
    // the quarantine (its value already dropped, and `T` drops nothing
    // else).
    let tombstone: Box<dyn Any> = unsafe { Box::from_raw(p) };
    let _ = TOMBSTONES.try_with(|kept| {
        let mut kept = kept.borrow_mut();
        kept.push_back(tombstone);
        if kept.len() > QUARANTINE {
            kept.pop_front();
        }
    });
    Ok(())
}
