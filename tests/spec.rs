//! SPEC.md, section by section: §4 validation (every rule, in order), §5 empty tensors,
//! §7 accuracy, §8 reference values, non-finite propagation.

mod common;

use fusedbn::batch_norm::{
    Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, Mode, SavedStats,
    SecondOrderInputs, Statistics, TrainingStats,
};
use fusedbn::ops::{Attrs, Inputs, Op, Outputs};
use fusedbn::{DataFormat, Error, Problem, Tensor};
use half::{bf16, f16};

fn t(shape: &[usize], v: Vec<f32>) -> Tensor {
    Tensor::new(shape.to_vec(), v).unwrap()
}

fn filled(shape: &[usize], v: f32) -> Tensor {
    t(shape, vec![v; shape.iter().product()])
}

fn vec1(v: &[f32]) -> Tensor {
    Tensor::vector(v.to_vec())
}

fn f32s<'a>(out: &'a Outputs, name: &str) -> &'a [f32] {
    out.get(name).unwrap().as_slice::<f32>().unwrap()
}

fn run(op: Op, inputs: &[(&str, &Tensor)], attrs: Attrs) -> fusedbn::Result<Outputs> {
    let mut i = Inputs::new();
    for (n, t) in inputs {
        i.insert(n, t);
    }
    op.run(&i, &attrs)
}

// ---------------------------------------------------------------- §8 reference values

#[test]
fn spec8_forward_training() {
    let per_channel = [5.0f32, 7.0, 9.0, 11.0, 13.0, 15.0];
    let x = t(
        &[1, 1, 6, 2],
        per_channel.iter().flat_map(|&v| [v, v]).collect(),
    );
    let (scale, offset) = (vec1(&[4.0, 4.0]), vec1(&[2.0, 2.0]));
    let attrs = Attrs::new().epsilon(0.001);
    let out = run(
        Op::FusedBatchNorm,
        &[("x", &x), ("scale", &scale), ("offset", &offset)],
        attrs,
    )
    .unwrap();
    let want = [-3.86, -1.51, 0.83, 3.17, 5.51, 7.86];
    for (i, y) in f32s(&out, "y").iter().enumerate() {
        assert!((y - want[i / 2]).abs() < 0.005, "y[{i}] = {y}");
    }
    assert_eq!(f32s(&out, "batch_mean"), [10.0, 10.0]);
    assert_eq!(f32s(&out, "batch_variance"), [14.0, 14.0]);
    assert_eq!(f32s(&out, "reserve_space_2"), [35.0 / 3.0, 35.0 / 3.0]);

    let (mean, var) = (vec1(&[6.0, 6.0]), vec1(&[16.0, 16.0]));
    let inputs = [
        ("x", &x),
        ("scale", &scale),
        ("offset", &offset),
        ("mean", &mean),
        ("variance", &var),
    ];
    let out = run(
        Op::FusedBatchNormV2,
        &inputs,
        attrs.exponential_avg_factor(0.5),
    )
    .unwrap();
    assert_eq!(f32s(&out, "batch_mean"), [8.0, 8.0]);
    assert_eq!(f32s(&out, "batch_variance"), [15.0, 15.0]);
}

#[test]
fn spec8_gradient_training() {
    let dy = t(&[1, 1, 6, 1], vec![2.0, 9.0, -4.0, 5.0, 8.0, 7.0]);
    let x = t(&[1, 1, 6, 1], vec![1.0, 7.0, 4.0, -3.0, -11.0, 13.0]);
    let scale = vec1(&[4.0]);
    // With the exact batch statistics (mean 11/6, variance 57.4722) SPEC's values hold;
    // with SPEC's rounded 1.833 / 57.472 TensorFlow itself gives -1.64765.
    for (rs1, rs2, dscale) in [(11.0 / 6.0, 57.472_22, -1.6488), (1.833, 57.472, -1.64765)] {
        let (rs1, rs2) = (vec1(&[rs1]), vec1(&[rs2]));
        let inputs = [
            ("y_backprop", &dy),
            ("x", &x),
            ("scale", &scale),
            ("reserve_space_1", &rs1),
            ("reserve_space_2", &rs2),
        ];
        let out = run(Op::FusedBatchNormGrad, &inputs, Attrs::new().epsilon(0.001)).unwrap();
        let want = [-1.34, 2.47, -4.44, 0.17, 1.60, 1.53];
        for (g, w) in f32s(&out, "x_backprop").iter().zip(want) {
            assert!((g - w).abs() < 0.006, "x_backprop {g} vs {w}");
        }
        assert!((f32s(&out, "scale_backprop")[0] - dscale).abs() < 2e-4);
        assert_eq!(f32s(&out, "offset_backprop"), [27.0]);
        assert_eq!(out.get("reserve_space_3").unwrap().shape(), [0]);
        assert_eq!(out.get("reserve_space_4").unwrap().shape(), [0]);
    }
}

// ---------------------------------------------------------------- §7 accuracy

/// |mean|/std = 1e4 and M = 10^6: a single running f32 sum would be off by far more
/// than the std; blocked two-pass sums keep mean and std right to ~1e-5·std.
#[test]
fn spec7_statistics_with_large_mean() {
    let mut rng = common::Rng::new(42);
    let m = 1_000_000usize;
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        let c = 2;
        let x: Vec<f32> = (0..m * c).map(|_| (1e4 + rng.normal()) as f32).collect();
        let shape = if format == DataFormat::Nhwc {
            [1, 1000, 1000, c]
        } else {
            [1, c, 1000, 1000]
        };
        let (mu, var, y) = batch_stats(format, &shape, fusedbn::Isa::default_isa(), &x);
        for ch in 0..c {
            let vals: Vec<f64> = if format == DataFormat::Nhwc {
                x.iter().skip(ch).step_by(c).map(|&v| v as f64).collect()
            } else {
                x[ch * m..(ch + 1) * m].iter().map(|&v| v as f64).collect()
            };
            let mean = vals.iter().sum::<f64>() / m as f64;
            let std = (vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / m as f64).sqrt();
            assert!(
                (mu[ch] as f64 - mean).abs() <= 1e-5 * std + f32::EPSILON as f64 * mean,
                "{format} mean {} vs {mean}",
                mu[ch]
            );
            assert!(
                ((var[ch] as f64).sqrt() - std).abs() <= 1e-5 * std,
                "{format} std {} vs {std}",
                (var[ch] as f64).sqrt()
            );
        }
        // y stays accurate too: normalized values have mean ~0 and std ~1.
        let ym: f64 = y.iter().map(|&v| v as f64).sum::<f64>() / y.len() as f64;
        assert!(ym.abs() < 1e-3, "{format} mean(y) = {ym}");
    }
}

// ---------------------------------------------------------------- §5 empty tensors

#[test]
fn spec5_empty_forward() {
    for (format, shape) in [
        (DataFormat::Nhwc, [0usize, 2, 2, 3]),
        (DataFormat::Nchw, [2, 3, 0, 4]),
    ] {
        let x = filled(&shape, 0.0);
        let three = vec1(&[1.0, 1.0, 1.0]);
        for (training, factor) in [(true, 1.0), (true, 0.5), (false, 1.0)] {
            let attrs = Attrs::new()
                .data_format(format)
                .is_training(training)
                .exponential_avg_factor(factor);
            let inputs = [
                ("x", &x),
                ("scale", &three),
                ("offset", &three),
                ("mean", &three),
                ("variance", &three),
            ];
            let out = run(Op::FusedBatchNormV3, &inputs, attrs).unwrap();
            assert_eq!(out.get("y").unwrap().shape(), shape);
            for name in [
                "batch_mean",
                "batch_variance",
                "reserve_space_1",
                "reserve_space_2",
            ] {
                let v = f32s(&out, name);
                assert!(
                    v.len() == 3 && v.iter().all(|v| v.is_nan()),
                    "{format} {training} {factor} {name}: {v:?}"
                );
            }
            assert_eq!(out.get("reserve_space_3").unwrap().shape(), [0]);
        }
    }
}

#[test]
fn spec5_empty_gradient_is_zero_even_with_nan_statistics() {
    let x = filled(&[0, 2, 2, 3], 0.0);
    let nan = vec1(&[f32::NAN; 3]);
    let scale = vec1(&[1.0; 3]);
    for training in [true, false] {
        let inputs = [
            ("y_backprop", &x),
            ("x", &x),
            ("scale", &scale),
            ("reserve_space_1", &nan),
            ("reserve_space_2", &nan),
        ];
        let out = run(
            Op::FusedBatchNormGradV3,
            &inputs,
            Attrs::new().is_training(training),
        )
        .unwrap();
        assert_eq!(out.get("x_backprop").unwrap().shape(), [0, 2, 2, 3]);
        assert_eq!(f32s(&out, "scale_backprop"), [0.0; 3]);
        assert_eq!(f32s(&out, "offset_backprop"), [0.0; 3]);
    }
}

// ---------------------------------------------------------------- non-finite values

#[test]
fn nan_and_inf_propagate_per_channel() {
    // Channel 0 holds a NaN, channel 1 an Inf, channel 2 is ordinary.
    let mut v = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0];
    v[0] = f32::NAN;
    v[4] = f32::INFINITY;
    let x = t(&[1, 3, 1, 3], v);
    let ones = vec1(&[1.0; 3]);
    let out = run(
        Op::FusedBatchNormV3,
        &[("x", &x), ("scale", &ones), ("offset", &ones)],
        Attrs::new().data_format(DataFormat::Nchw),
    )
    .unwrap();
    let (m, var) = (f32s(&out, "batch_mean"), f32s(&out, "batch_variance"));
    assert!(m[0].is_nan() && var[0].is_nan());
    assert!(m[1] == f32::INFINITY && var[1].is_nan());
    assert_eq!(m[2], 8.0);
    assert!(f32s(&out, "y")[6..].iter().all(|y| y.is_finite()));
}

// ---------------------------------------------------------------- §4 validation

/// Asserts an `InvalidArgument` naming `arg`, with the expectation and the finding in
/// the message.
fn assert_arg_error(r: fusedbn::Result<Outputs>, arg: &str, expect_in_msg: &[&str]) {
    match r {
        Err(e @ Error::InvalidArgument { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.starts_with(&format!("{arg}:")),
                "wrong argument in {msg:?}, wanted {arg}"
            );
            for s in expect_in_msg {
                assert!(msg.contains(s), "{msg:?} does not mention {s:?}");
            }
        }
        other => panic!("expected an error about {arg}, got {other:?}"),
    }
}

struct Fwd {
    x: Tensor,
    scale: Tensor,
    offset: Tensor,
    mean: Tensor,
    variance: Tensor,
}

impl Fwd {
    fn new() -> Self {
        Fwd {
            x: filled(&[2, 3, 3, 4], 1.0),
            scale: vec1(&[1.0; 4]),
            offset: vec1(&[0.0; 4]),
            mean: vec1(&[0.0; 4]),
            variance: vec1(&[1.0; 4]),
        }
    }

    fn run(&self, op: Op, attrs: Attrs) -> fusedbn::Result<Outputs> {
        run(
            op,
            &[
                ("x", &self.x),
                ("scale", &self.scale),
                ("offset", &self.offset),
                ("mean", &self.mean),
                ("variance", &self.variance),
            ],
            attrs,
        )
    }
}

#[test]
fn spec4_rule1_rank_of_x() {
    let mut f = Fwd::new();
    f.x = filled(&[2, 3, 4], 1.0);
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new()),
        "x",
        &["4-D or 5-D", "[2, 3, 4]"],
    );
    f.x = filled(&[2, 3, 3, 3, 4], 1.0);
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new()),
        "x",
        &["4-D", "NHWC", "[2, 3, 3, 3, 4]"],
    );
    f.x = filled(&[2, 3, 3, 4], 1.0);
    assert_arg_error(
        f.run(
            Op::FusedBatchNormV3,
            Attrs::new().data_format(DataFormat::Ndhwc),
        ),
        "x",
        &["5-D", "NDHWC"],
    );
}

#[test]
fn spec4_rule2_statistics_are_vectors() {
    for name in ["scale", "offset", "mean", "variance"] {
        let mut f = Fwd::new();
        let bad = filled(&[2, 2], 1.0);
        match name {
            "scale" => f.scale = bad,
            "offset" => f.offset = bad,
            "mean" => f.mean = bad,
            _ => f.variance = bad,
        }
        assert_arg_error(
            f.run(Op::FusedBatchNormV3, Attrs::new().is_training(false)),
            name,
            &["1-D", "[2, 2]"],
        );
    }
    let mut f = Fwd::new();
    f.scale = Tensor::new(vec![], vec![1.0f32]).unwrap();
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new()),
        "scale",
        &["1-D", "[]"],
    );
}

#[test]
fn spec4_rule3_scale_and_offset_have_c_elements() {
    let mut f = Fwd::new();
    f.scale = vec1(&[1.0; 3]);
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new()),
        "scale",
        &["4 elements", "[3]"],
    );
    let mut f = Fwd::new();
    f.offset = vec1(&[1.0; 5]);
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new()),
        "offset",
        &["4 elements", "[5]"],
    );
}

#[test]
fn spec4_rule4_mean_and_variance_in_inference_or_with_factor() {
    let mut f = Fwd::new();
    f.mean = Tensor::empty(fusedbn::DType::F32);
    f.variance = Tensor::empty(fusedbn::DType::F32);
    // Training with factor 1: they may be empty.
    f.run(Op::FusedBatchNormV3, Attrs::new()).unwrap();
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new().is_training(false)),
        "mean",
        &["4 elements", "inference", "[0]"],
    );
    assert_arg_error(
        f.run(
            Op::FusedBatchNormV3,
            Attrs::new().exponential_avg_factor(0.9),
        ),
        "mean",
        &["exponential_avg_factor"],
    );
    let mut f = Fwd::new();
    f.variance = vec1(&[1.0; 2]);
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new().is_training(false)),
        "variance",
        &["4 elements", "[2]"],
    );
    // Omitted entirely: a missing-input error.
    let f = Fwd::new();
    let r = run(
        Op::FusedBatchNormV3,
        &[("x", &f.x), ("scale", &f.scale), ("offset", &f.offset)],
        Attrs::new().is_training(false),
    );
    assert!(
        matches!(r, Err(Error::MissingInput { ref name, .. }) if name == "mean"),
        "{r:?}"
    );
}

struct Grad {
    dy: Tensor,
    x: Tensor,
    scale: Tensor,
    rs1: Tensor,
    rs2: Tensor,
    rs3: Tensor,
}

impl Grad {
    fn new() -> Self {
        Grad {
            dy: filled(&[2, 3, 3, 4], 1.0),
            x: filled(&[2, 3, 3, 4], 2.0),
            scale: vec1(&[1.0; 4]),
            rs1: vec1(&[0.0; 4]),
            rs2: vec1(&[1.0; 4]),
            rs3: Tensor::new(vec![], vec![0.0f32]).unwrap(),
        }
    }

    fn run(&self, op: Op, attrs: Attrs) -> fusedbn::Result<Outputs> {
        let mut i = vec![
            ("y_backprop", &self.dy),
            ("x", &self.x),
            ("scale", &self.scale),
            ("reserve_space_1", &self.rs1),
            ("reserve_space_2", &self.rs2),
        ];
        if op == Op::FusedBatchNormGradV3 {
            i.push(("reserve_space_3", &self.rs3));
        }
        run(op, &i, attrs)
    }
}

#[test]
fn spec4_rule5_gradient_shapes() {
    // TF's rank-0 reserve_space_3 is accepted.
    Grad::new()
        .run(Op::FusedBatchNormGradV3, Attrs::new())
        .unwrap();
    let mut g = Grad::new();
    g.dy = filled(&[2, 3, 3, 5], 1.0);
    assert_arg_error(
        g.run(Op::FusedBatchNormGradV3, Attrs::new()),
        "y_backprop",
        &["shape of x", "[2, 3, 3, 5]"],
    );
    let mut g = Grad::new();
    g.dy = filled(&[2, 3, 4], 1.0);
    assert_arg_error(
        g.run(Op::FusedBatchNormGradV3, Attrs::new()),
        "y_backprop",
        &["4-D"],
    );
    let mut g = Grad::new();
    g.rs1 = vec1(&[0.0; 3]);
    assert_arg_error(
        g.run(Op::FusedBatchNormGradV2, Attrs::new()),
        "reserve_space_1",
        &["4 elements", "[3]"],
    );
    let mut g = Grad::new();
    g.rs2 = vec1(&[]);
    assert_arg_error(
        g.run(Op::FusedBatchNormGrad, Attrs::new().is_training(false)),
        "reserve_space_2",
        &["4 elements", "[0]"],
    );
    let mut g = Grad::new();
    g.rs3 = filled(&[1, 1], 0.0);
    assert_arg_error(
        g.run(Op::FusedBatchNormGradV3, Attrs::new()),
        "reserve_space_3",
        &["1-D", "[1, 1]"],
    );
    let mut g = Grad::new();
    g.scale = vec1(&[1.0; 2]);
    assert_arg_error(
        g.run(Op::FusedBatchNormGradV3, Attrs::new()),
        "scale",
        &["4 elements", "[2]"],
    );
}

#[test]
fn spec4_rule6_data_format_and_op_version() {
    assert!(matches!(
        "NWHC".parse::<DataFormat>(),
        Err(Error::UnknownDataFormat { .. })
    ));
    let mut a = Attrs::new();
    let e = a.set("data_format", "nhwc").unwrap_err();
    assert!(
        e.to_string().contains("NHWC, NCHW, NDHWC, NCDHW") && e.to_string().contains("nhwc"),
        "{e}"
    );
    let mut f = Fwd::new();
    f.x = filled(&[1, 2, 3, 3, 4], 1.0);
    for op in [Op::FusedBatchNorm, Op::FusedBatchNormV2] {
        assert_arg_error(
            f.run(op, Attrs::new().data_format(DataFormat::Ndhwc)),
            "data_format",
            &["V3", "NDHWC"],
        );
    }
    f.run(
        Op::FusedBatchNormV3,
        Attrs::new().data_format(DataFormat::Ndhwc),
    )
    .unwrap();
    assert!(Grad::new()
        .run(
            Op::FusedBatchNormGradV2,
            Attrs::new().data_format(DataFormat::Ncdhw)
        )
        .is_err());
}

#[test]
fn spec4_rule7_element_types() {
    let mut f = Fwd::new();
    f.x = Tensor::new(vec![2, 3, 3, 4], vec![f16::ONE; 72]).unwrap();
    assert_arg_error(
        f.run(Op::FusedBatchNorm, Attrs::new()),
        "x",
        &["f32", "V2 or V3", "f16"],
    );
    f.run(Op::FusedBatchNormV2, Attrs::new()).unwrap();
    f.scale = Tensor::vector(vec![f16::ONE; 4]);
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new()),
        "scale",
        &["f32", "f16"],
    );
    let mut f = Fwd::new();
    f.mean = Tensor::vector(vec![0.0f64; 4]);
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new().is_training(false)),
        "mean",
        &["f32", "f64"],
    );

    let mut g = Grad::new();
    g.dy = Tensor::new(vec![2, 3, 3, 4], vec![bf16::ONE; 72]).unwrap();
    assert_arg_error(
        g.run(Op::FusedBatchNormGradV3, Attrs::new()),
        "x",
        &["bf16", "f32"],
    );
    g.x = Tensor::new(vec![2, 3, 3, 4], vec![bf16::ONE; 72]).unwrap();
    g.run(Op::FusedBatchNormGradV3, Attrs::new()).unwrap();
    assert_arg_error(
        g.run(Op::FusedBatchNormGrad, Attrs::new()),
        "y_backprop",
        &["f32", "bf16"],
    );
    g.rs3 = Tensor::vector(vec![bf16::ONE]);
    assert_arg_error(
        g.run(Op::FusedBatchNormGradV3, Attrs::new()),
        "reserve_space_3",
        &["f32", "bf16"],
    );
}

#[test]
fn spec4_rules_are_checked_in_order() {
    // Wrong rank of scale (rule 2) and wrong dtype of x (rule 7): rule 2 is reported.
    let mut f = Fwd::new();
    f.x = Tensor::new(vec![2, 3, 3, 4], vec![f16::ONE; 72]).unwrap();
    f.scale = filled(&[2, 2], 1.0);
    assert_arg_error(f.run(Op::FusedBatchNorm, Attrs::new()), "scale", &["1-D"]);
    // Wrong length of offset (rule 3) and of mean in inference (rule 4): rule 3 first.
    let mut f = Fwd::new();
    f.offset = vec1(&[0.0; 2]);
    f.mean = vec1(&[0.0; 2]);
    assert_arg_error(
        f.run(Op::FusedBatchNormV3, Attrs::new().is_training(false)),
        "offset",
        &[],
    );
}

#[test]
fn unknown_and_missing_inputs_and_ops() {
    let f = Fwd::new();
    let r = run(
        Op::FusedBatchNormV3,
        &[
            ("x", &f.x),
            ("scale", &f.scale),
            ("offset", &f.offset),
            ("y_backprop", &f.x),
        ],
        Attrs::new(),
    );
    assert!(
        matches!(&r, Err(Error::UnknownInput { name, .. }) if name == "y_backprop"),
        "{r:?}"
    );
    let r = run(
        Op::FusedBatchNormV3,
        &[("x", &f.x), ("offset", &f.offset)],
        Attrs::new(),
    );
    assert!(
        matches!(&r, Err(Error::MissingInput { name, .. }) if name == "scale"),
        "{r:?}"
    );
    let e = "FusedBatchNormV4".parse::<Op>().unwrap_err();
    assert!(e.to_string().contains("FusedBatchNormGradV3"), "{e}");
    let e = Attrs::new().set("momentum", "0.9").unwrap_err();
    assert!(e.to_string().contains("momentum"), "{e}");
    assert!(Tensor::new(vec![2, 3], vec![0f32; 5]).is_err());
    assert!(matches!(
        Problem::new(DataFormat::Nhwc, &[usize::MAX, 2, 2, 2]),
        Err(Error::TooLarge { .. })
    ));
}

/// The typed layer checks every buffer before it writes anything.
#[test]
fn typed_layer_writes_nothing_on_error() {
    let p = Problem::new(DataFormat::Nchw, &[2, 3, 2, 2]).unwrap();
    let x = vec![1.5f32; 24];
    let mut y = vec![7.0f32; 24];
    let (mut mu, mut var) = (vec![7.0f32; 3], vec![7.0f32; 2]); // variance buffer too short
    let e = p
        .forward(
            &x,
            Affine {
                scale: &[1.0; 3],
                offset: &[0.0; 3],
            },
            Forward::Training(TrainingStats {
                saved: SavedStats {
                    mean: &mut mu,
                    variance: &mut var,
                },
                running: None,
            }),
            Epilogue::plain(),
            &mut y,
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("saved variance (reserve_space_2, output): expected 3 elements"),
        "{e}"
    );
    assert!(y.iter().chain(&mu).chain(&var).all(|&v| v == 7.0));

    let mut dx = vec![7.0f32; 23];
    let (mut ds, mut db) = (vec![7.0f32; 3], vec![7.0f32; 3]);
    let e = p
        .backward(
            GradInputs {
                y_backprop: &x,
                x: &x,
            },
            &[1.0; 3],
            Backward::Training(Statistics {
                mean: &[0.0; 3],
                variance: &[1.0; 3],
            }),
            GradEpilogue::default(),
            Gradients {
                x: &mut dx,
                scale: &mut ds,
                offset: &mut db,
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("x_backprop (output)"), "{e}");
    assert!(dx.iter().chain(&ds).chain(&db).all(|&v| v == 7.0));
}

// ---------------------------------------------------------------- no input panics

mod no_panic {
    use super::*;
    use fusedbn::DType;
    use proptest::prelude::*;

    fn tensor() -> impl Strategy<Value = Tensor> {
        let dtype = prop::sample::select(vec![DType::F16, DType::BF16, DType::F32, DType::F64]);
        (prop::collection::vec(0usize..4, 0..6), dtype, any::<f32>()).prop_map(|(shape, d, v)| {
            let n: usize = shape.iter().product();
            match d {
                DType::F16 => Tensor::new(shape, vec![f16::from_f32(v); n]),
                DType::BF16 => Tensor::new(shape, vec![bf16::from_f32(v); n]),
                DType::F32 => Tensor::new(shape, vec![v; n]),
                DType::F64 => Tensor::new(shape, vec![v as f64; n]),
            }
            .unwrap()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

        /// Arbitrary tensors under arbitrary input names: an error or a complete result,
        /// never a panic.
        #[test]
        fn arbitrary_inputs_never_panic(
            op in prop::sample::select(Op::ALL.to_vec()),
            format in prop::sample::select(DataFormat::ALL.to_vec()),
            training: bool,
            factor in prop_oneof![Just(1.0f32), any::<f32>()],
            eps in any::<f32>(),
            tensors in prop::collection::vec((0usize..10, tensor()), 0..8),
        ) {
            let names = ["x", "scale", "offset", "mean", "variance", "y_backprop", "reserve_space_1", "reserve_space_2", "reserve_space_3", "bogus"];
            let mut inputs = Inputs::new();
            for (i, t) in &tensors {
                inputs.insert(names[*i], t);
            }
            let attrs = Attrs::new().data_format(format).is_training(training).exponential_avg_factor(factor).epsilon(eps);
            if let Ok(out) = op.run(&inputs, &attrs) {
                prop_assert_eq!(out.names().collect::<Vec<_>>(), op.output_names().to_vec());
            }
        }
    }
}

/// The reference's batch mean and variance of `x` (scale 1, offset 0, ε = 1e-3).
fn reference_batch_stats(format: DataFormat, shape: &[usize], x: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let c = Problem::new(format, shape).unwrap().channels();
    let xs: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let (ones, zeros) = (vec![1.0; c], vec![0.0; c]);
    let rp = Problem::new(format, shape).unwrap().with_epsilon(1e-3);
    let r = fusedbn::reference::forward(
        &rp,
        &xs,
        Affine {
            scale: &ones,
            offset: &zeros,
        },
        fusedbn::reference::ForwardMode::Training {
            running: None,
            factor: 1.0,
        },
    );
    (r.reserve_space_1, r.reserve_space_2)
}

/// The batch mean and variance of `x` that the forward op saves on `isa` (scale 1,
/// offset 0), and its `y`; any element type with `f32` statistics.
fn batch_stats<T: fusedbn::Element<Stat = f32>>(
    format: DataFormat,
    shape: &[usize],
    isa: fusedbn::Isa,
    x: &[T],
) -> (Vec<f32>, Vec<f32>, Vec<T>) {
    let p = Problem::new(format, shape).unwrap().with_isa(isa).unwrap();
    let c = p.channels();
    let mut y = x.to_vec();
    let (mut mu, mut var) = (vec![0f32; c], vec![0f32; c]);
    let (scale, offset) = (vec![1f32; c], vec![0f32; c]);
    p.forward(
        x,
        Affine {
            scale: &scale,
            offset: &offset,
        },
        Forward::Training(TrainingStats {
            saved: SavedStats {
                mean: &mut mu,
                variance: &mut var,
            },
            running: None,
        }),
        Epilogue::plain(),
        &mut y,
    )
    .unwrap();
    (mu, var, y)
}

/// Statistics around a running shift must fall back to exact two-pass tiles when the
/// data drifts: here every batch item is offset by 1000·n (std 1), so consecutive
/// tiles disagree by thousands of standard deviations.
#[test]
fn spec7_statistics_with_drifting_data() {
    use fusedbn::Isa;
    let mut rng = common::Rng::new(9);
    let (n, hw, c) = (8usize, 128 * 128, 3usize);
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        let shape = if format == DataFormat::Nhwc {
            [n, 128, 128, c]
        } else {
            [n, c, 128, 128]
        };
        let x: Vec<f32> = (0..n * hw * c)
            .map(|i| {
                let b = i / (hw * c);
                (1000.0 * b as f64 + rng.normal()) as f32
            })
            .collect();
        let (rm, rv) = reference_batch_stats(format, &shape, &x);
        for isa in Isa::supported() {
            let (mu, var, _) = batch_stats(format, &shape, isa, &x);
            for ch in 0..c {
                let std = rv[ch].sqrt();
                let (m, v) = (rm[ch], rv[ch]);
                assert!(
                    (mu[ch] as f64 - m).abs() <= 1e-5 * std + 1e-7 * m.abs(),
                    "{format} {isa} mean {} vs {m}",
                    mu[ch]
                );
                assert!(
                    (var[ch] as f64 - v).abs() <= 1e-5 * v,
                    "{format} {isa} var {} vs {v}",
                    var[ch]
                );
            }
        }
    }
}

/// Images that differ in level (here image `n` is offset by 2·n, std 1 within each).
/// Channels-last with many channels, a task's later tiles then lie several stds from
/// the pivots its first pixels gave, and take new ones from their own means (the sums
/// of the tiles before becoming moments); channel-major with short rows, a channel's
/// tile spans the batch, off the shift its first row gives, and is summed again around
/// the mean the first sums give. Every channel
/// as exact as the f64 reference; one channel with a NaN in the last image (NHWC: a
/// later tile, after the pivots moved) NaN, the others unaffected. C = 2048 (NHWC:
/// tiles of 64 pixels, tasks of two, images of 49) and C = 40 (tiles of 819, tasks of
/// four), both layouts, f32 and bf16, every ISA.
#[test]
fn spec7_statistics_of_images_at_different_levels() {
    use fusedbn::{bf16, Isa};
    let mut rng = common::Rng::new(21);
    for ([n, h, w, c], nan_at) in [([16usize, 7, 7, 2048], 5usize), ([8, 32, 32, 40], 7)] {
        let hw = h * w;
        let per_image = hw * c;
        let values: Vec<f32> = (0..n * per_image)
            .map(|i| (2.0 * (i / per_image) as f64 + rng.normal()) as f32)
            .collect();
        for format in [DataFormat::Nhwc, DataFormat::Nchw] {
            let shape = if format == DataFormat::Nhwc {
                [n, h, w, c]
            } else {
                [n, c, h, w]
            };
            // The same values in either layout (the level is the image's alone).
            let mut x = values.clone();
            // bf16 of the same values (its moments checked against those of its values).
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let xbf: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            // One NaN in channel `nan_at` of the last image's middle pixel.
            let (last, mid) = (n - 1, hw / 2);
            let at = match format {
                DataFormat::Nhwc => (last * hw + mid) * c + nan_at,
                _ => (last * c + nan_at) * hw + mid,
            };
            x[at] = f32::NAN;
            for (name, xs) in [("f32", &x), ("bf16", &xbf)] {
                let (rm, rv) = reference_batch_stats(format, &shape, xs);
                for isa in Isa::supported() {
                    let (mu, var) = if name == "f32" {
                        let (mu, var, _) = batch_stats(format, &shape, isa, xs);
                        (mu, var)
                    } else {
                        let (mu, var, _) = batch_stats(format, &shape, isa, &xb);
                        (mu, var)
                    };
                    for ch in 0..c {
                        let what = format!("{format} {shape:?} {name} {isa} channel {ch}");
                        if name == "f32" && ch == nan_at {
                            assert!(mu[ch].is_nan() && var[ch].is_nan(), "{what}: {}", mu[ch]);
                            continue;
                        }
                        let (m, v) = (rm[ch], rv[ch]);
                        assert!(
                            (mu[ch] as f64 - m).abs() <= 1e-5 * v.sqrt() + 1e-7 * m.abs(),
                            "{what}: mean {} vs {m}",
                            mu[ch]
                        );
                        assert!(
                            (var[ch] as f64 - v).abs() <= 1e-5 * v,
                            "{what}: variance {} vs {v}",
                            var[ch]
                        );
                    }
                }
            }
        }
    }
}

/// A channels-last task takes its first pivots from its first 32 pixels (16 where the
/// task is one tile). Where those pixels are unlike the rest of the first tile (here,
/// in some channels, 0 against 10⁴ ± 1 after them; in one channel a NaN among them),
/// the results must not depend on that choice: every channel but the NaN one as exact
/// as the f64 reference, the NaN one NaN.
#[test]
fn spec7_statistics_first_pixels_unlike_the_rest() {
    use fusedbn::Isa;
    let mut rng = common::Rng::new(11);
    // C = 40: five vectors of 8 lanes, or two of 16 and a partial one. A tile is 819
    // pixels at C = 40: 3000 pixels are one task of four tiles, 600 one of one tile.
    let c = 40usize;
    for ((pixels, head), nan) in [(3000usize, 32usize), (600, 16)]
        .into_iter()
        .flat_map(|ph| [(ph, false), (ph, true)])
    {
        let x: Vec<f32> = (0..pixels * c)
            .map(|i| {
                let (p, ch) = (i / c, i % c);
                if nan && ch == 7 && p == 3 {
                    f32::NAN
                } else if ch % 3 == 0 && p < head {
                    rng.normal() as f32
                } else {
                    (1e4 + rng.normal()) as f32
                }
            })
            .collect();
        let shape = [1, 1, pixels, c];
        let (rm, rv) = reference_batch_stats(DataFormat::Nhwc, &shape, &x);
        for isa in Isa::supported() {
            let (mu, var, _) = batch_stats(DataFormat::Nhwc, &shape, isa, &x);
            for ch in 0..c {
                if nan && ch == 7 {
                    assert!(mu[ch].is_nan() && var[ch].is_nan(), "{isa} NaN channel");
                    continue;
                }
                let (m, v) = (rm[ch], rv[ch]);
                assert!(
                    (mu[ch] as f64 - m).abs() <= 1e-5 * v.sqrt() + 1e-7 * m.abs(),
                    "{isa} {pixels} pixels nan={nan} channel {ch}: mean {} vs {m}",
                    mu[ch]
                );
                assert!(
                    (var[ch] as f64 - v).abs() <= 1e-5 * v,
                    "{isa} {pixels} pixels nan={nan} channel {ch}: var {} vs {v}",
                    var[ch]
                );
            }
        }
    }
}

// ---------------------------------------------------------------- Ex ops

#[test]
fn ex_validation() {
    use fusedbn::batch_norm::Activation;
    let f = Fwd::new();
    let side = filled(&[2, 3, 3, 4], 0.5);
    let relu = Attrs::new().activation_mode(Activation::Relu);
    let ex = |side: &Tensor, attrs: Attrs| {
        run(
            Op::FusedBatchNormEx,
            &[
                ("x", &f.x),
                ("scale", &f.scale),
                ("offset", &f.offset),
                ("mean", &f.mean),
                ("variance", &f.variance),
                ("side_input", side),
            ],
            attrs,
        )
    };
    ex(&side, relu).unwrap();
    // Rule 8: in training a side input needs the ReLU; in inference it does not.
    assert_arg_error(
        ex(&side, Attrs::new()),
        "activation_mode",
        &["Relu", "side_input", "Identity"],
    );
    ex(&side, Attrs::new().is_training(false)).unwrap();
    assert_arg_error(
        ex(&filled(&[2, 3, 3, 5], 0.5), relu),
        "side_input",
        &["shape of x", "[2, 3, 3, 5]"],
    );
    let half_side = Tensor::new(vec![2, 3, 3, 4], vec![f16::ONE; 72]).unwrap();
    assert_arg_error(ex(&half_side, relu), "side_input", &["f32", "f16"]);
    // Only the Ex ops know side_input and activation_mode.
    let r = run(
        Op::FusedBatchNormV3,
        &[
            ("x", &f.x),
            ("scale", &f.scale),
            ("offset", &f.offset),
            ("side_input", &side),
        ],
        Attrs::new(),
    );
    assert!(
        matches!(&r, Err(Error::UnknownInput { name, .. }) if name == "side_input"),
        "{r:?}"
    );
    let e = Attrs::new().set("activation_mode", "Tanh").unwrap_err();
    assert!(
        e.to_string().contains("Identity or Relu") && e.to_string().contains("Tanh"),
        "{e}"
    );

    // The Ex gradient needs the forward y (for the mask) and offset.
    let g = Grad::new();
    let y = filled(&[2, 3, 3, 4], 1.0);
    let base = [
        ("y_backprop", &g.dy),
        ("x", &g.x),
        ("scale", &g.scale),
        ("reserve_space_1", &g.rs1),
        ("reserve_space_2", &g.rs2),
        ("offset", &g.scale),
    ];
    let r = run(Op::FusedBatchNormGradEx, &base, relu);
    assert!(
        matches!(&r, Err(Error::MissingInput { name, .. }) if name == "y"),
        "{r:?}"
    );
    let mut with_y = base.to_vec();
    with_y.push(("y", &y));
    let out = run(Op::FusedBatchNormGradEx, &with_y, relu).unwrap();
    // y > 0 everywhere: the side input's gradient is dy itself.
    assert_eq!(out.get("side_input_backprop").unwrap(), &g.dy);
    assert_eq!(out.get("reserve_space_5").unwrap().shape(), [0]);
    let neg = filled(&[2, 3, 3, 4], -1.0);
    with_y.pop();
    with_y.push(("y", &neg));
    let out = run(Op::FusedBatchNormGradEx, &with_y, relu).unwrap();
    assert!(f32s(&out, "side_input_backprop").iter().all(|&v| v == 0.0));
    assert!(f32s(&out, "x_backprop").iter().all(|&v| v == 0.0));
    let bad_y = filled(&[2, 3, 3, 1], 1.0);
    with_y.pop();
    with_y.push(("y", &bad_y));
    assert_arg_error(
        run(Op::FusedBatchNormGradEx, &with_y, relu),
        "y",
        &["shape of x"],
    );
}

// ---------------------------------------------------------------- second order

/// The second-order formulas (SPEC §3) against central finite differences in f64 of
/// the first-order gradient: `L = <A, x_backprop> + <a, scale_backprop> +
/// <b, offset_backprop>`, differentiated with respect to `y_backprop`, `x` and
/// `scale` (in training the mean and variance are functions of x).
#[test]
fn second_order_formulas_match_finite_differences() {
    use fusedbn::reference;
    let mut rng = common::Rng::new(5);
    for (format, shape) in [
        (DataFormat::Nhwc, vec![2usize, 3, 2, 3]),
        (DataFormat::Nchw, vec![2, 2, 3, 2]),
        (DataFormat::Ncdhw, vec![1, 2, 2, 2, 3]),
    ] {
        let c = shape[format.channel_axis()];
        let n: usize = shape.iter().product();
        let mut v = |k: usize, s: f64, o: f64| -> Vec<f64> {
            (0..k).map(|_| o + s * rng.normal()).collect()
        };
        let (g, x, scale) = (v(n, 1.0, 0.0), v(n, 2.0, 1.0), v(c, 0.3, 1.0));
        let (ga, gs, go) = (v(n, 1.0, 0.0), v(c, 1.0, 0.0), v(c, 1.0, 0.0));
        let (pm, pv) = (v(c, 1.0, 0.0), v(c, 0.2, 1.5));
        let p = Problem::new(format, &shape).unwrap().with_epsilon(1e-3);
        let (ones, zeros) = (vec![1.0; c], vec![0.0; c]);
        for training in [true, false] {
            let loss = |g: &[f64], x: &[f64], scale: &[f64]| {
                let (rs1, rs2) = if training {
                    let f = reference::forward(
                        &p,
                        x,
                        Affine {
                            scale: &ones,
                            offset: &zeros,
                        },
                        reference::ForwardMode::Training {
                            running: None,
                            factor: 1.0,
                        },
                    );
                    (f.reserve_space_1, f.reserve_space_2)
                } else {
                    (pm.clone(), pv.clone())
                };
                let stats = Statistics {
                    mean: &rs1,
                    variance: &rs2,
                };
                let mode = if training {
                    Backward::Training(stats)
                } else {
                    Backward::Inference(stats)
                };
                let b = reference::backward(&p, GradInputs { y_backprop: g, x }, scale, mode);
                let dot = |p: &[f64], q: &[f64]| p.iter().zip(q).map(|(a, b)| a * b).sum::<f64>();
                dot(&ga, &b.x_backprop) + dot(&gs, &b.scale_backprop) + dot(&go, &b.offset_backprop)
            };
            let inputs = SecondOrderInputs {
                y_backprop: &g,
                x: &x,
                scale: &scale,
                reserve: Statistics {
                    mean: &pm,
                    variance: &pv,
                },
                grad_x_backprop: &ga,
                grad_scale_backprop: &gs,
                grad_offset_backprop: &go,
            };
            let mode = if training {
                Mode::Training
            } else {
                Mode::Inference
            };
            let r = reference::second_order(&p, inputs, mode);
            let h = 1e-6;
            let fd = |which: usize, i: usize| {
                let (mut a, mut b) = (
                    [g.clone(), x.clone(), scale.clone()],
                    [g.clone(), x.clone(), scale.clone()],
                );
                a[which][i] += h;
                b[which][i] -= h;
                (loss(&a[0], &a[1], &a[2]) - loss(&b[0], &b[1], &b[2])) / (2.0 * h)
            };
            for (which, name, analytic) in [
                (0, "grad_y_backprop", &r.grad_y_backprop),
                (1, "grad_x", &r.grad_x),
                (2, "grad_scale", &r.grad_scale),
            ] {
                let scale_of = analytic.iter().fold(1.0f64, |m, v| m.max(v.abs()));
                for (i, want) in analytic.iter().enumerate() {
                    let got = fd(which, i);
                    assert!((got - want).abs() <= 1e-5 * scale_of, "{format} training={training} {name}[{i}]: formula {want}, finite difference {got}");
                }
            }
        }
    }
}

/// Issue 8: an empty tensor whose nonzero dimensions multiply past `usize` is refused
/// cleanly (the trailing product used to be taken unchecked: a panic with overflow checks,
/// a wrapped, wrong geometry without them).
#[test]
fn empty_tensor_with_overflowing_dimensions_is_refused() {
    let big = 1usize << 33;
    for (format, shape) in [
        (DataFormat::Nchw, vec![0, 3, big, big]),
        (DataFormat::Nhwc, vec![0, big, big, 3]),
        (DataFormat::Nchw, vec![big, 0, big, 1]),
        (DataFormat::Ncdhw, vec![0, 3, big, big, 1]),
        (DataFormat::Ndhwc, vec![1, big, 0, big, 2]),
    ] {
        let r = Problem::new(format, &shape);
        assert!(
            matches!(r, Err(Error::TooLarge { .. })),
            "{format} {shape:?}: {r:?}"
        );
        // Through the op layer too: a clean error, never a panic.
        let x = Tensor::new(shape.clone(), Vec::<f32>::new()).unwrap();
        let c = shape[format.channel_axis()];
        let v = Tensor::new(vec![c], vec![1f32; c]).unwrap();
        let mut inputs = Inputs::new();
        inputs.insert("x", &x);
        inputs.insert("scale", &v);
        inputs.insert("offset", &v);
        inputs.insert("mean", &v);
        inputs.insert("variance", &v);
        let r = Op::FusedBatchNormV3.run(&inputs, &Attrs::new().data_format(format));
        assert!(r.is_err(), "{format} {shape:?}");
    }
    // Still fine when the dimensions fit.
    assert!(Problem::new(DataFormat::Nchw, &[0, 3, 1 << 20, 1 << 20]).is_ok());
}

/// The channels of the two low-payload NaN tests below.
const NAN_CHANNELS: usize = 8;

/// The bf16 problems of the two low-payload NaN tests below: `NAN_CHANNELS` channels of
/// 2×24×24 elements, in NHWC and in NCHW, and NCHW channels of 32×128×128 elements
/// (2^19: two chunks of the channel-major split, so that training takes the pass the
/// pool's threads share, `kernels::fused::cooperative`, where they are free to).
fn nan_problems() -> [(DataFormat, [usize; 4]); 3] {
    let c = NAN_CHANNELS;
    [
        (DataFormat::Nhwc, [2, 24, 24, c]),
        (DataFormat::Nchw, [2, c, 24, 24]),
        (DataFormat::Nchw, [32, c, 128, 128]),
    ]
}

/// Asserts that every element of `dirty` in a channel where `nan(channel)` is NaN and
/// that every other one has the bits of `clean`'s.
fn assert_nan_channels(
    format: DataFormat,
    shape: [usize; 4],
    dirty: &[bf16],
    clean: &[bf16],
    nan: impl Fn(usize) -> bool,
    at: &str,
) {
    let c = NAN_CHANNELS;
    assert_eq!(dirty.len(), clean.len(), "{at}");
    for (i, (d, k)) in dirty.iter().zip(clean).enumerate() {
        let channel = match format {
            DataFormat::Nhwc => i % c,
            _ => i / (shape[2] * shape[3]) % c,
        };
        if nan(channel) {
            assert!(d.is_nan(), "{at} element {i}: {d:?}");
        } else {
            assert_eq!(d.to_bits(), k.to_bits(), "{at} element {i}");
        }
    }
}

/// A NaN whose payload reaches the 16 low bits of an f32 (0x7FFF_FFFF: rounding it to
/// bf16 by adding half an ulp would carry it into -0.0) in `scale` or `offset` makes
/// its channel's bf16 `y` NaN on every ISA, in both layouts, in training and
/// inference; the other channels are unchanged. (The AVX2 narrowing skips its NaN test
/// only where no constant of a pass has such a NaN.)
#[test]
fn spec7_bf16_nan_constants_with_low_payloads_stay_nan() {
    use fusedbn::Isa;
    let low = f32::from_bits(0x7FFF_FFFF);
    let c = NAN_CHANNELS;
    for (format, shape) in nan_problems() {
        let n: usize = shape.iter().product();
        let x: Vec<bf16> = (0..n)
            .map(|i| bf16::from_f32((i % 97) as f32 * 0.25 - 9.0))
            .collect();
        let (mean, variance) = (vec![1f32; c], vec![4f32; c]);
        for isa in Isa::supported() {
            let p = Problem::new(format, &shape).unwrap().with_isa(isa).unwrap();
            for training in [false, true] {
                let run = |scale: &[f32], offset: &[f32]| {
                    let mut y = vec![bf16::ZERO; n];
                    let (mut mu, mut var) = (vec![0f32; c], vec![0f32; c]);
                    let mode = if training {
                        Forward::Training(TrainingStats {
                            saved: SavedStats {
                                mean: &mut mu,
                                variance: &mut var,
                            },
                            running: None,
                        })
                    } else {
                        Forward::Inference(Statistics {
                            mean: &mean,
                            variance: &variance,
                        })
                    };
                    p.forward(
                        &x,
                        Affine { scale, offset },
                        mode,
                        Epilogue::plain(),
                        &mut y,
                    )
                    .unwrap();
                    y
                };
                let (scale, offset) = (vec![1.5f32; c], vec![0.5f32; c]);
                let clean = run(&scale, &offset);
                let (mut dirty_scale, mut dirty_offset) = (scale.clone(), offset.clone());
                dirty_scale[1] = low;
                dirty_offset[2] = -low;
                let dirty = run(&dirty_scale, &dirty_offset);
                let at = format!("{format} {isa} training={training}");
                assert_nan_channels(format, shape, &dirty, &clean, |ch| matches!(ch, 1 | 2), &at);
            }
        }
    }
}

/// The gradients' side of the test above: a NaN of payload 0x7FFF_FFFF in `scale`
/// (every pass) or in the saved `mean` (training, where `dx` depends on it) makes its
/// channel's bf16 `dx` NaN on every ISA, in both layouts; the other channels are
/// unchanged (the resident training pass, the elementwise gradient and both inference
/// gradients narrow without the NaN test only where their constants allow it).
#[test]
fn spec7_bf16_nan_gradients_with_low_payloads_stay_nan() {
    use fusedbn::Isa;
    let low = f32::from_bits(0x7FFF_FFFF);
    let c = NAN_CHANNELS;
    for (format, shape) in nan_problems() {
        let n: usize = shape.iter().product();
        let value = |i: usize, k: usize| bf16::from_f32(((i * k) % 89) as f32 * 0.125 - 5.0);
        let x: Vec<bf16> = (0..n).map(|i| value(i, 1)).collect();
        let dy: Vec<bf16> = (0..n).map(|i| value(i, 7)).collect();
        for isa in Isa::supported() {
            let p = Problem::new(format, &shape).unwrap().with_isa(isa).unwrap();
            for training in [false, true] {
                let run = |scale: &[f32], mean: &[f32]| {
                    let variance = vec![4f32; c];
                    let stats = Statistics {
                        mean,
                        variance: &variance,
                    };
                    let mode = if training {
                        Backward::Training(stats)
                    } else {
                        Backward::Inference(stats)
                    };
                    let mut dx = vec![bf16::ZERO; n];
                    let (mut ds, mut db) = (vec![0f32; c], vec![0f32; c]);
                    p.backward(
                        GradInputs {
                            y_backprop: &dy,
                            x: &x,
                        },
                        scale,
                        mode,
                        GradEpilogue::default(),
                        Gradients {
                            x: &mut dx,
                            scale: &mut ds,
                            offset: &mut db,
                        },
                    )
                    .unwrap();
                    dx
                };
                let (scale, mean) = (vec![1.5f32; c], vec![0.25f32; c]);
                let clean = run(&scale, &mean);
                let (mut dirty_scale, mut dirty_mean) = (scale.clone(), mean.clone());
                dirty_scale[1] = low;
                dirty_mean[2] = -low;
                let dirty = run(&dirty_scale, &dirty_mean);
                let at = format!("{format} {isa} training={training}");
                let nan = |ch| ch == 1 || (training && ch == 2);
                assert_nan_channels(format, shape, &dirty, &clean, nan, &at);
            }
        }
    }
}
