//! TensorFlow-exact fused batch normalization for the CPU: the forward pass and its
//! gradient, with the behaviour of TensorFlow's `FusedBatchNorm*` and
//! `FusedBatchNormGrad*` ops (V1, V2, V3), in NHWC, NCHW, NDHWC and NCDHW, for `f32`,
//! `f16` and `bf16` data with `f32` statistics (and `f64`), in training and inference.
//!
//! A training step — forward with batch statistics, then the gradient:
//!
//! ```
//! use fusedbn::{DataFormat, Problem, batch_norm::{Gradients, SavedStats}};
//! let p = Problem::new(DataFormat::Nhwc, &[2, 4, 4, 3])?.with_epsilon(1e-3);
//! let x: Vec<f32> = (0..p.len()).map(|i| (i % 7) as f32).collect();
//! let (scale, offset) = (vec![1.0f32; 3], vec![0.0f32; 3]);
//! let (mut y, mut mean, mut var) = (vec![0.0; p.len()], vec![0.0; 3], vec![0.0; 3]);
//! p.forward_training(&x, &scale, &offset, &mut y, SavedStats { mean: &mut mean, variance: &mut var }, None)?;
//! let dy = vec![0.5f32; p.len()]; // the upstream gradient
//! let (mut dx, mut dscale, mut doffset) = (vec![0.0; p.len()], vec![0.0; 3], vec![0.0; 3]);
//! p.backward_training(&dy, &x, &scale, &mean, &var, Gradients { x: &mut dx, scale: &mut dscale, offset: &mut doffset })?;
//! assert_eq!(doffset, [16.0; 3]); // Σdy over the 32 elements of each channel
//! # Ok::<(), fusedbn::Error>(())
//! ```
//!
//! # Layers
//!
//! - [`ops`] — the TensorFlow-op layer: [`ops::Op`] by TF's name, named inputs and
//!   outputs, [`ops::Attrs`] with TF's defaults, over the dynamically typed [`Tensor`].
//!   Validates in SPEC §4's order and dispatches on the element type.
//! - [`batch_norm`] — the typed, zero-copy layer: methods of [`Problem`] over slices,
//!   generic in the [`Element`] type, writing into caller-owned buffers.
//! - [`kernels`] — the geometry, the instruction sets and (crate-private) the passes:
//!   statistics, apply, backward reduce, backward apply over a per-channel
//!   [`kernels::Geometry`]; multithreaded with rayon, results independent of the
//!   thread count. Only the validated layers above call the passes.
//! - [`reference`](mod@reference) — the `f64` oracle the tests compare everything against.
//! - [`driver`] — one problem description for tests, benchmarks and `fusedbn run --check`:
//!   inputs, reference outputs of any op, one tolerance policy.
//! - [`npy`] — NumPy `.npy` reading and writing (bfloat16 as numpy + ml_dtypes stores it).
//!
//! No input makes the library panic, and an op that returns an error has written no
//! output.

#![warn(missing_docs)]

pub mod batch_norm;
pub mod driver;
pub mod element;
pub mod error;
pub mod kernels;
pub mod layer;
pub mod npy;
pub mod ops;
pub mod problem;
pub mod reference;
pub mod tensor;

pub use element::{Element, Real};
pub use error::{Error, Result};
/// The half-precision element types (re-exported from the `half` crate).
pub use half::{bf16, f16};
/// The instruction set the kernels run with (also at `fusedbn::kernels::simd::Isa`).
pub use kernels::simd::Isa;
pub use problem::{DataFormat, Problem, DEFAULT_EPSILON};
pub use tensor::{DType, Tensor, TensorData};

/// The README's example, compiled and run as a doc test.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
