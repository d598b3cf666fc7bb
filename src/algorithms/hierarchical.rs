//! Hierarchical collectives, for several ranks on each of several hosts.
//! Allreduce: reduce-scatter inside each host (shared memory), then each
//! rank allreduces its block with the ranks of the same local index on
//! the other hosts (every host link busy at once, each carrying 1/L of
//! the data for L ranks a host), then allgather inside the host.
//! Allgather: the ranks of one local index gather across the hosts, then
//! each host gathers inside; reduce-scatter is its mirror. Either way a
//! host link carries each block once, where a flat ring over hosts
//! carries (n-1)/n of everything (with 2 hosts of 2: 3/4 of the data
//! against 1/2). The phases run on sub-groups of the communicator's
//! transport.

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
    /// Every rank by host (outer, in order of each host's first rank)
    /// and local index (inner): `grid[h][j]`.
    pub grid: Vec<Vec<usize>>,
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
        Some(Layers {
            host,
            across,
            grid: groups,
        })
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

/// The reduction each phase runs: Avg is summed in every phase (a
/// sub-group's Avg would divide by its own size) and divided once, by the
/// whole world, at the end.
fn summed(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    }
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
    let across_op = summed(op);
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

/// Where this rank's own block sits in the host-major staging layout the
/// allgather and reduce-scatter use: local index `j` (its segment among
/// the host's ranks), host index `h` (its block within the segment).
fn position(layers: &Layers, me: usize) -> (usize, usize) {
    let j = layers.host.iter().position(|r| *r == me).expect("a member");
    let h = layers
        .across
        .iter()
        .position(|r| *r == me)
        .expect("a member");
    (j, h)
}

/// Allgather of `block_bytes` from every rank into `buf` (n blocks, in
/// rank order; this rank's own block filled): across the hosts among the
/// ranks of one local index, then inside the host, through a staging
/// buffer ordered by local index, then host.
pub fn allgather(
    link: &mut Link<'_>,
    buf: &mut [u8],
    block_bytes: usize,
    layers: &Layers,
) -> Result<()> {
    let me = link.rank();
    let (hosts, locals) = (layers.across.len(), layers.host.len());
    let (j, h) = position(layers, me);
    let seg = hosts * block_bytes;
    let mut stage = link.take_scratch(locals * seg);
    let at = |j: usize, h: usize| (j * hosts + h) * block_bytes;
    stage[at(j, h)..at(j, h) + block_bytes]
        .copy_from_slice(&buf[me * block_bytes..(me + 1) * block_bytes]);
    within(link, &layers.across, me, |l| {
        ring::allgather(l, &mut stage[j * seg..(j + 1) * seg], block_bytes)
    })?;
    within(link, &layers.host, me, |l| {
        ring::allgather(l, &mut stage[..locals * seg], seg)
    })?;
    for (hh, ranks) in layers.grid.iter().enumerate() {
        for (jj, &r) in ranks.iter().enumerate() {
            if r != me {
                crate::copy::copy(
                    &mut buf[r * block_bytes..(r + 1) * block_bytes],
                    &stage[at(jj, hh)..at(jj, hh) + block_bytes],
                );
            }
        }
    }
    link.return_scratch(stage);
    Ok(())
}

/// Reduce-scatter: `out` = block `rank` of the reduction of every rank's
/// `input` (n blocks of `out.len()` bytes, rank order): inside the host
/// first (each rank reduces the blocks of one local index), then across
/// the hosts among the ranks of that index.
pub fn reduce_scatter(
    link: &mut Link<'_>,
    input: &[u8],
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    layers: &Layers,
) -> Result<()> {
    let me = link.rank();
    let total = link.size();
    let bb = out.len();
    let (hosts, locals) = (layers.across.len(), layers.host.len());
    let seg = hosts * bb;
    let mut stage = link.take_scratch(locals * seg);
    for (hh, ranks) in layers.grid.iter().enumerate() {
        for (jj, &r) in ranks.iter().enumerate() {
            let at = (jj * hosts + hh) * bb;
            crate::copy::copy(&mut stage[at..at + bb], &input[r * bb..(r + 1) * bb]);
        }
    }
    let phase_op = summed(op);
    let mut mine = vec![0u8; seg];
    within(link, &layers.host, me, |l| {
        ring::reduce_scatter(l, &stage[..locals * seg], &mut mine, dtype, phase_op)
    })?;
    link.return_scratch(stage);
    within(link, &layers.across, me, |l| {
        ring::reduce_scatter(l, &mine, out, dtype, phase_op)
    })?;
    if op == ReduceOp::Avg {
        reduce::divide(out, dtype, total);
    }
    Ok(())
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
