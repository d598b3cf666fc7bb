//! The NCCL backend, CPU side: finding and loading NCCL (`loader`),
//! deciding whether it can run here (`probe`) and choosing a backend when
//! a communicator is created (`select`). Collectives on device buffers
//! come with the GPU work of the NCCL issue; until then every
//! communicator runs on the socket backend.

pub mod loader;
pub mod probe;

pub use loader::{NcclLibrary, NcclVersion, Search};
pub use probe::{availability, cuda_devices, NcclInfo};

use crate::error::{Error, ErrorKind, Result};
use crate::options::Backend;

/// Chooses the backend for a new communicator. Returns the INFO line to
/// log (if any), or `Unavailable` with the reason when `backend=nccl`
/// cannot run. NCCL collectives are not built yet, so the choice is always
/// the socket backend.
///
/// For `auto`, NCCL is probed only when `log_info` (the line is the only
/// outcome today): the probe initialises the CUDA driver and loads NCCL,
/// which a process that only wants host buffers should not pay for.
pub(crate) fn select(requested: Backend, log_info: bool) -> Result<Option<String>> {
    match requested {
        Backend::Socket => Ok(None),
        Backend::Auto if !log_info => Ok(None),
        Backend::Auto => Ok(Some(match availability() {
            Ok(info) => format!(
                "NCCL {} found at {} ({} CUDA device{}), but this build of rdist runs collectives on sockets only (device buffers are not supported yet); using sockets",
                info.version,
                info.path.display(),
                info.devices,
                if info.devices == 1 { "" } else { "s" }
            ),
            Err(why) => format!("NCCL unavailable: {why}; using sockets"),
        })),
        Backend::Nccl => Err(Error::new(
            ErrorKind::Unavailable,
            match availability() {
                Ok(info) => format!(
                    "backend 'nccl': NCCL {} found at {}, but this build of rdist does not implement the NCCL backend yet (use backend=auto or socket)",
                    info.version,
                    info.path.display()
                ),
                Err(why) => format!(
                    "backend 'nccl' is unavailable: {why} (use backend=auto or socket to run on sockets)"
                ),
            },
        )),
    }
}
