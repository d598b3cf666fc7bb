//! The store server rank 0 hosts: keys and values in memory, served over
//! PyTorch's TCPStore protocol by one thread that waits on epoll (no thread
//! per client, so a thousand ranks or a flood of strangers cost a few
//! bytes each, not a thread each).
//!
//! Bounded against clients that misbehave (see [`Limits`]): a client must
//! validate within 5 s and send each query whole within 10 s of its first
//! byte; connections are capped, and at the
//! cap the oldest client that never validated makes room; keys and values
//! held, and bytes of queries still arriving, are capped in total. A client
//! that breaks a rule is disconnected (the protocol has no error reply)
//! and the reason is logged; the others are served on.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::protocol::{
    self, decode_query, put_i64, put_value, Query, Undecodable, AUTH_ACCEPTED, AUTH_CHALLENGE,
    AUTH_NO_TOKEN, MAGIC, NOT_READY, READY, STOP_WAITING, WAIT_CANCELED,
};
use crate::auth::{self, Side, Token};
use crate::error::{Error, Result};
use crate::sync::lock;

/// What store proofs are about (see `crate::auth`).
pub const STORE_CONTEXT: &[u8] = b"rdist store";
use crate::log;
use crate::options::LogLevel;

/// What the server allows its clients.
#[derive(Clone, Debug)]
pub struct Limits {
    /// How long a new client has to validate.
    pub handshake: Duration,
    /// How long a query may take to arrive once its first byte has.
    pub query: Duration,
    /// Most clients at once.
    pub connections: usize,
    /// Most clients that have not validated yet; more evict the oldest.
    pub unvalidated: usize,
    /// Most bytes of keys and values held (awaited keys included).
    pub stored_bytes: usize,
    /// Most bytes of queries still arriving, over all clients.
    pub arriving_bytes: usize,
    /// When set, the server stops by itself once no lease holds it and no
    /// client has asked anything for this long (see [`TcpStoreServer::lease`]).
    pub linger: Option<Duration>,
    /// When set, a client must prove it knows this token before anything
    /// but the handshake (see `crate::auth`).
    pub token: Option<Token>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            handshake: Duration::from_secs(5),
            query: Duration::from_secs(10),
            connections: 8192,
            unvalidated: 256,
            stored_bytes: 256 << 20,
            arriving_bytes: 256 << 20,
            linger: None,
            token: None,
        }
    }
}
/// Most bytes a client may send before it is admitted (its validation,
/// its proof of the token, a ping: under 100).
const PRE_ADMISSION_BYTES: usize = 256;
/// Replies waiting to be sent above which a client's further queries wait.
const REPLY_BACKLOG: usize = 1 << 20;
/// The listen backlog: wide jobs dial rank 0 all at once.
const LISTEN_BACKLOG: libc::c_int = 4096;

const LISTENER: u64 = 0;
const WAKER: u64 = 1;
const FIRST_CLIENT: u64 = 2;

/// One client.
struct Client {
    stream: TcpStream,
    peer: String,
    /// Distinguishes successive clients in one slot.
    serial: u64,
    received: Vec<u8>,
    replies: Vec<u8>,
    sent: usize,
    validated: bool,
    accepted: Instant,
    /// When the first byte of the query still arriving came.
    partial_since: Option<Instant>,
    /// The pending wait: its number, the keys it registered, and how
    /// many of them are still missing (0: not waiting).
    wait_serial: u64,
    awaited: Vec<Vec<u8>>,
    missing: usize,
    /// The pending wait is a WaitGet: answered with its key's value.
    wants_value: bool,
    writable_interest: bool,
    /// Proved the token (or the store has none).
    authenticated: bool,
    /// The nonces of the challenge in progress (the client's, ours).
    nonces: Option<(Vec<u8>, [u8; auth::NONCE_BYTES])>,
}

impl Client {
    /// Validated, and authenticated when the store has a token.
    fn admitted(&self) -> bool {
        self.validated && self.authenticated
    }
}

/// A client registered as waiting for a key.
#[derive(Clone, Copy)]
struct Waiter {
    slot: usize,
    serial: u64,
    wait_serial: u64,
    /// For a barrier: the count the key must reach (else: that it exists).
    until: Option<i64>,
}

/// Who still needs a server that stops by itself, shared by the serving
/// thread and the leases.
#[derive(Default)]
struct Lifetime {
    leases: usize,
    stopped: bool,
}

/// Everything the serving thread owns.
struct Server {
    lifetime: Arc<Mutex<Lifetime>>,
    /// When a query last came (or a client arrived).
    last_activity: Instant,
    limits: Limits,
    epoll: RawFd,
    listener: TcpListener,
    waker: UnixStream,
    clients: Vec<Option<Client>>,
    free_slots: Vec<usize>,
    live: usize,
    next_serial: u64,
    data: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    stored_bytes: usize,
    arriving_bytes: usize,
    waiters: HashMap<Vec<u8>, Vec<Waiter>>,
    accept_paused_until: Option<Instant>,
    /// Clients with a wait answered, to flush.
    woken: Vec<usize>,
    /// Queries answered so far (see `TcpStoreServer::queries_answered`).
    answered: Arc<AtomicU64>,
}

fn epoll_ctl(epoll: RawFd, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
    let mut event = libc::epoll_event { events, u64: token };
    // SAFETY: `event` is valid for the call; epoll and fd are open descriptors.
    if unsafe { libc::epoll_ctl(epoll, op, fd, &mut event) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Why a client is disconnected.
type Why = String;

impl Server {
    fn run(mut self) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        let mut next_sweep = Instant::now();
        loop {
            let timers = self.live > 0 || self.limits.linger.is_some();
            let timeout_ms = if timers || self.accept_paused_until.is_some() {
                250
            } else {
                -1
            };
            // SAFETY: `events` has room for events.len() entries.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll,
                    events.as_mut_ptr(),
                    events.len() as libc::c_int,
                    timeout_ms,
                )
            };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                thread::sleep(Duration::from_millis(10));
                continue;
            }
            for event in &events[..n as usize] {
                let (token, flags) = (event.u64, event.events);
                match token {
                    WAKER => return,
                    LISTENER => self.accept_all(),
                    _ => self.client_ready((token - FIRST_CLIENT) as usize, flags),
                }
            }
            let now = Instant::now();
            if now >= next_sweep {
                self.sweep(now);
                next_sweep = now + Duration::from_millis(250);
                if self.done_lingering(now) {
                    return;
                }
            }
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => self.admit(stream, peer),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    // Out of descriptors: make room from strangers, or stop
                    // accepting for a moment instead of spinning.
                    if !self.evict_oldest_unvalidated("the process ran out of descriptors") {
                        self.pause_accepting(&e);
                    }
                    return;
                }
            }
        }
    }

    fn pause_accepting(&mut self, why: &io::Error) {
        log::emit(
            LogLevel::Warn,
            None,
            &format!("rendezvous store: not accepting clients for 100 ms ({why})"),
        );
        let _ = epoll_ctl(
            self.epoll,
            libc::EPOLL_CTL_DEL,
            self.listener.as_raw_fd(),
            0,
            LISTENER,
        );
        self.accept_paused_until = Some(Instant::now() + Duration::from_millis(100));
    }

    fn admit(&mut self, stream: TcpStream, peer: SocketAddr) {
        let unvalidated = self
            .clients
            .iter()
            .flatten()
            .filter(|c| !c.admitted())
            .count();
        if unvalidated >= self.limits.unvalidated || self.live >= self.limits.connections {
            let room = self.evict_oldest_unvalidated("more clients arrived than the store admits");
            if !room && self.live >= self.limits.connections {
                log::emit(
                    LogLevel::Warn,
                    None,
                    &format!(
                        "rendezvous store: refused {peer}: it serves {} clients already",
                        self.live
                    ),
                );
                return;
            }
        }
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let _ = stream.set_nodelay(true);
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.clients.push(None);
            self.clients.len() - 1
        });
        let token = slot as u64 + FIRST_CLIENT;
        if epoll_ctl(
            self.epoll,
            libc::EPOLL_CTL_ADD,
            stream.as_raw_fd(),
            libc::EPOLLIN as u32,
            token,
        )
        .is_err()
        {
            self.free_slots.push(slot);
            return;
        }
        self.next_serial += 1;
        self.last_activity = Instant::now();
        self.clients[slot] = Some(Client {
            stream,
            peer: peer.to_string(),
            serial: self.next_serial,
            received: Vec::new(),
            replies: Vec::new(),
            sent: 0,
            validated: false,
            accepted: Instant::now(),
            partial_since: None,
            wait_serial: 0,
            awaited: Vec::new(),
            missing: 0,
            wants_value: false,
            writable_interest: false,
            authenticated: self.limits.token.is_none(),
            nonces: None,
        });
        self.live += 1;
    }

    /// Disconnects the longest-waiting client not yet admitted (validated,
    /// and authenticated when the store has a token); false
    /// when there is none.
    fn evict_oldest_unvalidated(&mut self, why: &str) -> bool {
        let oldest = self
            .clients
            .iter()
            .enumerate()
            .filter_map(|(slot, c)| {
                c.as_ref()
                    .filter(|c| !c.admitted())
                    .map(|c| (c.accepted, slot))
            })
            .min();
        match oldest {
            Some((_, slot)) => {
                self.disconnect(slot, format!("it had not been admitted when {why}"));
                true
            }
            None => false,
        }
    }

    fn disconnect(&mut self, slot: usize, why: Why) {
        let Some(client) = self.clients.get_mut(slot).and_then(Option::take) else {
            return;
        };
        log::emit(
            LogLevel::Info,
            None,
            &format!("rendezvous store: disconnected {}: {why}", client.peer),
        );
        let _ = epoll_ctl(
            self.epoll,
            libc::EPOLL_CTL_DEL,
            client.stream.as_raw_fd(),
            0,
            0,
        );
        self.arriving_bytes -= client.received.len();
        self.forget_wait(&client);
        self.free_slots.push(slot);
        self.live -= 1;
    }

    /// Withdraws a client's pending wait, if any.
    fn drop_wait(&mut self, slot: usize) {
        let Some(client) = self.clients.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.forget_wait(&client);
        let client = self.clients[slot].insert(client);
        client.awaited.clear();
        client.missing = 0;
        client.wants_value = false;
    }

    /// Removes a client's registrations as a waiter.
    fn forget_wait(&mut self, client: &Client) {
        for key in &client.awaited {
            if let Some(list) = self.waiters.get_mut(key) {
                list.retain(|w| w.serial != client.serial);
                if list.is_empty() {
                    self.waiters.remove(key);
                }
            }
            self.stored_bytes -= key.len();
        }
    }

    /// True (and marked stopped, so no lease can be taken any more) when
    /// no lease holds this server, no client waits and none has asked
    /// anything for the linger time.
    fn done_lingering(&self, now: Instant) -> bool {
        let Some(linger) = self.limits.linger else {
            return false;
        };
        let waiting = self.clients.iter().flatten().any(|c| c.missing > 0);
        if waiting || now.duration_since(self.last_activity) < linger {
            return false;
        }
        let mut lifetime = lock(&self.lifetime);
        if lifetime.leases > 0 {
            return false;
        }
        lifetime.stopped = true;
        true
    }

    /// Cuts off clients past their deadlines; resumes accepting.
    fn sweep(&mut self, now: Instant) {
        if self.accept_paused_until.is_some_and(|t| now >= t) {
            self.accept_paused_until = None;
            let _ = epoll_ctl(
                self.epoll,
                libc::EPOLL_CTL_ADD,
                self.listener.as_raw_fd(),
                libc::EPOLLIN as u32,
                LISTENER,
            );
        }
        let mut late = Vec::new();
        for (slot, client) in self.clients.iter().enumerate() {
            let Some(c) = client else { continue };
            let limits = &self.limits;
            if !c.admitted() && now.duration_since(c.accepted) > limits.handshake {
                late.push((
                    slot,
                    format!(
                        "it did not validate (and prove the token) within {:?}",
                        limits.handshake
                    ),
                ));
            } else if c
                .partial_since
                .is_some_and(|t| now.duration_since(t) > limits.query)
            {
                late.push((
                    slot,
                    format!("a query took longer than {:?} to arrive", limits.query),
                ));
            }
        }
        for (slot, why) in late {
            self.disconnect(slot, why);
        }
    }

    fn client_ready(&mut self, slot: usize, flags: u32) {
        let mut outcome = Ok(false);
        if flags & (libc::EPOLLOUT as u32) != 0 {
            outcome = self.flush(slot).map(|()| false);
        }
        if outcome.is_ok()
            && flags & ((libc::EPOLLIN | libc::EPOLLHUP | libc::EPOLLERR) as u32) != 0
        {
            outcome = self.receive(slot);
        }
        // Queries that came before the client hung up are still carried out.
        let outcome = outcome.and_then(|closed| {
            self.serve(slot)?;
            self.flush(slot)?;
            match closed {
                true => Err("it closed the connection".to_string()),
                false => Ok(()),
            }
        });
        if let Err(why) = outcome {
            self.disconnect(slot, why);
        }
        self.flush_woken();
    }

    /// Reads what has arrived, within the caps; true when the client hung up.
    fn receive(&mut self, slot: usize) -> std::result::Result<bool, Why> {
        let mut chunk = [0u8; 64 << 10];
        loop {
            let Some(client) = self.clients.get_mut(slot).and_then(Option::as_mut) else {
                return Ok(false);
            };
            match client.stream.read(&mut chunk) {
                Ok(0) => return Ok(true),
                Ok(n) => {
                    // Before admission only the handshake may come: a few
                    // dozen bytes.
                    if !client.admitted() && client.received.len() + n > PRE_ADMISSION_BYTES {
                        return Err("it sent more than a handshake before being admitted".into());
                    }
                    if self.arriving_bytes + n > self.limits.arriving_bytes {
                        // Make room from whoever holds the most, which is
                        // rarely the client that happens to read now.
                        let largest = self
                            .clients
                            .iter()
                            .enumerate()
                            .filter_map(|(i, c)| c.as_ref().map(|c| (c.received.len(), i)))
                            .max();
                        let why = format!(
                            "queries still arriving would hold more than {} bytes",
                            self.limits.arriving_bytes
                        );
                        match largest {
                            Some((held, other)) if other != slot && held >= n => {
                                self.disconnect(other, format!("{why}, and it held the most"));
                            }
                            _ => return Err(why),
                        }
                    }
                    let Some(client) = self.clients.get_mut(slot).and_then(Option::as_mut) else {
                        return Ok(false);
                    };
                    if client.received.is_empty() {
                        client.partial_since = Some(Instant::now());
                    }
                    client.received.extend_from_slice(&chunk[..n]);
                    self.arriving_bytes += n;
                    if n < chunk.len() {
                        return Ok(false);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(format!("reading failed ({e})")),
            }
        }
    }

    /// Answers every whole query received, while the client reads replies.
    fn serve(&mut self, slot: usize) -> std::result::Result<(), Why> {
        let Some(client) = self.clients.get_mut(slot).and_then(Option::as_mut) else {
            return Ok(());
        };
        let received = std::mem::take(&mut client.received);
        let mut used = 0;
        let mut outcome = Ok(());
        loop {
            let backlog = self.clients[slot]
                .as_ref()
                .map_or(0, |c| c.replies.len() - c.sent);
            if backlog > REPLY_BACKLOG {
                break;
            }
            match decode_query(&received[used..]) {
                Ok((query, len)) => {
                    used += len;
                    if let Err(why) = self.answer(slot, query) {
                        outcome = Err(why);
                        break;
                    }
                }
                Err(Undecodable::Incomplete) => break,
                Err(Undecodable::Invalid(why)) => {
                    outcome = Err(format!("it broke the TCPStore protocol: {why}"));
                    break;
                }
            }
        }
        self.arriving_bytes -= used;
        if let Some(client) = self.clients[slot].as_mut() {
            client.received = received;
            client.received.drain(..used);
            if used > 0 {
                client.partial_since = (!client.received.is_empty()).then(Instant::now);
            }
        }
        outcome
    }

    fn client(&mut self, slot: usize) -> &mut Client {
        self.clients[slot].as_mut().expect("a live client")
    }

    /// Carries out one query.
    fn answer(&mut self, slot: usize, query: Query<'_>) -> std::result::Result<(), Why> {
        self.last_activity = Instant::now();
        self.answered.fetch_add(1, Ordering::Relaxed);
        if !self.client(slot).validated {
            return match query {
                Query::Validate(MAGIC) => {
                    self.client(slot).validated = true;
                    Ok(())
                }
                Query::Validate(other) => Err(format!("it validated with magic {other:#x}")),
                _ => Err("it sent a query before validating".into()),
            };
        }
        if !self.client(slot).authenticated {
            return self.authenticate(slot, query);
        }
        match query {
            Query::Validate(_) => {}
            Query::AuthHello(_) => {
                // Authenticated already, or a store without a token.
                self.client(slot).replies.push(AUTH_NO_TOKEN);
            }
            Query::AuthProof(_) => return Err("it sent a proof that nobody asked for".into()),
            Query::Set(key, value) => self.set(key, value.to_vec())?,
            Query::CompareSet(key, expected, desired) => {
                let now = match self.data.get(key) {
                    None if !expected.is_empty() => expected.to_vec(),
                    Some(current) if current.as_slice() != expected => current.clone(),
                    _ => {
                        self.set(key, desired.to_vec())?;
                        desired.to_vec()
                    }
                };
                put_value(&mut self.client(slot).replies, &now);
            }
            Query::Get(key) => {
                // A missing key reads as empty, as from torch's libuv
                // server (clients wait for the key first).
                let value = self.data.get(key).map_or(&[][..], Vec::as_slice);
                let mut reply = Vec::with_capacity(value.len() + 8);
                put_value(&mut reply, value);
                self.client(slot).replies.extend_from_slice(&reply);
            }
            Query::Add(key, delta) => {
                let current = match self.data.get(key) {
                    None => 0,
                    Some(v) => std::str::from_utf8(v)
                        .ok()
                        .and_then(|s| s.trim().parse::<i64>().ok())
                        .ok_or_else(|| {
                            format!(
                                "it added to key '{}', whose value is not an integer",
                                printable(key)
                            )
                        })?,
                };
                let sum = current.checked_add(delta).ok_or_else(|| {
                    format!(
                        "adding {delta} to key '{}' ({current}) overflows",
                        printable(key)
                    )
                })?;
                self.set(key, sum.to_string().into_bytes())?;
                put_i64(&mut self.client(slot).replies, sum);
            }
            Query::Check(keys) => {
                let all = keys.iter().all(|k| self.present(k));
                self.client(slot)
                    .replies
                    .push(if all { READY } else { NOT_READY });
            }
            Query::Wait(keys) => self.wait(slot, &keys)?,
            Query::WaitGet(key) => self.wait_get(slot, key)?,
            Query::Arrive(counter, last, key, value, wait) => {
                if self.data.get(counter).is_some_and(|v| {
                    std::str::from_utf8(v).map_or(true, |t| t.trim().parse::<i64>().is_err())
                }) {
                    return Err(format!(
                        "it arrived at key '{}', whose value is not an integer",
                        printable(counter)
                    ));
                }
                self.add_one(counter)?;
                if self.counter(counter) >= last && !self.data.contains_key(key) {
                    self.set(key, value.to_vec())?;
                }
                if wait {
                    self.wait_get(slot, key)?;
                }
            }
            Query::NumKeys => {
                let n = self.data.len() as i64;
                put_i64(&mut self.client(slot).replies, n);
            }
            Query::DeleteKey(key) => {
                let deleted = match self.data.remove(key) {
                    Some(v) => {
                        self.stored_bytes -= key.len() + v.len();
                        1i64
                    }
                    None => 0,
                };
                put_i64(&mut self.client(slot).replies, deleted);
            }
            Query::Append(key, more) => {
                let mut value = self.data.get(key).cloned().unwrap_or_default();
                value.extend_from_slice(more);
                if value.len() > protocol::MAX_VALUE {
                    return Err(format!(
                        "appending made key '{}' longer than {} MiB",
                        printable(key),
                        protocol::MAX_VALUE >> 20
                    ));
                }
                self.set(key, value)?;
            }
            Query::MultiGet(keys) => {
                let mut reply = Vec::new();
                for key in keys {
                    let value = self.data.get(key).map_or(&[][..], Vec::as_slice);
                    if reply.len() + value.len() > self.limits.stored_bytes {
                        return Err("it asked for more than the store holds in one query".into());
                    }
                    put_value(&mut reply, value);
                }
                self.client(slot).replies.extend_from_slice(&reply);
            }
            Query::MultiSet(pairs) => {
                for (key, value) in pairs {
                    self.set(key, value.to_vec())?;
                }
            }
            Query::CancelWait => {
                self.drop_wait(slot);
                self.client(slot).replies.push(WAIT_CANCELED);
            }
            Query::Ping(nonce) => self
                .client(slot)
                .replies
                .extend_from_slice(&nonce.to_le_bytes()),
            Query::QueuePush(key, item) => {
                let grown = self.stored_bytes + key.len() + item.len();
                if grown > self.limits.stored_bytes {
                    return Err(format!(
                        "pushing to queue '{}' would make the store hold more than {} bytes",
                        printable(key),
                        self.limits.stored_bytes
                    ));
                }
                self.stored_bytes = grown;
                self.queues
                    .entry(key.to_vec())
                    .or_default()
                    .push_back(item.to_vec());
                self.wake(key);
            }
            Query::QueuePop(key) => {
                let queue = self.queues.get_mut(key);
                let len = queue.as_ref().map_or(0, |q| q.len());
                let item = queue.and_then(VecDeque::pop_front);
                if self.queues.get(key).is_some_and(VecDeque::is_empty) {
                    self.queues.remove(key);
                }
                let replies = &mut self.clients[slot].as_mut().expect("a live client").replies;
                put_i64(replies, len as i64);
                if let Some(item) = item {
                    put_value(replies, &item);
                    self.stored_bytes -= key.len() + item.len();
                }
            }
            Query::QueueLen(key) => {
                let len = self.queues.get(key).map_or(0, VecDeque::len);
                put_i64(&mut self.client(slot).replies, len as i64);
            }
            Query::ListKeys => {
                let mut reply = Vec::new();
                put_i64(&mut reply, self.data.len() as i64);
                for key in self.data.keys() {
                    put_value(&mut reply, key);
                }
                self.client(slot).replies.extend_from_slice(&reply);
            }
            Query::Barrier(key, world) => {
                self.add_one(key)?;
                if self.counter(key) >= world {
                    self.client(slot).replies.push(STOP_WAITING);
                } else {
                    self.register_wait(slot, &[key], Some(world))?;
                }
            }
        }
        Ok(())
    }

    /// The queries of a client that has not proved the token yet: only
    /// the challenge-response (see `crate::auth`); a ping is answered
    /// with the nonce inverted, which tells rdist's client that the store
    /// wants a token, and the client is then disconnected.
    fn authenticate(&mut self, slot: usize, query: Query<'_>) -> std::result::Result<(), Why> {
        let Some(token) = self.limits.token.clone() else {
            return Err("internal: an unauthenticated client of a store without a token".into());
        };
        match query {
            Query::AuthHello(client_nonce) => {
                let ours = auth::nonce();
                let proof = token.prove(Side::Answering, STORE_CONTEXT, client_nonce, &ours);
                let c = self.client(slot);
                c.nonces = Some((client_nonce.to_vec(), ours));
                c.replies.push(AUTH_CHALLENGE);
                c.replies.extend_from_slice(&ours);
                c.replies.extend_from_slice(&proof);
                Ok(())
            }
            Query::AuthProof(proof) => {
                let c = self.client(slot);
                let Some((theirs, ours)) = c.nonces.take() else {
                    return Err("it sent a proof before asking for a challenge".into());
                };
                if !token.verify(Side::Connecting, STORE_CONTEXT, &theirs, &ours, proof) {
                    return Err("its proof of the auth token was wrong".into());
                }
                c.authenticated = true;
                c.replies.push(AUTH_ACCEPTED);
                Ok(())
            }
            Query::Ping(nonce) => {
                self.client(slot)
                    .replies
                    .extend_from_slice(&(!nonce).to_le_bytes());
                let _ = self.flush(slot);
                Err("it has no auth token".into())
            }
            _ => Err("it sent a query without proving the auth token".into()),
        }
    }

    /// True when `key` holds a value or a non-empty queue.
    fn present(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.contains_key(key)
    }

    /// The integer under `key` (0 when missing or not an integer).
    fn counter(&self, key: &[u8]) -> i64 {
        self.data
            .get(key)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    fn add_one(&mut self, key: &[u8]) -> std::result::Result<(), Why> {
        let n = self.counter(key).saturating_add(1);
        self.set(key, n.to_string().into_bytes())
    }

    /// Stores a value (within the cap) and wakes the clients waiting for its key.
    fn set(&mut self, key: &[u8], value: Vec<u8>) -> std::result::Result<(), Why> {
        let old = self.data.get(key).map_or(0, |v| key.len() + v.len());
        let new = key.len() + value.len();
        if self.stored_bytes - old + new > self.limits.stored_bytes {
            return Err(format!(
                "setting key '{}' would make the store hold more than {} bytes",
                printable(key),
                self.limits.stored_bytes
            ));
        }
        self.stored_bytes = self.stored_bytes - old + new;
        self.data.insert(key.to_vec(), value);
        self.wake(key);
        Ok(())
    }

    /// Tells the clients waiting for `key` that it is there (a barrier's
    /// waiters: once its count is reached).
    fn wake(&mut self, key: &[u8]) {
        let count = self.counter(key);
        if let Some(waiters) = self.waiters.remove(key) {
            let (later, now): (Vec<Waiter>, Vec<Waiter>) = waiters
                .into_iter()
                .partition(|w| w.until.is_some_and(|n| count < n));
            if !later.is_empty() {
                self.waiters.insert(key.to_vec(), later);
            }
            for w in now {
                let Some(Some(c)) = self.clients.get_mut(w.slot) else {
                    continue;
                };
                if c.serial != w.serial || c.wait_serial != w.wait_serial || c.missing == 0 {
                    continue;
                }
                c.missing -= 1;
                if let Some(i) = c.awaited.iter().position(|k| k.as_slice() == key) {
                    self.stored_bytes -= c.awaited.swap_remove(i).len();
                }
                if c.missing == 0 {
                    c.replies.push(STOP_WAITING);
                    if std::mem::take(&mut c.wants_value) {
                        // Its one key, set just now.
                        put_value(
                            &mut c.replies,
                            self.data.get(key).map_or(&[][..], Vec::as_slice),
                        );
                    }
                    // Answered from another client's query: sent once
                    // that query is done.
                    self.woken.push(w.slot);
                }
            }
        }
    }

    /// Answers at once when every key exists, or registers the client.
    fn wait(&mut self, slot: usize, keys: &[&[u8]]) -> std::result::Result<(), Why> {
        let missing: Vec<&[u8]> = keys.iter().copied().filter(|k| !self.present(k)).collect();
        if missing.is_empty() {
            self.client(slot).replies.push(STOP_WAITING);
            return Ok(());
        }
        self.register_wait(slot, &missing, None)
    }

    /// Answers with the value of `key` at once when it is set, or
    /// registers the client as waiting for it (answered by `wake`).
    fn wait_get(&mut self, slot: usize, key: &[u8]) -> std::result::Result<(), Why> {
        match self.data.get(key) {
            Some(value) => {
                let replies = &mut self.clients[slot].as_mut().expect("a live client").replies;
                replies.push(STOP_WAITING);
                put_value(replies, value);
            }
            None => {
                self.register_wait(slot, &[key], None)?;
                self.client(slot).wants_value = true;
            }
        }
        Ok(())
    }

    /// Registers the client as waiting for `missing` (for `until`, see [`Waiter`]).
    fn register_wait(
        &mut self,
        slot: usize,
        missing: &[&[u8]],
        until: Option<i64>,
    ) -> std::result::Result<(), Why> {
        // A new wait replaces one still pending (its keys are released).
        self.drop_wait(slot);
        let held: usize = missing.iter().map(|k| k.len()).sum();
        if self.stored_bytes + held > self.limits.stored_bytes {
            return Err(format!(
                "its wait would make the store hold more than {} bytes",
                self.limits.stored_bytes
            ));
        }
        self.stored_bytes += held;
        let (serial, wait_serial) = {
            let c = self.client(slot);
            c.wait_serial += 1;
            c.missing = missing.len();
            c.awaited = missing.iter().map(|k| k.to_vec()).collect();
            (c.serial, c.wait_serial)
        };
        for key in missing {
            self.waiters.entry(key.to_vec()).or_default().push(Waiter {
                slot,
                serial,
                wait_serial,
                until,
            });
        }
        Ok(())
    }

    /// Sends the answers to the clients a query woke.
    fn flush_woken(&mut self) {
        while let Some(woken) = self.woken.pop() {
            if let Err(why) = self.flush(woken) {
                self.disconnect(woken, why);
            }
        }
    }

    /// Sends what replies the socket takes; asks to be told when it takes
    /// more.
    fn flush(&mut self, slot: usize) -> std::result::Result<(), Why> {
        let epoll = self.epoll;
        let Some(c) = self.clients.get_mut(slot).and_then(Option::as_mut) else {
            return Ok(());
        };
        while c.sent < c.replies.len() {
            match c.stream.write(&c.replies[c.sent..]) {
                Ok(0) => return Err("it stopped taking replies".into()),
                Ok(n) => c.sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(format!("writing failed ({e})")),
            }
        }
        let pending = c.sent < c.replies.len();
        if !pending {
            c.replies.clear();
            c.sent = 0;
        }
        if pending != c.writable_interest {
            c.writable_interest = pending;
            let events = if pending {
                (libc::EPOLLIN | libc::EPOLLOUT) as u32
            } else {
                libc::EPOLLIN as u32
            };
            epoll_ctl(
                epoll,
                libc::EPOLL_CTL_MOD,
                c.stream.as_raw_fd(),
                events,
                slot as u64 + FIRST_CLIENT,
            )
            .map_err(|e| format!("epoll failed ({e})"))?;
        }
        Ok(())
    }
}

/// A key for a log line: text when it is text, bytes otherwise, shortened.
fn printable(key: &[u8]) -> String {
    let text = String::from_utf8_lossy(&key[..key.len().min(80)]).into_owned();
    if key.len() > 80 {
        format!("{text}...")
    } else {
        text
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: the epoll descriptor is ours and closed once.
        unsafe { libc::close(self.epoll) };
    }
}

/// The rendezvous store server, hosted by rank 0. Serves until dropped.
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    answered: Arc<AtomicU64>,
    token: Option<Token>,
    lifetime: Arc<Mutex<Lifetime>>,
    /// Shut down to stop the serving thread.
    waker: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` and serves in a background thread.
    pub fn bind(addr: SocketAddr) -> Result<TcpStoreServer> {
        TcpStoreServer::bind_with(addr, Limits::default())
    }

    /// [`TcpStoreServer::bind`] with other limits.
    pub fn bind_with(addr: SocketAddr, limits: Limits) -> Result<TcpStoreServer> {
        let cannot_host = |err: &io::Error| {
            Error::system(format!("cannot host the rendezvous store on {addr}"), err)
        };
        let listener = TcpListener::bind(addr).map_err(|e| cannot_host(&e))?;
        // Listening again only widens the backlog (std uses 128).
        // SAFETY: the descriptor is a listening socket we own.
        unsafe { libc::listen(listener.as_raw_fd(), LISTEN_BACKLOG) };
        let local_addr = listener.local_addr().map_err(|e| cannot_host(&e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| cannot_host(&e))?;
        let (waker, wake_signal) = UnixStream::pair().map_err(|e| cannot_host(&e))?;
        // SAFETY: plain system call.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(cannot_host(&io::Error::last_os_error()));
        }
        let lifetime = Arc::new(Mutex::new(Lifetime::default()));
        let token = limits.token.clone();
        let server = Server {
            lifetime: Arc::clone(&lifetime),
            last_activity: Instant::now(),
            limits,
            epoll,
            listener,
            waker: wake_signal,
            clients: Vec::new(),
            free_slots: Vec::new(),
            live: 0,
            next_serial: 0,
            data: HashMap::new(),
            queues: HashMap::new(),
            stored_bytes: 0,
            arriving_bytes: 0,
            waiters: HashMap::new(),
            accept_paused_until: None,
            woken: Vec::new(),
            answered: Arc::default(),
        };
        let answered = Arc::clone(&server.answered);
        for (fd, token) in [
            (server.listener.as_raw_fd(), LISTENER),
            (server.waker.as_raw_fd(), WAKER),
        ] {
            epoll_ctl(epoll, libc::EPOLL_CTL_ADD, fd, libc::EPOLLIN as u32, token)
                .map_err(|e| cannot_host(&e))?;
        }
        let thread = thread::Builder::new()
            .name("rdist-store".into())
            .spawn(move || server.run())
            .map_err(|e| cannot_host(&e))?;
        Ok(TcpStoreServer {
            local_addr,
            answered,
            token,
            lifetime,
            waker,
            thread: Some(thread),
        })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// How many queries the server has answered: what a rendezvous costs
    /// rank 0's store, which serves every rank of a job.
    pub fn queries_answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    /// Holds a server bound with a linger time: it serves while any lease
    /// lives, then until idle for that long. `None` once it has stopped.
    pub fn lease(self: &Arc<Self>) -> Option<StoreLease> {
        let mut lifetime = lock(&self.lifetime);
        if lifetime.stopped {
            return None;
        }
        lifetime.leases += 1;
        Some(StoreLease(Arc::clone(self)))
    }
}

/// Keeps a lingering store server serving (see [`TcpStoreServer::lease`]).
pub struct StoreLease(Arc<TcpStoreServer>);

impl StoreLease {
    pub fn local_addr(&self) -> SocketAddr {
        self.0.local_addr
    }

    /// The token the store asks its clients for.
    pub fn token(&self) -> Option<&Token> {
        self.0.token.as_ref()
    }
}

impl Drop for StoreLease {
    fn drop(&mut self) {
        lock(&self.0.lifetime).leases -= 1;
    }
}

impl Drop for TcpStoreServer {
    /// Stops serving; every client's connection is closed, so clients
    /// blocked in a wait learn at once.
    fn drop(&mut self) {
        // Shutting down (rather than writing to) the socket cannot raise
        // SIGPIPE in a host process that does not ignore it.
        let _ = self.waker.shutdown(std::net::Shutdown::Both);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_in_range, connect, start_server, PATIENCE};
    use super::super::{Store, TcpStoreClient};
    use super::*;
    use crate::error::ErrorKind;
    use std::net::TcpStream;

    fn start_with(limits: Limits) -> TcpStoreServer {
        TcpStoreServer::bind_with("127.0.0.1:0".parse().expect("literal"), limits).expect("bind")
    }

    /// A raw connection, to speak the protocol (or not) by hand.
    fn raw(server: &TcpStoreServer) -> TcpStream {
        let stream = TcpStream::connect(server.local_addr()).expect("connect");
        stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
        stream
    }

    fn validated(server: &TcpStoreServer) -> TcpStream {
        let mut stream = raw(server);
        let mut hello = Vec::new();
        protocol::encode_query(&Query::Validate(MAGIC), &mut hello);
        stream.write_all(&hello).unwrap();
        stream
    }

    /// True when the server closed `stream` (within PATIENCE).
    fn closed_by_server(stream: &mut TcpStream) -> bool {
        let mut rest = Vec::new();
        match stream.read_to_end(&mut rest) {
            Ok(_) => true,
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
        }
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
    fn get_times_out_naming_the_key_and_the_connection_stays_usable() {
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
    fn adds_not_waited_for_count_and_keep_the_answers_in_step() {
        let server = start_server();
        let client = connect(&server);
        for _ in 0..3 {
            client.add_no_wait("n", 2).unwrap();
        }
        // Each later query reads its own answer, not an add's.
        assert_eq!(client.get("n", PATIENCE).unwrap(), b"6");
        client.add_no_wait("n", 1).unwrap();
        client.wait(&["n"], PATIENCE).unwrap();
        assert_eq!(client.add("n", 0).unwrap(), 7);
        client.add_no_wait("n", 1).unwrap();
        assert!(client.check(&["n"]).unwrap());
        assert_eq!(connect(&server).add("n", 0).unwrap(), 8);
    }

    #[test]
    fn a_wait_for_a_value_answers_with_it_once_set_and_can_be_withdrawn() {
        let server = start_server();
        let client = connect(&server);
        let err = client
            .wait_get("roster", Duration::from_millis(200))
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        assert!(err.message().contains("'roster'"), "{err}");
        // Withdrawn: the connection stays in step.
        assert_eq!(client.add("n", 1).unwrap(), 1);
        let writer = connect(&server);
        let setter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            writer.set("roster", b"every rank").unwrap();
        });
        assert_eq!(client.wait_get("roster", PATIENCE).unwrap(), b"every rank");
        setter.join().unwrap();
        // Present already: answered at once.
        assert_eq!(client.wait_get("roster", PATIENCE).unwrap(), b"every rank");
        assert_eq!(client.add("n", 1).unwrap(), 2);
    }

    #[test]
    fn arrivals_release_everyone_once_counted_and_a_failure_stays() {
        let server = start_server();
        let quiet = connect(&server);
        quiet.arrive_quietly("count", 3, "ready", b"ok").unwrap();
        let waiter = thread::spawn({
            let c = connect(&server);
            move || c.arrive("count", 3, "ready", b"ok", PATIENCE).unwrap()
        });
        thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished(), "released before the last arrival");
        let last = connect(&server);
        assert_eq!(
            last.arrive("count", 3, "ready", b"ok", PATIENCE).unwrap(),
            b"ok"
        );
        assert_eq!(waiter.join().unwrap(), b"ok");
        // The quiet arrival owes nothing: its connection stays in step.
        assert_eq!(quiet.add("count", 0).unwrap(), 3);
        // A failure said first is what the last arrival finds, not "ok".
        let failing = connect(&server);
        failing.set("ready2", b"rank 1 failed").unwrap();
        let got = last.arrive("count2", 1, "ready2", b"ok", PATIENCE).unwrap();
        assert_eq!(got, b"rank 1 failed");
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
            writer.multi_set(&[("c", b"3")]).unwrap();
        });
        client.wait(&["a", "b", "c"], PATIENCE).unwrap();
        setter.join().unwrap();
        assert!(client.check(&["a", "b", "c"]).unwrap());
    }

    #[test]
    fn every_other_command() {
        let server = start_server();
        let client = connect(&server);
        // compare_set: missing key with empty expected sets; with another
        // expected, nothing is stored and `expected` comes back (as torch).
        assert_eq!(client.compare_set("cs", b"", b"first").unwrap(), b"first");
        assert_eq!(client.compare_set("cs", b"wrong", b"x").unwrap(), b"first");
        assert_eq!(
            client.compare_set("cs", b"first", b"second").unwrap(),
            b"second"
        );
        assert_eq!(client.compare_set("none", b"old", b"x").unwrap(), b"old");
        assert!(!client.check(&["none"]).unwrap());
        client.append("log", b"ab").unwrap();
        client.append("log", b"cd").unwrap();
        assert_eq!(client.get("log", PATIENCE).unwrap(), b"abcd");
        client
            .multi_set(&[("m1", b"one"), ("m2", b""), ("m3", b"three")])
            .unwrap();
        assert_eq!(
            client.multi_get(&["m3", "m1", "m2"], PATIENCE).unwrap(),
            [b"three".to_vec(), b"one".to_vec(), vec![]]
        );
        assert_eq!(client.num_keys().unwrap(), 5);
        let mut keys = client.list_keys().unwrap();
        keys.sort();
        let expected: Vec<Vec<u8>> = ["/cs", "/log", "/m1", "/m2", "/m3"]
            .iter()
            .map(|k| k.as_bytes().to_vec())
            .collect();
        assert_eq!(keys, expected);
        assert!(client.delete_key("m1").unwrap());
        assert!(!client.delete_key("m1").unwrap());
        assert_eq!(client.num_keys().unwrap(), 4);
        assert!(client.ping().unwrap() < PATIENCE);
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
            drop_time < Duration::from_millis(300),
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
    fn garbage_wrong_magic_and_absurd_lengths_drop_only_that_client() {
        let server = start_server();
        let mut http = raw(&server);
        http.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert!(closed_by_server(&mut http));
        let mut wrong = raw(&server);
        wrong.write_all(&[0, 1, 2, 3, 4]).unwrap();
        assert!(closed_by_server(&mut wrong));
        let mut rogue = validated(&server);
        let mut huge_set = vec![1u8, 1, 0, 0, 0, 0, 0, 0, 0, b'k'];
        huge_set.extend_from_slice(&u64::MAX.to_le_bytes());
        rogue.write_all(&huge_set).unwrap();
        assert!(closed_by_server(&mut rogue));
        let client = connect(&server);
        client.set("still", b"serving").unwrap();
        assert_eq!(client.get("still", PATIENCE).unwrap(), b"serving");
    }

    #[test]
    fn silent_and_slow_clients_are_cut_off() {
        let server = start_with(Limits {
            handshake: Duration::from_millis(300),
            query: Duration::from_millis(600),
            ..Limits::default()
        });
        let start = Instant::now();
        let mut silent = raw(&server);
        assert!(closed_by_server(&mut silent));
        assert_in_range(start.elapsed(), 250, 2000);
        // Validated, then a set one byte at a time, slower than the limit.
        let mut slow = validated(&server);
        let start = Instant::now();
        let mut cut = false;
        for _ in 0..40 {
            if slow.write_all(&[1]).is_err() {
                cut = true;
                break;
            }
            thread::sleep(Duration::from_millis(100));
        }
        assert!(
            cut || closed_by_server(&mut slow),
            "a slow client was never cut off"
        );
        assert!(start.elapsed() < Duration::from_secs(4));
        // An idle client that validated is kept, and served.
        let client = connect(&server);
        thread::sleep(Duration::from_millis(800));
        client.set("k", b"v").unwrap();
    }

    #[test]
    fn a_flood_of_silent_connections_never_keeps_a_real_client_out() {
        let server = start_with(Limits {
            unvalidated: 32,
            ..Limits::default()
        });
        let mut silent: Vec<TcpStream> = (0..200).map(|_| raw(&server)).collect();
        let start = Instant::now();
        let client =
            TcpStoreClient::connect(&server.local_addr().to_string(), Instant::now() + PATIENCE)
                .expect("a real client gets in");
        client.set("k", b"v").unwrap();
        assert!(start.elapsed() < Duration::from_secs(2));
        // The oldest silent ones made room: closed by the server.
        let closed = silent
            .iter_mut()
            .take(100)
            .map(closed_by_server)
            .filter(|closed| *closed)
            .count();
        assert_eq!(closed, 100);
    }

    #[test]
    fn the_memory_cap_drops_the_client_that_exceeds_it_and_serves_the_rest() {
        let server = start_with(Limits {
            stored_bytes: 1 << 20,
            ..Limits::default()
        });
        let greedy = connect(&server);
        greedy.set("a", &vec![7u8; 600 << 10]).unwrap();
        let err = greedy.set("b", &vec![7u8; 600 << 10]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::PeerLost, "{err}");
        let other = connect(&server);
        assert_eq!(other.get("a", PATIENCE).unwrap().len(), 600 << 10);
        assert!(!other.check(&["b"]).unwrap());
        assert!(other.delete_key("a").unwrap());
        other.set("b", &vec![7u8; 600 << 10]).unwrap();
    }

    #[test]
    fn a_thousand_clients_are_served_by_one_thread() {
        let server = start_server();
        let clients: Vec<TcpStoreClient> = (0..1000).map(|_| connect(&server)).collect();
        for (i, c) in clients.iter().enumerate() {
            c.set(&format!("rank/{i}"), i.to_string().as_bytes())
                .unwrap();
        }
        let keys: Vec<String> = (0..1000).map(|i| format!("rank/{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        clients[999].wait(&refs, PATIENCE).unwrap();
        assert_eq!(clients[0].get("rank/999", PATIENCE).unwrap(), b"999");
    }

    fn with_token(secret: &str) -> TcpStoreServer {
        start_with(Limits {
            token: Some(Token::new(secret)),
            ..Limits::default()
        })
    }

    fn client_with(server: &TcpStoreServer, secret: Option<&str>) -> crate::Result<TcpStoreClient> {
        let token = secret.map(Token::new);
        TcpStoreClient::connect_with(
            &server.local_addr().to_string(),
            Instant::now() + Duration::from_secs(2),
            token.as_ref(),
        )
    }

    #[test]
    fn the_token_is_proved_both_ways_and_wrong_or_missing_tokens_are_named() {
        let server = with_token("s3cret");
        let good = client_with(&server, Some("s3cret")).unwrap();
        good.set("k", b"v").unwrap();
        assert_eq!(good.get("k", PATIENCE).unwrap(), b"v");

        let wrong = client_with(&server, Some("guess"))
            .err()
            .expect("a wrong token");
        assert_eq!(wrong.kind(), ErrorKind::Auth, "{wrong}");
        assert!(
            wrong
                .message()
                .contains("does not know this job's auth token"),
            "{wrong}"
        );

        let none = client_with(&server, None).err().expect("no token");
        assert_eq!(none.kind(), ErrorKind::Auth, "{none}");
        assert!(none.message().contains("requires an auth token"), "{none}");

        let open = start_server();
        let extra = client_with(&open, Some("s3cret"))
            .err()
            .expect("a store without a token");
        assert_eq!(extra.kind(), ErrorKind::Auth, "{extra}");
        assert!(extra.message().contains("has no auth token"), "{extra}");
        // The good client is still served.
        assert_eq!(good.get("k", PATIENCE).unwrap(), b"v");
    }

    #[test]
    fn nothing_but_the_handshake_is_served_before_the_proof() {
        let server = with_token("s3cret");
        // Validated, then a set without authenticating: dropped, not stored.
        let mut stranger = validated(&server);
        let mut set = Vec::new();
        protocol::encode_query(&Query::Set(b"/k", b"stolen"), &mut set);
        stranger.write_all(&set).unwrap();
        assert!(closed_by_server(&mut stranger));
        // A challenge answered with a made-up proof: dropped.
        let mut forger = validated(&server);
        let mut hello = Vec::new();
        protocol::encode_query(&Query::AuthHello(&[1; 32]), &mut hello);
        forger.write_all(&hello).unwrap();
        let mut challenge = [0u8; 65];
        forger.read_exact(&mut challenge).unwrap();
        assert_eq!(challenge[0], AUTH_CHALLENGE);
        let mut proof = Vec::new();
        protocol::encode_query(&Query::AuthProof(&challenge[33..65]), &mut proof);
        forger.write_all(&proof).unwrap();
        assert!(
            closed_by_server(&mut forger),
            "a reflected proof was accepted"
        );
        let good = client_with(&server, Some("s3cret")).unwrap();
        assert!(!good.check(&["k"]).unwrap());
    }

    #[test]
    fn a_client_that_never_proves_the_token_is_cut_off_and_cannot_flood() {
        let server = start_with(Limits {
            token: Some(Token::new("s3cret")),
            handshake: Duration::from_millis(300),
            ..Limits::default()
        });
        // Validated, then silent: no proof, so cut off at the deadline.
        let mut idle = validated(&server);
        let start = Instant::now();
        assert!(closed_by_server(&mut idle));
        assert_in_range(start.elapsed(), 250, 2000);
        // Validated, then a big query before any proof: cut off at once.
        let mut flooder = validated(&server);
        let mut big = Vec::new();
        protocol::encode_query(&Query::Set(b"/k", &vec![1u8; 4096]), &mut big);
        let _ = flooder.write_all(&big);
        assert!(closed_by_server(&mut flooder));
    }

    #[test]
    fn a_new_wait_replaces_the_pending_one() {
        let server = start_server();
        let mut waiter = validated(&server);
        let mut both = Vec::new();
        protocol::encode_query(&Query::Wait(vec![b"/a"]), &mut both);
        protocol::encode_query(&Query::Wait(vec![b"/b"]), &mut both);
        waiter.write_all(&both).unwrap();
        let setter = connect(&server);
        setter.set("a", b"1").unwrap();
        waiter
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut b = [0u8; 1];
        assert!(
            waiter.read(&mut b).is_err(),
            "the replaced wait was answered"
        );
        setter.set("b", b"2").unwrap();
        waiter.set_read_timeout(Some(PATIENCE)).unwrap();
        waiter.read_exact(&mut b).unwrap();
        assert_eq!(b[0], STOP_WAITING);
    }
}
