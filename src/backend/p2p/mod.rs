//! Point-to-point messages in their own context, as in MPI: matched by
//! source, tag and order, apart from the collectives (which keep the mesh),
//! and moving as soon as they are posted.
//!
//! Each ordered pair of ranks that exchanges messages gets its own TCP
//! connection, dialed by the sender on first use (a receive from a rank
//! dials it too, so that its death is noticed). Messages up to
//! `EAGER_MAX` travel at once and wait at the receiver for their receive;
//! larger ones send their envelope first and their payload when the
//! receiver answers (so memory stays bounded). A progress thread, started
//! on the first message, does every read and write; callers post and wait.

mod matching;
pub mod wire;

use crate::call::RawBuf;
use crate::dtype::DType;
use crate::error::{describe_io, Error, ErrorKind, Result};
use crate::sync::lock;
use crate::transport::channel::read_remote;
use crate::transport::channel::{Channel, TcpChannel};
use crate::transport::greeting::{self, Greeted, Greeting, HELLO_DEADLINE};
use crate::transport::link::Links;
use crate::transport::mesh::{self, Context, MeshSpec};
use crate::transport::signal::AbortSignal;
use matching::{Arrival, Envelope, Matching, PostedRecv};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use wire::{Header, Kind, EAGER_MAX, FAILURE_MAX, HEADER_BYTES, REMOTE_BYTES, REMOTE_MIN};

/// Who sent a received message, with which tag, and how many elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    pub source: usize,
    pub tag: i32,
    pub count: usize,
}

/// Where a message's result appears.
#[derive(Default)]
pub struct Done {
    result: Mutex<Option<Result<Status>>>,
    ready: Condvar,
}

impl Done {
    fn complete(&self, r: Result<Status>) {
        let mut slot = lock(&self.result);
        if slot.is_none() {
            *slot = Some(r);
        }
        drop(slot);
        self.ready.notify_all();
    }

    fn get(&self) -> Option<Result<Status>> {
        lock(&self.result).clone()
    }
}

/// A posted send or receive.
pub struct Ticket {
    id: u64,
    done: Arc<Done>,
    /// The rank it talks to (None: any), whose connections a waiting
    /// caller services itself.
    peer: Option<usize>,
    /// What it is, for messages (formatted only when one is needed).
    call: Described,
}

/// A send or receive as its errors name it.
#[derive(Clone, Copy, Debug)]
enum Described {
    Send(Outgoing),
    Recv(Incoming),
}

impl std::fmt::Display for Described {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Described::Send(m) => write!(
                f,
                "send to rank {} (tag {}, {} x {})",
                m.peer, m.tag, m.count, m.dtype
            ),
            Described::Recv(r) => {
                match r.peer {
                    Some(p) => write!(f, "recv from rank {p}")?,
                    None => write!(f, "recv from any rank")?,
                }
                match r.tag {
                    Some(t) => write!(f, " (tag {t}, ")?,
                    None => write!(f, " (any tag, ")?,
                }
                if r.exact {
                    write!(f, "{} x {})", r.count, r.dtype)
                } else {
                    write!(f, "up to {} x {})", r.count, r.dtype)
                }
            }
        }
    }
}

/// A message to send.
#[derive(Clone, Copy, Debug)]
pub struct Outgoing {
    pub buf: RawBuf,
    pub dtype: DType,
    pub count: usize,
    pub peer: usize,
    pub tag: i32,
}

/// A receive to post.
#[derive(Clone, Copy, Debug)]
pub struct Incoming {
    pub buf: RawBuf,
    pub dtype: DType,
    /// Elements `buf` holds.
    pub count: usize,
    /// None: any source.
    pub peer: Option<usize>,
    /// None: any tag.
    pub tag: Option<i32>,
    /// The message must have exactly `count` elements (rdist_recv).
    pub exact: bool,
}

/// What a mailbox is made from (see `SocketBackend::take_p2p`).
pub(crate) struct MailboxSpec {
    pub mesh: MeshSpec,
    pub listener: TcpListener,
    /// Where the collectives' connections that peers dial are admitted
    /// (this thread serves the listener for both contexts).
    pub links: Arc<Links>,
    pub timeout: Duration,
    /// How long a waiting caller drives progress itself before sleeping.
    pub spin: Duration,
    pub signal: Arc<AbortSignal>,
}

/// One communicator's point-to-point context.
pub(crate) struct Mailbox {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    rank: usize,
    mesh: MeshSpec,
    /// Where greeted collectives connections go (see transport::link).
    links: Arc<Links>,
    timeout: Duration,
    spin: Duration,
    signal: Arc<AbortSignal>,
    /// Wakes the progress thread (eventfd).
    wake: AbortSignal,
    /// Callers driving progress in their waits right now: the progress
    /// thread stays out of their way (two cores, four busy threads).
    drivers: std::sync::atomic::AtomicUsize,
    /// Bytes moved on any connection, so a driving caller sees progress.
    moved: std::sync::atomic::AtomicU64,
    /// Run on every pass of the progress thread (the flight recorder's
    /// publisher); it limits itself.
    hook: Mutex<Option<Box<dyn FnMut() + Send>>>,
    /// The first failure a peer reported here (its communicator failed or
    /// was aborted): the collectives fail with it too (see
    /// `Mailbox::reported_failure`).
    reported: std::sync::OnceLock<Error>,
    state: Mutex<State>,
}

struct State {
    listener: Option<TcpListener>,
    /// Accepted connections that have not said hello yet.
    greeting: Vec<Greeting>,
    /// Greeted collectives connections, admitted outside the lock.
    admitting: Vec<([u8; mesh::HELLO_BYTES], TcpStream)>,
    peers: Peers,
    matching: Matching,
    next_id: u64,
    /// Set once the communicator failed or was aborted: every call fails so.
    failed: Option<Error>,
    closing: bool,
    /// Sends to self, copied, waiting for their receive, are in `matching`.
    self_seq: u64,
}

/// Every peer's state, made when the pair is first used: a rank of a wide
/// job talks to a few peers, and a state for each of 1024 (648 bytes
/// apiece) was 0.6 MiB to fault in and zero per rank at init.
struct Peers {
    slots: Vec<Option<Box<Peer>>>,
    /// What a peer not used yet reads as.
    unused: Peer,
}

impl Peers {
    fn new(size: usize) -> Peers {
        Peers {
            slots: (0..size).map(|_| None).collect(),
            unused: Peer::default(),
        }
    }

    /// The peers used so far.
    fn used(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|p| self.slots[*p].is_some())
            .collect()
    }

    fn iter(&self) -> impl Iterator<Item = (usize, &Peer)> {
        (self.slots.iter().enumerate()).filter_map(|(i, p)| Some((i, p.as_deref()?)))
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut Peer)> {
        (self.slots.iter_mut().enumerate()).filter_map(|(i, p)| Some((i, p.as_deref_mut()?)))
    }
}

impl std::ops::Index<usize> for Peers {
    type Output = Peer;

    fn index(&self, peer: usize) -> &Peer {
        self.slots[peer].as_deref().unwrap_or(&self.unused)
    }
}

impl std::ops::IndexMut<usize> for Peers {
    fn index_mut(&mut self, peer: usize) -> &mut Peer {
        self.slots[peer].get_or_insert_with(Box::default)
    }
}

#[derive(Default)]
struct Peer {
    /// Dialed by this rank: carries its messages; Cts comes back on it.
    out: Option<Conn>,
    dialing: bool,
    /// Dialed by the peer: carries its messages; Cts goes back on it.
    inc: Option<Conn>,
    /// Sends not framed yet (waiting for `out`).
    queued: VecDeque<SendOp>,
    /// Sends whose envelope went out, waiting for Cts, by seq.
    awaiting_cts: HashMap<u64, SendOp>,
    /// Receives matched to an envelope, waiting for its payload, by seq.
    receiving: HashMap<u64, Target>,
    next_out_seq: u64,
    next_in_seq: u64,
    /// Payloads from this size go single-copy (the peer reads them from
    /// here); None: never.
    single_copy: Option<usize>,
    /// Why this rank can no longer send to the peer (its connection to
    /// it closed); the peer's messages already sent may still arrive.
    out_gone: Option<Error>,
    /// Why this pair can no longer talk.
    gone: Option<Error>,
}

struct SendOp {
    id: u64,
    msg: Outgoing,
    done: Arc<Done>,
}

/// Where a message's payload goes.
enum Target {
    Recv(PostedRecv, Status),
    /// Nowhere: its receive failed or gave up.
    Discard,
}

struct Conn {
    chan: Box<dyn Channel>,
    out: VecDeque<Frame>,
    /// Bytes of `out.front()` written.
    written: usize,
    head: [u8; HEADER_BYTES],
    head_len: usize,
    reading: Reading,
}

enum Reading {
    Header,
    Eager {
        env: Envelope,
        buf: Vec<u8>,
        got: usize,
    },
    /// A peer's failure report.
    Failure {
        buf: Vec<u8>,
        got: usize,
    },
    /// Where a same-host message lies in its sender: [pid, address].
    Remote {
        env: Envelope,
        at: [u8; REMOTE_BYTES],
        got: usize,
    },
    /// A payload going to `target` (a matched receive, or nowhere).
    Data {
        target: Target,
        len: usize,
        got: usize,
    },
}

struct Frame {
    /// The header, and for Remote its [pid, address].
    head: [u8; HEADER_BYTES + REMOTE_BYTES],
    head_len: usize,
    payload: RawBuf,
    /// Completed when the frame is written.
    done: Option<(u64, Arc<Done>, Status)>,
}

/// Stop reading new messages while this much is buffered unmatched.
const UNEXPECTED_LIMIT: usize = 256 << 20;

impl Frame {
    fn new(
        h: Header,
        extra: &[u8],
        payload: RawBuf,
        done: Option<(u64, Arc<Done>, Status)>,
    ) -> Frame {
        let mut head = [0u8; HEADER_BYTES + REMOTE_BYTES];
        head[..HEADER_BYTES].copy_from_slice(&h.encode());
        head[HEADER_BYTES..HEADER_BYTES + extra.len()].copy_from_slice(extra);
        Frame {
            head,
            head_len: HEADER_BYTES + extra.len(),
            payload,
            done,
        }
    }
}

impl Conn {
    fn new(stream: TcpStream) -> io::Result<Conn> {
        stream.set_nonblocking(true)?;
        Ok(Conn::over(Box::new(TcpChannel(stream))))
    }

    fn over(chan: Box<dyn Channel>) -> Conn {
        Conn {
            chan,
            out: VecDeque::new(),
            written: 0,
            head: [0; HEADER_BYTES],
            head_len: 0,
            reading: Reading::Header,
        }
    }
}

impl Shared {
    /// Wakes the progress thread (posts, closing).
    fn nudge(&self) {
        self.wake.abort();
    }
}

impl Mailbox {
    pub(crate) fn new(spec: MailboxSpec) -> Result<Arc<Mailbox>> {
        let size = spec.mesh.size;
        let peers = Peers::new(size);
        spec.listener
            .set_nonblocking(true)
            .map_err(|e| Error::system("set_nonblocking", &e))?;
        let mailbox = Arc::new(Mailbox {
            shared: Arc::new(Shared {
                rank: spec.mesh.rank,
                mesh: spec.mesh,
                links: spec.links,
                timeout: spec.timeout,
                spin: spec.spin,
                signal: spec.signal,
                wake: AbortSignal::new().map_err(|e| Error::system("eventfd", &e))?,
                drivers: Default::default(),
                moved: Default::default(),
                hook: Mutex::new(None),
                reported: std::sync::OnceLock::new(),
                state: Mutex::new(State {
                    listener: Some(spec.listener),
                    greeting: Vec::new(),
                    admitting: Vec::new(),
                    peers,
                    matching: Matching::default(),
                    next_id: 0,
                    failed: None,
                    closing: false,
                    self_seq: 0,
                }),
            }),
            thread: Mutex::new(None),
        });
        // Always running, even before the first send or receive: it keeps
        // the listener served, so strangers that connect are greeted and
        // dropped at their deadline rather than filling the accept backlog
        // a peer's first point-to-point connection needs.
        mailbox.ensure_thread()?;
        Ok(mailbox)
    }

    fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Has the progress thread run `hook` on every pass (at least every
    /// `IDLE_WAKE_MS`).
    pub(crate) fn set_hook(&self, hook: Box<dyn FnMut() + Send>) {
        *lock(&self.shared.hook) = Some(hook);
    }

    /// Posts a send; it starts at once.
    ///
    /// # Safety
    /// `msg.buf` valid for reads until the ticket completes.
    pub(crate) unsafe fn send(&self, msg: Outgoing) -> Result<Ticket> {
        if msg.tag < 0 {
            return Err(Error::invalid_argument(format!(
                "tag {} is negative (tags are 0..{})",
                msg.tag,
                i32::MAX
            )));
        }
        self.ensure_thread()?;
        let done = Arc::new(Done::default());
        let mut st = lock(&self.shared.state);
        st.usable()?;
        let id = st.new_id();
        if msg.peer == self.rank() {
            // To self: copied now, so it never waits for its receive.
            let seq = st.self_seq;
            st.self_seq += 1;
            let payload = msg.buf.bytes().to_vec();
            let arrival = Arrival {
                env: Envelope {
                    source: msg.peer,
                    tag: msg.tag,
                    seq,
                    dtype: msg.dtype,
                    count: msg.count as u64,
                },
                payload: Some(payload),
            };
            if let Some((r, a)) = st.matching.arrive(arrival) {
                st.deliver(r, a, self.rank());
            }
            done.complete(Ok(Status {
                source: self.rank(),
                tag: msg.tag,
                count: msg.count,
            }));
            return Ok(Ticket {
                id,
                done,
                peer: None,
                call: Described::Send(msg),
            });
        }
        if let Some(e) = st.peers[msg.peer]
            .gone
            .as_ref()
            .or(st.peers[msg.peer].out_gone.as_ref())
        {
            return Err(e.clone());
        }
        st.peers[msg.peer].queued.push_back(SendOp {
            id,
            msg,
            done: done.clone(),
        });
        let dial = st.needs_dial(msg.peer);
        if !dial && st.peers[msg.peer].out.is_some() {
            // The fast path: the caller writes what it can now (a small
            // message usually whole), without waking the progress thread.
            st.frame_sends();
            if let Err(e) = write_some(&self.shared, &mut st, msg.peer, true) {
                st.out_lost(&self.shared, msg.peer, e);
            }
            let idle = st.peers[msg.peer]
                .out
                .as_ref()
                .is_none_or(|c| c.out.is_empty());
            drop(st);
            if !idle {
                self.shared.nudge();
            }
            return Ok(Ticket {
                id,
                done,
                peer: Some(msg.peer),
                call: Described::Send(msg),
            });
        }
        drop(st);
        if dial {
            self.dial(msg.peer);
        }
        self.shared.nudge();
        Ok(Ticket {
            id,
            done,
            peer: Some(msg.peer),
            call: Described::Send(msg),
        })
    }

    /// Posts a receive; it matches at once if its message already arrived.
    ///
    /// # Safety
    /// `r.buf` valid for writes, and untouched, until the ticket completes.
    pub(crate) unsafe fn recv(&self, r: Incoming) -> Result<Ticket> {
        if let Some(t) = r.tag.filter(|t| *t < 0) {
            return Err(Error::invalid_argument(format!(
                "tag {t} is negative (tags are 0..{}, or RDIST_ANY_TAG)",
                i32::MAX
            )));
        }
        self.ensure_thread()?;
        let done = Arc::new(Done::default());
        let mut st = lock(&self.shared.state);
        st.usable()?;
        let id = st.new_id();
        let posted = PostedRecv {
            id,
            source: r.peer,
            tag: r.tag,
            buf: r.buf,
            dtype: r.dtype,
            capacity: r.count,
            exact: r.exact,
            done: done.clone(),
        };
        match st.matching.post(posted) {
            Some((r, a)) => st.deliver(r, a, self.rank()),
            None => {
                // Nothing buffered from a rank that is gone: nothing will come.
                let gone = r.peer.and_then(|p| {
                    let q = &st.peers[p];
                    q.gone
                        .clone()
                        .or_else(|| q.out_gone.clone().filter(|_| q.inc.is_none()))
                });
                if let Some(e) = gone {
                    st.matching.cancel(id);
                    return Err(e);
                }
            }
        }
        // A receive from a rank watches that rank through its own
        // connection to it, so that its death is noticed.
        let dial = r.peer.is_some_and(|p| p != self.rank() && st.needs_dial(p));
        drop(st);
        if dial {
            self.dial(r.peer.expect("some"));
            self.shared.nudge();
        }
        Ok(Ticket {
            id,
            done,
            peer: r.peer,
            call: Described::Recv(r),
        })
    }

    /// One round of progress by a waiting caller: nonblocking reads and
    /// writes on the connections with `peer` (every peer for None).
    fn drive(&self, peer: Option<usize>) {
        let mut st = lock(&self.shared.state);
        let peers = match peer {
            Some(p) if p != self.rank() => vec![p],
            Some(_) => return,
            None => st.peers.used(),
        };
        for p in peers {
            for out in [true, false] {
                let r = write_some(&self.shared, &mut st, p, out)
                    .and_then(|_| read_some(&self.shared, &mut st, p, out));
                if let Err(e) = r {
                    if out {
                        st.out_lost(&self.shared, p, e);
                    } else {
                        st.fail_peer(p, e);
                    }
                }
            }
        }
        st.frame_sends();
    }

    /// Dials `peer` (outside the lock) and installs the connection, or
    /// marks the pair gone.
    fn dial(&self, peer: usize) {
        let sh = &self.shared;
        let addr = sh.mesh.addrs[peer];
        // One attempt: after init every rank listens, so a refusal means
        // the rank is gone (its communicator destroyed, or it died).
        let limit = sh.timeout.min(Duration::from_secs(10));
        let hello = mesh::hello_for(&sh.mesh, Context::P2p);
        let made = TcpStream::connect_timeout(&addr, limit).and_then(|mut s| {
            sh.mesh.configure(&s, peer);
            let deadline = Instant::now() + limit;
            greeting::introduce(&mut s, &hello, sh.mesh.token.as_ref(), deadline).map_err(|e| {
                match e {
                    greeting::Refusal::Io(e) => e,
                    greeting::Refusal::Auth(why) => {
                        std::io::Error::new(std::io::ErrorKind::PermissionDenied, why)
                    }
                }
            })?;
            Conn::new(s)
        });
        let mut st = lock(&sh.state);
        let p = &mut st.peers[peer];
        p.dialing = false;
        match made {
            Ok(c) => p.out = Some(c),
            Err(e) => {
                let err = Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "rank {} cannot reach rank {peer} at {addr} for point-to-point: {}",
                        sh.rank,
                        describe_io(&e)
                    ),
                );
                st.out_lost(sh, peer, err);
            }
        }
    }

    fn ensure_thread(&self) -> Result<()> {
        let mut t = lock(&self.thread);
        if t.is_none() {
            let shared = self.shared.clone();
            *t = Some(
                std::thread::Builder::new()
                    .name(format!("rdist-p2p{}", self.rank()))
                    .spawn(move || progress(&shared))
                    .map_err(|e| Error::system("starting the point-to-point thread", &e))?,
            );
        }
        Ok(())
    }

    /// Waits for a ticket, bounded by the timeout; on timeout the call is
    /// withdrawn (its buffer is no longer touched) and the error names it
    /// and whatever else is pending here.
    pub(crate) fn wait(&self, t: &Ticket) -> Result<Status> {
        let deadline = Instant::now() + self.shared.timeout;
        // Drive progress here first, as MPI does in its waits: no thread
        // hand-off on the way in or out for a message that comes soon.
        // While bytes keep moving (a large message), keep driving.
        use std::sync::atomic::Ordering::Relaxed;
        self.shared.drivers.fetch_add(1, Relaxed);
        let mut spin_until = Instant::now() + self.shared.spin;
        let mut seen = self.shared.moved.load(Relaxed);
        while t.done.get().is_none() && Instant::now() < spin_until {
            self.drive(t.peer);
            let now = self.shared.moved.load(Relaxed);
            if now != seen {
                seen = now;
                spin_until = Instant::now() + self.shared.spin;
            }
            std::hint::spin_loop();
        }
        self.shared.drivers.fetch_sub(1, Relaxed);
        let mut r = lock(&t.done.result);
        loop {
            if let Some(res) = r.as_ref() {
                return res.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            r = crate::sync::wait_for(&t.done.ready, r, left);
        }
        drop(r);
        let mut st = lock(&self.shared.state);
        if let Some(res) = t.done.get() {
            return res; // completed just now
        }
        st.withdraw(t.id);
        let others: Vec<String> = st.pending().into_iter().take(8).collect();
        let err = Error::new(
            ErrorKind::Timeout,
            format!(
                "rank {}: {} did not complete within {:.1} s{}",
                self.rank(),
                t.call,
                self.shared.timeout.as_secs_f64(),
                if others.is_empty() {
                    String::new()
                } else {
                    format!("; also pending on this rank: {}", others.join("; "))
                }
            ),
        );
        t.done.complete(Err(err.clone()));
        Err(err)
    }

    /// The ticket's result once complete; never blocks.
    pub(crate) fn test(&self, t: &Ticket) -> Option<Result<Status>> {
        t.done.get()
    }

    /// The point-to-point calls pending on this rank, described.
    pub(crate) fn pending(&self) -> Vec<String> {
        lock(&self.shared.state).pending()
    }

    /// The failure a peer reported over point-to-point, if any. Since
    /// pairs connect on first use, that report may be the only one this
    /// rank gets: the collectives must fail with it rather than dial a
    /// peer that has gone.
    pub(crate) fn reported_failure(&self) -> Option<Error> {
        self.shared.reported.get().cloned()
    }

    /// Fails every pending and future call with `err`.
    pub(crate) fn fail(&self, err: Error) {
        lock(&self.shared.state).fail_all(err);
        self.shared.nudge();
    }

    /// Local: lets posted sends finish (bounded by the timeout), then fails
    /// what is left, closes every connection and joins the thread.
    pub(crate) fn close(&self) {
        let deadline = Instant::now() + self.shared.timeout;
        {
            let mut st = lock(&self.shared.state);
            st.closing = true;
        }
        self.shared.nudge();
        let thread = lock(&self.thread).take();
        if let Some(h) = thread {
            // The thread ends once no send is in flight, or at the deadline.
            while !h.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if !h.is_finished() {
                self.fail(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "rank {}: the communicator was destroyed while sends were still waiting for their receives",
                        self.rank()
                    ),
                ));
            }
            let _ = h.join();
        }
        let mut st = lock(&self.shared.state);
        st.fail_all(Error::invalid_usage("the communicator was destroyed"));
        st.listener = None;
        for (_, p) in st.peers.iter_mut() {
            p.out = None;
            p.inc = None;
        }
    }
}

/// Where a message's payload goes: its receive when it fits there;
/// nowhere when it does not (the receive then fails, naming both sides).
fn fit(r: PostedRecv, env: &Envelope, me: usize) -> Target {
    let status = Status {
        source: env.source,
        tag: env.tag,
        count: env.count as usize,
    };
    let misfit = if env.dtype != r.dtype {
        Some(format!(
            "it holds {}, the receive takes {}",
            env.dtype, r.dtype
        ))
    } else if env.count as usize > r.capacity || (r.exact && env.count as usize != r.capacity) {
        Some(format!(
            "it has {} elements, the receive {} {}",
            env.count,
            if r.exact { "expects" } else { "has room for" },
            r.capacity
        ))
    } else {
        None
    };
    match misfit {
        Some(why) => {
            r.done.complete(Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "rank {me}: the message from rank {} (tag {}, {} x {}) does not match its receive: {why}",
                    env.source, env.tag, env.count, env.dtype
                ),
            )));
            Target::Discard
        }
        None => Target::Recv(r, status),
    }
}

impl State {
    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn usable(&self) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.closing {
            return Err(Error::invalid_usage("the communicator is being destroyed"));
        }
        Ok(())
    }

    /// Whether the caller should dial `peer` now (and marks it dialing).
    fn needs_dial(&mut self, peer: usize) -> bool {
        let p = &mut self.peers[peer];
        if p.out.is_some() || p.dialing || p.gone.is_some() || p.out_gone.is_some() {
            return false;
        }
        p.dialing = true;
        true
    }

    /// A receive met its message: copy an eager payload, or ask for the
    /// rest; a message that does not fit fails the receive (and is
    /// consumed all the same).
    fn deliver(&mut self, r: PostedRecv, a: Arrival, me: usize) {
        let env = a.env;
        let target = fit(r, &env, me);
        match (a.payload, target) {
            (Some(bytes), Target::Recv(r, status)) => {
                // SAFETY: the receive's buffer is valid until it completes,
                // and holds at least the message (checked above).
                unsafe { r.buf.bytes_mut()[..bytes.len()].copy_from_slice(&bytes) };
                r.done.complete(Ok(status));
            }
            (Some(_), Target::Discard) => {}
            (None, target) => {
                let p = &mut self.peers[env.source];
                p.receiving.insert(env.seq, target);
                if let Some(inc) = p.inc.as_mut() {
                    inc.out
                        .push_back(Frame::new(Header::cts(env.seq), &[], RawBuf::EMPTY, None));
                }
            }
        }
    }

    /// Makes a call that gave up never touch its buffer again.
    fn withdraw(&mut self, id: u64) {
        if let Some(r) = self.matching.cancel(id) {
            drop(r);
            return;
        }
        for peer in self.peers.used() {
            let p = &mut self.peers[peer];
            if let Some(i) = p.queued.iter().position(|s| s.id == id) {
                p.queued.remove(i);
                return;
            }
            for t in p.receiving.values_mut() {
                if matches!(t, Target::Recv(r, _) if r.id == id) {
                    *t = Target::Discard;
                    return;
                }
            }
            if let Some(inc) = p.inc.as_mut() {
                if let Reading::Data { target, .. } = &mut inc.reading {
                    if matches!(target, Target::Recv(r, _) if r.id == id) {
                        *target = Target::Discard;
                        return;
                    }
                }
            }
            // A send already on the wire: the pair cannot go on without it.
            let on_wire = p.awaiting_cts.values().any(|s| s.id == id)
                || p.out.as_ref().is_some_and(|c| {
                    c.out
                        .iter()
                        .any(|f| f.done.as_ref().is_some_and(|d| d.0 == id))
                });
            if on_wire {
                let err = Error::new(
                    ErrorKind::Timeout,
                    format!("an earlier send to rank {peer} timed out while under way, which broke this pair's connection"),
                );
                self.fail_peer(peer, err);
                return;
            }
        }
    }

    /// This rank's connection to `peer` failed: sends to it fail. Its
    /// messages already sent to this rank may still be in flight (on the
    /// connection it dialed, perhaps not even accepted yet: a rank that
    /// sends and then exits), so receives from it fail only once that
    /// connection ends, or now if there is none.
    fn out_lost(&mut self, sh: &Shared, peer: usize, err: Error) {
        let p = &mut self.peers[peer];
        p.out = None;
        if p.out_gone.is_none() {
            p.out_gone = Some(err.clone());
        }
        for s in p.queued.drain(..) {
            s.done.complete(Err(err.clone()));
        }
        for (_, s) in p.awaiting_cts.drain() {
            s.done.complete(Err(err.clone()));
        }
        accept_and_greet(sh, self);
        if self.peers[peer].inc.is_none() {
            self.fail_peer(peer, err);
        }
    }

    /// Every call with `peer` fails with `err`; the pair's connections close.
    fn fail_peer(&mut self, peer: usize, err: Error) {
        let p = &mut self.peers[peer];
        if p.gone.is_none() {
            p.gone = Some(err.clone());
        }
        p.out = None;
        p.inc = None;
        for s in p.queued.drain(..) {
            s.done.complete(Err(err.clone()));
        }
        for (_, s) in p.awaiting_cts.drain() {
            s.done.complete(Err(err.clone()));
        }
        for (_, t) in p.receiving.drain() {
            if let Target::Recv(r, _) = t {
                r.done.complete(Err(err.clone()));
            }
        }
        let mut keep = VecDeque::new();
        for r in self.matching.posted.drain(..) {
            if r.source == Some(peer) {
                r.done.complete(Err(err.clone()));
            } else {
                keep.push_back(r);
            }
        }
        self.matching.posted = keep;
    }

    /// Best effort, never blocking: a Failure frame on every connection
    /// that is between frames, so the peers learn why rather than only
    /// that the line went dead.
    fn tell_peers(&mut self, kind: ErrorKind, report: &str) {
        let mut payload = vec![kind.code() as u8];
        payload.extend_from_slice(report.as_bytes());
        payload.truncate(FAILURE_MAX);
        let head = Header::failure(payload.len()).encode();
        for (_, p) in self.peers.iter_mut() {
            for c in [p.out.as_mut(), p.inc.as_mut()].into_iter().flatten() {
                if c.written == 0 {
                    let _ = c.chan.write2(&head, &payload);
                }
            }
        }
    }

    fn fail_all(&mut self, err: Error) {
        if self.failed.is_none() {
            self.failed = Some(err.clone());
        }
        // Peers never used have nothing to fail; `failed` refuses them.
        for peer in self.peers.used() {
            self.fail_peer(peer, err.clone());
        }
        for r in self.matching.posted.drain(..) {
            r.done.complete(Err(err.clone()));
        }
    }

    fn pending(&self) -> Vec<String> {
        let mut v = Vec::new();
        for r in &self.matching.posted {
            v.push(format!(
                "recv from {} ({}, up to {} x {}): no message yet",
                r.source
                    .map_or("any rank".to_string(), |s| format!("rank {s}")),
                r.tag.map_or("any tag".to_string(), |t| format!("tag {t}")),
                r.capacity,
                r.dtype
            ));
        }
        for (peer, p) in self.peers.iter() {
            for s in p.queued.iter().chain(p.awaiting_cts.values()) {
                v.push(format!(
                    "send to rank {peer} (tag {}, {} x {}): not received yet",
                    s.msg.tag, s.msg.count, s.msg.dtype
                ));
            }
            let receiving = p
                .receiving
                .values()
                .filter(|t| matches!(t, Target::Recv(..)))
                .count();
            if receiving > 0 {
                v.push(format!(
                    "{receiving} receive(s) from rank {peer}: matched, payload still arriving"
                ));
            }
        }
        v
    }

    /// Whether anything this rank sent is still in flight.
    fn sends_in_flight(&self) -> bool {
        self.peers.iter().any(|(_, p)| {
            !p.queued.is_empty()
                || !p.awaiting_cts.is_empty()
                || p.out.as_ref().is_some_and(|c| !c.out.is_empty())
                || p.inc.as_ref().is_some_and(|c| !c.out.is_empty())
        })
    }

    /// Turns queued sends into frames on their connection.
    fn frame_sends(&mut self) {
        for (_, p) in self.peers.iter_mut() {
            let Some(out) = p.out.as_mut() else { continue };
            while let Some(s) = p.queued.pop_front() {
                let seq = p.next_out_seq;
                p.next_out_seq += 1;
                let bytes = s.msg.buf.len();
                // Same host: large payloads are read by the receiver
                // straight from here (one copy, no socket).
                let remote = p
                    .single_copy
                    .is_some_and(|min| (min.max(REMOTE_MIN)..=EAGER_MAX).contains(&bytes));
                let eager = bytes <= EAGER_MAX && !remote;
                let (kind, payload) = if remote {
                    (Kind::Remote, REMOTE_BYTES as u64)
                } else if eager {
                    (Kind::Eager, bytes as u64)
                } else {
                    (Kind::Rts, 0)
                };
                let head = Header {
                    kind,
                    dtype: s.msg.dtype,
                    tag: s.msg.tag,
                    seq,
                    count: s.msg.count as u64,
                    payload,
                };
                if eager {
                    let status = Status {
                        source: s.msg.peer,
                        tag: s.msg.tag,
                        count: s.msg.count,
                    };
                    let done = Some((s.id, s.done, status));
                    out.out.push_back(Frame::new(head, &[], s.msg.buf, done));
                } else {
                    let mut extra = [0u8; REMOTE_BYTES];
                    extra[..8].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
                    extra[8..].copy_from_slice(&(s.msg.buf.addr() as u64).to_le_bytes());
                    let extra = if remote { &extra[..] } else { &[][..] };
                    out.out
                        .push_back(Frame::new(head, extra, RawBuf::EMPTY, None));
                    p.awaiting_cts.insert(seq, s);
                }
            }
        }
    }
}

/// The progress thread: every read and write of the point-to-point
/// connections, until the communicator closes.
fn progress(sh: &Shared) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    // What each pollfd is: 0 wake, 1 abort, 2 listener, then connections.
    #[derive(Clone, Copy)]
    enum Slot {
        Wake,
        Abort,
        Listener,
        Greeting,
        Out(usize),
        Inc(usize),
    }
    let mut slots: Vec<Slot> = Vec::new();
    loop {
        if let Some(hook) = lock(&sh.hook).as_mut() {
            hook();
        }
        {
            let mut st = lock(&sh.state);
            st.frame_sends();
            if st.closing && (!st.sends_in_flight() || st.failed.is_some()) {
                return;
            }
            fds.clear();
            slots.clear();
            let mut add = |fd: i32, events: i16, slot: Slot| {
                fds.push(libc::pollfd {
                    fd,
                    events,
                    revents: 0,
                });
                slots.push(slot);
            };
            add(sh.wake.fd(), libc::POLLIN, Slot::Wake);
            add(sh.signal.fd(), libc::POLLIN, Slot::Abort);
            if let Some(l) = &st.listener {
                add(l.as_raw_fd(), libc::POLLIN, Slot::Listener);
            }
            for g in st.greeting.iter() {
                add(g.fd(), libc::POLLIN, Slot::Greeting);
            }
            let paused = st.matching.unexpected_bytes > UNEXPECTED_LIMIT;
            for (peer, p) in st.peers.iter() {
                if let Some(c) = &p.out {
                    let w = if c.out.is_empty() { 0 } else { libc::POLLOUT };
                    add(c.chan.fd(), libc::POLLIN | w, Slot::Out(peer));
                }
                if let Some(c) = &p.inc {
                    let w = if c.out.is_empty() { 0 } else { libc::POLLOUT };
                    let r = if paused && matches!(c.reading, Reading::Header) {
                        0
                    } else {
                        libc::POLLIN
                    };
                    add(c.chan.fd(), r | w, Slot::Inc(peer));
                }
            }
        }
        // Whatever needs this thread wakes it (data, a dialer, a post, an
        // abort); the timeout only paces the hook and the greetings'
        // deadlines. (At 100 ms, a thousand idle ranks of one host woke
        // ten thousand times a second.)
        // SAFETY: fds is a live array of pollfd.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, IDLE_WAKE_MS) };
        if n < 0 {
            continue; // EINTR
        }
        let driven = sh.drivers.load(std::sync::atomic::Ordering::Relaxed) > 0;
        if n > 0 && driven {
            // A waiting caller is moving the bytes; look again shortly.
            std::thread::sleep(Duration::from_micros(50));
            continue;
        }
        let mut st = lock(&sh.state);
        let mut greet_now = false;
        for (fd, slot) in fds.iter().zip(slots.iter().copied()) {
            if fd.revents == 0 {
                continue;
            }
            match slot {
                Slot::Wake => {
                    let mut b = [0u8; 8];
                    // SAFETY: reads 8 bytes into a live buffer from our eventfd.
                    unsafe { libc::read(sh.wake.fd(), b.as_mut_ptr().cast(), 8) };
                }
                Slot::Abort => {
                    if st.failed.is_none() {
                        st.tell_peers(
                            ErrorKind::Aborted,
                            &format!("rank {} aborted the communicator", sh.rank),
                        );
                        st.fail_all(Error::new(
                            ErrorKind::Aborted,
                            format!("the communicator was aborted (rank {})", sh.rank),
                        ));
                    }
                }
                Slot::Listener | Slot::Greeting => greet_now = true,
                Slot::Out(peer) => {
                    if let Err(e) = service(sh, &mut st, peer, true, fd.revents) {
                        st.out_lost(sh, peer, e);
                    }
                }
                Slot::Inc(peer) => {
                    if let Err(e) = service(sh, &mut st, peer, false, fd.revents) {
                        st.fail_peer(peer, e);
                    }
                }
            }
        }
        if greet_now {
            accept_and_greet(sh, &mut st);
        }
        // Connections that never said hello are dropped.
        let now = Instant::now();
        st.greeting.retain(|g| !g.expired(now, HELLO_DEADLINE));
        if st.failed.is_some() && st.closing {
            return;
        }
        let admitting = std::mem::take(&mut st.admitting);
        drop(st);
        for (hello, s) in admitting {
            sh.links.admit(&hello, s);
        }
    }
}

/// Accepts what waits on the listener and reads the hellos that arrived.
fn accept_and_greet(sh: &Shared, st: &mut State) {
    accept_all(st);
    let mut i = 0;
    while i < st.greeting.len() {
        match st.greeting[i].advance(sh.mesh.token.as_ref()) {
            Greeted::Pending => i += 1,
            Greeted::Dropped => drop(st.greeting.swap_remove(i)),
            Greeted::Ready => {
                let g = st.greeting.swap_remove(i);
                install(sh, st, g);
            }
        }
    }
}

/// How often the progress thread wakes with nothing to do.
const IDLE_WAKE_MS: libc::c_int = 250;

/// Most connections greeted at once (see transport/greeting.rs).
const MAX_GREETINGS: usize = 1024;

fn accept_all(st: &mut State) {
    let Some(l) = &st.listener else { return };
    loop {
        match l.accept() {
            Ok((s, _)) => {
                if st.greeting.len() >= MAX_GREETINGS {
                    // A flood: the oldest has had the longest to speak.
                    st.greeting.remove(0);
                }
                st.greeting.extend(Greeting::new(s));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return, // WouldBlock, or a transient accept error
        }
    }
}

/// Makes a greeted connection the incoming one of its pair, when it
/// belongs to this communicator and the pair has none.
fn install(sh: &Shared, st: &mut State, g: Greeting) {
    let (hello, s) = g.finish();
    if mesh::is_collectives(&hello) {
        st.admitting.push((hello, s));
        return;
    }
    let Some(rank) = mesh::judge_p2p(&sh.mesh, &hello) else {
        return; // a stranger, or another communicator: dropped
    };
    if st.failed.is_some() {
        return; // failed or aborted: the dialer hears it as a closed line
    }
    let p = &mut st.peers[rank];
    if p.inc.is_some() || p.gone.is_some() {
        return; // one connection per pair and direction
    }
    sh.mesh.configure(&s, rank);
    if let Ok(c) = Conn::new(s) {
        p.inc = Some(c);
    }
}

fn lost(sh: &Shared, peer: usize, why: &str) -> Error {
    Error::new(
        ErrorKind::PeerLost,
        format!(
            "rank {}: point-to-point with rank {peer} failed: {why}",
            sh.rank
        ),
    )
}

/// Reads and writes what one connection allows now.
fn service(sh: &Shared, st: &mut State, peer: usize, out: bool, revents: i16) -> Result<()> {
    if revents & libc::POLLOUT != 0 {
        write_some(sh, st, peer, out)?;
    }
    if revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
        read_some(sh, st, peer, out)?;
    }
    Ok(())
}

fn conn(st: &mut State, peer: usize, out: bool) -> Option<&mut Conn> {
    let p = &mut st.peers[peer];
    if out {
        p.out.as_mut()
    } else {
        p.inc.as_mut()
    }
}

fn write_some(sh: &Shared, st: &mut State, peer: usize, out: bool) -> Result<()> {
    loop {
        let Some(c) = conn(st, peer, out) else {
            return Ok(());
        };
        let Some(f) = c.out.front() else {
            return Ok(());
        };
        let hl = f.head_len;
        let head_left = &f.head[c.written.min(hl)..hl];
        // SAFETY: a frame's payload is a posted send's buffer, valid
        // until the frame is written and the send completes.
        let body = unsafe { f.payload.bytes() };
        let body_left = &body[c.written.saturating_sub(hl)..];
        match c.chan.write2(head_left, body_left) {
            Ok(n) => {
                sh.moved
                    .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                c.written += n;
                if c.written == hl + body.len() {
                    c.written = 0;
                    let f = c.out.pop_front().expect("front");
                    if let Some((_, done, status)) = f.done {
                        done.complete(Ok(status));
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(lost(sh, peer, &describe_io(&e))),
        }
    }
}

fn read_some(sh: &Shared, st: &mut State, peer: usize, out: bool) -> Result<()> {
    let mut budget = 64usize; // frames per wake-up, so one peer cannot starve the rest
    loop {
        let me = sh.rank;
        let Some(c) = conn(st, peer, out) else {
            return Ok(());
        };
        match &mut c.reading {
            Reading::Header => {
                let got = c.head_len;
                match c.chan.read(&mut c.head[got..]) {
                    Ok(0) => {
                        return Err(lost(
                            sh,
                            peer,
                            &format!("rank {peer} closed the connection (it destroyed its communicator, exited or crashed)"),
                        ))
                    }
                    Ok(n) => {
                        sh.moved
                            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                        c.head_len += n
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(lost(sh, peer, &describe_io(&e))),
                }
                if c.head_len < HEADER_BYTES {
                    continue;
                }
                c.head_len = 0;
                let h = Header::decode(&c.head, peer)?;
                on_header(sh, st, peer, out, h)?;
                budget -= 1;
                if budget == 0 {
                    return Ok(());
                }
            }
            Reading::Eager { buf, got, .. } => {
                match c.chan.read(&mut buf[*got..]) {
                    Ok(0) => return Err(lost(sh, peer, "the connection closed inside a message")),
                    Ok(n) => {
                        sh.moved
                            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                        *got += n
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(lost(sh, peer, &describe_io(&e))),
                }
                if *got == buf.len() {
                    let Reading::Eager { env, buf, .. } =
                        std::mem::replace(&mut c.reading, Reading::Header)
                    else {
                        unreachable!()
                    };
                    arrive(st, env, Some(buf), me);
                }
            }
            Reading::Remote { at, got, .. } => {
                match c.chan.read(&mut at[*got..]) {
                    Ok(0) => return Err(lost(sh, peer, "the connection closed inside a message")),
                    Ok(n) => {
                        sh.moved
                            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                        *got += n
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(lost(sh, peer, &describe_io(&e))),
                }
                if *got == REMOTE_BYTES {
                    let Reading::Remote { env, at, .. } =
                        std::mem::replace(&mut c.reading, Reading::Header)
                    else {
                        unreachable!()
                    };
                    let pid = u64::from_le_bytes(at[..8].try_into().expect("8 bytes")) as i32;
                    let addr = u64::from_le_bytes(at[8..].try_into().expect("8 bytes"));
                    on_remote(st, peer, env, pid, addr, me);
                    sh.moved.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            Reading::Failure { buf, got } => {
                match c.chan.read(&mut buf[*got..]) {
                    Ok(0) => return Err(lost(sh, peer, "the connection closed inside a message")),
                    Ok(n) => {
                        sh.moved
                            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                        *got += n
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(lost(sh, peer, &describe_io(&e))),
                }
                if *got == buf.len() {
                    let e = reported(buf);
                    let _ = sh.reported.set(e.clone());
                    return Err(e);
                }
            }
            Reading::Data {
                target, len, got, ..
            } => {
                let mut sink = [0u8; 64 << 10];
                let dst: &mut [u8] = match target {
                    // SAFETY: the matched receive's buffer is valid until it
                    // completes; withdrawing it switches this to Discard.
                    Target::Recv(r, _) => unsafe { &mut r.buf.bytes_mut()[*got..*len] },
                    Target::Discard => {
                        let n = (*len - *got).min(sink.len());
                        &mut sink[..n]
                    }
                };
                match c.chan.read(dst) {
                    Ok(0) if *len > *got => {
                        return Err(lost(sh, peer, "the connection closed inside a message"))
                    }
                    Ok(n) => {
                        sh.moved
                            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                        *got += n
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(lost(sh, peer, &describe_io(&e))),
                }
                if *got == *len {
                    let Reading::Data { target, .. } =
                        std::mem::replace(&mut c.reading, Reading::Header)
                    else {
                        unreachable!()
                    };
                    if let Target::Recv(r, status) = target {
                        r.done.complete(Ok(status));
                    }
                }
            }
        }
    }
}

/// A same-host message: copied straight from the sender's memory into
/// its receive, or (none posted yet) into memory kept until one is; the
/// sender hears Ack. When the copy is refused, the receiver asks for the
/// payload over the socket instead (Cts), as for any large message.
fn on_remote(st: &mut State, peer: usize, env: Envelope, pid: i32, addr: u64, me: usize) {
    let len = env.count as usize * env.dtype.size();
    let answer = |st: &mut State, kind: Kind| {
        if let Some(inc) = st.peers[peer].inc.as_mut() {
            inc.out.push_back(Frame::new(
                Header::answer(kind, env.seq),
                &[],
                RawBuf::EMPTY,
                None,
            ));
        }
    };
    if let Some(r) = st.matching.claim(&env) {
        match fit(r, &env, me) {
            Target::Recv(r, status) => {
                // SAFETY: the receive's buffer is valid until it completes
                // and holds the message (fit checked it).
                let dst = unsafe { &mut r.buf.bytes_mut()[..len] };
                if read_remote(pid, addr, dst).is_ok() {
                    r.done.complete(Ok(status));
                    answer(st, Kind::Ack);
                } else {
                    st.peers[peer]
                        .receiving
                        .insert(env.seq, Target::Recv(r, status));
                    answer(st, Kind::Cts);
                }
            }
            Target::Discard => answer(st, Kind::Ack),
        }
        return;
    }
    if st.matching.unexpected_bytes + len <= UNEXPECTED_LIMIT {
        let mut kept = vec![0u8; len];
        if read_remote(pid, addr, &mut kept).is_ok() {
            arrive(st, env, Some(kept), me);
            answer(st, Kind::Ack);
            return;
        }
    }
    // Kept as an envelope: its receive asks for the payload (Cts).
    arrive(st, env, None, me);
}

/// The error a peer's Failure frame reports.
fn reported(payload: &[u8]) -> Error {
    let kind = payload
        .first()
        .and_then(|k| ErrorKind::from_code(*k as i32))
        .unwrap_or(ErrorKind::PeerLost);
    Error::new(
        kind,
        String::from_utf8_lossy(payload.get(1..).unwrap_or(&[])).into_owned(),
    )
}

fn arrive(st: &mut State, env: Envelope, payload: Option<Vec<u8>>, me: usize) {
    if let Some((r, a)) = st.matching.arrive(Arrival { env, payload }) {
        st.deliver(r, a, me);
    }
}

fn on_header(sh: &Shared, st: &mut State, peer: usize, out: bool, h: Header) -> Result<()> {
    let protocol = |what: &str| {
        Error::new(
            ErrorKind::System,
            format!(
                "rank {}: point-to-point protocol error from rank {peer}: {what}",
                sh.rank
            ),
        )
    };
    let me = sh.rank;
    if h.kind == Kind::Failure {
        let c = conn(st, peer, out).expect("reading it");
        if h.payload == 0 {
            let e = reported(&[]);
            let _ = sh.reported.set(e.clone());
            return Err(e);
        }
        c.reading = Reading::Failure {
            buf: vec![0; h.payload as usize],
            got: 0,
        };
        return Ok(());
    }
    if out {
        // Only answers come back on a connection this rank dialed.
        if h.kind != Kind::Cts && h.kind != Kind::Ack {
            return Err(protocol("a message on the sender's own connection"));
        }
        let p = &mut st.peers[peer];
        let s = p
            .awaiting_cts
            .remove(&h.seq)
            .ok_or_else(|| protocol("an answer for no message"))?;
        if h.kind == Kind::Ack {
            // The receiver copied it from here: done.
            s.done.complete(Ok(Status {
                source: peer,
                tag: s.msg.tag,
                count: s.msg.count,
            }));
            return Ok(());
        }
        let status = Status {
            source: peer,
            tag: s.msg.tag,
            count: s.msg.count,
        };
        let head = Header {
            kind: Kind::Data,
            dtype: s.msg.dtype,
            tag: s.msg.tag,
            seq: h.seq,
            count: s.msg.count as u64,
            payload: s.msg.buf.len() as u64,
        };
        p.out
            .as_mut()
            .expect("reading it")
            .out
            .push_back(Frame::new(
                head,
                &[],
                s.msg.buf,
                Some((s.id, s.done, status)),
            ));
        return Ok(());
    }
    let p = &mut st.peers[peer];
    let env = Envelope {
        source: peer,
        tag: h.tag,
        seq: h.seq,
        dtype: h.dtype,
        count: h.count,
    };
    match h.kind {
        Kind::Eager | Kind::Rts => {
            if h.seq != p.next_in_seq {
                return Err(protocol("messages out of order"));
            }
            p.next_in_seq += 1;
            if h.kind == Kind::Rts || h.payload == 0 {
                arrive(st, env, (h.kind == Kind::Eager).then(Vec::new), me);
            } else if let Some(r) = st.matching.claim(&env) {
                // Its receive is posted: the payload goes straight there.
                let target = fit(r, &env, me);
                let c = st.peers[peer].inc.as_mut().expect("reading it");
                c.reading = Reading::Data {
                    target,
                    len: h.payload as usize,
                    got: 0,
                };
            } else {
                let c = p.inc.as_mut().expect("reading it");
                c.reading = Reading::Eager {
                    env,
                    buf: vec![0; h.payload as usize],
                    got: 0,
                };
            }
        }
        Kind::Data => {
            let target = p
                .receiving
                .remove(&h.seq)
                .ok_or_else(|| protocol("a payload nobody asked for"))?;
            if let Target::Recv(r, status) = &target {
                if r.buf.len() < h.payload as usize {
                    return Err(protocol("a payload larger than its envelope said"));
                }
                if h.payload == 0 {
                    r.done.complete(Ok(*status));
                    return Ok(());
                }
            }
            let c = p.inc.as_mut().expect("reading it");
            c.reading = Reading::Data {
                target,
                len: h.payload as usize,
                got: 0,
            };
        }
        Kind::Remote => {
            if h.seq != p.next_in_seq {
                return Err(protocol("messages out of order"));
            }
            p.next_in_seq += 1;
            let c = p.inc.as_mut().expect("reading it");
            c.reading = Reading::Remote {
                env,
                at: [0; REMOTE_BYTES],
                got: 0,
            };
        }
        Kind::Cts | Kind::Ack => return Err(protocol("an answer on the receiver's connection")),
        Kind::Failure => unreachable!("handled above"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_to_self_is_buffered_whatever_its_size() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mesh = MeshSpec {
            rank: 0,
            size: 1,
            addrs: vec![addr].into(),
            job: [1; 16],
            comm_id: 0,
            token: None,
            far: vec![false].into(),
        };
        let shm = crate::options::Tuning::default().shm;
        let links = Links::new(mesh.clone(), false, shm).unwrap();
        let m = Mailbox::new(MailboxSpec {
            mesh,
            listener: l,
            links: Arc::new(links),
            timeout: Duration::from_secs(5),
            spin: Duration::from_micros(50),
            signal: Arc::new(AbortSignal::new().unwrap()),
        })
        .unwrap();
        // Send to self, then receive it: buffered whatever its size.
        let data: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let mut got = vec![0u8; data.len()];
        unsafe {
            let s = m
                .send(Outgoing {
                    buf: RawBuf::of(&data),
                    dtype: DType::Uint8,
                    count: data.len(),
                    peer: 0,
                    tag: 4,
                })
                .unwrap();
            m.wait(&s).unwrap();
            let r = m
                .recv(Incoming {
                    buf: RawBuf::of(&got),
                    dtype: DType::Uint8,
                    count: got.len(),
                    peer: None,
                    tag: Some(4),
                    exact: false,
                })
                .unwrap();
            let st = m.wait(&r).unwrap();
            assert_eq!(
                st,
                Status {
                    source: 0,
                    tag: 4,
                    count: data.len()
                }
            );
        }
        got.truncate(data.len());
        assert_eq!(got, data);
        m.close();
    }
}
