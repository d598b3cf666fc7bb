//! The table of collectives: for each kind, the algorithms that can run it
//! (default first), how many bytes its choice goes by, and how a call of
//! that kind is handed to the algorithm chosen for it (its buffers made
//! ready: in place or not, the root's own block, overlapping inputs
//! copied). The socket backend labels a call and runs its entry; a new
//! collective adds its entry here and its algorithm file beside.

use super::layers::Layers;
use super::{
    binomial, bruck, chain, direct, dissemination, halving_doubling, hierarchical,
    recursive_doubling, ring, Algo, Link,
};
use crate::call::{Call, Layout, RawBuf};
use crate::descriptor::OpKind;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// What an entry needs besides the call and the link.
pub struct Context<'a> {
    pub algo: Algo,
    /// This rank's host and cross-host groups, when the job has the shape
    /// for hierarchical collectives.
    pub layers: Option<&'a Layers>,
}

/// One kind of collective.
pub struct Entry {
    pub kind: OpKind,
    /// The algorithms that can run it, default first.
    pub algorithms: &'static [Algo],
    /// The bytes its algorithm is chosen by.
    pub bytes: fn(&Call) -> usize,
    /// Runs a call of this kind.
    ///
    /// # Safety
    /// The call's buffers valid as its constructor describes, and not used
    /// by anyone else until this returns.
    pub run: unsafe fn(&mut Link<'_>, &Call, &Context<'_>) -> Result<()>,
}

/// Every collective, one entry each.
pub static TABLE: &[Entry] = &[
    Entry {
        kind: OpKind::AllReduce,
        algorithms: &[
            Algo::Ring,
            Algo::RecursiveDoubling,
            Algo::HalvingDoubling,
            Algo::Hierarchical,
        ],
        bytes: recv_bytes,
        run: allreduce,
    },
    Entry {
        kind: OpKind::Broadcast,
        algorithms: &[Algo::Binomial, Algo::Chain, Algo::Hierarchical],
        bytes: recv_bytes,
        run: broadcast,
    },
    Entry {
        kind: OpKind::Reduce,
        algorithms: &[Algo::Binomial, Algo::Chain, Algo::Hierarchical],
        bytes: send_bytes,
        run: reduce,
    },
    Entry {
        kind: OpKind::AllGather,
        algorithms: &[Algo::Ring, Algo::Bruck, Algo::Hierarchical],
        bytes: recv_bytes,
        run: allgather,
    },
    Entry {
        kind: OpKind::ReduceScatter,
        algorithms: &[Algo::Ring, Algo::Hierarchical],
        bytes: send_bytes,
        run: reduce_scatter,
    },
    Entry {
        kind: OpKind::Gather,
        algorithms: &[Algo::Direct],
        bytes: send_bytes,
        run: gather,
    },
    Entry {
        kind: OpKind::Scatter,
        algorithms: &[Algo::Direct],
        bytes: recv_bytes,
        run: scatter,
    },
    Entry {
        kind: OpKind::AllToAll,
        algorithms: &[Algo::Direct],
        bytes: send_bytes,
        run: alltoall,
    },
    Entry {
        kind: OpKind::AllGatherV,
        algorithms: &[Algo::Direct],
        bytes: recv_bytes,
        run: allgatherv,
    },
    Entry {
        kind: OpKind::AllToAllV,
        algorithms: &[Algo::Direct],
        bytes: recv_bytes,
        run: alltoallv,
    },
    Entry {
        kind: OpKind::Barrier,
        algorithms: &[Algo::Dissemination, Algo::Hierarchical],
        bytes: |_| 0,
        run: barrier,
    },
];

/// The entry of collective `kind`.
pub fn entry(kind: OpKind) -> Result<&'static Entry> {
    TABLE
        .iter()
        .find(|e| e.kind == kind)
        .ok_or_else(|| Error::internal(format!("{} is not a collective", kind.name())))
}

fn send_bytes(call: &Call) -> usize {
    call.buffers()[0].0.len()
}

fn recv_bytes(call: &Call) -> usize {
    call.buffers()[1].0.len()
}

/// Copies `len` bytes between possibly overlapping caller buffers.
///
/// # Safety
/// Both must be valid for `len` bytes.
unsafe fn move_bytes(from: &RawBuf, to_addr: usize, len: usize) {
    // SAFETY: as the caller promises.
    unsafe { crate::copy::move_bytes(to_addr as *mut u8, from.addr() as *const u8, len) }
}

/// Bool results are 0 or 1 whatever bytes came in (a world of one, or a
/// reduction that only copied, passes them through otherwise).
fn normalize(buf: &mut [u8], dtype: DType) {
    if dtype == DType::Bool {
        buf.iter_mut().for_each(|b| *b = u8::from(*b != 0));
    }
}

/// A call's input, copied out when it overlaps the output (in place).
///
/// # Safety
/// As `Entry::run`.
unsafe fn input_apart<'a>(send: &RawBuf, recv: &RawBuf, copy: &'a mut Vec<u8>) -> &'a [u8] {
    if send.overlaps(recv) {
        *copy = send.bytes().to_vec();
        copy
    } else {
        send.bytes()
    }
}

unsafe fn allreduce(link: &mut Link<'_>, call: &Call, ctx: &Context<'_>) -> Result<()> {
    let Call::AllReduce {
        send,
        recv,
        data,
        op,
    } = *call
    else {
        return Err(Error::internal("allreduce entry for another call"));
    };
    move_bytes(&send, recv.addr(), recv.len());
    let buf = recv.bytes_mut();
    match (ctx.algo, ctx.layers) {
        (Algo::RecursiveDoubling, _) => recursive_doubling::allreduce(link, buf, data.dtype, op),
        (Algo::HalvingDoubling, _) => halving_doubling::allreduce(link, buf, data.dtype, op),
        (Algo::Hierarchical, Some(layers)) => {
            hierarchical::allreduce(link, buf, data.dtype, op, layers)
        }
        // Hierarchical forced where the job has no layers: every rank sees
        // the same roster, so every rank falls back alike.
        _ => ring::allreduce(link, buf, data.dtype, op),
    }?;
    normalize(buf, data.dtype);
    Ok(())
}

unsafe fn broadcast(link: &mut Link<'_>, call: &Call, ctx: &Context<'_>) -> Result<()> {
    let Call::Broadcast {
        send, recv, root, ..
    } = *call
    else {
        return Err(Error::internal("broadcast entry for another call"));
    };
    if link.rank() == root {
        move_bytes(&send, recv.addr(), recv.len());
    }
    let buf = recv.bytes_mut();
    match (ctx.algo, ctx.layers) {
        (Algo::Hierarchical, Some(layers)) => hierarchical::broadcast(link, buf, root, layers),
        (Algo::Chain, _) => chain::broadcast(link, buf, root),
        _ => binomial::broadcast(link, buf, root),
    }
}

unsafe fn reduce(link: &mut Link<'_>, call: &Call, ctx: &Context<'_>) -> Result<()> {
    let Call::Reduce {
        send,
        recv,
        data,
        op,
        root,
    } = *call
    else {
        return Err(Error::internal("reduce entry for another call"));
    };
    let run = |link: &mut Link<'_>, acc: &mut [u8]| match (ctx.algo, ctx.layers) {
        (Algo::Hierarchical, Some(layers)) => {
            hierarchical::reduce(link, acc, data.dtype, op, root, layers)
        }
        (Algo::Chain, _) => chain::reduce(link, acc, data.dtype, op, root),
        _ => binomial::reduce(link, acc, data.dtype, op, root),
    };
    if link.rank() == root {
        move_bytes(&send, recv.addr(), recv.len());
        let buf = recv.bytes_mut();
        run(link, buf)?;
        normalize(buf, data.dtype);
        Ok(())
    } else {
        // Other ranks' buffers are not written: they reduce into a copy.
        let mut acc = send.bytes().to_vec();
        run(link, &mut acc)
    }
}

unsafe fn allgather(link: &mut Link<'_>, call: &Call, ctx: &Context<'_>) -> Result<()> {
    let Call::AllGather { send, recv, .. } = *call else {
        return Err(Error::internal("allgather entry for another call"));
    };
    let bb = send.len();
    match (ctx.algo, ctx.layers) {
        (Algo::Hierarchical, Some(layers)) => {
            move_bytes(&send, recv.addr() + link.rank() * bb, bb);
            hierarchical::allgather(link, recv.bytes_mut(), bb, layers)
        }
        (Algo::Bruck, _) => {
            move_bytes(&send, recv.addr() + link.rank() * bb, bb);
            bruck::allgather(link, recv.bytes_mut(), bb)
        }
        _ if !send.overlaps(&recv) => ring::allgather_from(link, send.bytes(), recv.bytes_mut()),
        _ => {
            move_bytes(&send, recv.addr() + link.rank() * bb, bb);
            ring::allgather(link, recv.bytes_mut(), bb)
        }
    }
}

unsafe fn reduce_scatter(link: &mut Link<'_>, call: &Call, ctx: &Context<'_>) -> Result<()> {
    let Call::ReduceScatter {
        send,
        recv,
        data,
        op,
    } = *call
    else {
        return Err(Error::internal("reduce_scatter entry for another call"));
    };
    let mut copy = Vec::new();
    let input = input_apart(&send, &recv, &mut copy);
    let out = recv.bytes_mut();
    match (ctx.algo, ctx.layers) {
        (Algo::Hierarchical, Some(layers)) => {
            hierarchical::reduce_scatter(link, input, out, data.dtype, op, layers)
        }
        _ => ring::reduce_scatter(link, input, out, data.dtype, op),
    }?;
    normalize(out, data.dtype);
    Ok(())
}

unsafe fn gather(link: &mut Link<'_>, call: &Call, _: &Context<'_>) -> Result<()> {
    let Call::Gather {
        send, recv, root, ..
    } = *call
    else {
        return Err(Error::internal("gather entry for another call"));
    };
    let bb = send.len();
    if link.rank() == root {
        move_bytes(&send, recv.addr() + root * bb, bb);
        direct::gather_at_root(link, recv.bytes_mut(), bb)
    } else {
        link.send(root, send.bytes())
    }
}

unsafe fn scatter(link: &mut Link<'_>, call: &Call, _: &Context<'_>) -> Result<()> {
    let Call::Scatter {
        send, recv, root, ..
    } = *call
    else {
        return Err(Error::internal("scatter entry for another call"));
    };
    let bb = recv.len();
    if link.rank() != root {
        return link.recv(root, recv.bytes_mut());
    }
    let own = RawBuf::new((send.addr() + root * bb) as *const u8, bb);
    if own.overlaps(&recv) && own.addr() != recv.addr() {
        // Send the other blocks before the own block is moved over them.
        let copy = send.bytes().to_vec();
        direct::scatter_from_root(link, &copy, bb)?;
        move_bytes(
            &RawBuf::of(&copy[root * bb..(root + 1) * bb]),
            recv.addr(),
            bb,
        );
        return Ok(());
    }
    let sent = direct::scatter_from_root(link, send.bytes(), bb);
    move_bytes(&own, recv.addr(), bb);
    sent
}

unsafe fn alltoall(link: &mut Link<'_>, call: &Call, _: &Context<'_>) -> Result<()> {
    let Call::AllToAll { send, recv, .. } = *call else {
        return Err(Error::internal("alltoall entry for another call"));
    };
    let mut copy = Vec::new();
    let input = input_apart(&send, &recv, &mut copy);
    let bb = recv.len() / link.size();
    direct::alltoall(link, input, recv.bytes_mut(), bb)
}

/// The receive blocks of an uneven collective, as disjoint slices of
/// `buf` (blocks may come in any order; overlapping ones are refused).
fn split_blocks<'a>(
    buf: &'a mut [u8],
    layout: &Layout,
    es: usize,
    size: usize,
) -> Result<Vec<&'a mut [u8]>> {
    let mut order: Vec<usize> = (0..size).collect();
    order.sort_by_key(|r| layout.displ(*r));
    let mut out: Vec<Option<&'a mut [u8]>> = (0..size).map(|_| None).collect();
    let mut rest = buf;
    let mut at = 0usize;
    for r in order {
        let (start, len) = (layout.displ(r) * es, layout.count(r) * es);
        if start < at && len > 0 {
            return Err(Error::invalid_argument(format!(
                "the receive block of rank {r} overlaps another one (displacement {})",
                layout.displ(r)
            )));
        }
        let skip = start.saturating_sub(at);
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(skip.min(tail.len()));
        let (block, tail) = tail.split_at_mut(len);
        out[r] = Some(block);
        rest = tail;
        at = at.max(start + len);
    }
    Ok(out.into_iter().map(|b| b.expect("every rank")).collect())
}

unsafe fn allgatherv(link: &mut Link<'_>, call: &Call, _: &Context<'_>) -> Result<()> {
    let Call::AllGatherV {
        send,
        recv,
        dtype,
        layout,
    } = *call
    else {
        return Err(Error::internal("allgatherv entry for another call"));
    };
    let (rank, size, es) = (link.rank(), link.size(), dtype.size());
    // This rank's block goes to every rank: into its own place in recvbuf
    // (unless sendbuf is that place), and to the others from sendbuf when
    // it lies apart (as ring::allgather_from, for the same reason).
    move_bytes(&send, recv.addr() + layout.displ(rank) * es, send.len());
    let mut blocks: Vec<Option<&mut [u8]>> = split_blocks(recv.bytes_mut(), &layout, es, size)?
        .into_iter()
        .map(Some)
        .collect();
    let placed: &[u8] = blocks[rank].take().expect("own block");
    let own = if send.overlaps(&recv) {
        placed
    } else {
        send.bytes()
    };
    let sends: Vec<&[u8]> = vec![own; size];
    direct::exchange_v(link, &sends, blocks, es)
}

unsafe fn alltoallv(link: &mut Link<'_>, call: &Call, _: &Context<'_>) -> Result<()> {
    let Call::AllToAllV {
        send,
        recv,
        dtype,
        send_layout,
        recv_layout,
    } = *call
    else {
        return Err(Error::internal("alltoallv entry for another call"));
    };
    let (size, es) = (link.size(), dtype.size());
    // In place: the send side is copied out first.
    let mut copy = Vec::new();
    let input = input_apart(&send, &recv, &mut copy);
    let sends: Vec<&[u8]> = (0..size)
        .map(|r| {
            let at = send_layout.displ(r) * es;
            &input[at..at + send_layout.count(r) * es]
        })
        .collect();
    let blocks = split_blocks(recv.bytes_mut(), &recv_layout, es, size)?
        .into_iter()
        .map(Some)
        .collect();
    direct::exchange_v(link, &sends, blocks, es)
}

unsafe fn barrier(link: &mut Link<'_>, _: &Call, ctx: &Context<'_>) -> Result<()> {
    match (ctx.algo, ctx.layers) {
        (Algo::Hierarchical, Some(layers)) => hierarchical::barrier(link, layers),
        _ => dissemination::barrier(link),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every collective kind has exactly one entry, and its default
    /// algorithm comes first.
    #[test]
    fn every_collective_has_one_entry() {
        let collectives = [
            OpKind::AllReduce,
            OpKind::Broadcast,
            OpKind::Reduce,
            OpKind::AllGather,
            OpKind::ReduceScatter,
            OpKind::Gather,
            OpKind::Scatter,
            OpKind::AllToAll,
            OpKind::AllGatherV,
            OpKind::AllToAllV,
            OpKind::Barrier,
        ];
        for kind in collectives {
            assert_eq!(
                TABLE.iter().filter(|e| e.kind == kind).count(),
                1,
                "{kind:?}"
            );
            assert!(!entry(kind).unwrap().algorithms.is_empty());
        }
        assert_eq!(TABLE.len(), collectives.len());
        assert!(entry(OpKind::Send).is_err());
    }
}
