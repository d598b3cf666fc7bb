//! TCP: the medium between any two ranks, and the one every pair falls
//! back to. A channel is the pair's connection itself, non-blocking, with
//! a small receive buffer in front of it (as Open MPI's TCP endpoints
//! have): a small frame's header and payload come in one system call.

use crate::transport::channel::{writev, Caps, Channel};
use crate::transport::medium::{Medium, Pair};
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

/// While a connection carries small frames, reads shorter than this go
/// through the channel's buffer (one system call brings a frame whole,
/// header and payload, where reading them apart took two); longer ones,
/// and every read while it carries large payloads, go straight into the
/// reader's memory. At most this much of a large payload is copied twice.
const BUFFERED_READ: usize = 8 << 10;

/// A connected, non-blocking TCP stream.
pub struct TcpChannel {
    stream: TcpStream,
    /// Bytes read from the stream and not handed out yet: `buf[at..end]`
    /// (allocated on first use).
    buf: Vec<u8>,
    at: usize,
    end: usize,
    /// The connection carries large payloads (a read this long came
    /// since the last two short ones in a row): headers are read alone,
    /// so that no payload lands in the buffer to be copied again.
    large: bool,
    /// The last read asked for less than `BUFFERED_READ`.
    last_short: bool,
}

impl TcpChannel {
    /// Takes over a connected stream (made non-blocking, no timeouts).
    pub fn new(stream: TcpStream) -> io::Result<TcpChannel> {
        stream.set_read_timeout(None)?;
        stream.set_nonblocking(true)?;
        Ok(TcpChannel::of(stream))
    }

    /// A channel on `stream` as it is.
    pub fn of(stream: TcpStream) -> TcpChannel {
        TcpChannel {
            stream,
            buf: Vec::new(),
            at: 0,
            end: 0,
            large: false,
            last_short: false,
        }
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
        if buf.is_empty() {
            return Ok(0);
        }
        let short = buf.len() < BUFFERED_READ;
        // A header then a short payload (or two headers): small frames.
        self.large = !short || (self.large && !self.last_short);
        self.last_short = short;
        if self.at == self.end {
            if self.large {
                return io::Read::read(&mut self.stream, buf);
            }
            if self.buf.is_empty() {
                self.buf = vec![0; BUFFERED_READ];
            }
            let n = io::Read::read(&mut self.stream, &mut self.buf)?;
            (self.at, self.end) = (0, n);
        }
        let n = buf.len().min(self.end - self.at);
        buf[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }

    fn write2(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        writev(self.stream.as_raw_fd(), a, b)
    }

    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    fn read_combine(
        &mut self,
        dst: &mut [u8],
        unit: usize,
        combine: &mut dyn FnMut(&mut [u8], &[u8]),
    ) -> usize {
        // Only what the buffer holds (a large payload's first bytes, read
        // with its header): combined from there rather than copied again.
        let n = dst.len().min(self.end - self.at);
        let n = n - n % unit;
        if n > 0 {
            combine(&mut dst[..n], &self.buf[self.at..self.at + n]);
            self.at += n;
        }
        n
    }

    fn buffered(&self) -> bool {
        self.at < self.end
    }

    fn has_data(&self) -> bool {
        if self.buffered() {
            return true;
        }
        // Only asked while spinning. poll() looks without taking the
        // socket's lock, which a peek (recv) takes: a reader peeking in a
        // loop holds off the kernel delivering the very segment it waits
        // for (it goes to the socket's backlog, processed when the lock
        // is released).
        let mut p = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd, no wait.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n != 0
    }

    fn shutdown(&self, how: Shutdown) {
        let _ = self.stream.shutdown(how);
    }

    fn expect_bulk(&mut self) {
        // A connection that carries data both ways (a ping-pong, both
        // directions of a two-rank exchange) is taken by the kernel for
        // an interactive one, whose acknowledgements wait to ride on the
        // reply: the sender of a large payload then stalls on a full
        // send buffer. Quick acknowledgements last until this side next
        // writes, so the reader asks again as it goes.
        ask_quick_acks(self.stream.as_raw_fd());
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    /// A channel reading what `writer` sends over loopback.
    fn pair() -> (TcpChannel, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let writer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let reader = TcpChannel::new(l.accept().unwrap().0).unwrap();
        (reader, writer)
    }

    /// Bytes waiting in the socket, not yet read by anyone.
    fn in_socket(c: &TcpChannel) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: a socket descriptor and a c_int for the kernel to fill.
        assert_eq!(unsafe { libc::ioctl(c.fd(), libc::FIONREAD, &mut n) }, 0);
        n as usize
    }

    /// Reads exactly `buf.len()` bytes, waiting for them (bounded).
    fn read_exact(c: &mut TcpChannel, buf: &mut [u8]) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = 0;
        while got < buf.len() {
            match c.read(&mut buf[got..]) {
                Ok(0) => panic!("the writer closed"),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "nothing came");
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// Waits until `n` bytes are in the socket.
    fn wait_in_socket(c: &TcpChannel, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while in_socket(c) < n {
            assert!(Instant::now() < deadline, "nothing came");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn small_frames_come_whole_with_their_header() {
        let (mut c, mut w) = pair();
        let frames: Vec<u8> = (0..96u8).collect();
        w.write_all(&frames).unwrap();
        wait_in_socket(&c, 96);
        let mut header = [0u8; 40];
        read_exact(&mut c, &mut header);
        assert_eq!(header[..], frames[..40]);
        // Payload and the next frame came with the header, in one read.
        assert_eq!(in_socket(&c), 0);
        assert!(c.buffered() && c.has_data());
        let mut payload = [0u8; 8];
        read_exact(&mut c, &mut payload);
        assert_eq!(payload[..], frames[40..48]);
        let mut next = [0u8; 48];
        read_exact(&mut c, &mut next);
        assert_eq!(next[..], frames[48..]);
        assert!(!c.buffered() && !c.has_data());
        let e = c.read(&mut header).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        drop(w);
        assert_eq!(read_until_end(&mut c), 0);
    }

    fn read_until_end(c: &mut TcpChannel) -> usize {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match c.read(&mut [0u8; 40]) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "no end came");
                    std::thread::sleep(Duration::from_millis(1));
                }
                r => return r.unwrap(),
            }
        }
    }

    #[test]
    fn large_payloads_are_read_straight_into_their_buffers() {
        let (mut c, mut w) = pair();
        let payload: Vec<u8> = (0..64 << 10).map(|i| (i % 251) as u8).collect();
        let mut sent = Vec::new();
        for k in 0..3u8 {
            sent.extend([k; 40]);
            sent.extend(&payload);
        }
        let writer = std::thread::spawn(move || w.write_all(&sent).map(|_| w));
        let mut header = [0u8; 40];
        let mut got = vec![0u8; payload.len()];
        for k in 0..3u8 {
            // The header and some of its payload are there.
            wait_in_socket(&c, 40 + 1024);
            read_exact(&mut c, &mut header);
            assert_eq!(header, [k; 40]);
            // The first header brings some payload with it; after a large
            // payload a header is read alone, and the next payload goes
            // from the socket straight into its own buffer.
            assert_eq!(c.buffered(), k == 0, "header {k}");
            read_exact(&mut c, &mut got);
            assert!(got == payload, "payload {k} differs");
        }
        let _w = writer.join().unwrap().unwrap();
    }

    #[test]
    fn buffered_bytes_are_combined_in_whole_units() {
        let (mut c, mut w) = pair();
        w.write_all(&[[1u8; 40].as_slice(), &[2u8; 30]].concat())
            .unwrap();
        wait_in_socket(&c, 70);
        read_exact(&mut c, &mut [0u8; 40]);
        let mut dst = [10u8; 30];
        let mut add = |d: &mut [u8], s: &[u8]| d.iter_mut().zip(s).for_each(|(d, s)| *d += s);
        // 30 buffered bytes in units of 8: 24 combined, 6 left for read().
        assert_eq!(c.read_combine(&mut dst, 8, &mut add), 24);
        assert_eq!(dst[..24], [12u8; 24]);
        assert_eq!(dst[24..], [10u8; 6]);
        let mut rest = [0u8; 6];
        read_exact(&mut c, &mut rest);
        assert_eq!(rest, [2u8; 6]);
        assert_eq!(c.read_combine(&mut dst, 8, &mut add), 0);
    }
}
