//! The store client every rank uses: connecting (with retries until the
//! server is up), one request and reply at a time, and errors that say
//! what went wrong with the server.

use std::io::{self, BufReader, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use super::wire::{self, Request, Response, WireError};
use super::{key_timeout_error, lock, seconds, Store, OPERATION_TIMEOUT};
use crate::error::{describe_io, Error, ErrorKind, Result};

/// Extra time a client gives the server beyond a server-side wait, so a slow
/// reply is not mistaken for a dead server.
const REPLY_MARGIN: Duration = Duration::from_secs(2);

/// Whole milliseconds for the wire, saturating.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

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
            format!("the server at {addr} speaks neither rdist's store protocol nor PyTorch's TCPStore protocol ({msg}): is something else listening on that port?"),
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

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_in_range, connect, start_server, PATIENCE};
    use super::super::TcpStoreServer;
    use super::*;
    use std::net::{SocketAddr, TcpListener};

    /// An address on which, most likely, nothing listens: the OS just gave
    /// the port out and got it back.
    fn unused_addr() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("local address")
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
}
