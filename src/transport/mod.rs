//! How bytes move between ranks. Algorithms see only the `Transport` trait:
//! a set of sends and receives that run concurrently until all complete.

pub mod channel;
pub mod frame;
pub mod iface;
pub mod mesh;
pub mod shm;
pub mod signal;
pub mod stream;

use crate::error::Result;
use crate::op::Desc;

/// One direction of one transfer in an exchange.
pub enum Dir<'a> {
    Send(&'a [u8]),
    Recv(&'a mut [u8]),
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
