//! Progress outside a collective's exchange: a caller waiting for a
//! tagged call, or the endpoint's thread, holds the core for one pass and
//! moves the tagged frames (taking in whatever else arrives on the way:
//! a collective's frames for a later call go to the inbox).

use super::{Conn, StreamTransport};
use crate::error::{Error, ErrorKind};
use crate::transport::link::Connect;
use crate::transport::tagged::{Done, Outgoing, Status};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a tagged call's dial may take.
const DIAL_LIMIT: Duration = Duration::from_secs(10);

/// How a pass of `drive` goes.
#[derive(Clone, Copy, Debug)]
pub struct Drive {
    /// Dial a peer the tagged calls need and that is not connected (never
    /// from the endpoint's thread, which answers the peers' dials).
    pub connect: bool,
    /// Read every connection the calls wait on, data or not (which is how
    /// a peer's exit shows on shared memory); else only those with data,
    /// as a spinning caller looks.
    pub thorough: bool,
    /// The peer of the call the caller waits for, driven (and dialed)
    /// first.
    pub first: Option<usize>,
}
impl StreamTransport {
    /// Takes in the tagged calls posted while the core was held elsewhere,
    /// then a deferred receive (see `Posts`), and the channels that
    /// arrived.
    #[inline]
    pub fn take_posts(&mut self) {
        self.take_posts_but_deferred();
        if self.posts.has_deferred() {
            self.posts.take_deferred_into(&mut self.tagged);
        }
    }

    /// `take_posts`, leaving a deferred receive deferred: for a send
    /// written at once, which no receive of this rank's can match.
    #[inline]
    pub fn take_posts_but_deferred(&mut self) {
        if self.posts.pending() {
            self.take_pending_posts();
        }
        self.take_arrived();
    }

    /// Out of line: most calls find nothing posted by other threads.
    #[cold]
    #[inline(never)]
    fn take_pending_posts(&mut self) {
        self.posts.take_into(&mut self.tagged);
    }

    /// A tagged send written now when its peer is connected and nothing
    /// is ahead of it on the connection (see `Tagged::send_at_once`);
    /// whether it was taken (else it is posted the usual way).
    pub fn send_at_once(&mut self, msg: Outgoing, done: &Arc<Done>, id: u64) -> bool {
        if self.failed.is_some() {
            return false;
        }
        let Some(conn) = free_to_write(&mut self.conns, msg.peer) else {
            return false;
        };
        let path = conn.path;
        let taken = self
            .tagged
            .send_at_once(msg, done, id, &mut *conn.chan, path);
        if taken {
            self.moved = self.moved.wrapping_add(1);
        }
        taken
    }

    /// A blocking tagged send written whole now, needing no ticket (see
    /// `Tagged::send_whole_now`): its status, or None (the caller posts it).
    pub fn send_whole_now(&mut self, msg: Outgoing) -> Option<Status> {
        if self.failed.is_some() {
            return None;
        }
        let conn = free_to_write(&mut self.conns, msg.peer)?;
        if !conn.caps.whole_messages {
            return None;
        }
        let path = conn.path;
        let status = self.tagged.send_whole_now(msg, &mut *conn.chan, path)?;
        self.moved = self.moved.wrapping_add(1);
        Some(status)
    }

    /// One pass of tagged progress with `peer` (None: every peer the
    /// tagged context has talked to, and, when a receive from any rank
    /// is posted, every connected peer). Whether bytes moved.
    pub fn drive(&mut self, peer: Option<usize>, how: Drive) -> bool {
        // Calls posted after a failure fail with it as they are taken in.
        self.take_posts();
        if self.failed.is_some() {
            return false;
        }
        self.tagged.release_waiting_senders();
        let before = self.moved;
        match peer {
            Some(p) => self.drive_peer(p, how),
            None => {
                let mut how = how;
                if let Some(f) = how.first.filter(|f| self.tagged.used().contains(f)) {
                    how = self.drive_dialing_once(f, how);
                }
                for i in 0..self.tagged.used().len() {
                    let p = self.tagged.used()[i];
                    if Some(p) != how.first {
                        how = self.drive_dialing_once(p, how);
                    }
                }
                if self.tagged.wants_any_source() {
                    for i in 0..self.linked.len() {
                        let p = self.linked[i];
                        self.drive_peer(
                            p,
                            Drive {
                                connect: false,
                                ..how
                            },
                        );
                    }
                }
            }
        }
        if self.tagged.has_copies() {
            // After the passes, whose sends (an exchange's other half) are
            // out by now: the copies, then their answers.
            self.tagged.run_copies();
            self.moved = self.moved.wrapping_add(1);
            for i in 0..self.tagged.used().len() {
                let p = self.tagged.used()[i];
                if self.tagged.has_output(p) {
                    self.drive_peer(p, how);
                }
            }
        }
        self.moved != before
    }

    /// `drive_peer`, then `how` for the rest of the pass: no more dials
    /// once one was made. A peer that does not answer (stopped, its host
    /// gone) holds its dial to its bound, and the caller looks at its own
    /// call between two: a wait is not held behind the dials of every
    /// stopped peer its rank has calls with.
    fn drive_dialing_once(&mut self, peer: usize, how: Drive) -> Drive {
        let dials = how.connect
            && peer != self.rank
            && self.conns[peer].is_none()
            && (self.tagged.has_output(peer) || self.tagged.wants(peer));
        self.drive_peer(peer, how);
        match dials {
            true => Drive {
                connect: false,
                ..how
            },
            false => how,
        }
    }

    fn drive_peer(&mut self, peer: usize, how: Drive) {
        if peer == self.rank || self.failed.is_some() {
            return;
        }
        let output = self.tagged.has_output(peer);
        let wants = self.tagged.wants(peer);
        if self.conns[peer].is_none() {
            if !output && !wants {
                return;
            }
            if how.connect {
                self.connect_for_tagged(peer);
            }
            if self.conns[peer].is_none() {
                return;
            }
        }
        let conn = self.conns[peer].as_ref().expect("connected");
        if conn.gone.is_some() {
            return;
        }
        // A frame partly read is read on (its receive may be matched
        // already, so nothing waits for the peer any more); otherwise a
        // spinning caller reads only what is there (an empty ring's read
        // looks for the peer's exit now and then, a system call).
        let read = !conn.between_frames() || (wants && (how.thorough || conn.chan.has_data()));
        if !output && !read {
            return;
        }
        let taken = !output && !how.thorough && self.take_tagged_wholes(peer);
        // What the messages taken answer (a single-copy message's TagAck)
        // goes below, now: its sender waits for it, and the caller may
        // not call again for a long time.
        let answers = taken
            && self.failed.is_none()
            && self.tagged.has_output(peer)
            && self.conns[peer].as_ref().is_some_and(|c| c.gone.is_none());
        if taken && !answers {
            return;
        }
        let mut idle = std::mem::take(&mut self.idle);
        let mut result = Ok(());
        if output || answers {
            result = self.pump_sends(peer, &[], &mut idle);
        }
        if read && !taken && result.is_ok() {
            result = self.pump_reads(peer, &mut [], &mut idle);
            // What the reads answer (a single-copy message's TagAck, a
            // large one's TagCts) goes now: the sender waits for it.
            if result.is_ok() && self.tagged.has_output(peer) {
                result = self.pump_sends(peer, &[], &mut idle);
            }
        }
        self.idle = idle;
        if let Err(e) = result {
            self.drive_failed(peer, e);
        }
    }

    /// Writes the answers (TagAck, TagCts) owed to `peer` now: its sender
    /// waits for them.
    pub(super) fn send_answers(&mut self, peer: usize) {
        if self.failed.is_some()
            || !self.tagged.has_output(peer)
            || self.conns[peer].as_ref().is_none_or(|c| c.gone.is_some())
        {
            return;
        }
        let mut idle = std::mem::take(&mut self.idle);
        let result = self.pump_sends(peer, &[], &mut idle);
        self.idle = idle;
        if let Err(e) = result {
            self.drive_failed(peer, e);
        }
    }

    /// A spinning caller's pass over `peer` when only whole tagged
    /// messages wait there (shared memory, between frames): taken straight
    /// from the channel while the tagged calls want them, with none of a
    /// collective's progress state. Whether that was all (else the full
    /// read goes on: a frame that is not whole, or one for a collective).
    fn take_tagged_wholes(&mut self, peer: usize) -> bool {
        loop {
            let conn = self.conns[peer].as_ref().expect("connected");
            if conn.gone.is_some()
                || !conn.between_frames()
                || !conn.inbox.is_empty()
                || !conn.caps.whole_messages
            {
                return false;
            }
            if !self.tagged.wants(peer) {
                return true;
            }
            match self.take_tagged_whole(peer) {
                Ok(true) => {}
                Ok(false) => {
                    let conn = self.conns[peer].as_ref().expect("connected");
                    return !conn.chan.has_data();
                }
                Err(e) => {
                    self.drive_failed(peer, e);
                    return true;
                }
            }
        }
    }

    /// An error met outside an exchange: a peer's failure report fails
    /// the communicator (and is passed on, as an exchange would); a lost
    /// or misbehaving connection fails the calls with that peer only.
    fn drive_failed(&mut self, peer: usize, e: Error) {
        if self.heard.is_some() {
            self.fail(e, true);
            return;
        }
        let gone = self.conns[peer].as_ref().is_none_or(|c| c.gone.is_some());
        if !gone {
            // A protocol error: the pair cannot go on.
            let why = e.message().to_string();
            self.lose(peer, &why, None);
        }
    }

    /// Dials `peer` for a tagged call (unless its connection is made or
    /// on its way), bounded; a peer that cannot be reached fails the
    /// calls with it.
    pub(super) fn connect_for_tagged(&mut self, peer: usize) {
        let Some(links) = self.links.clone() else {
            return;
        };
        let deadline = Instant::now() + self.timeout.min(DIAL_LIMIT);
        match links.connect(peer, deadline) {
            // A peer's failure report fails the communicator, as one that
            // came on a connection does (see `drive_failed`).
            Ok(Connect::Failed(report)) => {
                let (kind, text) = self.hear_report(&report);
                let e = Error::new(kind, text);
                self.fail(e, true);
            }
            Ok(_) => self.take_arrived(),
            Err(e) => {
                if e.kind() == ErrorKind::PeerLost {
                    self.signal.note_lost(peer);
                }
                // An abort while it dialed stays an abort.
                let kind = match e.kind() {
                    ErrorKind::Aborted => ErrorKind::Aborted,
                    _ => ErrorKind::PeerLost,
                };
                let err = Error::new(
                    kind,
                    format!(
                        "rank {} cannot reach rank {peer} for point-to-point: {}",
                        self.rank,
                        e.message()
                    ),
                );
                self.tagged.fail_peer(peer, err);
            }
        }
    }

    /// Whether a tagged call is pending, or a tagged frame is partly
    /// read (its receive may be matched already): someone must keep
    /// moving.
    pub fn tagged_busy(&self) -> bool {
        self.tagged.busy()
            || (self.conns.iter().flatten()).any(|c| c.gone.is_none() && c.reading_tagged())
    }

    /// Whether some tagged call waits on a connection that wakes no
    /// descriptor (shared memory): whoever sleeps for it must sleep on the
    /// doorbell (or look again soon).
    pub fn tagged_waits_on_memory(&self) -> bool {
        let memory = |c: &Conn| !c.chan.caps().through_kernel;
        let on = |p: usize| self.conns[p].as_deref().is_some_and(memory);
        self.tagged
            .used()
            .iter()
            .any(|&p| on(p) && (self.tagged.has_output(p) || self.tagged.wants(p)))
            || self
                .conns
                .iter()
                .flatten()
                .any(|c| memory(c) && (c.reading_tagged() || self.tagged.wants_any_source()))
    }

    /// Whether some tagged call waits on a connection through the kernel
    /// (TCP), which rings no doorbell.
    pub fn tagged_waits_on_sockets(&self) -> bool {
        self.conns.iter().enumerate().any(|(p, c)| {
            c.as_deref().is_some_and(|c| {
                c.chan.caps().through_kernel
                    && c.gone.is_none()
                    && (self.tagged.wants(p) || self.tagged.has_output(p) || !c.between_frames())
            })
        })
    }

    /// The descriptors to poll, and for what, while tagged calls wait on
    /// connections that wake them (TCP). True when one of them holds
    /// bytes already read (`Channel::buffered`): poll() would not wake for
    /// those, so the caller must not sleep.
    pub fn tagged_fds(&self, out: &mut Vec<libc::pollfd>) -> bool {
        let mut ready = false;
        for (peer, conn) in self.conns.iter().enumerate() {
            let Some(conn) = conn else { continue };
            if conn.gone.is_some() {
                continue;
            }
            let mut events = 0;
            if self.tagged.wants(peer) || !conn.between_frames() {
                events |= libc::POLLIN;
                ready |= conn.chan.buffered();
            }
            // A shared-memory channel's descriptor only tells the peer's
            // exit (it is always writable, whatever room its ring has).
            if self.tagged.has_output(peer) && conn.chan.caps().through_kernel {
                events |= libc::POLLOUT;
            }
            if events != 0 {
                out.push(libc::pollfd {
                    fd: conn.chan.fd(),
                    events,
                    revents: 0,
                });
            }
        }
        ready
    }

    /// The tagged calls pending on this rank, described.
    pub fn tagged_pending(&self) -> Vec<String> {
        self.tagged.pending()
    }

    /// Whether a tagged send is still in flight (closing waits for them).
    pub fn tagged_sends_in_flight(&self) -> bool {
        self.failed.is_none() && self.tagged.sends_in_flight()
    }

    /// The other ranks not known to be gone (what a receive from any
    /// source waits on).
    pub fn tagged_others_not_gone(&self) -> Vec<usize> {
        self.tagged.others_not_gone()
    }

    /// The peers that tagged sends in flight still go to.
    pub fn tagged_send_peers(&self) -> Vec<usize> {
        match self.failed {
            None => self.tagged.send_peers(),
            Some(_) => Vec::new(),
        }
    }

    /// Makes tagged call `id` (which gave up waiting) never touch its
    /// buffer again (see `Tagged::withdraw`); where that needs memory
    /// there is none of, the pair fails.
    pub fn withdraw_tagged(&mut self, id: u64) {
        // It may still be among the posts (the core was held elsewhere).
        self.take_posts();
        let conns = &mut self.conns;
        let mut reading = |id: u64| {
            for conn in conns.iter_mut().flatten() {
                if let super::Incoming::Payload {
                    into: super::Target::Tagged(sink, _),
                    ..
                } = &mut conn.incoming
                {
                    if sink.is_receive(id) {
                        *sink = crate::transport::tagged::Sink::Drop;
                        return true;
                    }
                }
            }
            false
        };
        if let Some(peer) = self.tagged.withdraw(id, &mut reading) {
            let err = Error::new(
                ErrorKind::Timeout,
                format!(
                    "an earlier send to rank {peer} timed out while under way, and there was no memory to finish it without its buffer, which broke this pair's connection"
                ),
            );
            if let Some(conn) = self.conns[peer].as_mut() {
                conn.chan.shutdown(std::net::Shutdown::Both);
            }
            let why = err.message().to_string();
            self.lose(peer, &why, None);
        }
    }
}

/// `peer`'s connection when a tagged frame may be written on it now: made,
/// not lost, and with no frame of the collectives cut short on it.
fn free_to_write(conns: &mut [Option<Box<Conn>>], peer: usize) -> Option<&mut Conn> {
    let conn = conns.get_mut(peer)?.as_deref_mut()?;
    (conn.gone.is_none() && conn.unfinished_out == 0).then_some(conn)
}
