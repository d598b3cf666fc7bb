//! PyTorch's TCPStore wire protocol, both sides; the only code that knows
//! the byte layout. rdist's store server and client speak it, so torch
//! clients use rdist's store, rdist joins torch's (torchrun's agent store),
//! and one store serves both.
//!
//! A query is a type byte and its fields. Strings and byte vectors are a
//! u64 length and the bytes; key counts are u64; integers are
//! little-endian (every platform torch runs on). A client first sends
//! `Validate` with the magic number (no reply). Set, append and multi_set
//! have no reply; the others answer as [`QueryType`] documents. Types from
//! 0xF0 up are rdist's own extensions (a torch server drops a client that
//! sends one): authentication with the job's token (see `crate::auth`),
//! and a wait that answers with the value.

use crate::auth::{NONCE_BYTES, PROOF_BYTES};

/// Sent with `Validate`: proves the client speaks this protocol.
pub const MAGIC: u32 = 0x3C85_F7CE;
/// Longest value accepted (torch's libuv server takes 8 MiB); longer
/// means a bug or a stranger.
pub const MAX_VALUE: usize = 64 << 20;
/// Longest key accepted (torch's libuv server takes 8 KiB).
pub const MAX_KEY: usize = 64 << 10;
/// Most keys in one check, wait or multi_get/multi_set (as torch).
pub const MAX_KEYS: usize = 128 << 10;

/// Replies to auth_hello and auth_proof.
pub const AUTH_CHALLENGE: u8 = 0;
pub const AUTH_NO_TOKEN: u8 = 1;
pub const AUTH_ACCEPTED: u8 = 0;

/// Replies to check.
pub const READY: u8 = 0;
pub const NOT_READY: u8 = 1;
/// Replies to wait (and cancel_wait).
pub const STOP_WAITING: u8 = 0;
pub const WAIT_CANCELED: u8 = 1;

/// The query types, with torch's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum QueryType {
    /// u32 magic; no reply.
    Validate = 0,
    /// key, value; no reply.
    Set = 1,
    /// key, expected, desired; replies the value now stored (or
    /// `expected` when the key is missing and `expected` is not empty).
    CompareSet = 2,
    /// key; replies the value (a missing key breaks the connection: clients wait first).
    Get = 3,
    /// key, i64; replies the new i64 (the value is stored as decimal text).
    Add = 4,
    /// keys; replies READY or NOT_READY.
    Check = 5,
    /// keys; replies STOP_WAITING once all exist.
    Wait = 6,
    /// replies the number of keys as i64.
    NumKeys = 7,
    /// key; replies how many keys were deleted (0 or 1) as i64.
    DeleteKey = 8,
    /// key, value; appends (or sets); no reply.
    Append = 9,
    /// keys; replies each value in order.
    MultiGet = 10,
    /// count, then key and value pairs; no reply.
    MultiSet = 11,
    /// replies WAIT_CANCELED after withdrawing any pending wait.
    CancelWait = 12,
    /// u32 nonce; replies the nonce.
    Ping = 13,
    /// key, value: appends to the queue under key; no reply.
    QueuePush = 14,
    /// key; replies the queue's length before as i64, then (if it was
    /// not empty) the first item, which is removed.
    QueuePop = 15,
    /// key; replies the queue's length as i64.
    QueueLen = 16,
    /// replies the number of keys as i64, then each key.
    ListKeys = 17,
    /// key, i64 world size: adds 1 to the counter under key; replies
    /// STOP_WAITING once the counter reaches the world size.
    Barrier = 18,
    /// rdist: the client's 32-byte nonce; replies AUTH_CHALLENGE, the
    /// store's nonce and its proof, or AUTH_NO_TOKEN.
    AuthHello = 0xF0,
    /// rdist: the client's 32-byte proof; replies AUTH_ACCEPTED (or the
    /// store disconnects).
    AuthProof = 0xF1,
    /// rdist: key; replies STOP_WAITING and the value once the key exists
    /// (withdrawn with CancelWait, as a wait; for a key, not a queue: a
    /// push to a queue of that name answers it with an empty value). A wide job's ranks all wait
    /// for one value: answered in the store's one turn when it is set,
    /// where a wait and then a get took a turn of the store per rank.
    WaitGet = 0xF2,
    /// rdist: counter key, i64 last, key, value, u8 wait: adds 1 to the
    /// counter; the query that brings it to `last` sets key to value
    /// (unless key is set already: a rank that failed said so there);
    /// then, when wait is 1, as WaitGet for key (else no reply). A barrier
    /// whose release says something, in one query per rank.
    Arrive = 0xF3,
}

impl QueryType {
    fn from_byte(byte: u8) -> Option<QueryType> {
        use QueryType::*;
        Some(match byte {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => NumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            14 => QueuePush,
            15 => QueuePop,
            16 => QueueLen,
            17 => ListKeys,
            18 => Barrier,
            0xF0 => AuthHello,
            0xF1 => AuthProof,
            0xF2 => WaitGet,
            0xF3 => Arrive,
            _ => return None,
        })
    }
}

/// A decoded query; byte strings borrow from the receive buffer, so a
/// query that is still arriving costs no copies however often it is tried.
#[derive(Debug, PartialEq, Eq)]
pub enum Query<'a> {
    Validate(u32),
    Set(&'a [u8], &'a [u8]),
    CompareSet(&'a [u8], &'a [u8], &'a [u8]),
    Get(&'a [u8]),
    Add(&'a [u8], i64),
    Check(Vec<&'a [u8]>),
    Wait(Vec<&'a [u8]>),
    NumKeys,
    DeleteKey(&'a [u8]),
    Append(&'a [u8], &'a [u8]),
    MultiGet(Vec<&'a [u8]>),
    MultiSet(Vec<(&'a [u8], &'a [u8])>),
    CancelWait,
    Ping(u32),
    QueuePush(&'a [u8], &'a [u8]),
    QueuePop(&'a [u8]),
    QueueLen(&'a [u8]),
    ListKeys,
    Barrier(&'a [u8], i64),
    AuthHello(&'a [u8]),
    AuthProof(&'a [u8]),
    WaitGet(&'a [u8]),
    Arrive(&'a [u8], i64, &'a [u8], &'a [u8], bool),
}

/// Why a query could not be decoded yet, or ever.
#[derive(Debug, PartialEq, Eq)]
pub enum Undecodable {
    /// More bytes are needed.
    Incomplete,
    /// The bytes break the protocol (the connection cannot be trusted).
    Invalid(String),
}

/// A cursor over received bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Undecodable> {
        let end = self.at.checked_add(n).ok_or(Undecodable::Incomplete)?;
        let slice = self
            .bytes
            .get(self.at..end)
            .ok_or(Undecodable::Incomplete)?;
        self.at = end;
        Ok(slice)
    }

    fn u8(&mut self) -> Result<u8, Undecodable> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, Undecodable> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, Undecodable> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A length-prefixed byte string, refused when longer than MAX_VALUE
    /// before any of it arrives.
    fn bytes(&mut self) -> Result<&'a [u8], Undecodable> {
        let len = self.u64()?;
        if len > MAX_VALUE as u64 {
            return Err(Undecodable::Invalid(format!(
                "a key or value of {len} bytes (the limit is {} MiB)",
                MAX_VALUE >> 20
            )));
        }
        self.take(len as usize)
    }

    fn key(&mut self) -> Result<&'a [u8], Undecodable> {
        let at = self.at;
        let len = self.u64()?;
        if len > MAX_KEY as u64 {
            return Err(Undecodable::Invalid(format!(
                "a key of {len} bytes (the limit is {} KiB)",
                MAX_KEY >> 10
            )));
        }
        self.at = at;
        self.bytes()
    }

    fn count(&mut self) -> Result<usize, Undecodable> {
        let n = self.u64()?;
        if n > MAX_KEYS as u64 {
            return Err(Undecodable::Invalid(format!(
                "{n} keys in one query (the limit is {MAX_KEYS})"
            )));
        }
        Ok(n as usize)
    }

    fn keys(&mut self) -> Result<Vec<&'a [u8]>, Undecodable> {
        let n = self.count()?;
        let mut keys = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

/// Decodes the query at the start of `bytes`; returns it and how many bytes
/// it took.
pub fn decode_query(bytes: &[u8]) -> Result<(Query<'_>, usize), Undecodable> {
    let mut r = Reader { bytes, at: 0 };
    let byte = r.u8()?;
    let Some(kind) = QueryType::from_byte(byte) else {
        return Err(Undecodable::Invalid(format!("unknown query type {byte}")));
    };
    let query = match kind {
        QueryType::Validate => Query::Validate(r.u32()?),
        QueryType::Set => Query::Set(r.key()?, r.bytes()?),
        QueryType::CompareSet => Query::CompareSet(r.key()?, r.bytes()?, r.bytes()?),
        QueryType::Get => Query::Get(r.key()?),
        QueryType::Add => Query::Add(r.key()?, r.u64()? as i64),
        QueryType::Check => Query::Check(r.keys()?),
        QueryType::Wait => Query::Wait(r.keys()?),
        QueryType::NumKeys => Query::NumKeys,
        QueryType::DeleteKey => Query::DeleteKey(r.key()?),
        QueryType::Append => Query::Append(r.key()?, r.bytes()?),
        QueryType::MultiGet => Query::MultiGet(r.keys()?),
        QueryType::MultiSet => {
            let n = r.count()?;
            let mut pairs = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                pairs.push((r.key()?, r.bytes()?));
            }
            Query::MultiSet(pairs)
        }
        QueryType::CancelWait => Query::CancelWait,
        QueryType::Ping => Query::Ping(r.u32()?),
        QueryType::QueuePush => Query::QueuePush(r.key()?, r.bytes()?),
        QueryType::QueuePop => Query::QueuePop(r.key()?),
        QueryType::QueueLen => Query::QueueLen(r.key()?),
        QueryType::ListKeys => Query::ListKeys,
        QueryType::Barrier => Query::Barrier(r.key()?, r.u64()? as i64),
        QueryType::AuthHello => Query::AuthHello(r.take(NONCE_BYTES)?),
        QueryType::AuthProof => Query::AuthProof(r.take(PROOF_BYTES)?),
        QueryType::WaitGet => Query::WaitGet(r.key()?),
        QueryType::Arrive => Query::Arrive(
            r.key()?,
            r.u64()? as i64,
            r.key()?,
            r.bytes()?,
            match r.u8()? {
                0 => false,
                1 => true,
                other => return Err(Undecodable::Invalid(format!("arrive's wait flag {other}"))),
            },
        ),
    };
    Ok((query, r.at))
}

/// Appends the bytes of `query` to `out` (the client side).
pub fn encode_query(query: &Query<'_>, out: &mut Vec<u8>) {
    fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(b);
    }
    fn put_keys(out: &mut Vec<u8>, keys: &[&[u8]]) {
        out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        keys.iter().for_each(|k| put_bytes(out, k));
    }
    let kind = match query {
        Query::Validate(_) => QueryType::Validate,
        Query::Set(..) => QueryType::Set,
        Query::CompareSet(..) => QueryType::CompareSet,
        Query::Get(_) => QueryType::Get,
        Query::Add(..) => QueryType::Add,
        Query::Check(_) => QueryType::Check,
        Query::Wait(_) => QueryType::Wait,
        Query::NumKeys => QueryType::NumKeys,
        Query::DeleteKey(_) => QueryType::DeleteKey,
        Query::Append(..) => QueryType::Append,
        Query::MultiGet(_) => QueryType::MultiGet,
        Query::MultiSet(_) => QueryType::MultiSet,
        Query::CancelWait => QueryType::CancelWait,
        Query::Ping(_) => QueryType::Ping,
        Query::QueuePush(..) => QueryType::QueuePush,
        Query::QueuePop(_) => QueryType::QueuePop,
        Query::QueueLen(_) => QueryType::QueueLen,
        Query::ListKeys => QueryType::ListKeys,
        Query::Barrier(..) => QueryType::Barrier,
        Query::AuthHello(_) => QueryType::AuthHello,
        Query::AuthProof(_) => QueryType::AuthProof,
        Query::WaitGet(_) => QueryType::WaitGet,
        Query::Arrive(..) => QueryType::Arrive,
    };
    out.push(kind as u8);
    match query {
        Query::Validate(n) | Query::Ping(n) => out.extend_from_slice(&n.to_le_bytes()),
        Query::Set(k, v) | Query::Append(k, v) | Query::QueuePush(k, v) => {
            put_bytes(out, k);
            put_bytes(out, v);
        }
        Query::CompareSet(k, expected, desired) => {
            put_bytes(out, k);
            put_bytes(out, expected);
            put_bytes(out, desired);
        }
        Query::Get(k)
        | Query::DeleteKey(k)
        | Query::QueuePop(k)
        | Query::QueueLen(k)
        | Query::WaitGet(k) => put_bytes(out, k),
        Query::Add(k, delta) | Query::Barrier(k, delta) => {
            put_bytes(out, k);
            out.extend_from_slice(&delta.to_le_bytes());
        }
        Query::Check(keys) | Query::Wait(keys) | Query::MultiGet(keys) => put_keys(out, keys),
        Query::MultiSet(pairs) => {
            out.extend_from_slice(&(pairs.len() as u64).to_le_bytes());
            for (k, v) in pairs {
                put_bytes(out, k);
                put_bytes(out, v);
            }
        }
        Query::Arrive(counter, last, k, v, wait) => {
            put_bytes(out, counter);
            out.extend_from_slice(&last.to_le_bytes());
            put_bytes(out, k);
            put_bytes(out, v);
            out.push(u8::from(*wait));
        }
        Query::NumKeys | Query::CancelWait | Query::ListKeys => {}
        Query::AuthHello(fixed) | Query::AuthProof(fixed) => out.extend_from_slice(fixed),
    }
}

/// Appends an i64 reply.
pub fn put_i64(out: &mut Vec<u8>, n: i64) {
    out.extend_from_slice(&n.to_le_bytes());
}

/// Appends a byte-vector reply.
pub fn put_value(out: &mut Vec<u8>, value: &[u8]) {
    out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    out.extend_from_slice(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_queries() -> Vec<Query<'static>> {
        vec![
            Query::Validate(MAGIC),
            Query::Set(b"k", &[0, 255, 7]),
            Query::CompareSet(b"k", b"", b"new"),
            Query::Get(b"k"),
            Query::Add(b"k", -3),
            Query::Check(vec![b"a", b"b"]),
            Query::Wait(vec![]),
            Query::NumKeys,
            Query::DeleteKey(b"k"),
            Query::Append(b"k", b"more"),
            Query::MultiGet(vec![b"a"]),
            Query::MultiSet(vec![(b"a", b"1"), (b"b", b"")]),
            Query::CancelWait,
            Query::Ping(0xDEAD_BEEF),
            Query::QueuePush(b"q", b"item"),
            Query::QueuePop(b"q"),
            Query::QueueLen(b"q"),
            Query::ListKeys,
            Query::Barrier(b"b", 4),
            Query::AuthHello(&[7; 32]),
            Query::AuthProof(&[9; 32]),
            Query::WaitGet(b"k"),
            Query::Arrive(b"n", 3, b"k", b"ok", true),
            Query::Arrive(b"n", 3, b"k", b"", false),
        ]
    }

    #[test]
    fn every_query_round_trips_and_every_prefix_is_incomplete() {
        for query in all_queries() {
            let mut bytes = Vec::new();
            encode_query(&query, &mut bytes);
            assert_eq!(decode_query(&bytes), Ok((query, bytes.len())));
            for cut in 0..bytes.len() {
                assert_eq!(
                    decode_query(&bytes[..cut]).err(),
                    Some(Undecodable::Incomplete),
                    "{cut} bytes of {bytes:?}"
                );
            }
        }
    }

    #[test]
    fn the_layout_is_torchs() {
        // Set("ab", [1]): type 1, u64 length 2, "ab", u64 length 1, 1.
        let mut bytes = Vec::new();
        encode_query(&Query::Set(b"ab", &[1]), &mut bytes);
        let mut expected = vec![1u8, 2, 0, 0, 0, 0, 0, 0, 0, b'a', b'b'];
        expected.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(bytes, expected);
        let mut bytes = Vec::new();
        encode_query(&Query::Validate(MAGIC), &mut bytes);
        assert_eq!(bytes, [0, 0xCE, 0xF7, 0x85, 0x3C]);
    }

    #[test]
    fn absurd_lengths_and_types_are_refused_before_the_bytes_arrive() {
        let mut huge = vec![QueryType::Set as u8, 1, 0, 0, 0, 0, 0, 0, 0, b'k'];
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(
            matches!(decode_query(&huge), Err(Undecodable::Invalid(m)) if m.contains("64 MiB"))
        );
        let mut many = vec![QueryType::Check as u8];
        many.extend_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(decode_query(&many), Err(Undecodable::Invalid(_))));
        assert!(matches!(decode_query(&[0xF7]), Err(Undecodable::Invalid(m)) if m.contains("247")));
        let mut long_key = vec![QueryType::Get as u8];
        long_key.extend_from_slice(&(1u64 << 20).to_le_bytes());
        assert!(
            matches!(decode_query(&long_key), Err(Undecodable::Invalid(m)) if m.contains("KiB"))
        );
    }
    use crate::test_rng::Rng;

    /// Property: whatever arrives, decoding never panics, never claims
    /// more bytes than it was given, and what it decodes re-encodes to
    /// exactly the bytes it took (so no two byte strings mean one query).
    /// Inputs: random bytes, and valid queries with bytes flipped, cut
    /// and appended.
    #[test]
    fn property_decoding_is_total_and_canonical() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let valid: Vec<Vec<u8>> = all_queries()
            .iter()
            .map(|q| {
                let mut b = Vec::new();
                encode_query(q, &mut b);
                b
            })
            .collect();
        let mut executions = 0u64;
        let mut decoded = 0u64;
        for i in 0..200_000 {
            let input = if i % 2 == 0 {
                let len = rng.below(48);
                let mut b = rng.bytes(len);
                // Mostly known types, so decoding gets past the first byte.
                if let Some(first) = b.first_mut() {
                    *first %= 20;
                }
                b
            } else {
                let mut b = valid[rng.below(valid.len())].clone();
                for _ in 0..rng.below(3) {
                    let at = rng.below(b.len());
                    b[at] = rng.next() as u8;
                }
                match rng.below(3) {
                    0 => {
                        let n = rng.below(b.len() + 1);
                        b.truncate(n);
                    }
                    1 => {
                        let n = rng.below(8);
                        b.extend(rng.bytes(n));
                    }
                    _ => {}
                }
                b
            };
            executions += 1;
            if let Ok((query, used)) = decode_query(&input) {
                decoded += 1;
                assert!(used <= input.len());
                let mut again = Vec::new();
                encode_query(&query, &mut again);
                assert_eq!(again, &input[..used], "{query:?}");
            }
        }
        assert!(
            decoded > 10_000,
            "only {decoded} of {executions} inputs decoded"
        );
        println!("store protocol: {executions} executions, {decoded} decoded");
    }
}
