//! The store client every rank uses, speaking PyTorch's TCPStore protocol
//! (see `protocol`) to rdist's store server or to one torch hosts
//! (torchrun's agent store, a program's `TCPStore`): connecting with
//! retries until the server is up, one query and reply at a time, waits
//! bounded on the client side (withdrawn with cancel_wait), and errors
//! that say what went wrong with the server.
//!
//! Keys go on the wire behind "/", as torch's own clients put them, then
//! the client's prefix: a Python `store.get("rdist/...")` sees rdist's keys.
//!
//! A query without a reply (set, append...) is followed by a probe whose
//! answer proves it arrived (the store answers in order): a ping, or where
//! the store has none (torch 2.4's hangs up on one), num_keys.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use super::protocol::{
    encode_query, Query, AUTH_ACCEPTED, AUTH_CHALLENGE, AUTH_NO_TOKEN, MAGIC, MAX_KEY, MAX_VALUE,
    READY, STOP_WAITING, WAIT_CANCELED,
};
use super::server::STORE_CONTEXT;
use super::{key_timeout_error, seconds, Store, Update, OPERATION_TIMEOUT};
use crate::auth::{self, Side, Token, NONCE_BYTES, PROOF_BYTES};
use crate::error::{describe_io, Error, ErrorKind, Result};
use crate::sync::lock;

/// The least time a withdrawn wait's answer is waited for (see `wait_for`).
const CANCEL_ANSWER_MIN: Duration = Duration::from_secs(1);

/// The most a handshake may take once connected.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The query whose answer proves that the queries before it arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    /// A ping: rdist's store and newer torch's (answered with the nonce;
    /// by rdist's, with the nonce inverted when it wants a token).
    Ping,
    /// num_keys, for a store without ping (torch 2.4's hangs up on one);
    /// its count is not used.
    NumKeys,
}

/// The nonce of the pings that confirm queries.
const PROBE_NONCE: u32 = 0x7365_7421;

impl Probe {
    fn encode(self, out: &mut Vec<u8>) {
        match self {
            Probe::Ping => encode_query(&Query::Ping(PROBE_NONCE), out),
            Probe::NumKeys => encode_query(&Query::NumKeys, out),
        }
    }

    fn read(self, s: &mut TcpStream) -> io::Result<()> {
        match self {
            Probe::Ping => expect_nonce(s, PROBE_NONCE),
            Probe::NumKeys => read_i64(s).map(drop),
        }
    }
}

/// The connection of a client, and whether it can still be used.
struct Connection {
    stream: TcpStream,
    /// What the store answers to confirm arrivals (found in the handshake).
    probe: Probe,
    /// Set once a query failed half-way: the byte stream is then out of
    /// step, so every later query fails with the same error.
    broken: Option<Error>,
    /// Answers to adds sent without waiting (`add_no_wait`), read before
    /// the next query's answer.
    owed: usize,
}

/// A connection to a TCPStore (rdist's or torch's). Queries from several
/// threads are serialised.
pub struct TcpStoreClient {
    addr: String,
    /// Proved on every (re)connection.
    token: Option<Token>,
    /// Put before every key (after torch's "/").
    prefix: String,
    /// For a client of one meeting: the prefix of the meeting counters,
    /// this meeting's number and the rank that joined it.
    meeting: Option<(String, i64, usize)>,
    connection: Mutex<Connection>,
}

/// Why one connection attempt failed.
enum AttemptError {
    /// Worth retrying (server not up yet, name not resolvable yet...).
    Retry(String),
    /// Retrying cannot help (something else answers there).
    Fatal(Error),
}

impl TcpStoreClient {
    /// Connects to "host:port" (host may be a name, IPv4 or [IPv6]),
    /// retrying refused/failed connects with backoff (10 ms growing to
    /// 200 ms) until `deadline`, so ranks may start before the server.
    /// Keys are used as given.
    pub fn connect(addr: &str, deadline: Instant) -> Result<TcpStoreClient> {
        TcpStoreClient::connect_with(addr, deadline, None)
    }

    /// [`TcpStoreClient::connect`], proving knowledge of `token` to the
    /// store (which proves it first; see `crate::auth`).
    pub fn connect_with(
        addr: &str,
        deadline: Instant,
        token: Option<&Token>,
    ) -> Result<TcpStoreClient> {
        check_address(addr)?;
        let patience = deadline.saturating_duration_since(Instant::now());
        let mut backoff = Duration::from_millis(10);
        loop {
            let last_error = match connect_once(addr, deadline, token, Probe::Ping) {
                Ok((stream, probe)) => {
                    return Ok(TcpStoreClient {
                        addr: addr.to_string(),
                        token: token.cloned(),
                        prefix: String::new(),
                        meeting: None,
                        connection: Mutex::new(Connection {
                            stream,
                            probe,
                            broken: None,
                            owed: 0,
                        }),
                    })
                }
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

    /// Connects for one meeting of `rank`: keys go under `base` and the
    /// meeting's number. Each rank counts its meetings in the store itself,
    /// so the n-th communicator every rank creates on one store gets keys
    /// of its own, and creating communicators again and again on one store
    /// (or beside torch's keys) never meets an earlier one's keys.
    pub fn join(
        addr: &str,
        base: &str,
        rank: usize,
        deadline: Instant,
        token: Option<&Token>,
    ) -> Result<TcpStoreClient> {
        let mut client = TcpStoreClient::connect_with(addr, deadline, token)?;
        client.prefix = base.to_string();
        let meeting = client.add(&format!("meetings/{rank}"), 1)?;
        client.prefix = format!("{base}{meeting}/");
        client.meeting = Some((base.to_string(), meeting, rank));
        Ok(client)
    }

    /// The address this client was given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn key(&self, key: &str) -> Result<Vec<u8>> {
        let full = format!("/{}{key}", self.prefix).into_bytes();
        if full.len() > MAX_KEY {
            return Err(Error::invalid_argument(format!(
                "the store key '{key}' is longer than the store's limit of {} KiB",
                MAX_KEY >> 10
            )));
        }
        Ok(full)
    }

    /// Sends `bytes` and reads the reply with `read`, both bounded by
    /// `bound`. `probed`: the store's probe follows the queries, and its
    /// answer is read after theirs (it confirms the queries that have no
    /// reply arrived).
    fn exchange<T>(
        &self,
        mut bytes: Vec<u8>,
        probed: bool,
        bound: Duration,
        read: impl FnOnce(&mut TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let mut c = lock(&self.connection);
        self.mend(&mut c, bound)?;
        // After mending: a new connection may have found another store.
        let probe = c.probe;
        if probed {
            probe.encode(&mut bytes);
        }
        let outcome = (|| {
            let bound = bound.max(Duration::from_millis(1));
            c.stream.set_read_timeout(Some(bound))?;
            c.stream.set_write_timeout(Some(bound))?;
            c.stream.write_all(&bytes)?;
            let answer = read(&mut c.stream)?;
            if probed {
                probe.read(&mut c.stream)?;
            }
            Ok(answer)
        })();
        outcome.map_err(|e| {
            let err = self.connection_error(&e, bound);
            c.broken = Some(err.clone());
            err
        })
    }

    /// A connection broken by an earlier failure (out of step after a
    /// timeout, or lost) is made again, once per call, before giving up
    /// with the error that broke it: the store keeps no state per
    /// connection that a query here relies on.
    /// Then reads the answers owed on it, within `bound`.
    fn mend(&self, c: &mut Connection, bound: Duration) -> Result<()> {
        let Some(err) = c.broken.clone() else {
            return self.settle(c, bound);
        };
        let deadline = Instant::now() + Duration::from_secs(1);
        match connect_once(&self.addr, deadline, self.token.as_ref(), c.probe) {
            Ok((stream, probe)) => {
                c.stream = stream;
                c.probe = probe;
                c.broken = None;
                c.owed = 0;
                Ok(())
            }
            Err(_) => Err(err),
        }
    }

    /// Reads the answers owed to adds sent without waiting: the next
    /// answer on the connection is then the next query's.
    fn settle(&self, c: &mut Connection, bound: Duration) -> Result<()> {
        if c.owed == 0 {
            return Ok(());
        }
        // Within the caller's bound (the flight recorder's writes must not
        // hang on a store that stopped answering), but long enough for
        // answers already on their way.
        let bound = bound.clamp(Duration::from_millis(100), OPERATION_TIMEOUT);
        let settled = c
            .stream
            .set_read_timeout(Some(bound))
            .and_then(|()| (0..c.owed).try_for_each(|_| read_i64(&mut c.stream).map(drop)));
        c.owed = 0;
        settled.map_err(|e| {
            let err = self.connection_error(&e, bound);
            c.broken = Some(err.clone());
            err
        })
    }

    fn connection_error(&self, err: &io::Error, bound: Duration) -> Error {
        let addr = &self.addr;
        match err.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::new(
                ErrorKind::Timeout,
                format!(
                    "the rendezvous store at {addr} did not answer within {}",
                    seconds(bound)
                ),
            ),
            io::ErrorKind::InvalidData => Error::new(
                ErrorKind::System,
                format!("the rendezvous store at {addr} broke the TCPStore protocol: {err}"),
            ),
            _ => Error::new(
                ErrorKind::PeerLost,
                format!(
                    "lost the connection to the rendezvous store at {addr} ({})",
                    describe_io(err)
                ),
            ),
        }
    }

    /// Checks a value's length before it is sent.
    fn value<'v>(&self, key: &str, value: &'v [u8]) -> Result<&'v [u8]> {
        if value.len() > MAX_VALUE {
            return Err(Error::invalid_argument(format!(
                "the value for store key '{key}' is {} bytes, more than the store's limit of {} MiB",
                value.len(),
                MAX_VALUE >> 20
            )));
        }
        Ok(value)
    }

    /// A query with no reply, followed by the probe so that its arrival
    /// is confirmed (and a store that dropped it is noticed here).
    fn without_reply(&self, query: &Query<'_>) -> Result<()> {
        let mut bytes = Vec::new();
        encode_query(query, &mut bytes);
        self.exchange(bytes, true, OPERATION_TIMEOUT, |_| Ok(()))
    }

    fn with_reply<T>(
        &self,
        query: &Query<'_>,
        read: impl FnOnce(&mut TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let mut bytes = Vec::new();
        encode_query(query, &mut bytes);
        self.exchange(bytes, false, OPERATION_TIMEOUT, read)
    }

    /// Sets `key` to `desired` if it holds `expected` (or is missing and
    /// `expected` is empty); returns the value it holds afterwards.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let k = self.key(key)?;
        let query = Query::CompareSet(&k, self.value(key, expected)?, self.value(key, desired)?);
        self.with_reply(&query, read_value)
    }

    /// How many keys the store holds (all of them, not only this client's).
    pub fn num_keys(&self) -> Result<i64> {
        self.with_reply(&Query::NumKeys, read_i64)
    }

    /// Deletes `key`; true when it existed.
    pub fn delete_key(&self, key: &str) -> Result<bool> {
        let k = self.key(key)?;
        Ok(self.with_reply(&Query::DeleteKey(&k), read_i64)? == 1)
    }

    /// Appends `more` to the value of `key` (or sets it).
    pub fn append(&self, key: &str, more: &[u8]) -> Result<()> {
        let k = self.key(key)?;
        self.without_reply(&Query::Append(&k, self.value(key, more)?))
    }

    /// Waits for all `keys` (up to `timeout`), then returns their values.
    pub fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait(keys, timeout)?;
        let full = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&[u8]> = full.iter().map(Vec::as_slice).collect();
        self.with_reply(&Query::MultiGet(refs), |s| {
            (0..keys.len()).map(|_| read_value(s)).collect()
        })
    }

    /// Sets every key to its value, in one query.
    pub fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let full = pairs
            .iter()
            .map(|(k, v)| Ok((self.key(k)?, self.value(k, v)?)))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<(&[u8], &[u8])> = full.iter().map(|(k, v)| (k.as_slice(), *v)).collect();
        self.without_reply(&Query::MultiSet(refs))
    }

    /// Every key in the store, as stored (torch's keys start with "/").
    pub fn list_keys(&self) -> Result<Vec<Vec<u8>>> {
        self.with_reply(&Query::ListKeys, |s| {
            let n = read_i64(s)?;
            if !(0..=1 << 24).contains(&n) {
                return Err(invalid(format!("list_keys answered {n} keys")));
            }
            (0..n).map(|_| read_value(s)).collect()
        })
    }

    /// Sends `bytes` (a wait, or a wait for a value: `with_value`, for
    /// `keys`) and reads its answer, withdrawing it after `timeout`.
    fn wait_for(
        &self,
        bytes: &[u8],
        keys: &[&str],
        timeout: Duration,
        with_value: bool,
    ) -> Result<Option<Vec<u8>>> {
        let mut c = lock(&self.connection);
        self.mend(&mut c, timeout.min(OPERATION_TIMEOUT))?;
        let answer = |s: &mut TcpStream| match with_value {
            true => read_value(s).map(Some),
            false => Ok(Some(Vec::new())),
        };
        let outcome: io::Result<Option<Vec<u8>>> = (|| {
            c.stream.set_read_timeout(Some(OPERATION_TIMEOUT))?;
            c.stream.set_write_timeout(Some(OPERATION_TIMEOUT))?;
            c.stream.write_all(bytes)?;
            c.stream
                .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
            match read_u8(&mut c.stream) {
                Ok(STOP_WAITING) => {
                    // The value follows at once: read within the
                    // operation's bound, not what is left of the wait's.
                    c.stream.set_read_timeout(Some(OPERATION_TIMEOUT))?;
                    answer(&mut c.stream)
                }
                Ok(other) => Err(invalid(format!("wait answered {other}"))),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    // Withdraw the wait; the store answers WAIT_CANCELED
                    // (after STOP_WAITING if the keys came just now). A
                    // store that answered nothing for the wait's length is
                    // given as long again (a second at least), not the
                    // operations' bound: a stopped store host would hold
                    // every slice of init's wait that long.
                    c.stream.set_read_timeout(Some(
                        timeout.clamp(CANCEL_ANSWER_MIN, OPERATION_TIMEOUT),
                    ))?;
                    let mut cancel = Vec::new();
                    encode_query(&Query::CancelWait, &mut cancel);
                    c.stream.write_all(&cancel)?;
                    let mut stopped = None;
                    loop {
                        match read_u8(&mut c.stream)? {
                            WAIT_CANCELED => return Ok(stopped),
                            STOP_WAITING => stopped = answer(&mut c.stream)?,
                            other => return Err(invalid(format!("cancel_wait answered {other}"))),
                        }
                    }
                }
                Err(e) => Err(e),
            }
        })();
        match outcome {
            Ok(Some(value)) => Ok(Some(value).filter(|_| with_value)),
            Ok(None) => {
                drop(c);
                let mut missing = Vec::new();
                for key in keys {
                    if !self.check(&[key])? {
                        missing.push(key.to_string());
                    }
                }
                Err(key_timeout_error(timeout, &missing))
            }
            Err(e) => {
                let err = self.connection_error(&e, timeout);
                c.broken = Some(err.clone());
                Err(err)
            }
        }
    }

    /// Sends `bytes` without reading anything back; `owed`: the answers
    /// they will get, read before the next query's (`settle`).
    fn send_unread(&self, bytes: &[u8], owed: usize) -> Result<()> {
        let mut c = lock(&self.connection);
        self.mend(&mut c, OPERATION_TIMEOUT)?;
        let sent = c
            .stream
            .set_write_timeout(Some(OPERATION_TIMEOUT))
            .and_then(|()| c.stream.write_all(bytes));
        match sent {
            Ok(()) => {
                c.owed += owed;
                Ok(())
            }
            Err(e) => {
                let err = self.connection_error(&e, OPERATION_TIMEOUT);
                c.broken = Some(err.clone());
                Err(err)
            }
        }
    }

    /// One round trip (a ping, or num_keys where the store has no ping);
    /// the time it took.
    pub fn ping(&self) -> Result<Duration> {
        let start = Instant::now();
        self.exchange(Vec::new(), true, OPERATION_TIMEOUT, |_| Ok(()))?;
        Ok(start.elapsed())
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn read_u8(s: &mut TcpStream) -> io::Result<u8> {
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_i64(s: &mut TcpStream) -> io::Result<i64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

fn read_value(s: &mut TcpStream) -> io::Result<Vec<u8>> {
    let len = read_i64(s)? as u64;
    if len > MAX_VALUE as u64 {
        return Err(invalid(format!("a value of {len} bytes")));
    }
    // Read through `take`: memory grows with the bytes that arrive.
    let mut value = Vec::new();
    s.take(len).read_to_end(&mut value)?;
    if value.len() as u64 != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(value)
}

fn expect_nonce(s: &mut TcpStream, nonce: u32) -> io::Result<()> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    match u32::from_le_bytes(b) {
        n if n == nonce => Ok(()),
        n => Err(invalid(format!("ping {nonce:#x} came back as {n:#x}"))),
    }
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

/// One attempt: resolve, connect to the first address that answers,
/// handshake (confirming with `probe` first: a client that found the
/// store has no ping asks it no more).
fn connect_once(
    addr: &str,
    deadline: Instant,
    token: Option<&Token>,
    probe: Probe,
) -> std::result::Result<(TcpStream, Probe), AttemptError> {
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
            Ok(stream) => {
                let patience = attempt_timeout.min(HANDSHAKE_TIMEOUT);
                return match token {
                    None => handshake(addr, stream, socket_addr, patience, probe),
                    // Only rdist's store authenticates, and it has ping.
                    Some(token) => authenticate(addr, stream, socket_addr, patience, token)
                        .map(|stream| (stream, Probe::Ping)),
                };
            }
            Err(err) => last_error = describe_io(&err),
        }
    }
    Err(AttemptError::Retry(last_error))
}

/// Validates (torch's magic number) and confirms with `probe`: a TCPStore
/// echoes a ping's nonce. A store that hangs up on the ping before
/// answering anything may be one without ping (torch 2.4's): asked again
/// on a new connection (at `at`) with num_keys, within what is left of
/// `patience`, it says so by answering; otherwise the hang-up stands
/// (a store shutting down, or full for now: worth another try).
fn handshake(
    addr: &str,
    stream: TcpStream,
    at: SocketAddr,
    patience: Duration,
    probe: Probe,
) -> std::result::Result<(TcpStream, Probe), AttemptError> {
    let until = Instant::now() + patience;
    let hung_up = match greet(addr, stream, patience, probe) {
        Ok(stream) => return Ok((stream, probe)),
        Err(Refused::HungUp(reason)) => reason,
        Err(Refused::Other(err)) => return Err(err),
    };
    if probe == Probe::Ping {
        let left = until.saturating_duration_since(Instant::now());
        if !left.is_zero() {
            if let Ok(again) = TcpStream::connect_timeout(&at, left) {
                let left = until
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                if let Ok(stream) = greet(addr, again, left, Probe::NumKeys) {
                    return Ok((stream, Probe::NumKeys));
                }
            }
        }
    }
    Err(AttemptError::Retry(hung_up))
}

/// Why a handshake failed.
enum Refused {
    /// The store closed the connection before answering anything.
    HungUp(String),
    Other(AttemptError),
}

/// Sends Validate and `probe` on `stream` and checks the answer, within
/// `patience`.
fn greet(
    addr: &str,
    mut stream: TcpStream,
    patience: Duration,
    probe: Probe,
) -> std::result::Result<TcpStream, Refused> {
    let io_failure = |err: &io::Error| Refused::Other(AttemptError::Retry(describe_io(err)));
    stream.set_nodelay(true).map_err(|e| io_failure(&e))?;
    stream
        .set_read_timeout(Some(patience))
        .map_err(|e| io_failure(&e))?;
    stream
        .set_write_timeout(Some(patience))
        .map_err(|e| io_failure(&e))?;
    let nonce = std::process::id() ^ 0x5244_4953;
    let mut hello = Vec::new();
    encode_query(&Query::Validate(MAGIC), &mut hello);
    match probe {
        Probe::Ping => encode_query(&Query::Ping(nonce), &mut hello),
        Probe::NumKeys => encode_query(&Query::NumKeys, &mut hello),
    }
    stream.write_all(&hello).map_err(|e| io_failure(&e))?;
    let not_a_store = |what: String| {
        Refused::Other(AttemptError::Fatal(Error::new(
            ErrorKind::System,
            format!(
                "the server at {addr} is not a rendezvous store: it {what} to the TCPStore \
                 handshake, which rdist's store and PyTorch's both speak; is something else \
                 listening on that port?"
            ),
        )))
    };
    // A ping's answer is 4 bytes, num_keys' 8.
    let mut answer = [0u8; 8];
    let want = match probe {
        Probe::Ping => 4,
        Probe::NumKeys => 8,
    };
    let mut got = 0;
    while got < want {
        match stream.read(&mut answer[got..want]) {
            Ok(0) if got == 0 => {
                return Err(Refused::HungUp("connection closed".to_string()));
            }
            Ok(0) => return Err(io_failure(&io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(not_a_store(format!(
                    "gave no answer within {}",
                    seconds(patience)
                )));
            }
            Err(e)
                if got == 0
                    && matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
                    ) =>
            {
                return Err(Refused::HungUp(describe_io(&e)));
            }
            // Perhaps a store shutting down or one full for now; worth
            // another try.
            Err(e) => return Err(io_failure(&e)),
        }
    }
    match probe {
        Probe::Ping => {
            let echo = u32::from_le_bytes([answer[0], answer[1], answer[2], answer[3]]);
            if echo == nonce {
                Ok(stream)
            } else if echo == !nonce {
                Err(Refused::Other(AttemptError::Fatal(Error::new(
                    ErrorKind::Auth,
                    format!(
                        "the rendezvous store at {addr} requires an auth token and this rank has \
                         none: set auth_token (or RDIST_AUTH_TOKEN) as the other ranks did"
                    ),
                ))))
            } else {
                Err(not_a_store(format!(
                    "answered {:?}",
                    String::from_utf8_lossy(&answer[..4])
                )))
            }
        }
        Probe::NumKeys => match i64::from_le_bytes(answer) {
            n if n >= 0 => Ok(stream),
            _ => Err(not_a_store(format!(
                "answered {:?}",
                String::from_utf8_lossy(&answer)
            ))),
        },
    }
}

/// Validates, then the challenge-response of `crate::auth`: the store
/// proves the token first, then this client.
fn authenticate(
    addr: &str,
    mut stream: TcpStream,
    at: SocketAddr,
    patience: Duration,
    token: &Token,
) -> std::result::Result<TcpStream, AttemptError> {
    let failed = |what: String| AttemptError::Fatal(Error::new(ErrorKind::Auth, what));
    let io_failure = |err: &io::Error, step: &str| match err.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => failed(format!(
            "the server at {addr} gave no answer to rdist's authentication within {} \
             (is it a rendezvous store?)",
            seconds(patience)
        )),
        // A PyTorch TCPStore drops a client that asks for rdist's
        // authentication; so would a store shutting down (worth a retry).
        _ => AttemptError::Retry(format!(
            "the store closed the connection {step} ({}; a PyTorch TCPStore cannot \
             authenticate: unset auth_token to use one)",
            describe_io(err)
        )),
    };
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(patience));
    let _ = stream.set_write_timeout(Some(patience));
    let ours = auth::nonce();
    let mut hello = Vec::new();
    encode_query(&Query::Validate(MAGIC), &mut hello);
    encode_query(&Query::AuthHello(&ours), &mut hello);
    stream
        .write_all(&hello)
        .map_err(|e| io_failure(&e, "when asked to authenticate"))?;
    let mut status = [0u8; 1];
    if let Err(e) = stream.read_exact(&mut status) {
        // Hung up on the question: a store without rdist's authentication
        // (PyTorch's) does that. If a plain handshake works, say so now
        // rather than retry until the timeout. (The address this
        // connection went to: a connection reset has no peer any more.)
        if let Ok(again) = TcpStream::connect_timeout(&at, patience) {
            if handshake(addr, again, at, patience, Probe::Ping).is_ok() {
                return Err(failed(format!(
                    "the store at {addr} speaks the TCPStore protocol but not rdist's \
                     authentication (a PyTorch TCPStore, such as torchrun's, cannot \
                     authenticate), and this rank has an auth token: unset auth_token (and \
                     RDIST_AUTH_TOKEN) to meet through it"
                )));
            }
        }
        return Err(io_failure(&e, "when asked to authenticate"));
    }
    if status[0] == AUTH_NO_TOKEN {
        return Err(failed(format!(
            "the rendezvous store at {addr} has no auth token, but this rank was given one: \
             give every rank the same auth_token (or RDIST_AUTH_TOKEN), or none"
        )));
    }
    if status[0] != AUTH_CHALLENGE {
        return Err(failed(format!(
            "the server at {addr} answered rdist's authentication with {:#x}: is it a rendezvous store?",
            status[0]
        )));
    }
    let mut challenge = [0u8; NONCE_BYTES + PROOF_BYTES];
    stream
        .read_exact(&mut challenge)
        .map_err(|e| io_failure(&e, "during authentication"))?;
    let (theirs, their_proof) = challenge.split_at(NONCE_BYTES);
    if !token.verify(Side::Answering, STORE_CONTEXT, &ours, theirs, their_proof) {
        return Err(failed(format!(
            "the rendezvous store at {addr} does not know this job's auth token (its proof \
             did not match): were the ranks given different tokens, or is this another job's \
             store?"
        )));
    }
    let proof = token.prove(Side::Connecting, STORE_CONTEXT, &ours, theirs);
    let mut bytes = Vec::new();
    encode_query(&Query::AuthProof(&proof), &mut bytes);
    stream
        .write_all(&bytes)
        .map_err(|e| io_failure(&e, "during authentication"))?;
    match stream.read_exact(&mut status) {
        Ok(()) if status[0] == AUTH_ACCEPTED => Ok(stream),
        _ => Err(failed(format!(
            "the rendezvous store at {addr} rejected this rank's proof of the auth token"
        ))),
    }
}

impl Store for TcpStoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = self.key(key)?;
        self.without_reply(&Query::Set(&k, self.value(key, value)?))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        let k = self.key(key)?;
        self.with_reply(&Query::Get(&k), read_value)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = self.key(key)?;
        self.with_reply(&Query::Add(&k, delta), read_i64)
    }

    fn add_no_wait(&self, key: &str, delta: i64) -> Result<()> {
        let k = self.key(key)?;
        let mut bytes = Vec::new();
        encode_query(&Query::Add(&k, delta), &mut bytes);
        self.send_unread(&bytes, 1)
    }

    /// Every update back to back: the store answers them in order, so one
    /// round trip carries them all.
    fn apply(&self, updates: &[Update<'_>]) -> Result<Vec<i64>> {
        let mut bytes = Vec::new();
        let mut adds = 0;
        for w in updates {
            match *w {
                Update::Set(key, value) => {
                    let k = self.key(key)?;
                    encode_query(&Query::Set(&k, self.value(key, value)?), &mut bytes);
                }
                Update::Add(key, delta) => {
                    let k = self.key(key)?;
                    encode_query(&Query::Add(&k, delta), &mut bytes);
                    adds += 1;
                }
            }
        }
        // The answer to a last Add confirms that all arrived; after a Set,
        // the probe's does.
        let probed = !matches!(updates.last(), Some(Update::Add(..)));
        self.exchange(bytes, probed, OPERATION_TIMEOUT, |s| {
            (0..adds).map(|_| read_i64(s)).collect()
        })
    }

    fn get_present(&self, key: &str) -> Result<Vec<u8>> {
        let k = self.key(key)?;
        self.with_reply(&Query::Get(&k), read_value)
    }

    fn get_all(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.multi_get(keys, timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let full = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&[u8]> = full.iter().map(Vec::as_slice).collect();
        Ok(self.with_reply(&Query::Check(refs), read_u8)? == READY)
    }

    /// Waits on the server; when `timeout` passes first, withdraws the wait
    /// (cancel_wait) and names the keys still missing.
    fn read_within(&self, keys: &[&str], bound: Duration) -> Result<Vec<Option<Vec<u8>>>> {
        let deadline = Instant::now() + bound;
        let full = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<_>>>()?;
        // One round trip: which exist (a check per key), then their values.
        let mut bytes = Vec::new();
        for k in &full {
            encode_query(&Query::Check(vec![k.as_slice()]), &mut bytes);
        }
        let present = self.exchange(bytes, false, bound, |s| {
            (0..full.len())
                .map(|_| Ok(read_u8(s)? == READY))
                .collect::<io::Result<Vec<bool>>>()
        })?;
        let wanted: Vec<&[u8]> = full
            .iter()
            .zip(&present)
            .filter(|(_, p)| **p)
            .map(|(k, _)| k.as_slice())
            .collect();
        let mut values = if wanted.is_empty() {
            Vec::new()
        } else {
            let mut q = Vec::new();
            encode_query(&Query::MultiGet(wanted.clone()), &mut q);
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(500));
            self.exchange(q, false, left, |s| {
                (0..wanted.len()).map(|_| read_value(s)).collect()
            })?
        }
        .into_iter();
        Ok(present
            .into_iter()
            .map(|p| if p { values.next() } else { None })
            .collect())
    }

    fn set_within(&self, key: &str, value: &[u8], bound: Duration) -> Result<()> {
        // Never wait for another thread's query: this is best effort.
        if self.connection.try_lock().is_err() {
            return Ok(());
        }
        let k = self.key(key)?;
        let mut bytes = Vec::new();
        encode_query(&Query::Set(&k, self.value(key, value)?), &mut bytes);
        self.exchange(bytes, true, bound, |_| Ok(()))
    }

    fn duplicated_ranks(&self, size: usize) -> Vec<usize> {
        let Some((base, meeting, me)) = &self.meeting else {
            return Vec::new();
        };
        let (meeting, me) = (*meeting, *me);
        // Each rank's meeting counter, and whether the meeting before this
        // one completed (every rank connected), read around the prefix.
        let mut raw: Vec<Vec<u8>> = (0..size)
            .map(|r| format!("/{base}meetings/{r}").into_bytes())
            .collect();
        raw.push(format!("/{base}{}/connected", meeting - 1).into_bytes());
        let refs: Vec<&[u8]> = raw.iter().map(Vec::as_slice).collect();
        let Ok(values) = self.with_reply(&Query::MultiGet(refs), |s| {
            (0..=size)
                .map(|_| read_value(s))
                .collect::<io::Result<Vec<_>>>()
        }) else {
            return Vec::new();
        };
        let number = |v: &[u8]| -> i64 {
            std::str::from_utf8(v)
                .ok()
                .and_then(|t| t.parse().ok())
                .unwrap_or(0)
        };
        let counts: Vec<i64> = values[..size].iter().map(|v| number(v)).collect();
        let previous_completed = number(&values[size]) >= size as i64;
        (0..size)
            .filter(|&r| {
                // Another process with rank r went on to a later meeting
                // while this one is still open ...
                counts[r] > meeting
                // ... or this process is that later one: the meeting
                // before never completed, yet rank r came again.
                || (r == me && meeting > 1 && !previous_completed
                    && counts.iter().all(|&c| c < meeting || c == counts[me]))
            })
            .collect()
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<_>>>()?;
        let mut bytes = Vec::new();
        encode_query(
            &Query::Wait(full.iter().map(Vec::as_slice).collect()),
            &mut bytes,
        );
        self.wait_for(&bytes, keys, timeout, false).map(drop)
    }

    fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let full = self.key(key)?;
        let mut bytes = Vec::new();
        encode_query(&Query::WaitGet(&full), &mut bytes);
        let value = self.wait_for(&bytes, &[key], timeout, true)?;
        value.ok_or_else(|| Error::internal("the store answered a wait for a value without one"))
    }

    fn arrive(
        &self,
        counter: &str,
        last: i64,
        key: &str,
        value: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let (counter_key, full) = (self.key(counter)?, self.key(key)?);
        let mut bytes = Vec::new();
        let query = Query::Arrive(&counter_key, last, &full, self.value(key, value)?, true);
        encode_query(&query, &mut bytes);
        let got = self.wait_for(&bytes, &[key], timeout, true)?;
        got.ok_or_else(|| Error::internal("the store answered a wait for a value without one"))
    }

    /// One compare-and-set, which rdist's store and torch's both answer.
    fn set_if_absent(&self, key: &str, value: &[u8]) -> Result<Vec<u8>> {
        self.compare_set(key, b"", value)
    }

    /// Sent without waiting for anything: the store answers nothing.
    fn arrive_quietly(&self, counter: &str, last: i64, key: &str, value: &[u8]) -> Result<()> {
        let (counter_key, full) = (self.key(counter)?, self.key(key)?);
        let mut bytes = Vec::new();
        let query = Query::Arrive(&counter_key, last, &full, self.value(key, value)?, false);
        encode_query(&query, &mut bytes);
        self.send_unread(&bytes, 0)
    }
}
