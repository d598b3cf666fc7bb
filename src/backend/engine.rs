//! The engine: everything that runs a communicator's calls. It owns the
//! socket backend, NCCL (when every rank has it), the CUDA staging pool,
//! the operation sequence and the trace. Every call, on any backend,
//! starts and ends in `Engine::run`: it is numbered there, traced there,
//! and sent where its buffers say (`route`).

use super::board::Board;
use super::cuda::{self, Cuda, Stream};
use super::nccl::communicator::{NcclComm, Raw};
use super::p2p::Mailbox;
use super::route::{self, Route};
use super::socket::{Settings, SocketBackend};
use super::staging::StagingPool;
use crate::algorithms::Algo;
use crate::call::Call;
use crate::error::{Error, ErrorKind, Result};
use crate::log;
use crate::options::{Backend, LogLevel, Options};
use crate::sync::lock;
use crate::trace::Trace;
use crate::transport::roster::Roster;
use crate::transport::signal::AbortSignal;
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The numbers every rank must agree on: one per collective, and one per
/// message between each pair of ranks. They label the frames on the wire
/// and the trace, and name calls in errors ("allreduce #19").
pub(crate) struct Sequence {
    collectives: u64,
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl Sequence {
    fn new(size: usize) -> Sequence {
        Sequence {
            collectives: 0,
            sent: vec![0; size],
            received: vec![0; size],
        }
    }

    /// The number of `call`, advancing its counter.
    pub(crate) fn number(&mut self, call: &Call) -> u64 {
        let counter = match *call {
            Call::Send { peer, .. } => &mut self.sent[peer],
            Call::Recv { peer, .. } => &mut self.received[peer],
            _ => &mut self.collectives,
        };
        let n = *counter;
        *counter += 1;
        n
    }

    /// The number the next collective (or split) gets, advancing it.
    pub(crate) fn next_collective(&mut self) -> u64 {
        let n = self.collectives;
        self.collectives += 1;
        n
    }
}

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
    sequence: Sequence,
    trace: Option<Trace>,
    /// Host-memory sends and receives, in their own context.
    mailbox: Arc<Mailbox>,
    /// Which collective this rank is in, and which it last finished.
    board: Arc<Board>,
}

/// Ends a communicator's work without its engine's lock, which a call
/// stuck in NCCL may hold.
pub(crate) struct Aborter {
    signal: Arc<AbortSignal>,
    nccl: Option<Arc<Raw>>,
}

impl Aborter {
    pub(crate) fn abort(&self) {
        self.signal.abort();
        // NCCL's side first: an operation stuck on the GPU ends now.
        if let Some(raw) = &self.nccl {
            raw.abort();
        }
    }
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
        let mailbox = Mailbox::new(
            socket
                .take_p2p(options.timeout, signal.clone())
                .ok_or_else(|| Error::internal("no point-to-point listener"))?,
        )?;
        log::emit(
            LogLevel::Info,
            Some(rank),
            &format!(
                "joined {size} ranks in {:.3} s: socket backend over {}, local rank {local_rank}, listening on {addr}",
                started.elapsed().as_secs_f64(),
                socket.transport_detail(),
            ),
        );
        let mut sequence = Sequence::new(size);
        let nccl = super::nccl::establish(
            &mut |call: &Call| {
                let seq = sequence.number(call);
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
            sequence,
            trace: options
                .trace_file
                .as_deref()
                .map(|p| Trace::new(p, rank, size)),
            mailbox,
            board: Arc::default(),
        })
    }

    /// What this rank is doing, for the flight recorder (see `board`).
    pub(crate) fn board(&self) -> Arc<Board> {
        self.board.clone()
    }

    /// The point-to-point context (host memory).
    pub(crate) fn mailbox(&self) -> Arc<Mailbox> {
        self.mailbox.clone()
    }

    pub(crate) fn backend(&self) -> Backend {
        match self.nccl {
            Some(_) => Backend::Nccl,
            None => Backend::Socket,
        }
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
        // A peer's failure heard only by the point-to-point context (the
        // collectives may never have connected to anyone).
        if let Some(e) = self.mailbox.reported_failure() {
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
                    sequence,
                    trace,
                    staging,
                    board,
                    ..
                } = self;
                let r = plan.run(calls, deadline, staging, |c| {
                    run_host(socket, sequence, trace, board, c)
                });
                Some(r.map_err(|e| self.mixed(e)))
            }
        }
    }

    /// Host buffers: the socket backend.
    unsafe fn run_host(&mut self, calls: &[Call]) -> Result<()> {
        run_host(
            &mut self.socket,
            &mut self.sequence,
            &mut self.trace,
            &self.board,
            calls,
        )
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
        let seqs: Vec<u64> = calls.iter().map(|c| self.sequence.number(c)).collect();
        let first = calls
            .first()
            .map(|c| c.op_kind())
            .zip(seqs.first().copied());
        if let Some((kind, seq)) = first {
            self.board.begin(kind, seq);
        }
        let r = match calls {
            [Call::Barrier] => n.barrier(),
            _ => n.run(calls, streams, finish_on_device),
        };
        if let Some((kind, seq)) = first {
            self.board.end(kind, seq);
        }
        // An error that failed NCCL's communicator fails the whole
        // communicator, and the peers hear of it now.
        if let (Err(e), Some(_)) = (&r, n.failure()) {
            self.socket.fail(e.clone());
        }
        if let Some(t) = self.trace.as_mut() {
            for (c, seq) in calls.iter().zip(seqs) {
                t.record(c, seq, started, r.is_ok());
            }
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
        let seq = self.sequence.next_collective();
        let split = self.socket.split(color, key, seq, signal.clone())?;
        let shape = split
            .as_ref()
            .map(|(rank, b)| (*rank, b.roster().addrs.len()));
        let nccl = match &self.nccl {
            Some(n) => n.split(color, key, shape)?,
            None => None,
        };
        let Some((rank, mut socket)) = split else {
            return Ok(None);
        };
        let size = socket.roster().addrs.len();
        let mailbox = Mailbox::new(
            socket
                .take_p2p(self.timeout, signal.clone())
                .ok_or_else(|| Error::internal("no point-to-point listener"))?,
        )?;
        Ok(Some((
            rank,
            Engine {
                rank,
                timeout: self.timeout,
                signal,
                socket,
                nccl,
                cuda: self.cuda,
                staging: StagingPool::default(),
                sequence: Sequence::new(size),
                trace: None,
                mailbox,
                board: Arc::default(),
            },
        )))
    }

    /// Tells the peers this rank aborted and makes the running call end.
    pub(crate) fn abort(&mut self) {
        if let Some(n) = &self.nccl {
            n.abort();
        }
        self.socket.abort();
    }

    /// Local: NCCL first (finalizing flushes work the peers take part in),
    /// then the sockets; writes the trace.
    pub(crate) fn close(&mut self) {
        self.mailbox.close();
        if let Some(n) = self.nccl.as_mut() {
            n.close();
        }
        self.socket.close();
        if let Some(t) = &self.trace {
            t.write();
        }
    }
}

/// Runs host-buffer calls on the socket backend (consecutive sends and
/// receives as one exchange), numbering and tracing each.
///
/// # Safety
/// Buffers of `calls` valid until this returns.
unsafe fn run_host(
    socket: &mut SocketBackend,
    sequence: &mut Sequence,
    trace: &mut Option<Trace>,
    board: &Board,
    calls: &[Call],
) -> Result<()> {
    let mut i = 0;
    while i < calls.len() {
        let started = trace.as_ref().map(|_| Instant::now());
        if !calls[i].is_p2p() {
            let seq = sequence.number(&calls[i]);
            let kind = calls[i].op_kind();
            board.begin(kind, seq);
            let result = socket.run(&calls[i], seq);
            board.end(kind, seq);
            if let (Some(t), Some(started)) = (trace.as_mut(), started) {
                t.record(&calls[i], seq, started, result.is_ok());
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
            .map(|c| (c, sequence.number(c)))
            .collect();
        let result = socket.run_p2p(&numbered);
        if let (Some(t), Some(started)) = (trace.as_mut(), started) {
            for (c, seq) in &numbered {
                t.record(c, *seq, started, result.is_ok());
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
