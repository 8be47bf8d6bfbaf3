//! Second-order gradients (the gradient of a gradient, as a gradient penalty takes it)
//! through the fused layer: against candle-nn's `BatchNorm`, whose backward is made of
//! differentiable tensor ops, and against central differences in f64.
//!
//! Candle detaches the gradient between graph nodes unless `CANDLE_GRAD_DO_NOT_DETACH`
//! is set, and reads the variable once per thread. So each test runs itself again in a
//! child process with the variable set (setting it here would race with the other
//! test threads) and checks there.

mod common;

use candle_core::{DType, Result, Tensor, Var};
use common::*;

const DETACH_VAR: &str = "CANDLE_GRAD_DO_NOT_DETACH";

/// True in the child process (with the variable set), which runs the checks; in the
/// parent, runs test `name` in that child and asserts that it ran and passed.
fn in_child(name: &str) -> bool {
    if std::env::var(DETACH_VAR).is_ok_and(|v| !v.is_empty() && v != "0") {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--test-threads=1"])
        .env(DETACH_VAR, "1")
        .output()
        .expect("running the test binary again");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} with {DETACH_VAR}=1:\n{stdout}\n{stderr}"
    );
    false
}

/// The layer under test: fusedbn's or candle-nn's (with the epilogue written out).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layer {
    Fused,
    CandleNn,
}

#[derive(Clone, Copy, Debug)]
struct Case<'a> {
    shape: &'a [usize],
    channels_last: bool,
    train: bool,
    side: bool,
    relu: bool,
}

/// The leaves of one run: x's buffer, a factor ahead of the layer (so that x reaches it
/// through another tracked op), weight, bias, the side input and the loss's weights r.
struct Leaves {
    x: Var,
    s: Var,
    w: Var,
    b: Var,
    side: Var,
    r: Var,
}

/// The first-order gradients of `Σ y·r + Σ y²/4` (the square makes dy depend on the
/// inputs, so the penalty reaches the second-order kernel through dy too), then the
/// gradients of the penalty `Σ q·gx² + 0.7·Σ gw² + Σ t·gb + Σ u·gside`: `[gx, gw, gb,
/// gside, d/dx, d/ds, d/dw, d/db, d/dside, d/dr]` (absent gradients as zeros), and the
/// penalty's value. `bump`: element `k` of x's buffer moved by `delta` first.
fn penalty(
    layer: Layer,
    case: Case,
    dt: DType,
    seed: u64,
    bump: Option<(usize, f64)>,
) -> Result<(Vec<Tensor>, f64)> {
    let shape = case.shape;
    let (rank, c) = (shape.len(), shape[1]);
    let (to_last, _) = perms(rank);
    let last = case.channels_last && rank > 2;
    let buffer = |t: Tensor| -> Result<Var> {
        if last {
            var(&t.permute(to_last.as_slice())?, dt)
        } else {
            var(&t, dt)
        }
    };
    let view = |v: &Var| -> Result<Tensor> {
        if last {
            channels_last_view(v.as_tensor())
        } else {
            Ok(v.as_tensor().clone())
        }
    };
    let bshape: Vec<usize> = (0..rank).map(|i| if i == 1 { c } else { 1 }).collect();
    let shift = rand(&[c], -2.0, 2.0, seed + 9)?.reshape(bshape.as_slice())?;
    let mut x0 = rand(shape, -1.0, 2.0, seed)?.broadcast_add(&shift)?;
    if let Some((k, delta)) = bump {
        let dims = x0.dims().to_vec();
        let order = if last {
            to_last.clone()
        } else {
            (0..rank).collect()
        };
        // Element k of the buffer, whose dims are x's permuted by `order`.
        let mut buf = x0
            .permute(order.as_slice())?
            .contiguous()?
            .flatten_all()?
            .to_vec1::<f64>()?;
        buf[k] += delta;
        let bdims: Vec<usize> = order.iter().map(|&a| dims[a]).collect();
        let inverse: Vec<usize> = (0..rank)
            .map(|a| order.iter().position(|&b| b == a).unwrap_or(a))
            .collect();
        x0 = Tensor::from_vec(buf, bdims, &DEV)?.permute(inverse.as_slice())?;
    }
    let l = Leaves {
        x: buffer(x0)?,
        s: buffer(rand(shape, 0.5, 1.5, seed + 1)?)?,
        w: var(&rand(&[c], 0.5, 1.5, seed + 2)?, dt)?,
        b: var(&rand(&[c], -0.5, 0.5, seed + 3)?, dt)?,
        side: buffer(rand(shape, -1.0, 1.0, seed + 4)?)?,
        r: var(&rand(shape, -1.0, 1.0, seed + 7)?, dt)?,
    };
    let (rm, rv) = (
        rand(&[c], -0.5, 0.5, seed + 5)?.to_dtype(dt)?,
        rand(&[c], 0.5, 2.0, seed + 6)?.to_dtype(dt)?,
    );
    let (q, u) = (
        rand(shape, 0.5, 1.5, seed + 8)?.to_dtype(dt)?,
        rand(shape, -1.0, 1.0, seed + 10)?.to_dtype(dt)?,
    );
    let t = rand(&[c], -1.0, 1.0, seed + 11)?.to_dtype(dt)?;
    let z = (view(&l.x)? * view(&l.s)?)?;
    let side = view(&l.side)?;
    let (w, b) = (l.w.as_tensor().clone(), l.b.as_tensor().clone());
    let side_in = case.side.then_some(&side);
    let y = match layer {
        Layer::Fused => {
            let bn = fusedbn_candle::BatchNorm::new(c, rm, rv, w, b, 1e-3)?;
            bn.forward_ex(&z, side_in, case.relu, case.train)?
        }
        Layer::CandleNn => {
            let bn = candle_nn::BatchNorm::new(c, rm, rv, w, b, 1e-3)?;
            let mut y = candle_core::ModuleT::forward_t(&bn, &z, case.train)?;
            if let Some(s) = side_in {
                y = (y + s)?;
            }
            if case.relu {
                y = y.relu()?;
            }
            y
        }
    };
    let loss1 = ((&y * l.r.as_tensor())?.sum_all()? + (y.sqr()?.sum_all()? * 0.25)?)?;
    let g1 = loss1.backward()?;
    let first = |v: &Var| -> Result<Tensor> {
        match g1.get(v) {
            Some(g) => Ok(g.clone()),
            None => v.as_tensor().zeros_like(),
        }
    };
    let (gx, gw, gb, gside) = (first(&l.x)?, first(&l.w)?, first(&l.b)?, first(&l.side)?);
    let as_view = |g: &Tensor| -> Result<Tensor> {
        if last {
            channels_last_view(g)
        } else {
            Ok(g.clone())
        }
    };
    let mut loss2 = (as_view(&gx)?.sqr()? * &q)?.sum_all()?;
    loss2 = (loss2 + (gw.sqr()?.sum_all()? * 0.7)?)?;
    loss2 = (loss2 + (&gb * &t)?.sum_all()?)?;
    if case.side {
        loss2 = (loss2 + (as_view(&gside)? * &u)?.sum_all()?)?;
    }
    let value = loss2.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let g2 = loss2.backward()?;
    let second = |v: &Var| -> Result<Tensor> {
        let g = match g2.get(v) {
            Some(g) => g.clone(),
            None => v.as_tensor().zeros_like()?,
        };
        Ok(g)
    };
    let grads = vec![
        gx,
        gw,
        gb,
        gside,
        second(&l.x)?,
        second(&l.s)?,
        second(&l.w)?,
        second(&l.b)?,
        second(&l.side)?,
        second(&l.r)?,
    ];
    Ok((grads, value))
}

const NAMES: [&str; 10] = [
    "gx", "gw", "gb", "gside", "d2 x", "d2 s", "d2 w", "d2 b", "d2 side", "d2 r",
];

fn cases() -> Vec<Case<'static>> {
    let mut v = vec![];
    for (shape, channels_last) in [
        (&[16usize, 5][..], false),
        (&[4, 5, 6][..], false),
        (&[4, 5, 6][..], true),
        (&[3, 5, 6, 7][..], false),
        (&[3, 5, 6, 7][..], true),
        (&[2, 19, 9, 4][..], true),
        (&[2, 3, 4, 3, 5][..], false),
        (&[2, 3, 4, 3, 5][..], true),
    ] {
        for train in [true, false] {
            for (side, relu) in [(false, false), (true, true), (false, true), (true, false)] {
                v.push(Case {
                    shape,
                    channels_last,
                    train,
                    side,
                    relu,
                });
            }
        }
    }
    v
}

#[test]
fn second_order_matches_candle_nn_in_f32_and_f64() -> Result<()> {
    if !in_child("second_order_matches_candle_nn_in_f32_and_f64") {
        return Ok(());
    }
    for (i, case) in cases().into_iter().enumerate() {
        for (dt, tol) in [(DType::F64, 1e-9), (DType::F32, 2e-4)] {
            let seed = 100 + i as u64;
            let (ours, _) = penalty(Layer::Fused, case, dt, seed, None)?;
            let (theirs, _) = penalty(Layer::CandleNn, case, dt, seed, None)?;
            for ((name, a), b) in NAMES.iter().zip(&ours).zip(&theirs) {
                close(&format!("{case:?} {dt:?} {name}"), a, b, tol)?;
            }
            // Not vacuous: the penalty's gradient reaches x, the factor and the
            // weight through the layer's second order.
            let nonzero = |t: &Tensor| -> Result<bool> {
                Ok(t.abs()?
                    .max_all()?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?
                    > 0.0)
            };
            assert!(nonzero(&ours[5])? && nonzero(&ours[6])?, "{case:?}");
            if case.train {
                assert!(nonzero(&ours[4])?, "{case:?}");
            }
        }
    }
    Ok(())
}

/// The fused layer's second-order gradient of x against central differences of its own
/// first-order gradients (f64): an oracle that does not go through candle-nn.
#[test]
fn second_order_matches_finite_differences() -> Result<()> {
    if !in_child("second_order_matches_finite_differences") {
        return Ok(());
    }
    for (case, seed) in [
        (
            Case {
                shape: &[3, 5, 6, 7],
                channels_last: true,
                train: true,
                side: true,
                relu: true,
            },
            7,
        ),
        (
            Case {
                shape: &[16, 5],
                channels_last: false,
                train: true,
                side: false,
                relu: false,
            },
            8,
        ),
    ] {
        let d2x = penalty(Layer::Fused, case, DType::F64, seed, None)?.0[4].clone();
        let d2x = d2x.flatten_all()?.to_vec1::<f64>()?;
        let scale = d2x.iter().fold(0f64, |m, v| m.max(v.abs()));
        for k in [0, 1, 17, d2x.len() / 2, d2x.len() - 1] {
            let h = 1e-5;
            let loss2 = |delta: f64| -> Result<f64> {
                Ok(penalty(Layer::Fused, case, DType::F64, seed, Some((k, delta)))?.1)
            };
            let fd = (loss2(h)? - loss2(-h)?) / (2.0 * h);
            assert!(
                (fd - d2x[k]).abs() <= 1e-6 * scale,
                "{case:?} x[{k}]: finite differences {fd}, autograd {}",
                d2x[k]
            );
        }
    }
    Ok(())
}

/// f16 and bf16 against the f32 path (no ReLU: values within a rounding of zero flip
/// its mask, and one flipped element moves gx by a quarter of its largest value in
/// bf16; the ReLU's second order is checked in f32 and f64 above).
#[test]
fn half_types_follow_the_f32_path() -> Result<()> {
    if !in_child("half_types_follow_the_f32_path") {
        return Ok(());
    }
    let case = Case {
        shape: &[4, 8, 5, 6],
        channels_last: true,
        train: true,
        side: true,
        relu: false,
    };
    let (reference, _) = penalty(Layer::Fused, case, DType::F32, 3, None)?;
    // Measured: at most 8.9e-3 (f16) and 6.9e-2 (bf16, d2 b), the roundings of the
    // inputs and of candle's own ops in the half type.
    for (dt, tol) in [(DType::F16, 2e-2), (DType::BF16, 1.5e-1)] {
        let (half, _) = penalty(Layer::Fused, case, dt, 3, None)?;
        for ((name, a), b) in NAMES.iter().zip(&half).zip(&reference) {
            close(&format!("{dt:?} {name}"), a, b, tol)?;
        }
    }
    Ok(())
}
