//! Backward passes: the reduction `Σdy`, `Σdy·(x − μ)` per channel, and the
//! elementwise `dx = (dy − dȳ)·k1 + (x − μ)·k2`.
//!
//! Centring both `dy` and `x` before scaling (rather than folding the means into a
//! constant term) keeps `dx` exact where it should vanish (e.g. `M = 1`, as in
//! TensorFlow) and accurate when |μ| ≫ std.

use std::mem::size_of;

use super::apply::{elementwise, head_len, VectorFn, STREAM_AHEAD_BYTES};
use super::simd::{
    load_n, load_partial_n, prefetch_each, sub_n, Dispatch, Isa, Kernel, Reads, Simd, Walk,
    MAX_LANES,
};
use super::{
    arena_if, channel_tiles, map_items, pixels_per_tile, scratch, short_period, task_waves,
    ChannelMajorSplit, ChannelTask, Geometry, NoPace, Pace, PixelSplit, Scratch, TaskRows,
    ARENA_MIN_BYTES, IMAGE_BLOCK_CHANNELS, PREFETCH_BYTES, STREAM_BYTES,
};
use crate::element::{Element, Real};

/// The full-size inputs of a backward pass: `dy`, the optional ReLU mask (the forward's
/// `y`: `dy` counts only where it is positive) and `x`.
#[derive(Debug)]
pub struct GradData<'a, T> {
    /// The upstream gradient.
    pub dy: &'a [T],
    /// The forward output of a ReLU, when `dy` is to be masked by it.
    pub mask: Option<&'a [T]>,
    /// The forward's input.
    pub x: &'a [T],
}

impl<T> Clone for GradData<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for GradData<'_, T> {}

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

    /// The channel-by-channel total of the sums of `n` tasks (`task(t, item, sums)` adds
    /// task `t`'s to zeros), added in task order: [`BackwardSums::total`]'s bits (its
    /// first task plus 0.0 is zeros plus it), with the tasks' sums in waves in the
    /// calling thread's buffer of them ([`task_waves`]): for large C, where a pair of
    /// vectors a task had been fresh pages every call.
    pub(crate) fn in_waves<I: Send>(
        g: &Geometry,
        n: usize,
        c: usize,
        items: Vec<I>,
        task: impl Fn(usize, I, (&mut [f64], &mut [f64])) + Sync + Send,
    ) -> Self {
        debug_assert_eq!(items.len(), n);
        let mut total = BackwardSums::zeros(c);
        let run = |t: usize, item: I, out: &mut [f64]| {
            let (sd, sx) = out.split_at_mut(c);
            task(t, item, (sd, sx));
        };
        task_waves(g, items, 2 * c, 0.0f64, run, |parts| {
            for p in parts.chunks_exact((2 * c).max(1)) {
                let (sd, sx) = p.split_at(c);
                for (a, b) in total.sum_dy.iter_mut().zip(sd) {
                    *a += b;
                }
                for (a, b) in total.sum_dy_xc.iter_mut().zip(sx) {
                    *a += b;
                }
            }
        });
        total
    }

    /// The channel-by-channel total of per-task partial sums, added in task order. The
    /// first task's sums become the total (plus 0.0, as the sum from zeros they replace:
    /// the same bits, −0 included), without another allocation.
    pub fn total(c: usize, partials: Vec<BackwardSums>) -> Self {
        let mut partials = partials.into_iter();
        let mut sums = partials.next().unwrap_or_else(|| BackwardSums::zeros(c));
        for v in sums.sum_dy.iter_mut().chain(&mut sums.sum_dy_xc) {
            *v += 0.0;
        }
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
    data: GradData<'_, T>,
    mean: &[T::Stat],
) -> BackwardSums {
    let GradData { dy, mask, x } = data;
    debug_assert!(dy.len() == g.len() && x.len() == g.len() && mean.len() == g.channels);
    if g.channels_last() {
        // Every input together under a fixed size, not this machine's cache: the
        // summation order (and with it the last bits) depends on the shape and dtype
        // alone. (With x alone counted, 16x28x28x512 bf16, 26 MB of dy and x, went 1.4
        // -> 2.0 ms.)
        let inputs = 2 + usize::from(mask.is_some());
        let quads = if inputs * std::mem::size_of_val(x) < STREAM_BYTES {
            Quads::Cached
        } else if std::mem::size_of::<T>() == 2 {
            Quads::Prefetched
        } else {
            Quads::No
        };
        pixel_task_sums(g, isa, data, mean, None, false, quads)
    } else {
        let per = ChannelMajorSplit::new(g).map_channels(
            g,
            |task| {
                T::Stat::dispatch(
                    isa,
                    TaskSums {
                        g,
                        dy,
                        mask,
                        x,
                        mean,
                        task,
                    },
                )
            },
            |a, b| (a.0 + b.0, a.1 + b.1),
        );
        BackwardSums::from_pairs(&per)
    }
}

/// The backward sums of a channels-last tensor by pixel tasks ([`PixelSplit::reduce`]),
/// each task's [`PixelSums`] (walking its pixels as `quads` says) added in task order;
/// with `dx = Some((dx, k1))`, each task also writes its pixels of `dx = dy·k1` (with
/// non-temporal stores where `stream`). The one driver of [`reduce`] and
/// `fused::backward_inference` over channels-last tensors: at large C (where a task's
/// pair of `f64` vectors reaches [`ARENA_MIN_BYTES`]) the tasks' scratch comes from the
/// thread's arena and their sums from [`BackwardSums::in_waves`], below it each task's
/// sums are its own vectors, added by [`BackwardSums::total`] (the same bits either way).
pub(crate) fn pixel_task_sums<T: Element>(
    g: &Geometry,
    isa: Isa,
    data: GradData<'_, T>,
    mean: &[T::Stat],
    dx: Option<(&mut [T], &[T::Stat])>,
    stream: bool,
    quads: Quads,
) -> BackwardSums {
    let GradData { dy, mask, x } = data;
    debug_assert!(dx.as_ref().is_none_or(|(o, _)| o.len() == g.len()));
    let c = g.channels;
    let split = PixelSplit::reduce(g);
    // Each task's piece of dx (as `PixelSplit::chunks_mut` cuts it), or none.
    let (outs, k1): (Vec<Option<&mut [T]>>, _) = match dx {
        Some((dx, k1)) => (
            split.chunks_mut(dx).into_iter().map(Some).collect(),
            Some(k1),
        ),
        None => ((0..split.len()).map(|_| None).collect(), None),
    };
    let large = 2 * c * size_of::<f64>() >= ARENA_MIN_BYTES;
    // Task `t`'s sums added to `sums`, its dx (if any) into `out`.
    let task = |t: usize, out: Option<&mut [T]>, sums: (&mut [f64], &mut [f64])| {
        let range = split.range(t);
        let run = |arena: Option<&bumpalo::Bump>| {
            T::Stat::dispatch(
                isa,
                PixelSums {
                    dy: &dy[range.clone()],
                    mask: mask.map(|m| &m[range.clone()]),
                    x: &x[range.clone()],
                    mean,
                    dx: out.zip(k1),
                    stream,
                    quads,
                    sums,
                    arena,
                },
            )
        };
        arena_if(large, run);
    };
    if !large {
        let partials = map_items(g, outs, |t, out| {
            let mut sums = BackwardSums::zeros(c);
            task(t, out, (&mut sums.sum_dy, &mut sums.sum_dy_xc));
            sums
        });
        return BackwardSums::total(c, partials);
    }
    BackwardSums::in_waves(g, outs.len(), c, outs, task)
}

/// `(Σdy, Σdy·(x − m))` over channel `c`, outer rows `[o0, o1)`, of a channel-major
/// tensor, tile by tile.
#[inline(always)]
pub(crate) fn channel_rows_in<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    g: &Geometry,
    data: GradData<'_, T>,
    m: U,
    c: usize,
    rows: std::ops::Range<usize>,
) -> (f64, f64) {
    channel_rows_paced(s, g, data, m, c, rows, &mut NoPace)
}

/// [`channel_rows_in`] with `pace` called after each tile (see [`Pace`]).
#[inline(always)]
pub(crate) fn channel_rows_paced<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    g: &Geometry,
    data: GradData<'_, T>,
    m: U,
    c: usize,
    rows: std::ops::Range<usize>,
    pace: &mut P,
) -> (f64, f64) {
    let (dy, mask, x) = (data.dy, data.mask, data.x);
    let (o0, o1) = (rows.start, rows.end);
    let (mut sdy, mut sdx) = (0f64, 0f64);
    let (m, zero) = (s.splat(m), s.splat(U::ZERO));
    for tile in channel_tiles(g, c, o0, o1) {
        let mut acc = (zero, zero);
        for (i, (d, x)) in tile.pieces(dy).zip(tile.pieces(x)).enumerate() {
            let mk = mask.map(|y| &y[tile.start + i * tile.stride..][..tile.step]);
            acc = match mk {
                None => sums_run(s, [d, x], m, acc, pace),
                Some(y) => sums_run(s, [d, x, y], m, acc, pace),
            };
        }
        sdy += s.sum_f64(acc.0);
        sdx += s.sum_f64(acc.1);
        pace.tile_done(s, tile);
    }
    (sdy, sdx)
}

/// `(Σdy, Σdy·(x − mean[c]))` of each channel `c` of task `t` of a channel-major split
/// (rows shorter than [`TILE`](super::TILE)), walked image by image: at each outer
/// index the task's channels in turn (in blocks of at most [`IMAGE_BLOCK_CHANNELS`]),
/// so that every tensor is read (and `dx` written) in memory order. With `out`, `dx = dy·k1[c]` is written to its rows in the same read
/// (the inference gradient), with ordinary stores.
///
/// Each channel's `f32` sums stay apart until the end of its tile, whose rows are the
/// same for every channel ([`channel_tiles`] of rows shorter than a tile depends on the
/// rows alone): each channel folds the same rows into the same lanes in the same order
/// as the walk channel by channel ([`channel_rows_in`], `fused::channel_rows_out`),
/// and adds the same tile sums in `f64`, so the bits are the same. Walked channel by
/// channel, a channel's rows lie a plane of the other channels apart, a few cache lines
/// each, which no hardware prefetcher follows (`Geometry::rows_in_image_order`).
#[inline(always)]
pub(crate) fn task_rows_by_image<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    g: &Geometry,
    data: GradData<'_, T>,
    mean: &[U],
    t: ChannelTask,
    mut out: Option<(&mut TaskRows<'_, T>, &[U])>,
) -> Vec<(f64, f64)> {
    let zero = s.splat(U::ZERO);
    let mut sums = vec![(0f64, 0f64); t.c1 - t.c0];
    let mut acc: Scratch<(S::V, S::V), 64> =
        scratch((zero, zero), IMAGE_BLOCK_CHANNELS.min(t.c1 - t.c0));
    let (inner, stride) = (g.inner, g.channels * g.inner);
    // The task's channels in blocks, each walked image by image (see
    // IMAGE_BLOCK_CHANNELS); `b` is the block's first channel within the task.
    for b in (0..t.c1 - t.c0).step_by(IMAGE_BLOCK_CHANNELS) {
        let (c0, c1) = (t.c0 + b, (t.c0 + b + IMAGE_BLOCK_CHANNELS).min(t.c1));
        let width = (c1 - c0) * inner;
        let mean = &mean[c0..c1];
        let acc = &mut acc[..c1 - c0];
        for tile in channel_tiles(g, c0, t.o0, t.o1) {
            debug_assert!(tile.step == inner);
            let o0 = (tile.start - c0 * inner) / stride;
            for o in o0..o0 + tile.count {
                // The block's channels of image `o`: one slice of each tensor.
                let at = o * stride + c0 * inner;
                let (dy, x) = (&data.dy[at..][..width], &data.x[at..][..width]);
                let mask = data.mask.map(|y| &y[at..][..width]);
                let mut dx = out
                    .as_mut()
                    .map(|(rows, k1)| (&mut rows.image(o)[b * inner..][..width], &k1[c0..c1]));
                for (j, a) in acc.iter_mut().enumerate() {
                    let r = j * inner..(j + 1) * inner;
                    let (d, x) = (&dy[r.clone()], &x[r.clone()]);
                    let m = s.splat(mean[j]);
                    *a = match (&mut dx, mask) {
                        (Some((dx, k1)), mask) => {
                            let run = GradData {
                                dy: d,
                                mask: mask.map(|y| &y[r.clone()]),
                                x,
                            };
                            let (s, k1) = (s.plain_nans(&[&[k1[j]]]), s.splat(k1[j]));
                            let dx = &mut dx[r];
                            row_sums_out(s, run, m, (dx, false), k1, *a, &mut NoPace)
                        }
                        (None, None) => sums_run(s, [d, x], m, *a, &mut NoPace),
                        (None, Some(y)) => sums_run(s, [d, x, &y[r]], m, *a, &mut NoPace),
                    };
                }
            }
            for (sum, a) in sums[b..].iter_mut().zip(acc.iter_mut()) {
                sum.0 += s.sum_f64(a.0);
                sum.1 += s.sum_f64(a.1);
                *a = (zero, zero);
            }
        }
    }
    sums
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
        if self.g.rows_in_image_order(std::mem::size_of::<T>()) {
            let data = GradData {
                dy: self.dy,
                mask: self.mask,
                x: self.x,
            };
            return task_rows_by_image(s, self.g, data, self.mean, t, None);
        }
        let mut out = Vec::with_capacity(t.c1 - t.c0);
        for c in t.c0..t.c1 {
            let data = GradData {
                dy: self.dy,
                mask: self.mask,
                x: self.x,
            };
            out.push(channel_rows_in(
                s,
                self.g,
                data,
                self.mean[c],
                c,
                t.o0..t.o1,
            ));
        }
        out
    }
}

/// Accumulates `Σdy`, `Σdy·(x − m)` of one contiguous run into `acc` (dy masked to
/// `mask > 0` when given) and writes `dx = dy·k1` (the inference gradient — or, with
/// `k1 = 1`, the masked dy itself), fused into the same read, streamed when `stream`;
/// with [`Pace::step`] of `pace` after each step of four vectors of the run's body
/// where the pacer steps ([`Pace::STEPS`]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn row_sums_out<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    data: GradData<'_, T>,
    m: S::V,
    (dx, stream): (&mut [T], bool),
    k1: S::V,
    acc: (S::V, S::V),
    pace: &mut P,
) -> (S::V, S::V) {
    let (dy, x) = (data.dy, data.x);
    // One instantiation per case, so the loops test no flag.
    match data.mask {
        None => sums_out_run(s, [dy, x], m, dx, stream, k1, acc, pace),
        Some(y) => sums_out_run(s, [dy, x, y], m, dx, stream, k1, acc, pace),
    }
}

/// dy of a vector of `[dy, x]` or `[dy, x, mask]`: masked to `mask > 0` with three.
#[inline(always)]
fn grad_of<U: Real, S: Simd<U>, const N: usize>(s: S, v: &[S::V; N]) -> S::V {
    if N == 3 {
        s.mask_positive(v[2], v[0])
    } else {
        v[0]
    }
}

/// Folds one vector of `[dy, x(, mask)]` into the sums `a += dy`, `b += dy·(x − m)`;
/// returns its (masked) dy.
#[inline(always)]
fn fold<U: Real, S: Simd<U>, const N: usize>(
    s: S,
    v: &[S::V; N],
    m: S::V,
    a: &mut S::V,
    b: &mut S::V,
) -> S::V {
    let d = grad_of(s, v);
    *a = s.add(*a, d);
    *b = s.mul_add(d, s.sub(v[1], m), *b);
    d
}

/// The partial vector `[at, at + len)` of `ins` folded into the sums; returns its dy.
#[inline(always)]
fn sums_partial<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize>(
    s: S,
    ins: &[&[T]; N],
    at: usize,
    len: usize,
    m: S::V,
    (a, b): (S::V, S::V),
) -> (S::V, (S::V, S::V)) {
    let (mut a, mut b) = (a, b);
    let d = fold(s, &load_partial_n(s, ins, at, len), m, &mut a, &mut b);
    (d, (a, b))
}

/// The sums over one run of `ins` = dy, x (and the mask): whole vectors in four
/// chains, with [`Pace::step`] after each step of four vectors.
#[inline(always)]
fn sums_run<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>, const N: usize>(
    s: S,
    ins: [&[T]; N],
    m: S::V,
    (mut a, mut b): (S::V, S::V),
    pace: &mut P,
) -> (S::V, S::V) {
    let r = Reads::new(S::LANES, ins, ins[0].len());
    assert!(r.lanes_of(s));
    let zero = s.splat(U::ZERO);
    let (mut a1, mut b1, mut a2, mut b2, mut a3, mut b3) = (zero, zero, zero, zero, zero, zero);
    let mut z = pace.zip_take();
    // Four vectors a step, in four chains of sums: with two, the loop waited on the
    // latency of its additions (as `stats::deviation_sums`, and as there loaded as two
    // pairs in any lane order, `Simd::load_pair_unordered_ptr`: every lane has the
    // same mean here).
    for i in 0..r.vectors() / 4 {
        let j = 4 * i;
        // SAFETY: `j + 3 < 4·(vectors / 4) <= vectors`; lanes checked above.
        let ((v0, v1), (v2, v3)) = unsafe {
            (
                r.load_pair_unordered_unchecked(s, j),
                r.load_pair_unordered_unchecked(s, j + 2),
            )
        };
        fold(s, &v0, m, &mut a, &mut b);
        fold(s, &v1, m, &mut a1, &mut b1);
        fold(s, &v2, m, &mut a2, &mut b2);
        fold(s, &v3, m, &mut a3, &mut b3);
        pace.step(s, &mut z);
    }
    pace.zip_put(z);
    // The last 0–3 whole vectors, into the first chains, in order.
    let j = r.vectors() / 4 * 4;
    if j < r.vectors() {
        fold(s, &r.load(s, j), m, &mut a, &mut b);
    }
    if j + 1 < r.vectors() {
        fold(s, &r.load(s, j + 1), m, &mut a1, &mut b1);
    }
    if j + 2 < r.vectors() {
        fold(s, &r.load(s, j + 2), m, &mut a2, &mut b2);
    }
    let (at, n) = r.tail();
    if n > 0 {
        (_, (a, b)) = sums_partial(s, &ins, at, n, m, (a, b));
    }
    (
        s.add(s.add(a, a1), s.add(a2, a3)),
        s.add(s.add(b, b1), s.add(b2, b3)),
    )
}

/// [`sums_run`] that also writes `dx = dy·k1`, streamed when `stream` (the first
/// partial vector peeled so the full stores are aligned), with [`Pace::step`] of
/// `pace` after each step of four whole vectors of the body where [`Pace::STEPS`].
///
/// The sums have the bits of the one-chain walk from the run's first element, wherever
/// `dx` sits in memory: element `k` is summed in lane `k mod LANES`, in order. Where
/// streaming peels a head of `h` elements, those are folded into lanes `0..h` alone,
/// and the aligned body is summed with the accumulators rotated by `h` lanes (lane `i`
/// holding lane `(h + i) mod LANES`), rotated back at the end of the run; one read of
/// the run, as for an aligned `dx`. Folding the peeled head into the lanes as a vector
/// of its own had made `offset_backprop` and `scale_backprop` of a streamed NCHW
/// inference gradient (and so the Ex backward's `dx`) depend on the buffer's offset
/// (`tests/properties.rs`, streamed outputs; `tests::rotated_rows_have_the_bits_of_the_aligned_walk`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn sums_out_run<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>, const N: usize>(
    s: S,
    ins: [&[T]; N],
    m: S::V,
    out: &mut [T],
    stream: bool,
    k1: S::V,
    mut acc: (S::V, S::V),
    pace: &mut P,
) -> (S::V, S::V) {
    if rows_in_pairs::<U, S, T>(s) && out.len() >= PAIR_RUN_MIN {
        // 16-bit data only, where nothing rides in the loop (`Pace::STEPS` is for
        // 32-bit elements: `fused::zips`): a pacer's tiles still run.
        debug_assert!(!P::STEPS);
        return sums_out_run_pairs(s, ins, m, out, stream, k1, acc);
    }
    let l = S::LANES;
    let head = head_len(out, l, stream);
    if head > 0 {
        let (mut a, mut b) = acc;
        let v = load_partial_n(s, &ins, 0, head);
        let d = fold_where(s, &v, m, lanes_on(s, 0, head), &mut a, &mut b);
        s.store_partial(&mut out[..head], s.mul(d, k1));
        acc = (s.rotate_lanes(a, head), s.rotate_lanes(b, head));
    }
    // One body loop for both cases: with two, the aligned one ran 8 % slower (bf16 with
    // AVX2, where no head is ever peeled). That cell moves with code layout alone (1.13
    // to 1.22 of a copy across builds with the same loop), so this is a layout effect.
    let (ins_b, out_b) = (sub_n(&ins, head, None), &mut out[head..]);
    let (at, n) = {
        let mut w = Walk::new(l, ins_b, &mut *out_b);
        acc = if S::HINTS && stream && w.aligned() {
            sums_out_body::<U, S, T, P, N, true>(s, &mut w, m, k1, acc, pace)
        } else {
            sums_out_body::<U, S, T, P, N, false>(s, &mut w, m, k1, acc, pace)
        };
        w.tail()
    };
    if head == 0 {
        if n > 0 {
            let d;
            (d, acc) = sums_partial(s, &ins_b, at, n, m, acc);
            let len = out_b.len();
            if len >= l && !(S::HINTS && stream) {
                // The run's last whole vector, overlapping the one before, instead of a
                // masked store (3 to 5 times a plain store with AVX2 on AMD Zen 3:
                // `scripts/models/maskstore.c`): its common elements are written twice
                // with the same values (the same formula on the same inputs). The sums
                // keep the partial vector above, so their lanes do not change. Not
                // where the body streamed (as `apply::run_splat`): an ordinary store
                // into a line still in a write-combining buffer would flush it.
                let d = grad_of(s, &load_n(s, &ins_b, len - l));
                s.store(&mut out_b[len - l..], s.mul(d, k1));
            } else {
                s.store_partial(&mut out_b[at..at + n], s.mul(d, k1));
            }
        }
        return acc;
    }
    let (mut a, mut b) = acc;
    if n > 0 {
        let v = load_partial_n(s, &ins_b, at, n);
        let d = fold_where(s, &v, m, lanes_on(s, 0, n), &mut a, &mut b);
        s.store_partial(&mut out_b[at..at + n], s.mul(d, k1));
    }
    (a, b) = (s.rotate_lanes(a, l - head), s.rotate_lanes(b, l - head));
    // The aligned walk's last partial vector folds zeros into the lanes it does not
    // cover (no change but for a non-finite mean): the same here.
    let last = out.len() % l;
    if last > 0 {
        let zeros = [s.splat(U::ZERO); N];
        fold_where(s, &zeros, m, lanes_on(s, last, l), &mut a, &mut b);
    }
    (a, b)
}

/// The fewest elements of a run that [`sums_out_run`] walks in pairs
/// ([`sums_out_run_pairs`]): a run's pair sums go back to lane order once at its end
/// (and a streamed head rotates them twice), a fixed cost that a short run would not
/// earn back. The length alone decides, so where `dx` sits never changes the sums.
const PAIR_RUN_MIN: usize = 128;

/// Whether [`sums_out_run`] takes [`sums_out_run_pairs`] (for runs of at least
/// [`PAIR_RUN_MIN`]): 16-bit data with AVX2, bf16 in its even/odd pair order
/// ([`Simd::pair_even_odd`]), f16 as two vectors in memory order (two chains of sums
/// instead of one, and `dx` streamed as one 32-byte store a pair instead of two of 16
/// bytes). `HINTS` with 8 lanes of `f32` is AVX2 among this crate's ISAs (the portable
/// kernels have no hints, AVX-512 has 16 lanes). Not the AVX-512 kernels: not measured
/// (no AVX-512 machine at hand).
/// `scripts/ab.sh 3 "--shape 64,56,56,256 --shape 64,112,112,64 --format NCHW --op
/// backward_inference --dtype f16"` (AMD EPYC Zen 1, time ÷ copy): f16 1.022 / 1.001
/// -> 0.933 / 0.929.
#[inline(always)]
fn rows_in_pairs<U: Real, S: Simd<U>, T: Element<Stat = U>>(s: S) -> bool {
    s.pair_even_odd::<T>() || (S::HINTS && S::LANES == 8 && std::mem::size_of::<T>() == 2)
}

/// The sums of one run in the ISA's pair order: `a[0]`, `b[0]` hold the even elements
/// of each pair of vectors and `a[1]`, `b[1]` the odd ones where
/// [`Simd::pair_even_odd`] (AVX2 bf16), the first and the second vector otherwise (f16).
/// Together, lane `k mod 2·LANES` of a run (in memory order) is one sum.
#[derive(Clone, Copy)]
struct PairSums<V> {
    a: [V; 2],
    b: [V; 2],
}

/// Elements `[at, at + n)` (`0 < n ≤ 2·LANES`) of each input as one pair in pair order,
/// zeros past `n`.
#[inline(always)]
fn pair_partial<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize>(
    s: S,
    ins: &[&[T]; N],
    at: usize,
    n: usize,
) -> ([S::V; N], [S::V; N]) {
    let l = S::LANES;
    // (`load_partial` takes fewer than LANES elements.)
    let mut even = if n >= l {
        let mut v = [s.splat(U::ZERO); N];
        for i in 0..N {
            v[i] = s.load(&ins[i][at..at + l]);
        }
        v
    } else {
        load_partial_n(s, ins, at, n)
    };
    let mut odd = if n > l {
        load_partial_n(s, ins, at + l, n - l)
    } else {
        [s.splat(U::ZERO); N]
    };
    for i in 0..N {
        (even[i], odd[i]) = s.to_pair_order::<T>(even[i], odd[i]);
    }
    (even, odd)
}

/// The lanes `[from, to)` (`from ≤ to ≤ 2·LANES`, memory order) of a pair on: the
/// `[on, off]` of [`fold_where`] for its even and its odd vector.
#[inline(always)]
fn pair_lanes_on<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    from: usize,
    to: usize,
) -> [[S::V; 2]; 2] {
    let l = S::LANES;
    let lo = s.lanes_between(from.min(l), to.min(l));
    let hi = s.lanes_between(from.max(l) - l, to.max(l) - l);
    let (even, odd) = s.to_pair_order::<T>(lo, hi);
    let one = s.splat(U::from_f64(1.0));
    [[even, s.sub(one, even)], [odd, s.sub(one, odd)]]
}

/// [`fold_where`] of one pair into `sums`, the lanes of `on` only (all of them where
/// `on` is `None`); returns the pair's (masked) dy.
#[inline(always)]
fn fold_pair<U: Real, S: Simd<U>, const N: usize>(
    s: S,
    (even, odd): &([S::V; N], [S::V; N]),
    m: S::V,
    on: Option<[[S::V; 2]; 2]>,
    sums: &mut PairSums<S::V>,
) -> (S::V, S::V) {
    let PairSums {
        a: [a0, a1],
        b: [b0, b1],
    } = sums;
    match on {
        None => (fold(s, even, m, a0, b0), fold(s, odd, m, a1, b1)),
        Some([e, o]) => (
            fold_where(s, even, m, e, a0, b0),
            fold_where(s, odd, m, o, a1, b1),
        ),
    }
}

/// Writes `d·k1` of a pair in pair order to `out` (at most `2·LANES` elements).
#[inline(always)]
fn store_pair_partial<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    out: &mut [T],
    (de, dd): (S::V, S::V),
    k1: S::V,
) {
    let l = S::LANES;
    let (lo, hi) = s.to_lane_order::<T>(s.mul(de, k1), s.mul(dd, k1));
    let n = out.len();
    if n >= l {
        s.store(&mut out[..l], lo);
    } else {
        s.store_partial(out, lo);
    }
    if n > l {
        s.store_partial(&mut out[l..], hi);
    }
}

/// `sums` with their `2·LANES` lanes (memory order) rotated down by `r < 2·LANES`: lane
/// `i` of the result is lane `(i + r) mod 2·LANES`. Bit moves only (the blend adds +0 to
/// each kept lane, and the sums never hold −0: they start at +0).
#[inline(always)]
fn rotate_pair_sums<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    sums: PairSums<S::V>,
    r: usize,
) -> PairSums<S::V> {
    let l = S::LANES;
    let k = r % l;
    let [on, off] = lanes_on(s, 0, l - k);
    let turn = |[even, odd]: [S::V; 2]| {
        let (lo, hi) = s.to_lane_order::<T>(even, odd);
        let (lo, hi) = if r >= l { (hi, lo) } else { (lo, hi) };
        let (rl, rh) = (s.rotate_lanes(lo, k), s.rotate_lanes(hi, k));
        let lo = s.add(s.mask_positive(on, rl), s.mask_positive(off, rh));
        let hi = s.add(s.mask_positive(on, rh), s.mask_positive(off, rl));
        let (even, odd) = s.to_pair_order::<T>(lo, hi);
        [even, odd]
    };
    PairSums {
        a: turn(sums.a),
        b: turn(sums.b),
    }
}

/// [`sums_out_run`] two vectors at a time, for runs of at least [`PAIR_RUN_MIN`]
/// elements where [`rows_in_pairs`]. With AVX2 bf16 in its pair order
/// ([`Simd::pair_even_odd`]): `dy` and `x` one load, shift and mask per pair of vectors
/// each (instead of two widening loads and shifts), `dx` narrowed in pair order with no
/// cross-lane shuffle. With f16 the pair is two vectors in memory order. Where `dx` is
/// streamed, it goes out as whole 32-byte stores, after a head peeled to align them.
///
/// Element `k` of the run is summed in lane `k mod 2·LANES` of [`PairSums`], in order,
/// wherever `dx` sits: a peeled head of `h` elements folds into lanes `0..h`, the body
/// into the sums rotated by `h` lanes, rotated back at the end; the aligned walk's last
/// partial pair folds zeros into the lanes it does not cover (no change but for a
/// non-finite mean), and so does a streamed run. The two halves of the run's sums are
/// then added, in lane order, into `(a, b)`.
#[inline(always)]
fn sums_out_run_pairs<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize>(
    s: S,
    ins: [&[T]; N],
    m: S::V,
    out: &mut [T],
    stream: bool,
    k1: S::V,
    (a, b): (S::V, S::V),
) -> (S::V, S::V) {
    let (l, len) = (S::LANES, out.len());
    let p = 2 * l;
    let stream = stream && S::HINTS && s.cl_stream_align::<T>() == p;
    let zero = s.splat(U::ZERO);
    let mut sums = PairSums {
        a: [zero; 2],
        b: [zero; 2],
    };
    let align = p * std::mem::size_of::<T>();
    let head = if stream {
        out.as_ptr().align_offset(align).min(len).min(p - 1)
    } else {
        0
    };
    if head > 0 {
        let v = pair_partial(s, &ins, 0, head);
        let on = pair_lanes_on::<U, S, T>(s, 0, head);
        let d = fold_pair(s, &v, m, Some(on), &mut sums);
        store_pair_partial(s, &mut out[..head], d, k1);
        sums = rotate_pair_sums::<U, S, T>(s, sums, head);
    }
    let (ins_b, out_b) = (sub_n(&ins, head, None), &mut out[head..]);
    let done = {
        let mut w = Walk::new(l, ins_b, &mut *out_b);
        if stream && w.aligned_to(align) {
            sums_out_pairs_body::<U, S, T, N, true>(s, &mut w, m, k1, &mut sums)
        } else {
            sums_out_pairs_body::<U, S, T, N, false>(s, &mut w, m, k1, &mut sums)
        }
    };
    let rest = out_b.len() - done;
    if rest > 0 {
        let v = pair_partial(s, &ins_b, done, rest);
        // With no head, the last partial pair folds zeros past `rest`, as the aligned
        // walk does; with one, only the elements, the zeros below.
        let on = (head > 0).then(|| pair_lanes_on::<U, S, T>(s, 0, rest));
        let d = fold_pair(s, &v, m, on, &mut sums);
        store_pair_partial(s, &mut out_b[done..], d, k1);
    }
    if head > 0 {
        sums = rotate_pair_sums::<U, S, T>(s, sums, p - head);
        let last = len % p;
        if last > 0 {
            let zeros = ([zero; N], [zero; N]);
            let on = pair_lanes_on::<U, S, T>(s, last, p);
            fold_pair(s, &zeros, m, Some(on), &mut sums);
        }
    }
    let (a0, a1) = s.to_lane_order::<T>(sums.a[0], sums.a[1]);
    let (b0, b1) = s.to_lane_order::<T>(sums.b[0], sums.b[1]);
    (s.add(a, s.add(a0, a1)), s.add(b, s.add(b0, b1)))
}

/// The whole pairs of [`sums_out_run_pairs`]; returns how many elements they cover.
/// With `STREAM`, the output starts at a multiple of [`Simd::cl_stream_align`] elements,
/// which is a pair.
#[inline(always)]
fn sums_out_pairs_body<
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    const N: usize,
    const STREAM: bool,
>(
    s: S,
    w: &mut Walk<'_, T, N>,
    m: S::V,
    k1: S::V,
    sums: &mut PairSums<S::V>,
) -> usize {
    let pairs = w.vectors() / 2;
    let pair_bytes = 2 * S::LANES * std::mem::size_of::<T>();
    assert!(w.reads.lanes_of(s));
    assert!(!STREAM || (s.cl_stream_align::<T>() == 2 * S::LANES && w.aligned_to(pair_bytes)));
    let ahead = STREAM_AHEAD_BYTES / std::mem::size_of::<T>();
    for i in 0..pairs {
        let j = 2 * i;
        if STREAM {
            w.reads.prefetch_ahead(s, j, ahead, 2 * S::LANES);
        }
        // SAFETY: `j + 1 < 2·pairs <= vectors`, and the lanes are checked above. With
        // `STREAM` the output starts at a multiple of `cl_stream_align` = 2·LANES
        // elements (both asserted above), so vector `j` (even) does.
        unsafe {
            let v = w.reads.load_pair_unchecked(s, j);
            let (de, dd) = fold_pair(s, &v, m, None, sums);
            let (de, dd) = (s.mul(de, k1), s.mul(dd, k1));
            if STREAM {
                w.stream_pair_cl_unchecked::<S, true>(s, j, de, dd);
            } else {
                w.store_pair_unchecked::<S, false>(s, j, de, dd);
            }
        }
    }
    2 * pairs * S::LANES
}

#[inline(always)]
fn sums_out_body<
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    P: Pace<S>,
    const N: usize,
    const STREAM: bool,
>(
    s: S,
    w: &mut Walk<'_, T, N>,
    m: S::V,
    k1: S::V,
    (mut a, mut b): (S::V, S::V),
    pace: &mut P,
) -> (S::V, S::V) {
    // Two vectors folded in order into the same sums (the bits of one at a time), their
    // `dx` stored together: one narrowing for both where the ISA packs pairs (AVX-512
    // bf16: one `vcvtne2ps2bf16` instead of two roundings by shifts and `vpmovdw`s).
    // Streamed 16-bit pairs with AVX2 go out as two 16-byte stores. One 32-byte store
    // where a pair is so aligned, a run's first vector alone where not (as
    // `apply::splat_body`), was measured no faster: Intel Xeon, `--isa avx2`,
    // `scripts/ab.sh 7`, NCHW 64x256x56x56 / 64x64x112x112 backward inference, time ÷
    // copy, bf16 1.100 / 0.902 -> 1.092 / 0.896, f16 1.044 / 0.887 -> 1.038 / 0.827.
    let total = w.vectors();
    // The walk's lanes checked once: every pair below lies in its `total` vectors. (With
    // the checked loads and stores, an assertion a pair was in the loop: perf annotate,
    // NCHW backward inference, f32 and bf16, both ISAs.)
    assert!(w.reads.lanes_of(s));
    if P::STEPS {
        // Four vectors a step, for the pace's work beside them ([`Pace::step`]).
        let mut z = pace.zip_take();
        for i in 0..total / 4 {
            // SAFETY: `4·i + 3 < total`, the lanes checked above.
            unsafe {
                sums_out_two::<U, S, T, N, STREAM>(s, w, 4 * i, m, k1, (&mut a, &mut b));
                sums_out_two::<U, S, T, N, STREAM>(s, w, 4 * i + 2, m, k1, (&mut a, &mut b));
            }
            pace.step(s, &mut z);
        }
        pace.zip_put(z);
        if total % 4 >= 2 {
            let j = total / 4 * 4;
            // SAFETY: `j + 1 < total`, the lanes checked above.
            unsafe { sums_out_two::<U, S, T, N, STREAM>(s, w, j, m, k1, (&mut a, &mut b)) };
        }
    } else {
        // Two a step where nothing rides in the loop: the loop of four had made NCHW
        // 16x2048x7x7 f32 backward inference (rows of six vectors) 0.41 -> 0.60 ms with
        // AVX2 (Zen 4, `scripts/ab.sh 9`).
        for i in 0..total / 2 {
            // SAFETY: `2·i + 1 < total`, the lanes checked above.
            unsafe { sums_out_two::<U, S, T, N, STREAM>(s, w, 2 * i, m, k1, (&mut a, &mut b)) };
        }
    }
    if total % 2 == 1 {
        let j = total - 1;
        let d = fold(s, &w.load(s, j), m, &mut a, &mut b);
        w.store::<S, STREAM>(s, j, s.mul(d, k1));
    }
    (a, b)
}

/// Vectors `j` and `j + 1` of [`sums_out_body`], folded in order into `(a, b)`, their
/// `dx` stored together. (A function, not a closure: a closure is compiled without the
/// kernel's target features, and its intrinsics were calls.)
///
/// # Safety
/// `j + 1 < w.vectors()` and `w.reads.lanes_of(s)`; with `STREAM`, `w.aligned()`.
#[inline(always)]
unsafe fn sums_out_two<U, S, T, const N: usize, const STREAM: bool>(
    s: S,
    w: &mut Walk<'_, T, N>,
    j: usize,
    m: S::V,
    k1: S::V,
    (a, b): (&mut S::V, &mut S::V),
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
{
    // Streamed (inputs from DRAM): every input prefetched STREAM_AHEAD_BYTES ahead, one
    // hint per line, as the elementwise passes and the channels-last inference gradient
    // do.
    if STREAM {
        let ahead = STREAM_AHEAD_BYTES / std::mem::size_of::<T>();
        w.reads.prefetch_ahead(s, j, ahead, 2 * S::LANES);
    }
    // SAFETY: vectors `j` and `j + 1` exist and the lanes are `S`'s (the caller's
    // guarantee).
    let (u, v) = unsafe {
        (
            w.reads.load_unchecked(s, j),
            w.reads.load_unchecked(s, j + 1),
        )
    };
    let d = fold(s, &u, m, a, b);
    let e = fold(s, &v, m, a, b);
    // SAFETY: as above.
    unsafe { w.store2_unchecked::<S, STREAM>(s, j, s.mul(d, k1), s.mul(e, k1)) };
}

/// Backward sums over whole pixels, by tiles flushed to `f64`; with `dx`, also writes
/// `dx = dy·k1` (the inference gradient).
pub(crate) struct PixelSums<'a, T: Element> {
    pub dy: &'a [T],
    pub mask: Option<&'a [T]>,
    pub x: &'a [T],
    pub mean: &'a [T::Stat],
    pub dx: Option<(&'a mut [T], &'a [T::Stat])>,
    /// Write `dx` with non-temporal stores (where a pixel is vector-aligned).
    pub stream: bool,
    /// Without `dx`: whether to take four pixels at a time ([`Quads`]).
    pub quads: Quads,
    /// `Σdy` and `Σdy·(x − m)` per channel, added to.
    pub sums: (&'a mut [f64], &'a mut [f64]),
    /// Where the C-sized scratch comes from at large C ([`with_arena`]); the heap
    /// without.
    pub arena: Option<&'a bumpalo::Bump>,
}

/// How [`PixelSums`] without `dx` walks its pixels.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Quads {
    /// One pixel at a time, in memory order: f32 tensors from DRAM (four interleaved
    /// pixel streams of dy and x were slower there without a prefetch, and with one
    /// 0.87–1.05× the time of this, by shape and ISA: no clear gain).
    No,
    /// Four pixels at a time, one accumulator update (two loads, two stores) per four
    /// vectors of each input: tensors in cache, where those stores bound the pass.
    Cached,
    /// As `Cached`, each input prefetched [`PREFETCH_BYTES`] ahead: 16-bit tensors from
    /// DRAM. Without the prefetch the eight interleaved streams were 1.3–1.9× slower than
    /// memory order; with it, 4–7 % faster (Zen 4, in-process backward sums, 2 threads,
    /// 9 interleaved rounds, medians: bf16 64x56x56x256 8.18 -> 7.72 ms with AVX-512,
    /// 7.55 -> 7.14 with AVX2; f16 7.52 -> 7.07 / 7.81 -> 7.23; at 64x112x112x64 from
    /// 0.94 to 1.02). In cache the same prefetch cost 10 % (16x7x7x2048 bf16). One
    /// prefetch per line, in memory order ([`Simd::prefetch_lines`]): with one per
    /// vector and pixel (four per line of each input with AVX2) this path was 1.3–1.4×
    /// slower than `No` at 64x56x56x256 on a Zen 3 (bf16 9.5 against 12.2–13.3 ms,
    /// f16 10.0 against 13.1), and with one per line as fast (9.4 and 9.5 ms); at
    /// 64x112x112x64 it stays 5 % ahead of `No` (8.27 against 8.69 ms). Tried on a Zen
    /// 4 (2026-12-02, one trial build with environment switches, `scripts/ab.sh 3`,
    /// NHWC backward training, bf16 and f16, 64x56x56x256 and 64x112x112x64, both
    /// ISAs, time ÷ copy): these hints 4 KiB or 16 KiB ahead instead of 8, or as
    /// `prefetchnta` or `prefetcht0`; none was below 8 KiB with `prefetcht1` in more
    /// than 2 of the 8 cells, and `prefetchnta` was above it in all 8 (bf16 AVX-512
    /// 64x56x56x256 1.49 -> 1.82).
    Prefetched,
}

impl<T: Element> Kernel<T::Stat> for PixelSums<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) {
        // `dx = dy·k1` (an arithmetic result) where it is written.
        let s = match &self.dx {
            Some((_, k1)) => s.plain_nans(&[k1]),
            None => s,
        };
        let (dy, x, st) = (self.dy, self.x, self.stream);
        let (m, q, sums, ar) = (self.mean, self.quads, self.sums, self.arena);
        match (self.mask, self.dx) {
            (None, None) => pixel_sums(s, [dy, x], m, None, false, q, sums, ar),
            (Some(y), None) => pixel_sums(s, [dy, x, y], m, None, false, q, sums, ar),
            (None, Some(o)) => pixel_sums(s, [dy, x], m, Some(o), st, q, sums, ar),
            (Some(y), Some(o)) => pixel_sums(s, [dy, x, y], m, Some(o), st, q, sums, ar),
        }
        if st {
            s.fence();
        }
    }
}

/// The whole vectors of one pixel: sums into `a`, `b` and `dx = dy·k1`.
#[inline(always)]
fn pixel_out<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize, const STREAM: bool>(
    s: S,
    w: &mut Walk<'_, T, N>,
    consts: &Reads<'_, U, 2>,
    a: &mut [S::V],
    b: &mut [S::V],
    ahead: Option<usize>,
) {
    let total = w.vectors();
    period_out::<U, S, T, N, STREAM>(s, w, 0, total, consts, a, b, ahead);
}

/// [`pixel_out`] in the ISA's pair order ([`Simd::pair_even_odd`]: AVX2 bf16, where a
/// pair loads with one shift and one mask and narrows without a cross-lane shuffle):
/// vectors `lead + 2i` and `lead + 2i + 1` as one pair each, against constants and sums
/// laid out so ([`PairLayout`]); vector 0 (where `lead` is 1) and an odd last vector
/// alone, in memory order. `lead` 1 puts the pairs of a streamed `dx` whose pixels start
/// half a pair off 32 bytes on whole 32-byte stores ([`Simd::stream_pair_ptr`]).
#[inline(always)]
fn pixel_out_pairs<
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    const N: usize,
    const STREAM: bool,
>(
    s: S,
    w: &mut Walk<'_, T, N>,
    lead: usize,
    consts: &Reads<'_, U, 2>,
    a: &mut [S::V],
    b: &mut [S::V],
    ahead: Option<usize>,
) {
    let total = w.vectors();
    assert!(lead <= total && w.reads.lanes_of(s));
    if lead == 1 {
        single_out::<U, S, T, N, STREAM>(s, w, 0, consts, a, b);
    }
    let (l, pairs) = (S::LANES, (total - lead) / 2);
    let end = lead + 2 * pairs;
    // The pairs through one pointer per input, output and constant, their ranges proved
    // here once (see `pairs_out`).
    assert!(end <= a.len() && end <= b.len());
    assert!(consts.vectors() >= end && consts.lanes_of(s));
    let (ins, out, k) = (w.reads.base(), w.out_base(), consts.base());
    let sums = (a.as_mut_ptr(), b.as_mut_ptr());
    // Every pair one whole streamed store where the first is so aligned (the pairs are
    // contiguous); otherwise `Simd::stream_pair_ptr` tests each.
    let align = s.cl_stream_align::<T>() * std::mem::size_of::<T>();
    let whole = STREAM && (out.wrapping_add(lead * l) as usize).is_multiple_of(align);
    // SAFETY: `end <= total`, so every pair's `2·LANES` elements lie within the walk's
    // inputs and output; `end` is within the sums and the constants (asserted above);
    // `whole` is tested just above.
    unsafe {
        match (whole, s.plain_nans_const::<T>()) {
            (true, Some(c)) => {
                pairs_out::<U, S, T, N, STREAM, true>(c, ins, out, k, sums, lead, pairs, ahead)
            }
            (true, None) => {
                pairs_out::<U, S, T, N, STREAM, true>(s, ins, out, k, sums, lead, pairs, ahead)
            }
            (false, Some(c)) => {
                pairs_out::<U, S, T, N, STREAM, false>(c, ins, out, k, sums, lead, pairs, ahead)
            }
            (false, None) => {
                pairs_out::<U, S, T, N, STREAM, false>(s, ins, out, k, sums, lead, pairs, ahead)
            }
        }
    }
    if end < total {
        single_out::<U, S, T, N, STREAM>(s, w, total - 1, consts, a, b);
    }
}

/// The `pairs` pairs of [`pixel_out_pairs`] from vector `lead`: sums into `a`, `b` and
/// `dx = dy·k1`, each pair streamed with one whole store with `WHOLE`. Through one
/// pointer per input, output and constant: with the `Walk`, `Reads` and slices per
/// pair, the loop (AVX2 bf16) carried four bounds checks, three reloads from the stack,
/// a test of the NaN flag and one of the output's alignment a pair (`perf annotate`,
/// Zen 4).
///
/// # Safety
/// Each of `ins` and `out` holds `(lead + 2·pairs)·LANES` elements (readable, and
/// writable for `out`), as do both constants of `k`; `a` and `b` hold `lead + 2·pairs`
/// vectors; with `STREAM` the output is vector-aligned, and with `WHOLE` vector `lead`
/// starts at a multiple of [`Simd::cl_stream_align`] elements.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pairs_out<
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    const N: usize,
    const STREAM: bool,
    const WHOLE: bool,
>(
    s: S,
    ins: [*const T; N],
    out: *mut T,
    [mp, kp]: [*const U; 2],
    (a, b): (*mut S::V, *mut S::V),
    lead: usize,
    pairs: usize,
    ahead: Option<usize>,
) {
    let l = S::LANES;
    for i in 0..pairs {
        let g = lead + 2 * i;
        let at = g * l;
        if let Some(ahead) = ahead {
            prefetch_each(s, &ins, at + ahead, 2 * l);
        }
        // SAFETY: `g + 1 < lead + 2·pairs`, within every range of the caller's guarantee.
        unsafe {
            let (mv, mw) = (s.load_ptr(mp.add(at)), s.load_ptr(mp.add(at + l)));
            let (kv, kw) = (s.load_ptr(kp.add(at)), s.load_ptr(kp.add(at + l)));
            let (p, q) = pairs_at(s, &ins, at);
            let d = fold(s, &p, mv, &mut *a.add(g), &mut *b.add(g));
            let e = fold(s, &q, mw, &mut *a.add(g + 1), &mut *b.add(g + 1));
            let (d, e, o) = (s.mul(d, kv), s.mul(e, kw), out.add(at));
            match (STREAM, WHOLE) {
                (true, true) => s.stream_pair_cl_whole_ptr(o, d, e),
                (true, false) => s.stream_pair_ptr(o, d, e),
                _ => s.store_pair_ptr(o, d, e),
            }
        }
    }
}

/// The pair at element `at` of every input of `base`, in the order of
/// [`Simd::pair_even_odd`].
///
/// # Safety
/// Every `base[i]` is valid for reads of `at + 2·LANES` elements.
#[inline(always)]
unsafe fn pairs_at<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize>(
    s: S,
    base: &[*const T; N],
    at: usize,
) -> ([S::V; N], [S::V; N]) {
    let zero = s.splat(U::ZERO);
    let (mut a, mut b) = ([zero; N], [zero; N]);
    for ((a, b), p) in a.iter_mut().zip(b.iter_mut()).zip(base) {
        // SAFETY: the caller's guarantee.
        (*a, *b) = unsafe { s.load_pair_ptr(p.add(at)) };
    }
    (a, b)
}

/// Vector `g` of `w` alone, in memory order: sums into `a[g]`, `b[g]` and `dx = dy·k1`.
/// (A function, not a closure: a closure does not inherit the caller's target features,
/// and its intrinsics were calls: `pixel_out_pairs` ran NHWC backward inference bf16
/// with AVX2 at 2.5–7.4 times the time of the loop it replaced.)
#[inline(always)]
fn single_out<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize, const STREAM: bool>(
    s: S,
    w: &mut Walk<'_, T, N>,
    g: usize,
    consts: &Reads<'_, U, 2>,
    a: &mut [S::V],
    b: &mut [S::V],
) {
    let [mv, kv] = consts.load(s, g);
    let d = fold(s, &w.load(s, g), mv, &mut a[g], &mut b[g]);
    w.store::<S, STREAM>(s, g, s.mul(d, kv));
}

/// Which vectors of a pixel [`pixel_out_pairs`] takes as pairs, and so which groups of
/// constants and sums hold their lanes in pair order: `count` pairs from vector `lead`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PairLayout {
    lead: usize,
    count: usize,
}

impl PairLayout {
    /// Each pair's `2·lanes` values of `v` from memory order to pair order (`even` first
    /// and then `odd`: [`Simd::pair_even_odd`]), or back with `!to_pairs` (the sums'
    /// lanes at a flush). `lanes` is at most 16.
    fn reorder<U: Real>(self, v: &mut [U], lanes: usize, to_pairs: bool) {
        // A copy of each block on the stack, not an allocation (as `apply::Pattern`:
        // this runs once per call, and small tensors take microseconds).
        let mut copy = [U::ZERO; 32];
        let copy = &mut copy[..2 * lanes];
        for i in 0..self.count {
            let block = &mut v[(self.lead + 2 * i) * lanes..][..2 * lanes];
            copy.copy_from_slice(block);
            for j in 0..lanes {
                // Element 2j of the pair is lane j of the even half, 2j + 1 of the odd.
                let (memory, pair) = ([2 * j, 2 * j + 1], [j, lanes + j]);
                let (to, from) = if to_pairs {
                    (pair, memory)
                } else {
                    (memory, pair)
                };
                block[to[0]] = copy[from[0]];
                block[to[1]] = copy[from[1]];
            }
        }
    }
}

/// Vectors `j0..j0 + m` of `w` against groups `0..m` of `consts` and of the sums `a`,
/// `b` (one pixel, or one period of a rotated run): sums and `dx = dy·k1`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn period_out<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize, const STREAM: bool>(
    s: S,
    w: &mut Walk<'_, T, N>,
    j0: usize,
    m: usize,
    consts: &Reads<'_, U, 2>,
    a: &mut [S::V],
    b: &mut [S::V],
    ahead: Option<usize>,
) {
    let l = S::LANES;
    // Through one pointer per input, output and constant, their ranges proved here
    // once (as `pairs_out`: with the `Walk` and slices the loop carried two bounds
    // checks and a reload from the stack a pair, AVX-512 bf16).
    assert!(m <= a.len() && m <= b.len() && j0 + m <= w.vectors());
    assert!(consts.vectors() >= m && consts.lanes_of(s) && w.reads.lanes_of(s));
    let (ins, out, [mp, kp]) = (w.reads.base(), w.out_base(), consts.base());
    let (a, b) = (a.as_mut_ptr(), b.as_mut_ptr());
    let (ins, out) = (
        ins.map(|p| p.wrapping_add(j0 * l)),
        out.wrapping_add(j0 * l),
    );
    // SAFETY: vectors `j0..j0 + m` lie within the walk's inputs and output, groups
    // `0..m` within the constants and the sums (asserted above); with `STREAM` the
    // output is vector-aligned (the caller's test), which the streamed stores need.
    unsafe {
        // The hint's presence as a constant of the loop: tested inside it, it stayed a
        // load from the stack and a branch a pair (perf annotate, NHWC backward
        // inference, f32 and bf16, both ISAs).
        match ahead {
            Some(ahead) => {
                period_pairs::<U, S, T, N, STREAM, true>(s, ins, out, [mp, kp], a, b, m, ahead)
            }
            None => period_pairs::<U, S, T, N, STREAM, false>(s, ins, out, [mp, kp], a, b, m, 0),
        }
        if m % 2 == 1 {
            let (g, at) = (m - 1, (m - 1) * l);
            let (mv, kv) = (s.load_ptr(mp.add(at)), s.load_ptr(kp.add(at)));
            let d = fold(
                s,
                &vectors_at(s, &ins, at),
                mv,
                &mut *a.add(g),
                &mut *b.add(g),
            );
            let (d, o) = (s.mul(d, kv), out.add(at));
            if STREAM {
                s.stream_ptr(o, d);
            } else {
                s.store_ptr(o, d);
            }
        }
    }
}

/// The pairs of [`period_out`]: vectors `0..m / 2 * 2` from the inputs `ins`, the
/// output `out` and the constants `[mean, k1]`, into the sums `a`, `b`; with `PF`, each
/// input prefetched `ahead` elements on.
///
/// # Safety
/// As in [`period_out`]: `m` vectors from each pointer are valid (and `out` is
/// vector-aligned with `STREAM`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn period_pairs<
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    const N: usize,
    const STREAM: bool,
    const PF: bool,
>(
    s: S,
    ins: [*const T; N],
    out: *mut T,
    [mp, kp]: [*const U; 2],
    a: *mut S::V,
    b: *mut S::V,
    m: usize,
    ahead: usize,
) {
    let l = S::LANES;
    for i in 0..m / 2 {
        let g = 2 * i;
        let at = g * l;
        if PF {
            prefetch_each(s, &ins, at + ahead, 2 * l);
        }
        // SAFETY: `g + 1 < m` (the caller's guarantee covers vectors `0..m`).
        unsafe {
            let (mv, mw) = (s.load_ptr(mp.add(at)), s.load_ptr(mp.add(at + l)));
            let (kv, kw) = (s.load_ptr(kp.add(at)), s.load_ptr(kp.add(at + l)));
            let d = fold(
                s,
                &vectors_at(s, &ins, at),
                mv,
                &mut *a.add(g),
                &mut *b.add(g),
            );
            let e = fold(
                s,
                &vectors_at(s, &ins, at + l),
                mw,
                &mut *a.add(g + 1),
                &mut *b.add(g + 1),
            );
            let (d, e, o) = (s.mul(d, kv), s.mul(e, kw), out.add(at));
            if STREAM {
                s.stream2_ptr(o, d, e);
            } else {
                s.store2_ptr(o, d, e);
            }
        }
    }
}

/// [`fold`] in the lanes where `on` is positive only: elsewhere `a` and `b` keep their
/// bits (whatever the other lanes hold, infinities and NaN included). Returns the
/// (masked) dy of every lane.
#[inline(always)]
fn fold_where<U: Real, S: Simd<U>, const N: usize>(
    s: S,
    v: &[S::V; N],
    m: S::V,
    [on, off]: [S::V; 2],
    a: &mut S::V,
    b: &mut S::V,
) -> S::V {
    let d = grad_of(s, v);
    let (na, nb) = (s.add(*a, d), s.mul_add(d, s.sub(v[1], m), *b));
    // One of each pair is +0, and a sum of +0 keeps the other's bits (the sums start at
    // +0 and so never hold −0).
    *a = s.add(s.mask_positive(on, na), s.mask_positive(off, *a));
    *b = s.add(s.mask_positive(on, nb), s.mask_positive(off, *b));
    d
}

/// The lanes `[from, to)` on, the others off: `[on, off]` for [`fold_where`].
#[inline(always)]
fn lanes_on<U: Real, S: Simd<U>>(s: S, from: usize, to: usize) -> [S::V; 2] {
    let on = s.lanes_between(from, to);
    [on, s.sub(s.splat(U::from_f64(1.0)), on)]
}

/// One tile of whole pixels of `c` channels walked as one run of vectors in periods of
/// `per = consts.vectors()`: group `g` of a period holds channels `(h + g·LANES + i) mod
/// c` (`consts` expanded so by [`PeriodConsts`], or `mean` and `k1` themselves where
/// `h = 0` and `C = per·LANES`), the run starting `h` elements
/// (`0 ≤ h < LANES`) into the tile. Its first `h` elements go in the upper lanes of the
/// last group (the tile's first `h` channels), and what is left after the whole vectors
/// in the lower lanes of the group it falls in. Lane `j` of the sums `a`, `b` (`per`
/// groups) adds, in order, the elements at `(h + j) mod (per·LANES)` of the tile (all of
/// one channel): the same sums, lane for lane, whatever `h`.
///
/// Three uses:
/// - `C` a multiple of the lanes with a streamed `dx` that starts `h > 0` elements
///   before a vector boundary (`per = C / LANES`): each channel is summed in one lane,
///   pixel after pixel, as in the pixel-by-pixel walk, so the sums have its bits; only
///   the lanes are rotated. Without it a vector-misaligned `dx` (a `Vec` of `f32` from
///   the system allocator is aligned to 16 bytes) was written with ordinary stores.
/// - `C` not a multiple of the lanes with a short period (`C < LANES` in particular):
///   a pixel by pixel walk took one masked vector a pixel (two of three lanes idle at
///   C = 3 with AVX2) and one chain of additions, and cost NHWC backward inference
///   of 3145728x1x1x2 f32 5.3–7.1 times its copy (Zen 4). With `dx` streamed, `h`
///   aligns its stores; otherwise `h = 0`.
/// - `C` a multiple of the lanes, pixels of few vectors, `dx` with ordinary stores
///   (`h = 0`, `per = C / LANES`: lane `j` is channel `j`; see [`FEW_PERIODIC_GROUPS`]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_periodic<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize, const STREAM: bool>(
    s: S,
    ins: [&[T]; N],
    mut out: Option<&mut [T]>,
    h: usize,
    consts: &Reads<'_, U, 2>,
    ahead: Option<usize>,
    a: &mut [S::V],
    b: &mut [S::V],
) {
    let l = S::LANES;
    let per = consts.vectors();
    let len = ins[0].len();
    debug_assert!(h < l && h + l <= len && (STREAM || h == 0));
    debug_assert!(out.as_ref().is_none_or(|o| o.len() == len));
    let last = per - 1;
    if h > 0 {
        // The tile's first h elements: the upper lanes of the last group (rotated there
        // in registers: through a stack buffer, the reload waits behind the streamed
        // stores).
        let [mv, kv] = consts.load(s, last);
        let mut v = load_partial_n(s, &ins, 0, h);
        for x in v.iter_mut() {
            *x = s.rotate_lanes(*x, h);
        }
        let d = fold_where(s, &v, mv, lanes_on(s, l - h, l), &mut a[last], &mut b[last]);
        if let Some(o) = out.as_deref_mut() {
            s.store_partial(&mut o[..h], s.rotate_lanes(s.mul(d, kv), l - h));
        }
    }
    let body = (len - h) / l * l;
    let ins_b = sub_n(&ins, h, Some(body));
    let total = body / l;
    match out.as_deref_mut() {
        Some(o) => {
            let mut w = Walk::new(l, ins_b, &mut o[h..h + body]);
            debug_assert!(!STREAM || w.aligned());
            let mut j0 = 0;
            while j0 < total {
                if let Some(ahead) = ahead {
                    // From DRAM: every input prefetched ahead, one hint per line, a
                    // period at a time. (Spread over the period's pairs instead, as the
                    // pixel walk does: within the noise, and f16 AVX-512 64x56x56x256
                    // with dx 16 bytes off a line 0.94 -> 1.20 of a copy; Zen 4,
                    // `scripts/ab.sh 3`, 2026-12-02.)
                    w.reads.prefetch_ahead(s, j0, ahead, per * l);
                }
                let m = per.min(total - j0);
                period_out::<U, S, T, N, STREAM>(s, &mut w, j0, m, consts, a, b, None);
                j0 += m;
            }
        }
        None => {
            // The sums alone (a training gradient's first pass), the ranges proved
            // once: with checked loads and indexing `perf annotate` showed two bounds
            // checks and a reload of a pointer from the stack a vector (NHWC
            // 64x56x56x24 f32 backward training, AVX-512).
            let r = Reads::new(l, ins_b, body);
            assert!(consts.lanes_of(s) && r.lanes_of(s));
            let (a, b) = (&mut a[..per], &mut b[..per]);
            let mut j0 = 0;
            while j0 < total {
                let m = per.min(total - j0);
                for (g, (ag, bg)) in a[..m].iter_mut().zip(&mut b[..m]).enumerate() {
                    // SAFETY: `g < m <= per == consts.vectors()` and `j0 + g < j0 + m <=
                    // total == r.vectors()`; both `Reads` have `S`'s lanes (checked above).
                    let ([mv, _], v) =
                        unsafe { (consts.load_unchecked(s, g), r.load_unchecked(s, j0 + g)) };
                    fold(s, &v, mv, ag, bg);
                }
                j0 += m;
            }
        }
    }
    // What is left (fewer than LANES elements): the lower lanes of its group.
    let (at, n) = (h + body, len - h - body);
    if n > 0 {
        let g = total % per;
        let [mv, kv] = consts.load(s, g);
        let v = load_partial_n(s, &ins, at, n);
        let d = fold_where(s, &v, mv, lanes_on(s, 0, n), &mut a[g], &mut b[g]);
        if let Some(o) = out {
            s.store_partial(&mut o[at..at + n], s.mul(d, kv));
        }
    }
}

/// With `dx` and ordinary stores, pixels of at most this many whole vectors walk a
/// tile as one periodic run of vectors ([`tile_periodic`], the period a pixel), not
/// pixel by pixel: the pixel walk's per-pixel setup (its slices, `Walk`, alignment
/// test and tail) cost more than the pixel's own work there. The same additions in
/// the same lanes (lane j is channel j): the same bits
/// (`rotated_streamed_dx_has_the_bits_of_the_plain_walk`). Measured on the AVX2-only
/// Zen 3 (`scripts/ab.sh 5`, NHWC backward inference and Ex gradient, 2x8x8x32,
/// 2x32x32x32, 2x16x32x64 and 16x56x56x64, f32, f16 and bf16, base / this / base /
/// this, time ÷ copy): of the 48 medians of the changed cells 34 below both runs of
/// the base, 5 above (among them bf16 backward inference 2x16x32x64, 8 vectors a
/// pixel: 4.31 / 4.44 / 4.29 / 4.40, hence [`FEW_PERIODIC_PAIRED_GROUPS`]); of the 12
/// of an unchanged shape (16x28x28x128), 3 below and 1 above. E.g. f32 backward
/// inference 2x32x32x32 2.10 / 1.53 / 1.80 / 1.54; bf16 2x8x8x32 on one thread 3.72 /
/// 3.55 / 3.90 / 3.58 us.
/// Streamed tensors keep the pixel walk: from DRAM (64x112x112x64) the periodic run
/// was slower in bf16 (0.89 / 1.07 / 0.80 / 1.00) and within the noise in f16. So do
/// the portable kernels (scalar, and f64 on every ISA): not measured. Counted in
/// vectors, so with AVX-512 this covers C <= 128. On a Zen 4 (the same `ab.sh 5` with
/// 2x16x16x128 and 16x14x14x256 added, eafa76b against 38e4265): with AVX-512, of the
/// 72 medians of cells this changes 52 below both base runs and 4 above (three at
/// 2x16x16x128, 8 vectors, one at 2x8x8x32), of the 12 unchanged (C = 256) 5 below and
/// 3 above; with AVX2, of 40 changed 35 below and 1 above, of 44 unchanged 10 below and
/// 17 above.
const FEW_PERIODIC_GROUPS: usize = 8;
/// [`FEW_PERIODIC_GROUPS`] where the pixel walk takes its vectors in pairs (AVX2 bf16,
/// one shift and one mask per pair, where the periodic run widens vector by vector).
const FEW_PERIODIC_PAIRED_GROUPS: usize = 4;

/// The mean (and `k1`) of [`tile_periodic`]'s lanes: lane `j` of a period of `per`
/// vectors holds channel `(h + j) mod C`.
struct PeriodConsts<U> {
    h: usize,
    mean: Vec<U>,
    k1: Vec<U>,
}

impl<U: Copy> PeriodConsts<U> {
    /// The constants of a period of `per` vectors of `lanes` from channel `h`.
    fn new(h: usize, per: usize, lanes: usize, mean: &[U], k1: Option<&[U]>) -> Self {
        let c = mean.len();
        let expand = |v: &[U]| (0..per * lanes).map(|j| v[(h + j) % c]).collect::<Vec<U>>();
        PeriodConsts {
            h,
            mean: expand(mean),
            k1: k1.map_or_else(|| expand(mean), expand),
        }
    }
}

/// The sums over the four pixels of `ins` from `p0` (`c` channels each): one update of
/// the accumulators per four vectors of each input (see [`PixelSums::quads`]).
#[inline(always)]
fn sums_quad<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize, const PF: bool>(
    s: S,
    ins: &[&[T]; N],
    p0: usize,
    c: usize,
    consts: &Reads<'_, U, 2>,
    a: &mut [S::V],
    b: &mut [S::V],
) {
    let (l, start) = (S::LANES, p0);
    let (a, b) = (&mut a[..c.div_ceil(l)], &mut b[..c.div_ceil(l)]);
    let ahead = PREFETCH_BYTES / std::mem::size_of::<T>();
    // The whole vectors through one pointer per input (pixel 0 of the quad), their
    // ranges proved once, and no slice made for a quad without a partial vector: with
    // a slice and a `Reads` per pixel the loop carried two bounds checks and three
    // reloads from the stack a vector, and four slices and asserts a quad (see the
    // tile flush in `pixel_sums` for the figures of both changes).
    let whole = c / l;
    assert!(whole <= a.len() && whole <= b.len());
    assert!(consts.vectors() >= whole && consts.lanes_of(s));
    let mut base = [std::ptr::null::<T>(); N];
    for (p, i) in base.iter_mut().zip(ins) {
        // Four whole pixels from `p0` (checked: the slice panics past the end).
        *p = i[start..start + 4 * c].as_ptr();
    }
    // The accumulators through iterators: indexed, `a[g]` kept a bounds check a vector
    // in the machine code despite the assertion above (perf annotate, NHWC backward
    // training in cache, f32, bf16 and f16, both ISAs).
    let pairs = a[..whole].iter_mut().zip(&mut b[..whole]);
    for (g, (ag, bg)) in pairs.enumerate() {
        if PF {
            // The four pixels are contiguous in each input: the lines of four vectors'
            // worth from the first pixel, in memory order.
            prefetch_each(s, &base, ahead + 4 * g * l, 4 * l);
        }
        // SAFETY: `g < whole <= consts.vectors()`, lanes checked above.
        let [m, _] = unsafe { consts.load_unchecked(s, g) };
        // SAFETY: pixel `k < 4` of each input holds `c` elements from `k·c`, and
        // `g·l + l <= whole·l <= c` (checked above).
        let (v0, v1, v2, v3) = unsafe {
            (
                vectors_at(s, &base, g * l),
                vectors_at(s, &base, c + g * l),
                vectors_at(s, &base, 2 * c + g * l),
                vectors_at(s, &base, 3 * c + g * l),
            )
        };
        let (d0, d1, d2, d3) = (
            grad_of(s, &v0),
            grad_of(s, &v1),
            grad_of(s, &v2),
            grad_of(s, &v3),
        );
        let sb = s.mul(d0, s.sub(v0[1], m));
        let sb = s.mul_add(d1, s.sub(v1[1], m), sb);
        let sb = s.mul_add(d2, s.sub(v2[1], m), sb);
        let sb = s.mul_add(d3, s.sub(v3[1], m), sb);
        *ag = s.add(*ag, s.add(s.add(d0, d1), s.add(d2, d3)));
        *bg = s.add(*bg, sb);
    }
    let (at, n) = (whole * l, c - whole * l);
    if n > 0 {
        if PF {
            // The quad's last line(s), as in the statistics' four-pixel loop.
            prefetch_each(s, &base, ahead + 4 * at, 4 * n);
        }
        let g = at / l;
        let [m, _] = consts.load(s, g);
        for k in 0..4 {
            let p = sub_n(ins, start + k * c, Some(c));
            (_, (a[g], b[g])) = sums_partial(s, &p, at, n, m, (a[g], b[g]));
        }
    }
}

/// The vector at element `at` of every input of `base`.
///
/// # Safety
/// Every `base[i]` is valid for reads of `at + LANES` elements.
#[inline(always)]
unsafe fn vectors_at<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize>(
    s: S,
    base: &[*const T; N],
    at: usize,
) -> [S::V; N] {
    let mut v = [s.splat(U::ZERO); N];
    for (v, p) in v.iter_mut().zip(base) {
        // SAFETY: the caller's guarantee.
        *v = unsafe { s.load_ptr(p.add(at)) };
    }
    v
}

/// [`PixelSums`] for one combination of inputs: `ins` = dy, x (and the mask).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pixel_sums<U: Real, S: Simd<U>, T: Element<Stat = U>, const N: usize>(
    s: S,
    ins: [&[T]; N],
    mean: &[U],
    mut dx: Option<(&mut [T], &[U])>,
    stream: bool,
    quads: Quads,
    sums: (&mut [f64], &mut [f64]),
    arena: Option<&bumpalo::Bump>,
) {
    let (l, c) = (S::LANES, mean.len());
    // Without the hints (`Simd::HINTS`) no streamed dx and no prefetched quads: the
    // plain walks, compiled once.
    let stream = S::HINTS && stream;
    let quads = match quads {
        Quads::Prefetched if !S::HINTS => Quads::Cached,
        q => q,
    };
    let groups = c.div_ceil(l);
    let zero = s.splat(U::ZERO);
    // Scratch on the stack for few channel groups (small tensors paid about ten
    // allocations a call here and in the callers), from the thread's arena where given
    // (large C: from the heap, fresh pages a task; see `with_arena`).
    let (mut heap_mean, mut heap_k1): (
        Scratch<U, { 8 * MAX_LANES }>,
        Scratch<U, { 8 * MAX_LANES }>,
    );
    let mean_p: &mut [U] = match arena {
        Some(a) => a.alloc_slice_fill_copy(groups * l, U::ZERO),
        None => {
            heap_mean = scratch(U::ZERO, groups * l);
            &mut heap_mean
        }
    };
    mean_p[..mean.len()].copy_from_slice(mean);
    let k1_p: &mut [U] = match arena {
        Some(a) => a.alloc_slice_fill_copy(groups * l, U::ZERO),
        None => {
            heap_k1 = scratch(U::ZERO, groups * l);
            &mut heap_k1
        }
    };
    if let Some((_, k1)) = &dx {
        k1_p[..k1.len()].copy_from_slice(k1);
    }
    let tile = pixels_per_tile(c) * c;
    let size = std::mem::size_of::<T>();
    // With dx, where the ISA has a cheaper pair order (AVX2 bf16), the pixel walk takes
    // its vectors in pairs (`pixel_out_pairs`), the constants laid out to match (they
    // serve only that walk then: without dx the walks below load single vectors). A
    // streamed dx whose pixels are whole pairs and start half a pair off 32 bytes takes
    // its first vector alone, so that every pair is one 32-byte store. Each channel
    // still adds its elements in one lane in the same order: the same bits.
    let whole = c / l;
    let pair_layout = (dx.is_some() && s.pair_even_odd::<T>()).then(|| {
        let off = dx
            .as_ref()
            .map_or(0, |(o, _)| o.as_ptr() as usize % (2 * l * size));
        let lead = usize::from(stream && c.is_multiple_of(2 * l) && off == l * size && whole > 0);
        PairLayout {
            lead,
            count: (whole - lead) / 2,
        }
    });
    if let Some(p) = pair_layout {
        p.reorder(mean_p, l, true);
        p.reorder(k1_p, l, true);
    }
    let consts = Reads::new(l, [&mean_p[..], &k1_p[..]], groups * l);
    // Tiles walked as one periodic run of vectors (`tile_periodic`): C not a multiple
    // of the lanes with a short period; C a multiple of the lanes where a streamed dx
    // starts off a vector boundary (the constants rotated by the `h` channels before it);
    // with dx and ordinary stores, C a multiple of the lanes of few vectors (`few`, from
    // lane 0). Only kernels with hints (the SIMD ones): the portable kernels' `stream`
    // is always false above, and they keep the pixel walk they had.
    let short = short_period(c, l);
    let rotated = stream && dx.is_some() && c.is_multiple_of(l);
    let few_groups = if s.pair_even_odd::<T>() {
        FEW_PERIODIC_PAIRED_GROUPS
    } else {
        FEW_PERIODIC_GROUPS
    };
    let few = S::HINTS && dx.is_some() && !stream && c.is_multiple_of(l) && groups <= few_groups;
    let period = short.or((rotated || few).then_some(groups));
    let width = groups.max(period.unwrap_or(0));
    let (mut a_buf, mut b_buf, mut lanes_buf): (
        Scratch<S::V, 16>,
        Scratch<S::V, 16>,
        Scratch<U, { 2 * 16 * MAX_LANES }>,
    );
    // Slices taken once: each use of a `Scratch` tests where its elements are (+5k
    // instructions a 2x8x8x32 Ex backward call when the loops indexed them).
    let (a, b, lanes): (&mut [S::V], &mut [S::V], &mut [U]) = match arena {
        Some(ar) => (
            ar.alloc_slice_fill_copy(width, zero),
            ar.alloc_slice_fill_copy(width, zero),
            ar.alloc_slice_fill_copy(2 * width * l, U::ZERO),
        ),
        None => {
            (a_buf, b_buf, lanes_buf) = (
                scratch(zero, width),
                scratch(zero, width),
                scratch(U::ZERO, 2 * width * l),
            );
            (&mut a_buf, &mut b_buf, &mut lanes_buf)
        }
    };
    let mut pc: Option<PeriodConsts<U>> = None;
    let k1 = dx.as_ref().map(|d| d.1);
    // With a streamed dx (inputs from DRAM), each input prefetched STREAM_AHEAD_BYTES
    // ahead. Measured on an Intel Xeon (`scripts/ab.sh 3`, NHWC backward inference,
    // time ÷ copy): f32 64x56x56x256 1.17 -> 1.09 with AVX-512 and 1.10 -> 1.01 with
    // AVX2, bf16 1.07 -> 0.82 and f16 0.91 -> 0.77 with AVX2 (64x112x112x64 alike).
    // With AVX-512 the 16-bit types once went 1.10 -> 1.27 with it, but their dx was
    // then not streamed at all (32-byte vectors in a buffer aligned to 16); streamed
    // (`tile_periodic`), bf16 64x56x56x256 0.92 -> 0.83, f16 0.91 -> 0.81.
    let ahead_dx = stream;
    // Whole pixels streamed only where every pixel is whole vectors: with a partial last
    // vector a pixel's tail (an ordinary masked store) and the next pixel's stores share
    // a line with its non-temporal ones, and such mixed lines cost NHWC backward
    // inference of 655360x1x1x24 f16 with AVX-512 (one whole vector and a tail a
    // pixel) 12.4-12.8 times its copy, 262144x1x1x72 4.6-4.8; 1.9 and 1.27-1.29 with
    // ordinary stores (Zen 4, `scripts/ab.sh 3`).
    let stream_px = stream && c.is_multiple_of(l);
    let ahead = STREAM_AHEAD_BYTES / size;
    let len = ins[0].len();
    let mut t0 = 0;
    while t0 < len {
        let t1 = (t0 + tile).min(len);
        a.fill(zero);
        b.fill(zero);
        let mut q0 = t0;
        // The period constants of this tile, where it is walked as a periodic run.
        let mut periodic = None;
        if let Some(per) = period {
            let n = t1 - t0;
            // A streamed dx: the run starts where dx reaches a vector boundary.
            let h = match dx.as_ref() {
                Some((out, _)) if stream => out[t0..].as_ptr().align_offset(l * size),
                _ => 0,
            };
            if (short.is_some() || h > 0 || few) && h < l && h + l <= n {
                // From lane 0 with C = per·LANES (the few-vector run) the period's
                // constants are `mean` and `k1` as given; otherwise expanded once and
                // kept for the tiles after while `h` is the same.
                let as_given = h == 0 && c == per * l;
                if !as_given && pc.as_ref().is_none_or(|p| p.h != h) {
                    pc = Some(PeriodConsts::new(h, per, l, mean, k1));
                }
                let consts_p = match pc.as_ref() {
                    Some(p) if !as_given => Reads::new(l, [&p.mean[..], &p.k1[..]], per * l),
                    _ => Reads::new(l, [mean, k1.unwrap_or(mean)], per * l),
                };
                let ins_t = sub_n(&ins, t0, Some(n));
                let (pa, pb) = (&mut a[..per], &mut b[..per]);
                match dx.as_mut() {
                    Some((out, _)) if stream => {
                        let (o, pf) = (Some(&mut out[t0..t1]), ahead_dx.then_some(ahead));
                        tile_periodic::<U, S, T, N, true>(s, ins_t, o, h, &consts_p, pf, pa, pb);
                    }
                    Some((out, _)) => {
                        let o = Some(&mut out[t0..t1]);
                        tile_periodic::<U, S, T, N, false>(s, ins_t, o, 0, &consts_p, None, pa, pb);
                    }
                    None => {
                        tile_periodic::<U, S, T, N, false>(
                            s, ins_t, None, 0, &consts_p, None, pa, pb,
                        );
                    }
                }
                q0 = t1;
                periodic = Some((h, per));
            }
        }
        if dx.is_none() && quads != Quads::No {
            while q0 + 4 * c <= t1 {
                if quads == Quads::Prefetched {
                    sums_quad::<U, S, T, N, true>(s, &ins, q0, c, &consts, a, b);
                } else {
                    sums_quad::<U, S, T, N, false>(s, &ins, q0, c, &consts, a, b);
                }
                q0 += 4 * c;
            }
        }
        for p0 in (q0..t1).step_by(c) {
            let px = sub_n(&ins, p0, Some(c));
            match dx.as_mut() {
                None => {
                    // One pixel a step (f32 from DRAM, `Quads::No`), its ranges proved
                    // once: with `Reads::load` and indexed sums the loop kept three
                    // bounds checks and a reload from the stack a vector (NHWC f32
                    // 64x56x56x256 backward training, AVX-512, `perf annotate`).
                    let r = Reads::new(l, px, c);
                    let nv = r.vectors();
                    assert!(nv <= consts.vectors() && r.lanes_of(s) && consts.lanes_of(s));
                    let (av, bv) = (&mut a[..nv], &mut b[..nv]);
                    for (g, (ag, bg)) in av.iter_mut().zip(bv.iter_mut()).enumerate() {
                        // SAFETY: `g < nv`, at most the vectors of both (checked above),
                        // whose lanes are `S`'s.
                        let ([mv, _], v) =
                            unsafe { (consts.load_unchecked(s, g), r.load_unchecked(s, g)) };
                        fold(s, &v, mv, ag, bg);
                    }
                    let (a, b) = (&mut a[..], &mut b[..]);
                    let (at, n) = r.tail();
                    if n > 0 {
                        let g = at / l;
                        let [mv, _] = consts.load(s, g);
                        (_, (a[g], b[g])) = sums_partial(s, &px, at, n, mv, (a[g], b[g]));
                    }
                }
                Some((out, _)) => {
                    // From DRAM: every input prefetched ahead, one hint per line, spread
                    // over the pixel's pairs of vectors (in its walk below). A burst of
                    // a pixel's lines before its walk (eight a pixel and input at C =
                    // 256 bf16) stalled on the core's misses in flight: `perf` put a
                    // fifth of the pass's samples on that burst. Zen 4, `scripts/ab.sh
                    // 3`, 64x112x112x64 / 64x56x56x256, time ÷ copy, burst -> spread:
                    // bf16 AVX2 1.11 / 1.02 -> 0.93 / 0.96, AVX-512 0.99 / 0.95 -> 0.85
                    // / 0.85; f16 AVX2 1.07 / 0.97 -> 0.88 / 0.87, AVX-512 0.96 / 0.92
                    // -> 0.87 / 0.87; f32 0.80-0.89 -> 0.76-0.79.
                    let pa = ahead_dx.then_some(ahead);
                    let o = &mut out[p0..p0 + c];
                    let (at, n) = {
                        let mut w = Walk::new(l, px, &mut *o);
                        let (ca, cb) = (&mut a[..], &mut b[..]);
                        match (pair_layout, stream_px && w.aligned()) {
                            (Some(p), true) => pixel_out_pairs::<U, S, T, N, true>(
                                s, &mut w, p.lead, &consts, ca, cb, pa,
                            ),
                            (Some(p), false) => pixel_out_pairs::<U, S, T, N, false>(
                                s, &mut w, p.lead, &consts, ca, cb, pa,
                            ),
                            (None, true) => {
                                pixel_out::<U, S, T, N, true>(s, &mut w, &consts, ca, cb, pa)
                            }
                            (None, false) => {
                                pixel_out::<U, S, T, N, false>(s, &mut w, &consts, ca, cb, pa)
                            }
                        }
                        w.tail()
                    };
                    if n > 0 {
                        let g = at / l;
                        let [mv, kv] = consts.load(s, g);
                        let d;
                        (d, (a[g], b[g])) = sums_partial(s, &px, at, n, mv, (a[g], b[g]));
                        s.store_partial(&mut o[at..at + n], s.mul(d, kv));
                    }
                }
            }
        }
        let used = periodic.map_or(groups, |(_, per)| per);
        let (la, lb) = lanes.split_at_mut(used * l);
        for gi in 0..used {
            s.store(&mut la[gi * l..], a[gi]);
            s.store(&mut lb[gi * l..], b[gi]);
        }
        if let (Some(p), None) = (pair_layout, periodic) {
            // The pixel walk's pairs (a periodic tile's lanes are in memory order).
            p.reorder(la, l, false);
            p.reorder(lb, l, false);
        }
        // Lane j holds the elements at `(h + j) mod w` of every w elements, in order
        // (w = per·LANES periodic, else C with h = 0): folded by that residue, so that
        // the bits do not depend on h (on where dx lies in memory).
        // Indices stepped, not taken `% w` and `% c` per channel: two integer divisions
        // a channel were 15 % of the samples of NHWC 64x56x56x256 bf16 backward sums
        // (C = 256, a flush every 128 pixels; `perf annotate`, Zen 4).
        let (h, w) = periodic.map_or((0, c), |(h, _)| (h, used * l));
        let (sd, sx) = (&mut sums.0[..c], &mut sums.1[..c]);
        if h == 0 && w == c {
            // Lane j is channel j: the same additions as below, in a plain loop over
            // the channels (no wrap tests). With the four-pixel loop's single base
            // pointers (`sums_quad`), this took the 16-bit sums from DRAM from
            // 1.31-1.50 of a plain read of dy and x to 1.07-1.24 with AVX2, 1.30-1.35
            // to 1.10-1.24 with AVX-512 (Zen 4, NHWC 64x56x56x256 bf16, in process, 25
            // interleaved rounds, medians, four runs; each change alone 1.21-1.34); a
            // bare loop of the same walk took 1.09-1.15 (`scripts/models/sums_walks.c`
            // has it in C).
            for ((d, x), (u, v)) in sd.iter_mut().zip(sx.iter_mut()).zip(la.iter().zip(&*lb)) {
                *d += u.to_f64();
                *x += v.to_f64();
            }
        } else {
            let (mut j, mut ch) = ((w - h) % w, 0);
            for _ in 0..w {
                sd[ch] += la[j].to_f64();
                sx[ch] += lb[j].to_f64();
                j += 1;
                if j == w {
                    j = 0;
                }
                ch += 1;
                if ch == c {
                    ch = 0;
                }
            }
        }
        t0 = t1;
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
///
/// `k` is `[dy_mean, mean, k1, k2]`, per channel.
pub fn apply<T: Element>(
    g: &Geometry,
    isa: Isa,
    data: GradData<'_, T>,
    k: [&[T::Stat]; 4],
    dx: &mut [T],
) {
    let GradData { dy, mask, x } = data;
    debug_assert!(dy.len() == g.len() && x.len() == g.len() && dx.len() == g.len());
    match mask {
        None => elementwise(g, isa, [dy, x], k, dx, BackwardFn),
        Some(y) => elementwise(g, isa, [dy, x, y], k, dx, BackwardMaskFn),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// The inference gradient over `c`-channel pixels of `dy`, `x` (and the mask `y`),
    /// its `dx` written `off` elements past a 64-byte boundary, with or without
    /// non-temporal stores: `dx` and the sums as `f64`s.
    fn run<T: Element>(
        isa: Isa,
        ins: &[Vec<T>],
        mean: &[T::Stat],
        k1: &[T::Stat],
        off: usize,
        stream: bool,
    ) -> (Vec<f64>, BackwardSums) {
        let (c, n) = (mean.len(), ins[0].len());
        let mut buf = vec![T::default(); n + 64];
        let base = buf.as_ptr().align_offset(64).min(64);
        let start = base + off;
        let out = &mut buf[start..start + n];
        let mut sums = BackwardSums::zeros(c);
        T::Stat::dispatch(
            isa,
            PixelSums {
                dy: &ins[0],
                mask: ins.get(2).map(|y| &y[..]),
                x: &ins[1],
                mean,
                dx: Some((out, k1)),
                stream,
                quads: Quads::No,
                sums: (&mut sums.sum_dy, &mut sums.sum_dy_xc),
                arena: None,
            },
        );
        let dx = buf[start..start + n]
            .iter()
            .map(|v| v.widen().to_f64())
            .collect();
        (dx, sums)
    }

    fn same(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()))
    }

    /// A streamed `dx` that is not aligned to whole vectors takes the rotated walk
    /// (`tile_periodic`), and so does every C with a short period, and with ordinary
    /// stores every C of at most [`FEW_PERIODIC_GROUPS`] whole vectors (the periodic
    /// run from lane 0, compared here with the streamed pixel walk at offset 0: C = 8
    /// to 64 with AVX2, 8 to 32 in bf16 ([`FEW_PERIODIC_PAIRED_GROUPS`]), 16 to 128
    /// with AVX-512; the scalar kernels stream nothing and take the pixel walk both
    /// times): every offset from the vector boundary, several tiles and a short
    /// last one, with and without the ReLU mask, an infinite mean and a NaN in x gives
    /// the bits of the walk at offset 0 with ordinary stores, `dx` and sums alike.
    fn rotated_matches_plain<T: Element>() {
        for isa in Isa::supported() {
            // Multiples of the lanes (one lane a channel), short periods (several lanes
            // a channel, folded by residue whatever the offset), and C = 200: a period
            // too long with 16 lanes (pixel by pixel, ordinary stores), whole vectors
            // with 8.
            for c in [
                16usize, 32, 48, 64, 1, 2, 3, 5, 6, 7, 9, 12, 24, 40, 200, 8, 80, 96, 128,
            ] {
                let pixels = 2 * pixels_per_tile(c) + 37;
                let n = pixels * c;
                let val = |i: usize, k: u64| {
                    let h = (i as u64 ^ k).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
                    T::narrow(T::Stat::from_f64(h as f64 / (1u64 << 23) as f64 - 1.0))
                };
                // dy positive: with the infinite means of channels 0 and c − 1 (each
                // in the last group's straddling lanes, whatever the offset) the sums
                // are −inf, and a lane summed where it should not be turns them NaN.
                let (dy, mut x, y): (Vec<T>, Vec<T>, Vec<T>) = (
                    (0..n)
                        .map(|i| T::narrow(T::Stat::from_f64(1.5)).widen() + val(i, 1).widen())
                        .map(T::narrow)
                        .collect(),
                    (0..n).map(|i| val(i, 2)).collect(),
                    (0..n).map(|i| val(i, 3)).collect(),
                );
                x[5 * c + 3] = T::narrow(T::Stat::from_f64(f64::NAN));
                let mut mean: Vec<T::Stat> =
                    (0..c).map(|i| T::Stat::from_f64(i as f64 / 7.0)).collect();
                mean[0] = T::Stat::from_f64(f64::INFINITY);
                mean[c - 1] = T::Stat::from_f64(f64::INFINITY);
                let k1: Vec<T::Stat> = (0..c).map(|i| T::Stat::from_f64(1.0 + i as f64)).collect();
                for ins in [
                    vec![dy.clone(), x.clone()],
                    vec![dy.clone(), x.clone(), y.clone()],
                ] {
                    let (dx0, s0) = run(isa, &ins, &mean, &k1, 0, false);
                    for off in 0..16 {
                        let (dx, sums) = run(isa, &ins, &mean, &k1, off, true);
                        let what = format!("{isa} c = {c}, offset {off}, {} inputs", ins.len());
                        assert!(same(&dx, &dx0), "{what}: dx");
                        assert!(same(&sums.sum_dy, &s0.sum_dy), "{what}: sum dy");
                        assert!(same(&sums.sum_dy_xc, &s0.sum_dy_xc), "{what}: sum dy·xc");
                    }
                }
            }
        }
    }

    /// [`BackwardSums::in_waves`] (large C: the tasks' sums a wave at a time in the
    /// calling thread's buffer) adds the tasks' sums in task order: [`BackwardSums::total`]'s bits, over
    /// three waves, with sums of magnitudes that make the order show.
    #[test]
    fn in_waves_adds_the_tasks_in_order_bit_for_bit() {
        let (c, n) = (40_000, 9);
        let g = Geometry::new(64 * n, c, 1);
        let value = |t: usize, ch: usize, k: usize| {
            ((t * 7919 + ch * 31 + k) % 1013) as f64 * 1e-3 * 10f64.powi((t % 5) as i32 * 3)
        };
        let fill = |t: usize, (sd, sx): (&mut [f64], &mut [f64])| {
            for ch in 0..c {
                sd[ch] += value(t, ch, 0);
                sx[ch] += -value(t, ch, 1);
            }
        };
        let partials: Vec<BackwardSums> = (0..n)
            .map(|t| {
                let mut p = BackwardSums::zeros(c);
                fill(t, (&mut p.sum_dy, &mut p.sum_dy_xc));
                p
            })
            .collect();
        let want = BackwardSums::total(c, partials);
        let got = BackwardSums::in_waves(&g, n, c, vec![(); n], |t, (), sums| fill(t, sums));
        let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.sum_dy), bits(&want.sum_dy));
        assert_eq!(bits(&got.sum_dy_xc), bits(&want.sum_dy_xc));
    }

    /// At large C (its sums and scratch from the arena) the channels-last inference
    /// gradient is each task's alone (64 pixels, the kernel's heap path), dx and sums
    /// bit for bit; and the training sums (`reduce`: products and tiles in `f32`) are
    /// within 1e-6 of the sum of absolute terms of `f64` sums.
    #[test]
    fn large_c_gradient_sums_match_the_tasks_and_f64() {
        let (pixels, c) = (300, 9_000);
        let g = Geometry::new(pixels, c, 1);
        assert_eq!(PixelSplit::reduce(&g).len(), 5);
        let n = g.len();
        let dy: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.01 - 5.0)
            .collect();
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 104_729) % 997) as f32 * 0.02 + 3.0)
            .collect();
        let mean: Vec<f32> = (0..c).map(|ch| 3.0 + (ch % 17) as f32 * 0.5).collect();
        let k1: Vec<f32> = (0..c).map(|ch| 0.5 + (ch % 13) as f32 * 0.1).collect();
        let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for isa in Isa::supported() {
            let data = GradData {
                dy: &dy,
                mask: None,
                x: &x,
            };
            let mut dx = vec![0f32; n];
            let got = crate::kernels::fused::backward_inference(&g, isa, data, &mean, &k1, &mut dx);
            let mut want_dx = Vec::with_capacity(n);
            let mut parts = Vec::new();
            for (d, xs) in dy.chunks(64 * c).zip(x.chunks(64 * c)) {
                let (part_dx, part) = run(isa, &[d.to_vec(), xs.to_vec()], &mean, &k1, 0, false);
                want_dx.extend(part_dx);
                parts.push(part);
            }
            let want = BackwardSums::total(c, parts);
            let got_dx: Vec<f64> = dx.iter().map(|v| *v as f64).collect();
            assert_eq!(bits(&got_dx), bits(&want_dx), "{isa:?} dx");
            assert_eq!(bits(&got.sum_dy), bits(&want.sum_dy), "{isa:?} sum dy");
            assert_eq!(
                bits(&got.sum_dy_xc),
                bits(&want.sum_dy_xc),
                "{isa:?} sum dy·xc"
            );
            let sums = reduce(&g, isa, data, &mean);
            for ch in 0..c {
                let (mut sd, mut sx, mut scale) = (0f64, 0f64, 0f64);
                for p in 0..pixels {
                    let (d, v) = (
                        dy[p * c + ch] as f64,
                        x[p * c + ch] as f64 - mean[ch] as f64,
                    );
                    (sd, sx, scale) = (sd + d, sx + d * v, scale + (d * v).abs() + d.abs());
                }
                let tol = 1e-6 * scale.max(1.0);
                assert!(
                    (sums.sum_dy[ch] - sd).abs() <= tol,
                    "{isa:?} ch {ch} sum dy"
                );
                assert!(
                    (sums.sum_dy_xc[ch] - sx).abs() <= tol,
                    "{isa:?} ch {ch} sum dy·xc"
                );
            }
        }
    }

    #[test]
    fn rotated_streamed_dx_has_the_bits_of_the_plain_walk() {
        rotated_matches_plain::<f32>();
        rotated_matches_plain::<bf16>();
        rotated_matches_plain::<f16>();
    }

    /// The inference gradient of channel-major rows of `len` elements of `ins` (one
    /// channel: the sums carried from row to row, as `fused::channel_rows_out` does),
    /// `dx` written `off` elements past a 64-byte boundary, with or without
    /// non-temporal stores: `dx`, then each lane of the two sums, as `f64`s.
    struct Rows<'a, T: Element> {
        ins: &'a [Vec<T>],
        len: usize,
        mean: T::Stat,
        k1: T::Stat,
        out: &'a mut [T],
        stream: bool,
    }

    impl<T: Element> Kernel<T::Stat> for Rows<'_, T> {
        type Output = Vec<f64>;
        fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<f64> {
            // The token the library passes (`fused::InferenceRows`).
            let s = s.plain_nans(&[&[self.k1]]);
            let (m, k1) = (s.splat(self.mean), s.splat(self.k1));
            // Sums that do not start at zero, different in each lane.
            let start: Vec<T::Stat> = (0..S::LANES)
                .map(|i| T::Stat::from_f64(0.25 + i as f64))
                .collect();
            let mut acc = (s.load(&start[..]), s.load(&start[..]));
            let total = self.ins[0].len();
            let mut at = 0;
            while at < total {
                let n = self.len.min(total - at);
                let data = GradData {
                    dy: &self.ins[0][at..at + n],
                    mask: self.ins.get(2).map(|y| &y[at..at + n]),
                    x: &self.ins[1][at..at + n],
                };
                let out = &mut self.out[at..at + n];
                acc = row_sums_out(s, data, m, (out, self.stream), k1, acc, &mut NoPace);
                at += n;
            }
            let mut lanes = vec![T::Stat::ZERO; 2 * S::LANES];
            s.store(&mut lanes[..S::LANES], acc.0);
            s.store(&mut lanes[S::LANES..], acc.1);
            let dx = self.out.iter().map(|v| v.widen().to_f64());
            dx.chain(lanes.iter().map(|v| v.to_f64())).collect()
        }
    }

    /// A streamed channel-major `dx` that is not aligned to whole vectors peels a head
    /// and sums the body in rotated lanes (`sums_out_run`): every offset from a 64-byte
    /// boundary, rows shorter than a vector, of whole vectors and of odd lengths (so
    /// each row starts at another offset), with and without the ReLU mask, a NaN in x,
    /// a finite and an infinite mean, gives the bits of the aligned walk in `dx` and in
    /// every lane of both sums.
    fn rows_match_aligned<T: Element>() {
        let n = 1000;
        let val = |i: usize, k: u64| {
            let h = (i as u64 ^ k).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            T::narrow(T::Stat::from_f64(h as f64 / (1u64 << 23) as f64 - 0.25))
        };
        // dy positive: with the infinite mean every lane's dy·(x − m) sum is −inf, and
        // a zero folded where the aligned walk folds none (or none where it folds one:
        // 0·−inf) turns a lane NaN.
        let (dy, mut x, y): (Vec<T>, Vec<T>, Vec<T>) = (
            (0..n)
                .map(|i| T::narrow(val(i, 1).widen() + T::Stat::from_f64(1.5)))
                .collect(),
            (0..n).map(|i| val(i, 2)).collect(),
            (0..n).map(|i| val(i, 3)).collect(),
        );
        x[407] = T::narrow(T::Stat::from_f64(f64::NAN));
        let run = |isa, ins: &[Vec<T>], len, mean: f64, off, stream| {
            let mut buf = vec![T::default(); n + 64];
            let start = buf.as_ptr().align_offset(64).min(64) + off;
            let rows = Rows {
                ins,
                len,
                mean: T::Stat::from_f64(mean),
                k1: T::Stat::from_f64(1.75),
                out: &mut buf[start..start + n],
                stream,
            };
            T::Stat::dispatch(isa, rows)
        };
        for isa in Isa::supported() {
            for ins in [
                vec![dy.clone(), x.clone()],
                vec![dy.clone(), x.clone(), y.clone()],
            ] {
                // From 128 (`PAIR_RUN_MIN`) on, AVX2 bf16 and f16 walk pairs.
                for len in [
                    1usize, 3, 7, 15, 16, 17, 31, 32, 33, 64, 77, 100, 127, 128, 129, 136, 143,
                    144, 151, 255, 1000,
                ] {
                    for mean in [0.125, f64::INFINITY] {
                        let aligned = run(isa, &ins, len, mean, 0, false);
                        for off in 0..16 {
                            let got = run(isa, &ins, len, mean, off, true);
                            let what = format!(
                                "{isa}, rows of {len}, mean {mean}, offset {off}, {} inputs",
                                ins.len()
                            );
                            assert!(same(&got, &aligned), "{what}");
                        }
                    }
                }
            }
        }
    }

    /// `dx` of channel-major rows of every length from 1 to 70 (so every tail length of
    /// every ISA, rows shorter than a vector, and rows whose last whole vector overlaps
    /// the one before) and some longer ones, with and without the ReLU mask, NaN and
    /// infinities in dy, the library's token (`Simd::plain_nans` of `k1`): each element
    /// is `dy·k1` (dy masked to `y > 0`) narrowed, bit for bit, on every ISA the
    /// machine has.
    fn row_dx_is_the_formula<T: Element>() {
        let n = 1000;
        let val = |i: usize, k: u64| {
            let h = (i as u64 ^ k).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            T::narrow(T::Stat::from_f64(h as f64 / (1u64 << 23) as f64 - 0.25))
        };
        let mut ins: Vec<Vec<T>> = (1..=3)
            .map(|k| (0..n).map(|i| val(i, k)).collect())
            .collect();
        // Non-finite dy, in tails and in overlapped lanes of some row lengths.
        for (i, v) in [
            (5, f64::NAN),
            (48, f64::INFINITY),
            (62, f64::NEG_INFINITY),
            (999, f64::NAN),
        ] {
            ins[0][i] = T::narrow(T::Stat::from_f64(v));
        }
        let k1 = T::Stat::from_f64(1.75);
        for isa in Isa::supported() {
            for masked in [false, true] {
                let ins = &ins[..if masked { 3 } else { 2 }];
                for len in (1..=70).chain([127, 128, 129, 143, 1000]) {
                    let mut out = vec![T::default(); n];
                    let rows = Rows {
                        ins,
                        len,
                        mean: T::Stat::from_f64(0.125),
                        k1,
                        out: &mut out,
                        stream: false,
                    };
                    T::Stat::dispatch(isa, rows);
                    for (i, got) in out.iter().enumerate() {
                        let on = !masked || ins[2][i].widen() > T::Stat::ZERO;
                        let d = if on { ins[0][i].widen() } else { T::Stat::ZERO };
                        let want = T::narrow(d * k1);
                        let bits = |v: T| v.widen().to_f64().to_bits();
                        assert_eq!(
                            bits(*got),
                            bits(want),
                            "{isa}, rows of {len}, masked {masked}, element {i}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn row_dx_is_the_formula_on_every_row_length() {
        row_dx_is_the_formula::<f32>();
        row_dx_is_the_formula::<bf16>();
        row_dx_is_the_formula::<f16>();
    }

    #[test]
    fn rotated_rows_have_the_bits_of_the_aligned_walk() {
        rows_match_aligned::<f32>();
        rows_match_aligned::<bf16>();
        rows_match_aligned::<f16>();
    }
}
