//! [`BatchNorm`]: candle-nn's `BatchNorm` (same constructor, configuration, variable
//! names, semantics and checkpoints) with fusedbn's fused, trainable kernels.

use candle_core::{bail, ModuleT, Result, Tensor, Var};
use candle_nn::{BatchNormConfig, Init, VarBuilder};

use crate::functional::{batch_norm_eval, batch_norm_train, fusable, Epilogue};

/// Batch normalization over `[N, C, *]` inputs, a drop-in replacement for
/// [`candle_nn::BatchNorm`].
///
/// Built by [`batch_norm`] from candle-nn's own [`BatchNormConfig`] and `VarBuilder`
/// names (`running_mean`, `running_var`, `weight`, `bias`), so a model switches by
/// changing one `use` line and loads the same checkpoints. The semantics are
/// candle-nn's:
/// - training (`forward_t(x, true)`): normalize with the batch mean and biased batch
///   variance, and update the running statistics in place as
///   `running_mean ← (1 − momentum)·running_mean + momentum·mean` and
///   `running_var ← (1 − momentum)·running_var + momentum·M/(M − 1)·var`
///   (`M = numel(x)/C`; note that `momentum` weighs the *new* value, as in PyTorch);
/// - inference (`forward_t(x, false)`): normalize with the running statistics;
/// - `y = (x − mean)/√(var + eps)·weight + bias`, without `weight` and `bias` when
///   `affine` is false.
///
/// What differs: the forward and its gradient are one fused kernel call each on the CPU
/// (f32, f64, f16, bf16; statistics in f32 for the halves, rounded once at the end), a
/// channels-last input stays channels-last, training works in f16 and bf16 (candle-nn
/// fails there with a dtype mismatch), and [`BatchNorm::forward_ex`] fuses a residual
/// add and a ReLU. On another device, or with `remove_mean = false`, it runs
/// candle-nn's own code on the same variables.
///
/// ```
/// use candle_core::{DType, Device, ModuleT, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use fusedbn_candle::{batch_norm, BatchNorm}; // was: use candle_nn::{batch_norm, BatchNorm};
///
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let bn: BatchNorm = batch_norm(16, candle_nn::BatchNormConfig::default(), vb.pp("bn"))?;
/// let x = Tensor::randn(0f32, 1., (4, 16, 8, 8), &Device::Cpu)?;
/// let y = bn.forward_t(&x, true)?; // training: batch statistics, running stats updated
/// assert_eq!(y.dims(), x.dims());
/// let y = bn.forward_t(&x, false)?; // inference: running statistics
/// assert!(varmap.data().lock().unwrap().contains_key("bn.running_mean"));
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct BatchNorm {
    running_mean: Var,
    running_var: Var,
    weight_and_bias: Option<(Tensor, Tensor)>,
    remove_mean: bool,
    eps: f64,
    momentum: f64,
}

/// Builds a [`BatchNorm`] from a `VarBuilder`, exactly as [`candle_nn::batch_norm`] does:
/// the same names, initial values (`running_mean` 0, `running_var` 1, `weight` 1,
/// `bias` 0) and checks.
pub fn batch_norm<C: Into<BatchNormConfig>>(
    num_features: usize,
    config: C,
    vb: VarBuilder,
) -> Result<BatchNorm> {
    let config = config.into();
    if config.eps < 0. {
        bail!("batch-norm eps cannot be negative {}", config.eps)
    }
    let running_mean = vb.get_with_hints(num_features, "running_mean", Init::Const(0.))?;
    let running_var = vb.get_with_hints(num_features, "running_var", Init::Const(1.))?;
    let weight_and_bias = if config.affine {
        let weight = vb.get_with_hints(num_features, "weight", Init::Const(1.))?;
        let bias = vb.get_with_hints(num_features, "bias", Init::Const(0.))?;
        Some((weight, bias))
    } else {
        None
    };
    Ok(BatchNorm {
        running_mean: Var::from_tensor(&running_mean)?,
        running_var: Var::from_tensor(&running_var)?,
        weight_and_bias,
        remove_mean: config.remove_mean,
        eps: config.eps,
        momentum: config.momentum,
    })
}

impl BatchNorm {
    fn check_validity(&self, num_features: usize) -> Result<()> {
        if self.eps < 0. {
            bail!("batch-norm eps cannot be negative {}", self.eps)
        }
        if !(0.0..=1.0).contains(&self.momentum) {
            bail!(
                "batch-norm momentum must be between 0 and 1, is {}",
                self.momentum
            )
        }
        let named = [
            ("running mean", Some(self.running_mean.as_tensor())),
            ("running variance", Some(self.running_var.as_tensor())),
            ("weight", self.weight_and_bias.as_ref().map(|w| &w.0)),
            ("bias", self.weight_and_bias.as_ref().map(|w| &w.1)),
        ];
        for (name, t) in named {
            if let Some(t) = t {
                if t.dims() != [num_features] {
                    bail!(
                        "batch-norm {name} has unexpected shape {:?} should have shape [{num_features}]",
                        t.shape()
                    )
                }
            }
        }
        Ok(())
    }

    fn build(
        num_features: usize,
        running: (Tensor, Tensor),
        weight_and_bias: Option<(Tensor, Tensor)>,
        eps: f64,
        momentum: f64,
    ) -> Result<Self> {
        let out = BatchNorm {
            running_mean: Var::from_tensor(&running.0)?,
            running_var: Var::from_tensor(&running.1)?,
            weight_and_bias,
            remove_mean: true,
            eps,
            momentum,
        };
        out.check_validity(num_features)?;
        Ok(out)
    }

    /// As [`candle_nn::BatchNorm::new`] (momentum 0.1).
    pub fn new(
        num_features: usize,
        running_mean: Tensor,
        running_var: Tensor,
        weight: Tensor,
        bias: Tensor,
        eps: f64,
    ) -> Result<Self> {
        let running = (running_mean, running_var);
        Self::build(num_features, running, Some((weight, bias)), eps, 0.1)
    }

    /// As [`candle_nn::BatchNorm::new_no_bias`]: no affine parameters.
    pub fn new_no_bias(
        num_features: usize,
        running_mean: Tensor,
        running_var: Tensor,
        eps: f64,
    ) -> Result<Self> {
        Self::build(num_features, (running_mean, running_var), None, eps, 0.1)
    }

    /// As [`candle_nn::BatchNorm::new_with_momentum`].
    pub fn new_with_momentum(
        num_features: usize,
        running_mean: Tensor,
        running_var: Tensor,
        weight: Tensor,
        bias: Tensor,
        eps: f64,
        momentum: f64,
    ) -> Result<Self> {
        let running = (running_mean, running_var);
        Self::build(num_features, running, Some((weight, bias)), eps, momentum)
    }

    /// As [`candle_nn::BatchNorm::new_no_bias_with_momentum`].
    pub fn new_no_bias_with_momentum(
        num_features: usize,
        running_mean: Tensor,
        running_var: Tensor,
        eps: f64,
        momentum: f64,
    ) -> Result<Self> {
        let running = (running_mean, running_var);
        Self::build(num_features, running, None, eps, momentum)
    }

    /// The running mean (a variable).
    pub fn running_mean(&self) -> &Tensor {
        self.running_mean.as_tensor()
    }

    /// The running (Bessel-corrected) variance (a variable).
    pub fn running_var(&self) -> &Tensor {
        self.running_var.as_tensor()
    }

    /// Epsilon, added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// `weight` and `bias`, when `affine`.
    pub fn weight_and_bias(&self) -> Option<(&Tensor, &Tensor)> {
        self.weight_and_bias.as_ref().map(|v| (&v.0, &v.1))
    }

    /// The running statistics' update weight.
    pub fn momentum(&self) -> f64 {
        self.momentum
    }

    /// False when built with `remove_mean = false` (then every forward runs candle-nn's
    /// code).
    pub fn remove_mean(&self) -> bool {
        self.remove_mean
    }

    /// candle-nn's `BatchNorm` on the same variables (running statistics, weight and
    /// bias are shared, not copied: training either one updates both).
    pub fn to_candle_nn(&self) -> Result<candle_nn::BatchNorm> {
        let c = self.running_mean.dim(0)?;
        if self.remove_mean {
            let (rm, rv) = (self.running_mean(), self.running_var());
            return match &self.weight_and_bias {
                Some((w, b)) => candle_nn::BatchNorm::new_with_momentum(
                    c,
                    rm.clone(),
                    rv.clone(),
                    w.clone(),
                    b.clone(),
                    self.eps,
                    self.momentum,
                ),
                None => candle_nn::BatchNorm::new_no_bias_with_momentum(
                    c,
                    rm.clone(),
                    rv.clone(),
                    self.eps,
                    self.momentum,
                ),
            };
        }
        // Only candle-nn's `batch_norm` sets `remove_mean`: hand it our tensors through
        // a VarBuilder (which returns them as they are, so they stay shared).
        let mut ts = std::collections::HashMap::new();
        ts.insert("running_mean".to_string(), self.running_mean().clone());
        ts.insert("running_var".to_string(), self.running_var().clone());
        if let Some((w, b)) = &self.weight_and_bias {
            ts.insert("weight".to_string(), w.clone());
            ts.insert("bias".to_string(), b.clone());
        }
        let rm = self.running_mean();
        let vb = VarBuilder::from_tensors(ts, rm.dtype(), rm.device());
        let config = BatchNormConfig {
            eps: self.eps,
            remove_mean: false,
            affine: self.weight_and_bias.is_some(),
            momentum: self.momentum,
        };
        candle_nn::batch_norm(c, config, vb)
    }

    /// True when this input runs on fusedbn's kernels (else candle-nn's code runs).
    pub fn is_fused_for(&self, x: &Tensor) -> bool {
        self.remove_mean && fusable(x)
    }

    fn check_input(&self, x: &Tensor) -> Result<()> {
        let num_features = self.running_mean.dim(0)?;
        if x.rank() < 2 {
            bail!(
                "batch-norm input tensor must have at least two dimensions ({:?})",
                x.shape()
            )
        }
        if x.dim(1)? != num_features {
            bail!(
                "batch-norm input doesn't have the expected number of features ({:?} <> {})",
                x.shape(),
                num_features
            )
        }
        Ok(())
    }

    /// The training forward (batch statistics; running statistics updated).
    pub fn forward_train(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_ex(x, None, false, true)
    }

    /// `y = relu?(bn(x) + side_input?)` in one fused pass (TensorFlow's
    /// `_FusedBatchNormEx`), in training (`train = true`, as
    /// [`forward_t`](ModuleT::forward_t) with batch statistics) or inference. The
    /// gradient reaches `x`, `weight`, `bias` and the side input, from one fused
    /// backward call.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor, Var};
    /// use candle_nn::{VarBuilder, VarMap};
    /// let varmap = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    /// let bn = fusedbn_candle::batch_norm(4, 1e-5, vb)?;
    /// let x = Tensor::randn(0f32, 1., (2, 4, 3, 3), &Device::Cpu)?;
    /// let shortcut = Var::randn(0f32, 1., (2, 4, 3, 3), &Device::Cpu)?;
    /// let y = bn.forward_ex(&x, Some(&shortcut), true, true)?; // relu(bn(x) + shortcut)
    /// let grads = y.sum_all()?.backward()?;
    /// assert!(grads.get(&shortcut).is_some());
    /// assert!(y.flatten_all()?.min(0)?.to_scalar::<f32>()? >= 0.0);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn forward_ex(
        &self,
        x: &Tensor,
        side_input: Option<&Tensor>,
        relu: bool,
        train: bool,
    ) -> Result<Tensor> {
        self.check_input(x)?;
        let epilogue = Epilogue { side_input, relu };
        if !self.is_fused_for(x) {
            // candle-nn's own code, on the same variables, then the epilogue.
            let mut y = self.to_candle_nn()?.forward_t(x, train)?;
            if let Some(s) = side_input {
                y = (y + s)?;
            }
            return if relu { y.relu() } else { Ok(y) };
        }
        let (w, b) = match self.weight_and_bias() {
            Some((w, b)) => (Some(w), Some(b)),
            None => (None, None),
        };
        if !train {
            let (rm, rv) = (
                self.running_mean.as_detached_tensor(),
                self.running_var.as_detached_tensor(),
            );
            return batch_norm_eval(x, &rm, &rv, w, b, self.eps, epilogue);
        }
        let out = batch_norm_train(x, w, b, self.eps, epilogue)?;
        self.update_running(x, &out.mean, &out.variance)?;
        Ok(out.y)
    }

    /// candle-nn's update, in its arithmetic: `(1 − m)·running + m·batch`, with the
    /// variance scaled by `M/(M − 1)` (computed in the statistics type, f32 or f64, and
    /// stored in the variables' type — candle-nn fails when they differ).
    fn update_running(&self, x: &Tensor, mean: &Tensor, var: &Tensor) -> Result<()> {
        let c = self.running_mean.dim(0)?;
        let m = self.momentum;
        let batch = (x.elem_count() / c.max(1)) as f64;
        let update = |v: &Var, batch_value: &Tensor, weight: f64| -> Result<()> {
            let running = v.as_detached_tensor();
            let dtype = running.dtype();
            let fresh = ((running.to_dtype(batch_value.dtype())? * (1.0 - m))?
                + (batch_value * weight)?)?
                .to_dtype(dtype)?;
            v.set(&fresh)
        };
        update(&self.running_mean, mean, m)?;
        update(&self.running_var, var, m * batch / (batch - 1.0))
    }
}

impl ModuleT for BatchNorm {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_ex(x, None, false, train)
    }
}

impl From<candle_nn::BatchNorm> for BatchNorm {
    /// The same layer on the same variables (shared, not copied).
    fn from(bn: candle_nn::BatchNorm) -> Self {
        // candle-nn keeps `remove_mean` private; its `Debug` output is the only place it
        // shows (only `candle_nn::batch_norm` can set it to false).
        let remove_mean = !format!("{bn:?}").contains("remove_mean: false");
        BatchNorm {
            running_mean: var_of(bn.running_mean()),
            running_var: var_of(bn.running_var()),
            weight_and_bias: bn.weight_and_bias().map(|(w, b)| (w.clone(), b.clone())),
            remove_mean,
            eps: bn.eps(),
            momentum: bn.momentum(),
        }
    }
}

/// candle-nn's running statistics are always variables (its constructors make them
/// so), and `Var::from_tensor` returns a variable's tensor as it is: shared, infallible.
fn var_of(t: &Tensor) -> Var {
    Var::from_tensor(t).expect("candle-nn keeps its running statistics in variables")
}

impl TryFrom<BatchNorm> for candle_nn::BatchNorm {
    type Error = candle_core::Error;
    /// candle-nn's layer on the same variables; see [`BatchNorm::to_candle_nn`].
    fn try_from(bn: BatchNorm) -> Result<Self> {
        bn.to_candle_nn()
    }
}

impl TryFrom<&BatchNorm> for candle_nn::BatchNorm {
    type Error = candle_core::Error;
    fn try_from(bn: &BatchNorm) -> Result<Self> {
        bn.to_candle_nn()
    }
}
