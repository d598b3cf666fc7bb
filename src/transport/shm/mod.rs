//! Shared memory between ranks on one host: every rank owns a segment
//! holding one single-producer/single-consumer byte ring per peer (the
//! peer writes, the owner reads). A `ShmChannel` pairs the ring from a peer
//! with the ring to it, and keeps the TCP connection to that peer only to
//! notice its death (shared memory has no end-of-stream).
//!
//! A pair agrees on its rings when it connects, on first use (see attach).
//! Segments have no name (memfd): nothing is ever left behind in /dev/shm,
//! even when a rank crashes. Point-to-point messages go over TCP.

mod attach;
mod channel;
mod doorbell;
mod ring;
mod segment;

pub use attach::{answer, offer, Home};
pub use doorbell::Doorbell;
