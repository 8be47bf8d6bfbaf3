//! Explicit SIMD: one generic loop body per kernel, compiled for each instruction set
//! and chosen at run time.
//!
//! A kernel implements [`Kernel`]: a body generic over an ISA token `S: Simd<U>`.
//! [`Isa::run`] picks the token's ISA and calls the body inside a
//! `#[target_feature]` function, so the body (marked `#[inline(always)]`) is compiled
//! with that ISA's instructions. Dispatch happens once per task (not per element): a
//! rayon closure does not inherit target features, so the parallel drivers call
//! `Isa::run` inside each task.
//!
//! | ISA | lanes | needs |
//! |---|---|---|
//! | [`Isa::Avx512`] | 16 × f32 | AVX-512 F, BW, VL (masked tails, F16C-style conversions) |
//! | [`Isa::Avx2`] | 8 × f32 | AVX2, FMA, F16C |
//! | [`Isa::Scalar`] | 8 × f32 or f64 arrays, compiler-vectorized | nothing (also every f64 kernel) |
//!
//! `FUSEDBN_ISA=scalar|avx2|avx512` sets the default ISA (an unsupported or unknown
//! value is ignored); [`Problem::with_isa`](crate::Problem::with_isa) sets it per problem.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use crate::element::Element;
use crate::error::Error;

pub use portable::Portable;

/// An instruction set the kernels can be compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust over arrays of 8 lanes (the compiler vectorizes what it can).
    Scalar,
    /// AVX2 with FMA and F16C, 8 f32 lanes.
    Avx2,
    /// AVX-512 (F, BW, VL), 16 f32 lanes with masked tails.
    Avx512,
}

impl Isa {
    /// Every ISA, slowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The name used by `FUSEDBN_ISA` and `fusedbn bench --isa`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether this machine can run the ISA.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The ISAs this machine supports, slowest first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// The best supported ISA.
    pub fn detect() -> Isa {
        *Isa::ALL
            .iter()
            .rev()
            .find(|i| i.is_supported())
            .unwrap_or(&Isa::Scalar)
    }

    /// The default: `FUSEDBN_ISA` when it names a supported ISA, else [`Isa::detect`].
    /// Read once per process.
    pub fn default_isa() -> Isa {
        static DEFAULT: OnceLock<Isa> = OnceLock::new();
        *DEFAULT.get_or_init(|| {
            std::env::var("FUSEDBN_ISA")
                .ok()
                .and_then(|v| v.parse::<Isa>().ok())
                .filter(|i| i.is_supported())
                .unwrap_or_else(Isa::detect)
        })
    }

    /// Runs `k` compiled for this ISA (f32 kernels); an ISA this machine lacks runs
    /// the portable code instead.
    #[inline]
    pub fn run<K: Kernel<f32>>(self, k: K) -> K::Output {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the features were detected on this CPU (cached after the first call).
            Isa::Avx512 if self.is_supported() => unsafe { avx512::run(k) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 if self.is_supported() => unsafe { avx2::run(k) },
            _ => k.run(Portable),
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Isa {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| Error::InvalidAttr {
                name: "isa".into(),
                expected: "one of scalar, avx2, avx512".into(),
                found: s.into(),
            })
    }
}

/// A kernel body, generic over the ISA token.
pub trait Kernel<U> {
    /// What the kernel returns.
    type Output;
    /// The body. Implementations must be `#[inline(always)]` so that they are compiled
    /// with the target features of the dispatching function.
    fn run<S: Simd<U>>(self, s: S) -> Self::Output;
}

/// Runs an f32 or f64 kernel on the given ISA (f64 kernels are always portable).
/// A supertrait of [`Real`](crate::Real).
pub trait Dispatch: Sized {
    /// Runs `k` for this compute type on `isa`.
    fn dispatch<K: Kernel<Self>>(isa: Isa, k: K) -> K::Output;
}

impl Dispatch for f32 {
    #[inline]
    fn dispatch<K: Kernel<f32>>(isa: Isa, k: K) -> K::Output {
        isa.run(k)
    }
}

impl Dispatch for f64 {
    #[inline]
    fn dispatch<K: Kernel<f64>>(_isa: Isa, k: K) -> K::Output {
        k.run(Portable)
    }
}

/// An ISA token: proof that the ISA's instructions may be used, and the operations on
/// its vector of `LANES` compute values `U`.
///
/// Loads widen elements of `x` (`T` with `T::Stat = U`) to `U` lanes; stores round
/// to `T` (to nearest even). `*_partial` handle a slice shorter than `LANES` (loads
/// fill the missing lanes with zero; stores write only the slice). `stream` is a store
/// that may bypass the cache (non-temporal) for large outputs.
pub trait Simd<U>: Copy + Send + Sync + 'static {
    /// Lanes per vector.
    const LANES: usize;
    /// The vector type.
    type V: Copy;
    /// All lanes `v`.
    fn splat(self, v: U) -> Self::V;
    /// `a + b`.
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a − b`.
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a · b`.
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a · b + c` (fused where the ISA has FMA).
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// The lanes summed in `f64`, lane 0 first.
    fn sum_f64(self, v: Self::V) -> f64;
    /// Loads `LANES` elements (`src.len() >= LANES`).
    fn load<T: Element<Stat = U>>(self, src: &[T]) -> Self::V;
    /// Loads `src.len() < LANES` elements, zero in the other lanes.
    fn load_partial<T: Element<Stat = U>>(self, src: &[T]) -> Self::V;
    /// Stores `LANES` elements (`dst.len() >= LANES`).
    fn store<T: Element<Stat = U>>(self, dst: &mut [T], v: Self::V);
    /// Stores the first `dst.len() < LANES` lanes.
    fn store_partial<T: Element<Stat = U>>(self, dst: &mut [T], v: Self::V);
    /// Stores `LANES` elements, bypassing the cache when `dst` is suitably aligned.
    /// Callers issue [`Simd::fence`] before the data is read by another thread.
    fn stream<T: Element<Stat = U>>(self, dst: &mut [T], v: Self::V) {
        self.store(dst, v)
    }
    /// Orders preceding streaming stores before later stores.
    fn fence(self) {}
    /// Hints that the cache line holding `data[0]` will be read soon (into L2). A
    /// hint only: no effect on results; empty slices are ignored.
    fn prefetch<T>(self, _data: &[T]) {}
}

// Array helpers for kernels with several inputs or constants. Plain loops, not
// `array::map` closures: a closure is compiled as a function of its own, without the
// kernel's target features, and the intrinsics inside it would become calls.

/// `[splat(v[0]), splat(v[1]), …]`.
#[inline(always)]
pub(crate) fn splat_n<U: Copy, S: Simd<U>, const N: usize>(s: S, v: [U; N]) -> [S::V; N] {
    let mut out = [s.splat(v[0]); N];
    for i in 1..N {
        out[i] = s.splat(v[i]);
    }
    out
}

/// `[load(src[0][at..]), load(src[1][at..]), …]`.
#[inline(always)]
pub(crate) fn load_n<U: Copy, S: Simd<U>, T: Element<Stat = U>, const N: usize>(
    s: S,
    src: &[&[T]; N],
    at: usize,
) -> [S::V; N] {
    let mut out = [s.load(&src[0][at..]); N];
    for i in 1..N {
        out[i] = s.load(&src[i][at..]);
    }
    out
}

/// `[load_partial(src[0][at..at + len]), …]`.
#[inline(always)]
pub(crate) fn load_partial_n<U: Copy, S: Simd<U>, T: Element<Stat = U>, const N: usize>(
    s: S,
    src: &[&[T]; N],
    at: usize,
    len: usize,
) -> [S::V; N] {
    let mut out = [s.load_partial(&src[0][at..at + len]); N];
    for i in 1..N {
        out[i] = s.load_partial(&src[i][at..at + len]);
    }
    out
}
