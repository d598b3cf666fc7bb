//! How the ranks sit on hosts, for the algorithms that go by layers
//! (`hierarchical`, `grid`): the ranks of this rank's host, the ranks of
//! its local index on every host, and every rank by host and index.

use crate::transport::membership::hosts::groups;

/// Where this rank sits: the ranks of its host, and the ranks with its
/// local index on every host (each in rank order, this rank in both).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layers {
    pub host: Vec<usize>,
    pub across: Vec<usize>,
    /// Every rank by host (outer, in order of each host's first rank)
    /// and local index (inner): `grid[h][j]`.
    pub grid: Vec<Vec<usize>>,
}

impl Layers {
    /// The layers of `rank` when `hosts` (a host id per rank) puts as many
    /// ranks, two or more, on each of two or more hosts; None otherwise.
    pub fn of<H: AsRef<str>>(hosts: &[H], rank: usize) -> Option<Layers> {
        // One host (the common case, and a wide job's): no layers, and no
        // lists of every rank to make first.
        let first = hosts.first()?.as_ref();
        if hosts.iter().all(|h| h.as_ref() == first) {
            return None;
        }
        let groups = groups(hosts);
        let per_host = groups[0].len();
        if groups.len() < 2 || per_host < 2 || groups.iter().any(|g| g.len() != per_host) {
            return None;
        }
        let host = groups.iter().find(|g| g.contains(&rank))?.clone();
        let index = host.iter().position(|r| *r == rank)?;
        let across = groups.iter().map(|g| g[index]).collect();
        Some(Layers {
            host,
            across,
            grid: groups,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_need_several_ranks_on_each_of_several_hosts_alike() {
        let hosts = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let two_by_two = hosts(&["a", "b", "a", "b"]);
        assert_eq!(
            Layers::of(&two_by_two, 2),
            Some(Layers {
                host: vec![0, 2],
                across: vec![2, 3],
                grid: vec![vec![0, 2], vec![1, 3]],
            })
        );
        assert_eq!(Layers::of(&hosts(&["a", "a", "a"]), 0), None);
        assert_eq!(Layers::of(&hosts(&["a", "b", "c"]), 0), None);
        assert_eq!(Layers::of(&hosts(&["a", "a", "b"]), 0), None);
    }
}
