//! Connecting every pair of ranks: rank i dials every lower rank and accepts
//! every higher one. Each connection starts with a hello naming the job, the
//! communicator and the rank (with an `auth_token`, inside the
//! challenge-response of `greeting`), answered by a one-byte verdict.
//! Accepted connections are greeted side by side without blocking, each
//! with a short deadline, so stray or silent connections delay no rank. Point-to-point connections (see
//! backend/p2p) start with the same hello, marked with their context, and
//! are made later, on first use; one that arrives while this rank is still
//! connecting its mesh is kept for them (`Mesh::early_p2p`).

use super::greeting::{self, Greeted, Greeting, Refusal, HELLO_DEADLINE};
use crate::auth::Token;
use crate::error::{describe_io, Error, ErrorKind, Result};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const HELLO_MAGIC: u32 = 0x5244_4831; // "RDH1"
pub use super::greeting::HELLO_BYTES;

/// Which traffic a connection carries (byte 36 of the hello).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Context {
    /// The collectives' mesh, made at init.
    Collectives = 0,
    /// Point-to-point messages, one connection per ordered pair, dialed
    /// by the sender on first use.
    P2p = 1,
}

/// The connected mesh.
pub struct Mesh {
    /// Index = peer rank; `None` for self.
    pub streams: Vec<Option<TcpStream>>,
    /// Point-to-point connections that peers dialed (their ranks) while
    /// this rank was still accepting its mesh.
    pub early_p2p: Vec<(usize, TcpStream)>,
}

/// Who is connecting to whom.
#[derive(Clone, Debug)]
pub struct MeshSpec {
    pub rank: usize,
    pub size: usize,
    /// Listening address of every rank.
    pub addrs: Vec<SocketAddr>,
    /// Random per job; distinguishes jobs that reuse a port.
    pub job: [u8; 16],
    /// Distinguishes communicators of one job (the world, each split).
    pub comm_id: u64,
    pub deadline: Instant,
    /// The job's shared secret, when it has one.
    pub token: Option<Token>,
    /// Per rank: on another host than this rank (its connections get
    /// keepalive, see `configure`).
    pub far: Vec<bool>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Verdict {
    Welcome = 0,
    OtherJob = 1,
    OtherWorld = 2,
}

/// The hello a rank sends on a connection of `context`.
pub fn hello_for(spec: &MeshSpec, context: Context) -> [u8; HELLO_BYTES] {
    let mut b = hello(spec);
    b[36] = context as u8;
    b
}

fn hello(spec: &MeshSpec) -> [u8; HELLO_BYTES] {
    let mut b = [0u8; HELLO_BYTES];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..20].copy_from_slice(&spec.job);
    b[20..28].copy_from_slice(&spec.comm_id.to_le_bytes());
    b[28..32].copy_from_slice(&(spec.rank as u32).to_le_bytes());
    b[32..36].copy_from_slice(&(spec.size as u32).to_le_bytes());
    b[36] = Context::Collectives as u8;
    b
}

/// Judges a point-to-point hello: the dialing rank when it belongs to this
/// communicator (any rank but this one).
pub fn judge_p2p(spec: &MeshSpec, b: &[u8; HELLO_BYTES]) -> Option<usize> {
    let rank = u32::from_le_bytes([b[28], b[29], b[30], b[31]]) as usize;
    let ok = b[36] == Context::P2p as u8
        && u32::from_le_bytes([b[0], b[1], b[2], b[3]]) == HELLO_MAGIC
        && b[4..20] == spec.job
        && b[20..28] == spec.comm_id.to_le_bytes()
        && u32::from_le_bytes([b[32], b[33], b[34], b[35]]) as usize == spec.size
        && rank < spec.size
        && rank != spec.rank;
    ok.then_some(rank)
}

/// Judges a hello; returns the dialing rank when it belongs here.
fn judge(spec: &MeshSpec, b: &[u8; HELLO_BYTES]) -> std::result::Result<usize, Verdict> {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    if u32_at(0) != HELLO_MAGIC || b[4..20] != spec.job {
        return Err(Verdict::OtherJob);
    }
    let comm = u64::from_le_bytes(b[20..28].try_into().expect("8 bytes"));
    let rank = u32_at(28) as usize;
    if comm != spec.comm_id
        || u32_at(32) as usize != spec.size
        || rank <= spec.rank
        || rank >= spec.size
    {
        return Err(Verdict::OtherWorld);
    }
    Ok(rank)
}

impl MeshSpec {
    /// Sets up a connection to `peer`: no delay, and keepalive when the
    /// peer is on another host.
    pub fn configure(&self, stream: &TcpStream, peer: usize) {
        let _ = stream.set_nodelay(true);
        if self.far.get(peer).copied().unwrap_or(true) {
            // Spread over 5 s: a wide job makes its connections within a
            // second, and probes all sent at once overflow a queue.
            let idle = 10 + (self.rank * 31 + peer * 17) % 5;
            keep_alive(stream, idle as i32);
        }
    }
}

/// Keepalive finds peers whose host vanished without closing the
/// connection (a crash of the machine, a cable): probes after `idle_s`
/// quiet seconds, then every 2 s, 3 unanswered end it. Only across hosts:
/// a process on this host that dies closes its sockets, and at 256 ranks
/// on one host the 65,000 sockets' probes, all due at once, overflowed
/// loopback's queue and timed healthy connections out.
fn keep_alive(stream: &TcpStream, idle_s: i32) {
    let fd = stream.as_raw_fd();
    let set = |level: i32, name: i32, value: i32| {
        // SAFETY: setsockopt on our own socket with a live i32.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle_s);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 2);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
}

fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Dials `addr` until `deadline`, retrying while nobody listens yet.
pub fn dial(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    let mut pause = Duration::from_millis(5);
    loop {
        match TcpStream::connect_timeout(&addr, left(deadline)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() + pause < deadline => {
                if e.kind() != io::ErrorKind::ConnectionRefused
                    && e.kind() != io::ErrorKind::TimedOut
                {
                    return Err(e);
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Makes room for a rank's descriptors: one connection per peer (shared
/// memory keeps it too, to notice the peer's exit), plus a margin for the
/// process's own. Raises the soft RLIMIT_NOFILE towards the hard one when
/// it is too low (a wide job on one host passes the common soft limit of
/// 1024 at ~1000 ranks); fails, saying so, when even the hard limit is too
/// low, instead of letting accept() fail quietly and the peers time out.
/// Rank 0 also serves every rank's store connection: two per rank, and
/// a margin of 32 at least, 256 when the hard limit allows.
pub fn reserve_descriptors(rank: usize, size: usize) -> Result<()> {
    let need = (2 * size + 32) as libc::rlim_t;
    let want = need + 224;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a live struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur >= want {
        return Ok(());
    }
    if lim.rlim_max < need {
        return Err(Error::new(
            ErrorKind::System,
            format!(
                "rank {} needs about {need} file descriptors for a world of {} ranks, but this process may open at most {} (RLIMIT_NOFILE hard limit): raise it (ulimit -Hn, or LimitNOFILE in systemd/containers)",
                rank, size, lim.rlim_max
            ),
        ));
    }
    let raised = libc::rlimit {
        rlim_cur: want.max(lim.rlim_cur.saturating_mul(2)).min(lim.rlim_max),
        rlim_max: lim.rlim_max,
    };
    if raised.rlim_cur <= lim.rlim_cur {
        return Ok(()); // enough, if not the margin we would like
    }
    // SAFETY: as above.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(Error::system(
            format!(
                "raising the descriptor limit from {} to {} for a world of {} ranks",
                lim.rlim_cur, raised.rlim_cur, size
            ),
            &io::Error::last_os_error(),
        ));
    }
    crate::log::emit(
        crate::options::LogLevel::Info,
        Some(rank),
        &format!(
            "raised the soft descriptor limit from {} to {} for {size} ranks",
            lim.rlim_cur, raised.rlim_cur
        ),
    );
    Ok(())
}

/// Connects this rank to every other.
pub fn connect(listener: &TcpListener, spec: &MeshSpec) -> Result<Mesh> {
    let mut streams: Vec<Option<TcpStream>> = (0..spec.size).map(|_| None).collect();
    let mut early_p2p = Vec::new();
    let me = hello(spec);
    let timed_out = |what: String| {
        Error::new(
            ErrorKind::Timeout,
            format!(
                "rank {} timed out connecting to its peers: {what}",
                spec.rank
            ),
        )
    };
    for (peer, slot) in streams.iter_mut().enumerate().take(spec.rank) {
        let addr = spec.addrs[peer];
        let mut s = dial(addr, spec.deadline).map_err(|e| {
            Error::new(
                ErrorKind::PeerLost,
                format!(
                    "rank {} cannot connect to rank {peer} at {addr}: {}",
                    spec.rank,
                    describe_io(&e)
                ),
            )
        })?;
        spec.configure(&s, peer);
        greeting::introduce(&mut s, &me, spec.token.as_ref(), spec.deadline).map_err(|e| {
            match e {
                Refusal::Auth(why) => Error::new(
                    ErrorKind::Auth,
                    format!("rank {} cannot join rank {peer} at {addr}: {why}", spec.rank),
                ),
                Refusal::Io(e) => Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "rank {} lost its connection to rank {peer} at {addr} during the handshake ({}){}",
                        spec.rank,
                        describe_io(&e),
                        if spec.token.is_some() { "; does that rank have the same auth token?" } else { "" }
                    ),
                ),
            }
        })?;
        *slot = Some(s);
    }
    accept_higher(listener, spec, &mut streams, &mut early_p2p, &timed_out)?;
    for (peer, slot) in streams.iter_mut().enumerate().take(spec.rank) {
        let s = slot.as_mut().expect("dialed above");
        s.set_read_timeout(Some(left(spec.deadline)))
            .map_err(|e| Error::system("set_read_timeout", &e))?;
        let mut verdict = [0u8; 1];
        match s.read_exact(&mut verdict) {
            Ok(()) => {}
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut =>
            {
                return Err(timed_out(format!("rank {peer} never answered the hello")));
            }
            Err(e) => {
                return Err(Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "rank {peer} closed the connection during the handshake ({})",
                        describe_io(&e)
                    ),
                ))
            }
        }
        if let Some(why) = greeting::describe_status(verdict[0]) {
            return Err(Error::new(
                ErrorKind::Auth,
                format!("rank {} cannot join rank {peer}: {why}", spec.rank),
            ));
        }
        match verdict[0] {
            0 => {}
            1 => {
                return Err(Error::new(
                    ErrorKind::Auth,
                    format!(
                        "rank {peer} at {} belongs to another job and refused this rank (two jobs sharing a MASTER_PORT?)",
                        spec.addrs[peer]
                    ),
                ))
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!(
                        "rank {peer} refused this rank: it expects a different communicator or world size (world size {} here)",
                        spec.size
                    ),
                ))
            }
        }
        s.set_read_timeout(None)
            .map_err(|e| Error::system("set_read_timeout", &e))?;
    }
    Ok(Mesh { streams, early_p2p })
}

/// Most connections greeted at once; more make the oldest go.
const MAX_GREETINGS: usize = 1024;

fn accept_higher(
    listener: &TcpListener,
    spec: &MeshSpec,
    streams: &mut [Option<TcpStream>],
    early_p2p: &mut Vec<(usize, TcpStream)>,
    timed_out: &dyn Fn(String) -> Error,
) -> Result<()> {
    let expected = spec.size - 1 - spec.rank;
    let mut have = 0;
    let mut greetings: Vec<Greeting> = Vec::new();
    let mut strays = 0usize;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::system("set_nonblocking", &e))?;
    while have < expected {
        let now = Instant::now();
        if now >= spec.deadline {
            let missing: Vec<String> = (spec.rank + 1..spec.size)
                .filter(|r| streams[*r].is_none())
                .map(|r| r.to_string())
                .collect();
            let strays = if strays > 0 {
                format!(" ({strays} other connections came and were dropped: strangers, or ranks with another auth token)")
            } else {
                String::new()
            };
            return Err(timed_out(format!(
                "ranks {} never connected to {}{strays}",
                missing.join(", "),
                spec.addrs[spec.rank]
            )));
        }
        let limit = HELLO_DEADLINE.min(spec.deadline.saturating_duration_since(now));
        let before = greetings.len();
        greetings.retain(|g| !g.expired(now, limit));
        strays += before - greetings.len();
        wait_for_bytes(listener, &greetings, spec.deadline);
        accept_all(listener, &mut greetings, &mut strays);
        let mut i = 0;
        while i < greetings.len() {
            match greetings[i].advance(spec.token.as_ref()) {
                Greeted::Pending => i += 1,
                Greeted::Dropped => {
                    greetings.swap_remove(i);
                    strays += 1;
                }
                Greeted::Ready => {
                    let (b, mut s) = greetings.swap_remove(i).finish();
                    if let Some(rank) = judge_p2p(spec, &b) {
                        // A peer that finished connecting already sends point-to-point.
                        spec.configure(&s, rank);
                        early_p2p.push((rank, s));
                        continue;
                    }
                    match judge(spec, &b) {
                        Ok(rank) if streams[rank].is_none() => {
                            s.write_all(&[Verdict::Welcome as u8])
                                .map_err(|e| Error::system(format!("answering rank {rank}"), &e))?;
                            spec.configure(&s, rank);
                            streams[rank] = Some(s);
                            have += 1;
                        }
                        Ok(_) => {
                            let _ = s.write_all(&[Verdict::OtherWorld as u8]);
                            strays += 1;
                        }
                        Err(v) => {
                            let _ = s.write_all(&[v as u8]);
                            strays += 1;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Sleeps until the listener or a greeting has bytes (at most 100 ms).
fn wait_for_bytes(listener: &TcpListener, greetings: &[Greeting], deadline: Instant) {
    let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw_fd())
        .chain(greetings.iter().map(Greeting::fd))
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = left(deadline).as_millis().min(100) as i32;
    // SAFETY: `fds` is a live array of fds.len() pollfd.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms.max(1)) };
}

/// Accepts every waiting connection into a greeting.
fn accept_all(listener: &TcpListener, greetings: &mut Vec<Greeting>, strays: &mut usize) {
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                if greetings.len() >= MAX_GREETINGS {
                    // The oldest has had the longest to speak.
                    greetings.remove(0);
                    *strays += 1;
                }
                greetings.extend(Greeting::new(s));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return, // WouldBlock, or a transient error (out of fds)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keepalive_of(s: &TcpStream) -> (i32, i32) {
        let get = |level: i32, name: i32| {
            let mut v: i32 = -1;
            let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
            // SAFETY: getsockopt into a live i32 on our own socket.
            unsafe {
                libc::getsockopt(
                    s.as_raw_fd(),
                    level,
                    name,
                    (&mut v as *mut i32).cast(),
                    &mut len,
                )
            };
            v
        };
        (
            get(libc::SOL_SOCKET, libc::SO_KEEPALIVE),
            get(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
        )
    }

    /// 256 ranks on one host failed ~17 s after connecting: every one of
    /// the 65,000 loopback sockets sent its keepalive probes at once, the
    /// queue dropped them, and healthy connections timed out. Peers on
    /// this host get no keepalive; those on other hosts get it, spread.
    #[test]
    fn keepalive_only_across_hosts_and_spread() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let spec = MeshSpec {
            rank: 0,
            size: 4,
            addrs: vec![l.local_addr().unwrap(); 4],
            job: [0; 16],
            comm_id: 0,
            deadline: Instant::now(),
            token: None,
            far: vec![false, false, true, true],
        };
        let near = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        spec.configure(&near, 1);
        assert_eq!(keepalive_of(&near).0, 0, "no keepalive on this host");
        let idles: Vec<i32> = [2, 3]
            .iter()
            .map(|&peer| {
                let far = TcpStream::connect(l.local_addr().unwrap()).unwrap();
                spec.configure(&far, peer);
                let (on, idle) = keepalive_of(&far);
                assert_eq!(on, 1, "keepalive to another host");
                assert!((10..15).contains(&idle), "{idle}");
                idle
            })
            .collect();
        assert_ne!(idles[0], idles[1], "probes spread over time");
    }
}
