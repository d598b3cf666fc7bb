//! Can NCCL run here? The CUDA driver (through cudarc, which is told to
//! load it at run time), a device, then NCCL's library (see `loader`).

use super::loader::{self, NcclVersion};
use std::path::PathBuf;
use std::sync::OnceLock;

/// What `availability` found when NCCL can run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclInfo {
    /// The NCCL library loaded.
    pub path: PathBuf,
    pub version: NcclVersion,
    /// CUDA devices the driver reports.
    pub devices: usize,
}

/// The number of CUDA devices, or why there are none usable. Never panics:
/// cudarc panics when a library or symbol is missing, so the driver's
/// presence is checked first and every driver call runs under
/// `catch_unwind`.
pub fn cuda_devices() -> Result<usize, String> {
    // SAFETY: only tries to open the driver's library by its names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so not found)".to_string());
    }
    let counted = std::panic::catch_unwind(|| {
        cudarc::driver::result::init()?;
        cudarc::driver::result::device::get_count()
    });
    use cudarc::driver::sys::CUresult;
    match counted {
        Err(_) => Err("the CUDA driver could not be used (loading it failed)".to_string()),
        Ok(Err(e)) if e.0 == CUresult::CUDA_ERROR_NO_DEVICE => Err("no CUDA device".to_string()),
        Ok(Err(e)) => Err(format!("the CUDA driver failed to initialise ({:?})", e.0)),
        Ok(Ok(n)) if n <= 0 => Err("no CUDA device".to_string()),
        Ok(Ok(n)) => Ok(n as usize),
    }
}

/// Whether the NCCL backend can run in this process: a CUDA driver, at
/// least one device, and NCCL's library. The error is the reason, for
/// people ("no CUDA driver (libcuda.so not found)", "no CUDA device",
/// "libnccl.so.2 not found (tried: ...)"). Checked once per process.
pub fn availability() -> Result<NcclInfo, String> {
    static FOUND: OnceLock<Result<NcclInfo, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let devices = cuda_devices()?;
            let lib = loader::load()?;
            Ok(NcclInfo {
                path: lib.path.clone(),
                version: lib.version,
                devices,
            })
        })
        .clone()
}
