//! A live 4-rank job (real processes, env://, no token) under attack:
//! thousands of garbage, silent, slow, oversized and bogus-hello
//! connections thrown at rank 0's store and at every rank's listener while
//! the ranks run checked allreduces. Not one result may be wrong, the job
//! must keep running, and rank 0's threads, descriptors and memory must
//! stay bounded.

mod common;

use rdist::store::{Store, TcpStoreClient};
use rdist::{Comm, Options, ReduceOp};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const JOB_SECONDS: f64 = 14.0;

/// (threads, descriptors, resident KiB) of this process.
fn usage() -> (usize, usize, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0);
    (field("Threads:"), fds, field("VmRSS:"))
}

/// Not a test of its own: the body of the rank processes (does nothing
/// without RDIST_ATTACKED_RANK).
#[test]
fn rank_process() {
    if std::env::var("RDIST_ATTACKED_RANK").is_err() {
        return;
    }
    let comm = Comm::init("env://", -1, -1, &Options::default()).unwrap();
    let (rank, size) = (comm.rank(), comm.size());
    let base = usage();
    let peak = Arc::new([
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ]);
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (t, f, r) = usage();
                peak[0].fetch_max(t, Ordering::Relaxed);
                peak[1].fetch_max(f, Ordering::Relaxed);
                peak[2].fetch_max(r, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    println!("READY");
    let until = Instant::now() + Duration::from_secs_f64(JOB_SECONDS);
    let (mut iterations, mut wrong) = (0u64, 0u64);
    let value =
        |r: usize, it: u64, i: usize| ((r as u64 * 7919 + it * 31 + i as u64) % 1000) as f64;
    loop {
        // Element 0 says whether this rank goes on; all stop together.
        let mut buf: Vec<f64> = (0..4096).map(|i| value(rank, iterations, i)).collect();
        buf[0] = f64::from(u8::from(Instant::now() < until));
        comm.allreduce(&mut buf, ReduceOp::Sum).unwrap();
        for (i, got) in buf.iter().enumerate().skip(1) {
            let want: f64 = (0..size).map(|r| value(r, iterations, i)).sum();
            if *got != want {
                wrong += 1;
            }
        }
        iterations += 1;
        if buf[0] < size as f64 {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    comm.barrier().unwrap();
    println!(
        "RESULT rank={rank} iterations={iterations} wrong={wrong} threads={}/{} fds={}/{} rss_kib={}/{}",
        base.0,
        peak[0].load(Ordering::Relaxed),
        base.1,
        peak[1].load(Ordering::Relaxed),
        base.2,
        peak[2].load(Ordering::Relaxed),
    );
}

fn spawn_rank(rank: usize, port: u16) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "rank_process",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("RDIST_ATTACKED_RANK", "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "4")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("RDIST_TIMEOUT_MS", "60000")
        .env_remove("RDIST_AUTH_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Counts of what was thrown.
#[derive(Default)]
struct Thrown {
    garbage: AtomicUsize,
    silent: AtomicUsize,
    slow: AtomicUsize,
    oversized: AtomicUsize,
    hellos: AtomicUsize,
}

fn connect(addr: SocketAddr) -> Option<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    Some(s)
}

/// The TCPStore validation bytes, then a set with a value length claimed
/// (and `value` bytes of it sent).
fn store_set(key: &str, claimed: u64, value: usize) -> Vec<u8> {
    let mut b = vec![0u8, 0xCE, 0xF7, 0x85, 0x3C, 1];
    b.extend_from_slice(&(key.len() as u64).to_le_bytes());
    b.extend_from_slice(key.as_bytes());
    b.extend_from_slice(&claimed.to_le_bytes());
    b.extend(std::iter::repeat_n(7u8, value));
    b
}

fn attack(store: SocketAddr, ranks: Vec<SocketAddr>, thrown: Arc<Thrown>, until: Instant) {
    let mut targets = vec![store];
    targets.extend(ranks);
    let mut workers = Vec::new();
    // Garbage: random bytes, then hang up (store and every listener).
    for w in 0..2 {
        let (targets, thrown) = (targets.clone(), thrown.clone());
        workers.push(std::thread::spawn(move || {
            let mut x = 0x2545_F491_4F6C_DD1Du64 + w;
            let mut i = 0;
            while Instant::now() < until {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if let Some(mut s) = connect(targets[i % targets.len()]) {
                    let junk: Vec<u8> = (0..1 + x % 300).map(|k| (x >> (k % 56)) as u8).collect();
                    let _ = s.write_all(&junk);
                    thrown.garbage.fetch_add(1, Ordering::Relaxed);
                }
                i += 1;
            }
        }));
    }
    // Silent: held open until the end (300 on the store, 100 per rank).
    {
        let (targets, thrown) = (targets.clone(), thrown.clone());
        workers.push(std::thread::spawn(move || {
            let mut held = Vec::new();
            for (i, t) in targets.iter().enumerate() {
                for _ in 0..if i == 0 { 300 } else { 100 } {
                    if let Some(s) = connect(*t) {
                        held.push(s);
                        thrown.silent.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            while Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }
    // Slow: a set to the store one byte every 100 ms (50 clients).
    {
        let thrown = thrown.clone();
        workers.push(std::thread::spawn(move || {
            let mut clients: Vec<(TcpStream, Vec<u8>)> = (0..50)
                .filter_map(|i| connect(store).map(|s| (s, store_set(&format!("slow{i}"), 10, 10))))
                .collect();
            thrown.slow.fetch_add(clients.len(), Ordering::Relaxed);
            let mut at = 0;
            while Instant::now() < until {
                for (s, bytes) in clients.iter_mut() {
                    if at < bytes.len() {
                        let _ = s.write_all(&bytes[at..at + 1]);
                    }
                }
                at += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
        }));
    }
    // Oversized: claimed 1 GiB values, and real 40 MiB ones (more than
    // the store holds in all).
    {
        let thrown = thrown.clone();
        workers.push(std::thread::spawn(move || {
            for i in 0..20 {
                if let Some(mut s) = connect(store) {
                    let _ = s.write_all(&store_set(&format!("huge{i}"), 1 << 30, 1024));
                    thrown.oversized.fetch_add(1, Ordering::Relaxed);
                }
            }
            for i in 0..10 {
                if Instant::now() >= until {
                    break;
                }
                if let Some(mut s) = connect(store) {
                    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
                    let _ = s.write_all(&store_set(&format!("big{i}"), 40 << 20, 40 << 20));
                    thrown.oversized.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    // Bogus hellos to the ranks: the right size, another job.
    {
        let (targets, thrown) = (targets[1..].to_vec(), thrown.clone());
        workers.push(std::thread::spawn(move || {
            let mut i = 0usize;
            while Instant::now() < until && i < 2000 {
                if let Some(mut s) = connect(targets[i % targets.len()]) {
                    let mut hello = [0u8; 40];
                    hello[0..4].copy_from_slice(&0x5244_4831u32.to_le_bytes());
                    hello[4..20].copy_from_slice(&(i as u128).to_le_bytes());
                    hello[28] = (i % 4) as u8;
                    hello[32] = 4;
                    hello[36] = (i % 2) as u8;
                    let _ = s.write_all(&hello);
                    thrown.hellos.fetch_add(1, Ordering::Relaxed);
                }
                i += 1;
            }
        }));
    }
    for w in workers {
        let _ = w.join();
    }
}

#[test]
fn a_live_job_survives_thousands_of_hostile_connections() {
    let port = common::free_port();
    let mut ranks: Vec<Child> = (0..4).map(|r| spawn_rank(r, port)).collect();
    // Wait for rank 0 to be running its loop.
    let mut out0 = BufReader::new(ranks[0].stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("READY") {
        line.clear();
        assert!(
            out0.read_line(&mut line).unwrap() > 0,
            "rank 0 ended before its loop"
        );
    }
    // As a stranger would: read every rank's address from the store.
    let store: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let client =
        TcpStoreClient::connect(&store.to_string(), Instant::now() + Duration::from_secs(5))
            .unwrap();
    let addrs: Vec<SocketAddr> = (0..4)
        .map(|r| {
            let v = client
                .get(&format!("rdist/tcp/1/rank/{r}"), Duration::from_secs(5))
                .unwrap();
            String::from_utf8_lossy(&v)
                .split(' ')
                .nth(1)
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    println!("ranks listen at {addrs:?}");
    let thrown = Arc::new(Thrown::default());
    let start = Instant::now();
    attack(
        store,
        addrs,
        thrown.clone(),
        start + Duration::from_secs_f64(JOB_SECONDS - 3.0),
    );
    let mut results = Vec::new();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out0, &mut rest);
    results.push(rest);
    for r in ranks.iter_mut().skip(1) {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(r.stdout.as_mut().unwrap(), &mut text);
        results.push(text);
    }
    for (r, child) in ranks.iter_mut().enumerate() {
        let status = child.wait().unwrap();
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err);
        assert!(
            status.success(),
            "rank {r} failed under attack:\n{}\n{err}",
            results[r]
        );
    }
    let report: Vec<&str> = results
        .iter()
        .map(|t| {
            t.lines()
                .find(|l| l.starts_with("RESULT"))
                .expect("a RESULT line")
        })
        .collect();
    let field = |line: &str, name: &str| -> Vec<usize> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap()
            .split('/')
            .map(|n| n.parse().unwrap())
            .collect()
    };
    for line in &report {
        assert_eq!(field(line, "wrong"), [0], "{line}");
        assert!(field(line, "iterations")[0] >= 20, "{line}");
    }
    let (threads, fds, rss) = (
        field(report[0], "threads"),
        field(report[0], "fds"),
        field(report[0], "rss_kib"),
    );
    println!(
        "thrown: {} garbage, {} silent, {} slow, {} oversized, {} bogus hellos",
        thrown.garbage.load(Ordering::Relaxed),
        thrown.silent.load(Ordering::Relaxed),
        thrown.slow.load(Ordering::Relaxed),
        thrown.oversized.load(Ordering::Relaxed),
        thrown.hellos.load(Ordering::Relaxed),
    );
    for line in &report {
        println!("{line}");
    }
    assert!(thrown.garbage.load(Ordering::Relaxed) >= 1000);
    assert!(
        threads[1] <= threads[0] + 4,
        "rank 0's threads grew: {threads:?}"
    );
    assert!(
        fds[1] <= fds[0] + 1400,
        "rank 0's descriptors grew: {fds:?}"
    );
    assert!(
        rss[1] <= rss[0] + 700 * 1024,
        "rank 0's memory grew: {rss:?} KiB"
    );
}
