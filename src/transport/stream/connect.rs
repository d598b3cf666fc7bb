//! Connecting the peers an exchange names, on first use (see
//! `transport::link`): this rank dials the lower ones itself and waits for
//! the higher ones' connections, which its endpoint's thread admits
//! (unless a tagged call made the pair already).

use super::{Conn, StreamTransport};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::channel::Channel;
use crate::transport::Xfer;
use std::time::{Duration, Instant};

/// How often a rank waiting for a peer's connection checks that the peer
/// still listens.
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// How long one such check may take.
const PROBE_LIMIT: Duration = Duration::from_millis(100);

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
                if let Err(e) = links.connect(peer, deadline) {
                    // Nobody listens where it did: it is gone.
                    if e.kind() == ErrorKind::PeerLost {
                        self.signal.note_lost(peer);
                    }
                    return Err(e);
                }
            }
            awaited.push(peer);
        }
        self.take_arrived();
        let mut next_probe = Instant::now() + PROBE_EVERY;
        loop {
            awaited.retain(|p| self.conns[*p].is_none());
            if awaited.is_empty() {
                return Ok(());
            }
            if Instant::now() >= next_probe {
                next_probe = Instant::now() + PROBE_EVERY;
                self.probe_listeners(&links, &awaited, xfers)?;
                continue;
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

    /// A peer that never connected may be gone (it exited, or destroyed
    /// its communicator): nobody listens at its address then, which a
    /// connection attempt shows at once (the peer's point-to-point thread
    /// drops the empty connection of one that lives). Without this, a rank
    /// that died before dialing was noticed only at the timeout.
    fn probe_listeners(
        &mut self,
        links: &crate::transport::link::Links,
        awaited: &[usize],
        xfers: &[Xfer<'_>],
    ) -> Result<()> {
        // One peer per round, in turn, briefly: a wide exchange waiting on
        // many peers must not flood their listeners or overrun its timeout.
        self.probed = self.probed.wrapping_add(1);
        if let Some(&peer) = awaited.get(self.probed % awaited.len().max(1)) {
            let addr = links.spec.addrs[peer];
            let probe = std::net::TcpStream::connect_timeout(&addr, PROBE_LIMIT);
            if let Err(e) = probe {
                if e.kind() == std::io::ErrorKind::ConnectionRefused {
                    self.signal.note_lost(peer);
                    let during = during(xfers);
                    return Err(Error::new(
                        ErrorKind::PeerLost,
                        format!(
                            "rank {} waited{during} for rank {peer} to connect, but nobody listens at its address {addr} any more: it exited, or destroyed its communicator",
                            self.rank
                        ),
                    ));
                }
            }
        }
        Ok(())
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
    }
}

/// " in <the call>", for messages.
fn during(xfers: &[Xfer<'_>]) -> String {
    xfers
        .first()
        .map(|x| format!(" in {}", x.desc))
        .unwrap_or_default()
}
