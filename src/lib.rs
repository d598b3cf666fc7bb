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

pub mod algorithms;
pub mod backend;
pub mod call;
pub mod comm;
pub mod dtype;
pub mod error;
pub mod ffi;
pub mod group;
pub mod log;
pub mod op;
pub mod options;
pub mod reduce;
pub mod rendezvous;
pub mod transport;
mod typed;

pub use comm::{AbortHandle, Comm, Request};
pub use dtype::{DType, Element};
pub use error::{Error, ErrorKind, Result};
pub use options::{Backend, Options};
pub use reduce::ReduceOp;

/// The version, as in Cargo.toml (the header's RDIST_VERSION_* macros
/// are checked against these by a test).
pub const VERSION_MAJOR: u32 = 0;
pub const VERSION_MINOR: u32 = 1;
pub const VERSION_PATCH: u32 = 0;
