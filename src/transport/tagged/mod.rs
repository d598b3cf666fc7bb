//! Tagged point-to-point messages, in their own context as in MPI: matched
//! by source, tag and order, apart from the collectives, on the same
//! connection of each pair (see `frame::FrameKind::Tag*`).
//!
//! A message up to `EAGER_MAX` travels at once, with its envelope, and
//! waits at the receiver for its receive (`TagEager`); a larger one sends
//! its envelope first and its payload when the receiver answers
//! (`TagRts`, `TagCts`, `TagData`). Between ranks of one host that can
//! read each other's memory, a large message stays in the sender's buffer
//! and the receiver copies it out (`TagRemote`, answered by `TagAck`).
//!
//! A receive that gives up waiting after its message was matched (its
//! payload on the way, or waiting to be copied out of the sender's memory)
//! consumes that message: the payload is dropped and the sender released
//! as if it had been received.
//!
//! A send that gives up waiting (its timeout) is withdrawn: its buffer is
//! never read again. What of it is framed already keeps its place in the
//! pair's order (the receiver counts on it): its payload is copied out of
//! the caller's buffer first, and it goes out as sent. A single-copy send
//! cannot be taken back from a receiver that may be reading it: the sender
//! marks it withdrawn in its memory, and the receiver, after its copy,
//! looks there and fails the receive rather than keep bytes that may have
//! changed under it; the sender keeps a copy too, sent if the receiver's
//! copy fails and it asks for the bytes over the connection.
//!
//! This is the context's state: the posted sends and receives, matching,
//! and each pair's protocol. The stream core (`stream`) reads and writes
//! its frames, and asks it what to do with each; whoever holds the core
//! moves its bytes (a waiting caller, the endpoint's thread, or a
//! collective's exchange, which also takes the tagged frames it meets).

mod choice;
mod matching;
mod posts;

use crate::call::RawBuf;
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::sync::lock;
use crate::transport::channel::{read_remote, read_remote_then_word, Channel};
use crate::transport::frame::{FrameKind, Header, EAGER_MAX, HEADER_BYTES, TAG_REMOTE_BYTES};
use choice::Choices;
pub use choice::ReadCost;
use matching::{Arrival, Envelope, Matching, PostedRecv, Remote};
pub use posts::{Post, Posts};
use std::cell::UnsafeCell;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Who sent a received message, with which tag, and how many elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    pub source: usize,
    pub tag: i32,
    pub count: usize,
}

/// Where a posted call's result appears. Set and read without a lock
/// (a spinning caller looks at it on every pass); the lock is only for
/// those who sleep on it.
pub struct Done {
    /// EMPTY, WRITING (one completer is writing `result`), or READY.
    state: AtomicU8,
    result: UnsafeCell<MaybeUninit<Result<Status>>>,
    sleep: Mutex<()>,
    ready: Condvar,
    /// Threads asleep on `ready` (a wake costs a system call: paid only
    /// when someone sleeps).
    sleepers: AtomicU32,
}

const EMPTY: u8 = 0;
const WRITING: u8 = 1;
const READY: u8 = 2;

// SAFETY: `result` is written once, by the completer that moved `state`
// from EMPTY to WRITING, and read only once `state` is READY (published
// with Release, seen with Acquire); the result itself may cross threads
// (checked below).
unsafe impl Sync for Done {}
unsafe impl Send for Done {}
const _: () = {
    const fn crosses_threads<T: Send + Sync>() {}
    crosses_threads::<Result<Status>>();
};

impl Default for Done {
    fn default() -> Done {
        Done {
            state: AtomicU8::new(EMPTY),
            result: UnsafeCell::new(MaybeUninit::uninit()),
            sleep: Mutex::new(()),
            ready: Condvar::new(),
            sleepers: AtomicU32::new(0),
        }
    }
}

impl Done {
    /// The first result stays.
    pub fn complete(&self, r: Result<Status>) {
        // Claimed with one compare-and-swap, published with one swap: the
        // swap is also the barrier between publishing and looking for
        // sleepers (a sleeper counts itself, then looks at `state`:
        // either it sees READY, or this load sees it).
        if self
            .state
            .compare_exchange(EMPTY, WRITING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        // SAFETY: only the completer that claimed the state writes here,
        // and nobody reads before READY.
        unsafe { (*self.result.get()).write(r) };
        self.state.swap(READY, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            // Under the lock: a sleeper that saw no result holds it until
            // it waits, so this wake cannot fall between its look and its
            // wait.
            let _held = lock(&self.sleep);
            self.ready.notify_all();
        }
    }

    #[inline]
    pub fn is_finished(&self) -> bool {
        self.state.load(Ordering::Acquire) == READY
    }

    /// The result, once complete.
    #[inline]
    pub fn result(&self) -> Option<&Result<Status>> {
        // SAFETY: READY is stored after the result was written (Release,
        // seen here with Acquire), and it is never written again.
        self.is_finished()
            .then(|| unsafe { (*self.result.get()).assume_init_ref() })
    }

    pub fn get(&self) -> Option<Result<Status>> {
        self.result().cloned()
    }

    /// Sleeps until the result is in or `deadline` passes; the result.
    pub fn sleep_until(&self, deadline: Instant) -> Option<Result<Status>> {
        let mut held = lock(&self.sleep);
        // Counted, then the look (both SeqCst, as in `complete`): either
        // this look sees the result, or `complete` sees the sleeper and
        // wakes it.
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        while self.state.load(Ordering::SeqCst) != READY {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            held = crate::sync::wait_for(&self.ready, held, left);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(held);
        self.get()
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        if *self.state.get_mut() == READY {
            // SAFETY: written once and not dropped before.
            unsafe { self.result.get_mut().assume_init_drop() };
        }
    }
}

impl Done {
    /// A fresh `Done`: one this thread kept from a finished call when it
    /// has one (a small exchange posts one a message; an allocation and
    /// its free cost about as much as the rest of the post).
    pub fn fresh() -> Arc<Done> {
        SPARE_DONES
            .try_with(|s| s.borrow_mut().pop())
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Keeps `done` for this thread's next call when nothing else holds
    /// it (else it goes when the last holder lets go).
    fn recycle(mut done: Arc<Done>) {
        let Some(d) = Arc::get_mut(&mut done) else {
            return;
        };
        if std::mem::replace(d.state.get_mut(), EMPTY) == READY {
            // SAFETY: READY: written once, dropped here once (the state
            // is EMPTY from now on).
            unsafe { d.result.get_mut().assume_init_drop() };
        }
        let _ = SPARE_DONES.try_with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < SPARE_DONES_MAX {
                s.push(done);
            }
        });
    }
}

/// `Done`s a thread keeps for its next calls, at most this many.
const SPARE_DONES_MAX: usize = 64;

thread_local! {
    static SPARE_DONES: std::cell::RefCell<Vec<Arc<Done>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A posted send or receive.
pub struct Ticket {
    pub id: u64,
    /// Taken out only when the ticket goes (see `Drop`).
    pub done: std::mem::ManuallyDrop<Arc<Done>>,
    /// What it is, for messages (formatted only when one is needed).
    pub call: Described,
}

impl Ticket {
    pub fn new(id: u64, call: Described) -> Ticket {
        Ticket {
            id,
            done: std::mem::ManuallyDrop::new(Done::fresh()),
            call,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used after.
        let done = unsafe { std::mem::ManuallyDrop::take(&mut self.done) };
        Done::recycle(done);
    }
}

/// A send or receive as its errors name it.
#[derive(Clone, Copy, Debug)]
pub enum Described {
    Send(Outgoing),
    Recv(Incoming),
}

impl Described {
    /// The rank the call waits for (None: a receive from any source).
    pub fn peer(&self) -> Option<usize> {
        match self {
            Described::Send(m) => Some(m.peer),
            Described::Recv(r) => r.peer,
        }
    }
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

impl Outgoing {
    /// What the send's caller learns once it went.
    pub fn status(&self) -> Status {
        Status {
            source: self.peer,
            tag: self.tag,
            count: self.count,
        }
    }
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

/// Where an arriving frame's payload goes (the stream core reads it).
pub enum Sink {
    /// Straight into a matched receive's buffer.
    Receive(PostedRecv, Status),
    /// Kept until a receive takes it.
    Keep(Envelope, Vec<u8>),
    /// Read and dropped (its receive failed, or gave up).
    Drop,
    /// A single-copy message's descriptor (see `TAG_REMOTE_BYTES`).
    Descriptor(Envelope),
}

impl Sink {
    /// The bytes the next read may fill, `got` bytes in (None: drop them,
    /// up to the frame's end).
    pub fn buffer(&mut self, got: usize) -> Option<&mut [u8]> {
        match self {
            // SAFETY: a matched receive's buffer is valid until its
            // ticket completes; withdrawing it turns this into Drop.
            Sink::Receive(r, _) => Some(unsafe { &mut r.buf.bytes_mut()[got..] }),
            Sink::Keep(_, v) => Some(&mut v[got..]),
            Sink::Drop | Sink::Descriptor(_) => None,
        }
    }

    /// Whether this sink is receive `id`'s.
    pub fn is_receive(&self, id: u64) -> bool {
        matches!(self, Sink::Receive(r, _) if r.id == id)
    }
}

/// A send not written yet.
struct SendOp {
    id: u64,
    msg: Outgoing,
    done: Arc<Done>,
    /// Sent single copy (the receiver reads `msg.buf` itself).
    remote: bool,
    /// When it went single copy by its buffer's choice (see `choice`).
    chosen_at: Option<Instant>,
    /// The payload copied out of a withdrawn send's buffer (`msg.buf`
    /// points here then).
    kept: Option<Box<[u8]>>,
}

/// A copy of `buf` that stays where it is (None: no memory for it).
fn keep(buf: RawBuf) -> Option<(RawBuf, Box<[u8]>)> {
    let mut v: Vec<u8> = Vec::new();
    v.try_reserve_exact(buf.len()).ok()?;
    // SAFETY: the send is still posted: its buffer is valid until it
    // completes or is withdrawn (which this copy is part of).
    v.extend_from_slice(unsafe { buf.bytes() });
    let kept = v.into_boxed_slice();
    Some((RawBuf::of(&kept), kept))
}

/// Whether the sender of single-copy message `seq` withdrew it (its send
/// timed out) before this rank's copy of it ended: its buffer may have
/// changed under the copy. Its word unreadable: the sender is gone, and
/// so is any promise about its buffer.
fn withdrawn(remote: &Remote, seq: u64) -> bool {
    let mut word = [0u8; 8];
    read_remote(remote.pid, remote.withdrawn, &mut word)
        .map_or(true, |_| u64::from_le_bytes(word) > seq)
}

/// The error of a receive whose single-copy message `sender` withdrew
/// (its send timed out) while this rank copied it.
fn withdrawn_while_copied(sender: usize, me: usize) -> Error {
    Error::new(
        ErrorKind::Timeout,
        format!(
            "rank {sender} withdrew this message (its send timed out) while rank {me} copied it"
        ),
    )
}

/// A frame waiting to be written: its header (and a single-copy
/// descriptor), its payload in the sender's buffer, and the send it
/// completes once written (eager and rendezvous payloads).
struct OutFrame {
    head: [u8; HEADER_BYTES + TAG_REMOTE_BYTES],
    head_len: usize,
    payload: RawBuf,
    done: Option<(Arc<Done>, Status)>,
    /// The send whose frame this is (0: an answer).
    id: u64,
    /// The payload copied out of a withdrawn send's buffer.
    kept: Option<Box<[u8]>>,
}

impl OutFrame {
    fn new(
        h: Header,
        extra: &[u8],
        payload: RawBuf,
        done: Option<(Arc<Done>, Status)>,
        id: u64,
    ) -> OutFrame {
        let mut head = [0u8; HEADER_BYTES + TAG_REMOTE_BYTES];
        head[..HEADER_BYTES].copy_from_slice(&h.encode());
        head[HEADER_BYTES..HEADER_BYTES + extra.len()].copy_from_slice(extra);
        OutFrame {
            head,
            head_len: HEADER_BYTES + extra.len(),
            payload,
            done,
            id,
            kept: None,
        }
    }

    fn len(&self) -> usize {
        self.head_len + self.payload.len()
    }
}

/// One peer's side of the protocol, made when the pair is first used.
#[derive(Default)]
struct Peer {
    /// Sends not framed yet (framing needs the connection's abilities).
    queued: VecDeque<SendOp>,
    /// Frames to write; the front one has `written` bytes out.
    out: VecDeque<OutFrame>,
    written: usize,
    /// Sends whose envelope went out, waiting for TagCts or TagAck, by seq.
    awaiting: HashMap<u64, SendOp>,
    /// Receives matched to an envelope, waiting for its payload, by seq.
    receiving: HashMap<u64, Sink>,
    /// Receives posted after their single-copy message came, waiting for
    /// the copy out of the sender's memory (see `Tagged::run_copies`).
    copies: VecDeque<(PostedRecv, Arrival)>,
    next_out_seq: u64,
    next_in_seq: u64,
    /// Why this pair can no longer talk.
    gone: Option<Error>,
    /// One past the highest sequence number of a single-copy send to this
    /// peer withdrawn before the peer answered: the peer reads it here
    /// (its descriptor says where; `Peer` is boxed, so it stays put).
    withdrawn: AtomicU64,
    /// Which of this rank's buffers go to the peer single copy below the
    /// single-copy sizes (see `choice`).
    choices: Choices,
}

impl Peer {
    /// Queues an answer (TagCts, TagAck) ahead of the frames not started
    /// yet: answers are short, and unblock the peer. Behind the frame
    /// being written (it cannot be cut) and the answers already waiting.
    fn push_answer(&mut self, f: OutFrame) {
        let mut at = usize::from(self.written > 0);
        while at < self.out.len() && self.out[at].id == 0 {
            at += 1;
        }
        self.out.insert(at, f);
    }
}

/// What a connection can do for the tagged context, as `write` frames
/// its sends.
#[derive(Clone, Copy, Debug)]
pub struct Path {
    /// The peer's pid when the receiver may copy from the sender's memory.
    pub single_copy_pid: Option<i32>,
}

impl Path {
    /// What `chan` allows.
    pub fn of(chan: &dyn Channel) -> Path {
        Path {
            single_copy_pid: chan.peer_pid().filter(|_| chan.caps().single_copy),
        }
    }

    /// Whether a message of `bytes` stays in the sender's memory for its
    /// receiver to copy (from `min` bytes, where the path allows it).
    fn single_copy(&self, bytes: usize, min: usize) -> bool {
        self.single_copy_pid.is_some() && bytes >= min && bytes > 0
    }
}

/// Stop keeping messages nobody asked for beyond this much memory: a
/// single-copy message past it stays in its sender until its receive
/// comes (the sender then sends it over the connection).
const UNEXPECTED_LIMIT: usize = 256 << 20;

/// How long a single-copy message nobody asked for yet stays in its
/// sender's memory, waiting for its receive to be posted (then it is
/// copied once, straight into the receive), before it is copied out into
/// memory kept here and its sender is released: a sender that blocks
/// until then may be this rank's peer in a send-before-receive both ways.
const REMOTE_PATIENCE: std::time::Duration = std::time::Duration::from_micros(200);

/// The tagged context of one rank of one communicator.
pub struct Tagged {
    rank: usize,
    matching: Matching,
    peers: Vec<Option<Box<Peer>>>,
    /// The peers made so far.
    used: Vec<usize>,
    /// Sends to self, copied, are numbered here.
    self_seq: u64,
    /// Set once the communicator failed or was aborted: every call fails so.
    failed: Option<Error>,
    closing: bool,
    /// Messages from this size go single-copy where a pair can.
    single_copy_min: usize,
    /// The same for a message sent while a receive of as much is posted
    /// (both ways at once: see `stream::Tuning`).
    two_way_single_copy_min: usize,
    /// Receives waiting in the peers' `copies`.
    copies: usize,
    /// Below those sizes, single copy is chosen per buffer from its
    /// receiver's copy times, weighed with this (None: never)...
    read_cost: Option<ReadCost>,
    /// ... for messages of these sizes (empty: never).
    chosen_sizes: std::ops::RangeInclusive<usize>,
}

impl Tagged {
    pub fn new(
        rank: usize,
        size: usize,
        single_copy_min: usize,
        two_way_single_copy_min: usize,
        read_cost: Option<ReadCost>,
    ) -> Tagged {
        Tagged {
            rank,
            matching: Matching::default(),
            peers: (0..size).map(|_| None).collect(),
            used: Vec::new(),
            self_seq: 0,
            failed: None,
            closing: false,
            single_copy_min,
            two_way_single_copy_min,
            copies: 0,
            read_cost,
            #[allow(clippy::reversed_empty_ranges)]
            chosen_sizes: read_cost.map_or(1..=0, |c| c.sizes()),
        }
    }

    /// Whether a message of `bytes` goes single copy: from
    /// `single_copy_min`, or sooner while a receive of as much is posted
    /// (this rank's core copies both ways at once: from any peer, as in a
    /// ring's exchange).
    #[inline]
    fn goes_single_copy(&self, msg: &Outgoing, path: Path) -> bool {
        match self.sized_single_copy(msg.buf.len(), path) {
            Some(single) => single,
            None => self
                .peer_ref(msg.peer)
                .is_some_and(|p| (p.choices).single(msg.buf.addr(), msg.buf.len(), p.next_in_seq)),
        }
    }

    /// Counts a send framed or written, single copy or not, where its
    /// buffer's path is chosen (see `choice`); whether it is.
    #[inline]
    fn count_sent(&mut self, msg: &Outgoing, path: Path, single: bool) -> bool {
        if !self.chosen_sizes.contains(&msg.buf.len()) {
            return false;
        }
        let chosen = self.sized_single_copy(msg.buf.len(), path).is_none();
        if chosen {
            let p = self.peer(msg.peer);
            let heard = p.next_in_seq;
            (p.choices).sent(msg.buf.addr(), msg.buf.len(), single, heard);
        }
        chosen
    }

    /// Whether a message of `bytes` goes single copy by its size (see
    /// `goes_single_copy`); None: below those sizes, where it could pay
    /// (the peer's `choices` decide).
    #[inline]
    fn sized_single_copy(&self, bytes: usize, path: Path) -> Option<bool> {
        let two_way = self.two_way_single_copy_min;
        if path.single_copy(bytes, two_way.min(self.single_copy_min))
            && (path.single_copy(bytes, self.single_copy_min)
                || (self.matching.posted.iter()).any(|r| r.buf.len() >= two_way))
        {
            return Some(true);
        }
        let chosen = self.chosen_sizes.contains(&bytes) && path.single_copy(bytes, 1);
        (!chosen).then_some(false)
    }

    #[inline]
    fn peer(&mut self, p: usize) -> &mut Peer {
        if self.peers[p].is_none() {
            self.add_peer(p);
        }
        match &mut self.peers[p] {
            Some(peer) => peer,
            None => unreachable!("a peer's state is made before it is used"),
        }
    }

    /// The first call with `p` makes its state (out of line: once a peer).
    #[cold]
    #[inline(never)]
    fn add_peer(&mut self, p: usize) {
        self.used.push(p);
        self.peers[p] = Some(Box::default());
    }

    #[inline]
    fn peer_ref(&self, p: usize) -> Option<&Peer> {
        self.peers.get(p)?.as_deref()
    }

    /// The peers this context has talked to.
    pub fn used(&self) -> &[usize] {
        &self.used
    }

    #[inline]
    pub fn usable(&self) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.closing {
            return Err(Error::invalid_usage("the communicator is being destroyed"));
        }
        Ok(())
    }

    pub fn set_closing(&mut self) {
        self.closing = true;
    }

    /// Posts `post`; one refused completes with why (its caller is not
    /// here to be told).
    pub fn take_post(&mut self, post: Post) {
        let (done, r) = match post {
            Post::Send(msg, done, id) => {
                let r = self.post_send(msg, done.clone(), id);
                (done, r)
            }
            Post::Recv(r, done, id) => {
                let r = self.post_recv(r, done.clone(), id);
                (done, r)
            }
        };
        if let Err(e) = r {
            done.complete(Err(e));
        }
    }

    /// Posts send `id` (it is framed and written by whoever holds the
    /// core next). A send to this rank is copied at once.
    pub fn post_send(&mut self, msg: Outgoing, done: Arc<Done>, id: u64) -> Result<()> {
        self.usable()?;
        if msg.peer == self.rank {
            let seq = self.self_seq;
            self.self_seq += 1;
            // SAFETY: the caller keeps the buffer valid until the ticket
            // completes, which is now.
            let payload = unsafe { msg.buf.bytes() }.to_vec();
            let env = Envelope {
                source: self.rank,
                tag: msg.tag,
                seq,
                dtype: msg.dtype,
                count: msg.count as u64,
            };
            self.arrive(env, Some(payload), None);
            done.complete(Ok(Status {
                source: self.rank,
                tag: msg.tag,
                count: msg.count,
            }));
            return Ok(());
        }
        let p = self.peer(msg.peer);
        if let Some(e) = &p.gone {
            return Err(e.clone());
        }
        p.queued.push_back(SendOp {
            id,
            msg,
            done,
            remote: false,
            chosen_at: None,
            kept: None,
        });
        Ok(())
    }

    /// Whether eager send `msg` may be written now: nothing is ahead of
    /// it to its peer (no queued send, no frame partly written) and it
    /// goes over the connection (not single copy).
    #[inline]
    fn writable_now(&mut self, msg: &Outgoing, path: Path) -> bool {
        let bytes = msg.buf.len();
        if self.usable().is_err()
            || msg.peer == self.rank
            || bytes > EAGER_MAX
            || self.goes_single_copy(msg, path)
        {
            return false;
        }
        let p = self.peer(msg.peer);
        p.gone.is_none() && p.queued.is_empty() && p.out.is_empty() && p.written == 0
    }

    /// A blocking send written whole now, as one message of a channel
    /// that keeps message boundaries (shared memory), when
    /// `writable_now`: complete on return, so it needs no ticket. Its
    /// status, or None (nothing written: the caller posts it).
    pub fn send_whole_now(
        &mut self,
        msg: Outgoing,
        chan: &mut dyn Channel,
        path: Path,
    ) -> Option<Status> {
        if !self.writable_now(&msg, path) {
            return None;
        }
        let p = self.peer(msg.peer);
        let head = eager_header(&msg, p.next_out_seq).encode();
        // SAFETY: the caller keeps the buffer valid until this returns.
        if !chan.write_whole(&head, unsafe { msg.buf.bytes() }) {
            return None;
        }
        p.next_out_seq += 1;
        self.count_sent(&msg, path, false);
        Some(msg.status())
    }

    /// Writes eager send `id` on `chan` now, when `writable_now`: no
    /// queue, no pass over the peers, so a small message costs little
    /// more than the channel's write. Whether it was taken: written whole
    /// (and complete), or partly, its rest queued as any frame's. Not
    /// taken (nothing written, nothing counted): the caller posts it with
    /// `post_send`, which also reports why it cannot go.
    pub fn send_at_once(
        &mut self,
        msg: Outgoing,
        done: &Arc<Done>,
        id: u64,
        chan: &mut dyn Channel,
        path: Path,
    ) -> bool {
        if !self.writable_now(&msg, path) {
            return false;
        }
        let bytes = msg.buf.len();
        let p = self.peer(msg.peer);
        let h = eager_header(&msg, p.next_out_seq);
        let head = h.encode();
        // SAFETY: the caller keeps the buffer valid until the ticket
        // completes (now, or once its rest is written).
        let body = unsafe { msg.buf.bytes() };
        let written = loop {
            match chan.write2(&head, body) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Full, or broken: the usual path waits, or finds why.
                Err(_) => return false,
            }
        };
        if written == 0 {
            return false;
        }
        p.next_out_seq += 1;
        self.count_sent(&msg, path, false);
        let p = self.peer(msg.peer);
        let status = msg.status();
        if written == HEADER_BYTES + bytes {
            done.complete(Ok(status));
        } else {
            p.out.push_back(OutFrame::new(
                h,
                &[],
                msg.buf,
                Some((done.clone(), status)),
                id,
            ));
            p.written = written;
        }
        true
    }

    /// Whether blocking receive `r` may take its peer's next message
    /// straight from the connection, with no ticket: nothing is pending
    /// in this context (no posted receive could claim the message first,
    /// no send or partly moved frame needs this caller to move it) and
    /// nothing from that peer waits unmatched (it arrived first).
    #[inline]
    pub fn receivable_now(&self, r: &Incoming) -> bool {
        let Some(peer) = r.peer.filter(|p| *p != self.rank) else {
            return false;
        };
        self.usable().is_ok()
            && !self.busy()
            && self.peer_ref(peer).is_some_and(|p| p.gone.is_none())
            && !self
                .matching
                .unexpected
                .iter()
                .any(|a| a.env.source == peer)
    }

    /// Blocking receive `r` (`receivable_now`) takes eager frame `h`,
    /// which is next from its peer, when the message is its own (tag,
    /// type and count fit): the frame is counted in and the status
    /// returned; the caller copies the payload. None: the frame goes the
    /// usual way (which also reports a misfit or a protocol error).
    pub fn take_eager_now(&mut self, r: &Incoming, h: &Header) -> Option<Status> {
        let peer = r.peer?;
        if h.kind != FrameKind::TagEager || !self.next_is_for(r, h, h.payload) {
            return None;
        }
        self.peer(peer).next_in_seq += 1;
        Some(Status {
            source: peer,
            tag: h.tag(),
            count: h.desc.count as usize,
        })
    }

    /// `take_eager_now` for the commonest case, read without decoding:
    /// an exact receive from one rank with one tag takes `head` when it
    /// is, byte for byte, the header of the next eager message it
    /// expects from that peer, and `record` (header and payload) is that
    /// message whole. None: not that header (nothing changed; the frame
    /// is decoded and taken, or reported, the usual way).
    #[inline]
    pub fn take_expected_eager(&mut self, r: &Incoming, record: &[u8]) -> Option<Status> {
        let (Some(peer), Some(tag), true) = (r.peer, r.tag, r.exact) else {
            return None;
        };
        let bytes = r.dtype.size().checked_mul(r.count)?;
        if bytes > r.buf.len() || tag < 0 || record.len() != HEADER_BYTES + bytes {
            return None;
        }
        let p = self.peers.get_mut(peer)?.as_deref_mut()?;
        let want = Header::tagged(
            FrameKind::TagEager,
            p.next_in_seq,
            tag,
            r.count as u64,
            r.dtype,
            bytes as u64,
        )
        .encode();
        if record[..HEADER_BYTES] != want {
            return None;
        }
        p.next_in_seq += 1;
        Some(Status {
            source: peer,
            tag,
            count: r.count,
        })
    }

    /// Whether frame `h`, of `bytes` payload, is the next from `r`'s
    /// peer and `r`'s own message (tag, type, count and size fit).
    fn next_is_for(&self, r: &Incoming, h: &Header, bytes: u64) -> bool {
        let Some(p) = r.peer.and_then(|peer| self.peer_ref(peer)) else {
            return false;
        };
        h.desc.seq == p.next_in_seq
            && r.tag.is_none_or(|t| t == h.tag())
            && h.desc.dtype == r.dtype
            && if r.exact {
                h.desc.count == r.count as u64
            } else {
                h.desc.count <= r.count as u64
            }
            && bytes <= r.buf.len() as u64
    }

    /// Blocking receive `r` (`receivable_now`) takes single-copy frame
    /// `h`, next from its peer, when the message is its own (as
    /// `take_eager_now`): copies it out of the sender's memory at `pid`
    /// (`descriptor`: where), counts the frame in and queues its TagAck,
    /// as `deliver` would, with no ticket and no matching. None, with
    /// nothing changed: the frame goes the usual way (a misfit, or a copy
    /// the kernel refused, which the usual way asks for over the
    /// connection).
    pub fn take_remote_now(
        &mut self,
        r: &Incoming,
        h: &Header,
        pid: i32,
        descriptor: &[u8; TAG_REMOTE_BYTES],
    ) -> Option<Result<Status>> {
        let peer = r.peer?;
        let word =
            |at: usize| u64::from_le_bytes(descriptor[at..at + 8].try_into().expect("8 bytes"));
        let tag = h.tag();
        let len = h.desc.count.checked_mul(h.desc.dtype.size() as u64)?;
        if h.kind != FrameKind::TagRemote || word(8) != len || !self.next_is_for(r, h, len) {
            return None;
        }
        // SAFETY: the caller keeps the buffer valid and untouched until
        // it returns; it holds the message (checked above).
        let dst = unsafe { &mut r.buf.bytes_mut()[..len as usize] };
        let start = Instant::now();
        let read = read_remote_then_word(pid, word(0), dst, word(16)).ok()?;
        let read_ns = start.elapsed().as_nanos().max(1) as u64;
        let env = Envelope {
            source: peer,
            tag,
            seq: h.desc.seq,
            dtype: h.desc.dtype,
            count: h.desc.count,
        };
        self.peer(peer).next_in_seq += 1;
        self.answer_copied(env, read_ns);
        let status = Status {
            source: peer,
            tag,
            count: h.desc.count as usize,
        };
        Some(match read.is_none_or(|w| w > env.seq) {
            false => Ok(status),
            true => Err(withdrawn_while_copied(env.source, self.rank)),
        })
    }

    /// Posts receive `id`; it matches at once if its message already
    /// arrived.
    pub fn post_recv(&mut self, r: Incoming, done: Arc<Done>, id: u64) -> Result<()> {
        self.usable()?;
        if let Some(p) = r.peer.filter(|p| *p != self.rank) {
            // Its peer is driven from now on (see `used`).
            self.peer(p);
        }
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
        match self.matching.post(posted) {
            // Its message waits in the sender's memory: copied by the next
            // pass that moves this context, not here, so that a caller who
            // posts its receives before its sends (irecv; isend; wait)
            // sends first, and both sides of an exchange copy at once.
            Some((r, a)) if a.remote.is_some() && a.env.source != self.rank => {
                self.peer(a.env.source).copies.push_back((r, a));
                self.copies += 1;
            }
            Some((r, a)) => self.deliver(r, a),
            None => {
                // Nothing buffered from a rank that is gone: nothing will come.
                let gone = r.peer.and_then(|p| self.peer_ref(p)?.gone.clone());
                if let Some(e) = gone {
                    self.matching.cancel(id);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Whether reading `peer`'s frames now serves this context: a receive
    /// that may take its messages is posted, a send waits for its answer,
    /// or a send to it is still being written (the peer may be writing to
    /// this rank just as it does, both waiting for room: its messages are
    /// taken in, so that sends made before receives on both sides go on).
    pub fn wants(&self, peer: usize) -> bool {
        let waiting = self.peer_ref(peer).is_some_and(|p| {
            !p.awaiting.is_empty()
                || !p.receiving.is_empty()
                || !p.queued.is_empty()
                || !p.out.is_empty()
        });
        waiting
            || self
                .matching
                .posted
                .iter()
                .any(|r| r.source.is_none_or(|s| s == peer))
    }

    /// Whether a receive from any rank is posted (every peer's frames
    /// may be its message).
    pub fn wants_any_source(&self) -> bool {
        self.matching.posted.iter().any(|r| r.source.is_none())
    }

    /// Whether a receive waits for its copy out of a sender's memory.
    #[inline]
    pub fn has_copies(&self) -> bool {
        self.copies > 0
    }

    /// Copies the single-copy messages whose receives were posted after
    /// they came (see `post_recv`), each answered with TagAck (queued:
    /// the caller writes the answers).
    pub fn run_copies(&mut self) {
        for i in 0..self.used.len() {
            let peer = self.used[i];
            loop {
                let p = self.peers[peer].as_deref_mut().expect("used");
                let Some((r, a)) = p.copies.pop_front() else {
                    break;
                };
                self.copies -= 1;
                self.deliver(r, a);
            }
        }
    }

    /// Whether any call is pending here (so that someone keeps moving).
    pub fn busy(&self) -> bool {
        !self.matching.posted.is_empty()
            || self.copies > 0
            || self.used.iter().any(|&p| {
                self.peer_ref(p).is_some_and(|q| {
                    !q.queued.is_empty()
                        || !q.out.is_empty()
                        || !q.awaiting.is_empty()
                        || !q.receiving.is_empty()
                })
            })
    }

    /// Whether something waits to be written to `peer`.
    pub fn has_output(&self, peer: usize) -> bool {
        self.peer_ref(peer)
            .is_some_and(|p| !p.out.is_empty() || !p.queued.is_empty())
    }

    /// Whether a frame to `peer` is partly written (nothing else may go
    /// on the connection before it ends).
    pub fn mid_frame(&self, peer: usize) -> bool {
        self.peer_ref(peer).is_some_and(|p| p.written > 0)
    }

    /// Bytes still to write of the partly written frame to `peer` (a
    /// failure report pads them, so the peer can parse what follows).
    pub fn unfinished(&self, peer: usize) -> usize {
        self.peer_ref(peer)
            .filter(|p| p.written > 0)
            .and_then(|p| p.out.front().map(|f| f.len() - p.written))
            .unwrap_or(0)
    }

    /// Forgets how far the frames cut short were written (the core pads
    /// them, see `StreamTransport::fail`); their sends fail with the rest.
    pub fn forget_cut_frames(&mut self) {
        for &p in &self.used {
            if let Some(q) = self.peers[p].as_deref_mut() {
                if q.written > 0 {
                    q.written = 0;
                    if let Some(f) = q.out.pop_front() {
                        if let Some((done, _)) = f.done {
                            done.complete(Err(Error::new(
                                ErrorKind::Aborted,
                                "the communicator failed while this send was being written",
                            )));
                        }
                    }
                }
            }
        }
    }

    /// Turns `peer`'s queued sends into frames, as the path allows.
    fn frame(&mut self, peer: usize, path: Path) {
        while let Some(mut s) = self.peer(peer).queued.pop_front() {
            let single_copy = self.goes_single_copy(&s.msg, path);
            let chosen = self.count_sent(&s.msg, path, single_copy);
            let p = self.peer(peer);
            let seq = p.next_out_seq;
            p.next_out_seq += 1;
            let bytes = s.msg.buf.len();
            let status = Status {
                source: peer,
                tag: s.msg.tag,
                count: s.msg.count,
            };
            let header = |kind, payload: usize| {
                Header::tagged(
                    kind,
                    seq,
                    s.msg.tag,
                    s.msg.count as u64,
                    s.msg.dtype,
                    payload as u64,
                )
            };
            if single_copy {
                // Same host: the receiver copies it from here, one copy.
                let mut d = [0u8; TAG_REMOTE_BYTES];
                d[..8].copy_from_slice(&(s.msg.buf.addr() as u64).to_le_bytes());
                d[8..16].copy_from_slice(&(bytes as u64).to_le_bytes());
                let withdrawn = &p.withdrawn as *const AtomicU64 as u64;
                d[16..].copy_from_slice(&withdrawn.to_le_bytes());
                let h = header(FrameKind::TagRemote, TAG_REMOTE_BYTES);
                p.out
                    .push_back(OutFrame::new(h, &d, RawBuf::EMPTY, None, s.id));
                s.remote = true;
                s.chosen_at = chosen.then(Instant::now);
                p.awaiting.insert(seq, s);
            } else if bytes <= EAGER_MAX {
                let h = header(FrameKind::TagEager, bytes);
                p.out.push_back(OutFrame::new(
                    h,
                    &[],
                    s.msg.buf,
                    Some((s.done, status)),
                    s.id,
                ));
            } else {
                let h = header(FrameKind::TagRts, 0);
                p.out
                    .push_back(OutFrame::new(h, &[], RawBuf::EMPTY, None, s.id));
                p.awaiting.insert(seq, s);
            }
        }
    }

    /// Writes as much of `peer`'s frames as `chan` takes now; whether
    /// bytes moved. Sends complete as their frames go out (eager) or as
    /// their answers come (rendezvous, single copy).
    pub fn write(&mut self, peer: usize, chan: &mut dyn Channel, path: Path) -> io::Result<bool> {
        self.frame(peer, path);
        let p = self.peer(peer);
        let mut moved = false;
        while let Some(f) = p.out.front() {
            let hl = f.head_len;
            let head = &f.head[p.written.min(hl)..hl];
            // SAFETY: a frame's payload is a posted send's buffer, valid
            // until the frame is written and the send completes.
            let body = unsafe { f.payload.bytes() };
            let body = &body[p.written.saturating_sub(hl)..];
            match chan.write2(head, body) {
                Ok(n) => {
                    moved = true;
                    p.written += n;
                    if p.written == f.len() {
                        p.written = 0;
                        let f = p.out.pop_front().expect("front");
                        if let Some((done, status)) = f.done {
                            done.complete(Ok(status));
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(moved),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(moved)
    }

    /// A tagged frame's header arrived from `peer`: where its payload
    /// goes (None: the frame is complete, it has none). `pid` is the
    /// peer's when its memory can be read.
    pub fn on_header(&mut self, peer: usize, h: &Header, pid: Option<i32>) -> Result<Option<Sink>> {
        let me = self.rank;
        let protocol = |what: &str| {
            Error::new(
                ErrorKind::System,
                format!("rank {me}: point-to-point protocol error from rank {peer}: {what}"),
            )
        };
        let env = Envelope {
            source: peer,
            tag: h.tag(),
            seq: h.desc.seq,
            dtype: h.desc.dtype,
            count: h.desc.count,
        };
        match h.kind {
            FrameKind::TagEager | FrameKind::TagRts | FrameKind::TagRemote => {
                let p = self.peer(peer);
                if env.seq != p.next_in_seq {
                    return Err(protocol("messages out of order"));
                }
                p.next_in_seq += 1;
                if h.kind == FrameKind::TagRemote {
                    if pid.is_none() {
                        return Err(protocol("a single-copy message on a connection without it"));
                    }
                    return Ok(Some(Sink::Descriptor(env)));
                }
                if h.kind == FrameKind::TagRts || h.payload == 0 {
                    self.arrive(env, (h.kind == FrameKind::TagEager).then(Vec::new), None);
                    return Ok(None);
                }
                Ok(Some(match self.matching.claim(&env) {
                    // Its receive is posted: the payload goes straight there.
                    Some(r) => fit(r, &env, me),
                    None => Sink::Keep(env, vec![0; h.payload as usize]),
                }))
            }
            FrameKind::TagData => {
                let target = self
                    .peer(peer)
                    .receiving
                    .remove(&env.seq)
                    .ok_or_else(|| protocol("a payload nobody asked for"))?;
                if let Sink::Receive(r, status) = &target {
                    if r.buf.len() < h.payload as usize {
                        let e = protocol("a payload larger than its envelope said");
                        r.done.complete(Err(e.clone()));
                        return Err(e);
                    }
                    if h.payload == 0 {
                        r.done.complete(Ok(*status));
                        return Ok(None);
                    }
                }
                Ok(Some(target))
            }
            FrameKind::TagCts | FrameKind::TagAck => {
                let read_cost = self.read_cost;
                let p = self.peer(peer);
                let s = p
                    .awaiting
                    .remove(&env.seq)
                    .ok_or_else(|| protocol("an answer for no message"))?;
                let status = Status {
                    source: peer,
                    tag: s.msg.tag,
                    count: s.msg.count,
                };
                if let (Some(cost), Some(at)) = (&read_cost, s.chosen_at) {
                    // How its copy went (a TagCts: not at all).
                    let read_ns = if h.kind == FrameKind::TagAck {
                        env.count
                    } else {
                        0
                    };
                    let (addr, len) = (s.msg.buf.addr(), s.msg.buf.len());
                    let waited = at.elapsed().as_nanos() as u64;
                    p.choices.heard(addr, len, read_ns, waited, cost);
                }
                if h.kind == FrameKind::TagAck {
                    // The receiver copied it from here (in `count` ns):
                    // done.
                    s.done.complete(Ok(status));
                    return Ok(None);
                }
                let head = Header::tagged(
                    FrameKind::TagData,
                    env.seq,
                    s.msg.tag,
                    s.msg.count as u64,
                    s.msg.dtype,
                    s.msg.buf.len() as u64,
                );
                let mut f = OutFrame::new(head, &[], s.msg.buf, Some((s.done, status)), s.id);
                f.kept = s.kept;
                p.out.push_back(f);
                Ok(None)
            }
            _ => Err(protocol("a frame of another context")),
        }
    }

    /// A tagged frame's payload arrived whole (read into `sink`).
    pub fn on_payload(&mut self, peer: usize, sink: Sink, descriptor: &[u8], pid: Option<i32>) {
        match sink {
            Sink::Receive(r, status) => r.done.complete(Ok(status)),
            Sink::Keep(env, payload) => self.arrive(env, Some(payload), None),
            Sink::Drop => {}
            Sink::Descriptor(env) => {
                let word = |at: usize| {
                    u64::from_le_bytes(descriptor[at..at + 8].try_into().expect("8 bytes"))
                };
                let _ = peer;
                self.on_remote(env, pid.unwrap_or(0), word(0), word(16));
            }
        }
    }

    /// A whole small message lent by the connection (shared memory): its
    /// receive takes it, or it is kept.
    pub fn on_whole(&mut self, peer: usize, h: &Header, payload: &[u8]) -> Result<()> {
        let sink = self.on_header(peer, h, None)?;
        match sink {
            None => {}
            Some(Sink::Receive(r, status)) => {
                // SAFETY: as in `Sink::buffer`; fit checked the size.
                crate::copy::copy(unsafe { &mut r.buf.bytes_mut()[..payload.len()] }, payload);
                r.done.complete(Ok(status));
            }
            Some(Sink::Keep(env, mut v)) => {
                crate::copy::copy(&mut v, payload);
                self.arrive(env, Some(v), None);
            }
            Some(_) => {}
        }
        Ok(())
    }

    /// A same-host message: copied straight from the sender's memory into
    /// its receive, or (none posted yet) left there for a while, for the
    /// receive to come (`REMOTE_PATIENCE`); the sender hears TagAck. When
    /// the copy is refused, the receiver asks for the payload over the
    /// connection instead (TagCts), as for any large message.
    fn on_remote(&mut self, env: Envelope, pid: i32, addr: u64, withdrawn: u64) {
        let remote = Remote {
            pid,
            addr,
            withdrawn,
            since: Instant::now(),
        };
        match self.matching.claim(&env) {
            Some(r) => self.deliver(
                r,
                Arrival {
                    env,
                    payload: None,
                    remote: Some(remote),
                },
            ),
            None => self.arrive(env, None, Some(remote)),
        }
    }

    /// Copies out the single-copy messages nobody has asked for within
    /// `REMOTE_PATIENCE` (or that cannot be kept: beyond the limit they are
    /// asked for over the connection when their receive comes), releasing
    /// their senders.
    #[inline]
    pub fn release_waiting_senders(&mut self) {
        if self.matching.remote_waiting > 0 {
            self.release_senders();
        }
    }

    fn release_senders(&mut self) {
        let now = Instant::now();
        let mut answers = Vec::new();
        let mut gone = Vec::new();
        for (i, a) in self.matching.unexpected.iter_mut().enumerate() {
            let Some(remote) = a.remote else { continue };
            if now.duration_since(remote.since) < REMOTE_PATIENCE {
                continue;
            }
            a.remote = None;
            self.matching.remote_waiting -= 1;
            // Within the limit, and where the memory is there: else kept
            // as an envelope, whose receive asks for the payload.
            let len = a.env.count as usize * a.env.dtype.size();
            if self.matching.unexpected_bytes + len > UNEXPECTED_LIMIT {
                continue;
            }
            let mut kept: Vec<u8> = Vec::new();
            if kept.try_reserve_exact(len).is_err() {
                continue;
            }
            kept.resize(len, 0);
            if read_remote(remote.pid, remote.addr, &mut kept).is_err() {
                continue;
            }
            answers.push((a.env, FrameKind::TagAck));
            if withdrawn(&remote, a.env.seq) {
                // Its sender gave up on it: it was never sent.
                gone.push(i);
                continue;
            }
            self.matching.unexpected_bytes += len;
            a.payload = Some(kept);
        }
        for i in gone.into_iter().rev() {
            self.matching.unexpected.remove(i);
        }
        for (env, kind) in answers {
            self.answer(env, kind);
        }
    }

    /// Queues an answer (TagAck, TagCts) to the sender of `env`.
    fn answer(&mut self, env: Envelope, kind: FrameKind) {
        self.answer_counting(env, kind, 0);
    }

    /// The TagAck of a single-copy message that its receive copied in
    /// `read_ns` (the sender's `choices` weigh it).
    fn answer_copied(&mut self, env: Envelope, read_ns: u64) {
        self.answer_counting(env, FrameKind::TagAck, read_ns);
    }

    /// An answer whose `count` carries `count` (a TagAck's copy time in
    /// ns, 0: not timed).
    fn answer_counting(&mut self, env: Envelope, kind: FrameKind, count: u64) {
        let h = Header::tagged(kind, env.seq, 0, count, DType::Uint8, 0);
        self.peer(env.source)
            .push_answer(OutFrame::new(h, &[], RawBuf::EMPTY, None, 0));
    }

    fn arrive(&mut self, env: Envelope, payload: Option<Vec<u8>>, remote: Option<Remote>) {
        let a = Arrival {
            env,
            payload,
            remote,
        };
        if let Some((r, a)) = self.matching.arrive(a) {
            self.deliver(r, a);
        }
    }

    /// A receive met its message: copy an eager payload, or ask for the
    /// rest; a message that does not fit fails the receive (and is
    /// consumed all the same).
    fn deliver(&mut self, r: PostedRecv, a: Arrival) {
        let env = a.env;
        let target = fit(r, &env, self.rank);
        match (a.payload, a.remote, target) {
            (Some(bytes), _, Sink::Receive(r, status)) => {
                // SAFETY: the receive's buffer is valid until it completes,
                // and holds at least the message (checked above).
                crate::copy::copy(unsafe { &mut r.buf.bytes_mut()[..bytes.len()] }, &bytes);
                r.done.complete(Ok(status));
            }
            (Some(_), _, _) => {}
            (None, Some(remote), Sink::Receive(r, status)) => {
                // One copy, straight from the sender's memory.
                let len = env.count as usize * env.dtype.size();
                // SAFETY: as above.
                let dst = unsafe { &mut r.buf.bytes_mut()[..len] };
                let start = Instant::now();
                // With the sender's word saying what it withdrew, read
                // after the bytes (see `withdrawn`).
                let read = read_remote_then_word(remote.pid, remote.addr, dst, remote.withdrawn);
                if let Ok(word) = read {
                    let read_ns = start.elapsed().as_nanos().max(1) as u64;
                    r.done.complete(match word.is_none_or(|w| w > env.seq) {
                        false => Ok(status),
                        true => Err(withdrawn_while_copied(env.source, self.rank)),
                    });
                    self.answer_copied(env, read_ns);
                } else {
                    self.peer(env.source)
                        .receiving
                        .insert(env.seq, Sink::Receive(r, status));
                    self.answer(env, FrameKind::TagCts);
                }
            }
            // A misfit: consumed all the same, its sender released.
            (None, Some(_), _) => self.answer(env, FrameKind::TagAck),
            (None, None, target) if env.source == self.rank => drop(target),
            (None, None, target) => {
                self.peer(env.source).receiving.insert(env.seq, target);
                self.answer(env, FrameKind::TagCts);
            }
        }
    }

    /// Makes a call that gave up never touch its buffer again. A send
    /// framed already keeps its place (see the module's comment): its
    /// payload is copied out first, or, single copy, it is marked
    /// withdrawn for its receiver. Returns the peer whose pair must fail
    /// instead: there was no memory for the copy. `reading` turns a
    /// receive whose payload the core is reading right now into a drop
    /// (true when it was that).
    pub fn withdraw(&mut self, id: u64, reading: &mut dyn FnMut(u64) -> bool) -> Option<usize> {
        if self.matching.cancel(id).is_some() || reading(id) {
            return None;
        }
        for i in 0..self.used.len() {
            let peer = self.used[i];
            let p = self.peers[peer].as_deref_mut().expect("used");
            if let Some(k) = p.queued.iter().position(|s| s.id == id) {
                p.queued.remove(k);
                return None;
            }
            if let Some(k) = p.copies.iter().position(|(r, _)| r.id == id) {
                // Matched already: its message is consumed, its sender
                // released (as a matched receive's payload is dropped).
                let (_, a) = p.copies.remove(k).expect("found");
                self.copies -= 1;
                self.answer(a.env, FrameKind::TagAck);
                return None;
            }
            for t in p.receiving.values_mut() {
                if t.is_receive(id) {
                    *t = Sink::Drop;
                    return None;
                }
            }
            let mut found = false;
            for f in p.out.iter_mut().filter(|f| f.id == id) {
                found = true;
                f.done = None;
                if !f.payload.is_empty() && f.kept.is_none() {
                    let Some((buf, kept)) = keep(f.payload) else {
                        return Some(peer);
                    };
                    (f.payload, f.kept) = (buf, Some(kept));
                }
            }
            for (seq, s) in p.awaiting.iter_mut().filter(|(_, s)| s.id == id) {
                found = true;
                if s.remote {
                    p.withdrawn.fetch_max(seq + 1, Ordering::SeqCst);
                }
                if s.kept.is_none() {
                    // Its receiver asks for the payload later (a
                    // single-copy one too, when its copy failed or was
                    // given up: TagCts), from here, never from the
                    // caller's buffer again.
                    let Some((buf, kept)) = keep(s.msg.buf) else {
                        return Some(peer);
                    };
                    (s.msg.buf, s.kept) = (buf, Some(kept));
                }
            }
            if found {
                return None;
            }
        }
        None
    }

    /// Every call with `peer` fails with `err` (its connection is gone):
    /// messages it sent that already arrived stay receivable.
    pub fn fail_peer(&mut self, peer: usize, err: Error) {
        let p = self.peer(peer);
        if p.gone.is_none() {
            p.gone = Some(err.clone());
        }
        p.written = 0;
        for s in p.queued.drain(..) {
            s.done.complete(Err(err.clone()));
        }
        for f in p.out.drain(..) {
            if let Some((done, _)) = f.done {
                done.complete(Err(err.clone()));
            }
        }
        for (_, s) in p.awaiting.drain() {
            s.done.complete(Err(err.clone()));
        }
        for (_, t) in p.receiving.drain() {
            if let Sink::Receive(r, _) = t {
                r.done.complete(Err(err.clone()));
            }
        }
        let copies: Vec<_> = p.copies.drain(..).collect();
        self.copies -= copies.len();
        for (r, _) in copies {
            r.done.complete(Err(err.clone()));
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
        // Its messages not here whole (still in its memory, or waiting to
        // be asked for) are lost with it.
        let m = &mut self.matching;
        let remote_lost = (m.unexpected.iter())
            .filter(|a| a.env.source == peer && a.remote.is_some())
            .count();
        m.unexpected
            .retain(|a| !(a.env.source == peer && a.payload.is_none()));
        m.remote_waiting -= remote_lost;
    }

    /// Every pending and future call fails with `err`.
    pub fn fail_all(&mut self, err: Error) {
        if self.failed.is_none() {
            self.failed = Some(err.clone());
        }
        for i in 0..self.used.len() {
            self.fail_peer(self.used[i], err.clone());
        }
        for r in self.matching.posted.drain(..) {
            r.done.complete(Err(err.clone()));
        }
    }

    /// Whether a send to any peer is still in flight.
    pub fn sends_in_flight(&self) -> bool {
        self.used.iter().any(|&p| self.sends_in_flight_to(p))
    }

    /// The other ranks not known to be gone.
    pub fn others_not_gone(&self) -> Vec<usize> {
        (0..self.peers.len())
            .filter(|&q| q != self.rank && self.peer_ref(q).is_none_or(|p| p.gone.is_none()))
            .collect()
    }

    /// The peers that sends in flight still go to.
    pub fn send_peers(&self) -> Vec<usize> {
        (self.used.iter().copied())
            .filter(|&p| self.sends_in_flight_to(p))
            .collect()
    }

    fn sends_in_flight_to(&self, p: usize) -> bool {
        self.peer_ref(p).is_some_and(|q| {
            q.gone.is_none()
                && (!q.queued.is_empty() || !q.out.is_empty() || !q.awaiting.is_empty())
        })
    }

    /// The calls pending on this rank, described.
    pub fn pending(&self) -> Vec<String> {
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
        for &peer in &self.used {
            let Some(p) = self.peer_ref(peer) else {
                continue;
            };
            let framed = p.out.iter().filter(|f| f.done.is_some()).count();
            let queued = p.queued.len() + p.awaiting.len();
            for s in p.queued.iter().chain(p.awaiting.values()) {
                v.push(format!(
                    "send to rank {peer} (tag {}, {} x {}): not received yet",
                    s.msg.tag, s.msg.count, s.msg.dtype
                ));
            }
            if framed > 0 && queued == 0 {
                v.push(format!(
                    "{framed} send(s) to rank {peer}: not written yet (its connection is full)"
                ));
            }
            let receiving = p
                .receiving
                .values()
                .filter(|t| matches!(t, Sink::Receive(..)))
                .count();
            if receiving > 0 {
                v.push(format!(
                    "{receiving} receive(s) from rank {peer}: matched, payload still arriving"
                ));
            }
            if !p.copies.is_empty() {
                v.push(format!(
                    "{} receive(s) from rank {peer}: matched, to be copied from its memory",
                    p.copies.len()
                ));
            }
        }
        v
    }
}

/// Where a message's payload goes: its receive when it fits there;
/// nowhere when it does not (the receive then fails, naming both sides).
/// The frame of eager send `msg`, number `seq` to its peer.
fn eager_header(msg: &Outgoing, seq: u64) -> Header {
    Header::tagged(
        FrameKind::TagEager,
        seq,
        msg.tag,
        msg.count as u64,
        msg.dtype,
        msg.buf.len() as u64,
    )
}

fn fit(r: PostedRecv, env: &Envelope, me: usize) -> Sink {
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
            Sink::Drop
        }
        None => Sink::Receive(r, status),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv_call() -> Described {
        Described::Recv(Incoming {
            buf: RawBuf::EMPTY,
            dtype: DType::Uint8,
            count: 0,
            peer: Some(1),
            tag: Some(0),
            exact: true,
        })
    }

    #[test]
    fn a_done_kept_for_the_next_call_comes_back_empty() {
        let first = Ticket::new(1, recv_call());
        let kept = Arc::as_ptr(&first.done);
        first
            .done
            .complete(Err(Error::invalid_usage("the first call's result")));
        assert!(first.done.is_finished());
        drop(first);
        // The same Done, reused on this thread, with no result in it.
        let second = Ticket::new(2, recv_call());
        assert_eq!(Arc::as_ptr(&second.done), kept);
        assert!(!second.done.is_finished() && second.done.get().is_none());
        second.done.complete(Ok(Status {
            source: 1,
            tag: 0,
            count: 0,
        }));
        assert!(matches!(second.done.get(), Some(Ok(s)) if s.source == 1));
        // One still held elsewhere (a posted receive's clone) is not kept.
        let third = Ticket::new(3, recv_call());
        let held = Arc::clone(&third.done);
        drop(third);
        let fourth = Ticket::new(4, recv_call());
        assert!(!Arc::ptr_eq(&fourth.done, &held));
        // The first result stays, a later one is ignored.
        held.complete(Ok(Status {
            source: 2,
            tag: 0,
            count: 0,
        }));
        held.complete(Err(Error::invalid_usage("late")));
        assert!(matches!(held.get(), Some(Ok(s)) if s.source == 2));
    }

    #[test]
    fn a_sleeper_wakes_when_its_result_comes() {
        let done = Arc::new(Done::default());
        let other = done.clone();
        let t = std::thread::spawn(move || {
            other.sleep_until(Instant::now() + std::time::Duration::from_secs(10))
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        let started = Instant::now();
        done.complete(Ok(Status {
            source: 0,
            tag: 7,
            count: 1,
        }));
        let got = t.join().unwrap();
        assert!(matches!(got, Some(Ok(s)) if s.tag == 7));
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }
}
