//! Pipelined chain broadcast for large messages: the root's data flows
//! root -> root+1 -> ... in chunks, every rank forwarding chunk c-1 while it
//! receives chunk c. Time is about (chunks + n - 2) chunk transfers instead
//! of the binomial tree's log2(n) whole-message transfers.

use super::{split_pair, Link};
use crate::error::Result;

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
