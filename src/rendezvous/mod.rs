//! Rendezvous: ranks find each other through a key-value store (hosted by
//! rank 0, by the unique id's creator, or kept in a shared directory),
//! publish their listening address, host and pid, and learn everyone's.

mod alone;
mod host_board;
pub mod method;
pub mod store;
pub mod unique_id;

use crate::auth::Token;
use crate::error::{Error, ErrorKind, Result};
use crate::options::Options;
use crate::transport::iface;
use crate::transport::membership::cpus::Cpus;
use crate::transport::membership::{host_id, hosts, packed, Placement, Roster};
use host_board::{HostBoard, OwnBoard};
use method::Method;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};
use store::{FileStore, Store, StoreLease, TcpStoreClient, Update};
use unique_id::UniqueId;

/// How ranks meet.
#[derive(Clone, Debug)]
pub enum Meeting {
    Method(Method),
    UniqueId(UniqueId),
}

/// What a rank knows once everyone has joined.
pub struct Joined {
    pub size: usize,
    pub local_rank: usize,
    pub roster: Roster,
    /// Some rank published that NCCL may run in its process (the
    /// `offers_nccl` of `join`); when none did, init skips asking.
    pub some_rank_offers_nccl: bool,
    pub listener: TcpListener,
    pub store: Arc<dyn Store>,
    /// The store server, when this rank hosts it (leased by the comm).
    pub server: Option<StoreLease>,
    file_store: Option<Arc<FileStore>>,
    rank: usize,
    /// The store answers `wait_get` and `arrive` (see `join_hosting`).
    answers_wait_get: bool,
    /// Where the ranks meet, for messages.
    place: String,
    /// How the host's ranks are released from `all_ready`.
    board: Board,
    /// The rendezvous's deadline (init's timeout), and the timeout.
    deadline: Instant,
    timeout: Duration,
}

/// Releases the host's other ranks when dropped, where this rank is its
/// host's first: at the end of its own init, and from a thread of its
/// own. Waking a thousand ranks takes the waker 2 ms of CPU, after which
/// the scheduler put it behind every rank it woke: rank 0 was the slowest
/// rank of a wide job by 0.2-0.4 s, for that.
pub struct Release(Option<HostBoard>);

impl Drop for Release {
    fn drop(&mut self) {
        let Some(board) = self.0.take() else {
            return;
        };
        // Marked here: a rank whose wake is lost (this process ended
        // before the thread ran) still finds it at its next look.
        board.mark(true);
        let board = std::sync::Arc::new(board);
        let waker = board.clone();
        let spawned = std::thread::Builder::new()
            .name("rdist-release".into())
            .spawn(move || waker.wake());
        // No thread to be had: woken from here.
        if spawned.is_err() {
            board.wake();
        }
    }
}

/// This rank's part in its host's board (see `host_board`).
enum Board {
    /// The store releases this rank itself.
    None,
    /// The host's first rank: released by the store, it releases the
    /// others through its board.
    Leader(HostBoard),
    /// Released through the board of the host's first rank (`leader`).
    Follower { at: packed::BoardAt, leader: usize },
}

impl Joined {
    /// The store, when it serves on after init (a TCP store: rank 0's,
    /// torch's); a shared directory is removed once everyone joined.
    pub fn lasting_store(&self) -> Option<Arc<dyn Store>> {
        self.file_store.is_none().then(|| self.store.clone())
    }

    /// Called once this rank's communicator is set up: returns when every
    /// rank's is (no rank's init returns before every rank can take part
    /// in a collective, as with NCCL's and torch's), or fails with what a
    /// rank that could not set up published (`failed`), or when the
    /// rendezvous's deadline (init's timeout) passes. Every rank comes out
    /// alike: a rank that gives up says so where the release would be,
    /// unless the release came first. A shared directory is then removed
    /// by the last rank out.
    ///
    /// The ranks of a wide job that finished first went on to their first
    /// collective and, connecting, took the cores from the ranks still
    /// setting up (1024 ranks on 2 cores: half of init's last second).
    /// The last rank to arrive releases everyone at once; on rdist's own
    /// store in one round trip and the store's one turn.
    pub fn all_ready(&mut self) -> Result<Release> {
        let mut release = Release(None);
        let waited = match &self.board {
            Board::Follower { at, leader } => {
                match HostBoard::open(at.pid, at.fd, &self.roster.job) {
                    Some(board) => self.released_by(&board, *leader, *at),
                    None => self.released_by_store(),
                }
            }
            Board::Leader(_) | Board::None => self.released_by_store(),
        };
        let value = match waited {
            // Said where the release would be, unless it came just now.
            Err(e) if e.kind() == ErrorKind::Timeout => {
                let gave_up = format!("{} rank {}: {}", e.kind().code(), self.rank, e.message());
                match self.store.set_if_absent(READY_KEY, gave_up.as_bytes()) {
                    Ok(value) if value == READY => Ok(value),
                    _ => Err(e),
                }
            }
            other => other,
        };
        let ready = value.as_deref().ok() == Some(READY);
        if let Board::Leader(board) = std::mem::replace(&mut self.board, Board::None) {
            match ready {
                true => release.0 = Some(board),
                false => board.release(false),
            }
        }
        match &self.file_store {
            Some(f) => {
                if self.store.add(LEFT_KEY, 1).unwrap_or(0) >= self.size as i64 {
                    let _ = f.remove();
                }
            }
            // For a unique id's host, which keeps its store until then.
            None => drop(self.store.add_no_wait(LEFT_KEY, 1)),
        }
        let value = value?;
        if value == READY {
            return Ok(release);
        }
        Err(published_error(&value))
    }

    /// Counts this rank in the store and waits there for the release.
    fn released_by_store(&self) -> Result<Vec<u8>> {
        let (store, size) = (&*self.store, self.size);
        let mut arrived = false;
        wait_for_ranks(store, self.rank, size, self.deadline, |slice| {
            if !std::mem::replace(&mut arrived, true) {
                if self.answers_wait_get {
                    return store.arrive(CONNECTED_KEY, size as i64, READY_KEY, READY, slice);
                }
                // Unless a rank that failed said so there already.
                if store.add(CONNECTED_KEY, 1)? >= size as i64 {
                    store.set_if_absent(READY_KEY, READY)?;
                }
            }
            // One query where it can be: a unique id's host may stop its
            // store once every rank has left, between a wait and a get.
            wait_value(store, READY_KEY, slice, self.answers_wait_get)
        })
        .map_err(|e| self.not_ready(e))
    }

    /// Counts this rank in the store (not waiting for an answer) and
    /// waits on the host's board for the host's first rank to release it;
    /// meanwhile, in growing slices, looks in the store for the release,
    /// and whether the first rank still lives.
    fn released_by(
        &self,
        board: &HostBoard,
        leader: usize,
        at: packed::BoardAt,
    ) -> Result<Vec<u8>> {
        let (store, deadline) = (&*self.store, self.deadline);
        store.arrive_quietly(CONNECTED_KEY, self.size as i64, READY_KEY, READY)?;
        let _quietly = WakingQuietly::begin();
        let mut slice = first_slice(self.size);
        loop {
            let released = board.wait(slice.min(left(deadline)));
            if released == host_board::Release::Ready {
                return Ok(READY.to_vec());
            }
            let bound = left(deadline).clamp(Duration::from_secs(1), store::OPERATION_TIMEOUT);
            let looked = store.read_within(&[READY_KEY], bound);
            if let Ok(Some(value)) = looked.as_ref().map(|v| v.first().cloned().flatten()) {
                return Ok(value);
            }
            // SAFETY: kill with signal 0 only asks whether the process is there.
            let leader_lives = unsafe { libc::kill(at.pid as libc::pid_t, 0) } == 0
                || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
            if released == host_board::Release::Failed || !leader_lives {
                let what = match leader_lives {
                    true => "gave up waiting for the others (its error says why)",
                    false => "exited before it released them",
                };
                let store_said = looked.err().map_or(String::new(), |e| format!("; {e}"));
                return Err(Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "rank {leader} (pid {}), which waited for every rank on behalf of this \
                         host's ranks, {what}{store_said}",
                        at.pid
                    ),
                ));
            }
            if left(deadline).is_zero() {
                return Err(self.not_ready(Error::new(ErrorKind::Timeout, "")));
            }
            slice = (slice * 2).min(Duration::from_secs(2));
        }
    }

    /// Tells every rank waiting in `all_ready` that this one could not set
    /// up its communicator, and why; returns the error to report here.
    /// The first failure published is the one every rank reports: a rank
    /// that failed only because another did (the other's connection lost
    /// in an exchange) reports that other's.
    pub fn failed(&self, e: Error) -> Error {
        let text = format!(
            "{} rank {} could not set up its communicator: {}",
            e.kind().code(),
            self.rank,
            e.message()
        );
        let first = self.store.set_if_absent(READY_KEY, text.as_bytes());
        if let Board::Leader(board) = &self.board {
            board.release(false);
        }
        match first {
            Ok(first) if first != text.as_bytes() && e.kind() == ErrorKind::PeerLost => {
                published_error(&first)
            }
            _ => e,
        }
    }

    /// A timeout of `all_ready`, saying how many ranks got there.
    fn not_ready(&self, e: Error) -> Error {
        if e.kind() != ErrorKind::Timeout {
            return e;
        }
        let count = self
            .store
            .read_within(&[CONNECTED_KEY], Duration::from_secs(1))
            .ok()
            .and_then(|v| v.into_iter().next().flatten())
            .and_then(|v| String::from_utf8(v).ok()?.parse::<usize>().ok());
        let did = count.map_or(String::new(), |n| format!(": {n} of {} did", self.size));
        Error::new(
            ErrorKind::Timeout,
            format!(
                "timed out after {:.1} s waiting through {} for every rank to set up its communicator{did} \
                 (every rank had joined: one has died or hangs in init since)",
                self.timeout.as_secs_f64(),
                self.place
            ),
        )
    }
}

/// Waits up to `slice` for `key` and returns its value: in one query on a
/// store that `answers_wait_get`, else a wait and then a get.
fn wait_value(
    store: &dyn Store,
    key: &str,
    slice: Duration,
    answers_wait_get: bool,
) -> Result<Vec<u8>> {
    if answers_wait_get {
        return store.wait_get(key, slice);
    }
    store.wait(&[key], slice)?;
    store.get_present(key)
}

/// The error a rank published where the release would be: its code, then
/// its message.
fn published_error(value: &[u8]) -> Error {
    let text = String::from_utf8_lossy(value);
    let (kind, why) = text
        .split_once(' ')
        .and_then(|(code, why)| Some((ErrorKind::from_code(code.parse().ok()?)?, why)))
        .unwrap_or((ErrorKind::PeerLost, &text));
    Error::new(kind, why.to_string())
}

/// Counts the ranks whose communicator is set up (also watched by a
/// unique id's host and by a later meeting looking for ranks started
/// twice).
const CONNECTED_KEY: &str = "connected";
/// Set by the last rank to count itself in `CONNECTED_KEY` to `READY`, or
/// by a rank that failed to its error's code and message.
const READY_KEY: &str = "ready";
const READY: &[u8] = b"ok";
/// Counts the ranks out of `all_ready`: a shared directory is removed,
/// and a unique id's host stops its store, once every rank is.
pub(crate) const LEFT_KEY: &str = "left";

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Where rank 0's store listens: the address MASTER_ADDR (or the tcp://
/// host) names, so that only that network reaches it, when that address is
/// this host's. Every interface otherwise: a name this host resolves to a
/// loopback address other ranks cannot use (Debian maps its own hostname
/// to 127.0.1.1) or to an address it does not have (NAT, a proxy).
fn store_address(host: &str, master: SocketAddr) -> SocketAddr {
    let literal = host.trim_start_matches('[').trim_end_matches(']');
    let named_loopback =
        master.ip().is_loopback() && literal != "localhost" && literal.parse::<IpAddr>().is_err();
    let ours = TcpListener::bind((master.ip(), 0)).is_ok();
    if ours && !named_loopback && !master.ip().is_unspecified() {
        master
    } else {
        wildcard(master.ip(), master.port())
    }
}

fn wildcard(ip: IpAddr, port: u16) -> SocketAddr {
    match ip {
        IpAddr::V4(_) => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port),
        IpAddr::V6(_) => SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port),
    }
}

/// Meets the other ranks; blocks until all `size` have joined or the
/// timeout passes. `offers_nccl`: NCCL may run in this process (published
/// with the rank's address; see `Joined::some_rank_offers_nccl`).
/// `meanwhile` runs once this rank has published itself, before it waits
/// for the others: work that needs no roster done then is off the path
/// of the last ranks of a wide job, which do everything after the roster
/// comes while the cores are busiest.
pub fn join(
    meeting: &Meeting,
    rank: usize,
    size: usize,
    opts: &Options,
    offers_nccl: bool,
    meanwhile: &mut dyn FnMut(),
) -> Result<Joined> {
    if let Meeting::Method(Method::Alone) = meeting {
        if size == 1 {
            return alone::join(opts);
        }
        // More ranks, given as arguments: they meet as env:// always does.
        let master = method::env_master(&crate::options::process_env)?;
        return join(
            &Meeting::Method(master),
            rank,
            size,
            opts,
            offers_nccl,
            meanwhile,
        );
    }
    crate::transport::mesh::reserve_descriptors(rank, size)?;
    // On failure the lease goes, but the store lingers (see
    // store::hosted), so the other ranks can still ask it who is missing.
    let mut server = None;
    join_hosting(
        meeting,
        rank,
        size,
        opts,
        offers_nccl,
        meanwhile,
        &mut server,
    )
}

/// Where the ranks meet, and what is known of that place.
struct Met {
    store: Arc<dyn Store>,
    /// Where the store listens (None: a shared directory).
    master: Option<SocketAddr>,
    /// The job id, when the meeting brings one (a unique id).
    job: Option<[u8; 16]>,
    file_store: Option<Arc<FileStore>>,
    /// Whether the store answers `wait_get` (rdist's own server, or a
    /// directory): torch's does not.
    answers_wait_get: bool,
    /// Where the ranks meet, for messages.
    place: String,
}

/// What this rank published.
struct Published {
    listener: TcpListener,
    /// The board this rank offers its host (see `host_board`).
    board: Option<OwnBoard>,
    /// This rank completed the count of ranks: it gathers the roster.
    last: bool,
}

/// Init's meeting, in its steps: meet (the store), claim (the job's id and
/// this rank's number), publish (this rank's address, host and board),
/// gather (the roster, by the last rank to come), then each rank reads
/// the roster and finds its place among its host's ranks.
fn join_hosting(
    meeting: &Meeting,
    rank: usize,
    size: usize,
    opts: &Options,
    offers_nccl: bool,
    meanwhile: &mut dyn FnMut(),
    server: &mut Option<StoreLease>,
) -> Result<Joined> {
    let deadline = Instant::now() + opts.timeout;
    let mut met = meet(meeting, rank, deadline, opts, server)?;
    let job = claim(&mut met, rank, size, opts, deadline, server.is_some())?;
    let published = publish(&met, &job, rank, size, opts, offers_nccl)?;
    if published.last {
        gather(&met, rank, size, opts, deadline)?;
    }
    meanwhile();
    let listing = read_roster(&met, rank, size, opts, deadline)?;
    let mine = &listing.hosts[rank];
    let place = Placement::of(&listing.hosts, rank);
    let board = match (
        published.board,
        listing.boards.iter().find(|(h, _)| h == mine),
    ) {
        _ if place.host_ranks == 1 => Board::None,
        // A first rank that cannot map its board leaves the others to find
        // the release in the store (at their first look, within a second).
        (Some(own), _) if place.leader == rank => own.mapped().map_or(Board::None, Board::Leader),
        (_, Some((_, Some(at)))) if place.leader != rank => Board::Follower {
            at: *at,
            leader: place.leader,
        },
        _ => Board::None,
    };
    let roster = Roster {
        job,
        comm_id: 0,
        addrs: listing.addrs,
        hosts: listing.hosts,
        machines: listing.machines.into(),
        cpus: (listing.cpus.into_iter())
            .filter_map(|(h, c)| Some((h, c?)))
            .collect(),
    };
    let local_rank = match opts.local_rank {
        Some(l) => l as usize,
        None => {
            match method::first_int(&method::LOCAL_RANK_VARS[1..], &crate::options::process_env)? {
                Some(l) if l >= 0 => l as usize,
                _ => roster.local_rank(rank),
            }
        }
    };
    Ok(Joined {
        size,
        local_rank,
        roster,
        some_rank_offers_nccl: listing.some_offer_nccl,
        listener: published.listener,
        store: met.store,
        server: server.take(),
        file_store: met.file_store,
        rank,
        answers_wait_get: met.answers_wait_get,
        place: met.place,
        board,
        deadline,
        timeout: opts.timeout,
    })
}

/// Meet: reaches the store the meeting names (rank 0 of tcp:// hosts it).
fn meet(
    meeting: &Meeting,
    rank: usize,
    deadline: Instant,
    opts: &Options,
    server: &mut Option<StoreLease>,
) -> Result<Met> {
    let token = opts.auth_token.as_deref().map(Token::new);
    let met = |store: Arc<dyn Store>, master, job, place| Met {
        store,
        master,
        job,
        file_store: None,
        answers_wait_get: true,
        place,
    };
    Ok(match meeting {
        Meeting::Method(Method::TorchStore { host, port, prefix }) => {
            let master = iface::resolve(host, *port)?;
            let client = TcpStoreClient::join(
                &host_port(host, *port),
                prefix,
                rank,
                deadline,
                token.as_ref(),
            )?;
            Met {
                answers_wait_get: false,
                ..met(
                    Arc::new(client),
                    Some(master),
                    None,
                    format!("torchrun's store at {}", host_port(host, *port)),
                )
            }
        }
        Meeting::Method(Method::Tcp { host, port }) => {
            let master = iface::resolve(host, *port)?;
            let mut place = format!("the store at {}", host_port(host, *port));
            let mut port_taken = None;
            if rank == 0 {
                match store::hosted::host(store_address(host, master), token.clone()) {
                    Ok(s) => *server = Some(s),
                    // A store already listens there (a PyTorch TCPStore a
                    // launcher or the program made, or another
                    // communicator's): every rank joins it, under keys of
                    // this meeting's own. Whatever else holds the port
                    // fails the handshake, and the error names it.
                    Err(e) if e.message().ends_with("address already in use") => {
                        place =
                            format!("the store already listening at {}", host_port(host, *port));
                        port_taken = Some(e);
                    }
                    Err(e) => return Err(e),
                }
            }
            let client = TcpStoreClient::join(
                &host_port(host, *port),
                "rdist/tcp/",
                rank,
                deadline,
                token.as_ref(),
            )
            .map_err(|e| match port_taken {
                Some(taken) => Error::new(
                    taken.kind(),
                    format!(
                        "{}, and joining what listens there failed: {}",
                        taken.message(),
                        e.message()
                    ),
                ),
                None => e,
            })?;
            met(Arc::new(client), Some(master), None, place)
        }
        Meeting::Method(Method::File(path)) => {
            let f = Arc::new(FileStore::new(path)?);
            Met {
                file_store: Some(f.clone()),
                ..met(f, None, None, format!("the directory {}", path.display()))
            }
        }
        Meeting::Method(Method::Alone) => {
            return Err(Error::internal("a world of one has no store to join"))
        }
        Meeting::UniqueId(id) => {
            let client =
                TcpStoreClient::connect_with(&id.addr.to_string(), deadline, token.as_ref())?;
            met(
                Arc::new(client),
                Some(id.addr),
                Some(id.job),
                format!("the unique id's store at {}", id.addr),
            )
        }
    })
}

/// "HOST:PORT", an IPv6 address in brackets.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Claim: the job's id and world size (made by rank 0, with whether the
/// store is rdist's own, which only rank 0 knows) and this rank's number,
/// which no other process may hold.
fn claim(
    met: &mut Met,
    rank: usize,
    size: usize,
    opts: &Options,
    deadline: Instant,
    hosting: bool,
) -> Result<[u8; 16]> {
    let store = &*met.store;
    let job = if rank == 0 {
        if met.job.is_none() {
            met.answers_wait_get = met.file_store.is_some() || hosting;
        }
        let job = met.job.unwrap_or_else(|| {
            let mut j = [0u8; 16];
            crate::random::fill(&mut j);
            j
        });
        store.set(
            "job",
            &JobRecord {
                job,
                answers_wait_get: met.answers_wait_get,
                size,
            }
            .to_bytes(),
        )?;
        job
    } else {
        let v = store
            .get("job", left(deadline))
            .map_err(|e| missing_ranks(e, store, size, &met.place, opts))?;
        let record = JobRecord::from_bytes(&v)
            .ok_or_else(|| Error::internal("the job's record in the store is malformed"))?;
        if met.job.is_none() {
            met.answers_wait_get = record.answers_wait_get;
        }
        // A process of another world size, found before it claims or
        // publishes anything: one whose rank is beyond the job's cannot be
        // one of its ranks, and goes alone, leaving the job unharmed; one
        // within it took a real rank's place, and every rank hears why.
        if record.size != size {
            let e = Error::new(
                ErrorKind::Mismatch,
                format!(
                    "rank 0 was started with world size {} but rank {rank} with {size} \
                     (check WORLD_SIZE / the size argument on every rank)",
                    record.size
                ),
            );
            if rank < record.size {
                let _ = store.set(FAILED_KEY, e.message().as_bytes());
                return Err(e);
            }
            return Err(e.context(format!(
                "this process (rank {rank}) is not one of the job's {} ranks and left it \
                 without joining",
                record.size
            )));
        }
        met.job.unwrap_or(record.job)
    };
    if store.add(&format!("claim/{rank}"), 1)? > 1 {
        return Err(Error::invalid_usage(format!(
            "rank {rank} joined twice: two processes were started with rank {rank} (check RANK / the rank argument)"
        )));
    }
    Ok(job)
}

/// What rank 0 leaves in the store for the others at the claim.
struct JobRecord {
    job: [u8; 16],
    /// Whether the store answers `wait_get` (see `Met`).
    answers_wait_get: bool,
    size: usize,
}

impl JobRecord {
    fn to_bytes(&self) -> Vec<u8> {
        let mut b = self.job.to_vec();
        b.push(u8::from(self.answers_wait_get));
        b.extend_from_slice(&(self.size as u64).to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8]) -> Option<JobRecord> {
        if b.len() != 25 {
            return None;
        }
        Some(JobRecord {
            job: b[..16].try_into().ok()?,
            answers_wait_get: b[16] == 1,
            size: u64::from_le_bytes(b[17..25].try_into().ok()?) as usize,
        })
    }
}

/// Publish: binds this rank's listener where the others reach it, offers
/// a board to its host, and publishes both with the world size and the
/// count, in one round trip.
fn publish(
    met: &Met,
    job: &[u8; 16],
    rank: usize,
    size: usize,
    opts: &Options,
    offers_nccl: bool,
) -> Result<Published> {
    let ip = match met.master {
        Some(m) => iface::listen_address(opts.ifname.as_deref(), m)?,
        None => iface::public_address(opts.ifname.as_deref()),
    };
    let listener = TcpListener::bind((ip, 0))
        .map_err(|e| Error::system(format!("binding a listener on {ip}"), &e))?;
    crate::transport::mesh::widen_backlog(&listener, size);
    let addr = listener
        .local_addr()
        .map_err(|e| Error::system("local_addr", &e))?;
    let host = opts.host_id.clone().unwrap_or_else(host_id);
    // Whether this rank turns out to be its host's first is known from
    // the roster; every rank offers a board (see `host_board`). Only
    // rdist's own store counts an arrival without answering.
    let board = (met.answers_wait_get && met.file_store.is_none() && size > 1)
        .then(|| OwnBoard::create(job))
        .flatten();
    let me = packed::published(
        size,
        addr,
        &host,
        std::process::id(),
        offers_nccl,
        board.as_ref().map(OwnBoard::fd),
        &crate::transport::machine::this_machine(hosts::machine_of(&host)),
        Cpus::own().as_ref(),
    );
    // The world size (the last to set it stays: see `wait_for_ranks`).
    let size_text = size.to_string();
    let rank_key = format!("rank/{rank}");
    let joined = met.store.apply(&[
        Update::Set("world_size", size_text.as_bytes()),
        Update::Set(&rank_key, me.as_bytes()),
        Update::Add("joined", 1),
    ])?;
    Ok(Published {
        listener,
        board,
        last: joined.first() == Some(&(size as i64)),
    })
}

/// The roster's key names the world size: ranks started with another
/// never take it for theirs.
fn roster_key(size: usize) -> String {
    format!("roster/{size}")
}

/// Gather (by the rank that completed the count): every rank's key into
/// one value, which the others wait for: one key per rank to wait on, not
/// every rank's (a thousand ranks each waiting on a thousand keys kept
/// the store's one thread busy for seconds, as NCCL's and PyTorch's
/// bootstraps found before).
fn gather(met: &Met, rank: usize, size: usize, opts: &Options, deadline: Instant) -> Result<()> {
    let store = &*met.store;
    // Every key is there unless ranks of another world size were
    // counted: the wait (with its checks) says so, not a hang.
    let keys: Vec<String> = (0..size).map(|r| format!("rank/{r}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    wait_for_ranks(store, rank, size, deadline, |slice| {
        store.wait(&key_refs, slice)
    })
    .map_err(|e| missing_ranks(e, store, size, &met.place, opts))?;
    let values = store.get_all(&key_refs, left(deadline).max(Duration::from_millis(1)))?;
    match packed::gather(&values, rank, size) {
        Ok(roster) => store.set(&roster_key(size), &roster),
        Err(e) => {
            // Every rank hears it: the ones still waiting for ranks of
            // another world size through the failure key, the others
            // at once through an empty roster.
            let _ = store.set(FAILED_KEY, e.message().as_bytes());
            let _ = store.set(&roster_key(size), b"");
            Err(e)
        }
    }
}

/// Every rank reads the roster, in one round trip where the store answers
/// it: its one turn then answers every rank (a wait and a get took a turn
/// per rank).
fn read_roster(
    met: &Met,
    rank: usize,
    size: usize,
    opts: &Options,
    deadline: Instant,
) -> Result<packed::Listing> {
    let store = &*met.store;
    let key = roster_key(size);
    let value = wait_for_ranks(store, rank, size, deadline, |slice| {
        wait_value(store, &key, slice, met.answers_wait_get)
    })
    .map_err(|e| missing_ranks(e, store, size, &met.place, opts))?;
    if value.is_empty() {
        let why = store.get(FAILED_KEY, Duration::from_secs(1))?;
        return Err(Error::new(
            ErrorKind::Mismatch,
            String::from_utf8_lossy(&why).into_owned(),
        ));
    }
    packed::decode(&value)
        .filter(|l| l.addrs.len() == size)
        .ok_or_else(|| Error::internal("the roster in the store is malformed"))
}

/// Waits with `wait` (given each slice of time) for what every rank
/// brings; meanwhile (in growing slices) looks for what would make the
/// wait vain, so that every rank says it at once, not only the one that
/// saw it: a failure another rank published, or a rank started with
/// another world size (published here for the others).
fn wait_for_ranks<T>(
    store: &dyn Store,
    rank: usize,
    size: usize,
    deadline: Instant,
    mut wait: impl FnMut(Duration) -> Result<T>,
) -> Result<T> {
    // Each look costs a round trip with rank 0's store, and a wide job's
    // first ranks wait about as long as its launch takes (a millisecond or
    // so a rank on a small host: 1.0-1.4 s for 1024 ranks on 2 cores): the
    // first slice is long enough for most to need none, and looks taken
    // meanwhile slow the launch.
    let mut slice = first_slice(size);
    let _batch = WakingQuietly::begin();
    loop {
        let e = match wait(slice.min(left(deadline))) {
            Ok(got) => return Ok(got),
            Err(e) if e.kind() == ErrorKind::Timeout => e,
            Err(e) => return Err(e),
        };
        // A store too busy to answer within the look's bound is waited
        // for again (up to the deadline), as the keys are.
        let bound = left(deadline).clamp(Duration::from_secs(1), store::OPERATION_TIMEOUT);
        let looked = match store.read_within(&[FAILED_KEY, "world_size"], bound) {
            Ok(values) => values,
            Err(e) if e.kind() == ErrorKind::Timeout && !left(deadline).is_zero() => continue,
            Err(e) => return Err(e),
        };
        let [failed, last] = <[Option<Vec<u8>>; 2]>::try_from(looked).map_err(|_| {
            Error::internal("the store answered a read of two keys with another count")
        })?;
        if let Some(text) = failed {
            return Err(Error::new(
                ErrorKind::Mismatch,
                String::from_utf8_lossy(&text).into_owned(),
            ));
        }
        // Every rank sets "world_size": a value other than ours means some
        // rank has another (the last to set it stays). Only then is every
        // rank's key read, to name it (a read of every key by every rank,
        // on every slice, was most of a wide job's rendezvous).
        if last.as_deref() != Some(size.to_string().as_bytes()) {
            if let Some(mismatch) = other_world_size(store, rank, size)? {
                let _ = store.set(FAILED_KEY, mismatch.message().as_bytes());
                return Err(mismatch);
            }
        }
        if left(deadline).is_zero() {
            return Err(e);
        }
        slice = (slice * 2).min(Duration::from_secs(2));
    }
}

/// While it lives, the calling thread waits under SCHED_BATCH, whose
/// wake-up preempts no running thread (the policy is otherwise the same:
/// same share, same nice). A wide job's ranks all wait for one answer of
/// the store, which the store's one thread writes to each in turn: each
/// woken rank preempted it, and at 1024 ranks on 2 cores the last answer
/// went out 0.2-0.5 s after the first (105 preemptions in one pass).
struct WakingQuietly(bool);

impl WakingQuietly {
    fn begin() -> WakingQuietly {
        // Only a thread under the default policy (a real-time one keeps
        // its own).
        // SAFETY: plain system calls on the calling thread (0).
        let switched = unsafe {
            libc::sched_getscheduler(0) == libc::SCHED_OTHER
                && libc::sched_setscheduler(
                    0,
                    libc::SCHED_BATCH,
                    &libc::sched_param { sched_priority: 0 },
                ) == 0
        };
        WakingQuietly(switched)
    }
}

impl Drop for WakingQuietly {
    fn drop(&mut self) {
        if self.0 {
            // SAFETY: as in `begin`.
            unsafe {
                libc::sched_setscheduler(
                    0,
                    libc::SCHED_OTHER,
                    &libc::sched_param { sched_priority: 0 },
                )
            };
        }
    }
}

/// The first slice of a wait for the other ranks, before a look for what
/// would make it vain: 1 s, and 2 ms a rank beyond 500 (up to 4 s).
fn first_slice(size: usize) -> Duration {
    Duration::from_millis((size as u64).saturating_mul(2).clamp(1000, 4000))
}

/// Where a rank that finds the meeting cannot succeed says why.
const FAILED_KEY: &str = "failed";

/// A rank that already joined with another world size than `size`.
fn other_world_size(store: &dyn Store, rank: usize, size: usize) -> Result<Option<Error>> {
    for r in (0..size).filter(|r| *r != rank) {
        let key = format!("rank/{r}");
        if !store.check(&[&key])? {
            continue;
        }
        let value = store.get(&key, Duration::from_secs(1))?;
        let theirs = String::from_utf8_lossy(&value)
            .split(' ')
            .next()
            .unwrap_or("?")
            .to_string();
        if theirs != size.to_string() {
            return Ok(Some(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "rank {r} was started with world size {theirs} but rank {rank} with {size} \
                     (check WORLD_SIZE / the size argument on every rank)"
                ),
            )));
        }
    }
    Ok(None)
}

/// Turns a store timeout into a rendezvous timeout naming the missing ranks.
fn missing_ranks(e: Error, store: &dyn Store, size: usize, place: &str, opts: &Options) -> Error {
    if e.kind() != ErrorKind::Timeout {
        return e;
    }
    let twice = store.duplicated_ranks(size);
    if let Some(r) = twice.first() {
        return Error::invalid_usage(format!(
            "rank {r} joined twice: two processes were started with rank {r} (check RANK / the rank argument); rendezvous through {place} timed out after {:.1} s",
            opts.timeout.as_secs_f64()
        ));
    }
    let mut missing = Vec::new();
    for r in 0..size {
        match store.check(&[&format!("rank/{r}")]) {
            Ok(true) => {}
            Ok(false) => missing.push(r),
            Err(why) => return e.context(format!("rendezvous through {place} failed, and the store could not say who is missing ({why})")),
        }
    }
    if missing.is_empty() {
        // Every rank of this world size published, yet the count of ranks
        // never came out right: another process counted itself in.
        return e.context(format!(
            "rendezvous through {place} timed out after {:.1} s: all {size} ranks joined, but a \
             process not of this job (another world size or job) counted itself in",
            opts.timeout.as_secs_f64()
        ));
    }
    let shown: Vec<String> = missing.iter().take(16).map(|r| r.to_string()).collect();
    let more = if missing.len() > 16 {
        format!(" and {} more", missing.len() - 16)
    } else {
        String::new()
    };
    Error::new(
        ErrorKind::Timeout,
        format!(
            "rendezvous through {place} timed out after {:.1} s: {} of {size} ranks joined; missing: rank{} {}{more}",
            opts.timeout.as_secs_f64(),
            size - missing.len(),
            if missing.len() == 1 { "" } else { "s" },
            shown.join(", ")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Joins one rank per entry of `ranks` (threads, over a tcp:// store
    /// rank 0 hosts): (host id, timeout in ms, delay in ms between the
    /// roster and `all_ready`). Returns each rank's outcome, how long its
    /// `all_ready` took, and whether a board released it.
    fn ready(ranks: &[(&str, u64, u64)]) -> Vec<(Result<()>, Duration, bool)> {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let meeting = Meeting::Method(Method::Tcp {
            host: "127.0.0.1".into(),
            port,
        });
        let size = ranks.len();
        std::thread::scope(|s| {
            let handles: Vec<_> = (ranks.iter().enumerate())
                .map(|(rank, &(host, timeout_ms, delay_ms))| {
                    let meeting = meeting.clone();
                    s.spawn(move || {
                        let mut opts = Options::default();
                        opts.set("timeout_ms", &timeout_ms.to_string()).unwrap();
                        opts.set("host_id", host).unwrap();
                        let mut joined =
                            join(&meeting, rank, size, &opts, false, &mut || {}).unwrap();
                        let follower = matches!(joined.board, Board::Follower { .. });
                        std::thread::sleep(Duration::from_millis(delay_ms));
                        let started = Instant::now();
                        let outcome = joined.all_ready().map(drop);
                        (outcome, started.elapsed(), follower)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn a_hosts_ranks_are_released_through_its_board_at_once() {
        // A follower whose wake were lost would wait for its first look
        // (a second).
        let out = ready(&[
            ("h", 20_000, 0),
            ("h", 20_000, 0),
            ("h", 20_000, 0),
            ("h", 20_000, 200),
        ]);
        for (rank, (outcome, took, follower)) in out.iter().enumerate() {
            assert!(outcome.is_ok(), "rank {rank}: {outcome:?}");
            assert_eq!(*follower, rank > 0, "rank {rank}");
            assert!(
                *took < Duration::from_millis(800),
                "rank {rank} took {took:?}"
            );
        }
    }

    #[test]
    fn a_rank_later_than_the_others_timeout_fails_as_they_did() {
        // Ranks 0 and 1 give up after a second; rank 2, with more
        // patience, comes after that: it must not find the world ready.
        let out = ready(&[("a", 1_000, 0), ("a", 1_000, 0), ("b", 20_000, 2_000)]);
        for (rank, (outcome, _, _)) in out.iter().enumerate() {
            let e = outcome
                .as_ref()
                .expect_err("a rank succeeded where others gave up");
            assert_eq!(e.kind(), ErrorKind::Timeout, "rank {rank}: {e}");
        }
        let e = out[2].0.as_ref().unwrap_err();
        assert!(
            e.message().starts_with("rank 0: timed out")
                || e.message().starts_with("rank 1: timed out"),
            "{e}"
        );
    }

    #[test]
    fn ranks_meet_through_torchruns_store_without_ping_as_torch_2_4_hosts_it() {
        let store = store::old_torch::OldTorchStore::start();
        let meeting = Meeting::Method(Method::TorchStore {
            host: "127.0.0.1".into(),
            port: store.port(),
            prefix: "rdist/x/0/".into(),
        });
        let size = 3;
        let outcomes: Vec<Result<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..size)
                .map(|rank| {
                    let meeting = meeting.clone();
                    s.spawn(move || {
                        let mut opts = Options::default();
                        opts.set("timeout_ms", "20000").unwrap();
                        let mut joined = join(&meeting, rank, size, &opts, false, &mut || {})?;
                        joined.all_ready()?;
                        Ok(joined.size)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, outcome) in outcomes.iter().enumerate() {
            assert_eq!(
                outcome.as_ref().ok(),
                Some(&size),
                "rank {rank}: {outcome:?}"
            );
        }
    }
}
