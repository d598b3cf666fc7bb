//! Who the ranks of a communicator are and how to reach them: what
//! rendezvous finds out and the mesh connects.

use std::net::SocketAddr;
use std::sync::Arc;

/// A host id (see `rendezvous::host_id`), shared by the entries of its
/// ranks: a wide roster is cloned a few times at init, and a string per
/// rank each time was most of that.
pub(crate) type HostId = Arc<str>;

#[derive(Clone, Debug)]
pub(crate) struct Roster {
    /// The job's id: every connection's hello carries it.
    pub job: [u8; 16],
    /// Tells apart the communicators of one job (splits get their own).
    pub comm_id: u64,
    /// Shared by every clone (the communicator, its mesh, its
    /// point-to-point context): copying a wide roster at init was most of
    /// the memory a rank first touched after it came (32 KiB a copy at
    /// 1024 ranks, a page fault each 4 KiB).
    pub addrs: Arc<[SocketAddr]>,
    pub hosts: Arc<[HostId]>,
}

impl Roster {
    /// Rank within its host: how many lower ranks share its host name.
    pub fn local_rank(&self, rank: usize) -> usize {
        self.hosts[..rank]
            .iter()
            .filter(|h| **h == self.hosts[rank])
            .count()
    }
}

/// 64-bit FNV-1a over several byte strings (communicator ids).
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in *part {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The machine part of a host id from `rendezvous::host_id` (its boot id, which
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
}
