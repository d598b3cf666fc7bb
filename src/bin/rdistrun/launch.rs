//! Starting the ranks: the master port, each rank's command and environment,
//! its process group, and the threads that forward its output.

use crate::args::Config;
use crate::output::{self, ErrorLines, OutputReader, Stream};
use crate::supervise::RankProcess;
use crate::{EXIT_CANNOT_START, EXIT_LAUNCHER_ERROR};
use std::fs::File;
use std::io;
use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;

/// The given port, or a port that is free right now. As with torchrun, another
/// process could take it before rank 0 binds it; that is rare enough to accept.
pub fn choose_master_port(config: &Config) -> io::Result<u16> {
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

pub enum LaunchError {
    Spawn(io::Error),
    Output(io::Error),
}

/// Prints why a rank could not be started; returns rdistrun's exit status.
pub fn report_launch_error(config: &Config, error: &LaunchError) -> u8 {
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

/// The token the job's ranks prove to each other: `--auth-token`, else
/// the RDIST_AUTH_TOKEN rdistrun was given, else (one node) a fresh random
/// one, so that launched jobs are authenticated by default. A job across
/// nodes needs the same token on every node, which rdistrun cannot make
/// up alone: it runs without one and says so.
/// A blank RDIST_AUTH_TOKEN is refused, as the ranks would refuse it.
pub fn job_token(config: &Config) -> Result<Option<String>, String> {
    if config.no_auth {
        return Ok(None);
    }
    if let Some(token) = &config.auth_token {
        return Ok(Some(token.clone()));
    }
    if let Some(token) = std::env::var_os("RDIST_AUTH_TOKEN") {
        let token = token.to_string_lossy();
        if token.trim().is_empty() {
            return Err(
                "RDIST_AUTH_TOKEN is set but empty or blank, which would turn \
                 authentication off: give it a real secret, or unset it (or pass --no-auth) \
                 to run without one"
                    .into(),
            );
        }
        return Ok(Some(token.into_owned()));
    }
    if config.nnodes == 1 {
        return Ok(Some(random_token()));
    }
    eprintln!(
        "rdistrun: warning: this job spans {} nodes and has no auth token, so any process \
         that can reach its ports can join it; pass --auth-token T (the same on every node) \
         or set RDIST_AUTH_TOKEN, or --no-auth to silence this",
        config.nnodes
    );
    Ok(None)
}

/// 32 random bytes as hex.
fn random_token() -> String {
    let mut bytes = [0u8; 32];
    rdist::internals::random_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Starts local rank `local_rank`; returns it and, when its stdout is a
/// pseudo-terminal, the terminal's other end (see `forward_output`).
/// Every rank is started before any output thread: the spawn forks
/// rdistrun, and a fork copies the threads' stacks' mappings, so forking
/// beside two threads per rank already started made starting 1024 ranks
/// quadratic (10 s of system time for /bin/true).
pub fn spawn_rank(
    config: &Config,
    token: Option<&str>,
    master_port: u16,
    local_rank: usize,
) -> Result<(RankProcess, Option<File>), LaunchError> {
    let rank = config.node_rank * config.nproc_per_node + local_rank;
    let (stdout, pty) = output::stdout_channel(config.stdout_tty);
    // The command (holding the child's end of a pseudo-terminal) is dropped
    // right after the spawn.
    let child = rank_command(config, token, master_port, local_rank, rank, stdout)
        .spawn()
        .map_err(LaunchError::Spawn)?;
    Ok((RankProcess::new(rank, child), pty))
}

/// Starts the threads forwarding a started rank's output.
pub fn forward_output(
    process: &mut RankProcess,
    pty: Option<File>,
    config: &Config,
    readers: &mut Vec<OutputReader>,
    errors: &Arc<ErrorLines>,
) -> Result<(), LaunchError> {
    attach_readers(process, pty, config.prefix_output, readers, errors).map_err(LaunchError::Output)
}

fn rank_command(
    config: &Config,
    token: Option<&str>,
    master_port: u16,
    local_rank: usize,
    rank: usize,
    stdout: Stdio,
) -> Command {
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
        .stdout(stdout)
        .stderr(Stdio::piped())
        // Own process group: signals must reach what the rank forked too, and a
        // terminal Ctrl-C should reach the rank once (forwarded), not twice.
        .process_group(0);
    match token {
        Some(token) => command.env("RDIST_AUTH_TOKEN", token),
        None => command.env_remove("RDIST_AUTH_TOKEN"),
    };
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

/// Starts the threads forwarding the rank's stdout (`pty`, or its pipe) and
/// stderr.
fn attach_readers(
    process: &mut RankProcess,
    pty: Option<File>,
    prefixed: bool,
    readers: &mut Vec<OutputReader>,
    errors: &Arc<ErrorLines>,
) -> io::Result<()> {
    let piped = process
        .child
        .stdout
        .take()
        .map(OwnedFd::from)
        .map(File::from);
    let streams = [
        (pty.or(piped), Stream::Stdout),
        (
            process
                .child
                .stderr
                .take()
                .map(OwnedFd::from)
                .map(File::from),
            Stream::Stderr,
        ),
    ];
    for (source, stream) in streams {
        if let Some(source) = source {
            readers.push(output::spawn_reader(
                process.rank,
                source,
                prefixed,
                stream,
                errors.clone(),
            )?);
        }
    }
    Ok(())
}
