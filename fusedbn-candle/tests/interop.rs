//! Checkpoints and conversions between candle-nn's `BatchNorm` and ours, the fused
//! epilogue, the fallback, and gradients checked by finite differences in f64.

mod common;

use candle_core::{DType, ModuleT, Result, Tensor, Var};
use candle_nn::{BatchNormConfig, VarBuilder, VarMap};
use common::*;
use fusedbn_candle::{batch_norm_eval, batch_norm_train, Epilogue};

fn config() -> BatchNormConfig {
    BatchNormConfig {
        eps: 1e-4,
        remove_mean: true,
        affine: true,
        momentum: 0.2,
    }
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// A checkpoint saved by candle-nn's layer (through a VarMap, as safetensors) loads into
/// ours, and ours saves one that candle-nn loads.
#[test]
fn checkpoints_round_trip_through_safetensors() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("fusedbn-candle-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (a_path, b_path) = (
        dir.join("candle_nn.safetensors"),
        dir.join("ours.safetensors"),
    );
    let x = rand(&[6, 4, 3, 3], -1.0, 4.0, 21)?.to_dtype(DType::F32)?;

    // candle-nn trains a step (moving the running statistics) and saves.
    let vm_a = VarMap::new();
    let theirs = candle_nn::batch_norm(
        4,
        config(),
        VarBuilder::from_varmap(&vm_a, DType::F32, &DEV).pp("bn"),
    )?;
    for (name, v) in vm_a.data().lock().unwrap().iter() {
        if name.ends_with("weight") || name.ends_with("bias") {
            v.set(&rand(&[4], 0.5, 1.5, name.len() as u64)?.to_dtype(DType::F32)?)?;
        }
    }
    theirs.forward_t(&x, true)?;
    vm_a.save(&a_path)?;

    // Ours, built with the same names, loads it and infers the same.
    let mut vm_b = VarMap::new();
    let ours = fusedbn_candle::batch_norm(
        4,
        config(),
        VarBuilder::from_varmap(&vm_b, DType::F32, &DEV).pp("bn"),
    )?;
    vm_b.load(&a_path)?;
    assert_eq!(values(ours.running_var())?, values(theirs.running_var())?);
    close(
        "eval after load",
        &ours.forward_t(&x, false)?,
        &theirs.forward_t(&x, false)?,
        1e-6,
    )?;

    // Ours trains a step and saves; candle-nn loads it.
    ours.forward_t(&(&x * 2.0)?, true)?;
    vm_b.save(&b_path)?;
    let mut vm_c = VarMap::new();
    let back = candle_nn::batch_norm(
        4,
        config(),
        VarBuilder::from_varmap(&vm_c, DType::F32, &DEV).pp("bn"),
    )?;
    vm_c.load(&b_path)?;
    assert_eq!(values(back.running_mean())?, values(ours.running_mean())?);
    assert_eq!(values(back.running_var())?, values(ours.running_var())?);
    close(
        "eval after load back",
        &back.forward_t(&x, false)?,
        &ours.forward_t(&x, false)?,
        1e-6,
    )?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Conversions share the variables: training one layer moves the other's statistics.
#[test]
fn conversions_share_variables() -> Result<()> {
    let x = rand(&[5, 3, 4], 2.0, 6.0, 31)?.to_dtype(DType::F32)?;
    for remove_mean in [true, false] {
        let vm = VarMap::new();
        let cfg = BatchNormConfig {
            remove_mean,
            ..config()
        };
        let theirs = candle_nn::batch_norm(3, cfg, VarBuilder::from_varmap(&vm, DType::F32, &DEV))?;
        let ours = fusedbn_candle::BatchNorm::from(theirs.clone());
        assert_eq!(ours.remove_mean(), remove_mean);
        assert_eq!((ours.eps(), ours.momentum()), (1e-4, 0.2));
        assert_eq!(ours.is_fused_for(&x), remove_mean);
        ours.forward_t(&x, true)?;
        let m = values(theirs.running_mean())?;
        if remove_mean {
            assert!(m.iter().all(|&v| v > 0.5), "{m:?}"); // moved towards the mean (≈ 4)
        } else {
            // candle-nn keeps no running mean without mean removal.
            assert!(m.iter().all(|&v| v == 0.0), "{m:?}");
        }
        let v = values(theirs.running_var())?;
        assert!(v.iter().all(|&v| v != 1.0), "{v:?}");

        let back = candle_nn::BatchNorm::try_from(&ours)?;
        back.forward_t(&x, true)?;
        assert_eq!(values(ours.running_mean())?, values(back.running_mean())?);
        let (w, _) = back.weight_and_bias().unwrap();
        assert!(w.is_variable() || w.track_op());
        // Same computation either way round (the fallback is candle-nn's own code).
        let (a, b) = (ours.forward_t(&x, false)?, back.forward_t(&x, false)?);
        close("eval", &a, &b, 1e-6)?;
    }
    Ok(())
}

/// `remove_mean = false` has no fused kernel: candle-nn's code runs, with its numbers.
#[test]
fn remove_mean_false_falls_back_to_candle_nn() -> Result<()> {
    let x = rand(&[4, 2, 3], -1.0, 3.0, 41)?.to_dtype(DType::F32)?;
    let cfg = BatchNormConfig {
        remove_mean: false,
        ..config()
    };
    let (va, vb) = (VarMap::new(), VarMap::new());
    let theirs = candle_nn::batch_norm(2, cfg, VarBuilder::from_varmap(&va, DType::F32, &DEV))?;
    let ours = fusedbn_candle::batch_norm(2, cfg, VarBuilder::from_varmap(&vb, DType::F32, &DEV))?;
    assert!(!ours.is_fused_for(&x));
    for train in [true, false] {
        close(
            "y",
            &ours.forward_t(&x, train)?,
            &theirs.forward_t(&x, train)?,
            0.0,
        )?;
    }
    assert_eq!(values(ours.running_var())?, values(theirs.running_var())?);
    Ok(())
}

/// `forward_ex` = `relu(bn(x) + side)` of candle-nn's layer, gradients included (the
/// side input's too), in training and inference, contiguous and channels-last.
#[test]
fn forward_ex_matches_the_composed_ops() -> Result<()> {
    for channels_last in [false, true] {
        for train in [true, false] {
            for relu in [true, false] {
                let shape = [3, 4, 5, 2];
                let (ours, theirs) = {
                    let p = [
                        rand(&[4], -0.2, 0.2, 1)?,
                        rand(&[4], 0.5, 2.0, 2)?,
                        rand(&[4], 0.5, 1.5, 3)?,
                        rand(&[4], -0.5, 0.5, 4)?,
                    ];
                    let mk = |i: usize| var(&p[i], DType::F32).map(|v| v.as_tensor().clone());
                    (
                        fusedbn_candle::BatchNorm::new(4, mk(0)?, mk(1)?, mk(2)?, mk(3)?, 1e-5)?,
                        candle_nn::BatchNorm::new(4, mk(0)?, mk(1)?, mk(2)?, mk(3)?, 1e-5)?,
                    )
                };
                let (to_last, _) = perms(4);
                let mk_input = |seed| -> Result<(Var, Tensor)> {
                    let t = rand(&shape, -1.5, 1.5, seed)?;
                    if channels_last {
                        let v = var(&t.permute(to_last.as_slice())?, DType::F32)?;
                        let view = channels_last_view(v.as_tensor())?;
                        Ok((v, view))
                    } else {
                        let v = var(&t, DType::F32)?;
                        let t = v.as_tensor().clone();
                        Ok((v, t))
                    }
                };
                let (xv, x) = mk_input(51)?;
                let (sv, side) = mk_input(52)?;
                let r = rand(&shape, -1.0, 1.0, 53)?.to_dtype(DType::F32)?;
                let a = ours.forward_ex(&x, Some(&side), relu, train)?;
                let b = (theirs.forward_t(&x, train)? + &side)?;
                let b = if relu { b.relu()? } else { b };
                let what = format!("channels_last={channels_last} train={train} relu={relu}");
                close(&format!("{what} y"), &a, &b, 1e-5)?;
                if channels_last {
                    assert!(is_channels_last(&a)?);
                }
                let ga = (&a * &r)?.sum_all()?.backward()?;
                let gb = (&b * &r)?.sum_all()?.backward()?;
                let (w_a, b_a) = ours.weight_and_bias().unwrap();
                let (w_b, b_b) = theirs.weight_and_bias().unwrap();
                for (name, p, q) in [
                    ("dx", xv.as_tensor(), xv.as_tensor()),
                    ("dside", sv.as_tensor(), sv.as_tensor()),
                    ("dweight", w_a, w_b),
                    ("dbias", b_a, b_b),
                ] {
                    let (p, q) = (ga.get(p).unwrap(), gb.get(q).unwrap());
                    close(&format!("{what} {name}"), p, q, 1e-5)?;
                }
                close(
                    &format!("{what} running_mean"),
                    ours.running_mean(),
                    theirs.running_mean(),
                    1e-6,
                )?;
                close(
                    &format!("{what} running_var"),
                    ours.running_var(),
                    theirs.running_var(),
                    1e-6,
                )?;
            }
        }
    }
    Ok(())
}

/// `Σ y·r` of the fused op with a side input and a ReLU. `args` are x, weight, bias and
/// the side input; x and the side input are given as their buffers: `[N, C, *]`, or
/// `[N, *, C]` seen through a permuted view when `last`.
fn loss(args: &[Tensor], stats: &Tensor, r: &Tensor, train: bool, last: bool) -> Result<Tensor> {
    let view = |t: &Tensor| {
        if last {
            channels_last_view(t)
        } else {
            Ok(t.clone())
        }
    };
    let (x, w, b, side) = (view(&args[0])?, &args[1], &args[2], view(&args[3])?);
    let ep = Epilogue::relu(Some(&side));
    let y = if train {
        batch_norm_train(&x, Some(w), Some(b), 1e-3, ep)?.y
    } else {
        let (m, v) = (stats.get(0)?, stats.get(1)?);
        batch_norm_eval(&x, &m, &v, Some(w), Some(b), 1e-3, ep)?
    };
    (y * r)?.sum_all()
}

/// Every gradient of the fused op (x, weight, bias, side input; training and inference;
/// both layouts) against central differences in f64.
#[test]
fn gradients_match_finite_differences_in_f64() -> Result<()> {
    let shape = [3, 2, 2, 3];
    let (to_last, _) = perms(4);
    for train in [true, false] {
        for last in [false, true] {
            let buffer = |t: Tensor| {
                if last {
                    t.permute(to_last.as_slice())?.contiguous()
                } else {
                    Ok(t)
                }
            };
            let args = [
                buffer(rand(&shape, -1.0, 2.0, 61)?)?,
                rand(&[2], 0.5, 1.5, 62)?,
                rand(&[2], -0.2, 0.2, 63)?,
                buffer(rand(&shape, -0.5, 0.5, 64)?)?,
            ];
            let stats = Tensor::stack(&[rand(&[2], 0.0, 1.0, 65)?, rand(&[2], 0.5, 1.5, 66)?], 0)?;
            let r = rand(&shape, -1.0, 1.0, 67)?;
            let vars = args.clone().map(|t| Var::from_tensor(&t).unwrap());
            let tracked: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let grads = loss(&tracked, &stats, &r, train, last)?.backward()?;
            let h = 1e-6;
            for (k, name) in ["x", "weight", "bias", "side_input"]
                .into_iter()
                .enumerate()
            {
                let g = grads.get(&vars[k]).expect("missing gradient");
                let g = g.flatten_all()?.to_vec1::<f64>()?;
                let base = args[k].flatten_all()?.to_vec1::<f64>()?;
                for (e, &want) in g.iter().enumerate() {
                    let at = |d: f64| -> Result<f64> {
                        let mut v = base.clone();
                        v[e] += d;
                        let mut a = args.clone();
                        a[k] = Tensor::from_vec(v, args[k].shape(), &DEV)?;
                        loss(&a, &stats, &r, train, last)?.to_scalar::<f64>()
                    };
                    let fd = (at(h)? - at(-h)?) / (2.0 * h);
                    assert!(
                        (fd - want).abs() <= 1e-6 * (1.0 + fd.abs()),
                        "train={train} channels_last={last} d{name}[{e}]: autograd {want} vs finite difference {fd}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// Errors, not panics, for what candle-nn rejects.
#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let vm = VarMap::new();
    let bn = fusedbn_candle::batch_norm(3, 1e-5, VarBuilder::from_varmap(&vm, DType::F32, &DEV))?;
    let e = bn
        .forward_t(&Tensor::zeros((4, 2, 5), DType::F32, &DEV)?, true)
        .unwrap_err();
    assert!(e.to_string().contains("expected number of features"), "{e}");
    assert!(bn
        .forward_t(&Tensor::zeros(3, DType::F32, &DEV)?, true)
        .is_err());
    let x = Tensor::zeros((2, 3, 4), DType::F32, &DEV)?;
    let side = Tensor::zeros((2, 3, 5), DType::F32, &DEV)?;
    assert!(bn.forward_ex(&x, Some(&side), true, true).is_err());
    assert!(
        fusedbn_candle::batch_norm(3, -1.0, VarBuilder::from_varmap(&vm, DType::F32, &DEV))
            .is_err()
    );
    Ok(())
}
