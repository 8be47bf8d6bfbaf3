//! The driver's comparison (`fusedbn::driver::check`) is the oracle of the property and
//! large-scale tests and of `fusedbn run --check`: it must pass the op's own outputs and
//! reject outputs that are wrong by more than the tolerance, whatever the element type,
//! in an elementwise output and in a per-channel one, and a NaN where a number is
//! expected.

use fusedbn::driver::{check, reference, Case, Fill};
use fusedbn::ops::{Op, Outputs};
use fusedbn::{DType, DataFormat, Tensor, TensorData};

/// `outputs` with element `i` of output `name` replaced by `f(old)`.
fn altered(op: Op, outputs: &Outputs, name: &str, i: usize, f: impl Fn(f64) -> f64) -> Outputs {
    let tensors = op
        .output_names()
        .iter()
        .map(|&n| {
            let t = outputs.get(n).expect("every output").clone();
            if n != name {
                return t;
            }
            let mut v = t.to_f64_vec();
            v[i] = f(v[i]);
            let data = match t.dtype() {
                DType::F16 => TensorData::F16(v.iter().map(|&e| half::f16::from_f64(e)).collect()),
                DType::BF16 => {
                    TensorData::BF16(v.iter().map(|&e| half::bf16::from_f64(e)).collect())
                }
                DType::F32 => TensorData::F32(v.iter().map(|&e| e as f32).collect()),
                DType::F64 => TensorData::F64(v),
            };
            Tensor::from_data(t.shape().to_vec(), data).expect("same shape")
        })
        .collect();
    Outputs::from_tensors(op, tensors).expect("the op's outputs")
}

#[test]
fn check_passes_the_op_and_rejects_wrong_values() {
    let op = Op::FusedBatchNormV3;
    for format in DataFormat::ALL {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let logical: &[usize] = if format.rank() == 5 {
                &[2, 3, 5, 7, 9]
            } else {
                &[2, 5, 7, 9]
            };
            let case = Case::new(op, format, logical, dtype)
                .expect("valid case")
                .training(true)
                .fill(Fill::Random {
                    mean: 3.0,
                    std: 2.0,
                });
            let inputs = case.inputs().expect("inputs");
            let got = case.run(&inputs).expect("the op runs");
            let want = reference(op, &case.named(&inputs), &case.attrs, None).expect("reference");
            let report = check(&want, &got).unwrap_or_else(|e| panic!("{case}: {e}"));
            assert!(report.worst() <= 1.0, "{case}: {report}");
            let y = report.outputs.iter().find(|a| a.name == "y").expect("y");
            assert_eq!(y.compared, logical.iter().product::<usize>(), "{case}");
            assert!(y.exact > 0, "{case}: no exact value\n{report}");

            // Wrong by 10 % of the value, far beyond 1e-4 of the scale plus two ulps (bf16:
            // 1.6 %).
            for (name, i) in [("y", 17), ("batch_mean", 4), ("batch_variance", 8)] {
                let bad = altered(op, &got, name, i, |v| v * 1.1 + 0.1);
                let e = check(&want, &bad).expect_err(&format!("{case}: {name}[{i}] off"));
                assert!(e.to_string().contains(name), "{case}: {e}");
            }
            let nan = altered(op, &got, "y", 3, |_| f64::NAN);
            check(&want, &nan).expect_err(&format!("{case}: a NaN in y"));
        }
    }
}

/// Outputs of 2^16 values and more are compared in parallel tasks (channels-last: blocks
/// of pixels with every channel; channel-major: a channel and a block of rows): a wrong
/// value is still found and named by its storage index, in both layouts, and an
/// infinity meets an equal infinity but not a finite value.
#[test]
fn check_in_parallel_tasks_finds_the_wrong_value_and_meets_infinities() {
    let op = Op::FusedBatchNormV3;
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        for dtype in [DType::F32, DType::BF16] {
            let case = Case::new(op, format, &[3, 64, 64, 9], dtype)
                .expect("valid case")
                .training(true);
            let inputs = case.inputs().expect("inputs");
            let got = case.run(&inputs).expect("the op runs");
            let want = reference(op, &case.named(&inputs), &case.attrs, None).expect("reference");
            check(&want, &got).unwrap_or_else(|e| panic!("{case}: {e}"));
            for i in [0, 40_000, 3 * 64 * 64 * 9 - 1] {
                let bad = altered(op, &got, "y", i, |v| v * 1.1 + 0.1);
                let e = check(&want, &bad).expect_err(&format!("{case}: y[{i}] off"));
                assert!(
                    e.to_string().contains(&format!("element {i}:")),
                    "{case}: {e}"
                );
            }
            // The reference's index of storage element i (values channel after channel).
            let g = want.geometry;
            let i = 12_345;
            let (o, c, j) = (
                i / (g.channels * g.inner),
                (i / g.inner) % g.channels,
                i % g.inner,
            );
            let at = c * g.outer * g.inner + o * g.inner + j;
            let mut inf = want.clone();
            let y = inf.outputs.iter_mut().find(|e| e.name == "y").expect("y");
            y.values[at] = f64::INFINITY;
            let got_inf = altered(op, &got, "y", i, |_| f64::INFINITY);
            check(&inf, &got_inf).unwrap_or_else(|e| panic!("{case}: inf against inf: {e}"));
            check(&inf, &got).expect_err(&format!("{case}: a finite value against inf"));
        }
    }
}

/// A `Reference`'s fields are public: edited into an impossible state (a channel past
/// C, a geometry whose size overflows, fewer channels than it lists) it makes `check`
/// fail with an error, never panic.
#[test]
fn check_refuses_an_edited_reference() {
    let op = Op::FusedBatchNormV3;
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        let case = Case::new(op, format, &[2, 3, 4, 5], DType::F32)
            .expect("valid case")
            .training(true);
        let inputs = case.inputs().expect("inputs");
        let got = case.run(&inputs).expect("the op runs");
        let want = reference(op, &case.named(&inputs), &case.attrs, None).expect("reference");
        check(&want, &got).expect("the unedited reference passes");

        // With the per-channel outputs alone a channel past C was read as `v[5]` of 5
        // values: an index out of bounds.
        let mut past = want.clone();
        past.outputs.retain(|e| e.name == "batch_mean");
        past.channels[0] = 5;
        let e = check(&past, &got).expect_err("a channel past C");
        assert!(e.to_string().contains("channel 5"), "{e}");

        // Refused by the checks at the entry (the messages say so), not by the length
        // comparison further on, which a wrapped size could have passed.
        let mut huge = want.clone();
        huge.geometry.outer = usize::MAX / 2;
        let e = check(&huge, &got).expect_err("a geometry whose size overflows");
        assert!(e.to_string().contains("fits in usize"), "{e}");

        let mut fewer = want.clone();
        fewer.geometry.channels = 2;
        let e = check(&fewer, &got).expect_err("fewer channels than the reference lists");
        assert!(e.to_string().contains("channels below 2"), "{e}");

        let mut none = want.clone();
        none.geometry.channels = 0;
        let e = check(&none, &got).expect_err("no channels");
        assert!(e.to_string().contains("channels below 0"), "{e}");
    }
}

/// `Fill::Levels` offsets x of batch item n by step·n in every format (N outermost),
/// and the op on it passes the check (the statistics of such data take new pivots
/// tile by tile: `tests/spec.rs::spec7_statistics_of_images_at_different_levels`).
#[test]
fn levels_fill_offsets_each_batch_item() {
    for format in [DataFormat::Nhwc, DataFormat::Nchw, DataFormat::Ndhwc] {
        let logical: &[usize] = if format.rank() == 5 {
            &[4, 2, 3, 5, 7]
        } else {
            &[4, 3, 5, 7]
        };
        let case = Case::new(Op::FusedBatchNormV3, format, logical, DType::F32)
            .expect("valid case")
            .training(true)
            .fill(Fill::Levels { step: 100.0 });
        let inputs = case.inputs().expect("inputs");
        let x = inputs
            .iter()
            .find(|(n, _)| *n == "x")
            .expect("x")
            .1
            .to_f64_vec();
        let per_item = x.len() / 4;
        let means: Vec<f64> = x
            .chunks(per_item)
            .map(|c| c.iter().sum::<f64>() / per_item as f64)
            .collect();
        for n in 1..4 {
            let step = means[n] - means[n - 1];
            assert!(
                (step - 100.0).abs() < 5.0,
                "{case}: item {n} {step} above item {}",
                n - 1
            );
        }
        let got = case.run(&inputs).expect("the op runs");
        let want = reference(
            Op::FusedBatchNormV3,
            &case.named(&inputs),
            &case.attrs,
            None,
        )
        .expect("reference");
        let report = check(&want, &got).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert!(report.worst() <= 1.0, "{case}: {report}");
    }
}
