//! Backends run calls. `engine` is where every call starts and ends: it
//! numbers and traces it and sends it where `route` says from where its
//! buffers live: `socket` (rdist's algorithms over the transport) for host
//! buffers, `nccl` for device buffers when every rank can run it, and
//! `staging` (host copies) for device buffers NCCL cannot take. `cuda` is
//! the driver, loaded at run time. `p2p` is the point-to-point context:
//! sends and receives matched by source and tag, beside the collectives.

pub(crate) mod board;
pub mod cuda;
pub(crate) mod engine;
pub mod nccl;
pub(crate) mod p2p;
pub(crate) mod route;
pub(crate) mod socket;

/// What setting up an engine needs that needs no roster, looked up while
/// the rank waits for the others to join (see `rendezvous::join`).
pub(crate) fn prepare() {
    socket::prepare();
}
pub(crate) mod staging;
