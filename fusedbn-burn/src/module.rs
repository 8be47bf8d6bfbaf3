//! The drop-in module: `burn::nn::BatchNorm`'s fields, records and semantics on
//! fusedbn's kernels.

use burn::config::Config;
use burn::module::{Content, DisplaySettings, Flag, Module, ModuleDisplay, Param, RunningState};
use burn::nn::Initializer;
use burn::tensor::{Device, Tensor};

/// [`BatchNorm`]'s configuration: `burn::nn::BatchNormConfig`'s fields and defaults
/// (epsilon 1e-5, momentum 0.1).
///
/// ```
/// use fusedbn_burn::BatchNormConfig;
/// let config = BatchNormConfig::new(64).with_momentum(0.01);
/// assert_eq!((config.epsilon, config.momentum), (1e-5, 0.01));
/// ```
#[derive(Config, Debug)]
pub struct BatchNormConfig {
    /// The number of features (channels). Must be greater than zero.
    pub num_features: usize,
    /// A finite, positive value added to the variance. Default: 1e-5
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// A finite momentum in `[0, 1]` for the running statistics:
    /// `running = (1 − momentum)·running + momentum·batch`. Default: 0.1
    #[config(default = 0.1)]
    pub momentum: f64,
}

impl From<burn::nn::BatchNormConfig> for BatchNormConfig {
    fn from(c: burn::nn::BatchNormConfig) -> Self {
        BatchNormConfig {
            num_features: c.num_features,
            epsilon: c.epsilon,
            momentum: c.momentum,
        }
    }
}

impl From<BatchNormConfig> for burn::nn::BatchNormConfig {
    fn from(c: BatchNormConfig) -> Self {
        burn::nn::BatchNormConfig {
            num_features: c.num_features,
            epsilon: c.epsilon,
            momentum: c.momentum,
        }
    }
}

impl BatchNormConfig {
    /// A new module: `gamma` ones, `beta` zeros, running mean zeros, running
    /// variance ones, training enabled — as `burn::nn::BatchNormConfig::init`.
    ///
    /// # Panics
    ///
    /// As burn's: when `num_features` is zero, `epsilon` is not finite and positive,
    /// or `momentum` is not finite and within `[0, 1]`.
    pub fn init(&self, device: &Device) -> BatchNorm {
        assert!(
            self.num_features > 0,
            "num_features must be greater than zero."
        );
        assert!(
            self.epsilon.is_finite() && self.epsilon > 0.0,
            "epsilon must be finite and positive."
        );
        assert!(
            self.momentum.is_finite() && (0.0..=1.0).contains(&self.momentum),
            "momentum must be finite and within [0, 1]."
        );
        let n = self.num_features;
        BatchNorm {
            gamma: Initializer::Ones.init([n], device),
            beta: Initializer::Zeros.init([n], device),
            training: Param::from_bool(true),
            running_mean: RunningState::new(Tensor::zeros([n], device)),
            running_var: RunningState::new(Tensor::ones([n], device)),
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }
}

/// Batch normalization over `[N, C, *]` with fusedbn's kernels: a drop-in for
/// `burn::nn::BatchNorm`.
///
/// The same fields, so the same record paths (`gamma`, `beta`, `running_mean`,
/// `running_var`): a record saved from `burn::nn::BatchNorm` loads into this module
/// and back. The same semantics: it trains when its input is on an autodiff device
/// and it is not frozen ([`Module::valid`]/`freeze` turn training off), normalizing
/// with the batch mean and biased variance and updating
/// `running = (1 − momentum)·running + momentum·batch` with the **biased** batch
/// variance, as burn does; otherwise it normalizes with the running statistics.
///
/// On Flex (with or without autodiff) the forward pass is one fusedbn kernel and,
/// when training, the backward pass one node computing `dx`, `dgamma` and `dbeta`
/// together; on other devices it runs burn's own operations
/// ([`crate::is_fused`]).
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use fusedbn_burn::{BatchNorm, BatchNormConfig};
///
/// let device = Device::flex().autodiff();
/// let bn = BatchNormConfig::new(2).init(&device);
/// let x = Tensor::<2>::from_floats([[1.0, 0.0], [3.0, 4.0]], &device);
/// let y = bn.forward(x);
/// // batch mean [2, 2], biased variance [1, 4]: momentum 0.1 from [0, 0] and [1, 1]
/// let running = bn.running_mean.value_sync().into_data().try_to_vec::<f32>().unwrap();
/// assert!((running[0] - 0.2).abs() < 1e-6);
/// let running_var = bn.running_var.value_sync().into_data().try_to_vec::<f32>().unwrap();
/// assert!((running_var[1] - 1.3).abs() < 1e-6);
/// // and the same parameters as burn's own module
/// let theirs: burn::nn::BatchNorm = bn.into();
/// let ours = BatchNorm::from(theirs);
/// # let _ = (y, ours);
/// ```
#[derive(Module, Debug)]
#[module(custom_display)]
pub struct BatchNorm {
    /// The learnable scale gamma, `[C]`.
    pub gamma: Param<Tensor<1>>,
    /// The learnable offset beta, `[C]`.
    pub beta: Param<Tensor<1>>,
    /// Whether training behavior is enabled for this layer.
    pub training: Param<Flag>,
    /// The running mean, `[C]`.
    pub running_mean: RunningState<Tensor<1>>,
    /// The running (biased) variance, `[C]`.
    pub running_var: RunningState<Tensor<1>>,
    /// Momentum of the running statistics.
    pub momentum: f64,
    /// Added to the variance before the reciprocal square root.
    pub epsilon: f64,
}

impl BatchNorm {
    /// Normalizes `input` (`[N, C, *]`, `C` = the number of features).
    ///
    /// # Panics
    ///
    /// When the rank is below 2 or the second axis is not the number of features.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let [num_features] = self.gamma.shape().dims();
        burn::tensor::assert_shape!(input, [_, num_features, ..]);
        // As burn: training needs an autodiff device *and* a layer not frozen.
        if input.device().is_autodiff() && self.training.is_enabled() {
            self.forward_train(input)
        } else {
            self.forward_inference(input)
        }
    }

    fn forward_inference<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let device = input.device();
        let mean = self.running_mean.value().to_device(&device);
        let var = self.running_var.value().to_device(&device);
        crate::batch_norm(
            input,
            self.gamma.val(),
            self.beta.val(),
            mean,
            var,
            self.epsilon,
        )
    }

    fn forward_train<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let device = input.device();
        let result =
            crate::batch_norm_train(input, self.gamma.val(), self.beta.val(), self.epsilon);
        // burn's update, operation for operation, so the numbers are burn's.
        let running_mean = self.running_mean.value_sync().to_device(&device);
        let running_var = self.running_var.value_sync().to_device(&device);
        let running_mean = running_mean
            .mul_scalar(1.0 - self.momentum)
            .add(result.mean.detach().mul_scalar(self.momentum));
        let running_var = running_var
            .mul_scalar(1.0 - self.momentum)
            .add(result.variance.detach().mul_scalar(self.momentum));
        self.running_mean.update(running_mean.detach());
        self.running_var.update(running_var.detach());
        result.output
    }
}

impl From<burn::nn::BatchNorm> for BatchNorm {
    /// Takes over burn's module: the same parameters (ids included, so an
    /// optimizer's state carries on), running statistics and settings.
    fn from(bn: burn::nn::BatchNorm) -> Self {
        BatchNorm {
            gamma: bn.gamma,
            beta: bn.beta,
            training: bn.training,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            momentum: bn.momentum,
            epsilon: bn.epsilon,
        }
    }
}

impl From<BatchNorm> for burn::nn::BatchNorm {
    /// Hands the module back to burn, parameters and statistics unchanged.
    fn from(bn: BatchNorm) -> Self {
        burn::nn::BatchNorm {
            gamma: bn.gamma,
            beta: bn.beta,
            training: bn.training,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            momentum: bn.momentum,
            epsilon: bn.epsilon,
        }
    }
}

impl ModuleDisplay for BatchNorm {
    fn custom_settings(&self) -> Option<DisplaySettings> {
        DisplaySettings::new()
            .with_new_line_after_attribute(false)
            .optional()
    }

    fn custom_content(&self, content: Content) -> Option<Content> {
        let [num_features] = self.beta.shape().dims();
        let content = content
            .add("num_features", &num_features)
            .add("momentum", &self.momentum)
            .add("epsilon", &self.epsilon);
        if self.training.is_enabled() {
            content.optional()
        } else {
            content.add("training", &self.training).optional()
        }
    }
}
