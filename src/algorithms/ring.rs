//! Ring algorithms: each rank sends to its right neighbour and receives
//! from its left. Bandwidth-optimal: every rank moves (n-1)/n of the data
//! per phase. Allreduce = reduce-scatter + allgather.

use super::{block, split_pair, Link};
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};

fn neighbours(link: &Link<'_>) -> (usize, usize, usize, usize) {
    let (r, n) = (link.rank(), link.size());
    (r, n, (r + 1) % n, (r + n - 1) % n)
}

/// In-place allreduce of `buf` (`buf.len() / dtype.size()` elements).
pub fn allreduce(link: &mut Link<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let n = link.size();
    if n == 1 {
        return Ok(());
    }
    let owned = reduce_scatter_in_place(link, buf, dtype, op)?;
    if op == ReduceOp::Avg {
        let es = dtype.size();
        let mine = block(buf.len() / es, n, owned, es);
        reduce::divide(&mut buf[mine], dtype, n);
    }
    allgather_in_place(link, buf, dtype)
}

/// The first half of `allreduce`: after n-1 steps this rank holds one
/// block (n nearly equal ones) reduced over every rank (Avg not yet
/// divided); returns which block.
pub fn reduce_scatter_in_place(
    link: &mut Link<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<usize> {
    let (r, n, right, left) = neighbours(link);
    let es = dtype.size();
    let count = buf.len() / es;
    // Incoming blocks are combined as they arrive (no staging copy).
    for s in 0..n.saturating_sub(1) {
        let sb = block(count, n, (r + n - s) % n, es);
        let rb = block(count, n, (r + 2 * n - s - 1) % n, es);
        let (out, into) = split_pair(buf, sb, rb);
        let send = link.send_xfer(right, out);
        let recv = link.recv_reduce_xfer(left, into, dtype, op);
        link.exchange(&mut [send, recv])?;
    }
    Ok((r + 1) % n)
}

/// The second half of `allreduce`: every rank holds its block of
/// `reduce_scatter_in_place`; afterwards every rank holds all of them.
pub fn allgather_in_place(link: &mut Link<'_>, buf: &mut [u8], dtype: DType) -> Result<()> {
    let (r, n, right, left) = neighbours(link);
    let es = dtype.size();
    let count = buf.len() / es;
    for s in 0..n.saturating_sub(1) {
        let sb = block(count, n, (r + 1 + n - s) % n, es);
        let rb = block(count, n, (r + n - s) % n, es);
        let (out, into) = split_pair(buf, sb, rb);
        link.send_recv(right, out, left, into)?;
    }
    Ok(())
}

/// `out` = block `rank` of the element-wise reduction of every rank's
/// `input` (n blocks of `out.len()` bytes). `input` is not modified.
pub fn reduce_scatter(
    link: &mut Link<'_>,
    input: &[u8],
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (r, n, right, left) = neighbours(link);
    let bb = out.len();
    let blk = |i: usize| &input[i * bb..(i + 1) * bb];
    if n == 1 {
        crate::copy::copy(out, blk(0));
    } else {
        // Partial sums travel right; at step s this rank passes on block
        // r-s-1 (the first straight from its input, later the sum it made
        // the step before) and receives block r-s-2, so the last one
        // received is r. The incoming block and the partial sum live in
        // the link's scratch, kept between calls: fresh buffers of a
        // block each are page faults on every call.
        let mut scratch = link.take_scratch(if n > 2 { 2 * bb } else { bb });
        let (incoming, partial) = scratch.split_at_mut(bb);
        let partial = &mut partial[..if n > 2 { bb } else { 0 }];
        for s in 0..n - 1 {
            let sent: &[u8] = if s == 0 {
                blk((r + n - 1) % n)
            } else {
                partial
            };
            link.send_recv(right, sent, left, incoming)?;
            let b = (r + 2 * n - s - 2) % n;
            if s + 2 < n {
                reduce::reduce_to(partial, incoming, blk(b), dtype, op);
            } else {
                reduce::reduce_to(out, incoming, blk(b), dtype, op);
            }
        }
        link.return_scratch(scratch);
    }
    if op == ReduceOp::Avg {
        reduce::divide(out, dtype, n);
    }
    Ok(())
}

/// `buf` holds n blocks of `block_bytes`; this rank's own block is filled.
/// Afterwards every block holds its rank's data.
pub fn allgather(link: &mut Link<'_>, buf: &mut [u8], block_bytes: usize) -> Result<()> {
    pass_on(link, buf, block_bytes, 0)
}

/// `allgather` of this rank's block `input` into `buf` (n blocks of
/// `input.len()`, apart from `input`). The first step sends it from
/// `input`, not from its copy in `buf`: lines this call just wrote are
/// slower for another core to read (single copy reads them straight out
/// of this rank's memory) than the caller's.
pub fn allgather_from(link: &mut Link<'_>, input: &[u8], buf: &mut [u8]) -> Result<()> {
    let (r, n, right, left) = neighbours(link);
    let bb = input.len();
    crate::copy::copy(&mut buf[r * bb..(r + 1) * bb], input);
    if n > 1 {
        let from = (r + n - 1) % n;
        link.send_recv(right, input, left, &mut buf[from * bb..(from + 1) * bb])?;
    }
    pass_on(link, buf, bb, 1)
}

/// The ring's steps from `first` on: at step s this rank sends block r-s
/// and receives block r-s-1.
fn pass_on(link: &mut Link<'_>, buf: &mut [u8], block_bytes: usize, first: usize) -> Result<()> {
    let (r, n, right, left) = neighbours(link);
    let range = |i: usize| i * block_bytes..(i + 1) * block_bytes;
    for s in first..n.saturating_sub(1) {
        let (out, into) = split_pair(buf, range((r + n - s) % n), range((r + 2 * n - s - 1) % n));
        link.send_recv(right, out, left, into)?;
    }
    Ok(())
}
