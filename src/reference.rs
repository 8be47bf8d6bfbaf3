//! The test oracle: every op in `f64` with obvious loops, straight from SPEC §3 and §5.
//!
//! Nothing here is fast or clever; it exists so that the optimized kernels can be
//! checked against something a reader can verify in five minutes. Inputs are `f64`
//! (widen half data first: widening is exact); outputs are unrounded `f64`. The
//! parameters are the typed API's named structs ([`Affine`], [`Statistics`],
//! [`GradInputs`], [`SecondOrderInputs`]) with `f64` elements; shape, layout and epsilon
//! come from the [`Problem`].
//!
//! ```
//! use fusedbn::{DataFormat, Problem, reference::{self, ForwardMode}};
//! use fusedbn::batch_norm::Affine;
//! let p = Problem::new(DataFormat::Nhwc, &[1, 1, 6, 1])?.with_epsilon(0.001);
//! let x = [5.0, 7.0, 9.0, 11.0, 13.0, 15.0];
//! let f = reference::forward(&p, &x, Affine { scale: &[4.0], offset: &[2.0] },
//!     ForwardMode::Training { running: None, factor: 1.0 });
//! assert_eq!(f.reserve_space_1, [10.0]);
//! assert!((f.y[0] - -3.86).abs() < 0.01);
//! # Ok::<(), fusedbn::Error>(())
//! ```

use crate::batch_norm::{
    Affine, Backward, GradInputs, Mode, Problem, SecondOrderInputs, Statistics,
};

/// The channel of every element of `x`, in storage order.
fn channels(p: &Problem) -> impl Iterator<Item = usize> {
    let g = *p.geometry();
    (0..g.len()).map(move |i| (i / g.inner) % g.channels.max(1))
}

/// The forward mode of [`forward`].
#[derive(Clone, Copy, Debug)]
pub enum ForwardMode<'a> {
    /// Batch statistics; `running` (the op's `mean`/`variance` inputs) is read only when
    /// `factor != 1`.
    Training {
        /// The running statistics before the update.
        running: Option<Statistics<'a, f64>>,
        /// `exponential_avg_factor`.
        factor: f64,
    },
    /// Population statistics.
    Inference(Statistics<'a, f64>),
}

/// Outputs of a forward op.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardOutputs {
    /// `y`, same layout as `x`.
    pub y: Vec<f64>,
    /// Output `batch_mean`.
    pub batch_mean: Vec<f64>,
    /// Output `batch_variance`.
    pub batch_variance: Vec<f64>,
    /// `reserve_space_1`.
    pub reserve_space_1: Vec<f64>,
    /// `reserve_space_2`.
    pub reserve_space_2: Vec<f64>,
}

/// Outputs of a gradient op.
#[derive(Clone, Debug, PartialEq)]
pub struct GradOutputs {
    /// `x_backprop`, same layout as `x`.
    pub x_backprop: Vec<f64>,
    /// `scale_backprop`.
    pub scale_backprop: Vec<f64>,
    /// `offset_backprop`.
    pub offset_backprop: Vec<f64>,
}

/// A forward op (SPEC §3): `y`, and the statistics outputs (in inference, the given
/// statistics passed through; NaN for an empty `x`).
pub fn forward(
    p: &Problem,
    x: &[f64],
    affine: Affine<'_, f64>,
    mode: ForwardMode<'_>,
) -> ForwardOutputs {
    let c = p.channels();
    let epsilon = f64::from(p.epsilon());
    let (scale, offset) = (affine.scale, affine.offset);
    let (mu, var, batch) = match mode {
        ForwardMode::Training { running, factor } => {
            let m = x.len() / c.max(1);
            let mut sum = vec![0.0; c];
            for (ch, v) in channels(p).zip(x) {
                sum[ch] += v;
            }
            let mu: Vec<f64> = sum.iter().map(|s| s / m as f64).collect();
            let mut sq = vec![0.0; c];
            for (ch, v) in channels(p).zip(x) {
                sq[ch] += (v - mu[ch]) * (v - mu[ch]);
            }
            let var: Vec<f64> = sq.iter().map(|s| s / m as f64).collect();
            let adj = m as f64 / (m as f64 - 1.0).max(1.0);
            let batch = if x.is_empty() {
                (vec![f64::NAN; c], vec![f64::NAN; c])
            } else if factor == 1.0 {
                (mu.clone(), var.iter().map(|v| adj * v).collect())
            } else {
                let r = running.unwrap_or(Statistics {
                    mean: &[],
                    variance: &[],
                });
                let old = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(f64::NAN);
                (
                    (0..c)
                        .map(|i| (1.0 - factor) * old(r.mean, i) + factor * mu[i])
                        .collect(),
                    (0..c)
                        .map(|i| (1.0 - factor) * old(r.variance, i) + factor * adj * var[i])
                        .collect(),
                )
            };
            (mu, var, batch)
        }
        ForwardMode::Inference(s) => {
            let batch = if x.is_empty() {
                (vec![f64::NAN; c], vec![f64::NAN; c])
            } else {
                (s.mean.to_vec(), s.variance.to_vec())
            };
            (s.mean.to_vec(), s.variance.to_vec(), batch)
        }
    };
    let y = channels(p)
        .zip(x)
        .map(|(ch, v)| (v - mu[ch]) * (scale[ch] / (var[ch] + epsilon).sqrt()) + offset[ch])
        .collect();
    let training = matches!(mode, ForwardMode::Training { .. });
    let (batch_mean, batch_variance) = batch;
    ForwardOutputs {
        y,
        reserve_space_1: if training { mu } else { batch_mean.clone() },
        reserve_space_2: if training {
            var
        } else {
            batch_variance.clone()
        },
        batch_mean,
        batch_variance,
    }
}

/// A gradient op: `mode` carries the batch mean and biased variance (training) or the
/// population statistics (inference).
pub fn backward(
    p: &Problem,
    inputs: GradInputs<'_, f64>,
    scale: &[f64],
    mode: Backward<'_, f64>,
) -> GradOutputs {
    let (dy, x) = (inputs.y_backprop, inputs.x);
    let (rs1, rs2) = (mode.statistics().mean, mode.statistics().variance);
    let is_training = mode.is_training();
    let epsilon = f64::from(p.epsilon());
    let c = p.channels();
    let m = x.len() / c.max(1);
    let r: Vec<f64> = rs2.iter().map(|v| 1.0 / (v + epsilon).sqrt()).collect();
    let (mut sum_dy, mut sum_dy_xc) = (vec![0.0; c], vec![0.0; c]);
    for ((ch, d), v) in channels(p).zip(dy).zip(x) {
        sum_dy[ch] += d;
        sum_dy_xc[ch] += d * (v - rs1[ch]);
    }
    let x_backprop = channels(p)
        .zip(dy)
        .zip(x)
        .map(|((ch, d), v)| {
            if is_training {
                let xc = v - rs1[ch];
                scale[ch]
                    * r[ch]
                    * (d - sum_dy[ch] / m as f64 - xc * r[ch] * r[ch] * sum_dy_xc[ch] / m as f64)
            } else {
                d * scale[ch] * r[ch]
            }
        })
        .collect();
    let scale_backprop = if x.is_empty() {
        vec![0.0; c]
    } else {
        (0..c).map(|i| r[i] * sum_dy_xc[i]).collect()
    };
    GradOutputs {
        x_backprop,
        scale_backprop,
        offset_backprop: sum_dy,
    }
}

/// The Ex forward epilogue applied to a forward result `y`: `act(y + side)`.
pub fn epilogue(y: &[f64], side: Option<&[f64]>, relu: bool) -> Vec<f64> {
    y.iter()
        .enumerate()
        .map(|(i, &v)| {
            let v = v + side.map_or(0.0, |s| s[i]);
            if relu && v < 0.0 {
                0.0
            } else {
                v
            }
        })
        .collect()
}

/// ReLU's gradient mask: `dy` where the forward output `y > 0`, else 0.
pub fn relu_mask(dy: &[f64], y: &[f64]) -> Vec<f64> {
    dy.iter()
        .zip(y)
        .map(|(&d, &v)| if v > 0.0 { d } else { 0.0 })
        .collect()
}

/// Outputs of a second-order gradient op.
#[derive(Clone, Debug, PartialEq)]
pub struct SecondOrderOutputs {
    /// Gradient with respect to `y_backprop`.
    pub grad_y_backprop: Vec<f64>,
    /// Gradient with respect to `x`.
    pub grad_x: Vec<f64>,
    /// Gradient with respect to `scale`.
    pub grad_scale: Vec<f64>,
}

/// The gradient of the gradient op (SPEC §3, second order): `g = y_backprop`, and the
/// upstream gradients `ga` (for `x_backprop`, the shape of x), `gs` (for
/// `scale_backprop`) and `go` (for `offset_backprop`). In training the mean and
/// variance are recomputed from `x` (as TensorFlow does); in inference they are
/// `inputs.reserve`.
pub fn second_order(
    p: &Problem,
    inputs: SecondOrderInputs<'_, f64>,
    mode: Mode,
) -> SecondOrderOutputs {
    let SecondOrderInputs {
        y_backprop: g,
        x,
        scale,
        reserve,
        grad_x_backprop: ga,
        grad_scale_backprop: gs,
        grad_offset_backprop: go,
    } = inputs;
    let is_training = mode == Mode::Training;
    let epsilon = f64::from(p.epsilon());
    let c = p.channels();
    let m = (x.len() / c.max(1)) as f64;
    let ch: Vec<usize> = channels(p).collect();
    let (mu, var) = if is_training {
        let ones = vec![1.0; c];
        let zeros = vec![0.0; c];
        let affine = Affine {
            scale: &ones,
            offset: &zeros,
        };
        let mode = ForwardMode::Training {
            running: None,
            factor: 1.0,
        };
        let f = forward(p, x, affine, mode);
        (f.reserve_space_1, f.reserve_space_2)
    } else {
        (reserve.mean.to_vec(), reserve.variance.to_vec())
    };
    let r: Vec<f64> = var.iter().map(|v| 1.0 / (v + epsilon).sqrt()).collect();
    let xh: Vec<f64> = (0..x.len())
        .map(|i| (x[i] - mu[ch[i]]) * r[ch[i]])
        .collect();
    let mean_of = |f: &dyn Fn(usize) -> f64| {
        let mut s = vec![0.0; c];
        for i in 0..x.len() {
            s[ch[i]] += f(i);
        }
        s.iter().map(|v| v / m).collect::<Vec<f64>>()
    };
    let gbar = mean_of(&|i| g[i]);
    let abar = mean_of(&|i| ga[i]);
    let s2 = mean_of(&|i| g[i] * xh[i]);
    let t = mean_of(&|i| ga[i] * xh[i]);
    let k = mean_of(&|i| ga[i] * (g[i] - gbar[ch[i]]));
    let mut grad_scale = vec![0.0; c];
    let mut grad_y_backprop = vec![0.0; x.len()];
    let mut grad_x = vec![0.0; x.len()];
    for i in 0..x.len() {
        let j = ch[i];
        let (sc, rr) = (scale[j], r[j]);
        if is_training {
            grad_y_backprop[i] = sc * rr * (ga[i] - abar[j] - xh[i] * t[j]) + gs[j] * xh[i] + go[j];
            grad_scale[j] += rr * ga[i] * (g[i] - gbar[j] - xh[i] * s2[j]);
            grad_x[i] = -sc
                * rr
                * rr
                * (xh[i] * (k[j] - 3.0 * s2[j] * t[j])
                    + (g[i] - gbar[j]) * t[j]
                    + (ga[i] - abar[j]) * s2[j])
                + gs[j] * rr * (g[i] - gbar[j] - xh[i] * s2[j]);
        } else {
            grad_y_backprop[i] = sc * rr * ga[i] + gs[j] * rr * (x[i] - mu[j]) + go[j];
            grad_scale[j] += rr * ga[i] * g[i];
            grad_x[i] = gs[j] * rr * g[i];
        }
    }
    SecondOrderOutputs {
        grad_y_backprop,
        grad_x,
        grad_scale,
    }
}
