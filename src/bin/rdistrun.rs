//! `rdistrun`: starts one process per local rank of an rdist job, like `torchrun`.
//!
//! ```text
//! rdistrun [OPTIONS] [--] PROGRAM [ARGS...]
//!
//!   --nproc-per-node N  ranks to start on this node                 [1]
//!   --nnodes M          nodes in the job                            [1]
//!   --node-rank K       index of this node, 0 <= K < M              [0]
//!   --master-addr A     host that rank 0 listens on                 [127.0.0.1]
//!   --master-port P     port that rank 0 listens on; absent or 0 picks a free port
//!   --no-prefix         do not prefix output lines with "[rank R] "
//!   --grace-s S         seconds between SIGTERM and SIGKILL when stopping  [5]
//! ```
//!
//! Options also take the `--name=value` form. Every rank gets `RANK` (K*N + local),
//! `WORLD_SIZE` (M*N), `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (N), `NODE_RANK` and
//! `GROUP_RANK` (K), `MASTER_ADDR`, `MASTER_PORT` and `RDIST_LAUNCHER=rdistrun` in
//! its environment, and `/dev/null` as stdin.
//!
//! The ranks' stdout and stderr are forwarded line by line (whole lines only, so
//! ranks never interleave mid-line) to rdistrun's stdout and stderr, prefixed with
//! `[rank R] ` unless `--no-prefix` is given.
//!
//! Each rank runs in its own process group, so that stopping a rank also stops
//! what it forked (a shell's children, data-loader workers). SIGINT and SIGTERM
//! sent to rdistrun are forwarded to every rank; a second one sends SIGKILL. When a
//! rank fails (non-zero exit or killed by a signal), the others get SIGTERM and,
//! after the grace period, SIGKILL; rdistrun then prints one summary line and exits
//! with the failed rank's exit code, or 128 + signal number. It exits 0 when all
//! ranks exit 0, 2 for a bad command line and 127 when PROGRAM cannot be started.

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

const USAGE: &str = "\
usage: rdistrun [OPTIONS] [--] PROGRAM [ARGS...]

Starts N copies of PROGRAM, one per local rank, with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT set.

options:
  --nproc-per-node N  ranks to start on this node (default 1)
  --nnodes M          nodes in the job (default 1)
  --node-rank K       index of this node, 0 <= K < M (default 0)
  --master-addr A     host that rank 0 listens on (default 127.0.0.1)
  --master-port P     port that rank 0 listens on (default: a free port)
  --no-prefix         do not prefix output lines with \"[rank R] \"
  --grace-s S         seconds between SIGTERM and SIGKILL when stopping (default 5)
  -h, --help          print this help
  --version           print the version
";

/// Conventional exit status for a bad command line.
const EXIT_USAGE: u8 = 2;
/// Same status a shell uses for a command it cannot run.
const EXIT_CANNOT_START: u8 = 127;
/// rdistrun itself could not do its job (e.g. no free port).
const EXIT_LAUNCHER_ERROR: u8 = 1;

const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
const DEFAULT_GRACE: Duration = Duration::from_secs(5);
/// How often children are polled for exit and pending signals are looked at.
const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// How long output may keep flowing after the last rank exited; only a background
/// process that inherited a rank's pipe can keep it open longer.
const OUTPUT_DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

fn main() -> ExitCode {
    let invocation = match parse_args(std::env::args_os().skip(1)) {
        Ok(invocation) => invocation,
        Err(message) => {
            eprintln!("rdistrun: error: {message}");
            eprint!("{USAGE}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match invocation {
        Invocation::Help => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Invocation::Version => {
            println!("rdistrun {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Invocation::Run(config) => ExitCode::from(run(&config)),
    }
}

// ---------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------

/// What the command line asks for.
#[derive(Debug, PartialEq)]
enum Invocation {
    Run(Config),
    Help,
    Version,
}

/// A validated launch request.
#[derive(Debug, Clone, PartialEq)]
struct Config {
    nproc_per_node: usize,
    nnodes: usize,
    node_rank: usize,
    master_addr: String,
    /// `None` means: pick a free port.
    master_port: Option<u16>,
    prefix_output: bool,
    grace: Duration,
    program: OsString,
    args: Vec<OsString>,
}

/// Option values as given, before the cross-option checks.
struct Options {
    nproc_per_node: usize,
    nnodes: usize,
    node_rank: usize,
    master_addr: String,
    master_port: Option<u16>,
    prefix_output: bool,
    grace: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: DEFAULT_MASTER_ADDR.to_string(),
            master_port: None,
            prefix_output: true,
            grace: DEFAULT_GRACE,
        }
    }
}

/// Parses the arguments after the program name. Options end at the first
/// argument that is not an option (PROGRAM) or at `--`; everything after PROGRAM
/// belongs to PROGRAM.
fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Invocation, String> {
    let mut args = args.into_iter();
    let mut options = Options::default();
    let program = loop {
        let Some(arg) = args.next() else {
            return Err("missing PROGRAM to run".to_string());
        };
        // Every option is ASCII, so an argument that is not UTF-8 is the program.
        let Some(text) = arg.to_str() else { break arg };
        if text == "--" {
            break args.next().ok_or("missing PROGRAM after '--'")?;
        }
        if !text.starts_with('-') || text == "-" {
            break arg;
        }
        let (name, inline_value) = match text.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value)),
            _ => (text, None),
        };
        match name {
            "-h" | "--help" => return Ok(Invocation::Help),
            "--version" => return Ok(Invocation::Version),
            "--no-prefix" if inline_value.is_none() => options.prefix_output = false,
            "--no-prefix" => return Err("--no-prefix takes no value".to_string()),
            "--nproc-per-node" | "--nnodes" | "--node-rank" | "--master-addr" | "--master-port"
            | "--grace-s" => {
                let value = match inline_value {
                    Some(value) => value.to_string(),
                    None => next_value(&mut args, name)?,
                };
                set_option(&mut options, name, &value)?;
            }
            _ => return Err(format!("unknown option '{text}'")),
        }
    };
    let config = Config {
        nproc_per_node: options.nproc_per_node,
        nnodes: options.nnodes,
        node_rank: options.node_rank,
        master_addr: options.master_addr,
        master_port: options.master_port,
        prefix_output: options.prefix_output,
        grace: options.grace,
        program,
        args: args.collect(),
    };
    validate(&config)?;
    Ok(Invocation::Run(config))
}

/// The value of an option given as `--name value`.
fn next_value(args: &mut impl Iterator<Item = OsString>, name: &str) -> Result<String, String> {
    let value = args.next().ok_or(format!("{name} requires a value"))?;
    value
        .into_string()
        .map_err(|_| format!("{name}: value is not valid UTF-8"))
}

fn set_option(options: &mut Options, name: &str, value: &str) -> Result<(), String> {
    match name {
        "--nproc-per-node" => options.nproc_per_node = parse_count(name, value)?,
        "--nnodes" => options.nnodes = parse_count(name, value)?,
        "--node-rank" => options.node_rank = parse_count(name, value)?,
        "--master-addr" => options.master_addr = value.to_string(),
        // Port 0 asks for a free port, as it does for bind(2).
        "--master-port" => options.master_port = Some(parse_port(value)?).filter(|&p| p != 0),
        "--grace-s" => options.grace = parse_seconds(name, value)?,
        _ => return Err(format!("unknown option '{name}'")),
    }
    Ok(())
}

fn parse_count(name: &str, value: &str) -> Result<usize, String> {
    value
        .parse()
        .map_err(|_| format!("{name} must be a non-negative whole number, got '{value}'"))
}

fn parse_port(value: &str) -> Result<u16, String> {
    value
        .parse()
        .map_err(|_| format!("--master-port must be a port number in 0..65535, got '{value}'"))
}

fn parse_seconds(name: &str, value: &str) -> Result<Duration, String> {
    value
        .parse::<f64>()
        .ok()
        .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
        .ok_or(format!(
            "{name} must be a non-negative number of seconds, got '{value}'"
        ))
}

/// Checks that need several options at once.
fn validate(config: &Config) -> Result<(), String> {
    if config.nproc_per_node == 0 {
        return Err("--nproc-per-node must be at least 1".to_string());
    }
    if config.nnodes == 0 {
        return Err("--nnodes must be at least 1".to_string());
    }
    if config.node_rank >= config.nnodes {
        return Err(format!(
            "--node-rank must be less than --nnodes (got --node-rank {} with --nnodes {})",
            config.node_rank, config.nnodes
        ));
    }
    if config.nnodes.checked_mul(config.nproc_per_node).is_none() {
        return Err("--nnodes times --nproc-per-node is too large".to_string());
    }
    if config.master_addr.is_empty() {
        return Err("--master-addr must not be empty".to_string());
    }
    if config.program.is_empty() {
        return Err("PROGRAM must not be empty".to_string());
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Launching
// ---------------------------------------------------------------------------

/// Starts all local ranks, supervises them and reports; returns the exit status.
fn run(config: &Config) -> u8 {
    let master_port = match choose_master_port(config) {
        Ok(port) => port,
        Err(error) => {
            eprintln!("rdistrun: cannot pick a free port for MASTER_PORT: {error}");
            return EXIT_LAUNCHER_ERROR;
        }
    };
    // Before spawning, so that a Ctrl-C during start-up is forwarded, not fatal.
    if let Err(error) = install_signal_handlers() {
        eprintln!("rdistrun: cannot install signal handlers: {error}");
        return EXIT_LAUNCHER_ERROR;
    }
    let mut ranks = Vec::with_capacity(config.nproc_per_node);
    let mut readers = Vec::with_capacity(2 * config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        match launch_rank(config, master_port, local_rank, &mut readers) {
            Ok(rank) => ranks.push(rank),
            Err(error) => {
                for rank in &mut ranks {
                    rank.kill_and_reap();
                }
                wait_for_readers(readers, OUTPUT_DRAIN_TIMEOUT);
                return report_launch_error(config, &error);
            }
        }
    }
    let stop = supervise(&mut ranks, config.grace);
    // Drain output first, so that the summary is the last line printed.
    wait_for_readers(readers, OUTPUT_DRAIN_TIMEOUT);
    if let Some(stop) = &stop {
        eprintln!("rdistrun: {}", summarize(stop));
    }
    stop.as_ref().map_or(0, exit_code)
}

/// The given port, or a port that is free right now. As with torchrun, another
/// process could take it before rank 0 binds it; that is rare enough to accept.
fn choose_master_port(config: &Config) -> io::Result<u16> {
    if let Some(port) = config.master_port {
        return Ok(port);
    }
    let port = TcpListener::bind(("0.0.0.0", 0))?.local_addr()?.port();
    if config.nnodes > 1 {
        eprintln!(
            "rdistrun: warning: no --master-port given for a {}-node job; using {port}, \
             which every node must use too",
            config.nnodes
        );
    }
    Ok(port)
}

enum LaunchError {
    Spawn(io::Error),
    Output(io::Error),
}

fn report_launch_error(config: &Config, error: &LaunchError) -> u8 {
    match error {
        LaunchError::Spawn(error) => {
            eprintln!(
                "rdistrun: cannot start '{}': {}",
                config.program.to_string_lossy(),
                describe_io_error(error)
            );
            EXIT_CANNOT_START
        }
        LaunchError::Output(error) => {
            eprintln!(
                "rdistrun: cannot forward output: {}",
                describe_io_error(error)
            );
            EXIT_LAUNCHER_ERROR
        }
    }
}

/// The OS message without std's " (os error N)" suffix.
fn describe_io_error(error: &io::Error) -> String {
    let text = error.to_string();
    match text.rfind(" (os error ") {
        Some(end) => text[..end].to_string(),
        None => text,
    }
}

fn launch_rank(
    config: &Config,
    master_port: u16,
    local_rank: usize,
    readers: &mut Vec<OutputReader>,
) -> Result<RankProcess, LaunchError> {
    let rank = config.node_rank * config.nproc_per_node + local_rank;
    let child = rank_command(config, master_port, local_rank, rank)
        .spawn()
        .map_err(LaunchError::Spawn)?;
    let mut process = RankProcess {
        rank,
        child,
        exit: None,
    };
    if let Err(error) = attach_readers(&mut process, config.prefix_output, readers) {
        process.kill_and_reap();
        return Err(LaunchError::Output(error));
    }
    Ok(process)
}

fn rank_command(config: &Config, master_port: u16, local_rank: usize, rank: usize) -> Command {
    let mut command = Command::new(&config.program);
    command
        .args(&config.args)
        .env("RANK", rank.to_string())
        .env(
            "WORLD_SIZE",
            (config.nnodes * config.nproc_per_node).to_string(),
        )
        .env("LOCAL_RANK", local_rank.to_string())
        .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
        .env("NODE_RANK", config.node_rank.to_string())
        .env("GROUP_RANK", config.node_rank.to_string())
        .env("MASTER_ADDR", &config.master_addr)
        .env("MASTER_PORT", master_port.to_string())
        .env("RDIST_LAUNCHER", "rdistrun")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Own process group: signals must reach what the rank forked too, and a
        // terminal Ctrl-C should reach the rank once (forwarded), not twice.
        .process_group(0);
    die_with_launcher(&mut command);
    command
}

/// Has the kernel SIGKILL the rank if rdistrun dies without cleaning up (e.g.
/// SIGKILL), since ranks in their own process groups miss a terminal's Ctrl-C.
#[cfg(target_os = "linux")]
fn die_with_launcher(command: &mut Command) {
    let launcher = std::process::id();
    let hook = move || {
        // SAFETY: prctl and getppid are async-signal-safe system calls.
        let parent = unsafe {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            libc::getppid()
        };
        // rdistrun already died before the request took effect. (A raw OS
        // error, since allocating between fork and exec is not safe.)
        if u32::try_from(parent).ok() != Some(launcher) {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: the hook only makes async-signal-safe calls and allocates nothing.
    unsafe {
        command.pre_exec(hook);
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_launcher(_command: &mut Command) {}

// ---------------------------------------------------------------------------
// Output forwarding
// ---------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// A thread copying one of a rank's output pipes to rdistrun's own output.
struct OutputReader {
    rank: usize,
    thread: JoinHandle<()>,
}

fn attach_readers(
    process: &mut RankProcess,
    prefixed: bool,
    readers: &mut Vec<OutputReader>,
) -> io::Result<()> {
    let prefix = if prefixed {
        format!("[rank {}] ", process.rank).into_bytes()
    } else {
        Vec::new()
    };
    if let Some(stdout) = process.child.stdout.take() {
        readers.push(spawn_reader(
            process.rank,
            stdout,
            prefix.clone(),
            Stream::Stdout,
        )?);
    }
    if let Some(stderr) = process.child.stderr.take() {
        readers.push(spawn_reader(process.rank, stderr, prefix, Stream::Stderr)?);
    }
    Ok(())
}

fn spawn_reader(
    rank: usize,
    source: impl Read + Send + 'static,
    prefix: Vec<u8>,
    stream: Stream,
) -> io::Result<OutputReader> {
    let thread = thread::Builder::new()
        .name(format!("rank-{rank}-output"))
        .spawn(move || forward_lines(source, &prefix, stream))?;
    Ok(OutputReader { rank, thread })
}

/// Copies `source` line by line until end of file. Bytes need not be UTF-8.
fn forward_lines(source: impl Read, prefix: &[u8], stream: Stream) {
    let mut reader = BufReader::new(source);
    let mut line = Vec::new();
    // read_until retries EINTR itself; any other error means the pipe is unusable.
    while matches!(reader.read_until(b'\n', &mut line), Ok(n) if n > 0) {
        write_line(stream, prefix, &line);
        line.clear();
    }
}

/// Writes one whole line, adding the newline a final line may lack. The single
/// write under the stream's lock keeps lines of different ranks apart.
fn write_line(stream: Stream, prefix: &[u8], line: &[u8]) {
    let mut record = Vec::with_capacity(prefix.len() + line.len() + 1);
    record.extend_from_slice(prefix);
    record.extend_from_slice(line);
    if !line.ends_with(b"\n") {
        record.push(b'\n');
    }
    // Write errors (say, a closed pipe) are ignored: reading must go on, or the
    // rank would block on a full pipe.
    let _ = match stream {
        Stream::Stdout => {
            let mut stdout = io::stdout().lock();
            stdout.write_all(&record).and_then(|()| stdout.flush())
        }
        Stream::Stderr => io::stderr().lock().write_all(&record),
    };
}

/// Joins the output threads, giving up on those still blocked after `timeout`:
/// their pipe is then held open by a background process that outlived its rank.
fn wait_for_readers(readers: Vec<OutputReader>, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while readers.iter().any(|r| !r.thread.is_finished()) && Instant::now() < deadline {
        thread::sleep(POLL_INTERVAL);
    }
    let mut abandoned = Vec::new();
    for reader in readers {
        if reader.thread.is_finished() {
            // A panic in a reader has already been reported by the panic hook.
            let _ = reader.thread.join();
        } else if !abandoned.contains(&reader.rank) {
            abandoned.push(reader.rank);
        }
    }
    if !abandoned.is_empty() {
        eprintln!(
            "rdistrun: warning: not waiting for the output of {}: held open by a process \
             that outlived its rank",
            list_ranks(&abandoned)
        );
    }
}

// ---------------------------------------------------------------------------
// Signals
// ---------------------------------------------------------------------------

/// SIGINT and SIGTERM received so far; the supervisor compares it with the number
/// it has handled.
static SIGNALS_RECEIVED: AtomicUsize = AtomicUsize::new(0);
/// The most recent of those signals.
static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Only touches lock-free atomics: nothing else is async-signal-safe.
extern "C" fn record_signal(signal: libc::c_int) {
    LAST_SIGNAL.store(signal, Ordering::SeqCst);
    SIGNALS_RECEIVED.fetch_add(1, Ordering::SeqCst);
}

fn install_signal_handlers() -> io::Result<()> {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is a valid value to fill in, and the handler
        // is async-signal-safe.
        let result = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = record_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            // Restart interrupted reads and waits instead of failing them.
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if result != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn signal_name(signal: i32) -> Option<&'static str> {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    };
    Some(name)
}

/// "signal 9 (SIGKILL)", or "signal 40" for a signal without a known name.
fn describe_signal(signal: i32) -> String {
    match signal_name(signal) {
        Some(name) => format!("signal {signal} ({name})"),
        None => format!("signal {signal}"),
    }
}

// ---------------------------------------------------------------------------
// Supervision
// ---------------------------------------------------------------------------

/// How a rank ended.
#[derive(Debug, Clone)]
enum RankExit {
    Code(i32),
    Signal {
        signal: i32,
        core_dumped: bool,
    },
    /// waitpid failed; should not happen for our own child.
    Unknown(String),
}

impl RankExit {
    fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => RankExit::Code(code),
            (None, Some(signal)) => RankExit::Signal {
                signal,
                core_dumped: status.core_dumped(),
            },
            (None, None) => RankExit::Unknown(format!("unrecognized wait status {status}")),
        }
    }

    fn is_success(&self) -> bool {
        matches!(self, RankExit::Code(0))
    }

    /// rdistrun's own exit status when this exit is what stopped the job.
    fn exit_code(&self) -> u8 {
        match self {
            RankExit::Code(code) => u8::try_from(*code).unwrap_or(EXIT_LAUNCHER_ERROR),
            RankExit::Signal { signal, .. } => signal_exit_code(*signal),
            RankExit::Unknown(_) => EXIT_LAUNCHER_ERROR,
        }
    }

    fn describe(&self) -> String {
        match self {
            RankExit::Code(code) => format!("exited with code {code}"),
            RankExit::Signal {
                signal,
                core_dumped,
            } => {
                let core = if *core_dumped { " (core dumped)" } else { "" };
                format!("killed by {}{core}", describe_signal(*signal))
            }
            RankExit::Unknown(reason) => format!("could not be waited for: {reason}"),
        }
    }
}

/// The shell convention for "ended by a signal".
fn signal_exit_code(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(u8::MAX)
}

/// One started rank.
struct RankProcess {
    rank: usize,
    child: Child,
    /// `Some` once the rank has been reaped.
    exit: Option<RankExit>,
}

impl RankProcess {
    fn is_running(&self) -> bool {
        self.exit.is_none()
    }

    fn pid(&self) -> libc::pid_t {
        // Linux pids fit in pid_t; std only reports them as u32.
        self.child.id() as libc::pid_t
    }

    /// Signals the rank's whole process group. Only while the rank is unreaped:
    /// its pid (= group id) cannot be reused by another process until then.
    fn signal_group(&self, signal: i32) {
        if self.is_running() {
            // SAFETY: kill has no memory-safety preconditions. Failure (the group
            // is already gone) needs no handling.
            unsafe {
                libc::kill(-self.pid(), signal);
            }
        }
    }

    /// Stops a rank at once; used when start-up is abandoned.
    fn kill_and_reap(&mut self) {
        self.signal_group(libc::SIGKILL);
        if let Ok(status) = self.child.wait() {
            self.exit = Some(RankExit::from_status(status));
        }
    }

    /// Reaps the rank if it has exited; returns its exit the first time.
    fn poll_exit(&mut self) -> Option<RankExit> {
        if !self.is_running() {
            return None;
        }
        let exit = match self.child.try_wait() {
            Ok(Some(status)) => RankExit::from_status(status),
            Ok(None) => return None,
            Err(error) => RankExit::Unknown(error.to_string()),
        };
        self.exit = Some(exit.clone());
        Some(exit)
    }
}

/// Why the job is being stopped.
#[derive(Debug)]
enum StopCause {
    RankFailed {
        rank: usize,
        pid: libc::pid_t,
        exit: RankExit,
    },
    Signal(i32),
}

/// A job being (or having been) stopped before all ranks succeeded.
#[derive(Debug)]
struct Stop {
    cause: StopCause,
    /// Ranks still running when the stop began; they were sent a signal.
    stopped: Vec<usize>,
    /// Ranks that had to be sent SIGKILL.
    killed: Vec<usize>,
    /// When survivors get SIGKILL; `None` for a grace period too long to matter.
    deadline: Option<Instant>,
}

/// Polls the ranks until all have exited, stopping the job on the first failure
/// or signal. Returns `None` when every rank exited 0 undisturbed.
fn supervise(ranks: &mut [RankProcess], grace: Duration) -> Option<Stop> {
    let mut signals_handled = 0;
    let mut stop: Option<Stop> = None;
    while ranks.iter().any(RankProcess::is_running) {
        // Signals first: a rank dying of a forwarded signal is not the cause.
        handle_signals(ranks, &mut signals_handled, &mut stop, grace);
        if let Some(failure) = reap_exited(ranks) {
            if stop.is_none() {
                stop = Some(begin_stop(ranks, failure, libc::SIGTERM, grace));
            }
        }
        if let Some(stop) = &mut stop {
            if stop
                .deadline
                .is_some_and(|deadline| Instant::now() >= deadline)
            {
                kill_survivors(ranks, stop);
            }
        }
        thread::sleep(POLL_INTERVAL);
    }
    stop
}

/// Forwards a newly received SIGINT/SIGTERM to all ranks; any further one, or
/// one arriving while the job is already stopping, escalates to SIGKILL.
fn handle_signals(
    ranks: &[RankProcess],
    handled: &mut usize,
    stop: &mut Option<Stop>,
    grace: Duration,
) {
    let received = SIGNALS_RECEIVED.load(Ordering::SeqCst);
    if received == *handled {
        return;
    }
    let fresh = received - *handled;
    *handled = received;
    match stop {
        Some(stop) => kill_survivors(ranks, stop),
        None => {
            let signal = LAST_SIGNAL.load(Ordering::SeqCst);
            let mut new_stop = begin_stop(ranks, StopCause::Signal(signal), signal, grace);
            if fresh > 1 {
                kill_survivors(ranks, &mut new_stop);
            }
            *stop = Some(new_stop);
        }
    }
}

/// Reaps ranks that have exited; returns the first (lowest) failed one, if any.
fn reap_exited(ranks: &mut [RankProcess]) -> Option<StopCause> {
    let mut first_failure = None;
    for process in ranks.iter_mut() {
        let Some(exit) = process.poll_exit() else {
            continue;
        };
        if !exit.is_success() && first_failure.is_none() {
            first_failure = Some(StopCause::RankFailed {
                rank: process.rank,
                pid: process.pid(),
                exit,
            });
        }
    }
    first_failure
}

/// Sends `signal` to every running rank and starts the grace period.
fn begin_stop(ranks: &[RankProcess], cause: StopCause, signal: i32, grace: Duration) -> Stop {
    let mut stopped = Vec::new();
    for process in ranks.iter().filter(|p| p.is_running()) {
        process.signal_group(signal);
        stopped.push(process.rank);
    }
    Stop {
        cause,
        stopped,
        killed: Vec::new(),
        deadline: Instant::now().checked_add(grace),
    }
}

fn kill_survivors(ranks: &[RankProcess], stop: &mut Stop) {
    for process in ranks.iter().filter(|p| p.is_running()) {
        if !stop.killed.contains(&process.rank) {
            process.signal_group(libc::SIGKILL);
            stop.killed.push(process.rank);
        }
    }
}

/// rdistrun's exit status for a stopped job.
fn exit_code(stop: &Stop) -> u8 {
    match &stop.cause {
        StopCause::RankFailed { exit, .. } => exit.exit_code(),
        StopCause::Signal(signal) => signal_exit_code(*signal),
    }
}

/// The one-line summary, e.g. "rank 2 (pid 4242) failed first: exited with
/// code 3; stopped ranks 0, 1, 3".
fn summarize(stop: &Stop) -> String {
    let cause = match &stop.cause {
        StopCause::RankFailed { rank, pid, exit } => {
            format!("rank {rank} (pid {pid}) failed first: {}", exit.describe())
        }
        StopCause::Signal(signal) => format!("interrupted by {}", describe_signal(*signal)),
    };
    let stopped = if stop.stopped.is_empty() {
        "no other ranks were running".to_string()
    } else {
        format!("stopped {}", list_ranks(&stop.stopped))
    };
    if stop.killed.is_empty() {
        format!("{cause}; {stopped}")
    } else {
        format!(
            "{cause}; {stopped} (SIGKILL needed for {})",
            list_ranks(&stop.killed)
        )
    }
}

/// "rank 3" or "ranks 0, 1, 3".
fn list_ranks(ranks: &[usize]) -> String {
    let numbers: Vec<String> = ranks.iter().map(usize::to_string).collect();
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", numbers.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Invocation, String> {
        parse_args(args.iter().map(OsString::from))
    }

    fn parse_config(args: &[&str]) -> Config {
        match parse(args) {
            Ok(Invocation::Run(config)) => config,
            other => panic!("expected a run for {args:?}, got {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let config = parse_config(&["prog"]);
        assert_eq!(config.nproc_per_node, 1);
        assert_eq!(config.nnodes, 1);
        assert_eq!(config.node_rank, 0);
        assert_eq!(config.master_addr, "127.0.0.1");
        assert_eq!(config.master_port, None);
        assert!(config.prefix_output);
        assert_eq!(config.grace, Duration::from_secs(5));
        assert!(config.args.is_empty());
    }

    #[test]
    fn both_option_forms_and_program_arguments() {
        let config = parse_config(&[
            "--nproc-per-node=4",
            "--nnodes",
            "2",
            "--node-rank=1",
            "--master-port",
            "29500",
            "--grace-s=0.5",
            "--no-prefix",
            "prog",
            "--nnodes",
            "x",
        ]);
        assert_eq!(config.nproc_per_node, 4);
        assert_eq!(config.nnodes, 2);
        assert_eq!(config.node_rank, 1);
        assert_eq!(config.master_port, Some(29500));
        assert_eq!(config.grace, Duration::from_millis(500));
        assert!(!config.prefix_output);
        assert_eq!(config.program, "prog");
        assert_eq!(config.args, ["--nnodes", "x"]);
    }

    #[test]
    fn double_dash_ends_options() {
        let config = parse_config(&["--", "--weird-program", "-h"]);
        assert_eq!(config.program, "--weird-program");
        assert_eq!(config.args, ["-h"]);
    }

    #[test]
    fn port_zero_means_pick_one() {
        assert_eq!(parse_config(&["--master-port=0", "p"]).master_port, None);
    }

    #[test]
    fn help_and_version() {
        assert_eq!(parse(&["-h"]), Ok(Invocation::Help));
        assert_eq!(parse(&["--help", "prog"]), Ok(Invocation::Help));
        assert_eq!(parse(&["--version"]), Ok(Invocation::Version));
    }

    #[test]
    fn bad_command_lines() {
        for args in [
            &[][..],
            &["--"],
            &["--nproc-per-node", "0", "p"],
            &["--nproc-per-node", "-1", "p"],
            &["--nproc-per-node"],
            &["--nnodes", "2", "--node-rank", "2", "p"],
            &["--master-port", "65536", "p"],
            &["--grace-s", "-1", "p"],
            &["--no-prefix=yes", "p"],
            &["--bogus", "p"],
        ] {
            assert!(parse(args).is_err(), "{args:?} should be rejected");
        }
    }

    #[test]
    fn summary_lines() {
        let stop = Stop {
            cause: StopCause::RankFailed {
                rank: 2,
                pid: 4242,
                exit: RankExit::Code(3),
            },
            stopped: vec![0, 1, 3],
            killed: vec![],
            deadline: None,
        };
        assert_eq!(
            summarize(&stop),
            "rank 2 (pid 4242) failed first: exited with code 3; stopped ranks 0, 1, 3"
        );
        assert_eq!(exit_code(&stop), 3);
        let stop = Stop {
            cause: StopCause::Signal(libc::SIGINT),
            stopped: vec![0],
            killed: vec![0],
            deadline: None,
        };
        assert_eq!(
            summarize(&stop),
            "interrupted by signal 2 (SIGINT); stopped rank 0 (SIGKILL needed for rank 0)"
        );
        assert_eq!(exit_code(&stop), 130);
    }
}
