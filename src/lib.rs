//! TensorFlow-exact fused batch normalization.
pub mod batch_norm;
pub mod element;
pub mod error;
pub mod kernels;
pub mod npy;
pub mod ops;
pub mod problem;
pub mod reference;
pub mod tensor;

pub use element::{Element, Real};
pub use error::{Error, Result};
pub use problem::{DataFormat, Problem, DEFAULT_EPSILON};
pub use tensor::{DType, Tensor, TensorData};
