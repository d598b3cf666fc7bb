//! One call as the caller made it: the operation, its buffers (raw, so that
//! non-blocking calls can carry them to another thread) and parameters.
//! Constructors validate everything that can be checked locally.

use crate::descriptor::{Desc, OpKind};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;

/// A caller's buffer: address and length in bytes. Whoever makes a `Call`
/// from raw pointers promises they stay valid until the call completes.
#[derive(Clone, Copy, Debug)]
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a RawBuf is only dereferenced while the call that owns it runs,
// and the caller guarantees exclusive use of the buffer until then.
unsafe impl Send for RawBuf {}

impl RawBuf {
    pub const EMPTY: RawBuf = RawBuf {
        ptr: std::ptr::null_mut(),
        len: 0,
    };

    pub fn new(ptr: *const u8, len: usize) -> RawBuf {
        RawBuf {
            ptr: ptr as *mut u8,
            len,
        }
    }

    pub fn of(s: &[u8]) -> RawBuf {
        RawBuf::new(s.as_ptr(), s.len())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// # Safety
    /// The buffer must be valid for reads of `len` bytes for `'a`.
    pub unsafe fn bytes<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.ptr, self.len)
        }
    }

    /// # Safety
    /// The buffer must be valid for writes of `len` bytes for `'a`, and not
    /// otherwise borrowed.
    pub unsafe fn bytes_mut<'a>(&self) -> &'a mut [u8] {
        if self.len == 0 {
            &mut []
        } else {
            std::slice::from_raw_parts_mut(self.ptr, self.len)
        }
    }

    /// Whether the two byte ranges share any byte.
    pub fn overlaps(&self, other: &RawBuf) -> bool {
        self.len > 0
            && other.len > 0
            && self.addr() < other.addr() + other.len
            && other.addr() < self.addr() + self.len
    }
}

/// Per-rank element counts and displacements of an uneven collective:
/// `size` counts, then `size` displacements, in an array that whoever made
/// the call keeps alive until it completes (the caller's for a blocking
/// call; the request's for a non-blocking one).
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    ptr: *const usize,
    size: usize,
}

// SAFETY: as RawBuf: only read while the call that owns it runs.
unsafe impl Send for Layout {}

impl Layout {
    /// # Safety
    /// `counts_and_displs` (2 * size entries) outlives every use.
    pub unsafe fn new(counts_and_displs: &[usize]) -> Layout {
        Layout {
            ptr: counts_and_displs.as_ptr(),
            size: counts_and_displs.len() / 2,
        }
    }

    fn all(&self) -> &[usize] {
        // SAFETY: the maker keeps the array alive until the call completes.
        unsafe { std::slice::from_raw_parts(self.ptr, 2 * self.size) }
    }

    pub fn count(&self, rank: usize) -> usize {
        self.all()[rank]
    }

    pub fn displ(&self, rank: usize) -> usize {
        self.all()[self.size + rank]
    }

    /// Checks counts and displacements and returns the elements the
    /// buffer must hold (the furthest end of a block).
    pub fn extent(&self, what: &str) -> Result<usize> {
        let mut end = 0usize;
        for r in 0..self.size {
            let e = self.displ(r).checked_add(self.count(r)).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "{what}: displacement {} + count {} of rank {r} overflows size_t",
                    self.displ(r),
                    self.count(r)
                ))
            })?;
            end = end.max(e);
        }
        Ok(end)
    }

    /// Refuses blocks that overlap (`what` names the arrays): they are
    /// receive blocks, each written by its rank's data. Checked before
    /// the call touches any memory.
    pub fn check_disjoint(&self, what: &str) -> Result<()> {
        let mut order: Vec<usize> = (0..self.size).filter(|&r| self.count(r) > 0).collect();
        order.sort_by_key(|&r| self.displ(r));
        for w in order.windows(2) {
            let (a, b) = (w[0], w[1]);
            // `extent` has checked that the ends do not overflow.
            if self.displ(b) < self.displ(a) + self.count(a) {
                return Err(Error::invalid_argument(format!(
                    "{what}: the receive block of rank {b} (displacement {}, count {}) overlaps \
                     that of rank {a} (displacement {}, count {})",
                    self.displ(b),
                    self.count(b),
                    self.displ(a),
                    self.count(a)
                )));
            }
        }
        Ok(())
    }
}

/// Element count and type of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Data {
    pub count: usize,
    pub dtype: DType,
}

#[derive(Clone, Copy, Debug)]
pub enum Call {
    AllReduce {
        send: RawBuf,
        recv: RawBuf,
        data: Data,
        op: ReduceOp,
    },
    Broadcast {
        send: RawBuf,
        recv: RawBuf,
        data: Data,
        root: usize,
    },
    Reduce {
        send: RawBuf,
        recv: RawBuf,
        data: Data,
        op: ReduceOp,
        root: usize,
    },
    AllGather {
        send: RawBuf,
        recv: RawBuf,
        data: Data,
    },
    ReduceScatter {
        send: RawBuf,
        recv: RawBuf,
        data: Data,
        op: ReduceOp,
    },
    Gather {
        send: RawBuf,
        recv: RawBuf,
        data: Data,
        root: usize,
    },
    Scatter {
        send: RawBuf,
        recv: RawBuf,
        data: Data,
        root: usize,
    },
    AllToAll {
        send: RawBuf,
        recv: RawBuf,
        data: Data,
    },
    /// Rank i's `send` lands at `layout.displ(i)`, `layout.count(i)`
    /// elements (the same layout on every rank).
    AllGatherV {
        send: RawBuf,
        recv: RawBuf,
        dtype: DType,
        layout: Layout,
    },
    /// `send_layout` block j goes to rank j; `recv_layout` block i comes
    /// from rank i. With `send == recv` (in place) the receive layout
    /// describes both.
    AllToAllV {
        send: RawBuf,
        recv: RawBuf,
        dtype: DType,
        send_layout: Layout,
        recv_layout: Layout,
    },
    Barrier,
    Send {
        buf: RawBuf,
        data: Data,
        peer: usize,
    },
    Recv {
        buf: RawBuf,
        data: Data,
        peer: usize,
    },
}

/// Checks a rank argument against the group size.
pub fn check_rank(what: &str, value: i64, size: usize) -> Result<usize> {
    if value < 0 || value as u64 >= size as u64 {
        return Err(Error::invalid_argument(format!(
            "{what} {value} is out of range (the communicator has ranks 0..{})",
            size.saturating_sub(1)
        )));
    }
    Ok(value as usize)
}

/// A buffer of `count` elements times `blocks`, checked for NULL and overflow.
fn buffer(name: &str, ptr: *const u8, data: Data, blocks: usize) -> Result<RawBuf> {
    let elems = data.count.checked_mul(blocks).ok_or_else(|| {
        Error::invalid_argument(format!(
            "{name}: {} blocks of {} elements overflow size_t",
            blocks, data.count
        ))
    })?;
    let len = data.dtype.bytes(elems).map_err(|e| e.context(name))?;
    if len > isize::MAX as usize {
        return Err(Error::invalid_argument(format!(
            "{name}: {len} bytes is too large"
        )));
    }
    if ptr.is_null() && len > 0 {
        return Err(Error::invalid_argument(format!(
            "{name} is NULL but {elems} elements of {} were given",
            data.dtype
        )));
    }
    Ok(RawBuf::new(ptr, len))
}

impl Call {
    /// Builds a call from raw arguments as the C API receives them;
    /// `size`/`rank` are the communicator's. Everything checkable without
    /// the other ranks is checked here.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: OpKind,
        send: *const u8,
        recv: *mut u8,
        data: Data,
        op: ReduceOp,
        root: i64,
        rank: usize,
        size: usize,
    ) -> Result<Call> {
        if matches!(
            kind,
            OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter
        ) {
            op.check(data.dtype)?;
        }
        let one = |name: &str, p: *const u8| buffer(name, p, data, 1);
        let all = |name: &str, p: *const u8| buffer(name, p, data, size);
        let root_rank = || check_rank("root", root, size);
        Ok(match kind {
            OpKind::AllReduce => Call::AllReduce {
                send: one("sendbuf", send)?,
                recv: one("recvbuf", recv)?,
                data,
                op,
            },
            OpKind::Broadcast => {
                let root = root_rank()?;
                let send = if rank == root {
                    one("sendbuf", send)?
                } else {
                    RawBuf::EMPTY
                };
                Call::Broadcast {
                    send,
                    recv: one("recvbuf", recv)?,
                    data,
                    root,
                }
            }
            OpKind::Reduce => {
                let root = root_rank()?;
                let recv = if rank == root {
                    one("recvbuf", recv)?
                } else {
                    RawBuf::EMPTY
                };
                Call::Reduce {
                    send: one("sendbuf", send)?,
                    recv,
                    data,
                    op,
                    root,
                }
            }
            OpKind::AllGather => Call::AllGather {
                send: one("sendbuf", send)?,
                recv: all("recvbuf", recv)?,
                data,
            },
            OpKind::ReduceScatter => Call::ReduceScatter {
                send: all("sendbuf", send)?,
                recv: one("recvbuf", recv)?,
                data,
                op,
            },
            OpKind::Gather => {
                let root = root_rank()?;
                let recv = if rank == root {
                    all("recvbuf", recv)?
                } else {
                    RawBuf::EMPTY
                };
                Call::Gather {
                    send: one("sendbuf", send)?,
                    recv,
                    data,
                    root,
                }
            }
            OpKind::Scatter => {
                let root = root_rank()?;
                let send = if rank == root {
                    all("sendbuf", send)?
                } else {
                    RawBuf::EMPTY
                };
                Call::Scatter {
                    send,
                    recv: one("recvbuf", recv)?,
                    data,
                    root,
                }
            }
            OpKind::AllToAll => Call::AllToAll {
                send: all("sendbuf", send)?,
                recv: all("recvbuf", recv)?,
                data,
            },
            OpKind::Barrier => Call::Barrier,
            OpKind::Send => Call::Send {
                buf: one("buf", send)?,
                data,
                peer: check_rank("peer", root, size)?,
            },
            OpKind::Split => return Err(Error::internal("comm_split is not a data call")),
            OpKind::AllGatherV | OpKind::AllToAllV => {
                return Err(Error::internal(
                    "uneven collectives are made with Call::uneven",
                ))
            }
        })
    }

    /// An uneven collective (`OpKind::AllGatherV` or `AllToAllV`) from raw
    /// arguments: `send_layout` is ignored for allgatherv (its count is
    /// `send_count`) and for in-place alltoallv. Counts, displacements and
    /// buffer extents are checked here.
    ///
    /// # Safety
    /// The layouts' arrays outlive the call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn uneven(
        kind: OpKind,
        send: *const u8,
        send_count: usize,
        send_layout: Layout,
        recv: *mut u8,
        recv_layout: Layout,
        dtype: DType,
        rank: usize,
    ) -> Result<Call> {
        let buf = |name: &str, p: *const u8, elems: usize| {
            buffer(
                name,
                p,
                Data {
                    count: elems,
                    dtype,
                },
                1,
            )
        };
        // The arrays as the C calls name them.
        let recv_arrays = match kind {
            OpKind::AllGatherV => "recvcounts/displs",
            _ => "recvcounts/rdispls",
        };
        let recv_buf = buf("recvbuf", recv, recv_layout.extent(recv_arrays)?)?;
        recv_layout.check_disjoint(recv_arrays)?;
        match kind {
            OpKind::AllGatherV => {
                let own = recv_layout.count(rank);
                if send_count != own {
                    return Err(Error::invalid_argument(format!(
                        "sendcount {send_count} differs from recvcounts[{rank}] = {own} (this rank's own block)"
                    )));
                }
                Ok(Call::AllGatherV {
                    send: buf("sendbuf", send, send_count)?,
                    recv: recv_buf,
                    dtype,
                    layout: recv_layout,
                })
            }
            OpKind::AllToAllV => {
                let in_place = std::ptr::eq(send, recv);
                let send_layout = if in_place { recv_layout } else { send_layout };
                let send_buf = if in_place {
                    recv_buf
                } else {
                    buf("sendbuf", send, send_layout.extent("sendcounts/sdispls")?)?
                };
                let (sent, received) = (send_layout.count(rank), recv_layout.count(rank));
                if sent != received {
                    return Err(Error::invalid_argument(format!(
                        "sendcounts[{rank}] = {sent} differs from recvcounts[{rank}] = {received} \
                         (the block this rank sends itself)"
                    )));
                }
                Ok(Call::AllToAllV {
                    send: send_buf,
                    recv: recv_buf,
                    dtype,
                    send_layout,
                    recv_layout,
                })
            }
            _ => Err(Error::internal("not an uneven collective")),
        }
    }

    /// A receive (the one call whose single buffer is written).
    pub fn recv(buf: *mut u8, data: Data, peer: i64, size: usize) -> Result<Call> {
        Ok(Call::Recv {
            buf: buffer("buf", buf, data, 1)?,
            data,
            peer: check_rank("peer", peer, size)?,
        })
    }

    /// Whether NCCL can run this call (reductions NCCL lacks run on the
    /// sockets, device buffers staged).
    pub fn nccl_can(&self) -> bool {
        match *self {
            Call::AllReduce { data, op, .. }
            | Call::Reduce { data, op, .. }
            | Call::ReduceScatter { data, op, .. } => op.nccl_can(data.dtype),
            // Not on NCCL yet: device buffers are staged to the sockets.
            Call::AllGatherV { .. } | Call::AllToAllV { .. } => false,
            _ => true,
        }
    }

    pub fn is_p2p(&self) -> bool {
        matches!(self, Call::Send { .. } | Call::Recv { .. })
    }

    /// Bytes this rank hands to the call (its send side; receive for recv).
    pub fn bytes(&self) -> usize {
        match self {
            Call::AllReduce { send, .. }
            | Call::Reduce { send, .. }
            | Call::AllGather { send, .. }
            | Call::ReduceScatter { send, .. }
            | Call::Gather { send, .. }
            | Call::AllToAll { send, .. }
            | Call::AllGatherV { send, .. }
            | Call::AllToAllV { send, .. } => send.len(),
            Call::Broadcast { recv, .. } | Call::Scatter { recv, .. } => recv.len(),
            Call::Barrier => 0,
            Call::Send { buf, .. } | Call::Recv { buf, .. } => buf.len(),
        }
    }

    /// The call's buffers, each with whether the call reads it (`true`) or
    /// writes it (`false`).
    pub fn buffers(&self) -> [(RawBuf, bool); 2] {
        match *self {
            Call::AllReduce { send, recv, .. }
            | Call::Broadcast { send, recv, .. }
            | Call::Reduce { send, recv, .. }
            | Call::AllGather { send, recv, .. }
            | Call::ReduceScatter { send, recv, .. }
            | Call::Gather { send, recv, .. }
            | Call::Scatter { send, recv, .. }
            | Call::AllToAll { send, recv, .. }
            | Call::AllGatherV { send, recv, .. }
            | Call::AllToAllV { send, recv, .. } => [(send, true), (recv, false)],
            Call::Barrier => [(RawBuf::EMPTY, true), (RawBuf::EMPTY, false)],
            Call::Send { buf, .. } => [(buf, true), (RawBuf::EMPTY, false)],
            Call::Recv { buf, .. } => [(RawBuf::EMPTY, true), (buf, false)],
        }
    }

    /// The same call on other buffers: `f` maps each buffer (with whether
    /// it is read) to its replacement.
    pub fn with_buffers(&self, mut f: impl FnMut(RawBuf, bool) -> RawBuf) -> Call {
        let mut c = *self;
        match &mut c {
            Call::AllReduce { send, recv, .. }
            | Call::Broadcast { send, recv, .. }
            | Call::Reduce { send, recv, .. }
            | Call::AllGather { send, recv, .. }
            | Call::ReduceScatter { send, recv, .. }
            | Call::Gather { send, recv, .. }
            | Call::Scatter { send, recv, .. }
            | Call::AllToAll { send, recv, .. }
            | Call::AllGatherV { send, recv, .. }
            | Call::AllToAllV { send, recv, .. } => {
                *send = f(*send, true);
                *recv = f(*recv, false);
            }
            Call::Barrier => {}
            Call::Send { buf, .. } => *buf = f(*buf, true),
            Call::Recv { buf, .. } => *buf = f(*buf, false),
        }
        c
    }

    /// The C function name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Call::AllReduce { .. } => "allreduce",
            Call::Broadcast { .. } => "broadcast",
            Call::Reduce { .. } => "reduce",
            Call::AllGather { .. } => "allgather",
            Call::ReduceScatter { .. } => "reduce_scatter",
            Call::Gather { .. } => "gather",
            Call::Scatter { .. } => "scatter",
            Call::AllToAll { .. } => "alltoall",
            Call::AllGatherV { .. } => "allgatherv",
            Call::AllToAllV { .. } => "alltoallv",
            Call::Barrier => "barrier",
            Call::Send { .. } => "send",
            Call::Recv { .. } => "recv",
        }
    }

    /// The call as the ranks compare it, as number `seq` (the backend
    /// labels the algorithm on top). Sends and receives carry their data
    /// only: their root (the sender) is the caller's to set.
    pub fn desc(&self, seq: u64) -> Desc {
        let d = Desc::new(self.op_kind(), seq);
        match *self {
            Call::AllReduce { data, op, .. } | Call::ReduceScatter { data, op, .. } => {
                d.data(data.count, data.dtype).reduction(op)
            }
            Call::Reduce { data, op, root, .. } => {
                d.data(data.count, data.dtype).reduction(op).root(root)
            }
            Call::Broadcast { data, root, .. }
            | Call::Gather { data, root, .. }
            | Call::Scatter { data, root, .. } => d.data(data.count, data.dtype).root(root),
            Call::AllGather { data, .. }
            | Call::AllToAll { data, .. }
            | Call::Send { data, .. }
            | Call::Recv { data, .. } => d.data(data.count, data.dtype),
            Call::AllGatherV { dtype, .. } | Call::AllToAllV { dtype, .. } => d.data(0, dtype),
            Call::Barrier => d,
        }
    }

    /// Its kind as the ranks compare it (sends and receives are one kind).
    pub fn op_kind(&self) -> OpKind {
        match self {
            Call::AllReduce { .. } => OpKind::AllReduce,
            Call::Broadcast { .. } => OpKind::Broadcast,
            Call::Reduce { .. } => OpKind::Reduce,
            Call::AllGather { .. } => OpKind::AllGather,
            Call::ReduceScatter { .. } => OpKind::ReduceScatter,
            Call::Gather { .. } => OpKind::Gather,
            Call::Scatter { .. } => OpKind::Scatter,
            Call::AllToAll { .. } => OpKind::AllToAll,
            Call::AllGatherV { .. } => OpKind::AllGatherV,
            Call::AllToAllV { .. } => OpKind::AllToAllV,
            Call::Barrier => OpKind::Barrier,
            Call::Send { .. } | Call::Recv { .. } => OpKind::Send,
        }
    }
}
