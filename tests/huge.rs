//! More than 2^31 elements through the library (issue 8): bf16 tensors of
//! 2^31 + 2^20 elements (4 GiB each), so that any index or count kept in 32 bits wraps,
//! in forward and backward, training and inference, channels-last and channel-major —
//! a few channels (first, second, middle, last) checked against the f64 reference by
//! the library's driver.
//!
//! Ignored by default (peak ~12 GiB and a few minutes on 2 cores); run it with
//! `cargo test --release --test huge -- --ignored --nocapture`.

use std::time::Instant;

use fusedbn::driver::{check, reference, Case, Fill};
use fusedbn::ops::Op;
use fusedbn::{DType, DataFormat};

/// Logical `[N, H, W, C]` with N·H·W·C = 2049 · 2^20 = 2^31 + 2^20.
const LOGICAL: [usize; 4] = [1, 2049, 1024, 1024];

fn run(op: Op, format: DataFormat, training: bool) {
    let start = Instant::now();
    let case = Case::new(op, format, &LOGICAL, DType::BF16)
        .expect("valid case")
        .training(training)
        .fill(Fill::Random {
            mean: 50.0,
            std: 2.0,
        });
    assert!(case.elements() > 1 << 31);
    let inputs = case.inputs().expect("inputs");
    let made = start.elapsed();
    let outputs = case.run(&inputs).expect("the op runs");
    let ran = start.elapsed() - made;
    let c = LOGICAL[3];
    let channels = [0, 1, c / 2, c - 1];
    let want =
        reference(case.op, &case.named(&inputs), &case.attrs, Some(&channels)).expect("reference");
    let report = check(&want, &outputs).unwrap_or_else(|e| panic!("{case}: {e}"));
    eprintln!(
        "{case}: {} elements, inputs {:.1} s, op {:.1} s, worst {:.3} of the tolerance\n{report}",
        case.elements(),
        made.as_secs_f64(),
        ran.as_secs_f64(),
        report.worst()
    );
}

#[test]
#[ignore = "needs ~12 GiB and minutes: cargo test --release --test huge -- --ignored"]
fn more_than_2_pow_31_elements() {
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        for training in [true, false] {
            run(Op::FusedBatchNormV3, format, training);
            run(Op::FusedBatchNormGradV3, format, training);
        }
    }
}
