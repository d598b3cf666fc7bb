//! Hierarchical collectives, for several ranks on each of several hosts.
//! Allreduce: reduce-scatter inside each host (shared memory), then each
//! rank allreduces its block with the ranks of the same local index on
//! the other hosts (every host link busy at once, each carrying 1/L of
//! the data for L ranks a host), then allgather inside the host.
//! Allgather: the ranks of one local index gather across the hosts, then
//! each host gathers inside; reduce-scatter is its mirror. Either way a
//! host link carries each block once, where a flat ring over hosts
//! carries (n-1)/n of everything (with 2 hosts of 2: 3/4 of the data
//! against 1/2). Broadcast and reduce: small messages go through two
//! trees (across the hosts among the ranks of the root's local index,
//! then inside each host), so no path crosses the network more than
//! ceil(log2 hosts) times; large ones go along one pipelined chain that
//! visits the ranks host by host, so each host link carries the message
//! once whatever the rank layout. Barrier: each host's first rank hears
//! from its host-mates, the first ranks meet across the hosts, and each
//! releases its host. The phases run on sub-groups of the communicator's
//! transport. From `grid::MIN_BYTES_PER_RANK` a rank, allreduce, allgather
//! and reduce-scatter run the same data movement as one pipelined
//! schedule instead (see `grid`).

use super::layers::Layers;
use super::{
    binomial, block, chain, dissemination, exchange_checked, grid, recursive_doubling, ring,
    summed, Check, Link,
};
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::transport::{Transport, Xfer};

/// A subset of a transport's ranks, seen as a transport of its own.
struct Subgroup<'a> {
    inner: &'a mut dyn Transport,
    members: &'a [usize],
    me: usize,
    /// The whole call's neighbours' check, carried by the first exchange.
    check: Option<Check>,
}

impl Transport for Subgroup<'_> {
    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn connected(&self, peer: usize) -> bool {
        self.inner.connected(self.members[peer])
    }

    fn exchange(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()> {
        for x in xfers.iter_mut() {
            x.peer = self.members[x.peer];
        }
        match self.check.take() {
            Some(check) => exchange_checked(self.inner, check, xfers),
            None => self.inner.exchange(xfers),
        }
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
        check: link.check.take(),
    };
    let result = f(&mut Link::new(&mut sub, desc, &mut *link.scratch));
    // A sub-group that exchanged nothing leaves the check to the call.
    link.check = sub.check.take();
    result
}

/// In-place allreduce of `buf` over every rank of `link`, by layers.
pub fn allreduce(
    link: &mut Link<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    layers: &Layers,
) -> Result<()> {
    if buf.len() / link.size() >= grid::MIN_BYTES_PER_RANK {
        return grid::allreduce(link, buf, dtype, op, layers);
    }
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
        // Across hosts the link, not this machine, sets the crossover: the
        // reference's stays.
        if part.len() <= super::tuner::REFERENCE_CROSSOVERS.small_allreduce_tcp {
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

/// Broadcasts and reduces from this size take the chain (see the module
/// comment); below, the two trees, which need fewer steps.
pub const CHAIN_BYTES: usize = 64 << 10;

/// Where `rank` sits: its host's index in `grid`, and its local index.
fn place(layers: &Layers, rank: usize) -> (usize, usize) {
    layers
        .grid
        .iter()
        .enumerate()
        .find_map(|(h, g)| g.iter().position(|r| *r == rank).map(|j| (h, j)))
        .expect("every rank is in the grid")
}

/// Every rank once, host by host, starting with `root` and its host-mates
/// (each host's ranks in order from the same local index as the root's).
fn chain_order(layers: &Layers, root: usize) -> Vec<usize> {
    let (rh, rj) = place(layers, root);
    let hosts = layers.grid.len();
    (0..hosts)
        .flat_map(|k| {
            let g = &layers.grid[(rh + k) % hosts];
            (0..g.len()).map(move |i| g[(rj + i) % g.len()])
        })
        .collect()
}

/// The order for a reduce's chain (`chain::reduce` starts after the root
/// and ends at it): the root, then the other hosts, then the root's
/// host-mates, so the data leaves no host twice.
fn reduce_order(layers: &Layers, root: usize) -> Vec<usize> {
    let order = chain_order(layers, root);
    let mates = layers.host.len();
    let mut v = vec![root];
    v.extend_from_slice(&order[mates..]);
    v.extend_from_slice(&order[1..mates]);
    v
}

/// The ranks of `root`'s local index on every host (the root among them).
fn root_column(layers: &Layers, root: usize) -> Vec<usize> {
    let (_, rj) = place(layers, root);
    layers.grid.iter().map(|g| g[rj]).collect()
}

/// Root's `buf` ends up in every rank's `buf`.
pub fn broadcast(link: &mut Link<'_>, buf: &mut [u8], root: usize, layers: &Layers) -> Result<()> {
    let me = link.rank();
    if buf.len() >= CHAIN_BYTES {
        let order = chain_order(layers, root);
        return within(link, &order, me, |l| chain::broadcast(l, buf, 0));
    }
    let (rh, rj) = place(layers, root);
    let column = root_column(layers, root);
    if column.contains(&me) {
        within(link, &column, me, |l| binomial::broadcast(l, buf, rh))?;
    }
    within(link, &layers.host, me, |l| binomial::broadcast(l, buf, rj))
}

/// `acc` holds this rank's contribution; at the root it ends up holding
/// the reduction over all ranks (elsewhere it is scratch). The mirror of
/// `broadcast`: inside each host to the rank of the root's local index,
/// then across the hosts to the root (small); or along the chain that
/// ends at the root (large).
pub fn reduce(
    link: &mut Link<'_>,
    acc: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
    layers: &Layers,
) -> Result<()> {
    let me = link.rank();
    if acc.len() >= CHAIN_BYTES {
        let order = reduce_order(layers, root);
        return within(link, &order, me, |l| chain::reduce(l, acc, dtype, op, 0));
    }
    let (rh, rj) = place(layers, root);
    let phase_op = summed(op);
    within(link, &layers.host, me, |l| {
        binomial::reduce(l, acc, dtype, phase_op, rj)
    })?;
    let column = root_column(layers, root);
    if column.contains(&me) {
        within(link, &column, me, |l| {
            binomial::reduce(l, acc, dtype, phase_op, rh)
        })?;
    }
    if me == root && op == ReduceOp::Avg {
        reduce::divide(acc, dtype, link.size());
    }
    Ok(())
}

/// No rank leaves before every rank has entered: each host's first rank
/// hears from the others of its host, the first ranks of all hosts meet
/// (dissemination, ceil(log2 hosts) rounds over the network), and each
/// releases its host. Inside a host the messages are empty frames over
/// shared memory.
pub fn barrier(link: &mut Link<'_>, layers: &Layers) -> Result<()> {
    let me = link.rank();
    let leader = layers.host[0];
    let leaders: Vec<usize> = layers.grid.iter().map(|g| g[0]).collect();
    if me == leader {
        let mut xfers: Vec<_> = layers.host[1..]
            .iter()
            .map(|&r| link.recv_xfer(r, &mut []))
            .collect();
        link.exchange(&mut xfers)?;
        within(link, &leaders, me, dissemination::barrier)?;
        let mut xfers: Vec<_> = layers.host[1..]
            .iter()
            .map(|&r| link.send_xfer(r, &[]))
            .collect();
        link.exchange(&mut xfers)
    } else {
        link.send(leader, &[])?;
        link.recv(leader, &mut [])
    }
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
    if block_bytes >= grid::MIN_BYTES_PER_RANK {
        return grid::allgather(link, buf, block_bytes, layers);
    }
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
    if out.len() >= grid::MIN_BYTES_PER_RANK {
        return grid::reduce_scatter(link, input, out, dtype, op, layers);
    }
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
    fn the_chain_visits_each_host_once_starting_at_the_root() {
        // Ranks dealt round-robin over 3 hosts (a flat chain in rank order
        // would cross the network at every step).
        let hosts: Vec<String> = (0..9).map(|r| format!("h{}", r % 3)).collect();
        let layers = Layers::of(&hosts, 0).unwrap();
        assert_eq!(chain_order(&layers, 4), vec![4, 7, 1, 5, 8, 2, 3, 6, 0]);
        for root in 0..9 {
            let order = chain_order(&layers, root);
            assert_eq!(order[0], root);
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, (0..9).collect::<Vec<_>>());
            let crossings = order.windows(2).filter(|w| w[0] % 3 != w[1] % 3).count();
            assert_eq!(crossings, 2, "root {root}: {order:?}");
        }
        assert_eq!(root_column(&layers, 4), vec![3, 4, 5]);
        // A reduce's chain runs from the rank after the root around to it.
        assert_eq!(reduce_order(&layers, 4), vec![4, 5, 8, 2, 3, 6, 0, 7, 1]);
        for root in 0..9 {
            let order = reduce_order(&layers, root);
            let mut ring = order[1..].to_vec();
            ring.push(root);
            let crossings = ring.windows(2).filter(|w| w[0] % 3 != w[1] % 3).count();
            assert_eq!(crossings, 2, "root {root}: {order:?}");
        }
    }
}
