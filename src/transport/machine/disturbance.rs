//! How much of the machine others used while it was measured: other
//! processes, and a VM's host taking its cores back (steal time). Under
//! them a copy shares its core and a cache line waits for a thread that
//! is not running, so the numbers read low; and a profile is kept until a
//! reboot. So the share is kept beside the profile, and one measured
//! while others used much of the machine is measured again later (see
//! `cached_or_measured`).

/// Busy and total time of every core, and this process's own time, in
/// the kernel's clock ticks.
struct Times {
    busy: u64,
    total: u64,
    own: u64,
}

/// Started before a measurement, read after it.
pub(super) struct Watch(Option<Times>);

impl Watch {
    pub(super) fn start() -> Watch {
        Watch(times())
    }

    /// Others' share of the machine's time since `start`, in thousandths
    /// (None where the kernel does not say).
    pub(super) fn others_permille(&self) -> Option<u32> {
        let (a, b) = (self.0.as_ref()?, times()?);
        others_permille(a, &b)
    }
}

fn others_permille(a: &Times, b: &Times) -> Option<u32> {
    let total = b.total.checked_sub(a.total).filter(|t| *t > 0)?;
    let own = b.own.saturating_sub(a.own);
    let others = b.busy.saturating_sub(a.busy).saturating_sub(own);
    Some((others.saturating_mul(1000) / total).min(1000) as u32)
}

fn times() -> Option<Times> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let (busy, total) = ticks_of(
        &stat,
        Some(super::allowed_cpus())
            .filter(|c| !c.is_empty())
            .as_deref(),
    )?;
    Some(Times {
        busy,
        total,
        own: own_ticks()?,
    })
}

/// Busy and total ticks of the CPUs in `cpus` (None: all, the first
/// line), from /proc/stat's text: others on CPUs this process may not use
/// do not disturb its measuring.
fn ticks_of(stat: &str, cpus: Option<&[usize]>) -> Option<(u64, u64)> {
    let Some(cpus) = cpus else {
        return machine_ticks(stat.lines().next()?);
    };
    let mut sum = (0u64, 0u64);
    let mut any = false;
    for line in stat.lines() {
        let Some(rest) = line.strip_prefix("cpu") else {
            continue;
        };
        let Some((n, fields)) = rest.split_once(' ') else {
            continue;
        };
        let Ok(cpu) = n.parse::<usize>() else {
            continue;
        };
        if cpus.contains(&cpu) {
            let (b, t) = machine_ticks(&format!("cpu {fields}"))?;
            sum = (sum.0 + b, sum.1 + t);
            any = true;
        }
    }
    any.then_some(sum)
}

/// Busy and total ticks from a /proc/stat line ("cpu user nice system
/// idle iowait irq softirq steal ..."). Interrupt time is left out:
/// loopback TCP's work, part of the measuring, may be counted there
/// rather than in this process's own time (a kernel that charges it to
/// the process makes others read lower, never higher).
fn machine_ticks(line: &str) -> Option<(u64, u64)> {
    let v: Vec<u64> = line
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    let [user, nice, system, idle, iowait, _irq, _softirq, steal, ..] = v[..] else {
        return None;
    };
    let busy = user + nice + system + steal;
    Some((busy, busy + idle + iowait))
}

/// This process's user and system time, in clock ticks.
fn own_ticks() -> Option<u64> {
    // SAFETY: getrusage fills the struct it is given; sysconf has no
    // preconditions.
    let (ru, hz) = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut ru) != 0 {
            return None;
        }
        (ru, libc::sysconf(libc::_SC_CLK_TCK))
    };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    let hz = u64::try_from(hz).ok().filter(|h| *h > 0)?;
    Some((us(ru.ru_utime) + us(ru.ru_stime)) * hz / 1_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn others_are_what_the_machine_did_beyond_this_process() {
        let line = "cpu  100 5 50 1000 10 7 9 20 0 0";
        assert_eq!(machine_ticks(line), Some((175, 1185)));
        assert_eq!(machine_ticks("cpu0 1 2 3 4 5 6 7 8"), None);
        assert_eq!(machine_ticks("cpu  1 2 3"), None);
        let stat = "cpu  10 0 10 100 0 0 0 0 0 0\ncpu0 1 0 1 50 0 0 0 0 0 0\ncpu1 9 0 9 50 0 0 0 0 0 0\nintr 5";
        assert_eq!(ticks_of(stat, None), Some((20, 120)));
        assert_eq!(ticks_of(stat, Some(&[1])), Some((18, 68)));
        assert_eq!(ticks_of(stat, Some(&[0, 1])), Some((20, 120)));
        assert_eq!(ticks_of(stat, Some(&[7])), None);
        let a = Times {
            busy: 1000,
            total: 5000,
            own: 300,
        };
        // 400 ticks of 1000 busy, 250 of them this process's: 15 %.
        let b = Times {
            busy: 1400,
            total: 6000,
            own: 550,
        };
        assert_eq!(others_permille(&a, &b), Some(150));
        // Only this process: nothing.
        let alone = Times { own: 700, ..b };
        assert_eq!(others_permille(&a, &alone), Some(0));
        assert_eq!(others_permille(&a, &a), None);
    }

    #[test]
    fn a_busy_core_beside_the_measurement_shows() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Another process keeps one core busy (a thread of this one would
        // count as its own).
        let mut spinner = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh");
        std::thread::sleep(std::time::Duration::from_millis(50));
        let w = Watch::start();
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(400) {
            std::hint::spin_loop();
        }
        let busy = w.others_permille();
        let _ = spinner.kill();
        let _ = spinner.wait();
        let Some(busy) = busy else {
            eprintln!("skipped: this kernel does not say how busy the machine is");
            return;
        };
        // One core of `cores` kept busy by another process, which shares
        // the cores with whatever else runs (other tests): a fifth of its
        // share is enough to tell it from nothing.
        let floor = 1000 / cores as u32 / 5;
        assert!(
            busy >= floor,
            "others used {busy} per mille, expected {floor} or more"
        );
    }
}
