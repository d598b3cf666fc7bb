//! Who the ranks of a communicator are and how to reach them: what
//! rendezvous finds out and the mesh connects.

use std::net::SocketAddr;

#[derive(Clone, Debug)]
pub(crate) struct Roster {
    /// The job's id: every connection's hello carries it.
    pub job: [u8; 16],
    /// Tells apart the communicators of one job (splits get their own).
    pub comm_id: u64,
    pub addrs: Vec<SocketAddr>,
    pub hosts: Vec<String>,
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
