//! The progress loop of an exchange (`run`) and how it waits: busy
//! passes, spinning, sleeping on the shared-memory doorbell or in poll(),
//! reading ahead once stalled, and the timeout.

use super::{Gone, Progress, StreamTransport};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{preemption, Dir, Xfer};
use std::io;
use std::time::{Duration, Instant};

/// How long a collective's exchange goes without progress before it reads
/// frames that belong to later calls. Until then it leaves them in the
/// socket: a frame read early costs an allocation and a second copy, and a
/// pipelined chain whose middle ranks read ahead moved most of a 64 MiB
/// broadcast through their inboxes. Matched exchanges (every send meets a
/// receive in the peer's same call) never need to read ahead to finish;
/// after the stall it is read all the same, so a program whose calls do not
/// match up (or a peer's failure report behind data) still gets through.
pub(super) const READ_AHEAD_AFTER: Duration = Duration::from_millis(1);

/// Exchanges that receive at least this much through sockets measure how
/// fast the sockets delivered it; the next one skips spinning when it
/// would take longer than `SPIN_PAYS_WITHIN` spin windows at that rate.
const RATE_MIN_BYTES: usize = 64 << 10;
const SPIN_PAYS_WITHIN: u32 = 4;

impl StreamTransport {
    /// A collective's timeout, naming whom it waited for and the tagged
    /// calls pending on this rank (a deadlock between the two contexts
    /// shows both sides).
    fn timeout_error(&self, p: &Progress) -> Error {
        let waiting = self.waiting_for(p);
        let during = p.desc.map(|d| format!(" in {d}")).unwrap_or_default();
        let tagged: Vec<String> = self.tagged.pending().into_iter().take(8).collect();
        let tagged = match tagged.is_empty() {
            true => String::new(),
            false => format!(
                "; point-to-point calls pending on this rank: {}",
                tagged.join("; ")
            ),
        };
        Error::new(
            ErrorKind::Timeout,
            format!(
                "rank {} timed out after {:.1} s{during} waiting for {}; is that rank alive and making the same calls?{tagged}",
                self.rank,
                self.timeout.as_secs_f64(),
                waiting.join(", ")
            ),
        )
    }

    /// The peers this exchange still waits on.
    fn waited(&self, p: &Progress) -> Vec<usize> {
        (0..self.size)
            .filter(|&peer| {
                !p.recvs[peer].is_empty() || !p.sends[peer].is_empty() || !p.acked[peer].is_empty()
            })
            .collect()
    }

    /// Asks a peer this exchange waits on whether its process runs, once
    /// nothing has moved for a while (see `transport::watch`); one that
    /// does not answer fails the exchange.
    fn watch_silence(&mut self, p: &Progress, idle: Duration) -> Result<()> {
        let Some(links) = self.links.clone() else {
            return Ok(());
        };
        let waited = self.waited(p);
        let during = p.desc.map(|d| format!(" in {d}")).unwrap_or_default();
        match self
            .watch
            .look(&links.spec, &waited, idle, self.moved, &during)
        {
            Some((peer, text)) => Err(self.silent(peer, text)),
            None => Ok(()),
        }
    }

    /// The peers this exchange still waits on, and for what.
    pub(super) fn waiting_for(&self, p: &Progress) -> Vec<String> {
        let mut waiting = Vec::new();
        for peer in 0..self.size {
            let r = p.recvs[peer].len();
            let s = p.sends[peer].len() + p.acked[peer].len();
            if r + s > 0 {
                let what = match (r > 0, s > 0) {
                    (true, true) => "to send and to receive",
                    (true, false) => "to send",
                    _ => "to receive",
                };
                waiting.push(format!("rank {peer} ({what})"));
            }
        }
        waiting
    }

    pub(super) fn run(&mut self, xfers: &mut [Xfer<'_>], p: &mut Progress) -> Result<()> {
        let socket_bytes = self.socket_recv_bytes(xfers);
        if socket_bytes < RATE_MIN_BYTES {
            return self.progress(xfers, p, self.spin);
        }
        // Spinning pays only when the data may come within the window: a
        // chunk over a slow link (1 MiB over 1 Gbit/s is 8 ms) would spin
        // 500 µs of every step away from the other ranks of the host
        // (3 hosts x 2 ranks, 1 Gbit/s, allreduce 64 MiB: 0.140 GB/s
        // spinning at every step, 0.143 sleeping at once).
        let expected = self
            .socket_rate
            .map(|rate| Duration::from_secs_f64(socket_bytes as f64 / rate));
        let spin = match expected {
            Some(t) if t > self.spin * SPIN_PAYS_WITHIN => Duration::ZERO,
            _ => self.spin,
        };
        let started = Instant::now();
        let result = self.progress(xfers, p, spin);
        if result.is_ok() {
            let took = started.elapsed().as_secs_f64().max(1e-6);
            self.socket_rate = Some(socket_bytes as f64 / took);
        }
        result
    }

    /// Bytes this exchange receives through the kernel (TCP).
    fn socket_recv_bytes(&self, xfers: &mut [Xfer<'_>]) -> usize {
        xfers
            .iter_mut()
            .filter(|x| {
                self.conns[x.peer]
                    .as_ref()
                    .is_some_and(|c| c.chan.caps().through_kernel)
            })
            .filter_map(|x| x.dir.recv_buf().map(|b| b.len()))
            .sum()
    }

    fn progress(&mut self, xfers: &mut [Xfer<'_>], p: &mut Progress, spin: Duration) -> Result<()> {
        // None for a large exchange while other work shares the cores.
        let spin = preemption::spin(spin, self.yield_when_idle, || xfer_bytes(xfers));
        self.check_xfers(xfers)?;
        for (peer, conn) in self.conns.iter().enumerate() {
            if let Some(Some(Gone::Lost(why))) = conn.as_ref().map(|c| &c.gone) {
                return Err(self.lost(peer, &why.clone(), xfers.first().map(|x| x.desc)));
            }
        }
        self.start(xfers, p)?;
        // Clock reads cost as much as a small message: the deadline and the
        // spin are counted from the first check, not before the first pass.
        let mut deadline_at: Option<Instant> = None;
        // First pass: push sends and try the receives we expect.
        for peer in 0..self.size {
            if !p.sends[peer].is_empty() {
                self.pump_sends(peer, xfers, p)?;
            }
            if !p.recvs[peer].is_empty() {
                self.pump_reads(peer, xfers, p)?;
            }
        }
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut peers_of: Vec<usize> = Vec::new();
        let mut last_moved = self.moved;
        let mut idle_since: Option<Instant> = None;
        // When spinning stops. Over sockets only: a fixed window from the
        // first check, since a large message over a slow link moves a
        // little at every pass and would otherwise spin to the end, taking
        // the cores that the other ranks on the host need (3 hosts x 2
        // ranks on 1 Gbit/s links: busbw 0.111 spinning, 0.119 not).
        // Likewise when some peers are on other hosts (the links, not
        // the copies, are the bound there: 4 hosts x 2 ranks, allreduce
        // 64 MiB 0.112 -> 0.129 GB/s). Else `spin` after the last
        // progress: a sleeping reader slows a flowing shared-memory copy.
        let mut spin_until: Option<Instant> = None;
        let mut passes = 0u32;
        let mut nap_ms = 1;
        // Past the spin window, with nothing moving: each wake from a nap
        // looks once, then naps again. (Fifteen busy passes and yields a
        // wake, with a thousand ranks of one host waiting for peers still
        // starting, took the cores those peers needed.)
        let mut napping = false;
        while p.remaining > 0 {
            if !spin.is_zero() && !napping && passes % 16 != 15 {
                // Between the checks below (a clock read each), pure busy
                // passes: a small message's latency is a few of them.
                passes = passes.wrapping_add(1);
                self.busy_pass(xfers, p, false)?;
                if self.yield_when_idle && p.remaining > 0 {
                    // The peer may be waiting for this very core.
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            self.check_departed(p)?;
            // Tagged calls posted meanwhile by other threads, and
            // connections that arrived for them.
            if self.posts.pending() || self.posts.has_deferred() {
                self.take_posts();
            }
            self.tagged.release_waiting_senders();
            if self.tagged.has_copies() {
                self.tagged.run_copies();
            }
            if self.signal.is_aborted() {
                return Err(Error::new(
                    ErrorKind::Aborted,
                    format!("rdist_comm_abort was called on rank {}", self.rank),
                ));
            }
            let now = Instant::now();
            let deadline = *deadline_at.get_or_insert(now + self.timeout);
            if now >= deadline {
                return Err(self.timeout_error(p));
            }
            if !spin.is_zero() {
                // Busy pass: small messages live or die on wake-up latency.
                passes = passes.wrapping_add(1);
                self.busy_pass(xfers, p, passes.is_multiple_of(64))?;
                if p.remaining == 0 {
                    break;
                }
            }
            preemption::looked(now, self.rank, self.yield_when_idle);
            if self.moved != last_moved {
                last_moved = self.moved;
                idle_since = Some(now);
                nap_ms = 1;
                napping = false;
                if !p.sockets_only && !self.mixed {
                    spin_until = Some(now + spin);
                }
            }
            let idle = now.duration_since(*idle_since.get_or_insert(now));
            if idle >= self.read_ahead_after {
                p.read_ahead = true;
            }
            if self.watch.due(idle, self.moved, now) {
                self.watch_silence(p, idle)?;
            }
            if now < *spin_until.get_or_insert(now + spin) {
                if self.yield_when_idle {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            napping = true;
            // Shared memory wakes no descriptor: sleep on its doorbell
            // (also with spinning turned off, RDIST_SPIN_US=0).
            if self.doorbell.is_some() && !p.sockets_only && self.waits_on_memory(p) {
                self.doze(xfers, p, deadline, idle)?;
                continue;
            }
            fds.clear();
            peers_of.clear();
            fds.push(libc::pollfd {
                fd: self.signal.fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            fds.push(libc::pollfd {
                fd: self.posts.bell.fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            // Bytes already read into a channel wake no poll(): no sleep.
            let mut buffered = false;
            for &peer in &self.linked {
                let Some(conn) = &self.conns[peer] else {
                    continue;
                };
                let mut events = 0;
                if conn.gone.is_none() {
                    // Frames nobody asked for yet stay unread (and unpolled).
                    let mid_frame = !conn.between_frames();
                    events |= libc::POLLRDHUP;
                    if mid_frame || p.reads_from(peer) || self.tagged.wants(peer) {
                        events |= libc::POLLIN;
                        buffered |= conn.chan.buffered();
                    }
                    if !p.sends[peer].is_empty()
                        || !conn.acks_out.is_empty()
                        || self.tagged.has_output(peer)
                    {
                        events |= libc::POLLOUT;
                    }
                }
                if events != 0 {
                    fds.push(libc::pollfd {
                        fd: conn.chan.fd(),
                        events,
                        revents: 0,
                    });
                    peers_of.push(peer);
                }
            }
            // Spinning transports sleep in short naps: shared memory has no
            // descriptor that wakes poll() when data arrives.
            let mut wait_ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
            if !spin.is_zero() {
                wait_ms = wait_ms.min(nap_ms);
                nap_ms = (nap_ms * 2).min(8);
            }
            if !p.read_ahead {
                // Wake to allow reading ahead once stalled.
                wait_ms = wait_ms.min(self.read_ahead_after.as_millis().min(1 << 20) as i32 + 1);
            }
            if buffered {
                wait_ms = 0;
            }
            // SAFETY: fds is a live, correctly sized array of pollfd.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::system("poll", &e));
            }
            for k in 2..fds.len() {
                let revents = fds[k].revents;
                let peer = peers_of[k - 2];
                // Bytes already in the channel set no revents: read them too.
                let held = fds[k].events & libc::POLLIN != 0
                    && self.conns[peer].as_ref().is_some_and(|c| c.chan.buffered());
                if revents == 0 && !held {
                    continue;
                }
                if revents & libc::POLLOUT != 0 {
                    self.pump_sends(peer, xfers, p)?;
                }
                let readable = libc::POLLIN | libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
                if held || revents & readable != 0 {
                    self.pump_reads(peer, xfers, p)?;
                }
            }
        }
        Ok(())
    }
}

impl StreamTransport {
    /// Sleeps on the doorbell until a peer moves data (or a short timeout,
    /// after which the caller re-checks abort, peers' deaths and the
    /// deadline). `idle`: how long nothing has moved; the longer, the
    /// longer the nap (a peer's data rings the doorbell whatever the nap).
    fn doze(
        &mut self,
        xfers: &mut [Xfer<'_>],
        p: &mut Progress,
        deadline: Instant,
        idle: Duration,
    ) -> Result<()> {
        let bell = self.doorbell.as_ref().expect("doze needs a doorbell");
        let seen = bell.prepare();
        let before = self.moved;
        // A peer that died rings no doorbell: the pass below looks at each
        // awaited one's liveness socket (spinning looks only now and then,
        // and naps grow long).
        for x in xfers.iter() {
            if let Some(conn) = self.conns[x.peer].as_mut() {
                conn.chan.look_for_departure();
            }
        }
        // Re-check after announcing the sleep: a ring sent just before is
        // either seen here or makes the futex return at once.
        let checked = self.busy_pass(xfers, p, true);
        let bell = self.doorbell.as_ref().expect("doze needs a doorbell");
        if checked.is_err() || p.remaining == 0 || self.moved != before {
            bell.done();
            return checked;
        }
        // Peers over TCP ring no doorbell: with some, nap briefly and
        // look at their sockets again (the pass above reads them all).
        let longest = if self.mixed {
            Duration::from_micros(200)
        } else {
            (idle / 4).clamp(Duration::from_millis(20), Duration::from_millis(100))
        };
        let nap = deadline
            .saturating_duration_since(Instant::now())
            .min(longest);
        bell.sleep(seen, nap);
        Ok(())
    }

    /// Whether some transfer still pending is over shared memory (whose
    /// data wakes the doorbell, not poll()). Once only sockets are left,
    /// the exchange sleeps in poll() until their data comes, instead of
    /// napping on the doorbell and looking at every socket again and again
    /// (a tick of a pipelined schedule over hosts spends most of its time
    /// there).
    fn waits_on_memory(&self, p: &Progress) -> bool {
        self.linked.iter().any(|&peer| {
            let Some(c) = self.conns[peer].as_ref() else {
                return false;
            };
            !c.chan.caps().through_kernel
                && (!p.recvs[peer].is_empty()
                    || !p.sends[peer].is_empty()
                    || !p.acked[peer].is_empty()
                    || !c.acks_out.is_empty())
        })
    }

    /// One pass over every peer: push pending sends, read what is there
    /// (everything when `all`, which is how a silent peer's death shows).
    fn busy_pass(&mut self, xfers: &mut [Xfer<'_>], p: &mut Progress, all: bool) -> Result<()> {
        for i in 0..self.linked.len() {
            let peer = self.linked[i];
            let Some(conn) = &self.conns[peer] else {
                continue;
            };
            if conn.gone.is_some() {
                continue;
            }
            let readable = all || conn.chan.has_data();
            if !p.sends[peer].is_empty()
                || !conn.acks_out.is_empty()
                || self.tagged.has_output(peer)
            {
                self.pump_sends(peer, xfers, p)?;
            }
            if readable {
                self.pump_reads(peer, xfers, p)?;
            }
        }
        Ok(())
    }
}

/// The most bytes one transfer of the exchange moves (what decides whether
/// a wait for it spins while other work shares the cores).
fn xfer_bytes(xfers: &[Xfer<'_>]) -> usize {
    xfers
        .iter()
        .map(|x| match &x.dir {
            Dir::Send(d) => d.len(),
            Dir::Recv(b) | Dir::RecvReduce(b, ..) => b.len(),
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::descriptor::{Desc, OpKind};
    use crate::dtype::DType;
    use crate::options::ShmTuning;
    use crate::transport::channel::{Caps, Channel};
    use crate::transport::shm::{answer, offer, Home};
    use crate::transport::signal::AbortSignal;
    use crate::transport::stream::{Drive, Tuning};
    use crate::transport::tcp::TcpChannel;
    use crate::transport::Transport;
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::os::fd::RawFd;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// `n` transports connected pairwise over loopback TCP.
    pub(in crate::transport::stream) fn tcp_world(n: usize) -> Vec<StreamTransport> {
        let mut chans: Vec<Vec<Option<Box<dyn Channel>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for a in 0..n {
            for b in a + 1..n {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
                let theirs = l.accept().unwrap().0;
                for (rank, peer, s) in [(a, b, ours), (b, a, theirs)] {
                    s.set_nonblocking(true).unwrap();
                    s.set_nodelay(true).unwrap();
                    chans[rank][peer] = Some(Box::new(TcpChannel::of(s)));
                }
            }
        }
        chans
            .into_iter()
            .enumerate()
            .map(|(rank, c)| {
                StreamTransport::new(
                    rank,
                    c,
                    None,
                    Arc::new(AbortSignal::new().unwrap()),
                    tuning(),
                )
                .unwrap()
            })
            .collect()
    }

    /// The tests' tuning: single copy never.
    fn tuning() -> Tuning {
        Tuning {
            timeout: Duration::from_secs(20),
            spin: Duration::from_micros(50),
            peer_check: Duration::ZERO,
            yield_when_idle: true,
            ranks_per_core: 1,
            single_copy_min: usize::MAX,
            two_way_single_copy_min: usize::MAX,
            reduced_single_copy_min: usize::MAX,
            mixed: false,
            tagged_single_copy_min: usize::MAX,
            tagged_read_cost: None,
        }
    }

    /// A channel that counts the bytes it brings in.
    struct Counted(Box<dyn Channel>, Arc<AtomicUsize>);

    impl Counted {
        fn got(&self, n: usize) -> usize {
            self.1.fetch_add(n, Ordering::Relaxed);
            n
        }
    }

    impl Channel for Counted {
        fn caps(&self) -> Caps {
            self.0.caps()
        }
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.0.read(buf).map(|n| self.got(n))
        }
        fn write2(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize> {
            self.0.write2(a, b)
        }
        fn fd(&self) -> RawFd {
            self.0.fd()
        }
        fn has_data(&self) -> bool {
            self.0.has_data()
        }
        fn buffered(&self) -> bool {
            self.0.buffered()
        }
        fn shutdown(&self, how: Shutdown) {
            self.0.shutdown(how)
        }
        fn look_for_departure(&mut self) {
            self.0.look_for_departure()
        }
        fn peer_pid(&self) -> Option<i32> {
            self.0.peer_pid()
        }
        fn write_whole(&mut self, a: &[u8], b: &[u8]) -> bool {
            self.0.write_whole(a, b)
        }
        fn peek_whole(&self) -> Option<&[u8]> {
            self.0.peek_whole()
        }
        fn consume_whole(&mut self, len: usize) {
            self.got(len);
            self.0.consume_whole(len)
        }
        fn read_combine(
            &mut self,
            dst: &mut [u8],
            unit: usize,
            combine: &mut dyn FnMut(&mut [u8], &[u8]),
        ) -> usize {
            let n = self.0.read_combine(dst, unit, combine);
            self.got(n)
        }
    }

    /// Two ranks of this process over shared-memory rings, each counting
    /// what its channel brings in.
    fn shm_world(tuning: Tuning) -> (Vec<StreamTransport>, Vec<Arc<AtomicUsize>>) {
        let shm = ShmTuning {
            membarrier: false,
            single_copy: true,
        };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut dialer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let mut answerer = l.accept().unwrap().0;
        let homes = [0, 1].map(|r| Home::new(r, 2, 2, shm).unwrap());
        let (p1, p0) = std::thread::scope(|sc| {
            let t = sc.spawn(|| answer(Some(&homes[0]), 1, &mut answerer).unwrap());
            let p1 = offer(Some(&homes[1]), 0, &mut dialer).unwrap();
            (p1.unwrap(), t.join().unwrap().unwrap())
        });
        let chans = [
            homes[0].channel(1, p0, answerer),
            homes[1].channel(0, p1, dialer),
        ];
        let counts: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::default()).collect();
        let world = (chans.into_iter().zip(&homes).enumerate())
            .map(|(rank, (chan, home))| {
                let mut c: Vec<Option<Box<dyn Channel>>> = vec![None, None];
                c[1 - rank] = Some(Box::new(Counted(chan, counts[rank].clone())));
                let signal = Arc::new(AbortSignal::new().unwrap());
                StreamTransport::new(rank, c, Some(home.doorbell()), signal, tuning).unwrap()
            })
            .collect();
        (world, counts)
    }

    /// What each rank's channel has brought in so far.
    fn carried(counts: &[Arc<AtomicUsize>]) -> Vec<usize> {
        counts.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }

    /// Both ranks took only a descriptor and its answer off the rings in
    /// an exchange of `n` bytes each way.
    fn both_single_copy(before: &[usize], after: &[usize], n: usize) {
        for r in 0..2 {
            let took = after[r] - before[r];
            assert!(
                took < 4096,
                "rank {r} took {took} bytes off the rings in a two-way exchange of {n}"
            );
        }
    }

    /// A rank that sends while it receives takes single copy from its own
    /// size (each core then copies once instead of both ways through the
    /// rings); a payload sent one way at that size still takes the rings.
    #[test]
    fn a_rank_that_sends_while_it_receives_goes_single_copy_from_its_own_size() {
        let n = 1 << 20;
        let (w, counts) = shm_world(Tuning {
            two_way_single_copy_min: n,
            ..tuning()
        });
        let [mut t0, mut t1]: [StreamTransport; 2] = w.try_into().ok().unwrap();
        let desc = |seq: u64| Desc::new(OpKind::AllGather, seq).data(n, DType::Uint8);
        let mine = [0u8, 1].map(|r| {
            (0..n)
                .map(|i| (i * 7 + r as usize) as u8)
                .collect::<Vec<u8>>()
        });
        let carried = || carried(&counts);
        // One way: through the rings.
        let mut got = vec![0u8; n];
        std::thread::scope(|sc| {
            sc.spawn(|| {
                t0.exchange(&mut [Xfer::send(1, &mine[0], desc(0))])
                    .unwrap()
            });
            t1.exchange(&mut [Xfer::recv(0, &mut got, desc(0))])
                .unwrap();
        });
        assert!(got == mine[0]);
        assert!(
            carried()[1] >= n,
            "one way went single copy: {:?}",
            carried()
        );
        // With a few bytes received alongside (a rooted call's check): the
        // core is free for the rings' second copy.
        let before = carried();
        let mut check = [0u8; 8];
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let mut x = [
                    Xfer::send(1, &mine[0], desc(1)),
                    Xfer::recv(1, &mut check, desc(1)),
                ];
                t0.exchange(&mut x).unwrap()
            });
            let mut x = [
                Xfer::recv(0, &mut got, desc(1)),
                Xfer::send(0, &[7; 8], desc(1)),
            ];
            t1.exchange(&mut x).unwrap();
        });
        assert!(got == mine[0] && check == [7; 8]);
        assert!(
            carried()[1] - before[1] >= n,
            "a send beside a small receive went single copy"
        );
        // Both ways: single copy, a descriptor and its answer on the rings.
        let before = carried();
        let (mut got0, mut got1) = (vec![0u8; n], vec![0u8; n]);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                t0.exchange(&mut [
                    Xfer::send(1, &mine[0], desc(2)),
                    Xfer::recv(1, &mut got0, desc(2)),
                ])
                .unwrap()
            });
            t1.exchange(&mut [
                Xfer::send(0, &mine[1], desc(2)),
                Xfer::recv(0, &mut got1, desc(2)),
            ])
            .unwrap();
        });
        assert!(got0 == mine[1] && got1 == mine[0]);
        let after = carried();
        both_single_copy(&before, &after, n);
    }

    /// A point-to-point send in a group takes single copy one way from
    /// the tagged size (as a tagged send does); a collective's one-way
    /// payload of that size keeps the rings.
    #[test]
    fn a_grouped_send_goes_single_copy_one_way_from_the_tagged_size() {
        let n = 1 << 20;
        let (w, counts) = shm_world(Tuning {
            tagged_single_copy_min: n,
            ..tuning()
        });
        let [mut t0, mut t1]: [StreamTransport; 2] = w.try_into().ok().unwrap();
        let mine: Vec<u8> = (0..n).map(|i| (i * 3 + 1) as u8).collect();
        let carried = || carried(&counts);
        for (seq, kind, single) in [(0, OpKind::Send, true), (1, OpKind::Broadcast, false)] {
            let desc = Desc::new(kind, seq).data(n, DType::Uint8);
            let before = carried();
            let mut got = vec![0u8; n];
            std::thread::scope(|sc| {
                sc.spawn(|| t0.exchange(&mut [Xfer::send(1, &mine, desc)]).unwrap());
                t1.exchange(&mut [Xfer::recv(0, &mut got, desc)]).unwrap();
            });
            assert!(got == mine, "{kind:?} arrived wrong");
            let took = carried()[1] - before[1];
            match single {
                true => assert!(took < 4096, "{kind:?}: {took} bytes off the rings"),
                false => assert!(took >= n, "{kind:?} went single copy"),
            }
        }
    }

    /// A tagged send while this rank has a receive of as much posted (an
    /// exchange) takes single copy from its own size; one sent with no
    /// receive posted takes the rings.
    #[test]
    fn a_tagged_send_while_a_receive_waits_goes_single_copy_from_its_own_size() {
        use crate::call::RawBuf;
        use crate::transport::tagged::{Done, Incoming, Outgoing};
        let n = 1 << 20;
        let (w, counts) = shm_world(Tuning {
            two_way_single_copy_min: n,
            ..tuning()
        });
        let carried = || carried(&counts);
        let mine = [0u8, 1].map(|r| {
            (0..n)
                .map(|i| (i * 5 + r as usize) as u8)
                .collect::<Vec<u8>>()
        });
        let mut got = [vec![0u8; n], vec![0u8; n]];
        // Each rank: its receive (if `recv_first`) and its send posted,
        // then driven until both are done. Round 0: rank 0 sends, rank 1
        // receives, no receive on rank 0. Round 1: both at once.
        let run =
            |t: &mut StreamTransport, me: usize, send: bool, recv: bool, got: &mut Vec<u8>| {
                let peer = 1 - me;
                let mut dones = Vec::new();
                if recv {
                    let r = Incoming {
                        buf: RawBuf::of(got),
                        dtype: DType::Uint8,
                        count: n,
                        peer: Some(peer),
                        tag: Some(3),
                        exact: true,
                    };
                    let d = Arc::new(Done::default());
                    t.tagged.post_recv(r, d.clone(), 1).unwrap();
                    dones.push(d);
                }
                if send {
                    let m = Outgoing {
                        buf: RawBuf::of(&mine[me]),
                        dtype: DType::Uint8,
                        count: n,
                        peer,
                        tag: 3,
                    };
                    let d = Arc::new(Done::default());
                    t.tagged.post_send(m, d.clone(), 2).unwrap();
                    dones.push(d);
                }
                let how = Drive {
                    connect: false,
                    thorough: true,
                    first: None,
                };
                let deadline = Instant::now() + Duration::from_secs(20);
                while !dones.iter().all(|d| d.is_finished()) {
                    assert!(
                        Instant::now() < deadline,
                        "rank {me}: the calls did not finish"
                    );
                    t.drive(None, how);
                    std::thread::yield_now();
                }
                for d in dones {
                    d.get().unwrap().unwrap();
                }
            };
        let [mut t0, mut t1]: [StreamTransport; 2] = w.try_into().ok().unwrap();
        let [g0, g1] = &mut got;
        std::thread::scope(|sc| {
            sc.spawn(|| run(&mut t0, 0, true, false, g0));
            run(&mut t1, 1, false, true, g1);
        });
        assert!(got[1] == mine[0]);
        assert!(
            carried()[1] >= n,
            "a one-way send went single copy: {:?}",
            carried()
        );
        let before = carried();
        let [g0, g1] = &mut got;
        std::thread::scope(|sc| {
            sc.spawn(|| run(&mut t0, 0, true, true, g0));
            run(&mut t1, 1, true, true, g1);
        });
        assert!(got[0] == mine[1] && got[1] == mine[0]);
        let after = carried();
        both_single_copy(&before, &after, n);
    }

    /// Below the single-copy sizes, a tagged buffer sent again and again
    /// goes single copy once its receiver's copy, timed and told in the
    /// answer, beats the rings (`tagged::choice`), and back to the rings
    /// when its sender waited longer than the rings take twice in a row
    /// (its receiver came late; once is taken for noise); where no copy can beat them, it stays on the rings but
    /// for two tries; with no message coming back (one-way traffic), it
    /// is never tried. Every message arrives whole, its bytes changed
    /// between sends or not.
    #[test]
    fn a_tagged_buffer_goes_single_copy_once_its_receivers_copies_beat_the_rings() {
        use crate::call::RawBuf;
        use crate::transport::tagged::{Done, Incoming, Outgoing, ReadCost};
        let n = 256 << 10;
        // Rings of 1 MB/s (262 ms for the message): any copy beats them
        // (tried after 8 sends, and kept), but a receive posted 800 ms
        // late twice in a row does not (the rings for 8 sends, then a try
        // that pays).
        // Rings faster than any copy: the two tries, then the rings.
        let slow_rings = ReadCost {
            pass_mbs: 1,
            fixed_ns: 0,
            max_bytes: n,
        };
        let fast_rings = ReadCost {
            pass_mbs: u32::MAX,
            fixed_ns: 0,
            max_bytes: n,
        };
        // Each send posted, or first offered to the connection at once (as
        // a blocking send is: `send_at_once`).
        let late = [20, 21];
        let slow_paths: Vec<usize> = (8..=21).chain([30, 31]).collect();
        let cases = [
            (slow_rings, true, slow_paths),
            (fast_rings, true, vec![8, 9]),
            (slow_rings, false, vec![]),
        ];
        for ((cost, talk_back, want), at_once) in cases
            .iter()
            .cloned()
            .flat_map(|c| [(c.clone(), false), (c, true)])
        {
            let (w, counts) = shm_world(Tuning {
                tagged_read_cost: Some(cost),
                ..tuning()
            });
            let [mut t0, mut t1]: [StreamTransport; 2] = w.try_into().ok().unwrap();
            let mut mine = vec![0u8; n];
            let mut got = vec![0u8; n];
            let mut single = Vec::new();
            let drive = |t: &mut StreamTransport, d: &Arc<Done>| {
                let deadline = Instant::now() + Duration::from_secs(20);
                while !d.is_finished() {
                    assert!(Instant::now() < deadline, "the call did not finish");
                    let how = Drive {
                        connect: false,
                        thorough: true,
                        first: None,
                    };
                    t.drive(None, how);
                    std::thread::yield_now();
                }
                d.get().unwrap().unwrap();
            };
            for round in 0..32usize {
                // Unchanged for 15 sends, then new bytes before each.
                let fill = if round < 15 { 0 } else { round };
                for (i, b) in mine.iter_mut().enumerate() {
                    *b = (i * 7 + fill) as u8;
                }
                got.fill(0);
                let before = carried(&counts)[1];
                let r = Incoming {
                    buf: RawBuf::of(&got),
                    dtype: DType::Uint8,
                    count: n,
                    peer: Some(0),
                    tag: Some(5),
                    exact: true,
                };
                std::thread::scope(|sc| {
                    sc.spawn(|| {
                        let m = Outgoing {
                            buf: RawBuf::of(&mine),
                            dtype: DType::Uint8,
                            count: n,
                            peer: 1,
                            tag: 5,
                        };
                        let d = Arc::new(Done::default());
                        if !(at_once && t0.send_at_once(m, &d, 2)) {
                            t0.tagged.post_send(m, d.clone(), 2).unwrap();
                        }
                        drive(&mut t0, &d);
                        if talk_back {
                            let mut back = [0u8; 8];
                            let r = Incoming {
                                buf: RawBuf::new(back.as_mut_ptr(), back.len()),
                                dtype: DType::Uint8,
                                count: 8,
                                peer: Some(1),
                                tag: Some(6),
                                exact: true,
                            };
                            let d = Arc::new(Done::default());
                            t0.tagged.post_recv(r, d.clone(), 3).unwrap();
                            drive(&mut t0, &d);
                            assert_eq!(back, [7u8; 8]);
                        }
                    });
                    if late.contains(&round) {
                        std::thread::sleep(Duration::from_millis(800));
                    }
                    let d = Arc::new(Done::default());
                    t1.tagged.post_recv(r, d.clone(), 1).unwrap();
                    drive(&mut t1, &d);
                    if talk_back {
                        let m = Outgoing {
                            buf: RawBuf::of(&[7u8; 8]),
                            dtype: DType::Uint8,
                            count: 8,
                            peer: 0,
                            tag: 6,
                        };
                        let d = Arc::new(Done::default());
                        t1.tagged.post_send(m, d.clone(), 4).unwrap();
                        drive(&mut t1, &d);
                    }
                });
                assert!(got == mine, "round {round}: arrived wrong");
                let took = carried(&counts)[1] - before;
                if took < 4096 {
                    single.push(round);
                } else {
                    assert!(took >= n, "round {round}: {took} bytes off the rings");
                }
            }
            assert_eq!(
                single, want,
                "the rounds that went single copy, rings at {} MB/s, sent at once: {at_once}, \
                 talking back: {talk_back}",
                cost.pass_mbs
            );
        }
    }

    /// Two ranks of one host whose tagged messages all go single copy.
    fn single_copy_pair() -> [StreamTransport; 2] {
        let (w, _) = shm_world(Tuning {
            tagged_single_copy_min: 1,
            ..tuning()
        });
        w.try_into().ok().unwrap()
    }

    /// A pass that reads every connection a call waits on.
    const THOROUGH: Drive = Drive {
        connect: false,
        thorough: true,
        first: None,
    };

    /// A single-copy send withdrawn (its timeout) and its buffer gone:
    /// the receiver's copy fails and it asks for the payload over the
    /// connection (TagCts); the sender sends the copy it kept when it
    /// withdrew, never the caller's memory (unmapped here: reading it
    /// would crash).
    #[test]
    fn a_withdrawn_single_copy_send_asked_for_later_sends_what_it_kept() {
        use crate::call::RawBuf;
        use crate::transport::tagged::{Done, Incoming, Outgoing};
        use std::sync::atomic::AtomicBool;
        let n = 64 << 10;
        let [mut t0, mut t1] = single_copy_pair();
        let how = THOROUGH;
        // SAFETY: a fresh private mapping, unmapped below once withdrawn.
        let mem = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(mem, libc::MAP_FAILED);
        let pattern: Vec<u8> = (0..n).map(|i| (i * 11 + 5) as u8).collect();
        // SAFETY: `mem` holds `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), mem.cast::<u8>(), n) };
        let m = Outgoing {
            buf: RawBuf::new(mem.cast(), n),
            dtype: DType::Uint8,
            count: n,
            peer: 1,
            tag: 9,
        };
        let sent = Arc::new(Done::default());
        t0.tagged.post_send(m, sent.clone(), 2).unwrap();
        for _ in 0..100 {
            t0.drive(None, how);
        }
        assert!(
            !sent.is_finished(),
            "a single-copy send waits for its answer"
        );
        assert_eq!(t0.tagged.withdraw(2, &mut |_| false), None);
        // SAFETY: the send was withdrawn: nothing reads `mem` any more.
        assert_eq!(unsafe { libc::munmap(mem, n) }, 0);
        let mut got = vec![0u8; n];
        let r = Incoming {
            buf: RawBuf::new(got.as_mut_ptr(), n),
            dtype: DType::Uint8,
            count: n,
            peer: Some(0),
            tag: Some(9),
            exact: true,
        };
        let received = Arc::new(Done::default());
        let done = AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    t0.drive(None, how);
                    std::thread::yield_now();
                }
            });
            t1.tagged.post_recv(r, received.clone(), 1).unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            while !received.is_finished() && Instant::now() < deadline {
                t1.drive(None, how);
                std::thread::yield_now();
            }
            done.store(true, Ordering::Relaxed);
        });
        let status = received.get().expect("the receive finished");
        assert_eq!(status.unwrap().count, n);
        assert!(got == pattern, "the kept copy arrived wrong");
    }

    /// A blocking receive that finds a single-copy message next copies it
    /// itself (`recv_whole_now`): a receive it does not fit leaves the
    /// message where it is; the one it fits gets the bytes, and the
    /// sender's answer is written before it returns (the sender finishes
    /// driving alone); a message its sender withdrew while it was copied
    /// fails the receive, naming the sender.
    #[test]
    fn a_blocking_receive_copies_a_single_copy_message_itself_and_answers_at_once() {
        use super::super::RecvNow;
        use crate::call::RawBuf;
        use crate::transport::tagged::{Done, Incoming, Outgoing};
        let n = 64 << 10;
        let [mut t0, mut t1] = single_copy_pair();
        let how = THOROUGH;
        let pattern: Vec<u8> = (0..n).map(|i| (i * 13 + 1) as u8).collect();
        let mut got = vec![0u8; n];
        let receive = |tag: i32, got: &mut Vec<u8>| Incoming {
            buf: RawBuf::new(got.as_mut_ptr(), n),
            dtype: DType::Uint8,
            count: n,
            peer: Some(0),
            tag: Some(tag),
            exact: true,
        };
        // A first message the usual way: rank 1 knows its peer from then
        // on (a receive from a peer never heard of is posted).
        let hello = [1u8; 8];
        let mut heard = [0u8; 8];
        let sent = Arc::new(Done::default());
        let m = Outgoing {
            buf: RawBuf::of(&hello),
            dtype: DType::Uint8,
            count: 8,
            peer: 1,
            tag: 1,
        };
        t0.tagged.post_send(m, sent.clone(), 1).unwrap();
        let r = Incoming {
            buf: RawBuf::new(heard.as_mut_ptr(), 8),
            dtype: DType::Uint8,
            count: 8,
            peer: Some(0),
            tag: Some(1),
            exact: true,
        };
        let received = Arc::new(Done::default());
        t1.tagged.post_recv(r, received.clone(), 1).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(sent.is_finished() && received.is_finished()) {
            assert!(
                Instant::now() < deadline,
                "the first message did not arrive"
            );
            t0.drive(None, how);
            t1.drive(None, how);
        }
        assert_eq!(heard, hello);
        for (id, withdrawn) in [(2, false), (3, true)] {
            let m = Outgoing {
                buf: RawBuf::of(&pattern),
                dtype: DType::Uint8,
                count: n,
                peer: 1,
                tag: 9,
            };
            let sent = Arc::new(Done::default());
            t0.tagged.post_send(m, sent.clone(), id).unwrap();
            for _ in 0..100 {
                t0.drive(None, how);
            }
            assert!(
                !sent.is_finished(),
                "a single-copy send waits for its answer"
            );
            if withdrawn {
                assert_eq!(t0.tagged.withdraw(id, &mut |_| false), None);
            }
            got.fill(0);
            let misfit = receive(8, &mut got);
            assert!(matches!(t1.recv_whole_now(&misfit), RecvNow::Post));
            assert!(got.iter().all(|b| *b == 0), "a misfit touched nothing");
            let r = receive(9, &mut got);
            let RecvNow::Taken(result) = t1.recv_whole_now(&r) else {
                panic!("the single-copy message was not taken");
            };
            if withdrawn {
                let e = result.expect_err("withdrawn while copied");
                assert!(e.message().contains("rank 0 withdrew"), "{e}");
                continue;
            }
            assert_eq!(result.unwrap().count, n);
            assert!(got == pattern, "the copy arrived wrong");
            for _ in 0..100 {
                t0.drive(None, how);
            }
            assert!(sent.is_finished(), "the answer was not written at once");
            sent.get().unwrap().unwrap();
        }
    }

    /// Rank 0 sends two broadcast frames to rank 1 at once; rank 1's first
    /// call also waits for rank 2, who sends after `delay`. Returns in how
    /// many of `rounds` rounds rank 1 had read the second frame ahead into
    /// its inbox by the end of its first call (every frame is checked).
    fn read_ahead_rounds(rounds: u64, delay: Duration, read_ahead_after: Duration) -> u64 {
        let mut w = tcp_world(3).into_iter();
        let (mut t0, mut t1, mut t2) = (w.next().unwrap(), w.next().unwrap(), w.next().unwrap());
        t1.read_ahead_after = read_ahead_after;
        let desc = |seq: u64| Desc::new(OpKind::Broadcast, seq).data(100, DType::Uint8);
        let sender = std::thread::spawn(move || {
            for r in 0..rounds {
                for seq in [2 * r, 2 * r + 1] {
                    let data = [seq as u8; 100];
                    t0.exchange(&mut [Xfer::send(1, &data, desc(seq))]).unwrap();
                }
                t0.exchange(&mut [Xfer::send(1, &[], desc(1000 + r))])
                    .unwrap();
            }
        });
        let late = std::thread::spawn(move || {
            for r in 0..rounds {
                std::thread::sleep(delay);
                t2.exchange(&mut [Xfer::send(1, &[7; 100], desc(2 * r))])
                    .unwrap();
                t2.exchange(&mut [Xfer::send(1, &[], desc(1000 + r))])
                    .unwrap();
            }
        });
        let mut read_ahead = 0;
        for r in 0..rounds {
            let (mut a, mut b) = ([0u8; 100], [0u8; 100]);
            let d = desc(2 * r);
            t1.exchange(&mut [Xfer::recv(0, &mut a, d), Xfer::recv(2, &mut b, d)])
                .unwrap();
            assert!(a == [2 * r as u8; 100] && b == [7; 100]);
            read_ahead += u64::from(!t1.conns[0].as_ref().unwrap().inbox.is_empty());
            t1.exchange(&mut [Xfer::recv(0, &mut a, desc(2 * r + 1))])
                .unwrap();
            assert_eq!(a, [2 * r as u8 + 1; 100]);
            // Both senders wait here, so the next round starts afresh.
            let d = desc(1000 + r);
            t1.exchange(&mut [Xfer::recv(0, &mut [], d), Xfer::recv(2, &mut [], d)])
                .unwrap();
        }
        sender.join().unwrap();
        late.join().unwrap();
        read_ahead
    }

    /// While a collective's exchange makes progress (here: never counted
    /// as stalled), the next call's frames stay unread (in the socket, or
    /// in the channel's buffer).
    #[test]
    fn collectives_leave_the_next_calls_frames_unread() {
        let rounds = 20;
        let n = read_ahead_rounds(rounds, Duration::from_micros(200), Duration::from_secs(60));
        assert_eq!(n, 0, "read ahead in {n} of {rounds} rounds");
    }

    /// A stalled exchange reads them after `read_ahead_after` (so a failure
    /// report queued behind them still gets through), and the frame read
    /// early still reaches its call.
    #[test]
    fn stalled_collectives_read_ahead() {
        let n = read_ahead_rounds(2, Duration::from_millis(200), Duration::from_millis(1));
        assert_eq!(n, 2, "read ahead in {n} of 2 stalled rounds");
    }

    /// CPU time this thread has used.
    fn thread_cpu() -> Duration {
        // SAFETY: a zeroed rusage for the kernel to fill.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: RUSAGE_THREAD with a live rusage.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) }, 0);
        let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        Duration::from_micros(us(ru.ru_utime) + us(ru.ru_stime))
    }

    /// Without spinning, an exchange stalled on one peer sleeps, and reads
    /// ahead the frames another peer's channel already holds in its buffer
    /// (they wake no poll(): a wait that only looked at revents saw none
    /// and polled with no timeout until the late peer came, using a core).
    #[test]
    fn a_stalled_exchange_without_spinning_sleeps_and_reads_ahead() {
        let mut w = tcp_world(3).into_iter();
        let (mut t0, mut t1, mut t2) = (w.next().unwrap(), w.next().unwrap(), w.next().unwrap());
        t1.read_ahead_after = Duration::from_millis(1);
        t1.spin = Duration::ZERO;
        let desc = |seq: u64| Desc::new(OpKind::Broadcast, seq).data(100, DType::Uint8);
        let (go, gone) = std::sync::mpsc::channel::<()>();
        let rank0 = std::thread::spawn(move || {
            for seq in [0u64, 1] {
                t0.exchange(&mut [Xfer::send(1, &[seq as u8; 100], desc(seq))])
                    .unwrap();
            }
            // Kept open until rank 1 is done.
            let _ = gone.recv();
        });
        let rank2 = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            t2.exchange(&mut [Xfer::send(1, &[7; 100], desc(0))])
                .unwrap();
        });
        // Both of rank 0's frames are there: one read takes them both.
        std::thread::sleep(Duration::from_millis(50));
        let before = thread_cpu();
        let (mut a, mut b) = ([0u8; 100], [0u8; 100]);
        t1.exchange(&mut [
            Xfer::recv(0, &mut a, desc(0)),
            Xfer::recv(2, &mut b, desc(0)),
        ])
        .unwrap();
        let cpu = thread_cpu() - before;
        assert!(a == [0u8; 100] && b == [7u8; 100]);
        let read_ahead = !t1.conns[0].as_ref().unwrap().inbox.is_empty();
        t1.exchange(&mut [Xfer::recv(0, &mut a, desc(1))]).unwrap();
        assert_eq!(a, [1u8; 100]);
        go.send(()).unwrap();
        rank0.join().unwrap();
        rank2.join().unwrap();
        assert!(read_ahead, "rank 0's second frame was not read ahead");
        assert!(
            cpu < Duration::from_millis(100),
            "rank 1 used {cpu:?} of CPU waiting 250 ms"
        );
    }

    /// A tagged message's announcement (request to send) that came in one
    /// read with a collective's frame, and waits in the channel's buffer,
    /// is answered while a later collective waits without spinning: the
    /// collective depends on it (rank 2 sends only once rank 0's tagged
    /// send is through).
    #[test]
    fn a_tagged_message_held_in_the_channel_moves_while_a_collective_sleeps() {
        use crate::call::RawBuf;
        use crate::transport::frame::EAGER_MAX;
        use crate::transport::tagged::{Done, Incoming, Outgoing};
        let n = EAGER_MAX + 8;
        let mut w = tcp_world(3).into_iter();
        let (mut t0, mut t1, mut t2) = (w.next().unwrap(), w.next().unwrap(), w.next().unwrap());
        t1.spin = Duration::ZERO;
        t1.timeout = Duration::from_secs(5);
        let desc = |seq: u64| Desc::new(OpKind::Broadcast, seq).data(100, DType::Uint8);
        let rank0 = std::thread::spawn(move || {
            t0.exchange(&mut [Xfer::send(1, &[1u8; 100], desc(0))])
                .unwrap();
            let mine = vec![5u8; n];
            let m = Outgoing {
                buf: RawBuf::of(&mine),
                dtype: DType::Uint8,
                count: n,
                peer: 1,
                tag: 3,
            };
            let done = Arc::new(Done::default());
            t0.tagged.post_send(m, done.clone(), 2).unwrap();
            let deadline = Instant::now() + Duration::from_secs(8);
            while !done.is_finished() && Instant::now() < deadline {
                let thorough = Drive {
                    connect: false,
                    thorough: true,
                    first: None,
                };
                t0.drive(None, thorough);
                std::thread::sleep(Duration::from_micros(200));
            }
            assert!(done.is_finished(), "rank 0's tagged send never went");
            t0.exchange(&mut [Xfer::send(2, &[2u8; 100], desc(1))])
                .unwrap();
        });
        let rank2 = std::thread::spawn(move || {
            let mut a = [0u8; 100];
            t2.exchange(&mut [Xfer::recv(0, &mut a, desc(1))]).unwrap();
            t2.exchange(&mut [Xfer::send(1, &[7u8; 100], desc(2))])
                .unwrap();
        });
        // Rank 0's frame and its tagged announcement are both there.
        std::thread::sleep(Duration::from_millis(100));
        let mut a = [0u8; 100];
        t1.exchange(&mut [Xfer::recv(0, &mut a, desc(0))]).unwrap();
        assert_eq!(a, [1u8; 100]);
        let mut got = vec![0u8; n];
        let r = Incoming {
            buf: RawBuf::new(got.as_mut_ptr(), got.len()),
            dtype: DType::Uint8,
            count: n,
            peer: Some(0),
            tag: Some(3),
            exact: true,
        };
        let done = Arc::new(Done::default());
        t1.tagged.post_recv(r, done.clone(), 1).unwrap();
        let res = t1.exchange(&mut [Xfer::recv(2, &mut a, desc(2))]);
        rank0.join().unwrap();
        rank2.join().unwrap();
        res.unwrap();
        assert_eq!(a, [7u8; 100]);
        assert!(done.is_finished() && got == vec![5u8; n]);
    }

    /// A receive-and-reduce of a partial element is refused (its leftover
    /// bytes would be combined into the next frame), not run.
    #[test]
    fn a_reduce_of_a_partial_element_is_an_error() {
        let mut w = tcp_world(2).into_iter();
        let (mut t0, mut t1) = (w.next().unwrap(), w.next().unwrap());
        let desc = Desc::new(OpKind::Reduce, 0).data(1, DType::Int32);
        let sender = std::thread::spawn(move || {
            let _ = t0.exchange(&mut [Xfer::send(1, &[1u8; 6], desc)]);
        });
        let mut buf = [0u8; 6];
        let e = t1
            .exchange(&mut [Xfer::recv_reduce(
                0,
                &mut buf,
                DType::Int32,
                crate::reduce::ReduceOp::Sum,
                desc,
            )])
            .unwrap_err();
        assert!(e.message().contains("not whole int32 elements"), "{e}");
        sender.join().unwrap();
    }

    /// A socket's reader in the kernel's interactive mode, whose
    /// acknowledgements wait to ride on a reply (see `Channel::expect_bulk`).
    fn acks_wait_for_a_reply(t: &StreamTransport, peer: usize) -> bool {
        let fd = t.conns[peer].as_ref().unwrap().chan.fd();
        !crate::transport::tcp::quick_acks(fd).unwrap()
    }

    /// A large payload read over a connection that also carries replies
    /// leaves it acknowledging at once: the sender's buffer frees as the
    /// reader goes, instead of when its reply is written. The kernel's
    /// mode is its own state, moved by timers and by when segments leave:
    /// about one run in twenty, beside the other tests, it reads
    /// interactive again at the end. Up to three tries; a reader that
    /// never asks fails them all.
    #[test]
    fn a_large_payload_is_read_with_quick_acknowledgements() {
        let mut outcomes = Vec::new();
        for _ in 0..3 {
            match large_payload_then_quick_acks() {
                Ok(true) => return,
                Ok(false) => outcomes.push("interactive after the payload"),
                Err(why) => outcomes.push(why),
            }
        }
        panic!(
            "the reader of a large payload left its acknowledgements waiting for a reply: {outcomes:?}"
        );
    }

    /// One try: Ok(whether the socket acknowledges at once after the
    /// payload), Err when the connection never became interactive.
    fn large_payload_then_quick_acks() -> std::result::Result<bool, &'static str> {
        let mut w = tcp_world(2).into_iter();
        let (mut t0, mut t1) = (w.next().unwrap(), w.next().unwrap());
        let desc = |seq: u64, n: usize| Desc::new(OpKind::Broadcast, seq).data(n, DType::Uint8);
        let big = 1 << 20;
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let sender = std::thread::spawn(move || {
            for seq in 0..3 {
                t0.exchange(&mut [Xfer::send(1, &[seq as u8; 8], desc(seq, 8))])
                    .unwrap();
                let mut back = [0u8; 8];
                t0.exchange(&mut [Xfer::recv(1, &mut back, desc(seq, 8))])
                    .unwrap();
            }
            // Sent whatever the reader found: it waits for this payload.
            let _ = go_rx.recv();
            t0.exchange(&mut [Xfer::send(1, &vec![9u8; big], desc(3, big))])
                .unwrap();
        });
        // Small messages both ways: the kernel takes the connection for an
        // interactive one.
        for seq in 0..3 {
            let mut got = [0u8; 8];
            t1.exchange(&mut [Xfer::recv(0, &mut got, desc(seq, 8))])
                .unwrap();
            t1.exchange(&mut [Xfer::send(0, &got, desc(seq, 8))])
                .unwrap();
        }
        let interactive = acks_wait_for_a_reply(&t1, 0);
        go_tx.send(()).unwrap();
        let mut got = vec![0u8; big];
        t1.exchange(&mut [Xfer::recv(0, &mut got, desc(3, big))])
            .unwrap();
        assert!(got.iter().all(|&b| b == 9));
        let quick = !acks_wait_for_a_reply(&t1, 0);
        sender.join().unwrap();
        match interactive {
            true => Ok(quick),
            false => Err("no interactive mode to leave"),
        }
    }
}
