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
//! | [`Isa::Avx512`] | 16 × f32 | AVX-512 F, BW, VL, DQ (masked tails, F16C-style conversions) |
//! | [`Isa::Avx2`] | 8 × f32 | AVX2, FMA, F16C |
//! | [`Isa::Scalar`] | 8 × f32 or f64 arrays, compiler-vectorized | nothing (also every f64 kernel) |
//!
//! `FUSEDBN_ISA=scalar|avx2|avx512` sets the default ISA (an unsupported or unknown
//! value is ignored); [`Problem::with_isa`](crate::Problem::with_isa) sets it per problem.

#[cfg(target_arch = "x86_64")]
mod avx2;
// The fuzz targets' build (`--cfg fuzzing`, see `Isa::is_supported`) leaves it unused.
#[cfg(target_arch = "x86_64")]
#[cfg_attr(fuzzing, allow(dead_code))]
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
    /// Portable Rust over 8-lane vectors of the `wide` crate (SSE2 pairs on a baseline
    /// x86-64 build, NEON on aarch64).
    Scalar,
    /// AVX2 with FMA and F16C, 8 f32 lanes.
    Avx2,
    /// AVX-512 (F, BW, VL, DQ: every CPU with BW and VL has DQ), 16 f32 lanes with
    /// masked tails.
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
            // The fuzz targets (cargo-fuzz builds with `--cfg fuzzing`) run the AVX2
            // and portable kernels only: the AVX-512 instances were a third of the
            // library's code (of its unoptimized IR), and cargo-fuzz compiles it as
            // one codegen unit with AddressSanitizer, on one core beside CI's other
            // steps. The ordinary tests run every ISA the machine has.
            #[cfg(all(target_arch = "x86_64", fuzzing))]
            Isa::Avx512 => false,
            #[cfg(all(target_arch = "x86_64", not(fuzzing)))]
            Isa::Avx512 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq")
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
        on_enough_stack(|| self.run_here(k))
    }

    #[inline]
    fn run_here<K: Kernel<f32>>(self, k: K) -> K::Output {
        match self {
            #[cfg(all(target_arch = "x86_64", not(fuzzing)))]
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

/// A piece of a kernel that [`Simd::outline`] runs as a function of its own, compiled
/// for the token's ISA.
pub trait Body<S> {
    /// What the piece returns.
    type Output;
    /// The piece. Implementations must be `#[inline(always)]`, as [`Kernel::run`].
    fn run(self, s: S) -> Self::Output;
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
        on_enough_stack(|| k.run(Portable))
    }
}

/// Runs `f` (a kernel) where the stack has room for it. In release builds that is
/// anywhere: a kernel's frame is a few KiB. Unoptimized builds keep every value of
/// every `#[inline(always)]` function inlined into the kernel in a stack slot of its
/// own, up to 2.7 MB for one kernel (an AVX-512 resident pass), more than the 2 MiB
/// of a rayon thread: a debug build of NCHW 8x64x64x64 bf16 backward training died
/// of a stack overflow. There, `f` runs on a fresh stack (`stacker`, made for this)
/// when less than [`DEBUG_STACK_RED_ZONE`] is left.
#[inline(always)]
fn on_enough_stack<R>(f: impl FnOnce() -> R) -> R {
    if cfg!(debug_assertions) {
        stacker::maybe_grow(DEBUG_STACK_RED_ZONE, DEBUG_STACK, f)
    } else {
        f()
    }
}

/// The stack a kernel needs in an unoptimized build (with margin: the largest frame
/// measured was 2.7 MB), and the size of the stack it gets when less is left.
const DEBUG_STACK_RED_ZONE: usize = 6 << 20;
const DEBUG_STACK: usize = 16 << 20;

/// The most lanes of any ISA's vectors (AVX-512, f32): the stack room kernels keep for
/// one vector's lanes.
pub(crate) const MAX_LANES: usize = 16;

/// An ISA token: proof that the ISA's instructions may be used, and the operations on
/// its vector of `LANES` compute values `U`.
///
/// Loads widen elements of `x` (`T` with `T::Stat = U`) to `U` lanes; stores round
/// to `T` (to nearest even). `*_partial` handle a slice shorter than `LANES` (loads
/// fill the missing lanes with zero; stores write only the slice). `stream` is a store
/// that may bypass the cache (non-temporal) for large outputs.
pub trait Simd<U>: Copy + Send + Sync + 'static {
    /// Lanes per vector (at most [`MAX_LANES`]).
    const LANES: usize;
    /// Whether the ISA has non-temporal stores and prefetch hints. Where it has not
    /// (the portable ISA: [`Simd::stream_ptr`] is a plain store and the prefetches do
    /// nothing), the kernels run one variant of each loop instead of one per hint: the
    /// others would be the same machine code, compiled again (in a release build of the
    /// library, most of its LLVM time went to the portable kernels).
    const HINTS: bool = true;
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
    /// `if a > b { a } else { b }` per lane (x86 `max` semantics: `b` when either is
    /// NaN), so `max(0, v)` is a ReLU that keeps NaN and −0.
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// `v` where `m > 0`, else 0 (ReLU's gradient mask: 0 for NaN `m`).
    fn mask_positive(self, m: Self::V, v: Self::V) -> Self::V;
    /// `v` with its lanes rotated down by `r < LANES`: lane `i` of the result is lane
    /// `(i + r) mod LANES` of `v`. In registers: through a stack buffer, the reload
    /// waited on the store buffer, non-temporal stores included (perf: a tenth of the
    /// streamed NCHW inference gradient of bf16 with AVX-512, at one rotation a row).
    fn rotate_lanes(self, v: Self::V, r: usize) -> Self::V;
    /// 1 in the lanes `[from, to)`, 0 in the others (`from ≤ to ≤ LANES`).
    fn lanes_between(self, from: usize, to: usize) -> Self::V;
    /// The lanes summed in `f64`, lane 0 first.
    fn sum_f64(self, v: Self::V) -> f64;
    /// Loads `LANES` elements from `p`.
    ///
    /// # Safety
    /// `p` is valid for reads of `LANES` elements.
    unsafe fn load_ptr<T: Element<Stat = U>>(self, p: *const T) -> Self::V;
    /// Stores `LANES` elements at `p`.
    ///
    /// # Safety
    /// `p` is valid for writes of `LANES` elements.
    unsafe fn store_ptr<T: Element<Stat = U>>(self, p: *mut T, v: Self::V);
    /// Stores `LANES` elements at `p`, bypassing the cache (non-temporal) where the ISA
    /// can. Callers issue [`Simd::fence`] before the data is read by another thread.
    ///
    /// # Safety
    /// `p` is valid for writes of `LANES` elements and aligned to `LANES` elements.
    unsafe fn stream_ptr<T: Element<Stat = U>>(self, p: *mut T, v: Self::V) {
        // SAFETY: the caller's guarantee covers an ordinary store.
        unsafe { self.store_ptr(p, v) }
    }
    /// Stores two vectors, `2·LANES` elements, at `p` (`a` first): one narrowing for
    /// both where the ISA packs two vectors at once (AVX2 bf16).
    ///
    /// # Safety
    /// `p` is valid for writes of `2·LANES` elements.
    #[inline(always)]
    unsafe fn store2_ptr<T: Element<Stat = U>>(self, p: *mut T, a: Self::V, b: Self::V) {
        // SAFETY: the caller's guarantee covers both halves.
        unsafe {
            self.store_ptr(p, a);
            self.store_ptr(p.add(Self::LANES), b);
        }
    }
    /// As [`Simd::store2_ptr`], non-temporal.
    ///
    /// # Safety
    /// `p` is valid for writes of `2·LANES` elements and aligned to `LANES` elements.
    #[inline(always)]
    unsafe fn stream2_ptr<T: Element<Stat = U>>(self, p: *mut T, a: Self::V, b: Self::V) {
        // SAFETY: the caller's guarantee covers both halves, each aligned.
        unsafe {
            self.stream_ptr(p, a);
            self.stream_ptr(p.add(Self::LANES), b);
        }
    }
    /// This token for a pass whose stored values are each the result of an IEEE
    /// arithmetic instruction (then possibly `max` with 0 or a mask) on elements of the
    /// tensors (of the element type) and on `consts` alone: where no value of `consts`
    /// is a NaN with a payload in the 16 low bits of its f32 (the bits bf16 drops),
    /// neither is any NaN the pass stores
    /// (x86 arithmetic returns the default NaN, whose 16 low bits are zero, or a
    /// quieted operand; a bf16 element widens with zeros there), and the AVX2 bf16
    /// narrowing skips its NaN test: the round-to-nearest-even addition then leaves
    /// such a NaN as it is. Perf: the test was three of the twenty-two vector
    /// instructions a pair of AVX2 bf16 vectors takes in forward inference (in L2, one
    /// thread, 12 % of its time); Intel Xeon, `scripts/ab.sh 5`, time ÷ copy, NCHW
    /// 64x256x56x56 / 64x64x112x112: forward inference 0.898 / 0.924 -> 0.888 / 0.897,
    /// the inference gradient 1.221 / 1.148 -> 1.134 / 1.103; channels-last 1 %. The
    /// other ISAs narrow with one instruction and ignore it.
    #[inline(always)]
    fn plain_nans(self, consts: &[&[U]]) -> Self {
        let _ = consts;
        self
    }
    /// The alignment, in elements of `T`, that a streamed channel-major elementwise run
    /// gives its pairs ([`Simd::stream_pair_ptr`]): `LANES` (what the non-temporal
    /// stores need), or `2·LANES` where a pair aligned so is stored whole.
    #[inline(always)]
    fn pair_stream_align<T: Element<Stat = U>>(self) -> usize {
        Self::LANES
    }
    /// The alignment, in elements of `T`, that the channels-last elementwise passes
    /// give a streamed output before their first whole vector: `LANES` (what the
    /// non-temporal stores need), or more where a wider store is faster.
    #[inline(always)]
    fn cl_stream_align<T: Element<Stat = U>>(self) -> usize {
        Self::LANES
    }
    /// Whether [`Simd::load_pair_ptr`] splits a pair of `2·LANES` elements of `T` into
    /// its even and odd elements (`a` = elements 0, 2, 4, …; `b` = 1, 3, 5, …) rather
    /// than into halves: the cheaper order where a conversion works on 32-bit pairs
    /// (bf16: one shift and one mask a vector, no cross-lane shuffle). Callers whose
    /// lanes meet per-lane constants lay the constants out the same way.
    #[inline(always)]
    fn pair_even_odd<T: Element<Stat = U>>(self) -> bool {
        false
    }
    /// Two vectors of consecutive lanes (`a` first) rearranged into the order in which
    /// [`Simd::load_pair_ptr`] returns a pair of `T`: even and odd lanes where
    /// [`Simd::pair_even_odd`], unchanged otherwise. For per-lane constants and sums
    /// that meet such pairs.
    #[inline(always)]
    fn to_pair_order<T: Element<Stat = U>>(self, a: Self::V, b: Self::V) -> (Self::V, Self::V) {
        (a, b)
    }
    /// The inverse of [`Simd::to_pair_order`]: a pair in the order of
    /// [`Simd::load_pair_ptr`] back into two vectors of consecutive lanes.
    #[inline(always)]
    fn to_lane_order<T: Element<Stat = U>>(self, a: Self::V, b: Self::V) -> (Self::V, Self::V) {
        (a, b)
    }
    /// Loads `2·LANES` elements from `p` as two vectors, in the order of
    /// [`Simd::pair_even_odd`].
    ///
    /// # Safety
    /// `p` is valid for reads of `2·LANES` elements.
    #[inline(always)]
    unsafe fn load_pair_ptr<T: Element<Stat = U>>(self, p: *const T) -> (Self::V, Self::V) {
        // SAFETY: the caller's guarantee covers both halves.
        unsafe { (self.load_ptr(p), self.load_ptr(p.add(Self::LANES))) }
    }
    /// Loads `2·LANES` elements from `p` as two vectors whose lanes hold them in any
    /// order, for sums over a run in which every lane meets the same constants (a
    /// channel-major row: the statistics, the gradient's sums). AVX-512 takes bf16 as
    /// even and odd elements there, one load, a shift and a mask for 32 where
    /// [`Simd::load_pair_ptr`] widens each half with a shuffle (`vpmovzxwd`) and a
    /// shift; the other ISAs and types load as [`Simd::load_pair_ptr`].
    ///
    /// # Safety
    /// `p` is valid for reads of `2·LANES` elements.
    #[inline(always)]
    unsafe fn load_pair_unordered_ptr<T: Element<Stat = U>>(
        self,
        p: *const T,
    ) -> (Self::V, Self::V) {
        // SAFETY: the caller's guarantee.
        unsafe { self.load_pair_ptr(p) }
    }
    /// Stores a pair loaded by [`Simd::load_pair_ptr`] (the same order) at `p`.
    ///
    /// # Safety
    /// `p` is valid for writes of `2·LANES` elements.
    #[inline(always)]
    unsafe fn store_pair_ptr<T: Element<Stat = U>>(self, p: *mut T, a: Self::V, b: Self::V) {
        // SAFETY: the caller's guarantee.
        unsafe { self.store2_ptr(p, a, b) }
    }
    /// As [`Simd::store_pair_ptr`], non-temporal.
    ///
    /// # Safety
    /// `p` is valid for writes of `2·LANES` elements and aligned to `LANES` elements.
    #[inline(always)]
    unsafe fn stream_pair_ptr<T: Element<Stat = U>>(self, p: *mut T, a: Self::V, b: Self::V) {
        // SAFETY: the caller's guarantee.
        unsafe { self.stream2_ptr(p, a, b) }
    }
    /// As [`Simd::stream_pair_ptr`], for the channels-last elementwise passes, where
    /// AVX-512 stores 16-bit pairs that start a 64-byte line as one 64-byte store
    /// ([`Simd::cl_stream_align`] aligns the first) and f16 pairs half a line off as
    /// four 16-byte non-temporal stores (`avx512::stream_quarters`).
    ///
    /// # Safety
    /// As [`Simd::stream_pair_ptr`].
    #[inline(always)]
    unsafe fn stream_pair_cl_ptr<T: Element<Stat = U>>(self, p: *mut T, a: Self::V, b: Self::V) {
        // SAFETY: the caller's guarantee.
        unsafe { self.stream_pair_ptr(p, a, b) }
    }
    /// As [`Simd::stream_pair_cl_ptr`], for a pair known to start at a multiple of
    /// [`Simd::cl_stream_align`] elements: without the alignment test a store that
    /// the other takes (the loops decide it once a run: `apply::periodic`, and
    /// `apply::splat_body` for channel-major runs, whose pairs are aligned to
    /// [`Simd::pair_stream_align`], the same alignment on every ISA).
    ///
    /// # Safety
    /// As [`Simd::stream_pair_ptr`], and `p` is aligned to `cl_stream_align::<T>()`
    /// elements.
    #[inline(always)]
    unsafe fn stream_pair_cl_whole_ptr<T: Element<Stat = U>>(
        self,
        p: *mut T,
        a: Self::V,
        b: Self::V,
    ) {
        // SAFETY: the caller's guarantee (more than `stream_pair_cl_ptr` needs).
        unsafe { self.stream_pair_cl_ptr(p, a, b) }
    }
    /// This token with its [`Simd::plain_nans`] flag as a constant, where the flag is
    /// set and narrowing to `T` reads it; `None` otherwise (always, on the ISAs that
    /// ignore the flag, and for every type but bf16, so that no second copy of their
    /// loops is compiled). A loop run with the token returned has no NaN test in its
    /// narrowing: the test of the flag stayed in the machine code of the AVX2 bf16
    /// loops, once a store.
    #[inline(always)]
    fn plain_nans_const<T: Element<Stat = U>>(self) -> Option<Self> {
        None
    }
    /// Loads `LANES` elements (`src.len() >= LANES`).
    #[inline(always)]
    fn load<T: Element<Stat = U>>(self, src: &[T]) -> Self::V {
        assert!(src.len() >= Self::LANES);
        // SAFETY: checked just above.
        unsafe { self.load_ptr(src.as_ptr()) }
    }
    /// Loads `src.len() < LANES` elements, zero in the other lanes.
    fn load_partial<T: Element<Stat = U>>(self, src: &[T]) -> Self::V;
    /// Stores `LANES` elements (`dst.len() >= LANES`).
    #[inline(always)]
    fn store<T: Element<Stat = U>>(self, dst: &mut [T], v: Self::V) {
        assert!(dst.len() >= Self::LANES);
        // SAFETY: checked just above.
        unsafe { self.store_ptr(dst.as_mut_ptr(), v) }
    }
    /// Stores the first `dst.len() < LANES` lanes.
    fn store_partial<T: Element<Stat = U>>(self, dst: &mut [T], v: Self::V);
    /// Stores `LANES` elements, bypassing the cache when `dst` is suitably aligned.
    /// Callers issue [`Simd::fence`] before the data is read by another thread.
    #[inline(always)]
    fn stream<T: Element<Stat = U>>(self, dst: &mut [T], v: Self::V) {
        assert!(dst.len() >= Self::LANES);
        let p = dst.as_mut_ptr();
        if (p as usize).is_multiple_of(Self::LANES * std::mem::size_of::<T>()) {
            // SAFETY: length checked above, alignment just now.
            unsafe { self.stream_ptr(p, v) }
        } else {
            // SAFETY: length checked above.
            unsafe { self.store_ptr(p, v) }
        }
    }
    /// Orders preceding streaming stores before later stores.
    fn fence(self) {}
    /// Runs `b` with this token in a function of its own, never inlined into the
    /// caller, compiled for this token's ISA: for the pieces a kernel would otherwise
    /// inline several times over (a resident pass's reductions and its row writes,
    /// once per pacing and per call site). LLVM's scalar replacement of aggregates
    /// (SROA) grows faster than the size of a function: in a release build of the
    /// library, SROA was 2,486 of the 3,854 thread-seconds of LLVM's function
    /// pipeline (`-Z llvm-time-trace`), 1,600 of them in three resident passes with
    /// 16-bit data. A call per tile or per channel costs nothing next to the rows it
    /// covers.
    fn outline<B: Body<Self>>(self, b: B) -> B::Output;
    /// Hints that the cache line holding `data[0]` will be read soon (into L2). A
    /// hint only: no effect on results; empty slices are ignored.
    fn prefetch<T>(self, _data: &[T]) {}
    /// Hints that the cache line at `p` will be read soon (into L2). A hint only: any
    /// address is allowed (nothing is read, nothing faults).
    ///
    /// Into L2 (`prefetcht1`), not L1 too: `prefetcht0` for every hint of both ISAs was
    /// slower in 13 of 16 cells on a Zen 4 (2026-12-02, `scripts/ab.sh 3`, NHWC
    /// forward and backward training, bf16 and f16, 64x56x56x256 and 64x112x112x64,
    /// time ÷ copy: forward training bf16 AVX-512 64x56x56x256 1.28 -> 1.51, backward
    /// training bf16 AVX-512 1.63 -> 1.86); the three faster cells (at most bf16 AVX2
    /// forward training 64x112x112x64, 1.70 -> 1.41) by no more than a cell moves
    /// between runs there.
    fn prefetch_ptr<T>(self, _p: *const T) {}
    /// [`Simd::prefetch_ptr`] for every 64-byte line of the `n` elements from `p`: one
    /// hint per line, not per vector. (A prefetch takes a load slot: one per 16-bit
    /// AVX2 vector, four per line, made the channels-last statistics of 64x56x56x256
    /// bf16 from DRAM 1.4x slower on Zen 3; see `PREFETCH_BYTES`.)
    #[inline(always)]
    fn prefetch_lines<T>(self, p: *const T, n: usize) {
        let size = std::mem::size_of::<T>().max(1);
        for j in 0..(n * size).div_ceil(64) {
            self.prefetch_ptr(p.wrapping_add(j * 64 / size));
        }
    }
}

// Array helpers for kernels with several inputs or constants. Plain loops, not
// `array::map` closures: a closure is compiled as a function of its own, without the
// kernel's target features, and the intrinsics inside it would become calls.

/// `[&src[0][at..][..len], &src[1][at..][..len], …]` (`len = None`: to the end).
/// Also a loop for a second reason: `array::map` over slices was compiled as an
/// out-of-line `try_map` call (with a `vzeroupper` and a store-forwarding stall on its
/// result) once per channel-major row, a fifth of the time of a 49-element-row pass.
#[inline(always)]
pub(crate) fn sub_n<'a, T, const N: usize>(
    src: &[&'a [T]; N],
    at: usize,
    len: Option<usize>,
) -> [&'a [T]; N] {
    let mut out = *src;
    for x in out.iter_mut() {
        *x = match len {
            Some(len) => &x[at..][..len],
            None => &x[at..],
        };
    }
    out
}

/// `[splat(v[0]), splat(v[1]), …]`.
#[inline(always)]
pub(crate) fn splat_n<U: Copy, S: Simd<U>, const N: usize>(s: S, v: [U; N]) -> [S::V; N] {
    let mut out = [s.splat(v[0]); N];
    for i in 1..N {
        out[i] = s.splat(v[i]);
    }
    out
}

/// `[load(src[0][at..at + LANES]), …]`: one whole vector of each input.
#[inline(always)]
pub(crate) fn load_n<U: Copy, S: Simd<U>, T: Element<Stat = U>, const N: usize>(
    s: S,
    src: &[&[T]; N],
    at: usize,
) -> [S::V; N] {
    let l = S::LANES;
    let mut out = [s.load(&src[0][at..at + l]); N];
    for i in 1..N {
        out[i] = s.load(&src[i][at..at + l]);
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

/// `N` inputs of (at least) one length, read one whole vector at a time with the bounds
/// proved once, in [`Reads::new`] — the split-once style of the hot loops: a loop
/// `for j in 0..r.vectors()` carries no per-load check and no pointer reloads. What is
/// left after the whole vectors (fewer than `LANES` elements) is [`Reads::tail`], for the
/// masked partial loads.
/// Hints that the `n` elements from element `at` of every input of `ptrs` will be read
/// soon: one prefetch per 64-byte line ([`Simd::prefetch_lines`]). Any `at` is allowed
/// (past the end, nothing is read and nothing faults). For hot loops that keep their
/// input pointers in registers ([`Reads::base`]); [`Reads::prefetch_ahead`] is this
/// through a `Reads`.
#[inline(always)]
pub(crate) fn prefetch_each<U, S: Simd<U>, T, const N: usize>(
    s: S,
    ptrs: &[*const T; N],
    at: usize,
    n: usize,
) {
    for p in ptrs {
        s.prefetch_lines(p.wrapping_add(at), n);
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Reads<'a, T, const N: usize> {
    ins: [*const T; N],
    vectors: usize,
    lanes: usize,
    len: usize,
    _borrow: std::marker::PhantomData<&'a [T]>,
}

impl<'a, T: Element, const N: usize> Reads<'a, T, N> {
    /// The first `len` elements of each input (each at least that long), in vectors of
    /// `lanes`.
    #[inline(always)]
    pub fn new(lanes: usize, ins: [&'a [T]; N], len: usize) -> Self {
        for x in &ins {
            assert!(x.len() >= len, "an input shorter than the run");
        }
        Reads {
            ins: {
                let mut p = [std::ptr::null(); N];
                for (p, x) in p.iter_mut().zip(&ins) {
                    *p = x.as_ptr();
                }
                p
            },
            vectors: len / lanes.max(1),
            lanes,
            len,
            _borrow: std::marker::PhantomData,
        }
    }

    /// Whole vectors.
    #[inline(always)]
    pub fn vectors(&self) -> usize {
        self.vectors
    }

    /// The first element of every input: for hot loops that keep these pointers in
    /// registers and prove their ranges once (each input holds at least
    /// `vectors()·lanes` elements from it).
    #[inline(always)]
    pub fn base(&self) -> [*const T; N] {
        self.ins
    }

    /// Hints that the `n` elements of every input from element `j·lanes + ahead` will
    /// be read soon: one prefetch per 64-byte line ([`Simd::prefetch_lines`]). Any `j`
    /// and `ahead` are allowed (past the end, nothing is read and nothing faults).
    #[inline(always)]
    pub fn prefetch_ahead<S: Simd<T::Stat>>(&self, s: S, j: usize, ahead: usize, n: usize) {
        prefetch_each(s, &self.ins, j * self.lanes + ahead, n);
    }

    /// Whether `S`'s vectors are the `lanes` of [`Reads::new`] (the precondition of the
    /// unchecked accessors, besides the index).
    #[inline(always)]
    pub fn lanes_of<S: Simd<T::Stat>>(&self, _s: S) -> bool {
        S::LANES == self.lanes
    }

    /// Vector `j` of every input.
    #[inline(always)]
    pub fn load<S: Simd<T::Stat>>(&self, s: S, j: usize) -> [S::V; N] {
        assert!(j < self.vectors && S::LANES == self.lanes);
        // SAFETY: checked just above.
        unsafe { self.load_unchecked(s, j) }
    }

    /// [`Reads::load`] without its check, for hot loops that prove their range once.
    ///
    /// # Safety
    /// `j < self.vectors()` and `self.lanes_of(s)`.
    #[inline(always)]
    pub unsafe fn load_unchecked<S: Simd<T::Stat>>(&self, s: S, j: usize) -> [S::V; N] {
        debug_assert!(j < self.vectors && S::LANES == self.lanes);
        let at = j * self.lanes;
        // SAFETY: `(j + 1)·lanes <= len` (the caller's guarantee) and every input holds
        // at least `len` elements (checked in `new`); the borrow lives as long as `self`.
        let first = unsafe { s.load_ptr(self.ins[0].add(at)) };
        let mut out = [first; N];
        // Unrolled by hand with constant indices (N ≤ 4 here): a loop over the array
        // kept it in memory instead of registers.
        assert!(N <= 4);
        macro_rules! lane {
            ($i:literal) => {
                if let (Some(o), Some(p)) = (out.get_mut($i), self.ins.get($i)) {
                    // SAFETY: as above.
                    *o = unsafe { s.load_ptr(p.add(at)) };
                }
            };
        }
        lane!(1);
        lane!(2);
        lane!(3);
        out
    }

    /// Vectors `j` and `j + 1` of every input, each pair in the order of
    /// [`Simd::pair_even_odd`]. Unchecked: pairs are loaded only in hot loops, which
    /// prove their range once.
    ///
    /// # Safety
    /// `j + 1 < self.vectors()` and `self.lanes_of(s)`.
    #[inline(always)]
    pub unsafe fn load_pair_unchecked<S: Simd<T::Stat>>(
        &self,
        s: S,
        j: usize,
    ) -> ([S::V; N], [S::V; N]) {
        // SAFETY: the caller's guarantee.
        unsafe { self.pairs_at::<S, false>(s, j) }
    }

    /// [`Reads::load_pair_unchecked`] with [`Simd::load_pair_unordered_ptr`]: for sums
    /// in which every lane meets the same constants. Every input's pair is in the same
    /// order.
    ///
    /// # Safety
    /// As [`Reads::load_pair_unchecked`].
    #[inline(always)]
    pub unsafe fn load_pair_unordered_unchecked<S: Simd<T::Stat>>(
        &self,
        s: S,
        j: usize,
    ) -> ([S::V; N], [S::V; N]) {
        // SAFETY: the caller's guarantee.
        unsafe { self.pairs_at::<S, true>(s, j) }
    }

    /// Vectors `j` and `j + 1` of every input, in the ISA's pair order (`UNORDERED`:
    /// in that of [`Simd::load_pair_unordered_ptr`]).
    ///
    /// # Safety
    /// As [`Reads::load_pair_unchecked`].
    #[inline(always)]
    unsafe fn pairs_at<S: Simd<T::Stat>, const UNORDERED: bool>(
        &self,
        s: S,
        j: usize,
    ) -> ([S::V; N], [S::V; N]) {
        debug_assert!(j + 1 < self.vectors && S::LANES == self.lanes);
        let at = j * self.lanes;
        // (A macro, not a closure: closures are compiled without the kernel's target
        // features.)
        macro_rules! pair {
            ($p:expr) => {
                // SAFETY: `(j + 2)·lanes <= len` (the caller's guarantee) and every
                // input holds at least `len` elements (checked in `new`); the borrow
                // lives as long as `self`.
                unsafe {
                    if UNORDERED {
                        s.load_pair_unordered_ptr($p.add(at))
                    } else {
                        s.load_pair_ptr($p.add(at))
                    }
                }
            };
        }
        let (a0, b0) = pair!(self.ins[0]);
        let (mut a, mut b) = ([a0; N], [b0; N]);
        // Unrolled by hand as in `load`.
        assert!(N <= 4);
        macro_rules! lane {
            ($i:literal) => {
                if let (Some(x), Some(y), Some(p)) =
                    (a.get_mut($i), b.get_mut($i), self.ins.get($i))
                {
                    (*x, *y) = pair!(p);
                }
            };
        }
        lane!(1);
        lane!(2);
        lane!(3);
        (a, b)
    }

    /// The elements after the whole vectors: `(first index, count < LANES)`.
    #[inline(always)]
    pub fn tail(&self) -> (usize, usize) {
        let at = self.vectors * self.lanes;
        (at, self.len - at)
    }
}

/// [`Reads`] of `N` inputs plus one output of the run's length, written one whole
/// vector at a time.
pub(crate) struct Walk<'a, T, const N: usize> {
    /// The inputs.
    pub reads: Reads<'a, T, N>,
    out: *mut T,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

impl<'a, T: Element, const N: usize> Walk<'a, T, N> {
    /// The walk over `out` and the first `out.len()` elements of each input.
    #[inline(always)]
    pub fn new(lanes: usize, ins: [&'a [T]; N], out: &'a mut [T]) -> Self {
        Walk {
            reads: Reads::new(lanes, ins, out.len()),
            out: out.as_mut_ptr(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// Whole vectors.
    #[inline(always)]
    pub fn vectors(&self) -> usize {
        self.reads.vectors
    }

    /// The output's first element, for hot loops as [`Reads::base`] (`vectors()·lanes`
    /// writable elements from it, borrowed mutably for the life of `self`).
    #[inline(always)]
    pub fn out_base(&mut self) -> *mut T {
        self.out
    }

    /// Whether the output is aligned to whole vectors (so it may be streamed).
    #[inline(always)]
    pub fn aligned(&self) -> bool {
        self.aligned_to(self.reads.lanes * std::mem::size_of::<T>())
    }

    /// Whether the output starts at a multiple of `bytes`.
    #[inline(always)]
    pub fn aligned_to(&self, bytes: usize) -> bool {
        (self.out as usize).is_multiple_of(bytes)
    }

    /// Vector `j` of every input.
    #[inline(always)]
    pub fn load<S: Simd<T::Stat>>(&self, s: S, j: usize) -> [S::V; N] {
        self.reads.load(s, j)
    }

    /// Writes vector `j` of the output; non-temporal when `STREAM` (which needs
    /// [`Walk::aligned`]).
    #[inline(always)]
    pub fn store<S: Simd<T::Stat>, const STREAM: bool>(&mut self, s: S, j: usize, v: S::V) {
        assert!(j < self.reads.vectors && S::LANES == self.reads.lanes);
        // SAFETY: checked just above.
        unsafe { self.store_unchecked::<S, STREAM>(s, j, v) }
    }

    /// [`Walk::store`] without its check, for hot loops that prove their range once.
    ///
    /// # Safety
    /// `j < self.vectors()` and `self.reads.lanes_of(s)`.
    #[inline(always)]
    pub unsafe fn store_unchecked<S: Simd<T::Stat>, const STREAM: bool>(
        &mut self,
        s: S,
        j: usize,
        v: S::V,
    ) {
        debug_assert!(j < self.reads.vectors && S::LANES == self.reads.lanes);
        // SAFETY: `(j + 1)·lanes <= len = out.len()` (the caller's guarantee), and the
        // output is borrowed mutably for the life of `self`; streaming is asked for only
        // after `aligned()`.
        unsafe {
            let p = self.out.add(j * self.reads.lanes);
            if STREAM {
                debug_assert!(self.aligned());
                s.stream_ptr(p, v)
            } else {
                s.store_ptr(p, v)
            }
        }
    }

    /// Writes vectors `j` and `j + 1` of the output (see [`Simd::store2_ptr`]), for hot
    /// loops that prove their range once; non-temporal when `STREAM`.
    ///
    /// # Safety
    /// `j + 1 < self.vectors()` and `self.reads.lanes_of(s)`; with `STREAM`, the output
    /// is [`Walk::aligned`].
    #[inline(always)]
    pub unsafe fn store2_unchecked<S: Simd<T::Stat>, const STREAM: bool>(
        &mut self,
        s: S,
        j: usize,
        a: S::V,
        b: S::V,
    ) {
        // SAFETY: the caller's guarantee.
        unsafe { self.store_two_unchecked::<S, STREAM, false>(s, j, a, b) }
    }

    /// Writes vectors `j` and `j + 1` of the output from a pair in the order of
    /// [`Simd::pair_even_odd`]; non-temporal when `STREAM` (which needs
    /// [`Walk::aligned`]). Unchecked, as [`Reads::load_pair_unchecked`].
    ///
    /// # Safety
    /// `j + 1 < self.vectors()` and `self.reads.lanes_of(s)`.
    #[inline(always)]
    pub unsafe fn store_pair_unchecked<S: Simd<T::Stat>, const STREAM: bool>(
        &mut self,
        s: S,
        j: usize,
        a: S::V,
        b: S::V,
    ) {
        // SAFETY: the caller's guarantee.
        unsafe { self.store_two_unchecked::<S, STREAM, true>(s, j, a, b) }
    }

    /// [`Walk::store_pair_unchecked`], streamed with [`Simd::stream_pair_cl_ptr`] (the
    /// channels-last elementwise passes), or with `WHOLE` with
    /// [`Simd::stream_pair_cl_whole_ptr`].
    ///
    /// # Safety
    /// As [`Walk::store_pair_unchecked`], and the output is [`Walk::aligned`]; with
    /// `WHOLE`, vector `j` starts at a multiple of [`Simd::cl_stream_align`] elements.
    #[inline(always)]
    pub unsafe fn stream_pair_cl_unchecked<S: Simd<T::Stat>, const WHOLE: bool>(
        &mut self,
        s: S,
        j: usize,
        a: S::V,
        b: S::V,
    ) {
        debug_assert!(j + 1 < self.reads.vectors && S::LANES == self.reads.lanes);
        debug_assert!(self.aligned());
        // SAFETY: `(j + 2)·lanes <= len = out.len()` and the alignment (the caller's
        // guarantee); the output is borrowed mutably for the life of `self`.
        unsafe {
            let p = self.out.add(j * self.reads.lanes);
            if WHOLE {
                debug_assert!((p as usize)
                    .is_multiple_of(s.cl_stream_align::<T>() * std::mem::size_of::<T>()));
                s.stream_pair_cl_whole_ptr(p, a, b)
            } else {
                s.stream_pair_cl_ptr(p, a, b)
            }
        }
    }

    /// Writes vectors `j` and `j + 1` of the output: in memory order ([`Simd::store2_ptr`]), or
    /// with `PAIR` a pair in the order of [`Simd::pair_even_odd`]; non-temporal when
    /// `STREAM` (which needs [`Walk::aligned`]).
    ///
    /// # Safety
    /// `j + 1 < self.vectors()` and `self.reads.lanes_of(s)`.
    #[inline(always)]
    unsafe fn store_two_unchecked<S: Simd<T::Stat>, const STREAM: bool, const PAIR: bool>(
        &mut self,
        s: S,
        j: usize,
        a: S::V,
        b: S::V,
    ) {
        debug_assert!(j + 1 < self.reads.vectors && S::LANES == self.reads.lanes);
        // SAFETY: `(j + 2)·lanes <= len = out.len()` (the caller's guarantee), and the
        // output is borrowed mutably for the life of `self`; streaming is asked for only
        // after `aligned()`.
        unsafe {
            let p = self.out.add(j * self.reads.lanes);
            debug_assert!(!STREAM || self.aligned());
            match (STREAM, PAIR) {
                (true, true) => s.stream_pair_ptr(p, a, b),
                (false, true) => s.store_pair_ptr(p, a, b),
                (true, false) => s.stream2_ptr(p, a, b),
                (false, false) => s.store2_ptr(p, a, b),
            }
        }
    }

    /// The elements after the whole vectors: `(first index, count < LANES)`.
    #[inline(always)]
    pub fn tail(&self) -> (usize, usize) {
        self.reads.tail()
    }
}

/// `M` outputs of one length, written one whole vector at a time with the bounds proved
/// once, in [`Writes::new`] (the output side of [`Walk`], for passes that write more
/// than one tensor per element, such as the second-order gradient).
pub(crate) struct Writes<'a, T, const M: usize> {
    outs: [*mut T; M],
    vectors: usize,
    lanes: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

impl<'a, T: Element, const M: usize> Writes<'a, T, M> {
    /// The first `len` elements of each output (each at least that long), in vectors of
    /// `lanes`.
    #[inline(always)]
    pub fn new(lanes: usize, mut outs: [&'a mut [T]; M], len: usize) -> Self {
        let mut ptrs = [std::ptr::null_mut(); M];
        for (p, o) in ptrs.iter_mut().zip(&mut outs) {
            assert!(o.len() >= len, "an output shorter than the run");
            *p = o.as_mut_ptr();
        }
        Writes {
            outs: ptrs,
            vectors: len / lanes.max(1),
            lanes,
            _borrow: std::marker::PhantomData,
        }
    }

    /// Whole vectors.
    #[inline(always)]
    pub fn vectors(&self) -> usize {
        self.vectors
    }

    /// Whether `S`'s vectors are the `lanes` of [`Writes::new`] (the precondition of
    /// the unchecked store, besides the indices).
    #[inline(always)]
    pub fn lanes_of<S: Simd<T::Stat>>(&self, _s: S) -> bool {
        S::LANES == self.lanes
    }

    /// Writes vectors `j` and `j + 1` of output `i` (`a` first), as
    /// [`Simd::store2_ptr`]: one narrowing for both where the ISA has one. Unchecked:
    /// pairs are stored only in hot loops, which prove their range once.
    ///
    /// # Safety
    /// `i < M`, `j + 1 < self.vectors()` and `self.lanes_of(s)`.
    #[inline(always)]
    pub unsafe fn store2_unchecked<S: Simd<T::Stat>>(
        &mut self,
        s: S,
        i: usize,
        j: usize,
        a: S::V,
        b: S::V,
    ) {
        debug_assert!(i < M && j + 1 < self.vectors && S::LANES == self.lanes);
        // SAFETY: `(j + 2)·lanes <= len` (the caller's guarantee) and every output holds
        // at least `len` elements (checked in `new`); the outputs are borrowed mutably
        // for the life of `self`.
        unsafe { s.store2_ptr(self.outs.get_unchecked(i).add(j * self.lanes), a, b) }
    }

    /// Writes vector `j` of output `i`.
    #[inline(always)]
    pub fn store<S: Simd<T::Stat>>(&mut self, s: S, i: usize, j: usize, v: S::V) {
        assert!(j < self.vectors && S::LANES == self.lanes);
        // SAFETY: `(j + 1)·lanes <= len` and every output holds at least `len` elements
        // (checked in `new`); the outputs are borrowed mutably for the life of `self`,
        // and `self.outs[i]` panics for `i >= M` before any write.
        unsafe { s.store_ptr(self.outs[i].add(j * self.lanes), v) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// What a pair-store test runs a kernel on: an ISA, or on a CPU with AVX-512 BF16
    /// also the AVX-512 kernels with those conversions unused (the path of AVX-512 CPUs
    /// without them), so that both narrowing paths of pairs are tested on such a machine
    /// (single-vector stores have one path).
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Target {
        Isa(Isa),
        Avx512WithoutBf16,
    }

    impl Target {
        fn all() -> Vec<Target> {
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
            let mut v: Vec<Target> = Isa::supported().into_iter().map(Target::Isa).collect();
            #[cfg(target_arch = "x86_64")]
            if Isa::Avx512.is_supported() && avx512::cpu_has_bf16() {
                v.push(Target::Avx512WithoutBf16);
            }
            v
        }

        fn run<K: Kernel<f32>>(self, k: K) -> K::Output {
            match self {
                Target::Isa(isa) => isa.run(k),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: made by `all` only where the CPU has AVX-512 (F, BW, VL, DQ).
                Target::Avx512WithoutBf16 => unsafe { avx512::run_without_bf16(k) },
                #[cfg(not(target_arch = "x86_64"))]
                Target::Avx512WithoutBf16 => unreachable!("made only on x86-64"),
            }
        }

        fn lanes(self) -> usize {
            match self {
                Target::Isa(Isa::Avx512) | Target::Avx512WithoutBf16 => 16,
                Target::Isa(_) => 8,
            }
        }
    }

    impl fmt::Display for Target {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            match self {
                Target::Isa(isa) => write!(f, "{isa}"),
                Target::Avx512WithoutBf16 => f.write_str("avx512 without BF16"),
            }
        }
    }

    /// Round-trips `src` through one ISA's loads and stores: full vectors, then a
    /// partial tail.
    struct RoundTrip<'a, T> {
        src: &'a [f32],
        out: &'a mut [T],
        back: &'a mut [f32],
    }

    impl<T: Element<Stat = f32>> Kernel<f32> for RoundTrip<'_, T> {
        type Output = ();
        #[inline(always)]
        fn run<S: Simd<f32>>(self, s: S) {
            let (l, n) = (S::LANES, self.src.len());
            let mut i = 0;
            while i + l <= n {
                s.store(&mut self.out[i..], s.load(&self.src[i..]));
                s.store(&mut self.back[i..], s.load(&self.out[i..]));
                i += l;
            }
            s.store_partial(&mut self.out[i..], s.load_partial(&self.src[i..]));
            s.store_partial(&mut self.back[i..], s.load_partial(&self.out[i..]));
        }
    }

    /// Values where conversions go wrong: ties to even, NaN payloads, infinities,
    /// overflow, subnormals of both types, signed zeros.
    fn awkward() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7FC0_1234),
            f32::from_bits(0x7FFF_FFFF), // rounding up would carry out of the NaN
            f32::from_bits(0xFFFF_8000),
            f32::from_bits(0x7FFF_0000), // quiet NaNs as arithmetic makes them
            f32::from_bits(0xFFC1_0000),
            f32::from_bits(0x7F80_0001), // signalling NaN
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40, // f32 subnormal
            -1e-40,
            f32::from_bits(0x0000_0001), // the smallest subnormal
            f32::from_bits(0x807F_FFFF), // the largest negative subnormal
            65504.0,
            65520.0, // rounds to f16 infinity
            6.0e-8,  // f16 subnormal
            3.0e-5,
            1.0 + 2f32.powi(-11), // f16 tie, to even
            1.0 + 3.0 * 2f32.powi(-11),
            1.0 + 2f32.powi(-8), // bf16 tie, to even
            1.0 + 3.0 * 2f32.powi(-8),
            f32::from_bits(0x3F80_8001),
            f32::from_bits(0x7F7F_FFFF),
        ];
        // A sweep of bit patterns.
        let mut bits = 0x0000_1234u32;
        for _ in 0..200 {
            bits = bits.wrapping_mul(2_654_435_761).wrapping_add(0x9E37);
            v.push(f32::from_bits(bits));
        }
        v
    }

    fn check<T: Element<Stat = f32> + PartialEq>(to_bits: fn(T) -> u16) {
        let src = awkward();
        for isa in Isa::supported() {
            // Every tail length of every ISA (16 lanes at most), and a long run.
            let lens = (0..=33).chain([src.len()]);
            for len in lens {
                let src = &src[..len];
                let mut out = vec![T::default(); len];
                let mut back = vec![0f32; len];
                isa.run(RoundTrip {
                    src,
                    out: &mut out,
                    back: &mut back,
                });
                for (i, (&x, (&o, &b))) in src.iter().zip(out.iter().zip(&back)).enumerate() {
                    let want = T::narrow(x);
                    assert_eq!(
                        to_bits(o),
                        to_bits(want),
                        "{isa} {:?}: element {i} = {x:e} ({:#010x})",
                        T::DTYPE,
                        x.to_bits()
                    );
                    assert_eq!(
                        b.to_bits(),
                        o.widen().to_bits(),
                        "{isa}: widening element {i}"
                    );
                }
            }
        }
    }

    /// Narrows `src` two vectors at a time with [`Simd::store2_ptr`], into a
    /// vector-aligned buffer with [`Simd::stream2_ptr`], in the ISA's pair order
    /// with [`Simd::store_pair_ptr`], and one vector at a time with [`Simd::store`];
    /// with `consts`, under [`Simd::plain_nans`] of them.
    struct Pairs<'a, T> {
        src: &'a [f32],
        consts: Option<&'a [f32]>,
        stored: &'a mut [T],
        streamed: &'a mut [T],
        paired: &'a mut [T],
        single: &'a mut [T],
    }

    impl<T: Element<Stat = f32>> Kernel<f32> for Pairs<'_, T> {
        type Output = ();
        #[inline(always)]
        fn run<S: Simd<f32>>(self, s: S) {
            let s = match self.consts {
                Some(k) => s.plain_nans(&[k]),
                None => s,
            };
            let l = S::LANES;
            let (mut x, mut y) = (vec![0f32; l], vec![0f32; l]);
            let n = self.src.len() / (2 * l) * (2 * l);
            assert!(self.stored.len() >= n && self.streamed.len() >= n);
            let head = self.streamed.as_ptr().align_offset(l * size_of::<T>());
            assert!(self.streamed.len() >= head + n);
            for i in (0..n).step_by(2 * l) {
                let (a, b) = (s.load(&self.src[i..]), s.load(&self.src[i + l..]));
                // SAFETY: `i + 2·l <= n` elements fit both outputs (asserted above);
                // `streamed` from `head` on is aligned to `l` elements.
                unsafe {
                    s.store2_ptr(self.stored.as_mut_ptr().add(i), a, b);
                    s.stream2_ptr(self.streamed.as_mut_ptr().add(head + i), a, b);
                }
                let two = &self.src[i..i + 2 * l];
                for j in 0..l {
                    (x[j], y[j]) = if s.pair_even_odd::<T>() {
                        (two[2 * j], two[2 * j + 1])
                    } else {
                        (two[j], two[l + j])
                    };
                }
                // SAFETY: as above.
                unsafe {
                    s.store_pair_ptr(self.paired.as_mut_ptr().add(i), s.load(&x), s.load(&y));
                }
                s.store(&mut self.single[i..], a);
                s.store(&mut self.single[i + l..], b);
            }
            s.fence();
        }
    }

    /// `src` narrowed by every pair store of every ISA (and of AVX-512 without its BF16
    /// conversions, see [`Target`]), with `consts` as in [`Pairs`], against the `half`
    /// crate.
    fn pairs_of<T: Element<Stat = f32> + PartialEq>(
        to_bits: fn(T) -> u16,
        src: &[f32],
        consts: Option<&[f32]>,
    ) {
        for isa in Target::all() {
            let mut stored = vec![T::default(); src.len()];
            let mut streamed = vec![T::default(); src.len() + 16];
            let mut paired = vec![T::default(); src.len()];
            let mut single = vec![T::default(); src.len()];
            isa.run(Pairs {
                src,
                consts,
                stored: &mut stored,
                streamed: &mut streamed,
                paired: &mut paired,
                single: &mut single,
            });
            let lanes = isa.lanes();
            let n = src.len() / (2 * lanes) * (2 * lanes);
            let head = streamed.as_ptr().align_offset(lanes * size_of::<T>());
            for i in 0..n {
                let want = to_bits(T::narrow(src[i]));
                let at = format!("{isa} {consts:?}: element {i} ({:#010x})", src[i].to_bits());
                assert_eq!(to_bits(stored[i]), want, "store2, {at}");
                assert_eq!(to_bits(streamed[head + i]), want, "stream2, {at}");
                assert_eq!(to_bits(paired[i]), want, "store_pair, {at}");
                assert_eq!(to_bits(single[i]), want, "store, {at}");
            }
        }
    }

    fn pairs<T: Element<Stat = f32> + PartialEq>(to_bits: fn(T) -> u16) {
        let src = awkward();
        pairs_of(to_bits, &src, None);
        // Constants with a NaN whose payload reaches the 16 low bits: the narrowing
        // keeps its NaN test, and every value narrows as before.
        pairs_of(to_bits, &src, Some(&[1.0, f32::from_bits(0x7FC0_0001)]));
        // Constants without one: every value that arithmetic on bf16 elements and on
        // them can give (all but NaNs with a payload in the 16 low bits and
        // signalling NaNs) narrows as the `half` crate does, without the test.
        let quiet = |v: &&f32| !v.is_nan() || v.to_bits() & 0x0040_FFFF == 0x0040_0000;
        let arithmetic: Vec<f32> = src.iter().filter(quiet).copied().collect();
        assert!(arithmetic.iter().filter(|v| v.is_nan()).count() >= 4);
        pairs_of(to_bits, &arithmetic, Some(&[1.0, f32::NAN, -f32::NAN]));
    }

    /// Every high half of an f32 (every bf16) with the low halves where rounding
    /// turns: 0, 1, just below, at and just above the tie, 0xFFFF, and two others.
    fn every_bf16_rounding() -> Vec<f32> {
        let lows = [
            0x0000, 0x0001, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xC000,
        ];
        let mut v = Vec::with_capacity(lows.len() << 16);
        for hi in 0..=0xFFFFu32 {
            for lo in lows {
                v.push(f32::from_bits(hi << 16 | lo));
            }
        }
        v
    }

    #[test]
    fn bf16_pair_stores_round_every_high_half_at_every_turn() {
        let src = every_bf16_rounding();
        // With the NaN test: every value.
        pairs_of(bf16::to_bits, &src, None);
        // Without it (the constants allow it): NaNs only as arithmetic gives them.
        let quiet = |v: &&f32| !v.is_nan() || v.to_bits() & 0x0040_FFFF == 0x0040_0000;
        let arithmetic: Vec<f32> = src.iter().filter(quiet).copied().collect();
        pairs_of(bf16::to_bits, &arithmetic, Some(&[1.0, f32::NAN]));
    }

    #[test]
    fn pair_stores_round_like_single_ones() {
        pairs::<f16>(f16::to_bits);
        pairs::<bf16>(bf16::to_bits);
        pairs::<f32>(|v| (v.to_bits() >> 16) as u16);
        pairs::<f32>(|v| v.to_bits() as u16);
    }

    /// The pair-order methods of one ISA on `src` (`4·LANES` elements of `T`): what
    /// [`Simd::load_pair_ptr`] loads, put back in lane order; the pair order of the
    /// same vectors loaded one by one; and the pair as stored by every pair store, in
    /// a buffer at a 64-byte line (`out[0]`) and, for 16-bit types, one vector past a
    /// line (`out[1]`: the least alignment a pair stream allows, 16 bytes with AVX2 and
    /// 32 with AVX-512, where the streams take their narrower stores).
    struct PairOrder<'a, T> {
        src: &'a [T],
        out: [&'a mut [T]; 2],
    }

    /// (lane order of the pair load, pair order of the single loads, the pair load, the
    /// unordered pair load), as f32 bits.
    type PairLanes = (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>);

    impl<T: Element<Stat = f32>> Kernel<f32> for PairOrder<'_, T> {
        type Output = PairLanes;
        #[inline(always)]
        fn run<S: Simd<f32>>(self, s: S) -> PairLanes {
            let l = S::LANES;
            assert!(self.src.len() >= 2 * l);
            let bits = |vs: [S::V; 2]| {
                let mut lanes = vec![0f32; 2 * l];
                s.store(&mut lanes, vs[0]);
                s.store(&mut lanes[l..], vs[1]);
                lanes.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            // SAFETY: `src` holds 2·l elements (asserted above).
            let (a, b) = unsafe { s.load_pair_ptr(self.src.as_ptr()) };
            let (x, y) = s.to_lane_order::<T>(a, b);
            let (e, o) = s.to_pair_order::<T>(s.load(self.src), s.load(&self.src[l..]));
            // SAFETY: as above.
            let (u, v) = unsafe { s.load_pair_unordered_ptr(self.src.as_ptr()) };
            let [lined, half] = self.out;
            // One vector off a line only for 16-bit types: an f32 pair there is not
            // aligned to the two vectors a whole-line stream of it needs.
            let half = (size_of::<T>() == 2).then_some((half, l));
            for (buf, at) in std::iter::once((lined, 0)).chain(half) {
                let head = buf.as_ptr().align_offset(64) + at;
                assert!(buf.len() >= head + 8 * l);
                let p = buf[head..].as_mut_ptr();
                // SAFETY: 8·l elements from `head` are in `buf` (asserted above). `p` is
                // at a line, or (a 16-bit type) `l` elements past one: aligned to `l`
                // elements, what every pair stream needs, and so is each pair `2·l` on.
                // `stream_pair_cl_whole_ptr` runs only from a line, at `6·l` elements
                // past it: a multiple of `2·l`, which `cl_stream_align` divides on
                // every ISA.
                unsafe {
                    s.store_pair_ptr(p, a, b);
                    s.stream_pair_ptr(p.add(2 * l), a, b);
                    s.stream_pair_cl_ptr(p.add(4 * l), a, b);
                    if at == 0 {
                        s.stream_pair_cl_whole_ptr(p.add(6 * l), a, b);
                    } else {
                        s.store_pair_ptr(p.add(6 * l), a, b);
                    }
                }
            }
            s.fence();
            (bits([x, y]), bits([e, o]), bits([a, b]), bits([u, v]))
        }
    }

    fn pair_order_of<T: Element<Stat = f32> + PartialEq + std::fmt::Debug>() {
        for isa in Target::all() {
            let l = isa.lanes();
            let src: Vec<T> = (0..2 * l)
                .map(|i| T::narrow(i as f32 * 0.75 - 5.0))
                .collect();
            let want: Vec<u32> = src.iter().map(|v| v.widen().to_bits()).collect();
            let mut lined = vec![T::default(); 8 * l + 64];
            let mut half = vec![T::default(); 8 * l + 64];
            let (lanes, paired, loaded, mut unordered) = isa.run(PairOrder {
                src: &src,
                out: [&mut lined, &mut half],
            });
            assert_eq!(
                lanes,
                want,
                "{isa} {:?}: to_lane_order(load_pair)",
                T::DTYPE
            );
            assert_eq!(
                paired,
                loaded,
                "{isa} {:?}: to_pair_order(load, load)",
                T::DTYPE
            );
            // The unordered pair load: every element once, in some lanes.
            let mut sorted = want.clone();
            sorted.sort_unstable();
            unordered.sort_unstable();
            assert_eq!(
                unordered,
                sorted,
                "{isa} {:?}: load_pair_unordered",
                T::DTYPE
            );
            let half = (size_of::<T>() == 2).then_some((&half, l));
            for (buf, at) in std::iter::once((&lined, 0)).chain(half) {
                let head = buf.as_ptr().align_offset(64) + at;
                for (k, how) in ["store_pair", "stream_pair", "stream_pair_cl", "cl_whole"]
                    .iter()
                    .enumerate()
                {
                    let got = &buf[head + 2 * k * l..][..2 * l];
                    assert_eq!(got, &src[..], "{isa} {:?}: {how}, offset {at}", T::DTYPE);
                }
            }
        }
    }

    #[test]
    fn pair_order_round_trips_and_every_pair_store_agrees() {
        pair_order_of::<f32>();
        pair_order_of::<f16>();
        pair_order_of::<bf16>();
    }

    /// Writes `v` partially into `buf[1..1 + n]` on one ISA.
    struct Partial<'a, T> {
        buf: &'a mut [T],
        n: usize,
        src: &'a [T],
    }

    impl<T: Element<Stat = f32>> Kernel<f32> for Partial<'_, T> {
        type Output = Vec<f32>;
        #[inline(always)]
        fn run<S: Simd<f32>>(self, s: S) -> Vec<f32> {
            let v = s.load_partial(&self.src[..self.n]);
            s.store_partial(&mut self.buf[1..1 + self.n], v);
            let mut lanes = vec![0f32; S::LANES];
            s.store(&mut lanes, v);
            lanes
        }
    }

    fn partial_bounds<T: Element<Stat = f32> + PartialEq + std::fmt::Debug>() {
        let sentinel = T::narrow(-7.0);
        for isa in Isa::supported() {
            let lanes = if isa == Isa::Avx512 { 16 } else { 8 };
            for n in 0..lanes {
                let src: Vec<T> = (0..n).map(|i| T::narrow(i as f32 + 1.0)).collect();
                let mut buf = vec![sentinel; 18];
                let got = isa.run(Partial {
                    buf: &mut buf,
                    n,
                    src: &src,
                });
                assert_eq!(buf[0], sentinel, "{isa} n={n}: wrote before the slice");
                assert_eq!(&buf[1..1 + n], &src[..], "{isa} n={n}");
                assert!(
                    buf[1 + n..].iter().all(|&b| b == sentinel),
                    "{isa} n={n}: wrote past the slice"
                );
                for (i, l) in got.iter().enumerate() {
                    let want = if i < n { i as f32 + 1.0 } else { 0.0 };
                    assert_eq!(*l, want, "{isa} n={n}: lane {i} of a partial load");
                }
            }
        }
    }

    #[test]
    fn partial_loads_and_stores_touch_only_their_elements() {
        partial_bounds::<f32>();
        partial_bounds::<f16>();
        partial_bounds::<bf16>();
    }

    #[test]
    fn f16_conversions_match_the_half_crate_on_every_isa() {
        check::<f16>(f16::to_bits);
    }

    #[test]
    fn bf16_conversions_match_the_half_crate_on_every_isa() {
        check::<bf16>(bf16::to_bits);
    }

    /// Every rotation of the lanes 0, 1, 2, … and every `lanes_between` mask, as
    /// `(lanes, rotations, masks)`.
    struct Lanes;

    impl Kernel<f32> for Lanes {
        type Output = (usize, Vec<Vec<f32>>, Vec<Vec<f32>>);
        #[inline(always)]
        fn run<S: Simd<f32>>(self, s: S) -> Self::Output {
            let l = S::LANES;
            let iota: Vec<f32> = (0..l).map(|i| i as f32).collect();
            let v = s.load(&iota[..]);
            let lanes = |x| {
                let mut out = vec![0f32; l];
                s.store(&mut out[..], x);
                out
            };
            let rotations = (0..l).map(|r| lanes(s.rotate_lanes(v, r))).collect();
            let mut masks = Vec::new();
            for from in 0..=l {
                for to in from..=l {
                    masks.push(lanes(s.lanes_between(from, to)));
                }
            }
            (l, rotations, masks)
        }
    }

    #[test]
    fn lane_rotations_and_masks_on_every_isa() {
        for isa in Isa::supported() {
            let (l, rotations, masks) = isa.run(Lanes);
            for (r, got) in rotations.iter().enumerate() {
                let want: Vec<f32> = (0..l).map(|i| ((i + r) % l) as f32).collect();
                assert_eq!(got, &want, "{isa}: rotation by {r}");
            }
            let mut k = 0;
            for from in 0..=l {
                for to in from..=l {
                    let want: Vec<f32> = (0..l)
                        .map(|i| if from <= i && i < to { 1.0 } else { 0.0 })
                        .collect();
                    assert_eq!(masks[k], want, "{isa}: lanes {from}..{to}");
                    k += 1;
                }
            }
        }
    }

    /// `sum_f64` of one vector loaded from `v`.
    struct Sum<'a>(&'a [f32]);

    impl Kernel<f32> for Sum<'_> {
        type Output = f64;
        #[inline(always)]
        fn run<S: Simd<f32>>(self, s: S) -> f64 {
            s.sum_f64(s.load(self.0))
        }
    }

    /// A vector's lanes are summed in `f64` on every ISA: exactly where the `f64` sum is
    /// exact (lanes far apart in magnitude, which an `f32` sum would lose), and NaN and
    /// Inf as IEEE sums give them.
    #[test]
    fn sum_f64_adds_the_lanes_in_f64() {
        let v = [1e8f32, 1.0, -1e8, 0.25, 0.125, 7.0, -2.0, 0.5];
        let exact: f64 = v.iter().map(|&x| f64::from(x)).sum();
        for isa in Isa::supported() {
            let lanes = if isa == Isa::Avx512 { 16 } else { 8 };
            let mut buf = vec![0f32; lanes];
            buf[..8].copy_from_slice(&v);
            assert_eq!(isa.run(Sum(&buf)), exact, "{isa}");
            // Every lane counts exactly once: lane i > 0 holds 2^i, lane 0 holds 2^25
            // (against which an f32 sum would round the 2 of lane 1 away).
            let mut powers: Vec<f32> = (0..lanes).map(|i| (1u32 << i) as f32).collect();
            powers[0] = 33_554_432.0;
            let want = 33_554_432.0 + f64::from((1u32 << lanes) - 2);
            assert_eq!(isa.run(Sum(&powers)), want, "{isa}: lanes");
            for (bad, want) in [
                (f32::INFINITY, f64::INFINITY),
                (f32::NEG_INFINITY, f64::NEG_INFINITY),
            ] {
                buf[lanes - 1] = bad;
                assert_eq!(isa.run(Sum(&buf)), want, "{isa}: {bad}");
            }
            buf[0] = f32::NAN;
            assert!(isa.run(Sum(&buf)).is_nan(), "{isa}: NaN");
            buf[0] = f32::INFINITY;
            buf[lanes - 1] = f32::NEG_INFINITY;
            assert!(isa.run(Sum(&buf)).is_nan(), "{isa}: Inf - Inf");
        }
    }

    #[test]
    fn isa_names_round_trip_and_detection_is_supported() {
        for isa in Isa::ALL {
            assert_eq!(isa.name().parse::<Isa>().unwrap(), isa);
        }
        assert!(Isa::detect().is_supported());
        assert!("sse".parse::<Isa>().is_err());
    }
}
