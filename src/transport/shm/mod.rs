//! Shared memory between ranks on one host: every rank owns a segment
//! holding one single-producer/single-consumer byte ring per peer (the
//! peer writes, the owner reads). A `ShmChannel` pairs the ring from a peer
//! with the ring to it, and keeps the TCP connection to that peer only to
//! notice its death (shared memory has no end-of-stream). Both contexts,
//! the collectives' frames and tagged messages, share the pair's rings.
//!
//! A pair agrees on its rings when it connects, on first use (see attach).
//! Segments have no name (memfd): nothing is ever left behind in /dev/shm,
//! even when a rank crashes.

mod attach;
mod channel;
mod ring;
mod segment;

pub use attach::{answer, offer, Home};
pub use ring::WHOLE_PAYLOAD;

use crate::transport::channel::{Caps, Channel};
use crate::transport::doorbell::Doorbell;
use crate::transport::medium::{Layout, Medium, Pair, Wanted};
use std::io;
use std::net::TcpStream;

/// The shared-memory medium: pairs of one host, when both sides could
/// make their segment and map the other's.
pub struct SharedMemory {
    home: Option<Home>,
    wanted: bool,
}

impl SharedMemory {
    /// Makes this rank's segment when it has peers on its host and the
    /// options want shared memory (without one, it declines every pair).
    pub fn open(layout: Layout, wanted: Wanted) -> SharedMemory {
        let home = match wanted.shm && layout.local_ranks > 1 {
            true => Home::new(layout.rank, layout.size, layout.local_ranks, wanted.tuning),
            false => None,
        };
        SharedMemory {
            home,
            wanted: wanted.shm,
        }
    }

    /// The channel both sides agreed on (`rings`), or the stream back.
    fn agreed(
        &self,
        pair: &Pair,
        rings: Option<attach::Pair>,
        stream: TcpStream,
    ) -> Result<Box<dyn Channel>, TcpStream> {
        match (rings, self.home.as_ref()) {
            (Some(rings), Some(home)) => Ok(home.channel(pair.peer, rings, stream)),
            _ => Err(stream),
        }
    }
}

impl Medium for SharedMemory {
    fn name(&self) -> &'static str {
        "shared memory"
    }

    fn caps(&self) -> Caps {
        Caps {
            through_kernel: false,
            whole_messages: true,
            lends: true,
            single_copy: false,
        }
    }

    fn applies(&self, pair: &Pair) -> bool {
        // Every pair of one host runs the agreement, whatever it wants: a
        // rank that wants no shared memory offers none (no segment), so
        // ranks that differ in RDIST_TRANSPORT still agree on TCP.
        pair.near
    }

    fn wanted(&self) -> bool {
        self.wanted
    }

    fn offer(
        &self,
        pair: &Pair,
        mut stream: TcpStream,
    ) -> io::Result<Result<Box<dyn Channel>, TcpStream>> {
        let rings = offer(self.home.as_ref(), pair.peer, &mut stream)?;
        Ok(self.agreed(pair, rings, stream))
    }

    fn answer(
        &self,
        pair: &Pair,
        mut stream: TcpStream,
    ) -> io::Result<Result<Box<dyn Channel>, TcpStream>> {
        let rings = answer(self.home.as_ref(), pair.peer, &mut stream)?;
        Ok(self.agreed(pair, rings, stream))
    }

    fn doorbell(&self) -> Option<Doorbell> {
        self.home.as_ref().map(Home::doorbell)
    }
}
