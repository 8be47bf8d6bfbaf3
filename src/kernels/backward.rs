//! Backward passes: the reduction `Σdy`, `Σdy·(x − μ)` per channel, and the
//! elementwise `dx = (dy − dȳ)·k1 + (x − μ)·k2`.
//!
//! Centring both `dy` and `x` before scaling (rather than folding the means into a
//! constant term) keeps `dx` exact where it should vanish (e.g. `M = 1`, as in
//! TensorFlow) and accurate when |μ| ≫ std.

use super::apply::{elementwise, head_len, VectorFn};
use super::simd::{load_len, Dispatch, Isa, Kernel, Simd};
use super::{
    channel_tiles, map_tasks, merge_channel_results, pixels_per_reduce_task, pixels_per_tile,
    ChannelMajorSplit, ChannelTask, Geometry,
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

impl BackwardSums {
    /// Zero sums for `c` channels.
    pub fn zeros(c: usize) -> Self {
        BackwardSums {
            sum_dy: vec![0.0; c],
            sum_dy_xc: vec![0.0; c],
        }
    }

    /// The channel-by-channel total of per-task partial sums, added in task order.
    pub fn total(c: usize, partials: &[BackwardSums]) -> Self {
        let mut sums = BackwardSums::zeros(c);
        for p in partials {
            for (a, b) in sums.sum_dy.iter_mut().zip(&p.sum_dy) {
                *a += b;
            }
            for (a, b) in sums.sum_dy_xc.iter_mut().zip(&p.sum_dy_xc) {
                *a += b;
            }
        }
        sums
    }

    /// Sums from per-channel `(Σdy, Σdy·(x − μ))` pairs.
    pub fn from_pairs(pairs: &[(f64, f64)]) -> Self {
        BackwardSums {
            sum_dy: pairs.iter().map(|p| p.0).collect(),
            sum_dy_xc: pairs.iter().map(|p| p.1).collect(),
        }
    }
}

/// `Σdy` and `Σdy·(x − mean[c])` per channel of `dy` and `x` (geometry `g`). With
/// `mask` (the forward output `y` of a ReLU), `dy` counts only where `mask > 0`.
pub fn reduce<T: Element>(
    g: &Geometry,
    isa: Isa,
    dy: &[T],
    mask: Option<&[T]>,
    x: &[T],
    mean: &[T::Stat],
) -> BackwardSums {
    debug_assert!(dy.len() == g.len() && x.len() == g.len() && mean.len() == g.channels);
    if g.channels_last() {
        let c = g.channels;
        let ppt = pixels_per_reduce_task(c);
        let partials = map_tasks(g, g.outer.div_ceil(ppt), |t| {
            let range = t * ppt * c..((t + 1) * ppt).min(g.outer) * c;
            let mut sums = BackwardSums::zeros(c);
            T::Stat::dispatch(
                isa,
                PixelSums {
                    dy: &dy[range.clone()],
                    mask: mask.map(|m| &m[range.clone()]),
                    x: &x[range],
                    mean,
                    dx: None,
                    sums: &mut sums,
                },
            );
            sums
        });
        BackwardSums::total(c, &partials)
    } else {
        let tasks = ChannelMajorSplit::new(g).tasks(g);
        let partials = map_tasks(g, tasks.len(), |i| {
            T::Stat::dispatch(
                isa,
                TaskSums {
                    g,
                    dy,
                    mask,
                    x,
                    mean,
                    task: tasks[i],
                },
            )
        });
        let per = merge_channel_results(g, &tasks, partials, |a, b| (a.0 + b.0, a.1 + b.1));
        BackwardSums::from_pairs(&per)
    }
}

/// `(Σdy, Σdy·(x − m))` over channel `c`, outer rows `[o0, o1)`, of a channel-major
/// tensor, tile by tile.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn channel_rows_in<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    g: &Geometry,
    dy: &[T],
    mask: Option<&[T]>,
    x: &[T],
    m: U,
    c: usize,
    o0: usize,
    o1: usize,
) -> (f64, f64) {
    let (mut sdy, mut sdx) = (0f64, 0f64);
    let (m, zero) = (s.splat(m), s.splat(U::ZERO));
    for tile in channel_tiles(g, c, o0, o1) {
        let mut acc = (zero, zero);
        for (i, (d, x)) in tile.pieces(dy).zip(tile.pieces(x)).enumerate() {
            let mk = mask.map(|y| &y[tile.start + i * tile.stride..][..tile.step]);
            acc = row_sums(s, d, mk, x, m, None, zero, acc);
        }
        sdy += s.sum_f64(acc.0);
        sdx += s.sum_f64(acc.1);
    }
    (sdy, sdx)
}

/// The backward sums of each channel of one task of a channel-major split.
struct TaskSums<'a, T: Element> {
    g: &'a Geometry,
    dy: &'a [T],
    mask: Option<&'a [T]>,
    x: &'a [T],
    mean: &'a [T::Stat],
    task: ChannelTask,
}

impl<T: Element> Kernel<T::Stat> for TaskSums<'_, T> {
    type Output = Vec<(f64, f64)>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<(f64, f64)> {
        let t = self.task;
        let mut out = Vec::with_capacity(t.c1 - t.c0);
        for c in t.c0..t.c1 {
            out.push(channel_rows_in(
                s,
                self.g,
                self.dy,
                self.mask,
                self.x,
                self.mean[c],
                c,
                t.o0,
                t.o1,
            ));
        }
        out
    }
}

/// Accumulates `Σdy`, `Σdy·(x − m)` of one contiguous run into `acc` (dy masked to
/// `mask > 0` when given); with `dx`, also writes `dx = dy·k1` (the inference
/// gradient — or, with `k1 = 1`, the masked dy itself), fused into the same read.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn row_sums<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    dy: &[T],
    mask: Option<&[T]>,
    x: &[T],
    m: S::V,
    mut dx: Option<(&mut [T], bool)>,
    k1: S::V,
    (mut a, mut b): (S::V, S::V),
) -> (S::V, S::V) {
    let (l, n) = (S::LANES, dy.len());
    let stream = dx.as_ref().is_some_and(|d| d.1);
    // Peel a partial vector so that streaming stores are aligned.
    let head = match &dx {
        Some((out, st)) => head_len(out, l, *st),
        None => 0,
    };
    let mut i = 0;
    while i < n {
        let len = if i == 0 && head > 0 {
            head
        } else {
            l.min(n - i)
        };
        let full = len == l;
        let mut d = load_len(s, dy, i, len);
        if let Some(y) = mask {
            d = s.mask_positive(load_len(s, y, i, len), d);
        }
        a = s.add(a, d);
        b = s.mul_add(d, s.sub(load_len(s, x, i, len), m), b);
        if let Some((out, _)) = dx.as_mut() {
            let v = s.mul(d, k1);
            if !full {
                s.store_partial(&mut out[i..i + len], v);
            } else if stream {
                s.stream(&mut out[i..], v);
            } else {
                s.store(&mut out[i..], v);
            }
        }
        i += len;
    }
    (a, b)
}

/// Backward sums over whole pixels, by tiles flushed to `f64`; with `dx`, also writes
/// `dx = dy·k1` (the inference gradient).
pub(crate) struct PixelSums<'a, T: Element> {
    pub dy: &'a [T],
    pub mask: Option<&'a [T]>,
    pub x: &'a [T],
    pub mean: &'a [T::Stat],
    pub dx: Option<(&'a mut [T], &'a [T::Stat])>,
    pub sums: &'a mut BackwardSums,
}

impl<T: Element> Kernel<T::Stat> for PixelSums<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) {
        let (l, c) = (S::LANES, self.mean.len());
        let (full, groups) = (c / l, c.div_ceil(l));
        let zero = s.splat(T::Stat::ZERO);
        let padded = |v: &[T::Stat]| {
            let mut p = v.to_vec();
            p.resize(groups * l, T::Stat::ZERO);
            p
        };
        let mean = padded(self.mean);
        let k1 = padded(self.dx.as_ref().map_or(&[][..], |d| d.1));
        let mut out = self.dx.map(|d| d.0);
        let (mut a, mut b) = (vec![zero; groups], vec![zero; groups]);
        let mut lanes = vec![T::Stat::ZERO; 2 * groups * l];
        let tile = pixels_per_tile(c) * c;
        for (t, (dt, xt)) in self.dy.chunks(tile).zip(self.x.chunks(tile)).enumerate() {
            a.fill(zero);
            b.fill(zero);
            for (p, (dp, xp)) in dt.chunks_exact(c).zip(xt.chunks_exact(c)).enumerate() {
                let at = t * tile + p * c;
                let yp = self.mask.map(|y| &y[at..][..c]);
                let mut o = out.as_deref_mut().map(|o| &mut o[at..][..c]);
                for gi in 0..groups {
                    let (full_group, at, len) = (gi < full, gi * l, l.min(c - gi * l));
                    let mut d = load_len(s, dp, at, len);
                    if let Some(y) = yp {
                        d = s.mask_positive(load_len(s, y, at, len), d);
                    }
                    a[gi] = s.add(a[gi], d);
                    b[gi] = s.mul_add(
                        d,
                        s.sub(load_len(s, xp, at, len), s.load(&mean[at..])),
                        b[gi],
                    );
                    if let Some(o) = o.as_deref_mut() {
                        let v = s.mul(d, s.load(&k1[gi * l..]));
                        if full_group {
                            s.store(&mut o[gi * l..], v);
                        } else {
                            s.store_partial(&mut o[gi * l..], v);
                        }
                    }
                }
            }
            let (la, lb) = lanes.split_at_mut(groups * l);
            for gi in 0..groups {
                s.store(&mut la[gi * l..], a[gi]);
                s.store(&mut lb[gi * l..], b[gi]);
            }
            for ch in 0..c {
                self.sums.sum_dy[ch] += la[ch].to_f64();
                self.sums.sum_dy_xc[ch] += lb[ch].to_f64();
            }
        }
    }
}

/// `(dy − dm)·k1 + (x − m)·k2`.
#[derive(Clone, Copy)]
pub(crate) struct BackwardFn;

impl VectorFn<2, 4> for BackwardFn {
    #[inline(always)]
    fn eval<U: Real, S: Simd<U>>(
        &self,
        s: S,
        [dy, x]: [S::V; 2],
        [dm, m, k1, k2]: [S::V; 4],
    ) -> S::V {
        s.mul_add(s.sub(dy, dm), k1, s.mul(s.sub(x, m), k2))
    }
}

/// `(mask > 0 ? dy : 0 − dm)·k1 + (x − m)·k2`: the training gradient after a ReLU.
#[derive(Clone, Copy)]
pub(crate) struct BackwardMaskFn;

impl VectorFn<3, 4> for BackwardMaskFn {
    #[inline(always)]
    fn eval<U: Real, S: Simd<U>>(&self, s: S, [dy, x, y]: [S::V; 3], k: [S::V; 4]) -> S::V {
        BackwardFn.eval(s, [s.mask_positive(y, dy), x], k)
    }
}

/// `dx = (dy − dy_mean[c])·k1[c] + (x − mean[c])·k2[c]`, computed in `U`, rounded once;
/// with `mask`, dy counts only where `mask > 0`.
#[allow(clippy::too_many_arguments)]
pub fn apply<T: Element>(
    g: &Geometry,
    isa: Isa,
    dy: &[T],
    mask: Option<&[T]>,
    x: &[T],
    dy_mean: &[T::Stat],
    mean: &[T::Stat],
    k1: &[T::Stat],
    k2: &[T::Stat],
    dx: &mut [T],
) {
    debug_assert!(dy.len() == g.len() && x.len() == g.len() && dx.len() == g.len());
    let k = [dy_mean, mean, k1, k2];
    match mask {
        None => elementwise(g, isa, [dy, x], k, dx, BackwardFn),
        Some(y) => elementwise(g, isa, [dy, x, y], k, dx, BackwardMaskFn),
    }
}
