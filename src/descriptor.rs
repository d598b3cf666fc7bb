//! What an operation is, as the ranks compare it: its kind, element type,
//! reduction, root, sequence number and count. Every frame on the wire
//! carries one, so that ranks which called different things find out.

use crate::dtype::DType;
use crate::reduce::ReduceOp;
use std::fmt;

/// The algorithms' names by wire value (`algorithms::Algo` is the
/// discriminant; 0 is none), kept here so that layers below the
/// algorithms can name them in messages.
const ALGO_NAMES: [&str; 10] = [
    "none",
    "ring",
    "recursive_doubling",
    "binomial",
    "direct",
    "dissemination",
    "chain",
    "halving_doubling",
    "hierarchical",
    "bruck",
];

/// The wire value of the algorithm called `name` in the `algo` option
/// (also its short forms), so that a bad name fails where it is set.
pub fn algo_value(name: &str) -> crate::error::Result<u8> {
    let n = name.trim().to_ascii_lowercase();
    let alias = match n.as_str() {
        "rd" | "doubling" => "recursive_doubling",
        "tree" => "binomial",
        "linear" => "direct",
        "rabenseifner" | "hd" => "halving_doubling",
        "2d" | "hier" => "hierarchical",
        other => other,
    };
    (1..ALGO_NAMES.len())
        .find(|&v| ALGO_NAMES[v] == alias)
        .map(|v| v as u8)
        .ok_or_else(|| {
            crate::error::Error::invalid_argument(format!(
                "unknown algorithm '{name}' (known: {})",
                ALGO_NAMES[1..].join(", ")
            ))
        })
}

/// The name of the algorithm with wire value `v`.
pub fn algo_name(v: u8) -> &'static str {
    ALGO_NAMES.get(usize::from(v)).copied().unwrap_or("unknown")
}

/// The kind of an operation (the wire value is the discriminant).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    AllReduce = 1,
    Broadcast = 2,
    Reduce = 3,
    AllGather = 4,
    ReduceScatter = 5,
    Gather = 6,
    Scatter = 7,
    AllToAll = 8,
    Barrier = 9,
    Send = 10,
    Split = 11,
    AllGatherV = 12,
    AllToAllV = 13,
}

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "allreduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllGather => "allgather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::AllToAll => "alltoall",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send/recv",
            OpKind::Split => "comm_split",
            OpKind::AllGatherV => "allgatherv",
            OpKind::AllToAllV => "alltoallv",
        }
    }

    pub fn from_wire(v: u8) -> Option<OpKind> {
        use OpKind::*;
        [
            AllReduce,
            Broadcast,
            Reduce,
            AllGather,
            ReduceScatter,
            Gather,
            Scatter,
            AllToAll,
            Barrier,
            Send,
            Split,
            AllGatherV,
            AllToAllV,
        ]
        .into_iter()
        .find(|k| *k as u8 == v)
    }

    /// Whether the call has a root (and so ranks that may receive nothing).
    pub fn has_root(self) -> bool {
        matches!(
            self,
            OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter
        )
    }

    /// Whether its receivers combine what they receive.
    pub fn has_reduction(self) -> bool {
        matches!(
            self,
            OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter
        )
    }
}

/// One operation as every participating rank must agree on it.
/// For collectives `seq` counts the communicator's collectives; for
/// send/recv it counts the messages between that pair of ranks, and `root`
/// holds the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub kind: OpKind,
    pub dtype: DType,
    pub redop: ReduceOp,
    pub root: i32,
    pub seq: u64,
    pub count: u64,
    /// Which algorithm runs it (ranks must pick the same one).
    pub algo: u8,
}

impl Desc {
    pub fn new(kind: OpKind, seq: u64) -> Desc {
        Desc {
            kind,
            dtype: DType::Uint8,
            redop: ReduceOp::Sum,
            root: 0,
            seq,
            count: 0,
            algo: 0,
        }
    }

    pub fn data(mut self, count: usize, dtype: DType) -> Desc {
        self.count = count as u64;
        self.dtype = dtype;
        self
    }

    pub fn reduction(mut self, op: ReduceOp) -> Desc {
        self.redop = op;
        self
    }

    pub fn root(mut self, root: usize) -> Desc {
        self.root = root as i32;
        self
    }
}

impl fmt::Display for Desc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            OpKind::Send => write!(
                f,
                "send/recv #{} ({} x {} from rank {})",
                self.seq, self.count, self.dtype, self.root
            ),
            OpKind::Barrier => write!(f, "barrier #{}", self.seq),
            OpKind::Split => write!(f, "comm_split #{}", self.seq),
            // One transfer of an uneven collective: its count, and the
            // count its sender expects back (see algorithms::direct).
            OpKind::AllGatherV | OpKind::AllToAllV => write!(
                f,
                "{} #{} ({} x {} one way between the two ranks, {} the other way)",
                self.kind.name(),
                self.seq,
                self.count,
                self.dtype,
                self.root as u32
            ),
            kind => {
                write!(
                    f,
                    "{} #{} ({} x {}",
                    kind.name(),
                    self.seq,
                    self.count,
                    self.dtype
                )?;
                if kind.has_reduction() {
                    write!(f, ", {}", self.redop)?;
                }
                if kind.has_root() {
                    write!(f, ", root {}", self.root)?;
                }
                write!(f, ")")
            }
        }
    }
}
