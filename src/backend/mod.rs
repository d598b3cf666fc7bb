//! Backends run calls: `socket` (the transport plus rdist's algorithms)
//! for host buffers, `nccl` for device buffers when every rank can run it;
//! `route` decides per call from where the buffers live, and `cuda` is the
//! driver both use.

pub mod cuda;
pub mod nccl;
pub(crate) mod route;
pub mod socket;
