//! The Keras-style layer (`fusedbn::layer::BatchNorm`, SPEC §6) against golden runs of
//! `tf_keras.layers.BatchNormalization(fused=True)` under `tests/fixtures_keras/`, its
//! safetensors weights, and its fused ReLU against the plain op composition.
//!
//! Run with `--nocapture` to see the largest error per quantity against Keras.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fusedbn::batch_norm::{
    Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, SavedStats,
    Statistics, TrainingStats,
};
use fusedbn::layer::{BatchNorm, Forwarded, LayerGradients, WeightsError};

use fusedbn::{bf16, npy, DataFormat, Problem};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures_keras")
}

/// A `.npy` fixture as `f32` values and its shape.
fn read(dir: &Path, file: &str) -> (Vec<f32>, Vec<usize>) {
    let t = npy::read(dir.join(file)).unwrap_or_else(|e| panic!("{e}"));
    let v = t
        .as_slice::<f32>()
        .unwrap_or_else(|| panic!("{file}: expected f32, found {}", t.dtype()))
        .to_vec();
    (v, t.shape().to_vec())
}

fn read_opt(dir: &Path, file: &serde_json::Value) -> Option<Vec<f32>> {
    file.as_str().map(|f| read(dir, f).0)
}

/// Largest error of each quantity over every case: (|got − want| / max|want|, case).
type Worst = BTreeMap<&'static str, (f64, String)>;

/// Compares with the tolerance of the task: 1e-4 relative to max|want|, plus 1e-6.
fn check(
    worst: &mut Worst,
    failures: &mut Vec<String>,
    what: &'static str,
    at: &str,
    got: &[f32],
    want: &[f32],
) {
    if got.len() != want.len() {
        failures.push(format!(
            "{at} {what}: {} values, want {}",
            got.len(),
            want.len()
        ));
        return;
    }
    let scale = want.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    let tol = 1e-4 * scale + 1e-6;
    let (mut err, mut at_i) = (0f64, 0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (f64::from(g) - f64::from(w)).abs();
        if e > err || e.is_nan() {
            (err, at_i) = (if e.is_nan() { f64::INFINITY } else { e }, i);
        }
    }
    if err > tol {
        failures.push(format!(
            "{at} {what}: |got − want| = {err:.3e} > {tol:.3e} at [{at_i}] (got {}, want {})",
            got[at_i], want[at_i]
        ));
    }
    let rel = if scale > 0.0 { err / scale } else { err };
    let entry = worst.entry(what).or_insert((0.0, String::new()));
    if rel >= entry.0 {
        *entry = (rel, at.to_string());
    }
}

#[test]
fn every_keras_fixture_matches_tf_keras() {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .expect("tests/fixtures_keras")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.join("case.json").is_file())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 10,
        "expected the committed Keras fixtures, found {}",
        dirs.len()
    );

    let (mut worst, mut failures, mut steps) = (Worst::new(), Vec::new(), 0);
    for dir in &dirs {
        let name = dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("?")
            .to_string();
        let text = std::fs::read_to_string(dir.join("case.json")).expect("case.json");
        let j: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        let format: DataFormat = j["data_format"]
            .as_str()
            .expect("data_format")
            .parse()
            .expect("format");
        let axis = j["axis"].as_i64().expect("axis");
        let init = &j["initial"];
        let (mm, _) = read(dir, init["moving_mean"].as_str().expect("moving_mean"));
        let mut bn = BatchNorm::new(format, mm.len())
            .with_momentum(j["momentum"].as_f64().expect("momentum"))
            .with_epsilon(j["epsilon"].as_f64().expect("epsilon") as f32)
            .with_center(j["center"].as_bool().expect("center"))
            .with_scale(j["scale"].as_bool().expect("scale"));
        // Keras' axis (-1 or 1) is the layer's channel axis.
        let rank = format.rank() as i64;
        assert_eq!(((axis + rank) % rank) as usize, bn.axis(), "{name}: axis");
        bn.set_moving_mean(&mm).expect("moving_mean");
        bn.set_moving_variance(&read_opt(dir, &init["moving_variance"]).expect("moving_variance"))
            .expect("moving_variance");
        if let Some(g) = read_opt(dir, &init["gamma"]) {
            bn.set_gamma(&g).expect("gamma");
        }
        if let Some(b) = read_opt(dir, &init["beta"]) {
            bn.set_beta(&b).expect("beta");
        }
        assert_eq!(
            init["gamma"].is_null(),
            !bn.scale(),
            "{name}: gamma iff scale"
        );
        assert_eq!(
            init["beta"].is_null(),
            !bn.center(),
            "{name}: beta iff center"
        );

        for (i, s) in j["steps"].as_array().expect("steps").iter().enumerate() {
            let training = s["training"].as_bool().expect("training");
            let at = format!(
                "{name} step {i} ({})",
                if training { "training" } else { "inference" }
            );
            let (x, shape) = read(dir, s["x"].as_str().expect("x"));
            let y = bn.forward(&x, &shape, training).expect("forward");
            check(
                &mut worst,
                &mut failures,
                "y",
                &at,
                &y,
                &read(dir, s["y"].as_str().expect("y")).0,
            );
            let (dy, _) = read(dir, s["dy"].as_str().expect("dy"));
            let g = bn
                .backward(Forwarded { x: &x, y: &y }, &dy)
                .expect("backward");
            check(
                &mut worst,
                &mut failures,
                "dx",
                &at,
                &g.x,
                &read(dir, s["dx"].as_str().expect("dx")).0,
            );
            match (g.gamma, read_opt(dir, &s["dgamma"])) {
                (Some(got), Some(want)) => {
                    check(&mut worst, &mut failures, "dgamma", &at, &got, &want)
                }
                (None, None) => {}
                (got, want) => failures.push(format!("{at}: dgamma {got:?}, want {want:?}")),
            }
            match (g.beta, read_opt(dir, &s["dbeta"])) {
                (Some(got), Some(want)) => {
                    check(&mut worst, &mut failures, "dbeta", &at, &got, &want)
                }
                (None, None) => {}
                (got, want) => failures.push(format!("{at}: dbeta {got:?}, want {want:?}")),
            }
            let want_mm = read_opt(dir, &s["moving_mean"]).expect("moving_mean");
            let want_mv = read_opt(dir, &s["moving_variance"]).expect("moving_variance");
            check(
                &mut worst,
                &mut failures,
                "moving_mean",
                &at,
                bn.moving_mean(),
                &want_mm,
            );
            check(
                &mut worst,
                &mut failures,
                "moving_variance",
                &at,
                bn.moving_variance(),
                &want_mv,
            );
            steps += 1;
        }
    }
    eprintln!(
        "Keras layer vs tf_keras 2.21: {} cases, {steps} steps",
        dirs.len()
    );
    eprintln!("{:<16} {:>12}  at", "quantity", "max err/max|want|");
    for (what, (err, at)) in &worst {
        eprintln!("{what:<16} {err:>12.3e}  {at}");
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    for what in [
        "y",
        "dx",
        "dgamma",
        "dbeta",
        "moving_mean",
        "moving_variance",
    ] {
        assert!(worst.contains_key(what), "no fixture compared {what}");
    }
}

/// A small deterministic pseudo-random sequence in [-1, 1).
fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn trained_layer() -> BatchNorm {
    let mut bn = BatchNorm::new(DataFormat::Nchw, 3).with_momentum(0.8);
    bn.set_gamma(&[0.5, 1.5, -2.0]).expect("gamma");
    bn.set_beta(&[0.25, 0.0, 1.0]).expect("beta");
    let x = data(2 * 3 * 4 * 5, 1);
    bn.forward(&x, &[2, 3, 4, 5], true).expect("forward");
    bn
}

fn temp_path(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "fusedbn-{tag}-{}-{nanos}.safetensors",
        std::process::id()
    ))
}

#[test]
fn save_and_load_round_trip() {
    let bn = trained_layer();
    let path = temp_path("roundtrip");
    bn.save(&path).expect("save");
    let mut loaded = BatchNorm::new(DataFormat::Nchw, 3);
    let result = loaded.load(&path);
    std::fs::remove_file(&path).expect("remove the temporary file");
    result.expect("load");
    assert_eq!(loaded.gamma(), bn.gamma());
    assert_eq!(loaded.beta(), bn.beta());
    assert_eq!(loaded.moving_mean(), bn.moving_mean());
    assert_eq!(loaded.moving_variance(), bn.moving_variance());
    assert_ne!(
        bn.moving_mean(),
        &[0.0; 3],
        "the forward call moved the statistics"
    );

    // The same through bytes; the loaded layer predicts exactly as the saved one.
    let mut other = BatchNorm::new(DataFormat::Nchw, 3).with_momentum(0.8);
    other
        .load_safetensors(&bn.to_safetensors().expect("to_safetensors"))
        .expect("load");
    let x = data(3 * 3 * 2, 7);
    assert_eq!(
        other.predict(&x, &[3, 3, 1, 2]).expect("predict"),
        bn.predict(&x, &[3, 3, 1, 2]).expect("predict")
    );

    // Tensor names, dtype and shape as Keras has them.
    let bytes = bn.to_safetensors().expect("to_safetensors");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    let mut names = file.names();
    names.sort_unstable();
    assert_eq!(names, ["beta", "gamma", "moving_mean", "moving_variance"]);
    for n in names {
        let t = file.tensor(n).expect("tensor");
        assert_eq!(
            (t.dtype(), t.shape()),
            (safetensors::Dtype::F32, &[3usize][..])
        );
    }

    // A layer without gamma and beta saves only the moving statistics.
    let plain = BatchNorm::new(DataFormat::Nhwc, 2)
        .with_center(false)
        .with_scale(false);
    let bytes = plain.to_safetensors().expect("to_safetensors");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    let mut names = file.names();
    names.sort_unstable();
    assert_eq!(names, ["moving_mean", "moving_variance"]);
}

/// A safetensors file of f32 tensors `(name, shape)`, filled with 1.
fn file_with(tensors: &[(&str, Vec<usize>)]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, s)| 1f32.to_le_bytes().repeat(s.iter().product()))
        .collect();
    let views: Vec<_> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s), b)| {
            (
                *n,
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .expect("view"),
            )
        })
        .collect();
    safetensors::serialize(views, None).expect("serialize")
}

#[test]
fn load_errors_name_what_was_expected_and_found() {
    let mut bn = trained_layer();
    let before = (bn.gamma().to_vec(), bn.moving_mean().to_vec());

    let missing = file_with(&[
        ("gamma", vec![3]),
        ("beta", vec![3]),
        ("moving_mean", vec![3]),
    ]);
    let e = bn.load_safetensors(&missing).unwrap_err();
    assert!(
        matches!(&e, WeightsError::MissingTensor { name, .. } if name == "moving_variance"),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "missing tensor \"moving_variance\": expected tensors gamma, beta, moving_mean, moving_variance"
    );

    let shapes = file_with(&[
        ("gamma", vec![3]),
        ("beta", vec![3]),
        ("moving_mean", vec![1, 3]),
        ("moving_variance", vec![3]),
    ]);
    let e = bn.load_safetensors(&shapes).unwrap_err();
    assert_eq!(
        e.to_string(),
        "tensor \"moving_mean\": expected shape [3], found [1, 3]"
    );

    let extra = file_with(&[
        ("gamma", vec![3]),
        ("beta", vec![3]),
        ("moving_mean", vec![3]),
        ("moving_variance", vec![3]),
        ("kernel", vec![3]),
    ]);
    let e = bn.load_safetensors(&extra).unwrap_err();
    assert!(
        e.to_string().starts_with("unexpected tensor \"kernel\""),
        "{e}"
    );

    let half = {
        let b = vec![0u8; 6];
        let mut views = vec![(
            "gamma",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![3], &b)
                .expect("view"),
        )];
        let ones = 1f32.to_le_bytes().repeat(3);
        for n in ["beta", "moving_mean", "moving_variance"] {
            views.push((
                n,
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![3], &ones)
                    .expect("view"),
            ));
        }
        safetensors::serialize(views, None).expect("serialize")
    };
    let e = bn.load_safetensors(&half).unwrap_err();
    assert_eq!(
        e.to_string(),
        "tensor \"gamma\": expected dtype F32, found F16"
    );

    let e = bn.load_safetensors(b"not a safetensors file").unwrap_err();
    assert!(matches!(e, WeightsError::Format { .. }), "{e:?}");

    // A file error names the file.
    let path = temp_path("badshape");
    std::fs::write(&path, &shapes).expect("write");
    let e = bn.load(&path).unwrap_err();
    std::fs::remove_file(&path).expect("remove the temporary file");
    assert_eq!(
        e.to_string(),
        format!(
            "{}: tensor \"moving_mean\": expected shape [3], found [1, 3]",
            path.display()
        )
    );
    let e = bn.load(temp_path("does-not-exist")).unwrap_err();
    assert!(
        matches!(e, WeightsError::Io { action: "read", .. }),
        "{e:?}"
    );

    // Nothing was loaded by any failed call.
    assert_eq!((bn.gamma().to_vec(), bn.moving_mean().to_vec()), before);
}

#[test]
fn misuse_is_an_error_not_a_panic() {
    let mut bn = BatchNorm::new(DataFormat::Nhwc, 2);
    let (x, y4) = ([1.0f32; 8], [0.0f32; 4]);
    let e = bn
        .backward(Forwarded { x: &x[..4], y: &y4 }, &[1.0f32; 4])
        .unwrap_err();
    assert!(e.to_string().contains("preceding forward"), "{e}");
    let y = bn.forward(&x, &[4, 2], true).expect("forward");
    let fw = Forwarded { x: &x, y: &y };
    let e = bn.backward(fw, &[1.0f32; 6]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "y_backprop: expected 8 elements (shape [4, 1, 1, 2]), found 6 elements"
    );
    let xb = [bf16::ONE; 8];
    let e = bn
        .backward(Forwarded { x: &xb, y: &xb }, &[bf16::ONE; 8])
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "dy: expected f32 elements (the type of the forward input), found bf16 elements"
    );
    // The wrong channel count, rank or length.
    assert!(bn.forward(&[1.0f32; 6], &[2, 3], true).is_err());
    assert!(bn.forward(&[1.0f32; 2], &[2], true).is_err());
    assert!(bn.forward(&[1.0f32; 8], &[2, 1, 1, 1, 2], true).is_err());
    assert!(bn.forward(&[1.0f32; 7], &[4, 2], true).is_err());
    // A failed forward drops the cache and leaves the statistics alone.
    assert!(bn.backward(fw, &[1.0f32; 8]).is_err());
    let stats = bn.moving_mean().to_vec();
    assert!(bn.forward(&[5.0f32; 7], &[4, 2], true).is_err());
    assert_eq!(bn.moving_mean(), &stats[..]);
    // An empty batch leaves the moving statistics unchanged (no NaN).
    let y = bn
        .forward::<f32>(&[], &[0, 2], true)
        .expect("empty forward");
    assert!(y.is_empty());
    assert_eq!(bn.moving_mean(), &stats[..]);
    let g = bn
        .backward::<f32>(Forwarded { x: &[], y: &[] }, &[])
        .expect("empty backward");
    assert_eq!(g.beta, Some(vec![0.0, 0.0]));
    let e = bn.apply_sgd(
        &LayerGradients::<f32> {
            x: vec![],
            gamma: Some(vec![1.0]),
            beta: None,
        },
        0.1,
    );
    assert!(e.is_err());
}

/// The layer's ReLU gradient is the plain gradient on `dy` masked by `y > 0`,
/// i.e. what the op composition BN → ReLU gives, in training and in inference.
#[test]
fn relu_backward_matches_the_op_composition() {
    let (shape, c) = ([2usize, 3, 3, 4], 4);
    let p = Problem::new(DataFormat::Nhwc, &shape)
        .expect("problem")
        .with_epsilon(1e-3);
    let n = p.len();
    let x: Vec<f32> = data(n, 3).iter().map(|v| 2.0 * v + 0.5).collect();
    let dy = data(n, 4);
    let (gamma, beta) = (vec![1.0f32, -0.5, 2.0, 0.75], vec![0.1f32, 0.3, -0.2, 0.0]);
    let mut max_err = 0f32;
    for training in [true, false] {
        let mut bn = BatchNorm::new(DataFormat::Nhwc, c).with_relu(true);
        bn.set_gamma(&gamma).expect("gamma");
        bn.set_beta(&beta).expect("beta");
        bn.set_moving_mean(&[0.5, 0.4, 0.6, 0.5])
            .expect("moving_mean");
        bn.set_moving_variance(&[1.2, 1.4, 1.3, 1.1])
            .expect("moving_variance");
        let (mm, mv) = (bn.moving_mean().to_vec(), bn.moving_variance().to_vec());
        let y = bn.forward(&x, &shape, training).expect("forward");
        let g = bn
            .backward(Forwarded { x: &x, y: &y }, &dy)
            .expect("backward");

        // Composition: plain BN, then ReLU, then the plain gradient on the masked dy.
        let (mut z, mut mean, mut var) = (vec![0.0f32; n], vec![0.0f32; c], vec![0.0f32; c]);
        let affine = Affine {
            scale: &gamma,
            offset: &beta,
        };
        if training {
            let saved = SavedStats {
                mean: &mut mean,
                variance: &mut var,
            };
            let mode = Forward::Training(TrainingStats {
                saved,
                running: None,
            });
            p.forward(&x, affine, mode, Epilogue::plain(), &mut z)
                .expect("forward_training");
        } else {
            let mode = Forward::Inference(Statistics {
                mean: &mm,
                variance: &mv,
            });
            p.forward(&x, affine, mode, Epilogue::plain(), &mut z)
                .expect("forward_inference");
            (mean, var) = (mm, mv);
        }
        let relu: Vec<f32> = z.iter().map(|&v| v.max(0.0)).collect();
        assert_eq!(y, relu, "training={training}: forward is relu(bn(x))");
        let positive = relu.iter().filter(|&&v| v > 0.0).count();
        assert!(
            positive > n / 4 && positive < n * 3 / 4,
            "the mask matters: {positive}/{n}"
        );
        let masked: Vec<f32> = dy
            .iter()
            .zip(&relu)
            .map(|(&d, &r)| if r > 0.0 { d } else { 0.0 })
            .collect();
        let (mut dx, mut dg, mut db) = (vec![0.0f32; n], vec![0.0f32; c], vec![0.0f32; c]);
        let grads = Gradients {
            x: &mut dx,
            scale: &mut dg,
            offset: &mut db,
        };
        let stats = Statistics {
            mean: &mean,
            variance: &var,
        };
        let mode = if training {
            Backward::Training(stats)
        } else {
            Backward::Inference(stats)
        };
        let inputs = GradInputs {
            y_backprop: &masked,
            x: &x,
        };
        p.backward(inputs, &gamma, mode, GradEpilogue::default(), grads)
            .expect("backward");
        for (got, want) in [
            (&g.x, &dx),
            (g.gamma.as_ref().expect("dgamma"), &dg),
            (g.beta.as_ref().expect("dbeta"), &db),
        ] {
            for (a, b) in got.iter().zip(want) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "training={training}: {a} vs {b}"
                );
                max_err = max_err.max((a - b).abs());
            }
        }
    }
    eprintln!("ReLU layer vs BN→ReLU composition: max |difference| {max_err:.3e}");
}

/// Finite differences of `L = Σ dy·layer(x)` on a tiny tensor agree with the layer's
/// training gradient, ReLU included (f64-accumulated loss, central differences).
#[test]
fn relu_training_gradient_matches_finite_differences() {
    let shape = [3usize, 2, 1, 2]; // NCHW: 6 elements per channel
    let x: Vec<f32> = data(12, 11).iter().map(|v| 3.0 * v).collect();
    let dy = data(12, 12);
    let make = || {
        let mut bn = BatchNorm::new(DataFormat::Nchw, 2)
            .with_relu(true)
            .with_epsilon(1e-3);
        bn.set_gamma(&[1.3, -0.7]).expect("gamma");
        bn.set_beta(&[0.2, 0.1]).expect("beta");
        bn
    };
    let loss = |x: &[f32], gamma: &[f32], beta: &[f32]| -> f64 {
        let mut bn = make();
        bn.set_gamma(gamma).expect("gamma");
        bn.set_beta(beta).expect("beta");
        let y = bn.forward(x, &shape, true).expect("forward");
        y.iter()
            .zip(&dy)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum()
    };
    let mut bn = make();
    let y = bn.forward(&x, &shape, true).expect("forward");
    let g = bn
        .backward(Forwarded { x: &x, y: &y }, &dy)
        .expect("backward");
    let (gamma, beta) = (bn.gamma().to_vec(), bn.beta().to_vec());
    let h = 1e-2f32;
    let numeric = |f: &dyn Fn(f32) -> f64| (f(h) - f(-h)) / f64::from(2.0 * h);
    let mut worst = 0f64;
    for i in 0..x.len() {
        let d = numeric(&|e| {
            let mut xp = x.clone();
            xp[i] += e;
            loss(&xp, &gamma, &beta)
        });
        worst = worst.max((d - f64::from(g.x[i])).abs());
    }
    for c in 0..2 {
        let dg = numeric(&|e| {
            let mut gp = gamma.clone();
            gp[c] += e;
            loss(&x, &gp, &beta)
        });
        let db = numeric(&|e| {
            let mut bp = beta.clone();
            bp[c] += e;
            loss(&x, &gamma, &bp)
        });
        worst = worst.max((dg - f64::from(g.gamma.as_ref().expect("dgamma")[c])).abs());
        worst = worst.max((db - f64::from(g.beta.as_ref().expect("dbeta")[c])).abs());
    }
    eprintln!("ReLU layer gradient vs finite differences: max |difference| {worst:.3e}");
    assert!(worst < 2e-3, "finite differences disagree by {worst}");
}

/// Half-precision data goes through the same layer: bf16 results are within one
/// bf16 rounding of the f32 layer's.
#[test]
fn bf16_data_follows_the_f32_layer() {
    let shape = [4usize, 3, 3, 2];
    let x32: Vec<f32> = data(72, 21)
        .iter()
        .map(|&v| bf16::from_f32(v * 4.0).to_f32())
        .collect();
    let x16: Vec<bf16> = x32.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut a = BatchNorm::new(DataFormat::Nhwc, 2).with_relu(true);
    let mut b = a.clone();
    let ya = a.forward(&x32, &shape, true).expect("f32 forward");
    let yb = b.forward(&x16, &shape, true).expect("bf16 forward");
    for (p, q) in ya.iter().zip(&yb) {
        // One rounding to bf16 (8 significant bits) of the f32 result.
        assert!(
            (q.to_f32() - p).abs() <= p.abs() * 2f32.powi(-8),
            "{p} vs {q}"
        );
    }
    assert_eq!(a.moving_mean(), b.moving_mean());
    assert_eq!(a.moving_variance(), b.moving_variance());
}
