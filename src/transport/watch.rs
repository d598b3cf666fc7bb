//! Peers that fall silent. A wait that has heard nothing for a while
//! (`RDIST_PEER_CHECK_MS`, 3 s by default) asks the ranks it waits for
//! whether their processes still run (`shrink::answers`: a peer's
//! endpoint thread answers at once, even while its caller computes). One
//! that does not answer (stopped by a signal or a debugger, or on a host
//! that vanished) is lost: the wait fails with `PeerLost` naming it
//! within seconds instead of at the timeout, and the other ranks hear it
//! as any failure. One that answers is waited for, and asked again after
//! as long.

use super::mesh::MeshSpec;
use super::shrink;
use crate::error::Result;
use std::time::{Duration, Instant};

/// How long a peer's process has to answer: longer than its endpoint's
/// thread may be held up admitting another connection (`link.rs`'s
/// agreement deadline, 10 s), so a live rank is never taken for a
/// stopped one.
pub const ANSWER_LIMIT: Duration = Duration::from_secs(12);

/// When one wait asks next.
pub struct Watch {
    /// Silence before asking; zero: never.
    after: Duration,
    /// Not before then (after an answer, the silence must last as long
    /// again).
    next: Option<Instant>,
    /// Which of the awaited peers is asked next.
    turn: usize,
}

impl Watch {
    pub fn new(after: Duration) -> Watch {
        Watch {
            after,
            next: None,
            turn: 0,
        }
    }

    /// Whether a wait that has heard nothing for `idle` asks now (cheap:
    /// waits call it on every look at the clock).
    #[inline]
    pub fn due(&self, idle: Duration, now: Instant) -> bool {
        !self.after.is_zero() && idle >= self.after && self.next.is_none_or(|t| now >= t)
    }

    /// Asks one of `waited` (in turn) whether its process runs; the
    /// reason to give it up when it did not answer within `ANSWER_LIMIT`.
    /// None when it answered, or when `deadline` cut the question short
    /// (the wait's own timeout then names it). `during`: " in <the call>".
    pub fn ask(
        &mut self,
        spec: &MeshSpec,
        waited: &[usize],
        idle: Duration,
        during: &str,
        deadline: Instant,
    ) -> Result<Option<(usize, String)>> {
        if waited.is_empty() {
            return Ok(None);
        }
        self.turn = self.turn.wrapping_add(1);
        let peer = waited[self.turn % waited.len()];
        let asked = Instant::now();
        let limit = deadline.min(asked + ANSWER_LIMIT);
        let answered = shrink::answers(spec, peer, limit)?;
        self.next = Some(Instant::now() + self.after);
        if answered || limit < asked + ANSWER_LIMIT {
            return Ok(None);
        }
        Ok(Some((
            peer,
            format!(
                "rank {peer} does not answer: rank {} heard nothing from it for {:.1} s{during}, \
                 then its process did not answer within {} s (it is stopped, by a signal or a \
                 debugger, or its host is unreachable; option peer_check_ms=0 waits for it to the timeout)",
                spec.rank,
                idle.as_secs_f64(),
                ANSWER_LIMIT.as_secs()
            ),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::Watch;
    use std::time::{Duration, Instant};

    #[test]
    fn a_watch_asks_after_the_silence_and_never_when_off() {
        let now = Instant::now();
        let w = Watch::new(Duration::from_secs(3));
        assert!(!w.due(Duration::from_secs(2), now));
        assert!(w.due(Duration::from_secs(3), now));
        let mut w2 = Watch::new(Duration::from_secs(3));
        w2.next = Some(now + Duration::from_secs(1));
        assert!(!w2.due(Duration::from_secs(9), now));
        assert!(w2.due(Duration::from_secs(9), now + Duration::from_secs(1)));
        assert!(!Watch::new(Duration::ZERO).due(Duration::from_secs(1000), now));
    }
}
