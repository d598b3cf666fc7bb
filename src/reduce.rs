//! Reduction operations and the element-wise kernels that apply them to byte
//! buffers (the hot loops of allreduce and reduce-scatter).
//!
//! Dispatch on (dtype, op) happens once per call; each (type, op) pair then
//! runs its own monomorphised loop over typed slices, which the compiler
//! vectorises. Buffers that are not aligned for their type are staged through
//! small aligned stack blocks. float16 and bfloat16 combine in f32 and round
//! back once: bfloat16 per element (its conversions are inline bit operations
//! that vectorise), float16 block-wise through `half`'s slice conversions
//! (F16C where the CPU has it; those are out-of-line calls, so converting
//! whole blocks amortises them).

use std::fmt;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::dtype::{as_bytes, as_bytes_mut, try_from_bytes, try_from_bytes_mut, DType, Element};
use crate::error::{Error, Result};

/// A reduction. Values equal NCCL's `ncclRedOp_t`. Avg is Sum divided by the
/// group size (integers: truncating division).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ReduceOp {
    /// Element-wise sum (integers wrap).
    Sum = 0,
    /// Element-wise product (integers wrap).
    Prod = 1,
    /// Element-wise maximum (floats ignore NaN, like `f32::max`).
    Max = 2,
    /// Element-wise minimum (floats ignore NaN, like `f32::min`).
    Min = 3,
    /// Sum divided by the group size (integers truncate).
    Avg = 4,
    /// Bitwise and, integer and bool types only (since 0.2; rdist's own
    /// values start at 64, clear of the ops NCCL adds and creates).
    Band = 64,
    /// Bitwise or (since 0.2).
    Bor = 65,
    /// Bitwise exclusive or (since 0.2).
    Bxor = 66,
}

impl ReduceOp {
    /// Every op, in C value order.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
        ReduceOp::Band,
        ReduceOp::Bor,
        ReduceOp::Bxor,
    ];

    /// Whether this op applies to `dtype`: bitwise ops need an integer or
    /// bool type, and bool has no average.
    pub fn check(self, dtype: DType) -> Result<()> {
        let bitwise = matches!(self, ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor);
        if bitwise && dtype.is_float() {
            return Err(Error::invalid_argument(format!(
                "op {self} needs an integer or bool dtype, not {dtype}"
            )));
        }
        if self == ReduceOp::Avg && dtype == DType::Bool {
            return Err(Error::invalid_argument(
                "op avg has no meaning for bool (use max for any, min for all)",
            ));
        }
        Ok(())
    }

    /// Whether NCCL has this op for this dtype (else the call runs on the
    /// sockets, device buffers staged through host memory).
    pub fn nccl_can(self, dtype: DType) -> bool {
        !matches!(self, ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor)
            && !matches!(dtype, DType::Bool | DType::Int16 | DType::Uint16)
    }

    /// Lowercase name ("sum").
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
            ReduceOp::Band => "band",
            ReduceOp::Bor => "bor",
            ReduceOp::Bxor => "bxor",
        }
    }
}

impl TryFrom<i32> for ReduceOp {
    type Error = Error;

    /// The op for a C value (`rdist_op_t`).
    fn try_from(value: i32) -> Result<ReduceOp> {
        ReduceOp::ALL
            .iter()
            .copied()
            .find(|op| *op as i32 == value)
            .ok_or_else(|| {
                Error::invalid_argument(format!(
                    "unknown reduction op {value} (rdist_op_t is 0..4 or 64..66)"
                ))
            })
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// dst[i] = dst[i] (op) src[i] element-wise, for byte buffers holding `dtype`
/// elements. Avg combines as Sum (the caller divides once at the end with
/// [`divide`]). Works on any alignment.
///
/// # Panics
/// If the lengths differ or are not a multiple of `dtype.size()` (a caller bug).
pub fn reduce_into(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    check_lengths(dtype, dst.len(), &[src.len()]);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => into_dtype::<Sum>(dst, src, dtype),
        ReduceOp::Prod => into_dtype::<Prod>(dst, src, dtype),
        ReduceOp::Max => into_dtype::<Max>(dst, src, dtype),
        ReduceOp::Min => into_dtype::<Min>(dst, src, dtype),
        ReduceOp::Band => into_dtype::<Band>(dst, src, dtype),
        ReduceOp::Bor => into_dtype::<Bor>(dst, src, dtype),
        ReduceOp::Bxor => into_dtype::<Bxor>(dst, src, dtype),
    }
}

/// out[i] = a[i] (op) b[i]; same rules as [`reduce_into`] (lets algorithms
/// avoid a copy). `out` cannot alias `a` or `b` (the borrow rules enforce it).
///
/// # Panics
/// If the lengths differ or are not a multiple of `dtype.size()` (a caller bug).
pub fn reduce_to(out: &mut [u8], a: &[u8], b: &[u8], dtype: DType, op: ReduceOp) {
    check_lengths(dtype, out.len(), &[a.len(), b.len()]);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => to_dtype::<Sum>(out, a, b, dtype),
        ReduceOp::Prod => to_dtype::<Prod>(out, a, b, dtype),
        ReduceOp::Max => to_dtype::<Max>(out, a, b, dtype),
        ReduceOp::Min => to_dtype::<Min>(out, a, b, dtype),
        ReduceOp::Band => to_dtype::<Band>(out, a, b, dtype),
        ReduceOp::Bor => to_dtype::<Bor>(out, a, b, dtype),
        ReduceOp::Bxor => to_dtype::<Bxor>(out, a, b, dtype),
    }
}

/// buf[i] /= n, for Avg's final step: floats divide (float16/bfloat16 through
/// f32), integers use truncating division.
///
/// # Panics
/// If `n` is 0 or the length is not a multiple of `dtype.size()` (caller bugs).
pub fn divide(buf: &mut [u8], dtype: DType, n: usize) {
    assert!(n > 0, "divide by a group size of 0");
    check_lengths(dtype, buf.len(), &[]);
    match dtype {
        DType::Int8 => native_map::<i8>(buf, |s| i8::divide(s, n)),
        DType::Uint8 => native_map::<u8>(buf, |s| u8::divide(s, n)),
        DType::Int16 => native_map::<i16>(buf, |s| i16::divide(s, n)),
        DType::Uint16 => native_map::<u16>(buf, |s| u16::divide(s, n)),
        // No average for bool (refused when the call is made).
        DType::Bool => {}
        DType::Int32 => native_map::<i32>(buf, |s| i32::divide(s, n)),
        DType::Uint32 => native_map::<u32>(buf, |s| u32::divide(s, n)),
        DType::Int64 => native_map::<i64>(buf, |s| i64::divide(s, n)),
        DType::Uint64 => native_map::<u64>(buf, |s| u64::divide(s, n)),
        DType::Float32 => native_map::<f32>(buf, |s| f32::divide(s, n)),
        DType::Float64 => native_map::<f64>(buf, |s| f64::divide(s, n)),
        DType::Bfloat16 => native_map::<bf16>(buf, |s| bf16::divide(s, n)),
        DType::Float16 => f16_map(buf, |s| f32::divide(s, n)),
    }
}

/// Panics unless every length equals `len` and `len` holds whole elements.
fn check_lengths(dtype: DType, len: usize, others: &[usize]) {
    assert!(
        len.is_multiple_of(dtype.size()) && others.iter().all(|&o| o == len),
        "reduction buffers of {len} and {others:?} bytes do not hold equal numbers of {dtype}"
    );
}

// ---------------------------------------------------------------------------
// Element arithmetic and ops

/// The arithmetic the ops need, per element type.
trait Arith: Element + Default {
    fn add(self, other: Self) -> Self;
    fn mul(self, other: Self) -> Self;
    fn max(self, other: Self) -> Self;
    fn min(self, other: Self) -> Self;
    /// Bitwise and, or, xor (floats: of their bit patterns; never asked
    /// for, since calls refuse bitwise ops on floats).
    fn band(self, other: Self) -> Self;
    fn bor(self, other: Self) -> Self;
    fn bxor(self, other: Self) -> Self;
    /// s[i] /= n.
    fn divide(s: &mut [Self], n: usize);
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            // Wrapping: overflow is defined behaviour for reductions, never a
            // panic (debug builds included).
            #[inline(always)]
            fn add(self, other: Self) -> Self { self.wrapping_add(other) }
            #[inline(always)]
            fn mul(self, other: Self) -> Self { self.wrapping_mul(other) }
            #[inline(always)]
            fn max(self, other: Self) -> Self { Ord::max(self, other) }
            #[inline(always)]
            fn min(self, other: Self) -> Self { Ord::min(self, other) }
            #[inline(always)]
            fn band(self, other: Self) -> Self { self & other }
            #[inline(always)]
            fn bor(self, other: Self) -> Self { self | other }
            #[inline(always)]
            fn bxor(self, other: Self) -> Self { self ^ other }
            fn divide(s: &mut [Self], n: usize) {
                if <$t>::BITS <= 32 {
                    // Through f64, which vectorises where integer division
                    // does not: with |x| < 2^53 the correctly rounded
                    // quotient truncates to the exact integer quotient (and
                    // an n that f64 rounds, beyond 2^53, gives |q| < 1 → 0).
                    let d = n as f64;
                    s.iter_mut().for_each(|x| *x = (*x as f64 / d) as $t);
                    return;
                }
                match <$t>::try_from(n) {
                    // n > 0, so truncating division cannot overflow.
                    Ok(d) => s.iter_mut().for_each(|x| *x /= d),
                    // n exceeds the type's range: divide exactly in i128
                    // (i64::MIN / 2^63 == -1, everything else 0).
                    Err(_) => s
                        .iter_mut()
                        .for_each(|x| *x = (i128::from(*x) / n as i128) as $t),
                }
            }
        }
    )*};
}

int_arith!(i8, u8, i16, u16, i32, u32, i64, u64);

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, other: Self) -> Self { self + other }
            #[inline(always)]
            fn mul(self, other: Self) -> Self { self * other }
            #[inline(always)]
            fn max(self, other: Self) -> Self { <$t>::max(self, other) }
            #[inline(always)]
            fn min(self, other: Self) -> Self { <$t>::min(self, other) }
            #[inline(always)]
            fn band(self, other: Self) -> Self { <$t>::from_bits(self.to_bits() & other.to_bits()) }
            #[inline(always)]
            fn bor(self, other: Self) -> Self { <$t>::from_bits(self.to_bits() | other.to_bits()) }
            #[inline(always)]
            fn bxor(self, other: Self) -> Self { <$t>::from_bits(self.to_bits() ^ other.to_bits()) }
            fn divide(s: &mut [Self], n: usize) {
                let d = n as $t;
                s.iter_mut().for_each(|x| *x /= d);
            }
        }
    )*};
}

float_arith!(f32, f64);

/// bfloat16 combines in f32 and rounds back once, element by element:
/// `half`'s bf16 conversions are inline bit operations, so this fused loop
/// vectorises (and beats staging blocks through f32 buffers).
impl Arith for bf16 {
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        bf16::from_f32(self.to_f32() + other.to_f32())
    }
    #[inline(always)]
    fn mul(self, other: Self) -> Self {
        bf16::from_f32(self.to_f32() * other.to_f32())
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        bf16::from_f32(self.to_f32().max(other.to_f32()))
    }
    #[inline(always)]
    fn min(self, other: Self) -> Self {
        bf16::from_f32(self.to_f32().min(other.to_f32()))
    }
    #[inline(always)]
    fn band(self, other: Self) -> Self {
        bf16::from_bits(self.to_bits() & other.to_bits())
    }
    #[inline(always)]
    fn bor(self, other: Self) -> Self {
        bf16::from_bits(self.to_bits() | other.to_bits())
    }
    #[inline(always)]
    fn bxor(self, other: Self) -> Self {
        bf16::from_bits(self.to_bits() ^ other.to_bits())
    }
    fn divide(s: &mut [Self], n: usize) {
        let d = n as f32;
        s.iter_mut()
            .for_each(|x| *x = bf16::from_f32(x.to_f32() / d));
    }
}

/// A binary reduction, monomorphised per element type.
trait Op {
    fn apply<T: Arith>(a: T, b: T) -> T;
    /// What it is on bool: or (sum, max, bor), and (prod, min, band), xor.
    const LOGIC: Logic;
}

#[derive(Clone, Copy)]
enum Logic {
    Or,
    And,
    Xor,
}

struct Sum;
struct Prod;
struct Max;
struct Min;
struct Band;
struct Bor;
struct Bxor;

impl Op for Band {
    const LOGIC: Logic = Logic::And;
    #[inline(always)]
    fn apply<T: Arith>(a: T, b: T) -> T {
        a.band(b)
    }
}

impl Op for Bor {
    const LOGIC: Logic = Logic::Or;
    #[inline(always)]
    fn apply<T: Arith>(a: T, b: T) -> T {
        a.bor(b)
    }
}

impl Op for Bxor {
    const LOGIC: Logic = Logic::Xor;
    #[inline(always)]
    fn apply<T: Arith>(a: T, b: T) -> T {
        a.bxor(b)
    }
}

/// d[i] = (d[i] != 0) logic (s[i] != 0), as 0 or 1: bool's kernel (bytes
/// need no alignment, and the loop vectorises).
fn bool_into(d: &mut [u8], s: &[u8], logic: Logic) {
    match logic {
        Logic::Or => d
            .iter_mut()
            .zip(s)
            .for_each(|(x, &y)| *x = u8::from(*x != 0 || y != 0)),
        Logic::And => d
            .iter_mut()
            .zip(s)
            .for_each(|(x, &y)| *x = u8::from(*x != 0 && y != 0)),
        Logic::Xor => d
            .iter_mut()
            .zip(s)
            .for_each(|(x, &y)| *x = u8::from((*x != 0) != (y != 0))),
    }
}

/// o[i] = (a[i] != 0) logic (b[i] != 0), as 0 or 1.
fn bool_to(o: &mut [u8], a: &[u8], b: &[u8], logic: Logic) {
    o.copy_from_slice(a);
    bool_into(o, b, logic);
}

impl Op for Sum {
    const LOGIC: Logic = Logic::Or;
    #[inline(always)]
    fn apply<T: Arith>(a: T, b: T) -> T {
        a.add(b)
    }
}

impl Op for Prod {
    const LOGIC: Logic = Logic::And;
    #[inline(always)]
    fn apply<T: Arith>(a: T, b: T) -> T {
        a.mul(b)
    }
}

impl Op for Max {
    const LOGIC: Logic = Logic::Or;
    #[inline(always)]
    fn apply<T: Arith>(a: T, b: T) -> T {
        a.max(b)
    }
}

impl Op for Min {
    const LOGIC: Logic = Logic::And;
    #[inline(always)]
    fn apply<T: Arith>(a: T, b: T) -> T {
        a.min(b)
    }
}

// ---------------------------------------------------------------------------
// Typed loops: plain zips over equal-length slices, so they vectorise.

/// d[i] = d[i] (op) s[i].
#[inline]
fn zip_into<T: Arith, O: Op>(d: &mut [T], s: &[T]) {
    for (x, &y) in d.iter_mut().zip(s) {
        *x = O::apply(*x, y);
    }
}

/// o[i] = a[i] (op) b[i].
#[inline]
fn zip_to<T: Arith, O: Op>(o: &mut [T], a: &[T], b: &[T]) {
    for ((x, &y), &z) in o.iter_mut().zip(a).zip(b) {
        *x = O::apply(y, z);
    }
}

// ---------------------------------------------------------------------------
// Per-dtype dispatch (once per call)

fn into_dtype<O: Op>(dst: &mut [u8], src: &[u8], dtype: DType) {
    match dtype {
        DType::Int8 => native_into::<i8, O>(dst, src),
        DType::Uint8 => native_into::<u8, O>(dst, src),
        DType::Int32 => native_into::<i32, O>(dst, src),
        DType::Uint32 => native_into::<u32, O>(dst, src),
        DType::Int64 => native_into::<i64, O>(dst, src),
        DType::Uint64 => native_into::<u64, O>(dst, src),
        DType::Float32 => native_into::<f32, O>(dst, src),
        DType::Float64 => native_into::<f64, O>(dst, src),
        DType::Bfloat16 => native_into::<bf16, O>(dst, src),
        DType::Float16 => f16_to::<O>(dst, None, src),
        DType::Int16 => native_into::<i16, O>(dst, src),
        DType::Uint16 => native_into::<u16, O>(dst, src),
        DType::Bool => bool_into(dst, src, O::LOGIC),
    }
}

fn to_dtype<O: Op>(out: &mut [u8], a: &[u8], b: &[u8], dtype: DType) {
    match dtype {
        DType::Int8 => native_to::<i8, O>(out, a, b),
        DType::Uint8 => native_to::<u8, O>(out, a, b),
        DType::Int32 => native_to::<i32, O>(out, a, b),
        DType::Uint32 => native_to::<u32, O>(out, a, b),
        DType::Int64 => native_to::<i64, O>(out, a, b),
        DType::Uint64 => native_to::<u64, O>(out, a, b),
        DType::Float32 => native_to::<f32, O>(out, a, b),
        DType::Float64 => native_to::<f64, O>(out, a, b),
        DType::Bfloat16 => native_to::<bf16, O>(out, a, b),
        DType::Float16 => f16_to::<O>(out, Some(a), b),
        DType::Int16 => native_to::<i16, O>(out, a, b),
        DType::Uint16 => native_to::<u16, O>(out, a, b),
        DType::Bool => bool_to(out, a, b, O::LOGIC),
    }
}

// ---------------------------------------------------------------------------
// Drivers: aligned buffers run the typed loop directly; misaligned ones are
// staged through aligned stack blocks (byte copies into L1-resident buffers
// are cheap, and keep the typed loop vectorised without per-element
// unaligned reads).

/// Elements per stack block: 2 KiB for 8-byte types, small enough for L1.
const BLOCK: usize = 256;

/// Whether `b` starts at an address aligned for `T`.
fn aligned<T>(b: &[u8]) -> bool {
    (b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
}

fn native_into<T: Arith, O: Op>(dst: &mut [u8], src: &[u8]) {
    if aligned::<T>(dst) && aligned::<T>(src) {
        zip_into::<T, O>(typed_mut(dst), typed(src));
    } else {
        staged(dst, None, src, zip_into::<T, O>);
    }
}

fn native_to<T: Arith, O: Op>(out: &mut [u8], a: &[u8], b: &[u8]) {
    if aligned::<T>(out) && aligned::<T>(a) && aligned::<T>(b) {
        zip_to::<T, O>(typed_mut(out), typed(a), typed(b));
    } else {
        staged(out, Some(a), b, zip_into::<T, O>);
    }
}

/// Applies `f` to buf's elements, in place.
fn native_map<T: Arith>(buf: &mut [u8], f: impl Fn(&mut [T])) {
    if aligned::<T>(buf) {
        f(typed_mut(buf));
    } else {
        let mut xs = [T::default(); BLOCK];
        for chunk in buf.chunks_mut(BLOCK * std::mem::size_of::<T>()) {
            let x = load_native(chunk, &mut xs);
            f(x);
            chunk.copy_from_slice(as_bytes(x));
        }
    }
}

/// out = (a, or out itself when `a` is None) (f) b, block by block through
/// aligned stack copies; `f` combines its second argument into its first.
#[inline]
fn staged<T: Arith>(out: &mut [u8], a: Option<&[u8]>, b: &[u8], f: impl Fn(&mut [T], &[T])) {
    let step = BLOCK * std::mem::size_of::<T>();
    let mut xs = [T::default(); BLOCK];
    let mut ys = [T::default(); BLOCK];
    for (i, (ob, bb)) in out.chunks_mut(step).zip(b.chunks(step)).enumerate() {
        let first = match a {
            Some(a) => &a[i * step..][..ob.len()],
            None => &*ob,
        };
        let x = load_native(first, &mut xs);
        f(x, load_native(bb, &mut ys));
        ob.copy_from_slice(as_bytes(x));
    }
}

/// Copies `bytes` into the front of `stage`, returning that typed prefix.
#[inline]
fn load_native<'s, T: Element>(bytes: &[u8], stage: &'s mut [T]) -> &'s mut [T] {
    let x = &mut stage[..bytes.len() / std::mem::size_of::<T>()];
    as_bytes_mut(x).copy_from_slice(bytes);
    x
}

/// out = (a, or out itself when `a` is None) (op) b for float16: each block
/// is widened to f32, combined, and rounded back once.
fn f16_to<O: Op>(out: &mut [u8], a: Option<&[u8]>, b: &[u8]) {
    let step = BLOCK * 2;
    let mut stage = [f16::ZERO; BLOCK];
    let mut xs = [0f32; BLOCK];
    let mut ys = [0f32; BLOCK];
    for (i, (ob, bb)) in out.chunks_mut(step).zip(b.chunks(step)).enumerate() {
        let n = ob.len() / 2;
        let (x, y) = (&mut xs[..n], &mut ys[..n]);
        let first = match a {
            Some(a) => &a[i * step..][..ob.len()],
            None => &*ob,
        };
        widen(first, &mut stage[..n], x);
        widen(bb, &mut stage[..n], y);
        zip_into::<f32, O>(x, y);
        narrow(x, &mut stage[..n], ob);
    }
}

/// Applies `f` to buf's float16 values widened to f32, in place.
fn f16_map(buf: &mut [u8], f: impl Fn(&mut [f32])) {
    let mut stage = [f16::ZERO; BLOCK];
    let mut xs = [0f32; BLOCK];
    for chunk in buf.chunks_mut(BLOCK * 2) {
        let n = chunk.len() / 2;
        widen(chunk, &mut stage[..n], &mut xs[..n]);
        f(&mut xs[..n]);
        narrow(&xs[..n], &mut stage[..n], chunk);
    }
}

/// float16 bytes (any alignment) -> f32; `stage` has out's length.
#[inline]
fn widen(bytes: &[u8], stage: &mut [f16], out: &mut [f32]) {
    match try_from_bytes::<f16>(bytes) {
        Some(h) => h.convert_to_f32_slice(out),
        None => {
            as_bytes_mut(stage).copy_from_slice(bytes);
            stage.convert_to_f32_slice(out);
        }
    }
}

/// f32 -> float16 bytes (any alignment), rounding to nearest even.
#[inline]
fn narrow(vals: &[f32], stage: &mut [f16], bytes: &mut [u8]) {
    match try_from_bytes_mut::<f16>(bytes) {
        Some(h) => h.convert_from_f32_slice(vals),
        None => {
            stage.convert_from_f32_slice(vals);
            bytes.copy_from_slice(as_bytes(stage));
        }
    }
}

/// Typed view of bytes the caller checked are aligned (lengths were checked
/// by `check_lengths`).
fn typed<T: Element>(b: &[u8]) -> &[T] {
    try_from_bytes(b).expect("aligned whole-element buffer")
}

/// Mutable form of [`typed`].
fn typed_mut<T: Element>(b: &mut [u8]) -> &mut [T] {
    try_from_bytes_mut(b).expect("aligned whole-element buffer")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use std::fmt::Debug;

    /// Test values and a scalar reference written with plain Rust arithmetic,
    /// independent of the kernels' `Arith`/`Op` machinery.
    trait Sample: Element + Default + Debug {
        /// A value from 64 random bits.
        fn sample(bits: u64) -> Self;
        /// a (op) b, Avg combining as Sum.
        fn reference(op: ReduceOp, a: Self, b: Self) -> Self;
        /// a / n, truncating for integers.
        fn ref_divide(a: Self, n: usize) -> Self;
        /// Equality (floats by value, so 0.0 == -0.0).
        fn same(a: Self, b: Self) -> bool;
    }

    macro_rules! int_sample {
        ($($t:ty),*) => {$(
            impl Sample for $t {
                fn sample(bits: u64) -> Self {
                    // Full range, so sums and products overflow often.
                    bits as $t
                }
                fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                    match op {
                        ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                        ReduceOp::Prod => a.wrapping_mul(b),
                        ReduceOp::Max => Ord::max(a, b),
                        ReduceOp::Min => Ord::min(a, b),
                        ReduceOp::Band => a & b,
                        ReduceOp::Bor => a | b,
                        ReduceOp::Bxor => a ^ b,
                    }
                }
                fn ref_divide(a: Self, n: usize) -> Self {
                    (a as i128 / n as i128) as $t
                }
                fn same(a: Self, b: Self) -> bool {
                    a == b
                }
            }
        )*};
    }

    int_sample!(i8, u8, i16, u16, i32, u32, i64, u64);

    /// A float in -125.0..=125.0 in steps of 1/8: exact in every float type,
    /// and products stay below float16's maximum.
    fn small_float(bits: u64) -> f32 {
        ((bits % 2001) as i32 - 1000) as f32 / 8.0
    }

    fn ref_f32(op: ReduceOp, a: f32, b: f32) -> f32 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
            ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => unreachable!("refused for floats"),
        }
    }

    impl Sample for f32 {
        fn sample(bits: u64) -> Self {
            small_float(bits)
        }
        fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
            ref_f32(op, a, b)
        }
        fn ref_divide(a: Self, n: usize) -> Self {
            a / n as f32
        }
        fn same(a: Self, b: Self) -> bool {
            a == b
        }
    }

    impl Sample for f64 {
        fn sample(bits: u64) -> Self {
            f64::from(small_float(bits)) + 1.0 / 1024.0
        }
        fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Max => a.max(b),
                ReduceOp::Min => a.min(b),
                ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
                    unreachable!("refused for floats")
                }
            }
        }
        fn ref_divide(a: Self, n: usize) -> Self {
            a / n as f64
        }
        fn same(a: Self, b: Self) -> bool {
            a == b
        }
    }

    macro_rules! half_sample {
        ($($t:ty),*) => {$(
            impl Sample for $t {
                fn sample(bits: u64) -> Self {
                    <$t>::from_f32(small_float(bits))
                }
                fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                    <$t>::from_f32(ref_f32(op, a.to_f32(), b.to_f32()))
                }
                fn ref_divide(a: Self, n: usize) -> Self {
                    <$t>::from_f32(a.to_f32() / n as f32)
                }
                fn same(a: Self, b: Self) -> bool {
                    a == b
                }
            }
        )*};
    }

    half_sample!(f16, bf16);

    /// Deterministic xorshift values.
    fn values<T: Sample>(len: usize, seed: u64) -> Vec<T> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                T::sample(s)
            })
            .collect()
    }

    /// Bytes placed at a chosen offset from an 8-aligned address, so offset 1
    /// is misaligned for every multi-byte type.
    struct Placed {
        store: Vec<u64>,
        offset: usize,
        len: usize,
    }

    impl Placed {
        fn new<T: Element>(vals: &[T], offset: usize) -> Placed {
            let src = as_bytes(vals);
            let mut p = Placed {
                store: vec![0; (src.len() + offset) / 8 + 1],
                offset,
                len: src.len(),
            };
            p.bytes_mut().copy_from_slice(src);
            p
        }

        fn bytes(&self) -> &[u8] {
            &as_bytes(&self.store)[self.offset..][..self.len]
        }

        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut as_bytes_mut(&mut self.store)[self.offset..][..self.len]
        }

        fn values<T: Sample>(&self) -> Vec<T> {
            let mut v = vec![T::default(); self.len / std::mem::size_of::<T>()];
            as_bytes_mut(&mut v).copy_from_slice(self.bytes());
            v
        }
    }

    fn assert_same<T: Sample>(got: &[T], want: &[T], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(T::same(g, w), "{what}: element {i}: got {g:?}, want {w:?}");
        }
    }

    /// Offsets (0 aligned, 1 misaligned) for `n` buffers: every combination.
    fn offsets(n: u32) -> impl Iterator<Item = Vec<usize>> {
        (0..1usize << n).map(move |m| (0..n).map(|i| (m >> i) & 1).collect())
    }

    fn check<T: Sample>(op: ReduceOp) {
        for len in [0, 1, 7, 1000] {
            let a = values::<T>(len, 1 + len as u64);
            let b = values::<T>(len, 1000 + len as u64);
            let want: Vec<T> = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| T::reference(op, x, y))
                .collect();
            for off in offsets(2) {
                let what = format!("reduce_into {} {op} len {len} offsets {off:?}", T::DTYPE);
                let mut dst = Placed::new(&a, off[0]);
                let src = Placed::new(&b, off[1]);
                reduce_into(dst.bytes_mut(), src.bytes(), T::DTYPE, op);
                assert_same(&dst.values::<T>(), &want, &what);
            }
            for off in offsets(3) {
                let what = format!("reduce_to {} {op} len {len} offsets {off:?}", T::DTYPE);
                let mut out = Placed::new(&vec![T::default(); len], off[0]);
                let (pa, pb) = (Placed::new(&a, off[1]), Placed::new(&b, off[2]));
                reduce_to(out.bytes_mut(), pa.bytes(), pb.bytes(), T::DTYPE, op);
                assert_same(&out.values::<T>(), &want, &what);
            }
        }
    }

    #[test]
    fn every_dtype_and_op_matches_reference() {
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                if op.check(dtype).is_err() {
                    continue; // refused when the call is made (tested below)
                }
                match dtype {
                    DType::Int16 => check::<i16>(op),
                    DType::Uint16 => check::<u16>(op),
                    DType::Bool => check_bool(op),
                    DType::Int8 => check::<i8>(op),
                    DType::Uint8 => check::<u8>(op),
                    DType::Int32 => check::<i32>(op),
                    DType::Uint32 => check::<u32>(op),
                    DType::Int64 => check::<i64>(op),
                    DType::Uint64 => check::<u64>(op),
                    DType::Float16 => check::<f16>(op),
                    DType::Float32 => check::<f32>(op),
                    DType::Float64 => check::<f64>(op),
                    DType::Bfloat16 => check::<bf16>(op),
                }
            }
        }
    }

    /// Bool against a reference on plain Rust bools: any nonzero byte is
    /// true, results are 0 or 1, at every alignment.
    fn check_bool(op: ReduceOp) {
        let logic = |a: bool, b: bool| match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::Bor => a || b,
            ReduceOp::Prod | ReduceOp::Min | ReduceOp::Band => a && b,
            ReduceOp::Bxor => a != b,
            ReduceOp::Avg => unreachable!("refused for bool"),
        };
        for len in [0usize, 1, 7, 64, 1000] {
            let a: Vec<u8> = (0..len).map(|i| [0u8, 1, 2, 255, 0, 7][i % 6]).collect();
            let b: Vec<u8> = (0..len)
                .map(|i| [0u8, 0, 9, 0, 1, 128][(i * 7 + 3) % 6])
                .collect();
            let want: Vec<u8> = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| u8::from(logic(x != 0, y != 0)))
                .collect();
            let mut into = a.clone();
            reduce_into(&mut into, &b, DType::Bool, op);
            assert_eq!(into, want, "{op} into, {len}");
            let mut out = vec![5u8; len];
            reduce_to(&mut out, &a, &b, DType::Bool, op);
            assert_eq!(out, want, "{op} to, {len}");
        }
    }

    #[test]
    fn bitwise_ops_refuse_floats_and_bool_refuses_avg() {
        for dtype in DType::ALL {
            for op in [ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor] {
                let r = op.check(dtype);
                assert_eq!(r.is_err(), dtype.is_float(), "{op} on {dtype}");
                if let Err(e) = r {
                    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
                    assert!(e.message().contains(dtype.name()), "{e}");
                }
            }
        }
        assert!(ReduceOp::Avg.check(DType::Bool).is_err());
        assert!(ReduceOp::Avg.check(DType::Int16).is_ok());
        assert_eq!(ReduceOp::try_from(64).unwrap(), ReduceOp::Band);
        assert_eq!(DType::try_from(66).unwrap(), DType::Uint16);
        assert!(ReduceOp::try_from(5).is_err() && DType::try_from(10).is_err());
    }

    fn combine<T: Sample>(a: &[T], b: &[T], op: ReduceOp) -> Vec<T> {
        let mut dst = a.to_vec();
        reduce_into(as_bytes_mut(&mut dst), as_bytes(b), T::DTYPE, op);
        let mut out = vec![T::default(); a.len()];
        reduce_to(
            as_bytes_mut(&mut out),
            as_bytes(a),
            as_bytes(b),
            T::DTYPE,
            op,
        );
        assert_same(&out, &dst, "reduce_to vs reduce_into");
        dst
    }

    #[test]
    fn integer_overflow_wraps() {
        assert_eq!(
            combine(&[127i8, -128], &[1, -1], ReduceOp::Sum),
            [-128, 127]
        );
        assert_eq!(combine(&[200u8, 16], &[2, 16], ReduceOp::Prod), [144, 0]);
        assert_eq!(combine(&[u8::MAX], &[1], ReduceOp::Avg), [0]);
        assert_eq!(combine(&[i32::MAX], &[1], ReduceOp::Sum), [i32::MIN]);
        assert_eq!(combine(&[u32::MAX], &[u32::MAX], ReduceOp::Prod), [1]);
        assert_eq!(combine(&[i64::MAX], &[2], ReduceOp::Prod), [-2]);
        assert_eq!(combine(&[u64::MAX], &[1], ReduceOp::Sum), [0]);
    }

    #[test]
    fn float_max_min_ignore_nan() {
        let nan = f32::NAN;
        assert_eq!(combine(&[nan, 1.0], &[2.0, nan], ReduceOp::Max), [2.0, 1.0]);
        assert_eq!(combine(&[nan, 1.0], &[2.0, nan], ReduceOp::Min), [2.0, 1.0]);
        assert_eq!(combine(&[f64::NAN], &[-3.0], ReduceOp::Max), [-3.0]);
        let h = |x: f32| f16::from_f32(x);
        assert_eq!(combine(&[h(nan)], &[h(0.5)], ReduceOp::Min), [h(0.5)]);
    }

    #[test]
    fn half_types_round_once_through_f32() {
        // 2048 + 1 is not representable in f16; f32 sums exactly, rounding
        // back gives 2048 (ties to even).
        let h = |x: f32| f16::from_f32(x);
        assert_eq!(combine(&[h(2048.0)], &[h(1.0)], ReduceOp::Sum), [h(2048.0)]);
        assert_eq!(combine(&[h(2048.0)], &[h(3.0)], ReduceOp::Sum), [h(2052.0)]);
        let b = |x: f32| bf16::from_f32(x);
        assert_eq!(combine(&[b(256.0)], &[b(1.0)], ReduceOp::Sum), [b(256.0)]);
        assert_eq!(combine(&[b(1.5)], &[b(-2.0)], ReduceOp::Prod), [b(-3.0)]);
    }

    fn check_divide<T: Sample>(vals: &[T], n: usize) {
        let want: Vec<T> = vals.iter().map(|&x| T::ref_divide(x, n)).collect();
        for off in [0, 1] {
            let mut buf = Placed::new(vals, off);
            divide(buf.bytes_mut(), T::DTYPE, n);
            let what = format!("divide {} by {n} offset {off}", T::DTYPE);
            assert_same(&buf.values::<T>(), &want, &what);
        }
    }

    fn divide_vec<T: Sample>(vals: &[T], n: usize) -> Vec<T> {
        let mut v = vals.to_vec();
        divide(as_bytes_mut(&mut v), T::DTYPE, n);
        v
    }

    #[test]
    fn divide_truncates_integers() {
        assert_eq!(divide_vec(&[-7i8, 7, -1, 1], 2), [-3, 3, 0, 0]);
        assert_eq!(divide_vec(&[-7i32, 7, i32::MIN], 2), [-3, 3, i32::MIN / 2]);
        assert_eq!(divide_vec(&[-7i64, 7], 2), [-3, 3]);
        assert_eq!(divide_vec(&[7u8, 255], 2), [3, 127]);
        assert_eq!(divide_vec(&[7u32, 8], 3), [2, 2]);
        assert_eq!(divide_vec(&[u64::MAX], 1), [u64::MAX]);
        // Group sizes beyond the type's range.
        assert_eq!(divide_vec(&[-128i8, 127, -127], 128), [-1, 0, 0]);
        assert_eq!(divide_vec(&[255u8], 256), [0]);
        assert_eq!(divide_vec(&[i64::MIN], 1 << 63), [-1]);
        assert_eq!(divide_vec(&[u64::MAX], usize::MAX), [1]);
    }

    #[test]
    fn divide_floats() {
        assert_eq!(divide_vec(&[7.0f32, -7.0], 2), [3.5, -3.5]);
        assert_eq!(divide_vec(&[1.0f64], 3), [1.0 / 3.0]);
        let h = |x: f32| f16::from_f32(x);
        assert_eq!(divide_vec(&[h(3.0), h(-7.0)], 2), [h(1.5), h(-3.5)]);
        let b = |x: f32| bf16::from_f32(x);
        assert_eq!(divide_vec(&[b(-7.0)], 4), [b(-1.75)]);
    }

    #[test]
    fn divide_small_integers_exhaustively() {
        let i8s: Vec<i8> = (i8::MIN..=i8::MAX).collect();
        let u8s: Vec<u8> = (0..=u8::MAX).collect();
        for n in (1..=600).chain([1 << 20, 1 << 53, (1 << 53) + 1, usize::MAX]) {
            check_divide(&i8s, n);
            check_divide(&u8s, n);
        }
        let edges = [i32::MIN, i32::MIN + 1, -1, 0, 1, i32::MAX - 1, i32::MAX];
        let u_edges = [0, 1, u32::MAX / 2, u32::MAX - 1, u32::MAX];
        for n in [
            1,
            2,
            3,
            7,
            65535,
            65536,
            i32::MAX as usize,
            1 << 31,
            u32::MAX as usize,
            1 << 32,
        ] {
            check_divide(&edges, n);
            check_divide(&u_edges, n);
        }
    }

    #[test]
    fn divide_matches_reference_at_any_alignment() {
        for n in [1, 2, 3, 8, 300, 65537, 1 << 33, usize::MAX] {
            check_divide(&values::<i8>(1000, 5), n);
            check_divide(&values::<u8>(1000, 5), n);
            check_divide(&values::<i32>(1000, 6), n);
            check_divide(&values::<u32>(1000, 7), n);
            check_divide(&values::<i64>(1000, 8), n);
            check_divide(&values::<u64>(1000, 9), n);
            check_divide(&values::<f16>(1000, 10), n);
            check_divide(&values::<f32>(1000, 11), n);
            check_divide(&values::<f64>(1000, 12), n);
            check_divide(&values::<bf16>(1000, 13), n);
        }
    }

    #[test]
    #[should_panic(expected = "do not hold equal numbers")]
    fn unequal_lengths_panic() {
        reduce_into(&mut [0u8; 8], &[0u8; 4], DType::Float32, ReduceOp::Sum);
    }

    #[test]
    #[should_panic(expected = "do not hold equal numbers")]
    fn partial_elements_panic() {
        reduce_to(&mut [0u8; 6], &[0; 6], &[0; 6], DType::Int32, ReduceOp::Sum);
    }

    #[test]
    #[should_panic(expected = "group size of 0")]
    fn divide_by_zero_panics() {
        divide(&mut [0u8; 4], DType::Int32, 0);
    }

    #[test]
    fn try_from_accepts_every_c_value() {
        let values = [0, 1, 2, 3, 4, 64, 65, 66];
        for (v, op) in values.iter().zip(ReduceOp::ALL.iter()) {
            assert_eq!(ReduceOp::try_from(*v).unwrap(), *op);
            assert_eq!(*op as i32, *v);
        }
    }

    #[test]
    fn try_from_rejects_unknown_values() {
        for v in [-1, 5, 7, 10, 63, 67, 99, i32::MAX, i32::MIN] {
            let e = ReduceOp::try_from(v).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            assert_eq!(
                e.message(),
                format!("unknown reduction op {v} (rdist_op_t is 0..4 or 64..66)")
            );
        }
    }

    #[test]
    fn names() {
        let names: Vec<String> = ReduceOp::ALL.iter().map(|op| op.to_string()).collect();
        assert_eq!(
            names,
            ["sum", "prod", "max", "min", "avg", "band", "bor", "bxor"]
        );
        for op in ReduceOp::ALL {
            assert_eq!(op.name(), op.to_string());
        }
    }

    /// Throughput on 16 MiB buffers, in GB/s of destination bytes per second.
    /// Run: cargo test --release -- --ignored --nocapture throughput
    #[test]
    #[ignore]
    fn throughput() {
        const BYTES: usize = 16 << 20;
        let src = vec![0x3c3c_3c3c_3c3c_3c3cu64; BYTES / 8 + 1];
        let mut dst = vec![0x3c3c_3c3c_3c3c_3c3cu64; BYTES / 8 + 1];
        let mut out = vec![0u64; BYTES / 8 + 1];
        let s = &as_bytes(&src)[..BYTES];
        let s1 = &as_bytes(&src)[1..][..BYTES];
        let mut run = |name: &str, dtype: Option<(DType, usize)>| {
            let d = &mut as_bytes_mut(&mut dst)[..BYTES];
            let o = &mut as_bytes_mut(&mut out)[..BYTES];
            let secs = best_of(|| match (name, dtype) {
                ("memcpy", _) => d.copy_from_slice(s),
                ("into", Some((t, _))) => reduce_into(d, s, t, ReduceOp::Sum),
                ("to", Some((t, _))) => reduce_to(o, d, s, t, ReduceOp::Sum),
                ("into+1", Some((t, _))) => reduce_into(d, s1, t, ReduceOp::Sum),
                ("divide", Some((t, n))) => divide(d, t, n),
                _ => unreachable!(),
            });
            let label = dtype.map_or(String::new(), |(t, _)| t.to_string());
            println!(
                "{name:>8} {label:>8}: {:6.2} GB/s",
                BYTES as f64 / secs / 1e9
            );
        };
        run("memcpy", None);
        for t in [
            DType::Float32,
            DType::Float16,
            DType::Bfloat16,
            DType::Float64,
            DType::Int32,
        ] {
            run("into", Some((t, 1)));
            run("to", Some((t, 1)));
            run("into+1", Some((t, 1)));
        }
        run("memcpy", None);
        run("divide", Some((DType::Float32, 3)));
        run("divide", Some((DType::Int32, 3)));
        run("divide", Some((DType::Float16, 3)));
    }

    /// Best wall time of several runs of `f`, after a warm-up run.
    fn best_of(mut f: impl FnMut()) -> f64 {
        f();
        (0..15)
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                std::hint::black_box(());
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }
}
