//! Collective algorithms, one per file, and the table of collectives
//! (`table`: which algorithms run each kind, and how a call is handed to
//! the one chosen). They see only a `Link` (the transport plus the
//! operation's label) and byte buffers; nothing here knows about sockets
//! or C.

pub mod binomial;
pub mod bruck;
pub mod chain;
pub mod direct;
pub mod dissemination;
pub mod grid;
pub mod halving_doubling;
pub mod hierarchical;
pub mod layers;
#[cfg(test)]
pub mod mock;
pub mod recursive_doubling;
pub mod ring;
pub mod table;
pub mod tuner;

use crate::descriptor::{Desc, OpKind};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::transport::{Shape, Transport, Xfer};
use std::ops::Range;
pub use tuner::Crossovers;

/// The algorithms rdist has (the wire value is the discriminant; ranks
/// that picked different ones fail with a mismatch instead of corrupting).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Algo {
    Ring = 1,
    RecursiveDoubling = 2,
    Binomial = 3,
    Direct = 4,
    Dissemination = 5,
    Chain = 6,
    HalvingDoubling = 7,
    /// Inside each host, then across hosts, then inside again (see
    /// `hierarchical`).
    Hierarchical = 8,
    /// Allgather in ceil(log2 n) rounds (see `bruck`).
    Bruck = 9,
}

impl Algo {
    pub const ALL: [Algo; 9] = [
        Algo::Ring,
        Algo::RecursiveDoubling,
        Algo::Binomial,
        Algo::Direct,
        Algo::Dissemination,
        Algo::Chain,
        Algo::HalvingDoubling,
        Algo::Hierarchical,
        Algo::Bruck,
    ];

    #[cfg(test)]
    pub fn name(self) -> &'static str {
        crate::descriptor::algo_name(self as u8)
    }

    /// Parses a name from the `algo` option (also short forms).
    pub fn parse(name: &str) -> Result<Algo> {
        let v = crate::descriptor::algo_value(name)?;
        Algo::ALL
            .into_iter()
            .find(|a| *a as u8 == v)
            .ok_or_else(|| Error::internal(format!("algorithm {v} has a name but no entry")))
    }
}

/// Between hosts the links, not the cores, are the bound, and the chain
/// wins from far smaller messages: 3 hosts on 1 Gbit/s links (tbf),
/// busbw 0.116-0.118 GB/s from 64 KiB to 16 MiB, the tree 0.060 at every
/// size (its root sends everything twice).
const CHAIN_ACROSS_HOSTS_BYTES: usize = 64 << 10;

/// Allreduces from this size run hierarchically when the ranks sit on
/// several hosts, several on each, as many on every host: the host links
/// then carry 1/(ranks per host) of the data each, all of them at once.
const HIERARCHICAL_BYTES: usize = 256 << 10;

/// Picks the algorithm for an operation; `forced` wins where it applies.
/// `shape`: what the media can do (through kernel sockets or shared
/// memory; some ranks on other hosts, so the network, not the cores, is
/// the bound); `layered`: several ranks on each of several hosts, as many
/// on every host (see `hierarchical`); `crossovers`: the sizes at which
/// algorithms hand over, from the tuning model (`tuner`).
pub fn choose(
    kind: OpKind,
    bytes: usize,
    size: usize,
    forced: Option<Algo>,
    shape: &Shape,
    layered: bool,
    crossovers: &Crossovers,
) -> Algo {
    let over_tcp = shape.through_kernel();
    let c = crossovers;
    let (small_allreduce, small_allgather) = match over_tcp {
        true => (c.small_allreduce_tcp, c.small_allgather_tcp),
        false => (c.small_allreduce_shm, c.small_allgather_shm),
    };
    let across_hosts = shape.across_hosts;
    let options = table::entry(kind).map_or(&[Algo::Direct][..], |e| e.algorithms);
    if let Some(f) = forced.filter(|f| options.contains(f)) {
        return f;
    }
    match kind {
        OpKind::AllReduce | OpKind::AllGather | OpKind::ReduceScatter
            if layered && bytes >= HIERARCHICAL_BYTES =>
        {
            Algo::Hierarchical
        }
        // Barriers by layers: ceil(log2 hosts) rounds over the network
        // instead of ceil(log2 n) (3 hosts of 4 ranks, 1 ms each way:
        // 2.4 ms against 3.6; on 1 Gbit/s links without delay 164 µs
        // against 287).
        OpKind::Barrier if layered => Algo::Hierarchical,
        // Large broadcasts and reduces along the chain that visits the
        // hosts in turn: each host link carries the data once whatever
        // the rank layout (a flat chain in rank order crosses the network
        // at every step when ranks are dealt round-robin). Small ones stay
        // on the flat tree, for its fewer steps (measured: no faster by
        // layers with ranks numbered host by host); `algo=hierarchical`
        // gives the two trees, which cross the network at most
        // ceil(log2 hosts) times from any root and in any layout.
        OpKind::Broadcast | OpKind::Reduce if layered && bytes >= hierarchical::CHAIN_BYTES => {
            Algo::Hierarchical
        }
        OpKind::AllGather if bytes <= small_allgather && size > 2 => Algo::Bruck,
        // Two ranks: the ring halves each rank's reductions, which pays
        // only from larger messages.
        OpKind::AllReduce
            if bytes <= small_allreduce || size <= 2 && bytes <= 4 * small_allreduce =>
        {
            Algo::RecursiveDoubling
        }
        OpKind::AllReduce
            if over_tcp
                && size >= 4
                && size.is_power_of_two()
                && bytes >= c.halving_doubling_tcp =>
        {
            Algo::HalvingDoubling
        }
        OpKind::Broadcast | OpKind::Reduce if over_tcp && size >= 3 && bytes >= c.chain_tcp => {
            Algo::Chain
        }
        OpKind::Broadcast | OpKind::Reduce
            if across_hosts && size >= 3 && bytes >= CHAIN_ACROSS_HOSTS_BYTES =>
        {
            Algo::Chain
        }
        _ => options[0],
    }
}

/// What an algorithm talks through: the transport, labelled with the
/// operation so that every frame it sends can be checked by the receiver.
pub struct Link<'t> {
    transport: &'t mut dyn Transport,
    desc: Desc,
    /// Kept by the backend between calls, so large scratch buffers are
    /// allocated (and page-faulted) once, not per call.
    scratch: &'t mut Vec<u8>,
    /// The neighbours' check, still to be sent (see `checked`).
    check: Option<Check>,
}

/// The neighbours' check of a call: this rank's label to the next rank,
/// the previous one's to this (empty transfers, in the whole world's
/// numbering).
pub type Check = [Xfer<'static>; 2];

impl<'t> Link<'t> {
    pub fn new(transport: &'t mut dyn Transport, desc: Desc, scratch: &'t mut Vec<u8>) -> Link<'t> {
        Link {
            transport,
            desc,
            scratch,
            check: None,
        }
    }

    /// For a call in which a rank may receive nothing (the root of a
    /// broadcast or scatter, a leaf of a reduce or gather): every rank
    /// also sends its label to the next rank and receives the previous
    /// one's, within its first exchange. A rank whose call differs from
    /// its neighbour's (another root, count, type or operation) then
    /// fails in this call, not the next; without it, two ranks that each
    /// took itself for the root both returned success.
    pub fn checked(mut self) -> Link<'t> {
        let (rank, n, desc) = (self.rank(), self.size(), self.desc);
        if n > 1 {
            self.check = Some([
                Xfer::send((rank + 1) % n, &[], desc),
                Xfer::recv((rank + n - 1) % n, &mut [], desc),
            ]);
        }
        self
    }

    /// Runs the neighbours' check if no exchange carried it.
    pub fn finish(mut self) -> Result<()> {
        if self.check.is_some() {
            self.exchange(&mut [])?;
        }
        Ok(())
    }

    /// Borrows the scratch buffer with at least `len` bytes; hand it back
    /// with `return_scratch` (if an error intervenes it is simply
    /// allocated again next time).
    pub fn take_scratch(&mut self, len: usize) -> Vec<u8> {
        let mut v = std::mem::take(self.scratch);
        if v.len() < len {
            v.resize(len, 0);
        }
        v
    }

    pub fn return_scratch(&mut self, v: Vec<u8>) {
        *self.scratch = v;
    }

    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    pub fn size(&self) -> usize {
        self.transport.size()
    }

    /// What this call's frames carry (the uneven collectives label each
    /// transfer with its own count).
    pub fn desc(&self) -> Desc {
        self.desc
    }

    pub fn send_xfer<'a>(&self, peer: usize, data: &'a [u8]) -> Xfer<'a> {
        Xfer::send(peer, data, self.desc)
    }

    pub fn recv_xfer<'a>(&self, peer: usize, buf: &'a mut [u8]) -> Xfer<'a> {
        Xfer::recv(peer, buf, self.desc)
    }

    pub fn recv_reduce_xfer<'a>(
        &self,
        peer: usize,
        buf: &'a mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Xfer<'a> {
        Xfer::recv_reduce(peer, buf, dtype, op, self.desc)
    }

    pub fn exchange(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()> {
        match self.check.take() {
            Some(check) => exchange_checked(self.transport, check, xfers),
            None => self.transport.exchange(xfers),
        }
    }

    pub fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        let x = self.send_xfer(peer, data);
        self.exchange(&mut [x])
    }

    pub fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let x = self.recv_xfer(peer, buf);
        self.exchange(&mut [x])
    }

    /// Sends `data` to `to` while receiving `buf` from `from`.
    pub fn send_recv(&mut self, to: usize, data: &[u8], from: usize, buf: &mut [u8]) -> Result<()> {
        let s = self.send_xfer(to, data);
        let r = self.recv_xfer(from, buf);
        self.exchange(&mut [s, r])
    }
}

/// `xfers` with the neighbours' check ahead of them: the first frame each
/// rank sends its next rank in the call, and the first it takes from its
/// previous one, whatever else passes between them.
///
/// While a peer is not connected yet the check goes alone, ahead: an
/// exchange first waits for every peer it names to connect, and one whose
/// peer connects only later in the call would hold this rank's check,
/// which the next rank's first exchange waits for.
pub fn exchange_checked(
    transport: &mut dyn Transport,
    mut check: Check,
    xfers: &mut [Xfer<'_>],
) -> Result<()> {
    if !check
        .iter()
        .chain(xfers.iter())
        .all(|x| transport.connected(x.peer))
    {
        transport.exchange(&mut check)?;
        return transport.exchange(xfers);
    }
    let (peer, desc) = (check[0].peer, check[0].desc);
    let placeholder = || Xfer::send(peer, &[], desc);
    let mut all = Vec::with_capacity(xfers.len() + 2);
    all.extend(check);
    for x in xfers.iter_mut() {
        all.push(std::mem::replace(x, placeholder()));
    }
    let result = transport.exchange(&mut all);
    for (x, back) in xfers.iter_mut().zip(all.drain(2..)) {
        *x = back;
    }
    result
}

/// The reduction a partial step runs: Avg is summed along the way (a
/// step or sub-group dividing by its own count would be wrong) and
/// divided once, by the whole world, at the end.
pub fn summed(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    }
}

/// Byte range of block `i` when `count` elements of `esize` bytes are cut
/// into `n` nearly equal blocks (the first `count % n` get one more).
pub fn block(count: usize, n: usize, i: usize, esize: usize) -> Range<usize> {
    let base = count / n;
    let extra = count % n;
    let start = i * base + i.min(extra);
    let len = base + usize::from(i < extra);
    start * esize..(start + len) * esize
}

/// Borrows two disjoint ranges of one buffer, one to read and one to write.
pub fn split_pair(buf: &mut [u8], read: Range<usize>, write: Range<usize>) -> (&[u8], &mut [u8]) {
    assert!(
        read.end <= write.start || write.end <= read.start,
        "ranges overlap"
    );
    // Decided by where the ranges end, not start: an empty range may start
    // where the other one does.
    if read.end <= write.start {
        let (lo, hi) = buf.split_at_mut(write.start);
        (&lo[read], &mut hi[..write.end - write.start])
    } else {
        let (lo, hi) = buf.split_at_mut(read.start);
        (&hi[..read.end - read.start], &mut lo[write])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `super::choose` with the reference machine's crossovers.
    fn choose(
        kind: OpKind,
        bytes: usize,
        size: usize,
        forced: Option<Algo>,
        shape: &Shape,
        layered: bool,
    ) -> Algo {
        super::choose(
            kind,
            bytes,
            size,
            forced,
            shape,
            layered,
            &tuner::REFERENCE_CROSSOVERS,
        )
    }

    /// A shape over TCP or shared memory, across hosts or not.
    fn shape(over_tcp: bool, across_hosts: bool) -> Shape {
        let caps = crate::transport::Caps {
            through_kernel: over_tcp,
            ..Default::default()
        };
        Shape {
            within_host: caps,
            between_hosts: caps,
            across_hosts,
        }
    }

    #[test]
    fn every_algorithm_has_its_own_name_and_parses_back() {
        for a in Algo::ALL {
            assert_eq!(Algo::parse(a.name()).unwrap(), a);
            assert!(!["none", "unknown"].contains(&a.name()), "{a:?}");
        }
    }

    #[test]
    fn blocks_cover_the_buffer_exactly() {
        for count in [0, 1, 2, 5, 17, 100] {
            for n in 1..7 {
                let mut next = 0;
                for i in 0..n {
                    let r = block(count, n, i, 4);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, count * 4);
            }
        }
    }

    #[test]
    fn split_pair_takes_empty_ranges_anywhere() {
        let mut buf: Vec<u8> = (0..8).collect();
        for (read, write) in [
            (0..0, 0..8),
            (0..8, 0..0),
            (8..8, 0..8),
            (0..8, 8..8),
            (2..4, 4..8),
        ] {
            let (r, w) = split_pair(&mut buf, read.clone(), write.clone());
            assert_eq!(
                r,
                &(read.start as u8..read.end as u8).collect::<Vec<_>>()[..]
            );
            assert_eq!(w.len(), write.len());
            w.fill(9);
            buf = (0..8).collect();
        }
    }

    #[test]
    fn forced_algorithms_apply_only_where_they_can() {
        assert_eq!(
            choose(OpKind::AllReduce, 8, 4, None, &shape(false, false), false),
            Algo::RecursiveDoubling
        );
        assert_eq!(
            choose(
                OpKind::AllReduce,
                64 << 20,
                4,
                None,
                &shape(false, false),
                false
            ),
            Algo::Ring
        );
        assert_eq!(
            choose(
                OpKind::AllReduce,
                8,
                4,
                Some(Algo::Ring),
                &shape(false, false),
                false
            ),
            Algo::Ring
        );
        assert_eq!(
            choose(
                OpKind::AllReduce,
                4 << 20,
                4,
                None,
                &shape(true, false),
                false
            ),
            Algo::HalvingDoubling
        );
        for (bytes, size) in [(4 << 20, 6), (4 << 20, 2), (128 << 10, 4)] {
            assert_eq!(
                choose(
                    OpKind::AllReduce,
                    bytes,
                    size,
                    None,
                    &shape(true, false),
                    false
                ),
                Algo::Ring,
                "{bytes} B, {size} ranks"
            );
        }
        assert_eq!(
            choose(
                OpKind::AllReduce,
                4 << 20,
                8,
                Some(Algo::Ring),
                &shape(true, false),
                false
            ),
            Algo::Ring
        );
        assert_eq!(
            choose(
                OpKind::Broadcast,
                8,
                4,
                Some(Algo::Ring),
                &shape(false, false),
                false
            ),
            Algo::Binomial
        );
        assert_eq!(
            choose(
                OpKind::Broadcast,
                64 << 20,
                4,
                None,
                &shape(true, false),
                false
            ),
            Algo::Chain
        );
        assert_eq!(
            choose(
                OpKind::Broadcast,
                64 << 20,
                4,
                None,
                &shape(false, false),
                false
            ),
            Algo::Binomial
        );
        assert_eq!(
            choose(
                OpKind::Broadcast,
                64 << 20,
                2,
                None,
                &shape(true, false),
                false
            ),
            Algo::Binomial
        );
        // Layered jobs: hierarchical allreduce from 256 KiB.
        assert_eq!(
            choose(
                OpKind::AllReduce,
                1 << 20,
                6,
                None,
                &shape(true, true),
                true
            ),
            Algo::Hierarchical
        );
        assert_eq!(
            choose(
                OpKind::AllReduce,
                8 << 10,
                6,
                None,
                &shape(true, true),
                true
            ),
            Algo::RecursiveDoubling
        );
        assert_eq!(
            choose(
                OpKind::AllReduce,
                1 << 20,
                6,
                None,
                &shape(true, true),
                false
            ),
            Algo::Ring
        );
        // Layered jobs: barriers by layers; broadcast and reduce from
        // 64 KiB (the chain host by host), small ones on the flat tree.
        assert_eq!(
            choose(OpKind::Barrier, 0, 6, None, &shape(true, true), true),
            Algo::Hierarchical
        );
        for kind in [OpKind::Broadcast, OpKind::Reduce] {
            assert_eq!(
                choose(kind, 64 << 10, 6, None, &shape(true, true), true),
                Algo::Hierarchical
            );
            assert_eq!(
                choose(kind, 8 << 10, 6, None, &shape(true, true), true),
                Algo::Binomial
            );
        }
        assert_eq!(
            choose(OpKind::Barrier, 0, 6, None, &shape(true, true), false),
            Algo::Dissemination
        );
        // Between hosts the chain from 64 KiB (3+ ranks); small ones stay on the tree.
        assert_eq!(
            choose(
                OpKind::Broadcast,
                64 << 10,
                3,
                None,
                &shape(true, true),
                false
            ),
            Algo::Chain
        );
        assert_eq!(
            choose(
                OpKind::Broadcast,
                8 << 10,
                3,
                None,
                &shape(true, true),
                false
            ),
            Algo::Binomial
        );
        // Reduce mirrors broadcast: a chain over TCP from 4 MiB, between
        // hosts from 64 KiB; the tree on shared memory and for small ones.
        for (bytes, over_tcp, across, want) in [
            (16 << 20, true, false, Algo::Chain),
            (64 << 20, false, false, Algo::Binomial),
            (64 << 10, true, true, Algo::Chain),
            (8 << 10, true, true, Algo::Binomial),
        ] {
            assert_eq!(
                choose(
                    OpKind::Reduce,
                    bytes,
                    4,
                    None,
                    &shape(over_tcp, across),
                    false
                ),
                want,
                "{bytes} over_tcp {over_tcp} across {across}"
            );
        }
        assert_eq!(
            choose(
                OpKind::Reduce,
                1 << 20,
                4,
                Some(Algo::Chain),
                &shape(false, false),
                false
            ),
            Algo::Chain
        );
        assert_eq!(Algo::parse("RD").unwrap(), Algo::RecursiveDoubling);
        assert!(Algo::parse("bogus").unwrap_err().message().contains("ring"));
    }
}
