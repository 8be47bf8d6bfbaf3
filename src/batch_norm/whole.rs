//! The whole ops: [`Problem::forward`], [`Problem::backward`] and
//! [`Problem::second_order`] — the [phases](super::phases) fused into the fewest passes
//! over memory (the coefficient formulas are the phases' own, shared below).

use super::phases::{self, backward_coeffs};
use super::{
    Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, Mode, Problem,
    SecondOrderGradients, SecondOrderInputs, TrainingStats,
};
use crate::element::{Element, Real};
use crate::error::Result;
use crate::kernels::apply;
use crate::kernels::backward::GradData;
use crate::kernels::second_order::{self, SecondOrderCoeffs};
use crate::kernels::{fused, scratch, stats, Scratch};

impl Problem {
    /// The forward pass: `y = act((x − mean)·scale/√(variance + ε) + offset + side)`,
    /// with the batch's own statistics in [`Forward::Training`] (written to
    /// `saved`, and the running statistics updated when given) or the given ones in
    /// [`Forward::Inference`]. The [`Epilogue`] adds the Ex op's side input and ReLU in
    /// the same pass. With an empty `x` every statistic is NaN.
    ///
    /// Training is [`Problem::moments`] → [`forward_apply`](Problem::forward_apply)
    /// fused: channel-major channels small enough to stay in cache are reduced and
    /// normalized while they are still there (one read of `x` from memory).
    ///
    /// ```
    /// use fusedbn::{DataFormat, Problem};
    /// use fusedbn::batch_norm::{Affine, Epilogue, Forward, RunningStats, SavedStats, TrainingStats};
    /// let p = Problem::new(DataFormat::Nhwc, &[1, 1, 6, 1])?.with_epsilon(0.001);
    /// let x = [5.0f32, 7.0, 9.0, 11.0, 13.0, 15.0];
    /// let mut y = [0.0f32; 6];
    /// let (mut mu, mut var) = ([0.0f32], [0.0f32]);
    /// let (mut run_mean, mut run_var) = ([6.0f32], [16.0f32]);
    /// p.forward(
    ///     &x,
    ///     Affine { scale: &[4.0], offset: &[2.0] },
    ///     Forward::Training(TrainingStats {
    ///         saved: SavedStats { mean: &mut mu, variance: &mut var },
    ///         running: Some(RunningStats { mean: &mut run_mean, variance: &mut run_var, factor: 0.5 }),
    ///     }),
    ///     Epilogue::plain(),
    ///     &mut y,
    /// )?;
    /// assert_eq!((mu[0], var[0]), (10.0, 35.0 / 3.0));
    /// assert_eq!((run_mean[0], run_var[0]), (8.0, 15.0)); // 0.5·6 + 0.5·10, 0.5·16 + 0.5·14
    /// assert!((y[0] - -3.86).abs() < 0.01);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    ///
    /// Inference, with the Ex epilogue:
    ///
    /// ```
    /// use fusedbn::{DataFormat, Problem};
    /// use fusedbn::batch_norm::{Affine, Epilogue, Forward, Statistics};
    /// let p = Problem::new(DataFormat::Nchw, &[1, 2, 1, 2])?.with_epsilon(0.0);
    /// let x = [1.0f32, 3.0, 10.0, 30.0];
    /// let side = [0.0f32, 0.0, -5.0, 0.0];
    /// let mut y = [0.0f32; 4];
    /// p.forward(
    ///     &x,
    ///     Affine { scale: &[1.0, 2.0], offset: &[0.0, 1.0] },
    ///     Forward::Inference(Statistics { mean: &[2.0, 20.0], variance: &[1.0, 100.0] }),
    ///     Epilogue::relu(Some(&side)),
    ///     &mut y,
    /// )?;
    /// assert_eq!(y, [0.0, 1.0, 0.0, 3.0]); // relu([-1, 1, -1 - 5, 3])
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn forward<T: Element>(
        &self,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        mode: Forward<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &mut [T],
    ) -> Result<()> {
        T::mono_forward(self, x, affine, mode, epilogue, y)
    }

    pub(super) fn forward_impl<T: Element>(
        &self,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        mode: Forward<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &mut [T],
    ) -> Result<()> {
        match mode {
            Forward::Training(stats) => self.forward_training(x, affine, stats, epilogue, y),
            Forward::Inference(s) => {
                self.check_forward(x, affine, epilogue, y)?;
                self.check_c("mean", s.mean.len())?;
                self.check_c("variance", s.variance.len())?;
                if self.is_empty() {
                    return Ok(());
                }
                let a = self.scale_rsqrt(affine.scale, s.variance);
                let k = [s.mean, &a, affine.offset];
                apply::affine(self.geometry(), self.isa(), x, k, epilogue.kernel(), y);
                Ok(())
            }
        }
    }

    pub(crate) fn check_forward<T: Element>(
        &self,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &[T],
    ) -> Result<()> {
        self.check_x("x", x.len())?;
        if let Some(side) = epilogue.side_input {
            self.check_x("side_input", side.len())?;
        }
        self.check_c("scale", affine.scale.len())?;
        self.check_c("offset", affine.offset.len())?;
        self.check_x("y (output)", y.len())
    }

    fn forward_training<T: Element>(
        &self,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        stats: TrainingStats<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &mut [T],
    ) -> Result<()> {
        self.check_forward(x, affine, epilogue, y)?;
        self.check_training_stats(&stats)?;
        if self.is_empty() {
            phases::write_training_stats::<T::Stat>(&[], self.channels(), stats);
            return Ok(());
        }
        let eps = f64::from(self.epsilon());
        let moments = fused::forward_training(
            self.geometry(),
            self.isa(),
            x,
            epilogue.kernel(),
            y,
            |c, mo| phases::forward_coeffs(affine, c, mo, eps),
        );
        phases::write_training_stats(&moments, self.channels(), stats);
        Ok(())
    }

    /// The gradient of [`forward`](Problem::forward) with respect to `x`, `scale` and
    /// `offset`, in the mode of the forward ([`Backward::Training`] with the batch
    /// statistics it saved, or [`Backward::Inference`] with the population statistics
    /// it used: then `dx = dy·scale/√(variance + ε)`). The [`GradEpilogue`] masks `dy`
    /// with a ReLU's forward output and writes the side input's gradient, in the same
    /// passes.
    ///
    /// Training is [`backward_sums`](Problem::backward_sums) →
    /// [`backward_apply`](Problem::backward_apply) fused.
    ///
    /// ```
    /// use fusedbn::{DataFormat, Problem};
    /// use fusedbn::batch_norm::{Backward, GradEpilogue, GradInputs, Gradients, Statistics};
    /// // SPEC §8: one channel of six elements.
    /// let p = Problem::new(DataFormat::Nhwc, &[1, 1, 6, 1])?.with_epsilon(0.001);
    /// let dy = [2.0f32, 9.0, -4.0, 5.0, 8.0, 7.0];
    /// let x = [1.0f32, 7.0, 4.0, -3.0, -11.0, 13.0];
    /// let (mut dx, mut dscale, mut doffset) = ([0.0f32; 6], [0.0f32], [0.0f32]);
    /// p.backward(
    ///     GradInputs { y_backprop: &dy, x: &x },
    ///     &[4.0],
    ///     Backward::Training(Statistics { mean: &[11.0 / 6.0], variance: &[57.472_222] }),
    ///     GradEpilogue::default(),
    ///     Gradients { x: &mut dx, scale: &mut dscale, offset: &mut doffset },
    /// )?;
    /// assert_eq!(doffset[0], 27.0);
    /// assert!((dscale[0] - -1.6488).abs() < 1e-4);
    /// assert!((dx[0] - -1.34).abs() < 0.01);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn backward<T: Element>(
        &self,
        inputs: GradInputs<'_, T>,
        scale: &[T::Stat],
        mode: Backward<'_, T::Stat>,
        epilogue: GradEpilogue<'_, T>,
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        T::mono_backward(self, inputs, scale, mode, epilogue, grads)
    }

    pub(super) fn backward_impl<T: Element>(
        &self,
        inputs: GradInputs<'_, T>,
        scale: &[T::Stat],
        mode: Backward<'_, T::Stat>,
        epilogue: GradEpilogue<'_, T>,
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        let stats = mode.statistics();
        self.check_backward(inputs, scale, stats, &epilogue, &grads)?;
        if self.is_empty() {
            grads.scale.fill(T::Stat::ZERO);
            grads.offset.fill(T::Stat::ZERO);
            return Ok(());
        }
        let (g, isa) = (self.geometry(), self.isa());
        let (dy, x, mask) = (inputs.y_backprop, inputs.x, epilogue.relu_output);
        let data = GradData { dy, mask, x };
        let (rs1, rs2) = (stats.mean, stats.variance);
        let eps = f64::from(self.epsilon());
        let m = self.elements_per_channel() as f64;
        let ones = || vec![T::Stat::from_f64(1.0); self.channels()];
        let coeffs =
            |c: usize, sdy: f64, sdx: f64| backward_coeffs(scale, stats, eps, m, c, sdy, sdx);
        let sums = match (mode.is_training(), epilogue.side_input_backprop) {
            (true, None) => fused::backward_training(g, isa, data, rs1, grads.x, coeffs),
            (true, Some(sg)) => {
                fused::backward_training_side(g, isa, data, rs1, sg, grads.x, coeffs)
            }
            (false, None) => {
                // dx = dy·scale·r, with the sums, in one pass.
                let k1 = self.scale_rsqrt(scale, rs2);
                fused::backward_inference(g, isa, data, rs1, &k1, grads.x)
            }
            (false, Some(sg)) => {
                // The sums and the (masked) dy in one pass, then dx = sg·scale·r from
                // that output alone (not dy, y and x again).
                let k1 = self.scale_rsqrt(scale, rs2);
                let sums = fused::backward_inference(g, isa, data, rs1, &ones(), sg);
                let zero = vec![T::Stat::ZERO; self.channels()];
                let plain = apply::Epilogue::default();
                apply::affine(g, isa, sg, [&zero, &k1, &zero], plain, grads.x);
                sums
            }
        };
        phases::write_param_grads(
            stats,
            eps,
            &sums.sum_dy,
            &sums.sum_dy_xc,
            grads.scale,
            grads.offset,
        );
        Ok(())
    }

    pub(crate) fn check_backward<T: Element>(
        &self,
        inputs: GradInputs<'_, T>,
        scale: &[T::Stat],
        stats: super::Statistics<'_, T::Stat>,
        epilogue: &GradEpilogue<'_, T>,
        grads: &Gradients<'_, T>,
    ) -> Result<()> {
        self.check_x("y_backprop", inputs.y_backprop.len())?;
        self.check_x("x", inputs.x.len())?;
        self.check_c("scale", scale.len())?;
        self.check_c("mean (reserve_space_1)", stats.mean.len())?;
        self.check_c("variance (reserve_space_2)", stats.variance.len())?;
        if let Some(y) = epilogue.relu_output {
            self.check_x("y (relu_output)", y.len())?;
        }
        if let Some(sg) = &epilogue.side_input_backprop {
            self.check_x("side_input_backprop (output)", sg.len())?;
        }
        self.check_x("x_backprop (output)", grads.x.len())?;
        self.check_c("scale_backprop (output)", grads.scale.len())?;
        self.check_c("offset_backprop (output)", grads.offset.len())
    }

    /// The gradient of the gradient op (SPEC §3, second order): the gradients with
    /// respect to the gradient op's `y_backprop`, `x` and `scale`, given its inputs and
    /// the upstream gradients of its outputs. In [`Mode::Training`] the mean and
    /// variance are recomputed from `x`, as TensorFlow does (`reserve` is not read); in
    /// [`Mode::Inference`] they are `reserve`. Two reductions (one in inference), then
    /// one pass writing both outputs.
    ///
    /// ```
    /// use fusedbn::{DataFormat, Problem};
    /// use fusedbn::batch_norm::{Mode, SecondOrderGradients, SecondOrderInputs, Statistics};
    /// let p = Problem::new(DataFormat::Nhwc, &[1, 1, 4, 1])?;
    /// let (dy, x, ddx) = ([1.0f32, -1.0, 2.0, 0.5], [1.0f32, 2.0, 3.0, 4.0], [0.5f32; 4]);
    /// let (mut ddy, mut dx, mut dscale) = ([0.0f32; 4], [0.0f32; 4], [0.0f32]);
    /// p.second_order(
    ///     SecondOrderInputs {
    ///         y_backprop: &dy, x: &x, scale: &[2.0],
    ///         reserve: Statistics { mean: &[2.5], variance: &[1.25] },
    ///         grad_x_backprop: &ddx, grad_scale_backprop: &[0.0], grad_offset_backprop: &[0.0],
    ///     },
    ///     Mode::Inference,
    ///     SecondOrderGradients { y_backprop: &mut ddy, x: &mut dx, scale: &mut dscale },
    /// )?;
    /// // Inference: dx = dy·scale·r is linear in dy, so d/d(dy) of Σ ddx·dx = ddx·scale·r.
    /// let r = 1.0 / (1.25f32 + 1e-4).sqrt();
    /// assert!((ddy[0] - 0.5 * 2.0 * r).abs() < 1e-6);
    /// # Ok::<(), fusedbn::Error>(())
    /// ```
    pub fn second_order<T: Element>(
        &self,
        inputs: SecondOrderInputs<'_, T>,
        mode: Mode,
        out: SecondOrderGradients<'_, T>,
    ) -> Result<()> {
        T::mono_second_order(self, inputs, mode, out)
    }

    pub(super) fn second_order_impl<T: Element>(
        &self,
        inputs: SecondOrderInputs<'_, T>,
        mode: Mode,
        out: SecondOrderGradients<'_, T>,
    ) -> Result<()> {
        let i = inputs;
        self.check_x("y_backprop", i.y_backprop.len())?;
        self.check_x("x", i.x.len())?;
        self.check_c("scale", i.scale.len())?;
        self.check_c("reserve_space_1", i.reserve.mean.len())?;
        self.check_c("reserve_space_2", i.reserve.variance.len())?;
        self.check_x("grad_x_backprop", i.grad_x_backprop.len())?;
        self.check_c("grad_scale_backprop", i.grad_scale_backprop.len())?;
        self.check_c("grad_offset_backprop", i.grad_offset_backprop.len())?;
        self.check_x("grad_y_backprop (output)", out.y_backprop.len())?;
        self.check_x("grad_x (output)", out.x.len())?;
        self.check_c("grad_scale (output)", out.scale.len())?;
        let zero = T::Stat::ZERO;
        if self.is_empty() {
            out.scale.fill(zero);
            return Ok(());
        }
        let is_training = mode == Mode::Training;
        let (g, isa, c) = (self.geometry(), self.isa(), self.channels());
        let (m, eps) = (
            self.elements_per_channel() as f64,
            f64::from(self.epsilon()),
        );
        // The three shifts of the reduction, `[μ, kg, ka]`; in training, g and A are
        // shifted by each channel's first element, so that centred sums cancel exactly
        // where they should (one element per channel).
        let moments = is_training.then(|| stats::channel_moments(g, isa, i.x));
        let shifts = fused::Columns::new(c, |ch| match &moments {
            Some(mo) => [
                T::Stat::from_f64(mo[ch].mean),
                i.y_backprop[ch * g.inner].widen(),
                i.grad_x_backprop[ch * g.inner].widen(),
            ],
            None => [i.reserve.mean[ch], zero, zero],
        });
        let var = |ch: usize| match &moments {
            Some(mo) => mo[ch].variance(),
            None => i.reserve.variance[ch].to_f64(),
        };
        let ins = [i.y_backprop, i.x, i.grad_x_backprop];
        let [mean, kg, ka] = shifts.get();
        let sums = second_order::reduce(g, isa, ins, [mean, kg, ka]);
        let u = T::Stat::from_f64;
        // On the stack for up to 64 channels (a heap allocation per call otherwise),
        // written through a slice (pushes were a tenth of a 1x1x1x32 call). The
        // formulas below, with their eight divisions and a square root a channel, were
        // 8.6 % of the samples of NCHW 2x8x8x32 bf16 second-order training (perf, Zen
        // 3). Tried (2026-12-02): four channels at a time, inputs gathered into
        // lanes and the formulas over fixed-length arrays (packed divisions, the same
        // bits): all 12 second-order 2x8x8x32 cells slower (`scripts/ab.sh 7`, e.g.
        // NCHW bf16 training 8.50 -> 8.73 us on a loaded machine). Not kept.
        let mut k_buf: Scratch<SecondOrderCoeffs<T::Stat>, 64> = scratch(Default::default(), c);
        let k = &mut k_buf[..];
        for (ch, kc) in k.iter_mut().enumerate() {
            let r = 1.0 / (var(ch) + eps).sqrt();
            let (sc, ga, go) = (
                i.scale[ch].to_f64(),
                i.grad_scale_backprop[ch].to_f64(),
                i.grad_offset_backprop[ch],
            );
            let (kg, ka) = (kg[ch].to_f64(), ka[ch].to_f64());
            let (gbar, abar) = (kg + sums[ch].g / m, ka + sums[ch].a / m);
            let g_xc = sums[ch].g_xc + kg * sums[ch].xc; // Σg·(x − μ)
            let a_xc = sums[ch].a_xc + ka * sums[ch].xc; // ΣA·(x − μ)
            let (c2, e2, e3, g_mean, a_mean, dscale);
            if is_training {
                let s2 = r * g_xc / m; // mean(g·x̂)
                let t = r * a_xc / m; // mean(A·x̂)
                let mk = sums[ch].a_g - sums[ch].a * sums[ch].g / m; // Σ(A − Ā)(g − ḡ)
                let kk = mk / m;
                c2 = ga * r - sc * r * r * t;
                e2 = -sc * r * r * s2;
                e3 = -sc * r * r * r * (kk - 3.0 * s2 * t) - ga * r * r * s2;
                dscale = r * (mk - r * s2 * a_xc);
                (g_mean, a_mean) = (gbar, abar);
            } else {
                c2 = ga * r;
                (e2, e3) = (0.0, 0.0);
                dscale = r * sums[ch].a_g;
                (g_mean, a_mean) = (0.0, 0.0);
            }
            *kc = SecondOrderCoeffs {
                mean: mean[ch],
                a_mean: u(a_mean),
                g_mean: u(g_mean),
                c1: u(sc * r),
                c2: u(c2),
                b: go,
                e2: u(e2),
                e3: u(e3),
            };
            out.scale[ch] = u(dscale);
        }
        second_order::apply(g, isa, ins, k, (out.y_backprop, out.x));
        Ok(())
    }

    /// `scale·rsqrt(variance + ε)` per channel, computed in `f64`, rounded to `U`.
    pub(super) fn scale_rsqrt<U: Real>(&self, scale: &[U], variance: &[U]) -> Vec<U> {
        let eps = f64::from(self.epsilon());
        scale
            .iter()
            .zip(variance)
            .map(|(s, v)| U::from_f64(s.to_f64() / (v.to_f64() + eps).sqrt()))
            .collect()
    }
}
