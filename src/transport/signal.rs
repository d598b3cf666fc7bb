//! A flag plus an eventfd: lets another thread (rdist_comm_abort) wake a
//! rank that is blocked in poll().

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

pub struct AbortSignal {
    aborted: AtomicBool,
    event: OwnedFd,
}

impl AbortSignal {
    pub fn new() -> std::io::Result<AbortSignal> {
        // SAFETY: eventfd has no memory arguments; the fd is checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(AbortSignal {
            aborted: AtomicBool::new(false),
            // SAFETY: fd is a fresh descriptor owned by nobody else.
            event: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
        unsafe { libc::write(self.event.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// The fd to poll for POLLIN; it stays readable once aborted.
    pub fn fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }
}
