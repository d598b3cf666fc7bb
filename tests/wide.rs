//! Wide jobs: pairs connect on first use, so a rank holds connections only
//! to the peers its algorithms use. Real processes under the real
//! launcher (rdistrun), checked collectives (rdist-bench compares every
//! element with the expected value), and each rank's descriptors counted.

mod common;

use rdist::store::TcpStoreServer;
use rdist::Comm;
use std::process::Command;
use std::time::Duration;

/// 48 ranks run checked allreduce, broadcast and barrier. Had every pair
/// connected, each rank would hold a connection to each of its 47 peers
/// besides its own ~10 descriptors; with connections on demand it holds
/// those of the few peers its algorithms name (log2 of the world each).
#[test]
fn a_wide_job_connects_only_the_pairs_it_uses() {
    let ranks = 48;
    let out = common::output_within(
        Command::new(env!("CARGO_BIN_EXE_rdistrun"))
            .args(["--nproc-per-node", &ranks.to_string()])
            .arg(env!("CARGO_BIN_EXE_rdist-bench"))
            .args(["--op", "allreduce,broadcast,barrier"])
            .args(["--min-bytes", "4K", "--max-bytes", "64K"])
            .args(["--seconds", "0.01", "--reps", "1", "--resources"])
            .env("RDIST_TIMEOUT_MS", "60000"),
        Duration::from_secs(120),
        "48 ranks of rdist-bench",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}\n{err}");
    assert!(
        text.contains("out of bounds values : 0 OK"),
        "wrong elements:\n{text}"
    );
    let line = text
        .lines()
        .find(|l| l.contains("# resources:"))
        .unwrap_or_else(|| panic!("no resources line:\n{text}"));
    let after_run = line.split("after the run ").nth(1).expect("after the run");
    let mean_fds: f64 = after_run
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no fd count in: {line}"));
    assert!(
        mean_fds < 40.0,
        "{mean_fds} descriptors per rank on average: every pair connected? {line}"
    );
}

/// What joining costs the store every rank shares (rank 0's, one thread
/// serving the whole job): the same few queries a rank, however many ranks
/// join. Each rank reading every rank's key, or asking again and again
/// while it waits, made a wide job's rendezvous grow with the square of
/// the ranks.
#[test]
fn joining_costs_the_shared_store_a_few_queries_a_rank_at_any_width() {
    let mut per_rank = Vec::new();
    for ranks in [4usize, 32] {
        let server = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let url = format!("tcp://{}", server.local_addr());
        let joins: Vec<_> = (0..ranks)
            .map(|r| {
                let url = url.clone();
                std::thread::spawn(move || {
                    Comm::init(&url, r as i64, ranks as i64, &common::opts(60_000))
                })
            })
            .collect();
        let comms: Vec<Comm> = joins
            .into_iter()
            .map(|j| j.join().unwrap().expect("init"))
            .collect();
        per_rank.push(server.queries_answered() as f64 / ranks as f64);
        drop(comms);
    }
    eprintln!(
        "store queries per rank: 4 ranks {:.1}, 32 ranks {:.1}",
        per_rank[0], per_rank[1]
    );
    // About 13 a rank; a rank that waits over a second for the others
    // (a loaded machine) looks again, 4 queries a look. Reading every
    // rank's key one by one, or every rank polling the count, would add
    // 28 or more a rank at 32 ranks.
    assert!(
        per_rank.iter().all(|q| *q <= 20.0) && per_rank[1] <= per_rank[0] + 3.0,
        "queries per rank at 4 and 32 ranks: {per_rank:?}"
    );
}
