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

/// `n` ranks of a C communicator (threads of this process), each running
/// `body(comm, rank)`; the communicators are destroyed after.
fn c_world<R: Send + 'static>(
    n: usize,
    body: impl Fn(*mut rdist_comm_t, usize) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let mut id = rdist_unique_id_t {
        internal: [0; RDIST_UNIQUE_ID_BYTES],
    };
    assert_eq!(rdist_get_unique_id(&mut id), rdist_result_t::RDIST_SUCCESS);
    let body = std::sync::Arc::new(body);
    let ranks: Vec<_> = (0..n)
        .map(|rank| {
            let body = body.clone();
            std::thread::spawn(move || {
                let mut opts = std::ptr::null_mut();
                assert_eq!(
                    rdist_options_create(&mut opts),
                    rdist_result_t::RDIST_SUCCESS
                );
                rdist_options_set(opts, c"timeout_ms".as_ptr(), c"20000".as_ptr());
                let mut comm = std::ptr::null_mut();
                let rc = rdist_comm_init_rank(&mut comm, n as i32, id, rank as i32, opts);
                assert_eq!(rc, rdist_result_t::RDIST_SUCCESS, "{}", last_error());
                rdist_options_destroy(opts);
                let out = body(comm, rank);
                assert_eq!(rdist_comm_destroy(comm), rdist_result_t::RDIST_SUCCESS);
                out
            })
        })
        .collect();
    ranks.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Found by a review of the C boundary: each of these panicked, wrote
/// memory before refusing, or took a bad value, and now returns a precise
/// error.
#[test]
fn uneven_layouts_options_and_handles_are_refused_before_anything_moves() {
    c_world(2, move |comm, rank| {
        let null = std::ptr::null_mut::<c_void>();
        // alltoallv whose own block's counts differ: was a panic (INTERNAL).
        let send = [rank as f32; 8];
        let mut recv = [-1.0f32; 8];
        let (sc, sd, rc, rd) = ([2usize, 2], [0usize, 2], [3usize, 2], [0usize, 3]);
        let sc = if rank == 0 { sc } else { [2, 3] };
        let rc = if rank == 0 { rc } else { [2, 2] };
        let code = rdist_alltoallv(
            send.as_ptr().cast(),
            sc.as_ptr(),
            sd.as_ptr(),
            recv.as_mut_ptr().cast(),
            rc.as_ptr(),
            rd.as_ptr(),
            7,
            comm,
            null,
        );
        assert_eq!(code, rdist_result_t::RDIST_ERR_INVALID_ARGUMENT);
        let own = if rank == 0 {
            "sendcounts[0] = 2 differs from recvcounts[0] = 3"
        } else {
            "sendcounts[1] = 3 differs from recvcounts[1] = 2"
        };
        assert!(last_error().contains(own), "{}", last_error());
        assert_eq!(recv, [-1.0; 8], "a refused alltoallv wrote its output");
        // allgatherv with overlapping receive blocks: wrote this rank's
        // block into recvbuf before refusing.
        let mine = [10.0 + rank as f32, 20.0 + rank as f32];
        let mut out = [-1.0f32; 4];
        let code = rdist_allgatherv(
            mine.as_ptr().cast(),
            2,
            out.as_mut_ptr().cast(),
            [2usize, 2].as_ptr(),
            [0usize, 1].as_ptr(),
            7,
            comm,
            null,
        );
        assert_eq!(code, rdist_result_t::RDIST_ERR_INVALID_ARGUMENT);
        assert!(
            last_error().contains("recvcounts/displs: the receive block of rank 1"),
            "{}",
            last_error()
        );
        assert_eq!(out, [-1.0; 4], "a refused allgatherv wrote its output");
        // The communicator still works, and the ranks agree on the order.
        let mut v = [1.0f32; 2];
        let p = v.as_mut_ptr().cast();
        assert_eq!(
            rdist_allreduce(p, p, 2, 7, 0, comm, null),
            rdist_result_t::RDIST_SUCCESS
        );
        assert_eq!(v, [2.0; 2]);
        // A request passed as a communicator is named as one.
        let mut req = std::ptr::null_mut();
        assert_eq!(
            rdist_ibarrier(comm, &mut req),
            rdist_result_t::RDIST_SUCCESS
        );
        let mut r = 0;
        assert_eq!(
            rdist_comm_rank(req as *const rdist_comm_t, &mut r),
            rdist_result_t::RDIST_ERR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("comm is a request, not a communicator"),
            "{}",
            last_error()
        );
        assert_eq!(rdist_wait(req), rdist_result_t::RDIST_SUCCESS);
        rdist_request_free(req);
        assert!(
            rdist_comm_rank(req as *const rdist_comm_t, &mut r)
                == rdist_result_t::RDIST_ERR_INVALID_ARGUMENT
                && last_error().contains("comm is a request already passed to rdist_request_free"),
            "{}",
            last_error()
        );
        // An out-parameter is named as the C call names it.
        assert_eq!(
            rdist_comm_size(comm, std::ptr::null_mut()),
            rdist_result_t::RDIST_ERR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("size (an out-pointer) is NULL")
                && last_error().contains(&format!("rank {rank}")),
            "{}",
            last_error()
        );
    });
    // An algorithm that does not exist fails where it is set.
    let mut opts = std::ptr::null_mut();
    assert_eq!(
        rdist_options_create(&mut opts),
        rdist_result_t::RDIST_SUCCESS
    );
    assert_eq!(
        rdist_options_set(opts, c"algo".as_ptr(), c"bogus".as_ptr()),
        rdist_result_t::RDIST_ERR_INVALID_ARGUMENT
    );
    assert!(
        last_error().contains("unknown algorithm 'bogus'"),
        "{}",
        last_error()
    );
    assert_eq!(
        rdist_options_set(opts, c"algo".as_ptr(), c"tree".as_ptr()),
        rdist_result_t::RDIST_SUCCESS
    );
    rdist_options_destroy(opts);
}

/// A one-rank communicator, and a group opened with an allreduce of `v`
/// queued in it.
fn one_rank_with_an_allreduce_queued_in_a_group(v: &mut [f32; 2]) -> *mut rdist_comm_t {
    let mut id = rdist_unique_id_t {
        internal: [0; RDIST_UNIQUE_ID_BYTES],
    };
    assert_eq!(rdist_get_unique_id(&mut id), rdist_result_t::RDIST_SUCCESS);
    let mut comm = std::ptr::null_mut();
    assert_eq!(
        rdist_comm_init_rank(&mut comm, 1, id, 0, std::ptr::null()),
        rdist_result_t::RDIST_SUCCESS
    );
    let p = v.as_mut_ptr().cast();
    assert_eq!(rdist_group_start(), rdist_result_t::RDIST_SUCCESS);
    assert_eq!(
        rdist_allreduce(p, p, 2, 7, 0, comm, std::ptr::null_mut()),
        rdist_result_t::RDIST_SUCCESS
    );
    comm
}

/// A group whose communicator was destroyed before the group ended: its
/// calls ran on the closed communicator (a panic at 2 ranks, a success at
/// 1). Now refused, naming why.
#[test]
fn a_group_ending_after_its_communicator_was_destroyed_is_refused() {
    let mut v = [1.0f32; 2];
    let comm = one_rank_with_an_allreduce_queued_in_a_group(&mut v);
    assert_eq!(rdist_comm_destroy(comm), rdist_result_t::RDIST_SUCCESS);
    assert_eq!(rdist_group_end(), rdist_result_t::RDIST_ERR_INVALID_USAGE);
    assert!(
        last_error().contains("1 call(s) were queued in this group on a communicator that rdist_comm_destroy destroyed"),
        "{}",
        last_error()
    );
}

/// In a fork() child every call on the parent's communicator, and on its
/// requests, fails at once with InvalidUsage: queries returned success,
/// rdist_comm_backend deadlocked on a lock the parent's worker held, and
/// a wait on a request in flight hung past its timeout.
#[test]
fn a_forked_child_is_refused_every_call_through_the_c_abi() {
    let said = c_world(2, |comm, rank| {
        if rank == 1 {
            // Late, so that rank 0's call is in flight when it forks.
            std::thread::sleep(Duration::from_millis(1500));
            let mut v = [1.0f32; 4];
            let p = v.as_mut_ptr().cast();
            assert_eq!(
                rdist_allreduce(p, p, 4, 7, 0, comm, std::ptr::null_mut()),
                rdist_result_t::RDIST_SUCCESS
            );
            return String::new();
        }
        let mut v = [1.0f32; 4];
        let p = v.as_mut_ptr().cast();
        let mut req = std::ptr::null_mut();
        assert_eq!(
            rdist_iallreduce(p, p, 4, 7, 0, comm, &mut req),
            rdist_result_t::RDIST_SUCCESS
        );
        std::thread::sleep(Duration::from_millis(300));
        let mut fds = [0i32; 2];
        // SAFETY: a pipe for the child's verdict.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child calls rdist, writes to the pipe and _exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: a bound on the child, whatever hangs.
            unsafe { libc::alarm(10) };
            let mut x = 0;
            let mut be = rdist_backend_t::RDIST_BACKEND_AUTO;
            let mut status = rdist_status_t {
                source: 0,
                tag: 0,
                count: 0,
            };
            let calls: Vec<(&str, rdist_result_t)> = vec![
                ("rank", rdist_comm_rank(comm, &mut x)),
                ("size", rdist_comm_size(comm, &mut x)),
                ("local_rank", rdist_comm_local_rank(comm, &mut x)),
                ("backend", rdist_comm_backend(comm, &mut be)),
                (
                    "failed_ranks",
                    rdist_comm_failed_ranks(comm, std::ptr::null_mut(), 0, &mut x),
                ),
                ("test", rdist_test(req, &mut x)),
                ("status", rdist_request_status(req, &mut status)),
                ("wait", rdist_wait(req)),
                ("abort", rdist_comm_abort(comm)),
            ];
            let mut msg = String::new();
            for (what, rc) in calls {
                let e = last_error();
                if rc != rdist_result_t::RDIST_ERR_INVALID_USAGE || !e.contains("fork()") {
                    msg += &format!("{what}: {rc:?} {e}; ");
                }
            }
            rdist_request_free(req);
            rdist_comm_destroy(comm);
            if msg.is_empty() {
                msg = "refused".to_string();
            }
            // SAFETY: writing our own buffer to our pipe, then exiting.
            unsafe {
                libc::write(fds[1], msg.as_ptr().cast(), msg.len());
                libc::_exit(0);
            }
        }
        // SAFETY: closing our copy of the write end, reaping the child.
        let mut status = 0;
        unsafe {
            libc::close(fds[1]);
            libc::waitpid(pid, &mut status, 0);
        }
        let mut buf = [0u8; 4096];
        // SAFETY: reading into our buffer, then closing our read end.
        let n = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len()) };
        unsafe { libc::close(fds[0]) };
        let said = String::from_utf8_lossy(&buf[..n.max(0) as usize]).into_owned();
        // The parent's call completes as if nothing happened.
        assert_eq!(rdist_wait(req), rdist_result_t::RDIST_SUCCESS);
        rdist_request_free(req);
        assert_eq!(v, [2.0; 4]);
        format!("{said} (child status {status})")
    });
    assert!(
        said[0].starts_with("refused (child status 0)"),
        "the child: {}",
        said[0]
    );
}

/// A group opened before fork() and ended in the child runs nothing there
/// (its calls are the parent's) and says why; the parent's end runs them.
#[test]
fn a_group_opened_before_fork_is_refused_in_the_child() {
    let mut v = [1.0f32; 2];
    let comm = one_rank_with_an_allreduce_queued_in_a_group(&mut v);
    let mut fds = [0i32; 2];
    // SAFETY: a pipe for the child's verdict.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child calls rdist, writes to the pipe and _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: a bound on the child, whatever hangs.
        unsafe { libc::alarm(10) };
        let rc = rdist_group_end();
        let msg = format!("{rc:?} {}", last_error());
        // SAFETY: writing our own buffer to our pipe, then exiting.
        unsafe {
            libc::write(fds[1], msg.as_ptr().cast(), msg.len());
            libc::_exit(0);
        }
    }
    let mut status = 0;
    let mut buf = [0u8; 2048];
    // SAFETY: closing our write end, reaping the child, reading its verdict.
    let n = unsafe {
        libc::close(fds[1]);
        libc::waitpid(pid, &mut status, 0);
        let n = libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len());
        libc::close(fds[0]);
        n
    };
    let said = String::from_utf8_lossy(&buf[..n.max(0) as usize]).into_owned();
    assert_eq!(status, 0, "the child: {said}");
    assert!(
        said.starts_with("RDIST_ERR_INVALID_USAGE") && said.contains("fork()"),
        "the child: {said}"
    );
    assert_eq!(rdist_group_end(), rdist_result_t::RDIST_SUCCESS);
    assert_eq!(v, [1.0; 2]);
    assert_eq!(rdist_comm_destroy(comm), rdist_result_t::RDIST_SUCCESS);
}
