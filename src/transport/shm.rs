//! Shared memory between ranks on one host: every rank owns a segment
//! holding one single-producer/single-consumer byte ring per peer (the
//! peer writes, the owner reads). A `ShmChannel` pairs the ring from a peer
//! with the ring to it, and keeps the TCP connection to that peer only to
//! notice its death (shared memory has no end-of-stream).
//!
//! Segments are created under /dev/shm with names from the job id and are
//! unlinked as soon as every peer has mapped them, so nothing is left
//! behind even when a rank crashes later.

use super::channel::Channel;
use crate::copy;
use crate::error::{Error, Result};
use std::cell::Cell;
use std::ffi::CString;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Bytes of one ring's data area.
pub const RING_BYTES: usize = 1 << 20;
/// Control block: head and tail on separate cache lines.
const CTL_BYTES: usize = 128;
const SLOT_BYTES: usize = CTL_BYTES + RING_BYTES;

/// A mapped segment; unmapped on drop.
pub struct Segment {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics and
// the ring protocol (one writer, one reader per ring).
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly what mmap returned.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// The /dev/shm name of `rank`'s segment in a communicator.
pub fn segment_name(job: &[u8; 16], comm_id: u64, rank: usize) -> String {
    let hex: String = job[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("/rdist-{hex}-{comm_id:016x}-{rank}")
}

impl Segment {
    /// Creates (or, with `create == false`, opens) a segment of `slots` rings.
    pub fn map(name: &str, slots: usize, create: bool) -> Result<Segment> {
        let len = slots * SLOT_BYTES;
        let cname = CString::new(name).map_err(|_| Error::internal("segment name has a NUL"))?;
        let flags = if create {
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR
        } else {
            libc::O_RDWR
        };
        // SAFETY: plain libc calls on a valid C string; every result checked.
        unsafe {
            let fd = libc::shm_open(cname.as_ptr(), flags | libc::O_CLOEXEC, 0o600);
            if fd < 0 {
                return Err(Error::system(
                    format!("shm_open {name}"),
                    &io::Error::last_os_error(),
                ));
            }
            if create && libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = io::Error::last_os_error();
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
                return Err(Error::system(
                    format!("sizing shared memory {name} ({len} bytes)"),
                    &e,
                ));
            }
            let base = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            if base == libc::MAP_FAILED {
                return Err(Error::system(
                    format!("mapping shared memory {name}"),
                    &io::Error::last_os_error(),
                ));
            }
            Ok(Segment {
                base: base.cast(),
                len,
            })
        }
    }

    pub fn unlink(name: &str) {
        if let Ok(c) = CString::new(name) {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }

    /// The doorbell of the rank that owns this segment (in its own slot).
    pub fn doorbell(self: &Arc<Self>, owner: usize, asymmetric: bool) -> Doorbell {
        assert!(
            (owner + 1) * SLOT_BYTES <= self.len,
            "doorbell slot out of the segment"
        );
        // SAFETY: inside the mapping; the two words sit on separate lines.
        let ctl = unsafe { self.base.add(owner * SLOT_BYTES) };
        Doorbell {
            _segment: self.clone(),
            bell: ctl.cast(),
            // SAFETY: 64 bytes in, inside the control block.
            sleeping: unsafe { ctl.add(64) }.cast(),
            asymmetric,
        }
    }

    fn ring(self: &Arc<Self>, slot: usize) -> Ring {
        assert!(
            (slot + 1) * SLOT_BYTES <= self.len,
            "ring slot out of the segment"
        );
        // SAFETY: inside the mapping (checked above).
        let ctl = unsafe { self.base.add(slot * SLOT_BYTES) };
        Ring {
            _segment: self.clone(),
            // SAFETY: the tail word sits 64 bytes in, inside the control block.
            tail: unsafe { ctl.add(64) }.cast(),
            // SAFETY: the data area follows the control block.
            data: unsafe { ctl.add(CTL_BYTES) },
            tail_seen: Cell::new(0),
            at: Cell::new(0),
            number: Cell::new(1),
            taken: Cell::new(0),
            payload_lines: std::cell::RefCell::new(Vec::new()),
        }
    }
}

/// A rank's doorbell: a counter that every peer bumps after writing to or
/// reading from a ring shared with this rank, plus a flag saying whether
/// this rank sleeps on it (futex), so a bump wakes it only then. It lives
/// in the otherwise unused slot of the rank's own segment.
pub struct Doorbell {
    _segment: Arc<Segment>,
    bell: *const AtomicU32,
    sleeping: *const AtomicU32,
    /// Every rank registered for membarrier: the sleeper pays for the
    /// store-load barrier (a syscall, on the way to sleep) so that ringing
    /// needs none (a fence there waits for every store of the message to
    /// reach the peer: most of a small message's cost).
    asymmetric: bool,
}

// SAFETY: see Segment.
unsafe impl Send for Doorbell {}

impl Doorbell {
    fn bell(&self) -> &AtomicU32 {
        // SAFETY: an aligned word of the live mapping.
        unsafe { &*self.bell }
    }

    fn sleeping(&self) -> &AtomicU32 {
        // SAFETY: as bell.
        unsafe { &*self.sleeping }
    }

    /// Wakes the owner if it sleeps. Costs one load while the owner spins:
    /// the fence pairs with the one in `prepare`, so either the owner's
    /// re-check sees what the caller just published, or the caller sees
    /// the owner's sleeping flag and bumps the counter its futex waits on.
    pub fn ring(&self) {
        if self.asymmetric {
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
        } else {
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        // Only the first ring after the owner announced its sleep pays for
        // the wake-up; later ones (until it sleeps again) see the flag clear.
        if self.sleeping().load(Ordering::SeqCst) != 0
            && self.sleeping().swap(0, Ordering::SeqCst) != 0
        {
            self.bell().fetch_add(1, Ordering::SeqCst);
            // SAFETY: futex wake on a shared (not private) word.
            unsafe { libc::syscall(libc::SYS_futex, self.bell, libc::FUTEX_WAKE, i32::MAX) };
        }
    }

    /// Announces that the owner is about to sleep; returns the counter to
    /// pass to `sleep`. The owner must re-check for work after this.
    pub fn prepare(&self) -> u32 {
        let seen = self.bell().load(Ordering::SeqCst);
        self.sleeping().store(1, Ordering::SeqCst);
        if self.asymmetric {
            // Every thread of every registered rank passes a full barrier:
            // a peer's ring either sees the flag, or its message is
            // visible to the re-check that follows.
            global_barrier();
        } else {
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        seen
    }

    /// Sleeps until a peer rings (since `prepare`) or `timeout` passes.
    pub fn sleep(&self, seen: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: futex wait on a shared word with a live timespec; returns
        // at once if the counter already moved on.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.bell,
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
            )
        };
        self.done();
    }

    pub fn done(&self) {
        self.sleeping().store(0, Ordering::SeqCst);
    }
}

/// Registers this process for expedited global membarriers; false where
/// the kernel has none (then doorbells use a fence on both sides).
fn register_membarrier() -> bool {
    if std::env::var_os("RDIST_NO_MEMBARRIER").is_some() {
        return false;
    }
    // SAFETY: membarrier takes plain integers.
    unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED,
            0,
            0,
        ) == 0
    }
}

const MEMBARRIER_CMD_GLOBAL_EXPEDITED: libc::c_int = 1 << 1;
const MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED: libc::c_int = 1 << 2;

fn global_barrier() {
    // SAFETY: as above; registration succeeded on every rank.
    let rc = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0) };
    if rc != 0 {
        // Cannot happen after a successful registration; stay correct anyway.
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

/// One SPSC ring of records. Each record starts on a cache line with an
/// 8-byte word (its number, low half; its length, high half) followed by
/// its bytes, and is published by storing that word last. The reader polls
/// the word where the next record starts, so a small message costs one
/// cache-line transfer (word and bytes share the line) instead of one for
/// an index and another for the data. `tail` (bytes freed by the reader)
/// tells the writer which space it may reuse.
struct Ring {
    _segment: Arc<Segment>,
    tail: *const AtomicU64,
    data: *mut u8,
    /// The writer's last reading of `tail` (never ahead of the real one).
    tail_seen: Cell<u64>,
    /// Where this side is: the writer's next record (bytes ever used), or
    /// the reader's current record.
    at: Cell<u64>,
    /// Number of the record at `at` (the first is 1; memory never written
    /// reads as record 0, so it is never taken for one).
    number: Cell<u32>,
    /// Reader: bytes of the current record already handed out.
    taken: Cell<usize>,
    /// Writer: per 64-byte line of the ring, whether it was last written
    /// with payload (1) rather than a record's word (0).
    payload_lines: std::cell::RefCell<Vec<u8>>,
}

/// Records start on cache lines, so a small one shares its line with its word.
const RECORD_ALIGN: u64 = 64;
const RECORD_WORD: usize = 8;
/// Largest record: big payloads go as several, so the reader can start on
/// the first while the writer fills the next.
const MAX_RECORD: usize = 64 << 10;

// SAFETY: see Segment; each Ring is used by one side only.
unsafe impl Send for Ring {}

/// Where the next record starts after one of `len` bytes at `at`.
fn record_end(at: u64, len: usize) -> u64 {
    at + ((RECORD_WORD + len) as u64).next_multiple_of(RECORD_ALIGN)
}

impl Ring {
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: points at an 8-aligned word of the live mapping.
        unsafe { &*self.tail }
    }

    /// The word of the record starting at byte `at` of the ring.
    fn word(&self, at: u64) -> &AtomicU64 {
        // SAFETY: `at % RING_BYTES` is a multiple of 64, inside the data
        // area, so the word is aligned and mapped.
        unsafe {
            &*self
                .data
                .add((at % RING_BYTES as u64) as usize)
                .cast::<AtomicU64>()
        }
    }

    /// Reader: bytes freed for the writer so far.
    fn freed(&self) -> u64 {
        self.at.get()
    }

    /// Length of the next unread record, if it has been published.
    fn next_record(&self) -> Option<usize> {
        let w = self.word(self.at.get()).load(Ordering::Acquire);
        (w as u32 == self.number.get()).then_some((w >> 32) as usize)
    }

    fn readable(&self) -> usize {
        self.next_record().map_or(0, |len| len - self.taken.get())
    }

    /// Copies `len` bytes starting at ring byte `from` (wrapping) into `to`.
    fn copy_out(&self, from: u64, to: &mut [u8]) {
        let at = (from % RING_BYTES as u64) as usize;
        let first = to.len().min(RING_BYTES - at);
        // SAFETY: both ranges lie inside the data area, in a published
        // record that the writer does not touch until `tail` passes it.
        unsafe {
            copy::copy_nonoverlapping(self.data.add(at), to.as_mut_ptr(), first);
            if first < to.len() {
                copy::copy_nonoverlapping(self.data, to.as_mut_ptr().add(first), to.len() - first);
            }
        }
    }

    /// Copies `from` into the ring starting at ring byte `to` (wrapping).
    fn copy_in(&self, to: u64, from: &[u8]) {
        let at = (to % RING_BYTES as u64) as usize;
        let first = from.len().min(RING_BYTES - at);
        // SAFETY: the range lies in space the reader has freed and that no
        // published record covers until the word below is stored.
        unsafe {
            copy::copy_nonoverlapping(from.as_ptr(), self.data.add(at), first);
            if first < from.len() {
                copy::copy_nonoverlapping(from.as_ptr().add(first), self.data, from.len() - first);
            }
        }
    }

    /// Copies up to `buf.len()` bytes out of published records; returns how
    /// many.
    fn read(&self, buf: &mut [u8]) -> usize {
        let mut done = 0;
        while done < buf.len() {
            let Some(len) = self.next_record() else { break };
            let at = self.at.get();
            let taken = self.taken.get();
            let n = (len - taken).min(buf.len() - done);
            self.copy_out(at + (RECORD_WORD + taken) as u64, &mut buf[done..done + n]);
            done += n;
            self.consumed(len, n);
        }
        done
    }

    /// Accounts for `n` more bytes handed out of the current record (of
    /// `len` bytes), freeing its space once all of it is out.
    fn consumed(&self, len: usize, n: usize) {
        let taken = self.taken.get() + n;
        if taken < len {
            self.taken.set(taken);
            return;
        }
        let next = record_end(self.at.get(), len);
        self.at.set(next);
        self.number.set(self.number.get().wrapping_add(1));
        self.taken.set(0);
        self.tail().store(next, Ordering::Release);
    }

    /// Hands up to `dst.len()` bytes of the current record, in whole
    /// `unit`s and without a copy, to `combine(dst part, ring bytes)`;
    /// returns how many bytes it consumed (0 when none can go that way:
    /// nothing published, or a unit straddles the record's end or the
    /// ring's wrap).
    fn combine(
        &self,
        dst: &mut [u8],
        unit: usize,
        combine: &mut dyn FnMut(&mut [u8], &[u8]),
    ) -> usize {
        let mut done = 0;
        while done < dst.len() {
            let Some(len) = self.next_record() else { break };
            let at = self.at.get();
            let taken = self.taken.get();
            let from = ((at + (RECORD_WORD + taken) as u64) % RING_BYTES as u64) as usize;
            let contiguous = (len - taken).min(RING_BYTES - from);
            let n = contiguous.min(dst.len() - done);
            let n = n - n % unit;
            if n == 0 {
                break;
            }
            // SAFETY: inside the data area, in a published record that the
            // writer does not touch until `tail` passes it.
            let src = unsafe { std::slice::from_raw_parts(self.data.add(from), n) };
            combine(&mut dst[done..done + n], src);
            done += n;
            self.consumed(len, n);
        }
        done
    }

    /// The whole next record, lent without a copy: when it is published,
    /// none of it was handed out yet and it does not wrap around the ring.
    /// Release it with `consumed(len, len)`.
    fn peek(&self) -> Option<&[u8]> {
        if self.taken.get() != 0 {
            return None;
        }
        let len = self.next_record()?;
        let from = ((self.at.get() + RECORD_WORD as u64) % RING_BYTES as u64) as usize;
        if from + len > RING_BYTES {
            return None;
        }
        // SAFETY: inside the data area, in a published record that the
        // writer does not touch until `tail` passes it.
        Some(unsafe { std::slice::from_raw_parts(self.data.add(from), len) })
    }

    /// Publishes `a` then `b` as one record if all of it fits now; false
    /// (nothing written) otherwise.
    fn write_whole(&self, a: &[u8], b: &[u8]) -> bool {
        let len = a.len() + b.len();
        if len == 0 || len > MAX_RECORD {
            return false;
        }
        let need = record_end(0, len) as usize;
        let at = self.at.get();
        if RING_BYTES - ((at - self.tail_seen.get()) as usize) < need {
            self.tail_seen.set(self.tail().load(Ordering::Acquire));
            if RING_BYTES - ((at - self.tail_seen.get()) as usize) < need {
                return false;
            }
        }
        self.write2(a, b) == len
    }

    /// Publishes as much of `a` then `b` as fits as one record; returns how
    /// many bytes.
    fn write2(&self, a: &[u8], b: &[u8]) -> usize {
        if a.is_empty() && b.is_empty() {
            return 0;
        }
        let at = self.at.get();
        let want = (RECORD_WORD + a.len() + b.len()).min(RECORD_WORD + MAX_RECORD);
        // The reader's tail lives on a line the reader keeps writing: read
        // it (one cache-line transfer) only when the last value seen leaves
        // too little room.
        let mut free = RING_BYTES - (at - self.tail_seen.get()) as usize;
        if free < want {
            self.tail_seen.set(self.tail().load(Ordering::Acquire));
            free = RING_BYTES - (at - self.tail_seen.get()) as usize;
        }
        if free < RECORD_ALIGN as usize {
            return 0;
        }
        // `free` is a multiple of the alignment, so the padded record fits.
        let len = (want.min(free) - RECORD_WORD).min(a.len() + b.len());
        let from_a = len.min(a.len());
        let body = at + RECORD_WORD as u64;
        self.copy_in(body, &a[..from_a]);
        self.copy_in(body + from_a as u64, &b[..len - from_a]);
        let number = self.number.get();
        let next = record_end(at, len);
        // Where the next record will start, the ring may still hold bytes of
        // an older record's payload, which could read as that record's
        // number (user data full of small integers does): overwrite them
        // before publishing this record, so a reader that gets here early
        // finds no record. A line that begins with an older record's word
        // needs nothing (that number is from the previous lap, never the
        // next one), so a stream of small records never pays for this; and
        // when the ring is exactly full, the slot is the reader's unread
        // record, which is such a word.
        let mut lines = self.payload_lines.borrow_mut();
        if lines.is_empty() {
            lines.resize(RING_BYTES / RECORD_ALIGN as usize, 0);
        }
        let line = |pos: u64| ((pos % RING_BYTES as u64) / RECORD_ALIGN) as usize;
        let next_line = line(next);
        if lines[next_line] != 0 {
            if next - self.tail_seen.get() >= RING_BYTES as u64 {
                self.tail_seen.set(self.tail().load(Ordering::Acquire));
            }
            if next - self.tail_seen.get() < RING_BYTES as u64 {
                let not_next = !number.wrapping_add(1);
                self.word(next)
                    .store(u64::from(not_next), Ordering::Relaxed);
                lines[next_line] = 0;
            }
        }
        // This record: a word on its first line, payload on the others.
        let (first, end) = (line(at), line(at) + ((next - at) / RECORD_ALIGN) as usize);
        lines[first] = 0;
        if end <= lines.len() {
            lines[first + 1..end].fill(1);
        } else {
            let wrap = end - lines.len();
            lines[first + 1..].fill(1);
            lines[..wrap].fill(1);
        }
        drop(lines);
        self.word(at)
            .store(u64::from(number) | (len as u64) << 32, Ordering::Release);
        self.number.set(number.wrapping_add(1));
        self.at.set(next);
        len
    }
}

/// A channel to one peer on the same host.
pub struct ShmChannel {
    from_peer: Ring,
    to_peer: Ring,
    /// Rung after every transfer, so a sleeping peer wakes.
    peer_bell: Doorbell,
    /// Kept open only so the peer's exit shows as end-of-stream.
    liveness: TcpStream,
    peer_closed: bool,
    asked: u32,
    /// The peer's pid when single-copy reads work.
    cma_pid: Option<i32>,
}

impl ShmChannel {
    /// `mine` is this rank's segment (slot = peer), `theirs` the peer's
    /// (slot = this rank).
    pub fn new(
        mine: &Arc<Segment>,
        theirs: &Arc<Segment>,
        rank: usize,
        peer: usize,
        liveness: TcpStream,
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

    fn peer_pid(&self) -> Option<i32> {
        self.cma_pid
    }
}

/// Something for peers to read with process_vm_readv to prove they can.
static PROBE: [u8; 16] = *b"rdist-cma-probe!";

/// Finds out whether every rank can read every peer's memory directly
/// (Linux cross-memory attach; Yama or containers may forbid it). Returns
/// each peer's pid when all can.
fn probe_single_copy(streams: &mut [Option<TcpStream>]) -> io::Result<Option<Vec<i32>>> {
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
        ok &= super::channel::read_remote(pid, addr, &mut got).is_ok() && got == PROBE;
        pids[peer] = pid;
    }
    let all = everyone_ok(
        streams,
        ok && std::env::var_os("RDIST_NO_SINGLE_COPY").is_none(),
    )?;
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

/// Channels to every peer, and what this rank sleeps on while waiting.
pub struct Attached {
    pub channels: Vec<Option<Box<dyn Channel>>>,
    /// "shared memory" or "tcp".
    pub name: &'static str,
    /// This rank's doorbell (shared memory only).
    pub doorbell: Option<Doorbell>,
    /// Every peer agreed that single-copy reads work (shared memory only).
    pub single_copy: bool,
}

/// Turns the mesh's TCP streams into channels: shared-memory rings when
/// `use_shm` (every rank on this host) and every rank manages to map the
/// segments, TCP otherwise.
pub fn attach(
    rank: usize,
    mut streams: Vec<Option<TcpStream>>,
    job: &[u8; 16],
    comm_id: u64,
    use_shm: bool,
) -> Result<Attached> {
    let size = streams.len();
    let io_err = |e: io::Error| Error::system("agreeing on shared memory with the peers", &e);
    if use_shm && size > 1 {
        let mine_name = segment_name(job, comm_id, rank);
        let mine = Segment::map(&mine_name, size, true);
        let created = everyone_ok(&mut streams, mine.is_ok()).map_err(io_err)?;
        let mut theirs: Vec<Option<Arc<Segment>>> = (0..size).map(|_| None).collect();
        let mut opened = created;
        if created {
            for (peer, slot) in theirs.iter_mut().enumerate() {
                if peer != rank {
                    match Segment::map(&segment_name(job, comm_id, peer), size, false) {
                        Ok(seg) => *slot = Some(Arc::new(seg)),
                        Err(_) => opened = false,
                    }
                }
            }
        }
        let all_opened = everyone_ok(&mut streams, opened).map_err(io_err)?;
        let pids = if all_opened {
            probe_single_copy(&mut streams).map_err(io_err)?
        } else {
            None
        };
        let asymmetric =
            all_opened && everyone_ok(&mut streams, register_membarrier()).map_err(io_err)?;
        // Everyone has mapped it (or given up): the name is no longer needed.
        Segment::unlink(&mine_name);
        if let (true, Ok(mine)) = (all_opened, mine) {
            let mine = Arc::new(mine);
            let channels = streams
                .into_iter()
                .enumerate()
                .map(|(peer, s)| {
                    s.map(|stream| {
                        let theirs = theirs[peer].as_ref().expect("mapped above");
                        let pid = pids.as_ref().map(|p: &Vec<i32>| p[peer]);
                        Box::new(ShmChannel::new(
                            &mine, theirs, rank, peer, stream, pid, asymmetric,
                        )) as Box<dyn Channel>
                    })
                })
                .collect();
            return Ok(Attached {
                channels,
                name: "shared memory",
                doorbell: Some(mine.doorbell(rank, asymmetric)),
                single_copy: pids.is_some(),
            });
        }
    }
    let mut channels: Vec<Option<Box<dyn Channel>>> = Vec::with_capacity(size);
    for s in streams {
        channels.push(match s {
            Some(stream) => {
                stream
                    .set_nonblocking(true)
                    .map_err(|e| Error::system("set_nonblocking", &e))?;
                Some(Box::new(super::channel::TcpChannel(stream)))
            }
            None => None,
        });
    }
    Ok(Attached {
        channels,
        name: "tcp",
        doorbell: None,
        single_copy: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two views of one ring in a fresh, already unlinked segment (the
    /// rings keep it mapped): one to write, one to read.
    fn ring_pair(tag: &str) -> (Ring, Ring) {
        let name = format!("/rdist-test-{tag}{}", std::process::id());
        let seg = Arc::new(Segment::map(&name, 2, true).unwrap());
        Segment::unlink(&name);
        (seg.ring(1), seg.ring(1))
    }

    #[test]
    fn rings_carry_bytes_across_wraparound() {
        let (writer, reader) = ring_pair("wrap-");
        let pattern: Vec<u8> = (0..8 * RING_BYTES).map(|i| (i % 251) as u8).collect();
        let (mut sent, mut got) = (0usize, 0usize);
        let mut out = vec![0u8; 200_000];
        // Writes of every size (tiny to several records), reads of every
        // size (a few bytes of a record up to many records at once).
        let (mut w, mut r) = (1usize, 1usize);
        while got < 6 * RING_BYTES {
            w = (w * 7 + 3) % 300_000;
            r = (r * 13 + 5) % out.len();
            let rest = &pattern[sent..];
            let end = (w + 1).min(rest.len());
            let split = 7.min(end);
            sent += writer.write2(&rest[..split], &rest[split..end]);
            let m = reader.read(&mut out[..r + 1]);
            assert_eq!(&out[..m], &pattern[got..got + m]);
            got += m;
            assert!(got <= sent);
        }
        // Everything written is read, and an empty ring reads nothing.
        while got < sent {
            let m = reader.read(&mut out);
            assert!(m > 0);
            assert_eq!(&out[..m], &pattern[got..got + m]);
            got += m;
        }
        assert_eq!(reader.read(&mut out), 0);
        assert_eq!(reader.readable(), 0);
    }

    #[test]
    fn stale_payload_bytes_never_pass_for_a_record() {
        let (writer, reader) = ring_pair("stale-");
        // Lap 1: 16 records of 64 KiB fill the ring; every 8-byte word of
        // their payload holds the number a lap-2 record starting there
        // would carry (small records, one per cache line).
        let per = MAX_RECORD - RECORD_WORD;
        let laps_records = (RING_BYTES / MAX_RECORD) as u64;
        let mut out = vec![0u8; MAX_RECORD];
        for k in 0..laps_records {
            let base = k * MAX_RECORD as u64 + RECORD_WORD as u64;
            let payload: Vec<u8> = (0..per / 8)
                .flat_map(|w| {
                    let q = base + 8 * w as u64;
                    (laps_records + 1 + q / RECORD_ALIGN).to_le_bytes()
                })
                .collect();
            assert_eq!(writer.write2(&payload, &[]), per);
            assert_eq!(reader.read(&mut out), per);
            assert_eq!(&out[..per], &payload[..]);
        }
        // Lap 2: one small record; the slot after it held lap-1 payload
        // equal to the next number, and must not read as a record.
        assert_eq!(writer.write2(b"header-and-a-small-payload", &[]), 26);
        assert_eq!(reader.read(&mut out), 26);
        assert_eq!(reader.readable(), 0);
        assert_eq!(reader.read(&mut out), 0);
        assert_eq!(writer.write2(b"next", &[]), 4);
        assert_eq!(reader.read(&mut out), 4);
        assert_eq!(&out[..4], b"next");
    }

    #[test]
    fn whole_records_are_all_or_nothing_and_mix_with_byte_reads() {
        let (writer, reader) = ring_pair("whole-");
        let mut out = vec![0u8; MAX_RECORD];
        // Fill the ring with whole records until one no longer fits: that
        // one writes nothing at all.
        // 1070 bytes: records of 1088 bytes, which do not divide the ring,
        // so some straddle its end.
        let msg: Vec<u8> = (0..1070u32).map(|i| (i % 253) as u8).collect();
        let mut written = 0;
        while writer.write_whole(&msg[..40], &msg[40..]) {
            written += 1;
        }
        let per = record_end(0, msg.len()) as usize;
        assert_eq!(written, RING_BYTES / per);
        assert!(writer.write2(&[], &[]) == 0);
        // Read them back alternately lent whole and copied byte-wise; the
        // reads free room, and a record that would wrap around the ring's
        // end is never lent (it is read byte-wise instead).
        let mut wrapped_seen = false;
        for k in 0..4 * written {
            if k >= written {
                assert!(
                    writer.write_whole(&msg[..40], &msg[40..]),
                    "room after reads"
                );
            }
            let at = (reader.at.get() % RING_BYTES as u64) as usize;
            let wraps = at + RECORD_WORD + msg.len() > RING_BYTES;
            match reader.peek() {
                Some(rec) if k % 2 == 0 => {
                    assert!(!wraps);
                    assert_eq!(rec, &msg[..]);
                    reader.consumed(rec.len(), rec.len());
                }
                lent => {
                    assert!(lent.is_some() != wraps);
                    wrapped_seen |= wraps;
                    // Part of the record, then the rest: nothing is lent
                    // while the record is half read.
                    assert_eq!(reader.read(&mut out[..10]), 10);
                    assert!(reader.peek().is_none());
                    assert_eq!(reader.read(&mut out[10..msg.len()]), msg.len() - 10);
                    assert_eq!(&out[..msg.len()], &msg[..]);
                }
            }
        }
        assert!(wrapped_seen, "some record straddled the ring's end");
        assert!(reader.peek().is_none(), "an empty ring lends nothing");
        assert!(!writer.write_whole(&[], &[]));
        assert!(!writer.write_whole(&vec![0u8; MAX_RECORD + 1], &[]));
    }
}
