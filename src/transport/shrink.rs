//! The survivors' agreement at a shrink: which ranks of a communicator
//! go on, the same answer on every survivor whatever each had noticed,
//! whichever rank died (the store's host too), over fresh connections to
//! the parent's listeners (the parent's own connections may be broken,
//! and a failed parent refuses its peers).
//!
//! Every survivor dials the lowest rank it does not know to be out (failed
//! or excluded) with a shrink hello and its ballot (`survivors::Ballot`).
//! That rank, if it believes itself the lowest, coordinates: it counts
//! the ballots, probes the ranks it has no ballot from (a refused dial is
//! a dead process; an answer, a rank yet to call shrink), and once every
//! rank is counted, failed or excluded it answers every ballot with the
//! decision. A rank that is not coordinating answers a ballot with the
//! rank it asks itself (its senders ask that one). When the coordinator
//! dies its ballots' senders see the connection end and ask the next
//! lowest, which coordinates in turn. Every rank that has the decision
//! keeps it in its `Inbox`, and its endpoint's thread answers late ballots
//! (and probes) with it, whether or not the rank is still in its shrink
//! call: a coordinator whose probe finds a decision already taken (its
//! predecessor died after answering some ranks) adopts it.
//!
//! Suspicions are checked, not trusted, where a wrong one would split the
//! survivors: a rank about to coordinate first probes the lower ranks it
//! believes failed, and a coordinator whose probe finds a lower rank alive
//! steps down to it.

use super::greeting::{self, Refusal, HELLO_AUTH_FLAG, HELLO_BYTES};
use super::membership::survivors::{Answer, Ballot, Decision, Tally};
use super::mesh::{self, MeshSpec};
use super::signal::Wake;
use crate::error::{Error, ErrorKind, Result};
use crate::log;
use crate::options::LogLevel;
use crate::sync::lock;
use std::collections::BTreeSet;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SHRINK_MAGIC: u32 = 0x5244_5331; // "RDS1"

/// Byte 36 of a shrink hello: what the dialer wants.
const PURPOSE: usize = 36;
/// A ballot follows; the answer comes when the shrink is decided.
const BALLOT: u8 = 1;
/// Is this rank's process alive? Answered `ALIVE` at once.
const PROBE: u8 = 2;
const ALIVE: u8 = 0x21;
/// Bytes 38..40: the shrink's number (the epoch) on this communicator.
const EPOCH: usize = 38;

/// How long a probe may take: a live rank's endpoint thread answers at
/// once, a dead process's address refuses; no answer by then (a stopped
/// process, a vanished host) counts as failed.
const PROBE_LIMIT: Duration = Duration::from_secs(3);
/// How long a rank waits for the rank it asked before it probes it.
const LOOK_AFTER: Duration = Duration::from_secs(1);
/// Probes run at most this many at once.
const PROBES_AT_ONCE: usize = 64;

/// A ballot that reached this rank: its sender waits for an answer.
struct Caller {
    rank: usize,
    epoch: u16,
    stream: TcpStream,
}

struct State {
    /// The number of this rank's latest shrink of the communicator.
    epoch: u16,
    /// Whether that shrink is under way (its ballots are read).
    active: bool,
    waiting: Vec<Caller>,
    /// The latest shrink's answer, once known: late ballots get it.
    settled: Option<(u16, Vec<u8>)>,
}

/// Where ballots for this rank wait (one per communicator, beside its
/// links), filled by the endpoint's thread.
pub struct Inbox {
    state: Mutex<State>,
    bell: Wake,
}

impl Inbox {
    pub fn new() -> Result<Inbox> {
        Ok(Inbox {
            state: Mutex::new(State {
                epoch: 0,
                active: false,
                waiting: Vec::new(),
                settled: None,
            }),
            bell: Wake::new().map_err(|e| Error::system("eventfd", &e))?,
        })
    }

    /// Starts this rank's next shrink: its number.
    fn begin(&self) -> u16 {
        let mut st = lock(&self.state);
        st.epoch = st.epoch.wrapping_add(1);
        st.active = true;
        st.epoch
    }

    /// Ends it (ballots of it that come later get the settled answer, or
    /// a refusal).
    fn end(&self, me: usize) {
        let waiting = {
            let mut st = lock(&self.state);
            st.active = false;
            std::mem::take(&mut st.waiting)
        };
        let settled = lock(&self.state).settled.clone();
        for mut c in waiting {
            match &settled {
                Some((epoch, bytes)) => reply(&mut c, *epoch, bytes, me),
                None => refuse(&mut c, "its rdist_comm_shrink ended without a decision", me),
            }
        }
    }

    fn take(&self) -> Vec<Caller> {
        self.bell.drain();
        std::mem::take(&mut lock(&self.state).waiting)
    }

    /// Keeps the answer of shrink `epoch` and gives it to every ballot
    /// waiting for it.
    fn settle(&self, epoch: u16, answer: &Answer, me: usize) {
        let bytes = answer.encode();
        let waiting = {
            let mut st = lock(&self.state);
            st.settled = Some((epoch, bytes.clone()));
            std::mem::take(&mut st.waiting)
        };
        for mut c in waiting {
            reply(&mut c, epoch, &bytes, me);
        }
    }

    /// The settled answer of shrink `epoch`, if any.
    fn settled(&self, epoch: u16) -> Option<Vec<u8>> {
        match &lock(&self.state).settled {
            Some((e, bytes)) if *e == epoch => Some(bytes.clone()),
            _ => None,
        }
    }
}

/// Answers a waiting ballot (not read) with `bytes` if it is of shrink
/// `epoch`, else says the two ranks are at different shrinks.
fn reply(c: &mut Caller, epoch: u16, bytes: &[u8], me: usize) {
    skip_unread(&c.stream);
    if c.epoch == epoch {
        send_answer(&mut c.stream, bytes);
        return;
    }
    let why = format!(
        "rank {} is at shrink #{} of this communicator and rank {me} at #{epoch}: every remaining rank must call rdist_comm_shrink as often",
        c.rank, c.epoch
    );
    send_answer(&mut c.stream, &Answer::Refused(why).encode());
}

fn refuse(c: &mut Caller, why: &str, me: usize) {
    skip_unread(&c.stream);
    let why = Answer::Refused(format!("rank {me}: {why}"));
    send_answer(&mut c.stream, &why.encode());
}

/// Reads, without waiting, what the sender of an unread ballot sent: a
/// socket closed with bytes unread resets the connection, and the reset
/// can take the answer with it.
fn skip_unread(stream: &TcpStream) {
    let mut scratch = [0u8; 4096];
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    while matches!((&*stream).read(&mut scratch), Ok(n) if n > 0) {}
    let _ = stream.set_nonblocking(false);
}

/// Writes an answer without blocking the writer long (the endpoint's
/// thread among them): a caller that stopped reading loses it.
fn send_answer(stream: &mut TcpStream, bytes: &[u8]) {
    let _ = stream.set_write_timeout(Some(Duration::from_millis(200)));
    let _ = write_frame(stream, bytes);
}

/// Gives every held ballot's sender `bytes`.
fn answer_all(held: Vec<(usize, TcpStream)>, bytes: &[u8]) {
    for (_, mut stream) in held {
        send_answer(&mut stream, bytes);
    }
}

/// Whether a greeted hello is a shrink's rather than a pair's.
pub fn is_shrink_hello(hello: &[u8; HELLO_BYTES]) -> bool {
    hello[0..4] == SHRINK_MAGIC.to_le_bytes()
}

fn hello(spec: &MeshSpec, purpose: u8, epoch: u16) -> [u8; HELLO_BYTES] {
    let mut b = mesh::hello_with(spec, SHRINK_MAGIC);
    b[PURPOSE] = purpose;
    debug_assert_eq!(HELLO_AUTH_FLAG, 37);
    b[EPOCH..EPOCH + 2].copy_from_slice(&epoch.to_le_bytes());
    b
}

/// The endpoint thread's part, for a greeted shrink hello: a probe is
/// answered at once (with the settled answer of its shrink, if any), a
/// ballot waits in the inbox (or gets the settled answer, or a refusal
/// when it is of a shrink this rank has finished). Never blocks long.
pub fn admit(inbox: &Inbox, spec: &MeshSpec, b: &[u8; HELLO_BYTES], mut s: TcpStream) {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]) as usize;
    let rank = u32_at(28);
    let ours = b[4..20] == spec.job
        && b[20..28] == spec.comm_id.to_le_bytes()
        && u32_at(32) == spec.size
        && rank < spec.size
        && rank != spec.rank;
    if !ours || !mesh::came_from(spec, rank, &s) {
        return;
    }
    let epoch = u16::from_le_bytes([b[EPOCH], b[EPOCH + 1]]);
    match b[PURPOSE] {
        PROBE => {
            let settled = inbox.settled(epoch).unwrap_or_default();
            let mut answer = vec![ALIVE];
            answer.extend_from_slice(&(settled.len() as u32).to_le_bytes());
            answer.extend_from_slice(&settled);
            let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
            let _ = s.write_all(&answer);
        }
        BALLOT => {
            let mut c = Caller {
                rank,
                epoch,
                stream: s,
            };
            let mut st = lock(&inbox.state);
            if let Some((settled, bytes)) = &st.settled {
                if *settled == epoch {
                    let bytes = bytes.clone();
                    drop(st);
                    send_answer(&mut c.stream, &bytes);
                    return;
                }
            }
            // A shrink this rank has finished (or is past): no answer will
            // come for it.
            let over = epoch < st.epoch || (epoch == st.epoch && !st.active);
            if over && st.epoch > 0 {
                let mine = st.epoch;
                drop(st);
                reply(&mut c, mine, &[], spec.rank);
                return;
            }
            st.waiting.push(c);
            inbox.bell.ring();
        }
        _ => {}
    }
}

fn write_frame(s: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
    let mut b = Vec::with_capacity(4 + bytes.len());
    b.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    b.extend_from_slice(bytes);
    s.write_all(&b)
}

/// Reads one length-prefixed message of at most `limit` bytes (blocking,
/// bounded by the stream's read timeout).
fn read_frame(s: &mut TcpStream, limit: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a shrink message of {n} bytes"),
        ));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// Most bytes a ballot or an answer of a world of `size` takes.
fn frame_limit(size: usize) -> usize {
    64 + 8 * size + 1024
}

/// Why a dial to another rank got nowhere.
enum Unreached {
    /// Its process is gone (refused, reset, unreachable) or it did not
    /// answer in time (stopped, or its host vanished).
    Gone,
    /// Something of this rank's own failed (descriptors, addresses), or
    /// the peer refused this rank's token: not the peer's death.
    Here(Error),
}

/// Whether an error of a dial says the other side is gone (rather than
/// something of this side's own).
fn peer_gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::TimedOut
            | io::ErrorKind::WouldBlock
            | io::ErrorKind::NotConnected
    ) || matches!(
        e.raw_os_error(),
        Some(libc::EHOSTUNREACH | libc::ENETUNREACH | libc::EHOSTDOWN | libc::ENETDOWN)
    )
}

/// Dials `peer`'s listener with a shrink hello; the connection and its
/// greeting are bounded by `limit` (a peer that takes longer, stopped or
/// on a vanished host, counts as gone).
fn dial(
    spec: &MeshSpec,
    peer: usize,
    purpose: u8,
    epoch: u16,
    limit: Instant,
) -> std::result::Result<TcpStream, Unreached> {
    let left = limit.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Unreached::Gone);
    }
    let why = |e: io::Error| match peer_gone(&e) {
        true => Unreached::Gone,
        false => Unreached::Here(Error::system(
            format!("rdist_comm_shrink dialing rank {peer}"),
            &e,
        )),
    };
    let mut s = mesh::connect_from(spec.addrs[spec.rank].ip(), spec.addrs[peer], left, None)
        .map_err(why)?;
    let _ = s.set_nodelay(true);
    let hello = hello(spec, purpose, epoch);
    greeting::introduce(&mut s, &hello, spec.token.as_ref(), limit, None).map_err(|e| match e {
        Refusal::Auth(text) => Unreached::Here(Error::new(
            ErrorKind::Auth,
            format!(
                "rank {} cannot reach rank {peer} for rdist_comm_shrink: {text}",
                spec.rank
            ),
        )),
        Refusal::Io(e) => why(e),
    })?;
    Ok(s)
}

/// What a probe found.
enum Probed {
    /// No answer (refused, closed, or none within `PROBE_LIMIT`).
    Dead,
    /// Its process answers; with the answer it settled for this shrink.
    Alive(Option<Answer>),
}

/// Probes `peer`'s process.
fn probe(spec: &MeshSpec, peer: usize, epoch: u16, deadline: Instant) -> Result<Probed> {
    probe_until(
        spec,
        peer,
        epoch,
        deadline.min(Instant::now() + PROBE_LIMIT),
    )
}

/// What a rank's process said when asked whether it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// It answered (or refused this rank's credentials: it runs too).
    Runs,
    /// Nobody listens at its address: it exited, or destroyed its
    /// communicator.
    Gone,
    /// No answer by the limit: stopped (a signal, a debugger), or its
    /// host unreachable.
    Silent,
}

/// Asks `peer`'s process whether it runs, until `limit`. Its endpoint's
/// thread answers at once, whatever its caller is doing, so a rank that
/// merely computes answers. A connection dropped before the answer (its
/// thread may have let the greeting expire while it was busy admitting
/// another) proves nothing: asked again, until `limit`. For waits that
/// hear nothing from a peer: see `transport::watch`.
pub fn answers(spec: &MeshSpec, peer: usize, limit: Instant) -> Liveness {
    loop {
        let left = limit.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Liveness::Silent;
        }
        let mut s =
            match mesh::connect_from(spec.addrs[spec.rank].ip(), spec.addrs[peer], left, None) {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Liveness::Gone,
                Err(e) if timed_out(&e) => return Liveness::Silent,
                // Unreachable for now (a vanished host's neighbours say so
                // late), out of descriptors: again shortly.
                Err(_) => {
                    std::thread::sleep(ASK_AGAIN.min(left));
                    continue;
                }
            };
        let _ = s.set_nodelay(true);
        let hello = hello(spec, PROBE, 0);
        let answered = match greeting::introduce(&mut s, &hello, spec.token.as_ref(), limit, None) {
            // Refused credentials come from a running process.
            Err(Refusal::Auth(_)) => return Liveness::Runs,
            Err(Refusal::Io(e)) => Err(e),
            Ok(()) => {
                let left = limit
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                let mut b = [0u8; 1];
                s.set_read_timeout(Some(left))
                    .and_then(|()| s.read_exact(&mut b))
                    .map(|()| b[0] == ALIVE)
            }
        };
        match answered {
            Ok(true) => return Liveness::Runs,
            Err(e) if timed_out(&e) => return Liveness::Silent,
            // Dropped, or an answer of another kind: again shortly.
            _ => std::thread::sleep(ASK_AGAIN.min(limit.saturating_duration_since(Instant::now()))),
        }
    }
}

/// A read or connect that ran out of time (a blocking socket's timeout
/// reads as WouldBlock).
fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

/// How soon a question whose connection was dropped is asked again.
const ASK_AGAIN: Duration = Duration::from_millis(200);

fn probe_until(spec: &MeshSpec, peer: usize, epoch: u16, limit: Instant) -> Result<Probed> {
    let mut s = match dial(spec, peer, PROBE, epoch, limit) {
        Ok(s) => s,
        Err(Unreached::Gone) => return Ok(Probed::Dead),
        Err(Unreached::Here(e)) => return Err(e),
    };
    let left = limit
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let mut b = [0u8; 1];
    if s.set_read_timeout(Some(left)).is_err() || s.read_exact(&mut b).is_err() || b[0] != ALIVE {
        return Ok(Probed::Dead);
    }
    let settled = read_frame(&mut s, frame_limit(spec.size)).ok();
    Ok(Probed::Alive(settled.and_then(|b| {
        (!b.is_empty())
            .then(|| Answer::decode(&b, spec.size))
            .flatten()
    })))
}

/// Probes `ranks`, `PROBES_AT_ONCE` at a time; each one's result.
fn probe_all(
    spec: &MeshSpec,
    ranks: &[usize],
    epoch: u16,
    deadline: Instant,
) -> Result<Vec<(usize, Probed)>> {
    let mut out = Vec::with_capacity(ranks.len());
    for chunk in ranks.chunks(PROBES_AT_ONCE) {
        let results: Vec<(usize, Result<Probed>)> = std::thread::scope(|scope| {
            let probes: Vec<_> = chunk
                .iter()
                .map(|&r| (r, scope.spawn(move || probe(spec, r, epoch, deadline))))
                .collect();
            probes
                .into_iter()
                .map(|(r, p)| {
                    let result = p
                        .join()
                        .unwrap_or_else(|_| Err(Error::internal("a shrink's probe panicked")));
                    (r, result)
                })
                .collect()
        });
        for (r, p) in results {
            out.push((r, p?));
        }
    }
    Ok(out)
}

/// Polls `fds` for input (or their end) up to `wait`.
fn wait_for(fds: &[i32], wait: Duration) {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = wait.as_millis().clamp(1, 1000) as libc::c_int;
    // SAFETY: a live array of pollfd.
    unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
}

/// Whether the other end of a connection that sends nothing closed it.
fn ended(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: peeks one byte into a live buffer, without blocking.
    let n = unsafe {
        libc::recv(
            s.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n == 0 {
        return true;
    }
    n < 0 && {
        let e = io::Error::last_os_error();
        !matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        )
    }
}

/// What this rank brings to a shrink.
pub struct Want<'a> {
    /// The ranks its caller leaves out (none: only the failed ones).
    pub exclude: &'a [usize],
    /// The ranks it knows failed.
    pub failed: Vec<usize>,
    /// The port it listens on for the new communicator.
    pub port: u16,
}

/// Runs this rank's part of a shrink of the communicator `spec`
/// describes; returns the decision (which names this rank), bounded by
/// `timeout`.
pub fn agree(
    inbox: &Inbox,
    spec: &MeshSpec,
    want: Want<'_>,
    timeout: Duration,
) -> Result<Decision> {
    let epoch = inbox.begin();
    let result = run(inbox, spec, want, timeout, epoch);
    inbox.end(spec.rank);
    result
}

fn run(
    inbox: &Inbox,
    spec: &MeshSpec,
    want: Want<'_>,
    timeout: Duration,
    epoch: u16,
) -> Result<Decision> {
    let deadline = Instant::now() + timeout;
    let me = spec.rank;
    let mut exclude = want.exclude.to_vec();
    exclude.sort_unstable();
    exclude.dedup();
    let mut ballot = Ballot {
        epoch,
        port: want.port,
        exclude: exclude.clone(),
        failed: want.failed.clone(),
    };
    // The ranks this rank believes out: it asks the lowest of the others.
    let mut out: BTreeSet<usize> = exclude.iter().chain(&want.failed).copied().collect();
    out.remove(&me);
    let mut ask: Option<usize> = None;
    // Ranks this rank itself found gone in this shrink (no need to check).
    let mut found_gone: BTreeSet<usize> = BTreeSet::new();
    loop {
        if Instant::now() >= deadline {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "rank {me}'s rdist_comm_shrink timed out after {:.1} s waiting for the lowest remaining rank's decision (ranks believed out: {:?})",
                    timeout.as_secs_f64(),
                    out
                ),
            ));
        }
        let lowest = (0..spec.size)
            .find(|r| !out.contains(r))
            .expect("this rank is never out");
        let c = ask.take().unwrap_or(lowest);
        let step = if c == me {
            // The lower ranks believed failed are checked first: a live
            // one coordinates instead (a wrong suspicion must not make
            // two coordinators).
            let suspects: Vec<usize> = (0..me)
                .filter(|r| {
                    out.contains(r) && exclude.binary_search(r).is_err() && !found_gone.contains(r)
                })
                .collect();
            match check_lower(spec, &suspects, epoch, deadline)? {
                Some(step) => step,
                None => {
                    found_gone.extend(suspects);
                    coordinate(inbox, spec, &ballot, deadline, timeout)?
                }
            }
        } else {
            ask_rank(inbox, spec, c, &ballot, deadline)?
        };
        match step {
            Step::Answered(answer) => return finish(inbox, epoch, answer, me, c),
            Step::Ask(x) => {
                // A rank this one believes out, or a loop: the rank that
                // said so will see it soon; meanwhile, not too often.
                if out.contains(&x) || x == c {
                    std::thread::sleep(Duration::from_millis(5));
                }
                if x != me {
                    ask = Some(x);
                }
            }
            Step::Alive(x) => {
                out.remove(&x);
                ballot.failed.retain(|r| *r != x);
                ask = Some(x);
            }
            Step::Gone(x) => {
                // What this rank found out goes in its ballot, so that the
                // next coordinator need not probe it.
                out.insert(x);
                found_gone.insert(x);
                if !ballot.failed.contains(&x) {
                    ballot.failed.push(x);
                }
            }
        }
    }
}

/// Where one attempt left this rank.
enum Step {
    /// The shrink's answer.
    Answered(Answer),
    /// Ask this rank (it is coordinating, or closer to the one who is).
    Ask(usize),
    /// This rank, believed failed, is alive: ask it.
    Alive(usize),
    /// This rank is gone.
    Gone(usize),
}

/// Keeps the answer and turns it into this rank's result.
fn finish(inbox: &Inbox, epoch: u16, answer: Answer, me: usize, from: usize) -> Result<Decision> {
    inbox.settle(epoch, &answer, me);
    match answer {
        Answer::Decided(d) if d.members.iter().any(|(r, _)| *r == me) => Ok(d),
        Answer::Decided(_) => Err(left_out(me, from)),
        Answer::Refused(why) => Err(Error::new(
            ErrorKind::Mismatch,
            format!("rdist_comm_shrink on rank {me}: {why}"),
        )),
        Answer::AskRank(_) => Err(Error::internal("a shrink ended on a redirection")),
    }
}

/// Probes the lower ranks this rank believes failed, lowest first: the
/// first that is alive (or has the answer already) decides the next step.
fn check_lower(
    spec: &MeshSpec,
    suspects: &[usize],
    epoch: u16,
    deadline: Instant,
) -> Result<Option<Step>> {
    for (r, found) in probe_all(spec, suspects, epoch, deadline)? {
        match found {
            Probed::Dead => {}
            Probed::Alive(Some(answer @ (Answer::Decided(_) | Answer::Refused(_)))) => {
                return Ok(Some(Step::Answered(answer)))
            }
            Probed::Alive(_) => return Ok(Some(Step::Alive(r))),
        }
    }
    Ok(None)
}

fn left_out(me: usize, by: usize) -> Error {
    Error::new(
        ErrorKind::PeerLost,
        format!(
            "rank {by}'s rdist_comm_shrink decided without rank {me}: it was believed failed, or called rdist_comm_shrink after the others had waited for it until their timeout"
        ),
    )
}

/// Sends the ballot to rank `c` and waits for its answer, answering the
/// ballots that reach this rank meanwhile with "ask rank c".
fn ask_rank(
    inbox: &Inbox,
    spec: &MeshSpec,
    c: usize,
    ballot: &Ballot,
    deadline: Instant,
) -> Result<Step> {
    let limit = deadline.min(Instant::now() + PROBE_LIMIT);
    let mut s = match dial(spec, c, BALLOT, ballot.epoch, limit) {
        Ok(s) => s,
        Err(Unreached::Gone) => return Ok(Step::Gone(c)),
        Err(Unreached::Here(e)) => return Err(e),
    };
    let _ = s.set_write_timeout(Some(PROBE_LIMIT));
    if write_frame(&mut s, &ballot.encode()).is_err() {
        return Ok(Step::Gone(c));
    }
    let redirect = Answer::AskRank(c).encode();
    let mut next_look = Instant::now() + LOOK_AFTER;
    loop {
        for mut caller in inbox.take() {
            reply(&mut caller, ballot.epoch, &redirect, spec.rank);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "rank {}'s rdist_comm_shrink timed out waiting for rank {c}'s decision (rank {c} answers, but has not called rdist_comm_shrink)",
                    spec.rank
                ),
            ));
        }
        // A stopped rank's kernel took the connection, but nobody answers:
        // now and then the rank is probed; no answer is a failed rank, an
        // answer it settled is the answer.
        if Instant::now() >= next_look {
            match probe(spec, c, ballot.epoch, deadline)? {
                Probed::Dead => return Ok(Step::Gone(c)),
                Probed::Alive(Some(a @ (Answer::Decided(_) | Answer::Refused(_)))) => {
                    return Ok(Step::Answered(a))
                }
                Probed::Alive(_) => {}
            }
            next_look = Instant::now() + LOOK_AFTER;
        }
        let wait = left.min(next_look.saturating_duration_since(Instant::now()));
        wait_for(&[s.as_raw_fd(), inbox.bell.fd()], wait);
        let mut pfd = libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd, no wait.
        if unsafe { libc::poll(&mut pfd, 1, 0) } <= 0 {
            continue;
        }
        // An answer is written whole: it arrives at once once it starts.
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        return Ok(
            match read_frame(&mut s, frame_limit(spec.size))
                .ok()
                .and_then(|b| Answer::decode(&b, spec.size))
            {
                Some(Answer::AskRank(x)) => Step::Ask(x),
                Some(answer) => Step::Answered(answer),
                None => Step::Gone(c),
            },
        );
    }
}

/// This rank is the lowest it believes alive: it counts the ballots until
/// every rank is counted, failed or excluded, then answers them all. It
/// steps down when a probe finds a lower rank alive, and adopts an answer
/// a probe finds already settled.
fn coordinate(
    inbox: &Inbox,
    spec: &MeshSpec,
    ballot: &Ballot,
    deadline: Instant,
    timeout: Duration,
) -> Result<Step> {
    let me = spec.rank;
    let epoch = ballot.epoch;
    let mut tally = Tally::new(spec.size, me, ballot);
    let mut held: Vec<(usize, TcpStream)> = Vec::new();
    // Ballots still under way when the askers give up are left out a
    // little before their deadline, so that they hear the decision.
    let give_up = deadline - (timeout / 10).min(Duration::from_secs(2));
    let mut next_probe = Instant::now();
    let mut probe_every = Duration::from_millis(20);
    // Lower ranks others believe failed are probed once, by this rank.
    let mut verified: BTreeSet<usize> = ballot.failed.iter().copied().collect();
    let answer = loop {
        for mut caller in inbox.take() {
            if caller.epoch != epoch {
                reply(&mut caller, epoch, &[], me);
                continue;
            }
            let _ = caller.stream.set_read_timeout(Some(Duration::from_secs(2)));
            match read_frame(&mut caller.stream, frame_limit(spec.size))
                .ok()
                .and_then(|b| Ballot::decode(&b, spec.size))
            {
                Some(b) if b.epoch == epoch => {
                    tally.count(caller.rank, &b);
                    held.retain(|(r, _)| *r != caller.rank);
                    held.push((caller.rank, caller.stream));
                }
                _ => {}
            }
        }
        // A ballot's sender that hung up: dead, or gone to ask another
        // rank; its probe tells.
        held.retain(|(r, s)| {
            let gone = ended(s);
            if gone {
                tally.forget(*r);
                next_probe = Instant::now();
            }
            !gone
        });
        let undecided = tally.undecided();
        let unverified: Vec<usize> = tally
            .failed()
            .filter(|r| *r < me && !verified.contains(r))
            .collect();
        if undecided.is_empty() && unverified.is_empty() {
            break tally.decide(spec.comm_id);
        }
        let now = Instant::now();
        if now >= give_up {
            log::emit(
                LogLevel::Warn,
                Some(me),
                &format!("rdist_comm_shrink: ranks {undecided:?} sent no ballot within the timeout and are left out"),
            );
            for r in undecided {
                tally.lost(r);
            }
            verified.extend(unverified);
            continue;
        }
        if now >= next_probe || !unverified.is_empty() {
            let mut ranks = unverified.clone();
            ranks.extend(&undecided);
            let mut stepped: Option<Step> = None;
            for (r, found) in probe_all(spec, &ranks, epoch, give_up)? {
                verified.insert(r);
                match found {
                    Probed::Dead => tally.lost(r),
                    Probed::Alive(Some(a @ (Answer::Decided(_) | Answer::Refused(_)))) => {
                        stepped.get_or_insert(Step::Answered(a));
                    }
                    Probed::Alive(_) if r < me => {
                        stepped.get_or_insert(Step::Alive(r));
                    }
                    Probed::Alive(_) => tally.revive(r),
                }
            }
            if let Some(step) = stepped {
                // Not this rank's to decide: its askers ask the one who is.
                let to = match &step {
                    Step::Alive(r) => Answer::AskRank(*r).encode(),
                    Step::Answered(a) => a.encode(),
                    _ => unreachable!("a probe steps down or answers"),
                };
                answer_all(held, &to);
                return Ok(step);
            }
            next_probe = Instant::now() + probe_every;
            probe_every = (probe_every * 2).min(Duration::from_millis(500));
            continue;
        }
        let mut fds: Vec<i32> = held.iter().map(|(_, s)| s.as_raw_fd()).collect();
        fds.push(inbox.bell.fd());
        wait_for(&fds, next_probe.min(give_up).saturating_duration_since(now));
    };
    inbox.settle(epoch, &answer, me);
    answer_all(held, &answer.encode());
    Ok(Step::Answered(answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shrink_hello_is_told_apart_and_carries_purpose_and_epoch() {
        let spec = MeshSpec {
            rank: 2,
            size: 4,
            addrs: (0..4)
                .map(|r| format!("127.0.0.1:{}", 1000 + r).parse().unwrap())
                .collect(),
            job: [5; 16],
            comm_id: 77,
            token: None,
            far: vec![false; 4].into(),
        };
        let h = hello(&spec, BALLOT, 513);
        assert!(is_shrink_hello(&h));
        assert_eq!(h[PURPOSE], BALLOT);
        assert_eq!(h[HELLO_AUTH_FLAG], 0);
        assert_eq!(u16::from_le_bytes([h[EPOCH], h[EPOCH + 1]]), 513);
        let mut pair = h;
        pair[0..4].copy_from_slice(&0x5244_4831u32.to_le_bytes());
        assert!(!is_shrink_hello(&pair));
    }
}
