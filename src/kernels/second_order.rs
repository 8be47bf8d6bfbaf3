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

use super::simd::{
    load_n, load_partial_n, splat_n, sub_n, Dispatch, Isa, Kernel, Reads, Simd, Writes, MAX_LANES,
};
use super::{
    arena_if, channel_tiles, for_each_row_chunk_pair, next_cyclic, pixels_per_tile, scratch,
    scratch_in, task_waves, ChannelMajorSplit, ChannelTask, Geometry, PixelSplit, RowOrder,
    Scratch, ARENA_MIN_BYTES, IMAGE_BLOCK_CHANNELS,
};
use crate::element::{Element, Real};

/// One channel's sums of the second-order reduction, in `f64`, with `g' = g − kg`,
/// `A' = A − ka` (the shifts given to [`reduce`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SecondOrderSums {
    /// `Σg'`.
    pub g: f64,
    /// `ΣA'`.
    pub a: f64,
    /// `Σg'·(x − μ)`.
    pub g_xc: f64,
    /// `ΣA'·(x − μ)`.
    pub a_xc: f64,
    /// `ΣA'·g'`.
    pub a_g: f64,
    /// `Σ(x − μ)`.
    pub xc: f64,
}

type Six = [f64; 6];

/// `v[i][at..at + len]` for each of the three inputs (spelled out: `[T; N]::map` with a
/// closure is not always inlined into the kernels' target-feature code).
#[inline(always)]
fn window<T>(v: [&[T]; 3], at: usize, len: usize) -> [&[T]; 3] {
    [
        &v[0][at..at + len],
        &v[1][at..at + len],
        &v[2][at..at + len],
    ]
}

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
) -> Vec<SecondOrderSums> {
    let size = size_of::<T>();
    let walk = if geo.rows_in_image_order(size) && 3 * geo.len() * size >= IMAGE_ORDER_MIN_BYTES {
        RowOrder::Images
    } else {
        RowOrder::Channels
    };
    reduce_in(geo, isa, ins, shifts, walk)
}

/// The fewest bytes of the three inputs for which [`reduce`] walks short channel-major
/// rows image by image: its walk keeps six sums and three shifts a channel, which a
/// row reloads and stores, and a tensor in L1 or L2 gains nothing from memory order.
/// Measured on the AVX2-only Zen 3 (`scripts/ab.sh 5`, one thread, NCHW 2x32x8x8, 24
/// KB of bf16 inputs, channel walk / image walk / channel walk): second-order
/// inference 6.17 / 6.74 / 6.10 us, training f32 6.67 / 7.07 / 6.66 us; while NCHW
/// 16x512x7x7 (2.4 MB of bf16 inputs) gained (bf16 training 8.70 / 7.99 / 8.07 of a
/// copy). A size of the tensor, not of this machine's caches.
const IMAGE_ORDER_MIN_BYTES: usize = 1 << 20;

/// [`reduce`], a channel-major tensor's rows walked in the order `walk` (the tests run
/// every order on tensors of any size).
fn reduce_in<T: Element>(
    geo: &Geometry,
    isa: Isa,
    ins: [&[T]; 3],
    shifts: [&[T::Stat]; 3],
    walk: RowOrder,
) -> Vec<SecondOrderSums> {
    let [g, x, a] = ins;
    let c = geo.channels;
    let per: Vec<Six> = if geo.channels_last() {
        let split = PixelSplit::reduce(geo);
        // At large C a task's six sums come in waves in the calling thread's buffer
        // (`task_waves`) and its scratch from its thread's arena (`arena_if`): from the
        // heap they were fresh pages every task
        // (NHWC 4096x1x1x8192 bf16 second-order training: ~5,800 page faults a call).
        // From C = 8192, as the backward sums (two `f64` vectors of C at 128 KiB), not
        // where the six sums reach 128 KiB (C = 2731): in cache, with the arena from
        // there, NHWC 16x7x7x3072 and 16x7x7x4096 took 6–21 % longer a call in 6 of 8
        // cells (`scripts/ab.sh 5`, ms, both ops, f32 and bf16; the f32 4096 cells
        // between the heap's runs), and f32 16x7x7x3072 longer in each of 8 further
        // pairs (1–29 %); the copies' times drifted too much for their ratios to say.
        // Not explained (the heap's blocks there came back without faults).
        let large = 2 * c * size_of::<f64>() >= ARENA_MIN_BYTES;
        let task = |r: std::ops::Range<usize>, out: &mut [Six]| {
            let ins = [&g[r.clone()], &x[r.clone()], &a[r]];
            arena_if(large, |arena| {
                T::Stat::dispatch(
                    isa,
                    PixelSums {
                        ins,
                        shifts,
                        strips: true,
                        out,
                        arena,
                    },
                )
            })
        };
        if split.len() <= 1 {
            // One task (a small tensor): its sums are the total, summed from zeros as
            // the total below is, and no per-task vector is made.
            let mut total = vec![[0f64; 6]; c];
            task(split.range(0), &mut total);
            return finish(total);
        }
        if large {
            // The tasks' sums a wave at a time, added in task order to a total from
            // zeros: the bits of the merge below (zeros plus the first task's sums is
            // the first task's sums plus 0.0).
            let mut total = vec![[0f64; 6]; c];
            let items = vec![(); split.len()];
            task_waves(
                geo,
                items,
                c,
                [0f64; 6],
                |t, (), out| task(split.range(t), out),
                |parts| {
                    for p in parts.chunks_exact(c) {
                        add_sums(&mut total, p);
                    }
                },
            );
            return finish(total);
        }
        let partials = split.map(geo, |r| {
            let mut out = vec![[0f64; 6]; c];
            task(r, &mut out);
            out
        });
        // The first task's sums become the total (plus 0.0, as the sum from zeros
        // they replace: the same bits, −0 included), without another allocation.
        let mut partials = partials.into_iter();
        let mut total = partials.next().unwrap_or_else(|| vec![[0f64; 6]; c]);
        for t in total.iter_mut().flatten() {
            *t += 0.0;
        }
        for p in partials {
            add_sums(&mut total, &p);
        }
        total
    } else {
        ChannelMajorSplit::new(geo).map_channels(
            geo,
            |task| {
                T::Stat::dispatch(
                    isa,
                    TaskSums {
                        geo,
                        ins: [g, x, a],
                        shifts,
                        task,
                        walk,
                    },
                )
            },
            |p, q| std::array::from_fn(|k| p[k] + q[k]),
        )
    };
    finish(per)
}

/// Adds a task's sums `part` to `total`, channel by channel.
fn add_sums(total: &mut [Six], part: &[Six]) {
    for (t, v) in total.iter_mut().zip(part) {
        for k in 0..6 {
            t[k] += v[k];
        }
    }
}

/// The sums as [`SecondOrderSums`] (collected in place: the same size and alignment).
fn finish(per: Vec<Six>) -> Vec<SecondOrderSums> {
    per.into_iter()
        .map(|[g, a, g_xc, a_xc, a_g, xc]| SecondOrderSums {
            g,
            a,
            g_xc,
            a_xc,
            a_g,
            xc,
        })
        .collect()
}

struct TaskSums<'a, T: Element> {
    geo: &'a Geometry,
    ins: [&'a [T]; 3],
    shifts: [&'a [T::Stat]; 3],
    task: ChannelTask,
    walk: RowOrder,
}

impl<T: Element> Kernel<T::Stat> for TaskSums<'_, T> {
    type Output = Vec<Six>;
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) -> Vec<Six> {
        match self.walk {
            RowOrder::Channels => self.channels(s),
            RowOrder::Images => self.images(s),
        }
    }
}

impl<T: Element> TaskSums<'_, T> {
    /// The six sums of each channel of the task, channel by channel.
    #[inline(always)]
    fn channels<S: Simd<T::Stat>>(self, s: S) -> Vec<Six> {
        let t = self.task;
        let zero = s.splat(T::Stat::ZERO);
        let mut out = Vec::with_capacity(t.c1 - t.c0);
        for c in t.c0..t.c1 {
            let sh = self.shifts.map(|v| v[c]);
            let full = splat_n(s, sh);
            // A partial vector's shifts are loaded partially too (missing lanes 0 − 0).
            let rep = sh.map(|v| [v; MAX_LANES]);
            let mut total = [0f64; 6];
            for tile in channel_tiles(self.geo, c, t.o0, t.o1) {
                let mut acc = [zero; 6];
                for i in 0..tile.count {
                    let off = tile.start + i * tile.stride;
                    let ins = window(self.ins, off, tile.step);
                    row_sums(s, ins, &full, &rep, &mut acc);
                }
                for k in 0..6 {
                    total[k] += s.sum_f64(acc[k]);
                }
            }
            out.push(total);
        }
        out
    }

    /// The six sums of each channel of the task, walked image by image: at each outer
    /// index the task's channels in turn (in blocks of at most
    /// [`IMAGE_BLOCK_CHANNELS`]), every input read in memory order. Each
    /// channel's `f32` sums stay apart until the end of its tile, whose rows are the
    /// same for every channel (rows shorter than a tile): the same rows folded into the
    /// same lanes in the same order as [`TaskSums::channels`], the same tile sums added
    /// in `f64`, so the same bits. For rows of a few cache lines
    /// ([`Geometry::rows_in_image_order`]), which walked channel by channel lie a plane
    /// apart and wait on their loads.
    #[inline(always)]
    fn images<S: Simd<T::Stat>>(self, s: S) -> Vec<Six> {
        let (t, geo) = (self.task, self.geo);
        let zero = s.splat(T::Stat::ZERO);
        let mut out = vec![[0f64; 6]; t.c1 - t.c0];
        // On the stack up to 32 channels (6 KiB with AVX2), as small tensors have.
        let mut acc: Scratch<[S::V; 6], 32> =
            scratch([zero; 6], IMAGE_BLOCK_CHANNELS.min(t.c1 - t.c0));
        let (inner, stride) = (geo.inner, geo.channels * geo.inner);
        // The task's channels in blocks (IMAGE_BLOCK_CHANNELS), each walked image by
        // image; `b` is the block's first channel within the task.
        for b in (0..t.c1 - t.c0).step_by(IMAGE_BLOCK_CHANNELS) {
            let (c0, c1) = (t.c0 + b, (t.c0 + b + IMAGE_BLOCK_CHANNELS).min(t.c1));
            let acc = &mut acc[..c1 - c0];
            for tile in channel_tiles(geo, c0, t.o0, t.o1) {
                debug_assert!(tile.step == inner);
                let o0 = (tile.start - c0 * inner) / stride;
                for o in o0..o0 + tile.count {
                    // The block's channels of image `o`: one slice of each input.
                    let ins = window(self.ins, o * stride + c0 * inner, (c1 - c0) * inner);
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let c = c0 + j;
                        let sh = [self.shifts[0][c], self.shifts[1][c], self.shifts[2][c]];
                        let rep = sh.map(|v| [v; MAX_LANES]);
                        row_sums(s, window(ins, j * inner, inner), &splat_n(s, sh), &rep, acc);
                    }
                }
                for (total, acc) in out[b..].iter_mut().zip(acc.iter_mut()) {
                    for k in 0..6 {
                        total[k] += s.sum_f64(acc[k]);
                    }
                    *acc = [zero; 6];
                }
            }
        }
        out
    }
}

/// Adds one row `ins = [g, x, a]` of a channel to its six sums `acc`, around the
/// channel's shifts (`full`, and `rep` for a partial vector: its missing lanes 0 − 0).
#[inline(always)]
fn row_sums<U: Real, S: Simd<U>, T: Element<Stat = U>>(
    s: S,
    ins: [&[T]; 3],
    full: &Shifts<S::V>,
    rep: &[[U; MAX_LANES]; 3],
    acc: &mut [S::V; 6],
) {
    let r = Reads::new(S::LANES, ins, ins[0].len());
    for j in 0..r.vectors() {
        let [g, x, a] = r.load(s, j);
        accumulate(s, g, x, a, full, acc);
    }
    let (at, n) = r.tail();
    if n > 0 {
        let [g, x, a] = load_partial_n(s, &ins, at, n);
        let k = load_partial_n(s, &[&rep[0][..], &rep[1][..], &rep[2][..]], 0, n);
        accumulate(s, g, x, a, &k, acc);
    }
}

/// At most this many channel groups (vectors of channels): [`PixelSums`] sums one group
/// at a time over a tile, in registers. The loop needs nine registers whatever the
/// count; the limit is the range it was measured over (C ≤ 32 for f32 on AVX2, Zen 3:
/// faster or even from L1 to DRAM). On AVX-512 it covers C ≤ 64 for f32, not measured.
const STRIP_GROUPS: usize = 4;

/// The bytes of the three inputs in one block of pixels summed a group at a time: half
/// of a 32 KiB L1, so that every group after the first reads the block from L1.
const STRIP_BLOCK_BYTES: usize = 16 << 10;

/// Adds the six sums of the pixels `ins` to `out` (one entry per channel).
struct PixelSums<'a, T: Element> {
    ins: [&'a [T]; 3],
    shifts: [&'a [T::Stat]; 3],
    /// Whether a group at a time is allowed (with at most [`STRIP_GROUPS`] groups);
    /// false only in the test that checks both give the same bits.
    strips: bool,
    out: &'a mut [Six],
    /// Where the C-sized scratch comes from at large C ([`super::with_arena`]); the
    /// stack or the heap without.
    arena: Option<&'a bumpalo::Bump>,
}

/// Channel groups whose scratch [`PixelSums`] and [`Apply`] keep on the stack.
const STACK_GROUPS: usize = 8;

impl<T: Element> Kernel<T::Stat> for PixelSums<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) {
        let (l, c) = (S::LANES, self.shifts[0].len());
        let (whole, rest) = (c / l, c % l);
        let groups = c.div_ceil(l);
        let zero = s.splat(T::Stat::ZERO);
        let out = self.out;
        assert!(out.len() == c && l <= MAX_LANES);
        // Slices taken once (each use of a `Scratch` tests where its elements are).
        let (mut shifts_buf, mut acc_buf, mut lanes_buf) = (
            Scratch::<_, STACK_GROUPS>::new(),
            Scratch::<_, STACK_GROUPS>::new(),
            Scratch::<_, { STACK_GROUPS * MAX_LANES }>::new(),
        );
        let ar = self.arena;
        let shifts = scratch_in(ar, &mut shifts_buf, [zero; 3], groups);
        let acc = scratch_in(ar, &mut acc_buf, [zero; 6], groups);
        let lanes = scratch_in(ar, &mut lanes_buf, T::Stat::ZERO, groups * l);
        // Shifts padded with 0 past C, so the partial group shifts its missing lanes by
        // 0 (through one group's lanes on the stack).
        for (gi, sh) in shifts.iter_mut().enumerate() {
            let chans = gi * l..c.min((gi + 1) * l);
            for (v, k) in self.shifts.iter().zip(sh.iter_mut()) {
                let mut lanes = [T::Stat::ZERO; MAX_LANES];
                lanes[..chans.len()].copy_from_slice(&v[chans.clone()]);
                *k = s.load(&lanes[..l]);
            }
        }
        let shifts = &*shifts;
        let tile = pixels_per_tile(c) * c;
        let len = self.ins[0].len();
        let mut start = 0;
        while start < len {
            let end = (start + tile).min(len);
            acc.fill([zero; 6]);
            if self.strips && c > 0 && groups <= STRIP_GROUPS {
                // Few channel groups: blocks of pixels small enough for L1, and in each
                // block one group at a time, its six sums in registers. Each lane still
                // adds its pixels in order: the same sums, bit for bit.
                let block = (STRIP_BLOCK_BYTES / (3 * c * size_of::<T>())).max(1) * c;
                let mut b = start;
                while b < end {
                    let e = (b + block).min(end);
                    let blk = window(self.ins, b, e - b);
                    let pixels = [
                        blk[0].chunks_exact(c),
                        blk[1].chunks_exact(c),
                        blk[2].chunks_exact(c),
                    ];
                    for gi in 0..whole {
                        let at = gi * l;
                        assert!(at + l <= c);
                        let k = &shifts[gi];
                        let mut a6 = acc[gi];
                        let [pg, px, pa] = pixels.clone();
                        for ((g, x), a) in pg.zip(px).zip(pa) {
                            let (g, x, a) = (s.load(&g[at..]), s.load(&x[at..]), s.load(&a[at..]));
                            accumulate(s, g, x, a, k, &mut a6);
                        }
                        acc[gi] = a6;
                    }
                    if rest > 0 {
                        let at = whole * l;
                        let k = &shifts[whole];
                        let mut a6 = acc[whole];
                        let [pg, px, pa] = pixels;
                        for ((g, x), a) in pg.zip(px).zip(pa) {
                            let [g, x, a] = load_partial_n(s, &[g, x, a], at, rest);
                            accumulate(s, g, x, a, k, &mut a6);
                        }
                        acc[whole] = a6;
                    }
                    b = e;
                }
            } else {
                let mut p = start;
                while p < end {
                    // One pixel: its whole vectors with the bounds proved once, then the
                    // partial group. (With `Reads::load`, a check of its own a vector:
                    // perf annotate, NHWC second order, both ISAs.)
                    let ins = window(self.ins, p, c);
                    let r = Reads::new(l, ins, c);
                    assert!(whole <= r.vectors() && r.lanes_of(s));
                    for ((ac, k), j) in acc.iter_mut().zip(shifts).zip(0..whole) {
                        // SAFETY: `j < whole <= r.vectors()`, and the lanes are `S`'s
                        // (checked above).
                        let [g, x, a] = unsafe { r.load_unchecked(s, j) };
                        accumulate(s, g, x, a, k, ac);
                    }
                    if rest > 0 {
                        let [g, x, a] = load_partial_n(s, &ins, whole * l, rest);
                        accumulate(s, g, x, a, &shifts[whole], &mut acc[whole]);
                    }
                    p += c;
                }
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
    }
}

/// One channel's constants of the elementwise pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct SecondOrderCoeffs<U> {
    /// μ.
    pub mean: U,
    /// Ā.
    pub a_mean: U,
    /// ḡ.
    pub g_mean: U,
    /// Coefficient of `A − Ā` in `d_g`.
    pub c1: U,
    /// Coefficient of `x − μ` in `d_g` and of `g − ḡ` in `d_x`.
    pub c2: U,
    /// The constant term of `d_g` (the upstream `offset_backprop` gradient).
    pub b: U,
    /// Coefficient of `A − Ā` in `d_x`.
    pub e2: U,
    /// Coefficient of `x − μ` in `d_x`.
    pub e3: U,
}

impl<U: Copy> SecondOrderCoeffs<U> {
    /// In the order [`eval`] takes them.
    fn array(&self) -> [U; 8] {
        [
            self.mean,
            self.a_mean,
            self.g_mean,
            self.c1,
            self.c2,
            self.b,
            self.e2,
            self.e3,
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
    k: &[SecondOrderCoeffs<T::Stat>],
    outs: (&mut [T], &mut [T]),
) {
    let ([g, x, a], (d_g, d_x)) = (ins, outs);
    let row_len = geo.row_len();
    // At large C (from 8192, as the reduction) the channel groups' constants (8 values
    // a channel) come from the thread's arena: from the heap they were fresh pages
    // every task.
    let large = geo.channels_last() && 2 * geo.channels * size_of::<f64>() >= ARENA_MIN_BYTES;
    for_each_row_chunk_pair(geo, d_g, d_x, |row0, dg, dx| {
        let ins = sub_n(&[g, x, a], row0 * row_len, Some(dg.len()));
        arena_if(large, |arena| {
            T::Stat::dispatch(
                isa,
                Apply {
                    geo,
                    row0,
                    ins,
                    k,
                    dg,
                    dx,
                    arena,
                },
            )
        });
    });
}

struct Apply<'a, T: Element> {
    geo: &'a Geometry,
    row0: usize,
    ins: [&'a [T]; 3],
    k: &'a [SecondOrderCoeffs<T::Stat>],
    dg: &'a mut [T],
    dx: &'a mut [T],
    /// Where the constants come from at large C ([`super::with_arena`]); the stack or
    /// the heap without.
    arena: Option<&'a bumpalo::Bump>,
}

impl<T: Element> Kernel<T::Stat> for Apply<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd<T::Stat>>(self, s: S) {
        let (geo, l) = (self.geo, S::LANES);
        let (dg, dx) = (self.dg, self.dx);
        if geo.channels_last() {
            // Per-channel constants padded to whole vectors, one set per channel group;
            // each pixel: its whole vectors with the bounds proved once, then the
            // partial group.
            let c = geo.channels;
            let (whole, rest) = (c / l, c % l);
            let groups = c.div_ceil(l);
            // Built through one group's lanes on the stack (and kept there for few
            // groups).
            assert!(l <= MAX_LANES);
            let zero = s.splat(T::Stat::ZERO);
            // A slice taken once (each use of a `Scratch` tests where its elements are).
            let mut consts_buf = Scratch::<_, STACK_GROUPS>::new();
            let consts = scratch_in(self.arena, &mut consts_buf, [zero; 8], groups);
            for (gi, kv) in consts.iter_mut().enumerate() {
                let mut lanes = [[T::Stat::ZERO; MAX_LANES]; 8];
                let chans = &self.k[gi * l..c.min((gi + 1) * l)];
                for (i, k) in chans.iter().enumerate() {
                    for (j, v) in k.array().into_iter().enumerate() {
                        lanes[j][i] = v;
                    }
                }
                for (j, v) in kv.iter_mut().enumerate() {
                    *v = s.load(&lanes[j][..l]);
                }
            }
            let pixels = dg.len() / c.max(1);
            if rest == 0 && whole > 0 {
                // Every pixel whole vectors: the task's pixels as one run, pixel p its
                // vectors `p·whole..` against the groups' constants, with no per-pixel
                // reads, writes and splits to set up (1.7 % of the instructions of a
                // 2x8x8x32 f32 second-order training call with AVX2, 0.7 % in bf16:
                // callgrind). The same arithmetic per element.
                let n = pixels * c;
                let r = Reads::new(l, window(self.ins, 0, n), n);
                let mut w = Writes::new(l, [dg, dx], n);
                for p in 0..pixels {
                    whole_vectors::<_, _, _, false>(s, &r, &mut w, p * whole, whole, consts);
                }
                return;
            }
            for (p, (dg, dx)) in dg
                .chunks_exact_mut(c)
                .zip(dx.chunks_exact_mut(c))
                .enumerate()
            {
                let ins = window(self.ins, p * c, c);
                let r = Reads::new(l, ins, c);
                let (dgt, dxt) = {
                    let (dgw, dgt) = dg.split_at_mut(whole * l);
                    let (dxw, dxt) = dx.split_at_mut(whole * l);
                    let mut w = Writes::new(l, [dgw, dxw], whole * l);
                    whole_vectors::<_, _, _, false>(s, &r, &mut w, 0, whole, consts);
                    (dgt, dxt)
                };
                if rest > 0 {
                    let [g, x, a] = load_partial_n(s, &ins, whole * l, rest);
                    let (vg, vx) = eval(s, g, x, a, &consts[whole]);
                    s.store_partial(dgt, vg);
                    s.store_partial(dxt, vx);
                }
            }
            debug_assert_eq!(pixels * c, dg.len());
        } else {
            let n = geo.inner;
            let rows = dg.chunks_exact_mut(n).zip(dx.chunks_exact_mut(n));
            let c = geo.channels;
            let mut ch = self.row0 % c.max(1);
            for (r, (dg, dx)) in rows.enumerate() {
                let kv = splat_n(s, self.k[ch].array());
                ch = next_cyclic(ch, c);
                let ins = window(self.ins, r * n, n);
                let rd = Reads::new(l, ins, n);
                let (at, m) = rd.tail();
                {
                    let mut w = Writes::new(l, [&mut dg[..at], &mut dx[..at]], at);
                    whole_vectors::<_, _, _, true>(s, &rd, &mut w, 0, rd.vectors(), &[kv]);
                }
                if m > 0 && n >= l {
                    // The row's last whole vector, overlapping the one before, instead
                    // of two masked stores (3 to 5 times a plain store with AVX2 on AMD
                    // Zen 3: `scripts/models/maskstore.c`): the common elements are
                    // written twice with the same values (the same formula on the same
                    // inputs).
                    let [g, x, a] = load_n(s, &ins, n - l);
                    let (vg, vx) = eval(s, g, x, a, &kv);
                    s.store(&mut dg[n - l..], vg);
                    s.store(&mut dx[n - l..], vx);
                } else if m > 0 {
                    let [g, x, a] = load_partial_n(s, &ins, at, m);
                    let (vg, vx) = eval(s, g, x, a, &kv);
                    s.store_partial(&mut dg[at..], vg);
                    s.store_partial(&mut dx[at..], vx);
                }
            }
        }
    }
}

/// Whole vectors `j0..j0 + vectors` of both outputs from `r`, with constants `k[j]` for
/// vector `j0 + j`, or `k[0]` for every vector when `SPLAT` (a channel-major row). Two
/// vectors a step, stored as pairs: one narrowing for both where the ISA has one
/// (`vcvtne2ps2bf16`, AVX2's packed bf16), where one vector at a time took the
/// shifting bf16 rounding and a `vpmovdw` to memory each — a quarter of the time of
/// NHWC 2x8x8x32 bf16 second order with AVX-512 (perf).
#[inline(always)]
fn whole_vectors<U: Real, S: Simd<U>, T: Element<Stat = U>, const SPLAT: bool>(
    s: S,
    r: &Reads<'_, T, 3>,
    w: &mut Writes<'_, T, 2>,
    j0: usize,
    vectors: usize,
    k: &[[S::V; 8]],
) {
    // Once, so that the loop needs no checks of its own: the constants, and vectors
    // `j0..j0 + vectors` of the inputs and of both outputs.
    assert!(!k.is_empty() && (SPLAT || k.len() >= vectors));
    let end = j0 + vectors;
    assert!(end <= r.vectors() && end <= w.vectors() && r.lanes_of(s) && w.lanes_of(s));
    for i in 0..vectors / 2 {
        let j = 2 * i;
        // SAFETY: `j + 1 < vectors`, so vectors `j0 + j` and `j0 + j + 1` lie below
        // `end`, at most the inputs' and the outputs' whole vectors, and the lanes are
        // `S`'s (all checked above); the outputs are 0 and 1 of two.
        // The constants likewise: `j + 1 < vectors <= k.len()` unless `SPLAT` (index 0,
        // `k` not empty). Indexed with checks, the loop kept two bounds checks a pair
        // (perf annotate, NHWC second order f32 and bf16, both ISAs).
        let ([g0, x0, a0], [g1, x1, a1], k0, k1) = unsafe {
            (
                r.load_unchecked(s, j0 + j),
                r.load_unchecked(s, j0 + j + 1),
                k.get_unchecked(if SPLAT { 0 } else { j }),
                k.get_unchecked(if SPLAT { 0 } else { j + 1 }),
            )
        };
        let (vg0, vx0) = eval(s, g0, x0, a0, k0);
        let (vg1, vx1) = eval(s, g1, x1, a1, k1);
        // SAFETY: as above.
        unsafe {
            w.store2_unchecked(s, 0, j0 + j, vg0, vg1);
            w.store2_unchecked(s, 1, j0 + j, vx0, vx1);
        }
    }
    if vectors % 2 == 1 {
        let j = vectors - 1;
        let [g, x, a] = r.load(s, j0 + j);
        let (vg, vx) = eval(s, g, x, a, &k[if SPLAT { 0 } else { j }]);
        w.store(s, 0, j0 + j, vg);
        w.store(s, 1, j0 + j, vx);
    }
}

#[cfg(test)]
mod tests {
    use super::{PixelSums, RowOrder, SecondOrderCoeffs, Six};
    use crate::element::{Element, Real};
    use crate::kernels::simd::{Dispatch, Isa};
    use crate::kernels::Geometry;
    use half::bf16;

    /// Constants of `c` channels for the elementwise pass: channel `ch`'s `j`-th (in
    /// [`SecondOrderCoeffs::array`]'s order) is `value(ch * 8 + j)`.
    fn coeffs<U: Copy>(c: usize, value: impl Fn(usize) -> U) -> Vec<SecondOrderCoeffs<U>> {
        (0..c)
            .map(|ch| {
                let f = |j: usize| value(ch * 8 + j);
                SecondOrderCoeffs {
                    mean: f(0),
                    a_mean: f(1),
                    g_mean: f(2),
                    c1: f(3),
                    c2: f(4),
                    b: f(5),
                    e2: f(6),
                    e3: f(7),
                }
            })
            .collect()
    }

    /// The channels-last reduction one channel group at a time (few groups) must give
    /// the bits of the pixel-at-a-time loop, on every ISA: C below, at and above a
    /// vector, with a partial group, one tile and several (C = 32: 1024 pixels a tile),
    /// far-from-zero data, NaN and Inf, f32 and bf16.
    #[test]
    fn channel_groups_match_pixel_at_a_time_bit_for_bit() {
        fn check<T: Element>(isa: Isa, c: usize, pixels: usize, case: usize) {
            let make = |seed: usize| -> Vec<T> {
                (0..pixels * c)
                    .map(|i| {
                        let v = ((i * 7919 + seed * 131) % 1013) as f64 / 1013.0 - 0.5;
                        let v = match (case, i % c) {
                            (1, _) => 3.0e4 + v,
                            (2, 0) if i % 11 == 0 => f64::NAN,
                            (2, 1) if i % 13 == 0 => f64::INFINITY,
                            _ => v,
                        };
                        T::narrow(T::Stat::from_f64(v))
                    })
                    .collect()
            };
            let (g, x, a) = (make(1), make(2), make(3));
            let shift = |k: usize| -> Vec<T::Stat> {
                (0..c)
                    .map(|ch| T::Stat::from_f64(0.25 * (ch + k) as f64))
                    .collect()
            };
            let (m, kg, ka) = (shift(0), shift(1), shift(2));
            let run = |strips: bool| -> Vec<Six> {
                let mut out = vec![[0f64; 6]; c];
                T::Stat::dispatch(
                    isa,
                    PixelSums {
                        ins: [&g, &x, &a],
                        shifts: [&m, &kg, &ka],
                        strips,
                        out: &mut out,
                        arena: None,
                    },
                );
                out
            };
            let (by_group, by_pixel) = (run(true), run(false));
            for (ch, (p, q)) in by_group.iter().zip(&by_pixel).enumerate() {
                let same = p
                    .iter()
                    .zip(q)
                    .all(|(u, v)| u.to_bits() == v.to_bits() || (u.is_nan() && v.is_nan()));
                assert!(
                    same,
                    "{isa:?} {} C={c} pixels={pixels} case {case} channel {ch}: {p:?} vs {q:?}",
                    std::any::type_name::<T>()
                );
            }
            // And both against the sums in f64 (where the two walks are one, past
            // STRIP_GROUPS groups, this is what checks them): within 1e-4 of the sum of
            // the terms' magnitudes (f32 lanes add at most 1024 values a tile).
            if case != 2 {
                for (ch, got) in by_pixel.iter().enumerate() {
                    let (mut want, mut mag) = ([0f64; 6], [0f64; 6]);
                    for p in 0..pixels {
                        let v = |d: &[T], k: &[T::Stat]| {
                            d[p * c + ch].widen().to_f64() - k[ch].to_f64()
                        };
                        let (gv, xv, av) = (v(&g, &kg), v(&x, &m), v(&a, &ka));
                        let terms = [gv, av, gv * xv, av * xv, av * gv, xv];
                        for k in 0..6 {
                            want[k] += terms[k];
                            mag[k] += terms[k].abs();
                        }
                    }
                    for k in 0..6 {
                        assert!(
                            (got[k] - want[k]).abs() <= 1e-4 * mag[k] + 1e-30,
                            "{isa:?} {} C={c} pixels={pixels} case {case} channel {ch} sum {k}: \
                             {} vs {}",
                            std::any::type_name::<T>(),
                            got[k],
                            want[k]
                        );
                    }
                }
            }
        }
        for isa in Isa::supported() {
            // C = 130: more channel groups than `STACK_GROUPS` on every ISA (the
            // scratch on the heap).
            for (c, pixels) in [
                (1, 37),
                (3, 300),
                (8, 64),
                (20, 129),
                (32, 2500),
                (40, 70),
                (130, 21),
            ] {
                for case in 0..3 {
                    check::<f32>(isa, c, pixels, case);
                    check::<bf16>(isa, c, pixels, case);
                }
            }
        }
    }

    /// The channel-major sums walked image by image (`RowOrder::Images`) give the bits
    /// of the walk channel by channel: rows of 49, 15, 2, 3 and 200 elements,
    /// 16x700x7x7 in at least three tasks (four of 175 channels on two threads),
    /// channels of several tiles (3000 rows of 3, 90 of 200), channels split into row
    /// chunks of several tiles (1400 rows of 200), a task of more channels than an
    /// image-order block (1100 channels of 3: `IMAGE_BLOCK_CHANNELS`), each dtype,
    /// every ISA. (Fails with the image walk keeping its sums from one tile to the
    /// next, tried.)
    #[test]
    fn image_order_sums_have_the_bits_of_the_channel_walk() {
        fn check<T: Element>() {
            for (outer, channels, inner) in super::super::IMAGE_WALK_GEOMETRIES {
                let geo = Geometry::new(outer, channels, inner);
                let make = |seed: usize| -> Vec<T> {
                    (0..geo.len())
                        .map(|i| {
                            let v = ((i * 7919 + seed * 131) % 1013) as f64 / 1013.0 - 0.5;
                            T::narrow(T::Stat::from_f64(v + seed as f64))
                        })
                        .collect()
                };
                let (g, x, a) = (make(1), make(2), make(3));
                let shift = |k: usize| -> Vec<T::Stat> {
                    (0..channels)
                        .map(|ch| T::Stat::from_f64(0.25 * (ch + k) as f64))
                        .collect()
                };
                let (m, kg, ka) = (shift(0), shift(1), shift(2));
                for isa in Isa::supported() {
                    let run = |walk| -> Vec<u64> {
                        let sums = super::reduce_in(&geo, isa, [&g, &x, &a], [&m, &kg, &ka], walk);
                        sums.iter()
                            .flat_map(|s| [s.g, s.a, s.g_xc, s.a_xc, s.a_g, s.xc])
                            .map(f64::to_bits)
                            .collect()
                    };
                    let plain = run(RowOrder::Channels);
                    let what = format!("{isa} {outer}x{channels}x{inner}");
                    assert!(run(RowOrder::Images) == plain, "{what}: image order");
                }
            }
        }
        check::<f32>();
        check::<bf16>();
        check::<half::f16>();
    }

    /// The elementwise pass over channel-major rows of every length from 2 to 70 (every
    /// tail length, rows shorter than a vector, rows whose last whole vector overlaps
    /// the one before; a row of 1 is itself channels-last) gives, element for element,
    /// the bits of the same problem in channels-last order (another walk: whole
    /// pixels, no row tails at C = 16), on every ISA the machine has: each element is
    /// the same formula of its own inputs and its channel's constants.
    #[test]
    fn channel_major_rows_have_the_bits_of_channels_last() {
        fn check<T: Element>() {
            let (outer, c) = (2, 16);
            for len in 2..=70 {
                let total = outer * c * len;
                let make = |seed: usize| -> Vec<T> {
                    (0..total)
                        .map(|i| {
                            let v = ((i * 7919 + seed * 131) % 1013) as f64 / 1013.0 - 0.5;
                            T::narrow(T::Stat::from_f64(v + seed as f64))
                        })
                        .collect()
                };
                let major = [make(1), make(2), make(3)];
                // Index of element (n, ch, p) in channels-last order.
                let last = |i: usize| {
                    let (n, ch, p) = (i / (c * len), i / len % c, i % len);
                    (n * len + p) * c + ch
                };
                let mut minor = major.clone();
                for (m, t) in major.iter().zip(&mut minor) {
                    for (i, v) in m.iter().enumerate() {
                        t[last(i)] = *v;
                    }
                }
                let k = coeffs(c, |i| T::Stat::from_f64(0.5 + 0.125 * i as f64));
                for isa in Isa::supported() {
                    let run = |geo: Geometry, ins: &[Vec<T>; 3]| {
                        let (mut dg, mut dx) =
                            (vec![T::default(); total], vec![T::default(); total]);
                        super::apply(
                            &geo,
                            isa,
                            [&ins[0], &ins[1], &ins[2]],
                            &k,
                            (&mut dg, &mut dx),
                        );
                        (dg, dx)
                    };
                    let (dg, dx) = run(Geometry::new(outer, c, len), &major);
                    let (dg_l, dx_l) = run(Geometry::new(outer * len, c, 1), &minor);
                    let bits = |v: T| v.widen().to_f64().to_bits();
                    for i in 0..total {
                        let what = format!("{isa}, rows of {len}, element {i}");
                        assert_eq!(bits(dg[i]), bits(dg_l[last(i)]), "{what}: d_g");
                        assert_eq!(bits(dx[i]), bits(dx_l[last(i)]), "{what}: d_x");
                    }
                }
            }
        }
        check::<f32>();
        check::<bf16>();
        check::<half::f16>();
    }

    /// At large C (C ≥ 8192) the channels-last tasks' sums come in waves
    /// (`task_waves`), each task's scratch from the arena. The total must still be each task's sums added in task order, bit for bit,
    /// over two waves (C = 22,000: four tasks a wave, five tasks). In the even channels
    /// every other task's data is 2^40 times the rest's, so that adding the tasks'
    /// `Σg'`, `ΣA'` and `Σxc` rounds and their order shows (it fails with a wave's tasks
    /// added in reverse, tried); the odd channels, unscaled, must be within 1e-6 of the
    /// sum of the terms' magnitudes of the sums in `f64`. Each task's expected sums are
    /// those of a tensor of its pixels alone, which one task sums. And the kernels with
    /// their scratch from an arena give the heap's bits, the elementwise pass included.
    #[test]
    fn large_c_sums_are_the_tasks_added_in_order_bit_for_bit() {
        use super::{reduce, Apply, SecondOrderSums};
        use crate::kernels::PixelSplit;
        let (pixels, c) = (300, 22_000);
        let geo = Geometry::new(pixels, c, 1);
        let split = PixelSplit::reduce(&geo);
        assert_eq!(split.len(), 5);
        let per_task = split.range(0).len() / c;
        assert_eq!(PixelSplit::reduce(&Geometry::new(per_task, c, 1)).len(), 1);
        let make = |seed: usize| -> Vec<bf16> {
            (0..geo.len())
                .map(|i| {
                    let (ch, task) = (i % c, i / c / per_task);
                    let v = ((i * 7919 + seed * 131) % 1013) as f32 * 0.013 + (ch % 50) as f32;
                    let big = ch % 2 == 0 && task % 2 == 1;
                    bf16::from_f32(if big { v * (2f32).powi(40) } else { v })
                })
                .collect()
        };
        let (g, x, a) = (make(1), make(2), make(3));
        let shift = |k: usize| -> Vec<f32> { (0..c).map(|ch| ((ch + k) % 7) as f32).collect() };
        let (m, kg, ka) = (shift(0), shift(1), shift(2));
        let six = |s: &SecondOrderSums| [s.g, s.a, s.g_xc, s.a_xc, s.a_g, s.xc];
        for isa in Isa::supported() {
            let got = reduce(&geo, isa, [&g, &x, &a], [&m, &kg, &ka]);
            let mut want = vec![[0f64; 6]; c];
            for t in 0..split.len() {
                let r = split.range(t);
                let one = Geometry::new(r.len() / c, c, 1);
                let part = reduce(
                    &one,
                    isa,
                    [&g[r.clone()], &x[r.clone()], &a[r]],
                    [&m, &kg, &ka],
                );
                for (w, p) in want.iter_mut().zip(&part) {
                    for (w, p) in w.iter_mut().zip(six(p)) {
                        *w += p;
                    }
                }
            }
            for ch in 0..c {
                let (got, want) = (six(&got[ch]), want[ch]);
                assert_eq!(
                    got.map(f64::to_bits),
                    want.map(f64::to_bits),
                    "{isa:?} channel {ch}"
                );
            }
            for ch in (1..c).step_by(998) {
                let (mut exact, mut mag) = ([0f64; 6], [0f64; 6]);
                for p in 0..pixels {
                    let v = |d: &[bf16], k: &[f32]| d[p * c + ch].to_f64() - k[ch] as f64;
                    let (gv, xv, av) = (v(&g, &kg), v(&x, &m), v(&a, &ka));
                    let terms = [gv, av, gv * xv, av * xv, av * gv, xv];
                    for k in 0..6 {
                        exact[k] += terms[k];
                        mag[k] += terms[k].abs();
                    }
                }
                let got = six(&got[ch]);
                for k in 0..6 {
                    assert!(
                        (got[k] - exact[k]).abs() <= 1e-6 * mag[k],
                        "{isa:?} {ch} {k}"
                    );
                }
            }
            // One task's kernels, scratch from an arena and from the heap.
            let r = 0..per_task * c;
            let ins = [&g[r.clone()], &x[r.clone()], &a[r.clone()]];
            let bump = bumpalo::Bump::new();
            let sums = |arena: Option<&bumpalo::Bump>| {
                let mut out = vec![[0f64; 6]; c];
                f32::dispatch(
                    isa,
                    PixelSums {
                        ins,
                        shifts: [&m, &kg, &ka],
                        strips: true,
                        out: &mut out,
                        arena,
                    },
                );
                out
            };
            let (heap, arena) = (sums(None), sums(Some(&bump)));
            assert!(bump.allocated_bytes() >= crate::kernels::ARENA_MIN_BYTES);
            assert!(heap
                .iter()
                .flatten()
                .zip(arena.iter().flatten())
                .all(|(p, q)| p.to_bits() == q.to_bits()));
            let k = coeffs(c, |i| 0.5 + 0.125 * (i % 29) as f32);
            let one = Geometry::new(per_task, c, 1);
            let pass = |arena: Option<&bumpalo::Bump>| {
                let (mut dg, mut dx) = (vec![bf16::ZERO; r.len()], vec![bf16::ZERO; r.len()]);
                f32::dispatch(
                    isa,
                    Apply {
                        geo: &one,
                        row0: 0,
                        ins,
                        k: &k,
                        dg: &mut dg,
                        dx: &mut dx,
                        arena,
                    },
                );
                (dg, dx)
            };
            let bump = bumpalo::Bump::new();
            let (heap, arena) = (pass(None), pass(Some(&bump)));
            assert!(bump.allocated_bytes() >= crate::kernels::ARENA_MIN_BYTES);
            let bits = |v: &[bf16]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&heap.0), bits(&arena.0), "{isa:?} d_g");
            assert_eq!(bits(&heap.1), bits(&arena.1), "{isa:?} d_x");
        }
    }
}
