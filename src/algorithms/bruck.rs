//! Bruck's allgather: ceil(log2 n) rounds for any n, where the ring takes
//! n - 1. In round k every rank sends the blocks it has so far (its own
//! and the next ones, up to 2^k of them) to rank - 2^k and receives as
//! many from rank + 2^k; a rotation puts them in rank order at the end.
//! Small allgathers are latency-bound, and wide jobs make many of them at
//! init and split (one byte or a few per rank): at 1024 ranks on 2 cores
//! the ring's 1023 rounds took tens of seconds. Its peers (rank +- 2^k)
//! are the dissemination barrier's, so a wide job connects few pairs.

use super::Link;
use crate::error::Result;

/// `buf` holds n blocks of `block` bytes; this rank's own is in place.
pub fn allgather(link: &mut Link<'_>, buf: &mut [u8], block: usize) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    if n == 1 || block == 0 {
        return Ok(());
    }
    // Block i of `have` is rank (r + i) % n's.
    let mut have = link.take_scratch(n * block);
    have[..block].copy_from_slice(&buf[r * block..(r + 1) * block]);
    let mut got = 1;
    while got < n {
        let count = got.min(n - got);
        let (to, from) = ((r + n - got) % n, (r + got) % n);
        let (mine, rest) = have.split_at_mut(got * block);
        let result = link.send_recv(to, &mine[..count * block], from, &mut rest[..count * block]);
        if let Err(e) = result {
            link.return_scratch(have);
            return Err(e);
        }
        got += count;
    }
    for i in 0..n {
        let owner = (r + i) % n;
        buf[owner * block..(owner + 1) * block].copy_from_slice(&have[i * block..(i + 1) * block]);
    }
    link.return_scratch(have);
    Ok(())
}
