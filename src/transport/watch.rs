//! Peers that fall silent. A wait that has heard nothing for a while
//! (option `peer_check_ms`, 3 s by default) asks the ranks it waits for
//! whether their processes still run (`shrink::answers`: a peer's
//! endpoint thread answers at once, even while its caller computes). One
//! that does not answer (stopped by a signal or a debugger, or on a host
//! that vanished) is lost: the wait fails with `PeerLost` naming it
//! within seconds instead of at the timeout, and the other ranks hear it
//! as any failure. One that answers is waited for, and asked again after
//! as long.
//!
//! The question is asked from a thread of its own, so the wait goes on
//! meanwhile: it still takes data, failure reports and its own timeout.

use super::mesh::MeshSpec;
use super::shrink::{self, Liveness};
use crate::sync::lock;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a peer's process has to answer: longer than its endpoint's
/// thread may be held up admitting another connection (`link.rs`'s
/// agreement deadline, 10 s a read), so a live rank is not taken for a
/// stopped one.
pub const ANSWER_LIMIT: Duration = Duration::from_secs(12);

/// Peers asked at once (a root waiting on many would otherwise take a
/// round of silence per peer).
const ASK_AT_ONCE: usize = 8;

/// When one wait asks, and what it asked.
pub struct Watch {
    /// Silence before asking; zero: never.
    after: Duration,
    /// Not before then (after an answer, the silence must last as long
    /// again).
    next: Option<Instant>,
    /// Where in the awaited peers the next question starts.
    turn: usize,
    asking: Option<Asking>,
}

/// The asking thread's finding: None until it is done; then the peers
/// that did not answer (in the order asked), and how.
type Verdict = Arc<Mutex<Option<Vec<(usize, Liveness)>>>>;

/// A question on its way.
struct Asking {
    /// The wait's count of movements when it asked: any since, and the
    /// question is forgotten.
    moves: u64,
    /// The silence when it asked.
    idle: Duration,
    verdict: Verdict,
    /// The asking thread (joined by `finish`).
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    pub fn new(after: Duration) -> Watch {
        Watch {
            after,
            next: None,
            turn: 0,
            asking: None,
        }
    }

    /// Whether it ever asks.
    pub fn on(&self) -> bool {
        !self.after.is_zero()
    }

    /// Whether a wait that has heard nothing for `idle` (`moves`: its
    /// count of movements) has something to do here now: a question to
    /// ask, or one answered. Cheap while nothing is due: waits call it on
    /// every look at the clock.
    #[inline]
    pub fn due(&mut self, idle: Duration, moves: u64, now: Instant) -> bool {
        if self.after.is_zero() {
            return false;
        }
        if let Some(a) = &self.asking {
            if a.moves != moves {
                // It moved since: whatever the answer, it proves nothing.
                self.asking = None;
                self.next = Some(now + self.after);
                return false;
            }
            return lock(&a.verdict).is_some();
        }
        idle >= self.after && self.next.is_none_or(|t| now >= t)
    }

    /// After `due`: takes the answer to the question asked before (the
    /// peer that did not answer and why to give it up, or None), or asks
    /// up to `ASK_AT_ONCE` of `waited` (in turn) whether their processes
    /// run, from a thread of its own. `during`: " in <the call>".
    pub fn look(
        &mut self,
        spec: &MeshSpec,
        waited: &[usize],
        idle: Duration,
        moves: u64,
        during: &str,
    ) -> Option<(usize, String)> {
        self.look_all(spec, waited, idle, moves, during)
            .into_iter()
            .next()
    }

    /// Whether a question is on its way (`look` then takes its answer and
    /// needs no peers).
    pub fn asking(&self) -> bool {
        self.asking.is_some()
    }

    /// `look`, giving up every peer of the question that did not answer.
    pub fn look_all(
        &mut self,
        spec: &MeshSpec,
        waited: &[usize],
        idle: Duration,
        moves: u64,
        during: &str,
    ) -> Vec<(usize, String)> {
        if let Some(a) = self.asking.take() {
            self.next = Some(Instant::now() + self.after);
            let found = lock(&a.verdict).take().unwrap_or_default();
            return (found.into_iter())
                .map(|(peer, how)| (peer, given_up(spec.rank, peer, how, a.idle, during)))
                .collect();
        }
        let peers: Vec<usize> = waited.iter().copied().filter(|&p| p != spec.rank).collect();
        if peers.is_empty() {
            self.next = Some(Instant::now() + self.after);
            return Vec::new();
        }
        let k = peers.len().min(ASK_AT_ONCE);
        let asked: Vec<usize> = (0..k)
            .map(|i| peers[(self.turn + i) % peers.len()])
            .collect();
        self.turn = self.turn.wrapping_add(k);
        let verdict: Verdict = Arc::new(Mutex::new(None));
        let (spec, told) = (spec.clone(), verdict.clone());
        let thread = std::thread::Builder::new()
            .name(format!("rdist-ask{}", spec.rank))
            .spawn(move || {
                let limit = Instant::now() + ANSWER_LIMIT;
                let answers: Vec<Liveness> = std::thread::scope(|scope| {
                    let asking: Vec<_> = asked
                        .iter()
                        .map(|&peer| {
                            scope.spawn({
                                let spec = &spec;
                                move || shrink::answers(spec, peer, limit)
                            })
                        })
                        .collect();
                    asking
                        .into_iter()
                        .map(|h| h.join().unwrap_or(Liveness::Runs))
                        .collect()
                });
                let silent = (asked.iter().copied())
                    .zip(answers)
                    .filter(|(_, a)| *a != Liveness::Runs)
                    .collect();
                *lock(&told) = Some(silent);
            });
        match thread {
            Ok(thread) => {
                self.asking = Some(Asking {
                    moves,
                    idle,
                    verdict,
                    thread: Some(thread),
                })
            }
            // No thread to ask from: again after the silence.
            Err(_) => self.next = Some(Instant::now() + self.after),
        }
        Vec::new()
    }

    /// Waits for a question still on its way (at most `ANSWER_LIMIT`), so
    /// that no thread of this watch outlives its owner.
    pub fn finish(&mut self) {
        if let Some(h) = self.asking.take().and_then(|mut a| a.thread.take()) {
            let _ = h.join();
        }
    }
}

/// Why a wait gives `peer` up.
fn given_up(rank: usize, peer: usize, how: Liveness, idle: Duration, during: &str) -> String {
    let waited = format!(
        "rank {rank} waited{during} {:.1} s with nothing moving",
        idle.as_secs_f64()
    );
    match how {
        Liveness::Gone => format!(
            "rank {peer} is gone: {waited}, then found nobody listening at rank {peer}'s address \
             (it exited, or destroyed its communicator)"
        ),
        _ => format!(
            "rank {peer} does not answer: {waited}, then rank {peer}'s process did not answer \
             within {} s (it is stopped, by a signal or a debugger, or its host is unreachable; \
             option peer_check_ms=0 waits for it to the timeout)",
            ANSWER_LIMIT.as_secs()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{Asking, Watch};
    use crate::transport::mesh::MeshSpec;
    use crate::transport::shrink::Liveness;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    fn spec() -> MeshSpec {
        MeshSpec {
            rank: 0,
            size: 2,
            addrs: Arc::from(vec!["127.0.0.1:9".parse().unwrap(); 2]),
            job: [0; 16],
            comm_id: 0,
            token: None,
            far: Arc::from(vec![false; 2]),
        }
    }

    fn asking(w: &mut Watch, verdict: Option<Vec<(usize, Liveness)>>, moves: u64) {
        w.asking = Some(Asking {
            moves,
            idle: Duration::from_secs(3),
            verdict: Arc::new(Mutex::new(verdict)),
            thread: None,
        });
    }

    #[test]
    fn a_watch_asks_after_the_silence_and_never_when_off() {
        let now = Instant::now();
        let mut w = Watch::new(Duration::from_secs(3));
        assert!(!w.due(Duration::from_secs(2), 0, now));
        assert!(w.due(Duration::from_secs(3), 0, now));
        w.next = Some(now + Duration::from_secs(1));
        assert!(!w.due(Duration::from_secs(9), 0, now));
        assert!(w.due(Duration::from_secs(9), 0, now + Duration::from_secs(1)));
        assert!(!Watch::new(Duration::ZERO).due(Duration::from_secs(1000), 0, now));
    }

    #[test]
    fn only_a_question_unanswered_while_nothing_moved_gives_a_peer_up() {
        let (s, now) = (spec(), Instant::now());
        let idle = Duration::from_secs(9);
        let mut w = Watch::new(Duration::from_secs(3));
        // On its way: nothing to do yet.
        asking(&mut w, None, 7);
        assert!(!w.due(idle, 7, now));
        // Answered by everyone: the peers run; asked again only after the silence.
        asking(&mut w, Some(vec![]), 7);
        assert!(w.due(idle, 7, now));
        assert!(w.look(&s, &[1], idle, 7, "").is_none());
        assert!(w.asking.is_none() && !w.due(idle, 7, Instant::now()));
        // Unanswered, but the wait moved since: forgotten.
        asking(&mut w, Some(vec![(1, Liveness::Silent)]), 7);
        assert!(!w.due(idle, 8, now));
        assert!(w.asking.is_none());
        // Unanswered while nothing moved: given up, named.
        asking(&mut w, Some(vec![(1, Liveness::Silent)]), 7);
        assert!(w.due(idle, 7, now));
        let (peer, why) = w.look(&s, &[1], idle, 7, " in allreduce #3").unwrap();
        assert_eq!(peer, 1);
        assert!(
            why.starts_with(
                "rank 1 does not answer: rank 0 waited in allreduce #3 3.0 s with nothing moving"
            ),
            "{why}"
        );
        asking(&mut w, Some(vec![(1, Liveness::Gone)]), 7);
        let (_, why) = w.look(&s, &[1], idle, 7, "").unwrap();
        assert!(why.starts_with("rank 1 is gone"), "{why}");
        // Every peer of one question that did not answer is given up.
        asking(
            &mut w,
            Some(vec![(1, Liveness::Silent), (2, Liveness::Gone)]),
            7,
        );
        let all = w.look_all(&s, &[1, 2], idle, 7, "");
        assert_eq!(all.iter().map(|(p, _)| *p).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn a_rank_never_asks_itself() {
        let mut w = Watch::new(Duration::from_secs(3));
        assert!(w
            .look(&spec(), &[0], Duration::from_secs(5), 0, "")
            .is_none());
        assert!(w.asking.is_none());
    }
}
