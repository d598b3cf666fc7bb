//! The doorbell a rank sleeps on while its peers are in shared memory
//! (a futex word in its own segment), and the membarrier registration
//! that lets ringing it skip a fence.

use super::segment::Segment;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

impl Segment {
    /// The doorbell of the rank that owns this segment (in its own slot).
    pub fn doorbell(self: &Arc<Self>, owner: usize, asymmetric: bool) -> Doorbell {
        assert!(
            (owner + 1) * self.slot_bytes() <= self.len,
            "doorbell slot out of the segment"
        );
        // SAFETY: inside the mapping; the two words sit on separate lines.
        let ctl = unsafe { self.base.add(owner * self.slot_bytes()) };
        Doorbell {
            _segment: self.clone(),
            bell: ctl.cast(),
            // SAFETY: 64 bytes in, inside the control block.
            sleeping: unsafe { ctl.add(64) }.cast(),
            asymmetric,
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
            crate::transport::futex::wake_all(self.bell());
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
        // Returns at once if the counter already moved on.
        crate::transport::futex::wait(self.bell(), seen, timeout);
        self.done();
    }

    pub fn done(&self) {
        self.sleeping().store(0, Ordering::SeqCst);
    }
}

/// Registers this process for expedited global membarriers; false where
/// the kernel has none (then doorbells use a fence on both sides).
/// `wanted` false (RDIST_NO_MEMBARRIER) skips it.
pub(super) fn register_membarrier(wanted: bool) -> bool {
    if !wanted {
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
