//! The doorbell a rank sleeps on while its peers' channels wake no
//! descriptor (shared memory): a futex word that every peer bumps after
//! writing to or reading from a channel shared with this rank, and the
//! membarrier registration that lets ringing it skip a fence. Its words
//! live in memory the rank shares with its peers (shm/ puts them in its
//! own segment).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A rank's doorbell: a counter that every peer bumps after writing to or
/// reading from a channel shared with this rank, plus a flag saying
/// whether this rank sleeps on it (futex), so a bump wakes it only then.
pub struct Doorbell {
    /// Keeps the memory of the two words mapped.
    _memory: Arc<dyn Send + Sync + std::panic::RefUnwindSafe>,
    bell: *const AtomicU32,
    sleeping: *const AtomicU32,
    /// Every rank registered for membarrier: the sleeper pays for the
    /// store-load barrier (a syscall, on the way to sleep) so that ringing
    /// needs none (a fence there waits for every store of the message to
    /// reach the peer: most of a small message's cost).
    asymmetric: bool,
}

// SAFETY: the words are shared memory, and every access goes through
// atomics, from any thread.
unsafe impl Send for Doorbell {}
unsafe impl Sync for Doorbell {}

impl Doorbell {
    /// The doorbell whose counter is at `bell` and sleeping flag at
    /// `sleeping` (aligned words on separate cache lines), inside memory
    /// that `memory` keeps mapped.
    ///
    /// # Safety
    /// Both words stay valid while `memory` lives.
    pub unsafe fn at(
        memory: Arc<dyn Send + Sync + std::panic::RefUnwindSafe>,
        bell: *const AtomicU32,
        sleeping: *const AtomicU32,
        asymmetric: bool,
    ) -> Doorbell {
        Doorbell {
            _memory: memory,
            bell,
            sleeping,
            asymmetric,
        }
    }

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
            super::futex::wake_all(self.bell());
        }
    }

    /// Announces that the owner (one of its threads) is about to sleep;
    /// returns the counter to pass to `sleep`. The owner must re-check for
    /// work after this.
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
        super::futex::wait(self.bell(), seen, timeout);
    }

    /// The owner is not going to sleep after all (it found work after
    /// `prepare`). The flag stays as it is: another thread of the owner
    /// may sleep on the bell too (the endpoint's, or a collective's), and
    /// clearing it would leave that one unwoken until its nap ends; a
    /// peer's next ring clears it, one wake too many at most.
    pub fn done(&self) {}
}

/// Registers this process for expedited global membarriers; false where
/// the kernel has none (then doorbells use a fence on both sides).
/// `wanted` false (RDIST_NO_MEMBARRIER) skips it.
pub fn register_membarrier(wanted: bool) -> bool {
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
