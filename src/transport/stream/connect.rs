//! Connecting the peers an exchange names, on first use (see
//! `transport::link`): this rank dials the lower ones itself and waits for
//! the higher ones' connections, which its point-to-point thread admits.

use super::{Conn, StreamTransport};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::channel::Channel;
use crate::transport::Xfer;
use std::time::Instant;

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
                let chan = links.dial(peer, deadline)?;
                self.install(peer, chan);
            } else {
                awaited.push(peer);
            }
        }
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
                let during = xfers
                    .first()
                    .map(|x| format!(" in {}", x.desc))
                    .unwrap_or_default();
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

    /// Installs the channels that peers' dials made (one per pair: a
    /// second one for a connected pair is dropped).
    pub(super) fn take_arrived(&mut self) {
        let Some(links) = &self.links else { return };
        for (peer, chan) in links.take_arrived() {
            if self.conns[peer].is_none() {
                self.install(peer, chan);
            }
        }
    }

    fn install(&mut self, peer: usize, chan: Box<dyn Channel>) {
        if self.doorbell.is_some() && chan.copies_through_kernel() {
            // A peer over TCP rings no doorbell: naps on it stay short.
            self.mixed = true;
        }
        self.conns[peer] = Some(Conn::new(chan));
    }
}
