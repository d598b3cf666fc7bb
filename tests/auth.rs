//! Authentication (`auth_token`): ranks that know the job's token meet and
//! run; a process with a wrong or missing token is refused with
//! RDIST_ERR_AUTH and a message that says so, and the job goes on without
//! it, even when it came first and claimed a real rank's number.

mod common;

use rdist::{Comm, ErrorKind, Options, ReduceOp};
use std::time::{Duration, Instant};

fn with_token(token: Option<&str>, timeout_ms: u64) -> Options {
    let mut o = common::opts(timeout_ms);
    if let Some(t) = token {
        o.set("auth_token", t).unwrap();
    }
    o
}

#[test]
fn ranks_with_the_token_meet_and_every_connection_proves_it() {
    // Over TCP, point-to-point dials connections of its own (with shared
    // memory it uses rings made at init).
    for transport in ["auto", "tcp"] {
        let opts = move || {
            let mut o = with_token(Some("s3cret"), 20_000);
            o.set("transport", transport).unwrap();
            o
        };
        let url = format!("tcp://127.0.0.1:{}", common::free_port());
        let results = common::world_with(
            3,
            opts(),
            Duration::from_secs(60),
            move |rank, size| Comm::init(&url, rank as i64, size as i64, &opts()),
            |comm| {
                let mut v = [comm.rank() as u64 + 1];
                comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                let next = (comm.rank() + 1) % comm.size();
                let prev = (comm.rank() + comm.size() - 1) % comm.size();
                let out = [comm.rank() as u32; 4];
                let mut inc = [0u32; 4];
                comm.sendrecv(&out, next, &mut inc, prev).unwrap();
                (v[0], inc[0] as usize == prev)
            },
        );
        for (sum, ring_ok) in results {
            assert_eq!(sum, 6, "{transport}");
            assert!(ring_ok, "{transport}");
        }
    }
}

#[test]
fn a_stranger_claiming_a_rank_is_refused_and_the_job_goes_on() {
    for stranger_token in [Some("guess"), None] {
        let port = common::free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        // Rank 0 hosts the store with the token.
        let hosts = {
            let url = url.clone();
            std::thread::spawn(move || {
                let comm = Comm::init(&url, 0, 2, &with_token(Some("s3cret"), 20_000))?;
                let mut v = [1u64];
                comm.allreduce(&mut v, ReduceOp::Sum)?;
                Ok::<_, rdist::Error>(v[0])
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        // The stranger comes first, as rank 1.
        let start = Instant::now();
        let refused = Comm::init(&url, 1, 2, &with_token(stranger_token, 5_000))
            .err()
            .expect("a stranger joined the job");
        assert_eq!(refused.kind(), ErrorKind::Auth, "{refused}");
        let msg = refused.message().to_string();
        match stranger_token {
            Some(_) => assert!(msg.contains("does not know this job's auth token"), "{msg}"),
            None => assert!(msg.contains("requires an auth token"), "{msg}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "took {:?}",
            start.elapsed()
        );
        // The real rank 1 joins after it.
        let comm = Comm::init(&url, 1, 2, &with_token(Some("s3cret"), 20_000)).unwrap();
        let mut v = [2u64];
        comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], 3);
        assert_eq!(hosts.join().unwrap().unwrap(), 3);
    }
}

#[test]
fn a_token_where_the_others_have_none_is_named() {
    let url = format!("tcp://127.0.0.1:{}", common::free_port());
    let host = {
        let url = url.clone();
        std::thread::spawn(move || Comm::init(&url, 0, 2, &with_token(None, 3_000)).err())
    };
    std::thread::sleep(Duration::from_millis(200));
    let e = Comm::init(&url, 1, 2, &with_token(Some("s3cret"), 3_000))
        .err()
        .expect("a token where the store has none");
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.message().contains("has no auth token"), "{e}");
    let _ = host.join();
}

#[test]
fn a_blank_token_is_refused_not_taken_for_none() {
    // Set as an option, and in a process of its own through the
    // environment (where a blank variable used to mean "no token").
    for blank in ["", "  "] {
        let e = Options::default().set("auth_token", blank).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.message().contains("would turn authentication off"), "{e}");
        let out = common::output_within(
            std::process::Command::new(env!("CARGO_BIN_EXE_rdist-bench"))
                .args(["--op", "barrier", "--reps", "1"])
                .env("RANK", "0")
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", common::free_port().to_string())
                .env("RDIST_TIMEOUT_MS", "5000")
                .env("RDIST_AUTH_TOKEN", blank),
            Duration::from_secs(20),
            "rdist-bench with a blank RDIST_AUTH_TOKEN",
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(stderr.contains("RDIST_AUTH_TOKEN"), "{stderr}");
        assert!(stderr.contains("would turn authentication off"), "{stderr}");
    }
}
