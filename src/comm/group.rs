//! rdist_group_start/end: per-thread, nestable. Calls made inside a group
//! are queued and run together at the outermost end, so that sends and
//! receives between the same ranks can't deadlock each other.

use super::queue::{Request, Runner};
use crate::backend::cuda::Stream;
use crate::call::Call;
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

struct Group {
    depth: usize,
    queued: Vec<(Arc<Runner>, Call, Stream)>,
    /// Tagged sends/receives, posted at once (they have their own
    /// context), waited for at the end.
    posted: Vec<Request>,
}

thread_local! {
    // Const-initialised: every blocking call asks `active()`, and a lazily
    // initialised thread-local costs a check more on each.
    static GROUP: RefCell<Group> = const {
        RefCell::new(Group {
            depth: 0,
            queued: Vec::new(),
            posted: Vec::new(),
        })
    };
}

/// Group levels open on all threads together: while none is, `active`
/// needs no look at the thread's own state (a thread-local in a shared
/// library is a call into the dynamic loader, on every blocking call).
/// A level left open by a thread that exits stays counted: the looks then
/// cost the thread-local again, nothing else.
static OPEN: AtomicUsize = AtomicUsize::new(0);

pub fn start() {
    GROUP.with(|g| {
        g.borrow_mut().depth += 1;
        OPEN.fetch_add(1, Ordering::Relaxed);
    });
}

#[inline]
pub fn active() -> bool {
    // A thread sees its own start in program order, so a group it opened
    // always counts here.
    OPEN.load(Ordering::Relaxed) != 0 && GROUP.with(|g| g.borrow().depth > 0)
}

/// Queues a call on `comm` for the current group.
pub(crate) fn enqueue(comm: Arc<Runner>, call: Call, stream: Stream) {
    GROUP.with(|g| g.borrow_mut().queued.push((comm, call, stream)));
}

/// Keeps a posted send/receive to wait for when the group ends.
pub(crate) fn wait_at_end(req: Request) {
    GROUP.with(|g| g.borrow_mut().posted.push(req));
}

/// Ends one level; the outermost end runs everything queued (each
/// communicator's calls in order, different communicators concurrently)
/// and reports the first error.
///
/// # Safety
/// Every queued call's buffers must still be valid (the C contract).
pub unsafe fn end() -> Result<()> {
    let (queued, posted) = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Error::invalid_usage(
                "rdist_group_end without a matching rdist_group_start",
            ));
        }
        g.depth -= 1;
        OPEN.fetch_sub(1, Ordering::Relaxed);
        if g.depth > 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let (queued, posted) = (std::mem::take(&mut g.queued), std::mem::take(&mut g.posted));
        // In a fork() child the calls are the parent's: they run nothing,
        // and are let go without touching what the parent's threads share.
        let foreign = (queued.iter().map(|(runner, ..)| runner.check_process()))
            .chain(posted.iter().map(Request::check_process))
            .find_map(Result::err);
        if let Some(e) = foreign {
            std::mem::forget((queued, posted));
            return Err(e);
        }
        Ok((queued, posted))
    })?;
    // Split by communicator, keeping each one's order.
    let mut per_comm: Vec<(Arc<Runner>, Vec<Call>, Vec<Stream>)> = Vec::new();
    for (comm, call, stream) in queued {
        match per_comm.iter_mut().find(|(c, ..)| Arc::ptr_eq(c, &comm)) {
            Some((_, calls, streams)) => {
                calls.push(call);
                streams.push(stream);
            }
            None => per_comm.push((comm, vec![call], vec![stream])),
        }
    }
    let mut first_error = None;
    // A communicator destroyed since its calls were queued runs none.
    per_comm.retain(
        |(comm, calls, _)| match comm.refuse_if_closed(calls.len()) {
            Ok(()) => true,
            Err(e) => {
                first_error.get_or_insert(e);
                false
            }
        },
    );
    // Device batches first, enqueued here in group order (see
    // `try_device_batch`); the rest run below, concurrently across
    // communicators.
    per_comm.retain(
        |(comm, calls, streams)| match comm.try_device_batch(calls, streams) {
            Some(r) => {
                if first_error.is_none() {
                    first_error = r.err();
                }
                false
            }
            None => true,
        },
    );
    let rest = run_concurrently(per_comm);
    if first_error.is_none() {
        first_error = rest.err();
    }
    for r in &posted {
        if let Err(e) = r.wait() {
            first_error.get_or_insert(e);
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Runs each communicator's calls, different communicators concurrently.
///
/// # Safety
/// As `end`.
unsafe fn run_concurrently(per_comm: Vec<(Arc<Runner>, Vec<Call>, Vec<Stream>)>) -> Result<()> {
    match per_comm.len() {
        0 => Ok(()),
        1 => {
            let (comm, calls, streams) = &per_comm[0];
            comm.run_batch(calls.clone(), streams.clone())
        }
        _ => std::thread::scope(|s| {
            let handles: Vec<_> = per_comm
                .iter()
                .map(|(comm, calls, streams)| {
                    let (calls, streams) = (calls.clone(), streams.clone());
                    // SAFETY: the caller keeps the buffers valid until end returns,
                    // and we join every thread before returning.
                    s.spawn(move || unsafe { comm.run_batch(calls, streams) })
                })
                .collect();
            let results: Vec<Result<()>> = handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::internal("a group thread panicked")))
                })
                .collect();
            results.into_iter().collect::<Result<Vec<()>>>().map(|_| ())
        }),
    }
}
