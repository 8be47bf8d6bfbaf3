//! The hot loops, as passes over a per-channel geometry.
//!
//! `x` is viewed as `[outer, C, inner]`: NHWC/NDHWC are `[N·H·W, C, 1]`, NCHW/NCDHW
//! are `[N, C, H·W]`. Four passes cover every op:
//!
//! | pass | module | reads | writes |
//! |---|---|---|---|
//! | statistics: per-channel mean and M2 | `stats` | x | C moments |
//! | apply: `y = (x − shift)·a + b` | `apply` | x | y |
//! | backward reduce: `Σdy`, `Σdy·(x−μ)` | `backward` | dy, x | 2·C sums |
//! | backward apply: `dx = (dy−dȳ)·k1 + (x−μ)·k2` | `backward` | dy, x | dx |
//!
//! `fused` runs them with the fewest trips to memory: in channel-major layouts a
//! channel's slice that fits in L2 is reduced and then transformed while it is hot
//! (forward training: one DRAM read of x; backward: one read of dy and x), and the
//! inference gradient is a single pass.
//!
//! This module (the driver) decides how the work is split; the pass modules decide how
//! one piece is done, with one loop body per pass written against the [`simd::Simd`]
//! trait and compiled per ISA. Splitting depends only on the geometry, never on the
//! number of threads, and partial results are merged in a fixed order, so results are
//! bit-identical whatever the thread count. Reductions accumulate in `U` (f32) lanes
//! over cache-sized tiles and merge tiles in `f64`.
//!
//! Kernels do no validation: the op and typed layers check every length first.

pub(crate) mod apply;
pub(crate) mod backward;
pub(crate) mod fused;
pub(crate) mod second_order;
pub mod simd;
pub(crate) mod stats;

use rayon::prelude::*;

/// A kernel's scratch of `n` copies of `v`: inline (on the stack) up to `N`, on the
/// heap beyond. Sized so that the scratch of a small tensor's few channel groups needs
/// no allocation: at 2x8x8x32 a second-order call made about 18 allocations
/// (callgrind) and spent about 15 % of its time in malloc and free (perf).
pub(crate) type Scratch<T, const N: usize> = smallvec::SmallVec<[T; N]>;

/// `n` copies of `v` as [`Scratch`].
#[inline(always)]
pub(crate) fn scratch<T: Clone, const N: usize>(v: T, n: usize) -> Scratch<T, N> {
    smallvec::SmallVec::from_elem(v, n)
}

/// `n` copies of `v` from `arena` where given (large C, see [`with_arena`]), else as
/// [`scratch`] kept in `buf` (which the caller declares empty, to outlive the slice).
#[inline(always)]
pub(crate) fn scratch_in<'a, T: Copy, const N: usize>(
    arena: Option<&'a bumpalo::Bump>,
    buf: &'a mut Scratch<T, N>,
    v: T,
    n: usize,
) -> &'a mut [T] {
    match arena {
        Some(a) => a.alloc_slice_fill_copy(n, v),
        None => {
            *buf = scratch(v, n);
            buf
        }
    }
}

/// Runs `f` with this thread's kernel arena, emptied first: scratch that grows with C
/// (a channels-last task's per-channel sums, pivots and pattern of constants) is taken
/// from it instead of the heap.
///
/// Why: such scratch, allocated and freed once a task, is a few hundred KiB at large C,
/// where glibc's malloc serves it from `mmap` or trims it back to the kernel when freed,
/// so every task paid page faults (and the zeroing of fresh pages) for its scratch.
/// NHWC 4096x1x1x8192 (Zen 3, AVX2, 2 threads) saw about 2,600 page faults a
/// statistics call, and the call took 12.5 ms with them against 7.5 ms with malloc
/// told not to give memory back (`GLIBC_TUNABLES`, a trial). The arena keeps its
/// largest block between tasks and calls, up to [`ARENA_KEEP_BYTES`].
///
/// A call made while the arena is in use on this thread gets a fresh one (freed after:
/// the heap's behaviour again). That happens when the caller is itself a task of the
/// pool (a kernel called inside `rayon::ThreadPool::install` and the like, where the
/// caller's thread may run tasks while it waits); [`task_waves`] keeps its results in
/// a buffer of their own, so the tasks it runs on the calling thread do not.
pub(crate) fn with_arena<R>(f: impl FnOnce(&bumpalo::Bump) -> R) -> R {
    thread_local! {
        static ARENA: std::cell::RefCell<bumpalo::Bump> =
            std::cell::RefCell::new(bumpalo::Bump::new());
    }
    ARENA.with(|cell| in_arena(cell, f))
}

/// `f` with this thread's arena where `large` ([`with_arena`]), with none (the heap)
/// otherwise: the one switch of every kernel that takes C-sized scratch from it.
pub(crate) fn arena_if<R>(large: bool, f: impl FnOnce(Option<&bumpalo::Bump>) -> R) -> R {
    if large {
        with_arena(|arena| f(Some(arena)))
    } else {
        f(None)
    }
}

/// `f` with `len` values of the calling thread's buffer of [`task_waves`] results of
/// type `R`, kept between calls, one per type (the statistics' `Moments`, the backward
/// sums' `f64`, the second-order sums' `[f64; 6]`: a training step or a second-order
/// call takes two in turn), each while its allocation is at most
/// [`ARENA_KEEP_BYTES`]. Not the thread's arena, so that the tasks run on this thread
/// still find that free. Its values are those the last call left (`zero` where it
/// grew): each task zeroes its own results, on its own thread. (Zeroed on this one
/// first, from an arena, the results of the tasks run on the other core were lines
/// they had to fetch from L3; see `task_waves`.) A nested call of the same type (a
/// task of the pool calling a kernel on this thread) finds none and makes its own.
fn with_wave_buffer<R: Copy + 'static, T>(len: usize, zero: R, f: impl FnOnce(&mut [R]) -> T) -> T {
    use std::any::Any;
    thread_local! {
        static WAVES: std::cell::Cell<Vec<Box<dyn Any>>> = const { std::cell::Cell::new(Vec::new()) };
    }
    let mut kept = WAVES.with(|w| w.take());
    let mut buf: Vec<R> = match kept.iter().position(|b| b.is::<Vec<R>>()) {
        Some(i) => kept
            .swap_remove(i)
            .downcast::<Vec<R>>()
            .map_or_else(|_| Vec::new(), |b| *b),
        None => Vec::new(),
    };
    // The others back for calls `f` makes (none of the callers does).
    WAVES.with(|w| w.set(kept));
    if buf.len() < len {
        buf.reserve_exact(len - buf.len());
        buf.resize(len, zero);
    }
    let r = f(&mut buf[..len]);
    if buf.capacity() * std::mem::size_of::<R>() <= ARENA_KEEP_BYTES {
        let mut kept = WAVES.with(|w| w.take());
        kept.retain(|b| !b.is::<Vec<R>>());
        kept.push(Box::new(buf));
        WAVES.with(|w| w.set(kept));
    }
    r
}

/// `f` with the arena in `cell`, emptied first (a fresh one if it is in use), which
/// keeps its largest block after, up to [`ARENA_KEEP_BYTES`].
fn in_arena<R>(cell: &std::cell::RefCell<bumpalo::Bump>, f: impl FnOnce(&bumpalo::Bump) -> R) -> R {
    match cell.try_borrow_mut() {
        Ok(mut arena) => {
            arena.reset();
            let r = f(&arena);
            if arena.allocated_bytes() > ARENA_KEEP_BYTES {
                *arena = bumpalo::Bump::new();
            }
            r
        }
        Err(_) => f(&bumpalo::Bump::new()),
    }
}

/// The most bytes a thread's kernel arena keeps between calls ([`with_arena`]), and
/// each of its buffers of wave results ([`with_wave_buffer`]): more
/// than the statistics' scratch of a channels-last task at C = 65,536 (3.3 MiB with
/// AVX2: 52 bytes a channel); past it each call gets fresh memory again.
const ARENA_KEEP_BYTES: usize = 8 << 20;

/// The least bytes of scratch a kernel takes from [`with_arena`] rather than the heap:
/// glibc's first `mmap` threshold, from which a block allocated and freed a task came
/// back as fresh pages.
pub(crate) const ARENA_MIN_BYTES: usize = 128 << 10;

/// Runs `task(t, item, out)` for the `n` tasks of a pass whose per-task results take
/// at least [`ARENA_MIN_BYTES`] (`width` values each: a channels-last reduction at
/// large C), in parallel when `g` is large, `out` a slice of `width` copies of `zero`;
/// after each wave of tasks, `merge(parts)` with the wave's results in task order
/// (`width` each), each task's `out` zeroed by the task. The waves' results live in
/// the calling thread's buffer ([`with_wave_buffer`]), a wave [`WAVE_BYTES`] at most
/// but at least four tasks (past [`ARENA_KEEP_BYTES`] from C ≈ 87,000 in the
/// statistics and C ≈ 43,700 in the second-order sums, where the buffer is dropped
/// after each call: not measured): a vector of results a task, allocated and freed
/// each call, had been fresh pages every call (12.6 MB of moments for NHWC
/// 4096x1x1x8192's 64 statistics tasks). `items`: one per task (a task's piece of an
/// output), handed to its task.
pub(crate) fn task_waves<I, R, F, M>(
    g: &Geometry,
    items: Vec<I>,
    width: usize,
    zero: R,
    task: F,
    mut merge: M,
) where
    I: Send,
    R: Copy + Send + Sync + 'static,
    F: Fn(usize, I, &mut [R]) + Sync + Send,
    M: FnMut(&[R]),
{
    let n = items.len();
    let width = width.max(1);
    let wave = (WAVE_BYTES / (width * std::mem::size_of::<R>()).max(1)).clamp(4, n.max(4));
    let mut items = items.into_iter();
    with_wave_buffer(wave.min(n) * width, zero, |parts| {
        for t0 in (0..n).step_by(wave) {
            let t1 = (t0 + wave).min(n);
            let parts = &mut parts[..(t1 - t0) * width];
            let wave_items: Vec<I> = items.by_ref().take(t1 - t0).collect();
            // Each task zeroes its results where it runs: they stay in that core's
            // cache for the task's sums.
            let run = |(i, (item, out)): (usize, (I, &mut [R]))| {
                out.fill(zero);
                task(t0 + i, item, out)
            };
            if g.parallel() {
                wave_items
                    .into_par_iter()
                    .zip(parts.par_chunks_mut(width))
                    .enumerate()
                    .for_each(run);
            } else {
                wave_items
                    .into_iter()
                    .zip(parts.chunks_mut(width))
                    .enumerate()
                    .for_each(run);
            }
            merge(parts);
        }
    });
}

/// Bytes of per-task results [`task_waves`] keeps at a time: 10 tasks of statistics a
/// wave at C = 8192.
const WAVE_BYTES: usize = 2 << 20;

/// Elements per channel-major reduction tile: the second pass over a tile hits L1.
pub const TILE: usize = 8192;
/// Target elements per channels-last reduction tile (pixels × C): fits L2.
pub const CL_TILE: usize = 32768;
/// Elements per parallel task (each task is one rayon job).
pub const TASK: usize = 1 << 18;
/// Below this many elements every pass runs on the calling thread: a rayon hand-off
/// and the other core's cold caches cost more than the work. Raised from 2^15: on the
/// 2-core Intel Xeon (`scripts/ab.sh 5 "--shape 2,16,16,64 --shape 2,16,16,128 --shape
/// 3,16,16,128 --shape 4,16,16,128 --op all --dtype f32,bf16 --isa avx2,avx512 --runs
/// 200 --min-time 0.05"`, medians of the ms, this threshold's build ÷ the old one's;
/// below it, one thread against two) the ops of 32,768 and 65,536 elements took
/// 0.62–0.99 of their time in the median of each shape and dtype (f32 0.62–0.76, bf16
/// 0.82–0.99), faster in 116 of 128 cells; of the 12 slower, 7 are bf16 second-order
/// ops (up to 1.38 at NCHW 2x128x16x16 with AVX2), whose work per element would pay for
/// the second thread sooner. At 98,304 f32 took 0.81–0.85 and bf16 0.97–1.14; 131,072
/// (still parallel, the control) moved 0.98–1.02. f16 (`--dtype f16`): 0.75–0.88 at
/// 32,768 and 65,536, 58 of 64 cells faster. The splits that decide the bits do not
/// depend on it (`scripts/same_bits.py`: 0 of 15,360 files differ).
pub const PARALLEL_MIN: usize = 1 << 17;

/// Whether a pass over `elements` elements uses the thread pool: at least
/// [`PARALLEL_MIN`] of them, and more than one thread in the pool.
pub(crate) fn uses_pool(elements: usize) -> bool {
    elements >= PARALLEL_MIN && rayon::current_num_threads() > 1
}

/// A channel's data (x, or dy and x) up to this many bytes is processed while it is
/// resident in the core's caches (L2 and its share of L3; measured: a 802 KB channel
/// went from 1.7× to 1.1× copy time when it was allowed to stay resident). Raised from
/// 4 MiB: on a Zen 4 (1 MiB L2, 32 MiB L3, 2 threads) NCHW backward training of
/// 64x64x112x112 f32 (6.4 MB of dy and x per channel) went from 1.45–1.48 to
/// 1.05–1.12 of a copy, and a 16 MiB limit gained little more (1.48 → 1.42 at 12.8
/// MB). The limit on machines whose reported last-level cache is at most
/// [`LLC_CAP_BYTES`]; others count on their L2 alone ([`resident_bytes`]). The path does
/// not change the bits: both reduce by the same row chunks.
pub const RESIDENT_BYTES: usize = 8 << 20;
/// Channels a resident training task walks at least ([`ChannelMajorSplit::whole_channels`]):
/// a task writes each channel's output while it reduces the next (`fused::RowsBehind`),
/// so its first reduction alone runs without writes beside it. Measured on an Intel
/// Xeon (AVX-512, 2 threads, NCHW, time ÷ copy, p25–p75): 4, 8, 16 and 32 channels a
/// task gave backward training f32 64x64x112x112 1.12–1.16, 1.07–1.10, 1.03–1.07,
/// 1.02–1.05 and bf16 1.27–1.30, 1.22–1.27, 1.19–1.25, 1.17–1.22; forward training
/// bf16 64x64x112x112 1.31–1.38, 1.27–1.33, 1.28–1.35, 1.23–1.28.
pub const PIPELINE_CHANNELS: usize = 32;

/// A resident pass writes a channel while it reduces the next only when a channel of x
/// takes at least this many bytes; smaller channels are reduced, then written while
/// the next one is prefetched whole, which they survive in L2. Measured on the Intel
/// Xeon (`scripts/ab.sh 3`, NCHW, time ÷ copy, reduce-then-write against pipelined):
/// 16x512x28x28 f32 (50 KB a channel) forward training 0.84 against 1.20, 16x1024x14x14
/// f32 (12.5 KB) 1.17 against 1.28, bf16 16x512x28x28 backward 1.25 against 1.33; but
/// 16x64x56x56 bf16 (100 KB) forward 1.77 against 1.49, f32 (200 KB) backward 1.30
/// against 1.14, and every channel of the DRAM-sized targets (800 KB and more) faster
/// pipelined (CHANGELOG.md).
pub const PIPELINE_MIN_CHANNEL_BYTES: usize = 64 << 10;
/// Outputs of at least this many bytes, whose pass also reads an input as large — so
/// that input and output together exceed the last-level cache ([`llc_bytes`]) — are
/// written with non-temporal stores: ordinary stores would read each output line first
/// and then evict the input. (Measured on a 32 MiB-L3 Zen 3, 16x56x56x256 f16, 26 MB
/// out: forward inference 1.16-1.23 -> 0.90-0.94 of a copy, backward inference
/// 1.04-1.06 -> 0.89-0.92; f32 outputs of 51 MB were 25 % faster streamed.)
pub const STREAM_BYTES: usize = 16 << 20;

/// Channel-major training passes over rows shorter than this many bytes keep no
/// channel resident when the inputs and the output together fit [`STREAM_BYTES`]
/// ([`Geometry::resident`]).
pub const RESIDENT_SHORT_ROW_BYTES: usize = 4096;

/// Channel-major training passes over rows shorter than this many bytes keep no
/// channel resident, whatever the tensor's size: a channel of such rows is a few lines
/// in each of `N` pages, and two passes in memory order (x read twice from DRAM) beat
/// the resident walk. Measured on a Zen 4 (32 MiB L3, 2 threads, interleaved, 5 rounds):
/// 64x2048x7x7 bf16 forward training 5.25 -> 1.91 ms, backward training 5.62 -> 3.37,
/// f32 forward training 6.80 -> 3.60; 64x1024x14x14 bf16 (392-byte rows) forward
/// training 3.87 -> 2.77, backward even; f32 at 14x14 (784-byte rows) stays resident
/// (backward training 7.45 resident, 9.03 in two passes). The same bits either way
/// (the resident passes reduce by the two-pass split's row chunks).
pub const RESIDENT_MIN_ROW_BYTES: usize = 512;

/// Channel-major rows shorter than this many bytes are never streamed. A row is
/// streamed from its first aligned vector to its last whole one, with ordinary stores
/// before and after, so a short row's cache lines mix non-temporal and ordinary stores
/// (and the next row's): measured on a 32 MiB-L3 Zen 3, NCHW forward inference of
/// 128x2048x7x7 (196-byte f32 rows) took 6.0 times its copy streamed and 1.0 not;
/// 64x1024x14x14 bf16 (392-byte rows) 3.4 and 1.1; 32x512x28x28 f32 (3136-byte rows)
/// 0.86 streamed and 0.99 not (and its bf16 training passes, 1568-byte rows, were
/// faster streamed).
pub const STREAM_ROW_BYTES: usize = 1024;

/// Channel-major rows shorter than this many bytes are walked image by image where a
/// pass allows it ([`Geometry::rows_in_image_order`]): the inference gradient, the
/// training gradient's sums and the second-order sums. At most [`STREAM_ROW_BYTES`]:
/// the image-order walks write with ordinary stores. Measured on the AVX2-only Zen 3
/// (32 MiB L3, 2 threads, `scripts/ab.sh 7`, time ÷ copy, channel walk / image walk):
/// NCHW inference gradient 16x2048x7x7 f32 2.45 -> 1.14, bf16 5.27 -> 3.90,
/// 16x1024x14x14 f32 (784-byte rows) 1.38 -> 0.95; from DRAM 64x2048x7x7 bf16 3.18 ->
/// 1.74 (CHANGELOG.md).
pub const IMAGE_ORDER_ROW_BYTES: usize = STREAM_ROW_BYTES;

/// The most channels an image-order walk ([`RowOrder::Images`]) keeps sums for at a
/// time: a task's channels are walked in blocks of this many, each block image by
/// image. It bounds the walk's scratch (six vectors a channel for the second-order
/// sums: 48 KiB with AVX2, within an L2) whatever the task's channel count, which rows
/// of a few elements make large (NCHW 1x131072x1x2 is one task of 131,072 channels).
/// A block of 7x7 16-bit rows is 25 KB of each tensor an image, contiguous.
pub const IMAGE_BLOCK_CHANNELS: usize = 256;

// The image-order walks write with ordinary stores: only rows that are never streamed.
const _: () = assert!(IMAGE_ORDER_ROW_BYTES <= STREAM_ROW_BYTES);

/// How far ahead of its loads the channels-last statistics prefetch x when their
/// accumulators live in memory (more channels than fit registers), and how far the
/// 16-bit backward sums from DRAM prefetch dy and x (`backward::Quads::Prefetched`).
/// Raised from 4096 on a Zen 4 (in-process `moments` from DRAM, interleaved, medians of 5–7): bf16
/// 64x56x56x256 AVX-512 4.34 -> 3.49 ms with 2 threads, 7.46 -> 5.83 with one;
/// 64x28x28x1024 bf16 7.78 -> 6.11; f32 64x56x56x256 AVX-512 8.32 -> 7.53; f16 AVX2
/// 64x112x112x64 one thread 5.93 -> 5.02; f32 16x28x28x512 (in L3) one thread 1.54 ->
/// 1.21. The one case that went the other way: f32 C = 64 with AVX2, 6.9–7.0 -> 7.2–7.7
/// ms. (In the backward sums' one-pixel-at-a-time loop the same prefetch was slower for
/// f32 and for C = 64 at either distance, so that loop has none.) Both four-pixel loops
/// prefetch once per 64-byte line (`Simd::prefetch_lines`): a prefetch takes a load
/// slot, and one per vector of each pixel (four per line for 16-bit data with AVX2) made
/// the bf16 statistics of 64x56x56x256 from DRAM 7.69 ms on a Zen 3 against 5.50 with
/// one per line (f16 7.39 -> 5.42; in L3, one thread, 16x28x28x512 bf16 0.92 -> 0.82
/// ms). Twice as far (16 KiB) was measured on an Intel Xeon (AVX-512, 2 MiB L2) on
/// 2026-11-28, for every user of this constant and for the in-memory-accumulator
/// statistics alone (`scripts/ab.sh 4` and `5` against 8 KiB, NHWC forward training,
/// DRAM and in-cache shapes, AVX-512 and AVX2; also NHWC inference and backward and NCHW
/// forward inference for every user): the forward training cells moved by -0.50 to
/// +0.53 of a copy in both directions, about as much as the 8 KiB build moved between
/// runs that hour (64x56x56x256 bf16 AVX2 1.49, 1.96, 1.69), the other ops within
/// ±0.12; not taken.
pub(crate) const PREFETCH_BYTES: usize = 8192;

/// The most last-level cache [`llc_bytes`] counts on, whatever the machine reports. A
/// virtual machine's sysfs gives the whole host's L3 (480 MiB on an Intel Xeon with
/// AVX-512 here, 2 cores of it lent), of which a 2-core guest gets far less: there, with
/// the reported size, outputs up to 240 MiB were written with ordinary stores, and
/// NHWC f32 64x56x56x256 forward inference took 1.15 of a copy, forward training 1.68,
/// backward training 1.54. Measured there (`scripts/ab.sh 3`, f32, the LLC forced to
/// 480 MiB and to a cap, interleaved, ms): tensors of 48 MiB and more are faster
/// streamed (NCHW 12x256x64x64 backward inference 5.15 -> 3.58 ms, NHWC forward
/// training 4.43 -> 3.41, 64x56x56x256 forward inference 18.0 -> 12.4), tensors of 16
/// and 32 MiB slower (NCHW forward inference 0.63 -> 1.26 and 1.29 -> 2.08 ms), bf16 at
/// 48 MiB mixed and at 64 MiB faster. A cap of 96 MiB streams from 48 MiB; machines
/// with a 32 MiB L3 (the Zen 3 and Zen 4 of README.md) are unchanged.
pub const LLC_CAP_BYTES: usize = 96 << 20;

/// The data caches of CPU 0 as Linux's sysfs gives them: `(largest, level 2)`, in
/// bytes, 0 where unknown. Read once per process.
fn caches() -> (usize, usize) {
    static CACHES: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *CACHES.get_or_init(|| {
        let (mut best, mut l2) = (0, 0);
        for i in 0..8 {
            let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
            let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).ok();
            if read("type").is_some_and(|t| t.trim() == "Instruction") {
                continue;
            }
            if let Some(size) = read("size").and_then(|v| parse_size(v.trim())) {
                best = best.max(size);
                if read("level").is_some_and(|v| v.trim() == "2") {
                    l2 = size;
                }
            }
        }
        (best, l2)
    })
}

/// The size of the largest data cache of CPU 0 (Linux sysfs), or 32 MiB where it cannot
/// be read, at most [`LLC_CAP_BYTES`].
pub fn llc_bytes() -> usize {
    match caches().0 {
        0 => 32 << 20,
        best => best.min(LLC_CAP_BYTES),
    }
}

/// The most bytes of a channel (all the inputs a pass keeps) that a channel-major
/// training pass keeps resident: [`RESIDENT_BYTES`], or the core's L2 where the
/// machine reports a last-level cache larger than [`LLC_CAP_BYTES`] (a host's whole L3
/// shared with its other tenants, far from the core: residency there must come from
/// L2). Measured on an Intel Xeon with AVX-512 (2 MiB L2 a core, 480 MiB L3 reported,
/// 2 cores of a VM; `scripts/ab.sh 3`, NCHW, time ÷ copy, limit 8 MiB against 2 MiB):
/// 64x64x112x112 (3.2 MB of f32 x a channel) forward training f32 1.43 -> 1.26 with
/// AVX-512 and 1.63 -> 1.38 with AVX2, backward training bf16 1.71 -> 1.42 and 1.77 ->
/// 1.51, Ex backward f32 64x256x56x56 (2.4 MB of three inputs) 1.36 -> 0.97; channels
/// that fit the L2 (64x256x56x56 f32 and bf16) unchanged. The bits do not depend on the
/// path (both reduce by the same row chunks), so they do not depend on the machine.
pub(crate) fn resident_bytes() -> usize {
    match caches() {
        (llc, l2) if llc > LLC_CAP_BYTES && l2 > 0 => RESIDENT_BYTES.min(l2),
        _ => RESIDENT_BYTES,
    }
}

/// The most last-level cache a machine may report for the Ex gradient's side pass to
/// keep its channels resident even when its tensors stream from DRAM
/// ([`side_resident_streamed`]).
const SIDE_RESIDENT_LLC_MAX: usize = 192 << 20;

/// Whether the Ex gradient's side pass (`fused::backward_training_side`) keeps channels
/// that fit its resident limit (`resident_bytes`) resident even when its tensors are
/// streamed: on machines that report a last-level cache past [`LLC_CAP_BYTES`] but not
/// past [`SIDE_RESIDENT_LLC_MAX`]; and where the pass writes `dx` inside the reduction's
/// loop (`zipped`: 32-bit elements in a pipelined pass, `fused::zips`), on machines that
/// report at most [`LLC_CAP_BYTES`] or no cache size (taken as 32 MiB, as
/// [`llc_bytes`] does) too. The Zen 3 of README.md (32 MiB, AVX2 only) was measured
/// with two sweeps before the zip, not with it.
/// Measured on two Intel Xeons with 2 MiB of L2 a core (2 cores of a VM each, NCHW
/// 64x256x56x56, 1.6 MB of dy, x, y and the side gradient a 16-bit channel; time ÷
/// copy, two sweeps against resident): one reporting 300–480 MiB of L3 (2026-11-29,
/// AVX-512) f16 1.14 against 1.49, bf16 1.17 against 1.27 (AVX2 1.31 both), so two
/// sweeps; one of the Sapphire Rapids class reporting 105 MiB (2026-12-03,
/// `scripts/ab.sh 3`) bf16 1.29 against 1.20 with AVX-512 and 1.46 against 1.17 with
/// AVX2, f16 1.36 against 1.09 and 1.42 against 1.23, so resident. On the Zen 4 of
/// README.md (32 MiB of L3, 1 MiB of L2 a core; 2026-12-05, `scripts/ab.sh 3`, two
/// sweeps against resident): 16-bit data two sweeps (64x256x56x56 bf16 1.24 against
/// 1.51 with AVX2, f16 1.20 against 1.39), f32 with the zip resident (64x256x56x56
/// 1.17 against 0.98 with AVX2 and 1.20 against 0.94 with AVX-512, 64x128x56x56 1.20
/// against 1.06 and 1.14 against 1.05, 64x112x64x112 1.18 against 1.15 and 1.14 against
/// 1.08). The bits do not depend on the path.
pub(crate) fn side_resident_streamed(zipped: bool) -> bool {
    let (llc, l2) = caches();
    (llc > LLC_CAP_BYTES && llc <= SIDE_RESIDENT_LLC_MAX && l2 > 0)
        || (zipped && llc <= LLC_CAP_BYTES)
}

/// `i + 1`, wrapping to 0 at `n`: the index of a cyclic walk (channel of the next row,
/// accumulator set of the next pixel) without a division per step.
#[inline(always)]
pub(crate) fn next_cyclic(i: usize, n: usize) -> usize {
    if i + 1 >= n {
        0
    } else {
        i + 1
    }
}

/// `"32768K"`, `"1M"` or `"512"` in bytes.
fn parse_size(v: &str) -> Option<usize> {
    let (num, mul) = match v.as_bytes().last()? {
        b'K' => (&v[..v.len() - 1], 1 << 10),
        b'M' => (&v[..v.len() - 1], 1 << 20),
        b'G' => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}
/// Largest periodic constant pattern (elements) for channels-last elementwise passes.
pub const MAX_PERIOD: usize = 1 << 14;

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

    /// Whether a pass over this geometry should use the thread pool.
    pub(crate) fn parallel(&self) -> bool {
        uses_pool(self.len())
    }

    /// Whether a channel-major training pass over `inputs` tensors of elements of `size`
    /// bytes runs channel by channel, each channel reduced and then transformed while it
    /// is resident in the caches: while its `inputs` take at most `limit` bytes a
    /// channel ([`RESIDENT_BYTES`], or [`resident_bytes`] for a pass that reads a
    /// channel twice in a row).
    pub(crate) fn resident(&self, size: usize, inputs: usize, limit: usize) -> bool {
        // Rows of a few cache lines: never resident (see RESIDENT_MIN_ROW_BYTES).
        if self.inner * size < RESIDENT_MIN_ROW_BYTES {
            return false;
        }
        // Short rows in tensors that fit a last-level cache: the second read of each
        // channel comes from that cache anyway, and walking a channel row by row (one
        // row per page) cost more than two passes in memory order (measured on a 32
        // MiB L3: 16x2048x7x7 bf16 forward training 0.77 -> 0.61 ms, 16x512x7x7 f32
        // backward training 0.20 -> 0.15 ms). A fixed size, not this machine's cache,
        // so that the choice of path does not depend on the machine (the bits do not
        // depend on it either way: both paths reduce by the same row chunks).
        let in_cache = (inputs + 1) * self.len() * size <= STREAM_BYTES;
        if self.inner * size < RESIDENT_SHORT_ROW_BYTES && in_cache {
            return false;
        }
        !self.channels_last() && inputs * self.per_channel() * size <= limit
    }

    /// Whether a resident pass writes each channel while it reduces the next
    /// ([`PIPELINE_MIN_CHANNEL_BYTES`]); otherwise it reduces a channel, then writes it
    /// while it prefetches the next. The bits are the same either way.
    pub(crate) fn pipelined(&self, size: usize) -> bool {
        self.per_channel() * size >= PIPELINE_MIN_CHANNEL_BYTES
    }

    /// Whether an output of this geometry with elements of `size` bytes is streamed:
    /// the output and an input of the same size do not fit the last-level cache
    /// together (see [`STREAM_BYTES`]).
    pub(crate) fn stream(&self, size: usize) -> bool {
        let bytes = self.len() * size;
        bytes >= STREAM_BYTES && 2 * bytes >= llc_bytes() && self.streamable_rows(size)
    }

    /// Whether a channel-major pass that walks one task's rows channel by channel may
    /// walk them image by image instead, in memory order ([`RowOrder::Images`]): rows
    /// shorter than [`IMAGE_ORDER_ROW_BYTES`], which are never streamed, of more than
    /// one image (with one, the walk by channel is already in memory order); not empty
    /// rows (the walk finds an image's index by dividing by the plane).
    pub(crate) fn rows_in_image_order(&self, size: usize) -> bool {
        !self.channels_last()
            && self.outer > 1
            && (1..IMAGE_ORDER_ROW_BYTES).contains(&(self.inner * size))
    }

    /// Whether the rows of this geometry are long enough to stream
    /// ([`STREAM_ROW_BYTES`]): channels-last passes write whole tasks, channel-major
    /// ones a row at a time.
    fn streamable_rows(&self, size: usize) -> bool {
        self.channels_last() || self.inner * size >= STREAM_ROW_BYTES
    }

    /// As [`Geometry::stream`], for the output of an L2-resident pass (channel-major
    /// training): its input comes from DRAM once either way, so any output past
    /// [`STREAM_BYTES`] is streamed (measured, 16x256x56x56 f16 on a 32 MiB L3:
    /// backward training 1.36 -> 1.15 of a copy, forward 1.45 -> 1.36).
    pub(crate) fn stream_resident(&self, size: usize) -> bool {
        self.len() * size >= STREAM_BYTES && self.streamable_rows(size)
    }

    /// Pixels per channels-last elementwise task: a multiple of `lcm(C, 32) / C`
    /// pixels (a multiple of 32 elements: 64 bytes of 16-bit data, whole vectors of
    /// every ISA), so every task starts at the same alignment and lane phase as the
    /// first; about [`TASK`] elements at most (at least one unit: 32 pixels for an odd
    /// C), in [`balanced`] tasks. Where that unit would leave a thread without a task
    /// (few pixels of an odd C: 128 pixels of 1025 channels on three threads made two
    /// tasks of 64), 16 pixels instead, as before: a task's kernel finds its own
    /// alignment, and an elementwise split decides no bits.
    ///
    /// The unit had been 16 pixels whatever C, which undid the balance where a pixel
    /// is long: 16x7x7x2048 (784 pixels) was cut 7 × 112 where [`balanced`] asked 8 × 98,
    /// one thread taking four tasks and the other three.
    fn pixels_per_task(&self) -> usize {
        let c = self.channels.max(1);
        let unit = apply::lcm(c, 32) / c;
        let most = ((TASK / c) / unit).max(1) * unit;
        let parallel = self.parallel();
        let per = balanced(self.outer, most, parallel);
        let whole = per.next_multiple_of(unit);
        let threads = if parallel {
            rayon::current_num_threads().max(1)
        } else {
            1
        };
        if unit > 16 && self.outer.div_ceil(whole) < threads.min(self.outer) {
            per.next_multiple_of(16)
        } else {
            whole
        }
    }

    /// Whole rows ([`Geometry::row_len`]) per task of an elementwise pass: pixels in
    /// whole units of 32 elements channels-last ([`Geometry::pixels_per_task`]),
    /// [`balanced`] rows of about [`TASK`] elements channel-major.
    pub(crate) fn rows_per_task(&self) -> usize {
        if self.channels_last() {
            self.pixels_per_task()
        } else {
            let most = (TASK / self.row_len().max(1)).max(1);
            balanced(self.outer * self.channels, most, self.parallel())
        }
    }
}

/// Items per task when `items` are cut into tasks of at most `most` items: as few tasks
/// as that allows, but for a `parallel` pass about a multiple of the pool's threads
/// (while there are items for them), of equal size (the last may be shorter, and
/// rounding the size up can leave a task fewer: 10 items of at most 4 on 8 threads
/// are 5 tasks of 2). Without it a tensor of a few tasks left a
/// thread idle: NCHW 16x512x7x7 was cut 334 + 178 channels and 5349 + 2843 rows, and on
/// two threads its 16-bit forward training was barely faster than on one. Only for
/// splits that do not decide the bits (whole channels, elementwise rows): the row
/// chunks of a reduction stay fixed by the shape alone.
pub(crate) fn balanced(items: usize, most: usize, parallel: bool) -> usize {
    let mut tasks = items.div_ceil(most.max(1)).max(1);
    if parallel {
        let threads = rayon::current_num_threads().max(1);
        tasks = tasks.next_multiple_of(threads).min(items.max(1));
    }
    items.div_ceil(tasks).max(1)
}

/// Runs `f(first_row, out_rows)` over fixed chunks of whole rows of `out` (a tensor of
/// geometry `g`; rows as in [`Geometry::row_len`]), in parallel when `g` is large.
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

/// [`for_each_row_chunk`] over two outputs of the same geometry at once (the same
/// chunks of each): `f(first_row, a_chunk, b_chunk)`.
pub(crate) fn for_each_row_chunk_pair<O, F>(g: &Geometry, a: &mut [O], b: &mut [O], f: F)
where
    O: Send,
    F: Fn(usize, &mut [O], &mut [O]) + Sync + Send,
{
    let rpt = g.rows_per_task();
    let chunk = (rpt * g.row_len()).max(1);
    if g.parallel() {
        a.par_chunks_mut(chunk)
            .zip(b.par_chunks_mut(chunk))
            .enumerate()
            .for_each(|(i, (a, b))| f(i * rpt, a, b));
    } else {
        a.chunks_mut(chunk)
            .zip(b.chunks_mut(chunk))
            .enumerate()
            .for_each(|(i, (a, b))| f(i * rpt, a, b));
    }
}

/// Maps `f` over owned items (in parallel when `g` is large), results in order.
pub(crate) fn map_items<I: Send, R: Send>(
    g: &Geometry,
    items: Vec<I>,
    f: impl Fn(usize, I) -> R + Sync + Send,
) -> Vec<R> {
    if g.parallel() {
        items
            .into_par_iter()
            .enumerate()
            .map(|(i, v)| f(i, v))
            .collect()
    } else {
        items
            .into_iter()
            .enumerate()
            .map(|(i, v)| f(i, v))
            .collect()
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

/// The order in which a channel-major pass over one task's rows walks them. Either
/// way each channel's rows are summed in the same lanes, in the same order, with the
/// same tiles: the bits do not depend on it.
///
/// (Until 2026-12-07 the walk by channel could also hint the next channel's rows while
/// it worked on a channel's, for rows of 128 bytes to 1 KiB in tensors past the
/// last-level cache, where no hardware prefetcher follows rows a plane apart. Once such
/// rows of several images were walked image by image, only tensors of one image took
/// the hints, whose next channel's row is the next bytes in memory, and they were
/// removed: docs/performance.md, the Zen 3's tenth session.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowOrder {
    /// Channel by channel, each channel's rows a plane of the other channels apart.
    Channels,
    /// Image by image (outer index by outer index): the task's channels of one image
    /// are contiguous, so the walk reads and writes each tensor in memory order, with
    /// the channels' sums kept apart until their tile ends
    /// ([`Geometry::rows_in_image_order`], `backward::task_rows_by_image`).
    Images,
}

/// The `(outer, channels, inner)` geometries the tests of the image-order walks run
/// ([`RowOrder::Images`] against the channel walk): rows of 49, 15, 2, 3 and 200
/// elements, 16x700x7x7 in several tasks, channels of several tiles (3000 rows of 3,
/// 90 of 200), channels split into row chunks of several tiles (1400 rows of 200),
/// and a task of more channels than a block (1100 channels: [`IMAGE_BLOCK_CHANNELS`]).
#[cfg(test)]
pub(crate) const IMAGE_WALK_GEOMETRIES: [(usize, usize, usize); 7] = [
    (16, 700, 49),
    (5, 64, 15),
    (3, 9, 2),
    (3000, 3, 3),
    (90, 5, 200),
    (1400, 2, 200),
    (4, 1100, 3),
];

/// The fixed split of a channel-major pass into tasks of about [`TASK`] elements:
/// a task covers channels `[c0, c1)` and outer rows `[o0, o1)` of each — either a
/// group of whole small channels, or a chunk of the rows of one large channel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChannelMajorSplit {
    /// Channels per task (1 when channels are split into row chunks).
    pub channels_per_task: usize,
    /// Outer rows per task.
    pub rows_per_task: usize,
    /// Row chunks per channel (1 when channels are grouped).
    pub chunks: usize,
}

/// One task of a [`ChannelMajorSplit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChannelTask {
    pub c0: usize,
    pub c1: usize,
    pub o0: usize,
    pub o1: usize,
}

impl ChannelMajorSplit {
    pub fn new(g: &Geometry) -> Self {
        let per_channel = g.per_channel().max(1);
        if per_channel >= TASK {
            // As few chunks as keep a task within TASK elements (rounded up to an even
            // number, below), of equal rows (the last may be shorter): 64x64x112x112
            // splits 16, 16, 16, 16, not 20, 20, 20, 4, so that the threads of a shared
            // resident pass (`fused::cooperative`) can take equal shares of a channel's
            // chunks (and the two-pass tasks are of equal size).
            // Tried (2026-12-02, Zen 4, 1 MiB L2): half this TASK, so that the 800 KB
            // channels of 64x256x56x56 (16-bit dy and x) split in two chunks and the
            // threads share each one (half a channel a thread, two of them fit the L2)
            // instead of taking whole ones. `scripts/ab.sh 3`, NCHW, time ÷ copy:
            // backward training bf16 1.24 -> 1.13 (AVX2) and 1.24 -> 1.04 (AVX-512),
            // but f16 1.12 -> 1.29 and 1.14 -> 1.23, and forward training 16-bit slower
            // in all four cells (f16 AVX2 1.14 -> 1.41); f32 within 0.07. Not kept (it
            // would also have changed the bits of every such channel-major reduction).
            // An even number of chunks where there are rows for it: with an odd one the
            // two threads of a shared pass took unequal shares and the one with more
            // rows set the pace (128x64x112x112: 7 chunks of 19 rows, 76 rows against
            // 52, NCHW forward training 1.28-1.38 of a copy in every dtype against
            // 1.02-1.20 at 64x64x112x112, whose 4 chunks split evenly; Sapphire
            // Rapids-class Xeon, AVX-512, CHANGELOG 2026-12-03). Still the shape's
            // alone, not the pool's: the bits do not depend on the thread count.
            let most = (TASK / g.inner.max(1)).max(1);
            let fewest = g.outer.div_ceil(most).max(1);
            let chunks = if fewest > 1 && fewest % 2 == 1 {
                (fewest + 1).min(g.outer)
            } else {
                fewest
            };
            let rows_per_task = g.outer.div_ceil(chunks).max(1);
            ChannelMajorSplit {
                channels_per_task: 1,
                rows_per_task,
                chunks: g.outer.div_ceil(rows_per_task).max(1),
            }
        } else {
            ChannelMajorSplit {
                channels_per_task: balanced(g.channels, TASK / per_channel, g.parallel()),
                rows_per_task: g.outer,
                chunks: 1,
            }
        }
    }

    /// Whole channels only, about [`TASK`] elements a task and, for a `pipelined` pass
    /// ([`Geometry::pipelined`]), at least [`PIPELINE_CHANNELS`] channels (fewer where
    /// the threads would have fewer tasks than one each): the split of the passes that
    /// keep a channel resident from its reduction to its output.
    pub fn whole_channels(g: &Geometry, pipelined: bool) -> Self {
        let threads = rayon::current_num_threads().max(1);
        let least = if pipelined {
            PIPELINE_CHANNELS.min(g.channels.div_ceil(threads))
        } else {
            1
        };
        ChannelMajorSplit {
            channels_per_task: balanced(g.channels, TASK / g.per_channel().max(1), g.parallel())
                .max(least),
            rows_per_task: g.outer.max(1),
            chunks: 1,
        }
    }

    /// The tasks with the output rows of each (`out` is a tensor of geometry `g`): one
    /// walk over the tensor and one vector per task, holding one block per outer index
    /// (the task's channels of that image, contiguous) — not one slice per row, whose
    /// serial walk took 15 % of a one-thread NCHW 16x512x7x7 bf16 backward inference
    /// (8192 rows), nor one vector per channel (2048 allocations at 16x2048x7x7).
    pub fn rows_mut<'a, T>(&self, g: &Geometry, out: &'a mut [T]) -> Vec<TaskRows<'a, T>> {
        // The tasks' rows built in place (not a vector of tasks and one of blocks
        // zipped into a third: two allocations a call fewer, which small tensors
        // notice).
        let mut rows: Vec<TaskRows<'a, T>> = self
            .task_iter(g)
            .map(|task| TaskRows {
                task,
                inner: g.inner,
                blocks: Vec::with_capacity(task.o1 - task.o0),
            })
            .collect();
        let groups = g.channels.div_ceil(self.channels_per_task.max(1));
        let image = g.channels * g.inner;
        if image > 0 {
            for (o, mut rest) in out.chunks_mut(image).enumerate() {
                let chunk = o / self.rows_per_task.max(1);
                for group in 0..groups {
                    let c0 = group * self.channels_per_task;
                    let c1 = (c0 + self.channels_per_task).min(g.channels);
                    let (block, tail) = rest.split_at_mut((c1 - c0) * g.inner);
                    rows[group * self.chunks + chunk].blocks.push(block);
                    rest = tail;
                }
            }
        }
        rows
    }

    /// `f(task)` for every task (in parallel when `g` is large), which gives one result
    /// per channel of its task; a channel's results from several tasks are merged in
    /// row order. One result per channel.
    pub fn map_channels<R, F, M>(&self, g: &Geometry, f: F, merge: M) -> Vec<R>
    where
        R: Copy + Send,
        F: Fn(ChannelTask) -> Vec<R> + Sync + Send,
        M: Fn(R, R) -> R,
    {
        if let Some(only) = self.whole(g) {
            // Its results are already one per channel, in order: no task list, no
            // vector of results, no merge (four allocations fewer per reduction,
            // which small tensors notice).
            return f(only);
        }
        let tasks = self.tasks(g);
        let partials = map_tasks(g, tasks.len(), |i| f(tasks[i]));
        self.merge(g, partials, merge)
    }

    /// The one task of a split that has a single task holding every channel (a small
    /// tensor), whose per-channel results need no merge.
    fn whole(&self, g: &Geometry) -> Option<ChannelTask> {
        let mut tasks = self.task_iter(g);
        match (tasks.len(), tasks.next()) {
            (1, Some(t)) if t.c0 == 0 && t.c1 == g.channels => Some(t),
            _ => None,
        }
    }

    /// Folds per-task results of this split (one `R` per channel of each task, tasks
    /// in order) into one result per channel, merging a channel's chunks in row
    /// order; a [`whole`](Self::whole) task's results are returned as they are.
    pub fn merge<R: Copy>(
        &self,
        g: &Geometry,
        mut results: Vec<Vec<R>>,
        merge: impl Fn(R, R) -> R,
    ) -> Vec<R> {
        if results.len() == 1 && self.whole(g).is_some() {
            if let Some(only) = results.pop() {
                return only;
            }
        }
        let mut out: Vec<Option<R>> = vec![None; g.channels];
        for (t, rs) in self.task_iter(g).zip(results) {
            for (c, r) in (t.c0..t.c1).zip(rs) {
                out[c] = Some(match out[c] {
                    Some(prev) => merge(prev, r),
                    None => r,
                });
            }
        }
        out.into_iter().flatten().collect()
    }

    /// The tasks, channel-major: all chunks of a channel are consecutive.
    pub fn tasks(&self, g: &Geometry) -> Vec<ChannelTask> {
        self.task_iter(g).collect()
    }

    /// [`tasks`](Self::tasks) one at a time (its length known, so that a collect
    /// allocates once).
    fn task_iter(&self, g: &Geometry) -> impl ExactSizeIterator<Item = ChannelTask> + '_ {
        let per = self.channels_per_task.max(1);
        let (chunks, rows, outer, channels) =
            (self.chunks, self.rows_per_task, g.outer, g.channels);
        let groups = channels.div_ceil(per);
        (0..groups * chunks).map(move |i| {
            let (group, k) = (i / chunks, i % chunks);
            let c0 = group * per;
            let o0 = k * rows;
            ChannelTask {
                c0,
                c1: (c0 + per).min(channels),
                o0,
                o1: (o0 + rows).min(outer),
            }
        })
    }
}

/// The output rows of one task of a [`ChannelMajorSplit`], in tensor order.
pub(crate) struct TaskRows<'a, T> {
    /// The task.
    pub task: ChannelTask,
    /// Elements per row.
    inner: usize,
    /// Per outer index `o0..o1`: channels `c0..c1` of that image.
    blocks: Vec<&'a mut [T]>,
}

impl<'a, T> TaskRows<'a, T> {
    /// The first channel still held by the block of outer index `o`: rows taken by
    /// [`TaskRows::take_row`] leave it.
    #[inline(always)]
    fn first_channel(&self, i: usize) -> usize {
        match self.inner {
            0 => self.task.c0,
            n => self.task.c1 - self.blocks[i].len() / n,
        }
    }

    /// The output row of channel `c` at outer index `o` (both within the task; not a
    /// row taken by [`TaskRows::take_row`]).
    #[inline(always)]
    pub fn row(&mut self, c: usize, o: usize) -> &mut [T] {
        let i = o - self.task.o0;
        let first = self.first_channel(i);
        &mut self.blocks[i][(c - first) * self.inner..][..self.inner]
    }

    /// The output rows of every channel of the task at outer index `o` (within the
    /// task; none of them taken by [`TaskRows::take_row`]), contiguous.
    #[inline(always)]
    pub fn image(&mut self, o: usize) -> &mut [T] {
        let block = &mut self.blocks[o - self.task.o0];
        debug_assert_eq!(block.len(), (self.task.c1 - self.task.c0) * self.inner);
        block
    }

    /// The output row of channel `c` at outer index `o`, taken out of the task's rows
    /// for the life of the output (a writer may then hold it across calls). Rows of
    /// lower channels at `o` still held are given up: a pass takes its rows channel by
    /// channel, in order. Panics if the row of `c` at `o` was taken already.
    #[inline(always)]
    pub fn take_row(&mut self, c: usize, o: usize) -> &'a mut [T] {
        let i = o - self.task.o0;
        let first = self.first_channel(i);
        let block = std::mem::take(&mut self.blocks[i]);
        let rest = &mut block[(c - first) * self.inner..];
        let (row, rest) = rest.split_at_mut(self.inner);
        self.blocks[i] = rest;
        row
    }
}

/// Pixels per tile in a channels-last reduction: about [`CL_TILE`] elements, at
/// least 64 pixels (so per-tile work per channel stays cheap for wide C) and at most 1024 (so no
/// `f32` lane sums more than 1024 values).
pub(crate) fn pixels_per_tile(c: usize) -> usize {
    (CL_TILE / c.max(1)).clamp(64, 1024)
}

/// Longest period (in vectors) of a channels-last run walked periodically when C is not
/// a multiple of the lanes (`C / gcd(C, LANES)`): its constants and sums are a few
/// times that many vectors, in L1.
const PERIOD_MAX_VECTORS: usize = 16;

/// The period in vectors of a channels-last reduction over `c` channels walked as one
/// run of vectors of `l` lanes, lane `j` of the period holding channel `j mod c`
/// (`backward::tile_periodic`), where `c` is not a multiple of `l`: `lcm(c, l) / l`,
/// repeated up to at least four vectors (four independent chains of additions); `None`
/// past [`PERIOD_MAX_VECTORS`] or for `c` a multiple of `l` (a pixel is whole vectors).
/// Each lane sums at most [`pixels_per_tile`]` · c / (per · l) ≤ 1024` values of a tile.
///
/// The statistics do not take it: the same walk there (accumulators in memory, not in
/// registers as `stats::deviation_sums_regs` keeps them) made NHWC forward training
/// slower at C = 5, 12, 24, 40 and faster only at C = 2, 3, 6 (Zen 4, `scripts/ab.sh 3`,
/// 2026-11-27).
pub(crate) fn short_period(c: usize, l: usize) -> Option<usize> {
    if c == 0 || l == 0 || c.is_multiple_of(l) {
        return None;
    }
    let p = apply::lcm(c, l) / l;
    (p <= PERIOD_MAX_VECTORS).then(|| p * 4usize.div_ceil(p))
}

/// The fixed split of a channels-last reduction (statistics, gradient sums, second-order
/// sums) into tasks of whole pixels: the one place that says which elements a task
/// covers. A task is read in tiles of [`pixels_per_tile`] from its start (its last tile
/// may be shorter).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PixelSplit {
    pixels_per_task: usize,
    pixels: usize,
    channels: usize,
}

impl PixelSplit {
    /// The split of a channels-last tensor of geometry `g`, from the shape alone (so
    /// the bits do not depend on the thread count): tasks of [`pixels_per_reduce_task`]
    /// pixels, a whole number of tiles, the last one what is left — but where that
    /// makes at most [`FEW_REDUCE_TASKS`] tasks, an even number of them (one stays one)
    /// of equal size in whole units of `lcm(C, 32) / C` pixels (each task starts where
    /// the first does within a vector and a 64-byte line; the last may be shorter, and
    /// rounding the size up to the unit can leave an odd count: 257 pixels of 1367
    /// channels are 96 + 96 + 65).
    ///
    /// With a few whole-tile tasks a short last one left one thread up to twice the
    /// pixels of the other: 16x14x14x256 was 1024 + 1024 + 1024 + 64 pixels (2048
    /// against 1088 on two threads) and 16x7x7x512 512 + 272; now 4 × 784 and 2 × 392.
    /// With more tasks the halves two threads take differ by a task at most in many,
    /// and the even split measured slower where it added a task (16x7x7x2048, 7 → 8;
    /// 16x28x28x128, 7 → 8: NHWC forward training 0.1–0.9 of a copy higher, its
    /// tasks' fixed costs and short last tiles; docs/performance.md, 2026-12-06,
    /// fourth session).
    pub fn reduce(g: &Geometry) -> Self {
        let (pixels, c) = (g.outer, g.channels.max(1));
        let most = pixels_per_reduce_task(c);
        let fewest = pixels.div_ceil(most).max(1);
        let pixels_per_task = if fewest > 1 && fewest <= FEW_REDUCE_TASKS {
            let tasks = fewest.next_multiple_of(2);
            let unit = apply::lcm(c, 32) / c;
            pixels.div_ceil(tasks).next_multiple_of(unit)
        } else {
            most
        };
        PixelSplit {
            pixels_per_task,
            pixels,
            channels: g.channels,
        }
    }

    /// Number of tasks.
    pub fn len(&self) -> usize {
        self.pixels.div_ceil(self.pixels_per_task)
    }

    /// The elements of task `t`.
    pub fn range(&self, t: usize) -> std::ops::Range<usize> {
        let p = self.pixels_per_task;
        t * p * self.channels..((t + 1) * p).min(self.pixels) * self.channels
    }

    /// `f(range of task t)` for every task (in parallel when `g` is large), in order.
    pub fn map<R, F>(&self, g: &Geometry, f: F) -> Vec<R>
    where
        R: Send,
        F: Fn(std::ops::Range<usize>) -> R + Sync + Send,
    {
        map_tasks(g, self.len(), |t| f(self.range(t)))
    }

    /// An output of the tensor's size cut into the tasks' pieces, in order.
    pub fn chunks_mut<'a, T>(&self, out: &'a mut [T]) -> Vec<&'a mut [T]> {
        out.chunks_mut((self.pixels_per_task * self.channels).max(1))
            .collect()
    }
}

/// Pixels per task of a channels-last reduction ([`PixelSplit::reduce`]): a whole
/// number of tiles of about [`TASK`] elements.
pub(crate) fn pixels_per_reduce_task(c: usize) -> usize {
    let ppt = pixels_per_tile(c);
    ((TASK / c.max(1)) / ppt).max(1) * ppt
}

/// The most whole-tile tasks a channels-last reduction is cut into before
/// [`PixelSplit::reduce`] evens them out instead.
const FEW_REDUCE_TASKS: usize = 4;

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

    /// How many outer rows of channel `c` of a channel-major tensor `g` are complete
    /// once this tile of that channel is reduced: a tile that ends a row finishes its
    /// `count` rows; a piece of a longer row finishes none before the row's last piece.
    pub fn rows_done(self, g: &Geometry, c: usize) -> usize {
        let (at, stride) = (self.start - c * g.inner, g.channels * g.inner);
        let (o, off) = (at / stride, at % stride);
        if off + self.step >= g.inner {
            o + self.count
        } else {
            o
        }
    }

    /// The tile's pieces of `data` (a tensor of the tiled geometry), in order.
    pub fn pieces<T>(self, data: &[T]) -> impl Iterator<Item = &[T]> + Clone {
        (0..self.count).map(move |i| &data[self.start + i * self.stride..][..self.step])
    }
}

/// Work interleaved with a channel-major reduction, tile by tile: the resident
/// training passes write channel `c`'s output while they reduce channel `c + 1`, so
/// that the DRAM reads of the one and the writes of the other overlap (as in a copy)
/// instead of following each other. The reduction's arithmetic does not depend on it.
/// (A trait, not a closure: a closure would be compiled without the kernel's target
/// features.)
pub(crate) trait Pace<S> {
    /// Called after each `tile` of the reduction, in order.
    fn tile_done(&mut self, s: S, tile: Tile);
    /// The state of the work a reduction's main loop interleaves with its loads
    /// ([`Pace::step`]), which the loop keeps in locals of its own, so that the
    /// compiler may keep it in registers. Read through the pacer instead, it was loaded
    /// again after every streaming store of the step (the compiler cannot tell the
    /// stores from the pacer's fields), and NCHW 64x256x56x56 f32 backward training
    /// with AVX2 took 2.3-2.5 of a copy, with perf's samples on those loads (Zen 4);
    /// 1.0-1.1 in locals.
    type Zip: Default;
    /// Whether [`Pace::step`] does anything: a reduction may keep a loop of its own
    /// where it does not.
    const STEPS: bool = false;
    /// The state, taken before a reduction's loop.
    #[inline(always)]
    fn zip_take(&mut self) -> Self::Zip {
        Self::Zip::default()
    }
    /// The state, given back after the loop.
    #[inline(always)]
    fn zip_put(&mut self, _z: Self::Zip) {}
    /// Called once per step of a reduction's main loop (four whole vectors of each
    /// input it reads), for work to interleave with its loads instruction by
    /// instruction rather than tile by tile (`fused::RowsBehind`'s zip). Nothing by
    /// default.
    #[inline(always)]
    fn step(&mut self, _s: S, _z: &mut Self::Zip) {}
}

/// No work between tiles: a plain reduction.
pub(crate) struct NoPace;

impl<S> Pace<S> for NoPace {
    type Zip = ();
    #[inline(always)]
    fn tile_done(&mut self, _s: S, _tile: Tile) {}
}

/// The tiles of channel `c`, outer rows `[o0, o1)`, of a channel-major tensor, in
/// order: a tile is a run of whole rows totalling about [`TILE`] elements, or an equal
/// piece of one row when rows are longer than that. (An iterator rather than a
/// callback: a closure would be compiled without the kernel's target features.)
pub(crate) fn channel_tiles(g: &Geometry, c: usize, o0: usize, o1: usize) -> ChannelTiles {
    let (inner, stride) = (g.inner, g.channels * g.inner);
    let (pieces, piece, per_tile) = if inner >= TILE {
        let pieces = inner.div_ceil(TILE);
        (pieces, inner.div_ceil(pieces), 1)
    } else {
        (1, inner, (TILE / inner.max(1)).max(1))
    };
    ChannelTiles {
        base: c * inner,
        inner,
        stride,
        pieces,
        piece,
        per_tile,
        o: o0,
        o1,
        p: 0,
    }
}

/// The iterator of [`channel_tiles`]. Written out, with a `next` that is always
/// inlined, rather than `flat_map` over rows and pieces: once the reductions took a
/// pacing parameter (`Pace`), the compiler stopped inlining the `flat_map`'s `next`,
/// and a call per tile cost NCHW 16x1024x14x14 f32 forward training (one 16-row tile a
/// channel) 8 % of its time (perf: 4 % of samples in `FlattenCompat::next`).
pub(crate) struct ChannelTiles {
    base: usize,
    inner: usize,
    stride: usize,
    pieces: usize,
    piece: usize,
    per_tile: usize,
    /// The next tile's first outer row, and its piece of that row.
    o: usize,
    o1: usize,
    p: usize,
}

impl Iterator for ChannelTiles {
    type Item = Tile;

    #[inline(always)]
    fn next(&mut self) -> Option<Tile> {
        if self.o >= self.o1 {
            return None;
        }
        let s = self.p * self.piece;
        let tile = Tile {
            start: self.base + self.o * self.stride + s,
            step: if self.pieces == 1 {
                self.inner
            } else {
                self.piece.min(self.inner - s)
            },
            stride: self.stride,
            count: self.per_tile.min(self.o1 - self.o),
        };
        self.p += 1;
        if self.p == self.pieces {
            self.p = 0;
            self.o += self.per_tile;
        }
        Some(tile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `f()` on a fresh pool of `threads` threads.
    fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool")
            .install(f)
    }

    /// A balanced split keeps every task within `most` items, covers the items, and in
    /// parallel gives a task to every thread (while there are items for them), with as
    /// many tasks as a multiple of the threads allows; serially, as few as `most` allows.
    #[test]
    fn balanced_tasks_fit_and_share_the_threads() {
        for threads in [1, 2, 3, 8] {
            in_pool(threads, || {
                for (items, most) in [
                    (512, 334),
                    (8192, 5349),
                    (64, 5),
                    (1, 7),
                    (3, 1),
                    (784, 512),
                    (0, 4),
                    (100, 0),
                ] {
                    for parallel in [false, true] {
                        let per = balanced(items, most, parallel);
                        let tasks = items.div_ceil(per);
                        assert!(per >= 1 && per <= most.max(1), "{items} {most}: {per}");
                        let fewest = items.div_ceil(most.max(1));
                        if !parallel || threads == 1 {
                            assert_eq!(tasks, fewest, "{items} {most}");
                        } else {
                            assert!(
                                tasks >= fewest.min(threads).min(items),
                                "{items} {most} {threads}: {tasks}"
                            );
                            assert!(
                                tasks <= fewest.next_multiple_of(threads),
                                "{items} {most} {threads}: {tasks}"
                            );
                        }
                    }
                }
                // The shape that wanted it: 334 + 178 channels become 256 + 256 on two
                // threads (and 171 + 171 + 170 on three, 8 × 64 on eight).
                let want = match threads {
                    1 | 2 => 256,
                    3 => 171,
                    _ => 64,
                };
                assert_eq!(balanced(512, 334, true), want, "{threads} threads");
            });
        }
    }

    /// A channels-last elementwise task is a whole number of 32-element units (64
    /// bytes of 16-bit data, whole vectors of every ISA, the lane phase of the first
    /// task) of at most about `TASK` elements, and a tensor of long pixels keeps
    /// [`balanced`]'s even split: 16x7x7x2048 is 8 × 98 pixels on two threads, where
    /// a unit of 16 pixels made it 7 × 112.
    #[test]
    fn channels_last_tasks_are_whole_units_and_balanced() {
        for threads in [1, 2, 3, 4] {
            in_pool(threads, || {
                for c in [2, 3, 5, 24, 40, 64, 100, 512, 1000, 2048, 4099] {
                    for outer in [1, 7, 784, 3136, 100_003] {
                        let g = Geometry::new(outer, c, 1);
                        let per = g.rows_per_task();
                        let what = format!("{threads} threads, {outer} x {c}: {per}");
                        let unit = apply::lcm(c, 32) / c;
                        // Whole units, or 16 pixels where the unit would idle a thread.
                        assert!(
                            (per * c).is_multiple_of(32) || (unit > 16 && per.is_multiple_of(16)),
                            "{what}"
                        );
                        assert!(per * c <= TASK.max(unit * c) + unit * c, "{what}");
                        let fits = outer.div_ceil(threads).next_multiple_of(unit);
                        if g.parallel() && fits * (threads - 1) < outer {
                            // Every thread has a task where whole units allow it.
                            assert!(outer.div_ceil(per) >= threads, "{what}");
                        }
                    }
                }
                let g = Geometry::new(16 * 7 * 7, 2048, 1);
                if threads == 2 {
                    assert_eq!(g.rows_per_task(), 98);
                }
                // 128 pixels of 1025 channels: two tasks of 64 in units of 32 pixels,
                // so 16-pixel units on three threads (3 × 48 pixels, the last 32).
                let g = Geometry::new(128, 1025, 1);
                if threads == 3 {
                    assert_eq!(g.rows_per_task(), 48);
                }
            });
        }
    }

    /// A channels-last reduction's tasks cover every pixel once, in order: whole-tile
    /// tasks of `pixels_per_reduce_task` where there are over `FEW_REDUCE_TASKS` of
    /// them (or one), otherwise an even number of equal size in whole 32-element units;
    /// and the shapes that wanted it split evenly: 16x14x14x256 as 4 × 784 pixels (was
    /// 3 × 1024 + 64), 16x7x7x512 as 2 × 392 (was 512 + 272), while 16x7x7x2048 keeps
    /// its 7 tasks of 128 (6 and 16 pixels over).
    #[test]
    fn reduction_tasks_cover_the_pixels_and_few_are_even() {
        for c in [
            1, 2, 3, 5, 24, 34, 40, 64, 100, 256, 512, 1000, 1367, 2048, 4099,
        ] {
            for pixels in [0, 1, 7, 64, 129, 257, 784, 3136, 12_544, 15_393, 100_003] {
                let g = Geometry::new(pixels, c, 1);
                if !g.channels_last() {
                    // C = 1 is one channel-major run, which this split never sees.
                    continue;
                }
                let split = PixelSplit::reduce(&g);
                let what = format!("{pixels} x {c}: {split:?}");
                let n = split.len();
                let most = pixels_per_reduce_task(c);
                let fewest = pixels.div_ceil(most).max(1);
                if fewest == 1 || fewest > FEW_REDUCE_TASKS {
                    assert_eq!(split.pixels_per_task, most, "{what}");
                } else {
                    // Even, unless rounding the size up to the unit took a task away
                    // (257 pixels of 1367 channels: 4 asked, 3 of 96 pixels).
                    let unit = apply::lcm(c, 32) / c;
                    assert!(split.pixels_per_task.is_multiple_of(unit), "{what}");
                    assert!(split.pixels_per_task < most + unit, "{what}");
                    let exact = pixels.div_ceil(fewest.next_multiple_of(2));
                    assert!(
                        n.is_multiple_of(2) || split.pixels_per_task > exact,
                        "{what}"
                    );
                }
                let mut next = 0;
                for t in 0..n {
                    let r = split.range(t);
                    assert_eq!(r.start, next, "{what}");
                    assert!(r.end > r.start && r.end.is_multiple_of(c), "{what}");
                    if t + 1 < n {
                        assert_eq!(r.len(), split.pixels_per_task * c, "{what}");
                    }
                    next = r.end;
                }
                assert_eq!(next, pixels * c, "{what}");
                let chunks = split.chunks_mut(&mut vec![0u8; pixels * c]).len();
                assert_eq!(chunks, n.min(pixels * c), "{what}");
            }
        }
        for ((pixels, c), want) in [
            ((16 * 14 * 14, 256), (784, 4)),
            ((16 * 7 * 7, 512), (392, 2)),
            ((16 * 28 * 28, 24), (6272, 2)),
            ((16 * 7 * 7, 2048), (128, 7)),
            ((257, 1367), (96, 3)),
            ((512 * 767, 2), (98_176, 4)), // tests/scale.rs' evened shapes
            ((400 * 600, 3), (60_000, 4)),
            ((64 * 56 * 56, 256), (1024, 196)),
        ] {
            let split = PixelSplit::reduce(&Geometry::new(pixels, c, 1));
            let got = (split.pixels_per_task, split.len());
            assert_eq!(got, want, "{pixels} x {c}");
        }
    }

    /// The tiles of a channel's rows cover each of its elements once, in memory order:
    /// runs of whole rows of at most `TILE` elements, or equal pieces of a longer row.
    #[test]
    fn channel_tiles_cover_each_element_once_in_order() {
        for (outer, channels, inner) in [
            (1, 1, 1),
            (16, 3, 196),
            (64, 2, 3136),
            (7, 2, TILE),
            (5, 3, TILE + 1),
            (3, 2, 3 * TILE - 5),
            (4, 1, 0),
        ] {
            let g = Geometry::new(outer, channels, inner);
            for c in 0..channels {
                for (o0, o1) in [(0, outer), (1.min(outer), outer), (0, outer / 2)] {
                    let mut seen = Vec::new();
                    for t in channel_tiles(&g, c, o0, o1) {
                        assert!(
                            t.count >= 1 && t.step <= inner && t.step * t.count <= TILE.max(inner)
                        );
                        for i in 0..t.count {
                            let at = t.start + i * t.stride;
                            seen.extend(at..at + t.step);
                        }
                    }
                    let want: Vec<usize> = (o0..o1)
                        .flat_map(|o| {
                            let row = (o * channels + c) * inner;
                            row..row + inner
                        })
                        .collect();
                    assert_eq!(
                        seen, want,
                        "{outer}x{channels}x{inner} c {c} rows {o0}..{o1}"
                    );
                }
            }
        }
    }

    /// A large channel's row chunks: each within TASK elements, of equal rows but the
    /// last, covering the rows, and an even number of them where the rows allow it
    /// (two threads then share a channel evenly), whatever the pool.
    #[test]
    fn large_channels_split_in_an_even_number_of_chunks() {
        // (outer, inner, chunks, rows per chunk)
        for (outer, inner, chunks, rows) in [
            (64, 12544, 4, 16),  // 64x64x112x112: 4 chunks, as before
            (128, 12544, 8, 16), // 128x64x112x112: 7 chunks of 19 rows before
            (128, 3136, 2, 64),  // 128x256x56x56
            (5, 100000, 3, 2),   // 3 wanted 4, but 5 rows give 2, 2, 1
            (1, 1 << 20, 1, 1),  // one row
            (3, 1 << 18, 3, 1),  // a row a chunk
            (40, 1 << 15, 6, 7), // 5 chunks of 8 rows before
        ] {
            for threads in [1, 2, 3] {
                let g = Geometry::new(outer, 2, inner);
                let split = in_pool(threads, || ChannelMajorSplit::new(&g));
                let what = format!("{outer}x{inner}, {threads} threads: {split:?}");
                assert_eq!(
                    (split.chunks, split.rows_per_task),
                    (chunks, rows),
                    "{what}"
                );
                assert_eq!(split.channels_per_task, 1, "{what}");
                assert!(split.rows_per_task * inner <= TASK.max(inner), "{what}");
                assert_eq!(outer.div_ceil(split.rows_per_task), split.chunks, "{what}");
            }
        }
    }

    /// `merge` folds a channel's row chunks in row order, one result a channel, and
    /// hands a whole split's single task back as it is.
    #[test]
    fn merge_folds_chunks_in_row_order() {
        // Two channels of 3 chunks each (outer 5, rows 2, 2, 1).
        let g = Geometry::new(5, 2, 100000);
        let split = ChannelMajorSplit::new(&g);
        assert_eq!((split.chunks, split.whole(&g)), (3, None));
        let results: Vec<Vec<u32>> = split
            .tasks(&g)
            .iter()
            .map(|t| (t.c0..t.c1).map(|c| (c * 100 + t.o0) as u32).collect())
            .collect();
        // Not commutative: the order of the fold shows.
        let got = split.merge(&g, results, |a, b| a * 10 + b % 10);
        assert_eq!(got, vec![(2 * 10 + 4), (100 * 10 + 2) * 10 + 4]);
        // A small tensor: one task of every channel, returned as it is.
        let small = Geometry::new(2, 32, 64);
        let split = ChannelMajorSplit::new(&small);
        assert!(split.whole(&small).is_some());
        let only: Vec<u32> = (0..32).collect();
        assert_eq!(split.merge(&small, vec![only.clone()], |_, _| 0), only);
    }

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(parse_size("32768K"), Some(32 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert!(llc_bytes() >= 1 << 10 && llc_bytes() <= LLC_CAP_BYTES);
        assert!(resident_bytes() > 0 && resident_bytes() <= RESIDENT_BYTES);
    }
}
