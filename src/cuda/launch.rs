//! Launch geometry: how a problem is cut into channel groups and blocks — the host-side
//! twin of `Geo` in `kernels.cu`. Pure arithmetic on the problem's shape (never on the
//! device or on timing), so the partials, their merge order and so the results depend on
//! the problem alone; tested without a GPU.
//!
//! Two traversals of `x = [outer, C, inner]`:
//! - [`Traversal::ChannelsFirst`] (`inner > 1`: NCHW, NCDHW, or one channel): a block
//!   reduces or transforms one channel's chunk of `THREADS·UNROLL·iters` vectors.
//! - [`Traversal::ChannelsLast`] (`inner == 1`: NHWC, NDHWC): a block is `tx`
//!   channel-vectors wide and `ty` rows tall and walks `RK·iters` rows per thread row.
//!
//! A vector is 16 bytes of the element type when the contiguous run (`inner`, or `C`)
//! is a multiple of it, else one element.
//!
//! Every channel is in one launch (one group) unless a channel-major budget is given, so
//! the training passes read x twice (the second time from L2 only where x fits there).
//! Channel groups sized to stay in L2 between the two passes (16 MiB, a third of an
//! H100's L2, until 2026-11-28) were slower in every case measured: their launches run
//! one after another, and a channels-last group is a strip of every row. Measured with `fusedbn bench --device cuda --runs 9` on an
//! H200, one group against 16 MiB ones (`FUSEDBN_CUDA_GROUP_MB`, which still sets a
//! channel-major budget for experiments), time ÷ device copy: NCHW forward training
//! f32 16x256x56x56 3.47 -> 2.11, 256x256x56x56 3.53 -> 1.61, backward training 3.12 ->
//! 1.72 and 3.70 -> 1.59; f16 and bf16 alike; channels-last in [`plan`].

/// Threads per block.
pub const THREADS: u32 = 256;
/// Vectors per thread per round, channels-first (`UNROLL` in kernels.cu).
pub const UNROLL: u64 = 8;
/// Rows per thread per round, channels-last (`RK` in kernels.cu).
pub const RK: u64 = 16;
/// Blocks a launch aims for (8 per multiprocessor of a 132-SM H100): rounds per thread
/// grow only while a launch would still have at least this many blocks. A constant, not
/// the device's count, so results do not depend on the device.
pub const TARGET_BLOCKS: u64 = 1056;
/// Most rounds per thread.
pub const MAX_ITERS: u64 = 16;
/// The largest grid y dimension.
const MAX_GRID_Y: u64 = 65535;

/// The kernels' geometry argument (`struct Geo` in kernels.cu, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Geo {
    /// Dimensions before the channel axis, multiplied.
    pub outer: u64,
    /// Channels.
    pub c: u64,
    /// Dimensions after the channel axis, multiplied.
    pub inner: u64,
    /// First channel (channels-first) or channel-vector (channels-last) of the group.
    pub c0: u64,
    /// Channels or channel-vectors in the group.
    pub width: u64,
    /// Blocks along the reduced axis: partials per channel.
    pub chunks: u64,
    /// Index of the group's first channel among the partials.
    pub part_base: u64,
    /// Rounds per thread.
    pub iters: u64,
}

/// How a kernel walks `x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Traversal {
    /// One channel per block row: `inner > 1`.
    ChannelsFirst,
    /// Channel-vectors across a block, rows down it: `inner == 1`.
    ChannelsLast,
}

/// One launch over a group of channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    /// The kernels' geometry argument.
    pub geo: Geo,
    /// Grid (x: chunks, y: channels or channel-vector blocks).
    pub grid: (u32, u32),
    /// First channel of the group.
    pub first_channel: usize,
    /// Channels in the group.
    pub channels: usize,
}

/// How a problem is launched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The traversal.
    pub traversal: Traversal,
    /// Elements per vector (16 bytes' worth, or 1).
    pub vector: usize,
    /// Block shape (x, y).
    pub block: (u32, u32),
    /// Partials per channel (the same in every group).
    pub chunks: u64,
    /// The channel groups, in order.
    pub groups: Vec<Group>,
}

impl Plan {
    /// True when vectors are 16 bytes wide (the `_v` kernels), false for the scalar ones.
    pub fn vectorized(&self, elem_bytes: usize) -> bool {
        self.vector * elem_bytes == 16
    }
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b.max(1))
}

/// The plan for `x = [outer, channels, inner]` (not empty) of `elem_bytes`-byte elements,
/// with `inputs` full-size tensors read per element and, channels-first, channel groups
/// of at most `group_bytes` of them (`None`: one group). Channels-last is one group.
pub fn plan(
    outer: usize,
    channels: usize,
    inner: usize,
    elem_bytes: usize,
    inputs: usize,
    group_bytes: Option<usize>,
) -> Plan {
    let (outer, c, inner) = (outer as u64, channels as u64, inner as u64);
    let per_vec = (16 / elem_bytes) as u64;
    let mut groups = Vec::new();
    if inner > 1 || c == 1 {
        let budget = group_bytes.map_or(u64::MAX, |b| b as u64);
        let per_elem = (elem_bytes * inputs) as u64;
        let vector = if inner % per_vec == 0 { per_vec } else { 1 };
        let mv = outer * inner / vector;
        let chan_bytes = outer * inner * per_elem;
        let gc = (budget / chan_bytes.max(1)).clamp(1, c.min(MAX_GRID_Y));
        let chunks1 = ceil_div(mv, u64::from(THREADS) * UNROLL);
        let iters = (chunks1 * gc / TARGET_BLOCKS).clamp(1, MAX_ITERS);
        let chunks = ceil_div(mv, u64::from(THREADS) * UNROLL * iters);
        let mut c0 = 0;
        while c0 < c {
            let width = gc.min(c - c0);
            groups.push(Group {
                geo: Geo {
                    outer,
                    c,
                    inner,
                    c0,
                    width,
                    chunks,
                    part_base: c0,
                    iters,
                },
                grid: (chunks as u32, width as u32),
                first_channel: c0 as usize,
                channels: width as usize,
            });
            c0 += width;
        }
        Plan {
            traversal: Traversal::ChannelsFirst,
            vector: vector as usize,
            block: (THREADS, 1),
            chunks,
            groups,
        }
    } else {
        let vector = if c % per_vec == 0 { per_vec } else { 1 };
        let cv = c / vector;
        // One group, whatever the budget: a channels-last group is a strip of every row,
        // so a narrow one reads 16 bytes of each 1 KiB row and its launches run one after
        // another; two reads of x from DRAM cost less (H100, `fusedbn bench --device
        // cuda`, NHWC 256x56x56x256 f32 forward training 13.5 -> 1.57 of a copy,
        // 16x56x56x256 3.00 -> 1.94, backward training 12.8 -> 1.66 and 3.83 -> 1.77,
        // every dtype alike). Only the grid's y limit splits the channels.
        let gcv = cv.min(MAX_GRID_Y * 32);
        let tx = gcv.next_power_of_two().min(32);
        let ty = u64::from(THREADS) / tx;
        let grid_y = ceil_div(gcv, tx);
        let chunks1 = ceil_div(outer, ty * RK);
        let iters = (chunks1 * grid_y / TARGET_BLOCKS).clamp(1, MAX_ITERS);
        let chunks = ceil_div(outer, ty * RK * iters);
        let mut j0 = 0;
        while j0 < cv {
            let width = gcv.min(cv - j0);
            groups.push(Group {
                geo: Geo {
                    outer,
                    c,
                    inner,
                    c0: j0,
                    width,
                    chunks,
                    part_base: j0 * vector,
                    iters,
                },
                grid: (chunks as u32, ceil_div(width, tx) as u32),
                first_channel: (j0 * vector) as usize,
                channels: (width * vector) as usize,
            });
            j0 += width;
        }
        Plan {
            traversal: Traversal::ChannelsLast,
            vector: vector as usize,
            block: (tx as u32, ty as u32),
            chunks,
            groups,
        }
    }
}

/// Blocks of the finalize kernels (one warp per channel) for `channels` channels.
pub fn finalize_blocks(channels: usize) -> u32 {
    (channels * 32).div_ceil(THREADS as usize) as u32
}
