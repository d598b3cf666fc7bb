//! Point-to-point in its own context, as in MPI: tags, wildcards, sends
//! that move when posted, receives posted before a collective and matched
//! after it, and the errors that name what is pending. Real ranks (threads
//! with real sockets on loopback), through the C ABI where requests are
//! involved.

mod common;

use rdist::internals::{Data, RawBuf};
use rdist::{Comm, DType, ErrorKind, Request};
use std::time::{Duration, Instant};

fn irecv(
    comm: &Comm,
    buf: &mut [u8],
    dtype: DType,
    peer: Option<usize>,
    tag: Option<i32>,
) -> Request {
    let count = buf.len() / dtype.size();
    // SAFETY: every test waits for the request before its buffer goes.
    unsafe {
        comm.irecv_message(
            RawBuf::new(buf.as_mut_ptr(), buf.len()),
            Data { count, dtype },
            peer,
            tag,
        )
    }
    .unwrap()
}

fn isend(comm: &Comm, buf: &[u8], dtype: DType, peer: usize, tag: i32) -> Request {
    let count = buf.len() / dtype.size();
    // SAFETY: every test waits for the request before its buffer goes.
    unsafe { comm.isend_message(RawBuf::of(buf), Data { count, dtype }, peer, tag) }.unwrap()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn a_receive_posted_before_a_collective_matches_a_send_made_after_it() {
    // irecv; allreduce; send; wait on every rank at once (legal in MPI):
    // the receive and the send are in their own context.
    // Shared memory (large payloads single-copy) and TCP (eager and
    // rendezvous over the socket).
    // And shared memory with single copy from 64 KiB (the receiver reads
    // the sender's buffer: Remote frames).
    for (n, transport, single_copy) in [
        (2usize, "auto", None),
        (3, "auto", None),
        (4, "auto", None),
        (3, "tcp", None),
        (3, "auto", Some("65536")),
    ] {
        let mut o = common::opts(20_000);
        o.set("transport", transport).unwrap();
        if let Some(min) = single_copy {
            o.set("single_copy_min", min).unwrap();
        }
        common::world(n, o, Duration::from_secs(60), move |comm| {
            let r = comm.rank();
            let (right, left) = ((r + 1) % n, (r + n - 1) % n);
            for round in 0..4usize {
                // Small (eager), 1 MiB (single copy on one host, else
                // eager) and large (rendezvous, > 64 MiB) messages.
                let elems = match round {
                    2 => (65 << 20) / 4 + 3,
                    3 => (1 << 20) / 4 + 1,
                    _ => 1000 + round,
                };
                let mut got = vec![0u8; elems * 4];
                let req = irecv(&comm, &mut got, DType::Float32, Some(left), Some(7));
                let mut x = [r as f32 + 1.0; 4];
                comm.allreduce(&mut x, rdist::ReduceOp::Sum).unwrap();
                assert_eq!(x[0], (n * (n + 1) / 2) as f32);
                let mine: Vec<f32> = (0..elems)
                    .map(|i| (r * 1_000_000 + i + round) as f32)
                    .collect();
                comm.send_tagged(&mine, right, 7).unwrap();
                let s = req.wait_status().unwrap().unwrap();
                assert_eq!((s.source, s.tag, s.count), (left, 7, elems));
                assert_eq!(req.status(), Some(s));
                let want: Vec<f32> = (0..elems)
                    .map(|i| (left * 1_000_000 + i + round) as f32)
                    .collect();
                assert!(
                    got == f32_bytes(&want),
                    "rank {r} round {round}: wrong payload"
                );
            }
            comm.barrier().unwrap();
        });
    }
}

#[test]
fn a_nonblocking_send_moves_data_before_it_is_waited_on() {
    // Rank 0 posts isend and computes for 1.5 s before waiting; rank 1's
    // blocking receive must not wait for that (it did before: 2.0 s).
    for elems in [256usize << 10, (80 << 20) / 4] {
        let times = common::world(
            2,
            common::opts(20_000),
            Duration::from_secs(60),
            move |comm| {
                if comm.rank() == 0 {
                    let data: Vec<f32> = (0..elems).map(|i| i as f32).collect();
                    let bytes = f32_bytes(&data);
                    comm.barrier().unwrap();
                    let req = isend(&comm, &bytes, DType::Float32, 1, 3);
                    std::thread::sleep(Duration::from_millis(1500));
                    req.wait().unwrap();
                    Duration::ZERO
                } else {
                    let mut got = vec![0f32; elems];
                    comm.barrier().unwrap();
                    let t = Instant::now();
                    let s = comm.recv_tagged(&mut got, Some(0), Some(3)).unwrap();
                    let took = t.elapsed();
                    assert_eq!(s.count, elems);
                    assert!(got.iter().enumerate().all(|(i, v)| *v == i as f32));
                    took
                }
            },
        );
        assert!(
            times[1] < Duration::from_millis(1000),
            "{elems} floats: the receiver waited {:?} for a send posted at once",
            times[1]
        );
    }
}

#[test]
fn tags_and_wildcards_match_as_in_mpi() {
    common::world(3, common::opts(20_000), Duration::from_secs(60), |comm| {
        let r = comm.rank();
        if r > 0 {
            // Each sender: tags 1, 2, 3, then tag 1 again (order within a tag kept).
            for (k, tag) in [1, 2, 3, 1].into_iter().enumerate() {
                let v = [(r * 100 + k) as i32; 3];
                comm.send_tagged(&v, 0, tag).unwrap();
            }
        } else {
            let mut buf = [0i32; 8];
            // Tag 3 from rank 2 first, although tags 1 and 2 came before it.
            let s = comm.recv_tagged(&mut buf, Some(2), Some(3)).unwrap();
            assert_eq!((s.source, s.tag, s.count, buf[0]), (2, 3, 3, 202));
            // Tag 1 from anyone, twice from rank 1 in order: first k=0, then k=3.
            let s = comm.recv_tagged(&mut buf, Some(1), Some(1)).unwrap();
            assert_eq!((s.source, buf[0]), (1, 100));
            let s = comm.recv_tagged(&mut buf, Some(1), Some(1)).unwrap();
            assert_eq!((s.source, buf[0]), (1, 103));
            // Any source, any tag: the other five, each exactly once, and
            // rank 2's two tag-1 messages in the order they were sent.
            let mut seen = Vec::new();
            for _ in 0..5 {
                let s = comm.recv_tagged(&mut buf, None, None).unwrap();
                assert_eq!(s.count, 3);
                seen.push((s.source, s.tag, buf[0]));
            }
            let twos: Vec<i32> = seen
                .iter()
                .filter(|x| x.0 == 2 && x.1 == 1)
                .map(|x| x.2)
                .collect();
            assert_eq!(twos, vec![200, 203]);
            seen.sort();
            assert_eq!(
                seen,
                vec![
                    (1, 2, 101),
                    (1, 3, 102),
                    (2, 1, 200),
                    (2, 1, 203),
                    (2, 2, 201)
                ]
            );
        }
        comm.barrier().unwrap();
    });
}

#[test]
fn a_message_that_does_not_fit_fails_its_receive_and_is_consumed() {
    common::world(2, common::opts(20_000), Duration::from_secs(60), |comm| {
        if comm.rank() == 0 {
            comm.send_tagged(&[1i32, 2, 3, 4], 1, 0).unwrap(); // too long
            comm.send_tagged(&[5i32, 6], 1, 0).unwrap(); // shorter: fits
            comm.send_tagged(&[7.0f32], 1, 0).unwrap(); // other dtype
            comm.send_tagged(&[8i32], 1, 0).unwrap();
        } else {
            let mut buf = [0i32; 3];
            let e = comm.recv_tagged(&mut buf, Some(0), Some(0)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            assert!(
                e.message().contains("4 elements") && e.message().contains("room for 3"),
                "{e}"
            );
            let s = comm.recv_tagged(&mut buf, Some(0), Some(0)).unwrap();
            assert_eq!((s.count, &buf[..2]), (2, &[5, 6][..]));
            let e = comm.recv_tagged(&mut buf, Some(0), Some(0)).unwrap_err();
            assert!(
                e.message().contains("float32") && e.message().contains("int32"),
                "{e}"
            );
            let s = comm.recv_tagged(&mut buf, Some(0), Some(0)).unwrap();
            assert_eq!((s.count, buf[0]), (1, 8));
        }
        comm.barrier().unwrap();
    });
}

#[test]
fn an_exact_receive_takes_only_its_own_message_whatever_its_bytes() {
    // The plain receive (tag 0, this count and dtype) takes a message
    // straight off shared memory when its header is the one it expects:
    // as many bytes of another dtype, or one with another tag, are not
    // its own.
    common::world(2, common::opts(20_000), Duration::from_secs(60), |comm| {
        if comm.rank() == 0 {
            comm.send(&[3i32, 4], 1).unwrap();
            comm.send(&[9u8; 8], 1).unwrap();
            comm.send(&[5i32, 6], 1).unwrap();
            comm.send(&[7i64], 1).unwrap();
            comm.send_tagged(&[1i32, 2], 1, 5).unwrap();
            comm.send(&[10i32, 11], 1).unwrap();
        } else {
            let mut buf = [0i32; 2];
            comm.recv(&mut buf, 0).unwrap();
            assert_eq!(buf, [3, 4]);
            let e = comm.recv(&mut buf, 0).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            let mut got = [0u8; 8];
            let exact = |got: &mut [u8; 8]| {
                let data = Data {
                    count: 2,
                    dtype: DType::Int32,
                };
                // SAFETY: waited for before `got` goes.
                unsafe { comm.irecv_exact(RawBuf::new(got.as_mut_ptr(), 8), data, 0) }
                    .unwrap()
                    .wait()
            };
            exact(&mut got).unwrap();
            assert_eq!(got, [5, 0, 0, 0, 6, 0, 0, 0]);
            let e = exact(&mut got).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            comm.recv(&mut buf, 0).unwrap();
            assert_eq!(
                buf,
                [10, 11],
                "the tag-5 message is not the plain receive's"
            );
            let s = comm.recv_tagged(&mut buf, Some(0), Some(5)).unwrap();
            assert_eq!((s.count, buf), (2, [1, 2]));
        }
        comm.barrier().unwrap();
    });
}

#[test]
fn a_deadlock_across_the_two_contexts_names_both_pending_calls() {
    let errors = common::world(2, common::opts(1500), Duration::from_secs(60), |comm| {
        if comm.rank() == 0 {
            // Waits for a message with tag 5 that never comes, then a collective.
            let mut got = vec![0u8; 16];
            let req = irecv(&comm, &mut got, DType::Int32, Some(1), Some(5));
            let mut x = [1.0f32];
            let e = comm.allreduce(&mut x, rdist::ReduceOp::Sum).unwrap_err();
            let w = req.wait().is_ok();
            (e.to_string(), w)
        } else {
            // Sends tag 6 (not 5), then waits for a message rank 0 never sends.
            comm.send_tagged(&[1i32, 2, 3, 4], 0, 6).unwrap();
            let mut buf = [0i32; 4];
            let e = comm.recv_tagged(&mut buf, Some(0), None).unwrap_err();
            // Stay until rank 0's collective has timed out too (leaving
            // would make it fail for that reason instead).
            std::thread::sleep(Duration::from_millis(2500));
            (e.to_string(), false)
        }
    });
    let (e0, w0) = &errors[0];
    assert!(e0.contains("allreduce"), "{e0}");
    assert!(
        e0.contains("recv from rank 1 (tag 5"),
        "rank 0 names its pending receive: {e0}"
    );
    assert!(!*w0, "the receive never matched");
    // Rank 1's receive ends at its own timeout, or a moment earlier with
    // rank 0's failure report (their connection carries both contexts):
    // either way it names the call and why.
    let (e1, _) = &errors[1];
    assert!(
        e1.contains("recv from rank 0 (any tag")
            && (e1.contains("did not complete") || e1.contains("rank 0 failed: rank 0 timed out")),
        "{e1}"
    );
}

#[test]
fn a_receive_from_a_rank_that_left_fails_at_once() {
    let t = common::world(2, common::opts(30_000), Duration::from_secs(60), |comm| {
        comm.barrier().unwrap();
        if comm.rank() == 1 {
            drop(comm);
            return Duration::ZERO;
        }
        let t = Instant::now();
        let mut buf = [0u8; 4];
        let e = comm.recv_tagged(&mut buf, Some(1), Some(0)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerLost, "{e}");
        assert!(e.message().contains("rank 1"), "{e}");
        t.elapsed()
    });
    assert!(t[0] < Duration::from_secs(5), "noticed after {:?}", t[0]);
}

#[test]
fn a_nonblocking_receive_from_a_rank_that_left_fails_at_its_wait_and_after() {
    // Posted once its peer is known to have left: the wait fails at once,
    // naming the rank, and so does every later wait (the request's free
    // waits too).
    let t = common::world(2, common::opts(30_000), Duration::from_secs(90), |comm| {
        comm.barrier().unwrap();
        if comm.rank() == 1 {
            drop(comm);
            return [Duration::ZERO; 2];
        }
        // A blocking receive finds the rank gone first.
        let mut first = [0i32; 1];
        let e = comm.recv_tagged(&mut first, Some(1), Some(0)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerLost, "{e}");
        let mut buf = [0u8; 4];
        let r = irecv(&comm, &mut buf, DType::Int32, Some(1), Some(0));
        let mut took = [Duration::ZERO; 2];
        for t in took.iter_mut() {
            let at = Instant::now();
            let e = r.wait().unwrap_err();
            *t = at.elapsed();
            assert_eq!(e.kind(), ErrorKind::PeerLost, "{e}");
            assert!(e.message().contains("rank 1"), "{e}");
        }
        took
    });
    assert!(
        t[0][0] < Duration::from_secs(5) && t[0][1] < Duration::from_secs(1),
        "the waits took {:?}",
        t[0]
    );
}

#[test]
fn bad_tagged_arguments_are_refused_precisely() {
    common::world(2, common::opts(5_000), Duration::from_secs(60), |comm| {
        let mut buf = [0u8; 4];
        let data = Data {
            count: 4,
            dtype: DType::Uint8,
        };
        let raw = RawBuf::new(buf.as_mut_ptr(), 4);
        // SAFETY: nothing is posted by these calls, which fail.
        unsafe {
            let e = comm.isend_message(raw, data, 1, -3).err().unwrap();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            assert!(e.message().contains("tag -3"), "{e}");
            let e = comm
                .irecv_message(raw, data, Some(0), Some(-2))
                .err()
                .unwrap();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        }
        let e = comm.send_tagged(&[1u8], 2, 0).unwrap_err();
        assert!(e.message().contains("peer 2"), "{e}");
        // A request with no status (a collective), and one still in flight.
        let mut x = [0u8; 1];
        let peer = 1 - comm.rank();
        let rq = irecv(&comm, &mut buf, DType::Uint8, None, None);
        // In flight: the peer sends only after the allreduce below.
        assert_eq!(rq.status(), None);
        x[0] = 1;
        comm.allreduce(&mut x, rdist::ReduceOp::Sum).unwrap();
        assert_eq!(x[0], 2);
        comm.send_tagged(&[comm.rank() as u8 + 10], peer, 9)
            .unwrap();
        let s = rq.wait_status().unwrap().unwrap();
        assert_eq!(
            (s.source, s.tag, s.count, buf[0]),
            (peer, 9, 1, peer as u8 + 10)
        );
    });
}

#[test]
fn tagged_calls_in_a_group_complete_when_it_ends() {
    common::world(2, common::opts(10_000), Duration::from_secs(60), |comm| {
        let peer = 1 - comm.rank();
        let mine: Vec<u8> = vec![comm.rank() as u8 + 1; 100_000];
        let mut got = vec![0u8; 100_000];
        let d = Data {
            count: mine.len(),
            dtype: DType::Uint8,
        };
        rdist::internals::group::start();
        // SAFETY: both buffers outlive the group, which ends below.
        unsafe {
            comm.recv_message(
                RawBuf::new(got.as_mut_ptr(), got.len()),
                d,
                Some(peer),
                Some(4),
                rdist::internals::Stream::DEFAULT,
            )
            .unwrap();
            comm.send_message(
                RawBuf::of(&mine),
                d,
                peer,
                4,
                rdist::internals::Stream::DEFAULT,
            )
            .unwrap();
            rdist::internals::group::end().unwrap();
        }
        assert!(got.iter().all(|b| *b == peer as u8 + 1));
    });
}

#[test]
fn messages_sent_before_a_rank_left_are_still_received() {
    // Rank 0 sends (eager, and single-copy-sized) and destroys its
    // communicator at once; rank 1 receives later and must get both, then
    // hear that rank 0 is gone.
    common::world(2, common::opts(10_000), Duration::from_secs(60), |comm| {
        comm.barrier().unwrap();
        if comm.rank() == 0 {
            comm.send_tagged(&[7u32; 10], 1, 1).unwrap();
            drop(comm);
            return;
        }
        std::thread::sleep(Duration::from_millis(300));
        let mut small = [0u32; 10];
        let s = comm.recv_tagged(&mut small, Some(0), Some(1)).unwrap();
        assert_eq!((s.count, small), (10, [7u32; 10]));
        let e = comm.recv_tagged(&mut small, Some(0), None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerLost, "{e}");
    });
}

#[test]
fn tagged_messages_of_every_size_arrive_whole_on_every_path() {
    // Eager over the rings (whole records and streamed), single copy from
    // the sender's memory (and its deferred form: the receive posted
    // after the message came), eager over TCP; both ranks sending first
    // (a receive posted late) and in turn.
    let sizes = [
        0usize,
        1,
        100,
        65_495,
        65_537,
        131_072,
        (1 << 20) + 3,
        5 << 20,
    ];
    for (transport, single_copy) in [
        ("auto", "auto"),
        ("auto", "off"),
        ("auto", "1"),
        ("tcp", "auto"),
    ] {
        let mut o = common::opts(20_000);
        o.set("transport", transport).unwrap();
        o.set("single_copy_min", single_copy).unwrap();
        common::world(2, o, Duration::from_secs(120), move |comm| {
            let (me, peer) = (comm.rank(), 1 - comm.rank());
            for (k, &n) in sizes.iter().enumerate() {
                let mine: Vec<u8> = (0..n).map(|i| (i * 7 + me * 31 + k) as u8).collect();
                let want: Vec<u8> = (0..n).map(|i| (i * 7 + peer * 31 + k) as u8).collect();
                let mut got = vec![0u8; n];
                // Both send first: the peer's message comes before its receive.
                let s = isend(&comm, &mine, DType::Uint8, peer, k as i32);
                std::thread::sleep(Duration::from_millis(2));
                let st = comm
                    .recv_tagged(&mut got, Some(peer), Some(k as i32))
                    .unwrap();
                s.wait().unwrap();
                assert_eq!(
                    (st.source, st.count),
                    (peer, n),
                    "{transport}/{single_copy} {n} B"
                );
                assert!(
                    got == want,
                    "{transport}/{single_copy}: {n} B arrived wrong (send first)"
                );
                // In turn: rank 0 sends, rank 1 receives, and back.
                got.fill(0);
                if me == 0 {
                    comm.send_tagged(&mine, peer, 1000).unwrap();
                    comm.recv_tagged(&mut got, Some(peer), Some(1000)).unwrap();
                } else {
                    comm.recv_tagged(&mut got, Some(peer), Some(1000)).unwrap();
                    comm.send_tagged(&mine, peer, 1000).unwrap();
                }
                assert!(
                    got == want,
                    "{transport}/{single_copy}: {n} B arrived wrong (in turn)"
                );
            }
            comm.barrier().unwrap();
        });
    }
}

#[test]
fn a_receive_posted_after_its_single_copy_message_came_copies_it_later_not_in_the_post() {
    // irecv; isend; wait, as exchanges go: when the message already waits
    // in its sender's memory, the receive must not copy it in irecv (the
    // caller's isend would wait behind the copy, and the two sides of an
    // exchange would copy in turn instead of at once) but at its wait, or
    // on the endpoint's thread meanwhile. 128 MiB copies for tens of
    // milliseconds; posting a receive takes microseconds.
    // A receive posted more than 200 us after its message came finds it
    // copied out of the sender's memory already (its sender released, see
    // `REMOTE_PATIENCE`), and copies it from there: on a loaded machine
    // that can happen to any one round, so the best of three counts.
    let mut o = common::opts(30_000);
    o.set("single_copy_min", "1").unwrap();
    let rounds = common::world(2, o, Duration::from_secs(120), |comm| {
        let n = 128 << 20;
        let mut rounds = Vec::new();
        for round in 0..3 {
            if comm.rank() == 0 {
                let mine: Vec<u8> = (0..n).map(|i| ((i + round) % 251) as u8).collect();
                let big = isend(&comm, &mine, DType::Uint8, 1, 5);
                comm.send_tagged(&[1u8], 1, 6).unwrap();
                big.wait().unwrap();
            } else {
                let mut got = vec![0u8; n];
                // Receiving the small message reads the large one's
                // descriptor, which came first, and keeps it (its sender's
                // buffer stays until the copy is done).
                let mut small = [0u8; 1];
                comm.recv_tagged(&mut small, Some(0), Some(6)).unwrap();
                let t = Instant::now();
                let r = irecv(&comm, &mut got, DType::Uint8, Some(0), Some(5));
                let posted = t.elapsed();
                r.wait().unwrap();
                rounds.push((posted, t.elapsed()));
                assert!(got
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == ((i + round) % 251) as u8));
            }
            comm.barrier().unwrap();
        }
        rounds
    });
    let rounds = &rounds[1];
    assert!(
        rounds.iter().any(|&(posted, all)| posted * 4 < all),
        "the receive was copied while it was posted (posting, all): {rounds:?}"
    );
}

#[test]
fn a_wait_moves_every_pending_call_not_only_its_own() {
    // A ring of three where each rank's blocking receive can only complete
    // once its earlier nonblocking send (large: it needs the receiver's
    // answer, then its payload written) moves on: 0 -> 1 -> 2 -> 0. The
    // waiting caller holds the progress, so its wait must move the send
    // too. With single copy, the receiver's answer (TagAck) to one peer
    // must go out while it waits on another.
    for single_copy in ["off", "1"] {
        let mut o = common::opts(10_000);
        o.set("single_copy_min", single_copy).unwrap();
        common::world(3, o, Duration::from_secs(60), move |comm| {
            let (me, n) = (comm.rank(), comm.size());
            let (to, from) = ((me + 1) % n, (me + n - 1) % n);
            let big = 3 << 20;
            let mine: Vec<u8> = (0..big).map(|i| (i * 13 + me) as u8).collect();
            let want: Vec<u8> = (0..big).map(|i| (i * 13 + from) as u8).collect();
            let mut got = vec![0u8; big];
            let s = isend(&comm, &mine, DType::Uint8, to, 7);
            // Let the envelope reach the receiver before its receive.
            std::thread::sleep(Duration::from_millis(20));
            comm.recv_tagged(&mut got, Some(from), Some(7)).unwrap();
            s.wait().unwrap();
            assert!(
                got == want,
                "{single_copy}: the ring's message arrived wrong"
            );
            comm.barrier().unwrap();
        });
    }
}

/// A receive whose caller takes the message itself (it spins: a spin
/// window of 2 s here) copies the payload out of the sender's memory, and
/// its answer (TagAck) is what completes the send: that answer must go
/// out as the receive completes, not when the receiving rank next calls
/// rdist (here after a third of a second; in a program, after its compute
/// step) or its endpoint's thread next looks. In a process of its own,
/// for the spin window.
#[test]
fn a_single_copy_send_completes_with_its_receive_not_at_the_receivers_next_call() {
    with_spin(
        "a_single_copy_send_completes_with_its_receive_not_at_the_receivers_next_call",
        "2000000",
        "SINGLE COPY ANSWERED",
        single_copy_answer_worker,
    );
}

fn single_copy_answer_worker() {
    use std::sync::{Arc, Mutex};
    for size in [64 << 10, 4 << 20] {
        let mut o = common::opts(10_000);
        o.set("single_copy_min", "1").unwrap();
        // When each round's receive and send returned.
        let received = Arc::new(Mutex::new(Vec::new()));
        let sent = Arc::new(Mutex::new(Vec::new()));
        let (r, s) = (received.clone(), sent.clone());
        common::world(2, o, Duration::from_secs(60), move |comm| {
            let me = comm.rank();
            let mine: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
            let mut got = vec![0u8; size];
            // Round 0 makes the connection.
            for round in 0..10 {
                comm.barrier().unwrap();
                if me == 0 {
                    comm.send_tagged(&mine, 1, round).unwrap();
                    s.lock().unwrap().push(Instant::now());
                } else {
                    got.fill(0);
                    comm.recv_tagged(&mut got, Some(0), Some(round)).unwrap();
                    r.lock().unwrap().push(Instant::now());
                    assert!(got == mine, "{size} B, round {round}: arrived wrong");
                    std::thread::sleep(Duration::from_millis(300));
                }
            }
        });
        let (received, sent) = (received.lock().unwrap(), sent.lock().unwrap());
        let mut late: Vec<Duration> = (1..sent.len())
            .map(|i| sent[i].saturating_duration_since(received[i]))
            .collect();
        late.sort();
        // The answer left behind waited 20-250 ms for the endpoint's
        // thread, or the 300 ms, in every round; sent at once, it reaches
        // a spinning sender in microseconds. The third quickest of nine:
        // sends held up by a busy machine are not the fault.
        assert!(
            late[2] < Duration::from_millis(16),
            "{size} B: single-copy sends returned {late:?} after their receives: their answers waited"
        );
        println!("SINGLE COPY ANSWERED {size} B: sends returned {late:?} after their receives");
    }
}

#[test]
fn a_send_that_timed_out_never_hands_its_receiver_changed_bytes() {
    // Rank 1 posts its receive only after rank 0's send timed out and
    // rank 0 wrote over its buffer. Framed eager sends (TCP: partly
    // written, the socket full) are finished from a copy of the bytes
    // they had: the message arrives intact, the pair goes on. A
    // single-copy send (shared memory, forced) cannot be taken back
    // from a receiver that may be reading it: its receive fails, saying
    // why, rather than deliver what the buffer holds now.
    for (transport, single_copy, bytes) in [("tcp", "off", 32 << 20), ("auto", "1", 1 << 20)] {
        let mut o = common::opts(1500);
        o.set("transport", transport).unwrap();
        o.set("single_copy_min", single_copy).unwrap();
        common::world(2, o, Duration::from_secs(60), move |comm| {
            let sent: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
            if comm.rank() == 0 {
                let mut buf = sent.clone();
                let e = comm.send_tagged(&buf, 1, 1).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Timeout, "{transport}: {e}");
                buf.fill(0xff);
                comm.send_tagged(&[7u8; 16], 1, 2).unwrap();
                drop(buf);
            } else {
                std::thread::sleep(Duration::from_millis(2500));
                let mut got = vec![0u8; bytes];
                match comm.recv_tagged(&mut got, Some(0), Some(1)) {
                    Ok(st) => {
                        assert_eq!(st.count, bytes, "{transport}");
                        assert!(got == sent, "{transport}: the message arrived changed");
                        assert_eq!(
                            single_copy, "off",
                            "a withdrawn single-copy message was received"
                        );
                    }
                    Err(e) => {
                        assert_eq!(single_copy, "1", "{transport}: {e}");
                        assert!(
                            e.to_string().contains("rank 0 withdrew this message"),
                            "{e}"
                        );
                    }
                }
                let mut small = [0u8; 16];
                comm.recv_tagged(&mut small, Some(0), Some(2)).unwrap();
                assert_eq!(small, [7u8; 16], "{transport}: the pair did not go on");
            }
            comm.barrier().unwrap();
        });
    }
}

/// A receive whose message never comes times out at its bound even while
/// other messages keep arriving: bytes moving for other calls extend the
/// wait's spin, never its timeout (they did, for as long as the traffic
/// lasted, when it came faster than the spin window). Run in a process of
/// its own, with a spin window (RDIST_SPIN_US) far longer than the gaps
/// between the other messages.
#[test]
fn a_wait_times_out_while_other_messages_keep_arriving() {
    with_spin(
        "a_wait_times_out_while_other_messages_keep_arriving",
        "200000",
        "BUSY WAIT TIMED OUT",
        busy_wait_worker,
    );
}

/// Runs `worker` in a process of its own (the test `name` again, which
/// then plays the worker) with a spin window of `spin_us` (tuning is read
/// from the environment), and checks that it passed and printed `done`.
fn with_spin(name: &str, spin_us: &str, done: &str, worker: fn()) {
    if std::env::var("RDIST_TEST_ROLE").is_ok_and(|role| role == name) {
        return worker();
    }
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env("RDIST_TEST_ROLE", name)
        .env("RDIST_SPIN_US", spin_us);
    let out = common::output_within(&mut cmd, Duration::from_secs(60), name);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(done), "{text}");
}

fn busy_wait_worker() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let done = Arc::new(AtomicBool::new(false));
    let r = common::world(
        2,
        common::opts(1500),
        Duration::from_secs(60),
        move |comm| {
            if comm.rank() == 0 {
                let mut buf = [0u8; 8];
                let t = Instant::now();
                let e = comm.recv_tagged(&mut buf, Some(1), Some(5)).unwrap_err();
                let waited = t.elapsed();
                done.store(true, Ordering::Relaxed);
                assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
                assert!(e.to_string().contains("recv from rank 1"), "{e}");
                waited
            } else {
                // A message with another tag every 50 us, until rank 0 is done.
                let t = Instant::now();
                while !done.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(20) {
                    if comm.send_tagged(&[1u8; 8], 0, 6).is_err() {
                        break;
                    }
                    let s = Instant::now();
                    while s.elapsed() < Duration::from_micros(50) {
                        std::hint::spin_loop();
                    }
                }
                t.elapsed()
            }
        },
    );
    assert!(
        r[0] < Duration::from_millis(3000),
        "the receive timed out after {:?} (bound 1.5 s)",
        r[0]
    );
    println!("BUSY WAIT TIMED OUT after {:?}", r[0]);
}

#[test]
fn a_blocking_receive_takes_the_oldest_message_it_accepts() {
    // A blocking receive may take its message straight from the
    // connection; never one that MPI's order gives to another: rank 0's
    // tag-7 message that arrived first (and now waits unmatched) comes
    // before the one still on the connection.
    common::world(2, common::opts(20_000), Duration::from_secs(60), |comm| {
        if comm.rank() == 0 {
            for (tag, v) in [(7, 1i32), (5, 2), (7, 3), (5, 4), (5, 5)] {
                comm.send_tagged(&[v], 1, tag).unwrap();
            }
        } else {
            // All five are there before the first receive.
            std::thread::sleep(Duration::from_millis(200));
            let mut got = Vec::new();
            for tag in [5, 7, 7, 5, 5] {
                let mut v = [0i32];
                let s = comm.recv_tagged(&mut v, Some(0), Some(tag)).unwrap();
                assert_eq!(s.tag, tag);
                got.push(v[0]);
            }
            assert_eq!(got, vec![2, 1, 3, 4, 5]);
        }
        comm.barrier().unwrap();
    });
}

#[test]
fn a_blocking_receive_never_overtakes_one_posted_before_it() {
    // The receive posted first (any tag) gets the first message, although
    // the blocking one made later accepts it too and, spinning, sees it
    // first. Twenty rounds, the messages sent while the blocking receive
    // spins.
    let both = std::sync::Arc::new(std::sync::Barrier::new(2));
    common::world(
        2,
        common::opts(20_000),
        Duration::from_secs(60),
        move |comm| {
            for round in 0..20 {
                if comm.rank() == 0 {
                    both.wait();
                    std::thread::sleep(Duration::from_micros(100));
                    comm.send_tagged(&[1i32], 1, 5).unwrap();
                    comm.send_tagged(&[2i32], 1, 5).unwrap();
                } else {
                    let mut first = [0i32; 1];
                    let mut bytes = [0u8; 4];
                    let r = irecv(&comm, &mut bytes, DType::Int32, Some(0), None);
                    both.wait();
                    comm.recv_tagged(&mut first, Some(0), Some(5)).unwrap();
                    r.wait().unwrap();
                    assert_eq!(
                        (i32::from_le_bytes(bytes), first[0]),
                        (1, 2),
                        "round {round}"
                    );
                }
            }
            comm.barrier().unwrap();
        },
    );
}

#[test]
fn receives_posted_one_after_another_match_in_order_whichever_is_waited_first() {
    // A small irecv waits beside the posted calls for its wait (deferred):
    // the next irecv posts it first, so the first receive still gets the
    // first message, although the second one is waited for first.
    common::world(2, common::opts(20_000), Duration::from_secs(60), |comm| {
        for round in 0..20i32 {
            if comm.rank() == 0 {
                comm.barrier().unwrap();
                comm.send_tagged(&[round], 1, 5).unwrap();
                comm.send_tagged(&[round + 100], 1, 5).unwrap();
            } else {
                let (mut first, mut second) = ([0u8; 4], [0u8; 4]);
                let a = irecv(&comm, &mut first, DType::Int32, Some(0), Some(5));
                let b = irecv(&comm, &mut second, DType::Int32, Some(0), Some(5));
                comm.barrier().unwrap();
                b.wait().unwrap();
                a.wait().unwrap();
                assert_eq!(
                    (i32::from_le_bytes(first), i32::from_le_bytes(second)),
                    (round, round + 100),
                    "round {round}"
                );
            }
        }
        comm.barrier().unwrap();
    });
}

/// A receive waited for on another thread keeps its place: the waiter
/// looks at the connection for its message (deferred, for the spin
/// window, here two seconds) while the posting thread posts a second
/// receive for the same messages. The first receive gets the first
/// message (the second one did when the waiter took the first out of
/// sight while it looked). In a process of its own, for the spin window.
#[test]
fn a_receive_waited_for_on_another_thread_keeps_its_place() {
    with_spin(
        "a_receive_waited_for_on_another_thread_keeps_its_place",
        "2000000",
        "ORDER KEPT",
        waited_elsewhere_worker,
    );
}

fn waited_elsewhere_worker() {
    common::world(2, common::opts(20_000), Duration::from_secs(60), |comm| {
        for round in 0..10i32 {
            if comm.rank() == 0 {
                // Nothing else on the connection while rank 1 looks.
                std::thread::sleep(Duration::from_millis(50));
                comm.send_tagged(&[round], 1, 5).unwrap();
                comm.send_tagged(&[round + 100], 1, 5).unwrap();
                comm.barrier().unwrap();
                continue;
            }
            let (mut first, mut second) = ([0u8; 4], [0u8; 4]);
            let a = irecv(&comm, &mut first, DType::Int32, Some(0), Some(5));
            let started = &std::sync::Barrier::new(2);
            std::thread::scope(|sc| {
                let waiter = sc.spawn(move || {
                    started.wait();
                    a.wait().unwrap();
                });
                started.wait();
                std::thread::sleep(Duration::from_millis(2));
                let b = irecv(&comm, &mut second, DType::Int32, Some(0), Some(5));
                b.wait().unwrap();
                waiter.join().unwrap();
            });
            comm.barrier().unwrap();
            assert_eq!(
                (i32::from_le_bytes(first), i32::from_le_bytes(second)),
                (round, round + 100),
                "round {round}: the receive posted first got the second message"
            );
        }
        comm.barrier().unwrap();
    });
    println!("ORDER KEPT");
}

#[test]
fn a_receive_posted_after_its_message_came_has_its_data_and_status() {
    // Its message is already on the connection when it is posted (it may
    // complete there and then): the data, who sent it, the tag and the
    // count are the message's, for any-tag receives and exact ones.
    common::world(2, common::opts(20_000), Duration::from_secs(60), |comm| {
        if comm.rank() == 0 {
            comm.send_tagged(&[11i32, 12], 1, 3).unwrap();
            comm.send_tagged(&[21i32, 22, 23], 1, 4).unwrap();
        } else {
            std::thread::sleep(Duration::from_millis(100));
            let mut a = [0u8; 8];
            let r = irecv(&comm, &mut a, DType::Int32, Some(0), Some(3));
            r.wait().unwrap();
            let s = r.status().unwrap();
            assert_eq!((s.source, s.tag, s.count), (0, 3, 2));
            let mut b = [0u8; 16];
            let r = irecv(&comm, &mut b, DType::Int32, Some(0), None);
            r.wait().unwrap();
            let s = r.status().unwrap();
            assert_eq!((s.source, s.tag, s.count), (0, 4, 3));
            let ints = |v: &[u8]| -> Vec<i32> {
                v.chunks(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                    .collect()
            };
            assert_eq!((ints(&a), ints(&b[..12])), (vec![11, 12], vec![21, 22, 23]));
        }
        comm.barrier().unwrap();
    });
}

#[test]
fn a_blocking_receive_times_out_within_its_bound_whatever_the_spin() {
    // Its look at the connection before it is posted counts against the
    // timeout: with a spin window (5 s) longer than the timeout (1 s), a
    // receive from a connected but silent peer fails at 1 s, not 2.
    with_spin(
        "a_blocking_receive_times_out_within_its_bound_whatever_the_spin",
        "5000000",
        "LONG SPIN TIMED OUT",
        long_spin_worker,
    );
}

fn long_spin_worker() {
    let r = common::world(2, common::opts(1000), Duration::from_secs(60), |comm| {
        if comm.rank() == 0 {
            comm.send_tagged(&[1i32], 1, 1).unwrap();
            std::thread::sleep(Duration::from_secs(3));
            Duration::ZERO
        } else {
            let mut b = [0i32];
            comm.recv_tagged(&mut b, Some(0), Some(1)).unwrap();
            let t = Instant::now();
            let e = comm.recv_tagged(&mut b, Some(0), Some(2)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            assert!(e.to_string().contains("recv from rank 0"), "{e}");
            t.elapsed()
        }
    });
    assert!(
        r[1] < Duration::from_millis(1500),
        "the receive timed out after {:?} (bound 1 s)",
        r[1]
    );
    println!("LONG SPIN TIMED OUT after {:?}", r[1]);
}
