//! The CUDA backend (feature `cuda`).
//!
//! Without a GPU (our machines, CI) every test that needs one prints why it skipped and
//! returns; the host-side logic (launch geometry, layout mapping, the kernel source and,
//! where libnvrtc can be loaded, its compilation) is tested everywhere. On a GPU: every
//! op × layout × dtype × mode against the f64 reference under the driver's tolerance
//! policy, odd sizes and tails, a large M, empty tensors, validation, bit-identical
//! reruns, and the committed TensorFlow fixtures through the GPU.
#![cfg(feature = "cuda")]

mod common;

use std::sync::OnceLock;

use fusedbn::batch_norm::{Affine, Epilogue, Forward, SavedStats, TrainingStats};
use fusedbn::cuda::launch::{self, Traversal};
use fusedbn::cuda::{self, Gpu};
use fusedbn::driver::{check, reference, Case, Fill};
use fusedbn::ops::{Backend, Inputs, Op};
use fusedbn::{npy, DType, DataFormat, Problem, Tensor};

/// The GPU, or `None` with the reason printed once per test.
fn gpu(test: &str) -> Option<Gpu> {
    static GPU: OnceLock<Result<Gpu, String>> = OnceLock::new();
    match GPU.get_or_init(|| Gpu::new(0).map_err(|e| e.to_string())) {
        Ok(g) => Some(g.clone()),
        Err(e) => {
            eprintln!("{test}: skipped, no GPU ({e})");
            None
        }
    }
}

// ---- host-side logic: runs everywhere ----

#[test]
fn plans_cover_every_channel_once_in_groups_under_budget() {
    let shapes: [(usize, usize, usize); 9] = [
        (16, 256, 3136),   // NCHW 16x256x56x56
        (50176, 256, 1),   // NHWC 16x56x56x256
        (1, 1, 7),         // one channel
        (7, 3, 1),         // C = 3, channels last
        (2, 5, 9),         // inner not a multiple of the vector
        (1, 1, 1),         // M = 1
        (802_816, 256, 1), // NHWC 256x56x56x256
        (3, 70_000, 2),    // more channels than a grid's y dimension
        (100, 36, 1),      // C a multiple of 4, not of 8
    ];
    for &(outer, c, inner) in &shapes {
        for elem in [4usize, 2] {
            for budget in [Some(16usize << 20), Some(1 << 10), None] {
                let p = launch::plan(outer, c, inner, elem, 2, budget);
                let what = format!("{outer}x{c}x{inner} elem {elem} budget {budget:?}");
                let mut next = 0;
                for g in &p.groups {
                    assert_eq!(g.first_channel, next, "{what}: groups in order");
                    assert!(g.channels > 0);
                    next += g.channels;
                    assert!(g.grid.1 as u64 <= 65535, "{what}");
                    assert_eq!(g.geo.chunks, p.chunks, "{what}: uniform chunks");
                    assert_eq!(g.grid.0 as u64, p.chunks);
                    let (tx, ty) = (p.block.0 as u64, p.block.1 as u64);
                    assert_eq!(tx * ty, launch::THREADS as u64, "{what}");
                    // The chunks cover the reduced axis.
                    let per_chunk = match p.traversal {
                        Traversal::ChannelsFirst => {
                            launch::THREADS as u64 * launch::UNROLL * g.geo.iters * p.vector as u64
                        }
                        Traversal::ChannelsLast => ty * launch::RK * g.geo.iters,
                    };
                    let reduced = match p.traversal {
                        Traversal::ChannelsFirst => (outer * inner) as u64,
                        Traversal::ChannelsLast => outer as u64,
                    };
                    assert!(p.chunks * per_chunk >= reduced, "{what}");
                    assert!(
                        (p.chunks - 1) * per_chunk < reduced,
                        "{what}: no empty chunk"
                    );
                    if p.traversal == Traversal::ChannelsLast {
                        assert!(g.grid.1 as u64 * tx >= g.geo.width, "{what}");
                    }
                }
                assert_eq!(next, c, "{what}: every channel once");
                let run = if p.traversal == Traversal::ChannelsFirst {
                    inner
                } else {
                    c
                };
                assert_eq!(run % p.vector, 0, "{what}");
                assert!(p.vector == 1 || p.vector * elem == 16, "{what}");
                if p.traversal == Traversal::ChannelsLast {
                    assert_eq!(p.groups.len(), 1, "{what}: channels-last is one group");
                }
                if let (Some(b), true) = (budget, p.groups.len() > 1) {
                    // Channels-first: a group reads at most the budget, or one channel if
                    // larger.
                    let per = outer * inner * elem * 2;
                    let width = p.groups[0].geo.width as usize;
                    assert!(width == 1 || width * per <= b, "{what}");
                }
            }
        }
    }
    // Layout mapping: NHWC-like geometries go channels-last, NCHW-like channels-first.
    let nhwc = Problem::new(DataFormat::Nhwc, &[2, 3, 3, 8]).unwrap();
    let nchw = Problem::new(DataFormat::Nchw, &[2, 8, 3, 3]).unwrap();
    let ncdhw = Problem::new(DataFormat::Ncdhw, &[2, 8, 3, 3, 2]).unwrap();
    assert_eq!(
        launch::plan(18, 8, 1, 4, 1, None).traversal,
        Traversal::ChannelsLast
    );
    assert_eq!(nhwc.channels(), 8);
    assert_eq!(nchw.elements_per_channel(), 18);
    assert_eq!(ncdhw.elements_per_channel(), 36);
    assert_eq!(
        launch::plan(2, 8, 18, 4, 1, None).traversal,
        Traversal::ChannelsFirst
    );
}

#[test]
fn the_kernel_source_defines_every_kernel() {
    for name in cuda::KERNELS {
        assert!(
            cuda::SOURCE.contains(&format!(" {name}(")),
            "kernels.cu lacks {name}"
        );
    }
    assert!(cuda::compile_options(DType::F64, 9, 0).is_err());
    let o = cuda::compile_options(DType::BF16, 9, 0).unwrap();
    assert!(o.contains(&"--gpu-architecture=compute_90".to_string()));
    assert!(o.contains(&"-DFBN_DTYPE=2".to_string()));
}

#[test]
fn nvrtc_compiles_the_kernels_for_each_dtype() {
    if !cuda::nvrtc_present() {
        eprintln!("nvrtc_compiles_the_kernels_for_each_dtype: skipped, libnvrtc not found");
        return;
    }
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let ptx = cuda::compile(dtype, 9, 0).unwrap_or_else(|e| panic!("{dtype}: {e}"));
        for name in cuda::KERNELS {
            assert!(ptx.contains(&format!(".entry {name}(")), "{dtype}: {name}");
        }
    }
}

#[test]
fn without_a_device_gpu_new_is_an_error_not_a_panic() {
    match Gpu::new(0) {
        Ok(g) => eprintln!("a GPU is present: {g:?}"),
        Err(e) => assert!(e.to_string().starts_with("CUDA: "), "{e}"),
    }
}

// ---- on the GPU ----

/// Runs `case` on the GPU through the op layer and checks every output against the f64
/// reference; returns the worst error in units of the tolerance.
fn check_case(gpu: &Gpu, case: &Case) -> f64 {
    let inputs = case.inputs().unwrap();
    let out = case
        .op
        .run_on(
            &case.named(&inputs),
            &case.attrs,
            &Backend::Cuda(gpu.clone()),
        )
        .unwrap_or_else(|e| panic!("{case}: {e}"));
    let want = reference(case.op, &case.named(&inputs), &case.attrs, None).unwrap();
    let report = check(&want, &out).unwrap_or_else(|e| panic!("{case}: {e}"));
    report.worst()
}

fn logical_shapes() -> Vec<Vec<usize>> {
    vec![
        vec![2, 5, 7, 3],   // C = 3: no vector in NHWC
        vec![1, 1, 1, 1],   // M = 1, C = 1
        vec![3, 4, 5, 1],   // C = 1
        vec![1, 1, 1, 8],   // M = 1
        vec![2, 3, 5, 64],  // odd spatial size: NCHW tails
        vec![4, 8, 8, 32],  // vectorized both ways
        vec![2, 8, 8, 36],  // C multiple of 4 but not 8
        vec![3, 17, 19, 5], // nothing divides
    ]
}

#[test]
fn every_op_layout_dtype_and_mode_matches_the_reference() {
    let Some(gpu) = gpu("every_op_layout_dtype_and_mode_matches_the_reference") else {
        return;
    };
    let mut n = 0;
    let mut worst = 0f64;
    for op in [
        Op::FusedBatchNormV3,
        Op::FusedBatchNormGradV3,
        Op::FusedBatchNormEx,
        Op::FusedBatchNormGradEx,
    ] {
        for format in [DataFormat::Nhwc, DataFormat::Nchw] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                for training in [true, false] {
                    for shape in logical_shapes() {
                        let mut variants = vec![Case::new(op, format, &shape, dtype).unwrap()];
                        if op == Op::FusedBatchNormEx {
                            variants = vec![
                                variants[0].clone().ex(true, true),
                                variants[0].clone().ex(false, true),
                            ];
                            if !training {
                                variants.push(variants[0].clone().ex(true, false));
                            }
                        } else if op == Op::FusedBatchNormGradEx {
                            variants = vec![
                                variants[0].clone().ex(false, true),
                                variants[0].clone().ex(false, false),
                            ];
                        } else if op == Op::FusedBatchNormV3 && training {
                            variants.push(variants[0].clone().factor(0.25));
                        }
                        for case in variants {
                            let case = case.training(training);
                            worst = worst.max(check_case(&gpu, &case));
                            n += 1;
                        }
                    }
                }
            }
        }
    }
    eprintln!(
        "{n} cases on {}, worst error {worst:.3} of tolerance",
        gpu.name()
    );
}

#[test]
fn five_d_formats_large_m_and_offset_data_match_the_reference() {
    let Some(gpu) = gpu("five_d_formats_large_m_and_offset_data_match_the_reference") else {
        return;
    };
    let mut cases = Vec::new();
    for format in [DataFormat::Ndhwc, DataFormat::Ncdhw] {
        for op in [Op::FusedBatchNormV3, Op::FusedBatchNormGradV3] {
            for dtype in [DType::F32, DType::BF16] {
                cases.push(Case::new(op, format, &[2, 3, 5, 7, 12], dtype).unwrap());
            }
        }
    }
    // Large M (2^20 elements per channel), both layouts, both directions.
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        for op in [Op::FusedBatchNormV3, Op::FusedBatchNormGradV3] {
            for dtype in [DType::F32, DType::F16] {
                cases.push(Case::new(op, format, &[16, 256, 256, 4], dtype).unwrap());
            }
        }
        // |mean| / std = 1e4 (SPEC §7): shifted sums keep the variance.
        cases.push(
            Case::new(Op::FusedBatchNormV3, format, &[4, 500, 500, 2], DType::F32)
                .unwrap()
                .fill(Fill::Random {
                    mean: 1e4,
                    std: 1.0,
                }),
        );
        cases.push(
            Case::new(
                Op::FusedBatchNormGradV3,
                format,
                &[8, 64, 64, 8],
                DType::F32,
            )
            .unwrap()
            .fill(Fill::Constant { dy: 0.1 }),
        );
    }
    for case in &cases {
        for training in [true, false] {
            let c = case.clone().training(training);
            let w = check_case(&gpu, &c);
            eprintln!("{c}: worst {w:.3}");
        }
    }
}

#[test]
fn reruns_are_bit_identical() {
    let Some(gpu) = gpu("reruns_are_bit_identical") else {
        return;
    };
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        for op in [Op::FusedBatchNormV3, Op::FusedBatchNormGradV3] {
            for dtype in [DType::F32, DType::BF16] {
                let case = Case::new(op, format, &[8, 56, 56, 64], dtype).unwrap();
                let inputs = case.inputs().unwrap();
                let run = || {
                    case.op
                        .run_on(
                            &case.named(&inputs),
                            &case.attrs,
                            &Backend::Cuda(gpu.clone()),
                        )
                        .unwrap()
                };
                let first = run();
                for _ in 0..3 {
                    assert_eq!(first, run(), "{case}");
                }
            }
        }
    }
}

#[test]
fn empty_tensors_follow_spec_5() {
    let Some(gpu) = gpu("empty_tensors_follow_spec_5") else {
        return;
    };
    for op in [
        Op::FusedBatchNormV3,
        Op::FusedBatchNormGradV3,
        Op::FusedBatchNormEx,
        Op::FusedBatchNormGradEx,
    ] {
        for training in [true, false] {
            let case = Case::new(op, DataFormat::Nhwc, &[0, 4, 4, 3], DType::F32)
                .unwrap()
                .training(training);
            let inputs = case.inputs().unwrap();
            let cpu = case.op.run(&case.named(&inputs), &case.attrs).unwrap();
            let gpu_out = case
                .op
                .run_on(
                    &case.named(&inputs),
                    &case.attrs,
                    &Backend::Cuda(gpu.clone()),
                )
                .unwrap();
            for (name, t) in cpu.iter() {
                let g = gpu_out.get(name).unwrap();
                assert_eq!(t.shape(), g.shape(), "{case} {name}");
                let (a, b) = (t.to_f64_vec(), g.to_f64_vec());
                for (x, y) in a.iter().zip(&b) {
                    assert!(
                        x == y || (x.is_nan() && y.is_nan()),
                        "{case} {name}: {x} vs {y}"
                    );
                }
            }
        }
    }
}

#[test]
fn validation_is_the_cpu_ops_own() {
    let Some(gpu) = gpu("validation_is_the_cpu_ops_own") else {
        return;
    };
    let p = Problem::new(DataFormat::Nhwc, &[1, 2, 2, 3]).unwrap();
    let x = vec![1.0f32; 12];
    let (scale, offset) = ([1.0f32; 3], [0.0f32; 2]); // offset too short
    let run = |on_gpu: bool| {
        let (mut y, mut m, mut v) = (vec![0.0f32; 12], vec![0.0f32; 3], vec![0.0f32; 3]);
        let mode = Forward::Training(TrainingStats {
            saved: SavedStats {
                mean: &mut m,
                variance: &mut v,
            },
            running: None,
        });
        let affine = Affine {
            scale: &scale,
            offset: &offset,
        };
        let r = if on_gpu {
            gpu.forward(&p, &x, affine, mode, Epilogue::plain(), &mut y)
        } else {
            p.forward(&x, affine, mode, Epilogue::plain(), &mut y)
        };
        (r, y)
    };
    let (cpu, _) = run(false);
    let (on_gpu, y) = run(true);
    assert!(cpu.is_err());
    assert_eq!(cpu, on_gpu);
    assert!(y.iter().all(|&v| v == 0.0), "nothing written on error");
    // f64 data is refused with an error, not run.
    let p64 = Problem::new(DataFormat::Nhwc, &[1, 1, 2, 1]).unwrap();
    let mut y64 = [0.0f64; 2];
    let (mut m, mut v) = ([0.0f64], [0.0f64]);
    let mode = Forward::Training(TrainingStats {
        saved: SavedStats {
            mean: &mut m,
            variance: &mut v,
        },
        running: None,
    });
    let affine = Affine {
        scale: &[1.0f64],
        offset: &[0.0f64],
    };
    assert!(gpu
        .forward(
            &p64,
            &[1.0f64, 2.0],
            affine,
            mode,
            Epilogue::plain(),
            &mut y64
        )
        .is_err());
}

#[test]
fn tensorflow_fixtures_through_the_gpu() {
    let Some(gpu) = gpu("tensorflow_fixtures_through_the_gpu") else {
        return;
    };
    let backend = Backend::Cuda(gpu);
    let mut failures = Vec::new();
    let mut ran = 0;
    for case in common::cases() {
        if case.op.is_second_order() {
            continue;
        }
        let tensors: Vec<(String, Tensor)> = case
            .inputs
            .iter()
            .map(|(n, p)| (n.clone(), npy::read(p).expect("fixture input reads")))
            .collect();
        if tensors.iter().any(|(_, t)| t.dtype() == DType::F64) {
            continue;
        }
        let mut inputs = Inputs::new();
        for (n, t) in &tensors {
            inputs.insert(n, t);
        }
        let out = match case.op.run_on(&inputs, &case.attrs, &backend) {
            Ok(o) => o,
            Err(e) => {
                failures.push(format!("{}: error {e}", case.name));
                continue;
            }
        };
        ran += 1;
        for (name, path) in &case.expected {
            let want = npy::read(path).expect("fixture output reads");
            let got = out.get(name).expect("op produces every expected output");
            if let Err(e) = common::compare(name, got, &want) {
                failures.push(format!("{}: {e}", case.name));
            }
        }
    }
    eprintln!("{ran} TensorFlow fixtures through the GPU");
    assert!(
        failures.is_empty(),
        "{} fixtures failed on the GPU:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A buffer whose size in bytes overflows `usize` is refused as too large; before,
/// the size wrapped and the buffer was shorter than its length said.
#[test]
fn a_buffer_too_large_to_count_in_bytes_is_refused() {
    let Some(gpu) = gpu("a_buffer_too_large_to_count_in_bytes_is_refused") else {
        return;
    };
    let r = gpu.alloc::<f32>(usize::MAX / 2);
    assert!(
        matches!(r, Err(fusedbn::Error::TooLarge { .. })),
        "{:?}",
        r.map(|b| b.len())
    );
}
