//! rdist: collective communication for native training engines.
//!
//! The safe Rust API is [`Comm`] with typed methods
//! ([`Comm::allreduce`], [`Comm::broadcast`], ...); the C ABI in [`ffi`]
//! (`include/rdist.h`) wraps the same code.
//!
//! ```no_run
//! let comm = rdist::Comm::init("env://", -1, -1, &rdist::Options::default())?;
//! let mut grads = vec![1.0f32; 1024];
//! comm.allreduce(&mut grads, rdist::ReduceOp::Avg)?;
//! # Ok::<(), rdist::Error>(())
//! ```

// Layers, top to bottom (data flows one way; tests/layers.rs checks it):
// ffi -> comm -> backend -> algorithms -> transport, with rendezvous
// beside backend (comm uses both). The rest are base modules every layer
// may use: call, descriptor, dtype, reduce, copy, error, options, log,
// trace, auth, random, sync.

/// cbindgen:ignore
pub(crate) mod algorithms;
/// cbindgen:ignore
pub(crate) mod auth;
/// cbindgen:ignore
pub(crate) mod backend;
/// cbindgen:ignore
pub(crate) mod call;
/// cbindgen:ignore
pub(crate) mod comm;
/// cbindgen:ignore
pub(crate) mod copy;
/// cbindgen:ignore
pub(crate) mod descriptor;
/// cbindgen:ignore
pub(crate) mod dtype;
/// cbindgen:ignore
pub(crate) mod error;
pub mod ffi;
/// cbindgen:ignore
pub(crate) mod log;
/// cbindgen:ignore
pub(crate) mod options;
/// cbindgen:ignore
pub(crate) mod random;
/// cbindgen:ignore
pub(crate) mod reduce;
/// cbindgen:ignore
pub(crate) mod rendezvous;
/// cbindgen:ignore
pub(crate) mod sync;
/// cbindgen:ignore
#[cfg(test)]
mod test_rng;
/// cbindgen:ignore
pub(crate) mod trace;
/// cbindgen:ignore
pub(crate) mod transport;

/// Internals for rdist's own tests and benchmark. Not API: anything here
/// may change in any release.
/// cbindgen:ignore
#[doc(hidden)]
pub mod internals {
    pub use crate::backend::cuda::{self, Stream};
    pub use crate::backend::nccl;
    pub use crate::call::{Call, Data, Layout, RawBuf};
    pub use crate::comm::group;
    pub use crate::descriptor::OpKind;
    pub use crate::random::fill as random_bytes;
    pub use crate::rendezvous::method;
    pub use crate::transport::machine::Machine;
    /// This machine's profile (see `transport::machine`).
    pub fn local_machine() -> Machine {
        let host = crate::transport::membership::host_id();
        crate::transport::machine::this_machine(crate::transport::membership::hosts::machine_of(
            &host,
        ))
    }
    pub mod tuner {
        pub use crate::algorithms::tuner::allreduce_bound_s;
    }
}

/// The rendezvous key-value store: a server and a client speaking
/// PyTorch's TCPStore protocol (each interoperates with torch's), and a
/// store in a shared directory.
/// cbindgen:ignore
pub mod store {
    pub use crate::rendezvous::store::{FileStore, Limits, Store, TcpStoreClient, TcpStoreServer};
}

pub use comm::{AbortHandle, Comm, Request};
pub use dtype::{DType, Element};
pub use error::{Error, ErrorKind, Result};
pub use options::{Backend, Options};
pub use reduce::ReduceOp;
pub use transport::tagged::Status;

/// The version, as in Cargo.toml (the header's RDIST_VERSION_* macros
/// are checked against these by a test).
/// cbindgen:ignore
pub const VERSION_MAJOR: u32 = 0;
/// cbindgen:ignore
pub const VERSION_MINOR: u32 = 2;
/// cbindgen:ignore
pub const VERSION_PATCH: u32 = 0;
