//! The problem description every layer speaks: data format, shape of `x`, epsilon.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::kernels::simd::Isa;
use crate::kernels::Geometry;
use crate::tensor::numel;

/// Memory layout of `x`. The channel axis is the reduction's odd one out: statistics
/// run over every other axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DataFormat {
    /// `[N, H, W, C]` (TensorFlow's default).
    #[default]
    Nhwc,
    /// `[N, C, H, W]`.
    Nchw,
    /// `[N, D, H, W, C]`.
    Ndhwc,
    /// `[N, C, D, H, W]`.
    Ncdhw,
}

impl DataFormat {
    /// All four formats.
    pub const ALL: [DataFormat; 4] = [
        DataFormat::Nhwc,
        DataFormat::Nchw,
        DataFormat::Ndhwc,
        DataFormat::Ncdhw,
    ];

    /// TensorFlow's string for the format.
    pub fn as_str(self) -> &'static str {
        match self {
            DataFormat::Nhwc => "NHWC",
            DataFormat::Nchw => "NCHW",
            DataFormat::Ndhwc => "NDHWC",
            DataFormat::Ncdhw => "NCDHW",
        }
    }

    /// The rank of `x` in this format (4 or 5).
    pub fn rank(self) -> usize {
        match self {
            DataFormat::Nhwc | DataFormat::Nchw => 4,
            DataFormat::Ndhwc | DataFormat::Ncdhw => 5,
        }
    }

    /// The index of the channel axis.
    pub fn channel_axis(self) -> usize {
        match self {
            DataFormat::Nhwc => 3,
            DataFormat::Ndhwc => 4,
            DataFormat::Nchw | DataFormat::Ncdhw => 1,
        }
    }

    /// True for the channels-last formats (NHWC, NDHWC).
    pub fn is_channels_last(self) -> bool {
        matches!(self, DataFormat::Nhwc | DataFormat::Ndhwc)
    }
}

impl fmt::Display for DataFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DataFormat {
    type Err = Error;
    /// Parses TensorFlow's format strings exactly (`"NHWC"`, `"NCHW"`, `"NDHWC"`, `"NCDHW"`).
    fn from_str(s: &str) -> Result<Self> {
        DataFormat::ALL
            .into_iter()
            .find(|f| f.as_str() == s)
            .ok_or_else(|| Error::UnknownDataFormat {
                found: s.to_string(),
            })
    }
}

/// Default `epsilon` of TensorFlow's fused batch-norm ops.
pub const DEFAULT_EPSILON: f32 = 1e-4;

/// One batch-normalization problem: the data format, the shape of `x` and epsilon.
///
/// A `Problem` is validated once, when it is made; its methods in
/// [`batch_norm`](crate::batch_norm) then run the forward pass or the gradient over
/// caller-supplied slices.
///
/// ```
/// use fusedbn::{DataFormat, Problem};
/// let p = Problem::new(DataFormat::Nchw, &[2, 3, 4, 5])?.with_epsilon(1e-3);
/// assert_eq!(p.channels(), 3);
/// assert_eq!(p.elements_per_channel(), 2 * 4 * 5);
/// assert!(Problem::new(DataFormat::Nchw, &[2, 3, 4]).is_err()); // NCHW needs rank 4
/// # Ok::<(), fusedbn::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    format: DataFormat,
    shape: Vec<usize>,
    epsilon: f32,
    geometry: Geometry,
    isa: Isa,
}

impl Problem {
    /// A problem for `x` of the given shape in the given format (epsilon 1e-4).
    ///
    /// Fails when the rank does not match the format (4 for NHWC/NCHW, 5 for
    /// NDHWC/NCDHW) or the element count overflows.
    pub fn new(format: DataFormat, shape: &[usize]) -> Result<Self> {
        check_x_shape("x", format, shape)?;
        let c = shape[format.channel_axis()];
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
        let total = numel(shape).ok_or_else(too_large)?;
        let (outer, inner) = if format.is_channels_last() {
            (total.checked_div(c).unwrap_or(0), 1)
        } else {
            (shape[0], numel(&shape[2..]).ok_or_else(too_large)?)
        };
        Ok(Problem {
            format,
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
    /// use fusedbn::{DataFormat, Problem, kernels::simd::Isa};
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

    /// The data format.
    pub fn format(&self) -> DataFormat {
        self.format
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
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }
}

/// SPEC §4 rule 1: `x` (or `y_backprop`) has the rank of its data format.
pub(crate) fn check_x_shape(arg: &str, format: DataFormat, shape: &[usize]) -> Result<()> {
    if shape.len() != format.rank() {
        let what = if shape.len() == 4 || shape.len() == 5 {
            format!("a {}-D tensor (data_format {format})", format.rank())
        } else {
            "a 4-D or 5-D tensor".to_string()
        };
        return Err(Error::arg(
            arg,
            what,
            format!("shape {shape:?} (rank {})", shape.len()),
        ));
    }
    Ok(())
}
