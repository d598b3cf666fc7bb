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

/// cbindgen:ignore
pub mod algorithms;
/// cbindgen:ignore
pub mod backend;
/// cbindgen:ignore
pub mod call;
/// cbindgen:ignore
pub mod comm;
/// cbindgen:ignore
pub mod copy;
/// cbindgen:ignore
pub mod dtype;
/// cbindgen:ignore
pub mod error;
pub mod ffi;
/// cbindgen:ignore
pub mod group;
/// cbindgen:ignore
pub mod log;
/// cbindgen:ignore
pub mod op;
/// cbindgen:ignore
pub mod options;
/// cbindgen:ignore
pub mod reduce;
/// cbindgen:ignore
pub mod rendezvous;
/// cbindgen:ignore
pub mod trace;
/// cbindgen:ignore
pub mod transport;
/// cbindgen:ignore
mod typed;

pub use comm::{AbortHandle, Comm, Request};
pub use dtype::{DType, Element};
pub use error::{Error, ErrorKind, Result};
pub use options::{Backend, Options};
pub use reduce::ReduceOp;

/// The version, as in Cargo.toml (the header's RDIST_VERSION_* macros
/// are checked against these by a test).
/// cbindgen:ignore
pub const VERSION_MAJOR: u32 = 0;
/// cbindgen:ignore
pub const VERSION_MINOR: u32 = 1;
/// cbindgen:ignore
pub const VERSION_PATCH: u32 = 0;
