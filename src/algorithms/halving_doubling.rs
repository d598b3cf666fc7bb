//! Halving-doubling allreduce (Rabenseifner): a reduce-scatter by recursive
//! halving, then an allgather by recursive doubling. It moves the same bytes
//! as the ring (2(n-1)/n of the buffer per rank) in 2 log2(n) steps instead
//! of 2(n-1), and every step is an exchange within a pair: a pair never
//! waits on another pair, which is what counts when ranks outnumber cores
//! (the ring's step waits on both neighbours, who may not be running).
//! Sizes that are not a power of two first fold the extra ranks into a
//! partner (`recursive_doubling::fold`).

use super::recursive_doubling::{fold, unfold};
use super::{split_pair, Link};
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use std::ops::Range;

pub fn allreduce(link: &mut Link<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let n = link.size();
    if n == 1 {
        return Ok(());
    }
    let Some(folded) = fold(link, buf, dtype, op)? else {
        return Ok(());
    };
    let virtual_rank = folded.virtual_rank;
    let es = dtype.size();
    let bytes = |e: &Range<usize>| e.start * es..e.end * es;

    // Reduce-scatter: halve the range this rank is responsible for at every
    // step; partners share the range before the step and split it.
    let mut mine = 0..buf.len() / es;
    let mut parents: Vec<Range<usize>> = Vec::with_capacity(folded.ranks.trailing_zeros() as usize);
    let mut mask = folded.ranks / 2;
    while mask > 0 {
        let partner = folded.real(virtual_rank ^ mask);
        let mid = mine.start + (mine.end - mine.start) / 2;
        let (keep, give) = if virtual_rank & mask == 0 {
            (mine.start..mid, mid..mine.end)
        } else {
            (mid..mine.end, mine.start..mid)
        };
        let (out, into) = split_pair(buf, bytes(&give), bytes(&keep));
        let send = link.send_xfer(partner, out);
        let recv = link.recv_reduce_xfer(partner, into, dtype, op);
        link.exchange(&mut [send, recv])?;
        parents.push(mine);
        mine = keep;
        mask >>= 1;
    }
    if op == ReduceOp::Avg {
        reduce::divide(&mut buf[bytes(&mine)], dtype, n);
    }
    // Allgather: retrace the halvings, swapping halves with the same partners.
    let mut mask = 1;
    while let Some(parent) = parents.pop() {
        let partner = folded.real(virtual_rank ^ mask);
        let theirs = if virtual_rank & mask == 0 {
            mine.end..parent.end
        } else {
            parent.start..mine.start
        };
        let (out, into) = split_pair(buf, bytes(&mine), bytes(&theirs));
        link.send_recv(partner, out, partner, into)?;
        mine = parent;
        mask <<= 1;
    }
    unfold(link, &folded, buf)
}
