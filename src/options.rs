//! Key/value settings: what `rdist_options_set` accepts, plus the environment
//! variables that back each key. Parsed once, when a communicator is created.
//!
//! This is the one place where rdist reads its environment: the options'
//! variables (`KEYS`), the developers' tuning variables (`Tuning`), and,
//! through `process_env`, the launcher's variables that rendezvous reads
//! (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) and the places the NCCL
//! loader searches. Every layer gets its settings from here.

use crate::error::{Error, Result};
use std::ffi::OsString;
use std::time::Duration;

/// A variable of the process environment (None when unset or not UTF-8).
/// Rendezvous asks for the launcher's variables through this.
pub(crate) fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// `process_env` for paths (the NCCL loader's search).
pub(crate) fn process_env_os(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

/// The machine profile given instead of measured (`RDIST_MACHINE`, in
/// the cache's one-line format: see `transport::machine`).
pub(crate) fn machine_profile() -> Option<String> {
    process_env("RDIST_MACHINE").filter(|v| !v.trim().is_empty())
}

/// Where measurements of the machine are cached: `$RDIST_CACHE_DIR`,
/// else `$XDG_CACHE_HOME/rdist`, else `~/.cache/rdist`, else a directory
/// of this user's in the temporary directory.
pub(crate) fn cache_dir() -> std::path::PathBuf {
    use std::path::PathBuf;
    let env = |k: &str| {
        process_env_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("RDIST_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("rdist")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("rdist")))
        .unwrap_or_else(|| {
            // SAFETY: geteuid has no preconditions.
            let uid = unsafe { libc::geteuid() };
            std::env::temp_dir().join(format!("rdist-cache-{uid}"))
        })
}

/// Which backend runs the collectives (values equal `rdist_backend_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Backend {
    Auto = 0,
    Socket = 1,
    Nccl = 2,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Socket => "socket",
            Backend::Nccl => "nccl",
        }
    }
}

/// When shared-memory payloads travel single-copy (`process_vm_readv` out
/// of the sender's memory) instead of through the rings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SingleCopy {
    /// rdist decides per communicator (see `SingleCopy::min_bytes`).
    Auto,
    Off,
    /// Payloads of at least this many bytes.
    From(usize),
}

impl SingleCopy {
    /// The payload size from which to go single-copy (usize::MAX: never);
    /// `auto`: the tuning model's choice (see `algorithms::tuner`).
    pub fn min_bytes(self, auto: usize) -> usize {
        match self {
            SingleCopy::Auto => auto,
            SingleCopy::Off => usize::MAX,
            SingleCopy::From(n) => n,
        }
    }

    /// The same for payloads that their receiver combines: rdist's own
    /// choice leaves them to the rings (see `transport::stream::Tuning`),
    /// a size given by option applies to them too.
    pub fn reduced_min_bytes(self) -> usize {
        match self {
            SingleCopy::From(n) => n,
            SingleCopy::Auto | SingleCopy::Off => usize::MAX,
        }
    }
}

/// How bytes move between ranks on one host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// Shared memory on one host, TCP across hosts.
    Auto,
    /// TCP everywhere (the cross-host path, testable on one machine).
    Tcp,
}

/// Developers' switches for shared memory, from the environment only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmTuning {
    /// Use membarrier() to order ring updates (RDIST_NO_MEMBARRIER unsets).
    pub membarrier: bool,
    /// Allow single-copy payloads (RDIST_NO_SINGLE_COPY unsets).
    pub single_copy: bool,
}

/// Developers' tuning, from the environment only (no option key): knobs
/// for measuring, not for users.
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// How long a waiting rank busy-waits before sleeping (RDIST_SPIN_US).
    pub spin: Duration,
    pub shm: ShmTuning,
    /// NCCL_COMM_BLOCKING as set: NCCL reads it too, and rdist refuses
    /// NCCL when it makes calls block (see `backend::nccl`).
    pub nccl_comm_blocking: Option<String>,
}

/// Long enough to cover a peer's step in a collective, short enough not to
/// burn a core while a rank computes between collectives.
pub const DEFAULT_SPIN_US: u64 = 500;

/// Long enough that a rank which merely computes is asked rarely (its
/// endpoint's thread answers at once), short enough that a stopped one is
/// named within seconds.
pub const DEFAULT_PEER_CHECK_MS: u64 = 3000;

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            spin: Duration::from_micros(DEFAULT_SPIN_US),
            shm: ShmTuning {
                membarrier: true,
                single_copy: true,
            },
            nccl_comm_blocking: None,
        }
    }
}

impl Tuning {
    fn from_lookup(lookup: &impl Fn(&str) -> Option<String>) -> Result<Tuning> {
        let mut t = Tuning::default();
        if let Some(v) = lookup("RDIST_SPIN_US").filter(|v| !v.trim().is_empty()) {
            let us: u64 = v.trim().parse().map_err(|_| {
                Error::invalid_argument(format!(
                    "environment variable RDIST_SPIN_US: '{v}' is not a number of microseconds"
                ))
            })?;
            t.spin = Duration::from_micros(us);
        }
        t.shm.membarrier = lookup("RDIST_NO_MEMBARRIER").is_none();
        t.shm.single_copy = lookup("RDIST_NO_SINGLE_COPY").is_none();
        t.nccl_comm_blocking = lookup("NCCL_COMM_BLOCKING");
        Ok(t)
    }
}

/// Log verbosity (to stderr).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Warn = 0,
    Info = 1,
    Trace = 2,
}

/// Every setting of a communicator. `Options::default()` is the documented
/// defaults; `Options::from_env()` layers the environment on top; explicit
/// `set` calls win over both.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub backend: Backend,
    pub transport: TransportKind,
    pub algo: Option<String>,
    pub timeout: Duration,
    /// How long a wait hears nothing from the ranks it waits for before
    /// it asks whether their processes run (zero: never, so a rank paused
    /// in a debugger leaves the others waiting to the timeout).
    pub peer_check: Duration,
    pub local_rank: Option<i32>,
    pub device: Option<i32>,
    pub ifname: Option<String>,
    pub auth_token: Option<String>,
    pub debug: LogLevel,
    pub trace_file: Option<String>,
    /// Which shared-memory payloads travel single-copy (process_vm_readv)
    /// instead of through the rings.
    pub single_copy_min: SingleCopy,
    /// Which ranks share a host (and so shared memory): by default the
    /// hostname, boot id and network namespace; set for containers that
    /// share memory across those, or to keep ranks apart.
    pub host_id: Option<String>,
    /// Developers' tuning (environment only).
    pub tuning: Tuning,
    /// Keys set explicitly (they win over the environment).
    explicit: Vec<&'static str>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            backend: Backend::Auto,
            transport: TransportKind::Auto,
            algo: None,
            timeout: Duration::from_millis(300_000),
            peer_check: Duration::from_millis(DEFAULT_PEER_CHECK_MS),
            local_rank: None,
            device: None,
            ifname: None,
            auth_token: None,
            debug: LogLevel::Warn,
            trace_file: None,
            single_copy_min: SingleCopy::Auto,
            host_id: None,
            tuning: Tuning::default(),
            explicit: Vec::new(),
        }
    }
}

/// Each key with the environment variable that supplies it.
pub const KEYS: [(&str, &str); 13] = [
    ("backend", "RDIST_BACKEND"),
    ("transport", "RDIST_TRANSPORT"),
    ("algo", "RDIST_ALGO"),
    ("timeout_ms", "RDIST_TIMEOUT_MS"),
    ("local_rank", "LOCAL_RANK"),
    ("device", "RDIST_DEVICE"),
    ("ifname", "RDIST_SOCKET_IFNAME"),
    ("auth_token", "RDIST_AUTH_TOKEN"),
    ("debug", "RDIST_DEBUG"),
    ("trace_file", "RDIST_TRACE_FILE"),
    ("single_copy_min", "RDIST_SINGLE_COPY_MIN"),
    ("host_id", "RDIST_HOST_ID"),
    ("peer_check_ms", "RDIST_PEER_CHECK_MS"),
];

impl Options {
    /// Sets `key` to `value`, validating both.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let canonical = KEYS
            .iter()
            .map(|(k, _)| *k)
            .find(|k| *k == key)
            .ok_or_else(|| {
                let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
                Error::invalid_argument(format!(
                    "unknown option '{key}' (known: {})",
                    known.join(", ")
                ))
            })?;
        self.apply(canonical, value)?;
        if !self.explicit.contains(&canonical) {
            self.explicit.push(canonical);
        }
        Ok(())
    }

    /// These options with the environment filled in for every key not set
    /// explicitly. A malformed environment variable is an error naming it.
    pub fn with_env(&self) -> Result<Options> {
        self.with_env_from(process_env)
    }

    /// `with_env` with an injectable lookup (for tests).
    pub fn with_env_from(&self, lookup: impl Fn(&str) -> Option<String>) -> Result<Options> {
        let mut merged = self.clone();
        merged.tuning = Tuning::from_lookup(&lookup)?;
        for (key, var) in KEYS {
            if self.explicit.contains(&key) {
                continue;
            }
            // A blank variable is unset, except the token's: a blank
            // secret is a mistake that would turn authentication off.
            if let Some(value) = lookup(var).filter(|v| !v.trim().is_empty() || key == "auth_token")
            {
                merged
                    .apply(key, &value)
                    .map_err(|e| e.context(format!("environment variable {var}")))?;
            }
        }
        Ok(merged)
    }

    fn apply(&mut self, key: &str, value: &str) -> Result<()> {
        let v = value.trim();
        let bad = |what: &str| {
            Error::invalid_argument(format!("option '{key}': '{value}' is not {what}"))
        };
        match key {
            "backend" => {
                self.backend = match v.to_ascii_lowercase().as_str() {
                    "auto" => Backend::Auto,
                    "socket" | "gloo" | "tcp" => Backend::Socket,
                    "nccl" => Backend::Nccl,
                    _ => return Err(bad("one of auto, socket, nccl")),
                }
            }
            "transport" => {
                self.transport = match v.to_ascii_lowercase().as_str() {
                    "auto" | "shm" => TransportKind::Auto,
                    "tcp" => TransportKind::Tcp,
                    _ => return Err(bad("one of auto, tcp")),
                }
            }
            "algo" => {
                self.algo = match v.to_ascii_lowercase().as_str() {
                    "" | "auto" => None,
                    name => {
                        crate::descriptor::algo_value(name)
                            .map_err(|e| bad(&format!("an algorithm: {}", e.message())))?;
                        Some(name.to_string())
                    }
                }
            }
            "timeout_ms" => {
                let ms: u64 = v
                    .parse()
                    .ok()
                    .filter(|ms| *ms > 0)
                    .ok_or_else(|| bad("a positive number of milliseconds"))?;
                self.timeout = Duration::from_millis(ms);
            }
            "local_rank" => {
                let r: i32 = v
                    .parse()
                    .ok()
                    .filter(|r| *r >= 0)
                    .ok_or_else(|| bad("a rank >= 0"))?;
                self.local_rank = Some(r);
            }
            "device" => {
                let d: i32 = v
                    .parse()
                    .ok()
                    .filter(|d| *d >= 0)
                    .ok_or_else(|| bad("a device ordinal >= 0"))?;
                self.device = Some(d);
            }
            "ifname" => {
                if v.is_empty() {
                    return Err(bad("an interface list like eth0,eth1 or ^docker,lo"));
                }
                self.ifname = Some(v.to_string());
            }
            "auth_token" => {
                if v.is_empty() {
                    return Err(Error::invalid_argument(format!(
                        "option '{key}' is {}: a blank secret would turn authentication off; give \
                         every rank the same non-blank token, or leave auth_token and \
                         RDIST_AUTH_TOKEN unset to run without one",
                        if value.is_empty() { "empty" } else { "blank" }
                    )));
                }
                self.auth_token = Some(value.to_string())
            }
            "debug" => {
                self.debug = match v.to_ascii_uppercase().as_str() {
                    "WARN" | "" => LogLevel::Warn,
                    "INFO" => LogLevel::Info,
                    "TRACE" => LogLevel::Trace,
                    _ => return Err(bad("one of WARN, INFO, TRACE")),
                }
            }
            "trace_file" => self.trace_file = Some(value.to_string()).filter(|t| !t.is_empty()),
            "single_copy_min" => {
                self.single_copy_min = match v.to_ascii_lowercase().as_str() {
                    "auto" | "" => SingleCopy::Auto,
                    "off" | "never" => SingleCopy::Off,
                    n => SingleCopy::From(bytes(n).ok_or_else(|| {
                        bad("a number of bytes (65536, 64K, 64KiB, 1M), auto or off")
                    })?),
                }
            }
            "host_id" => {
                if v.contains(char::is_whitespace) {
                    return Err(bad("a host id without spaces"));
                }
                // The packed roster gives a host id at most 64 KiB.
                if v.len() > 1024 {
                    return Err(bad("a host id of at most 1024 bytes"));
                }
                self.host_id = Some(v.to_string()).filter(|h| !h.is_empty());
            }
            "peer_check_ms" => {
                let ms: u64 = v
                    .parse()
                    .map_err(|_| bad("a number of milliseconds (0: never)"))?;
                self.peer_check = Duration::from_millis(ms);
            }
            _ => return Err(Error::internal(format!("option key '{key}' not handled"))),
        }
        Ok(())
    }
}

/// A number of bytes, as a size is written by hand: plain, or with a
/// binary suffix (k, kib, m, mib, g, gib; any case). None when it is not
/// one or does not fit.
fn bytes(s: &str) -> Option<usize> {
    let lower = s.trim().to_ascii_lowercase();
    let digits = lower.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let shift = match lower[digits.len()..].trim_start() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => return None,
    };
    let n: usize = digits.trim_end().parse().ok()?;
    n.checked_mul(1usize << shift)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn defaults_match_the_contract() {
        let o = Options::default();
        assert_eq!(o.backend, Backend::Auto);
        assert_eq!(o.transport, TransportKind::Auto);
        assert_eq!(o.timeout, Duration::from_secs(300));
        assert_eq!(o.peer_check, Duration::from_secs(3));
        assert_eq!(o.debug, LogLevel::Warn);
    }

    #[test]
    fn every_key_accepts_a_valid_value() {
        let mut o = Options::default();
        for (key, value) in [
            ("backend", "socket"),
            ("transport", "tcp"),
            ("algo", "ring"),
            ("timeout_ms", "1500"),
            ("local_rank", "3"),
            ("device", "1"),
            ("ifname", "^docker,lo"),
            ("auth_token", "s3cret"),
            ("debug", "info"),
            ("trace_file", "/tmp/t.json"),
            ("single_copy_min", "262144"),
            ("peer_check_ms", "0"),
        ] {
            o.set(key, value).unwrap();
        }
        assert_eq!(o.peer_check, Duration::ZERO);
        assert_eq!(o.backend, Backend::Socket);
        assert_eq!(o.transport, TransportKind::Tcp);
        assert_eq!(o.algo.as_deref(), Some("ring"));
        assert_eq!(o.timeout, Duration::from_millis(1500));
        assert_eq!(o.local_rank, Some(3));
        assert_eq!(o.debug, LogLevel::Info);
        assert_eq!(o.single_copy_min, SingleCopy::From(256 << 10));
        for (written, n) in [
            ("64K", 64 << 10),
            ("64KiB", 64 << 10),
            ("1m", 1 << 20),
            ("2 MiB", 2 << 20),
            ("1G", 1 << 30),
            ("512B", 512),
        ] {
            o.set("single_copy_min", written).unwrap();
            assert_eq!(o.single_copy_min, SingleCopy::From(n), "{written}");
        }
        for wrong in [
            "64KB",
            "K",
            "-1",
            "1.5M",
            "99999999999999999999G",
            "1T",
            "17179869184G",
        ] {
            let e = o.set("single_copy_min", wrong).unwrap_err();
            assert!(e.message().contains("64KiB"), "{wrong}: {e}");
        }
        o.set("single_copy_min", "off").unwrap();
        assert_eq!(o.single_copy_min, SingleCopy::Off);
        o.set("single_copy_min", "AUTO").unwrap();
        assert_eq!(o.single_copy_min, SingleCopy::Auto);
    }

    #[test]
    fn single_copy_auto_goes_single_copy_only_when_ranks_outnumber_cores() {
        assert_eq!(SingleCopy::Auto.min_bytes(4 << 20), 4 << 20);
        assert_eq!(SingleCopy::Auto.min_bytes(usize::MAX), usize::MAX);
        assert_eq!(SingleCopy::Off.min_bytes(4 << 20), usize::MAX);
        assert_eq!(SingleCopy::From(4096).min_bytes(usize::MAX), 4096);
        assert_eq!(Options::default().single_copy_min, SingleCopy::Auto);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_invalid_arguments() {
        let mut o = Options::default();
        let e = o.set("timeout", "5").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("unknown option 'timeout'"), "{e}");
        for (key, value) in [
            ("timeout_ms", "-1"),
            ("timeout_ms", "abc"),
            ("timeout_ms", "0"),
            ("backend", "mpi"),
            ("debug", "LOUD"),
            ("local_rank", "-2"),
            ("single_copy_min", "1MB"),
            ("peer_check_ms", "-1"),
        ] {
            let e = o.set(key, value).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{key}={value}");
            assert!(e.message().contains(key), "{e}");
        }
    }

    #[test]
    fn explicit_options_win_over_the_environment() {
        let mut o = Options::default();
        o.set("timeout_ms", "1000").unwrap();
        let env = |name: &str| match name {
            "RDIST_TIMEOUT_MS" => Some("9000".to_string()),
            "RDIST_TRANSPORT" => Some("tcp".to_string()),
            _ => None,
        };
        let merged = o.with_env_from(env).unwrap();
        assert_eq!(merged.timeout, Duration::from_millis(1000));
        assert_eq!(merged.transport, TransportKind::Tcp);
    }

    #[test]
    fn tuning_comes_from_the_environment() {
        let env = |name: &str| match name {
            "RDIST_SPIN_US" => Some("20".to_string()),
            "RDIST_NO_SINGLE_COPY" => Some("1".to_string()),
            "NCCL_COMM_BLOCKING" => Some("1".to_string()),
            _ => None,
        };
        let t = Options::default().with_env_from(env).unwrap().tuning;
        assert_eq!(t.spin, Duration::from_micros(20));
        assert!(t.shm.membarrier);
        assert!(!t.shm.single_copy);
        assert_eq!(t.nccl_comm_blocking.as_deref(), Some("1"));
        let none = Options::default().with_env_from(|_| None).unwrap().tuning;
        assert_eq!(none, Tuning::default());
        let bad = |name: &str| (name == "RDIST_SPIN_US").then(|| "fast".to_string());
        let e = Options::default().with_env_from(bad).unwrap_err();
        assert!(e.message().contains("RDIST_SPIN_US"), "{e}");
    }

    #[test]
    fn a_malformed_environment_variable_is_named() {
        let env = |name: &str| (name == "RDIST_BACKEND").then(|| "bogus".to_string());
        let e = Options::default().with_env_from(env).unwrap_err();
        assert!(e.message().contains("RDIST_BACKEND"), "{e}");
    }
}
