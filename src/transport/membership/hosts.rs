//! Which ranks share a host: the host id a rank publishes, and the
//! grouping every layer derives from the roster's ids alike (local ranks,
//! a host's first rank, the ranks of one machine, the hosts in order).

use std::sync::Arc;

/// A host id (see `host_id`), shared by the entries of its ranks: a wide
/// roster is cloned a few times at init, and a string per rank each time
/// was most of that.
pub(crate) type HostId = Arc<str>;

/// Which machine, and which network namespace on it, this process is in:
/// ranks with equal ids share memory. The hostname alone says too little
/// (network namespaces or containers on one machine share it and may not
/// share memory, or must not be told apart from other hosts).
pub(crate) fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|b| b.trim().chars().take(8).collect::<String>())
        .unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net")
        .ok()
        .and_then(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("net:[")?.strip_suffix(']')?.to_string())
        })
        .unwrap_or_default();
    format!("{}/{boot}/{netns}", hostname())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The machine part of a host id from `host_id` (its boot id, which
/// network namespaces and containers of one machine share); any other id
/// (given by option, e.g. "dc1/rack3/node7") is its own machine.
pub(crate) fn machine_of(host: &str) -> &str {
    let mut parts = host.split('/');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(_), Some(boot), Some(_), None)
            if boot.len() == 8 && boot.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            boot
        }
        _ => host,
    }
}

/// Where one rank sits among the hosts of a roster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    /// Ranks on its host, itself included.
    pub host_ranks: usize,
    /// The first rank of its host (its host's leader).
    pub leader: usize,
    /// Ranks on its machine: hosts that are network namespaces or
    /// containers of one machine share its cores.
    pub machine_ranks: usize,
    /// Every rank is on its host.
    pub whole_world_here: bool,
}

impl Placement {
    pub fn of<H: AsRef<str>>(hosts: &[H], rank: usize) -> Placement {
        let mine = hosts[rank].as_ref();
        let machine = machine_of(mine);
        let (mut host_ranks, mut leader, mut machine_ranks) = (0, rank, 0);
        // A rank's host is most often the one before it: its machine is
        // looked up once per run of ranks, not once per rank.
        let mut last: Option<(&str, bool)> = None;
        for (r, h) in hosts.iter().enumerate() {
            let h = h.as_ref();
            if h == mine {
                leader = leader.min(r);
                host_ranks += 1;
            }
            let same_machine = match last {
                Some((seen, same)) if seen == h => same,
                _ => {
                    let same = machine_of(h) == machine;
                    last = Some((h, same));
                    same
                }
            };
            machine_ranks += usize::from(same_machine);
        }
        Placement {
            host_ranks,
            leader,
            machine_ranks,
            whole_world_here: host_ranks == hosts.len(),
        }
    }
}

/// For each rank, whether it is on another host than `rank`.
pub(crate) fn far<H: AsRef<str>>(hosts: &[H], rank: usize) -> Vec<bool> {
    let mine = hosts[rank].as_ref();
    hosts.iter().map(|h| h.as_ref() != mine).collect()
}

/// Every rank by host: the hosts in order of their first rank, each
/// with its ranks in rank order.
pub fn groups<H: AsRef<str>>(hosts: &[H]) -> Vec<Vec<usize>> {
    let mut names: Vec<&str> = Vec::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (r, h) in hosts.iter().enumerate() {
        match names.iter().position(|n| *n == h.as_ref()) {
            Some(i) => groups[i].push(r),
            None => {
                names.push(h.as_ref());
                groups.push(vec![r]);
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_of_one_machine_are_one_machine() {
        assert_eq!(machine_of("h0/0a1b2c3d/4026531840"), "0a1b2c3d");
        assert_eq!(machine_of("h2/0a1b2c3d/4026532777"), "0a1b2c3d");
        assert_eq!(machine_of("other-host/"), "other-host/");
        assert_eq!(machine_of("dc1/rack3/node7"), "dc1/rack3/node7");
        assert_eq!(machine_of("node7"), "node7");
        assert_eq!(machine_of("a/b/c/d"), "a/b/c/d");
    }

    #[test]
    fn a_ranks_place_counts_its_host_and_its_machine() {
        let hosts = [
            "h0/0a1b2c3d/1",
            "h1/0a1b2c3d/2",
            "h0/0a1b2c3d/1",
            "other",
            "h1/0a1b2c3d/2",
        ];
        let p = Placement::of(&hosts, 2);
        assert_eq!(
            p,
            Placement {
                host_ranks: 2,
                leader: 0,
                machine_ranks: 4,
                whole_world_here: false,
            }
        );
        assert_eq!(Placement::of(&hosts, 3).machine_ranks, 1);
        assert_eq!(Placement::of(&hosts, 4).leader, 1);
        assert!(Placement::of(&["a", "a"], 1).whole_world_here);
        assert_eq!(far(&hosts, 0), [false, true, false, true, true]);
        assert_eq!(groups(&hosts), vec![vec![0, 2], vec![1, 4], vec![3]]);
    }
}
