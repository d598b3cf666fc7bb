//! rdist's GPU code paths on a machine with no GPU, against test doubles of
//! the CUDA driver and NCCL (tests/gpu_stub: C libraries named
//! libcuda.so.1 and libnccl.so.2 whose "device memory" is address space
//! the CPU cannot touch, so a device buffer read or written by the CPU
//! crashes the test). They check what rdist does with device buffers:
//! which backend gets them, that NCCL is driven as documented (one
//! unique id, non-blocking communicators, groups, streams), that the
//! socket backend stages them through host memory with correct results
//! on several ranks, and that a stalled or failing NCCL becomes an error
//! instead of a hang. Real GPUs: see tests/nccl.rs (`skipped: no CUDA
//! device` without one).
//!
//! Every test runs this binary again as a child process with the doubles
//! on LD_LIBRARY_PATH (the dynamic loader reads it at start), bounded in
//! time.

mod common;

use cudarc::driver::sys as cu;
use rdist::internals::OpKind;
use rdist::internals::Stream;
use rdist::internals::{Call, Data};
use rdist::{Backend, Comm, DType, Options, ReduceOp};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Builds the doubles once per test binary (tests/gpu_stub/build.sh).
fn stub_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = root.join("target/gpu-stub");
        let out = Command::new("bash")
            .arg(root.join("tests/gpu_stub/build.sh"))
            .arg(&dir)
            .output()
            .expect("running tests/gpu_stub/build.sh");
        assert!(
            out.status.success(),
            "building the GPU test doubles failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
}

static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs this binary as `worker_process` in `role` with the doubles loaded
/// (`env` added); returns its output and the doubles' call log. Fails
/// past 60 s; `expect_ok` asserts the exit status.
fn run_role(role: &str, env: &[(&str, &str)], expect_ok: bool) -> (Output, String) {
    run_with(Libraries::Doubles, role, env, expect_ok)
}

/// Which CUDA driver and NCCL a child loads.
enum Libraries {
    /// The test doubles.
    Doubles,
    /// The machine's driver and the NCCL wheel scripts/setup.sh installs.
    Real,
}

fn run_with(
    libs: Libraries,
    role: &str,
    env: &[(&str, &str)],
    expect_ok: bool,
) -> (Output, String) {
    let log = std::env::temp_dir().join(format!(
        "rdist-gpu-stub-{role}-{}-{}.log",
        std::process::id(),
        RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&log);
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "worker_process",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("RDIST_TEST_ROLE", role)
    .env("RDIST_STUB_LOG", &log)
    .env_remove("RDIST_DEBUG")
    .env_remove("RDIST_BACKEND")
    .env_remove("RDIST_DEVICE");
    match libs {
        Libraries::Doubles => {
            let dir = stub_dir();
            cmd.env("LD_LIBRARY_PATH", dir)
                .env("RDIST_NCCL_LIBRARY", dir.join("libnccl.so.2"));
        }
        Libraries::Real => {
            let wheel = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("build/nccl/nvidia/nccl/lib/libnccl.so.2");
            if wheel.is_file() {
                cmd.env("RDIST_NCCL_LIBRARY", wheel);
            }
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = common::output_within(&mut cmd, Duration::from_secs(60), &format!("role {role}"));
    let calls = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    if expect_ok {
        assert!(
            out.status.success(),
            "role {role} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (out, calls)
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

// ---------------------------------------------------------------- device

/// The CUDA driver as a test program uses it (the doubles, here).
mod device {
    use super::cu;

    fn ok(what: &str, rc: cu::CUresult) {
        assert_eq!(rc, cu::CUresult::CUDA_SUCCESS, "{what}");
    }

    /// Initialises the driver and makes device `ordinal`'s primary context
    /// current on this thread.
    pub fn use_device(ordinal: i32) {
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            ok("cuInit", cu::cuInit(0));
            let mut dev = 0;
            ok("cuDeviceGet", cu::cuDeviceGet(&mut dev, ordinal));
            let mut ctx = std::ptr::null_mut();
            ok(
                "cuDevicePrimaryCtxRetain",
                cu::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            );
            ok("cuCtxSetCurrent", cu::cuCtxSetCurrent(ctx));
        }
    }

    /// Device memory holding `bytes`.
    pub struct Buffer {
        pub ptr: u64,
        pub len: usize,
    }

    impl Buffer {
        pub fn new(bytes: &[u8]) -> Buffer {
            let len = bytes.len().max(1);
            let mut ptr = 0;
            // SAFETY: out-pointer to a local; a host source of `len` bytes.
            unsafe {
                ok("cuMemAlloc", cu::cuMemAlloc_v2(&mut ptr, len));
                if !bytes.is_empty() {
                    ok(
                        "cuMemcpyHtoD",
                        cu::cuMemcpyHtoD_v2(ptr, bytes.as_ptr().cast(), bytes.len()),
                    );
                }
            }
            Buffer {
                ptr,
                len: bytes.len(),
            }
        }

        pub fn zeroed(len: usize) -> Buffer {
            Buffer::new(&vec![0u8; len])
        }

        pub fn read(&self) -> Vec<u8> {
            let mut out = vec![0u8; self.len];
            if self.len > 0 {
                // SAFETY: a host destination of `len` bytes.
                unsafe {
                    ok(
                        "cuMemcpyDtoH",
                        cu::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr, self.len),
                    );
                }
            }
            out
        }

        pub fn ptr(&self) -> *mut u8 {
            self.ptr as *mut u8
        }
    }

    impl Drop for Buffer {
        fn drop(&mut self) {
            // SAFETY: ours.
            unsafe { cu::cuMemFree_v2(self.ptr) };
        }
    }

    pub fn stream() -> usize {
        let mut s = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        unsafe { ok("cuStreamCreate", cu::cuStreamCreate(&mut s, 0)) };
        s as usize
    }

    /// Waits for `stream` (the doubles finish work at once unless stalled).
    pub fn sync(stream: usize) {
        // SAFETY: a stream made by `stream()` (or 0).
        unsafe {
            ok(
                "cuStreamSynchronize",
                cu::cuStreamSynchronize(stream as cu::CUstream),
            )
        };
    }
}

// ------------------------------------------------------------- reference

/// Element i of rank r's input: small integers, exact in every dtype and
/// their sums over 4 ranks too (even int8).
fn value(r: usize, i: usize) -> i64 {
    ((r * 3 + i) % 11 + 1) as i64
}

/// `v` as one element of `dtype` (v small and exact).
fn encode(dtype: DType, v: i64) -> Vec<u8> {
    match dtype {
        DType::Int8 => (v as i8).to_le_bytes().to_vec(),
        DType::Uint8 => (v as u8).to_le_bytes().to_vec(),
        DType::Int32 => (v as i32).to_le_bytes().to_vec(),
        DType::Uint32 => (v as u32).to_le_bytes().to_vec(),
        DType::Int64 => v.to_le_bytes().to_vec(),
        DType::Uint64 => (v as u64).to_le_bytes().to_vec(),
        DType::Float32 => (v as f32).to_le_bytes().to_vec(),
        DType::Float64 => (v as f64).to_le_bytes().to_vec(),
        // bfloat16: the top half of the float32 (exact for small ints).
        DType::Bfloat16 => (((v as f32).to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        DType::Float16 => f16_bits(v).to_le_bytes().to_vec(),
        DType::Int16 => (v as i16).to_le_bytes().to_vec(),
        DType::Uint16 => (v as u16).to_le_bytes().to_vec(),
        // Every input is nonzero (true), so sums (or) and the rest are 1:
        // the check then covers the bytes moved and the reductions staged
        // off NCCL (which has no bool).
        DType::Bool => vec![u8::from(v != 0)],
    }
}

/// IEEE half-precision bits of a small non-negative integer.
fn f16_bits(v: i64) -> u16 {
    assert!((0..2048).contains(&v));
    if v == 0 {
        return 0;
    }
    let e = 63 - (v as u64).leading_zeros() as i64; // v = 1.m * 2^e
    let mantissa = ((v << (10 - e)) & 0x3ff) as u16;
    (((e + 15) as u16) << 10) | mantissa
}

fn encode_all(dtype: DType, vals: impl IntoIterator<Item = i64>) -> Vec<u8> {
    vals.into_iter().flat_map(|v| encode(dtype, v)).collect()
}

/// Runs every collective (and grouped send/recv) on device buffers on
/// `comm`, `count` elements of `dtype`, and checks the results against the
/// reference. Returns the number of calls made.
fn every_collective(comm: &Comm, dtype: DType, count: usize, stream: usize) -> usize {
    let (me, n) = (comm.rank(), comm.size());
    let data = Data { count, dtype };
    let root = n - 1;
    let mine = |k: usize| encode_all(dtype, (0..count * k).map(|i| value(me, i)));
    let run = |kind: OpKind, send: *const u8, recv: *mut u8, root: usize| {
        let call = Call::new(kind, send, recv, data, ReduceOp::Sum, root as i64, me, n)
            .unwrap_or_else(|e| panic!("{kind:?} {dtype}: {e}"));
        // SAFETY: device buffers alive until the stream is synchronised below.
        unsafe { comm.run_on(call, Stream(stream)) }
            .unwrap_or_else(|e| panic!("rank {me}: {kind:?} {dtype} x {count}: {e}"));
        device::sync(stream);
    };
    let sum = |i: usize| (0..n).map(|r| value(r, i)).sum::<i64>();
    let check = |what: &str, got: Vec<u8>, want: Vec<u8>| {
        assert!(
            got == want,
            "rank {me}: {what} {dtype} x {count}: got {got:?}, want {want:?}"
        );
    };

    let send = device::Buffer::new(&mine(1));
    let recv = device::Buffer::zeroed(count * dtype.size());
    run(OpKind::AllReduce, send.ptr(), recv.ptr(), 0);
    check(
        "allreduce",
        recv.read(),
        encode_all(dtype, (0..count).map(sum)),
    );

    // In place.
    let both = device::Buffer::new(&mine(1));
    run(OpKind::AllReduce, both.ptr(), both.ptr(), 0);
    check(
        "allreduce in place",
        both.read(),
        encode_all(dtype, (0..count).map(sum)),
    );

    let recv = device::Buffer::zeroed(count * dtype.size());
    run(OpKind::Broadcast, send.ptr(), recv.ptr(), root);
    check(
        "broadcast",
        recv.read(),
        encode_all(dtype, (0..count).map(|i| value(root, i))),
    );

    let recv = device::Buffer::zeroed(count * dtype.size());
    run(OpKind::Reduce, send.ptr(), recv.ptr(), root);
    if me == root {
        check(
            "reduce",
            recv.read(),
            encode_all(dtype, (0..count).map(sum)),
        );
    }

    let recv = device::Buffer::zeroed(n * count * dtype.size());
    run(OpKind::AllGather, send.ptr(), recv.ptr(), 0);
    let gathered = encode_all(
        dtype,
        (0..n).flat_map(|r| (0..count).map(move |i| value(r, i))),
    );
    check("allgather", recv.read(), gathered.clone());

    let big = device::Buffer::new(&mine(n));
    let recv = device::Buffer::zeroed(count * dtype.size());
    run(OpKind::ReduceScatter, big.ptr(), recv.ptr(), 0);
    check(
        "reduce_scatter",
        recv.read(),
        encode_all(dtype, (0..count).map(|i| sum(me * count + i))),
    );

    let recv = device::Buffer::zeroed(n * count * dtype.size());
    run(OpKind::Gather, send.ptr(), recv.ptr(), root);
    if me == root {
        check("gather", recv.read(), gathered);
    }

    let recv = device::Buffer::zeroed(count * dtype.size());
    run(OpKind::Scatter, big.ptr(), recv.ptr(), root);
    check(
        "scatter",
        recv.read(),
        encode_all(dtype, (0..count).map(|i| value(root, me * count + i))),
    );

    let recv = device::Buffer::zeroed(n * count * dtype.size());
    run(OpKind::AllToAll, big.ptr(), recv.ptr(), 0);
    check(
        "alltoall",
        recv.read(),
        encode_all(
            dtype,
            (0..n).flat_map(|r| (0..count).map(move |i| value(r, me * count + i))),
        ),
    );

    // A ring of sends and receives in one group.
    let recv = device::Buffer::zeroed(count * dtype.size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    rdist::internals::group::start();
    let s = Call::new(
        OpKind::Send,
        send.ptr(),
        std::ptr::null_mut(),
        data,
        ReduceOp::Sum,
        next as i64,
        me,
        n,
    )
    .unwrap();
    let r = Call::recv(recv.ptr(), data, prev as i64, n).unwrap();
    // SAFETY: buffers alive until the group ends and the stream is synced.
    unsafe {
        comm.run_on(s, Stream(stream)).unwrap();
        comm.run_on(r, Stream(stream)).unwrap();
        rdist::internals::group::end()
            .unwrap_or_else(|e| panic!("rank {me}: send/recv group: {e}"));
    }
    device::sync(stream);
    check(
        "send/recv",
        recv.read(),
        encode_all(dtype, (0..count).map(|i| value(prev, i))),
    );

    comm.barrier()
        .unwrap_or_else(|e| panic!("rank {me}: barrier: {e}"));
    12
}

/// rdist_allreduce through the C ABI on device buffers, on a one-rank
/// NCCL communicator made with rdist_comm_init_rank.
fn c_abi_allreduce_on_device(stream: usize) {
    use rdist::ffi::{comm::*, options::*, types::*};
    let mut id = rdist_unique_id_t { internal: [0; 128] };
    assert_eq!(rdist_get_unique_id(&mut id), rdist_result_t::RDIST_SUCCESS);
    let mut opts = std::ptr::null_mut();
    assert_eq!(
        rdist_options_create(&mut opts),
        rdist_result_t::RDIST_SUCCESS
    );
    assert_eq!(
        rdist_options_set(opts, c"backend".as_ptr(), c"nccl".as_ptr()),
        rdist_result_t::RDIST_SUCCESS
    );
    let mut comm = std::ptr::null_mut();
    assert_eq!(
        rdist_comm_init_rank(&mut comm, 1, id, 0, opts),
        rdist_result_t::RDIST_SUCCESS
    );
    let mut backend = rdist_backend_t::RDIST_BACKEND_AUTO;
    assert_eq!(
        rdist_comm_backend(comm, &mut backend),
        rdist_result_t::RDIST_SUCCESS
    );
    assert!(matches!(backend, rdist_backend_t::RDIST_BACKEND_NCCL));
    let send = device::Buffer::new(&encode_all(DType::Bfloat16, [1, 2, 3, 4]));
    let recv = device::Buffer::zeroed(8);
    let rc = rdist::ffi::collectives::rdist_allreduce(
        send.ptr().cast(),
        recv.ptr().cast(),
        4,
        DType::Bfloat16 as i32,
        ReduceOp::Max as i32,
        comm,
        stream as *mut std::ffi::c_void,
    );
    assert_eq!(rc, rdist_result_t::RDIST_SUCCESS);
    device::sync(stream);
    assert_eq!(recv.read(), encode_all(DType::Bfloat16, [1, 2, 3, 4]));
    assert_eq!(rdist_comm_destroy(comm), rdist_result_t::RDIST_SUCCESS);
    rdist_options_destroy(opts);
}

/// An in-place float32 sum of `count` elements of `buf` on a one-rank
/// communicator.
fn in_place_sum(buf: &device::Buffer, count: usize) -> Call {
    let data = Data {
        count,
        dtype: DType::Float32,
    };
    Call::new(
        OpKind::AllReduce,
        buf.ptr(),
        buf.ptr(),
        data,
        ReduceOp::Sum,
        0,
        0,
        1,
    )
    .unwrap()
}

fn options(pairs: &[(&str, &str)]) -> Options {
    let mut o = common::opts(10_000);
    for (k, v) in pairs {
        o.set(k, v).unwrap();
    }
    o
}

/// The doubles' `rdist_stub_stall_stream(stream, on)`, from the loaded
/// libcuda.so.1.
fn stub_stall_stream() -> unsafe extern "C" fn(*mut std::ffi::c_void, i32) {
    // SAFETY: looks up a library already loaded (RTLD_NOLOAD) and a symbol
    // the doubles export with this signature.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!lib.is_null(), "the CUDA doubles are not loaded");
        let f = libc::dlsym(lib, c"rdist_stub_stall_stream".as_ptr());
        assert!(!f.is_null(), "rdist_stub_stall_stream is missing");
        std::mem::transmute::<*mut std::ffi::c_void, unsafe extern "C" fn(*mut std::ffi::c_void, i32)>(
            f,
        )
    }
}

/// The doubles' count of pointer queries answered so far.
fn stub_pointer_queries() -> u64 {
    // SAFETY: as in `stub_stall_stream`; the symbol takes nothing and
    // returns an unsigned long.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!lib.is_null(), "the CUDA doubles are not loaded");
        let f = libc::dlsym(lib, c"rdist_stub_pointer_queries".as_ptr());
        assert!(!f.is_null(), "rdist_stub_pointer_queries is missing");
        let f = std::mem::transmute::<*mut std::ffi::c_void, unsafe extern "C" fn() -> libc::c_ulong>(
            f,
        );
        f() as u64
    }
}

/// A one-rank NCCL communicator on device 0 (made current), with
/// `timeout_ms` when given.
fn nccl_world_of_one(timeout_ms: Option<&str>) -> Comm {
    device::use_device(0);
    let mut pairs = vec![("backend", "nccl")];
    pairs.extend(timeout_ms.map(|t| ("timeout_ms", t)));
    Comm::init_rank(&Comm::unique_id().unwrap(), 0, 1, &options(&pairs)).unwrap()
}

/// Not a test of its own: the body of the child processes the tests
/// start (does nothing without RDIST_TEST_ROLE).
#[test]
fn worker_process() {
    let Ok(role) = std::env::var("RDIST_TEST_ROLE") else {
        return;
    };
    match role.as_str() {
        // World 1 on NCCL: every collective and dtype on device buffers.
        "nccl_world1" => {
            let comm = nccl_world_of_one(None);
            assert_eq!(comm.backend(), Backend::Nccl);
            let stream = device::stream();
            let mut calls = 0;
            for dtype in DType::ALL {
                for count in [0, 1, 1000] {
                    calls += every_collective(&comm, dtype, count, stream);
                }
            }
            // A non-blocking twin on device buffers (no stream: the default
            // stream, finished when the request completes).
            let send = device::Buffer::new(&encode_all(DType::Float32, [3, 4, 5]));
            let recv = device::Buffer::zeroed(12);
            let call = Call::new(
                OpKind::AllReduce,
                send.ptr(),
                recv.ptr(),
                Data {
                    count: 3,
                    dtype: DType::Float32,
                },
                ReduceOp::Avg,
                0,
                0,
                1,
            )
            .unwrap();
            // SAFETY: buffers alive until the request completes.
            let req = unsafe { comm.submit(call) }.unwrap();
            req.wait().unwrap();
            assert_eq!(recv.read(), encode_all(DType::Float32, [3, 4, 5]));
            // Through the C ABI, with a stream.
            c_abi_allreduce_on_device(stream);
            // Split: NCCL's communicator splits too.
            let sub = comm.split(7, 0).unwrap().expect("a color");
            assert_eq!(sub.backend(), Backend::Nccl);
            let both = device::Buffer::new(&encode_all(DType::Int64, [9, 8]));
            let call = Call::new(
                OpKind::Broadcast,
                both.ptr(),
                both.ptr(),
                Data {
                    count: 2,
                    dtype: DType::Int64,
                },
                ReduceOp::Sum,
                0,
                0,
                1,
            )
            .unwrap();
            // SAFETY: the buffer is alive until the stream is synchronised.
            unsafe { sub.run_on(call, Stream(stream)) }.unwrap();
            device::sync(stream);
            assert_eq!(both.read(), encode_all(DType::Int64, [9, 8]));
            // Shrink: the survivors (here, this rank alone) get NCCL's
            // communicator made anew, and device work goes on on it.
            let shrunk = comm.shrink(&[], false, None).unwrap();
            assert_eq!(shrunk.backend(), Backend::Nccl);
            // SAFETY: as above.
            unsafe { shrunk.run_on(call, Stream(stream)) }.unwrap();
            device::sync(stream);
            assert_eq!(both.read(), encode_all(DType::Int64, [9, 8]));
            drop(shrunk);
            // One group over two NCCL communicators (enqueued in group
            // order on this thread).
            let a = device::Buffer::new(&encode_all(DType::Float32, [1, 2]));
            let b = device::Buffer::new(&encode_all(DType::Float32, [3, 4]));
            rdist::internals::group::start();
            // SAFETY: buffers alive until the stream is synchronised.
            unsafe {
                comm.run_on(in_place_sum(&a, 2), Stream(stream)).unwrap();
                sub.run_on(in_place_sum(&b, 2), Stream(stream)).unwrap();
                rdist::internals::group::end().unwrap();
            }
            device::sync(stream);
            assert_eq!(a.read(), encode_all(DType::Float32, [1, 2]));
            assert_eq!(b.read(), encode_all(DType::Float32, [3, 4]));
            drop(sub);
            // A barrier grouped with device calls joins NCCL's group.
            let buf = device::Buffer::new(&encode_all(DType::Float32, [6, 7]));
            rdist::internals::group::start();
            // SAFETY: the buffer is alive until the group ends and the
            // stream is synchronised.
            unsafe {
                comm.run_on(in_place_sum(&buf, 2), Stream(stream)).unwrap();
                comm.run_on(Call::Barrier, Stream(stream)).unwrap();
                rdist::internals::group::end().unwrap();
            }
            device::sync(stream);
            assert_eq!(buf.read(), encode_all(DType::Float32, [6, 7]));
            // Host buffers on the same communicator run on the sockets.
            let mut host = [1.5f32, 2.5];
            comm.allreduce(&mut host, ReduceOp::Sum).unwrap();
            assert_eq!(host, [1.5, 2.5]);
            println!("CALLS {calls}");
        }
        // A group over two NCCL communicators, the first with a
        // non-blocking call still running (the doubles stall the default
        // stream it waits on, for 300 ms).
        // The engine numbers and traces every call, NCCL's included: a
        // device allreduce (NCCL), a host allreduce (sockets), a barrier
        // (NCCL), written to RDIST_TEST_TRACE at destroy.
        "nccl_trace" => {
            device::use_device(0);
            let path = std::env::var("RDIST_TEST_TRACE").unwrap();
            let o = options(&[("backend", "nccl"), ("trace_file", &path)]);
            let comm = Comm::init_rank(&Comm::unique_id().unwrap(), 0, 1, &o).unwrap();
            assert_eq!(comm.backend(), Backend::Nccl);
            let buf = device::Buffer::new(&encode_all(DType::Float32, [1, 2, 3]));
            // SAFETY: the buffer outlives the stream's work (synchronised below).
            unsafe { comm.run_on(in_place_sum(&buf, 3), Stream(device::stream())) }.unwrap();
            device::sync(device::stream());
            let mut host = [1.0f32; 4];
            comm.allreduce(&mut host, ReduceOp::Sum).unwrap();
            comm.barrier().unwrap();
            drop(comm);
        }
        "group_behind_queued_work" => {
            let first = nccl_world_of_one(None);
            let second = first.split(0, 0).unwrap().expect("a color");
            let stall = stub_stall_stream();
            let queued = device::Buffer::zeroed(4);
            // SAFETY: a helper of the doubles; NULL is the default stream.
            unsafe { stall(std::ptr::null_mut(), 1) };
            // SAFETY: the buffer outlives the request (waited below).
            let req = unsafe { first.submit(in_place_sum(&queued, 1)) }.unwrap();
            let stream = device::stream();
            let (a, b) = (device::Buffer::zeroed(4), device::Buffer::zeroed(4));
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    // SAFETY: as above.
                    unsafe { stall(std::ptr::null_mut(), 0) };
                });
                rdist::internals::group::start();
                // SAFETY: buffers alive until the stream is synchronised.
                unsafe {
                    first.run_on(in_place_sum(&a, 1), Stream(stream)).unwrap();
                    second.run_on(in_place_sum(&b, 1), Stream(stream)).unwrap();
                    rdist::internals::group::end().unwrap();
                }
            });
            req.wait().unwrap();
            device::sync(stream);
            println!("DONE");
        }
        // A held non-blocking receive, then a group with the matching
        // send (to self, the one rank): they must run as one exchange.
        "irecv_then_group_send" => {
            let comm = nccl_world_of_one(Some("3000"));
            let stream = device::stream();
            let src = device::Buffer::new(&encode_all(DType::Int32, [5, 6, 7]));
            let dst = device::Buffer::zeroed(12);
            let data = Data {
                count: 3,
                dtype: DType::Int32,
            };
            // SAFETY: both buffers outlive the request and the group.
            let recv = unsafe { comm.submit(Call::recv(dst.ptr(), data, 0, 1).unwrap()) }.unwrap();
            let send = Call::new(
                OpKind::Send,
                src.ptr(),
                std::ptr::null_mut(),
                data,
                ReduceOp::Sum,
                0,
                0,
                1,
            )
            .unwrap();
            rdist::internals::group::start();
            // SAFETY: as above.
            let grouped = unsafe {
                comm.run_on(send, Stream(stream)).unwrap();
                rdist::internals::group::end()
            };
            let waited = recv.wait();
            device::sync(stream);
            match (grouped, waited) {
                (Ok(()), Ok(())) => println!(
                    "RESULT {}",
                    dst.read() == encode_all(DType::Int32, [5, 6, 7])
                ),
                (g, w) => println!("RESULT error {g:?} {w:?}"),
            }
        }
        // Host buffers on threads with no CUDA context current.
        "host_without_context" => {
            common::world(
                2,
                options(&[("backend", "socket")]),
                Duration::from_secs(50),
                |comm| {
                    let mut v = vec![comm.rank() as i32 + 1; 1000];
                    comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                    assert!(v.iter().all(|x| *x == 3));
                },
            );
            println!("DONE");
        }
        // Host buffers on the stack and in the brk heap: told apart with
        // no pointer query; a device buffer still asks.
        "host_without_query" => {
            common::world(
                2,
                options(&[("backend", "socket")]),
                Duration::from_secs(50),
                |comm| {
                    let before = stub_pointer_queries();
                    for _ in 0..100 {
                        let mut v = [comm.rank() as i32 + 1; 16];
                        comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                        assert!(v.iter().all(|x| *x == 3));
                    }
                    // The heap's last byte, as a send's buffer (the main
                    // thread, which alone allocates there, waits).
                    // SAFETY: reads the break.
                    let heap_end = unsafe { libc::sbrk(0) } as usize;
                    let byte = (heap_end - 1) as *const u8;
                    let peer = 1 - comm.rank();
                    let mut got = [0u8; 1];
                    // SAFETY: the last byte of the brk heap is mapped
                    // (malloc's); it is only read.
                    let last = unsafe { std::slice::from_raw_parts(byte, 1) };
                    if comm.rank() == 0 {
                        comm.send(last, peer).unwrap();
                        comm.recv(&mut got, peer).unwrap();
                    } else {
                        comm.recv(&mut got, peer).unwrap();
                        comm.send(last, peer).unwrap();
                    }
                    let queries = stub_pointer_queries() - before;
                    println!("rank {}: {queries} pointer queries", comm.rank());
                },
            );
            let comm = nccl_world_of_one(None);
            let buf = device::Buffer::new(&encode_all(DType::Float32, [1, 2, 3]));
            let before = stub_pointer_queries();
            // SAFETY: the buffer outlives the stream's work (synchronised below).
            unsafe { comm.run_on(in_place_sum(&buf, 3), Stream(device::stream())) }.unwrap();
            device::sync(device::stream());
            println!(
                "device buffer: {} pointer queries",
                stub_pointer_queries() - before
            );
            println!("DONE");
        }
        // N ranks (threads) on sockets with device buffers: staged.
        "socket_world" => {
            let n: usize = std::env::var("RANKS").unwrap().parse().unwrap();
            common::world(
                n,
                options(&[("backend", "socket")]),
                Duration::from_secs(50),
                |comm| {
                    device::use_device(0);
                    assert_eq!(comm.backend(), Backend::Socket);
                    let stream = device::stream();
                    for dtype in [
                        DType::Float32,
                        DType::Int8,
                        DType::Bfloat16,
                        DType::Float16,
                        DType::Uint64,
                    ] {
                        for count in [0, 1, 3, 5000] {
                            every_collective(&comm, dtype, count, stream);
                        }
                    }
                    // Mixed: host input, device output.
                    let host = encode_all(DType::Int32, (0..4).map(|i| value(comm.rank(), i)));
                    let out = device::Buffer::zeroed(16);
                    let call = Call::new(
                        OpKind::AllReduce,
                        host.as_ptr(),
                        out.ptr(),
                        Data {
                            count: 4,
                            dtype: DType::Int32,
                        },
                        ReduceOp::Max,
                        0,
                        comm.rank(),
                        comm.size(),
                    )
                    .unwrap();
                    // SAFETY: buffers alive for the call.
                    unsafe { comm.run_on(call, Stream(stream)) }.unwrap();
                    let n = comm.size();
                    let want = encode_all(
                        DType::Int32,
                        (0..4).map(|i| (0..n).map(|r| value(r, i)).max().unwrap()),
                    );
                    assert_eq!(out.read(), want, "mixed host/device allreduce");
                },
            );
            println!("DONE");
        }
        // backend=auto with the doubles: NCCL for one rank per device.
        "auto" => {
            let mut code = -1;
            let rc = rdist::ffi::version::rdist_nccl_version(&mut code);
            println!("C_VERSION {} {code}", rc as i32);
            let comm = Comm::init_rank(
                &Comm::unique_id().unwrap(),
                0,
                1,
                &options(&[("debug", "INFO")]),
            )
            .unwrap();
            println!("BACKEND {:?}", comm.backend());
        }
        // Two ranks (threads), one NCCL each, or refusing it together.
        "two_ranks" => {
            // One backend for both ranks, or one each ("auto,socket").
            let backends: Vec<String> = std::env::var("BACKEND")
                .unwrap()
                .split(',')
                .map(str::to_string)
                .collect();
            let id = Comm::unique_id().unwrap();
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let backend = backends[rank as usize % backends.len()].clone();
                    std::thread::spawn(move || {
                        let mut o = options(&[("backend", &backend), ("debug", "INFO")]);
                        o.set("timeout_ms", "10000").unwrap();
                        // Two local ranks: local ranks 0 and 1 (devices 0 and 1).
                        match Comm::init_rank(&id, rank, 2, &o) {
                            Ok(c) => format!("rank {rank} {:?}", c.backend()),
                            Err(e) => format!("rank {rank} error {:?} {}", e.kind(), e.message()),
                        }
                    })
                })
                .collect();
            for h in handles {
                println!("RESULT {}", h.join().unwrap());
            }
        }
        // Two NCCL ranks passing different kinds of memory to one call:
        // rank 0 host buffers (sockets), rank 1 device buffers (NCCL).
        "kinds_differ" => {
            let id = Comm::unique_id().unwrap();
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    std::thread::spawn(move || {
                        device::use_device(rank as i32);
                        let o = options(&[("backend", "nccl"), ("timeout_ms", "1500")]);
                        let comm = Comm::init_rank(&id, rank, 2, &o).unwrap();
                        if rank == 0 {
                            let mut host = vec![1i32; 4];
                            let e = comm.allreduce(&mut host, ReduceOp::Sum).unwrap_err();
                            println!("RANK0 {:?} {}", e.kind(), e.message());
                        } else {
                            let buf = device::Buffer::zeroed(16);
                            let data = Data {
                                count: 4,
                                dtype: DType::Int32,
                            };
                            let call = Call::new(
                                OpKind::AllReduce,
                                buf.ptr(),
                                buf.ptr(),
                                data,
                                ReduceOp::Sum,
                                0,
                                1,
                                2,
                            )
                            .unwrap();
                            // SAFETY: the buffer outlives the (simulated) work.
                            let _ = unsafe { comm.run_on(call, Stream::DEFAULT) };
                            // Still there when rank 0 times out.
                            std::thread::sleep(Duration::from_secs(3));
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        }
        // NCCL work that never finishes on the GPU: the watchdog aborts it.
        "stall" => {
            let comm = nccl_world_of_one(Some("1500"));
            let stream = device::stream();
            let buf = device::Buffer::zeroed(64);
            let call = in_place_sum(&buf, 16);
            let started = Instant::now();
            // SAFETY: the buffer outlives the communicator's work (aborted).
            unsafe { comm.run_on(call, Stream(stream)) }.expect("enqueueing succeeds");
            // The next call fails once the watchdog gave up on the first.
            let err = loop {
                std::thread::sleep(Duration::from_millis(100));
                // SAFETY: as above.
                if let Err(e) = unsafe { comm.run_on(call, Stream(stream)) } {
                    break e;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "no timeout after 10 s"
                );
            };
            println!("KIND {:?}", err.kind());
            println!("ERROR {}", err.message());
            println!("AFTER {:.1}", started.elapsed().as_secs_f64());
        }
        // A burst of calls whose last one stalls, and then nothing: the
        // watchdog must still see the last one (the calls share events).
        "stall_last" => {
            let comm = nccl_world_of_one(Some("1500"));
            let stream = device::stream();
            let buf = device::Buffer::zeroed(64);
            let call = in_place_sum(&buf, 16);
            let burst: usize = std::env::var("BURST").unwrap().parse().unwrap();
            let started = Instant::now();
            for _ in 0..burst {
                // SAFETY: the buffer outlives the communicator's work.
                unsafe { comm.run_on(call, Stream(stream)) }.expect("enqueueing succeeds");
            }
            println!("BURST {:.6}", started.elapsed().as_secs_f64());
            // No call after the burst: only the watchdog can notice.
            std::thread::sleep(Duration::from_millis(3000));
            // SAFETY: as above.
            let err =
                unsafe { comm.run_on(call, Stream(stream)) }.expect_err("the watchdog failed it");
            println!("KIND {:?}", err.kind());
            println!("ERROR {}", err.message());
        }
        // An asynchronous NCCL error (the doubles inject a remote error).
        "async_error" => {
            let comm = nccl_world_of_one(None);
            let buf = device::Buffer::zeroed(64);
            let call = in_place_sum(&buf, 16);
            // SAFETY: the buffer outlives the call.
            let first = unsafe { comm.run_on(call, Stream::DEFAULT) };
            let started = Instant::now();
            let err = loop {
                // SAFETY: as above.
                if let Err(e) = unsafe { comm.run_on(call, Stream::DEFAULT) } {
                    break e;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "no error after 10 s"
                );
                std::thread::sleep(Duration::from_millis(50));
            };
            println!("FIRST {}", first.is_ok());
            println!("KIND {:?}", err.kind());
            println!("ERROR {}", err.message());
        }
        // Two ranks (processes), NCCL work stalled; rank 1 dies.
        "peer_dies" => {
            let rank: i64 = std::env::var("RANK").unwrap().parse().unwrap();
            let port = std::env::var("PORT").unwrap();
            device::use_device(rank as i32);
            let comm = Comm::init(
                &format!("tcp://127.0.0.1:{port}"),
                rank,
                2,
                &options(&[("backend", "nccl"), ("timeout_ms", "30000")]),
            )
            .unwrap();
            let buf = device::Buffer::zeroed(64);
            let call = in_place_sum(&buf, 16);
            let started = Instant::now();
            // SAFETY: the buffer outlives the (aborted) work.
            unsafe { comm.run_on(call, Stream::DEFAULT) }.expect("enqueueing succeeds");
            if rank == 1 {
                // Dies with its work in flight: no destructor runs.
                std::process::exit(0);
            }
            let err = loop {
                std::thread::sleep(Duration::from_millis(50));
                // SAFETY: as above.
                if let Err(e) = unsafe { comm.run_on(call, Stream::DEFAULT) } {
                    break e;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(25),
                    "no error after 25 s"
                );
            };
            println!("KIND {:?}", err.kind());
            println!("ERROR {}", err.message());
            println!("AFTER {:.1}", started.elapsed().as_secs_f64());
        }
        // rdist_comm_abort on an NCCL communicator.
        "abort" => {
            let comm = nccl_world_of_one(None);
            comm.abort();
            let buf = device::Buffer::zeroed(4);
            let call = in_place_sum(&buf, 1);
            // SAFETY: the buffer outlives the call.
            let err = unsafe { comm.run_on(call, Stream::DEFAULT) }.unwrap_err();
            println!("KIND {:?}", err.kind());
        }
        // rdist_comm_abort from another thread while a barrier waits for
        // NCCL work that cannot finish (the doubles stall it).
        "abort_during_wait" => {
            let comm = nccl_world_of_one(Some("30000"));
            let started = Instant::now();
            let waited = std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    comm.abort();
                });
                comm.barrier()
            });
            match waited {
                Ok(()) => println!("KIND none: the aborted barrier returned Ok"),
                Err(e) => println!("KIND {:?}", e.kind()),
            }
            println!("AFTER {:.1}", started.elapsed().as_secs_f64());
        }
        // rdist_comm_abort from another thread while a call is stuck
        // inside NCCL (the doubles block it until an abort).
        "abort_stuck_call" => {
            let comm = nccl_world_of_one(Some("30000"));
            let buf = device::Buffer::zeroed(4);
            let started = Instant::now();
            let ran = std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    comm.abort();
                    println!("ABORTED {:.1}", started.elapsed().as_secs_f64());
                });
                // SAFETY: the buffer outlives the communicator's work.
                unsafe { comm.run_on(in_place_sum(&buf, 1), Stream::DEFAULT) }
            });
            match ran {
                Ok(()) => println!("KIND none: the stuck call returned Ok"),
                Err(e) => println!("KIND {:?}", e.kind()),
            }
            println!("AFTER {:.1}", started.elapsed().as_secs_f64());
        }
        other => panic!("unknown role {other}"),
    }
}

/// The number after "`key` " in a role's output (the test harness may
/// print its own text before it on the line).
fn number_after(text: &str, key: &str) -> f64 {
    text.lines()
        .find_map(|l| l.split_once(&format!("{key} ")).map(|x| x.1))
        .unwrap_or_else(|| panic!("no {key} in:\n{text}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{key}: {e} in:\n{text}"))
}

/// Lines of the doubles' log from NCCL naming `event`.
fn nccl_lines<'a>(log: &'a str, event: &str) -> Vec<&'a str> {
    log.lines()
        .filter(|l| l.starts_with("nccl ") && l.split_whitespace().any(|w| w == event))
        .collect()
}

#[test]
fn world_of_one_runs_every_collective_and_dtype_on_nccl() {
    let (out, log) = run_role("nccl_world1", &[], true);
    let calls: usize = stdout(&out)
        .lines()
        .find_map(|l| l.split_once("CALLS ").map(|x| x.1))
        .expect("CALLS line")
        .parse()
        .unwrap();
    assert_eq!(calls, 12 * DType::ALL.len() * 3);
    // Device buffers went to NCCL, on non-blocking communicators (the
    // Rust API's and the C ABI's).
    let inits = nccl_lines(&log, "init");
    assert_eq!(inits.len(), 2, "{log}");
    assert!(inits.iter().all(|l| l.contains("blocking=0")), "{log}");
    for op in [
        "ncclAllReduce",
        "ncclBroadcast",
        "ncclReduce",
        "ncclAllGather",
        "ncclReduceScatter",
        "ncclSend",
        "ncclRecv",
    ] {
        assert!(
            !nccl_lines(&log, op).is_empty(),
            "no {op} in the NCCL log:\n{log}"
        );
    }
    // On the caller's stream (not only the default one).
    assert!(
        nccl_lines(&log, "ncclAllReduce")
            .iter()
            .any(|l| !l.contains("stream=(nil)") && !l.contains("stream=0x0 ")),
        "{log}"
    );
    // NCCL reported no error to any call (0 success, 7 in progress).
    for l in log.lines().filter(|l| l.starts_with("nccl ")) {
        let rc = l.split_whitespace().find_map(|w| w.strip_prefix("result="));
        assert!(
            matches!(rc, None | Some("0") | Some("7")),
            "NCCL failed a call: {l}"
        );
    }
    // Split, and a healthy shrink by NCCL's own ncclCommShrink; every
    // communicator finalized and destroyed at the end, none aborted: the
    // main one, the C ABI's, the split's and the shrink's.
    assert_eq!(nccl_lines(&log, "split").len(), 1, "{log}");
    let shrinks = nccl_lines(&log, "shrink");
    assert_eq!(shrinks.len(), 1, "{log}");
    assert!(shrinks[0].contains("result=7"), "{log}");
    assert_eq!(nccl_lines(&log, "destroy").len(), 4, "{log}");
    assert!(nccl_lines(&log, "abort").is_empty(), "{log}");
}

#[test]
fn a_shrink_whose_ncclcommshrink_fails_makes_a_new_nccl_communicator() {
    let (_, log) = run_role(
        "nccl_world1",
        &[("RDIST_STUB_NCCL_SHRINK_FAILS", "1")],
        true,
    );
    let shrinks = nccl_lines(&log, "shrink");
    assert_eq!(shrinks.len(), 1, "{log}");
    assert!(shrinks[0].contains("result=3"), "{log}");
    // The survivors' communicator made anew: a third init, device work on it.
    assert_eq!(nccl_lines(&log, "init").len(), 3, "{log}");
}

#[test]
fn every_call_is_numbered_and_traced_on_nccl_and_sockets_alike() {
    let trace = std::env::temp_dir().join(format!("rdist-nccl-trace-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&trace);
    run_role(
        "nccl_trace",
        &[("RDIST_TEST_TRACE", trace.to_str().unwrap())],
        true,
    );
    let text = std::fs::read_to_string(&trace).unwrap();
    let _ = std::fs::remove_file(&trace);
    // One event per call, in order, with consecutive sequence numbers
    // whichever backend ran it.
    let events: Vec<(String, u64)> = text
        .lines()
        .filter(|l| l.contains("\"ph\":\"X\""))
        .map(|l| {
            let name = l
                .split("\"name\":\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            let seq = l
                .split("\"seq\":")
                .nth(1)
                .unwrap()
                .split(',')
                .next()
                .unwrap();
            (name.to_string(), seq.parse().unwrap())
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["allreduce", "allreduce", "barrier"], "{text}");
    let first = events[0].1;
    let seqs: Vec<u64> = events.iter().map(|e| e.1).collect();
    assert_eq!(seqs, [first, first + 1, first + 2], "{text}");
    assert!(
        text.contains("\"bytes\":12") && text.contains("\"bytes\":16"),
        "{text}"
    );
}

#[test]
fn device_buffers_on_the_socket_backend_are_staged_through_host_memory() {
    for ranks in ["2", "3"] {
        let (out, log) = run_role("socket_world", &[("RANKS", ranks)], true);
        assert!(stdout(&out).contains("DONE"));
        // No NCCL communicator was made; data crossed through host copies.
        assert!(nccl_lines(&log, "init").is_empty(), "{log}");
        assert!(
            log.lines()
                .any(|l| l.starts_with("cuda ") && l.contains("DtoH")),
            "{log}"
        );
    }
}

#[test]
fn buffers_are_told_apart_where_the_driver_lacks_a_pointer_attribute() {
    // A driver without CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL (9) fails the
    // whole attribute list; rdist asks one attribute at a time. Taking
    // device buffers for host ones would crash the staging test (the
    // doubles' device memory is inaccessible to the CPU), and NCCL would
    // get none.
    let env = [("RDIST_STUB_UNSUPPORTED_ATTRIBUTE", "9"), ("RANKS", "2")];
    let (out, log) = run_role("socket_world", &env, true);
    assert!(stdout(&out).contains("DONE"));
    assert!(
        log.lines()
            .any(|l| l.starts_with("cuda ") && l.contains("DtoH")),
        "{log}"
    );
    let (_, log) = run_role("nccl_world1", &env[..1], true);
    assert!(!nccl_lines(&log, "ncclAllReduce").is_empty(), "{log}");
}

#[test]
fn a_group_enqueues_in_its_order_behind_queued_work() {
    // Every rank must put the group's kernels on the shared stream in the
    // group's order, whatever work is still queued: the first
    // communicator's allreduce before the second's.
    let (out, log) = run_role("group_behind_queued_work", &[], true);
    assert!(stdout(&out).contains("DONE"), "{}", stderr(&out));
    let comm_of = |l: &str| {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix("comm="))
            .map(str::to_string)
    };
    let first = comm_of(nccl_lines(&log, "init")[0]).expect("init names its comm");
    let on_stream: Vec<String> = nccl_lines(&log, "ncclAllReduce")
        .into_iter()
        .filter(|l| !l.contains("stream=(nil)"))
        .filter_map(comm_of)
        .collect();
    assert_eq!(on_stream.len(), 2, "{log}");
    assert_eq!(
        on_stream[0], first,
        "the second communicator went first:\n{log}"
    );
}

#[test]
fn a_held_receive_and_a_grouped_send_run_together() {
    let (out, log) = run_role("irecv_then_group_send", &[], true);
    assert!(
        stdout(&out).contains("RESULT true"),
        "{}\n{log}",
        stdout(&out)
    );
}

#[test]
fn host_buffers_are_told_apart_on_a_thread_with_no_context() {
    // A driver that answers pointer queries only in a context: rdist asks
    // again in device 0's primary context.
    let env = [("RDIST_STUB_POINTER_NEEDS_CONTEXT", "1")];
    let (out, _) = run_role("host_without_context", &env, true);
    assert!(stdout(&out).contains("DONE"), "{}", stderr(&out));
}

#[test]
fn host_buffers_on_the_stack_and_the_heap_ask_the_driver_nothing() {
    // With a device present, every buffer's kind was asked of the driver
    // (a query per buffer, per call); a stack or brk-heap address never
    // holds device memory.
    let (out, _) = run_role("host_without_query", &[], true);
    let text = stdout(&out);
    assert!(text.contains("DONE"), "{text}\n{}", stderr(&out));
    for r in 0..2 {
        assert!(
            text.contains(&format!("rank {r}: 0 pointer queries")),
            "{text}"
        );
    }
    // Once: an in-place call's buffer is asked about once.
    assert!(
        text.contains("device buffer: 1 pointer queries"),
        "a device buffer is asked about, once: {text}"
    );
}

#[test]
fn auto_picks_nccl_when_every_rank_has_a_device() {
    let (out, _) = run_role("auto", &[], true);
    assert!(stdout(&out).contains("BACKEND Nccl"), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("C_VERSION 0 22105"),
        "{}",
        stdout(&out)
    );
    let err = stderr(&out);
    assert!(err.contains("NCCL 2.21.5 from"), "{err}");
    assert!(err.contains("device buffers run on NCCL"), "{err}");

    let (out, _) = run_role("auto", &[("RDIST_STUB_DEVICES", "0")], true);
    assert!(stdout(&out).contains("BACKEND Socket"), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("NCCL unavailable: no CUDA device; using sockets"),
        "{}",
        stderr(&out)
    );

    // NCCL_COMM_BLOCKING=1 would make NCCL block past the timeout.
    let (out, log) = run_role("auto", &[("NCCL_COMM_BLOCKING", "1")], true);
    assert!(stdout(&out).contains("BACKEND Socket"), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("NCCL unavailable: NCCL_COMM_BLOCKING=1 is set"),
        "{}",
        stderr(&out)
    );
    assert!(nccl_lines(&log, "init").is_empty(), "{log}");
}

#[test]
fn two_ranks_share_one_unique_id_or_agree_to_fall_back() {
    // Two devices: one NCCL communicator per rank, on devices 0 and 1,
    // from the same unique id.
    let (out, log) = run_role(
        "two_ranks",
        &[("BACKEND", "nccl"), ("RDIST_STUB_DEVICES", "2")],
        true,
    );
    let text = stdout(&out);
    assert!(
        text.contains("RESULT rank 0 Nccl") && text.contains("RESULT rank 1 Nccl"),
        "{text}\n{}",
        stderr(&out)
    );
    let inits = nccl_lines(&log, "init");
    assert_eq!(inits.len(), 2, "{log}");
    let id = |l: &str| {
        l.split_whitespace()
            .find(|w| w.starts_with("id="))
            .map(str::to_string)
    };
    assert!(
        id(inits[0]).is_some() && id(inits[0]) == id(inits[1]),
        "{log}"
    );
    assert!(
        inits.iter().any(|l| l.contains("device=0"))
            && inits.iter().any(|l| l.contains("device=1")),
        "{log}"
    );

    // One device: rank 1 has none of its own. auto: both fall back, each
    // saying why; nccl: both fail with Unavailable.
    let (out, log) = run_role(
        "two_ranks",
        &[("BACKEND", "auto"), ("RDIST_STUB_DEVICES", "1")],
        true,
    );
    let text = stdout(&out);
    assert!(
        text.contains("RESULT rank 0 Socket") && text.contains("RESULT rank 1 Socket"),
        "{text}"
    );
    let err = stderr(&out);
    assert!(err.contains("local rank 1 has no GPU of its own"), "{err}");
    assert!(err.contains("rank 1 cannot run it"), "{err}");
    assert!(nccl_lines(&log, "init").is_empty(), "{log}");

    // Two devices, but rank 1 asks for sockets: it still answers rank
    // 0's question (rank 0 would otherwise wait for it until the
    // timeout), and both run on sockets at once.
    let started = std::time::Instant::now();
    let (out, log) = run_role(
        "two_ranks",
        &[("BACKEND", "auto,socket"), ("RDIST_STUB_DEVICES", "2")],
        true,
    );
    let text = stdout(&out);
    assert!(
        text.contains("RESULT rank 0 Socket") && text.contains("RESULT rank 1 Socket"),
        "{text}\n{}",
        stderr(&out)
    );
    assert!(started.elapsed() < Duration::from_secs(8), "{text}");
    assert!(
        stderr(&out).contains("rank 1 cannot run it"),
        "{}",
        stderr(&out)
    );
    assert!(nccl_lines(&log, "init").is_empty(), "{log}");

    let (out, _) = run_role(
        "two_ranks",
        &[("BACKEND", "nccl"), ("RDIST_STUB_DEVICES", "1")],
        true,
    );
    let text = stdout(&out);
    for rank in 0..2 {
        assert!(
            text.contains(&format!(
                "RESULT rank {rank} error Unavailable backend 'nccl' is unavailable"
            )),
            "{text}"
        );
    }
}

#[test]
fn ranks_passing_different_kinds_of_memory_are_told_why_they_timed_out() {
    let (out, _) = run_role("kinds_differ", &[("RDIST_STUB_DEVICES", "2")], true);
    let text = stdout(&out);
    assert!(text.contains("RANK0 Timeout"), "{text}\n{}", stderr(&out));
    assert!(
        text.contains("every rank must pass the same kind of memory"),
        "{text}"
    );
}

#[test]
fn a_stalled_nccl_operation_times_out_and_is_aborted() {
    let (out, log) = run_role("stall", &[("RDIST_STUB_NCCL_HANG", "1")], true);
    let text = stdout(&out);
    assert!(text.contains("KIND Timeout"), "{text}\n{}", stderr(&out));
    assert!(
        text.contains("allreduce") && text.contains("has not finished on the GPU"),
        "{text}"
    );
    let after = number_after(&text, "AFTER");
    assert!(
        (1.4..6.0).contains(&after),
        "timed out after {after} s (timeout 1.5 s)"
    );
    let aborts = nccl_lines(&log, "abort");
    assert_eq!(aborts.len(), 1, "ncclCommAbort must be called once:\n{log}");
    assert!(aborts[0].contains("result=0"), "{log}");
}

#[test]
fn the_last_of_a_burst_of_calls_is_watched_too() {
    // Calls close together share one watched event (re-recorded for each):
    // a stall in the last of them, with no call after it, still times out.
    let burst = 40;
    let (out, log) = run_role(
        "stall_last",
        &[
            ("RDIST_STUB_NCCL_HANG", &format!("from:{burst}")),
            ("BURST", &burst.to_string()),
        ],
        true,
    );
    let text = stdout(&out);
    assert!(text.contains("KIND Timeout"), "{text}\n{}", stderr(&out));
    assert!(text.contains("has not finished on the GPU"), "{text}");
    assert_eq!(nccl_lines(&log, "abort").len(), 1, "{log}");
    // A burst within the 1 ms a shared event covers shares events,
    // recorded again for each call after the first. How many share the
    // last one depends on when the watchdog looked: an event it found
    // complete between two records is retired, and the next call starts
    // another (seen once in a fresh clone's run: the last 32 shared one).
    let took = number_after(&text, "BURST");
    if took < 0.001 {
        let after = text
            .split("and the ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("the stalled call shares no event: {text}"));
        assert!((1..burst).contains(&after), "{text}");
    } else {
        println!("skipped: the shared-event check: the burst took {took:.4} s (> 1 ms) here");
    }
}

#[test]
fn an_asynchronous_nccl_error_is_reported_with_nccl_text() {
    let (out, log) = run_role("async_error", &[("RDIST_STUB_NCCL_ASYNC_ERROR", "6")], true);
    let text = stdout(&out);
    assert!(text.contains("KIND PeerLost"), "{text}\n{}", stderr(&out));
    assert!(text.contains("injected asynchronous error 6"), "{text}");
    assert_eq!(nccl_lines(&log, "abort").len(), 1, "{log}");
}

#[test]
fn comm_abort_aborts_nccl() {
    let (out, log) = run_role("abort", &[], true);
    assert!(stdout(&out).contains("KIND Aborted"), "{}", stdout(&out));
    assert_eq!(nccl_lines(&log, "abort").len(), 1, "{log}");
    assert!(
        nccl_lines(&log, "destroy").is_empty(),
        "an aborted communicator must not be destroyed:\n{log}"
    );
}

#[test]
fn an_abort_ends_a_blocked_call_with_an_error() {
    // An abort ends NCCL's kernels, so the wait sees them finish; the call
    // must still fail (its data is not the result), at once, not at the
    // 30 s timeout.
    let (out, log) = run_role("abort_during_wait", &[("RDIST_STUB_NCCL_HANG", "1")], true);
    let text = stdout(&out);
    assert!(text.contains("KIND Aborted"), "{text}\n{}", stderr(&out));
    let after = number_after(&text, "AFTER");
    assert!(after < 5.0, "the barrier ended {after} s after the start");
    assert_eq!(nccl_lines(&log, "abort").len(), 1, "{log}");
}

#[test]
fn an_abort_frees_a_call_stuck_inside_nccl() {
    // The stuck thread holds the communicator; the abort waits a grace
    // period for it, then goes ahead (only NCCL's abort flag frees it).
    let (out, log) = run_role(
        "abort_stuck_call",
        &[("RDIST_STUB_NCCL_ENQUEUE_BLOCK", "1")],
        true,
    );
    let text = stdout(&out);
    assert!(text.contains("KIND Aborted"), "{text}\n{log}");
    assert!(number_after(&text, "ABORTED") < 5.0, "{text}");
    assert!(number_after(&text, "AFTER") < 5.0, "{text}");
    assert_eq!(nccl_lines(&log, "blocked").len(), 1, "{log}");
    assert_eq!(nccl_lines(&log, "abort").len(), 1, "{log}");
}

#[test]
fn the_doubles_keep_device_memory_away_from_the_cpu() {
    // Guards the guard: if the doubles let the CPU read device memory, the
    // tests above could not catch rdist doing so.
    let dir = stub_dir();
    let out = Command::new(dir.join("smoke")).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A real CUDA device, or None after printing why the test skips.
fn real_device() -> Option<usize> {
    match rdist::internals::cuda::cuda_devices() {
        Ok(n) => Some(n),
        Err(why) => {
            eprintln!("skipped: no CUDA device ({why})");
            None
        }
    }
}

#[test]
fn real_gpu_world_of_one_runs_every_collective_and_dtype_on_nccl() {
    if real_device().is_none() {
        return;
    }
    let (out, _) = run_with(Libraries::Real, "nccl_world1", &[], true);
    eprintln!("{}", stdout(&out));
}

#[test]
fn real_gpu_ranks_sharing_one_device_stage_through_the_socket_backend() {
    if real_device().is_none() {
        return;
    }
    for ranks in ["2", "4"] {
        let (out, _) = run_with(Libraries::Real, "socket_world", &[("RANKS", ranks)], true);
        assert!(stdout(&out).contains("DONE"));
        eprintln!("{ranks} ranks on one GPU through sockets: every collective correct");
    }
}

#[test]
fn the_benchmark_compares_rdist_and_direct_nccl_on_device_buffers() {
    let dir = stub_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_rdistrun"))
        .args(["--nproc-per-node", "1", env!("CARGO_BIN_EXE_rdist-bench")])
        .args([
            "--device",
            "--nccl-direct",
            "--max-bytes",
            "4K",
            "--seconds",
            "0.01",
            "--reps",
            "1",
        ])
        .env("LD_LIBRARY_PATH", dir)
        .env("RDIST_NCCL_LIBRARY", dir.join("libnccl.so.2"))
        .env_remove("RDIST_BACKEND")
        .output()
        .unwrap();
    let text = stdout(&out);
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert!(text.contains("rdist backend nccl"), "{text}");
    // Sizes 8 B .. 2 KiB by 4 (up to 4 KiB): five rows, each with both
    // times and no wrong element.
    let rows: Vec<&str> = text.lines().filter(|l| !l.contains('#')).collect();
    assert_eq!(rows.len(), 5, "{text}");
    for row in rows {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols.last(), Some(&"0"), "{row}");
        assert_ne!(cols[cols.len() - 3], "-", "no direct NCCL time: {row}");
    }
}

#[test]
fn a_peer_dying_with_nccl_work_in_flight_is_found_within_seconds() {
    // The timeout is 30 s: the sockets, not the timeout, must end the wait.
    let port = common_port();
    let env = |rank: &'static str| {
        vec![
            ("RANK", rank.to_string()),
            ("PORT", port.to_string()),
            ("RDIST_STUB_DEVICES", "2".to_string()),
            ("RDIST_STUB_NCCL_HANG", "1".to_string()),
        ]
    };
    let spawn = |rank: &'static str| {
        let vars = env(rank);
        std::thread::spawn(move || {
            let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
            run_role("peer_dies", &vars, true)
        })
    };
    let (zero, one) = (spawn("0"), spawn("1"));
    let (out, log) = zero.join().unwrap();
    one.join().unwrap();
    let text = stdout(&out);
    assert!(text.contains("KIND PeerLost"), "{text}\n{}", stderr(&out));
    assert!(text.contains("rank 1's connection closed"), "{text}");
    let after = number_after(&text, "AFTER");
    assert!(after < 10.0, "found after {after} s");
    assert_eq!(nccl_lines(&log, "abort").len(), 1, "{log}");
}

fn common_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
