//! Element types: the data type `T` of `x`/`y`/`dy`/`dx` and the statistics type `U`.
//!
//! Every hot loop is generic over [`Element`]; it widens each element to
//! [`Element::Stat`] on load, computes in that type, and rounds once on store.

use half::{bf16, f16};
use std::fmt::{self, Debug};
use std::ops::{Add, Div, Mul, Neg, Sub};

use crate::error::{Error, Result};
use crate::tensor::TensorData;

/// The element type of a [`Tensor`](crate::Tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary16.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE binary32.
    F32,
    /// IEEE binary64 (an extension: TensorFlow's fused ops have no f64 CPU kernel).
    F64,
}

impl DType {
    /// TensorFlow's name for the type (`half`, `bfloat16`, `float`, `double`).
    pub fn tf_name(self) -> &'static str {
        match self {
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::F32 => "float",
            DType::F64 => "double",
        }
    }

    /// Unit roundoff: half the distance from 1 to the next value (2^-11 for f16,
    /// 2^-8 for bf16, 2^-24 for f32, 2^-53 for f64). Rounding to this type changes a
    /// value `v` by at most `epsilon()·|v|`.
    pub fn epsilon(self) -> f64 {
        match self {
            DType::F16 => 2f64.powi(-11),
            DType::BF16 => 2f64.powi(-8),
            DType::F32 => 2f64.powi(-24),
            DType::F64 => 2f64.powi(-53),
        }
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        })
    }
}

impl std::str::FromStr for DType {
    type Err = Error;
    /// Parses `f16`, `bf16`, `f32`, `f64` (also TensorFlow's `half`, `bfloat16`,
    /// `float`, `double`).
    fn from_str(s: &str) -> Result<Self> {
        [DType::F16, DType::BF16, DType::F32, DType::F64]
            .into_iter()
            .find(|d| d.to_string() == s || d.tf_name() == s)
            .ok_or_else(|| Error::InvalidAttr {
                name: "dtype".into(),
                expected: "one of f16, bf16, f32, f64".into(),
                found: s.into(),
            })
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// The statistics / compute type `U`: `f32`, or `f64` for `f64` data.
///
/// Scale, offset, mean, variance, the reserve spaces and the 1-D gradients have
/// this type, and every element of `x` is widened to it before any arithmetic.
pub trait Real:
    crate::kernels::simd::Dispatch
    + Element<Stat = Self>
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + PartialOrd
{
    /// Additive identity.
    const ZERO: Self;
    /// Rounds an `f64` to this type (round to nearest even).
    fn from_f64(v: f64) -> Self;
    /// Widens to `f64` (exact).
    fn to_f64(self) -> f64;
}

/// A tensor element type: `f32`, `f16`, `bf16` (statistics in `f32`) or `f64`.
///
/// This trait is sealed; the four implementations are the only ones.
///
/// Its supertrait `Mono` (hidden) holds this crate's compiled instantiation of the typed
/// API for each type, so that a crate calling [`Problem::forward`](crate::Problem::forward)
/// and the other methods does not compile the kernels again.
pub trait Element:
    Copy
    + Default
    + Debug
    + PartialEq
    + Send
    + Sync
    + 'static
    + sealed::Sealed
    + crate::batch_norm::mono::Mono
{
    /// The statistics type `U` that goes with this element type.
    type Stat: Real;
    /// The run-time tag of this type.
    const DTYPE: DType;
    /// Widens to the compute type (exact).
    fn widen(self) -> Self::Stat;
    /// Rounds a computed value to this type (round to nearest even).
    fn narrow(v: Self::Stat) -> Self;
    /// Wraps a vector of this type as dynamically typed tensor data.
    fn wrap(v: Vec<Self>) -> TensorData;
    /// Borrows dynamically typed data as this type, if it is this type.
    fn slice(d: &TensorData) -> Option<&[Self]>;
}

macro_rules! real {
    ($t:ty, $dt:ident) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
        impl Element for $t {
            type Stat = $t;
            const DTYPE: DType = DType::$dt;
            #[inline(always)]
            fn widen(self) -> $t {
                self
            }
            #[inline(always)]
            fn narrow(v: $t) -> Self {
                v
            }
            fn wrap(v: Vec<Self>) -> TensorData {
                TensorData::$dt(v)
            }
            fn slice(d: &TensorData) -> Option<&[Self]> {
                match d {
                    TensorData::$dt(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
real!(f32, F32);
real!(f64, F64);

macro_rules! half_element {
    ($t:ty, $dt:ident) => {
        impl Element for $t {
            type Stat = f32;
            const DTYPE: DType = DType::$dt;
            #[inline(always)]
            fn widen(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn narrow(v: f32) -> Self {
                <$t>::from_f32(v)
            }
            fn wrap(v: Vec<Self>) -> TensorData {
                TensorData::$dt(v)
            }
            fn slice(d: &TensorData) -> Option<&[Self]> {
                match d {
                    TensorData::$dt(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
half_element!(f16, F16);
half_element!(bf16, BF16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_narrowing_rounds_to_nearest_even() {
        // 1 + 2^-11 is exactly halfway between two f16 values: ties go to even (1.0).
        assert_eq!(f16::narrow(1.0 + 2f32.powi(-11)), f16::from_f32(1.0));
        // 1 + 3 * 2^-11 is halfway between 1+2^-10 and 1+2^-9: ties go to even (1+2^-9).
        assert_eq!(
            f16::narrow(1.0 + 3.0 * 2f32.powi(-11)).to_f32(),
            1.0 + 2f32.powi(-9)
        );
        // bf16 has 8 mantissa bits: 1 + 2^-8 is halfway, goes to 1.0.
        assert_eq!(bf16::narrow(1.0 + 2f32.powi(-8)).to_f32(), 1.0);
        assert_eq!(
            bf16::narrow(1.0 + 3.0 * 2f32.powi(-8)).to_f32(),
            1.0 + 2f32.powi(-6)
        );
    }
}
