//! The command line: parses and checks rdistrun's options into a `Config`.

use std::ffi::OsString;
use std::time::Duration;

pub const USAGE: &str = "\
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
  --no-tty            give the ranks a pipe as stdout, not a pseudo-terminal
                      (C stdio then buffers it in blocks, not lines)
  --report-s S        after a rank fails, seconds the other ranks get to report
                      their own errors and exit before SIGTERM (default 3)
  --grace-s S         seconds between SIGTERM and SIGKILL when stopping (default 5)
  --on-failure WHAT   when a rank fails: stop (the others, after --report-s; the
                      default) or continue (the others run on to their own end,
                      as a job that shrinks its communicators and goes on needs;
                      the failure is still reported and sets the exit status)
  --auth-token T      the job's shared secret, handed to the ranks as
                      RDIST_AUTH_TOKEN (give every node the same); default: the
                      RDIST_AUTH_TOKEN rdistrun was given, else a random one for
                      a one-node job
  --no-auth           run the ranks without an auth token
  -h, --help          print this help
  --version           print the version
";

const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
const DEFAULT_REPORT: Duration = Duration::from_secs(3);
const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// What the command line asks for.
#[derive(Debug, PartialEq)]
pub enum Invocation {
    Run(Config),
    Help,
    Version,
}

/// A validated launch request.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// `None` means: pick a free port.
    pub master_port: Option<u16>,
    pub prefix_output: bool,
    /// Whether each rank's stdout is a pseudo-terminal (else a pipe).
    pub stdout_tty: bool,
    /// After a rank fails, how long the others may run on to report.
    pub report: Duration,
    /// Between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// What a rank's failure does to the others.
    pub on_failure: OnFailure,
    /// `--auth-token`.
    pub auth_token: Option<String>,
    /// `--no-auth`.
    pub no_auth: bool,
    pub program: OsString,
    pub args: Vec<OsString>,
}

/// What a rank's failure does to the others (`--on-failure`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OnFailure {
    /// They get `--report-s` to report, then SIGTERM, then SIGKILL.
    Stop,
    /// They run on to their own end.
    Continue,
}

/// Option values as given, before the cross-option checks.
struct Options {
    nproc_per_node: usize,
    nnodes: usize,
    node_rank: usize,
    master_addr: String,
    master_port: Option<u16>,
    prefix_output: bool,
    stdout_tty: bool,
    report: Duration,
    grace: Duration,
    on_failure: OnFailure,
    auth_token: Option<String>,
    no_auth: bool,
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
            stdout_tty: true,
            report: DEFAULT_REPORT,
            grace: DEFAULT_GRACE,
            on_failure: OnFailure::Stop,
            auth_token: None,
            no_auth: false,
        }
    }
}

/// Parses the arguments after the program name. Options end at the first
/// argument that is not an option (PROGRAM) or at `--`; everything after PROGRAM
/// belongs to PROGRAM.
pub fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Invocation, String> {
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
            "--no-prefix" | "--no-tty" | "--no-auth" if inline_value.is_some() => {
                return Err(format!("{name} takes no value"))
            }
            "--no-prefix" => options.prefix_output = false,
            "--no-auth" => options.no_auth = true,
            "--no-tty" => options.stdout_tty = false,
            "--nproc-per-node" | "--nnodes" | "--node-rank" | "--master-addr" | "--master-port"
            | "--report-s" | "--grace-s" | "--auth-token" | "--on-failure" => {
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
        stdout_tty: options.stdout_tty,
        report: options.report,
        grace: options.grace,
        on_failure: options.on_failure,
        auth_token: options.auth_token,
        no_auth: options.no_auth,
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
        "--report-s" => options.report = parse_seconds(name, value)?,
        "--grace-s" => options.grace = parse_seconds(name, value)?,
        "--on-failure" => {
            options.on_failure = match value {
                "stop" => OnFailure::Stop,
                "continue" => OnFailure::Continue,
                _ => {
                    return Err(format!(
                        "--on-failure must be stop or continue, got '{value}'"
                    ))
                }
            }
        }
        "--auth-token" if value.trim().is_empty() => {
            return Err(
                "--auth-token must not be empty or blank (use --no-auth to run without)".into(),
            )
        }
        "--auth-token" => options.auth_token = Some(value.to_string()),
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
        assert!(config.stdout_tty);
        assert_eq!(config.report, Duration::from_secs(3));
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
            "--report-s",
            "0",
            "--no-prefix",
            "--no-tty",
            "prog",
            "--nnodes",
            "x",
        ]);
        assert_eq!(config.nproc_per_node, 4);
        assert_eq!(config.nnodes, 2);
        assert_eq!(config.node_rank, 1);
        assert_eq!(config.master_port, Some(29500));
        assert_eq!(config.grace, Duration::from_millis(500));
        assert_eq!(config.report, Duration::ZERO);
        assert!(!config.prefix_output);
        assert!(!config.stdout_tty);
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
            &["--report-s", "NaN", "p"],
            &["--report-s=-2", "p"],
            &["--no-prefix=yes", "p"],
            &["--no-tty=1", "p"],
            &["--bogus", "p"],
        ] {
            assert!(parse(args).is_err(), "{args:?} should be rejected");
        }
    }
}
