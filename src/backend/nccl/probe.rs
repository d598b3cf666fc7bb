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

/// Whether the NCCL backend can run in this process: a CUDA driver, at
/// least one device, and NCCL's library. The error is the reason, for
/// people ("no CUDA driver (libcuda.so not found)", "no CUDA device",
/// "libnccl.so.2 not found (tried: ...)"). Checked once per process.
pub fn availability() -> Result<NcclInfo, String> {
    static FOUND: OnceLock<Result<NcclInfo, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let devices = crate::backend::cuda::cuda_devices()?;
            let lib = loader::load()?;
            Ok(NcclInfo {
                path: lib.path.clone(),
                version: lib.version,
                devices,
            })
        })
        .clone()
}
