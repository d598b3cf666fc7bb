//! An NCCL communicator: created non-blocking (so no NCCL call can hang a
//! thread past the timeout), driven for device buffers, watched by
//! `watchdog`, aborted or finalized at the end.

use super::loader::{NcclLibrary, RawResult, NCCL_SUCCESS};
use super::watchdog::Watchdog;
use crate::backend::cuda::{self, ContextGuard, Stream};
use crate::call::{Call, Data, RawBuf};
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::ReduceOp;
use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `ncclInvalidArgument`.
const NCCL_INVALID_ARGUMENT: RawResult = 4;
/// `ncclInvalidUsage`.
const NCCL_INVALID_USAGE: RawResult = 5;
/// `ncclRemoteError`: a peer failed or went away.
const NCCL_REMOTE_ERROR: RawResult = 6;
/// `ncclInProgress`: a non-blocking call has not finished yet.
const NCCL_IN_PROGRESS: RawResult = 7;
/// `NCCL_SPLIT_NOCOLOR`.
const NCCL_SPLIT_NOCOLOR: i32 = -1;
/// `NCCL_API_MAGIC`, which `NCCL_CONFIG_INITIALIZER` puts in `magic`.
const NCCL_API_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: "NCCL's default" for an int field.
const NCCL_CONFIG_UNDEF_INT: i32 = i32::MIN;
/// The `ncclConfig_t` version rdist fills in: `NCCL_VERSION(2, 17, 0)`.
/// NCCL resets every field newer than this to its default.
const CONFIG_VERSION: u32 = 21_700;

/// The entry points the backend cannot run without (the others are
/// optional: split, finalize, last error).
pub const REQUIRED: [&str; 13] = [
    "ncclCommInitRankConfig",
    "ncclCommAbort",
    "ncclCommDestroy",
    "ncclCommGetAsyncError",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// The start of `ncclConfig_t`, as nccl.h lays it out (NCCL copies
/// `size` bytes of it and keeps its defaults for the rest, and it ignores
/// fields newer than `version`), so this prefix works with every NCCL
/// since 2.17. `traffic_class` is there only so that no padding byte
/// reaches NCCL. tests/nccl.rs checks the layout against the installed
/// NCCL's header.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: i32,
    cga_cluster_size: i32,
    min_ctas: i32,
    max_ctas: i32,
    net_name: *const std::ffi::c_char,
    split_share: i32,
    traffic_class: i32,
}

impl Config {
    /// NCCL_CONFIG_INITIALIZER with `blocking = 0`.
    fn non_blocking() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: NCCL_API_MAGIC,
            version: CONFIG_VERSION,
            blocking: 0,
            cga_cluster_size: NCCL_CONFIG_UNDEF_INT,
            min_ctas: NCCL_CONFIG_UNDEF_INT,
            max_ctas: NCCL_CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: NCCL_CONFIG_UNDEF_INT,
            traffic_class: NCCL_CONFIG_UNDEF_INT,
        }
    }
}

/// rdist's `ncclConfig_t` prefix: its size, and each field's offset under
/// its name in nccl.h. For checking against a header (tests/nccl.rs).
pub fn config_layout() -> (usize, Vec<(&'static str, usize)>) {
    use std::mem::offset_of;
    let fields = vec![
        ("size", offset_of!(Config, size)),
        ("magic", offset_of!(Config, magic)),
        ("version", offset_of!(Config, version)),
        ("blocking", offset_of!(Config, blocking)),
        ("cgaClusterSize", offset_of!(Config, cga_cluster_size)),
        ("minCTAs", offset_of!(Config, min_ctas)),
        ("maxCTAs", offset_of!(Config, max_ctas)),
        ("netName", offset_of!(Config, net_name)),
        ("splitShare", offset_of!(Config, split_share)),
        ("trafficClass", offset_of!(Config, traffic_class)),
    ];
    (std::mem::size_of::<Config>(), fields)
}

/// The NCCL constants and enum values rdist passes or compares, under
/// their names in nccl.h (checked against a header by tests/nccl.rs).
pub fn abi_constants() -> Vec<(&'static str, i64)> {
    let mut v: Vec<(&'static str, i64)> = vec![
        ("ncclSuccess", NCCL_SUCCESS as i64),
        ("ncclInvalidArgument", NCCL_INVALID_ARGUMENT as i64),
        ("ncclInvalidUsage", NCCL_INVALID_USAGE as i64),
        ("ncclRemoteError", NCCL_REMOTE_ERROR as i64),
        ("ncclInProgress", NCCL_IN_PROGRESS as i64),
        ("NCCL_SPLIT_NOCOLOR", NCCL_SPLIT_NOCOLOR as i64),
        ("NCCL_API_MAGIC", NCCL_API_MAGIC as i64),
        ("NCCL_CONFIG_UNDEF_INT", NCCL_CONFIG_UNDEF_INT as i64),
        (
            "NCCL_UNIQUE_ID_BYTES",
            std::mem::size_of::<ncclUniqueId>() as i64,
        ),
    ];
    let dtypes = [
        ("ncclInt8", DType::Int8),
        ("ncclUint8", DType::Uint8),
        ("ncclInt32", DType::Int32),
        ("ncclUint32", DType::Uint32),
        ("ncclInt64", DType::Int64),
        ("ncclUint64", DType::Uint64),
        ("ncclFloat16", DType::Float16),
        ("ncclFloat32", DType::Float32),
        ("ncclFloat64", DType::Float64),
        ("ncclBfloat16", DType::Bfloat16),
    ];
    v.extend(dtypes.iter().map(|&(n, d)| (n, dtype(d) as i64)));
    let ops = [
        ("ncclSum", ReduceOp::Sum),
        ("ncclProd", ReduceOp::Prod),
        ("ncclMax", ReduceOp::Max),
        ("ncclMin", ReduceOp::Min),
        ("ncclAvg", ReduceOp::Avg),
    ];
    v.extend(ops.iter().map(|&(n, o)| (n, op(o) as i64)));
    v
}

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
    fn new(lib: &'static NcclLibrary, comm: ncclComm_t, context: usize) -> Raw {
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

    fn gone(&self) -> Error {
        Error::new(ErrorKind::Aborted, "the NCCL communicator was aborted")
    }

    /// Holds the communicator for a span of NCCL calls, or fails with
    /// Aborted when it is gone or being aborted.
    pub fn hold(&self) -> Result<Held<'_>> {
        if self.abort_requested.load(Ordering::Acquire) {
            return Err(self.gone());
        }
        let comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        self.held(comm)
    }

    /// `hold` without waiting: None while another thread holds it.
    fn try_hold(&self) -> Option<Result<Held<'_>>> {
        match self.comm.try_lock() {
            Ok(comm) => Some(self.held(comm)),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(self.held(p.into_inner())),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
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
    fn destroy(&self) {
        let mut comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
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
            match self.comm.try_lock() {
                Ok(c) => break Some(c),
                Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if since.elapsed() < ABORT_GRACE => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(5));
                }
                Err(std::sync::TryLockError::WouldBlock) => break None,
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

/// An NCCL communicator for one device.
pub(crate) struct NcclComm {
    raw: Arc<Raw>,
    pub ordinal: i32,
    context: usize,
    rank: usize,
    size: usize,
    timeout: Duration,
    watchdog: Watchdog,
    /// A one-element device buffer and a stream for barriers (made at the
    /// first barrier).
    barrier: Option<(usize, Stream)>,
    finished: bool,
}

fn dtype(d: DType) -> ncclDataType_t {
    use ncclDataType_t as T;
    match d {
        DType::Int8 => T::ncclInt8,
        DType::Uint8 => T::ncclUint8,
        DType::Int32 => T::ncclInt32,
        DType::Uint32 => T::ncclUint32,
        DType::Int64 => T::ncclInt64,
        DType::Uint64 => T::ncclUint64,
        DType::Float16 => T::ncclFloat16,
        DType::Float32 => T::ncclFloat32,
        DType::Float64 => T::ncclFloat64,
        DType::Bfloat16 => T::ncclBfloat16,
    }
}

fn op(o: ReduceOp) -> ncclRedOp_t {
    match o {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Prod => ncclRedOp_t::ncclProd,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
    }
}

fn ptr(b: RawBuf) -> *mut c_void {
    b.addr() as *mut c_void
}

impl NcclComm {
    /// `ncclCommInitRankConfig` (non-blocking) on device `ordinal`, waited
    /// for until `timeout`.
    pub fn init(
        lib: &'static NcclLibrary,
        id: &[u8; 128],
        rank: usize,
        size: usize,
        ordinal: i32,
        timeout: Duration,
    ) -> Result<NcclComm> {
        let deadline = Instant::now() + timeout;
        let context = cuda::primary_context(ordinal)?;
        let _ctx = ContextGuard::push(context)?;
        let mut unique = ncclUniqueId { internal: [0; 128] };
        for (d, s) in unique.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        let init = lib.api.ncclCommInitRankConfig.expect("required");
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let mut config = Config::non_blocking();
        // SAFETY: out-pointer to a local; the config outlives the call
        // (NCCL copies it).
        let rc = unsafe {
            init(
                &mut comm,
                size as i32,
                unique,
                rank as i32,
                (&mut config as *mut Config).cast::<ncclConfig_t>(),
            )
        };
        if comm.is_null() {
            return Err(Error::new(
                ErrorKind::Backend,
                format!(
                    "ncclCommInitRankConfig failed: {}",
                    lib.describe_failure("ncclCommInitRankConfig", rc)
                ),
            ));
        }
        let raw = Arc::new(Raw::new(lib, comm, context));
        let settled = raw
            .hold()
            .and_then(|h| h.settle("ncclCommInitRankConfig", rc, deadline));
        if let Err(e) = settled {
            raw.abort();
            return Err(e);
        }
        let watchdog = Watchdog::start(raw.clone(), context, timeout, rank)?;
        Ok(NcclComm {
            raw,
            ordinal,
            context,
            rank,
            size,
            timeout,
            watchdog,
            barrier: None,
            finished: false,
        })
    }

    /// The device and context NCCL runs on.
    pub fn place(&self) -> (i32, usize) {
        (self.ordinal, self.context)
    }

    /// The watchdog's failure, if NCCL failed or stalled.
    pub fn failure(&self) -> Option<Error> {
        self.watchdog.failure()
    }

    /// The watchdog, to hear about failures.
    pub fn watchdog(&self) -> &Watchdog {
        &self.watchdog
    }

    /// Enqueues `calls` on their streams (one NCCL group when more than one
    /// call, or when a call is itself several sends and receives). With
    /// `wait`, returns once they finished on the GPU (bounded); otherwise
    /// once enqueued, as NCCL does.
    ///
    /// # Safety
    /// Device buffers valid until the work completes on the streams.
    pub unsafe fn run(&mut self, calls: &[Call], streams: &[Stream], wait: bool) -> Result<()> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let barriers: Vec<Call>;
        let calls = match calls.iter().any(|c| matches!(c, Call::Barrier)) {
            false => calls,
            true => {
                // A barrier (alone or in a group) is a one-element sum on
                // the scratch buffer.
                let (scratch, _) = self.scratch()?;
                let one = RawBuf::new(scratch as *const u8, 4);
                barriers = calls
                    .iter()
                    .map(|c| match c {
                        Call::Barrier => Call::AllReduce {
                            send: one,
                            recv: one,
                            data: Data {
                                count: 1,
                                dtype: DType::Float32,
                            },
                            op: ReduceOp::Sum,
                        },
                        c => *c,
                    })
                    .collect();
                &barriers[..]
            }
        };
        let mut result = self.issue(calls, streams, wait);
        if self.raw.is_aborted() {
            // An abort meanwhile (the watchdog's, or rdist_comm_abort)
            // ended the call: whatever NCCL returned, or Ok (the wait saw
            // the aborted kernels finish), the data is not the result.
            result = Err(self.failure().unwrap_or_else(|| self.raw.gone()));
        }
        if let Err(e) = &result {
            // A wait that timed out leaves work stuck on the GPU, and a
            // group that failed halfway leaves this rank out of step with
            // its peers: either way the communicator cannot go on.
            if self.failure().is_none() {
                self.watchdog.fail(e.clone());
            }
        }
        result
    }

    unsafe fn issue(&mut self, calls: &[Call], streams: &[Stream], wait: bool) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let _ctx = ContextGuard::push(self.context)?;
        let grouped = calls.len() > 1
            || calls.iter().any(|c| {
                matches!(
                    c,
                    Call::Gather { .. } | Call::Scatter { .. } | Call::AllToAll { .. }
                ) || c.is_p2p()
            });
        let api = &self.raw.lib.api;
        {
            // Held from the group's start until NCCL has taken the work:
            // an abort must not free the communicator inside the group.
            let held = self.raw.hold()?;
            if grouped {
                held.settle(
                    "ncclGroupStart",
                    (api.ncclGroupStart.expect("required"))(),
                    deadline,
                )?;
            }
            let mut first_error = None;
            for (call, &stream) in calls.iter().zip(streams) {
                if let Err(e) = self.enqueue(&held, call, stream, deadline) {
                    first_error = Some(e);
                    break;
                }
            }
            if grouped {
                let rc = (api.ncclGroupEnd.expect("required"))();
                let ended = held.settle("ncclGroupEnd", rc, deadline);
                if first_error.is_none() {
                    first_error = ended.err();
                }
            }
            if let Some(e) = first_error {
                return Err(e);
            }
        }
        let mut seen: Vec<Stream> = Vec::new();
        for (call, &stream) in calls.iter().zip(streams) {
            if seen.contains(&stream) {
                continue;
            }
            seen.push(stream);
            match wait {
                true => {
                    self.watchdog
                        .wait_stream(stream, deadline, &format!("NCCL {}", call.name()))?
                }
                false => self.watchdog.watch_stream(stream, describe(call))?,
            }
        }
        Ok(())
    }

    /// One call's NCCL operations (inside a group when several).
    unsafe fn enqueue(
        &self,
        held: &Held,
        call: &Call,
        stream: Stream,
        deadline: Instant,
    ) -> Result<()> {
        let api = &self.raw.lib.api;
        let s = stream.as_cu().cast();
        let run = |what: &str, rc: RawResult| held.settle(what, rc, deadline);
        match *call {
            Call::AllReduce {
                send,
                recv,
                data,
                op: o,
            } => run(
                "ncclAllReduce",
                held.call(|comm| {
                    (api.ncclAllReduce.expect("required"))(
                        ptr(send),
                        ptr(recv),
                        data.count,
                        dtype(data.dtype),
                        op(o),
                        comm,
                        s,
                    )
                }),
            ),
            Call::Broadcast {
                send,
                recv,
                data,
                root,
            } => run(
                "ncclBroadcast",
                held.call(|comm| {
                    (api.ncclBroadcast.expect("required"))(
                        ptr(send),
                        ptr(recv),
                        data.count,
                        dtype(data.dtype),
                        root as i32,
                        comm,
                        s,
                    )
                }),
            ),
            Call::Reduce {
                send,
                recv,
                data,
                op: o,
                root,
            } => run(
                "ncclReduce",
                held.call(|comm| {
                    (api.ncclReduce.expect("required"))(
                        ptr(send),
                        ptr(recv),
                        data.count,
                        dtype(data.dtype),
                        op(o),
                        root as i32,
                        comm,
                        s,
                    )
                }),
            ),
            Call::AllGather { send, recv, data } => run(
                "ncclAllGather",
                held.call(|comm| {
                    (api.ncclAllGather.expect("required"))(
                        ptr(send),
                        ptr(recv),
                        data.count,
                        dtype(data.dtype),
                        comm,
                        s,
                    )
                }),
            ),
            Call::ReduceScatter {
                send,
                recv,
                data,
                op: o,
            } => run(
                "ncclReduceScatter",
                held.call(|comm| {
                    (api.ncclReduceScatter.expect("required"))(
                        ptr(send),
                        ptr(recv),
                        data.count,
                        dtype(data.dtype),
                        op(o),
                        comm,
                        s,
                    )
                }),
            ),
            Call::Gather {
                send,
                recv,
                data,
                root,
            } => {
                if self.rank == root {
                    for r in 0..self.size {
                        self.p2p(held, false, block(recv, r, data), data, r, stream, deadline)?;
                    }
                }
                self.p2p(held, true, send, data, root, stream, deadline)
            }
            Call::Scatter {
                send,
                recv,
                data,
                root,
            } => {
                if self.rank == root {
                    for r in 0..self.size {
                        self.p2p(held, true, block(send, r, data), data, r, stream, deadline)?;
                    }
                }
                self.p2p(held, false, recv, data, root, stream, deadline)
            }
            Call::AllToAll { send, recv, data } => {
                for r in 0..self.size {
                    self.p2p(held, true, block(send, r, data), data, r, stream, deadline)?;
                    self.p2p(held, false, block(recv, r, data), data, r, stream, deadline)?;
                }
                Ok(())
            }
            Call::Send { buf, data, peer } => {
                self.p2p(held, true, buf, data, peer, stream, deadline)
            }
            Call::Recv { buf, data, peer } => {
                self.p2p(held, false, buf, data, peer, stream, deadline)
            }
            Call::Barrier => Err(Error::internal(
                "a barrier reached NCCL's enqueue unreplaced",
            )),
        }
    }

    /// One ncclSend (`send`) or ncclRecv, waited out of ncclInProgress.
    #[allow(clippy::too_many_arguments)]
    unsafe fn p2p(
        &self,
        held: &Held,
        send: bool,
        buf: RawBuf,
        data: Data,
        peer: usize,
        stream: Stream,
        deadline: Instant,
    ) -> Result<()> {
        let api = &self.raw.lib.api;
        let (n, t, p, s) = (
            data.count,
            dtype(data.dtype),
            peer as i32,
            stream.as_cu().cast(),
        );
        let rc = held.call(|comm| match send {
            true => (api.ncclSend.expect("required"))(ptr(buf), n, t, p, comm, s),
            false => (api.ncclRecv.expect("required"))(ptr(buf), n, t, p, comm, s),
        });
        held.settle(if send { "ncclSend" } else { "ncclRecv" }, rc, deadline)
    }

    /// A barrier as NCCL users make one: a one-element allreduce on the
    /// device (see `run`), on an internal stream, waited for on the host
    /// (bounded).
    pub fn barrier(&mut self) -> Result<()> {
        let (_, stream) = self.scratch()?;
        // SAFETY: no caller buffers.
        unsafe { self.run(&[Call::Barrier], &[stream], true) }
    }

    /// A one-element device buffer and a non-blocking stream for
    /// barriers, made at the first one.
    fn scratch(&mut self) -> Result<(usize, Stream)> {
        if let Some(b) = self.barrier {
            return Ok(b);
        }
        let _ctx = ContextGuard::push(self.context)?;
        let mut dev: cudarc::driver::sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local.
        cuda::check("cuMemAlloc (barrier scratch)", || unsafe {
            cudarc::driver::sys::cuMemAlloc_v2(&mut dev, 4)
        })?;
        let mut s: cudarc::driver::sys::CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local. Non-blocking: a barrier never
        // waits on the legacy default stream.
        cuda::check("cuStreamCreate (barrier)", || unsafe {
            cudarc::driver::sys::cuStreamCreate(&mut s, 1)
        })?;
        self.barrier = Some((dev as usize, Stream(s as usize)));
        Ok((dev as usize, Stream(s as usize)))
    }

    /// `ncclCommSplit`, collective over this communicator (every rank
    /// calls it; a negative color opts out). `shape` is this rank's
    /// (rank, size) in the new group, as the socket side's split computed
    /// it with the same (color, key) order NCCL uses.
    pub fn split(
        &self,
        color: i32,
        key: i32,
        shape: Option<(usize, usize)>,
    ) -> Result<Option<NcclComm>> {
        let lib = self.raw.lib;
        let Some(split) = lib.api.ncclCommSplit else {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "NCCL {} has no ncclCommSplit (it came in NCCL 2.18)",
                    lib.version
                ),
            ));
        };
        let deadline = Instant::now() + self.timeout;
        let _ctx = ContextGuard::push(self.context)?;
        let mut config = Config::non_blocking();
        let color = if color < 0 { NCCL_SPLIT_NOCOLOR } else { color };
        // A non-blocking split finishes in NCCL's own thread, which stores
        // the new communicator through this pointer when it is done (it
        // stays NULL until then): the slot must outlive that thread's
        // work, so it lives on the heap and is leaked if the wait fails.
        let slot_ptr: *mut ncclComm_t = Box::into_raw(Box::new(std::ptr::null_mut()));
        let settled = self.raw.hold().and_then(|held| {
            // SAFETY: a live communicator, the slot above and a config
            // NCCL copies before returning.
            let rc = held.call(|parent| unsafe {
                split(
                    parent,
                    color,
                    key,
                    slot_ptr,
                    (&mut config as *mut Config).cast::<ncclConfig_t>(),
                )
            });
            // NCCL reports the split's progress on the parent.
            held.settle("ncclCommSplit", rc, deadline)
        });
        if let Err(e) = settled {
            // The ranks are out of step now: the parent cannot go on.
            self.watchdog.fail(e.clone());
            return Err(e);
        }
        // SAFETY: NCCL is done with the slot (the parent is idle again).
        let comm = unsafe { *Box::from_raw(slot_ptr) };
        if comm.is_null() {
            return match shape {
                None => Ok(None),
                Some(_) => Err(Error::new(
                    ErrorKind::Backend,
                    format!(
                        "ncclCommSplit made no communicator for rank {} (color {color})",
                        self.rank
                    ),
                )),
            };
        }
        let raw = Arc::new(Raw::new(lib, comm, self.context));
        let Some((rank, size)) = shape else {
            raw.abort();
            return Err(Error::internal(
                "NCCL made a communicator for a rank that opted out of the split",
            ));
        };
        let watchdog = Watchdog::start(raw.clone(), self.context, self.timeout, rank)?;
        Ok(Some(NcclComm {
            raw,
            ordinal: self.ordinal,
            context: self.context,
            rank,
            size,
            timeout: self.timeout,
            watchdog,
            barrier: None,
            finished: false,
        }))
    }

    /// Aborts NCCL's side (from any thread; see `Raw::abort`).
    pub fn abort(&self) {
        self.watchdog.abort();
    }

    /// A handle on the raw communicator for aborting from another thread.
    pub fn raw(&self) -> Arc<Raw> {
        self.raw.clone()
    }

    /// Finalizes (flushing enqueued work, bounded) and destroys; aborts
    /// instead when NCCL failed, stalled or the finalize times out.
    pub fn close(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let failed = self.watchdog.stop() || self.raw.is_aborted();
        let _ctx = ContextGuard::push(self.context);
        let api = &self.raw.lib.api;
        let clean = !failed
            && match api.ncclCommFinalize {
                Some(f) => self
                    .raw
                    .hold()
                    .and_then(|held| {
                        // SAFETY: a live communicator.
                        let rc = held.call(|comm| unsafe { f(comm) });
                        held.settle("ncclCommFinalize", rc, Instant::now() + self.timeout)
                    })
                    .is_ok(),
                None => true,
            };
        match clean {
            true => self.raw.destroy(),
            // Ends work stuck on the GPU; a no-op when already aborted.
            false => self.raw.abort(),
        }
        // Only now: freeing device memory waits for the device, which a
        // stuck kernel (ended by the abort above) would block forever.
        if let Some((scratch, stream)) = self.barrier.take() {
            // SAFETY: ours, made in `barrier`.
            unsafe {
                cudarc::driver::sys::cuMemFree_v2(scratch as _);
                cudarc::driver::sys::cuStreamDestroy_v2(stream.as_cu());
            }
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.close();
    }
}

fn block(b: RawBuf, i: usize, data: Data) -> RawBuf {
    let len = data.dtype.size() * data.count;
    RawBuf::new((b.addr() + i * len) as *const u8, len)
}

/// What the watchdog names when an operation stalls.
fn describe(call: &Call) -> String {
    let [(a, _), (b, _)] = call.buffers();
    format!("NCCL {} ({} bytes)", call.name(), a.len().max(b.len()))
}
