//! For tests: a TCPStore as PyTorch 2.4 hosts it (torchrun's agent store
//! under torch 2.4), whose queries stop at cancel_wait: it has no ping,
//! and hangs up on a client that sends one (as on any query it does not
//! know, rdist's own among them). Then the client's tests against it:
//! rdist meets through such a store by confirming with num_keys.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use super::protocol::{
    decode_query, put_i64, put_value, Query, Undecodable, MAGIC, NOT_READY, READY, STOP_WAITING,
    WAIT_CANCELED,
};
use crate::sync::lock;

#[derive(Default)]
struct State {
    data: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    /// Bumped to stop the server (u64::MAX) or to hang up on every
    /// client connected now.
    generation: AtomicUsize,
    connections: AtomicUsize,
    pings: AtomicUsize,
}

const STOPPED: usize = usize::MAX;

/// The server: a thread accepting, a thread per client. Stops when dropped.
pub(crate) struct OldTorchStore {
    addr: SocketAddr,
    state: Arc<State>,
    acceptor: Option<JoinHandle<()>>,
}

impl OldTorchStore {
    pub(crate) fn start() -> OldTorchStore {
        OldTorchStore::start_at(0)
    }

    /// On `port` of 127.0.0.1 (0: one from the OS).
    pub(crate) fn start_at(port: u16) -> OldTorchStore {
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind");
        let addr = listener.local_addr().expect("address");
        let state = Arc::new(State::default());
        let acceptor = thread::spawn({
            let state = state.clone();
            move || {
                for stream in listener.incoming() {
                    let generation = state.generation.load(Ordering::SeqCst);
                    if generation == STOPPED {
                        return;
                    }
                    let Ok(stream) = stream else { continue };
                    state.connections.fetch_add(1, Ordering::SeqCst);
                    let state = state.clone();
                    thread::spawn(move || serve(stream, &state, generation));
                }
            }
        });
        OldTorchStore {
            addr,
            state,
            acceptor: Some(acceptor),
        }
    }

    pub(crate) fn addr(&self) -> String {
        self.addr.to_string()
    }

    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Connections accepted so far.
    pub(crate) fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Pings received so far (each cost its client the connection).
    pub(crate) fn pings(&self) -> usize {
        self.state.pings.load(Ordering::SeqCst)
    }

    /// Closes every connection open now (the store keeps its keys).
    pub(crate) fn hang_up_all(&self) {
        self.state.generation.fetch_add(1, Ordering::SeqCst);
        // Each client's thread looks at least every 10 ms.
        thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for OldTorchStore {
    fn drop(&mut self) {
        self.state.generation.store(STOPPED, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

/// One client, served until it breaks the protocol, sends a query torch
/// 2.4 does not know, or the generation it came in changes.
fn serve(mut stream: TcpStream, state: &State, generation: usize) {
    let _ = stream.set_nodelay(true);
    if stream
        .set_read_timeout(Some(Duration::from_millis(10)))
        .is_err()
    {
        return;
    }
    let mut received = Vec::new();
    let mut waiting: Option<Vec<Vec<u8>>> = None;
    let mut validated = false;
    loop {
        if state.generation.load(Ordering::SeqCst) != generation {
            return;
        }
        if let Some(keys) = &waiting {
            let data = lock(&state.data);
            if keys.iter().all(|k| data.contains_key(k)) {
                drop(data);
                waiting = None;
                if stream.write_all(&[STOP_WAITING]).is_err() {
                    return;
                }
            }
        }
        let (reply, used) = match decode_query(&received) {
            Ok((query, used)) => {
                let mut reply = Vec::new();
                if !answer(state, query, &mut reply, &mut waiting, &mut validated) {
                    return; // Dropping the stream hangs up.
                }
                (reply, used)
            }
            Err(Undecodable::Incomplete) => {
                let mut chunk = [0u8; 4096];
                match stream.read(&mut chunk) {
                    Ok(0) => return,
                    Ok(n) => received.extend_from_slice(&chunk[..n]),
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock
                                | io::ErrorKind::TimedOut
                                | io::ErrorKind::Interrupted
                        ) => {}
                    Err(_) => return,
                }
                continue;
            }
            Err(Undecodable::Invalid(_)) => return,
        };
        received.drain(..used);
        if stream.write_all(&reply).is_err() {
            return;
        }
    }
}

/// Carries out `query` as torch 2.4's store does; false: hang up.
fn answer(
    state: &State,
    query: Query<'_>,
    reply: &mut Vec<u8>,
    waiting: &mut Option<Vec<Vec<u8>>>,
    validated: &mut bool,
) -> bool {
    if !*validated {
        *validated = query == Query::Validate(MAGIC);
        return *validated;
    }
    let mut data = lock(&state.data);
    match query {
        Query::Validate(magic) => return magic == MAGIC,
        Query::Set(key, value) => {
            data.insert(key.to_vec(), value.to_vec());
        }
        Query::CompareSet(key, expected, desired) => {
            let stored = match data.get(key).cloned() {
                None if !expected.is_empty() => expected.to_vec(),
                Some(current) if current != expected => current,
                _ => {
                    data.insert(key.to_vec(), desired.to_vec());
                    desired.to_vec()
                }
            };
            put_value(reply, &stored);
        }
        Query::Get(key) => match data.get(key) {
            Some(value) => put_value(reply, value),
            None => return false,
        },
        Query::Add(key, delta) => {
            let current: i64 = data
                .get(key)
                .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
                .unwrap_or(0);
            let new = current + delta;
            data.insert(key.to_vec(), new.to_string().into_bytes());
            put_i64(reply, new);
        }
        Query::Check(keys) => {
            let ready = keys.iter().all(|k| data.contains_key(*k));
            reply.push(if ready { READY } else { NOT_READY });
        }
        Query::Wait(keys) => {
            if keys.iter().all(|k| data.contains_key(*k)) {
                reply.push(STOP_WAITING);
            } else {
                *waiting = Some(keys.iter().map(|k| k.to_vec()).collect());
            }
        }
        Query::NumKeys => put_i64(reply, data.len() as i64),
        Query::DeleteKey(key) => put_i64(reply, i64::from(data.remove(key).is_some())),
        Query::Append(key, more) => data.entry(key.to_vec()).or_default().extend(more),
        Query::MultiGet(keys) => {
            for key in keys {
                match data.get(key) {
                    Some(value) => put_value(reply, value),
                    None => return false,
                }
            }
        }
        Query::MultiSet(pairs) => {
            for (key, value) in pairs {
                data.insert(key.to_vec(), value.to_vec());
            }
        }
        Query::CancelWait => {
            *waiting = None;
            reply.push(WAIT_CANCELED);
        }
        Query::Ping(_) => {
            state.pings.fetch_add(1, Ordering::SeqCst);
            return false;
        }
        // Torch 2.4 knows none of the others.
        _ => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_in_range, start_server, PATIENCE};
    use super::super::{Limits, Store, TcpStoreClient, TcpStoreServer, Update};
    use super::*;
    use crate::auth::Token;
    use crate::error::ErrorKind;
    use std::time::Instant;

    fn connect(store: &OldTorchStore) -> TcpStoreClient {
        TcpStoreClient::connect(&store.addr(), Instant::now() + PATIENCE)
            .expect("connect to a store without ping")
    }

    #[test]
    fn every_query_works_against_a_store_without_ping() {
        let store = OldTorchStore::start();
        let client = connect(&store);
        // The handshake's ping, once; nothing after asks for one.
        assert_eq!(store.pings(), 1);
        client.set("a", b"1").unwrap();
        client.append("a", b"2").unwrap();
        client.multi_set(&[("b", b"x"), ("c", b"")]).unwrap();
        let added = client
            .apply(&[Update::Add("n", 2), Update::Set("d", b"y")])
            .unwrap();
        assert_eq!(added, [2]);
        client.set_within("e", b"z", PATIENCE).unwrap();
        assert_eq!(client.get("a", PATIENCE).unwrap(), b"12");
        assert!(client.check(&["a", "b", "c", "d", "e"]).unwrap());
        assert_eq!(
            client.multi_get(&["d", "b"], PATIENCE).unwrap(),
            [b"y".to_vec(), b"x".to_vec()]
        );
        assert_eq!(client.set_if_absent("d", b"other").unwrap(), b"y".to_vec());
        // A wait that times out is withdrawn, and the connection stays
        // in step.
        let start = Instant::now();
        let err = client
            .wait(&["never"], Duration::from_millis(200))
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        assert_in_range(start.elapsed(), 150, 2000);
        assert_eq!(client.add("n", 1).unwrap(), 3);
        client.add_no_wait("n", 1).unwrap();
        assert_eq!(client.num_keys().unwrap(), 6);
        assert!(client.delete_key("e").unwrap());
        assert!(client.ping().unwrap() < PATIENCE);
        // Another client's set ends a wait.
        let writer = connect(&store);
        let setter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            writer.set("late", b"here").unwrap();
        });
        assert_eq!(client.get("late", PATIENCE).unwrap(), b"here");
        setter.join().unwrap();
        assert_eq!(client.add("n", 0).unwrap(), 4);
        assert_eq!(store.pings(), 2, "one per handshake");
    }

    #[test]
    fn a_mended_connection_to_a_store_without_ping_asks_no_ping_again() {
        let store = OldTorchStore::start();
        let client = connect(&store);
        client.set("k", b"v").unwrap();
        let (pings, connections) = (store.pings(), store.connections());
        store.hang_up_all();
        // The first query after the hang-up may find the connection lost;
        // the next makes it again.
        let _ = client.set("k", b"w");
        client.set("k", b"w").unwrap();
        assert_eq!(client.get("k", PATIENCE).unwrap(), b"w");
        assert_eq!(store.pings(), pings);
        assert_eq!(store.connections(), connections + 1);
    }

    #[test]
    fn rdists_store_is_still_pinged_and_still_asks_for_its_token() {
        let server = start_server();
        let addr = server.local_addr().to_string();
        let client = TcpStoreClient::connect(&addr, Instant::now() + PATIENCE).unwrap();
        client.set("k", b"v").unwrap();
        assert!(client.ping().unwrap() < PATIENCE);
        let guarded = TcpStoreServer::bind_with(
            "127.0.0.1:0".parse().unwrap(),
            Limits {
                token: Some(Token::new("s3cret")),
                ..Default::default()
            },
        )
        .unwrap();
        let start = Instant::now();
        let err =
            TcpStoreClient::connect(&guarded.local_addr().to_string(), Instant::now() + PATIENCE)
                .err()
                .expect("no token");
        assert_eq!(err.kind(), ErrorKind::Auth, "{err}");
        assert!(err.message().contains("requires an auth token"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_token_against_a_store_without_ping_is_refused_at_once_saying_why() {
        let store = OldTorchStore::start();
        let start = Instant::now();
        let err = TcpStoreClient::connect_with(
            &store.addr(),
            Instant::now() + PATIENCE,
            Some(&Token::new("s3cret")),
        )
        .err()
        .expect("torch's store cannot authenticate");
        assert_eq!(err.kind(), ErrorKind::Auth, "{err}");
        assert!(
            err.message()
                .contains("speaks the TCPStore protocol but not rdist's authentication"),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_server_that_hangs_up_on_everything_is_retried_until_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        thread::spawn({
            let accepted = accepted.clone();
            move || {
                for stream in listener.incoming() {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    drop(stream);
                }
            }
        });
        let start = Instant::now();
        let err = TcpStoreClient::connect(&addr, Instant::now() + Duration::from_millis(500))
            .err()
            .expect("nothing answers");
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        assert!(err.message().contains("could not reach"), "{err}");
        assert_in_range(start.elapsed(), 450, 3000);
        // Tried again and again, asking num_keys after each ping.
        assert!(accepted.load(Ordering::SeqCst) >= 4);
    }

    #[test]
    fn a_store_not_up_yet_is_waited_for_then_met_without_ping() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        // Nothing listens: refused until the deadline.
        let start = Instant::now();
        let err = TcpStoreClient::connect(&addr, Instant::now() + Duration::from_millis(300))
            .err()
            .expect("nothing listens");
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        assert_in_range(start.elapsed(), 250, 2000);
        // A store without ping that comes up later is met.
        let start = Instant::now();
        let client =
            thread::spawn(move || TcpStoreClient::connect(&addr, Instant::now() + PATIENCE));
        thread::sleep(Duration::from_millis(300));
        let store = OldTorchStore::start_at(port);
        let client = client.join().unwrap().expect("met once up");
        assert_in_range(start.elapsed(), 250, 3000);
        client.set("k", b"v").unwrap();
        assert_eq!(client.get("k", PATIENCE).unwrap(), b"v");
        drop(store);
    }
}
