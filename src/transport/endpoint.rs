//! A rank's end of one communicator: the stream core (every connection
//! of the rank, both contexts), the one acceptor (the endpoint's thread,
//! `service`), and the calls of the tagged context. The collectives hold
//! the core for a call (`core`); tagged calls are posted, and then moved
//! by whoever holds the core: the caller waiting for one, the endpoint's
//! thread when nobody waits, or a collective running meanwhile.

use super::link::Links;
use super::media;
use super::medium::{Layout, Wanted};
use super::mesh::MeshSpec;
use super::preemption;
use super::service::{self, Shared};
use super::signal::{AbortSignal, Wake};
use super::stream::{Drive, RecvNow, StreamTransport, Tuning};
use super::tagged::Described;
use super::tagged::{Done, Incoming, Outgoing, Post, Status, Ticket};
use super::watch::Watch;
use crate::error::{Error, ErrorKind, Result};
use crate::options::LogLevel;
use crate::sync::{lock, try_lock};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What an endpoint is made from.
pub struct EndpointSpec {
    pub mesh: MeshSpec,
    pub listener: TcpListener,
    /// Ranks on this rank's host, itself included.
    pub local_ranks: usize,
    pub wanted: Wanted,
    pub tuning: Tuning,
    pub signal: Arc<AbortSignal>,
}

/// A rank's end of one communicator.
pub struct Endpoint {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    spin: Duration,
    yield_when_idle: bool,
    timeout: Duration,
    /// Silence before a wait asks whether its peer runs (see `watch`).
    peer_check: Duration,
}

impl Endpoint {
    /// Opens the media, makes the core (connections come on first use)
    /// and starts the thread that serves the listener.
    pub fn new(spec: EndpointSpec) -> Result<Endpoint> {
        let EndpointSpec {
            mesh,
            listener,
            local_ranks,
            wanted,
            tuning,
            signal,
        } = spec;
        let layout = Layout {
            rank: mesh.rank,
            size: mesh.size,
            local_ranks,
        };
        let (rank, size) = (mesh.rank, mesh.size);
        let links = Arc::new(Links::new(
            mesh,
            media::open(layout, wanted),
            signal.clone(),
        )?);
        let ranks_per_core = tuning.ranks_per_core.max(1);
        let (spin, yield_when_idle, timeout, peer_check) = (
            tuning.spin,
            tuning.yield_when_idle,
            tuning.timeout,
            tuning.peer_check,
        );
        let core = StreamTransport::on_demand(rank, size, links.clone(), signal.clone(), tuning)?;
        let posts = core.posts();
        let shared = Arc::new(Shared {
            rank,
            doorbell: links.doorbell(),
            core: Mutex::new(core),
            posts,
            links,
            wake: Wake::new().map_err(|e| Error::system("eventfd", &e))?,
            drivers: AtomicUsize::new(0),
            ranks_per_core,
            may_sleep_long: AtomicBool::new(true),
            driven_lately: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            hook: Mutex::new(None),
        });
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::system("set_nonblocking", &e))?;
        let for_thread = shared.clone();
        // Always running: it serves the listener, so peers' dials are
        // greeted whatever this rank's callers are doing, and strangers
        // that connect are dropped at their deadline rather than filling
        // the accept backlog a peer's first connection needs.
        let thread = std::thread::Builder::new()
            .name(format!("rdist-ep{rank}"))
            .spawn(move || service::run(&for_thread, listener))
            .map_err(|e| Error::system("starting the endpoint's thread", &e))?;
        Ok(Endpoint {
            shared,
            thread: Mutex::new(Some(thread)),
            spin,
            yield_when_idle,
            timeout,
            peer_check,
        })
    }

    /// The core, for a collective (held until the guard goes), with the
    /// tagged calls posted meanwhile taken in: a deferred receive (see
    /// `Posts`) is then pending, and named, while the collective runs.
    pub fn core(&self) -> MutexGuard<'_, StreamTransport> {
        let mut core = lock(&self.shared.core);
        core.take_posts();
        core
    }

    /// The core when no call holds it (as `core`).
    pub fn try_core(&self) -> Option<MutexGuard<'_, StreamTransport>> {
        let mut core = try_lock(&self.shared.core)?;
        core.take_posts();
        Some(core)
    }

    /// The pairs' connections, and the media they are made on.
    pub fn links(&self) -> &Links {
        &self.shared.links
    }

    /// Has the endpoint's thread run `hook` on every pass (at least every
    /// quarter second).
    pub fn set_hook(&self, hook: Box<dyn FnMut() + Send>) {
        *lock(&self.shared.hook) = Some(hook);
    }

    /// Posts a tagged send; it starts at once when the core is free (a
    /// small message is usually written whole before this returns).
    /// `blocking`: the caller waits for it at once (else the endpoint's
    /// thread is told that a call may need it).
    ///
    /// # Safety
    /// `msg.buf` valid for reads until the ticket completes.
    pub unsafe fn send(&self, msg: Outgoing, blocking: bool) -> Result<Ticket> {
        if msg.tag < 0 {
            return Err(Error::invalid_argument(format!(
                "tag {} is negative (tags are 0..{})",
                msg.tag,
                i32::MAX
            )));
        }
        let ticket = self.ticket(Described::Send(msg));
        let post = Post::Send(msg, Arc::clone(&ticket.done), ticket.id);
        self.post(post, &ticket.done, Some(msg.peer), blocking)?;
        Ok(ticket)
    }

    /// A new call's ticket.
    fn ticket(&self, call: Described) -> Ticket {
        Ticket::new(self.shared.posts.new_id(), call)
    }

    /// Posts a tagged receive; it matches at once if its message already
    /// arrived. `blocking` as for `send`.
    ///
    /// # Safety
    /// `r.buf` valid for writes, and untouched, until the ticket completes.
    pub unsafe fn recv(&self, r: Incoming, blocking: bool) -> Result<Ticket> {
        if let Some(t) = r.tag.filter(|t| *t < 0) {
            return Err(Error::invalid_argument(format!(
                "tag {t} is negative (tags are 0..{}, or RDIST_ANY_TAG)",
                i32::MAX
            )));
        }
        let ticket = self.ticket(Described::Recv(r));
        let mut post = Post::Recv(r, Arc::clone(&ticket.done), ticket.id);
        // A small one from one rank waits for its wait, which receives it
        // as a blocking receive does (`wait`); any other call posts it
        // first, and so does the endpoint's thread when it looks.
        if !blocking && r.peer.is_some() && r.buf.len() <= DEFERRED_MAX {
            match self.shared.posts.defer(post) {
                None => {
                    self.shared.nudge();
                    return Ok(ticket);
                }
                Some(back) => post = back,
            }
        }
        self.post(post, &ticket.done, r.peer, blocking)?;
        Ok(ticket)
    }

    /// A blocking send that is complete on return, with no ticket, when
    /// its message is written whole at once (shared memory, nothing ahead
    /// of it; see `StreamTransport::send_whole_now`). None: the caller
    /// posts it (`send`) and waits, which also reports what is wrong.
    ///
    /// # Safety
    /// `msg.buf` valid for reads until this returns.
    pub unsafe fn send_now(&self, msg: Outgoing) -> Option<Status> {
        if msg.tag < 0 {
            return None;
        }
        let mut core = try_lock(&self.shared.core)?;
        core.take_posts_but_deferred();
        core.send_whole_now(msg)
    }

    /// A blocking receive that takes its message straight from its
    /// peer's connection, with no ticket, when nothing else is pending
    /// here and the message is next there (see
    /// `StreamTransport::recv_whole_now`), looking for it for up to the
    /// spin window. Not taken: when the wait began, for the caller, who
    /// posts it (`recv`) and waits (`wait_since`, bounded from then),
    /// which also sleeps and reports what is wrong.
    ///
    /// # Safety
    /// `r.buf` valid for writes, and untouched, until this returns.
    pub unsafe fn recv_now(&self, r: Incoming) -> std::result::Result<Result<Status>, Instant> {
        if r.tag.is_some_and(|t| t < 0) {
            return Err(Instant::now());
        }
        // SAFETY: as this function's.
        match unsafe { self.look(&r, None) } {
            Look::Taken(result) => Ok(result),
            Look::Post(since) | Look::Posted(since) => Err(since),
        }
    }

    /// `recv_now`'s looks, for a blocking receive (`deferred` None) or for
    /// deferred receive `deferred`, which stays in its slot while it looks
    /// (`Posts::with_deferred`): no receive can be posted ahead of it.
    ///
    /// # Safety
    /// As `recv_now`.
    unsafe fn look(&self, r: &Incoming, deferred: Option<u64>) -> Look {
        let sh = &self.shared;
        let mut began: Option<Instant> = None;
        let mut passes = 0u32;
        let mut registered = false;
        let spin = preemption::spin(self.spin, self.yield_when_idle, || r.buf.len());
        let look = loop {
            if let Some(mut core) = try_lock(&sh.core) {
                let now = match deferred {
                    None => {
                        core.take_posts();
                        core.recv_whole_now(r)
                    }
                    Some(id) => {
                        core.take_posts_but_deferred();
                        let core = &mut *core;
                        let looked = sh.posts.with_deferred(id, || {
                            let now = core.recv_whole_now(r);
                            let leaves = !matches!(now, RecvNow::NotYet);
                            (now, leaves)
                        });
                        match looked {
                            // Posted by another call meanwhile.
                            None => break Look::Posted(began.unwrap_or_else(Instant::now)),
                            // Posted here, ahead of anything else.
                            Some((RecvNow::Post, Some(post))) => {
                                core.tagged.take_post(post);
                                break Look::Posted(began.unwrap_or_else(Instant::now));
                            }
                            Some((now, _)) => now,
                        }
                    }
                };
                match now {
                    RecvNow::Taken(result) => {
                        // An answer a full ring did not take yet (a
                        // single-copy message's TagAck) goes with the
                        // endpoint's thread: its sender waits for it.
                        if r.peer.is_some_and(|p| core.tagged.has_output(p)) {
                            sh.driven_lately.store(true, Ordering::Relaxed);
                            sh.nudge();
                        }
                        break Look::Taken(result.map_err(|e| named_call(&Described::Recv(*r), e)));
                    }
                    RecvNow::Post => break Look::Post(began.unwrap_or_else(Instant::now)),
                    RecvNow::NotYet => {}
                }
            }
            passes = passes.wrapping_add(1);
            if passes == 64 && !registered {
                // A caller spins on: the endpoint's thread keeps out of its
                // way (a message that comes within a few passes pays nothing).
                registered = true;
                sh.drivers.fetch_add(1, Ordering::Relaxed);
            }
            if passes == self.first_clock() || passes.is_multiple_of(64) {
                let now = Instant::now();
                preemption::looked(now, self.shared.rank, self.yield_when_idle);
                let began = *began.get_or_insert(now);
                // Never past the timeout, whatever the spin window.
                if now >= began + spin.min(self.timeout) {
                    break Look::Post(began);
                }
            }
            if self.yield_when_idle {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        };
        if registered {
            sh.drivers.fetch_sub(1, Ordering::Relaxed);
            sh.driven_lately.store(true, Ordering::Relaxed);
        }
        look
    }

    /// Takes a call in: directly when the core is free (and moves it as
    /// far as it goes now), else through the posts, waking the holder.
    /// `done`: its ticket's completion.
    fn post(&self, post: Post, done: &Done, peer: Option<usize>, blocking: bool) -> Result<()> {
        let sh = &self.shared;
        let Some(mut core) = try_lock(&sh.core) else {
            sh.posts.push(post);
            if let Some(bell) = &sh.doorbell {
                bell.ring();
            }
            return Ok(());
        };
        // Earlier posts first: messages of one pair keep their order.
        core.take_posts();
        let sending = matches!(post, Post::Send(..));
        let taken = match post {
            Post::Send(msg, done, id) if core.send_at_once(msg, &done, id) => Ok(()),
            Post::Send(msg, done, id) => core.tagged.post_send(msg, done, id),
            Post::Recv(r, done, id) => core.tagged.post_recv(r, done, id),
        };
        taken?;
        // A send starts moving now; a receive waits for its wait or test
        // (or the endpoint's thread), as MPI's do: a look at its peer here
        // would mostly find nothing, and costs every receive.
        if sending && !done.is_finished() {
            if let Some(p) = peer.filter(|p| *p != sh.rank) {
                core.drive(Some(p), CALLER);
            }
        }
        drop(core);
        // What is left of a call nobody waits for yet moves with the
        // endpoint's thread: rung if it sleeps long (idle), else it looks
        // within its look's interval (see `service::rarer`).
        if !blocking && !done.is_finished() {
            sh.nudge();
        }
        Ok(())
    }

    /// The pass of a spin after which the clock is first read: a reading
    /// costs tens of nanoseconds, about what a message that comes during
    /// it then waits, so a spinning caller skips it for the first few
    /// passes (a message mostly comes within them). One that yields on
    /// every pass may be away for a time slice each: it reads at once.
    #[inline]
    fn first_clock(&self) -> u32 {
        if self.yield_when_idle {
            1
        } else {
            8
        }
    }

    /// Waits for a ticket, bounded by the timeout: drives progress itself
    /// first (no thread hand-off for a message that comes soon), moving
    /// every pending call, not only this one, as MPI's waits do (a peer
    /// may wait on an answer this rank owes it for another call), then
    /// sleeps while the endpoint's thread moves
    /// it. On timeout the call is withdrawn (its buffer is no longer
    /// touched) and the error names it and what else is pending here.
    pub fn wait(&self, t: &Ticket) -> Result<Status> {
        // Complete already (a look on another call's behalf took it): no
        // look at the core, which another call may hold for long.
        if let Some(r) = t.done.get() {
            return r.map_err(|e| named(t, e));
        }
        if let (Described::Recv(r), true) = (&t.call, self.shared.posts.has_deferred()) {
            return self.receive_deferred(t, r).map_err(|e| named(t, e));
        }
        self.wait_for(t, None).map_err(|e| named(t, e))
    }

    /// Waits for receive `t`, deferred (else `wait_for`), as a blocking
    /// receive: straight from its peer's connection when it is next there,
    /// else posted and waited for (bounded from when the look began).
    fn receive_deferred(&self, t: &Ticket, r: &Incoming) -> Result<Status> {
        // SAFETY: the ticket's contract: the buffer stays valid and
        // untouched until it completes.
        match unsafe { self.look(r, Some(t.id)) } {
            Look::Taken(result) => {
                // Claimed, not just written: another thread waiting on the
                // same request may time it out meanwhile (the first result
                // stays).
                t.done.complete(result.clone());
                result
            }
            Look::Post(since) => {
                self.post_deferred();
                self.wait_for(t, Some(since))
            }
            Look::Posted(since) => self.wait_for(t, Some(since)),
        }
    }

    /// Posts the deferred receive, if any (for a caller about to wait or
    /// look by the ticket): into the core when it is free, else into the
    /// queue its holder takes, never out of sight.
    fn post_deferred(&self) {
        let sh = &self.shared;
        if !sh.posts.has_deferred() {
            return;
        }
        match try_lock(&sh.core) {
            Some(mut core) => core.take_posts(),
            None => sh.posts.flush_to_queue(),
        }
    }

    /// `wait` for a call whose wait began at `since` (before it was
    /// posted): bounded by the timeout from then.
    pub fn wait_since(&self, t: &Ticket, since: Instant) -> Result<Status> {
        self.post_deferred();
        self.wait_for(t, Some(since)).map_err(|e| named(t, e))
    }

    fn wait_for(&self, t: &Ticket, since: Option<Instant>) -> Result<Status> {
        if let Some(r) = t.done.get() {
            return r;
        }
        let sh = &self.shared;
        // The clock is first read after a few passes that did not finish
        // the call (`first_clock`), then every 64 passes.
        let mut deadline = since.map(|s| s + self.timeout);
        // A wait that began before its post (a look at the connection)
        // spun from then.
        let spin = preemption::spin(self.spin, self.yield_when_idle, || match &t.call {
            Described::Send(m) => m.buf.len(),
            Described::Recv(r) => r.buf.len(),
        });
        let mut spin_until: Option<Instant> = since.map(|s| s + spin);
        let mut passes = 0u32;
        let mut registered = false;
        while !t.done.is_finished() {
            if let Some(mut core) = try_lock(&sh.core) {
                if core.drive(None, caller_for(t)) {
                    spin_until = None;
                }
            }
            if t.done.is_finished() {
                break;
            }
            passes = passes.wrapping_add(1);
            if passes == 64 && !registered {
                // A caller spins on: the endpoint's thread keeps out of its
                // way (a message that comes within a few passes pays nothing).
                registered = true;
                sh.drivers.fetch_add(1, Ordering::Relaxed);
            }
            if passes == self.first_clock() || passes.is_multiple_of(64) {
                let now = Instant::now();
                preemption::looked(now, self.shared.rank, self.yield_when_idle);
                // Bytes moving for other calls extend the spin, never the
                // call's own bound.
                if now >= *deadline.get_or_insert(now + self.timeout)
                    || now >= *spin_until.get_or_insert(now + spin)
                {
                    break;
                }
            }
            if self.yield_when_idle {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if !t.done.is_finished() {
            if !registered {
                registered = true;
                sh.drivers.fetch_add(1, Ordering::Relaxed);
            }
            let deadline = deadline.unwrap_or_else(|| Instant::now() + self.timeout);
            self.sleep_for(t, deadline);
        }
        if registered {
            sh.drivers.fetch_sub(1, Ordering::Relaxed);
        }
        sh.driven_lately.store(true, Ordering::Relaxed);
        if let Some(r) = t.done.get() {
            return r;
        }
        let mut core = self.core();
        if let Some(r) = t.done.get() {
            return r; // completed just now
        }
        core.withdraw_tagged(t.id);
        let others: Vec<String> = core.tagged_pending().into_iter().take(8).collect();
        drop(core);
        let err = Error::new(
            ErrorKind::Timeout,
            format!(
                "rank {}: {} did not complete within {:.1} s{}",
                sh.rank,
                t.call,
                self.timeout.as_secs_f64(),
                if others.is_empty() {
                    String::new()
                } else {
                    format!("; also pending on this rank: {}", others.join("; "))
                }
            ),
        );
        t.done.complete(Err(err.clone()));
        Err(err)
    }

    /// Past the spin window: sleeps until the ticket completes or the
    /// deadline, still moving the calls itself (no hand-off to the
    /// endpoint's thread, whose naps would add to the wait): on the
    /// doorbell while they wait on shared memory (a peer's write wakes it),
    /// in poll() on their sockets otherwise, in growing naps that look at
    /// the ticket between them. While a collective holds the core, it moves
    /// the calls, and completes this one.
    fn sleep_for(&self, t: &Ticket, deadline: Instant) {
        let sh = &self.shared;
        let mut nap = Duration::from_millis(1);
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut watch = Watch::new(self.peer_check);
        let mut quiet_since = Instant::now();
        let mut moves = 0u64;
        while !t.done.is_finished() {
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                return;
            }
            let idle = now.duration_since(quiet_since);
            if watch.due(idle, moves, now) {
                // A receive from any source waits on every rank not gone
                // (looked up when the core is free: else on a later pass,
                // as the question stays due).
                let waited = match (watch.asking(), t.call.peer()) {
                    (true, _) => Some(Vec::new()),
                    (false, Some(peer)) => Some(vec![peer]),
                    (false, None) => self.try_core().map(|c| c.tagged_others_not_gone()),
                };
                if let Some(waited) = waited {
                    if !watch.asking()
                        && waited.is_empty()
                        && t.call.peer().is_none()
                        && self.nobody_left(t).is_some()
                    {
                        return;
                    }
                    let during = format!(" in {}", t.call);
                    let given_up = watch.look_all(&sh.links.spec, &waited, idle, moves, &during);
                    if !given_up.is_empty() {
                        let mut core = self.core();
                        for (peer, text) in given_up {
                            // Fails this call, and every other with that peer.
                            core.silent(peer, text);
                        }
                        continue;
                    }
                }
            }
            let nap_now = nap.min(left);
            nap = (nap * 2).min(Duration::from_millis(50));
            let Some(mut core) = try_lock(&sh.core) else {
                t.done
                    .sleep_until(Instant::now() + nap_now.min(Duration::from_millis(1)));
                continue;
            };
            match (&sh.doorbell, core.tagged_waits_on_memory()) {
                (Some(bell), true) => {
                    // Announced, then looked at once more: a write after
                    // the look rings the doorbell.
                    let seen = bell.prepare();
                    let moved = core.drive(None, thorough_for(t));
                    // Calls waiting on sockets too ring no doorbell: the
                    // naps stay short then.
                    let sockets = core.tagged_waits_on_sockets();
                    drop(core);
                    if moved {
                        nap = Duration::from_millis(1);
                        quiet_since = Instant::now();
                        moves += 1;
                    } else if !t.done.is_finished() {
                        let short = Duration::from_millis(1);
                        bell.sleep(seen, if sockets { nap_now.min(short) } else { nap_now });
                    }
                }
                _ => {
                    let moved = core.drive(None, thorough_for(t));
                    fds.clear();
                    let buffered = core.tagged_fds(&mut fds);
                    drop(core);
                    if moved {
                        nap = Duration::from_millis(1);
                        quiet_since = Instant::now();
                        moves += 1;
                    }
                    if moved || buffered || t.done.is_finished() {
                        continue;
                    }
                    fds.push(libc::pollfd {
                        fd: sh.posts.bell.fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    let ms = nap_now.as_millis().clamp(1, i32::MAX as u128) as i32;
                    // SAFETY: fds is a live array of pollfd.
                    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
                }
            }
        }
    }

    /// Ends a receive from any source for which no other rank is left
    /// (each failed or gone): nothing can come but a send to self, which
    /// had `peer_check` to come. None where there is no other rank at all,
    /// or the core is busy (tried again on a later pass).
    fn nobody_left(&self, t: &Ticket) -> Option<()> {
        let sh = &self.shared;
        if sh.links.spec.size < 2 {
            return None;
        }
        let mut core = self.try_core()?;
        if t.done.is_finished() {
            return Some(());
        }
        core.withdraw_tagged(t.id);
        drop(core);
        t.done.complete(Err(Error::new(
            ErrorKind::PeerLost,
            format!(
                "rank {}: {} waits for nobody: every other rank is gone (failed or left)",
                sh.rank, t.call
            ),
        )));
        Some(())
    }

    /// The ticket's result once complete; never blocks (it moves what it
    /// can when the core is free, as MPI_Test does).
    pub fn test(&self, t: &Ticket) -> Option<Result<Status>> {
        if let Some(r) = t.done.get() {
            return Some(r.map_err(|e| named(t, e)));
        }
        self.post_deferred();
        if let Some(mut core) = try_lock(&self.shared.core) {
            core.drive(None, caller_for(t));
        }
        t.done.get().map(|r| r.map_err(|e| named(t, e)))
    }

    /// Local: lets posted sends finish (bounded by the timeout, and by
    /// the receivers' liveness: one whose process does not answer after
    /// a silence fails the sends to it), then stops the thread; the core
    /// says goodbye when it goes.
    pub fn close(&self) {
        let sh = &self.shared;
        let deadline = Instant::now() + self.timeout;
        {
            let mut core = self.core();
            core.take_posts();
            core.tagged.set_closing();
        }
        let mut watch = Watch::new(self.peer_check);
        let (mut quiet_since, mut moves, mut told) = (Instant::now(), 0u64, false);
        loop {
            let mut core = self.core();
            if core.drive(None, THOROUGH) {
                quiet_since = Instant::now();
                moves += 1;
            }
            if !core.tagged_sends_in_flight() {
                break;
            }
            let now = Instant::now();
            let idle = now.duration_since(quiet_since);
            // Said after the silence that starts the question, or 3 s
            // where nobody is asked.
            let say_after = match watch.on() {
                true => self.peer_check,
                false => Duration::from_secs(3),
            };
            if !told && idle >= say_after {
                // Once: a destroy that waits is not silent about what for.
                told = true;
                crate::log::emit(
                    LogLevel::Warn,
                    Some(sh.rank),
                    &format!(
                        "rdist_comm_destroy waits for ranks {:?} to receive what this rank sent them (up to {:.1} s, the timeout)",
                        core.tagged_send_peers(),
                        deadline.saturating_duration_since(now).as_secs_f64()
                    ),
                );
            }
            if watch.due(idle, moves, now) {
                let peers = core.tagged_send_peers();
                let during = " in destroy for its sends to finish";
                let given_up = watch.look_all(&sh.links.spec, &peers, idle, moves, during);
                for (peer, text) in &given_up {
                    // Fails the sends to it (and says so to the others);
                    // said here too, as nobody may wait for them.
                    crate::log::emit(
                        LogLevel::Warn,
                        Some(sh.rank),
                        &format!("rdist_comm_destroy: the sends to rank {peer} failed: {text}"),
                    );
                    core.silent(*peer, text.clone());
                }
                if !given_up.is_empty() {
                    continue;
                }
            }
            if Instant::now() >= deadline {
                let e = Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "rank {}: the communicator was destroyed while sends to ranks {:?} were still waiting for their receives, {:.1} s (the timeout)",
                        sh.rank,
                        core.tagged_send_peers(),
                        self.timeout.as_secs_f64()
                    ),
                );
                crate::log::emit(
                    LogLevel::Warn,
                    Some(sh.rank),
                    &format!("rdist_comm_destroy: {e}"),
                );
                core.fail(e, false);
                break;
            }
            drop(core);
            std::thread::sleep(Duration::from_micros(200));
        }
        // A question still on its way has no thread outlive the destroy.
        watch.finish();
        sh.closing.store(true, Ordering::Release);
        sh.wake.ring();
        if let Some(h) = lock(&self.thread).take() {
            let _ = h.join();
        }
        self.core().close();
    }
}

/// What a receive's looks at its peer's connection came to.
enum Look {
    /// Taken, with its result.
    Taken(Result<Status>),
    /// Not taken: to be posted, and waited for from when the look began.
    Post(Instant),
    /// A deferred one posted meanwhile: waited for from when the look began.
    Posted(Instant),
}

/// The largest receive that is deferred (see `Posts`): a small one, whose
/// posting and matching are most of its cost.
const DEFERRED_MAX: usize = crate::transport::shm::WHOLE_PAYLOAD;

/// How a caller moves its calls: it may dial, and reads what has come.
const CALLER: Drive = Drive {
    connect: true,
    thorough: false,
    first: None,
};

/// How a caller about to sleep looks: every connection its calls wait on
/// (how a peer's exit shows on shared memory).
const THOROUGH: Drive = Drive {
    connect: true,
    thorough: true,
    first: None,
};

/// How a caller waiting for `t` moves the calls: `t`'s peer first.
fn caller_for(t: &Ticket) -> Drive {
    Drive {
        first: t.call.peer(),
        ..CALLER
    }
}

/// `THOROUGH`, `t`'s peer first.
fn thorough_for(t: &Ticket) -> Drive {
    Drive {
        first: t.call.peer(),
        ..THOROUGH
    }
}

/// A call's error says which call failed, when it does not already.
fn named(t: &Ticket, e: Error) -> Error {
    named_call(&t.call, e)
}

/// `e`, saying which call failed.
fn named_call(call: &Described, e: Error) -> Error {
    let call = call.to_string();
    match e.message().contains(&call) {
        true => e,
        false => Error::new(e.kind(), format!("{call} failed: {}", e.message())),
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let sh = &self.shared;
        sh.closing.store(true, Ordering::Release);
        sh.wake.ring();
        if let Some(h) = lock(&self.thread).take() {
            let _ = h.join();
        }
    }
}
