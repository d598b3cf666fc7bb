//! The handles C holds (communicators, requests, option sets): boxes with
//! a liveness word first, so that the commonest misuses of one (a call
//! after its destroy or free, a second destroy, a handle of one kind
//! passed as another) are an error with a message, not a crash. Each kind
//! has its own live and retired words. A retired handle's contents are dropped at once; its box stays
//! behind as a tombstone among the last `QUARANTINE` of its type retired
//! on the thread, where a stale pointer still finds it dead, and then
//! holds the thread's next new handle of that type (so that a request a
//! call makes and frees costs no allocation). A pointer older than that,
//! or one that never was a handle, is not caught (docs/api.md).

use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};

/// A kind of handle: its liveness word in use (a retired one's is the
/// complement, `retired`), what it is, and what retires it.
pub type Kind = (u32, &'static str, &'static str);
pub const COMM: Kind = (0x7264_6973, "a communicator", "rdist_comm_destroy");
pub const REQUEST: Kind = (0x7264_7271, "a request", "rdist_request_free");
pub const OPTIONS: Kind = (0x7264_6f70, "an option set", "rdist_options_destroy");
const KINDS: [Kind; 3] = [COMM, REQUEST, OPTIONS];

/// The liveness word of a retired handle whose live one is `live`.
const fn retired(live: u32) -> u32 {
    !live
}

/// Tombstones a thread keeps of each type (a few tens of bytes each).
const QUARANTINE: usize = 4096;

/// Whether a handle is in use, and of which kind: first in every
/// handle (at offset 0), so that a handle of another kind is read at the
/// same place.
pub struct Liveness(AtomicU32);

impl Liveness {
    /// A handle of the kind `T` in use.
    pub fn of<T: Handle>() -> Liveness {
        Liveness(AtomicU32::new(T::LIVE))
    }
}

/// A type C holds through a pointer from `create`, its `Liveness` at
/// offset 0 (every kind's: a pointer is read as a word before it is known
/// to be this kind).
pub trait Handle: Sized + 'static {
    /// Its liveness word while in use (`COMM`, `REQUEST`, `OPTIONS`) and
    /// what it is, for messages ("a communicator").
    const LIVE: u32;
    const KIND: &'static str;
    /// The call that retires it, and what it does.
    const RETIRED_BY: &'static str;
    const RETIRES: &'static str;
    fn liveness(&self) -> &Liveness;
    /// Drops what the handle holds (once, when it is retired).
    ///
    /// # Safety
    /// Called once; nothing reads the value after.
    unsafe fn drop_value(&mut self);
    /// Runs `f` on this thread's tombstones of the type (None while the
    /// thread is exiting).
    fn with_tombstones<R>(f: impl FnOnce(&mut VecDeque<Box<Self>>) -> R) -> Option<R>;
}

/// The pointer C gets for `handle`: the box of the oldest tombstone once
/// the quarantine is full, else a new one.
pub fn create<T: Handle>(handle: T) -> *mut T {
    let reused = T::with_tombstones(|kept| {
        if kept.len() >= QUARANTINE {
            kept.pop_front()
        } else {
            None
        }
    })
    .flatten();
    match reused {
        Some(mut boxed) => {
            // The tombstone's value was dropped when it was retired; what
            // is left (the liveness word) needs no drop.
            *boxed = handle;
            Box::into_raw(boxed)
        }
        None => Box::into_raw(Box::new(handle)),
    }
}

/// Borrows a live handle; NULL, or one already retired, is an invalid
/// argument naming `name`.
pub fn get<'a, T: Handle>(p: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: NULL, or a pointer from `create`: its box lives until it
    // leaves the quarantine (a pointer used later than that is the
    // caller's undefined behaviour, as in C).
    if p.is_null() {
        return Err(Error::invalid_argument(format!("{name} is NULL")));
    }
    // The word first, through the pointer: a handle of another kind is no
    // `T` to make a reference to.
    let word = unsafe { word_of(p) };
    if word != T::LIVE {
        return Err(not_live::<T>(word, name));
    }
    // SAFETY: a live `T`, from `create`.
    Ok(unsafe { &*p })
}

/// The liveness word of the handle at `p`, of whatever kind.
///
/// # Safety
/// `p` is a pointer from `create` of some handle type, whose box lives (a
/// tombstone's does): each holds its `Liveness` at offset 0.
unsafe fn word_of<T>(p: *const T) -> u32 {
    // SAFETY: as the function says.
    unsafe { (*p.cast::<Liveness>()).0.load(Ordering::Acquire) }
}

/// What a handle whose word is `word` is instead of a live `T`.
fn not_live<T: Handle>(word: u32, name: &str) -> Error {
    if word == retired(T::LIVE) {
        return Error::invalid_argument(format!(
            "{name} was already passed to {}: a handle is not valid after it",
            T::RETIRED_BY
        ));
    }
    let other = KINDS.iter().find_map(|&(live, kind, by)| {
        (word == live)
            .then(|| kind.to_string())
            .or_else(|| (word == retired(live)).then(|| format!("{kind} already passed to {by}")))
    });
    Error::invalid_argument(match other {
        Some(other) => format!("{name} is {other}, not {}", T::KIND),
        None => format!(
            "{name} is not {} (nor any live rdist handle: a pointer retired long ago, \
             or not from rdist)",
            T::KIND
        ),
    })
}

/// Drops what a live handle holds and leaves its box as a tombstone. NULL
/// is a no-op; a handle retired before is an invalid argument.
pub fn retire<T: Handle>(p: *mut T, name: &str) -> Result<()> {
    retire_after(p, name, |_| {})
}

/// `retire`, running `last` on the handle first (once it is refused to
/// every other call).
pub fn retire_after<T: Handle>(p: *mut T, name: &str, last: impl FnOnce(&T)) -> Result<()> {
    if p.is_null() {
        return Ok(());
    }
    // A look and a store, not a compare-and-swap (a request is freed per
    // message): two threads freeing one handle at once is outside the
    // contract, as a double free() is in C; one after the other is caught.
    // SAFETY: from `create`, and its box is not freed before it leaves the
    // quarantine; the word is read before anything takes it for a `T`.
    let word = unsafe { word_of(p) };
    if word == retired(T::LIVE) {
        return Err(Error::invalid_argument(format!(
            "{name} was already passed to {} before: it was {} twice",
            T::RETIRED_BY,
            T::RETIRES
        )));
    }
    if word != T::LIVE {
        return Err(not_live::<T>(word, name));
    }
    // SAFETY: a live `T` from `create`.
    let handle = unsafe { &mut *p };
    handle
        .liveness()
        .0
        .store(retired(T::LIVE), Ordering::Release);
    last(handle);
    // SAFETY: only the call that retired the handle gets here, and `get`
    // refuses it from now on.
    unsafe { handle.drop_value() };
    // SAFETY: from Box::into_raw in `create`; freed once (its value
    // already dropped, and `T` drops nothing else), or reused by `create`.
    let tombstone = unsafe { Box::from_raw(p) };
    T::with_tombstones(|kept| kept.push_back(tombstone));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::mem::ManuallyDrop;
    use std::rc::Rc;

    /// A handle whose value counts its drops.
    #[repr(C)]
    struct Probe {
        live: Liveness,
        value: ManuallyDrop<Rc<()>>,
    }

    impl Handle for Probe {
        const LIVE: u32 = 0x7072_6f62;
        const KIND: &'static str = "a probe";
        const RETIRED_BY: &'static str = "probe_free";
        const RETIRES: &'static str = "freed";

        fn liveness(&self) -> &Liveness {
            &self.live
        }

        unsafe fn drop_value(&mut self) {
            // SAFETY: as the trait says.
            unsafe { ManuallyDrop::drop(&mut self.value) }
        }

        fn with_tombstones<R>(f: impl FnOnce(&mut VecDeque<Box<Probe>>) -> R) -> Option<R> {
            thread_local! {
                static KEPT: RefCell<VecDeque<Box<Probe>>> = const { RefCell::new(VecDeque::new()) };
            }
            KEPT.try_with(|kept| f(&mut kept.borrow_mut())).ok()
        }
    }

    fn probe(count: &Rc<()>) -> *mut Probe {
        create(Probe {
            live: Liveness::of::<Probe>(),
            value: ManuallyDrop::new(count.clone()),
        })
    }

    #[test]
    fn a_retired_handle_is_refused_and_its_value_dropped_once() {
        let count = Rc::new(());
        let p = probe(&count);
        assert!(get(p, "p").is_ok());
        assert_eq!(Rc::strong_count(&count), 2);
        retire(p, "p").unwrap();
        assert_eq!(Rc::strong_count(&count), 1);
        let e = get(p, "p").err().unwrap();
        assert!(e.message().contains("already passed to probe_free"), "{e}");
        let e = retire(p, "p").unwrap_err();
        assert!(e.message().contains("freed twice"), "{e}");
        assert_eq!(Rc::strong_count(&count), 1);
        assert!(retire(std::ptr::null_mut::<Probe>(), "p").is_ok());
        assert!(get(std::ptr::null::<Probe>(), "p").is_err());
    }

    #[test]
    fn tombstones_are_kept_for_the_quarantine_then_reused() {
        let count = Rc::new(());
        let first = probe(&count);
        retire(first, "p").unwrap();
        let mut later = Vec::new();
        for _ in 1..QUARANTINE {
            let p = probe(&count);
            retire(p, "p").unwrap();
            later.push(p);
            assert!(
                get(first, "p").is_err(),
                "the first one left the quarantine early"
            );
        }
        // The quarantine is full: the next handle takes the oldest box.
        let next = probe(&count);
        assert_eq!(next, first);
        assert!(get(next, "p").is_ok());
        retire(next, "p").unwrap();
        assert_eq!(Rc::strong_count(&count), 1);
    }
}
