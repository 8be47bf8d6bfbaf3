//! Statistics pass: per-channel count, mean and M2 (sum of squared deviations) in one
//! read of `x`.
//!
//! Each tile (cache-sized) gives `Σ(x − K)` and `Σ(x − K)²` in `f32` lanes around a
//! shift `K`, merged with Chan's formula in `f64`. The shift is the channel's mean over
//! the tiles before (for a first tile, the mean of its first few values), so one pass
//! over the tile usually suffices; when the tile's mean turns out to lie more than one
//! std from the shift (drifting data, NaN or Inf), the tile is redone exactly in two
//! passes while it is still cached —
//! first its own `f32` mean as the pivot, then the sums around it. Either way the
//! sums never cancel by more than a factor of two, even when |mean| ≫ std. The choice
//! depends only on the data, so results stay deterministic.

use rayon::prelude::*;

use super::simd::{Dispatch, Isa, Kernel, Reads, Simd, MAX_LANES};
use super::{
    arena_if, channel_tiles, next_cyclic, pixels_per_tile, scratch, task_waves, ChannelMajorSplit,
    ChannelTask, Geometry, NoPace, Pace, PixelSplit, Scratch, Tile, ARENA_MIN_BYTES,
    PREFETCH_BYTES, STREAM_BYTES,
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
    #[inline]
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

    /// `acc[i] = acc[i].merge(part[i])` for every `i`, exactly (bit for bit), with the
    /// ratios of the counts computed once when the counts are the same in every element
    /// (the channels of a task): no division per channel.
    pub(crate) fn merge_into(acc: &mut [Moments], part: &[Moments]) {
        let (Some(a0), Some(b0)) = (acc.first(), part.first()) else {
            return;
        };
        let (na, nb) = (a0.count, b0.count);
        let n = na + nb;
        let (wb, wab) = (nb / n, na * nb / n);
        for (a, b) in acc.iter_mut().zip(part) {
            let same = a.count == na && b.count == nb && na > 0.0 && nb > 0.0;
            *a = if same && a.mean.is_finite() && b.mean.is_finite() {
                let delta = b.mean - a.mean;
                Moments {
                    count: n,
                    mean: a.mean + delta * wb,
                    m2: a.m2 + b.m2 + delta * delta * wab,
                }
            } else {
                a.merge(*b)
            };
        }
    }

    /// Biased variance `M2 / count` (NaN when empty).
    pub fn variance(self) -> f64 {
        self.m2 / self.count
    }

    /// Moments of a tile of `count` values from its pivot and the sums of
    /// `d = x − pivot` and `d²`.
    #[inline]
    pub(crate) fn from_pivot(count: usize, pivot: f64, s1: f64, s2: f64) -> Moments {
        Self::from_pivot_f64(count as f64, pivot, s1, s2)
    }

    /// [`Moments::from_pivot_f64`] with selects where it branches: the same bits.
    #[inline(always)]
    pub(crate) fn from_pivot_select(n: f64, pivot: f64, s1: f64, s2: f64) -> Moments {
        let finite = pivot.is_finite();
        let m2 = s2 - s1 * s1 / n;
        let m2 = if m2 < 0.0 { 0.0 } else { m2 };
        let mean = pivot + s1 / n;
        Moments {
            count: n,
            mean: if finite { mean } else { pivot },
            m2: if finite { m2 } else { f64::NAN },
        }
    }

    /// [`Moments::from_pivot`] with the count as `f64`.
    #[inline]
    pub(crate) fn from_pivot_f64(n: f64, pivot: f64, s1: f64, s2: f64) -> Moments {
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
pub fn channel_moments<T: Element>(g: &Geometry, isa: Isa, x: &[T]) -> Vec<Moments> {
    debug_assert_eq!(x.len(), g.len());
    if g.channels_last() {
        channels_last(g, isa, x)
    } else {
        channel_major(g, isa, x)
    }
}

/// Moments of channel `c`, outer rows `[o0, o1)`, of a channel-major tensor: tiles
/// merged in order.
#[inline(always)]
pub(crate) fn channel_rows_in<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    g: &Geometry,
    x: &[T],
    c: usize,
    o0: usize,
    o1: usize,
) -> Moments {
    channel_rows_paced(s, g, x, c, o0, o1, &mut NoPace)
}

/// [`channel_rows_in`] with `pace` called after each tile (see [`Pace`]).
#[inline(always)]
pub(crate) fn channel_rows_paced<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    g: &Geometry,
    x: &[T],
    c: usize,
    o0: usize,
    o1: usize,
    pace: &mut P,
) -> Moments {
    let mut m = Moments::EMPTY;
    for tile in channel_tiles(g, c, o0, o1) {
        // The shift: the mean of the tiles before, or for the first tile the mean of
        // its first few values (an estimate within a fraction of a std for any but
        // drifting data). Before, the first tile was always summed twice (its own mean,
        // then the sums around it): with 7x7 rows every channel is one tile, and the
        // moments of 16x2048x7x7 f32 took 455 us instead of 309 (one thread).
        // (No closure here: closures are compiled without the kernel's target
        // features, and one around `lane_sums` made its intrinsics calls: forward
        // training of NCHW 2x32x8x8 took 7.1 us instead of 3.8.)
        let k = if m.count > 0.0 {
            Some(U::from_f64(m.mean))
        } else {
            first_pivot(s, tile, x)
        };
        m = m.merge(tile_moments_around(s, tile, x, k, pace));
        pace.tile_done(s, tile);
    }
    m
}

/// The shift of a channel's first tile: the mean of its first [`PIVOT_VALUES`] values,
/// `None` when that is not finite.
#[inline(always)]
fn first_pivot<U: Real, S: Simd<U>, T: Element<Stat = U>>(s: S, tile: Tile, x: &[T]) -> Option<U> {
    let p = tile.pieces(x).next()?;
    let head = &p[..PIVOT_VALUES.min(p.len())];
    let k = U::from_f64(lane_sums(s, [head].into_iter()) / head.len() as f64);
    k.to_f64().is_finite().then_some(k)
}

/// The moments of one tile: from sums around the shift `k` when it is close enough to
/// the tile's mean ([`well_shifted`]); else from sums around the mean those sums give
/// (`k + Σ(x − k)/n`), a second pass; exactly in two more passes where that too is off
/// (NaN, Inf, or a shift off by millions of stds).
///
/// The second shift is for tiles that span the batch (a channel of short rows is one
/// tile), where images at different levels put the mean of the first row's values
/// more than a std from the tile's: NCHW 16x2048x7x7 f32 with image n offset by 3·n
/// (std about 3 each) took every channel through the exact path, three passes, 2.2
/// times the statistics time of i.i.d. data (Zen 4, one thread). Shifts from rows
/// spread over the tile instead made i.i.d. data slower (NCHW 2x32x8x8 forward training
/// 3-9 % in time, `scripts/ab.sh 3`, both ISAs; tried, not kept).
#[inline(always)]
fn tile_moments_around<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    tile: Tile,
    x: &[T],
    k: Option<U>,
    pace: &mut P,
) -> Moments {
    // (A `match`, not `Option::map`: the closure would be compiled without the
    // kernel's target features, with the main loop of `deviation_sums` in it.)
    let first = match k {
        Some(k) => {
            let (s1, s2) = deviation_sums(s, tile.pieces(x), k, pace);
            Some((k, s1, s2))
        }
        None => None,
    };
    tile_moments_after(s, tile, x, first, pace)
}

/// [`tile_moments_around`] from the sums around its shift, `first = (k, Σ(x − k),
/// Σ(x − k)²)` (`None`: no finite shift).
#[inline(always)]
fn tile_moments_after<U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    tile: Tile,
    x: &[T],
    first: Option<(U, f64, f64)>,
    pace: &mut P,
) -> Moments {
    let (n, pieces) = (tile.len(), tile.pieces(x));
    if let Some((k, s1, s2)) = first {
        if well_shifted(n, s1, s2) {
            return Moments::from_pivot(n, k.to_f64(), s1, s2);
        }
        let mean = U::from_f64(k.to_f64() + s1 / n as f64);
        if mean.to_f64().is_finite() {
            let (s1, s2) = deviation_sums(s, pieces.clone(), mean, pace);
            if well_shifted(n, s1, s2) {
                return Moments::from_pivot(n, mean.to_f64(), s1, s2);
            }
        }
    }
    tile_moments(s, pieces, n, pace)
}

/// [`channel_rows_in`] for channels `c0..c1` whose rows `[o0, o1)` make one tile each
/// (short rows: one tile per channel, as 7x7 or 8x8 images): the shifts of all the
/// channels (of a group, where rows are summed by groups) first, then their sums.
/// Channel by channel, a channel's work was one chain
/// of dependent steps (the shift's sum and division, then the sums around it, then the
/// moments' divisions) and the next channel's could not start far enough ahead to hide
/// it: NCHW 1x32x8x8 f32 took 2.0 us, 60 ns a channel of 64 values, and 0.9 us this way
/// (Zen 3, AVX2, one thread). `first` is the tile of the first channel; the others
/// follow `inner` apart. Rows of at least a vector and at most [`GROUP_ROW_BYTES`] are
/// summed [`group_sums`]' way, a group of channels image by image; others as a tile.
#[inline(always)]
fn single_tile_channels<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    x: &[T],
    first: Tile,
    count: usize,
    inner: usize,
    out: &mut Vec<Moments>,
) {
    // (Loops, not closures: see `channel_rows_in`.)
    let grouped = first.step == inner
        && inner >= S::LANES
        && inner * size_of::<T>() <= GROUP_ROW_BYTES
        && first.start + (first.count - 1) * first.stride + count * inner <= x.len();
    if !grouped {
        let mut pivots: Vec<Option<U>> = Vec::with_capacity(count);
        let mut tile = first;
        for _ in 0..count {
            pivots.push(first_pivot(s, tile, x));
            tile.start += inner;
        }
        let mut tile = first;
        for k in pivots {
            out.push(Moments::EMPTY.merge(tile_moments_around(s, tile, x, k, &mut NoPace)));
            tile.start += inner;
        }
        return;
    }
    // Wider groups where the ISA has the registers for their sums (four a channel).
    let (wide, mut c) = (S::LANES >= 16, 0);
    while c < count {
        let mut tile = first;
        tile.start += c * inner;
        c += match (wide, count - c) {
            (true, 4..) => group_moments::<U, S, T, 4>(s, x, tile, out),
            (false, 2..) => group_moments::<U, S, T, 2>(s, x, tile, out),
            _ => group_moments::<U, S, T, 1>(s, x, tile, out),
        };
    }
}

/// Rows of at most this many bytes are summed by groups of channels ([`group_sums`]).
/// NCHW 16x2048x7x7 f32 `moments` (one thread, AVX-512, Zen 4): 205-210 us a channel
/// at a time, its rows a plane apart, 157-160 us by groups (120-150 in a probe's loop
/// of eight channels with no shifts to take), and a read of the same bytes in memory
/// order 75-90 us. Rows of 14x14 f32 (784 bytes) gained nothing in that probe.
const GROUP_ROW_BYTES: usize = 256;

// The resident passes reduce a channel with `channel_rows_paced`, whose bits the
// phases' moments must give; they take rows of at least `RESIDENT_MIN_ROW_BYTES` only,
// which the group walk never sums.
const _: () = assert!(GROUP_ROW_BYTES < super::RESIDENT_MIN_ROW_BYTES);

/// The moments of `G` channels of one tile each, the first `tile`, the others `inner
/// = tile.step` apart, into `out`; returns `G`. Each channel's shift is the mean of
/// its first row (image), summed as [`group_sums`] sums; its moments are the sums of
/// [`group_sums`] around it, or [`tile_moments_after`]'s where those are not well
/// shifted (a non-finite shift gives non-finite sums: the exact path).
#[inline(always)]
fn group_moments<U: Real, S: Simd<U>, T: Element<Stat = U>, const G: usize>(
    s: S,
    x: &[T],
    tile: Tile,
    out: &mut Vec<Moments>,
) -> usize {
    let first_row = Tile { count: 1, ..tile };
    let row_sums = group_sums::<U, S, T, G>(s, x, first_row, [U::ZERO; G]);
    let inv = 1.0 / tile.step as f64;
    let mut k = [U::ZERO; G];
    for g in 0..G {
        k[g] = U::from_f64(row_sums[g].0 * inv);
    }
    let sums = group_sums::<U, S, T, G>(s, x, tile, k);
    let mut t = tile;
    for g in 0..G {
        let (s1, s2) = sums[g];
        let m = tile_moments_after(s, t, x, Some((k[g], s1, s2)), &mut NoPace);
        out.push(Moments::EMPTY.merge(m));
        t.start += tile.step;
    }
    G
}

/// `(Σ(x − k[g]), Σ(x − k[g])²)` over the tiles of `G` adjacent channels (the first
/// `tile`, each whole rows of `tile.step = inner` elements, `LANES ≤ inner`), walked
/// image by image: the `G` rows of an image are adjacent in memory, where a channel's
/// rows are a plane apart (a walk channel by channel read 16 rows a plane apart for
/// each 7x7 channel of a 16-image batch, and the caches' prefetchers did not keep up).
/// Each channel sums into two pairs of `U` vectors, its row's even whole vectors in
/// the first and odd ones in the second (one pair had the AVX2 loop wait on its chain
/// of additions: NCHW 16x512x7x7 f32 `moments` 41.5 us, two 37-38.5), then the row's
/// last `LANES` elements with the lanes before its tail zeroed into the second (an
/// overlapping load: no partial load a row), so a channel's bits do not depend on `G`
/// or on the channels beside it. A lane adds at most `2·TILE / LANES` values.
#[inline(always)]
fn group_sums<U: Real, S: Simd<U>, T: Element<Stat = U>, const G: usize>(
    s: S,
    x: &[T],
    tile: Tile,
    k: [U; G],
) -> [(f64, f64); G] {
    let inner = tile.step;
    let (vectors, tail) = (inner / S::LANES, inner % S::LANES);
    // The whole rows of the group in every image lie in `x` (one check for the loop).
    assert!(
        S::LANES <= inner
            && tile.count > 0
            && tile.start + (tile.count - 1) * tile.stride + G * inner <= x.len()
    );
    // (Loops, not `array::from_fn`: see `channel_rows_in` on closures.)
    let keep = s.lanes_between(S::LANES - tail, S::LANES);
    let zero = s.splat(U::ZERO);
    let mut kv = [zero; G];
    for g in 0..G {
        kv[g] = s.splat(k[g]);
    }
    let (mut a, mut b, mut a2, mut b2) = ([zero; G], [zero; G], [zero; G], [zero; G]);
    let base = x.as_ptr().wrapping_add(tile.start);
    for r in 0..tile.count {
        let row = base.wrapping_add(r * tile.stride);
        for g in 0..G {
            let p = row.wrapping_add(g * inner);
            let (mut sa, mut sb, mut ta, mut tb) = (a[g], b[g], a2[g], b2[g]);
            for j in 0..vectors / 2 {
                // SAFETY: both vectors end by `(2j + 2)·LANES ≤ vectors·LANES ≤ inner`
                // elements into row `r` of channel `g`, which the assertion above puts
                // inside `x`.
                let d = s.sub(
                    unsafe { s.load_ptr(p.wrapping_add(2 * j * S::LANES)) },
                    kv[g],
                );
                // SAFETY: as just above (the pair's second vector).
                let e = s.sub(
                    unsafe { s.load_ptr(p.wrapping_add((2 * j + 1) * S::LANES)) },
                    kv[g],
                );
                sa = s.add(sa, d);
                sb = s.mul_add(d, d, sb);
                ta = s.add(ta, e);
                tb = s.mul_add(e, e, tb);
            }
            if vectors % 2 == 1 {
                // SAFETY: the row's last whole vector, inside `x` (above).
                let d = s.sub(
                    unsafe { s.load_ptr(p.wrapping_add((vectors - 1) * S::LANES)) },
                    kv[g],
                );
                sa = s.add(sa, d);
                sb = s.mul_add(d, d, sb);
            }
            if tail > 0 {
                // SAFETY: `inner − LANES ≥ 0` and the row is inside `x` (above).
                let v = unsafe { s.load_ptr(p.wrapping_add(inner - S::LANES)) };
                let d = s.mul(s.sub(v, kv[g]), keep);
                ta = s.add(ta, d);
                tb = s.mul_add(d, d, tb);
            }
            a[g] = sa;
            b[g] = sb;
            a2[g] = ta;
            b2[g] = tb;
        }
    }
    for g in 0..G {
        a[g] = s.add(a[g], a2[g]);
        b[g] = s.add(b[g], b2[g]);
    }
    let mut sums = [(0.0, 0.0); G];
    for g in 0..G {
        sums[g] = (s.sum_f64(a[g]), s.sum_f64(b[g]));
    }
    sums
}

/// Whether sums around a shift (`s1 = Σd`, `s2 = Σd²` over `n` values) are accurate:
/// the tile's mean is within one std (δ ≤ σ) of the shift. Then `s2 = M2·(1 + δ²/σ²)`
/// and the rounding error of `M2 = s2 − s1²/n` is at most ~4× that of the `f32` sums
/// (a tolerance sampling noise — δ ≈ σ/√n — never comes near, unlike a tighter one,
/// which made most tiles of random data fall back). False for NaN and Inf, which the
/// exact path handles.
#[inline(always)]
fn well_shifted(n: usize, s1: f64, s2: f64) -> bool {
    well_shifted_inv(1.0 / n as f64, s1, s2)
}

/// [`well_shifted`] with `1/n` given: a loop over the channels of a tile (which all have
/// the same `n`) then does no division per channel (perf: the division was the
/// costliest instruction of the per-tile bookkeeping at C = 2048).
#[inline(always)]
fn well_shifted_inv(inv_n: f64, s1: f64, s2: f64) -> bool {
    let q = s1 * s1 * inv_n;
    q <= s2 - q
}

/// Whether every channel of a tile's `f32` sums is [`well_shifted_inv`], tested for every
/// channel with no early exit: a loop with no branch a channel, which the compiler turns
/// into vector code (`vcvtps2pd`, `vmulpd`, `vcmplepd` with AVX2; perf, NHWC 16x7x7x2048
/// bf16 forward training: the short-circuiting loops, one compare and branch a channel,
/// were about a tenth of the statistics pass).
#[inline(always)]
fn all_well_shifted<U: Real>(inv_n: f64, sum1: &[U], sum2: &[U]) -> bool {
    sum1.iter().zip(sum2).fold(true, |all, (a, b)| {
        all & well_shifted_inv(inv_n, a.to_f64(), b.to_f64())
    })
}

/// `(Σ(x − k), Σ(x − k)²)` over the pieces, in `U` lanes summed in `f64`, with
/// [`Pace::step`] after each step of four vectors.
#[inline(always)]
fn deviation_sums<'a, U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    pieces: impl Iterator<Item = &'a [T]>,
    k: U,
    pace: &mut P,
) -> (f64, f64) {
    let (kv, zero) = (s.splat(k), s.splat(U::ZERO));
    let (mut s1, mut s2, mut r1, mut r2) = (zero, zero, zero, zero);
    let (mut u1, mut u2, mut v1, mut v2) = (zero, zero, zero, zero);
    let (mut t1, mut t2) = (0f64, 0f64);
    // The shift, as a slice a partial vector is loaded from.
    let kp = [k; 16];
    let mut z = pace.zip_take();
    for p in pieces {
        let r = Reads::new(S::LANES, [p], p.len());
        assert!(r.lanes_of(s));
        // Four vectors a step, in four chains of sums: with two, the loop waited on
        // the latency of its additions (4 cycles a step), not on its instructions.
        // Loaded as two pairs in any lane order (`Simd::load_pair_unordered_ptr`): a
        // sum may take its values in any lanes, and AVX2 and AVX-512 widen a pair of
        // bf16 vectors with one load, a shift and a mask where two vectors took two
        // widening loads (`vpmovzxwd`) and two shifts.
        for i in 0..r.vectors() / 4 {
            let j = 4 * i;
            // SAFETY: `j + 3 < 4·(vectors / 4) <= vectors`; lanes checked above.
            let (([a], [b]), ([c], [e])) = unsafe {
                (
                    r.load_pair_unordered_unchecked(s, j),
                    r.load_pair_unordered_unchecked(s, j + 2),
                )
            };
            let (a, b, c, e) = (s.sub(a, kv), s.sub(b, kv), s.sub(c, kv), s.sub(e, kv));
            s1 = s.add(s1, a);
            s2 = s.mul_add(a, a, s2);
            r1 = s.add(r1, b);
            r2 = s.mul_add(b, b, r2);
            u1 = s.add(u1, c);
            u2 = s.mul_add(c, c, u2);
            v1 = s.add(v1, e);
            v2 = s.mul_add(e, e, v2);
            pace.step(s, &mut z);
        }
        // The last 0–3 whole vectors, into the first chains, in order.
        let j = r.vectors() / 4 * 4;
        if j < r.vectors() {
            let d = s.sub(r.load(s, j)[0], kv);
            s1 = s.add(s1, d);
            s2 = s.mul_add(d, d, s2);
        }
        if j + 1 < r.vectors() {
            let d = s.sub(r.load(s, j + 1)[0], kv);
            r1 = s.add(r1, d);
            r2 = s.mul_add(d, d, r2);
        }
        if j + 2 < r.vectors() {
            let d = s.sub(r.load(s, j + 2)[0], kv);
            u1 = s.add(u1, d);
            u2 = s.mul_add(d, d, u2);
        }
        let (at, n) = r.tail();
        if n > 0 && r.vectors() > 0 {
            // The tail of a row of at least one vector: a partial vector minus a
            // partial vector of the shift, so the lanes past it add 0 − 0. A lane then
            // adds at most one value per row more than the row's whole vectors give
            // it: at most 2·TILE / LANES values a tile.
            // (Tried, 2026-12-02, Zen 3: the tail into the chain after the row's last
            // whole vector instead, so that a 49-element row adds twice to each of
            // `s`, `r`, `u` and once to `v`, not three times to `r`: a shorter chain of
            // dependent FMAs per row, other bits. NCHW 16x64x7x7 f32 `moments` in L2,
            // one thread, 12.9 -> 13.1 us: the row loop is not bound by that chain.)
            let d = s.sub(s.load_partial(&p[at..]), s.load_partial(&kp[..n]));
            r1 = s.add(r1, d);
            r2 = s.mul_add(d, d, r2);
        } else if n > 0 {
            // A row shorter than a vector (rows of 1–15 elements would put a whole
            // tile in a few lanes): widened as a vector, then added one by one in f64.
            // (Not a scalar widening: for f16 that is a call into the `half` crate, and
            // a call in this loop kept the accumulators on the stack.)
            let mut lanes = [U::ZERO; 16];
            s.store(&mut lanes[..], s.load_partial(&p[at..]));
            for &v in &lanes[..n] {
                let d = v - k;
                t1 += d.to_f64();
                t2 += (d * d).to_f64();
            }
        }
    }
    pace.zip_put(z);
    let (s1, s2) = (
        s.add(s.add(s1, r1), s.add(u1, v1)),
        s.add(s.add(s2, r2), s.add(u2, v2)),
    );
    (s.sum_f64(s1) + t1, s.sum_f64(s2) + t2)
}

/// The moments of each channel of one task of a channel-major split.
struct TaskMoments<'a, T> {
    g: &'a Geometry,
    x: &'a [T],
    task: ChannelTask,
}

impl<T: Element> Kernel<T::Stat> for TaskMoments<'_, T> {
    type Output = Vec<Moments>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<Moments> {
        let t = self.task;
        let mut out = Vec::with_capacity(t.c1 - t.c0);
        let mut tiles = channel_tiles(self.g, t.c0, t.o0, t.o1);
        if let (Some(first), None) = (tiles.next(), tiles.next()) {
            single_tile_channels(s, self.x, first, t.c1 - t.c0, self.g.inner, &mut out);
            return out;
        }
        for c in t.c0..t.c1 {
            out.push(channel_rows_in(s, self.g, self.x, c, t.o0, t.o1));
        }
        out
    }
}

fn channel_major<T: Element>(g: &Geometry, isa: Isa, x: &[T]) -> Vec<Moments> {
    ChannelMajorSplit::new(g).map_channels(
        g,
        |task| T::Stat::dispatch(isa, TaskMoments { g, x, task }),
        Moments::merge,
    )
}

/// Exact two-pass moments of one cache-resident tile of `n` elements.
#[inline(always)]
fn tile_moments<'a, U: Real, S: Simd<U>, T: Element<Stat = U>, P: Pace<S>>(
    s: S,
    pieces: impl Iterator<Item = &'a [T]> + Clone,
    n: usize,
    pace: &mut P,
) -> Moments {
    let pivot = U::from_f64(lane_sums(s, pieces.clone()) / n as f64);
    let (s1, s2) = deviation_sums(s, pieces, pivot, pace);
    Moments::from_pivot(n, pivot.to_f64(), s1, s2)
}

/// Values whose mean is the shift of a channel-major task's first tile (rows summed by
/// groups, [`group_moments`], take their first row's mean: at most 128 values).
const PIVOT_VALUES: usize = 64;

/// `Σx` over the pieces, in `U` lanes summed in `f64` (at most one tile: a lane adds
/// at most `TILE / LANES` values).
#[inline(always)]
fn lane_sums<'a, U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    pieces: impl Iterator<Item = &'a [T]>,
) -> f64 {
    let zero = s.splat(U::ZERO);
    let (mut a0, mut a1) = (zero, zero);
    for p in pieces {
        let r = Reads::new(S::LANES, [p], p.len());
        let pairs = r.vectors() / 2;
        for i in 0..pairs {
            let ([a], [b]) = (r.load(s, 2 * i), r.load(s, 2 * i + 1));
            a0 = s.add(a0, a);
            a1 = s.add(a1, b);
        }
        if r.vectors() % 2 == 1 {
            let [a] = r.load(s, r.vectors() - 1);
            a0 = s.add(a0, a);
        }
        let (at, len) = r.tail();
        if len > 0 {
            a1 = s.add(a1, s.load_partial(&p[at..]));
        }
    }
    s.sum_f64(a0) + s.sum_f64(a1)
}

/// Moments of the pixels `x` (whole pixels of `c` channels) into `out`, by tiles.
struct PixelMoments<'a, T: Element> {
    x: &'a [T],
    c: usize,
    out: &'a mut [Moments],
    /// Pixels of over four vectors go four at a time (see [`deviation_sums_px`]).
    quads: bool,
    /// Where the scratch comes from at large C ([`with_arena`]); the heap without.
    arena: Option<&'a bumpalo::Bump>,
}

impl<T: Element> Kernel<T::Stat> for PixelMoments<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) {
        let (l, c) = (S::LANES, self.c);
        let groups = c.div_ceil(l);
        // With few vectors per pixel, consecutive pixels go to separate accumulator sets
        // so that at least four add chains run at once.
        let sets = 4usize.div_ceil(groups);
        let zero = s.splat(T::Stat::ZERO);
        // One buffer per kind, on the stack for few channel groups: on small tensors
        // malloc and free were a quarter of the pass (perf, 2x8x8x32 f32), with seven
        // allocations a task, and still counted with three. From the thread's arena
        // (`self.arena`, given at large C only) where the heap handed each task fresh
        // pages (see `with_arena`).
        let (mut heap_vectors, mut heap_lanes, mut heap_columns): (
            Scratch<S::V, 32>,
            Scratch<T::Stat, { 3 * 8 * MAX_LANES }>,
            Scratch<f64, { 3 * 64 }>,
        );
        let vectors: &mut [S::V] = match self.arena {
            Some(arena) => arena.alloc_slice_fill_copy(groups + 3 * sets * groups, zero),
            None => {
                heap_vectors = scratch(zero, groups + 3 * sets * groups);
                &mut heap_vectors
            }
        };
        let (pivot, acc) = vectors.split_at_mut(groups);
        let lanes: &mut [T::Stat] = match self.arena {
            Some(arena) => arena.alloc_slice_fill_copy(3 * groups * l, T::Stat::ZERO),
            None => {
                heap_lanes = scratch(T::Stat::ZERO, 3 * groups * l);
                &mut heap_lanes
            }
        };
        // Per channel, the f64 sums around the task's pivot of the tiles accepted so
        // far (count, Σd, Σd²: plain additions, no division per tile), as three columns
        // so that a tile whose channels are all accepted is flushed in vector loops
        // (perf, 16x7x7x2048 f32: the per-channel flush was a fifth of the pass); and,
        // allocated only when a tile needs one, the moments of tiles redone exactly.
        let columns: &mut [f64] = match self.arena {
            Some(arena) => arena.alloc_slice_fill_copy(3 * c, 0.0f64),
            None => {
                heap_columns = scratch(0.0f64, 3 * c);
                &mut heap_columns
            }
        };
        let (count, rest) = columns.split_at_mut(c);
        let (s1, s2) = rest.split_at_mut(c);
        let mut exact: Vec<Moments> = Vec::new();
        let tile_len = pixels_per_tile(c) * c;
        // A task of one tile has no later tile to miss its pivots (PIVOT_PIXELS).
        let pivot_pixels = if self.x.len() > tile_len {
            PIVOT_PIXELS
        } else {
            PIVOT_PIXELS_ONE_TILE
        };
        let mut first = true;
        for tile in self.x.chunks(tile_len) {
            let n = tile.len() / c;
            let inv_n = 1.0 / n as f64;
            let (pivots, rest) = lanes.split_at_mut(groups * l);
            let (sum1, sum2) = rest.split_at_mut(groups * l);
            // The task's pivots, on its first tile: the means of its first few pixels
            // (an estimate of the tile's mean within a fraction of a std for any but
            // drifting data). Then the tile's sums around the pivots, one pass.
            let head = if first {
                first = false;
                let head = pivot_pixels.min(n) * c;
                tile_pivots(s, &tile[..head], c, sets, acc, pivot, pivots);
                head
            } else {
                0
            };
            deviation_sums_px(s, tile, c, sets, pivot, acc, self.quads, (sum1, sum2));
            // Whether every channel of the tile is well shifted: tested once a pass.
            let mut all = all_well_shifted(inv_n, &sum1[..c], &sum2[..c]);
            // Where some channel's tile mean lies more than a std from its pivot (drift,
            // as from image to image where images differ in level; NaN or Inf), those
            // channels take this tile's means as their pivots, kept for the task's later
            // tiles, and the tile is summed again while it is cached; their sums of the
            // tiles before, around the old pivots, become moments first. The other
            // channels keep their pivots, so the second pass gives them the first's sums
            // bit for bit, and no channel's data changes another channel's result. (On a
            // task's first tile every channel took the tile's means before, and a later
            // tile's channels that were off were each walked on their own, strided by C,
            // in f64, as `channel_exact` still does where a channel is off after the
            // second pass: NHWC 16x7x7x2048 f32 whose images differ in level by a std
            // each, the second tile of each task off in every channel, took 16 times the
            // statistics time of i.i.d. data; Zen 4, one thread, 5.3 ms against 0.33.)
            if !all && head < tile.len() {
                let off =
                    |ch: usize| !well_shifted_inv(inv_n, sum1[ch].to_f64(), sum2[ch].to_f64());
                let off: Vec<usize> = (0..c).filter(|&ch| off(ch)).collect();
                let (mut means, mut mean_lanes) =
                    (vec![zero; groups], vec![T::Stat::ZERO; groups * l]);
                tile_pivots(s, tile, c, sets, acc, &mut means, &mut mean_lanes);
                if !off.is_empty() {
                    exact.resize(c, Moments::EMPTY);
                }
                for &ch in &off {
                    if count[ch] > 0.0 {
                        let (p, a, b) = (pivots[ch].to_f64(), s1[ch], s2[ch]);
                        exact[ch] = exact[ch].merge(Moments::from_pivot_f64(count[ch], p, a, b));
                        (count[ch], s1[ch], s2[ch]) = (0.0, 0.0, 0.0);
                    }
                    pivots[ch] = mean_lanes[ch];
                }
                for (g, v) in pivot.iter_mut().enumerate() {
                    *v = s.load(&pivots[g * l..]);
                }
                deviation_sums_px(s, tile, c, sets, pivot, acc, self.quads, (sum1, sum2));
                all = all_well_shifted(inv_n, &sum1[..c], &sum2[..c]);
            }
            // A channel whose tile mean lies more than one std from its pivot (drift,
            // NaN, Inf) is redone exactly on its own, so no channel's data changes
            // another channel's result.
            let (sum1, sum2) = (&sum1[..c], &sum2[..c]);
            let nf = n as f64;
            if all {
                for ch in 0..c {
                    count[ch] += nf;
                    s1[ch] += sum1[ch].to_f64();
                    s2[ch] += sum2[ch].to_f64();
                }
            } else {
                exact.resize(c, Moments::EMPTY);
                for ch in 0..c {
                    let (a, b) = (sum1[ch].to_f64(), sum2[ch].to_f64());
                    if well_shifted_inv(inv_n, a, b) {
                        count[ch] += nf;
                        s1[ch] += a;
                        s2[ch] += b;
                    } else {
                        exact[ch] = exact[ch].merge(channel_exact(tile, c, ch));
                    }
                }
            }
        }
        if exact.is_empty() && !self.x.is_empty() {
            // Every channel has a count (no tile was redone): the moments with no branch
            // a channel but the merge's (perf, NHWC 16x7x7x2048 bf16 forward training
            // with AVX2: this loop, with `from_pivot_f64`'s branches, was a sixth of the
            // statistics pass). The same bits.
            let channels = self.out.iter_mut().zip(&lanes[..c]);
            for ((o, p), ((n, a), b)) in channels.zip(count.iter().zip(&*s1).zip(&*s2)) {
                *o = o.merge(Moments::from_pivot_select(*n, p.to_f64(), *a, *b));
            }
        } else {
            for ch in 0..c {
                let shifted = if count[ch] > 0.0 {
                    Moments::from_pivot_f64(count[ch], lanes[ch].to_f64(), s1[ch], s2[ch])
                } else {
                    Moments::EMPTY
                };
                let ex = exact.get(ch).copied().unwrap_or(Moments::EMPTY);
                self.out[ch] = self.out[ch].merge(shifted).merge(ex);
            }
        }
    }
}

/// Exact moments of channel `ch` of a channels-last tile, in `f64` (the rare fallback).
fn channel_exact<T: Element>(tile: &[T], c: usize, ch: usize) -> Moments {
    let values = || tile.iter().skip(ch).step_by(c).map(|v| v.widen().to_f64());
    let n = values().count();
    if n == 0 {
        return Moments::EMPTY;
    }
    let mean = values().sum::<f64>() / n as f64;
    if !mean.is_finite() {
        return Moments {
            count: n as f64,
            mean,
            m2: f64::NAN,
        };
    }
    Moments {
        count: n as f64,
        mean,
        m2: values().map(|v| (v - mean) * (v - mean)).sum(),
    }
}

/// Pixels whose means are the first pivots of a channels-last task of several tiles.
/// The pivots stay those of the task's every later tile, where a channel whose tile
/// mean lies more than its std from them ([`well_shifted`]) takes the tile's mean as
/// its pivot and the tile is summed again (`PixelMoments::run`); before 2026-12-07 each
/// such channel fell back to the exact per-channel path (`channel_exact`).
/// From 16 pixels the pivot of i.i.d. data is off by σ/4, and a later tile of 64 pixels
/// (C ≥ 512) misses it by more than σ with a probability of about 3·10⁻⁴ a channel: at
/// C = 2048 half the later tiles took the fallback. From 32 it is about 4·10⁻⁶. (Those
/// rates are the normal distribution's, not counted; the profile that led here put 2.8
/// % of a one-thread forward training of 16x7x7x2048 f32 in the fallback loop.)
/// Measured on a Zen 4 (AVX-512, 2 threads, the bench's i.i.d. data; `scripts/ab.sh 5`,
/// NHWC forward training in cache, time ÷ copy, AVX-512 / AVX2): bf16 16x7x7x2048 6.95
/// / 8.12 -> 6.42 / 7.95, 16x28x28x512 3.24 / 3.31 -> 2.82 / 3.06, 16x14x14x1024 5.19 /
/// 5.78 -> 4.94 / 5.55; f32 16x7x7x2048 3.98 / 4.13 -> 3.86 / 4.00, 16x14x14x1024 2.57
/// / 2.62 -> 2.46 / 2.58. From DRAM (64x56x56x256, 64x112x112x64, three dtypes, both
/// ISAs, `scripts/ab.sh 3`) the twelve cells moved by -0.07 to +0.10, within the noise.
const PIVOT_PIXELS: usize = 32;

/// [`PIVOT_PIXELS`] for a task of one tile, whose pivots serve only that tile, of which
/// they are a part: there 16 pixels miss by more than σ about as rarely as 32 do for a
/// later tile. (32 made NHWC 2x8x8x32 forward training 3-6 % slower on the Zen 4.)
const PIVOT_PIXELS_ONE_TILE: usize = 16;

/// The per-channel means of the whole pixels `px` (`c` channels each) into `pivot`
/// (vectors) and `pivots` (lanes); `acc` is scratch of at least `sets` accumulator sets.
#[inline(always)]
fn tile_pivots<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    px: &[T],
    c: usize,
    sets: usize,
    acc: &mut [S::V],
    pivot: &mut [S::V],
    pivots: &mut [U],
) {
    let (l, groups) = (S::LANES, pivot.len());
    let sums = &mut acc[..sets * groups];
    sums.fill(s.splat(U::ZERO));
    // The head of every task: its first lines were read with no hint ahead of them, a
    // miss to DRAM at a time (perf, NHWC 64x28x28x1024 bf16 `moments` on Zen 3: this
    // loop was 5.6 % of the pass for 6 % of its bytes). Now the first PREFETCH_BYTES
    // before the loop and, per pixel, the lines PREFETCH_BYTES on.
    let ahead = PREFETCH_BYTES / std::mem::size_of::<T>();
    s.prefetch_lines(px.as_ptr(), px.len().min(ahead));
    // The set cycles by a counter, not `i % sets` (perf showed the `div` among the
    // hottest instructions of this kernel at C = 32).
    let mut set = 0;
    for p in px.chunks_exact(c) {
        s.prefetch_lines(p.as_ptr().wrapping_add(ahead), c);
        accumulate(s, p, &mut sums[set * groups..][..groups]);
        set = next_cyclic(set, sets);
    }
    let inv = s.splat(U::from_f64(1.0 / (px.len() / c) as f64));
    for (g, p) in pivot.iter_mut().enumerate() {
        let mut sum = sums[g];
        for k in 1..sets {
            sum = s.add(sum, sums[k * groups + g]);
        }
        *p = s.mul(sum, inv);
        s.store(&mut pivots[g * l..], *p);
    }
}

/// `a[g] += px[g·L..]` for every channel group of one pixel (the last group partial).
#[inline(always)]
fn accumulate<U: Real, S: Simd<U>, T: Element<Stat = U>>(s: S, px: &[T], a: &mut [S::V]) {
    let r = Reads::new(S::LANES, [px], px.len());
    let a = &mut a[..r.vectors() + usize::from(r.tail().1 > 0)];
    for (g, acc) in a.iter_mut().enumerate().take(r.vectors()) {
        let [v] = r.load(s, g);
        *acc = s.add(*acc, v);
    }
    let (at, n) = r.tail();
    if n > 0 {
        let g = r.vectors();
        a[g] = s.add(a[g], s.load_partial(&px[at..]));
    }
}

/// Per channel of a channels-last tile: `Σ(x − pivot)` into `sum1`, `Σ(x − pivot)²`
/// into `sum2` (lanes past C have pivot 0 and load as 0, so they add 0).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn deviation_sums_px<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    tile: &[T],
    c: usize,
    sets: usize,
    pivot: &[S::V],
    acc: &mut [S::V],
    quads: bool,
    (sum1, sum2): (&mut [U], &mut [U]),
) {
    let (l, groups) = (S::LANES, pivot.len());
    // Pixels of up to four vectors (C ≤ 32 f32 lanes on AVX2, 64 on AVX-512): every
    // accumulator in a register.
    match groups {
        1 => return deviation_sums_regs::<U, S, T, 1, 4>(s, tile, c, pivot, (sum1, sum2)),
        2 => return deviation_sums_regs::<U, S, T, 2, 2>(s, tile, c, pivot, (sum1, sum2)),
        3 => return deviation_sums_regs::<U, S, T, 3, 1>(s, tile, c, pivot, (sum1, sum2)),
        4 => return deviation_sums_regs::<U, S, T, 4, 1>(s, tile, c, pivot, (sum1, sum2)),
        _ => {}
    }
    let (full, zero) = (c / l, s.splat(U::ZERO));
    let (v1, rest) = acc.split_at_mut(sets * groups);
    let v2 = &mut rest[..sets * groups];
    v1.fill(zero);
    v2.fill(zero);
    let pivot = &pivot[..groups];
    // With over 4 vectors of channels the accumulators are in memory, and perf puts a
    // third of this loop on the instruction after the load of x: the loads likely wait
    // behind the accumulator stores (which they alias modulo 4 KiB), so a load that
    // misses the cache starts late and few misses overlap (NHWC C = 256 statistics
    // read DRAM at 12–17 GB/s, where C = 64, accumulators in registers, read 27). A
    // prefetch waits on nothing. The four-pixel loop prefetches in cache too (unlike
    // the backward sums' `Quads::Cached`): from L3 it halves the time (Zen 3, one
    // thread, 5 rounds: 16x28x28x512 bf16 2.22 -> 1.24 ms; from DRAM, 2 threads,
    // 64x56x56x256 bf16 10.1 -> 5.5 ms), and in L2 it made no difference beyond the
    // noise (16x7x7x2048 and 16x14x14x1024, f32 and bf16).
    // Tried (2026-12-02, Zen 4), not kept: (1) at least one quad ahead (4·C, further
    // than PREFETCH_BYTES above C = 1024 in 16-bit and C = 512 in f32, where these
    // hints fall in the quad being read): forward training of 16x7x7x2048 and
    // 16x14x14x1024 (in cache) moved as much as the cell the change did not touch
    // (bf16 16x14x14x1024), and the moments of 16x7x7x2048 f32 alone took 259-279 us
    // with it, 226-298 without (three runs each). (2) The quads walked a block
    // of four channel groups at a time over the whole tile, the sums in registers (the
    // same values added in the same order: the same bits, checked): in cache the
    // moments of 16x7x7x2048 f32 took 192 us against 203 with AVX-512 but 265 against
    // 170 with AVX2, and from DRAM NHWC forward training went 1.47 -> 2.01 of a copy
    // (bf16 AVX2 64x56x56x256), 1.30 -> 1.63 (bf16 AVX-512): the strided walks cost
    // more than the accumulator stores they save. (3) Two or four quads per update of
    // the accumulators in the paired loop below (each quad's sums added in turn: the
    // same bits, checked): the moments of bf16 64x112x112x64 and 64x56x56x256 with AVX2
    // (in-process, AVX-512 and both variants interleaved, medians of 40, three runs)
    // took 2-10 % less with two written out (+0.7 to −3 % written as a loop over the
    // quads), 5-19 % more with four: too little to show in the op against this
    // machine's noise. (4) These hints off for tensors in cache (a switch flipped
    // between interleaved calls, 200 each, six NHWC shapes, f32 and bf16, both ISAs):
    // 0.95-1.03 of the time with them in 18 of 24 cells, 1.09-1.26 at 16x28x28x128 f32,
    // 16x28x28x512 bf16 and 16x14x14x1024 f32 (AVX2), 1.9-2.1 at 16x56x56x256 bf16.
    // (5) These hints 16 KiB ahead instead of 8 (a trial build, `scripts/ab.sh 5`, NHWC
    // forward training bf16 and f16, 64x56x56x256 and 64x112x112x64, both ISAs): four
    // of eight cells lower by at most 0.05 of a copy, four higher by up to 0.19.
    // (6) On a Zen 3 (2026-12-02, bf16 64x56x56x256 `moments` ÷ a read, interleaved in
    // one process): 4, 12, 16, 24 and 32 KiB ahead, prefetcht0, and one pixel at a
    // time all within the noise; at C = 512 and 1024, where these statistics take
    // 1.4-1.8 of a read (C = 64: 0.8-1.0), distances up to 32 KiB changed nothing.
    // (7) Two of the adds of each vector of the pair loop below as `fma(d, 1, e)` (the
    // same bits), to unload the add ports: slower, one thread in L2 (NHWC 1x16x32x256
    // bf16), 15.0 -> 16.0 us (medians of three runs).
    // (8) Two quads per update of the accumulators again, in both four-pixel loops
    // (the paired one and `quad_rest`'s, each accumulator taking the two quads' sums
    // in turn in registers: the same bits, every output of four NHWC shapes compared
    // byte for byte), on a Zen 3 (2026-12-07, `scripts/ab.sh`, NHWC forward training
    // from DRAM, 64x56x56x256 and 64x112x112x64, bf16 and f16): base / two quads /
    // base, 3 of 4 cells above both base runs, 1 between; two quads / base / two
    // quads, base below both in 1 (f16 64x112x112x64 1.41 / 1.11 / 1.36 of a copy),
    // above both in 1 (bf16 64x112x112x64 1.21 / 1.30 / 1.25), between in 2. Not kept.
    let ahead = PREFETCH_BYTES / std::mem::size_of::<T>();
    // With `quads`, four pixels at a time: one accumulator update (two loads, two
    // stores) per four vectors of x, not per vector. For tensors in cache, where those
    // stores were the bottleneck (Zen 4, f32 moments, interleaved medians): 16x7x7x2048
    // 0.36 -> 0.27 ms with AVX-512, 0.37 -> 0.32 ms with AVX2; 16x14x14x1024 AVX-512
    // 0.51 -> 0.39 ms; 16x14x14x256 AVX2 0.130 -> 0.091 ms. From DRAM the four interleaved pixel streams were
    // slower than memory order (64x56x56x256 f32 AVX-512 8.4 -> 9.5 ms, 16x28x28x512
    // f32 AVX2 0.85 -> 1.21 ms), so larger f32 tensors keep one pixel at a time
    // (16-bit ones do not: see `channels_last`).
    let mut blocks = tile.chunks_exact(4 * c);
    if quads {
        let (a, b) = (&mut v1[..groups], &mut v2[..groups]);
        // Whole vectors taken two at a time in the order of `Simd::load_pair_ptr` where
        // the ISA has a cheaper one (AVX2 bf16: even and odd channels, one shift and
        // one mask per 16 elements instead of two widenings), with their pivots and
        // sums in that order for the tile (the sums put back before the pixels left
        // over). Each channel adds the same values in the same order: the same bits.
        // Zen 1 (AVX2 only), `scripts/ab.sh 5`, NHWC forward training bf16, time ÷ copy:
        // 64x112x112x64 1.558 -> 1.484, 64x56x56x256 1.642 -> 1.589 (CHANGELOG).
        let paired = if s.pair_even_odd::<T>() {
            full / 2 * 2
        } else {
            0
        };
        let mut eo: Scratch<S::V, 32> = scratch(zero, paired);
        for g in (0..paired).step_by(2) {
            (eo[g], eo[g + 1]) = s.to_pair_order::<T>(pivot[g], pivot[g + 1]);
        }
        let eo = &eo[..];
        if paired > 0 {
            // The pairs through the quad's first element and the pixel stride, their
            // ranges proved once: with a `Reads` of four slices a quad, the loop kept
            // four bounds checks and eight reloads from the stack a pair (AVX2 bf16,
            // `perf annotate`), as the backward sums' four-pixel loop did (see
            // `backward::sums_quad`).
            assert!(paired.is_multiple_of(2) && eo.len() >= paired && paired * l <= c);
            for q in &mut blocks {
                let (base, pf) = (q.as_ptr(), q.as_ptr().wrapping_add(ahead));
                let (ap, bp) = (&mut a[..paired], &mut b[..paired]);
                let pairs = ap.chunks_exact_mut(2).zip(bp.chunks_exact_mut(2));
                for (i, ((ag, bg), pg)) in pairs.zip(eo.chunks_exact(2)).enumerate() {
                    let at = 2 * i * l;
                    // SAFETY: `q` is four pixels of `c` elements and `at + 2·l <=
                    // paired·l <= c` (checked above): each pair lies in its pixel.
                    let (e, o) = unsafe {
                        let (e0, o0) = s.load_pair_ptr(base.add(at));
                        let (e1, o1) = s.load_pair_ptr(base.add(c + at));
                        let (e2, o2) = s.load_pair_ptr(base.add(2 * c + at));
                        let (e3, o3) = s.load_pair_ptr(base.add(3 * c + at));
                        ([e0, e1, e2, e3], [o0, o1, o2, o3])
                    };
                    s.prefetch_lines(pf.wrapping_add(4 * at), 8 * l);
                    for (k, x) in [e, o].into_iter().enumerate() {
                        let p = pg[k];
                        let [x0, x1, x2, x3] = x;
                        let (d0, d1, d2, d3) =
                            (s.sub(x0, p), s.sub(x1, p), s.sub(x2, p), s.sub(x3, p));
                        let sq = s.mul_add(d1, d1, s.mul(d0, d0));
                        let sq = s.mul_add(d3, d3, s.mul_add(d2, d2, sq));
                        ag[k] = s.add(ag[k], s.add(s.add(d0, d1), s.add(d2, d3)));
                        bg[k] = s.add(bg[k], sq);
                    }
                }
                quad_rest(s, q, c, paired, pivot, pf, a, b);
            }
            for g in (0..paired).step_by(2) {
                (a[g], a[g + 1]) = s.to_lane_order::<T>(a[g], a[g + 1]);
                (b[g], b[g + 1]) = s.to_lane_order::<T>(b[g], b[g + 1]);
            }
        } else {
            for q in &mut blocks {
                let pf = q.as_ptr().wrapping_add(ahead);
                quad_rest(s, q, c, 0, pivot, pf, a, b);
            }
        }
    }
    let rest = if quads { blocks.remainder() } else { tile };
    let mut set = 0;
    for px in rest.chunks_exact(c) {
        let k = set * groups;
        set = next_cyclic(set, sets);
        let (a, b) = (&mut v1[k..][..groups], &mut v2[k..][..groups]);
        let r = Reads::new(l, [px], c);
        let pf = px.as_ptr().wrapping_add(ahead);
        for g in 0..r.vectors().min(groups) {
            s.prefetch_ptr(pf.wrapping_add(g * l));
            let [v] = r.load(s, g);
            let d = s.sub(v, pivot[g]);
            a[g] = s.add(a[g], d);
            b[g] = s.mul_add(d, d, b[g]);
        }
        if full < groups {
            let d = s.sub(s.load_partial(&px[full * l..]), pivot[full]);
            a[full] = s.add(a[full], d);
            b[full] = s.mul_add(d, d, b[full]);
        }
    }
    for g in 0..groups {
        let (mut a, mut b) = (v1[g], v2[g]);
        for k in 1..sets {
            a = s.add(a, v1[k * groups + g]);
            b = s.add(b, v2[k * groups + g]);
        }
        s.store(&mut sum1[g * l..], a);
        s.store(&mut sum2[g * l..], b);
    }
}

/// One quad of [`deviation_sums_px`]'s four-pixel loop (`q`: four pixels of `c`
/// channels), vectors `from..` of each pixel and the partial one, in the order of the
/// lanes; `pf`: the quad's address plus the prefetch distance.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn quad_rest<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    q: &[T],
    c: usize,
    from: usize,
    pivot: &[S::V],
    pf: *const T,
    a: &mut [S::V],
    b: &mut [S::V],
) {
    let (l, groups) = (S::LANES, pivot.len());
    let full = c / l;
    let r = Reads::new(l, [&q[..c], &q[c..2 * c], &q[2 * c..3 * c], &q[3 * c..]], c);
    for g in from..r.vectors().min(groups) {
        let [x0, x1, x2, x3] = r.load(s, g);
        // The four pixels are contiguous: the lines of the four vectors' worth of the
        // quad at this step, in memory order. After the loads in the source, and so in
        // the machine code: with the hints ahead of them (LLVM's choice from ed7a85c on,
        // with no change here) NHWC forward training of 64x56x56x256 with AVX-512 took
        // 1.28-1.30 of a copy instead of 1.20-1.24 in f16, 1.41-1.42 instead of 1.35 in
        // bf16 (`scripts/ab.sh 3`, two runs); AVX2 moved within the noise.
        s.prefetch_lines(pf.wrapping_add(4 * g * l), 4 * l);
        let p = pivot[g];
        let (d0, d1, d2, d3) = (s.sub(x0, p), s.sub(x1, p), s.sub(x2, p), s.sub(x3, p));
        let sq = s.mul_add(d1, d1, s.mul(d0, d0));
        let sq = s.mul_add(d3, d3, s.mul_add(d2, d2, sq));
        a[g] = s.add(a[g], s.add(s.add(d0, d1), s.add(d2, d3)));
        b[g] = s.add(b[g], sq);
    }
    if full < groups {
        // The quad's last line(s): the whole vectors' hints above cover `4·full·L`
        // elements of the `4·C`, and a line left to a demand miss once a quad (C = 200
        // f16 with AVX-512: one of 25) made NHWC forward training of 64x56x56x200 1.55
        // of a copy against 1.40 with this hint (Zen 4, `scripts/ab.sh 9`).
        s.prefetch_lines(pf.wrapping_add(4 * full * l), 4 * (c - full * l));
        for k in 0..4 {
            let d = s.sub(
                s.load_partial(&q[k * c + full * l..][..c - full * l]),
                pivot[full],
            );
            a[full] = s.add(a[full], d);
            b[full] = s.mul_add(d, d, b[full]);
        }
    }
}

/// [`deviation_sums_px`] for pixels of `G` vectors (the last one partial when `C` is
/// not a multiple of the lanes), with the `2·G·SETS` accumulators in registers: `SETS`
/// consecutive pixels go to separate sets, so that at least four add chains run at once.
///
/// Accumulators in memory (a store → load → add chain per pixel) stall every load of x
/// that aliases one of them modulo 4 KiB. With small C that was the whole cost of the
/// pass: a process saw either 1.3 or 2.3 µs for the moments of 2x8x8x32 f32 (Zen 3),
/// depending on where its buffers landed.
#[inline(always)]
fn deviation_sums_regs<
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    const G: usize,
    const SETS: usize,
>(
    s: S,
    tile: &[T],
    c: usize,
    pivot: &[S::V],
    sums: (&mut [U], &mut [U]),
) {
    // Whether the last vector is partial, decided once: inside the loop a test per
    // vector (and a prefetch loop of C-dependent length per block) stayed in the
    // machine code (NHWC 64x112x112x64 f16, AVX-512).
    if c.is_multiple_of(S::LANES) {
        regs_loop::<U, S, T, G, SETS, false>(s, tile, c, pivot, sums)
    } else {
        regs_loop::<U, S, T, G, SETS, true>(s, tile, c, pivot, sums)
    }
}

/// [`deviation_sums_regs`] with `PARTIAL` = whether `C` is not a multiple of the lanes.
#[inline(always)]
fn regs_loop<
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    const G: usize,
    const SETS: usize,
    const PARTIAL: bool,
>(
    s: S,
    tile: &[T],
    c: usize,
    pivot: &[S::V],
    (sum1, sum2): (&mut [U], &mut [U]),
) {
    let (l, zero) = (S::LANES, s.splat(U::ZERO));
    // Whole vectors a pixel: every load of `pixel_deviations` lies inside its pixel.
    let full = if PARTIAL { G - 1 } else { G };
    assert!(c / l == full && c.div_ceil(l) == G && tile.len().is_multiple_of(c));
    let pivot: [S::V; G] = std::array::from_fn(|g| pivot[g]);
    let (mut a, mut b) = ([[zero; G]; SETS], [[zero; G]; SETS]);
    // x prefetched PREFETCH_BYTES ahead, one hint per line: on an Intel Xeon (AVX-512,
    // 2 threads, `scripts/ab.sh`) NHWC forward training of 64x112x112x64 from DRAM went
    // 1.29 -> 1.16 of a copy in f32, 1.61 -> 1.29 in bf16, 1.61 -> 1.23 in f16
    // (64x112x112x32 f32 1.22 -> 1.04); in-cache shapes (16x56x56x64, 16x28x28x32)
    // moved within the noise. A block of whole vectors is a constant length, so its
    // hints are unrolled.
    let ahead = PREFETCH_BYTES / std::mem::size_of::<T>();
    let block_len = if PARTIAL { SETS * c } else { SETS * G * l };
    let mut blocks = tile.chunks_exact(SETS * c);
    for block in &mut blocks {
        s.prefetch_lines(block.as_ptr().wrapping_add(ahead), block_len);
        for k in 0..SETS {
            let px = &block[k * c..][..c];
            // SAFETY: a pixel of `c` elements, `c / l == full` (checked above).
            unsafe { pixel_deviations::<U, S, T, G, PARTIAL>(s, px, &pivot, &mut a[k], &mut b[k]) };
        }
    }
    for px in blocks.remainder().chunks_exact(c) {
        // SAFETY: as above.
        unsafe { pixel_deviations::<U, S, T, G, PARTIAL>(s, px, &pivot, &mut a[0], &mut b[0]) };
    }
    for g in 0..G {
        let (mut u, mut v) = (a[0][g], b[0][g]);
        for k in 1..SETS {
            u = s.add(u, a[k][g]);
            v = s.add(v, b[k][g]);
        }
        s.store(&mut sum1[g * l..], u);
        s.store(&mut sum2[g * l..], v);
    }
}

/// One pixel of `G` vectors (all whole, or with `PARTIAL` the last one partial) into
/// `a += x − pivot`, `b += (x − pivot)²`.
///
/// # Safety
/// `px` holds the whole vectors: `px.len() >= (G − 1)·LANES` with `PARTIAL`, `>=
/// G·LANES` without (the partial vector is loaded checked).
#[inline(always)]
unsafe fn pixel_deviations<
    U: Real,
    S: Simd<U>,
    T: Element<Stat = U>,
    const G: usize,
    const PARTIAL: bool,
>(
    s: S,
    px: &[T],
    pivot: &[S::V; G],
    a: &mut [S::V; G],
    b: &mut [S::V; G],
) {
    let (l, full) = (S::LANES, if PARTIAL { G - 1 } else { G });
    debug_assert!(px.len() >= full * l && (PARTIAL || px.len() == G * l));
    for g in 0..G {
        let v = if g < full {
            // SAFETY: `(g + 1)·l <= full·l <= px.len()` (the caller's guarantee).
            unsafe { s.load_ptr(px.as_ptr().add(g * l)) }
        } else {
            s.load_partial(&px[full * l..])
        };
        let d = s.sub(v, pivot[g]);
        a[g] = s.add(a[g], d);
        b[g] = s.mul_add(d, d, b[g]);
    }
}

fn channels_last<T: Element>(g: &Geometry, isa: Isa, x: &[T]) -> Vec<Moments> {
    let c = g.channels;
    // A fixed size, not this machine's cache, so that the summation order (and with it
    // the last bits) depends on the shape alone. 16-bit types take four pixels at a
    // time from DRAM too: a vector of them is half the bytes of an f32 one for the same
    // accumulator updates, and there the stores cost more than the interleaved pixel
    // streams (Zen 4, `moments` from DRAM, 7 interleaved rounds, medians: bf16 AVX2
    // 64x56x56x256 4.70 -> 4.48 ms, 64x112x112x64 3.99 -> 3.63 ms, 64x28x28x512 2.64 ->
    // 2.39 ms; bf16 AVX-512 64x56x56x256 4.69 -> 4.44 ms; f16 AVX2 4.84 -> 4.24 ms).
    let quads = std::mem::size_of_val(x) < STREAM_BYTES || std::mem::size_of::<T>() == 2;
    // Tried and not kept (2026-11-30, Intel Xeon model 207, 300 MiB L3): a task's tiles
    // after the first walked as two halves in lockstep (two read streams a thread, each
    // tile's sums kept and taken in tile order: the same bits, checked by a test across
    // ISAs and dtypes). Timed alone, with the two builds' orders alternating over 16
    // rounds, the moments of 64x56x56x256 bf16 with AVX2 went 0.51 -> 0.43 of a
    // one-thread copy (64x112x112x64 0.34 -> 0.31; AVX-512 0.40 -> 0.39). Forward
    // training did not follow: `scripts/ab.sh 8 "--shape 64,56,56,256 --format NHWC
    // --op forward_training --dtype bf16,f16,f32 --isa avx2,avx512"` gave the 16-bit
    // cells 0.01-0.05 of a copy higher and f32 0.02-0.05 lower, and at 192x56x56x256
    // (x and y 616 MB in bf16, past the L3) the four 16-bit cells moved by -0.02 to
    // +0.04. No gain in the op, 150 lines more: reverted.
    // Past glibc's first `mmap` threshold a task's scratch and results come from the
    // threads' arenas (`with_arena`), which keep them between tasks and calls: from the
    // heap, each task's were fresh pages at large C (NHWC 4096x1x1x8192 bf16: about
    // 2,600 page faults a statistics call, Zen 3). Below it the heap, as before: with
    // the arena every in-cache NHWC 16x7x7x2048 forward training cell was slower
    // (Zen 3, `scripts/ab.sh 9`: f32 3.58 of a copy against 3.26 and 3.27, bf16 6.06
    // against 5.56 and 5.62), for a reason not found.
    let large = c * std::mem::size_of::<Moments>() >= ARENA_MIN_BYTES;
    // The moments of the task of elements `range` merged into `out` (C of them).
    let task = |range: std::ops::Range<usize>, out: &mut [Moments]| {
        let x = &x[range];
        let run = |out: &mut [Moments], arena: Option<&bumpalo::Bump>| {
            T::Stat::dispatch(
                isa,
                PixelMoments {
                    x,
                    c,
                    out,
                    quads,
                    arena,
                },
            )
        };
        arena_if(large, |arena| run(out, arena));
    };
    let split = PixelSplit::reduce(g);
    if split.len() <= 1 {
        // One task (a small tensor): its moments are the total, with no per-task
        // results.
        let mut total = vec![Moments::EMPTY; c];
        task(split.range(0), &mut total);
        return total;
    }
    if !large {
        let partials = split.map(g, |range| {
            let mut out = vec![Moments::EMPTY; c];
            task(range, &mut out);
            out
        });
        // The first task's moments are the total so far (merging them into empty ones
        // gives the same bits).
        let mut partials = partials.into_iter();
        let mut total = partials.next().unwrap_or_else(|| vec![Moments::EMPTY; c]);
        let rest: Vec<Vec<Moments>> = partials.collect();
        let rest: Vec<&[Moments]> = rest.iter().map(|p| &p[..]).collect();
        let parallel = g.parallel() && c > MERGE_BLOCK && rest.len() * c >= MERGE_PARALLEL;
        merge_tasks(&mut total, &rest, parallel);
        return total;
    }
    // At large C the tasks' moments in waves (`task_waves`: the calling thread's buffer
    // of them, kept between calls), merged
    // into the total in task order (the first merged into empty moments: its own bits).
    let mut total = vec![Moments::EMPTY; c];
    let items = vec![(); split.len()];
    let run = |t: usize, _: (), out: &mut [Moments]| task(split.range(t), out);
    task_waves(g, items, c, Moments::EMPTY, run, |parts| {
        let parallel = g.parallel() && c > MERGE_BLOCK && parts.len() >= MERGE_PARALLEL;
        let parts: Vec<&[Moments]> = parts.chunks_exact(c).collect();
        merge_tasks(&mut total, &parts, parallel);
    });
    total
}

/// `total[ch]` merged with every task's `rest[t][ch]` in task order. With `parallel`,
/// the channels in blocks shared by the pool: the same bits as one loop, since each
/// channel's merges are the same in the same order (`merge_into` is exact per
/// element). On one thread it was a serial tail the other core idled through (perf,
/// NHWC 64x28x28x1024 bf16 `moments` from DRAM on Zen 3, 195 tasks: `merge_into` 3.8 %
/// of the samples). Besides its unit test, the parallel path is checked against the
/// f64 reference by `tests/properties.rs`' 16-bit channels-last tests (2x130x100x1000,
/// about 100 tasks of 1,000 channels: an `assert!(!parallel)` here failed both).
fn merge_tasks(total: &mut [Moments], rest: &[&[Moments]], parallel: bool) {
    let merge = |(i, block): (usize, &mut [Moments])| {
        for p in rest {
            Moments::merge_into(block, &p[i * MERGE_BLOCK..][..block.len()]);
        }
    };
    if parallel {
        total
            .par_chunks_mut(MERGE_BLOCK)
            .enumerate()
            .for_each(merge);
    } else {
        total.chunks_mut(MERGE_BLOCK).enumerate().for_each(merge);
    }
}

/// Channels per block of [`merge_tasks`].
const MERGE_BLOCK: usize = 128;
/// The fewest merges (tasks after the first × channels) [`merge_tasks`] shares with the
/// pool: below it a parallel region cost more than it saved (NHWC 16x14x14x256 bf16
/// `moments` in cache, 3 × 256 merges: 54 -> 64 us with it). It was `1 << 15`, which
/// kept the merges of every in-cache ResNet-50 shape with C ≥ 512 (12,288 each: 6 ×
/// 2048, 12 × 1024, 24 × 512) on one thread while the other waited (perf, NHWC
/// 16x7x7x2048 f32 forward training, two threads: the merge 2.6 % of the samples,
/// all on one thread). At `1 << 13` (Zen 4, `scripts/ab.sh 7`, NHWC forward training,
/// f32 and bf16, both ISAs, time ÷ copy) all 12 cells of those three shapes were
/// lower: 16x7x7x2048 bf16 AVX-512 6.95 -> 5.74, f32 3.95 -> 3.44; 16x14x14x1024
/// 2.29–5.24 from 2.46–5.55; 16x28x28x512 by 0.03–0.06. 16x56x56x256 (48 × 256, now
/// shared too) and 32x28x28x512 moved within ±0.03.
const MERGE_PARALLEL: usize = 1 << 13;

#[cfg(test)]
mod tests {
    use super::{channel_moments, channel_rows_in, Moments};
    use crate::element::{Element, Real};
    use crate::kernels::simd::{Dispatch, Isa, Kernel, Simd};
    use crate::kernels::{ChannelMajorSplit, Geometry};

    /// Asserts `got` and `want` the same bits channel by channel (any NaN equals any
    /// NaN); `what` names the case.
    fn assert_same_moments(got: &[Moments], want: &[Moments], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: channel counts");
        let same = |p: f64, q: f64| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan());
        for (ch, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                same(a.count, b.count) && same(a.mean, b.mean) && same(a.m2, b.m2),
                "{what} channel {ch}: {a:?} vs {b:?}"
            );
        }
    }

    /// Every channel's moments by `channel_rows_in` alone, one channel at a time over
    /// rows `[o0, o1)`: what the resident passes compute.
    struct ByChannel<'a, T> {
        g: &'a Geometry,
        x: &'a [T],
        rows: (usize, usize),
    }

    impl<T: Element> Kernel<T::Stat> for ByChannel<'_, T> {
        type Output = Vec<Moments>;
        fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<Moments> {
            let (o0, o1) = self.rows;
            let mut out = Vec::new();
            for c in 0..self.g.channels {
                out.push(channel_rows_in(s, self.g, self.x, c, o0, o1));
            }
            out
        }
    }

    /// Channels of one tile take the batched path. Where their rows are not summed by
    /// groups (shorter than a vector of the ISA, or longer than `GROUP_ROW_BYTES`), it
    /// must give `channel_rows_in`'s bits channel by channel: the resident passes use
    /// the latter, and take rows of `RESIDENT_MIN_ROW_BYTES` and more only (past
    /// `GROUP_ROW_BYTES`, checked at compile time). Rows summed by groups (7x7, 8x8,
    /// rows of exactly a vector, 12, 17 and 24 elements: whole vectors with and without
    /// a tail, groups of 4, 2 and 1 channels by ISA) must give each channel the bits of
    /// the same channel after three other channels (another place in another group,
    /// other neighbours), be within 1e-6 of a std (mean) and 1e-5 (M2) of the f64
    /// two-pass moments of its values, and take NaN and Inf channels the exact path
    /// as `channel_rows_in` does (the same bits), among them an Inf in a later row
    /// where the row's tail vector zeroes its lane (Inf·0) while its whole vector sums
    /// it. f32, bf16 and f16; every ISA; a misleading head (the exact fallback) and
    /// far-from-zero data.
    #[test]
    fn one_tile_channels_match_channel_rows_in_bit_for_bit() {
        fn check<T: Element>() {
            let lanes = |isa: Isa| if isa == Isa::Avx512 { 16 } else { 8 };
            let size = size_of::<T>();
            for isa in Isa::supported() {
                for (outer, c, inner) in [
                    (2, 32, 64),
                    (16, 5, 49),
                    (16, 13, 49),
                    (3, 4, 3),
                    (3, 6, 8),
                    (4, 5, 16),
                    (3, 5, 12),
                    (1, 7, 17),
                    (5, 11, 24),
                    (4, 3, 200),
                ] {
                    let g = Geometry::new(outer, c, inner);
                    assert_eq!(ChannelMajorSplit::new(&g).tasks(&g).len(), 1);
                    let grouped = inner * size <= super::GROUP_ROW_BYTES && inner >= lanes(isa);
                    for case in 0..5 {
                        let x: Vec<T> = (0..g.len())
                            .map(|i| {
                                let v = (i * 7919 % 1013) as f64 / 1013.0 - 0.5;
                                let (o, ch, at) = (i / (c * inner), i / inner % c, i % inner);
                                let v = match (case, ch) {
                                    (1, _) => 3.0e4 + 100.0 * v,
                                    (2, 1) if at < 8 && o == 0 => 1000.0,
                                    (3, 2) if i % 5 == 0 => f64::NAN,
                                    (3, 0) if i % 7 == 0 => f64::INFINITY,
                                    // Row 1, second-last element: inside the last whole
                                    // vector and under the tail vector's zeroed lanes.
                                    (4, 3) if o == 1 && at + 2 == inner => f64::INFINITY,
                                    _ => v,
                                };
                                T::narrow(<T::Stat as Real>::from_f64(v))
                            })
                            .collect();
                        let got = channel_moments(&g, isa, &x);
                        let want = T::Stat::dispatch(
                            isa,
                            ByChannel {
                                g: &g,
                                x: &x,
                                rows: (0, outer),
                            },
                        );
                        let what =
                            format!("{:?} {isa:?} {outer}x{c}x{inner} case {case}", T::DTYPE);
                        if !grouped {
                            assert_same_moments(&got, &want, &what);
                            continue;
                        }
                        // The same channels after three others (of other values): each
                        // in another place in its group, beside other channels.
                        let wider: Vec<T> = (0..outer)
                            .flat_map(|o| {
                                let others = (0..3 * inner).map(move |i| {
                                    T::narrow(<T::Stat as Real>::from_f64(
                                        (o * 31 + i) as f64 * 0.37,
                                    ))
                                });
                                others.chain(x[o * c * inner..][..c * inner].iter().copied())
                            })
                            .collect();
                        let shifted =
                            channel_moments(&Geometry::new(outer, c + 3, inner), isa, &wider);
                        for ch in 0..c {
                            let what = format!("{what} channel {ch}");
                            let v: Vec<f64> = (0..outer)
                                .flat_map(|o| &x[(o * c + ch) * inner..][..inner])
                                .map(|v| v.widen().to_f64())
                                .collect();
                            assert_same_moments(&got[ch..ch + 1], &shifted[ch + 3..ch + 4], &what);
                            if v.iter().any(|v| !v.is_finite()) {
                                assert_same_moments(&got[ch..ch + 1], &want[ch..ch + 1], &what);
                                continue;
                            }
                            let (m, r) = (got[ch], exact(&v));
                            let sd = (r.m2 / r.count).sqrt();
                            assert_eq!(m.count, r.count, "{what}");
                            assert!(
                                (m.mean - r.mean).abs() <= 1e-6 * sd
                                    && (m.m2 - r.m2).abs() <= 1e-5 * r.m2,
                                "{what}: {m:?} vs {r:?}"
                            );
                        }
                    }
                }
            }
        }
        check::<f32>();
        check::<half::bf16>();
        check::<half::f16>();
    }

    /// Past [`ARENA_MIN_BYTES`](crate::kernels::ARENA_MIN_BYTES) of moments a task (C
    /// of 5,462 and more), the channels-last tasks' moments come in waves from the
    /// arena: the total is still every task's moments merged in task order, bit for
    /// bit, over more than one wave. Each task's moments are those of a tensor of its
    /// pixels alone (one task: 64 pixels of 22,000 channels; bf16, which takes four
    /// pixels at a time at any size, so a task's sums do not depend on the tensor's).
    #[test]
    fn large_c_moments_are_the_tasks_merged_in_order_bit_for_bit() {
        use half::bf16;
        let (pixels, c, per_task) = (300, 22_000, 64);
        let g = Geometry::new(pixels, c, 1);
        assert_eq!(super::PixelSplit::reduce(&g).len(), 5);
        let x: Vec<bf16> = (0..g.len())
            .map(|i| bf16::from_f32((i * 7919 % 1013) as f32 * 0.01 + (i % c) as f32 * 0.1 + 50.0))
            .collect();
        for isa in Isa::supported() {
            let got = channel_moments(&g, isa, &x);
            let mut want = vec![Moments::EMPTY; c];
            for part in x.chunks(per_task * c) {
                let one = Geometry::new(part.len() / c, c, 1);
                let m = channel_moments(&one, isa, part);
                for (w, m) in want.iter_mut().zip(m) {
                    *w = w.merge(m);
                }
            }
            assert_same_moments(&got, &want, &format!("{isa:?}"));
        }
    }

    /// Channels-last moments of bf16 `x` must be those of the same values as f32, bit
    /// for bit, on every ISA: the lanes meet the same pivots in the same order, whatever
    /// order the 16-bit loads come in (AVX2 loads bf16 pairs as even and odd channels in
    /// `deviation_sums_px`'s four-pixel loop). C of whole pairs of vectors, with one
    /// vector left over, with a partial vector; tiles of a whole number of quads and
    /// not, several tiles; near-zero, far-from-zero and NaN channels. Only an ISA with
    /// such a pair order (AVX2) exercises the paired loop; elsewhere this checks the
    /// widening alone.
    #[test]
    fn channels_last_bf16_moments_are_its_f32_moments_bit_for_bit() {
        use half::bf16;
        for isa in Isa::supported() {
            for (pixels, c) in [
                (300, 40),
                (2000, 48),
                (517, 56),
                (64, 64),
                (301, 75),
                (1100, 130),
                (259, 256),
            ] {
                let g = Geometry::new(pixels, c, 1);
                for case in 0..3 {
                    let x: Vec<bf16> = (0..g.len())
                        .map(|i| {
                            let v = (i * 7919 % 1013) as f32 / 1013.0 - 0.5 + (i % c) as f32;
                            match (case, i % c) {
                                (1, _) => bf16::from_f32(3.0e4 + 64.0 * v),
                                (2, 3) if i % 11 == 0 => bf16::NAN,
                                _ => bf16::from_f32(v),
                            }
                        })
                        .collect();
                    let wide: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                    // Small enough that f32 takes the four-pixel loop too.
                    assert!(std::mem::size_of_val(&wide[..]) < super::STREAM_BYTES);
                    let (got, want) = (
                        channel_moments(&g, isa, &x),
                        channel_moments(&g, isa, &wide),
                    );
                    let what = format!("{isa:?} {pixels}x{c} case {case}");
                    assert_same_moments(&got, &want, &what);
                }
            }
        }
    }

    /// `from_pivot_select` (the branch-free final step of a channels-last task) must be
    /// `from_pivot_f64` bit for bit: a rounding-negative M2, zero, NaN and Inf sums and
    /// pivots, counts of 1 and more.
    #[test]
    fn from_pivot_select_is_from_pivot_f64_bit_for_bit() {
        let values = [
            0.0,
            -0.0,
            1.0,
            -3.5,
            1e-300,
            7.25e10,
            f64::NAN,
            f64::INFINITY,
            -f64::INFINITY,
        ];
        for n in [1.0, 3.0, 4096.0] {
            for &p in &values {
                for &a in &values {
                    for &b in &values {
                        let (x, y) = (
                            Moments::from_pivot_f64(n, p, a, b),
                            Moments::from_pivot_select(n, p, a, b),
                        );
                        for (u, v) in [(x.count, y.count), (x.mean, y.mean), (x.m2, y.m2)] {
                            assert!(
                                u.to_bits() == v.to_bits() || (u.is_nan() && v.is_nan()),
                                "n {n} pivot {p} s1 {a} s2 {b}: {x:?} vs {y:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Two-pass moments in `f64`: the reference.
    fn exact(v: &[f64]) -> Moments {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let m2 = v.iter().map(|x| (x - mean) * (x - mean)).sum();
        Moments { count: n, mean, m2 }
    }

    /// The shift of a channel-major channel's first tile is the mean of its first 64
    /// values. Where those lie far from the rest (here 1000 against values near 0 with a
    /// std of 0.01, so sums around that shift would cancel to nothing in `f32`), the
    /// tile must be redone exactly: every ISA, rows shorter and longer than the 64
    /// values, one tile and several. With the redo turned off (`well_shifted_inv`
    /// always true) every case fails on at least one ISA: 64x3x49 (a head over two
    /// rows) with the scalar and AVX2 kernels, 2x2x1600 with AVX-512, 3x2x9000 with all
    /// three. The 16x3x49 this test had before failed on none: too few values to lose
    /// the 1e-5 asked here.
    #[test]
    fn channel_major_first_tile_with_a_misleading_head_is_exact() {
        for isa in Isa::supported() {
            for (outer, c, inner) in [(64, 3, 49), (2, 2, 1600), (3, 2, 9000)] {
                let g = Geometry::new(outer, c, inner);
                let x: Vec<f32> = (0..g.len())
                    .map(|i| {
                        // The channel's first 64 values, over as many rows as they take.
                        let (o, r) = (i / (c * inner), i % inner);
                        let noise = ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.02;
                        if (o * inner + r) < 64 {
                            1000.0 + noise
                        } else {
                            noise
                        }
                    })
                    .collect();
                let got = channel_moments(&g, isa, &x);
                for (ch, m) in got.iter().enumerate() {
                    let v: Vec<f64> = (0..outer)
                        .flat_map(|o| &x[(o * c + ch) * inner..][..inner])
                        .map(|&v| v as f64)
                        .collect();
                    let want = exact(&v);
                    assert_eq!(m.count, want.count);
                    let (dm, dv) = (
                        (m.mean - want.mean).abs() / want.mean.abs(),
                        (m.m2 - want.m2).abs() / want.m2,
                    );
                    assert!(
                        dm < 1e-6 && dv < 1e-5,
                        "{isa:?} {outer}x{c}x{inner} channel {ch}: {m:?} vs {want:?}"
                    );
                }
            }
        }
    }

    /// The final merge of the channels-last statistics gives the bits of a plain fold
    /// of `Moments::merge` over the tasks (from the first task's moments, as
    /// `channels_last` starts), whether its channel blocks are shared by
    /// the pool or not: counts equal and unequal across channels, an empty channel, an
    /// infinite mean, C not a multiple of the block.
    #[test]
    fn task_merge_in_parallel_blocks_is_the_plain_fold() {
        use super::{merge_tasks, MERGE_BLOCK};
        let c = 2 * MERGE_BLOCK + 37;
        let moments = |t: usize, ch: usize| {
            let k = (t * 7919 + ch * 104_729) % 1000;
            let count = if ch == 5 {
                0.0
            } else if ch.is_multiple_of(11) {
                (3 + k % 5) as f64
            } else {
                64.0
            };
            let mean = if ch == 9 && t == 2 {
                f64::INFINITY
            } else {
                k as f64 * 0.37 - 100.0
            };
            Moments {
                count,
                mean,
                m2: if count > 0.0 { k as f64 * 1.3 } else { 0.0 },
            }
        };
        let tasks: Vec<Vec<Moments>> = (0..6)
            .map(|t| (0..c).map(|ch| moments(t, ch)).collect())
            .collect();
        let want: Vec<Moments> = (0..c)
            .map(|ch| tasks[1..].iter().fold(tasks[0][ch], |a, p| a.merge(p[ch])))
            .collect();
        for parallel in [false, true] {
            let mut total = tasks[0].clone();
            let rest: Vec<&[Moments]> = tasks[1..].iter().map(|p| &p[..]).collect();
            merge_tasks(&mut total, &rest, parallel);
            assert_same_moments(&total, &want, &format!("parallel {parallel}"));
        }
    }

    /// `merge_into` is `merge`, element by element, bit for bit: on the fast path (equal
    /// counts, finite means) and on every fallback (a count that differs, an empty
    /// side, an infinite or NaN mean).
    #[test]
    fn merge_into_is_merge_bit_for_bit() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let m = |count: f64, mean: f64, m2: f64| Moments { count, mean, m2 };
        let mut acc: Vec<Moments> = (0..64)
            .map(|_| m(96.0, (next() - 0.5) * 1e6, next() * 1e3))
            .collect();
        let mut part: Vec<Moments> = (0..64)
            .map(|_| m(40.0, (next() - 0.5) * 1e6, next() * 1e3))
            .collect();
        acc[3].mean = f64::INFINITY;
        part[5].mean = f64::NAN;
        part[7] = Moments::EMPTY;
        part[9].count = 41.0;
        acc[11] = Moments::EMPTY;
        let want: Vec<Moments> = acc.iter().zip(&part).map(|(a, b)| a.merge(*b)).collect();
        Moments::merge_into(&mut acc, &part);
        let bits = |v: &Moments| [v.count.to_bits(), v.mean.to_bits(), v.m2.to_bits()];
        for (i, (got, want)) in acc.iter().zip(&want).enumerate() {
            assert_eq!(bits(got), bits(want), "element {i}: {got:?} vs {want:?}");
        }
        // An empty accumulator (a first task) takes the part as it is.
        let mut empty = vec![Moments::EMPTY; 4];
        Moments::merge_into(&mut empty, &part[..4]);
        assert_eq!(empty, part[..4]);
    }
}
