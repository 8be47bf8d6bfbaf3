//! Apply pass — `y = (x − shift[c])·a[c] + b[c]`, computed in `U`, rounded to `T` once —
//! and the elementwise engine the backward apply shares with it.
//!
//! The forward op uses it with `shift = mean`, `a = scale·rsqrt(var + ε)`,
//! `b = offset`. Centring before scaling keeps `y` accurate when |mean| ≫ std.
//!
//! The engine walks an output as one flat stream: in channel-major layouts a row has
//! one channel (constants splatted), in channels-last layouts the constants repeat
//! with period `lcm(C, lanes)` (a pattern built per task). Large outputs are written
//! with non-temporal stores; the first partial vector is peeled so that every full
//! vector store is aligned. Head and tail use partial vectors through the same
//! arithmetic, so results do not depend on the alignment of the buffers.

use std::mem::size_of;

use super::simd::{
    load_n, load_partial_n, splat_n, sub_n, Dispatch, Isa, Kernel, Reads, Simd, Walk,
};
use super::{
    arena_if, for_each_row_chunk, next_cyclic, Geometry, ARENA_MIN_BYTES, MAX_PERIOD,
    STREAM_ROW_BYTES,
};
use crate::element::{DType, Element, Real};

/// What the forward pass does after the affine map: add an optional residual
/// (`side_input`, the shape of x) and apply an optional ReLU — TensorFlow's
/// `_FusedBatchNormEx` epilogue, fused into the same pass.
#[derive(Clone, Copy, Debug)]
pub struct Epilogue<'a, T> {
    /// Added to the normalized value before the activation.
    pub side: Option<&'a [T]>,
    /// `max(0, ·)` after the addition.
    pub relu: bool,
}

impl<T> Default for Epilogue<'_, T> {
    fn default() -> Self {
        Epilogue {
            side: None,
            relu: false,
        }
    }
}

/// Per-channel affine map of `x` into `y` (both of geometry `g`), then the epilogue:
/// `y = act((x − shift)·a + b + side)`; `k = [shift, a, b]`, `C` elements each.
pub fn affine<T: Element>(
    g: &Geometry,
    isa: Isa,
    x: &[T],
    k: [&[T::Stat]; 3],
    epi: Epilogue<'_, T>,
    y: &mut [T],
) {
    debug_assert!(x.len() == g.len() && y.len() == g.len());
    match (epi.side, epi.relu) {
        (None, false) => elementwise(g, isa, [x], k, y, Affine),
        (None, true) => elementwise(g, isa, [x], k, y, AffineRelu),
        (Some(side), false) => elementwise(g, isa, [x, side], k, y, AffineSide::<false>),
        (Some(side), true) => elementwise(g, isa, [x, side], k, y, AffineSide::<true>),
    }
}

/// `out = f(ins, consts[channel])` over a whole tensor of geometry `g`, split into
/// tasks; streamed when the output is large.
pub(crate) fn elementwise<T: Element, F, const N: usize, const K: usize>(
    g: &Geometry,
    isa: Isa,
    ins: [&[T]; N],
    consts: [&[T::Stat]; K],
    out: &mut [T],
    f: F,
) where
    F: VectorFn<N, K> + Copy + Send + Sync,
{
    let stream = g.stream(size_of::<T>());
    let row_len = g.row_len();
    // Whether a channels-last task's pattern of constants surely reaches
    // [`ARENA_MIN_BYTES`] (`K` rows of at least C values, twice with pairs), and takes
    // the thread's arena. A pattern whose period is a multiple of C (up to
    // `MAX_PERIOD`) can reach it at smaller C (bf16 AVX2 at C = 1001: 192 KiB) and
    // stays on the heap: not measured.
    let large = g.channels_last() && 2 * K * g.channels * size_of::<T::Stat>() >= ARENA_MIN_BYTES;
    for_each_row_chunk(g, out, |row0, out| {
        let ins = sub_n(&ins, row0 * row_len, Some(out.len()));
        let run = |out: &mut [T], arena: Option<&bumpalo::Bump>| {
            T::Stat::dispatch(
                isa,
                Elementwise {
                    g,
                    row0,
                    ins,
                    out,
                    consts,
                    stream,
                    f,
                    arena,
                },
            )
        };
        arena_if(large, |arena| run(out, arena));
    });
}

/// The per-vector function of an elementwise pass: `N` inputs, `K` per-channel
/// constants.
pub(crate) trait VectorFn<const N: usize, const K: usize> {
    /// One output vector from the input and constant vectors: the result of an
    /// arithmetic instruction, then possibly `max` with 0 or a mask (the passes
    /// narrow it under [`Simd::plain_nans`] of the constants).
    fn eval<U: Real, S: Simd<U>>(&self, s: S, x: [S::V; N], k: [S::V; K]) -> S::V;
}

/// `(x − shift)·a + b`.
#[derive(Clone, Copy)]
pub(crate) struct Affine;

impl VectorFn<1, 3> for Affine {
    #[inline(always)]
    fn eval<U: Real, S: Simd<U>>(&self, s: S, [x]: [S::V; 1], [sh, a, b]: [S::V; 3]) -> S::V {
        // Rounded after the product and after the sum, as TensorFlow's kernel does:
        // fusing would change the last bit of about a quarter of the f32 outputs.
        s.add(s.mul(s.sub(x, sh), a), b)
    }
}

/// `max(0, (x − shift)·a + b)`.
#[derive(Clone, Copy)]
pub(crate) struct AffineRelu;

impl VectorFn<1, 3> for AffineRelu {
    #[inline(always)]
    fn eval<U: Real, S: Simd<U>>(&self, s: S, x: [S::V; 1], k: [S::V; 3]) -> S::V {
        s.max(s.splat(U::ZERO), Affine.eval(s, x, k))
    }
}

/// `act((x − shift)·a + b + side)`, with a ReLU when `RELU`.
#[derive(Clone, Copy)]
pub(crate) struct AffineSide<const RELU: bool>;

impl<const RELU: bool> VectorFn<2, 3> for AffineSide<RELU> {
    #[inline(always)]
    fn eval<U: Real, S: Simd<U>>(&self, s: S, [x, side]: [S::V; 2], k: [S::V; 3]) -> S::V {
        let v = s.add(Affine.eval(s, [x], k), side);
        if RELU {
            s.max(s.splat(U::ZERO), v)
        } else {
            v
        }
    }
}

/// An elementwise pass over a chunk of whole rows of geometry `g`, starting at row
/// `row0`: `out = f(ins, consts[channel])`.
pub(crate) struct Elementwise<'a, T: Element, F, const N: usize, const K: usize> {
    pub g: &'a Geometry,
    pub row0: usize,
    pub ins: [&'a [T]; N],
    pub out: &'a mut [T],
    pub consts: [&'a [T::Stat]; K],
    pub stream: bool,
    pub f: F,
    /// Where a channels-last task's pattern of constants comes from where it is large
    /// ([`PatternBuf`]); the heap without.
    pub arena: Option<&'a bumpalo::Bump>,
}

impl<T: Element, F: VectorFn<N, K>, const N: usize, const K: usize> Kernel<T::Stat>
    for Elementwise<'_, T, F, N, K>
{
    type Output = ();
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) {
        let (g, l) = (self.g, S::LANES);
        if g.channels_last() {
            // `f`'s result is an arithmetic result (the `VectorFn` contract). Only bf16
            // narrows by adding, so only bf16 looks at the constants (a pass over 3·C
            // values a task of TASK elements: 2 % of them at C = 2048).
            let s = if T::DTYPE == DType::BF16 {
                s.plain_nans(&self.consts)
            } else {
                s
            };
            let c = g.channels;
            // The pattern's period: lcm(C, 2·lanes), a whole number of pairs, repeated
            // to at least 128 elements so the loop over one period is not too short.
            // With lcm(C, lanes) an odd number of vectors (C = 200 or 208 with 16
            // lanes, 200 with 8) left one vector a period stored on its own, and every
            // other pair off the line a streamed pair starts on.
            // Not where the doubled period's constants would outgrow
            // [`PAIR_PERIOD_CONST_BYTES`].
            let pairs_fit = |p: usize| p * K * size_of::<T::Stat>() <= PAIR_PERIOD_CONST_BYTES;
            let period = match lcm(c, 2 * l) {
                even if even <= MAX_PERIOD && pairs_fit(even) => even,
                _ => lcm(c, l),
            };
            let period = period * (128 / period).max(1);
            if period <= MAX_PERIOD {
                let head = head_len(self.out, s.cl_stream_align::<T>(), self.stream);
                let pairs = s.pair_even_odd::<T>();
                let pattern = Pattern::new(self.arena, self.consts, c, period, head, l, pairs);
                periodic(s, &pattern, self.ins, self.out, self.stream, &self.f);
            } else {
                // A huge period (large C, prime to the lanes): one pixel at a time,
                // each starting the pattern afresh.
                let pairs = s.pair_even_odd::<T>();
                let pattern = Pattern::new(self.arena, self.consts, c, c, 0, l, pairs);
                for (p, out) in self.out.chunks_exact_mut(c).enumerate() {
                    let ins = sub_n(&self.ins, p * c, Some(c));
                    periodic(s, &pattern, ins, out, false, &self.f);
                }
            }
        } else if !self.stream && g.inner >= S::LANES && g.inner * size_of::<T>() < STREAM_ROW_BYTES
        {
            // Rows too short to stream (`Geometry::stream` never streams them; a caller
            // that asks for streaming anyway gets the streamed path below).
            short_rows(s, g, self.row0, self.ins, self.out, self.consts, &self.f);
        } else {
            let c = g.channels;
            // The channel advances with the row (no division per row).
            let mut ch = self.row0 % c.max(1);
            // (`max(1)`: an empty C = 1 geometry has rows of 0 elements, and no rows.)
            for (r, out) in self.out.chunks_exact_mut(g.inner.max(1)).enumerate() {
                let ins = sub_n(&self.ins, r * g.inner, Some(g.inner));
                let mut kv = [T::Stat::ZERO; K];
                for (v, k) in kv.iter_mut().zip(self.consts) {
                    *v = k[ch];
                }
                let k = splat_n(s, kv);
                // Not resident: a streamed run reads its inputs from DRAM.
                run_splat(
                    s.plain_nans(&[&kv]),
                    ins,
                    out,
                    k,
                    self.stream,
                    self.stream,
                    &self.f,
                    [None, None],
                );
                ch = next_cyclic(ch, c);
            }
        }
        if self.stream {
            s.fence();
        }
    }
}

/// A chunk of whole channel-major rows (starting at row `row0`) shorter than
/// [`STREAM_ROW_BYTES`], so never streamed, and at least a vector long: each row as
/// whole units (a vector, or for bf16 rows of at least two vectors a pair, narrowed by
/// one instruction), then where the row is not a whole number of units, its last unit
/// overlapping the one before (its common elements written twice with the same values:
/// `out` is not an input, and the row has one channel's constants). No masked tail, no
/// alignment head, no prefetch slots and no bounds test per row: in [`run_splat`], a
/// row's set-up cost about as much as its four vectors, and NCHW 16x128x7x7 f32
/// forward inference (in L2, one thread) took 2.2 times its copy where NHWC took 1.2.
#[inline(always)]
fn short_rows<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    g: &Geometry,
    row0: usize,
    ins: [&[T]; N],
    out: &mut [T],
    consts: [&[U]; K],
    f: &F,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    let (inner, c, l) = (g.inner, g.channels, S::LANES);
    if out.is_empty() || c == 0 {
        return;
    }
    let rows = out.len() / inner;
    assert!(inner >= l && rows * inner == out.len());
    let first = row0 % c;
    // bf16 narrows by adding, and looks at the constants of the channels the rows have
    // (every channel, where the rows wrap around).
    let s = if T::DTYPE == DType::BF16 {
        let mut touched = consts;
        if first + rows <= c {
            for k in touched.iter_mut() {
                *k = &k[first..first + rows];
            }
        }
        s.plain_nans(&touched)
    } else {
        s
    };
    match s.plain_nans_const::<T>() {
        Some(plain) => short_rows_with(plain, inner, c, first, ins, out, consts, f),
        None => short_rows_with(s, inner, c, first, ins, out, consts, f),
    }
}

/// The loop of [`short_rows`], from channel `ch` (`inner >= LANES`, `out` whole rows).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn short_rows_with<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    inner: usize,
    c: usize,
    mut ch: usize,
    ins: [&[T]; N],
    out: &mut [T],
    consts: [&[U]; K],
    f: &F,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    let l = S::LANES;
    let pairs = T::DTYPE == DType::BF16 && inner >= 2 * l;
    let unit = if pairs { 2 * l } else { l };
    let (whole, overlap) = (inner / unit, !inner.is_multiple_of(unit));
    let rows = out.len() / inner;
    // Every input at least `out.len()` long: `Walk::new` asserts it (`Reads::new`), and
    // `out_base` is the start of the whole of `out`. The last unit of a row may reach
    // past the walk's whole vectors, never past `out.len()`.
    let mut w = Walk::new(l, ins, out);
    assert!(w.reads.lanes_of(s) && unit <= inner);
    let (src, dst) = (w.reads.base(), w.out_base());
    let len = rows * inner;
    for r in 0..rows {
        let mut kv = [U::ZERO; K];
        for (v, k) in kv.iter_mut().zip(&consts) {
            *v = k[ch];
        }
        let k = splat_n(s, kv);
        let at = r * inner;
        for j in 0..whole {
            debug_assert!(at + (j + 1) * unit <= len);
            // SAFETY: `at + (j + 1)·unit <= at + inner <= len`, the length of `out`
            // and at most that of every input (`Walk::new`).
            unsafe { short_unit(s, src, dst, at + j * unit, pairs, k, f) };
        }
        if overlap {
            // SAFETY: `unit <= inner`, so `at + inner − unit` is in the row, and the
            // unit ends at the row's end, `<= len` as above.
            unsafe { short_unit(s, src, dst, at + inner - unit, pairs, k, f) };
        }
        ch = next_cyclic(ch, c);
    }
}

/// One unit of [`short_rows_with`] at element `at`: a vector, or with `pairs` a pair in
/// the ISA's pair order (every lane has the same constants).
///
/// # Safety
/// Every pointer of `src` and `dst` is valid for the unit's elements from `at` (reads,
/// and writes for `dst`), and `dst`'s are not read through `src`.
#[inline(always)]
unsafe fn short_unit<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    src: [*const T; N],
    dst: *mut T,
    at: usize,
    pairs: bool,
    k: [S::V; K],
    f: &F,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    // SAFETY (every access below): the caller's guarantee.
    unsafe {
        if pairs {
            let (a0, b0) = s.load_pair_ptr(src[0].add(at));
            let (mut a, mut b) = ([a0; N], [b0; N]);
            for i in 1..N {
                (a[i], b[i]) = s.load_pair_ptr(src[i].add(at));
            }
            s.store_pair_ptr(dst.add(at), f.eval(s, a, k), f.eval(s, b, k));
        } else {
            let mut v = [s.load_ptr(src[0].add(at)); N];
            for i in 1..N {
                v[i] = s.load_ptr(src[i].add(at));
            }
            s.store_ptr(dst.add(at), f.eval(s, v, k));
        }
    }
}

/// Elements before the first full vector of `out` aligned to `lanes` elements (0 when
/// not streaming).
#[inline(always)]
pub(crate) fn head_len<T>(out: &[T], lanes: usize, stream: bool) -> usize {
    if stream {
        out.as_ptr()
            .align_offset(lanes * size_of::<T>())
            .min(out.len())
            .min(lanes - 1)
    } else {
        0
    }
}

/// The rows of `prefetch` from element `at` on (at most their ends), first in the
/// slots (the loops hint the first `count`), and `count`. (`[None, Some]` had left the
/// row in the second slot, unhinted, and a null pointer in the first, hinted.)
#[inline(always)]
pub(crate) fn prefetch_slots<T>(prefetch: [Option<&[T]>; 2], at: usize) -> ([*const T; 2], usize) {
    let (mut pf, mut count) = ([std::ptr::null(); 2], 0);
    for p in prefetch.into_iter().flatten() {
        pf[count] = p[at.min(p.len())..].as_ptr();
        count += 1;
    }
    (pf, count)
}

/// One contiguous run with the same constants everywhere; `prefetch`: data to bring
/// into L2 meanwhile (see [`splat_body`]); `ahead` (with `stream`, for inputs read from
/// DRAM): each input is also prefetched [`STREAM_AHEAD_BYTES`] ahead of its loads.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn run_splat<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    ins: [&[T]; N],
    out: &mut [T],
    k: [S::V; K],
    stream: bool,
    ahead: bool,
    f: &F,
    prefetch: [Option<&[T]>; 2],
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    let l = S::LANES;
    if !stream && T::DTYPE == DType::BF16 && out.len() > 2 * l && !out.len().is_multiple_of(2 * l) {
        // bf16: the whole pairs, then the last 2·LANES elements as one more pair
        // overlapping the one before (its common elements are written twice with the
        // same values: `out` is not an input, and every lane has the same constants)
        // — where an odd whole vector and a tail took a narrowing and a store each, the
        // costliest steps of a short row with AVX-512 (`vpmovdw` to memory, where a
        // pair takes one `vcvtne2ps2bf16` and a plain store). NCHW 16x512x7x7 (49
        // elements a row), one thread: forward inference 66 -> 53 us. Not for f16,
        // whose pairs are two conversions anyway (one more vector a row: 7 % slower
        // at 14x14), nor f32.
        let (len, pair) = (out.len(), 2 * l);
        let whole = len / pair * pair;
        let (pf, count) = prefetch_slots(prefetch, 0);
        let mut w = Walk::new(l, sub_n(&ins, 0, Some(whole)), &mut out[..whole]);
        splat_dispatch(s, &mut w, k, f, pf, false, count, false);
        let st = len - pair;
        let mut w = Walk::new(l, sub_n(&ins, st, Some(pair)), &mut out[st..]);
        splat_body::<U, S, T, F, N, K, false, 0, false>(s, &mut w, k, f, pf);
        return;
    }
    let head = head_len(out, l, stream);
    if head > 0 {
        let v = f.eval(s, load_partial_n(s, &ins, 0, head), k);
        s.store_partial(&mut out[..head], v);
    }
    let (ins, out) = (sub_n(&ins, head, None), &mut out[head..]);
    let (pf, count) = prefetch_slots(prefetch, head);
    let (at, n) = {
        let mut w = Walk::new(l, ins, &mut *out);
        let stream = stream && w.aligned();
        splat_dispatch(s, &mut w, k, f, pf, stream, count, ahead);
        w.tail()
    };
    if n > 0 {
        if !stream && at + n >= l {
            // The last whole vector of the run, overlapping the one before: its
            // common lanes are written twice with the same values (`out` is not an
            // input, and every lane has the same constants), and no masked load or
            // store is needed (a 7×7 row with 16 lanes: three whole vectors, then
            // this one instead of a masked vector for the 49th element).
            let st = at + n - l;
            let v = load_n(s, &ins, st);
            s.store(&mut out[st..], f.eval(s, v, k));
        } else {
            let v = f.eval(s, load_partial_n(s, &ins, at, n), k);
            s.store_partial(&mut out[at..at + n], v);
        }
    }
}

/// [`splat_body`] with its flags as run-time values: `stream` (non-temporal stores;
/// `w` must be aligned), the number of prefetched inputs (0, 1 or 2) and `ahead` (the
/// inputs prefetched ahead: streamed runs without a prefetched next channel only).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn splat_dispatch<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    w: &mut Walk<'_, T, N>,
    k: [S::V; K],
    f: &F,
    pf: [*const T; 2],
    stream: bool,
    count: usize,
    ahead: bool,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    if !S::HINTS {
        // No streaming stores or prefetches on this ISA: one loop for every case.
        return splat_body::<U, S, T, F, N, K, false, 0, false>(s, w, k, f, pf);
    }
    // bf16 with AVX2 under `Simd::plain_nans`: the loops with the flag as a constant
    // (see `Simd::plain_nans_const`).
    match s.plain_nans_const::<T>() {
        Some(plain) => splat_arms(plain, w, k, f, pf, stream, count, ahead),
        None => splat_arms(s, w, k, f, pf, stream, count, ahead),
    }
}

/// The arms of [`splat_dispatch`] on an ISA with hints.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn splat_arms<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    w: &mut Walk<'_, T, N>,
    k: [S::V; K],
    f: &F,
    pf: [*const T; 2],
    stream: bool,
    count: usize,
    ahead: bool,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    match (stream, count) {
        (true, 0) if ahead => splat_body::<U, S, T, F, N, K, true, 0, true>(s, w, k, f, pf),
        (true, 0) => splat_body::<U, S, T, F, N, K, true, 0, false>(s, w, k, f, pf),
        (false, 0) => splat_body::<U, S, T, F, N, K, false, 0, false>(s, w, k, f, pf),
        (true, 1) => splat_body::<U, S, T, F, N, K, true, 1, false>(s, w, k, f, pf),
        (false, 1) => splat_body::<U, S, T, F, N, K, false, 1, false>(s, w, k, f, pf),
        (true, _) => splat_body::<U, S, T, F, N, K, true, 2, false>(s, w, k, f, pf),
        (false, _) => splat_body::<U, S, T, F, N, K, false, 2, false>(s, w, k, f, pf),
    }
}

/// Whether the next channel's data of element type `T` that a resident pass hints pair
/// by pair ([`splat_body`] with `PF` > 0) is hinted twice a line: where it is 32-bit
/// (a hint at the start of each line and one 32 bytes into it), as a pair of 16-bit
/// AVX2 vectors (half a line) hints it. Measured on the Intel Xeon (2 MiB L2 a core),
/// one build with the second hint switched by an environment variable, NCHW
/// 64x256x56x56 and 64x64x112x112, time ÷ copy, two runs (`scripts/ab.sh 5`, then
/// `scripts/ab.sh 6` in the other order): f32 forward and backward training lower in
/// 15 of 16 cells (forward training 64x64x112x112 1.070 -> 0.991 and 1.095 -> 1.052 with
/// AVX-512, 1.202 -> 1.107 and 1.147 -> 1.125 with AVX2; backward training
/// 64x256x56x56 AVX-512 1.026 -> 1.005 and 1.030 -> 0.951), where the unchanged 16-bit
/// AVX2 cells of the same runs moved by up to 0.18 either way. 16-bit data with
/// AVX-512 (a pair a line, a second hint there too) was lower in 3 of 8 cells: not
/// taken. Hints are the other way for 16-bit AVX2: one a line there (every other
/// pair) made all 16 of its NCHW and NHWC forward training and inference cells slower
/// (`scripts/ab.sh 5`: NCHW forward training bf16 64x64x112x112 1.348 -> 1.524, NHWC
/// f16 forward inference 64x112x112x64 0.860 -> 0.942), so a pair keeps its hint.
/// On a Zen 4 (2026-12-02, a trial build without the second hint, `scripts/ab.sh 5`,
/// NCHW f32 64x256x56x56, 64x64x112x112 and 16x112x112x64, forward and backward
/// training, both ISAs) 9 of 12 cells were higher without it (backward training AVX2
/// 16x112x112x64 1.148 -> 1.216), the rest lower by at most 0.05: kept on both.
const fn half_line_hints<T>() -> bool {
    size_of::<T>() == 4
}

/// The whole vectors of a run; with `PF` > 0, also a prefetch of the same position of
/// the first `PF` of `pf` (the next channel's data in a resident pass) per vector, so
/// their DRAM reads overlap this run's arithmetic and stores; with `AHEAD`, a prefetch
/// of every input [`STREAM_AHEAD_BYTES`] ahead, per pair of vectors.
#[inline(always)]
fn splat_body<
    U,
    S,
    T,
    F,
    const N: usize,
    const K: usize,
    const STREAM: bool,
    const PF: usize,
    const AHEAD: bool,
>(
    s: S,
    w: &mut Walk<'_, T, N>,
    k: [S::V; K],
    f: &F,
    pf: [*const T; 2],
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    // Two vectors per step, stored together (one narrowing for both where the ISA
    // packs pairs), then an odd last one.
    let total = w.vectors();
    // A pair is loaded and stored in the ISA's pair order (`Simd::pair_even_odd`):
    // every lane has the same constants here, so the order does not matter.
    let ahead = STREAM_AHEAD_BYTES / size_of::<T>();
    // Checked once here, so the loads and stores below carry no check of their own.
    assert!(w.reads.lanes_of(s));
    // Streamed, where the ISA stores a pair whole only from a wider alignment than a
    // vector's (`Simd::pair_stream_align`: 16-bit, 32 bytes with AVX2 and 64 with
    // AVX-512) and the run is not so aligned: its first vector alone, so that every
    // pair after it is. (Not a longer head of ordinary stores: a row's first line then
    // mixed them with non-temporal ones, and NCHW 64x256x56x56 forward inference went
    // from 0.88 to 1.29 of a copy.)
    // (Known at compile time where the alignment is a vector's: those loops are as they
    // were.)
    // Every pair after that first vector then starts at a multiple of the alignment,
    // which is `Simd::cl_stream_align`'s: its stores need no test of their own
    // (`Simd::stream_pair_cl_whole_ptr`).
    let pair_align = s.pair_stream_align::<T>();
    assert!(
        !STREAM
            || pair_align == s.cl_stream_align::<T>()
                && (pair_align == S::LANES || pair_align == 2 * S::LANES)
                && w.aligned()
    );
    let first = usize::from(
        STREAM && pair_align > S::LANES && total > 0 && !w.aligned_to(pair_align * size_of::<T>()),
    );
    if first == 1 {
        for p in &pf[..PF] {
            s.prefetch_ptr(*p);
        }
        let v = f.eval(s, w.load(s, 0), k);
        w.store::<S, STREAM>(s, 0, v);
    }
    for i in 0..(total - first) / 2 {
        let j = first + 2 * i;
        if AHEAD {
            w.reads.prefetch_ahead(s, j, ahead, 2 * S::LANES);
        }
        // SAFETY: `j + 1 < first + 2·((total − first) / 2) <= total`; lanes checked
        // above; streamed, the pair starts at a multiple of `cl_stream_align` elements
        // (asserted above).
        unsafe { splat_pair(s, w, j, k, f, STREAM, &pf[..PF]) };
    }
    if (total - first) % 2 == 1 {
        let j = total - 1;
        for p in &pf[..PF] {
            s.prefetch_ptr(p.wrapping_add(j * S::LANES));
        }
        let v = f.eval(s, w.load(s, j), k);
        w.store::<S, STREAM>(s, j, v);
    }
}

/// Vectors `j` and `j + 1` of `w` written (streamed with `stream`), each line of them
/// hinted in every row of `pf` first: the pair step of [`splat_body`] and of the zip
/// ([`zip_four`]).
///
/// # Safety
/// `j + 1 < w.vectors()` and `w.reads.lanes_of(s)`; with `stream`, the ISA has hints,
/// the output is [`Walk::aligned`] and vector `j` starts at a multiple of
/// `Simd::cl_stream_align` elements.
#[inline(always)]
unsafe fn splat_pair<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    w: &mut Walk<'_, T, N>,
    j: usize,
    k: [S::V; K],
    f: &F,
    stream: bool,
    pf: &[*const T],
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    for p in pf {
        // One hint per line of the pair, not per vector (a pair of 16-bit AVX2
        // vectors is half a line: four hints a line with two prefetched inputs).
        s.prefetch_lines(p.wrapping_add(j * S::LANES), 2 * S::LANES);
        if half_line_hints::<T>() {
            // 32-bit data: a second hint 32 bytes into each line (see
            // `half_line_hints`).
            let half = 32 / size_of::<T>();
            s.prefetch_lines(p.wrapping_add(j * S::LANES + half), 2 * S::LANES - half);
        }
    }
    // SAFETY: `j + 1 < vectors` and the lanes (the caller's guarantee).
    let (x, y) = unsafe { w.reads.load_pair_unchecked(s, j) };
    let (a, b) = (f.eval(s, x, k), f.eval(s, y, k));
    if stream {
        // SAFETY: as for the load, and the alignment (the caller's guarantee).
        unsafe { w.stream_pair_cl_unchecked::<S, true>(s, j, a, b) };
    } else {
        // SAFETY: as for the load.
        unsafe { w.store_pair_unchecked::<S, false>(s, j, a, b) };
    }
}

/// Vectors `j` to `j + 3` of `w` written as two pairs of [`splat_body`] (streamed with
/// `stream`), each with its hints of the same lines of the first `pfs` of `pf` (rows a
/// reduction reads soon): the writes of a pipelined resident pass put into the
/// reduction's loop step by step, so that its loads and these stores mix as in a copy
/// (`fused::RowsBehind`'s zip).
///
/// # Safety
/// `j + 4 <= w.vectors()` and `w.reads.lanes_of(s)`; with `stream`, the ISA has hints,
/// `Simd::pair_stream_align` equals `Simd::cl_stream_align` and is one or two vectors,
/// and vector `j` of the output starts at a multiple of it (as [`splat_body`]'s pairs).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn zip_four<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    w: &mut Walk<'_, T, N>,
    j: usize,
    k: [S::V; K],
    f: &F,
    stream: bool,
    pf: [*const T; 2],
    pfs: usize,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    // bf16 with AVX2 under `Simd::plain_nans`: the flag as a constant, as `splat_dispatch`.
    match s.plain_nans_const::<T>() {
        // SAFETY: the caller's guarantee.
        Some(plain) => unsafe { zip_pairs(plain, w, j, k, f, stream, pf, pfs) },
        // SAFETY: the caller's guarantee.
        None => unsafe { zip_pairs(s, w, j, k, f, stream, pf, pfs) },
    }
}

/// [`zip_four`]'s two pairs.
///
/// # Safety
/// As [`zip_four`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn zip_pairs<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    w: &mut Walk<'_, T, N>,
    j: usize,
    k: [S::V; K],
    f: &F,
    stream: bool,
    pf: [*const T; 2],
    pfs: usize,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    let pf = &pf[..pfs.min(2)];
    for jj in [j, j + 2] {
        // SAFETY: `jj + 1 < j + 4 <= vectors`; lanes (the caller's guarantee); streamed,
        // vector `j` starts at a multiple of `cl_stream_align` elements (the caller's
        // guarantee), and so does `j + 2`.
        unsafe { splat_pair(s, w, jj, k, f, stream, pf) };
    }
}

/// Per-channel constants laid out along a channels-last stream that starts at a pixel
/// boundary: `values[i][j]` is constant `i` of the channel of element `head + j`,
/// repeating every `period` elements; `head_values` covers the `head` elements before.
/// With `pairs`, each whole pair of vectors in the period (`2·lanes` elements from a
/// multiple of `2·lanes`) is laid out in the ISA's pair order instead
/// (`Simd::pair_even_odd`: even elements, then odd ones) for the pair loads, and
/// `single` keeps memory order for single vectors and tails.
struct Pattern<'a, U, const K: usize> {
    period: usize,
    head: usize,
    /// Each of `values`, `single` (with pairs) and `head_values` as `K` rows, one
    /// after the other in one allocation (three allocations per constant cost the
    /// 2x8x8x32 second-order pass, eight constants, a tenth of its time), from the
    /// thread's arena where it is large (see [`PatternBuf`]).
    buf: PatternBuf<'a, U>,
    /// Length of a row of `values` or `single`: `period + lanes`.
    row: usize,
    pairs: bool,
}

impl<'a, U: Real, const K: usize> Pattern<'a, U, K> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        arena: Option<&'a bumpalo::Bump>,
        consts: [&[U]; K],
        c: usize,
        period: usize,
        head: usize,
        lanes: usize,
        pairs: bool,
    ) -> Self {
        // One vector of lanes past the period lets a tail read a whole vector.
        let row = period + lanes;
        let rows = if pairs { 2 * K } else { K };
        // The rows (in memory order, then laid out in pairs below), then with pairs the
        // memory-order copy (`single`), then the head's values; appended, not zeroed
        // first.
        let len = rows * row + K * head;
        let mut buf = if let Some(arena) = arena.filter(|_| len * size_of::<U>() >= ARENA_MIN_BYTES)
        {
            let mut v = bumpalo::collections::Vec::with_capacity_in(len, arena);
            fill(consts, c, (head, row, rows), &mut |part| {
                v.extend_from_slice_copy(part)
            });
            PatternBuf::Arena(v.into_bump_slice_mut())
        } else {
            let mut v = Vec::with_capacity(len);
            fill(consts, c, (head, row, rows), &mut |part| {
                v.extend_from_slice(part)
            });
            PatternBuf::Heap(v)
        };
        let buf_mut: &mut [U] = match &mut buf {
            PatternBuf::Heap(v) => v,
            PatternBuf::Arena(v) => v,
        };
        if pairs {
            let buf = buf_mut;
            // The values repeat every lcm(C, 2·lanes) elements, a whole number of pairs:
            // only the first such stretch is reordered, and copied over the rest of the
            // period (which is repeated to at least 128 elements: at C = 32 with AVX2,
            // four times the work, a tenth of a 2x8x8x32 Ex backward call).
            let base = match lcm(c.max(1), 2 * lanes) {
                b if period.is_multiple_of(b) => b,
                _ => period,
            };
            for v in buf[..K * row].chunks_exact_mut(row) {
                // A copy of each block on the stack (at most 2 × 16 lanes): an
                // allocation per block cost 2x8x8x32 bf16 AVX2 forward inference 0.3 µs.
                let mut memory = [U::ZERO; 32];
                for block in v[..base].chunks_exact_mut(2 * lanes) {
                    let memory = &mut memory[..2 * lanes];
                    memory.copy_from_slice(block);
                    for (i, pair) in memory.chunks_exact(2).enumerate() {
                        block[i] = pair[0];
                        block[lanes + i] = pair[1];
                    }
                }
                for at in (base..period).step_by(base) {
                    v.copy_within(..base, at);
                }
            }
        }
        Pattern {
            period,
            head,
            buf,
            row,
            pairs,
        }
    }

    /// Constant `i` of the element `head + j` at `[i][j]`, `period + lanes` of them, in
    /// pair order where the pattern has pairs.
    fn values(&self) -> [&[U]; K] {
        let (row, buf) = (self.row, self.buf());
        std::array::from_fn(|i| &buf[i * row..][..row])
    }

    fn buf(&self) -> &[U] {
        match &self.buf {
            PatternBuf::Heap(v) => v,
            PatternBuf::Arena(v) => v,
        }
    }

    /// As [`Pattern::values`], in memory order.
    fn single(&self) -> [&[U]; K] {
        let row = self.row;
        let base = if self.pairs { K * row } else { 0 };
        let buf = self.buf();
        std::array::from_fn(|i| &buf[base + i * row..][..row])
    }

    /// The constants of the `head` elements before the pattern.
    fn head_values(&self) -> [&[U]; K] {
        let (row, head) = (self.row, self.head);
        let base = if self.pairs { 2 * K * row } else { K * row };
        let buf = self.buf();
        std::array::from_fn(|i| &buf[base + i * head..][..head])
    }
}

/// Where a [`Pattern`]'s values live: on the heap, or in the thread's arena where they
/// take at least [`ARENA_MIN_BYTES`] (NHWC 4096x1x1x8192 bf16: 192 KiB a task, 128
/// tasks a call). Smaller patterns stay on the heap: from the arena every in-cache
/// NHWC 16x7x7x2048 cell was slower (Zen 3, `scripts/ab.sh 7`, forward inference f32
/// 1.87 of a copy against 1.31 and 1.36 from the heap), for a reason not found.
enum PatternBuf<'a, U> {
    Heap(Vec<U>),
    Arena(&'a mut [U]),
}

/// A [`Pattern`]'s values in the order of its buffer, passed to `push`: `rows / K`
/// times each constant's row of `row` values from channel `head` (in memory order; a
/// second time for the pairs' memory-order copy), then each constant's `head` values.
fn fill<U: Real, const K: usize>(
    consts: [&[U]; K],
    c: usize,
    (head, row, rows): (usize, usize, usize),
    push: &mut impl FnMut(&[U]),
) {
    for _ in 0..rows / K {
        for k in consts {
            cycle(push, &k[..c], head, row);
        }
    }
    for k in consts {
        cycle(push, &k[..c], 0, head);
    }
}

/// Passes `len` elements of `k` repeated cyclically from index `start` to `push`: whole
/// slices, no division per element (this runs once per task, and dominated small
/// tensors).
fn cycle<U: Real>(push: &mut impl FnMut(&[U]), k: &[U], start: usize, len: usize) {
    if k.is_empty() {
        // No channels (no elements either): zeros keep the rows whole.
        for _ in 0..len {
            push(&[U::ZERO]);
        }
        return;
    }
    let (mut i, mut left) = (start % k.len(), len);
    while left > 0 {
        let take = (k.len() - i).min(left);
        push(&k[i..i + take]);
        left -= take;
        i = 0;
    }
}

/// A run of whole pixels with constants from `pattern`: the pattern's period is a whole
/// number of vectors, so the loop runs period by period with no wrap test.
#[inline(always)]
fn periodic<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    pattern: &Pattern<'_, U, K>,
    ins: [&[T]; N],
    out: &mut [T],
    stream: bool,
    f: &F,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    let (l, head) = (S::LANES, pattern.head.min(out.len()));
    let (values, head_values) = (pattern.values(), pattern.head_values());
    let single = pattern.single();
    // The head: under `Simd::cl_stream_align` elements, so up to a few vectors.
    let mut h0 = 0;
    while h0 < head {
        let n = (head - h0).min(l);
        let k = load_partial_n(s, &head_values, h0, n);
        let v = f.eval(s, load_partial_n(s, &ins, h0, n), k);
        s.store_partial(&mut out[h0..h0 + n], v);
        h0 += n;
    }
    let (ins, mut out) = (sub_n(&ins, head, None), &mut out[head..]);
    let consts = Reads::new(l, values, pattern.period);
    let singles = Reads::new(l, single, pattern.period);
    // Streamed from DRAM with at most two inputs: two walks of
    // nearly half the run each in lockstep (see `periodic_two`), a gap of a few units
    // apart (`two_walks`), the gap and the rest as below. Each walk is a whole number of
    // periods and of lines, so the second starts at the pattern's phase 0 and on a
    // line, as the first does. With three inputs (the Ex
    // gradient's dy, x and y: six streams read a thread) bf16 AVX2 was slower (NHWC
    // 64x56x56x256, 1.22 -> 1.67 of a copy, `scripts/ab.sh 3`).
    //
    // The streamed loops decide two things once a run, not once a store: whether every
    // pair starts at a multiple of `Simd::cl_stream_align` (an even number of vectors
    // a period, from an output so aligned: `Simd::stream_pair_cl_whole_ptr`), and
    // whether the bf16 narrowing may skip its NaN test (`Simd::plain_nans_const`).
    // Both tests had stayed in the AVX2 loops, a test and a branch each a store.
    let line = (64 / size_of::<T>()).max(1);
    let unit = lcm(pattern.period, line);
    let whole_at = whole_bytes::<U, S, T>(s);
    let even = consts.vectors().is_multiple_of(2);
    let whole = even && (out.as_ptr() as usize).is_multiple_of(whole_at);
    // Every vector width: f32 with AVX-512 (a vector a line) had kept one walk, which
    // was as fast on the Intel Xeon of 2026-11-29, but on a Sapphire Rapids-class Xeon
    // (2026-12-03, 105 MiB L3) one walk took NHWC f32 forward inference to 0.82-0.92 of
    // a copy where AVX2's two walks took 0.64-0.71 (`scripts/ab.sh 3`; with two walks
    // AVX-512 0.67-0.70, forward training 1.43-1.58 -> 1.18-1.24).
    let two = S::HINTS && stream && whole && N <= 2;
    // The two walks: `[0, half)` and `[half + gap, 2·half + gap)`; the gap between
    // them and the rest after them go through the single walk below.
    let (half, gap) = match two.then(|| two_walks(out.len(), unit, size_of::<T>())) {
        Some(Some(w)) => w,
        _ => (0, 0),
    };
    let mut rest_at = 0;
    let mut gap_out: &mut [T] = &mut [];
    if half > 0 {
        let (first, rest) = out.split_at_mut(half);
        let (between, rest) = rest.split_at_mut(gap);
        let (second, rest) = rest.split_at_mut(half);
        let mut a = Walk::new(l, sub_n(&ins, 0, Some(half)), first);
        let mut b = Walk::new(l, sub_n(&ins, half + gap, Some(half)), second);
        let (walks, reads) = ([&mut a, &mut b], [&consts, &singles]);
        match s.plain_nans_const::<T>() {
            Some(p) => periodic_two::<U, S, T, F, N, K>(p, walks, reads, f),
            None => periodic_two::<U, S, T, F, N, K>(s, walks, reads, f),
        }
        gap_out = between;
        rest_at = 2 * half + gap;
        out = rest;
    }
    // The gap (a whole number of units: no tail), then the rest; each starts at the
    // pattern's phase 0. One loop, so the single walk's code is compiled once.
    let gap_ins = sub_n(&ins, half, None);
    let rest_ins = sub_n(&ins, rest_at, None);
    for (ins, out) in [(gap_ins, gap_out), (rest_ins, out)] {
        if out.is_empty() {
            continue;
        }
        let (at, n) = {
            let mut w = Walk::new(l, ins, &mut *out);
            let reads = [&consts, &singles];
            if S::HINTS && stream && w.aligned() {
                match (even && w.aligned_to(whole_at), s.plain_nans_const::<T>()) {
                    (true, Some(p)) => {
                        periodic_body::<U, S, T, F, N, K, true, true>(p, &mut w, reads, f)
                    }
                    (true, None) => {
                        periodic_body::<U, S, T, F, N, K, true, true>(s, &mut w, reads, f)
                    }
                    (false, Some(p)) => {
                        periodic_body::<U, S, T, F, N, K, true, false>(p, &mut w, reads, f)
                    }
                    (false, None) => {
                        periodic_body::<U, S, T, F, N, K, true, false>(s, &mut w, reads, f)
                    }
                }
            } else {
                match s.plain_nans_const::<T>() {
                    Some(p) => periodic_body::<U, S, T, F, N, K, false, false>(p, &mut w, reads, f),
                    None => periodic_body::<U, S, T, F, N, K, false, false>(s, &mut w, reads, f),
                }
            }
            w.tail()
        };
        if n > 0 {
            let p = at % pattern.period;
            let k = load_partial_n(s, &single, p, n);
            let v = f.eval(s, load_partial_n(s, &ins, at, n), k);
            s.store_partial(&mut out[at..at + n], v);
        }
    }
}

/// The walks of [`periodic_two`] over a run of `len` elements of `size` bytes: `(half,
/// gap)`, the first walk `[0, half)` and the second `[half + gap, 2·half + gap)`, both
/// whole numbers of `unit` elements (whole periods and lines), with the second's bytes
/// as near half a page past the first's as a gap of at most [`GAP_UNITS`] units puts
/// them (the first such gap); `None` where no such gap puts them [`WALK_SKEW_MIN_BYTES`] off a multiple of a
/// page (a unit of whole pages), or the run is under two units.
///
/// Why: the two walks' output, their input and the pass's constants usually sit at the
/// same offsets in their pages (large buffers come from `mmap`, and half of a task was a
/// whole number of pages), so a load of the one walk matched the low 12 address bits
/// of a store of the other still in flight (a 4K alias), and waited for it. The loads
/// of each step come before its stores (see [`periodic_two`]), but with non-temporal
/// stores queued behind DRAM the stores of the steps before are in flight too. On an
/// AMD EPYC Zen 3 (AVX2, 2026-12-01) `perf` put two thirds of the bf16 loop's samples
/// on its loads, and the C model (`scripts/models/two_streams.c SKEW`, time ÷ a
/// memcpy): two walks a page multiple apart 1.22 / 1.19 (4,096 bytes past one), 512,
/// 1,024 or 2,048 bytes off one 0.63 / 0.62 / 0.63, one walk 0.62-0.67.
fn two_walks(len: usize, unit: usize, size: usize) -> Option<(usize, usize)> {
    let unit_bytes = unit * size;
    let mut best: Option<(usize, usize, usize)> = None;
    // Each unit of gap moves the second walk by about half a unit (the walks shrink).
    for k in 0..=GAP_UNITS.min(2 * PAGE / unit_bytes.max(1) + 2) {
        let gap = k * unit;
        let half = len.checked_sub(gap)? / 2 / unit * unit;
        if half == 0 {
            break;
        }
        let apart = (half + gap) * size % PAGE;
        let skew = apart.min(PAGE - apart);
        if best.is_none_or(|(s, _, _)| skew > s) {
            best = Some((skew, half, gap));
        }
    }
    best.and_then(|(skew, half, gap)| (skew >= WALK_SKEW_MIN_BYTES).then_some((half, gap)))
}

/// The most units [`two_walks`] puts between its walks.
const GAP_UNITS: usize = 64;

/// A page, as far as the 4K aliasing of loads and stores goes.
const PAGE: usize = 4096;

/// The least distance from a page multiple that [`two_walks`] takes the walks' bytes
/// apart: past the stores a walk has in flight (the C model: 512 bytes as good as
/// 2,048).
const WALK_SKEW_MIN_BYTES: usize = 512;

/// The loops of [`periodic`] over one walk; `STREAM`: non-temporal stores (the output
/// [`Walk::aligned`]); `WHOLE`: every pair of the non-quad loop starts at a multiple of
/// [`Simd::cl_stream_align`] (the output aligned so, an even number of vectors a period).
#[inline(always)]
fn periodic_body<
    U,
    S,
    T,
    F,
    const N: usize,
    const K: usize,
    const STREAM: bool,
    const WHOLE: bool,
>(
    s: S,
    w: &mut Walk<'_, T, N>,
    [consts, singles]: [&Reads<'_, U, K>; 2],
    f: &F,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    let (total, per) = (w.vectors(), consts.vectors());
    // The ranges of every load and store below, proved once (split-once: an `assert!`
    // per load cost channels-last 16-bit passes about a tenth of their instructions):
    // every run of vectors is at most one period (`per`) long and ends by `total`.
    assert!(w.reads.lanes_of(s) && consts.lanes_of(s) && singles.lanes_of(s));
    assert!(singles.vectors() == per && (per > 0 || total == 0));
    assert!(!WHOLE || (STREAM && per.is_multiple_of(2) && w.aligned_to(whole_bytes::<U, S, T>(s))));
    let ahead = STREAM_AHEAD_BYTES / size_of::<T>();
    let mut j0 = 0;
    let const_bytes = K * per * S::LANES * std::mem::size_of::<U>();
    let quad = if STREAM {
        S::LANES * size_of::<T>() >= 64
    } else {
        const_bytes >= QUAD_CONST_BYTES
    };
    if quad {
        // Four periods at a time, each vector of constants loaded once for the four
        // (K loads per four vectors of x, not per vector): with C in the thousands the
        // constants are K times the size of a pixel and do not stay in L1 beside it
        // ([`QUAD_CONST_BYTES`]).
        // Elementwise, so the bits are the same in any order. Streamed only where each
        // vector is a whole line (f32 with AVX-512): non-temporal stores to four
        // interleaved lines of several vectors each keep partial lines in the
        // write-combining buffers. Intel Xeon, from DRAM, NHWC forward inference, time ÷
        // copy: bf16 AVX2 0.95 -> 1.80, f32 AVX2 0.67 -> 1.11 (64x56x56x256); f32
        // AVX-512 (`scripts/ab.sh 4`, 64x112x112x64 / 64x56x56x256) 0.648 / 0.634 ->
        // 0.611 / 0.625, forward training 1.087 / 1.079 -> 1.069 / 1.057.
        // Not taken: 16-bit elements in cache, where one thread in L2 gained (NHWC
        // 1x64x64x64, f16 AVX2 0.026 -> 0.018 ms) but the ResNet-50 shapes moved both
        // ways (16x7x7x512 bf16 AVX2 forward inference 3.8 -> 3.1 of a copy,
        // 16x14x14x1024 f16 AVX-512 1.03 -> 1.21), too noisy to choose.
        // Tried (2026-12-02, Zen 4), not kept: eight periods a block in cache, halving
        // the constant loads again: `scripts/ab.sh 5`, NHWC 16x7x7x2048 and
        // 16x14x14x1024, the four ops, f32 and bf16, both ISAs, moved cells both ways by
        // up to 1.4 of a copy (forward inference f32 AVX2 16x7x7x2048 1.75 -> 2.67,
        // forward training bf16 AVX-512 16x7x7x2048 7.63 -> 7.40).
        while j0 + 4 * per <= total {
            for i in 0..per / 2 {
                let q = 2 * i;
                // SAFETY (every access of this block): `q + 1 < per`, and vector
                // `j0 + r·per + q + 1 < j0 + 4·per <= total`; lanes checked above.
                let (k0, k1) =
                    unsafe { (consts.load_unchecked(s, q), consts.load_unchecked(s, q + 1)) };
                for r in 0..4 {
                    let j = j0 + r * per + q;
                    if STREAM {
                        // From DRAM (see STREAM_AHEAD_BYTES).
                        w.reads.prefetch_ahead(s, j, ahead, 2 * S::LANES);
                    }
                    let (x, y) = unsafe { w.reads.load_pair_unchecked(s, j) };
                    let (a, b) = (f.eval(s, x, k0), f.eval(s, y, k1));
                    unsafe { w.store_pair_unchecked::<S, STREAM>(s, j, a, b) };
                }
            }
            if per % 2 == 1 {
                let q = per - 1;
                let k = singles.load(s, q);
                for r in 0..4 {
                    let j = j0 + r * per + q;
                    let v = f.eval(s, w.load(s, j), k);
                    w.store::<S, STREAM>(s, j, v);
                }
            }
            j0 += 4 * per;
        }
    }
    while j0 < total {
        // 1 <= m <= per, and j0 + m <= total.
        let m = per.min(total - j0);
        // Pairs in the ISA's pair order, with constants laid out the same way (see
        // `Pattern`), then an odd last vector with constants in memory order.
        for i in 0..m / 2 {
            let q = 2 * i;
            if STREAM {
                // Streamed: the inputs come from DRAM (see STREAM_AHEAD_BYTES).
                w.reads.prefetch_ahead(s, j0 + q, ahead, 2 * S::LANES);
            }
            // SAFETY (every access of this block): `q + 1 < m <= per` and
            // `j0 + q + 1 < j0 + m <= total`; lanes checked above.
            let (x, y) = unsafe { w.reads.load_pair_unchecked(s, j0 + q) };
            let (k0, k1) =
                unsafe { (consts.load_unchecked(s, q), consts.load_unchecked(s, q + 1)) };
            let (a, b) = (f.eval(s, x, k0), f.eval(s, y, k1));
            if STREAM {
                // Aligned: streaming is asked for only after `Walk::aligned`; with
                // `WHOLE`, `j0` and `q` are even and the output is aligned to
                // `cl_stream_align` (checked above).
                unsafe { w.stream_pair_cl_unchecked::<S, WHOLE>(s, j0 + q, a, b) };
            } else {
                unsafe { w.store_pair_unchecked::<S, STREAM>(s, j0 + q, a, b) };
            }
        }
        if m % 2 == 1 {
            let q = m - 1;
            let v = f.eval(s, w.load(s, j0 + q), singles.load(s, q));
            w.store::<S, STREAM>(s, j0 + q, v);
        }
        j0 += m;
    }
}

/// [`periodic_body`], streamed, over two runs of the same whole number of periods at
/// once: each pair of vectors of the one, then the same pair of the other. Two
/// sequential streams a thread keep more lines in flight from DRAM than one (with the
/// prefetch of `STREAM_AHEAD_BYTES` ahead in each): a C model of the bf16 AVX2 pass
/// (NHWC 64x56x56x256, two threads, Intel Xeon; `scripts/models/two_streams.c`) took
/// 1.16 of a `memcpy` with one stream and 1.05 with two, and a plain read of the same
/// bytes 0.65 and 0.50 (`scripts/models/read_streams.c`). Elementwise, so the bits are
/// those of any other order.
///
/// Each step loads the pair of both walks before it stores either. The two walks are
/// half a run apart, x and y usually start at the same offset in their pages (large
/// buffers come from `mmap`), and for the ResNet-50 shapes half a task is a whole
/// number of pages; so with load A, store A, load B the load of B matched the store
/// just made to A in its low 12 address bits: a 4K alias, which the load waits on. With
/// the loads first no load follows a store of the same step, whatever the offsets. On
/// an AMD EPYC (Zen 1, AVX2, 2026-11-30) `perf` put a third of the loop's samples on
/// the instruction after B's load, and the order here took NHWC forward inference
/// (`scripts/ab.sh 3`, time ÷ copy, 64x112x112x64 / 64x56x56x256) bf16 from 1.75 / 1.78
/// to 1.02 / 1.05, f16 1.87 / 1.92 -> 1.12 / 1.14, f32 0.78 / 0.73 -> 0.65 / 0.65; a
/// single walk gave bf16 1.10 / 1.12. (Both builds of that run carried environment
/// switches for the trial; the committed build against the one before it: NHWC forward
/// training 16-bit 2.25-2.31 -> 1.54-1.60, backward training 1.86-2.13 -> 1.44-1.63.)
/// Not measured with AVX-512, whose 16-bit passes take this loop too.
/// On a Zen 3 that order was not enough: the stores of the steps before are in flight
/// too, and the walks now start a gap apart that is no page multiple ([`two_walks`]).
#[inline(always)]
fn periodic_two<U, S, T, F, const N: usize, const K: usize>(
    s: S,
    walks: [&mut Walk<'_, T, N>; 2],
    [consts, singles]: [&Reads<'_, U, K>; 2],
    f: &F,
) where
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    F: VectorFn<N, K>,
{
    let (total, per) = (walks[0].vectors(), consts.vectors());
    // The ranges of every access below, proved once: both walks are `total` vectors,
    // a whole number of periods of an even number `per` of vectors, and start at a
    // multiple of `cl_stream_align` elements, so every pair does.
    assert!(walks.iter().all(|w| {
        w.reads.lanes_of(s) && w.aligned_to(whole_bytes::<U, S, T>(s)) && w.vectors() == total
    }));
    assert!(consts.lanes_of(s) && singles.lanes_of(s) && singles.vectors() == per);
    assert!(per > 0 && per.is_multiple_of(2) && total.is_multiple_of(per));
    let ahead = STREAM_AHEAD_BYTES / size_of::<T>();
    let [wa, wb] = walks;
    for j0 in (0..total).step_by(per) {
        for i in 0..per / 2 {
            let q = 2 * i;
            // SAFETY (every access of this block): `q + 1 < per` and `j0 + q + 1 <
            // j0 + per <= total`; lanes and alignment checked above.
            let (k0, k1) =
                unsafe { (consts.load_unchecked(s, q), consts.load_unchecked(s, q + 1)) };
            // Both walks' loads before either walk's stores (see above: the second
            // walk's load after the first walk's store waited on it).
            wa.reads.prefetch_ahead(s, j0 + q, ahead, 2 * S::LANES);
            wb.reads.prefetch_ahead(s, j0 + q, ahead, 2 * S::LANES);
            let (xa, ya) = unsafe { wa.reads.load_pair_unchecked(s, j0 + q) };
            let (xb, yb) = unsafe { wb.reads.load_pair_unchecked(s, j0 + q) };
            let (a, b) = (f.eval(s, xa, k0), f.eval(s, ya, k1));
            unsafe { wa.stream_pair_cl_unchecked::<S, true>(s, j0 + q, a, b) };
            let (a, b) = (f.eval(s, xb, k0), f.eval(s, yb, k1));
            unsafe { wb.stream_pair_cl_unchecked::<S, true>(s, j0 + q, a, b) };
        }
    }
}

/// The bytes a pair that [`Simd::stream_pair_cl_whole_ptr`] stores starts at a multiple
/// of: [`Simd::cl_stream_align`] elements (one rule for the check before the walks are
/// made and the asserts of the loops).
#[inline(always)]
fn whole_bytes<U: Real, S: Simd<U>, T: Element<Stat = U>>(s: S) -> usize {
    s.cl_stream_align::<T>() * size_of::<T>()
}

/// The most bytes of constants a period of lcm(C, 2·lanes) may take; above it the
/// period stays lcm(C, lanes) even when that is an odd number of vectors. At C = 1000
/// with AVX-512 (16-bit, three constants) the doubled period's 48 KiB, past the 32 KiB
/// L1, made NHWC 16384x1x1x1000 slower (Zen 4, `scripts/ab.sh 7`, time ÷ copy: f16
/// forward inference 0.95 -> 1.10, bf16 forward training 1.55 -> 1.90), where C = 200
/// (9.4 KiB) and C = 264 (12.4 KiB) gained.
const PAIR_PERIOD_CONST_BYTES: usize = 16 << 10;

/// The fewest bytes of constants per period for which [`periodic_body`] runs four
/// periods at a time. Measured (Zen 4, 32 KiB L1, f32 forward inference, three
/// constants): C = 2048 (24 KiB) 2x7x7x2048 0.048 -> 0.036 ms, 16x7x7x2048 0.23 -> 0.21
/// ms; C = 1024 (12 KiB, beside the pixels in L1 anyway) 4x14x14x1024 0.108 -> 0.127 ms.
const QUAD_CONST_BYTES: usize = 16 << 10;

/// How far ahead of its loads a streamed elementwise pass (output past the last-level
/// cache, inputs from DRAM) prefetches each input, in bytes: the hardware prefetchers
/// alone kept too few lines in flight. Measured on an Intel Xeon with AVX-512 (2 cores
/// of a VM, 2 threads, `scripts/ab.sh 3`, NCHW 64x256x56x56 forward inference, no
/// prefetch / 2 KiB / 4 KiB / 8 KiB ahead, time ÷ copy): bf16 AVX2 1.40 / 0.96 / 0.96 /
/// 0.94, bf16 AVX-512 1.02 / 0.81 / 0.80 / 0.81, f16 AVX2 1.16 / 0.84 / 0.85 / 0.84,
/// f32 AVX-512 0.77 / 0.66 / 0.63 / 0.63. Not measured on AMD (Zen 3 / Zen 4), whose
/// statistics gained from the same 8 KiB prefetch ([`super::PREFETCH_BYTES`]).
pub(crate) const STREAM_AHEAD_BYTES: usize = super::PREFETCH_BYTES;

/// Least common multiple.
pub(crate) fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn two_walks_are_whole_units_in_the_run_and_off_a_page_apart() {
        for size in [2, 4] {
            for unit in [8, 16, 32, 64, 96, 256, 320, 512, 1024, 1536, 2048, 4096] {
                for len in [
                    0,
                    unit,
                    2 * unit,
                    3 * unit + 5,
                    64 * unit,
                    1 << 18,
                    (1 << 18) + 7,
                ] {
                    let Some((half, gap)) = two_walks(len, unit, size) else {
                        // Only a run of a few units, or a unit of whole pages.
                        let short = len < 64 * unit;
                        assert!(
                            short || (unit * size).is_multiple_of(PAGE),
                            "{len} {unit} {size}"
                        );
                        continue;
                    };
                    assert!(half > 0 && half.is_multiple_of(unit) && gap.is_multiple_of(unit));
                    assert!(2 * half + gap <= len && gap <= GAP_UNITS * unit);
                    let apart = (half + gap) * size % PAGE;
                    assert!(apart.min(PAGE - apart) >= WALK_SKEW_MIN_BYTES);
                }
            }
        }
        // ResNet-50's NHWC bf16 tasks: C = 256 and 64 with AVX2 (units of 256 and 128
        // elements) and tasks of 2^18 elements, each half a whole number of pages.
        for unit in [256, 128] {
            let (half, gap) = two_walks(1 << 18, unit, 2).unwrap();
            assert_eq!((half + gap) * 2 % PAGE, PAGE / 2, "unit {unit}");
        }
    }

    /// The channels-last pass, streamed (the two walks, their gap and the rest) and not,
    /// on every ISA: every element `((x − k0)·k1 + k2)` rounded as the kernel rounds
    /// (each step in `f32`, then narrowed), bit for bit, into an output filled with
    /// NaN first (an element no walk wrote stays NaN).
    fn streamed_affine_is_exact<T: Element<Stat = f32>>() {
        affine_is_exact::<T>(
            &[1, 3, 16, 64, 67, 256, 2048],
            &[0, 1, 33, 700, 2100],
            false,
        );
    }

    /// [`streamed_affine_is_exact`] over `cs` × `pixel_counts`; with `arena`, each case
    /// given a fresh arena, which it must have used (a pattern of at least
    /// [`ARENA_MIN_BYTES`]).
    fn affine_is_exact<T: Element<Stat = f32>>(cs: &[usize], pixel_counts: &[usize], arena: bool) {
        for &c in cs {
            for &pixels in pixel_counts {
                let n = pixels * c;
                let g = Geometry::new(pixels, c, 1);
                let x: Vec<T> = (0..n)
                    .map(|i| T::narrow((i % 1013) as f32 * 0.37 - 150.0))
                    .collect();
                let k: [Vec<f32>; 3] = std::array::from_fn(|j| {
                    (0..c)
                        .map(|ch| (ch % 7) as f32 * 0.3 + j as f32 - 0.9)
                        .collect()
                });
                let want: Vec<T> = x
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        let ch = i % c;
                        T::narrow((v.widen() - k[0][ch]) * k[1][ch] + k[2][ch])
                    })
                    .collect();
                let bits = |v: &[T]| v.iter().map(|e| e.widen().to_bits()).collect::<Vec<_>>();
                for isa in Isa::supported() {
                    for stream in [false, true] {
                        // An offset a 16-bit output's pairs start off 32 bytes at
                        // and one they start on: the walks need the latter.
                        for skip in [0, 1] {
                            let mut buf = vec![T::narrow(f32::NAN); n + 32];
                            let at = buf.as_ptr().align_offset(64) + skip;
                            let out = &mut buf[at..at + n];
                            let bump = bumpalo::Bump::new();
                            let pass = Elementwise {
                                g: &g,
                                row0: 0,
                                ins: [&x[..]],
                                out,
                                consts: [&k[0][..], &k[1][..], &k[2][..]],
                                stream,
                                f: Affine,
                                arena: arena.then_some(&bump),
                            };
                            f32::dispatch(isa, pass);
                            if arena && n > 0 {
                                assert!(bump.allocated_bytes() >= ARENA_MIN_BYTES, "C={c}");
                            }
                            assert_eq!(
                                bits(&buf[at..at + n]),
                                bits(&want),
                                "{isa:?} C={c} pixels={pixels} stream={stream} skip={skip}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The channel-major pass over a chunk of `ins[0].len()` elements from row `row0`
    /// (not streamed), written into a buffer filled with NaN at `skip` elements past a
    /// line; the chunk's output.
    fn into_fresh<T: Element<Stat = f32>, F: VectorFn<N, 3>, const N: usize>(
        isa: Isa,
        g: &Geometry,
        row0: usize,
        ins: [&[T]; N],
        consts: [&[f32]; 3],
        f: F,
        skip: usize,
    ) -> Vec<T> {
        let n = ins[0].len();
        // Room for the line's offset (up to 31 16-bit elements, any number under Miri's
        // allocator) and the skip.
        let mut buf = vec![T::narrow(f32::NAN); n + 64];
        let at = buf.as_ptr().align_offset(64) + skip;
        let pass = Elementwise {
            g,
            row0,
            ins,
            out: &mut buf[at..at + n],
            consts,
            stream: false,
            f,
            arena: None,
        };
        f32::dispatch(isa, pass);
        buf[at..at + n].to_vec()
    }

    /// Channel-major chunks of whole rows (from row `row0`, below and past C, the channel
    /// wrapping around within the chunk or not), every row length from below a vector to
    /// past the short-row limit, with one input (the affine map) and two (a side input
    /// and ReLU), and with a NaN constant whose payload is in the bits bf16 drops (in a
    /// channel the chunk has, or one it has not), on every ISA: bit for bit against the
    /// scalar formula rounded as the kernel rounds (x86 `max` for the ReLU: the NaN
    /// passes), into an output filled with NaN and placed on and off a line. (f16: any
    /// NaN for a NaN, as the hardware and `half` may keep different payload bits.)
    fn channel_major_affine_is_exact<T: Element<Stat = f32>>() {
        let c = 5;
        let longest = 2 * STREAM_ROW_BYTES / size_of::<T>();
        // (Rows of one element are the channels-last layout.)
        let mut inners: Vec<usize> = (2..=70).collect();
        inners.extend([
            95, 96, 97, 127, 128, 196, 255, 256, 257, 511, 512, 513, longest,
        ]);
        let same = |a: &[T], b: &[T]| {
            a.iter().zip(b).all(|(p, q)| {
                let (p, q) = (p.widen(), q.widen());
                p.to_bits() == q.to_bits() || (T::DTYPE == DType::F16 && p.is_nan() && q.is_nan())
            }) && a.len() == b.len()
        };
        for inner in inners {
            let g = Geometry::new(3, c, inner);
            // (row0, rows): wrapping, not, a single row, and from past C.
            for (row0, rows) in [(0, 15), (2, 4), (4, 9), (1, 1), (7, 3), (9, 4)] {
                let n = rows * inner;
                let x: Vec<T> = (0..n)
                    .map(|i| T::narrow((i % 1013) as f32 * 0.37 - 150.0))
                    .collect();
                let side: Vec<T> = (0..n).map(|i| T::narrow((i % 17) as f32 - 8.5)).collect();
                for nan in [None, Some(3), Some(0)] {
                    let mut k: [Vec<f32>; 3] = std::array::from_fn(|j| {
                        (0..c).map(|ch| ch as f32 * 0.3 + j as f32 - 0.9).collect()
                    });
                    if let Some(ch) = nan {
                        k[1][ch] = f32::from_bits(0x7FC0_FFFF);
                    }
                    let affine = |i: usize| {
                        let ch = (row0 + i / inner) % c;
                        (x[i].widen() - k[0][ch]) * k[1][ch] + k[2][ch]
                    };
                    let relu = |v: f32| if 0.0 > v { 0.0 } else { v };
                    let want_side: Vec<T> = (0..n)
                        .map(|i| T::narrow(relu(affine(i) + side[i].widen())))
                        .collect();
                    let want_plain: Vec<T> = (0..n).map(|i| T::narrow(affine(i))).collect();
                    for isa in Isa::supported() {
                        for skip in [0, 1, 3] {
                            let what = format!(
                                "{isa:?} inner={inner} row0={row0} rows={rows} nan={nan:?} skip={skip}"
                            );
                            let consts = [&k[0][..], &k[1][..], &k[2][..]];
                            let ins = [&x[..], &side[..]];
                            let got =
                                into_fresh(isa, &g, row0, ins, consts, AffineSide::<true>, skip);
                            assert!(same(&got, &want_side), "side, ReLU: {what}");
                            let got = into_fresh(isa, &g, row0, [&x[..]], consts, Affine, skip);
                            assert!(same(&got, &want_plain), "affine: {what}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn channel_major_affine_is_exact_f32() {
        channel_major_affine_is_exact::<f32>();
    }

    #[test]
    fn channel_major_affine_is_exact_bf16() {
        channel_major_affine_is_exact::<bf16>();
    }

    #[test]
    fn channel_major_affine_is_exact_f16() {
        channel_major_affine_is_exact::<f16>();
    }

    #[test]
    fn streamed_channels_last_affine_is_exact_f32() {
        streamed_affine_is_exact::<f32>();
    }

    #[test]
    fn streamed_channels_last_affine_is_exact_bf16() {
        streamed_affine_is_exact::<bf16>();
    }

    #[test]
    fn streamed_channels_last_affine_is_exact_f16() {
        streamed_affine_is_exact::<f16>();
    }

    /// Large C, the pattern of constants from the arena (both of its shapes: a period of
    /// C at 12,000 channels, and one pixel at a time at 12,001, whose period with the
    /// lanes is past `MAX_PERIOD`).
    #[test]
    fn channels_last_affine_with_the_pattern_in_the_arena_is_exact() {
        affine_is_exact::<f32>(&[12_000, 12_001], &[1, 3], true);
        affine_is_exact::<bf16>(&[12_000, 12_001], &[1, 3], true);
    }
}
