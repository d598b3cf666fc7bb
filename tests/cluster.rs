//! Across hosts, on one machine: a cluster of network namespaces joined by
//! a bridge (scripts/cluster.sh), one `rdistrun --nnodes N --node-rank k`
//! per host, the real launcher and a C program through env://. Needs root
//! and network namespaces; without them the tests print `skipped:`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/cluster.sh")
}

fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_rdistrun"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Whether this machine lets us make namespaces (root, ip, a kernel with them).
fn namespaces_available() -> bool {
    static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = format!("rdprobe{}-{n}", std::process::id());
    let made = Command::new("ip")
        .args(["netns", "add", &probe])
        .output()
        .is_ok_and(|o| o.status.success());
    if made {
        let _ = Command::new("ip").args(["netns", "del", &probe]).output();
    }
    made
}

macro_rules! need_namespaces {
    () => {
        if !namespaces_available() {
            println!("skipped: cannot create network namespaces here (needs root and `ip`)");
            return;
        }
    };
}

/// A cluster that is torn down when dropped.
struct Cluster {
    name: String,
}

impl Cluster {
    fn up(tag: &str, hosts: usize, extra: &[&str]) -> Cluster {
        let name = format!("rd{tag}{}", std::process::id() % 10000);
        let out = Command::new("bash")
            .arg(script())
            .args(["up", &hosts.to_string(), "--name", &name])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cluster up: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Cluster { name }
    }

    /// Runs `command` (a shell line) on every host; returns (success, output).
    fn run(&self, command: &str, limit: Duration) -> (bool, String) {
        let out = common::output_within(
            Command::new("bash")
                .arg(script())
                .args(["run", "--name", &self.name, "--", "sh", "-c", command])
                .env("LD_LIBRARY_PATH", bin_dir()),
            limit,
            "cluster.sh run",
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }

    fn namespaces(name: &str) -> Vec<String> {
        let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&format!("{name}-")))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .args(["down", "--name", &self.name])
            .output();
    }
}

#[test]
fn three_hosts_run_a_job_and_leave_nothing_behind() {
    need_namespaces!();
    let prog = std::env::temp_dir().join(format!("rdist-cluster-ranks-{}", std::process::id()));
    common::compile_c("tests/c/rdistrun_ranks.c", &prog, &bin_dir());
    let cluster = Cluster::up("c", 3, &["--rate", "1gbit"]);
    let name = cluster.name.clone();
    assert_eq!(
        Cluster::namespaces(&name).len(),
        4,
        "3 hosts and the switch"
    );
    let command = format!(
        "RDIST_DEBUG=INFO exec {}/rdistrun --nnodes 3 --node-rank $CLUSTER_HOST \
         --nproc-per-node 2 --master-addr $CLUSTER_MASTER --master-port {} \
         --auth-token cluster-secret {} alone 1.5 2",
        bin_dir().display(),
        common::free_port(),
        prog.display()
    );
    let (ok, text) = cluster.run(&command, Duration::from_secs(120));
    assert!(ok, "the job failed:\n{text}");
    for rank in 0..6 {
        assert!(
            text.contains(&format!("rank {rank} size 6 sum 9 12")),
            "rank {rank} did not print its sum:\n{text}"
        );
    }
    // Each host's two ranks share one host id, and memory; the hosts are
    // apart (their namespaces differ, though the hostname is the same):
    // one communicator, shared memory inside a host and TCP between.
    let joined: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("joined 6 ranks"))
        .collect();
    assert_eq!(joined.len(), 6, "{text}");
    for line in joined {
        assert!(
            line.contains("over shared memory on this host, tcp to the others, 2 ranks on"),
            "{line}"
        );
    }
    drop(cluster);
    let _ = std::fs::remove_file(&prog);
    assert!(
        Cluster::namespaces(&name).is_empty(),
        "namespaces left behind"
    );
}

/// A link pulled in the middle of a job (host 2's cable): every rank on
/// every host fails within the timeout, each says what it could see (the
/// far side: the store did not answer; the near side: the ranks behind
/// the link published nothing), and every rdistrun exits.
#[test]
fn a_pulled_link_fails_every_rank_on_every_host() {
    need_namespaces!();
    let cluster = Cluster::up("p", 3, &[]);
    let puller = {
        let name = cluster.name.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(4));
            Command::new("bash")
                .arg(script())
                .args(["link", "2", "down", "--name", &name])
                .output()
                .unwrap()
        })
    };
    let command = format!(
        "RDIST_TIMEOUT_MS=5000 exec {bin}/rdistrun --nnodes 3 --node-rank $CLUSTER_HOST \
         --nproc-per-node 2 --master-addr $CLUSTER_MASTER --master-port {port} \
         --auth-token t --report-s 8 {bin}/rdist-bench --op allreduce --min-bytes 64K \
         --max-bytes 64K --seconds 1 --reps 100 --no-check",
        bin = bin_dir().display(),
        port = common::free_port()
    );
    let start = std::time::Instant::now();
    let (ok, text) = cluster.run(&command, Duration::from_secs(90));
    let took = start.elapsed();
    assert!(puller.join().unwrap().status.success());
    assert!(!ok, "the job went on without host 2:\n{text}");
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{text}");
    for host in 0..3 {
        assert!(
            text.contains(&format!("[host {host}] rdistrun: rank")),
            "host {host}'s rdistrun did not report:\n{text}"
        );
    }
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("] [rank ") && l.contains("rdist-bench: rank"))
        .collect();
    assert_eq!(errors.len(), 6, "every rank reports:\n{text}");
    for line in errors {
        // Behind the link the store cannot be reached; on the near side the
        // ranks behind it published nothing (or, once rank 0 has exited
        // with its own report, its store is gone too).
        let store_gone = line.contains("could not say what the other ranks last did");
        let says = if line.starts_with("[host 2]") {
            store_gone
        } else {
            // Every rank of host 2 went quiet at once: the network is named.
            (line.contains("ranks 4, 5 published nothing: every rank of host 10.77.")
                && line.contains("the network between it and the others"))
                || store_gone
        };
        assert!(says, "{line}");
    }
}

/// Loss and delay between hosts (1 % of packets dropped and 5 ms added,
/// each way, on every host's link): TCP retransmits under every
/// collective, and every one of them, at every size the bench runs,
/// still completes with results equal to the reference (rdist-bench
/// checks each and exits 3 on a wrong element).
#[test]
fn every_collective_is_exact_over_lossy_slow_links() {
    need_namespaces!();
    let cluster = Cluster::up("l", 3, &["--delay", "5ms", "--loss", "1%"]);
    let command = format!(
        "RDIST_TIMEOUT_MS=30000 exec {bin}/rdistrun --nnodes 3 --node-rank $CLUSTER_HOST \
         --nproc-per-node 2 --master-addr $CLUSTER_MASTER --master-port {port} \
         --auth-token t {bin}/rdist-bench --op all --min-bytes 8 --max-bytes 1M \
         --factor 32 --seconds 0.02 --reps 1",
        bin = bin_dir().display(),
        port = common::free_port()
    );
    let (ok, text) = cluster.run(&command, Duration::from_secs(150));
    assert!(ok, "the job failed:\n{text}");
    for op in [
        "allreduce",
        "broadcast",
        "reduce",
        "allgather",
        "reduce_scatter",
        "alltoall",
        "barrier",
        "sendrecv",
    ] {
        assert!(
            text.contains(&format!("[rank 0] # {op}\n")),
            "no {op}:\n{text}"
        );
    }
    assert!(
        text.contains("[rank 0] # out of bounds values : 0 OK"),
        "{text}"
    );
    // The impairment was real: TCP had to retransmit.
    let retrans = Command::new("ip")
        .args([
            "netns",
            "exec",
            &format!("{}-h1", cluster.name),
            "cat",
            "/proc/net/snmp",
        ])
        .output()
        .unwrap();
    let snmp = String::from_utf8_lossy(&retrans.stdout);
    let tcp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Tcp:")).collect();
    let column = tcp[0]
        .split_whitespace()
        .position(|c| c == "RetransSegs")
        .unwrap();
    let segs: u64 = tcp[1]
        .split_whitespace()
        .nth(column)
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        segs > 0,
        "no segment was retransmitted: the loss did not happen"
    );
}
