//! The flight recorder, always on: each rank's point-to-point thread
//! publishes to the rendezvous store what the board (`backend::board`)
//! has said for a second or more (the collective it is stuck in, or the
//! last it finished before going quiet); a rank whose collective times
//! out reads the others' and names those that never reached it, and
//! what they last did. A job that never pauses for a second writes
//! nothing.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::backend::board::{Board, Snapshot};
use crate::descriptor::OpKind;
use crate::error::{Error, ErrorKind};
use crate::rendezvous::store::Store;

/// How long the board must stand still before it is published.
const QUIET: Duration = Duration::from_secs(1);
/// How often the publisher looks.
const LOOK_EVERY: Duration = Duration::from_millis(50);
/// Most ranks a report names.
const NAMED: usize = 8;

fn key(rank: usize) -> String {
    format!("progress/{rank}")
}

fn unix_ms(at: SystemTime) -> u128 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

fn code(op: Option<(OpKind, u64)>) -> String {
    op.map_or("0 0".into(), |(k, s)| format!("{} {s}", k as u8))
}

fn op_from(kind: Option<&str>, seq: Option<&str>) -> Option<(OpKind, u64)> {
    let kind = OpKind::from_wire(kind?.parse().ok()?)?;
    Some((kind, seq?.parse().ok()?))
}

/// The closure the point-to-point thread runs on every pass.
pub(crate) fn publisher(
    store: Arc<dyn Store>,
    rank: usize,
    board: Arc<Board>,
) -> impl FnMut() + Send {
    let mut seen: Snapshot = board.snapshot();
    let mut since = (Instant::now(), SystemTime::now());
    let mut published = false;
    let mut looked = Instant::now();
    move || {
        let now = Instant::now();
        if now.duration_since(looked) < LOOK_EVERY {
            return;
        }
        looked = now;
        let snapshot = board.snapshot();
        if snapshot != seen {
            seen = snapshot;
            since = (now, SystemTime::now());
            published = false;
            return;
        }
        if published || now.duration_since(since.0) < QUIET {
            return;
        }
        let record = format!(
            "{} {} {}",
            unix_ms(since.1),
            code(snapshot.current),
            code(snapshot.last)
        );
        // Best effort, and quick: a store that is gone only costs the
        // report, never this thread's other work.
        let _ = store.set_within(&key(rank), record.as_bytes(), Duration::from_secs(1));
        published = true;
    }
}

/// Adds to a collective's timeout what the other ranks last published.
pub(crate) fn explain_timeout(
    e: Error,
    store: &dyn Store,
    rank: usize,
    size: usize,
    board: &Board,
) -> Error {
    let snapshot = board.snapshot();
    let Some((kind, seq)) = snapshot.current.or(snapshot.last) else {
        return e;
    };
    let now = unix_ms(SystemTime::now());
    let others: Vec<usize> = (0..size).filter(|r| *r != rank).collect();
    let keys: Vec<String> = others.iter().map(|r| key(*r)).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let records = match store.read_within(&refs, Duration::from_secs(2)) {
        Ok(records) => records,
        Err(why) => {
            return Error::new(
                ErrorKind::Timeout,
                format!(
                    "{}; the rendezvous store (on rank 0's host) could not say what the other \
                     ranks last did ({}): if rank 0 is among those waited for, it may be \
                     stopped or its host unreachable",
                    e.message(),
                    why.message()
                ),
            )
        }
    };
    let mut behind = Vec::new();
    let mut silent = Vec::new();
    for (r, record) in others.into_iter().zip(records) {
        let Some(value) = record else {
            silent.push(r);
            continue;
        };
        let text = String::from_utf8_lossy(&value).into_owned();
        let mut fields = text.split(' ');
        let since: u128 = fields.next().and_then(|t| t.parse().ok()).unwrap_or(now);
        let current = op_from(fields.next(), fields.next());
        let last = op_from(fields.next(), fields.next());
        let age = now.saturating_sub(since) as f64 / 1000.0;
        let doing = match (current, last) {
            (Some((_, s)), _) if s >= seq => continue, // reached it (or beyond)
            (Some((k, s)), _) => format!("has been in {} #{s} for {age:.1} s", k.name()),
            (None, Some((_, s))) if s >= seq => continue,
            (None, Some((k, s))) => format!(
                "last finished {} #{s}, {age:.1} s ago, and has been in no rdist collective since",
                k.name()
            ),
            (None, None) => format!("has made no collective call in {age:.1} s"),
        };
        behind.push(format!("rank {r} {doing}"));
    }
    if behind.is_empty() && silent.is_empty() {
        return e;
    }
    let mut parts = Vec::new();
    if !behind.is_empty() {
        let more = behind.len().saturating_sub(NAMED);
        behind.truncate(NAMED);
        let tail = if more > 0 {
            format!(" (and {more} more)")
        } else {
            String::new()
        };
        parts.push(format!(
            "ranks that never reached {} #{seq}: {}{tail}",
            kind.name(),
            behind.join("; ")
        ));
    }
    if !silent.is_empty() && silent.len() < size - 1 {
        let shown: Vec<String> = silent.iter().take(NAMED).map(|r| r.to_string()).collect();
        parts.push(format!(
            "rank{} {} published nothing, though a rank publishes once it has stood still for \
             a second: stopped or frozen (SIGSTOP, a debugger, an overloaded host), or unable to \
             reach the store",
            if silent.len() == 1 { "" } else { "s" },
            shown.join(", ")
        ));
    }
    Error::new(
        ErrorKind::Timeout,
        format!("{}; {}", e.message(), parts.join("; ")),
    )
}
