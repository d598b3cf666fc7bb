//! rdist-bench --device: allreduce on device buffers on a CUDA stream,
//! through rdist (NCCL when the communicator has it, else staged through
//! the sockets) and, with --nccl-direct, through NCCL called directly on a
//! communicator of its own, side by side.

use cudarc::driver::sys as cu;
use rdist::internals::nccl::loader::{self, NcclLibrary, NCCL_SUCCESS};
use rdist::internals::OpKind;
use rdist::internals::Stream;
use rdist::internals::{Call, Data};
use rdist::{Backend, Comm, DType, ReduceOp};
use std::time::Instant;

fn ok(what: &str, rc: cu::CUresult) -> Result<(), String> {
    match rc {
        cu::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(format!("{what} failed: {e:?}")),
    }
}

/// The device this rank uses (RDIST_DEVICE, else the local rank), made
/// current on this thread.
pub fn use_device(comm: &Comm) -> Result<i32, String> {
    let devices = rdist::internals::cuda::cuda_devices()?;
    let ordinal = match std::env::var("RDIST_DEVICE") {
        Ok(d) => d.parse().map_err(|_| format!("bad RDIST_DEVICE '{d}'"))?,
        Err(_) => (comm.local_rank() % devices) as i32,
    };
    let ctx = rdist::internals::cuda::primary_context(ordinal).map_err(|e| e.to_string())?;
    // SAFETY: a primary context handle.
    ok("cuCtxSetCurrent", unsafe {
        cu::cuCtxSetCurrent(ctx as cu::CUcontext)
    })?;
    Ok(ordinal)
}

/// Device buffers and a stream for one size.
pub struct Bufs {
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub stream: usize,
}

impl Bufs {
    /// `count` float32 elements each, send filled with rank-dependent
    /// values (the bench's pattern).
    pub fn new(count: usize, rank: usize) -> Result<Bufs, String> {
        let bytes = (count * 4).max(4);
        let (mut send, mut recv) = (0, 0);
        let mut stream = std::ptr::null_mut();
        let host: Vec<f32> = (0..count).map(|i| ((rank * 7 + i) % 13) as f32).collect();
        // SAFETY: out-pointers to locals; a host source of count*4 bytes.
        unsafe {
            ok("cuMemAlloc", cu::cuMemAlloc_v2(&mut send, bytes))?;
            ok("cuMemAlloc", cu::cuMemAlloc_v2(&mut recv, bytes))?;
            ok("cuStreamCreate", cu::cuStreamCreate(&mut stream, 1))?;
            if count > 0 {
                ok(
                    "cuMemcpyHtoD",
                    cu::cuMemcpyHtoD_v2(send, host.as_ptr().cast(), count * 4),
                )?;
            }
        }
        Ok(Bufs {
            send,
            recv,
            count,
            stream: stream as usize,
        })
    }

    pub fn sync(&self) -> Result<(), String> {
        // SAFETY: our stream.
        ok("cuStreamSynchronize", unsafe {
            cu::cuStreamSynchronize(self.stream as cu::CUstream)
        })
    }

    pub fn result(&self) -> Result<Vec<f32>, String> {
        let mut out = vec![0f32; self.count];
        if self.count > 0 {
            // SAFETY: a host destination of count*4 bytes.
            ok("cuMemcpyDtoH", unsafe {
                cu::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.recv, self.count * 4)
            })?;
        }
        Ok(out)
    }
}

impl Drop for Bufs {
    fn drop(&mut self) {
        // SAFETY: ours.
        unsafe {
            cu::cuMemFree_v2(self.send);
            cu::cuMemFree_v2(self.recv);
            cu::cuStreamDestroy_v2(self.stream as cu::CUstream);
        }
    }
}

/// One way to run a device allreduce.
pub enum Runner {
    Rdist,
    /// NCCL directly, on its own communicator (blocking, as most code
    /// that calls NCCL creates it).
    Direct {
        lib: &'static NcclLibrary,
        comm: usize,
    },
}

impl Runner {
    /// An NCCL communicator of its own, its unique id sent over `comm`.
    pub fn direct(comm: &Comm) -> Result<Runner, String> {
        let lib = loader::load()?;
        let mut id = [0u8; 128];
        if comm.rank() == 0 {
            let made = lib.unique_id()?;
            for (d, s) in id.iter_mut().zip(made.internal) {
                *d = s as u8;
            }
        }
        comm.broadcast(&mut id, 0).map_err(|e| e.to_string())?;
        let mut raw = cudarc::nccl::sys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in raw.internal.iter_mut().zip(id) {
            *d = s as _;
        }
        let init = lib
            .api
            .ncclCommInitRankConfig
            .ok_or("NCCL lacks ncclCommInitRankConfig")?;
        let mut nc = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; NULL config = defaults (blocking).
        let rc = unsafe {
            init(
                &mut nc,
                comm.size() as i32,
                raw,
                comm.rank() as i32,
                std::ptr::null_mut(),
            )
        };
        if rc != NCCL_SUCCESS {
            return Err(lib.describe_failure("ncclCommInitRankConfig", rc));
        }
        Ok(Runner::Direct {
            lib,
            comm: nc as usize,
        })
    }

    /// Enqueues one allreduce (sum) of `b` on its stream.
    pub fn run(&self, comm: &Comm, b: &Bufs) -> Result<(), String> {
        match self {
            Runner::Rdist => {
                let call = Call::new(
                    OpKind::AllReduce,
                    b.send as *const u8,
                    b.recv as *mut u8,
                    Data {
                        count: b.count,
                        dtype: DType::Float32,
                    },
                    ReduceOp::Sum,
                    0,
                    comm.rank(),
                    comm.size(),
                )
                .map_err(|e| e.to_string())?;
                // SAFETY: the buffers outlive the stream's work (synced
                // before they are freed).
                unsafe { comm.run_on(call, Stream(b.stream)) }.map_err(|e| e.to_string())
            }
            Runner::Direct { lib, comm: nc } => {
                let f = lib.api.ncclAllReduce.ok_or("NCCL lacks ncclAllReduce")?;
                // SAFETY: device buffers of count floats, a live comm.
                let rc = unsafe {
                    f(
                        b.send as *const _,
                        b.recv as *mut _,
                        b.count,
                        cudarc::nccl::sys::ncclDataType_t::ncclFloat32,
                        cudarc::nccl::sys::ncclRedOp_t::ncclSum,
                        *nc as cudarc::nccl::sys::ncclComm_t,
                        b.stream as cudarc::nccl::sys::cudaStream_t,
                    )
                };
                match rc {
                    NCCL_SUCCESS => Ok(()),
                    e => Err(lib.describe_failure("ncclAllReduce", e)),
                }
            }
        }
    }

    /// Median over `reps` batches of the slowest rank's time per call:
    /// each batch enqueues `iters` calls and waits for the stream.
    pub fn measure(&self, comm: &Comm, b: &Bufs, seconds: f64, reps: usize) -> Result<f64, String> {
        let e = |e: rdist::Error| e.to_string();
        for _ in 0..3 {
            self.run(comm, b)?;
        }
        b.sync()?;
        let t = Instant::now();
        for _ in 0..5 {
            self.run(comm, b)?;
        }
        b.sync()?;
        let mut est = [t.elapsed().as_secs_f64() / 5.0];
        comm.allreduce(&mut est, ReduceOp::Max).map_err(e)?;
        let iters = ((seconds / est[0].max(1e-7)) as usize).clamp(1, 100_000);
        let mut batches = vec![0f64; reps];
        for batch in batches.iter_mut() {
            comm.barrier().map_err(e)?;
            let t = Instant::now();
            for _ in 0..iters {
                self.run(comm, b)?;
            }
            b.sync()?;
            *batch = t.elapsed().as_secs_f64() / iters as f64;
        }
        comm.allreduce(&mut batches, ReduceOp::Max).map_err(e)?;
        batches.sort_by(|x, y| x.total_cmp(y));
        Ok(batches[batches.len() / 2])
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        if let Runner::Direct { lib, comm } = self {
            if let Some(f) = lib.api.ncclCommDestroy {
                // SAFETY: ours; its work was synchronised.
                unsafe { f(*comm as cudarc::nccl::sys::ncclComm_t) };
            }
        }
    }
}

/// The --device table: per size, rdist's time and (with --nccl-direct)
/// NCCL's, their ratio (NCCL's time / rdist's: 1.00 is parity, below 1
/// rdist is slower), and #wrong against the reference sum.
pub fn bench(
    comm: &Comm,
    sizes: &[usize],
    seconds: f64,
    reps: usize,
    direct: bool,
) -> Result<u64, String> {
    let (rank, n) = (comm.rank(), comm.size());
    let ordinal = use_device(comm)?;
    let mut runners = vec![Runner::Rdist];
    if direct {
        runners.push(Runner::direct(comm)?);
    }
    let backend = match comm.backend() {
        Backend::Nccl => "nccl",
        _ => "socket (device buffers staged through host memory)",
    };
    if rank == 0 {
        println!("# rdist-bench --device: {n} ranks, device {ordinal} on rank 0, rdist backend {backend}, float32 allreduce sum");
        println!(
            "# {:>12} {:>12} {:>11} {:>9} {:>9} {:>11} {:>9} {:>7}",
            "size(B)", "count", "rdist(us)", "algbw", "busbw", "nccl(us)", "nccl/rd", "#wrong"
        );
    }
    let mut wrong_total = 0;
    for &bytes in sizes {
        let count = bytes / 4;
        let b = Bufs::new(count, rank)?;
        let mut times = Vec::new();
        let mut wrong = 0u64;
        for r in &runners {
            times.push(r.measure(comm, &b, seconds, reps)?);
            let got = b.result()?;
            let want = |i: usize| (0..n).map(|k| ((k * 7 + i) % 13) as f32).sum::<f32>();
            wrong += got
                .iter()
                .enumerate()
                .filter(|(i, g)| **g != want(*i))
                .count() as u64;
        }
        let mut w = [wrong];
        comm.allreduce(&mut w, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        wrong_total += w[0];
        if rank == 0 {
            let t = times[0];
            let algbw = bytes as f64 / t / 1e9;
            let busbw = algbw * 2.0 * (n - 1) as f64 / n as f64;
            let (nccl, ratio) = match times.get(1) {
                Some(d) => (format!("{:.2}", d * 1e6), format!("{:.2}", d / t)),
                None => ("-".into(), "-".into()),
            };
            println!(
                "  {:>12} {:>12} {:>11.2} {:>9.3} {:>9.3} {:>11} {:>9} {:>7}",
                bytes,
                count,
                t * 1e6,
                algbw,
                busbw,
                nccl,
                ratio,
                w[0]
            );
        }
    }
    Ok(wrong_total)
}
