//! Issue order: a communicator's calls run inline on the caller's thread
//! when nothing is queued, otherwise behind the queued non-blocking calls
//! on the communicator's worker thread. Sends and receives on host memory
//! go to the tagged context (backend/messages, on the transport's
//! endpoint) instead, and start when posted. Those on device memory (NCCL's, or staged) are held until their
//! request is waited for or tested, or another call comes, and then start
//! together as one exchange. `Request` is a non-blocking call in flight.

use super::Birth;
use crate::backend::board::Board;
use crate::backend::cuda::Stream;
use crate::backend::engine::{Aborter, Engine};
use crate::backend::messages::{Messages, Posted};
use crate::call::Call;
use crate::error::{Error, ErrorKind, Result};
use crate::rendezvous::store::Store;
use crate::sync::{self, lock};
use crate::transport::tagged::{Described, Incoming, Outgoing, Status};
use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Runs one communicator's calls in issue order (shared by the owner's
/// thread, the worker thread, groups and threads that abort).
pub(crate) struct Runner {
    rank: usize,
    timeout: Duration,
    engine: Arc<Mutex<Engine>>,
    /// Ends the work without the engine's lock (which a call stuck in
    /// NCCL holds).
    aborter: Aborter,
    has_nccl: bool,
    /// Host-memory sends and receives.
    messages: Arc<Messages>,
    queue: Mutex<Queue>,
    queue_changed: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Non-blocking sends/receives not started yet (see `hold`).
    held: Mutex<Vec<(Call, Arc<Completion>)>>,
    /// Whether `held` may hold calls (checked without the lock on every
    /// call; set under it).
    has_held: AtomicBool,
    /// What this rank is doing (the flight recorder's board).
    board: Arc<Board>,
    /// The store the flight recorder publishes to, the world size, and
    /// where each rank runs.
    recorder: Mutex<Option<super::progress::Recorder>>,
    /// The process that made it (its requests are refused in a fork()).
    birth: Birth,
    /// `queue.unfinished`, readable without the lock (written under it):
    /// a blocking call runs inline only when nothing is queued.
    queued: AtomicUsize,
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
    /// One per call (a batch of held sends/receives completes together).
    done: Vec<Arc<Completion>>,
}

/// Where a queued call's result appears.
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
            r = sync::wait_for(&self.ready, r, left);
        }
    }

    fn complete(&self, result: Result<()>) {
        *lock(&self.result) = Some(result);
        self.ready.notify_all();
    }
}

/// A non-blocking call in flight. It belongs to the process that made
/// its communicator: in a fork() child every use is refused (the threads
/// that would finish it run only in the parent), and it is let go there
/// without touching what it shares with them.
pub struct Request {
    kind: ManuallyDrop<Kind>,
    birth: Birth,
}

enum Kind {
    /// A collective, or a device send/receive, on the worker.
    Queued(Queued),
    /// A host send or receive in the tagged context.
    P2p {
        messages: Arc<Messages>,
        posted: Posted,
    },
    /// A host send complete as it was posted (written whole at once).
    Complete(Status),
}

impl Drop for Request {
    fn drop(&mut self) {
        if !self.birth.forked() {
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.kind) }
        }
    }
}

impl Request {
    fn of(kind: Kind, birth: Birth) -> Request {
        Request {
            kind: ManuallyDrop::new(kind),
            birth,
        }
    }

    /// Refuses use from a fork() of the process that made it, saying why.
    pub fn check_process(&self) -> Result<()> {
        self.birth.check()
    }

    /// Blocks until the call completes and returns its result (bounded by
    /// the timeout).
    pub fn wait(&self) -> Result<()> {
        self.wait_status().map(|_| ())
    }

    /// `wait`, with the status of a point-to-point call.
    pub fn wait_status(&self) -> Result<Option<Status>> {
        self.check_process()?;
        match &*self.kind {
            Kind::Queued(q) => q.wait().map(|_| None),
            Kind::P2p { messages, posted } => messages.wait(posted).map(Some),
            Kind::Complete(status) => Ok(Some(*status)),
        }
    }

    /// Whether the call has completed and a wait would find nothing left
    /// to do (no trace entry to record): freeing it then skips the wait.
    pub fn settled(&self) -> bool {
        if self.birth.forked() {
            return true; // nothing to wait for here
        }
        match &*self.kind {
            Kind::Queued(_) => false,
            Kind::P2p { messages, posted } => messages.settled(posted),
            Kind::Complete(_) => true,
        }
    }

    /// The result if the call has completed; never blocks.
    pub fn test(&self) -> Option<Result<()>> {
        if let Err(e) = self.check_process() {
            return Some(Err(e));
        }
        match &*self.kind {
            Kind::Queued(q) => q.test(),
            Kind::P2p { messages, posted } => messages.test(posted).map(|r| r.map(|_| ())),
            Kind::Complete(_) => Some(Ok(())),
        }
    }

    /// Who sent what, once a point-to-point call completed (None for
    /// other calls, or while in flight).
    pub fn status(&self) -> Option<Status> {
        if self.birth.forked() {
            return None;
        }
        match &*self.kind {
            Kind::Queued(_) => None,
            Kind::P2p { messages, posted } => messages.test(posted).and_then(|r| r.ok()),
            Kind::Complete(status) => Some(*status),
        }
    }
}

/// A call queued on the communicator's worker.
struct Queued {
    done: Arc<Completion>,
    timeout: Duration,
    /// For held sends/receives: the communicator to start them on when
    /// this request is waited for or tested.
    owner: Option<Arc<Runner>>,
    /// The communicator, to abort if the call never completes.
    comm: Weak<Runner>,
    /// The counts an uneven collective reads, kept while it may read them
    /// (see `Runner::submit_keeping`).
    _arrays: Option<Box<[usize]>>,
}

/// How long a wait for queued calls may last. Calls are bounded by the
/// timeout themselves; this bound is a backstop against a bug, generous
/// enough for several queued calls.
fn backstop(timeout: Duration) -> Duration {
    timeout * 4 + Duration::from_secs(10)
}

impl Queued {
    /// Blocks until the call completes and returns its result.
    fn wait(&self) -> Result<()> {
        if let Some(owner) = &self.owner {
            owner.start_held()?;
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
        let until = Instant::now() + Duration::from_secs(10);
        if let Some(comm) = self.comm.upgrade() {
            if !comm.abort_until(until) {
                // The call that overran holds the engine and may still
                // write into this request's buffers: the error waits until
                // it lets go (a caller frees them once it hears it), said
                // now rather than silently.
                crate::log::emit(
                    crate::options::LogLevel::Warn,
                    Some(comm.rank),
                    &format!(
                        "a call overran its bound ({:.1} s) and does not end on abort; its \
                         wait returns only once it lets go of the communicator",
                        limit.as_secs_f64()
                    ),
                );
                comm.abort();
            }
        }
        if self.done.wait_until(until).is_none() {
            msg.push_str(" (and the call still had not ended 10 s later)");
        }
        Error::new(ErrorKind::Timeout, msg)
    }

    /// The result if the call has completed; never blocks (it may start
    /// held sends/receives on the worker).
    fn test(&self) -> Option<Result<()>> {
        if let Some(owner) = &self.owner {
            if let Err(e) = owner.start_held() {
                return Some(Err(e));
            }
        }
        lock(&self.done.result).clone()
    }
}

impl Runner {
    pub(crate) fn new(rank: usize, timeout: Duration, engine: Engine, birth: Birth) -> Arc<Runner> {
        let aborter = engine.aborter();
        let has_nccl = engine.has_nccl();
        let messages = engine.messages();
        let board = engine.ledger().board();
        let engine = Arc::new(Mutex::new(engine));
        crate::backend::engine::watch_nccl(&engine);
        Arc::new(Runner {
            rank,
            timeout,
            engine,
            aborter,
            has_nccl,
            messages,
            queue: Mutex::new(Queue::default()),
            queue_changed: Condvar::new(),
            worker: Mutex::new(None),
            held: Mutex::new(Vec::new()),
            has_held: AtomicBool::new(false),
            queued: AtomicUsize::new(0),
            board,
            recorder: Mutex::new(None),
            birth,
        })
    }

    /// Refuses use from a fork() of the process that made it, saying why.
    pub(crate) fn check_process(&self) -> Result<()> {
        self.birth.check()
    }

    /// Whether calls on device memory go to NCCL (fixed when it is made).
    pub(crate) fn has_nccl(&self) -> bool {
        self.has_nccl
    }

    /// Turns the flight recorder on: publishes this rank's board to
    /// `store` and reads the others' when a collective times out.
    pub(crate) fn record_to(
        &self,
        store: Arc<dyn Store>,
        size: usize,
        places: super::progress::Places,
    ) {
        lock(&self.engine).set_hook(Box::new(super::progress::publisher(
            store.clone(),
            self.rank,
            self.board.clone(),
        )));
        *lock(&self.recorder) = Some((store, size, places));
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The engine, for what is not a call (split, queries). Callers drain
    /// the queue first where order matters.
    pub(crate) fn engine(&self) -> MutexGuard<'_, Engine> {
        lock(&self.engine)
    }

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
        // Host sends/receives: posted first, waited for last.
        let mut posted = Vec::new();
        let mut rest_calls = Vec::with_capacity(calls.len());
        let mut rest_streams = Vec::with_capacity(calls.len());
        // Receives first: a payload that arrives while the batch is being
        // posted then goes straight into its buffer.
        for call in calls.iter().filter(|c| matches!(c, Call::Recv { .. })) {
            if self.is_tagged_host(call) {
                posted.push(self.post(call, None, true)?);
            }
        }
        for (call, stream) in calls.into_iter().zip(streams) {
            if call.is_p2p() && self.is_tagged_host(&call) {
                if matches!(call, Call::Send { .. }) {
                    posted.push(self.post(&call, None, true)?);
                }
            } else {
                rest_calls.push(call);
                rest_streams.push(stream);
            }
        }
        let rest = if rest_calls.is_empty() {
            Ok(())
        } else {
            self.run_rest(rest_calls, rest_streams)
                .map_err(|e| self.explained(e))
        };
        let mut first = rest.err();
        for r in &posted {
            if let Err(e) = r.wait() {
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `run_batch` of what does not go to the point-to-point context.
    unsafe fn run_rest(self: &Arc<Self>, calls: Vec<Call>, streams: Vec<Stream>) -> Result<()> {
        if calls.iter().all(Call::is_p2p) && self.has_held.load(Ordering::Acquire) {
            return self.run_with_held(calls, streams);
        }
        self.start_held()?;
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
        if call.is_p2p() && self.is_tagged_host(&call) {
            return self.run_tagged(&call, None).map(|_| ());
        }
        if call.is_p2p() && self.has_held.load(Ordering::Acquire) {
            return self.run_with_held(vec![call], vec![stream]);
        }
        self.start_held()?;
        let busy = self.queued.load(Ordering::Acquire) > 0;
        let r = if busy {
            self.submit(vec![call], Some(vec![stream]))?.wait()
        } else {
            self.run_now(std::slice::from_ref(&call), Some(&[stream]), false)
        };
        r.map_err(|e| self.explained(e))
    }

    /// Runs calls on the engine now.
    unsafe fn run_now(
        &self,
        calls: &[Call],
        streams: Option<&[Stream]>,
        finish_on_device: bool,
    ) -> Result<()> {
        lock(&self.engine).run(calls, streams, finish_on_device)
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
        if !self.has_nccl {
            return None;
        }
        if self.has_held.load(Ordering::Acquire) && calls.iter().all(Call::is_p2p) {
            // Sends/receives join the held ones in one exchange
            // (`run_batch`); which batches go there depends only on the
            // program, so the order is the same on every rank.
            return None;
        }
        if self.queued.load(Ordering::Acquire) > 0 || self.has_held.load(Ordering::Acquire) {
            // Behind queued calls. Waiting for them here, rather than
            // leaving the batch to run behind them later, keeps the
            // group's order on every rank whatever the timing.
            if let Err(e) = self.drain("rdist_group_end") {
                return Some(Err(e));
            }
        }
        lock(&self.engine).run_if_device(calls, streams)
    }

    /// Starts the held non-blocking calls and waits until every queued
    /// one has finished (bounded by `backstop`).
    pub(crate) fn drain(self: &Arc<Self>, what: &str) -> Result<()> {
        self.start_held()?;
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
            q = sync::wait_for(&self.queue_changed, q, left);
        }
        Ok(())
    }

    /// Queues non-blocking calls on the worker (`streams` None: they have
    /// no caller's stream, and finish on the device before completing).
    pub(crate) fn submit(
        self: &Arc<Self>,
        calls: Vec<Call>,
        streams: Option<Vec<Stream>>,
    ) -> Result<Request> {
        self.submit_with(calls, streams, None)
    }

    /// Queues an uneven collective; its request keeps `arrays` (the
    /// counts and offsets the call reads) until it is freed.
    ///
    /// # Safety
    /// As `submit`; the call's layouts point into `arrays`.
    pub(crate) unsafe fn submit_keeping(
        self: &Arc<Self>,
        call: Call,
        arrays: Box<[usize]>,
    ) -> Result<Request> {
        self.submit_with(vec![call], None, Some(arrays))
    }

    fn submit_with(
        self: &Arc<Self>,
        calls: Vec<Call>,
        streams: Option<Vec<Stream>>,
        arrays: Option<Box<[usize]>>,
    ) -> Result<Request> {
        self.start_held()?;
        let done = Arc::new(Completion::default());
        let finish_on_device = streams.is_none();
        self.enqueue(Job {
            calls,
            streams,
            finish_on_device,
            done: vec![done.clone()],
        })?;
        Ok(self.request_of(Kind::Queued(Queued {
            _arrays: arrays,
            ..self.queued_request(done, false)
        })))
    }

    fn request(self: &Arc<Self>, done: Arc<Completion>, held: bool) -> Request {
        self.request_of(Kind::Queued(self.queued_request(done, held)))
    }

    fn request_of(&self, kind: Kind) -> Request {
        Request::of(kind, self.birth)
    }

    fn queued_request(self: &Arc<Self>, done: Arc<Completion>, held: bool) -> Queued {
        Queued {
            done,
            timeout: self.timeout,
            owner: held.then(|| self.clone()),
            comm: Arc::downgrade(self),
            _arrays: None,
        }
    }

    /// A collective's timeout says what the other ranks last did (the
    /// flight recorder).
    fn explained(&self, e: Error) -> Error {
        if e.kind() != ErrorKind::Timeout {
            return e;
        }
        let recorder = lock(&self.recorder).clone();
        match recorder {
            Some((store, size, places)) => {
                super::progress::explain_timeout(e, &*store, self.rank, size, &self.board, &places)
            }
            None => e,
        }
    }

    /// Whether a send/receive goes to the tagged context: its
    /// buffer is host memory (device memory keeps NCCL's semantics, or is
    /// staged with the collectives).
    pub(crate) fn is_tagged_host(&self, call: &Call) -> bool {
        let buf = match call {
            Call::Send { buf, .. } | Call::Recv { buf, .. } => buf,
            _ => return false,
        };
        crate::backend::cuda::is_host(buf.addr(), buf.len())
    }

    /// A host send/receive as the tagged context takes it.
    fn described(call: &Call, tag: Option<i32>) -> Result<Described> {
        match *call {
            Call::Send { buf, data, peer } => Ok(Described::Send(Outgoing {
                buf,
                dtype: data.dtype,
                count: data.count,
                peer,
                tag: tag.unwrap_or(0),
            })),
            Call::Recv { buf, data, peer } => Ok(Described::Recv(Incoming {
                buf,
                dtype: data.dtype,
                count: data.count,
                peer: Some(peer),
                tag: Some(tag.unwrap_or(0)),
                exact: true,
            })),
            _ => Err(Error::internal(
                "a tagged call that is not a send or receive",
            )),
        }
    }

    /// Posts a host send/receive in the tagged context. `blocking`: this
    /// thread waits for it before it returns to the caller's code.
    ///
    /// # Safety
    /// The call's buffer valid (and, for a receive, untouched) until the
    /// request completes.
    pub(crate) unsafe fn post(
        self: &Arc<Self>,
        call: &Call,
        tag: Option<i32>,
        blocking: bool,
    ) -> Result<Request> {
        match Self::described(call, tag)? {
            Described::Send(msg) => self.post_send(msg, blocking),
            Described::Recv(r) => self.post_recv(r, blocking),
        }
    }

    /// Posts a host send in the tagged context (complete at once when it
    /// is written whole now).
    ///
    /// # Safety
    /// As `post`.
    pub(crate) unsafe fn post_send(
        self: &Arc<Self>,
        msg: Outgoing,
        blocking: bool,
    ) -> Result<Request> {
        if let Some(status) = self.messages.send_now(msg) {
            return Ok(self.request_of(Kind::Complete(status)));
        }
        let posted = self.messages.send(msg, blocking)?;
        Ok(self.request_of(Kind::P2p {
            messages: self.messages.clone(),
            posted,
        }))
    }

    /// A blocking host send in the tagged context.
    ///
    /// # Safety
    /// `msg.buf` valid for reads until this returns.
    pub(crate) unsafe fn send_blocking(&self, msg: Outgoing) -> Result<Status> {
        self.messages.send_blocking(msg)
    }

    /// Runs a host send/receive in the tagged context, blocking (with
    /// no request when it completes at once).
    ///
    /// # Safety
    /// The call's buffer valid (and, for a receive, untouched) until this
    /// returns.
    pub(crate) unsafe fn run_tagged(&self, call: &Call, tag: Option<i32>) -> Result<Status> {
        match Self::described(call, tag)? {
            Described::Send(msg) => self.messages.send_blocking(msg),
            Described::Recv(r) => self.messages.recv_blocking(r),
        }
    }

    /// A blocking receive with wildcards (tagged API).
    ///
    /// # Safety
    /// As `run_tagged`.
    pub(crate) unsafe fn run_recv(&self, r: Incoming) -> Result<Status> {
        self.messages.recv_blocking(r)
    }

    /// Posts a receive with wildcards (tagged API).
    ///
    /// # Safety
    /// As `post`.
    pub(crate) unsafe fn post_recv(
        self: &Arc<Self>,
        r: Incoming,
        blocking: bool,
    ) -> Result<Request> {
        let posted = self.messages.recv(r, blocking)?;
        Ok(self.request_of(Kind::P2p {
            messages: self.messages.clone(),
            posted,
        }))
    }

    /// Holds a non-blocking send/receive until its request is waited for or
    /// tested, or another call comes: then every held one starts together
    /// as one exchange, so `irecv` before `isend` can't deadlock.
    pub(crate) fn hold(self: &Arc<Self>, call: Call) -> Request {
        let done = Arc::new(Completion::default());
        let mut held = lock(&self.held);
        held.push((call, done.clone()));
        self.has_held.store(true, Ordering::Release);
        drop(held);
        self.request(done, true)
    }

    fn take_held(&self) -> Vec<(Call, Arc<Completion>)> {
        let mut held = lock(&self.held);
        self.has_held.store(false, Ordering::Release);
        std::mem::take(&mut *held)
    }

    /// Runs blocking sends/receives together with the held non-blocking
    /// ones, as one exchange, and waits for it: in `irecv; send; wait` on
    /// every rank, the irecv alone would wait for a send queued behind it.
    /// Device work is finished on return (the held calls' requests
    /// promise that).
    ///
    /// # Safety
    /// Buffers of `calls` valid until this returns.
    unsafe fn run_with_held(
        self: &Arc<Self>,
        calls: Vec<Call>,
        streams: Vec<Stream>,
    ) -> Result<()> {
        let (mut all, mut done): (Vec<Call>, Vec<Arc<Completion>>) =
            self.take_held().into_iter().unzip();
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
        self.request(mine, false).wait()
    }

    /// Starts the held sends/receives on the worker.
    pub(crate) fn start_held(self: &Arc<Self>) -> Result<()> {
        if !self.has_held.load(Ordering::Acquire) {
            return Ok(());
        }
        let held = self.take_held();
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
        // The worker first: a job queued with no worker to run it would
        // run later, after its caller was told it failed (and reused its
        // buffers).
        self.ensure_worker()?;
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
        Ok(())
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
                    q = sync::wait(&self.queue_changed, q);
                }
            };
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: whoever submitted the job keeps its buffers valid
                // until the request completes.
                unsafe { self.run_now(&job.calls, job.streams.as_deref(), job.finish_on_device) }
            }))
            .unwrap_or_else(|_| Err(Error::internal("a non-blocking call panicked")));
            for done in &job.done {
                done.complete(result.clone());
            }
            {
                let mut q = lock(&self.queue);
                q.unfinished -= 1;
                self.queued.store(q.unfinished, Ordering::Release);
            }
            self.queue_changed.notify_all();
        }
    }

    /// Refuses calls queued in a group on a communicator destroyed before
    /// the group ended: its connections are gone.
    pub(crate) fn refuse_if_closed(&self, queued: usize) -> Result<()> {
        match lock(&self.queue).closing {
            false => Ok(()),
            true => Err(Error::invalid_usage(format!(
                "rank {}: {queued} call(s) were queued in this group on a communicator that \
                 rdist_comm_destroy destroyed before the group ended; they did not run",
                self.rank
            ))),
        }
    }

    /// The ranks this rank knows to have failed; callable from any thread.
    pub(crate) fn failed_ranks(&self) -> Vec<usize> {
        self.aborter.failed_ranks()
    }

    /// Makes pending and future calls fail with `Aborted`; callable from
    /// any thread.
    pub(crate) fn abort(&self) {
        self.aborter.abort();
        // The running call (if any) notices at once and lets go of the engine.
        lock(&self.engine).abort();
    }

    /// `abort`, waiting for the engine until `until` at most (a call that
    /// never notices the abort, the backstop's case, holds it); whether
    /// it got it.
    fn abort_until(&self, until: Instant) -> bool {
        self.aborter.abort();
        loop {
            if let Some(mut engine) = sync::try_lock(&self.engine) {
                engine.abort();
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Local: runs the held sends/receives (bounded by the timeout),
    /// finishes queued calls, joins the worker and closes the engine.
    pub(crate) fn close(self: &Arc<Self>) {
        let _ = self.start_held();
        lock(&self.queue).closing = true;
        self.queue_changed.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            let _ = h.join();
        }
        lock(&self.engine).close();
    }
}
