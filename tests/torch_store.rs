//! rdist beside PyTorch: meeting through a store that torch hosts. The real
//! torch (PyPI's, set up by scripts/torch-env.sh) hosts a TCPStore, and
//! the real torchrun launches C ranks that call rdist_init("env://").
//! Without torch these tests print a `skipped:` line.

mod common;

use rdist::{Comm, ReduceOp};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// The torch venv's python, or None (with the reason printed).
fn torch_python() -> Option<PathBuf> {
    static FOUND: OnceLock<Option<PathBuf>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let root = Path::new(env!("CARGO_MANIFEST_DIR"));
            let out = Command::new("bash")
                .arg(root.join("scripts/torch-env.sh"))
                .stderr(Stdio::inherit())
                .output()
                .ok()?;
            let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
            (out.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
        })
        .clone()
}

macro_rules! need_torch {
    () => {
        match torch_python() {
            Some(p) => p,
            None => {
                println!("skipped: torch is not available (scripts/torch-env.sh failed)");
                return;
            }
        }
    };
}

/// A Python process hosting a TCPStore (libuv or not) on a port from the
/// OS; it prints the port, and at the end (stdin closed) every key under
/// "rdist/" it can see, to show torch reads what rdist wrote.
struct TorchStore {
    child: Child,
    port: u16,
}

impl TorchStore {
    fn start(python: &Path, libuv: bool) -> TorchStore {
        let script = format!(
            r#"
import sys, datetime
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                  use_libuv={}, timeout=datetime.timedelta(seconds=60))
print(s.port, flush=True)
sys.stdin.read()
print("torch sees", s.num_keys(), flush=True)
"#,
            if libuv { "True" } else { "False" }
        );
        let mut child = Command::new(python)
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start python");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("port? {line:?}"));
        TorchStore { child, port }
    }

    /// Closes its stdin and returns what it printed last.
    fn finish(mut self) -> String {
        drop(self.child.stdin.take());
        let mut rest = String::new();
        let mut r = BufReader::new(self.child.stdout.take().unwrap());
        let _ = r.read_line(&mut rest);
        let _ = self.child.wait();
        rest
    }
}

impl Drop for TorchStore {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn tcp_init_on_a_port_where_torch_hosts_its_store_joins_that_store() {
    let python = need_torch!();
    for libuv in [true, false] {
        let store = TorchStore::start(&python, libuv);
        let url = format!("tcp://127.0.0.1:{}", store.port);
        // Three communicators in a row on the same store: each meeting
        // gets keys of its own.
        for round in 0..3 {
            let url = url.clone();
            let sums = common::world_with(
                3,
                common::opts(20_000),
                Duration::from_secs(60),
                move |rank, size| Comm::init(&url, rank as i64, size as i64, &common::opts(20_000)),
                move |comm| {
                    let mut v = [comm.rank() as f64 + round as f64, 1.0];
                    comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                    v
                },
            );
            for s in sums {
                assert_eq!(
                    s,
                    [3.0 + 3.0 * round as f64, 3.0],
                    "libuv {libuv} round {round}"
                );
            }
        }
        let last = store.finish();
        let n: i64 = last
            .trim()
            .strip_prefix("torch sees ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{last:?}"));
        assert!(n > 0, "torch sees none of rdist's keys: {last}");
        let _ = std::io::stdout().flush();
    }
}

#[test]
fn something_that_is_no_store_is_named_as_such() {
    // A listener that answers with garbage: not a TCPStore (rdist's or torch's).
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut s = s;
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        }
    });
    let url = format!("tcp://127.0.0.1:{port}");
    let e = match Comm::init(&url, 1, 2, &common::opts(3_000)) {
        Ok(_) => panic!("joined a world through an HTTP server"),
        Err(e) => e,
    };
    let m = e.message();
    assert!(
        m.contains(&port.to_string()) && m.contains("is not a rendezvous store"),
        "{e}"
    );
}

/// tests/c/rdistrun_ranks.c, compiled against librdist.so.
fn ranks_program() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let lib = lib_dir();
        let out = std::env::temp_dir().join(format!("rdist-torchrun-ranks-{}", std::process::id()));
        common::compile_c("tests/c/rdistrun_ranks.c", &out, &lib);
        out
    })
    .clone()
}

fn lib_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_rdistrun"))
        .parent()
        .unwrap()
        .to_path_buf()
}

#[test]
fn torchrun_launches_c_ranks_that_init_with_env() {
    let python = need_torch!();
    let torchrun = python.parent().unwrap().join("torchrun");
    let prog = ranks_program();
    let endpoint = format!("127.0.0.1:{}", common::free_port());
    let launches: [Vec<String>; 2] = [
        vec!["--standalone".into(), "--nproc-per-node".into(), "3".into()],
        vec![
            "--nnodes".into(),
            "1".into(),
            "--nproc-per-node".into(),
            "2".into(),
            "--rdzv-backend".into(),
            "c10d".into(),
            "--rdzv-endpoint".into(),
            endpoint,
        ],
    ];
    for args in launches {
        let size: usize = args[args.iter().position(|a| a == "--nproc-per-node").unwrap() + 1]
            .parse()
            .unwrap();
        let out = common::output_within(
            Command::new(&torchrun)
                .args(&args)
                .arg("--no-python")
                .arg(&prog)
                .args(["alone", "1.5", "2"])
                .env("LD_LIBRARY_PATH", lib_dir())
                .env("OMP_NUM_THREADS", "1"),
            Duration::from_secs(90),
            "torchrun",
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "torchrun {args:?} failed:\n{stdout}\n{stderr}"
        );
        let want = format!("size {size} sum {} {}", 1.5 * size as f64, 2 * size);
        for r in 0..size {
            assert!(
                stdout.contains(&format!("rank {r} {want}")),
                "torchrun {args:?}: rank {r} did not print '{want}':\n{stdout}\n{stderr}"
            );
        }
    }
}

/// tests/torch/store_transcript.py's transcript of every TCPStore command,
/// run by torch's own client against the store at `port`.
fn transcript(python: &Path, port: u16) -> Vec<String> {
    let out = common::output_within(
        Command::new(python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/torch/store_transcript.py"))
            .args(["127.0.0.1", &port.to_string()]),
        Duration::from_secs(90),
        "store_transcript.py",
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("\"done\""),
        "the transcript did not finish:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout.lines().map(str::to_string).collect()
}

#[test]
fn torchs_client_gets_the_same_answers_from_rdists_store_as_from_torchs() {
    let python = need_torch!();
    // The reference: torch's client against torch's own (libuv) server.
    let torch_server = TorchStore::start(&python, true);
    let reference = transcript(&python, torch_server.port);
    drop(torch_server);
    let server = rdist::store::TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let ours = transcript(&python, server.local_addr().port());
    assert!(reference.len() > 40, "{reference:?}");
    for (theirs, mine) in reference.iter().zip(&ours) {
        assert_eq!(mine, theirs, "rdist's store answered differently");
    }
    assert_eq!(ours.len(), reference.len());
    // What torch's client set, rdist's client reads (torch puts "/" before keys).
    use rdist::store::Store;
    let rdist_client = rdist::store::TcpStoreClient::connect(
        &server.local_addr().to_string(),
        std::time::Instant::now() + Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(
        rdist_client.get("log", Duration::from_secs(5)).unwrap(),
        b"abcd"
    );
    assert_eq!(
        rdist_client.get("pre/k", Duration::from_secs(5)).unwrap(),
        b"v"
    );
}

#[test]
fn rdists_client_runs_every_command_against_torchs_store() {
    let python = need_torch!();
    use rdist::store::{Store, TcpStoreClient};
    for libuv in [true, false] {
        let torch_server = TorchStore::start(&python, libuv);
        let addr = format!("127.0.0.1:{}", torch_server.port);
        let c = TcpStoreClient::connect(&addr, std::time::Instant::now() + Duration::from_secs(5))
            .unwrap();
        let patience = Duration::from_secs(5);
        c.set("rdist/a", b"1").unwrap();
        assert_eq!(c.get("rdist/a", patience).unwrap(), b"1");
        assert_eq!(c.add("rdist/n", 5).unwrap(), 5);
        assert_eq!(c.add("rdist/n", -7).unwrap(), -2);
        assert_eq!(c.compare_set("rdist/cs", b"", b"first").unwrap(), b"first");
        assert_eq!(c.compare_set("rdist/cs", b"nope", b"x").unwrap(), b"first");
        assert_eq!(
            c.compare_set("rdist/cs", b"first", b"second").unwrap(),
            b"second"
        );
        assert!(c.check(&["rdist/a", "rdist/n"]).unwrap());
        assert!(!c.check(&["rdist/a", "rdist/zz"]).unwrap());
        c.wait(&["rdist/a"], patience).unwrap();
        let err = c
            .wait(&["rdist/a", "rdist/zz"], Duration::from_millis(300))
            .unwrap_err();
        assert_eq!(
            err.message(),
            "timed out after 0.3 s waiting for key 'rdist/zz' in the rendezvous store"
        );
        // Still in step after the cancelled wait.
        c.append("rdist/log", b"ab").unwrap();
        c.append("rdist/log", b"cd").unwrap();
        assert_eq!(c.get("rdist/log", patience).unwrap(), b"abcd");
        c.multi_set(&[("rdist/m1", b"one"), ("rdist/m2", b"")])
            .unwrap();
        assert_eq!(
            c.multi_get(&["rdist/m2", "rdist/m1"], patience).unwrap(),
            [vec![], b"one".to_vec()]
        );
        let before = c.num_keys().unwrap();
        assert!(c.delete_key("rdist/m1").unwrap());
        assert!(!c.delete_key("rdist/m1").unwrap());
        assert_eq!(c.num_keys().unwrap(), before - 1);
        assert!(c.ping().unwrap() < patience);
        if libuv {
            // torch's legacy server lacks list_keys.
            let keys = c.list_keys().unwrap();
            assert!(keys.iter().any(|k| k == b"/rdist/log"), "{keys:?}");
        }
        // Torch sees what rdist wrote.
        let last = torch_server.finish();
        let n: i64 = last
            .trim()
            .strip_prefix("torch sees ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{last:?}"));
        assert_eq!(n, before - 1, "libuv {libuv}");
    }
}

#[test]
fn a_token_against_torchs_store_is_refused_at_once_saying_why() {
    let python = need_torch!();
    let store = TorchStore::start(&python, true);
    let mut o = common::opts(20_000);
    o.set("auth_token", "s3cret").unwrap();
    let start = std::time::Instant::now();
    let e = match Comm::init(&format!("tcp://127.0.0.1:{}", store.port), 1, 2, &o) {
        Ok(_) => panic!("joined torch's store with an auth token"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), rdist::ErrorKind::Auth, "{e}");
    assert!(e.message().contains("not rdist's authentication"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}
