//! Connecting a pair of ranks on first use. A rank holds connections only
//! to the peers its algorithms exchange with (a few dozen at 1024 ranks,
//! not 1023), made when an exchange first names the peer.
//!
//! The higher rank of a pair dials. The lower rank's point-to-point thread,
//! always running because it serves the listener, greets the connection,
//! agrees on shared memory when the pair shares a host (`shm::answer`),
//! and leaves the channel here; the transport takes it when an exchange
//! needs that peer. So a dial never waits for the peer's caller, which may
//! be busy in an earlier call, computing, or waiting for this very rank.

use super::channel::{Channel, TcpChannel};
use super::mesh::{self, MeshSpec};
use super::shm::{self, Doorbell, Home};
use super::signal::AbortSignal;
use crate::error::{Error, Result};
use crate::options::ShmTuning;
use crate::sync::lock;
use std::net::TcpStream;
use std::os::fd::RawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long the answering side's part of a shared-memory agreement may
/// take (the dialer is in it already, so only a stalled peer takes long).
const AGREE_DEADLINE: Duration = Duration::from_secs(10);

/// What both sides of every pair of one communicator share.
pub struct Links {
    pub spec: MeshSpec,
    /// Per rank: on this host (the pair agrees on shared memory, or on
    /// TCP, when it connects).
    near: Vec<bool>,
    /// This rank's segment, when it has peers on this host and shared
    /// memory could be made.
    home: Option<Home>,
    /// Channels the point-to-point thread made for peers that dialed.
    arrived: Mutex<Vec<(usize, Box<dyn Channel>)>>,
    /// Readable while `arrived` may hold something.
    bell: AbortSignal,
}

impl Links {
    /// `want_shm`: shared memory with the ranks of this host (else TCP
    /// with every peer).
    pub fn new(spec: MeshSpec, want_shm: bool, tuning: ShmTuning) -> Result<Links> {
        // Every pair of one host runs the agreement, whatever it wants: a
        // rank that wants no shared memory offers none (no segment), so
        // ranks that differ in RDIST_TRANSPORT still agree on TCP.
        let near: Vec<bool> = (0..spec.size)
            .map(|p| p != spec.rank && !spec.far[p])
            .collect();
        let local_ranks = 1 + near.iter().filter(|n| **n).count();
        let home = match want_shm && local_ranks > 1 {
            true => Home::new(spec.rank, spec.size, local_ranks, tuning),
            false => None,
        };
        Ok(Links {
            near,
            home,
            arrived: Mutex::new(Vec::new()),
            bell: AbortSignal::new().map_err(|e| Error::system("eventfd", &e))?,
            spec,
        })
    }

    /// Whether pairs on this host may share memory (this rank made its
    /// segment); the transport then sleeps on `doorbell`.
    pub fn doorbell(&self) -> Option<Doorbell> {
        self.home.as_ref().map(Home::doorbell)
    }

    /// Dials `peer` (a lower rank) and agrees on the channel, bounded by
    /// `deadline`.
    pub fn dial(&self, peer: usize, deadline: Instant) -> Result<Box<dyn Channel>> {
        let mut s = mesh::dial_collectives(&self.spec, peer, deadline)?;
        if !self.near[peer] {
            return tcp(s);
        }
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let agreed = s
            .set_read_timeout(Some(left))
            .and_then(|()| shm::offer(self.home.as_ref(), peer, &mut s));
        match agreed {
            Ok(Some(pair)) => Ok(self.home.as_ref().expect("agreed").channel(peer, pair, s)),
            Ok(None) => tcp(s),
            Err(e) => Err(Error::new(
                crate::error::ErrorKind::PeerLost,
                format!(
                    "rank {} lost its connection to rank {peer} while agreeing on shared memory ({})",
                    self.spec.rank,
                    crate::error::describe_io(&e)
                ),
            )),
        }
    }

    /// The point-to-point thread's part: answers a greeted collectives
    /// hello and, when welcomed, leaves the channel for the transport.
    /// Blocking for a pair of this host (its agreement is three short
    /// messages with a dialer that is in it already), bounded.
    pub fn admit(&self, hello: &[u8; mesh::HELLO_BYTES], mut s: TcpStream) {
        let Some(rank) = mesh::answer_collectives(&self.spec, hello, &mut s) else {
            return;
        };
        let chan = if self.near[rank] {
            let agreed = s
                .set_read_timeout(Some(AGREE_DEADLINE))
                .and_then(|()| shm::answer(self.home.as_ref(), rank, &mut s));
            match agreed {
                Ok(Some(pair)) => Some(self.home.as_ref().expect("agreed").channel(rank, pair, s)),
                Ok(None) => tcp(s).ok(),
                Err(_) => None, // the dialer hears it as a lost connection
            }
        } else {
            tcp(s).ok()
        };
        if let Some(chan) = chan {
            lock(&self.arrived).push((rank, chan));
            self.bell.abort();
        }
    }

    /// The channels made for peers that dialed, since the last call.
    pub fn take_arrived(&self) -> Vec<(usize, Box<dyn Channel>)> {
        let mut arrived = lock(&self.arrived);
        let mut b = [0u8; 8];
        // SAFETY: reads 8 bytes into a live buffer from our own
        // non-blocking eventfd (resetting it; nothing waiting: EAGAIN).
        unsafe { libc::read(self.bell.fd(), b.as_mut_ptr().cast(), 8) };
        std::mem::take(&mut *arrived)
    }

    /// Readable when a channel may have arrived.
    pub fn arrival_fd(&self) -> RawFd {
        self.bell.fd()
    }
}

fn tcp(stream: TcpStream) -> Result<Box<dyn Channel>> {
    stream
        .set_read_timeout(None)
        .and_then(|()| stream.set_nonblocking(true))
        .map_err(|e| Error::system("set_nonblocking", &e))?;
    Ok(Box::new(TcpChannel(stream)))
}
