//! Every op on small odd shapes with the portable ISA, checked against the f64
//! reference: sized to run under Miri, which checks the `unsafe` of the kernels (their
//! unchecked loads and stores, proved once before each loop, are generic over the
//! ISA, and the portable ISA reads and writes through the same pointers):
//!
//! ```text
//! MIRIFLAGS="-Zmiri-tree-borrows -Zmiri-permissive-provenance -Zmiri-ignore-leaks \
//!     -Zmiri-disable-isolation" cargo +nightly miri test --test miri
//! ```
//!
//! (Stacked Borrows stops in crossbeam-epoch, rayon's deque, before any kernel runs;
//! rayon's pool threads outlive `main`, which Miri reports unless told to ignore it;
//! the Ex gradient's side pass sizes its residency from the caches the files under
//! `/sys/devices/system/cpu` give, which Miri's isolation refuses to open.)
//!
//! (Miri sees no AVX2 or AVX-512: their intrinsics are not all modelled, and CPU
//! detection reports neither.) Without Miri it is one more quick check against the
//! reference.

use fusedbn::driver::{check, reference, Case, Fill};
use fusedbn::ops::Op;
use fusedbn::{DType, DataFormat, Isa};

/// Shapes `[N, H, W, C]` that reach the pair loops, tails and periods of 8-lane vectors:
/// C of two whole vectors and rows of two and a quarter (16; 18), C not a multiple of
/// the lanes (12: a channels-last period of three vectors) with rows of one and seven
/// eighths (15), C = 8 and 3, a single element per channel, and rows of six vectors
/// and one element (49: the four-a-step loops' tail of two).
const SHAPES: [[usize; 4]; 5] = [
    [1, 3, 6, 16],
    [2, 3, 5, 12],
    [1, 5, 3, 8],
    [1, 1, 1, 3],
    [1, 7, 7, 16],
];

#[test]
fn every_op_matches_the_reference_on_small_shapes() {
    // Under Miri a case takes seconds to minutes: f32 and bf16 on the first two shapes
    // there, every dtype and shape without it.
    let (dtypes, shapes): (&[DType], &[[usize; 4]]) = if cfg!(miri) {
        (&[DType::F32, DType::BF16], &SHAPES[..2])
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
    let least = if cfg!(miri) { 120 } else { 600 };
    assert!(ran >= least, "only {ran} cases ran");
    eprintln!("{ran} cases");
}
