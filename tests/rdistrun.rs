//! End-to-end tests of the `rdistrun` launcher binary, with `sh -c` scripts as ranks.
//! Every run is bounded: a launcher that outlives `RUN_LIMIT` is killed and the
//! test fails.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

const RUN_LIMIT: Duration = Duration::from_secs(20);

/// A launcher that is still running; its stdout is read line by line.
struct Launcher {
    child: Child,
    started: Instant,
    stdout_lines: Receiver<String>,
    stdout_seen: Vec<String>,
    stderr: JoinHandle<String>,
}

/// A launcher that has exited.
struct Finished {
    status: ExitStatus,
    elapsed: Duration,
    stdout: Vec<String>,
    stderr: String,
}

impl Finished {
    fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// The stderr lines rdistrun wrote itself (not a rank's).
    fn launcher_messages(&self) -> Vec<&str> {
        self.stderr
            .lines()
            .filter(|line| line.starts_with("rdistrun:"))
            .collect()
    }
}

impl Launcher {
    fn start(args: &[&str]) -> Launcher {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rdistrun"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("rdistrun should start");
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        Launcher {
            child,
            started: Instant::now(),
            stdout_lines: send_lines(stdout),
            stdout_seen: Vec::new(),
            stderr: thread::spawn(move || read_all(stderr)),
        }
    }

    fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }

    fn deadline(&self) -> Instant {
        self.started + RUN_LIMIT
    }

    /// Waits for the next stdout line, failing the test at the deadline.
    fn next_line(&mut self) -> String {
        let left = self.deadline().saturating_duration_since(Instant::now());
        match self.stdout_lines.recv_timeout(left) {
            Ok(line) => {
                self.stdout_seen.push(line.clone());
                line
            }
            Err(error) => {
                self.kill();
                panic!(
                    "no stdout line from rdistrun ({error:?}); so far: {:?}",
                    self.stdout_seen
                )
            }
        }
    }

    fn send_signal(&self, signal: libc::c_int) {
        // SAFETY: plain system call on our own child, which is not reaped yet.
        assert_eq!(unsafe { libc::kill(self.pid(), signal) }, 0);
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for exit and collects the output, failing the test at the deadline.
    fn finish(mut self) -> Finished {
        let status = loop {
            match self.child.try_wait().expect("waitpid on rdistrun") {
                Some(status) => break status,
                None if Instant::now() >= self.deadline() => {
                    self.kill();
                    panic!("rdistrun ran longer than {RUN_LIMIT:?}; killed it");
                }
                None => thread::sleep(Duration::from_millis(10)),
            }
        };
        let elapsed = self.started.elapsed();
        loop {
            let left = self.deadline().saturating_duration_since(Instant::now());
            match self.stdout_lines.recv_timeout(left) {
                Ok(line) => self.stdout_seen.push(line),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => panic!("rdistrun's stdout stayed open"),
            }
        }
        Finished {
            status,
            elapsed,
            stdout: self.stdout_seen,
            stderr: self.stderr.join().expect("stderr reader"),
        }
    }
}

fn send_lines(source: impl Read + Send + 'static) -> Receiver<String> {
    let (sender, receiver) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(source).lines() {
            let Ok(line) = line else { break };
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    receiver
}

fn read_all(mut source: impl Read) -> String {
    let mut text = String::new();
    let _ = source.read_to_string(&mut text);
    text
}

fn run(args: &[&str]) -> Finished {
    Launcher::start(args).finish()
}

/// Splits "[rank R] rest" into (R, rest).
fn split_prefix(line: &str) -> (usize, &str) {
    let rest = line
        .strip_prefix("[rank ")
        .unwrap_or_else(|| panic!("line without rank prefix: {line:?}"));
    let (rank, text) = rest
        .split_once("] ")
        .unwrap_or_else(|| panic!("malformed prefix: {line:?}"));
    (rank.parse().expect("rank number in prefix"), text)
}

/// Parses "KEY=value KEY=value" as printed by `ENV_SCRIPT`, keyed by prefix rank.
fn env_by_rank(lines: &[String]) -> HashMap<usize, HashMap<String, String>> {
    lines
        .iter()
        .map(|line| {
            let (rank, text) = split_prefix(line);
            let vars = text
                .split_whitespace()
                .filter_map(|pair| pair.split_once('='))
                .map(|(key, value)| (key.to_string(), value.to_string()))
                .collect();
            (rank, vars)
        })
        .collect()
}

const ENV_SCRIPT: &str = "echo RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK \
    LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE NODE_RANK=$NODE_RANK GROUP_RANK=$GROUP_RANK \
    MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT RDIST_LAUNCHER=$RDIST_LAUNCHER";

fn process_exists(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Reads "[rank R] ready PID" lines from `count` ranks; returns the pids.
fn wait_until_ready(launcher: &mut Launcher, count: usize) -> Vec<libc::pid_t> {
    let mut pids = Vec::new();
    while pids.len() < count {
        let line = launcher.next_line();
        let (_, text) = split_prefix(&line);
        if let Some(pid) = text.strip_prefix("ready ") {
            pids.push(pid.parse().expect("pid after 'ready'"));
        }
    }
    pids
}

#[test]
fn three_ranks_get_their_environment() {
    let out = run(&["--nproc-per-node", "3", "sh", "-c", ENV_SCRIPT]);
    assert_eq!(out.code(), Some(0), "stderr: {}", out.stderr);
    assert_eq!(out.stderr, "");
    assert_eq!(out.stdout.len(), 3, "{:?}", out.stdout);
    let env = env_by_rank(&out.stdout);
    let port = &env[&0]["MASTER_PORT"];
    let port_number: u16 = port.parse().expect("MASTER_PORT is a port number");
    assert_ne!(port_number, 0);
    for rank in 0..3 {
        let vars = &env[&rank];
        let expect = |key: &str, value: &str| assert_eq!(vars[key], value, "{key} of rank {rank}");
        expect("RANK", &rank.to_string());
        expect("WORLD_SIZE", "3");
        expect("LOCAL_RANK", &rank.to_string());
        expect("LOCAL_WORLD_SIZE", "3");
        expect("NODE_RANK", "0");
        expect("GROUP_RANK", "0");
        expect("MASTER_ADDR", "127.0.0.1");
        expect("MASTER_PORT", port);
        expect("RDIST_LAUNCHER", "rdistrun");
    }
}

#[test]
fn second_node_numbers_ranks_after_the_first() {
    let out = run(&[
        "--nnodes",
        "2",
        "--node-rank=1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "10.1.2.3",
        "--master-port=29511",
        "--",
        "sh",
        "-c",
        ENV_SCRIPT,
    ]);
    assert_eq!(out.code(), Some(0), "stderr: {}", out.stderr);
    let env = env_by_rank(&out.stdout);
    let mut ranks: Vec<usize> = env.keys().copied().collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [2, 3]);
    for (local, rank) in [(0, 2), (1, 3)] {
        let vars = &env[&rank];
        assert_eq!(vars["RANK"], rank.to_string());
        assert_eq!(vars["WORLD_SIZE"], "4");
        assert_eq!(vars["LOCAL_RANK"], local.to_string());
        assert_eq!(vars["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(vars["NODE_RANK"], "1");
        assert_eq!(vars["MASTER_ADDR"], "10.1.2.3");
        assert_eq!(vars["MASTER_PORT"], "29511");
    }
}

#[test]
fn success_prints_only_the_ranks_output() {
    let out = run(&["--nproc-per-node", "2", "true"]);
    assert_eq!(out.code(), Some(0));
    assert!(out.stdout.is_empty(), "{:?}", out.stdout);
    assert_eq!(out.stderr, "");
}

#[test]
fn output_is_prefixed_per_stream_and_final_lines_are_kept() {
    let script = "echo out; echo err >&2; printf 'no newline'";
    let out = run(&["--nproc-per-node", "2", "sh", "-c", script]);
    assert_eq!(out.code(), Some(0));
    let mut stdout = out.stdout.clone();
    stdout.sort();
    assert_eq!(
        stdout,
        [
            "[rank 0] no newline",
            "[rank 0] out",
            "[rank 1] no newline",
            "[rank 1] out"
        ]
    );
    let mut stderr: Vec<&str> = out.stderr.lines().collect();
    stderr.sort_unstable();
    assert_eq!(stderr, ["[rank 0] err", "[rank 1] err"]);
}

#[test]
fn no_prefix_passes_lines_through() {
    let out = run(&["--no-prefix", "sh", "-c", "echo plain; printf last"]);
    assert_eq!(out.code(), Some(0));
    assert_eq!(out.stdout, ["plain", "last"]);
}

#[test]
fn lines_of_different_ranks_never_interleave() {
    let payload = "x".repeat(3000);
    let script = "i=0; while [ $i -lt 200 ]; do echo \"$RANK:$1\"; i=$((i+1)); done";
    let out = run(&["--nproc-per-node", "4", "sh", "-c", script, "sh", &payload]);
    assert_eq!(out.code(), Some(0));
    let mut counts = [0; 4];
    for line in &out.stdout {
        let (rank, text) = split_prefix(line);
        assert_eq!(text, format!("{rank}:{payload}"), "mangled line");
        counts[rank] += 1;
    }
    assert_eq!(counts, [200; 4]);
}

#[test]
fn failing_rank_stops_the_others_with_its_exit_code() {
    let script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 30";
    let out = run(&["--nproc-per-node", "3", "sh", "-c", script]);
    assert_eq!(out.code(), Some(3), "stderr: {}", out.stderr);
    assert!(
        out.elapsed < Duration::from_secs(10),
        "took {:?}",
        out.elapsed
    );
    let messages = out.launcher_messages();
    assert_eq!(messages.len(), 1, "{messages:?}");
    let summary = messages[0];
    assert!(summary.starts_with("rdistrun: rank 1 (pid "), "{summary}");
    assert!(
        summary.ends_with("failed first: exited with code 3; stopped ranks 0, 2"),
        "{summary}"
    );
}

#[test]
fn rank_killed_by_a_signal_gives_128_plus_signal() {
    let script = "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; sleep 30";
    let out = run(&["--nproc-per-node", "2", "sh", "-c", script]);
    assert_eq!(out.code(), Some(128 + 9), "stderr: {}", out.stderr);
    assert!(
        out.elapsed < Duration::from_secs(10),
        "took {:?}",
        out.elapsed
    );
    let messages = out.launcher_messages();
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].contains("rank 1 (pid ")
            && messages[0].contains("failed first: killed by signal 9 (SIGKILL); stopped rank 0"),
        "{}",
        messages[0]
    );
}

#[test]
fn ranks_ignoring_sigterm_are_killed_after_the_grace_period() {
    // Rank 1 waits so that the others have set up their trap before it fails.
    let script = "if [ \"$RANK\" = 1 ]; then sleep 1; exit 4; fi; trap '' TERM; sleep 30";
    let out = run(&[
        "--grace-s",
        "0.5",
        "--nproc-per-node",
        "3",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(out.code(), Some(4), "stderr: {}", out.stderr);
    assert!(
        out.elapsed < Duration::from_secs(10),
        "took {:?}",
        out.elapsed
    );
    let messages = out.launcher_messages();
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].ends_with("stopped ranks 0, 2 (SIGKILL needed for ranks 0, 2)"),
        "{}",
        messages[0]
    );
}

#[test]
fn sigint_is_forwarded_to_every_rank() {
    // A generous grace period: the ranks must stop because of the SIGINT itself.
    let script = "echo ready $$; sleep 30";
    let mut launcher = Launcher::start(&[
        "--grace-s",
        "30",
        "--nproc-per-node",
        "3",
        "sh",
        "-c",
        script,
    ]);
    let pids = wait_until_ready(&mut launcher, 3);
    let interrupted = Instant::now();
    launcher.send_signal(libc::SIGINT);
    let out = launcher.finish();
    assert!(
        interrupted.elapsed() < Duration::from_secs(5),
        "took {:?}",
        interrupted.elapsed()
    );
    assert_eq!(out.code(), Some(128 + 2), "stderr: {}", out.stderr);
    assert_eq!(
        out.launcher_messages(),
        ["rdistrun: interrupted by signal 2 (SIGINT); stopped ranks 0, 1, 2"]
    );
    for pid in pids {
        assert!(!process_exists(pid), "rank process {pid} survived");
    }
}

#[test]
fn sigterm_is_forwarded_too() {
    let mut launcher = Launcher::start(&[
        "--nproc-per-node",
        "2",
        "sh",
        "-c",
        "echo ready $$; sleep 30",
    ]);
    wait_until_ready(&mut launcher, 2);
    launcher.send_signal(libc::SIGTERM);
    let out = launcher.finish();
    assert_eq!(out.code(), Some(128 + 15), "stderr: {}", out.stderr);
    assert!(
        out.elapsed < Duration::from_secs(10),
        "took {:?}",
        out.elapsed
    );
}

#[test]
fn second_sigint_escalates_to_sigkill() {
    let script = "trap '' INT; echo ready $$; sleep 30";
    let mut launcher = Launcher::start(&[
        "--grace-s",
        "30",
        "--nproc-per-node",
        "2",
        "sh",
        "-c",
        script,
    ]);
    let pids = wait_until_ready(&mut launcher, 2);
    launcher.send_signal(libc::SIGINT);
    thread::sleep(Duration::from_millis(300));
    launcher.send_signal(libc::SIGINT);
    let out = launcher.finish();
    assert!(
        out.elapsed < Duration::from_secs(10),
        "took {:?}",
        out.elapsed
    );
    assert_eq!(out.code(), Some(128 + 2), "stderr: {}", out.stderr);
    assert_eq!(
        out.launcher_messages(),
        ["rdistrun: interrupted by signal 2 (SIGINT); stopped ranks 0, 1 (SIGKILL needed for ranks 0, 1)"]
    );
    for pid in pids {
        assert!(!process_exists(pid), "rank process {pid} survived");
    }
}

#[test]
fn missing_program_exits_127() {
    let out = run(&[
        "--nproc-per-node",
        "2",
        "/nonexistent/rdistrun-test-program",
    ]);
    assert_eq!(out.code(), Some(127));
    assert_eq!(
        out.launcher_messages(),
        ["rdistrun: cannot start '/nonexistent/rdistrun-test-program': No such file or directory"]
    );
    let out = run(&["rdistrun-no-such-program-on-path"]);
    assert_eq!(out.code(), Some(127));
    assert!(out
        .stderr
        .contains("cannot start 'rdistrun-no-such-program-on-path'"));
}

#[test]
fn bad_arguments_exit_2_with_usage() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "missing PROGRAM"),
        (
            &["--nproc-per-node", "0", "true"],
            "--nproc-per-node must be at least 1",
        ),
        (
            &["--nproc-per-node=abc", "true"],
            "--nproc-per-node must be",
        ),
        (&["--nproc-per-node"], "--nproc-per-node requires a value"),
        (
            &["--nnodes", "2", "--node-rank", "2", "true"],
            "--node-rank must be less than --nnodes",
        ),
        (
            &["--master-port", "65536", "true"],
            "--master-port must be a port number",
        ),
        (&["--grace-s", "soon", "true"], "--grace-s must be"),
        (&["--frobnicate", "true"], "unknown option '--frobnicate'"),
    ];
    for (args, message) in cases {
        let out = run(args);
        assert_eq!(out.code(), Some(2), "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains(message), "{args:?}: {}", out.stderr);
        assert!(
            out.stderr.contains("usage: rdistrun"),
            "{args:?}: {}",
            out.stderr
        );
    }
}

#[test]
fn help_and_version() {
    let out = run(&["--help"]);
    assert_eq!(out.code(), Some(0));
    assert!(out.stdout[0].starts_with("usage: rdistrun"));
    let out = run(&["--version"]);
    assert_eq!(out.code(), Some(0));
    assert!(out.stdout[0].starts_with("rdistrun "));
}
