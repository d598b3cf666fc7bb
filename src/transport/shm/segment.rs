//! A rank's shared-memory segment: its layout (one slot of control block
//! and ring per rank), naming, creating or opening, mapping and unlinking.

use crate::error::{Error, Result};
use std::ffi::CString;
use std::io;

/// Bytes of one ring's data area.
pub const RING_BYTES: usize = 1 << 20;
/// Control block: head and tail on separate cache lines.
pub(super) const CTL_BYTES: usize = 128;
pub(super) const SLOT_BYTES: usize = CTL_BYTES + RING_BYTES;

/// A mapped segment; unmapped on drop.
pub struct Segment {
    pub(super) base: *mut u8,
    pub(super) len: usize,
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
}
