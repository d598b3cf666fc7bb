//! Shrinking a communicator: real rank processes on loopback, some killed
//! (the store's host, rank 0, too), the survivors agreeing on a new
//! communicator and running on it; a healthy shrink that leaves a live
//! rank out while the parent goes on; calls that differ between ranks.
//! Each result is checked against sums computed here from the survivors'
//! old ranks. Each test is bounded.

mod common;

use rdist::{Comm, ErrorKind, Options, ReduceOp};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// Starts `size` ranks of this binary as workers in `role` (see
/// `shrink_worker`); returns each rank's RESULT line (None for ranks that
/// printed none, the killed ones) after all ended within `limit`.
fn run_job(role: &str, size: usize, limit: Duration) -> Vec<Option<String>> {
    let port = common::free_port();
    let children: Vec<_> = (0..size)
        .map(|rank| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args([
                "--exact",
                "shrink_worker",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("RDIST_TEST_ROLE", role)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", size.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RDIST_TIMEOUT_MS", "20000");
            std::thread::spawn(move || common::output_within(&mut cmd, limit, "a shrink worker"))
        })
        .collect();
    children
        .into_iter()
        .enumerate()
        .map(|(rank, c)| {
            let out = c.join().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let line = text
                .lines()
                .find_map(|l| l.split_once("RESULT ").map(|x| x.1.to_string()));
            if line.is_none() && out.status.code().is_some() {
                eprintln!(
                    "rank {rank} printed no result; stdout:\n{text}\nstderr:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            line
        })
        .collect()
}

/// The `key=value` fields of a RESULT line.
fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace()
        .filter_map(|f| f.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn ranks_of(list: &str) -> Vec<usize> {
    list.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect()
}

/// Not a test of its own: the body of the worker processes (does nothing
/// without RDIST_TEST_ROLE). Roles: `noticed:V` (ranks V are killed in
/// the middle of a run of allreduces; the others shrink when theirs
/// fails), `quiet:V` (ranks V die right after init, before anyone talks
/// to them; the others shrink without having noticed), `healthy:V` (the
/// others shrink leaving ranks V out, then every rank goes on on the
/// parent).
#[test]
fn shrink_worker() {
    let Ok(role) = std::env::var("RDIST_TEST_ROLE") else {
        return;
    };
    let (mode, victims) = role.split_once(':').unwrap();
    let victims = ranks_of(victims);
    let comm = Comm::init("env://", -1, -1, &Options::default()).unwrap();
    let me = comm.rank();
    let doomed = victims.contains(&me);
    let mut killed_at = 0u128;
    match mode {
        "noticed" | "failover" => {
            let mut buf = vec![1.0f32; 1024];
            for i in 0.. {
                if doomed && i == 30 {
                    println!("KILLED at={}", now_us());
                    // SAFETY: a deliberate crash, no cleanup.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                if let Err(e) = comm.allreduce(&mut buf, ReduceOp::Sum) {
                    if doomed {
                        // Another victim died first: this one dies too.
                        println!("KILLED at={}", now_us());
                        // SAFETY: as above.
                        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                    }
                    assert!(
                        matches!(e.kind(), ErrorKind::PeerLost | ErrorKind::Aborted),
                        "rank {me}: {e}"
                    );
                    break;
                }
                buf.iter_mut().for_each(|x| *x = 1.0);
            }
            if mode == "failover" && me == 0 {
                // The coordinator-to-be dies while the others wait on it.
                std::thread::sleep(Duration::from_millis(300));
                println!("KILLED at={}", now_us());
                // SAFETY: as above.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
        }
        "quiet" => {
            if doomed {
                println!("KILLED at={}", now_us());
                // SAFETY: as above.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            killed_at = now_us();
            std::thread::sleep(Duration::from_millis(200));
        }
        "stopped" | "resumed" => {
            if doomed {
                // Stopped (not dead: its kernel still takes connections),
                // as a debugger or ^Z would; killed after the test, or
                // resumed once the others have shrunk without it.
                let pid = std::process::id();
                let then = match mode {
                    "stopped" => format!("sleep 10; kill -9 {pid}"),
                    _ => format!("sleep 8; kill -CONT {pid}"),
                };
                // It outlives this process (nobody waits for it).
                let later = Command::new("sh").args(["-c", &then]).spawn().unwrap();
                std::mem::forget(later);
                // SAFETY: stops this process.
                unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
                if mode == "resumed" {
                    // Back: its shrink must not make a communicator of its
                    // own; the others' decision left it out. (Its thread
                    // takes the ballots that waited for it first: their
                    // senders have hung up since.)
                    // (The stop takes hold within this first sleep; the
                    // second runs after it.)
                    std::thread::sleep(Duration::from_millis(200));
                    std::thread::sleep(Duration::from_millis(500));
                    let r = comm.shrink(&[], false, None);
                    let kind = r.as_ref().err().map(|e| e.kind());
                    println!(
                        "RESULT old={me} resumed={kind:?} msg={}",
                        r.err().map(|e| e.to_string()).unwrap_or_default()
                    );
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        "healthy" if doomed => {
            // Left out: waits for the others on the parent.
            let mut x = [me as f64 + 1.0];
            comm.allreduce(&mut x, ReduceOp::Sum).unwrap();
            let child = comm.split(7, 0).unwrap().unwrap();
            println!(
                "RESULT old={me} left_out=1 parent_sum={} split_size={}",
                x[0],
                child.size()
            );
            return;
        }
        _ => {}
    }
    let known: Vec<String> = comm.failed_ranks().iter().map(|r| r.to_string()).collect();
    let started = now_us();
    let exclude: &[usize] = if mode == "healthy" { &victims } else { &[] };
    let child = comm
        .shrink(exclude, false, None)
        .unwrap_or_else(|e| panic!("rank {me}: shrink failed: {e}"));
    let shrunk = now_us();
    let mut x = [me as f64 + 1.0];
    child.allreduce(&mut x, ReduceOp::Sum).unwrap();
    let stepped = now_us();
    let mut extra = String::new();
    if mode == "healthy" {
        // The parent goes on, with the rank left out.
        let mut y = [me as f64 + 1.0];
        comm.allreduce(&mut y, ReduceOp::Sum).unwrap();
        let split = comm.split(7, 0).unwrap().unwrap();
        extra = format!(" parent_sum={} split_size={}", y[0], split.size());
    } else {
        // The failed parent refuses calls, and still splits or not
        // without crashing, and is destroyed after the child.
        assert!(comm.allreduce(&mut [1.0f32], ReduceOp::Sum).is_err());
        assert!(comm.split(0, 0).is_err());
    }
    println!(
        "RESULT old={me} new={} size={} sum={} knew={} shrink_us={} step_us={} stepped_at={}{extra}",
        child.rank(),
        child.size(),
        x[0],
        known.join(","),
        shrunk - started,
        stepped - shrunk,
        stepped.max(killed_at)
    );
    if mode == "resumed" {
        // The parent stays until the stopped rank is back and has asked.
        std::thread::sleep(Duration::from_secs(8));
    }
    drop(child);
    drop(comm);
}

/// Runs a job whose `victims` die in `mode` and checks that exactly the
/// others finished, renumbered in order, with the right sum.
fn survivors_shrink(mode: &str, size: usize, victims: &[usize]) -> Vec<BTreeMap<String, String>> {
    let list: Vec<String> = victims.iter().map(|v| v.to_string()).collect();
    let role = format!("{mode}:{}", list.join(","));
    let mut victims = victims.to_vec();
    if mode == "failover" {
        victims.push(0);
    }
    let lines = run_job(&role, size, Duration::from_secs(90));
    let survivors: Vec<usize> = (0..size).filter(|r| !victims.contains(r)).collect();
    let want: f64 = survivors.iter().map(|r| *r as f64 + 1.0).sum();
    let mut out = Vec::new();
    for (rank, line) in lines.iter().enumerate() {
        if victims.contains(&rank) {
            assert!(line.is_none(), "killed rank {rank} printed {line:?}");
            continue;
        }
        let line = line
            .as_deref()
            .unwrap_or_else(|| panic!("{role}: survivor {rank} printed no result"));
        let f = fields(line);
        let new_rank = survivors.iter().position(|r| *r == rank).unwrap();
        assert_eq!(f["new"], new_rank.to_string(), "{role}: {line}");
        assert_eq!(f["size"], survivors.len().to_string(), "{role}: {line}");
        assert_eq!(f["sum"].parse::<f64>().unwrap(), want, "{role}: {line}");
        // Found out within seconds, not at the timeout (20 s); a stopped
        // rank after its probes (up to 3 s each) went unanswered.
        let took = f["shrink_us"].parse::<u64>().unwrap();
        let bound = if mode == "stopped" {
            8_000_000
        } else {
            5_000_000
        };
        assert!(took < bound, "{role}: rank {rank}'s shrink took {took} us");
        out.push(f);
    }
    out
}

#[test]
fn the_survivors_of_a_killed_rank_shrink_and_go_on_whichever_rank_died() {
    // The store's host, then a rank in the middle, then two at once.
    for victims in [&[0][..], &[2], &[0, 1]] {
        let results = survivors_shrink("noticed", 4, victims);
        let slowest = results
            .iter()
            .map(|f| f["shrink_us"].parse::<u64>().unwrap())
            .max()
            .unwrap();
        eprintln!("killed {victims:?} of 4: slowest shrink {slowest} us");
    }
}

#[test]
fn a_coordinator_that_dies_during_the_shrink_is_replaced() {
    // Rank 3 dies; rank 0, whom the others ask first, dies while they
    // wait for its decision: rank 1 takes over.
    let results = survivors_shrink("failover", 4, &[3]);
    assert_eq!(results.len(), 2);
}

#[test]
fn a_stopped_rank_is_left_out_within_seconds_even_the_first() {
    // Rank 0 stops: its kernel still accepts the others' ballots, but it
    // never answers; they probe it, and rank 1 coordinates.
    let results = survivors_shrink("stopped", 4, &[0]);
    for f in &results {
        eprintln!("stopped rank 0: shrink took {} us", f["shrink_us"]);
    }
}

#[test]
fn a_stopped_rank_that_comes_back_is_told_it_was_left_out() {
    let lines = run_job("resumed:0", 4, Duration::from_secs(60));
    let back = lines[0].as_deref().expect("rank 0 printed no result");
    assert!(back.contains("resumed=Some(PeerLost)"), "{back}");
    assert!(back.contains("decided without rank 0"), "{back}");
    for (rank, line) in lines.iter().enumerate().skip(1) {
        let f = fields(line.as_deref().expect("a survivor printed no result"));
        assert_eq!(f["size"], "3", "rank {rank}: {f:?}");
        assert_eq!(f["sum"], "9", "rank {rank}: {f:?}"); // 2 + 3 + 4
    }
}

#[test]
fn survivors_that_noticed_nothing_agree_all_the_same() {
    // Ranks 1 and 3 die before anyone talks to them: nobody knows; the
    // coordinator finds out by probing. Rank 0 (the store's host) in a
    // second job.
    for victims in [&[1, 3][..], &[0]] {
        let results = survivors_shrink("quiet", 4, victims);
        for f in &results {
            assert_eq!(f["knew"], "", "a survivor knew of a failure: {f:?}");
        }
    }
}

#[test]
fn a_healthy_shrink_leaves_a_live_rank_out_and_the_parent_goes_on() {
    let lines = run_job("healthy:1", 4, Duration::from_secs(60));
    for (rank, line) in lines.iter().enumerate() {
        let line = line
            .as_deref()
            .unwrap_or_else(|| panic!("rank {rank} printed no result"));
        let f = fields(line);
        // The parent's allreduce over all 4 ranks, and its split.
        assert_eq!(f["parent_sum"], "10", "rank {rank}: {line}");
        assert_eq!(f["split_size"], "4", "rank {rank}: {line}");
        if rank == 1 {
            assert!(f.contains_key("left_out"), "{line}");
            continue;
        }
        assert_eq!(f["size"], "3", "rank {rank}: {line}");
        assert_eq!(f["sum"], "8", "rank {rank}: {line}"); // 1 + 3 + 4
        assert_eq!(
            f["new"],
            [0, 0, 1, 2][rank].to_string(),
            "rank {rank}: {line}"
        );
    }
}

#[test]
fn bad_exclude_lists_are_refused_on_the_calling_rank() {
    let results = common::world(3, common::opts(10_000), Duration::from_secs(30), |comm| {
        let me = comm.rank();
        let own = comm.shrink(&[me], false, None).err().map(|e| e.kind());
        let far = comm.shrink(&[3], false, None).err().map(|e| e.kind());
        let twice = comm.shrink(&[(me + 1) % 3, (me + 1) % 3], false, None);
        let twice = twice.err().map(|e| e.kind());
        // The communicator is untouched by the refusals.
        let mut x = [1.0f32];
        comm.allreduce(&mut x, ReduceOp::Sum).unwrap();
        (own, far, twice, x[0])
    });
    for (own, far, twice, sum) in results {
        assert_eq!(own, Some(ErrorKind::InvalidArgument));
        assert_eq!(far, Some(ErrorKind::InvalidArgument));
        assert_eq!(twice, Some(ErrorKind::InvalidArgument));
        assert_eq!(sum, 3.0);
    }
}

#[test]
fn ranks_that_pass_different_exclude_lists_fail_with_a_mismatch() {
    let results = common::world(4, common::opts(10_000), Duration::from_secs(30), |comm| {
        let exclude: &[usize] = match comm.rank() {
            0 => &[3],
            // Its ballot comes last: the others must wait for it all the
            // same (rank 2 alone leaves it out).
            1 => {
                std::thread::sleep(Duration::from_millis(300));
                &[3]
            }
            2 => &[1, 3],
            _ => return None,
        };
        let r = comm.shrink(exclude, false, None);
        let r = r.map(|_| ()).map_err(|e| (e.kind(), e.to_string()));
        // Rank 3 was left out by some: the job's parent still works.
        Some(r)
    });
    for (rank, r) in results.into_iter().enumerate().take(3) {
        let (kind, text) = r.unwrap().expect_err("different exclude lists shrank");
        assert_eq!(kind, ErrorKind::Mismatch, "rank {rank}: {text}");
        assert!(text.contains("same exclude_ranks"), "rank {rank}: {text}");
    }
}

#[test]
fn abort_from_another_thread_does_not_wait_for_a_shrink_under_way() {
    let results = common::world(2, common::opts(3_000), Duration::from_secs(30), |comm| {
        if comm.rank() == 1 {
            // Alive, but never shrinks: rank 0 waits for it to the timeout.
            std::thread::sleep(Duration::from_secs(4));
            return (0.0, 0.0, 0);
        }
        let aborter = comm.abort_handle();
        let watchdog = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let t = std::time::Instant::now();
            aborter.abort();
            t.elapsed().as_secs_f64()
        });
        let t = std::time::Instant::now();
        let child = comm.shrink(&[], false, None).unwrap();
        let took = t.elapsed().as_secs_f64();
        (watchdog.join().unwrap(), took, child.size())
    });
    let (abort_took, shrink_took, size) = results[0];
    assert!(
        abort_took < 0.5,
        "rdist_comm_abort waited {abort_took} s for the shrink"
    );
    // Rank 1 answered its probes but never called: left out near the timeout.
    assert!(
        (2.0..3.5).contains(&shrink_took),
        "shrink took {shrink_took} s"
    );
    assert_eq!(size, 1);
}
