//! Every golden TensorFlow fixture through the library's op layer.
//!
//! Run with `--nocapture` to see how close to TensorFlow the results are: per element
//! type, the share of elements that are bit-identical and the largest difference.

mod common;

use std::collections::BTreeMap;

use fusedbn::{npy, ops::Inputs, Tensor};

/// Per element type: (elements, bit-identical elements, largest |got−want| / max|want|).
type Closeness = BTreeMap<String, (usize, usize, f64)>;

fn record(stats: &mut Closeness, key: String, got: &Tensor, want: &Tensor) {
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let scale = w
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f64, |m, v| m.max(v.abs()));
    let e = stats.entry(key).or_insert((0, 0, 0.0));
    for (a, b) in g.iter().zip(&w) {
        e.0 += 1;
        if a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) {
            e.1 += 1;
        } else if scale > 0.0 {
            e.2 = e.2.max((a - b).abs() / scale);
        }
    }
}

#[test]
fn every_fixture_matches_tensorflow() {
    let mut failures = Vec::new();
    let mut stats = Closeness::new();
    let cases = common::cases();
    for case in &cases {
        let tensors: Vec<(String, Tensor)> = case
            .inputs
            .iter()
            .map(|(n, p)| (n.clone(), npy::read(p).expect("fixture input reads")))
            .collect();
        let mut inputs = Inputs::new();
        for (n, t) in &tensors {
            inputs.insert(n, t);
        }
        let out = match case.op.run(&inputs, &case.attrs) {
            Ok(o) => o,
            Err(e) => {
                failures.push(format!("{}: error {e}", case.name));
                continue;
            }
        };
        for (name, path) in &case.expected {
            let want = npy::read(path).expect("fixture output reads");
            let got = out.get(name).expect("op produces every expected output");
            if let Err(e) = common::compare(name, got, &want) {
                failures.push(format!("{}: {e}", case.name));
            }
            let kind = if got.rank() == 1 {
                "statistics"
            } else {
                "data"
            };
            record(&mut stats, format!("{} {kind}", got.dtype()), got, &want);
        }
    }
    for (k, (n, same, worst)) in &stats {
        eprintln!(
            "{k:>14}: {n:>6} elements, {:6.2}% bit-identical to TensorFlow, largest difference {worst:.2e} of max|value|",
            100.0 * *same as f64 / *n as f64
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} fixtures failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
