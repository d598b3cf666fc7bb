//! The store server rank 0 hosts: keys and values in memory, one thread
//! per client, and server-side waits for keys.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::wire::{self, Request, Response, WireError};
use super::{add_to_counter, deadline_after, lock};
use crate::error::{Error, ErrorKind, Result};

/// How long the server waits for a new client's handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_in_range, connect, start_server, PATIENCE};
    use super::super::Store;
    use super::*;

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
}
