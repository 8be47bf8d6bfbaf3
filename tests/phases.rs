//! The phases of the typed API (`fusedbn::batch_norm::phases`) against the whole ops:
//! on one shard they give **bit-identical** results to `Problem::forward` /
//! `Problem::backward` in training (plain and Ex, every format and dtype, shapes that
//! take the cache-resident fused paths and the streaming ones); split into uneven
//! shards along N (one of them empty), they give the results of one big batch.

use fusedbn::batch_norm::phases::{combine_moments, combine_sums, GradSums, Moments};
use fusedbn::batch_norm::{
    Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, RunningStats,
    SavedStats, Statistics, TrainingStats,
};
use fusedbn::{bf16, f16, DataFormat, Element, Problem, Real};

/// Deterministic data: a per-channel offset and spread, far enough from zero to matter.
fn data<T: Element>(n: usize, seed: u64, mean: f64) -> Vec<T> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            T::narrow(<T::Stat as Real>::from_f64(
                mean + (i % 7) as f64 * 0.25 + 2.0 * (u - 0.5),
            ))
        })
        .collect()
}

fn stat<T: Element>(c: usize, f: impl Fn(usize) -> f64) -> Vec<T::Stat> {
    (0..c).map(|i| <T::Stat as Real>::from_f64(f(i))).collect()
}

fn bits<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.widen().to_f64().to_bits()).collect()
}

/// Logical `[N, H, W, C]` in `format`'s order.
fn shape(format: DataFormat, n: usize, h: usize, w: usize, c: usize) -> Vec<usize> {
    if format.is_channels_last() {
        vec![n, h, w, c]
    } else {
        vec![n, c, h, w]
    }
}

/// Forward training and the training gradient, whole and as phases on one shard, with
/// and without the Ex epilogue: every output bit for bit.
fn one_shard_is_bit_identical<T: Element>(format: DataFormat, dims: [usize; 4], ex: bool) {
    let [n, h, w, c] = dims;
    let p = Problem::new(format, &shape(format, n, h, w, c))
        .unwrap()
        .with_epsilon(1e-3);
    let len = p.len();
    let x: Vec<T> = data(len, 1, 3.0);
    let side: Vec<T> = data(len, 2, -3.0);
    let dy: Vec<T> = data(len, 3, 0.5);
    let (scale, offset) = (
        stat::<T>(c, |i| 0.5 + 0.1 * i as f64),
        stat::<T>(c, |i| 0.2 - 0.05 * i as f64),
    );
    let affine = Affine {
        scale: &scale,
        offset: &offset,
    };
    let epilogue = if ex {
        Epilogue::relu(Some(&side[..]))
    } else {
        Epilogue::plain()
    };
    let zero = <T::Stat as Real>::ZERO;
    let running0 = stat::<T>(c, |i| 1.0 + i as f64);

    // Whole op.
    let mut y = vec![T::default(); len];
    let (mut mean, mut var) = (vec![zero; c], vec![zero; c]);
    let (mut rm, mut rv) = (running0.clone(), running0.clone());
    p.forward(
        &x,
        affine,
        Forward::Training(TrainingStats {
            saved: SavedStats {
                mean: &mut mean,
                variance: &mut var,
            },
            running: Some(RunningStats {
                mean: &mut rm,
                variance: &mut rv,
                factor: 0.25,
            }),
        }),
        epilogue,
        &mut y,
    )
    .unwrap();

    // Phases.
    let local = p.moments(&x).unwrap();
    let global = combine_moments(&[&local]).unwrap();
    let mut y2 = vec![T::default(); len];
    let (mut mean2, mut var2) = (vec![zero; c], vec![zero; c]);
    let (mut rm2, mut rv2) = (running0.clone(), running0);
    p.forward_apply(
        &x,
        affine,
        &global,
        TrainingStats {
            saved: SavedStats {
                mean: &mut mean2,
                variance: &mut var2,
            },
            running: Some(RunningStats {
                mean: &mut rm2,
                variance: &mut rv2,
                factor: 0.25,
            }),
        },
        epilogue,
        &mut y2,
    )
    .unwrap();
    let what = format!("{format} {dims:?} {} ex={ex}", T::DTYPE);
    assert_eq!(bits(&y), bits(&y2), "{what}: y");
    for (a, b, name) in [
        (&mean, &mean2, "mean"),
        (&var, &var2, "variance"),
        (&rm, &rm2, "running mean"),
        (&rv, &rv2, "running variance"),
    ] {
        assert_eq!(bits(a), bits(b), "{what}: {name}");
    }

    // The gradient, with the forward's y as the ReLU mask in the Ex case.
    let saved = Statistics {
        mean: &mean,
        variance: &var,
    };
    let inputs = GradInputs {
        y_backprop: &dy,
        x: &x,
    };
    let relu_output = ex.then_some(&y[..]);
    let (mut dx, mut ds, mut db) = (vec![T::default(); len], vec![zero; c], vec![zero; c]);
    let mut side_grad = vec![T::default(); len];
    p.backward(
        inputs,
        &scale,
        Backward::Training(saved),
        GradEpilogue {
            relu_output,
            side_input_backprop: ex.then_some(&mut side_grad[..]),
        },
        Gradients {
            x: &mut dx,
            scale: &mut ds,
            offset: &mut db,
        },
    )
    .unwrap();
    let mut side_grad2 = vec![T::default(); len];
    let local = p
        .backward_sums(
            inputs,
            saved.mean,
            GradEpilogue {
                relu_output,
                side_input_backprop: ex.then_some(&mut side_grad2[..]),
            },
        )
        .unwrap();
    let total = combine_sums(&[&local]).unwrap();
    let (mut dx2, mut ds2, mut db2) = (vec![T::default(); len], vec![zero; c], vec![zero; c]);
    p.backward_apply(
        inputs,
        &scale,
        saved,
        &total,
        relu_output,
        Gradients {
            x: &mut dx2,
            scale: &mut ds2,
            offset: &mut db2,
        },
    )
    .unwrap();
    assert_eq!(bits(&dx), bits(&dx2), "{what}: dx");
    assert_eq!(bits(&ds), bits(&ds2), "{what}: dscale");
    assert_eq!(bits(&db), bits(&db2), "{what}: doffset");
    if ex {
        assert_eq!(bits(&side_grad), bits(&side_grad2), "{what}: side grad");
    }
}

/// Shapes: tiny, SIMD tails, C = 1, M = 1, channel-major channels that stay resident
/// and ones too large to (NCHW 1×2×512×512: 1 MiB per f32 channel), and channels the
/// phases' reduction splits into row chunks across tasks (NCHW 3×2×300×700: 630 000
/// elements a channel, resident in the whole ops for f32 without Ex and for the half
/// types with it, two passes for f32 Ex and f64); and resident tasks of several channels,
/// whose passes write a channel while they reduce the next: NCHW 2×8×64×64 (rows of
/// 4096 elements, all eight channels in one task), 2×6×100×100 (rows longer than a
/// reduction tile, reduced in pieces), 6×3×200×250 (channels reduced in two row chunks).
const SHAPES: [[usize; 4]; 11] = [
    [1, 1, 1, 1],
    [3, 5, 7, 1],
    [2, 3, 5, 19],
    [1, 1, 1, 33],
    [4, 9, 11, 64],
    [2, 64, 64, 3],
    [1, 512, 512, 2],
    [3, 300, 700, 2],
    [2, 64, 64, 8],
    [2, 100, 100, 6],
    [6, 200, 250, 3],
];

#[test]
fn phases_on_one_shard_are_bit_identical_to_the_whole_ops() {
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        for dims in SHAPES {
            for ex in [false, true] {
                one_shard_is_bit_identical::<f32>(format, dims, ex);
                one_shard_is_bit_identical::<bf16>(format, dims, ex);
                one_shard_is_bit_identical::<f16>(format, dims, ex);
                one_shard_is_bit_identical::<f64>(format, dims, ex);
            }
        }
    }
}

/// A batch split along N into uneven shards (one empty) gives, through the phases, the
/// statistics, y, dx and parameter gradients of the whole batch.
fn shards_match_one_batch<T: Element>(format: DataFormat, split: &[usize], hwc: [usize; 3]) {
    let [h, w, c] = hwc;
    let n: usize = split.iter().sum();
    let whole = Problem::new(format, &shape(format, n, h, w, c)).unwrap();
    let per_image = h * w * c;
    let x: Vec<T> = data(whole.len(), 7, 40.0);
    let dy: Vec<T> = data(whole.len(), 8, 0.25);
    let scale = stat::<T>(c, |i| 1.0 + 0.25 * i as f64);
    let offset = stat::<T>(c, |i| 0.5 * i as f64);
    let affine = Affine {
        scale: &scale,
        offset: &offset,
    };
    let zero = <T::Stat as Real>::ZERO;

    // The whole batch, with the whole ops.
    let mut y = vec![T::default(); whole.len()];
    let (mut mean, mut var, mut rm, mut rv) =
        (vec![zero; c], vec![zero; c], vec![zero; c], vec![zero; c]);
    whole
        .forward(
            &x,
            affine,
            Forward::Training(TrainingStats {
                saved: SavedStats {
                    mean: &mut mean,
                    variance: &mut var,
                },
                running: Some(RunningStats {
                    mean: &mut rm,
                    variance: &mut rv,
                    factor: 1.0,
                }),
            }),
            Epilogue::plain(),
            &mut y,
        )
        .unwrap();
    let (mut dx, mut ds, mut db) = (
        vec![T::default(); whole.len()],
        vec![zero; c],
        vec![zero; c],
    );
    whole
        .backward(
            GradInputs {
                y_backprop: &dy,
                x: &x,
            },
            &scale,
            Backward::Training(Statistics {
                mean: &mean,
                variance: &var,
            }),
            GradEpilogue::default(),
            Gradients {
                x: &mut dx,
                scale: &mut ds,
                offset: &mut db,
            },
        )
        .unwrap();

    // The shards, with the phases. N is the outermost axis in every format, so a shard
    // of images is a contiguous range.
    let mut start = 0;
    let shards: Vec<(Problem, std::ops::Range<usize>)> = split
        .iter()
        .map(|&k| {
            let r = start..start + k * per_image;
            start = r.end;
            (Problem::new(format, &shape(format, k, h, w, c)).unwrap(), r)
        })
        .collect();
    let local: Vec<Vec<Moments>> = shards
        .iter()
        .map(|(p, r)| p.moments(&x[r.clone()]).unwrap())
        .collect();
    let parts: Vec<&[Moments]> = local.iter().map(|v| &v[..]).collect();
    let global = combine_moments(&parts).unwrap();
    let mut y2 = vec![T::default(); whole.len()];
    let (mut mean2, mut var2, mut rm2, mut rv2) =
        (vec![zero; c], vec![zero; c], vec![zero; c], vec![zero; c]);
    for (p, r) in &shards {
        p.forward_apply(
            &x[r.clone()],
            affine,
            &global,
            TrainingStats {
                saved: SavedStats {
                    mean: &mut mean2,
                    variance: &mut var2,
                },
                running: Some(RunningStats {
                    mean: &mut rm2,
                    variance: &mut rv2,
                    factor: 1.0,
                }),
            },
            Epilogue::plain(),
            &mut y2[r.clone()],
        )
        .unwrap();
    }
    let saved = Statistics {
        mean: &mean2,
        variance: &var2,
    };
    let sums: Vec<Vec<GradSums>> = shards
        .iter()
        .map(|(p, r)| {
            let inputs = GradInputs {
                y_backprop: &dy[r.clone()],
                x: &x[r.clone()],
            };
            p.backward_sums(inputs, saved.mean, GradEpilogue::default())
                .unwrap()
        })
        .collect();
    let parts: Vec<&[GradSums]> = sums.iter().map(|v| &v[..]).collect();
    let total = combine_sums(&parts).unwrap();
    let (mut dx2, mut ds2, mut db2) = (
        vec![T::default(); whole.len()],
        vec![zero; c],
        vec![zero; c],
    );
    for (p, r) in &shards {
        let inputs = GradInputs {
            y_backprop: &dy[r.clone()],
            x: &x[r.clone()],
        };
        p.backward_apply(
            inputs,
            &scale,
            saved,
            &total,
            None,
            Gradients {
                x: &mut dx2[r.clone()],
                scale: &mut ds2,
                offset: &mut db2,
            },
        )
        .unwrap();
    }

    // Statistics to 2e-5 of their size (the tiling differs, so not bit for bit; SPEC §7
    // allows 1e-4);
    // elements to a couple of roundings of T.
    let what = format!("{format} {split:?} {hwc:?} {}", T::DTYPE);
    let eps = T::DTYPE.epsilon();
    let close = |name: &str, a: &[T::Stat], b: &[T::Stat], scale: &dyn Fn(usize) -> f64| {
        for i in 0..a.len() {
            let (a, b) = (a[i].to_f64(), b[i].to_f64());
            assert!(
                (a - b).abs() <= 2e-5 * scale(i) + 2e-5 * b.abs(),
                "{what}: {name}[{i}] {a} vs {b}"
            );
        }
    };
    let std = |i: usize| var[i].to_f64().sqrt();
    close("mean", &mean, &mean2, &std);
    close("variance", &var, &var2, &|i| var[i].to_f64());
    close("running mean", &rm, &rm2, &std);
    close("running variance", &rv, &rv2, &|i| rv[i].to_f64());
    let m = (n * h * w) as f64;
    close("doffset", &db, &db2, &|_| m);
    close("dscale", &ds, &ds2, &|_| m);
    for (name, a, b) in [("y", &y, &y2), ("dx", &dx, &dx2)] {
        let top = b
            .iter()
            .map(|v| v.widen().to_f64().abs())
            .fold(0.0, f64::max);
        for i in 0..a.len() {
            let (u, v) = (a[i].widen().to_f64(), b[i].widen().to_f64());
            assert!(
                (u - v).abs() <= 2.0 * eps * u.abs() + 1e-5 * top,
                "{what}: {name}[{i}] {u} vs {v}"
            );
        }
    }
}

#[test]
fn uneven_shards_with_an_empty_one_match_one_batch() {
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        for split in [&[3usize, 0, 1, 5][..], &[1, 1], &[0, 2], &[6]] {
            for hwc in [[5, 7, 3], [16, 16, 32], [1, 1, 17]] {
                shards_match_one_batch::<f32>(format, split, hwc);
                shards_match_one_batch::<bf16>(format, split, hwc);
                shards_match_one_batch::<f64>(format, split, hwc);
            }
        }
    }
}

#[test]
fn phases_validate_their_inputs() {
    let p = Problem::new(DataFormat::Nhwc, &[2, 2, 2, 3]).unwrap();
    let x = vec![1.0f32; p.len()];
    assert!(p.moments(&x[1..]).is_err());
    // Shards disagreeing on C.
    let a = vec![Moments::EMPTY; 3];
    let b = vec![Moments::EMPTY; 2];
    let e = combine_moments(&[&a, &b]).unwrap_err();
    assert!(e.to_string().contains("3 channels in every shard"), "{e}");
    assert!(combine_sums(&[]).is_err());
    // Global moments that count fewer elements than this shard holds.
    let local = p.moments(&x).unwrap();
    let half: Vec<Moments> = local
        .iter()
        .map(|m| Moments {
            count: m.count - 1.0,
            ..*m
        })
        .collect();
    let (mut y, mut mu, mut var) = (vec![7.0f32; p.len()], [7.0f32; 3], [7.0f32; 3]);
    let e = p
        .forward_apply(
            &x,
            Affine {
                scale: &[1.0; 3],
                offset: &[0.0; 3],
            },
            &half,
            TrainingStats {
                saved: SavedStats {
                    mean: &mut mu,
                    variance: &mut var,
                },
                running: None,
            },
            Epilogue::plain(),
            &mut y,
        )
        .unwrap_err();
    assert!(e.to_string().contains("global count"), "{e}");
    assert!(y.iter().chain(&mu).chain(&var).all(|&v| v == 7.0));
    // An all-empty batch: NaN statistics, as the whole op gives.
    let empty = Problem::new(DataFormat::Nchw, &[0, 3, 4, 4]).unwrap();
    let none = combine_moments(&[&empty.moments::<f32>(&[]).unwrap()]).unwrap();
    let (mut mu, mut var) = ([0.0f32; 3], [0.0f32; 3]);
    empty
        .forward_apply::<f32>(
            &[],
            Affine {
                scale: &[1.0; 3],
                offset: &[0.0; 3],
            },
            &none,
            TrainingStats {
                saved: SavedStats {
                    mean: &mut mu,
                    variance: &mut var,
                },
                running: None,
            },
            Epilogue::plain(),
            &mut [],
        )
        .unwrap();
    assert!(mu.iter().chain(&var).all(|v| v.is_nan()));
}
