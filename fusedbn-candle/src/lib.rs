//! Drop-in fused batch normalization for [candle](https://github.com/huggingface/candle):
//! candle-nn's `BatchNorm` — same constructor, `BatchNormConfig`, variable names,
//! semantics and checkpoints — running [fusedbn](https://docs.rs/fusedbn)'s fused CPU
//! kernels for the forward pass and for its gradient, through candle's autograd.
//!
//! Switching a model is one line:
//!
//! ```text
//! -use candle_nn::{batch_norm, BatchNorm};
//! +use fusedbn_candle::{batch_norm, BatchNorm};
//! ```
//!
//! - [`BatchNorm`] / [`batch_norm`]: the layer (`ModuleT`), with
//!   [`BatchNorm::forward_ex`] for a fused residual add and ReLU, and conversions from and
//!   to [`candle_nn::BatchNorm`] on the same variables.
//! - [`batch_norm_train`] / [`batch_norm_eval`]: the functional form on tensors.
//!
//! The op is a candle `CustomOp3` whose backward returns the gradients of `x`, `weight`
//! and `bias` (and of the side input) from one fused kernel call. Inputs are `[N, C, *]`
//! (rank ≥ 2) in f32, f64, f16 or bf16 (statistics in f32 for the halves), contiguous or
//! channels-last behind a permuted view (kept channels-last, not copied). On other
//! devices, other dtypes, or with `remove_mean = false`, candle-nn's own code runs.
//!
//! ```
//! use candle_core::{DType, Device, ModuleT, Tensor};
//! use candle_nn::{Optimizer, VarBuilder, VarMap, SGD};
//! use fusedbn_candle::batch_norm;
//!
//! let dev = Device::Cpu;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let bn = batch_norm(8, 1e-5, vb.pp("bn"))?;
//! let mut opt = SGD::new(varmap.all_vars(), 0.1)?;
//! let x = Tensor::randn(1f32, 2., (16, 8, 5, 5), &dev)?;
//! for _ in 0..3 {
//!     let loss = bn.forward_t(&x, true)?.relu()?.mean_all()?;
//!     opt.backward_step(&loss)?; // gradients of weight and bias from the fused backward
//! }
//! # Ok::<(), candle_core::Error>(())
//! ```

#![warn(missing_docs)]

pub mod functional;
mod grad;
mod module;
mod op;

pub use functional::{batch_norm_eval, batch_norm_train, Epilogue, TrainOutput};
pub use module::{batch_norm, BatchNorm};

/// The README's example, compiled and run as a doc test.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
