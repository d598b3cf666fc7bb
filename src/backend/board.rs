//! The flight recorder's board: which collective this rank is in and
//! which it last finished, kept in atomics (a few relaxed stores a call),
//! so that when a collective times out the ranks can be told what each
//! other rank was doing (`comm::progress` publishes and reads it).

use crate::descriptor::OpKind;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A collective as the board holds it: kind in the top byte, sequence
/// number below; 0 is none.
fn pack(kind: OpKind, seq: u64) -> u64 {
    ((kind as u64) << 56) | (seq & ((1 << 56) - 1))
}

fn unpack(v: u64) -> Option<(OpKind, u64)> {
    let kind = OpKind::from_wire((v >> 56) as u8)?;
    Some((kind, v & ((1 << 56) - 1)))
}

#[derive(Default)]
pub struct Board {
    current: AtomicU64,
    last: AtomicU64,
}

/// What the board says at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The collective in progress.
    pub current: Option<(OpKind, u64)>,
    /// The last one finished (successfully or not).
    pub last: Option<(OpKind, u64)>,
}

impl Board {
    pub fn begin(&self, kind: OpKind, seq: u64) {
        self.current.store(pack(kind, seq), Relaxed);
    }

    pub fn end(&self, kind: OpKind, seq: u64) {
        self.last.store(pack(kind, seq), Relaxed);
        self.current.store(0, Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            current: unpack(self.current.load(Relaxed)),
            last: unpack(self.last.load(Relaxed)),
        }
    }
}
