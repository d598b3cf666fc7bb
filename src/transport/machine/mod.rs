//! What this machine can move, measured once per machine and cached: its
//! cores, how fast one core and all cores copy memory, how long a cache
//! line takes to go from one core to another, how fast two cores pass
//! data through shared memory (the rings' two copies) against one core
//! copying it straight out of another's memory (single copy), the same
//! two ways with both cores sending at once (`swaps`), and what loopback
//! TCP does. The tuning model (`algorithms::tuner`) chooses from these; the
//! ranks publish them at init, so that every rank of a job chooses from
//! the same numbers (see `membership::packed`).
//!
//! The cache is a small text file per machine (its boot id, so a reboot
//! measures again) under `$RDIST_CACHE_DIR`, else `$XDG_CACHE_HOME/rdist`,
//! else `~/.cache/rdist`, else the temporary directory. The first process to need it measures under a file lock;
//! the other ranks of the machine wait and read what it wrote, so ranks
//! do not measure against each other. `RDIST_MACHINE` gives the numbers
//! instead (the cache's one-line format), for tests and for hosts where
//! measuring is unwelcome. Beside the numbers the file keeps how much of
//! the machine others used meanwhile (`disturbance`): a profile measured
//! while they used much of it is measured again, at most every ten
//! minutes and by one process, and the quieter measurement kept.

pub(crate) mod cgroup;
mod disturbance;
mod swaps;

use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The measured inputs of the tuning model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Machine {
    /// Cores this process may use.
    pub cores: u32,
    /// One core's memcpy bandwidth over buffers larger than its caches,
    /// in MB/s (bytes copied, 10^6 per second).
    pub copy_one_mbs: u32,
    /// All cores copying at once, together, in MB/s: the memory system's
    /// bound for collectives on shared memory.
    pub copy_all_mbs: u32,
    /// Half a round trip of a cache line between two cores, in ns: the
    /// floor of a step on shared memory.
    pub handoff_ns: u32,
    /// Half a round trip of 8 bytes over loopback TCP, in ns.
    pub tcp_latency_ns: u32,
    /// One loopback TCP stream's bandwidth, in MB/s.
    pub tcp_mbs: u32,
    /// The last-level cache of the first core, in KiB (sysfs).
    pub cache_kib: u32,
    /// Two cores passing data through a shared buffer in 64 KiB pieces,
    /// the writer copying in while the reader copies out (how the rings
    /// move a payload), in MB/s of payload.
    pub pass_mbs: u32,
    /// One core copying data another core just wrote straight out of its
    /// memory with process_vm_readv (how single copy moves a payload), in
    /// MB/s.
    pub cma_mbs: u32,
    /// One small process_vm_readv, in ns: single copy's fixed cost per
    /// message, beside its two frames.
    pub cma_call_ns: u32,
    /// Two cores swapping 1, 4 and 16 MiB they each just wrote, both at
    /// once: single copy's time in thousandths of the rings' (above 1000
    /// the rings are faster for a rank that sends while it receives).
    pub swap_1m_permille: u32,
    pub swap_4m_permille: u32,
    pub swap_16m_permille: u32,
}

/// The cache's format (a new field makes a new one, so old files are
/// measured again, not misread).
const FORMAT: &str = "machine4";
/// The formats before the swaps (`machine3`) and before `pass_mbs`,
/// `cma_mbs` and `cma_call_ns` (`machine2`): still read (from
/// `RDIST_MACHINE`), what they lack unknown.
const EARLIER_FORMATS: [&str; 2] = ["machine3", "machine2"];

/// A profile's size in the packed roster.
pub const BYTES: usize = 52;

/// A profile that says nothing measured: the model then keeps its
/// reference choices (see `tuner::REFERENCE`).
pub const UNKNOWN: Machine = Machine {
    cores: 0,
    copy_one_mbs: 0,
    copy_all_mbs: 0,
    handoff_ns: 0,
    tcp_latency_ns: 0,
    tcp_mbs: 0,
    cache_kib: 0,
    pass_mbs: 0,
    cma_mbs: 0,
    cma_call_ns: 0,
    swap_1m_permille: 0,
    swap_4m_permille: 0,
    swap_16m_permille: 0,
};

impl Machine {
    /// Whether every number was measured (or given).
    pub fn is_known(self) -> bool {
        self.fields().iter().all(|(_, v)| *v > 0)
    }

    /// Its copy bandwidths were measured.
    pub fn knows_memory(self) -> bool {
        self.copy_one_mbs > 0 && self.copy_all_mbs > 0
    }

    /// Its loopback TCP numbers were measured.
    pub fn knows_tcp(self) -> bool {
        self.tcp_latency_ns > 0 && self.tcp_mbs > 0
    }

    /// Both ways of moving a payload between two cores were measured.
    pub fn knows_single_copy(self) -> bool {
        self.pass_mbs > 0 && self.cma_mbs > 0 && self.cma_call_ns > 0
    }

    /// The two ways of swapping payloads were measured.
    pub fn knows_swaps(self) -> bool {
        self.swaps().iter().all(|(_, p)| *p > 0)
    }

    /// (size, single copy's time per mille of the rings') per swap size.
    pub fn swaps(self) -> [(usize, u32); 3] {
        let p = [
            self.swap_1m_permille,
            self.swap_4m_permille,
            self.swap_16m_permille,
        ];
        std::array::from_fn(|i| (swaps::SIZES_MIB[i] << 20, p[i]))
    }

    fn fields(self) -> [(&'static str, u32); 13] {
        [
            ("cores", self.cores),
            ("copy_one_mbs", self.copy_one_mbs),
            ("copy_all_mbs", self.copy_all_mbs),
            ("handoff_ns", self.handoff_ns),
            ("tcp_latency_ns", self.tcp_latency_ns),
            ("tcp_mbs", self.tcp_mbs),
            ("cache_kib", self.cache_kib),
            ("pass_mbs", self.pass_mbs),
            ("cma_mbs", self.cma_mbs),
            ("cma_call_ns", self.cma_call_ns),
            ("swap_1m_permille", self.swap_1m_permille),
            ("swap_4m_permille", self.swap_4m_permille),
            ("swap_16m_permille", self.swap_16m_permille),
        ]
    }

    fn set(&mut self, field: usize, v: u32) {
        let slot = match field {
            0 => &mut self.cores,
            1 => &mut self.copy_one_mbs,
            2 => &mut self.copy_all_mbs,
            3 => &mut self.handoff_ns,
            4 => &mut self.tcp_latency_ns,
            5 => &mut self.tcp_mbs,
            6 => &mut self.cache_kib,
            7 => &mut self.pass_mbs,
            8 => &mut self.cma_mbs,
            9 => &mut self.cma_call_ns,
            10 => &mut self.swap_1m_permille,
            11 => &mut self.swap_4m_permille,
            _ => &mut self.swap_16m_permille,
        };
        *slot = v;
    }

    /// One line: "machine4 cores=16 copy_one_mbs=6300 ...".
    pub fn to_line(self) -> String {
        let mut s = FORMAT.to_string();
        for (k, v) in self.fields() {
            s += &format!(" {k}={v}");
        }
        s
    }

    /// The line `to_line` wrote; None when it is not one.
    pub fn from_line(line: &str) -> Option<Machine> {
        let mut words = line.split_whitespace();
        let format = words.next()?;
        if format != FORMAT && !EARLIER_FORMATS.contains(&format) {
            return None;
        }
        let names = UNKNOWN.fields().map(|(k, _)| k);
        let mut m = UNKNOWN;
        for w in words {
            let (k, v) = w.split_once('=')?;
            let v: u32 = v.parse().ok()?;
            let field = names.iter().position(|n| *n == k)?;
            m.set(field, v);
        }
        (m.cores > 0).then_some(m)
    }

    /// A compact token for the roster's published line (no spaces):
    /// the numbers joined by commas; `-` when nothing is known.
    pub fn to_token(self) -> String {
        if self.cores == 0 {
            return "-".into();
        }
        let v: Vec<String> = self.fields().iter().map(|(_, v)| v.to_string()).collect();
        v.join(",")
    }

    /// The token `to_token` wrote; UNKNOWN for anything else.
    pub fn from_token(token: &str) -> Machine {
        let v: Vec<u32> = token.split(',').filter_map(|x| x.parse().ok()).collect();
        if v.len() != UNKNOWN.fields().len() {
            return UNKNOWN;
        }
        let mut m = UNKNOWN;
        for (i, x) in v.into_iter().enumerate() {
            m.set(i, x);
        }
        m
    }

    /// The numbers, little-endian (the packed roster's form).
    pub fn to_bytes(self) -> [u8; BYTES] {
        let mut out = [0u8; BYTES];
        for (i, (_, v)) in self.fields().iter().enumerate() {
            out[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    pub fn from_bytes(b: &[u8; BYTES]) -> Machine {
        let mut m = UNKNOWN;
        for (i, w) in b.chunks_exact(4).enumerate() {
            m.set(i, u32::from_le_bytes(w.try_into().expect("4 bytes")));
        }
        m
    }
}

/// This machine's profile: given by `RDIST_MACHINE`, else cached, else
/// measured now (and cached). `machine` names the machine in the cache
/// (its boot id, which its network namespaces share: see
/// `membership::hosts::machine_of`). Looked up once per process; UNKNOWN
/// if it cannot be had (the model then keeps its reference choices).
pub fn this_machine(machine: &str) -> Machine {
    static THIS: OnceLock<Machine> = OnceLock::new();
    *THIS.get_or_init(|| {
        if let Some(line) = crate::options::machine_profile() {
            return Machine::from_line(&line).unwrap_or(UNKNOWN);
        }
        cached_or_measured(machine).unwrap_or(UNKNOWN)
    })
}

/// How the numbers are measured: a change that makes earlier files wrong
/// moves it on, so those are measured again (their lines stay readable,
/// as `RDIST_MACHINE`).
const MEASURED_BY: &str = "m4";

/// Others' share of the machine (thousandths of its cores' time) above
/// which a measurement counts as disturbed.
const BUSY_PERMILLE: u32 = 100;

/// How long a disturbed profile is used before it is measured again.
const MEASURE_AGAIN_AFTER: Duration = Duration::from_secs(600);

/// The cache file's name: the machine and the cores this process may use.
fn cache_name(machine: &str, cores: usize) -> String {
    let clean: String = machine
        .chars()
        .map(|c| match c.is_ascii_alphanumeric() || c == '-' {
            true => c,
            false => '_',
        })
        .take(64)
        .collect();
    format!("{FORMAT}{MEASURED_BY}-{clean}-{cores}cores")
}

fn cached_or_measured(machine: &str) -> Option<Machine> {
    cached_or_measured_in(&crate::options::cache_dir(), machine)
}

/// `cached_or_measured`, with the cache in `dir`.
fn cached_or_measured_in(dir: &std::path::Path, machine: &str) -> Option<Machine> {
    let cpus = cgroup::machine_cpus();
    let cores = match cpus.len() {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n.min(cgroup::quota_cores().map_or(usize::MAX, |q| q as usize)),
    };
    let measure_watched = |cores| measure_watched_on(&cpus, cores);
    if !own_private_dir(dir) {
        return Some(measure_watched(cores).0);
    }
    let name = cache_name(machine, cores);
    let path = dir.join(format!("{name}.txt"));
    // The file is written whole and renamed into place: reading it needs
    // no lock (the ranks of a wide job would take turns at it).
    let cached = || read_cache(&path);
    // Measured while others used much of the machine, and not tried again
    // lately.
    let due = |others: u32| others > BUSY_PERMILLE && older_than(&path, MEASURE_AGAIN_AFTER);
    let lock = || {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(dir.join(format!("{name}.lock")))
            .ok()
    };
    if let Some((m, others)) = cached() {
        if !due(others) {
            return Some(m);
        }
        // Measured while others used much of the machine: one process
        // measures again, if nobody does (nobody waits for it), and the
        // quieter profile stays; the file's time says when it was tried.
        let file = lock();
        let Some(_locked) = file.as_ref().and_then(|f| Locked::take(f, Duration::ZERO)) else {
            return Some(m);
        };
        let Some((m, others)) = cached() else {
            return Some(m);
        };
        // Measured again meanwhile, by the holder before this one.
        if !due(others) {
            return Some(m);
        }
        let (again, others_again) = measure_watched(cores);
        let (kept, kept_others) = match others_again < others {
            true => (again, others_again),
            false => (m, others),
        };
        crate::log::emit(
            crate::options::LogLevel::Info,
            None,
            &format!(
                "the machine profile was measured while others used {}% of the machine; measured again while they used {}%: kept the {} one",
                others / 10,
                others_again / 10,
                if others_again < others { "new" } else { "old" }
            ),
        );
        write_cache(&path, kept, kept_others);
        return Some(kept);
    }
    // No lock, no measuring: every rank of the machine would measure at
    // once, against each other.
    let file = lock()?;
    // One measurer per machine: the others wait here (bounded by the
    // measurement, well under a second), then read its file. A holder
    // that never lets go (a stopped process) costs the others 10 s, then
    // they measure for themselves.
    let Some(locked) = Locked::take(&file, Duration::from_secs(10)) else {
        return Some(measure_watched(cores).0);
    };
    if let Some((m, _)) = cached() {
        return Some(m);
    }
    let (m, others) = measure_watched(cores);
    write_cache(&path, m, others);
    drop(locked);
    Some(m)
}

/// The profile in the cache file at `path`, and how much of the machine
/// others used while it was measured (0 when the file does not say).
fn read_cache(path: &std::path::Path) -> Option<(Machine, u32)> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut lines = text.lines();
    let m = Machine::from_line(lines.next()?.trim())?;
    let others = lines
        .next()
        .and_then(|l| l.trim().strip_prefix("others_permille="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Some((m, others))
}

/// Writes the cache file whole, then renames it into place.
fn write_cache(path: &std::path::Path, m: Machine, others: u32) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    // A file of its own, never one a link points to.
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(format!("{}\nothers_permille={others}\n", m.to_line()).as_bytes())
        });
    match written {
        Ok(()) => {
            let _ = std::fs::rename(&tmp, path);
        }
        Err(_) => {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

/// Whether the file at `path` was last written more than `age` ago.
fn older_than(path: &std::path::Path, age: Duration) -> bool {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|e| e > age)
}

/// `measure`, and how much of the machine others used meanwhile (per
/// mille; 0 where the kernel does not say), on a thread that may run on
/// `cpus` (the machine's: see `cgroup::machine_cpus`), as the threads it
/// starts may: a rank bound to one core still measures the machine, not
/// that core (two cores passing bytes, all cores copying); `cores` at
/// most, as many as the thread got. Where no thread can start, on the
/// caller, within its own CPUs (its binding is the launcher's).
fn measure_watched_on(cpus: &[usize], cores: usize) -> (Machine, u32) {
    let watched = |cores: usize| {
        let watch = disturbance::Watch::start();
        let m = measure(cores);
        (m, watch.others_permille().unwrap_or(0))
    };
    let on = cpus.to_vec();
    let widened = spawn(move || {
        if !on.is_empty() {
            allow_cpus(&on);
        }
        // The kernel keeps the thread inside the cgroup's cpuset.
        let got = allowed_cpus().len();
        watched(if got > 0 { cores.min(got) } else { cores })
    });
    match widened {
        Some(h) => h.join().unwrap_or((UNKNOWN, 0)),
        None => watched(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

/// Lets the calling thread (and the threads it starts) run on `cpus`;
/// where the system refuses, it keeps the CPUs it had.
fn allow_cpus(cpus: &[usize]) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes
    // within it (numbers past its size are skipped); pid 0 is the calling
    // thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus.iter().filter(|c| **c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Makes `dir` (mode 0700) if it is not there, and says whether it is
/// this user's own and nobody else's to write: a shared temporary
/// directory must not let another user plant the file read here.
fn own_private_dir(dir: &std::path::Path) -> bool {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir);
    let Ok(meta) = std::fs::symlink_metadata(dir) else {
        return false;
    };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    meta.is_dir() && meta.uid() == me && meta.mode() & 0o022 == 0
}

/// An exclusive flock, released on drop.
struct Locked<'a>(&'a std::fs::File);

impl<'a> Locked<'a> {
    /// The lock, tried every 10 ms for up to `limit`.
    fn take(f: &'a std::fs::File, limit: Duration) -> Option<Locked<'a>> {
        use std::os::fd::AsRawFd;
        let deadline = Instant::now() + limit;
        loop {
            // SAFETY: flock on a descriptor this function's caller keeps
            // open.
            let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                return Some(Locked(f));
            }
            let busy = std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK);
            if !busy || Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: as in take.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Measures this machine (about a third of a second). A number that
/// could not be measured (no loopback in this network namespace, no
/// thread to spare, no cache in sysfs) is 0: the model then takes the
/// reference machine's for what it feeds.
pub fn measure(cores: usize) -> Machine {
    let threads = cores.clamp(1, 64);
    let copy_one = || copy_mbs(1, 64 << 20);
    // The threads' buffers together outgrow the caches.
    let copy_all = || copy_mbs(threads, (128 << 20) / threads);
    let mut m = Machine {
        cores: cores as u32,
        copy_one_mbs: copy_one().unwrap_or(0),
        copy_all_mbs: copy_all().unwrap_or(0),
        handoff_ns: handoff_ns().unwrap_or(0),
        tcp_latency_ns: tcp_latency_ns().unwrap_or(0),
        tcp_mbs: tcp_mbs().unwrap_or(0),
        cache_kib: last_level_cache_kib(),
        ..two_core_moves().unwrap_or(UNKNOWN)
    };
    if let Some([one, four, sixteen]) = swaps::single_copy_permille() {
        m.swap_1m_permille = one;
        m.swap_4m_permille = four;
        m.swap_16m_permille = sixteen;
    }
    // Whatever else runs meanwhile (another job, the machine's host) only
    // makes a copy read low, and the profile is kept until a reboot: the
    // copies are timed again, after the rest, and the better kept.
    m.copy_one_mbs = m.copy_one_mbs.max(copy_one().unwrap_or(0));
    m.copy_all_mbs = m.copy_all_mbs.max(copy_all().unwrap_or(0));
    m
}

/// A measuring thread, or None when none can be started.
fn spawn<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<std::thread::JoinHandle<T>> {
    std::thread::Builder::new()
        .name("rdist-measure".into())
        .spawn(f)
        .ok()
}

/// `threads` threads each copying half of `bytes` between two buffers of
/// their own at once (at least 2 MiB each way); the best of five rounds,
/// all threads' bytes together.
fn copy_mbs(threads: usize, bytes: usize) -> Option<u32> {
    let bytes = (bytes / 2).max(2 << 20);
    // The threads start copying only once all of them exist (a thread
    // that could not start would leave the others at the barrier).
    let go = Arc::new((
        std::sync::Mutex::new(None::<bool>),
        std::sync::Condvar::new(),
    ));
    let start = Arc::new(std::sync::Barrier::new(threads));
    let mut handles = Vec::with_capacity(threads);
    for _ in 0..threads {
        let (go, start) = (go.clone(), start.clone());
        handles.push(spawn(move || {
            let (lock, ready) = &*go;
            let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
            while state.is_none() {
                state = ready.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if *state != Some(true) {
                return Duration::MAX;
            }
            drop(state);
            let src = vec![1u8; bytes];
            let mut dst = vec![0u8; bytes];
            let mut best = Duration::MAX;
            for _ in 0..5 {
                start.wait();
                let t = Instant::now();
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&mut dst);
                best = best.min(t.elapsed());
            }
            best
        }));
    }
    let all = handles.iter().all(Option::is_some);
    {
        let (lock, ready) = &*go;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = Some(all);
        ready.notify_all();
    }
    let slowest = handles
        .into_iter()
        .flatten()
        .map(|h| h.join().unwrap_or(Duration::MAX))
        .max()?;
    (all && slowest != Duration::MAX).then(|| mbs(bytes * threads, slowest).max(1))
}

/// The largest cache sysfs lists for cpu0, in KiB (0 if none).
fn last_level_cache_kib() -> u32 {
    cpu0_caches().max().unwrap_or(0)
}

/// The largest cache cpu0 shares with no other core (with its own
/// hardware threads only: its level 1 and 2 on today's servers; not the
/// level 2 that a cluster of small cores shares), in KiB (0 if sysfs
/// lists none). Read, not measured, so not in the profile; once per
/// process (every communicator's tuning asks).
pub fn core_cache_kib() -> u32 {
    static KIB: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *KIB.get_or_init(read_core_cache_kib)
}

fn read_core_cache_kib() -> u32 {
    let cpu0 = "/sys/devices/system/cpu/cpu0";
    let read = |path: String| std::fs::read_to_string(path).map(|s| s.trim().to_string());
    let Ok(threads) = read(format!("{cpu0}/topology/thread_siblings_list")) else {
        return 0;
    };
    (0..8)
        .map_while(|i| {
            let dir = format!("{cpu0}/cache/index{i}");
            let size = read(format!("{dir}/size")).ok()?;
            let shared = read(format!("{dir}/shared_cpu_list")).unwrap_or_default();
            Some(if shared == threads { kib_of(&size) } else { 0 })
        })
        .max()
        .unwrap_or(0)
}

/// cpu0's caches as sysfs lists them, in KiB.
fn cpu0_caches() -> impl Iterator<Item = u32> {
    (0..8).map_while(|i| {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
        let size = std::fs::read_to_string(format!("{dir}/size")).ok()?;
        Some(kib_of(size.trim()))
    })
}

/// "48K" or "32M" in KiB (0 if neither).
fn kib_of(size: &str) -> u32 {
    match size.strip_suffix('K') {
        Some(k) => k.parse().unwrap_or(0),
        None => size
            .strip_suffix('M')
            .and_then(|m| m.parse::<u32>().ok())
            .map_or(0, |m| m.saturating_mul(1024)),
    }
}

fn mbs(bytes: usize, took: Duration) -> u32 {
    let us = took.as_micros().max(1);
    (bytes as u128 / us).min(u32::MAX as u128) as u32
}

/// Two threads, each pinned to a core of its own, passing a counter back
/// and forth in batches for 20 ms; the best batch counts (a preempted
/// partner says nothing about the cores). Bounded by time, so a machine
/// of one core (where each pass is a context switch) is done as soon.
fn handoff_ns() -> Option<u32> {
    const BATCH: u64 = 64;
    let cpus = Arc::new(allowed_cpus());
    // On one core every pass is a context switch: nothing to learn about
    // the trip between cores.
    if cpus.len() < 2 {
        return None;
    }
    let pin = move |cpus: &[usize], i: usize| {
        if cpus.len() >= 2 {
            pin_to(cpus[i]);
        }
    };
    let theirs = cpus.clone();
    let ball = Arc::new(AtomicU64::new(0));
    let other = ball.clone();
    let partner = spawn(move || {
        pin(&theirs, 1);
        let mut next = 1;
        let mut idle = Instant::now();
        loop {
            let v = other.load(Ordering::Acquire);
            if v == u64::MAX {
                return;
            }
            if v == next {
                other.store(v + 1, Ordering::Release);
                next += 2;
                idle = Instant::now();
            } else {
                std::hint::spin_loop();
                if idle.elapsed() > Duration::from_millis(200) {
                    return;
                }
            }
        }
    });
    let partner = partner?;
    let stop_partner = ball.clone();
    let Some(measurer) = spawn(move || {
        pin(&cpus, 0);
        let stop = Instant::now() + Duration::from_millis(20);
        let mut best = u128::MAX;
        let mut v = 0;
        'batches: while Instant::now() < stop {
            let t = Instant::now();
            for _ in 0..BATCH / 2 {
                ball.store(v + 1, Ordering::Release);
                while ball.load(Ordering::Acquire) != v + 2 {
                    std::hint::spin_loop();
                    if t.elapsed() > Duration::from_millis(100) {
                        break 'batches;
                    }
                }
                v += 2;
            }
            best = best.min(t.elapsed().as_nanos() / u128::from(BATCH));
        }
        ball.store(u64::MAX, Ordering::Release);
        (best != u128::MAX).then(|| best.clamp(1, 1_000_000) as u32)
    }) else {
        stop_partner.store(u64::MAX, Ordering::Release);
        let _ = partner.join();
        return None;
    };
    let ns = measurer.join().ok().flatten();
    let _ = partner.join();
    ns
}

/// Payload moved between two cores, the rings' way and single copy's
/// way, on two pinned cores (`pass_mbs`, `cma_mbs`), and single copy's
/// fixed cost (`cma_call_ns`); the rest of the profile unknown. None
/// with fewer than two usable cores, or when a thread cannot start or
/// the other stalls.
fn two_core_moves() -> Option<Machine> {
    let (c0, c1) = two_cores()?;
    let area = Arc::new(MoveArea::new());
    let (writer_area, reader_area) = (area.clone(), area.clone());
    let ((), times) = pinned_pair(
        (c0, move || writer_area.write_rounds()),
        (c1, move || reader_area.read_rounds()),
        || area.stop.store(true, Ordering::Release),
    )?;
    let (pass, cma) = times?;
    Some(Machine {
        pass_mbs: mbs(MoveArea::BYTES, pass).max(1),
        cma_mbs: mbs(MoveArea::BYTES, cma).max(1),
        cma_call_ns: cma_call_ns()?,
        ..UNKNOWN
    })
}

/// The buffers and counters of `two_core_moves`: the writer's source,
/// a ring of 64 KiB slots (1 MiB, as a pair's ring), the reader's
/// destination.
struct MoveArea {
    src: *mut u8,
    ring: *mut u8,
    dst: *mut u8,
    /// Pieces written into the ring, and read out of it, so far.
    written: AtomicU64,
    freed: AtomicU64,
    /// The writer's step (2r+1: the source of round r is written for the
    /// rings; 2r+2: for single copy), and the last step the reader ended.
    step: AtomicU64,
    seen: AtomicU64,
    stop: std::sync::atomic::AtomicBool,
}

// SAFETY: the buffers are only touched as the counters allow (the writer
// writes `src` and the ring's free slots, the reader reads filled slots
// and `src` only while the writer waits, and writes `dst`).
unsafe impl Send for MoveArea {}
unsafe impl Sync for MoveArea {}

impl MoveArea {
    const PIECE: usize = 64 << 10;
    const SLOTS: usize = 16;
    /// Bytes moved per round: past one core's share of most caches, yet
    /// quick.
    const BYTES: usize = 4 << 20;
    const PIECES: usize = Self::BYTES / Self::PIECE;
    const ROUNDS: u64 = 4;
    /// The longest either thread waits for the other.
    const PATIENCE: Duration = Duration::from_millis(200);

    fn new() -> MoveArea {
        let leak = |n: usize, b: u8| Box::into_raw(vec![b; n].into_boxed_slice()).cast::<u8>();
        MoveArea {
            src: leak(Self::BYTES, 1),
            ring: leak(Self::PIECE * Self::SLOTS, 2),
            dst: leak(Self::BYTES, 3),
            written: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            step: AtomicU64::new(0),
            seen: AtomicU64::new(0),
            stop: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Spins until `ready` holds; false when stopped or out of patience.
    fn wait(&self, ready: impl Fn() -> bool) -> bool {
        spin_until(&self.stop, Self::PATIENCE, ready)
    }

    /// The writer: each round, writes its source anew (so that it sits
    /// in this core's cache, as data just made does) and copies it into
    /// the ring piece by piece; then writes it anew for the reader to
    /// copy straight out.
    fn write_rounds(&self) {
        for r in 0..Self::ROUNDS {
            for (step, fill) in [(2 * r + 1, 0x11), (2 * r + 2, 0x22)] {
                if !self.wait(|| self.seen.load(Ordering::Acquire) + 1 >= step) {
                    return;
                }
                // SAFETY: the reader reads `src` only between this step
                // and its `seen` of it.
                unsafe { std::ptr::write_bytes(self.src, fill ^ r as u8, Self::BYTES) };
                self.step.store(step, Ordering::Release);
                if step % 2 == 0 {
                    continue;
                }
                let base = r * Self::PIECES as u64;
                for i in 0..Self::PIECES {
                    let n = base + i as u64;
                    let room = || n < self.freed.load(Ordering::Acquire) + Self::SLOTS as u64;
                    if !self.wait(room) {
                        return;
                    }
                    let slot = (n as usize % Self::SLOTS) * Self::PIECE;
                    // SAFETY: piece i of the source, into a slot the
                    // reader freed.
                    unsafe {
                        crate::copy::copy_nonoverlapping(
                            self.src.add(i * Self::PIECE),
                            self.ring.add(slot),
                            Self::PIECE,
                        )
                    };
                    self.written.store(n + 1, Ordering::Release);
                }
            }
        }
    }

    /// The reader: the best time of the rounds for each way.
    fn read_rounds(&self) -> Option<(Duration, Duration)> {
        let (mut pass, mut cma) = (Duration::MAX, Duration::MAX);
        for r in 0..Self::ROUNDS {
            if !self.wait(|| self.step.load(Ordering::Acquire) == 2 * r + 1) {
                return None;
            }
            let t = Instant::now();
            let base = r * Self::PIECES as u64;
            for i in 0..Self::PIECES {
                let n = base + i as u64;
                if !self.wait(|| self.written.load(Ordering::Acquire) > n) {
                    return None;
                }
                let slot = (n as usize % Self::SLOTS) * Self::PIECE;
                // SAFETY: a slot the writer filled, into piece i of ours.
                unsafe {
                    crate::copy::copy_nonoverlapping(
                        self.ring.add(slot),
                        self.dst.add(i * Self::PIECE),
                        Self::PIECE,
                    )
                };
                self.freed.store(n + 1, Ordering::Release);
            }
            pass = pass.min(t.elapsed());
            self.seen.store(2 * r + 1, Ordering::Release);
            if !self.wait(|| self.step.load(Ordering::Acquire) == 2 * r + 2) {
                return None;
            }
            let t = Instant::now();
            // SAFETY: both ranges are this area's live buffers.
            let dst = unsafe { std::slice::from_raw_parts_mut(self.dst, Self::BYTES) };
            super::channel::read_remote(std::process::id() as i32, self.src as u64, dst).ok()?;
            cma = cma.min(t.elapsed());
            self.seen.store(2 * r + 2, Ordering::Release);
        }
        Some((pass, cma))
    }
}

impl Drop for MoveArea {
    fn drop(&mut self) {
        for (p, n) in [
            (self.src, Self::BYTES),
            (self.ring, Self::PIECE * Self::SLOTS),
            (self.dst, Self::BYTES),
        ] {
            // SAFETY: leaked in `new` as boxed slices of these lengths.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)) });
        }
    }
}

/// One process_vm_readv of 64 bytes of this process, in ns (the best of
/// batches): what single copy pays per message whatever its size.
fn cma_call_ns() -> Option<u32> {
    const BATCH: u32 = 64;
    let src = [7u8; 64];
    let mut dst = [0u8; 64];
    let pid = std::process::id() as i32;
    let mut best = Duration::MAX;
    for _ in 0..16 {
        let t = Instant::now();
        for _ in 0..BATCH {
            super::channel::read_remote(pid, src.as_ptr() as u64, &mut dst).ok()?;
        }
        best = best.min(t.elapsed());
    }
    Some((best.as_nanos() / u128::from(BATCH)).clamp(1, u32::MAX as u128) as u32)
}

/// Runs `first` and `second` on threads pinned to their cores, and
/// their results once both end: `stop` tells the first to give up once
/// the second has ended (or could not start). None when a thread cannot
/// start or panics.
fn pinned_pair<A: Send + 'static, B: Send + 'static>(
    first: (usize, impl FnOnce() -> A + Send + 'static),
    second: (usize, impl FnOnce() -> B + Send + 'static),
    stop: impl Fn(),
) -> Option<(A, B)> {
    let ((c0, f), (c1, g)) = (first, second);
    let first = spawn(move || {
        pin_to(c0);
        f()
    })?;
    let Some(second) = spawn(move || {
        pin_to(c1);
        g()
    }) else {
        stop();
        let _ = first.join();
        return None;
    };
    let b = second.join().ok();
    stop();
    let a = first.join().ok();
    Some((a?, b?))
}

/// Spins until `ready` holds, for a measuring thread waiting on its
/// partner; false once `stop` is set or after `patience`.
fn spin_until(
    stop: &std::sync::atomic::AtomicBool,
    patience: Duration,
    ready: impl Fn() -> bool,
) -> bool {
    let give_up = Instant::now() + patience;
    let mut spins = 0u32;
    while !ready() {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) && (stop.load(Ordering::Acquire) || Instant::now() >= give_up)
        {
            return false;
        }
    }
    true
}

/// Two of the cores this process may run on, for the two-core
/// measurements: the second not a hardware thread of the first where
/// another is allowed (siblings share their caches, which would hide what
/// the measurements look for).
fn two_cores() -> Option<(usize, usize)> {
    let cpus = allowed_cpus();
    let first = *cpus.first()?;
    let siblings = std::fs::read_to_string(format!(
        "/sys/devices/system/cpu/cpu{first}/topology/thread_siblings_list"
    ))
    .map(|s| cpu_list(s.trim()))
    .unwrap_or_default();
    let others: Vec<usize> = cpus.iter().copied().filter(|&c| c != first).collect();
    let second = others
        .iter()
        .copied()
        .find(|c| !siblings.contains(c))
        .or_else(|| others.first().copied())?;
    Some((first, second))
}

/// A sysfs cpu list ("0-3,8,10-11") as its cpus.
fn cpu_list(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    out.extend(a..=b.min(a + 4096));
                }
            }
            None => out.extend(part.parse::<usize>().ok()),
        }
    }
    out
}

/// The CPUs the calling thread may run on (empty where the system does
/// not say).
pub(crate) fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity
    // writes at most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|c| libc::CPU_ISSET(*c, &set))
            .collect()
    }
}

/// Pins the calling thread (only it) to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: as in allowed_cpus; pid 0 is the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn loopback_pair() -> Result<(TcpStream, TcpStream)> {
    let sys = |what: &str, e: std::io::Error| Error::system(what.to_string(), &e);
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| sys("bind", e))?;
    let addr = l.local_addr().map_err(|e| sys("local_addr", e))?;
    let a =
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)).map_err(|e| sys("connect", e))?;
    let (b, _) = l.accept().map_err(|e| sys("accept", e))?;
    for s in [&a, &b] {
        s.set_nodelay(true).map_err(|e| sys("nodelay", e))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))
            .map_err(|e| sys("timeout", e))?;
    }
    Ok((a, b))
}

/// 8-byte ping-pong over loopback TCP between two threads, in batches
/// for 20 ms; the best batch counts, as in `handoff_ns`.
fn tcp_latency_ns() -> Result<u32> {
    const BATCH: u32 = 16;
    let (mut a, mut b) = loopback_pair()?;
    let echo = spawn(move || {
        let mut buf = [0u8; 8];
        while b.read_exact(&mut buf).is_ok() && buf != [0xff; 8] {
            if b.write_all(&buf).is_err() {
                return;
            }
        }
    })
    .ok_or_else(|| Error::internal("no thread to measure with"))?;
    let io = |e| Error::system("loopback ping-pong", &e);
    let stop = Instant::now() + Duration::from_millis(20);
    let mut best = Duration::MAX;
    let mut buf = [0u8; 8];
    while best == Duration::MAX || Instant::now() < stop {
        let t = Instant::now();
        for i in 0..BATCH {
            a.write_all(&u64::from(i).to_le_bytes()).map_err(io)?;
            a.read_exact(&mut buf).map_err(io)?;
        }
        best = best.min(t.elapsed());
    }
    let _ = a.write_all(&[0xff; 8]);
    let _ = echo.join();
    if best == Duration::MAX {
        return Err(Error::internal("no ping-pong batch finished"));
    }
    Ok((best.as_nanos() / u128::from(2 * BATCH)).clamp(1, u32::MAX as u128) as u32)
}

/// One loopback TCP stream carrying 16 MiB in 1 MiB writes, sixteen
/// times; the best time counts. The two ends are threads on cores of
/// their own, as two ranks' would be (left to the scheduler, a reader
/// woken by the writer is often moved to its core), and the reader asks
/// for quick acknowledgements as the transport does: either left out,
/// the figure changed from one measurement to the next by up to 3x, and
/// with it the crossovers over TCP.
fn tcp_mbs() -> Result<u32> {
    const ROUND: usize = 16 << 20;
    const ROUNDS: usize = 16;
    let cpus = allowed_cpus();
    let pin = move |i: usize| {
        if cpus.len() >= 2 {
            pin_to(cpus[i]);
        }
    };
    let pin_writer = pin.clone();
    let (mut a, mut b) = loopback_pair()?;
    let sink = spawn(move || {
        pin(1);
        let mut buf = vec![0u8; 1 << 20];
        for _ in 0..ROUNDS {
            let mut got = 0;
            while got < ROUND {
                match b.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got += n,
                }
                // See `Channel::expect_bulk`: the answer written after
                // each round would have the kernel hold acknowledgements
                // back for it.
                super::tcp::ask_quick_acks(std::os::fd::AsRawFd::as_raw_fd(&b));
            }
            if b.write_all(&[1]).is_err() {
                return;
            }
        }
    })
    .ok_or_else(|| Error::internal("no thread to measure with"))?;
    // The writer is a thread of its own too: pinning the caller would
    // leave the application's thread pinned.
    let writer = spawn(move || -> std::io::Result<Duration> {
        pin_writer(0);
        let chunk = vec![7u8; 1 << 20];
        let mut best = Duration::MAX;
        for _ in 0..ROUNDS {
            let t = Instant::now();
            for _ in 0..ROUND / chunk.len() {
                a.write_all(&chunk)?;
            }
            let mut done = [0u8; 1];
            a.read_exact(&mut done)?;
            best = best.min(t.elapsed());
        }
        Ok(best)
    })
    .ok_or_else(|| Error::internal("no thread to measure with"))?;
    let best = writer
        .join()
        .map_err(|_| Error::internal("the measuring thread failed"))?
        .map_err(|e| Error::system("loopback stream", &e));
    let _ = sink.join();
    Ok(mbs(ROUND, best?))
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn the_line_and_the_token_and_the_bytes_say_the_same() {
        let m = Machine {
            cores: 16,
            copy_one_mbs: 6300,
            copy_all_mbs: 41000,
            handoff_ns: 90,
            tcp_latency_ns: 9000,
            tcp_mbs: 3100,
            cache_kib: 32768,
            pass_mbs: 12000,
            cma_mbs: 25000,
            cma_call_ns: 350,
            swap_1m_permille: 1260,
            swap_4m_permille: 1110,
            swap_16m_permille: 1300,
        };
        assert_eq!(Machine::from_line(&m.to_line()), Some(m));
        assert!(m.knows_swaps() && m.is_known());
        // The format before the swaps: read, those unknown.
        let before = Machine::from_line(
            "machine3 cores=16 copy_one_mbs=6300 copy_all_mbs=41000 handoff_ns=90 \
             tcp_latency_ns=9000 tcp_mbs=3100 cache_kib=32768 pass_mbs=12000 cma_mbs=25000 \
             cma_call_ns=350",
        )
        .unwrap();
        assert_eq!(
            before,
            Machine {
                swap_1m_permille: 0,
                swap_4m_permille: 0,
                swap_16m_permille: 0,
                ..m
            }
        );
        assert!(before.knows_single_copy() && !before.knows_swaps());
        // The format before the two-core moves: read, those unknown.
        let old = Machine::from_line(
            "machine2 cores=16 copy_one_mbs=6300 copy_all_mbs=41000 handoff_ns=90 \
             tcp_latency_ns=9000 tcp_mbs=3100 cache_kib=32768",
        )
        .unwrap();
        assert_eq!(
            old,
            Machine {
                pass_mbs: 0,
                cma_mbs: 0,
                cma_call_ns: 0,
                ..before
            }
        );
        assert!(!old.knows_single_copy() && m.knows_single_copy());
        assert_eq!(Machine::from_token(&m.to_token()), m);
        assert_eq!(Machine::from_bytes(&m.to_bytes()), m);
        assert_eq!(Machine::from_token(&UNKNOWN.to_token()), UNKNOWN);
        assert_eq!(Machine::from_line("machine0 cores=1"), None);
        assert_eq!(Machine::from_line("machine2 cores=1 bogus=2"), None);
        assert_eq!(Machine::from_line("machine2 cores=1 copy_one_mbs=x"), None);
        assert_eq!(Machine::from_line("machine2 cores=0"), None);
        let partial = Machine::from_line("machine2 cores=4 copy_one_mbs=5000").unwrap();
        assert!(!partial.knows_memory() && !partial.knows_tcp() && !partial.is_known());
        assert_eq!(Machine::from_token("1,2,3"), UNKNOWN);
    }

    #[test]
    fn the_cache_is_kept_only_in_a_directory_of_this_users_own() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("rdist-own-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let mine = base.join("made");
        assert!(own_private_dir(&mine), "made here, mode 0700");
        let mode = std::fs::metadata(&mine).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        // One that others may write to (a planted file or link) is not used.
        std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(!own_private_dir(&mine));
        // Nor a link to a directory, nor a file.
        std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = base.join("link");
        std::os::unix::fs::symlink(&mine, &link).unwrap();
        assert!(!own_private_dir(&link));
        let file = base.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(!own_private_dir(&file));
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_profile_measured_while_the_machine_was_busy_is_measured_again_later() {
        let dir = std::env::temp_dir().join(format!("rdist-busy-profile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(own_private_dir(&dir));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let path = dir.join(format!("{}.txt", cache_name("m", cores)));
        let planted = Machine {
            cores: cores as u32,
            copy_one_mbs: 1,
            ..UNKNOWN
        };
        let age = |secs: u64| {
            let f = std::fs::File::options().write(true).open(&path).unwrap();
            f.set_modified(std::time::SystemTime::now() - Duration::from_secs(secs))
                .unwrap();
        };
        // Quiet, or disturbed but measured lately: used as it is.
        write_cache(&path, planted, 20);
        age(3600);
        assert_eq!(cached_or_measured_in(&dir, "m"), Some(planted));
        write_cache(&path, planted, 990);
        age(60);
        assert_eq!(cached_or_measured_in(&dir, "m"), Some(planted));
        // Disturbed, and long ago: measured again, and the quieter kept.
        age(3600);
        let again = cached_or_measured_in(&dir, "m").unwrap();
        let (kept, others) = read_cache(&path).unwrap();
        assert!(others < 990, "{others}");
        assert_eq!(kept, again);
        assert_ne!(again, planted);
        assert!(!older_than(&path, Duration::from_secs(60)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn measuring_gives_plausible_numbers() {
        let m = measure(2);
        eprintln!("{}", m.to_line());
        assert!(m.knows_memory() && m.knows_tcp(), "{m:?}");
        assert!(m.copy_one_mbs > 100, "{m:?}");
        assert!(m.tcp_mbs > 10, "{m:?}");
        assert!(m.tcp_latency_ns < 10_000_000, "{m:?}");
    }
}
