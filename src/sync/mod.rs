//! Synchronized batch normalization: the statistics of the **whole** batch when the
//! batch is split across processes (or threads, or devices), as data-parallel training
//! needs.
//!
//! The training forward and gradient are the [phases](crate::batch_norm::phases) with a
//! [`Collective`] between them:
//!
//! 1. Every rank computes its shard's per-channel `(count, mean, M2)`; one
//!    all-gather hands every rank every rank's rows, and every rank folds them **in
//!    rank order** (Chan's update), so every rank holds bit-identical global
//!    statistics. Not `Σx` and `Σx²` (they cancel catastrophically when |mean| ≫ std),
//!    not `(mean, invstd)` pairs, not an equal-weight average of rank means (wrong for
//!    uneven shards).
//! 2. Every rank normalizes its own shard with them and updates the running statistics
//!    with the **global** count (`variance·n/(n − 1)`, n over all ranks).
//! 3. The gradient is one all-reduce (sum) of the per-channel `(Σdy, Σdy·(x − mean))`,
//!    then `dx` with the global count. `dscale` and `doffset` come out **global** (the
//!    sums over the whole batch, identical on every rank): no further all-reduce of the
//!    batch-norm parameters' gradients is needed. (PyTorch's `SyncBatchNorm` returns
//!    each rank's local ones, which its data-parallel wrapper then all-reduces.)
//!
//! Inference needs no communication: it normalizes with given statistics, so run the
//! ordinary [`Problem::forward`] / [`Problem::backward`] on each rank.
//!
//! Before the data collectives, every synchronized call takes part in one small
//! all-gather that checks that all ranks run the same operation with the same channel
//! count, epsilon, layout, element type, activation and averaging factor, and that every
//! rank's inputs passed validation: a rank that disagrees or fails makes the call fail
//! with an error **on every rank** (never a hang, never a mismatched collective).
//! Shards may be uneven and empty: a rank with `N = 0` takes part in every collective
//! and writes only the per-channel outputs; when every rank is empty the results are the
//! empty-tensor ones of a single process (NaN statistics, zero parameter gradients).
//!
//! Three collectives come with the crate: [`SingleProcess`] (one rank; the synchronized
//! calls then give bit-identical results to the whole ops), [`ThreadGroup`] (ranks that
//! are threads of one process) and, with the cargo feature `mpi`, `Mpi` (any rsmpi
//! communicator; OpenMPI). [`Timed`] wraps any of them to measure the time spent
//! communicating. A transport of your own (NCCL, gloo, a TCP ring) is a [`Collective`]
//! implementation away.
//!
//! Two ranks as two threads, each holding half of a batch:
//!
//! ```
//! use fusedbn::{DataFormat, Problem, sync::ThreadGroup};
//! use fusedbn::batch_norm::{Affine, Epilogue, SavedStats, TrainingStats};
//! let shards = [vec![1.0f32, 2.0, 3.0], vec![4.0, 5.0, 6.0, 7.0, 8.0]];
//! let stats: Vec<(f32, f32)> = std::thread::scope(|s| {
//!     let handles: Vec<_> = ThreadGroup::new(2).into_iter().zip(&shards).map(|(comm, x)| {
//!         let x = &x[..];
//!         s.spawn(move || {
//!             let p = Problem::new(DataFormat::Nhwc, &[1, 1, x.len(), 1])?;
//!             let (mut mean, mut var, mut y) = ([0.0f32], [0.0f32], vec![0.0f32; x.len()]);
//!             p.forward_sync(&comm, x, Affine { scale: &[1.0], offset: &[0.0] },
//!                 TrainingStats { saved: SavedStats { mean: &mut mean, variance: &mut var },
//!                     running: None },
//!                 Epilogue::plain(), &mut y)?;
//!             Ok::<_, fusedbn::Error>((mean[0], var[0]))
//!         })
//!     }).collect();
//!     handles.into_iter().map(|h| h.join().unwrap()).collect::<Result<_, _>>()
//! })?;
//! // The statistics of all eight values, on both ranks.
//! assert_eq!(stats, [(4.5, 5.25), (4.5, 5.25)]);
//! # Ok::<(), fusedbn::Error>(())
//! ```

use std::cell::Cell;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::batch_norm::phases::{combine_moments, GradSums, Moments};
use crate::batch_norm::{
    Activation, Affine, Epilogue, GradEpilogue, GradInputs, Gradients, Problem, Statistics,
    TrainingStats,
};
use crate::element::{Element, Real};
use crate::error::{Error, Result};

#[cfg(feature = "mpi")]
mod mpi_impl;
/// The `mpi` crate (rsmpi) this crate was built with, to initialize MPI and make
/// communicators with the same version that [`Mpi`] wraps.
#[cfg(feature = "mpi")]
pub use ::mpi;
#[cfg(feature = "mpi")]
pub use mpi_impl::Mpi;

/// The communication a synchronized batch norm needs: a group of `size` ranks, this
/// one numbered `rank`, that can all-gather and sum-all-reduce `f64` buffers.
///
/// # Contract
///
/// - Every rank calls the same collectives in the same order, each with a buffer of the
///   same length (the synchronized calls of this crate guarantee the lengths once their
///   agreement check has passed).
/// - [`all_gather`](Collective::all_gather) returns every rank's buffer, concatenated
///   **in rank order**, on every rank; the values are copied, never rounded.
/// - [`all_reduce_sum`](Collective::all_reduce_sum) replaces the buffer with the
///   element-wise sum over the ranks, **the same bits on every rank**. The provided
///   method does an all-gather and adds the rows in rank order (deterministic, and
///   cheap for the `2·C + 1` values a gradient sends); override it only with a sum
///   that is identical on every rank.
/// - A failure is returned as an [`Error`] (see [`Error::Collective`]), not a panic,
///   where the transport allows it.
///
/// # Implementing it
///
/// A transport of your own — here a trivial one that is a single rank:
///
/// ```
/// use fusedbn::sync::Collective;
/// struct Alone;
/// impl Collective for Alone {
///     fn rank(&self) -> usize { 0 }
///     fn size(&self) -> usize { 1 }
///     fn all_gather(&self, local: &[f64]) -> fusedbn::Result<Vec<f64>> {
///         Ok(local.to_vec())
///     }
/// }
/// let mut buf = [1.0, 2.0];
/// Alone.all_reduce_sum(&mut buf)?;
/// assert_eq!(buf, [1.0, 2.0]);
/// # Ok::<(), fusedbn::Error>(())
/// ```
pub trait Collective {
    /// This rank's number, `0..size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn size(&self) -> usize;

    /// Every rank's `local` (the same length on every rank), concatenated in rank order.
    fn all_gather(&self, local: &[f64]) -> Result<Vec<f64>>;

    /// The element-wise sum of `buf` over the ranks, in place, identical on every rank.
    fn all_reduce_sum(&self, buf: &mut [f64]) -> Result<()> {
        let all = self.all_gather(buf)?;
        let n = buf.len();
        if all.len() != n * self.size() {
            return Err(Error::Collective {
                reason: format!(
                    "all_gather returned {} values, expected {} ranks × {n}",
                    all.len(),
                    self.size()
                ),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let mut rows = all.chunks_exact(n);
        if let Some(first) = rows.next() {
            buf.copy_from_slice(first);
        }
        for row in rows {
            for (a, b) in buf.iter_mut().zip(row) {
                *a += b;
            }
        }
        Ok(())
    }
}

impl<C: Collective + ?Sized> Collective for &C {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn all_gather(&self, local: &[f64]) -> Result<Vec<f64>> {
        (**self).all_gather(local)
    }
    fn all_reduce_sum(&self, buf: &mut [f64]) -> Result<()> {
        (**self).all_reduce_sum(buf)
    }
}

/// One rank: every collective is the identity. The synchronized calls then give
/// bit-identical results to the whole ops ([`Problem::forward`], [`Problem::backward`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_gather(&self, local: &[f64]) -> Result<Vec<f64>> {
        Ok(local.to_vec())
    }
    fn all_reduce_sum(&self, _buf: &mut [f64]) -> Result<()> {
        Ok(())
    }
}

/// Ranks that are threads of one process (model replicas in one process, and tests):
/// [`ThreadGroup::new`] hands out one [`ThreadRank`] per rank, each to be moved to its
/// own thread.
///
/// Collectives meet at a barrier (a mutex and a condition variable); results are in
/// rank order, so identical on every rank. When a rank's [`ThreadRank`] is dropped (its
/// thread returned or panicked) while others wait in, or later enter, a collective,
/// those collectives fail with [`Error::Collective`] instead of waiting forever.
#[derive(Debug)]
pub struct ThreadGroup;

impl ThreadGroup {
    /// `size` connected ranks, rank `i` at index `i` (none for `size == 0`).
    ///
    /// ```
    /// use fusedbn::sync::{Collective, ThreadGroup};
    /// let sums: Vec<Vec<f64>> = std::thread::scope(|s| {
    ///     let handles: Vec<_> = ThreadGroup::new(3).into_iter().map(|comm| s.spawn(move || {
    ///         let mut buf = vec![comm.rank() as f64, 1.0];
    ///         comm.all_reduce_sum(&mut buf).map(|()| buf)
    ///     })).collect();
    ///     handles.into_iter().map(|h| h.join().unwrap()).collect::<Result<_, _>>()
    /// })?;
    /// assert_eq!(sums, vec![vec![3.0, 3.0]; 3]);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    #[allow(clippy::new_ret_no_self)]
    pub fn new(size: usize) -> Vec<ThreadRank> {
        let shared = Arc::new(Shared {
            size,
            state: Mutex::new(State {
                arrived: 0,
                generation: 0,
                slots: vec![Vec::new(); size],
                departed: None,
            }),
            wake: Condvar::new(),
        });
        (0..size)
            .map(|rank| ThreadRank {
                shared: Arc::clone(&shared),
                rank,
            })
            .collect()
    }
}

/// One rank of a [`ThreadGroup`].
#[derive(Debug)]
pub struct ThreadRank {
    shared: Arc<Shared>,
    rank: usize,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Debug)]
struct State {
    /// Ranks waiting at the current barrier.
    arrived: usize,
    /// Barriers passed so far.
    generation: u64,
    /// Each rank's contribution to the current all-gather.
    slots: Vec<Vec<f64>>,
    /// The first rank that left the group.
    departed: Option<usize>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every rank has arrived (or one has left).
    fn barrier<'a>(&self, mut st: MutexGuard<'a, State>) -> Result<MutexGuard<'a, State>> {
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.size {
            st.arrived = 0;
            st.generation += 1;
            self.wake.notify_all();
            return Ok(st);
        }
        while st.generation == gen {
            if let Some(r) = st.departed {
                return Err(Error::Collective {
                    reason: format!("rank {r} of the thread group left while others waited"),
                });
            }
            st = self.wake.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        Ok(st)
    }
}

impl Collective for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_gather(&self, local: &[f64]) -> Result<Vec<f64>> {
        let shared = &*self.shared;
        let mut st = shared.lock();
        if let Some(r) = st.departed {
            return Err(Error::Collective {
                reason: format!("rank {r} of the thread group has left"),
            });
        }
        st.slots[self.rank] = local.to_vec();
        let st = shared.barrier(st)?;
        let lens: Vec<usize> = st.slots.iter().map(Vec::len).collect();
        let out = if lens.iter().all(|&l| l == local.len()) {
            Ok(st.slots.concat())
        } else {
            Err(Error::Collective {
                reason: format!(
                    "all_gather: the ranks passed buffers of different lengths {lens:?}"
                ),
            })
        };
        // Nobody overwrites a slot before every rank has read them all.
        drop(shared.barrier(st)?);
        out
    }
}

impl Drop for ThreadRank {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.departed.get_or_insert(self.rank);
        self.shared.wake.notify_all();
    }
}

/// A [`Collective`] that measures the time its collectives take (the time spent
/// communicating, including waiting for slower ranks), for splitting a step into
/// local compute and communication.
///
/// ```
/// use fusedbn::sync::{Collective, SingleProcess, Timed};
/// let comm = Timed::new(SingleProcess);
/// comm.all_gather(&[1.0])?;
/// assert_eq!(comm.calls(), 1);
/// comm.reset();
/// assert_eq!((comm.calls(), comm.elapsed()), (0, std::time::Duration::ZERO));
/// # Ok::<(), fusedbn::Error>(())
/// ```
#[derive(Debug)]
pub struct Timed<C> {
    inner: C,
    elapsed: Cell<Duration>,
    calls: Cell<u64>,
}

impl<C: Collective> Timed<C> {
    /// Wraps `inner`.
    pub fn new(inner: C) -> Self {
        Timed {
            inner,
            elapsed: Cell::new(Duration::ZERO),
            calls: Cell::new(0),
        }
    }

    /// The time spent in collectives since the last [`reset`](Timed::reset).
    pub fn elapsed(&self) -> Duration {
        self.elapsed.get()
    }

    /// The number of collectives since the last [`reset`](Timed::reset).
    pub fn calls(&self) -> u64 {
        self.calls.get()
    }

    /// Zeroes the time and the count.
    pub fn reset(&self) {
        self.elapsed.set(Duration::ZERO);
        self.calls.set(0);
    }

    /// The wrapped collective.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    fn time<R>(&self, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        self.elapsed.set(self.elapsed.get() + t.elapsed());
        self.calls.set(self.calls.get() + 1);
        r
    }
}

impl<C: Collective> Collective for Timed<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_gather(&self, local: &[f64]) -> Result<Vec<f64>> {
        self.time(|| self.inner.all_gather(local))
    }
    fn all_reduce_sum(&self, buf: &mut [f64]) -> Result<()> {
        self.time(|| self.inner.all_reduce_sum(buf))
    }
}

// ---------------------------------------------------------------------------------
// The agreement check.

/// What a synchronized call is, as every rank describes it; all ranks must agree.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Descriptor {
    /// 1: training forward; 2: training gradient; 3: an op that runs locally.
    pub kind: u8,
    /// The op (0 for the typed API; `ops::Op` index + 1 from the op layer).
    pub op: u8,
    /// Whether the op is in training mode (op layer).
    pub training: bool,
    pub channels: usize,
    pub epsilon: f32,
    /// Rank of `x`.
    pub rank: usize,
    pub channels_last: bool,
    /// 1 f16, 2 bf16, 3 f32, 4 f64.
    pub dtype: u8,
    pub relu: bool,
    /// The running statistics' factor (NaN when there are none).
    pub factor: f32,
}

const MAGIC: f64 = 0x5EED_B0A7 as f64;
const FIELDS: usize = 12;

pub(crate) const KIND_FORWARD: u8 = 1;
pub(crate) const KIND_BACKWARD: u8 = 2;
pub(crate) const KIND_LOCAL: u8 = 3;

impl Descriptor {
    pub(crate) fn of(problem: &Problem, kind: u8, dtype: crate::element::DType) -> Self {
        Descriptor {
            kind,
            op: 0,
            training: true,
            channels: problem.channels(),
            epsilon: problem.epsilon(),
            rank: problem.shape().len(),
            channels_last: problem.is_channels_last(),
            dtype: dtype_code(dtype),
            relu: false,
            factor: f32::NAN,
        }
    }

    fn encode(&self, ok: bool) -> [f64; FIELDS] {
        [
            MAGIC,
            if ok { 0.0 } else { 1.0 },
            f64::from(self.kind),
            f64::from(self.op),
            f64::from(u8::from(self.training)),
            self.channels as f64,
            f64::from(self.epsilon.to_bits()),
            self.rank as f64,
            f64::from(u8::from(self.channels_last)),
            f64::from(self.dtype),
            f64::from(u8::from(self.relu)),
            f64::from(self.factor.to_bits()),
        ]
    }
}

fn dtype_code(d: crate::element::DType) -> u8 {
    use crate::element::DType;
    match d {
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::F32 => 3,
        DType::F64 => 4,
    }
}

fn dtype_name(code: f64) -> String {
    use crate::element::DType;
    match code as u8 {
        1 => DType::F16.to_string(),
        2 => DType::BF16.to_string(),
        3 => DType::F32.to_string(),
        4 => DType::F64.to_string(),
        _ => format!("code {code}"),
    }
}

fn kind_name(kind: f64, op: f64, training: f64) -> String {
    let mode = if training != 0.0 {
        "training"
    } else {
        "inference"
    };
    match op as usize {
        0 => match kind as u8 {
            KIND_FORWARD => "the training forward".to_string(),
            KIND_BACKWARD => "the training gradient".to_string(),
            _ => "a local op".to_string(),
        },
        i => match crate::ops::Op::ALL.get(i - 1) {
            Some(o) => format!("{o} in {mode}"),
            None => format!("op {i}"),
        },
    }
}

/// One small all-gather in which every rank says what it is about to do (or that its
/// inputs failed validation); every rank gets the same verdict. `local` is this rank's
/// own validation result, returned unchanged when it failed.
pub(crate) fn agree(comm: &dyn Collective, d: &Descriptor, local: Result<()>) -> Result<()> {
    let mine = d.encode(local.is_ok());
    let all = comm.all_gather(&mine)?;
    let size = comm.size();
    if all.len() != FIELDS * size || size == 0 {
        return Err(Error::Collective {
            reason: format!(
                "the agreement check's all_gather returned {} values for {size} ranks of {FIELDS}",
                all.len()
            ),
        });
    }
    let rows: Vec<&[f64]> = all.chunks_exact(FIELDS).collect();
    if let Some(r) = rows.iter().position(|row| row[0] != MAGIC) {
        return Err(Error::Collective {
            reason: format!(
                "rank {r} sent something other than a batch-norm agreement check \
                 (the ranks are not running the same program step)"
            ),
        });
    }
    local?;
    let failed: Vec<usize> = (0..size).filter(|&r| rows[r][1] != 0.0).collect();
    if !failed.is_empty() {
        let who = failed
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let s = if failed.len() == 1 { "" } else { "s" };
        return Err(Error::Collective {
            reason: format!(
                "rank{s} {who} of {size} rejected its inputs (its own error says why); \
                 no rank computed anything"
            ),
        });
    }
    // Fields in the order they are reported: (index, name, how to show a value).
    type Show = fn(&[f64]) -> String;
    let fields: [(usize, &str, Show); 7] = [
        (2, "the operation", |r| kind_name(r[2], r[3], r[4])),
        (9, "the element type", |r| dtype_name(r[9])),
        (7, "the layout of x", |r| {
            let axis = if r[8] != 0.0 { "last" } else { "first" };
            format!("rank {} with channels {axis}", r[7])
        }),
        (5, "the channel count C", |r| format!("{}", r[5])),
        (6, "epsilon", |r| format!("{}", f32::from_bits(r[6] as u32))),
        (10, "the activation", |r| {
            if r[10] != 0.0 { "Relu" } else { "Identity" }.to_string()
        }),
        (11, "the running statistics' factor", |r| {
            let f = f32::from_bits(r[11] as u32);
            if f.is_nan() {
                "none (no running statistics)".to_string()
            } else {
                f.to_string()
            }
        }),
    ];
    for (i, name, show) in fields {
        let differs = |row: &[f64]| {
            row[i].to_bits() != rows[0][i].to_bits()
                || (i == 2 && (row[3] != rows[0][3] || row[4] != rows[0][4]))
        };
        if let Some(r) = rows.iter().position(|row| differs(row)) {
            return Err(Error::Collective {
                reason: format!(
                    "the ranks disagree on {name}: rank 0 has {}, rank {r} has {}",
                    show(rows[0]),
                    show(rows[r])
                ),
            });
        }
    }
    Ok(())
}

/// Takes part in the agreement check of a synchronized call as a rank that has failed
/// before it could make the call (an input file it could not read, say): the other
/// ranks' call then returns an error instead of waiting for this one. Returns `failure`.
///
/// ```
/// use fusedbn::{Error, sync::{fail_step, SingleProcess}};
/// let e = fail_step(&SingleProcess, Error::Collective { reason: "no input".into() });
/// assert!(e.to_string().contains("no input"));
/// ```
pub fn fail_step(comm: &dyn Collective, failure: Error) -> Error {
    match agree(comm, &Descriptor::default(), Err(failure)) {
        Err(e) => e,
        Ok(()) => Error::Collective {
            reason: "fail_step: the agreement check passed".into(),
        },
    }
}

// ---------------------------------------------------------------------------------
// The synchronized forward and gradient.

const MOMENT_FIELDS: usize = 3;

/// The global moments from every rank's, folded in rank order.
fn gather_moments(comm: &dyn Collective, local: &[Moments]) -> Result<Vec<Moments>> {
    let flat: Vec<f64> = local.iter().flat_map(|m| [m.count, m.mean, m.m2]).collect();
    let all = comm.all_gather(&flat)?;
    let c = local.len();
    let size = comm.size();
    if all.len() != flat.len() * size {
        return Err(Error::Collective {
            reason: format!(
                "all_gather returned {} values, expected {size} ranks × {}",
                all.len(),
                flat.len()
            ),
        });
    }
    let parts: Vec<Vec<Moments>> = (0..size)
        .map(|r| {
            (0..c)
                .map(|ch| {
                    let v = &all[(r * c + ch) * MOMENT_FIELDS..][..MOMENT_FIELDS];
                    Moments {
                        count: v[0],
                        mean: v[1],
                        m2: v[2],
                    }
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[Moments]> = parts.iter().map(|v| &v[..]).collect();
    if c == 0 {
        return Ok(Vec::new());
    }
    combine_moments(&refs)
}

impl Problem {
    /// The training forward over a batch split across the ranks of `comm`: this rank's
    /// shard `x` is normalized with the statistics of the **whole** batch (every rank's
    /// shard), which are written to `stats.saved` — bit-identical on every rank — and
    /// update `stats.running` with the global count. With [`Epilogue`], the Ex op:
    /// `y = act(bn(x) + side_input)`, the side input local.
    ///
    /// Collectives: one agreement check (a few values), one all-gather of
    /// `3·C` values. Every rank of `comm` must make the same call; shards may differ
    /// in N (and in spatial size) and may be empty. With one rank the results are
    /// bit-identical to [`Problem::forward`] in training.
    ///
    /// Fails on every rank when the ranks disagree on the channel count, epsilon,
    /// layout, element type, activation or running-statistics factor, or when any
    /// rank's inputs are invalid; nothing is then written on any rank. `affine` and the
    /// running statistics are not compared: every rank must pass the same values (a
    /// rank that passes others normalizes its shard with them and keeps its own running
    /// statistics).
    /// See the [module documentation](crate::sync) for an example.
    pub fn forward_sync<T: Element>(
        &self,
        comm: &dyn Collective,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        stats: TrainingStats<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &mut [T],
    ) -> Result<()> {
        self.forward_sync_as(comm, 0, x, affine, stats, epilogue, y)
            .map(|_| ())
    }

    /// [`forward_sync`](Problem::forward_sync) tagged with the op-layer's op, returning
    /// the global moments.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_sync_as<T: Element>(
        &self,
        comm: &dyn Collective,
        op: u8,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        stats: TrainingStats<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &mut [T],
    ) -> Result<Vec<Moments>> {
        let mut d = Descriptor::of(self, KIND_FORWARD, T::DTYPE);
        d.op = op;
        d.relu = epilogue.activation == Activation::Relu;
        d.factor = stats.running.as_ref().map_or(f32::NAN, |r| r.factor);
        let local = self
            .check_forward(x, affine, epilogue, y)
            .and_then(|()| self.check_training_stats(&stats));
        agree(comm, &d, local)?;
        let moments = self.moments(x)?;
        let global = gather_moments(comm, &moments)?;
        self.forward_apply(x, affine, &global, stats, epilogue, y)?;
        Ok(global)
    }

    /// The training gradient over a batch split across the ranks of `comm`, for the
    /// statistics [`forward_sync`](Problem::forward_sync) saved (`saved`, global):
    /// `dx` of this rank's shard, and the **global** `dscale = Σ dy·x̂/…` and
    /// `doffset = Σ dy` over the whole batch, identical on every rank. (PyTorch's
    /// `SyncBatchNorm` returns each rank's local parameter gradients instead; these
    /// need no further all-reduce.) With [`GradEpilogue`], the Ex gradient: `dy` masked
    /// by the forward output's ReLU, and the side input's gradient (local).
    ///
    /// Collectives: one agreement check, one all-reduce (sum) of `2·C + 1` values
    /// (`Σdy`, `Σdy·(x − mean)` per channel and the element count). With one rank the
    /// results are bit-identical to [`Problem::backward`] in training.
    ///
    /// Fails on every rank as [`forward_sync`](Problem::forward_sync) does.
    ///
    /// ```
    /// use fusedbn::{DataFormat, Problem, sync::SingleProcess};
    /// use fusedbn::batch_norm::{GradEpilogue, GradInputs, Gradients, Statistics};
    /// let p = Problem::new(DataFormat::Nhwc, &[1, 1, 6, 1])?.with_epsilon(0.001);
    /// let dy = [2.0f32, 9.0, -4.0, 5.0, 8.0, 7.0];
    /// let x = [1.0f32, 7.0, 4.0, -3.0, -11.0, 13.0];
    /// let (mut dx, mut dscale, mut doffset) = ([0.0f32; 6], [0.0f32], [0.0f32]);
    /// p.backward_sync(&SingleProcess, GradInputs { y_backprop: &dy, x: &x }, &[4.0],
    ///     Statistics { mean: &[11.0 / 6.0], variance: &[57.472_222] }, GradEpilogue::default(),
    ///     Gradients { x: &mut dx, scale: &mut dscale, offset: &mut doffset })?;
    /// assert_eq!(doffset[0], 27.0);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn backward_sync<T: Element>(
        &self,
        comm: &dyn Collective,
        inputs: GradInputs<'_, T>,
        scale: &[T::Stat],
        saved: Statistics<'_, T::Stat>,
        epilogue: GradEpilogue<'_, T>,
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        self.backward_sync_as(comm, 0, inputs, scale, saved, epilogue, grads)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward_sync_as<T: Element>(
        &self,
        comm: &dyn Collective,
        op: u8,
        inputs: GradInputs<'_, T>,
        scale: &[T::Stat],
        saved: Statistics<'_, T::Stat>,
        epilogue: GradEpilogue<'_, T>,
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        let mut d = Descriptor::of(self, KIND_BACKWARD, T::DTYPE);
        d.op = op;
        d.relu = epilogue.relu_output.is_some();
        let local = self.check_backward(inputs, scale, saved, &epilogue, &grads);
        agree(comm, &d, local)?;
        let GradEpilogue {
            relu_output,
            mut side_input_backprop,
        } = epilogue;
        let local_epilogue = GradEpilogue {
            relu_output,
            side_input_backprop: side_input_backprop.as_deref_mut(),
        };
        let sums = self.backward_sums(inputs, saved.mean, local_epilogue)?;
        let c = sums.len();
        // [count, Σdy per channel, Σdy·(x − mean) per channel]
        let mut buf = Vec::with_capacity(2 * c + 1);
        buf.push(self.elements_per_channel() as f64);
        buf.extend(sums.iter().map(|s| s.sum_dy));
        buf.extend(sums.iter().map(|s| s.sum_dy_xc));
        comm.all_reduce_sum(&mut buf)?;
        let count = buf[0];
        let total: Vec<GradSums> = (0..c)
            .map(|ch| GradSums {
                count,
                sum_dy: buf[1 + ch],
                sum_dy_xc: buf[1 + c + ch],
            })
            .collect();
        if count == 0.0 {
            // The whole batch is empty: zero parameter gradients (SPEC §5), whatever
            // the (NaN) saved statistics.
            grads.scale.fill(<T::Stat as Real>::ZERO);
            grads.offset.fill(<T::Stat as Real>::ZERO);
            return Ok(());
        }
        match side_input_backprop {
            // The side input's gradient is `dy` masked by the ReLU, exactly: `dx` from
            // it and `x` has the same bits and reads one tensor fewer than from `dy`,
            // `y` and `x` (what the whole op does too).
            Some(sg) => {
                let inputs = GradInputs {
                    y_backprop: sg,
                    x: inputs.x,
                };
                self.backward_apply(inputs, scale, saved, &total, None, grads)
            }
            None => self.backward_apply(inputs, scale, saved, &total, relu_output, grads),
        }
    }
}
