//! Shared memory between ranks on one host: every rank owns a segment
//! holding one single-producer/single-consumer byte ring per peer (the
//! peer writes, the owner reads). A `ShmChannel` pairs the ring from a peer
//! with the ring to it, and keeps the TCP connection to that peer only to
//! notice its death (shared memory has no end-of-stream).
//!
//! Point-to-point (backend/p2p) has rings of its own in the same segments
//! (see attach), so its traffic never mixes with the collectives'.
//!
//! Segments are created under /dev/shm with names from the job id and are
//! unlinked as soon as every peer has mapped them, so nothing is left
//! behind even when a rank crashes later.

mod attach;
mod channel;
mod doorbell;
mod ring;
mod segment;

pub use attach::{attach, P2pChannels};
pub use doorbell::Doorbell;
