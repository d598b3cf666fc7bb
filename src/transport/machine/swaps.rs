//! Two cores swapping payloads they each just wrote, both at once (an
//! exchange, every step of a ring), the rings' way and single copy's way:
//! which is faster for a rank that sends while it receives. Measured, not
//! inferred from one way's rates: how much a core's own copy into the
//! ring costs depends on where its payload sits (its own cache, a shared
//! one it has nearly to itself, memory), and a machine's caches decide it.

use super::{pinned_pair, spin_until, two_cores};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The sizes swapped, in MiB: where the rings' extra copy leaves a core's
/// own cache, a shared one, and (on most machines) both.
pub const SIZES_MIB: [usize; 3] = [1, 4, 16];

/// Single copy's time per swap in thousandths of the rings', at each of
/// `SIZES_MIB`: the median of `PASSES` passes (each the best of its rounds
/// each way, the slower of the two cores), as a machine busy for a moment
/// moves one pass's ratio by half or more. None with fewer than two
/// usable cores, or when a thread cannot start or the other stalls.
pub fn single_copy_permille() -> Option<[u32; 3]> {
    let mut passes = Vec::with_capacity(PASSES);
    for _ in 0..PASSES {
        passes.push(one_pass()?);
    }
    Some(std::array::from_fn(|i| {
        let mut at: Vec<u32> = passes.iter().map(|p| p[i]).collect();
        at.sort_unstable();
        at[at.len() / 2]
    }))
}

/// Passes of the swaps (an odd number: the median is one of them).
const PASSES: usize = 3;

fn one_pass() -> Option<[u32; 3]> {
    let (c0, c1) = two_cores()?;
    let mut out = [0u32; 3];
    for (slot, mib) in out.iter_mut().zip(SIZES_MIB) {
        let area = Arc::new(SwapArea::new(mib << 20));
        let (theirs, mine) = (area.clone(), area.clone());
        let (b, a) = pinned_pair(
            (c1, move || theirs.swap_rounds(1)),
            (c0, move || mine.swap_rounds(0)),
            || area.stop.store(true, Ordering::Release),
        )?;
        let ((ring_a, cma_a), (ring_b, cma_b)) = (a?, b?);
        let (ring, cma) = (ring_a.max(ring_b), cma_a.max(cma_b));
        let permille = cma.as_nanos() * 1000 / ring.as_nanos().max(1);
        *slot = permille.clamp(1, u128::from(u32::MAX)) as u32;
    }
    Some(out)
}

/// One core's side: the payload it writes and sends, the one it
/// receives, and the ring it sends through (64 KiB slots, 1 MiB, as a
/// pair's ring), with its counts of pieces written and freed.
struct Side {
    src: *mut u8,
    dst: *mut u8,
    ring: *mut u8,
    written: AtomicU64,
    freed: AtomicU64,
    /// The last step this side reached (see `SwapArea::meet`).
    step: AtomicU64,
}

struct SwapArea {
    bytes: usize,
    sides: [Side; 2],
    stop: AtomicBool,
}

// SAFETY: each buffer is touched only as the counters allow: a side
// writes its own `src` only between the steps where nobody reads it, its
// own ring's free slots and its own `dst`; it reads the other's filled
// slots, and the other's `src` only between the steps where that stays
// unchanged.
unsafe impl Send for SwapArea {}
unsafe impl Sync for SwapArea {}

impl SwapArea {
    const PIECE: usize = 64 << 10;
    const SLOTS: usize = 16;
    /// The first round also faults the pages in.
    const ROUNDS: u64 = 4;
    /// The longest either thread waits for the other.
    const PATIENCE: Duration = Duration::from_millis(200);

    fn new(bytes: usize) -> SwapArea {
        let leak = |n: usize| Box::into_raw(vec![0u8; n].into_boxed_slice()).cast::<u8>();
        let side = || Side {
            src: leak(bytes),
            dst: leak(bytes),
            ring: leak(Self::PIECE * Self::SLOTS),
            written: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            step: AtomicU64::new(0),
        };
        SwapArea {
            bytes,
            sides: [side(), side()],
            stop: AtomicBool::new(false),
        }
    }

    /// Spins until `ready` holds; false when stopped or out of patience.
    fn wait(&self, ready: impl Fn() -> bool) -> bool {
        spin_until(&self.stop, Self::PATIENCE, ready)
    }

    /// Side `me` reaches `step` and waits for the other to reach it too.
    fn meet(&self, me: usize, step: u64) -> bool {
        self.sides[me].step.store(step, Ordering::Release);
        self.wait(|| self.sides[1 - me].step.load(Ordering::Acquire) >= step)
    }

    /// Side `me`'s rounds: the best time of each way.
    fn swap_rounds(&self, me: usize) -> Option<(Duration, Duration)> {
        let (mine, theirs) = (&self.sides[me], &self.sides[1 - me]);
        let pieces = (self.bytes / Self::PIECE) as u64;
        let (mut ring, mut cma) = (Duration::MAX, Duration::MAX);
        let mut step = 0;
        for r in 0..Self::ROUNDS {
            // Through the rings: each side copies its payload in and the
            // other's out, piece by piece, as the ring has room.
            // SAFETY: our own source; the other reads it only through the
            // ring (below) or between the single-copy steps.
            unsafe { std::ptr::write_bytes(mine.src, (2 * r + me as u64) as u8, self.bytes) };
            step += 1;
            if !self.meet(me, step) {
                return None;
            }
            let t = Instant::now();
            let base = r * pieces;
            let (mut sent, mut got) = (0u64, 0u64);
            let give_up = t + Self::PATIENCE;
            let mut idle = 0u32;
            while sent < pieces || got < pieces {
                let mut moved = false;
                let n = base + sent;
                if sent < pieces && n < mine.freed.load(Ordering::Acquire) + Self::SLOTS as u64 {
                    let slot = (n as usize % Self::SLOTS) * Self::PIECE;
                    // SAFETY: piece `sent` of our source into a slot the
                    // other side freed.
                    unsafe {
                        crate::copy::copy_nonoverlapping(
                            mine.src.add(sent as usize * Self::PIECE),
                            mine.ring.add(slot),
                            Self::PIECE,
                        )
                    };
                    mine.written.store(n + 1, Ordering::Release);
                    sent += 1;
                    moved = true;
                }
                let n = base + got;
                if got < pieces && theirs.written.load(Ordering::Acquire) > n {
                    let slot = (n as usize % Self::SLOTS) * Self::PIECE;
                    // SAFETY: a slot the other side filled, into piece
                    // `got` of our destination.
                    unsafe {
                        crate::copy::copy_nonoverlapping(
                            theirs.ring.add(slot),
                            mine.dst.add(got as usize * Self::PIECE),
                            Self::PIECE,
                        )
                    };
                    theirs.freed.store(n + 1, Ordering::Release);
                    got += 1;
                    moved = true;
                }
                if !moved {
                    std::hint::spin_loop();
                    idle = idle.wrapping_add(1);
                    if idle.is_multiple_of(1024)
                        && (self.stop.load(Ordering::Acquire) || Instant::now() >= give_up)
                    {
                        return None;
                    }
                }
            }
            ring = ring.min(t.elapsed());
            // Single copy: each side writes its payload anew, then copies
            // the other's straight out of its memory.
            step += 1;
            if !self.meet(me, step) {
                return None;
            }
            // SAFETY: as above; the other reads it only after the next step.
            unsafe { std::ptr::write_bytes(mine.src, (2 * r + me as u64 + 7) as u8, self.bytes) };
            step += 1;
            if !self.meet(me, step) {
                return None;
            }
            let t = Instant::now();
            // SAFETY: our destination, whole; nobody else touches it.
            let dst = unsafe { std::slice::from_raw_parts_mut(mine.dst, self.bytes) };
            crate::transport::channel::read_remote(
                std::process::id() as i32,
                theirs.src as u64,
                dst,
            )
            .ok()?;
            cma = cma.min(t.elapsed());
            step += 1;
            if !self.meet(me, step) {
                return None;
            }
        }
        Some((ring, cma))
    }
}

impl Drop for SwapArea {
    fn drop(&mut self) {
        for side in &self.sides {
            for (p, n) in [
                (side.src, self.bytes),
                (side.dst, self.bytes),
                (side.ring, Self::PIECE * Self::SLOTS),
            ] {
                // SAFETY: leaked in `new` as boxed slices of these lengths.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)) });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swapping_gives_a_ratio_at_each_size() {
        if two_cores().is_none() {
            eprintln!("skipped: one usable core");
            return;
        }
        let probe = [1u8; 64];
        let mut into = [0u8; 64];
        let pid = std::process::id() as i32;
        if crate::transport::channel::read_remote(pid, probe.as_ptr() as u64, &mut into).is_err() {
            eprintln!("skipped: process_vm_readv is refused here");
            return;
        }
        // A thread preempted past the patience gives None: tried again.
        let r = (0..5)
            .find_map(|_| single_copy_permille())
            .expect("five tries, none measured");
        eprintln!("single copy / rings at {SIZES_MIB:?} MiB: {r:?} per mille");
        assert!(r.iter().all(|&p| (50..20_000).contains(&p)), "{r:?}");
    }
}
