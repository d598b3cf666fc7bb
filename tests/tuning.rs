//! The tuning model in real processes started by `rdistrun`: every rank
//! chooses its crossovers from rank 0's host's profile (published in the
//! roster), whatever its own says, so the ranks run the same algorithm;
//! a machine is measured once and cached; `RDIST_DEBUG=INFO` says why.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A profile four times faster over TCP than the reference machine
/// (`tuner::REFERENCE`): the latency-bound algorithms keep 4x larger
/// messages over TCP.
const FAST_TCP: &str = "machine2 cores=2 copy_one_mbs=8000 copy_all_mbs=13000 handoff_ns=60 \
                        tcp_latency_ns=9000 tcp_mbs=8000 cache_kib=32768";
/// One four times slower: 4x smaller.
const SLOW_TCP: &str = "machine2 cores=2 copy_one_mbs=8000 copy_all_mbs=13000 handoff_ns=60 \
                        tcp_latency_ns=9000 tcp_mbs=500 cache_kib=32768";

/// Runs `script` as each of `n` ranks under rdistrun, with `env`; the
/// output (both streams) once it exits, within 60 s.
fn launch(n: usize, script: &str, env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rdistrun"));
    cmd.args([
        "--nproc-per-node",
        &n.to_string(),
        "--no-tty",
        "sh",
        "-c",
        script,
    ])
    .env("BENCH", env!("CARGO_BIN_EXE_rdist-bench"))
    .env("RDIST_DEBUG", "INFO")
    .env_remove("RDIST_MACHINE")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("rdistrun starts");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        let mut e = String::new();
        let _ = err.read_to_string(&mut e);
        s + &e
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("rdistrun did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status.success(), reader.join().unwrap())
}

/// Each rank's "tuning:" line.
fn tuning_lines(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.contains("tuning: ")).collect()
}

#[test]
fn every_rank_chooses_from_rank_0s_profile_whatever_its_own_says() {
    // Rank 1 is a host of its own whose profile says TCP is slow
    // (crossovers 4x smaller); rank 0's host's says fast (4x larger). An
    // allreduce of 128 KiB over TCP lies between: recursive doubling by
    // rank 0's profile, the ring by rank 1's, and ranks that disagreed
    // would fail with a mismatch.
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then export RDIST_MACHINE='{SLOW_TCP}' RDIST_HOST_ID=rank1-host; fi; \
         exec \"$BENCH\" --op allreduce --min-bytes 128K --max-bytes 128K --reps 2 --seconds 0.01"
    );
    let (ok, out) = launch(
        3,
        &script,
        &[("RDIST_MACHINE", FAST_TCP), ("RDIST_TRANSPORT", "tcp")],
    );
    assert!(ok, "{out}");
    let lines = tuning_lines(&out);
    assert_eq!(lines.len(), 3, "{out}");
    for line in lines {
        assert!(
            line.contains("on shared memory and 256 KiB over TCP"),
            "every rank takes rank 0's crossovers: {line}"
        );
        assert!(line.contains("chain over TCP from 16 MiB"), "{line}");
    }
    assert!(out.contains("# out of bounds values : 0 OK"), "{out}");
}

/// The machine profiles cached in `dir`.
fn profiles(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect()
}

#[test]
fn a_machine_is_measured_once_and_its_profile_cached() {
    let dir = std::env::temp_dir().join(format!("rdist-tuning-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = dir.to_str().unwrap();
    let script =
        "exec \"$BENCH\" --op allreduce --min-bytes 8 --max-bytes 8 --reps 1 --seconds 0.01";
    let (ok, out) = launch(2, script, &[("RDIST_CACHE_DIR", cache)]);
    assert!(ok, "{out}");
    let files = profiles(&dir);
    assert_eq!(files.len(), 1, "one profile per machine: {files:?}");
    let line = std::fs::read_to_string(&files[0]).unwrap();
    assert!(line.starts_with("machine4 cores="), "{line}");
    let cores = line
        .split_whitespace()
        .nth(1)
        .unwrap()
        .trim_start_matches("cores=");
    // With two cores, the two ways of moving a payload between them were
    // measured, and the model says which it takes.
    let two_cores = cores.parse::<u32>().unwrap() >= 2;
    if two_cores {
        assert!(
            !line.contains(" pass_mbs=0 ") && !line.contains(" cma_mbs=0 "),
            "{line}"
        );
    }
    for l in tuning_lines(&out) {
        assert!(
            l.contains(&format!("crossovers from rank 0's host ({cores} cores")),
            "{l}"
        );
        assert_eq!(
            l.contains("through the rings, one copies"),
            two_cores,
            "{l}"
        );
    }
    // A second run reads it: the file stays as it was.
    let modified = std::fs::metadata(&files[0]).unwrap().modified().unwrap();
    let (ok, out) = launch(2, script, &[("RDIST_CACHE_DIR", cache)]);
    assert!(ok, "{out}");
    assert_eq!(
        std::fs::metadata(&files[0]).unwrap().modified().unwrap(),
        modified
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_that_run_one_call_by_different_algorithms_are_told_which() {
    // Rank 1 alone forces the ring: the call is the same on every rank,
    // the algorithm not, and the error names both algorithms.
    let script = "if [ \"$RANK\" = 1 ]; then export RDIST_ALGO=ring; fi; \
                  exec \"$BENCH\" --op allreduce --min-bytes 1K --max-bytes 1K --reps 1 --seconds 0.01";
    let (ok, out) = launch(3, script, &[("RDIST_ALGO", "recursive_doubling")]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("by different algorithms (ring here, recursive_doubling there")
            || out.contains("by different algorithms (recursive_doubling here, ring there"),
        "{out}"
    );
}

/// The CPUs this process may run on (/proc/self/status's list).
fn allowed_cpus() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let Some(list) = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
    else {
        return Vec::new();
    };
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        if let (Ok(lo), Ok(hi)) = (lo.parse::<usize>(), hi.parse::<usize>()) {
            cpus.extend(lo..=hi);
        }
    }
    cpus
}

#[test]
fn ranks_bound_to_cores_of_their_own_spin_and_measure_the_whole_machine() {
    // A launcher that binds each rank to one core (srun --cpu-bind=cores,
    // mpirun --bind-to core) leaves each rank one CPU: the host's ranks
    // have two together, and are not oversubscribed; bound to one CPU
    // together, they are.
    let cpus = allowed_cpus();
    let [a, b, ..] = cpus[..] else {
        println!("skipped: binding ranks to cores of their own needs 2 CPUs (have {cpus:?})");
        return;
    };
    let dir = std::env::temp_dir().join(format!("rdist-tuning-bound-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = dir.to_str().unwrap();
    let run = |cpu: &str| {
        let script = format!(
            "exec taskset -c {cpu} \"$BENCH\" --op allreduce --min-bytes 8 --max-bytes 8 --reps 1 --seconds 0.01"
        );
        let (ok, out) = launch(2, &script, &[("RDIST_CACHE_DIR", cache)]);
        assert!(ok, "{out}");
        let lines: Vec<String> = tuning_lines(&out).iter().map(|l| l.to_string()).collect();
        assert_eq!(lines.len(), 2, "{out}");
        lines
    };
    // (Memory-bound or not: that is the machine's profile.)
    for line in run(&format!("$([ \"$RANK\" = 0 ] && echo {a} || echo {b})")) {
        assert!(line.contains("2 ranks here on 2 cores"), "{line}");
        assert!(!line.contains("oversubscribed"), "{line}");
        assert!(line.contains("spin"), "{line}");
    }
    // The profile, measured by a rank bound to one core, is the
    // machine's: its cores, and two of them passing bytes.
    let files = profiles(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let profile = std::fs::read_to_string(&files[0]).unwrap();
    assert!(
        profile.starts_with("machine4 cores=") && !profile.starts_with("machine4 cores=1 "),
        "{profile}"
    );
    assert!(!profile.contains(" pass_mbs=0 "), "{profile}");
    for line in run(&a.to_string()) {
        assert!(line.contains("2 ranks here on 1 cores"), "{line}");
        assert!(line.contains("oversubscribed"), "{line}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
