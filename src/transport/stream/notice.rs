//! Failure notices between ranks: telling the peers that this rank failed
//! or leaves (`fail`, `close`), and the errors that say a peer was lost or
//! left (`lost`, `check_departed`, `closed_peer`).

use super::{Conn, Gone, Progress, StreamTransport};
use crate::descriptor::Desc;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::channel::Channel;
use crate::transport::frame::{self, FrameKind, Header, HEADER_BYTES};
use std::io;
use std::net::Shutdown;
use std::time::{Duration, Instant};

/// How long failure reports and goodbyes may take per peer: they are best
/// effort and must never hold up an error.
const NOTIFY_BUDGET: Duration = Duration::from_millis(200);

impl StreamTransport {
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
        // Pass on a report heard from another rank as it was (every rank
        // that hears it passes it on once, so it reaches the ranks its
        // author could not tell before its peers exited).
        let report = match (&self.heard, err.kind()) {
            (Some(heard), _) => heard.clone(),
            (None, ErrorKind::Aborted) => Error::new(
                err.kind(),
                format!("rank {} aborted the communicator", self.rank),
            ),
            (None, kind) => Error::new(
                kind,
                format!("rank {} failed: {}", self.rank, err.message()),
            ),
        };
        let payload = frame::encode_failure(&report, &self.signal.lost_ranks());
        // Peers that dial this rank from now on get it as their answer.
        if let Some(links) = &self.links {
            links.failed(payload.clone());
        }
        if tell_peers && !self.notified {
            self.notified = true;
            // Peers that connected but were never needed hear it too.
            self.take_arrived();
            let header = Header::control(FrameKind::Failure, payload.len()).encode();
            self.cut_tagged();
            for conn in self.conns.iter_mut().flatten() {
                if conn.gone.is_none() {
                    conn.send_control(&header, &payload);
                }
            }
        }
        // The tagged calls fail with it (their pending frames are cut).
        self.cut_tagged();
        for peer in 0..self.size {
            self.fail_tagged_reading(peer, &err);
        }
        self.tagged.fail_all(err.clone());
        err
    }

    /// A tagged frame cut short counts as the connection's unfinished
    /// frame (a control frame pads it with zeros first), before the tagged
    /// calls are failed and forget it.
    fn cut_tagged(&mut self) {
        for (peer, conn) in self.conns.iter_mut().enumerate() {
            if let Some(conn) = conn {
                conn.unfinished_out += self.tagged.unfinished(peer);
            }
        }
        self.tagged.forget_cut_frames();
    }

    /// `peer`'s process does not answer, or is gone (see
    /// `transport::watch`): it counts as failed, and every call with it
    /// fails with `text`. It is told so (should it run after all, it
    /// fails too rather than wait for this rank), and its connection is
    /// given up.
    pub fn silent(&mut self, peer: usize, text: String) -> Error {
        self.signal.note_lost(peer);
        let err = Error::new(ErrorKind::PeerLost, text);
        if let Some(conn) = self.conns[peer].as_mut() {
            if conn.gone.is_none() {
                let report = Error::new(
                    err.kind(),
                    format!("rank {} gave rank {peer} up: {}", self.rank, err.message()),
                );
                let payload = frame::encode_failure(&report, &self.signal.lost_ranks());
                let header = Header::control(FrameKind::Failure, payload.len()).encode();
                conn.send_control(&header, &payload);
                conn.chan.shutdown(Shutdown::Write);
                conn.gone = Some(Gone::Lost("its process does not answer".into()));
            }
        }
        self.fail_tagged_reading(peer, &err);
        self.tagged.fail_peer(peer, err.clone());
        err
    }

    /// A peer's failure report (a failure frame's payload, or its answer
    /// to a dial): notes the ranks it names as lost and keeps it, to be
    /// passed on as it is. Its kind and text.
    pub(super) fn hear_report(&mut self, payload: &[u8]) -> (ErrorKind, String) {
        let (kind, lost, text) = frame::decode_failure(payload);
        for r in lost
            .into_iter()
            .filter(|r| *r < self.size && *r != self.rank)
        {
            self.signal.note_lost(r);
        }
        self.heard = Some(Error::new(kind, text.clone()));
        (kind, text)
    }

    /// Goodbye: tells peers this rank is leaving (cleanly, or after which
    /// error), lets the kernel deliver what was already sent, and closes
    /// every connection.
    pub fn close(&mut self) {
        self.take_arrived();
        let (header, payload) = match &self.failed {
            None => (Header::control(FrameKind::Bye, 0).encode(), Vec::new()),
            Some(e) => {
                // Peers still waiting learn why, not just that the line went dead.
                let report = Error::new(
                    e.kind(),
                    format!("rank {} left after an error: {}", self.rank, e.message()),
                );
                let payload = frame::encode_failure(&report, &self.signal.lost_ranks());
                (
                    Header::control(FrameKind::Failure, payload.len()).encode(),
                    payload,
                )
            }
        };
        self.cut_tagged();
        for conn in self.conns.iter_mut().flatten() {
            if conn.gone.is_none() {
                conn.send_control(&header, &payload);
            }
            conn.chan.shutdown(Shutdown::Write);
            conn.drain();
        }
        self.conns.clear();
        self.tagged
            .fail_all(Error::invalid_usage("the communicator was destroyed"));
    }

    pub(super) fn lost(&self, peer: usize, why: &str, desc: Option<Desc>) -> Error {
        let age = self.conns[peer]
            .as_ref()
            .map(|c| c.connected_at.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        let during = desc.map(|d| format!(" during {d}")).unwrap_or_default();
        Error::new(
            ErrorKind::PeerLost,
            format!(
                "rank {} lost its connection to rank {peer} ({why}: {}){during}, {age:.1} s after connecting",
                self.rank,
                cause_of(why)
            ),
        )
    }

    /// A peer that left cleanly can't serve transfers still waiting for it.
    pub(super) fn check_departed(&self, p: &Progress) -> Result<()> {
        for &peer in &self.linked {
            let Some(conn) = &self.conns[peer] else {
                continue;
            };
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
}

impl Conn {
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

/// What a lost connection's error says happened: a closed or reset
/// connection is the peer's process ending; a connection that timed out
/// (keepalive) or lost its route is the network, or the peer's host.
pub(super) fn cause_of(why: &str) -> &'static str {
    let network = ["timed out", "no route", "unreachable", "host is down"];
    if network.iter().any(|w| why.contains(w)) {
        "the network to it failed or its host went down; its process may still be running"
    } else {
        "it exited or crashed"
    }
}

#[cfg(test)]
mod tests {
    use super::cause_of;
    use super::Gone;
    use crate::descriptor::{Desc, OpKind};
    use crate::dtype::DType;
    use crate::error::{Error, ErrorKind};
    use crate::transport::stream::progress::tests::tcp_world;
    use crate::transport::{Transport, Xfer};

    /// Rank 0 fails and its report reaches rank 1 only (its connection to
    /// rank 2 is already broken); rank 1 passes it on before it leaves, so
    /// rank 2, waiting on rank 1, learns what happened on rank 0 rather
    /// than only that rank 1's connection closed (a pulled link in CI:
    /// "lost its connection to rank 1 ... it exited or crashed").
    #[test]
    fn a_heard_failure_is_passed_on() {
        let mut w = tcp_world(3).into_iter();
        let (mut t0, mut t1, mut t2) = (w.next().unwrap(), w.next().unwrap(), w.next().unwrap());
        let desc = Desc::new(OpKind::Broadcast, 1).data(4, DType::Uint8);
        let waiter = std::thread::spawn(move || {
            let mut buf = [0u8; 4];
            let e = t2
                .exchange(&mut [Xfer::recv(1, &mut buf, desc)])
                .unwrap_err();
            e.message().to_string()
        });
        t0.conns[2].as_mut().unwrap().gone = Some(Gone::Lost("test".into()));
        t0.fail(
            Error::new(ErrorKind::Timeout, "it timed out on rank 0"),
            true,
        );
        let mut buf = [0u8; 4];
        let e = t1
            .exchange(&mut [Xfer::recv(0, &mut buf, desc)])
            .unwrap_err();
        assert!(
            e.message().starts_with("rank 0 failed: it timed out"),
            "{e}"
        );
        drop(t1);
        let heard = waiter.join().unwrap();
        assert!(
            heard.starts_with("rank 0 failed: it timed out on rank 0 (rank 2 was in broadcast"),
            "{heard}"
        );
        drop(t0);
    }

    #[test]
    fn a_partition_is_told_apart_from_a_crash() {
        for crash in ["connection closed", "connection reset", "broken pipe"] {
            assert_eq!(cause_of(crash), "it exited or crashed", "{crash}");
        }
        for partition in ["timed out", "no route to host", "network is unreachable"] {
            assert!(
                cause_of(partition).starts_with("the network"),
                "{partition}"
            );
        }
    }
}
