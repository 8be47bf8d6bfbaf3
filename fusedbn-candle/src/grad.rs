//! The gradient of the fused op as candle ops of its own, so that a second backward (the
//! gradient of a gradient: gradient penalties, Hessian-vector products) reaches
//! fusedbn's second-order kernel (`Problem::second_order`, TensorFlow's
//! `FusedBatchNormGradGrad`) instead of seeing constants.
//!
//! The backward of [`crate::op::FusedBatchNorm`] is one kernel call with up to four
//! results (dx, the side input's gradient, dscale, doffset), but a candle op has one
//! output. So its `bwd` applies up to three ops: [`BatchNormGrad`] (output dx) and
//! [`GradParams`] (output `cat[dscale, doffset]`, f64) to the same arguments `(x,
//! scale, dy)`, and, behind a ReLU, [`SideGrad`] (the side input's gradient) to dy. The
//! first runs the fused backward and leaves the other results in the state the three
//! share, where the others take them: the first-order backward is still one kernel
//! call. The `bwd` of the first two is the second-order kernel given that output's
//! upstream gradient and zeros for the other's (the kernel is linear in them, and
//! candle adds the parts); that of [`SideGrad`] is the ReLU's mask.
//!
//! The gradient graph keeps `x`, `dy` and (behind a ReLU) `y` alive until the gradients
//! are dropped, as candle-nn's backward keeps its operands.
//!
//! Candle detaches the gradient between nodes unless `CANDLE_GRAD_DO_NOT_DETACH` is set
//! (candle-core's `backprop.rs`), so a second backward through anything but a leaf
//! needs that variable, as it does through candle-nn's own `BatchNorm`. The
//! second-order results are constants to autograd: a third backward is not supported.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor, WithDType,
};
use fusedbn::batch_norm::{
    Backward, GradEpilogue, GradInputs, Gradients, Mode, SecondOrderGradients, SecondOrderInputs,
    Statistics,
};
use fusedbn::{Element, Problem, Real};

use crate::op::{by_dtype, contiguous, err, per_channel, to_f64, to_stat, values, CpuView, Stats};

/// What the fused backward computed besides dx, until the op that returns it runs.
#[derive(Debug, Default)]
pub(crate) struct Extras {
    /// The side input's gradient (dy masked by the ReLU).
    side: Option<CpuStorage>,
    /// `cat[dscale, doffset]`.
    params: Option<Vec<f64>>,
}

/// The constants of one backward call, shared by its ops.
#[derive(Debug)]
pub(crate) struct GradShared {
    /// The forward's problem (layout, shape, epsilon).
    pub problem: Problem,
    /// Training (batch statistics) or inference (population statistics).
    pub training: bool,
    /// The statistics the forward normalized with.
    pub stats: Stats,
    /// The forward's output behind a ReLU: its mask `y > 0`.
    pub relu_y: Option<Tensor>,
    /// Whether the fused backward writes the side input's gradient (a side input
    /// behind a ReLU; without the ReLU that gradient is dy itself).
    pub side_output: bool,
    pub extras: Mutex<Extras>,
}

impl GradShared {
    fn extras(&self) -> Result<MutexGuard<'_, Extras>> {
        self.extras
            .lock()
            .map_err(|_| candle_core::Error::msg("fusedbn: a batch-norm backward panicked"))
    }

    fn statistics<U: Real>(&self) -> (Vec<U>, Vec<U>) {
        (to_stat(&self.stats.mean), to_stat(&self.stats.variance))
    }

    /// The ReLU's output, as the elements of `T` the op's arguments have.
    fn relu_view(&self) -> Result<Option<CpuView<'_>>> {
        self.relu_y
            .as_ref()
            .map(|y| CpuView::of(y, "y"))
            .transpose()
    }

    /// The fused backward: returns dx, and leaves the side input's gradient and
    /// `cat[dscale, doffset]` in [`Extras`].
    fn first_order<T: Element + WithDType>(
        &self,
        x: &[T],
        dy: &[T],
        scale: &[f64],
    ) -> Result<Vec<T>> {
        let p = &self.problem;
        let (mean, variance) = self.statistics::<T::Stat>();
        let stats = Statistics {
            mean: &mean,
            variance: &variance,
        };
        let mode = if self.training {
            Backward::Training(stats)
        } else {
            Backward::Inference(stats)
        };
        let scale = to_stat::<T::Stat>(scale);
        let c = p.channels();
        let y = self.relu_view()?;
        let y = y.as_ref().map(|v| v.slice::<T>()).transpose()?;
        let mut dx = vec![T::default(); x.len()];
        let mut dside = self.side_output.then(|| vec![T::default(); x.len()]);
        let (mut dscale, mut doffset) = (vec![T::Stat::ZERO; c], vec![T::Stat::ZERO; c]);
        p.backward(
            GradInputs { y_backprop: dy, x },
            &scale,
            mode,
            GradEpilogue {
                relu_output: y,
                side_input_backprop: dside.as_deref_mut(),
            },
            Gradients {
                x: &mut dx,
                scale: &mut dscale,
                offset: &mut doffset,
            },
        )
        .map_err(err)?;
        let mut params = to_f64(&dscale);
        params.extend(to_f64(&doffset));
        let mut e = self.extras()?;
        e.side = dside.map(T::to_cpu_storage_owned);
        e.params = Some(params);
        Ok(dx)
    }

    /// The gradients with respect to `x`, `scale` and `dy` of `Σ gx·dx + Σ gp·cat[dscale,
    /// doffset]` (`None`: zeros), from the second-order kernel.
    fn second_order<T: Element + WithDType>(
        &self,
        [x, dy]: [&[T]; 2],
        scale: &[f64],
        gx: Option<&[T]>,
        gp: Option<&[f64]>,
    ) -> Result<(Vec<T>, Vec<f64>, Vec<T>)> {
        let p = &self.problem;
        let (c, n) = (p.channels(), x.len());
        let y = self.relu_view()?;
        let y = y.as_ref().map(|v| v.slice::<T>()).transpose()?;
        let kept = |y: T| y.to_f64() > 0.0;
        // Behind a ReLU the gradient op took dy masked by `y > 0`, a mask constant
        // almost everywhere: the kernel's dy is the masked one, and its gradient with
        // respect to dy is masked again below.
        let dy: Cow<[T]> = match y {
            Some(y) => dy
                .iter()
                .zip(y)
                .map(|(&d, &y)| if kept(y) { d } else { T::default() })
                .collect(),
            None => Cow::Borrowed(dy),
        };
        let zeros;
        let gx = match gx {
            Some(g) => g,
            None => {
                zeros = vec![T::default(); n];
                &zeros
            }
        };
        let (gs, go) = match gp {
            Some(g) if g.len() == 2 * c => (to_stat(&g[..c]), to_stat(&g[c..])),
            Some(g) => bail!(
                "fusedbn: the parameters' gradient has {} values, expected {}",
                g.len(),
                2 * c
            ),
            None => (vec![T::Stat::ZERO; c], vec![T::Stat::ZERO; c]),
        };
        let (mean, variance) = self.statistics::<T::Stat>();
        let scale = to_stat::<T::Stat>(scale);
        let (mut ddy, mut dx) = (vec![T::default(); n], vec![T::default(); n]);
        let mut dscale = vec![T::Stat::ZERO; c];
        let mode = if self.training {
            Mode::Training
        } else {
            Mode::Inference
        };
        p.second_order(
            SecondOrderInputs {
                y_backprop: &dy,
                x,
                scale: &scale,
                reserve: Statistics {
                    mean: &mean,
                    variance: &variance,
                },
                grad_x_backprop: gx,
                grad_scale_backprop: &gs,
                grad_offset_backprop: &go,
            },
            mode,
            SecondOrderGradients {
                y_backprop: &mut ddy,
                x: &mut dx,
                scale: &mut dscale,
            },
        )
        .map_err(err)?;
        if let Some(y) = y {
            for (d, &y) in ddy.iter_mut().zip(y) {
                if !kept(y) {
                    *d = T::default();
                }
            }
        }
        Ok((dx, to_f64(&dscale), ddy))
    }

    /// The `bwd` of [`BatchNormGrad`] (`gx`) and [`GradParams`] (`gp`): the gradients
    /// of their arguments `x`, `scale` and `dy`, each only where candle will use it.
    fn backward(
        &self,
        [x, scale, dy]: [&Tensor; 3],
        gx: Option<&Tensor>,
        gp: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if !(x.track_op() || scale.track_op() || dy.track_op()) {
            return Ok((None, None, None));
        }
        let scale_v = values(scale)?;
        let gx = gx.map(|g| g.contiguous()).transpose()?;
        let gp = gp.map(values).transpose()?;
        let (xv, dyv) = (CpuView::of(x, "x")?, CpuView::of(dy, "dy")?);
        let gxv = gx
            .as_ref()
            .map(|g| CpuView::of(g, "the gradient of dx"))
            .transpose()?;
        let dev = x.device();
        macro_rules! run {
            ($t:ty) => {{
                let gx = gxv.as_ref().map(|v| v.slice::<$t>()).transpose()?;
                let (dx, dscale, ddy) = self.second_order::<$t>(
                    [xv.slice::<$t>()?, dyv.slice::<$t>()?],
                    &scale_v,
                    gx,
                    gp.as_deref(),
                )?;
                (
                    Tensor::from_vec(dx, x.shape(), dev)?,
                    Tensor::from_vec(dscale, scale.shape(), dev)?.to_dtype(scale.dtype())?,
                    Tensor::from_vec(ddy, x.shape(), dev)?,
                )
            }};
        }
        let (dx, dscale, ddy) = by_dtype!(x.dtype(), run);
        Ok((
            x.track_op().then_some(dx),
            scale.track_op().then_some(dscale),
            dy.track_op().then_some(ddy),
        ))
    }
}

/// The gradient with respect to `x`: `(x, scale, dy) → dx`, running the whole fused
/// backward (see the module docs).
#[derive(Debug)]
pub(crate) struct BatchNormGrad(pub Arc<GradShared>);

impl CustomOp3 for BatchNormGrad {
    fn name(&self) -> &'static str {
        "fusedbn-batch-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = &self.0.problem;
        if l1.dims() != p.shape() || l3.dims() != p.shape() {
            bail!(
                "fusedbn: the gradient's x {:?} and dy {:?}, the op was built for {:?}",
                l1.dims(),
                l3.dims(),
                p.shape()
            )
        }
        let scale = per_channel(s2, l2, 0, p.channels())?;
        macro_rules! run {
            ($t:ty) => {{
                let x = contiguous::<$t>(s1, l1, "x")?;
                let dy = contiguous::<$t>(s3, l3, "dy")?;
                <$t>::to_cpu_storage_owned(self.0.first_order::<$t>(x, dy, &scale)?)
            }};
        }
        let dx = by_dtype!(s1.dtype(), run);
        Ok((dx, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        scale: &Tensor,
        dy: &Tensor,
        _dx: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.0.backward([x, scale, dy], Some(grad), None)
    }
}

/// The gradients of `scale` and `offset`: `(x, scale, dy) → cat[dscale, doffset]`
/// (`[2C]`, f64), computed by the [`BatchNormGrad`] applied just before.
#[derive(Debug)]
pub(crate) struct GradParams(pub Arc<GradShared>);

impl CustomOp3 for GradParams {
    fn name(&self) -> &'static str {
        "fusedbn-batch-norm-grad-params"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let Some(v) = self.0.extras()?.params.take() else {
            bail!("fusedbn: the parameters' gradient before the batch-norm backward")
        };
        let n = v.len();
        Ok((CpuStorage::F64(v), Shape::from_dims(&[n])))
    }

    fn bwd(
        &self,
        x: &Tensor,
        scale: &Tensor,
        dy: &Tensor,
        _params: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.0.backward([x, scale, dy], None, Some(grad))
    }
}

/// The side input's gradient behind a ReLU: `dy → dy·(y > 0)`, computed by the
/// [`BatchNormGrad`] applied just before.
#[derive(Debug)]
pub(crate) struct SideGrad(pub Arc<GradShared>);

impl CustomOp1 for SideGrad {
    fn name(&self) -> &'static str {
        "fusedbn-batch-norm-side-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some(side) = self.0.extras()?.side.take() else {
            bail!("fusedbn: the side input's gradient before the batch-norm backward")
        };
        Ok((side, l.shape().clone()))
    }

    fn bwd(&self, _dy: &Tensor, _side: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let Some(y) = &self.0.relu_y else {
            return Ok(Some(grad.clone()));
        };
        let zeros = grad.zeros_like()?;
        Ok(Some(y.gt(0f64)?.where_cond(grad, &zeros)?))
    }
}
