//! The endpoint's thread: the one acceptor of a rank's communicator (it
//! greets every connection that peers dial and hands the welcomed ones to
//! `Links::admit`), the tagged calls' progress while no caller waits for
//! them, and the flight recorder's hook. It never dials (peers' threads
//! answer dials, so two threads dialing each other would wait for each
//! other).

use super::doorbell::Doorbell;
use super::greeting::{Greeted, Greeting, HELLO_DEADLINE};
use super::link::Links;
use super::signal::Wake;
use super::stream::{Drive, StreamTransport};
use super::tagged::Posts;
use crate::sync::{lock, try_lock};
use std::io;
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Shared by the endpoint and its thread.
pub(super) struct Shared {
    pub rank: usize,
    pub core: Mutex<StreamTransport>,
    pub posts: Arc<Posts>,
    pub links: Arc<Links>,
    /// This rank's own doorbell, rung to wake a holder of the core that
    /// dozes on it (a tagged call was posted).
    pub doorbell: Option<Doorbell>,
    /// Wakes the endpoint's thread (closing; a call posted while it sleeps
    /// long, see `nudge`).
    pub wake: Wake,
    /// Callers driving progress in their waits right now: the thread
    /// stays out of their way.
    pub drivers: AtomicUsize,
    /// Ranks per core on this host (1 unless they outnumber the cores):
    /// the thread's looks while calls are afoot are that many times
    /// rarer, up to the idle wake (see `rarer`).
    pub ranks_per_core: usize,
    /// A caller drove since the thread last looked: it may come back at
    /// once (the next blocking call), so the thread does not sleep on the
    /// doorbell then (the barrier that sleep needs interrupts every core).
    pub driven_lately: AtomicBool,
    /// The thread may be about to sleep long, idle (else it looks again
    /// within its look's interval, see `rarer`): a call left for it must
    /// ring `wake`.
    pub may_sleep_long: AtomicBool,
    pub closing: AtomicBool,
    /// Run on every pass of the thread (the flight recorder's publisher);
    /// it limits itself.
    pub hook: Mutex<Option<Box<dyn FnMut() + Send>>>,
}

/// How often the thread wakes with nothing to do. Whatever needs it wakes
/// it (a dialer, a call posted while it sleeps long, data on a socket);
/// the timeout only paces the hook and the greetings' deadlines. (At
/// 100 ms, a thousand idle ranks of one host woke ten thousand times a
/// second.)
const IDLE_WAKE_MS: libc::c_int = 250;

/// How often it looks while tagged calls wait and nobody moves them:
/// shared memory wakes no descriptor, and calls posted meanwhile do not
/// ring it.
const ACTIVE_LOOK_MS: libc::c_int = 2;

/// How often it looks while callers move their calls themselves.
const CALLERS_LOOK_MS: libc::c_int = 20;

/// How long after the last call it stays active.
const ACTIVE_FOR: Duration = Duration::from_millis(100);

/// How the thread moves tagged calls: it never dials, and reads every
/// connection a call waits on (how a peer's exit shows).
const THOROUGH: Drive = Drive {
    connect: false,
    thorough: true,
    first: None,
};

/// Most connections greeted at once (see transport/greeting.rs).
const MAX_GREETINGS: usize = 1024;

impl Shared {
    /// Tells the thread that a call needs it, when it may be asleep for
    /// long (a system call, saved while it looks often anyway).
    pub fn nudge(&self) {
        if self.may_sleep_long.load(Ordering::SeqCst) {
            self.wake.ring();
        }
    }
}

pub(super) fn run(sh: &Shared, listener: TcpListener) {
    // Its wakes never preempt a running thread (SCHED_BATCH: the same
    // share, no wake-up preemption): callers spinning for a message are
    // not pushed off their core by a look that finds nothing to do.
    // SAFETY: a plain system call on the calling thread (0).
    unsafe {
        libc::sched_setscheduler(
            0,
            libc::SCHED_BATCH,
            &libc::sched_param { sched_priority: 0 },
        )
    };
    let mut greeting: Vec<Greeting> = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut last_busy = Instant::now();
    // Whether the listener may have connections waiting (an accept that
    // finds none still costs the kernel a socket made and freed).
    let mut listener_ready = true;
    loop {
        if let Some(hook) = lock(&sh.hook).as_mut() {
            hook();
        }
        if listener_ready {
            accept_all(&listener, &mut greeting);
        }
        let mut i = 0;
        while i < greeting.len() {
            match greeting[i].advance(sh.links.spec.token.as_ref()) {
                Greeted::Pending => i += 1,
                Greeted::Dropped => drop(greeting.swap_remove(i)),
                Greeted::Ready => {
                    let (hello, s) = greeting.swap_remove(i).finish();
                    sh.links.admit(&hello, s);
                }
            }
        }
        // Connections that never said hello are dropped.
        let now = Instant::now();
        greeting.retain(|g| !g.expired(now, HELLO_DEADLINE));
        if sh.closing.load(Ordering::Acquire) {
            return;
        }
        fds.clear();
        // Said before looking at the calls: one posted after the look
        // rings, one posted before it is seen.
        sh.may_sleep_long.store(true, Ordering::SeqCst);
        let lately = sh.driven_lately.swap(false, Ordering::Relaxed);
        let driven = sh.drivers.load(Ordering::Relaxed) > 0;
        let mut busy = driven || lately;
        // Someone else moves the calls (a caller, or a collective holding
        // the core, which takes the tagged frames it meets).
        let mut others = busy;
        let mut holding = false;
        // Bytes already read into a channel wake no poll(): look again at once.
        let mut buffered = false;
        // Callers that drove since the last look may be back at once: the
        // thread stays out of their way (holding the core, it could be
        // preempted, and they would wait for it a whole time slice).
        if !busy {
            match try_lock(&sh.core) {
                Some(mut core) => {
                    holding = true;
                    core.drive(None, THOROUGH);
                    if core.tagged_busy() {
                        busy = true;
                        buffered = core.tagged_fds(&mut fds);
                    }
                }
                None => {
                    busy = true;
                    others = true;
                }
            }
        }
        let now = Instant::now();
        if busy {
            last_busy = now;
        }
        // Callers moving their calls: it looks now and then (each look
        // takes a core from them). Calls pending and nobody moving them:
        // it looks every few milliseconds. Either way (as many times less
        // often as ranks outnumber cores) calls posted need not ring it.
        // Idle for a while: it sleeps long, and the first call posted
        // rings it.
        let idle = !buffered && !others && now.duration_since(last_busy) >= ACTIVE_FOR;
        let wait_ms = if buffered {
            0
        } else if others {
            rarer(CALLERS_LOOK_MS, sh.ranks_per_core)
        } else if !idle {
            rarer(ACTIVE_LOOK_MS, sh.ranks_per_core)
        } else {
            IDLE_WAKE_MS
        };
        if !idle {
            sh.may_sleep_long.store(false, Ordering::SeqCst);
        }
        // Woken by: closing, a dialer, a call posted while it sleeps long,
        // a greeting's next bytes and, when this thread moves the tagged
        // calls, a call posted or a connection that arrived meanwhile
        // (else whoever holds the core takes those).
        let listener_at = fds.len() + 1;
        let mut wakers = vec![sh.wake.fd(), listener.as_raw_fd()];
        if holding {
            wakers.extend([sh.posts.bell.fd(), sh.links.arrival_fd()]);
        }
        for fd in wakers.into_iter().chain(greeting.iter().map(Greeting::fd)) {
            fds.push(libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            });
        }
        // SAFETY: fds is a live array of pollfd.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
        sh.may_sleep_long.store(false, Ordering::SeqCst);
        // An interrupted poll() tells nothing: accept anyway.
        listener_ready = n < 0 || (n > 0 && fds[listener_at].revents != 0);
        if n > 0 {
            sh.wake.drain();
        }
    }
}

/// A look's interval when `ranks_per_core` ranks share each core: each
/// look takes a core from a rank with work, so a thousand ranks on two
/// cores that looked every few milliseconds each would keep the cores
/// busy looking. At most the idle wake (a call nobody waits for then
/// moves within it; its caller's own wait moves it at once).
fn rarer(every_ms: libc::c_int, ranks_per_core: usize) -> libc::c_int {
    let scale = libc::c_int::try_from(ranks_per_core).unwrap_or(libc::c_int::MAX);
    every_ms.saturating_mul(scale.max(1)).min(IDLE_WAKE_MS)
}

fn accept_all(listener: &TcpListener, greeting: &mut Vec<Greeting>) {
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                if greeting.len() >= MAX_GREETINGS {
                    // A flood: the oldest has had the longest to speak.
                    greeting.remove(0);
                }
                greeting.extend(Greeting::new(s));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return, // WouldBlock, or a transient accept error
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_are_rarer_by_the_ranks_per_core_up_to_the_idle_wake() {
        assert_eq!(rarer(ACTIVE_LOOK_MS, 1), ACTIVE_LOOK_MS);
        assert_eq!(rarer(ACTIVE_LOOK_MS, 0), ACTIVE_LOOK_MS);
        assert_eq!(rarer(ACTIVE_LOOK_MS, 4), 4 * ACTIVE_LOOK_MS);
        assert_eq!(rarer(CALLERS_LOOK_MS, 512), IDLE_WAKE_MS);
        assert_eq!(rarer(CALLERS_LOOK_MS, usize::MAX), IDLE_WAKE_MS);
    }
}
