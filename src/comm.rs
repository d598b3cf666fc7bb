//! `Comm`: a communicator. Creation (rendezvous + mesh), rank/size/split/
//! abort, and the one place where calls run: inline on the caller's thread,
//! or on the communicator's worker thread for non-blocking calls (which
//! keeps every call in issue order).

use crate::algorithms::Algo;
use crate::backend::cuda::{self, Cuda, Stream};
use crate::backend::nccl::communicator::{NcclComm, Raw};
use crate::backend::route::{self, Route, StagingPool};
use crate::backend::socket::{Settings, SocketBackend};
use crate::call::Call;
use crate::error::{Error, ErrorKind, Result};
use crate::group;
use crate::log;
use crate::options::{Backend, LogLevel, Options};
use crate::rendezvous::store::TcpStoreServer;
use crate::rendezvous::{self, method, unique_id::UniqueId, Meeting};
use crate::trace::Trace;
use crate::transport::signal::AbortSignal;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A communicator: a group of ranks that run collectives together.
pub struct Comm {
    shared: Arc<Shared>,
}

/// The state shared between the owner's thread, the worker thread and
/// threads that abort.
pub(crate) struct Shared {
    rank: usize,
    size: usize,
    local_rank: usize,
    timeout: Duration,
    signal: Arc<AbortSignal>,
    engine: Mutex<Engine>,
    queue: Mutex<Queue>,
    queue_changed: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Non-blocking sends/receives not started yet (see `defer`).
    deferred: Mutex<Vec<(Call, Arc<Completion>)>>,
    /// Whether `deferred` may hold calls (checked without the lock on
    /// every call; set under it).
    has_deferred: AtomicBool,
    /// `queue.unfinished`, readable without the lock (written under it):
    /// a blocking call runs inline only when nothing is queued.
    queued: AtomicUsize,
    /// NCCL's communicator, reachable without the engine's lock (which a
    /// call stuck in NCCL holds) so that abort can end the call.
    nccl_raw: Mutex<Option<Arc<Raw>>>,
}

struct Engine {
    backend: SocketBackend,
    /// NCCL, for device buffers, when every rank could run it.
    nccl: Option<NcclComm>,
    /// The CUDA driver, when this process can have device buffers.
    cuda: Option<&'static Cuda>,
    /// Host buffers and events for staging device buffers (see `route`).
    staging: StagingPool,
    trace: Option<Trace>,
    /// The rendezvous store this rank hosts, if any (lives with the comm).
    _server: Option<TcpStoreServer>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Jobs submitted and not yet finished (queued or running).
    unfinished: usize,
    closing: bool,
}

struct Job {
    calls: Vec<Call>,
    /// The callers' streams for blocking calls queued behind non-blocking
    /// ones (None for non-blocking calls, which have none).
    streams: Option<Vec<Stream>>,
    /// Complete only once device work finished (non-blocking calls, whose
    /// requests promise that), not once it is enqueued.
    finish_on_device: bool,
    /// One per call (a batch of deferred sends/receives completes together).
    done: Vec<Arc<Completion>>,
}

/// Where a non-blocking call's result appears.
#[derive(Default)]
struct Completion {
    result: Mutex<Option<Result<()>>>,
    ready: Condvar,
}

impl Completion {
    /// The result once the call completed, or None at `deadline`.
    fn wait_until(&self, deadline: Instant) -> Option<Result<()>> {
        let mut r = lock(&self.result);
        loop {
            if let Some(res) = r.as_ref() {
                return Some(res.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            r = self
                .ready
                .wait_timeout(r, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A non-blocking call in flight.
pub struct Request {
    done: Arc<Completion>,
    timeout: Duration,
    /// For deferred sends/receives: the communicator to start them on
    /// when this request is waited for or tested.
    owner: Option<Arc<Shared>>,
    /// The communicator, to abort if the call never completes.
    comm: std::sync::Weak<Shared>,
}

/// How long a wait for queued calls may last. Calls are bounded by the
/// timeout themselves; this bound is a backstop against a bug, generous
/// enough for several queued calls.
fn backstop(timeout: Duration) -> Duration {
    timeout * 4 + Duration::from_secs(10)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock was already reported as an error; the
    // state itself stays consistent, so keep going.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Request {
    /// Blocks until the call completes and returns its result.
    pub fn wait(&self) -> Result<()> {
        if let Some(owner) = &self.owner {
            owner.flush_deferred()?;
        }
        let limit = backstop(self.timeout);
        match self.done.wait_until(Instant::now() + limit) {
            Some(res) => res,
            None => Err(self.give_up(limit)),
        }
    }

    /// The backstop fired: the call may still be queued, and must never
    /// touch its buffers after the caller hears it failed (and frees them).
    /// Aborting the communicator ends a running call and makes queued ones
    /// fail without running; this waits (bounded) for that.
    fn give_up(&self, limit: Duration) -> Error {
        let mut msg = format!(
            "request did not complete within {:.1} s; the communicator was aborted",
            limit.as_secs_f64()
        );
        if let Some(comm) = self.comm.upgrade() {
            comm.abort();
        }
        let grace = Duration::from_secs(10);
        if self.done.wait_until(Instant::now() + grace).is_none() {
            msg.push_str(" (and the call still had not ended 10 s later)");
        }
        Error::new(ErrorKind::Timeout, msg)
    }

    /// The result if the call has completed; never blocks (it may start
    /// deferred sends/receives on the worker).
    pub fn test(&self) -> Option<Result<()>> {
        if let Some(owner) = &self.owner {
            if let Err(e) = owner.flush_deferred() {
                return Some(Err(e));
            }
        }
        lock(&self.done.result).clone()
    }
}

impl Shared {
    /// Runs calls in issue order: inline when nothing is queued, otherwise
    /// behind the queued non-blocking calls.
    ///
    /// # Safety
    /// Buffers of `calls` valid until this returns.
    pub(crate) unsafe fn run_batch(
        self: &Arc<Self>,
        calls: Vec<Call>,
        streams: Vec<Stream>,
    ) -> Result<()> {
        if calls.iter().all(Call::is_p2p) && self.has_deferred.load(Ordering::Acquire) {
            return self.run_with_deferred(calls, streams);
        }
        self.flush_deferred()?;
        let busy = lock(&self.queue).unfinished > 0;
        if busy {
            return self.submit(calls, Some(streams))?.wait();
        }
        self.run_now(&calls, Some(&streams), false)
    }

    /// `run_batch` of one call, without allocating on the inline path
    /// (small collectives are a few hundred nanoseconds in all).
    ///
    /// # Safety
    /// Buffers of `call` valid until this returns.
    pub(crate) unsafe fn run_one(self: &Arc<Self>, call: Call, stream: Stream) -> Result<()> {
        if call.is_p2p() && self.has_deferred.load(Ordering::Acquire) {
            return self.run_with_deferred(vec![call], vec![stream]);
        }
        self.flush_deferred()?;
        let busy = self.queued.load(Ordering::Acquire) > 0;
        if busy {
            return self.submit(vec![call], Some(vec![stream]))?.wait();
        }
        self.run_now(std::slice::from_ref(&call), Some(&[stream]), false)
    }

    /// Runs calls where their buffers say (see `route`). `streams` are the
    /// callers' streams, one per call; None for non-blocking twins, which
    /// have none: their device work runs on the default stream. With
    /// `finish_on_device`, device work is finished when this returns.
    unsafe fn run_now(
        &self,
        calls: &[Call],
        streams: Option<&[Stream]>,
        finish_on_device: bool,
    ) -> Result<()> {
        self.dispatch(calls, streams, false, finish_on_device)
            .unwrap_or_else(|| Err(Error::internal("a call was left unrun")))
    }

    /// Enqueues `calls` on NCCL now if that is where they all go (None
    /// otherwise, leaving them to `run_batch`). A group's device batches
    /// are enqueued this way one communicator after another, in the order
    /// of the group, so that kernels sharing a stream queue in the same
    /// order on every rank.
    ///
    /// # Safety
    /// Device buffers valid until the work on their streams is done.
    pub(crate) unsafe fn try_device_batch(
        self: &Arc<Self>,
        calls: &[Call],
        streams: &[Stream],
    ) -> Option<Result<()>> {
        if lock(&self.nccl_raw).is_none() {
            return None;
        }
        if self.has_deferred.load(Ordering::Acquire) && calls.iter().all(Call::is_p2p) {
            // Sends/receives join the held ones in one exchange
            // (`run_batch`); which batches go there depends only on the
            // program, so the order is the same on every rank.
            return None;
        }
        if self.queued.load(Ordering::Acquire) > 0 || self.has_deferred.load(Ordering::Acquire) {
            // Behind queued calls. Waiting for them here, rather than
            // leaving the batch to run behind them later, keeps the
            // group's order on every rank whatever the timing.
            if let Err(e) = self.drain("rdist_group_end") {
                return Some(Err(e));
            }
        }
        self.dispatch(calls, Some(streams), true, false)
    }

    /// Starts the held non-blocking calls and waits until every queued
    /// one has finished (bounded by `backstop`).
    fn drain(self: &Arc<Self>, what: &str) -> Result<()> {
        self.flush_deferred()?;
        let limit = backstop(self.timeout);
        let started = Instant::now();
        let mut q = lock(&self.queue);
        while q.unfinished > 0 {
            let left = limit.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "{what}: {} queued non-blocking call(s) did not finish within {:.1} s",
                        q.unfinished,
                        limit.as_secs_f64()
                    ),
                ));
            }
            q = self
                .queue_changed
                .wait_timeout(q, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    /// Runs `calls` where their buffers say; with `device_only`, only when
    /// that is NCCL (None otherwise, nothing run).
    unsafe fn dispatch(
        &self,
        calls: &[Call],
        streams: Option<&[Stream]>,
        device_only: bool,
        background: bool,
    ) -> Option<Result<()>> {
        let mut engine = lock(&self.engine);
        let Engine {
            backend,
            trace,
            nccl,
            cuda,
            staging,
            ..
        } = &mut *engine;
        if nccl.is_none() && device_only {
            return None;
        }
        if let Some(e) = nccl.as_ref().and_then(|n| n.failure()) {
            backend.fail(e.clone());
            return Some(Err(e));
        }
        if self.signal.is_aborted() {
            return Some(Err(Error::new(
                ErrorKind::Aborted,
                format!("the communicator was aborted (rank {})", self.rank),
            )));
        }
        let Some(cuda) = cuda else {
            return (!device_only).then(|| run_host(backend, trace, calls));
        };
        let defaults;
        let streams = match streams {
            Some(s) => s,
            None => {
                defaults = vec![Stream::DEFAULT; calls.len()];
                &defaults
            }
        };
        let on_nccl = |n: &mut NcclComm, backend: &mut SocketBackend, r: Result<()>| {
            // An error that failed NCCL's communicator fails the whole
            // communicator, and the peers hear of it now.
            if let (Err(e), Some(_)) = (&r, n.failure()) {
                backend.fail(e.clone());
            }
            Some(r)
        };
        if let (Some(n), [Call::Barrier]) = (nccl.as_mut(), calls) {
            let r = n.barrier();
            return on_nccl(n, backend, r);
        }
        let route = match route::route(cuda, calls, streams, nccl.as_ref().map(|n| n.place())) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        match route {
            Route::Device => match nccl.as_mut() {
                Some(n) => {
                    let r = n.run(calls, streams, background);
                    on_nccl(n, backend, r)
                }
                None => Some(Err(Error::internal("device route without NCCL"))),
            },
            _ if device_only => None,
            Route::Host => Some(run_host(backend, trace, calls).map_err(|e| mixed(e, nccl))),
            Route::Staged(plan) => {
                let deadline = Instant::now() + self.timeout;
                let r = plan.run(calls, deadline, staging, |c| run_host(backend, trace, c));
                Some(r.map_err(|e| mixed(e, nccl)))
            }
        }
    }
}

/// A timeout on the sockets of a communicator that also has NCCL: each
/// rank picks NCCL or the sockets from its own buffers, so say so.
fn mixed(e: Error, nccl: &Option<NcclComm>) -> Error {
    match (e.kind(), nccl) {
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

/// Runs host-buffer calls on the socket backend (consecutive sends and
/// receives as one exchange), recording them in the trace.
///
/// # Safety
/// Buffers of `calls` valid until this returns.
unsafe fn run_host(
    backend: &mut SocketBackend,
    trace: &mut Option<Trace>,
    calls: &[Call],
) -> Result<()> {
    let mut i = 0;
    while i < calls.len() {
        // Consecutive sends/receives run as one exchange.
        let p2p = calls[i].is_p2p();
        let end = match p2p {
            true => calls[i..]
                .iter()
                .position(|c| !c.is_p2p())
                .map_or(calls.len(), |k| i + k),
            false => i + 1,
        };
        let started = trace.as_ref().map(|_| Instant::now());
        let result = match p2p {
            true => backend.run_p2p(&calls[i..end]),
            false => backend.run(&calls[i]),
        };
        if let (Some(t), Some(started)) = (trace.as_mut(), started) {
            for c in &calls[i..end] {
                t.record(c, started, result.is_ok());
            }
        }
        result?;
        i = end;
    }
    Ok(())
}

impl Shared {
    fn submit(self: &Arc<Self>, calls: Vec<Call>, streams: Option<Vec<Stream>>) -> Result<Request> {
        self.flush_deferred()?;
        let done = Arc::new(Completion::default());
        let finish_on_device = streams.is_none();
        self.enqueue(Job {
            calls,
            streams,
            finish_on_device,
            done: vec![done.clone()],
        })?;
        Ok(Request {
            done,
            timeout: self.timeout,
            owner: None,
            comm: Arc::downgrade(self),
        })
    }

    /// Holds a non-blocking send/receive until its request is waited for or
    /// tested, or another call comes: then every held one starts together
    /// as one exchange, so `irecv` before `isend` can't deadlock.
    fn defer(self: &Arc<Self>, call: Call) -> Request {
        let done = Arc::new(Completion::default());
        let mut held = lock(&self.deferred);
        held.push((call, done.clone()));
        self.has_deferred.store(true, Ordering::Release);
        drop(held);
        Request {
            done,
            timeout: self.timeout,
            owner: Some(self.clone()),
            comm: Arc::downgrade(self),
        }
    }

    /// Runs blocking sends/receives together with the held non-blocking
    /// ones, as one exchange, and waits for it: in `irecv; send; wait` on
    /// every rank, the irecv alone would wait for a send queued behind it.
    /// Device work is finished on return (the held calls' requests
    /// promise that).
    ///
    /// # Safety
    /// Buffers of `calls` valid until this returns.
    unsafe fn run_with_deferred(
        self: &Arc<Self>,
        calls: Vec<Call>,
        streams: Vec<Stream>,
    ) -> Result<()> {
        let held = {
            let mut d = lock(&self.deferred);
            self.has_deferred.store(false, Ordering::Release);
            std::mem::take(&mut *d)
        };
        let (mut all, mut done): (Vec<Call>, Vec<Arc<Completion>>) = held.into_iter().unzip();
        let mut all_streams = vec![Stream::DEFAULT; all.len()];
        all.extend(calls);
        all_streams.extend(streams);
        let mine = Arc::new(Completion::default());
        done.push(mine.clone());
        self.enqueue(Job {
            calls: all,
            streams: Some(all_streams),
            finish_on_device: true,
            done,
        })?;
        Request {
            done: mine,
            timeout: self.timeout,
            owner: None,
            comm: Arc::downgrade(self),
        }
        .wait()
    }

    /// Starts the held sends/receives on the worker.
    fn flush_deferred(self: &Arc<Self>) -> Result<()> {
        if !self.has_deferred.load(Ordering::Acquire) {
            return Ok(());
        }
        let held = {
            let mut d = lock(&self.deferred);
            self.has_deferred.store(false, Ordering::Release);
            std::mem::take(&mut *d)
        };
        if held.is_empty() {
            return Ok(());
        }
        let (calls, done) = held.into_iter().unzip();
        self.enqueue(Job {
            calls,
            streams: None,
            finish_on_device: true,
            done,
        })
    }

    fn enqueue(self: &Arc<Self>, job: Job) -> Result<()> {
        {
            let mut q = lock(&self.queue);
            if q.closing {
                return Err(Error::invalid_usage("the communicator is being destroyed"));
            }
            q.jobs.push_back(job);
            q.unfinished += 1;
            self.queued.store(q.unfinished, Ordering::Release);
        }
        self.queue_changed.notify_all();
        self.ensure_worker()
    }

    fn ensure_worker(self: &Arc<Self>) -> Result<()> {
        let mut w = lock(&self.worker);
        if w.is_none() {
            let me = self.clone();
            let handle = std::thread::Builder::new()
                .name(format!("rdist-rank{}", self.rank))
                .spawn(move || me.work())
                .map_err(|e| Error::system("starting the communicator's worker thread", &e))?;
            *w = Some(handle);
        }
        Ok(())
    }

    /// The worker: runs queued jobs in order until the comm closes.
    fn work(&self) {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        break job;
                    }
                    if q.closing {
                        return;
                    }
                    q = self
                        .queue_changed
                        .wait(q)
                        .unwrap_or_else(|p| p.into_inner());
                }
            };
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: whoever submitted the job keeps its buffers valid
                // until the request completes.
                unsafe { self.run_now(&job.calls, job.streams.as_deref(), job.finish_on_device) }
            }))
            .unwrap_or_else(|_| Err(Error::internal("a non-blocking call panicked")));
            for done in &job.done {
                *lock(&done.result) = Some(result.clone());
                done.ready.notify_all();
            }
            {
                let mut q = lock(&self.queue);
                q.unfinished -= 1;
                self.queued.store(q.unfinished, Ordering::Release);
            }
            self.queue_changed.notify_all();
        }
    }

    fn abort(&self) {
        self.signal.abort();
        // NCCL's side first: an operation stuck on the GPU ends now.
        if let Some(raw) = lock(&self.nccl_raw).as_ref() {
            raw.abort();
        }
        // The running call (if any) notices at once and lets go of the engine.
        let mut engine = lock(&self.engine);
        if let Some(n) = &engine.nccl {
            n.abort();
        }
        engine.backend.abort();
    }

    fn stop_worker(&self) {
        lock(&self.queue).closing = true;
        self.queue_changed.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            let _ = h.join();
        }
    }
}

impl Comm {
    /// torch.distributed-style creation: `init_method` is `env://`,
    /// `tcp://HOST:PORT` or `file:///path`; rank/size -1 read the
    /// environment. Blocks until all ranks joined or the timeout passed.
    pub fn init(init_method: &str, rank: i64, size: i64, opts: &Options) -> Result<Comm> {
        let opts = opts.with_env()?;
        let env = |k: &str| std::env::var(k).ok();
        let (rank, size) = method::rank_and_size(rank, size, &env)?;
        let meeting = Meeting::Method(method::parse(init_method, &env)?);
        Comm::create(&meeting, rank, size, &opts)
    }

    /// NCCL-style creation from a unique id made by `Comm::unique_id`.
    pub fn init_rank(
        id: &[u8; rendezvous::unique_id::UNIQUE_ID_BYTES],
        rank: i64,
        size: i64,
        opts: &Options,
    ) -> Result<Comm> {
        let opts = opts.with_env()?;
        if size < 1 || size > i32::MAX as i64 {
            return Err(Error::invalid_argument(format!(
                "world size {size} must be at least 1"
            )));
        }
        let rank = crate::call::check_rank("rank", rank, size as usize)?;
        let id = UniqueId::from_bytes(id)?;
        Comm::create(&Meeting::UniqueId(id), rank, size as usize, &opts)
    }

    /// Creates a unique id and hosts its rendezvous in this process (in a
    /// background thread, until every rank joined or the timeout).
    pub fn unique_id() -> Result<[u8; rendezvous::unique_id::UNIQUE_ID_BYTES]> {
        let opts = Options::default().with_env()?;
        let id = rendezvous::unique_id::create(opts.ifname.as_deref(), opts.timeout)?;
        Ok(id.to_bytes())
    }

    fn create(meeting: &Meeting, rank: usize, size: usize, opts: &Options) -> Result<Comm> {
        log::raise_level(opts.debug);
        let started = Instant::now();
        if opts.auth_token.is_some() {
            // Refuse rather than run unauthenticated while the user asked
            // for authentication.
            return Err(Error::new(
                ErrorKind::Unavailable,
                "auth_token is set, but this version of rdist cannot authenticate connections yet; unset it (or RDIST_AUTH_TOKEN) to run without authentication",
            ));
        }
        let forced = opts.algo.as_deref().map(Algo::parse).transpose()?;
        let joined = rendezvous::join(meeting, rank, size, opts)?;
        let signal = Arc::new(AbortSignal::new().map_err(|e| Error::system("eventfd", &e))?);
        let settings = Settings::new(opts.timeout, forced, opts.transport, opts.single_copy_min);
        let mut backend = SocketBackend::connect(
            rank,
            joined.roster.clone(),
            &joined.listener,
            signal.clone(),
            settings,
        )?;
        joined.finish();
        log::emit(
            LogLevel::Info,
            Some(rank),
            &format!(
                "joined {size} ranks in {:.3} s: socket backend over {}, local rank {}, listening on {}",
                started.elapsed().as_secs_f64(),
                backend.transport_detail(),
                joined.local_rank,
                joined.roster.addrs[rank]
            ),
        );
        let nccl = crate::backend::nccl::establish(
            &mut backend,
            opts.backend,
            rank,
            size,
            joined.local_rank,
            opts.device,
            opts.timeout,
        )?;
        let engine = Engine {
            backend,
            nccl,
            cuda: cuda::driver(),
            staging: StagingPool::default(),
            trace: opts
                .trace_file
                .as_deref()
                .map(|p| Trace::new(p, rank, size)),
            _server: joined.server,
        };
        Ok(Comm::from_parts(
            rank,
            size,
            joined.local_rank,
            opts.timeout,
            signal,
            engine,
        ))
    }

    fn from_parts(
        rank: usize,
        size: usize,
        local_rank: usize,
        timeout: Duration,
        signal: Arc<AbortSignal>,
        engine: Engine,
    ) -> Comm {
        let nccl_raw = engine.nccl.as_ref().map(|n| n.raw());
        let comm = Comm {
            shared: Arc::new(Shared {
                rank,
                size,
                local_rank,
                timeout,
                signal,
                engine: Mutex::new(engine),
                queue: Mutex::new(Queue::default()),
                queue_changed: Condvar::new(),
                worker: Mutex::new(None),
                deferred: Mutex::new(Vec::new()),
                has_deferred: AtomicBool::new(false),
                queued: AtomicUsize::new(0),
                nccl_raw: Mutex::new(nccl_raw),
            }),
        };
        comm.tell_peers_of_nccl_failures();
        comm
    }

    /// Makes an NCCL failure found by the watchdog reach the peers at
    /// once, through the sockets (a peer waiting on this rank there would
    /// otherwise wait out its timeout).
    fn tell_peers_of_nccl_failures(&self) {
        let mut engine = lock(&self.shared.engine);
        let Some(n) = &engine.nccl else {
            return;
        };
        let weak = Arc::downgrade(&self.shared);
        n.watchdog().on_failure(Box::new(move |e, stopping| {
            // The engine may be held by a call that is about to notice the
            // failure itself; it lets go within its own bounded wait.
            while !stopping.load(Ordering::Acquire) {
                let Some(shared) = weak.upgrade() else {
                    return;
                };
                if let Ok(mut engine) = shared.engine.try_lock() {
                    engine.backend.fail(e.clone());
                    return;
                }
                drop(shared);
                std::thread::sleep(Duration::from_millis(5));
            }
        }));
        let weak = Arc::downgrade(&self.shared);
        n.watchdog().probe_peers(Box::new(move || {
            // Only when no call holds the engine (one that does finds a
            // closed connection itself).
            let shared = weak.upgrade()?;
            let engine = shared.engine.try_lock().ok()?;
            engine.backend.closed_peer()
        }));
        // A failure found before the handler was in place.
        if let Some(e) = n.failure() {
            engine.backend.fail(e);
        }
    }

    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    pub fn size(&self) -> usize {
        self.shared.size
    }

    pub fn local_rank(&self) -> usize {
        self.shared.local_rank
    }

    pub fn backend(&self) -> Backend {
        match lock(&self.shared.engine).nccl {
            Some(_) => Backend::Nccl,
            None => Backend::Socket,
        }
    }

    /// Runs a call now (or queues it in the current group).
    ///
    /// # Safety
    /// The call's buffers must stay valid until it completes (for a call
    /// inside a group: until the group ends).
    pub unsafe fn run(&self, call: Call) -> Result<()> {
        self.run_on(call, Stream::DEFAULT)
    }

    /// `run` with the caller's CUDA stream for device buffers (ignored for
    /// host buffers): device work is enqueued on `stream` and this returns
    /// once it is, as NCCL does.
    ///
    /// # Safety
    /// As `run`; device buffers valid until the work on `stream` is done.
    pub unsafe fn run_on(&self, call: Call, stream: Stream) -> Result<()> {
        if group::active() {
            group::enqueue(self.shared.clone(), call, stream);
            return Ok(());
        }
        self.shared.run_one(call, stream)
    }

    /// Starts a call on the communicator's worker and returns at once.
    ///
    /// # Safety
    /// The call's buffers must stay valid and untouched until the request
    /// completes.
    pub unsafe fn submit(&self, call: Call) -> Result<Request> {
        if group::active() {
            return Err(Error::invalid_usage(
                "non-blocking calls cannot be made inside rdist_group_start/end (use the blocking calls there)",
            ));
        }
        if call.is_p2p() {
            return Ok(self.shared.defer(call));
        }
        self.shared.submit(vec![call], None)
    }

    /// Collective: ranks with equal `color` form a new communicator ordered
    /// by (key, rank); a negative color (RDIST_SPLIT_NOCOLOR) yields None.
    pub fn split(&self, color: i32, key: i32) -> Result<Option<Comm>> {
        if color < 0 && color != -1 {
            return Err(Error::invalid_argument(format!(
                "color {color} is negative (use RDIST_SPLIT_NOCOLOR, -1, to opt out)"
            )));
        }
        if group::active() {
            return Err(Error::invalid_usage(
                "rdist_comm_split cannot be called inside a group",
            ));
        }
        // Split comes after the queued non-blocking calls.
        self.shared.drain("rdist_comm_split")?;
        let signal = Arc::new(AbortSignal::new().map_err(|e| Error::system("eventfd", &e))?);
        let mut engine = lock(&self.shared.engine);
        let split = engine.backend.split(color, key, signal.clone())?;
        let shape = split
            .as_ref()
            .map(|(rank, b)| (*rank, b.roster().addrs.len()));
        // Every rank of an NCCL communicator splits NCCL's too (those
        // without a color included, as ncclCommSplit requires).
        let nccl = match &engine.nccl {
            Some(n) => n.split(color, key, shape)?,
            None => None,
        };
        let Some((rank, backend)) = split else {
            return Ok(None);
        };
        let size = backend.roster().addrs.len();
        let local_rank = backend.roster().local_rank(rank);
        let engine = Engine {
            backend,
            nccl,
            cuda: engine.cuda,
            staging: StagingPool::default(),
            trace: None,
            _server: None,
        };
        Ok(Some(Comm::from_parts(
            rank,
            size,
            local_rank,
            self.shared.timeout,
            signal,
            engine,
        )))
    }

    /// Makes pending and future calls fail with `Aborted` here and on every
    /// rank that can still be reached. Callable from any thread.
    pub fn abort(&self) {
        self.shared.abort();
    }

    /// A handle that can abort this communicator from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            shared: self.shared.clone(),
        }
    }
}

/// Aborts a communicator from another thread (see `Comm::abort`).
#[derive(Clone)]
pub struct AbortHandle {
    shared: Arc<Shared>,
}

impl AbortHandle {
    pub fn abort(&self) {
        self.shared.abort();
    }
}

impl Drop for Comm {
    /// Local: finishes queued calls, says goodbye to the peers, closes
    /// every connection and joins every thread.
    fn drop(&mut self) {
        // Held sends/receives still run (bounded by the timeout).
        let _ = self.shared.flush_deferred();
        self.shared.stop_worker();
        let mut engine = lock(&self.shared.engine);
        // NCCL first: finalizing flushes work the peers take part in.
        if let Some(n) = engine.nccl.as_mut() {
            n.close();
        }
        engine.backend.close();
        if let Some(t) = &engine.trace {
            t.write();
        }
    }
}
