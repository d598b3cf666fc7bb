//! The engine: everything that runs a communicator's calls. It owns the
//! socket backend, NCCL (when every rank has it), the CUDA staging pool
//! and the ledger. Every call but a tagged message on host memory starts
//! and ends in `Engine::run`: it is numbered and traced in the ledger and
//! sent where its buffers say (`route`). Tagged messages on host memory go
//! to the transport's endpoint through `messages`, numbered and traced in
//! the same ledger, so that they move whatever the collectives are doing.

use super::cuda::{self, Cuda, Stream};
use super::ledger::Ledger;
use super::messages::Messages;
use super::nccl::communicator::{NcclComm, Raw};
use super::route::{self, Route};
use super::socket::{Settings, SocketBackend, Survivors};
use super::staging::StagingPool;
use crate::algorithms::Algo;
use crate::call::{Call, Data, RawBuf};
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::log;
use crate::options::{LogLevel, Options};
use crate::sync::lock;
use crate::trace::Trace;
use crate::transport::membership::Roster;
use crate::transport::signal::AbortSignal;
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// What an engine is made from, besides its connections.
pub(crate) struct EngineSpec<'a> {
    pub rank: usize,
    pub roster: Roster,
    pub listener: &'a TcpListener,
    pub local_rank: usize,
    pub options: &'a Options,
    /// Every rank said at the rendezvous that NCCL cannot run in its
    /// process (see `nccl::may_run`).
    pub nobody_has_nccl: bool,
}

pub(crate) struct Engine {
    rank: usize,
    timeout: Duration,
    signal: Arc<AbortSignal>,
    socket: SocketBackend,
    /// NCCL, for device buffers, when every rank could run it.
    nccl: Option<NcclComm>,
    /// The CUDA driver, when this process can have device buffers.
    cuda: Option<&'static Cuda>,
    /// Host buffers and events for staging device buffers.
    staging: StagingPool,
    /// Numbers and traces every call (and holds the flight recorder's board).
    ledger: Arc<Ledger>,
    /// Tagged messages on host memory.
    messages: Arc<Messages>,
    /// What it was made with (a shrink makes NCCL's side again with them).
    options: Options,
    /// The local rank its device was chosen by at init (kept by splits
    /// and shrinks: a rank's device does not change with its new rank).
    device_rank: usize,
}

/// Ends a communicator's work without its engine's lock, which a call
/// stuck in NCCL may hold.
pub(crate) struct Aborter {
    signal: Arc<AbortSignal>,
    nccl: Option<Arc<Raw>>,
}

impl Aborter {
    /// The ranks this rank lost (see `AbortSignal::lost_ranks`).
    pub(crate) fn failed_ranks(&self) -> Vec<usize> {
        self.signal.lost_ranks()
    }

    pub(crate) fn abort(&self) {
        self.signal.abort();
        // NCCL's side first: an operation stuck on the GPU ends now.
        if let Some(raw) = &self.nccl {
            raw.abort();
        }
    }
}

/// A shrink of a communicator (see `Comm::shrink`): every rank but those
/// excluded and the failed, agreed among them, without the parent's
/// engine lock (a concurrent rdist_comm_abort takes it); then
/// `Engine::shrunk` makes the NCCL side.
pub(crate) struct Shrinker {
    survivors: Survivors,
    /// The ranks the parent lost, as this rank knows.
    lost: Vec<usize>,
}

/// A shrink's socket side, done: what `Engine::shrunk` completes.
pub(crate) struct Shrunk {
    rank: usize,
    socket: SocketBackend,
    signal: Arc<AbortSignal>,
    /// Parent ranks left out.
    left_out: Vec<usize>,
    timeout: Duration,
    /// Whether this rank knew the parent lost a rank.
    lost_any: bool,
}

impl Shrinker {
    pub(crate) fn agree(self, exclude: &[usize], timeout: Duration) -> Result<Shrunk> {
        let signal = Arc::new(AbortSignal::new().map_err(|e| Error::system("eventfd", &e))?);
        let lost_any = !self.lost.is_empty();
        let (rank, socket, left_out) =
            self.survivors
                .shrink(exclude, self.lost, signal.clone(), timeout)?;
        Ok(Shrunk {
            rank,
            socket,
            signal,
            left_out,
            timeout,
            lost_any,
        })
    }
}

/// Whether every rank of `socket`'s communicator says `yes` (an
/// allgather of one byte each).
fn all_say(socket: &mut SocketBackend, ledger: &Ledger, yes: bool) -> Result<bool> {
    let size = socket.roster().addrs.len();
    let mine = [yes as u8];
    let mut all = vec![0u8; size];
    let call = Call::AllGather {
        send: RawBuf::of(&mine),
        recv: RawBuf::new(all.as_mut_ptr(), size),
        data: Data {
            count: 1,
            dtype: DType::Uint8,
        },
    };
    let seq = ledger.number(&call);
    // SAFETY: both buffers live until the call returns.
    unsafe { socket.run(&call, seq) }?;
    Ok(all.iter().all(|b| *b == 1))
}

impl Engine {
    /// Connects to every rank of `spec.roster` and, when the options and
    /// every rank allow, creates NCCL's communicator too.
    pub(crate) fn connect(spec: EngineSpec<'_>) -> Result<Engine> {
        let EngineSpec {
            rank,
            roster,
            listener,
            local_rank,
            options,
            nobody_has_nccl,
        } = spec;
        let started = Instant::now();
        let forced = options.algo.as_deref().map(Algo::parse).transpose()?;
        let signal = Arc::new(AbortSignal::new().map_err(|e| Error::system("eventfd", &e))?);
        let size = roster.addrs.len();
        let addr = roster.addrs[rank];
        let settings = Settings::new(options, forced);
        let mut socket = SocketBackend::connect(rank, roster, listener, signal.clone(), settings)?;
        let trace = options
            .trace_file
            .as_deref()
            .map(|p| Trace::new(p, rank, size));
        let ledger = Arc::new(Ledger::new(size, trace));
        let messages = Arc::new(Messages::new(socket.endpoint(), ledger.clone()));
        log::emit(
            LogLevel::Info,
            Some(rank),
            &format!(
                "joined {size} ranks in {:.3} s: socket backend over {}, local rank {local_rank}, listening on {addr}",
                started.elapsed().as_secs_f64(),
                socket.transport_detail(),
            ),
        );
        log::emit(
            LogLevel::Info,
            Some(rank),
            &format!("tuning: {}", socket.tuning_detail()),
        );
        let nccl = super::nccl::establish(
            &mut |call: &Call| {
                let seq = ledger.number(call);
                // SAFETY: establish passes calls on its own live buffers.
                unsafe { socket.run(call, seq) }
            },
            options,
            rank,
            size,
            local_rank,
            nobody_has_nccl,
        )?;
        Ok(Engine {
            rank,
            timeout: options.timeout,
            signal,
            socket,
            nccl,
            cuda: cuda::driver(),
            staging: StagingPool::default(),
            ledger,
            messages,
            options: options.clone(),
            device_rank: local_rank,
        })
    }

    /// Where calls are numbered and traced (and the flight recorder's board).
    pub(crate) fn ledger(&self) -> Arc<Ledger> {
        self.ledger.clone()
    }

    /// Tagged messages on host memory.
    pub(crate) fn messages(&self) -> Arc<Messages> {
        self.messages.clone()
    }

    /// Has the endpoint's thread run `hook` now and then (the flight
    /// recorder's publisher).
    pub(crate) fn set_hook(&self, hook: Box<dyn FnMut() + Send>) {
        self.socket.endpoint().set_hook(hook);
    }

    pub(crate) fn has_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    pub(crate) fn roster(&self) -> &Roster {
        self.socket.roster()
    }

    pub(crate) fn aborter(&self) -> Aborter {
        Aborter {
            signal: self.signal.clone(),
            nccl: self.nccl.as_ref().map(|n| n.raw()),
        }
    }

    /// Runs `calls` where their buffers say. `streams` are the callers'
    /// streams, one per call (None: the default stream). With
    /// `finish_on_device`, device work has finished when this returns;
    /// otherwise it has been enqueued on the streams, as NCCL does.
    ///
    /// # Safety
    /// The calls' buffers valid until this returns (device buffers: until
    /// the work on their streams is done).
    pub(crate) unsafe fn run(
        &mut self,
        calls: &[Call],
        streams: Option<&[Stream]>,
        finish_on_device: bool,
    ) -> Result<()> {
        self.run_where(calls, streams, false, finish_on_device)
            .unwrap_or_else(|| Err(Error::internal("a call was left unrun")))
    }

    /// Runs `calls` on NCCL if that is where they all go; None (nothing
    /// run) otherwise. Device work is enqueued when this returns.
    ///
    /// # Safety
    /// As `run`.
    pub(crate) unsafe fn run_if_device(
        &mut self,
        calls: &[Call],
        streams: &[Stream],
    ) -> Option<Result<()>> {
        self.nccl.as_ref()?;
        self.run_where(calls, Some(streams), true, false)
    }

    unsafe fn run_where(
        &mut self,
        calls: &[Call],
        streams: Option<&[Stream]>,
        device_only: bool,
        finish_on_device: bool,
    ) -> Option<Result<()>> {
        if let Some(e) = self.nccl.as_ref().and_then(|n| n.failure()) {
            self.socket.fail(e.clone());
            return Some(Err(e));
        }
        if self.signal.is_aborted() {
            return Some(Err(Error::new(
                ErrorKind::Aborted,
                format!("the communicator was aborted (rank {})", self.rank),
            )));
        }
        let Some(cuda) = self.cuda else {
            return (!device_only).then(|| self.run_host(calls));
        };
        let defaults;
        let streams = match streams {
            Some(s) => s,
            None => {
                defaults = vec![Stream::DEFAULT; calls.len()];
                &defaults
            }
        };
        let route = match (&self.nccl, calls) {
            // A barrier alone has no buffers to say where it goes.
            (Some(_), [Call::Barrier]) => Route::Device,
            _ => match route::route(
                cuda,
                calls,
                streams,
                // What NCCL cannot do goes to the sockets, staged.
                self.nccl
                    .as_ref()
                    .filter(|_| calls.iter().all(Call::nccl_can))
                    .map(|n| n.place()),
            ) {
                Ok(r) => r,
                Err(e) => return Some(Err(e)),
            },
        };
        match route {
            Route::Device => Some(self.run_device(calls, streams, finish_on_device)),
            _ if device_only => None,
            Route::Host => Some(self.run_host(calls).map_err(|e| self.mixed(e))),
            Route::Staged(plan) => {
                let deadline = Instant::now() + self.timeout;
                let Engine {
                    socket,
                    ledger,
                    staging,
                    ..
                } = self;
                let r = plan.run(calls, deadline, staging, |c| run_host(socket, ledger, c));
                Some(r.map_err(|e| self.mixed(e)))
            }
        }
    }

    /// Host buffers: the socket backend.
    unsafe fn run_host(&mut self, calls: &[Call]) -> Result<()> {
        run_host(&mut self.socket, &self.ledger, calls)
    }

    /// Device buffers of NCCL's device: NCCL, numbered and traced like
    /// every other call.
    unsafe fn run_device(
        &mut self,
        calls: &[Call],
        streams: &[Stream],
        finish_on_device: bool,
    ) -> Result<()> {
        let Some(n) = self.nccl.as_mut() else {
            return Err(Error::internal("device route without NCCL"));
        };
        let started = Instant::now();
        let seqs: Vec<u64> = calls.iter().map(|c| self.ledger.number(c)).collect();
        let first = calls
            .first()
            .map(|c| c.op_kind())
            .zip(seqs.first().copied());
        if let Some((kind, seq)) = first {
            self.ledger.begin(kind, seq);
        }
        let r = match calls {
            [Call::Barrier] => n.barrier(),
            _ => n.run(calls, streams, finish_on_device),
        };
        if let Some((kind, seq)) = first {
            self.ledger.end(kind, seq);
        }
        // An error that failed NCCL's communicator fails the whole
        // communicator, and the peers hear of it now.
        if let (Err(e), Some(_)) = (&r, n.failure()) {
            self.socket.fail(e.clone());
        }
        for (c, seq) in calls.iter().zip(seqs) {
            self.ledger.record(c, seq, started, r.is_ok());
        }
        r
    }

    /// A timeout on the sockets of a communicator that also has NCCL: each
    /// rank picks NCCL or the sockets from its own buffers, so say so.
    fn mixed(&self, e: Error) -> Error {
        match (e.kind(), &self.nccl) {
            (ErrorKind::Timeout, Some(_)) => Error::new(
                ErrorKind::Timeout,
                format!(
                    "{} (this call ran on the sockets because this rank's buffers were host memory, or mixed; a rank whose buffers were all device memory ran it on NCCL instead: every rank must pass the same kind of memory)",
                    e.message()
                ),
            ),
            _ => e,
        }
    }

    /// Collective split (see `Comm::split`): the new rank and engine, or
    /// None for no color. Every rank of an NCCL communicator splits NCCL's
    /// too (those without a color included, as ncclCommSplit requires).
    pub(crate) fn split(&mut self, color: i32, key: i32) -> Result<Option<(usize, Engine)>> {
        let signal = Arc::new(AbortSignal::new().map_err(|e| Error::system("eventfd", &e))?);
        let seq = self.ledger.next_collective();
        let split = self.socket.split(color, key, seq, signal.clone())?;
        let shape = split
            .as_ref()
            .map(|(rank, b)| (*rank, b.roster().addrs.len()));
        let nccl = match &self.nccl {
            Some(n) => n.split(color, key, shape)?,
            None => None,
        };
        let Some((rank, socket)) = split else {
            return Ok(None);
        };
        let size = socket.roster().addrs.len();
        let ledger = Arc::new(Ledger::new(size, None));
        let options = self.options.clone();
        let child = self.child(rank, signal, socket, nccl, ledger, options);
        Ok(Some((rank, child)))
    }

    /// A child communicator's engine (a split's, a shrink's): its own
    /// connections, NCCL, ledger and messages; this one's CUDA and device.
    fn child(
        &self,
        rank: usize,
        signal: Arc<AbortSignal>,
        socket: SocketBackend,
        nccl: Option<NcclComm>,
        ledger: Arc<Ledger>,
        options: Options,
    ) -> Engine {
        let messages = Arc::new(Messages::new(socket.endpoint(), ledger.clone()));
        Engine {
            rank,
            timeout: options.timeout,
            signal,
            socket,
            nccl,
            cuda: self.cuda,
            staging: StagingPool::default(),
            ledger,
            messages,
            options,
            device_rank: self.device_rank,
        }
    }

    /// What a shrink of this communicator needs (see `Shrinker`), taken
    /// under the engine's lock, which the agreement then does not hold.
    pub(crate) fn shrinker(&self) -> Shrinker {
        Shrinker {
            survivors: self.socket.survivors(),
            lost: self.signal.lost_ranks(),
        }
    }

    /// Completes a shrink of this communicator into an engine. Its NCCL
    /// side: a healthy shrink (no rank lost, this one not aborted, every
    /// survivor's NCCL able to) is NCCL's own ncclCommShrink (2.27 and
    /// newer), a call on this communicator's NCCL; otherwise a fresh NCCL
    /// communicator of the survivors, as at init (this one's may be
    /// broken), on the same device. Every survivor makes the same choice.
    pub(crate) fn shrunk(&self, shrunk: Shrunk) -> Result<(usize, Engine)> {
        let Shrunk {
            rank,
            mut socket,
            signal,
            left_out,
            timeout,
            lost_any,
        } = shrunk;
        let size = socket.roster().addrs.len();
        let ledger = Arc::new(Ledger::new(size, None));
        let mut options = self.options.clone();
        options.timeout = timeout;
        let nccl = match &self.nccl {
            None => None,
            Some(parent) => {
                let healthy = !lost_any && !self.signal.is_aborted() && parent.can_shrink();
                let mut shrunk = None;
                if all_say(&mut socket, &ledger, healthy)? {
                    match parent.shrink(&left_out, (rank, size)) {
                        Ok(c) => shrunk = Some(c),
                        Err(e) => log::emit(
                            LogLevel::Warn,
                            Some(self.rank),
                            &format!("ncclCommShrink failed ({e}); making a new NCCL communicator of the survivors instead"),
                        ),
                    }
                    if !all_say(&mut socket, &ledger, shrunk.is_some())? {
                        if let Some(c) = shrunk.take() {
                            c.abort();
                        }
                    }
                }
                match shrunk {
                    Some(c) => Some(c),
                    None => super::nccl::establish(
                        &mut |call: &Call| {
                            let seq = ledger.number(call);
                            // SAFETY: establish passes calls on its own live buffers.
                            unsafe { socket.run(call, seq) }
                        },
                        &options,
                        rank,
                        size,
                        self.device_rank,
                        false,
                    )?,
                }
            }
        };
        Ok((
            rank,
            self.child(rank, signal, socket, nccl, ledger, options),
        ))
    }

    /// Tells the peers this rank aborted and makes the running call end.
    pub(crate) fn abort(&mut self) {
        if let Some(n) = &self.nccl {
            n.abort();
        }
        self.socket.abort();
    }

    /// Local: NCCL first (finalizing flushes work the peers take part in),
    /// then the endpoint (tagged sends finish first); writes the trace.
    pub(crate) fn close(&mut self) {
        if let Some(n) = self.nccl.as_mut() {
            n.close();
        }
        self.socket.close();
        self.ledger.write_trace();
    }
}

/// Runs host-buffer calls on the socket backend (consecutive sends and
/// receives as one exchange), numbering and tracing each.
///
/// # Safety
/// Buffers of `calls` valid until this returns.
unsafe fn run_host(socket: &mut SocketBackend, ledger: &Ledger, calls: &[Call]) -> Result<()> {
    let mut i = 0;
    while i < calls.len() {
        let started = ledger.tracing().then(Instant::now);
        if !calls[i].is_p2p() {
            let seq = ledger.number(&calls[i]);
            let kind = calls[i].op_kind();
            ledger.begin(kind, seq);
            let result = socket.run(&calls[i], seq);
            ledger.end(kind, seq);
            if let Some(started) = started {
                ledger.record(&calls[i], seq, started, result.is_ok());
            }
            result?;
            i += 1;
            continue;
        }
        // Consecutive sends/receives run as one exchange.
        let end = calls[i..]
            .iter()
            .position(|c| !c.is_p2p())
            .map_or(calls.len(), |k| i + k);
        let numbered: Vec<(&Call, u64)> = calls[i..end]
            .iter()
            .map(|c| (c, ledger.number(c)))
            .collect();
        let result = socket.run_p2p(&numbered);
        if let Some(started) = started {
            for (c, seq) in &numbered {
                ledger.record(c, *seq, started, result.is_ok());
            }
        }
        result?;
        i = end;
    }
    Ok(())
}

/// Makes an NCCL failure found by the watchdog reach the peers at once,
/// through the sockets (a peer waiting on this rank there would otherwise
/// wait out its timeout), and lets the watchdog ask the sockets whether a
/// peer has gone.
pub(crate) fn watch_nccl(engine: &Arc<Mutex<Engine>>) {
    let mut held = lock(engine);
    let Some(n) = &held.nccl else {
        return;
    };
    let weak: Weak<Mutex<Engine>> = Arc::downgrade(engine);
    n.watchdog().on_failure(Box::new(move |e, stopping| {
        // The engine may be held by a call that is about to notice the
        // failure itself; it lets go within its own bounded wait.
        while !stopping.load(Ordering::Acquire) {
            let Some(engine) = weak.upgrade() else {
                return;
            };
            if let Ok(mut engine) = engine.try_lock() {
                engine.socket.fail(e.clone());
                return;
            }
            drop(engine);
            std::thread::sleep(Duration::from_millis(5));
        }
    }));
    let weak: Weak<Mutex<Engine>> = Arc::downgrade(engine);
    n.watchdog().probe_peers(Box::new(move || {
        // Only when no call holds the engine (one that does finds a
        // closed connection itself).
        let engine = weak.upgrade()?;
        let held = engine.try_lock().ok()?;
        held.socket.closed_peer()
    }));
    // A failure found before the handler was in place.
    if let Some(e) = n.failure() {
        held.socket.fail(e);
    }
}
