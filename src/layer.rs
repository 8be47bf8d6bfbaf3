//! A batch-normalization layer with the semantics of Keras' `BatchNormalization`
//! (SPEC §6): trainable `gamma`/`beta`, moving statistics updated by every training
//! call, `forward(x, training)` and `backward(dy)`, an optional fused ReLU, and the
//! weights saved and loaded as safetensors under Keras' names.
//!
//! [`BatchNorm`] is what `tf_keras.layers.BatchNormalization(fused=True)` computes,
//! op for op: a training call runs `FusedBatchNormV3` in training mode with the moving
//! statistics as `mean`/`variance` and `exponential_avg_factor = 1 − momentum`, and keeps
//! its `batch_mean`/`batch_variance` outputs as the new moving statistics (so the moving
//! variance is updated with the Bessel-corrected batch variance); an inference call
//! normalizes with the moving statistics and leaves them alone. The golden tests in
//! `tests/keras_layer.rs` replay multi-step runs of the real Keras layer.
//!
//! A training step, then inference with the moving statistics:
//!
//! ```
//! use fusedbn::{DataFormat, layer::{BatchNorm, Forwarded}};
//! // 2 images of 2×2 pixels with 3 channels; channel c holds values around 10·c.
//! let shape = [2, 2, 2, 3];
//! let x: Vec<f32> = (0..24).map(|i| (i % 3) as f32 * 10.0 + (i / 3) as f32).collect();
//! let mut bn = BatchNorm::new(DataFormat::Nhwc, 3).with_momentum(0.9);
//!
//! // Training: normalize with the batch's own statistics...
//! let y = bn.forward(&x, &shape, true)?;
//! let mean_y: f32 = y.iter().step_by(3).sum::<f32>() / 8.0;
//! assert!(mean_y.abs() < 1e-5);
//! // ...and move the moving statistics 10% of the way to them (batch mean 10·c + 3.5).
//! assert!((bn.moving_mean()[1] - 0.1 * 13.5).abs() < 1e-5);
//!
//! // The gradient of a loss with respect to x, gamma and beta.
//! let dy = vec![1.0f32; 24];
//! let grads = bn.backward(Forwarded { x: &x, y: &y }, &dy)?;
//! assert_eq!(grads.beta.as_deref(), Some(&[8.0f32; 3][..])); // Σdy per channel
//! assert!(grads.x.iter().all(|g| g.abs() < 1e-4)); // a constant dy does nothing
//! bn.apply_sgd(&grads, 0.1)?;
//! assert!((bn.beta()[0] - -0.8).abs() < 1e-6);
//!
//! // Inference: normalize with the moving statistics, which stay as they are.
//! let before = bn.moving_mean().to_vec();
//! let y = bn.predict(&x, &shape)?;
//! assert_eq!(y.len(), 24);
//! assert_eq!(bn.moving_mean(), &before[..]);
//! # Ok::<(), fusedbn::Error>(())
//! ```
//!
//! A layer after a dense layer sees a batch of feature vectors `[N, C]`: the layer
//! accepts any rank from 2 up to its format's rank and treats the missing axes as
//! length 1 (see [`BatchNorm::forward`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::batch_norm::Problem;
use crate::batch_norm::{
    Activation, Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients,
    RunningStats, SavedStats, Statistics, TrainingStats,
};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::format::DataFormat;
use crate::sync::Collective;
use crate::tensor::DType;

/// Keras' default momentum of the moving statistics.
pub const DEFAULT_MOMENTUM: f64 = 0.99;

/// Keras' default epsilon.
pub const DEFAULT_EPSILON: f32 = 1e-3;

/// The smallest epsilon the op Keras calls accepts (`tf.compat.v1.nn.fused_batch_norm`
/// raises anything smaller to this value, a cuDNN requirement); the layer does the same.
pub const MIN_EPSILON: f32 = 1.001e-5;

/// The tensor names of the saved weights, in Keras' order.
pub const WEIGHT_NAMES: [&str; 4] = ["gamma", "beta", "moving_mean", "moving_variance"];

/// A batch-normalization layer with Keras semantics (SPEC §6).
///
/// Made with [`BatchNorm::new`] and configured with the `with_*` builders:
///
/// | setting | default | builder |
/// |---|---|---|
/// | channel axis | the format's ([`DataFormat::channel_axis`]) | [`new`](BatchNorm::new) |
/// | momentum | 0.99 | [`with_momentum`](BatchNorm::with_momentum) |
/// | epsilon | 1e-3 | [`with_epsilon`](BatchNorm::with_epsilon) |
/// | center (learn `beta`) | on | [`with_center`](BatchNorm::with_center) |
/// | scale (learn `gamma`) | on | [`with_scale`](BatchNorm::with_scale) |
/// | fused ReLU after the normalization | off | [`with_relu`](BatchNorm::with_relu) |
///
/// The parameters start as in Keras: `gamma = 1`, `beta = 0`, `moving_mean = 0`,
/// `moving_variance = 1`, `f32`, one value per channel. With scale off the layer uses
/// 1 instead of `gamma` (which it neither saves nor trains); with center off it uses 0
/// instead of `beta`.
///
/// The data can be `f32`, `f16` or `bf16` (any [`Element`] with `f32` statistics);
/// the parameters, statistics and their gradients are always `f32`.
///
/// [`forward`](BatchNorm::forward) keeps only per-channel values for
/// [`backward`](BatchNorm::backward) (the statistics and `gamma` it used), never a copy
/// of its input: the caller passes the forward's `x` and `y` back to `backward`
/// ([`Forwarded`]). [`predict`](BatchNorm::predict) runs inference without keeping
/// anything, and [`clear_cache`](BatchNorm::clear_cache) forgets the last forward.
#[derive(Clone)]
pub struct BatchNorm {
    format: DataFormat,
    channels: usize,
    momentum: f64,
    epsilon: f32,
    center: bool,
    scale: bool,
    relu: bool,
    gamma: Vec<f32>,
    beta: Vec<f32>,
    moving_mean: Vec<f32>,
    moving_variance: Vec<f32>,
    cache: Option<Cache>,
}

/// What [`BatchNorm::backward`] needs from the last forward call.
#[derive(Clone)]
struct Cache {
    problem: Problem,
    training: bool,
    center: bool,
    scale: bool,
    /// The element type of the forward's `x`.
    dtype: DType,
    /// The scale the forward call used (`gamma`, or ones).
    gamma: Vec<f32>,
    /// Training: the batch mean and biased variance. Inference: the moving statistics.
    mean: Vec<f32>,
    variance: Vec<f32>,
}

/// The tensors of the forward call that [`BatchNorm::backward`] differentiates: the
/// layer keeps only per-channel values (the statistics and `gamma` the call used), not
/// a copy of `x`; the caller, who has them anyway, passes them back.
#[derive(Clone, Copy, Debug)]
pub struct Forwarded<'a, T> {
    /// The forward call's input.
    pub x: &'a [T],
    /// The forward call's output (read only with the fused ReLU: its mask).
    pub y: &'a [T],
}

/// The gradients [`BatchNorm::backward`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerGradients<T> {
    /// The gradient with respect to the input `x` (its shape and type).
    pub x: Vec<T>,
    /// The gradient with respect to `gamma`; `None` when the layer has scale off.
    pub gamma: Option<Vec<f32>>,
    /// The gradient with respect to `beta`; `None` when the layer has center off.
    pub beta: Option<Vec<f32>>,
}

/// A [`BatchNorm`] in synchronized mode ([`BatchNorm::synchronized`]): the layer and
/// the collective its training calls synchronize over.
pub struct Synchronized<'a> {
    layer: &'a mut BatchNorm,
    comm: &'a dyn Collective,
}

impl fmt::Debug for Synchronized<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Synchronized")
            .field("layer", &self.layer)
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .finish()
    }
}

impl Synchronized<'_> {
    /// [`BatchNorm::forward`] with the statistics of the whole batch in training (one
    /// agreement check and one all-gather of `3·C` values); inference is local.
    pub fn forward<T: Element<Stat = f32>>(
        &mut self,
        x: &[T],
        shape: &[usize],
        training: bool,
    ) -> Result<Vec<T>> {
        let mut y = vec![T::default(); x.len()];
        self.forward_into(x, shape, training, &mut y)?;
        Ok(y)
    }

    /// [`forward`](Synchronized::forward) into a buffer the caller owns.
    pub fn forward_into<T: Element<Stat = f32>>(
        &mut self,
        x: &[T],
        shape: &[usize],
        training: bool,
        y: &mut [T],
    ) -> Result<()> {
        let comm = training.then_some(self.comm);
        self.layer.forward_with(comm, x, shape, training, y)
    }

    /// [`BatchNorm::backward`] after a synchronized training forward: this shard's `dx`
    /// and the global gradients of `gamma` and `beta` (one agreement check and one
    /// all-reduce of `2·C + 1` values). After an inference forward, local.
    pub fn backward<T: Element<Stat = f32>>(
        &self,
        forward: Forwarded<'_, T>,
        dy: &[T],
    ) -> Result<LayerGradients<T>> {
        self.layer.backward_with(Some(self.comm), forward, dy)
    }

    /// The layer.
    pub fn layer(&self) -> &BatchNorm {
        self.layer
    }

    /// The layer, to change (an optimizer step with the global gradients).
    pub fn layer_mut(&mut self) -> &mut BatchNorm {
        self.layer
    }
}

impl fmt::Debug for BatchNorm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchNorm")
            .field("format", &self.format)
            .field("channels", &self.channels)
            .field("momentum", &self.momentum)
            .field("epsilon", &self.epsilon)
            .field("center", &self.center)
            .field("scale", &self.scale)
            .field("relu", &self.relu)
            .field("gamma", &self.gamma)
            .field("beta", &self.beta)
            .field("moving_mean", &self.moving_mean)
            .field("moving_variance", &self.moving_variance)
            .field(
                "cache",
                &self.cache.as_ref().map(|c| {
                    let mode = if c.training { "training" } else { "inference" };
                    format!("{mode} forward of shape {:?}", c.problem.shape())
                }),
            )
            .finish()
    }
}

impl BatchNorm {
    /// A layer for data in `format` with `channels` channels, with Keras' defaults.
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm};
    /// let bn = BatchNorm::new(DataFormat::Nchw, 4);
    /// assert_eq!((bn.axis(), bn.momentum(), bn.epsilon()), (1, 0.99, 1e-3));
    /// assert_eq!(bn.gamma(), &[1.0; 4]);
    /// assert_eq!(bn.moving_variance(), &[1.0; 4]);
    /// ```
    pub fn new(format: DataFormat, channels: usize) -> Self {
        BatchNorm {
            format,
            channels,
            momentum: DEFAULT_MOMENTUM,
            epsilon: DEFAULT_EPSILON,
            center: true,
            scale: true,
            relu: false,
            gamma: vec![1.0; channels],
            beta: vec![0.0; channels],
            moving_mean: vec![0.0; channels],
            moving_variance: vec![1.0; channels],
            cache: None,
        }
    }

    /// The same layer with another momentum: each training call sets
    /// `moving = momentum·moving + (1 − momentum)·batch statistic`.
    ///
    /// Like Keras' Python float, the momentum is an `f64`; the op receives
    /// `1 − momentum` rounded to `f32`, exactly as Keras passes it.
    pub fn with_momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// The same layer with another epsilon (added to the variance before the
    /// reciprocal square root). Values below [`MIN_EPSILON`] act as `MIN_EPSILON`, as
    /// in Keras' fused layer.
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm};
    /// let bn = BatchNorm::new(DataFormat::Nhwc, 1).with_epsilon(0.0);
    /// assert_eq!(bn.epsilon(), 0.0);
    /// let y = bn.predict(&[2.0f32], &[1, 1])?; // (2 − 0)/√(1 + 1.001e-5)
    /// assert!((y[0] - 2.0 / (1.0 + 1.001e-5f32).sqrt()).abs() < 1e-7);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn with_epsilon(mut self, epsilon: f32) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// The same layer with `beta` on or off (off: the offset is 0 and `beta` is neither
    /// trained nor saved).
    pub fn with_center(mut self, center: bool) -> Self {
        self.center = center;
        self
    }

    /// The same layer with `gamma` on or off (off: the scale is 1 and `gamma` is
    /// neither trained nor saved).
    pub fn with_scale(mut self, scale: bool) -> Self {
        self.scale = scale;
        self
    }

    /// The same layer with a ReLU fused after the normalization,
    /// `y = max(0, bn(x))`, in the same pass (the Ex ops); the gradient masks `dy` by
    /// `y > 0`.
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::{BatchNorm, Forwarded}};
    /// let mut bn = BatchNorm::new(DataFormat::Nhwc, 1).with_relu(true);
    /// let x = [1.0f32, 2.0, 3.0, 4.0];
    /// let y = bn.forward(&x, &[4, 1], true)?;
    /// assert_eq!(&y[..2], &[0.0, 0.0]);
    /// assert!(y[2] > 0.0 && y[3] > y[2]);
    /// let g = bn.backward(Forwarded { x: &x, y: &y }, &[1.0f32; 4])?;
    /// assert_eq!(g.beta, Some(vec![2.0])); // only the two positive outputs pass dy
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn with_relu(mut self, relu: bool) -> Self {
        self.relu = relu;
        self
    }

    /// The data format.
    pub fn format(&self) -> DataFormat {
        self.format
    }

    /// The channel axis of a full-rank input (Keras' `axis`, non-negative): 3 for
    /// NHWC, 1 for NCHW and NCDHW, 4 for NDHWC.
    pub fn axis(&self) -> usize {
        self.format.channel_axis()
    }

    /// The number of channels.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// The momentum of the moving statistics.
    pub fn momentum(&self) -> f64 {
        self.momentum
    }

    /// Epsilon as set (see [`with_epsilon`](BatchNorm::with_epsilon) for the value used).
    pub fn epsilon(&self) -> f32 {
        self.epsilon
    }

    /// Whether the layer has `beta`.
    pub fn center(&self) -> bool {
        self.center
    }

    /// Whether the layer has `gamma`.
    pub fn scale(&self) -> bool {
        self.scale
    }

    /// Whether a ReLU follows the normalization.
    pub fn relu(&self) -> bool {
        self.relu
    }

    /// The scale parameter, one per channel (unused when scale is off).
    pub fn gamma(&self) -> &[f32] {
        &self.gamma
    }

    /// The offset parameter, one per channel (unused when center is off).
    pub fn beta(&self) -> &[f32] {
        &self.beta
    }

    /// The moving mean, one per channel.
    pub fn moving_mean(&self) -> &[f32] {
        &self.moving_mean
    }

    /// The moving variance, one per channel.
    pub fn moving_variance(&self) -> &[f32] {
        &self.moving_variance
    }

    /// `gamma`, to change in place (an optimizer's update).
    pub fn gamma_mut(&mut self) -> &mut [f32] {
        &mut self.gamma
    }

    /// `beta`, to change in place.
    pub fn beta_mut(&mut self) -> &mut [f32] {
        &mut self.beta
    }

    /// The moving mean, to change in place.
    pub fn moving_mean_mut(&mut self) -> &mut [f32] {
        &mut self.moving_mean
    }

    /// The moving variance, to change in place.
    pub fn moving_variance_mut(&mut self) -> &mut [f32] {
        &mut self.moving_variance
    }

    /// Replaces `gamma`; fails unless `values` has one element per channel.
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm};
    /// let mut bn = BatchNorm::new(DataFormat::Nhwc, 2);
    /// bn.set_gamma(&[0.5, 2.0])?;
    /// assert_eq!(bn.gamma(), &[0.5, 2.0]);
    /// let e = bn.set_gamma(&[1.0]).unwrap_err();
    /// assert_eq!(e.to_string(), "gamma: expected 2 elements (one per channel), found 1 elements");
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn set_gamma(&mut self, values: &[f32]) -> Result<()> {
        set(&mut self.gamma, "gamma", values)
    }

    /// Replaces `beta`; fails unless `values` has one element per channel.
    pub fn set_beta(&mut self, values: &[f32]) -> Result<()> {
        set(&mut self.beta, "beta", values)
    }

    /// Replaces the moving mean; fails unless `values` has one element per channel.
    pub fn set_moving_mean(&mut self, values: &[f32]) -> Result<()> {
        set(&mut self.moving_mean, "moving_mean", values)
    }

    /// Replaces the moving variance; fails unless `values` has one element per channel.
    pub fn set_moving_variance(&mut self, values: &[f32]) -> Result<()> {
        set(&mut self.moving_variance, "moving_variance", values)
    }

    /// The layer's forward pass (Keras' `layer(x, training=training)`), returning `y`.
    ///
    /// `shape` is the shape of `x` in the layer's format. Besides the format's own rank
    /// (4 or 5), any rank from 2 up is accepted, the missing axes counting as length 1:
    /// `[N, C]` or `[N, L, C]` in a channels-last format, `[N, C]` or `[N, C, L]` in a
    /// channels-first one. The channel axis must have [`channels`](BatchNorm::channels)
    /// elements.
    ///
    /// - `training == true`: normalizes with the batch mean and biased variance and
    ///   updates the moving statistics with `exponential_avg_factor = 1 − momentum`
    ///   and the Bessel-corrected batch variance. An empty batch leaves them unchanged
    ///   (the op itself would make them NaN; Keras guards empty batches the same way
    ///   under a distribution strategy).
    /// - `training == false`: normalizes with the moving statistics.
    ///
    /// Keeps the per-channel values [`backward`](BatchNorm::backward) needs (not `x`).
    /// A failed call changes nothing except that it forgets the previous forward.
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm};
    /// let mut bn = BatchNorm::new(DataFormat::Nchw, 2).with_momentum(0.5);
    /// // NCHW [N=1, C=2, H=1, W=2]: channel 0 is [1, 3], channel 1 is [10, 30].
    /// let y = bn.forward(&[1.0f32, 3.0, 10.0, 30.0], &[1, 2, 1, 2], true)?;
    /// assert!((y[0] + 1.0).abs() < 1e-3 && (y[3] - 1.0).abs() < 1e-5);
    /// assert_eq!(bn.moving_mean(), &[1.0, 10.0]); // 0.5·0 + 0.5·(2, 20)
    /// assert_eq!(bn.moving_variance(), &[1.5, 100.5]); // 0.5·1 + 0.5·(2, 200) (M/(M−1) = 2)
    /// assert!(bn.forward(&[1.0f32; 3], &[1, 3, 1, 1], true).is_err()); // 3 channels, not 2
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn forward<T: Element<Stat = f32>>(
        &mut self,
        x: &[T],
        shape: &[usize],
        training: bool,
    ) -> Result<Vec<T>> {
        let mut y = vec![T::default(); x.len()];
        self.forward_into(x, shape, training, &mut y)?;
        Ok(y)
    }

    /// [`forward`](BatchNorm::forward) writing `y` into a buffer the caller owns
    /// (the length of `x`).
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm, bf16};
    /// let mut bn = BatchNorm::new(DataFormat::Nhwc, 1);
    /// let x: Vec<bf16> = [1.0f32, 2.0, 3.0].iter().map(|&v| bf16::from_f32(v)).collect();
    /// let mut y = vec![bf16::ZERO; 3];
    /// bn.forward_into(&x, &[3, 1], true, &mut y)?;
    /// assert_eq!(y[1], bf16::ZERO);
    /// assert!((bn.moving_mean()[0] - 0.02).abs() < 1e-6); // f32 statistics
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn forward_into<T: Element<Stat = f32>>(
        &mut self,
        x: &[T],
        shape: &[usize],
        training: bool,
        y: &mut [T],
    ) -> Result<()> {
        self.forward_with(None, x, shape, training, y)
    }

    /// This layer in synchronized mode over `comm` (data-parallel training with the
    /// batch split across ranks, [`crate::sync`]): while the returned view lives, its
    /// training [`forward`](Synchronized::forward) normalizes this rank's shard with the
    /// statistics of the **whole** batch and updates the moving statistics with them
    /// (and the global count) — bit-identical on every rank — and its
    /// [`backward`](Synchronized::backward) returns this shard's `dx` and the **global**
    /// gradients of `gamma` and `beta` (the same on every rank; no further all-reduce of
    /// them is needed). Inference runs locally, with no communication.
    ///
    /// Every rank must make the same calls in the same order; the ranks' shards may
    /// have different N, and may be empty (an empty rank still takes part; the moving
    /// statistics change unless the whole batch is empty).
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::{BatchNorm, Forwarded}, sync::ThreadGroup};
    /// let shards = [vec![1.0f32, 2.0, 3.0], vec![10.0]];
    /// let layers: Vec<BatchNorm> = std::thread::scope(|s| {
    ///     let handles: Vec<_> = ThreadGroup::new(2).into_iter().zip(&shards).map(|(comm, x)| {
    ///         s.spawn(move || {
    ///             let mut bn = BatchNorm::new(DataFormat::Nhwc, 1).with_momentum(0.0);
    ///             let mut sync = bn.synchronized(&comm);
    ///             let y = sync.forward(x, &[x.len(), 1], true)?;
    ///             let g = sync.backward(Forwarded { x, y: &y }, &vec![1.0f32; x.len()])?;
    ///             assert_eq!(g.beta, Some(vec![4.0])); // Σdy over both shards
    ///             Ok::<_, fusedbn::Error>(bn)
    ///         })
    ///     }).collect();
    ///     handles.into_iter().map(|h| h.join().unwrap()).collect::<Result<_, _>>()
    /// })?;
    /// // The mean of all four values, on both ranks.
    /// assert_eq!(layers[0].moving_mean(), &[4.0]);
    /// assert_eq!(layers[1].moving_mean(), &[4.0]);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn synchronized<'a>(&'a mut self, comm: &'a dyn Collective) -> Synchronized<'a> {
        Synchronized { layer: self, comm }
    }

    fn forward_with<T: Element<Stat = f32>>(
        &mut self,
        comm: Option<&dyn Collective>,
        x: &[T],
        shape: &[usize],
        training: bool,
        y: &mut [T],
    ) -> Result<()> {
        self.cache = None;
        let problem = self.problem(shape)?;
        let c = self.channels;
        let gamma = self.effective_gamma().into_owned();
        let beta = self.effective_beta().into_owned();
        let epilogue = Epilogue {
            side_input: None,
            activation: self.activation(),
        };
        let (mean, variance) = if training {
            let (mut mean, mut variance) = (vec![0.0f32; c], vec![0.0f32; c]);
            let saved = SavedStats {
                mean: &mut mean,
                variance: &mut variance,
            };
            let affine = Affine {
                scale: &gamma,
                offset: &beta,
            };
            let factor = (1.0 - self.momentum) as f32;
            match comm {
                None => {
                    // The op validates every length before it writes anything, so the
                    // moving statistics change only when the call succeeds.
                    let running = (!problem.is_empty()).then(|| RunningStats {
                        mean: &mut self.moving_mean,
                        variance: &mut self.moving_variance,
                        factor,
                    });
                    let mode = Forward::Training(TrainingStats { saved, running });
                    problem.forward(x, affine, mode, epilogue, y)?;
                }
                Some(comm) => {
                    // The moving statistics move unless the whole batch is empty
                    // (known only after the collective): updated in copies.
                    let (mut mm, mut mv) = (self.moving_mean.clone(), self.moving_variance.clone());
                    let running = Some(RunningStats {
                        mean: &mut mm,
                        variance: &mut mv,
                        factor,
                    });
                    let stats = TrainingStats { saved, running };
                    let global = problem.forward_sync_as(comm, 0, x, affine, stats, epilogue, y)?;
                    if global.iter().any(|m| m.count > 0.0) {
                        self.moving_mean = mm;
                        self.moving_variance = mv;
                    }
                }
            }
            (mean, variance)
        } else {
            let (mean, variance) = (&self.moving_mean, &self.moving_variance);
            let affine = Affine {
                scale: &gamma,
                offset: &beta,
            };
            let mode = Forward::Inference(Statistics { mean, variance });
            problem.forward(x, affine, mode, epilogue, y)?;
            (mean.clone(), variance.clone())
        };
        self.cache = Some(Cache {
            problem,
            training,
            center: self.center,
            scale: self.scale,
            dtype: T::DTYPE,
            gamma,
            mean,
            variance,
        });
        Ok(())
    }

    /// Inference without keeping anything for the gradient: `y` normalized with the
    /// moving statistics (`forward(x, shape, false)` on a shared reference).
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm};
    /// let mut bn = BatchNorm::new(DataFormat::Nhwc, 1).with_epsilon(0.0);
    /// bn.set_moving_mean(&[2.0])?;
    /// bn.set_moving_variance(&[4.0])?;
    /// let y = bn.predict(&[0.0f32, 2.0, 6.0], &[3, 1])?; // (x − 2)/√(4 + ε)
    /// assert!(y.iter().zip([-1.0, 0.0, 2.0]).all(|(a, b)| (a - b).abs() < 1e-5));
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn predict<T: Element<Stat = f32>>(&self, x: &[T], shape: &[usize]) -> Result<Vec<T>> {
        let problem = self.problem(shape)?;
        let mut y = vec![T::default(); x.len()];
        problem.forward(
            x,
            Affine {
                scale: &self.effective_gamma(),
                offset: &self.effective_beta(),
            },
            Forward::Inference(Statistics {
                mean: &self.moving_mean,
                variance: &self.moving_variance,
            }),
            Epilogue {
                side_input: None,
                activation: self.activation(),
            },
            &mut y,
        )?;
        Ok(y)
    }

    /// The gradient of the last [`forward`](BatchNorm::forward) call, for the
    /// upstream gradient `dy` (the shape and type of that call's `x`); `forward` holds
    /// that call's `x` and `y` (the layer does not keep a copy; `y` is read only with
    /// the ReLU, as its mask).
    ///
    /// After a training forward this is the training gradient (through the batch
    /// statistics); after an inference forward it is `dx = dy·gamma/√(moving_variance + ε)`.
    /// With the ReLU, `dy` is first masked to where the forward output was positive.
    /// The gradients of `gamma` and `beta` are `None` when the layer has scale or center
    /// off. The values the forward call used (its `x`, `gamma` and statistics) are the
    /// ones differentiated, even if the layer's parameters changed since.
    ///
    /// Fails when no forward call came before, or `dy`, `x` or `y` does not match the
    /// forward call's shape and type.
    /// The cached forward is kept: `backward` can be called again with another `dy`.
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::{BatchNorm, Forwarded}};
    /// let mut bn = BatchNorm::new(DataFormat::Nhwc, 1).with_scale(false);
    /// let x = [1.0f32, 5.0];
    /// assert!(bn.backward(Forwarded { x: &x, y: &x }, &[1.0f32]).is_err()); // no forward yet
    /// let y = bn.forward(&x, &[2, 1], false)?;
    /// let forward = Forwarded { x: &x, y: &y };
    /// let g = bn.backward(forward, &[1.0f32, 2.0])?;
    /// assert!((g.x[1] - 2.0 / (1.0f32 + 1e-3).sqrt()).abs() < 1e-6);
    /// assert_eq!((g.gamma, g.beta), (None, Some(vec![3.0])));
    /// assert!(bn.backward(forward, &[1.0f32; 3]).is_err()); // the wrong length
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn backward<T: Element<Stat = f32>>(
        &self,
        forward: Forwarded<'_, T>,
        dy: &[T],
    ) -> Result<LayerGradients<T>> {
        self.backward_with(None, forward, dy)
    }

    fn backward_with<T: Element<Stat = f32>>(
        &self,
        comm: Option<&dyn Collective>,
        forward: Forwarded<'_, T>,
        dy: &[T],
    ) -> Result<LayerGradients<T>> {
        let cache = self.cache.as_ref().ok_or_else(|| {
            Error::arg(
                "dy",
                "a preceding forward call (backward differentiates the last forward)",
                "no forward call",
            )
        })?;
        let wrong_type = || {
            Error::arg(
                "dy",
                format!("{} elements (the type of the forward input)", cache.dtype),
                format!("{} elements", T::DTYPE),
            )
        };
        if T::DTYPE != cache.dtype {
            return Err(wrong_type());
        }
        let p = &cache.problem;
        p.check_x("x (of the forward call)", forward.x.len())?;
        p.check_x("y (of the forward call)", forward.y.len())?;
        let x = forward.x;
        let relu_output = self.relu.then_some(forward.y);
        let c = p.channels();
        let (mut dx, mut dgamma, mut dbeta) =
            (vec![T::default(); x.len()], vec![0.0; c], vec![0.0; c]);
        let grads = Gradients {
            x: &mut dx,
            scale: &mut dgamma,
            offset: &mut dbeta,
        };
        let stats = Statistics {
            mean: &cache.mean,
            variance: &cache.variance,
        };
        let epilogue = GradEpilogue {
            relu_output,
            side_input_backprop: None,
        };
        let inputs = GradInputs { y_backprop: dy, x };
        match comm {
            Some(comm) if cache.training => {
                p.backward_sync(comm, inputs, &cache.gamma, stats, epilogue, grads)?;
            }
            _ => {
                let mode = if cache.training {
                    Backward::Training(stats)
                } else {
                    Backward::Inference(stats)
                };
                p.backward(inputs, &cache.gamma, mode, epilogue, grads)?;
            }
        }
        Ok(LayerGradients {
            x: dx,
            gamma: cache.scale.then_some(dgamma),
            beta: cache.center.then_some(dbeta),
        })
    }

    /// Forgets the last forward call (its statistics and `gamma`, kept for
    /// [`backward`](BatchNorm::backward)).
    pub fn clear_cache(&mut self) {
        self.cache = None;
    }

    /// One step of plain gradient descent on the trainable parameters:
    /// `gamma −= learning_rate·grads.gamma`, `beta −= learning_rate·grads.beta`
    /// (those present). Fails, changing nothing, when a gradient does not have one
    /// element per channel.
    pub fn apply_sgd<T>(&mut self, grads: &LayerGradients<T>, learning_rate: f32) -> Result<()> {
        let c = self.channels;
        for (name, g) in [("gamma", &grads.gamma), ("beta", &grads.beta)] {
            if let Some(g) = g {
                check_channels(&format!("grads.{name}"), g.len(), c)?;
            }
        }
        let pairs = [
            (&mut self.gamma, &grads.gamma),
            (&mut self.beta, &grads.beta),
        ];
        for (param, g) in pairs {
            if let Some(g) = g {
                for (p, g) in param.iter_mut().zip(g) {
                    *p -= learning_rate * g;
                }
            }
        }
        Ok(())
    }

    /// The names of the tensors this layer saves and loads, in Keras' order:
    /// `gamma` (with scale on), `beta` (with center on), `moving_mean`, `moving_variance`.
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm};
    /// let bn = BatchNorm::new(DataFormat::Nhwc, 8).with_scale(false);
    /// assert_eq!(bn.weight_names(), ["beta", "moving_mean", "moving_variance"]);
    /// ```
    pub fn weight_names(&self) -> Vec<&'static str> {
        let has = [self.scale, self.center, true, true];
        WEIGHT_NAMES
            .into_iter()
            .zip(has)
            .filter_map(|(n, h)| h.then_some(n))
            .collect()
    }

    /// The weights as a safetensors file in memory: the tensors of
    /// [`weight_names`](BatchNorm::weight_names), `F32`, shape `[C]`, plus the layer's
    /// configuration as (informative) metadata.
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm};
    /// let mut bn = BatchNorm::new(DataFormat::Nhwc, 2);
    /// bn.set_moving_mean(&[1.5, -2.0])?;
    /// let bytes = bn.to_safetensors()?;
    /// let mut other = BatchNorm::new(DataFormat::Nhwc, 2);
    /// other.load_safetensors(&bytes)?;
    /// assert_eq!(other.moving_mean(), &[1.5, -2.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_safetensors(&self) -> Result<Vec<u8>, WeightsError> {
        let bytes: Vec<(&str, Vec<u8>)> = self
            .weight_names()
            .into_iter()
            .map(|name| {
                let v = self.weight(name);
                (name, v.iter().flat_map(|x| x.to_le_bytes()).collect())
            })
            .collect();
        let views = bytes
            .iter()
            .map(|(name, b)| {
                TensorView::new(Dtype::F32, vec![self.channels], b).map(|v| (*name, v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| WeightsError::Format {
                reason: e.to_string(),
            })?;
        safetensors::serialize(views, Some(self.metadata())).map_err(|e| WeightsError::Format {
            reason: e.to_string(),
        })
    }

    /// Loads weights from a safetensors file in memory (see
    /// [`load`](BatchNorm::load) for what is checked). On error the layer is unchanged.
    pub fn load_safetensors(&mut self, bytes: &[u8]) -> Result<(), WeightsError> {
        let file = SafeTensors::deserialize(bytes).map_err(|e| WeightsError::Format {
            reason: e.to_string(),
        })?;
        let names = self.weight_names();
        let expected = names.join(", ");
        let mut found: Vec<&str> = file.names();
        found.sort_unstable();
        if let Some(extra) = found.iter().find(|n| !names.contains(n)) {
            return Err(WeightsError::UnexpectedTensor {
                name: extra.to_string(),
                expected,
            });
        }
        let mut values = Vec::with_capacity(names.len());
        for name in names {
            let t = file.tensor(name).map_err(|_| WeightsError::MissingTensor {
                name: name.to_string(),
                expected: expected.clone(),
            })?;
            if t.dtype() != Dtype::F32 {
                return Err(WeightsError::DType {
                    name: name.to_string(),
                    found: t.dtype().to_string(),
                });
            }
            if t.shape() != [self.channels] {
                return Err(WeightsError::Shape {
                    name: name.to_string(),
                    expected: vec![self.channels],
                    found: t.shape().to_vec(),
                });
            }
            let v: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            values.push((name, v));
        }
        for (name, v) in values {
            *self.weight_mut(name) = v;
        }
        Ok(())
    }

    /// Saves the weights as a safetensors file (see
    /// [`to_safetensors`](BatchNorm::to_safetensors)).
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm};
    /// let path = std::env::temp_dir().join(format!("fusedbn-doc-{}.safetensors", std::process::id()));
    /// let mut bn = BatchNorm::new(DataFormat::Nchw, 3);
    /// bn.set_beta(&[0.1, 0.2, 0.3])?;
    /// bn.save(&path)?;
    /// let mut loaded = BatchNorm::new(DataFormat::Nchw, 3);
    /// loaded.load(&path)?;
    /// std::fs::remove_file(&path)?;
    /// assert_eq!(loaded.beta(), &[0.1, 0.2, 0.3]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), WeightsError> {
        let path = path.as_ref();
        let bytes = self.to_safetensors().map_err(|e| e.in_file(path))?;
        std::fs::write(path, bytes).map_err(|source| WeightsError::Io {
            path: path.to_path_buf(),
            action: "write",
            source,
        })
    }

    /// Loads the weights from a safetensors file (written by [`save`](BatchNorm::save),
    /// or converted from a Keras model with the same names).
    ///
    /// The file must hold exactly the tensors of
    /// [`weight_names`](BatchNorm::weight_names), each `F32` of shape `[C]`; anything
    /// else is an error naming the tensor, what was expected and what was found, and
    /// leaves the layer unchanged. The layer's configuration (format, momentum, ...)
    /// is not read from the file.
    ///
    /// ```
    /// use fusedbn::{DataFormat, layer::BatchNorm};
    /// let bytes = BatchNorm::new(DataFormat::Nhwc, 3).to_safetensors()?;
    /// let e = BatchNorm::new(DataFormat::Nhwc, 4).load_safetensors(&bytes).unwrap_err();
    /// assert_eq!(e.to_string(), "tensor \"gamma\": expected shape [4], found [3]");
    /// let e = BatchNorm::new(DataFormat::Nhwc, 3).with_scale(false).load_safetensors(&bytes).unwrap_err();
    /// assert!(e.to_string().starts_with("unexpected tensor \"gamma\""));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<(), WeightsError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| WeightsError::Io {
            path: path.to_path_buf(),
            action: "read",
            source,
        })?;
        self.load_safetensors(&bytes).map_err(|e| e.in_file(path))
    }

    fn weight(&self, name: &str) -> &[f32] {
        match name {
            "gamma" => &self.gamma,
            "beta" => &self.beta,
            "moving_mean" => &self.moving_mean,
            _ => &self.moving_variance,
        }
    }

    fn weight_mut(&mut self, name: &str) -> &mut Vec<f32> {
        match name {
            "gamma" => &mut self.gamma,
            "beta" => &mut self.beta,
            "moving_mean" => &mut self.moving_mean,
            _ => &mut self.moving_variance,
        }
    }

    fn metadata(&self) -> HashMap<String, String> {
        [
            ("layer", "BatchNormalization".to_string()),
            ("data_format", self.format.to_string()),
            ("axis", self.axis().to_string()),
            ("momentum", self.momentum.to_string()),
            ("epsilon", self.epsilon.to_string()),
            ("center", self.center.to_string()),
            ("scale", self.scale.to_string()),
            ("activation", self.activation().to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn activation(&self) -> Activation {
        if self.relu {
            Activation::Relu
        } else {
            Activation::Identity
        }
    }

    fn effective_gamma(&self) -> Cow<'_, [f32]> {
        if self.scale {
            Cow::Borrowed(&self.gamma)
        } else {
            Cow::Owned(vec![1.0; self.channels])
        }
    }

    fn effective_beta(&self) -> Cow<'_, [f32]> {
        if self.center {
            Cow::Borrowed(&self.beta)
        } else {
            Cow::Owned(vec![0.0; self.channels])
        }
    }

    /// The op's problem for an input of `shape`: padded to the format's rank, channel
    /// count checked, epsilon as Keras passes it.
    fn problem(&self, shape: &[usize]) -> Result<Problem> {
        let (rank, last) = (self.format.rank(), self.format.is_channels_last());
        if shape.len() < 2 || shape.len() > rank {
            return Err(Error::arg(
                "x",
                format!("a tensor of rank 2 to {rank} (data_format {})", self.format),
                format!("shape {shape:?} (rank {})", shape.len()),
            ));
        }
        let axis = if last { shape.len() - 1 } else { 1 };
        if shape[axis] != self.channels {
            return Err(Error::arg(
                "x",
                format!(
                    "{} channels on axis {axis} (data_format {})",
                    self.channels, self.format
                ),
                format!("shape {shape:?}"),
            ));
        }
        let mut full = shape.to_vec();
        let at = if last { 1 } else { 2 };
        full.splice(at..at, std::iter::repeat_n(1, rank - shape.len()));
        Ok(Problem::new(self.format, &full)?.with_epsilon(self.epsilon.max(MIN_EPSILON)))
    }
}

fn check_channels(arg: &str, len: usize, channels: usize) -> Result<()> {
    if len == channels {
        Ok(())
    } else {
        Err(Error::arg(
            arg,
            format!("{channels} elements (one per channel)"),
            format!("{len} elements"),
        ))
    }
}

fn set(dst: &mut [f32], arg: &str, values: &[f32]) -> Result<()> {
    check_channels(arg, values.len(), dst.len())?;
    dst.copy_from_slice(values);
    Ok(())
}

/// Why saving or loading a layer's weights failed. Every message names the tensor
/// (and the file, when there is one), what was expected and what was found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// The file could not be read or written.
    #[error("{}: could not {action} the file: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// `"read"` or `"write"`.
        action: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not a well-formed safetensors file.
    #[error("not a valid safetensors file: {reason}")]
    Format {
        /// What the safetensors reader reported.
        reason: String,
    },
    /// A tensor the layer needs is not in the file.
    #[error("missing tensor {name:?}: expected tensors {expected}")]
    MissingTensor {
        /// The missing tensor.
        name: String,
        /// The tensors the layer loads.
        expected: String,
    },
    /// The file holds a tensor the layer does not have (e.g. `gamma` for a layer with
    /// scale off).
    #[error("unexpected tensor {name:?}: expected tensors {expected}")]
    UnexpectedTensor {
        /// The tensor found.
        name: String,
        /// The tensors the layer loads.
        expected: String,
    },
    /// A tensor of the wrong shape.
    #[error("tensor {name:?}: expected shape {expected:?}, found {found:?}")]
    Shape {
        /// The tensor.
        name: String,
        /// `[C]`.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor of the wrong element type.
    #[error("tensor {name:?}: expected dtype F32, found {found}")]
    DType {
        /// The tensor.
        name: String,
        /// The dtype in the file, as safetensors names it.
        found: String,
    },
    /// An error about the contents of a file.
    #[error("{}: {source}", .path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: Box<WeightsError>,
    },
}

impl WeightsError {
    fn in_file(self, path: &Path) -> Self {
        WeightsError::InFile {
            path: path.to_path_buf(),
            source: Box::new(self),
        }
    }
}
