//! The typed, zero-copy layer: forward pass and gradient over slices, generic in the
//! element type, writing into buffers the caller owns.
//!
//! Every method validates every length before it writes anything, then runs the
//! [kernel passes](crate::kernels). Nothing here allocates in proportion to `x`.

use crate::element::{Element, Real};
use crate::error::{Error, Result};
use std::fmt;
use std::str::FromStr;

use crate::kernels::apply::{self, Epilogue};
use crate::kernels::second_order::{self, SecondOrderCoeffs};
use crate::kernels::{backward, fused, stats};
use crate::problem::Problem;

/// Where [`Problem::forward_training`] writes the batch statistics that the gradient
/// needs (TensorFlow's `reserve_space_1` and `reserve_space_2`).
#[derive(Debug)]
pub struct SavedStats<'a, U> {
    /// Batch mean, `C` elements.
    pub mean: &'a mut [U],
    /// Biased batch variance (`Σ(x−μ)²/M`), `C` elements.
    pub variance: &'a mut [U],
}

/// Running (moving) statistics updated in place by [`Problem::forward_training`]:
/// `mean ← (1−f)·mean + f·μ`, `variance ← (1−f)·variance + f·M/(M−1)·σ²`.
/// With `factor == 1` the old contents are ignored (TensorFlow's `batch_mean` and
/// `batch_variance` outputs).
#[derive(Debug)]
pub struct RunningStats<'a, U> {
    /// Running mean, `C` elements.
    pub mean: &'a mut [U],
    /// Running (Bessel-corrected) variance, `C` elements.
    pub variance: &'a mut [U],
    /// `exponential_avg_factor`.
    pub factor: f32,
}

/// Where the gradient methods write their results.
#[derive(Debug)]
pub struct Gradients<'a, T: Element> {
    /// `x_backprop`, the length of `x`.
    pub x: &'a mut [T],
    /// `scale_backprop`, `C` elements.
    pub scale: &'a mut [T::Stat],
    /// `offset_backprop`, `C` elements.
    pub offset: &'a mut [T::Stat],
}

/// Where [`Problem::second_order`] writes its results: the gradients with respect to
/// the gradient op's inputs `y_backprop`, `x` and `scale`.
#[derive(Debug)]
pub struct SecondOrderGradients<'a, T: Element> {
    /// Gradient with respect to `y_backprop` (the length of x).
    pub y_backprop: &'a mut [T],
    /// Gradient with respect to `x` (the length of x).
    pub x: &'a mut [T],
    /// Gradient with respect to `scale`, `C` elements.
    pub scale: &'a mut [T::Stat],
}

/// The activation after the residual add of the Ex ops (TensorFlow's
/// `activation_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activation {
    /// No activation.
    #[default]
    Identity,
    /// `max(0, ·)`.
    Relu,
}

impl Activation {
    /// TensorFlow's name (`Identity`, `Relu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Activation::Identity => "Identity",
            Activation::Relu => "Relu",
        }
    }
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Activation {
    type Err = Error;
    /// Parses TensorFlow's names exactly.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "Identity" => Ok(Activation::Identity),
            "Relu" => Ok(Activation::Relu),
            _ => Err(Error::InvalidAttr {
                name: "activation_mode".into(),
                expected: "Identity or Relu".into(),
                found: s.into(),
            }),
        }
    }
}

fn check_len(arg: &str, len: usize, want: usize, what: &str) -> Result<()> {
    if len == want {
        Ok(())
    } else {
        Err(Error::arg(
            arg,
            format!("{want} elements ({what})"),
            format!("{len} elements"),
        ))
    }
}

impl Problem {
    fn check_x(&self, arg: &str, len: usize) -> Result<()> {
        check_len(arg, len, self.len(), &format!("shape {:?}", self.shape()))
    }

    fn check_c(&self, arg: &str, len: usize) -> Result<()> {
        check_len(arg, len, self.channels(), "the channel count of x")
    }

    /// Forward pass in training mode: normalizes `x` with its own batch statistics.
    ///
    /// Writes `y`, the batch mean and biased variance into `saved`, and, when given,
    /// updates the running statistics. With an empty `x`, every statistic is NaN.
    ///
    /// ```
    /// use fusedbn::{DataFormat, Problem, batch_norm::{RunningStats, SavedStats}};
    /// let p = Problem::new(DataFormat::Nhwc, &[1, 1, 6, 1])?.with_epsilon(0.001);
    /// let x = [5.0f32, 7.0, 9.0, 11.0, 13.0, 15.0];
    /// let mut y = [0.0f32; 6];
    /// let (mut mu, mut var) = ([0.0f32], [0.0f32]);
    /// let (mut run_mean, mut run_var) = ([6.0f32], [16.0f32]);
    /// p.forward_training(
    ///     &x, &[4.0], &[2.0], &mut y,
    ///     SavedStats { mean: &mut mu, variance: &mut var },
    ///     Some(RunningStats { mean: &mut run_mean, variance: &mut run_var, factor: 0.5 }),
    /// )?;
    /// assert_eq!((mu[0], var[0]), (10.0, 35.0 / 3.0));
    /// assert_eq!((run_mean[0], run_var[0]), (8.0, 15.0)); // 0.5·6 + 0.5·10, 0.5·16 + 0.5·14
    /// assert!((y[0] - -3.86).abs() < 0.01);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn forward_training<T: Element>(
        &self,
        x: &[T],
        scale: &[T::Stat],
        offset: &[T::Stat],
        y: &mut [T],
        saved: SavedStats<'_, T::Stat>,
        running: Option<RunningStats<'_, T::Stat>>,
    ) -> Result<()> {
        self.forward_training_ex(
            x,
            scale,
            offset,
            None,
            Activation::Identity,
            y,
            saved,
            running,
        )
    }

    /// [`forward_training`](Problem::forward_training) with the Ex epilogue:
    /// `y = act(bn(x) + side_input)`, fused into the same pass (`side_input` has the
    /// shape of x).
    ///
    /// ```
    /// use fusedbn::{DataFormat, Problem, batch_norm::{Activation, SavedStats}};
    /// let p = Problem::new(DataFormat::Nhwc, &[1, 1, 4, 1])?;
    /// let (x, side) = ([1.0f32, 2.0, 3.0, 4.0], [0.5f32; 4]);
    /// let (mut y, mut mu, mut var) = ([0.0f32; 4], [0.0f32], [0.0f32]);
    /// p.forward_training_ex(&x, &[1.0], &[0.0], Some(&side), Activation::Relu, &mut y,
    ///     SavedStats { mean: &mut mu, variance: &mut var }, None)?;
    /// assert_eq!(y[0], 0.0); // relu(-1.34 + 0.5)
    /// assert!((y[3] - 1.84).abs() < 0.01); // relu(1.34 + 0.5)
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn forward_training_ex<T: Element>(
        &self,
        x: &[T],
        scale: &[T::Stat],
        offset: &[T::Stat],
        side_input: Option<&[T]>,
        activation: Activation,
        y: &mut [T],
        saved: SavedStats<'_, T::Stat>,
        running: Option<RunningStats<'_, T::Stat>>,
    ) -> Result<()> {
        self.check_x("x", x.len())?;
        if let Some(side) = side_input {
            self.check_x("side_input", side.len())?;
        }
        self.check_c("scale", scale.len())?;
        self.check_c("offset", offset.len())?;
        if let Some(r) = &running {
            self.check_c("mean", r.mean.len())?;
            self.check_c("variance", r.variance.len())?;
        }
        self.check_x("y (output)", y.len())?;
        self.check_c("reserve_space_1 (output)", saved.mean.len())?;
        self.check_c("reserve_space_2 (output)", saved.variance.len())?;

        let nan = T::Stat::from_f64(f64::NAN);
        if self.is_empty() {
            saved.mean.fill(nan);
            saved.variance.fill(nan);
            if let Some(r) = running {
                r.mean.fill(nan);
                r.variance.fill(nan);
            }
            return Ok(());
        }
        let m = self.elements_per_channel() as f64;
        let adj = m / (m - 1.0).max(1.0);
        let eps = f64::from(self.epsilon());
        // y = (x − μ)·scale/√(σ² + ε) + offset, with μ rounded to U as it is saved.
        let epi = Epilogue {
            side: side_input,
            relu: activation == Activation::Relu,
        };
        let moments = fused::forward_training(self.geometry(), self.isa(), x, epi, y, |c, mo| {
            let a = scale[c].to_f64() / (mo.variance() + eps).sqrt();
            [T::Stat::from_f64(mo.mean), T::Stat::from_f64(a), offset[c]]
        });
        for (c, mo) in moments.iter().enumerate() {
            saved.mean[c] = T::Stat::from_f64(mo.mean);
            saved.variance[c] = T::Stat::from_f64(mo.variance());
        }
        if let Some(r) = running {
            let f = f64::from(r.factor);
            for (c, mo) in moments.iter().enumerate() {
                let (mu, var) = (mo.mean, adj * mo.variance());
                let (mean, variance) = if r.factor == 1.0 {
                    (mu, var)
                } else {
                    (
                        (1.0 - f) * r.mean[c].to_f64() + f * mu,
                        (1.0 - f) * r.variance[c].to_f64() + f * var,
                    )
                };
                r.mean[c] = T::Stat::from_f64(mean);
                r.variance[c] = T::Stat::from_f64(variance);
            }
        }
        Ok(())
    }

    /// Forward pass in inference mode: normalizes `x` with the given population
    /// statistics, `y = (x − mean)·scale/√(variance + ε) + offset`.
    ///
    /// ```
    /// use fusedbn::{DataFormat, Problem};
    /// let p = Problem::new(DataFormat::Nchw, &[1, 2, 1, 2])?.with_epsilon(0.0);
    /// let x = [1.0f32, 3.0, 10.0, 30.0];
    /// let mut y = [0.0f32; 4];
    /// p.forward_inference(&x, &[1.0, 2.0], &[0.0, 1.0], &[2.0, 20.0], &[1.0, 100.0], &mut y)?;
    /// assert_eq!(y, [-1.0, 1.0, -1.0, 3.0]);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn forward_inference<T: Element>(
        &self,
        x: &[T],
        scale: &[T::Stat],
        offset: &[T::Stat],
        mean: &[T::Stat],
        variance: &[T::Stat],
        y: &mut [T],
    ) -> Result<()> {
        self.forward_inference_ex(
            x,
            scale,
            offset,
            mean,
            variance,
            None,
            Activation::Identity,
            y,
        )
    }

    /// [`forward_inference`](Problem::forward_inference) with the Ex epilogue:
    /// `y = act(bn(x) + side_input)` in the same pass.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_inference_ex<T: Element>(
        &self,
        x: &[T],
        scale: &[T::Stat],
        offset: &[T::Stat],
        mean: &[T::Stat],
        variance: &[T::Stat],
        side_input: Option<&[T]>,
        activation: Activation,
        y: &mut [T],
    ) -> Result<()> {
        self.check_x("x", x.len())?;
        if let Some(side) = side_input {
            self.check_x("side_input", side.len())?;
        }
        self.check_c("scale", scale.len())?;
        self.check_c("offset", offset.len())?;
        self.check_c("mean", mean.len())?;
        self.check_c("variance", variance.len())?;
        self.check_x("y (output)", y.len())?;
        if self.is_empty() {
            return Ok(());
        }
        let a = self.scale_rsqrt(scale, variance);
        let epi = Epilogue {
            side: side_input,
            relu: activation == Activation::Relu,
        };
        apply::affine(self.geometry(), self.isa(), x, mean, &a, offset, epi, y);
        Ok(())
    }

    /// Gradient in training mode, with the batch statistics saved by
    /// [`Problem::forward_training`] (`reserve_space_1`, `reserve_space_2`).
    ///
    /// ```
    /// use fusedbn::{DataFormat, Problem, batch_norm::Gradients};
    /// // SPEC §8: one channel of six elements.
    /// let p = Problem::new(DataFormat::Nhwc, &[1, 1, 6, 1])?.with_epsilon(0.001);
    /// let dy = [2.0f32, 9.0, -4.0, 5.0, 8.0, 7.0];
    /// let x = [1.0f32, 7.0, 4.0, -3.0, -11.0, 13.0];
    /// let (mut dx, mut dscale, mut doffset) = ([0.0f32; 6], [0.0f32], [0.0f32]);
    /// p.backward_training(&dy, &x, &[4.0], &[11.0 / 6.0], &[57.472_222],
    ///     Gradients { x: &mut dx, scale: &mut dscale, offset: &mut doffset })?;
    /// assert_eq!(doffset[0], 27.0);
    /// assert!((dscale[0] - -1.6488).abs() < 1e-4);
    /// assert!((dx[0] - -1.34).abs() < 0.01);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn backward_training<T: Element>(
        &self,
        y_backprop: &[T],
        x: &[T],
        scale: &[T::Stat],
        saved_mean: &[T::Stat],
        saved_variance: &[T::Stat],
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        self.backward(
            y_backprop,
            x,
            scale,
            saved_mean,
            saved_variance,
            None,
            grads,
            None,
            true,
        )
    }

    /// Gradient in inference mode, with the population statistics the forward pass
    /// used: `x_backprop = y_backprop·scale/√(variance + ε)`.
    pub fn backward_inference<T: Element>(
        &self,
        y_backprop: &[T],
        x: &[T],
        scale: &[T::Stat],
        mean: &[T::Stat],
        variance: &[T::Stat],
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        self.backward(
            y_backprop, x, scale, mean, variance, None, grads, None, false,
        )
    }

    /// The gradient of [`forward_training_ex`](Problem::forward_training_ex): with
    /// `relu_output` (the forward `y` of an op with a ReLU) `y_backprop` is masked to
    /// `y > 0` on the fly, in both passes; `side_input_backprop`, when given, receives
    /// the masked `y_backprop` (the gradient of the side input), written by the
    /// reduction pass.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_training_ex<T: Element>(
        &self,
        y_backprop: &[T],
        x: &[T],
        scale: &[T::Stat],
        saved_mean: &[T::Stat],
        saved_variance: &[T::Stat],
        relu_output: Option<&[T]>,
        grads: Gradients<'_, T>,
        side_input_backprop: Option<&mut [T]>,
    ) -> Result<()> {
        self.backward(
            y_backprop,
            x,
            scale,
            saved_mean,
            saved_variance,
            relu_output,
            grads,
            side_input_backprop,
            true,
        )
    }

    /// The gradient of [`forward_inference_ex`](Problem::forward_inference_ex); see
    /// [`backward_training_ex`](Problem::backward_training_ex).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_inference_ex<T: Element>(
        &self,
        y_backprop: &[T],
        x: &[T],
        scale: &[T::Stat],
        mean: &[T::Stat],
        variance: &[T::Stat],
        relu_output: Option<&[T]>,
        grads: Gradients<'_, T>,
        side_input_backprop: Option<&mut [T]>,
    ) -> Result<()> {
        self.backward(
            y_backprop,
            x,
            scale,
            mean,
            variance,
            relu_output,
            grads,
            side_input_backprop,
            false,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn backward<T: Element>(
        &self,
        dy: &[T],
        x: &[T],
        scale: &[T::Stat],
        rs1: &[T::Stat],
        rs2: &[T::Stat],
        mask: Option<&[T]>,
        grads: Gradients<'_, T>,
        side_grad: Option<&mut [T]>,
        is_training: bool,
    ) -> Result<()> {
        self.check_x("y_backprop", dy.len())?;
        self.check_x("x", x.len())?;
        self.check_c("scale", scale.len())?;
        self.check_c("reserve_space_1", rs1.len())?;
        self.check_c("reserve_space_2", rs2.len())?;
        self.check_x("x_backprop (output)", grads.x.len())?;
        self.check_c("scale_backprop (output)", grads.scale.len())?;
        self.check_c("offset_backprop (output)", grads.offset.len())?;
        if let Some(y) = mask {
            self.check_x("y", y.len())?;
        }
        if let Some(sg) = &side_grad {
            self.check_x("side_input_backprop (output)", sg.len())?;
        }
        if self.is_empty() {
            grads.scale.fill(T::Stat::ZERO);
            grads.offset.fill(T::Stat::ZERO);
            return Ok(());
        }
        let (g, isa) = (self.geometry(), self.isa());
        let eps = f64::from(self.epsilon());
        let m = self.elements_per_channel() as f64;
        let r = |c: usize| 1.0 / (rs2[c].to_f64() + eps).sqrt();
        let ones = vec![T::Stat::from_f64(1.0); self.channels()];
        let coeffs = |c: usize, sdy: f64, sdx: f64| {
            // dx = scale·r·(dy − Σdy/M − (x − μ)·r²·Σdy(x − μ)/M)
            let (r, u) = (r(c), T::Stat::from_f64);
            let k1 = scale[c].to_f64() * r;
            [u(sdy / m), u(k1), u(-k1 * r * r * sdx / m)]
        };
        let sums = match (is_training, side_grad) {
            (true, None) => fused::backward_training(g, isa, dy, mask, x, rs1, grads.x, coeffs),
            (true, Some(sg)) => {
                // The reduction pass also writes the (masked) dy: k1 = 1.
                let sums = fused::backward_inference(g, isa, dy, mask, x, rs1, &ones, sg);
                let k: Vec<_> = (0..self.channels())
                    .map(|c| coeffs(c, sums.sum_dy[c], sums.sum_dy_xc[c]))
                    .collect();
                let [dm, k1, k2] = fused::columns(&k);
                backward::apply(g, isa, dy, mask, x, &dm, rs1, &k1, &k2, grads.x);
                sums
            }
            (false, None) => {
                // dx = dy·scale·r, with the sums, in one pass.
                let k1 = self.scale_rsqrt(scale, rs2);
                fused::backward_inference(g, isa, dy, mask, x, rs1, &k1, grads.x)
            }
            (false, Some(sg)) => {
                // The sums and the (masked) dy in one pass, then dx = sg·scale·r from
                // that output alone (not dy, y and x again).
                let k1 = self.scale_rsqrt(scale, rs2);
                let sums = fused::backward_inference(g, isa, dy, mask, x, rs1, &ones, sg);
                let zero = vec![T::Stat::ZERO; self.channels()];
                apply::affine(g, isa, sg, &zero, &k1, &zero, Epilogue::default(), grads.x);
                sums
            }
        };
        for c in 0..self.channels() {
            grads.offset[c] = T::Stat::from_f64(sums.sum_dy[c]);
            grads.scale[c] = T::Stat::from_f64(r(c) * sums.sum_dy_xc[c]);
        }
        Ok(())
    }

    /// The gradient of the gradient op (SPEC §3, second order): given the gradient op's
    /// inputs (`y_backprop`, `x`, `scale`, `reserve_space_1/2`) and the upstream
    /// gradients of its outputs (`grad_x_backprop`, the shape of x;
    /// `grad_scale_backprop`, `grad_offset_backprop`, `C` elements), the gradients with
    /// respect to `y_backprop`, `x` and `scale`. In training the mean and variance are
    /// recomputed from `x`, as TensorFlow does (the reserve spaces are not read); in
    /// inference they are `reserve_space_1/2`. Two reductions (one in inference), then
    /// one pass writing both outputs.
    #[allow(clippy::too_many_arguments)]
    pub fn second_order<T: Element>(
        &self,
        y_backprop: &[T],
        x: &[T],
        scale: &[T::Stat],
        reserve_space_1: &[T::Stat],
        reserve_space_2: &[T::Stat],
        grad_x_backprop: &[T],
        grad_scale_backprop: &[T::Stat],
        grad_offset_backprop: &[T::Stat],
        is_training: bool,
        out: SecondOrderGradients<'_, T>,
    ) -> Result<()> {
        self.check_x("y_backprop", y_backprop.len())?;
        self.check_x("x", x.len())?;
        self.check_c("scale", scale.len())?;
        self.check_c("reserve_space_1", reserve_space_1.len())?;
        self.check_c("reserve_space_2", reserve_space_2.len())?;
        self.check_x("grad_x_backprop", grad_x_backprop.len())?;
        self.check_c("grad_scale_backprop", grad_scale_backprop.len())?;
        self.check_c("grad_offset_backprop", grad_offset_backprop.len())?;
        self.check_x("grad_y_backprop (output)", out.y_backprop.len())?;
        self.check_x("grad_x (output)", out.x.len())?;
        self.check_c("grad_scale (output)", out.scale.len())?;
        let zero = T::Stat::ZERO;
        if self.is_empty() {
            out.scale.fill(zero);
            return Ok(());
        }
        let (g, isa, c) = (self.geometry(), self.isa(), self.channels());
        let (m, eps) = (
            self.elements_per_channel() as f64,
            f64::from(self.epsilon()),
        );
        let (mean, var): (Vec<T::Stat>, Vec<f64>) = if is_training {
            let mo = stats::channel_moments(g, isa, x);
            (
                mo.iter().map(|v| T::Stat::from_f64(v.mean)).collect(),
                mo.iter().map(|v| v.variance()).collect(),
            )
        } else {
            (
                reserve_space_1.to_vec(),
                reserve_space_2.iter().map(|v| v.to_f64()).collect(),
            )
        };
        // Shift g and A by each channel's first element in training, so that centred
        // sums cancel exactly where they should (one element per channel).
        let first = |v: &[T]| -> Vec<T::Stat> {
            (0..c)
                .map(|ch| {
                    if is_training {
                        v[ch * g.inner].widen()
                    } else {
                        T::Stat::ZERO
                    }
                })
                .collect()
        };
        let (kg, ka) = (first(y_backprop), first(grad_x_backprop));
        let sums = second_order::reduce(g, isa, y_backprop, x, grad_x_backprop, &mean, &kg, &ka);
        let u = T::Stat::from_f64;
        let mut k = SecondOrderCoeffs {
            mean: mean.clone(),
            ..Default::default()
        };
        for ch in 0..c {
            let r = 1.0 / (var[ch] + eps).sqrt();
            let (sc, ga, go) = (
                scale[ch].to_f64(),
                grad_scale_backprop[ch].to_f64(),
                grad_offset_backprop[ch],
            );
            let (kg, ka) = (kg[ch].to_f64(), ka[ch].to_f64());
            let (gbar, abar) = (kg + sums.g[ch] / m, ka + sums.a[ch] / m);
            let g_xc = sums.g_xc[ch] + kg * sums.xc[ch]; // Σg·(x − μ)
            let a_xc = sums.a_xc[ch] + ka * sums.xc[ch]; // ΣA·(x − μ)
            let (c2, e2, e3, g_mean, a_mean, dscale);
            if is_training {
                let s2 = r * g_xc / m; // mean(g·x̂)
                let t = r * a_xc / m; // mean(A·x̂)
                let mk = sums.a_g[ch] - sums.a[ch] * sums.g[ch] / m; // Σ(A − Ā)(g − ḡ)
                let kk = mk / m;
                c2 = ga * r - sc * r * r * t;
                e2 = -sc * r * r * s2;
                e3 = -sc * r * r * r * (kk - 3.0 * s2 * t) - ga * r * r * s2;
                dscale = r * (mk - r * s2 * a_xc);
                (g_mean, a_mean) = (gbar, abar);
            } else {
                c2 = ga * r;
                (e2, e3) = (0.0, 0.0);
                dscale = r * sums.a_g[ch];
                (g_mean, a_mean) = (0.0, 0.0);
            }
            k.a_mean.push(u(a_mean));
            k.g_mean.push(u(g_mean));
            k.c1.push(u(sc * r));
            k.c2.push(u(c2));
            k.b.push(go);
            k.e2.push(u(e2));
            k.e3.push(u(e3));
            out.scale[ch] = u(dscale);
        }
        second_order::apply(
            g,
            isa,
            y_backprop,
            x,
            grad_x_backprop,
            &k,
            out.y_backprop,
            out.x,
        );
        Ok(())
    }

    /// `scale·rsqrt(variance + ε)` per channel, computed in `f64`, rounded to `U`.
    fn scale_rsqrt<U: Real>(&self, scale: &[U], variance: &[U]) -> Vec<U> {
        let eps = f64::from(self.epsilon());
        scale
            .iter()
            .zip(variance)
            .map(|(s, v)| U::from_f64(s.to_f64() / (v.to_f64() + eps).sqrt()))
            .collect()
    }
}
