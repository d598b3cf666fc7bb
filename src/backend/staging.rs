//! Staging: device buffers that the socket backend reaches through host
//! copies (copy in, run on the host copies, copy back), with a pool of
//! host buffers and events kept between calls.

use super::cuda::{self, ContextGuard, Event, Stream};
use crate::call::{Call, RawBuf};
use crate::error::Result;
use std::time::Instant;

/// Host buffers kept for the next staged call (allocating and faulting
/// in fresh pages per call costs more than the copies).
const POOLED: usize = 4;

/// What staged calls keep between calls: host buffers, and one event per
/// context to wait on copies with.
#[derive(Default)]
pub(crate) struct StagingPool {
    bufs: Vec<Vec<u8>>,
    events: Vec<(usize, Event)>,
}

impl StagingPool {
    /// Records an event for `context` on `stream` and waits for it.
    fn wait(
        &mut self,
        context: usize,
        stream: Stream,
        deadline: Instant,
        what: &str,
    ) -> Result<()> {
        let i = match self.events.iter().position(|(c, _)| *c == context) {
            Some(i) => i,
            None => {
                self.events.push((context, Event::new()?));
                self.events.len() - 1
            }
        };
        let event = &self.events[i].1;
        event.record_on(stream)?;
        event.wait(deadline, what)
    }
}

/// A host buffer of `len` bytes from `pool` (its old bytes are overwritten
/// by the copy in), or a new one.
fn take(pool: &mut Vec<Vec<u8>>, len: usize) -> Vec<u8> {
    let mut buf = match pool.iter().position(|b| b.capacity() >= len) {
        Some(i) => pool.swap_remove(i),
        None => Vec::new(),
    };
    buf.resize(len, 0);
    buf
}

/// Returns `buf` to `pool`; a full pool keeps its largest buffers (the
/// sizes in use now, not those of earlier calls).
fn give_back(pool: &mut Vec<Vec<u8>>, buf: Vec<u8>) {
    if pool.len() < POOLED {
        pool.push(buf);
        return;
    }
    if let Some(smallest) = pool.iter_mut().min_by_key(|b| b.capacity()) {
        if smallest.capacity() < buf.capacity() {
            *smallest = buf;
        }
    }
}

/// Host copies of a batch's device buffers. Overlapping buffers (in-place
/// calls) share one copy, so the host call sees the same aliasing.
pub(crate) struct Staging {
    regions: Vec<Region>,
}

struct Region {
    device: usize,
    len: usize,
    context: usize,
    stream: Stream,
    /// Some call reads from it: copy in before the host call.
    read: bool,
    /// Some call writes to it: copy back after.
    written: bool,
    host: Vec<u8>,
}

impl Staging {
    pub(crate) fn new(mut bufs: Vec<(RawBuf, bool, usize, Stream)>) -> Staging {
        bufs.sort_by_key(|(b, ..)| b.addr());
        let mut regions: Vec<Region> = Vec::new();
        for (buf, read, context, stream) in bufs {
            let end = buf.addr() + buf.len();
            match regions.last_mut() {
                Some(r) if buf.addr() < r.device + r.len && r.context == context => {
                    r.len = r.len.max(end - r.device);
                    r.read |= read;
                    r.written |= !read;
                }
                _ => regions.push(Region {
                    device: buf.addr(),
                    len: buf.len(),
                    context,
                    stream,
                    read,
                    written: !read,
                    host: Vec::new(),
                }),
            }
        }
        Staging { regions }
    }

    /// Copies the device buffers in, runs `host` on calls rewritten to the
    /// host copies, copies the results back. Every GPU wait ends by
    /// `deadline`. Returns once the results are in device memory.
    ///
    /// # Safety
    /// The calls' buffers valid until this returns.
    pub(crate) unsafe fn run(
        mut self,
        calls: &[Call],
        deadline: Instant,
        pool: &mut StagingPool,
        host: impl FnOnce(&[Call]) -> Result<()>,
    ) -> Result<()> {
        for r in &mut self.regions {
            r.host = take(&mut pool.bufs, r.len);
        }
        let result = self.copy_run_copy(calls, deadline, pool, host);
        for r in &mut self.regions {
            give_back(&mut pool.bufs, std::mem::take(&mut r.host));
        }
        result
    }

    unsafe fn copy_run_copy(
        &mut self,
        calls: &[Call],
        deadline: Instant,
        pool: &mut StagingPool,
        host: impl FnOnce(&[Call]) -> Result<()>,
    ) -> Result<()> {
        // Only regions read are copied in: a call writes every byte of
        // each receive buffer it has (those a rank does not use, like a
        // non-root's in reduce, are empty in its Call), so the copy back
        // never returns bytes the call left alone.
        for r in self.regions.iter_mut().filter(|r| r.read) {
            let _ctx = ContextGuard::push(r.context)?;
            cuda::copy_to_host(r.host.as_mut_ptr(), r.device, r.len, r.stream)?;
            pool.wait(
                r.context,
                r.stream,
                deadline,
                "copying a device buffer to the host",
            )?;
        }
        let staged: Vec<Call> = calls
            .iter()
            .map(|c| c.with_buffers(|b, _| self.host_view(b)))
            .collect();
        host(&staged)?;
        for r in &self.regions {
            if r.written {
                let _ctx = ContextGuard::push(r.context)?;
                cuda::copy_to_device(r.device, r.host.as_ptr(), r.len, r.stream)?;
                pool.wait(
                    r.context,
                    r.stream,
                    deadline,
                    "copying a result back to the device",
                )?;
            }
        }
        Ok(())
    }

    /// The host copy standing for `buf` (`buf` itself when it is host
    /// memory).
    fn host_view(&mut self, buf: RawBuf) -> RawBuf {
        if buf.is_empty() {
            return buf;
        }
        for r in &mut self.regions {
            if buf.addr() >= r.device && buf.addr() + buf.len() <= r.device + r.len {
                let at = buf.addr() - r.device;
                // Derived from a mutable borrow: the host call writes here.
                return RawBuf::new(r.host[at..].as_mut_ptr(), buf.len());
            }
        }
        buf
    }
}
