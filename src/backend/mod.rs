//! Backends run calls: `socket` (the transport plus rdist's algorithms)
//! today; `nccl` finds and checks NCCL (its collectives on device buffers
//! come with the GPU work of its issue).

pub mod nccl;
pub mod socket;
