//! The C API from C: tests/c/core_test.c compiled with -Wall -Wextra
//! -Wpedantic -Werror against the committed header, run as a 4-rank job
//! through rdistrun.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Where cargo put librdist.so for this build profile.
fn lib_dir() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_rdistrun"));
    exe.parent().unwrap().to_path_buf()
}

fn compile(src: &str, out: &Path) {
    common::compile_c(src, out, &lib_dir());
}

/// Runs a command, killing it and failing past `limit`.
fn run_bounded(cmd: &mut Command, limit: Duration) -> std::process::Output {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{cmd:?} took longer than {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn c_program_runs_four_ranks_through_rdistrun() {
    let dir = std::env::temp_dir().join(format!("rdist-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("core_test");
    compile("tests/c/core_test.c", &exe);
    let out = run_bounded(
        Command::new(env!("CARGO_BIN_EXE_rdistrun"))
            .args(["--nproc-per-node", "4"])
            .arg(&exe)
            .env("LD_LIBRARY_PATH", lib_dir()),
        Duration::from_secs(60),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "job failed:\n{stdout}\n{stderr}");
    for r in 0..4 {
        assert!(
            stdout.contains(&format!("[rank {r}] rank {r}: ok")),
            "rank {r} missing:\n{stdout}\n{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn c_survivors_shrink_after_a_rank_is_killed() {
    let dir = std::env::temp_dir().join(format!("rdist-c-shrink-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("shrink_ranks");
    compile("tests/c/shrink_ranks.c", &exe);
    let out = run_bounded(
        Command::new(env!("CARGO_BIN_EXE_rdistrun"))
            .args(["--nproc-per-node", "4", "--on-failure", "continue"])
            .arg(&exe)
            .env("LD_LIBRARY_PATH", lib_dir()),
        Duration::from_secs(60),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The job failed (rank 1 did), and said so; the others finished.
    assert!(
        !out.status.success(),
        "rank 1's death went unreported:\n{stdout}\n{stderr}"
    );
    for r in [0, 2, 3] {
        assert!(
            stdout.contains(&format!("[rank {r}] rank {r}: shrunk ok")),
            "rank {r} missing:\n{stdout}\n{stderr}"
        );
    }
    assert!(!stdout.contains("rank 1: shrunk"), "{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}
