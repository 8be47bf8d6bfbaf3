//! The phases of batch normalization in training, as validated building blocks, so that
//! a collective (an all-reduce across processes, threads or devices) can sit between
//! them. The whole ops ([`Problem::forward`], [`Problem::backward`]) are these phases
//! fused; on one shard the phases give bit-identical results.
//!
//! | phase | reads | writes |
//! |---|---|---|
//! | 1. [`Problem::moments`] | `x` | per channel `(count, mean, M2)` of this shard ([`Moments`]) |
//! | 2. [`combine_moments`] | every shard's moments, in shard order | the global moments |
//! | 3. [`Problem::forward_apply`] | `x`, scale/offset, the global moments (side input) | `y`, saved statistics, running statistics (variance corrected with the **global** count) |
//! | 4. [`Problem::backward_sums`] | `dy`, `x`, the saved (global) mean (ReLU output) | per channel `(count, Σdy, Σdy·(x−mean))` of this shard ([`GradSums`]); the side input's gradient |
//! | 5. [`combine_sums`] | every shard's sums, in shard order | the global sums |
//! | 6. [`Problem::backward_apply`] | `dy`, `x`, scale, saved statistics, the global sums (ReLU output) | `dx`, and the **global** `dscale`, `doffset` |
//!
//! A data-parallel step over two shards (here in one process; across processes the
//! combine steps are an all-gather):
//!
//! ```
//! use fusedbn::{DataFormat, Problem};
//! use fusedbn::batch_norm::{phases, Affine, Epilogue, GradEpilogue, GradInputs, Gradients,
//!     SavedStats, Statistics, TrainingStats};
//! let shards: [Vec<f32>; 2] = [vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0, 7.0, 8.0]];
//! let problems: Vec<Problem> = shards.iter()
//!     .map(|x| Problem::new(DataFormat::Nhwc, &[1, 1, x.len(), 1]))
//!     .collect::<Result<_, _>>()?;
//! let affine = Affine { scale: &[1.0f32][..], offset: &[0.0][..] };
//! // 1–2: local moments, combined in shard order.
//! let local: Vec<Vec<phases::Moments>> = problems.iter().zip(&shards)
//!     .map(|(p, x)| p.moments(x)).collect::<Result<_, _>>()?;
//! let global = phases::combine_moments(&[&local[0], &local[1]])?;
//! assert_eq!((global[0].count, global[0].mean), (8.0, 4.5));
//! // 3: every shard normalizes with the global statistics.
//! let (mut mean, mut var) = ([0.0f32], [0.0f32]);
//! let mut y0 = vec![0.0f32; 3];
//! problems[0].forward_apply(&shards[0], affine, &global,
//!     TrainingStats { saved: SavedStats { mean: &mut mean, variance: &mut var }, running: None },
//!     Epilogue::plain(), &mut y0)?;
//! assert_eq!((mean[0], var[0]), (4.5, 5.25));
//! // 4–6: local gradient sums, combined, then dx and the global dscale/doffset.
//! let saved = Statistics { mean: &mean[..], variance: &var[..] };
//! let dy = [vec![1.0f32; 3], vec![1.0f32; 5]];
//! let sums: Vec<Vec<phases::GradSums>> = (0..2)
//!     .map(|i| problems[i].backward_sums(GradInputs { y_backprop: &dy[i], x: &shards[i] },
//!         saved.mean, GradEpilogue::default()))
//!     .collect::<Result<_, _>>()?;
//! let total = phases::combine_sums(&[&sums[0], &sums[1]])?;
//! let (mut dx, mut dscale, mut doffset) = (vec![0.0f32; 3], [0.0f32], [0.0f32]);
//! problems[0].backward_apply(GradInputs { y_backprop: &dy[0], x: &shards[0] }, affine.scale,
//!     saved, &total, None, Gradients { x: &mut dx, scale: &mut dscale, offset: &mut doffset })?;
//! assert_eq!(doffset[0], 8.0); // global Σdy
//! assert!(dx.iter().all(|v| v.abs() < 1e-6)); // a constant dy has no effect
//! # Ok::<(), fusedbn::Error>(())
//! ```

use super::{
    Affine, Epilogue, GradEpilogue, GradInputs, Gradients, Problem, Statistics, TrainingStats,
};
use crate::element::{Element, Real};
use crate::error::{Error, Result};
use crate::kernels::backward::{self, GradData};
use crate::kernels::{apply, fused, stats};

/// Per-channel count, mean and `M2` (sum of squared deviations from the mean) of one
/// shard, mergeable in any grouping with [`Moments::merge`] (Chan, Golub and LeVeque's
/// pairwise update). `count` is an integer held in `f64`.
pub use crate::kernels::stats::Moments;

/// Per-channel gradient sums of one shard: the element count, `Σdy` and
/// `Σdy·(x − mean)` (with the **global** mean), in `f64`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GradSums {
    /// Elements summed (an integer held in `f64`).
    pub count: f64,
    /// `Σ dy`.
    pub sum_dy: f64,
    /// `Σ dy·(x − mean)`.
    pub sum_dy_xc: f64,
}

impl GradSums {
    /// The sums of two shards together.
    pub fn merge(self, other: GradSums) -> GradSums {
        GradSums {
            count: self.count + other.count,
            sum_dy: self.sum_dy + other.sum_dy,
            sum_dy_xc: self.sum_dy_xc + other.sum_dy_xc,
        }
    }
}

/// Folds per-shard, per-channel values in shard order: `parts[0] ⊕ parts[1] ⊕ …`,
/// channel by channel. Fails when the shards disagree on the channel count.
fn fold<V: Copy + Default>(parts: &[&[V]], merge: impl Fn(V, V) -> V) -> Result<Vec<V>> {
    let Some(first) = parts.first() else {
        return Err(Error::arg("parts", "at least one shard", "none"));
    };
    let c = first.len();
    let mut out = first.to_vec();
    for (i, p) in parts.iter().enumerate().skip(1) {
        if p.len() != c {
            return Err(Error::arg(
                "parts",
                format!("{c} channels in every shard (as shard 0)"),
                format!("{} channels in shard {i}", p.len()),
            ));
        }
        for (a, &b) in out.iter_mut().zip(p.iter()) {
            *a = merge(*a, b);
        }
    }
    Ok(out)
}

/// Phase 2: the global moments from every shard's, folded left to right in the order
/// given (give them in rank order: every rank then holds bit-identical statistics,
/// whatever the grouping the transport used). Empty shards (count 0) are neutral.
pub fn combine_moments(parts: &[&[Moments]]) -> Result<Vec<Moments>> {
    fold(parts, Moments::merge)
}

/// Phase 5: the global gradient sums from every shard's, added left to right in the
/// order given.
pub fn combine_sums(parts: &[&[GradSums]]) -> Result<Vec<GradSums>> {
    fold(parts, GradSums::merge)
}

impl Problem {
    /// Phase 1: this shard's per-channel moments (`count` = the elements per channel;
    /// an empty shard gives count 0). Reads `x` once.
    pub fn moments<T: Element>(&self, x: &[T]) -> Result<Vec<Moments>> {
        T::mono_moments(self, x)
    }

    pub(super) fn moments_impl<T: Element>(&self, x: &[T]) -> Result<Vec<Moments>> {
        self.check_x("x", x.len())?;
        if self.is_empty() {
            return Ok(vec![Moments::EMPTY; self.channels()]);
        }
        Ok(stats::channel_moments(self.geometry(), self.isa(), x))
    }

    /// Phase 3: `y = act((x − mean)·scale/√(variance + ε) + offset + side)` with the
    /// given (global) moments, writing them as the saved statistics and updating the
    /// running statistics with the global count (`variance·n/(n−1)`). A shard with no
    /// elements writes only the statistics. With a global count of 0 every statistic
    /// is NaN. Fails when a channel's global count is less than this shard's.
    pub fn forward_apply<T: Element>(
        &self,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        moments: &[Moments],
        stats: TrainingStats<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &mut [T],
    ) -> Result<()> {
        T::mono_forward_apply(self, x, affine, moments, stats, epilogue, y)
    }

    pub(super) fn forward_apply_impl<T: Element>(
        &self,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        moments: &[Moments],
        stats: TrainingStats<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &mut [T],
    ) -> Result<()> {
        self.check_forward(x, affine, epilogue, y)?;
        self.check_c("moments", moments.len())?;
        self.check_training_stats(&stats)?;
        let local = self.elements_per_channel() as f64;
        if let Some(c) = moments
            .iter()
            .position(|m| m.count < local || m.count.is_nan())
        {
            return Err(Error::arg(
                "moments",
                format!("a global count of at least this shard's {local} elements per channel"),
                format!("count {} in channel {c}", moments[c].count),
            ));
        }
        if !self.is_empty() {
            let eps = f64::from(self.epsilon());
            let k = fused::Columns::new(self.channels(), |c| {
                forward_coeffs(affine, c, moments[c], eps)
            });
            apply::affine(
                self.geometry(),
                self.isa(),
                x,
                k.get(),
                epilogue.kernel(),
                y,
            );
        }
        write_training_stats(moments, self.channels(), stats);
        Ok(())
    }

    /// Phase 4: this shard's per-channel `(count, Σdy, Σdy·(x − mean))`, with `mean`
    /// the saved (global) batch mean. With `epilogue.relu_output`, `dy` counts only where
    /// that forward output is positive; `epilogue.side_input_backprop` receives the
    /// masked `dy` in the same pass (the side input's gradient is local). Reads `dy`
    /// and `x` once.
    pub fn backward_sums<T: Element>(
        &self,
        inputs: GradInputs<'_, T>,
        mean: &[T::Stat],
        epilogue: GradEpilogue<'_, T>,
    ) -> Result<Vec<GradSums>> {
        T::mono_backward_sums(self, inputs, mean, epilogue)
    }

    pub(super) fn backward_sums_impl<T: Element>(
        &self,
        inputs: GradInputs<'_, T>,
        mean: &[T::Stat],
        epilogue: GradEpilogue<'_, T>,
    ) -> Result<Vec<GradSums>> {
        self.check_x("y_backprop", inputs.y_backprop.len())?;
        self.check_x("x", inputs.x.len())?;
        self.check_c("mean", mean.len())?;
        if let Some(y) = epilogue.relu_output {
            self.check_x("y (relu_output)", y.len())?;
        }
        if let Some(sg) = &epilogue.side_input_backprop {
            self.check_x("side_input_backprop (output)", sg.len())?;
        }
        let c = self.channels();
        if self.is_empty() {
            return Ok(vec![GradSums::default(); c]);
        }
        let (g, isa) = (self.geometry(), self.isa());
        let data = GradData {
            dy: inputs.y_backprop,
            mask: epilogue.relu_output,
            x: inputs.x,
        };
        let sums = match epilogue.side_input_backprop {
            None => backward::reduce(g, isa, data, mean),
            Some(sg) => {
                let ones = vec![T::Stat::from_f64(1.0); c];
                fused::backward_inference(g, isa, data, mean, &ones, sg)
            }
        };
        let count = self.elements_per_channel() as f64;
        Ok((0..c)
            .map(|ch| GradSums {
                count,
                sum_dy: sums.sum_dy[ch],
                sum_dy_xc: sums.sum_dy_xc[ch],
            })
            .collect())
    }

    /// Phase 6: `dx = scale·r·(dy − Σdy/n − (x − mean)·r²·Σdy(x − mean)/n)` with
    /// `r = 1/√(variance + ε)` and the given (global) sums and count `n`, and the
    /// **global** parameter gradients `dscale = r·Σdy(x − mean)`, `doffset = Σdy`
    /// (every shard gets the same). `saved` are the global batch statistics of the
    /// forward. With `relu_output`, `dy` is masked as in phase 4. Reads `dy` and `x`
    /// once (and `relu_output`).
    ///
    /// Where phase 4 wrote `side_input_backprop`, pass that as `y_backprop` and no
    /// `relu_output`: it is `dy` masked exactly, so `dx` has the same bits, and one
    /// tensor fewer is read ([`Problem::backward_sync`](crate::Problem::backward_sync)
    /// and the whole op do this).
    pub fn backward_apply<T: Element>(
        &self,
        inputs: GradInputs<'_, T>,
        scale: &[T::Stat],
        saved: Statistics<'_, T::Stat>,
        sums: &[GradSums],
        relu_output: Option<&[T]>,
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        T::mono_backward_apply(self, inputs, scale, saved, sums, relu_output, grads)
    }

    pub(super) fn backward_apply_impl<T: Element>(
        &self,
        inputs: GradInputs<'_, T>,
        scale: &[T::Stat],
        saved: Statistics<'_, T::Stat>,
        sums: &[GradSums],
        relu_output: Option<&[T]>,
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        let epilogue = GradEpilogue {
            relu_output,
            side_input_backprop: None,
        };
        self.check_backward(inputs, scale, saved, &epilogue, &grads)?;
        self.check_c("sums", sums.len())?;
        let local = self.elements_per_channel() as f64;
        if let Some(c) = sums
            .iter()
            .position(|s| s.count < local || s.count.is_nan())
        {
            return Err(Error::arg(
                "sums",
                format!("a global count of at least this shard's {local} elements per channel"),
                format!("count {} in channel {c}", sums[c].count),
            ));
        }
        let eps = f64::from(self.epsilon());
        let sum_dy: Vec<f64> = sums.iter().map(|s| s.sum_dy).collect();
        let sum_dy_xc: Vec<f64> = sums.iter().map(|s| s.sum_dy_xc).collect();
        if !self.is_empty() {
            let (g, isa) = (self.geometry(), self.isa());
            let k = fused::Columns::new(self.channels(), |c| {
                let s = &sums[c];
                backward_coeffs(scale, saved, eps, s.count, c, s.sum_dy, s.sum_dy_xc)
            });
            let [dm, k1, k2] = k.get();
            let data = GradData {
                dy: inputs.y_backprop,
                mask: relu_output,
                x: inputs.x,
            };
            backward::apply(g, isa, data, [dm, saved.mean, k1, k2], grads.x);
        }
        write_param_grads(saved, eps, &sum_dy, &sum_dy_xc, grads.scale, grads.offset);
        Ok(())
    }

    pub(crate) fn check_training_stats<U>(&self, stats: &TrainingStats<'_, U>) -> Result<()> {
        if let Some(r) = &stats.running {
            self.check_c("running mean", r.mean.len())?;
            self.check_c("running variance", r.variance.len())?;
        }
        self.check_c(
            "saved mean (reserve_space_1, output)",
            stats.saved.mean.len(),
        )?;
        self.check_c(
            "saved variance (reserve_space_2, output)",
            stats.saved.variance.len(),
        )
    }
}

/// The forward's per-channel `[shift, a, b]`: `y = (x − shift)·a + b` with the mean
/// rounded to `U` as it is saved and `a = scale/√(σ² + ε)` in `f64`.
pub(super) fn forward_coeffs<U: Real>(
    affine: Affine<'_, U>,
    c: usize,
    mo: Moments,
    eps: f64,
) -> [U; 3] {
    let a = affine.scale[c].to_f64() / (mo.variance() + eps).sqrt();
    [U::from_f64(mo.mean), U::from_f64(a), affine.offset[c]]
}

/// Writes the saved statistics and updates the running ones from the (global)
/// moments: NaN everywhere when there are none (an empty batch).
pub(crate) fn write_training_stats<U: Real>(
    moments: &[Moments],
    channels: usize,
    stats: TrainingStats<'_, U>,
) {
    let nan = U::from_f64(f64::NAN);
    let TrainingStats { saved, running } = stats;
    for c in 0..channels {
        let mo = moments.get(c).copied().unwrap_or(Moments::EMPTY);
        if mo.count == 0.0 {
            saved.mean[c] = nan;
            saved.variance[c] = nan;
        } else {
            saved.mean[c] = U::from_f64(mo.mean);
            saved.variance[c] = U::from_f64(mo.variance());
        }
    }
    let Some(r) = running else { return };
    let f = f64::from(r.factor);
    for c in 0..channels {
        let mo = moments.get(c).copied().unwrap_or(Moments::EMPTY);
        if mo.count == 0.0 {
            r.mean[c] = nan;
            r.variance[c] = nan;
            continue;
        }
        let adj = mo.count / (mo.count - 1.0).max(1.0);
        let (mu, var) = (mo.mean, adj * mo.variance());
        let (mean, variance) = if r.factor == 1.0 {
            (mu, var)
        } else {
            (
                (1.0 - f) * r.mean[c].to_f64() + f * mu,
                (1.0 - f) * r.variance[c].to_f64() + f * var,
            )
        };
        r.mean[c] = U::from_f64(mean);
        r.variance[c] = U::from_f64(variance);
    }
}

/// The training gradient's per-channel `[dȳ, k1, k2]`:
/// `dx = (dy − dȳ)·k1 + (x − mean)·k2` with `k1 = scale·r`, `k2 = −k1·r²·Σdy(x−μ)/n`.
pub(super) fn backward_coeffs<U: Real>(
    scale: &[U],
    saved: Statistics<'_, U>,
    eps: f64,
    n: f64,
    c: usize,
    sum_dy: f64,
    sum_dy_xc: f64,
) -> [U; 3] {
    let r = 1.0 / (saved.variance[c].to_f64() + eps).sqrt();
    let k1 = scale[c].to_f64() * r;
    [
        U::from_f64(sum_dy / n),
        U::from_f64(k1),
        U::from_f64(-k1 * r * r * sum_dy_xc / n),
    ]
}

/// `doffset = Σdy`, `dscale = r·Σdy(x − mean)`.
pub(super) fn write_param_grads<U: Real>(
    saved: Statistics<'_, U>,
    eps: f64,
    sum_dy: &[f64],
    sum_dy_xc: &[f64],
    dscale: &mut [U],
    doffset: &mut [U],
) {
    for c in 0..dscale.len() {
        let r = 1.0 / (saved.variance[c].to_f64() + eps).sqrt();
        doffset[c] = U::from_f64(sum_dy[c]);
        dscale[c] = U::from_f64(r * sum_dy_xc[c]);
    }
}
