//! Shared helpers for the integration tests: start N ranks as threads with
//! real sockets on loopback (the unique-id rendezvous, so ports come from
//! the OS), bounded in time.

#![allow(dead_code)]

use rdist::{Comm, Options};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

/// Options with a short timeout, so that a hang fails fast.
pub fn opts(timeout_ms: u64) -> Options {
    let mut o = Options::default();
    o.set("timeout_ms", &timeout_ms.to_string()).unwrap();
    o
}

/// Runs `body(comm)` on `n` ranks (threads) and returns their results in
/// rank order. Panics if the whole job takes longer than `limit`.
pub fn world<R: Send + 'static>(
    n: usize,
    options: Options,
    limit: Duration,
    body: impl Fn(Comm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let id = Comm::unique_id().expect("unique id");
    world_with(
        n,
        options.clone(),
        limit,
        move |rank, size| Comm::init_rank(&id, rank as i64, size as i64, &options),
        body,
    )
}

/// `world`, with each rank's communicator made by `init(rank, size)`.
pub fn world_with<R: Send + 'static>(
    n: usize,
    _options: Options,
    limit: Duration,
    init: impl Fn(usize, usize) -> rdist::Result<Comm> + Send + Sync + 'static,
    body: impl Fn(Comm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let body = std::sync::Arc::new(body);
    let init = std::sync::Arc::new(init);
    let (tx, rx) = mpsc::channel();
    for rank in 0..n {
        let (tx, body, init) = (tx.clone(), body.clone(), init.clone());
        std::thread::Builder::new()
            .name(format!("rank{rank}"))
            .spawn(move || {
                let comm =
                    init(rank, n).unwrap_or_else(|e| panic!("rank {rank}: init failed: {e}"));
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(comm)));
                let _ = tx.send((rank, r));
            })
            .unwrap();
    }
    drop(tx);
    let deadline = std::time::Instant::now() + limit;
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(r))) => out[rank] = Some(r),
            Ok((rank, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("rank {rank} panicked: {msg}")
            }
            Err(_) => panic!("a {n}-rank job did not finish within {limit:?}"),
        }
    }
    out.into_iter().map(|r| r.unwrap()).collect()
}

/// Runs `cmd` to completion with its stdout and stderr captured (read as
/// it runs, so a chatty child never blocks on a full pipe); kills it and
/// panics, naming `what`, past `limit`.
pub fn output_within(
    cmd: &mut std::process::Command,
    limit: Duration,
    what: &str,
) -> std::process::Output {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} took longer than {limit:?}; its stderr:\n{}",
                String::from_utf8_lossy(&err.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Compiles the C program `src` (relative to the repository) into `out`
/// with -Werror against the committed header and the librdist.so in
/// `lib_dir`.
pub fn compile_c(src: &str, out: &Path, lib_dir: &Path) {
    assert!(
        lib_dir.join("librdist.so").exists(),
        "{} has no librdist.so: run `cargo build` before `cargo test` (scripts/test.sh does)",
        lib_dir.display()
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let status = Command::new("cc")
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Wpedantic",
            "-Werror",
            "-O1",
        ])
        .arg(format!("-I{}", root.join("include").display()))
        .arg(root.join(src))
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib_dir.display()))
        .args(["-lrdist", "-lm"])
        .status()
        .expect("cc runs");
    assert!(status.success(), "compiling {src} failed");
}

/// A loopback port held for the job that is about to listen on it.
///
/// A port merely released after bind(0) goes back to the kernel's pool, where
/// a parallel test's connect() or bind(0) can take it first. Closing an
/// accepted connection from the listening side first leaves the port in
/// TIME_WAIT for a minute: no bind(0) and no connect() is given it, while a
/// listener that sets SO_REUSEADDR (std's, torch's TCPStore, libuv) binds it.
pub fn free_port() -> u16 {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    // Bounded: a stranger's connection accepted instead would never close.
    let _ = client.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    drop(listener.accept().unwrap().0);
    // Wait for the listening side's FIN so that side closed first.
    let _ = client.read(&mut [0u8; 1]);
    port
}
