//! Connecting a pair of ranks on first use: one connection per pair, for
//! both contexts. A rank holds connections only to the peers it talks to
//! (a few dozen at 1024 ranks, not 1023).
//!
//! Whichever side needs the pair first dials (the collectives leave it to
//! the higher rank; a tagged message dials from either side). The other
//! side's endpoint thread, always running because it serves the listener,
//! greets the connection and runs the media's agreement (`medium::agree`),
//! and leaves the channel here; the stream core takes it when it needs
//! that peer. So a dial never waits for the peer's caller, which may be
//! busy in an earlier call, computing, or waiting for this very rank.
//!
//! When both sides dial at once, the higher rank's connection is the
//! pair's: each side's thread refuses the other's dial only when it is
//! dialing itself and its rank is the higher (`Verdict::Duplicate`), so
//! exactly one of the two is welcomed, and the refused side waits for
//! the other's to arrive.

use super::channel::Channel;
use super::doorbell::Doorbell;
use super::frame::{FrameKind, Header};
use super::media;
use super::medium::{Medium, Pair};
use super::mesh::{self, Dialed, MeshSpec, Verdict};
use super::shrink::{self, Inbox};
use super::signal::{AbortSignal, Wake};
use crate::error::{describe_io, Error, ErrorKind, Result};
use crate::sync::lock;
use std::net::TcpStream;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the answering side's part of the media's agreement may take
/// (the dialer is in it already, so only a stalled peer takes long).
const AGREE_DEADLINE: Duration = Duration::from_secs(10);

/// Where a pair's connection stands, as this side sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Idle,
    /// A thread of this rank is dialing it.
    Dialing,
    /// Made (by either side): its channel is in `arrived`, or taken.
    Connected,
    /// This side's dial was refused for the peer's own (since then): it
    /// will arrive, unless that dial failed; past `AWAIT_LIMIT` this side
    /// dials again.
    Awaiting(Instant),
}

/// How long a side whose dial was refused for the peer's waits for the
/// peer's connection before it dials again (the peer's dial may have
/// failed, and the peer may never dial again).
const AWAIT_LIMIT: Duration = Duration::from_secs(5);

/// What a `connect` came to.
pub enum Connect {
    /// The channel is in `arrived` (or on its way there, from the peer's
    /// dial): take it.
    Arriving,
    /// Another thread of this rank is dialing it.
    Elsewhere,
    /// The peer's communicator failed; its failure report
    /// (`frame::encode_failure`'s bytes), which it answered the dial with.
    Failed(Vec<u8>),
}

/// What this side's dial came to.
enum Dial {
    Made(Box<dyn Channel>),
    /// Refused for the peer's own dial, which this side's thread admits.
    Duplicate,
    /// The peer failed; its report.
    Failed(Vec<u8>),
}

struct Shared {
    /// Per rank (one byte each: a wide job's rank keeps 1023).
    states: Vec<State>,
    /// Channels made (dialed or admitted) and not taken yet.
    arrived: Vec<(usize, Box<dyn Channel>)>,
    /// This rank's failure report (see `frame::encode_failure`), once its
    /// communicator failed: a peer that dials it after that is answered
    /// with it instead of a connection nothing would ever use.
    failure: Option<Vec<u8>>,
}

/// What both sides of every pair of one communicator share.
pub struct Links {
    pub spec: MeshSpec,
    /// The media a pair tries, in order (see `media::open`).
    media: Vec<Box<dyn Medium>>,
    shared: Mutex<Shared>,
    /// Readable while `arrived` may hold something.
    bell: Wake,
    /// Set while `arrived` may hold something (looked at without the lock
    /// on every pass of a waiting caller).
    pending: AtomicBool,
    /// Ballots of a shrink of this communicator (see `shrink`).
    pub inbox: Inbox,
    /// The communicator's abort: a dial waiting for an answer ends on it.
    signal: Arc<AbortSignal>,
}

impl Links {
    pub fn new(
        spec: MeshSpec,
        media: Vec<Box<dyn Medium>>,
        signal: Arc<AbortSignal>,
    ) -> Result<Links> {
        Ok(Links {
            shared: Mutex::new(Shared {
                states: vec![State::Idle; spec.size],
                arrived: Vec::new(),
                failure: None,
            }),
            media,
            bell: Wake::new().map_err(|e| Error::system("eventfd", &e))?,
            pending: AtomicBool::new(false),
            inbox: Inbox::new()?,
            signal,
            spec,
        })
    }

    /// The media, in the order pairs try them.
    pub fn media(&self) -> &[Box<dyn Medium>] {
        &self.media
    }

    /// What this rank sleeps on while waiting on channels that wake no
    /// descriptor (shared memory), if it has any.
    pub fn doorbell(&self) -> Option<Doorbell> {
        self.media.iter().find_map(|m| m.doorbell())
    }

    fn pair(&self, peer: usize) -> Pair {
        Pair {
            peer,
            near: !self.spec.far[peer],
        }
    }

    /// Makes the pair's connection unless it is made or being made:
    /// dials `peer` (bounded by `deadline`) and agrees on a medium. The
    /// channel lands in `arrived`.
    pub fn connect(&self, peer: usize, deadline: Instant) -> Result<Connect> {
        self.connect_within(peer, deadline, deadline)
    }

    /// `connect`, with the peer's answer to the dial bounded by
    /// `answer_by` and the agreement after a welcome by `deadline`: a
    /// peer that welcomed the dial is alive, and a short look for its
    /// answer must not cut its agreement short.
    pub fn connect_within(
        &self,
        peer: usize,
        answer_by: Instant,
        deadline: Instant,
    ) -> Result<Connect> {
        {
            let mut sh = lock(&self.shared);
            match sh.states[peer] {
                State::Idle => sh.states[peer] = State::Dialing,
                State::Awaiting(since) if since.elapsed() >= AWAIT_LIMIT => {
                    sh.states[peer] = State::Dialing
                }
                State::Dialing => return Ok(Connect::Elsewhere),
                State::Connected | State::Awaiting(_) => return Ok(Connect::Arriving),
            }
        }
        let made = self.dial(peer, answer_by, deadline);
        let mut sh = lock(&self.shared);
        match made {
            Ok(Dial::Made(chan)) => {
                sh.states[peer] = State::Connected;
                sh.arrived.push((peer, chan));
                self.pending.store(true, Ordering::Release);
                self.bell.ring();
            }
            Ok(Dial::Duplicate) => {
                // Refused for the peer's own dial, which this side's
                // thread admits (perhaps already has).
                if sh.states[peer] == State::Dialing {
                    sh.states[peer] = State::Awaiting(Instant::now());
                }
            }
            Ok(Dial::Failed(report)) => {
                if sh.states[peer] == State::Dialing {
                    sh.states[peer] = State::Idle;
                }
                return Ok(Connect::Failed(report));
            }
            // The peer's own dial made the pair meanwhile: this one's
            // failure (the peer may have left since) does not matter.
            Err(_) if sh.states[peer] == State::Connected => {}
            Err(e) => {
                if sh.states[peer] == State::Dialing {
                    sh.states[peer] = State::Idle;
                }
                return Err(e);
            }
        }
        Ok(Connect::Arriving)
    }

    /// Dials and, when welcomed, agrees on a medium.
    fn dial(&self, peer: usize, answer_by: Instant, deadline: Instant) -> Result<Dial> {
        let s = match mesh::dial(&self.spec, peer, answer_by.min(deadline), &self.signal)? {
            Dialed::Welcomed(s) => s,
            Dialed::Duplicate => return Ok(Dial::Duplicate),
            Dialed::Failed(report) => return Ok(Dial::Failed(report)),
        };
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        s.set_read_timeout(Some(left))
            .and_then(|()| media::agree(&self.media, &self.pair(peer), s, true))
            .map(Dial::Made)
            .map_err(|e| {
                Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "rank {} lost its connection to rank {peer} while agreeing on a medium ({})",
                        self.spec.rank,
                        describe_io(&e)
                    ),
                )
            })
    }

    /// The endpoint thread's part: answers a greeted hello and, when
    /// welcomed, agrees on a medium and leaves the channel for the core.
    /// Blocking for a pair of this host (its agreement is three short
    /// messages with a dialer that is in it already), bounded.
    pub fn admit(&self, hello: &[u8; mesh::HELLO_BYTES], mut s: TcpStream) {
        // A shrink's connection, whether or not this communicator failed.
        if shrink::is_shrink_hello(hello) {
            shrink::admit(&self.inbox, &self.spec, hello, s);
            return;
        }
        let rank = match mesh::judge(&self.spec, hello) {
            Ok(rank) => rank,
            Err(verdict) => {
                mesh::answer(&self.spec, verdict, 0, &mut s);
                return;
            }
        };
        if !mesh::came_from(&self.spec, rank, &s) {
            mesh::answer(&self.spec, Verdict::NotFromItsAddress, 0, &mut s);
            return;
        }
        if let Some(report) = lock(&self.shared).failure.clone() {
            mesh::answer_failed(&mut s, &report);
            return;
        }
        let verdict = {
            let mut sh = lock(&self.shared);
            let dialing_and_higher = sh.states[rank] == State::Dialing && self.spec.rank > rank;
            match sh.states[rank] {
                State::Connected => Verdict::Duplicate,
                _ if dialing_and_higher => Verdict::Duplicate,
                _ => {
                    sh.states[rank] = State::Connected;
                    Verdict::Welcome
                }
            }
        };
        if !mesh::answer(&self.spec, verdict, rank, &mut s) {
            // The dialer left before the answer: no channel will come of
            // this welcome (and the pair may be dialed again).
            let mut sh = lock(&self.shared);
            if verdict == Verdict::Welcome && sh.states[rank] == State::Connected {
                sh.states[rank] = State::Idle;
            }
            return;
        }
        if verdict != Verdict::Welcome {
            return;
        }
        let agreed = s
            .set_read_timeout(Some(AGREE_DEADLINE))
            .and_then(|()| media::agree(&self.media, &self.pair(rank), s, false));
        let mut sh = lock(&self.shared);
        match agreed {
            // The communicator failed meanwhile: nothing would read this
            // channel; the peer gets the report on it, then its end.
            Ok(mut chan) if sh.failure.is_some() => {
                let report = sh.failure.as_deref().unwrap_or_default();
                let header = Header::control(FrameKind::Failure, report.len()).encode();
                // A fresh channel takes all of it, in several writes where
                // shared memory cuts it into records; stop where one would
                // block (nobody will wait on this channel).
                let (mut head, mut body) = (&header[..], report);
                while let Ok(n @ 1..) = chan.write2(head, body) {
                    let from_head = n.min(head.len());
                    (head, body) = (&head[from_head..], &body[n - from_head..]);
                    if head.is_empty() && body.is_empty() {
                        break;
                    }
                }
            }
            Ok(chan) => {
                sh.arrived.push((rank, chan));
                self.pending.store(true, Ordering::Release);
                self.bell.ring();
            }
            // The dialer hears it as a lost connection.
            Err(_) => sh.states[rank] = State::Idle,
        }
    }

    /// Keeps this rank's failure report for the peers that dial it later.
    pub fn failed(&self, report: Vec<u8>) {
        lock(&self.shared).failure.get_or_insert(report);
    }

    /// Whether a channel may wait in `take_arrived` (one load).
    #[inline]
    pub fn has_arrived(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// The channels made for peers, since the last call.
    pub fn take_arrived(&self) -> Vec<(usize, Box<dyn Channel>)> {
        if !self.pending.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut sh = lock(&self.shared);
        self.pending.store(false, Ordering::Release);
        self.bell.drain();
        std::mem::take(&mut sh.arrived)
    }

    /// Readable when a channel may have arrived.
    pub fn arrival_fd(&self) -> RawFd {
        self.bell.fd()
    }
}
