//! `Comm`: a communicator's life. Creation (rendezvous, then the engine
//! that connects every rank), rank/size, split, shrink, abort and destroy. Its
//! calls run through `queue` (issue order, non-blocking calls, held
//! sends/receives) on the backends' engine; `group` batches them.

mod fork;
pub mod group;
mod progress;
pub(crate) mod queue;
mod typed;

use crate::backend::cuda::Stream;
use crate::backend::engine::{Engine, EngineSpec};
use crate::call::{Call, Data, RawBuf};
use crate::error::{Error, Result};
use crate::log;
use crate::options::{self, Backend, Options};
use crate::rendezvous::store::StoreLease;
use crate::rendezvous::{self, method, unique_id::UniqueId, Meeting};
use crate::transport::tagged::{Incoming, Outgoing, Status};
pub(crate) use fork::Birth;
pub use queue::Request;
use queue::Runner;
use std::sync::Arc;

/// A communicator: a group of ranks that run collectives together.
pub struct Comm {
    runner: Arc<Runner>,
    rank: usize,
    size: usize,
    local_rank: usize,
    /// The rendezvous store this rank hosts, if any (leased by the comm).
    _server: Option<StoreLease>,
    /// The process that made it (calls from a fork() of it are refused).
    birth: Birth,
}

impl Comm {
    /// torch.distributed-style creation: `init_method` is `env://`,
    /// `tcp://HOST:PORT` or `file:///path`; rank/size -1 read the
    /// environment. Blocks until all ranks joined or the timeout passed.
    pub fn init(init_method: &str, rank: i64, size: i64, opts: &Options) -> Result<Comm> {
        let opts = opts.with_env()?;
        let env = options::process_env;
        let (rank, size) = method::rank_and_size(rank, size, &env)?;
        let meeting = Meeting::Method(method::parse(init_method, &env)?);
        Comm::create(&meeting, rank, size, &opts)
    }

    /// NCCL-style creation from a unique id made by `Comm::unique_id`.
    pub fn init_rank(
        id: &[u8; rendezvous::unique_id::UNIQUE_ID_BYTES],
        rank: i64,
        size: i64,
        opts: &Options,
    ) -> Result<Comm> {
        let opts = opts.with_env()?;
        if size < 1 || size > i32::MAX as i64 {
            return Err(Error::invalid_argument(format!(
                "world size {size} must be at least 1"
            )));
        }
        let rank = crate::call::check_rank("rank", rank, size as usize)?;
        let id = UniqueId::from_bytes(id)?;
        Comm::create(&Meeting::UniqueId(id), rank, size as usize, &opts)
    }

    /// Creates a unique id and hosts its rendezvous in this process (in a
    /// background thread, until every rank joined or the timeout).
    pub fn unique_id() -> Result<[u8; rendezvous::unique_id::UNIQUE_ID_BYTES]> {
        let opts = Options::default().with_env()?;
        let token = opts.auth_token.as_deref().map(crate::auth::Token::new);
        let id = rendezvous::unique_id::create(opts.ifname.as_deref(), opts.timeout, token)?;
        Ok(id.to_bytes())
    }

    fn create(meeting: &Meeting, rank: usize, size: usize, opts: &Options) -> Result<Comm> {
        log::raise_level(opts.debug);
        let offers_nccl = crate::backend::nccl::may_run(opts);
        let mut joined = rendezvous::join(meeting, rank, size, opts, offers_nccl, &mut || {
            crate::backend::prepare()
        })?;
        let engine = Engine::connect(EngineSpec {
            rank,
            roster: joined.roster.clone(),
            listener: &joined.listener,
            local_rank: joined.local_rank,
            options: opts,
            nobody_has_nccl: !joined.some_rank_offers_nccl,
        })
        .map_err(|e| joined.failed(e))?;
        let release = joined.all_ready()?;
        let local_rank = joined.local_rank;
        let store = joined.lasting_store();
        let places = joined.roster.clone();
        let comm = Comm::with_engine(rank, size, local_rank, opts.timeout, engine, joined.server);
        if let Some(store) = store {
            comm.runner.record_to(store, size, places);
        }
        // The host's other ranks go on now (this rank is their host's
        // first), after this one is done.
        drop(release);
        Ok(comm)
    }

    fn with_engine(
        rank: usize,
        size: usize,
        local_rank: usize,
        timeout: std::time::Duration,
        engine: Engine,
        server: Option<StoreLease>,
    ) -> Comm {
        let birth = Birth::here();
        Comm {
            runner: Runner::new(rank, timeout, engine, birth),
            rank,
            size,
            local_rank,
            _server: server,
            birth,
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The backend this communicator runs on (fixed when it is made: a
    /// query that waits for no call, in a fork() child too).
    pub fn backend(&self) -> Backend {
        match self.runner.has_nccl() {
            true => Backend::Nccl,
            false => Backend::Socket,
        }
    }

    /// Refuses use from a process forked from the one that made this
    /// communicator (the C API refuses every call there), saying why.
    pub fn check_process(&self) -> Result<()> {
        self.birth.check()
    }

    /// Runs a call now (or queues it in the current group).
    ///
    /// # Safety
    /// The call's buffers must stay valid until it completes (for a call
    /// inside a group: until the group ends).
    pub unsafe fn run(&self, call: Call) -> Result<()> {
        self.run_on(call, Stream::DEFAULT)
    }

    /// `run` with the caller's CUDA stream for device buffers (ignored for
    /// host buffers): device work is enqueued on `stream` and this returns
    /// once it is, as NCCL does.
    ///
    /// # Safety
    /// As `run`; device buffers valid until the work on `stream` is done.
    pub unsafe fn run_on(&self, call: Call, stream: Stream) -> Result<()> {
        self.birth.check()?;
        if group::active() {
            group::enqueue(self.runner.clone(), call, stream);
            return Ok(());
        }
        self.runner.run_one(call, stream)
    }

    /// A plain send or receive (`rdist_send`, `rdist_recv`): `run_on`,
    /// with host memory outside a group handed straight to the
    /// point-to-point context (no dispatch on the way: a small send is a
    /// few hundred nanoseconds in all).
    ///
    /// # Safety
    /// As `run_on`.
    #[inline]
    pub unsafe fn run_p2p(&self, call: Call, stream: Stream) -> Result<()> {
        self.birth.check()?;
        let host = |buf: &RawBuf| crate::backend::cuda::is_host(buf.addr(), buf.len());
        if !group::active() {
            match call {
                Call::Send { buf, data, peer } if host(&buf) => {
                    let msg = Outgoing {
                        buf,
                        dtype: data.dtype,
                        count: data.count,
                        peer,
                        tag: 0,
                    };
                    return self.runner.send_blocking(msg).map(|_| ());
                }
                Call::Recv { buf, data, peer } if host(&buf) => {
                    let r = Incoming {
                        exact: true,
                        ..incoming(buf, data, Some(peer), Some(0))
                    };
                    return self.runner.run_recv(r).map(|_| ());
                }
                _ => {}
            }
        }
        self.run_on(call, stream)
    }

    /// Starts a call on the communicator's worker and returns at once.
    ///
    /// # Safety
    /// The call's buffers must stay valid and untouched until the request
    /// completes.
    pub unsafe fn submit(&self, call: Call) -> Result<Request> {
        self.birth.check()?;
        if group::active() {
            return Err(Error::invalid_usage(
                "non-blocking calls cannot be made inside rdist_group_start/end (use the blocking calls there)",
            ));
        }
        if call.is_p2p() {
            if self.runner.is_tagged_host(&call) {
                return self.runner.post(&call, None, false);
            }
            return Ok(self.runner.hold(call));
        }
        self.runner.submit(vec![call], None)
    }

    /// Sends `data.count` elements of `buf` to `peer` with `tag` (>= 0), in
    /// the point-to-point context; returns when buf may be reused.
    /// `stream` is for device buffers (tag 0 only: NCCL has no tags).
    ///
    /// # Safety
    /// `buf` valid for reads until this returns (inside a group: until
    /// the group ends).
    pub unsafe fn send_message(
        &self,
        buf: RawBuf,
        data: Data,
        peer: usize,
        tag: i32,
        stream: Stream,
    ) -> Result<()> {
        self.birth.check()?;
        check_tag(tag)?;
        let call = Call::Send { buf, data, peer };
        if !self.runner.is_tagged_host(&call) {
            device_tag(tag == 0)?;
            return self.run_on(call, stream);
        }
        if !group::active() {
            return self.runner.run_tagged(&call, Some(tag)).map(|_| ());
        }
        let req = self.runner.post(&call, Some(tag), false)?;
        group::wait_at_end(req);
        Ok(())
    }

    /// Non-blocking `send_message`.
    ///
    /// # Safety
    /// `buf` valid for reads until the request completes.
    pub unsafe fn isend_message(
        &self,
        buf: RawBuf,
        data: Data,
        peer: usize,
        tag: i32,
    ) -> Result<Request> {
        self.birth.check()?;
        check_tag(tag)?;
        if !crate::backend::cuda::is_host(buf.addr(), buf.len()) {
            device_tag(tag == 0)?;
            return self.submit(Call::Send { buf, data, peer });
        }
        if group::active() {
            return Err(group_refuses());
        }
        let msg = Outgoing {
            buf,
            dtype: data.dtype,
            count: data.count,
            peer,
            tag,
        };
        self.runner.post_send(msg, false)
    }

    /// Receives into `buf` (room for `data.count` elements) the oldest
    /// message from `peer` (None: any rank) with `tag` (None: any tag),
    /// and says who sent what. Inside a group it returns None at once and
    /// the receive completes when the group ends.
    ///
    /// # Safety
    /// `buf` valid for writes until this returns (inside a group: until
    /// the group ends).
    pub unsafe fn recv_message(
        &self,
        buf: RawBuf,
        data: Data,
        peer: Option<usize>,
        tag: Option<i32>,
        stream: Stream,
    ) -> Result<Option<Status>> {
        self.birth.check()?;
        if let Some(call) = self.device_recv(buf, data, peer, tag)? {
            self.run_on(call, stream)?;
            return Ok((!group::active()).then_some(Status {
                source: peer.unwrap_or(0),
                tag: 0,
                count: data.count,
            }));
        }
        let r = incoming(buf, data, peer, tag);
        if !group::active() {
            return self.runner.run_recv(r).map(Some);
        }
        let req = self.runner.post_recv(r, false)?;
        group::wait_at_end(req);
        Ok(None)
    }

    /// Non-blocking `recv_message`; the request's `status()` says who sent
    /// what once it completed.
    ///
    /// # Safety
    /// `buf` valid for writes, and untouched, until the request completes.
    pub unsafe fn irecv_message(
        &self,
        buf: RawBuf,
        data: Data,
        peer: Option<usize>,
        tag: Option<i32>,
    ) -> Result<Request> {
        self.irecv_posted(incoming(buf, data, peer, tag))
    }

    /// Non-blocking plain receive (rdist_irecv): tag 0, from `peer`, of
    /// exactly `data.count` elements.
    ///
    /// # Safety
    /// `buf` valid for writes, and untouched, until the request completes.
    pub unsafe fn irecv_exact(&self, buf: RawBuf, data: Data, peer: usize) -> Result<Request> {
        self.irecv_posted(Incoming {
            exact: true,
            ..incoming(buf, data, Some(peer), Some(0))
        })
    }

    /// Posts receive `r`: in the point-to-point context on host memory,
    /// held as a plain receive on device memory.
    ///
    /// # Safety
    /// As `irecv_message`.
    unsafe fn irecv_posted(&self, r: Incoming) -> Result<Request> {
        self.birth.check()?;
        let data = Data {
            count: r.count,
            dtype: r.dtype,
        };
        if let Some(call) = self.device_recv(r.buf, data, r.peer, r.tag)? {
            return self.submit(call);
        }
        if group::active() {
            return Err(group_refuses());
        }
        self.runner.post_recv(r, false)
    }

    /// The plain receive a tagged one on device memory becomes (None for
    /// host memory, which the point-to-point context takes).
    fn device_recv(
        &self,
        buf: RawBuf,
        data: Data,
        peer: Option<usize>,
        tag: Option<i32>,
    ) -> Result<Option<Call>> {
        if let Some(t) = tag {
            check_tag(t)?;
        }
        if crate::backend::cuda::is_host(buf.addr(), buf.len()) {
            return Ok(None);
        }
        let Some(peer) = peer else {
            return Err(Error::invalid_usage(
                "a receive from any rank needs host memory (device buffers go through NCCL, which matches by rank only)",
            ));
        };
        device_tag(tag == Some(0))?;
        Ok(Some(Call::Recv { buf, data, peer }))
    }

    /// Runs an uneven collective (`Call::uneven`) now.
    ///
    /// # Safety
    /// The call's buffers and layout arrays valid until this returns.
    pub unsafe fn run_uneven(&self, call: Call, stream: Stream) -> Result<()> {
        self.birth.check()?;
        if group::active() {
            return Err(Error::invalid_usage(
                "rdist_allgatherv/rdist_alltoallv cannot be queued in a group (call them outside it)",
            ));
        }
        self.runner.run_one(call, stream)
    }

    /// Starts an uneven collective whose layout arrays live in `arrays`
    /// (kept with the request).
    ///
    /// # Safety
    /// The call's buffers valid until the request completes; the call's
    /// layouts point into `arrays`; the request kept (not dropped) until
    /// it completes, since the arrays go with it.
    pub unsafe fn submit_uneven(&self, call: Call, arrays: Box<[usize]>) -> Result<Request> {
        self.birth.check()?;
        if group::active() {
            return Err(Error::invalid_usage(
                "non-blocking calls cannot be made inside rdist_group_start/end (use the blocking calls there)",
            ));
        }
        self.runner.submit_keeping(call, arrays)
    }

    /// Collective: ranks with equal `color` form a new communicator ordered
    /// by (key, rank); a negative color (RDIST_SPLIT_NOCOLOR) yields None.
    pub fn split(&self, color: i32, key: i32) -> Result<Option<Comm>> {
        self.birth.check()?;
        if color < 0 && color != -1 {
            return Err(Error::invalid_argument(format!(
                "color {color} is negative (use RDIST_SPLIT_NOCOLOR, -1, to opt out)"
            )));
        }
        if group::active() {
            return Err(Error::invalid_usage(
                "rdist_comm_split cannot be called inside a group",
            ));
        }
        // Split comes after the queued non-blocking calls.
        self.runner.drain("rdist_comm_split")?;
        let Some((rank, engine)) = self.runner.engine().split(color, key)? else {
            return Ok(None);
        };
        let size = engine.roster().addrs.len();
        let local_rank = engine.roster().local_rank(rank);
        Ok(Some(Comm::with_engine(
            rank,
            size,
            local_rank,
            self.runner.timeout(),
            engine,
            None,
        )))
    }

    /// A new communicator of this one's ranks but `exclude` and those that
    /// failed (NCCL's ncclCommShrink, ULFM's MPIX_Comm_shrink). Every rank
    /// that stays calls it; excluded and failed ranks do not. With an
    /// empty `exclude`, the survivors agree among themselves which ranks
    /// failed, whatever each had noticed, and leave exactly those out.
    /// The new ranks keep the old order. Works on a communicator that
    /// failed or was aborted; this one stays as it was (split, destroy and
    /// abort still work on it). `abort_first` (RDIST_SHRINK_ABORT) aborts
    /// this communicator first, ending its calls in flight here and on
    /// every rank it reaches; otherwise its queued calls finish first.
    /// `opts`: None keeps this communicator's settings; otherwise their
    /// timeout bounds the shrink and the new communicator's calls (the
    /// other settings are this one's).
    pub fn shrink(
        &self,
        exclude: &[usize],
        abort_first: bool,
        opts: Option<&Options>,
    ) -> Result<Comm> {
        self.birth.check()?;
        if group::active() {
            return Err(Error::invalid_usage(
                "rdist_comm_shrink cannot be called inside a group",
            ));
        }
        let mut seen = vec![false; self.size];
        for &r in exclude {
            if r >= self.size {
                return Err(Error::invalid_argument(format!(
                    "exclude_ranks names rank {r}, but the communicator has ranks 0..{}",
                    self.size - 1
                )));
            }
            if r == self.rank {
                return Err(Error::invalid_argument(format!(
                    "rank {r} excludes itself: ranks that leave do not call rdist_comm_shrink"
                )));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(Error::invalid_argument(format!(
                    "exclude_ranks names rank {r} twice"
                )));
            }
        }
        // Checked before anything happens to this communicator.
        let timeout = match opts {
            Some(o) => o.with_env()?.timeout,
            None => self.runner.timeout(),
        };
        if abort_first {
            self.runner.abort();
        }
        // Queued calls end first (at once on a failed communicator).
        self.runner.drain("rdist_comm_shrink")?;
        // The agreement runs without the engine's lock: another thread may
        // abort this communicator meanwhile.
        let shrinker = self.runner.engine().shrinker();
        let shrunk = shrinker.agree(exclude, timeout)?;
        // NCCL's side may be a call on this communicator's NCCL.
        let (rank, engine) = self.runner.engine().shrunk(shrunk)?;
        let size = engine.roster().addrs.len();
        let local_rank = engine.roster().local_rank(rank);
        Ok(Comm::with_engine(
            rank, size, local_rank, timeout, engine, None,
        ))
    }

    /// Makes pending and future calls fail with `Aborted` here and on every
    /// rank that can still be reached. Callable from any thread.
    pub fn abort(&self) {
        if !self.birth.forked() {
            self.runner.abort();
        }
    }

    /// The ranks this rank knows to have failed: those whose connection
    /// broke (they died or left, or their host or the network between failed), in
    /// ascending order. Callable from any thread, also after a call failed.
    pub fn failed_ranks(&self) -> Vec<usize> {
        if self.birth.forked() {
            return Vec::new();
        }
        self.runner.failed_ranks()
    }

    /// A handle that can abort this communicator from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            runner: self.runner.clone(),
            birth: self.birth,
        }
    }
}

fn check_tag(tag: i32) -> Result<()> {
    if tag < 0 {
        return Err(Error::invalid_argument(format!(
            "tag {tag} is negative (tags are 0..{}; RDIST_ANY_TAG only in receives)",
            i32::MAX
        )));
    }
    Ok(())
}

fn device_tag(tag_zero: bool) -> Result<()> {
    if tag_zero {
        return Ok(());
    }
    Err(Error::invalid_usage(
        "tags other than 0, and RDIST_ANY_TAG, need host memory (device buffers go through NCCL, which has no tags)",
    ))
}

fn group_refuses() -> Error {
    Error::invalid_usage(
        "non-blocking calls cannot be made inside rdist_group_start/end (use the blocking calls there)",
    )
}

/// Aborts a communicator from another thread (see `Comm::abort`).
#[derive(Clone)]
pub struct AbortHandle {
    runner: Arc<Runner>,
    birth: Birth,
}

impl AbortHandle {
    pub fn abort(&self) {
        if !self.birth.forked() {
            self.runner.abort();
        }
    }
}

impl Drop for Comm {
    /// Local: finishes queued calls, says goodbye to the peers, closes
    /// every connection and joins every thread.
    fn drop(&mut self) {
        if self.birth.forked() {
            // The connections and segments are the parent's: leave them
            // (and the runner, whose threads exist only there) alone.
            std::mem::forget(Arc::clone(&self.runner));
            return;
        }
        self.runner.close();
    }
}

/// A tagged receive on host memory, as the API describes it (wildcards
/// allowed, a shorter message fits).
fn incoming(buf: RawBuf, data: Data, peer: Option<usize>, tag: Option<i32>) -> Incoming {
    Incoming {
        buf,
        dtype: data.dtype,
        count: data.count,
        peer,
        tag,
        exact: false,
    }
}
