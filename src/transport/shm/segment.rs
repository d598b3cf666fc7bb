//! A rank's shared-memory segment: its layout (one slot of control block
//! and ring per rank), naming, creating or opening, mapping and unlinking.

use crate::error::{Error, Result};
use std::ffi::CString;
use std::io;

/// Bytes of one ring's data area, with few ranks on the host.
pub const RING_BYTES: usize = 1 << 20;
/// ... and the least, however many ranks share the host (twice the
/// largest record).
pub const MIN_RING_BYTES: usize = 128 << 10;
/// What the rings of one host may hold at most, every ring full: each
/// pair of ranks has three (collectives, and point-to-point both ways),
/// and a page once written stays in /dev/shm (tmpfs, often half the RAM;
/// a full one kills the rank that touches a new page with SIGBUS).
const HOST_RINGS_BYTES: usize = 4 << 30;
/// Control block: head and tail on separate cache lines.
pub(super) const CTL_BYTES: usize = 128;

/// The ring size for `local_ranks` ranks on one host: 1 MiB up to 32
/// ranks, shrinking by halves to 128 KiB from 128. Every rank of the host
/// computes the same from the same count, as both ends of a ring must.
pub fn ring_bytes_for(local_ranks: usize) -> usize {
    let rings = 3 * local_ranks * local_ranks.saturating_sub(1);
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

/// The /dev/shm name of `rank`'s segment in a communicator.
pub fn segment_name(job: &[u8; 16], comm_id: u64, rank: usize) -> String {
    let hex: String = job[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("/rdist-{hex}-{comm_id:016x}-{rank}")
}

impl Segment {
    /// Bytes of one slot: a control block and a ring.
    pub(super) fn slot_bytes(&self) -> usize {
        CTL_BYTES + self.ring_bytes
    }

    /// Creates (or, with `create == false`, opens) a segment of `slots`
    /// rings of `ring_bytes` each.
    pub fn map(name: &str, slots: usize, ring_bytes: usize, create: bool) -> Result<Segment> {
        let len = slots * (CTL_BYTES + ring_bytes);
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
                ring_bytes,
            })
        }
    }

    pub fn unlink(name: &str) {
        if let Ok(c) = CString::new(name) {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(c.as_ptr()) };
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
        assert_eq!(ring_bytes_for(32), RING_BYTES);
        assert_eq!(ring_bytes_for(64), 256 << 10);
        assert_eq!(ring_bytes_for(128), MIN_RING_BYTES);
        assert_eq!(ring_bytes_for(1024), MIN_RING_BYTES);
        for n in [2, 16, 33, 48, 64, 90] {
            let r = ring_bytes_for(n);
            assert!(
                r.is_power_of_two() && 3 * n * (n - 1) * r <= HOST_RINGS_BYTES,
                "{n}: {r}"
            );
        }
    }
}
