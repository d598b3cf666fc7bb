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
//!   --no-tty            ranks' stdout is a pipe, not a pseudo-terminal
//!   --report-s S        after a rank fails, seconds the others get to report [3]
//!   --grace-s S         seconds between SIGTERM and SIGKILL when stopping  [5]
//!   --on-failure WHAT   stop the others after a failure, or continue      [stop]
//!   --auth-token T      the job's shared secret (default: RDIST_AUTH_TOKEN, else random on one node)
//!   --no-auth           no auth token
//! ```
//!
//! Options also take the `--name=value` form. Every rank gets `RANK` (K*N + local),
//! `WORLD_SIZE` (M*N), `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (N), `NODE_RANK` and
//! `GROUP_RANK` (K), `MASTER_ADDR`, `MASTER_PORT`, `RDIST_LAUNCHER=rdistrun` and
//! `RDIST_AUTH_TOKEN` (the job's secret; see `--auth-token`) in its
//! environment, and `/dev/null` as stdin (launch.rs).
//!
//! Each rank's stdout is a pseudo-terminal, so that C stdio flushes it at every
//! line, and its stderr a pipe; both are forwarded line by line (whole lines
//! only, so ranks never interleave mid-line) to rdistrun's stdout and stderr,
//! prefixed with `[rank R] ` unless `--no-prefix` is given (output.rs).
//!
//! Each rank runs in its own process group, so that stopping a rank also stops
//! what it forked (a shell's children, data-loader workers). SIGINT and SIGTERM
//! sent to rdistrun are forwarded to every rank; a second one sends SIGKILL
//! (signals.rs). When a rank fails (non-zero exit or killed by a signal), the
//! others get `--report-s` seconds to report their own errors (say, rdist's
//! "lost its connection to rank R") and exit, then SIGTERM and, after the grace
//! period, SIGKILL; with `--on-failure continue` they run on to their own end.
//! rdistrun then prints a summary: one line on what happened, naming the rank
//! that failed first (the first reaped, or the rank its error names, if that
//! one failed on its own too), and each failed rank's first error line (else
//! its last line on stderr); it exits with the failed rank's exit code, or
//! 128 + signal number (supervise.rs). It exits 0 when all ranks exit 0, 2 for
//! a bad command line (args.rs) and 127 when PROGRAM cannot be started.

mod args;
mod launch;
mod output;
mod signals;
mod supervise;

use args::{Config, Invocation, USAGE};
use output::ErrorLines;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// Conventional exit status for a bad command line.
const EXIT_USAGE: u8 = 2;
/// Same status a shell uses for a command it cannot run.
const EXIT_CANNOT_START: u8 = 127;
/// rdistrun itself could not do its job (e.g. no free port).
const EXIT_LAUNCHER_ERROR: u8 = 1;

/// How long output may keep flowing after the last rank exited; only a background
/// process that inherited a rank's stdout or stderr can keep it open longer.
const OUTPUT_DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

fn main() -> ExitCode {
    let invocation = match args::parse_args(std::env::args_os().skip(1)) {
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

/// Starts all local ranks, supervises them and reports; returns the exit status.
fn run(config: &Config) -> u8 {
    let master_port = match launch::choose_master_port(config) {
        Ok(port) => port,
        Err(error) => {
            eprintln!("rdistrun: cannot pick a free port for MASTER_PORT: {error}");
            return EXIT_LAUNCHER_ERROR;
        }
    };
    // Before spawning, so that a Ctrl-C during start-up is forwarded, not fatal.
    if let Err(error) = signals::install_handlers() {
        eprintln!("rdistrun: cannot install signal handlers: {error}");
        return EXIT_LAUNCHER_ERROR;
    }
    let token = match launch::job_token(config) {
        Ok(token) => token,
        Err(error) => {
            eprintln!("rdistrun: {error}");
            return EXIT_LAUNCHER_ERROR;
        }
    };
    let errors = Arc::new(ErrorLines::default());
    let mut ranks = Vec::with_capacity(config.nproc_per_node);
    let mut readers = Vec::with_capacity(2 * config.nproc_per_node);
    // Every rank is started before any output thread (see
    // launch::spawn_rank); when the descriptors run out first (two pipes
    // per rank), the ranks started so far get their threads, which close
    // the pipes of ranks that exited, and starting goes on.
    let mut ptys: Vec<Option<Option<std::fs::File>>> = Vec::with_capacity(config.nproc_per_node);
    let mut failed = None;
    let mut local_rank = 0;
    let mut retried = false;
    while failed.is_none() && local_rank < config.nproc_per_node {
        match launch::spawn_rank(config, token.as_deref(), master_port, local_rank) {
            Ok((rank, pty)) => {
                ranks.push(rank);
                ptys.push(Some(pty));
                local_rank += 1;
                retried = false;
            }
            Err(launch::LaunchError::Spawn(e))
                if e.raw_os_error() == Some(libc::EMFILE) && !retried =>
            {
                retried = true;
                failed = forward_all(&mut ranks, &mut ptys, config, &mut readers, &errors);
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(error) => failed = Some(error),
        }
    }
    if failed.is_none() {
        failed = forward_all(&mut ranks, &mut ptys, config, &mut readers, &errors);
    }
    if let Some(error) = failed {
        for rank in &mut ranks {
            rank.kill_and_reap();
        }
        output::wait_for_readers(readers, OUTPUT_DRAIN_TIMEOUT);
        return launch::report_launch_error(config, &error);
    }
    let stop = supervise::supervise(&mut ranks, config.report, config.grace, config.on_failure);
    // Drain output first, so that the summary comes after everything the ranks
    // printed, and can quote it.
    output::wait_for_readers(readers, OUTPUT_DRAIN_TIMEOUT);
    let Some(mut stop) = stop else { return 0 };
    stop.follow_blame(&ranks, |rank| errors.quote(rank));
    let exits: Vec<_> = ranks.iter().map(|p| (p.rank, p.exit().cloned())).collect();
    for line in supervise::summarize(&stop, &exits, |rank| errors.quote(rank)) {
        eprintln!("rdistrun: {line}");
    }
    stop.exit_code()
}

/// Starts the output threads of the started ranks that have none yet.
fn forward_all(
    ranks: &mut [supervise::RankProcess],
    ptys: &mut [Option<Option<std::fs::File>>],
    config: &Config,
    readers: &mut Vec<output::OutputReader>,
    errors: &Arc<ErrorLines>,
) -> Option<launch::LaunchError> {
    for (rank, pty) in ranks.iter_mut().zip(ptys.iter_mut()) {
        if let Some(pty) = pty.take() {
            if let Err(error) = launch::forward_output(rank, pty, config, readers, errors) {
                return Some(error);
            }
        }
    }
    None
}
