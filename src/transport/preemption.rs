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
//! work). A small message fits the rings whole and is fastest caught by a
//! spin (8 B: 0.5 us spinning, 10-17 us sleeping at once). Large waits
//! spin again once the hold is over.

use std::cell::Cell;
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
/// How long large waits sleep at once once other work is seen: then they spin
/// again, and the next samples tell. Short at first (a burst of work, such
/// as this process's own start, passes), twice as long each time the other
/// work is still there right after, up to the longest.
const HOLD: Duration = Duration::from_millis(20);
const LONGEST_HOLD: Duration = Duration::from_secs(1);

/// Nanoseconds since `epoch()`: when the next sample is due, and until
/// when waits sleep at once.
static NEXT_SAMPLE: AtomicU64 = AtomicU64::new(0);
static SLEEP_UNTIL: AtomicU64 = AtomicU64::new(0);
/// The hold last given, and when the last one ended (nanoseconds).
static LAST_HOLD: AtomicU64 = AtomicU64::new(0);
static HOLD_ENDED: AtomicU64 = AtomicU64::new(0);
/// Whether waits sleep at once now (read without a clock by every wait).
static SLEEPING: AtomicBool = AtomicBool::new(false);
/// Whether the log said so once.
static SAID: AtomicBool = AtomicBool::new(false);

/// The most bytes a wait may be for and still spin while other work
/// shares the cores: such a message fits the rings whole, so it comes
/// while its peer runs at all, and spinning catches it at once; a larger
/// one streams, needing both ranks on their cores at the same time, which
/// a sleeper woken ahead of the other work gets sooner.
const SPIN_BYTES: usize = 256 << 10;
/// Samples in a row that must see other work (a stray kernel thread
/// takes a core for a few milliseconds now and then).
const IN_A_ROW: u32 = 3;

thread_local! {
    /// This thread's run delay and when it was read (ns since the epoch).
    static LAST: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
    /// Its last samples in a row that saw other work.
    static ROW: Cell<u32> = const { Cell::new(0) };
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `t` as nanoseconds since the epoch.
fn stamp(t: Instant) -> u64 {
    t.saturating_duration_since(epoch()).as_nanos() as u64
}

/// How long a wait for `bytes` spins before it sleeps: `configured`, or
/// nothing while other work shares the cores and the wait is for more
/// than `SPIN_BYTES`.
#[inline]
pub fn spin(configured: Duration, bytes: usize) -> Duration {
    if bytes > SPIN_BYTES && SLEEPING.load(Ordering::Relaxed) {
        Duration::ZERO
    } else {
        configured
    }
}

/// A waiting thread's clock read at `now`: samples its run delay when a
/// sample is due, and ends the sleeping once the hold is over.
#[inline]
pub fn looked(now: Instant) {
    let t = stamp(now);
    if SLEEPING.load(Ordering::Relaxed) && t >= SLEEP_UNTIL.load(Ordering::Relaxed) {
        SLEEPING.store(false, Ordering::Relaxed);
        HOLD_ENDED.store(t, Ordering::Relaxed);
    }
    if t >= NEXT_SAMPLE.load(Ordering::Relaxed) {
        sample(t, run_delay);
    }
}

#[cold]
fn sample(t: u64, read: impl FnOnce() -> Option<u64>) {
    NEXT_SAMPLE.store(t + SAMPLE_EVERY.as_nanos() as u64, Ordering::Relaxed);
    let Some(delay) = read() else { return };
    let last = LAST.replace(Some((delay, t)));
    // A sample long after this thread's last one covers its sleeps too.
    if let Some((delay0, t0)) = last.filter(|(_, t0)| t > *t0) {
        let span = t - t0;
        let share = delay.saturating_sub(delay0) as f64 / span as f64;
        let row = match span <= 4 * SAMPLE_EVERY.as_nanos() as u64 && share >= CONTENDED_SHARE {
            true => ROW.get() + 1,
            false => 0,
        };
        ROW.set(row);
        if row >= IN_A_ROW {
            contended(t, share);
        }
    } else {
        ROW.set(0);
    }
}

fn contended(t: u64, share: f64) {
    if SLEEPING.load(Ordering::Relaxed) {
        return;
    }
    // Seen again within the samples right after the last hold: longer.
    let ended = HOLD_ENDED.load(Ordering::Relaxed);
    let again =
        ended != 0 && t - ended.min(t) <= (IN_A_ROW as u64 + 2) * SAMPLE_EVERY.as_nanos() as u64;
    let hold = match again {
        true => (LAST_HOLD.load(Ordering::Relaxed) * 2).min(LONGEST_HOLD.as_nanos() as u64),
        false => HOLD.as_nanos() as u64,
    };
    LAST_HOLD.store(hold, Ordering::Relaxed);
    SLEEP_UNTIL.store(t + hold, Ordering::Relaxed);
    SLEEPING.store(true, Ordering::Relaxed);
    if !SAID.swap(true, Ordering::Relaxed) {
        crate::log::emit(
            crate::options::LogLevel::Info,
            None,
            &format!(
                "other work shares this process's cores (a waiting thread was kept off its core {:.0} % of the time): waits sleep at once while it does",
                share * 100.0
            ),
        );
    }
}

/// This thread's time ready to run but not running, in nanoseconds (the
/// second field of /proc/thread-self/schedstat); None where there is none.
fn run_delay() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the state is process-wide.
    #[test]
    fn a_thread_kept_off_its_core_stops_the_spin_for_a_while() {
        let spin = Duration::from_micros(500);
        let ms = |n: u64| n * 1_000_000;
        let at = |t: u64| epoch() + Duration::from_nanos(t);
        let hold = HOLD.as_nanos() as u64;
        let big = || super::spin(spin, SPIN_BYTES + 1);
        // Samples every 10 ms from `t`, each with `share` of the time off
        // the core; the time after the last.
        let delay = Cell::new(0u64);
        let samples = |t: u64, n: u64, share: f64| {
            for i in 0..n {
                delay.set(delay.get() + (ms(10) as f64 * share) as u64);
                sample(t + ms(10 * i), || Some(delay.get()));
            }
            t + ms(10 * (n - 1))
        };
        NEXT_SAMPLE.store(u64::MAX, Ordering::Relaxed);
        let t0 = stamp(Instant::now()) + ms(1000);
        assert_eq!(big(), spin);
        // 1 % delay is a core of one's own; one sample at half is a stray
        // kernel thread.
        let t = samples(t0, 5, 0.01);
        let t = samples(t + ms(10), 1, 0.5);
        let t = samples(t + ms(10), 2, 0.01);
        assert_eq!(big(), spin);
        // Three in a row at half: other work. Waits sleep at once, for
        // the first, short hold.
        let t = samples(t + ms(10), 3, 0.5);
        assert_eq!(big(), Duration::ZERO);
        assert_eq!(super::spin(spin, SPIN_BYTES), spin);
        looked(at(t + hold / 2));
        assert_eq!(big(), Duration::ZERO);
        assert_eq!(super::spin(spin, SPIN_BYTES), spin);
        looked(at(t + hold));
        assert_eq!(big(), spin);
        // Still there right after: twice as long.
        let t = samples(t + hold + ms(10), 3, 0.5);
        assert_eq!(big(), Duration::ZERO);
        assert_eq!(super::spin(spin, SPIN_BYTES), spin);
        looked(at(t + hold));
        assert_eq!(big(), Duration::ZERO);
        assert_eq!(super::spin(spin, SPIN_BYTES), spin);
        looked(at(t + 2 * hold));
        assert_eq!(big(), spin);
        // Gone: spinning stays; seen again much later, a short hold again.
        let t = samples(t + 2 * hold + ms(10), 20, 0.01);
        let t = samples(t + ms(10), 3, 0.5);
        assert_eq!(big(), Duration::ZERO);
        assert_eq!(super::spin(spin, SPIN_BYTES), spin);
        looked(at(t + hold));
        assert_eq!(big(), spin);
        // A sample long after the last one says nothing (sleeps between).
        let t = samples(t + hold + ms(10), 1, 0.01);
        delay.set(delay.get() + ms(600));
        sample(t + ms(1000), || Some(delay.get()));
        assert_eq!(big(), spin);
        // The file is there on Linux, and counts up.
        let a = run_delay().expect("/proc/thread-self/schedstat");
        assert!(run_delay().unwrap() >= a);
    }
}
