//! Hierarchical allreduce (inside each host, across hosts, inside again),
//! allgather and reduce-scatter against an independent reference, on ranks given host ids by option
//! (threads on loopback: shared memory inside a "host", TCP between), at
//! sizes that do and do not divide evenly, for every reduction, chosen
//! automatically (>= 256 KiB) and forced (`algo=hierarchical`); the largest
//! count (2.4 MB) takes the pipelined schedule of `algorithms::grid`.

mod common;

use rdist::{Comm, ReduceOp};
use std::time::Duration;

/// `size` ranks on `hosts` host ids, interleaved (rank r on host r % hosts).
fn run(size: usize, hosts: usize, forced: bool) {
    let url = format!("tcp://127.0.0.1:{}", common::free_port());
    let opts = move |rank: usize| {
        let mut o = common::opts(30_000);
        o.set("host_id", &format!("host{}", rank % hosts)).unwrap();
        if forced {
            o.set("algo", "hierarchical").unwrap();
        }
        o
    };
    let value = |r: usize, i: usize| ((r * 7 + i * 13) % 11) as i64 + 1;
    // When the last rank entered each round's barrier and the first one
    // left it (µs since `start`), shared by this world's threads alone;
    // compared once every rank is done.
    use std::sync::atomic::{AtomicU64, Ordering};
    let entered: std::sync::Arc<[AtomicU64; 3]> = std::sync::Arc::new(Default::default());
    let first_left: std::sync::Arc<[AtomicU64; 3]> = std::sync::Arc::new([
        AtomicU64::new(u64::MAX),
        AtomicU64::new(u64::MAX),
        AtomicU64::new(u64::MAX),
    ]);
    let (entered_seen, left_seen) = (entered.clone(), first_left.clone());
    let start = std::time::Instant::now();
    let micros = move || start.elapsed().as_micros() as u64;
    let results = common::world_with(
        size,
        opts(0),
        Duration::from_secs(120),
        move |rank, size| Comm::init(&url, rank as i64, size as i64, &opts(rank)),
        move |comm| {
            let r = comm.rank();
            let mut bad = Vec::new();
            // Broadcast and reduce from every root, by two trees (small,
            // forced) and by the chain that visits the hosts in turn
            // (>= 64 KiB, chosen; 300,000 elements are three chunks).
            for count in [1usize, 1000, 8_193, 300_000] {
                if !forced && count < 8_193 {
                    continue;
                }
                for root in 0..comm.size() {
                    let mut v: Vec<i64> = (0..count)
                        .map(|i| if r == root { value(root, i) } else { -1 })
                        .collect();
                    comm.broadcast(&mut v, root).unwrap();
                    if let Some(i) = (0..count).find(|&i| v[i] != value(root, i)) {
                        bad.push(format!(
                            "broadcast root {root} count {count} [{i}]: {}",
                            v[i]
                        ));
                    }
                    let mine: Vec<i64> = (0..count)
                        .map(|i| value(r, i) * (root as i64 + 1))
                        .collect();
                    for op in [ReduceOp::Sum, ReduceOp::Max] {
                        let mut out = vec![0i64; if r == root { count } else { 0 }];
                        comm.reduce(&mine, &mut out, op, root).unwrap();
                        for (i, got) in out.iter().enumerate() {
                            let all = (0..comm.size()).map(|q| value(q, i) * (root as i64 + 1));
                            let want = match op {
                                ReduceOp::Sum => all.sum::<i64>(),
                                _ => all.max().unwrap(),
                            };
                            if *got != want {
                                bad.push(format!("reduce {op:?} root {root} count {count} [{i}]: {got} != {want}"));
                                break;
                            }
                        }
                    }
                    let fmine: Vec<f64> = mine.iter().map(|v| *v as f64).collect();
                    let mut fout = vec![0f64; if r == root { count } else { 0 }];
                    comm.reduce(&fmine, &mut fout, ReduceOp::Avg, root).unwrap();
                    for (i, got) in fout.iter().enumerate() {
                        let want = (0..comm.size())
                            .map(|q| (value(q, i) * (root as i64 + 1)) as f64)
                            .sum::<f64>()
                            / comm.size() as f64;
                        if (got - want).abs() > 1e-9 {
                            bad.push(format!(
                                "reduce Avg root {root} count {count} [{i}]: {got} != {want}"
                            ));
                            break;
                        }
                    }
                }
            }
            // Barrier: no rank leaves before the last has entered (rank
            // `size - 1 - round % size` enters 30 ms late each round).
            for round in 0..3 {
                let late = comm.size() - 1 - round % comm.size();
                if r == late {
                    std::thread::sleep(Duration::from_millis(30));
                }
                entered[round].fetch_max(micros(), Ordering::SeqCst);
                comm.barrier().unwrap();
                first_left[round].fetch_min(micros(), Ordering::SeqCst);
            }
            for count in [1usize, 3, 1000, 70_001, 300_007] {
                if !forced && count < 70_000 {
                    continue;
                }
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                    let mut v: Vec<i64> = (0..count).map(|i| value(r, i)).collect();
                    comm.allreduce(&mut v, op).unwrap();
                    for (i, got) in v.iter().enumerate() {
                        let all = (0..comm.size()).map(|q| value(q, i));
                        let want = match op {
                            ReduceOp::Sum => all.sum::<i64>(),
                            ReduceOp::Max => all.max().unwrap(),
                            _ => all.min().unwrap(),
                        };
                        if *got != want {
                            bad.push(format!("{op:?} count {count} [{i}]: {got} != {want}"));
                            break;
                        }
                    }
                }
                // Allgather and reduce-scatter: `count` elements a rank
                // (the chosen-by-size case crosses 256 KiB in total).
                let mine: Vec<i64> = (0..count).map(|i| value(r, i)).collect();
                let mut all = vec![0i64; count * comm.size()];
                comm.allgather(&mine, &mut all).unwrap();
                for (i, got) in all.iter().enumerate() {
                    let want = value(i / count, i % count);
                    if *got != want {
                        bad.push(format!("allgather count {count} [{i}]: {got} != {want}"));
                        break;
                    }
                }
                let input: Vec<i64> = (0..count * comm.size()).map(|i| value(r, i)).collect();
                for op in [ReduceOp::Sum, ReduceOp::Max] {
                    let mut out = vec![0i64; count];
                    comm.reduce_scatter(&input, &mut out, op).unwrap();
                    for (i, got) in out.iter().enumerate() {
                        let all = (0..comm.size()).map(|q| value(q, r * count + i));
                        let want = match op {
                            ReduceOp::Sum => all.sum::<i64>(),
                            _ => all.max().unwrap(),
                        };
                        if *got != want {
                            bad.push(format!(
                                "reduce_scatter {op:?} count {count} [{i}]: {got} != {want}"
                            ));
                            break;
                        }
                    }
                }
                let finput: Vec<f64> = input.iter().map(|v| *v as f64).collect();
                let mut fout = vec![0f64; count];
                comm.reduce_scatter(&finput, &mut fout, ReduceOp::Avg)
                    .unwrap();
                for (i, got) in fout.iter().enumerate() {
                    let want = (0..comm.size())
                        .map(|q| value(q, r * count + i) as f64)
                        .sum::<f64>()
                        / comm.size() as f64;
                    if (got - want).abs() > 1e-12 {
                        bad.push(format!(
                            "reduce_scatter Avg count {count} [{i}]: {got} != {want}"
                        ));
                        break;
                    }
                }
                let mut f: Vec<f64> = (0..count).map(|i| value(r, i) as f64).collect();
                comm.allreduce(&mut f, ReduceOp::Avg).unwrap();
                for (i, got) in f.iter().enumerate() {
                    let want = (0..comm.size()).map(|q| value(q, i) as f64).sum::<f64>()
                        / comm.size() as f64;
                    if (got - want).abs() > 1e-12 {
                        bad.push(format!("Avg count {count} [{i}]: {got} != {want}"));
                        break;
                    }
                }
            }
            bad
        },
    );
    for (rank, bad) in results.iter().enumerate() {
        assert!(
            bad.is_empty(),
            "rank {rank} of {size} on {hosts} hosts: {bad:?}"
        );
    }
    for round in 0..3 {
        let last_in = entered_seen[round].load(Ordering::SeqCst);
        let first_out = left_seen[round].load(Ordering::SeqCst);
        assert!(
            first_out >= last_in,
            "barrier round {round}: a rank left at {first_out} µs, before the last entered at {last_in} µs ({size} ranks on {hosts} hosts)"
        );
    }
}

#[test]
fn two_hosts_of_two_forced() {
    run(4, 2, true);
}

#[test]
fn three_hosts_of_two_forced() {
    run(6, 3, true);
}

#[test]
fn two_hosts_of_three_chosen_by_size() {
    run(6, 2, false);
}

#[test]
fn forced_on_one_host_it_falls_back_alike_on_every_rank() {
    run(3, 1, true);
}
