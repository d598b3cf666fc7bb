//! The small-message path: whole frames written and read as single
//! shared-memory ring records, without the bookkeeping of `run`.

use super::{deliver, StreamTransport};
use crate::error::Result;
use crate::transport::channel::Channel;
use crate::transport::frame::{FrameKind, Header, HEADER_BYTES, TAG_REMOTE_BYTES};
use crate::transport::tagged::{Incoming, Sink, Status};
use crate::transport::{Dir, Xfer};

/// Most transfers `exchange_whole` takes on (it tracks them in a bitmask).
const WHOLE_MAX_XFERS: usize = 32;
/// Largest payload it takes: small messages, whose cost is bookkeeping.
const WHOLE_MAX_BYTES: usize = 16 << 10;
/// Passes it makes over transfers still waiting before leaving them to
/// `run` (about a microsecond: a peer's answer in a small collective).
const WHOLE_SPINS: u32 = 64;
const WHOLE_SPINS_YIELDING: u32 = 2;

/// The bitmask of the first `n` transfers (n <= WHOLE_MAX_XFERS).
pub(super) fn all_of(n: usize) -> u32 {
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
pub(super) fn keep_unfinished<'x, 'a>(xfers: &'x mut [Xfer<'a>], done: u32) -> &'x mut [Xfer<'a>] {
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
    pub(super) fn exchange_whole(&mut self, xfers: &mut [Xfer<'_>]) -> u32 {
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
                true => {
                    conn.unfinished_out == 0
                        && conn.acks_out.is_empty()
                        && !self.tagged.has_output(x.peer)
                }
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

impl StreamTransport {
    /// Takes the next record from `peer` when it is a whole tagged frame
    /// (shared memory lends small messages whole): the tagged context
    /// matches it without the byte-stream steps. False when the next
    /// record is not one (or nothing is there).
    pub(super) fn take_tagged_whole(&mut self, peer: usize) -> Result<bool> {
        let conn = self.conns[peer].as_mut().expect("peer is not this rank");
        let Some(record) = conn.chan.peek_whole() else {
            return Ok(false);
        };
        if record.len() < HEADER_BYTES || record[2] < FrameKind::TagEager as u8 {
            return Ok(false);
        }
        let head: &[u8; HEADER_BYTES] = record[..HEADER_BYTES].try_into().expect("a header");
        let header = Header::decode(head, peer)?;
        if !header.kind.is_tagged() || header.payload != (record.len() - HEADER_BYTES) as u64 {
            return Ok(false);
        }
        let len = record.len();
        let payload = &record[HEADER_BYTES..];
        let pid = conn.chan.peer_pid();
        match header.kind {
            FrameKind::TagEager => self.tagged.on_whole(peer, &header, payload)?,
            _ => match self.tagged.on_header(peer, &header, pid)? {
                None => {}
                Some(Sink::Descriptor(env)) => {
                    let mut d = [0u8; TAG_REMOTE_BYTES];
                    d.copy_from_slice(&payload[..TAG_REMOTE_BYTES]);
                    self.tagged.on_payload(peer, Sink::Descriptor(env), &d, pid);
                }
                Some(mut sink) => {
                    if let Some(b) = sink.buffer(0) {
                        crate::copy::copy(&mut b[..payload.len()], payload);
                    }
                    self.tagged.on_payload(peer, sink, &[], pid);
                }
            },
        }
        let conn = self.conns[peer].as_mut().expect("peer is not this rank");
        conn.chan.consume_whole(len);
        self.moved = self.moved.wrapping_add(1);
        Ok(true)
    }
}

/// What a blocking receive found on its peer's connection.
pub enum RecvNow {
    /// Its message, copied into its buffer (an error: a single-copy
    /// message its sender withdrew while it was copied).
    Taken(Result<Status>),
    /// Nothing yet; looking again may find it.
    NotYet,
    /// It must be posted (something else is next, or pending, or the
    /// connection does not lend whole messages).
    Post,
}

impl StreamTransport {
    /// Blocking receive `r` takes its message straight from its peer's
    /// next whole record (shared memory), needing no ticket, when nothing
    /// else is pending (`Tagged::receivable_now`) and that record is its
    /// message (`Tagged::take_eager_now`).
    pub fn recv_whole_now(&mut self, r: &Incoming) -> RecvNow {
        if self.failed.is_some() || !self.tagged.receivable_now(r) {
            return RecvNow::Post;
        }
        let Some(peer) = r.peer else {
            return RecvNow::Post;
        };
        let Some(conn) = self.conns.get_mut(peer).and_then(|c| c.as_mut()) else {
            return RecvNow::Post;
        };
        if conn.gone.is_some()
            || !conn.between_frames()
            || !conn.inbox.is_empty()
            || !conn.caps.whole_messages
        {
            return RecvNow::Post;
        }
        let Some(record) = conn.chan.peek_whole() else {
            // Nothing yet, or a record that cannot be lent whole (it
            // wraps around the ring): that one is read the usual way.
            return match conn.chan.has_data() {
                true => RecvNow::Post,
                false => RecvNow::NotYet,
            };
        };
        let kind = record.get(2).copied();
        let single_copy = kind == Some(FrameKind::TagRemote as u8);
        if record.len() < HEADER_BYTES || !(single_copy || kind == Some(FrameKind::TagEager as u8))
        {
            return RecvNow::Post;
        }
        let head: &[u8; HEADER_BYTES] = record[..HEADER_BYTES].try_into().expect("a header");
        let len = record.len();
        if !single_copy {
            // The header it expects, compared whole: no decoding.
            if let Some(status) = self.tagged.take_expected_eager(r, record) {
                // SAFETY: the caller keeps the buffer valid and untouched
                // until this returns; the payload fits (checked).
                let dest = unsafe { r.buf.bytes_mut() };
                crate::copy::copy(&mut dest[..len - HEADER_BYTES], &record[HEADER_BYTES..]);
                conn.chan.consume_whole(len);
                self.moved = self.moved.wrapping_add(1);
                return RecvNow::Taken(Ok(status));
            }
        }
        // A frame that does not decode is reported by the usual path.
        let Ok(header) = Header::decode(head, peer) else {
            return RecvNow::Post;
        };
        if header.payload != (len - HEADER_BYTES) as u64 {
            return RecvNow::Post;
        }
        let taken = if single_copy {
            // Copied out of the sender's memory here, its TagAck written
            // below: no ticket, no matching, no pass over the peers.
            let (Some(pid), Ok(descriptor)) = (
                conn.chan.peer_pid(),
                <&[u8; TAG_REMOTE_BYTES]>::try_from(&record[HEADER_BYTES..]),
            ) else {
                return RecvNow::Post;
            };
            let descriptor = *descriptor;
            match self.tagged.take_remote_now(r, &header, pid, &descriptor) {
                Some(result) => result,
                None => return RecvNow::Post,
            }
        } else {
            let Some(status) = self.tagged.take_eager_now(r, &header) else {
                return RecvNow::Post;
            };
            // SAFETY: the caller keeps the buffer valid and untouched until
            // this returns; `take_eager_now` checked that the payload fits.
            let dest = unsafe { r.buf.bytes_mut() };
            crate::copy::copy(&mut dest[..len - HEADER_BYTES], &record[HEADER_BYTES..]);
            Ok(status)
        };
        let conn = self.conns[peer].as_mut().expect("peer is not this rank");
        conn.chan.consume_whole(len);
        self.moved = self.moved.wrapping_add(1);
        if single_copy {
            // Its sender waits for the answer.
            self.send_answers(peer);
        }
        RecvNow::Taken(taken)
    }
}

/// Completes receive `x` from the next record of `chan` when that record
/// is exactly the frame expected (header and length); false otherwise,
/// leaving the record where it is.
pub(super) fn read_whole(chan: &mut dyn Channel, x: &mut Xfer<'_>) -> bool {
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
