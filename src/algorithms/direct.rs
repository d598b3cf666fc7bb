//! Direct exchanges: every transfer posted at once and progressed together
//! (gather, scatter, alltoall). Simple, and fine while n is small.

use super::Link;
use crate::error::Result;
use crate::transport::Xfer;

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

/// Uneven exchange (alltoallv, allgatherv): `send[j]` goes to rank j,
/// `recv[i]` comes from rank i, all at once; this rank's own block is
/// copied (None: it is already in place). Each transfer is labelled with
/// its own element count, so ranks whose counts disagree both fail,
/// naming both counts.
pub fn exchange_v(
    link: &mut Link<'_>,
    send: &[&[u8]],
    recv: Vec<Option<&mut [u8]>>,
    dtype_size: usize,
) -> Result<()> {
    let r = link.rank();
    let desc = link.desc();
    let es = dtype_size.max(1);
    // A transfer's label carries its count and (in `root`, low 32 bits)
    // the count its sender expects back from the receiver, so a mismatch
    // in either direction is seen by both ranks.
    let label = |count: usize, back: usize| {
        let mut d = desc.data(count, desc.dtype);
        d.root = back as u32 as i32;
        d
    };
    let mut xfers = Vec::with_capacity(2 * recv.len());
    for (i, into) in recv.into_iter().enumerate() {
        match into {
            Some(into) if i == r => crate::copy::copy(into, send[r]),
            None if i == r => {}
            Some(into) => {
                let (out, back) = (send[i].len() / es, into.len() / es);
                xfers.push(Xfer::send(i, send[i], label(out, back)));
                xfers.push(Xfer::recv(i, into, label(back, out)));
            }
            None => unreachable!("only this rank's block may be in place"),
        }
    }
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
