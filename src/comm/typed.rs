//! The typed, safe Rust API on `Comm`: slices in, results in slices out.
//! Lengths are checked here; everything then runs through `Call`.

use super::group;
use super::Comm;
use crate::call::{Call, Data, Layout, RawBuf};
use crate::descriptor::OpKind;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::transport::tagged::Status;

/// Counts, then the displacements of blocks packed in rank order.
fn packed_layout(counts: &[usize], size: usize, what: &str) -> Result<Vec<usize>> {
    need(what, counts.len(), size)?;
    let mut v = counts.to_vec();
    let mut at = 0usize;
    for c in counts {
        v.push(at);
        at = at
            .checked_add(*c)
            .ok_or_else(|| Error::invalid_argument(format!("{what} overflow size_t")))?;
    }
    Ok(v)
}

fn need(what: &str, have: usize, want: usize) -> Result<()> {
    if have != want {
        return Err(Error::invalid_argument(format!(
            "{what} has {have} elements, expected {want}"
        )));
    }
    Ok(())
}

impl Comm {
    fn typed<T: Element>(
        &self,
        kind: OpKind,
        send: &[T],
        recv: &mut [T],
        count: usize,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let (s, r) = (as_bytes(send).as_ptr(), as_bytes_mut(recv).as_mut_ptr());
        self.typed_raw::<T>(kind, s, r, count, op, root)
    }

    /// `send`/`recv` point into slices the callers hold for the whole call
    /// (equal for in-place calls), with lengths they checked.
    fn typed_raw<T: Element>(
        &self,
        kind: OpKind,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        if group::active() {
            return Err(Error::invalid_usage(
                "the safe Rust API cannot be used inside a group (its borrows end before the group does)",
            ));
        }
        let data = Data {
            count,
            dtype: T::DTYPE,
        };
        let call = Call::new(
            kind,
            send,
            recv,
            data,
            op,
            root as i64,
            self.rank(),
            self.size(),
        )?;
        // SAFETY: the buffers outlive this blocking call, and the lengths
        // checked by the callers cover what `call` touches.
        unsafe { self.run(call) }
    }

    /// In-place allreduce of `buf` across all ranks.
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let p = as_bytes_mut(buf).as_mut_ptr();
        self.typed_raw::<T>(OpKind::AllReduce, p, p, buf.len(), op, 0)
    }

    /// Out-of-place allreduce: `recv` = reduction of every rank's `send`.
    pub fn allreduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        need("recv", recv.len(), send.len())?;
        self.typed(OpKind::AllReduce, send, recv, send.len(), op, 0)
    }

    /// `buf` on `root` is copied into `buf` on every rank.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let p = as_bytes_mut(buf).as_mut_ptr();
        self.typed_raw::<T>(OpKind::Broadcast, p, p, buf.len(), ReduceOp::Sum, root)
    }

    /// `recv` on `root` = reduction of every rank's `send` (`recv` is
    /// ignored elsewhere and may be empty).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        if self.rank() == root {
            need("recv", recv.len(), send.len())?;
        }
        self.typed(OpKind::Reduce, send, recv, send.len(), op, root)
    }

    /// `recv` (size × send.len()) = every rank's `send`, rank-major.
    pub fn allgather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        need("recv", recv.len(), send.len() * self.size())?;
        self.typed(OpKind::AllGather, send, recv, send.len(), ReduceOp::Sum, 0)
    }

    /// `recv` = block `rank` of the reduction of every rank's `send`
    /// (size × recv.len() elements).
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        need("send", send.len(), recv.len() * self.size())?;
        let n = recv.len();
        self.typed(OpKind::ReduceScatter, send, recv, n, op, 0)
    }

    /// `recv` on `root` (size × send.len()) = every rank's `send`.
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        if self.rank() == root {
            need("recv", recv.len(), send.len() * self.size())?;
        }
        self.typed(OpKind::Gather, send, recv, send.len(), ReduceOp::Sum, root)
    }

    /// Block r of `send` on `root` (size × recv.len()) goes to rank r's `recv`.
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        if self.rank() == root {
            need("send", send.len(), recv.len() * self.size())?;
        }
        let n = recv.len();
        self.typed(OpKind::Scatter, send, recv, n, ReduceOp::Sum, root)
    }

    /// Block j of `send` goes to rank j; block i of `recv` comes from rank i.
    pub fn alltoall<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        need("recv", recv.len(), send.len())?;
        if !send.len().is_multiple_of(self.size()) {
            return Err(Error::invalid_argument(format!(
                "alltoall buffers of {} elements do not split into {} blocks",
                send.len(),
                self.size()
            )));
        }
        let n = send.len() / self.size();
        self.typed(OpKind::AllToAll, send, recv, n, ReduceOp::Sum, 0)
    }

    pub fn barrier(&self) -> Result<()> {
        self.typed::<u8>(OpKind::Barrier, &[], &mut [], 0, ReduceOp::Sum, 0)
    }

    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.typed(OpKind::Send, buf, &mut [], buf.len(), ReduceOp::Sum, peer)
    }

    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        if group::active() {
            return Err(Error::invalid_usage(
                "the safe Rust API cannot be used inside a group",
            ));
        }
        let data = Data {
            count: buf.len(),
            dtype: T::DTYPE,
        };
        let call = Call::recv(
            as_bytes_mut(buf).as_mut_ptr(),
            data,
            peer as i64,
            self.size(),
        )?;
        // SAFETY: `buf` outlives this blocking call.
        unsafe { self.run(call) }
    }

    /// Allgather with a count per rank: rank i's `send` lands in `recv`
    /// at the sum of the counts before i (`counts[i]` must equal rank i's
    /// `send.len()`); `recv` holds the sum of all counts.
    pub fn allgatherv<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        let layout = packed_layout(counts, self.size(), "counts")?;
        need("recv", recv.len(), counts.iter().sum())?;
        self.typed_p2p_allowed()?;
        let (s, r) = (as_bytes(send).as_ptr(), as_bytes_mut(recv).as_mut_ptr());
        // SAFETY: the slices and `layout` outlive this blocking call.
        unsafe {
            let l = Layout::new(&layout);
            let call = Call::uneven(
                OpKind::AllGatherV,
                s,
                send.len(),
                l,
                r,
                l,
                T::DTYPE,
                self.rank(),
            )?;
            self.run_uneven(call, crate::backend::cuda::Stream::DEFAULT)
        }
    }

    /// Alltoall with a count per rank: `send_counts[j]` elements of `send`
    /// (packed in rank order) go to rank j; `recv_counts[i]` elements from
    /// rank i land in `recv` (packed in rank order).
    pub fn alltoallv<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let sl = packed_layout(send_counts, self.size(), "send_counts")?;
        let rl = packed_layout(recv_counts, self.size(), "recv_counts")?;
        need("send", send.len(), send_counts.iter().sum())?;
        need("recv", recv.len(), recv_counts.iter().sum())?;
        self.typed_p2p_allowed()?;
        let (s, r) = (as_bytes(send).as_ptr(), as_bytes_mut(recv).as_mut_ptr());
        // SAFETY: the slices and layouts outlive this blocking call.
        unsafe {
            let call = Call::uneven(
                OpKind::AllToAllV,
                s,
                0,
                Layout::new(&sl),
                r,
                Layout::new(&rl),
                T::DTYPE,
                self.rank(),
            )?;
            self.run_uneven(call, crate::backend::cuda::Stream::DEFAULT)
        }
    }

    /// Sends `buf` to `peer` with `tag` (>= 0), in the point-to-point
    /// context (matched by source, tag and order, apart from collectives).
    pub fn send_tagged<T: Element>(&self, buf: &[T], peer: usize, tag: i32) -> Result<()> {
        self.typed_p2p_allowed()?;
        let peer = crate::call::check_rank("peer", peer as i64, self.size())?;
        let data = Data {
            count: buf.len(),
            dtype: T::DTYPE,
        };
        // SAFETY: `buf` outlives this blocking call.
        unsafe {
            self.send_message(
                RawBuf::of(as_bytes(buf)),
                data,
                peer,
                tag,
                crate::backend::cuda::Stream::DEFAULT,
            )
        }
    }

    /// Receives the oldest message from `peer` (None: any rank) with `tag`
    /// (None: any tag) into `buf`, which may be longer than the message;
    /// returns who sent what.
    pub fn recv_tagged<T: Element>(
        &self,
        buf: &mut [T],
        peer: Option<usize>,
        tag: Option<i32>,
    ) -> Result<Status> {
        self.typed_p2p_allowed()?;
        if let Some(p) = peer {
            crate::call::check_rank("peer", p as i64, self.size())?;
        }
        let data = Data {
            count: buf.len(),
            dtype: T::DTYPE,
        };
        let bytes = as_bytes_mut(buf);
        // SAFETY: `buf` outlives this blocking call.
        let got = unsafe {
            self.recv_message(
                RawBuf::new(bytes.as_mut_ptr(), bytes.len()),
                data,
                peer,
                tag,
                crate::backend::cuda::Stream::DEFAULT,
            )
        }?;
        got.ok_or_else(|| Error::internal("a blocking receive without a status"))
    }

    fn typed_p2p_allowed(&self) -> Result<()> {
        if group::active() {
            return Err(Error::invalid_usage(
                "the safe Rust API cannot be used inside a group (its borrows end before the group does)",
            ));
        }
        Ok(())
    }

    /// Sends `send` to `to` while receiving `recv` from `from` (one
    /// exchange, so rings and swaps can't deadlock).
    pub fn sendrecv<T: Element>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<()> {
        let size = self.size();
        let s = Call::new(
            OpKind::Send,
            as_bytes(send).as_ptr(),
            std::ptr::null_mut(),
            Data {
                count: send.len(),
                dtype: T::DTYPE,
            },
            ReduceOp::Sum,
            to as i64,
            self.rank(),
            size,
        )?;
        let r = Call::recv(
            as_bytes_mut(recv).as_mut_ptr(),
            Data {
                count: recv.len(),
                dtype: T::DTYPE,
            },
            from as i64,
            size,
        )?;
        group::start();
        // SAFETY: both slices outlive the group, which ends below.
        unsafe {
            let queued = self.run(s).and_then(|_| self.run(r));
            let ended = group::end();
            queued.and(ended)
        }
    }
}
