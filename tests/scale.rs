//! Every reduction of every op at scale: millions of elements per channel, in every
//! layout and element type, with N = 1 (one huge image: a channel-major row far longer
//! than any tile) and N > 1, random data far from zero (|mean| / std = 1e4 for f32 and
//! f64, 1e2 for the half types) and a constant gradient (where a sum kept too long in
//! f32 drifts furthest) — checked against the f64 reference by the library's driver
//! (`fusedbn::driver`), with its one tolerance policy.
//!
//! Issue 7's bug — the channel-major inference gradient summing a whole 2048×2048 row in
//! f32 lanes, `offset_backprop` off by 4e-3 — fails `inference_gradient` and
//! `ex_gradient_inference` here.

use fusedbn::driver::{check, reference, Case, Fill};
use fusedbn::ops::Op;
use fusedbn::{DType, DataFormat};

const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

/// Logical `[N, spatial…, C]` shapes with about 2.1 million elements per channel:
/// N = 1 and N > 1 for the 4-D formats; the 5-D formats (the same kernels' geometry
/// with another rank) one of each.
fn shapes(format: DataFormat) -> Vec<Vec<usize>> {
    match format {
        DataFormat::Nhwc | DataFormat::Nchw => vec![vec![1, 1024, 2051, 2], vec![3, 700, 1001, 2]],
        DataFormat::Ndhwc => vec![vec![3, 5, 140, 1001, 2]],
        DataFormat::Ncdhw => vec![vec![1, 4, 512, 1027, 2]],
    }
}

/// Random data far from zero for the type.
fn far(dtype: DType) -> Fill {
    let mean = match dtype {
        DType::F32 | DType::F64 => 1e4,
        _ => 1e2,
    };
    Fill::Random { mean, std: 1.0 }
}

/// Runs every case against the `f64` reference with the driver's tolerance, and
/// asserts that at least `min` cases ran and none was out of tolerance (all failures
/// are listed, not just the first). Cases that differ only in their ISA share one set
/// of inputs and one reference (made once, not once an ISA: most of these tests' time).
fn check_all(cases: impl IntoIterator<Item = Case>, min: usize) {
    let mut groups: Vec<(Case, Vec<fusedbn::Isa>)> = Vec::new();
    for case in cases {
        let key = case.clone().isa(fusedbn::Isa::Scalar);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, isas)) => isas.push(case.isa),
            None => groups.push((key, vec![case.isa])),
        }
    }
    let mut failures = Vec::new();
    let mut checked = 0;
    for (key, isas) in groups {
        let inputs = key.inputs().expect("inputs");
        let want = reference(key.op, &key.named(&inputs), &key.attrs, None).expect("reference");
        for isa in isas {
            let case = key.clone().isa(isa);
            let outputs = case.run(&inputs).expect("the op runs");
            checked += 1;
            if let Err(e) = check(&want, &outputs) {
                failures.push(format!("{case} on {}: {e}", case.isa));
            }
        }
    }
    assert!(checked >= min, "only {checked} cases");
    assert!(
        failures.is_empty(),
        "{} of {checked} cases out of tolerance:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Runs `adjust(case)` for every format, shape and type, with each fill in `fills`.
fn sweep(op: Op, fills: &[fn(DType) -> Fill], adjust: impl Fn(Case) -> Case) {
    let mut cases = Vec::new();
    for format in DataFormat::ALL {
        for logical in shapes(format) {
            for dtype in DTYPES {
                for fill in fills {
                    let case = Case::new(op, format, &logical, dtype)
                        .expect("valid case")
                        .fill(fill(dtype));
                    cases.push(adjust(case));
                }
            }
        }
    }
    check_all(cases, 24);
}

fn constant(_: DType) -> Fill {
    Fill::Constant { dy: 0.1 }
}

#[test]
fn forward_statistics() {
    sweep(Op::FusedBatchNormV3, &[far], |c| c.training(true));
}

/// Channels-last statistics run one loop per number of vectors in a pixel (accumulators
/// in registers up to four vectors: C ≤ 32 on AVX2, ≤ 64 on AVX-512; in memory past
/// that; with AVX2, bf16 vectors past four go in even/odd pairs, C = 40 leaving one
/// over). Each width, whole and with a partial last vector, at about a million elements
/// per channel, far from zero, on every ISA this CPU has (`sweep` runs the default one
/// with C = 2 only).
#[test]
fn channels_last_statistics_of_every_pixel_width_on_every_isa() {
    check_all(
        nhwc_training_far(&[8, 19, 32, 40, 64].map(|c| [1, 1023, 1027, c])),
        16,
    );
}

/// Channels-last statistics cut into two to four reduction tasks are evened out into
/// an even number of equal ones (`PixelSplit::reduce`): at the most pixels a channel
/// that path takes, C = 2 (392,704 pixels: three whole-tile tasks, now four of 98,176)
/// and C = 3 (240,000: four of 60,000), far from zero, on every ISA this CPU has.
#[test]
fn channels_last_statistics_of_few_evened_tasks_on_every_isa() {
    check_all(nhwc_training_far(&[[1, 512, 767, 2], [1, 400, 600, 3]]), 4);
}

/// FusedBatchNormV3 in training of each NHWC shape, far from zero, f32 and bf16, on
/// every ISA this CPU has.
fn nhwc_training_far(shapes: &[[usize; 4]]) -> Vec<Case> {
    let mut cases = Vec::new();
    for shape in shapes {
        for isa in fusedbn::Isa::supported() {
            for dtype in [DType::F32, DType::BF16] {
                let case = Case::new(Op::FusedBatchNormV3, DataFormat::Nhwc, shape, dtype)
                    .expect("valid case")
                    .training(true)
                    .fill(far(dtype))
                    .isa(isa);
                cases.push(case);
            }
        }
    }
    cases
}

/// Channels-last statistics with C in the thousands: tiles of 64 pixels, tasks of two
/// to four tiles whose first pivots come from 32 pixels and serve every later tile, so
/// that the later tiles' sums are taken around another tile's pivots (and fall back
/// per channel where those lie more than a std off). Far from zero, f32 and bf16, C =
/// 2048 (whole vectors) and C = 1000 (a partial last one), 8,192 pixels a channel, on
/// every ISA this CPU has.
#[test]
fn channels_last_statistics_of_thousands_of_channels_on_every_isa() {
    let cases = nhwc_training_far(&[1000, 2048].map(|c| [2, 64, 64, c]));
    check_all(cases, 8);
}

/// The channels-last gradient sums walk four pixels at a time (accumulators updated
/// once per four vectors, prefetched for 16-bit tensors past 16 MiB), through one
/// pointer per input, with a partial last vector summed apart; the inference gradient
/// sums pixel by pixel as it streams `dx` (`backward::pairs_out` with AVX2 bf16, whose
/// pairs fall on and off 32 bytes at these C, `period_out` otherwise). The training and
/// inference gradients at about a million elements per channel, far from zero, bf16
/// (84 and 151 MB a tensor: the prefetched walk), C = 40 (five whole AVX2 vectors; two
/// and a tail with AVX-512) and C = 72 (nine; four and a tail), on every ISA this CPU
/// has.
#[test]
fn channels_last_gradient_sums_of_four_pixels_on_every_isa() {
    let mut cases = Vec::new();
    for c in [40, 72] {
        for isa in fusedbn::Isa::supported() {
            for training in [true, false] {
                let case = Case::new(
                    Op::FusedBatchNormGradV3,
                    DataFormat::Nhwc,
                    &[1, 1023, 1027, c],
                    DType::BF16,
                )
                .expect("valid case")
                .training(training)
                .fill(far(DType::BF16))
                .isa(isa);
                cases.push(case);
            }
        }
    }
    check_all(cases, 8);
}

/// With ordinary stores (tensors under the 16 MiB streaming limit), pixels of at most 8
/// whole vectors (4 pairs with AVX2 bf16) are walked a tile at a time as one periodic
/// run of vectors while dx (or the Ex gradient's side gradient) is written
/// (`backward::FEW_PERIODIC_GROUPS`). That walk at the most elements a channel it can
/// see: C = 8 f32 (one AVX2 vector; 512,000 elements a channel), C = 16 f32 (one AVX-512
/// vector, two AVX2 ones) and C = 32 bf16 and f16 (250,000 a channel), each tensor just
/// under 16 MiB; the inference gradient and the Ex training gradient (side input and
/// ReLU), far from zero and with a constant dy, on every ISA this CPU has.
#[test]
fn channels_last_pixels_of_few_vectors_on_every_isa() {
    let mut cases = Vec::new();
    for (shape, dtype) in [
        ([1, 512, 1000, 8], DType::F32),
        ([1, 512, 500, 16], DType::F32),
        ([1, 500, 500, 32], DType::BF16),
        ([1, 500, 500, 32], DType::F16),
    ] {
        assert!(shape.iter().product::<usize>() * dtype.size() < 16 << 20);
        for isa in fusedbn::Isa::supported() {
            for fill in [far(dtype), constant(dtype)] {
                let new = |op| {
                    Case::new(op, DataFormat::Nhwc, &shape, dtype)
                        .expect("valid case")
                        .fill(fill)
                        .isa(isa)
                };
                cases.push(new(Op::FusedBatchNormGradV3).training(false));
                cases.push(new(Op::FusedBatchNormGradEx).training(true).ex(true, true));
            }
        }
    }
    check_all(cases, 16);
}

/// Channels-last outputs that are streamed (past 16 MiB and half the last-level cache,
/// counted as at most 96 MiB: 48 MiB of output streams on every machine) are written by
/// two sequential streams a thread (every dtype on every SIMD ISA, f32 with AVX-512
/// since 2026-12-03): each task's two halves in lockstep, then what is
/// left. Every elementwise output pass on that path (forward, forward with a side input
/// and Relu, the gradient's `x_backprop`) against the reference, with C = 1000 (with
/// AVX-512 and 16-bit types an odd number of vectors a period) and C = 67 (tails, a
/// period of many vectors), in buffers wherever the allocator puts them.
#[test]
fn streamed_channels_last_outputs_on_every_isa() {
    let mut cases = Vec::new();
    // About 25.5 million elements: 51 MB in bf16.
    for shape in [[2, 128, 100, 1000], [1, 1024, 370, 67]] {
        for isa in fusedbn::Isa::supported() {
            for dtype in [DType::F32, DType::BF16] {
                let wide = isa == fusedbn::Isa::Avx512 && dtype == DType::F32;
                if isa == fusedbn::Isa::Scalar || wide {
                    continue; // One stream there: whole-line vectors, or no hints.
                }
                let new = |op| {
                    Case::new(op, DataFormat::Nhwc, &shape, dtype)
                        .expect("valid case")
                        .fill(far(dtype))
                        .isa(isa)
                };
                cases.push(new(Op::FusedBatchNormV3).training(false));
                cases.push(new(Op::FusedBatchNormEx).training(true).ex(true, true));
                cases.push(new(Op::FusedBatchNormGradV3).training(true));
            }
        }
    }
    check_all(cases, 6);
}

#[test]
fn forward_statistics_running_average() {
    sweep(Op::FusedBatchNormV3, &[far], |c| {
        c.training(true).factor(0.25)
    });
}

#[test]
fn ex_forward_statistics() {
    sweep(Op::FusedBatchNormEx, &[far], |c| {
        c.training(true).ex(true, true)
    });
}

#[test]
fn training_gradient() {
    sweep(Op::FusedBatchNormGradV3, &[far, constant], |c| {
        c.training(true)
    });
}

#[test]
fn inference_gradient() {
    sweep(Op::FusedBatchNormGradV3, &[far, constant], |c| {
        c.training(false)
    });
}

#[test]
fn ex_gradient_training() {
    sweep(Op::FusedBatchNormGradEx, &[far, constant], |c| {
        c.training(true).ex(true, true)
    });
}

#[test]
fn ex_gradient_inference() {
    sweep(Op::FusedBatchNormGradEx, &[far, constant], |c| {
        c.training(false).ex(true, true)
    });
}

#[test]
fn second_order_training() {
    sweep(Op::FusedBatchNormGradGradV3, &[far, constant], |c| {
        c.training(true)
    });
}

#[test]
fn second_order_inference() {
    sweep(Op::FusedBatchNormGradGradV3, &[far, constant], |c| {
        c.training(false)
    });
}

/// The reproduction, exactly: one 2048×2048 image, `y_backprop` = 0.1.
#[test]
fn one_huge_image_inference_gradient_sums_exactly() {
    for dtype in DTYPES {
        let case = Case::new(
            Op::FusedBatchNormGradV3,
            DataFormat::Nchw,
            &[1, 2048, 2048, 1],
            dtype,
        )
        .unwrap()
        .training(false)
        .fill(Fill::Constant { dy: 0.1 });
        let inputs = case.inputs().unwrap();
        let out = case.run(&inputs).unwrap();
        let got = out.get("offset_backprop").unwrap().to_f64_vec()[0];
        let dy = inputs[0].1.to_f64_vec()[0]; // 0.1 rounded to the type
        let exact = dy * (2048.0 * 2048.0);
        // f32 lanes sum at most 1024 values before f64 takes over: at most 512 roundings
        // of 2^-24 each, relative (the bug was 4e-3).
        assert!(
            (got - exact).abs() <= 3e-5 * exact,
            "{dtype}: offset_backprop {got}, exact {exact}"
        );
    }
}

/// One channel's NaN, Inf or outlier changes no bit of any other channel's statistics or
/// output, in every layout (the NHWC statistics once redid a whole tile, all channels,
/// on the exact path when one channel needed it; they now redo a tile where a channel's
/// mean moved from its pivot, with new pivots for the channels that moved alone).
/// C = 19, and C = 8 (one channel is more than a sixteenth of the channels).
#[test]
fn one_channels_outlier_leaves_other_channels_bit_identical() {
    use fusedbn::{Tensor, TensorData};
    for (format, channels) in [DataFormat::Nhwc, DataFormat::Nchw]
        .into_iter()
        .flat_map(|f| [(f, 19usize), (f, 8)])
    {
        for dtype in [DType::F32, DType::BF16] {
            let case = Case::new(Op::FusedBatchNormV3, format, &[4, 37, 41, channels], dtype)
                .unwrap()
                .training(true);
            let inputs = case.inputs().unwrap();
            let base = case.run(&inputs).unwrap();
            // The channel of element i; NCHW has 37·41 elements per row.
            let (channels, inner) = (
                channels,
                if format.is_channels_last() {
                    1
                } else {
                    37 * 41
                },
            );
            // An element of channel 0 in the middle of the tensor.
            let at = if format.is_channels_last() {
                channels * 3000
            } else {
                1234
            };
            assert_eq!((at / inner) % channels, 0);
            for bad in [f64::NAN, f64::INFINITY, 1e6] {
                let mut changed = inputs.clone();
                let x = &mut changed[0].1;
                let (shape, data) = x.clone().into_parts();
                let data = match data {
                    TensorData::F32(mut v) => {
                        v[at] = bad as f32;
                        TensorData::F32(v)
                    }
                    TensorData::BF16(mut v) => {
                        v[at] = fusedbn::bf16::from_f64(bad);
                        TensorData::BF16(v)
                    }
                    other => other,
                };
                *x = Tensor::from_data(shape, data).unwrap();
                let out = case.run(&changed).unwrap();
                for name in ["batch_mean", "batch_variance", "y"] {
                    let (a, b) = (
                        base.get(name).unwrap().to_f64_vec(),
                        out.get(name).unwrap().to_f64_vec(),
                    );
                    for i in 0..a.len() {
                        let ch = if name == "y" {
                            (i / inner) % channels
                        } else {
                            i
                        };
                        if ch != 0 {
                            assert_eq!(a[i].to_bits(), b[i].to_bits(), "{format} {dtype} x[{at}] = {bad}: {name}[{i}] (channel {ch}) changed");
                        }
                    }
                }
            }
        }
    }
}

/// NCHW forward and gradient in training, far from zero, f32 and bf16, every supported
/// ISA, for each of `shapes` (given as N, H, W, C).
fn nchw_training(shapes: &[[usize; 4]]) -> Vec<Case> {
    let mut cases = Vec::new();
    for shape in shapes {
        for op in [Op::FusedBatchNormV3, Op::FusedBatchNormGradV3] {
            for isa in fusedbn::Isa::supported() {
                for dtype in [DType::F32, DType::BF16] {
                    let case = Case::new(op, DataFormat::Nchw, shape, dtype)
                        .expect("valid case")
                        .training(true)
                        .fill(far(dtype))
                        .isa(isa);
                    cases.push(case);
                }
            }
        }
    }
    cases
}

/// Channel-major rows shorter than the 1 KiB streaming and 4 KiB residency limits
/// (7×7 and 14×14 images), on both sides of the 16 MiB rule that decides whether a
/// training pass keeps channels resident (so both the resident walk and the two passes
/// in memory order run with short rows), far from zero, forward and gradient in
/// training, f32 and bf16, on every supported ISA.
#[test]
fn short_channel_major_rows_on_both_paths() {
    check_all(
        nchw_training(&[[16, 7, 7, 512], [200, 7, 7, 512], [96, 14, 14, 256]]),
        12,
    );
}

/// Channel-major channels of 1.3 and 1.6 million elements whose fewest row chunks were
/// odd (5 and 7) and are now even (6 chunks of 7 rows, 8 of 16: `ChannelMajorSplit::new`), so
/// that the two threads of a shared resident pass take equal shares: the reductions
/// over the new chunks, resident (f32 forward, bf16 forward and gradient) and in two
/// passes (f32 gradient), far from zero, training, f32 and bf16, every supported ISA.
#[test]
fn channel_major_channels_in_an_even_number_of_chunks() {
    check_all(nchw_training(&[[40, 128, 256, 2], [128, 112, 112, 2]]), 8);
}

/// The pipelined resident passes write a channel's rows inside the next channel's
/// reduction, four vectors a step (the zip of `fused::RowsBehind`, 32-bit elements):
/// short rows of a few steps and a tail (13×17, resident only in a tensor past the
/// 16 MiB rule), whole steps (56×56), steps and a rest (32×35) and an odd length
/// (37×41); f32 channels of 72 KB to 2.3 MB, so every task pipelines; forward, gradient,
/// the Ex forward with a side input and ReLU, the Ex gradient with ReLU (a mask, no
/// side input) and with its side input's gradient too (`dx` from `sg` and x inside the
/// reduction that writes the next channel's `sg`: it fails with that writer's last four
/// vectors of a row skipped, 18 of 120 cases), far from zero, training, f32 and (paced
/// by tiles, the control) bf16, every supported ISA.
#[test]
fn rows_written_in_the_reductions_steps() {
    let mut cases = Vec::new();
    for shape in [
        [2600, 13, 17, 4],
        [8, 56, 56, 6],
        [18, 32, 35, 6],
        [12, 37, 41, 6],
    ] {
        for (op, side, relu) in [
            (Op::FusedBatchNormV3, false, false),
            (Op::FusedBatchNormGradV3, false, false),
            (Op::FusedBatchNormEx, true, true),
            (Op::FusedBatchNormGradEx, false, true),
            (Op::FusedBatchNormGradEx, true, true),
        ] {
            for isa in fusedbn::Isa::supported() {
                for dtype in [DType::F32, DType::BF16] {
                    let case = Case::new(op, DataFormat::Nchw, &shape, dtype)
                        .expect("valid case")
                        .training(true)
                        .fill(far(dtype))
                        .isa(isa);
                    cases.push(if op.is_ex() {
                        case.ex(side, relu)
                    } else {
                        case
                    });
                }
            }
        }
    }
    check_all(cases, 64);
}

/// Channel-major channels of a million elements that stay resident under the 8 MiB
/// `RESIDENT_BYTES` limit: NCHW 1x1000x1000x2, 1,000,000 elements a channel, so x alone
/// (forward: 4 MB in f32) and dy with x (gradient: 8 MB in f32, 4 MB in bf16) fit it,
/// and each channel is reduced and then transformed in one task. (The `sweep` shapes,
/// 2.1 million elements a channel, keep only the half types' forward resident.) The Ex
/// gradient with its side input's gradient keeps dy, x, y and that gradient of a bf16
/// channel resident (8 MB; f32 takes two passes). Far from zero and constant, forward
/// and gradient in training, every supported ISA.
#[test]
fn resident_channels_of_a_million_elements() {
    let mut cases = Vec::new();
    for op in [
        Op::FusedBatchNormV3,
        Op::FusedBatchNormGradV3,
        Op::FusedBatchNormGradEx,
    ] {
        for isa in fusedbn::Isa::supported() {
            for dtype in [DType::F32, DType::BF16] {
                for fill in [far(dtype), constant(dtype)] {
                    let case = Case::new(op, DataFormat::Nchw, &[1, 1000, 1000, 2], dtype)
                        .expect("valid case")
                        .training(true)
                        .fill(fill)
                        .isa(isa);
                    cases.push(if op.is_ex() {
                        case.ex(true, true)
                    } else {
                        case
                    });
                }
            }
        }
    }
    check_all(cases, 8);
}

/// The Ex gradient's side pass, resident and pipelined, at the most elements a channel
/// it keeps resident in f32: 518,400 (dy, x, y and the side gradient, 8.3 MB, under the
/// 8 MiB `RESIDENT_BYTES`), where `dx` of a channel is written inside the loop that
/// reduces the next one (the zip) — one row a channel (N = 1, rows of 518,400) and
/// four (rows of 129,600); far from zero and constant, f32 and (by tiles) bf16, every
/// supported ISA.
#[test]
fn side_gradient_resident_at_half_a_million_per_channel() {
    let shapes = [[1, 720, 720, 4], [4, 360, 360, 4]];
    let sized = shapes
        .iter()
        .flat_map(|s| [(DType::F32, *s), (DType::BF16, *s)]);
    check_all(nchw_side_gradients(sized), 8);
}

/// The NCHW Ex gradient in training with its side input's gradient (Relu), for each
/// `(dtype, shape)`: on every supported ISA, far from zero and with a constant
/// gradient.
fn nchw_side_gradients(sized: impl IntoIterator<Item = (DType, [usize; 4])>) -> Vec<Case> {
    let mut cases = Vec::new();
    for (dtype, shape) in sized {
        for isa in fusedbn::Isa::supported() {
            for fill in [far(dtype), constant(dtype)] {
                let case = Case::new(Op::FusedBatchNormGradEx, DataFormat::Nchw, &shape, dtype)
                    .expect("valid case")
                    .training(true)
                    .fill(fill)
                    .isa(isa)
                    .ex(true, true);
                cases.push(case);
            }
        }
    }
    cases
}

/// Short channel-major rows with a tail (7×7: 49 elements, 14×14: 196, neither a
/// multiple of 8 or 16 lanes) at about two million elements a channel: the statistics
/// add each row's tail into their `f32` lanes, and the gradients' and second-order
/// sums flush their `f32` sums by tiles of whole rows — all must stay bounded over
/// 40,000 rows a channel (220,000 of 3×3: 9 elements). These rows (under 1 KiB, of
/// many images, never resident here: under `RESIDENT_MIN_ROW_BYTES`, or channels past
/// the resident limit) take the image-order walks (`Geometry::rows_in_image_order`):
/// the inference gradient, the training gradient's sums (plain, and the Ex gradient's
/// side pass), the second-order sums in training and in inference. Far from zero for
/// the forward, constant dy (where a sum kept too long drifts furthest) and far for
/// the gradients, f32 and bf16, every supported ISA.
///
/// With the image walks keeping their `f32` sums from one tile to the next (tried):
/// 12 of 132 cases fail — the inference gradient and the Ex gradient at every shape,
/// the plain training gradient at 3×3 only (a task of `TASK` elements holds 29,000
/// rows of 9, and 5,000 of 49, whose `f32` sums stay within the tolerance). No
/// second-order case fails with it (in training the constant fill cancels exactly
/// around the shifts, each channel's first element); that walk is held to the walk by
/// channel bit for bit by `second_order`'s kernel tests.
#[test]
fn short_rows_with_tails_at_millions_per_channel() {
    let mut cases = Vec::new();
    for shape in [[40_000, 7, 7, 2], [10_000, 14, 14, 2], [220_000, 3, 3, 2]] {
        for (op, training) in [
            (Op::FusedBatchNormV3, true),
            (Op::FusedBatchNormGradV3, false),
            (Op::FusedBatchNormGradV3, true),
            (Op::FusedBatchNormGradEx, true),
            (Op::FusedBatchNormGradGradV3, true),
            (Op::FusedBatchNormGradGradV3, false),
        ] {
            for isa in fusedbn::Isa::supported() {
                for dtype in [DType::F32, DType::BF16] {
                    let fills = if op == Op::FusedBatchNormV3 {
                        vec![far(dtype)]
                    } else {
                        vec![far(dtype), constant(dtype)]
                    };
                    for fill in fills {
                        let case = Case::new(op, DataFormat::Nchw, &shape, dtype)
                            .expect("valid case")
                            .training(training)
                            .fill(fill)
                            .isa(isa);
                        cases.push(if op.is_ex() {
                            case.ex(true, true)
                        } else {
                            case
                        });
                    }
                }
            }
        }
    }
    check_all(cases, 60);
}

/// The Ex gradient with its side input's gradient on tensors that stream from DRAM
/// (51 MB each: past `kernels::STREAM_BYTES` and half the last-level cache counted)
/// whose channels fit a core's L2 (dy, x, y and the side gradient of a channel: 800 KB).
/// Where the machine reports 96–192 MiB of L3 (`kernels::side_resident_streamed`), and
/// for f32 (which writes `dx` inside the reduction's loop) where it reports at most 96
/// MiB, these channels are kept resident and each read once; elsewhere the pass sweeps
/// the tensors twice. The reference's values either way: bf16 and f32, far from zero and with a
/// constant gradient (100,352 and 50,176 elements a channel, as many as an L2-resident
/// channel of four tensors holds at 2 MiB), every supported ISA.
#[test]
fn ex_gradient_of_streamed_tensors_with_l2_sized_channels() {
    let sized = [
        (DType::BF16, [32, 56, 56, 256]),
        (DType::F32, [16, 56, 56, 256]),
    ];
    check_all(nchw_side_gradients(sized), 8);
}

/// Images at different levels (`Fill::Levels`, image n offset by 3·n, std 1.5 to 1.9
/// within each) at 1,048,576 elements a channel: 64 images of 128x128, C = 8, forward
/// training, both 4-D layouts, f32 and bf16, every ISA, against the f64 reference. The
/// channels-last tasks (32,768 pixels, two images each) take new pivots in their
/// second image's tiles, whose sums before become moments; the channel-major tiles
/// (8192 values, half a row) after each image's first are off the mean before and are
/// summed again around their own. No f32 sum grows with the tensor on either path.
#[test]
fn images_at_different_levels_at_a_million_a_channel() {
    let mut cases = Vec::new();
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        for isa in fusedbn::Isa::supported() {
            for dtype in [DType::F32, DType::BF16] {
                let case = Case::new(Op::FusedBatchNormV3, format, &[64, 128, 128, 8], dtype)
                    .expect("valid case")
                    .training(true)
                    .fill(Fill::Levels { step: 3.0 })
                    .isa(isa);
                cases.push(case);
            }
        }
    }
    check_all(cases, 8);
}

/// Images at different levels (image n offset by 3·n) through the resident
/// channel-major passes, which write each channel's `y` while they reduce the next
/// (`fused::RowsBehind`, paced between tiles): NCHW 16x4x64x64 (256 KB f32 channels,
/// whole channels a task) and 128x2x64x64 (2 MB f32 channels in two row chunks,
/// shared by the threads where the pool has two: `fused::cooperative`), forward
/// training and the Ex op with a side input and a ReLU, f32 and bf16, every ISA, against the f64 reference. A tile of two images
/// is off the mean of the tiles before and is summed again around its own mean with
/// the same pacer; `y` and the statistics are checked.
#[test]
fn images_at_different_levels_through_the_resident_passes() {
    let mut cases = Vec::new();
    for shape in [[16, 64, 64, 4], [128, 64, 64, 2]] {
        for (op, ex) in [(Op::FusedBatchNormV3, false), (Op::FusedBatchNormEx, true)] {
            for isa in fusedbn::Isa::supported() {
                for dtype in [DType::F32, DType::BF16] {
                    let case = Case::new(op, DataFormat::Nchw, &shape, dtype)
                        .expect("valid case")
                        .training(true)
                        .ex(ex, ex)
                        .fill(Fill::Levels { step: 3.0 })
                        .isa(isa);
                    cases.push(case);
                }
            }
        }
    }
    check_all(cases, 8);
}
