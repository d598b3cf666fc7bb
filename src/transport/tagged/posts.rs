//! Tagged calls posted while another thread holds the core, and the one
//! deferred receive beside them.

use super::{Done, Incoming, Outgoing, Tagged};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::transport::signal::Wake;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A call posted while another thread held the core.
pub enum Post {
    Send(Outgoing, Arc<Done>, u64),
    Recv(Incoming, Arc<Done>, u64),
}

impl Post {
    fn id(&self) -> u64 {
        match self {
            Post::Send(_, _, id) | Post::Recv(_, _, id) => *id,
        }
    }
}

/// Where calls are posted while the core is held elsewhere (a collective
/// on another thread): whoever holds it takes them in at its next look,
/// in the order they came, before anything else is posted.
///
/// One non-blocking receive at a time may instead wait beside the queue,
/// deferred (`defer`): its own wait receives it as a blocking receive
/// does, straight from the connection with no matching, while it stays in
/// its slot (`with_deferred`), unless anything else takes the core first,
/// which posts it (`take_deferred_into`, `push`, `flush_to_queue`): it is
/// always somewhere, so it keeps its place among the calls.
pub struct Posts {
    queue: Mutex<Vec<Post>>,
    pending: AtomicBool,
    next_id: AtomicU64,
    deferred: Deferred,
    /// Rung on a post, for a holder asleep in poll().
    pub bell: Wake,
}

impl Posts {
    pub fn new() -> Result<Posts> {
        Ok(Posts {
            queue: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
            next_id: AtomicU64::new(FIRST_ID),
            deferred: Deferred {
                state: AtomicU64::new(EMPTY),
                post: UnsafeCell::new(None),
            },
            bell: Wake::new().map_err(|e| Error::system("eventfd", &e))?,
        })
    }

    /// A new call's id.
    #[inline]
    pub fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn push(&self, post: Post) {
        self.enqueue(Some(post));
    }

    /// Queues `post` (or nothing) behind a deferred receive, which came
    /// before it, for whoever holds the core.
    fn enqueue(&self, post: Option<Post>) {
        let mut q = lock(&self.queue);
        let deferred = self.deferred.take();
        if deferred.is_none() && post.is_none() {
            return;
        }
        q.extend(deferred);
        q.extend(post);
        drop(q);
        self.pending.store(true, Ordering::Release);
        self.bell.ring();
    }

    /// Defers receive `post` (see `Posts`); given back when the slot is
    /// taken (the caller posts it the usual way, which posts the one in
    /// the slot first).
    #[inline]
    pub fn defer(&self, post: Post) -> Option<Post> {
        self.deferred.put(post)
    }

    /// Runs `f` while receive `id` is still deferred, holding its slot, so
    /// no call can be posted ahead of it meanwhile; `f` says whether the
    /// receive leaves the slot (then it is handed back with `f`'s result).
    /// None: it is not deferred (any more): another call posted it, or is
    /// posting it. `f` must not take the posts in (the slot is held).
    #[inline]
    pub fn with_deferred<R>(
        &self,
        id: u64,
        f: impl FnOnce() -> (R, bool),
    ) -> Option<(R, Option<Post>)> {
        self.deferred.with(id, f)
    }

    /// Moves a deferred receive into the queue, for whoever holds the core
    /// (a caller that cannot take the core and must not leave it behind).
    pub fn flush_to_queue(&self) {
        self.enqueue(None);
    }

    /// Whether a receive is deferred (or its slot busy).
    #[inline]
    pub fn has_deferred(&self) -> bool {
        self.deferred.state.load(Ordering::Acquire) != EMPTY
    }

    /// Posts the deferred receive into `tagged`.
    pub fn take_deferred_into(&self, tagged: &mut Tagged) {
        if let Some(post) = self.deferred.take() {
            tagged.take_post(post);
        }
    }

    /// Whether calls wait to be taken in (looked at without the lock).
    #[inline]
    pub fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Takes the posted calls into `tagged`, in order.
    pub fn take_into(&self, tagged: &mut Tagged) {
        let posts = {
            let mut q = lock(&self.queue);
            self.pending.store(false, Ordering::Release);
            self.bell.drain();
            std::mem::take(&mut *q)
        };
        for post in posts {
            tagged.take_post(post);
        }
    }
}

/// The first call's id: ids are never `EMPTY` or `BUSY`.
const FIRST_ID: u64 = 1;
/// The slot holds no receive.
const EMPTY: u64 = 0;
/// One thread is putting, looking at or taking the slot's receive.
const BUSY: u64 = u64::MAX;

/// The deferred receive's slot, without a lock: its state word is claimed
/// (`BUSY`) with one compare-and-swap and released with a plain store,
/// where a mutex costs two atomic operations (a small exchange passes
/// through the slot twice).
struct Deferred {
    /// EMPTY, BUSY, or the id of the receive in `post`.
    state: AtomicU64,
    post: UnsafeCell<Option<Post>>,
}

// SAFETY: `post` is read or written only by the thread that moved `state`
// to BUSY (Acquire), until it stores another state (Release); a `Post`
// may move between threads (it did through the mutex before).
unsafe impl Sync for Deferred {}
const _: () = {
    const fn crosses_threads<T: Send>() {}
    crosses_threads::<Post>();
};

/// Gives a claimed slot back as `state` if the holder unwinds.
struct Claim<'a> {
    slot: &'a Deferred,
    back_to: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.slot.state.store(self.back_to, Ordering::Release);
    }
}

impl Deferred {
    /// Claims the slot in state `from`; the guard stores `from` back
    /// unless told otherwise.
    #[inline]
    fn claim(&self, from: u64) -> Option<Claim<'_>> {
        self.state
            .compare_exchange(from, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Claim {
                slot: self,
                back_to: from,
            })
    }

    /// The post, for the holder of a claim (borrowed from the claim, so
    /// one claim lends it once at a time).
    #[inline]
    fn post<'c>(claim: &'c mut Claim<'_>) -> &'c mut Option<Post> {
        // SAFETY: the claim makes this thread the only one touching it.
        unsafe { &mut *claim.slot.post.get() }
    }

    #[inline]
    fn put(&self, post: Post) -> Option<Post> {
        if self.state.load(Ordering::Relaxed) != EMPTY {
            return Some(post);
        }
        let Some(mut claim) = self.claim(EMPTY) else {
            return Some(post);
        };
        claim.back_to = post.id();
        *Deferred::post(&mut claim) = Some(post);
        None
    }

    #[inline]
    fn with<R>(&self, id: u64, f: impl FnOnce() -> (R, bool)) -> Option<(R, Option<Post>)> {
        if self.state.load(Ordering::Acquire) != id {
            return None;
        }
        let mut claim = self.claim(id)?;
        let (result, leaves) = f();
        if !leaves {
            return Some((result, None));
        }
        claim.back_to = EMPTY;
        Some((result, Deferred::post(&mut claim).take()))
    }

    /// Takes the deferred receive out, waiting while another thread holds
    /// the slot: a put, or its owner's look at one connection (which may
    /// report a failure to the peers first: up to a fraction of a second,
    /// slept through after a short spin).
    fn take(&self) -> Option<Post> {
        let mut passes = 0u32;
        loop {
            match self.state.load(Ordering::Acquire) {
                EMPTY => return None,
                BUSY => {
                    passes = passes.saturating_add(1);
                    if passes < 64 {
                        std::hint::spin_loop();
                    } else if passes < 128 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                }
                id => {
                    if let Some(mut claim) = self.claim(id) {
                        claim.back_to = EMPTY;
                        return Deferred::post(&mut claim).take();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call::RawBuf;
    use crate::dtype::DType;

    fn recv(id: u64) -> Post {
        let r = Incoming {
            buf: RawBuf::EMPTY,
            dtype: DType::Uint8,
            count: 0,
            peer: Some(0),
            tag: Some(0),
            exact: true,
        };
        Post::Recv(r, Arc::new(Done::default()), id)
    }

    fn posts() -> Posts {
        Posts::new().unwrap()
    }

    #[test]
    fn one_receive_is_deferred_at_a_time() {
        let p = posts();
        assert!(!p.has_deferred());
        assert!(p.defer(recv(1)).is_none());
        assert!(p.has_deferred());
        let back = p.defer(recv(2)).expect("the slot is taken");
        assert_eq!(back.id(), 2);
        let taken = p.deferred.take().expect("deferred");
        assert_eq!(taken.id(), 1);
        assert!(!p.has_deferred());
        assert!(p.deferred.take().is_none());
    }

    #[test]
    fn its_owner_looks_while_it_stays_or_takes_it_back() {
        let p = posts();
        assert!(p.defer(recv(7)).is_none());
        assert!(p.with_deferred(8, || ((), true)).is_none(), "not its id");
        let (seen, post) = p.with_deferred(7, || (p.has_deferred(), false)).unwrap();
        assert!(seen && post.is_none());
        assert!(p.has_deferred(), "stays when it does not leave");
        let (_, post) = p.with_deferred(7, || ((), true)).unwrap();
        assert_eq!(post.expect("handed back").id(), 7);
        assert!(!p.has_deferred());
        assert!(p.with_deferred(7, || ((), true)).is_none());
    }

    #[test]
    fn a_flush_queues_it_ahead_of_later_posts() {
        let p = posts();
        assert!(p.defer(recv(3)).is_none());
        p.push(recv(4));
        assert!(!p.has_deferred());
        assert!(p.pending());
        let q = lock(&p.queue);
        let ids: Vec<u64> = q.iter().map(Post::id).collect();
        assert_eq!(ids, [3, 4]);
    }

    #[test]
    fn a_look_that_unwinds_gives_the_slot_back() {
        let p = posts();
        assert!(p.defer(recv(5)).is_none());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.with_deferred(5, || -> ((), bool) { panic!("planted") })
        }));
        assert!(r.is_err());
        assert_eq!(p.deferred.take().map(|p| p.id()), Some(5));
    }

    #[test]
    fn a_taker_waits_for_the_owners_look_and_never_both_get_it() {
        for _ in 0..200 {
            let p = Arc::new(posts());
            assert!(p.defer(recv(9)).is_none());
            let other = p.clone();
            let taker = std::thread::spawn(move || other.deferred.take().map(|p| p.id()));
            let mine = p
                .with_deferred(9, || {
                    std::hint::spin_loop();
                    ((), true)
                })
                .and_then(|(_, post)| post.map(|p| p.id()));
            let theirs = taker.join().unwrap();
            assert!(
                matches!((mine, theirs), (Some(9), None) | (None, Some(9))),
                "{mine:?} {theirs:?}"
            );
            assert!(!p.has_deferred());
        }
    }
}
