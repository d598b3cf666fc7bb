//! Which path a same-host tagged message below the single-copy sizes
//! takes, the rings or single copy, chosen per buffer from how long its
//! receiver took to copy it out of this rank's memory the last times.
//!
//! Why: single copy is fast when the receiver finds the sender's bytes
//! in its own cache (a buffer sent again unchanged: the receiver's last
//! copy left them there), and slow when the sender has just written them
//! (the lines come out of the writer's cache, and the writer's next write
//! takes them back): there the rings are about twice as fast. No size
//! tells the two apart; the receiver's copy time does. Nor must the
//! sender wait for a receiver that comes late, where the rings would have
//! taken its bytes at once: its wait for the answer counts too. A buffer
//! starts on the rings. Now and then (less often each time it did not
//! pay) two of its sends in a row go single copy, since the first read of
//! lines the sender wrote last is slow whatever follows; while the
//! receiver's copies beat what the rings would take, the buffer stays
//! single copy (a slow copy now and then is noise; two close together
//! send it back). A try is made only while the peer talks back (a message
//! from it came since the last send to it: a ping-pong, an exchange), so
//! that a sender whose receiver is busy elsewhere (one-way traffic) is
//! never held by a try the rings would have let go.

use crate::transport::shm::WHOLE_PAYLOAD;

/// What a single copy costs against the rings on this machine (the
/// tuning model's measured inputs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReadCost {
    /// Two cores passing bytes through a ring, MB/s of payload.
    pub pass_mbs: u32,
    /// What a single-copy message costs beyond its copy and the step a
    /// ring message takes too (its answer's trip), ns.
    pub fixed_ns: u32,
    /// The largest message chosen for: a core's own cache (a larger one
    /// cannot wait whole in the receiver's cache for the next send).
    pub max_bytes: usize,
}

impl ReadCost {
    /// What the rings take for one message of `bytes`: its bytes at the
    /// pass rate, and the first record's once more, since its reader
    /// starts only when it is whole (a message up to `WHOLE_PAYLOAD` is
    /// one record: a copy in, then a copy out; a larger one streams, the
    /// reader copying out of one record while the writer fills the next).
    fn rings_ns(&self, bytes: usize) -> f64 {
        let serial = bytes.min(WHOLE_PAYLOAD);
        (bytes + serial) as f64 * 1000.0 / f64::from(self.pass_mbs.max(1))
    }

    /// The sizes for which single copy could pay at all (a copy taking
    /// no time beats the rings), so that trying it is worth a send.
    pub fn sizes(&self) -> std::ops::RangeInclusive<usize> {
        // The fewest bytes the rings pass in `fixed_ns`.
        let passed = u64::from(self.fixed_ns) * u64::from(self.pass_mbs) / 1000;
        let whole = WHOLE_PAYLOAD as u64;
        // Inverting `rings_ns`: twice the bytes up to a whole record.
        let lo = match passed / 2 < whole {
            true => passed / 2 + 1,
            false => passed - whole + 1,
        };
        usize::try_from(lo).unwrap_or(usize::MAX)..=self.max_bytes
    }

    /// Whether a single-copy send of `bytes` beat the rings: its
    /// receiver's copy took `read_ns` (0: not timed), and its sender
    /// waited `waited_ns` for the answer (for the receiver to come, to
    /// copy, and to answer) no longer than twice what the rings take (in
    /// an exchange the answer waits while its sender copies the other
    /// way; a receiver that came late costs more).
    pub fn paid(&self, bytes: usize, read_ns: u64, waited_ns: u64) -> bool {
        let (rings, fixed) = (self.rings_ns(bytes), f64::from(self.fixed_ns));
        read_ns > 0 && (read_ns as f64 + fixed) < rings && (waited_ns as f64) < 2.0 * rings + fixed
    }
}

/// Buffers remembered per peer (the least recently sent is forgotten).
const SLOTS: usize = 4;
/// Sends through the rings before a buffer's first try of single copy.
const FIRST_TRY_AFTER: u32 = 8;
/// The most sends through the rings between two tries.
const LAST_TRY_AFTER: u32 = 1024;
/// Slow copies (net of forgiven ones) that send a buffer back to the rings.
const MOST_MISSES: u8 = 2;
/// Fast copies in a row that forgive one slow one.
const FORGIVE_AFTER: u8 = 4;
/// How much longer the rings go on after each try that did not pay (a
/// try costs up to twice a send, a written buffer's copy being slow).
const TRY_LESS_OFTEN: u32 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Through the rings; single copy is tried once `until_try` sends went.
    Rings { until_try: u32 },
    /// Trying single copy: `sends` more go so, then `answers` more copy
    /// times are awaited.
    Trying { sends: u8, answers: u8 },
    /// Single copy while it pays. A slow copy now and then is the
    /// machine's noise (an interrupt, a preempted receiver): `misses`
    /// counts the slow ones, less one for every `FORGIVE_AFTER` fast ones
    /// in a row (`paid`); at `MOST_MISSES` the buffer goes back to the
    /// rings (it is being written: two slow copies in a row, or every
    /// other one; noise seldom strikes twice within a few copies).
    Single { misses: u8, paid: u8 },
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    addr: usize,
    len: usize,
    /// When it was last sent (for forgetting the oldest).
    stamp: u64,
    mode: Mode,
    /// Sends through the rings before the next try.
    wait: u32,
}

/// One peer's remembered buffers.
#[derive(Default)]
pub struct Choices {
    slots: Vec<Slot>,
    clock: u64,
    /// How many messages had come from the peer at the last send to it.
    heard_at_send: u64,
}

impl Choices {
    fn find(&self, addr: usize, len: usize) -> Option<usize> {
        self.slots
            .iter()
            .position(|s| s.addr == addr && s.len == len)
    }

    /// Whether the next send of the `len` bytes at `addr` goes single
    /// copy, `heard` messages having come from the peer so far.
    pub fn single(&self, addr: usize, len: usize, heard: u64) -> bool {
        self.find(addr, len)
            .is_some_and(|i| match self.slots[i].mode {
                Mode::Rings { until_try } => until_try == 0 && heard != self.heard_at_send,
                Mode::Trying { sends, .. } => sends > 0,
                Mode::Single { .. } => true,
            })
    }

    /// A send of the `len` bytes at `addr` was framed, single copy or not
    /// (as `single` said), `heard` messages having come from the peer.
    pub fn sent(&mut self, addr: usize, len: usize, single: bool, heard: u64) {
        self.clock += 1;
        self.heard_at_send = heard;
        let i = match self.find(addr, len) {
            Some(i) => i,
            None => self.remember(addr, len),
        };
        let s = &mut self.slots[i];
        s.stamp = self.clock;
        s.mode = match (s.mode, single) {
            (Mode::Rings { .. }, true) => Mode::Trying {
                sends: 1,
                answers: 2,
            },
            (Mode::Rings { until_try }, false) => Mode::Rings {
                until_try: until_try.saturating_sub(1),
            },
            (Mode::Trying { sends, answers }, true) => Mode::Trying {
                sends: sends.saturating_sub(1),
                answers,
            },
            (m, _) => m,
        };
    }

    /// The receiver of a single-copy send of the `len` bytes at `addr`
    /// copied it in `read_ns` (0: it did not time it), its sender having
    /// waited `waited_ns` for that answer.
    pub fn heard(
        &mut self,
        addr: usize,
        len: usize,
        read_ns: u64,
        waited_ns: u64,
        cost: &ReadCost,
    ) {
        let Some(i) = self.find(addr, len) else {
            return;
        };
        let s = &mut self.slots[i];
        let paid = cost.paid(len, read_ns, waited_ns);
        match s.mode {
            Mode::Single {
                misses,
                paid: streak,
            } if paid => {
                s.mode = match streak + 1 {
                    FORGIVE_AFTER => Mode::Single {
                        misses: misses.saturating_sub(1),
                        paid: 0,
                    },
                    streak => Mode::Single {
                        misses,
                        paid: streak,
                    },
                }
            }
            Mode::Single { misses, .. } if misses + 1 < MOST_MISSES => {
                s.mode = Mode::Single {
                    misses: misses + 1,
                    paid: 0,
                }
            }
            Mode::Single { .. } => s.mode = Mode::Rings { until_try: s.wait },
            Mode::Trying { .. } if paid => {
                s.mode = Mode::Single { misses: 0, paid: 0 };
                s.wait = FIRST_TRY_AFTER;
            }
            Mode::Trying { sends, answers } if answers > 1 => {
                s.mode = Mode::Trying {
                    sends,
                    answers: answers - 1,
                }
            }
            Mode::Trying { .. } => {
                s.wait = (s.wait * TRY_LESS_OFTEN).min(LAST_TRY_AFTER);
                s.mode = Mode::Rings { until_try: s.wait };
            }
            _ => {}
        }
    }

    fn remember(&mut self, addr: usize, len: usize) -> usize {
        let slot = Slot {
            addr,
            len,
            stamp: self.clock,
            mode: Mode::Rings {
                until_try: FIRST_TRY_AFTER,
            },
            wait: FIRST_TRY_AFTER,
        };
        if self.slots.len() < SLOTS {
            self.slots.push(slot);
            return self.slots.len() - 1;
        }
        let oldest = (0..SLOTS)
            .min_by_key(|&i| self.slots[i].stamp)
            .expect("slots");
        self.slots[oldest] = slot;
        oldest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // 10 GB/s through the rings, 2 us fixed: 64 KiB takes 8.2 us there
    // (its first 16 KiB record is not overlapped), 8 KiB 1.6 us (copied
    // in, then out).
    const COST: ReadCost = ReadCost {
        pass_mbs: 10_000,
        fixed_ns: 2_000,
        max_bytes: 1 << 20,
    };
    const LEN: usize = 64 << 10;
    const FAST: u64 = 2_000;
    const SLOW: u64 = 8_000;

    /// Sends the buffer once, the receiver taking `read_ns` when it goes
    /// single copy; whether it did.
    fn send(c: &mut Choices, addr: usize, read_ns: u64) -> bool {
        // A ping-pong: a message from the peer came since the last send.
        let heard = c.heard_at_send + 1;
        let single = c.single(addr, LEN, heard);
        c.sent(addr, LEN, single, heard);
        if single {
            c.heard(addr, LEN, read_ns, read_ns + 1_000, &COST);
        }
        single
    }

    #[test]
    fn one_way_traffic_is_never_held_by_a_try() {
        let mut c = Choices::default();
        for _ in 0..100 {
            assert!(!c.single(0x1000, LEN, 0));
            c.sent(0x1000, LEN, false, 0);
        }
        // The peer talks back: the try comes with the next send.
        assert!(c.single(0x1000, LEN, 1));
    }

    #[test]
    fn the_cost_tells_a_copy_from_cache_from_one_out_of_the_writers() {
        assert!(COST.paid(LEN, FAST, FAST + 1_000));
        assert!(!COST.paid(LEN, SLOW, SLOW + 1_000));
        assert!(!COST.paid(LEN, 0, 1_000), "an untimed copy proves nothing");
        assert!(
            COST.paid(LEN, FAST, 12_000),
            "an exchange: the answer waited while its sender copied"
        );
        assert!(
            !COST.paid(LEN, FAST, 100_000),
            "a sender that waited for its receiver to come lost its time"
        );
        let sizes = COST.sizes();
        assert!(sizes.contains(&LEN));
        assert!(
            !sizes.contains(&(8 << 10)),
            "1.6 us through the rings: never"
        );
        assert!(sizes.contains(&10_001) && !sizes.contains(&10_000));
        let slow_fixed = ReadCost {
            fixed_ns: 5_000,
            ..COST
        };
        let past_whole = slow_fixed.sizes();
        assert!(
            past_whole.contains(&(50_000 - (16 << 10) + 1))
                && !past_whole.contains(&(50_000 - (16 << 10))),
            "beyond a whole record the rings pass the bytes once more than \
             the first record's"
        );
        assert!(
            !sizes.contains(&(2 << 20)),
            "larger than a core's cache: never"
        );
    }

    #[test]
    fn a_buffer_sent_unchanged_goes_single_copy_after_two_tries() {
        let mut c = Choices::default();
        let paths: Vec<bool> = (0..12)
            .map(|i| send(&mut c, 0x1000, if i == 8 { SLOW } else { FAST }))
            .collect();
        // 8 through the rings, a try whose first read is slow (the lines
        // were the sender's), a second that pays, then single copy.
        assert_eq!(paths[..8], [false; 8]);
        assert_eq!(paths[8..], [true; 4]);
    }

    #[test]
    fn a_buffer_written_before_every_send_stays_on_the_rings_and_is_tried_less_often() {
        let mut c = Choices::default();
        let tries: Vec<usize> = (0..3000).filter(|_| send(&mut c, 0x1000, SLOW)).collect();
        // Pairs of tries, after 8, 32, 128, 512, 1024 ... sends through
        // the rings.
        assert_eq!(&tries[..6], &[8, 9, 42, 43, 172, 173]);
        let gaps: Vec<usize> = tries.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps
            .iter()
            .all(|&g| g == 1 || g <= LAST_TRY_AFTER as usize + 1));
        assert!(tries.len() <= 12, "{} tries in 3000 sends", tries.len());
    }

    #[test]
    fn a_buffer_that_starts_being_written_goes_back_to_the_rings_after_two_slow_copies() {
        let mut c = Choices::default();
        for _ in 0..12 {
            send(&mut c, 0x1000, FAST);
        }
        let h = u64::MAX;
        assert!(c.single(0x1000, LEN, h));
        assert!(send(&mut c, 0x1000, SLOW), "this one went single copy");
        assert!(send(&mut c, 0x1000, SLOW), "one slow copy may be noise");
        assert!(!c.single(0x1000, LEN, h), "two are not: the rings");
    }

    #[test]
    fn one_slow_copy_among_fast_ones_keeps_the_buffer_single_copy() {
        let mut c = Choices::default();
        for _ in 0..12 {
            send(&mut c, 0x1000, FAST);
        }
        // An interrupt now and then.
        for i in 0..1000 {
            let read = if i % 20 == 0 { SLOW } else { FAST };
            assert!(
                send(&mut c, 0x1000, read),
                "send {i} went through the rings"
            );
        }
    }

    #[test]
    fn a_buffer_written_before_every_other_send_goes_back_to_the_rings() {
        let mut c = Choices::default();
        for _ in 0..12 {
            send(&mut c, 0x1000, FAST);
        }
        let h = u64::MAX;
        for read in [SLOW, FAST, SLOW] {
            assert!(c.single(0x1000, LEN, h));
            send(&mut c, 0x1000, read);
        }
        assert!(!c.single(0x1000, LEN, h), "half its copies slow: the rings");
    }

    #[test]
    fn each_buffer_is_judged_alone_and_the_oldest_is_forgotten() {
        let mut c = Choices::default();
        for _ in 0..12 {
            send(&mut c, 0x1000, FAST);
            send(&mut c, 0x9000, SLOW);
        }
        let h = u64::MAX;
        assert!(c.single(0x1000, LEN, h));
        assert!(!c.single(0x9000, LEN, h));
        assert!(
            !c.single(0x1000, LEN / 2, h),
            "another length is another buffer"
        );
        for b in 1..=SLOTS {
            send(&mut c, 0x100000 * b, FAST);
        }
        assert!(!c.single(0x1000, LEN, h), "forgotten: back to the rings");
    }
}
