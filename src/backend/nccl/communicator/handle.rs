//! The locking handle on the raw NCCL communicator (`Raw`), shared with the
//! watchdog: holding it for a span of NCCL calls (`Held`), waiting out
//! `ncclInProgress`, and destroying or aborting it once, from any thread.

use super::super::loader::{NcclLibrary, RawResult, NCCL_SUCCESS};
use super::abi::{NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_IN_PROGRESS, NCCL_REMOTE_ERROR};
use crate::backend::cuda::ContextGuard;
use crate::error::{Error, ErrorKind, Result};
use crate::sync::{lock, try_lock};
use cudarc::nccl::sys::ncclComm_t;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long `Raw::abort` waits for a thread issuing NCCL work to let go
/// of the communicator. A thread polling `ncclInProgress` lets go within
/// a millisecond; one still inside an NCCL call after this is stuck
/// there (a full work queue behind a dead peer), and only NCCL's own
/// abort flag can free it.
const ABORT_GRACE: Duration = Duration::from_secs(1);

/// The raw communicator, shared with the watchdog.
pub(crate) struct Raw {
    pub lib: &'static NcclLibrary,
    /// The device's context: every NCCL call runs with it current, abort
    /// and destroy too (which may come from any thread; NCCL would
    /// otherwise make device 0 current on that thread).
    context: usize,
    /// The communicator; 0 once destroyed or aborted. A thread issuing
    /// work holds the lock from `ncclGroupStart` until NCCL has taken the
    /// work (see `hold`), so an abort never frees the communicator under
    /// an NCCL call or inside an open group.
    comm: Mutex<usize>,
    /// The communicator's address, readable without the lock (for an
    /// abort that cannot wait for a stuck holder).
    handle: usize,
    /// Aborted (as opposed to destroyed).
    aborted: AtomicBool,
    /// Freed by NCCL (destroyed or aborted): whoever sets it frees it,
    /// once, even when an abort goes ahead without the lock.
    freed: AtomicBool,
    /// An abort is waiting for the lock: a holder polling NCCL gives up.
    abort_requested: AtomicBool,
}

/// The communicator, held for a span of NCCL calls (see `Raw::comm`).
pub(crate) struct Held<'a> {
    raw: &'a Raw,
    comm: MutexGuard<'a, usize>,
}

impl Raw {
    pub(super) fn new(lib: &'static NcclLibrary, comm: ncclComm_t, context: usize) -> Raw {
        Raw {
            lib,
            context,
            comm: Mutex::new(comm as usize),
            handle: comm as usize,
            aborted: AtomicBool::new(false),
            freed: AtomicBool::new(false),
            abort_requested: AtomicBool::new(false),
        }
    }

    pub(super) fn gone(&self) -> Error {
        Error::new(ErrorKind::Aborted, "the NCCL communicator was aborted")
    }

    /// Holds the communicator for a span of NCCL calls, or fails with
    /// Aborted when it is gone or being aborted.
    pub fn hold(&self) -> Result<Held<'_>> {
        if self.abort_requested.load(Ordering::Acquire) {
            return Err(self.gone());
        }
        let comm = lock(&self.comm);
        self.held(comm)
    }

    /// `hold` without waiting: None while another thread holds it.
    fn try_hold(&self) -> Option<Result<Held<'_>>> {
        try_lock(&self.comm).map(|comm| self.held(comm))
    }

    fn held<'a>(&'a self, comm: MutexGuard<'a, usize>) -> Result<Held<'a>> {
        if *comm == 0 || self.is_aborted() || self.abort_requested.load(Ordering::Acquire) {
            return Err(self.gone());
        }
        Ok(Held { raw: self, comm })
    }

    /// `ncclCommGetAsyncError` (see `Held::async_state`), or None while a
    /// thread is issuing work (the watchdog then looks next time).
    pub fn try_async_state(&self) -> Option<Result<bool>> {
        self.try_hold().map(|h| h?.async_state())
    }

    /// `ncclCommDestroy` (after a finalize), once.
    pub(super) fn destroy(&self) {
        let mut comm = lock(&self.comm);
        if *comm != 0 && !self.freed.swap(true, Ordering::AcqRel) {
            if let Some(f) = self.lib.api.ncclCommDestroy {
                let _ctx = ContextGuard::push(self.context);
                // SAFETY: a live, finalized communicator, freed once.
                unsafe { f(*comm as ncclComm_t) };
            }
        }
        *comm = 0;
    }

    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// `ncclCommAbort`, once: ends every operation in flight and frees the
    /// communicator. Safe from any thread: it asks a thread issuing work
    /// to let go first (`ABORT_GRACE`). A thread stuck inside an NCCL call
    /// past that can only be freed by NCCL's abort flag, so the abort then
    /// goes ahead without the lock (as PyTorch's watchdog does), and that
    /// thread never touches the communicator again (`aborted`).
    pub fn abort(&self) {
        self.abort_requested.store(true, Ordering::Release);
        let since = Instant::now();
        let mut pause = Duration::from_micros(50);
        let mut comm = loop {
            match try_lock(&self.comm) {
                Some(c) => break Some(c),
                None if since.elapsed() < ABORT_GRACE => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(5));
                }
                None => break None,
            }
        };
        let live = comm.as_ref().is_none_or(|c| **c != 0);
        if live && !self.freed.swap(true, Ordering::AcqRel) {
            // Before NCCL's abort: a stuck holder returning from NCCL sees
            // it and never touches the communicator again.
            self.aborted.store(true, Ordering::Release);
            if let Some(f) = self.lib.api.ncclCommAbort {
                let _ctx = ContextGuard::push(self.context);
                // SAFETY: a live communicator, freed here once (`freed`);
                // `aborted` keeps every other path off it from now on.
                unsafe { f(self.handle as ncclComm_t) };
            }
        }
        if let Some(c) = comm.as_mut() {
            **c = 0;
        }
    }
}

impl Held<'_> {
    /// Runs one NCCL call on the communicator.
    pub fn call<T>(&self, f: impl FnOnce(ncclComm_t) -> T) -> T {
        f(*self.comm as ncclComm_t)
    }

    /// `ncclCommGetAsyncError`: Ok(true) when idle, Ok(false) while a
    /// non-blocking call is still in progress, or the error.
    pub fn async_state(&self) -> Result<bool> {
        let f = self.raw.lib.api.ncclCommGetAsyncError.expect("required");
        let mut state: RawResult = NCCL_SUCCESS;
        // SAFETY: a live communicator and an out-pointer to a local.
        let rc = self.call(|comm| unsafe { f(comm, &mut state) });
        if rc != NCCL_SUCCESS {
            return Err(self.error("ncclCommGetAsyncError", rc));
        }
        match state {
            NCCL_SUCCESS => Ok(true),
            NCCL_IN_PROGRESS => Ok(false),
            e => Err(self.error("an NCCL operation", e)),
        }
    }

    /// An error for NCCL's result `rc` from `what`, with NCCL's last error
    /// text; its kind follows the result (a remote error is a lost peer).
    pub fn error(&self, what: &str, rc: RawResult) -> Error {
        let kind = match rc {
            NCCL_INVALID_ARGUMENT => ErrorKind::InvalidArgument,
            NCCL_INVALID_USAGE => ErrorKind::InvalidUsage,
            NCCL_REMOTE_ERROR => ErrorKind::PeerLost,
            _ => ErrorKind::Backend,
        };
        let last = match self.raw.lib.api.ncclGetLastError {
            // An abort may have freed it under a stuck holder: NCCL's
            // last error outside a communicator then.
            Some(_) if self.raw.freed.load(Ordering::Acquire) => self.raw.lib.last_error(),
            // SAFETY: a live communicator; NCCL returns a string it owns.
            Some(f) => self.call(|comm| unsafe { text(f(comm)) }),
            None => String::new(),
        };
        let mut msg = format!("{what} failed: {}", self.raw.lib.error_string(rc));
        if !last.is_empty() {
            msg.push_str(&format!(" ({last})"));
        }
        Error::new(kind, msg)
    }

    /// Waits out `ncclInProgress` (bounded by `deadline`; an abort ends
    /// the wait at once).
    pub fn settle(&self, what: &str, rc: RawResult, deadline: Instant) -> Result<()> {
        match rc {
            NCCL_SUCCESS => return Ok(()),
            NCCL_IN_PROGRESS => {}
            e => return Err(self.error(what, e)),
        }
        let mut pause = Duration::from_micros(1);
        loop {
            if self.raw.abort_requested.load(Ordering::Acquire) {
                return Err(self.raw.gone());
            }
            if self.async_state()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{what} was still in progress in NCCL at the timeout"),
                ));
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn text(p: *const std::ffi::c_char) -> String {
    match p.is_null() {
        true => String::new(),
        false => std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned(),
    }
}
