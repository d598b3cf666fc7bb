//! The two futex calls rdist makes, on words of memory that processes
//! share (never the private kind: the waiters are other processes).

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `word` holds `expected`, up to `timeout` (returns at once
/// if it holds something else; may return early: callers look again).
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a futex wait on a live word, with a live relative timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

/// Wakes every process sleeping on `word`.
pub(crate) fn wake_all(word: &AtomicU32) {
    // SAFETY: a futex wake on a live word.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}
