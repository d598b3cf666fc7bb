//! A rank's shared-memory segment: its layout (one slot of control block
//! and ring per rank), naming, creating or opening, mapping and unlinking.

use crate::error::{Error, Result};
use crate::transport::doorbell::Doorbell;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// Bytes of one ring's data area, with few ranks on the host.
pub const RING_BYTES: usize = 1 << 20;
/// ... and the least, however many ranks share the host (twice the
/// largest record).
pub const MIN_RING_BYTES: usize = 128 << 10;
/// What the rings of one host may hold at most, every ring full: each
/// pair of ranks has two (one each way, for both contexts), and a page
/// once written stays in memory (a memfd counts against tmpfs-like
/// limits; a full one kills the rank that touches a new page with SIGBUS).
const HOST_RINGS_BYTES: usize = 4 << 30;
/// Control block: head and tail on separate cache lines.
pub(super) const CTL_BYTES: usize = 128;

/// The ring size for `local_ranks` ranks on one host: 1 MiB up to 64
/// ranks, shrinking by halves to 128 KiB from 256. Every rank of the host
/// computes the same from the same count, as both ends of a ring must.
pub fn ring_bytes_for(local_ranks: usize) -> usize {
    let rings = local_ranks * local_ranks.saturating_sub(1);
    let fit = HOST_RINGS_BYTES / rings.max(1);
    let pow2 = if fit.is_power_of_two() {
        fit
    } else {
        fit.next_power_of_two() / 2
    };
    pow2.clamp(MIN_RING_BYTES, RING_BYTES)
}

/// A mapped segment; unmapped on drop.
pub struct Segment {
    pub(super) base: *mut u8,
    pub(super) len: usize,
    /// Bytes of each ring's data area (see `ring_bytes_for`).
    pub(super) ring_bytes: usize,
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

impl Segment {
    /// Bytes of one slot: a control block and a ring.
    pub(super) fn slot_bytes(&self) -> usize {
        CTL_BYTES + self.ring_bytes
    }

    /// Creates a segment that has no name at all (memfd): peers open it
    /// through /proc/<pid>/fd/<fd> (see `open_of`), so nothing is ever left
    /// in /dev/shm, whenever and however the rank ends. Returns the
    /// descriptor, which must stay open for peers to find it.
    pub fn create_private(slots: usize, ring_bytes: usize) -> Result<(Segment, OwnedFd)> {
        let len = slots * (CTL_BYTES + ring_bytes);
        // SAFETY: memfd_create with a valid C string; the result is checked.
        let fd = unsafe {
            libc::memfd_create(
                c"rdist-rings".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(Error::system(
                "memfd_create for shared memory",
                &io::Error::last_os_error(),
            ));
        }
        // SAFETY: a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::system(
                format!("sizing shared memory ({len} bytes)"),
                &io::Error::last_os_error(),
            ));
        }
        // Sealed at its size: the size peers check when they open it
        // stays true, so no mapping can outlive the file's end (SIGBUS).
        // SAFETY: fcntl on our own descriptor with integer arguments.
        unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        let seg = Segment::map_fd(fd.as_raw_fd(), len, ring_bytes)?;
        Ok((seg, fd))
    }

    /// Maps the segment that process `pid` created with `create_private`
    /// and holds open as descriptor `fd`, when this process may (same
    /// user, same PID namespace). Fails on a size other than the layout's,
    /// so a stale or foreign descriptor is never taken for rings; the
    /// caller checks the owner's cookie too (see shm::attach).
    pub fn open_of(pid: i32, fd: i32, slots: usize, ring_bytes: usize) -> Result<Segment> {
        let len = slots * (CTL_BYTES + ring_bytes);
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::system(format!("opening {path}"), &e))?;
        let size = file
            .metadata()
            .map_err(|e| Error::system(format!("stat {path}"), &e))?
            .len();
        if size != len as u64 {
            return Err(Error::internal(format!(
                "{path} has {size} bytes, not the {len} of a segment"
            )));
        }
        Segment::map_fd(file.as_raw_fd(), len, ring_bytes)
    }

    fn map_fd(fd: i32, len: usize, ring_bytes: usize) -> Result<Segment> {
        // SAFETY: maps `len` bytes of a descriptor we hold; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::system(
                "mapping shared memory",
                &io::Error::last_os_error(),
            ));
        }
        Ok(Segment {
            base: base.cast(),
            len,
            ring_bytes,
        })
    }

    /// The unused ring area of `slot` (a rank's own slot holds only its
    /// doorbell): where the owner leaves its cookie.
    pub(super) fn spare(&self, slot: usize, bytes: usize) -> *mut u8 {
        assert!(bytes <= self.ring_bytes && (slot + 1) * self.slot_bytes() <= self.len);
        // SAFETY: inside the mapping (checked above).
        unsafe { self.base.add(slot * self.slot_bytes() + CTL_BYTES) }
    }
}

impl Segment {
    /// The doorbell of the rank that owns this segment (in its own slot).
    pub fn doorbell(self: &Arc<Self>, owner: usize, asymmetric: bool) -> Doorbell {
        assert!(
            (owner + 1) * self.slot_bytes() <= self.len,
            "doorbell slot out of the segment"
        );
        // SAFETY: inside the mapping; the two words sit on separate lines.
        let ctl = unsafe { self.base.add(owner * self.slot_bytes()) };
        // SAFETY: the words are inside the mapping, which the doorbell's
        // clone of the segment keeps.
        unsafe {
            Doorbell::at(
                self.clone(),
                ctl.cast(),
                // 64 bytes in, inside the control block.
                ctl.add(64).cast(),
                asymmetric,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Wide hosts get smaller rings, so that every ring of the host full
    /// stays within the budget (down to the floor).
    #[test]
    fn rings_shrink_as_the_host_fills() {
        assert_eq!(ring_bytes_for(1), RING_BYTES);
        assert_eq!(ring_bytes_for(8), RING_BYTES);
        assert_eq!(ring_bytes_for(64), RING_BYTES);
        assert_eq!(ring_bytes_for(128), 256 << 10);
        assert_eq!(ring_bytes_for(256), MIN_RING_BYTES);
        assert_eq!(ring_bytes_for(1024), MIN_RING_BYTES);
        for n in [2, 16, 33, 48, 64, 90, 128] {
            let r = ring_bytes_for(n);
            assert!(
                r.is_power_of_two() && n * (n - 1) * r <= HOST_RINGS_BYTES,
                "{n}: {r}"
            );
        }
    }
}
