//! The checks of synchronized batch norm, written against `&dyn Collective` so that the
//! same code runs with the thread group (`tests/sync.rs`) and under `mpirun`
//! (`tests/sync_mpi.rs`). Every rank generates the whole batch deterministically, runs
//! the single-process ops on it (the reference), runs the synchronized ops on its own
//! shard, and compares: bit for bit with one rank, within SPEC §7's tolerances
//! otherwise; the per-channel results must have the same bits on every rank (checked
//! with one more all-gather of a fingerprint).
#![allow(dead_code)]

use fusedbn::batch_norm::{
    Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, RunningStats,
    SavedStats, Statistics, TrainingStats,
};
use fusedbn::layer::{BatchNorm, Forwarded};
use fusedbn::ops::{Attrs, Inputs, Op};
use fusedbn::sync::Collective;
use fusedbn::{bf16, f16, DataFormat, Element, Problem, Real, Tensor};

/// Deterministic data around `mean`.
pub fn data<T: Element>(n: usize, seed: u64, mean: f64) -> Vec<T> {
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

/// A 52-bit fingerprint of some values' bits (exact in an f64).
fn fingerprint(parts: &[Vec<u64>]) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p {
            h ^= b;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h >> 12) as f64
}

/// Fails unless every rank passes the same fingerprint.
fn same_on_every_rank(comm: &dyn Collective, what: &str, parts: &[Vec<u64>]) -> Result<(), String> {
    let mine = fingerprint(parts);
    let all = comm.all_gather(&[mine]).map_err(|e| e.to_string())?;
    if all.iter().any(|&f| f != all[0]) {
        return Err(format!(
            "{what}: per-channel results differ between ranks {all:?}"
        ));
    }
    Ok(())
}

/// The shape of `n` images of `[D,] H, W, C` in `format`'s axis order.
pub fn shape(format: DataFormat, n: usize, spatial: &[usize], c: usize) -> Vec<usize> {
    let spatial = if format.rank() == 5 {
        spatial.to_vec()
    } else {
        spatial[1..].to_vec()
    };
    let mut s = vec![n];
    if format.is_channels_last() {
        s.extend(spatial);
        s.push(c);
    } else {
        s.push(c);
        s.extend(spatial);
    }
    s
}

/// The images per rank: uneven with an empty rank, even, and all empty.
pub fn splits(size: usize) -> Vec<Vec<usize>> {
    let uneven = [2usize, 0, 3, 1];
    let one = if size == 1 {
        vec![3]
    } else {
        uneven[..size].to_vec()
    };
    vec![one, vec![1; size], vec![0; size]]
}

/// A named pair of results: one process, synchronized.
type Pair<'a, V> = (&'a str, &'a [V], &'a [V]);

fn epilogue<T>(ex: bool, side: &[T]) -> Epilogue<'_, T> {
    if ex {
        Epilogue::relu(Some(side))
    } else {
        Epilogue::plain()
    }
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol || (a.is_nan() && b.is_nan())
}

/// One case: `steps` training steps (forward with running statistics, then the
/// gradient) of the synchronized ops on this rank's shard against the whole ops on the
/// whole batch.
fn case<T: Element>(
    comm: &dyn Collective,
    format: DataFormat,
    split: &[usize],
    spatial: &[usize],
    c: usize,
    ex: bool,
    steps: u64,
) -> Result<(), String> {
    let (rank, size) = (comm.rank(), comm.size());
    let what = format!(
        "rank {rank}/{size} {format} {} split {split:?} spatial {spatial:?} C {c} ex={ex}",
        T::DTYPE
    );
    let n: usize = split.iter().sum();
    let whole = Problem::new(format, &shape(format, n, spatial, c))
        .unwrap()
        .with_epsilon(1e-3);
    let mine = Problem::new(format, &shape(format, split[rank], spatial, c))
        .unwrap()
        .with_epsilon(1e-3);
    let per_image = whole.len() / n.max(1);
    let start = split[..rank].iter().sum::<usize>() * per_image;
    let r = start..start + mine.len();
    let zero = <T::Stat as Real>::ZERO;
    let scale = stat::<T>(c, |i| 0.75 + 0.125 * i as f64);
    let offset = stat::<T>(c, |i| 0.25 * i as f64 - 0.5);
    let affine = Affine {
        scale: &scale,
        offset: &offset,
    };
    let (mut rm, mut rv) = (stat::<T>(c, |_| 0.0), stat::<T>(c, |_| 1.0));
    let (mut rm2, mut rv2) = (rm.clone(), rv.clone());
    let tol_t = 2.0 * T::DTYPE.epsilon();
    for step in 0..steps {
        let what = format!("{what} step {step}");
        let x: Vec<T> = data(whole.len(), 11 + step, 30.0);
        let side: Vec<T> = data(whole.len(), 21 + step, -1.0);
        let dy: Vec<T> = data(whole.len(), 31 + step, 0.25);
        let epi = |s| epilogue(ex, s);
        // Reference: the whole batch in one process.
        let mut y = vec![T::default(); whole.len()];
        let (mut mean, mut var) = (vec![zero; c], vec![zero; c]);
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
                        factor: 0.3,
                    }),
                }),
                epi(&side),
                &mut y,
            )
            .map_err(|e| format!("{what}: reference forward: {e}"))?;
        let (mut dx, mut ds, mut db) = (
            vec![T::default(); whole.len()],
            vec![zero; c],
            vec![zero; c],
        );
        let mut sg = vec![T::default(); whole.len()];
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
                GradEpilogue {
                    relu_output: ex.then_some(&y[..]),
                    side_input_backprop: ex.then_some(&mut sg[..]),
                },
                Gradients {
                    x: &mut dx,
                    scale: &mut ds,
                    offset: &mut db,
                },
            )
            .map_err(|e| format!("{what}: reference backward: {e}"))?;

        // Synchronized, this rank's shard.
        let mut y2 = vec![T::default(); mine.len()];
        let (mut mean2, mut var2) = (vec![zero; c], vec![zero; c]);
        mine.forward_sync(
            comm,
            &x[r.clone()],
            affine,
            TrainingStats {
                saved: SavedStats {
                    mean: &mut mean2,
                    variance: &mut var2,
                },
                running: Some(RunningStats {
                    mean: &mut rm2,
                    variance: &mut rv2,
                    factor: 0.3,
                }),
            },
            epi(&side[r.clone()]),
            &mut y2,
        )
        .map_err(|e| format!("{what}: forward_sync: {e}"))?;
        let (mut dx2, mut ds2, mut db2) =
            (vec![T::default(); mine.len()], vec![zero; c], vec![zero; c]);
        let mut sg2 = vec![T::default(); mine.len()];
        // The ReLU mask: the reference's y, so that a value rounding to either side of
        // 0 cannot flip the mask between the two runs.
        mine.backward_sync(
            comm,
            GradInputs {
                y_backprop: &dy[r.clone()],
                x: &x[r.clone()],
            },
            &scale,
            Statistics {
                mean: &mean2,
                variance: &var2,
            },
            GradEpilogue {
                relu_output: ex.then_some(&y[r.clone()]),
                side_input_backprop: ex.then_some(&mut sg2[..]),
            },
            Gradients {
                x: &mut dx2,
                scale: &mut ds2,
                offset: &mut db2,
            },
        )
        .map_err(|e| format!("{what}: backward_sync: {e}"))?;

        same_on_every_rank(
            comm,
            &what,
            &[
                bits::<T::Stat>(&mean2),
                bits::<T::Stat>(&var2),
                bits::<T::Stat>(&rm2),
                bits::<T::Stat>(&rv2),
                bits::<T::Stat>(&ds2),
                bits::<T::Stat>(&db2),
            ],
        )?;
        let per_channel: [Pair<'_, T::Stat>; 6] = [
            ("mean", &mean, &mean2),
            ("variance", &var, &var2),
            ("running mean", &rm, &rm2),
            ("running variance", &rv, &rv2),
            ("dscale", &ds, &ds2),
            ("doffset", &db, &db2),
        ];
        let elements: [Pair<'_, T>; 3] = [
            ("y", &y[r.clone()], &y2),
            ("dx", &dx[r.clone()], &dx2),
            ("side_input_backprop", &sg[r.clone()], &sg2),
        ];
        if size == 1 {
            for (name, a, b) in per_channel {
                if bits::<T::Stat>(a) != bits::<T::Stat>(b) {
                    return Err(format!("{what}: {name} not bit-identical: {a:?} vs {b:?}"));
                }
            }
            for (name, a, b) in elements {
                if bits(a) != bits(b) {
                    return Err(format!("{what}: {name} not bit-identical"));
                }
            }
            continue;
        }
        // Statistics to 2e-5 of their size (SPEC §7 allows 1e-4), gradients sums to
        // 2e-5 of the count; elements to two roundings of T plus 1e-5 of the largest.
        let m = (whole.elements_per_channel()).max(1) as f64;
        for (name, a, b) in per_channel {
            for ch in 0..c {
                let (u, v) = (a[ch].to_f64(), b[ch].to_f64());
                let size = match name {
                    "mean" | "running mean" => var[ch].to_f64().sqrt() + u.abs(),
                    "dscale" | "doffset" => m,
                    _ => u.abs(),
                };
                if !close(u, v, 2e-5 * size + 1e-6) {
                    return Err(format!(
                        "{what}: {name}[{ch}] {u} (one process) vs {v} (synchronized)"
                    ));
                }
            }
        }
        for (name, a, b) in elements {
            let top = a
                .iter()
                .map(|v| v.widen().to_f64().abs())
                .fold(0.0, f64::max);
            for i in 0..a.len() {
                let (u, v) = (a[i].widen().to_f64(), b[i].widen().to_f64());
                if !close(u, v, tol_t * u.abs() + 1e-5 * top) {
                    return Err(format!(
                        "{what}: {name}[{i}] {u} (one process) vs {v} (synchronized)"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Every format, dtype, plain and Ex, the three splits of [`splits`], two shapes, three
/// steps of running statistics.
pub fn typed_api(comm: &dyn Collective) -> Result<usize, String> {
    let mut cases = 0;
    for split in splits(comm.size()) {
        for format in DataFormat::ALL {
            for (spatial, c) in [(&[2usize, 3, 5][..], 7usize), (&[1, 16, 16][..], 32)] {
                for ex in [false, true] {
                    case::<f32>(comm, format, &split, spatial, c, ex, 3)?;
                    case::<f16>(comm, format, &split, spatial, c, ex, 3)?;
                    case::<bf16>(comm, format, &split, spatial, c, ex, 3)?;
                    case::<f64>(comm, format, &split, spatial, c, ex, 3)?;
                    cases += 4;
                }
            }
        }
    }
    Ok(cases)
}

/// The op layer: every training op synchronized (`Op::run_sync`) against `Op::run` on
/// the whole batch, with the V3 forward's outputs feeding the gradients.
pub fn op_layer(comm: &dyn Collective) -> Result<usize, String> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut cases = 0;
    for split in splits(size) {
        for (fwd, grad, format, dtype_f32) in [
            (
                Op::FusedBatchNorm,
                Op::FusedBatchNormGrad,
                DataFormat::Nhwc,
                true,
            ),
            (
                Op::FusedBatchNormV2,
                Op::FusedBatchNormGradV2,
                DataFormat::Nchw,
                false,
            ),
            (
                Op::FusedBatchNormV3,
                Op::FusedBatchNormGradV3,
                DataFormat::Ncdhw,
                false,
            ),
            (
                Op::FusedBatchNormEx,
                Op::FusedBatchNormGradEx,
                DataFormat::Ndhwc,
                true,
            ),
        ] {
            let what = format!("rank {rank}/{size} {fwd}/{grad} {format} split {split:?}");
            let c = 5;
            let n: usize = split.iter().sum();
            let sh = shape(format, n, &[2, 3, 4], c);
            let my_shape = shape(format, split[rank], &[2, 3, 4], c);
            let len: usize = sh.iter().product();
            let per_image = len / n.max(1);
            let start = split[..rank].iter().sum::<usize>() * per_image;
            let r = start..start + split[rank] * per_image;
            let t = |v: Vec<f32>, shape: &[usize]| -> Tensor {
                if dtype_f32 {
                    Tensor::new(shape.to_vec(), v).unwrap()
                } else {
                    let h: Vec<bf16> = v.iter().map(|&a| bf16::from_f32(a)).collect();
                    Tensor::new(shape.to_vec(), h).unwrap()
                }
            };
            let x = data::<f32>(len, 5, -20.0);
            let side = data::<f32>(len, 6, 0.5);
            let dy = data::<f32>(len, 7, 0.1);
            let (xw, xm) = (t(x.clone(), &sh), t(x[r.clone()].to_vec(), &my_shape));
            let (sw, sm) = (t(side.clone(), &sh), t(side[r.clone()].to_vec(), &my_shape));
            let (dw, dm) = (t(dy.clone(), &sh), t(dy[r.clone()].to_vec(), &my_shape));
            let scale = Tensor::vector(vec![1.5f32, 0.5, 1.0, 2.0, 0.25]);
            let offset = Tensor::vector(vec![0.0f32, 0.5, -0.5, 1.0, 0.1]);
            let mean = Tensor::vector(vec![0.5f32; c]);
            let var = Tensor::vector(vec![2.0f32; c]);
            let mut attrs = Attrs::new()
                .epsilon(0.01)
                .data_format(format)
                .exponential_avg_factor(0.5);
            let ex = fwd == Op::FusedBatchNormEx;
            if ex {
                attrs = attrs.activation_mode(fusedbn::batch_norm::Activation::Relu);
            }
            let fwd_inputs = |x: &Tensor, s: &Tensor| -> Vec<(String, Tensor)> {
                let mut v = vec![
                    ("x".to_string(), x.clone()),
                    ("scale".into(), scale.clone()),
                    ("offset".into(), offset.clone()),
                    ("mean".into(), mean.clone()),
                    ("variance".into(), var.clone()),
                ];
                if ex {
                    v.push(("side_input".into(), s.clone()));
                }
                v
            };
            let named = |v: &[(String, Tensor)]| -> Vec<(String, Tensor)> { v.to_vec() };
            let run = |op: Op, v: &[(String, Tensor)], sync: bool| {
                let mut inputs = Inputs::new();
                for (k, t) in v {
                    inputs.insert(k, t);
                }
                if sync {
                    op.run_sync(&inputs, &attrs, comm)
                } else {
                    op.run(&inputs, &attrs)
                }
                .map_err(|e| format!("{what}: {op}: {e}"))
            };
            let whole = run(fwd, &named(&fwd_inputs(&xw, &sw)), false)?;
            let synced = run(fwd, &named(&fwd_inputs(&xm, &sm)), true)?;
            let grad_inputs =
                |dy: &Tensor, x: &Tensor, fwd_out: &fusedbn::ops::Outputs, y: &Tensor| {
                    let mut v = vec![
                        ("y_backprop".to_string(), dy.clone()),
                        ("x".into(), x.clone()),
                        ("scale".into(), scale.clone()),
                        (
                            "reserve_space_1".into(),
                            fwd_out.get("reserve_space_1").unwrap().clone(),
                        ),
                        (
                            "reserve_space_2".into(),
                            fwd_out.get("reserve_space_2").unwrap().clone(),
                        ),
                    ];
                    if ex {
                        v.push(("offset".into(), offset.clone()));
                        v.push(("y".into(), y.clone()));
                    }
                    v
                };
            // The ReLU mask from the whole run's y (sliced), as in `case`.
            let y_whole = whole.get("y").unwrap().clone();
            let y_slice = {
                let f: Vec<f32> = y_whole.to_f64_vec()[r.clone()]
                    .iter()
                    .map(|&v| v as f32)
                    .collect();
                t(f, &my_shape)
            };
            let gw = run(grad, &grad_inputs(&dw, &xw, &whole, &y_whole), false)?;
            let gs = run(grad, &grad_inputs(&dm, &xm, &synced, &y_slice), true)?;
            cases += 1;
            for (out_whole, out_sync, names) in [
                (
                    &whole,
                    &synced,
                    &[
                        "batch_mean",
                        "batch_variance",
                        "reserve_space_1",
                        "reserve_space_2",
                    ][..],
                ),
                (&gw, &gs, &["scale_backprop", "offset_backprop"][..]),
            ] {
                let mut fps = Vec::new();
                for &name in names {
                    let a = out_whole.get(name).unwrap().to_f64_vec();
                    let b = out_sync.get(name).unwrap().to_f64_vec();
                    fps.push(b.iter().map(|v| v.to_bits()).collect::<Vec<u64>>());
                    for ch in 0..c {
                        let ok = if size == 1 {
                            a[ch].to_bits() == b[ch].to_bits()
                        } else {
                            close(
                                a[ch],
                                b[ch],
                                2e-5 * (a[ch].abs() + len as f64 / c as f64) + 1e-6,
                            )
                        };
                        if !ok {
                            return Err(format!(
                                "{what}: {name}[{ch}] {} (one process) vs {} (synchronized)",
                                a[ch], b[ch]
                            ));
                        }
                    }
                }
                same_on_every_rank(comm, &what, &fps)?;
            }
            for (out_whole, out_sync, name) in [(&whole, &synced, "y"), (&gw, &gs, "x_backprop")] {
                let a = out_whole.get(name).unwrap().to_f64_vec();
                let b = out_sync.get(name).unwrap().to_f64_vec();
                let a = &a[r.clone()];
                let top = a.iter().map(|v| v.abs()).fold(0.0, f64::max);
                let eps = if dtype_f32 {
                    2f64.powi(-24)
                } else {
                    2f64.powi(-8)
                };
                for i in 0..a.len() {
                    let ok = if size == 1 {
                        a[i].to_bits() == b[i].to_bits()
                    } else {
                        close(a[i], b[i], 2.0 * eps * a[i].abs() + 1e-5 * top)
                    };
                    if !ok {
                        return Err(format!(
                            "{what}: {name}[{i}] {} (one process) vs {} (synchronized)",
                            a[i], b[i]
                        ));
                    }
                }
            }
        }
    }
    Ok(cases)
}

/// The Keras-style layer in synchronized mode: four training steps with SGD on the
/// global gradients; the moving statistics and parameters equal a single layer on the
/// whole batch, and have the same bits on every rank.
pub fn layer(comm: &dyn Collective) -> Result<(), String> {
    let (rank, size) = (comm.rank(), comm.size());
    let split = &splits(size)[0];
    let c = 6;
    let n: usize = split.iter().sum();
    let mut whole = BatchNorm::new(DataFormat::Nhwc, c)
        .with_momentum(0.8)
        .with_relu(true);
    let mut mine = whole.clone();
    let start = split[..rank].iter().sum::<usize>() * 4 * c;
    let r = start..start + split[rank] * 4 * c;
    for step in 0..4u64 {
        let what = format!("rank {rank}/{size} layer step {step}");
        let x: Vec<f32> = data(n * 4 * c, 40 + step, 100.0);
        let dy: Vec<f32> = data(n * 4 * c, 50 + step, 0.0);
        let y = whole
            .forward(&x, &[n, 2, 2, c], true)
            .map_err(|e| e.to_string())?;
        let g = whole
            .backward(Forwarded { x: &x, y: &y }, &dy)
            .map_err(|e| e.to_string())?;
        whole.apply_sgd(&g, 0.1).map_err(|e| e.to_string())?;
        let mut s = mine.synchronized(comm);
        let xs = &x[r.clone()];
        let y2 = s
            .forward(xs, &[split[rank], 2, 2, c], true)
            .map_err(|e| format!("{what}: {e}"))?;
        let g2 = s
            .backward(Forwarded { x: xs, y: &y2 }, &dy[r.clone()])
            .map_err(|e| format!("{what}: {e}"))?;
        mine.apply_sgd(&g2, 0.1).map_err(|e| e.to_string())?;
        let f = |v: &[f32]| {
            v.iter()
                .map(|x| u64::from(x.to_bits()))
                .collect::<Vec<u64>>()
        };
        same_on_every_rank(
            comm,
            &what,
            &[
                f(mine.moving_mean()),
                f(mine.moving_variance()),
                f(mine.gamma()),
                f(mine.beta()),
            ],
        )?;
        for (name, a, b) in [
            ("moving_mean", whole.moving_mean(), mine.moving_mean()),
            (
                "moving_variance",
                whole.moving_variance(),
                mine.moving_variance(),
            ),
            ("gamma", whole.gamma(), mine.gamma()),
            ("beta", whole.beta(), mine.beta()),
        ] {
            for ch in 0..c {
                let (u, v) = (f64::from(a[ch]), f64::from(b[ch]));
                let ok = if size == 1 {
                    u.to_bits() == v.to_bits()
                } else {
                    close(u, v, 1e-5 * (1.0 + u.abs()))
                };
                if !ok {
                    return Err(format!(
                        "{what}: {name}[{ch}] {u} (one process) vs {v} (synchronized)"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Ranks that disagree (rank 1 has another epsilon; then rank 0 has a scale of the
/// wrong length): an error on every rank, not a hang; then a good call still works.
pub fn disagreement(comm: &dyn Collective) -> Result<(), String> {
    let (rank, size) = (comm.rank(), comm.size());
    if size < 2 {
        return Ok(());
    }
    let eps = if rank == 1 { 1e-3 } else { 1e-4 };
    let p = Problem::new(DataFormat::Nhwc, &[1, 1, 4, 2])
        .unwrap()
        .with_epsilon(eps);
    let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
    let mut y = [9.0f32; 8];
    let (mut m, mut v) = ([9.0f32; 2], [9.0f32; 2]);
    let scale_ok = [1.0f32; 2];
    let call =
        |p: &Problem, scale: &[f32], y: &mut [f32; 8], m: &mut [f32; 2], v: &mut [f32; 2]| {
            p.forward_sync(
                comm,
                &x,
                Affine {
                    scale,
                    offset: &[0.0; 2],
                },
                TrainingStats {
                    saved: SavedStats {
                        mean: m,
                        variance: v,
                    },
                    running: None,
                },
                Epilogue::plain(),
                y,
            )
        };
    let e = call(&p, &scale_ok, &mut y, &mut m, &mut v)
        .err()
        .ok_or(format!("rank {rank}: disagreeing epsilon accepted"))?;
    let msg = e.to_string();
    if !msg.contains("disagree on epsilon") || !msg.contains("rank 1 has 0.001") {
        return Err(format!("rank {rank}: unexpected error {msg}"));
    }
    let p = p.with_epsilon(1e-4);
    let bad = [1.0f32; 3];
    let scale = if rank == 0 { &bad[..] } else { &scale_ok[..] };
    let e = call(&p, scale, &mut y, &mut m, &mut v)
        .err()
        .ok_or(format!("rank {rank}: a bad scale on rank 0 accepted"))?;
    let msg = e.to_string();
    let want = if rank == 0 {
        "scale: expected 2 elements"
    } else {
        "rank 0 of"
    };
    if !msg.contains(want) {
        return Err(format!("rank {rank}: unexpected error {msg}"));
    }
    if y != [9.0; 8] || m != [9.0; 2] {
        return Err(format!("rank {rank}: a failed call wrote its outputs"));
    }
    call(&p, &scale_ok, &mut y, &mut m, &mut v)
        .map_err(|e| format!("rank {rank}: good call after errors: {e}"))?;
    if (m[0] - 4.0).abs() > 1e-6 {
        return Err(format!("rank {rank}: mean {m:?}"));
    }
    // The op layer: one rank in inference, the others in training.
    let xt = Tensor::new(vec![1, 1, 4, 2], x.to_vec()).unwrap();
    let (s, o) = (
        Tensor::vector(vec![1.0f32; 2]),
        Tensor::vector(vec![0.0f32; 2]),
    );
    let inputs = Inputs::new()
        .with("x", &xt)
        .with("scale", &s)
        .with("offset", &o)
        .with("mean", &s)
        .with("variance", &s);
    let attrs = Attrs::new().is_training(rank != size - 1);
    let e = Op::FusedBatchNormV3
        .run_sync(&inputs, &attrs, comm)
        .err()
        .ok_or(format!("rank {rank}: mixed training/inference accepted"))?;
    if !e.to_string().contains("disagree on the operation") {
        return Err(format!("rank {rank}: unexpected error {e}"));
    }
    Ok(())
}

/// Everything, in an order every rank follows.
pub fn all(comm: &dyn Collective) -> Result<String, String> {
    let typed = typed_api(comm)?;
    let ops = op_layer(comm)?;
    layer(comm)?;
    disagreement(comm)?;
    Ok(format!(
        "rank {}/{}: {typed} typed cases × 3 steps, {ops} op-layer cases, layer, disagreement: ok",
        comm.rank(),
        comm.size()
    ))
}
