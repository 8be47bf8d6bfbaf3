//! Backward passes: the reduction `Σdy`, `Σdy·(x − μ)` per channel, and the
//! elementwise `dx = (dy − dȳ)·k1 + (x − μ)·k2`.
//!
//! Centring both `dy` and `x` before scaling (rather than folding the means into a
//! constant term) keeps `dx` exact where it should vanish (e.g. `M = 1`, as in
//! TensorFlow) and accurate when |μ| ≫ std.

use super::{
    for_each_channel_tile, for_each_row_chunk, map_tasks, pixels_per_task, pixels_per_tile,
    ChannelMajorSplit, Geometry, LANES,
};
use crate::element::{Element, Real};

/// Per-channel sums of the backward reduction, in `f64`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BackwardSums {
    /// `Σ dy` per channel.
    pub sum_dy: Vec<f64>,
    /// `Σ dy·(x − μ)` per channel.
    pub sum_dy_xc: Vec<f64>,
}

/// `Σdy` and `Σdy·(x − mean[c])` per channel of `dy` and `x` (geometry `g`).
pub fn reduce<T: Element>(g: &Geometry, dy: &[T], x: &[T], mean: &[T::Stat]) -> BackwardSums {
    debug_assert!(dy.len() == g.len() && x.len() == g.len() && mean.len() == g.channels);
    if g.channels_last() {
        reduce_channels_last(g, dy, x, mean)
    } else {
        reduce_channel_major(g, dy, x, mean)
    }
}

fn reduce_channel_major<T: Element>(
    g: &Geometry,
    dy: &[T],
    x: &[T],
    mean: &[T::Stat],
) -> BackwardSums {
    let split = ChannelMajorSplit::new(g);
    let partials = map_tasks(g, split.tasks(g), |t| {
        let (c, o0, o1) = split.task(g, t);
        let m = mean[c];
        let (mut sdy, mut sdx) = (0f64, 0f64);
        for_each_channel_tile(g, c, o0, o1, |tile| {
            let zero = T::Stat::ZERO;
            let (mut a, mut b) = ([zero; LANES], [zero; LANES]);
            for (d, xv) in tile.pieces(dy).zip(tile.pieces(x)) {
                let k = d.len() - d.len() % LANES;
                for (dc, xc) in d[..k].chunks_exact(LANES).zip(xv[..k].chunks_exact(LANES)) {
                    for l in 0..LANES {
                        let dv = dc[l].widen();
                        a[l] = a[l] + dv;
                        b[l] = b[l] + dv * (xc[l].widen() - m);
                    }
                }
                for (l, (dv, xv)) in d[k..].iter().zip(&xv[k..]).enumerate() {
                    let dv = dv.widen();
                    a[l] = a[l] + dv;
                    b[l] = b[l] + dv * (xv.widen() - m);
                }
            }
            sdy += a.iter().map(|v| v.to_f64()).sum::<f64>();
            sdx += b.iter().map(|v| v.to_f64()).sum::<f64>();
        });
        (sdy, sdx)
    });
    let mut sums = BackwardSums::default();
    for p in partials.chunks(split.chunks) {
        sums.sum_dy.push(p.iter().map(|v| v.0).sum());
        sums.sum_dy_xc.push(p.iter().map(|v| v.1).sum());
    }
    sums
}

fn reduce_channels_last<T: Element>(
    g: &Geometry,
    dy: &[T],
    x: &[T],
    mean: &[T::Stat],
) -> BackwardSums {
    let c = g.channels;
    let ppt = pixels_per_task(c);
    let tile_px = pixels_per_tile(c);
    let tasks = g.outer.div_ceil(ppt);
    let partials = map_tasks(g, tasks, |t| {
        let zero = T::Stat::ZERO;
        let range = t * ppt * c..((t + 1) * ppt).min(g.outer) * c;
        let (dy, x) = (&dy[range.clone()], &x[range]);
        let mut out = BackwardSums {
            sum_dy: vec![0.0; c],
            sum_dy_xc: vec![0.0; c],
        };
        let (mut a, mut b) = (vec![zero; c], vec![zero; c]);
        for (dt, xt) in dy.chunks(tile_px * c).zip(x.chunks(tile_px * c)) {
            a.fill(zero);
            b.fill(zero);
            for (dp, xp) in dt.chunks_exact(c).zip(xt.chunks_exact(c)) {
                for ((((a, b), d), xv), m) in
                    a.iter_mut().zip(b.iter_mut()).zip(dp).zip(xp).zip(mean)
                {
                    let d = d.widen();
                    *a = *a + d;
                    *b = *b + d * (xv.widen() - *m);
                }
            }
            for ch in 0..c {
                out.sum_dy[ch] += a[ch].to_f64();
                out.sum_dy_xc[ch] += b[ch].to_f64();
            }
        }
        out
    });
    let mut sums = BackwardSums {
        sum_dy: vec![0.0; c],
        sum_dy_xc: vec![0.0; c],
    };
    for p in &partials {
        for ch in 0..c {
            sums.sum_dy[ch] += p.sum_dy[ch];
            sums.sum_dy_xc[ch] += p.sum_dy_xc[ch];
        }
    }
    sums
}

/// `dx = (dy − dy_mean[c])·k1[c] + (x − mean[c])·k2[c]`, computed in `U`, rounded once.
#[allow(clippy::too_many_arguments)]
pub fn apply<T: Element>(
    g: &Geometry,
    dy: &[T],
    x: &[T],
    dy_mean: &[T::Stat],
    mean: &[T::Stat],
    k1: &[T::Stat],
    k2: &[T::Stat],
    dx: &mut [T],
) {
    debug_assert!(dy.len() == g.len() && x.len() == g.len() && dx.len() == g.len());
    let (row_len, c) = (g.row_len(), g.channels);
    for_each_row_chunk(g, dx, |row0, out| {
        let off = row0 * row_len;
        let (dys, xs) = (&dy[off..][..out.len()], &x[off..][..out.len()]);
        if g.channels_last() {
            for ((o, d), xr) in out
                .chunks_exact_mut(c)
                .zip(dys.chunks_exact(c))
                .zip(xs.chunks_exact(c))
            {
                for i in 0..c {
                    let v = (d[i].widen() - dy_mean[i]) * k1[i] + (xr[i].widen() - mean[i]) * k2[i];
                    o[i] = T::narrow(v);
                }
            }
        } else {
            for (r, ((o, d), xr)) in out
                .chunks_exact_mut(row_len)
                .zip(dys.chunks_exact(row_len))
                .zip(xs.chunks_exact(row_len))
                .enumerate()
            {
                let ch = (row0 + r) % c;
                let (dm, m, k1, k2) = (dy_mean[ch], mean[ch], k1[ch], k2[ch]);
                for ((o, d), xv) in o.iter_mut().zip(d).zip(xr) {
                    *o = T::narrow((d.widen() - dm) * k1 + (xv.widen() - m) * k2);
                }
            }
        }
    });
}
