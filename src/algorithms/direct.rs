//! Direct exchanges: every transfer posted at once and progressed together
//! (gather, scatter, alltoall). Simple, and fine while n is small.

use super::Link;
use crate::error::Result;

/// The first `n` blocks of `block_bytes` of `buf` (zero-length ones too).
fn blocks_mut(buf: &mut [u8], n: usize, block_bytes: usize) -> Vec<&mut [u8]> {
    let mut out = Vec::with_capacity(n);
    let mut rest = buf;
    for _ in 0..n {
        let (head, tail) = rest.split_at_mut(block_bytes);
        out.push(head);
        rest = tail;
    }
    out
}

/// Root receives block i from rank i into `buf` (n blocks of
/// `block_bytes`; its own block must already be in place).
pub fn gather_at_root(link: &mut Link<'_>, buf: &mut [u8], block_bytes: usize) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let mut xfers: Vec<_> = blocks_mut(buf, n, block_bytes)
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i != r)
        .map(|(i, b)| link.recv_xfer(i, b))
        .collect();
    link.exchange(&mut xfers)
}

/// Root sends block i of `buf` to rank i.
pub fn scatter_from_root(link: &mut Link<'_>, buf: &[u8], block_bytes: usize) -> Result<()> {
    let r = link.rank();
    let mut xfers: Vec<_> = (0..link.size())
        .filter(|i| *i != r)
        .map(|i| link.send_xfer(i, &buf[i * block_bytes..(i + 1) * block_bytes]))
        .collect();
    link.exchange(&mut xfers)
}

/// Block j of `send` goes to rank j; block i of `recv` comes from rank i.
pub fn alltoall(
    link: &mut Link<'_>,
    send: &[u8],
    recv: &mut [u8],
    block_bytes: usize,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let block = |i: usize| &send[i * block_bytes..(i + 1) * block_bytes];
    let mut xfers = Vec::with_capacity(2 * n);
    for (i, into) in blocks_mut(recv, n, block_bytes).into_iter().enumerate() {
        if i == r {
            crate::copy::copy(into, block(r));
        } else {
            xfers.push(link.send_xfer(i, block(i)));
            xfers.push(link.recv_xfer(i, into));
        }
    }
    link.exchange(&mut xfers)
}
