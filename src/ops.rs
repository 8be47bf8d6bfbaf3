//! The TensorFlow-op layer: TF's op names, input and output names, attribute defaults,
//! validation order (SPEC §4) and dtype dispatch, over dynamically typed [`Tensor`]s.
//!
//! ```
//! use fusedbn::{Tensor, ops::{Attrs, Inputs, Op}};
//! let x = Tensor::new(vec![1, 1, 6, 1], vec![5.0f32, 7.0, 9.0, 11.0, 13.0, 15.0])?;
//! let (scale, offset) = (Tensor::vector(vec![4.0f32]), Tensor::vector(vec![2.0f32]));
//! let inputs = Inputs::new().with("x", &x).with("scale", &scale).with("offset", &offset);
//! let out = Op::FusedBatchNormV3.run(&inputs, &Attrs::new().epsilon(0.001))?;
//! assert_eq!(out.get("batch_mean").unwrap().as_slice::<f32>(), Some(&[10.0f32][..]));
//! assert_eq!(out.get("batch_variance").unwrap().as_slice::<f32>(), Some(&[14.0f32][..]));
//! assert_eq!(out.names().collect::<Vec<_>>(),
//!            ["y", "batch_mean", "batch_variance", "reserve_space_1", "reserve_space_2", "reserve_space_3"]);
//! # Ok::<(), fusedbn::Error>(())
//! ```

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::batch_norm::Problem;
use crate::batch_norm::{
    Activation, Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, Mode,
    RunningStats, SavedStats, SecondOrderGradients, SecondOrderInputs, Statistics, TrainingStats,
};
use crate::element::{Element, Real};
use crate::error::{Error, Result};
use crate::format::{check_x_shape, DataFormat, DEFAULT_EPSILON};
use crate::kernels::simd::Isa;
use crate::sync::{self, Collective};
use crate::tensor::{DType, Tensor};

/// `$f::<T>(args)` with `T` the element type of the run-time `$dtype`: the op layer's
/// one step from a [`Tensor`]'s dtype to the typed API (each arm a monomorphized call).
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
        }
    };
}

/// One of TensorFlow's fused batch-norm ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `FusedBatchNorm`: f32 only, 4-D.
    FusedBatchNorm,
    /// `FusedBatchNormV2`: `x` in f16, bf16 or f32 with f32 statistics, 4-D.
    FusedBatchNormV2,
    /// `FusedBatchNormV3`: as V2, also 5-D; adds `reserve_space_3`.
    FusedBatchNormV3,
    /// `FusedBatchNormGrad`: f32 only, 4-D.
    FusedBatchNormGrad,
    /// `FusedBatchNormGradV2`: as `FusedBatchNormV2`.
    FusedBatchNormGradV2,
    /// `FusedBatchNormGradV3`: as V2, also 5-D; takes `reserve_space_3`.
    FusedBatchNormGradV3,
    /// `FusedBatchNormEx` (TensorFlow's `_FusedBatchNormEx`): V3 plus an optional
    /// `side_input` and `activation_mode`: `y = act(bn(x) + side_input)`.
    FusedBatchNormEx,
    /// `FusedBatchNormGradEx`: the gradient of `FusedBatchNormEx`, masked by the
    /// forward `y` for ReLU; also returns `side_input_backprop`.
    FusedBatchNormGradEx,
    /// `FusedBatchNormGradGrad`: the gradient of `FusedBatchNormGrad` (f32).
    FusedBatchNormGradGrad,
    /// `FusedBatchNormGradGradV2`: the gradient of `FusedBatchNormGradV2`.
    FusedBatchNormGradGradV2,
    /// `FusedBatchNormGradGradV3`: the gradient of `FusedBatchNormGradV3`.
    FusedBatchNormGradGradV3,
}

const FORWARD_INPUTS: &[&str] = &["x", "scale", "offset", "mean", "variance"];
const GRAD_INPUTS: &[&str] = &[
    "y_backprop",
    "x",
    "scale",
    "reserve_space_1",
    "reserve_space_2",
];
const GRAD_V3_INPUTS: &[&str] = &[
    "y_backprop",
    "x",
    "scale",
    "reserve_space_1",
    "reserve_space_2",
    "reserve_space_3",
];
const FORWARD_OUTPUTS: &[&str] = &[
    "y",
    "batch_mean",
    "batch_variance",
    "reserve_space_1",
    "reserve_space_2",
];
const FORWARD_V3_OUTPUTS: &[&str] = &[
    "y",
    "batch_mean",
    "batch_variance",
    "reserve_space_1",
    "reserve_space_2",
    "reserve_space_3",
];
const GRAD_OUTPUTS: &[&str] = &[
    "x_backprop",
    "scale_backprop",
    "offset_backprop",
    "reserve_space_3",
    "reserve_space_4",
];
const GRAD_V3_OUTPUTS: &[&str] = &[
    "x_backprop",
    "scale_backprop",
    "offset_backprop",
    "reserve_space_4",
    "reserve_space_5",
];
const FORWARD_ATTRS: &[&str] = &[
    "epsilon",
    "data_format",
    "is_training",
    "exponential_avg_factor",
];
const GRAD_ATTRS: &[&str] = &["epsilon", "data_format", "is_training"];
const EX_INPUTS: &[&str] = &["x", "scale", "offset", "mean", "variance", "side_input"];
const GRAD_EX_INPUTS: &[&str] = &[
    "y_backprop",
    "x",
    "scale",
    "reserve_space_1",
    "reserve_space_2",
    "reserve_space_3",
    "offset",
    "y",
];
const GRAD_EX_OUTPUTS: &[&str] = &[
    "x_backprop",
    "scale_backprop",
    "offset_backprop",
    "reserve_space_4",
    "reserve_space_5",
    "side_input_backprop",
];
const EX_ATTRS: &[&str] = &[
    "epsilon",
    "data_format",
    "is_training",
    "exponential_avg_factor",
    "activation_mode",
];
const GRAD_EX_ATTRS: &[&str] = &["epsilon", "data_format", "is_training", "activation_mode"];
const GRAD_GRAD_INPUTS: &[&str] = &[
    "y_backprop",
    "x",
    "scale",
    "reserve_space_1",
    "reserve_space_2",
    "grad_x_backprop",
    "grad_scale_backprop",
    "grad_offset_backprop",
];
const GRAD_GRAD_V3_INPUTS: &[&str] = &[
    "y_backprop",
    "x",
    "scale",
    "reserve_space_1",
    "reserve_space_2",
    "reserve_space_3",
    "grad_x_backprop",
    "grad_scale_backprop",
    "grad_offset_backprop",
];
const GRAD_GRAD_OUTPUTS: &[&str] = &["grad_y_backprop", "grad_x", "grad_scale"];

impl Op {
    /// Every op, forward first.
    pub const ALL: [Op; 11] = [
        Op::FusedBatchNorm,
        Op::FusedBatchNormV2,
        Op::FusedBatchNormV3,
        Op::FusedBatchNormGrad,
        Op::FusedBatchNormGradV2,
        Op::FusedBatchNormGradV3,
        Op::FusedBatchNormEx,
        Op::FusedBatchNormGradEx,
        Op::FusedBatchNormGradGrad,
        Op::FusedBatchNormGradGradV2,
        Op::FusedBatchNormGradGradV3,
    ];

    /// TensorFlow's name of the op.
    pub fn name(self) -> &'static str {
        match self {
            Op::FusedBatchNorm => "FusedBatchNorm",
            Op::FusedBatchNormV2 => "FusedBatchNormV2",
            Op::FusedBatchNormV3 => "FusedBatchNormV3",
            Op::FusedBatchNormGrad => "FusedBatchNormGrad",
            Op::FusedBatchNormGradV2 => "FusedBatchNormGradV2",
            Op::FusedBatchNormGradV3 => "FusedBatchNormGradV3",
            Op::FusedBatchNormEx => "FusedBatchNormEx",
            Op::FusedBatchNormGradEx => "FusedBatchNormGradEx",
            Op::FusedBatchNormGradGrad => "FusedBatchNormGradGrad",
            Op::FusedBatchNormGradGradV2 => "FusedBatchNormGradGradV2",
            Op::FusedBatchNormGradGradV3 => "FusedBatchNormGradGradV3",
        }
    }

    /// True for the gradient ops.
    pub fn is_gradient(self) -> bool {
        matches!(
            self,
            Op::FusedBatchNormGrad
                | Op::FusedBatchNormGradV2
                | Op::FusedBatchNormGradV3
                | Op::FusedBatchNormGradEx
        ) || self.is_second_order()
    }

    /// 1, 2 or 3.
    pub fn version(self) -> u8 {
        match self {
            Op::FusedBatchNorm | Op::FusedBatchNormGrad | Op::FusedBatchNormGradGrad => 1,
            Op::FusedBatchNormV2 | Op::FusedBatchNormGradV2 | Op::FusedBatchNormGradGradV2 => 2,
            Op::FusedBatchNormV3
            | Op::FusedBatchNormGradV3
            | Op::FusedBatchNormEx
            | Op::FusedBatchNormGradEx
            | Op::FusedBatchNormGradGradV3 => 3,
        }
    }

    /// True for the second-order ops (the gradient of the gradient).
    pub fn is_second_order(self) -> bool {
        matches!(
            self,
            Op::FusedBatchNormGradGrad
                | Op::FusedBatchNormGradGradV2
                | Op::FusedBatchNormGradGradV3
        )
    }

    /// True for the Ex ops (side input and activation).
    pub fn is_ex(self) -> bool {
        matches!(self, Op::FusedBatchNormEx | Op::FusedBatchNormGradEx)
    }

    /// The op's input names, in TensorFlow's order.
    pub fn input_names(self) -> &'static [&'static str] {
        match self {
            Op::FusedBatchNormEx => return EX_INPUTS,
            Op::FusedBatchNormGradEx => return GRAD_EX_INPUTS,
            Op::FusedBatchNormGradGradV3 => return GRAD_GRAD_V3_INPUTS,
            Op::FusedBatchNormGradGrad | Op::FusedBatchNormGradGradV2 => return GRAD_GRAD_INPUTS,
            _ => {}
        }
        match (self.is_gradient(), self.version()) {
            (false, _) => FORWARD_INPUTS,
            (true, 3) => GRAD_V3_INPUTS,
            (true, _) => GRAD_INPUTS,
        }
    }

    /// The op's output names, in TensorFlow's order.
    pub fn output_names(self) -> &'static [&'static str] {
        if self == Op::FusedBatchNormGradEx {
            return GRAD_EX_OUTPUTS;
        }
        if self.is_second_order() {
            return GRAD_GRAD_OUTPUTS;
        }
        match (self.is_gradient(), self.version()) {
            (false, 3) => FORWARD_V3_OUTPUTS,
            (false, _) => FORWARD_OUTPUTS,
            (true, 3) => GRAD_V3_OUTPUTS,
            (true, _) => GRAD_OUTPUTS,
        }
    }

    /// The op's attribute names.
    pub fn attr_names(self) -> &'static [&'static str] {
        match self {
            Op::FusedBatchNormEx => return EX_ATTRS,
            Op::FusedBatchNormGradEx => return GRAD_EX_ATTRS,
            _ => {}
        }
        if self.is_gradient() {
            GRAD_ATTRS
        } else {
            FORWARD_ATTRS
        }
    }

    /// The element types `x` may have (f64 is this library's extension).
    pub fn dtypes(self) -> &'static [DType] {
        if self.version() == 1 {
            &[DType::F32, DType::F64]
        } else {
            &[DType::F16, DType::BF16, DType::F32, DType::F64]
        }
    }

    /// The data formats the op accepts (5-D formats need V3).
    pub fn formats(self) -> &'static [DataFormat] {
        if self.version() == 3 {
            &DataFormat::ALL
        } else {
            &DataFormat::ALL[..2]
        }
    }

    /// Runs the op on named inputs.
    ///
    /// Inputs the op does not need in the requested mode may be omitted: `mean` and
    /// `variance` in training with `exponential_avg_factor == 1`, and
    /// `reserve_space_3` of the V3 gradient (its content is never read).
    /// Outputs come back under TensorFlow's names, in TensorFlow's order.
    pub fn run(self, inputs: &Inputs<'_>, attrs: &Attrs) -> Result<Outputs> {
        self.run_with_isa(inputs, attrs, Isa::default_isa())
    }

    /// [`Op::run`] with the kernels of instruction set `isa` (fails when this CPU
    /// lacks it); the results are those of [`Op::run`] up to the ISA's rounding.
    ///
    /// ```
    /// use fusedbn::{Isa, Tensor, ops::{Attrs, Inputs, Op}};
    /// let x = Tensor::new(vec![1, 1, 4, 1], vec![1.0f32, 2.0, 3.0, 4.0])?;
    /// let (scale, offset) = (Tensor::vector(vec![1.0f32]), Tensor::vector(vec![0.0f32]));
    /// let inputs = Inputs::new().with("x", &x).with("scale", &scale).with("offset", &offset);
    /// let out = Op::FusedBatchNormV3.run_with_isa(&inputs, &Attrs::new(), Isa::Scalar)?;
    /// assert_eq!(out.get("batch_mean").unwrap().as_slice::<f32>(), Some(&[2.5f32][..]));
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn run_with_isa(self, inputs: &Inputs<'_>, attrs: &Attrs, isa: Isa) -> Result<Outputs> {
        self.run_on(inputs, attrs, &Backend::Cpu(isa))
    }

    /// [`Op::run`] on a [`Backend`]: the CPU with an instruction set, or (feature
    /// `cuda`) a GPU. Validation, empty-tensor rules and outputs are the same; the
    /// second-order ops run on the CPU only.
    pub fn run_on(self, inputs: &Inputs<'_>, attrs: &Attrs, backend: &Backend) -> Result<Outputs> {
        self.run_in(inputs, attrs, backend, None)
    }

    /// [`Op::run`] on this rank's shard of a batch split across the ranks of `comm`
    /// (see [`crate::sync`]): the training forward ops (V1–V3, Ex) normalize with the
    /// statistics of the whole batch, and the training gradient ops (V1–V3, Ex) use the
    /// sums over the whole batch. `y` / `x_backprop` / `side_input_backprop` are this
    /// rank's shard; the per-channel outputs (batch statistics, reserve spaces,
    /// `scale_backprop`, `offset_backprop`) are global and bit-identical on every rank.
    /// Inference ops need no communication and run locally (after the agreement
    /// check); the second-order ops in training are not synchronized and fail.
    ///
    /// Every rank must call it with the same op; a rank whose inputs fail validation,
    /// or ranks that disagree on the op, mode, channel count, epsilon, layout or element
    /// type, make it fail on every rank (one small collective before the data ones).
    /// With [`crate::sync::SingleProcess`] the results are bit-identical to
    /// [`Op::run`].
    ///
    /// ```
    /// use fusedbn::{Tensor, ops::{Attrs, Inputs, Op}, sync::SingleProcess};
    /// let x = Tensor::new(vec![1, 1, 6, 1], vec![5.0f32, 7.0, 9.0, 11.0, 13.0, 15.0])?;
    /// let (scale, offset) = (Tensor::vector(vec![4.0f32]), Tensor::vector(vec![2.0f32]));
    /// let inputs = Inputs::new().with("x", &x).with("scale", &scale).with("offset", &offset);
    /// let attrs = Attrs::new().epsilon(0.001);
    /// let out = Op::FusedBatchNormV3.run_sync(&inputs, &attrs, &SingleProcess)?;
    /// assert_eq!(out, Op::FusedBatchNormV3.run(&inputs, &attrs)?);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn run_sync(
        self,
        inputs: &Inputs<'_>,
        attrs: &Attrs,
        comm: &dyn Collective,
    ) -> Result<Outputs> {
        let tag = Op::ALL
            .iter()
            .position(|&o| o == self)
            .map_or(0, |i| i as u8 + 1);
        let synchronized = attrs.is_training && !self.is_second_order();
        if !synchronized {
            let result = if self.is_second_order() && attrs.is_training {
                Err(Error::arg(
                    "is_training",
                    format!("false for {self} when synchronized (its training statistics are not synchronized; run it without synchronization)"),
                    "true",
                ))
            } else {
                self.run_with_isa(inputs, attrs, Isa::default_isa())
            };
            let d = sync::Descriptor {
                kind: sync::KIND_LOCAL,
                op: tag,
                training: attrs.is_training,
                ..Default::default()
            };
            let local = result.as_ref().map(|_| ()).map_err(Clone::clone);
            sync::agree(comm, &d, local)?;
            return result;
        }
        let ctx = SyncCtx {
            comm,
            op: tag,
            joined: Cell::new(false),
        };
        let cpu = Backend::Cpu(Isa::default_isa());
        let result = self.run_in(inputs, attrs, &cpu, Some(&ctx));
        match result {
            Err(e) if !ctx.joined.get() => Err(sync::fail_step(comm, e)),
            r => r,
        }
    }

    fn run_in(
        self,
        inputs: &Inputs<'_>,
        attrs: &Attrs,
        backend: &Backend,
        sync: Option<&SyncCtx<'_>>,
    ) -> Result<Outputs> {
        for (name, _) in &inputs.entries {
            if !self.input_names().contains(&name.as_str()) {
                return Err(Error::UnknownInput {
                    op: self.name().into(),
                    name: name.clone(),
                    expected: self.input_names().join(", "),
                });
            }
        }
        if !self.formats().contains(&attrs.data_format) {
            return Err(Error::arg(
                "data_format",
                format!(
                    "NHWC or NCHW for {} (5-D formats need the V3 op)",
                    self.name()
                ),
                attrs.data_format.as_str(),
            ));
        }
        if self.is_second_order() {
            match backend {
                Backend::Cpu(isa) => self.run_second_order(inputs, attrs, *isa),
                #[cfg(feature = "cuda")]
                Backend::Cuda(_) => Err(Error::arg(
                    "backend",
                    "the CPU for the second-order ops",
                    "CUDA",
                )),
            }
        } else if self.is_gradient() {
            self.run_gradient(inputs, attrs, backend, sync)
        } else {
            self.run_forward(inputs, attrs, backend, sync)
        }
    }

    fn required<'a>(self, inputs: &Inputs<'a>, name: &str, why: &str) -> Result<&'a Tensor> {
        inputs.get(name).ok_or_else(|| Error::MissingInput {
            op: self.name().into(),
            name: name.into(),
            why: why.into(),
        })
    }

    fn run_forward(
        self,
        inputs: &Inputs<'_>,
        attrs: &Attrs,
        backend: &Backend,
        sync: Option<&SyncCtx<'_>>,
    ) -> Result<Outputs> {
        let x = self.required(inputs, "x", "always required")?;
        let scale = self.required(inputs, "scale", "always required")?;
        let offset = self.required(inputs, "offset", "always required")?;
        let needs_stats = !attrs.is_training || attrs.exponential_avg_factor != 1.0;
        let why = if attrs.is_training {
            "required when exponential_avg_factor != 1"
        } else {
            "required in inference"
        };
        let (mean, variance) = if needs_stats {
            (
                Some(self.required(inputs, "mean", why)?),
                Some(self.required(inputs, "variance", why)?),
            )
        } else {
            (inputs.get("mean"), inputs.get("variance"))
        };
        let side = inputs.get("side_input");
        // §4 rules 1-2: ranks.
        check_x_shape("x", attrs.data_format, x.shape())?;
        check_vector("scale", scale)?;
        check_vector("offset", offset)?;
        for (name, t) in [("mean", mean), ("variance", variance)] {
            if let Some(t) = t {
                check_vector(name, t)?;
            }
        }
        // Rules 3-4: sizes.
        let problem = Problem::new(attrs.data_format, x.shape())?
            .with_epsilon(attrs.epsilon)
            .with_isa(backend.isa())?;
        let c = problem.channels();
        check_channels("scale", scale, c)?;
        check_channels("offset", offset, c)?;
        if needs_stats {
            for (name, t) in [("mean", mean), ("variance", variance)] {
                if let Some(t) = t {
                    check_channels_because(name, t, c, why)?;
                }
            }
        }
        if let Some(side) = side {
            check_same_shape("side_input", side, x)?;
        }
        // Rule 7: element types.
        self.check_dtype("x", x)?;
        let u = stat_dtype(x.dtype());
        for (name, t) in [
            ("scale", Some(scale)),
            ("offset", Some(offset)),
            ("mean", mean),
            ("variance", variance),
        ] {
            if let Some(t) = t {
                check_stat_dtype(name, t, u)?;
            }
        }
        if let Some(side) = side {
            check_same_dtype("side_input", side, x)?;
        }
        // Rule 8: in training, a side input needs the ReLU (TensorFlow's rule).
        if attrs.is_training && side.is_some() && attrs.activation_mode != Activation::Relu {
            return Err(Error::arg(
                "activation_mode",
                "Relu when a side_input is given in training",
                attrs.activation_mode.as_str(),
            ));
        }
        let ex = Ex {
            side,
            act: if self.is_ex() {
                attrs.activation_mode
            } else {
                Activation::Identity
            },
        };
        let stats = if needs_stats {
            mean.zip(variance)
        } else {
            None
        };
        let mut out = by_dtype!(
            x.dtype(),
            forward(
                &problem,
                [x, scale, offset],
                stats,
                ex,
                (attrs, backend),
                sync
            )
        )?;
        if self.version() == 3 {
            out.push(Tensor::empty(u));
        }
        Ok(Outputs::new(self, out))
    }

    fn run_gradient(
        self,
        inputs: &Inputs<'_>,
        attrs: &Attrs,
        backend: &Backend,
        sync: Option<&SyncCtx<'_>>,
    ) -> Result<Outputs> {
        let dy = self.required(inputs, "y_backprop", "always required")?;
        let x = self.required(inputs, "x", "always required")?;
        let scale = self.required(inputs, "scale", "always required")?;
        let rs1 = self.required(inputs, "reserve_space_1", "always required")?;
        let rs2 = self.required(inputs, "reserve_space_2", "always required")?;
        let rs3 = inputs.get("reserve_space_3");
        let (offset, y) = if self.is_ex() {
            let why = "required by FusedBatchNormGradEx";
            (
                Some(self.required(inputs, "offset", why)?),
                Some(self.required(inputs, "y", why)?),
            )
        } else {
            (None, None)
        };
        // §4 rules 1-2: ranks.
        check_x_shape("y_backprop", attrs.data_format, dy.shape())?;
        check_x_shape("x", attrs.data_format, x.shape())?;
        check_vector("scale", scale)?;
        if let Some(offset) = offset {
            check_vector("offset", offset)?;
        }
        check_vector("reserve_space_1", rs1)?;
        check_vector("reserve_space_2", rs2)?;
        if let Some(t) = rs3 {
            // TensorFlow's CPU V3 forward returns a rank-0 reserve_space_3; accept it.
            if t.rank() > 1 {
                return Err(Error::arg(
                    "reserve_space_3",
                    "a 1-D tensor (or TensorFlow's scalar placeholder)",
                    format!("shape {:?}", t.shape()),
                ));
            }
        }
        // Rules 3 and 5: sizes.
        let problem = Problem::new(attrs.data_format, x.shape())?
            .with_epsilon(attrs.epsilon)
            .with_isa(backend.isa())?;
        let c = problem.channels();
        check_channels("scale", scale, c)?;
        if dy.shape() != x.shape() {
            return Err(Error::arg(
                "y_backprop",
                format!("the shape of x, {:?}", x.shape()),
                format!("shape {:?}", dy.shape()),
            ));
        }
        check_channels("reserve_space_1", rs1, c)?;
        check_channels("reserve_space_2", rs2, c)?;
        if let Some(offset) = offset {
            check_channels("offset", offset, c)?;
        }
        if let Some(y) = y {
            check_same_shape("y", y, x)?;
        }
        // Rule 7: element types.
        self.check_dtype("y_backprop", dy)?;
        if x.dtype() != dy.dtype() {
            return Err(Error::arg(
                "x",
                format!("the element type of y_backprop ({})", dy.dtype()),
                x.dtype().to_string(),
            ));
        }
        let u = stat_dtype(x.dtype());
        for (name, t) in [
            ("scale", Some(scale)),
            ("reserve_space_1", Some(rs1)),
            ("reserve_space_2", Some(rs2)),
            ("reserve_space_3", rs3),
            ("offset", offset),
        ] {
            if let Some(t) = t {
                check_stat_dtype(name, t, u)?;
            }
        }
        if let Some(y) = y {
            check_same_dtype("y", y, x)?;
        }
        // The ReLU mask is the forward output; the Ex gradient also returns dy (masked)
        // as the side input's gradient.
        let ex = GradEx {
            mask: y.filter(|_| attrs.activation_mode == Activation::Relu),
            side_grad: self.is_ex(),
        };
        let mut out = by_dtype!(
            x.dtype(),
            gradient(
                &problem,
                [dy, x, scale, rs1, rs2],
                ex,
                (attrs, backend),
                sync
            )
        )?;
        let side_grad = if self.is_ex() { out.pop() } else { None };
        out.push(Tensor::empty(u));
        out.push(Tensor::empty(u));
        out.extend(side_grad);
        Ok(Outputs::new(self, out))
    }

    fn run_second_order(self, inputs: &Inputs<'_>, attrs: &Attrs, isa: Isa) -> Result<Outputs> {
        let req = |name: &str| self.required(inputs, name, "always required");
        let (dy, x, scale) = (req("y_backprop")?, req("x")?, req("scale")?);
        let (rs1, rs2) = (req("reserve_space_1")?, req("reserve_space_2")?);
        let ga = req("grad_x_backprop")?;
        let (gs, go) = (req("grad_scale_backprop")?, req("grad_offset_backprop")?);
        // §4 rules 1-2: ranks.
        check_x_shape("y_backprop", attrs.data_format, dy.shape())?;
        check_x_shape("x", attrs.data_format, x.shape())?;
        check_x_shape("grad_x_backprop", attrs.data_format, ga.shape())?;
        for (name, t) in [
            ("scale", scale),
            ("reserve_space_1", rs1),
            ("reserve_space_2", rs2),
            ("grad_scale_backprop", gs),
            ("grad_offset_backprop", go),
        ] {
            check_vector(name, t)?;
        }
        // Rules 3 and 5: sizes.
        let problem = Problem::new(attrs.data_format, x.shape())?
            .with_epsilon(attrs.epsilon)
            .with_isa(isa)?;
        let c = problem.channels();
        check_same_shape("y_backprop", dy, x)?;
        check_same_shape("grad_x_backprop", ga, x)?;
        for (name, t) in [
            ("scale", scale),
            ("reserve_space_1", rs1),
            ("reserve_space_2", rs2),
            ("grad_scale_backprop", gs),
            ("grad_offset_backprop", go),
        ] {
            check_channels(name, t, c)?;
        }
        // Rule 7: element types.
        self.check_dtype("y_backprop", dy)?;
        check_same_dtype("x", x, dy)?;
        check_same_dtype("grad_x_backprop", ga, dy)?;
        let u = stat_dtype(x.dtype());
        for (name, t) in [
            ("scale", scale),
            ("reserve_space_1", rs1),
            ("reserve_space_2", rs2),
            ("grad_scale_backprop", gs),
            ("grad_offset_backprop", go),
        ] {
            check_stat_dtype(name, t, u)?;
        }
        let args = [dy, x, scale, rs1, rs2, ga, gs, go];
        let out = by_dtype!(x.dtype(), second_order(&problem, args, attrs.is_training))?;
        Ok(Outputs::new(self, out))
    }

    fn check_dtype(self, arg: &str, t: &Tensor) -> Result<()> {
        if self.dtypes().contains(&t.dtype()) {
            return Ok(());
        }
        let names: Vec<String> = self.dtypes().iter().map(|d| d.to_string()).collect();
        let hint = if self.version() == 1 {
            " (half types need the V2 or V3 op)"
        } else {
            ""
        };
        Err(Error::arg(
            arg,
            format!(
                "element type {} for {}{hint}",
                names.join(", "),
                self.name()
            ),
            t.dtype().to_string(),
        ))
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Op {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Op::ALL
            .into_iter()
            .find(|op| op.name() == s)
            .ok_or_else(|| Error::UnknownOp {
                found: s.to_string(),
                expected: Op::ALL.map(Op::name).join(", "),
            })
    }
}

/// The statistics type `U` for data of type `t`.
fn stat_dtype(t: DType) -> DType {
    if t == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn check_vector(arg: &str, t: &Tensor) -> Result<()> {
    if t.rank() == 1 {
        Ok(())
    } else {
        Err(Error::arg(
            arg,
            "a 1-D tensor",
            format!("shape {:?}", t.shape()),
        ))
    }
}

fn check_channels(arg: &str, t: &Tensor, c: usize) -> Result<()> {
    check_channels_because(arg, t, c, "")
}

fn check_channels_because(arg: &str, t: &Tensor, c: usize, why: &str) -> Result<()> {
    if t.numel() == c {
        return Ok(());
    }
    let why = if why.is_empty() {
        String::new()
    } else {
        format!(", {why}")
    };
    Err(Error::arg(
        arg,
        format!("{c} elements (the channel count of x{why})"),
        format!("shape {:?}", t.shape()),
    ))
}

fn check_same_shape(arg: &str, t: &Tensor, x: &Tensor) -> Result<()> {
    if t.shape() == x.shape() {
        Ok(())
    } else {
        Err(Error::arg(
            arg,
            format!("the shape of x, {:?}", x.shape()),
            format!("shape {:?}", t.shape()),
        ))
    }
}

fn check_same_dtype(arg: &str, t: &Tensor, x: &Tensor) -> Result<()> {
    if t.dtype() == x.dtype() {
        Ok(())
    } else {
        Err(Error::arg(
            arg,
            format!("the element type of x ({})", x.dtype()),
            t.dtype().to_string(),
        ))
    }
}

fn check_stat_dtype(arg: &str, t: &Tensor, u: DType) -> Result<()> {
    if t.dtype() == u {
        Ok(())
    } else {
        Err(Error::arg(
            arg,
            format!("element type {u} (the statistics type for this x)"),
            t.dtype().to_string(),
        ))
    }
}

/// Borrows `t` as `T`; the dtype has been checked by the caller.
fn typed<T: Element>(t: &Tensor) -> Result<&[T]> {
    t.as_slice::<T>()
        .ok_or_else(|| Error::arg("tensor", T::DTYPE.to_string(), t.dtype().to_string()))
}

/// The Ex parts of a forward op: side input and activation.
#[derive(Clone, Copy)]
struct Ex<'a> {
    side: Option<&'a Tensor>,
    act: Activation,
}

/// What a synchronized op run needs: the collective, the op's tag for the agreement
/// check, and whether this rank has taken part in it yet.
struct SyncCtx<'a> {
    comm: &'a dyn Collective,
    op: u8,
    joined: Cell<bool>,
}

/// `[x, scale, offset]` → `[y, batch_mean, batch_variance, reserve_space_1,
/// reserve_space_2]`.
fn forward<T: Element>(
    p: &Problem,
    [x, scale, offset]: [&Tensor; 3],
    stats: Option<(&Tensor, &Tensor)>,
    ex: Ex<'_>,
    (attrs, backend): (&Attrs, &Backend),
    sync: Option<&SyncCtx<'_>>,
) -> Result<Vec<Tensor>> {
    let side = match ex.side {
        Some(t) => Some(typed::<T>(t)?),
        None => None,
    };
    let c = p.channels();
    let zero = T::Stat::ZERO;
    let (xs, scale, offset) = (
        typed::<T>(x)?,
        typed::<T::Stat>(scale)?,
        typed::<T::Stat>(offset)?,
    );
    let epilogue = Epilogue {
        side_input: side,
        activation: ex.act,
    };
    let mut y = vec![T::default(); xs.len()];
    let (mut batch_mean, mut batch_var) = (vec![zero; c], vec![zero; c]);
    let (mut rs1, mut rs2) = (vec![zero; c], vec![zero; c]);
    if attrs.is_training {
        if let Some((m, v)) = stats {
            batch_mean.copy_from_slice(typed::<T::Stat>(m)?);
            batch_var.copy_from_slice(typed::<T::Stat>(v)?);
        }
        let stats = TrainingStats {
            saved: SavedStats {
                mean: &mut rs1,
                variance: &mut rs2,
            },
            running: Some(RunningStats {
                mean: &mut batch_mean,
                variance: &mut batch_var,
                factor: attrs.exponential_avg_factor,
            }),
        };
        let affine = Affine { scale, offset };
        match sync {
            Some(ctx) => {
                ctx.joined.set(true);
                p.forward_sync_as(ctx.comm, ctx.op, xs, affine, stats, epilogue, &mut y)?;
            }
            None => backend.forward(p, xs, affine, Forward::Training(stats), epilogue, &mut y)?,
        }
    } else {
        let (m, v) = stats.ok_or_else(|| Error::arg("mean", "a tensor in inference", "none"))?;
        let (m, v) = (typed::<T::Stat>(m)?, typed::<T::Stat>(v)?);
        backend.forward(
            p,
            xs,
            Affine { scale, offset },
            Forward::Inference(Statistics {
                mean: m,
                variance: v,
            }),
            epilogue,
            &mut y,
        )?;
        if p.is_empty() {
            let nan = T::Stat::from_f64(f64::NAN);
            batch_mean.fill(nan);
            batch_var.fill(nan);
        } else {
            batch_mean.copy_from_slice(m);
            batch_var.copy_from_slice(v);
        }
        rs1.copy_from_slice(&batch_mean);
        rs2.copy_from_slice(&batch_var);
    }
    Ok(vec![
        Tensor::new(x.shape().to_vec(), y)?,
        Tensor::vector(batch_mean),
        Tensor::vector(batch_var),
        Tensor::vector(rs1),
        Tensor::vector(rs2),
    ])
}

/// The Ex parts of a gradient op: the ReLU mask and whether to return the side
/// input's gradient.
#[derive(Clone, Copy)]
struct GradEx<'a> {
    mask: Option<&'a Tensor>,
    side_grad: bool,
}

/// `[y_backprop, x, scale, reserve_space_1, reserve_space_2]` → `[x_backprop,
/// scale_backprop, offset_backprop(, side_input_backprop)]`.
fn gradient<T: Element>(
    p: &Problem,
    args: [&Tensor; 5],
    ex: GradEx<'_>,
    (attrs, backend): (&Attrs, &Backend),
    sync: Option<&SyncCtx<'_>>,
) -> Result<Vec<Tensor>> {
    let [dy, x, scale, rs1, rs2] = args;
    let mask = match ex.mask {
        Some(t) => Some(typed::<T>(t)?),
        None => None,
    };
    let mut side_grad = if ex.side_grad {
        vec![T::default(); x.numel()]
    } else {
        Vec::new()
    };
    let side_out = if ex.side_grad {
        Some(&mut side_grad[..])
    } else {
        None
    };
    let c = p.channels();
    let (dys, xs) = (typed::<T>(dy)?, typed::<T>(x)?);
    let (scale, rs1, rs2) = (
        typed::<T::Stat>(scale)?,
        typed::<T::Stat>(rs1)?,
        typed::<T::Stat>(rs2)?,
    );
    let mut dx = vec![T::default(); xs.len()];
    let (mut dscale, mut doffset) = (vec![T::Stat::ZERO; c], vec![T::Stat::ZERO; c]);
    let grads = Gradients {
        x: &mut dx,
        scale: &mut dscale,
        offset: &mut doffset,
    };
    let stats = Statistics {
        mean: rs1,
        variance: rs2,
    };
    let epilogue = GradEpilogue {
        relu_output: mask,
        side_input_backprop: side_out,
    };
    let inputs = GradInputs {
        y_backprop: dys,
        x: xs,
    };
    match sync {
        Some(ctx) if attrs.is_training => {
            ctx.joined.set(true);
            p.backward_sync_as(ctx.comm, ctx.op, inputs, scale, stats, epilogue, grads)?;
        }
        _ => {
            let mode = if attrs.is_training {
                Backward::Training(stats)
            } else {
                Backward::Inference(stats)
            };
            backend.backward(p, inputs, scale, mode, epilogue, grads)?;
        }
    }
    let mut out = vec![
        Tensor::new(x.shape().to_vec(), dx)?,
        Tensor::vector(dscale),
        Tensor::vector(doffset),
    ];
    if ex.side_grad {
        out.push(Tensor::new(x.shape().to_vec(), side_grad)?);
    }
    Ok(out)
}

/// `[y_backprop, x, scale, rs1, rs2, grad_x_backprop, grad_scale_backprop,
/// grad_offset_backprop]` → `[grad_y_backprop, grad_x, grad_scale]`.
fn second_order<T: Element>(
    p: &Problem,
    args: [&Tensor; 8],
    is_training: bool,
) -> Result<Vec<Tensor>> {
    let [dy, x, scale, rs1, rs2, ga, gs, go] = args;
    let n = x.numel();
    let (mut dg, mut dx) = (vec![T::default(); n], vec![T::default(); n]);
    let mut dscale = vec![T::Stat::ZERO; p.channels()];
    let inputs = SecondOrderInputs {
        y_backprop: typed::<T>(dy)?,
        x: typed::<T>(x)?,
        scale: typed::<T::Stat>(scale)?,
        reserve: Statistics {
            mean: typed::<T::Stat>(rs1)?,
            variance: typed::<T::Stat>(rs2)?,
        },
        grad_x_backprop: typed::<T>(ga)?,
        grad_scale_backprop: typed::<T::Stat>(gs)?,
        grad_offset_backprop: typed::<T::Stat>(go)?,
    };
    let mode = if is_training {
        Mode::Training
    } else {
        Mode::Inference
    };
    p.second_order(
        inputs,
        mode,
        SecondOrderGradients {
            y_backprop: &mut dg,
            x: &mut dx,
            scale: &mut dscale,
        },
    )?;
    Ok(vec![
        Tensor::new(x.shape().to_vec(), dg)?,
        Tensor::new(x.shape().to_vec(), dx)?,
        Tensor::vector(dscale),
    ])
}

/// Where an op runs: the CPU with an instruction set, or (feature `cuda`) a GPU.
#[derive(Clone, Debug)]
pub enum Backend {
    /// The CPU kernels of an instruction set.
    Cpu(Isa),
    /// A GPU ([`crate::cuda`]): inputs are copied to it and the outputs back.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::Gpu),
}

impl Default for Backend {
    fn default() -> Self {
        Backend::Cpu(Isa::default_isa())
    }
}

impl Backend {
    /// The CPU instruction set of the problem (the best one when on a GPU).
    fn isa(&self) -> Isa {
        match self {
            Backend::Cpu(isa) => *isa,
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Isa::default_isa(),
        }
    }

    fn forward<T: Element>(
        &self,
        p: &Problem,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        mode: Forward<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &mut [T],
    ) -> Result<()> {
        match self {
            Backend::Cpu(_) => p.forward(x, affine, mode, epilogue, y),
            #[cfg(feature = "cuda")]
            Backend::Cuda(gpu) => gpu.forward(p, x, affine, mode, epilogue, y),
        }
    }

    fn backward<T: Element>(
        &self,
        p: &Problem,
        inputs: GradInputs<'_, T>,
        scale: &[T::Stat],
        mode: Backward<'_, T::Stat>,
        epilogue: GradEpilogue<'_, T>,
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        match self {
            Backend::Cpu(_) => p.backward(inputs, scale, mode, epilogue, grads),
            #[cfg(feature = "cuda")]
            Backend::Cuda(gpu) => gpu.backward(p, inputs, scale, mode, epilogue, grads),
        }
    }
}

/// The ops' attributes, with TensorFlow's defaults; built with chained setters.
///
/// ```
/// use fusedbn::{DataFormat, ops::Attrs};
/// let a = Attrs::new().epsilon(1e-3).data_format(DataFormat::Nchw).is_training(false);
/// assert_eq!(a.exponential_avg_factor, 1.0);
/// let mut b = Attrs::default();
/// b.set("data_format", "NCHW")?;
/// b.set("epsilon", "0.001")?;
/// b.set("is_training", "false")?;
/// assert_eq!(a, b);
/// assert!(b.set("is_training", "yes").is_err());
/// # Ok::<(), fusedbn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attrs {
    /// Added to the variance before the reciprocal square root (default 1e-4).
    pub epsilon: f32,
    /// Layout of `x` (default NHWC).
    pub data_format: DataFormat,
    /// Training (batch statistics) or inference (given statistics); default true.
    pub is_training: bool,
    /// Weight of the batch statistics in the running averages (default 1: replace).
    /// Forward ops only.
    pub exponential_avg_factor: f32,
    /// The activation of the Ex ops (default Identity).
    pub activation_mode: Activation,
}

impl Default for Attrs {
    fn default() -> Self {
        Attrs {
            epsilon: DEFAULT_EPSILON,
            data_format: DataFormat::Nhwc,
            is_training: true,
            exponential_avg_factor: 1.0,
            activation_mode: Activation::Identity,
        }
    }
}

impl Attrs {
    /// TensorFlow's defaults: epsilon 1e-4, NHWC, training, factor 1.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `epsilon`.
    pub fn epsilon(mut self, v: f32) -> Self {
        self.epsilon = v;
        self
    }

    /// Sets `data_format`.
    pub fn data_format(mut self, v: DataFormat) -> Self {
        self.data_format = v;
        self
    }

    /// Sets `is_training`.
    pub fn is_training(mut self, v: bool) -> Self {
        self.is_training = v;
        self
    }

    /// Sets `exponential_avg_factor`.
    pub fn exponential_avg_factor(mut self, v: f32) -> Self {
        self.exponential_avg_factor = v;
        self
    }

    /// Sets `activation_mode` (Ex ops).
    pub fn activation_mode(mut self, v: Activation) -> Self {
        self.activation_mode = v;
        self
    }

    /// Sets an attribute from its TensorFlow name and a string value
    /// (`is_training` takes `true`/`false`, numbers are decimal).
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        let bad = |expected: &str| Error::InvalidAttr {
            name: name.into(),
            expected: expected.into(),
            found: value.into(),
        };
        match name {
            "epsilon" => self.epsilon = value.parse().map_err(|_| bad("a number"))?,
            "exponential_avg_factor" => {
                self.exponential_avg_factor = value.parse().map_err(|_| bad("a number"))?
            }
            "is_training" => {
                self.is_training = match value {
                    "true" => true,
                    "false" => false,
                    _ => return Err(bad("true or false")),
                }
            }
            "activation_mode" => {
                self.activation_mode = value.parse().map_err(|_| bad("Identity or Relu"))?
            }
            "data_format" => {
                self.data_format = value
                    .parse()
                    .map_err(|_| bad("one of NHWC, NCHW, NDHWC, NCDHW"))?
            }
            _ => {
                return Err(Error::InvalidAttr {
                    name: name.into(),
                    expected: format!("an attribute name: {}", EX_ATTRS.join(", ")),
                    found: value.into(),
                })
            }
        }
        Ok(())
    }
}

/// Named input tensors, borrowed.
#[derive(Clone, Debug, Default)]
pub struct Inputs<'a> {
    entries: Vec<(String, &'a Tensor)>,
}

impl<'a> Inputs<'a> {
    /// No inputs.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the input `name`.
    pub fn with(mut self, name: &str, t: &'a Tensor) -> Self {
        self.insert(name, t);
        self
    }

    /// Adds (or replaces) the input `name`.
    pub fn insert(&mut self, name: &str, t: &'a Tensor) {
        self.entries.retain(|(n, _)| n != name);
        self.entries.push((name.to_string(), t));
    }

    /// The input `name`, if given.
    pub fn get(&self, name: &str) -> Option<&'a Tensor> {
        self.entries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| *t)
    }
}

/// An op's outputs, under TensorFlow's names and in TensorFlow's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Outputs {
    entries: Vec<(&'static str, Tensor)>,
}

impl Outputs {
    fn new(op: Op, tensors: Vec<Tensor>) -> Self {
        debug_assert_eq!(tensors.len(), op.output_names().len());
        Outputs {
            entries: op.output_names().iter().copied().zip(tensors).collect(),
        }
    }

    /// The outputs of `op` from tensors in the op's output order
    /// ([`Op::output_names`]): for outputs computed elsewhere (the typed layer, a file)
    /// to be checked like the op's own (`fusedbn::driver::check`). Fails when the count
    /// is not the op's number of outputs; the tensors' shapes are not checked here.
    ///
    /// ```
    /// use fusedbn::{DType, Tensor, ops::{Op, Outputs}};
    /// let x_backprop = Tensor::new(vec![1, 1, 2, 1], vec![0.5f32, -0.5])?;
    /// let (ds, db) = (Tensor::vector(vec![1.0f32]), Tensor::vector(vec![0.0f32]));
    /// let empty = Tensor::empty(DType::F32);
    /// let out = Outputs::from_tensors(
    ///     Op::FusedBatchNormGradV3,
    ///     vec![x_backprop, ds, db, empty.clone(), empty.clone()],
    /// )?;
    /// assert_eq!(out.get("offset_backprop").unwrap().as_slice::<f32>(), Some(&[0.0f32][..]));
    /// assert!(Outputs::from_tensors(Op::FusedBatchNormGradV3, vec![empty]).is_err());
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn from_tensors(op: Op, tensors: Vec<Tensor>) -> Result<Self> {
        let names = op.output_names();
        if tensors.len() != names.len() {
            return Err(Error::arg(
                "outputs",
                format!(
                    "{} tensors for {} ({})",
                    names.len(),
                    op.name(),
                    names.join(", ")
                ),
                tensors.len().to_string(),
            ));
        }
        Ok(Outputs::new(op, tensors))
    }

    /// The output `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.entries
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| t)
    }

    /// The output names, in order.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.entries.iter().map(|(n, _)| *n)
    }

    /// `(name, tensor)` pairs, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &Tensor)> {
        self.entries.iter().map(|(n, t)| (*n, t))
    }

    /// Consumes the outputs, returning `(name, tensor)` pairs in order.
    pub fn into_vec(self) -> Vec<(&'static str, Tensor)> {
        self.entries
    }
}
