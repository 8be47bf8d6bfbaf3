//! fusedbn's kernels on burn's Flex primitives ([`FlexTensor`]).
//!
//! Two layers:
//!
//! - [`batch_norm_train`], [`batch_norm_train_backward`] and [`batch_norm`] have the
//!   exact signatures and contracts of burn's `ModuleOps::batch_norm_train`,
//!   `ModuleOps::batch_norm_train_backward` and `ModuleOps::batch_norm` for
//!   `Flex` (statistics returned in `x`'s dtype, gradients in `gamma`'s), so a
//!   `burn-flex` whose `ModuleOps` implementation calls them gets fusedbn's kernels
//!   under `burn::nn::BatchNorm` itself (see the README's burn section);
//! - the crate's backend extension ([`crate::FusedBatchNormBackend`]) calls the
//!   `*_stats` variants, which keep the batch statistics in the statistics type
//!   (`f32` for `f16`/`bf16` data, else `x`'s own) so the backward pass reads them
//!   unrounded.
//!
//! Inputs are `[N, C, *]` of rank ≥ 2 in `f32`, `f64`, `f16` or `bf16`. A contiguous
//! tensor runs fusedbn's channels-first kernels; a channels-last buffer seen through
//! a permuted `[N, C, *]` view (strides `[.., 1, .., C]`) runs the channels-last
//! kernels on the buffer as it is, and the outputs come back as the same kind of
//! view. Any other layout is copied to contiguous first. Shape errors panic, as
//! burn's own ops do.

use burn::backend::flex::FlexTensor;
use burn::backend::ops::{BatchNormTrain, BatchNormTrainBackward, FloatTensorOps};
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, FloatDType, Shape, TensorData};
use fusedbn::batch_norm::{
    Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, SavedStats,
    Statistics, TrainingStats,
};
use fusedbn::{bf16, f16, Problem, Real};

/// The result of a training forward pass with its statistics in the statistics
/// type (`f32` for half-precision data).
pub(crate) struct TrainStats {
    pub output: FlexTensor,
    pub mean: FlexTensor,
    pub variance: FlexTensor,
}

/// burn's `ModuleOps::batch_norm_train` for `Flex`, on fusedbn's kernels: the
/// normalized `x` with the batch's own statistics, and the batch mean and biased
/// variance (`[C]`, in `x`'s dtype).
///
/// ```
/// use burn::backend::flex::FlexTensor;
/// use burn::tensor::TensorData;
/// let x = FlexTensor::from_data(TensorData::new(vec![1.0f32, 2.0, 3.0, 5.0], [2, 2]));
/// let ones = FlexTensor::from_data(TensorData::new(vec![1.0f32, 1.0], [2]));
/// let zeros = FlexTensor::from_data(TensorData::new(vec![0.0f32, 0.0], [2]));
/// let r = fusedbn_burn::flex::batch_norm_train(x, ones, zeros, 1e-5);
/// assert_eq!(r.mean.into_data().try_to_vec::<f32>().unwrap(), [2.0, 3.5]);
/// assert_eq!(r.variance.into_data().try_to_vec::<f32>().unwrap(), [1.0, 2.25]);
/// ```
pub fn batch_norm_train(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    epsilon: f64,
) -> BatchNormTrain<Flex> {
    let dtype = x.dtype();
    let r = batch_norm_train_stats(x, gamma, beta, epsilon);
    BatchNormTrain::new(r.output, cast(r.mean, dtype), cast(r.variance, dtype))
}

/// burn's `ModuleOps::batch_norm_train_backward` for `Flex`, on fusedbn's kernels:
/// the gradients of `x`, `gamma` and `beta` given the output's gradient and the
/// statistics [`batch_norm_train`] returned, in one pass over `x` and `dy` for the
/// sums and one to write `dx`.
pub fn batch_norm_train_backward(
    x: FlexTensor,
    gamma: FlexTensor,
    mean: FlexTensor,
    variance: FlexTensor,
    epsilon: f64,
    output_grad: FlexTensor,
) -> BatchNormTrainBackward<Flex> {
    let (x_grad, gamma_grad, beta_grad) =
        backward(x, gamma, mean, variance, epsilon, output_grad, true);
    BatchNormTrainBackward::new(x_grad, gamma_grad, beta_grad)
}

/// burn's `ModuleOps::batch_norm` for `Flex` (inference: the given statistics), on
/// fusedbn's kernels.
pub fn batch_norm(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    mean: FlexTensor,
    variance: FlexTensor,
    epsilon: f64,
) -> FlexTensor {
    match x.dtype() {
        DType::F32 => inference::<f32>(x, gamma, beta, mean, variance, epsilon),
        DType::F64 => inference::<f64>(x, gamma, beta, mean, variance, epsilon),
        DType::F16 => inference::<f16>(x, gamma, beta, mean, variance, epsilon),
        DType::BF16 => inference::<bf16>(x, gamma, beta, mean, variance, epsilon),
        other => unsupported(other),
    }
}

/// [`batch_norm_train`] with the statistics in the statistics type.
pub(crate) fn batch_norm_train_stats(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    epsilon: f64,
) -> TrainStats {
    match x.dtype() {
        DType::F32 => train::<f32>(x, gamma, beta, epsilon),
        DType::F64 => train::<f64>(x, gamma, beta, epsilon),
        DType::F16 => train::<f16>(x, gamma, beta, epsilon),
        DType::BF16 => train::<bf16>(x, gamma, beta, epsilon),
        other => unsupported(other),
    }
}

/// The gradients of `x`, `gamma` and `beta` (training: batch statistics; inference:
/// population statistics, `dx = dy·gamma/√(var + ε)`). `gamma`'s gradients come
/// back in `gamma`'s dtype.
pub(crate) fn backward(
    x: FlexTensor,
    gamma: FlexTensor,
    mean: FlexTensor,
    variance: FlexTensor,
    epsilon: f64,
    output_grad: FlexTensor,
    training: bool,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let args = (x, gamma, mean, variance, epsilon, output_grad, training);
    match args.0.dtype() {
        DType::F32 => grad::<f32>(args),
        DType::F64 => grad::<f64>(args),
        DType::F16 => grad::<f16>(args),
        DType::BF16 => grad::<bf16>(args),
        other => unsupported(other),
    }
}

/// True for the element types the kernels take.
pub(crate) fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

fn unsupported(dtype: DType) -> ! {
    panic!("fusedbn-burn: batch norm takes f32, f64, f16 or bf16 tensors, found {dtype:?}")
}

/// An element type both fusedbn and burn know.
trait Elem: fusedbn::Element + burn::tensor::Element + bytemuck::Pod {}
impl<T: fusedbn::Element + burn::tensor::Element + bytemuck::Pod> Elem for T {}

/// How `x`'s elements lie in memory.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Order {
    /// `[N, C, *]` row-major (or any layout that is copied to it).
    ChannelsFirst,
    /// A `[N, *, C]` row-major buffer seen through a permuted `[N, C, *]` view.
    ChannelsLast,
}

/// The axes that take a `[N, C, *]` view of a channels-last buffer to `[N, *, C]`.
fn to_last(rank: usize) -> Vec<usize> {
    let mut axes: Vec<usize> = (0..rank).filter(|&a| a != 1).collect();
    axes.push(1);
    axes
}

/// The inverse of [`to_last`]: `[N, *, C]` to `[N, C, *]`.
fn from_last(rank: usize) -> Vec<usize> {
    let mut axes = vec![0, rank - 1];
    axes.extend(1..rank - 1);
    axes
}

fn order_of(x: &FlexTensor) -> Order {
    let rank = x.layout().num_dims();
    if rank > 2 && !x.is_contiguous() && x.permute(&to_last(rank)).is_contiguous() {
        Order::ChannelsLast
    } else {
        Order::ChannelsFirst
    }
}

/// fusedbn's problem for `x` of burn shape `[N, C, *]` in the given order.
fn problem(shape: &Shape, order: Order, epsilon: f64) -> Problem {
    let dims = shape.to_vec();
    let p = match order {
        Order::ChannelsFirst => Problem::channels_first(&dims),
        Order::ChannelsLast => {
            let perm: Vec<usize> = to_last(dims.len()).iter().map(|&a| dims[a]).collect();
            Problem::channels_last(&perm)
        }
    };
    p.unwrap_or_else(|e| panic!("fusedbn-burn: batch norm input: {e}"))
        .with_epsilon(epsilon as f32)
}

/// `t` (shaped like `x`) as a tensor whose storage slice holds its elements in
/// `order`, in dtype `T`: no copy when it already does.
fn dense<T: Elem>(t: FlexTensor, order: Order) -> FlexTensor {
    let t = if t.dtype() == <T as burn::tensor::Element>::dtype() {
        t
    } else {
        cast(t, <T as burn::tensor::Element>::dtype())
    };
    let rank = t.layout().num_dims();
    let t = match order {
        Order::ChannelsFirst => t,
        Order::ChannelsLast => t.permute(&to_last(rank)),
    };
    if t.layout().contiguous_offsets().is_some() {
        t
    } else {
        t.to_contiguous()
    }
}

fn slice<T: Elem>(t: &FlexTensor) -> &[T] {
    t.as_slice::<T>()
        .expect("a dense tensor of the element type (made by `dense`)")
}

/// A `[C]` tensor of any float dtype as statistics-type values.
fn channel_vec<U: Real>(t: &FlexTensor, what: &str, channels: usize) -> Vec<U> {
    let dims = t.layout().shape().to_vec();
    assert!(
        dims == [channels],
        "fusedbn-burn: batch norm {what} must have shape [{channels}], found {dims:?}"
    );
    let t = t.to_contiguous();
    match t.dtype() {
        DType::F64 => slice::<f64>(&t).iter().map(|&v| U::from_f64(v)).collect(),
        DType::F32 => slice::<f32>(&t)
            .iter()
            .map(|&v| U::from_f64(v as f64))
            .collect(),
        DType::F16 => slice::<f16>(&t)
            .iter()
            .map(|&v| U::from_f64(v.to_f64()))
            .collect(),
        DType::BF16 => slice::<bf16>(&t)
            .iter()
            .map(|&v| U::from_f64(v.to_f64()))
            .collect(),
        other => unsupported(other),
    }
}

/// A `[C]` statistics vector as a tensor of its own dtype.
fn stat_tensor<U: Elem>(v: Vec<U>) -> FlexTensor {
    let c = v.len();
    FlexTensor::from_data(TensorData::new(v, [c]))
}

/// Output data in `order`, as a `[N, C, *]` tensor (a permuted view for channels-last).
fn output<T: Elem>(v: Vec<T>, shape: &Shape, order: Order) -> FlexTensor {
    let dims = shape.to_vec();
    let rank = dims.len();
    match order {
        Order::ChannelsFirst => FlexTensor::from_data(TensorData::new(v, dims)),
        Order::ChannelsLast => {
            let last: Vec<usize> = to_last(rank).iter().map(|&a| dims[a]).collect();
            FlexTensor::from_data(TensorData::new(v, last)).permute(&from_last(rank))
        }
    }
}

fn cast(t: FlexTensor, dtype: DType) -> FlexTensor {
    if t.dtype() == dtype {
        t
    } else {
        Flex::float_cast(t, FloatDType::from(dtype))
    }
}

fn fail(e: fusedbn::Error) -> ! {
    panic!("fusedbn-burn: batch norm: {e}")
}

fn train<T: Elem>(x: FlexTensor, gamma: FlexTensor, beta: FlexTensor, epsilon: f64) -> TrainStats
where
    T::Stat: Elem,
{
    let shape = x.shape();
    let order = order_of(&x);
    let p = problem(&shape, order, epsilon);
    let c = p.channels();
    let scale = channel_vec::<T::Stat>(&gamma, "gamma", c);
    let offset = channel_vec::<T::Stat>(&beta, "beta", c);
    let x = dense::<T>(x, order);
    let mut y = vec![T::default(); p.len()];
    let (mut mean, mut variance) = (vec![T::Stat::ZERO; c], vec![T::Stat::ZERO; c]);
    p.forward(
        slice::<T>(&x),
        Affine {
            scale: &scale,
            offset: &offset,
        },
        Forward::Training(TrainingStats {
            saved: SavedStats {
                mean: &mut mean,
                variance: &mut variance,
            },
            running: None,
        }),
        Epilogue::plain(),
        &mut y,
    )
    .unwrap_or_else(|e| fail(e));
    TrainStats {
        output: output(y, &shape, order),
        mean: stat_tensor(mean),
        variance: stat_tensor(variance),
    }
}

fn inference<T: Elem>(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    mean: FlexTensor,
    variance: FlexTensor,
    epsilon: f64,
) -> FlexTensor
where
    T::Stat: Elem,
{
    let shape = x.shape();
    let order = order_of(&x);
    let p = problem(&shape, order, epsilon);
    let c = p.channels();
    let scale = channel_vec::<T::Stat>(&gamma, "gamma", c);
    let offset = channel_vec::<T::Stat>(&beta, "beta", c);
    let mean = channel_vec::<T::Stat>(&mean, "mean", c);
    let variance = channel_vec::<T::Stat>(&variance, "variance", c);
    let x = dense::<T>(x, order);
    let mut y = vec![T::default(); p.len()];
    p.forward(
        slice::<T>(&x),
        Affine {
            scale: &scale,
            offset: &offset,
        },
        Forward::Inference(Statistics {
            mean: &mean,
            variance: &variance,
        }),
        Epilogue::plain(),
        &mut y,
    )
    .unwrap_or_else(|e| fail(e));
    output(y, &shape, order)
}

type GradArgs = (
    FlexTensor,
    FlexTensor,
    FlexTensor,
    FlexTensor,
    f64,
    FlexTensor,
    bool,
);

fn grad<T: Elem>(
    (x, gamma, mean, variance, epsilon, dy, training): GradArgs,
) -> (FlexTensor, FlexTensor, FlexTensor)
where
    T::Stat: Elem,
{
    let shape = x.shape();
    let dy_dims = dy.layout().shape().to_vec();
    assert!(
        dy_dims == shape.to_vec(),
        "fusedbn-burn: batch norm output gradient has shape {dy_dims:?}, x has {:?}",
        shape.to_vec()
    );
    let order = order_of(&x);
    let p = problem(&shape, order, epsilon);
    let c = p.channels();
    let gamma_dtype = gamma.dtype();
    let scale = channel_vec::<T::Stat>(&gamma, "gamma", c);
    let mean = channel_vec::<T::Stat>(&mean, "mean", c);
    let variance = channel_vec::<T::Stat>(&variance, "variance", c);
    let x = dense::<T>(x, order);
    let dy = dense::<T>(dy, order);
    let stats = Statistics {
        mean: &mean,
        variance: &variance,
    };
    let mode = if training {
        Backward::Training(stats)
    } else {
        Backward::Inference(stats)
    };
    let mut dx = vec![T::default(); p.len()];
    let (mut dscale, mut doffset) = (vec![T::Stat::ZERO; c], vec![T::Stat::ZERO; c]);
    p.backward(
        GradInputs {
            y_backprop: slice::<T>(&dy),
            x: slice::<T>(&x),
        },
        &scale,
        mode,
        GradEpilogue::default(),
        Gradients {
            x: &mut dx,
            scale: &mut dscale,
            offset: &mut doffset,
        },
    )
    .unwrap_or_else(|e| fail(e));
    (
        output(dx, &shape, order),
        cast(stat_tensor(dscale), gamma_dtype),
        cast(stat_tensor(doffset), gamma_dtype),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_round_trip() {
        for rank in 3..7 {
            let there = to_last(rank);
            let back = from_last(rank);
            let composed: Vec<usize> = back.iter().map(|&a| there[a]).collect();
            assert_eq!(composed, (0..rank).collect::<Vec<_>>(), "rank {rank}");
        }
        assert_eq!(to_last(4), [0, 2, 3, 1]);
        assert_eq!(from_last(4), [0, 3, 1, 2]);
    }
}
