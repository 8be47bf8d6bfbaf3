//! The fused batch norm as a candle [`CustomOp3`]: one forward kernel call, and a `bwd`
//! that returns every gradient from one call of fusedbn's backward (as the outputs of
//! the ops of [`crate::grad`], so that they can be differentiated again).
//!
//! # Arguments
//!
//! A `CustomOp3` has three tensor arguments, and candle's autograd routes a gradient to
//! each. The plain op takes `(x, weight, bias)`. The op with a side input
//! (`y = act(bn(x) + side)`) needs four, so it takes `(x, side, cat[weight, bias])`: the
//! `cat` is an ordinary candle op, whose backward splits the packed `[2C]` gradient back
//! into the gradients of `weight` and `bias`. Without affine parameters the caller
//! passes constant (untracked) ones and zeros, and candle drops their gradients.
//!
//! `x` (and the side input) must be contiguous: either `[N, C, *]` (channels first) or
//! `[N, *, C]` (channels last; the wrapper in [`crate::functional`] permutes a
//! channels-last view of `[N, C, *]` into that contiguous shape, which moves no data).
//!
//! # The saved statistics
//!
//! The training gradient needs the batch mean and variance the forward computed, but a
//! custom op has one output. They are carried by the op itself: `cpu_fwd` stores them
//! in a [`OnceLock`] that the op owns (shared, through an `Arc`, with the caller, which
//! reads them to update the running statistics). This is sound because candle builds the
//! op for one application: `apply_op3` moves the op into the graph node of its output,
//! `cpu_fwd` runs once, eagerly, before the output exists, and `bwd` is called on that
//! same op, with the same arguments, later. Recomputing the statistics in `bwd` would
//! cost one more pass over `x`; storing them costs `2C` numbers.

use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, StorageRef, Tensor,
    WithDType,
};
use fusedbn::batch_norm::{
    Activation, Affine, Epilogue, Forward, SavedStats, Statistics, TrainingStats,
};
use fusedbn::{Element, Problem, Real};

use crate::grad::{BatchNormGrad, Extras, GradParams, GradShared, SideGrad};

/// Per-channel statistics, widened to `f64` (exact for the `f32` statistics of `f32`,
/// `f16` and `bf16` data).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Stats {
    pub mean: Vec<f64>,
    pub variance: Vec<f64>,
}

/// Where the statistics come from.
#[derive(Clone, Debug)]
pub(crate) enum Mode {
    /// The batch's own; `cpu_fwd` writes them here (mean and biased variance).
    Training(Arc<OnceLock<Stats>>),
    /// Population (running) statistics, constants of the op.
    Inference(Stats),
}

/// The fused op. One instance per application (see the module docs).
#[derive(Debug)]
pub(crate) struct FusedBatchNorm {
    /// The shape and layout of the contiguous `x` the op sees, and epsilon.
    pub problem: Problem,
    pub mode: Mode,
    /// The second argument is the side input and the third `cat[weight, bias]`.
    pub side_input: bool,
    pub relu: bool,
}

/// `$run!(T)` for the element type `T` of the candle dtype `$dtype` (f32, f64, f16,
/// bf16), an error for any other: the one dispatch of the forward op and of the
/// gradient's ops.
macro_rules! by_dtype {
    ($dtype:expr, $run:ident) => {
        match $dtype {
            candle_core::DType::F32 => $run!(f32),
            candle_core::DType::F64 => $run!(f64),
            candle_core::DType::F16 => $run!(half::f16),
            candle_core::DType::BF16 => $run!(half::bf16),
            other => candle_core::bail!(
                "fusedbn: batch norm needs f32, f64, f16 or bf16 data, found {other:?}"
            ),
        }
    };
}
pub(crate) use by_dtype;

pub(crate) fn err(e: fusedbn::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// `C` values of a rank-1 argument, whatever its strides, widened to `f64`.
pub(crate) fn per_channel(s: &CpuStorage, l: &Layout, start: usize, c: usize) -> Result<Vec<f64>> {
    fn read<T: WithDType>(v: &[T], l: &Layout, start: usize, c: usize) -> Result<Vec<f64>> {
        let stride = l.stride().first().copied().unwrap_or(1);
        (start..start + c)
            .map(|i| {
                v.get(l.start_offset() + i * stride)
                    .map(|e| e.to_f64())
                    .ok_or_else(|| candle_core::Error::msg("fusedbn: parameter out of bounds"))
            })
            .collect()
    }
    match s {
        CpuStorage::F32(v) => read(v, l, start, c),
        CpuStorage::F64(v) => read(v, l, start, c),
        CpuStorage::F16(v) => read(v, l, start, c),
        CpuStorage::BF16(v) => read(v, l, start, c),
        other => bail!(
            "fusedbn: batch-norm parameters must be f32, f64, f16 or bf16, found {:?}",
            other.dtype()
        ),
    }
}

/// The contiguous elements of a CPU storage seen through `l`.
pub(crate) fn contiguous<'a, T: WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("fusedbn: {what} must be contiguous (the wrapper makes it so)")
    };
    Ok(&s.as_slice::<T>()?[a..b])
}

pub(crate) fn to_stat<U: Real>(v: &[f64]) -> Vec<U> {
    v.iter().map(|&a| U::from_f64(a)).collect()
}

pub(crate) fn to_f64<U: Real>(v: &[U]) -> Vec<f64> {
    v.iter().map(|&a| a.to_f64()).collect()
}

impl FusedBatchNorm {
    pub(crate) fn activation(&self) -> Activation {
        if self.relu {
            Activation::Relu
        } else {
            Activation::Identity
        }
    }

    fn forward<T: Element + WithDType>(
        &self,
        x: &[T],
        side: Option<&[T]>,
        scale: &[f64],
        offset: &[f64],
    ) -> Result<Vec<T>> {
        let p = &self.problem;
        let (scale, offset) = (to_stat::<T::Stat>(scale), to_stat::<T::Stat>(offset));
        let affine = Affine {
            scale: &scale,
            offset: &offset,
        };
        let epilogue = Epilogue {
            side_input: side,
            activation: self.activation(),
        };
        let mut y = vec![T::default(); x.len()];
        match &self.mode {
            Mode::Training(saved) => {
                let c = p.channels();
                let (mut mean, mut variance) = (vec![T::Stat::ZERO; c], vec![T::Stat::ZERO; c]);
                let stats = TrainingStats {
                    saved: SavedStats {
                        mean: &mut mean,
                        variance: &mut variance,
                    },
                    running: None,
                };
                p.forward(x, affine, Forward::Training(stats), epilogue, &mut y)
                    .map_err(err)?;
                let stats = Stats {
                    mean: to_f64(&mean),
                    variance: to_f64(&variance),
                };
                if saved.set(stats).is_err() {
                    bail!("fusedbn: a batch-norm op was applied twice")
                }
            }
            Mode::Inference(s) => {
                let (mean, variance) = (to_stat(&s.mean), to_stat(&s.variance));
                let stats = Statistics {
                    mean: &mean,
                    variance: &variance,
                };
                p.forward(x, affine, Forward::Inference(stats), epilogue, &mut y)
                    .map_err(err)?;
            }
        }
        Ok(y)
    }

    pub(crate) fn stats(&self) -> Result<&Stats> {
        match &self.mode {
            Mode::Training(saved) => match saved.get() {
                Some(s) => Ok(s),
                None => bail!("fusedbn: batch-norm backward before its forward"),
            },
            Mode::Inference(s) => Ok(s),
        }
    }
}

/// A read guard on a CPU tensor's storage and the range of its contiguous elements.
pub(crate) struct CpuView<'a> {
    guard: StorageRef<'a>,
    range: (usize, usize),
}

impl CpuView<'_> {
    pub(crate) fn of<'a>(t: &'a Tensor, what: &str) -> Result<CpuView<'a>> {
        let (guard, layout) = t.storage_and_layout();
        let Some(range) = layout.contiguous_offsets() else {
            bail!("fusedbn: {what} must be contiguous")
        };
        Ok(CpuView { guard, range })
    }

    pub(crate) fn slice<T: WithDType>(&self) -> Result<&[T]> {
        match &*self.guard {
            Storage::Cpu(s) => Ok(&s.as_slice::<T>()?[self.range.0..self.range.1]),
            _ => bail!("fusedbn: the fused batch norm runs on the CPU only"),
        }
    }
}

/// `C` values of a parameter tensor, as `f64`.
pub(crate) fn values(t: &Tensor) -> Result<Vec<f64>> {
    t.detach().to_dtype(DType::F64)?.flatten_all()?.to_vec1()
}

impl CustomOp3 for FusedBatchNorm {
    fn name(&self) -> &'static str {
        "fusedbn-batch-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = &self.problem;
        if l1.dims() != p.shape() {
            bail!(
                "fusedbn: x has shape {:?}, the op was built for {:?}",
                l1.dims(),
                p.shape()
            )
        }
        let c = p.channels();
        let (scale, offset) = if self.side_input {
            (per_channel(s3, l3, 0, c)?, per_channel(s3, l3, c, c)?)
        } else {
            (per_channel(s2, l2, 0, c)?, per_channel(s3, l3, 0, c)?)
        };
        macro_rules! run {
            ($t:ty) => {{
                let x = contiguous::<$t>(s1, l1, "x")?;
                let side = if self.side_input {
                    Some(contiguous::<$t>(s2, l2, "side_input")?)
                } else {
                    None
                };
                <$t>::to_cpu_storage_owned(self.forward::<$t>(x, side, &scale, &offset)?)
            }};
        }
        let y = by_dtype!(s1.dtype(), run);
        Ok((y, Shape::from_dims(p.shape())))
    }

    fn bwd(
        &self,
        x: &Tensor,
        arg2: &Tensor,
        arg3: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let c = self.problem.channels();
        // The upstream gradient may come strided (a permuted or broadcast view).
        let dy = dy.contiguous()?;
        let scale = if self.side_input {
            arg3.narrow(0, 0, c)?
        } else {
            arg2.clone()
        };
        let shared = Arc::new(GradShared {
            problem: self.problem.clone(),
            training: matches!(self.mode, Mode::Training(_)),
            stats: self.stats()?.clone(),
            relu_y: self.relu.then(|| y.detach()),
            // With no ReLU the side input's gradient is dy itself (below); none is written
            // for a side input that takes no gradient.
            side_output: self.side_input && self.relu && arg2.track_op(),
            extras: Mutex::new(Extras::default()),
        });
        // dx first: its forward runs the fused backward and leaves the other results
        // for the two ops after it.
        let dx = x.apply_op3(&scale, &dy, BatchNormGrad(shared.clone()))?;
        let dparams = x.apply_op3(&scale, &dy, GradParams(shared.clone()))?;
        // Only what candle will use: it adds each returned gradient into a zero-filled
        // accumulator, so a gradient for an untracked argument would cost a full pass.
        let dx = x.track_op().then_some(dx);
        if self.side_input {
            let dside = if self.relu {
                arg2.track_op()
                    .then(|| dy.apply_op1(SideGrad(shared)))
                    .transpose()?
            } else {
                arg2.track_op().then_some(dy)
            };
            Ok((
                dx,
                dside,
                arg3.track_op()
                    .then(|| dparams.to_dtype(arg3.dtype()))
                    .transpose()?,
            ))
        } else {
            Ok((
                dx,
                arg2.track_op()
                    .then(|| dparams.narrow(0, 0, c)?.to_dtype(arg2.dtype()))
                    .transpose()?,
                arg3.track_op()
                    .then(|| dparams.narrow(0, c, c)?.to_dtype(arg3.dtype()))
                    .transpose()?,
            ))
        }
    }
}
