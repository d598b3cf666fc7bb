//! Addresses that are host memory whatever the CUDA driver would say: the
//! brk heap (where malloc keeps small allocations) and the calling
//! thread's stack. The driver never maps device memory there, and asking
//! it (`cuPointerGetAttributes`) costs every call a buffer's kind is
//! needed for, on every machine with a GPU, host buffers included.

use std::cell::Cell;
use std::sync::OnceLock;

/// Whether `addr` is in the brk heap or in the calling thread's stack.
#[inline]
pub(crate) fn surely_host(addr: usize) -> bool {
    in_heap(addr) || in_own_stack(addr)
}

/// Whether `addr` lies in the brk heap as it is now.
#[inline]
fn in_heap(addr: usize) -> bool {
    static START: OnceLock<usize> = OnceLock::new();
    let start = *START.get_or_init(heap_start);
    // SAFETY: sbrk(0) only reads the current break (no change).
    start != 0 && addr >= start && addr < unsafe { libc::sbrk(0) } as usize
}

/// Where the brk heap starts (`start_brk`, field 47 of /proc/self/stat;
/// 0 where it cannot be read: no fast path then).
fn heap_start() -> usize {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    // The command's name, in parentheses, may hold spaces: fields count
    // from after its closing one (which is field 2).
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    rest.split_whitespace()
        .nth(47 - 3)
        .and_then(|f| f.parse().ok())
        .unwrap_or(0)
}

thread_local! {
    /// The calling thread's stack, [low, high), looked up once per thread
    /// ((0, 0) where it cannot be).
    static STACK: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

/// Whether `addr` lies in the calling thread's stack.
#[inline]
fn in_own_stack(addr: usize) -> bool {
    STACK
        .try_with(|s| {
            let (low, high) = s.get().unwrap_or_else(|| {
                let bounds = own_stack();
                s.set(Some(bounds));
                bounds
            });
            addr >= low && addr < high
        })
        .unwrap_or(false)
}

/// The calling thread's stack as pthread reports it.
fn own_stack() -> (usize, usize) {
    // SAFETY: pthread_getattr_np fills an attribute object that is
    // destroyed after; pthread_attr_getstack writes the two outputs.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return (0, 0);
        }
        let mut base: *mut libc::c_void = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        let rc = libc::pthread_attr_getstack(&attr, &mut base, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        if rc != 0 || base.is_null() {
            return (0, 0);
        }
        (base as usize, base as usize + size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_allocations_and_locals_are_host_and_a_fresh_mapping_is_not_known() {
        let local = [0u8; 64];
        assert!(surely_host(local.as_ptr() as usize), "a local");
        // The heap's first and last bytes (a test runs on a thread of its
        // own, whose allocations come from another arena of malloc's).
        let start = heap_start();
        // SAFETY: reads the break.
        let end = unsafe { libc::sbrk(0) } as usize;
        assert!(start != 0 && start <= end, "{start:#x} {end:#x}");
        if start < end {
            assert!(surely_host(start) && surely_host(end - 1));
        }
        assert!(!in_heap(end));
        // A fresh anonymous mapping is neither: the driver is asked.
        // SAFETY: a plain anonymous mapping, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                1 << 20,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        assert!(!surely_host(p as usize));
        // SAFETY: mapped above, 1 MiB.
        unsafe { libc::munmap(p, 1 << 20) };
        // Another thread's stack is not this thread's.
        let theirs = std::thread::spawn(|| {
            let x = [1u8; 16];
            (x.as_ptr() as usize, surely_host(x.as_ptr() as usize))
        })
        .join()
        .unwrap();
        assert!(theirs.1, "a local of that thread, seen from it");
        assert!(!in_own_stack(theirs.0), "seen from this one");
        assert!(!surely_host(0));
    }
}
