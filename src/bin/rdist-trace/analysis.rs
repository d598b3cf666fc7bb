//! Matching the ranks' operations, who arrived last, and the merged trace.

use crate::trace_file::{Op, Timeline};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One operation across the ranks that took part.
pub struct Matched {
    pub seq: u64,
    pub name: String,
    /// (rank, its op, how long it waited for the last arrival).
    pub ranks: Vec<(usize, Op, f64)>,
    /// The rank that arrived last (on the aligned clocks).
    pub last: usize,
}

pub struct Merged {
    pub ranks: Vec<usize>,
    /// Per rank: microseconds to add to its clock to read rank 0's.
    pub offsets: BTreeMap<usize, f64>,
    pub ops: Vec<Matched>,
}

/// Collectives that no rank leaves before every rank has arrived.
fn symmetric(name: &str) -> bool {
    matches!(
        name,
        "allreduce"
            | "allgather"
            | "allgatherv"
            | "reduce_scatter"
            | "alltoall"
            | "alltoallv"
            | "barrier"
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Sends and receives: numbered apart from the collectives (in their own
/// context, per rank), and between two ranks only, so never matched here.
fn point_to_point(name: &str) -> bool {
    matches!(name, "send" | "recv")
}

pub fn merge(mut timelines: Vec<Timeline>) -> Merged {
    timelines.sort_by_key(|t| t.rank);
    for t in &mut timelines {
        t.ops.retain(|op| !point_to_point(&op.name));
    }
    let mut by_seq: BTreeMap<u64, Vec<(usize, Op)>> = BTreeMap::new();
    for t in &timelines {
        for op in &t.ops {
            by_seq.entry(op.seq).or_default().push((t.rank, op.clone()));
        }
    }
    let reference = timelines.first().map_or(0, |t| t.rank);
    let mut offsets = BTreeMap::new();
    // Every rank leaves a symmetric collective (one where each needs every
    // other's data) at about the same moment: those align the clocks.
    let any_symmetric = timelines
        .iter()
        .any(|t| t.ops.iter().any(|op| symmetric(&op.name)));
    for t in &timelines {
        let diffs: Vec<f64> = t
            .ops
            .iter()
            .filter(|op| symmetric(&op.name) || !any_symmetric)
            .filter_map(|op| {
                let theirs = by_seq.get(&op.seq)?.iter().find(|(r, _)| *r == reference)?;
                Some((theirs.1.start + theirs.1.dur) - (op.start + op.dur))
            })
            .collect();
        offsets.insert(t.rank, median(diffs));
    }
    let arrival = |r: usize, op: &Op| op.start + offsets.get(&r).copied().unwrap_or(0.0);
    let ops = by_seq
        .into_iter()
        .filter(|(_, v)| v.len() > 1)
        .map(|(seq, v)| {
            // The last to arrive; each other rank waited while in the call
            // before it came (a leaf of a reduce may have left by then).
            let (last, latest) = v
                .iter()
                .map(|(r, op)| (*r, arrival(*r, op)))
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .expect("two or more ranks");
            let name = v[0].1.name.clone();
            let ranks = v
                .into_iter()
                .map(|(r, op)| {
                    let wait = (latest - arrival(r, &op)).clamp(0.0, op.dur);
                    (r, op, wait)
                })
                .collect();
            Matched {
                seq,
                name,
                ranks,
                last,
            }
        })
        .collect();
    Merged {
        ranks: timelines.iter().map(|t| t.rank).collect(),
        offsets,
        ops,
    }
}

fn ms(us: f64) -> String {
    format!("{:.2} ms", us / 1000.0)
}

pub fn report(m: &Merged) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "rdist-trace: {} ranks ({}), {} operations matched by sequence number",
        m.ranks.len(),
        m.ranks
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        m.ops.len()
    );
    if m.ops.is_empty() {
        return s;
    }
    // Per rank: how often it came last, and how long the others waited then.
    let mut blame: BTreeMap<usize, (usize, f64)> = BTreeMap::new();
    let mut waited: BTreeMap<usize, f64> = BTreeMap::new();
    for op in &m.ops {
        let others: f64 = op.ranks.iter().map(|(_, _, w)| w).sum();
        let e = blame.entry(op.last).or_default();
        e.0 += 1;
        e.1 += others;
        for (r, _, w) in &op.ranks {
            *waited.entry(*r).or_default() += w;
        }
    }
    let mut order: Vec<(usize, (usize, f64))> = blame.into_iter().collect();
    order.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    let _ = writeln!(
        s,
        "who made the others wait (arrived last at a collective):"
    );
    for (rank, (count, total)) in &order {
        let _ = writeln!(
            s,
            "  rank {rank}: last in {count} of {} operations; the others waited {} in all for it ({} per operation it held up)",
            m.ops.len(),
            ms(*total),
            ms(total / *count as f64)
        );
    }
    if let Some((rank, (count, total))) = order.first() {
        if *count * 2 > m.ops.len() {
            let _ = writeln!(
                s,
                "straggler: rank {rank} (last in {count} of {} operations, {} of waiting caused)",
                m.ops.len(),
                ms(*total)
            );
        }
    }
    // Per operation kind.
    let mut kinds: BTreeMap<&str, (usize, f64, BTreeMap<usize, usize>)> = BTreeMap::new();
    for op in &m.ops {
        let e = kinds.entry(&op.name).or_default();
        e.0 += 1;
        e.1 += op.ranks.iter().map(|(_, _, w)| w).sum::<f64>();
        *e.2.entry(op.last).or_default() += 1;
    }
    let _ = writeln!(s, "by operation:");
    for (name, (count, total, lasts)) in &kinds {
        let (top, n) = lasts
            .iter()
            .max_by_key(|(_, n)| **n)
            .map_or((0, 0), |(r, n)| (*r, *n));
        let _ = writeln!(
            s,
            "  {name}: {count} calls, {} waited in all ({} per call); last to arrive: rank {top} ({n} of {count})",
            ms(*total),
            ms(total / *count as f64)
        );
    }
    let _ = writeln!(s, "time each rank spent waiting for others:");
    for (rank, w) in &waited {
        let _ = writeln!(s, "  rank {rank}: {}", ms(*w));
    }
    s
}

/// One Chrome trace: a process per rank, clocks aligned to the first rank's,
/// each event with its wait and whether its rank came last.
pub fn chrome_trace(m: &Merged) -> String {
    let mut s = String::from("{\"traceEvents\":[\n");
    let mut first = true;
    for rank in &m.ranks {
        let _ = write!(
            s,
            "{}{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{rank},\"args\":{{\"name\":\"rank {rank}\"}}}}",
            if first { "" } else { ",\n" }
        );
        first = false;
    }
    for op in &m.ops {
        for (rank, o, wait) in &op.ranks {
            let ts = o.start + m.offsets.get(rank).copied().unwrap_or(0.0);
            let _ = write!(
                s,
                ",\n{{\"name\":\"{}\",\"ph\":\"X\",\"pid\":{rank},\"tid\":0,\"ts\":{ts:.3},\"dur\":{:.3},\"args\":{{\"seq\":{},\"bytes\":{},\"ok\":{},\"waited_us\":{wait:.1},\"arrived_last\":{}}}}}",
                o.name,
                o.dur,
                op.seq,
                o.bytes,
                o.ok,
                *rank == op.last
            );
        }
    }
    s.push_str("\n]}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(name: &str, seq: u64, start: f64, dur: f64) -> Op {
        Op {
            name: name.into(),
            seq,
            start,
            dur,
            bytes: 4,
            ok: true,
        }
    }

    #[test]
    fn the_late_rank_is_found_whatever_the_clocks_say() {
        // Rank 1's clock is 5 s ahead; rank 2 enters each allreduce 10 ms
        // after the others, and all leave together at 20 ms.
        let clock = [0.0, 5e6, -3e6];
        let timelines = (0..3)
            .map(|r| Timeline {
                rank: r,
                ops: (0..4)
                    .flat_map(|s| {
                        let step = s as f64 * 1e5;
                        let enter = if r == 2 { 10_000.0 } else { 0.0 };
                        // Rank 0 also sends, late, numbered as the
                        // collectives are but in the other context.
                        let send = op("send", s, clock[r] + step + 50_000.0, 1.0);
                        let all = op("allreduce", s, clock[r] + step + enter, 20_000.0 - enter);
                        if r == 0 {
                            vec![send, all]
                        } else {
                            vec![all]
                        }
                    })
                    .collect(),
            })
            .collect();
        let m = merge(timelines);
        assert_eq!(m.ops.len(), 4);
        for op in &m.ops {
            assert_eq!((op.name.as_str(), op.ranks.len()), ("allreduce", 3));
            assert_eq!(op.last, 2);
            for (r, _, wait) in &op.ranks {
                let want = if *r == 2 { 0.0 } else { 10_000.0 };
                assert!((wait - want).abs() < 1.0, "rank {r} waited {wait}");
            }
        }
        let text = report(&m);
        assert!(
            text.contains("straggler: rank 2 (last in 4 of 4 operations, 80.00 ms"),
            "{text}"
        );
        assert!(chrome_trace(&m).contains("\"arrived_last\":true"));
    }
}
