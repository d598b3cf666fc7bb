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

/// Connects to `to` from the local address `from` (a loopback address
/// other than 127.0.0.1 plays a stranger on another host).
fn connect_from(from: std::net::Ipv4Addr, to: std::net::SocketAddr) -> std::net::TcpStream {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(to) = to else {
        panic!("an IPv4 peer expected: {to}")
    };
    let sin = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(ip.octets()),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain system calls on a fresh socket with live addresses.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        let local = sin(from, 0);
        assert_eq!(
            libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len),
            0
        );
        let remote = sin(*to.ip(), to.port());
        assert_eq!(
            libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len),
            0
        );
        std::net::TcpStream::from_raw_fd(fd)
    }
}

#[test]
fn a_stranger_from_another_address_cannot_greet_a_rank_as_its_peer() {
    // Without a token the job's id is in the store for anyone to read, and
    // the pairs connect on first use: a stranger could greet rank 0 as rank
    // 1 before rank 1 does, and take its place. A hello's rank is believed
    // only from that rank's own address.
    use std::io::{Read, Write};
    use std::sync::mpsc;
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = std::sync::Arc::new(std::sync::Mutex::new(go_rx));
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let (url, go) = (url.clone(), go_rx.clone());
            std::thread::spawn(move || {
                let mut o = with_token(None, 20_000);
                o.set("transport", "tcp").unwrap();
                let comm = Comm::init(&url, r, 2, &o)?;
                // No call yet, so no connection between the two.
                let _ = go.lock().unwrap().recv();
                let mut v = [r as u64 + 1];
                comm.allreduce(&mut v, ReduceOp::Sum)?;
                Ok::<_, rdist::Error>(v[0])
            })
        })
        .collect();
    // The stranger reads the job id and rank 0's address from the store.
    let store = rdist::store::TcpStoreClient::connect(
        &format!("127.0.0.1:{port}"),
        Instant::now() + Duration::from_secs(10),
    )
    .unwrap();
    use rdist::store::Store;
    let job = store
        .get("rdist/tcp/1/job", Duration::from_secs(10))
        .unwrap();
    let rank0 = store
        .get("rdist/tcp/1/rank/0", Duration::from_secs(10))
        .unwrap();
    let rank0: std::net::SocketAddr = String::from_utf8_lossy(&rank0)
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let mut hello = Vec::new();
    hello.extend_from_slice(&0x5244_4831u32.to_le_bytes());
    hello.extend_from_slice(&job[..16]);
    hello.extend_from_slice(&0u64.to_le_bytes()); // the world communicator
    hello.extend_from_slice(&1u32.to_le_bytes()); // "I am rank 1"
    hello.extend_from_slice(&2u32.to_le_bytes());
    hello.extend_from_slice(&[0; 4]);
    std::thread::sleep(Duration::from_millis(300)); // both ranks are listening
    let mut stranger = connect_from(std::net::Ipv4Addr::new(127, 0, 0, 2), rank0);
    stranger.write_all(&hello).unwrap();
    stranger
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut verdict = [0u8; 1];
    stranger.read_exact(&mut verdict).unwrap();
    assert_eq!(verdict[0], 4, "rank 0 took a stranger for rank 1");
    // The real ranks meet and run as if it never came.
    go_tx.send(()).unwrap();
    go_tx.send(()).unwrap();
    for h in ranks {
        assert_eq!(h.join().unwrap().unwrap(), 3);
    }
}
