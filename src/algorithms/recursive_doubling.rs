//! Recursive doubling allreduce: log2(n) rounds of pairwise exchange of the
//! whole buffer; latency-optimal for small messages. Sizes that are not a
//! power of two first fold the extra ranks into a partner (`fold`, also
//! used by halving-doubling).

use super::Link;
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};

pub fn allreduce(link: &mut Link<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    if link.size() == 1 {
        return Ok(());
    }
    let Some(folded) = fold(link, buf, dtype, op)? else {
        return Ok(());
    };
    let mut scratch = link.take_scratch(buf.len());
    let scratch_len = buf.len();
    let mut mask = 1;
    while mask < folded.ranks {
        let partner = folded.real(folded.virtual_rank ^ mask);
        link.send_recv(partner, buf, partner, &mut scratch[..scratch_len])?;
        reduce::reduce_into(buf, &scratch[..scratch_len], dtype, op);
        mask <<= 1;
    }
    if op == ReduceOp::Avg {
        reduce::divide(buf, dtype, link.size());
    }
    link.return_scratch(scratch);
    unfold(link, &folded, buf)
}

/// A rank's place among the largest power of two of ranks that run the
/// recursive steps, after `fold`.
pub struct Folded {
    /// How many ranks take part (a power of two).
    pub ranks: usize,
    /// This rank's index among them.
    pub virtual_rank: usize,
    extra: usize,
    rank: usize,
}

impl Folded {
    /// The real rank of virtual rank `v`.
    pub fn real(&self, v: usize) -> usize {
        if v < self.extra {
            2 * v + 1
        } else {
            v + self.extra
        }
    }
}

/// Folds the ranks beyond the largest power of two into partners: among
/// the first 2*extra ranks, even ones hand their data to the next odd one
/// (which reduces it into its own) and wait for the result. None for those
/// (their `buf` holds the result on return); the others go on, and end
/// with `unfold`.
pub fn fold(
    link: &mut Link<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<Option<Folded>> {
    let (r, n) = (link.rank(), link.size());
    let ranks = 1usize << (usize::BITS - 1 - n.leading_zeros()); // largest power of two <= n
    let extra = n - ranks;
    if r < 2 * extra && r % 2 == 0 {
        link.send(r + 1, buf)?;
        link.recv(r + 1, buf)?;
        return Ok(None);
    }
    if r < 2 * extra {
        let x = link.recv_reduce_xfer(r - 1, buf, dtype, op);
        link.exchange(&mut [x])?;
    }
    let virtual_rank = if r < 2 * extra { r / 2 } else { r - extra };
    Ok(Some(Folded {
        ranks,
        virtual_rank,
        extra,
        rank: r,
    }))
}

/// Hands the result back to the partner that folded into this rank.
pub fn unfold(link: &mut Link<'_>, folded: &Folded, buf: &[u8]) -> Result<()> {
    if folded.rank < 2 * folded.extra {
        link.send(folded.rank - 1, buf)?;
    }
    Ok(())
}
