//! Whether other work shares this process's cores, as the scheduler tells
//! it: the share of the time a waiting thread was ready to run but did
//! not (its run delay, in /proc/thread-self/schedstat). While it is large,
//! waits for large transfers sleep at once instead of spinning.
//!
//! Why: a rank that spins while another task wants its core (a data
//! loader, another job) uses up its share of the core while it waits, so
//! when its peer's bytes come, the scheduler runs the other task first. A
//! large transfer streams through the rings and needs both ranks on their
//! cores at once, again and again: a 1 MiB exchange between two ranks with
//! one busy loop beside them on two cores took 0.5-1.3 ms spinning and
//! 0.15-0.19 ms sleeping at once (a sleeper is woken ahead of the other
//! work). A small message is fastest caught by a spin (8 B: 0.5 us
//! spinning, 10-17 us sleeping at once). Large waits spin again once the
//! hold is over. Ranks that outnumber the cores yield instead, and do not
//! ask.

use std::cell::Cell;
use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How often a waiting thread asks the scheduler (a file read of a few
/// microseconds).
const SAMPLE_EVERY: Duration = Duration::from_millis(10);
/// Run delay, as a share of the time between two samples, that is other
/// work (a rank alone on its core sees about 1 %; beside a busy loop,
/// about half).
const CONTENDED_SHARE: f64 = 0.10;
/// Samples in a row that must see other work (a stray kernel thread
/// takes a core for a few milliseconds now and then).
const IN_A_ROW: u32 = 3;
/// How long large waits sleep at once once other work is seen: then they
/// spin again, and the next samples tell. Short at first (a burst of work,
/// such as this process's own start, passes), twice as long each time the
/// other work is still there right after, up to the longest.
const HOLD: Duration = Duration::from_millis(20);
const LONGEST_HOLD: Duration = Duration::from_secs(1);
/// The most bytes a wait may be for and still spin while other work
/// shares the cores (measured: 64 KiB gains nothing from sleeping, 1 MiB
/// three to six times). A receive counts its buffer's size: a small
/// message into a large buffer sleeps too.
const SPIN_BYTES: usize = 256 << 10;

/// The process's detector.
static DETECTOR: Detector = Detector::new();

thread_local! {
    /// This thread's run delay and when it was read (ns since the epoch).
    static LAST: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
    /// Its last samples in a row that saw other work.
    static ROW: Cell<u32> = const { Cell::new(0) };
}

/// The state, process-wide (one value, so that a test can have its own).
struct Detector {
    /// Nanoseconds since `epoch()`: when the next sample is due, until
    /// when large waits sleep at once, the hold last given and when the
    /// last one ended.
    next_sample: AtomicU64,
    sleep_until: AtomicU64,
    last_hold: AtomicU64,
    hold_ended: AtomicU64,
    /// Whether large waits sleep at once now (published after
    /// `sleep_until`).
    sleeping: AtomicBool,
    /// Whether the log said so once.
    said: AtomicBool,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `t` as nanoseconds since the epoch.
fn stamp(t: Instant) -> u64 {
    t.saturating_duration_since(epoch()).as_nanos() as u64
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos() as u64
}

/// How long a wait for `bytes` (counted only when asked) spins before it
/// sleeps: `configured`, or nothing while other work shares the cores and
/// the wait is for more than `SPIN_BYTES`. A wait that `yields` (its ranks
/// outnumber the cores) keeps `configured`.
#[inline]
pub fn spin(configured: Duration, yields: bool, bytes: impl FnOnce() -> usize) -> Duration {
    if yields {
        return configured;
    }
    DETECTOR.spin(configured, bytes, Instant::now)
}

/// A spinning wait's clock read at `now`, on rank `rank` (which the log
/// names): samples the thread's run delay when a sample is due, and ends
/// the sleeping once the hold is over. A wait that `yields` does not ask.
#[inline]
pub fn looked(now: Instant, rank: usize, yields: bool) {
    if !yields {
        DETECTOR.looked(now, rank, run_delay);
    }
}

impl Detector {
    const fn new() -> Detector {
        Detector {
            next_sample: AtomicU64::new(0),
            sleep_until: AtomicU64::new(0),
            last_hold: AtomicU64::new(0),
            hold_ended: AtomicU64::new(0),
            sleeping: AtomicBool::new(false),
            said: AtomicBool::new(false),
        }
    }

    #[inline]
    fn spin(
        &self,
        configured: Duration,
        bytes: impl FnOnce() -> usize,
        now: impl FnOnce() -> Instant,
    ) -> Duration {
        if !self.sleeping.load(Ordering::Acquire) || bytes() <= SPIN_BYTES {
            return configured;
        }
        // A hold that ran out while nobody waited (a compute phase) ends
        // here, not after this wait slept.
        let t = stamp(now());
        if t >= self.sleep_until.load(Ordering::Relaxed) {
            self.end_hold(t);
            return configured;
        }
        Duration::ZERO
    }

    #[inline]
    fn looked(&self, now: Instant, rank: usize, read: impl FnOnce() -> Option<u64>) {
        let t = stamp(now);
        if self.sleeping.load(Ordering::Acquire) && t >= self.sleep_until.load(Ordering::Relaxed) {
            self.end_hold(t);
        }
        if t >= self.next_sample.load(Ordering::Relaxed) {
            self.sample(t, rank, read);
        }
    }

    fn end_hold(&self, t: u64) {
        if self.sleeping.swap(false, Ordering::Relaxed) {
            self.hold_ended.store(t, Ordering::Relaxed);
        }
    }

    #[cold]
    fn sample(&self, t: u64, rank: usize, read: impl FnOnce() -> Option<u64>) {
        self.next_sample
            .store(t + nanos(SAMPLE_EVERY), Ordering::Relaxed);
        let Some(delay) = read() else { return };
        let last = LAST.replace(Some((delay, t)));
        // A sample long after this thread's last one covers its sleeps too.
        let row = match last.filter(|(_, t0)| t > *t0 && t - *t0 <= 4 * nanos(SAMPLE_EVERY)) {
            Some((delay0, t0)) => {
                let share = delay.saturating_sub(delay0) as f64 / (t - t0) as f64;
                match share >= CONTENDED_SHARE {
                    true => ROW.get() + 1,
                    false => 0,
                }
            }
            None => 0,
        };
        ROW.set(row);
        if row >= IN_A_ROW {
            self.contended(t, rank);
        }
    }

    fn contended(&self, t: u64, rank: usize) {
        if self.sleeping.load(Ordering::Relaxed) {
            return;
        }
        // Seen again within the samples right after the last hold: longer.
        let ended = self.hold_ended.load(Ordering::Relaxed);
        let again = ended != 0
            && t.saturating_sub(ended) <= (u64::from(IN_A_ROW) + 2) * nanos(SAMPLE_EVERY);
        let hold = match again {
            true => {
                (self.last_hold.load(Ordering::Relaxed) * 2).clamp(nanos(HOLD), nanos(LONGEST_HOLD))
            }
            false => nanos(HOLD),
        };
        self.last_hold.store(hold, Ordering::Relaxed);
        self.sleep_until.store(t + hold, Ordering::Relaxed);
        self.sleeping.store(true, Ordering::Release);
        if crate::log::enabled(crate::options::LogLevel::Info)
            && !self.said.swap(true, Ordering::Relaxed)
        {
            crate::log::emit(
                crate::options::LogLevel::Info,
                Some(rank),
                "other work shares this process's cores (a waiting thread was off its core a tenth of the time or more, three samples in a row): waits for more than 256 KiB sleep at once while it does",
            );
        }
    }
}

/// This thread's time ready to run but not running, in nanoseconds (the
/// second field of /proc/thread-self/schedstat); None where there is none.
fn run_delay() -> Option<u64> {
    let mut buf = [0u8; 96];
    let n = std::fs::File::open("/proc/thread-self/schedstat")
        .and_then(|mut f| f.read(&mut buf))
        .ok()?;
    let text = std::str::from_utf8(&buf[..n]).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_kept_off_its_core_stops_large_spins_for_a_while() {
        // Its own detector, and the thread's own samples: nothing else in
        // the process reaches them.
        let d = Detector::new();
        LAST.set(None);
        ROW.set(0);
        let spin = Duration::from_micros(500);
        let ms = |n: u64| n * 1_000_000;
        let at = |t: u64| epoch() + Duration::from_nanos(t);
        let hold = nanos(HOLD);
        // Samples every 10 ms from `t`, each with `share` of the time off
        // the core; the time of the last.
        let delay = Cell::new(0u64);
        let samples = |t: u64, n: u64, share: f64| {
            for i in 0..n {
                delay.set(delay.get() + (ms(10) as f64 * share) as u64);
                d.sample(t + ms(10 * i), 0, || Some(delay.get()));
            }
            t + ms(10 * (n - 1))
        };
        // A clock read that samples nothing (not due).
        let look = |t: u64| {
            d.next_sample.store(u64::MAX, Ordering::Relaxed);
            d.looked(at(t), 0, || panic!("no sample is due"));
        };
        let big = |t: u64| d.spin(spin, || SPIN_BYTES + 1, || at(t));
        let small = |t: u64| d.spin(spin, || SPIN_BYTES, || at(t));
        let t0 = stamp(Instant::now()) + ms(1000);
        assert_eq!(big(t0), spin);
        // 1 % delay is a core of one's own; one sample at half is a stray
        // kernel thread.
        let t = samples(t0, 5, 0.01);
        let t = samples(t + ms(10), 1, 0.5);
        let t = samples(t + ms(10), 2, 0.01);
        assert_eq!(big(t), spin);
        // Three in a row at half: other work. Large waits sleep at once,
        // for the first, short hold; small ones still spin.
        let t = samples(t + ms(10), 3, 0.5);
        assert_eq!(big(t), Duration::ZERO);
        assert_eq!(small(t), spin);
        look(t + hold / 2);
        assert_eq!(big(t + hold / 2), Duration::ZERO);
        look(t + hold);
        assert_eq!(big(t + hold), spin);
        // Still there right after: twice as long.
        let t = samples(t + hold + ms(10), 1, 0.5);
        assert_eq!(big(t), Duration::ZERO);
        look(t + hold);
        assert_eq!(big(t + hold), Duration::ZERO);
        look(t + 2 * hold);
        assert_eq!(big(t + 2 * hold), spin);
        // Gone: spinning stays; seen again much later, a short hold again.
        let t = samples(t + 2 * hold + ms(10), 20, 0.01);
        let t = samples(t + ms(10), 3, 0.5);
        assert_eq!(big(t), Duration::ZERO);
        // A hold that ran out while nobody waited ends at the next wait.
        assert_eq!(big(t + hold), spin);
        // A sample long after the last one says nothing (sleeps between).
        let t = samples(t + hold + ms(10), 1, 0.01);
        delay.set(delay.get() + ms(600));
        d.sample(t + ms(1000), 0, || Some(delay.get()));
        assert_eq!(big(t + ms(1000)), spin);
        // The file is there on Linux, and counts up.
        let a = run_delay().expect("/proc/thread-self/schedstat");
        assert!(run_delay().unwrap() >= a);
    }
}
