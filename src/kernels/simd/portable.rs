//! The portable ISA: vectors are `[U; 8]` arrays and every operation a lane loop, which
//! the compiler vectorizes with whatever the build target allows. Also runs every
//! f64 kernel.

use super::Simd;
use crate::element::{Element, Real};

/// Token of the portable ISA (always available).
#[derive(Clone, Copy, Debug, Default)]
pub struct Portable;

const L: usize = 8;

impl<U: Real> Simd<U> for Portable {
    const LANES: usize = L;
    const HINTS: bool = false;
    type V = [U; L];

    #[inline(always)]
    fn splat(self, v: U) -> [U; L] {
        [v; L]
    }
    #[inline(always)]
    fn add(self, a: [U; L], b: [U; L]) -> [U; L] {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    fn sub(self, a: [U; L], b: [U; L]) -> [U; L] {
        std::array::from_fn(|i| a[i] - b[i])
    }
    #[inline(always)]
    fn mul(self, a: [U; L], b: [U; L]) -> [U; L] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    fn mul_add(self, a: [U; L], b: [U; L], c: [U; L]) -> [U; L] {
        // Unfused: a software fma per lane would be far slower than the rest.
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    fn max(self, a: [U; L], b: [U; L]) -> [U; L] {
        std::array::from_fn(|i| if a[i] > b[i] { a[i] } else { b[i] })
    }
    #[inline(always)]
    fn mask_positive(self, m: [U; L], v: [U; L]) -> [U; L] {
        std::array::from_fn(|i| if m[i] > U::ZERO { v[i] } else { U::ZERO })
    }
    #[inline(always)]
    fn rotate_lanes(self, v: [U; L], r: usize) -> [U; L] {
        std::array::from_fn(|i| v[(i + r) % L])
    }
    #[inline(always)]
    fn lanes_between(self, from: usize, to: usize) -> [U; L] {
        std::array::from_fn(|i| {
            if from <= i && i < to {
                U::from_f64(1.0)
            } else {
                U::ZERO
            }
        })
    }
    #[inline(always)]
    fn sum_f64(self, v: [U; L]) -> f64 {
        v.iter().map(|x| x.to_f64()).sum()
    }
    #[inline(always)]
    unsafe fn load_ptr<T: Element<Stat = U>>(self, p: *const T) -> [U; L] {
        // SAFETY: the caller guarantees L readable elements at `p`.
        std::array::from_fn(|i| unsafe { p.add(i).read() }.widen())
    }
    #[inline(always)]
    unsafe fn store_ptr<T: Element<Stat = U>>(self, p: *mut T, v: [U; L]) {
        for (i, x) in v.into_iter().enumerate() {
            // SAFETY: the caller guarantees L writable elements at `p`.
            unsafe { p.add(i).write(T::narrow(x)) };
        }
    }
    #[inline(always)]
    fn load_partial<T: Element<Stat = U>>(self, src: &[T]) -> [U; L] {
        let mut v = [U::ZERO; L];
        for (d, s) in v.iter_mut().zip(src) {
            *d = s.widen();
        }
        v
    }
    #[inline(always)]
    fn store_partial<T: Element<Stat = U>>(self, dst: &mut [T], v: [U; L]) {
        for (d, s) in dst.iter_mut().zip(v) {
            *d = T::narrow(s);
        }
    }
}
