//! The flight recorder, always on: each rank's point-to-point thread
//! publishes to the rendezvous store what the board (`backend::board`)
//! has said for a second or more (the collective it is stuck in, or the
//! last it finished before going quiet); a rank whose collective times
//! out reads the others' and names those that never reached it, and
//! what they last did. A job that never pauses for a second writes
//! nothing.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::backend::board::{Board, Snapshot};
use crate::descriptor::OpKind;
use crate::error::{Error, ErrorKind};
use crate::rendezvous::store::Store;
use crate::transport::membership::{HostId, Roster};

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

/// Where each rank runs: its host id and the address it listens on, to
/// say "every rank on host X" rather than list ranks. The roster itself
/// (shared, not copied: read only to explain a timeout).
pub(crate) type Places = Roster;

/// What a timeout's explanation reads: the store, the world size, and
/// where each rank runs.
pub(crate) type Recorder = (Arc<dyn Store>, usize, Places);

/// The hosts all of whose ranks are in `silent` (not this rank's host),
/// by address, when every silent rank is on one of them; None otherwise.
fn silent_hosts(silent: &[usize], places: &[(HostId, IpAddr)], rank: usize) -> Option<Vec<IpAddr>> {
    let mut hosts: Vec<&HostId> = Vec::new();
    for r in silent {
        let host = &places.get(*r)?.0;
        if !hosts.contains(&host) {
            hosts.push(host);
        }
    }
    let whole = |host: &HostId| {
        *host != places[rank].0
            && places
                .iter()
                .enumerate()
                .all(|(r, (h, _))| h != host || silent.contains(&r))
    };
    if hosts.is_empty() || !hosts.iter().all(|h| whole(h)) {
        return None;
    }
    Some(
        hosts
            .iter()
            .map(|h| {
                places
                    .iter()
                    .find(|(x, _)| x == *h)
                    .expect("a rank's host")
                    .1
            })
            .collect(),
    )
}

/// Adds to a collective's timeout what the other ranks last published.
pub(crate) fn explain_timeout(
    e: Error,
    store: &dyn Store,
    rank: usize,
    size: usize,
    board: &Board,
    roster: &Roster,
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
        let more = match silent.len() > NAMED {
            true => format!(" (and {} more)", silent.len() - NAMED),
            false => String::new(),
        };
        let places: Vec<(HostId, IpAddr)> = (roster.hosts.iter().cloned())
            .zip(roster.addrs.iter().map(|a| a.ip()))
            .collect();
        if let Some(hosts) = silent_hosts(&silent, &places, rank) {
            // A whole host gone quiet at once is its network (or the host),
            // far more often than all its ranks frozen together.
            let hosts: Vec<String> = hosts.iter().map(IpAddr::to_string).collect();
            parts.push(format!(
                "rank{} {}{more} published nothing: {} of host{} {}, so that host is down or the \
                 network between it and the others (the store is on rank 0's host) is cut, or \
                 every rank there is stopped",
                if silent.len() == 1 { "" } else { "s" },
                shown.join(", "),
                if silent.len() == 1 {
                    "the only rank"
                } else {
                    "every rank"
                },
                if hosts.len() == 1 { "" } else { "s" },
                hosts.join(", ")
            ));
            return Error::new(
                ErrorKind::Timeout,
                format!("{}; {}", e.message(), parts.join("; ")),
            );
        }
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

#[cfg(test)]
mod tests {
    use super::silent_hosts;
    use std::net::IpAddr;

    fn places(hosts: &[&str]) -> Vec<(crate::transport::membership::HostId, IpAddr)> {
        hosts
            .iter()
            .map(|h| {
                let ip = format!("10.0.0.{}", h.trim_start_matches('h'));
                ((*h).into(), ip.parse().unwrap())
            })
            .collect()
    }

    #[test]
    fn a_whole_silent_host_is_named_by_its_address() {
        let p = places(&["h1", "h1", "h2", "h2", "h3", "h3"]);
        let h3: IpAddr = "10.0.0.3".parse().unwrap();
        assert_eq!(silent_hosts(&[4, 5], &p, 0), Some(vec![h3]));
        assert_eq!(silent_hosts(&[2, 3, 4, 5], &p, 0).map(|v| v.len()), Some(2));
        // Half a host is not its network; nor is this rank's own host.
        assert_eq!(silent_hosts(&[4], &p, 0), None);
        assert_eq!(silent_hosts(&[2, 3, 4], &p, 0), None);
        assert_eq!(silent_hosts(&[1], &p, 0), None);
        assert_eq!(silent_hosts(&[], &p, 0), None);
    }
}
