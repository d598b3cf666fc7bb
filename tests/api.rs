//! The rest of the contract: non-blocking calls, groups, split, the
//! file:// and unique-id rendezvous, and the C ABI's handling of bad input.

mod common;

use rdist::ffi::collectives::*;
use rdist::ffi::comm::*;
use rdist::ffi::groups::*;
use rdist::ffi::options::*;
use rdist::ffi::p2p::*;
use rdist::ffi::requests::*;
use rdist::ffi::types::*;
use rdist::ffi::version::*;
use rdist::internals::OpKind;
use rdist::internals::{Call, Data};
use rdist::{Comm, DType, ErrorKind, ReduceOp};
use std::ffi::{c_void, CStr};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);

fn last_error() -> String {
    unsafe { CStr::from_ptr(rdist_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn non_blocking_calls_complete_in_order_with_blocking_ones() {
    common::world(3, common::opts(20_000), LIMIT, |comm| {
        let r = comm.rank() as f32;
        let mut a = vec![r; 50_000];
        let mut b = vec![r * 10.0; 7];
        let ra = unsafe {
            comm.submit(
                Call::new(
                    OpKind::AllReduce,
                    a.as_ptr().cast(),
                    a.as_mut_ptr().cast(),
                    Data {
                        count: a.len(),
                        dtype: DType::Float32,
                    },
                    ReduceOp::Sum,
                    0,
                    comm.rank(),
                    3,
                )
                .unwrap(),
            )
            .unwrap()
        };
        let rb = unsafe {
            comm.submit(
                Call::new(
                    OpKind::Broadcast,
                    b.as_ptr().cast(),
                    b.as_mut_ptr().cast(),
                    Data {
                        count: 7,
                        dtype: DType::Float32,
                    },
                    ReduceOp::Sum,
                    2,
                    comm.rank(),
                    3,
                )
                .unwrap(),
            )
            .unwrap()
        };
        // A blocking call issued now runs after the two queued ones.
        let mut c = [1u64; 3];
        comm.allreduce(&mut c, ReduceOp::Sum).unwrap();
        assert!(
            ra.test().is_some() && rb.test().is_some(),
            "blocking call overtook queued ones"
        );
        ra.wait().unwrap();
        rb.wait().unwrap();
        assert!(a.iter().all(|x| *x == 3.0));
        assert!(b.iter().all(|x| *x == 20.0));
        assert_eq!(c, [3, 3, 3]);
    });
}

#[test]
fn groups_let_ranks_swap_with_a_neighbour_and_themselves() {
    common::world(4, common::opts(20_000), LIMIT, |comm| {
        let (r, n) = (comm.rank(), comm.size());
        let big = 1 << 20;
        let out: Vec<u32> = (0..big).map(|i| (r * big + i) as u32).collect();
        let mut from_left = vec![0u32; big];
        let mut from_right = vec![0u32; big];
        let mut from_self = vec![0u32; 4];
        let (left, right) = ((r + n - 1) % n, (r + 1) % n);
        let d = |c| Data {
            count: c,
            dtype: DType::Uint32,
        };
        unsafe {
            rdist::internals::group::start();
            comm.run(send_call(&out, d(big), left, r, n)).unwrap();
            comm.run(send_call(&out, d(big), right, r, n)).unwrap();
            comm.run(Call::recv(from_self.as_mut_ptr().cast(), d(4), r as i64, n).unwrap())
                .unwrap();
            comm.run(send_call(&out, d(4), r, r, n)).unwrap();
            comm.run(Call::recv(from_left.as_mut_ptr().cast(), d(big), left as i64, n).unwrap())
                .unwrap();
            comm.run(Call::recv(from_right.as_mut_ptr().cast(), d(big), right as i64, n).unwrap())
                .unwrap();
            rdist::internals::group::end().unwrap();
        }
        assert_eq!(from_left[5], (left * big + 5) as u32);
        assert_eq!(from_right[big - 1], (right * big + big - 1) as u32);
        assert_eq!(from_self, out[..4]);
    });
}

#[test]
fn split_forms_ordered_subgroups_and_nocolor_opts_out() {
    let sums = common::world(5, common::opts(20_000), LIMIT, |comm| {
        let r = comm.rank();
        let color = if r == 4 { -1 } else { (r % 2) as i32 };
        // key reverses the order inside each group
        let sub = comm.split(color, -(r as i32)).unwrap();
        if r == 4 {
            assert!(sub.is_none());
            comm.barrier().unwrap();
            return None;
        }
        let sub = sub.unwrap();
        assert_eq!(sub.size(), 2);
        let mut v = [r as u64];
        sub.allreduce(&mut v, ReduceOp::Sum).unwrap();
        let mut order = vec![0u64; 2];
        sub.allgather(&[r as u64], &mut order).unwrap();
        // The parent still works alongside the child.
        comm.barrier().unwrap();
        Some((sub.rank(), v[0], order))
    });
    assert_eq!(sums[0], Some((1, 2, vec![2, 0])));
    assert_eq!(sums[2], Some((0, 2, vec![2, 0])));
    assert_eq!(sums[1], Some((1, 4, vec![3, 1])));
    assert_eq!(sums[3], Some((0, 4, vec![3, 1])));
    assert!(sums[4].is_none());
}

#[test]
fn a_store_at_an_ipv6_address_in_brackets_is_met() {
    // An IPv6 loopback: the store, the ranks' listeners and their
    // connections all on it (skipped where the host has no ::1).
    let Ok(probe) = std::net::TcpListener::bind("[::1]:0") else {
        println!("skipped: this host has no IPv6 loopback");
        return;
    };
    drop(probe);
    for transport in ["auto", "tcp"] {
        let url = format!("tcp://[::1]:{}", common::free_port());
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let url = url.clone();
                std::thread::spawn(move || {
                    let mut o = common::opts(20_000);
                    o.set("transport", transport).unwrap();
                    let comm = Comm::init(&url, r, 3, &o).unwrap();
                    let mut v = [r as i32 + 1];
                    comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                    let mut got = [0i32];
                    let next = (r as usize + 1) % 3;
                    let prev = (r as usize + 2) % 3;
                    comm.sendrecv(&[r as i32], next, &mut got, prev).unwrap();
                    (v[0], got[0] as usize == prev)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), (6, true), "{transport}");
        }
    }
}

#[test]
fn file_rendezvous_meets_and_cleans_up() {
    let dir = std::env::temp_dir().join(format!(
        "rdist-file-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let url = format!("file://{}", dir.display());
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let url = url.clone();
            std::thread::spawn(move || {
                let comm = Comm::init(&url, r, 3, &common::opts(20_000)).unwrap();
                let mut v = [1i32];
                comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                v[0]
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 3);
    }
    assert!(!dir.exists(), "the rendezvous directory was left behind");
}

#[test]
fn bad_arguments_through_the_c_abi_are_precise_and_harmless() {
    assert_eq!(rdist_version(), 200);
    let msg =
        |p: *const std::ffi::c_char| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    assert_eq!(
        msg(rdist_result_string(5)),
        "mismatched calls between ranks"
    );
    assert_eq!(msg(rdist_result_string(77)), "unknown result code");
    let mut data = [1.0f32; 4];
    let p = data.as_mut_ptr() as *mut c_void;
    let rc = rdist_allreduce(p, p, 4, 7, 0, std::ptr::null_mut(), std::ptr::null_mut());
    assert_eq!(rc, rdist_result_t::RDIST_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("rdist_allreduce") && last_error().contains("comm is NULL"),
        "{}",
        last_error()
    );
    assert_eq!(rdist_group_end(), rdist_result_t::RDIST_ERR_INVALID_USAGE);
    assert!(last_error().contains("without a matching rdist_group_start"));
    let mut opts = std::ptr::null_mut();
    assert_eq!(
        rdist_options_create(&mut opts),
        rdist_result_t::RDIST_SUCCESS
    );
    let rc = rdist_options_set(opts, c"timeout_ms".as_ptr(), c"soon".as_ptr());
    assert_eq!(rc, rdist_result_t::RDIST_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("timeout_ms"), "{}", last_error());
    assert_eq!(
        rdist_options_set(opts, c"timeout_ms".as_ptr(), c"20000".as_ptr()),
        rdist_result_t::RDIST_SUCCESS
    );
    assert_eq!(last_error(), "");
    let mut comm = std::ptr::null_mut();
    assert_eq!(
        rdist_init(&mut comm, c"bogus://x".as_ptr(), 0, 1, opts),
        rdist_result_t::RDIST_ERR_INVALID_ARGUMENT
    );
    assert!(comm.is_null(), "out-parameter written on failure");
    assert!(
        last_error().starts_with("rdist_init: rank 0: unknown init method"),
        "{}",
        last_error()
    );
    assert_eq!(
        rdist_init(std::ptr::null_mut(), c"env://".as_ptr(), 0, 1, opts),
        rdist_result_t::RDIST_ERR_INVALID_ARGUMENT
    );

    // A real one-rank communicator for the argument checks below.
    let mut id = rdist_unique_id_t {
        internal: [0; RDIST_UNIQUE_ID_BYTES],
    };
    assert_eq!(rdist_get_unique_id(&mut id), rdist_result_t::RDIST_SUCCESS);
    assert_eq!(
        rdist_comm_init_rank(&mut comm, 1, id, 0, opts),
        rdist_result_t::RDIST_SUCCESS,
        "{}",
        last_error()
    );
    rdist_options_destroy(opts);
    rdist_options_destroy(std::ptr::null_mut());
    let before = data;
    let cases: Vec<(&str, rdist_result_t)> = vec![
        (
            "dtype 99",
            rdist_allreduce(p, p, 4, 99, 0, comm, std::ptr::null_mut()),
        ),
        (
            "dtype -1",
            rdist_allreduce(p, p, 4, -1, 0, comm, std::ptr::null_mut()),
        ),
        (
            "op 5",
            rdist_allreduce(p, p, 4, 7, 5, comm, std::ptr::null_mut()),
        ),
        (
            "NULL sendbuf",
            rdist_allreduce(std::ptr::null(), p, 4, 7, 0, comm, std::ptr::null_mut()),
        ),
        (
            "overflow",
            rdist_allreduce(p, p, usize::MAX / 2, 7, 0, comm, std::ptr::null_mut()),
        ),
        (
            "root 1",
            rdist_broadcast(p, p, 4, 7, 1, comm, std::ptr::null_mut()),
        ),
        (
            "root -1",
            rdist_reduce(p, p, 4, 7, 0, -1, comm, std::ptr::null_mut()),
        ),
        ("peer 3", rdist_send(p, 4, 7, 3, comm, std::ptr::null_mut())),
        (
            "NULL req",
            rdist_iallreduce(p, p, 4, 7, 0, comm, std::ptr::null_mut()),
        ),
    ];
    for (what, rc) in cases {
        assert_eq!(rc, rdist_result_t::RDIST_ERR_INVALID_ARGUMENT, "{what}");
    }
    assert_eq!(data, before, "a rejected call touched memory");
    assert_eq!(
        rdist_allreduce(p, p, 4, 99, 0, comm, std::ptr::null_mut()),
        rdist_result_t::RDIST_ERR_INVALID_ARGUMENT
    );
    assert!(
        last_error().contains("rdist_allreduce: rank 0: unknown dtype 99"),
        "{}",
        last_error()
    );
    // Still usable after all that.
    let mut req = std::ptr::null_mut();
    assert_eq!(
        rdist_iallreduce(p, p, 4, 7, 4, comm, &mut req),
        rdist_result_t::RDIST_SUCCESS
    );
    assert_eq!(rdist_wait(req), rdist_result_t::RDIST_SUCCESS);
    rdist_request_free(req);
    rdist_request_free(std::ptr::null_mut());
    assert_eq!(data, before);
    let mut out = std::ptr::null_mut();
    assert_eq!(
        rdist_comm_split(comm, RDIST_SPLIT_NOCOLOR, 0, &mut out),
        rdist_result_t::RDIST_SUCCESS
    );
    assert!(out.is_null());
    assert_eq!(
        rdist_comm_split(comm, -5, 0, &mut out),
        rdist_result_t::RDIST_ERR_INVALID_ARGUMENT
    );
    assert_eq!(rdist_comm_destroy(comm), rdist_result_t::RDIST_SUCCESS);
    assert_eq!(
        rdist_comm_destroy(std::ptr::null_mut()),
        rdist_result_t::RDIST_SUCCESS
    );
}

#[test]
fn env_rendezvous_reads_torchrun_variables() {
    // env:// is exercised end to end by tests/c_api.rs through rdistrun, and
    // without a launcher by tests/rdistrun.rs; here only that a missing
    // MASTER_ADDR is explained once a launcher's variables are set.
    let launched = |k: &str| (k == "RANK" || k == "WORLD_SIZE").then(|| "1".to_string());
    let e = rdist::internals::method::parse("env://", &launched).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("MASTER_ADDR"));
}

#[test]
fn trace_file_records_every_operation_per_rank() {
    let dir = std::env::temp_dir().join(format!("rdist-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut o = common::opts(20_000);
    o.set(
        "trace_file",
        &format!("{}/trace-{{rank}}.json", dir.display()),
    )
    .unwrap();
    // Point-to-point too: a posted receive, and a send too large to be
    // written whole at once (both numbered and traced when they complete).
    const P2P: usize = 300_000;
    common::world(2, o, LIMIT, |comm| {
        comm.allreduce(&mut [1.0f64; 100], ReduceOp::Sum).unwrap();
        comm.barrier().unwrap();
        let peer = 1 - comm.rank();
        let d = Data {
            count: P2P,
            dtype: DType::Uint64,
        };
        let out = vec![7u64; P2P];
        let mut got = vec![0u64; P2P];
        // Non-blocking both ways, then blocking both ways.
        let recv = unsafe {
            comm.submit(Call::recv(got.as_mut_ptr().cast(), d, peer as i64, 2).unwrap())
                .unwrap()
        };
        let send = unsafe {
            comm.submit(send_call(&out, d, peer, comm.rank(), 2))
                .unwrap()
        };
        recv.wait().unwrap();
        send.wait().unwrap();
        assert!(got.iter().all(|v| *v == 7));
        got.fill(0);
        comm.send(&out, peer).unwrap();
        comm.recv(&mut got, peer).unwrap();
        assert!(got.iter().all(|v| *v == 7));
    });
    for r in 0..2 {
        let text = std::fs::read_to_string(dir.join(format!("trace-{r}.json"))).unwrap();
        assert!(text.starts_with("{\"traceEvents\":["), "{text}");
        assert!(
            text.contains("\"name\":\"allreduce\"") && text.contains("\"bytes\":800"),
            "{text}"
        );
        assert!(
            text.contains("\"name\":\"barrier\"") && text.contains(&format!("\"pid\":{r}")),
            "{text}"
        );
        // Each point-to-point call once, with its bytes.
        for name in ["send", "recv"] {
            let event = format!("\"name\":\"{name}\"");
            let bytes = format!("\"bytes\":{},", P2P * 8);
            let lines: Vec<&str> = text.lines().filter(|l| l.contains(&event)).collect();
            assert!(
                lines.len() == 2 && lines.iter().all(|l| l.contains(&bytes)),
                "want two {name}s of {} bytes traced: {text}",
                P2P * 8
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// MPI's usual exchange: post the receive, send (blocking), wait for the
/// receive; and the mirror image. On every rank at once, so each blocking
/// call needs the peers' non-blocking one to be under way.
#[test]
fn a_blocking_send_or_receive_starts_the_held_ones_with_it() {
    common::world(3, common::opts(10_000), LIMIT, |comm| {
        let (r, n) = (comm.rank(), comm.size());
        let (left, right) = ((r + n - 1) % n, (r + 1) % n);
        let d = |c| Data {
            count: c,
            dtype: DType::Uint64,
        };
        let send_to = |buf: &[u64], to: usize| send_call(buf, d(buf.len()), to, r, n);
        for (round, len) in [1usize, 300_000].into_iter().enumerate() {
            let tag = (round * 1000 + r) as u64;
            let out = vec![tag; len];
            // irecv from the left; send right (blocking); wait.
            let mut got = vec![0u64; len];
            let recv = unsafe {
                comm.submit(Call::recv(got.as_mut_ptr().cast(), d(len), left as i64, n).unwrap())
                    .unwrap()
            };
            comm.send(&out, right).unwrap();
            recv.wait().unwrap();
            assert!(got.iter().all(|v| *v == (round * 1000 + left) as u64));
            // isend left; receive from the right (blocking); wait.
            let mut got = vec![0u64; len];
            let send = unsafe { comm.submit(send_to(&out, left)) }.unwrap();
            comm.recv(&mut got, right).unwrap();
            send.wait().unwrap();
            assert!(got.iter().all(|v| *v == (round * 1000 + right) as u64));
        }
    });
}

#[test]
fn irecv_before_isend_on_every_rank_does_not_deadlock() {
    common::world(3, common::opts(10_000), LIMIT, |comm| {
        let (r, n) = (comm.rank(), comm.size());
        let out = vec![r as u64 * 100; 300_000];
        let mut from_left = vec![0u64; 300_000];
        let d = |c| Data {
            count: c,
            dtype: DType::Uint64,
        };
        let (left, right) = ((r + n - 1) % n, (r + 1) % n);
        let recv = unsafe {
            comm.submit(
                Call::recv(from_left.as_mut_ptr().cast(), d(300_000), left as i64, n).unwrap(),
            )
            .unwrap()
        };
        let send = unsafe {
            comm.submit(send_call(&out, d(300_000), right, r, n))
                .unwrap()
        };
        while recv.test().is_none() {
            std::thread::yield_now();
        }
        recv.wait().unwrap();
        send.wait().unwrap();
        assert!(from_left.iter().all(|v| *v == left as u64 * 100));
    });
}

/// A plain send of `data` from `buf` to rank `peer`, by rank `rank` of `size`.
fn send_call<T>(buf: &[T], data: Data, peer: usize, rank: usize, size: usize) -> Call {
    Call::new(
        OpKind::Send,
        buf.as_ptr().cast(),
        std::ptr::null_mut(),
        data,
        ReduceOp::Sum,
        peer as i64,
        rank,
        size,
    )
    .unwrap()
}
