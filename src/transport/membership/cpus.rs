//! The CPUs a rank may run on, as it publishes them at init, and what a
//! host's ranks have together. Whether the ranks of a host share cores
//! (and so must yield while they wait) is decided from the union of their
//! CPU sets: a launcher that binds each rank to a core of its own (`srun
//! --cpu-bind=cores`, `mpirun --bind-to core`, `taskset`) leaves every rank
//! one CPU, and one rank's own count would call every such job
//! oversubscribed.

/// A rank's CPUs: ranges of CPU numbers, and the cores its CPU quota
/// (a cgroup's `cpu.max`) allows when that is fewer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cpus {
    /// Sorted, disjoint, inclusive.
    ranges: Vec<(u32, u32)>,
    quota: Option<u32>,
}

/// What a host's ranks have together, as the roster carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HostCpus {
    /// Distinct CPUs the host's ranks may run on together, capped by the
    /// smallest quota among them.
    pub cpus: u32,
    /// Ranks of the job on the host (every communicator made from the
    /// job's first one keeps this count: the other ranks still run there).
    pub ranks: u32,
}

/// A set with more ranges than this is published as unknown: the token
/// stays short, and such masks are not what launchers make.
const MOST_RANGES: usize = 64;
/// The highest CPU number a token may name (Linux has at most 8192).
const MOST_CPU: u32 = 65535;

impl Cpus {
    /// This process's (None where the system does not say), looked up
    /// once per process: the quota is read from files (a program that
    /// changes its affinity between two communicators keeps the first).
    pub fn own() -> Option<Cpus> {
        static OWN: std::sync::OnceLock<Option<Cpus>> = std::sync::OnceLock::new();
        OWN.get_or_init(Cpus::look_up).clone()
    }

    fn look_up() -> Option<Cpus> {
        let cpus = crate::transport::machine::allowed_cpus();
        let mut c = Cpus::from_cpus(cpus.into_iter().map(|c| c as u32))?;
        // The cgroup's quota, whatever this rank's mask (ranks bound to a
        // core each share it); else the standard library's count, which
        // includes it: fewer than the mask means a quota is the bound.
        let usable = std::thread::available_parallelism().map_or(0, |n| n.get()) as u32;
        c.quota = crate::transport::machine::cgroup::quota_cores()
            .or((usable > 0 && usable < c.count()).then_some(usable));
        Some(c)
    }

    /// From CPU numbers in increasing order (None for none).
    fn from_cpus(cpus: impl Iterator<Item = u32>) -> Option<Cpus> {
        let mut ranges: Vec<(u32, u32)> = Vec::new();
        for c in cpus {
            match ranges.last_mut() {
                Some((_, hi)) if *hi + 1 == c => *hi = c,
                _ => ranges.push((c, c)),
            }
        }
        (!ranges.is_empty()).then_some(Cpus {
            ranges,
            quota: None,
        })
    }

    /// How many CPUs.
    pub fn count(&self) -> u32 {
        let n: u64 = self
            .ranges
            .iter()
            .map(|(lo, hi)| u64::from(hi - lo) + 1)
            .sum();
        n.min(u64::from(u32::MAX)) as u32
    }

    /// The token a rank publishes: a CPU list as sysfs writes one
    /// ("0-3,8"), and "/N" for a quota of N cores; "-" for unknown.
    pub fn token(cpus: Option<&Cpus>) -> String {
        let Some(c) = cpus.filter(|c| c.ranges.len() <= MOST_RANGES) else {
            return "-".into();
        };
        let mut token = c
            .ranges
            .iter()
            .map(|(lo, hi)| match lo == hi {
                true => lo.to_string(),
                false => format!("{lo}-{hi}"),
            })
            .collect::<Vec<String>>()
            .join(",");
        if let Some(q) = c.quota {
            token.push_str(&format!("/{q}"));
        }
        token
    }

    /// A published token (None: unknown, or not one).
    pub fn from_token(token: &str) -> Option<Cpus> {
        let (list, quota) = match token.split_once('/') {
            Some((list, q)) => (list, Some(q.parse::<u32>().ok().filter(|q| *q > 0)?)),
            None => (token, None),
        };
        let mut ranges = Vec::new();
        for part in list.split(',') {
            let (lo, hi) = match part.split_once('-') {
                Some((lo, hi)) => (lo.parse::<u32>().ok()?, hi.parse::<u32>().ok()?),
                None => {
                    let c = part.parse::<u32>().ok()?;
                    (c, c)
                }
            };
            // Sorted, apart, and CPU numbers a kernel can have.
            if lo > hi || hi > MOST_CPU || ranges.last().is_some_and(|(_, prev)| lo <= prev + 1) {
                return None;
            }
            ranges.push((lo, hi));
        }
        if ranges.is_empty() || ranges.len() > MOST_RANGES {
            return None;
        }
        Some(Cpus { ranges, quota })
    }

    /// What `sets` (a host's ranks') have together; None when a rank's
    /// set is unknown.
    pub fn together(sets: &[Option<&Cpus>]) -> Option<HostCpus> {
        let mut all: Vec<(u32, u32)> = Vec::new();
        let mut quota = u32::MAX;
        for set in sets {
            let set = (*set)?;
            all.extend_from_slice(&set.ranges);
            quota = quota.min(set.quota.unwrap_or(u32::MAX));
        }
        all.sort_unstable();
        let mut cpus = 0u64;
        let mut upto: Option<u32> = None;
        for (lo, hi) in all {
            let from = match upto {
                Some(u) if u >= hi => continue,
                Some(u) if u >= lo => u64::from(u) + 1,
                _ => u64::from(lo),
            };
            cpus += u64::from(hi) + 1 - from;
            upto = Some(hi);
        }
        Some(HostCpus {
            cpus: cpus.min(u64::from(quota)) as u32,
            ranks: sets.len().min(u32::MAX as usize) as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(token: &str) -> Cpus {
        Cpus::from_token(token).unwrap_or_else(|| panic!("{token}"))
    }

    #[test]
    fn a_token_reads_back() {
        for token in ["0", "0-15", "0-3,8,10-11", "2,4,6", "0-63/4"] {
            assert_eq!(Cpus::token(Some(&set(token))), token);
        }
        assert_eq!(Cpus::token(None), "-");
        for bad in [
            "",
            "-",
            "3-1",
            "1,1",
            "0-3,2",
            "a",
            "0/0",
            "0/x",
            "1,,2",
            "4294967295,5",
            "4294967295,0",
            "0-4294967295",
            "65536",
        ] {
            assert!(Cpus::from_token(bad).is_none(), "{bad}");
        }
        let c = Cpus::from_cpus([0, 1, 2, 5, 7, 8].into_iter()).unwrap();
        assert_eq!(Cpus::token(Some(&c)), "0-2,5,7-8");
        assert_eq!(c.count(), 6);
    }

    #[test]
    fn ranks_bound_to_cores_of_their_own_are_not_oversubscribed() {
        let (a, b, c, d) = (set("0"), set("1"), set("2"), set("3"));
        let host = Cpus::together(&[Some(&a), Some(&b), Some(&c), Some(&d)]).unwrap();
        assert_eq!(host, HostCpus { cpus: 4, ranks: 4 });
        // Two on one core.
        let host = Cpus::together(&[Some(&a), Some(&a), Some(&c)]).unwrap();
        assert_eq!(host, HostCpus { cpus: 2, ranks: 3 });
    }

    #[test]
    fn overlapping_sets_count_each_cpu_once_and_the_quota_caps_them() {
        let host = Cpus::together(&[Some(&set("0-7")), Some(&set("4-11")), Some(&set("2-3"))]);
        assert_eq!(host.unwrap().cpus, 12);
        let host = Cpus::together(&[Some(&set("0-15/3")), Some(&set("0-15/3"))]).unwrap();
        assert_eq!(host.cpus, 3);
        // Ranks bound to a core each under one quota.
        let host = Cpus::together(&[Some(&set("0/1")), Some(&set("1/1"))]).unwrap();
        assert_eq!(host, HostCpus { cpus: 1, ranks: 2 });
        let widest = set("0-65535");
        assert_eq!(widest.count(), 65536);
        let host = Cpus::together(&[Some(&widest), Some(&set("0-65535"))]).unwrap();
        assert_eq!(host.cpus, 65536);
        assert_eq!(Cpus::together(&[Some(&set("0")), None]), None);
    }

    #[test]
    fn this_process_has_a_set() {
        let own = Cpus::own().expect("sched_getaffinity");
        assert!(own.count() >= 1);
        assert_eq!(Cpus::from_token(&Cpus::token(Some(&own))), Some(own));
    }
}
