//! Pipelined chains for large messages. Broadcast: the root's data flows
//! root -> root+1 -> ... in chunks, every rank forwarding chunk c-1 while
//! it receives chunk c. Reduce is its mirror, flowing root+1 -> ... ->
//! root: every rank combines chunk c from its predecessor with its own
//! while it passes chunk c-1 on. Time is about (chunks + n - 2) chunk
//! transfers instead of the binomial tree's log2(n) whole-message
//! transfers, and every link carries the data once.

use super::{split_pair, Link};
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};

/// Chunk size: large enough to amortise a step's latency, small enough to
/// keep every link of the chain busy.
pub const CHUNK_BYTES: usize = 1 << 20;

pub fn broadcast(link: &mut Link<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let pos = (r + n - root) % n; // position along the chain
    let prev = (r + n - 1) % n;
    let next = (r + 1) % n;
    let last = pos == n - 1;
    let chunks = buf.len().div_ceil(CHUNK_BYTES);
    let len = buf.len();
    let range = |c: usize| c * CHUNK_BYTES..((c + 1) * CHUNK_BYTES).min(len);
    if pos == 0 {
        for c in 0..chunks {
            let x = link.send_xfer(next, &buf[range(c)]);
            link.exchange(&mut [x])?;
        }
        return Ok(());
    }
    // Step s receives chunk s (if any) and forwards chunk s-1 (if any).
    for s in 0..=chunks {
        match (s < chunks, s > 0 && !last) {
            (true, true) => {
                let (out, into) = split_pair(buf, range(s - 1), range(s));
                let send = link.send_xfer(next, out);
                let recv = link.recv_xfer(prev, into);
                link.exchange(&mut [send, recv])?;
            }
            (true, false) => {
                let x = link.recv_xfer(prev, &mut buf[range(s)]);
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
    let (r, n) = (link.rank(), link.size());
    if n == 1 || acc.is_empty() {
        if op == ReduceOp::Avg {
            reduce::divide(acc, dtype, n);
        }
        return Ok(());
    }
    let pos = (r + n - root - 1) % n; // the root is last
    let prev = (r + n - 1) % n;
    let next = (r + 1) % n;
    let (first, last) = (pos == 0, pos == n - 1);
    let chunks = acc.len().div_ceil(CHUNK_BYTES);
    let len = acc.len();
    let range = |c: usize| c * CHUNK_BYTES..((c + 1) * CHUNK_BYTES).min(len);
    // Avg sums along the chain and divides once, at the root.
    let combine = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    if first {
        for c in 0..chunks {
            let x = link.send_xfer(next, &acc[range(c)]);
            link.exchange(&mut [x])?;
        }
        return Ok(());
    }
    // Step s combines chunk s (if any) and passes chunk s-1 on (if any).
    for s in 0..=chunks {
        match (s < chunks, s > 0 && !last) {
            (true, true) => {
                let (out, into) = split_pair(acc, range(s - 1), range(s));
                let send = link.send_xfer(next, out);
                let recv = link.recv_reduce_xfer(prev, into, dtype, combine);
                link.exchange(&mut [send, recv])?;
            }
            (true, false) => {
                let x = link.recv_reduce_xfer(prev, &mut acc[range(s)], dtype, combine);
                link.exchange(&mut [x])?;
            }
            (false, true) => {
                let x = link.send_xfer(next, &acc[range(s - 1)]);
                link.exchange(&mut [x])?;
            }
            (false, false) => {}
        }
    }
    if last && op == ReduceOp::Avg {
        reduce::divide(acc, dtype, n);
    }
    Ok(())
}
