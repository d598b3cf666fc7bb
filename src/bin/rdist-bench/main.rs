//! rdist-bench: nccl-tests-style benchmark, one process per rank.
//!
//!   rdistrun --nproc-per-node 4 rdist-bench [--op allreduce,broadcast|all]
//!       [--min-bytes 8] [--max-bytes 64M] [--factor 4] [--dtype float32]
//!       [--redop sum] [--root 0] [--seconds 0.2] [--reps 5] [--no-check]
//!       [--json FILE] [--device [--nccl-direct]] [--resources]
//!
//! --device: allreduce on device buffers on a CUDA stream (NCCL when the
//! communicator has it, else staged through the sockets); --nccl-direct
//! adds NCCL called directly, side by side (see device.rs).
//!
//! Each size is warmed up, then timed in `--reps` batches of about
//! `--seconds`; a batch's time is the maximum over ranks and the reported
//! time the median batch. algbw = bytes / time; busbw applies nccl-tests'
//! factor per collective (allreduce 2(n-1)/n; allgather, reduce_scatter,
//! alltoall (n-1)/n; broadcast, reduce, point-to-point 1). #wrong counts
//! elements that differ from an independently computed reference on a
//! checked run.
//!
//! Point-to-point: `pingpong` (ranks 2i and 2i+1 send and receive in turn,
//! blocking; the time is half the round trip), `exchange` (each rank posts
//! a receive from the previous rank and a send to the next, then waits for
//! both) and `sendrecv` (the same ring shift as one group).

mod device;

use rdist::internals::{Data, RawBuf};
use rdist::{Comm, DType, Options, ReduceOp};
use std::fmt::Write as _;
use std::time::Instant;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Coll {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Barrier,
    /// Point-to-point: each rank sends to the next and receives from the
    /// previous at once (a ring shift), in one group.
    SendRecv,
    /// Ranks 2i and 2i+1 send and receive in turn (blocking).
    PingPong,
    /// The ring shift as non-blocking receive and send, then two waits.
    Exchange,
}

const ALL: [Coll; 10] = [
    Coll::AllReduce,
    Coll::Broadcast,
    Coll::Reduce,
    Coll::AllGather,
    Coll::ReduceScatter,
    Coll::AllToAll,
    Coll::Barrier,
    Coll::SendRecv,
    Coll::PingPong,
    Coll::Exchange,
];

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "allreduce",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::AllGather => "allgather",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllToAll => "alltoall",
            Coll::Barrier => "barrier",
            Coll::SendRecv => "sendrecv",
            Coll::PingPong => "pingpong",
            Coll::Exchange => "exchange",
        }
    }

    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll => (n - 1.0) / n,
            _ => 1.0,
        }
    }
}

struct Args {
    ops: Vec<Coll>,
    min_bytes: usize,
    max_bytes: usize,
    factor: usize,
    seconds: f64,
    reps: usize,
    root: usize,
    redop: ReduceOp,
    check: bool,
    json: Option<String>,
    /// Device buffers (allreduce only).
    device: bool,
    nccl_direct: bool,
    /// Report init time, descriptors and memory per rank.
    resources: bool,
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K') | Some('k') => (&s[..s.len() - 1], 1 << 10),
        Some('M') | Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('G') | Some('g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|v| v * mul)
        .map_err(|_| format!("'{s}' is not a size (e.g. 8, 64K, 16M)"))
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        ops: vec![Coll::AllReduce],
        min_bytes: 8,
        max_bytes: 64 << 20,
        factor: 4,
        seconds: 0.2,
        reps: 5,
        root: 0,
        redop: ReduceOp::Sum,
        check: true,
        json: None,
        device: false,
        nccl_direct: false,
        resources: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (flag, None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or(format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--op" | "-o" => {
                let v = value()?;
                a.ops = if v == "all" {
                    ALL.to_vec()
                } else {
                    v.split(',')
                        .map(|n| {
                            ALL.iter()
                                .copied()
                                .find(|c| c.name() == n)
                                .ok_or(format!("unknown op '{n}'"))
                        })
                        .collect::<Result<_, _>>()?
                };
            }
            "--min-bytes" | "-b" => a.min_bytes = parse_bytes(&value()?)?,
            "--max-bytes" | "-e" => a.max_bytes = parse_bytes(&value()?)?,
            "--factor" | "-f" => a.factor = value()?.parse().map_err(|_| "bad --factor")?,
            "--seconds" => a.seconds = value()?.parse().map_err(|_| "bad --seconds")?,
            "--reps" => a.reps = value()?.parse().map_err(|_| "bad --reps")?,
            "--root" => a.root = value()?.parse().map_err(|_| "bad --root")?,
            "--redop" => {
                let v = value()?;
                a.redop = ReduceOp::ALL
                    .into_iter()
                    .find(|o| o.name() == v)
                    .ok_or(format!("unknown redop '{v}'"))?;
            }
            "--no-check" => a.check = false,
            "--device" => a.device = true,
            "--nccl-direct" => a.nccl_direct = true,
            "--resources" => a.resources = true,
            "--json" => a.json = Some(value()?),
            "-h" | "--help" => {
                println!(
                    "{}",
                    include_str!("main.rs")
                        .lines()
                        .take_while(|l| l.starts_with("//!"))
                        .map(|l| l.trim_start_matches("//!").trim_start_matches(' '))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown option '{other}' (see --help)")),
        }
    }
    if a.factor < 2 || a.min_bytes == 0 || a.min_bytes > a.max_bytes || a.reps == 0 {
        return Err("need --factor >= 2, 0 < --min-bytes <= --max-bytes, --reps >= 1".into());
    }
    Ok(a)
}

/// Buffers for one collective at one size (float32 elements).
struct Bufs {
    send: Vec<f32>,
    recv: Vec<f32>,
}

fn setup(c: Coll, count: usize, comm: &Comm) -> Bufs {
    let (r, n) = (comm.rank(), comm.size());
    let fill = |len: usize, rank: usize| {
        (0..len)
            .map(|i| ((rank * 7 + i) % 13) as f32)
            .collect::<Vec<_>>()
    };
    match c {
        Coll::AllReduce
        | Coll::Broadcast
        | Coll::Reduce
        | Coll::SendRecv
        | Coll::PingPong
        | Coll::Exchange => Bufs {
            send: fill(count, r),
            recv: vec![0.0; count],
        },
        Coll::AllGather => Bufs {
            send: fill(count, r),
            recv: vec![0.0; count * n],
        },
        Coll::ReduceScatter | Coll::AllToAll => Bufs {
            send: fill(count * n, r),
            recv: vec![0.0; count * n],
        },
        Coll::Barrier => Bufs {
            send: vec![],
            recv: vec![],
        },
    }
}

fn run_once(c: Coll, b: &mut Bufs, count: usize, a: &Args, comm: &Comm) -> rdist::Result<()> {
    match c {
        Coll::AllReduce => comm.allreduce_into(&b.send, &mut b.recv, a.redop),
        Coll::Broadcast => comm.broadcast(&mut b.recv, a.root),
        Coll::Reduce => comm.reduce(&b.send, &mut b.recv, a.redop, a.root),
        Coll::AllGather => comm.allgather(&b.send, &mut b.recv),
        Coll::ReduceScatter => comm.reduce_scatter(&b.send, &mut b.recv[..count], a.redop),
        Coll::AllToAll => comm.alltoall(&b.send, &mut b.recv),
        Coll::Barrier => comm.barrier(),
        Coll::SendRecv => {
            let (r, n) = (comm.rank(), comm.size());
            comm.sendrecv(&b.send, (r + 1) % n, &mut b.recv, (r + n - 1) % n)
        }
        Coll::PingPong => {
            let (r, n) = (comm.rank(), comm.size());
            let peer = r ^ 1;
            match (peer < n, r % 2 == 0) {
                (false, _) => Ok(()),
                (true, true) => comm.send(&b.send, peer).and(comm.recv(&mut b.recv, peer)),
                (true, false) => comm.recv(&mut b.recv, peer).and(comm.send(&b.send, peer)),
            }
        }
        Coll::Exchange => {
            let (r, n) = (comm.rank(), comm.size());
            let data = Data {
                count: b.send.len(),
                dtype: DType::Float32,
            };
            let (out, into) = (as_raw(&b.send), as_raw(&b.recv));
            // SAFETY: both buffers outlive the requests, waited for here.
            unsafe {
                let recv = comm.irecv_message(into, data, Some((r + n - 1) % n), Some(0))?;
                let send = comm.isend_message(out, data, (r + 1) % n, 0)?;
                recv.wait().and(send.wait())
            }
        }
    }
}

/// A buffer as the raw calls take it.
fn as_raw(v: &[f32]) -> RawBuf {
    RawBuf::new(v.as_ptr().cast(), std::mem::size_of_val(v))
}

/// Elements of a checked run that differ from the reference (sum only).
fn count_wrong(c: Coll, count: usize, a: &Args, comm: &Comm) -> rdist::Result<u64> {
    if a.redop != ReduceOp::Sum || c == Coll::Barrier {
        return Ok(0);
    }
    let (r, n) = (comm.rank(), comm.size());
    let v = |rank: usize, i: usize| ((rank * 7 + i) % 13) as f32;
    let sum = |i: usize| (0..n).map(|k| v(k, i)).sum::<f32>();
    let mut b = setup(c, count, comm);
    if c == Coll::Broadcast {
        b.recv = (0..count)
            .map(|i| if r == a.root { v(r, i) } else { -1.0 })
            .collect();
    }
    run_once(c, &mut b, count, a, comm)?;
    let want: Vec<f32> = match c {
        Coll::AllReduce => (0..count).map(sum).collect(),
        Coll::Reduce if r == a.root => (0..count).map(sum).collect(),
        Coll::Reduce => return Ok(0),
        Coll::Broadcast => (0..count).map(|i| v(a.root, i)).collect(),
        Coll::AllGather => (0..n * count)
            .map(|j| v(j / count.max(1), j % count.max(1)))
            .collect(),
        Coll::ReduceScatter => (r * count..(r + 1) * count).map(sum).collect(),
        Coll::AllToAll => (0..n * count)
            .map(|j| v(j / count.max(1), r * count + j % count.max(1)))
            .collect(),
        Coll::Barrier => return Ok(0),
        Coll::SendRecv | Coll::Exchange => {
            let left = (r + n - 1) % n;
            (0..count).map(|i| v(left, i)).collect()
        }
        Coll::PingPong if r ^ 1 < n => (0..count).map(|i| v(r ^ 1, i)).collect(),
        Coll::PingPong => return Ok(0),
    };
    let got = &b.recv[..want.len()];
    Ok(got.iter().zip(&want).filter(|(g, w)| g != w).count() as u64)
}

/// Median over batches of the slowest rank's time per op.
fn measure(c: Coll, count: usize, a: &Args, comm: &Comm) -> rdist::Result<f64> {
    let mut b = setup(c, count, comm);
    for _ in 0..3 {
        run_once(c, &mut b, count, a, comm)?;
    }
    // Estimate, agreed on by all ranks, so every rank runs the same count.
    let t = Instant::now();
    let probe = 5;
    for _ in 0..probe {
        run_once(c, &mut b, count, a, comm)?;
    }
    let mut est = [t.elapsed().as_secs_f64() / probe as f64];
    comm.allreduce(&mut est, ReduceOp::Max)?;
    let iters = ((a.seconds / est[0].max(1e-7)) as usize).clamp(1, 200_000);
    let mut batches = vec![0f64; a.reps];
    for batch in batches.iter_mut() {
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            run_once(c, &mut b, count, a, comm)?;
        }
        *batch = t.elapsed().as_secs_f64() / iters as f64;
        if c == Coll::PingPong {
            // An iteration is a round trip.
            *batch /= 2.0;
        }
    }
    comm.allreduce(&mut batches, ReduceOp::Max)?;
    batches.sort_by(|x, y| x.total_cmp(y));
    Ok(batches[batches.len() / 2])
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("rdist-bench: {e}");
            std::process::exit(2);
        }
    };
    let started = std::time::Instant::now();
    let started_at = unix_us();
    let comm = match Comm::init("env://", -1, -1, &Options::default()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rdist-bench: cannot join the job: {e} (run it under rdistrun)");
            std::process::exit(1);
        }
    };
    if a.device {
        let sizes: Vec<usize> =
            std::iter::successors(Some(a.min_bytes), |s| s.checked_mul(a.factor))
                .take_while(|s| *s <= a.max_bytes)
                .collect();
        match device::bench(&comm, &sizes, a.seconds, a.reps, a.nccl_direct) {
            Ok(0) => return,
            Ok(_) => std::process::exit(3),
            Err(e) => {
                eprintln!("rdist-bench: rank {}: {e}", comm.rank());
                std::process::exit(1);
            }
        }
    }
    let joined = started.elapsed();
    let span = [started_at, unix_us()];
    let after_init = a.resources.then(Usage::now);
    if let Err(e) = bench(&a, &comm) {
        eprintln!("rdist-bench: rank {}: {e}", comm.rank());
        std::process::exit(1);
    }
    if let Some(after_init) = after_init {
        if let Err(e) = report_usage(&comm, joined, span, after_init, Usage::now()) {
            eprintln!("rdist-bench: rank {}: {e}", comm.rank());
            std::process::exit(1);
        }
    }
    drop(comm);
}

/// What a rank holds: open descriptors and resident memory.
#[derive(Clone, Copy)]
struct Usage {
    fds: u64,
    rss_kib: u64,
}

impl Usage {
    fn now() -> Usage {
        let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
        let rss_kib = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("VmRSS:"))?.to_string();
                line.split_whitespace().nth(1)?.parse().ok()
            })
            .unwrap_or(0);
        Usage { fds, rss_kib }
    }
}

/// Microseconds since the Unix epoch (one clock for every rank of a host).
fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Prints (rank 0) the slowest and mean init time, and descriptors and
/// resident memory per rank after init and after the benchmark. `span`:
/// when this rank called init and when it returned (`unix_us`), which
/// tells the launch (the first rank's call to the last's) from what init
/// took once every rank was there; on one host, whose ranks share a clock.
fn report_usage(
    comm: &Comm,
    joined: std::time::Duration,
    span: [u64; 2],
    after_init: Usage,
    after_run: Usage,
) -> rdist::Result<()> {
    let mut last = span;
    let mut first = [span[0]];
    comm.allreduce(&mut last, ReduceOp::Max)?;
    comm.allreduce(&mut first, ReduceOp::Min)?;
    let mine = [
        joined.as_micros() as u64,
        after_init.fds,
        after_init.rss_kib,
        after_run.fds,
        after_run.rss_kib,
    ];
    let mut max = mine;
    let mut sum = mine;
    comm.allreduce(&mut max, ReduceOp::Max)?;
    comm.allreduce(&mut sum, ReduceOp::Sum)?;
    let n = comm.size() as f64;
    if comm.rank() == 0 {
        let mean = |i: usize| sum[i] as f64 / n;
        println!(
            "# resources: {} ranks; init {:.2} s (slowest rank), {:.2} s mean; calls to init over {:.2} s, the last returned {:.2} s after the last call; after init {:.0} fds ({} max), {:.1} MiB RSS ({:.1} max) per rank; after the run {:.0} fds ({} max), {:.1} MiB RSS ({:.1} max)",
            comm.size(),
            max[0] as f64 / 1e6,
            mean(0) / 1e6,
            last[0].saturating_sub(first[0]) as f64 / 1e6,
            last[1].saturating_sub(last[0]) as f64 / 1e6,
            mean(1),
            max[1],
            mean(2) / 1024.0,
            max[2] as f64 / 1024.0,
            mean(3),
            max[3],
            mean(4) / 1024.0,
            max[4] as f64 / 1024.0,
        );
    }
    Ok(())
}

/// The largest allreduce against the tuning model's memory-bandwidth
/// bound, when every rank shares this host's memory (rdistrun's
/// LOCAL_WORLD_SIZE is the world) and the transport is left to rdist.
fn memory_model(
    a: &Args,
    n: usize,
    transport: &str,
    largest: &Option<(usize, f64)>,
) -> Option<String> {
    use rdist::internals::tuner;
    let (bytes, t) = (*largest)?;
    let local: usize = std::env::var("LOCAL_WORLD_SIZE").ok()?.parse().ok()?;
    if transport != "auto" || local != n || n < 2 || bytes < 1 << 20 || a.device {
        return None;
    }
    let m = rdist::internals::local_machine();
    // Allreduces go through the rings (a reducing receiver never takes
    // single copy).
    let bound = tuner::allreduce_bound_s(bytes, n, &m, false);
    (bound > 0.0).then(|| {
        format!(
            "# memory model: allreduce of {bytes} B on {n} ranks through the rings (one core copies {:.1} GB/s, \
             all {} together {:.1}) takes at least {:.2} us; this run {:.2} us, {:.0}% of the model",
            f64::from(m.copy_one_mbs) / 1000.0,
            m.cores,
            f64::from(m.copy_all_mbs) / 1000.0,
            bound * 1e6,
            t * 1e6,
            100.0 * bound / t
        )
    })
}

fn bench(a: &Args, comm: &Comm) -> rdist::Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let transport = std::env::var("RDIST_TRANSPORT").unwrap_or_else(|_| "auto".into());
    let mut json = String::from("[");
    let mut wrong_total = 0u64;
    let mut largest_allreduce = None;
    if rank == 0 {
        println!("# rdist-bench: {n} ranks, socket backend, transport {transport}, float32, redop {}, root {}", a.redop, a.root);
        println!(
            "# {:>12} {:>12} {:>8} {:>6} {:>5} {:>11} {:>9} {:>9} {:>7}",
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
        );
        println!(
            "# {:>12} {:>12} {:>8} {:>6} {:>5} {:>11} {:>9} {:>9} {:>7}",
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
        );
    }
    for &c in &a.ops {
        if rank == 0 {
            println!("# {}", c.name());
        }
        let sizes: Vec<usize> = if c == Coll::Barrier {
            vec![0]
        } else {
            std::iter::successors(Some(a.min_bytes), |s| s.checked_mul(a.factor))
                .take_while(|s| *s <= a.max_bytes)
                .collect()
        };
        for bytes in sizes {
            // Per-rank element count: the size is the whole buffer, as in nccl-tests.
            let count = match c {
                Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll => {
                    (bytes / 4 / n).max(usize::from(bytes > 0))
                }
                _ => bytes / 4,
            };
            let wrong = if a.check {
                count_wrong(c, count, a, comm)?
            } else {
                0
            };
            let mut w = [wrong];
            comm.allreduce(&mut w, ReduceOp::Sum)?;
            wrong_total += w[0];
            let t = measure(c, count, a, comm)?;
            if c == Coll::AllReduce {
                largest_allreduce = Some((bytes, t));
            }
            let algbw = bytes as f64 / t / 1e9;
            let busbw = algbw * c.bus_factor(n);
            if rank == 0 {
                let (redop, root) = match c {
                    Coll::AllReduce | Coll::ReduceScatter => (a.redop.name(), "-1".to_string()),
                    Coll::Reduce => (a.redop.name(), a.root.to_string()),
                    Coll::Broadcast => ("none", a.root.to_string()),
                    _ => ("none", "-1".to_string()),
                };
                println!(
                    "  {:>12} {:>12} {:>8} {:>6} {:>5} {:>11.2} {:>9.3} {:>9.3} {:>7}",
                    bytes,
                    count,
                    "float",
                    redop,
                    root,
                    t * 1e6,
                    algbw,
                    busbw,
                    w[0]
                );
                let _ = write!(
                    json,
                    "{}{{\"op\":\"{}\",\"bytes\":{bytes},\"count\":{count},\"ranks\":{n},\"transport\":\"{transport}\",\"time_us\":{:.3},\"algbw_GBps\":{algbw:.5},\"busbw_GBps\":{busbw:.5},\"wrong\":{}}}",
                    if json.len() > 1 { "," } else { "" },
                    c.name(),
                    t * 1e6,
                    w[0]
                );
            }
        }
    }
    if rank == 0 {
        if let Some(line) = memory_model(a, n, &transport, &largest_allreduce) {
            println!("{line}");
        }
        println!(
            "# out of bounds values : {wrong_total} {}",
            if wrong_total == 0 { "OK" } else { "FAILED" }
        );
        if let Some(path) = &a.json {
            json.push_str("]\n");
            if let Err(e) = std::fs::write(path, json) {
                eprintln!("rdist-bench: cannot write {path}: {e}");
            }
        }
    }
    comm.barrier()?;
    if wrong_total > 0 {
        std::process::exit(3);
    }
    Ok(())
}
