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
use std::time::Instant;

/// Shared by the endpoint and its thread.
pub(super) struct Shared {
    pub rank: usize,
    pub core: Mutex<StreamTransport>,
    pub posts: Arc<Posts>,
    pub links: Arc<Links>,
    /// This rank's own doorbell, rung to wake a holder of the core that
    /// dozes on it (a tagged call was posted).
    pub doorbell: Option<Doorbell>,
    /// Wakes the endpoint's thread (a caller stopped driving, closing).
    pub wake: Wake,
    /// Callers driving progress in their waits right now: the thread
    /// stays out of their way.
    pub drivers: AtomicUsize,
    pub closing: AtomicBool,
    /// Run on every pass of the thread (the flight recorder's publisher);
    /// it limits itself.
    pub hook: Mutex<Option<Box<dyn FnMut() + Send>>>,
}

/// How often the thread wakes with nothing to do. Whatever needs it wakes
/// it (a dialer, a post, a caller that stops driving, data on a socket);
/// the timeout only paces the hook and the greetings' deadlines. (At
/// 100 ms, a thousand idle ranks of one host woke ten thousand times a
/// second.)
const IDLE_WAKE_MS: libc::c_int = 250;

/// How often it looks while tagged calls wait on shared memory, which
/// wakes no descriptor.
const MEMORY_LOOK_MS: libc::c_int = 1;

/// Most connections greeted at once (see transport/greeting.rs).
const MAX_GREETINGS: usize = 1024;

pub(super) fn run(sh: &Shared, listener: TcpListener) {
    let mut greeting: Vec<Greeting> = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        if let Some(hook) = lock(&sh.hook).as_mut() {
            hook();
        }
        accept_all(&listener, &mut greeting);
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
        let mut wait_ms = IDLE_WAKE_MS;
        let driven = sh.drivers.load(Ordering::Relaxed) > 0;
        let mut holding = false;
        if !driven {
            if let Some(mut core) = try_lock(&sh.core) {
                holding = true;
                core.drive(
                    None,
                    Drive {
                        connect: false,
                        thorough: true,
                    },
                );
                if core.tagged.busy() {
                    core.tagged_fds(&mut fds);
                    if core.tagged_waits_on_memory() {
                        wait_ms = MEMORY_LOOK_MS;
                    }
                }
            } else {
                // A collective holds the core, and moves the tagged frames
                // it meets; look again soon for the rest.
                wait_ms = 5;
            }
        } else {
            // A waiting caller is moving the bytes; look again shortly.
            wait_ms = 5;
        }
        // Woken by: a caller that stops driving or closes, a dialer, a
        // greeting's next bytes and, when this thread moves the tagged
        // calls, a call posted or a connection that arrived meanwhile
        // (else whoever holds the core takes those).
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
        if n > 0 {
            sh.wake.drain();
        }
    }
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
