//! Shared memory for one pair of ranks, agreed when the pair connects.
//!
//! Every rank with peers on its host makes one segment at init (`Home`):
//! a ring per peer (written by that peer) and its doorbell, in a memfd
//! that has no name, so nothing is left in /dev/shm however the job ends.
//! Peers map it through /proc/<pid>/fd/<fd> and check the owner's cookie
//! (a stale pid could name another process). Pages are only allocated when
//! touched, so the rings of pairs that never connect cost nothing.
//!
//! When a pair of one host connects (transport/link), the dialer offers
//! what it has, the other side maps it and answers, the dialer maps that
//! and confirms: both come out with shared memory or both with TCP, and
//! single-copy reads only if each could read the other's memory.

use super::channel::ShmChannel;
use super::segment::{ring_bytes_for, Segment};
use crate::options::ShmTuning;
use crate::transport::channel::Channel;
use crate::transport::doorbell::{register_membarrier, Doorbell};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

/// Something for peers to read with process_vm_readv to prove they can.
static PROBE: [u8; 16] = *b"rdist-cma-probe!";

/// Bytes of the cookie at the start of the owner's spare ring area.
const COOKIE_BYTES: usize = 16;

/// This rank's segment, and what its peers need to map it.
pub struct Home {
    segment: Arc<Segment>,
    /// Held open: peers open the segment through it.
    fd: OwnedFd,
    cookie: [u8; COOKIE_BYTES],
    rank: usize,
    slots: usize,
    ring_bytes: usize,
    /// This process registered for membarrier (see doorbell): a pair
    /// shares memory only when both sides did the same.
    asymmetric: bool,
    /// Single-copy reads are allowed here (option, and PR_SET_PTRACER).
    single_copy: bool,
}

/// What a connected pair shares (see `offer` / `answer`).
pub struct Pair {
    theirs: Arc<Segment>,
    /// The peer's pid when both sides can read each other's memory.
    pid: Option<i32>,
}

impl Home {
    /// Makes this rank's segment for a communicator of `size` ranks with
    /// `local_ranks` on this host (ring sizes follow from it, alike on
    /// every rank of the host). None when shared memory cannot be made
    /// here (the pairs then use TCP).
    pub fn new(rank: usize, size: usize, local_ranks: usize, tuning: ShmTuning) -> Option<Home> {
        let ring_bytes = ring_bytes_for(local_ranks);
        let (segment, fd) = Segment::create_private(size, ring_bytes).ok()?;
        let mut cookie = [0u8; COOKIE_BYTES];
        cookie.copy_from_slice(&crate::auth::nonce()[..COOKIE_BYTES]);
        // SAFETY: the spare area of our own slot is ours alone, and
        // COOKIE_BYTES fit in it (checked by `spare`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                cookie.as_ptr(),
                segment.spare(rank, COOKIE_BYTES),
                COOKIE_BYTES,
            )
        };
        // Under Yama's ptrace_scope=1 only a declared tracer may read us.
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
        Some(Home {
            segment: Arc::new(segment),
            fd,
            cookie,
            rank,
            slots: size,
            ring_bytes,
            asymmetric: register_membarrier(tuning.membarrier),
            single_copy: tuning.single_copy,
        })
    }

    /// This rank's doorbell, which its peers ring.
    pub fn doorbell(&self) -> Doorbell {
        self.segment.doorbell(self.rank, self.asymmetric)
    }

    /// The dialer's offer: whether it has a segment, and how to find it.
    fn describe(home: Option<&Home>) -> [u8; OFFER_BYTES] {
        let mut b = [0u8; OFFER_BYTES];
        if let Some(h) = home {
            b[0] = 1;
            b[1] = u8::from(h.asymmetric);
            b[2..6].copy_from_slice(&(std::process::id() as i32).to_le_bytes());
            b[6..10].copy_from_slice(&h.fd.as_raw_fd().to_le_bytes());
            b[10..18].copy_from_slice(&(PROBE.as_ptr() as u64).to_le_bytes());
            b[18..34].copy_from_slice(&h.cookie);
        }
        b
    }

    /// Maps the segment `offer` describes (rank `peer`'s) and tries reading
    /// its memory: (segment, single-copy reads work).
    fn map_peer(&self, peer: usize, offer: &[u8; OFFER_BYTES]) -> Option<(Arc<Segment>, bool)> {
        if offer[0] != 1 || offer[1] != u8::from(self.asymmetric) {
            return None;
        }
        let i32_at = |i: usize| i32::from_le_bytes(offer[i..i + 4].try_into().expect("4 bytes"));
        let (pid, fd) = (i32_at(2), i32_at(6));
        let seg = Segment::open_of(pid, fd, self.slots, self.ring_bytes).ok()?;
        let mut cookie = [0u8; COOKIE_BYTES];
        // SAFETY: reads the peer's spare area, inside the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(seg.spare(peer, COOKIE_BYTES), cookie.as_mut_ptr(), 16)
        };
        if cookie[..] != offer[18..34] {
            return None; // another process's descriptor
        }
        let addr = u64::from_le_bytes(offer[10..18].try_into().expect("8 bytes"));
        let mut got = [0u8; 16];
        let reads = self.single_copy
            && crate::transport::channel::read_remote(pid, addr, &mut got).is_ok()
            && got == PROBE;
        Some((Arc::new(seg), reads))
    }

    /// The collectives' channel to `peer` over the pair's rings; the TCP
    /// connection stays, only to notice the peer's exit.
    pub fn channel(&self, peer: usize, pair: Pair, stream: TcpStream) -> Box<dyn Channel> {
        Box::new(ShmChannel::new(
            &self.segment,
            &pair.theirs,
            self.rank,
            peer,
            Arc::new(stream),
            pair.pid,
            self.asymmetric,
        ))
    }
}

/// Offer: has-segment, membarrier, pid, fd, probe address, cookie.
const OFFER_BYTES: usize = 34;

fn pid_of(offer: &[u8; OFFER_BYTES]) -> i32 {
    i32::from_le_bytes(offer[2..6].try_into().expect("4 bytes"))
}

/// Dialing side, right after the connection was welcomed (blocking, the
/// stream's timeouts set by the caller): Some when the pair shares memory.
pub fn offer(home: Option<&Home>, peer: usize, s: &mut TcpStream) -> io::Result<Option<Pair>> {
    s.write_all(&Home::describe(home))?;
    let mut answer = [0u8; OFFER_BYTES + 1];
    s.read_exact(&mut answer)?;
    let theirs: [u8; OFFER_BYTES] = answer[..OFFER_BYTES].try_into().expect("offer bytes");
    let they_read = answer[OFFER_BYTES] == 1;
    let mapped = match home {
        Some(h) if theirs[0] == 1 => h.map_peer(peer, &theirs),
        _ => None,
    };
    let both_read = mapped.as_ref().is_some_and(|(_, r)| *r) && they_read;
    s.write_all(&[u8::from(mapped.is_some()), u8::from(both_read)])?;
    Ok(mapped.map(|(seg, _)| Pair {
        theirs: seg,
        pid: both_read.then(|| pid_of(&theirs)),
    }))
}

/// Answering side of `offer` (the point-to-point thread, for a
/// connection it just welcomed).
pub fn answer(home: Option<&Home>, peer: usize, s: &mut TcpStream) -> io::Result<Option<Pair>> {
    let mut offered = [0u8; OFFER_BYTES];
    s.read_exact(&mut offered)?;
    let mapped = home.and_then(|h| h.map_peer(peer, &offered));
    let mut reply = [0u8; OFFER_BYTES + 1];
    if mapped.is_some() {
        reply[..OFFER_BYTES].copy_from_slice(&Home::describe(home));
        reply[OFFER_BYTES] = u8::from(mapped.as_ref().is_some_and(|(_, r)| *r));
    }
    s.write_all(&reply)?;
    let mut confirmed = [0u8; 2];
    s.read_exact(&mut confirmed)?;
    Ok(match (mapped, confirmed[0] == 1) {
        (Some((seg, _)), true) => Some(Pair {
            theirs: seg,
            pid: (confirmed[1] == 1).then(|| pid_of(&offered)),
        }),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn tuning() -> ShmTuning {
        ShmTuning {
            membarrier: false,
            single_copy: true,
        }
    }

    /// Two ranks of one host agree on shared memory when they connect:
    /// bytes written on one side arrive on the other, both ways, and
    /// nothing of theirs appears in /dev/shm.
    #[test]
    fn a_pair_agrees_on_its_rings_when_it_connects() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut dialer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let mut answerer = l.accept().unwrap().0;
        let (h0, h1) = (
            Home::new(0, 2, 2, tuning()).unwrap(),
            Home::new(1, 2, 2, tuning()).unwrap(),
        );
        let (c1, s1) = std::thread::scope(|sc| {
            let t = sc.spawn(|| answer(Some(&h0), 1, &mut answerer).unwrap());
            let c1 = offer(Some(&h1), 0, &mut dialer).unwrap();
            (c1, t.join().unwrap())
        });
        let (p1, p0) = (c1.expect("dialer shares"), s1.expect("answerer shares"));
        assert_eq!(
            p1.pid,
            Some(std::process::id() as i32),
            "single copy probed"
        );
        let mut a = h1.channel(0, p1, dialer);
        let mut b = h0.channel(1, p0, answerer);
        assert_eq!(a.write2(b"hello", b" there").unwrap(), 11);
        let mut got = [0u8; 11];
        assert_eq!(b.read(&mut got).unwrap(), 11);
        assert_eq!(&got, b"hello there");
        assert_eq!(b.write2(b"back", b"").unwrap(), 4);
        assert_eq!(a.read(&mut got).unwrap(), 4);
        assert_eq!(&got[..4], b"back");
    }

    /// When one side has no segment, or the offer names a descriptor whose
    /// cookie is not the owner's, both sides fall back to TCP together.
    #[test]
    fn a_pair_without_both_segments_or_with_a_wrong_cookie_uses_tcp() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let h0 = Home::new(0, 2, 2, tuning()).unwrap();
        for forge in [false, true] {
            let mut dialer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let mut answerer = l.accept().unwrap().0;
            let (d, a) = std::thread::scope(|sc| {
                let t = sc.spawn(|| answer(Some(&h0), 1, &mut answerer).unwrap());
                let d = if forge {
                    // A real segment of this process, announced with a
                    // cookie that is not in it.
                    let h1 = Home::new(1, 2, 2, tuning()).unwrap();
                    let mut offer = Home::describe(Some(&h1));
                    offer[18] ^= 0xff;
                    dialer.write_all(&offer).unwrap();
                    let mut reply = [0u8; OFFER_BYTES + 1];
                    dialer.read_exact(&mut reply).unwrap();
                    dialer.write_all(&[1, 1]).unwrap();
                    None::<Pair>
                } else {
                    offer(None, 0, &mut dialer).unwrap()
                };
                (d, t.join().unwrap())
            });
            assert!(d.is_none() && a.is_none(), "forge={forge}");
        }
    }
}
