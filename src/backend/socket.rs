//! The socket backend: runs each call with the algorithm chosen for it over
//! the transport's endpoint (shared memory on a host, TCP across hosts).

use crate::algorithms::layers::Layers;
use crate::algorithms::table::{self, Context};
use crate::algorithms::tuner;
use crate::algorithms::{self, bruck, Algo, Crossovers, Link};
use crate::auth::Token;
use crate::call::{Call, Data, RawBuf};
use crate::descriptor::{Desc, OpKind};
use crate::error::{Error, ErrorKind, Result};
use crate::options::{Options, ShmTuning, SingleCopy, TransportKind};
use crate::transport::endpoint::{Endpoint, EndpointSpec};
use crate::transport::media;
use crate::transport::medium::Wanted;
use crate::transport::membership::{hosts, split, Placement, Roster};
use crate::transport::mesh::MeshSpec;
use crate::transport::shrink::{self, Want};
use crate::transport::signal::AbortSignal;
use crate::transport::stream::Tuning;
use crate::transport::{Shape, Transport, Xfer};
use std::collections::VecDeque;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

/// How a communicator's backend behaves (inherited by splits).
#[derive(Clone, Debug)]
pub struct Settings {
    pub timeout: Duration,
    pub forced: Option<Algo>,
    pub transport: TransportKind,
    /// Busy-wait before sleeping (RDIST_SPIN_US).
    pub spin: Duration,
    /// Silence before a wait asks whether its peers' processes run
    /// (option `peer_check_ms`; zero: never).
    pub peer_check: Duration,
    /// Developers' switches for shared memory (see `options::ShmTuning`).
    pub shm: ShmTuning,
    /// Which shared-memory payloads travel single-copy (option
    /// `single_copy_min`), resolved per communicator at connect.
    pub single_copy: SingleCopy,
    /// The job's shared secret: every peer connection proves it.
    pub token: Option<Token>,
}

impl Settings {
    pub fn new(options: &Options, forced: Option<Algo>) -> Settings {
        Settings {
            token: options.auth_token.as_deref().map(Token::new),
            timeout: options.timeout,
            forced,
            transport: options.transport,
            spin: options.tuning.spin,
            peer_check: options.peer_check,
            single_copy: options.single_copy_min,
            shm: options.tuning.shm,
        }
    }
}

fn online_cores() -> usize {
    cores().0
}

/// Cores of the whole machine (not only those this process may use).
fn machine_cores() -> usize {
    cores().1
}

/// This process's cores and the machine's, looked up once per process:
/// both read files (the cgroup's quota, sysfs), 40 us a rank that the
/// last ranks of a wide job paid after the roster came. (A program that
/// changes its affinity between two communicators keeps the first count.)
fn cores() -> (usize, usize) {
    static CORES: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| {
        let ours = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: sysconf has no preconditions.
        let machine = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        (ours, if machine > 0 { machine as usize } else { ours })
    })
}

/// Looks up, while this rank waits for the others to join, what setting
/// up its engine will need and that needs no roster.
pub(crate) fn prepare() {
    cores();
}

pub struct SocketBackend {
    /// This rank's end of the communicator: every connection, both
    /// contexts.
    endpoint: Arc<Endpoint>,
    /// For the log: the transport and what was decided for it.
    transport_detail: String,
    /// The sizes at which algorithms hand over (the tuning model's).
    crossovers: Crossovers,
    /// For the log: the tuning model's inputs and choices.
    tuning_detail: String,
    /// This rank's host and cross-host groups, when the job has the
    /// shape for hierarchical collectives.
    layers: Option<Layers>,
    rank: usize,
    size: usize,
    roster: Roster,
    settings: Settings,
    /// Reused by the algorithms (see Link::take_scratch).
    scratch: Vec<u8>,
    /// Sends to this rank itself, waiting for their receive.
    to_self: VecDeque<Vec<u8>>,
}

impl SocketBackend {
    /// Connects the mesh described by `roster` (listener already bound).
    pub fn connect(
        rank: usize,
        roster: Roster,
        listener: &TcpListener,
        signal: Arc<AbortSignal>,
        settings: Settings,
    ) -> Result<SocketBackend> {
        crate::transport::stream::ignore_sigpipe();
        let timeout = settings.timeout;
        let size = roster.addrs.len();
        let spec = MeshSpec {
            rank,
            size,
            addrs: roster.addrs.clone(),
            job: roster.job,
            comm_id: roster.comm_id,
            token: settings.token.clone(),
            far: hosts::far(&roster.hosts, rank).into(),
        };
        let listener = listener
            .try_clone()
            .map_err(|e| Error::system("keeping the listener", &e))?;
        let place = Placement::of(&roster.hosts, rank);
        let (same_host, local_ranks) = (place.whole_world_here, place.host_ranks);
        // The cores the job's ranks here have together: one bound to a
        // core of its own sees one, and is not oversubscribed for that.
        let (cores, host_job_ranks) = match roster.cpus_of(rank) {
            Some(c) => (c.cpus as usize, c.ranks as usize),
            None => (online_cores(), 0),
        };
        // Hosts that are containers or network namespaces of one machine
        // share its cores: 4 "hosts" of 2 ranks on a 2-core machine, each
        // seeing 2 cores for its 2 ranks, spun a barrier to 2.9 ms (0.37
        // ms yielding).
        // The tuning model: crossovers from rank 0's host's profile (alike
        // on every rank), the rest from this host's.
        let plan = tuner::plan(&tuner::Inputs {
            agreed: roster.machine_of(0),
            here: roster.machine_of(rank),
            host_ranks: local_ranks,
            host_job_ranks,
            machine_ranks: place.machine_ranks,
            cores,
            machine_cores: machine_cores(),
            core_cache_kib: crate::transport::machine::core_cache_kib(),
        });
        let oversubscribed = plan.oversubscribed;
        let single_copy_min = settings.single_copy.min_bytes(plan.single_copy_min);
        let two_way_single_copy_min = settings.single_copy.min_bytes(plan.two_way_single_copy_min);
        let tagged_single_copy_min = settings.single_copy.min_bytes(plan.tagged_single_copy_min);
        // Shared memory with the ranks of this host, TCP with the others,
        // each pair agreeing when it connects (on first use).
        let wanted = Wanted {
            shm: settings.transport == TransportKind::Auto,
            tuning: settings.shm,
        };
        let endpoint = Endpoint::new(EndpointSpec {
            mesh: spec,
            listener,
            local_ranks,
            wanted,
            tuning: Tuning {
                timeout,
                spin: settings.spin,
                peer_check: settings.peer_check,
                yield_when_idle: oversubscribed,
                ranks_per_core: plan.ranks_per_core,
                single_copy_min,
                two_way_single_copy_min,
                reduced_single_copy_min: settings.single_copy.reduced_min_bytes(),
                mixed: false,
                // Tagged messages go single copy where the collectives do
                // (where the machine copies out of another's memory faster
                // than two cores pass bytes through a ring, or the ranks
                // outnumber the cores, or memory is the bound), and sooner
                // where the ranks share cores and single copy outpaces a
                // core's own copy (the model).
                tagged_single_copy_min,
                // Below it, by buffer, as its copies are measured: unless
                // the option fixes the size.
                tagged_read_cost: plan
                    .read_cost
                    .filter(|_| settings.single_copy == SingleCopy::Auto),
            },
            signal,
        })?;
        let shm_here = endpoint.links().doorbell().is_some();
        let media = endpoint.links().media();
        // The algorithms' view of the media, from what every rank knows
        // alike (the roster, the options), never from this rank's own
        // channels: a host whose shared memory failed, or that holds one
        // rank of a multi-host job, must choose as the others do.
        let shape = Shape {
            within_host: media::nominal(media, true),
            between_hosts: media::nominal(media, false),
            across_hosts: !same_host,
        };
        let mixed = shm_here && !same_host;
        {
            let mut core = endpoint.core();
            core.set_shape(shape);
            core.set_mixed(mixed);
        }
        let name = match (shm_here, same_host) {
            (false, _) => "tcp",
            (true, true) => "shared memory",
            (true, false) => "shared memory on this host, tcp to the others",
        };
        let mut transport_detail = format!("{name}, {local_ranks} ranks on {cores} cores here");
        if shm_here {
            transport_detail += &match (settings.shm.single_copy, single_copy_min) {
                (false, _) => ", single copy unavailable (RDIST_NO_SINGLE_COPY)".to_string(),
                (true, usize::MAX) => match two_way_single_copy_min {
                    usize::MAX => ", single copy off".to_string(),
                    n => format!(
                        ", single copy from {n} B for a rank that sends while it receives, where a pair can read each other"
                    ),
                },
                (true, n) => format!(
                    ", single copy from {n} B{} where a pair can read each other{}",
                    {
                        let sooner: Vec<String> = [
                            (two_way_single_copy_min, "a rank that sends while it receives"),
                            (tagged_single_copy_min, "a point-to-point message"),
                        ]
                        .into_iter()
                        .filter(|(m, _)| *m < n)
                        .map(|(m, what)| format!("{m} B for {what}"))
                        .collect();
                        match sooner.is_empty() {
                            true => String::new(),
                            false => format!(" ({})", sooner.join(", ")),
                        }
                    },
                    match settings.single_copy.reduced_min_bytes() {
                        usize::MAX => " (reductions through the rings)",
                        _ => "",
                    }
                ),
            };
        }
        Ok(SocketBackend {
            layers: Layers::of(&roster.hosts, rank),
            transport_detail,
            crossovers: plan.crossovers,
            tuning_detail: plan.why,
            endpoint: Arc::new(endpoint),
            rank,
            size,
            roster,
            settings,
            to_self: VecDeque::new(),
            scratch: Vec::new(),
        })
    }

    /// This rank's end of the communicator.
    pub(crate) fn endpoint(&self) -> Arc<Endpoint> {
        self.endpoint.clone()
    }

    /// The transport with its cores and single-copy choice, for the log.
    pub fn transport_detail(&self) -> &str {
        &self.transport_detail
    }

    /// The tuning model's inputs and choices, for the log.
    pub fn tuning_detail(&self) -> &str {
        &self.tuning_detail
    }

    pub fn roster(&self) -> &Roster {
        &self.roster
    }

    /// Tells the peers this rank aborted (if nobody did yet).
    pub fn abort(&mut self) {
        let mut core = self.endpoint.core();
        if core.failure().is_none() {
            let e = Error::new(
                ErrorKind::Aborted,
                format!("rdist_comm_abort was called on rank {}", self.rank),
            );
            core.fail(e, true);
        }
    }

    /// Local: lets tagged sends finish, says goodbye to the peers, closes
    /// every connection and stops the endpoint's thread.
    pub fn close(&mut self) {
        self.endpoint.close();
    }

    /// A peer whose connection has closed (see `StreamTransport::closed_peer`),
    /// when no call holds the core.
    pub fn closed_peer(&self) -> Option<usize> {
        self.endpoint.try_core()?.closed_peer()
    }

    /// Fails the communicator with `e` (another part of it failed, e.g.
    /// NCCL) and tells every reachable peer.
    pub fn fail(&mut self, e: Error) {
        let mut core = self.endpoint.core();
        if core.failure().is_none() {
            core.fail(e, true);
        }
    }

    /// The algorithm for a call, chosen by what the media can do as the
    /// transport says every rank sees it.
    fn label(&self, transport: &dyn Transport, mut desc: Desc, bytes: usize) -> (Desc, Algo) {
        let algo = algorithms::choose(
            desc.kind,
            bytes,
            self.size,
            self.settings.forced,
            &transport.shape(),
            self.layers.is_some(),
            &self.crossovers,
        );
        desc.algo = algo as u8;
        (desc, algo)
    }

    /// Runs one call to completion; `seq` is its number (see
    /// `engine::Sequence`).
    ///
    /// # Safety
    /// The call's buffers must be valid as its constructor describes and not
    /// used by anyone else until this returns.
    pub unsafe fn run(&mut self, call: &Call, seq: u64) -> Result<()> {
        if call.is_p2p() {
            return self.run_p2p(&[(call, seq)]);
        }
        self.run_call(call, seq)
    }

    /// A collective: labelled with the algorithm chosen for it and handed
    /// to its entry in the table of collectives.
    unsafe fn run_call(&mut self, call: &Call, seq: u64) -> Result<()> {
        let entry = table::entry(call.op_kind())?;
        // The core is this call's from its start to its end.
        let endpoint = self.endpoint.clone();
        let mut core = endpoint.core();
        let (desc, algo) = self.label(&*core, call.desc(seq), (entry.bytes)(call));
        let mut link = Link::new(&mut *core, desc, &mut self.scratch);
        if desc.kind.has_root() {
            link = link.checked();
        }
        let context = Context {
            algo,
            layers: self.layers.as_ref(),
        };
        (entry.run)(&mut link, call, &context)?;
        link.finish()
    }

    /// Runs sends and receives together in one exchange, so that any
    /// pattern (a ring, a swap with a neighbour) completes.
    ///
    /// # Safety
    /// As for `run`.
    pub unsafe fn run_p2p(&mut self, calls: &[(&Call, u64)]) -> Result<()> {
        // Sends to self first, so receives from self in the same group find them.
        for (c, _) in calls {
            if let Call::Send { buf, peer, .. } = c {
                if *peer == self.rank {
                    self.to_self.push_back(buf.bytes().to_vec());
                }
            }
        }
        let mut xfers: Vec<Xfer<'_>> = Vec::with_capacity(calls.len());
        for &(c, seq) in calls {
            match *c {
                Call::Send { buf, data, peer } if peer != self.rank => {
                    let desc = Desc::new(OpKind::Send, seq)
                        .data(data.count, data.dtype)
                        .root(self.rank);
                    xfers.push(Xfer::send(peer, buf.bytes(), desc));
                }
                Call::Recv { buf, data, peer } if peer != self.rank => {
                    let desc = Desc::new(OpKind::Send, seq)
                        .data(data.count, data.dtype)
                        .root(peer);
                    xfers.push(Xfer::recv(peer, buf.bytes_mut(), desc));
                }
                Call::Recv { buf, data, .. } => self.recv_from_self(buf, data)?,
                _ => {}
            }
        }
        self.endpoint.core().exchange(&mut xfers)
    }

    unsafe fn recv_from_self(&mut self, buf: RawBuf, data: Data) -> Result<()> {
        let Some(msg) = self.to_self.pop_front() else {
            return Err(Error::invalid_usage(format!(
                "rank {} receives from itself but has no matching send: put the send before it, or both in one rdist_group_start/end",
                self.rank
            )));
        };
        if msg.len() != buf.len() {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "rank {} sent itself {} bytes but receives {} x {} ({} bytes)",
                    self.rank,
                    msg.len(),
                    data.count,
                    data.dtype,
                    buf.len()
                ),
            ));
        }
        crate::copy::copy(buf.bytes_mut(), &msg);
        Ok(())
    }

    /// Collective split: ranks with equal `color` form a new communicator
    /// ordered by (key, rank). `seq` is the split's number (it also seeds
    /// the child's id). Returns the new rank and backend, or None for
    /// `color < 0` (no color).
    pub fn split(
        &mut self,
        color: i32,
        key: i32,
        seq: u64,
        signal: Arc<AbortSignal>,
    ) -> Result<Option<(usize, SocketBackend)>> {
        let endpoint = self.endpoint.clone();
        let mut core = endpoint.core();
        let d = Desc::new(OpKind::Split, seq);
        let (desc, _) = self.label(&*core, d, 0);
        let ip = self.roster.addrs[self.rank].ip();
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| Error::system(format!("binding a listener on {ip} for comm_split"), &e))?;
        crate::transport::mesh::widen_backlog(&listener, self.size);
        let port = listener
            .local_addr()
            .map_err(|e| Error::system("local_addr", &e))?
            .port();
        let mut all = vec![0u8; split::RECORD_BYTES * self.size];
        all[self.rank * split::RECORD_BYTES..][..split::RECORD_BYTES]
            .copy_from_slice(&split::record(color, key, port));
        // Few bytes per rank: latency-bound whatever the world (Bruck).
        bruck::allgather(
            &mut Link::new(&mut *core, desc, &mut self.scratch),
            &mut all,
            split::RECORD_BYTES,
        )?;
        drop(core);
        if color < 0 {
            return Ok(None);
        }
        let (new_rank, roster) = split::child(&self.roster, &all, self.rank, seq, color);
        let child =
            SocketBackend::connect(new_rank, roster, &listener, signal, self.settings.clone())?;
        Ok(Some((new_rank, child)))
    }

    /// What a shrink of this communicator needs, apart from its backend
    /// (so that the shrink holds no lock a concurrent abort needs).
    pub fn survivors(&self) -> Survivors {
        Survivors {
            endpoint: self.endpoint.clone(),
            roster: self.roster.clone(),
            rank: self.rank,
            settings: self.settings.clone(),
        }
    }
}

/// A shrink of a socket communicator (see `SocketBackend::survivors`).
pub struct Survivors {
    endpoint: Arc<Endpoint>,
    roster: Roster,
    rank: usize,
    settings: Settings,
}

impl Survivors {
    /// A communicator of the ranks but `exclude` and those that failed,
    /// agreed among the survivors over fresh connections (see
    /// `transport::shrink`), whatever state the parent is in. `failed`:
    /// the ranks this rank knows failed. Returns the new rank and
    /// backend, and the ranks left out (in the parent's numbering).
    pub fn shrink(
        self,
        exclude: &[usize],
        failed: Vec<usize>,
        signal: Arc<AbortSignal>,
        timeout: Duration,
    ) -> Result<(usize, SocketBackend, Vec<usize>)> {
        let ip = self.roster.addrs[self.rank].ip();
        let listener = TcpListener::bind((ip, 0)).map_err(|e| {
            Error::system(format!("binding a listener on {ip} for comm_shrink"), &e)
        })?;
        crate::transport::mesh::widen_backlog(&listener, self.roster.addrs.len());
        let port = listener
            .local_addr()
            .map_err(|e| Error::system("local_addr", &e))?
            .port();
        let links = self.endpoint.links();
        let want = Want {
            exclude,
            failed,
            port,
        };
        let decision = shrink::agree(&links.inbox, &links.spec, want, timeout)?;
        let (new_rank, roster) = decision
            .child(&self.roster, self.rank)
            .ok_or_else(|| Error::internal("a shrink's decision left its own rank out"))?;
        let settings = Settings {
            timeout,
            ..self.settings
        };
        let left_out = (0..self.roster.addrs.len())
            .filter(|r| decision.members.iter().all(|(m, _)| m != r))
            .collect();
        let child = SocketBackend::connect(new_rank, roster, &listener, signal, settings)?;
        Ok((new_rank, child, left_out))
    }
}
