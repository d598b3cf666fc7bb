//! Every collective × dtype × op × world size 1..5 × count class, on real
//! sockets, against references computed here independently.

mod common;

use half::{bf16, f16};
use rdist::internals::OpKind;
use rdist::internals::{Call, Data};
use rdist::{Comm, DType, ReduceOp};
use std::time::Duration;

fn encode(dtype: DType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DType::Int8 => out.extend_from_slice(&(v as i8).to_le_bytes()),
            DType::Uint8 => out.extend_from_slice(&(v as u8).to_le_bytes()),
            DType::Int32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
            DType::Uint32 => out.extend_from_slice(&(v as u32).to_le_bytes()),
            DType::Int64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
            DType::Uint64 => out.extend_from_slice(&(v as u64).to_le_bytes()),
            DType::Float16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::Float32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::Float64 => out.extend_from_slice(&v.to_le_bytes()),
            DType::Bfloat16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
            DType::Int16 => out.extend_from_slice(&(v as i16).to_le_bytes()),
            DType::Uint16 => out.extend_from_slice(&(v as u16).to_le_bytes()),
            // Odd values are true; true is any nonzero byte, so use 7.
            DType::Bool => out.push(if (v as i64) % 2 == 1 { 7 } else { 0 }),
        }
    }
    out
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks(dtype.size())
        .map(|b| match dtype {
            DType::Int8 => b[0] as i8 as f64,
            DType::Uint8 => b[0] as f64,
            DType::Int32 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::Uint32 => u32::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::Int64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::Uint64 => u64::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::Float16 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
            DType::Float32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::Float64 => f64::from_le_bytes(b.try_into().unwrap()),
            DType::Bfloat16 => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
            DType::Int16 => i16::from_le_bytes([b[0], b[1]]) as f64,
            DType::Uint16 => u16::from_le_bytes([b[0], b[1]]) as f64,
            DType::Bool => b[0] as f64,
        })
        .collect()
}

/// Small integers, so every reduction order gives exact results in every
/// type (products stay <= 2^5, sums <= 25).
fn value(rank: usize, i: usize, op: ReduceOp, salt: usize) -> f64 {
    match op {
        ReduceOp::Prod => {
            if (rank + i + salt).is_multiple_of(3) {
                2.0
            } else {
                1.0
            }
        }
        _ => ((rank * 7 + i * 3 + salt) % 5 + 1) as f64,
    }
}

fn reference(n: usize, i: usize, op: ReduceOp, salt: usize, dtype: DType) -> f64 {
    let vals: Vec<f64> = (0..n).map(|r| value(r, i, op, salt)).collect();
    if dtype == DType::Bool {
        // Logic on the truth values (odd = true); results are 0 or 1.
        let t: Vec<bool> = vals.iter().map(|v| (*v as i64) % 2 == 1).collect();
        let r = match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::Bor => t.iter().any(|x| *x),
            ReduceOp::Prod | ReduceOp::Min | ReduceOp::Band => t.iter().all(|x| *x),
            ReduceOp::Bxor => t.iter().filter(|x| **x).count() % 2 == 1,
            ReduceOp::Avg => unreachable!("refused for bool"),
        };
        return f64::from(u8::from(r));
    }
    let ints = || vals.iter().map(|v| *v as i64);
    match op {
        ReduceOp::Band => ints().fold(-1, |a, b| a & b) as f64,
        ReduceOp::Bor => ints().fold(0, |a, b| a | b) as f64,
        ReduceOp::Bxor => ints().fold(0, |a, b| a ^ b) as f64,
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Prod => vals.iter().product(),
        ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
        ReduceOp::Avg => {
            let s: f64 = vals.iter().sum();
            if dtype.is_float() {
                s / n as f64
            } else {
                (s / n as f64).trunc()
            }
        }
    }
}

fn close(dtype: DType, got: f64, want: f64) -> bool {
    let tol = match dtype {
        DType::Float16 | DType::Bfloat16 => 1e-2,
        DType::Float32 => 1e-6,
        _ => 0.0,
    };
    (got - want).abs() <= tol * want.abs().max(1.0)
}

#[allow(clippy::too_many_arguments)]
fn run(
    comm: &Comm,
    kind: OpKind,
    send: *const u8,
    recv: *mut u8,
    count: usize,
    dtype: DType,
    op: ReduceOp,
    root: usize,
) {
    let call = Call::new(
        kind,
        send,
        recv,
        Data { count, dtype },
        op,
        root as i64,
        comm.rank(),
        comm.size(),
    )
    .unwrap_or_else(|e| panic!("building {kind:?}: {e}"));
    unsafe { comm.run(call) }
        .unwrap_or_else(|e| panic!("rank {}: {kind:?} {count} x {dtype} {op}: {e}", comm.rank()));
}

fn counts(n: usize) -> Vec<usize> {
    let mut c = vec![0, 1, n.saturating_sub(1), 7, 1003];
    c.dedup();
    c
}

fn check(what: &str, dtype: DType, got: &[u8], want: &[f64]) {
    let got = decode(dtype, got);
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            close(dtype, *g, *w),
            "{what}: element {i} is {g}, expected {w}"
        );
    }
}

fn reductions(comm: &Comm, large: usize) {
    let (r, n) = (comm.rank(), comm.size());
    let mut cs = counts(n);
    cs.push(large);
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            if op.check(dtype).is_err() {
                continue; // refused locally (tests/api.rs, reduce.rs)
            }
            for &count in &cs {
                let salt = count % 11;
                let mine: Vec<f64> = (0..count).map(|i| value(r, i, op, salt)).collect();
                let want: Vec<f64> = (0..count)
                    .map(|i| reference(n, i, op, salt, dtype))
                    .collect();
                let tag = format!("rank {r}/{n} {count} x {dtype} {op}");
                // allreduce, out of place and in place
                let send = encode(dtype, &mine);
                let mut recv = vec![0u8; send.len()];
                run(
                    comm,
                    OpKind::AllReduce,
                    send.as_ptr(),
                    recv.as_mut_ptr(),
                    count,
                    dtype,
                    op,
                    0,
                );
                check(&format!("allreduce {tag}"), dtype, &recv, &want);
                let mut buf = send.clone();
                run(
                    comm,
                    OpKind::AllReduce,
                    buf.as_ptr(),
                    buf.as_mut_ptr(),
                    count,
                    dtype,
                    op,
                    0,
                );
                check(&format!("allreduce in place {tag}"), dtype, &buf, &want);
                // reduce to a root that moves with the count
                let root = count % n;
                let mut recv = vec![0u8; send.len()];
                run(
                    comm,
                    OpKind::Reduce,
                    send.as_ptr(),
                    recv.as_mut_ptr(),
                    count,
                    dtype,
                    op,
                    root,
                );
                if r == root {
                    check(&format!("reduce root {root} {tag}"), dtype, &recv, &want);
                }
                // reduce_scatter: count per rank
                if count <= 1003 {
                    let all: Vec<f64> = (0..count * n).map(|i| value(r, i, op, salt)).collect();
                    let send = encode(dtype, &all);
                    let mut recv = vec![0u8; count * dtype.size()];
                    run(
                        comm,
                        OpKind::ReduceScatter,
                        send.as_ptr(),
                        recv.as_mut_ptr(),
                        count,
                        dtype,
                        op,
                        0,
                    );
                    let want: Vec<f64> = (r * count..(r + 1) * count)
                        .map(|i| reference(n, i, op, salt, dtype))
                        .collect();
                    check(&format!("reduce_scatter {tag}"), dtype, &recv, &want);
                }
            }
        }
    }
}

fn movement(comm: &Comm) {
    let (r, n) = (comm.rank(), comm.size());
    let dtype = DType::Float32;
    for dtype2 in [dtype, DType::Uint8, DType::Float64, DType::Bfloat16] {
        for count in counts(n).into_iter().chain([70_000]) {
            let es = dtype2.size();
            let own: Vec<f64> = (0..count).map(|i| ((r * 31 + i) % 100) as f64).collect();
            let own_b = encode(dtype2, &own);
            let block_of = |rank: usize| {
                encode(
                    dtype2,
                    &(0..count)
                        .map(|i| ((rank * 31 + i) % 100) as f64)
                        .collect::<Vec<_>>(),
                )
            };
            let all_b: Vec<u8> = (0..n).flat_map(block_of).collect();
            for root in [0, n - 1] {
                // broadcast (in place)
                let mut buf = if r == root {
                    own_b.clone()
                } else {
                    vec![0u8; count * es]
                };
                run(
                    comm,
                    OpKind::Broadcast,
                    buf.as_ptr(),
                    buf.as_mut_ptr(),
                    count,
                    dtype2,
                    ReduceOp::Sum,
                    root,
                );
                assert_eq!(
                    buf,
                    block_of(root),
                    "broadcast root {root} count {count} rank {r}"
                );
                // gather
                let mut recv = vec![0u8; if r == root { count * es * n } else { 0 }];
                let rp = if r == root {
                    recv.as_mut_ptr()
                } else {
                    std::ptr::null_mut()
                };
                run(
                    comm,
                    OpKind::Gather,
                    own_b.as_ptr(),
                    rp,
                    count,
                    dtype2,
                    ReduceOp::Sum,
                    root,
                );
                if r == root {
                    assert_eq!(recv, all_b, "gather root {root} count {count}");
                }
                // scatter: root sends block j = what rank j would own
                let mut recv = vec![0u8; count * es];
                let sp = if r == root {
                    all_b.as_ptr()
                } else {
                    std::ptr::null()
                };
                run(
                    comm,
                    OpKind::Scatter,
                    sp,
                    recv.as_mut_ptr(),
                    count,
                    dtype2,
                    ReduceOp::Sum,
                    root,
                );
                assert_eq!(recv, own_b, "scatter root {root} count {count} rank {r}");
            }
            // allgather, out of place and in place
            let mut recv = vec![0u8; count * es * n];
            run(
                comm,
                OpKind::AllGather,
                own_b.as_ptr(),
                recv.as_mut_ptr(),
                count,
                dtype2,
                ReduceOp::Sum,
                0,
            );
            assert_eq!(recv, all_b, "allgather count {count} rank {r}");
            let mut buf = vec![0u8; count * es * n];
            buf[r * count * es..(r + 1) * count * es].copy_from_slice(&own_b);
            let p = buf.as_mut_ptr();
            run(
                comm,
                OpKind::AllGather,
                unsafe { p.add(r * count * es) },
                p,
                count,
                dtype2,
                ReduceOp::Sum,
                0,
            );
            assert_eq!(buf, all_b, "allgather in place count {count} rank {r}");
            // alltoall: block j from rank r carries (r, j)
            let piece = |from: usize, to: usize| {
                encode(
                    dtype2,
                    &(0..count)
                        .map(|i| ((from * 10 + to + i) % 100) as f64)
                        .collect::<Vec<_>>(),
                )
            };
            let send: Vec<u8> = (0..n).flat_map(|j| piece(r, j)).collect();
            let want: Vec<u8> = (0..n).flat_map(|i| piece(i, r)).collect();
            let mut recv = vec![0u8; send.len()];
            run(
                comm,
                OpKind::AllToAll,
                send.as_ptr(),
                recv.as_mut_ptr(),
                count,
                dtype2,
                ReduceOp::Sum,
                0,
            );
            assert_eq!(recv, want, "alltoall count {count} rank {r}");
        }
    }
    comm.barrier().unwrap();
}

fn p2p(comm: &Comm) {
    let (r, n) = (comm.rank(), comm.size());
    // A ring shift with sendrecv, then a blocking pair exchange.
    let send: Vec<i64> = (0..1000).map(|i| (r * 1000 + i) as i64).collect();
    let mut recv = vec![0i64; 1000];
    comm.sendrecv(&send, (r + 1) % n, &mut recv, (r + n - 1) % n)
        .unwrap();
    let from = (r + n - 1) % n;
    assert_eq!(
        recv,
        (0..1000)
            .map(|i| (from * 1000 + i) as i64)
            .collect::<Vec<_>>()
    );
    if n >= 2 && r < 2 {
        let peer = 1 - r;
        let big = vec![r as u8; 3 << 20];
        let mut got = vec![9u8; 3 << 20];
        // Both send first: must not deadlock (the transport drains early data).
        comm.send(&big, peer).unwrap();
        comm.recv(&mut got, peer).unwrap();
        assert!(got.iter().all(|b| *b == peer as u8));
    }
    comm.barrier().unwrap();
}

fn every_collective(n: usize, algo: Option<&str>) {
    every_collective_over(n, algo, "auto");
}

fn every_collective_over(n: usize, algo: Option<&str>, transport: &str) {
    let mut o = common::opts(60_000);
    o.set("transport", transport).unwrap();
    if let Some(a) = algo {
        o.set("algo", a).unwrap();
    }
    common::world(n, o, Duration::from_secs(240), move |comm| {
        reductions(&comm, 70_000);
        movement(&comm);
        p2p(&comm);
    });
}

#[test]
fn world_of_1() {
    every_collective(1, None);
}

#[test]
fn world_of_2() {
    every_collective(2, None);
}

#[test]
fn world_of_3() {
    every_collective(3, None);
}

#[test]
fn world_of_4() {
    every_collective(4, None);
}

#[test]
fn world_of_5() {
    every_collective(5, None);
}

#[test]
fn every_allreduce_algorithm_forced() {
    for algo in ["ring", "recursive_doubling", "halving_doubling"] {
        for n in [3, 4, 6] {
            let mut o = common::opts(60_000);
            o.set("algo", algo).unwrap();
            common::world(n, o, Duration::from_secs(120), |comm| {
                reductions(&comm, 5000)
            });
        }
    }
}

/// Bruck's allgather (chosen for small ones) and the ring, forced at
/// every size, against the reference: worlds of powers of two and not.
#[test]
fn every_allgather_algorithm_forced() {
    for algo in ["ring", "bruck"] {
        for n in [3, 5, 8] {
            let mut o = common::opts(60_000);
            o.set("algo", algo).unwrap();
            common::world(n, o, Duration::from_secs(120), |comm| movement(&comm));
        }
    }
}

// Single-copy transfers (process_vm_readv), off by default: forced on from
// 4 KiB so that every collective's large payloads take that path.
#[test]
fn single_copy_world_of_2() {
    single_copy_world(2);
}

#[test]
fn single_copy_world_of_4() {
    single_copy_world(4);
}

fn single_copy_world(n: usize) {
    let mut o = common::opts(60_000);
    o.set("single_copy_min", "4096").unwrap();
    common::world(n, o, Duration::from_secs(240), move |comm| {
        reductions(&comm, 70_000);
        movement(&comm);
        p2p(&comm);
    });
}

// The cross-host path (TCP everywhere), as forced with RDIST_TRANSPORT=tcp.

#[test]
fn tcp_world_of_2() {
    every_collective_over(2, None, "tcp");
}

#[test]
fn tcp_world_of_3() {
    every_collective_over(3, None, "tcp");
}

#[test]
fn tcp_world_of_5() {
    every_collective_over(5, None, "tcp");
}

#[test]
fn large_broadcasts_pipeline_along_a_chain() {
    // (ranks, algo, transport, bytes): forced, and chosen by default (TCP,
    // 16 MiB and up) with more than 16 chunks, not a multiple of one.
    for (n, algo, transport, bytes) in [
        (3, "chain", "auto", 5 << 20),
        (4, "auto", "tcp", 16 << 20),
        (5, "chain", "tcp", 5 << 20),
    ] {
        let mut o = common::opts(60_000);
        o.set("algo", algo).unwrap();
        o.set("transport", transport).unwrap();
        common::world(n, o, Duration::from_secs(120), move |comm| {
            let len = bytes / 4 + 3;
            for root in [0, n - 1, 1] {
                let want: Vec<f32> = (0..len).map(|i| ((i * 7 + root) % 1000) as f32).collect();
                let mut buf = if comm.rank() == root {
                    want.clone()
                } else {
                    vec![0.0; len]
                };
                comm.broadcast(&mut buf, root).unwrap();
                assert!(buf == want, "rank {} root {root} n {n}", comm.rank());
            }
        });
    }
}

/// Large reduces run along a chain that ends at the root (forced on
/// shared memory and TCP; chosen by default over TCP from 4 MiB on the
/// reference machine), with more chunks than ranks, not a multiple of
/// one; every root position, sum and max on integral floats, avg on
/// integers: exact against the reference, and the send buffers untouched.
#[test]
fn large_reduces_pipeline_along_a_chain() {
    for (n, algo, transport, bytes) in [
        (3, "chain", "auto", 5 << 20),
        (4, "auto", "tcp", 16 << 20),
        (5, "chain", "tcp", 3 << 20),
    ] {
        let mut o = common::opts(60_000);
        o.set("algo", algo).unwrap();
        o.set("transport", transport).unwrap();
        common::world(n, o, Duration::from_secs(120), move |comm| {
            let r = comm.rank();
            let len = bytes / 4 + 3;
            for (root, op) in [
                (0, ReduceOp::Sum),
                (n - 1, ReduceOp::Max),
                (1, ReduceOp::Sum),
            ] {
                let value = |q: usize, i: usize| ((i * 7 + q * 13 + root) % 1000) as f32;
                let send: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
                let mut recv = vec![-1.0f32; if r == root { len } else { 0 }];
                comm.reduce(&send, &mut recv, op, root).unwrap();
                assert!(send.iter().enumerate().all(|(i, v)| *v == value(r, i)));
                if r == root {
                    for (i, got) in recv.iter().enumerate() {
                        let all = (0..n).map(|q| value(q, i));
                        let want = match op {
                            ReduceOp::Max => all.fold(f32::MIN, f32::max),
                            _ => all.sum(),
                        };
                        assert_eq!(*got, want, "n {n} {algo} root {root} {op:?} element {i}");
                    }
                }
            }
            let root = n / 2;
            let send: Vec<i32> = (0..len as i32).map(|i| i % 977 - 400 + r as i32).collect();
            let mut recv = vec![0i32; if r == root { len } else { 0 }];
            comm.reduce(&send, &mut recv, ReduceOp::Avg, root).unwrap();
            if r == root {
                for (i, got) in recv.iter().enumerate() {
                    let sum: i64 = (0..n as i64).map(|q| (i as i64 % 977) - 400 + q).sum();
                    let want = (sum / n as i64) as i32;
                    assert_eq!(*got, want, "n {n} {algo} avg element {i}");
                }
            }
        });
    }
}

/// Large allreduces over TCP with 4 ranks go by halving-doubling by default,
/// as forced elsewhere on other world sizes: the sum is checked against
/// the reference, and every rank must hold the very same bits as rank 0
/// (each block is reduced once, by its owner, and then copied).
#[test]
fn large_allreduces_over_tcp_take_halving_doubling() {
    for (n, algo) in [(4, "auto"), (4, "ring"), (5, "halving_doubling")] {
        let mut o = common::opts(60_000);
        o.set("transport", "tcp").unwrap();
        o.set("algo", algo).unwrap();
        common::world(n, o, Duration::from_secs(120), move |comm| {
            let r = comm.rank();
            let len = (1 << 20) + 3; // just over 4 MiB of float32, uneven blocks
            let mut exact: Vec<f32> = (0..len).map(|i| ((i * 3 + r) % 1024) as f32).collect();
            comm.allreduce(&mut exact, ReduceOp::Sum).unwrap();
            for (i, got) in exact.iter().enumerate() {
                let want: usize = (0..n).map(|q| (i * 3 + q) % 1024).sum();
                assert_eq!(*got, want as f32, "rank {r}/{n} {algo} element {i}");
            }
            let mut inexact: Vec<f32> = (0..len)
                .map(|i| 0.1 + (i as f32).sqrt() / (r as f32 + 3.0))
                .collect();
            comm.allreduce(&mut inexact, ReduceOp::Sum).unwrap();
            let mut first = inexact.clone();
            comm.broadcast(&mut first, 0).unwrap();
            let same = first
                .iter()
                .zip(&inexact)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "rank {r}/{n} {algo}: bits differ from rank 0's");
        });
    }
}

/// Small messages go as whole shared-memory records (a fast path) and the
/// rest through the general exchange; both read the same rings. Roots
/// rotate so senders run ahead and records pile up, sizes straddle the
/// fast path's limit (16 KiB), a rank lags now and then so waits fall
/// back to the general loop mid-stream, and every result is checked.
#[test]
fn small_and_large_messages_interleave_on_shared_memory() {
    let sizes = [8usize, 0, 1024, 16 << 10, (16 << 10) + 4, 40_000, 4];
    for n in [2, 3] {
        common::world(
            n,
            common::opts(30_000),
            Duration::from_secs(120),
            move |comm| {
                let rank = comm.rank();
                for it in 0..600usize {
                    let bytes = sizes[it % sizes.len()];
                    let root = it % n;
                    let fill = |i: usize| (it * 31 + i * 7 + root) as u8;
                    let mut buf: Vec<u8> = (0..bytes)
                        .map(|i| if rank == root { fill(i) } else { 0xEE })
                        .collect();
                    let p = buf.as_mut_ptr();
                    run(
                        &comm,
                        OpKind::Broadcast,
                        p,
                        p,
                        bytes,
                        DType::Uint8,
                        ReduceOp::Sum,
                        root,
                    );
                    let bad = (0..bytes).find(|&i| buf[i] != fill(i));
                    assert!(
                        bad.is_none(),
                        "rank {rank}: broadcast #{it} of {bytes} B wrong at {bad:?}"
                    );
                    if it % 5 == 0 {
                        let count = bytes / 4;
                        let mut v: Vec<u8> = (0..count)
                            .flat_map(|i| (((rank + 1) * (i + it) % 1000) as u32).to_le_bytes())
                            .collect();
                        let p = v.as_mut_ptr();
                        run(
                            &comm,
                            OpKind::AllReduce,
                            p,
                            p,
                            count,
                            DType::Uint32,
                            ReduceOp::Sum,
                            0,
                        );
                        for (i, w) in v.chunks(4).enumerate() {
                            let want: usize = (0..n).map(|r| (r + 1) * (i + it) % 1000).sum();
                            let got = u32::from_le_bytes(w.try_into().unwrap()) as usize;
                            assert_eq!(got, want, "rank {rank}: allreduce #{it} element {i}");
                        }
                    }
                    if rank == n - 1 && it % 97 == 0 {
                        std::thread::sleep(Duration::from_millis(3));
                    }
                }
            },
        );
    }
}

/// Over TCP, frames from 64 KiB carry padding chosen from where the payload
/// sits in memory (see `frame::pad_for`). Payloads start at every 8-byte
/// offset of a page here, so every padding length goes through posted
/// receives, receive-and-reduce, and frames that arrive before their
/// receive (both ranks send 3 MiB first); every byte is checked.
#[test]
fn tcp_payloads_at_every_alignment_arrive_intact() {
    let mut o = common::opts(60_000);
    o.set("transport", "tcp").unwrap();
    common::world(2, o, Duration::from_secs(120), move |comm| {
        let (r, peer) = (comm.rank(), 1 - comm.rank());
        let fill = |who: usize, it: usize, i: usize| ((who * 37 + it * 11 + i * 7) % 97) as u8;
        let mut src = vec![0u8; (3 << 20) + 8192];
        let mut dst = vec![0u8; (3 << 20) + 8192];
        for it in 0..520 {
            let off = (it * 8) % 4096;
            let into = (it * 24) % 4096;
            let len = if it % 173 == 5 {
                3 << 20
            } else {
                (64 << 10) + it * 3
            };
            for (i, b) in src[off..off + len].iter_mut().enumerate() {
                *b = fill(r, it, i);
            }
            let got = &mut dst[into..into + len];
            got.fill(0xEE);
            if len > 1 << 20 {
                // Larger than the socket buffers: each rank's send drains the
                // other's frame into the inbox while it writes.
                comm.send(&src[off..off + len], peer).unwrap();
                comm.recv(got, peer).unwrap();
            } else {
                comm.sendrecv(&src[off..off + len], peer, got, peer)
                    .unwrap();
            }
            let bad = (0..len).find(|&i| got[i] != fill(peer, it, i));
            assert!(
                bad.is_none(),
                "rank {r}: message {it} ({len} B at +{off}) wrong at {bad:?}"
            );
            // Each rank sends half of it and reduces the other half.
            let sum = &mut src[off..off + 2 * (64 << 10) + it];
            for (i, b) in sum.iter_mut().enumerate() {
                *b = fill(r, it, i);
            }
            comm.allreduce(sum, ReduceOp::Sum).unwrap();
            let bad = (0..sum.len()).find(|&i| sum[i] != fill(0, it, i) + fill(1, it, i));
            assert!(
                bad.is_none(),
                "rank {r}: allreduce {it} at +{off} wrong at {bad:?}"
            );
        }
    });
}
