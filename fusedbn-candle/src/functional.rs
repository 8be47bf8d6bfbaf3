//! The functional API: batch norm on [`Tensor`]s, trainable through candle's autograd.
//!
//! `x` is `[N, C, *]` (rank 2 or more, as candle-nn's `BatchNorm` takes it), in any of
//! the memory layouts candle produces:
//! - contiguous (`[N, C, *]` row-major, "NCHW"): fusedbn's channels-first kernels;
//! - channels-last memory seen through a permuted view (the `[N, *, C]` buffer that
//!   `t.permute((0, 3, 1, 2))` makes look like `[N, C, H, W]`): fusedbn's channels-last
//!   kernels run on that buffer, nothing is copied, and `y` is the same kind of view;
//! - anything else is made contiguous first (one copy, as candle's own ops would).
//!
//! On a device other than the CPU, or with an element type other than f32, f64, f16 and
//! bf16, these functions run candle's own tensor ops (the formulas of candle-nn's
//! `BatchNorm`) instead: slower, same results.

use std::sync::{Arc, OnceLock};

use candle_core::{bail, DType, Result, Tensor};
use fusedbn::Problem;

use crate::op::{values, FusedBatchNorm, Mode, Stats};

/// What the forward does after the affine map: `y = relu?(bn(x) + side_input?)`, fused
/// into the same pass (TensorFlow's `_FusedBatchNormEx`). The default is plain batch
/// norm. The gradient reaches the side input too.
#[derive(Clone, Copy, Debug, Default)]
pub struct Epilogue<'a> {
    /// A residual the shape of `x`, added before the activation.
    pub side_input: Option<&'a Tensor>,
    /// Apply `max(0, ·)` last.
    pub relu: bool,
}

impl<'a> Epilogue<'a> {
    /// `y = relu(bn(x) + side_input)`, or `relu(bn(x))` without a side input.
    pub fn relu(side_input: Option<&'a Tensor>) -> Self {
        Epilogue {
            side_input,
            relu: true,
        }
    }
}

/// The result of [`batch_norm_train`].
#[derive(Clone, Debug)]
pub struct TrainOutput {
    /// The normalized output, the shape (and memory layout) of `x`.
    pub y: Tensor,
    /// The batch mean per channel, `[C]`, f32 (f64 for f64 data); not tracked.
    pub mean: Tensor,
    /// The biased batch variance per channel (`Σ(x−μ)²/M`), `[C]`, like `mean`.
    pub variance: Tensor,
}

/// Training-mode batch norm: normalizes each channel of `x` (`[N, C, *]`) with the
/// batch's own mean and biased variance, then `· weight + bias` (each `[C]`; `None`
/// means 1 and 0), then the [`Epilogue`]. Returns `y` and the batch statistics (the
/// caller updates its running statistics from them; [`crate::BatchNorm`] does it with
/// candle-nn's formulas).
///
/// Gradients flow to `x`, `weight`, `bias` and the side input, from one fused
/// backward kernel.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use fusedbn_candle::{batch_norm_train, Epilogue};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1., (8, 3, 4, 4), &dev)?;
/// let (w, b) = (Var::ones(3, candle_core::DType::F32, &dev)?, Var::zeros(3, candle_core::DType::F32, &dev)?);
/// let out = batch_norm_train(&x, Some(&w), Some(&b), 1e-5, Epilogue::default())?;
/// let loss = out.y.sqr()?.sum_all()?;
/// let grads = loss.backward()?;
/// assert_eq!(grads.get(&w).unwrap().dims(), [3]);
/// assert_eq!(out.mean.dims(), [3]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn batch_norm_train(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
    epilogue: Epilogue<'_>,
) -> Result<TrainOutput> {
    let saved = Arc::new(OnceLock::new());
    let run = Run {
        x,
        weight,
        bias,
        eps,
        epilogue,
    };
    if !run.fused() {
        return run.unfused_train();
    }
    let y = run.apply(Mode::Training(saved.clone()))?;
    let Some(stats) = saved.get() else {
        bail!("fusedbn: the training forward did not save its statistics")
    };
    let (mean, variance) = stat_tensors(stats, x)?;
    Ok(TrainOutput { y, mean, variance })
}

/// Inference-mode batch norm: normalizes each channel of `x` (`[N, C, *]`) with the
/// given population statistics (`[C]` each, any float type; not differentiated), then
/// `· weight + bias` (`None` means 1 and 0), then the [`Epilogue`]. Gradients flow to
/// `x`, `weight`, `bias` and the side input.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fusedbn_candle::{batch_norm_eval, Epilogue};
/// let dev = Device::Cpu;
/// let x = Tensor::new(&[[1f32, 10.], [3., 30.]], &dev)?; // [N = 2, C = 2]
/// let mean = Tensor::new(&[2f32, 20.], &dev)?;
/// let var = Tensor::new(&[1f32, 100.], &dev)?;
/// let y = batch_norm_eval(&x, &mean, &var, None, None, 0.0, Epilogue::default())?;
/// assert_eq!(y.to_vec2::<f32>()?, [[-1., -1.], [1., 1.]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn batch_norm_eval(
    x: &Tensor,
    mean: &Tensor,
    variance: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
    epilogue: Epilogue<'_>,
) -> Result<Tensor> {
    let run = Run {
        x,
        weight,
        bias,
        eps,
        epilogue,
    };
    if !run.fused() {
        return run.unfused_eval(mean, variance);
    }
    let stats = Stats {
        mean: values(mean)?,
        variance: values(variance)?,
    };
    run.apply(Mode::Inference(stats))
}

/// One call's arguments.
struct Run<'a> {
    x: &'a Tensor,
    weight: Option<&'a Tensor>,
    bias: Option<&'a Tensor>,
    eps: f64,
    epilogue: Epilogue<'a>,
}

/// True when fusedbn's kernels can run on `x`.
pub(crate) fn fusable(x: &Tensor) -> bool {
    x.device().is_cpu()
        && matches!(
            x.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        )
}

fn stat_dtype(x: DType) -> DType {
    if x == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn stat_tensors(s: &Stats, x: &Tensor) -> Result<(Tensor, Tensor)> {
    let dt = stat_dtype(x.dtype());
    let c = s.mean.len();
    let t = |v: &[f64]| Tensor::from_vec(v.to_vec(), c, x.device())?.to_dtype(dt);
    Ok((t(&s.mean)?, t(&s.variance)?))
}

impl Run<'_> {
    fn fused(&self) -> bool {
        fusable(self.x)
    }

    fn check(&self) -> Result<usize> {
        let x = self.x;
        if x.rank() < 2 {
            bail!(
                "batch-norm input tensor must have at least two dimensions ({:?})",
                x.shape()
            )
        }
        if self.eps < 0. {
            bail!("batch-norm eps cannot be negative {}", self.eps)
        }
        let c = x.dim(1)?;
        for (name, t) in [("weight", self.weight), ("bias", self.bias)] {
            if let Some(t) = t {
                if t.dims() != [c] {
                    bail!(
                        "batch-norm {name} has shape {:?}, should have shape [{c}] (the channel axis of x {:?})",
                        t.shape(),
                        x.shape()
                    )
                }
            }
        }
        if let Some(side) = self.epilogue.side_input {
            if side.shape() != x.shape() {
                bail!(
                    "batch-norm side input has shape {:?}, should have the shape of x {:?}",
                    side.shape(),
                    x.shape()
                )
            }
            if side.dtype() != x.dtype() {
                bail!(
                    "batch-norm side input is {:?}, x is {:?}",
                    side.dtype(),
                    x.dtype()
                )
            }
        }
        Ok(c)
    }

    /// The parameters as op arguments: the tensors themselves, or untracked constants.
    fn params(&self, c: usize) -> Result<(Tensor, Tensor)> {
        let dev = self.x.device();
        let dt = stat_dtype(self.x.dtype());
        let w = match self.weight {
            Some(w) => w.clone(),
            None => Tensor::ones(c, dt, dev)?,
        };
        let b = match self.bias {
            Some(b) => b.clone(),
            None => Tensor::zeros(c, dt, dev)?,
        };
        Ok((w, b))
    }

    fn apply(&self, mode: Mode) -> Result<Tensor> {
        let c = self.check()?;
        let x = self.x;
        let rank = x.rank();
        // The channels-last buffer behind a permuted [N, C, *] view, if that is what x
        // is: its [N, *, C] view is contiguous.
        let to_last: Vec<usize> = [0].into_iter().chain(2..rank).chain([1]).collect();
        let to_first: Vec<usize> = [0, rank - 1].into_iter().chain(1..rank - 1).collect();
        let last = (rank > 2 && !x.is_contiguous())
            .then(|| x.permute(to_last.as_slice()))
            .transpose()?
            .filter(|v| v.is_contiguous());
        let channels_last = last.is_some();
        let xs = match last {
            Some(v) => v,
            None => x.contiguous()?,
        };
        let problem = if channels_last {
            Problem::channels_last(xs.dims())
        } else {
            Problem::channels_first(xs.dims())
        }
        .map_err(candle_core::Error::wrap)?
        .with_epsilon(self.eps as f32);
        let (w, b) = self.params(c)?;
        let mut op = FusedBatchNorm {
            problem,
            mode,
            side_input: false,
            relu: self.epilogue.relu,
        };
        let y = match self.epilogue.side_input {
            None => xs.apply_op3(&w, &b, op)?,
            Some(side) => {
                let side = if channels_last {
                    side.permute(to_last.as_slice())?.contiguous()?
                } else {
                    side.contiguous()?
                };
                let packed = Tensor::cat(&[&w, &b.to_dtype(w.dtype())?], 0)?;
                op.side_input = true;
                xs.apply_op3(&side, &packed, op)?
            }
        };
        if channels_last {
            y.permute(to_first.as_slice())
        } else {
            Ok(y)
        }
    }

    /// `x` normalized with per-channel `mean` and `variance` (`[C]`, any float type),
    /// computed as candle-nn's `BatchNorm` computes it, then the affine map and the
    /// epilogue.
    fn finish(&self, xhat: Tensor) -> Result<Tensor> {
        let x = self.x;
        let shape: Vec<usize> = (0..x.rank())
            .map(|i| if i == 1 { x.dims()[1] } else { 1 })
            .collect();
        let mut y = xhat;
        if let Some(w) = self.weight {
            y = y.broadcast_mul(&w.to_dtype(y.dtype())?.reshape(shape.as_slice())?)?;
        }
        if let Some(b) = self.bias {
            y = y.broadcast_add(&b.to_dtype(y.dtype())?.reshape(shape.as_slice())?)?;
        }
        if let Some(side) = self.epilogue.side_input {
            y = (y + side)?;
        }
        if self.epilogue.relu {
            y = y.relu()?;
        }
        Ok(y)
    }

    fn unfused_train(&self) -> Result<TrainOutput> {
        let c = self.check()?;
        let x = self.x;
        let internal = stat_dtype(x.dtype());
        // [C, M], as candle-nn computes it.
        let xt = x.to_dtype(internal)?.transpose(0, 1)?;
        let dims_t = xt.dims().to_vec();
        let xt = xt.flatten_from(1)?.contiguous()?;
        let mean = xt.mean_keepdim(1)?;
        let xc = xt.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(1)?;
        let xhat = xc
            .broadcast_div(&(&var + self.eps)?.sqrt()?)?
            .to_dtype(x.dtype())?
            .reshape(dims_t)?
            .transpose(0, 1)?;
        let y = self.finish(xhat)?;
        Ok(TrainOutput {
            y,
            mean: mean.detach().reshape(c)?,
            variance: var.detach().reshape(c)?,
        })
    }

    fn unfused_eval(&self, mean: &Tensor, variance: &Tensor) -> Result<Tensor> {
        let x = self.x;
        self.check()?;
        let shape: Vec<usize> = (0..x.rank())
            .map(|i| if i == 1 { x.dims()[1] } else { 1 })
            .collect();
        let m = mean
            .detach()
            .to_dtype(x.dtype())?
            .reshape(shape.as_slice())?;
        let v = variance
            .detach()
            .to_dtype(x.dtype())?
            .reshape(shape.as_slice())?;
        let xhat = x
            .broadcast_sub(&m)?
            .broadcast_div(&(v + self.eps)?.sqrt()?)?;
        self.finish(xhat)
    }
}

#[cfg(test)]
mod tests {
    //! The fallback (candle's own ops, used off the CPU) against the fused op, on the CPU.
    use super::*;
    use candle_core::{Device, Var};

    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let s = b.abs().unwrap().max_all().unwrap();
        let f = |t: Tensor| t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        f(d) / f(s).max(1e-30)
    }

    #[test]
    fn the_unfused_fallback_computes_the_same() -> Result<()> {
        let dev = Device::Cpu;
        let shape = (4, 3, 5, 2);
        let x = Var::randn(1f32, 2., shape, &dev)?;
        let side = Var::randn(0f32, 1., shape, &dev)?;
        let w = Var::randn(1f32, 0.2, 3, &dev)?;
        let b = Var::randn(0f32, 0.2, 3, &dev)?;
        let (mean, var) = (
            Tensor::new(&[0.5f32, 1., 1.5], &dev)?,
            Tensor::new(&[1f32, 2., 3.], &dev)?,
        );
        let r = Tensor::randn(0f32, 1., shape, &dev)?;
        for relu in [false, true] {
            let run = Run {
                x: x.as_tensor(),
                weight: Some(w.as_tensor()),
                bias: Some(b.as_tensor()),
                eps: 1e-3,
                epilogue: Epilogue {
                    side_input: Some(side.as_tensor()),
                    relu,
                },
            };
            let fused = batch_norm_train(x.as_tensor(), Some(&w), Some(&b), 1e-3, run.epilogue)?;
            let unfused = run.unfused_train()?;
            assert!(rel(&fused.y, &unfused.y) < 1e-5);
            assert!(rel(&fused.mean, &unfused.mean) < 1e-6);
            assert!(rel(&fused.variance, &unfused.variance) < 1e-6);
            let eval = batch_norm_eval(
                x.as_tensor(),
                &mean,
                &var,
                Some(&w),
                Some(&b),
                1e-3,
                run.epilogue,
            )?;
            let eval_unfused = run.unfused_eval(&mean, &var)?;
            assert!(rel(&eval, &eval_unfused) < 1e-6);
            for (ya, yb) in [(&fused.y, &unfused.y), (&eval, &eval_unfused)] {
                let ga = (ya * &r)?.sum_all()?.backward()?;
                let gb = (yb * &r)?.sum_all()?.backward()?;
                for v in [&x, &side, &w, &b] {
                    let (p, q) = (ga.get(v).unwrap(), gb.get(v).unwrap());
                    assert!(rel(p, q) < 1e-5, "relu={relu}: {p} vs {q}");
                }
            }
        }
        Ok(())
    }
}
