//! Large hierarchical allreduce, allgather and reduce-scatter as one
//! pipelined schedule over the grid of hosts x local ranks.
//!
//! The phases of `hierarchical` (inside the host, across, inside again)
//! run one after the other: the links idle while a host copies, and the
//! ring across the hosts waits at every step for its slowest link, where
//! the L rings that share each host link rarely get equal shares of it.
//! Here every step is cut into chunks and the work runs in lock-step
//! ticks, each one exchange: at tick t every rank sends chunk t of its
//! stream to its right neighbour on the next host and receives chunk t
//! from its left one (a ring over the hosts among the ranks of one local
//! index, chunk t passed on at tick t + C), while over shared memory it
//! takes in its host-mates' contributions to the chunks it sends next
//! (reduce) and hands the finished chunks to them (gather). A tick waits
//! for one chunk, not one block, so the rings share each link at a common
//! pace, and the host's copies hide behind the network.

use super::{block, summed, Link};
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::transport::Xfer;
use std::ops::Range;

use super::layers::Layers;

/// Target chunk size: a tick moves about this much over each host link
/// (about 8 ms on 1 Gbit/s), large enough that a tick's overhead is
/// noise, small enough that the rings stay in step.
pub const CHUNK_BYTES: usize = 1 << 20;

/// From this much data per rank (a collective's whole buffer over the
/// world size) the schedule here beats the phases of `hierarchical`;
/// below, its extra ticks cost more than the overlap saves (3 hosts x 2
/// ranks on 1 Gbit/s links: at 2 MiB in all, 350 KiB a rank, it is ahead
/// by 2-7 %; at 1 MiB level; at 256 KiB allreduce takes 3x as long).
pub const MIN_BYTES_PER_RANK: usize = 256 << 10;

/// This rank's place in the grid.
struct Place {
    hosts: usize,
    locals: usize,
    /// This rank's host index and local index.
    h: usize,
    j: usize,
    /// The ranks with this local index on the previous and next host.
    left: usize,
    right: usize,
    /// `grid[h][m]`: every rank by host and local index.
    grid: Vec<Vec<usize>>,
}

impl Place {
    fn of(layers: &Layers, me: usize) -> Place {
        let grid = layers.grid.clone();
        let (h, j) = grid
            .iter()
            .enumerate()
            .find_map(|(h, g)| g.iter().position(|r| *r == me).map(|j| (h, j)))
            .expect("every rank is in the grid");
        let hosts = grid.len();
        Place {
            hosts,
            locals: grid[0].len(),
            h,
            j,
            left: grid[(h + hosts - 1) % hosts][j],
            right: grid[(h + 1) % hosts][j],
            grid,
        }
    }

    /// The host block a stream position `t` (in chunks) refers to: the
    /// ring sends block h, h-1, ... one after another, C chunks each.
    fn host_at(&self, t: i64, chunks: usize, shift: usize) -> usize {
        debug_assert!(t >= 0, "stream positions start at 0");
        let step = t.div_euclid(chunks as i64) as usize + shift;
        (self.h + self.hosts * (step / self.hosts + 1) - step) % self.hosts
    }

    /// The mate at `d` places after this rank in the host (and before).
    fn mate_after(&self, d: usize) -> (usize, usize) {
        let m = (self.j + d) % self.locals;
        (m, self.grid[self.h][m])
    }

    fn mate_before(&self, d: usize) -> (usize, usize) {
        let m = (self.j + self.locals - d) % self.locals;
        (m, self.grid[self.h][m])
    }
}

/// Chunks per host block: enough to keep the rings in step, and at least
/// as many as the host has ranks, so that the reductions of one tick
/// never land in the same chunk (see `allreduce`).
fn chunks_for(block_bytes: usize, locals: usize, chunk_bytes: usize) -> usize {
    block_bytes.div_ceil(chunk_bytes).max(locals).max(2)
}

/// Sub-range `i` of `parts` nearly equal ones of `range` (whole elements).
fn part(range: Range<usize>, parts: usize, i: usize, es: usize) -> Range<usize> {
    let r = block((range.end - range.start) / es, parts, i, es);
    range.start + r.start..range.start + r.end
}

/// One transfer of a tick, over a range of the working buffer (or, for
/// `SendInput`, of a separate input).
enum Op {
    Send(usize, Range<usize>),
    SendInput(usize, Range<usize>),
    Recv(usize, Range<usize>),
    RecvReduce(usize, Range<usize>),
}

/// Runs one tick: carves the working buffer into the ranges `ops` name
/// (reads may repeat a range, writes must not overlap anything) and
/// exchanges them all at once.
fn tick(
    link: &mut Link<'_>,
    work: &mut [u8],
    input: &[u8],
    ops: &[Op],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    // Distinct ranges of `work`, in order of start.
    let mut ranges: Vec<Range<usize>> = ops
        .iter()
        .filter_map(|o| match o {
            Op::Send(_, r) | Op::Recv(_, r) | Op::RecvReduce(_, r) => Some(r.clone()),
            Op::SendInput(..) => None,
        })
        .filter(|r| !r.is_empty())
        .collect();
    ranges.sort_by_key(|r| (r.start, r.end));
    ranges.dedup();
    let mut pieces: Vec<Option<&mut [u8]>> = Vec::with_capacity(ranges.len());
    let mut rest = work;
    let mut at = 0;
    for r in &ranges {
        assert!(r.start >= at, "a tick's ranges overlap");
        let (_, tail) = rest.split_at_mut(r.start - at);
        let (piece, tail) = tail.split_at_mut(r.end - r.start);
        pieces.push(Some(piece));
        rest = tail;
        at = r.end;
    }
    let index =
        |r: &Range<usize>| ranges.binary_search_by_key(&(r.start, r.end), |x| (x.start, x.end));
    // Reads first borrow their piece shared (several sends may share it);
    // a write takes its piece whole.
    let mut shared: Vec<Option<&[u8]>> = vec![None; ranges.len()];
    for o in ops {
        if let Op::Send(_, r) = o {
            if let Ok(i) = index(r) {
                if shared[i].is_none() {
                    let piece = pieces[i].take().expect("a read range is not written");
                    shared[i] = Some(piece);
                }
            }
        }
    }
    let mut xfers: Vec<Xfer<'_>> = Vec::with_capacity(ops.len());
    for o in ops {
        match o {
            Op::Send(peer, r) => {
                let data = index(r).ok().and_then(|i| shared[i]).unwrap_or(&[]);
                xfers.push(link.send_xfer(*peer, data));
            }
            Op::SendInput(peer, r) => xfers.push(link.send_xfer(*peer, &input[r.clone()])),
            Op::Recv(peer, r) | Op::RecvReduce(peer, r) => {
                let buf: &mut [u8] = match index(r) {
                    Ok(i) => pieces[i].take().expect("a tick writes a range once"),
                    Err(_) => &mut [],
                };
                xfers.push(match o {
                    Op::Recv(..) => link.recv_xfer(*peer, buf),
                    _ => link.recv_reduce_xfer(*peer, buf, dtype, op),
                });
            }
        }
    }
    link.exchange(&mut xfers)
}

/// In-place allreduce of `buf`. Local index j's ranks own segment j of
/// the buffer (L nearly equal segments) and run a ring allreduce on it
/// across the hosts, chunk by chunk: the stream a rank sends is its
/// segment's host blocks h, h-1, ... (2(H-1) blocks of C chunks: the
/// reduce-scatter half, then the gather half). Before it sends chunk t
/// of the first H blocks, its host-mate at distance d has reduced its own
/// contribution into it, at tick t - d (each mate a different tick, so
/// no chunk takes two reductions at once); every chunk it sends in the
/// gather half is final, and goes to its host-mates in the same tick.
pub fn allreduce(
    link: &mut Link<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    layers: &Layers,
) -> Result<()> {
    allreduce_in_chunks(link, buf, dtype, op, layers, CHUNK_BYTES)
}

fn allreduce_in_chunks(
    link: &mut Link<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    layers: &Layers,
    chunk_bytes: usize,
) -> Result<()> {
    let p = Place::of(layers, link.rank());
    let (hh, ll) = (p.hosts, p.locals);
    let es = dtype.size();
    let count = buf.len() / es;
    let seg = |m: usize| block(count, ll, m, es);
    let largest = count.div_ceil(ll).div_ceil(hh) * es;
    let c = chunks_for(largest, ll, chunk_bytes);
    let ci = c as i64;
    // The region of segment m at stream position t (blocks h, h-1, ...).
    let region = |m: usize, t: i64| -> Range<usize> {
        let host = p.host_at(t, c, 0);
        part(part(seg(m), hh, host, es), c, t.rem_euclid(ci) as usize, es)
    };
    let phase_op = summed(op);
    let reduce_end = ((hh - 1) * c) as i64; // the gather half starts here
    let sends_end = (2 * (hh - 1) * c) as i64;
    let contribute_end = (hh * c) as i64; // mates reduce into [0, H*C)
    let end = ((2 * hh - 1) * c) as i64; // the last block reaches the mates
    let mut ops = Vec::with_capacity(2 + 3 * ll);
    for u in -(ll as i64 - 1)..end {
        ops.clear();
        if u >= 0 && u < sends_end {
            if u >= reduce_end && u < contribute_end && op == ReduceOp::Avg {
                // This rank's block is final: divide once, before it leaves.
                reduce::divide(&mut buf[region(p.j, u)], dtype, link.size());
            }
            ops.push(Op::Send(p.right, region(p.j, u)));
            let into = region(p.j, u + ci);
            ops.push(if u < reduce_end {
                Op::RecvReduce(p.left, into)
            } else {
                Op::Recv(p.left, into)
            });
        }
        // Contributions: the mate d places before receives, for its tick
        // u + d, this rank's part of it; the mate d after sends this
        // rank its part of tick u + d.
        for d in 1..ll {
            let t = u + d as i64;
            if t >= 0 && t < contribute_end {
                let (m, before) = p.mate_before(d);
                ops.push(Op::Send(before, region(m, t)));
                let (_, after) = p.mate_after(d);
                ops.push(Op::RecvReduce(after, region(p.j, t)));
            }
        }
        // Final chunks to and from every host-mate.
        if u >= reduce_end {
            for d in 1..ll {
                let (_, to) = p.mate_after(d);
                ops.push(Op::Send(to, region(p.j, u)));
            }
            for d in 1..ll {
                let (m, from) = p.mate_after(d);
                ops.push(Op::Recv(from, region(m, u)));
            }
        }
        tick(link, buf, &[], &ops, dtype, phase_op)?;
    }
    Ok(())
}

/// Allgather of `block_bytes` from every rank into `buf` (n blocks in rank
/// order, this rank's own filled), straight into place: the ranks of one
/// local index pass the blocks of their column around the hosts, chunk
/// by chunk, and each chunk a rank sends across goes to its host-mates in
/// the same tick.
pub fn allgather(
    link: &mut Link<'_>,
    buf: &mut [u8],
    block_bytes: usize,
    layers: &Layers,
) -> Result<()> {
    allgather_in_chunks(link, buf, block_bytes, layers, CHUNK_BYTES)
}

fn allgather_in_chunks(
    link: &mut Link<'_>,
    buf: &mut [u8],
    block_bytes: usize,
    layers: &Layers,
    chunk_bytes: usize,
) -> Result<()> {
    let p = Place::of(layers, link.rank());
    let (hh, ll) = (p.hosts, p.locals);
    let c = chunks_for(block_bytes, 1, chunk_bytes);
    let ci = c as i64;
    let region = |m: usize, t: i64| -> Range<usize> {
        let r = p.grid[p.host_at(t, c, 0)][m];
        part(
            r * block_bytes..(r + 1) * block_bytes,
            c,
            t.rem_euclid(ci) as usize,
            1,
        )
    };
    let across_end = ((hh - 1) * c) as i64;
    let mut ops = Vec::with_capacity(2 + 2 * ll);
    for u in 0..(hh * c) as i64 {
        ops.clear();
        if u < across_end {
            ops.push(Op::Send(p.right, region(p.j, u)));
            ops.push(Op::Recv(p.left, region(p.j, u + ci)));
        }
        for d in 1..ll {
            let (_, to) = p.mate_after(d);
            ops.push(Op::Send(to, region(p.j, u)));
        }
        for d in 1..ll {
            let (m, from) = p.mate_after(d);
            ops.push(Op::Recv(from, region(m, u)));
        }
        tick(link, buf, &[], &ops, DType::Uint8, ReduceOp::Sum)?;
    }
    Ok(())
}

/// Reduce-scatter: `out` = block `rank` of the reduction of every rank's
/// `input` (n blocks of `out.len()` bytes, rank order). The mirror of
/// `allgather`: the ranks of local index j reduce the blocks of their
/// column around the hosts (partial sums in scratch), and before a rank
/// sends a chunk, its host-mate at distance d has reduced its
/// contribution into it, at tick t - d.
pub fn reduce_scatter(
    link: &mut Link<'_>,
    input: &[u8],
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    layers: &Layers,
) -> Result<()> {
    reduce_scatter_in_chunks(link, input, out, dtype, op, layers, CHUNK_BYTES)
}

fn reduce_scatter_in_chunks(
    link: &mut Link<'_>,
    input: &[u8],
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    layers: &Layers,
    chunk_bytes: usize,
) -> Result<()> {
    let p = Place::of(layers, link.rank());
    let (hh, ll) = (p.hosts, p.locals);
    let bb = out.len();
    let es = dtype.size();
    let c = chunks_for(bb, ll, chunk_bytes);
    let ci = c as i64;
    // Partial sums of this column's blocks, by host; the stream sends the
    // blocks of hosts h-1, h-2, ... and ends holding host h's, its own.
    let mut acc = link.take_scratch(hh * bb);
    let within_block = |t: i64| part(0..bb, c, t.rem_euclid(ci) as usize, es);
    let acc_at = |t: i64| {
        let k = within_block(t);
        let at = p.host_at(t, c, 1) * bb;
        at + k.start..at + k.end
    };
    let input_at = |m: usize, t: i64| {
        let k = within_block(t);
        let at = p.grid[p.host_at(t, c, 1)][m] * bb;
        at + k.start..at + k.end
    };
    let phase_op = summed(op);
    let across_end = ((hh - 1) * c) as i64;
    let contribute_end = (hh * c) as i64;
    // Every chunk of `acc` starts as this rank's own input, copied just
    // before anything lands in it (the ring's at tick t - C at earliest).
    let mut filled = 0i64;
    let mut ops = Vec::with_capacity(2 + 2 * ll);
    for u in -(ll as i64 - 1)..contribute_end - 1 {
        while filled < contribute_end && filled <= u + ci {
            let (dst, src) = (acc_at(filled), input_at(p.j, filled));
            crate::copy::copy(&mut acc[dst], &input[src]);
            filled += 1;
        }
        ops.clear();
        if u >= 0 && u < across_end {
            ops.push(Op::Send(p.right, acc_at(u)));
            ops.push(Op::RecvReduce(p.left, acc_at(u + ci)));
        }
        for d in 1..ll {
            let t = u + d as i64;
            if t >= 0 && t < contribute_end {
                let (m, before) = p.mate_before(d);
                ops.push(Op::SendInput(before, input_at(m, t)));
                let (_, after) = p.mate_after(d);
                ops.push(Op::RecvReduce(after, acc_at(t)));
            }
        }
        tick(link, &mut acc, input, &ops, dtype, phase_op)?;
    }
    crate::copy::copy(out, &acc[p.h * bb..(p.h + 1) * bb]);
    link.return_scratch(acc);
    if op == ReduceOp::Avg {
        reduce::divide(out, dtype, link.size());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(hosts: usize, locals: usize, me: usize) -> Place {
        let names: Vec<String> = (0..hosts * locals)
            .map(|r| format!("h{}", r / locals))
            .collect();
        Place::of(&Layers::of(&names, me).unwrap(), me)
    }

    #[test]
    fn the_stream_visits_the_host_blocks_backwards_c_chunks_each() {
        let p = place(3, 2, 2); // host 1, local 0
        let seq: Vec<usize> = (0..12).map(|t| p.host_at(t, 2, 0)).collect();
        assert_eq!(seq, vec![1, 1, 0, 0, 2, 2, 1, 1, 0, 0, 2, 2]);
        assert_eq!(p.host_at(0, 2, 1), 0);
        assert_eq!((p.left, p.right), (0, 4));
        assert_eq!(p.mate_after(1), (1, 3));
        assert_eq!(p.mate_before(1), (1, 3));
    }

    #[test]
    fn chunks_keep_reductions_apart() {
        assert_eq!(chunks_for(1, 1, CHUNK_BYTES), 2);
        assert_eq!(chunks_for(1, 4, CHUNK_BYTES), 4);
        assert_eq!(chunks_for(10 * CHUNK_BYTES + 1, 2, CHUNK_BYTES), 11);
    }

    /// Every layout of 2-4 hosts of 2-4 ranks (numbered host by host and
    /// dealt round-robin), counts that do and do not divide, chunks from
    /// a few elements (many per block) to whole blocks, against a
    /// reference computed here; the ranks are threads over an in-memory
    /// transport.
    #[test]
    fn every_layout_and_count_gives_the_reference() {
        use crate::algorithms::mock;
        use crate::dtype::{as_bytes, as_bytes_mut};
        let value = |r: usize, i: usize| ((r * 7 + i * 13) % 11) as i64 - 3;
        for hosts in 2..=4 {
            for locals in 2..=4 {
                let n = hosts * locals;
                for round_robin in [false, true] {
                    let names: Vec<String> = (0..n)
                        .map(|r| {
                            let h = if round_robin { r % hosts } else { r / locals };
                            format!("h{h}")
                        })
                        .collect();
                    for count in [1usize, 5, 97, 600] {
                        for chunk_bytes in [8usize, 40, 1 << 20] {
                            let names = names.clone();
                            let bad = mock::world(n, move |link| {
                                let me = link.rank();
                                let layers = Layers::of(&names, me).unwrap();
                                let mut bad = Vec::new();
                                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                                    let mut v: Vec<f64> =
                                        (0..count).map(|i| value(me, i) as f64).collect();
                                    let bytes = as_bytes_mut(&mut v);
                                    allreduce_in_chunks(
                                        link,
                                        bytes,
                                        DType::Float64,
                                        op,
                                        &layers,
                                        chunk_bytes,
                                    )
                                    .unwrap();
                                    for (i, got) in v.iter().enumerate() {
                                        let want = reference(op, n, |q| value(q, i));
                                        if (got - want).abs() > 1e-9 {
                                            bad.push(format!(
                                                "allreduce {op:?} [{i}] {got} != {want}"
                                            ));
                                            break;
                                        }
                                    }
                                    let input: Vec<f64> =
                                        (0..count * n).map(|i| value(me, i) as f64).collect();
                                    let mut out = vec![0f64; count];
                                    reduce_scatter_in_chunks(
                                        link,
                                        as_bytes(&input),
                                        as_bytes_mut(&mut out),
                                        DType::Float64,
                                        op,
                                        &layers,
                                        chunk_bytes,
                                    )
                                    .unwrap();
                                    for (i, got) in out.iter().enumerate() {
                                        let want = reference(op, n, |q| value(q, me * count + i));
                                        if (got - want).abs() > 1e-9 {
                                            bad.push(format!(
                                                "reduce_scatter {op:?} [{i}] {got} != {want}"
                                            ));
                                            break;
                                        }
                                    }
                                }
                                let mut all = vec![-1f64; count * n];
                                for i in 0..count {
                                    all[me * count + i] = value(me, i) as f64;
                                }
                                allgather_in_chunks(
                                    link,
                                    as_bytes_mut(&mut all),
                                    count * 8,
                                    &layers,
                                    chunk_bytes,
                                )
                                .unwrap();
                                for (i, got) in all.iter().enumerate() {
                                    if *got != value(i / count, i % count) as f64 {
                                        bad.push(format!("allgather [{i}] {got}"));
                                        break;
                                    }
                                }
                                bad
                            });
                            for (rank, b) in bad.iter().enumerate() {
                                assert!(
                                    b.is_empty(),
                                    "{hosts} hosts x {locals}, round robin {round_robin}, count {count}, chunk {chunk_bytes} B, rank {rank}: {b:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Rank q's value reduced over `n` ranks, as the collectives should.
    fn reference(op: ReduceOp, n: usize, value: impl Fn(usize) -> i64) -> f64 {
        let all = (0..n).map(|q| value(q) as f64);
        match op {
            ReduceOp::Sum => all.sum::<f64>(),
            ReduceOp::Max => all.fold(f64::MIN, f64::max),
            _ => all.sum::<f64>() / n as f64,
        }
    }
}
