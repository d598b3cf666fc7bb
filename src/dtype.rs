//! Element types of collective buffers, and safe byte views of typed slices.

use std::fmt;
use std::mem::{align_of, size_of};

use half::{bf16, f16};

use crate::error::{Error, Result};

/// The element type of a buffer. Values equal NCCL's `ncclDataType_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DType {
    /// Signed 8-bit integer.
    Int8 = 0,
    /// Unsigned 8-bit integer.
    Uint8 = 1,
    /// Signed 32-bit integer.
    Int32 = 2,
    /// Unsigned 32-bit integer.
    Uint32 = 3,
    /// Signed 64-bit integer.
    Int64 = 4,
    /// Unsigned 64-bit integer.
    Uint64 = 5,
    /// IEEE 754 half precision (`half::f16`).
    Float16 = 6,
    /// IEEE 754 single precision.
    Float32 = 7,
    /// IEEE 754 double precision.
    Float64 = 8,
    /// Brain floating point, f32 with a 7-bit mantissa (`half::bf16`).
    Bfloat16 = 9,
    /// One byte: 0 is false, anything else true (since 0.2; rdist's own
    /// values start at 64, clear of the types NCCL adds).
    Bool = 64,
    /// Signed 16-bit integer (since 0.2).
    Int16 = 65,
    /// Unsigned 16-bit integer (since 0.2).
    Uint16 = 66,
}

impl DType {
    /// Every dtype, in C value order.
    pub const ALL: [DType; 13] = [
        DType::Int8,
        DType::Uint8,
        DType::Int32,
        DType::Uint32,
        DType::Int64,
        DType::Uint64,
        DType::Float16,
        DType::Float32,
        DType::Float64,
        DType::Bfloat16,
        DType::Bool,
        DType::Int16,
        DType::Uint16,
    ];

    /// The dtype for a C value (`rdist_dtype_t`), None for no dtype.
    #[inline]
    pub fn from_c(value: i32) -> Option<DType> {
        use DType::*;
        Some(match value {
            0 => Int8,
            1 => Uint8,
            2 => Int32,
            3 => Uint32,
            4 => Int64,
            5 => Uint64,
            6 => Float16,
            7 => Float32,
            8 => Float64,
            9 => Bfloat16,
            64 => Bool,
            65 => Int16,
            66 => Uint16,
            _ => return None,
        })
    }

    /// Bytes per element.
    #[inline]
    pub fn size(self) -> usize {
        match self {
            DType::Int8 | DType::Uint8 | DType::Bool => 1,
            DType::Float16 | DType::Bfloat16 | DType::Int16 | DType::Uint16 => 2,
            DType::Int32 | DType::Uint32 | DType::Float32 => 4,
            DType::Int64 | DType::Uint64 | DType::Float64 => 8,
        }
    }

    /// Lowercase name, as used in messages and the C header ("float32").
    pub fn name(self) -> &'static str {
        match self {
            DType::Int8 => "int8",
            DType::Uint8 => "uint8",
            DType::Int32 => "int32",
            DType::Uint32 => "uint32",
            DType::Int64 => "int64",
            DType::Uint64 => "uint64",
            DType::Float16 => "float16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
            DType::Bfloat16 => "bfloat16",
            DType::Bool => "bool",
            DType::Int16 => "int16",
            DType::Uint16 => "uint16",
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::Float16 | DType::Float32 | DType::Float64 | DType::Bfloat16
        )
    }

    /// Size in bytes of `count` elements; InvalidArgument if it overflows `usize`.
    pub fn bytes(self, count: usize) -> Result<usize> {
        count.checked_mul(self.size()).ok_or_else(|| {
            let exact = count as u128 * self.size() as u128;
            Error::invalid_argument(format!(
                "count {count} of {self} overflows size_t ({exact} bytes)"
            ))
        })
    }
}

impl TryFrom<i32> for DType {
    type Error = Error;

    /// The dtype for a C value (`rdist_dtype_t`).
    fn try_from(value: i32) -> Result<DType> {
        DType::from_c(value).ok_or_else(|| {
            Error::invalid_argument(format!(
                "unknown dtype {value} (rdist_dtype_t is 0..9 or 64..66)"
            ))
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    /// Keeps `Element` closed: the byte views below are only sound for
    /// padding-free types whose every bit pattern is a valid value.
    pub trait Sealed {}
}

/// Rust element types that map to a DType (used by the typed safe API).
///
/// Sealed: implemented exactly for `i8, u8, i16, u16, i32, u32, i64, u64,
/// f16, f32, f64, bf16`, all plain old data (no padding, every bit pattern
/// valid). Bool has no Rust element type (not every byte is a valid
/// `bool`): use u8 buffers with `DType::Bool` through the raw API.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The dtype of this Rust type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

element! {
    i8 => Int8, u8 => Uint8, i16 => Int16, u16 => Uint16, i32 => Int32, u32 => Uint32, i64 => Int64,
    u64 => Uint64, f16 => Float16, f32 => Float32, f64 => Float64, bf16 => Bfloat16,
}

/// View a typed slice as its bytes (native byte order).
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: Element types are sealed plain old data without padding, so
    // every byte is initialised; u8 has alignment 1 and the length is the
    // slice's exact size in bytes, borrowed for the same lifetime.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// View a mutable typed slice as its bytes (native byte order).
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; in addition every bit pattern is a valid
    // Element value, so any bytes written through the view are sound.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// View bytes as a typed slice, if they are aligned for `T` and a whole
/// number of elements long; `None` otherwise.
pub fn try_from_bytes<T: Element>(b: &[u8]) -> Option<&[T]> {
    if !fits::<T>(b) {
        return None;
    }
    // SAFETY: `fits` checked alignment and that the length is a multiple of
    // size_of::<T>(); every bit pattern is a valid T (sealed POD), and the
    // view borrows `b` for its lifetime.
    Some(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / size_of::<T>()) })
}

/// Mutable form of [`try_from_bytes`].
pub fn try_from_bytes_mut<T: Element>(b: &mut [u8]) -> Option<&mut [T]> {
    if !fits::<T>(b) {
        return None;
    }
    // SAFETY: as in `try_from_bytes`; the exclusive borrow of `b` moves to
    // the view, and any T written is valid as bytes (no padding).
    Some(unsafe {
        std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<T>(), b.len() / size_of::<T>())
    })
}

/// Whether `b` starts aligned for `T` and holds whole elements.
fn fits<T>(b: &[u8]) -> bool {
    (b.as_ptr() as usize).is_multiple_of(align_of::<T>()) && b.len().is_multiple_of(size_of::<T>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn try_from_accepts_every_c_value() {
        let values = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 64, 65, 66];
        for (v, d) in values.iter().zip(DType::ALL.iter()) {
            assert_eq!(DType::try_from(*v).unwrap(), *d);
            assert_eq!(*d as i32, *v);
        }
    }

    #[test]
    fn try_from_rejects_unknown_values() {
        for v in [-1, 10, 11, 63, 67, 99, i32::MAX, i32::MIN] {
            let e = DType::try_from(v).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            assert_eq!(
                e.message(),
                format!("unknown dtype {v} (rdist_dtype_t is 0..9 or 64..66)")
            );
        }
    }

    #[test]
    fn size_name_and_float() {
        let expect = [
            (1, "int8", false),
            (1, "uint8", false),
            (4, "int32", false),
            (4, "uint32", false),
            (8, "int64", false),
            (8, "uint64", false),
            (2, "float16", true),
            (4, "float32", true),
            (8, "float64", true),
            (2, "bfloat16", true),
            (1, "bool", false),
            (2, "int16", false),
            (2, "uint16", false),
        ];
        for (d, (size, name, float)) in DType::ALL.iter().zip(expect) {
            assert_eq!((d.size(), d.name(), d.is_float()), (size, name, float));
            assert_eq!(d.to_string(), name);
        }
    }

    #[test]
    fn element_sizes_match_dtypes() {
        fn check<T: Element>() {
            assert_eq!(size_of::<T>(), T::DTYPE.size(), "{}", T::DTYPE);
        }
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
        check::<f16>();
        check::<f32>();
        check::<f64>();
        check::<bf16>();
    }

    #[test]
    fn bytes_multiplies() {
        assert_eq!(DType::Float32.bytes(0).unwrap(), 0);
        assert_eq!(DType::Float32.bytes(1000).unwrap(), 4000);
        assert_eq!(DType::Uint8.bytes(usize::MAX).unwrap(), usize::MAX);
        assert_eq!(
            DType::Float64.bytes(usize::MAX / 8).unwrap(),
            usize::MAX / 8 * 8
        );
    }

    #[test]
    fn bytes_overflow_is_invalid_argument() {
        let count = usize::MAX / 4 + 1;
        let e = DType::Float32.bytes(count).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let exact = count as u128 * 4;
        assert_eq!(
            e.message(),
            format!("count {count} of float32 overflows size_t ({exact} bytes)")
        );
        assert!(DType::Bfloat16.bytes(usize::MAX).is_err());
    }

    #[cfg(target_pointer_width = "64")]
    #[test]
    fn bytes_overflow_message_literal() {
        let e = DType::Float32.bytes(4611686018427387904).unwrap_err();
        assert_eq!(
            e.message(),
            "count 4611686018427387904 of float32 overflows size_t (18446744073709551616 bytes)"
        );
    }

    #[test]
    fn byte_views_round_trip() {
        let mut v = [1u32, 0x0102_0304, u32::MAX];
        assert_eq!(as_bytes(&v).len(), 12);
        assert_eq!(&as_bytes(&v)[4..8], &0x0102_0304u32.to_ne_bytes());
        as_bytes_mut(&mut v)[0..4].copy_from_slice(&7u32.to_ne_bytes());
        assert_eq!(v[0], 7);
        let back: &[u32] = try_from_bytes(as_bytes(&v)).unwrap();
        assert_eq!(back, &v);
        let h = [f16::from_f32(1.5), f16::from_f32(-2.0)];
        assert_eq!(try_from_bytes::<f16>(as_bytes(&h)).unwrap(), &h);
    }

    #[test]
    fn typed_views_reject_misaligned_or_partial() {
        let mut store = [0u64; 4];
        let bytes = as_bytes_mut(&mut store);
        assert!(try_from_bytes::<u32>(&bytes[1..9]).is_none());
        assert!(try_from_bytes::<u32>(&bytes[0..6]).is_none());
        assert_eq!(try_from_bytes::<u32>(&bytes[4..12]).unwrap().len(), 2);
        assert!(try_from_bytes_mut::<f64>(&mut bytes[4..12]).is_none());
        assert_eq!(
            try_from_bytes_mut::<u8>(&mut bytes[3..10]).unwrap().len(),
            7
        );
    }
}
