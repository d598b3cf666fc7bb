//! Who the ranks of a communicator are and how to reach them, and the
//! roster of a communicator made from some of them (a split's colour, or
//! the survivors of a failure).

use super::cpus::HostCpus;
use super::hosts::HostId;
use crate::transport::machine::{Machine, UNKNOWN};
use std::net::SocketAddr;
use std::sync::Arc;

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
    /// Each host's machine profile as its first rank published it (see
    /// `transport::machine`): the tuning model's inputs, alike on every
    /// rank.
    pub machines: Arc<[(HostId, Machine)]>,
    /// What each host's ranks of the job have together (hosts where some
    /// rank's CPUs are unknown are left out).
    pub cpus: Arc<[(HostId, HostCpus)]>,
}

impl Roster {
    /// Rank within its host: how many lower ranks share its host id.
    pub fn local_rank(&self, rank: usize) -> usize {
        self.hosts[..rank]
            .iter()
            .filter(|h| **h == self.hosts[rank])
            .count()
    }

    /// The machine profile of `rank`'s host (UNKNOWN if none came).
    pub fn machine_of(&self, rank: usize) -> Machine {
        let host = &self.hosts[rank];
        self.machines
            .iter()
            .find(|(h, _)| h == host)
            .map_or(UNKNOWN, |(_, m)| *m)
    }

    /// What the job's ranks on `rank`'s host have together, if known.
    pub fn cpus_of(&self, rank: usize) -> Option<HostCpus> {
        let host = &self.hosts[rank];
        self.cpus.iter().find(|(h, _)| h == host).map(|(_, c)| *c)
    }

    /// The roster of a communicator of `members` (ranks of this one, in
    /// their new order), each listening on `port_of(old rank)` at its old
    /// address, known as `comm_id` (derived by every member alike, e.g.
    /// with `fnv1a`).
    pub fn subset(
        &self,
        members: &[usize],
        port_of: impl Fn(usize) -> u16,
        comm_id: u64,
    ) -> Roster {
        Roster {
            job: self.job,
            comm_id,
            addrs: members
                .iter()
                .map(|r| SocketAddr::new(self.addrs[*r].ip(), port_of(*r)))
                .collect(),
            hosts: members.iter().map(|r| self.hosts[*r].clone()).collect(),
            machines: self.machines.clone(),
            cpus: self.cpus.clone(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subset_keeps_each_members_host_and_address_in_the_new_order() {
        let parent = Roster {
            job: [7; 16],
            comm_id: 0,
            addrs: ["10.0.0.1:100", "10.0.0.2:200", "10.0.0.1:300"]
                .iter()
                .map(|a| a.parse().unwrap())
                .collect(),
            hosts: ["a", "b", "a"].iter().map(|h| HostId::from(*h)).collect(),
            machines: Vec::new().into(),
            cpus: Vec::new().into(),
        };
        let child = parent.subset(&[2, 0], |r| 1000 + r as u16, 42);
        assert_eq!(child.job, [7; 16]);
        assert_eq!(child.comm_id, 42);
        let addrs: Vec<String> = child.addrs.iter().map(|a| a.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.1:1002", "10.0.0.1:1000"]);
        assert_eq!(child.local_rank(1), 1);
    }
}
