//! NCCL's ABI as rdist uses it: result codes and constants, the entry
//! points it needs, the `ncclConfig_t` prefix it passes, and its data types
//! and reduction operations (checked against nccl.h by tests/nccl.rs).

use super::super::loader::{RawResult, NCCL_SUCCESS};
use crate::dtype::DType;
use crate::reduce::ReduceOp;
use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t, ncclUniqueId};

/// `ncclInvalidArgument`.
pub(super) const NCCL_INVALID_ARGUMENT: RawResult = 4;
/// `ncclInvalidUsage`.
pub(super) const NCCL_INVALID_USAGE: RawResult = 5;
/// `ncclRemoteError`: a peer failed or went away.
pub(super) const NCCL_REMOTE_ERROR: RawResult = 6;
/// `ncclInProgress`: a non-blocking call has not finished yet.
pub(super) const NCCL_IN_PROGRESS: RawResult = 7;
/// `NCCL_SPLIT_NOCOLOR`.
pub(super) const NCCL_SPLIT_NOCOLOR: i32 = -1;
/// `NCCL_SHRINK_DEFAULT` and `NCCL_SHRINK_ABORT`.
pub(super) const NCCL_SHRINK_DEFAULT: i32 = 0;
pub(super) const NCCL_SHRINK_ABORT: i32 = 1;
/// `NCCL_API_MAGIC`, which `NCCL_CONFIG_INITIALIZER` puts in `magic`.
const NCCL_API_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: "NCCL's default" for an int field.
const NCCL_CONFIG_UNDEF_INT: i32 = i32::MIN;
/// The `ncclConfig_t` version rdist fills in: `NCCL_VERSION(2, 17, 0)`.
/// NCCL resets every field newer than this to its default.
const CONFIG_VERSION: u32 = 21_700;

/// The entry points the backend cannot run without (the others are
/// optional: split, shrink, finalize, last error).
pub const REQUIRED: [&str; 13] = [
    "ncclCommInitRankConfig",
    "ncclCommAbort",
    "ncclCommDestroy",
    "ncclCommGetAsyncError",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// The start of `ncclConfig_t`, as nccl.h lays it out (NCCL copies
/// `size` bytes of it and keeps its defaults for the rest, and it ignores
/// fields newer than `version`), so this prefix works with every NCCL
/// since 2.17. `traffic_class` is there only so that no padding byte
/// reaches NCCL. tests/nccl.rs checks the layout against the installed
/// NCCL's header.
#[repr(C)]
pub(super) struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: i32,
    cga_cluster_size: i32,
    min_ctas: i32,
    max_ctas: i32,
    net_name: *const std::ffi::c_char,
    split_share: i32,
    traffic_class: i32,
}

impl Config {
    /// NCCL_CONFIG_INITIALIZER with `blocking = 0`.
    pub(super) fn non_blocking() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: NCCL_API_MAGIC,
            version: CONFIG_VERSION,
            blocking: 0,
            cga_cluster_size: NCCL_CONFIG_UNDEF_INT,
            min_ctas: NCCL_CONFIG_UNDEF_INT,
            max_ctas: NCCL_CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: NCCL_CONFIG_UNDEF_INT,
            traffic_class: NCCL_CONFIG_UNDEF_INT,
        }
    }
}

/// rdist's `ncclConfig_t` prefix: its size, and each field's offset under
/// its name in nccl.h. For checking against a header (tests/nccl.rs).
pub fn config_layout() -> (usize, Vec<(&'static str, usize)>) {
    use std::mem::offset_of;
    let fields = vec![
        ("size", offset_of!(Config, size)),
        ("magic", offset_of!(Config, magic)),
        ("version", offset_of!(Config, version)),
        ("blocking", offset_of!(Config, blocking)),
        ("cgaClusterSize", offset_of!(Config, cga_cluster_size)),
        ("minCTAs", offset_of!(Config, min_ctas)),
        ("maxCTAs", offset_of!(Config, max_ctas)),
        ("netName", offset_of!(Config, net_name)),
        ("splitShare", offset_of!(Config, split_share)),
        ("trafficClass", offset_of!(Config, traffic_class)),
    ];
    (std::mem::size_of::<Config>(), fields)
}

/// The NCCL constants and enum values rdist passes or compares, under
/// their names in nccl.h (checked against a header by tests/nccl.rs).
pub fn abi_constants() -> Vec<(&'static str, i64)> {
    let mut v: Vec<(&'static str, i64)> = vec![
        ("ncclSuccess", NCCL_SUCCESS as i64),
        ("ncclInvalidArgument", NCCL_INVALID_ARGUMENT as i64),
        ("ncclInvalidUsage", NCCL_INVALID_USAGE as i64),
        ("ncclRemoteError", NCCL_REMOTE_ERROR as i64),
        ("ncclInProgress", NCCL_IN_PROGRESS as i64),
        ("NCCL_SPLIT_NOCOLOR", NCCL_SPLIT_NOCOLOR as i64),
        ("NCCL_SHRINK_DEFAULT", NCCL_SHRINK_DEFAULT as i64),
        ("NCCL_SHRINK_ABORT", NCCL_SHRINK_ABORT as i64),
        ("NCCL_API_MAGIC", NCCL_API_MAGIC as i64),
        ("NCCL_CONFIG_UNDEF_INT", NCCL_CONFIG_UNDEF_INT as i64),
        (
            "NCCL_UNIQUE_ID_BYTES",
            std::mem::size_of::<ncclUniqueId>() as i64,
        ),
    ];
    let dtypes = [
        ("ncclInt8", DType::Int8),
        ("ncclUint8", DType::Uint8),
        ("ncclInt32", DType::Int32),
        ("ncclUint32", DType::Uint32),
        ("ncclInt64", DType::Int64),
        ("ncclUint64", DType::Uint64),
        ("ncclFloat16", DType::Float16),
        ("ncclFloat32", DType::Float32),
        ("ncclFloat64", DType::Float64),
        ("ncclBfloat16", DType::Bfloat16),
    ];
    v.extend(dtypes.iter().map(|&(n, d)| (n, dtype(d) as i64)));
    let ops = [
        ("ncclSum", ReduceOp::Sum),
        ("ncclProd", ReduceOp::Prod),
        ("ncclMax", ReduceOp::Max),
        ("ncclMin", ReduceOp::Min),
        ("ncclAvg", ReduceOp::Avg),
    ];
    v.extend(ops.iter().map(|&(n, o)| (n, op(o) as i64)));
    v
}

pub(super) fn dtype(d: DType) -> ncclDataType_t {
    use ncclDataType_t as T;
    match d {
        DType::Int8 => T::ncclInt8,
        DType::Uint8 => T::ncclUint8,
        DType::Int32 => T::ncclInt32,
        DType::Uint32 => T::ncclUint32,
        DType::Int64 => T::ncclInt64,
        DType::Uint64 => T::ncclUint64,
        DType::Float16 => T::ncclFloat16,
        DType::Float32 => T::ncclFloat32,
        DType::Float64 => T::ncclFloat64,
        DType::Bfloat16 => T::ncclBfloat16,
        // NCCL has no such types: calls that only move bytes pass them as
        // a type of the same size; reductions on them never come here
        // (`ReduceOp::nccl_can` sends them to the sockets).
        DType::Bool => T::ncclUint8,
        DType::Int16 | DType::Uint16 => T::ncclFloat16,
    }
}

pub(super) fn op(o: ReduceOp) -> ncclRedOp_t {
    match o {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Prod => ncclRedOp_t::ncclProd,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        // Never sent to NCCL (`ReduceOp::nccl_can`); a defined value anyway.
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => ncclRedOp_t::ncclSum,
    }
}
