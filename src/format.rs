//! The data formats (TensorFlow's `data_format`) and the shape rule they imply.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

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
