//! Finds and loads NCCL's shared library at run time (rdist never links
//! against it), and resolves the entry points rdist uses.
//!
//! cudarc's own NCCL loader does not look for `libnccl.so.2`, the name
//! NCCL's runtime packages install (PyPI's `nvidia-nccl-cu12`, Debian's
//! `libnccl2`), so rdist loads NCCL itself and reuses `cudarc::nccl::sys`
//! for the types. Search order (see [`Search::from_env`]):
//!
//! 1. `RDIST_NCCL_LIBRARY`, a path; when set, nothing else is tried;
//! 2. `libnccl.so.2`, then `libnccl.so`, through the dynamic loader
//!    (LD_LIBRARY_PATH, the ldconfig cache, the default folders);
//! 3. `nvidia/nccl/lib/libnccl.so.2` of an installed Python wheel, in the
//!    site-packages / dist-packages folders of the active virtualenv or
//!    conda env, PYTHONPATH, every `python3` on PATH, ~/.local, /usr/local,
//!    /usr and pyenv's versions (found by listing folders; no Python is run).
//!
//! A loaded library is never unloaded (NCCL keeps threads of its own, and
//! the entry points stay valid for the life of the process).

use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId,
};
use std::ffi::{c_char, c_int, c_void, CStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The environment variable naming NCCL's library explicitly.
pub const LIBRARY_ENV: &str = "RDIST_NCCL_LIBRARY";

/// The dynamic-loader names tried, in order.
pub const LIBRARY_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// Where an installed `nvidia-nccl-cu12` wheel keeps the library, relative
/// to its site-packages folder.
pub const WHEEL_LIBRARY: &str = "nvidia/nccl/lib/libnccl.so.2";

/// `ncclResult_t` as NCCL returns it. Kept as a plain int at the boundary:
/// a newer NCCL may return a code that cudarc's enum does not list, and an
/// out-of-range enum value would be undefined behaviour in Rust.
pub type RawResult = c_int;

/// `ncclSuccess`.
pub const NCCL_SUCCESS: RawResult = 0;

/// NCCL's version, decoded from `ncclGetVersion`'s int.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `NCCL_VERSION(X,Y,Z)`: `X*10000 + Y*100 + Z` since 2.9,
    /// `X*1000 + Y*100 + Z` before.
    pub fn from_code(code: i32) -> NcclVersion {
        let code = code.max(0) as u32;
        let (major, rest) = match code >= 10_000 {
            true => (code / 10_000, code % 10_000),
            false => (code / 1_000, code % 1_000),
        };
        NcclVersion {
            major,
            minor: rest / 100,
            patch: rest % 100,
        }
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// NCCL's entry points. The first three are required (a library without
/// them is not NCCL); the others are `None` where this NCCL lacks them
/// (e.g. `ncclCommSplit` before 2.18, `ncclGetLastError` before 2.13), so
/// an old NCCL still loads and the caller decides what it needs.
///
/// The pointers stay valid for the life of the process (the library is
/// never unloaded).
#[allow(non_snake_case)]
#[derive(Clone, Copy, Debug)]
pub struct Api {
    pub ncclGetVersion: unsafe extern "C" fn(*mut c_int) -> RawResult,
    pub ncclGetUniqueId: unsafe extern "C" fn(*mut ncclUniqueId) -> RawResult,
    pub ncclGetErrorString: unsafe extern "C" fn(RawResult) -> *const c_char,
    pub ncclGetLastError: Option<unsafe extern "C" fn(ncclComm_t) -> *const c_char>,
    pub ncclCommInitRankConfig: Option<
        unsafe extern "C" fn(
            *mut ncclComm_t,
            c_int,
            ncclUniqueId,
            c_int,
            *mut ncclConfig_t,
        ) -> RawResult,
    >,
    pub ncclCommAbort: Option<unsafe extern "C" fn(ncclComm_t) -> RawResult>,
    pub ncclCommDestroy: Option<unsafe extern "C" fn(ncclComm_t) -> RawResult>,
    pub ncclCommFinalize: Option<unsafe extern "C" fn(ncclComm_t) -> RawResult>,
    pub ncclCommGetAsyncError:
        Option<unsafe extern "C" fn(ncclComm_t, *mut RawResult) -> RawResult>,
    pub ncclCommSplit: Option<
        unsafe extern "C" fn(
            ncclComm_t,
            c_int,
            c_int,
            *mut ncclComm_t,
            *mut ncclConfig_t,
        ) -> RawResult,
    >,
    /// NCCL 2.27 and newer.
    pub ncclCommShrink: Option<
        unsafe extern "C" fn(
            ncclComm_t,
            *mut c_int,
            c_int,
            *mut ncclComm_t,
            *mut ncclConfig_t,
            c_int,
        ) -> RawResult,
    >,
    pub ncclAllReduce: Option<
        unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            ncclDataType_t,
            ncclRedOp_t,
            ncclComm_t,
            cudaStream_t,
        ) -> RawResult,
    >,
    pub ncclBroadcast: Option<
        unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            ncclDataType_t,
            c_int,
            ncclComm_t,
            cudaStream_t,
        ) -> RawResult,
    >,
    pub ncclReduce: Option<
        unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            ncclDataType_t,
            ncclRedOp_t,
            c_int,
            ncclComm_t,
            cudaStream_t,
        ) -> RawResult,
    >,
    pub ncclAllGather: Option<
        unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            ncclDataType_t,
            ncclComm_t,
            cudaStream_t,
        ) -> RawResult,
    >,
    pub ncclReduceScatter: Option<
        unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            ncclDataType_t,
            ncclRedOp_t,
            ncclComm_t,
            cudaStream_t,
        ) -> RawResult,
    >,
    pub ncclSend: Option<
        unsafe extern "C" fn(
            *const c_void,
            usize,
            ncclDataType_t,
            c_int,
            ncclComm_t,
            cudaStream_t,
        ) -> RawResult,
    >,
    pub ncclRecv: Option<
        unsafe extern "C" fn(
            *mut c_void,
            usize,
            ncclDataType_t,
            c_int,
            ncclComm_t,
            cudaStream_t,
        ) -> RawResult,
    >,
    pub ncclGroupStart: Option<unsafe extern "C" fn() -> RawResult>,
    pub ncclGroupEnd: Option<unsafe extern "C" fn() -> RawResult>,
}

/// The names of the optional entry points of [`Api`], in declaration order.
pub const OPTIONAL_SYMBOLS: [&str; 17] = [
    "ncclGetLastError",
    "ncclCommInitRankConfig",
    "ncclCommAbort",
    "ncclCommDestroy",
    "ncclCommFinalize",
    "ncclCommGetAsyncError",
    "ncclCommSplit",
    "ncclCommShrink",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// A loaded NCCL: where it came from, its version and its entry points.
#[derive(Clone, Debug)]
pub struct NcclLibrary {
    /// What was loaded: a path, or a name the dynamic loader resolved (then
    /// the file it resolved to, when that can be found).
    pub path: PathBuf,
    pub version: NcclVersion,
    /// `ncclGetVersion`'s int, as NCCL returned it.
    pub version_code: i32,
    pub api: Api,
}

impl NcclLibrary {
    /// The optional entry points this NCCL lacks.
    pub fn missing(&self) -> Vec<&'static str> {
        let a = &self.api;
        let present = [
            a.ncclGetLastError.is_some(),
            a.ncclCommInitRankConfig.is_some(),
            a.ncclCommAbort.is_some(),
            a.ncclCommDestroy.is_some(),
            a.ncclCommFinalize.is_some(),
            a.ncclCommGetAsyncError.is_some(),
            a.ncclCommSplit.is_some(),
            a.ncclCommShrink.is_some(),
            a.ncclAllReduce.is_some(),
            a.ncclBroadcast.is_some(),
            a.ncclReduce.is_some(),
            a.ncclAllGather.is_some(),
            a.ncclReduceScatter.is_some(),
            a.ncclSend.is_some(),
            a.ncclRecv.is_some(),
            a.ncclGroupStart.is_some(),
            a.ncclGroupEnd.is_some(),
        ];
        OPTIONAL_SYMBOLS
            .iter()
            .zip(present)
            .filter(|(_, p)| !p)
            .map(|(n, _)| *n)
            .collect()
    }

    /// NCCL's text for a result code (`ncclGetErrorString`).
    pub fn error_string(&self, code: RawResult) -> String {
        // SAFETY: NCCL returns a static string (or NULL) for any code.
        unsafe { c_text((self.api.ncclGetErrorString)(code)) }
            .unwrap_or_else(|| format!("NCCL error {code}"))
    }

    /// NCCL's last error message, for errors outside a communicator (""
    /// where this NCCL has no `ncclGetLastError`).
    pub fn last_error(&self) -> String {
        match self.api.ncclGetLastError {
            // SAFETY: NULL asks for the last error outside a communicator.
            Some(f) => unsafe { c_text(f(std::ptr::null_mut())) }.unwrap_or_default(),
            None => String::new(),
        }
    }

    /// `ncclGetUniqueId`. Works without a GPU; note that NCCL then hosts
    /// the id's bootstrap root in a thread of this process.
    pub fn unique_id(&self) -> Result<ncclUniqueId, String> {
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid ncclUniqueId to write.
        let rc = unsafe { (self.api.ncclGetUniqueId)(&mut id) };
        match rc {
            NCCL_SUCCESS => Ok(id),
            _ => Err(self.describe_failure("ncclGetUniqueId", rc)),
        }
    }

    /// "F failed: <NCCL's text> (<last error>)".
    pub fn describe_failure(&self, func: &str, code: RawResult) -> String {
        let last = self.last_error();
        let mut msg = format!("{func} failed: {}", self.error_string(code));
        if !last.is_empty() {
            msg.push_str(&format!(" ({last})"));
        }
        msg
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn c_text(p: *const c_char) -> Option<String> {
    (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
}

/// One place to look for NCCL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Candidate {
    /// From RDIST_NCCL_LIBRARY.
    Explicit(PathBuf),
    /// A name for the dynamic loader.
    Name(String),
    /// A file of an installed wheel (`<site-packages>/nvidia/nccl/lib/...`).
    Wheel(PathBuf),
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Candidate::Explicit(p) => write!(f, "{LIBRARY_ENV}={}", p.display()),
            Candidate::Name(n) => f.write_str(n),
            Candidate::Wheel(p) => write!(f, "{}", p.display()),
        }
    }
}

/// Where to look for NCCL, in order.
#[derive(Clone, Debug, Default)]
pub struct Search {
    pub candidates: Vec<Candidate>,
}

impl Search {
    /// The search order for this process's environment (see the module
    /// documentation).
    pub fn from_env() -> Search {
        Search::from_lookup(crate::options::process_env_os)
    }

    /// `from_env` with an injectable environment (for tests).
    pub fn from_lookup(env: impl Fn(&str) -> Option<OsString>) -> Search {
        if let Some(p) = env(LIBRARY_ENV).filter(|p| !p.is_empty()) {
            return Search {
                candidates: vec![Candidate::Explicit(PathBuf::from(p))],
            };
        }
        let mut candidates: Vec<Candidate> = LIBRARY_NAMES
            .iter()
            .map(|n| Candidate::Name(n.to_string()))
            .collect();
        candidates.extend(
            site_packages(&env)
                .into_iter()
                .map(|d| Candidate::Wheel(d.join(WHEEL_LIBRARY))),
        );
        Search { candidates }
    }

    /// Loads the first candidate that loads. The error lists every
    /// candidate tried and why each failed.
    pub fn load(&self) -> Result<NcclLibrary, String> {
        let mut tried = Vec::new();
        let mut broken = Vec::new();
        for c in &self.candidates {
            let (target, resolve): (&std::ffi::OsStr, bool) = match c {
                // A bare name goes through the loader's search: report
                // the file it resolved to.
                Candidate::Explicit(p) => (p.as_os_str(), p.components().count() == 1),
                Candidate::Name(n) => (n.as_ref(), true),
                Candidate::Wheel(p) => {
                    if !p.is_file() {
                        tried.push(c.to_string());
                        continue;
                    }
                    (p.as_os_str(), false)
                }
            };
            match open(target, resolve) {
                Ok(lib) => return Ok(lib),
                Err(Failure::NotFound) => tried.push(c.to_string()),
                Err(Failure::Broken(why)) => {
                    tried.push(c.to_string());
                    broken.push(format!("{c}: {why}"));
                }
            }
        }
        let mut msg = match self.candidates.first() {
            Some(Candidate::Explicit(p)) if broken.is_empty() => format!(
                "{} not found ({LIBRARY_ENV} names it; nothing else is tried while it is set)",
                p.display()
            ),
            Some(Candidate::Explicit(_)) => String::new(),
            _ => format!(
                "{} not found (tried: {})",
                LIBRARY_NAMES[0],
                compact(&tried)
            ),
        };
        if !broken.is_empty() {
            if !msg.is_empty() {
                msg.push_str("; ");
            }
            msg.push_str(&format!("could not load {}", broken.join("; ")));
        }
        Err(msg)
    }
}

/// Joins what was tried; wheel paths are long, so a run of them shares one
/// "<dir>/{...}" suffix note.
fn compact(tried: &[String]) -> String {
    let wheel_suffix = format!("/{WHEEL_LIBRARY}");
    let (wheels, others): (Vec<&String>, Vec<&String>) =
        tried.iter().partition(|t| t.ends_with(&wheel_suffix));
    let mut parts: Vec<String> = others.into_iter().cloned().collect();
    if !wheels.is_empty() {
        let dirs: Vec<&str> = wheels
            .iter()
            .map(|w| &w[..w.len() - wheel_suffix.len()])
            .collect();
        parts.push(format!("{WHEEL_LIBRARY} in {}", dirs.join(", ")));
    } else {
        parts.push(format!(
            "{WHEEL_LIBRARY} in no folder (no Python site-packages found)"
        ));
    }
    parts.join(", ")
}

enum Failure {
    NotFound,
    Broken(String),
}

/// Loads one library and checks that it is NCCL.
fn open(target: &std::ffi::OsStr, resolve: bool) -> Result<NcclLibrary, Failure> {
    // SAFETY: loading runs the library's initialisers; NCCL's are safe to
    // run in any process.
    let lib = match unsafe { libloading::Library::new(target) } {
        Ok(lib) => lib,
        Err(e) => {
            let text = describe(&e);
            return Err(match text.contains("No such file or directory") {
                true => Failure::NotFound,
                false => Failure::Broken(text),
            });
        }
    };
    let api = resolve_api(&lib).map_err(Failure::Broken)?;
    // Never unloaded: the entry points stay valid for the process.
    std::mem::forget(lib);
    let mut code: c_int = 0;
    // SAFETY: a valid int to write.
    let rc = unsafe { (api.ncclGetVersion)(&mut code) };
    if rc != NCCL_SUCCESS {
        return Err(Failure::Broken(format!("ncclGetVersion returned {rc}")));
    }
    let path = match resolve {
        true => resolved_path(api.ncclGetVersion as *const c_void)
            .unwrap_or_else(|| PathBuf::from(target)),
        false => PathBuf::from(target),
    };
    Ok(NcclLibrary {
        path,
        version: NcclVersion::from_code(code),
        version_code: code,
        api,
    })
}

/// libloading's error with its cause ("dlopen failed: <dlerror text>").
fn describe(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

fn resolve_api(lib: &libloading::Library) -> Result<Api, String> {
    macro_rules! required {
        ($name:ident) => {
            // SAFETY: the type is NCCL's declaration of the symbol.
            *unsafe { lib.get(stringify!($name)) }.map_err(|e| {
                format!("not NCCL ({} missing: {})", stringify!($name), describe(&e))
            })?
        };
    }
    macro_rules! optional {
        ($name:ident) => {
            // SAFETY: the type is NCCL's declaration of the symbol.
            unsafe { lib.get(stringify!($name)) }.ok().map(|s| *s)
        };
    }
    Ok(Api {
        ncclGetVersion: required!(ncclGetVersion),
        ncclGetUniqueId: required!(ncclGetUniqueId),
        ncclGetErrorString: required!(ncclGetErrorString),
        ncclGetLastError: optional!(ncclGetLastError),
        ncclCommInitRankConfig: optional!(ncclCommInitRankConfig),
        ncclCommAbort: optional!(ncclCommAbort),
        ncclCommDestroy: optional!(ncclCommDestroy),
        ncclCommFinalize: optional!(ncclCommFinalize),
        ncclCommGetAsyncError: optional!(ncclCommGetAsyncError),
        ncclCommSplit: optional!(ncclCommSplit),
        ncclCommShrink: optional!(ncclCommShrink),
        ncclAllReduce: optional!(ncclAllReduce),
        ncclBroadcast: optional!(ncclBroadcast),
        ncclReduce: optional!(ncclReduce),
        ncclAllGather: optional!(ncclAllGather),
        ncclReduceScatter: optional!(ncclReduceScatter),
        ncclSend: optional!(ncclSend),
        ncclRecv: optional!(ncclRecv),
        ncclGroupStart: optional!(ncclGroupStart),
        ncclGroupEnd: optional!(ncclGroupEnd),
    })
}

/// The file that holds `addr` (what a bare library name resolved to).
fn resolved_path(addr: *const c_void) -> Option<PathBuf> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and fills `info`.
    let ok = unsafe { libc::dladdr(addr, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's file name is a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    use std::os::unix::ffi::OsStrExt;
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// The site-packages / dist-packages folders a wheel may be installed in,
/// most specific first, each once. Only folders that exist.
pub fn site_packages(env: &impl Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    let mut direct: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = env(var).filter(|p| !p.is_empty()) {
            prefixes.push(PathBuf::from(p));
        }
    }
    if let Some(pp) = env("PYTHONPATH") {
        direct.extend(std::env::split_paths(&pp).filter(|p| !p.as_os_str().is_empty()));
    }
    if let Some(path) = env("PATH") {
        for dir in std::env::split_paths(&path) {
            let py = dir.join("python3");
            if !py.is_file() {
                continue;
            }
            // A venv's bin/python3 links to the base interpreter: keep the
            // venv (dir/..) and add the interpreter's own prefix.
            prefixes.extend(dir.parent().map(Path::to_path_buf));
            if let Some(real) = std::fs::canonicalize(&py)
                .ok()
                .and_then(|r| r.parent()?.parent().map(Path::to_path_buf))
            {
                prefixes.push(real);
            }
        }
    }
    if let Some(home) = env("HOME").filter(|h| !h.is_empty()) {
        prefixes.push(Path::new(&home).join(".local"));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    let pyenv_root = env("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| Path::new(&h).join(".pyenv")));
    if let Some(versions) = pyenv_root.map(|r| r.join("versions")) {
        prefixes.extend(sorted_children(&versions, |_| true));
    }

    let mut out: Vec<PathBuf> = Vec::new();
    // Each folder once, however it was reached (/bin -> /usr/bin, ...).
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut add = |p: PathBuf| {
        let Ok(real) = std::fs::canonicalize(&p) else {
            return;
        };
        if real.is_dir() && !seen.contains(&real) {
            seen.push(real);
            out.push(p);
        }
    };
    for d in direct {
        add(d);
    }
    for prefix in prefixes {
        for lib in ["lib", "lib64"] {
            for py in sorted_children(&prefix.join(lib), |n| n.starts_with("python3")) {
                add(py.join("site-packages"));
                add(py.join("dist-packages"));
            }
        }
    }
    out
}

/// The sub-folders of `dir` whose names pass `keep`, sorted by name.
fn sorted_children(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(&keep))
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

/// NCCL as found by this process's environment, loaded once (the outcome
/// is kept for the life of the process).
pub fn load() -> Result<&'static NcclLibrary, String> {
    static LOADED: OnceLock<Result<NcclLibrary, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| Search::from_env().load())
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_in_both_schemes() {
        let v = NcclVersion::from_code(23203);
        assert_eq!((v.major, v.minor, v.patch), (2, 32, 3));
        assert_eq!(v.to_string(), "2.32.3");
        assert_eq!(NcclVersion::from_code(2804).to_string(), "2.8.4");
        assert_eq!(NcclVersion::from_code(21805).to_string(), "2.18.5");
    }

    #[test]
    fn an_explicit_library_is_the_only_candidate() {
        let env = |k: &str| (k == LIBRARY_ENV).then(|| OsString::from("/nope/libnccl.so.2"));
        let s = Search::from_lookup(env);
        assert_eq!(
            s.candidates,
            vec![Candidate::Explicit("/nope/libnccl.so.2".into())]
        );
        let e = s.load().unwrap_err();
        assert!(e.contains("/nope/libnccl.so.2 not found"), "{e}");
        assert!(e.contains(LIBRARY_ENV), "{e}");
    }

    #[test]
    fn the_search_tries_names_then_wheels() {
        let root = std::env::temp_dir().join(format!("rdist-nccl-search-{}", std::process::id()));
        let sp = root.join("venv/lib/python3.11/site-packages");
        std::fs::create_dir_all(&sp).unwrap();
        let venv = root.join("venv").into_os_string();
        let env = move |k: &str| (k == "VIRTUAL_ENV").then(|| venv.clone());
        let s = Search::from_lookup(env);
        assert_eq!(s.candidates[0], Candidate::Name("libnccl.so.2".into()));
        assert_eq!(s.candidates[1], Candidate::Name("libnccl.so".into()));
        assert_eq!(s.candidates[2], Candidate::Wheel(sp.join(WHEEL_LIBRARY)));
        // Only the wheel folder: a failure lists it.
        let only_wheel = Search {
            candidates: vec![Candidate::Wheel(sp.join(WHEEL_LIBRARY))],
        };
        let e = only_wheel.load().unwrap_err();
        assert!(e.starts_with("libnccl.so.2 not found (tried: "), "{e}");
        assert!(e.contains(&sp.display().to_string()), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_file_that_is_not_a_library_is_reported_as_such() {
        let root = std::env::temp_dir().join(format!("rdist-nccl-broken-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let fake = root.join("libnccl.so.2");
        std::fs::write(&fake, b"not an ELF file").unwrap();
        let s = Search {
            candidates: vec![Candidate::Explicit(fake.clone())],
        };
        let e = s.load().unwrap_err();
        assert!(e.starts_with("could not load"), "{e}");
        assert!(e.contains(&fake.display().to_string()), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
