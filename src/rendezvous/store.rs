//! The rendezvous key-value store: how ranks find each other.
//!
//! Rank 0 hosts a [`TcpStoreServer`]; every rank (rank 0 included) talks to it
//! through a [`TcpStoreClient`]. On a shared file system a [`FileStore`] does
//! the same job without a server. [`PrefixStore`] gives each user of a store its
//! own key space.
//!
//! The TCP protocol is rdist's own for now (see the `wire` module): a handshake
//! (magic number + protocol version), then length-prefixed requests and
//! replies. Encoding and decoding live only in `wire`, so that a later version
//! can speak PyTorch's TCPStore protocol and add authentication there.

use std::collections::HashMap;
use std::fs;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::error::{describe_io, Error, ErrorKind, Result};

use wire::{Request, Response, WireError};

/// Bound on the operations that never wait for other ranks (set, add, check).
const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);
/// Extra time a client gives the server beyond a server-side wait, so a slow
/// reply is not mistaken for a dead server.
const REPLY_MARGIN: Duration = Duration::from_secs(2);
/// How long the server waits for a new client's handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How many missing keys a timeout message names before "and N more".
const MAX_NAMED_KEYS: usize = 8;

/// A key-value store shared by all ranks of a job.
pub trait Store: Send + Sync {
    /// Stores `value` under `key`, replacing any previous value.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Waits until `key` exists (up to `timeout`), then returns its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Atomically adds `delta` to the integer stored at key (missing = 0;
    /// stored as decimal ASCII), returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// True when all keys exist. Never blocks (beyond one round trip).
    fn check(&self, keys: &[&str]) -> Result<bool>;
    /// Waits until all keys exist, up to `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
}

// ---------------------------------------------------------------------------
// Helpers shared by every store
// ---------------------------------------------------------------------------

/// A duration as people read it in messages: "2.0 s".
fn seconds(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}

/// The deadline `timeout` from now; `None` when it is too far to represent
/// (which means: wait without a deadline).
fn deadline_after(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

/// The error for a get/wait that ran out of time, naming the missing keys.
fn key_timeout_error(timeout: Duration, missing: &[String]) -> Error {
    let mut named: Vec<String> = missing
        .iter()
        .take(MAX_NAMED_KEYS)
        .map(|k| format!("'{k}'"))
        .collect();
    let what = match missing.len() {
        0 => String::from("keys"),
        1 => format!("key {}", named.remove(0)),
        n if n <= MAX_NAMED_KEYS => format!("keys {}", named.join(", ")),
        n => format!("keys {} and {} more", named.join(", "), n - MAX_NAMED_KEYS),
    };
    Error::new(
        ErrorKind::Timeout,
        format!(
            "timed out after {} waiting for {what} in the rendezvous store",
            seconds(timeout)
        ),
    )
}

/// `current + delta` for add(): the stored value must be a decimal integer.
fn add_to_counter(key: &str, current: Option<&[u8]>, delta: i64) -> Result<i64> {
    let current = match current {
        None => 0,
        Some(bytes) => std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.trim().parse::<i64>().ok())
            .ok_or_else(|| {
                Error::invalid_argument(format!(
                    "the value of key '{key}' in the rendezvous store is not a decimal integer, \
                     so add() cannot update it"
                ))
            })?,
    };
    current.checked_add(delta).ok_or_else(|| {
        Error::invalid_argument(format!(
            "adding {delta} to key '{key}' (now {current}) would overflow a 64-bit integer"
        ))
    })
}

/// Locks a mutex even if another thread panicked while holding it: the data
/// behind our mutexes is never left half-updated.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---------------------------------------------------------------------------
// PrefixStore
// ---------------------------------------------------------------------------

/// A view of another store in which every key becomes `"{prefix}/{key}"`.
pub struct PrefixStore {
    inner: Arc<dyn Store>,
    prefix: String,
}

impl PrefixStore {
    /// A view of `inner` that puts `prefix/` in front of every key.
    pub fn new(inner: Arc<dyn Store>, prefix: impl Into<String>) -> PrefixStore {
        PrefixStore {
            inner,
            prefix: prefix.into(),
        }
    }

    fn full_key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }

    fn full_keys(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.full_key(k)).collect()
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.full_key(key), value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.full_key(key), timeout)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.full_key(key), delta)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let full = self.full_keys(keys);
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.check(&refs)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full = self.full_keys(keys);
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }
}

// ---------------------------------------------------------------------------
// Wire protocol
// ---------------------------------------------------------------------------

/// rdist's own store protocol; the only code that knows the byte layout.
///
/// Integers are little-endian. A byte string is a u32 length then the bytes;
/// a key list is a u32 count then that many byte strings. The client first
/// sends the handshake (u32 magic, u32 version) and the server answers with a
/// reply (`Done` or `Failed`). Then each request is a command byte and its
/// fields, answered by one reply: a status byte and its fields.
mod wire {
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
}

/// Whole milliseconds for the wire, saturating.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

/// The keys and values, shared by all connection threads.
struct ServerState {
    data: Mutex<HashMap<String, Vec<u8>>>,
    /// Notified on every set/add and when the server stops.
    changed: Condvar,
    stopping: AtomicBool,
}

/// How a server-side wait ended.
enum Waited<T> {
    Ready(T),
    /// Ran out of time; the keys still missing.
    TimedOut(Vec<String>),
    Stopping,
}

impl ServerState {
    fn new() -> ServerState {
        ServerState {
            data: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
        }
    }

    fn set(&self, key: String, value: Vec<u8>) {
        lock(&self.data).insert(key, value);
        self.changed.notify_all();
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut data = lock(&self.data);
        let sum = add_to_counter(key, data.get(key).map(Vec::as_slice), delta)?;
        data.insert(key.to_string(), sum.to_string().into_bytes());
        drop(data);
        self.changed.notify_all();
        Ok(sum)
    }

    fn check(&self, keys: &[String]) -> bool {
        let data = lock(&self.data);
        keys.iter().all(|k| data.contains_key(k))
    }

    /// Waits until `probe` succeeds, the timeout passes or the server stops.
    /// `probe` returns the keys it still misses when it fails.
    fn wait_until<T>(
        &self,
        timeout: Duration,
        mut probe: impl FnMut(&HashMap<String, Vec<u8>>) -> std::result::Result<T, Vec<String>>,
    ) -> Waited<T> {
        let deadline = deadline_after(timeout);
        let mut data = lock(&self.data);
        loop {
            // Checked under the lock that stop() takes before notifying, so
            // the wake-up cannot be missed.
            if self.stopping.load(Ordering::SeqCst) {
                return Waited::Stopping;
            }
            let missing = match probe(&data) {
                Ok(found) => return Waited::Ready(found),
                Err(missing) => missing,
            };
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                return Waited::TimedOut(missing);
            }
            data = match self.changed.wait_timeout(data, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    /// Wakes every waiting connection thread and makes it give up.
    fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let _guard = lock(&self.data);
        self.changed.notify_all();
    }
}

/// Answers one request; `None` when the server is stopping (the connection
/// is then closed without a reply, which the client reports as lost).
fn handle_request(state: &ServerState, request: Request) -> Option<Response> {
    let response = match request {
        Request::Set { key, value } => {
            state.set(key, value);
            Response::Done
        }
        Request::Get { key, timeout_ms } => {
            let waited = state.wait_until(Duration::from_millis(timeout_ms), |data| {
                data.get(&key).cloned().ok_or_else(|| vec![key.clone()])
            });
            match waited {
                Waited::Ready(value) => Response::Value(value),
                Waited::TimedOut(missing) => Response::TimedOut(missing),
                Waited::Stopping => return None,
            }
        }
        Request::Add { key, delta } => match state.add(&key, delta) {
            Ok(sum) => Response::Integer(sum),
            Err(err) => failed(&err),
        },
        Request::Check { keys } => Response::Flag(state.check(&keys)),
        Request::Wait { keys, timeout_ms } => {
            let waited = state.wait_until(Duration::from_millis(timeout_ms), |data| {
                let missing: Vec<String> = keys
                    .iter()
                    .filter(|k| !data.contains_key(*k))
                    .cloned()
                    .collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(missing)
                }
            });
            match waited {
                Waited::Ready(()) => Response::Done,
                Waited::TimedOut(missing) => Response::TimedOut(missing),
                Waited::Stopping => return None,
            }
        }
    };
    Some(response)
}

/// A failure reply carrying an error.
fn failed(err: &Error) -> Response {
    Response::Failed {
        kind: err.kind().code(),
        message: err.message().to_string(),
    }
}

fn send_response(mut stream: &TcpStream, response: &Response) -> io::Result<()> {
    let bytes = wire::encode_response(response).or_else(|msg| {
        wire::encode_response(&failed(&Error::internal(format!(
            "the rendezvous store cannot send its reply: {msg}"
        ))))
    });
    match bytes {
        Ok(bytes) => stream.write_all(&bytes),
        Err(msg) => Err(io::Error::new(io::ErrorKind::InvalidData, msg)),
    }
}

/// Serves one client until it leaves, breaks the protocol or the server stops.
fn serve_connection(stream: TcpStream, state: &ServerState) {
    let mut reader = BufReader::new(&stream);
    if accept_handshake(&mut reader, &stream).is_ok() {
        serve_requests(&mut reader, &stream, state);
    }
    // Other handles to this socket exist (the acceptor keeps one to shut it
    // down), so close it explicitly for the client to notice.
    let _ = stream.shutdown(Shutdown::Both);
}

fn accept_handshake(reader: &mut impl Read, stream: &TcpStream) -> io::Result<()> {
    // A client that never finishes its handshake must not hold a thread.
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    match wire::decode_handshake(reader) {
        Ok(()) => {
            send_response(stream, &Response::Done)?;
            stream.set_read_timeout(None)
        }
        Err(WireError::Io(err)) => Err(err),
        Err(WireError::Protocol(msg)) => {
            let _ = send_response(stream, &failed(&Error::new(ErrorKind::System, &*msg)));
            Err(io::Error::new(io::ErrorKind::InvalidData, msg))
        }
    }
}

fn serve_requests(reader: &mut impl Read, stream: &TcpStream, state: &ServerState) {
    loop {
        let request = match wire::decode_request(reader) {
            Ok(request) => request,
            Err(WireError::Io(_)) => return,
            Err(WireError::Protocol(msg)) => {
                // The byte stream can no longer be trusted: say why, then drop.
                let err = Error::new(ErrorKind::System, format!("store protocol error: {msg}"));
                let _ = send_response(stream, &failed(&err));
                return;
            }
        };
        let Some(response) = handle_request(state, request) else {
            return;
        };
        if send_response(stream, &response).is_err() {
            return;
        }
    }
}

/// A client connection: a handle to shut its socket down, and its thread.
struct Connection {
    stream: TcpStream,
    thread: JoinHandle<()>,
}

/// The acceptor thread: accepts until woken through `waker`, then returns
/// the live connections for the server's Drop to close and join.
fn accept_loop(
    listener: TcpListener,
    waker: UnixStream,
    state: Arc<ServerState>,
) -> Vec<Connection> {
    let mut connections = Vec::new();
    while wait_for_clients(&listener, &waker) && !state.stopping.load(Ordering::SeqCst) {
        accept_pending(&listener, &state, &mut connections);
        join_finished(&mut connections);
    }
    connections
}

/// Sleeps until the listener has clients to accept (true) or the waker was
/// shut down (false).
fn wait_for_clients(listener: &TcpListener, waker: &UnixStream) -> bool {
    let mut fds = [pollfd(listener.as_raw_fd()), pollfd(waker.as_raw_fd())];
    // SAFETY: `fds` is a valid array of two pollfd for the whole call.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
    if ready < 0 {
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            // Should not happen; avoid spinning while the caller re-checks.
            thread::sleep(Duration::from_millis(10));
        }
        return true;
    }
    fds[1].revents == 0
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

fn accept_pending(
    listener: &TcpListener,
    state: &Arc<ServerState>,
    connections: &mut Vec<Connection>,
) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Some(connection) = start_connection(stream, state) {
                    connections.push(connection);
                }
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
            Err(_) => {
                // E.g. out of file descriptors: back off instead of spinning.
                thread::sleep(Duration::from_millis(10));
                return;
            }
        }
    }
}

/// Starts the thread serving one client; `None` (dropping the client) when
/// the socket or thread cannot be set up.
fn start_connection(stream: TcpStream, state: &Arc<ServerState>) -> Option<Connection> {
    // Some platforms let accepted sockets inherit the listener's non-blocking mode.
    stream.set_nonblocking(false).ok()?;
    stream.set_nodelay(true).ok()?;
    let handle = stream.try_clone().ok()?;
    let state = Arc::clone(state);
    let thread = thread::Builder::new()
        .name("rdist-store-conn".into())
        .spawn(move || serve_connection(stream, &state))
        .ok()?;
    Some(Connection {
        stream: handle,
        thread,
    })
}

/// Joins the threads of clients that left, so they do not pile up.
fn join_finished(connections: &mut Vec<Connection>) {
    let (finished, live): (Vec<_>, Vec<_>) =
        connections.drain(..).partition(|c| c.thread.is_finished());
    *connections = live;
    for connection in finished {
        let _ = connection.thread.join();
    }
}

/// The rendezvous store server, hosted by rank 0. Serves until dropped.
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    state: Arc<ServerState>,
    /// Shut down to wake the acceptor thread when stopping.
    waker: UnixStream,
    acceptor: Option<JoinHandle<Vec<Connection>>>,
}

impl TcpStoreServer {
    /// Binds and starts serving in background threads.
    pub fn bind(addr: SocketAddr) -> Result<TcpStoreServer> {
        let cannot_host = |err: &io::Error| {
            Error::system(format!("cannot host the rendezvous store on {addr}"), err)
        };
        let listener = TcpListener::bind(addr).map_err(|e| cannot_host(&e))?;
        let local_addr = listener.local_addr().map_err(|e| cannot_host(&e))?;
        // Non-blocking so that a readiness report that turns out stale
        // cannot block the acceptor in accept().
        listener
            .set_nonblocking(true)
            .map_err(|e| cannot_host(&e))?;
        let (waker, wake_signal) = UnixStream::pair().map_err(|e| cannot_host(&e))?;
        let state = Arc::new(ServerState::new());
        let acceptor_state = Arc::clone(&state);
        let acceptor = thread::Builder::new()
            .name("rdist-store-accept".into())
            .spawn(move || accept_loop(listener, wake_signal, acceptor_state))
            .map_err(|e| cannot_host(&e))?;
        Ok(TcpStoreServer {
            local_addr,
            state,
            waker,
            acceptor: Some(acceptor),
        })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for TcpStoreServer {
    /// Stops serving: wakes and joins the acceptor (so no new client can
    /// arrive), then shuts down every client socket and joins its thread.
    fn drop(&mut self) {
        self.state.stop();
        // Shutting down (rather than writing to) the socket cannot raise
        // SIGPIPE in a host process that does not ignore it.
        let _ = self.waker.shutdown(Shutdown::Both);
        let Some(acceptor) = self.acceptor.take() else {
            return;
        };
        let connections = acceptor.join().unwrap_or_default();
        for connection in &connections {
            let _ = connection.stream.shutdown(Shutdown::Both);
        }
        for connection in connections {
            let _ = connection.thread.join();
        }
    }
}

// ---------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------

/// The connection of a client, and whether it can still be used.
struct ClientConnection {
    reader: BufReader<TcpStream>,
    /// Set once a request failed half-way: the byte stream is then out of
    /// step, so every later request fails with the same error.
    broken: Option<Error>,
}

/// A connection to the rendezvous store server. Requests from several
/// threads are serialised.
pub struct TcpStoreClient {
    addr: String,
    connection: Mutex<ClientConnection>,
}

/// Why one connection attempt failed.
enum AttemptError {
    /// Worth retrying (server not up yet, name not resolvable yet...).
    Retry(String),
    /// Retrying cannot help (the server rejected us).
    Fatal(Error),
}

impl TcpStoreClient {
    /// Connects to "host:port" (host may be a name, IPv4 or [IPv6]),
    /// retrying refused/failed connects with backoff (10 ms growing to
    /// 200 ms) until `deadline`, so ranks may start before the server.
    pub fn connect(addr: &str, deadline: Instant) -> Result<TcpStoreClient> {
        check_address(addr)?;
        let patience = deadline.saturating_duration_since(Instant::now());
        let mut backoff = Duration::from_millis(10);
        loop {
            let last_error = match connect_once(addr, deadline) {
                Ok(stream) => return Ok(TcpStoreClient::from_stream(addr, stream)),
                Err(AttemptError::Fatal(err)) => return Err(err),
                Err(AttemptError::Retry(reason)) => reason,
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "could not reach the rendezvous store at {addr} within {} \
                         (last error: {last_error}); is rank 0 (the master) running?",
                        seconds(patience)
                    ),
                ));
            }
            thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }

    fn from_stream(addr: &str, stream: TcpStream) -> TcpStoreClient {
        TcpStoreClient {
            addr: addr.to_string(),
            connection: Mutex::new(ClientConnection {
                reader: BufReader::new(stream),
                broken: None,
            }),
        }
    }

    /// Sends one request and reads its reply, both bounded by `bound`.
    fn request(&self, request: &Request, bound: Duration) -> Result<Response> {
        let bytes = wire::encode_request(request).map_err(|msg| {
            Error::invalid_argument(format!("cannot send to the rendezvous store: {msg}"))
        })?;
        let mut connection = lock(&self.connection);
        if let Some(err) = &connection.broken {
            return Err(err.clone());
        }
        match exchange(&mut connection.reader, &bytes, bound) {
            Ok(response) => Ok(response),
            Err(err) => {
                let err = self.connection_error(err, bound);
                connection.broken = Some(err.clone());
                Err(err)
            }
        }
    }

    fn connection_error(&self, err: WireError, bound: Duration) -> Error {
        let addr = &self.addr;
        match err {
            WireError::Io(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the rendezvous store at {addr} did not answer within {}",
                        seconds(bound)
                    ),
                )
            }
            WireError::Io(err) => Error::new(
                ErrorKind::PeerLost,
                format!(
                    "lost the connection to the rendezvous store at {addr} ({})",
                    describe_io(&err)
                ),
            ),
            WireError::Protocol(msg) => Error::new(
                ErrorKind::System,
                format!("the rendezvous store at {addr} broke the store protocol: {msg}"),
            ),
        }
    }

    /// The error for a reply that is not the success `operation` expects.
    fn reply_error(&self, operation: &str, response: Response, timeout: Duration) -> Error {
        match response {
            Response::Failed { kind, message } => Error::new(
                ErrorKind::from_code(kind).unwrap_or(ErrorKind::Internal),
                message,
            ),
            Response::TimedOut(missing) => key_timeout_error(timeout, &missing),
            other => Error::new(
                ErrorKind::System,
                format!(
                    "the rendezvous store at {} answered {operation} with an unexpected reply \
                     ({other:?})",
                    self.addr
                ),
            ),
        }
    }
}

/// Writes a request and reads the reply, with socket timeouts of `bound`.
fn exchange(
    reader: &mut BufReader<TcpStream>,
    request: &[u8],
    bound: Duration,
) -> wire::WireResult<Response> {
    let stream = reader.get_mut();
    stream.set_read_timeout(Some(bound))?;
    stream.set_write_timeout(Some(bound))?;
    stream.write_all(request)?;
    wire::decode_response(reader)
}

/// Rejects addresses that are not "host:port" before any retrying.
fn check_address(addr: &str) -> Result<()> {
    let bad = || {
        Error::invalid_argument(format!(
            "the rendezvous store address '{addr}' is not host:port (use [addr]:port for IPv6)"
        ))
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
    if host.is_empty() || (host.contains(':') && !bracketed) {
        return Err(bad());
    }
    Ok(())
}

/// One attempt: resolve, connect to the first address that answers, handshake.
fn connect_once(addr: &str, deadline: Instant) -> std::result::Result<TcpStream, AttemptError> {
    // Give each attempt a sensible slice, even when the deadline has passed.
    let attempt_timeout = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(200), Duration::from_secs(10));
    let resolved = addr
        .to_socket_addrs()
        .map_err(|e| AttemptError::Retry(describe_io(&e)))?;
    let mut last_error = String::from("the name resolved to no address");
    for socket_addr in resolved {
        match TcpStream::connect_timeout(&socket_addr, attempt_timeout) {
            Ok(stream) => return handshake(addr, stream, attempt_timeout),
            Err(err) => last_error = describe_io(&err),
        }
    }
    Err(AttemptError::Retry(last_error))
}

fn handshake(
    addr: &str,
    mut stream: TcpStream,
    timeout: Duration,
) -> std::result::Result<TcpStream, AttemptError> {
    let io_failure = |err: &io::Error| AttemptError::Retry(describe_io(err));
    stream.set_nodelay(true).map_err(|e| io_failure(&e))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| io_failure(&e))?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(|e| io_failure(&e))?;
    stream
        .write_all(&wire::encode_handshake())
        .map_err(|e| io_failure(&e))?;
    match wire::decode_response(&mut stream) {
        Ok(Response::Done) => Ok(stream),
        Ok(Response::Failed { message, .. }) => Err(AttemptError::Fatal(Error::new(
            ErrorKind::System,
            format!("the rendezvous store at {addr} rejected this client: {message}"),
        ))),
        Ok(other) => Err(AttemptError::Fatal(Error::new(
            ErrorKind::System,
            format!("the rendezvous store at {addr} answered the handshake with {other:?}"),
        ))),
        Err(WireError::Io(err)) => Err(io_failure(&err)),
        Err(WireError::Protocol(msg)) => Err(AttemptError::Fatal(Error::new(
            ErrorKind::System,
            format!("the server at {addr} does not speak the rdist store protocol: {msg}"),
        ))),
    }
}

fn owned_keys(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| k.to_string()).collect()
}

impl Store for TcpStoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let request = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.request(&request, OPERATION_TIMEOUT)? {
            Response::Done => Ok(()),
            other => Err(self.reply_error("set", other, OPERATION_TIMEOUT)),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let request = Request::Get {
            key: key.to_string(),
            timeout_ms: millis(timeout),
        };
        match self.request(&request, timeout.saturating_add(REPLY_MARGIN))? {
            Response::Value(value) => Ok(value),
            other => Err(self.reply_error("get", other, timeout)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let request = Request::Add {
            key: key.to_string(),
            delta,
        };
        match self.request(&request, OPERATION_TIMEOUT)? {
            Response::Integer(sum) => Ok(sum),
            other => Err(self.reply_error("add", other, OPERATION_TIMEOUT)),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let request = Request::Check {
            keys: owned_keys(keys),
        };
        match self.request(&request, OPERATION_TIMEOUT)? {
            Response::Flag(all_exist) => Ok(all_exist),
            other => Err(self.reply_error("check", other, OPERATION_TIMEOUT)),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let request = Request::Wait {
            keys: owned_keys(keys),
            timeout_ms: millis(timeout),
        };
        match self.request(&request, timeout.saturating_add(REPLY_MARGIN))? {
            Response::Done => Ok(()),
            other => Err(self.reply_error("wait", other, timeout)),
        }
    }
}

// ---------------------------------------------------------------------------
// FileStore
// ---------------------------------------------------------------------------

/// Longest key a FileStore takes: its hex form must fit in a file name.
const MAX_FILE_KEY_LEN: usize = 120;
const FILE_POLL_START: Duration = Duration::from_millis(5);
const FILE_POLL_MAX: Duration = Duration::from_millis(50);
const LOCK_FILE: &str = "lock";

/// A store in a directory on a shared file system ("file:///path"
/// rendezvous): one file per key, named after the key in hex.
///
/// Values are written to a temporary file and renamed into place, so readers
/// never see a partial value; add() is serialised with flock() on a lock file.
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// Opens the store in directory `path`, creating it if missing.
    pub fn new(path: &Path) -> Result<FileStore> {
        fs::create_dir_all(path).map_err(|e| {
            Error::system(
                format!("cannot create the rendezvous directory {}", path.display()),
                &e,
            )
        })?;
        Ok(FileStore {
            dir: path.to_path_buf(),
        })
    }

    /// Removes the store's files (the whole directory).
    pub fn remove(&self) -> Result<()> {
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(self.io_error("cannot remove the rendezvous directory", &err)),
        }
    }

    fn io_error(&self, what: &str, err: &io::Error) -> Error {
        Error::system(format!("{what} {}", self.dir.display()), err)
    }

    fn key_path(&self, key: &str) -> Result<PathBuf> {
        if key.len() > MAX_FILE_KEY_LEN {
            return Err(Error::invalid_argument(format!(
                "key '{key}' is too long for a file rendezvous store ({} bytes; at most \
                 {MAX_FILE_KEY_LEN})",
                key.len()
            )));
        }
        let hex: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        Ok(self.dir.join(format!("key-{hex}")))
    }

    /// The value of `key`, or `None` while it does not exist.
    fn read_key(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match fs::read(self.key_path(key)?) {
            Ok(value) => Ok(Some(value)),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(self.io_error(&format!("cannot read key '{key}' from"), &err)),
        }
    }

    fn key_exists(&self, key: &str) -> Result<bool> {
        match fs::metadata(self.key_path(key)?) {
            Ok(_) => Ok(true),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(err) => Err(self.io_error(&format!("cannot look up key '{key}' in"), &err)),
        }
    }

    fn missing_keys(&self, keys: &[&str]) -> Result<Vec<String>> {
        let mut missing = Vec::new();
        for key in keys {
            if !self.key_exists(key)? {
                missing.push(key.to_string());
            }
        }
        Ok(missing)
    }

    /// Writes a whole value under a unique temporary name, then renames it
    /// over the key's file (atomic within one directory).
    fn write_key(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.key_path(key)?;
        let temp = self.dir.join(temp_file_name());
        let written = fs::write(&temp, value).and_then(|()| fs::rename(&temp, &path));
        written.map_err(|err| {
            let _ = fs::remove_file(&temp);
            self.io_error(&format!("cannot write key '{key}' to"), &err)
        })
    }

    /// Calls `probe` until it gives a value or `timeout` passes, sleeping a
    /// little longer each time. `Err(missing)` from `probe` means not yet.
    fn poll<T>(
        &self,
        timeout: Duration,
        mut probe: impl FnMut() -> Result<std::result::Result<T, Vec<String>>>,
    ) -> Result<T> {
        let deadline = deadline_after(timeout);
        let mut pause = FILE_POLL_START;
        loop {
            let missing = match probe()? {
                Ok(found) => return Ok(found),
                Err(missing) => missing,
            };
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => pause,
            };
            if left.is_zero() {
                return Err(key_timeout_error(timeout, &missing));
            }
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(FILE_POLL_MAX);
        }
    }

    /// Takes the store's exclusive lock, waiting at most OPERATION_TIMEOUT.
    fn lock_store(&self) -> Result<fs::File> {
        let path = self.dir.join(LOCK_FILE);
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| self.io_error("cannot open the lock file in", &e))?;
        let deadline = Instant::now() + OPERATION_TIMEOUT;
        let mut pause = Duration::from_millis(1);
        loop {
            // SAFETY: flock on a descriptor that `file` keeps open.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                // Closing `file` releases the lock.
                return Ok(file);
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => {}
                _ => return Err(self.io_error("cannot lock the rendezvous directory", &err)),
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "could not lock the rendezvous directory {} within {}",
                        self.dir.display(),
                        seconds(OPERATION_TIMEOUT)
                    ),
                ));
            }
            thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

/// A temporary file name no other thread, process or host will pick.
fn temp_file_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(".tmp-{}-{count}-{nanos}", std::process::id())
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.write_key(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.poll(timeout, || {
            Ok(self.read_key(key)?.ok_or_else(|| vec![key.to_string()]))
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let _lock = self.lock_store()?;
        let current = self.read_key(key)?;
        let sum = add_to_counter(key, current.as_deref(), delta)?;
        self.write_key(key, sum.to_string().as_bytes())?;
        Ok(sum)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        Ok(self.missing_keys(keys)?.is_empty())
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.poll(timeout, || {
            let missing = self.missing_keys(keys)?;
            Ok(if missing.is_empty() {
                Ok(())
            } else {
                Err(missing)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const PATIENCE: Duration = Duration::from_secs(5);

    fn start_server() -> TcpStoreServer {
        let addr: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
        TcpStoreServer::bind(addr).expect("bind the store server")
    }

    fn connect(server: &TcpStoreServer) -> TcpStoreClient {
        let addr = server.local_addr().to_string();
        TcpStoreClient::connect(&addr, Instant::now() + PATIENCE).expect("connect")
    }

    /// An address on which, most likely, nothing listens: the OS just gave
    /// the port out and got it back.
    fn unused_addr() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("local address")
    }

    fn temp_store_dir(name: &str) -> PathBuf {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        std::env::temp_dir().join(format!(
            "rdist-store-test-{}-{name}-{nanos}",
            std::process::id()
        ))
    }

    /// A raw connection, to speak the protocol (or not) by hand.
    fn raw_connection(server: &TcpStoreServer) -> TcpStream {
        let stream = TcpStream::connect(server.local_addr()).expect("connect");
        stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
        stream
    }

    /// Reads what the server sends until it closes the connection.
    fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
        let mut bytes = Vec::new();
        stream
            .read_to_end(&mut bytes)
            .expect("the server closes the connection");
        bytes
    }

    fn assert_in_range(elapsed: Duration, low_ms: u64, high_ms: u64) {
        assert!(
            elapsed >= Duration::from_millis(low_ms) && elapsed <= Duration::from_millis(high_ms),
            "took {elapsed:?}, expected {low_ms}..{high_ms} ms"
        );
    }

    #[test]
    fn set_get_round_trip() {
        let server = start_server();
        let client = connect(&server);
        client.set("answer", b"42").unwrap();
        client.set("empty", b"").unwrap();
        assert_eq!(client.get("answer", PATIENCE).unwrap(), b"42");
        assert_eq!(client.get("empty", PATIENCE).unwrap(), b"");
        client.set("answer", b"43").unwrap();
        assert_eq!(client.get("answer", PATIENCE).unwrap(), b"43");
        // Another client sees the same data.
        assert_eq!(connect(&server).get("answer", PATIENCE).unwrap(), b"43");
    }

    #[test]
    fn get_blocks_until_another_client_sets_the_key() {
        let server = start_server();
        let writer = connect(&server);
        let reader = connect(&server);
        let start = Instant::now();
        let getter = thread::spawn(move || reader.get("late", PATIENCE));
        thread::sleep(Duration::from_millis(200));
        writer.set("late", b"here").unwrap();
        assert_eq!(getter.join().unwrap().unwrap(), b"here");
        assert_in_range(start.elapsed(), 150, 2000);
    }

    #[test]
    fn get_times_out_naming_the_key() {
        let server = start_server();
        let client = connect(&server);
        let start = Instant::now();
        let err = client
            .get("peer/3", Duration::from_millis(300))
            .unwrap_err();
        assert_in_range(start.elapsed(), 250, 2000);
        assert_eq!(err.kind(), ErrorKind::Timeout);
        assert_eq!(
            err.message(),
            "timed out after 0.3 s waiting for key 'peer/3' in the rendezvous store"
        );
        // The connection stays usable after a timeout.
        client.set("peer/3", b"x").unwrap();
        assert_eq!(client.get("peer/3", PATIENCE).unwrap(), b"x");
    }

    #[test]
    fn add_is_atomic_across_clients() {
        let server = start_server();
        let adders: Vec<_> = (0..8)
            .map(|_| {
                let client = connect(&server);
                thread::spawn(move || {
                    for _ in 0..100 {
                        client.add("counter", 1).unwrap();
                    }
                })
            })
            .collect();
        for adder in adders {
            adder.join().unwrap();
        }
        let client = connect(&server);
        assert_eq!(client.add("counter", 0).unwrap(), 800);
        assert_eq!(client.get("counter", PATIENCE).unwrap(), b"800");
        assert_eq!(client.add("fresh", -5).unwrap(), -5);
    }

    #[test]
    fn add_rejects_values_that_are_not_integers() {
        let server = start_server();
        let client = connect(&server);
        client.set("name", b"alice").unwrap();
        let err = client.add("name", 1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.message().contains("'name'"), "{err}");
        client.set("big", i64::MAX.to_string().as_bytes()).unwrap();
        assert_eq!(
            client.add("big", 1).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        // The connection is still in step.
        assert_eq!(client.add("n", 2).unwrap(), 2);
    }

    #[test]
    fn check_and_wait() {
        let server = start_server();
        let client = connect(&server);
        client.set("a", b"1").unwrap();
        assert!(client.check(&["a"]).unwrap());
        assert!(client.check(&[]).unwrap());
        assert!(!client.check(&["a", "b"]).unwrap());

        let start = Instant::now();
        let err = client
            .wait(&["a", "b", "c"], Duration::from_millis(300))
            .unwrap_err();
        assert_in_range(start.elapsed(), 250, 2000);
        assert_eq!(err.kind(), ErrorKind::Timeout);
        assert_eq!(
            err.message(),
            "timed out after 0.3 s waiting for keys 'b', 'c' in the rendezvous store"
        );

        let writer = connect(&server);
        let setter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            writer.set("b", b"2").unwrap();
            writer.set("c", b"3").unwrap();
        });
        client.wait(&["a", "b", "c"], PATIENCE).unwrap();
        setter.join().unwrap();
        assert!(client.check(&["a", "b", "c"]).unwrap());
    }

    #[test]
    fn timeout_message_names_at_most_eight_keys() {
        let keys: Vec<String> = (0..11).map(|i| format!("k{i}")).collect();
        let err = key_timeout_error(Duration::from_secs(2), &keys);
        assert_eq!(
            err.message(),
            "timed out after 2.0 s waiting for keys 'k0', 'k1', 'k2', 'k3', 'k4', 'k5', 'k6', \
             'k7' and 3 more in the rendezvous store"
        );
    }

    #[test]
    fn prefix_store_isolates_keys() {
        let server = start_server();
        let shared: Arc<dyn Store> = Arc::new(connect(&server));
        let first = PrefixStore::new(Arc::clone(&shared), "job1");
        let second = PrefixStore::new(Arc::clone(&shared), "job2");
        first.set("rank", b"one").unwrap();
        second.set("rank", b"two").unwrap();
        assert_eq!(first.get("rank", PATIENCE).unwrap(), b"one");
        assert_eq!(second.get("rank", PATIENCE).unwrap(), b"two");
        assert_eq!(shared.get("job1/rank", PATIENCE).unwrap(), b"one");
        assert_eq!(first.add("count", 3).unwrap(), 3);
        assert!(!second.check(&["count"]).unwrap());
        assert!(first.check(&["rank", "count"]).unwrap());
        first.wait(&["rank", "count"], PATIENCE).unwrap();
        let err = second
            .wait(&["count"], Duration::from_millis(50))
            .unwrap_err();
        assert!(err.message().contains("'job2/count'"), "{err}");
    }

    #[test]
    fn client_retries_until_the_server_starts() {
        let addr = unused_addr();
        let starter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(300));
            TcpStoreServer::bind(addr)
        });
        let start = Instant::now();
        let client = TcpStoreClient::connect(&addr.to_string(), Instant::now() + PATIENCE).unwrap();
        assert_in_range(start.elapsed(), 250, 3000);
        let _server = starter.join().unwrap().unwrap();
        client.set("k", b"v").unwrap();
        assert_eq!(client.get("k", PATIENCE).unwrap(), b"v");
    }

    #[test]
    fn connect_times_out_naming_the_address() {
        let addr = unused_addr().to_string();
        let start = Instant::now();
        let err = match TcpStoreClient::connect(&addr, Instant::now() + Duration::from_millis(300))
        {
            Ok(_) => panic!("connected to {addr} although nothing listens there"),
            Err(err) => err,
        };
        assert_in_range(start.elapsed(), 250, 2000);
        assert_eq!(err.kind(), ErrorKind::Timeout);
        assert_eq!(
            err.message(),
            format!(
                "could not reach the rendezvous store at {addr} within 0.3 s (last error: \
                 connection refused); is rank 0 (the master) running?"
            )
        );
    }

    #[test]
    fn connect_accepts_names_and_ipv6_addresses() {
        let server = start_server();
        let by_name = format!("localhost:{}", server.local_addr().port());
        let client = TcpStoreClient::connect(&by_name, Instant::now() + PATIENCE).unwrap();
        client.set("k", b"v").unwrap();
        // Hosts without IPv6 cannot run the second half.
        let Ok(v6_server) = TcpStoreServer::bind("[::1]:0".parse().expect("literal address"))
        else {
            return;
        };
        let v6_addr = format!("[::1]:{}", v6_server.local_addr().port());
        let client = TcpStoreClient::connect(&v6_addr, Instant::now() + PATIENCE).unwrap();
        client.set("k", b"v6").unwrap();
        assert_eq!(client.get("k", PATIENCE).unwrap(), b"v6");
    }

    #[test]
    fn connect_rejects_malformed_addresses() {
        for addr in ["localhost", "::1:29500", ":29500", "host:port", "[::1]"] {
            let err = TcpStoreClient::connect(addr, Instant::now()).err();
            assert_eq!(
                err.map(|e| e.kind()),
                Some(ErrorKind::InvalidArgument),
                "{addr}"
            );
        }
    }

    #[test]
    fn bind_reports_a_port_in_use() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = TcpStoreServer::bind(addr).err().expect("the port is taken");
        assert_eq!(err.kind(), ErrorKind::System);
        assert_eq!(
            err.message(),
            format!("cannot host the rendezvous store on {addr}: address already in use")
        );
    }

    #[test]
    fn dropping_the_server_fails_blocked_clients_promptly() {
        let server = start_server();
        let blocked = connect(&server);
        let _idle = connect(&server);
        let getter = thread::spawn(move || {
            let result = blocked.get("never", Duration::from_secs(20));
            (result, Instant::now())
        });
        thread::sleep(Duration::from_millis(200));
        let start = Instant::now();
        drop(server);
        let drop_time = start.elapsed();
        let (result, failed_at) = getter.join().unwrap();
        assert!(
            drop_time < Duration::from_millis(100),
            "drop took {drop_time:?}"
        );
        assert!(failed_at.duration_since(start) < Duration::from_secs(1));
        let err = result.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::PeerLost, "{err}");
        assert!(
            err.message()
                .starts_with("lost the connection to the rendezvous store at 127.0.0.1:"),
            "{err}"
        );
    }

    #[test]
    fn requests_after_a_lost_connection_fail_fast() {
        let server = start_server();
        let client = connect(&server);
        drop(server);
        let start = Instant::now();
        assert_eq!(
            client.set("k", b"v").unwrap_err().kind(),
            ErrorKind::PeerLost
        );
        assert_eq!(
            client.check(&["k"]).unwrap_err().kind(),
            ErrorKind::PeerLost
        );
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn garbage_instead_of_a_handshake_drops_only_that_client() {
        let server = start_server();
        let mut stranger = raw_connection(&server);
        stranger.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let reply = read_until_closed(&mut stranger);
        match wire::decode_response(&mut reply.as_slice()) {
            Ok(Response::Failed { kind, message }) => {
                assert_eq!(kind, ErrorKind::System.code());
                assert!(message.contains("handshake"), "{message}");
            }
            other => panic!("unexpected reply {other:?}"),
        }
        let client = connect(&server);
        client.set("still", b"serving").unwrap();
        assert_eq!(client.get("still", PATIENCE).unwrap(), b"serving");
    }

    #[test]
    fn a_wrong_protocol_version_is_rejected() {
        let server = start_server();
        let mut old = raw_connection(&server);
        let mut hello = wire::MAGIC.to_le_bytes().to_vec();
        hello.extend_from_slice(&99u32.to_le_bytes());
        old.write_all(&hello).unwrap();
        let reply = read_until_closed(&mut old);
        match wire::decode_response(&mut reply.as_slice()) {
            Ok(Response::Failed { message, .. }) => assert!(message.contains("version 99")),
            other => panic!("unexpected reply {other:?}"),
        }
    }

    #[test]
    fn an_absurd_length_drops_the_client() {
        let server = start_server();
        let mut rogue = raw_connection(&server);
        rogue.write_all(&wire::encode_handshake()).unwrap();
        let mut set_with_huge_key = vec![1u8];
        set_with_huge_key.extend_from_slice(&u32::MAX.to_le_bytes());
        rogue.write_all(&set_with_huge_key).unwrap();
        let reply = read_until_closed(&mut rogue);
        let mut bytes = reply.as_slice();
        assert_eq!(wire::decode_response(&mut bytes).ok(), Some(Response::Done));
        match wire::decode_response(&mut bytes) {
            Ok(Response::Failed { message, .. }) => {
                assert!(message.contains("64 MiB"), "{message}")
            }
            other => panic!("unexpected reply {other:?}"),
        }
        let client = connect(&server);
        client.set("k", b"v").unwrap();
    }

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
            let bytes = wire::encode_request(&request).unwrap();
            assert_eq!(
                wire::decode_request(&mut bytes.as_slice()).unwrap(),
                request
            );
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
            let bytes = wire::encode_response(&response).unwrap();
            assert_eq!(
                wire::decode_response(&mut bytes.as_slice()).unwrap(),
                response
            );
        }
        let truncated = wire::encode_request(&Request::Check {
            keys: vec!["abc".into()],
        })
        .unwrap();
        let cut = &truncated[..truncated.len() - 1];
        assert!(matches!(
            wire::decode_request(&mut &cut[..]),
            Err(WireError::Io(_))
        ));
    }

    #[test]
    fn file_store_set_get_wait_and_timeouts() {
        let dir = temp_store_dir("basic");
        let store = FileStore::new(&dir).unwrap();
        store.set("peer/0", b"addr0").unwrap();
        assert_eq!(store.get("peer/0", PATIENCE).unwrap(), b"addr0");
        store.set("peer/0", b"addr0b").unwrap();
        assert_eq!(store.get("peer/0", PATIENCE).unwrap(), b"addr0b");
        assert!(store.check(&["peer/0"]).unwrap());
        assert!(!store.check(&["peer/0", "peer/1"]).unwrap());

        let start = Instant::now();
        let err = store.get("peer/3", Duration::from_millis(300)).unwrap_err();
        assert_in_range(start.elapsed(), 250, 2000);
        assert_eq!(err.kind(), ErrorKind::Timeout);
        assert_eq!(
            err.message(),
            "timed out after 0.3 s waiting for key 'peer/3' in the rendezvous store"
        );
        let err = store
            .wait(&["peer/0", "peer/1"], Duration::from_millis(100))
            .unwrap_err();
        assert!(err.message().contains("key 'peer/1'"), "{err}");

        // A second handle (another rank) sets a key while this one waits.
        let other = FileStore::new(&dir).unwrap();
        let setter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            other.set("peer/1", b"addr1").unwrap();
        });
        store.wait(&["peer/0", "peer/1"], PATIENCE).unwrap();
        setter.join().unwrap();
        assert_eq!(store.get("peer/1", PATIENCE).unwrap(), b"addr1");

        store.set("name", b"x").unwrap();
        assert_eq!(
            store.add("name", 1).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        let long_key = "k".repeat(MAX_FILE_KEY_LEN + 1);
        assert_eq!(
            store.set(&long_key, b"v").unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );

        store.remove().unwrap();
        assert!(!dir.exists());
        store.remove().unwrap();
    }

    #[test]
    fn file_store_add_is_atomic_across_threads() {
        let dir = temp_store_dir("add");
        let adders: Vec<_> = (0..4)
            .map(|_| {
                let store = FileStore::new(&dir).unwrap();
                thread::spawn(move || {
                    for _ in 0..25 {
                        store.add("counter", 1).unwrap();
                    }
                })
            })
            .collect();
        for adder in adders {
            adder.join().unwrap();
        }
        let store = FileStore::new(&dir).unwrap();
        assert_eq!(store.add("counter", 0).unwrap(), 100);
        assert_eq!(store.get("counter", PATIENCE).unwrap(), b"100");
        // Only the key, the lock file and no leftover temporary files.
        let entries = fs::read_dir(&dir).unwrap().count();
        assert_eq!(entries, 2);
        store.remove().unwrap();
    }
}
