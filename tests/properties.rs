//! The optimized passes against the f64 reference over random shapes, formats,
//! dtypes and odd sizes, through the typed layer; plus thread-count independence.

mod common;

use common::{eps, Rng};
use fusedbn::batch_norm::{Activation, Gradients, RunningStats, SavedStats, SecondOrderGradients};
use fusedbn::kernels::simd::Isa;
use fusedbn::{reference, DataFormat, Element, Problem, Real};
use half::{bf16, f16};
use proptest::prelude::*;

/// A random problem: data, statistics and the f64 view of what the kernels see.
struct Data<T: Element> {
    p: Problem,
    x: Vec<T>,
    dy: Vec<T>,
    scale: Vec<T::Stat>,
    offset: Vec<T::Stat>,
    mean: Vec<T::Stat>,
    variance: Vec<T::Stat>,
}

fn logical_to_shape(format: DataFormat, n: usize, spatial: &[usize], c: usize) -> Vec<usize> {
    let mut s = vec![n];
    if format.is_channels_last() {
        s.extend_from_slice(spatial);
        s.push(c);
    } else {
        s.push(c);
        s.extend_from_slice(spatial);
    }
    s
}

fn make<T: Element>(format: DataFormat, shape: &[usize], eps_attr: f32, seed: u64) -> Data<T> {
    let p = Problem::new(format, shape).unwrap().with_epsilon(eps_attr);
    let c = p.channels();
    let mut rng = Rng::new(seed);
    let centre: Vec<f64> = (0..c).map(|_| rng.normal() * 3.0).collect();
    let spread: Vec<f64> = (0..c).map(|_| 0.5 + rng.uniform() * 2.0).collect();
    let axis = format.channel_axis();
    let stride: usize = shape[axis + 1..].iter().product();
    let x = (0..p.len())
        .map(|i| {
            let ch = (i / stride) % c;
            T::narrow(T::Stat::from_f64(centre[ch] + spread[ch] * rng.normal()))
        })
        .collect();
    let dy = (0..p.len())
        .map(|_| T::narrow(T::Stat::from_f64(rng.normal())))
        .collect();
    let u = |v: f64| T::Stat::from_f64(v);
    Data {
        scale: (0..c).map(|_| u(0.5 + rng.uniform())).collect(),
        offset: (0..c).map(|_| u(rng.normal())).collect(),
        mean: (0..c).map(|_| u(rng.normal() * 3.0)).collect(),
        variance: (0..c).map(|_| u(0.5 + rng.uniform() * 4.0)).collect(),
        p,
        x,
        dy,
    }
}

fn f64s<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|e| e.widen().to_f64()).collect()
}

/// `got` (rounded to T) against the unrounded reference: an f32 computation error of
/// `rel·max|ref|` plus one rounding of T.
fn close<T: Element>(what: &str, got: &[T], want: &[f64], rel: f64) -> Result<(), TestCaseError> {
    close_scaled(what, got, want, rel, 0.0)
}

/// As [`close`], with the error scale at least `floor` (for results that are small
/// differences of larger terms).
fn close_scaled<T: Element>(
    what: &str,
    got: &[T],
    want: &[f64],
    rel: f64,
    floor: f64,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(floor, |m, v| m.max(v.abs()));
    let ulp = 2.0 * eps(T::DTYPE);
    for (i, (g, w)) in f64s(got).iter().zip(want).enumerate() {
        let tol = rel * scale + ulp * w.abs();
        prop_assert!(
            (g - w).abs() <= tol,
            "{}[{}]: got {}, want {} (tol {:e})",
            what,
            i,
            g,
            w,
            tol
        );
    }
    Ok(())
}

/// [`check_one`] with the kernels of every ISA this machine supports.
fn check_all<T: Element>(d: &Data<T>, factor: f32) -> Result<(), TestCaseError> {
    for isa in Isa::supported() {
        let d = Data {
            p: d.p.clone().with_isa(isa).unwrap(),
            x: d.x.clone(),
            dy: d.dy.clone(),
            scale: d.scale.clone(),
            offset: d.offset.clone(),
            mean: d.mean.clone(),
            variance: d.variance.clone(),
        };
        check_one(&d, factor).map_err(|e| TestCaseError::fail(format!("isa {isa}: {e}")))?;
    }
    Ok(())
}

fn check_one<T: Element>(d: &Data<T>, factor: f32) -> Result<(), TestCaseError> {
    let (p, c) = (&d.p, d.p.channels());
    let (fmt, shape, e) = (p.format(), p.shape(), f64::from(p.epsilon()));
    let (x, dy) = (f64s(&d.x), f64s(&d.dy));
    let (scale, offset) = (f64s(&d.scale), f64s(&d.offset));
    let (mean, variance) = (f64s(&d.mean), f64s(&d.variance));
    let zero = T::Stat::ZERO;

    // Forward, training.
    let mut y = vec![T::default(); p.len()];
    let (mut mu, mut var) = (vec![zero; c], vec![zero; c]);
    let (mut rm, mut rv) = (d.mean.clone(), d.variance.clone());
    p.forward_training(
        &d.x,
        &d.scale,
        &d.offset,
        &mut y,
        SavedStats {
            mean: &mut mu,
            variance: &mut var,
        },
        Some(RunningStats {
            mean: &mut rm,
            variance: &mut rv,
            factor,
        }),
    )
    .unwrap();
    let r = reference::forward_training(
        fmt,
        shape,
        &x,
        &scale,
        &offset,
        &mean,
        &variance,
        e,
        f64::from(factor),
    );
    close("y", &y, &r.y, 1e-5)?;
    // A mean's rounding error is relative to the data it averages, not to itself.
    let x_max = x.iter().fold(0f64, |m, v| m.max(v.abs()));
    close_scaled("reserve_space_1", &mu, &r.reserve_space_1, 1e-6, x_max)?;
    close("reserve_space_2", &var, &r.reserve_space_2, 1e-5)?;
    close_scaled("batch_mean", &rm, &r.batch_mean, 1e-6, x_max)?;
    close("batch_variance", &rv, &r.batch_variance, 1e-5)?;

    // Forward, inference.
    p.forward_inference(&d.x, &d.scale, &d.offset, &d.mean, &d.variance, &mut y)
        .unwrap();
    let r = reference::forward_inference(fmt, shape, &x, &scale, &offset, &mean, &variance, e);
    close("y (inference)", &y, &r.y, 1e-5)?;

    check_ex(d, &mu, &var)?;
    check_second_order(d, &mu, &var)?;

    // Gradients: training with the saved statistics, inference with the population ones.
    for training in [true, false] {
        let (rs1, rs2) = if training {
            (&mu, &var)
        } else {
            (&d.mean, &d.variance)
        };
        let mut dx = vec![T::default(); p.len()];
        let (mut ds, mut db) = (vec![zero; c], vec![zero; c]);
        let g = Gradients {
            x: &mut dx,
            scale: &mut ds,
            offset: &mut db,
        };
        if training {
            p.backward_training(&d.dy, &d.x, &d.scale, rs1, rs2, g)
                .unwrap();
        } else {
            p.backward_inference(&d.dy, &d.x, &d.scale, rs1, rs2, g)
                .unwrap();
        }
        let r = reference::backward(
            fmt,
            shape,
            &dy,
            &x,
            &scale,
            &f64s(rs1),
            &f64s(rs2),
            e,
            training,
        );
        // dx is a difference of terms of size |dy|·scale·r: errors scale with those.
        let r_max = f64s(rs2)
            .iter()
            .zip(&scale)
            .fold(0f64, |m, (v, s)| m.max(s.abs() / (v + e).sqrt()));
        let floor = dy.iter().fold(0f64, |m, v| m.max(v.abs())) * r_max;
        close_scaled("x_backprop", &dx, &r.x_backprop, 1e-5, floor)?;
        let m = p.elements_per_channel() as f64;
        let tol = 1e-5 * m.sqrt().max(1.0);
        for ch in 0..c {
            let (gs, gb) = (ds[ch].to_f64(), db[ch].to_f64());
            prop_assert!(
                (gb - r.offset_backprop[ch]).abs() <= tol * 4.0,
                "offset_backprop[{}] {} vs {}",
                ch,
                gb,
                r.offset_backprop[ch]
            );
            prop_assert!(
                (gs - r.scale_backprop[ch]).abs() <= tol * 8.0 + 1e-6 * r.scale_backprop[ch].abs(),
                "scale_backprop[{}] {} vs {}",
                ch,
                gs,
                r.scale_backprop[ch]
            );
        }
    }
    Ok(())
}

fn shape_strategy() -> impl Strategy<Value = (DataFormat, Vec<usize>)> {
    let c = prop_oneof![
        Just(1usize),
        Just(2),
        Just(3),
        Just(7),
        Just(8),
        Just(9),
        Just(16),
        Just(17),
        Just(33),
        1usize..80,
        Just(300)
    ];
    let dim = prop_oneof![
        Just(1usize),
        Just(2),
        Just(3),
        Just(5),
        Just(8),
        Just(9),
        Just(16),
        Just(17),
        1usize..24
    ];
    (
        prop::sample::select(DataFormat::ALL.to_vec()),
        c,
        dim.clone(),
        dim.clone(),
        dim.clone(),
        1usize..4,
    )
        .prop_map(|(f, c, a, b, d, n)| {
            let spatial: Vec<usize> = if f.rank() == 5 {
                vec![a, b, d.min(6)]
            } else {
                vec![a, b]
            };
            (f, logical_to_shape(f, n, &spatial, c))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn f32_matches_reference((f, shape) in shape_strategy(), seed: u64, factor in prop_oneof![Just(1.0f32), 0.0f32..1.0]) {
        check_all(&make::<f32>(f, &shape, 1e-3, seed), factor)?;
    }

    #[test]
    fn f16_matches_reference((f, shape) in shape_strategy(), seed: u64) {
        check_all(&make::<f16>(f, &shape, 1e-3, seed), 1.0)?;
    }

    #[test]
    fn bf16_matches_reference((f, shape) in shape_strategy(), seed: u64) {
        check_all(&make::<bf16>(f, &shape, 1e-3, seed), 0.1)?;
    }

    #[test]
    fn f64_matches_reference((f, shape) in shape_strategy(), seed: u64) {
        check_all(&make::<f64>(f, &shape, 1e-5, seed), 1.0)?;
    }
}

/// Shapes large enough for the parallel split, for rows longer than a tile, for many
/// tiles per channel, and for the channels-last tile clamps.
#[test]
fn large_and_odd_geometries_match_reference() {
    let cases: &[(DataFormat, &[usize])] = &[
        (DataFormat::Nchw, &[3, 5, 97, 101]),   // rows of 9797 > TILE
        (DataFormat::Nchw, &[40, 3, 33, 31]),   // many rows per tile, several tasks
        (DataFormat::Nhwc, &[4, 61, 67, 9]),    // channels-last, many tiles, parallel
        (DataFormat::Nhwc, &[2, 17, 13, 2048]), // wide C: 8 pixels per tile
        (DataFormat::Nhwc, &[1, 1, 70001, 1]),  // C = 1: one contiguous run
        (DataFormat::Ncdhw, &[2, 4, 9, 30, 31]),
        (DataFormat::Ndhwc, &[2, 9, 30, 31, 5]),
        (DataFormat::Nchw, &[1, 3, 1, 1]),     // M = 1
        (DataFormat::Nhwc, &[1, 1, 1, 5]),     // M = 1
        (DataFormat::Nchw, &[300, 2, 1, 1]),   // inner = 1 in NCHW: treated as channels-last
        (DataFormat::Nchw, &[4, 3, 300, 200]), // channel slice > L2 budget: two passes
        (DataFormat::Nhwc, &[1, 4, 5, 2049]),  // lcm(C, lanes) too large: pixel by pixel
        (DataFormat::Nhwc, &[2, 9, 7, 1000]),  // period lcm(1000, 16) = 2000
    ];
    for (i, (f, s)) in cases.iter().enumerate() {
        check_all(&make::<f32>(*f, s, 1e-3, i as u64), 0.25)
            .unwrap_or_else(|e| panic!("{f} {s:?}: {e}"));
        check_all(&make::<bf16>(*f, s, 1e-3, i as u64), 1.0)
            .unwrap_or_else(|e| panic!("bf16 {f} {s:?}: {e}"));
    }
}

/// The split into tasks and the merge order depend only on the shape, so results are
/// bit-identical whatever the number of threads.
#[test]
fn results_do_not_depend_on_thread_count() {
    // Channels-last, channel-major resident, channel-major in two passes.
    let shapes = [
        (DataFormat::Nhwc, vec![8, 40, 40, 24]),
        (DataFormat::Nchw, vec![8, 24, 40, 40]),
        (DataFormat::Nchw, vec![64, 8, 64, 64]),
    ];
    for isa in Isa::supported() {
        for (f, s) in shapes.clone() {
            let mut d = make::<f32>(f, &s, 1e-3, 7);
            d.p = d.p.with_isa(isa).unwrap();
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    let c = d.p.channels();
                    let mut y = vec![0f32; d.p.len()];
                    let (mut mu, mut var) = (vec![0f32; c], vec![0f32; c]);
                    d.p.forward_training(
                        &d.x,
                        &d.scale,
                        &d.offset,
                        &mut y,
                        SavedStats {
                            mean: &mut mu,
                            variance: &mut var,
                        },
                        None,
                    )
                    .unwrap();
                    let mut dx = vec![0f32; d.p.len()];
                    let (mut ds, mut db) = (vec![0f32; c], vec![0f32; c]);
                    d.p.backward_training(
                        &d.dy,
                        &d.x,
                        &d.scale,
                        &mu,
                        &var,
                        Gradients {
                            x: &mut dx,
                            scale: &mut ds,
                            offset: &mut db,
                        },
                    )
                    .unwrap();
                    (y, mu, var, dx, ds, db)
                })
            };
            let one = run(1);
            for t in [2, 3, 5] {
                assert!(run(t) == one, "{f} {isa}: {t} threads differ from 1 thread");
            }
        }
    }
}

/// Outputs of 16 MB and more are written with non-temporal stores after an unaligned
/// head; the arithmetic is the same for every element, so the result does not depend
/// on where the buffers sit in memory.
#[test]
fn streamed_outputs_match_reference_and_ignore_alignment() {
    for (f, s) in [
        (DataFormat::Nhwc, [16usize, 300, 300, 3]),
        (DataFormat::Nchw, [16, 3, 300, 300]),
    ] {
        let d = make::<f32>(f, &s, 1e-3, 11);
        check_all(&d, 1.0).unwrap_or_else(|e| panic!("{f}: {e}"));
        for isa in Isa::supported() {
            let p = d.p.clone().with_isa(isa).unwrap();
            let n = p.len();
            let run = |offset: usize| {
                let mut buf = vec![0f32; n + offset];
                let (mut mu, mut var) = (vec![0f32; 3], vec![0f32; 3]);
                p.forward_training(
                    &d.x,
                    &d.scale,
                    &d.offset,
                    &mut buf[offset..],
                    SavedStats {
                        mean: &mut mu,
                        variance: &mut var,
                    },
                    None,
                )
                .unwrap();
                let mut dx = vec![0f32; n + offset];
                let (mut ds, mut db) = (vec![0f32; 3], vec![0f32; 3]);
                p.backward_training(
                    &d.dy,
                    &d.x,
                    &d.scale,
                    &mu,
                    &var,
                    Gradients {
                        x: &mut dx[offset..],
                        scale: &mut ds,
                        offset: &mut db,
                    },
                )
                .unwrap();
                let mut dxi = vec![0f32; n + offset];
                p.backward_inference(
                    &d.dy,
                    &d.x,
                    &d.scale,
                    &d.mean,
                    &d.variance,
                    Gradients {
                        x: &mut dxi[offset..],
                        scale: &mut ds,
                        offset: &mut db,
                    },
                )
                .unwrap();
                (
                    buf.split_off(offset),
                    dx.split_off(offset),
                    dxi.split_off(offset),
                )
            };
            let base = run(0);
            for offset in [1, 3, 8] {
                assert!(
                    run(offset) == base,
                    "{f} {isa}: offset {offset} changes the result"
                );
            }
        }
    }
}

/// The Ex ops: `act(bn(x) + side)` forward, and the ReLU-masked gradient with the side
/// input's gradient, both modes, against the reference composed from the plain ops.
fn check_ex<T: Element>(d: &Data<T>, mu: &[T::Stat], var: &[T::Stat]) -> Result<(), TestCaseError> {
    let (p, c) = (&d.p, d.p.channels());
    let (fmt, shape, e) = (p.format(), p.shape(), f64::from(p.epsilon()));
    let (x, dy) = (f64s(&d.x), f64s(&d.dy));
    let (scale, offset) = (f64s(&d.scale), f64s(&d.offset));
    let side: Vec<T> = d.dy.iter().rev().copied().collect();
    let side64 = f64s(&side);
    let zero = T::Stat::ZERO;
    for training in [true, false] {
        let mut y = vec![T::default(); p.len()];
        let (mut m2, mut v2) = (vec![zero; c], vec![zero; c]);
        if training {
            p.forward_training_ex(
                &d.x,
                &d.scale,
                &d.offset,
                Some(&side),
                Activation::Relu,
                &mut y,
                SavedStats {
                    mean: &mut m2,
                    variance: &mut v2,
                },
                None,
            )
            .unwrap();
        } else {
            p.forward_inference_ex(
                &d.x,
                &d.scale,
                &d.offset,
                &d.mean,
                &d.variance,
                Some(&side),
                Activation::Relu,
                &mut y,
            )
            .unwrap();
        }
        let base = if training {
            reference::forward_training(fmt, shape, &x, &scale, &offset, &[], &[], e, 1.0).y
        } else {
            reference::forward_inference(
                fmt,
                shape,
                &x,
                &scale,
                &offset,
                &f64s(&d.mean),
                &f64s(&d.variance),
                e,
            )
            .y
        };
        let want = reference::epilogue(&base, Some(&side64), true);
        let floor = base.iter().chain(&side64).fold(0f64, |m, v| m.max(v.abs()));
        close_scaled("y (Ex, relu)", &y, &want, 1e-5, floor)?;

        // Gradient through the ReLU, masked by our own y (so both sides agree on ties).
        let (rs1, rs2) = if training {
            (mu, var)
        } else {
            (&d.mean[..], &d.variance[..])
        };
        let mut dx = vec![T::default(); p.len()];
        let mut side_grad = vec![T::default(); p.len()];
        let (mut ds, mut db) = (vec![zero; c], vec![zero; c]);
        let g = Gradients {
            x: &mut dx,
            scale: &mut ds,
            offset: &mut db,
        };
        if training {
            p.backward_training_ex(
                &d.dy,
                &d.x,
                &d.scale,
                rs1,
                rs2,
                Some(&y),
                g,
                Some(&mut side_grad),
            )
            .unwrap();
        } else {
            p.backward_inference_ex(
                &d.dy,
                &d.x,
                &d.scale,
                rs1,
                rs2,
                Some(&y),
                g,
                Some(&mut side_grad),
            )
            .unwrap();
        }
        let masked = reference::relu_mask(&dy, &f64s(&y));
        // The side input's gradient is exactly the masked dy.
        prop_assert!(
            f64s(&side_grad) == masked,
            "side_input_backprop differs from the masked dy"
        );
        let r = reference::backward(
            fmt,
            shape,
            &masked,
            &x,
            &scale,
            &f64s(rs1),
            &f64s(rs2),
            e,
            training,
        );
        let r_max = f64s(rs2)
            .iter()
            .zip(&scale)
            .fold(0f64, |m, (v, s)| m.max(s.abs() / (v + e).sqrt()));
        let floor = dy.iter().fold(0f64, |m, v| m.max(v.abs())) * r_max;
        close_scaled("x_backprop (Ex, relu)", &dx, &r.x_backprop, 1e-5, floor)?;
        let tol = 1e-5 * (p.elements_per_channel() as f64).sqrt().max(1.0);
        for ch in 0..c {
            prop_assert!(
                (db[ch].to_f64() - r.offset_backprop[ch]).abs() <= 4.0 * tol,
                "Ex offset_backprop[{}]",
                ch
            );
            prop_assert!(
                (ds[ch].to_f64() - r.scale_backprop[ch]).abs()
                    <= 8.0 * tol + 1e-6 * r.scale_backprop[ch].abs(),
                "Ex scale_backprop[{}]",
                ch
            );
        }
    }
    Ok(())
}

/// The gradient of the gradient op, both modes, against the reference.
fn check_second_order<T: Element>(
    d: &Data<T>,
    mu: &[T::Stat],
    var: &[T::Stat],
) -> Result<(), TestCaseError> {
    let (p, c) = (&d.p, d.p.channels());
    let (fmt, shape, e) = (p.format(), p.shape(), f64::from(p.epsilon()));
    // Upstream gradients: A has the shape of x, a and b are per channel.
    let ga: Vec<T> = d.dy.iter().rev().copied().collect();
    let (gs, go) = (d.offset.clone(), d.scale.clone());
    let zero = T::Stat::ZERO;
    for training in [true, false] {
        let (rs1, rs2) = if training {
            (mu, var)
        } else {
            (&d.mean[..], &d.variance[..])
        };
        let (mut dg, mut dx, mut dscale) = (
            vec![T::default(); p.len()],
            vec![T::default(); p.len()],
            vec![zero; c],
        );
        p.second_order(
            &d.dy,
            &d.x,
            &d.scale,
            rs1,
            rs2,
            &ga,
            &gs,
            &go,
            training,
            SecondOrderGradients {
                y_backprop: &mut dg,
                x: &mut dx,
                scale: &mut dscale,
            },
        )
        .unwrap();
        let r = reference::second_order(
            fmt,
            shape,
            &f64s(&d.dy),
            &f64s(&d.x),
            &f64s(&d.scale),
            &f64s(rs1),
            &f64s(rs2),
            &f64s(&ga),
            &f64s(&gs),
            &f64s(&go),
            e,
            training,
        );
        // Terms of size |A|·scale·r, |a|·|x̂|, |b| and their products with r: scale by those.
        let var64 = if training {
            reference::forward_training(
                fmt,
                shape,
                &f64s(&d.x),
                &vec![1.0; c],
                &vec![0.0; c],
                &[],
                &[],
                e,
                1.0,
            )
            .reserve_space_2
        } else {
            f64s(rs2)
        };
        let r_max = var64.iter().fold(0f64, |m, v| m.max(1.0 / (v + e).sqrt()));
        let big = |v: &[f64]| v.iter().fold(0f64, |m, x| m.max(x.abs()));
        let (sc, a_max, gsm) = (
            big(&f64s(&d.scale)),
            big(&f64s(&ga)).max(big(&f64s(&d.dy))),
            big(&f64s(&gs)).max(big(&f64s(&go))),
        );
        let floor = (a_max * sc * r_max + gsm * 8.0) * r_max.max(1.0) * 8.0;
        let mode = if training { "training" } else { "inference" };
        close_scaled(
            &format!("grad_y_backprop ({mode})"),
            &dg,
            &r.grad_y_backprop,
            1e-5,
            floor,
        )?;
        close_scaled(
            &format!("grad_x ({mode})"),
            &dx,
            &r.grad_x,
            1e-5,
            floor * r_max.max(1.0),
        )?;
        let m = p.elements_per_channel() as f64;
        close_scaled(
            &format!("grad_scale ({mode})"),
            &dscale,
            &r.grad_scale,
            1e-5,
            floor * m.sqrt(),
        )?;
    }
    Ok(())
}
