//! Backends run calls: `socket` (the transport plus rdist's algorithms)
//! today; NCCL for device buffers comes with its own issue.

pub mod socket;
