//! fusedbn's fused batch normalization for [burn](https://burn.dev) 0.22.
//!
//! burn composes batch norm's statistics and gradient from generic tensor
//! operations on its Flex CPU backend; this crate runs fusedbn's kernels instead,
//! as a backend extension of `Flex` and `Autodiff<Flex>`, where the whole
//! operation is **one** autodiff node whose backward computes `dx`, `dgamma` and
//! `dbeta` in one call.
//!
//! - [`BatchNorm`] / [`BatchNormConfig`]: a drop-in for `burn::nn::BatchNorm` /
//!   `burn::nn::BatchNormConfig` — the same fields and record names (`gamma`,
//!   `beta`, `running_mean`, `running_var`), the same defaults (epsilon 1e-5,
//!   momentum 0.1) and semantics (running variance updated with the *biased* batch
//!   variance, as burn does), conversions both ways sharing the parameters.
//!   Switching is one line:
//!   `use fusedbn_burn::{BatchNorm, BatchNormConfig};`.
//! - [`batch_norm_train`] / [`batch_norm`]: the functional forms, drop-ins for
//!   `burn::tensor::module::batch_norm_train` / `batch_norm`.
//! - [`flex`]: the kernels on Flex primitives, with the signatures of burn's
//!   `ModuleOps` batch-norm methods.
//!
//! On any device other than Flex (with or without autodiff), or for element types
//! the kernels do not take, every entry point calls burn's own operation: the
//! result is then exactly burn's. [`is_fused`] says which path a tensor takes.
//!
//! Not supported: second-order gradients (the gradient of the gradient), since the
//! backward is one kernel call and is not itself differentiable: on the backend type
//! `Autodiff<Autodiff<Flex>>` the outer backward panics with a message saying so,
//! burn's backward having no way to return an error. burn's own batch norm does the
//! same there (burn-autodiff 0.22.1: "Can't differentiate batch norm train backward"),
//! and burn's `Tensor` API cannot nest autodiff at all (`Device::autodiff` gives first
//! order only), so only code written on the backend types reaches it. Also not
//! supported: the fused side input + ReLU epilogue of fusedbn's Ex ops, which burn's
//! batch norm has no place for.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use fusedbn_burn::{BatchNorm, BatchNormConfig};
//!
//! let device = Device::flex().autodiff();
//! let bn: BatchNorm = BatchNormConfig::new(3).init(&device);
//! let x = Tensor::<4>::ones([2, 3, 4, 4], &device).require_grad();
//! let y = bn.forward(x.clone());
//! let grads = y.sum().backward();
//! assert!(x.grad(&grads).is_some());
//! ```

#![warn(missing_docs)]

mod extension;
pub mod flex;
mod module;

pub use extension::FusedBatchNormBackend;
pub use module::{BatchNorm, BatchNormConfig};

use burn::backend::{Dispatch, DispatchDevice};
use burn::tensor::module::BatchNormTrainOutput;
use burn::tensor::{FloatDType, Tensor};

/// True when `x` would run fusedbn's kernels: its device is Flex (autodiff or not)
/// and its dtype f32, f64, f16 or bf16. Elsewhere the entry points of this crate
/// call burn's own operation.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// let x = Tensor::<2>::zeros([4, 3], &Device::flex());
/// assert!(fusedbn_burn::is_fused(&x));
/// ```
pub fn is_fused<const D: usize>(x: &Tensor<D>) -> bool {
    let device = x.device().without_autodiff();
    matches!(device.as_dispatch(), DispatchDevice::Flex(_)) && flex::supports(x.dtype())
}

/// burn's `batch_norm_train` on fusedbn's kernels: `input` (`[N, C, *]`)
/// normalized with its own batch statistics, and the batch mean and biased
/// variance (`[C]`, in `input`'s dtype, detached). On an autodiff device the
/// output's gradient reaches `input`, `gamma` and `beta` through one node.
///
/// Falls back to `burn::tensor::module::batch_norm_train` where
/// [`is_fused`] is false.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// let device = Device::flex();
/// let x = Tensor::<2>::from_floats([[1.0, 10.0], [3.0, 30.0]], &device);
/// let r = fusedbn_burn::batch_norm_train(x, Tensor::ones([2], &device), Tensor::zeros([2], &device), 1e-5);
/// assert_eq!(r.mean.into_data().try_to_vec::<f32>().unwrap(), [2.0, 20.0]);
/// assert_eq!(r.variance.into_data().try_to_vec::<f32>().unwrap(), [1.0, 100.0]);
/// ```
///
/// # Panics
///
/// When the rank is below 2 or `gamma`/`beta` are not `[C]`, as burn's does.
pub fn batch_norm_train<const D: usize>(
    input: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
) -> BatchNormTrainOutput<D> {
    if !is_fused(&input) {
        return burn::tensor::module::batch_norm_train(input, gamma, beta, epsilon);
    }
    check(&input, &[("gamma", &gamma), ("beta", &beta)]);
    let dtype = FloatDType::from(input.dtype());
    let (output, mean, variance) = <Dispatch as FusedBatchNormBackend>::fusedbn_train(
        input.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    );
    BatchNormTrainOutput {
        output: Tensor::from_dispatch(output),
        mean: Tensor::<1>::from_dispatch(mean).cast(dtype),
        variance: Tensor::<1>::from_dispatch(variance).cast(dtype),
    }
}

/// burn's `batch_norm` (inference: the given statistics) on fusedbn's kernels. On
/// an autodiff device the output's gradient reaches `input`, `gamma` and `beta`
/// through one node; `mean` and `variance` are constants there, so when either
/// requires a gradient this calls burn's own operation, which differentiates them.
///
/// Falls back to `burn::tensor::module::batch_norm` where [`is_fused`] is false.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// let device = Device::flex();
/// let x = Tensor::<2>::from_floats([[3.0, 0.0]], &device);
/// let stats = |v: [f32; 2]| Tensor::<1>::from_floats(v, &device);
/// let y = fusedbn_burn::batch_norm(x, stats([1.0, 2.0]), stats([0.0, 1.0]), stats([1.0, 0.0]), stats([4.0, 1.0]), 0.0);
/// assert_eq!(y.into_data().try_to_vec::<f32>().unwrap(), [1.0, 1.0]);
/// ```
pub fn batch_norm<const D: usize>(
    input: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    mean: Tensor<1>,
    variance: Tensor<1>,
    epsilon: f64,
) -> Tensor<D> {
    if !is_fused(&input) || mean.is_require_grad() || variance.is_require_grad() {
        return burn::tensor::module::batch_norm(input, gamma, beta, mean, variance, epsilon);
    }
    check(
        &input,
        &[
            ("gamma", &gamma),
            ("beta", &beta),
            ("mean", &mean),
            ("variance", &variance),
        ],
    );
    Tensor::from_dispatch(<Dispatch as FusedBatchNormBackend>::fusedbn_inference(
        input.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        mean.into_dispatch(),
        variance.into_dispatch(),
        epsilon,
    ))
}

/// burn's checks, with burn's messages.
fn check<const D: usize>(input: &Tensor<D>, channel_tensors: &[(&str, &Tensor<1>)]) {
    assert!(D >= 2, "batch norm requires an input rank of at least 2");
    let channels = input.dims()[1];
    for (name, t) in channel_tensors {
        assert_eq!(t.dims(), [channels], "invalid batch norm {name} shape");
    }
}
