//! Who may connect, and how: the hello that starts every connection
//! between ranks (job, communicator, rank and world size, inside the
//! challenge-response of `greeting` when there is an `auth_token`), the
//! one-byte verdict that answers it, dialing a peer, and the socket
//! settings of a connection. Pairs connect on first use, one connection
//! each (see `link`).

use super::greeting::{self, Refusal};
use super::signal::{self, AbortSignal};
use crate::auth::Token;
use crate::error::{describe_io, Error, ErrorKind, Result};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HELLO_MAGIC: u32 = 0x5244_4831; // "RDH1"
pub use super::greeting::HELLO_BYTES;

/// Who this rank is, and how it reaches its peers.
#[derive(Clone, Debug)]
pub struct MeshSpec {
    pub rank: usize,
    pub size: usize,
    /// Listening address of every rank.
    pub addrs: Arc<[SocketAddr]>,
    /// Random per job; distinguishes jobs that reuse a port.
    pub job: [u8; 16],
    /// Distinguishes communicators of one job (the world, each split).
    pub comm_id: u64,
    /// The job's shared secret, when it has one.
    pub token: Option<Token>,
    /// Per rank: on another host than this rank (its connections get
    /// keepalive, see `configure`).
    pub far: Arc<[bool]>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Verdict {
    Welcome = 0,
    OtherJob = 1,
    OtherWorld = 2,
    /// The pair is connected already, or both sides dialed at once and
    /// this side's dial wins: the dialer uses the other connection.
    Duplicate = 3,
    /// The hello names a rank, but the connection comes from another
    /// address than that rank's: a stranger on another host.
    NotFromItsAddress = 4,
    /// This rank's communicator failed; its failure report follows (a
    /// u32 length, then `frame::encode_failure`'s bytes).
    Failed = 5,
}

fn hello(spec: &MeshSpec) -> [u8; HELLO_BYTES] {
    hello_with(spec, HELLO_MAGIC)
}

/// A hello of this rank with `magic` (the pairs' own, or a shrink's):
/// job, communicator, rank and world size; bytes 36..40 are left to it.
pub(super) fn hello_with(spec: &MeshSpec, magic: u32) -> [u8; HELLO_BYTES] {
    let mut b = [0u8; HELLO_BYTES];
    b[0..4].copy_from_slice(&magic.to_le_bytes());
    b[4..20].copy_from_slice(&spec.job);
    b[20..28].copy_from_slice(&spec.comm_id.to_le_bytes());
    b[28..32].copy_from_slice(&(spec.rank as u32).to_le_bytes());
    b[32..36].copy_from_slice(&(spec.size as u32).to_le_bytes());
    b
}

/// Connects to `addr` from `local` (port any), so that the connection
/// comes from this rank's own address, which the peer checks (see
/// `came_from`); from any address where `local` is of another family.
/// `abort`, when given and raised, ends the wait for the connection
/// (`Interrupted`): a host that vanished never answers it.
pub(super) fn connect_from(
    local: IpAddr,
    addr: SocketAddr,
    timeout: Duration,
    abort: Option<&AbortSignal>,
) -> io::Result<TcpStream> {
    if local.is_ipv4() != addr.is_ipv4() || local.is_unspecified() {
        return TcpStream::connect_timeout(&addr, timeout);
    }
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain system calls; the fd is owned by `stream` at once.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let (sa, len) = sockaddr(SocketAddr::new(local, 0));
    // SAFETY: `sa` is a live sockaddr of `len` bytes.
    if unsafe { libc::bind(fd, (&sa as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    stream.set_nonblocking(true)?;
    let (sa, len) = sockaddr(addr);
    // SAFETY: as above.
    if unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_storage).cast(), len) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        // Writable once connected (or refused: take_error says).
        signal::ready_by(fd, libc::POLLOUT, Instant::now() + timeout, abort)?;
        if let Some(e) = stream.take_error()? {
            return Err(e);
        }
    }
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// `addr` as the C socket address the system calls take.
fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero bytes are a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and as aligned.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// Whether a connection whose hello names `rank` came from that rank's
/// address (its dial binds it there). Without an auth token this is what
/// keeps a stranger on another host from greeting a rank as one of its
/// peers before that peer connects; on the same host a process can read
/// the ranks' memory anyway (it is what single copy does).
pub fn came_from(spec: &MeshSpec, rank: usize, s: &TcpStream) -> bool {
    let want = spec.addrs[rank].ip().to_canonical();
    // A dialer of another family than this rank's address could not bind
    // its own (see `connect_from`).
    let own = spec.addrs[spec.rank].ip().to_canonical();
    if want.is_unspecified() || want.is_ipv4() != own.is_ipv4() {
        return true;
    }
    s.peer_addr()
        .map(|a| a.ip().to_canonical() == want)
        .unwrap_or(false)
}

/// Judges a hello; returns the dialing rank when it belongs here (another
/// rank of this communicator).
pub fn judge(spec: &MeshSpec, b: &[u8; HELLO_BYTES]) -> std::result::Result<usize, Verdict> {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    if u32_at(0) != HELLO_MAGIC || b[4..20] != spec.job {
        return Err(Verdict::OtherJob);
    }
    let comm = u64::from_le_bytes(b[20..28].try_into().expect("8 bytes"));
    let rank = u32_at(28) as usize;
    if comm != spec.comm_id
        || u32_at(32) as usize != spec.size
        || rank == spec.rank
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

/// What a dial came to.
pub enum Dialed {
    /// The pair's connection, welcomed.
    Welcomed(TcpStream),
    /// The peer keeps the connection it dialed itself (see `Verdict::Duplicate`).
    Duplicate,
    /// The peer's communicator failed: its failure report
    /// (`frame::encode_failure`'s bytes), to be heard as if it came on a
    /// connection.
    Failed(Vec<u8>),
}

/// Dials `peer` for the pair's connection and waits for its verdict,
/// bounded by `deadline`. One attempt: every rank listens from before the
/// roster is published, and its endpoint's thread answers, so a refusal
/// means the peer is gone (exited, or destroyed its communicator).
pub fn dial(
    spec: &MeshSpec,
    peer: usize,
    deadline: Instant,
    abort: &AbortSignal,
) -> Result<Dialed> {
    let addr = spec.addrs[peer];
    let rank = spec.rank;
    let aborted = || {
        Error::new(
            ErrorKind::Aborted,
            format!("rdist_comm_abort was called on rank {rank} (while it dialed rank {peer})"),
        )
    };
    if abort.is_aborted() {
        return Err(aborted());
    }
    let connected = connect_from(spec.addrs[rank].ip(), addr, left(deadline), Some(abort));
    if abort.is_aborted() {
        return Err(aborted());
    }
    let mut s = connected.map_err(|e| {
        let why = match e.kind() {
            io::ErrorKind::ConnectionRefused => {
                "nobody listens there: it exited, or destroyed its communicator".to_string()
            }
            _ => describe_io(&e),
        };
        Error::new(
            ErrorKind::PeerLost,
            format!("rank {rank} cannot connect to rank {peer} at {addr}: {why}"),
        )
    })?;
    spec.configure(&s, peer);
    let introduced = greeting::introduce(
        &mut s,
        &hello(spec),
        spec.token.as_ref(),
        deadline,
        Some(abort),
    );
    if abort.is_aborted() {
        return Err(aborted());
    }
    introduced.map_err(|e| match e {
        Refusal::Auth(why) => Error::new(
            ErrorKind::Auth,
            format!("rank {rank} cannot join rank {peer} at {addr}: {why}"),
        ),
        // A stopped peer's kernel took the connection; nobody answers.
        Refusal::Io(e) if matches!(e.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock) => {
            Error::new(
                ErrorKind::Timeout,
                format!("rank {rank} timed out connecting to rank {peer} at {addr}: it never answered the hello"),
            )
        }
        Refusal::Io(e) => Error::new(
            ErrorKind::PeerLost,
            format!(
                "rank {rank} lost its connection to rank {peer} at {addr} during the handshake ({}){}",
                describe_io(&e),
                if spec.token.is_some() { "; does that rank have the same auth token?" } else { "" }
            ),
        ),
    })?;
    s.set_read_timeout(Some(left(deadline)))
        .map_err(|e| Error::system("set_read_timeout", &e))?;
    let mut verdict = [0u8; 1];
    // A stopped peer's kernel accepted for it: its answer may never come.
    let answered = signal::readable_by(s.as_raw_fd(), deadline, Some(abort));
    if abort.is_aborted() {
        return Err(aborted());
    }
    if let Err(e) = answered.and_then(|()| s.read_exact(&mut verdict)) {
        let timed_out = matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        );
        return Err(match timed_out {
            true => Error::new(
                ErrorKind::Timeout,
                format!("rank {rank} timed out connecting to rank {peer} at {addr}: it never answered the hello"),
            ),
            false => Error::new(
                ErrorKind::PeerLost,
                format!(
                    "rank {peer} closed the connection from rank {rank} during the handshake ({})",
                    describe_io(&e)
                ),
            ),
        });
    }
    if let Some(why) = greeting::describe_status(verdict[0]) {
        return Err(Error::new(
            ErrorKind::Auth,
            format!("rank {rank} cannot join rank {peer}: {why}"),
        ));
    }
    match verdict[0] {
        v if v == Verdict::Welcome as u8 => Ok(Dialed::Welcomed(s)),
        v if v == Verdict::Failed as u8 => {
            let mut len = [0u8; 4];
            let mut report = Vec::new();
            let read = s.read_exact(&mut len).and_then(|()| {
                let n = (u32::from_le_bytes(len) as usize).min(super::frame::FAILURE_MAX);
                report.resize(n, 0);
                s.read_exact(&mut report)
            });
            match read {
                Ok(()) => Ok(Dialed::Failed(report)),
                Err(_) => Err(Error::new(
                    ErrorKind::PeerLost,
                    format!("rank {peer} failed (its report was cut short)"),
                )),
            }
        }
        v if v == Verdict::NotFromItsAddress as u8 => Err(Error::new(
            ErrorKind::Auth,
            format!(
                "rank {peer} at {addr} refused rank {rank}: the connection did not come from \
                 rank {rank}'s address {} (is its outgoing address another one of this host's?)",
                spec.addrs[rank].ip()
            ),
        )),
        v if v == Verdict::Duplicate as u8 => Ok(Dialed::Duplicate),
        v if v == Verdict::OtherJob as u8 => Err(Error::new(
            ErrorKind::Auth,
            format!(
                "rank {peer} at {addr} belongs to another job and refused rank {rank} (two jobs sharing a MASTER_PORT?)"
            ),
        )),
        _ => Err(Error::new(
            ErrorKind::Mismatch,
            format!(
                "rank {peer} refused rank {rank}: it expects a different communicator or world size (world size {} here)",
                spec.size
            ),
        )),
    }
}

/// Answers a hello with this rank's failure report (see `Verdict::Failed`).
pub fn answer_failed(s: &mut TcpStream, report: &[u8]) {
    let mut b = vec![Verdict::Failed as u8];
    b.extend_from_slice(&(report.len() as u32).to_le_bytes());
    b.extend_from_slice(report);
    let _ = s.write_all(&b);
}

/// Sends a verdict on a greeted connection; for a welcome, also the
/// connection's settings.
pub fn answer(spec: &MeshSpec, verdict: Verdict, rank: usize, s: &mut TcpStream) -> bool {
    if s.write_all(&[verdict as u8]).is_err() {
        return false;
    }
    if verdict == Verdict::Welcome {
        spec.configure(s, rank);
    }
    true
}

/// Widens a listener's backlog to `size` dialers at least (std listens
/// with 128; the kernel caps it at net.core.somaxconn): in a wide job
/// many ranks dial one at once.
pub fn widen_backlog(listener: &TcpListener, size: usize) {
    let backlog = libc::c_int::try_from(size.max(128)).unwrap_or(libc::c_int::MAX);
    // SAFETY: listen() again on a bound, listening socket only widens it.
    unsafe { libc::listen(listener.as_raw_fd(), backlog) };
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
            addrs: vec![l.local_addr().unwrap(); 4].into(),
            job: [0; 16],
            comm_id: 0,
            token: None,
            far: vec![false, false, true, true].into(),
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
