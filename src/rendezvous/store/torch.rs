//! PyTorch's TCPStore protocol, client side: how rdist meets through a
//! store that torch hosts (torchrun's agent store, or a `TCPStore` a
//! program made). Keys go under a prefix of rdist's own, behind the "/"
//! torch's own clients put before every key, so torch and rdist share one
//! store without collisions and a Python `store.get()` sees rdist's keys.
//!
//! The protocol: after connecting, the client sends a validation (query 0
//! and a magic number), then a ping (a nonce the server echoes). Queries
//! are a type byte and values; strings and byte vectors are a u64 length
//! and the bytes; integers are little-endian (every platform torch runs
//! the store on). Set has no reply; get, add, check, wait and ping do.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{key_timeout_error, lock, seconds, Store, OPERATION_TIMEOUT};
use crate::error::{describe_io, Error, ErrorKind, Result};

const MAGIC: u32 = 0x3C85_F7CE;

#[derive(Clone, Copy)]
#[repr(u8)]
enum Query {
    Validate = 0,
    Set = 1,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    CancelWait = 12,
    Ping = 13,
}

/// Replies to check and wait.
const READY: u8 = 0;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// The most a value may claim to be (torch's own limit is far larger; a
/// rendezvous value is a few dozen bytes).
const MAX_VALUE: u64 = 64 << 20;

/// A client of a PyTorch TCPStore.
pub struct TorchStoreClient {
    addr: SocketAddr,
    /// Put before every key (after torch's "/").
    prefix: String,
    connection: Mutex<Connection>,
}

struct Connection {
    stream: TcpStream,
    /// Set once a query failed half-way (the stream is then out of step).
    broken: Option<Error>,
}

/// Whether something at `addr` answers as a PyTorch TCPStore (validation
/// and ping), within `bound`.
pub fn answers_as_torch_store(addr: SocketAddr, bound: Duration) -> bool {
    TcpStream::connect_timeout(&addr, bound)
        .and_then(|s| handshake(&s, bound))
        .is_ok()
}

fn handshake(stream: &TcpStream, bound: Duration) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(bound.max(Duration::from_millis(1))))?;
    let nonce = std::process::id() ^ 0x5244_4953;
    let mut hello = vec![Query::Validate as u8];
    hello.extend_from_slice(&MAGIC.to_le_bytes());
    hello.push(Query::Ping as u8);
    hello.extend_from_slice(&nonce.to_le_bytes());
    (&*stream).write_all(&hello)?;
    let mut echo = [0u8; 4];
    (&*stream).read_exact(&mut echo)?;
    if u32::from_le_bytes(echo) != nonce {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the ping came back wrong",
        ));
    }
    Ok(())
}

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
    buf.extend_from_slice(b);
}

impl TorchStoreClient {
    /// Connects to the TCPStore at `addr`, retrying refused connects until
    /// `deadline` (the store may come up after this rank). rdist's keys go
    /// under `base` and the number of this meeting: each rank counts its
    /// meetings in the store itself, so the n-th communicator every rank
    /// creates gets keys of its own, and destroying and creating
    /// communicators on one store never meets an earlier one's keys.
    pub fn connect(
        addr: SocketAddr,
        base: &str,
        rank: usize,
        deadline: Instant,
    ) -> Result<TorchStoreClient> {
        let mut c = TorchStoreClient::dial(addr, deadline)?;
        let n = c.add(&format!("{base}meetings/{rank}"), 1)?;
        c.prefix = format!("{base}{n}/");
        Ok(c)
    }

    fn dial(addr: SocketAddr, deadline: Instant) -> Result<TorchStoreClient> {
        let mut pause = Duration::from_millis(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
                .and_then(|s| handshake(&s, left.min(Duration::from_secs(10))).map(|_| s));
            match attempt {
                Ok(stream) => {
                    let _ = stream.set_read_timeout(None);
                    return Ok(TorchStoreClient {
                        addr,
                        prefix: String::new(),
                        connection: Mutex::new(Connection {
                            stream,
                            broken: None,
                        }),
                    });
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset
                    ) && Instant::now() + pause < deadline =>
                {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData) => {
                    return Err(Error::new(
                        ErrorKind::System,
                        format!(
                            "the store at {addr} answered but does not speak PyTorch's TCPStore protocol ({}): is something else listening on that port?",
                            describe_io(&e)
                        ),
                    ))
                }
                Err(e) => {
                    return Err(Error::new(
                        ErrorKind::PeerLost,
                        format!(
                            "could not reach the PyTorch store at {addr} within {}: {} (is the launcher's store up?)",
                            seconds(left),
                            describe_io(&e)
                        ),
                    ))
                }
            }
        }
    }

    fn key(&self, key: &str) -> String {
        format!("/{}{key}", self.prefix)
    }

    /// Sends `query` and reads a reply of `reply` bytes (0: none), bounded
    /// by `bound`; `read` decodes it.
    fn query<T>(
        &self,
        query: &[u8],
        bound: Duration,
        read: impl FnOnce(&mut TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let mut c = lock(&self.connection);
        if let Some(e) = &c.broken {
            return Err(e.clone());
        }
        let r = (|| {
            c.stream
                .set_read_timeout(Some(bound.max(Duration::from_millis(1))))?;
            c.stream.write_all(query)?;
            read(&mut c.stream)
        })();
        r.map_err(|e| {
            let err = self.failed(&e, bound);
            c.broken = Some(err.clone());
            err
        })
    }

    fn failed(&self, e: &io::Error, bound: Duration) -> Error {
        let addr = self.addr;
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::new(
                ErrorKind::Timeout,
                format!("the PyTorch store at {addr} did not answer within {}", seconds(bound)),
            ),
            _ => Error::new(
                ErrorKind::PeerLost,
                format!(
                    "lost the connection to the PyTorch store at {addr}: {} (did the launcher's agent exit?)",
                    describe_io(e)
                ),
            ),
        }
    }

    fn keys_query(&self, q: Query, keys: &[&str]) -> Vec<u8> {
        let mut b = vec![q as u8];
        b.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut b, self.key(k).as_bytes());
        }
        b
    }
}

fn read_u8(s: &mut TcpStream) -> io::Result<u8> {
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u64(s: &mut TcpStream) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

impl Store for TorchStoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut q = vec![Query::Set as u8];
        put_bytes(&mut q, self.key(key).as_bytes());
        put_bytes(&mut q, value);
        // No reply: a ping after it tells that the store took it.
        let nonce = 0x7365_7421u32;
        q.push(Query::Ping as u8);
        q.extend_from_slice(&nonce.to_le_bytes());
        self.query(&q, OPERATION_TIMEOUT, |s| {
            let mut b = [0u8; 4];
            s.read_exact(&mut b)?;
            if u32::from_le_bytes(b) != nonce {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a wrong ping reply",
                ));
            }
            Ok(())
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        let mut q = vec![Query::Get as u8];
        put_bytes(&mut q, self.key(key).as_bytes());
        self.query(&q, OPERATION_TIMEOUT, |s| {
            let len = read_u64(s)?;
            if len > MAX_VALUE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a value of {len} bytes"),
                ));
            }
            let mut v = vec![0u8; len as usize];
            s.read_exact(&mut v)?;
            Ok(v)
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut q = vec![Query::Add as u8];
        put_bytes(&mut q, self.key(key).as_bytes());
        q.extend_from_slice(&delta.to_le_bytes());
        self.query(&q, OPERATION_TIMEOUT, |s| {
            let mut b = [0u8; 8];
            s.read_exact(&mut b)?;
            Ok(i64::from_le_bytes(b))
        })
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let q = self.keys_query(Query::Check, keys);
        self.query(&q, OPERATION_TIMEOUT, |s| Ok(read_u8(s)? == READY))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let q = self.keys_query(Query::Wait, keys);
        let mut c = lock(&self.connection);
        if let Some(e) = &c.broken {
            return Err(e.clone());
        }
        let r: io::Result<bool> = (|| {
            c.stream
                .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
            c.stream.write_all(&q)?;
            match read_u8(&mut c.stream) {
                Ok(STOP_WAITING) => Ok(true),
                Ok(other) => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("wait answered {other}"),
                )),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    // Withdraw the wait; the store answers WAIT_CANCELED
                    // (after STOP_WAITING if the keys came just now).
                    c.stream.set_read_timeout(Some(OPERATION_TIMEOUT))?;
                    c.stream.write_all(&[Query::CancelWait as u8])?;
                    let mut stopped = false;
                    loop {
                        match read_u8(&mut c.stream)? {
                            WAIT_CANCELED => return Ok(stopped),
                            STOP_WAITING => stopped = true,
                            other => {
                                return Err(io::Error::new(
                                    io::ErrorKind::InvalidData,
                                    format!("cancel answered {other}"),
                                ))
                            }
                        }
                    }
                }
                Err(e) => Err(e),
            }
        })();
        match r {
            Ok(true) => Ok(()),
            Ok(false) => {
                drop(c);
                let missing: Vec<String> = keys
                    .iter()
                    .filter(|k| !self.check(&[k]).unwrap_or(false))
                    .map(|k| k.to_string())
                    .collect();
                Err(key_timeout_error(timeout, &missing))
            }
            Err(e) => {
                let err = self.failed(&e, timeout);
                c.broken = Some(err.clone());
                Err(err)
            }
        }
    }
}
