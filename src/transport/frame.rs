//! The frame header every message carries on a stream connection.

use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::op::{Desc, OpKind};
use crate::reduce::ReduceOp;

pub const HEADER_BYTES: usize = 40;
const MAGIC: u16 = 0x5244; // "RD"

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
}

/// Bytes of a Remote frame's descriptor.
pub const REMOTE_BYTES: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub desc: Desc,
    pub payload: u64,
}

impl Header {
    pub fn data(desc: Desc, payload: usize) -> Header {
        Header {
            kind: FrameKind::Data,
            desc,
            payload: payload as u64,
        }
    }

    pub fn control(kind: FrameKind, payload: usize) -> Header {
        Header {
            kind,
            desc: Desc::new(OpKind::Barrier, 0),
            payload: payload as u64,
        }
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
            _ => return Err(corrupt("unknown frame kind")),
        };
        let op = OpKind::from_wire(b[3]).ok_or_else(|| corrupt("unknown operation"))?;
        let dtype = DType::try_from(b[4] as i32).map_err(|_| corrupt("unknown dtype"))?;
        let redop = ReduceOp::try_from(b[5] as i32).map_err(|_| corrupt("unknown reduction"))?;
        let word = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        Ok(Header {
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
        })
    }
}

/// Payload of a Failure frame: the error kind and its message.
pub fn encode_failure(err: &Error) -> Vec<u8> {
    let mut v = vec![err.kind().code() as u8];
    v.extend_from_slice(err.message().as_bytes());
    v
}

pub fn decode_failure(payload: &[u8]) -> (ErrorKind, String) {
    let kind = payload
        .first()
        .and_then(|k| ErrorKind::from_code(*k as i32))
        .unwrap_or(ErrorKind::PeerLost);
    let text = String::from_utf8_lossy(payload.get(1..).unwrap_or(&[])).into_owned();
    (kind, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let desc = Desc::new(OpKind::Reduce, 77)
            .data(12345, DType::Bfloat16)
            .reduction(ReduceOp::Max)
            .root(3);
        let h = Header::data(desc, 999);
        assert_eq!(Header::decode(&h.encode(), 1).unwrap(), h);
    }

    #[test]
    fn garbage_is_rejected() {
        let e = Header::decode(&[7u8; HEADER_BYTES], 2).unwrap_err();
        assert!(e.message().contains("rank 2"), "{e}");
    }
}
