//! The single-copy protocol: the receiver copies a payload straight out
//! of the sender's memory (from the descriptor the sender wrote) and
//! acknowledges it, which completes the send.

use super::{Progress, StreamTransport, STAGE_BYTES};
use crate::descriptor::OpKind;
use crate::error::{describe_io, Error, ErrorKind, Result};
use crate::reduce;
use crate::transport::channel;
use crate::transport::frame::{FrameKind, Header, HEADER_BYTES, REMOTE_BYTES};
use crate::transport::{Dir, Xfer};
use std::io;

impl StreamTransport {
    /// Writes pending acknowledgements (only between data frames). True
    /// when none are left.
    pub(super) fn flush_acks(&mut self, peer: usize, p: &Progress) -> Result<bool> {
        if self.tagged.mid_frame(peer) {
            return Ok(false);
        }
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
                Err(e) => return Err(self.broke(peer, &describe_io(&e), p.desc)),
            }
        }
        conn.unfinished_out = 0;
        Ok(true)
    }

    /// Handles a single-copy descriptor: copies the payload out of the
    /// sender's memory into the posted receive and acknowledges it. With no
    /// receive posted yet, a collective's descriptor waits in the inbox
    /// (every collective posts its receives, and the sender waits for the
    /// ack anyway, so copying it twice through a fresh buffer would only
    /// cost page faults and a memmove); a user send is copied out at once,
    /// so that send-then-recv on both sides still completes.
    pub(super) fn copy_remote(
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
                channel::read_remote(pid, addr, &mut v)
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
    pub(super) fn acknowledge(&mut self, peer: usize, p: &Progress) -> Result<()> {
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
    pub(super) fn read_remote_into(
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
            Dir::Recv(buf) => channel::read_remote(pid, addr, buf).map_err(fail)?,
            Dir::RecvReduce(buf, dtype, op) => {
                // Cache-sized slices: copy one in, combine it, next.
                let conn = self.conns[peer].as_mut().expect("peer is not this rank");
                if conn.stage.len() < STAGE_BYTES {
                    conn.stage.resize(STAGE_BYTES, 0);
                }
                for (k, chunk) in buf.chunks_mut(STAGE_BYTES).enumerate() {
                    let stage = &mut conn.stage[..chunk.len()];
                    channel::read_remote(pid, addr + (k * STAGE_BYTES) as u64, stage)
                        .map_err(fail)?;
                    reduce::reduce_into(chunk, stage, *dtype, *op);
                }
            }
            Dir::Send(_) => unreachable!("receive queue holds receives"),
        }
        Ok(())
    }
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
