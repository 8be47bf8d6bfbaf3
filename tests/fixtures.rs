//! Every golden TensorFlow fixture through the library's op layer.

mod common;

use fusedbn::{npy, ops::Inputs};

#[test]
fn every_fixture_matches_tensorflow() {
    let mut failures = Vec::new();
    let cases = common::cases();
    for case in &cases {
        let tensors: Vec<(String, fusedbn::Tensor)> = case
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
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} fixtures failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
