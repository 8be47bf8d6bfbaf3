//! `fusedbn bench --device cuda`: the GPU backend against a device copy of the same
//! bytes, each case first checked against the f64 reference.
//!
//! Per case: the inputs come from the same [`driver::Case`] as the CPU bench; the op runs
//! once through the op layer on the GPU (`Backend::Cuda`) and its outputs are checked
//! against the reference on a sample of channels; then the op on device-resident buffers
//! and a copy kernel (16-byte streaming loads and stores, `Gpu::copy`) moving the same
//! bytes (forward: read x, write y; backward: read dy and x, write dx) alternate, each
//! call timed alone with CUDA events after the L2 is flushed (a 256 MiB memset), so that
//! neither finds its data in cache. `op/copy` is the median of the per-pair ratios.

use std::process::ExitCode;

use fusedbn::cuda::{DeviceBuffer, DeviceForward, DeviceGrad, DeviceGradOut, DeviceMode, Gpu};
use fusedbn::ops::Backend;
use fusedbn::{driver, DType, DataFormat, Element, Problem, Tensor};

use super::{BenchArgs, BenchOp, OpArg};
use crate::error::{CliError, Result};

/// GPU.md's shapes (logical N,H,W,C) and the small one.
const SHAPES: [[usize; 4]; 4] = [
    [16, 56, 56, 256],
    [16, 112, 112, 64],
    [256, 56, 56, 256],
    [2, 8, 8, 32],
];

/// cuDNN 9.19 through PyTorch 2.11 on one H100 (GPU.md): kernel time ÷ device copy.
fn cudnn(op: BenchOp, format: DataFormat, shape: &[usize], dtype: DType) -> Option<f64> {
    let row: [f64; 7] = match (op, format) {
        (BenchOp::ForwardTraining, DataFormat::Nchw) => [1.74, 4.53, 1.49, 3.37, 9.57, 1.80, 4.72],
        (BenchOp::ForwardTraining, DataFormat::Nhwc) => [2.15, 4.11, 1.92, 1.53, 4.34, 1.63, 3.40],
        (BenchOp::ForwardInference, DataFormat::Nchw) => [1.25, 2.41, 1.96, 1.28, 2.12, 1.21, 1.94],
        (BenchOp::ForwardInference, DataFormat::Nhwc) => [2.04, 1.84, 3.87, 2.04, 2.23, 1.27, 1.39],
        (BenchOp::BackwardTraining, DataFormat::Nchw) => {
            [2.15, 4.37, 3.35, 5.82, 13.65, 2.20, 4.57]
        }
        (BenchOp::BackwardTraining, DataFormat::Nhwc) => [1.66, 2.61, 2.09, 1.64, 2.78, 1.74, 2.06],
        _ => return None,
    };
    let col = match (shape, dtype) {
        ([16, 56, 56, 256], DType::F32) => 0,
        ([16, 56, 56, 256], DType::BF16) => 1,
        ([16, 56, 56, 256], DType::F16) => 2,
        ([16, 112, 112, 64], DType::F32) => 3,
        ([16, 112, 112, 64], DType::BF16) => 4,
        ([256, 56, 56, 256], DType::F32) => 5,
        ([256, 56, 56, 256], DType::BF16) => 6,
        _ => return None,
    };
    Some(row[col])
}

fn err(e: impl std::fmt::Display) -> CliError {
    CliError::new(format!("bench --device cuda: {e}"))
}

/// The timed pairs of one case: (op µs, copy µs) per pair.
type Pairs = Vec<(f64, f64)>;

pub fn bench(args: &BenchArgs) -> Result<ExitCode> {
    let gpu = Gpu::new(0).map_err(err)?;
    let ops: Vec<BenchOp> = if args.ops.is_empty() {
        vec![
            BenchOp::ForwardTraining,
            BenchOp::ForwardInference,
            BenchOp::BackwardTraining,
            BenchOp::BackwardInference,
        ]
    } else {
        let mut v = Vec::new();
        for o in &args.ops {
            match o {
                OpArg::Op(op) if !op.is_second_order() => v.push(*op),
                OpArg::Op(op) => {
                    return Err(err(format!("{} runs on the CPU only", op.name())));
                }
                OpArg::All => v.extend(BenchOp::ALL.into_iter().filter(|op| !op.is_second_order())),
            }
        }
        v
    };
    let formats = if args.formats.is_empty() {
        vec![DataFormat::Nchw, DataFormat::Nhwc]
    } else {
        args.formats.clone()
    };
    let dtypes: Vec<DType> = if args.dtypes.is_empty() {
        vec![DType::F32, DType::F16, DType::BF16]
    } else {
        args.dtypes.iter().map(|d| d.dtype()).collect()
    };
    let shapes: Vec<Vec<usize>> = if args.shapes.is_empty() {
        SHAPES.iter().map(|s| s.to_vec()).collect()
    } else {
        args.shapes.iter().map(|s| s.0.clone()).collect()
    };
    let runs = args.runs as usize;
    println!(
        "# {} ({} SMs, {} MB L2, sm_{}{}), {}; each call timed alone after an L2 flush; median of {runs} pairs",
        gpu.name(),
        gpu.multiprocessors(),
        gpu.l2_bytes() >> 20,
        gpu.capability().0,
        gpu.capability().1,
        gpu.group_bytes()
            .map_or("one channel group".to_string(), |b| format!("channel groups of {} MiB", b >> 20)),
    );
    println!(
        "{:<19} {:<6} {:<17} {:<5} {:>10} {:>10} {:>8} {:>8} {:>7} {:>7}  check",
        "op", "format", "shape", "dtype", "op µs", "copy µs", "GB/s", "op/copy", "cuDNN", "ahead"
    );
    let mut flush = gpu.alloc::<f32>(64 << 20).map_err(err)?; // 256 MiB
    let mut failed = 0;
    let mut cases = 0;
    for shape in &shapes {
        for &dtype in &dtypes {
            for &format in &formats {
                for &op in &ops {
                    let logical = super::logical_for(&super::LogicalShape(shape.clone()), format)?;
                    let case = op.driver_case(format, &logical, dtype).map_err(err)?;
                    cases += 1;
                    let inputs = case.inputs().map_err(err)?;
                    let check = check(&gpu, &case, &inputs);
                    let pairs = match dtype {
                        DType::F32 => time::<f32>(&gpu, op, &case, &inputs, runs, &mut flush),
                        DType::F16 => {
                            time::<fusedbn::f16>(&gpu, op, &case, &inputs, runs, &mut flush)
                        }
                        DType::BF16 => {
                            time::<fusedbn::bf16>(&gpu, op, &case, &inputs, runs, &mut flush)
                        }
                        DType::F64 => Err(err("f64 does not run on the GPU")),
                    }?;
                    let median = |mut v: Vec<f64>| {
                        v.sort_by(f64::total_cmp);
                        v[v.len() / 2]
                    };
                    let op_us = median(pairs.iter().map(|p| p.0).collect());
                    let copy_us = median(pairs.iter().map(|p| p.1).collect());
                    let ratio = median(pairs.iter().map(|p| p.0 / p.1).collect());
                    let bytes = case.bytes() as f64;
                    let anchor = cudnn(op, format, shape, dtype);
                    let (anchor_s, ahead) = match anchor {
                        Some(a) => (format!("{a:.2}"), if ratio < a { "yes" } else { "NO" }),
                        None => ("-".into(), "-"),
                    };
                    let check_s = match &check {
                        Ok(w) => format!("ok ({w:.2} of tol)"),
                        Err(e) => {
                            failed += 1;
                            format!("FAILED: {e}")
                        }
                    };
                    println!(
                        "{:<19} {:<6} {:<17} {:<5} {:>10.1} {:>10.1} {:>8.0} {:>8.3} {:>7} {:>7}  {}",
                        op.name(),
                        format.as_str(),
                        shape
                            .iter()
                            .map(|d| d.to_string())
                            .collect::<Vec<_>>()
                            .join("x"),
                        dtype.to_string(),
                        op_us,
                        copy_us,
                        bytes / op_us / 1e3,
                        ratio,
                        anchor_s,
                        ahead,
                        check_s
                    );
                }
            }
        }
    }
    eprintln!("fusedbn bench --device cuda: {cases} cases, {failed} checks failed");
    Ok(if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Runs the op layer on the GPU and checks against the reference on up to 8 channels.
fn check(
    gpu: &Gpu,
    case: &driver::Case,
    inputs: &[(&'static str, Tensor)],
) -> std::result::Result<f64, String> {
    let named = case.named(inputs);
    let out = case
        .op
        .run_on(&named, &case.attrs, &Backend::Cuda(gpu.clone()))
        .map_err(|e| e.to_string())?;
    let c = case.problem().map_err(|e| e.to_string())?.channels();
    let mut sample: Vec<usize> = (0..8).map(|i| i * (c - 1) / 7).collect();
    sample.dedup();
    let want = driver::reference(case.op, &named, &case.attrs, Some(&sample))
        .map_err(|e| e.to_string())?;
    let report = driver::check(&want, &out).map_err(|e| e.to_string())?;
    Ok(report.worst())
}

fn up<T: Element>(
    gpu: &Gpu,
    inputs: &[(&'static str, Tensor)],
    name: &str,
) -> Result<DeviceBuffer<T>> {
    let t = inputs
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| t)
        .ok_or_else(|| err(format!("no input {name}")))?;
    let s = t
        .as_slice::<T>()
        .ok_or_else(|| err(format!("{name} is not {}", T::DTYPE)))?;
    gpu.upload(s).map_err(err)
}

/// Times `runs` op/copy pairs, each call alone after an L2 flush.
fn time<T: Element>(
    gpu: &Gpu,
    op: BenchOp,
    case: &driver::Case,
    inputs: &[(&'static str, Tensor)],
    runs: usize,
    flush: &mut DeviceBuffer<f32>,
) -> Result<Pairs> {
    let p: Problem = case.problem().map_err(err)?;
    let (n, c) = (p.len(), p.channels());
    let f = |name: &str| up::<f32>(gpu, inputs, name);
    let scale = f("scale")?;
    let mut run: Box<dyn FnMut() -> fusedbn::Result<()>> = match op {
        BenchOp::ForwardTraining | BenchOp::ForwardInference | BenchOp::ForwardTrainingEx => {
            let x = up::<T>(gpu, inputs, "x")?;
            let side = if op == BenchOp::ForwardTrainingEx {
                Some(up::<T>(gpu, inputs, "side_input")?)
            } else {
                None
            };
            let offset = f("offset")?;
            let (mean, var) = if op == BenchOp::ForwardInference {
                (f("mean")?, f("variance")?)
            } else {
                (
                    gpu.alloc::<f32>(c).map_err(err)?,
                    gpu.alloc::<f32>(c).map_err(err)?,
                )
            };
            let mut y = gpu.alloc::<T>(n).map_err(err)?;
            let (mut sm, mut sv) = (
                gpu.alloc::<f32>(c).map_err(err)?,
                gpu.alloc::<f32>(c).map_err(err)?,
            );
            let (mut rm, mut rv) = (
                gpu.alloc::<f32>(c).map_err(err)?,
                gpu.alloc::<f32>(c).map_err(err)?,
            );
            let training = op != BenchOp::ForwardInference;
            let relu = op == BenchOp::ForwardTrainingEx;
            let (gpu, p) = (gpu.clone(), p.clone());
            Box::new(move || {
                let fw = DeviceForward {
                    x: &x,
                    scale: &scale,
                    offset: &offset,
                    side_input: side.as_ref(),
                    relu,
                };
                let mode = if training {
                    DeviceMode::Training {
                        saved_mean: &mut sm,
                        saved_variance: &mut sv,
                        running: Some((&mut rm, &mut rv)),
                        factor: 1.0,
                    }
                } else {
                    DeviceMode::Inference {
                        mean: &mean,
                        variance: &var,
                    }
                };
                gpu.forward_device(&p, fw, mode, &mut y)
            })
        }
        _ => {
            let dy = up::<T>(gpu, inputs, "y_backprop")?;
            let x = up::<T>(gpu, inputs, "x")?;
            let mask = if op == BenchOp::BackwardTrainingEx {
                Some(up::<T>(gpu, inputs, "y")?)
            } else {
                None
            };
            let (mean, var) = (f("reserve_space_1")?, f("reserve_space_2")?);
            let mut dx = gpu.alloc::<T>(n).map_err(err)?;
            let mut sg = if op == BenchOp::BackwardTrainingEx {
                Some(gpu.alloc::<T>(n).map_err(err)?)
            } else {
                None
            };
            let (mut ds, mut dof) = (
                gpu.alloc::<f32>(c).map_err(err)?,
                gpu.alloc::<f32>(c).map_err(err)?,
            );
            let training = op != BenchOp::BackwardInference;
            let (gpu, p) = (gpu.clone(), p.clone());
            Box::new(move || {
                gpu.backward_device(
                    &p,
                    DeviceGrad {
                        y_backprop: &dy,
                        x: &x,
                        scale: &scale,
                        mean: &mean,
                        variance: &var,
                        training,
                        relu_output: mask.as_ref(),
                    },
                    DeviceGradOut {
                        x: &mut dx,
                        scale: &mut ds,
                        offset: &mut dof,
                        side_input: sg.as_mut(),
                    },
                )
            })
        }
    };
    // The copy baseline: half the op's bytes read, half written.
    let half = (case.bytes() / 2).div_ceil(16) * 4;
    let src = gpu.upload(&vec![1f32; half]).map_err(err)?;
    let mut dst = gpu.alloc::<f32>(half).map_err(err)?;
    let mut timed = |what: &mut dyn FnMut() -> fusedbn::Result<()>| -> Result<f64> {
        gpu.zero(flush).map_err(err)?;
        gpu.time_us(what).map_err(err)
    };
    let mut copy = || gpu.copy(&src, &mut dst);
    for _ in 0..3 {
        timed(&mut *run)?;
        timed(&mut copy)?;
    }
    let mut pairs = Vec::with_capacity(runs);
    for i in 0..runs {
        let (o, c) = if i % 2 == 0 {
            let o = timed(&mut *run)?;
            (o, timed(&mut copy)?)
        } else {
            let c = timed(&mut copy)?;
            (timed(&mut *run)?, c)
        };
        pairs.push((o, c));
    }
    Ok(pairs)
}
