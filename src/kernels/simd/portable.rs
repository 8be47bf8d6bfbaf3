//! The portable ISA: vectors of 8 lanes from the `wide` crate (`f32x8`, `f64x8`: SSE2
//! pairs on a baseline x86-64 build, NEON on aarch64, arrays elsewhere). Also runs
//! every f64 kernel.
//!
//! The lanes were `[U; 8]` arrays with a lane loop per operation, which the compiler
//! unrolled and vectorized again in every kernel: in a release build of the library,
//! 57 % of LLVM's time went to the portable instantiations (`-Z llvm-time-trace`,
//! 9 s for one resident forward pass against 0.8 s for its AVX2 twin). `wide`'s types
//! hand LLVM vector operations directly. The arithmetic is the arrays' lane for lane
//! (unfused multiply-add, `max` and the ReLU mask by the same comparisons), so the
//! bits are the same.

use wide::{f32x8, f64x8, u16x8, u32x8};

use super::{Body, Simd};
use crate::element::{DType, Element};

/// Token of the portable ISA (always available).
#[derive(Clone, Copy, Debug, Default)]
pub struct Portable;

const L: usize = 8;

/// [`Simd::outline`] for the portable ISA.
#[inline(never)]
fn outlined<B: Body<Portable>>(s: Portable, b: B) -> B::Output {
    b.run(s)
}

/// The `Simd` implementation for one compute type `$u` over its `wide` vector `$v`;
/// `$load` and `$store` are the element conversions ([`load_f32`], [`store_f32`],
/// [`load_f64`], [`store_f64`]).
macro_rules! portable_simd {
    ($u:ty, $v:ty, $load:ident, $store:ident) => {
        impl Simd<$u> for Portable {
            const LANES: usize = L;
            const HINTS: bool = false;
            type V = $v;

            #[inline(always)]
            fn outline<B: Body<Self>>(self, b: B) -> B::Output {
                outlined(self, b)
            }

            #[inline(always)]
            fn splat(self, v: $u) -> $v {
                <$v>::splat(v)
            }
            #[inline(always)]
            fn add(self, a: $v, b: $v) -> $v {
                a + b
            }
            #[inline(always)]
            fn sub(self, a: $v, b: $v) -> $v {
                a - b
            }
            #[inline(always)]
            fn mul(self, a: $v, b: $v) -> $v {
                a * b
            }
            #[inline(always)]
            fn mul_add(self, a: $v, b: $v, c: $v) -> $v {
                // Unfused: a software fma per lane would be far slower than the rest.
                a * b + c
            }
            #[inline(always)]
            fn max(self, a: $v, b: $v) -> $v {
                // `a` where `a > b` (false for a NaN in either), else `b`.
                a.simd_gt(b).select(a, b)
            }
            #[inline(always)]
            fn mask_positive(self, m: $v, v: $v) -> $v {
                m.simd_gt(<$v>::splat(0.0)).select(v, <$v>::splat(0.0))
            }
            #[inline(always)]
            fn rotate_lanes(self, v: $v, r: usize) -> $v {
                let a = v.to_array();
                <$v>::new(std::array::from_fn(|i| a[(i + r) % L]))
            }
            #[inline(always)]
            fn lanes_between(self, from: usize, to: usize) -> $v {
                <$v>::new(std::array::from_fn(|i| {
                    if from <= i && i < to {
                        1.0
                    } else {
                        0.0
                    }
                }))
            }
            #[inline(always)]
            fn sum_f64(self, v: $v) -> f64 {
                // Lane 0 first, as the arrays added them (the bits of the portable ISA
                // are its own: AVX2 and AVX-512 add their lanes pairwise).
                v.to_array().iter().map(|&x| f64::from(x)).sum()
            }
            #[inline(always)]
            unsafe fn load_ptr<T: Element<Stat = $u>>(self, p: *const T) -> $v {
                // SAFETY: the caller guarantees L readable elements at `p`.
                unsafe { $load(p) }
            }
            #[inline(always)]
            unsafe fn store_ptr<T: Element<Stat = $u>>(self, p: *mut T, v: $v) {
                // SAFETY: the caller guarantees L writable elements at `p`.
                unsafe { $store(p, v) }
            }
            #[inline(always)]
            fn load_partial<T: Element<Stat = $u>>(self, src: &[T]) -> $v {
                let mut v = [0.0; L];
                for (d, s) in v.iter_mut().zip(src) {
                    *d = s.widen();
                }
                <$v>::new(v)
            }
            #[inline(always)]
            fn store_partial<T: Element<Stat = $u>>(self, dst: &mut [T], v: $v) {
                for (d, s) in dst.iter_mut().zip(v.to_array()) {
                    *d = T::narrow(s);
                }
            }
        }
    };
}

portable_simd!(f32, f32x8, load_f32, store_f32);
portable_simd!(f64, f64x8, load_f64, store_f64);

/// Eight elements at `p` widened to f32: f32 as they are, bf16 by a shift of their
/// bits (exact, as `bf16::to_f32`), f16 in the vector ([`from_f16_bits`]).
///
/// # Safety
/// `p` points to 8 readable elements.
#[inline(always)]
unsafe fn load_f32<T: Element<Stat = f32>>(p: *const T) -> f32x8 {
    // SAFETY: 8 readable elements at `p` (the caller's guarantee); `T` is f32 in the
    // first arm and a 16-bit type in the others (its `DTYPE`).
    unsafe {
        match T::DTYPE {
            DType::F32 => f32x8::new(p.cast::<[f32; L]>().read_unaligned()),
            DType::BF16 => f32x8::from_bits(load_bits16(p) << 16_u32),
            DType::F16 => from_f16_bits(load_bits16(p)),
            _ => f32x8::new(load_lanes(p)),
        }
    }
}

/// Eight f32 lanes stored at `p`: as they are for f32, rounded to bf16 or f16 in the
/// vector ([`to_bf16_bits`], [`to_f16_bits`]).
///
/// # Safety
/// `p` points to 8 writable elements.
#[inline(always)]
unsafe fn store_f32<T: Element<Stat = f32>>(p: *mut T, v: f32x8) {
    // SAFETY: 8 writable elements at `p` (the caller's guarantee); `T` is f32 in the
    // first arm and a 16-bit type in the others (its `DTYPE`).
    unsafe {
        match T::DTYPE {
            DType::F32 => p.cast::<[f32; L]>().write_unaligned(v.to_array()),
            DType::BF16 => store_bits16(p, to_bf16_bits(v)),
            DType::F16 => store_bits16(p, to_f16_bits(v)),
            _ => store_lanes(p, v.to_array()),
        }
    }
}

/// The bits of eight 16-bit elements at `p`, each in the low half of a 32-bit lane.
///
/// # Safety
/// `p` points to 8 readable 16-bit elements.
#[inline(always)]
unsafe fn load_bits16<T>(p: *const T) -> u32x8 {
    // SAFETY: the caller guarantees 8 readable 16-bit elements at `p`.
    u32x8::from(u16x8::new(unsafe { p.cast::<[u16; L]>().read_unaligned() }))
}

/// The low halves of `bits`' lanes stored as eight 16-bit elements at `p`.
///
/// # Safety
/// `p` points to 8 writable 16-bit elements.
#[inline(always)]
unsafe fn store_bits16<T>(p: *mut T, bits: u32x8) {
    // SAFETY: the caller guarantees 8 writable 16-bit elements at `p`.
    unsafe {
        p.cast::<[u16; L]>()
            .write_unaligned(bits.to_array().map(|b| b as u16))
    }
}

/// The bf16 bits of each lane (in the low half of a 32-bit lane), as `bf16::from_f32`
/// rounds: to nearest even, a NaN kept quiet with its high mantissa bits. Adding
/// `0x7FFF` plus the kept part's lowest bit carries into the kept part exactly when
/// `from_f32` rounds up (the round bit set, and a lower bit or the lowest kept bit set),
/// infinities and overflow to infinity included; the addition wraps only for a NaN,
/// whose lane takes the other value.
#[inline(always)]
fn to_bf16_bits(v: f32x8) -> u32x8 {
    let x = v.to_bits();
    let rounded = (x + u32x8::splat(0x7FFF) + ((x >> 16_u32) & u32x8::splat(1))) >> 16_u32;
    let quiet = (x >> 16_u32) | u32x8::splat(0x40);
    v.is_nan().select(quiet, rounded)
}

/// Each lane's f16 bits (the low half of a 32-bit lane) widened to f32 exactly, as
/// `f16::to_f32` (and F16C) widen them. A finite value's exponent and mantissa moved
/// to f32's places make an f32 of the same digits 2^112 times too small (a normal one
/// normal, a subnormal one subnormal): the product by 2^112 is exact. Infinities and
/// NaNs take f32's top exponent, a NaN made quiet with its payload kept. (Written out
/// because `half` converts one value per call behind a run-time feature test: the
/// portable f16 kernels ran 26–58 % slower on `wide`'s vectors with it, lane by lane.)
#[inline(always)]
fn from_f16_bits(h: u32x8) -> f32x8 {
    let sign = (h & u32x8::splat(0x8000)) << 16_u32;
    let em = h & u32x8::splat(0x7FFF);
    let scale = f32x8::splat(f32::from_bits((127 + 112) << 23));
    let finite = (f32x8::from_bits(em << 13_u32) * scale).to_bits();
    let quiet = em.simd_gt(u32x8::splat(0x7C00)) & u32x8::splat(0x0040_0000);
    let inf_nan = u32x8::splat(0x7F80_0000) | quiet | (em << 13_u32);
    let bits = em.simd_gt(u32x8::splat(0x7BFF)).select(inf_nan, finite);
    f32x8::from_bits(sign | bits)
}

/// The f16 bits of each lane (in the low half of a 32-bit lane), as `f16::from_f32`
/// (and F16C) round: to nearest even, overflow to infinity, a NaN quiet with its high
/// payload bits kept.
/// - Normal results: the exponent rebiased (−112 in f32's field), then rounding at
///   bit 13 by adding `0xFFF` plus the lowest kept bit, as [`to_bf16_bits`] at bit 16;
///   a carry into the exponent is the next binade or infinity, as it should be.
/// - Subnormal results and zeros (|x| < 2^−14): `0.5 + |x|` rounds |x| to a multiple of
///   2^−24 (the f16 subnormal step, 0.5's ulp), to nearest even in the FPU; the bits
///   above 0.5's are the f16 bits (1024 is the least normal, carried correctly).
#[inline(always)]
fn to_f16_bits(v: f32x8) -> u32x8 {
    let x = v.to_bits();
    let sign = (x >> 16_u32) & u32x8::splat(0x8000);
    let ax = x & u32x8::splat(0x7FFF_FFFF);
    let man = ax & u32x8::splat(0x007F_FFFF);
    let nan_bit = ax.simd_gt(u32x8::splat(0x7F80_0000)) & u32x8::splat(0x0200);
    let inf_nan = u32x8::splat(0x7C00) | nan_bit | (man >> 13_u32);
    let lsb = (ax >> 13_u32) & u32x8::splat(1);
    let normal = (ax - u32x8::splat(112 << 23) + u32x8::splat(0x0FFF) + lsb) >> 13_u32;
    let sub = (f32x8::from_bits(ax) + f32x8::splat(0.5)).to_bits() - u32x8::splat(0x3F00_0000);
    let finite = u32x8::splat(0x3880_0000).simd_gt(ax).select(sub, normal);
    // |x| at or past 2^16 (f16's exponent 31): infinity, or the NaN.
    let big = ax.simd_gt(u32x8::splat(0x477F_FFFF));
    let over = ax
        .simd_gt(u32x8::splat(0x7F7F_FFFF))
        .select(inf_nan, u32x8::splat(0x7C00));
    sign | big.select(over, finite)
}

/// Eight f64 elements at `p`.
///
/// # Safety
/// `p` points to 8 readable elements.
#[inline(always)]
unsafe fn load_f64<T: Element<Stat = f64>>(p: *const T) -> f64x8 {
    // SAFETY: the caller guarantees 8 readable elements at `p`.
    f64x8::new(unsafe { load_lanes(p) })
}

/// Eight f64 lanes stored at `p`.
///
/// # Safety
/// `p` points to 8 writable elements.
#[inline(always)]
unsafe fn store_f64<T: Element<Stat = f64>>(p: *mut T, v: f64x8) {
    // SAFETY: the caller guarantees 8 writable elements at `p`.
    unsafe { store_lanes(p, v.to_array()) }
}

/// Eight elements at `p`, each widened (`Element::widen`).
///
/// # Safety
/// `p` points to 8 readable elements.
#[inline(always)]
unsafe fn load_lanes<T: Element>(p: *const T) -> [T::Stat; L] {
    // SAFETY: the caller guarantees 8 readable elements at `p`.
    let a = unsafe { p.cast::<[T; L]>().read_unaligned() };
    a.map(Element::widen)
}

/// Eight lanes stored at `p`, each narrowed (`Element::narrow`).
///
/// # Safety
/// `p` points to 8 writable elements.
#[inline(always)]
unsafe fn store_lanes<T: Element>(p: *mut T, a: [T::Stat; L]) {
    // SAFETY: the caller guarantees 8 writable elements at `p`.
    unsafe { p.cast::<[T; L]>().write_unaligned(a.map(T::narrow)) }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    /// Bit patterns spread over all of f32 (a prime stride: every exponent, both signs,
    /// NaN payloads), with the edges: zeros, subnormals, the largest finite values,
    /// infinities, and the rounding ties of bf16 on both sides.
    fn patterns() -> Vec<u32> {
        let mut bits: Vec<u32> = (0..=u32::MAX).step_by(4099).collect();
        for b in [
            0x0000_0000u32,
            0x0000_0001,
            0x007F_FFFF,
            0x0080_0000,
            0x7F7F_FFFF,
        ] {
            for sign in [0, 0x8000_0000] {
                bits.push(b | sign);
            }
        }
        // f16's edges: 2^-25 and 2^-24 (the subnormal step), 2^-14 (the least normal)
        // and just below, 65504 (the largest finite), 65520 (the tie to infinity), each
        // with the ties and near-ties of bit 13 and of the subnormal steps.
        for b in [
            0x3300_0000u32,
            0x3380_0000,
            0x3880_0000,
            0x3870_0000,
            0x477F_E000,
        ] {
            for lo in [0u32, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7F_FFFF] {
                for sign in [0, 0x8000_0000] {
                    bits.push((b | lo) ^ sign);
                }
            }
        }
        bits.push(0x477F_F000);
        for hi in [0x3F80u32, 0x3F81, 0x7F7F, 0x0000, 0x7F80, 0x7FC0, 0x7FBF] {
            for lo in [0x7FFFu32, 0x8000, 0x8001, 0xFFFF, 0x0001] {
                bits.push(hi << 16 | lo);
                bits.push(0x8000_0000 | hi << 16 | lo);
            }
        }
        bits
    }

    /// The bf16 and f16 stores round as `bf16::from_f32` and `f16::from_f32` (NaNs,
    /// infinities, overflow, subnormals, ties included) and the bf16 load widens as
    /// `bf16::to_f32`, bit for bit.
    #[test]
    fn half_conversions_are_halfs() {
        let s = Portable;
        for chunk in patterns().chunks(L) {
            let mut lanes = [0.0f32; L];
            for (d, &b) in lanes.iter_mut().zip(chunk) {
                *d = f32::from_bits(b);
            }
            let v = f32x8::new(lanes);
            let mut out = [bf16::ZERO; L];
            // SAFETY: `out` holds L elements.
            unsafe { Simd::<f32>::store_ptr(s, out.as_mut_ptr(), v) };
            for (o, x) in out.iter().zip(lanes) {
                assert_eq!(
                    o.to_bits(),
                    bf16::from_f32(x).to_bits(),
                    "{:#010x}",
                    x.to_bits()
                );
            }
            // SAFETY: `out` holds L elements.
            let back = unsafe { Simd::<f32>::load_ptr(s, out.as_ptr()) }.to_array();
            for (b, o) in back.iter().zip(out) {
                assert_eq!(b.to_bits(), o.to_f32().to_bits());
            }
            let mut h = [f16::ZERO; L];
            // SAFETY: `h` holds L elements.
            unsafe { Simd::<f32>::store_ptr(s, h.as_mut_ptr(), v) };
            for (o, x) in h.iter().zip(lanes) {
                assert_eq!(o.to_bits(), f16::from_f32(x).to_bits());
            }
        }
    }

    /// `max` and the ReLU mask take the arrays' lane rule: `a` only where `a > b`, so a
    /// NaN in either gives `b`, and `max(0, -0)` is `-0`.
    #[test]
    fn max_and_mask_keep_the_lane_rule() {
        let s = Portable;
        let nan = f32::NAN;
        let a = f32x8::new([1.0, -1.0, nan, 2.0, 0.0, -0.0, 3.0, nan]);
        let b = f32x8::new([0.0, 0.0, 0.0, nan, -0.0, 0.0, 3.0, nan]);
        let m = Simd::<f32>::max(s, a, b).to_array();
        let want = [1.0, 0.0, 0.0, nan, -0.0, 0.0, 3.0, nan];
        for (g, w) in m.iter().zip(want) {
            assert_eq!(g.to_bits(), w.to_bits());
        }
        let v = f32x8::splat(5.0);
        let got = Simd::<f32>::mask_positive(s, a, v).to_array();
        assert_eq!(got, [5.0, 0.0, 0.0, 5.0, 0.0, 0.0, 5.0, 0.0]);
    }

    /// The f16 load widens every one of the 65536 f16 values as `f16::to_f32`, bit for
    /// bit (zeros, subnormals, infinities, NaN payloads).
    #[test]
    fn f16_loads_are_halfs() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for chunk in all.chunks(L) {
            // SAFETY: `chunk` holds L elements (65536 is a multiple of L).
            let got = unsafe { Simd::<f32>::load_ptr(Portable, chunk.as_ptr()) }.to_array();
            for (g, h) in got.iter().zip(chunk) {
                assert_eq!(g.to_bits(), h.to_f32().to_bits(), "{:#06x}", h.to_bits());
            }
        }
    }
}
