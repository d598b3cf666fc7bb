//! Failure behaviour: peer loss (a real process dying), abort from another
//! thread, timeouts, mismatched calls, ports in use, late and missing
//! ranks, duplicate ranks, and no leaked descriptors. Each test is bounded.

mod common;

use rdist::{Comm, ErrorKind, Options, ReduceOp};
use std::process::Command;
use std::time::{Duration, Instant};

/// This test binary, set to run only the test `name` in role `role`.
fn this_binary_as(name: &str, role: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env("RDIST_TEST_ROLE", role);
    cmd
}

/// This test binary as rank `rank` of `size` of a worker job (see
/// `worker_process`) meeting at `port`, with timeout `timeout_ms`.
fn worker_command(role: &str, rank: usize, size: usize, port: u16, timeout_ms: u64) -> Command {
    let mut w = this_binary_as("worker_process", role);
    w.env("RANK", rank.to_string())
        .env("WORLD_SIZE", size.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("RDIST_TIMEOUT_MS", timeout_ms.to_string());
    w
}

/// Re-runs this test binary as a worker process (see `worker_process`).
fn spawn_worker(role: &str, rank: usize, size: usize, port: u16) -> std::process::Child {
    let timeout = if role.starts_with("stop") {
        4000
    } else {
        60_000
    };
    worker_command(role, rank, size, port, timeout)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Starts a job of `size` workers in `role` with timeout `timeout_ms` and
/// the default peer check, their stdout piped (and stderr, with
/// `stderr`; else dropped).
fn start_job(role: &str, size: usize, timeout_ms: u64, stderr: bool) -> Vec<std::process::Child> {
    let port = common::free_port();
    (0..size)
        .map(|r| {
            let mut w = worker_command(role, r, size, port, timeout_ms);
            w.env_remove("RDIST_PEER_CHECK_MS")
                .env_remove("RDIST_DEBUG")
                .stdout(std::process::Stdio::piped())
                .stderr(match stderr {
                    true => std::process::Stdio::piped(),
                    false => std::process::Stdio::null(),
                });
            w.spawn().unwrap()
        })
        .collect()
}

/// Not a test of its own: the body of worker processes started by other
/// tests (does nothing without RDIST_TEST_ROLE).
#[test]
fn worker_process() {
    let Ok(role) = std::env::var("RDIST_TEST_ROLE") else {
        return;
    };
    if role == "dial_stopped" {
        return wait_behind_dials_to_stopped_ranks();
    }
    if role == "destroy_stopped" {
        return destroy_with_a_send_to_a_stopped_rank();
    }
    if role == "init_timed" {
        let t = Instant::now();
        match Comm::init("env://", -1, -1, &Options::default()) {
            Ok(_) => println!("RESULT init succeeded"),
            Err(e) => println!(
                "RESULT kind={:?} after={:.3} msg={e}",
                e.kind(),
                t.elapsed().as_secs_f64()
            ),
        }
        return;
    }
    let comm = Comm::init("env://", -1, -1, &Options::default()).unwrap();
    if let Some(call) = role.strip_prefix("abort2_then_") {
        return aborted_rank_2_then(&comm, call);
    }
    if role == "hush_p2p" {
        return receive_from_a_stopped_rank_1(&comm);
    }
    if role == "hush_any" {
        return receive_from_any_while_rank_1_stops_and_rank_2_dies(&comm);
    }
    if let Some(call) = role.strip_prefix("abort_dial_") {
        return abort_a_dial_to_a_stopped_rank_0(&comm, call);
    }
    let mut buf = vec![1.0f32; 4096];
    for i in 0.. {
        if role == "crash" && comm.rank() == 2 && i == 20 {
            // SAFETY: a deliberate crash, no cleanup, as a segfault would.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let stops = role
            .strip_prefix("stop")
            .or_else(|| role.strip_prefix("hush"));
        if stops == Some(&comm.rank().to_string()) && i == 20 {
            // SAFETY: stops this process (as a debugger or ^Z would).
            unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        }
        let t = Instant::now();
        if let Err(e) = comm.allreduce(&mut buf, ReduceOp::Sum) {
            println!(
                "RESULT kind={:?} after={:.3} failed={:?} msg={}",
                e.kind(),
                t.elapsed().as_secs_f64(),
                comm.failed_ranks(),
                e
            );
            return;
        }
        if i > 100_000 {
            println!("RESULT never failed");
            return;
        }
    }
}

#[test]
fn a_crashed_rank_fails_every_other_rank_quickly() {
    let segments_before = rdist_segments();
    let port = common::free_port();
    let workers: Vec<_> = (0..3).map(|r| spawn_worker("crash", r, 3, port)).collect();
    let start = Instant::now();
    let mut outputs = Vec::new();
    for mut w in workers {
        while w.try_wait().unwrap().is_none() {
            assert!(start.elapsed() < Duration::from_secs(30), "a worker hung");
            std::thread::sleep(Duration::from_millis(20));
        }
        outputs.push(w.wait_with_output().unwrap());
    }
    for (rank, out) in outputs.iter().enumerate().take(2) {
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.split_once("RESULT").map(|x| x.1))
            .unwrap_or_else(|| {
                panic!(
                    "rank {rank} printed no result:\n{text}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        assert!(line.contains("kind=PeerLost"), "rank {rank}: {line}");
        assert!(
            line.contains("rank 2"),
            "rank {rank} must name rank 2: {line}"
        );
        // Whether it saw rank 2's connection break or heard it from the
        // other survivor, each knows rank 2 failed, and only rank 2.
        assert!(line.contains("failed=[2] "), "rank {rank}: {line}");
        let after: f64 = line
            .split("after=")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(after < 5.0, "rank {rank} took {after} s to notice: {line}");
    }
    std::thread::sleep(Duration::from_millis(300));
    let left: Vec<String> = rdist_segments()
        .into_iter()
        .filter(|n| !segments_before.contains(n))
        .collect();
    let lasting: Vec<String> = {
        std::thread::sleep(Duration::from_millis(300));
        let now = rdist_segments();
        left.into_iter().filter(|n| now.contains(n)).collect()
    };
    assert!(
        lasting.is_empty(),
        "the crashed job left shared memory behind: {lasting:?}"
    );
}

#[test]
fn abort_from_another_thread_releases_a_blocked_call_on_every_rank() {
    let results = common::world(2, common::opts(60_000), Duration::from_secs(20), |comm| {
        // Both ranks block receiving from each other; nobody ever sends.
        let mut buf = vec![0u8; 16];
        let peer = 1 - comm.rank();
        let aborter = (comm.rank() == 0).then(|| {
            let handle = comm.abort_handle();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                handle.abort();
            })
        });
        let t = Instant::now();
        let e = comm.recv(&mut buf, peer).unwrap_err();
        let took = t.elapsed();
        if let Some(a) = aborter {
            a.join().unwrap();
        }
        let again = comm.barrier().unwrap_err();
        assert_eq!(again.kind(), ErrorKind::Aborted, "{again}");
        (e.kind(), took, e.to_string())
    });
    for (rank, (kind, took, msg)) in results.iter().enumerate() {
        assert_eq!(*kind, ErrorKind::Aborted, "rank {rank}: {msg}");
        assert!(*took < Duration::from_secs(3), "rank {rank} took {took:?}");
    }
    assert!(results[1].2.contains("rank 0 aborted"), "{}", results[1].2);
}

#[test]
fn an_unanswered_wait_times_out_near_the_timeout_naming_the_rank() {
    let results = common::world(3, common::opts(800), Duration::from_secs(20), |comm| {
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(2500));
            return None;
        }
        let t = Instant::now();
        let e = comm.allreduce(&mut [1i32; 8], ReduceOp::Sum).unwrap_err();
        Some((e.kind(), t.elapsed(), e.to_string()))
    });
    for (kind, took, msg) in results.into_iter().flatten() {
        assert!(kind == ErrorKind::Timeout, "{msg}");
        assert!(
            took >= Duration::from_millis(700) && took < Duration::from_secs(3),
            "{took:?}: {msg}"
        );
        assert!(msg.contains("rank 2") || msg.contains("timed out"), "{msg}");
    }
}

#[test]
fn mismatched_collectives_fail_on_both_sides_naming_both_calls() {
    let results = common::world(2, common::opts(10_000), Duration::from_secs(20), |comm| {
        let mut buf = vec![0f32; 10];
        let e = if comm.rank() == 0 {
            comm.allreduce(&mut buf, ReduceOp::Sum).unwrap_err()
        } else {
            comm.broadcast(&mut buf, 0).unwrap_err()
        };
        (e.kind(), e.to_string())
    });
    for (rank, (kind, msg)) in results.iter().enumerate() {
        assert_eq!(*kind, ErrorKind::Mismatch, "rank {rank}: {msg}");
        assert!(
            msg.contains("allreduce") && msg.contains("broadcast"),
            "rank {rank}: {msg}"
        );
    }
}

/// A rooted call, given its root.
type RootedCall = fn(&Comm, usize) -> rdist::Result<()>;

/// How a rank's rooted call went: its error's kind and text, whether the
/// barrier after it succeeded, how long the call took.
type RootedOutcome = (Result<(), (ErrorKind, String)>, bool, Duration);

/// Runs `call(comm, root)` with each rank's own idea of the root, then a
/// barrier.
fn rooted_call_with_roots(roots: &'static [usize], call: RootedCall) -> Vec<RootedOutcome> {
    common::world(
        roots.len(),
        common::opts(10_000),
        Duration::from_secs(30),
        move |comm| {
            let start = Instant::now();
            let first = call(&comm, roots[comm.rank()]).map_err(|e| (e.kind(), e.to_string()));
            let took = start.elapsed();
            (first, comm.barrier().is_ok(), took)
        },
    )
}

#[test]
fn a_rooted_call_with_another_root_fails_in_that_call() {
    // Each rank its own root: every call sent and none received, and
    // each used to return success keeping its own data (and a reduce or
    // gather waited for data no rank sent, until the timeout).
    let calls: [(&str, RootedCall); 4] = [
        ("broadcast", |c, root| {
            c.broadcast(&mut [c.rank() as f32; 4], root)
        }),
        ("scatter", |c, root| {
            c.scatter(&[c.rank() as f32; 8], &mut [0f32; 4], root)
        }),
        ("reduce", |c, root| {
            c.reduce(&[1f32; 4], &mut [0f32; 4], ReduceOp::Sum, root)
        }),
        ("gather", |c, root| {
            c.gather(&[1f32; 4], &mut [0f32; 8], root)
        }),
    ];
    for (name, call) in calls {
        for (rank, (first, _, took)) in rooted_call_with_roots(&[0, 1], call)
            .into_iter()
            .enumerate()
        {
            let (kind, msg) = first.expect_err(&format!("{name} with two roots succeeded"));
            assert_eq!(kind, ErrorKind::Mismatch, "{name} rank {rank}: {msg}");
            assert!(
                msg.contains("root 0") && msg.contains("root 1"),
                "{name} rank {rank}: {msg}"
            );
            assert!(
                took < Duration::from_secs(3),
                "{name} rank {rank}: {took:?}"
            );
        }
    }
    // One rank of three with another root: the ranks whose neighbour
    // called otherwise fail in the call, and the job fails on every rank
    // by the next one.
    let results = rooted_call_with_roots(&[0, 0, 1], calls[0].1);
    for rank in [0, 2] {
        let (kind, msg) = results[rank].0.clone().unwrap_err();
        assert_eq!(kind, ErrorKind::Mismatch, "rank {rank}: {msg}");
    }
    for (rank, (_, barrier_ok, _)) in results.iter().enumerate() {
        assert!(
            !barrier_ok,
            "rank {rank}: the barrier after a mismatch succeeded"
        );
    }
}

#[test]
fn mismatched_counts_and_dtypes_are_mismatches_too() {
    // Every rank keeps its communicator until all have their error: one
    // destroyed early is, to a rank still dialing it, a rank that left
    // (PEER_LOST, "nobody listens there"), which is not what this tests.
    let all_failed = std::sync::Arc::new(std::sync::Barrier::new(3));
    let results = common::world(
        3,
        common::opts(10_000),
        Duration::from_secs(20),
        move |comm| {
            let e = match comm.rank() {
                0 => comm.allreduce(&mut [0f32; 10], ReduceOp::Sum).unwrap_err(),
                1 => comm.allreduce(&mut [0f32; 20], ReduceOp::Sum).unwrap_err(),
                _ => comm.allreduce(&mut [0f64; 10], ReduceOp::Sum).unwrap_err(),
            };
            all_failed.wait();
            (e.kind(), e.to_string())
        },
    );
    for (kind, msg) in results {
        assert_eq!(kind, ErrorKind::Mismatch, "{msg}");
    }
}

#[test]
fn a_port_in_use_is_a_clear_error_naming_the_address() {
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let e = Comm::init(
        &format!("tcp://127.0.0.1:{port}"),
        0,
        2,
        &common::opts(2000),
    )
    .err()
    .unwrap();
    assert_eq!(e.kind(), ErrorKind::System, "{e}");
    assert!(
        e.to_string().contains(&port.to_string()) && e.to_string().contains("in use"),
        "{e}"
    );
}

#[test]
fn late_ranks_still_meet_even_when_rank_0_is_last() {
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let url = url.clone();
            std::thread::spawn(move || {
                // Rank 0 (the store host) arrives 1.5 s late: the others
                // retry their refused connects.
                std::thread::sleep(Duration::from_millis(if r == 0 {
                    1500
                } else {
                    100 * r as u64
                }));
                let comm = Comm::init(&url, r, 3, &common::opts(20_000)).unwrap();
                let mut v = [comm.rank() as u64 + 1];
                comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                v[0]
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 6);
    }
}

#[test]
fn a_missing_rank_is_named_when_rendezvous_times_out() {
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let url = url.clone();
            std::thread::spawn(move || Comm::init(&url, r, 3, &common::opts(1000)).err().unwrap())
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(
            e.to_string()
                .contains("2 of 3 ranks joined; missing: rank 2"),
            "{e}"
        );
    }
}

#[test]
fn init_ends_near_its_timeout_when_the_store_host_is_stopped() {
    // Rank 0 hosts the store (env://) and is stopped once rank 1 waits in
    // it; rank 2 never comes. Rank 1's init must end near its timeout, not
    // wait for the stopped store to answer each withdrawn wait (it waited
    // the store operations' bound, 30 s, for one).
    let port = common::free_port();
    let timeout_ms = 4000;
    let mut host = worker_command("init_timed", 0, 3, port, timeout_ms)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let waiter = std::thread::spawn(move || {
        common::output_within(
            &mut worker_command("init_timed", 1, 3, port, timeout_ms),
            Duration::from_secs(60),
            "rank 1's init",
        )
    });
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: stops the store's host, as ^Z or a debugger would.
    unsafe { libc::kill(host.id() as i32, libc::SIGSTOP) };
    let out = waiter.join().unwrap();
    let _ = host.kill();
    let _ = host.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.split_once("RESULT").map(|x| x.1))
        .unwrap_or_else(|| panic!("rank 1 printed no result:\n{text}"));
    assert!(line.contains("kind=Timeout"), "{line}");
    let after = after_of(line);
    assert!(
        after < timeout_ms as f64 / 1000.0 + 6.0,
        "rank 1's init took {after} s with a {timeout_ms} ms timeout: {line}"
    );
}

#[test]
fn two_processes_claiming_one_rank_are_refused() {
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let handles: Vec<_> = [0, 1, 1]
        .into_iter()
        .map(|r| {
            let url = url.clone();
            std::thread::spawn(move || Comm::init(&url, r, 3, &common::opts(1500)).err())
        })
        .collect();
    let errors: Vec<String> = handles
        .into_iter()
        .filter_map(|h| h.join().unwrap())
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors.iter().any(|e| e.contains("rank 1 joined twice")),
        "{errors:?}"
    );
}

#[test]
fn world_size_disagreement_is_reported() {
    // Every rank says so, at once (not only the one that reads the other's
    // size, while the other waits for a rank that will never come).
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let start = Instant::now();
    let handles: Vec<_> = [(0, 2), (1, 3)]
        .into_iter()
        .map(|(r, n)| {
            let url = url.clone();
            std::thread::spawn(move || Comm::init(&url, r, n, &common::opts(20_000)).err())
        })
        .collect();
    for h in handles {
        let e = h
            .join()
            .unwrap()
            .expect("init succeeded with mismatched world sizes");
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
        assert!(e.message().contains("started with world size"), "{e}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn a_process_with_a_rank_beyond_the_job_is_refused_at_once_and_the_job_goes_on() {
    // A stray process (RANK=5 WORLD_SIZE=6) meets a job of 4. It comes
    // fourth, when its count of ranks would have been the one that
    // completed the job's: it must be refused at once, and the job must
    // start and run as if it never came.
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let start = Instant::now();
    let real = |r: usize| {
        let url = url.clone();
        std::thread::spawn(move || {
            let comm = Comm::init(&url, r as i64, 4, &common::opts(15_000))?;
            let mut v = vec![r as f32 + 1.0; 8];
            comm.allreduce(&mut v, ReduceOp::Sum)?;
            Ok::<_, rdist::Error>(v)
        })
    };
    let mut ranks: Vec<_> = (0..3).map(real).collect();
    std::thread::sleep(Duration::from_millis(500));
    let stray = {
        let url = url.clone();
        std::thread::spawn(move || {
            let began = Instant::now();
            (
                Comm::init(&url, 5, 6, &common::opts(15_000)).err(),
                began.elapsed(),
            )
        })
    };
    let (refused, took) = stray.join().unwrap();
    let e = refused.expect("a rank beyond the job's size joined it");
    assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
    assert!(e.message().contains("not one of the job's 4 ranks"), "{e}");
    assert!(
        e.message().contains("world size 4 but rank 5 with 6"),
        "{e}"
    );
    assert!(took < Duration::from_secs(2), "refused after {took:?}");
    ranks.push(real(3));
    for (r, h) in ranks.into_iter().enumerate() {
        let v = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(v, vec![10.0; 8], "rank {r}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn a_rank_that_cannot_set_up_fails_init_on_every_rank_at_once() {
    // Init returns on no rank before every rank's communicator is set up:
    // a rank that fails after the rendezvous (here: an algorithm it
    // cannot parse) tells the others why, and they fail at once too,
    // where they used to return and wait in their first collective.
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let start = Instant::now();
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let url = url.clone();
            std::thread::spawn(move || {
                let mut o = common::opts(20_000);
                // Sockets: with NCCL possible, the ranks would ask each
                // other first, and learn of rank 1 as a lost connection
                // (which init then reports as rank 1's published reason).
                o.set("backend", "socket").unwrap();
                if r == 1 {
                    // Past `Options::set`, which refuses it: the engine,
                    // set up after the rendezvous, refuses it too.
                    o.algo = Some("no_such_algorithm".to_string());
                }
                Comm::init(&url, r, 3, &o).err()
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let e = h
            .join()
            .unwrap()
            .unwrap_or_else(|| panic!("rank {r}'s init succeeded beside a rank that failed"));
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "rank {r}: {e}");
        assert!(e.message().contains("no_such_algorithm"), "rank {r}: {e}");
        if r != 1 {
            assert!(
                e.message()
                    .contains("rank 1 could not set up its communicator"),
                "rank {r}: {e}"
            );
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
}

fn open_fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Not a test of its own: runs alone in a child process (descriptor counts
/// are per process, and other tests open sockets concurrently).
#[test]
fn fd_probe_process() {
    if std::env::var("RDIST_TEST_ROLE").as_deref() != Ok("fds") {
        return;
    }
    // Warm up once (lazy statics, the harness's own descriptors).
    common::world(2, common::opts(10_000), Duration::from_secs(20), |c| {
        c.barrier().unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    let (fds, threads) = (open_fd_count(), thread_count());
    common::world(3, common::opts(10_000), Duration::from_secs(20), |comm| {
        let mut v = vec![1u32; 1000];
        comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
        let req = unsafe { comm.submit(rdist::internals::Call::Barrier).unwrap() };
        req.wait().unwrap();
        let sub = comm.split((comm.rank() % 2) as i32, 0).unwrap().unwrap();
        sub.barrier().unwrap();
    });
    // The unique id's store thread leaves within ~100 ms of the last join.
    let deadline = Instant::now() + Duration::from_secs(3);
    while (open_fd_count() > fds || thread_count() > threads) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "FDS before={fds} after={} THREADS before={threads} after={}",
        open_fd_count(),
        thread_count()
    );
}

#[test]
fn destroy_closes_every_socket_and_joins_every_thread() {
    let out = this_binary_as("fd_probe_process", "fds").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.split_once("FDS ").map(|x| x.1.to_string()))
        .unwrap_or_else(|| {
            panic!(
                "probe printed nothing:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let nums: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(nums[0], nums[1], "descriptors leaked: {line}");
    assert_eq!(nums[2], nums[3], "threads leaked: {line}");
}

#[test]
fn a_peer_that_destroyed_its_comm_is_reported_not_waited_for() {
    let results = common::world(2, common::opts(30_000), Duration::from_secs(20), |comm| {
        if comm.rank() == 1 {
            drop(comm);
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        let e = comm.allreduce(&mut [1u8; 4], ReduceOp::Sum).unwrap_err();
        Some((e.kind(), t.elapsed(), e.to_string()))
    });
    let (kind, took, msg) = results[0].clone().unwrap();
    assert_eq!(kind, ErrorKind::PeerLost, "{msg}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(msg.contains("rank 1"), "{msg}");
}

fn rdist_segments() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("rdist-"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn shared_memory_segments_never_outlive_setup() {
    // Every segment is unlinked once all peers mapped it, so none lasts,
    // whatever happened to the job later (segments of tests running in
    // parallel exist only for the milliseconds of their setup).
    let before = rdist_segments();
    std::thread::sleep(Duration::from_millis(500));
    let lasting: Vec<String> = rdist_segments()
        .into_iter()
        .filter(|n| before.contains(n))
        .collect();
    assert!(lasting.is_empty(), "leftover shared memory: {lasting:?}");
}

/// With spinning turned off (RDIST_SPIN_US=0), shared memory still makes
/// progress: waits sleep on its doorbell (they used to poll descriptors
/// that shared memory never wakes, and hung until the timeout).
#[test]
fn no_spinning_still_makes_progress_on_shared_memory() {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rdistrun"));
    cmd.args(["--nproc-per-node", "3", env!("CARGO_BIN_EXE_rdist-bench")])
        .args([
            "--op",
            "all",
            "--max-bytes",
            "64K",
            "--seconds",
            "0.01",
            "--reps",
            "1",
        ])
        .env("RDIST_SPIN_US", "0")
        .env("RDIST_TIMEOUT_MS", "20000")
        .env_remove("RDIST_TRANSPORT");
    let out = common::output_within(
        &mut cmd,
        std::time::Duration::from_secs(60),
        "rdist-bench, no spin",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("out of bounds values : 0 OK"), "{text}");
    assert!(
        text.contains("shared memory") || text.contains("transport auto"),
        "{text}"
    );
}

/// Creating and destroying communicators on one address, again and again,
/// in the same processes: with a collective in each cycle, and with none
/// (ranks then race to the next rendezvous while rank 0 may still be
/// tearing the last one down).
#[test]
fn five_hundred_cycles_on_one_port() {
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let start = Instant::now();
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let url = url.clone();
            std::thread::spawn(move || {
                for cycle in 0..500 {
                    let comm = Comm::init(&url, r, 3, &common::opts(20_000))
                        .unwrap_or_else(|e| panic!("rank {r}, cycle {cycle}: {e}"));
                    if cycle % 2 == 0 {
                        let mut v = [r as u64 + cycle];
                        comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                        assert_eq!(v[0], 3 + 3 * cycle, "cycle {cycle}");
                    }
                    drop(comm);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    println!(
        "500 cycles on one port in {:.1} s",
        start.elapsed().as_secs_f64()
    );
}

/// Rank 0's store closes once no communicator needs it (after a short
/// linger), freeing the port; and it listens only where MASTER_ADDR points.
#[test]
fn the_store_listens_only_on_the_master_address_and_closes_when_unused() {
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    // Another of this host's addresses, when it has one.
    let other = std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| s.connect("10.255.255.1:9").map(|()| s))
        .and_then(|s| s.local_addr())
        .map(|a| a.ip())
        .ok()
        .filter(|ip| !ip.is_loopback() && !ip.is_unspecified());
    let reached = common::world_with(
        2,
        common::opts(10_000),
        Duration::from_secs(30),
        move |rank, size| Comm::init(&url, rank as i64, size as i64, &common::opts(10_000)),
        move |comm| {
            comm.barrier().unwrap();
            // While the job runs, the store must not answer on `other`.
            let reached = other.map(|ip| {
                std::net::TcpStream::connect_timeout(
                    &std::net::SocketAddr::new(ip, port),
                    Duration::from_secs(1),
                )
                .is_ok()
            });
            comm.barrier().unwrap();
            reached
        },
    );
    match other {
        Some(ip) => assert_eq!(
            reached,
            [Some(false); 2],
            "the store answered on {ip}:{port}"
        ),
        None => println!("skipped: this host has no address besides loopback"),
    }
    let start = Instant::now();
    while std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the store still holds port {port} 10 s after its communicators were destroyed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "the port was free {:.1} s after destroy",
        start.elapsed().as_secs_f64()
    );
}

/// A fork() of a rank uses its parent's communicator: refused with
/// InvalidUsage saying why, and destroying it there leaves the parent's
/// job running.
#[test]
fn a_forked_child_cannot_use_its_parents_communicator() {
    let url = format!("tcp://127.0.0.1:{}", common::free_port());
    let results = common::world_with(
        2,
        common::opts(20_000),
        Duration::from_secs(60),
        move |rank, size| Comm::init(&url, rank as i64, size as i64, &common::opts(20_000)),
        |comm| {
            let mut child_said = String::new();
            if comm.rank() == 0 {
                let mut fds = [0i32; 2];
                // SAFETY: a pipe for the child's verdict.
                assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
                // SAFETY: the child only calls rdist, writes to the pipe and _exits.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    let mut v = [1.0f32; 4];
                    let e = comm.allreduce(&mut v, ReduceOp::Sum);
                    let msg = match e {
                        Err(e) if e.kind() == ErrorKind::InvalidUsage => e.message().to_string(),
                        Err(e) => format!("wrong error: {e}"),
                        Ok(()) => "SUCCESS".to_string(),
                    };
                    drop(comm);
                    // SAFETY: writing our own buffer to our pipe, then exiting.
                    unsafe {
                        libc::write(fds[1], msg.as_ptr().cast(), msg.len());
                        libc::_exit(0);
                    }
                }
                // SAFETY: closing our copy of the write end, reaping the child.
                unsafe {
                    libc::close(fds[1]);
                    let mut status = 0;
                    libc::waitpid(pid, &mut status, 0);
                }
                let mut buf = [0u8; 1024];
                // SAFETY: reading into our buffer.
                let n = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len()) };
                child_said = String::from_utf8_lossy(&buf[..n.max(0) as usize]).into_owned();
                // SAFETY: our read end.
                unsafe { libc::close(fds[0]) };
            }
            // The parent's job is intact.
            let mut v = [comm.rank() as f32 + 1.0; 4];
            comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
            (child_said, v[0])
        },
    );
    let (said, sum) = &results[0];
    assert!(
        said.contains("is a fork() of it"),
        "the child got: {said:?}"
    );
    for (_, sum) in &results {
        assert_eq!(*sum, 3.0);
    }
    let _ = sum;
}

/// Stray connections that say nothing, made to ranks' listeners while a
/// rank is late, no longer fail init (each is dropped at its deadline,
/// side by side): they made every rank's init fail after the full
/// timeout, blaming the real ranks.
#[test]
fn silent_strangers_at_the_listeners_do_not_fail_init() {
    use rdist::store::{Store, TcpStoreClient};
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let early: Vec<_> = (0..2)
        .map(|r| {
            let url = url.clone();
            std::thread::spawn(move || {
                let comm = Comm::init(&url, r, 3, &common::opts(30_000))?;
                let mut v = [r as u64 + 1];
                comm.allreduce(&mut v, ReduceOp::Sum)?;
                Ok::<_, rdist::Error>(v[0])
            })
        })
        .collect();
    // A stranger reads ranks 0 and 1's addresses and opens six silent
    // connections to each, while rank 2 is late.
    let store = TcpStoreClient::connect(
        &format!("127.0.0.1:{port}"),
        Instant::now() + Duration::from_secs(10),
    )
    .unwrap();
    let mut silent = Vec::new();
    for r in 0..2 {
        let v = store
            .get(&format!("rdist/tcp/1/rank/{r}"), Duration::from_secs(10))
            .unwrap();
        let addr: std::net::SocketAddr = String::from_utf8_lossy(&v)
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        for _ in 0..6 {
            silent.push(std::net::TcpStream::connect(addr).unwrap());
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    let start = Instant::now();
    let late = Comm::init(&url, 2, 3, &common::opts(30_000)).unwrap();
    let mut v = [3u64];
    late.allreduce(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v[0], 6);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "init took {:?}",
        start.elapsed()
    );
    for h in early {
        assert_eq!(h.join().unwrap().unwrap(), 6);
    }
    drop(silent);
}

/// When a collective times out, every waiting rank names the rank that
/// never reached it and what that rank last did (the flight recorder).
#[test]
fn a_timeout_names_the_rank_that_never_came_and_what_it_last_did() {
    let url = format!("tcp://127.0.0.1:{}", common::free_port());
    let results = common::world_with(
        3,
        common::opts(4_000),
        Duration::from_secs(60),
        move |rank, size| Comm::init(&url, rank as i64, size as i64, &common::opts(4_000)),
        |comm| {
            let mut v = [1u32; 8];
            comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
            if comm.rank() == 2 {
                // Busy elsewhere (a slow data loader, a hang in user code).
                std::thread::sleep(Duration::from_secs(6));
                return String::new();
            }
            let e = comm.allreduce(&mut v, ReduceOp::Sum).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            e.message().to_string()
        },
    );
    for msg in &results[..2] {
        assert!(
            msg.contains("ranks that never reached allreduce #")
                && msg.contains(": rank 2 last finished allreduce #"),
            "{msg}"
        );
        assert!(
            msg.contains("has been in no rdist collective since"),
            "{msg}"
        );
        assert!(
            !msg.contains("rank 0 last") && !msg.contains("rank 1 last"),
            "{msg}"
        );
    }
    println!("{}", results[0]);
}

/// A stopped rank (SIGSTOP: a debugger, ^Z, a frozen host): the others
/// time out naming it; when it is rank 0, whose host serves the store,
/// they also say that the store could not answer and why that may be.
#[test]
fn a_stopped_rank_is_named_by_the_others() {
    for stopped in [1usize, 0] {
        let role = format!("stop{stopped}");
        let port = common::free_port();
        let mut workers: Vec<_> = (0..3).map(|r| spawn_worker(&role, r, 3, port)).collect();
        let start = Instant::now();
        let mut said = Vec::new();
        for (r, w) in workers.iter_mut().enumerate() {
            if r == stopped {
                continue;
            }
            while w.try_wait().unwrap().is_none() {
                assert!(start.elapsed() < Duration::from_secs(40), "rank {r} hung");
                std::thread::sleep(Duration::from_millis(20));
            }
            let mut out = String::new();
            std::io::Read::read_to_string(w.stdout.as_mut().unwrap(), &mut out).unwrap();
            said.push((r, out));
        }
        let _ = workers[stopped].kill();
        let _ = workers[stopped].wait();
        for (r, out) in &said {
            let line = out
                .lines()
                .find_map(|l| l.split_once("RESULT").map(|x| x.1))
                .unwrap_or_else(|| panic!("rank {r} printed no result: {out}"));
            assert!(line.contains("kind=Timeout"), "rank {r}: {line}");
            let named = if stopped == 0 {
                line.contains("could not say what the other ranks last did")
                    && line.contains("rank 0")
            } else {
                line.contains(&format!("rank {stopped}"))
            };
            assert!(named, "rank {r} does not point at rank {stopped}: {line}");
            println!("rank {stopped} stopped; rank {r} said:{line}");
        }
    }
}

/// Three ranks on sockets only (with backend auto, init's agreement on
/// NCCL, an allgather, connects some pairs already): rank 2 runs `rank_2`
/// instead of the call, ranks 0 and 1 an allreduce, which must fail; their
/// error kinds, how long the call took, and the messages.
fn allreduce_without_rank_2(
    timeout_ms: u64,
    rank_2: impl Fn(Comm) + Send + Sync + 'static,
) -> Vec<Option<(ErrorKind, Duration, String)>> {
    let mut o = common::opts(timeout_ms);
    o.set("backend", "socket").unwrap();
    let limit = Duration::from_millis(timeout_ms) + Duration::from_secs(15);
    common::world(3, o, limit, move |comm| {
        if comm.rank() == 2 {
            rank_2(comm);
            return None;
        }
        // Rank 2 has left (or is busy) by the time the others call.
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let e = comm.allreduce(&mut [1u32; 8], ReduceOp::Sum).unwrap_err();
        Some((e.kind(), t.elapsed(), e.to_string()))
    })
}

/// Pairs connect on first use, so a rank that never makes a call is
/// first missed as a connection that never came; after a second the ranks
/// waiting for it dial it themselves (it is alive, and its endpoint's
/// thread admits the connection) and wait for its data: every rank that
/// needs it times out within the timeout, and one names it and the call.
#[test]
fn a_rank_that_never_calls_is_named_by_the_ranks_waiting_for_it() {
    let results = allreduce_without_rank_2(1_500, |_comm| {
        std::thread::sleep(Duration::from_millis(2_500));
    });
    for (rank, r) in results.iter().take(2).enumerate() {
        let (kind, took, msg) = r.clone().unwrap();
        assert!(
            matches!(kind, ErrorKind::Timeout | ErrorKind::PeerLost),
            "rank {rank}: {msg}"
        );
        assert!(took < Duration::from_secs(4), "rank {rank}: {took:?}");
    }
    // A rank that waited for rank 2 itself says so (the other may wait
    // for that rank instead, or hear of it from it first): for its
    // connection, or, once it dialed rank 2, for its data.
    let waited =
        results.iter().take(2).flatten().any(|(kind, _, msg)| {
            *kind == ErrorKind::Timeout && msg.contains("waiting for rank 2")
        });
    assert!(waited, "{results:?}");
}

/// A rank that leaves before it ever connected (here: destroys its
/// communicator) is noticed by a rank waiting for its connection within
/// about a second, not at the timeout: nobody listens at its address.
#[test]
fn a_rank_gone_before_connecting_is_noticed_within_seconds() {
    let results = allreduce_without_rank_2(30_000, drop);
    // Every rank fails soon, and the one that waited for rank 2 says why
    // (the other may hear it from that rank).
    for (rank, r) in results.iter().take(2).enumerate() {
        let (kind, took, msg) = r.clone().unwrap();
        assert_eq!(kind, ErrorKind::PeerLost, "rank {rank}: {msg}");
        assert!(
            took < Duration::from_secs(5),
            "rank {rank}: {took:?}: {msg}"
        );
        assert!(msg.contains("rank 2"), "rank {rank}: {msg}");
    }
    assert!(
        results
            .iter()
            .flatten()
            .any(|(_, _, m)| m.contains("nobody listens")),
        "{results:?}"
    );
}

/// The body of `a_failed_rank_that_lives_on_is_heard_by_ranks_it_never_met`:
/// rank 2 aborts at once and lives on (as a program that handles the
/// error and goes on with other work); ranks 0 and 1 then make `call`,
/// their first with rank 2, and print how it ended.
fn aborted_rank_2_then(comm: &Comm, call: &str) {
    if comm.rank() == 2 {
        comm.abort();
        std::thread::sleep(Duration::from_secs(8));
        return;
    }
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let r = match call {
        "allreduce" => comm.allreduce(&mut [1u32; 8], ReduceOp::Sum),
        _ => comm.send(&[1u32; 8], 2),
    };
    match r {
        Ok(()) => println!("RESULT never failed"),
        Err(e) => println!(
            "RESULT kind={:?} after={:.3} msg={e}",
            e.kind(),
            t.elapsed().as_secs_f64()
        ),
    }
}

/// A rank whose communicator failed but whose process lives on answers
/// every dial with its failure report, and the ranks waiting for its
/// first connection dial it after a second: ranks that never talked to
/// it fail within seconds with its reason (here `Aborted`, naming it),
/// in a collective (where it was to dial them) and in a send (which
/// dials it). Before, they waited until it exited (a lost peer, its
/// reason unknown) or to the timeout, and a send failed as `PeerLost`
/// with the communicator still usable.
#[test]
fn a_failed_rank_that_lives_on_is_heard_by_ranks_it_never_met() {
    for call in ["allreduce", "send"] {
        let role = format!("abort2_then_{call}");
        let port = common::free_port();
        let mut workers: Vec<_> = (0..3)
            .map(|r| {
                let mut w = worker_command(&role, r, 3, port, 30_000);
                // No NCCL agreement at init, which connects pairs.
                w.env("RDIST_BACKEND", "socket")
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                w.spawn().unwrap()
            })
            .collect();
        let start = Instant::now();
        for r in 0..2 {
            let line = result_of(&mut workers, r, start, Duration::from_secs(40), &role);
            assert!(line.contains("kind=Aborted"), "{call}: rank {r}:{line}");
            assert!(
                line.contains("rank 2 aborted the communicator"),
                "{call}: rank {r}:{line}"
            );
            // Rank 2 lives 8 s; the timeout is 30 s.
            let after = after_of(&line);
            assert!(after < 4.0, "{call}: rank {r} took {after} s:{line}");
        }
        let _ = workers[2].kill();
        let _ = workers[2].wait();
    }
}

/// The body of the point-to-point half of
/// `a_stopped_rank_is_named_within_seconds_not_at_the_timeout`: rank 1
/// stops itself; ranks 0 and 2 receive from it.
fn receive_from_a_stopped_rank_1(comm: &Comm) {
    comm.barrier().unwrap();
    if comm.rank() == 1 {
        // SAFETY: stops this process (as a debugger or ^Z would).
        unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        // The stop reaches this thread a moment later: it must not go on
        // to destroy the communicator meanwhile (a rank gone, not stopped).
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let t = Instant::now();
    match comm.recv(&mut [0u32; 8], 1) {
        Ok(()) => println!("RESULT never failed"),
        Err(e) => println!(
            "RESULT kind={:?} after={:.3} failed={:?} msg={e}",
            e.kind(),
            t.elapsed().as_secs_f64(),
            comm.failed_ranks()
        ),
    }
}

/// The body of `a_receive_from_any_source_ends_when_every_sender_is_gone`:
/// rank 1 stops itself and rank 2 dies after a barrier; rank 0 receives
/// from any source.
fn receive_from_any_while_rank_1_stops_and_rank_2_dies(comm: &Comm) {
    comm.barrier().unwrap();
    match comm.rank() {
        0 => {
            let t = Instant::now();
            let first = comm.recv_tagged(&mut [0u32; 8], None, None);
            let took = t.elapsed().as_secs_f64();
            // Another, once nobody is left: at once.
            let t = Instant::now();
            let again = comm.recv_tagged(&mut [0u32; 8], None, None);
            let again = format!("{:.3} {again:?}", t.elapsed().as_secs_f64());
            match first {
                Ok(s) => println!("RESULT never failed: {s:?}"),
                Err(e) => println!(
                    "RESULT kind={:?} after={took:.3} failed={:?} msg={e} again={again}",
                    e.kind(),
                    comm.failed_ranks()
                ),
            }
            // SAFETY: ends the process without waiting for the others.
            unsafe { libc::_exit(0) };
        }
        1 => {
            // SAFETY: stops this process (as a debugger or ^Z would).
            unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
            std::thread::sleep(Duration::from_secs(60));
        }
        _ => {
            // SAFETY: a deliberate crash, no cleanup, as a segfault would.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
    }
}

/// The body of `destroy_does_not_wait_out_the_timeout_for_a_stopped_receiver`,
/// through the C API: rank 1 stops itself after a barrier; rank 0 starts
/// a send to it too large for the way between them to hold, never waits
/// for it, and destroys its communicator.
fn destroy_with_a_send_to_a_stopped_rank() {
    use rdist::ffi::collectives::rdist_barrier;
    use rdist::ffi::comm::{rdist_comm_destroy, rdist_init};
    use rdist::ffi::p2p::rdist_isend;
    use rdist::ffi::requests::rdist_wait;
    use rdist::ffi::version::rdist_last_error;
    let mut comm = std::ptr::null_mut();
    let rc = rdist_init(&mut comm, c"env://".as_ptr(), -1, -1, std::ptr::null());
    assert_eq!(rc as i32, 0);
    assert_eq!(rdist_barrier(comm) as i32, 0);
    if std::env::var("RANK").unwrap() != "0" {
        // SAFETY: stops this process (as a debugger or ^Z would).
        unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    std::thread::sleep(Duration::from_millis(500));
    let data = vec![7u8; 32 << 20];
    let mut req = std::ptr::null_mut();
    let rc = rdist_isend(data.as_ptr().cast(), data.len(), 0, 1, comm, &mut req);
    assert_eq!(rc as i32, 0);
    let t = Instant::now();
    let rc = rdist_comm_destroy(comm);
    let took = t.elapsed().as_secs_f64();
    let send = rdist_wait(req);
    // SAFETY: the thread's last error, a C string.
    let msg = unsafe { std::ffi::CStr::from_ptr(rdist_last_error()) }.to_string_lossy();
    println!("RESULT rc={rc:?} after={took:.3} send={send:?} msg={msg}");
    // SAFETY: ends the process without waiting for the stopped rank.
    unsafe { libc::_exit(0) };
}

/// The body of `a_wait_is_not_held_behind_dials_to_other_stopped_ranks`,
/// through the C API as a C program would: every rank but 0 stops right
/// after init; rank 0 posts receives from each (none connected yet) and
/// waits for the last one.
fn wait_behind_dials_to_stopped_ranks() {
    use rdist::ffi::comm::rdist_init;
    use rdist::ffi::p2p::rdist_irecv;
    use rdist::ffi::requests::rdist_wait;
    use rdist::ffi::version::rdist_last_error;
    let mut comm = std::ptr::null_mut();
    let rc = rdist_init(&mut comm, c"env://".as_ptr(), -1, -1, std::ptr::null());
    assert_eq!(rc as i32, 0);
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    let size: usize = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
    if rank != 0 {
        // SAFETY: stops this process (as a debugger or ^Z would).
        unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    std::thread::sleep(Duration::from_millis(1500));
    let mut bufs = vec![[0u32; 16]; size];
    let reqs: Vec<_> = (1..size)
        .map(|p| {
            let mut req = std::ptr::null_mut();
            let rc = rdist_irecv(bufs[p].as_mut_ptr().cast(), 16, 3, p as i32, comm, &mut req);
            assert_eq!(rc as i32, 0);
            req
        })
        .collect();
    let t = Instant::now();
    let rc = rdist_wait(*reqs.last().unwrap());
    // SAFETY: the thread's last error, a C string.
    let msg = unsafe { std::ffi::CStr::from_ptr(rdist_last_error()) }.to_string_lossy();
    println!(
        "RESULT rc={rc:?} after={:.3} msg={msg}",
        t.elapsed().as_secs_f64()
    );
    // SAFETY: ends the process without waiting for the stopped ranks.
    unsafe { libc::_exit(0) };
}

/// The body of `an_abort_ends_a_dial_to_a_stopped_rank`: rank 0 stops
/// itself; rank 1 makes `call` with it (a first one, so it dials rank 0)
/// and aborts from another thread a second later.
fn abort_a_dial_to_a_stopped_rank_0(comm: &Comm, call: &str) {
    if comm.rank() == 0 {
        // SAFETY: stops this process (as a debugger or ^Z would).
        unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    // Until rank 0 is stopped (it may be slow to get there on a busy
    // machine, and a live rank 0 would answer the dial).
    let pid = std::env::var("RDIST_TEST_STOPPED_PID").unwrap();
    let stopped = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, st)| st.starts_with('T'))
        })
    };
    let began = Instant::now();
    while !stopped() {
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "rank 0 never stopped"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let handle = comm.abort_handle();
    let aborter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        handle.abort();
    });
    let t = Instant::now();
    let result = match call {
        "send" => comm.send(&[7u32; 8], 0),
        _ => comm.allreduce(&mut [1u32; 8], ReduceOp::Sum),
    };
    let after = t.elapsed().as_secs_f64();
    aborter.join().unwrap();
    match result {
        Ok(()) => println!("RESULT never failed"),
        Err(e) => println!("RESULT kind={:?} after={after:.3} msg={e}", e.kind()),
    }
}

/// A rank that dials a stopped one (whose kernel accepts the connection
/// for it, so the dial's answer never comes) is freed by
/// `rdist_comm_abort` from another thread at once, in a first
/// point-to-point call and in a first collective alike. The watch is off
/// and the timeout 60 s: before, the dial waited for the whole timeout.
#[test]
fn an_abort_ends_a_dial_to_a_stopped_rank() {
    for call in ["send", "allreduce"] {
        let role = format!("abort_dial_{call}");
        let port = common::free_port();
        let mut workers: Vec<std::process::Child> = Vec::new();
        for r in 0..2 {
            let mut w = worker_command(&role, r, 2, port, 60_000);
            w.env("RDIST_PEER_CHECK_MS", "0")
                // No NCCL agreement at init: the pair is not connected.
                .env("RDIST_BACKEND", "socket")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null());
            if let Some(rank_0) = workers.first() {
                w.env("RDIST_TEST_STOPPED_PID", rank_0.id().to_string());
            }
            workers.push(w.spawn().unwrap());
        }
        let line = result_of(
            &mut workers,
            1,
            Instant::now(),
            Duration::from_secs(20),
            &role,
        );
        let _ = workers[0].kill();
        let _ = workers[0].wait();
        assert!(line.contains("kind=Aborted"), "{call}:{line}");
        assert!(line.contains("while it dialed rank 0"), "{call}:{line}");
        let after = after_of(&line);
        assert!(after < 4.0, "{call}: the abort took {after} s:{line}");
    }
}

/// A rank stopped (SIGSTOP, as ^Z or a debugger does) while the others
/// wait for it, with a timeout far away (60 s): after 3 s of silence they
/// ask whether its process runs, and since it does not answer within
/// 12 s, every other rank fails with `PeerLost` naming it, and counts it
/// as failed, well before the timeout; in a collective and in a blocking
/// receive. (Before, they waited for the whole timeout.)
#[test]
fn a_stopped_rank_is_named_within_seconds_not_at_the_timeout() {
    for role in ["hush1", "hush_p2p"] {
        let mut workers = start_job(role, 3, 60_000, false);
        let start = Instant::now();
        let said: Vec<(usize, String)> = [0usize, 2]
            .into_iter()
            .map(|r| {
                (
                    r,
                    result_of(&mut workers, r, start, Duration::from_secs(50), role),
                )
            })
            .collect();
        let _ = workers[1].kill();
        let _ = workers[1].wait();
        for (r, line) in &said {
            assert!(line.contains("kind=PeerLost"), "{role}: rank {r}:{line}");
            assert!(
                line.contains("rank 1 does not answer"),
                "{role}: rank {r}:{line}"
            );
            assert!(line.contains("failed=[1]"), "{role}: rank {r}:{line}");
            let after = after_of(line);
            assert!(after < 30.0, "{role}: rank {r} took {after} s:{line}");
        }
    }
}

/// A receive from any source, while one rank is stopped and the other
/// died: the stopped one is asked (as a receive from it would ask it) and
/// given up, and with no rank left to send, the receive fails with
/// `PeerLost` within seconds, and so does one posted afterwards. (Before,
/// a receive from any source never asked, and waited for the whole
/// timeout, here 60 s.)
#[test]
fn a_receive_from_any_source_ends_when_every_sender_is_gone() {
    let mut workers = start_job("hush_any", 3, 60_000, false);
    let start = Instant::now();
    let line = result_of(&mut workers, 0, start, Duration::from_secs(80), "hush_any");
    for w in &mut workers {
        let _ = w.kill();
        let _ = w.wait();
    }
    assert!(line.contains("kind=PeerLost"), "{line}");
    assert!(line.contains("every other rank is gone"), "{line}");
    assert!(line.contains("failed=[1, 2]"), "{line}");
    let after = after_of(&line);
    assert!(after < 35.0, "the receive took {after} s:{line}");
    // So does one posted then, after the silence that starts a question
    // (a send to self could still come meanwhile).
    let again = line.split_once("again=").unwrap().1;
    assert!(
        again.contains("PeerLost") && again.contains("every other rank is gone"),
        "{line}"
    );
    let took: f64 = again.split_whitespace().next().unwrap().parse().unwrap();
    assert!(took < 8.0, "{line}");
}

/// A communicator destroyed with a send still waiting for a stopped
/// receiver (SIGSTOP, a debugger) returns within seconds: its send fails
/// with `PeerLost` naming the rank, and stderr says so. (Before, the
/// destroy waited for the whole timeout, here 60 s, with nothing said, and
/// the send failed as "aborted".)
#[test]
fn destroy_does_not_wait_out_the_timeout_for_a_stopped_receiver() {
    let mut workers = start_job("destroy_stopped", 2, 60_000, true);
    let start = Instant::now();
    let line = result_of(
        &mut workers,
        0,
        start,
        Duration::from_secs(80),
        "destroy_stopped",
    );
    let mut said = String::new();
    std::io::Read::read_to_string(workers[0].stderr.as_mut().unwrap(), &mut said).unwrap();
    for w in &mut workers {
        let _ = w.kill();
        let _ = w.wait();
    }
    // Said on stderr too, for a program that never waits for the send.
    assert!(
        said.contains("rdist WARN [rank 0] rdist_comm_destroy waits for ranks [1] to receive"),
        "{said}"
    );
    assert!(
        said.contains("rdist WARN [rank 0] rdist_comm_destroy: the sends to rank 1 failed: rank 1 does not answer"),
        "{said}"
    );
    assert!(line.contains("rc=RDIST_SUCCESS"), "{line}");
    assert!(line.contains("send=RDIST_ERR_PEER_LOST"), "{line}");
    assert!(line.contains("rank 1 does not answer"), "{line}");
    let after = after_of(&line);
    assert!(after < 25.0, "the destroy took {after} s:{line}");
}

/// Rank 0 waits for a receive from rank 4 while ranks 1-4 are stopped and
/// none is connected yet: each dial to a stopped rank is held to its
/// bound (10 s), and the wait dialed ranks 1, 2 and 3 first, in one pass,
/// before it looked at its own call (about 40 s). The waited call's peer
/// is now dialed first, and one dial is made a pass.
#[test]
fn a_wait_is_not_held_behind_dials_to_other_stopped_ranks() {
    let port = common::free_port();
    let mut workers: Vec<_> = (0..5)
        .map(|r| {
            let mut w = worker_command("dial_stopped", r, 5, port, 30_000);
            w.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null());
            w.spawn().unwrap()
        })
        .collect();
    let start = Instant::now();
    let line = result_of(
        &mut workers,
        0,
        start,
        Duration::from_secs(90),
        "dial_stopped",
    );
    for w in &mut workers {
        let _ = w.kill();
        let _ = w.wait();
    }
    assert!(line.contains("RDIST_ERR_PEER_LOST"), "{line}");
    assert!(line.contains("rank 4"), "{line}");
    let after = after_of(&line);
    assert!(after < 16.0, "the wait took {after} s:{line}");
}

/// A rank that is merely late (here 5 s, past the second after which the
/// others dial it and the 3 s after which they ask whether it runs) is
/// waited for: its endpoint's thread answers both, and the call then
/// succeeds on every rank with the right sum.
#[test]
fn a_late_rank_is_waited_for_not_given_up() {
    let mut o = common::opts(30_000);
    o.set("backend", "socket").unwrap();
    let results = common::world(3, o, Duration::from_secs(40), |comm| {
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_secs(5));
        }
        let mut v = [comm.rank() as u32 + 1; 8];
        comm.allreduce(&mut v, ReduceOp::Sum).map(|()| v[0])
    });
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(r.as_ref().ok(), Some(&6), "rank {rank}: {r:?}");
    }
}

/// Waits (up to `limit` from `start`) for worker `r` to exit and returns
/// its RESULT line; on a hang, kills every worker and panics.
fn result_of(
    workers: &mut [std::process::Child],
    r: usize,
    start: Instant,
    limit: Duration,
    what: &str,
) -> String {
    while workers[r].try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            for w in workers.iter_mut() {
                let _ = w.kill();
            }
            panic!("{what}: rank {r} still waits after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = String::new();
    std::io::Read::read_to_string(workers[r].stdout.as_mut().unwrap(), &mut out).unwrap();
    let line = out
        .lines()
        .find_map(|l| l.split_once("RESULT").map(|x| x.1.to_string()))
        .unwrap_or_else(|| panic!("{what}: rank {r} printed no result: {out}"));
    println!("{what}: rank {r}:{line}");
    line
}

/// The `after=<seconds>` of a RESULT line.
fn after_of(line: &str) -> f64 {
    line.split_once("after=")
        .and_then(|(_, t)| t.split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no after= in {line}"))
}
