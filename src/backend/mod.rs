//! Backends run calls. `engine` is where calls start and end: it sends
//! each where `route` says from where its buffers live: `socket` (rdist's
//! algorithms over the transport) for host buffers, `nccl` for device
//! buffers when every rank can run it, and `staging` (host copies) for
//! device buffers NCCL cannot take. `messages` posts tagged messages on
//! host memory to the transport's endpoint. Every call of either kind is
//! numbered and traced in the `ledger`. `cuda` is the driver, loaded at
//! run time; `host_memory` knows some host buffers without asking it.

pub(crate) mod board;
pub mod cuda;
pub(crate) mod engine;
pub(crate) mod host_memory;
pub(crate) mod ledger;
pub(crate) mod messages;
pub mod nccl;
pub(crate) mod route;
pub(crate) mod socket;

/// What setting up an engine needs that needs no roster, looked up while
/// the rank waits for the others to join (see `rendezvous::join`).
pub(crate) fn prepare() {
    socket::prepare();
}
pub(crate) mod staging;
