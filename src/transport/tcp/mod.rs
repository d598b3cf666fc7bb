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
        // Only asked while spinning: one non-blocking peek.
        let mut b = [0u8; 1];
        // SAFETY: peeks at most one byte into a live buffer.
        let n = unsafe {
            libc::recv(
                self.0.as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n != -1 || io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock
    }

    fn shutdown(&self, how: Shutdown) {
        let _ = self.0.shutdown(how);
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
