//! Pipelined chains for large messages. Broadcast: the root's data flows
//! root -> root+1 -> ... in chunks, every rank forwarding chunk c-1 while
//! it receives chunk c. Reduce is its mirror, flowing root+1 -> ... ->
//! root: every rank combines chunk c from its predecessor with its own
//! while it passes chunk c-1 on. Time is about (chunks + n - 2) chunk
//! transfers instead of the binomial tree's log2(n) whole-message
//! transfers, and every link carries the data once.

use super::{split_pair, summed, Link};
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::transport::Xfer;

/// Chunk size: large enough to amortise a step's latency, small enough to
/// keep every link of the chain busy.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Middle-size messages are cut into at least `MIN_CHUNKS` chunks (down to
/// `MIN_CHUNK_BYTES`): in one or two chunks, a message crosses each link
/// of the chain in turn instead of streaming through all of them at once.
const MIN_CHUNKS: usize = 8;
const MIN_CHUNK_BYTES: usize = 16 << 10;

/// The chunk size for a message of `len` bytes (the same on every rank),
/// a multiple of 4 KiB: a reduce's chunks must hold whole elements.
fn chunk_bytes(len: usize) -> usize {
    (len / MIN_CHUNKS).clamp(MIN_CHUNK_BYTES, CHUNK_BYTES) & !4095
}

pub fn broadcast(link: &mut Link<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    pipeline(link, buf, root, None)
}

/// Reduces every rank's `acc` into the root's, along the chain that ends
/// at the root (`acc` holds this rank's contribution; on return the
/// root's holds the result, the others' partial sums).
pub fn reduce(
    link: &mut Link<'_>,
    acc: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let n = link.size();
    // Avg sums along the chain and divides once, at the root.
    let combine = summed(op);
    pipeline(link, acc, (root + 1) % n, Some((dtype, combine)))?;
    if link.rank() == root && op == ReduceOp::Avg {
        reduce::divide(acc, dtype, n);
    }
    Ok(())
}

/// Moves `buf` in chunks along the chain head -> head+1 -> ... -> head-1:
/// each rank receives chunk c from its predecessor (copied in, or combined
/// with its own by `combine`) while it passes chunk c-1 on.
fn pipeline(
    link: &mut Link<'_>,
    buf: &mut [u8],
    head: usize,
    combine: Option<(DType, ReduceOp)>,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let pos = (r + n - head) % n; // position along the chain
    let prev = (r + n - 1) % n;
    let next = (r + 1) % n;
    let last = pos == n - 1;
    let len = buf.len();
    let chunk = chunk_bytes(len);
    let chunks = len.div_ceil(chunk);
    let range = |c: usize| c * chunk..((c + 1) * chunk).min(len);
    if pos == 0 {
        for c in 0..chunks {
            let x = link.send_xfer(next, &buf[range(c)]);
            link.exchange(&mut [x])?;
        }
        return Ok(());
    }
    // Step s receives chunk s (if any) and passes chunk s-1 on (if any).
    for s in 0..=chunks {
        match (s < chunks, s > 0 && !last) {
            (true, true) => {
                let (out, into) = split_pair(buf, range(s - 1), range(s));
                let send = link.send_xfer(next, out);
                let recv = receive(link, prev, into, combine);
                link.exchange(&mut [send, recv])?;
            }
            (true, false) => {
                let x = receive(link, prev, &mut buf[range(s)], combine);
                link.exchange(&mut [x])?;
            }
            (false, true) => {
                let x = link.send_xfer(next, &buf[range(s - 1)]);
                link.exchange(&mut [x])?;
            }
            (false, false) => {}
        }
    }
    Ok(())
}

/// A receive from `prev` into `into`: copied, or combined with what is there.
fn receive<'a>(
    link: &Link<'_>,
    prev: usize,
    into: &'a mut [u8],
    combine: Option<(DType, ReduceOp)>,
) -> Xfer<'a> {
    match combine {
        Some((dtype, op)) => link.recv_reduce_xfer(prev, into, dtype, op),
        None => link.recv_xfer(prev, into),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_whole_elements_of_every_type() {
        for len in [1usize, 100_003, 300_000 * 8 + 4, 7 << 20, 64 << 20] {
            let c = chunk_bytes(len);
            assert_eq!(c % 4096, 0, "{len}");
            assert!((MIN_CHUNK_BYTES..=CHUNK_BYTES).contains(&c), "{len}: {c}");
        }
    }
}
