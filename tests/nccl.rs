//! The NCCL backend's CPU side: finding and loading NCCL's real library
//! (PyPI's nvidia-nccl-cu12, installed into build/nccl by scripts/setup.sh),
//! reading its version, `ncclGetUniqueId`, and choosing the backend when
//! NCCL cannot run (no GPU here): `auto` falls back to sockets with one
//! INFO line, `backend=nccl` fails with Unavailable and the reason.
//!
//! Tests that load NCCL, or that must not find it, run in a child process
//! (this binary re-run in a role): once a library named libnccl.so.2 is
//! loaded, the dynamic loader hands it to every later lookup by that name.
//! Each test is bounded in time.

mod common;

use rdist::internals::nccl::{self, loader};
use rdist::{Backend, Comm, ErrorKind, Options};
use std::ffi::{CStr, CString, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Where scripts/setup.sh installs the wheel (RDIST_TEST_NCCL_DIR, else
/// build/nccl in the crate).
fn wheel_dir() -> PathBuf {
    std::env::var_os("RDIST_TEST_NCCL_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("build/nccl"))
}

/// The wheel's libnccl.so.2, or None after printing why the test skips.
fn wheel_library() -> Option<PathBuf> {
    let lib = wheel_dir().join(loader::WHEEL_LIBRARY);
    if lib.is_file() {
        return Some(lib);
    }
    eprintln!(
        "skipped: NCCL not installed ({} is missing; scripts/setup.sh installs it)",
        lib.display()
    );
    None
}

/// Runs this test binary as `worker_process` in `role`, with `env` added
/// and RDIST_NCCL_LIBRARY / RDIST_DEBUG / RDIST_BACKEND cleared unless
/// given; fails past 60 s.
fn run_role(role: &str, env: &[(&str, &std::ffi::OsStr)]) -> Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "worker_process",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("RDIST_TEST_ROLE", role)
    .env_remove(loader::LIBRARY_ENV)
    .env_remove("RDIST_DEBUG")
    .env_remove("RDIST_BACKEND");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = common::output_within(&mut cmd, Duration::from_secs(60), &format!("role {role}"));
    assert!(
        out.status.success(),
        "role {role} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The text after `KEY ` on the line that starts with it.
fn field(out: &Output, key: &str) -> String {
    let text = String::from_utf8_lossy(&out.stdout);
    // (The first line printed follows the harness's "test ... " text.)
    text.lines()
        .find_map(|l| l.split_once(&format!("{key} ")).map(|x| x.1))
        .unwrap_or_else(|| {
            panic!(
                "no {key} line in:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
        .to_string()
}

/// An environment with no NCCL anywhere rdist looks for it (no
/// virtualenv, no python3 on PATH, HOME and PYENV_ROOT empty folders).
fn bare_env(dir: &Path) -> impl Fn(&str) -> Option<OsString> {
    let dir = dir.as_os_str().to_owned();
    move |k: &str| matches!(k, "HOME" | "PATH" | "PYENV_ROOT").then(|| dir.clone())
}

/// Not a test of its own: the body of the child processes the tests
/// start (does nothing without RDIST_TEST_ROLE).
#[test]
fn worker_process() {
    let Ok(role) = std::env::var("RDIST_TEST_ROLE") else {
        return;
    };
    match role.as_str() {
        // The search with nothing installed where it looks.
        "search_nothing" => {
            let dir = std::env::temp_dir().join(format!("rdist-nccl-bare-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let search = loader::Search::from_lookup(bare_env(&dir));
            let wheels: Vec<String> = search
                .candidates
                .iter()
                .filter_map(|c| match c {
                    loader::Candidate::Wheel(p) => Some(p.display().to_string()),
                    _ => None,
                })
                .collect();
            println!("WHEELS {}", wheels.join("|"));
            match search.load() {
                Ok(lib) => println!("FOUND {}", lib.path.display()),
                Err(e) => println!("ERROR {e}"),
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
        // RDIST_NCCL_LIBRARY (set by the parent), as rdist's own search.
        // rdist_nccl_version with RDIST_NCCL_LIBRARY naming nothing.
        "c_version_missing" => {
            let mut code = -1;
            let rc = rdist::ffi::version::rdist_nccl_version(&mut code);
            // SAFETY: rdist_last_error returns a NUL-terminated string.
            let why = unsafe { CStr::from_ptr(rdist::ffi::version::rdist_last_error()) };
            println!("C_VERSION {} {code}", rc as i32);
            println!("C_ERROR {}", why.to_string_lossy());
        }
        "load_explicit" => {
            report(loader::Search::from_env().load());
            // The same through the C API.
            let mut code = -1;
            let rc = rdist::ffi::version::rdist_nccl_version(&mut code);
            println!("C_VERSION {} {code}", rc as i32);
        }
        // A virtualenv holding the wheel: only the site-packages search.
        "load_from_venv" => {
            let dir = std::env::temp_dir().join(format!("rdist-nccl-venv-{}", std::process::id()));
            let lib_dir = dir.join("venv/lib/python3.12/site-packages/nvidia/nccl/lib");
            std::fs::create_dir_all(&lib_dir).unwrap();
            let real = std::env::var_os("RDIST_TEST_WHEEL_LIBRARY").unwrap();
            std::os::unix::fs::symlink(&real, lib_dir.join("libnccl.so.2")).unwrap();
            let env = bare_env(&dir);
            let venv = dir.join("venv").into_os_string();
            let search = loader::Search::from_lookup(move |k| match k {
                "VIRTUAL_ENV" => Some(venv.clone()),
                _ => env(k),
            });
            // Past the loader names (a system NCCL would win there).
            let wheels_only = loader::Search {
                candidates: search
                    .candidates
                    .into_iter()
                    .filter(|c| matches!(c, loader::Candidate::Wheel(_)))
                    .collect(),
            };
            report(wheels_only.load());
            std::fs::remove_dir_all(&dir).unwrap();
        }
        // backend=nccl with no GPU: Unavailable at once, with the reason.
        "nccl_unavailable" => {
            let mut o = Options::default();
            o.set("backend", "nccl").unwrap();
            o.set("timeout_ms", "5000").unwrap();
            let port = common::free_port();
            let t = Instant::now();
            let e = match Comm::init(&format!("tcp://127.0.0.1:{port}"), 0, 1, &o) {
                Ok(_) => panic!("backend=nccl must fail with no GPU visible"),
                Err(e) => e,
            };
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "took {:?}",
                t.elapsed()
            );
            assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
            let msg = e.message();
            assert!(msg.contains("backend 'nccl'"), "{msg}");
            match nccl::availability() {
                Err(why) => assert!(msg.contains(&why), "{msg} lacks {why}"),
                Ok(_) => assert!(msg.contains("does not implement the NCCL backend"), "{msg}"),
            }
            println!("RESULT ok");
        }
        // The same through the C API: RDIST_ERR_UNAVAILABLE and the text.
        "nccl_unavailable_c_api" => {
            use rdist::ffi::comm::rdist_init;
            use rdist::ffi::options::{
                rdist_options_create, rdist_options_destroy, rdist_options_set,
            };
            use rdist::ffi::version::rdist_last_error;
            let mut opts = std::ptr::null_mut();
            assert_eq!(rdist_options_create(&mut opts) as i32, 0);
            let key = CString::new("backend").unwrap();
            let value = CString::new("nccl").unwrap();
            assert_eq!(
                rdist_options_set(opts, key.as_ptr(), value.as_ptr()) as i32,
                0
            );
            let method = CString::new(format!("tcp://127.0.0.1:{}", common::free_port())).unwrap();
            let mut comm = std::ptr::null_mut();
            let rc = rdist_init(&mut comm, method.as_ptr(), 0, 1, opts);
            // SAFETY: rdist_last_error never returns NULL.
            let msg = unsafe { CStr::from_ptr(rdist_last_error()) }
                .to_string_lossy()
                .into_owned();
            rdist_options_destroy(opts);
            assert_eq!(rc as i32, ErrorKind::Unavailable.code(), "{msg}");
            assert!(comm.is_null());
            assert!(msg.contains("rdist_init"), "{msg}");
            assert!(msg.contains("backend 'nccl'"), "{msg}");
            println!("RESULT ok");
        }
        // backend=auto: runs (on sockets) and says why at INFO.
        "auto" => {
            let port = common::free_port();
            let comm = Comm::init(
                &format!("tcp://127.0.0.1:{port}"),
                0,
                1,
                &Options::default(),
            )
            .unwrap();
            assert_eq!(comm.backend(), Backend::Socket);
            let why = rdist::internals::cuda::cuda_devices().expect_err("no device is visible");
            println!("NO_DEVICE {why}");
            let mut v = vec![1.0f32, 2.0];
            comm.allreduce(&mut v, rdist::ReduceOp::Sum).unwrap();
            assert_eq!(v, [1.0, 2.0]);
            println!("RESULT ok");
        }
        other => panic!("unknown role {other}"),
    }
}

/// Prints what a child found: path, version, missing entry points, and
/// whether ncclGetUniqueId works.
fn report(found: Result<loader::NcclLibrary, String>) {
    let lib = found.unwrap_or_else(|e| panic!("NCCL did not load: {e}"));
    println!("PATH {}", lib.path.display());
    println!("VERSION {} {}", lib.version, lib.version_code);
    println!("MISSING {}", lib.missing().join(","));
    match lib.unique_id() {
        Ok(id) => println!(
            "UNIQUE_ID ok {}",
            id.internal.iter().filter(|b| **b != 0).count()
        ),
        Err(e) => println!("UNIQUE_ID error {e}"),
    }
}

#[test]
fn with_no_nccl_the_error_lists_what_was_tried() {
    let out = run_role("search_nothing", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    if let Some((_, found)) = stdout.lines().find_map(|l| l.split_once("FOUND ")) {
        eprintln!("skipped: NCCL is installed system-wide here ({found})");
        return;
    }
    let err = field(&out, "ERROR");
    assert!(
        err.starts_with("libnccl.so.2 not found (tried: libnccl.so.2, libnccl.so, "),
        "{err}"
    );
    assert!(err.contains(loader::WHEEL_LIBRARY), "{err}");
    // Every site-packages folder searched is named.
    let wheels = field(&out, "WHEELS");
    for w in wheels.split('|').filter(|w| !w.is_empty()) {
        let dir = w
            .strip_suffix(&format!("/{}", loader::WHEEL_LIBRARY))
            .unwrap();
        assert!(err.contains(dir), "{dir} missing from: {err}");
    }
}

#[test]
fn an_explicit_library_that_is_missing_is_named() {
    let env = |k: &str| (k == loader::LIBRARY_ENV).then(|| OsString::from("/no/such/libnccl.so.2"));
    let e = loader::Search::from_lookup(env).load().unwrap_err();
    assert!(e.contains("/no/such/libnccl.so.2 not found"), "{e}");
    assert!(e.contains(loader::LIBRARY_ENV), "{e}");
    // Through the C API: RDIST_ERR_UNAVAILABLE (7), the version untouched.
    let missing = std::ffi::OsStr::new("/no/such/libnccl.so.2");
    let out = run_role("c_version_missing", &[(loader::LIBRARY_ENV, missing)]);
    assert_eq!(field(&out, "C_VERSION"), "7 -1");
    assert!(
        field(&out, "C_ERROR").contains("/no/such/libnccl.so.2 not found"),
        "{}",
        field(&out, "C_ERROR")
    );
}

#[test]
fn the_wheel_loads_through_rdist_nccl_library() {
    let Some(lib) = wheel_library() else { return };
    let out = run_role("load_explicit", &[(loader::LIBRARY_ENV, lib.as_os_str())]);
    assert_eq!(field(&out, "PATH"), lib.display().to_string());
    check_loaded(&out);
    // rdist_nccl_version: RDIST_SUCCESS and NCCL's own code.
    let code = field(&out, "VERSION")
        .split(' ')
        .nth(1)
        .unwrap()
        .to_string();
    assert_eq!(field(&out, "C_VERSION"), format!("0 {code}"));
}

#[test]
fn the_wheel_is_found_in_a_virtualenv() {
    let Some(lib) = wheel_library() else { return };
    let out = run_role(
        "load_from_venv",
        &[("RDIST_TEST_WHEEL_LIBRARY", lib.as_os_str())],
    );
    let path = field(&out, "PATH");
    assert!(
        path.ends_with("/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"),
        "{path}"
    );
    check_loaded(&out);
}

/// Version >= 2.0 read, every entry point rdist declares present (the
/// wheel is a recent NCCL), and ncclGetUniqueId returns ncclSuccess.
fn check_loaded(out: &Output) {
    let version = field(out, "VERSION");
    let (text, code) = version.split_once(' ').unwrap();
    let parts: Vec<u32> = text.split('.').map(|p| p.parse().unwrap()).collect();
    assert_eq!(parts.len(), 3, "{version}");
    assert!(parts[0] >= 2, "NCCL {version} is older than 2.0");
    let code: i32 = code.parse().unwrap();
    assert_eq!(loader::NcclVersion::from_code(code).to_string(), text);
    assert_eq!(field(out, "MISSING"), "", "entry points missing");
    let uid = field(out, "UNIQUE_ID");
    assert!(uid.starts_with("ok "), "ncclGetUniqueId: {uid}");
    let nonzero: usize = uid[3..].parse().unwrap();
    assert!(nonzero > 0, "ncclGetUniqueId wrote an all-zero id");
}

#[test]
fn availability_gives_the_reason_nccl_cannot_run() {
    match rdist::internals::cuda::cuda_devices() {
        Err(why) => {
            assert!(why.contains("CUDA"), "{why}");
            assert_eq!(nccl::availability().unwrap_err(), why);
        }
        Ok(n) => {
            eprintln!(
                "{n} CUDA device(s): availability() = {:?}",
                nccl::availability()
            );
        }
    }
}

/// What a machine with no usable GPU does: the child sees no device
/// (CUDA_VISIBLE_DEVICES empty), so these also hold on GPU machines.
const NO_GPU: (&str, &str) = ("CUDA_VISIBLE_DEVICES", "");

#[test]
fn backend_nccl_fails_with_unavailable_and_the_reason() {
    let out = run_role("nccl_unavailable", &[(NO_GPU.0, NO_GPU.1.as_ref())]);
    assert_eq!(field(&out, "RESULT"), "ok");
}

#[test]
fn backend_nccl_through_the_c_api_is_rdist_err_unavailable() {
    let out = run_role("nccl_unavailable_c_api", &[(NO_GPU.0, NO_GPU.1.as_ref())]);
    assert_eq!(field(&out, "RESULT"), "ok");
}

#[test]
fn auto_falls_back_to_sockets_with_one_info_line() {
    // Even with NCCL's library at hand, no GPU means sockets.
    let mut env: Vec<(&str, &std::ffi::OsStr)> = vec![
        ("RDIST_DEBUG", "INFO".as_ref()),
        (NO_GPU.0, NO_GPU.1.as_ref()),
    ];
    let lib = wheel_library();
    if let Some(lib) = &lib {
        env.push((loader::LIBRARY_ENV, lib.as_os_str()));
    }
    let out = run_role("auto", &env);
    assert_eq!(field(&out, "RESULT"), "ok");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("rdist INFO [rank 0]") && l.contains("NCCL"))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "one INFO line about NCCL expected:\n{stderr}"
    );
    let line = lines[0];
    assert!(line.ends_with("; using sockets"), "{line}");
    // The child's own view of the devices (it sees none).
    let why = field(&out, "NO_DEVICE");
    assert!(
        line.contains(&format!("NCCL unavailable: {why}; using sockets")),
        "{line}"
    );

    // At the default level nothing is said.
    let quiet = run_role("auto", &[(NO_GPU.0, NO_GPU.1.as_ref())]);
    let stderr = String::from_utf8_lossy(&quiet.stderr);
    assert!(!stderr.contains("NCCL"), "{stderr}");
}

/// On a GPU machine NCCL must be found and report its version; the
/// collectives on device buffers are tests/gpu_stub.rs's `real_gpu_*`.
/// Without a CUDA device it says so and passes.
#[test]
fn gpu_nccl_is_found_where_there_is_a_device() {
    let devices = match rdist::internals::cuda::cuda_devices() {
        Ok(n) => n,
        Err(why) => {
            eprintln!("skipped: no CUDA device ({why})");
            return;
        }
    };
    let info = nccl::availability()
        .or_else(|why| {
            let lib = wheel_library().ok_or(why)?;
            let found = loader::Search {
                candidates: vec![loader::Candidate::Explicit(lib)],
            }
            .load()?;
            Ok::<_, String>(nccl::NcclInfo {
                path: found.path,
                version: found.version,
                devices,
            })
        })
        .expect("NCCL found on a GPU machine");
    eprintln!(
        "{devices} CUDA device(s), NCCL {} at {}",
        info.version,
        info.path.display()
    );
}

/// The parts of NCCL's ABI that rdist writes by hand, checked against the
/// installed NCCL's own header (the wheel ships nccl.h): the
/// `ncclConfig_t` prefix rdist fills in, the result codes and enum values
/// it passes or compares, and the prototypes `loader.rs` declares for the
/// entry points it resolves. A C program built from nccl.h prints what
/// the header says; the prototypes must compile as pointers to NCCL's
/// functions with `-Werror`. nccl.h includes CUDA's runtime headers for
/// two handle types; small stand-ins replace them (no CUDA toolkit here).
#[test]
fn the_hand_written_abi_matches_the_installed_nccl_header() {
    let Some(lib) = wheel_library() else { return };
    let include = lib.parent().unwrap().parent().unwrap().join("include");
    let header = include.join("nccl.h");
    assert!(header.is_file(), "{} is missing", header.display());
    let dir = std::env::temp_dir().join(format!("rdist-nccl-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let handles =
        "typedef struct CUstream_st *cudaStream_t;\ntypedef struct CUevent_st *cudaEvent_t;\n";
    for h in ["cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"] {
        let text = if h == "cuda_runtime.h" { handles } else { "" };
        std::fs::write(dir.join(h), text).unwrap();
    }
    let (rust_size, fields) = nccl::communicator::config_layout();
    let constants = nccl::communicator::abi_constants();
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"nccl.h\"\n\
         /* Older headers (2.28 among them) spell the magic out only in the initializer. */\n\
         #ifndef NCCL_API_MAGIC\n\
         static const ncclConfig_t initializer = NCCL_CONFIG_INITIALIZER;\n\
         #define NCCL_API_MAGIC (initializer.magic)\n\
         #endif\n\
         typedef ncclResult_t R;\n\
         #define SAME(f, t) _Static_assert(__builtin_types_compatible_p(__typeof__(&f), t), \\\n\
           #f \" is not \" #t \" in this nccl.h\"); checked++\n\
         int main(void) {\n\
         int checked = 0;\n\
         /* The prototypes loader.rs declares (RawResult is ncclResult_t). */\n\
         SAME(ncclGetVersion, R (*)(int *));\n\
         SAME(ncclGetUniqueId, R (*)(ncclUniqueId *));\n\
         SAME(ncclGetErrorString, const char *(*)(ncclResult_t));\n\
         SAME(ncclGetLastError, const char *(*)(ncclComm_t));\n\
         SAME(ncclCommInitRankConfig, R (*)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *));\n\
         SAME(ncclCommAbort, R (*)(ncclComm_t));\n\
         SAME(ncclCommDestroy, R (*)(ncclComm_t));\n\
         SAME(ncclCommFinalize, R (*)(ncclComm_t));\n\
         SAME(ncclCommGetAsyncError, R (*)(ncclComm_t, ncclResult_t *));\n\
         SAME(ncclCommSplit, R (*)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *));\n\
         SAME(ncclCommShrink, R (*)(ncclComm_t, int *, int, ncclComm_t *, ncclConfig_t *, int));\n\
         SAME(ncclAllReduce, R (*)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t));\n\
         SAME(ncclBroadcast, R (*)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t));\n\
         SAME(ncclReduce, R (*)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t));\n\
         SAME(ncclAllGather, R (*)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t));\n\
         SAME(ncclReduceScatter, R (*)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t));\n\
         SAME(ncclSend, R (*)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t));\n\
         SAME(ncclRecv, R (*)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t));\n\
         SAME(ncclGroupStart, R (*)(void));\n\
         SAME(ncclGroupEnd, R (*)(void));\n\
         printf(\"prototypes %d\\n\", checked);\n\
         printf(\"sizeof ncclConfig_t %zu\\n\", sizeof(ncclConfig_t));\n",
    );
    for (name, _) in &fields {
        c.push_str(&format!(
            "printf(\"{name} %zu\\n\", offsetof(ncclConfig_t, {name}));\n"
        ));
    }
    for (name, _) in &constants {
        c.push_str(&format!(
            "printf(\"{name} %lld\\n\", (long long)({name}));\n"
        ));
    }
    c.push_str("return 0;\n}\n");
    std::fs::write(dir.join("abi.c"), &c).unwrap();
    let exe = dir.join("abi");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let built = common::output_within(
        Command::new(&cc)
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror"])
            .arg("-I")
            .arg(&dir)
            .arg("-I")
            .arg(&include)
            .arg(dir.join("abi.c"))
            .arg("-o")
            .arg(&exe),
        Duration::from_secs(60),
        "compiling against nccl.h",
    );
    assert!(
        built.status.success(),
        "rdist's NCCL declarations do not match {}:\n{}",
        header.display(),
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = common::output_within(&mut Command::new(&exe), Duration::from_secs(30), "abi");
    assert!(ran.status.success());
    let said = |key: &str| -> i64 {
        let out = String::from_utf8_lossy(&ran.stdout).to_string();
        out.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in:\n{out}"))
    };
    assert_eq!(
        said("prototypes"),
        loader::OPTIONAL_SYMBOLS.len() as i64 + 3
    );
    for (name, offset) in &fields {
        assert_eq!(said(name) as usize, *offset, "ncclConfig_t.{name}");
    }
    // rdist's prefix ends on a field of NCCL's, inside NCCL's struct.
    let (last, last_offset) = fields.last().unwrap();
    assert_eq!(
        last_offset + 4,
        rust_size,
        "{last} ends the prefix with no padding"
    );
    assert!(rust_size as i64 <= said("sizeof ncclConfig_t"));
    for (name, value) in &constants {
        assert_eq!(said(name), *value, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
