//! Turning the mesh's TCP streams into channels: every rank agrees on
//! shared memory (segments mapped by all, single-copy reads, membarrier)
//! or falls back to TCP.

use super::channel::ShmChannel;
use super::doorbell::{register_membarrier, Doorbell};
use super::segment::{ring_bytes_for, segment_name, Segment};
use crate::error::{Error, Result};
use crate::options::ShmTuning;
use crate::transport::channel::Channel;
use std::io;
use std::net::TcpStream;
use std::sync::Arc;

/// Something for peers to read with process_vm_readv to prove they can.
static PROBE: [u8; 16] = *b"rdist-cma-probe!";

/// Finds out whether every rank can read every peer's memory directly
/// (Linux cross-memory attach; Yama or containers may forbid it). Returns
/// each peer's pid when all can.
fn probe_single_copy(
    streams: &mut [Option<TcpStream>],
    allowed: bool,
) -> io::Result<Option<Vec<i32>>> {
    use std::io::{Read, Write};
    // Under Yama's ptrace_scope=1 only a declared tracer may read us.
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    let mut me = [0u8; 16];
    me[..8].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    me[8..].copy_from_slice(&(PROBE.as_ptr() as u64).to_le_bytes());
    for s in streams.iter_mut().flatten() {
        s.write_all(&me)?;
    }
    let mut pids = vec![0i32; streams.len()];
    let mut ok = true;
    for (peer, s) in streams.iter_mut().enumerate() {
        let Some(s) = s else { continue };
        let mut theirs = [0u8; 16];
        s.read_exact(&mut theirs)?;
        let pid = u64::from_le_bytes(theirs[..8].try_into().expect("8 bytes")) as i32;
        let addr = u64::from_le_bytes(theirs[8..].try_into().expect("8 bytes"));
        let mut got = [0u8; 16];
        ok &= crate::transport::channel::read_remote(pid, addr, &mut got).is_ok() && got == PROBE;
        pids[peer] = pid;
    }
    let all = everyone_ok(streams, ok && allowed)?;
    Ok(all.then_some(pids))
}

/// Exchanges one status byte with every peer over the (still blocking)
/// mesh streams; true when every rank, this one included, said ok.
fn everyone_ok(streams: &mut [Option<TcpStream>], ok: bool) -> io::Result<bool> {
    use std::io::{Read, Write};
    for s in streams.iter_mut().flatten() {
        s.write_all(&[u8::from(ok)])?;
    }
    let mut all = ok;
    for s in streams.iter_mut().flatten() {
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        all &= b[0] == 1;
    }
    Ok(all)
}

/// A peer's point-to-point channels: (out, in) (see `Attached::p2p`).
pub type P2pPair = (Box<dyn Channel>, Box<dyn Channel>);

/// Per peer (out, in), and the doorbell (see `Attached::p2p`).
pub type P2pChannels = (Vec<Option<P2pPair>>, Doorbell);

/// Unlinks a segment's name when dropped.
struct Unlink<'a>(&'a str);

impl Drop for Unlink<'_> {
    fn drop(&mut self) {
        Segment::unlink(self.0);
    }
}

fn tcp_channel(stream: TcpStream) -> Result<Box<dyn Channel>> {
    stream
        .set_nonblocking(true)
        .map_err(|e| Error::system("set_nonblocking", &e))?;
    Ok(Box::new(crate::transport::channel::TcpChannel(stream)))
}

/// Channels to every peer, and what this rank sleeps on while waiting.
pub struct Attached {
    pub channels: Vec<Option<Box<dyn Channel>>>,
    /// Shared memory to some peers and TCP to others: waits must also
    /// look at sockets, which no doorbell wakes for.
    pub mixed: bool,
    /// "shared memory" or "tcp".
    pub name: &'static str,
    /// This rank's doorbell (shared memory only).
    pub doorbell: Option<Doorbell>,
    /// Every peer agreed that single-copy reads work (shared memory only).
    pub single_copy: bool,
    /// The point-to-point context's own channels to every peer, (out, in):
    /// one ring pair carries this rank's messages to the peer (and its
    /// answers back), another the peer's messages; and the context's own
    /// doorbell. Shared memory only.
    pub p2p: Option<P2pChannels>,
}

/// Turns the mesh's TCP streams into channels: shared-memory rings to the
/// peers on this host (`local`) when `use_shm` and every rank of the host
/// manages to map the segments, TCP to the others (and to all of them
/// otherwise). The ranks of one host agree among themselves only, over
/// their own streams, so hosts never wait for one another here.
pub fn attach(
    rank: usize,
    all_streams: Vec<Option<TcpStream>>,
    local: &[bool],
    job: &[u8; 16],
    comm_id: u64,
    use_shm: bool,
    tuning: ShmTuning,
) -> Result<Attached> {
    let size = all_streams.len();
    let io_err = |e: io::Error| Error::system("agreeing on shared memory with the peers", &e);
    // Near: the peers on this host; far: the others.
    let mut streams: Vec<Option<TcpStream>> = Vec::with_capacity(size);
    let mut far: Vec<Option<TcpStream>> = Vec::with_capacity(size);
    for (peer, s) in all_streams.into_iter().enumerate() {
        if local.get(peer).copied().unwrap_or(false) {
            streams.push(s);
            far.push(None);
        } else {
            streams.push(None);
            far.push(s);
        }
    }
    let any_near = streams.iter().any(Option::is_some);
    if use_shm && any_near {
        let mine_name = segment_name(job, comm_id, rank);
        // Slots 0..size: the collectives' rings; size..2*size: point-to-
        // point messages from lower to higher ranks (and the context's
        // doorbells); 2*size..3*size: from higher to lower. Pages are only
        // allocated when touched.
        // Smaller rings on a crowded host (see ring_bytes_for).
        let ring_bytes = ring_bytes_for(1 + local.iter().filter(|l| **l).count());
        let mine = Segment::map(&mine_name, 3 * size, ring_bytes, true);
        // Unlinked however this ends (an error in the agreement below
        // returns early): a name left in /dev/shm outlives the job.
        let _unlink = Unlink(&mine_name);
        let created = everyone_ok(&mut streams, mine.is_ok()).map_err(io_err)?;
        let mut theirs: Vec<Option<Arc<Segment>>> = (0..size).map(|_| None).collect();
        let mut opened = created;
        if created {
            for (peer, slot) in theirs.iter_mut().enumerate() {
                if peer != rank && streams[peer].is_some() {
                    match Segment::map(
                        &segment_name(job, comm_id, peer),
                        3 * size,
                        ring_bytes,
                        false,
                    ) {
                        Ok(seg) => *slot = Some(Arc::new(seg)),
                        Err(_) => opened = false,
                    }
                }
            }
        }
        let all_opened = everyone_ok(&mut streams, opened).map_err(io_err)?;
        let pids = if all_opened {
            probe_single_copy(&mut streams, tuning.single_copy).map_err(io_err)?
        } else {
            None
        };
        let asymmetric = all_opened
            && everyone_ok(&mut streams, register_membarrier(tuning.membarrier)).map_err(io_err)?;
        // Everyone has mapped it (or given up): the name is no longer needed.
        Segment::unlink(&mine_name);
        if let (true, Ok(mine)) = (all_opened, mine) {
            let mine = Arc::new(mine);
            let mut p2p: Vec<Option<P2pPair>> = (0..size).map(|_| None).collect();
            let mut channels: Vec<Option<Box<dyn Channel>>> = Vec::with_capacity(size);
            let mixed = far.iter().any(Option::is_some);
            for (peer, (s, remote)) in streams.into_iter().zip(far).enumerate() {
                let Some(stream) = s else {
                    channels.push(match remote {
                        Some(stream) => Some(tcp_channel(stream)?),
                        None => None,
                    });
                    continue;
                };
                let theirs = theirs[peer].as_ref().expect("mapped above");
                let stream = Arc::new(stream);
                let pid = pids.as_ref().map(|p: &Vec<i32>| p[peer]);
                // The liveness connection is shared: all three channels
                // notice the peer's exit on it.
                let (up, down) = (size, 2 * size);
                let (out_base, in_base) = if rank < peer { (up, down) } else { (down, up) };
                let p2p_channel = |base: usize| -> io::Result<Box<dyn Channel>> {
                    Ok(Box::new(ShmChannel::new(
                        &mine,
                        theirs,
                        rank,
                        peer,
                        stream.clone(),
                        pid,
                        asymmetric,
                        base,
                        size,
                    )))
                };
                p2p[peer] = Some((
                    p2p_channel(out_base).map_err(io_err)?,
                    p2p_channel(in_base).map_err(io_err)?,
                ));
                channels.push(Some(Box::new(ShmChannel::new(
                    &mine, theirs, rank, peer, stream, pid, asymmetric, 0, 0,
                )) as Box<dyn Channel>));
            }
            return Ok(Attached {
                channels,
                name: if mixed {
                    "shared memory on this host, tcp to the others"
                } else {
                    "shared memory"
                },
                mixed,
                doorbell: Some(mine.doorbell(rank, asymmetric)),
                single_copy: pids.is_some(),
                p2p: Some((p2p, mine.doorbell(size + rank, asymmetric))),
            });
        }
    }
    let mut channels: Vec<Option<Box<dyn Channel>>> = Vec::with_capacity(size);
    for (near, remote) in streams.into_iter().zip(far) {
        channels.push(match near.or(remote) {
            Some(stream) => Some(tcp_channel(stream)?),
            None => None,
        });
    }
    Ok(Attached {
        channels,
        name: "tcp",
        mixed: false,
        doorbell: None,
        single_copy: false,
        p2p: None,
    })
}
