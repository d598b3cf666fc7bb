//! Watches an NCCL communicator from a thread of its own, so that nothing
//! hangs silently: NCCL's asynchronous errors, and operations that do not
//! finish on the GPU within the timeout (a peer died, or never called),
//! abort the communicator (`ncclCommAbort`) and become the error of the
//! next call, on this rank and, through `on_failure`, on its peers.

use super::handle::Raw;
use crate::backend::cuda::{ContextGuard, Event, Stream};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::lock;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the watchdog looks.
const PERIOD: Duration = Duration::from_millis(20);

/// Calls on one stream within this span of the first share one watched
/// event, recorded again for each (a timeout may then come this much
/// early for the last of them). An event per call cost more than the
/// call's own enqueue in NCCL: creating and destroying them, and the
/// watchdog querying thousands while the caller waited for the queue.
const COALESCE: Duration = Duration::from_millis(1);

/// How long work may be in flight before the watchdog also asks whether a
/// peer's connection closed (a dead peer leaves NCCL's kernels waiting
/// forever; the sockets know within moments).
const PROBE_AFTER: Duration = Duration::from_millis(500);

/// What to do when NCCL fails (tell the peers): given the error and a
/// flag that turns true when the watchdog is being stopped.
pub(crate) type OnFailure = Box<dyn Fn(&Error, &AtomicBool) + Send + Sync>;

/// Asks the sockets whether a peer is gone (None when all are there, or
/// when that cannot be asked right now).
pub(crate) type ProbePeers = Box<dyn Fn() -> Option<usize> + Send + Sync>;

pub(crate) struct Watchdog {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

struct Inner {
    raw: Arc<Raw>,
    timeout: Duration,
    rank: usize,
    /// Work enqueued and not known to be finished, oldest first.
    pending: Mutex<VecDeque<Pending>>,
    changed: Condvar,
    failed: Mutex<Option<Error>>,
    /// Finished events, for reuse (creating one per call costs more than
    /// recording it).
    spare: Mutex<Vec<Event>>,
    next_id: AtomicU64,
    stopping: AtomicBool,
    on_failure: Mutex<Option<OnFailure>>,
    probe: Mutex<Option<ProbePeers>>,
}

struct Pending {
    /// Tells it apart while its event is being recorded again.
    id: u64,
    /// Shared with a caller recording it again (`recording`).
    event: Arc<Event>,
    /// A caller is recording the event again: not done, not to retire.
    recording: bool,
    stream: Stream,
    /// When the first call it covers was enqueued.
    since: Instant,
    /// The first call it covers.
    what: Watched,
    /// Calls after the first that it covers.
    later: usize,
}

/// A call watched on the GPU, as a timeout names it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Watched {
    pub name: &'static str,
    pub bytes: usize,
}

impl Pending {
    fn describe(&self) -> String {
        let first = format!("NCCL {} ({} bytes)", self.what.name, self.what.bytes);
        match self.later {
            0 => first,
            n => format!("{first} and the {n} call(s) after it on its stream"),
        }
    }
}

impl Watchdog {
    pub fn start(
        raw: Arc<Raw>,
        context: usize,
        timeout: Duration,
        rank: usize,
    ) -> Result<Watchdog> {
        let inner = Arc::new(Inner {
            raw,
            timeout,
            rank,
            pending: Mutex::new(VecDeque::new()),
            changed: Condvar::new(),
            failed: Mutex::new(None),
            spare: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            on_failure: Mutex::new(None),
            probe: Mutex::new(None),
        });
        let me = inner.clone();
        let thread = std::thread::Builder::new()
            .name(format!("rdist-nccl{rank}"))
            .spawn(move || me.run(context))
            .map_err(|e| Error::system("starting the NCCL watchdog thread", &e))?;
        Ok(Watchdog {
            inner,
            thread: Some(thread),
        })
    }

    /// Sets what to do on a failure (after the communicator exists).
    pub fn on_failure(&self, f: OnFailure) {
        *lock(&self.inner.on_failure) = Some(f);
    }

    /// Sets how to ask whether a peer is gone.
    pub fn probe_peers(&self, f: ProbePeers) {
        *lock(&self.inner.probe) = Some(f);
    }

    /// Watches the work on `stream` so far (`what` names the call just
    /// enqueued): records the stream's latest watched event again when
    /// that one began under `COALESCE` ago, else a new or reused event.
    pub fn watch_stream(&self, stream: Stream, what: Watched) -> Result<()> {
        // CU_STREAM_PER_THREAD names another stream on each thread.
        let shareable = stream != Stream(2);
        let claimed = shareable
            .then(|| {
                lock(&self.inner.pending)
                    .iter_mut()
                    .rev()
                    .take(8)
                    .find(|p| p.stream == stream)
                    .filter(|p| !p.recording && p.since.elapsed() < COALESCE)
                    .map(|p| {
                        p.recording = true;
                        (p.id, p.event.clone())
                    })
            })
            .flatten();
        if let Some((id, event)) = claimed {
            // Outside the lock: a record can block behind a full launch
            // queue (a stalled peer), and the watchdog must still be able
            // to time the entry out and abort, which ends the wait.
            let recorded = event.record_on(stream);
            if let Some(p) = lock(&self.inner.pending).iter_mut().find(|p| p.id == id) {
                p.recording = false;
                p.later += recorded.is_ok() as usize;
            }
            return recorded;
        }
        let event = self.event()?;
        event.record_on(stream)?;
        lock(&self.inner.pending).push_back(Pending {
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            event: Arc::new(event),
            recording: false,
            stream,
            since: Instant::now(),
            what,
            later: 0,
        });
        Ok(())
    }

    /// Waits (bounded) for the work on `stream` so far, on a reused event.
    pub fn wait_stream(&self, stream: Stream, deadline: Instant, what: &str) -> Result<()> {
        let event = self.event()?;
        event.record_on(stream)?;
        let waited = event.wait(deadline, what);
        if waited.is_ok() {
            self.inner.recycle(event);
        }
        waited
    }

    fn event(&self) -> Result<Event> {
        match lock(&self.inner.spare).pop() {
            Some(e) => Ok(e),
            None => Event::new(),
        }
    }

    pub fn failure(&self) -> Option<Error> {
        lock(&self.inner.failed).clone()
    }

    /// `rdist_comm_abort`: aborts NCCL's side now.
    pub fn abort(&self) {
        let e = Error::new(
            ErrorKind::Aborted,
            format!("rdist_comm_abort was called on rank {}", self.inner.rank),
        );
        self.inner.fail(e, false);
    }

    /// Fails the communicator with `e` found by a call (a wait that timed
    /// out, an error in a group): aborts NCCL. The caller holds the
    /// communicator's engine and tells the peers itself.
    pub fn fail(&self, e: Error) {
        self.inner.fail(e, false);
    }

    /// Stops the thread; returns whether the communicator failed (then
    /// it was aborted and must not be finalized).
    pub fn stop(&mut self) -> bool {
        self.inner.stopping.store(true, Ordering::Release);
        self.inner.changed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        lock(&self.inner.pending).clear();
        lock(&self.inner.spare).clear();
        self.failure().is_some()
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Inner {
    fn run(&self, context: usize) {
        // Events and the communicator belong to this context.
        let _ctx = ContextGuard::push(context);
        while !self.stopping.load(Ordering::Acquire) {
            if lock(&self.failed).is_some() {
                return; // aborted: nothing left to watch
            }
            if let Some(e) = self.check() {
                self.fail(e, true);
                return;
            }
            let pending = lock(&self.pending);
            let _ = self.changed.wait_timeout(pending, PERIOD);
        }
    }

    /// An error if NCCL reported one or the oldest work is overdue.
    fn check(&self) -> Option<Error> {
        // Skipped while a thread is issuing work (it polls NCCL itself,
        // and an enqueue stuck in NCCL still shows as overdue work below).
        if let Some(Err(e)) = self.raw.try_async_state() {
            return Some(e.context(format!("rank {}", self.rank)));
        }
        let mut pending = lock(&self.pending);
        while let Some(p) = pending.front() {
            let done = match p.recording {
                true => Ok(false),
                false => p.event.done(),
            };
            match done {
                Ok(true) => {
                    if let Some(p) = pending.pop_front() {
                        if let Ok(event) = Arc::try_unwrap(p.event) {
                            self.recycle(event);
                        }
                    }
                }
                Ok(false)
                    if p.since.elapsed() > PROBE_AFTER && p.since.elapsed() <= self.timeout =>
                {
                    let gone = lock(&self.probe).as_ref().and_then(|probe| probe());
                    if let Some(peer) = gone {
                        return Some(Error::new(
                            ErrorKind::PeerLost,
                            format!(
                                "rank {}: rank {peer}'s connection closed while {} was in flight on the GPU ({:.1} s); the NCCL communicator was aborted",
                                self.rank,
                                p.describe(),
                                p.since.elapsed().as_secs_f64()
                            ),
                        ));
                    }
                    break;
                }
                Ok(false) if p.since.elapsed() > self.timeout => {
                    return Some(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "rank {}: {} enqueued {:.1} s ago has not finished on the GPU (timeout {:.1} s; a peer may have died, not made the same call, or run it on the sockets because its buffers were host memory); the NCCL communicator was aborted",
                            self.rank,
                            p.describe(),
                            p.since.elapsed().as_secs_f64(),
                            self.timeout.as_secs_f64()
                        ),
                    ));
                }
                Ok(false) => break,
                Err(e) => return Some(e),
            }
        }
        None
    }

    /// Keeps a finished event for reuse.
    fn recycle(&self, event: Event) {
        let mut spare = lock(&self.spare);
        if spare.len() < 64 {
            spare.push(event);
        }
    }

    /// Records the first failure, aborts NCCL and (for failures found
    /// here) tells the peers.
    fn fail(&self, e: Error, tell: bool) {
        {
            let mut failed = lock(&self.failed);
            if failed.is_some() {
                return;
            }
            *failed = Some(e.clone());
        }
        self.raw.abort();
        lock(&self.pending).clear();
        crate::log::emit(
            crate::options::LogLevel::Warn,
            Some(self.rank),
            &format!("NCCL failed: {}", e.message()),
        );
        if tell {
            if let Some(f) = lock(&self.on_failure).as_ref() {
                f(&e, &self.stopping);
            }
        }
    }
}
