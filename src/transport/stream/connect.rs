//! Connecting the peers an exchange names, on first use (see
//! `transport::link`): this rank dials the lower ones itself and waits for
//! the higher ones' connections, which its endpoint's thread admits
//! (unless a tagged call made the pair already); a higher one that has
//! not come after a second, it dials itself.

use super::{Conn, StreamTransport};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::channel::Channel;
use crate::transport::link::{Connect, Links};
use crate::transport::watch::ANSWER_LIMIT;
use crate::transport::Xfer;
use std::time::{Duration, Instant};

/// How long a rank waits for a higher peer's connection before it dials
/// that peer itself (and again this often while it waits): a peer that
/// exited refuses the dial, one that failed answers it with its failure
/// report, and one that is merely late gets the pair's connection made.
const DIAL_AFTER: Duration = Duration::from_secs(1);
/// How long such a dial waits for the peer's answer (a stopped peer
/// never answers; a welcome then has its agreement's own bound).
const DIAL_LIMIT: Duration = Duration::from_secs(1);
/// How long the agreement after a welcome may take (the peer is alive).
const AGREEMENT_LIMIT: Duration = Duration::from_secs(10);
/// Dials left unanswered come at longer and longer intervals, up to this.
const DIAL_AFTER_MOST: Duration = Duration::from_secs(8);
/// How long a look for a refusal (nobody listens) may take.
const REFUSAL_LIMIT: Duration = Duration::from_millis(100);

impl StreamTransport {
    /// Makes sure every peer of `xfers` has a channel, bounded by the
    /// timeout. Cheap when they all have one (every call after the first
    /// with those peers).
    pub(super) fn connect_peers(&mut self, xfers: &[Xfer<'_>]) -> Result<()> {
        let missing = |t: &StreamTransport, peer: usize| {
            peer < t.size && peer != t.rank && t.conns[peer].is_none()
        };
        if !xfers.iter().any(|x| missing(self, x.peer)) {
            return Ok(());
        }
        let Some(links) = self.links.clone() else {
            return Err(Error::internal(format!(
                "rank {} has no connection to its peers and no way to make one",
                self.rank
            )));
        };
        let deadline = Instant::now() + self.timeout;
        self.take_arrived();
        let mut awaited: Vec<usize> = Vec::new();
        for x in xfers {
            let peer = x.peer;
            if !missing(self, peer) || awaited.contains(&peer) {
                continue;
            }
            if peer < self.rank {
                // A stopped peer never answers the dial: bounded as the
                // watch bounds its questions (see `transport::watch`).
                let answer_by = match self.watch.on() {
                    true => deadline.min(Instant::now() + ANSWER_LIMIT),
                    false => deadline,
                };
                match links.connect_within(peer, answer_by, deadline) {
                    Ok(Connect::Failed(report)) => {
                        return Err(self.failed_peer(peer, &report, xfers))
                    }
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::Timeout && answer_by < deadline => {
                        let text = format!(
                            "rank {peer} does not answer: rank {} dialed it{}, and it did not answer within {} s (it is stopped, by a signal or a debugger, or its host is unreachable; option peer_check_ms=0 waits for it to the timeout)",
                            self.rank,
                            during(xfers),
                            ANSWER_LIMIT.as_secs()
                        );
                        return Err(self.silent(peer, text));
                    }
                    Err(e) => {
                        // Nobody listens where it did: it is gone.
                        if e.kind() == ErrorKind::PeerLost {
                            self.signal.note_lost(peer);
                        }
                        return Err(e);
                    }
                }
            }
            awaited.push(peer);
        }
        self.take_arrived();
        let began = Instant::now();
        let mut dial_every = DIAL_AFTER;
        let mut next_dial = began + dial_every;
        loop {
            awaited.retain(|p| self.conns[*p].is_none());
            if awaited.is_empty() {
                return Ok(());
            }
            if self.signal.is_aborted() {
                return Err(Error::new(
                    ErrorKind::Aborted,
                    format!("rdist_comm_abort was called on rank {}", self.rank),
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                let during = during(xfers);
                let ranks: Vec<String> = awaited.iter().map(|p| format!("rank {p}")).collect();
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "rank {} timed out after {:.1} s{during} waiting for {} to connect; is that rank alive and making the same calls?",
                        self.rank,
                        self.timeout.as_secs_f64(),
                        ranks.join(", ")
                    ),
                ));
            }
            if now >= next_dial {
                // Dials that get no answer come less often (a stopped
                // peer, or one whose thread is swamped by other dials).
                dial_every = match self.dial_awaited(&links, &awaited, deadline, xfers)? {
                    true => DIAL_AFTER,
                    false => (dial_every * 2).min(DIAL_AFTER_MOST),
                };
                next_dial = Instant::now() + dial_every;
                self.take_arrived();
                continue;
            }
            // A peer whose dial is never answered may be stopped: asked
            // as an exchange asks (see `transport::watch`).
            let idle = began.elapsed();
            // A peer that connected counts as movement.
            let moves = (xfers.len() - awaited.len()) as u64;
            if self.watch.due(idle, moves, now) {
                let asked = self
                    .watch
                    .look(&links.spec, &awaited, idle, moves, &during(xfers));
                if let Some((peer, text)) = asked {
                    return Err(self.silent(peer, text));
                }
            }
            let mut fds = [
                libc::pollfd {
                    fd: links.arrival_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.signal.fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let ms = (deadline - now).as_millis().clamp(1, 100) as i32;
            // SAFETY: fds is a live array of two pollfd.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
            self.take_arrived();
        }
    }

    /// A peer that has not connected may be gone (it exited, or destroyed
    /// its communicator: nobody listens at its address), may have failed
    /// (its communicator answers every dial with its failure report), or
    /// may be late or busy: this rank dials it itself, one peer per round,
    /// in turn. Without this, the first two were noticed only at the
    /// timeout, and a failure report on another connection waited unread
    /// behind them. Whether the dial was answered: one that was not (a
    /// slow or stopped peer, a full backlog) proves nothing, and the wait
    /// goes on; only a refused connection says the peer is gone.
    fn dial_awaited(
        &mut self,
        links: &Links,
        awaited: &[usize],
        deadline: Instant,
        xfers: &[Xfer<'_>],
    ) -> Result<bool> {
        self.probed = self.probed.wrapping_add(1);
        let Some(&peer) = awaited.get(self.probed % awaited.len().max(1)) else {
            return Ok(true);
        };
        let now = Instant::now();
        let answer_by = deadline.min(now + DIAL_LIMIT);
        let agreed_by = deadline.min(now + AGREEMENT_LIMIT);
        let e = match links.connect_within(peer, answer_by, agreed_by) {
            Ok(Connect::Failed(report)) => return Err(self.failed_peer(peer, &report, xfers)),
            Ok(_) => return Ok(true),
            Err(e) => e,
        };
        // Credentials or a communicator that differ do not go away; an
        // abort ends the wait.
        if matches!(
            e.kind(),
            ErrorKind::Auth | ErrorKind::Mismatch | ErrorKind::Aborted
        ) {
            return Err(e);
        }
        let addr = links.spec.addrs[peer];
        let refused = std::net::TcpStream::connect_timeout(&addr, REFUSAL_LIMIT)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused);
        if !refused {
            return Ok(false);
        }
        self.signal.note_lost(peer);
        Err(Error::new(
            ErrorKind::PeerLost,
            format!(
                "rank {} waited{} for rank {peer} to connect, but nobody listens at its address {addr} any more: it exited, or destroyed its communicator",
                self.rank,
                during(xfers)
            ),
        ))
    }

    /// The error of a call whose dial `peer` answered with its failure
    /// report: the report, as this rank passes it on, and where this rank
    /// was.
    fn failed_peer(&mut self, peer: usize, report: &[u8], xfers: &[Xfer<'_>]) -> Error {
        let (kind, text) = self.hear_report(report);
        let during = during(xfers);
        Error::new(
            kind,
            format!(
                "{text} (rank {} was{during}, waiting for rank {peer} to connect)",
                self.rank
            ),
        )
    }

    /// Installs the channels that peers' dials made (one per pair: a
    /// second one for a connected pair is dropped).
    #[inline]
    pub(super) fn take_arrived(&mut self) {
        if self.links.as_ref().is_some_and(|l| l.has_arrived()) {
            self.install_arrived();
        }
    }

    /// `take_arrived`'s work, out of line: rare, and kept off the path of
    /// every small message.
    #[cold]
    #[inline(never)]
    fn install_arrived(&mut self) {
        let Some(links) = &self.links else { return };
        for (peer, chan) in links.take_arrived() {
            if self.conns[peer].is_none() {
                self.install(peer, chan);
            }
        }
    }

    fn install(&mut self, peer: usize, chan: Box<dyn Channel>) {
        if self.doorbell.is_some() && chan.caps().through_kernel {
            // A peer over TCP rings no doorbell: naps on it stay short.
            self.mixed = true;
        }
        self.conns[peer] = Some(Box::new(Conn::new(chan)));
        if let Err(at) = self.linked.binary_search(&peer) {
            self.linked.insert(at, peer);
        }
    }
}

/// " in <the call>", for messages.
fn during(xfers: &[Xfer<'_>]) -> String {
    xfers
        .first()
        .map(|x| format!(" in {}", x.desc))
        .unwrap_or_default()
}
