//! The crate's one source of random bytes (job ids, nonces, cookies,
//! the launcher's tokens): the kernel's getrandom(2), else /dev/urandom.

use std::io::{self, Read};

/// Fills `out` with random bytes from the kernel. A machine with neither
/// getrandom(2) (Linux before 3.17) nor /dev/urandom gets bytes hashed
/// from the time, the pid and a counter: unique enough to tell jobs
/// apart, never secret (no token can be made safe there).
pub fn fill(out: &mut [u8]) {
    let mut filled = 0;
    while filled < out.len() {
        // SAFETY: writes at most the remaining length into our slice.
        let n =
            unsafe { libc::getrandom(out[filled..].as_mut_ptr().cast(), out.len() - filled, 0) };
        if n > 0 {
            filled += n as usize;
            continue;
        }
        if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(out));
        if read.is_err() {
            from_time(out);
        }
        return;
    }
}

fn from_time(out: &mut [u8]) {
    use sha2::{Digest, Sha256};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    for (i, chunk) in out.chunks_mut(32).enumerate() {
        let mut h = Sha256::new();
        h.update(now.to_le_bytes());
        h.update(std::process::id().to_le_bytes());
        h.update(COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        h.update((i as u64).to_le_bytes());
        chunk.copy_from_slice(&h.finalize()[..chunk.len()]);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_fills_differ_and_cover_every_byte() {
        let (mut a, mut b) = ([0u8; 100], [0u8; 100]);
        super::fill(&mut a);
        super::fill(&mut b);
        assert_ne!(a, b);
        // 100 zero bytes at the end would mean the fill stopped short.
        assert!(a[68..].iter().any(|x| *x != 0) && b[68..].iter().any(|x| *x != 0));
        let mut c = [0u8; 70];
        super::from_time(&mut c);
        assert!(c[64..].iter().any(|x| *x != 0));
    }
}
