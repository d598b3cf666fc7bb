//! The frame header every message carries on a pair's connection, for
//! both contexts: the collectives' frames (labelled with the call they
//! belong to, which the receiver checks) and tagged point-to-point
//! messages (matched by source and tag, see `tagged`).

use crate::descriptor::{Desc, OpKind};
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::ReduceOp;

pub const HEADER_BYTES: usize = 40;
const MAGIC: u16 = 0x5244; // "RD"

/// Most padding a frame carries between its header and its payload.
pub const MAX_PAD: usize = 256;

/// Payloads from this size get padding that places them well in the kernel's
/// buffers (below it the padding would cost more than it saves).
pub const PAD_MIN_PAYLOAD: usize = 64 << 10;

/// Padding to put between the header and a payload at address `payload`
/// when it is copied into the kernel's socket buffers.
///
/// Why: the kernel copies a send into page fragments, starting where the
/// frame starts in a page (usually offset 0), and `rep movsb` on this kind
/// of CPU slows down by up to 2.5x when the destination lies a few bytes
/// ahead of the source modulo 4 KiB. A malloc'd buffer sits 16 bytes into a
/// page, the payload 40 bytes in: 24 bytes ahead, the slow case. The padding
/// moves the payload's place in the fragment to at least `SAFE` bytes
/// ahead (or behind) its source.
pub fn pad_for(payload: usize) -> usize {
    const PAGE: usize = 4096;
    const SAFE: usize = 128;
    let ahead = (HEADER_BYTES + PAGE - payload % PAGE) % PAGE;
    if (SAFE..=PAGE - SAFE).contains(&ahead) {
        0
    } else {
        (SAFE + PAGE - ahead) % PAGE
    }
}

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Payload of an operation.
    Data = 1,
    /// The sender destroyed its communicator cleanly.
    Bye = 2,
    /// The sender's communicator failed; the payload is [kind, message...].
    Failure = 3,
    /// Payload left in the sender's memory for the receiver to copy
    /// (single copy, same host); the wire payload is [address, length].
    Remote = 4,
    /// The receiver finished copying the oldest Remote payload.
    Ack = 5,
    /// A tagged message with its payload (eager).
    TagEager = 6,
    /// A tagged message's envelope; its payload follows the receiver's
    /// `TagCts` (rendezvous).
    TagRts = 7,
    /// Clear to send tagged message `seq` (receiver to sender).
    TagCts = 8,
    /// The payload of tagged message `seq`, after `TagCts`.
    TagData = 9,
    /// A tagged message left in the sender's memory for the receiver to
    /// copy (single copy, same host); the payload is [address, length].
    TagRemote = 10,
    /// The receiver copied tagged message `seq` (answer to `TagRemote`);
    /// its count is how long the copy took in ns (0: not timed).
    TagAck = 11,
}

impl FrameKind {
    /// Whether the frame belongs to the tagged context.
    pub fn is_tagged(self) -> bool {
        self as u8 >= FrameKind::TagEager as u8
    }
}

/// Tagged messages up to this size travel with their envelope, before
/// their receive is posted (the receiver keeps them until it is); larger
/// ones wait for it (`TagRts`). Large enough that a blocking send of any
/// usual size never waits for its receive (programs that send before they
/// receive, in both directions, keep working).
pub const EAGER_MAX: usize = 64 << 20;

/// Longest failure report.
pub const FAILURE_MAX: usize = 1 << 16;

/// Bytes of a Remote frame's descriptor.
pub const REMOTE_BYTES: usize = 16;

/// Bytes of a TagRemote frame's descriptor: the message's address and
/// length in the sender's memory, and the address of the sender's word
/// saying which of its messages to this rank were withdrawn.
pub const TAG_REMOTE_BYTES: usize = 24;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub desc: Desc,
    pub payload: u64,
    /// Bytes of padding between the header and the payload (see `pad_for`).
    pub pad: u16,
}

impl Header {
    pub fn data(desc: Desc, payload: usize) -> Header {
        Header {
            kind: FrameKind::Data,
            desc,
            payload: payload as u64,
            pad: 0,
        }
    }

    pub fn control(kind: FrameKind, payload: usize) -> Header {
        Header {
            kind,
            desc: Desc::new(OpKind::Barrier, 0),
            payload: payload as u64,
            pad: 0,
        }
    }

    /// A tagged frame: message `seq` of its pair, `count` elements of
    /// `dtype` with `tag`, and `payload` bytes after the header.
    pub fn tagged(
        kind: FrameKind,
        seq: u64,
        tag: i32,
        count: u64,
        dtype: DType,
        payload: u64,
    ) -> Header {
        Header {
            kind,
            desc: Desc {
                kind: OpKind::Send,
                dtype,
                redop: ReduceOp::Sum,
                root: tag,
                seq,
                count,
                algo: 0,
            },
            payload,
            pad: 0,
        }
    }

    /// A tagged message's tag.
    pub fn tag(&self) -> i32 {
        self.desc.root
    }

    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let d = &self.desc;
        let mut b = [0u8; HEADER_BYTES];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = self.kind as u8;
        b[3] = d.kind as u8;
        b[4] = d.dtype as i32 as u8;
        b[5] = d.redop as i32 as u8;
        b[6] = d.algo;
        b[8..12].copy_from_slice(&d.root.to_le_bytes());
        b[12..14].copy_from_slice(&self.pad.to_le_bytes());
        b[16..24].copy_from_slice(&d.seq.to_le_bytes());
        b[24..32].copy_from_slice(&d.count.to_le_bytes());
        b[32..40].copy_from_slice(&self.payload.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_BYTES], from: usize) -> Result<Header> {
        let corrupt = |what: &str| {
            Error::new(
                ErrorKind::System,
                format!("corrupt frame from rank {from}: {what} (is something else talking to this port?)"),
            )
        };
        if u16::from_le_bytes([b[0], b[1]]) != MAGIC {
            return Err(corrupt("bad magic"));
        }
        let kind = match b[2] {
            1 => FrameKind::Data,
            2 => FrameKind::Bye,
            3 => FrameKind::Failure,
            4 => FrameKind::Remote,
            5 => FrameKind::Ack,
            6 => FrameKind::TagEager,
            7 => FrameKind::TagRts,
            8 => FrameKind::TagCts,
            9 => FrameKind::TagData,
            10 => FrameKind::TagRemote,
            11 => FrameKind::TagAck,
            _ => return Err(corrupt("unknown frame kind")),
        };
        let op = OpKind::from_wire(b[3]).ok_or_else(|| corrupt("unknown operation"))?;
        let dtype = DType::try_from(b[4] as i32).map_err(|_| corrupt("unknown dtype"))?;
        let redop = ReduceOp::try_from(b[5] as i32).map_err(|_| corrupt("unknown reduction"))?;
        let pad = u16::from_le_bytes([b[12], b[13]]);
        if pad as usize > MAX_PAD {
            return Err(corrupt("padding too long"));
        }
        let word = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        let h = Header {
            kind,
            desc: Desc {
                kind: op,
                dtype,
                redop,
                root: i32::from_le_bytes([b[8], b[9], b[10], b[11]]),
                seq: word(16..24),
                count: word(24..32),
                algo: b[6],
            },
            payload: word(32..40),
            pad,
        };
        // A tagged frame's sizes must agree with its count and stay within
        // what its kind allows: a length never makes the receiver
        // allocate more than `EAGER_MAX` (or a failure report more than
        // `FAILURE_MAX`).
        let bytes = (h.desc.count as usize).checked_mul(dtype.size());
        let sized = |want: Option<usize>| want.is_some_and(|b| h.payload == b as u64);
        let ok = match kind {
            FrameKind::TagEager => sized(bytes) && h.payload <= EAGER_MAX as u64 && h.tag() >= 0,
            FrameKind::TagRts => h.payload == 0 && bytes.is_some() && h.tag() >= 0,
            FrameKind::TagData => sized(bytes),
            FrameKind::TagCts | FrameKind::TagAck => h.payload == 0,
            FrameKind::TagRemote => {
                h.payload == TAG_REMOTE_BYTES as u64 && bytes.is_some() && h.tag() >= 0
            }
            FrameKind::Failure => h.payload <= FAILURE_MAX as u64,
            _ => true,
        };
        if !ok {
            return Err(corrupt("sizes that do not agree"));
        }
        if kind.is_tagged() && op != OpKind::Send {
            return Err(corrupt("a tagged frame for a collective"));
        }
        Ok(h)
    }
}

/// Payload of a Failure frame: the error kind and its message.
/// A failure report: [kind, count of lost ranks (u16), each (u32),
/// message], so that the ranks hearing it learn which ranks the reporting
/// one lost, not only why it failed.
pub fn encode_failure(err: &Error, lost: &[usize]) -> Vec<u8> {
    let lost = &lost[..lost.len().min(MAX_REPORTED_LOST)];
    let mut v = vec![err.kind().code() as u8];
    v.extend_from_slice(&(lost.len() as u16).to_le_bytes());
    for r in lost {
        v.extend_from_slice(&(*r as u32).to_le_bytes());
    }
    let room = FAILURE_MAX.saturating_sub(v.len());
    let text = err.message().as_bytes();
    v.extend_from_slice(&text[..text.len().min(room)]);
    v
}

/// Ranks one failure report names at most (it stays within `FAILURE_MAX`).
const MAX_REPORTED_LOST: usize = 4096;

/// (kind, lost ranks, message) of a failure report; whatever is malformed
/// is read as nothing.
pub fn decode_failure(payload: &[u8]) -> (ErrorKind, Vec<usize>, String) {
    let kind = payload
        .first()
        .and_then(|k| ErrorKind::from_code(*k as i32))
        .unwrap_or(ErrorKind::PeerLost);
    let n = payload
        .get(1..3)
        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let ranks_end = (3 + 4 * n).min(payload.len());
    let lost = payload
        .get(3..ranks_end)
        .unwrap_or(&[])
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .collect();
    let text = String::from_utf8_lossy(payload.get(ranks_end.max(3)..).unwrap_or(&[])).into_owned();
    (kind, lost, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_reports_carry_the_lost_ranks() {
        let e = Error::new(ErrorKind::PeerLost, "rank 1 lost rank 2");
        let (kind, lost, text) = decode_failure(&encode_failure(&e, &[2, 7]));
        assert_eq!(
            (kind, lost, text.as_str()),
            (ErrorKind::PeerLost, vec![2, 7], "rank 1 lost rank 2")
        );
        let (_, lost, text) = decode_failure(&encode_failure(&e, &[]));
        assert_eq!((lost, text.as_str()), (vec![], "rank 1 lost rank 2"));
        // Cut short: no panic, no more ranks than there are bytes.
        let (_, lost, _) = decode_failure(&[4, 9, 0, 1, 0]);
        assert!(lost.is_empty());
    }

    #[test]
    fn headers_round_trip() {
        let desc = Desc::new(OpKind::Reduce, 77)
            .data(12345, DType::Bfloat16)
            .reduction(ReduceOp::Max)
            .root(3);
        let mut h = Header::data(desc, 999);
        h.pad = 200;
        assert_eq!(Header::decode(&h.encode(), 1).unwrap(), h);
    }

    #[test]
    fn padding_keeps_payloads_clear_of_their_source() {
        for addr in (0..3 * 4096).step_by(8) {
            let pad = pad_for(addr);
            assert!(pad <= MAX_PAD, "{addr}: {pad}");
            // Where the payload lands in a fragment page that starts with the header.
            let ahead = (HEADER_BYTES + pad + 4096 - addr % 4096) % 4096;
            assert!(
                (128..=4096 - 128).contains(&ahead),
                "{addr}: pad {pad}, {ahead} ahead"
            );
        }
        // A malloc'd buffer (16 bytes into a page) is the case that needs it.
        assert_eq!(pad_for(16), 104);
        assert_eq!(pad_for(2048), 0);
    }

    #[test]
    fn tagged_lengths_that_lie_are_refused() {
        let ok = Header::tagged(FrameKind::TagEager, 3, 7, 5, DType::Float32, 20);
        assert_eq!(Header::decode(&ok.encode(), 1).unwrap(), ok);
        for bad in [
            // More than an eager message may hold.
            Header::tagged(FrameKind::TagEager, 0, 0, 1 << 40, DType::Float64, 8 << 40),
            // Payload and count disagree.
            Header::tagged(FrameKind::TagEager, 0, 0, 2, DType::Float64, 17),
            Header::tagged(FrameKind::TagData, 0, 0, 2, DType::Float64, 17),
            // Overflowing counts, negative tags, answers with payloads.
            Header::tagged(FrameKind::TagRts, 0, 0, u64::MAX, DType::Float64, 0),
            Header::tagged(FrameKind::TagEager, 0, -4, 1, DType::Float64, 8),
            Header::tagged(FrameKind::TagCts, 0, 0, 0, DType::Uint8, 5),
            Header::tagged(FrameKind::TagRemote, 0, 0, 4, DType::Uint8, 4),
            Header::control(FrameKind::Failure, FAILURE_MAX + 1),
        ] {
            let e = Header::decode(&bad.encode(), 3).unwrap_err();
            assert!(e.message().contains("rank 3"), "{e}");
        }
    }

    #[test]
    fn garbage_is_rejected() {
        let e = Header::decode(&[7u8; HEADER_BYTES], 2).unwrap_err();
        assert!(e.message().contains("rank 2"), "{e}");
        let mut b = Header::data(Desc::new(OpKind::Broadcast, 1), 8).encode();
        b[12..14].copy_from_slice(&(MAX_PAD as u16 + 1).to_le_bytes());
        let e = Header::decode(&b, 1).unwrap_err();
        assert!(e.message().contains("padding"), "{e}");
    }
    use crate::test_rng::Rng;

    /// Property: any 40 bytes from a peer decode to an error or to a
    /// header that encodes back to a header equal to it; never a panic.
    #[test]
    fn property_frame_headers_decode_totally() {
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        let valid = Header::data(
            Desc::new(OpKind::AllReduce, 5).data(64, DType::Float32),
            256,
        )
        .encode();
        let mut ok = 0;
        for i in 0..200_000 {
            let mut b = [0u8; HEADER_BYTES];
            if i % 2 == 0 {
                b.copy_from_slice(&rng.bytes(HEADER_BYTES));
                b[0..2].copy_from_slice(&valid[0..2]);
            } else {
                b = valid;
                for _ in 0..1 + rng.below(3) {
                    b[rng.below(HEADER_BYTES)] = rng.next() as u8;
                }
            }
            if let Ok(h) = Header::decode(&b, 3) {
                ok += 1;
                assert_eq!(Header::decode(&h.encode(), 3).unwrap(), h);
            }
            let _ = decode_failure(&b[..rng.below(HEADER_BYTES)]);
        }
        assert!(ok > 1000, "{ok}");
        println!("frame headers: 200000 executions, {ok} decoded");
    }
}
