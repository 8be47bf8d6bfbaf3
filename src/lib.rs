//! TensorFlow-exact fused batch normalization for the CPU: the forward pass and its
//! gradient, with the behaviour of TensorFlow's `FusedBatchNorm*` and
//! `FusedBatchNormGrad*` ops (V1, V2, V3), in NHWC, NCHW, NDHWC and NCDHW, for `f32`,
//! `f16` and `bf16` data with `f32` statistics (and `f64`), in training and inference.
//!
//! A training step — forward with batch statistics, then the gradient:
//!
//! ```
//! use fusedbn::{DataFormat, Problem};
//! use fusedbn::batch_norm::{Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs,
//!     Gradients, SavedStats, Statistics, TrainingStats};
//! let p = Problem::new(DataFormat::Nhwc, &[2, 4, 4, 3])?.with_epsilon(1e-3);
//! let x: Vec<f32> = (0..p.len()).map(|i| (i % 7) as f32).collect();
//! let (scale, offset) = (vec![1.0f32; 3], vec![0.0f32; 3]);
//! let (mut y, mut mean, mut var) = (vec![0.0; p.len()], vec![0.0; 3], vec![0.0; 3]);
//! let affine = Affine { scale: &scale, offset: &offset };
//! let saved = SavedStats { mean: &mut mean, variance: &mut var };
//! p.forward(&x, affine, Forward::Training(TrainingStats { saved, running: None }),
//!     Epilogue::plain(), &mut y)?;
//! let dy = vec![0.5f32; p.len()]; // the upstream gradient
//! let (mut dx, mut dscale, mut doffset) = (vec![0.0; p.len()], vec![0.0; 3], vec![0.0; 3]);
//! p.backward(GradInputs { y_backprop: &dy, x: &x }, &scale,
//!     Backward::Training(Statistics { mean: &mean, variance: &var }), GradEpilogue::default(),
//!     Gradients { x: &mut dx, scale: &mut dscale, offset: &mut doffset })?;
//! assert_eq!(doffset, [16.0; 3]); // Σdy over the 32 elements of each channel
//! # Ok::<(), fusedbn::Error>(())
//! ```
//!
//! # Layers
//!
//! - [`ops`] — the TensorFlow-op layer: [`ops::Op`] by TF's name, named inputs and
//!   outputs, [`ops::Attrs`] with TF's defaults, over the dynamically typed [`Tensor`].
//!   Validates in SPEC §4's order and dispatches on the element type.
//! - [`batch_norm`] — the typed, zero-copy API: methods of [`Problem`] over slices,
//!   generic in the [`Element`] type, writing into caller-owned buffers; inputs named
//!   by field, modes as types; the whole ops and their [phases](batch_norm::phases)
//!   (local moments → combine → apply; local gradient sums → combine → apply) for
//!   data-parallel training and framework adapters.
//! - `kernels` (crate-private) — the passes (statistics, apply, backward reduce,
//!   backward apply, the fused ops, second order) over a per-channel geometry, and the
//!   SIMD code behind [`Isa`]; multithreaded with rayon, results independent of the
//!   thread count. Only the validated layers above call them, so no public entry can
//!   hand them a bad geometry or a short slice.
//! - [`sync`] — synchronized batch norm across processes or threads: a [`sync::Collective`]
//!   (single process, a thread group, MPI with the `mpi` feature, or your own) between
//!   the phases, for data-parallel training with the statistics of the whole batch.
//! - [`reference`](mod@reference) — the `f64` oracle the tests compare everything against.
//! - [`driver`] — one problem description for tests, benchmarks and `fusedbn run --check`:
//!   inputs, reference outputs of any op, one tolerance policy.
//! - [`npy`] — NumPy `.npy` reading and writing (bfloat16 as numpy + ml_dtypes stores it).
//!
//! No input makes the library panic, and an op that returns an error has written no
//! output.

#![warn(missing_docs)]

pub mod batch_norm;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod driver;
pub mod element;
pub mod error;
pub mod format;
mod kernels;
pub mod layer;
pub mod npy;
pub mod ops;
pub mod reference;
pub mod sync;
pub mod tensor;

pub use batch_norm::Problem;
pub use element::{Element, Real};
pub use error::{Error, Result};
pub use format::{DataFormat, DEFAULT_EPSILON};
/// The half-precision element types (re-exported from the `half` crate).
pub use half::{bf16, f16};
/// The instruction set the kernels run with.
pub use kernels::simd::Isa;

/// How the kernels split work across threads, for benchmarks that want a baseline
/// (a copy of the same bytes) split the same way.
pub mod tuning {
    /// Elements per parallel task (each task is one rayon job).
    pub const TASK: usize = crate::kernels::TASK;
    /// Below this many elements every pass runs on the calling thread.
    pub const PARALLEL_MIN: usize = crate::kernels::PARALLEL_MIN;

    /// Whether the passes over a tensor of `elements` elements use rayon's pool (the
    /// one the call runs in): at least [`PARALLEL_MIN`] elements and more than one
    /// thread. The kernels decide by this function, so a baseline that asks it splits
    /// the same way.
    ///
    /// ```
    /// use fusedbn::tuning::{parallel, PARALLEL_MIN};
    /// let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    /// assert!(!one.install(|| parallel(PARALLEL_MIN)));
    /// let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    /// assert!(two.install(|| parallel(PARALLEL_MIN)));
    /// assert!(!two.install(|| parallel(PARALLEL_MIN - 1)));
    /// ```
    pub fn parallel(elements: usize) -> bool {
        crate::kernels::uses_pool(elements)
    }
}
pub use tensor::{DType, Tensor, TensorData};

/// The README's example, compiled and run as a doc test.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
