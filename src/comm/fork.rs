//! Telling a process that fork()ed from the one that made a communicator:
//! the child shares the parent's sockets and shared memory but has none of
//! its threads, so a call there would interleave bytes with the parent's
//! and wait for progress no thread makes. Such calls fail with
//! `InvalidUsage`; destroying the communicator there leaves the parent's
//! connections alone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

use crate::error::{Error, Result};

/// Bumped in every child at fork() (pthread_atfork).
static FORKS: AtomicU64 = AtomicU64::new(0);
static WATCHING: Once = Once::new();

extern "C" fn in_child_after_fork() {
    // Async-signal-safe: one atomic add.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Where a communicator was made.
#[derive(Clone, Copy, Debug)]
pub struct Birth {
    forks: u64,
    pid: u32,
}

impl Birth {
    /// This process, now.
    pub fn here() -> Birth {
        WATCHING.call_once(|| {
            // SAFETY: registers a handler that only touches an atomic.
            unsafe { libc::pthread_atfork(None, None, Some(in_child_after_fork)) };
        });
        Birth {
            forks: FORKS.load(Ordering::Relaxed),
            pid: std::process::id(),
        }
    }

    /// True in a process forked from the one of this birth (one relaxed load).
    pub fn forked(&self) -> bool {
        FORKS.load(Ordering::Relaxed) != self.forks
    }

    /// Refuses use from a forked process, saying why.
    pub fn check(&self) -> Result<()> {
        if !self.forked() {
            return Ok(());
        }
        Err(Error::invalid_usage(format!(
            "this communicator was created in process {} and this process ({}) is a fork() of \
             it: a communicator cannot be used across fork() (the child shares its connections \
             but not its threads); create a new communicator in the child",
            self.pid,
            std::process::id()
        )))
    }
}
