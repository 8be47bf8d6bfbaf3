//! Whole ops with the fewest trips to memory.
//!
//! - [`forward_training`]: statistics, then `y` (with the Ex epilogue: residual add
//!   and ReLU in the same pass). Channel-major with a channel slice that fits the
//!   core's caches ([`RESIDENT_BYTES`]): each task reduces one channel and
//!   transforms it while it is hot — one DRAM read of x, one write of y. Otherwise two
//!   passes (x is read twice).
//!   Where a channel is at least as many row chunks of the two-pass split as there are
//!   threads, the threads share each channel instead of taking whole ones
//!   ([`cooperative`]): a thread keeps its share of it in its L2, not all of it.
//! - [`backward_training`]: the reduction, then `dx`; resident per channel when dy and
//!   x of a channel fit [`RESIDENT_BYTES`] (shared by the threads as forward), two
//!   passes otherwise. After a ReLU, dy is
//!   masked by the forward `y > 0` on the fly in both passes.
//! - [`backward_inference`]: `dx = dy·k1` needs no reduction first, so the sums and
//!   `dx` come from a single read of dy and x. With `k1 = 1` the same pass writes the
//!   masked dy (the Ex gradient's `side_input_backprop`) while it reduces.
//!
//! The per-channel coefficients are the caller's business (the typed layer's math):
//! the drivers call `coeffs(channel, reduction)` as soon as a channel's reduction is
//! complete.

use std::mem::size_of;
use std::ops::Range;

use super::apply::{run_splat, Affine, AffineRelu, AffineSide, Epilogue, VectorFn};
use super::backward::{
    self, row_sums_out, BackwardFn, BackwardMaskFn, BackwardSums, GradData, Quads,
};
use super::simd::{load_partial_n, splat_n, sub_n, Body, Dispatch, Isa, Kernel, Simd, Walk};
use super::stats::{self, Moments};
use super::{
    apply, channel_tiles, map_items, resident_bytes, scratch, side_resident_streamed,
    ChannelMajorSplit, Geometry, NoPace, Pace, RowOrder, Scratch, TaskRows, Tile, RESIDENT_BYTES,
    TILE,
};
use crate::element::{Element, Real};

mod cooperative;

use cooperative::{run_parts, Claim, Exchange, Plan};

/// The rows of channel `c` at outer index `o` of each input.
#[inline(always)]
fn row_of<'a, T, const N: usize>(
    g: &Geometry,
    ins: &[&'a [T]; N],
    c: usize,
    o: usize,
) -> [&'a [T]; N] {
    let off = (o * g.channels + c) * g.inner;
    sub_n(ins, off, Some(g.inner))
}

/// Outer rows per task of the two-pass channel-major split ([`ChannelMajorSplit::new`]),
/// whose row chunks of a channel are reduced separately and merged in order. The
/// resident passes reduce a channel by the same chunks, so that a result does not
/// depend on whether its channel stayed resident, and the phases API (which reduces
/// with the two-pass split) gives the whole ops' bits.
fn reduction_rows(g: &Geometry) -> usize {
    ChannelMajorSplit::new(g).rows_per_task.max(1)
}

/// The outer-row ranges of one channel's reduction after the first, [`reduction_rows`]
/// each, in order ([`RowChunks::all`] gives the first too). A resident pass reduces the
/// first chunk and merges the others into it ([`InOrder`]), so its result is the
/// two-pass split's (whose tasks merge in the same order).
struct RowChunks {
    next: usize,
    step: usize,
    outer: usize,
}

impl RowChunks {
    /// Every chunk in order: the first (`0..0` alone when the channel has no rows), then
    /// the others.
    fn all(g: &Geometry) -> impl Iterator<Item = Range<usize>> {
        let step = reduction_rows(g);
        let first = 0..step.min(g.outer);
        let rest = RowChunks {
            next: first.end,
            step,
            outer: g.outer,
        };
        std::iter::once(first).chain(rest)
    }
}

impl Iterator for RowChunks {
    type Item = Range<usize>;
    fn next(&mut self) -> Option<Range<usize>> {
        (self.next < self.outer).then(|| {
            let o0 = self.next;
            self.next = (o0 + self.step).min(self.outer);
            o0..self.next
        })
    }
}

/// The results of a channel's [`RowChunks`] merged in chunk order, the first taken as
/// it is (not merged into an empty value: the same bits as the two-pass split's, -0
/// included). One call site of the reduction a pass: the loop over
/// [`RowChunks::all`] feeds it.
struct InOrder<R>(Option<R>);

impl<R> InOrder<R> {
    /// Adds the next chunk's result.
    #[inline(always)]
    fn add(&mut self, next: R, merge: impl FnOnce(R, R) -> R) {
        self.0 = Some(match self.0.take() {
            Some(acc) => merge(acc, next),
            None => next,
        });
    }

    /// The merged result (`empty` before any chunk: not reached, as
    /// [`RowChunks::all`] yields at least one).
    #[inline(always)]
    fn finish(self, empty: R) -> R {
        self.0.unwrap_or(empty)
    }
}

/// [`InOrder`]'s merge of backward sums: added in order.
#[inline(always)]
fn add_sums((sdy, sdx): (f64, f64), (a, b): (f64, f64)) -> (f64, f64) {
    (sdy + a, sdx + b)
}

/// The moments of channel `c` of x by the row chunks of the two-pass split, merged in
/// order (the same bits as the phases' `moments` and the two-pass path), with `pace`
/// between tiles.
#[inline(always)]
fn resident_moments<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    g: &Geometry,
    x: &[T],
    c: usize,
    pace: &mut P,
) -> Moments {
    let mut m = InOrder(None);
    for r in RowChunks::all(g) {
        m.add(
            stats::channel_rows_paced(s, g, x, c, r.start, r.end, pace),
            Moments::merge,
        );
    }
    m.finish(Moments::EMPTY)
}

/// [`resident_moments`] as a function of its own ([`Simd::outline`]).
struct MomentsOf<'r, T, P> {
    g: &'r Geometry,
    x: &'r [T],
    c: usize,
    pace: &'r mut P,
}

impl<T: Element, S: Simd<T::Stat>, P: Pace<S>> Body<S> for MomentsOf<'_, T, P> {
    type Output = Moments;
    #[inline(always)]
    fn run(self, s: S) -> Moments {
        resident_moments(s, self.g, self.x, self.c, self.pace)
    }
}

/// The offset of the row a resident pass over the outer rows `span` prefetches: row `o`
/// of channel `reduced`, or past the span's last row, the row as far into the span of
/// the channel after it (the one the task reduces next). `None` past the tensor. Without the wrap, a channel whose rows
/// make a single reduction tile (14x14 images: 16 rows of 196 elements) prefetched
/// nothing, and NCHW 16x1024x14x14 f32 training took 1.33 of a copy where the
/// reduce-then-write pass, which prefetched the next channel whole, took 1.12–1.16.
#[inline(always)]
fn ahead_row(g: &Geometry, span: &Range<usize>, reduced: usize, o: usize) -> Option<usize> {
    let (c, o) = if o < span.end {
        (reduced, o)
    } else {
        (reduced + 1, o - span.end + span.start)
    };
    (c < g.channels && o < span.end).then(|| (o * g.channels + c) * g.inner)
}

/// The `i`-th outer row of `span` (`i` counted from `span.start`) a pass behind a
/// reduction writes: last first when `reversed`.
///
/// A pipelined pass writes channel `c` while it reduces `c + 1` front to back. In row
/// order, every row of `c` is read again a whole channel of reads after its reduction
/// read it; last row first, the rows read most recently are written first (reuse after
/// 0 to 2 channels of reads, not always 1), and more of them are still in L2 where a
/// channel is a good part of it. `scripts/ab.sh 3`, Intel Xeon (2 MiB L2), NCHW,
/// time ÷ copy, in order / reversed: 64x64x112x112 (1.6 MB of a 16-bit channel)
/// forward training bf16 1.22 -> 1.13 (AVX-512) and 1.47 -> 1.42 (AVX2), f16 1.20 ->
/// 1.11 and 1.41 -> 1.30, f32 1.06 -> 1.02 and 1.11 -> 1.06; backward training bf16
/// 1.24 -> 1.18 and 1.35 -> 1.29, f16 1.18 -> 1.12 and 1.26 -> 1.20; 64x256x56x56
/// within 4 %, mostly faster. The order of the writes changes no result.
#[inline(always)]
fn write_order(span: &Range<usize>, i: usize, reversed: bool) -> usize {
    if reversed {
        span.end - 1 - (i - span.start)
    } else {
        i
    }
}

/// Writes the output rows of a resident channel `c` (from its still-cached input rows)
/// while the reduction of channel `reduced` (the next one) walks the same outer rows:
/// for 32-bit elements four vectors of `c` in each step of that reduction's loop (the
/// zip: [`Pace::step`], [`zips`]), for 16-bit ones after each tile the rows of `c`
/// whose counterparts it has finished (and for either, after a tile, any rows the
/// steps did not reach). The DRAM reads of the next channel then overlap the writes of
/// this one, as in a copy; one after the other (the reduction, then the output while
/// the next channel was prefetched) the reduction waited on reads that the prefetch had
/// not brought into L2 (an Intel Xeon with a 2 MiB L2: the moments of a prefetched 800
/// KB channel took 61 us, 15 us from L2, 98 us from DRAM).
struct RowsBehind<'r, 'a, T, S: Simd<T::Stat>, F, R, const N: usize, const K: usize>
where
    T: Element,
{
    g: &'r Geometry,
    /// The writer's inputs (and the reduction's).
    ins: R,
    rows: &'r mut TaskRows<'a, T>,
    c: usize,
    reduced: usize,
    k: [S::V; K],
    /// The token the rows of `c` are written with: [`Simd::plain_nans`] of `k`.
    w: S,
    /// The outer rows of `c` this pass writes (and of `reduced` it reduces).
    span: Range<usize>,
    /// The next row of `c` to write (an outer row of `span`, counted in row order).
    next: usize,
    stream: bool,
    f: &'r F,
    /// The row of `c` being written vector by vector beside the reduction
    /// ([`Pace::step`]), if any (pipelined only).
    zip: Option<ZipRow<'a, T, S, N, K>>,
    /// Rows ahead of the reduction that the zip's writes prefetch: [`AHEAD_TILES`]
    /// tiles' rows.
    ahead: usize,
}

/// Where a writer behind a reduction ([`RowsBehind`]) finds its input rows, and the
/// inputs of the reduction whose rows its writes prefetch.
trait BehindIns<'a, T, const N: usize> {
    /// The writer's input rows of channel `c` at outer index `o`.
    fn row(&self, g: &Geometry, c: usize, o: usize) -> [&'a [T]; N];
    /// Input `i` (`i < 2`) of the reduction, whose rows the writes prefetch, if any.
    fn reduced(&self, i: usize) -> Option<&'a [T]>;
    /// Whether the writer's last input is one the reduction does not read (the Ex
    /// forward's side input, from DRAM), whose next row each write then prefetches.
    fn unreduced(&self) -> bool;
}

/// Whole tensors, the writer's inputs, of which the reduction reads the first `reads`.
struct Tensors<'r, 'a, T, const N: usize> {
    ins: &'r [&'a [T]; N],
    reads: usize,
}

impl<'a, T, const N: usize> BehindIns<'a, T, N> for Tensors<'_, 'a, T, N> {
    #[inline(always)]
    fn row(&self, g: &Geometry, c: usize, o: usize) -> [&'a [T]; N] {
        row_of(g, self.ins, c, o)
    }

    #[inline(always)]
    fn reduced(&self, i: usize) -> Option<&'a [T]> {
        (i < self.reads.min(N)).then(|| self.ins[i])
    }

    #[inline(always)]
    fn unreduced(&self) -> bool {
        self.reads < N
    }
}

/// The side gradient's `dx` writer's inputs ([`ResidentSide`]): `sg` of channel `c`,
/// its rows taken from the task's rows of `sg` (`rows[o − o0]`, written by the
/// reduction of `c`), and x; the reduction reads dy and x (and the mask).
struct SideIns<'r, 'a, T> {
    sg: &'r [&'a [T]],
    o0: usize,
    dy: &'a [T],
    x: &'a [T],
}

impl<'a, T> BehindIns<'a, T, 2> for SideIns<'_, 'a, T> {
    #[inline(always)]
    fn row(&self, g: &Geometry, c: usize, o: usize) -> [&'a [T]; 2] {
        let [x] = row_of(g, &[self.x], c, o);
        [self.sg[o - self.o0], x]
    }

    #[inline(always)]
    fn reduced(&self, i: usize) -> Option<&'a [T]> {
        [self.dy, self.x].get(i).copied()
    }

    #[inline(always)]
    fn unreduced(&self) -> bool {
        false
    }
}

/// A row of a pipelined pass's output being written four vectors at a time from the
/// reduction's loop ([`RowsBehind`]'s zip): its whole vectors from the first one that
/// may be streamed (`walk`; `j..end` in steps of four, then `end..` one by one), and the
/// elements after them (`tail_*`), written when the row is left.
struct ZipRow<'a, T: Element, S: Simd<T::Stat>, const N: usize, const K: usize> {
    /// The writer's token and constants ([`RowsBehind`]'s `w` and `k`), here so that
    /// the reduction's loop keeps them in its own locals.
    w: S,
    k: [S::V; K],
    walk: Walk<'a, T, N>,
    j: usize,
    end: usize,
    stream: bool,
    /// The rows the writes prefetch, at the walk's start (`pfs` of them).
    pf: [*const T; 2],
    pfs: usize,
    tail_ins: [&'a [T]; N],
    tail_out: &'a mut [T],
}

impl<'r, 'a, T, S, F, R, const N: usize, const K: usize> RowsBehind<'r, 'a, T, S, F, R, N, K>
where
    T: Element,
    S: Simd<T::Stat>,
    F: VectorFn<N, K>,
    R: BehindIns<'a, T, N>,
{
    /// The writer of channel `c`'s rows of `span` (in [`write_order`]: last first where
    /// pipelined), with constants `k`, from `ins`, behind the reduction of channel
    /// `reduced`: the splat constants and their [`Simd::plain_nans`] token derived
    /// here.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn new(
        s: S,
        g: &'r Geometry,
        ins: R,
        rows: &'r mut TaskRows<'a, T>,
        (c, reduced): (usize, usize),
        k: [T::Stat; K],
        span: Range<usize>,
        stream: bool,
        f: &'r F,
    ) -> Self {
        RowsBehind {
            g,
            ins,
            rows,
            c,
            reduced,
            k: splat_n(s, k),
            w: s.plain_nans(&[&k]),
            next: span.start,
            span,
            stream,
            f,
            zip: None,
            ahead: AHEAD_TILES * (TILE / g.inner.max(1)).max(1),
        }
    }

    /// The rows of the reduced channel (of the inputs the reduction reads) and of a
    /// side input that the write of `c`'s row `o` (counted in row order) prefetches;
    /// and the row's index in write order.
    #[inline(always)]
    fn prefetched(&self, o: usize, ahead: usize) -> ([Option<&'a [T]>; 2], usize) {
        let g = self.g;
        let at = ahead_row(g, &self.span, self.reduced, o + ahead);
        let ahead_row =
            |i: usize| at.and_then(|at| self.ins.reduced(i).map(|t| &t[at..][..g.inner]));
        let reversed = self.reduced != self.c;
        // An input the reduction does not read (the Ex forward's side input) comes
        // from DRAM, a row of `c` each write, and rows of a channel are a whole
        // pixel plane of the other channels apart, where no hardware prefetcher
        // follows: the row the next write reads, prefetched during this one (in
        // the slot the reduction leaves free). Zen 4, `scripts/ab.sh 3`, NCHW Ex
        // forward training, time ÷ copy, 64x256x56x56 / 64x64x112x112: bf16
        // AVX-512 1.18 / 1.16 -> 0.99 / 1.00, AVX2 1.36 / 1.13 -> 0.96 / 0.98; f16
        // AVX-512 1.29 / 1.08 -> 1.00 / 1.02, AVX2 1.22 / 1.06 -> 0.98 / 1.01; f32
        // 1.01-1.03 -> 0.92-1.04 (the plain op in the same run: -0.14 to +0.05).
        let side_next = (self.ins.unreduced() && o + 1 < self.span.end).then(|| {
            self.ins
                .row(g, self.c, write_order(&self.span, o + 1, reversed))[N - 1]
        });
        (
            [ahead_row(0), ahead_row(1).or(side_next)],
            write_order(&self.span, o, reversed),
        )
    }

    /// Leaves the zip's row, writing what is left of it. Inline code with no call
    /// (as all of the zip that runs in the reduction's loop): a call there (to an
    /// outlined row change) made the compiler keep the reduction's sums on the stack
    /// across the loop (perf, Zen 4, NCHW 64x64x112x112 f16 forward training with
    /// AVX-512, 1.05 -> 1.83 of a copy).
    #[inline(always)]
    fn zip_finish(&mut self) {
        let Some(mut z) = self.zip.take() else {
            return;
        };
        let (w, k, f) = (z.w, z.k, self.f);
        while z.j < z.end {
            // SAFETY: as in `step`.
            unsafe { apply::zip_four(w, &mut z.walk, z.j, k, f, z.stream, z.pf, z.pfs) };
            z.j += 4;
        }
        for j in z.end..z.walk.vectors() {
            let v = f.eval(w, z.walk.load(w, j), k);
            if z.stream {
                z.walk.store::<S, true>(w, j, v);
            } else {
                z.walk.store::<S, false>(w, j, v);
            }
        }
        if !z.tail_out.is_empty() {
            let n = z.tail_out.len();
            let v = f.eval(w, load_partial_n(w, &z.tail_ins, 0, n), k);
            w.store_partial(z.tail_out, v);
        }
    }

    /// The zip's next row: what is left of the current one written, the next row of
    /// `c` started, its elements before the first vector that may be streamed written
    /// now, as [`run_splat`] writes them: those before a whole vector by an ordinary
    /// store, and where the ISA streams whole pairs only from a wider alignment, a first
    /// vector alone. (A row with no step of four vectors after that is written whole.)
    #[inline(always)]
    fn zip_next(&mut self) {
        self.zip_finish();
        if self.next >= self.span.end {
            return;
        }
        let (g, w, k, f) = (self.g, self.w, self.k, self.f);
        let l = S::LANES;
        let o = self.next;
        self.next += 1;
        let (pf, o) = self.prefetched(o, self.ahead);
        let ins = self.ins.row(g, self.c, o);
        let out = self.rows.take_row(self.c, o);
        let pair = w.pair_stream_align::<T>();
        let can = self.stream
            && S::HINTS
            && pair == w.cl_stream_align::<T>()
            && (pair == l || pair == 2 * l);
        let head = apply::head_len(out, l, can);
        let (head_out, out) = out.split_at_mut(head);
        if head > 0 {
            let v = f.eval(w, load_partial_n(w, &ins, 0, head), k);
            w.store_partial(head_out, v);
        }
        let vectors = out.len() / l;
        let (body_out, tail_out) = out.split_at_mut(vectors * l);
        let mut walk = Walk::new(l, sub_n(&ins, head, Some(vectors * l)), body_out);
        let stream = can && walk.aligned();
        let first = usize::from(
            stream && pair > l && vectors > 0 && !walk.aligned_to(pair * size_of::<T>()),
        );
        if first == 1 {
            let v = f.eval(w, walk.load(w, 0), k);
            walk.store::<S, true>(w, 0, v);
        }
        // The prefetched rows first (`zip_four` hints the first `pfs`).
        let (at, pfs) = apply::prefetch_slots(pf, head);
        self.zip = Some(ZipRow {
            w,
            k,
            walk,
            j: first,
            end: first + (vectors - first) / 4 * 4,
            stream,
            pf: at,
            pfs,
            tail_ins: sub_n(&ins, head + vectors * l, None),
            tail_out,
        });
    }

    /// Writes the rows of `c` up to (not including) outer row `end` (after what is left
    /// of the zip's row, if it has any to write), each prefetching the row of the
    /// reduced channel `ahead` rows further (of each input it reads): the rows its next
    /// tile reads; and of an input it does not read (a side input), the row of `c` the
    /// next write reads. Without the prefetch the reduction's demand loads set the pace
    /// (NCHW 64x256x56x56 forward training f32 1.19 of a copy, bf16 1.49 with AVX-512;
    /// 1.04 and 1.20 with it, one row ahead; two rows: 1.07 and 1.16).
    #[inline(always)]
    fn upto(&mut self, end: usize, ahead: usize) {
        if self.next < end || (end >= self.span.end && self.zip.is_some()) {
            let w = self.w;
            w.outline(Upto {
                behind: self,
                end,
                ahead,
            });
        }
    }

    /// [`RowsBehind::upto`]'s loop, inlined into the function [`Upto`] outlines.
    #[inline(always)]
    fn upto_here(&mut self, end: usize, ahead: usize) {
        self.zip_finish();
        let g = self.g;
        while self.next < end {
            let (pf, o) = self.prefetched(self.next, ahead);
            run_splat(
                self.w,
                self.ins.row(g, self.c, o),
                self.rows.take_row(self.c, o),
                self.k,
                self.stream,
                false,
                self.f,
                pf,
            );
            self.next += 1;
        }
    }
}

/// A resident pass's row writes up to outer row `end` ([`RowsBehind::upto`]) as a
/// function of their own ([`Simd::outline`]): one per pass instead of one per tile
/// pacing and call site.
struct Upto<'b, B> {
    behind: &'b mut B,
    end: usize,
    ahead: usize,
}

impl<'a, T, S, F, R, const N: usize, const K: usize> Body<S>
    for Upto<'_, RowsBehind<'_, 'a, T, S, F, R, N, K>>
where
    T: Element,
    S: Simd<T::Stat>,
    F: VectorFn<N, K>,
    R: BehindIns<'a, T, N>,
{
    type Output = ();
    #[inline(always)]
    fn run(self, _: S) {
        self.behind.upto_here(self.end, self.ahead);
    }
}

impl<'a, T, S, F, R, const N: usize, const K: usize> Pace<S>
    for RowsBehind<'_, 'a, T, S, F, R, N, K>
where
    T: Element,
    S: Simd<T::Stat>,
    F: VectorFn<N, K>,
    R: BehindIns<'a, T, N>,
{
    /// Pipelined, the writes ride in the reduction's steps ([`Pace::step`]); a tile
    /// only catches up rows the steps did not reach (rows of fewer than four vectors
    /// give the reduction no step).
    #[inline(always)]
    fn tile_done(&mut self, _: S, tile: Tile) {
        self.upto(
            tile.rows_done(self.g, self.reduced),
            AHEAD_TILES * tile.count,
        );
    }

    type Zip = Option<ZipRow<'a, T, S, N, K>>;
    const STEPS: bool = zips::<T>();

    #[inline(always)]
    fn zip_take(&mut self) -> Self::Zip {
        self.zip.take()
    }

    #[inline(always)]
    fn zip_put(&mut self, z: Self::Zip) {
        self.zip = z;
    }

    /// Pipelined: four vectors of `c`'s output written beside each step of the reduction
    /// of `c + 1`, whose loads and these stores then mix instruction by instruction as
    /// in a copy (the zip).
    #[inline(always)]
    fn step(&mut self, _: S, z: &mut Self::Zip) {
        if !zips::<T>() {
            return;
        }
        if let Some(r) = z {
            if r.j < r.end {
                // SAFETY: `j + 4 <= end <= vectors` (`end − first` a multiple of 4,
                // `j` stepped by 4 from `first`), the walk made with `S::LANES`; with
                // `stream`, `zip_next` checked the ISA and the alignments, and vector
                // `first` (so every fourth after it) starts at a multiple of
                // `pair_stream_align`.
                unsafe {
                    apply::zip_four(r.w, &mut r.walk, r.j, r.k, self.f, r.stream, r.pf, r.pfs)
                };
                r.j += 4;
                return;
            }
        }
        self.zip = z.take();
        if self.reduced != self.c {
            self.zip_next();
        }
        *z = self.zip.take();
    }
}

/// Whether a pipelined pass over elements of type `T` writes its rows in the
/// reduction's steps (the zip, [`RowsBehind`]'s `step`) rather than after each tile:
/// for 32-bit elements. In the C model `scripts/models/resident_pipe.c` the zip took
/// 0.89 of a memcpy where the walk by tiles took 0.96. In the library (Zen 4,
/// `scripts/ab.sh 5`, NCHW 64x256x56x56 and 64x64x112x112, forward and backward
/// training, time ÷ copy, tiles -> zip): f32 lower in all 8 cells (forward
/// 64x256x56x56 0.894 -> 0.781 with AVX-512 and 0.907 -> 0.784 with AVX2, backward
/// 64x64x112x112 with AVX2 1.219 -> 1.070; mean -0.10 with each ISA), and in 7 of 8
/// and 6 of 8 in two earlier runs. 16-bit, two runs of 16 cells: with AVX2 higher in 8
/// and 3 of 8 (bf16 forward 64x256x56x56 1.085 -> 1.313, mean +0.16 and +0.04); with
/// AVX-512 lower in 3 and 5 of 8 (mean +0.02 and -0.03), higher at 64x256x56x56 in
/// both (bf16 forward 1.012 -> 1.212 in the second). A step of 16-bit data widens and
/// narrows as well as it loads and stores, and AVX2 has 16 vector registers for the
/// reduction's eight sums and the writer's constants: not taken for 16-bit.
const fn zips<T>() -> bool {
    size_of::<T>() == 4
}

/// How many tiles ahead of the reduction a pipelined pass's row writes prefetch the
/// reduced channel's rows ([`RowsBehind::upto`]): a row a written row,
/// `AHEAD_TILES` tiles' rows on. One tile ahead, the prefetches issued during a tile's
/// writes had not landed when the reduction read them. The C model
/// `scripts/models/resident_pipe.c` (Zen 4, NCHW 64x256x56x56 bf16 walk, two threads)
/// put the walk at 7.8 ms with one tile ahead and 6.9 with three (a memcpy of the bytes
/// 7.1; a read of them alone, prefetched, 3.4). In the library (Zen 4, NCHW
/// 64x256x56x56 and 64x64x112x112, forward and backward training, time ÷ copy, one tile
/// -> three, four runs of `scripts/ab.sh` with 5 or 7 rounds): with AVX-512 lower in
/// 12, 8, 6 and 9 of 12 cells (mean -0.09, -0.02, 0.00, -0.03 of a copy; bf16 forward
/// 64x256x56x56 1.16 -> 1.00 and f16 backward 1.29 -> 1.06 in the first), with AVX2 in
/// 8 and 6 of 12 (-0.02, +0.01): a small gain with AVX-512, even with AVX2. Six tiles
/// were no better than three; the Ex ops moved within the noise (±0.06). On the
/// pipelined ResNet-50 shapes at batch 16 (`scripts/ab.sh 3` and `7`): 16x64x56x56 and
/// 16x64x112x112 lower in 7 of 8 cells each, but 16x256x56x56, whose 16-row channels
/// make three tiles ahead more than a third of the next channel, higher in 9 of 12
/// (16-bit backward by 0.04-0.06). A distance in bytes might serve both; not tried.
const AHEAD_TILES: usize = 3;

/// The pace of a shared pass's reduction of channel `c + 1`: the rows of `c` written
/// behind it ([`RowsBehind`], made by `make` from `c`'s exchanged reduction) from the
/// first tile after every part has published `c`, not after a wait for it before the
/// reduction starts. A part that finished its share of `c` before the others goes on
/// reducing instead of spinning: on a Zen 4 (2 threads, NCHW 64x64x112x112 bf16
/// forward training) the wait had taken about a tenth of the op (`perf`).
struct WhenPublished<'e, B, M> {
    ex: &'e Exchange,
    c: usize,
    make: Option<M>,
    behind: Option<B>,
}

impl<'e, B, M: FnOnce() -> B> WhenPublished<'e, B, M> {
    fn new(ex: &'e Exchange, c: usize, make: M) -> Self {
        WhenPublished {
            ex,
            c,
            make: Some(make),
            behind: None,
        }
    }

    /// The writer of `c`'s rows, made now (waiting for `c`) if no tile made it. (Always
    /// one: `make` is taken only to fill `behind`.)
    fn into_behind(self) -> Option<B> {
        self.behind.or_else(|| self.make.map(|make| make()))
    }
}

impl<S, B: Pace<S>, M: FnOnce() -> B> Pace<S> for WhenPublished<'_, B, M> {
    type Zip = B::Zip;
    const STEPS: bool = B::STEPS;

    #[inline(always)]
    fn zip_take(&mut self) -> B::Zip {
        self.behind
            .as_mut()
            .map(|b| b.zip_take())
            .unwrap_or_default()
    }

    #[inline(always)]
    fn zip_put(&mut self, z: B::Zip) {
        if let Some(b) = &mut self.behind {
            b.zip_put(z);
        }
    }

    #[inline(always)]
    fn tile_done(&mut self, s: S, tile: Tile) {
        if self.behind.is_none() && self.ex.published(self.c) {
            self.behind = self.make.take().map(|make| make());
        }
        if let Some(b) = &mut self.behind {
            b.tile_done(s, tile);
        }
    }

    #[inline(always)]
    fn step(&mut self, s: S, z: &mut B::Zip) {
        if let Some(b) = &mut self.behind {
            b.step(s, z);
        }
    }
}

/// Forward training over a group of L2-resident channels: the moments of the first
/// channel, then for each channel its output from the still-cached rows while the next
/// channel is reduced ([`RowsBehind`]).
struct ResidentForward<'a, T: Element, C, F, const N: usize> {
    g: &'a Geometry,
    ins: [&'a [T]; N],
    rows: TaskRows<'a, T>,
    coeffs: &'a C,
    stream: bool,
    /// Whether a channel is written while the next is reduced ([`Geometry::pipelined`]).
    pipelined: bool,
    f: F,
}

impl<T: Element, C, F, const N: usize> Kernel<T::Stat> for ResidentForward<'_, T, C, F, N>
where
    C: Fn(usize, Moments) -> [T::Stat; 3],
    F: VectorFn<N, 3>,
{
    type Output = Vec<Moments>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<Moments> {
        let (g, mut rows) = (self.g, self.rows);
        let t = rows.task;
        let x = self.ins[0];
        let mut out = Vec::with_capacity(t.c1 - t.c0);
        let pipe = self.pipelined;
        let mut m = s.outline(MomentsOf {
            g,
            x,
            c: t.c0,
            pace: &mut NoPace,
        });
        for c in t.c0..t.c1 {
            let more = c + 1 < t.c1;
            let k = (self.coeffs)(c, m);
            let mut behind = RowsBehind::new(
                s,
                g,
                Tensors {
                    ins: &self.ins,
                    reads: 1,
                },
                &mut rows,
                (c, if pipe { c + 1 } else { c }),
                k,
                0..g.outer,
                self.stream,
                &self.f,
            );
            let next = if more && pipe {
                s.outline(MomentsOf {
                    g,
                    x,
                    c: c + 1,
                    pace: &mut behind,
                })
            } else {
                Moments::EMPTY
            };
            // Unpipelined, each row of `c` prefetches the same row of `c + 1`.
            behind.upto(g.outer, if pipe { 1 } else { g.outer });
            out.push(m);
            m = if more && !pipe {
                s.outline(MomentsOf {
                    g,
                    x,
                    c: c + 1,
                    pace: &mut NoPace,
                })
            } else {
                next
            };
        }
        if self.stream {
            s.fence();
        }
        out
    }
}

/// Backward training over a group of L2-resident channels: for each channel, its sums,
/// then `dx` from the still-cached rows of `ins` = dy, x (and the mask y).
struct ResidentBackward<'a, T: Element, C, F, const N: usize> {
    g: &'a Geometry,
    ins: [&'a [T]; N],
    mean: &'a [T::Stat],
    rows: TaskRows<'a, T>,
    coeffs: &'a C,
    stream: bool,
    /// Whether a channel is written while the next is reduced ([`Geometry::pipelined`]).
    pipelined: bool,
    f: F,
}

impl<T: Element, C, F, const N: usize> Kernel<T::Stat> for ResidentBackward<'_, T, C, F, N>
where
    C: Fn(usize, f64, f64) -> [T::Stat; 3],
    F: VectorFn<N, 4>,
{
    type Output = Vec<(f64, f64)>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<(f64, f64)> {
        let (g, mut rows) = (self.g, self.rows);
        let t = rows.task;
        let (dy, x, mask) = (self.ins[0], self.ins[1], self.ins.get(2).copied());
        let data = GradData { dy, mask, x };
        let mut out = Vec::with_capacity(t.c1 - t.c0);
        let pipe = self.pipelined;
        let mean = self.mean;
        let mut sums = s.outline(SumsOf {
            g,
            data,
            mean,
            c: t.c0,
            pace: &mut NoPace,
        });
        for c in t.c0..t.c1 {
            let more = c + 1 < t.c1;
            let [dm, k1, k2] = (self.coeffs)(c, sums.0, sums.1);
            let k = [dm, self.mean[c], k1, k2];
            let mut behind = RowsBehind::new(
                s,
                g,
                Tensors {
                    ins: &self.ins,
                    reads: 2,
                },
                &mut rows,
                (c, if pipe { c + 1 } else { c }),
                k,
                0..g.outer,
                self.stream,
                &self.f,
            );
            let next = if more && pipe {
                s.outline(SumsOf {
                    g,
                    data,
                    mean,
                    c: c + 1,
                    pace: &mut behind,
                })
            } else {
                (0.0, 0.0)
            };
            behind.upto(g.outer, if pipe { 1 } else { g.outer });
            out.push(sums);
            sums = if more && !pipe {
                s.outline(SumsOf {
                    g,
                    data,
                    mean,
                    c: c + 1,
                    pace: &mut NoPace,
                })
            } else {
                next
            };
        }
        if self.stream {
            s.fence();
        }
        out
    }
}

/// The backward sums of channel `c` by the row chunks of the two-pass split, added in
/// order (see [`resident_moments`]), with `pace` between tiles.
#[inline(always)]
fn resident_sums<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    g: &Geometry,
    data: GradData<'_, T>,
    mean: &[U],
    c: usize,
    pace: &mut P,
) -> (f64, f64) {
    let mut sums = InOrder(None);
    for r in RowChunks::all(g) {
        sums.add(
            backward::channel_rows_paced(s, g, data, mean[c], c, r, pace),
            add_sums,
        );
    }
    sums.finish((0.0, 0.0))
}

/// [`resident_sums`] as a function of its own ([`Simd::outline`]).
struct SumsOf<'r, 'a, T: Element, P> {
    g: &'r Geometry,
    data: GradData<'a, T>,
    mean: &'r [T::Stat],
    c: usize,
    pace: &'r mut P,
}

impl<T: Element, S: Simd<T::Stat>, P: Pace<S>> Body<S> for SumsOf<'_, '_, T, P> {
    type Output = (f64, f64);
    #[inline(always)]
    fn run(self, s: S) -> (f64, f64) {
        resident_sums(s, self.g, self.data, self.mean, self.c, self.pace)
    }
}

/// This part's chunks of channel `c` of x reduced and published to `ex`, with `pace`
/// between tiles.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn share_moments<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    g: &Geometry,
    x: &[T],
    c: usize,
    plan: &Plan,
    part: usize,
    ex: &Exchange,
    pace: &mut P,
) {
    for (k, r) in plan.chunks_of(g, part) {
        let m = stats::channel_rows_paced(s, g, x, c, r.start, r.end, pace);
        ex.put(c, k, [m.count, m.mean, m.m2]);
    }
    ex.done(c);
}

/// Channel `c`'s moments once every part has published it: its chunks merged in order,
/// as [`resident_moments`] merges them.
fn shared_moments(ex: &Exchange, c: usize) -> Moments {
    ex.wait(c);
    let chunk = |k| {
        let [count, mean, m2] = ex.get(c, k);
        Moments { count, mean, m2 }
    };
    (1..ex.chunks()).fold(chunk(0), |m, k| m.merge(chunk(k)))
}

/// This part's chunks of channel `c`'s backward sums, published to `ex`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn share_sums<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    g: &Geometry,
    data: GradData<'_, T>,
    mean: &[U],
    c: usize,
    plan: &Plan,
    part: usize,
    ex: &Exchange,
    pace: &mut P,
) {
    for (k, r) in plan.chunks_of(g, part) {
        let (a, b) = backward::channel_rows_paced(s, g, data, mean[c], c, r, pace);
        ex.put(c, k, [a, b, 0.0]);
    }
    ex.done(c);
}

/// Channel `c`'s backward sums once every part has published it, added in chunk order
/// as [`resident_sums`] adds them.
fn shared_sums(ex: &Exchange, c: usize) -> (f64, f64) {
    ex.wait(c);
    let [a, b, _] = ex.get(c, 0);
    (1..ex.chunks()).fold((a, b), |(sa, sb), k| {
        let [a, b, _] = ex.get(c, k);
        (sa + a, sb + b)
    })
}

/// One part of a forward training pass shared by the threads ([`cooperative`]): its
/// outer rows of every channel, each channel written from them while the next one's
/// share is reduced, after the parts have exchanged its reductions.
struct SharedForward<'a, T: Element, C, F, const N: usize> {
    g: &'a Geometry,
    ins: [&'a [T]; N],
    rows: TaskRows<'a, T>,
    coeffs: &'a C,
    stream: bool,
    f: F,
    plan: Plan,
    part: usize,
    ex: &'a Exchange,
}

impl<T: Element, C, F, const N: usize> Kernel<T::Stat> for SharedForward<'_, T, C, F, N>
where
    C: Fn(usize, Moments) -> [T::Stat; 3],
    F: VectorFn<N, 3>,
{
    type Output = Vec<Moments>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<Moments> {
        let (g, mut rows, ex) = (self.g, self.rows, self.ex);
        let (plan, part, x) = (&self.plan, self.part, self.ins[0]);
        let span = rows.task.o0..rows.task.o1;
        let rows_end = span.end;
        let mut out = Vec::with_capacity(g.channels);
        if g.channels == 0 {
            return out;
        }
        share_moments(s, g, x, 0, plan, part, ex, &mut NoPace);
        for c in 0..g.channels {
            let more = c + 1 < g.channels;
            let rows = &mut rows;
            let (ins, f, span) = (&self.ins, &self.f, span.clone());
            let (coeffs, stream) = (self.coeffs, self.stream);
            let mut behind = WhenPublished::new(ex, c, move || {
                let k = coeffs(c, shared_moments(ex, c));
                let ins = Tensors { ins, reads: 1 };
                RowsBehind::new(s, g, ins, rows, (c, c + 1), k, span, stream, f)
            });
            if more {
                share_moments(s, g, x, c + 1, plan, part, ex, &mut behind);
            }
            if let Some(mut behind) = behind.into_behind() {
                behind.upto(rows_end, 1);
            }
            out.push(shared_moments(ex, c));
        }
        if self.stream {
            s.fence();
        }
        out
    }
}

/// One part of a backward training pass shared by the threads (see [`SharedForward`]).
struct SharedBackward<'a, T: Element, C, F, const N: usize> {
    g: &'a Geometry,
    ins: [&'a [T]; N],
    mean: &'a [T::Stat],
    rows: TaskRows<'a, T>,
    coeffs: &'a C,
    stream: bool,
    f: F,
    plan: Plan,
    part: usize,
    ex: &'a Exchange,
}

impl<T: Element, C, F, const N: usize> Kernel<T::Stat> for SharedBackward<'_, T, C, F, N>
where
    C: Fn(usize, f64, f64) -> [T::Stat; 3],
    F: VectorFn<N, 4>,
{
    type Output = Vec<(f64, f64)>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<(f64, f64)> {
        let (g, mut rows, ex) = (self.g, self.rows, self.ex);
        let (plan, part) = (&self.plan, self.part);
        let (dy, x, mask) = (self.ins[0], self.ins[1], self.ins.get(2).copied());
        let data = GradData { dy, mask, x };
        let span = rows.task.o0..rows.task.o1;
        let rows_end = span.end;
        let mut out = Vec::with_capacity(g.channels);
        if g.channels == 0 {
            return out;
        }
        share_sums(s, g, data, self.mean, 0, plan, part, ex, &mut NoPace);
        for c in 0..g.channels {
            let more = c + 1 < g.channels;
            let rows = &mut rows;
            let (ins, f, span) = (&self.ins, &self.f, span.clone());
            let (coeffs, stream, mean) = (self.coeffs, self.stream, self.mean);
            let mut behind = WhenPublished::new(ex, c, move || {
                let (a, b) = shared_sums(ex, c);
                let [dm, k1, k2] = coeffs(c, a, b);
                let k = [dm, mean[c], k1, k2];
                let ins = Tensors { ins, reads: 2 };
                RowsBehind::new(s, g, ins, rows, (c, c + 1), k, span, stream, f)
            });
            if more {
                share_sums(s, g, data, self.mean, c + 1, plan, part, ex, &mut behind);
            }
            if let Some(mut behind) = behind.into_behind() {
                behind.upto(rows_end, 1);
            }
            out.push(shared_sums(ex, c));
        }
        if self.stream {
            s.fence();
        }
        out
    }
}

/// Forward pass in training mode: per-channel moments of `x`, then
/// `y = act((x − k[0])·k[1] + k[2] + side)` with `k = coeffs(c, moments[c])`.
/// Returns the moments.
pub fn forward_training<T: Element>(
    g: &Geometry,
    isa: Isa,
    x: &[T],
    epi: Epilogue<'_, T>,
    y: &mut [T],
    coeffs: impl Fn(usize, Moments) -> [T::Stat; 3] + Sync + Send,
) -> Vec<Moments> {
    let size = size_of::<T>();
    if g.resident(size, 1, RESIDENT_BYTES) {
        match (epi.side, epi.relu) {
            (None, false) => resident_forward(g, isa, [x], y, &coeffs, Affine),
            (None, true) => resident_forward(g, isa, [x], y, &coeffs, AffineRelu),
            (Some(side), false) => {
                resident_forward(g, isa, [x, side], y, &coeffs, AffineSide::<false>)
            }
            (Some(side), true) => {
                resident_forward(g, isa, [x, side], y, &coeffs, AffineSide::<true>)
            }
        }
    } else {
        // Tried: this output pass's tasks (and the two-pass gradients' dx pass's) last
        // first, so that it re-reads first what the reduction read last. On the Intel
        // Xeon (2 MiB L2 a core, a VM's share of a large L3; `scripts/ab.sh 5`, NHWC,
        // AVX-512, 64x56x56x256 and 64x112x112x64, f32/bf16/f16) the 16-bit cells were
        // 0.01-0.06 of a copy slower (forward training f16 64x112x112x64 1.335 -> 1.374,
        // backward training bf16 1.281 -> 1.338), f32 within 0.03; so memory order.
        // Tried too (2026-11-30): the reduction's tasks last first instead, the output
        // pass in memory order (results merged in task order: the same bits), so that
        // each pass starts where the one before ended. Same machine, `scripts/ab.sh 3`,
        // NHWC 64x112x112x64: forward training bf16 AVX2 1.65 -> 2.02, AVX-512 1.29 ->
        // 1.50, f16 AVX-512 1.20 -> 1.42, f32 AVX-512 1.15 -> 1.27; backward training
        // within 0.06. Not kept. The output pass last first again on a Zen 3 (32 MiB
        // L3, a victim cache; 2026-12-02, 25 interleaved rounds in one process, NHWC,
        // time ÷ copy): 64x56x56x256 bf16 1.23 -> 1.21, f32 1.12 -> 1.16;
        // 64x112x112x64 bf16 1.20 -> 1.20, f32 1.13 -> 1.11. No gain there either.
        let moments = stats::channel_moments(g, isa, x);
        let k = Columns::new(g.channels, |c| coeffs(c, moments[c]));
        apply::affine(g, isa, x, k.get(), epi, y);
        moments
    }
}

fn resident_forward<T: Element, C, F, const N: usize>(
    g: &Geometry,
    isa: Isa,
    ins: [&[T]; N],
    y: &mut [T],
    coeffs: &C,
    f: F,
) -> Vec<Moments>
where
    C: Fn(usize, Moments) -> [T::Stat; 3] + Sync + Send,
    F: VectorFn<N, 3> + Copy + Send + Sync,
{
    let stream = g.stream_resident(size_of::<T>());
    let pipelined = g.pipelined(size_of::<T>());
    resident_pass(
        g,
        pipelined,
        y,
        |plan, part, rows, ex| {
            T::Stat::dispatch(
                isa,
                SharedForward {
                    g,
                    ins,
                    rows,
                    coeffs,
                    stream,
                    f,
                    plan,
                    part,
                    ex,
                },
            )
        },
        |rows| {
            T::Stat::dispatch(
                isa,
                ResidentForward {
                    g,
                    ins,
                    rows,
                    coeffs,
                    stream,
                    pipelined,
                    f,
                },
            )
        },
    )
}

/// A channel-major training pass over channels kept in cache, writing `out`: shared
/// between the threads (`shared(plan, part, rows, exchange)` on every pool thread, each
/// part returning every channel's result) where the pass is pipelined, its channels
/// are several row chunks ([`Plan`]) and no other shared pass runs ([`Claim`]); else,
/// or where a pool thread did not come ([`run_parts`]), whole channels on each thread
/// (`whole(rows)` per task, their results in channel order).
fn resident_pass<T: Element, R: Send>(
    g: &Geometry,
    pipelined: bool,
    out: &mut [T],
    shared: impl for<'r> Fn(Plan, usize, TaskRows<'r, T>, &Exchange) -> Vec<R> + Sync,
    whole: impl for<'r> Fn(TaskRows<'r, T>) -> Vec<R> + Sync + Send,
) -> Vec<R> {
    if let (true, Some(plan)) = (pipelined, Plan::new(g)) {
        if let Some(_claim) = Claim::take() {
            let ex = Exchange::new(g, &plan);
            let parts = run_parts(&ex, plan.rows_mut(g, out), |part, rows| {
                shared(plan, part, rows, &ex)
            });
            if let Some(first) = parts.and_then(|p| p.into_iter().next()) {
                return first;
            }
        }
    }
    let split = ChannelMajorSplit::whole_channels(g, pipelined);
    let per_task = map_items(g, split.rows_mut(g, out), |_, rows| whole(rows));
    per_task.into_iter().flatten().collect()
}

/// Gradient in training mode: the backward sums, then
/// `dx = (dy − k[0])·k[1] + (x − mean)·k[2]` with `k = coeffs(c, Σdy, Σdy·(x − mean))`;
/// with `mask` (the forward `y` of a ReLU) dy counts only where `mask > 0`.
pub fn backward_training<T: Element>(
    g: &Geometry,
    isa: Isa,
    data: GradData<'_, T>,
    mean: &[T::Stat],
    dx: &mut [T],
    coeffs: impl Fn(usize, f64, f64) -> [T::Stat; 3] + Sync + Send,
) -> BackwardSums {
    let GradData { dy, mask, x } = data;
    let size = size_of::<T>();
    let inputs = if mask.is_some() { 3 } else { 2 };
    if g.resident(size, inputs, RESIDENT_BYTES) {
        let per = match mask {
            None => resident_backward(g, isa, [dy, x], mean, dx, &coeffs, BackwardFn),
            Some(y) => resident_backward(g, isa, [dy, x, y], mean, dx, &coeffs, BackwardMaskFn),
        };
        BackwardSums::from_pairs(&per)
    } else {
        let sums = backward::reduce(g, isa, data, mean);
        let k = Columns::new(g.channels, |c| coeffs(c, sums.sum_dy[c], sums.sum_dy_xc[c]));
        let [dm, k1, k2] = k.get();
        backward::apply(g, isa, data, [dm, mean, k1, k2], dx);
        sums
    }
}

fn resident_backward<T: Element, C, F, const N: usize>(
    g: &Geometry,
    isa: Isa,
    ins: [&[T]; N],
    mean: &[T::Stat],
    dx: &mut [T],
    coeffs: &C,
    f: F,
) -> Vec<(f64, f64)>
where
    C: Fn(usize, f64, f64) -> [T::Stat; 3] + Sync + Send,
    F: VectorFn<N, 4> + Copy + Send + Sync,
{
    let stream = g.stream_resident(size_of::<T>());
    let pipelined = g.pipelined(size_of::<T>());
    resident_pass(
        g,
        pipelined,
        dx,
        |plan, part, rows, ex| {
            T::Stat::dispatch(
                isa,
                SharedBackward {
                    g,
                    ins,
                    mean,
                    rows,
                    coeffs,
                    stream,
                    f,
                    plan,
                    part,
                    ex,
                },
            )
        },
        |rows| {
            T::Stat::dispatch(
                isa,
                ResidentBackward {
                    g,
                    ins,
                    mean,
                    rows,
                    coeffs,
                    stream,
                    pipelined,
                    f,
                },
            )
        },
    )
}

/// Gradient in inference mode: `dx = dy·k1[c]` and the backward sums (with `mean`), in
/// one read of dy and x; with `mask`, dy counts only where `mask > 0` (and with
/// `k1 = 1`, `dx` receives the masked dy itself).
pub fn backward_inference<T: Element>(
    g: &Geometry,
    isa: Isa,
    data: GradData<'_, T>,
    mean: &[T::Stat],
    k1: &[T::Stat],
    dx: &mut [T],
) -> BackwardSums {
    if g.channels_last() {
        let stream = g.stream(size_of::<T>());
        backward::pixel_task_sums(g, isa, data, mean, Some((dx, k1)), stream, Quads::No)
    } else {
        if g.is_empty() {
            // Nothing to walk (and rows of no elements have no plane to find an image
            // by: `channel_rows_out` divides by it).
            return BackwardSums::zeros(g.channels);
        }
        let size = size_of::<T>();
        let walk = if g.rows_in_image_order(size) {
            RowOrder::Images
        } else {
            RowOrder::Channels
        };
        inference_rows(g, isa, data, mean, k1, dx, walk)
    }
}

/// [`backward_inference`] of a channel-major tensor, its rows walked in the order
/// `walk` (the tests run every order on tensors of any size).
fn inference_rows<T: Element>(
    g: &Geometry,
    isa: Isa,
    data: GradData<'_, T>,
    mean: &[T::Stat],
    k1: &[T::Stat],
    dx: &mut [T],
    walk: RowOrder,
) -> BackwardSums {
    let GradData { dy, mask, x } = data;
    let split = ChannelMajorSplit::new(g);
    let rows = split.rows_mut(g, dx);
    let stream = g.stream(size_of::<T>());
    let partials = map_items(g, rows, |_, rows| {
        T::Stat::dispatch(
            isa,
            InferenceRows {
                g,
                dy,
                mask,
                x,
                mean,
                k1,
                rows,
                stream,
                walk,
            },
        )
    });
    let per = split.merge(g, partials, |a, b| (a.0 + b.0, a.1 + b.1));
    BackwardSums::from_pairs(&per)
}

/// The inference gradient over one task of a channel-major split: per channel, sums
/// flushed to `f64` after each tile of `channel_tiles`, and `dx = dy·k1`.
struct InferenceRows<'a, T: Element> {
    g: &'a Geometry,
    dy: &'a [T],
    mask: Option<&'a [T]>,
    x: &'a [T],
    mean: &'a [T::Stat],
    k1: &'a [T::Stat],
    rows: TaskRows<'a, T>,
    stream: bool,
    walk: RowOrder,
}

impl<T: Element> Kernel<T::Stat> for InferenceRows<'_, T> {
    type Output = Vec<(f64, f64)>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<(f64, f64)> {
        match self.walk {
            RowOrder::Channels => self.channels(s),
            RowOrder::Images => self.images(s),
        }
    }
}

impl<T: Element> InferenceRows<'_, T> {
    /// The sums of each channel of the task, its `dx` written, channel by channel.
    #[inline(always)]
    fn channels<S: Simd<T::Stat>>(self, s: S) -> Vec<(f64, f64)> {
        let (g, mut rows) = (self.g, self.rows);
        let t = rows.task;
        let data = GradData {
            dy: self.dy,
            mask: self.mask,
            x: self.x,
        };
        let mut out = Vec::with_capacity(t.c1 - t.c0);
        for c in t.c0..t.c1 {
            let (m, k1) = (self.mean[c], self.k1[c]);
            out.push(channel_rows_out(
                s.plain_nans(&[&[k1]]),
                g,
                data,
                m,
                k1,
                c,
                t.o0..t.o1,
                &mut rows,
                self.stream,
                &mut NoPace,
            ));
        }
        if self.stream {
            s.fence();
        }
        out
    }

    /// The sums of each channel of the task, its `dx` written, image by image
    /// ([`backward::task_rows_by_image`]): the same bits as
    /// [`InferenceRows::channels`]. Only for rows that are not streamed
    /// ([`Geometry::rows_in_image_order`]).
    #[inline(always)]
    fn images<S: Simd<T::Stat>>(self, s: S) -> Vec<(f64, f64)> {
        debug_assert!(!self.stream);
        let mut rows = self.rows;
        let data = GradData {
            dy: self.dy,
            mask: self.mask,
            x: self.x,
        };
        let task = rows.task;
        backward::task_rows_by_image(s, self.g, data, self.mean, task, Some((&mut rows, self.k1)))
    }
}

/// `(Σdy, Σdy·(x − m))` over channel `c`, outer rows `range` (within `rows`' task), of
/// a channel-major tensor, with `dx = dy·k1` written to `rows` in the same read; sums
/// flushed to `f64` after each tile of [`channel_tiles`] (whole rows of at most
/// [`TILE`](super::TILE) elements, or equal pieces of a longer row), so no `f32` lane
/// sums more than `TILE / LANES` values, whatever the shape. `dx` streamed when
/// `stream`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn channel_rows_out<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    g: &Geometry,
    data: GradData<'_, T>,
    m: U,
    k1: U,
    c: usize,
    range: std::ops::Range<usize>,
    rows: &mut TaskRows<'_, T>,
    stream: bool,
    pace: &mut P,
) -> (f64, f64) {
    let zero = s.splat(T::Stat::ZERO);
    let (m, k1) = (s.splat(m), s.splat(k1));
    let (mut sdy, mut sdx) = (0f64, 0f64);
    let stride = g.channels * g.inner;
    // Tiles, the same as the sums-only pass's (`backward::channel_rows_in`): the row
    // loop has no cut inside a row, and its accumulators stay in registers (perf,
    // NCHW 16x2048x7x7: cutting rows at a running count kept them on the stack).
    for tile in channel_tiles(g, c, range.start, range.end) {
        let first = tile.start - c * g.inner;
        let (o0, at) = (first / stride, first % stride);
        let mut acc = (zero, zero);
        for i in 0..tile.count {
            let off = tile.start + i * tile.stride;
            let (d, x) = (&data.dy[off..][..tile.step], &data.x[off..][..tile.step]);
            let mk = data.mask.map(|y| &y[off..][..tile.step]);
            let out = &mut rows.row(c, o0 + i)[at..][..tile.step];
            let run = GradData { dy: d, mask: mk, x };
            acc = row_sums_out(s, run, m, (out, stream), k1, acc, pace);
        }
        sdy += s.sum_f64(acc.0);
        sdx += s.sum_f64(acc.1);
        pace.tile_done(s, tile);
    }
    (sdy, sdx)
}

/// Gradient in training mode with the side input's gradient (the Ex op after
/// `side + ReLU`): the backward sums with `sg` = the masked dy (`side_input_backprop`)
/// written in the same read, then
/// `dx = (sg − k[0])·k[1] + (x − mean)·k[2]` with `k = coeffs(c, Σdy, Σdy·(x − mean))`
/// from `sg` and x — not dy, y and x again (the masked dy is exact in `T`, so `dx` is
/// the same either way). Resident per channel when dy, x, the mask and `sg` of a
/// channel fit `resident_bytes()` and the tensors are not streamed, or are streamed on
/// a machine where `side_resident_streamed` holds: one DRAM read of each input, one
/// write of each output. Otherwise two sweeps.
pub fn backward_training_side<T: Element>(
    g: &Geometry,
    isa: Isa,
    data: GradData<'_, T>,
    mean: &[T::Stat],
    sg: &mut [T],
    dx: &mut [T],
    coeffs: impl Fn(usize, f64, f64) -> [T::Stat; 3] + Sync + Send,
) -> BackwardSums {
    let size = size_of::<T>();
    let inputs = if data.mask.is_some() { 3 } else { 2 };
    // `sg` is read back by the second sweep, so it counts as resident data too.
    // The L2 limit where the machine reports an L3 past LLC_CAP_BYTES (unlike the plain
    // passes, which keep 8 MiB): there, at 8 MiB, NCHW 64x256x56x56 Ex backward took
    // 1.31 of a copy in f32 and 1.37 in bf16 (AVX-512), 0.98 and 1.19 within the L2.
    // And only for tensors that are not streamed (`Geometry::stream`): from DRAM the
    // two sweeps with streamed outputs were faster (`scripts/ab.sh 3`, the Intel Xeon
    // reporting 300-480 MiB of L3, NCHW, time ÷ copy, resident / two sweeps, AVX-512): 64x256x56x56 f16 1.49 / 1.14,
    // bf16 1.27 / 1.17 (AVX2 1.31 / 1.31), 16x256x56x56 f32 1.13 / 0.89; while in cache
    // the resident pass wins: 16x512x28x28 f32 0.92 / 1.28, 16x256x56x56 bf16 1.19 /
    // 1.44, 16x64x112x112 bf16 1.28 / 1.45, 16x64x56x56 f32 1.23 / 1.50.
    // On the Xeon reporting 105 MiB the resident pass was faster from DRAM too, so it
    // is kept there for streamed tensors as well (`side_resident_streamed`), and so it
    // is for f32, which writes `dx` inside the reduction's loop (the zip), on the Zen 4
    // reporting 32 MiB.
    if g.resident(size, inputs + 1, resident_bytes())
        && (!g.stream(size) || side_resident_streamed(zips::<T>() && g.pipelined(size)))
    {
        let stream = g.stream_resident(size);
        let pipelined = g.pipelined(size);
        let split = ChannelMajorSplit::whole_channels(g, pipelined);
        let items: Vec<_> = split
            .rows_mut(g, sg)
            .into_iter()
            .zip(split.rows_mut(g, dx))
            .collect();
        let coeffs = &coeffs;
        let per = map_items(g, items, |_, (sg, dx)| {
            T::Stat::dispatch(
                isa,
                ResidentSide {
                    g,
                    data,
                    mean,
                    sg,
                    dx,
                    coeffs,
                    stream,
                    pipelined,
                },
            )
        })
        .concat();
        BackwardSums::from_pairs(&per)
    } else {
        let ones = vec![T::Stat::from_f64(1.0); g.channels];
        let sums = backward_inference(g, isa, data, mean, &ones, sg);
        let k = Columns::new(g.channels, |c| coeffs(c, sums.sum_dy[c], sums.sum_dy_xc[c]));
        let [dm, k1, k2] = k.get();
        let masked = GradData {
            dy: &*sg,
            mask: None,
            x: data.x,
        };
        backward::apply(g, isa, masked, [dm, mean, k1, k2], dx);
        sums
    }
}

/// [`backward_training_side`] over a group of resident channels: per channel, the sums
/// and `sg` (ordinary stores: `dx` is computed from it while it is cached), and `dx` of
/// the channel from its `sg` and x by a [`RowsBehind`] ([`SideIns`]) — pipelined,
/// while the next channel is reduced, with the zip for 32-bit elements as the plain
/// backward pass. (Its own writer, tile by tile, had measured against the
/// reduce-then-write pass it replaced, `scripts/ab.sh 3`, Intel Xeon, NCHW
/// 64x256x56x56, time ÷ copy: bf16 1.57 -> 1.38 with AVX-512 but 1.32 -> 1.57 with
/// AVX2, f16 1.45 -> 1.44 and 1.48 -> 1.27, other cells within 2 %.)
struct ResidentSide<'a, T: Element, C> {
    g: &'a Geometry,
    data: GradData<'a, T>,
    mean: &'a [T::Stat],
    sg: TaskRows<'a, T>,
    dx: TaskRows<'a, T>,
    coeffs: &'a C,
    stream: bool,
    /// Whether a channel is written while the next is reduced ([`Geometry::pipelined`]).
    pipelined: bool,
}

impl<T: Element, C> Kernel<T::Stat> for ResidentSide<'_, T, C>
where
    C: Fn(usize, f64, f64) -> [T::Stat; 3],
{
    type Output = Vec<(f64, f64)>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<(f64, f64)> {
        let (g, d) = (self.g, self.data);
        let (mut sg, mut dx) = (self.sg, self.dx);
        let t = sg.task;
        let mut out = Vec::with_capacity(t.c1 - t.c0);
        let pipe = self.pipelined;
        let mean = self.mean;
        let mut sums = s.outline(SideSumsOf {
            g,
            data: d,
            mean,
            c: t.c0,
            sg: &mut sg,
            pace: &mut NoPace,
        });
        let mut taken = Vec::with_capacity(t.o1 - t.o0);
        for c in t.c0..t.c1 {
            let more = c + 1 < t.c1;
            let [dm, k1, k2] = (self.coeffs)(c, sums.0, sums.1);
            // `sg` of `c`, all written by its reduction: its rows taken out of the
            // task's, for the writer of `dx` to read while the reduction of `c + 1`
            // writes the next channel's.
            taken.clear();
            taken.extend((t.o0..t.o1).map(|o| &*sg.take_row(c, o)));
            let ins = SideIns {
                sg: &taken,
                o0: t.o0,
                dy: d.dy,
                x: d.x,
            };
            let mut behind = RowsBehind::new(
                s,
                g,
                ins,
                &mut dx,
                (c, if pipe { c + 1 } else { c }),
                [dm, mean[c], k1, k2],
                t.o0..t.o1,
                self.stream,
                &BackwardFn,
            );
            let next = if more && pipe {
                s.outline(SideSumsOf {
                    g,
                    data: d,
                    mean,
                    c: c + 1,
                    sg: &mut sg,
                    pace: &mut behind,
                })
            } else {
                (0.0, 0.0)
            };
            behind.upto(t.o1, if pipe { 1 } else { g.outer });
            out.push(sums);
            sums = if more && !pipe {
                s.outline(SideSumsOf {
                    g,
                    data: d,
                    mean,
                    c: c + 1,
                    sg: &mut sg,
                    pace: &mut NoPace,
                })
            } else {
                next
            };
        }
        if self.stream {
            s.fence();
        }
        out
    }
}

/// The backward sums of channel `c` with its masked dy written to `sg`, by the row
/// chunks of the two-pass split (see [`resident_moments`]), with `pace` between tiles.
#[inline(always)]
fn side_sums<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    g: &Geometry,
    d: GradData<'_, T>,
    mean: &[U],
    c: usize,
    sg: &mut TaskRows<'_, T>,
    pace: &mut P,
) -> (f64, f64) {
    let one = U::from_f64(1.0);
    let mut sums = InOrder(None);
    for r in RowChunks::all(g) {
        sums.add(
            channel_rows_out(s, g, d, mean[c], one, c, r, sg, false, pace),
            add_sums,
        );
    }
    sums.finish((0.0, 0.0))
}

/// [`side_sums`] as a function of its own ([`Simd::outline`]).
struct SideSumsOf<'r, 'a, 's, T: Element, P> {
    g: &'r Geometry,
    data: GradData<'a, T>,
    mean: &'r [T::Stat],
    c: usize,
    sg: &'r mut TaskRows<'s, T>,
    pace: &'r mut P,
}

impl<T: Element, S: Simd<T::Stat>, P: Pace<S>> Body<S> for SideSumsOf<'_, '_, '_, T, P> {
    type Output = (f64, f64);
    #[inline(always)]
    fn run(self, s: S) -> (f64, f64) {
        side_sums(s, self.g, self.data, self.mean, self.c, self.sg, self.pace)
    }
}

/// Per-channel triples `f(channel)` as three per-channel columns, in one buffer (the
/// triples and three columns were four allocations, which small tensors pay on every
/// call), on the stack up to 64 channels.
pub(crate) struct Columns<U>(Scratch<U, { 3 * 64 }>);

impl<U: Real> Columns<U> {
    /// The columns of `f(0)`, …, `f(c − 1)`.
    pub fn new(c: usize, mut f: impl FnMut(usize) -> [U; 3]) -> Self {
        let mut buf = scratch(U::ZERO, 3 * c);
        // Through slices taken once (each use of a `Scratch` tests where its elements
        // are).
        let (a, rest) = buf.split_at_mut(c);
        let (b, d) = rest.split_at_mut(c);
        for (ch, ((a, b), d)) in a.iter_mut().zip(b).zip(d).enumerate() {
            [*a, *b, *d] = f(ch);
        }
        Columns(buf)
    }

    /// The three columns.
    pub fn get(&self) -> [&[U]; 3] {
        let c = self.0.len() / 3;
        let (a, rest) = self.0.split_at(c);
        let (b, d) = rest.split_at(c);
        [a, b, d]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn data<T: Element>(n: usize, seed: u64, mean: f64) -> Vec<T> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                T::narrow(<T::Stat as Real>::from_f64(mean + 4.0 * u - 2.0))
            })
            .collect()
    }

    fn bits<T: Element>(v: &[T]) -> Vec<u64> {
        v.iter().map(|&e| e.widen().to_f64().to_bits()).collect()
    }

    /// Forward and backward training (plain, with a side input, with a ReLU mask) of
    /// one geometry on a pool of `threads`: the outputs' and the reductions' bits.
    fn resident_bits<T: Element>(g: &Geometry, isa: Isa, threads: usize) -> Vec<Vec<u64>> {
        let n = g.len();
        let (x, side, dy) = (
            data::<T>(n, 1, 3.0),
            data::<T>(n, 2, 0.0),
            data::<T>(n, 3, 0.1),
        );
        let mean: Vec<T::Stat> = (0..g.channels)
            .map(|c| <T::Stat as Real>::from_f64(3.0 + 0.01 * c as f64))
            .collect();
        let fc = |c: usize, m: Moments| {
            let r = |v: f64| <T::Stat as Real>::from_f64(v);
            [
                r(m.mean),
                r(1.0 / (m.variance() + 1e-3).sqrt()),
                r(0.25 * c as f64),
            ]
        };
        let bc = |c: usize, a: f64, b: f64| {
            let r = |v: f64| <T::Stat as Real>::from_f64(v);
            [r(a / n as f64), r(0.5 + c as f64), r(b * 1e-9)]
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool");
        pool.install(|| {
            let mut out = Vec::new();
            let mut y = vec![T::default(); n];
            let m = resident_forward(g, isa, [&x[..]], &mut y, &fc, Affine);
            out.push(bits(&y));
            out.push(
                m.iter()
                    .flat_map(|m| [m.count, m.mean, m.m2])
                    .map(f64::to_bits)
                    .collect(),
            );
            let m = resident_forward(g, isa, [&x[..], &side], &mut y, &fc, AffineSide::<true>);
            out.push(bits(&y));
            out.push(m.iter().map(|m| m.m2.to_bits()).collect());
            let mut dx = vec![T::default(); n];
            let s = resident_backward(g, isa, [&dy[..], &x], &mean, &mut dx, &bc, BackwardFn);
            out.push(bits(&dx));
            out.push(
                s.iter()
                    .flat_map(|s| [s.0, s.1])
                    .map(f64::to_bits)
                    .collect(),
            );
            let s = resident_backward(
                g,
                isa,
                [&dy[..], &x, &side],
                &mean,
                &mut dx,
                &bc,
                BackwardMaskFn,
            );
            out.push(bits(&dx));
            out.push(
                s.iter()
                    .flat_map(|s| [s.0, s.1])
                    .map(f64::to_bits)
                    .collect(),
            );
            out
        })
    }

    /// The passes shared by the threads (each reducing its chunks of every channel)
    /// give the bits of the whole-channel passes (one thread: no sharing) for two and
    /// three threads, with two chunks a channel, three (of which two threads take two
    /// and one), and rows of an odd length (vector tails, rows not 64-byte aligned).
    #[test]
    fn shared_passes_have_the_bits_of_whole_channels() {
        let before = cooperative::SHARED_RUNS.load(std::sync::atomic::Ordering::Relaxed);
        for (outer, channels, inner) in [(12, 3, 32768), (5, 2, 100000), (9, 2, 30001)] {
            let g = Geometry::new(outer, channels, inner);
            assert!(ChannelMajorSplit::new(&g).chunks >= 2);
            for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
                let one = resident_bits::<f32>(&g, isa, 1);
                let half = resident_bits::<bf16>(&g, isa, 1);
                for threads in [2, 3] {
                    assert!(
                        one == resident_bits::<f32>(&g, isa, threads),
                        "f32 {g:?} {isa:?} {threads}"
                    );
                    assert!(
                        half == resident_bits::<bf16>(&g, isa, threads),
                        "bf16 {g:?} {isa:?} {threads}"
                    );
                }
            }
        }
        // (Other tests may hold the claim, or a thread come late, for some calls; not
        // for all of them.)
        let after = cooperative::SHARED_RUNS.load(std::sync::atomic::Ordering::Relaxed);
        assert!(after > before, "no pass was shared");
    }

    /// Shared passes started from several pool threads at once (each a task of a
    /// parallel loop on the same pool) and from threads outside it: one at a time is
    /// shared, the others take the whole-channel path; none waits forever, and all
    /// give the same bits.
    #[test]
    fn concurrent_and_nested_passes_finish_with_the_same_bits() {
        use rayon::prelude::*;
        let g = Geometry::new(12, 3, 32768);
        let isa = Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.is_supported())
            .unwrap_or(Isa::Scalar);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a thread pool");
        let fc = |_: usize, m: Moments| [m.mean as f32, 1.0, 0.0];
        let x = data::<f32>(g.len(), 1, 3.0);
        let run = || {
            let mut y = vec![0f32; g.len()];
            let m = resident_forward(&g, isa, [&x[..]], &mut y, &fc, Affine);
            (
                bits(&y),
                m.iter().map(|m| m.m2.to_bits()).collect::<Vec<_>>(),
            )
        };
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a thread pool");
        let first = one.install(run);
        let nested: Vec<_> = pool.install(|| (0..6).into_par_iter().map(|_| run()).collect());
        let outside: Vec<_> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..3).map(|_| sc.spawn(|| pool.install(run))).collect();
            hs.into_iter()
                .map(|h| h.join().expect("a thread"))
                .collect()
        });
        let shared = pool.install(run);
        for r in nested.iter().chain(&outside).chain([&shared]) {
            assert!(*r == first);
        }
    }

    /// A pass whose pool has a thread blocked outside rayon (here until the pass has
    /// returned) does not wait for it: it gives the share up and takes the
    /// whole-channel path, with the same bits.
    #[test]
    fn a_blocked_pool_thread_does_not_hang_a_pass() {
        let g = Geometry::new(12, 3, 32768);
        let isa = Isa::Scalar;
        let fc = |_: usize, m: Moments| [m.mean as f32, 1.0, 0.0];
        let x = data::<f32>(g.len(), 1, 3.0);
        let run = || {
            let mut y = vec![0f32; g.len()];
            let m = resident_forward(&g, isa, [&x[..]], &mut y, &fc, Affine);
            (
                bits(&y),
                m.iter().map(|m| m.m2.to_bits()).collect::<Vec<_>>(),
            )
        };
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a thread pool");
        let want = one.install(run);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a thread pool");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        pool.spawn(move || {
            let _ = ready_tx.send(());
            let _ = rx.recv();
        });
        let _ = ready_rx.recv();
        let got = pool.install(run);
        let _ = tx.send(());
        assert!(got == want);
    }

    /// [`WhenPublished`] makes no writer while channel `c` is unpublished (the reduction
    /// goes on), makes it at the first tile after every part has published `c` and
    /// passes it that tile and every later one; where no tile came after, it is made at
    /// the end.
    #[test]
    fn rows_are_written_behind_once_the_channel_is_published() {
        struct Count(usize);
        impl Pace<()> for Count {
            type Zip = ();
            fn tile_done(&mut self, _: (), _: Tile) {
                self.0 += 1;
            }
        }
        let g = Geometry::new(4, 2, 8);
        let plan = Plan {
            parts: 2,
            per_part: 1,
            chunk_rows: 2,
            chunks: 2,
        };
        let tile = Tile {
            start: 0,
            step: 8,
            stride: 16,
            count: 1,
        };
        let ex = Exchange::new(&g, &plan);
        let made = std::cell::Cell::new(0);
        let mut pace = WhenPublished::new(&ex, 0, || {
            made.set(made.get() + 1);
            Count(0)
        });
        pace.tile_done((), tile);
        ex.done(0);
        pace.tile_done((), tile);
        assert_eq!(made.get(), 0, "made before every part published");
        ex.done(0);
        for _ in 0..3 {
            pace.tile_done((), tile);
        }
        assert_eq!(made.get(), 1);
        let writer = pace.into_behind().map(|w| w.0);
        assert_eq!((writer, made.get()), (Some(3), 1));
        // Published only after the reduction's last tile: made at the end, once.
        let late = WhenPublished::new(&ex, 1, || {
            made.set(made.get() + 1);
            Count(0)
        });
        ex.done(1);
        ex.done(1);
        assert_eq!(late.into_behind().map(|w| w.0), Some(0));
        assert_eq!(made.get(), 2);
    }

    /// The plan of a shared pass: every chunk in exactly one part, parts of equal
    /// chunks but the last, and each part's output rows its chunks' rows.
    #[test]
    fn shared_plans_cover_every_chunk_once() {
        for (outer, inner) in [
            (64, 12544),
            (33, 16384),
            (9, 30001),
            (3, 210000),
            (2, 131073),
        ] {
            let g = Geometry::new(outer, 2, inner);
            let split = ChannelMajorSplit::new(&g);
            for threads in 2..6 {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("a thread pool");
                let Some(plan) = pool.install(|| Plan::new(&g)) else {
                    // Only where a thread would be left without a part.
                    let per = split.chunks.div_ceil(threads);
                    assert!(split.chunks < threads || split.chunks.div_ceil(per) != threads);
                    continue;
                };
                assert_eq!(plan.parts, threads);
                let mut out = vec![0u8; g.len()];
                let rows = plan.rows_mut(&g, &mut out);
                assert_eq!(rows.len(), plan.parts);
                let mut next = 0;
                for (part, r) in rows.iter().enumerate() {
                    assert_eq!(r.task.o0, next);
                    for (k, rr) in plan.chunks_of(&g, part) {
                        assert_eq!(rr.start, next);
                        assert_eq!(rr.start, k * split.rows_per_task);
                        next = rr.end;
                    }
                    assert_eq!(r.task.o1, next);
                }
                assert_eq!(next, outer);
            }
        }
    }

    /// The inference gradient walked image by image (`RowOrder::Images`) gives the bits
    /// of the channel-by-channel walk, in `dx` and in both sums: rows of 49, 15, 2 and 200 elements
    /// (each row starting at another offset), 16x700x7x7 in at least three tasks (four
    /// of 175 channels on two threads), channels of several tiles (3000 rows of 3, 90
    /// of 200), channels split into row chunks of several tiles each (1400 rows of
    /// 200), a task of more channels than an image-order block (1100 channels of 3:
    /// `IMAGE_BLOCK_CHANNELS`), with and without the ReLU mask, each dtype, every ISA.
    /// (Fails with the image walk keeping its sums from one tile to the next, and with
    /// its blocks' `dx` all written to the first block's rows, tried.)
    #[test]
    fn image_order_inference_rows_have_the_bits_of_the_channel_walk() {
        fn check<T: Element>() {
            for (outer, channels, inner) in super::super::IMAGE_WALK_GEOMETRIES {
                let g = Geometry::new(outer, channels, inner);
                let n = g.len();
                let (dy, x, y) = (
                    data::<T>(n, 4, 0.0),
                    data::<T>(n, 5, 3.0),
                    data::<T>(n, 6, 0.0),
                );
                let r = |v: f64| <T::Stat as Real>::from_f64(v);
                let mean: Vec<T::Stat> = (0..channels).map(|c| r(3.0 - 0.01 * c as f64)).collect();
                let k1: Vec<T::Stat> = (0..channels).map(|c| r(0.5 + 0.1 * c as f64)).collect();
                for isa in Isa::supported() {
                    for mask in [None, Some(&y[..])] {
                        let run = |walk| {
                            let data = GradData {
                                dy: &dy,
                                mask,
                                x: &x,
                            };
                            let mut dx = vec![T::default(); n];
                            let s = inference_rows(&g, isa, data, &mean, &k1, &mut dx, walk);
                            let sums = s.sum_dy.iter().chain(&s.sum_dy_xc).map(|v| v.to_bits());
                            (bits(&dx), sums.collect::<Vec<u64>>())
                        };
                        let what =
                            format!("{isa} {outer}x{channels}x{inner}, mask {}", mask.is_some());
                        let plain = run(RowOrder::Channels);
                        assert!(run(RowOrder::Images) == plain, "{what}: image order");
                    }
                }
            }
        }
        check::<f32>();
        check::<bf16>();
        check::<half::f16>();
    }

    /// The backward sums of a task walked channel by channel
    /// (`backward::channel_rows_in`, each channel's rows a plane apart).
    struct ChannelWalk<'a, T: Element> {
        g: &'a Geometry,
        dy: &'a [T],
        mask: Option<&'a [T]>,
        x: &'a [T],
        mean: &'a [T::Stat],
        task: super::super::ChannelTask,
    }

    impl<T: Element> Kernel<T::Stat> for ChannelWalk<'_, T> {
        type Output = Vec<(f64, f64)>;
        fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<(f64, f64)> {
            let t = self.task;
            let mut out = Vec::new();
            for c in t.c0..t.c1 {
                let data = GradData {
                    dy: self.dy,
                    mask: self.mask,
                    x: self.x,
                };
                let rows = t.o0..t.o1;
                out.push(backward::channel_rows_in(
                    s,
                    self.g,
                    data,
                    self.mean[c],
                    c,
                    rows,
                ));
            }
            out
        }
    }

    /// The backward sums of a channel-major tensor with rows short enough to be walked
    /// image by image (`backward::reduce`, `Geometry::rows_in_image_order`) have the
    /// bits of the walk channel by channel, task by task, merged the same way: rows of
    /// 49, 15, 2, 3 and 200 elements, tasks of several channels, channels of several
    /// tiles, channels split into row chunks of several tiles (1400 rows of 200), a
    /// task of more channels than an image-order block (1100 channels of 3), with and
    /// without the ReLU mask, a NaN in x, each dtype, every ISA. (Fails with the image
    /// walk keeping its sums from one tile to the next, tried.)
    #[test]
    fn image_order_backward_sums_have_the_bits_of_the_channel_walk() {
        fn check<T: Element>() {
            for (outer, channels, inner) in super::super::IMAGE_WALK_GEOMETRIES {
                let g = Geometry::new(outer, channels, inner);
                assert!(g.rows_in_image_order(size_of::<T>()));
                let n = g.len();
                let (dy, mut x, y) = (
                    data::<T>(n, 7, 0.0),
                    data::<T>(n, 8, 3.0),
                    data::<T>(n, 9, 0.0),
                );
                x[n / 2] = T::narrow(<T::Stat as Real>::from_f64(f64::NAN));
                let r = |v: f64| <T::Stat as Real>::from_f64(v);
                let mean: Vec<T::Stat> = (0..channels).map(|c| r(3.0 - 0.01 * c as f64)).collect();
                for isa in Isa::supported() {
                    for mask in [None, Some(&y[..])] {
                        let data = GradData {
                            dy: &dy,
                            mask,
                            x: &x,
                        };
                        let got = backward::reduce(&g, isa, data, &mean);
                        let want = ChannelMajorSplit::new(&g).map_channels(
                            &g,
                            |task| {
                                let walk = ChannelWalk {
                                    g: &g,
                                    dy: &dy,
                                    mask,
                                    x: &x,
                                    mean: &mean,
                                    task,
                                };
                                T::Stat::dispatch(isa, walk)
                            },
                            |a, b| (a.0 + b.0, a.1 + b.1),
                        );
                        let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        let what =
                            format!("{isa} {outer}x{channels}x{inner}, mask {}", mask.is_some());
                        let want_dy: Vec<f64> = want.iter().map(|p| p.0).collect();
                        let want_xc: Vec<f64> = want.iter().map(|p| p.1).collect();
                        assert_eq!(bits(&got.sum_dy), bits(&want_dy), "{what}: sum dy");
                        assert_eq!(bits(&got.sum_dy_xc), bits(&want_xc), "{what}: sum dy·xc");
                    }
                }
            }
        }
        check::<f32>();
        check::<bf16>();
        check::<half::f16>();
    }

    /// Channel-major tensors of several images with empty rows (`inner` = 0, the
    /// image walk's plane zero): every reduction that can walk by image returns zero
    /// sums and no panic, on every ISA.
    #[test]
    fn empty_rows_of_several_images_reduce_to_zeros() {
        let g = Geometry::new(3, 5, 0);
        let zeros = [0f32; 5];
        for isa in Isa::supported() {
            let none: &[f32] = &[];
            let data = || GradData {
                dy: none,
                mask: None,
                x: none,
            };
            let sums = backward::reduce(&g, isa, data(), &zeros);
            assert_eq!((sums.sum_dy, sums.sum_dy_xc), (vec![0.0; 5], vec![0.0; 5]));
            let sums = backward_inference(&g, isa, data(), &zeros, &[1.0; 5], &mut []);
            assert_eq!((sums.sum_dy, sums.sum_dy_xc), (vec![0.0; 5], vec![0.0; 5]));
            let sums = super::super::second_order::reduce(&g, isa, [none; 3], [&zeros; 3]);
            assert!(sums
                .iter()
                .all(|s| [s.g, s.a, s.g_xc, s.a_xc, s.a_g, s.xc] == [0.0; 6]));
        }
    }
}
