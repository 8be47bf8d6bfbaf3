//! Parity with `candle_nn::BatchNorm` on the same parameters: outputs, every gradient
//! through candle's autograd from a scalar loss, running statistics, in training and
//! inference, for every rank and layout, affine or not; f32 and f64 to 1e-5 relative,
//! f16 and bf16 against the f32 path on the same rounded inputs.

mod common;

use candle_core::{DType, ModuleT, Result, Tensor, Var};
use common::*;

#[derive(Clone, Copy, Debug)]
struct Case<'a> {
    shape: &'a [usize],
    channels_last: bool,
    affine: bool,
    momentum: f64,
    eps: f64,
}

const SHAPES: [&[usize]; 5] = [
    &[16, 5],
    &[4, 6, 7],
    &[3, 5, 6, 7],
    &[2, 3, 4, 3, 5],
    &[2, 19, 33, 4], // channels not a multiple of any SIMD width, M of 132
];

/// One layer's variables.
struct Layer<L> {
    bn: L,
    running: (Var, Var),
    params: Option<(Var, Var)>,
}

/// The initial values of a case: x (f64, `[N, C, *]`), loss weights, parameters and
/// running statistics.
struct Init {
    x: Tensor,
    r: Tensor,
    w: Tensor,
    b: Tensor,
    rm: Tensor,
    rv: Tensor,
}

fn init(case: Case, seed: u64) -> Result<Init> {
    let c = case.shape[1];
    // Per-channel offsets, so the means are far from 0.
    let bshape: Vec<usize> = (0..case.shape.len())
        .map(|i| if i == 1 { c } else { 1 })
        .collect();
    let shift = (rand(&[c], -3.0, 3.0, seed + 7)?.reshape(bshape.as_slice()))?;
    Ok(Init {
        x: rand(case.shape, -1.0, 2.0, seed)?.broadcast_add(&shift)?,
        r: rand(case.shape, -1.0, 1.0, seed + 1)?,
        w: rand(&[c], 0.5, 1.5, seed + 2)?,
        b: rand(&[c], -0.5, 0.5, seed + 3)?,
        rm: rand(&[c], -0.2, 0.2, seed + 4)?,
        rv: rand(&[c], 0.5, 2.0, seed + 5)?,
    })
}

macro_rules! layer {
    ($ty:path, $init:expr, $case:expr, $dt:expr) => {{
        let (i, case, dt) = ($init, $case, $dt);
        let c = case.shape[1];
        let running = (var(&i.rm, dt)?, var(&i.rv, dt)?);
        let (rm, rv) = (running.0.as_tensor().clone(), running.1.as_tensor().clone());
        if case.affine {
            let params = (var(&i.w, dt)?, var(&i.b, dt)?);
            let (w, b) = (params.0.as_tensor().clone(), params.1.as_tensor().clone());
            let bn = <$ty>::new_with_momentum(c, rm, rv, w, b, case.eps, case.momentum)?;
            Layer {
                bn,
                running,
                params: Some(params),
            }
        } else {
            let bn = <$ty>::new_no_bias_with_momentum(c, rm, rv, case.eps, case.momentum)?;
            Layer {
                bn,
                running,
                params: None,
            }
        }
    }};
}

/// What one forward and backward produced.
struct Run {
    y: Tensor,
    dx: Tensor,
    dw: Option<Tensor>,
    db: Option<Tensor>,
    running: (Tensor, Tensor),
}

/// Two training forwards (or one inference forward) of `bn` on `x` (in `dt`, in the
/// case's layout), then the gradient of `Σ y·r`. `ours`: check that a channels-last
/// input gave a channels-last output.
fn run<L: ModuleT>(
    ours: bool,
    layer: &Layer<L>,
    i: &Init,
    case: Case,
    dt: DType,
    train: bool,
) -> Result<Run> {
    let (to_last, _) = perms(case.shape.len());
    let xv = if case.channels_last && case.shape.len() > 2 {
        var(&i.x.permute(to_last.as_slice())?, dt)?
    } else {
        var(&i.x, dt)?
    };
    let x = if case.channels_last && case.shape.len() > 2 {
        let x = channels_last_view(xv.as_tensor())?;
        assert!(!x.is_contiguous());
        x
    } else {
        xv.as_tensor().clone()
    };
    if train {
        // A first step whose only effect is on the running statistics.
        let x2 = (&x * 0.5)?; // exact in every dtype
        layer.bn.forward_t(&x2, true)?;
    }
    let y = layer.bn.forward_t(&x, train)?;
    if ours && case.channels_last && case.shape.len() > 2 {
        assert!(is_channels_last(&y)?, "{case:?}: y is not channels-last");
    }
    let loss = (&y * i.r.to_dtype(dt)?)?.sum_all()?;
    let grads = loss.backward()?;
    let mut dx = grads.get(&xv).expect("no gradient for x").clone();
    if case.channels_last && case.shape.len() > 2 {
        dx = channels_last_view(&dx)?;
    }
    let g = |v: &Var| grads.get(v).cloned();
    Ok(Run {
        y,
        dx,
        dw: layer.params.as_ref().and_then(|p| g(&p.0)),
        db: layer.params.as_ref().and_then(|p| g(&p.1)),
        running: (
            layer.running.0.as_detached_tensor(),
            layer.running.1.as_detached_tensor(),
        ),
    })
}

fn compare(
    what: &str,
    ours: &Run,
    theirs: &Run,
    check: impl Fn(&str, &Tensor, &Tensor) -> Result<()>,
) -> Result<()> {
    check(&format!("{what} y"), &ours.y, &theirs.y)?;
    check(&format!("{what} dx"), &ours.dx, &theirs.dx)?;
    match (&ours.dw, &theirs.dw, &ours.db, &theirs.db) {
        (Some(a), Some(b), Some(c), Some(d)) => {
            check(&format!("{what} dweight"), a, b)?;
            check(&format!("{what} dbias"), c, d)?;
        }
        (None, None, None, None) => {}
        _ => panic!("{what}: gradients of the parameters on one side only"),
    }
    check(
        &format!("{what} running_mean"),
        &ours.running.0,
        &theirs.running.0,
    )?;
    check(
        &format!("{what} running_var"),
        &ours.running.1,
        &theirs.running.1,
    )
}

fn cases() -> Vec<Case<'static>> {
    let mut v = vec![];
    for shape in SHAPES {
        for channels_last in [false, true] {
            if channels_last && shape.len() == 2 {
                continue;
            }
            for affine in [true, false] {
                v.push(Case {
                    shape,
                    channels_last,
                    affine,
                    momentum: 0.1,
                    eps: 1e-5,
                });
            }
        }
    }
    v.push(Case {
        shape: &[8, 4, 3, 3],
        channels_last: false,
        affine: true,
        momentum: 0.7,
        eps: 1e-3,
    });
    v
}

#[test]
fn f32_and_f64_match_candle_nn_in_training_and_inference() -> Result<()> {
    for (k, case) in cases().into_iter().enumerate() {
        for dt in [DType::F32, DType::F64] {
            for train in [true, false] {
                let i = init(case, 100 + k as u64)?;
                let ours = layer!(fusedbn_candle::BatchNorm, &i, case, dt);
                let theirs = layer!(candle_nn::BatchNorm, &i, case, dt);
                assert!(ours.bn.is_fused_for(&i.x.to_dtype(dt)?));
                let a = run(true, &ours, &i, case, dt, train)?;
                let b = run(false, &theirs, &i, case, dt, train)?;
                let what = format!("{case:?} {dt:?} train={train}");
                compare(&what, &a, &b, |w, x, y| close(w, x, y, 1e-5))?;
            }
        }
    }
    Ok(())
}

#[test]
fn halves_match_the_f32_path_on_the_same_rounded_inputs() -> Result<()> {
    for (k, case) in cases().into_iter().enumerate() {
        for (dt, unit) in [(DType::F16, 2f64.powi(-10)), (DType::BF16, 2f64.powi(-7))] {
            for train in [true, false] {
                let mut i = init(case, 300 + k as u64)?;
                // Every input representable in the half type.
                for t in [&mut i.x, &mut i.r, &mut i.w, &mut i.b, &mut i.rm, &mut i.rv] {
                    *t = t.to_dtype(dt)?.to_dtype(DType::F64)?;
                }
                let ours = layer!(fusedbn_candle::BatchNorm, &i, case, dt);
                let reference = layer!(candle_nn::BatchNorm, &i, case, DType::F32);
                let a = run(true, &ours, &i, case, dt, train)?;
                let b = run(false, &reference, &i, case, DType::F32, train)?;
                assert_eq!(a.y.dtype(), dt);
                let what = format!("{case:?} {dt:?} train={train}");
                // Rounded once from f32 (the parameters' gradients too). The running
                // statistics of the second step carry the first step's stored rounding
                // through `(1 − m)·old + m·new`, which can cancel: bounded against
                // the largest of them.
                compare(&what, &a, &b, |w, x, y| {
                    let floor = if w.contains("running") { 1.0 } else { 1e-3 };
                    close_half(w, x, y, unit, 2.0, floor)
                })?;
            }
        }
    }
    Ok(())
}

/// candle-nn fails to train in f16 (its running statistics and the f32 batch statistics
/// meet in one add); ours trains there and keeps the variables' dtype.
#[test]
fn trains_in_f16_with_f16_variables() -> Result<()> {
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F16, &DEV);
    let bn = fusedbn_candle::batch_norm(3, 1e-5, vb.pp("bn"))?;
    let x = rand(&[4, 3, 5, 5], 1.0, 3.0, 9)?.to_dtype(DType::F16)?;
    let y = bn.forward_t(&x, true)?;
    assert_eq!(y.dtype(), DType::F16);
    assert_eq!(bn.running_mean().dtype(), DType::F16);
    let m = bn.running_mean().to_dtype(DType::F32)?.to_vec1::<f32>()?;
    assert!(m.iter().all(|&v| (v - 0.2).abs() < 0.02), "{m:?}"); // 0.1 · mean ≈ 0.2
    let (w, _) = bn.weight_and_bias().unwrap();
    let g = (y * 2.0)?.sum_all()?.backward()?;
    assert_eq!(g.get(w).unwrap().dtype(), DType::F16);
    Ok(())
}

/// The permuted view is run in place: the output is the same kind of view and no copy
/// of `x` is made (the op sees x's own buffer).
#[test]
fn channels_last_views_stay_channels_last() -> Result<()> {
    let buffer = rand(&[2, 4, 5, 3], -1.0, 1.0, 11)?.to_dtype(DType::F32)?; // [N, H, W, C]
    let x = channels_last_view(&buffer)?; // [N, C, H, W]
    let y = fusedbn_candle::batch_norm_train(&x, None, None, 1e-5, Default::default())?.y;
    assert_eq!(y.dims(), [2, 3, 4, 5]);
    assert!(!y.is_contiguous() && is_channels_last(&y)?);
    let want =
        fusedbn_candle::batch_norm_train(&x.contiguous()?, None, None, 1e-5, Default::default())?.y;
    assert!(want.is_contiguous());
    close("channels-last vs contiguous", &y, &want, 1e-6)
}
