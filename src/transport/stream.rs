//! The stream transport: one non-blocking channel per peer (TCP, or
//! shared-memory rings) carrying framed messages, and a progress loop run
//! by the calling thread. Every exchange also drains frames arriving early
//! from any peer (into a per-peer inbox), so that symmetric sends never
//! deadlock and a failure report from any rank, or a dead connection, is
//! noticed while waiting for something else.
//!
//! Waiting: over TCP, poll(); over shared memory, spinning (yielding the
//! core between checks) for up to `spin` before sleeping in poll() on the
//! sockets with short, growing timeouts.

use super::channel::Channel;
use super::frame::{self, FrameKind, Header, HEADER_BYTES, MAX_PAD, PAD_MIN_PAYLOAD, REMOTE_BYTES};
use super::shm::Doorbell;
use super::signal::AbortSignal;
use super::{Dir, Transport, Xfer};
use crate::error::{describe_io, Error, ErrorKind, Result};
use crate::op::{Desc, OpKind};
use crate::reduce;
use std::collections::VecDeque;
use std::io;
use std::net::Shutdown;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long failure reports and goodbyes may take per peer: they are best
/// effort and must never hold up an error.
const NOTIFY_BUDGET: Duration = Duration::from_millis(200);

pub struct StreamTransport {
    rank: usize,
    size: usize,
    conns: Vec<Option<Conn>>,
    signal: Arc<AbortSignal>,
    timeout: Duration,
    /// How long to spin before sleeping (zero: sleep in poll() at once).
    spin: Duration,
    /// What this rank sleeps on when its peers are in shared memory.
    doorbell: Option<Doorbell>,
    /// Yield the core between spins (when ranks outnumber cores).
    yield_when_idle: bool,
    /// Payloads at least this large travel single-copy where the channel
    /// allows (the receiver reads the sender's memory); usize::MAX: never.
    single_copy_min: usize,
    /// How long a collective's exchange stalls before it reads ahead
    /// (`READ_AHEAD_AFTER`; tests change it).
    read_ahead_after: Duration,
    /// Counts reads and writes that moved bytes (progress detection).
    moved: u64,
    /// Bookkeeping of the exchange in progress (reused).
    progress: Progress,
    /// Set by the first error; every later exchange fails with it.
    failed: Option<Error>,
    /// Whether the peers were told about `failed`.
    notified: bool,
}

/// Why a peer can no longer be reached.
#[derive(Clone, Debug)]
enum Gone {
    /// It destroyed its communicator cleanly.
    Bye,
    /// Its connection broke (the process exited or crashed).
    Lost(String),
}

struct Conn {
    chan: Box<dyn Channel>,
    inbox: VecDeque<(Header, Vec<u8>)>,
    incoming: Incoming,
    /// Bytes still to write of a frame whose writing was interrupted.
    unfinished_out: usize,
    /// Where receive-and-reduce transfers stage incoming bytes, and how
    /// many staged bytes are not yet combined (a partial element).
    stage: Vec<u8>,
    staged: usize,
    /// Acknowledgements of single-copy payloads, waiting to be written
    /// (whole frames; written between data frames).
    acks_out: Vec<u8>,
    gone: Option<Gone>,
    connected_at: Instant,
}

enum Incoming {
    Header {
        buf: [u8; HEADER_BYTES],
        got: usize,
    },
    Payload {
        header: Header,
        into: Target,
        /// Padding still to skip before the payload.
        skip: usize,
        got: usize,
    },
}

enum Target {
    /// Straight into the buffer of transfer `i` of the current exchange.
    Posted(usize),
    /// Into the inbox (nobody asked for it yet).
    Early(Vec<u8>),
    /// A control frame's payload.
    Control(Vec<u8>),
    /// A single-copy descriptor: [address, length] in the sender's memory.
    Descriptor([u8; REMOTE_BYTES]),
}

/// Slice size for receive-and-reduce (fits in L2, a multiple of every
/// element size).
const STAGE_BYTES: usize = 128 << 10;

/// Completes a receive from a whole payload that arrived early.
fn deliver(dir: &mut Dir<'_>, payload: &[u8]) {
    match dir {
        Dir::Recv(buf) => crate::copy::copy(buf, payload),
        Dir::RecvReduce(buf, dtype, op) => reduce::reduce_into(buf, payload, *dtype, *op),
        Dir::Send(_) => unreachable!("receive queue holds receives"),
    }
}

/// A frame's header and the padding that follows it.
#[derive(Clone, Copy)]
struct Prefix {
    bytes: [u8; HEADER_BYTES + MAX_PAD],
    len: usize,
}

impl Prefix {
    const EMPTY: Prefix = Prefix {
        bytes: [0; HEADER_BYTES + MAX_PAD],
        len: 0,
    };

    fn new(header: &Header) -> Prefix {
        let mut p = Prefix::EMPTY;
        p.bytes[..HEADER_BYTES].copy_from_slice(&header.encode());
        p.len = HEADER_BYTES + header.pad as usize;
        p
    }

    fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// How long a collective's exchange goes without progress before it reads
/// frames that belong to later calls. Until then it leaves them in the
/// socket: a frame read early costs an allocation and a second copy, and a
/// pipelined chain whose middle ranks read ahead moved most of a 64 MiB
/// broadcast through their inboxes. Matched exchanges (every send meets a
/// receive in the peer's same call) never need to read ahead to finish;
/// after the stall it is read all the same, so a program whose calls do not
/// match up (or a peer's failure report behind data) still gets through.
const READ_AHEAD_AFTER: Duration = Duration::from_millis(1);

/// Per-exchange bookkeeping.
#[derive(Default)]
struct Progress {
    /// Transfers not yet complete.
    remaining: usize,
    /// Per peer: indices of its receives/sends not yet complete, in order.
    recvs: Vec<VecDeque<usize>>,
    sends: Vec<VecDeque<usize>>,
    /// Per peer: single-copy sends written and waiting for the receiver's ack.
    acked: Vec<VecDeque<usize>>,
    /// Per transfer: the single-copy descriptor, when it travels that way.
    remote: Vec<Option<[u8; REMOTE_BYTES]>>,
    /// Per transfer: bytes written so far (header included) and its header
    /// with any padding.
    written: Vec<usize>,
    prefixes: Vec<Prefix>,
    /// The operation this exchange belongs to (for messages).
    desc: Option<Desc>,
    /// Read frames that no receive of this exchange asked for (into the
    /// inbox): at once for point-to-point calls, else only once the
    /// exchange has stalled (see `READ_AHEAD_AFTER`).
    read_ahead: bool,
}

impl Progress {
    /// Whether a new frame from `peer` may be read now: one this exchange
    /// waits for (a receive, or the ack of a single-copy send), or any
    /// frame once reading ahead is allowed.
    fn reads_from(&self, peer: usize) -> bool {
        self.read_ahead || !self.recvs[peer].is_empty() || !self.acked[peer].is_empty()
    }
}

/// How a transport waits and moves bytes.
pub struct Tuning {
    /// Bound on every wait.
    pub timeout: Duration,
    /// How long to busy-wait before sleeping (zero: sleep in poll() at once).
    pub spin: Duration,
    /// Yield the core between spins (when ranks outnumber cores).
    pub yield_when_idle: bool,
    /// Payloads from this size travel single-copy where the channel allows;
    /// usize::MAX: never.
    pub single_copy_min: usize,
}

impl StreamTransport {
    /// Takes over connected channels (index = peer rank; `None` for this
    /// rank).
    pub fn new(
        rank: usize,
        channels: Vec<Option<Box<dyn Channel>>>,
        doorbell: Option<Doorbell>,
        signal: Arc<AbortSignal>,
        tuning: Tuning,
    ) -> StreamTransport {
        let Tuning {
            timeout,
            spin,
            yield_when_idle,
            single_copy_min,
        } = tuning;
        let size = channels.len();
        let conns = channels
            .into_iter()
            .map(|c| {
                c.map(|chan| Conn {
                    chan,
                    inbox: VecDeque::new(),
                    incoming: Incoming::Header {
                        buf: [0; HEADER_BYTES],
                        got: 0,
                    },
                    unfinished_out: 0,
                    stage: Vec::new(),
                    staged: 0,
                    acks_out: Vec::new(),
                    gone: None,
                    connected_at: Instant::now(),
                })
            })
            .collect();
        StreamTransport {
            rank,
            size,
            conns,
            signal,
            timeout,
            spin,
            doorbell,
            yield_when_idle,
            single_copy_min,
            read_ahead_after: READ_AHEAD_AFTER,
            moved: 0,
            progress: Progress::default(),
            failed: None,
            notified: false,
        }
    }

    /// The error this transport failed with, if any.
    pub fn failure(&self) -> Option<&Error> {
        self.failed.as_ref()
    }

    /// Marks the transport failed with `err` and tells every reachable peer
    /// (unless the error came from a peer's own report). Returns `err`.
    pub fn fail(&mut self, err: Error, tell_peers: bool) -> Error {
        if self.failed.is_none() {
            self.failed = Some(err.clone());
        }
        if tell_peers && !self.notified {
            self.notified = true;
            let report = match err.kind() {
                ErrorKind::Aborted => format!("rank {} aborted the communicator", self.rank),
                _ => format!("rank {} failed: {}", self.rank, err.message()),
            };
            let payload = frame::encode_failure(&Error::new(err.kind(), report));
            let header = Header::control(FrameKind::Failure, payload.len()).encode();
            for conn in self.conns.iter_mut().flatten() {
                if conn.gone.is_none() {
                    conn.send_control(&header, &payload);
                }
            }
        }
        err
    }

    /// Goodbye: tells peers this rank is leaving (cleanly, or after which
    /// error), lets the kernel deliver what was already sent, and closes
    /// every connection.
    pub fn close(&mut self) {
        let (header, payload) = match &self.failed {
            None => (Header::control(FrameKind::Bye, 0).encode(), Vec::new()),
            Some(e) => {
                // Peers still waiting learn why, not just that the line went dead.
                let report = Error::new(
                    e.kind(),
                    format!("rank {} left after an error: {}", self.rank, e.message()),
                );
                let payload = frame::encode_failure(&report);
                (
                    Header::control(FrameKind::Failure, payload.len()).encode(),
                    payload,
                )
            }
        };
        for conn in self.conns.iter_mut().flatten() {
            if conn.gone.is_none() {
                conn.send_control(&header, &payload);
            }
            conn.chan.shutdown(Shutdown::Write);
            conn.drain();
        }
        self.conns.clear();
    }

    fn conn(&mut self, peer: usize) -> &mut Conn {
        self.conns[peer]
            .as_mut()
            .expect("exchange validated that peer is not this rank")
    }

    fn check_xfers(&self, xfers: &[Xfer<'_>]) -> Result<()> {
        for x in xfers {
            if x.peer >= self.size || x.peer == self.rank {
                return Err(Error::internal(format!(
                    "transfer with invalid peer {} on rank {} of {}",
                    x.peer, self.rank, self.size
                )));
            }
        }
        Ok(())
    }

    /// Resets the bookkeeping (kept between exchanges, so small messages
    /// don't pay for allocations) and posts every transfer.
    fn start(&mut self, xfers: &mut [Xfer<'_>], p: &mut Progress) -> Result<()> {
        p.remaining = xfers.len();
        for queues in [&mut p.recvs, &mut p.sends, &mut p.acked] {
            queues.resize_with(self.size, VecDeque::new);
            queues.iter_mut().for_each(VecDeque::clear);
        }
        p.remote.clear();
        p.remote.resize(xfers.len(), None);
        p.written.clear();
        p.written.resize(xfers.len(), 0);
        p.prefixes.clear();
        p.prefixes.resize(xfers.len(), Prefix::EMPTY);
        p.desc = xfers.first().map(|x| x.desc);
        // Point-to-point sends may all go before any receive (both ranks
        // send first): their frames must be taken in as they come.
        p.read_ahead = xfers.iter().any(|x| x.desc.kind == OpKind::Send);
        for (i, x) in xfers.iter().enumerate() {
            match &x.dir {
                Dir::Send(data) => {
                    let single_copy = data.len() >= self.single_copy_min
                        && self.conns[x.peer]
                            .as_ref()
                            .is_some_and(|c| c.chan.peer_pid().is_some());
                    if single_copy {
                        let mut d = [0u8; REMOTE_BYTES];
                        d[..8].copy_from_slice(&(data.as_ptr() as u64).to_le_bytes());
                        d[8..].copy_from_slice(&(data.len() as u64).to_le_bytes());
                        p.remote[i] = Some(d);
                        let mut h = Header::data(x.desc, REMOTE_BYTES);
                        h.kind = FrameKind::Remote;
                        p.prefixes[i] = Prefix::new(&h);
                    } else {
                        let mut h = Header::data(x.desc, data.len());
                        if data.len() >= PAD_MIN_PAYLOAD
                            && self.conns[x.peer]
                                .as_ref()
                                .is_some_and(|c| c.chan.copies_through_kernel())
                        {
                            h.pad = frame::pad_for(data.as_ptr() as usize) as u16;
                        }
                        p.prefixes[i] = Prefix::new(&h);
                    }
                    p.sends[x.peer].push_back(i);
                }
                Dir::Recv(_) | Dir::RecvReduce(..) => p.recvs[x.peer].push_back(i),
            }
        }
        // Frames that arrived early satisfy receives first, in order.
        for peer in 0..self.size {
            if self.conns[peer].is_some() {
                self.match_inbox(peer, xfers, p)?;
            }
        }
        Ok(())
    }

    /// Hands frames that arrived early to the receives waiting for them.
    fn match_inbox(&mut self, peer: usize, xfers: &mut [Xfer<'_>], p: &mut Progress) -> Result<()> {
        while let Some(&i) = p.recvs[peer].front() {
            let Some((header, payload)) = self.conn(peer).inbox.pop_front() else {
                break;
            };
            if header.kind == FrameKind::Remote {
                let d = payload.try_into().expect("a deferred descriptor");
                self.read_remote_into(peer, &header, d, i, xfers)?;
                self.acknowledge(peer, p)?;
            } else {
                self.accept_header(peer, &header, i, xfers)?;
                deliver(&mut xfers[i].dir, &payload);
            }
            p.recvs[peer].pop_front();
            p.remaining -= 1;
        }
        Ok(())
    }

    /// Checks an arriving frame against the receive it is matched with.
    fn accept_header(
        &self,
        peer: usize,
        header: &Header,
        i: usize,
        xfers: &[Xfer<'_>],
    ) -> Result<()> {
        self.accept(peer, header, header.payload, i, xfers)
    }

    /// Checks a frame's label and payload length (`len`) against receive `i`.
    fn accept(
        &self,
        peer: usize,
        header: &Header,
        len: u64,
        i: usize,
        xfers: &[Xfer<'_>],
    ) -> Result<()> {
        let mine = &xfers[i].desc;
        if header.desc != *mine {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "mismatched calls: rank {} called {} but rank {} called {}",
                    self.rank, mine, peer, header.desc
                ),
            ));
        }
        let want = match &xfers[i].dir {
            Dir::Recv(buf) | Dir::RecvReduce(buf, ..) => buf.len() as u64,
            Dir::Send(_) => 0,
        };
        if len != want {
            return Err(Error::internal(format!(
                "rank {peer} sent {len} bytes for {mine}, rank {} expected {want}",
                self.rank
            )));
        }
        Ok(())
    }

    /// Writes as much as the socket takes of the sends queued for `peer`.
    fn pump_sends(&mut self, peer: usize, xfers: &[Xfer<'_>], p: &mut Progress) -> Result<()> {
        while let Some(&i) = p.sends[peer].front() {
            // Acknowledgements go out between data frames.
            if p.written[i] == 0 && !self.flush_acks(peer, p)? {
                return Ok(());
            }
            let Dir::Send(data) = &xfers[i].dir else {
                unreachable!("send queue holds sends")
            };
            let data: &[u8] = match &p.remote[i] {
                Some(d) => d,
                None => data,
            };
            let prefix = p.prefixes[i].as_slice();
            let total = prefix.len() + data.len();
            let conn = self.conns[peer].as_mut().expect("peer is not this rank");
            while p.written[i] < total {
                match write_frame_part(&mut *conn.chan, prefix, data, p.written[i]) {
                    Ok(n) => {
                        p.written[i] += n;
                        self.moved = self.moved.wrapping_add(1);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        conn.unfinished_out = total - p.written[i];
                        return Ok(());
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        conn.unfinished_out = total - p.written[i];
                        let why = describe_io(&e);
                        conn.gone = Some(Gone::Lost(why.clone()));
                        return Err(self.lost(peer, &why, p.desc));
                    }
                }
            }
            conn.unfinished_out = 0;
            p.sends[peer].pop_front();
            if p.remote[i].is_some() {
                // Complete once the receiver has copied it out of our memory.
                p.acked[peer].push_back(i);
            } else {
                p.remaining -= 1;
            }
        }
        self.flush_acks(peer, p)?;
        Ok(())
    }

    /// Writes pending acknowledgements (only between data frames). True
    /// when none are left.
    fn flush_acks(&mut self, peer: usize, p: &Progress) -> Result<bool> {
        let conn = self.conns[peer].as_mut().expect("peer is not this rank");
        if conn.acks_out.is_empty() {
            return Ok(true);
        }
        // Queued acks are whole frames unless one was cut short; a cut-short
        // data frame must be finished first.
        let mid_ack = !conn.acks_out.len().is_multiple_of(HEADER_BYTES);
        if conn.unfinished_out > 0 && !mid_ack {
            return Ok(false);
        }
        while !conn.acks_out.is_empty() {
            match conn.chan.write2(&[], &conn.acks_out) {
                Ok(n) => {
                    conn.acks_out.drain(..n);
                    self.moved = self.moved.wrapping_add(1);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // A partly written ack is a frame in progress too.
                    conn.unfinished_out = conn.acks_out.len() % HEADER_BYTES;
                    return Ok(false);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let why = describe_io(&e);
                    conn.gone = Some(Gone::Lost(why.clone()));
                    return Err(self.lost(peer, &why, p.desc));
                }
            }
        }
        conn.unfinished_out = 0;
        Ok(true)
    }

    /// Reads everything `peer` has sent so far, completing posted receives
    /// and keeping early frames in its inbox.
    fn pump_reads(&mut self, peer: usize, xfers: &mut [Xfer<'_>], p: &mut Progress) -> Result<()> {
        loop {
            let conn = self.conns[peer].as_mut().expect("peer is not this rank");
            if conn.gone.is_some() {
                return Ok(());
            }
            // Between frames, with this exchange complete, leave the next
            // frames where they are: the next call reads them straight into
            // its buffers, instead of into the inbox now and copied later.
            let between_frames = conn.between_frames();
            if between_frames && (p.remaining == 0 || !p.reads_from(peer)) {
                return Ok(());
            }
            // The next frame for the posted receive, whole in one record
            // (small messages over shared memory): no header/payload steps.
            if let (true, Some(&i)) = (between_frames, p.recvs[peer].front()) {
                if conn.inbox.is_empty() && read_whole(&mut *conn.chan, &mut xfers[i]) {
                    self.moved = self.moved.wrapping_add(1);
                    p.recvs[peer].pop_front();
                    p.remaining -= 1;
                    continue;
                }
            }
            // Receive-and-reduce on a channel that can lend its bytes
            // (shared memory): combine straight out of the ring, no staging.
            if let Incoming::Payload {
                into: Target::Posted(i),
                skip: 0,
                got,
                header,
            } = &mut conn.incoming
            {
                if let (Dir::RecvReduce(buf, dtype, op), 0) = (&mut xfers[*i].dir, conn.staged) {
                    let (dtype, op) = (*dtype, *op);
                    let dst = &mut buf[*got..header.payload as usize];
                    let n = conn.chan.read_combine(dst, dtype.size(), &mut |d, s| {
                        reduce::reduce_into(d, s, dtype, op)
                    });
                    if n > 0 {
                        self.moved = self.moved.wrapping_add(1);
                        *got += n;
                        if *got as u64 == header.payload {
                            self.finish_frame(peer, xfers, p)?;
                        }
                        continue;
                    }
                }
            }
            let conn = self.conns[peer].as_mut().expect("peer is not this rank");
            let result = match &mut conn.incoming {
                Incoming::Header { buf, got } => conn.chan.read(&mut buf[*got..]),
                Incoming::Payload { skip, .. } if *skip > 0 => {
                    let mut padding = [0u8; MAX_PAD];
                    conn.chan.read(&mut padding[..*skip])
                }
                Incoming::Payload {
                    into, got, header, ..
                } => {
                    let dest: &mut [u8] = match into {
                        Target::Posted(i) => match &mut xfers[*i].dir {
                            Dir::Recv(buf) => &mut buf[*got..],
                            // Stage a slice, reduce it, repeat: the
                            // message never exists whole in a scratch buffer.
                            Dir::RecvReduce(..) => {
                                let want =
                                    (header.payload as usize - *got).min(STAGE_BYTES - conn.staged);
                                if conn.stage.len() < STAGE_BYTES {
                                    conn.stage.resize(STAGE_BYTES, 0);
                                }
                                &mut conn.stage[conn.staged..conn.staged + want]
                            }
                            Dir::Send(_) => unreachable!("posted target is a receive"),
                        },
                        Target::Early(v) | Target::Control(v) => &mut v[*got..],
                        Target::Descriptor(d) => &mut d[*got..],
                    };
                    conn.chan.read(dest)
                }
            };
            let n = match result {
                Ok(0) => {
                    let conn = self.conn(peer);
                    if conn.gone.is_none() {
                        conn.gone = Some(Gone::Lost("connection closed".into()));
                    }
                    return match conn.gone {
                        Some(Gone::Lost(_)) => Err(self.lost(peer, "connection closed", p.desc)),
                        _ => Ok(()),
                    };
                }
                Ok(n) => {
                    self.moved = self.moved.wrapping_add(1);
                    n
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let why = describe_io(&e);
                    self.conn(peer).gone = Some(Gone::Lost(why.clone()));
                    return Err(self.lost(peer, &why, p.desc));
                }
            };
            self.advance_incoming(peer, n, xfers, p)?;
        }
    }

    /// Accounts for `n` bytes read from `peer` and acts on completed parts.
    fn advance_incoming(
        &mut self,
        peer: usize,
        n: usize,
        xfers: &mut [Xfer<'_>],
        p: &mut Progress,
    ) -> Result<()> {
        let conn = self.conn(peer);
        let header = match &mut conn.incoming {
            Incoming::Header { buf, got } => {
                *got += n;
                if *got < HEADER_BYTES {
                    return Ok(());
                }
                Header::decode(buf, peer)?
            }
            Incoming::Payload { skip, header, .. } if *skip > 0 => {
                *skip -= n;
                if *skip > 0 || header.payload > 0 {
                    return Ok(());
                }
                return self.finish_frame(peer, xfers, p);
            }
            Incoming::Payload {
                header, got, into, ..
            } => {
                *got += n;
                if let Target::Posted(i) = into {
                    if let Dir::RecvReduce(buf, dtype, op) = &mut xfers[*i].dir {
                        // Combine every whole element staged so far.
                        conn.staged += n;
                        let es = dtype.size();
                        let whole = conn.staged - conn.staged % es;
                        let at = *got - conn.staged;
                        reduce::reduce_into(
                            &mut buf[at..at + whole],
                            &conn.stage[..whole],
                            *dtype,
                            *op,
                        );
                        conn.stage.copy_within(whole..conn.staged, 0);
                        conn.staged -= whole;
                    }
                }
                if (*got as u64) < header.payload {
                    return Ok(());
                }
                return self.finish_frame(peer, xfers, p);
            }
        };
        // A new frame begins: decide where its payload goes.
        let into = match header.kind {
            FrameKind::Data => match p.recvs[peer].front() {
                Some(&i) => {
                    self.accept_header(peer, &header, i, xfers)?;
                    Target::Posted(i)
                }
                None => Target::Early(vec![0; header.payload as usize]),
            },
            FrameKind::Bye => {
                self.conn(peer).gone = Some(Gone::Bye);
                self.conn(peer).incoming = Incoming::Header {
                    buf: [0; HEADER_BYTES],
                    got: 0,
                };
                return Ok(());
            }
            FrameKind::Failure => Target::Control(vec![0; header.payload.min(1 << 16) as usize]),
            FrameKind::Remote if header.payload == REMOTE_BYTES as u64 => {
                Target::Descriptor([0; REMOTE_BYTES])
            }
            FrameKind::Remote => {
                return Err(Error::internal(format!(
                    "rank {peer} sent a malformed single-copy frame"
                )))
            }
            FrameKind::Ack => {
                self.conn(peer).incoming = Incoming::Header {
                    buf: [0; HEADER_BYTES],
                    got: 0,
                };
                let Some(_) = p.acked[peer].pop_front() else {
                    return Err(Error::internal(format!(
                        "rank {peer} acknowledged a transfer nobody sent"
                    )));
                };
                p.remaining -= 1;
                return Ok(());
            }
        };
        self.conn(peer).incoming = Incoming::Payload {
            header,
            into,
            skip: header.pad as usize,
            got: 0,
        };
        if header.payload == 0 && header.pad == 0 {
            return self.finish_frame(peer, xfers, p);
        }
        Ok(())
    }

    fn finish_frame(
        &mut self,
        peer: usize,
        xfers: &mut [Xfer<'_>],
        p: &mut Progress,
    ) -> Result<()> {
        let conn = self.conn(peer);
        let done = std::mem::replace(
            &mut conn.incoming,
            Incoming::Header {
                buf: [0; HEADER_BYTES],
                got: 0,
            },
        );
        let Incoming::Payload { header, into, .. } = done else {
            return Ok(());
        };
        match into {
            Target::Posted(_) => {
                p.recvs[peer].pop_front();
                p.remaining -= 1;
            }
            Target::Early(payload) => {
                // A receive may have been posted while this frame arrived.
                conn.inbox.push_back((header, payload));
                return self.match_inbox(peer, xfers, p);
            }
            Target::Descriptor(d) => return self.copy_remote(peer, header, d, xfers, p),
            Target::Control(payload) => {
                // The reporting rank tells everyone itself; don't echo it.
                self.notified = true;
                let (kind, text) = frame::decode_failure(&payload);
                // Say what this rank itself was waiting for: in a chain of
                // waits, the reporting rank names only its neighbour.
                let waiting = self.waiting_for(p);
                let waiting = match waiting.is_empty() {
                    true => String::new(),
                    false => format!(", waiting for {}", waiting.join(", ")),
                };
                let here = match p.desc {
                    Some(d) => format!(" (rank {} was in {d}{waiting})", self.rank),
                    None => String::new(),
                };
                return Err(Error::new(kind, format!("{text}{here}")));
            }
        }
        Ok(())
    }

    /// Handles a single-copy descriptor: copies the payload out of the
    /// sender's memory into the posted receive and acknowledges it. With no
    /// receive posted yet, a collective's descriptor waits in the inbox
    /// (every collective posts its receives, and the sender waits for the
    /// ack anyway, so copying it twice through a fresh buffer would only
    /// cost page faults and a memmove); a user send is copied out at once,
    /// so that send-then-recv on both sides still completes.
    fn copy_remote(
        &mut self,
        peer: usize,
        header: Header,
        d: [u8; REMOTE_BYTES],
        xfers: &mut [Xfer<'_>],
        p: &mut Progress,
    ) -> Result<()> {
        match p.recvs[peer].front() {
            Some(&i) => {
                self.read_remote_into(peer, &header, d, i, xfers)?;
                p.recvs[peer].pop_front();
                p.remaining -= 1;
            }
            None if header.desc.kind != OpKind::Send => {
                self.conn(peer).inbox.push_back((header, d.to_vec()));
                return Ok(());
            }
            None => {
                let (pid, addr, len) = self.remote_source(peer, d)?;
                let mut v = vec![0u8; len as usize];
                super::channel::read_remote(pid, addr, &mut v)
                    .map_err(|e| remote_failed(peer, len, &e))?;
                let mut h = header;
                h.kind = FrameKind::Data;
                h.payload = len;
                self.conn(peer).inbox.push_back((h, v));
            }
        }
        self.acknowledge(peer, p)
    }

    /// Queues (and tries to write) the ack that frees a single-copy send.
    fn acknowledge(&mut self, peer: usize, p: &Progress) -> Result<()> {
        let ack = Header::control(FrameKind::Ack, 0).encode();
        self.conn(peer).acks_out.extend_from_slice(&ack);
        self.flush_acks(peer, p)?;
        Ok(())
    }

    /// The sender's pid, and the address and length a descriptor names.
    fn remote_source(&mut self, peer: usize, d: [u8; REMOTE_BYTES]) -> Result<(i32, u64, u64)> {
        let addr = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(d[8..].try_into().expect("8 bytes"));
        let pid = self
            .conn(peer)
            .chan
            .peer_pid()
            .ok_or_else(|| Error::internal("single-copy frame on a channel without it"))?;
        Ok((pid, addr, len))
    }

    /// Copies the payload a descriptor names into receive `i` (combining
    /// it, for receive-and-reduce, in cache-sized slices).
    fn read_remote_into(
        &mut self,
        peer: usize,
        header: &Header,
        d: [u8; REMOTE_BYTES],
        i: usize,
        xfers: &mut [Xfer<'_>],
    ) -> Result<()> {
        let (pid, addr, len) = self.remote_source(peer, d)?;
        self.accept(peer, header, len, i, xfers)?;
        let fail = |e: io::Error| remote_failed(peer, len, &e);
        match &mut xfers[i].dir {
            Dir::Recv(buf) => super::channel::read_remote(pid, addr, buf).map_err(fail)?,
            Dir::RecvReduce(buf, dtype, op) => {
                // Cache-sized slices: copy one in, combine it, next.
                let conn = self.conns[peer].as_mut().expect("peer is not this rank");
                if conn.stage.len() < STAGE_BYTES {
                    conn.stage.resize(STAGE_BYTES, 0);
                }
                for (k, chunk) in buf.chunks_mut(STAGE_BYTES).enumerate() {
                    let stage = &mut conn.stage[..chunk.len()];
                    super::channel::read_remote(pid, addr + (k * STAGE_BYTES) as u64, stage)
                        .map_err(fail)?;
                    reduce::reduce_into(chunk, stage, *dtype, *op);
                }
            }
            Dir::Send(_) => unreachable!("receive queue holds receives"),
        }
        Ok(())
    }

    fn lost(&self, peer: usize, why: &str, desc: Option<Desc>) -> Error {
        let age = self.conns[peer]
            .as_ref()
            .map(|c| c.connected_at.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        let during = desc.map(|d| format!(" during {d}")).unwrap_or_default();
        Error::new(
            ErrorKind::PeerLost,
            format!(
                "rank {} lost its connection to rank {peer} ({why}: it exited or crashed){during}, {age:.1} s after connecting",
                self.rank
            ),
        )
    }

    /// A peer that left cleanly can't serve transfers still waiting for it.
    fn check_departed(&self, p: &Progress) -> Result<()> {
        for (peer, conn) in self.conns.iter().enumerate() {
            let Some(conn) = conn else { continue };
            if let Some(Gone::Bye) = conn.gone {
                if !p.recvs[peer].is_empty()
                    || !p.sends[peer].is_empty()
                    || !p.acked[peer].is_empty()
                {
                    let during = p.desc.map(|d| format!(" in {d}")).unwrap_or_default();
                    return Err(Error::new(
                        ErrorKind::PeerLost,
                        format!(
                            "rank {peer} destroyed its communicator while rank {} still needed it{during}",
                            self.rank
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// A peer whose connection has closed or failed, found without
    /// reading (poll with no wait), or None. For callers that are not
    /// inside an exchange (NCCL's watchdog): a closed connection there
    /// means the peer is gone, or left while work with it was in flight.
    pub fn closed_peer(&self) -> Option<usize> {
        let mut fds = Vec::new();
        let mut peers = Vec::new();
        for (peer, conn) in self.conns.iter().enumerate() {
            let Some(conn) = conn else { continue };
            if conn.gone.is_some() {
                return Some(peer);
            }
            fds.push(libc::pollfd {
                fd: conn.chan.fd(),
                events: libc::POLLRDHUP,
                revents: 0,
            });
            peers.push(peer);
        }
        // SAFETY: fds is a live, correctly sized array of pollfd.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
        if rc <= 0 {
            return None;
        }
        let closed = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
        fds.iter()
            .zip(peers)
            .find(|(f, _)| f.revents & closed != 0)
            .map(|(_, peer)| peer)
    }

    fn timeout_error(&self, p: &Progress) -> Error {
        let waiting = self.waiting_for(p);
        let during = p.desc.map(|d| format!(" in {d}")).unwrap_or_default();
        Error::new(
            ErrorKind::Timeout,
            format!(
                "rank {} timed out after {:.1} s{during} waiting for {}; is that rank alive and making the same calls?",
                self.rank,
                self.timeout.as_secs_f64(),
                waiting.join(", ")
            ),
        )
    }

    /// The peers this exchange still waits on, and for what.
    fn waiting_for(&self, p: &Progress) -> Vec<String> {
        let mut waiting = Vec::new();
        for peer in 0..self.size {
            let r = p.recvs[peer].len();
            let s = p.sends[peer].len() + p.acked[peer].len();
            if r + s > 0 {
                let what = match (r > 0, s > 0) {
                    (true, true) => "to send and to receive",
                    (true, false) => "to send",
                    _ => "to receive",
                };
                waiting.push(format!("rank {peer} ({what})"));
            }
        }
        waiting
    }

    fn run(&mut self, xfers: &mut [Xfer<'_>], p: &mut Progress) -> Result<()> {
        self.check_xfers(xfers)?;
        for (peer, conn) in self.conns.iter().enumerate() {
            if let Some(Some(Gone::Lost(why))) = conn.as_ref().map(|c| &c.gone) {
                return Err(self.lost(peer, &why.clone(), xfers.first().map(|x| x.desc)));
            }
        }
        self.start(xfers, p)?;
        // Clock reads cost as much as a small message: the deadline and the
        // spin are counted from the first check, not before the first pass.
        let mut deadline_at: Option<Instant> = None;
        // First pass: push sends and try the receives we expect.
        for peer in 0..self.size {
            if !p.sends[peer].is_empty() {
                self.pump_sends(peer, xfers, p)?;
            }
            if !p.recvs[peer].is_empty() {
                self.pump_reads(peer, xfers, p)?;
            }
        }
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut peers_of: Vec<usize> = Vec::new();
        let mut last_moved = self.moved;
        let mut idle_since: Option<Instant> = None;
        let mut passes = 0u32;
        let mut nap_ms = 1;
        while p.remaining > 0 {
            if !self.spin.is_zero() && passes % 16 != 15 {
                // Between the checks below (a clock read each), pure busy
                // passes: a small message's latency is a few of them.
                passes = passes.wrapping_add(1);
                self.busy_pass(xfers, p, false)?;
                if self.yield_when_idle && p.remaining > 0 {
                    // The peer may be waiting for this very core.
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            self.check_departed(p)?;
            if self.signal.is_aborted() {
                return Err(Error::new(
                    ErrorKind::Aborted,
                    format!("rdist_comm_abort was called on rank {}", self.rank),
                ));
            }
            let now = Instant::now();
            let deadline = *deadline_at.get_or_insert(now + self.timeout);
            if now >= deadline {
                return Err(self.timeout_error(p));
            }
            if !self.spin.is_zero() {
                // Busy pass: small messages live or die on wake-up latency.
                passes = passes.wrapping_add(1);
                self.busy_pass(xfers, p, passes.is_multiple_of(64))?;
                if p.remaining == 0 {
                    break;
                }
            }
            if self.moved != last_moved {
                last_moved = self.moved;
                idle_since = Some(now);
                nap_ms = 1;
            }
            let idle = now.duration_since(*idle_since.get_or_insert(now));
            if idle >= self.read_ahead_after {
                p.read_ahead = true;
            }
            if idle < self.spin {
                if self.yield_when_idle {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            // Shared memory wakes no descriptor: sleep on its doorbell
            // (also with spinning turned off, RDIST_SPIN_US=0).
            if self.doorbell.is_some() {
                self.doze(xfers, p, deadline)?;
                continue;
            }
            fds.clear();
            peers_of.clear();
            fds.push(libc::pollfd {
                fd: self.signal.fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            for (peer, conn) in self.conns.iter().enumerate() {
                let Some(conn) = conn else { continue };
                let mut events = 0;
                if conn.gone.is_none() {
                    // Frames nobody asked for yet stay unread (and unpolled).
                    let mid_frame = !conn.between_frames();
                    events |= libc::POLLRDHUP;
                    if mid_frame || p.reads_from(peer) {
                        events |= libc::POLLIN;
                    }
                    if !p.sends[peer].is_empty() || !conn.acks_out.is_empty() {
                        events |= libc::POLLOUT;
                    }
                }
                if events != 0 {
                    fds.push(libc::pollfd {
                        fd: conn.chan.fd(),
                        events,
                        revents: 0,
                    });
                    peers_of.push(peer);
                }
            }
            // Spinning transports sleep in short naps: shared memory has no
            // descriptor that wakes poll() when data arrives.
            let mut wait_ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
            if !self.spin.is_zero() {
                wait_ms = wait_ms.min(nap_ms);
                nap_ms = (nap_ms * 2).min(8);
            }
            if !p.read_ahead {
                // Wake to allow reading ahead once stalled.
                wait_ms = wait_ms.min(self.read_ahead_after.as_millis().min(1 << 20) as i32 + 1);
            }
            // SAFETY: fds is a live, correctly sized array of pollfd.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::system("poll", &e));
            }
            for k in 1..fds.len() {
                let revents = fds[k].revents;
                if revents == 0 {
                    continue;
                }
                let peer = peers_of[k - 1];
                if revents & libc::POLLOUT != 0 {
                    self.pump_sends(peer, xfers, p)?;
                }
                if revents & (libc::POLLIN | libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                    self.pump_reads(peer, xfers, p)?;
                }
            }
        }
        Ok(())
    }
}

impl StreamTransport {
    /// Sleeps on the doorbell until a peer moves data (or a short timeout,
    /// after which the caller re-checks abort, peers' deaths and the deadline).
    fn doze(&mut self, xfers: &mut [Xfer<'_>], p: &mut Progress, deadline: Instant) -> Result<()> {
        let bell = self.doorbell.as_ref().expect("doze needs a doorbell");
        let seen = bell.prepare();
        let before = self.moved;
        // Re-check after announcing the sleep: a ring sent just before is
        // either seen here or makes the futex return at once.
        let checked = self.busy_pass(xfers, p, true);
        let bell = self.doorbell.as_ref().expect("doze needs a doorbell");
        if checked.is_err() || p.remaining == 0 || self.moved != before {
            bell.done();
            return checked;
        }
        let nap = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(20));
        bell.sleep(seen, nap);
        Ok(())
    }

    /// One pass over every peer: push pending sends, read what is there
    /// (everything when `all`, which is how a silent peer's death shows).
    fn busy_pass(&mut self, xfers: &mut [Xfer<'_>], p: &mut Progress, all: bool) -> Result<()> {
        for peer in 0..self.size {
            let Some(conn) = &self.conns[peer] else {
                continue;
            };
            if conn.gone.is_some() {
                continue;
            }
            let readable = all || conn.chan.has_data();
            if !p.sends[peer].is_empty() || !conn.acks_out.is_empty() {
                self.pump_sends(peer, xfers, p)?;
            }
            if readable {
                self.pump_reads(peer, xfers, p)?;
            }
        }
        Ok(())
    }
}

/// Most transfers `exchange_whole` takes on (it tracks them in a bitmask).
const WHOLE_MAX_XFERS: usize = 32;
/// Largest payload it takes: small messages, whose cost is bookkeeping.
const WHOLE_MAX_BYTES: usize = 16 << 10;
/// Passes it makes over transfers still waiting before leaving them to
/// `run` (about a microsecond: a peer's answer in a small collective).
const WHOLE_SPINS: u32 = 64;
const WHOLE_SPINS_YIELDING: u32 = 2;

/// The bitmask of the first `n` transfers (n <= WHOLE_MAX_XFERS).
fn all_of(n: usize) -> u32 {
    match n {
        32.. => u32::MAX,
        n => (1u32 << n) - 1,
    }
}

/// Compares a received header with the expected one, word by word (a
/// call to memcmp costs more than the whole comparison).
fn same_header(got: &[u8], want: &[u8; HEADER_BYTES]) -> bool {
    got.len() == HEADER_BYTES
        && got
            .chunks_exact(8)
            .zip(want.chunks_exact(8))
            .fold(0u64, |diff, (g, w)| {
                let word = |b: &[u8]| u64::from_ne_bytes(b.try_into().expect("8 bytes"));
                diff | (word(g) ^ word(w))
            })
            == 0
}

/// Moves the transfers not in `done` to the front, keeping their order
/// (messages between two ranks match in order), and returns them.
fn keep_unfinished<'x, 'a>(xfers: &'x mut [Xfer<'a>], done: u32) -> &'x mut [Xfer<'a>] {
    let mut kept = 0;
    for i in 0..xfers.len() {
        if i >= WHOLE_MAX_XFERS || done & (1 << i) == 0 {
            xfers.swap(kept, i);
            kept += 1;
        }
    }
    &mut xfers[..kept]
}

impl StreamTransport {
    /// The fast path for small messages over shared memory: every frame is
    /// written, or read and checked, as one whole ring record, without the
    /// per-exchange bookkeeping of `run`. Takes only transfers on idle
    /// connections (nothing half-read or half-written, nothing early in the
    /// inbox), in order per peer and direction, and spins only briefly.
    /// Returns the bitmask of transfers it completed; `run` does the rest,
    /// including every wait, unexpected frame and error.
    fn exchange_whole(&mut self, xfers: &mut [Xfer<'_>]) -> u32 {
        let n = xfers.len();
        // One large transfer sends the whole exchange the general way at
        // once, instead of spinning here on what can never go whole.
        let small = |x: &Xfer<'_>| match &x.dir {
            Dir::Send(d) => d.len() <= WHOLE_MAX_BYTES && d.len() < self.single_copy_min,
            Dir::Recv(b) | Dir::RecvReduce(b, ..) => b.len() <= WHOLE_MAX_BYTES,
        };
        if n > WHOLE_MAX_XFERS || self.doorbell.is_none() || !xfers.iter().all(small) {
            return 0;
        }
        let want = all_of(n);
        let mut done = 0u32;
        let spins = match (self.spin.is_zero(), self.yield_when_idle) {
            (true, _) => 0,
            (false, true) => WHOLE_SPINS_YIELDING,
            (false, false) => WHOLE_SPINS,
        };
        let mut pass = 0;
        loop {
            let before = done;
            for i in 0..n {
                if done & (1 << i) == 0 && self.whole_ready(xfers, done, i) {
                    done |= u32::from(self.whole_transfer(&mut xfers[i])) << i;
                }
            }
            if done == want || pass == spins {
                return done;
            }
            pass += 1;
            if done == before {
                if self.yield_when_idle {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Whether transfer `i` may go as a whole record now: its connection is
    /// idle in its direction and every earlier transfer with the same peer
    /// and direction is done.
    fn whole_ready(&self, xfers: &[Xfer<'_>], done: u32, i: usize) -> bool {
        let x = &xfers[i];
        let sending = matches!(x.dir, Dir::Send(_));
        let Some(Some(conn)) = self.conns.get(x.peer) else {
            return false;
        };
        let idle = conn.gone.is_none()
            && match sending {
                true => conn.unfinished_out == 0 && conn.acks_out.is_empty(),
                false => conn.inbox.is_empty() && conn.between_frames(),
            };
        idle && (0..i).all(|j| {
            done & (1 << j) != 0
                || xfers[j].peer != x.peer
                || matches!(xfers[j].dir, Dir::Send(_)) != sending
        })
    }

    /// Writes or reads one transfer as a whole record; false when it cannot
    /// now (no room, nothing there, or a record that is not exactly the
    /// expected frame: `run` reads that one and says what is wrong).
    fn whole_transfer(&mut self, x: &mut Xfer<'_>) -> bool {
        let conn = self.conns[x.peer].as_mut().expect("checked by whole_ready");
        match x.dir {
            Dir::Send(data) => conn
                .chan
                .write_whole(&Header::data(x.desc, data.len()).encode(), data),
            Dir::Recv(_) | Dir::RecvReduce(..) => read_whole(&mut *conn.chan, x),
        }
    }
}

/// Completes receive `x` from the next record of `chan` when that record
/// is exactly the frame expected (header and length); false otherwise,
/// leaving the record where it is.
fn read_whole(chan: &mut dyn Channel, x: &mut Xfer<'_>) -> bool {
    let Some(buf) = x.dir.recv_buf() else {
        return false;
    };
    let len = buf.len();
    if len > WHOLE_MAX_BYTES {
        return false;
    }
    let Some(record) = chan.peek_whole() else {
        return false;
    };
    if record.len() != HEADER_BYTES + len
        || !same_header(&record[..HEADER_BYTES], &Header::data(x.desc, len).encode())
    {
        return false;
    }
    deliver(&mut x.dir, &record[HEADER_BYTES..]);
    chan.consume_whole(HEADER_BYTES + len);
    true
}

impl Transport for StreamTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(Error::new(
                e.kind(),
                format!(
                    "the communicator is unusable after an earlier error: {}",
                    e.message()
                ),
            ));
        }
        let done = self.exchange_whole(xfers);
        if done == all_of(xfers.len()) && !xfers.is_empty() {
            return Ok(());
        }
        let rest = keep_unfinished(xfers, done);
        let mut p = std::mem::take(&mut self.progress);
        let result = self.run(rest, &mut p);
        self.progress = p;
        match result {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail(e, true)),
        }
    }
}

impl Drop for StreamTransport {
    fn drop(&mut self) {
        self.close();
    }
}

impl Conn {
    /// True when no frame is partly read.
    fn between_frames(&self) -> bool {
        matches!(self.incoming, Incoming::Header { got: 0, .. })
    }

    /// Best-effort, bounded write of a control frame. An interrupted data
    /// frame is first completed with zeros so the peer can parse what
    /// follows; if that can't be done in time the connection is shut down.
    fn send_control(&mut self, header: &[u8], payload: &[u8]) {
        let deadline = Instant::now() + NOTIFY_BUDGET;
        // Finish what was interrupted: a data frame (padded with zeros) or
        // the acknowledgements queued behind it.
        let pad = vec![
            0u8;
            self.unfinished_out
                .saturating_sub(self.acks_out.len() % HEADER_BYTES)
        ];
        let acks = std::mem::take(&mut self.acks_out);
        let ok = write_all_by(&mut *self.chan, &pad, deadline)
            && write_all_by(&mut *self.chan, &acks, deadline)
            && write_all_by(&mut *self.chan, header, deadline)
            && write_all_by(&mut *self.chan, payload, deadline);
        self.unfinished_out = 0;
        if !ok {
            self.chan.shutdown(Shutdown::Both);
            self.gone = Some(Gone::Lost("shut down".into()));
        }
    }

    /// Reads and discards what is already queued, so that closing does not
    /// turn into a reset that could destroy data still travelling to the peer.
    fn drain(&mut self) {
        let mut sink = [0u8; 4096];
        for _ in 0..64 {
            match self.chan.read(&mut sink) {
                Ok(n) if n > 0 => continue,
                _ => break,
            }
        }
    }
}

/// One write of the rest of a frame (header and padding, then payload)
/// from `offset`.
fn write_frame_part(
    chan: &mut dyn Channel,
    prefix: &[u8],
    payload: &[u8],
    offset: usize,
) -> io::Result<usize> {
    if offset < prefix.len() {
        chan.write2(&prefix[offset..], payload)
    } else {
        chan.write2(&[], &payload[offset - prefix.len()..])
    }
}

/// Writes all of `bytes`, waiting (poll on the socket, or a short sleep
/// for shared memory) until `deadline`. False when it could not.
fn write_all_by(chan: &mut dyn Channel, mut bytes: &[u8], deadline: Instant) -> bool {
    while !bytes.is_empty() {
        match chan.write2(&[], bytes) {
            Ok(n) if n > 0 => {
                bytes = &bytes[n..];
                continue;
            }
            Err(e)
                if e.kind() != io::ErrorKind::WouldBlock
                    && e.kind() != io::ErrorKind::Interrupted =>
            {
                return false
            }
            _ => {}
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut fd = libc::pollfd {
            fd: chan.fd(),
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one live pollfd. For shared memory the socket is always
        // writable, so this returns at once; sleep briefly instead.
        unsafe { libc::poll(&mut fd, 1, left.as_millis().clamp(1, 10) as i32) };
        if chan.has_data() || fd.revents & libc::POLLOUT != 0 {
            std::thread::yield_now();
        }
    }
    true
}

/// Broken connections must surface as EPIPE errors, not kill the process
/// (writev has no MSG_NOSIGNAL flag). Called once when rdist creates its
/// first connection; a program that installed its own SIGPIPE handler keeps it.
pub fn ignore_sigpipe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: querying and, if default, replacing the SIGPIPE disposition.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGPIPE, std::ptr::null(), &mut old);
            if old.sa_sigaction == libc::SIG_DFL {
                libc::signal(libc::SIGPIPE, libc::SIG_IGN);
            }
        }
    });
}

/// The error for a single-copy read that failed: the sender's memory is
/// gone, which in practice means the sender is.
fn remote_failed(peer: usize, len: u64, e: &io::Error) -> Error {
    Error::new(
        ErrorKind::PeerLost,
        format!(
            "reading {len} bytes from rank {peer}'s memory failed ({}); did it exit?",
            describe_io(e)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::transport::channel::TcpChannel;
    use std::net::{TcpListener, TcpStream};

    /// `n` transports connected pairwise over loopback TCP.
    fn tcp_world(n: usize) -> Vec<StreamTransport> {
        let mut chans: Vec<Vec<Option<Box<dyn Channel>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for a in 0..n {
            for b in a + 1..n {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
                let theirs = l.accept().unwrap().0;
                for (rank, peer, s) in [(a, b, ours), (b, a, theirs)] {
                    s.set_nonblocking(true).unwrap();
                    s.set_nodelay(true).unwrap();
                    chans[rank][peer] = Some(Box::new(TcpChannel(s)));
                }
            }
        }
        chans
            .into_iter()
            .enumerate()
            .map(|(rank, c)| {
                let tuning = Tuning {
                    timeout: Duration::from_secs(20),
                    spin: Duration::from_micros(50),
                    yield_when_idle: true,
                    single_copy_min: usize::MAX,
                };
                StreamTransport::new(rank, c, None, Arc::new(AbortSignal::new().unwrap()), tuning)
            })
            .collect()
    }

    /// Rank 0 sends two broadcast frames to rank 1 at once; rank 1's first
    /// call also waits for rank 2, who sends after `delay`. Returns in how
    /// many of `rounds` rounds rank 1 had read the second frame ahead into
    /// its inbox by the end of its first call (every frame is checked).
    fn read_ahead_rounds(rounds: u64, delay: Duration, read_ahead_after: Duration) -> u64 {
        let mut w = tcp_world(3).into_iter();
        let (mut t0, mut t1, mut t2) = (w.next().unwrap(), w.next().unwrap(), w.next().unwrap());
        t1.read_ahead_after = read_ahead_after;
        let desc = |seq: u64| Desc::new(OpKind::Broadcast, seq).data(100, DType::Uint8);
        let sender = std::thread::spawn(move || {
            for r in 0..rounds {
                for seq in [2 * r, 2 * r + 1] {
                    let data = [seq as u8; 100];
                    t0.exchange(&mut [Xfer::send(1, &data, desc(seq))]).unwrap();
                }
                t0.exchange(&mut [Xfer::send(1, &[], desc(1000 + r))])
                    .unwrap();
            }
        });
        let late = std::thread::spawn(move || {
            for r in 0..rounds {
                std::thread::sleep(delay);
                t2.exchange(&mut [Xfer::send(1, &[7; 100], desc(2 * r))])
                    .unwrap();
                t2.exchange(&mut [Xfer::send(1, &[], desc(1000 + r))])
                    .unwrap();
            }
        });
        let mut read_ahead = 0;
        for r in 0..rounds {
            let (mut a, mut b) = ([0u8; 100], [0u8; 100]);
            let d = desc(2 * r);
            t1.exchange(&mut [Xfer::recv(0, &mut a, d), Xfer::recv(2, &mut b, d)])
                .unwrap();
            assert!(a == [2 * r as u8; 100] && b == [7; 100]);
            read_ahead += u64::from(!t1.conns[0].as_ref().unwrap().inbox.is_empty());
            t1.exchange(&mut [Xfer::recv(0, &mut a, desc(2 * r + 1))])
                .unwrap();
            assert_eq!(a, [2 * r as u8 + 1; 100]);
            // Both senders wait here, so the next round starts afresh.
            let d = desc(1000 + r);
            t1.exchange(&mut [Xfer::recv(0, &mut [], d), Xfer::recv(2, &mut [], d)])
                .unwrap();
        }
        sender.join().unwrap();
        late.join().unwrap();
        read_ahead
    }

    /// While a collective's exchange makes progress (here: never counted
    /// as stalled), the next call's frames stay in the socket.
    #[test]
    fn collectives_leave_the_next_calls_frames_unread() {
        let rounds = 20;
        let n = read_ahead_rounds(rounds, Duration::from_micros(200), Duration::from_secs(60));
        assert_eq!(n, 0, "read ahead in {n} of {rounds} rounds");
    }

    /// A stalled exchange reads them after `read_ahead_after` (so a failure
    /// report queued behind them still gets through), and the frame read
    /// early still reaches its call.
    #[test]
    fn stalled_collectives_read_ahead() {
        let n = read_ahead_rounds(2, Duration::from_millis(60), Duration::from_millis(1));
        assert_eq!(n, 2, "read ahead in {n} of 2 stalled rounds");
    }
}
