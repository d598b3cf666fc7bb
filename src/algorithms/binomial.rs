//! Binomial trees rooted anywhere: broadcast fans out in log2(n) rounds,
//! reduce gathers partial results up the same tree.

use super::Link;
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};

/// Position relative to the root, and its inverse.
fn relative(link: &Link<'_>, root: usize) -> (usize, usize, impl Fn(usize) -> usize) {
    let n = link.size();
    // Both operands are below n: a compare instead of a division (a small
    // broadcast is a few hundred cycles in all).
    let wrap = move |v: usize| if v >= n { v - n } else { v };
    let vr = wrap(link.rank() + n - root);
    (vr, n, move |v: usize| wrap(v + root))
}

/// Root's `buf` ends up in every rank's `buf`.
pub fn broadcast(link: &mut Link<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let (vr, n, real) = relative(link, root);
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            link.recv(real(vr - mask), buf)?;
            break;
        }
        mask <<= 1;
    }
    // Children: vr + m for every m below the bit we received on. The
    // usual one or two go off the heap: a small broadcast is a few hundred
    // nanoseconds in all.
    let kids = || {
        std::iter::successors(Some(mask >> 1), |m| Some(m >> 1))
            .take_while(|m| *m > 0)
            .filter(move |m| vr + m < n)
            .map(|m| real(vr + m))
    };
    let mut first = kids();
    match (first.next(), first.next(), first.next()) {
        (None, ..) => Ok(()),
        (Some(a), None, _) => link.exchange(&mut [link.send_xfer(a, buf)]),
        (Some(a), Some(b), None) => {
            link.exchange(&mut [link.send_xfer(a, buf), link.send_xfer(b, buf)])
        }
        _ => {
            let mut xfers: Vec<_> = kids().map(|c| link.send_xfer(c, buf)).collect();
            link.exchange(&mut xfers)
        }
    }
}

/// `acc` holds this rank's contribution; at the root it ends up holding the
/// reduction over all ranks (elsewhere it is scratch).
pub fn reduce(
    link: &mut Link<'_>,
    acc: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (vr, n, real) = relative(link, root);
    let mut mask = 1;
    while mask < n {
        if vr & mask == 0 {
            let child = vr | mask;
            if child < n {
                let x = link.recv_reduce_xfer(real(child), acc, dtype, op);
                link.exchange(&mut [x])?;
            }
        } else {
            return link.send(real(vr & !mask), acc);
        }
        mask <<= 1;
    }
    if op == ReduceOp::Avg {
        reduce::divide(acc, dtype, n);
    }
    Ok(())
}
