//! End-to-end tests of the `rdistrun` launcher binary, with `sh -c` scripts and a
//! C program (tests/c/rdistrun_ranks.c) as ranks. Every run is bounded: a
//! launcher that outlives `RUN_LIMIT` is killed and the test fails.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::OnceLock;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
        // The C rank program finds librdist.so through LD_LIBRARY_PATH.
        let mut command = Command::new(env!("CARGO_BIN_EXE_rdistrun"));
        command.args(args).env("LD_LIBRARY_PATH", lib_dir());
        Launcher::spawn(command)
    }

    /// Starts `command` with its output read as it comes.
    fn spawn(mut command: Command) -> Launcher {
        let mut child = command
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

/// `run` of rdistrun's options `args`, then `sh -c script`.
fn run_sh(args: &[&str], script: &str) -> Finished {
    let mut all = args.to_vec();
    all.extend(["sh", "-c", script]);
    run(&all)
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

/// Started by a parent that ignores SIGCHLD (which exec passes on, and
/// which has the kernel reap children itself): rdistrun still sees each
/// rank's exit and its code, and ends.
#[test]
fn a_launcher_started_with_sigchld_ignored_still_sees_its_ranks_exit() {
    use std::os::unix::process::CommandExt;
    for (script, code) in [("exit 0", 0), ("exit 3", 3)] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_rdistrun"));
        command.args(["--nproc-per-node", "2", "sh", "-c", script]);
        // SAFETY: signal() is async-signal-safe and allocates nothing.
        unsafe {
            command.pre_exec(|| {
                libc::signal(libc::SIGCHLD, libc::SIG_IGN);
                Ok(())
            });
        }
        let out = Launcher::spawn(command).finish();
        assert_eq!(out.code(), Some(code), "{}", out.stderr);
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
    let out = run_sh(&["--nproc-per-node", "2"], script);
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
    let out = run_sh(&["--nproc-per-node", "3"], script);
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
    let out = run_sh(&["--nproc-per-node", "2"], script);
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
    let out = run_sh(&["--grace-s", "0.5", "--nproc-per-node", "3"], script);
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

// ---------------------------------------------------------------------------
// A C program as ranks: stdio buffering, rdist's errors, env:// alone
// ---------------------------------------------------------------------------

/// Where cargo put librdist.so (and rdistrun) for this build profile.
fn lib_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_rdistrun"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// tests/c/rdistrun_ranks.c, compiled once per test run with -Werror against
/// the committed header and librdist.so.
fn rank_program() -> &'static str {
    static PROGRAM: OnceLock<String> = OnceLock::new();
    PROGRAM.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let program = dir.join("rdistrun_ranks");
        // Built under a name of its own, then renamed: another test run may
        // be using the program.
        let building = dir.join(format!("rdistrun_ranks.{}", std::process::id()));
        common::compile_c("tests/c/rdistrun_ranks.c", &building, &lib_dir());
        std::fs::rename(&building, &program).unwrap();
        program.to_str().expect("a UTF-8 path").to_string()
    })
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// Reads "[rank R] tick MS" lines of `ranks` ranks; returns, per line, how long
/// after the rank's printf it arrived here, and when.
fn read_ticks(launcher: &mut Launcher, ranks: usize) -> Vec<(Duration, Instant)> {
    let mut ticks = Vec::new();
    while ticks.len() < ranks {
        let line = launcher.next_line();
        let arrived = Instant::now();
        let (_, text) = split_prefix(&line);
        let printed: u128 = text
            .strip_prefix("tick ")
            .unwrap_or_else(|| panic!("expected a tick line first, got {line:?}"))
            .parse()
            .expect("milliseconds after 'tick'");
        let late = Duration::from_millis(unix_ms().saturating_sub(printed) as u64);
        ticks.push((late, arrived));
    }
    ticks
}

#[test]
fn c_printf_without_fflush_streams_line_by_line() {
    // rdistrun's own stdout is a pipe here, as when a job's output goes to a log.
    let mut launcher = Launcher::start(&["--nproc-per-node", "2", rank_program(), "tick"]);
    let started = launcher.started;
    let ticks = read_ticks(&mut launcher, 2);
    let out = launcher.finish();
    assert_eq!(out.code(), Some(0), "stderr: {}", out.stderr);
    let exited = started + out.elapsed;
    for (late, arrived) in ticks {
        assert!(
            late < Duration::from_secs(1),
            "a line came {late:?} after its printf"
        );
        // The program sleeps 4 s after the line: it must not have come at exit.
        let early = exited.saturating_duration_since(arrived);
        assert!(
            early > Duration::from_millis(2500),
            "the line came only {early:?} before the exit"
        );
    }
    let mut lines = out.stdout.clone();
    lines.sort();
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[0], "[rank 0] done");
    assert!(lines[1].starts_with("[rank 0] tick "), "{lines:?}");
    assert_eq!(lines[2], "[rank 1] done");
    assert!(lines[3].starts_with("[rank 1] tick "), "{lines:?}");
    // Raw terminal: no "\r" added before "\n".
    assert!(lines.iter().all(|l| !l.contains('\r')), "{lines:?}");
}

#[test]
fn with_no_tty_c_stdio_buffers_until_exit() {
    // The reference for the test above: through a pipe the line waits in the
    // program's stdio buffer until it exits, 4 s after the printf.
    let mut launcher = Launcher::start(&["--no-tty", rank_program(), "tick"]);
    let ticks = read_ticks(&mut launcher, 1);
    let out = launcher.finish();
    assert_eq!(out.code(), Some(0), "stderr: {}", out.stderr);
    assert!(
        ticks[0].0 > Duration::from_secs(3),
        "the line came {:?} after its printf",
        ticks[0].0
    );
    assert_eq!(out.stdout.last().map(String::as_str), Some("[rank 0] done"));
}

/// The lines of `text` with prefix "[rank R] ", without it, per rank.
fn lines_by_rank(lines: &[&str]) -> HashMap<usize, Vec<String>> {
    let mut by_rank: HashMap<usize, Vec<String>> = HashMap::new();
    for line in lines.iter().filter(|l| l.starts_with("[rank ")) {
        let (rank, text) = split_prefix(line);
        by_rank.entry(rank).or_default().push(text.to_string());
    }
    by_rank
}

/// Checks that `quote` (from the summary) is `line`, or its start cut short
/// with "...".
fn assert_quotes(quote: &str, line: &str) {
    match quote.strip_suffix("...") {
        Some(start) if quote != line => {
            assert!(
                line.starts_with(start) && start.len() >= 200,
                "{quote:?} vs {line:?}"
            )
        }
        _ => assert_eq!(quote, line),
    }
}

#[test]
fn survivors_report_rdist_errors_and_the_summary_quotes_each_rank() {
    // Rank 1 exits 3 before allreduce #20; ranks 0, 2 and 3 are blocked in it.
    // A long report period: they exit on their own as soon as they reported.
    let out = run(&[
        "--report-s",
        "15",
        "--nproc-per-node",
        "4",
        rank_program(),
        "fail",
    ]);
    assert_eq!(out.code(), Some(3), "stderr: {}", out.stderr);
    assert!(
        out.elapsed < Duration::from_secs(15),
        "took {:?}",
        out.elapsed
    );

    // Nothing lost: every rank's 19 allreduces (checked in the program).
    let stdout: Vec<&str> = out.stdout.iter().map(String::as_str).collect();
    let stdout = lines_by_rank(&stdout);
    for rank in 0..4 {
        let want: Vec<String> = (1..20)
            .map(|i| format!("rank {rank}: allreduce #{i} ok"))
            .collect();
        assert_eq!(stdout[&rank], want, "stdout of rank {rank}");
    }

    let stderr_lines: Vec<&str> = out.stderr.lines().collect();
    let stderr = lines_by_rank(&stderr_lines);
    assert_eq!(
        stderr[&1],
        ["rank 1: error: giving up on purpose before allreduce #20"]
    );
    for rank in [0, 2, 3] {
        let report = &stderr[&rank][0];
        assert!(
            report.starts_with(&format!(
                "rank {rank}: rdist_allreduce #20 failed: peer lost: rdist_allreduce: rank {rank}: "
            )) && report.contains("lost its connection to rank"),
            "rank {rank} reported: {report:?}"
        );
    }

    let messages = out.launcher_messages();
    assert_eq!(messages.len(), 5, "{messages:?}");
    assert!(
        messages[0].starts_with("rdistrun: rank 1 (pid ")
            && messages[0].ends_with(
                "failed first: exited with code 3; ranks 0, 2, 3 then exited with code 1"
            ),
        "{}",
        messages[0]
    );
    // The reference: each rank's first stderr line, read here.
    for rank in 0..4 {
        let prefix = format!("rdistrun: first error of rank {rank}: ");
        let quote = messages[rank + 1]
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{messages:?}"));
        assert_quotes(quote, &stderr[&rank][0]);
    }
    // The summary comes after everything the ranks printed.
    assert!(out.stderr.trim_end().ends_with(messages[4]));
}

#[test]
fn after_a_failure_the_others_have_time_to_report() {
    let script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 1; echo \"rank $RANK: late news\" >&2; exit 1";
    let out = run_sh(&["--nproc-per-node", "3"], script);
    assert_eq!(out.code(), Some(3), "stderr: {}", out.stderr);
    assert!(
        out.elapsed < Duration::from_secs(3),
        "took {:?}",
        out.elapsed
    );
    let messages = out.launcher_messages();
    assert_eq!(
        messages[1..],
        [
            "rdistrun: last line of rank 0 on stderr: rank 0: late news",
            "rdistrun: last line of rank 2 on stderr: rank 2: late news"
        ],
        "{messages:?}"
    );
    assert!(
        messages[0]
            .ends_with("failed first: exited with code 3; ranks 0, 2 then exited with code 1"),
        "{}",
        messages[0]
    );

    // With no report period the others are stopped at once, before they say
    // anything.
    let out = run_sh(&["--report-s", "0", "--nproc-per-node", "3"], script);
    assert_eq!(out.code(), Some(3), "stderr: {}", out.stderr);
    assert!(!out.stderr.contains("late news"), "{}", out.stderr);
    let messages = out.launcher_messages();
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].ends_with("failed first: exited with code 3; stopped ranks 0, 2"),
        "{}",
        messages[0]
    );
}

/// Runs the C program's `alone` mode with exactly `env` (and LD_LIBRARY_PATH)
/// as its environment, no launcher.
fn run_alone(env: &[(&str, &str)], numbers: &[&str]) -> Finished {
    let mut command = Command::new(rank_program());
    command
        .arg("alone")
        .args(numbers)
        .env_clear()
        .env("LD_LIBRARY_PATH", lib_dir())
        .envs(env.iter().copied());
    Launcher::spawn(command).finish()
}

#[test]
fn env_init_with_no_environment_is_a_world_of_one() {
    let numbers = ["1.5", "-2", "3e10", "0.1", "-7.25e-3"];
    let out = run_alone(&[("RDIST_DEBUG", "info")], &numbers);
    assert_eq!(out.code(), Some(0), "stderr: {}", out.stderr);
    assert_eq!(out.stdout.len(), 1, "{:?}", out.stdout);
    let sums = out.stdout[0]
        .strip_prefix("rank 0 size 1 sum ")
        .unwrap_or_else(|| panic!("{:?}", out.stdout));
    // A sum over one rank is the identity, to the last bit.
    let sums: Vec<f64> = sums.split(' ').map(|x| x.parse().unwrap()).collect();
    let want: Vec<f64> = numbers.iter().map(|x| x.parse().unwrap()).collect();
    assert_eq!(sums, want);
    assert!(
        out.stderr.lines().any(|l| l
            .starts_with("rdist INFO [rank 0] env:// with none of RANK, WORLD_SIZE")
            && l.contains("world of one")),
        "{}",
        out.stderr
    );

    // MASTER_ADDR and MASTER_PORT alone do not make a launcher, and a world of
    // one hosts no store: the port, held here, is not bound.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let out = run_alone(
        &[("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &port)],
        &["4"],
    );
    assert_eq!(out.code(), Some(0), "stderr: {}", out.stderr);
    assert_eq!(out.stdout, ["rank 0 size 1 sum 4"]);
}

#[test]
fn env_init_with_a_partial_environment_is_an_error() {
    for (env, missing) in [
        (&[("RANK", "1")][..], "WORLD_SIZE"),
        (&[("WORLD_SIZE", "2")][..], "RANK"),
        (&[("RANK", "0"), ("WORLD_SIZE", "1")][..], "MASTER_ADDR"),
    ] {
        let out = run_alone(env, &["1"]);
        assert_eq!(out.code(), Some(2), "{env:?}: {}", out.stderr);
        assert!(out.stdout.is_empty(), "{env:?}: {:?}", out.stdout);
        assert!(
            out.stderr
                .starts_with("alone: rdist_init failed: invalid argument: rdist_init: ")
                && out.stderr.contains(missing),
            "{env:?}: {}",
            out.stderr
        );
    }
}

#[test]
fn sigint_during_the_report_period_stops_the_ranks_at_once() {
    let script = "if [ \"$RANK\" = 1 ]; then sleep 0.5; exit 3; fi; echo ready $$; sleep 30";
    let mut launcher = Launcher::start(&[
        "--report-s",
        "30",
        "--nproc-per-node",
        "3",
        "sh",
        "-c",
        script,
    ]);
    let pids = wait_until_ready(&mut launcher, 2);
    // Rank 1 has failed by now; the others would be left 30 s to report.
    thread::sleep(Duration::from_secs(1));
    let interrupted = Instant::now();
    launcher.send_signal(libc::SIGINT);
    let out = launcher.finish();
    assert!(
        interrupted.elapsed() < Duration::from_secs(5),
        "took {:?}",
        interrupted.elapsed()
    );
    // The failure stays the cause, and its exit code rdistrun's.
    assert_eq!(out.code(), Some(3), "stderr: {}", out.stderr);
    let messages = out.launcher_messages();
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].starts_with("rdistrun: rank 1 (pid ")
            && messages[0].ends_with("failed first: exited with code 3; stopped ranks 0, 2"),
        "{}",
        messages[0]
    );
    for pid in pids {
        assert!(!process_exists(pid), "rank process {pid} survived");
    }
}

/// The token each rank got, by rank.
fn tokens(args: &[&str]) -> (Vec<String>, String) {
    let mut all = args.to_vec();
    all.extend(["sh", "-c", "echo TOKEN=${RDIST_AUTH_TOKEN:-none}"]);
    let out = run(&all);
    assert_eq!(out.code(), Some(0), "stderr: {}", out.stderr);
    let env = env_by_rank(&out.stdout);
    let mut ranks: Vec<usize> = env.keys().copied().collect();
    ranks.sort();
    (
        ranks.iter().map(|r| env[r]["TOKEN"].clone()).collect(),
        out.stderr,
    )
}

#[test]
fn a_launched_job_gets_a_fresh_auth_token_unless_told_otherwise() {
    let (first, _) = tokens(&["--nproc-per-node", "2"]);
    let (second, _) = tokens(&["--nproc-per-node", "2"]);
    assert_eq!(first[0], first[1], "the ranks of one job share the token");
    assert_eq!(first[0].len(), 64);
    assert!(first[0].bytes().all(|b| b.is_ascii_hexdigit()));
    assert_ne!(first[0], second[0], "every job gets its own token");
    let (given, _) = tokens(&["--nproc-per-node", "2", "--auth-token", "sh4red"]);
    assert_eq!(given, ["sh4red", "sh4red"]);
    let (none, _) = tokens(&["--nproc-per-node", "2", "--no-auth"]);
    assert_eq!(none, ["none", "none"]);
    // Across nodes rdistrun cannot make one up alone: none, and it says so.
    let (multi, warning) = tokens(&["--nnodes", "2", "--node-rank", "1"]);
    assert_eq!(multi, ["none"]);
    assert!(warning.contains("--auth-token"), "{warning}");
}

#[test]
fn with_on_failure_continue_the_others_run_to_their_end() {
    let script = r#"case $RANK in
        1) echo "rank 1: fatal: lost my data" >&2; exit 3;;
        *) sleep 1; echo "rank $RANK done";;
    esac"#;
    let out = run_sh(
        &[
            "--on-failure",
            "continue",
            "--report-s",
            "0",
            "--nproc-per-node",
            "3",
        ],
        script,
    );
    assert_eq!(out.code(), Some(3), "stderr: {}", out.stderr);
    for r in [0, 2] {
        assert!(
            out.stdout.contains(&format!("[rank {r}] rank {r} done")),
            "rank {r} was stopped: {:?}\n{}",
            out.stdout,
            out.stderr
        );
    }
    let messages = out.launcher_messages();
    assert!(
        messages[0].ends_with(
            "failed first: exited with code 3; the others went on (--on-failure continue); ranks 0, 2 then exited with code 0"
        ),
        "{messages:?}"
    );
    assert_eq!(
        messages[1..],
        ["rdistrun: first error of rank 1: rank 1: fatal: lost my data"],
        "{messages:?}"
    );
    // The default still stops them.
    let out = run_sh(&["--report-s", "0", "--nproc-per-node", "3"], script);
    assert_eq!(out.code(), Some(3), "stderr: {}", out.stderr);
    assert!(
        !out.stdout.iter().any(|l| l.contains("done")),
        "{:?}",
        out.stdout
    );
    let bad = run(&["--on-failure", "retry", "true"]);
    assert_eq!(bad.code(), Some(2), "stderr: {}", bad.stderr);
    assert!(
        bad.stderr.contains("--on-failure must be stop or continue"),
        "{}",
        bad.stderr
    );
}

#[test]
fn the_rank_that_failed_first_is_the_one_the_others_name() {
    // A crashed rank is reaped after its address space is torn down: its
    // peers can see its connections close, report and exit before. Rank
    // 0 plays such a peer (it names rank 1, as rdist's errors do, and exits
    // at once); rank 1 crashes later; rank 2 says only that it started.
    let script = r#"case $RANK in
        0) echo "rank 0: rank 0 lost its connection to rank 1 (connection closed: it exited or crashed)" >&2; exit 14;;
        1) sleep 0.3; kill -SEGV $$;;
        *) echo "worker starting" >&2; exec sleep 30;;
    esac"#;
    let out = run_sh(&["--report-s", "1", "--nproc-per-node", "3"], script);
    assert_eq!(out.code(), Some(128 + 11), "stderr: {}", out.stderr);
    let messages = out.launcher_messages();
    assert!(
        messages[0].contains("rank 1 (pid ")
            && messages[0].ends_with(
                "failed first: killed by signal 11 (SIGSEGV); rank 0 then exited with code 14; stopped rank 2"
            ),
        "{messages:?}"
    );
    assert_eq!(
        messages[1..],
        [
            "rdistrun: first error of rank 0: rank 0: rank 0 lost its connection to rank 1 (connection closed: it exited or crashed)",
            "rdistrun: last line of rank 2 on stderr: worker starting",
        ],
        "{messages:?}"
    );
    // Two ranks that name each other (the first found the mismatch, the
    // second heard its report): the first stays the one that failed first.
    let script = r#"case $RANK in
        0) echo "rank 0: mismatched calls: rank 0 called allreduce #3 but rank 1 called broadcast #3" >&2; exit 3;;
        *) sleep 0.2; echo "rank 1: rank 0 failed: mismatched calls" >&2; exit 1;;
    esac"#;
    let out = run_sh(&["--report-s", "1", "--nproc-per-node", "2"], script);
    assert_eq!(out.code(), Some(3), "stderr: {}", out.stderr);
    let messages = out.launcher_messages();
    assert!(
        messages[0].contains("rank 0 (pid ")
            && messages[0]
                .ends_with("failed first: exited with code 3; rank 1 then exited with code 1"),
        "{messages:?}"
    );
}

#[test]
fn a_blank_auth_token_is_refused_not_taken_for_none() {
    for blank in ["", "  "] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_rdistrun"));
        command
            .args(["--nproc-per-node", "2", "true"])
            .env("RDIST_AUTH_TOKEN", blank);
        let out = Launcher::spawn(command).finish();
        assert_eq!(out.code(), Some(1), "stderr: {}", out.stderr);
        assert!(
            out.stderr
                .contains("RDIST_AUTH_TOKEN is set but empty or blank"),
            "{}",
            out.stderr
        );
        let out = run(&["--nproc-per-node", "2", "--auth-token", blank, "true"]);
        assert_ne!(out.code(), Some(0), "stderr: {}", out.stderr);
        assert!(
            out.stderr
                .contains("--auth-token must not be empty or blank"),
            "{}",
            out.stderr
        );
    }
}

/// Runs `ranks` rdist-bench barriers under rdistrun in a shell that first
/// sets descriptor limits with `ulimit_args`, with info logging.
fn bench_with_limits(ulimit_args: &str, ranks: usize) -> Finished {
    let script = format!(
        "ulimit {ulimit_args} && exec \"$0\" --nproc-per-node {ranks} \"$1\" --op barrier --seconds 0.01 --reps 1"
    );
    let mut command = Command::new("sh");
    command
        .args([
            "-c",
            &script,
            env!("CARGO_BIN_EXE_rdistrun"),
            env!("CARGO_BIN_EXE_rdist-bench"),
        ])
        .env("RDIST_DEBUG", "info")
        .env("RDIST_TIMEOUT_MS", "15000");
    Launcher::spawn(command).finish()
}

/// A soft descriptor limit too low for the world is raised towards the
/// hard one (a wide job on one host passes the common 1024); a hard limit
/// too low fails every rank at once with a message that names it, rather
/// than accept() failing quietly until the peers time out.
#[test]
fn descriptor_limits_are_raised_or_named() {
    // 24 ranks want 2 * 24 + 256 descriptors; a soft limit of 100 is raised.
    let raised = bench_with_limits("-Sn 100", 24);
    assert_eq!(raised.code(), Some(0), "{}", raised.stderr);
    assert!(
        raised
            .stderr
            .contains("raised the soft descriptor limit from 100 to"),
        "{}",
        raised.stderr
    );
    // 64 ranks need at least 2 * 64 + 32; a hard limit of 120 cannot do.
    let refused = bench_with_limits("-n 120", 64);
    assert_eq!(refused.code(), Some(1), "{}", refused.stderr);
    assert!(
        refused.stderr.contains(
            "needs about 160 file descriptors for a world of 64 ranks, but this process may open at most 120"
        ),
        "{}",
        refused.stderr
    );
    assert!(
        refused.elapsed < Duration::from_secs(10),
        "refused at once, not at the timeout: {:?}",
        refused.elapsed
    );
}
