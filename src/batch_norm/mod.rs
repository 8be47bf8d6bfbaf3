//! The typed, zero-copy API: a [`Problem`] (layout, shape of `x`, epsilon) and its
//! methods over slices, generic in the element type, writing into buffers the caller
//! owns.
//!
//! Inputs and outputs are named by field and modes are types, so a call site says which
//! slice is which: [`Affine`] (`scale`, `offset`), [`Statistics`] (`mean`, `variance`),
//! [`Forward`] / [`Backward`] (training or inference, with what each needs), an
//! [`Epilogue`] / [`GradEpilogue`] for the Ex ops' side input and ReLU (the default is
//! the plain op), and the output structs [`SavedStats`], [`RunningStats`],
//! [`Gradients`], [`SecondOrderGradients`]. Swapping two of them does not compile:
//!
//! ```compile_fail
//! use fusedbn::{DataFormat, Problem, batch_norm::{Affine, Epilogue, Forward, Statistics}};
//! let p = Problem::new(DataFormat::Nhwc, &[1, 1, 2, 1])?;
//! let (x, mut y) = ([1.0f32, 2.0], [0.0f32; 2]);
//! let (s, o, m, v) = ([1.0f32], [0.0f32], [1.5f32], [0.25f32]);
//! // Statistics where the affine parameters belong: a type error.
//! p.forward(&x, Statistics { mean: &m, variance: &v },
//!     Forward::Inference(Affine { scale: &s, offset: &o }), Epilogue::default(), &mut y)?;
//! # Ok::<(), fusedbn::Error>(())
//! ```
//!
//! Two levels:
//! - **Whole ops** ([`Problem::forward`], [`Problem::backward`],
//!   [`Problem::second_order`]): the fused single-process ops, each in the fewest passes
//!   over memory.
//! - **Phases** ([`phases`]): the same computations cut where a collective (an
//!   all-reduce across processes, threads or devices) can sit between them — local
//!   moments, combine, forward apply; local gradient sums, combine, backward apply.
//!   Each is validated like the whole ops, and on one shard they give bit-identical
//!   results to them.
//!
//! Every method validates every length before it writes anything. Nothing here
//! allocates in proportion to `x`.

use std::fmt;
use std::str::FromStr;

use crate::element::Element;
use crate::error::{Error, Result};
use crate::format::{check_x_shape, DataFormat, DEFAULT_EPSILON};
use crate::kernels::simd::Isa;
use crate::kernels::Geometry;
use crate::tensor::numel;

pub(crate) mod mono;
pub mod phases;
mod whole;

/// `Clone` and `Copy` for the borrowed-slice parameter types, whatever the element type
/// (derive would demand `T: Copy` for `&[T]`, which is always `Copy`).
macro_rules! copy_borrows {
    ($($name:ident),*) => {$(
        impl<T> Clone for $name<'_, T> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<T> Copy for $name<'_, T> {}
    )*};
}
copy_borrows!(Affine, Statistics, Backward, Epilogue, GradInputs);

pub use phases::{GradSums, Moments};

/// The affine parameters: `y = x̂·scale + offset`, `C` elements each.
#[derive(Debug)]
pub struct Affine<'a, U> {
    /// γ, per channel.
    pub scale: &'a [U],
    /// β, per channel.
    pub offset: &'a [U],
}

/// Per-channel statistics that an op reads: the population (running) statistics in
/// inference, or the batch statistics the training forward saved
/// (`reserve_space_1/2`) in the training gradient. `C` elements each.
#[derive(Debug)]
pub struct Statistics<'a, U> {
    /// Mean per channel.
    pub mean: &'a [U],
    /// Variance per channel (biased for saved batch statistics).
    pub variance: &'a [U],
}

/// Where the training forward writes the batch statistics that the gradient needs
/// (TensorFlow's `reserve_space_1` and `reserve_space_2`).
#[derive(Debug)]
pub struct SavedStats<'a, U> {
    /// Batch mean, `C` elements.
    pub mean: &'a mut [U],
    /// Biased batch variance (`Σ(x−μ)²/M`), `C` elements.
    pub variance: &'a mut [U],
}

/// Running (moving) statistics updated in place by the training forward:
/// `mean ← (1−f)·mean + f·μ`, `variance ← (1−f)·variance + f·M/(M−1)·σ²` (M the
/// global count when the statistics come from [`phases`]). With `factor == 1` the old
/// contents are ignored (TensorFlow's `batch_mean` and `batch_variance` outputs).
#[derive(Debug)]
pub struct RunningStats<'a, U> {
    /// Running mean, `C` elements.
    pub mean: &'a mut [U],
    /// Running (Bessel-corrected) variance, `C` elements.
    pub variance: &'a mut [U],
    /// `exponential_avg_factor`.
    pub factor: f32,
}

/// What the training forward writes besides `y`.
#[derive(Debug)]
pub struct TrainingStats<'a, U> {
    /// The batch statistics (always written).
    pub saved: SavedStats<'a, U>,
    /// The running statistics, when the caller keeps them.
    pub running: Option<RunningStats<'a, U>>,
}

/// The forward mode.
#[derive(Debug)]
pub enum Forward<'a, U> {
    /// Normalize with the batch's own statistics, and write them.
    Training(TrainingStats<'a, U>),
    /// Normalize with the given population statistics.
    Inference(Statistics<'a, U>),
}

/// The gradient mode, with the statistics the forward used.
#[derive(Debug)]
pub enum Backward<'a, U> {
    /// The batch statistics the training forward saved (`reserve_space_1/2`): the
    /// gradient flows through them.
    Training(Statistics<'a, U>),
    /// The population statistics of an inference forward: constants.
    Inference(Statistics<'a, U>),
}

impl<'a, U> Backward<'a, U> {
    /// The statistics, whatever the mode.
    pub fn statistics(&self) -> Statistics<'a, U> {
        match *self {
            Backward::Training(s) | Backward::Inference(s) => s,
        }
    }

    /// True in training.
    pub fn is_training(&self) -> bool {
        matches!(self, Backward::Training(_))
    }
}

/// Training or inference, for ops whose mode carries no data
/// ([`Problem::second_order`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Batch statistics (recomputed from `x` by the second-order op).
    Training,
    /// Population statistics.
    Inference,
}

/// What the forward does after the affine map (TensorFlow's `_FusedBatchNormEx`
/// epilogue, fused into the same pass): `y = act(bn(x) + side_input)`. The default is
/// the plain op.
#[derive(Debug)]
pub struct Epilogue<'a, T> {
    /// A residual the shape of `x`, added before the activation.
    pub side_input: Option<&'a [T]>,
    /// The activation.
    pub activation: Activation,
}

impl<T> Default for Epilogue<'_, T> {
    fn default() -> Self {
        Epilogue {
            side_input: None,
            activation: Activation::Identity,
        }
    }
}

impl<'a, T> Epilogue<'a, T> {
    /// The plain op (no side input, no activation).
    pub fn plain() -> Self {
        Self::default()
    }

    /// `y = relu(bn(x) + side_input)`, or `relu(bn(x))` without a side input.
    pub fn relu(side_input: Option<&'a [T]>) -> Self {
        Epilogue {
            side_input,
            activation: Activation::Relu,
        }
    }

    pub(crate) fn kernel(self) -> crate::kernels::apply::Epilogue<'a, T> {
        crate::kernels::apply::Epilogue {
            side: self.side_input,
            relu: self.activation == Activation::Relu,
        }
    }
}

/// The gradient's counterpart of [`Epilogue`]; the default is the plain gradient.
#[derive(Debug)]
pub struct GradEpilogue<'a, T> {
    /// The forward output `y` of an op with a ReLU: `y_backprop` counts only where
    /// `y > 0` (masked on the fly, in every pass).
    pub relu_output: Option<&'a [T]>,
    /// Receives the gradient of the side input (the masked `y_backprop`), the shape of
    /// `x`.
    pub side_input_backprop: Option<&'a mut [T]>,
}

impl<T> Default for GradEpilogue<'_, T> {
    fn default() -> Self {
        GradEpilogue {
            relu_output: None,
            side_input_backprop: None,
        }
    }
}

/// The full-size inputs of a gradient, the shape of `x` each.
#[derive(Debug)]
pub struct GradInputs<'a, T> {
    /// The upstream gradient `dy`.
    pub y_backprop: &'a [T],
    /// The forward's input.
    pub x: &'a [T],
}

/// Where the gradient writes its results.
#[derive(Debug)]
pub struct Gradients<'a, T: Element> {
    /// `x_backprop`, the length of `x`.
    pub x: &'a mut [T],
    /// `scale_backprop`, `C` elements.
    pub scale: &'a mut [T::Stat],
    /// `offset_backprop`, `C` elements.
    pub offset: &'a mut [T::Stat],
}

/// The inputs of [`Problem::second_order`]: the gradient op's inputs and the upstream
/// gradients of its outputs.
#[derive(Clone, Copy, Debug)]
pub struct SecondOrderInputs<'a, T: Element> {
    /// The gradient op's `y_backprop` (the shape of x).
    pub y_backprop: &'a [T],
    /// The gradient op's `x`.
    pub x: &'a [T],
    /// The gradient op's `scale`, `C` elements.
    pub scale: &'a [T::Stat],
    /// The gradient op's `reserve_space_1/2` (read in inference only: training
    /// recomputes them from `x`, as TensorFlow does).
    pub reserve: Statistics<'a, T::Stat>,
    /// Upstream gradient of `x_backprop` (the shape of x).
    pub grad_x_backprop: &'a [T],
    /// Upstream gradient of `scale_backprop`, `C` elements.
    pub grad_scale_backprop: &'a [T::Stat],
    /// Upstream gradient of `offset_backprop`, `C` elements.
    pub grad_offset_backprop: &'a [T::Stat],
}

/// Where [`Problem::second_order`] writes its results: the gradients with respect to
/// the gradient op's inputs `y_backprop`, `x` and `scale`.
#[derive(Debug)]
pub struct SecondOrderGradients<'a, T: Element> {
    /// Gradient with respect to `y_backprop` (the length of x).
    pub y_backprop: &'a mut [T],
    /// Gradient with respect to `x` (the length of x).
    pub x: &'a mut [T],
    /// Gradient with respect to `scale`, `C` elements.
    pub scale: &'a mut [T::Stat],
}

/// The activation after the residual add of the Ex ops (TensorFlow's
/// `activation_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activation {
    /// No activation.
    #[default]
    Identity,
    /// `max(0, ·)`.
    Relu,
}

impl Activation {
    /// TensorFlow's name (`Identity`, `Relu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Activation::Identity => "Identity",
            Activation::Relu => "Relu",
        }
    }
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Activation {
    type Err = Error;
    /// Parses TensorFlow's names exactly.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "Identity" => Ok(Activation::Identity),
            "Relu" => Ok(Activation::Relu),
            _ => Err(Error::InvalidAttr {
                name: "activation_mode".into(),
                expected: "Identity or Relu".into(),
                found: s.into(),
            }),
        }
    }
}

/// One batch-normalization problem: where the channel axis is, the shape of `x` and
/// epsilon.
///
/// **Shapes** are always `x`'s own shape, in its own axis order: TensorFlow's
/// formats through [`Problem::new`] (`[N, H, W, C]` for NHWC, `[N, C, H, W]` for NCHW,
/// …), or any rank with the channel axis second (`[N, C, *]`, as candle and PyTorch
/// lay tensors out: [`Problem::channels_first`]) or last (`[N, *, C]`:
/// [`Problem::channels_last`]). Statistics run over every axis but the channel axis.
///
/// A `Problem` is validated once, when it is made; its methods then run the forward
/// pass or the gradient over caller-supplied slices.
///
/// ```
/// use fusedbn::{DataFormat, Problem};
/// let p = Problem::new(DataFormat::Nchw, &[2, 3, 4, 5])?.with_epsilon(1e-3);
/// assert_eq!(p.channels(), 3);
/// assert_eq!(p.elements_per_channel(), 2 * 4 * 5);
/// assert!(Problem::new(DataFormat::Nchw, &[2, 3, 4]).is_err()); // NCHW needs rank 4
/// // A candle/PyTorch `[N, C, L]` tensor: the same kernels, any rank.
/// let q = Problem::channels_first(&[8, 16, 100])?;
/// assert_eq!((q.channels(), q.elements_per_channel()), (16, 800));
/// # Ok::<(), fusedbn::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    format: Option<DataFormat>,
    channels_last: bool,
    shape: Vec<usize>,
    epsilon: f32,
    geometry: Geometry,
    isa: Isa,
}

impl Problem {
    /// A problem for `x` of the given shape in one of TensorFlow's formats (epsilon
    /// 1e-4).
    ///
    /// Fails when the rank does not match the format (4 for NHWC/NCHW, 5 for
    /// NDHWC/NCDHW) or the element count overflows.
    pub fn new(format: DataFormat, shape: &[usize]) -> Result<Self> {
        check_x_shape("x", format, shape)?;
        let mut p = Self::with_axis(shape, format.is_channels_last())?;
        p.format = Some(format);
        Ok(p)
    }

    /// A problem for `x = [N, C, *]` of any rank ≥ 2 (candle's and PyTorch's layout;
    /// rank 4 and 5 are NCHW and NCDHW).
    pub fn channels_first(shape: &[usize]) -> Result<Self> {
        Self::with_axis(shape, false)
    }

    /// A problem for `x = [N, *, C]` of any rank ≥ 2 (rank 4 and 5 are NHWC and
    /// NDHWC; also a channels-last tensor seen through a permuted `[N, C, *]` view).
    pub fn channels_last(shape: &[usize]) -> Result<Self> {
        Self::with_axis(shape, true)
    }

    fn with_axis(shape: &[usize], channels_last: bool) -> Result<Self> {
        if shape.len() < 2 {
            return Err(Error::arg(
                "x",
                "a tensor of rank 2 or more ([N, C, ...] or [N, ..., C])",
                format!("shape {shape:?} (rank {})", shape.len()),
            ));
        }
        // Every partial product of the dimensions must fit, also in an empty tensor
        // (`[0, 3, 2^33, 2^33]` has no elements but an H·W that overflows): checked on
        // the product of the nonzero dimensions, which bounds them all.
        let too_large = || Error::TooLarge {
            shape: shape.to_vec(),
        };
        shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(too_large)?;
        let (outer, c, inner) = if channels_last {
            let (rest, c) = shape.split_at(shape.len() - 1);
            (numel(rest).ok_or_else(too_large)?, c[0], 1)
        } else {
            (
                shape[0],
                shape[1],
                numel(&shape[2..]).ok_or_else(too_large)?,
            )
        };
        let format = DataFormat::ALL
            .into_iter()
            .find(|f| f.rank() == shape.len() && f.is_channels_last() == channels_last);
        Ok(Problem {
            format,
            channels_last,
            shape: shape.to_vec(),
            epsilon: DEFAULT_EPSILON,
            geometry: Geometry::new(outer, c, inner),
            isa: Isa::default_isa(),
        })
    }

    /// The same problem with another epsilon.
    pub fn with_epsilon(mut self, epsilon: f32) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// The same problem run with the kernels of another instruction set (the default
    /// is the best this CPU has, or `FUSEDBN_ISA`). Fails when the CPU lacks it.
    ///
    /// ```
    /// use fusedbn::{DataFormat, Isa, Problem};
    /// let p = Problem::new(DataFormat::Nhwc, &[1, 2, 2, 3])?.with_isa(Isa::Scalar)?;
    /// assert_eq!(p.isa(), Isa::Scalar);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        if !isa.is_supported() {
            return Err(Error::arg(
                "isa",
                format!(
                    "an instruction set this CPU supports ({})",
                    Isa::supported()
                        .iter()
                        .map(|i| i.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                isa.name(),
            ));
        }
        self.isa = isa;
        Ok(self)
    }

    /// The instruction set the kernels run with.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// TensorFlow's data format of `x`, when it has one (rank 4 or 5).
    pub fn format(&self) -> Option<DataFormat> {
        self.format
    }

    /// True when the channel axis is the last one.
    pub fn is_channels_last(&self) -> bool {
        self.channels_last
    }

    /// The shape of `x`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Epsilon, added to the variance before the reciprocal square root.
    pub fn epsilon(&self) -> f32 {
        self.epsilon
    }

    /// The channel count `C`.
    pub fn channels(&self) -> usize {
        self.geometry.channels
    }

    /// `M`, the number of elements per channel.
    pub fn elements_per_channel(&self) -> usize {
        self.geometry.per_channel()
    }

    /// The number of elements of `x`.
    pub fn len(&self) -> usize {
        self.geometry.len()
    }

    /// True when `x` has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The kernels' view of `x`: `[outer, C, inner]`.
    pub(crate) fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// `Ok` when `len == want`; the message (`what` formats the expectation) is built
    /// only on failure, so a call on a small tensor pays no allocation for it.
    fn check_len(
        &self,
        arg: &str,
        len: usize,
        want: usize,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        if len == want {
            Ok(())
        } else {
            Err(Error::arg(
                arg,
                format!("{want} elements ({})", what()),
                format!("{len} elements"),
            ))
        }
    }

    pub(crate) fn check_x(&self, arg: &str, len: usize) -> Result<()> {
        self.check_len(arg, len, self.len(), || format!("shape {:?}", self.shape()))
    }

    pub(crate) fn check_c(&self, arg: &str, len: usize) -> Result<()> {
        self.check_len(arg, len, self.channels(), || {
            "the channel count of x".into()
        })
    }
}
