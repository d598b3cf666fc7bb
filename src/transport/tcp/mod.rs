//! TCP: the medium between any two ranks, and the one every pair falls
//! back to. A channel is the pair's connection itself, non-blocking.

use crate::transport::channel::{writev, Caps, Channel};
use crate::transport::medium::{Medium, Pair};
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

/// A connected, non-blocking TCP stream.
pub struct TcpChannel(pub TcpStream);

impl TcpChannel {
    /// Takes over a connected stream (made non-blocking, no timeouts).
    pub fn new(stream: TcpStream) -> io::Result<TcpChannel> {
        stream.set_read_timeout(None)?;
        stream.set_nonblocking(true)?;
        Ok(TcpChannel(stream))
    }
}

impl Channel for TcpChannel {
    fn caps(&self) -> Caps {
        Caps {
            through_kernel: true,
            ..Caps::default()
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        io::Read::read(&mut self.0, buf)
    }

    fn write2(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        writev(self.0.as_raw_fd(), a, b)
    }

    fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    fn has_data(&self) -> bool {
        // Only asked while spinning. poll() looks without taking the
        // socket's lock, which a peek (recv) takes: a reader peeking in a
        // loop holds off the kernel delivering the very segment it waits
        // for (it goes to the socket's backlog, processed when the lock
        // is released).
        let mut p = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd, no wait.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n != 0
    }

    fn shutdown(&self, how: Shutdown) {
        let _ = self.0.shutdown(how);
    }

    fn expect_bulk(&mut self) {
        // A connection that carries data both ways (a ping-pong, both
        // directions of a two-rank exchange) is taken by the kernel for
        // an interactive one, whose acknowledgements wait to ride on the
        // reply: the sender of a large payload then stalls on a full
        // send buffer. Quick acknowledgements last until this side next
        // writes, so the reader asks again as it goes.
        ask_quick_acks(self.0.as_raw_fd());
    }
}

/// Asks socket `fd` to acknowledge what it reads at once, until it next
/// writes (TCP_QUICKACK).
pub fn ask_quick_acks(fd: RawFd) {
    let one: libc::c_int = 1;
    // SAFETY: a socket descriptor and a c_int option of its size (on
    // anything else the call fails, harmlessly).
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_QUICKACK,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Whether a socket acknowledges at once (false: in the kernel's
/// interactive mode, where acknowledgements wait to ride on a reply).
#[cfg(test)]
pub fn quick_acks(fd: RawFd) -> io::Result<bool> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a c_int and its size, for the kernel to fill.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_QUICKACK,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    match r {
        0 => Ok(v != 0),
        _ => Err(io::Error::last_os_error()),
    }
}

/// The TCP medium: every pair can use it, and it needs no agreement.
pub struct Tcp;

impl Medium for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn caps(&self) -> Caps {
        Caps {
            through_kernel: true,
            ..Caps::default()
        }
    }

    fn applies(&self, _pair: &Pair) -> bool {
        true
    }

    fn offer(
        &self,
        _pair: &Pair,
        stream: TcpStream,
    ) -> io::Result<Result<Box<dyn Channel>, TcpStream>> {
        Ok(Ok(Box::new(TcpChannel::new(stream)?)))
    }

    fn answer(
        &self,
        pair: &Pair,
        stream: TcpStream,
    ) -> io::Result<Result<Box<dyn Channel>, TcpStream>> {
        self.offer(pair, stream)
    }
}
