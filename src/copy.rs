//! Bulk byte copies that step around a slow path of glibc's memcpy.
//!
//! glibc copies from a few KiB up to about the L2 size with `rep movsb`. On
//! some x86 CPUs (measured on this project's AMD EPYC VM, glibc 2.36) that
//! instruction crawls when the destination lies just after the source
//! modulo 4 KiB: 32 KiB copied at 1-2 GB/s instead of 40 GB/s when
//! `(dst - src) % 4096` is 8, 16 or 24, and at half speed a few dozen bytes
//! either side. Two equal buffers malloc'd one after the other sit exactly
//! 16 bytes apart modulo 4 KiB, so a user's send and receive buffers hit it
//! (rdist-bench's 32 KiB allreduce: 34 us instead of 17 us). Such copies go
//! in 1 KiB pieces, which glibc moves with vector loads and stores at full
//! speed; every other copy is a plain memcpy. Other CPUs have no such path
//! and lose a fifth of the speed to the pieces (Intel's Sapphire Rapids),
//! so whether the CPU crawls is measured once per process (a few dozen
//! microseconds, up to a millisecond where it crawls) and the pieces are
//! used only where it does.

const PAGE: usize = 4096;
/// How close (modulo a page) destination and source must be to go in pieces.
const NEAR: usize = 64;
/// Below glibc's `rep movsb` threshold on every x86 it tunes for.
const PIECE: usize = 1024;
/// Smaller copies never take the `rep movsb` path.
const MIN_LEN: usize = 2 * PIECE;
/// The near distances the measurement tries (see `near_and_far_copy_times`).
const NEAR_DISTANCES: [usize; 3] = [8, 16, 24];
/// How much slower a near copy must be than a far one to call the path
/// slow (the EPYC's is ten to thirty times).
const SLOW_FACTOR: f64 = 1.5;

/// Copies `src` into `dst` (same length, like `copy_from_slice`).
#[inline]
pub fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between slices of unequal length"
    );
    // SAFETY: two live slices of `src.len()` bytes; `&mut` excludes overlap.
    unsafe { copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
}

/// `std::ptr::copy_nonoverlapping` (same arguments) without the slow path.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` valid for reads and `dst` for
/// writes of `len` bytes, the two not overlapping.
#[inline]
pub unsafe fn copy_nonoverlapping(src: *const u8, dst: *mut u8, len: usize) {
    if len < MIN_LEN || !in_pieces(dst as usize, src as usize, len) {
        // SAFETY: as the caller promises.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    // SAFETY: as the caller promises.
    unsafe { copy_in_pieces(src, dst, len) }
}

/// The pieces' loop, out of line: every small copy inlines the test above
/// and nothing more.
///
/// # Safety
/// As `copy_nonoverlapping`.
#[cold]
#[inline(never)]
unsafe fn copy_in_pieces(src: *const u8, dst: *mut u8, len: usize) {
    let mut at = 0;
    while at < len {
        let n = PIECE.min(len - at);
        // SAFETY: inside both ranges. black_box hides the address from the
        // optimiser, so the pieces are not fused back into one memcpy.
        unsafe { std::ptr::copy_nonoverlapping(std::hint::black_box(src.add(at)), dst.add(at), n) };
        at += n;
    }
}

/// Copies `len` bytes between ranges that may overlap (like `memmove`).
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes.
pub unsafe fn move_bytes(dst: *mut u8, src: *const u8, len: usize) {
    let (d, s) = (dst as usize, src as usize);
    if len == 0 || d == s {
        return;
    }
    if d + len <= s || s + len <= d {
        // SAFETY: disjoint, and valid for `len` bytes as the caller promises.
        unsafe { copy_nonoverlapping(src, dst, len) };
    } else {
        // SAFETY: as the caller promises; ptr::copy allows overlap.
        unsafe { std::ptr::copy(src, dst, len) };
    }
}

/// Out of line: only copies of `MIN_LEN` and more ask.
#[inline(never)]
fn in_pieces(dst: usize, src: usize, len: usize) -> bool {
    near(dst, src, len) && near_copies_crawl()
}

/// Whether a copy of `len` bytes from `src` to `dst` is one the slow path
/// may take.
fn near(dst: usize, src: usize, len: usize) -> bool {
    let ahead = dst.wrapping_sub(src) % PAGE;
    len >= MIN_LEN && ahead != 0 && !(NEAR..=PAGE - NEAR).contains(&ahead)
}

/// Whether this CPU's memcpy crawls on near copies, measured at first use.
fn near_copies_crawl() -> bool {
    static CRAWL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CRAWL.get_or_init(|| {
        let (near, far) = near_and_far_copy_times();
        near.as_secs_f64() > far.as_secs_f64() * SLOW_FACTOR
    })
}

/// The best time of a 32 KiB memcpy whose destination lies a few bytes
/// after its source modulo a page (the slowest of 8, 16 and 24: which of
/// them crawl differs between CPUs and microcode, the EPYC VM's crawled at
/// 16 one year and only at 8 the next), and of one 128 bytes after.
fn near_and_far_copy_times() -> (std::time::Duration, std::time::Duration) {
    const LEN: usize = 32 << 10;
    let src = vec![1u8; LEN + PAGE];
    let mut dst = vec![0u8; LEN + 2 * PAGE];
    // Both at a page's start plus 64, then the destination moved on.
    let s = src.as_ptr();
    let s = s.wrapping_add((64 + PAGE - s as usize % PAGE) % PAGE);
    let d0 = dst.as_mut_ptr();
    let d0 = d0.wrapping_add((64 + PAGE - d0 as usize % PAGE) % PAGE);
    let time = |ahead: usize| {
        let d = d0.wrapping_add(ahead);
        (0..8)
            .map(|_| {
                let t = std::time::Instant::now();
                // SAFETY: `s` and `d` leave LEN bytes inside their vectors
                // (each has a page and more to spare before the offset).
                unsafe { std::ptr::copy_nonoverlapping(std::hint::black_box(s), d, LEN) };
                std::hint::black_box(d);
                t.elapsed()
            })
            .min()
            .unwrap_or_default()
    };
    let near = NEAR_DISTANCES
        .into_iter()
        .map(time)
        .max()
        .unwrap_or_default();
    let far = time(128);
    drop(dst);
    (near, far)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_every_distance_and_length() {
        let mut arena = vec![0u8; 3 * PAGE + 40_000];
        for len in [0, 1, 7, MIN_LEN - 1, MIN_LEN, PIECE * 5 + 3, 33_000] {
            for gap in [0, 8, 16, 24, 40, 64, 100, PAGE - 48, PAGE - 8] {
                let src: Vec<u8> = (0..len).map(|i| (i * 31 + gap + len) as u8).collect();
                let (lo, hi) = arena.split_at_mut(PAGE);
                // Place the destination `gap` bytes after the source
                // modulo a page.
                let base = lo.as_ptr() as usize;
                let want = (src.as_ptr() as usize + gap).wrapping_sub(base) % PAGE;
                let dst = &mut hi[want..want + len];
                copy(dst, &src);
                assert!(dst == &src[..], "len {len} gap {gap}");
            }
        }
    }

    #[test]
    fn near_distances_are_told_from_others() {
        let s = 1 << 20;
        for ahead in [8, 16, 24, 40, 56, PAGE - 48, PAGE - 8] {
            assert!(near(s + ahead, s, 32 << 10), "{ahead}");
            assert!(near(s + 5 * PAGE + ahead, s, 32 << 10), "{ahead}");
        }
        for ahead in [0, 64, 128, 2048, PAGE - 64] {
            assert!(!near(s + ahead, s, 32 << 10), "{ahead}");
        }
        assert!(!near(s + 16, s, MIN_LEN - 1));
    }

    /// Whichever near distance crawls here, near copies go in pieces.
    #[test]
    fn a_crawl_at_any_near_distance_is_found() {
        let src = vec![1u8; (32 << 10) + PAGE];
        let mut dst = vec![0u8; (32 << 10) + 2 * PAGE];
        let s = src.as_ptr();
        let s = s.wrapping_add((64 + PAGE - s as usize % PAGE) % PAGE);
        let d0 = dst.as_mut_ptr();
        let d0 = d0.wrapping_add((64 + PAGE - d0 as usize % PAGE) % PAGE);
        let time = |ahead: usize| {
            (0..8)
                .map(|_| {
                    let t = std::time::Instant::now();
                    // SAFETY: 32 KiB from `s`, and from `d0 + ahead`, lie
                    // inside their vectors.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            std::hint::black_box(s),
                            d0.wrapping_add(ahead),
                            32 << 10,
                        )
                    };
                    t.elapsed()
                })
                .min()
                .unwrap_or_default()
        };
        let far = time(128);
        for ahead in NEAR_DISTANCES {
            let near = time(ahead);
            eprintln!("32 KiB memcpy, destination {ahead} B ahead: {near:?} (far {far:?})");
            // A crawl is ten times slower and more: clear of the noise.
            if near.as_secs_f64() > far.as_secs_f64() * 4.0 {
                assert!(
                    near_copies_crawl(),
                    "{ahead} B ahead crawls but near copies do not go in pieces"
                );
            }
        }
    }

    #[test]
    fn near_copies_go_in_pieces_only_on_a_cpu_where_they_crawl() {
        let (n, f) = near_and_far_copy_times();
        eprintln!("32 KiB memcpy: near {n:?}, far {f:?}");
        assert!(!n.is_zero() || !f.is_zero(), "no time measured");
        let s = 1 << 20;
        assert_eq!(in_pieces(s + 16, s, 32 << 10), near_copies_crawl());
        assert!(!in_pieces(s + 128, s, 32 << 10));
    }

    #[test]
    fn overlapping_moves_keep_memmove_semantics() {
        for (from, to, len) in [(0, 16, 9000), (16, 0, 9000), (0, 0, 100), (100, 5000, 4000)] {
            let mut buf: Vec<u8> = (0..20_000).map(|i| (i % 251) as u8).collect();
            let mut want = buf.clone();
            want.copy_within(from..from + len, to);
            let p = buf.as_mut_ptr();
            // SAFETY: both ranges lie inside `buf`.
            unsafe { move_bytes(p.add(to), p.add(from), len) };
            assert!(buf == want, "{from} -> {to}, {len} bytes");
        }
    }
}
