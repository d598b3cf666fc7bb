//! Where every call of a communicator is numbered and traced, on any
//! backend and in either context: the per-communicator sequence that
//! labels the collectives' frames and names calls in errors ("allreduce
//! #19"), the counters of sends and receives, the trace_file timeline, and
//! the flight recorder's board. Shared by the engine (which runs calls
//! under its lock) and the tagged port (whose calls are posted from any
//! thread).

use super::board::Board;
use crate::call::Call;
use crate::descriptor::OpKind;
use crate::sync::lock;
use crate::trace::Trace;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The numbers every rank must agree on: one per collective, and one per
/// message between each pair of ranks (device sends and receives, whose
/// frames carry them); tagged messages are numbered by their pair's
/// connection, and here only for the trace and the log.
pub(crate) struct Ledger {
    collectives: AtomicU64,
    /// Per peer: device sends to it and receives from it so far.
    pairs: Mutex<(Vec<u64>, Vec<u64>)>,
    /// Tagged sends and receives posted so far.
    tagged: AtomicU64,
    trace: Option<Mutex<Trace>>,
    board: Arc<Board>,
}

impl Ledger {
    pub(crate) fn new(size: usize, trace: Option<Trace>) -> Ledger {
        Ledger {
            collectives: AtomicU64::new(0),
            pairs: Mutex::new((vec![0; size], vec![0; size])),
            tagged: AtomicU64::new(0),
            trace: trace.map(Mutex::new),
            board: Arc::default(),
        }
    }

    /// The number of `call`, advancing its counter.
    pub(crate) fn number(&self, call: &Call) -> u64 {
        let mut pairs = match *call {
            Call::Send { .. } | Call::Recv { .. } => lock(&self.pairs),
            _ => return self.next_collective(),
        };
        let counter = match *call {
            Call::Send { peer, .. } => &mut pairs.0[peer],
            Call::Recv { peer, .. } => &mut pairs.1[peer],
            _ => unreachable!("collectives returned above"),
        };
        let n = *counter;
        *counter += 1;
        n
    }

    /// The number the next collective (or split) gets, advancing it.
    pub(crate) fn next_collective(&self) -> u64 {
        self.collectives.fetch_add(1, Ordering::Relaxed)
    }

    /// The number of a tagged call, for the trace (taken only while
    /// tracing).
    pub(crate) fn next_tagged(&self) -> u64 {
        self.tagged.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether calls are traced (then `started` times are worth taking).
    pub(crate) fn tracing(&self) -> bool {
        self.trace.is_some()
    }

    /// Records `call`, number `seq`, from `started` to now.
    pub(crate) fn record(&self, call: &Call, seq: u64, started: Instant, ok: bool) {
        if let Some(t) = &self.trace {
            lock(t).record(call.name(), seq, call.bytes(), started, ok);
        }
    }

    /// Records a tagged call (`name`: "send" or "recv").
    pub(crate) fn record_tagged(
        &self,
        name: &'static str,
        seq: u64,
        bytes: usize,
        started: Instant,
        ok: bool,
    ) {
        if let Some(t) = &self.trace {
            lock(t).record(name, seq, bytes, started, ok);
        }
    }

    pub(crate) fn begin(&self, kind: OpKind, seq: u64) {
        self.board.begin(kind, seq);
    }

    pub(crate) fn end(&self, kind: OpKind, seq: u64) {
        self.board.end(kind, seq);
    }

    /// What this rank is doing, for the flight recorder.
    pub(crate) fn board(&self) -> Arc<Board> {
        self.board.clone()
    }

    /// Writes the trace file, if any.
    pub(crate) fn write_trace(&self) {
        if let Some(t) = &self.trace {
            lock(t).write();
        }
    }
}
