//! How bytes move between ranks. Algorithms see only the `Transport` trait
//! (a set of sends and receives that run concurrently until all complete)
//! and the `Shape` of the media; the backend holds one `Endpoint` per
//! communicator, which carries both contexts, the collectives' exchanges
//! and tagged point-to-point messages, over one connection per pair.
//!
//! The media (TCP, shared memory) are folders behind `medium::Medium`,
//! registered in `media::open`.

pub mod channel;
pub mod doorbell;
pub mod endpoint;
pub mod frame;
pub(crate) mod futex;
pub mod greeting;
pub mod iface;
pub mod link;
pub mod machine;
pub mod media;
pub mod medium;
pub mod membership;
pub mod mesh;
pub(crate) mod preemption;
mod service;
pub mod shm;
pub mod shrink;
pub mod signal;
pub mod stream;
pub mod tagged;
pub mod tcp;
pub(crate) mod watch;

pub use channel::Caps;

use crate::descriptor::Desc;
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::ReduceOp;

/// One direction of one transfer in an exchange.
pub enum Dir<'a> {
    Send(&'a [u8]),
    Recv(&'a mut [u8]),
    /// Receive and combine into the buffer as the bytes arrive
    /// (buf = buf op incoming), without a staging copy of the whole message.
    RecvReduce(&'a mut [u8], DType, ReduceOp),
}

impl Dir<'_> {
    /// The buffer a receive fills (None for sends).
    pub fn recv_buf(&mut self) -> Option<&mut [u8]> {
        match self {
            Dir::Send(_) => None,
            Dir::Recv(b) | Dir::RecvReduce(b, _, _) => Some(b),
        }
    }
}

/// A send to or receive from `peer`, labelled with the operation it belongs
/// to (the receiver checks that the labels agree).
pub struct Xfer<'a> {
    pub peer: usize,
    pub dir: Dir<'a>,
    pub desc: Desc,
}

impl<'a> Xfer<'a> {
    pub fn send(peer: usize, data: &'a [u8], desc: Desc) -> Xfer<'a> {
        Xfer {
            peer,
            dir: Dir::Send(data),
            desc,
        }
    }

    pub fn recv_reduce(
        peer: usize,
        buf: &'a mut [u8],
        dtype: DType,
        op: ReduceOp,
        desc: Desc,
    ) -> Xfer<'a> {
        Xfer {
            peer,
            dir: Dir::RecvReduce(buf, dtype, op),
            desc,
        }
    }

    pub fn recv(peer: usize, buf: &'a mut [u8], desc: Desc) -> Xfer<'a> {
        Xfer {
            peer,
            dir: Dir::Recv(buf),
            desc,
        }
    }
}

/// What every rank of a communicator assumes of the media between its
/// ranks, alike on each (from the roster and the options, never from one
/// rank's own channels: ranks must choose the same algorithm).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// What a pair of one host's channel can do.
    pub within_host: Caps,
    /// What a pair of two hosts' channel can do.
    pub between_hosts: Caps,
    /// Some ranks are on other hosts (the network, not the cores, is
    /// the bound).
    pub across_hosts: bool,
}

impl Shape {
    /// Some pair's bytes go through kernel socket buffers: copies there
    /// (and the network), not memory bandwidth, are the bound.
    pub fn through_kernel(&self) -> bool {
        self.across_hosts || self.within_host.through_kernel
    }
}

/// A connected group of ranks.
pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// What the ranks assume of the media between them.
    fn shape(&self) -> Shape {
        Shape::default()
    }
    /// Runs every transfer concurrently and returns when all have completed,
    /// or with the first error (after which the transport is unusable).
    /// Messages between two ranks are matched in the order they were sent.
    fn exchange(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()>;
    /// Whether this rank already has a connection to `peer` (connections
    /// are made on first use: an exchange waits for every peer it names).
    fn connected(&self, _peer: usize) -> bool {
        true
    }
}
