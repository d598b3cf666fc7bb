//! A host board: one page of shared memory through which the first rank
//! of a host releases the host's other ranks from init's last wait with
//! one system call.
//!
//! Every rank of a wide job waits at the end of init for the last rank to
//! get there (`Joined::all_ready`). Released by rank 0's store, one
//! answer per rank, the store's one thread wrote a thousand sockets,
//! each write waking a rank that then took the core from it: 0.3 s at
//! 1024 ranks on 2 cores, the longest part of init after the last rank
//! came. Here the store answers one rank per host, which wakes the
//! others with one futex wake.
//!
//! Every rank makes a board before it publishes its key (a memfd, sealed
//! at its size: nothing is left behind however a rank ends); the host's
//! first rank's is the one used. The others open it through
//! /proc/<pid>/fd/<fd>, as the shared-memory rings are opened (a look at
//! what is there first: a plain file of the board's size), and check the
//! job id it carries.
//! Whoever cannot (another PID namespace, /proc hidden) waits on the
//! store as before: the board only wakes, the store still counts.

use crate::transport::futex;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

const BYTES: usize = 4096;
const MAGIC: u32 = 0x7264_6862; // "rdhb"
/// Offsets: the magic, the release word (a futex), the job id.
const MAGIC_AT: usize = 0;
const RELEASE_AT: usize = 4;
const JOB_AT: usize = 8;

/// The release word's values.
const WAITING: u32 = 0;
const READY: u32 = 1;
const FAILED: u32 = 2;

/// How a wait on the board ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Every rank set up its communicator.
    Ready,
    /// Some rank failed, or the first rank gave up waiting: the store
    /// says why (or nobody does).
    Failed,
    /// Not released within the time given.
    NotYet,
}

/// This rank's board, not mapped: most ranks of a host never use theirs
/// (mapping and unmapping a page is not free on a busy host).
pub(crate) struct OwnBoard(OwnedFd);

/// A host board, mapped (made by this rank, or opened from another's).
pub(crate) struct HostBoard {
    base: *mut u8,
    /// This rank's own board: the descriptor that keeps it, which the
    /// host's other ranks open.
    _own: Option<OwnedFd>,
}

// SAFETY: the mapping is shared memory touched only through atomics (the
// magic and job id were written before any other process could see it).
unsafe impl Send for HostBoard {}
unsafe impl Sync for HostBoard {}

impl OwnBoard {
    /// Makes this rank's board for `job`; None where memfd fails (the
    /// host's ranks then wait on the store).
    pub fn create(job: &[u8; 16]) -> Option<OwnBoard> {
        // SAFETY: memfd_create with a valid C string; the result is checked.
        let fd = unsafe {
            libc::memfd_create(
                c"rdist-host-board".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), BYTES as libc::off_t) } != 0 {
            return None;
        }
        let mut header = [0u8; JOB_AT + 16];
        header[MAGIC_AT..MAGIC_AT + 4].copy_from_slice(&MAGIC.to_ne_bytes());
        header[JOB_AT..].copy_from_slice(job);
        // SAFETY: writes a live buffer to our own descriptor.
        let wrote =
            unsafe { libc::pwrite(fd.as_raw_fd(), header.as_ptr().cast(), header.len(), 0) };
        if wrote != header.len() as isize {
            return None;
        }
        // Sealed at its size: no holder can shrink it under the others'
        // mappings (SIGBUS).
        // SAFETY: fcntl on our own descriptor with integer arguments.
        unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        Some(OwnBoard(fd))
    }

    /// The descriptor the host's other ranks open.
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Mapped, to release the others (this rank is its host's first).
    pub fn mapped(self) -> Option<HostBoard> {
        Some(HostBoard {
            base: map(self.0.as_raw_fd())?,
            _own: Some(self.0),
        })
    }
}

impl HostBoard {
    /// Opens the board process `pid` made for `job` and holds as `fd`;
    /// None when it cannot be opened or is not that job's board.
    pub fn open(pid: u32, fd: i32, job: &[u8; 16]) -> Option<HostBoard> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = format!("/proc/{pid}/fd/{fd}");
        // What is behind the number now may be anything (the rank ended,
        // the number was reused): opened only when it looks like a board.
        let looks = std::fs::metadata(&path).ok()?;
        if !looks.is_file() || looks.len() != BYTES as u64 {
            return None;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
            .open(&path)
            .ok()?;
        if file.metadata().ok()?.len() != BYTES as u64 {
            return None;
        }
        let board = HostBoard {
            base: map(file.as_raw_fd())?,
            _own: None,
        };
        // SAFETY: inside the mapping; written before the key that named it.
        let (magic, theirs) = unsafe {
            (
                board.base.add(MAGIC_AT).cast::<u32>().read(),
                std::slice::from_raw_parts(board.base.add(JOB_AT), 16),
            )
        };
        (magic == MAGIC && theirs == job).then_some(board)
    }

    fn release_word(&self) -> &AtomicU32 {
        // SAFETY: aligned, inside the mapping, which lives as long as self.
        unsafe { AtomicU32::from_ptr(self.base.add(RELEASE_AT).cast()) }
    }

    /// Releases every rank waiting on the board (`ready`: every rank set
    /// up its communicator) with one wake.
    pub fn release(&self, ready: bool) {
        self.mark(ready);
        self.wake();
    }

    /// Says how the wait ended, for a waiter's next look.
    pub fn mark(&self, ready: bool) {
        let word = self.release_word();
        word.store(if ready { READY } else { FAILED }, Ordering::Release);
    }

    /// Wakes every rank waiting on the board.
    pub fn wake(&self) {
        futex::wake_all(self.release_word());
    }

    /// Waits up to `timeout` for the release.
    pub fn wait(&self, timeout: Duration) -> Release {
        let word = self.release_word();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match word.load(Ordering::Acquire) {
                READY => return Release::Ready,
                WAITING => {}
                _ => return Release::Failed,
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Release::NotYet;
            }
            // Woken early or spuriously, it looks again.
            futex::wait(word, WAITING, left);
        }
    }
}

impl Drop for HostBoard {
    fn drop(&mut self) {
        // SAFETY: our own mapping of BYTES, unmapped once.
        unsafe { libc::munmap(self.base.cast(), BYTES) };
    }
}

fn map(fd: RawFd) -> Option<*mut u8> {
    // SAFETY: maps BYTES of a descriptor we hold; checked below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    (base != libc::MAP_FAILED).then_some(base.cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A board opened through /proc by another holder wakes it with one
    /// release, says which release it was, and refuses another job.
    #[test]
    fn a_release_wakes_every_holder_and_a_foreign_job_is_refused() {
        let job = [7u8; 16];
        let own = OwnBoard::create(&job).expect("a board");
        let pid = std::process::id();
        let fd = own.fd();
        let board = own.mapped().expect("mapped");
        assert!(HostBoard::open(pid, fd, &[8u8; 16]).is_none());
        let others: Vec<HostBoard> = (0..3)
            .map(|_| HostBoard::open(pid, fd, &job).expect("opened"))
            .collect();
        assert_eq!(others[0].wait(Duration::from_millis(20)), Release::NotYet);
        let started = std::time::Instant::now();
        std::thread::scope(|s| {
            let waiters: Vec<_> = (others.iter())
                .map(|b| s.spawn(|| b.wait(Duration::from_secs(10))))
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            board.release(true);
            for w in waiters {
                assert_eq!(w.join().unwrap(), Release::Ready);
            }
        });
        assert!(started.elapsed() < Duration::from_secs(5));
        let failed = OwnBoard::create(&job).unwrap().mapped().unwrap();
        failed.release(false);
        assert_eq!(failed.wait(Duration::ZERO), Release::Failed);
        assert!(HostBoard::open(pid, 987_654, &job).is_none());
    }
}
