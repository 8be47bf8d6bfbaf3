//! `fusedbn bench`: times the typed layer ([`Problem`]'s methods, preallocated
//! outputs) against a plain parallel copy of the same bytes.
//!
//! Structure, so that later work can add statistics, ISAs or other baselines without
//! touching the rest:
//! - [`BenchArgs`] → a list of [`Case`]s ([`cases`]);
//! - per case, a [`Workload`] owns every buffer (allocated once, outside the timed loop)
//!   and knows how to run the op ([`Workload::run_op`]), the baseline
//!   ([`Workload::run_copy`]) and the correctness check ([`Workload::check`]);
//! - [`measure`] interleaves timed op and copy runs and returns a [`Measurement`];
//! - [`Report`] prints it as a table row or a JSON line.

use std::fmt::Write as _;
use std::hint::black_box;
use std::io::{IsTerminal, Write as _};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use fusedbn::batch_norm::{Gradients, RunningStats, SavedStats};
use fusedbn::kernels::{PARALLEL_MIN, TASK};
use fusedbn::{reference, DType, DataFormat, Element, Problem, Real};
use rayon::prelude::*;

use crate::error::{CliError, Result};

/// ResNet-50's batch-norm inputs as (H, W, C).
const RESNET50: [(usize, usize, usize); 9] = [
    (112, 112, 64),
    (56, 56, 64),
    (56, 56, 256),
    (28, 28, 128),
    (28, 28, 512),
    (14, 14, 256),
    (14, 14, 1024),
    (7, 7, 512),
    (7, 7, 2048),
];
/// Batch size of the built-in shapes (and with `--quick`).
const BATCH: usize = 16;
const QUICK_BATCH: usize = 2;

/// Arguments of `fusedbn bench`.
#[derive(Debug, Args)]
#[command(after_help = bench_help())]
pub struct BenchArgs {
    /// Op to time (repeatable) [default: forward_training, forward_inference, backward_training]
    #[arg(long = "op", value_enum, value_name = "OP")]
    pub ops: Vec<BenchOp>,

    /// Data format (repeatable) [default: NHWC and NCHW; NDHWC and NCDHW for 5-number shapes]
    #[arg(long = "format", value_name = "FORMAT", value_parser = parse_format)]
    pub formats: Vec<DataFormat>,

    /// Element type of x, y, dy and dx
    #[arg(long, value_enum, default_value_t = BenchDtype::F32)]
    pub dtype: BenchDtype,

    /// Logical shape N,H,W,C (or N,D,H,W,C), laid out per format; replaces the built-in
    /// list (repeatable). A 4-number shape runs in 5-D formats with D = 1.
    #[arg(long = "shape", value_name = "N,H,W,C", value_parser = parse_shape)]
    pub shapes: Vec<LogicalShape>,

    /// Timed runs per case (the median is reported)
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub runs: u32,

    /// Size of the thread pool [default: rayon's default]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: Option<u32>,

    /// Built-in shapes with N = 2 instead of 16 (a fast smoke run)
    #[arg(long)]
    pub quick: bool,

    /// One JSON object per line instead of the table
    #[arg(long)]
    pub json: bool,
}

/// The text after `fusedbn bench --help`'s options.
fn bench_help() -> String {
    let shapes: Vec<String> = RESNET50
        .iter()
        .map(|(h, w, c)| format!("{h}x{w}x{c}"))
        .collect();
    format!(
        "Without --shape: ResNet-50's batch-norm shapes, N = {BATCH} ({QUICK_BATCH} with --quick) and\n\
         (H,W,C) = {}.\n\
         Each case runs once untimed and is checked against the f64 reference on up to 4 channels,\n\
         then --runs times, alternating the op with a parallel copy of the same bytes (forward:\n\
         y <- x; backward: dx <- dy plus a summed read of x). The table reports medians; GB/s counts\n\
         the bytes the op must move (forward: read x + write y; backward: read dy and x + write dx).\n\
         Exits with status 1 if any check fails.",
        shapes.join(", ")
    )
}

/// The passes the benchmark can time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum BenchOp {
    /// `Problem::forward_training` (batch statistics, running statistics with factor 1).
    ForwardTraining,
    /// `Problem::forward_inference`.
    ForwardInference,
    /// `Problem::backward_training`.
    BackwardTraining,
    /// `Problem::backward_inference`.
    BackwardInference,
}

impl BenchOp {
    const DEFAULT: [BenchOp; 3] = [
        BenchOp::ForwardTraining,
        BenchOp::ForwardInference,
        BenchOp::BackwardTraining,
    ];

    fn name(self) -> &'static str {
        match self {
            BenchOp::ForwardTraining => "forward_training",
            BenchOp::ForwardInference => "forward_inference",
            BenchOp::BackwardTraining => "backward_training",
            BenchOp::BackwardInference => "backward_inference",
        }
    }

    fn is_backward(self) -> bool {
        matches!(self, BenchOp::BackwardTraining | BenchOp::BackwardInference)
    }

    /// Tensors of x's size the op reads and writes: forward x → y, backward dy, x → dx.
    fn tensors_moved(self) -> usize {
        if self.is_backward() {
            3
        } else {
            2
        }
    }
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchDtype {
    F32,
    F16,
    Bf16,
    F64,
}

impl BenchDtype {
    fn dtype(self) -> DType {
        match self {
            BenchDtype::F32 => DType::F32,
            BenchDtype::F16 => DType::F16,
            BenchDtype::Bf16 => DType::BF16,
            BenchDtype::F64 => DType::F64,
        }
    }
}

/// `--shape`: logical N,H,W,C or N,D,H,W,C.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogicalShape(Vec<usize>);

fn parse_shape(s: &str) -> Result<LogicalShape, String> {
    let dims = s
        .split(',')
        .map(|d| match d.trim().parse::<usize>() {
            Ok(0) => Err(format!("dimension {d:?} must be at least 1")),
            Ok(v) => Ok(v),
            Err(_) => Err(format!("{d:?} is not a positive integer")),
        })
        .collect::<Result<Vec<usize>, String>>()?;
    if dims.len() != 4 && dims.len() != 5 {
        return Err("expected N,H,W,C or N,D,H,W,C".into());
    }
    if dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .is_none()
    {
        return Err("too many elements".into());
    }
    Ok(LogicalShape(dims))
}

fn parse_format(s: &str) -> Result<DataFormat, String> {
    s.to_ascii_uppercase()
        .parse()
        .map_err(|e: fusedbn::Error| e.to_string())
}

/// The shape of `x` in `format`'s own axis order.
fn layout(logical: &LogicalShape, format: DataFormat) -> Result<Vec<usize>> {
    let (n, d, h, w, c) = match logical.0[..] {
        [n, h, w, c] => (n, None, h, w, c),
        [n, d, h, w, c] => (n, Some(d), h, w, c),
        _ => return Err(CliError::new("a shape has 4 or 5 dimensions")),
    };
    Ok(match (format, d) {
        (DataFormat::Nhwc, None) => vec![n, h, w, c],
        (DataFormat::Nchw, None) => vec![n, c, h, w],
        (DataFormat::Ndhwc, d) => vec![n, d.unwrap_or(1), h, w, c],
        (DataFormat::Ncdhw, d) => vec![n, c, d.unwrap_or(1), h, w],
        (DataFormat::Nhwc | DataFormat::Nchw, Some(_)) => {
            let dims: Vec<String> = logical.0.iter().map(|d| d.to_string()).collect();
            return Err(CliError::new(format!(
                "--shape {} has 5 dimensions (N,D,H,W,C): it needs a 5-D --format (NDHWC or NCDHW), not {format}",
                dims.join(",")
            )));
        }
    })
}

/// One benchmark case.
#[derive(Clone, Debug)]
pub struct Case {
    pub op: BenchOp,
    pub format: DataFormat,
    /// The shape of x, in the format's axis order.
    pub shape: Vec<usize>,
}

impl Case {
    fn shape_str(&self) -> String {
        let dims: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        dims.join("x")
    }

    fn label(&self) -> String {
        format!("{} {} {}", self.op.name(), self.format, self.shape_str())
    }
}

/// The cases `args` asks for: shapes, then formats, then ops.
fn cases(args: &BenchArgs) -> Result<Vec<Case>> {
    let shapes: Vec<LogicalShape> = if args.shapes.is_empty() {
        let n = if args.quick { QUICK_BATCH } else { BATCH };
        RESNET50
            .iter()
            .map(|&(h, w, c)| LogicalShape(vec![n, h, w, c]))
            .collect()
    } else {
        args.shapes.clone()
    };
    let ops: Vec<BenchOp> = if args.ops.is_empty() {
        BenchOp::DEFAULT.to_vec()
    } else {
        dedup(&args.ops)
    };
    let mut out = Vec::new();
    for logical in &shapes {
        let formats = if !args.formats.is_empty() {
            dedup(&args.formats)
        } else if logical.0.len() == 5 {
            vec![DataFormat::Ndhwc, DataFormat::Ncdhw]
        } else {
            vec![DataFormat::Nhwc, DataFormat::Nchw]
        };
        for format in formats {
            let shape = layout(logical, format)?;
            for &op in &ops {
                out.push(Case {
                    op,
                    format,
                    shape: shape.clone(),
                });
            }
        }
    }
    Ok(out)
}

fn dedup<T: PartialEq + Copy>(v: &[T]) -> Vec<T> {
    let mut out = Vec::new();
    for &x in v {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

/// Runs `fusedbn bench`.
pub fn bench(args: &BenchArgs) -> Result<ExitCode> {
    let cases = cases(args)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads.map_or(0, |t| t as usize))
        .build()
        .map_err(|e| CliError::new(format!("could not start the thread pool: {e}")))?;
    let report = Report {
        dtype: args.dtype.dtype(),
        threads: pool.current_num_threads(),
        runs: args.runs as usize,
        json: args.json,
        shape_width: cases
            .iter()
            .map(|c| c.shape_str().len())
            .max()
            .unwrap_or(5)
            .max(5),
    };
    let progress = Progress::new(cases.len());
    let start = Instant::now();
    report.header();
    let mut failed = 0;
    for (i, case) in cases.iter().enumerate() {
        progress.show(i, case);
        let m = pool.install(|| match report.dtype {
            DType::F32 => measure::<f32>(case, report.runs),
            DType::F16 => measure::<fusedbn::f16>(case, report.runs),
            DType::BF16 => measure::<fusedbn::bf16>(case, report.runs),
            DType::F64 => measure::<f64>(case, report.runs),
        })?;
        progress.clear();
        if let Err(msg) = &m.check {
            failed += 1;
            eprintln!("fusedbn: bench: check FAILED: {}: {msg}", case.label());
        }
        report.row(case, &m);
    }
    progress.clear();
    eprintln!(
        "fusedbn bench: {} cases in {:.1} s (threads {})",
        cases.len(),
        start.elapsed().as_secs_f64(),
        report.threads
    );
    if failed > 0 {
        eprintln!(
            "fusedbn bench: {failed} of {} checks against the reference failed",
            cases.len()
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// The results of one case.
#[derive(Clone, Debug)]
pub struct Measurement {
    /// Op run times, in run order.
    pub op: Vec<Duration>,
    /// Copy-baseline run times, in run order (interleaved with `op`).
    pub copy: Vec<Duration>,
    /// Bytes the op reads and writes.
    pub bytes: usize,
    /// The warm-up run against the reference: `Err` holds the first mismatch.
    pub check: Result<(), String>,
}

impl Measurement {
    fn median_ms(&self) -> f64 {
        median_ms(&self.op)
    }

    fn copy_ms(&self) -> f64 {
        median_ms(&self.copy)
    }

    fn gbps(&self) -> f64 {
        self.bytes as f64 / (self.median_ms() * 1e-3) / 1e9
    }

    fn copy_ratio(&self) -> f64 {
        self.median_ms() / self.copy_ms()
    }
}

fn median_ms(v: &[Duration]) -> f64 {
    let mut ms: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    match ms.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => ms[n / 2],
        n => 0.5 * (ms[n / 2 - 1] + ms[n / 2]),
    }
}

/// Sets up one case, runs it once untimed and checks it, then times `runs` runs of the
/// op, each followed by one run of the copy baseline.
fn measure<T: Element>(case: &Case, runs: usize) -> Result<Measurement> {
    let mut w = Workload::<T>::new(case)?;
    w.run_op()?;
    let check = w.check();
    black_box(w.run_copy());
    let (mut op, mut copy) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    for _ in 0..runs {
        let t = Instant::now();
        w.run_op()?;
        black_box(&mut w.out);
        op.push(t.elapsed());
        let t = Instant::now();
        black_box(w.run_copy());
        black_box(&mut w.out);
        copy.push(t.elapsed());
    }
    Ok(Measurement {
        op,
        copy,
        bytes: case.op.tensors_moved() * w.x.len() * T::DTYPE.size(),
        check,
    })
}

/// Every buffer of one case, allocated once.
struct Workload<T: Element> {
    op: BenchOp,
    problem: Problem,
    x: Vec<T>,
    /// `y_backprop` (backward ops only).
    dy: Vec<T>,
    /// `y` (forward) or `x_backprop` (backward).
    out: Vec<T>,
    scale: Vec<T::Stat>,
    offset: Vec<T::Stat>,
    /// Inputs: the population statistics (inference ops) or the batch statistics of x
    /// (backward training, computed once during setup).
    mean: Vec<T::Stat>,
    variance: Vec<T::Stat>,
    /// Per-channel outputs: forward training's saved and running statistics, or the
    /// gradients' scale_backprop and offset_backprop (in `stat_out[0..2]`).
    stat_out: [Vec<T::Stat>; 4],
}

impl<T: Element> Workload<T> {
    fn new(case: &Case) -> Result<Self> {
        let problem = Problem::new(case.format, &case.shape)?;
        let c = problem.channels();
        let channel_of = channel_index(&problem);
        let x = generate(problem.len(), |i| {
            let ch = channel_of(i);
            channel_mean(ch) + channel_std(ch) * noise(1, i)
        });
        let dy = if case.op.is_backward() {
            // Correlated with x and off-centre, so that Σdy and Σdy·(x−μ) are far from 0.
            generate(problem.len(), |i| {
                0.25 + 0.5 * noise(1, i) + 0.5 * noise(2, i)
            })
        } else {
            Vec::new()
        };
        let stat = |f: &dyn Fn(usize) -> f64| -> Vec<T::Stat> {
            (0..c).map(|ch| T::Stat::from_f64(f(ch))).collect()
        };
        let mut w = Workload {
            op: case.op,
            x,
            dy,
            out: vec![T::default(); problem.len()],
            scale: stat(&|ch| 0.5 + 0.25 * (ch % 3) as f64),
            offset: stat(&|ch| 0.1 * ((ch % 4) as f64 - 1.5)),
            mean: stat(&|ch| channel_mean(ch) + 0.1),
            variance: stat(&|ch| 1.1 * channel_std(ch).powi(2)),
            stat_out: std::array::from_fn(|_| vec![T::Stat::ZERO; c]),
            problem,
        };
        if case.op == BenchOp::BackwardTraining {
            // The gradient's reserve spaces: x's own batch statistics.
            let [m, v, rm, rv] = &mut w.stat_out;
            w.problem.forward_training(
                &w.x,
                &w.scale,
                &w.offset,
                &mut w.out,
                SavedStats {
                    mean: m,
                    variance: v,
                },
                Some(RunningStats {
                    mean: rm,
                    variance: rv,
                    factor: 1.0,
                }),
            )?;
            w.mean.copy_from_slice(m);
            w.variance.copy_from_slice(v);
        }
        Ok(w)
    }

    /// One run of the op, through the typed layer, into the preallocated buffers.
    fn run_op(&mut self) -> fusedbn::Result<()> {
        let p = &self.problem;
        let [s0, s1, s2, s3] = &mut self.stat_out;
        match self.op {
            BenchOp::ForwardTraining => p.forward_training(
                &self.x,
                &self.scale,
                &self.offset,
                &mut self.out,
                SavedStats {
                    mean: s0,
                    variance: s1,
                },
                Some(RunningStats {
                    mean: s2,
                    variance: s3,
                    factor: 1.0,
                }),
            ),
            BenchOp::ForwardInference => p.forward_inference(
                &self.x,
                &self.scale,
                &self.offset,
                &self.mean,
                &self.variance,
                &mut self.out,
            ),
            BenchOp::BackwardTraining | BenchOp::BackwardInference => {
                let grads = Gradients {
                    x: &mut self.out,
                    scale: s0,
                    offset: s1,
                };
                if self.op == BenchOp::BackwardTraining {
                    p.backward_training(
                        &self.dy,
                        &self.x,
                        &self.scale,
                        &self.mean,
                        &self.variance,
                        grads,
                    )
                } else {
                    p.backward_inference(
                        &self.dy,
                        &self.x,
                        &self.scale,
                        &self.mean,
                        &self.variance,
                        grads,
                    )
                }
            }
        }
    }

    /// The baseline: moves the same bytes as the op with no arithmetic, on the same
    /// thread pool and with the library's task size. Forward: `y ← x` (read x, write y).
    /// Backward: `dx ← dy`, plus a read of x folded into a checksum (read dy and x,
    /// write dx). Returns the checksum (0 for forward), for `black_box`.
    fn run_copy(&mut self) -> u64 {
        let parallel = self.x.len() >= PARALLEL_MIN && rayon::current_num_threads() > 1;
        let src: &[T] = if self.op.is_backward() {
            &self.dy
        } else {
            &self.x
        };
        let extra: &[T] = if self.op.is_backward() { &self.x } else { &[] };
        let task = |(i, dst): (usize, &mut [T])| -> u64 {
            let lo = i * TASK;
            dst.copy_from_slice(&src[lo..lo + dst.len()]);
            extra
                .get(lo..lo + dst.len())
                .map_or(0, |e| checksum(bytes_of(e)))
        };
        if parallel {
            self.out
                .par_chunks_mut(TASK)
                .enumerate()
                .map(task)
                .reduce(|| 0, u64::wrapping_add)
        } else {
            self.out
                .chunks_mut(TASK)
                .enumerate()
                .map(task)
                .fold(0, u64::wrapping_add)
        }
    }

    /// Checks the last run against [`reference`] on up to 4 channels: each channel's
    /// elements are gathered and run as a 1-channel `[1, 1, M, 1]` NHWC problem.
    fn check(&self) -> Result<(), String> {
        let p = &self.problem;
        let eps = f64::from(p.epsilon());
        let tol_eps = T::DTYPE.epsilon();
        let wide = |v: T| v.widen().to_f64();
        let st = |v: &[T::Stat], c: usize| [v[c].to_f64()];
        for c in sample_channels(p.channels()) {
            let pos = channel_positions(p, c);
            let shape = [1, 1, pos.len(), 1];
            let xc: Vec<f64> = pos.iter().map(|&i| wide(self.x[i])).collect();
            let out: Vec<f64> = pos.iter().map(|&i| wide(self.out[i])).collect();
            let nhwc = DataFormat::Nhwc;
            let [s0, s1, s2, s3] = &self.stat_out;
            let checks: Vec<(&str, Vec<f64>, Vec<f64>)> = match self.op {
                BenchOp::ForwardTraining => {
                    let r = reference::forward_training(
                        nhwc,
                        &shape,
                        &xc,
                        &st(&self.scale, c),
                        &st(&self.offset, c),
                        &[],
                        &[],
                        eps,
                        1.0,
                    );
                    vec![
                        ("y", out, r.y),
                        (
                            "reserve_space_1 (batch mean)",
                            st(s0, c).to_vec(),
                            r.reserve_space_1,
                        ),
                        (
                            "reserve_space_2 (biased variance)",
                            st(s1, c).to_vec(),
                            r.reserve_space_2,
                        ),
                        ("batch_mean", st(s2, c).to_vec(), r.batch_mean),
                        ("batch_variance", st(s3, c).to_vec(), r.batch_variance),
                    ]
                }
                BenchOp::ForwardInference => {
                    let r = reference::forward_inference(
                        nhwc,
                        &shape,
                        &xc,
                        &st(&self.scale, c),
                        &st(&self.offset, c),
                        &st(&self.mean, c),
                        &st(&self.variance, c),
                        eps,
                    );
                    vec![("y", out, r.y)]
                }
                BenchOp::BackwardTraining | BenchOp::BackwardInference => {
                    let dyc: Vec<f64> = pos.iter().map(|&i| wide(self.dy[i])).collect();
                    let r = reference::backward(
                        nhwc,
                        &shape,
                        &dyc,
                        &xc,
                        &st(&self.scale, c),
                        &st(&self.mean, c),
                        &st(&self.variance, c),
                        eps,
                        self.op == BenchOp::BackwardTraining,
                    );
                    vec![
                        ("x_backprop", out, r.x_backprop),
                        ("scale_backprop", st(s0, c).to_vec(), r.scale_backprop),
                        ("offset_backprop", st(s1, c).to_vec(), r.offset_backprop),
                    ]
                }
            };
            for (what, got, want) in checks {
                close(&got, &want, tol_eps).map_err(|e| format!("{what}, channel {c}, {e}"))?;
            }
        }
        Ok(())
    }
}

/// `got` within `1e-4·max|want| + 2·eps·|want|` of `want`, NaN where `want` is NaN.
fn close(got: &[f64], want: &[f64], eps: f64) -> Result<(), String> {
    let scale = want
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f64, |m, v| m.max(v.abs()));
    for (k, (&a, &b)) in got.iter().zip(want).enumerate() {
        let tol = 1e-4 * scale + 2.0 * eps * b.abs();
        let ok = if b.is_nan() {
            a.is_nan()
        } else {
            (a - b).abs() <= tol
        };
        if !ok {
            return Err(format!(
                "element {k} of the channel: got {a}, expected {b} (tolerance {tol:.3e})"
            ));
        }
    }
    Ok(())
}

/// Up to 4 channels: the first, the last and two in between.
fn sample_channels(c: usize) -> Vec<usize> {
    dedup(&[0, c / 3, 2 * c / 3, c.saturating_sub(1)])
}

/// The storage indices of channel `c`'s elements, in storage order.
fn channel_positions(p: &Problem, c: usize) -> Vec<usize> {
    let (shape, axis) = (p.shape(), p.format().channel_axis());
    let channels = shape[axis];
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    (0..outer)
        .flat_map(|o| (0..inner).map(move |j| (o * channels + c) * inner + j))
        .collect()
}

/// Maps a storage index of x to its channel.
fn channel_index(p: &Problem) -> impl Fn(usize) -> usize + Sync {
    let axis = p.format().channel_axis();
    let channels = p.shape()[axis].max(1);
    let inner: usize = p.shape()[axis + 1..].iter().product::<usize>().max(1);
    move |i| (i / inner) % channels
}

fn channel_mean(c: usize) -> f64 {
    0.5 * ((c % 7) as f64 - 3.0)
}

fn channel_std(c: usize) -> f64 {
    0.5 + 0.25 * (c % 5) as f64
}

/// Deterministic noise with mean 0 and variance 1 (uniform on ±√3), from a hash of
/// `(stream, i)`.
fn noise(stream: u64, i: usize) -> f64 {
    let mut z = (i as u64) ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // splitmix64's finalizer.
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let u = (z >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    (2.0 * u - 1.0) * 3f64.sqrt()
}

/// `n` elements `f(i)`, rounded to `T`, generated in parallel.
fn generate<T: Element>(n: usize, f: impl Fn(usize) -> f64 + Sync) -> Vec<T> {
    (0..n)
        .into_par_iter()
        .map(|i| T::narrow(T::Stat::from_f64(f(i))))
        .collect()
}

/// The bytes of a slice of elements.
fn bytes_of<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: `Element` is sealed to f16, bf16, f32 and f64: plain data with no padding,
    // every byte initialized. `u8` has alignment 1 and the length is the slice's size.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// A cheap fold of every byte (wrapping sum of 8-byte words): a read of the memory
/// with as little arithmetic as possible.
fn checksum(b: &[u8]) -> u64 {
    let words = b.chunks_exact(8);
    let tail = words
        .remainder()
        .iter()
        .fold(0u64, |a, &x| a.wrapping_add(u64::from(x)));
    words
        .map(|w| {
            let mut a = [0u8; 8];
            a.copy_from_slice(w);
            u64::from_ne_bytes(a)
        })
        .fold(tail, u64::wrapping_add)
}

/// Prints the table or the JSON lines.
struct Report {
    dtype: DType,
    threads: usize,
    runs: usize,
    json: bool,
    shape_width: usize,
}

impl Report {
    fn header(&self) {
        if self.json {
            return;
        }
        println!(
            "fusedbn bench: dtype {}, threads {}, median of {} runs; copy = the same bytes moved \
             with no arithmetic, on the same threads (forward: y <- x; backward: dx <- dy + read of x)",
            self.dtype, self.threads, self.runs
        );
        println!(
            "{:<18}  {:<6}  {:<w$}  {:>9}  {:>7}  {:>9}  {:>7}  check",
            "op",
            "format",
            "shape",
            "ms",
            "GB/s",
            "copy ms",
            "op/copy",
            w = self.shape_width
        );
    }

    fn row(&self, case: &Case, m: &Measurement) {
        let check = if m.check.is_ok() { "ok" } else { "FAIL" };
        if self.json {
            let line = serde_json::json!({
                "op": case.op.name(),
                "format": case.format.as_str(),
                "dtype": self.dtype.to_string(),
                "shape": case.shape,
                "threads": self.threads,
                "isa": "scalar",
                "runs": self.runs,
                "median_ms": m.median_ms(),
                "gbps": m.gbps(),
                "copy_ms": m.copy_ms(),
                "copy_ratio": m.copy_ratio(),
                "check": check,
            });
            println!("{line}");
            return;
        }
        let mut s = String::new();
        let _ = write!(
            s,
            "{:<18}  {:<6}  {:<w$}  {:>9.3}  {:>7.2}  {:>9.3}  {:>7.2}  {check}",
            case.op.name(),
            case.format.as_str(),
            case.shape_str(),
            m.median_ms(),
            m.gbps(),
            m.copy_ms(),
            m.copy_ratio(),
            w = self.shape_width
        );
        println!("{s}");
    }
}

/// A `[i/n] case` line on stderr, redrawn in place; only when stderr is a terminal.
struct Progress {
    total: usize,
    enabled: bool,
}

impl Progress {
    fn new(total: usize) -> Self {
        Progress {
            total,
            enabled: std::io::stderr().is_terminal(),
        }
    }

    fn show(&self, i: usize, case: &Case) {
        if self.enabled {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K[{}/{}] {}", i + 1, self.total, case.label());
            let _ = err.flush();
        }
    }

    fn clear(&self) {
        if self.enabled {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_laid_out_per_format() {
        let s4 = parse_shape("2,5,6,3").unwrap();
        assert_eq!(layout(&s4, DataFormat::Nhwc).unwrap(), [2, 5, 6, 3]);
        assert_eq!(layout(&s4, DataFormat::Nchw).unwrap(), [2, 3, 5, 6]);
        assert_eq!(layout(&s4, DataFormat::Ndhwc).unwrap(), [2, 1, 5, 6, 3]);
        assert_eq!(layout(&s4, DataFormat::Ncdhw).unwrap(), [2, 3, 1, 5, 6]);
        let s5 = parse_shape("2,4,5,6,3").unwrap();
        assert_eq!(layout(&s5, DataFormat::Ncdhw).unwrap(), [2, 3, 4, 5, 6]);
        assert!(layout(&s5, DataFormat::Nchw).is_err());
        for bad in ["", "2,3,4", "2,3,4,5,6,7", "2,0,4,5", "a,b,c,d", "-1,2,3,4"] {
            assert!(parse_shape(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn channel_positions_cover_every_element_once() {
        for format in DataFormat::ALL {
            let shape = if format.rank() == 4 {
                vec![2, 3, 4, 5]
            } else {
                vec![2, 3, 4, 5, 2]
            };
            let p = Problem::new(format, &shape).unwrap();
            let channel_of = channel_index(&p);
            let mut seen = vec![false; p.len()];
            for c in 0..p.channels() {
                let pos = channel_positions(&p, c);
                assert_eq!(pos.len(), p.elements_per_channel());
                for i in pos {
                    assert_eq!(channel_of(i), c, "{format}");
                    assert!(!std::mem::replace(&mut seen[i], true));
                }
            }
            assert!(seen.iter().all(|&s| s));
        }
    }

    #[test]
    fn medians_and_samples() {
        let ms = |v: &[u64]| {
            median_ms(
                &v.iter()
                    .map(|&m| Duration::from_millis(m))
                    .collect::<Vec<_>>(),
            )
        };
        assert_eq!(ms(&[3, 1, 2]), 2.0);
        assert_eq!(ms(&[4, 1, 2, 3]), 2.5);
        assert_eq!(sample_channels(1), [0]);
        assert_eq!(sample_channels(3), [0, 1, 2]);
        assert_eq!(sample_channels(64), [0, 21, 42, 63]);
    }

    #[test]
    fn the_copy_baseline_copies_and_reads() {
        let case = Case {
            op: BenchOp::BackwardTraining,
            format: DataFormat::Nhwc,
            shape: vec![1, 300, 300, 3],
        };
        let mut w = Workload::<f32>::new(&case).unwrap();
        w.run_copy();
        assert_eq!(w.out, w.dy);
        assert_eq!(w.run_copy(), checksum(bytes_of(&w.x)));
        w.run_op().unwrap();
        assert_eq!(w.check(), Ok(()));
    }
}
