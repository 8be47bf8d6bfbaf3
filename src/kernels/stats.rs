//! Statistics pass: per-channel count, mean and M2 (sum of squared deviations) in one
//! read of `x`.
//!
//! Each tile (at most [`TILE`](super::TILE) elements, cache-resident) is reduced
//! exactly in two passes over the cached data: first a pivot (the tile's `f32` mean),
//! then `Σ(x − pivot)` and `Σ(x − pivot)²` in `f32` lanes, which give the tile's mean
//! and M2 without cancellation even when |mean| ≫ std. Tiles are merged with Chan's
//! formula in `f64`.

use super::{
    for_each_channel_tile, map_tasks, pixels_per_task, pixels_per_tile, ChannelMajorSplit,
    Geometry, LANES,
};
use crate::element::{Element, Real};

/// Count, mean and M2 of a set of values, mergeable in any grouping.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Moments {
    /// Number of values.
    pub count: f64,
    /// Their mean.
    pub mean: f64,
    /// Sum of squared deviations from the mean.
    pub m2: f64,
}

impl Moments {
    /// Moments of no values.
    pub const EMPTY: Moments = Moments {
        count: 0.0,
        mean: 0.0,
        m2: 0.0,
    };

    /// Moments of the union of two sets (Chan, Golub and LeVeque's pairwise update).
    pub fn merge(self, other: Moments) -> Moments {
        if other.count == 0.0 {
            return self;
        }
        if self.count == 0.0 {
            return other;
        }
        let count = self.count + other.count;
        if !(self.mean.is_finite() && other.mean.is_finite()) {
            // An infinite member: the mean is what the plain sum gives (±Inf, or NaN
            // for +Inf and −Inf together) and the deviations from it are NaN.
            return Moments {
                count,
                mean: self.mean + other.mean,
                m2: f64::NAN,
            };
        }
        let delta = other.mean - self.mean;
        Moments {
            count,
            mean: self.mean + delta * (other.count / count),
            m2: self.m2 + other.m2 + delta * delta * (self.count * other.count / count),
        }
    }

    /// Biased variance `M2 / count` (NaN when empty).
    pub fn variance(self) -> f64 {
        self.m2 / self.count
    }

    /// Moments of a tile from its pivot and the `f32`/`f64` sums of `d = x − pivot`.
    fn from_pivot(count: usize, pivot: f64, s1: f64, s2: f64) -> Moments {
        let n = count as f64;
        if !pivot.is_finite() {
            // The tile's sum is ±Inf or NaN: so is its mean, as IEEE sums give it.
            return Moments {
                count: n,
                mean: pivot,
                m2: f64::NAN,
            };
        }
        let m2 = s2 - s1 * s1 / n;
        Moments {
            count: n,
            mean: pivot + s1 / n,
            // Rounding can leave a tiny negative; NaN must stay NaN.
            m2: if m2 < 0.0 { 0.0 } else { m2 },
        }
    }
}

/// Per-channel moments of `x` (a tensor of geometry `g`), `C` of them.
pub fn channel_moments<T: Element>(g: &Geometry, x: &[T]) -> Vec<Moments> {
    debug_assert_eq!(x.len(), g.len());
    if g.channels_last() {
        channels_last(g, x)
    } else {
        channel_major(g, x)
    }
}

fn channel_major<T: Element>(g: &Geometry, x: &[T]) -> Vec<Moments> {
    let split = ChannelMajorSplit::new(g);
    let partials = map_tasks(g, split.tasks(g), |t| {
        let (c, o0, o1) = split.task(g, t);
        let mut m = Moments::EMPTY;
        for_each_channel_tile(g, c, o0, o1, |tile| {
            m = m.merge(tile_moments(tile.pieces(x), tile.len()));
        });
        m
    });
    partials
        .chunks(split.chunks)
        .map(|p| p.iter().fold(Moments::EMPTY, |a, &b| a.merge(b)))
        .collect()
}

/// Exact two-pass moments of one cache-resident tile of `n` elements.
fn tile_moments<'a, T: Element>(
    pieces: impl Iterator<Item = &'a [T]> + Clone,
    n: usize,
) -> Moments {
    let zero = T::Stat::ZERO;
    let mut sum = [zero; LANES];
    for p in pieces.clone() {
        let (body, tail) = p.split_at(p.len() - p.len() % LANES);
        for ch in body.chunks_exact(LANES) {
            for l in 0..LANES {
                sum[l] = sum[l] + ch[l].widen();
            }
        }
        for (l, v) in tail.iter().enumerate() {
            sum[l] = sum[l] + v.widen();
        }
    }
    let total = sum.iter().map(|v| v.to_f64()).sum::<f64>();
    let pivot = T::Stat::from_f64(total / n as f64);
    let (mut s1, mut s2) = ([zero; LANES], [zero; LANES]);
    for p in pieces {
        let (body, tail) = p.split_at(p.len() - p.len() % LANES);
        for ch in body.chunks_exact(LANES) {
            for l in 0..LANES {
                let d = ch[l].widen() - pivot;
                s1[l] = s1[l] + d;
                s2[l] = s2[l] + d * d;
            }
        }
        for (l, v) in tail.iter().enumerate() {
            let d = v.widen() - pivot;
            s1[l] = s1[l] + d;
            s2[l] = s2[l] + d * d;
        }
    }
    let s1 = s1.iter().map(|v| v.to_f64()).sum::<f64>();
    let s2 = s2.iter().map(|v| v.to_f64()).sum::<f64>();
    Moments::from_pivot(n, pivot.to_f64(), s1, s2)
}

fn channels_last<T: Element>(g: &Geometry, x: &[T]) -> Vec<Moments> {
    let c = g.channels;
    let ppt = pixels_per_task(c);
    let tile_px = pixels_per_tile(c);
    let tasks = g.outer.div_ceil(ppt);
    let partials = map_tasks(g, tasks, |t| {
        let zero = T::Stat::ZERO;
        let pixels = &x[t * ppt * c..((t + 1) * ppt).min(g.outer) * c];
        let mut out = vec![Moments::EMPTY; c];
        let (mut pivot, mut s1, mut s2) = (vec![zero; c], vec![zero; c], vec![zero; c]);
        for tile in pixels.chunks(tile_px * c) {
            let n = tile.len() / c;
            pivot.fill(zero);
            for px in tile.chunks_exact(c) {
                for (p, v) in pivot.iter_mut().zip(px) {
                    *p = *p + v.widen();
                }
            }
            let inv_n = T::Stat::from_f64(1.0 / n as f64);
            for p in pivot.iter_mut() {
                *p = *p * inv_n;
            }
            s1.fill(zero);
            s2.fill(zero);
            for px in tile.chunks_exact(c) {
                for (((a, b), p), v) in s1.iter_mut().zip(s2.iter_mut()).zip(&pivot).zip(px) {
                    let d = v.widen() - *p;
                    *a = *a + d;
                    *b = *b + d * d;
                }
            }
            for (ch, o) in out.iter_mut().enumerate() {
                *o = o.merge(Moments::from_pivot(
                    n,
                    pivot[ch].to_f64(),
                    s1[ch].to_f64(),
                    s2[ch].to_f64(),
                ));
            }
        }
        out
    });
    let mut total = vec![Moments::EMPTY; c];
    for p in &partials {
        for (t, m) in total.iter_mut().zip(p) {
            *t = t.merge(*m);
        }
    }
    total
}
