//! An NCCL communicator: created non-blocking (so no NCCL call can hang a
//! thread past the timeout), driven for device buffers, watched by
//! `watchdog`, aborted or finalized at the end.

mod abi;
mod handle;
pub(crate) mod watchdog;

pub use abi::{abi_constants, config_layout, REQUIRED};
pub(crate) use handle::Raw;

use super::loader::{NcclLibrary, RawResult};
use crate::backend::cuda::{self, ContextGuard, Stream};
use crate::call::{Call, Data, RawBuf};
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::ReduceOp;
use abi::{dtype, op, Config, NCCL_SHRINK_DEFAULT, NCCL_SPLIT_NOCOLOR};
use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclUniqueId};
use handle::Held;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};
use watchdog::{Watchdog, Watched};

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
    /// `finish_on_device`, returns once they finished on the GPU (bounded);
    /// otherwise once enqueued, as NCCL does.
    ///
    /// # Safety
    /// Device buffers valid until the work completes on the streams.
    pub unsafe fn run(
        &mut self,
        calls: &[Call],
        streams: &[Stream],
        finish_on_device: bool,
    ) -> Result<()> {
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
        let mut result = self.issue(calls, streams, finish_on_device);
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

    unsafe fn issue(
        &mut self,
        calls: &[Call],
        streams: &[Stream],
        finish_on_device: bool,
    ) -> Result<()> {
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
            match finish_on_device {
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
            // Never routed here (`Call::nccl_can`).
            Call::AllGatherV { .. } | Call::AllToAllV { .. } => {
                Err(Error::internal("uneven collectives do not run on NCCL"))
            }
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
        let color = if color < 0 { NCCL_SPLIT_NOCOLOR } else { color };
        // SAFETY: a live communicator, the slot and a config NCCL copies
        // before returning (see `child`).
        let start = |parent, slot, config| unsafe { split(parent, color, key, slot, config) };
        self.child("ncclCommSplit", &start, color != NCCL_SPLIT_NOCOLOR, shape)
    }

    /// Whether the loaded NCCL has ncclCommShrink (2.27 and newer) and this
    /// communicator can still take part in one.
    pub fn can_shrink(&self) -> bool {
        self.raw.lib.api.ncclCommShrink.is_some()
            && !self.raw.is_aborted()
            && self.failure().is_none()
    }

    /// `ncclCommShrink`, collective over the ranks that stay (`exclude`:
    /// the others, in this communicator's numbering); `shape` is this
    /// rank's (rank, size) in the new one, as the socket side's agreement
    /// decided it (the same order: NCCL keeps the old one).
    pub fn shrink(&self, exclude: &[usize], shape: (usize, usize)) -> Result<NcclComm> {
        let lib = self.raw.lib;
        let Some(shrink) = lib.api.ncclCommShrink else {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "NCCL {} has no ncclCommShrink (it came in NCCL 2.27)",
                    lib.version
                ),
            ));
        };
        let mut list: Vec<c_int> = exclude.iter().map(|r| *r as c_int).collect();
        let count = list.len() as c_int;
        let list_ptr = if list.is_empty() {
            std::ptr::null_mut()
        } else {
            list.as_mut_ptr()
        };
        // SAFETY: as for split; the list outlives the call, which reads
        // it before returning.
        let start = |parent, slot, config| unsafe {
            shrink(parent, list_ptr, count, slot, config, NCCL_SHRINK_DEFAULT)
        };
        self.child("ncclCommShrink", &start, true, Some(shape))?
            .ok_or_else(|| Error::internal("ncclCommShrink made no communicator"))
    }

    /// Runs `start` (a split or a shrink: NCCL makes a child communicator
    /// of this one) and waits, bounded, for the child. `joins`: this rank
    /// is in the child (NCCL makes none otherwise).
    fn child(
        &self,
        what: &'static str,
        start: &dyn Fn(ncclComm_t, *mut ncclComm_t, *mut ncclConfig_t) -> RawResult,
        joins: bool,
        shape: Option<(usize, usize)>,
    ) -> Result<Option<NcclComm>> {
        let lib = self.raw.lib;
        let deadline = Instant::now() + self.timeout;
        let _ctx = ContextGuard::push(self.context)?;
        let mut config = Config::non_blocking();
        // A non-blocking child finishes in NCCL's own thread, which stores
        // the new communicator through this pointer when it is done (it
        // stays NULL until then): the slot must outlive that thread's
        // work, so it lives on the heap and is leaked if the wait fails.
        let slot_ptr: *mut ncclComm_t = Box::into_raw(Box::new(std::ptr::null_mut()));
        let settled = self.raw.hold().and_then(|held| {
            let rc = held.call(|parent| {
                start(
                    parent,
                    slot_ptr,
                    (&mut config as *mut Config).cast::<ncclConfig_t>(),
                )
            });
            // NCCL reports the child's progress on the parent.
            held.settle(what, rc, deadline)
        });
        if let Err(e) = settled {
            // After a split the ranks are out of step: the parent cannot
            // go on. A shrink that failed is replaced by a new
            // communicator, and the parent stays as it was (NCCL reports
            // on it if it is broken).
            if what == "ncclCommSplit" {
                self.watchdog.fail(e.clone());
            }
            return Err(e);
        }
        if !joins {
            // NCCL's init thread may still store NULL through the slot
            // after the parent is idle: it is left to it (8 bytes).
            return match shape {
                None => Ok(None),
                Some(_) => Err(Error::internal(
                    "a rank that takes part in a split opted out of NCCL's",
                )),
            };
        }
        let comm = {
            // NCCL stores the child only when its own init thread ends,
            // which may be after the parent is idle again (NCCL 2.28 does
            // this): wait for the store (then for the child, below).
            match self.await_split_child(slot_ptr, deadline, what) {
                Ok(comm) => {
                    // SAFETY: the store was NCCL's last touch of the slot.
                    drop(unsafe { Box::from_raw(slot_ptr) });
                    comm
                }
                Err(e) => {
                    // The slot stays leaked: NCCL may still write it.
                    self.watchdog.fail(e.clone());
                    return Err(e);
                }
            }
        };
        let raw = Arc::new(Raw::new(lib, comm, self.context));
        let Some((rank, size)) = shape else {
            raw.abort();
            return Err(Error::internal(
                "NCCL made a communicator for a rank that opted out of the split",
            ));
        };
        // The child's own state reads ncclInProgress until its init is done.
        let settled = raw
            .hold()
            .and_then(|h| h.settle(what, abi::NCCL_IN_PROGRESS, deadline));
        if let Err(e) = settled {
            raw.abort();
            self.watchdog.fail(e.clone());
            return Err(e);
        }
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

    /// Waits (until `deadline`) for NCCL to store a split's child in
    /// `slot`; returns the child (whose init may still be running). An
    /// error on the parent, or an abort, ends the wait.
    fn await_split_child(
        &self,
        slot: *mut ncclComm_t,
        deadline: Instant,
        what: &str,
    ) -> Result<ncclComm_t> {
        // SAFETY: the slot is a live, aligned heap word that NCCL's init
        // thread writes with an atomic store.
        let cell = unsafe { std::sync::atomic::AtomicPtr::from_ptr(slot) };
        let mut pause = Duration::from_micros(1);
        let child = loop {
            let child = cell.load(std::sync::atomic::Ordering::Acquire);
            if !child.is_null() {
                break child;
            }
            // A failed split may never store: NCCL reports it on the parent.
            if let Some(Err(e)) = self.raw.try_async_state() {
                return Err(e.context(what));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{what} had made no communicator by the timeout"),
                ));
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(1));
        };
        Ok(child)
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
fn describe(call: &Call) -> Watched {
    let [(a, _), (b, _)] = call.buffers();
    Watched {
        name: call.name(),
        bytes: a.len().max(b.len()),
    }
}
