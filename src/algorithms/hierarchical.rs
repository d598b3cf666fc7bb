//! Hierarchical allreduce, for several ranks on each of several hosts:
//! reduce-scatter inside each host (shared memory), then each rank
//! allreduces its block with the ranks of the same local index on the
//! other hosts (every host link busy at once, each carrying 1/L of the
//! data for L ranks a host), then allgather inside the host. The phases
//! run on sub-groups of the communicator's transport.

use super::{block, recursive_doubling, ring, Link};
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::transport::{Transport, Xfer};

/// Where this rank sits: the ranks of its host, and the ranks with its
/// local index on every host (each in rank order, this rank in both).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layers {
    pub host: Vec<usize>,
    pub across: Vec<usize>,
}

impl Layers {
    /// The layers of `rank` when `hosts` (a host id per rank) puts as many
    /// ranks, two or more, on each of two or more hosts; None otherwise.
    pub fn of(hosts: &[String], rank: usize) -> Option<Layers> {
        let mut names: Vec<&String> = Vec::new();
        for h in hosts {
            if !names.contains(&h) {
                names.push(h);
            }
        }
        let members = |name: &String| -> Vec<usize> {
            (0..hosts.len()).filter(|r| hosts[*r] == *name).collect()
        };
        let groups: Vec<Vec<usize>> = names.iter().map(|n| members(n)).collect();
        let per_host = groups[0].len();
        if groups.len() < 2 || per_host < 2 || groups.iter().any(|g| g.len() != per_host) {
            return None;
        }
        let host = members(&hosts[rank]);
        let index = host.iter().position(|r| *r == rank)?;
        let across = groups.iter().map(|g| g[index]).collect();
        Some(Layers { host, across })
    }
}

/// A subset of a transport's ranks, seen as a transport of its own.
struct Subgroup<'a> {
    inner: &'a mut dyn Transport,
    members: &'a [usize],
    me: usize,
}

impl Transport for Subgroup<'_> {
    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn exchange(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()> {
        for x in xfers.iter_mut() {
            x.peer = self.members[x.peer];
        }
        self.inner.exchange(xfers)
    }
}

/// Runs `f` on the sub-group `members` of `link`'s transport.
fn within<T>(
    link: &mut Link<'_>,
    members: &[usize],
    me: usize,
    f: impl FnOnce(&mut Link<'_>) -> Result<T>,
) -> Result<T> {
    let desc = link.desc;
    let mut sub = Subgroup {
        inner: &mut *link.transport,
        members,
        me: members.iter().position(|r| *r == me).expect("a member"),
    };
    let mut sub_link = Link::new(&mut sub, desc, &mut *link.scratch);
    f(&mut sub_link)
}

/// In-place allreduce of `buf` over every rank of `link`, by layers.
pub fn allreduce(
    link: &mut Link<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    layers: &Layers,
) -> Result<()> {
    let me = link.rank();
    let total = link.size();
    let es = dtype.size();
    let count = buf.len() / es;
    let owned = within(link, &layers.host, me, |l| {
        ring::reduce_scatter_in_place(l, buf, dtype, op)
    })?;
    let mine = block(count, layers.host.len(), owned, es);
    // Avg is summed in every phase (a sub-group's Avg would divide by its
    // own size) and divided once, by everyone, below.
    let across_op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    within(link, &layers.across, me, |l| {
        let part = &mut buf[mine.clone()];
        if part.len() <= super::SMALL_ALLREDUCE_BYTES {
            recursive_doubling::allreduce(l, part, dtype, across_op)
        } else {
            ring::allreduce(l, part, dtype, across_op)
        }
    })?;
    if op == ReduceOp::Avg {
        reduce::divide(&mut buf[mine], dtype, total);
    }
    within(link, &layers.host, me, |l| {
        ring::allgather_in_place(l, buf, dtype)
    })
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
            })
        );
        assert_eq!(Layers::of(&hosts(&["a", "a", "a"]), 0), None);
        assert_eq!(Layers::of(&hosts(&["a", "b", "c"]), 0), None);
        assert_eq!(Layers::of(&hosts(&["a", "a", "b"]), 0), None);
    }
}
