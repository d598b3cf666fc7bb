//! Eventfds that wake a thread blocked in poll(): the abort flag with its
//! eventfd (rdist_comm_abort, from another thread), and a plain `Wake`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// What every thread of a communicator may ask at any time, without the
/// lock its calls hold: whether it was aborted (with the eventfd that
/// wakes a thread blocked in poll), and which ranks it lost.
pub struct AbortSignal {
    aborted: AtomicBool,
    event: OwnedFd,
    /// Ranks whose connection broke (they died, or their host or network
    /// did), in the order they were found.
    lost: Mutex<Vec<usize>>,
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
            lost: Mutex::new(Vec::new()),
        })
    }

    /// Notes that the connection to `rank` broke.
    pub fn note_lost(&self, rank: usize) {
        let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        if !lost.contains(&rank) {
            lost.push(rank);
        }
    }

    /// The ranks whose connection broke, in ascending order.
    pub fn lost_ranks(&self) -> Vec<usize> {
        let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone();
        lost.sort_unstable();
        lost
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

/// Waits until `fd` has something to read (bytes, or its end), or
/// `deadline` passes (`TimedOut`), or `abort` is raised (`Interrupted`,
/// with `abort.is_aborted()` true): a blocking read on a connection whose
/// peer's kernel accepted for it (a stopped process) would wait for the
/// whole deadline, and an abort from another thread must end it at once.
pub fn readable_by(
    fd: RawFd,
    deadline: std::time::Instant,
    abort: Option<&AbortSignal>,
) -> std::io::Result<()> {
    ready_by(fd, libc::POLLIN, deadline, abort)
}

/// `readable_by` for any of poll()'s `events` (POLLOUT: a connection
/// made).
pub fn ready_by(
    fd: RawFd,
    events: libc::c_short,
    deadline: std::time::Instant,
    abort: Option<&AbortSignal>,
) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    loop {
        if abort.is_some_and(AbortSignal::is_aborted) {
            return Err(Error::new(ErrorKind::Interrupted, "aborted"));
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(Error::new(ErrorKind::TimedOut, "no answer in time"));
        }
        let mut fds = [
            libc::pollfd {
                fd,
                events,
                revents: 0,
            },
            libc::pollfd {
                fd: abort.map_or(-1, AbortSignal::fd),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: two live pollfd (a negative fd is skipped by poll()).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if n < 0 {
            let e = Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(e);
            }
        } else if fds[0].revents != 0 {
            return Ok(());
        }
    }
}

/// An eventfd another thread rings to wake one that sleeps in poll(),
/// drained by the sleeper.
pub struct Wake {
    event: OwnedFd,
}

impl Wake {
    pub fn new() -> std::io::Result<Wake> {
        // SAFETY: eventfd has no memory arguments; the fd is checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Wake {
            // SAFETY: fd is a fresh descriptor owned by nobody else.
            event: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
        unsafe { libc::write(self.event.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Takes the rings so far (the fd reads as idle again).
    pub fn drain(&self) {
        let mut b = [0u8; 8];
        // SAFETY: reads 8 bytes into a live buffer from our own
        // non-blocking eventfd (nothing there: EAGAIN).
        unsafe { libc::read(self.event.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
    }

    /// The fd to poll for POLLIN.
    pub fn fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }
}
