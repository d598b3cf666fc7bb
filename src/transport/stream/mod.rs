//! The stream core: one non-blocking channel per peer (a medium's: TCP,
//! shared-memory rings) carrying framed messages of both contexts, the
//! collectives' and the tagged messages', and the progress run by
//! whoever holds the core. A collective's exchange runs with the core
//! held from its start to its end; tagged messages move whenever anyone
//! holds it (the exchange takes those it meets; a waiting caller or the
//! endpoint's thread drives them otherwise, `drive`). Every exchange also
//! drains frames arriving early from any peer (into a per-peer inbox), so
//! that symmetric sends never deadlock and a failure report from any
//! rank, or a dead connection, is noticed while waiting for something
//! else.
//!
//! Waiting: over TCP, poll(); over shared memory, spinning (yielding the
//! core between checks) for up to `spin` before sleeping on the doorbell
//! or in poll() with short, growing timeouts.

mod connect;
mod drive;

pub use drive::Drive;
mod notice;
mod progress;
mod single_copy;
mod small;

use super::channel::{Caps, Channel};
use super::doorbell::Doorbell;
use super::frame::{
    self, FrameKind, Header, HEADER_BYTES, MAX_PAD, PAD_MIN_PAYLOAD, REMOTE_BYTES, TAG_REMOTE_BYTES,
};
use super::link::Links;
use super::signal::AbortSignal;
use super::tagged::{Path, Posts, ReadCost, Sink, Tagged};
use super::watch::Watch;
use super::{Dir, Shape, Transport, Xfer};
use crate::descriptor::{Desc, OpKind};
use crate::error::{describe_io, Error, ErrorKind, Result};
use crate::reduce;
use progress::READ_AHEAD_AFTER;
pub use small::RecvNow;
use small::{all_of, keep_unfinished, read_whole};
use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct StreamTransport {
    rank: usize,
    size: usize,
    /// Boxed: a wide job's rank connects to a few of its peers, and a
    /// `Conn` inline for each of 1024 was 0.25 MiB to fault in at init.
    conns: Vec<Option<Box<Conn>>>,
    /// The peers that have a connection, ascending: what a waiting pass
    /// looks at (a wide job's rank has a few of its thousand peers, and a
    /// pass runs between every two yields of the core).
    linked: Vec<usize>,
    signal: Arc<AbortSignal>,
    timeout: Duration,
    /// How long to spin before sleeping (zero: sleep in poll() at once).
    spin: Duration,
    /// What this rank sleeps on when its peers are in shared memory.
    doorbell: Option<Doorbell>,
    /// Some peers over TCP beside the shared memory: no doorbell rings
    /// for them, so naps on the doorbell are kept short.
    mixed: bool,
    /// Yield the core between spins (when ranks outnumber cores).
    yield_when_idle: bool,
    /// Payloads at least this large travel single-copy where the channel
    /// allows (the receiver reads the sender's memory); usize::MAX: never.
    single_copy_min: usize,
    /// The same for payloads sent while this rank also receives (see
    /// `Tuning`).
    two_way_single_copy_min: usize,
    /// The same for payloads their receiver combines (see `Tuning`).
    reduced_single_copy_min: usize,
    /// The same for point-to-point sends in a group (as for tagged ones).
    tagged_single_copy_min: usize,
    /// How long a collective's exchange stalls before it reads ahead
    /// (`READ_AHEAD_AFTER`; tests change it).
    read_ahead_after: Duration,
    /// Counts reads and writes that moved bytes (progress detection).
    moved: u64,
    /// How fast the sockets delivered the last large exchange (bytes per
    /// second; see `Progress::socket_bytes`).
    socket_rate: Option<f64>,
    /// Bookkeeping of the exchange in progress (reused).
    progress: Progress,
    /// Set by the first error; every later exchange fails with it.
    failed: Option<Error>,
    /// Whether the peers were told about `failed`.
    notified: bool,
    /// How channels to peers are made on first use (None: every channel
    /// was given at construction).
    links: Option<Arc<Links>>,
    /// Which awaited peer the next dial looks at (connect.rs).
    probed: usize,
    /// When an exchange that hears nothing asks its peers whether they
    /// run (see `transport::watch`).
    watch: Watch,
    /// A failure another rank reported to this one, passed on as is: a
    /// peer that heard it may exit before the reporter's own notice
    /// reaches everyone, and its closed connection alone would say only
    /// "exited".
    heard: Option<Error>,
    /// The tagged context: its posted calls, matching and protocol.
    pub(crate) tagged: Tagged,
    /// Tagged calls posted while another thread held the core, taken in
    /// at the next look.
    posts: Arc<Posts>,
    /// Bookkeeping of progress outside an exchange (no transfers).
    idle: Progress,
    /// What every rank assumes of the media between them.
    shape: Shape,
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
    /// `chan`'s capabilities and tagged path, fixed for its life: read
    /// here on every small message instead of through its vtable.
    caps: Caps,
    path: Path,
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
    /// A tagged frame's payload, where the tagged context says (with the
    /// bytes of a single-copy descriptor).
    Tagged(Sink, [u8; TAG_REMOTE_BYTES]),
    /// Into the inbox (nobody asked for it yet).
    Early(Vec<u8>),
    /// A control frame's payload.
    Control(Vec<u8>),
    /// A single-copy descriptor: [address, length] in the sender's memory.
    Descriptor([u8; REMOTE_BYTES]),
}

/// While a payload from this size arrives, each read asks the channel for
/// prompt acknowledgements (`Channel::expect_bulk`). Below it the price
/// shows: over loopback, an acknowledgement of its own for each 16 KiB
/// message costs more than the stall it saves.
const BULK_PAYLOAD: u64 = 64 << 10;

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
    /// Every transfer of this exchange goes over a socket (TCP): poll()
    /// wakes when data comes, so spinning helps only a short exchange.
    sockets_only: bool,
}

impl Progress {
    /// Bookkeeping for `size` ranks with no transfers.
    fn sized(size: usize) -> Progress {
        let mut p = Progress::default();
        for queues in [&mut p.recvs, &mut p.sends, &mut p.acked] {
            queues.resize_with(size, VecDeque::new);
        }
        p
    }

    /// Whether a new frame from `peer` may be read now: one this exchange
    /// waits for (a receive, or the ack of a single-copy send), or any
    /// frame once reading ahead is allowed.
    fn reads_from(&self, peer: usize) -> bool {
        self.read_ahead || !self.recvs[peer].is_empty() || !self.acked[peer].is_empty()
    }
}

/// How a transport waits and moves bytes.
#[derive(Clone, Copy)]
pub struct Tuning {
    /// Bound on every wait.
    pub timeout: Duration,
    /// How long to busy-wait before sleeping (zero: sleep in poll() at once).
    pub spin: Duration,
    /// How long a wait hears nothing before it asks whether the peers it
    /// waits for still run (see `watch`); zero: never.
    pub peer_check: Duration,
    /// Yield the core between spins (when ranks outnumber cores).
    pub yield_when_idle: bool,
    /// Ranks per core, rounded up: the endpoint's thread looks this many
    /// times less often (see `service`).
    pub ranks_per_core: usize,
    /// Payloads from this size travel single-copy where the channel allows;
    /// usize::MAX: never.
    pub single_copy_min: usize,
    /// The same for payloads sent while this rank receives as much (an
    /// exchange whose receives add up to this size, a tagged send while
    /// this rank has such a receive posted, from any peer): through the rings
    /// its core then copies both ways, single copy only its incoming bytes.
    pub two_way_single_copy_min: usize,
    /// The same for payloads of reductions: a receiver that combines
    /// stages the single copy and reduces it on its own core, where the
    /// rings split the two passes between both ranks' cores, so rdist's
    /// own choice leaves them to the rings.
    pub reduced_single_copy_min: usize,
    /// Shared memory to some peers and TCP to others (see `doze`).
    pub mixed: bool,
    /// Tagged messages from this size go single-copy where a pair can;
    /// usize::MAX: never.
    pub tagged_single_copy_min: usize,
    /// Below it, a tagged message goes single copy when its buffer's last
    /// copies by its receiver beat the rings by this measure (see
    /// `tagged::choice`); None: never.
    pub tagged_read_cost: Option<ReadCost>,
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
    ) -> Result<StreamTransport> {
        let Tuning {
            timeout,
            spin,
            peer_check,
            yield_when_idle,
            ranks_per_core: _,
            single_copy_min,
            two_way_single_copy_min,
            reduced_single_copy_min,
            mixed,
            tagged_single_copy_min,
            tagged_read_cost,
        } = tuning;
        let size = channels.len();
        let conns: Vec<Option<Box<Conn>>> = channels
            .into_iter()
            .map(|c| c.map(|c| Box::new(Conn::new(c))))
            .collect();
        let linked = (0..size).filter(|p| conns[*p].is_some()).collect();
        Ok(StreamTransport {
            rank,
            size,
            conns,
            linked,
            signal,
            timeout,
            spin,
            doorbell,
            yield_when_idle,
            single_copy_min,
            two_way_single_copy_min,
            reduced_single_copy_min,
            tagged_single_copy_min,
            mixed,
            read_ahead_after: READ_AHEAD_AFTER,
            moved: 0,
            socket_rate: None,
            progress: Progress::default(),
            failed: None,
            notified: false,
            heard: None,
            links: None,
            probed: 0,
            watch: Watch::new(peer_check),
            tagged: Tagged::new(
                rank,
                size,
                tagged_single_copy_min,
                two_way_single_copy_min.min(tagged_single_copy_min),
                tagged_read_cost,
            ),
            posts: Arc::new(Posts::new()?),
            idle: Progress::sized(size),
            shape: Shape::default(),
        })
    }

    /// Where tagged calls are posted while another thread holds the core.
    pub fn posts(&self) -> Arc<Posts> {
        self.posts.clone()
    }

    /// What every rank assumes of the media (see `Shape`).
    pub fn set_shape(&mut self, shape: Shape) {
        self.shape = shape;
    }

    /// Some peers are over TCP beside the shared memory (see `doze`).
    pub fn set_mixed(&mut self, mixed: bool) {
        self.mixed = mixed;
    }

    /// A transport with no channel yet: each is made when a call first
    /// names its peer (see `transport::link`).
    pub fn on_demand(
        rank: usize,
        size: usize,
        links: Arc<Links>,
        signal: Arc<AbortSignal>,
        tuning: Tuning,
    ) -> Result<StreamTransport> {
        let doorbell = links.doorbell();
        let mut t = StreamTransport::new(
            rank,
            (0..size).map(|_| None).collect(),
            doorbell,
            signal,
            tuning,
        )?;
        t.links = Some(links);
        Ok(t)
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
        p.sockets_only = xfers.iter().all(|x| {
            self.conns[x.peer]
                .as_ref()
                .is_some_and(|c| c.chan.caps().through_kernel)
        });
        // Both ways: this rank also receives as much (a receive of a few
        // bytes alongside, such as a rooted call's check, leaves the core
        // free for the rings' second copy).
        let receiving: usize = (xfers.iter())
            .map(|x| match &x.dir {
                Dir::Recv(buf) | Dir::RecvReduce(buf, ..) => buf.len(),
                Dir::Send(_) => 0,
            })
            .sum();
        let two_way = receiving >= self.two_way_single_copy_min;
        for (i, x) in xfers.iter().enumerate() {
            match &x.dir {
                Dir::Send(data) => {
                    let min = match (x.desc.kind.has_reduction(), two_way) {
                        (true, _) => self.reduced_single_copy_min,
                        (false, true) => self.single_copy_min.min(self.two_way_single_copy_min),
                        (false, false) => self.single_copy_min,
                    };
                    // A grouped point-to-point send goes as a tagged one.
                    let min = match x.desc.kind == OpKind::Send {
                        true => min.min(self.tagged_single_copy_min),
                        false => min,
                    };
                    let single_copy = data.len() >= min
                        && self.conns[x.peer]
                            .as_ref()
                            .is_some_and(|c| c.chan.caps().single_copy);
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
                                .is_some_and(|c| c.chan.caps().through_kernel)
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
        for i in 0..self.linked.len() {
            self.match_inbox(self.linked[i], xfers, p)?;
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
            // The same call by different algorithms reads the same: say so.
            let how = match (Desc {
                algo: mine.algo,
                ..header.desc
            }) == *mine
            {
                true => format!(
                    ", by different algorithms ({} here, {} there: the ranks were given different \
                     `algo` options or tuning inputs)",
                    crate::descriptor::algo_name(mine.algo),
                    crate::descriptor::algo_name(header.desc.algo)
                ),
                false => String::new(),
            };
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "mismatched calls: rank {} called {} but rank {} called {}{how}",
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
        // Receive-and-reduce combines whole elements as they come and keeps
        // a partial one for the next bytes: a frame that ends mid-element
        // would carry it into the next frame.
        if let Dir::RecvReduce(_, dtype, _) = &xfers[i].dir {
            if want % dtype.size() as u64 != 0 {
                return Err(Error::internal(format!(
                    "rank {} received {want} bytes from rank {peer} to reduce for {mine}: not whole {} elements",
                    self.rank,
                    dtype.name()
                )));
            }
        }
        Ok(())
    }

    /// Writes as much as the channel takes of what waits for `peer`: a
    /// frame cut short first, then whole frames: tagged ones and
    /// acknowledgements between the exchange's sends, never inside one.
    fn pump_sends(&mut self, peer: usize, xfers: &[Xfer<'_>], p: &mut Progress) -> Result<()> {
        loop {
            let cut = self.conns[peer]
                .as_ref()
                .is_some_and(|c| c.unfinished_out > 0);
            if !cut && self.tagged.has_output(peer) {
                self.write_tagged(peer, p)?;
                if self.tagged.mid_frame(peer) {
                    return Ok(());
                }
            }
            let Some(&i) = p.sends[peer].front() else {
                break;
            };
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
                        return Err(self.broke(peer, &describe_io(&e), p.desc));
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

    /// Writes what the tagged context has for `peer`.
    fn write_tagged(&mut self, peer: usize, p: &Progress) -> Result<()> {
        let conn = self.conns[peer].as_mut().expect("peer is not this rank");
        let path = conn.path;
        match self.tagged.write(peer, &mut *conn.chan, path) {
            Ok(moved) => {
                self.moved = self.moved.wrapping_add(u64::from(moved));
                Ok(())
            }
            Err(e) => Err(self.broke(peer, &describe_io(&e), p.desc)),
        }
    }

    /// The connection to `peer` broke: it is gone, the tagged calls with
    /// it fail, and the error says so.
    pub(super) fn lose(&mut self, peer: usize, why: &str, desc: Option<Desc>) -> Error {
        let err = self.lost(peer, why, desc);
        if let Some(conn) = self.conns[peer].as_mut() {
            if conn.gone.is_none() {
                conn.gone = Some(Gone::Lost(why.to_string()));
            }
        }
        self.fail_tagged_reading(peer, &err);
        self.tagged.fail_peer(peer, err.clone());
        err
    }

    /// The connection to `peer` itself broke (closed, reset, unreadable):
    /// the peer counts as failed (`rdist_comm_failed_ranks`), then as
    /// `lose`. A pair given up for a protocol error or this rank's own
    /// timeout is lost but not counted: that peer may be alive.
    pub(super) fn broke(&mut self, peer: usize, why: &str, desc: Option<Desc>) -> Error {
        self.signal.note_lost(peer);
        self.lose(peer, why, desc)
    }

    /// A tagged receive whose payload was being read from `peer` (it is
    /// the core's then, not the tagged context's) fails with `err`: that
    /// connection is gone, or the transport failed.
    pub(super) fn fail_tagged_reading(&mut self, peer: usize, err: &Error) {
        let Some(conn) = self.conns[peer].as_mut() else {
            return;
        };
        if !conn.reading_tagged() {
            return;
        }
        let was = std::mem::replace(
            &mut conn.incoming,
            Incoming::Header {
                buf: [0; HEADER_BYTES],
                got: 0,
            },
        );
        if let Incoming::Payload {
            into: Target::Tagged(Sink::Receive(r, _), _),
            ..
        } = was
        {
            r.done.complete(Err(err.clone()));
        }
    }

    /// Reads everything `peer` has sent so far, completing posted receives
    /// and keeping early frames in its inbox.
    fn pump_reads(&mut self, peer: usize, xfers: &mut [Xfer<'_>], p: &mut Progress) -> Result<()> {
        loop {
            let tagged_wants = self.tagged.wants(peer);
            let conn = self.conns[peer].as_mut().expect("peer is not this rank");
            if conn.gone.is_some() {
                return Ok(());
            }
            // Between frames, with this exchange complete, leave the next
            // frames where they are: the next call reads them straight into
            // its buffers, instead of into the inbox now and copied later
            // (unless a tagged call may be waiting behind them).
            let between_frames = conn.between_frames();
            if between_frames && !tagged_wants && (p.remaining == 0 || !p.reads_from(peer)) {
                return Ok(());
            }
            // A whole tagged message, lent by the channel (shared memory).
            if between_frames && conn.inbox.is_empty() && self.take_tagged_whole(peer)? {
                continue;
            }
            let conn = self.conns[peer].as_mut().expect("peer is not this rank");
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
            let mut discard = [0u8; 4096];
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
                        Target::Tagged(Sink::Descriptor(_), d) => &mut d[*got..],
                        Target::Tagged(sink, _) => {
                            let left = header.payload as usize - *got;
                            match sink.buffer(*got) {
                                Some(b) => &mut b[..left],
                                None => &mut discard[..left.min(4096)],
                            }
                        }
                    };
                    let read = conn.chan.read(dest);
                    // Asked again after every read: this rank's own
                    // writes in between make the kernel delay them again.
                    if header.payload >= BULK_PAYLOAD && matches!(read, Ok(n) if n > 0) {
                        conn.chan.expect_bulk();
                    }
                    read
                }
            };
            let n = match result {
                Ok(0) => {
                    return match self.conn(peer).gone {
                        Some(Gone::Bye) => Ok(()),
                        _ => Err(self.broke(peer, "connection closed", p.desc)),
                    };
                }
                Ok(n) => {
                    self.moved = self.moved.wrapping_add(1);
                    n
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.broke(peer, &describe_io(&e), p.desc)),
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
                // What it sent before it left stays receivable.
                let left = Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "rank {peer} destroyed its communicator: nothing more will come from it, and it takes nothing more (rank {})",
                        self.rank
                    ),
                );
                self.tagged.fail_peer(peer, left);
                return Ok(());
            }
            FrameKind::TagEager
            | FrameKind::TagRts
            | FrameKind::TagCts
            | FrameKind::TagData
            | FrameKind::TagRemote
            | FrameKind::TagAck => {
                let pid = self.conn(peer).chan.peer_pid();
                match self.tagged.on_header(peer, &header, pid)? {
                    Some(sink) => Target::Tagged(sink, [0; TAG_REMOTE_BYTES]),
                    None => {
                        self.moved = self.moved.wrapping_add(1);
                        self.conn(peer).incoming = Incoming::Header {
                            buf: [0; HEADER_BYTES],
                            got: 0,
                        };
                        return Ok(());
                    }
                }
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
            Target::Tagged(sink, d) => {
                let pid = conn.chan.peer_pid();
                self.tagged.on_payload(peer, sink, &d, pid);
            }
            Target::Control(payload) => {
                let (kind, text) = self.hear_report(&payload);
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
}

impl Transport for StreamTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn shape(&self) -> Shape {
        self.shape
    }

    fn connected(&self, peer: usize) -> bool {
        peer == self.rank || self.conns.get(peer).is_some_and(Option::is_some)
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
        if let Err(e) = self.connect_peers(xfers) {
            return Err(self.fail(e, true));
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
    fn new(chan: Box<dyn Channel>) -> Conn {
        Conn {
            caps: chan.caps(),
            path: Path::of(&*chan),
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
        }
    }

    /// True when no frame is partly read.
    fn between_frames(&self) -> bool {
        matches!(self.incoming, Incoming::Header { got: 0, .. })
    }

    /// True while a tagged frame's payload is partly read.
    fn reading_tagged(&self) -> bool {
        matches!(
            self.incoming,
            Incoming::Payload {
                into: Target::Tagged(..),
                ..
            }
        )
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
