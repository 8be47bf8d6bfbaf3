//! Apply pass: `y = (x − shift[c])·a[c] + b[c]`, computed in `U`, rounded to `T` once.
//!
//! The forward op uses it with `shift = mean`, `a = scale·rsqrt(var + ε)`,
//! `b = offset`; the inference gradient with `shift = 0`, `a = scale·rsqrt(var + ε)`,
//! `b = 0`. Centring before scaling keeps `y` accurate when |mean| ≫ std.

use super::{for_each_row_chunk, Geometry};
use crate::element::Element;

/// Per-channel affine map of `x` into `y` (both of geometry `g`); `shift`, `a`, `b`
/// have `C` elements.
pub fn affine<T: Element>(
    g: &Geometry,
    x: &[T],
    shift: &[T::Stat],
    a: &[T::Stat],
    b: &[T::Stat],
    y: &mut [T],
) {
    debug_assert!(x.len() == g.len() && y.len() == g.len());
    let (row_len, c) = (g.row_len(), g.channels);
    for_each_row_chunk(g, y, |row0, out| {
        let xs = &x[row0 * row_len..][..out.len()];
        if g.channels_last() {
            for (yr, xr) in out.chunks_exact_mut(row_len).zip(xs.chunks_exact(row_len)) {
                for ((((yv, xv), s), a), b) in yr.iter_mut().zip(xr).zip(shift).zip(a).zip(b) {
                    *yv = T::narrow((xv.widen() - *s) * *a + *b);
                }
            }
        } else {
            for (r, (yr, xr)) in out
                .chunks_exact_mut(row_len)
                .zip(xs.chunks_exact(row_len))
                .enumerate()
            {
                let ch = (row0 + r) % c;
                let (s, a, b) = (shift[ch], a[ch], b[ch]);
                for (yv, xv) in yr.iter_mut().zip(xr) {
                    *yv = T::narrow((xv.widen() - s) * a + b);
                }
            }
        }
    });
}
