//! allgatherv and alltoallv on real ranks (threads with real sockets on
//! loopback) at 1..5 ranks, with uneven, zero and pseudo-random counts,
//! in place, non-blocking, and with counts that disagree between ranks;
//! results against references computed here.

mod common;

use rdist::internals::{Call, Layout, OpKind, Stream};
use rdist::{DType, ErrorKind};
use std::time::Duration;

/// Elements rank `from` sends rank `to` in round `round` (0 often).
fn count(from: usize, to: usize, round: usize) -> usize {
    let x = (from * 7 + to * 13 + round * 5) % 11;
    if x < 3 {
        0
    } else {
        x * (1 + round % 3) * 37
    }
}

fn value(from: usize, to: usize, i: usize) -> i64 {
    (from * 1_000_000 + to * 10_000 + i) as i64
}

#[test]
fn alltoallv_matches_the_reference_at_every_size() {
    for n in 1..=5usize {
        common::world(
            n,
            common::opts(30_000),
            Duration::from_secs(60),
            move |comm| {
                let r = comm.rank();
                for round in 0..4 {
                    let sc: Vec<usize> = (0..n).map(|j| count(r, j, round)).collect();
                    let rc: Vec<usize> = (0..n).map(|i| count(i, r, round)).collect();
                    let send: Vec<i64> = (0..n)
                        .flat_map(|j| (0..sc[j]).map(move |k| value(r, j, k)))
                        .collect();
                    let mut recv = vec![-1i64; rc.iter().sum()];
                    comm.alltoallv(&send, &sc, &mut recv, &rc).unwrap();
                    let want: Vec<i64> = (0..n)
                        .flat_map(|i| (0..rc[i]).map(move |k| value(i, r, k)))
                        .collect();
                    assert_eq!(recv, want, "rank {r}/{n} round {round}");
                }
            },
        );
    }
}

#[test]
fn allgatherv_matches_the_reference_in_and_out_of_place() {
    for n in 1..=5usize {
        common::world(
            n,
            common::opts(30_000),
            Duration::from_secs(60),
            move |comm| {
                let r = comm.rank();
                for round in 0..3 {
                    let counts: Vec<usize> = (0..n).map(|i| count(i, 0, round)).collect();
                    let mine: Vec<f32> = (0..counts[r]).map(|k| value(r, 0, k) as f32).collect();
                    let mut all = vec![0f32; counts.iter().sum()];
                    comm.allgatherv(&mine, &mut all, &counts).unwrap();
                    let want: Vec<f32> = (0..n)
                        .flat_map(|i| (0..counts[i]).map(move |k| value(i, 0, k) as f32))
                        .collect();
                    assert_eq!(all, want, "rank {r}/{n} round {round}");
                    // In place, through the C ABI: blocks in reverse rank order
                    // with gaps between them.
                    let displs: Vec<usize> = (0..n).map(|i| (n - 1 - i) * 2000 + i).collect();
                    let mut buf = vec![-1f32; n * 2000 + n];
                    for (k, v) in mine.iter().enumerate() {
                        buf[displs[r] + k] = *v;
                    }
                    let layout: Vec<usize> = counts.iter().chain(&displs).copied().collect();
                    // SAFETY: buf and layout outlive the blocking call.
                    unsafe {
                        let l = Layout::new(&layout);
                        let p = buf.as_mut_ptr() as *mut u8;
                        let own = p.add(displs[r] * 4);
                        let call = Call::uneven(
                            OpKind::AllGatherV,
                            own,
                            counts[r],
                            l,
                            p,
                            l,
                            DType::Float32,
                            r,
                        )
                        .unwrap();
                        comm.run_uneven(call, Stream::DEFAULT).unwrap();
                    }
                    for i in 0..n {
                        for k in 0..counts[i] {
                            assert_eq!(buf[displs[i] + k], value(i, 0, k) as f32);
                        }
                    }
                }
            },
        );
    }
}

#[test]
fn nonblocking_in_place_alltoallv_copies_its_arrays() {
    common::world(3, common::opts(30_000), Duration::from_secs(60), |comm| {
        let (r, n) = (comm.rank(), comm.size());
        // In place: each rank sends and receives 2 elements per peer.
        let counts = vec![2usize; n];
        let displs: Vec<usize> = (0..n).map(|i| 2 * i).collect();
        let mut buf: Vec<u32> = (0..2 * n).map(|k| (r * 100 + k) as u32).collect();
        let arrays: Box<[usize]> = counts.iter().chain(&displs).copied().collect();
        // SAFETY: the request keeps `arrays` (moved in; its heap block does
        // not move); buf outlives the wait.
        let req = unsafe {
            let l = Layout::new(&arrays);
            let p = buf.as_mut_ptr() as *mut u8;
            let call = Call::uneven(OpKind::AllToAllV, p, 0, l, p, l, DType::Uint32, r).unwrap();
            comm.submit_uneven(call, arrays).unwrap()
        };
        req.wait().unwrap();
        // Block i of the result is rank i's block r.
        let want: Vec<u32> = (0..n)
            .flat_map(|i| (0..2).map(move |k| (i * 100 + 2 * r + k) as u32))
            .collect();
        assert_eq!(buf, want);
    });
}

#[test]
fn counts_that_disagree_fail_both_ranks_naming_both() {
    let errors = common::world(2, common::opts(10_000), Duration::from_secs(60), |comm| {
        let r = comm.rank();
        // Rank 0 sends 3 to rank 1, which expects 4.
        let sc = if r == 0 { vec![1, 3] } else { vec![4, 1] };
        let rc = if r == 0 { vec![1, 4] } else { vec![4, 1] };
        let send = vec![1u8; sc.iter().sum()];
        let mut recv = vec![0u8; rc.iter().sum()];
        comm.alltoallv(&send, &sc, &mut recv, &rc).unwrap_err()
    });
    for (r, e) in errors.iter().enumerate() {
        assert_eq!(e.kind(), ErrorKind::Mismatch, "rank {r}: {e}");
        assert!(e.message().contains("alltoallv"), "rank {r}: {e}");
    }
    // Rank 0 sends 3 where rank 1 expects 4: both messages show it.
    for e in &errors {
        let m = e.message();
        assert!(
            m.contains("3 x uint8") || m.contains("3 the other way"),
            "{e}"
        );
    }
}

#[test]
fn bad_uneven_arguments_are_refused() {
    common::world(2, common::opts(5_000), Duration::from_secs(60), |comm| {
        let e = comm
            .alltoallv(&[1u8], &[1], &mut [0u8; 2], &[1, 1])
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        let mut buf = [0u8; 4];
        let layout = [1usize, usize::MAX, 0, 1];
        // SAFETY: nothing runs: the call is refused while being built.
        let e = unsafe {
            let l = Layout::new(&layout);
            let p = buf.as_mut_ptr();
            Call::uneven(OpKind::AllGatherV, p, 1, l, p, l, DType::Uint8, comm.rank()).unwrap_err()
        };
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.message().contains("overflows"), "{e}");
        comm.barrier().unwrap();
    });
}
