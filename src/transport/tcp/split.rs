//! TCP with one connection for each direction of a pair. A rank in a
//! large `sendmsg` holds its socket's lock for the whole copy, and the
//! segments its peer sends meanwhile on that same connection wait in the
//! socket's backlog until the call returns: a pair that sends both ways at
//! once (an exchange, a two-rank ring, halving-doubling's steps) takes
//! turns instead of overlapping. On two connections each socket carries
//! data one way only (and the other way's acknowledgements), and both
//! directions flow at once (docs/performance.md).
//!
//! The agreement, over the pair's welcomed connection (which becomes the
//! dialer's way out): the answerer listens on a new port of the address
//! the pair met on and names it with a nonce; the dialer connects and
//! proves the connection with the nonce; the answerer confirms. Whatever
//! fails on the way (a port a firewall refuses, a stranger's connection)
//! leaves the pair on its one connection (plain TCP, next in the table).

use super::{ask_quick_acks, readable, CAPS};
use crate::transport::channel::{writev, Caps, Channel};
use crate::transport::medium::{Medium, Pair};
use crate::transport::mesh;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

const NONCE: usize = 16;

/// How long the answerer waits for the second connection when the
/// welcomed one carries no read timeout.
const DEFAULT_WAIT: Duration = Duration::from_secs(10);

/// A pair's two connections: this rank writes on `out` and reads from
/// `inward` (the peer's `out`).
pub struct SplitChannel {
    out: TcpStream,
    inward: TcpStream,
}

impl SplitChannel {
    fn new(out: TcpStream, inward: TcpStream) -> io::Result<SplitChannel> {
        for s in [&out, &inward] {
            s.set_read_timeout(None)?;
            s.set_write_timeout(None)?;
            s.set_nonblocking(true)?;
        }
        Ok(SplitChannel { out, inward })
    }
}

impl Channel for SplitChannel {
    fn caps(&self) -> Caps {
        CAPS
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        io::Read::read(&mut self.inward, buf)
    }

    fn write2(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        writev(self.out.as_raw_fd(), a, b)
    }

    fn fd(&self) -> RawFd {
        self.inward.as_raw_fd()
    }

    fn write_fd(&self) -> RawFd {
        self.out.as_raw_fd()
    }

    fn has_data(&self) -> bool {
        readable(self.inward.as_raw_fd())
    }

    fn shutdown(&self, how: Shutdown) {
        let _ = self.out.shutdown(how);
        let _ = self.inward.shutdown(how);
    }

    fn expect_bulk(&mut self) {
        ask_quick_acks(self.inward.as_raw_fd());
    }
}

/// The medium: every pair across TCP, unless the options say one
/// connection (`RDIST_TCP_SPLIT=0`, or either side's build lacks it: its
/// table never offers it, and the answerer declines what it does not know).
pub struct SplitTcp {
    /// This rank (keepalive probes are spread by rank and peer).
    pub rank: usize,
    pub wanted: bool,
}

impl Medium for SplitTcp {
    fn name(&self) -> &'static str {
        "tcp-split"
    }

    fn caps(&self) -> Caps {
        CAPS
    }

    fn applies(&self, _pair: &Pair) -> bool {
        true
    }

    fn wanted(&self) -> bool {
        self.wanted
    }

    fn offer(
        &self,
        pair: &Pair,
        mut stream: TcpStream,
    ) -> io::Result<Result<Box<dyn Channel>, TcpStream>> {
        stream.write_all(&[u8::from(self.wanted)])?;
        let mut answer = [0u8; 3 + NONCE];
        stream.read_exact(&mut answer)?;
        if answer[0] != 1 {
            return Ok(Err(stream));
        }
        let port = u16::from_le_bytes([answer[1], answer[2]]);
        let wait = stream.read_timeout()?.unwrap_or(DEFAULT_WAIT);
        let to = SocketAddr::new(stream.peer_addr()?.ip(), port);
        let second = TcpStream::connect_timeout(&to, wait).and_then(|mut s| {
            s.set_write_timeout(Some(wait))?;
            s.write_all(&answer[3..])?;
            Ok(s)
        });
        // Said either way: the answerer waits for it.
        stream.write_all(&[u8::from(second.is_ok())])?;
        let Ok(second) = second else {
            return Ok(Err(stream));
        };
        let mut confirmed = [0u8; 1];
        stream.read_exact(&mut confirmed)?;
        if confirmed[0] != 1 {
            return Ok(Err(stream));
        }
        mesh::configure_more(&second, self.rank, pair.peer, !pair.near);
        Ok(Ok(Box::new(SplitChannel::new(stream, second)?)))
    }

    fn answer(
        &self,
        pair: &Pair,
        mut stream: TcpStream,
    ) -> io::Result<Result<Box<dyn Channel>, TcpStream>> {
        let mut asked = [0u8; 1];
        stream.read_exact(&mut asked)?;
        // No port to offer (none to bind): one connection.
        let listener = match asked[0] == 1 && self.wanted {
            true => (stream.local_addr())
                .and_then(|a| TcpListener::bind(SocketAddr::new(a.ip(), 0)))
                .ok(),
            false => None,
        };
        let mut answer = [0u8; 3 + NONCE];
        let mut nonce = [0u8; NONCE];
        if let Some(l) = &listener {
            crate::random::fill(&mut nonce);
            answer[0] = 1;
            answer[1..3].copy_from_slice(&l.local_addr()?.port().to_le_bytes());
            answer[3..].copy_from_slice(&nonce);
        }
        stream.write_all(&answer)?;
        let Some(listener) = listener else {
            return Ok(Err(stream));
        };
        let mut connected = [0u8; 1];
        stream.read_exact(&mut connected)?;
        if connected[0] != 1 {
            return Ok(Err(stream));
        }
        let wait = stream.read_timeout()?.unwrap_or(DEFAULT_WAIT);
        let second = take_proven(&listener, &nonce, Instant::now() + wait);
        stream.write_all(&[u8::from(second.is_some())])?;
        let Some(second) = second else {
            return Ok(Err(stream));
        };
        mesh::configure_more(&second, self.rank, pair.peer, !pair.near);
        Ok(Ok(Box::new(SplitChannel::new(second, stream)?)))
    }
}

/// The first connection to `listener` that proves itself with `nonce`
/// before `deadline` (others are dropped), or None.
fn take_proven(
    listener: &TcpListener,
    nonce: &[u8; NONCE],
    deadline: Instant,
) -> Option<TcpStream> {
    listener.set_nonblocking(true).ok()?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        match listener.accept() {
            Ok((mut s, _)) => {
                let proven = s
                    .set_nonblocking(false)
                    .and_then(|()| s.set_read_timeout(Some(left)))
                    .and_then(|()| {
                        let mut got = [0u8; NONCE];
                        s.read_exact(&mut got).map(|()| got == *nonce)
                    });
                if matches!(proven, Ok(true)) {
                    return Some(s);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let mut p = libc::pollfd {
                    fd: listener.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                let ms = left.as_millis().clamp(1, 1000) as i32;
                // SAFETY: one live pollfd.
                unsafe { libc::poll(&mut p, 1, ms) };
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    /// The two sides' agreement over a fresh loopback connection, with
    /// the answerer wanting the medium or not.
    type Agreed = Result<Box<dyn Channel>, TcpStream>;

    fn agree(offering: bool, answering: bool) -> (Agreed, Agreed) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = l.local_addr().unwrap();
        let pair = Pair {
            peer: 1,
            near: true,
        };
        let dialer = thread::spawn(move || {
            let s = TcpStream::connect(to).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let m = SplitTcp {
                rank: 0,
                wanted: offering,
            };
            m.offer(&pair, s).unwrap()
        });
        let s = l.accept().unwrap().0;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let m = SplitTcp {
            rank: 1,
            wanted: answering,
        };
        let answered = m.answer(&pair, s).unwrap();
        (dialer.join().unwrap(), answered)
    }

    fn read_some(chan: &mut dyn Channel, want: usize) -> Vec<u8> {
        let mut got = vec![0u8; want];
        let mut n = 0;
        let deadline = Instant::now() + Duration::from_secs(5);
        while n < want {
            match chan.read(&mut got[n..]) {
                Ok(0) => panic!("closed"),
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "nothing came");
                    thread::yield_now();
                }
                Err(e) => panic!("{e}"),
            }
        }
        got
    }

    #[test]
    fn both_wanting_get_a_connection_each_way() {
        let (a, b) = agree(true, true);
        let (Ok(mut a), Ok(mut b)) = (a, b) else {
            panic!("a side did not take the medium")
        };
        for c in [&a, &b] {
            assert_ne!(c.fd(), c.write_fd(), "reads and writes share a socket");
        }
        assert_eq!(a.write2(b"ping", b"!").unwrap(), 5);
        assert_eq!(read_some(&mut *b, 5), b"ping!");
        assert_eq!(b.write2(b"", b"pong").unwrap(), 4);
        assert_eq!(read_some(&mut *a, 4), b"pong");
        // The peer's end shows on the socket it reads (its death too).
        drop(b);
        let mut one = [0u8; 1];
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match a.read(&mut one) {
                Ok(0) => break,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::yield_now(),
                other => panic!("{other:?}"),
            }
            assert!(Instant::now() < deadline, "the peer's end never showed");
        }
    }

    #[test]
    fn either_side_declining_leaves_the_one_connection() {
        for (offering, answering) in [(true, false), (false, true), (false, false)] {
            let (a, b) = agree(offering, answering);
            let (Err(mut a), Err(mut b)) = (a, b) else {
                panic!("taken with offering={offering} answering={answering}")
            };
            // The welcomed connection is left as it was, both ways.
            a.write_all(b"x").unwrap();
            let mut got = [0u8; 1];
            b.read_exact(&mut got).unwrap();
            b.write_all(b"y").unwrap();
            a.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"y");
        }
    }

    #[test]
    fn a_stranger_on_the_port_is_not_taken() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = l.local_addr().unwrap();
        let nonce = [7u8; NONCE];
        let stranger = thread::spawn(move || {
            let mut s = TcpStream::connect(to).unwrap();
            s.write_all(&[9u8; NONCE]).unwrap();
            thread::sleep(Duration::from_millis(200));
            let mut s2 = TcpStream::connect(to).unwrap();
            s2.write_all(&[7u8; NONCE]).unwrap();
            (s, s2)
        });
        let taken = take_proven(&l, &nonce, Instant::now() + Duration::from_secs(5));
        let (_s, s2) = stranger.join().unwrap();
        let taken = taken.expect("the proven connection is taken");
        assert_eq!(taken.peer_addr().unwrap(), s2.local_addr().unwrap());
        // Nobody proves it: None at the deadline.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let started = Instant::now();
        assert!(take_proven(&l, &nonce, started + Duration::from_millis(300)).is_none());
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}
