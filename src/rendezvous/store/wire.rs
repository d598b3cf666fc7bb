//! rdist's own store protocol; the only code that knows the byte layout.
//!
//! Integers are little-endian. A byte string is a u32 length then the bytes;
//! a key list is a u32 count then that many byte strings. The client first
//! sends the handshake (u32 magic, u32 version) and the server answers with a
//! reply (`Done` or `Failed`). Then each request is a command byte and its
//! fields, answered by one reply: a status byte and its fields.

use std::io::{self, Read};

/// "RDST" when read as little-endian bytes.
pub const MAGIC: u32 = u32::from_le_bytes(*b"RDST");
pub const VERSION: u32 = 1;
/// Longest key or value accepted; longer means a bug or a stranger.
pub const MAX_LEN: usize = 64 << 20;
/// Most keys in one check/wait.
pub const MAX_KEYS: usize = 1 << 20;

const SET: u8 = 1;
const GET: u8 = 2;
const ADD: u8 = 3;
const CHECK: u8 = 4;
const WAIT: u8 = 5;

const DONE: u8 = 0;
const VALUE: u8 = 1;
const INTEGER: u8 = 2;
const FLAG: u8 = 3;
const TIMED_OUT: u8 = 4;
const FAILED: u8 = 5;

/// What a client asks. Timeouts are whole milliseconds.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    Set { key: String, value: Vec<u8> },
    Get { key: String, timeout_ms: u64 },
    Add { key: String, delta: i64 },
    Check { keys: Vec<String> },
    Wait { keys: Vec<String>, timeout_ms: u64 },
}

/// What the server answers.
#[derive(Debug, PartialEq, Eq)]
pub enum Response {
    Done,
    Value(Vec<u8>),
    Integer(i64),
    Flag(bool),
    /// A get/wait ran out of time; the keys still missing.
    TimedOut(Vec<String>),
    /// The request failed; `kind` is an `ErrorKind` code.
    Failed {
        kind: i32,
        message: String,
    },
}

/// Why decoding stopped: the connection, or bytes that break the protocol.
#[derive(Debug)]
pub enum WireError {
    Io(io::Error),
    Protocol(String),
}

impl From<io::Error> for WireError {
    fn from(err: io::Error) -> WireError {
        WireError::Io(err)
    }
}

pub type WireResult<T> = std::result::Result<T, WireError>;

pub fn encode_handshake() -> Vec<u8> {
    let mut out = Vec::with_capacity(8);
    put_u32(&mut out, MAGIC);
    put_u32(&mut out, VERSION);
    out
}

/// Reads and checks a client's handshake.
pub fn decode_handshake(r: &mut impl Read) -> WireResult<()> {
    if get_u32(r)? != MAGIC {
        return Err(WireError::Protocol(
            "this is an rdist rendezvous store; the client did not send its handshake".into(),
        ));
    }
    let version = get_u32(r)?;
    if version != VERSION {
        return Err(WireError::Protocol(format!(
            "store protocol version {version} is not supported (this store speaks version \
             {VERSION}); are all ranks running the same rdist?"
        )));
    }
    Ok(())
}

/// The bytes of a request; fails when a key or value is too long.
pub fn encode_request(request: &Request) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    match request {
        Request::Set { key, value } => {
            out.push(SET);
            put_bytes(&mut out, key.as_bytes())?;
            put_bytes(&mut out, value)?;
        }
        Request::Get { key, timeout_ms } => {
            out.push(GET);
            put_bytes(&mut out, key.as_bytes())?;
            put_u64(&mut out, *timeout_ms);
        }
        Request::Add { key, delta } => {
            out.push(ADD);
            put_bytes(&mut out, key.as_bytes())?;
            put_u64(&mut out, *delta as u64);
        }
        Request::Check { keys } => {
            out.push(CHECK);
            put_keys(&mut out, keys)?;
        }
        Request::Wait { keys, timeout_ms } => {
            out.push(WAIT);
            put_keys(&mut out, keys)?;
            put_u64(&mut out, *timeout_ms);
        }
    }
    Ok(out)
}

pub fn decode_request(r: &mut impl Read) -> WireResult<Request> {
    let request = match get_u8(r)? {
        SET => Request::Set {
            key: get_string(r)?,
            value: get_bytes(r)?,
        },
        GET => Request::Get {
            key: get_string(r)?,
            timeout_ms: get_u64(r)?,
        },
        ADD => Request::Add {
            key: get_string(r)?,
            delta: get_u64(r)? as i64,
        },
        CHECK => Request::Check { keys: get_keys(r)? },
        WAIT => Request::Wait {
            keys: get_keys(r)?,
            timeout_ms: get_u64(r)?,
        },
        other => return Err(WireError::Protocol(format!("unknown command {other}"))),
    };
    Ok(request)
}

/// The bytes of a reply; fails when a value is too long.
pub fn encode_response(response: &Response) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    match response {
        Response::Done => out.push(DONE),
        Response::Value(value) => {
            out.push(VALUE);
            put_bytes(&mut out, value)?;
        }
        Response::Integer(n) => {
            out.push(INTEGER);
            put_u64(&mut out, *n as u64);
        }
        Response::Flag(flag) => {
            out.push(FLAG);
            out.push(u8::from(*flag));
        }
        Response::TimedOut(missing) => {
            out.push(TIMED_OUT);
            put_keys(&mut out, missing)?;
        }
        Response::Failed { kind, message } => {
            out.push(FAILED);
            put_u32(&mut out, *kind as u32);
            put_bytes(&mut out, message.as_bytes())?;
        }
    }
    Ok(out)
}

pub fn decode_response(r: &mut impl Read) -> WireResult<Response> {
    let response = match get_u8(r)? {
        DONE => Response::Done,
        VALUE => Response::Value(get_bytes(r)?),
        INTEGER => Response::Integer(get_u64(r)? as i64),
        FLAG => match get_u8(r)? {
            0 => Response::Flag(false),
            1 => Response::Flag(true),
            other => return Err(WireError::Protocol(format!("bad flag value {other}"))),
        },
        TIMED_OUT => Response::TimedOut(get_keys(r)?),
        FAILED => Response::Failed {
            kind: get_u32(r)? as i32,
            message: String::from_utf8_lossy(&get_bytes(r)?).into_owned(),
        },
        other => return Err(WireError::Protocol(format!("unknown reply status {other}"))),
    };
    Ok(response)
}

fn put_u32(out: &mut Vec<u8>, n: u32) {
    out.extend_from_slice(&n.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(&n.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) -> Result<(), String> {
    if bytes.len() > MAX_LEN {
        return Err(format!(
            "{} bytes is longer than the store's limit of {} MiB",
            bytes.len(),
            MAX_LEN >> 20
        ));
    }
    put_u32(out, bytes.len() as u32);
    out.extend_from_slice(bytes);
    Ok(())
}

fn put_keys(out: &mut Vec<u8>, keys: &[String]) -> Result<(), String> {
    if keys.len() > MAX_KEYS {
        return Err(format!(
            "{} keys are more than the store's limit of {MAX_KEYS} per request",
            keys.len()
        ));
    }
    put_u32(out, keys.len() as u32);
    keys.iter().try_for_each(|k| put_bytes(out, k.as_bytes()))
}

fn get_u8(r: &mut impl Read) -> WireResult<u8> {
    let mut buf = [0u8; 1];
    r.read_exact(&mut buf)?;
    Ok(buf[0])
}

fn get_u32(r: &mut impl Read) -> WireResult<u32> {
    let mut buf = [0u8; 4];
    r.read_exact(&mut buf)?;
    Ok(u32::from_le_bytes(buf))
}

fn get_u64(r: &mut impl Read) -> WireResult<u64> {
    let mut buf = [0u8; 8];
    r.read_exact(&mut buf)?;
    Ok(u64::from_le_bytes(buf))
}

fn get_bytes(r: &mut impl Read) -> WireResult<Vec<u8>> {
    let len = get_u32(r)? as usize;
    if len > MAX_LEN {
        return Err(WireError::Protocol(format!(
            "a length of {len} bytes exceeds the limit of {} MiB",
            MAX_LEN >> 20
        )));
    }
    // Read through `take` so memory grows with the bytes that really
    // arrive, not with what the length claims.
    let mut bytes = Vec::new();
    r.take(len as u64).read_to_end(&mut bytes)?;
    if bytes.len() != len {
        return Err(WireError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(bytes)
}

fn get_string(r: &mut impl Read) -> WireResult<String> {
    String::from_utf8(get_bytes(r)?)
        .map_err(|_| WireError::Protocol("a key is not valid UTF-8".into()))
}

fn get_keys(r: &mut impl Read) -> WireResult<Vec<String>> {
    let count = get_u32(r)? as usize;
    if count > MAX_KEYS {
        return Err(WireError::Protocol(format!(
            "{count} keys are more than the limit of {MAX_KEYS}"
        )));
    }
    (0..count).map(|_| get_string(r)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_requests_and_replies_round_trip() {
        let requests = [
            Request::Set {
                key: "k".into(),
                value: vec![0, 255, 7],
            },
            Request::Get {
                key: "k".into(),
                timeout_ms: u64::MAX,
            },
            Request::Add {
                key: "k".into(),
                delta: -3,
            },
            Request::Check {
                keys: vec!["a".into(), "b".into()],
            },
            Request::Wait {
                keys: vec![],
                timeout_ms: 5,
            },
        ];
        for request in requests {
            let bytes = encode_request(&request).unwrap();
            assert_eq!(decode_request(&mut bytes.as_slice()).unwrap(), request);
        }
        let responses = [
            Response::Done,
            Response::Value(b"v".to_vec()),
            Response::Integer(i64::MIN),
            Response::Flag(true),
            Response::TimedOut(vec!["x".into()]),
            Response::Failed {
                kind: 3,
                message: "m".into(),
            },
        ];
        for response in responses {
            let bytes = encode_response(&response).unwrap();
            assert_eq!(decode_response(&mut bytes.as_slice()).unwrap(), response);
        }
        let truncated = encode_request(&Request::Check {
            keys: vec!["abc".into()],
        })
        .unwrap();
        let cut = &truncated[..truncated.len() - 1];
        assert!(matches!(
            decode_request(&mut &cut[..]),
            Err(WireError::Io(_))
        ));
    }
}
