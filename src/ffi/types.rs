//! The C types: opaque handles, result/dtype/op/backend enums, unique id.
//! Enum *arguments* arrive as plain integers (`RawDType` etc., shown as
//! the enum types in the header) and are validated with TryFrom.

use super::handles::{self, Handle, Liveness};
use crate::comm::{Comm, Request};
use crate::error::ErrorKind;
use crate::options::Options;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::{c_char, c_int};
use std::mem::ManuallyDrop;

/// Result of every fallible call; 0 is success. Details of a failure are in
/// rdist_last_error().
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum rdist_result_t {
    RDIST_SUCCESS = 0,
    /// Bad pointer, count, rank, dtype, op or option.
    RDIST_ERR_INVALID_ARGUMENT = 1,
    /// Call not allowed in this state.
    RDIST_ERR_INVALID_USAGE = 2,
    /// A bounded wait ran out.
    RDIST_ERR_TIMEOUT = 3,
    /// A rank exited, crashed or disconnected.
    RDIST_ERR_PEER_LOST = 4,
    /// Ranks called different collectives/counts/dtypes.
    RDIST_ERR_MISMATCH = 5,
    /// The communicator was aborted.
    RDIST_ERR_ABORTED = 6,
    /// The requested backend is not usable here.
    RDIST_ERR_UNAVAILABLE = 7,
    /// An OS or network call failed.
    RDIST_ERR_SYSTEM = 8,
    /// NCCL or CUDA reported an error.
    RDIST_ERR_BACKEND = 9,
    /// A peer failed the job's authentication.
    RDIST_ERR_AUTH = 10,
    /// A bug in rdist.
    RDIST_ERR_INTERNAL = 11,
}

impl From<ErrorKind> for rdist_result_t {
    fn from(k: ErrorKind) -> rdist_result_t {
        use rdist_result_t::*;
        match k {
            ErrorKind::InvalidArgument => RDIST_ERR_INVALID_ARGUMENT,
            ErrorKind::InvalidUsage => RDIST_ERR_INVALID_USAGE,
            ErrorKind::Timeout => RDIST_ERR_TIMEOUT,
            ErrorKind::PeerLost => RDIST_ERR_PEER_LOST,
            ErrorKind::Mismatch => RDIST_ERR_MISMATCH,
            ErrorKind::Aborted => RDIST_ERR_ABORTED,
            ErrorKind::Unavailable => RDIST_ERR_UNAVAILABLE,
            ErrorKind::System => RDIST_ERR_SYSTEM,
            ErrorKind::Backend => RDIST_ERR_BACKEND,
            ErrorKind::Auth => RDIST_ERR_AUTH,
            ErrorKind::Internal => RDIST_ERR_INTERNAL,
        }
    }
}

/// Element types. Values equal NCCL's ncclDataType_t, so engines can cast
/// directly.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum rdist_dtype_t {
    RDIST_INT8 = 0,
    RDIST_UINT8 = 1,
    RDIST_INT32 = 2,
    RDIST_UINT32 = 3,
    RDIST_INT64 = 4,
    RDIST_UINT64 = 5,
    RDIST_FLOAT16 = 6,
    RDIST_FLOAT32 = 7,
    RDIST_FLOAT64 = 8,
    RDIST_BFLOAT16 = 9,
    /// One byte: 0 is false, anything else true; results are 0 or 1. Since
    /// 0.2. rdist's own types start at 64, so that the types NCCL adds
    /// (counting up from 9; 10 and 11 are its float8 types) never collide.
    RDIST_BOOL = 64,
    /// Since 0.2.
    RDIST_INT16 = 65,
    /// Since 0.2.
    RDIST_UINT16 = 66,
}

/// Reductions. Values equal NCCL's ncclRedOp_t. AVG is SUM divided by the
/// group size (for integers: truncating division).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum rdist_op_t {
    RDIST_SUM = 0,
    RDIST_PROD = 1,
    RDIST_MAX = 2,
    RDIST_MIN = 3,
    RDIST_AVG = 4,
    /// Bitwise and, on integer and bool types (a floating-point dtype is
    /// RDIST_ERR_INVALID_ARGUMENT). Since 0.2. rdist's own ops start at 64:
    /// NCCL's built-in ops count up from 0, and the ops it creates at run
    /// time (ncclRedOpCreatePreMulSum) count up from ncclNumOps. On
    /// RDIST_BOOL, SUM and MAX are logical or, PROD and MIN logical and;
    /// AVG is RDIST_ERR_INVALID_ARGUMENT. On an NCCL communicator these
    /// reductions (and any on BOOL, INT16, UINT16) run on the sockets,
    /// device buffers staged through host memory.
    RDIST_BAND = 64,
    /// Bitwise or. Since 0.2.
    RDIST_BOR = 65,
    /// Bitwise exclusive or. Since 0.2.
    RDIST_BXOR = 66,
}

/// Backends.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum rdist_backend_t {
    RDIST_BACKEND_AUTO = 0,
    RDIST_BACKEND_SOCKET = 1,
    RDIST_BACKEND_NCCL = 2,
}

/// An rdist_result_t as it arrives (any int).
pub type RawResult = c_int;
/// An rdist_dtype_t as it arrives (any int; validated, never transmuted).
pub type RawDType = c_int;
/// An rdist_op_t as it arrives.
pub type RawOp = c_int;
/// An rdist_backend_t as it is written out.
pub type RawBackend = c_int;

/// Size of rdist_unique_id_t.
pub const RDIST_UNIQUE_ID_BYTES: usize = 128;

/// Opaque bytes from rdist_get_unique_id(); copy all of them to every rank.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdist_unique_id_t {
    pub internal: [c_char; RDIST_UNIQUE_ID_BYTES],
}

/// Pass as color to rdist_comm_split() to take no part in any new
/// communicator.
pub const RDIST_SPLIT_NOCOLOR: c_int = -1;

/// rdist_comm_shrink() flags (NCCL's values): queued calls on the parent
/// finish first.
pub const RDIST_SHRINK_DEFAULT: c_int = 0;

/// rdist_comm_shrink() flags: abort the parent first, ending its calls in
/// flight here and on every rank it reaches.
pub const RDIST_SHRINK_ABORT: c_int = 1;

/// As peer of a tagged receive: a message from any rank (since 0.2).
pub const RDIST_ANY_SOURCE: c_int = -1;

/// As tag of a tagged receive: a message with any tag (since 0.2).
pub const RDIST_ANY_TAG: c_int = -1;

/// Who sent a received message, with which tag, and how many elements
/// (since 0.2).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct rdist_status_t {
    /// The rank the message came from (of a send: the rank it went to).
    pub source: c_int,
    /// Its tag.
    pub tag: c_int,
    /// Elements received.
    pub count: usize,
}

/// A communicator (process group).
pub struct rdist_comm(CommSlot);

/// An operation in flight.
pub struct rdist_request(RequestSlot);

/// Key/value settings.
pub struct rdist_options(OptionsSlot);

// A handle's contents, the liveness word first (`#[repr(C)]`): a handle of
// another kind is read at the same place (see `handles`). The handles
// themselves stay opaque to C (no `#[repr(C)]`); each holds its slot
// alone, at offset 0 (checked below).

#[repr(C)]
pub struct CommSlot {
    pub(crate) live: Liveness,
    pub(crate) comm: ManuallyDrop<Comm>,
}

#[repr(C)]
pub struct RequestSlot {
    pub(crate) live: Liveness,
    pub(crate) req: ManuallyDrop<Request>,
}

#[repr(C)]
pub struct OptionsSlot {
    pub(crate) live: Liveness,
    pub(crate) opts: ManuallyDrop<Options>,
}

macro_rules! handle_of {
    ($handle:ident, $slot:ident, $field:ident, $value:ty, $kind:expr, $retires:literal) => {
        impl $handle {
            /// A new handle holding `value`, as the pointer C gets.
            pub(crate) fn create(value: $value) -> *mut $handle {
                handles::create($handle($slot {
                    live: Liveness::of::<$handle>(),
                    $field: ManuallyDrop::new(value),
                }))
            }
        }

        impl std::ops::Deref for $handle {
            type Target = $slot;
            fn deref(&self) -> &$slot {
                &self.0
            }
        }

        impl std::ops::DerefMut for $handle {
            fn deref_mut(&mut self) -> &mut $slot {
                &mut self.0
            }
        }

        const _: () = assert!(
            std::mem::offset_of!($handle, 0) == 0 && std::mem::offset_of!($slot, live) == 0
        );

        impl Handle for $handle {
            const LIVE: u32 = $kind.0;
            const KIND: &'static str = $kind.1;
            const RETIRED_BY: &'static str = $kind.2;
            const RETIRES: &'static str = $retires;

            fn liveness(&self) -> &Liveness {
                &self.live
            }

            unsafe fn drop_value(&mut self) {
                // SAFETY: as the trait says (once, nothing reads it after).
                unsafe { ManuallyDrop::drop(&mut self.$field) }
            }

            fn with_tombstones<R>(f: impl FnOnce(&mut VecDeque<Box<$handle>>) -> R) -> Option<R> {
                thread_local! {
                    static KEPT: RefCell<VecDeque<Box<$handle>>> =
                        const { RefCell::new(VecDeque::new()) };
                }
                KEPT.try_with(|kept| f(&mut kept.borrow_mut())).ok()
            }
        }
    };
}
handle_of!(rdist_comm, CommSlot, comm, Comm, handles::COMM, "destroyed");
handle_of!(
    rdist_request,
    RequestSlot,
    req,
    Request,
    handles::REQUEST,
    "freed"
);
handle_of!(
    rdist_options,
    OptionsSlot,
    opts,
    Options,
    handles::OPTIONS,
    "destroyed"
);

/// A communicator (process group).
pub type rdist_comm_t = rdist_comm;
/// An operation in flight.
pub type rdist_request_t = rdist_request;
/// Key/value settings.
pub type rdist_options_t = rdist_options;
