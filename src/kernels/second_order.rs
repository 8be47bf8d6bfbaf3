//! Second-order gradient passes (the gradient of the gradient op): one reduction of
//! five per-channel sums, then one elementwise pass writing both full-size outputs.
//!
//! With `g = y_backprop`, `A` the upstream gradient of `x_backprop`, `xc = x − μ`:
//!
//! - reduction, with `g' = g − kg`, `A' = A − ka` around per-channel shifts (the
//!   channel's first elements, so that centred sums cancel exactly where they should,
//!   e.g. one element per channel): `Σg'`, `ΣA'`, `Σg'·xc`, `ΣA'·xc`, `ΣA'·g'`, `Σxc`;
//! - elementwise: `d_g = (A − Ā)·c1 + xc·c2 + b` and
//!   `d_x = (g − ḡ)·c2 + (A − Ā)·e2 + xc·e3`, per-channel constants from the sums.
//!
//! (In training μ comes from the statistics pass first: two reductions in all.)

use rayon::prelude::*;

use super::simd::{load_len, splat_n, store_len, Dispatch, Isa, Kernel, Simd};
use super::{
    channel_tiles, map_tasks, merge_channel_results, pixels_per_reduce_task, pixels_per_tile,
    ChannelMajorSplit, ChannelTask, Geometry, TASK,
};
use crate::element::{Element, Real};

/// Per-channel sums of the second-order reduction, in `f64`, with `g' = g − kg`,
/// `A' = A − ka` (the shifts given to [`reduce`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SecondOrderSums {
    /// `Σg'`.
    pub g: Vec<f64>,
    /// `ΣA'`.
    pub a: Vec<f64>,
    /// `Σg'·(x − μ)`.
    pub g_xc: Vec<f64>,
    /// `ΣA'·(x − μ)`.
    pub a_xc: Vec<f64>,
    /// `ΣA'·g'`.
    pub a_g: Vec<f64>,
    /// `Σ(x − μ)`.
    pub xc: Vec<f64>,
}

type Six = [f64; 6];

/// The per-channel shifts `[μ, kg, ka]` as vectors.
type Shifts<V> = [V; 3];

/// Adds one vector of `g`, `x`, `a` to the six sums. For a partial vector the shifts
/// must be loaded partially too, so that the missing lanes stay 0 − 0 = 0.
#[inline(always)]
fn accumulate<U: Real, S: Simd<U>>(
    s: S,
    g: S::V,
    x: S::V,
    a: S::V,
    k: &Shifts<S::V>,
    acc: &mut [S::V; 6],
) {
    let (g, a, xc) = (s.sub(g, k[1]), s.sub(a, k[2]), s.sub(x, k[0]));
    acc[0] = s.add(acc[0], g);
    acc[1] = s.add(acc[1], a);
    acc[2] = s.mul_add(g, xc, acc[2]);
    acc[3] = s.mul_add(a, xc, acc[3]);
    acc[4] = s.mul_add(a, g, acc[4]);
    acc[5] = s.add(acc[5], xc);
}

/// The six sums per channel of `ins = [g, x, a]` (all of geometry `geo`), around
/// `shifts = [mean, kg, ka]`: `mean` for x and the shifts `kg`, `ka` for g and A.
pub fn reduce<T: Element>(
    geo: &Geometry,
    isa: Isa,
    ins: [&[T]; 3],
    shifts: [&[T::Stat]; 3],
) -> SecondOrderSums {
    let [g, x, a] = ins;
    let c = geo.channels;
    let per: Vec<Six> = if geo.channels_last() {
        let ppt = pixels_per_reduce_task(c);
        let partials = map_tasks(geo, geo.outer.div_ceil(ppt), |t| {
            let r = t * ppt * c..((t + 1) * ppt).min(geo.outer) * c;
            let ins = [&g[r.clone()], &x[r.clone()], &a[r]];
            T::Stat::dispatch(isa, PixelSums { ins, shifts })
        });
        let mut total = vec![[0f64; 6]; c];
        for p in &partials {
            for (t, v) in total.iter_mut().zip(p) {
                for k in 0..6 {
                    t[k] += v[k];
                }
            }
        }
        total
    } else {
        let tasks = ChannelMajorSplit::new(geo).tasks(geo);
        let partials = map_tasks(geo, tasks.len(), |i| {
            T::Stat::dispatch(
                isa,
                TaskSums {
                    geo,
                    ins: [g, x, a],
                    shifts,
                    task: tasks[i],
                },
            )
        });
        merge_channel_results(geo, &tasks, partials, |p, q| {
            std::array::from_fn(|k| p[k] + q[k])
        })
    };
    let col = |k: usize| per.iter().map(|v| v[k]).collect();
    SecondOrderSums {
        g: col(0),
        a: col(1),
        g_xc: col(2),
        a_xc: col(3),
        a_g: col(4),
        xc: col(5),
    }
}

struct TaskSums<'a, T: Element> {
    geo: &'a Geometry,
    ins: [&'a [T]; 3],
    shifts: [&'a [T::Stat]; 3],
    task: ChannelTask,
}

impl<T: Element> Kernel<T::Stat> for TaskSums<'_, T> {
    type Output = Vec<Six>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<Six> {
        let (t, l) = (self.task, S::LANES);
        let zero = s.splat(T::Stat::ZERO);
        let mut out = Vec::with_capacity(t.c1 - t.c0);
        let mut repeated = vec![T::Stat::ZERO; 3 * l];
        for c in t.c0..t.c1 {
            for (j, sh) in self.shifts.iter().enumerate() {
                repeated[j * l..(j + 1) * l].fill(sh[c]);
            }
            let full = [
                s.load(&repeated[..]),
                s.load(&repeated[l..]),
                s.load(&repeated[2 * l..]),
            ];
            let mut total = [0f64; 6];
            for tile in channel_tiles(self.geo, c, t.o0, t.o1) {
                let mut acc = [zero; 6];
                for i in 0..tile.count {
                    let off = tile.start + i * tile.stride;
                    let [g, x, a] = self.ins.map(|v| &v[off..][..tile.step]);
                    let mut j = 0;
                    while j < tile.step {
                        let len = l.min(tile.step - j);
                        let (gv, xv, av) = (
                            load_len(s, g, j, len),
                            load_len(s, x, j, len),
                            load_len(s, a, j, len),
                        );
                        let k = if len == l {
                            full
                        } else {
                            [
                                s.load_partial(&repeated[..len]),
                                s.load_partial(&repeated[l..l + len]),
                                s.load_partial(&repeated[2 * l..2 * l + len]),
                            ]
                        };
                        accumulate(s, gv, xv, av, &k, &mut acc);
                        j += len;
                    }
                }
                for k in 0..6 {
                    total[k] += s.sum_f64(acc[k]);
                }
            }
            out.push(total);
        }
        out
    }
}

struct PixelSums<'a, T: Element> {
    ins: [&'a [T]; 3],
    shifts: [&'a [T::Stat]; 3],
}

impl<T: Element> Kernel<T::Stat> for PixelSums<'_, T> {
    type Output = Vec<Six>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<Six> {
        let (l, c) = (S::LANES, self.shifts[0].len());
        let groups = c.div_ceil(l);
        let zero = s.splat(T::Stat::ZERO);
        // Shifts padded with 0 past C, so partial groups shift their missing lanes by 0.
        let padded = self.shifts.map(|v| {
            let mut p = v.to_vec();
            p.resize(groups * l, T::Stat::ZERO);
            p
        });
        let mut acc = vec![[zero; 6]; groups];
        let mut lanes = vec![T::Stat::ZERO; groups * l];
        let mut out = vec![[0f64; 6]; c];
        let tile = pixels_per_tile(c) * c;
        let [g, x, a] = self.ins;
        let mut start = 0;
        while start < g.len() {
            let end = (start + tile).min(g.len());
            acc.fill([zero; 6]);
            let mut p = start;
            while p < end {
                for (gi, ac) in acc.iter_mut().enumerate() {
                    let (at, len) = (p + gi * l, l.min(c - gi * l));
                    let (gv, xv, av) = (
                        load_len(s, g, at, len),
                        load_len(s, x, at, len),
                        load_len(s, a, at, len),
                    );
                    let at = gi * l;
                    let k = [
                        s.load(&padded[0][at..]),
                        s.load(&padded[1][at..]),
                        s.load(&padded[2][at..]),
                    ];
                    accumulate(s, gv, xv, av, &k, ac);
                }
                p += c;
            }
            for k in 0..6 {
                for (gi, ac) in acc.iter().enumerate() {
                    s.store(&mut lanes[gi * l..], ac[k]);
                }
                for (ch, o) in out.iter_mut().enumerate() {
                    o[k] += lanes[ch].to_f64();
                }
            }
            start = end;
        }
        out
    }
}

/// Per-channel constants of the elementwise pass.
#[derive(Clone, Debug, Default)]
pub struct SecondOrderCoeffs<U> {
    /// μ.
    pub mean: Vec<U>,
    /// Ā.
    pub a_mean: Vec<U>,
    /// ḡ.
    pub g_mean: Vec<U>,
    /// Coefficient of `A − Ā` in `d_g`.
    pub c1: Vec<U>,
    /// Coefficient of `x − μ` in `d_g` and of `g − ḡ` in `d_x`.
    pub c2: Vec<U>,
    /// The constant term of `d_g` (the upstream `offset_backprop` gradient).
    pub b: Vec<U>,
    /// Coefficient of `A − Ā` in `d_x`.
    pub e2: Vec<U>,
    /// Coefficient of `x − μ` in `d_x`.
    pub e3: Vec<U>,
}

impl<U: Copy> SecondOrderCoeffs<U> {
    fn at(&self, c: usize) -> [U; 8] {
        [
            self.mean[c],
            self.a_mean[c],
            self.g_mean[c],
            self.c1[c],
            self.c2[c],
            self.b[c],
            self.e2[c],
            self.e3[c],
        ]
    }
}

#[inline(always)]
fn eval<U: Real, S: Simd<U>>(s: S, g: S::V, x: S::V, a: S::V, k: &[S::V; 8]) -> (S::V, S::V) {
    let [m, am, gm, c1, c2, b, e2, e3] = *k;
    let (xc, ac, gc) = (s.sub(x, m), s.sub(a, am), s.sub(g, gm));
    let dg = s.add(s.mul_add(ac, c1, s.mul(xc, c2)), b);
    let dx = s.mul_add(gc, c2, s.mul_add(ac, e2, s.mul(xc, e3)));
    (dg, dx)
}

/// Writes `outs = (d_g, d_x)` (see the module docs) from `ins = [g, x, a]`.
pub fn apply<T: Element>(
    geo: &Geometry,
    isa: Isa,
    ins: [&[T]; 3],
    k: &SecondOrderCoeffs<T::Stat>,
    outs: (&mut [T], &mut [T]),
) {
    let ([g, x, a], (d_g, d_x)) = (ins, outs);
    let row_len = geo.row_len();
    let rows = (TASK / row_len.max(1)).max(1);
    let chunk = (rows * row_len).max(1);
    let run = |i: usize, (dg, dx): (&mut [T], &mut [T])| {
        let off = i * chunk;
        let ins = [g, x, a].map(|v| &v[off..][..dg.len()]);
        T::Stat::dispatch(
            isa,
            Apply {
                geo,
                row0: i * rows,
                ins,
                k,
                dg,
                dx,
            },
        );
    };
    if geo.len() >= super::PARALLEL_MIN && rayon::current_num_threads() > 1 {
        d_g.par_chunks_mut(chunk)
            .zip(d_x.par_chunks_mut(chunk))
            .enumerate()
            .for_each(|(i, o)| run(i, o));
    } else {
        d_g.chunks_mut(chunk)
            .zip(d_x.chunks_mut(chunk))
            .enumerate()
            .for_each(|(i, o)| run(i, o));
    }
}

struct Apply<'a, T: Element> {
    geo: &'a Geometry,
    row0: usize,
    ins: [&'a [T]; 3],
    k: &'a SecondOrderCoeffs<T::Stat>,
    dg: &'a mut [T],
    dx: &'a mut [T],
}

impl<T: Element> Kernel<T::Stat> for Apply<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) {
        let (geo, l) = (self.geo, S::LANES);
        let [g, x, a] = self.ins;
        let row_len = geo.row_len();
        if geo.channels_last() {
            // Per-channel constants padded to whole vectors, one set per channel group.
            let c = geo.channels;
            let groups = c.div_ceil(l);
            let mut padded = vec![T::Stat::ZERO; 8 * groups * l];
            for ch in 0..c {
                for (j, v) in self.k.at(ch).into_iter().enumerate() {
                    padded[j * groups * l + ch] = v;
                }
            }
            let mut consts = Vec::with_capacity(groups);
            for gi in 0..groups {
                let mut kv = [s.splat(T::Stat::ZERO); 8];
                for (j, v) in kv.iter_mut().enumerate() {
                    *v = s.load(&padded[j * groups * l + gi * l..]);
                }
                consts.push(kv);
            }
            let mut p = 0;
            while p < self.dg.len() {
                for (gi, kv) in consts.iter().enumerate() {
                    let (at, len) = (p + gi * l, l.min(c - gi * l));
                    let (gv, xv, av) = (
                        load_len(s, g, at, len),
                        load_len(s, x, at, len),
                        load_len(s, a, at, len),
                    );
                    let (dg, dx) = eval(s, gv, xv, av, kv);
                    store_len(s, self.dg, at, len, dg);
                    store_len(s, self.dx, at, len, dx);
                }
                p += c;
            }
        } else {
            for r in 0..self.dg.len() / row_len {
                let kv = splat_n(s, self.k.at((self.row0 + r) % geo.channels));
                let mut j = r * row_len;
                let end = j + row_len;
                while j < end {
                    let len = l.min(end - j);
                    let (gv, xv, av) = (
                        load_len(s, g, j, len),
                        load_len(s, x, j, len),
                        load_len(s, a, j, len),
                    );
                    let (dg, dx) = eval(s, gv, xv, av, &kv);
                    store_len(s, self.dg, j, len, dg);
                    store_len(s, self.dx, j, len, dx);
                    j += len;
                }
            }
        }
    }
}
