//! Channel-major training passes in which every thread takes a share of each channel.
//!
//! A resident pass ([`super::ResidentForward`]) gives each thread whole channels: it
//! writes channel `c` from its still-cached rows while it reduces `c + 1`, so a thread
//! keeps about two channels in its core's L2. Where a channel is a good part of that L2
//! (a 16-bit channel of 64x64x112x112 is 1.6 MB, an f32 one 3.2 MB, against 2 MiB), the
//! rows written late were evicted before they were read again. Here each of `parts`
//! threads takes the same outer rows of every channel (whole chunks of the two-pass
//! split, [`super::RowChunks`]), so a thread keeps two *shares* of a channel, and the
//! threads publish each chunk's reduction of a channel ([`Exchange`]) and fold all of
//! them in chunk order before writing it: the two-pass split's bits, whichever thread
//! reduced which chunk.
//!
//! Every thread of the pool runs one share, all at the same time: a thread waits for
//! the others' reductions of each channel. The shares start only once every one has a
//! thread of its own ([`run_parts`]); where the pool's threads do not all come within
//! a few milliseconds (busy with other work, blocked outside rayon), nothing is shared
//! and the caller takes the whole-channel path. At most one shared pass runs in the
//! process at a time ([`Claim`]); a second caller takes the whole-channel path too.
//!
//! Measured on an Intel Xeon with AVX-512 (2 MiB L2 a core, 2 threads; `scripts/ab.sh
//! 3`, NCHW 64x64x112x112, time ÷ copy, whole channels a thread → shared, with the same
//! even row chunks): forward training f32 1.028 → 0.982 (AVX-512) and 1.077 → 1.032
//! (AVX2), bf16 1.151 → 1.049 and 1.429 → 1.358, f16 1.112 → 1.015 and 1.340 → 1.219;
//! backward training f32 1.040 → 1.001 and 1.038 → 1.001, bf16 1.167 → 1.126 and
//! 1.267 → 1.242, f16 1.155 → 1.100 and 1.204 → 1.199. Forward training comes close
//! to what whole channels of half the rows cost (32x64x112x112: bf16 AVX-512 1.04),
//! backward training does not (1.05 there). The waits for the other thread's
//! reductions (timed: 1.5–4 % of the threads' time) are not the difference: reducing
//! the next channel's tiles instead of waiting, and writing behind them once the
//! coefficients are known, gained nothing (`scripts/ab.sh 3`: bf16 backward AVX-512
//! 1.135 → 1.157).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::super::{ChannelMajorSplit, Geometry, TaskRows};

/// The one cooperative pass that may run in the process; released on drop.
pub(super) struct Claim(());

static BUSY: AtomicBool = AtomicBool::new(false);

impl Claim {
    /// The claim, unless another cooperative pass holds it.
    pub fn take() -> Option<Claim> {
        BUSY.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Claim(()))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        BUSY.store(false, Ordering::Release);
    }
}

/// How a cooperative pass shares a geometry's rows: `parts` threads, each taking
/// `per_part` consecutive chunks of `chunk_rows` outer rows (the two-pass split's).
#[derive(Clone, Copy, Debug)]
pub(in crate::kernels) struct Plan {
    pub parts: usize,
    pub per_part: usize,
    pub chunk_rows: usize,
    pub chunks: usize,
}

impl Plan {
    /// The plan for `g` on the current pool: one part per thread. `None` for a small
    /// tensor ([`Geometry::parallel`]), one thread, or channels of fewer chunks than
    /// threads, or chunks that would leave a thread without a part (there the
    /// whole-channel path keeps every thread busy: 32x64x112x112 has 2 chunks a channel,
    /// and 2 parts would leave 14 of 16 threads idle).
    pub fn new(g: &Geometry) -> Option<Plan> {
        let threads = rayon::current_num_threads();
        let split = ChannelMajorSplit::new(g);
        if threads < 2 || split.chunks < threads || !g.parallel() {
            return None;
        }
        let per_part = split.chunks.div_ceil(threads);
        let parts = split.chunks.div_ceil(per_part);
        (parts == threads).then_some(Plan {
            parts,
            per_part,
            chunk_rows: split.rows_per_task,
            chunks: split.chunks,
        })
    }

    /// The output rows of each part: every channel, the part's outer rows.
    pub fn rows_mut<'a, T>(&self, g: &Geometry, out: &'a mut [T]) -> Vec<TaskRows<'a, T>> {
        ChannelMajorSplit {
            channels_per_task: g.channels.max(1),
            rows_per_task: self.per_part * self.chunk_rows,
            chunks: self.parts,
        }
        .rows_mut(g, out)
    }

    /// The chunks of `part`, each as its index and its outer rows.
    pub fn chunks_of(
        &self,
        g: &Geometry,
        part: usize,
    ) -> impl Iterator<Item = (usize, Range<usize>)> {
        let (rows, outer) = (self.chunk_rows, g.outer);
        let first = part * self.per_part;
        (first..(first + self.per_part).min(self.chunks))
            .map(move |k| (k, k * rows..((k + 1) * rows).min(outer)))
    }
}

/// The per-chunk reductions of every channel (three `f64` each), published by the
/// threads that computed them, and how many threads have published each channel.
pub(super) struct Exchange {
    values: Vec<AtomicU64>,
    arrived: Vec<AtomicUsize>,
    chunks: usize,
    parts: usize,
    /// Set when a share panicked: the others stop waiting (and panic too).
    failed: AtomicBool,
}

impl Exchange {
    pub fn new(g: &Geometry, plan: &Plan) -> Exchange {
        Exchange {
            values: (0..g.channels * plan.chunks * 3)
                .map(|_| AtomicU64::new(0))
                .collect(),
            arrived: (0..g.channels).map(|_| AtomicUsize::new(0)).collect(),
            chunks: plan.chunks,
            parts: plan.parts,
            failed: AtomicBool::new(false),
        }
    }

    /// Chunks per channel.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Stores chunk `k`'s reduction of channel `c`.
    #[inline]
    pub fn put(&self, c: usize, k: usize, v: [f64; 3]) {
        let at = (c * self.chunks + k) * 3;
        for (slot, v) in self.values[at..at + 3].iter().zip(v) {
            slot.store(v.to_bits(), Ordering::Relaxed);
        }
    }

    /// Marks this thread's chunks of channel `c` as published.
    #[inline]
    pub fn done(&self, c: usize) {
        self.arrived[c].fetch_add(1, Ordering::Release);
    }

    /// Chunk `k`'s reduction of channel `c`, once every thread has published `c`
    /// ([`Exchange::wait`]).
    #[inline]
    pub fn get(&self, c: usize, k: usize) -> [f64; 3] {
        let at = (c * self.chunks + k) * 3;
        std::array::from_fn(|i| f64::from_bits(self.values[at + i].load(Ordering::Relaxed)))
    }

    /// Whether every thread has published channel `c` (without waiting).
    #[inline]
    pub fn published(&self, c: usize) -> bool {
        self.arrived[c].load(Ordering::Acquire) >= self.parts
    }

    /// Waits until every thread has published channel `c`. Spins, then yields the core.
    /// Every part is running on a thread of its own by then ([`run_parts`]' start), and
    /// none waits for anything but the others' reductions.
    pub fn wait(&self, c: usize) {
        let mut spins = 0u32;
        while self.arrived[c].load(Ordering::Acquire) < self.parts {
            assert!(
                !self.failed.load(Ordering::Relaxed),
                "fusedbn: a thread of a cooperative pass panicked"
            );
            if spins < 1 << 14 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Marks the exchange failed if its share panics (drop during unwinding).
struct Watch<'a>(&'a Exchange);

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.failed.store(true, Ordering::Relaxed);
        }
    }
}

/// How many shared passes ran (tests check that theirs were shared).
#[cfg(test)]
pub(super) static SHARED_RUNS: AtomicUsize = AtomicUsize::new(0);

/// How long the parts wait for each other to start before they give up the shared
/// pass (a pool thread busy with other work, or blocked outside rayon).
const START_WAIT: Duration = Duration::from_millis(5);

/// The start of a shared pass: how many parts have been claimed, or [`GAVE_UP`].
struct Start(AtomicUsize);

const GAVE_UP: usize = usize::MAX;

impl Start {
    /// Claims the next part, unless the pass was given up.
    fn claim(&self) -> Option<usize> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                // Lazily: `then_some(n + 1)` computed `GAVE_UP + 1` (an overflow panic in
                // debug builds) once a pass was given up.
                (n != GAVE_UP).then(|| n + 1)
            })
            .ok()
    }

    /// Whether all `parts` parts have been claimed (each by a thread that now runs only
    /// it) within [`START_WAIT`]; if not, gives the pass up, so that no part starts
    /// (the decision is one atomic value: every part sees the same).
    fn all_started(&self, parts: usize) -> bool {
        let t0 = Instant::now();
        let mut spins = 0u32;
        loop {
            match self.0.load(Ordering::Acquire) {
                GAVE_UP => return false,
                n if n >= parts => return true,
                n => {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(64)
                        && t0.elapsed() > START_WAIT
                        && self
                            .0
                            .compare_exchange(n, GAVE_UP, Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                    {
                        return false;
                    }
                    std::hint::spin_loop();
                }
            }
        }
    }
}

/// Runs `f(part, rows)` for every part at once, each on a thread of its own; results
/// in part order. `None` (nothing run, `rows` dropped) when the pool's threads did not
/// all take a part within [`START_WAIT`]: the caller takes the whole-channel path.
///
/// The parts are spawned in a `rayon::scope`, and each claims a part when a thread
/// runs it. A part waits for the others only once all are claimed: each on its own
/// thread (a part calls nothing that could run another rayon job on its thread), so
/// none waits on a thread that is not running its share. A thread that never comes
/// (blocked outside rayon, or busy for longer than [`START_WAIT`]) costs that wait and
/// the whole-channel path, not a hang: the spawned parts left over then end at once,
/// on whichever thread runs them, the scope's own included.
pub(super) fn run_parts<'a, T: Send, R: Send>(
    ex: &Exchange,
    rows: Vec<TaskRows<'a, T>>,
    f: impl Fn(usize, TaskRows<'a, T>) -> R + Sync,
) -> Option<Vec<R>> {
    let n = rows.len();
    let slots: Vec<Mutex<Option<TaskRows<'a, T>>>> =
        rows.into_iter().map(|r| Mutex::new(Some(r))).collect();
    let results: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let start = Start(AtomicUsize::new(0));
    let part = || -> Option<()> {
        let i = start.claim()?;
        if !start.all_started(n) {
            return None;
        }
        let rows = slots.get(i)?.lock().ok()?.take()?;
        let _watch = Watch(ex);
        let r = f(i, rows);
        *results.get(i)?.lock().ok()? = Some(r);
        Some(())
    };
    rayon::scope(|sc| {
        for _ in 0..n {
            sc.spawn(|_| {
                part();
            });
        }
    });
    if start.0.load(Ordering::Acquire) == GAVE_UP {
        return None;
    }
    #[cfg(test)]
    SHARED_RUNS.fetch_add(1, Ordering::Relaxed);
    results
        .into_iter()
        .map(|r| r.into_inner().ok().flatten())
        .collect()
}
