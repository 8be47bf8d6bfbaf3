//! A dynamically typed, row-major (C order) tensor for the TensorFlow-op layer.

use half::{bf16, f16};

use crate::element::Element;
use crate::error::{Error, Result};

// `DType` is defined with `Element`, which the kernels use: they need nothing of this
// module.
pub use crate::element::DType;

/// The elements of a [`Tensor`], one variant per [`DType`].
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    /// `f16` elements.
    F16(Vec<f16>),
    /// `bf16` elements.
    BF16(Vec<bf16>),
    /// `f32` elements.
    F32(Vec<f32>),
    /// `f64` elements.
    F64(Vec<f64>),
}

impl TensorData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::F16(_) => DType::F16,
            TensorData::BF16(_) => DType::BF16,
            TensorData::F32(_) => DType::F32,
            TensorData::F64(_) => DType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F16(v) => v.len(),
            TensorData::BF16(v) => v.len(),
            TensorData::F32(v) => v.len(),
            TensorData::F64(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dense, row-major tensor with a run-time element type.
///
/// ```
/// use fusedbn::{DType, Tensor};
/// let t = Tensor::new(vec![2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
/// assert_eq!(t.shape(), &[2, 3]);
/// assert_eq!(t.dtype(), DType::F32);
/// assert_eq!(t.as_slice::<f32>().unwrap()[4], 5.0);
/// # Ok::<(), fusedbn::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: TensorData,
}

impl Tensor {
    /// A tensor of the given shape over `data` (row-major). Fails when the number of
    /// elements does not match the shape.
    pub fn new<T: Element>(shape: Vec<usize>, data: Vec<T>) -> Result<Self> {
        Self::from_data(shape, T::wrap(data))
    }

    /// A tensor of the given shape over already wrapped data.
    pub fn from_data(shape: Vec<usize>, data: TensorData) -> Result<Self> {
        let expected = numel(&shape).ok_or_else(|| Error::TooLarge {
            shape: shape.clone(),
        })?;
        if expected != data.len() {
            return Err(Error::DataLength {
                shape,
                expected,
                found: data.len(),
            });
        }
        Ok(Tensor { shape, data })
    }

    /// A 1-D tensor.
    pub fn vector<T: Element>(data: Vec<T>) -> Self {
        Tensor {
            shape: vec![data.len()],
            data: T::wrap(data),
        }
    }

    /// The empty 1-D tensor `[0]` of the given type (TensorFlow's placeholder outputs).
    pub fn empty(dtype: DType) -> Self {
        let data = match dtype {
            DType::F16 => TensorData::F16(Vec::new()),
            DType::BF16 => TensorData::BF16(Vec::new()),
            DType::F32 => TensorData::F32(Vec::new()),
            DType::F64 => TensorData::F64(Vec::new()),
        };
        Tensor {
            shape: vec![0],
            data,
        }
    }

    /// The shape, outermost dimension first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// The elements.
    pub fn data(&self) -> &TensorData {
        &self.data
    }

    /// Consumes the tensor, returning its shape and elements.
    pub fn into_parts(self) -> (Vec<usize>, TensorData) {
        (self.shape, self.data)
    }

    /// The elements as a slice of `T`, or `None` when the tensor holds another type.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        T::slice(&self.data)
    }

    /// Every element widened to `f64` (exact for all four types).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            TensorData::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            TensorData::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            TensorData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::F64(v) => v.clone(),
        }
    }
}

/// The element count of a shape, or `None` on overflow.
pub(crate) fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}
