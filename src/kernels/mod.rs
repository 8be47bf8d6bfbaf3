//! The hot loops, as passes over a per-channel geometry.
//!
//! `x` is viewed as `[outer, C, inner]`: NHWC/NDHWC are `[N·H·W, C, 1]`, NCHW/NCDHW
//! are `[N, C, H·W]`. Four passes cover every op:
//!
//! | pass | module | reads | writes |
//! |---|---|---|---|
//! | statistics: per-channel mean and M2 | [`stats`] | x | C moments |
//! | apply: `y = (x - shift)·a + b` | [`apply`] | x | y |
//! | backward reduce: `Σdy`, `Σdy·(x−μ)` | [`backward`] | dy, x | 2·C sums |
//! | backward apply: `dx = (dy−dȳ)·k1 + (x−μ)·k2` | [`backward`] | dy, x | dx |
//!
//! This module (the driver) decides how the work is split; the pass modules decide
//! how one piece is done. Splitting depends only on the geometry, never on the number
//! of threads, and partial results are merged in a fixed order, so results are
//! bit-identical whatever the thread count. Reductions accumulate in `U` (f32) lanes
//! over tiles of at most [`TILE`] elements and merge tiles in `f64`.
//!
//! Kernels do no validation: the op and typed layers check every length first.

pub mod apply;
pub mod backward;
pub mod stats;

use rayon::prelude::*;

/// Elements per reduction tile: small enough that a tile's second pass hits L1/L2,
/// and that no `f32` accumulator lane sums more than ~1000 values.
pub const TILE: usize = 8192;
/// Elements per parallel task (each task is one rayon job).
pub const TASK: usize = 1 << 18;
/// Below this many elements every pass runs on the calling thread: a rayon hand-off
/// costs more than the work.
pub const PARALLEL_MIN: usize = 1 << 15;
/// Independent accumulator lanes in the channel-major reductions (lets the compiler
/// vectorize without reassociating floating-point sums).
pub const LANES: usize = 8;

/// The kernels' view of `x`: `[outer, channels, inner]`, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Product of the dimensions before the channel axis (N·H·W for NHWC, N for NCHW).
    pub outer: usize,
    /// The channel count `C`.
    pub channels: usize,
    /// Product of the dimensions after the channel axis (1 for NHWC, H·W for NCHW).
    pub inner: usize,
}

impl Geometry {
    /// The geometry `[outer, channels, inner]`. With one channel the tensor is a single
    /// contiguous run, and is described as `[1, 1, outer·inner]`.
    pub fn new(outer: usize, channels: usize, inner: usize) -> Self {
        if channels == 1 {
            Geometry {
                outer: 1,
                channels: 1,
                inner: outer * inner,
            }
        } else {
            Geometry {
                outer,
                channels,
                inner,
            }
        }
    }

    /// Total number of elements.
    pub fn len(&self) -> usize {
        self.outer * self.channels * self.inner
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `M`, the number of elements of one channel.
    pub fn per_channel(&self) -> usize {
        self.outer * self.inner
    }

    /// True when the channel is the fastest-varying index (`inner == 1`): a "row" is
    /// then one pixel holding all channels. Otherwise a row is `inner` contiguous
    /// elements of one channel.
    pub fn channels_last(&self) -> bool {
        self.inner == 1
    }

    /// Length of one contiguous row (see [`Geometry::channels_last`]).
    pub fn row_len(&self) -> usize {
        if self.channels_last() {
            self.channels
        } else {
            self.inner
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        if self.channels_last() {
            self.outer
        } else {
            self.outer * self.channels
        }
    }

    /// Rows per elementwise task: a fixed function of the geometry.
    fn rows_per_task(&self) -> usize {
        (TASK / self.row_len().max(1)).max(1)
    }

    /// Whether a pass over this geometry should use the thread pool.
    fn parallel(&self) -> bool {
        self.len() >= PARALLEL_MIN && rayon::current_num_threads() > 1
    }
}

/// Runs `f(first_row, out_rows)` over fixed row chunks of `out` (a tensor of this
/// geometry), in parallel when the tensor is large enough.
pub(crate) fn for_each_row_chunk<O, F>(g: &Geometry, out: &mut [O], f: F)
where
    O: Send,
    F: Fn(usize, &mut [O]) + Sync + Send,
{
    let rpt = g.rows_per_task();
    let chunk = (rpt * g.row_len()).max(1);
    if g.parallel() {
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, o)| f(i * rpt, o));
    } else {
        out.chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, o)| f(i * rpt, o));
    }
}

/// Maps `f` over task indices `0..n` (in parallel when `g` is large), results in order.
pub(crate) fn map_tasks<R, F>(g: &Geometry, n: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(usize) -> R + Sync + Send,
{
    if g.parallel() {
        (0..n).into_par_iter().map(f).collect()
    } else {
        (0..n).map(f).collect()
    }
}

/// The fixed split of a channel-major reduction: task `t` covers channel
/// `t / chunks` and rows `[k·rows, (k+1)·rows)` of it (`k = t % chunks`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChannelMajorSplit {
    pub rows_per_task: usize,
    pub chunks: usize,
}

impl ChannelMajorSplit {
    pub fn new(g: &Geometry) -> Self {
        let rows_per_task = (TASK / g.inner.max(1)).max(1);
        let chunks = g.outer.div_ceil(rows_per_task).max(1);
        ChannelMajorSplit {
            rows_per_task,
            chunks,
        }
    }

    pub fn tasks(&self, g: &Geometry) -> usize {
        self.chunks * g.channels
    }

    /// `(channel, first outer index, end outer index)` of task `t`.
    pub fn task(&self, g: &Geometry, t: usize) -> (usize, usize, usize) {
        let c = t / self.chunks;
        let o0 = (t % self.chunks) * self.rows_per_task;
        (c, o0, (o0 + self.rows_per_task).min(g.outer))
    }
}

/// Pixels per tile in a channels-last reduction: about [`TILE`] elements, at least 8
/// pixels (so merges stay rare for wide C) and at most 1024 (so no `f32` lane sums
/// more than 1024 values).
pub(crate) fn pixels_per_tile(c: usize) -> usize {
    (TILE / c.max(1)).clamp(8, 1024)
}

/// Pixels per task in a channels-last reduction: a whole number of tiles.
pub(crate) fn pixels_per_task(c: usize) -> usize {
    let ppt = pixels_per_tile(c);
    ((TASK / c.max(1)) / ppt).max(1) * ppt
}

/// A tile of one channel in a channel-major tensor: `count` contiguous pieces of
/// `step` elements, the first at `start`, each `stride` after the previous.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tile {
    pub start: usize,
    pub step: usize,
    pub stride: usize,
    pub count: usize,
}

impl Tile {
    /// Number of elements in the tile.
    pub fn len(self) -> usize {
        self.step * self.count
    }

    /// The tile's pieces of `data` (a tensor of the tiled geometry), in order.
    pub fn pieces<T>(self, data: &[T]) -> impl Iterator<Item = &[T]> + Clone {
        (0..self.count).map(move |i| &data[self.start + i * self.stride..][..self.step])
    }
}

/// Calls `f` with each tile of channel `c`, outer rows `[o0, o1)`, of a channel-major
/// tensor: a tile is a run of whole rows totalling about [`TILE`] elements, or an
/// equal piece of one row when rows are longer than that.
pub(crate) fn for_each_channel_tile(
    g: &Geometry,
    c: usize,
    o0: usize,
    o1: usize,
    mut f: impl FnMut(Tile),
) {
    let inner = g.inner;
    let stride = g.channels * inner;
    let base = c * inner;
    if inner >= TILE {
        let piece = inner.div_ceil(inner.div_ceil(TILE));
        for o in o0..o1 {
            let mut s = 0;
            while s < inner {
                let step = piece.min(inner - s);
                f(Tile {
                    start: base + o * stride + s,
                    step,
                    stride,
                    count: 1,
                });
                s += step;
            }
        }
    } else {
        let per_tile = (TILE / inner.max(1)).max(1);
        let mut o = o0;
        while o < o1 {
            let count = per_tile.min(o1 - o);
            f(Tile {
                start: base + o * stride,
                step: inner,
                stride,
                count,
            });
            o += count;
        }
    }
}
