//! Where ranks meet: parsing `env://`, `tcp://HOST:PORT`, `file:///path`
//! and the rank/world-size variables of torchrun, Slurm and Open MPI.

use crate::error::{Error, Result};
use std::path::PathBuf;

/// A parsed init method.
#[derive(Clone, Debug, PartialEq)]
pub enum Method {
    /// A TCP store at host:port, hosted by rank 0.
    Tcp { host: String, port: u16 },
    /// A store in a directory on a shared file system.
    File(PathBuf),
    /// A PyTorch TCPStore that a launcher already hosts at host:port
    /// (torchrun's agent store): every rank is a client, rdist's keys go
    /// under `prefix`.
    TorchStore {
        host: String,
        port: u16,
        prefix: String,
    },
    /// `env://` in a process that no launcher started (none of the rank or
    /// world-size variables is set): a world of one meets no one, so it
    /// needs no store, as an MPI program started without mpirun. A larger
    /// world (rank and size given as arguments) meets through MASTER_ADDR
    /// and MASTER_PORT, as `env://` always does.
    Alone,
}

/// The variables that can supply rank, world size and local rank, in order.
const RANK_VARS: [&str; 4] = ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];
const SIZE_VARS: [&str; 4] = [
    "WORLD_SIZE",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
];
pub const LOCAL_RANK_VARS: [&str; 3] =
    ["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"];

/// Reads the first of `vars` that is set, as an integer.
pub fn first_int(vars: &[&str], lookup: &dyn Fn(&str) -> Option<String>) -> Result<Option<i64>> {
    for var in vars {
        if let Some(v) = lookup(var).filter(|v| !v.trim().is_empty()) {
            return v.trim().parse().map(Some).map_err(|_| {
                Error::invalid_argument(format!(
                    "environment variable {var}='{v}' is not an integer"
                ))
            });
        }
    }
    Ok(None)
}

/// True when any of the rank or world-size variables is set: a launcher
/// (rdistrun, torchrun, Slurm, mpirun) started this process.
pub fn launched(lookup: &dyn Fn(&str) -> Option<String>) -> bool {
    RANK_VARS
        .iter()
        .chain(&SIZE_VARS)
        .any(|var| lookup(var).is_some_and(|v| !v.trim().is_empty()))
}

/// Parses `init_method`; `env://` reads MASTER_ADDR and MASTER_PORT, or is
/// `Method::Alone` when no launcher started this process.
pub fn parse(init_method: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<Method> {
    let m = init_method.trim();
    if m == "env://" || m.is_empty() {
        if !launched(lookup) {
            return Ok(Method::Alone);
        }
        return env_master(lookup);
    }
    if let Some(rest) = m.strip_prefix("tcp://") {
        let (host, port) = host_and_port(m, rest.trim_end_matches('/'))?;
        return Ok(Method::Tcp {
            host: host.to_string(),
            port: parse_port(port, "the port")?,
        });
    }
    if let Some(path) = m.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(Error::invalid_argument(format!(
                "init method '{m}' needs an absolute path (file:///shared/dir/job)"
            )));
        }
        return Ok(Method::File(PathBuf::from(path)));
    }
    Err(Error::invalid_argument(format!(
        "unknown init method '{m}' (expected env://, tcp://HOST:PORT or file:///path)"
    )))
}

/// HOST:PORT of the init method `m`, HOST a name, an IPv4 address or an
/// IPv6 address in brackets (returned without them).
fn host_and_port<'a>(m: &str, rest: &'a str) -> Result<(&'a str, &'a str)> {
    let bad = |why: &str| Error::invalid_argument(format!("init method '{m}' {why}"));
    let (host, after) = match rest.strip_prefix('[') {
        Some(bracketed) => {
            let (host, after) = bracketed.split_once(']').ok_or_else(|| {
                bad("opens an IPv6 address with '[' and never closes it (expected tcp://[ADDRESS]:PORT)")
            })?;
            let port = after.strip_prefix(':').ok_or_else(|| {
                bad("has no port after its IPv6 address (expected tcp://[ADDRESS]:PORT)")
            })?;
            (host, port)
        }
        None => {
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| bad("has no port (expected tcp://HOST:PORT)"))?;
            if host.contains([':', '[', ']']) {
                return Err(bad(
                    "has an IPv6 address without brackets or a stray bracket (expected tcp://HOST:PORT, or tcp://[ADDRESS]:PORT for IPv6)",
                ));
            }
            (host, port)
        }
    };
    if host.is_empty() {
        return Err(bad("has no host"));
    }
    Ok((host, after))
}

/// The store of `env://`: MASTER_ADDR and MASTER_PORT; under Slurm with
/// neither set, the step's first node and a port from the job and step ids
/// (see `slurm_master`).
pub fn env_master(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Method> {
    if let Some(master) = slurm_master(lookup) {
        return master;
    }
    let host = lookup("MASTER_ADDR")
        .map(|h| h.trim().trim_start_matches('[').trim_end_matches(']').to_string())
        .filter(|h| !h.is_empty())
        .ok_or_else(|| {
        Error::invalid_argument(
            "init method env:// needs MASTER_ADDR and MASTER_PORT (rdistrun and torchrun set them; under Slurm, export MASTER_ADDR=$(scontrol show hostnames | head -1))",
        )
    })?;
    let port = lookup("MASTER_PORT")
        .ok_or_else(|| Error::invalid_argument("init method env:// needs MASTER_PORT"))?;
    let port = parse_port(&port, "MASTER_PORT")?;
    if let Some(prefix) = torchrun_store_prefix(lookup) {
        return Ok(Method::TorchStore { host, port, prefix });
    }
    Ok(Method::Tcp { host, port })
}

/// Under srun with no MASTER_ADDR: every task of a step derives the same
/// store from Slurm's own variables, so that `srun -n N program` needs
/// nothing set by hand. The host is the first of the step's nodes (where
/// task 0 runs: Slurm places tasks in node order), the port one of
/// 12000-31999 (below Linux's ephemeral range) from the job and step ids,
/// so that steps of one job, and jobs sharing a node, get their own.
/// MASTER_PORT, when set, wins.
fn slurm_master(lookup: &dyn Fn(&str) -> Option<String>) -> Option<Result<Method>> {
    let set = |var: &str| lookup(var).filter(|v| !v.trim().is_empty());
    if set("MASTER_ADDR").is_some() || set("SLURM_PROCID").is_none() {
        return None;
    }
    let nodes = set("SLURM_STEP_NODELIST").or_else(|| set("SLURM_JOB_NODELIST"))?;
    Some((|| {
        let host = first_host(nodes.trim()).ok_or_else(|| {
            Error::invalid_argument(format!(
                "cannot read the first node of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST '{nodes}' \
                 (set MASTER_ADDR)"
            ))
        })?;
        let port = match set("MASTER_PORT") {
            Some(p) => parse_port(&p, "MASTER_PORT")?,
            None => {
                let id = |var: &str| {
                    set(var).map_or(Ok(0), |v| {
                        v.trim().parse::<u64>().map_err(|_| {
                            Error::invalid_argument(format!(
                                "environment variable {var}='{v}' is not an integer"
                            ))
                        })
                    })
                };
                let (job, step) = (id("SLURM_JOB_ID")?, id("SLURM_STEP_ID")?);
                12_000 + (job.wrapping_mul(97).wrapping_add(step) % 20_000) as u16
            }
        };
        Ok(Method::Tcp { host, port })
    })())
}

/// The first host of a Slurm host list ("node[01-04,07],gpu1" gives
/// "node01"; every bracket takes its first number, zero padding kept).
fn first_host(list: &str) -> Option<String> {
    let mut host = String::new();
    let mut rest = list;
    loop {
        let stop = rest.find([',', '[']).unwrap_or(rest.len());
        host.push_str(&rest[..stop]);
        rest = &rest[stop..];
        match rest.chars().next() {
            Some('[') => {
                let close = rest.find(']')?;
                let first = rest[1..close].split([',', '-']).next()?.trim();
                if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                host.push_str(first);
                rest = &rest[close + 1..];
            }
            _ => break,
        }
    }
    (!host.is_empty()).then_some(host)
}

/// Under torchrun, whose agent hosts a TCPStore on MASTER_PORT for its
/// workers (TORCHELASTIC_USE_AGENT_STORE): the key prefix for rdist in it,
/// one per run and restart, so a restarted job never sees stale keys.
fn torchrun_store_prefix(lookup: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let agent = lookup("TORCHELASTIC_USE_AGENT_STORE")?;
    if !matches!(agent.trim().to_ascii_lowercase().as_str(), "true" | "1") {
        return None;
    }
    let run = lookup("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into());
    let restart = lookup("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
    Some(format!("rdist/{}/{}/", run.trim(), restart.trim()))
}

fn parse_port(s: &str, what: &str) -> Result<u16> {
    s.trim()
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| {
            Error::invalid_argument(format!("{what} '{s}' is not a port number (1..65535)"))
        })
}

/// Rank and world size from the arguments, -1 meaning "from the environment".
/// Both -1 in a process no launcher started (none of the variables set) is a
/// world of one, rank 0, as MPI runs a program started without mpirun; a
/// partial environment (say RANK without WORLD_SIZE) is an error.
pub fn rank_and_size(
    rank: i64,
    size: i64,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<(usize, usize)> {
    if rank == -1 && size == -1 && !launched(lookup) {
        return Ok((0, 1));
    }
    let size = if size == -1 {
        first_int(&SIZE_VARS, lookup)?.ok_or_else(|| {
            Error::invalid_argument("world_size is -1 but none of WORLD_SIZE, SLURM_NTASKS, OMPI_COMM_WORLD_SIZE is set")
        })?
    } else {
        size
    };
    if size < 1 || size > i32::MAX as i64 {
        return Err(Error::invalid_argument(format!(
            "world size {size} must be at least 1"
        )));
    }
    let rank = if rank == -1 {
        first_int(&RANK_VARS, lookup)?.ok_or_else(|| {
            Error::invalid_argument(
                "rank is -1 but none of RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK is set",
            )
        })?
    } else {
        rank
    };
    if rank < 0 || rank >= size {
        return Err(Error::invalid_argument(format!(
            "rank {rank} is out of range for world size {size}"
        )));
    }
    Ok((rank as usize, size as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    static TORCHRUN: [(&str, &str); 7] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RUN_ID", "job7"),
        ("TORCHELASTIC_RESTART_COUNT", "2"),
    ];
    static NO_AGENT_STORE: [(&str, &str); 5] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "False"),
    ];

    #[test]
    fn torchruns_agent_store_is_joined_not_hosted() {
        assert_eq!(
            parse("env://", &env(&TORCHRUN)).unwrap(),
            Method::TorchStore {
                host: "127.0.0.1".into(),
                port: 29500,
                prefix: "rdist/job7/2/".into()
            }
        );
        assert!(matches!(
            parse("env://", &env(&TORCHRUN[..4])).unwrap(),
            Method::Tcp { .. }
        ));
        assert!(matches!(
            parse("env://", &env(&NO_AGENT_STORE)).unwrap(),
            Method::Tcp { .. }
        ));
    }

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn under_srun_the_store_comes_from_slurms_variables() {
        static STEP: [(&str, &str); 5] = [
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NODELIST", "node[07-09,12],gpu1"),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "0"),
        ];
        let Method::Tcp { host, port } = parse("env://", &env(&STEP)).unwrap() else {
            panic!("not a tcp store")
        };
        assert_eq!(host, "node07");
        assert!((12_000..32_000).contains(&port), "{port}");
        // Another step of the job gets another port.
        static NEXT: [(&str, &str); 5] = [
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NODELIST", "node[07-09,12],gpu1"),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "1"),
        ];
        let Method::Tcp { port: next, .. } = parse("env://", &env(&NEXT)).unwrap() else {
            panic!("not a tcp store")
        };
        assert_ne!(port, next);
        for (list, first) in [
            ("vm", Some("vm")),
            ("a,b", Some("a")),
            ("rack[1-2]-n[003-004]", Some("rack1-n003")),
            ("n[5]", Some("n5")),
            ("n[", None),
            ("n[x-2]", None),
            ("", None),
        ] {
            assert_eq!(first_host(list).as_deref(), first, "{list}");
        }
        // MASTER_ADDR wins; MASTER_PORT wins over the derived port.
        static GIVEN: [(&str, &str); 5] = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "vm"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "123"),
        ];
        assert_eq!(
            parse("env://", &env(&GIVEN)).unwrap(),
            Method::Tcp {
                host: "h".into(),
                port: 123
            }
        );
        static PORT_ONLY: [(&str, &str); 4] = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "vm"),
            ("MASTER_PORT", "123"),
        ];
        assert_eq!(
            parse("env://", &env(&PORT_ONLY)).unwrap(),
            Method::Tcp {
                host: "vm".into(),
                port: 123
            }
        );
    }

    #[test]
    fn a_malformed_tcp_address_is_named_for_what_it_lacks() {
        let none = env(&[]);
        for (bad, says) in [
            ("tcp://[::1", "never closes it"),
            ("tcp://[::1:80", "never closes it"),
            ("tcp://[::1]", "no port after its IPv6 address"),
            ("tcp://[::1]80", "no port after its IPv6 address"),
            ("tcp://[]:80", "has no host"),
            ("tcp://::1:80", "without brackets"),
            ("tcp://h]:80", "stray bracket"),
            ("tcp://:80", "has no host"),
            ("tcp://host", "has no port"),
        ] {
            let e = parse(bad, &none).unwrap_err();
            assert_eq!(
                e.kind(),
                crate::error::ErrorKind::InvalidArgument,
                "{bad}: {e}"
            );
            assert!(e.message().contains(says), "{bad}: {e}");
            assert!(e.message().contains(bad), "{bad}: {e}");
        }
        assert_eq!(
            parse("tcp://[fe80::1]:80/", &none).unwrap(),
            Method::Tcp {
                host: "fe80::1".into(),
                port: 80
            }
        );
    }

    #[test]
    fn methods_parse() {
        let none = env(&[]);
        assert_eq!(
            parse("tcp://10.0.0.1:29500", &none).unwrap(),
            Method::Tcp {
                host: "10.0.0.1".into(),
                port: 29500
            }
        );
        assert_eq!(
            parse("tcp://[::1]:80", &none).unwrap(),
            Method::Tcp {
                host: "::1".into(),
                port: 80
            }
        );
        assert_eq!(
            parse("file:///tmp/x", &none).unwrap(),
            Method::File("/tmp/x".into())
        );
        assert_eq!(parse("env://", &none).unwrap(), Method::Alone);
        let launched = env(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        let e = parse("env://", &launched).unwrap_err();
        assert!(e.message().contains("MASTER_ADDR"), "{e}");
        let e = parse("env://", &env(&[("SLURM_PROCID", "1")])).unwrap_err();
        assert!(e.message().contains("MASTER_ADDR"), "{e}");
        let with = env(&[
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "123"),
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
        ]);
        assert_eq!(
            parse("env://", &with).unwrap(),
            Method::Tcp {
                host: "h".into(),
                port: 123
            }
        );
        for bad in [
            "tcp://host",
            "tcp://:1",
            "tcp://h:70000",
            "file://rel",
            "mpi://x",
        ] {
            assert!(parse(bad, &none).is_err(), "{bad}");
        }
    }

    #[test]
    fn ranks_fall_back_to_slurm_and_open_mpi() {
        let slurm = env(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "8")]);
        assert_eq!(rank_and_size(-1, -1, &slurm).unwrap(), (3, 8));
        let ompi = env(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        assert_eq!(rank_and_size(-1, -1, &ompi).unwrap(), (1, 2));
        assert_eq!(rank_and_size(0, 1, &env(&[])).unwrap(), (0, 1));
        assert!(rank_and_size(4, 4, &env(&[])).is_err());
        assert!(rank_and_size(-1, 4, &env(&[]))
            .unwrap_err()
            .message()
            .contains("RANK"));
        assert!(rank_and_size(0, 0, &env(&[])).is_err());
    }

    #[test]
    fn no_launcher_is_a_world_of_one_but_a_partial_environment_is_an_error() {
        assert_eq!(rank_and_size(-1, -1, &env(&[])).unwrap(), (0, 1));
        // The address alone does not make a launcher.
        let master = env(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "1")]);
        assert_eq!(rank_and_size(-1, -1, &master).unwrap(), (0, 1));
        assert_eq!(parse("env://", &master).unwrap(), Method::Alone);
        let blank = env(&[("RANK", " "), ("WORLD_SIZE", "")]);
        assert_eq!(rank_and_size(-1, -1, &blank).unwrap(), (0, 1));
        let rank_only = env(&[("RANK", "1")]);
        let e = rank_and_size(-1, -1, &rank_only).unwrap_err();
        assert!(e.message().contains("WORLD_SIZE"), "{e}");
        let size_only = env(&[("WORLD_SIZE", "2")]);
        let e = rank_and_size(-1, -1, &size_only).unwrap_err();
        assert!(e.message().contains("RANK"), "{e}");
        // Only both -1 mean "from the environment" as a whole.
        assert!(rank_and_size(-1, 1, &env(&[])).is_err());
        assert!(rank_and_size(0, -1, &env(&[])).is_err());
    }
    use crate::test_rng::Rng;

    /// Property: no init method or option value, however odd, panics; each
    /// is parsed or refused with an error.
    #[test]
    fn property_urls_and_options_never_panic() {
        let mut rng = Rng(0xDEAD_BEEF_CAFE_F00D);
        let pieces = [
            "env://",
            "tcp://",
            "file://",
            "/",
            ":",
            "[",
            "]",
            "::1",
            "0",
            "65535",
            "65536",
            "-1",
            "host",
            "@",
            "%",
            "?",
            " ",
            "\u{0}",
            "é",
            "127.0.0.1",
            "..",
            "x",
        ];
        let keys = [
            "backend",
            "transport",
            "algo",
            "timeout_ms",
            "local_rank",
            "device",
            "ifname",
            "auth_token",
            "debug",
            "trace_file",
            "single_copy_min",
            "nope",
        ];
        let env = |var: &str| match var {
            "RANK" => Some("1".to_string()),
            "WORLD_SIZE" => Some("2".to_string()),
            _ => None,
        };
        for _ in 0..50_000 {
            let text: String = (0..rng.below(6))
                .map(|_| pieces[rng.below(pieces.len())])
                .collect();
            let _ = parse(&text, &env);
            let mut options = crate::options::Options::default();
            let _ = options.set(keys[rng.below(keys.len())], &text);
        }
        println!("init methods and options: 50000 executions each");
    }
}
