//! Every op on small odd shapes with the portable ISA, checked against the f64
//! reference: sized to run under Miri, which checks the `unsafe` of the kernels (their
//! unchecked loads and stores, proved once before each loop, are generic over the
//! ISA, and the portable ISA reads and writes through the same pointers):
//!
//! ```text
//! cargo +nightly miri test --test miri
//! ```
//!
//! (Miri sees no AVX2 or AVX-512: their intrinsics are not all modelled, and CPU
//! detection reports neither.) Without Miri it is one more quick check against the
//! reference.

use fusedbn::driver::{check, reference, Case, Fill};
use fusedbn::ops::Op;
use fusedbn::{DType, DataFormat, Isa};

/// Shapes `[N, H, W, C]` that reach the tails and periods of 8-lane vectors: C a
/// multiple of the lanes and not (12: a channels-last period of three vectors), rows of
/// H·W = 15 (one vector and a tail), a single element per channel.
const SHAPES: [[usize; 4]; 3] = [[2, 3, 5, 12], [1, 5, 3, 8], [1, 1, 1, 3]];

#[test]
fn every_op_matches_the_reference_on_small_shapes() {
    // Under Miri a case takes seconds to minutes: f32 and bf16 on the first shape there,
    // every dtype and shape without it.
    let (dtypes, shapes): (&[DType], &[[usize; 4]]) = if cfg!(miri) {
        (&[DType::F32, DType::BF16], &SHAPES[..1])
    } else {
        (&[DType::F32, DType::BF16, DType::F16, DType::F64], &SHAPES)
    };
    let mut ran = 0;
    for op in Op::ALL {
        for format in [DataFormat::Nhwc, DataFormat::Nchw] {
            for dtype in dtypes.iter().filter(|d| op.dtypes().contains(d)) {
                for &shape in shapes {
                    for training in [true, false] {
                        let mut case = Case::new(op, format, &shape, *dtype)
                            .unwrap_or_else(|e| panic!("{op:?} {format:?} {shape:?}: {e}"))
                            .training(training)
                            .isa(Isa::Scalar)
                            .fill(Fill::Random {
                                mean: 2.0,
                                std: 1.5,
                            });
                        if op == Op::FusedBatchNormEx || op == Op::FusedBatchNormGradEx {
                            case = case.ex(true, true);
                        }
                        let inputs = case.inputs().unwrap_or_else(|e| panic!("{case}: {e}"));
                        let got = case.run(&inputs).unwrap_or_else(|e| panic!("{case}: {e}"));
                        let want = reference(op, &case.named(&inputs), &case.attrs, None)
                            .unwrap_or_else(|e| panic!("{case}: reference: {e}"));
                        let report = check(&want, &got).unwrap_or_else(|e| panic!("{case}: {e}"));
                        assert!(report.worst() <= 1.0, "{case}: {report}");
                        ran += 1;
                    }
                }
            }
        }
    }
    let least = if cfg!(miri) { 60 } else { 200 };
    assert!(ran >= least, "only {ran} cases ran");
    eprintln!("{ran} cases");
}
