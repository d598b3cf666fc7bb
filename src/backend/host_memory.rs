//! Addresses that are host memory whatever the CUDA driver would say: the
//! brk heap (where malloc keeps the main thread's small allocations) and
//! the live part of the calling thread's stack. The driver maps device
//! memory into neither (both are single mappings of their own, and a
//! caller's buffer on its stack lies between the stack pointer and the
//! stack's top), and asking it (`cuPointerGetAttributes`) costs every call
//! a buffer's kind is needed for, on every machine with a GPU, host
//! buffers included. Anything else is still asked.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Whether `addr` is in the brk heap or in the calling thread's live stack.
#[inline]
pub(crate) fn surely_host(addr: usize) -> bool {
    in_heap(addr) || in_live_stack(addr)
}

/// Whether `addr` lies in the brk heap as it is now.
#[inline]
fn in_heap(addr: usize) -> bool {
    let Some((start, brk)) = heap() else {
        return false;
    };
    // SAFETY: glibc's current break, an aligned word it keeps; read,
    // never written (sbrk(0) may write it, racing a first malloc
    // elsewhere).
    let end = unsafe { (*brk).load(Ordering::Relaxed) };
    addr >= start && addr < end
}

/// Where the brk heap starts (`start_brk`, field 47 of /proc/self/stat)
/// and glibc's word holding the current break (`__curbrk`); None where
/// either is missing (another C library: no heap fast path then).
fn heap() -> Option<(usize, *const AtomicUsize)> {
    static HEAP: OnceLock<Option<(usize, usize)>> = OnceLock::new();
    let h = HEAP.get_or_init(|| {
        // SAFETY: looks a data symbol up in the loaded objects.
        let brk = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__curbrk".as_ptr()) };
        let aligned = (brk as usize).is_multiple_of(std::mem::align_of::<AtomicUsize>());
        (!brk.is_null() && aligned).then(|| (heap_start(), brk as usize))
    });
    h.filter(|(start, _)| *start != 0)
        .map(|(start, brk)| (start, brk as *const AtomicUsize))
}

/// `start_brk` from /proc/self/stat (0 where it cannot be read).
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

/// Whether `addr` lies between the calling thread's stack pointer and its
/// stack's top: the main thread's reported range reaches down to the next
/// mapping (or further, with an unlimited stack limit), where later
/// mappings may land; the part in use is the stack's own.
#[inline]
fn in_live_stack(addr: usize) -> bool {
    let sp = stack_pointer();
    STACK
        .try_with(|s| {
            let (low, high) = s.get().unwrap_or_else(|| {
                let bounds = own_stack();
                s.set(Some(bounds));
                bounds
            });
            // Off the thread's stack (a signal stack, a fiber): not known.
            low <= sp && sp < high && addr >= sp && addr < high
        })
        .unwrap_or(false)
}

/// About where the stack pointer is: a local of a frame of its own, below
/// every caller's.
#[inline(never)]
fn stack_pointer() -> usize {
    let here = 0u8;
    std::hint::black_box(&here) as *const u8 as usize
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
        (base as usize, (base as usize).saturating_add(size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locals_and_the_heap_are_host_and_a_fresh_mapping_is_not_known() {
        let local = [0u8; 64];
        assert!(surely_host(local.as_ptr() as usize), "a local");
        // Below the stack pointer: not the live stack.
        assert!(!in_live_stack(stack_pointer() - 4096));
        // The heap's first byte, where glibc's break is known (a test
        // runs on a thread of its own, whose allocations come from another
        // arena of malloc's, so the heap is not this test's to size).
        if let Some((start, _)) = heap() {
            assert!(surely_host(start));
        }
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
        assert!(!in_live_stack(theirs.0), "seen from this one");
        assert!(!surely_host(0));
    }
}
