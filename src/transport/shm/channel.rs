//! `ShmChannel`: the channel to one peer on the same host, a ring from it
//! and a ring to it, with the TCP connection kept only to notice its death.

use super::ring::Ring;
use super::segment::Segment;
use crate::transport::channel::{Caps, Channel};
use crate::transport::doorbell::Doorbell;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

/// A channel to one peer on the same host.
pub struct ShmChannel {
    from_peer: Ring,
    to_peer: Ring,
    /// Rung after every transfer, so a sleeping peer wakes.
    peer_bell: Doorbell,
    /// Kept open only so the peer's exit shows as end-of-stream (one
    /// descriptor a local peer: at 256 ranks on a host, three put every
    /// rank past the common limit of 1024).
    liveness: Arc<TcpStream>,
    peer_closed: bool,
    asked: u32,
    /// The peer's pid when single-copy reads work.
    cma_pid: Option<i32>,
}

impl ShmChannel {
    /// `mine` is this rank's segment (slot = peer), `theirs` the peer's
    /// (slot = this rank); the peer's doorbell is in its own slot.
    pub fn new(
        mine: &Arc<Segment>,
        theirs: &Arc<Segment>,
        rank: usize,
        peer: usize,
        liveness: Arc<TcpStream>,
        cma_pid: Option<i32>,
        asymmetric: bool,
    ) -> ShmChannel {
        let _ = liveness.set_nonblocking(true);
        ShmChannel {
            from_peer: mine.ring(peer),
            to_peer: theirs.ring(rank),
            peer_bell: theirs.doorbell(peer, asymmetric),
            liveness,
            peer_closed: false,
            asked: 0,
            cma_pid,
        }
    }

    /// Whether the peer's end of the liveness connection closed (a peek
    /// syscall, so only every 64th time it is asked while spinning).
    fn peer_gone(&mut self) -> bool {
        self.asked = self.asked.wrapping_add(1);
        if !self.peer_closed && self.asked.is_multiple_of(64) {
            let mut b = [0u8; 1];
            // SAFETY: peeks one byte into a live buffer, never blocking.
            let n = unsafe {
                libc::recv(
                    self.liveness.as_raw_fd(),
                    b.as_mut_ptr().cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            let err = io::Error::last_os_error().kind();
            self.peer_closed = n == 0
                || (n < 0 && err != io::ErrorKind::WouldBlock && err != io::ErrorKind::Interrupted);
        }
        self.peer_closed
    }
}

impl Channel for ShmChannel {
    fn caps(&self) -> Caps {
        Caps {
            through_kernel: false,
            whole_messages: true,
            lends: true,
            single_copy: self.cma_pid.is_some(),
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let freed = self.from_peer.freed();
        let n = self.from_peer.read(buf);
        if n > 0 {
            if self.from_peer.freed() != freed {
                // Space freed: a peer waiting to write may go on.
                self.peer_bell.ring();
            }
            return Ok(n);
        }
        // Empty: end of stream only once the peer is gone and everything
        // it wrote has been read.
        if self.peer_gone() && self.from_peer.readable() == 0 {
            return Ok(0);
        }
        Err(io::ErrorKind::WouldBlock.into())
    }

    fn write2(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        match self.to_peer.write2(a, b) {
            0 if self.peer_gone() => Err(io::ErrorKind::BrokenPipe.into()),
            0 => Err(io::ErrorKind::WouldBlock.into()),
            n => {
                self.peer_bell.ring();
                Ok(n)
            }
        }
    }

    fn write_whole(&mut self, a: &[u8], b: &[u8]) -> bool {
        let written = self.to_peer.write_whole(a, b);
        if written {
            self.peer_bell.ring();
        }
        written
    }

    fn peek_whole(&self) -> Option<&[u8]> {
        self.from_peer.peek()
    }

    fn consume_whole(&mut self, len: usize) {
        self.from_peer.consumed(len, len);
        // Space freed: a peer waiting to write may go on.
        self.peer_bell.ring();
    }

    fn read_combine(
        &mut self,
        dst: &mut [u8],
        unit: usize,
        combine: &mut dyn FnMut(&mut [u8], &[u8]),
    ) -> usize {
        let freed = self.from_peer.freed();
        let n = self.from_peer.combine(dst, unit, combine);
        if self.from_peer.freed() != freed {
            self.peer_bell.ring();
        }
        n
    }

    fn fd(&self) -> RawFd {
        self.liveness.as_raw_fd()
    }

    fn has_data(&self) -> bool {
        self.from_peer.readable() > 0
    }

    fn shutdown(&self, how: Shutdown) {
        let _ = self.liveness.shutdown(how);
    }

    fn look_for_departure(&mut self) {
        // `peer_gone` looks when the count it advances is a multiple of 64.
        self.asked = u32::MAX;
    }

    fn peer_pid(&self) -> Option<i32> {
        self.cma_pid
    }
}
