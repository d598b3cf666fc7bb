//! How bytes move between ranks. Algorithms see only the `Transport` trait:
//! a set of sends and receives that run concurrently until all complete.

pub mod channel;
pub mod frame;
pub(crate) mod futex;
pub mod greeting;
pub mod iface;
pub mod link;
pub mod mesh;
pub(crate) mod roster;
pub mod shm;
pub mod signal;
pub mod stream;

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

/// A connected group of ranks.
pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Runs every transfer concurrently and returns when all have completed,
    /// or with the first error (after which the transport is unusable).
    /// Messages between two ranks are matched in the order they were sent.
    fn exchange(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()>;
}
