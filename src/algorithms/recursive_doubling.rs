//! Recursive doubling allreduce: log2(n) rounds of pairwise exchange of the
//! whole buffer; latency-optimal for small messages. Sizes that are not a
//! power of two first fold the extra ranks into a partner.

use super::Link;
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};

pub fn allreduce(link: &mut Link<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    if n == 1 {
        return Ok(());
    }
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros()); // largest power of two <= n
    let rem = n - p;
    let mut scratch = link.take_scratch(buf.len());
    let scratch_len = buf.len();
    // Fold: among the first 2*rem ranks, even ones hand their data to the
    // next odd one and wait for the result.
    if r < 2 * rem && r % 2 == 0 {
        link.send(r + 1, buf)?;
        return link.recv(r + 1, buf);
    }
    if r < 2 * rem {
        link.recv(r - 1, &mut scratch[..scratch_len])?;
        reduce::reduce_into(buf, &scratch[..scratch_len], dtype, op);
    }
    let virtual_rank = if r < 2 * rem { r / 2 } else { r - rem };
    let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
    let mut mask = 1;
    while mask < p {
        let partner = real(virtual_rank ^ mask);
        link.send_recv(partner, buf, partner, &mut scratch[..scratch_len])?;
        reduce::reduce_into(buf, &scratch[..scratch_len], dtype, op);
        mask <<= 1;
    }
    if op == ReduceOp::Avg {
        reduce::divide(buf, dtype, n);
    }
    link.return_scratch(scratch);
    if r < 2 * rem {
        link.send(r - 1, buf)?;
    }
    Ok(())
}
