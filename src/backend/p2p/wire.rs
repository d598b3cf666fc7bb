//! The frames of a point-to-point connection. The dialing rank sends
//! messages (Eager with the payload, or Rts and, once the receiver answers
//! Cts, Data with the payload); the accepting rank sends only Cts.

use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};

pub const HEADER_BYTES: usize = 32;
const MAGIC: u16 = 0x5250; // "RP"

/// Messages up to this size travel with their envelope, before their
/// receive is posted (the receiver keeps them until it is); larger ones
/// wait for it. Large enough that a blocking send of any usual size
/// never waits for its receive (programs that send before they receive
/// in both directions keep working, as they did on the shared stream).
pub const EAGER_MAX: usize = 64 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A whole message: envelope and payload.
    Eager = 1,
    /// Request to send: the envelope of a message whose payload waits for Cts.
    Rts = 2,
    /// The payload of message `seq`, after Cts.
    Data = 3,
    /// Clear to send message `seq` (receiver to sender).
    Cts = 4,
    /// The sender's communicator failed or was aborted; the payload is
    /// [error kind, message...] (either direction).
    Failure = 5,
    /// The envelope of a message whose payload the receiver copies
    /// straight from the sender's memory (same host); the payload is
    /// [pid, address] as two u64.
    Remote = 6,
    /// The receiver copied message `seq` (answer to Remote).
    Ack = 7,
}

/// Bytes of a Remote frame's payload.
pub const REMOTE_BYTES: usize = 16;

/// Messages below this size never go single-copy (a round trip costs
/// more than copying them).
pub const REMOTE_MIN: usize = 4 << 10;

/// Longest Failure payload.
pub const FAILURE_MAX: usize = 4096;

/// One frame header. `seq` numbers the messages of one connection from 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub dtype: DType,
    pub tag: i32,
    pub seq: u64,
    /// Elements in the message.
    pub count: u64,
    /// Payload bytes that follow this header.
    pub payload: u64,
}

impl Header {
    /// An answer to message `seq` (Cts or Ack).
    pub fn answer(kind: Kind, seq: u64) -> Header {
        Header {
            kind,
            dtype: DType::Uint8,
            tag: 0,
            seq,
            count: 0,
            payload: 0,
        }
    }

    pub fn cts(seq: u64) -> Header {
        Header {
            kind: Kind::Cts,
            dtype: DType::Uint8,
            tag: 0,
            seq,
            count: 0,
            payload: 0,
        }
    }

    pub fn failure(payload: usize) -> Header {
        Header {
            kind: Kind::Failure,
            dtype: DType::Uint8,
            tag: 0,
            seq: 0,
            count: payload as u64,
            payload: payload as u64,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = self.kind as u8;
        b[3] = self.dtype as i32 as u8;
        b[4..8].copy_from_slice(&self.tag.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.payload.to_le_bytes());
        b
    }

    /// Decodes and checks a header from rank `from`: sizes must agree with
    /// the count and stay within what the kind allows, so a length never
    /// makes the receiver allocate more than `EAGER_MAX`.
    pub fn decode(b: &[u8; HEADER_BYTES], from: usize) -> Result<Header> {
        let corrupt = |what: &str| {
            Error::new(
                ErrorKind::System,
                format!("corrupt point-to-point frame from rank {from}: {what}"),
            )
        };
        if u16::from_le_bytes([b[0], b[1]]) != MAGIC {
            return Err(corrupt("bad magic"));
        }
        let kind = match b[2] {
            1 => Kind::Eager,
            2 => Kind::Rts,
            3 => Kind::Data,
            4 => Kind::Cts,
            5 => Kind::Failure,
            6 => Kind::Remote,
            7 => Kind::Ack,
            _ => return Err(corrupt("unknown frame kind")),
        };
        let dtype = DType::try_from(b[3] as i32).map_err(|_| corrupt("unknown dtype"))?;
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let h = Header {
            kind,
            dtype,
            tag: i32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            seq: word(8),
            count: word(16),
            payload: word(24),
        };
        let bytes = (h.count as usize)
            .checked_mul(dtype.size())
            .ok_or_else(|| corrupt("count overflows"))?;
        let ok = match kind {
            Kind::Eager => bytes <= EAGER_MAX && h.payload == bytes as u64 && h.tag >= 0,
            Kind::Rts => h.payload == 0 && bytes > EAGER_MAX && h.tag >= 0,
            Kind::Data => h.payload == bytes as u64,
            Kind::Cts => h.payload == 0,
            Kind::Failure => h.payload as usize <= FAILURE_MAX && h.payload == bytes as u64,
            Kind::Remote => h.payload == REMOTE_BYTES as u64 && bytes <= EAGER_MAX && h.tag >= 0,
            Kind::Ack => h.payload == 0,
        };
        if !ok {
            return Err(corrupt("sizes that do not agree"));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let h = Header {
            kind: Kind::Eager,
            dtype: DType::Float32,
            tag: 7,
            seq: 3,
            count: 5,
            payload: 20,
        };
        assert_eq!(Header::decode(&h.encode(), 1).unwrap(), h);
        let c = Header::cts(9);
        assert_eq!(Header::decode(&c.encode(), 1).unwrap(), c);
    }

    #[test]
    fn lengths_that_lie_are_refused() {
        let mut h = Header {
            kind: Kind::Eager,
            dtype: DType::Float64,
            tag: 0,
            seq: 0,
            count: 1 << 40,
            payload: 8 << 40,
        };
        // An eager frame may not claim more than EAGER_MAX.
        let e = Header::decode(&h.encode(), 3).unwrap_err();
        assert!(e.message().contains("rank 3"), "{e}");
        // Payload and count must agree.
        h.count = 2;
        h.payload = 17;
        assert!(Header::decode(&h.encode(), 3).is_err());
        // Overflowing counts.
        h.count = u64::MAX;
        assert!(Header::decode(&h.encode(), 3).is_err());
        // Garbage.
        assert!(Header::decode(&[0xAB; HEADER_BYTES], 3).is_err());
        // A negative tag.
        h.count = 1;
        h.payload = 8;
        h.tag = -4;
        assert!(Header::decode(&h.encode(), 3).is_err());
    }
    use crate::test_rng::Rng;

    /// Property: any header bytes decode to an error or a header whose
    /// encoding decodes to the same; never a panic, never a size beyond
    /// what its kind allows (checked by decode itself).
    #[test]
    fn property_p2p_headers_decode_totally() {
        let mut rng = Rng(0x0F0F_1234_5555_AAAA);
        let mut ok = 0;
        let valid = [
            Header {
                kind: Kind::Eager,
                dtype: DType::Float32,
                tag: 7,
                seq: 3,
                count: 5,
                payload: 20,
            }
            .encode(),
            Header::cts(9).encode(),
            Header::failure(12).encode(),
        ];
        for i in 0..200_000 {
            let mut b = valid[i % valid.len()];
            if i % 4 == 0 {
                b.copy_from_slice(&rng.bytes(HEADER_BYTES));
                b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
                b[2] = 1 + rng.below(6) as u8;
            } else {
                for _ in 0..1 + rng.below(2) {
                    b[rng.below(HEADER_BYTES)] = rng.next() as u8;
                }
            }
            if let Ok(h) = Header::decode(&b, 1) {
                ok += 1;
                assert_eq!(Header::decode(&h.encode(), 1).unwrap(), h);
            }
        }
        println!("point-to-point headers: 200000 executions, {ok} decoded");
    }
}
