//! The test oracle: every op in `f64` with obvious loops, straight from SPEC §3 and §5.
//!
//! Nothing here is fast or clever; it exists so that the optimized kernels can be
//! checked against something a reader can verify in five minutes. Inputs are `f64`
//! (widen half data first: widening is exact); outputs are unrounded `f64`.

use crate::problem::DataFormat;

/// The channel of every element of `x`, in storage order.
fn channels(format: DataFormat, shape: &[usize]) -> impl Iterator<Item = usize> {
    let axis = format.channel_axis();
    let c = shape[axis];
    let stride: usize = shape[axis + 1..].iter().product();
    let n: usize = shape.iter().product();
    (0..n).map(move |i| (i / stride) % c)
}

/// Outputs of a forward op.
#[derive(Clone, Debug, PartialEq)]
pub struct Forward {
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
pub struct Backward {
    /// `x_backprop`, same layout as `x`.
    pub x_backprop: Vec<f64>,
    /// `scale_backprop`.
    pub scale_backprop: Vec<f64>,
    /// `offset_backprop`.
    pub offset_backprop: Vec<f64>,
}

/// Forward pass in training mode. `mean`/`variance` are only read when `factor != 1`.
#[allow(clippy::too_many_arguments)]
pub fn forward_training(
    format: DataFormat,
    shape: &[usize],
    x: &[f64],
    scale: &[f64],
    offset: &[f64],
    mean: &[f64],
    variance: &[f64],
    epsilon: f64,
    factor: f64,
) -> Forward {
    let c = shape[format.channel_axis()];
    let m = x.len() / c.max(1);
    let mut sum = vec![0.0; c];
    for (ch, v) in channels(format, shape).zip(x) {
        sum[ch] += v;
    }
    let mu: Vec<f64> = sum.iter().map(|s| s / m as f64).collect();
    let mut sq = vec![0.0; c];
    for (ch, v) in channels(format, shape).zip(x) {
        sq[ch] += (v - mu[ch]) * (v - mu[ch]);
    }
    let var: Vec<f64> = sq.iter().map(|s| s / m as f64).collect();
    let y = channels(format, shape)
        .zip(x)
        .map(|(ch, v)| (v - mu[ch]) * (scale[ch] / (var[ch] + epsilon).sqrt()) + offset[ch])
        .collect();
    let adj = m as f64 / (m as f64 - 1.0).max(1.0);
    let (batch_mean, batch_variance) = if x.is_empty() {
        (vec![f64::NAN; c], vec![f64::NAN; c])
    } else if factor == 1.0 {
        (mu.clone(), var.iter().map(|v| adj * v).collect())
    } else {
        (
            (0..c)
                .map(|i| (1.0 - factor) * mean[i] + factor * mu[i])
                .collect(),
            (0..c)
                .map(|i| (1.0 - factor) * variance[i] + factor * adj * var[i])
                .collect(),
        )
    };
    Forward {
        y,
        batch_mean,
        batch_variance,
        reserve_space_1: mu,
        reserve_space_2: var,
    }
}

/// Forward pass in inference mode with population statistics `mean`/`variance`.
#[allow(clippy::too_many_arguments)]
pub fn forward_inference(
    format: DataFormat,
    shape: &[usize],
    x: &[f64],
    scale: &[f64],
    offset: &[f64],
    mean: &[f64],
    variance: &[f64],
    epsilon: f64,
) -> Forward {
    let c = shape[format.channel_axis()];
    let y = channels(format, shape)
        .zip(x)
        .map(|(ch, v)| (v - mean[ch]) * (scale[ch] / (variance[ch] + epsilon).sqrt()) + offset[ch])
        .collect();
    let (batch_mean, batch_variance) = if x.is_empty() {
        (vec![f64::NAN; c], vec![f64::NAN; c])
    } else {
        (mean.to_vec(), variance.to_vec())
    };
    Forward {
        y,
        reserve_space_1: batch_mean.clone(),
        reserve_space_2: batch_variance.clone(),
        batch_mean,
        batch_variance,
    }
}

/// Gradient. `rs1`/`rs2` are the batch mean and biased variance in training, the
/// population mean and variance in inference.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    format: DataFormat,
    shape: &[usize],
    dy: &[f64],
    x: &[f64],
    scale: &[f64],
    rs1: &[f64],
    rs2: &[f64],
    epsilon: f64,
    is_training: bool,
) -> Backward {
    let c = shape[format.channel_axis()];
    let m = x.len() / c.max(1);
    let r: Vec<f64> = rs2.iter().map(|v| 1.0 / (v + epsilon).sqrt()).collect();
    let (mut sum_dy, mut sum_dy_xc) = (vec![0.0; c], vec![0.0; c]);
    for ((ch, d), v) in channels(format, shape).zip(dy).zip(x) {
        sum_dy[ch] += d;
        sum_dy_xc[ch] += d * (v - rs1[ch]);
    }
    let x_backprop = channels(format, shape)
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
    Backward {
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
pub struct SecondOrder {
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
/// `rs1`/`rs2`.
#[allow(clippy::too_many_arguments)]
pub fn second_order(
    format: DataFormat,
    shape: &[usize],
    g: &[f64],
    x: &[f64],
    scale: &[f64],
    rs1: &[f64],
    rs2: &[f64],
    ga: &[f64],
    gs: &[f64],
    go: &[f64],
    epsilon: f64,
    is_training: bool,
) -> SecondOrder {
    let c = shape[format.channel_axis()];
    let m = (x.len() / c.max(1)) as f64;
    let ch: Vec<usize> = channels(format, shape).collect();
    let (mu, var) = if is_training {
        let f = forward_training(
            format,
            shape,
            x,
            &vec![1.0; c],
            &vec![0.0; c],
            &[],
            &[],
            epsilon,
            1.0,
        );
        (f.reserve_space_1, f.reserve_space_2)
    } else {
        (rs1.to_vec(), rs2.to_vec())
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
    SecondOrder {
        grad_y_backprop,
        grad_x,
        grad_scale,
    }
}
