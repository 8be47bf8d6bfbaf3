//! `fusedbn bench`: times the typed layer ([`Problem`]'s methods, preallocated
//! outputs) against a plain parallel copy of the same bytes.
//!
//! Structure, so that later work can add statistics, ISAs or other baselines without
//! touching the rest:
//! - [`BenchArgs`] → a list of [`Case`]s ([`cases`]): shape × format × op × dtype × ISA ×
//!   threads;
//! - per case, a [`Workload`] owns every buffer (allocated once, outside the timed loop)
//!   and knows how to run the op ([`Workload::run_op`]), the baseline
//!   ([`Workload::run_copy`]) and the correctness check ([`Workload::check`]);
//! - [`measure`] warms both up, then times op/copy *pairs* and returns a
//!   [`Measurement`];
//! - [`Report`] prints it as a table row or a JSON line; [`Progress`] draws a bar on
//!   stderr when it is a terminal.
//!
//! # Why the median of per-pair ratios
//!
//! The machines this runs on are shared: the time to copy the same buffer drifts by up
//! to 2× from one second to the next (other tenants, clock changes). The op's median and
//! the copy's median are each fine, but their ratio mixes in whatever the bandwidth did
//! between the moments the two medians happen to come from. So every op run is timed
//! right next to one copy of the same bytes (a *pair*; the order alternates, op first on
//! even pairs and copy first on odd ones, so that neither always runs in the other's
//! wake), each pair gives a ratio `op_i / copy_i` in which any drift slower than a pair
//! cancels, and `copy_ratio` is the median of those ratios (a pair hit by a burst is an
//! outlier the median ignores). The ratio of the two medians is reported beside it
//! (`ratio_of_medians` in JSON), and the quartiles of the pair ratios show the spread.

use std::fmt::Write as _;
use std::hint::black_box;
use std::io::{IsTerminal, Write as _};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use std::any::Any;

use clap::{Args, ValueEnum};
use fusedbn::batch_norm::{
    Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, Mode, RunningStats,
    SavedStats, SecondOrderGradients, SecondOrderInputs, Statistics, TrainingStats,
};
use fusedbn::driver::{self, Placement};
use fusedbn::ops::{Op, Outputs};
use fusedbn::tuning::{parallel as uses_pool, TASK};
use fusedbn::Isa;
use fusedbn::{DType, DataFormat, Element, Problem, Real, Tensor, TensorData};
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

/// Untimed op/copy pairs before timing starts, at least (and at least [`WARMUP_TIME`]).
const WARMUP_PAIRS: usize = 2;
/// Untimed warm-up per case, at least: wakes the thread pool, faults in every page of
/// every buffer and lets the clock settle.
const WARMUP_TIME: Duration = Duration::from_millis(10);
/// A cache line: `--offset` places every tensor this far from a multiple of it.
const LINE: usize = 64;
/// With `--min-time`, a case runs at most this many times `--runs` pairs.
const MAX_PAIRS_FACTOR: usize = 100;

/// Arguments of `fusedbn bench`.
#[derive(Debug, Args)]
#[command(after_help = bench_help())]
pub struct BenchArgs {
    /// Op to time (repeatable or comma-separated; all: every op) [default: the four
    /// plain ops: forward_training, forward_inference, backward_training,
    /// backward_inference]
    #[arg(long = "op", value_enum, value_name = "OP", value_delimiter = ',')]
    pub ops: Vec<OpArg>,

    /// Data format (repeatable or comma-separated) [default: NHWC and NCHW; NDHWC and
    /// NCDHW for 5-number shapes]
    #[arg(
        long = "format",
        visible_alias = "layout",
        value_name = "FORMAT",
        value_parser = parse_format,
        value_delimiter = ','
    )]
    pub formats: Vec<DataFormat>,

    /// Element type of x, y, dy and dx (repeatable or comma-separated) [default: f32]
    #[arg(
        long = "dtype",
        value_enum,
        value_name = "DTYPE",
        value_delimiter = ','
    )]
    pub dtypes: Vec<BenchDtype>,

    /// The problem as its channels-last tensor shape N,H,W,C (or N,D,H,W,C): exactly the
    /// shape x has in NHWC (NDHWC), and the same problem transposed for the
    /// channel-major formats; replaces the built-in list (repeatable). A 4-number shape
    /// runs in 5-D formats with D = 1.
    #[arg(long = "shape", value_name = "N,H,W,C", value_parser = parse_shape)]
    pub shapes: Vec<LogicalShape>,

    /// Kernels to run: scalar, avx2, avx512, or all (every one this CPU supports);
    /// repeatable or comma-separated [default: the best this CPU has, or FUSEDBN_ISA]
    #[arg(long = "isa", value_name = "ISA", value_delimiter = ',')]
    pub isas: Vec<String>,

    /// Size of the thread pool (repeatable or comma-separated) [default: rayon's default,
    /// one per core]
    #[arg(
        long = "threads",
        value_name = "N",
        value_delimiter = ',',
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub threads: Vec<u32>,

    /// Where every tensor of a case starts: this many bytes past a 64-byte boundary
    /// (repeatable or comma-separated; a multiple of 8 below 64). 0: on a cache line, as
    /// PyTorch's and TensorFlow's CPU allocators place tensors; 16: where glibc's malloc
    /// places a large Rust `Vec` (its chunk header is 16 bytes)
    #[arg(
        long = "offset",
        value_name = "BYTES",
        value_delimiter = ',',
        value_parser = parse_offset
    )]
    pub offsets: Vec<usize>,

    /// Offset x of batch item n by STEP·n (images at different levels, as a batch's
    /// activations often are; within an item the std is 1.5 to 1.9); 0: the same
    /// distribution in every item
    #[arg(long, value_name = "STEP", default_value_t = 0.0, value_parser = parse_levels)]
    pub levels: f64,

    /// Timed op/copy pairs per case, at least
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub runs: u32,

    /// Keep adding timed pairs until a case has been timed this many seconds (at most
    /// 100 × --runs pairs; 0: exactly --runs pairs)
    #[arg(long = "min-time", value_name = "SECONDS", default_value_t = 0.2, value_parser = parse_seconds)]
    pub min_time: f64,

    /// Built-in shapes with N = 2 instead of 16 (a fast smoke run)
    #[arg(long)]
    pub quick: bool,

    /// One JSON object per line instead of the table
    #[arg(long)]
    pub json: bool,

    /// With --json: also every pair's times (`pairs_op_ms`, `pairs_copy_ms`, in run order)
    #[arg(long, requires = "json")]
    pub raw: bool,

    /// Where the ops run: the CPU, or GPU 0 (needs a build with `--features cuda`;
    /// shapes default to GPU.md's, times are CUDA events after an L2 flush)
    #[arg(long, value_enum, default_value_t = BenchDevice::Cpu)]
    pub device: BenchDevice,
}

/// `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchDevice {
    /// The CPU kernels.
    Cpu,
    /// The CUDA backend on GPU 0.
    Cuda,
}

#[cfg(feature = "cuda")]
#[path = "gpu_bench.rs"]
mod gpu;

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
         then op and copy alternate untimed (warm-up), then --runs timed pairs (more with\n\
         --min-time), each an op run next to a parallel copy of the same bytes: of the op's k input\n\
         and j output tensors, the first j inputs are copied into the outputs and the rest are read\n\
         (forward: y <- x; backward: dx <- dy plus a summed read of x; forward_training_ex: y <- x\n\
         plus a read of side_input; backward_training_ex: dx <- dy, side_input_backprop <- x plus a\n\
         read of y; second_order_*: grad_y_backprop <- y_backprop, grad_x <- x plus a read of\n\
         grad_x_backprop; f16/bf16 copy their own 2-byte elements).\n\
         ms and copy ms are medians; op/copy is the median of the per-pair ratios op_i/copy_i,\n\
         which cancels the machine's bandwidth drift (the ratio of the medians is in --json as\n\
         ratio_of_medians), with the pair ratios' quartiles beside it. GB/s counts the bytes the op\n\
         must move, the same k + j tensors (forward: read x + write y; backward: read dy and x +\n\
         write dx; the Ex and second-order ops: as their copies above).\n\
         Every tensor starts on a 64-byte boundary (as PyTorch's and TensorFlow's CPU allocators\n\
         place theirs), or --offset bytes past one (16: where glibc's malloc puts a large Vec).\n\
         Without --op: the four plain ops; the Ex and second-order ops run when named (or --op all).\n\
         Exits with status 1 if any check fails, 2 on invalid arguments (an unknown --isa, or one\n\
         this CPU lacks).",
        shapes.join(", ")
    )
}

/// The passes the benchmark can time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum BenchOp {
    /// `Problem::forward` in training (batch statistics, running statistics with factor 1).
    ForwardTraining,
    /// `Problem::forward` in inference.
    ForwardInference,
    /// `Problem::backward` in training.
    BackwardTraining,
    /// `Problem::backward` in inference.
    BackwardInference,
    /// `Problem::forward` in training with a side input and Relu.
    ForwardTrainingEx,
    /// `Problem::backward` in training: Relu mask from the forward y, with
    /// side_input_backprop.
    BackwardTrainingEx,
    /// `Problem::second_order` in training (statistics recomputed from x).
    SecondOrderTraining,
    /// `Problem::second_order` in inference.
    SecondOrderInference,
}

impl BenchOp {
    /// What runs without `--op`.
    const DEFAULT: [BenchOp; 4] = [
        BenchOp::ForwardTraining,
        BenchOp::ForwardInference,
        BenchOp::BackwardTraining,
        BenchOp::BackwardInference,
    ];

    /// `--op all`.
    const ALL: [BenchOp; 8] = [
        BenchOp::ForwardTraining,
        BenchOp::ForwardInference,
        BenchOp::BackwardTraining,
        BenchOp::BackwardInference,
        BenchOp::ForwardTrainingEx,
        BenchOp::BackwardTrainingEx,
        BenchOp::SecondOrderTraining,
        BenchOp::SecondOrderInference,
    ];

    fn name(self) -> &'static str {
        match self {
            BenchOp::ForwardTraining => "forward_training",
            BenchOp::ForwardInference => "forward_inference",
            BenchOp::BackwardTraining => "backward_training",
            BenchOp::BackwardInference => "backward_inference",
            BenchOp::ForwardTrainingEx => "forward_training_ex",
            BenchOp::BackwardTrainingEx => "backward_training_ex",
            BenchOp::SecondOrderTraining => "second_order_training",
            BenchOp::SecondOrderInference => "second_order_inference",
        }
    }

    fn is_second_order(self) -> bool {
        matches!(
            self,
            BenchOp::SecondOrderTraining | BenchOp::SecondOrderInference
        )
    }

    /// Whether the op reads a `y_backprop` (every gradient op).
    fn reads_dy(self) -> bool {
        !matches!(
            self,
            BenchOp::ForwardTraining | BenchOp::ForwardInference | BenchOp::ForwardTrainingEx
        )
    }

    /// Tensors of x's size the op reads, in the order the copy baseline takes them
    /// (see [`Workload::inputs`]).
    fn inputs(self) -> usize {
        match self {
            BenchOp::ForwardTraining | BenchOp::ForwardInference => 1, // x
            BenchOp::BackwardTraining | BenchOp::BackwardInference => 2, // dy, x
            BenchOp::ForwardTrainingEx => 2,                           // x, side_input
            BenchOp::BackwardTrainingEx => 3,                          // dy, x, y
            BenchOp::SecondOrderTraining | BenchOp::SecondOrderInference => 3, // dy, x, grad_x_backprop
        }
    }

    /// Tensors of x's size the op writes: y, dx, or dx and side_input_backprop, or
    /// grad_y_backprop and grad_x.
    fn outputs(self) -> usize {
        match self {
            BenchOp::BackwardTrainingEx
            | BenchOp::SecondOrderTraining
            | BenchOp::SecondOrderInference => 2,
            _ => 1,
        }
    }

    /// The TensorFlow op and mode this pass is, as a [`driver::Case`] on x of logical
    /// shape `[N, spatial…, C]`: the V3 ops for the plain passes, `_FusedBatchNormEx`
    /// with a side input and Relu, `_FusedBatchNormGradEx` with Relu (its `y` is the
    /// mask), `FusedBatchNormGradGradV3` for second order.
    fn driver_case(
        self,
        format: DataFormat,
        logical: &[usize],
        dtype: DType,
    ) -> fusedbn::Result<driver::Case> {
        let (op, training) = match self {
            BenchOp::ForwardTraining => (Op::FusedBatchNormV3, true),
            BenchOp::ForwardInference => (Op::FusedBatchNormV3, false),
            BenchOp::BackwardTraining => (Op::FusedBatchNormGradV3, true),
            BenchOp::BackwardInference => (Op::FusedBatchNormGradV3, false),
            BenchOp::ForwardTrainingEx => (Op::FusedBatchNormEx, true),
            BenchOp::BackwardTrainingEx => (Op::FusedBatchNormGradEx, true),
            BenchOp::SecondOrderTraining => (Op::FusedBatchNormGradGradV3, true),
            BenchOp::SecondOrderInference => (Op::FusedBatchNormGradGradV3, false),
        };
        let case = driver::Case::new(op, format, logical, dtype)?.training(training);
        Ok(match self {
            BenchOp::ForwardTrainingEx => case.ex(true, true),
            BenchOp::BackwardTrainingEx => case.ex(false, true),
            _ => case,
        })
    }
}

/// One `--op` value: an op, or `all`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpArg {
    Op(BenchOp),
    All,
}

impl ValueEnum for OpArg {
    fn value_variants<'a>() -> &'a [Self] {
        const VARIANTS: [OpArg; 9] = [
            OpArg::Op(BenchOp::ForwardTraining),
            OpArg::Op(BenchOp::ForwardInference),
            OpArg::Op(BenchOp::BackwardTraining),
            OpArg::Op(BenchOp::BackwardInference),
            OpArg::Op(BenchOp::ForwardTrainingEx),
            OpArg::Op(BenchOp::BackwardTrainingEx),
            OpArg::Op(BenchOp::SecondOrderTraining),
            OpArg::Op(BenchOp::SecondOrderInference),
            OpArg::All,
        ];
        &VARIANTS
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        match self {
            OpArg::Op(op) => op.to_possible_value(),
            OpArg::All => Some(clap::builder::PossibleValue::new("all").help("Every op above")),
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

fn parse_offset(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(v) if v < LINE && v % 8 == 0 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a byte offset: 0, 8, 16, ... or 56 (a multiple of 8 below {LINE})"
        )),
    }
}

fn parse_levels(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v.abs() <= 1e6 => Ok(v),
        _ => Err(format!("{s:?} is not a step from -1e6 to 1e6")),
    }
}

/// The `--levels` step of a case's fill (0 for the default fill).
fn args_levels(case: &Case) -> f64 {
    match case.driver.fill {
        driver::Fill::Levels { step } => step,
        _ => 0.0,
    }
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds from 0 to 3600")),
    }
}

/// The names `--isa` accepts, for messages.
fn isa_names() -> String {
    let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
    names.join(", ")
}

/// `--isa`'s values → ISAs this CPU runs, checked before anything is timed. An unknown
/// name or an ISA the CPU lacks is a one-line error (exit status 2).
fn parse_isas(values: &[String]) -> Result<Vec<Isa>> {
    if values.is_empty() {
        return Ok(vec![Isa::default_isa()]);
    }
    let supported: Vec<&str> = Isa::supported().iter().map(|i| i.name()).collect();
    let mut out = Vec::new();
    for v in values {
        let name = v.trim().to_ascii_lowercase();
        if name == "all" {
            out.extend(Isa::supported());
            continue;
        }
        let isa: Isa = name.parse().map_err(|_| {
            CliError::new(format!(
                "--isa {v:?}: unknown instruction set; expected one of {}, or all (this CPU supports {})",
                isa_names(),
                supported.join(", ")
            ))
        })?;
        // The library's own check (the same one every case's problem goes through).
        Problem::new(DataFormat::Nhwc, &[1, 1, 1, 1])?
            .with_isa(isa)
            .map_err(|_| {
                CliError::new(format!(
                    "--isa {}: this CPU does not support it (it supports {})",
                    isa.name(),
                    supported.join(", ")
                ))
            })?;
        out.push(isa);
    }
    Ok(dedup(&out))
}

/// The ISA the kernels of `dtype` really run with when the problem asks for `isa`: the
/// f64 kernels are always the portable ones (the library dispatches f64 to its portable kernels).
fn effective_isa(dtype: DType, isa: Isa) -> Isa {
    if dtype == DType::F64 {
        Isa::Scalar
    } else {
        isa
    }
}

/// `logical` as the `[N, spatial…, C]` of `format`'s rank (a 4-number shape in a 5-D
/// format gets D = 1).
fn logical_for(logical: &LogicalShape, format: DataFormat) -> Result<Vec<usize>> {
    match (logical.0.len(), format.rank()) {
        (4, 5) => {
            let mut v = logical.0.clone();
            v.insert(1, 1);
            Ok(v)
        }
        (a, b) if a == b => Ok(logical.0.clone()),
        _ => {
            let dims: Vec<String> = logical.0.iter().map(|d| d.to_string()).collect();
            Err(CliError::new(format!(
                "--shape {} has 5 dimensions (N,D,H,W,C): it needs a 5-D --format (NDHWC or NCDHW), not {format}",
                dims.join(",")
            )))
        }
    }
}

/// The shape of `x` in `format`'s own axis order.
#[cfg(test)]
fn layout(logical: &LogicalShape, format: DataFormat) -> Result<Vec<usize>> {
    Ok(driver::layout(format, &logical_for(logical, format)?)?)
}

/// One benchmark case.
#[derive(Clone, Debug)]
pub struct Case {
    pub op: BenchOp,
    pub format: DataFormat,
    /// The shape of x, in the format's axis order.
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// The ISA asked for (see [`effective_isa`] for the one that runs).
    pub isa: Isa,
    /// Index into the thread pools (one per `--threads` value).
    pub pool: usize,
    /// Bytes past a 64-byte boundary where each tensor starts (`--offset`).
    pub offset: usize,
    /// The same problem for the library's driver: its inputs, reference and check.
    pub driver: driver::Case,
}

impl Case {
    /// `op` on x of `logical` shape (`[N, spatial…, C]` of the format's rank).
    fn new(
        op: BenchOp,
        format: DataFormat,
        logical: &[usize],
        dtype: DType,
        isa: Isa,
        pool: usize,
        offset: usize,
    ) -> Result<Case> {
        let driver = op.driver_case(format, logical, dtype)?.isa(isa);
        Ok(Case {
            op,
            format,
            shape: driver.shape.clone(),
            dtype,
            isa,
            pool,
            offset,
            driver,
        })
    }

    /// The shape, and `+OFFSET` for tensors off a cache line.
    fn shape_str(&self) -> String {
        let dims: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        match self.offset {
            0 => dims.join("x"),
            off => format!("{}+{off}", dims.join("x")),
        }
    }

    fn label(&self) -> String {
        format!(
            "{} {} {} {} {}",
            self.op.name(),
            self.format,
            self.shape_str(),
            self.dtype,
            self.isa
        )
    }

    /// Bytes the op reads and writes (also the progress bar's weight): the driver's
    /// count, the same k + j tensors of x's size as the copy baseline moves.
    fn bytes(&self) -> usize {
        self.driver.bytes()
    }
}

/// The cases `args` asks for: shapes, then formats, ops, dtypes, ISAs and thread counts
/// (the last ones vary fastest, so that the rows to compare are adjacent).
fn cases(args: &BenchArgs, isas: &[Isa], pools: usize) -> Result<Vec<Case>> {
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
        let named: Vec<BenchOp> = args
            .ops
            .iter()
            .flat_map(|o| match o {
                OpArg::Op(op) => vec![*op],
                OpArg::All => BenchOp::ALL.to_vec(),
            })
            .collect();
        dedup(&named)
    };
    let dtypes: Vec<DType> = if args.dtypes.is_empty() {
        vec![DType::F32]
    } else {
        dedup(&args.dtypes).into_iter().map(|d| d.dtype()).collect()
    };
    let offsets = if args.offsets.is_empty() {
        vec![0]
    } else {
        dedup(&args.offsets)
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
            let logical = logical_for(logical, format)?;
            for &op in &ops {
                for &dtype in &dtypes {
                    // ISAs that run the same kernels for this dtype (f64) run once.
                    let mut seen = Vec::new();
                    for &isa in isas {
                        if seen.contains(&effective_isa(dtype, isa)) {
                            continue;
                        }
                        seen.push(effective_isa(dtype, isa));
                        for pool in 0..pools {
                            for &off in &offsets {
                                let mut case =
                                    Case::new(op, format, &logical, dtype, isa, pool, off)?;
                                if args.levels != 0.0 {
                                    let fill = driver::Fill::Levels { step: args.levels };
                                    case.driver = case.driver.fill(fill);
                                }
                                out.push(case);
                            }
                        }
                    }
                }
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

/// How many pairs [`measure`] times.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Timed pairs, at least.
    pub runs: usize,
    /// Keep timing pairs until this long has been spent timing (up to
    /// [`MAX_PAIRS_FACTOR`] × `runs` pairs).
    pub min_time: Duration,
}

impl Plan {
    /// A rough guess of a case's seconds (for the progress bar's share and ETA): setup,
    /// then the pairs at ~20 GB/s, or `min_time`.
    fn estimate(&self, case: &Case) -> f64 {
        let bytes = case.bytes() as f64;
        let pairs = self.runs as f64 * 2.0 * bytes / 20e9;
        bytes / 2e9 + pairs.max(self.min_time.as_secs_f64())
    }
}

/// Runs `fusedbn bench`.
pub fn bench(args: &BenchArgs) -> Result<ExitCode> {
    if args.device == BenchDevice::Cuda {
        #[cfg(feature = "cuda")]
        return gpu::bench(args);
        #[cfg(not(feature = "cuda"))]
        return Err(CliError::new(
            "--device cuda: this fusedbn was built without the cuda feature (cargo build --release --features cuda)",
        ));
    }
    let isas = parse_isas(&args.isas)?;
    let thread_counts: Vec<usize> = if args.threads.is_empty() {
        vec![0]
    } else {
        dedup(&args.threads)
            .into_iter()
            .map(|t| t as usize)
            .collect()
    };
    let pools = thread_counts
        .iter()
        .map(|&n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .map_err(|e| CliError::new(format!("could not start the thread pool: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let cases = cases(args, &isas, pools.len())?;
    let plan = Plan {
        runs: args.runs as usize,
        min_time: Duration::from_secs_f64(args.min_time),
    };
    let report = Report {
        json: args.json,
        raw: args.raw,
        shape_width: cases
            .iter()
            .map(|c| c.shape_str().len())
            .max()
            .unwrap_or(5)
            .max(5),
    };
    let mut progress = Progress::new(cases.iter().map(|c| plan.estimate(c)).collect());
    let start = Instant::now();
    report.header(&plan);
    let mut failed = 0;
    for (i, case) in cases.iter().enumerate() {
        progress.show(i, case);
        let pool = &pools[case.pool];
        let m = pool.install(|| match case.dtype {
            DType::F32 => measure::<f32>(case, plan),
            DType::F16 => measure::<fusedbn::f16>(case, plan),
            DType::BF16 => measure::<fusedbn::bf16>(case, plan),
            DType::F64 => measure::<f64>(case, plan),
        });
        progress.clear();
        let m = m?;
        if let Err(msg) = &m.check {
            failed += 1;
            eprintln!("fusedbn: bench: check FAILED: {}: {msg}", case.label());
        }
        report.row(case, pool.current_num_threads(), &m);
    }
    progress.clear();
    let threads: Vec<String> = pools
        .iter()
        .map(|p| p.current_num_threads().to_string())
        .collect();
    eprintln!(
        "fusedbn bench: {} cases in {:.1} s (threads {})",
        cases.len(),
        start.elapsed().as_secs_f64(),
        threads.join(", ")
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
    /// Copy-baseline run times, `copy[i]` paired with `op[i]`.
    pub copy: Vec<Duration>,
    /// Bytes the op reads and writes.
    pub bytes: usize,
    /// The ISA the kernels ran with.
    pub isa: Isa,
    /// The first run against the reference: `Err` holds the first mismatch.
    pub check: Result<(), String>,
}

impl Measurement {
    fn median_ms(&self) -> f64 {
        median(&ms(&self.op))
    }

    fn min_ms(&self) -> f64 {
        ms(&self.op).into_iter().fold(f64::INFINITY, f64::min)
    }

    fn copy_ms(&self) -> f64 {
        median(&ms(&self.copy))
    }

    fn gbps(&self) -> f64 {
        self.bytes as f64 / (self.median_ms() * 1e-3) / 1e9
    }

    fn copy_gbps(&self) -> f64 {
        self.bytes as f64 / (self.copy_ms() * 1e-3) / 1e9
    }

    /// `op_i / copy_i` for every pair, sorted.
    fn pair_ratios(&self) -> Vec<f64> {
        let mut r: Vec<f64> = self
            .op
            .iter()
            .zip(&self.copy)
            .map(|(o, c)| o.as_secs_f64() / c.as_secs_f64())
            .collect();
        r.sort_by(f64::total_cmp);
        r
    }

    /// The median of the per-pair ratios (see the module's documentation).
    fn copy_ratio(&self) -> f64 {
        median(&self.pair_ratios())
    }

    /// The pair ratios' first and third quartiles.
    fn copy_ratio_quartiles(&self) -> (f64, f64) {
        let r = self.pair_ratios();
        (quantile(&r, 0.25), quantile(&r, 0.75))
    }

    fn ratio_of_medians(&self) -> f64 {
        self.median_ms() / self.copy_ms()
    }
}

fn ms(v: &[Duration]) -> Vec<f64> {
    v.iter().map(|d| d.as_secs_f64() * 1e3).collect()
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    quantile(&s, 0.5)
}

/// The `q`-quantile of sorted `s`, interpolating linearly between ranks (NaN if empty).
fn quantile(s: &[f64], q: f64) -> f64 {
    match s.len() {
        0 => f64::NAN,
        n => {
            let pos = q.clamp(0.0, 1.0) * (n - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
        }
    }
}

/// Sets up one case, runs it once untimed and checks it, warms up op and copy
/// alternately, then times pairs (see the module's documentation) until `plan` is met.
fn measure<T: Element>(case: &Case, plan: Plan) -> Result<Measurement> {
    let mut w = Workload::<T>::new(case)?;
    w.run_op()?;
    let check = w.check();
    let warm = Instant::now();
    let mut pairs = 0;
    while pairs < WARMUP_PAIRS || warm.elapsed() < WARMUP_TIME {
        w.run_op()?;
        black_box((&mut w.out, &mut w.out2));
        black_box(w.run_copy());
        black_box((&mut w.out, &mut w.out2));
        pairs += 1;
    }
    let max_pairs = plan.runs * MAX_PAIRS_FACTOR;
    let (mut op, mut copy) = (Vec::with_capacity(plan.runs), Vec::with_capacity(plan.runs));
    let mut timed = Duration::ZERO;
    while op.len() < plan.runs || (timed < plan.min_time && op.len() < max_pairs) {
        let op_first = op.len() % 2 == 0;
        let (mut t_op, mut t_copy) = (Duration::ZERO, Duration::ZERO);
        for step in 0..2 {
            let t = Instant::now();
            if (step == 0) == op_first {
                w.run_op()?;
                black_box((&mut w.out, &mut w.out2));
                t_op = t.elapsed();
            } else {
                black_box(w.run_copy());
                black_box((&mut w.out, &mut w.out2));
                t_copy = t.elapsed();
            }
        }
        timed += t_op + t_copy;
        op.push(t_op);
        copy.push(t_copy);
    }
    Ok(Measurement {
        op,
        copy,
        bytes: case.bytes(),
        isa: effective_isa(T::DTYPE, w.problem.isa()),
        check,
    })
}

/// Every buffer of one case, allocated once.
struct Workload<T: Element> {
    op: BenchOp,
    problem: Problem,
    x: Placed<T>,
    /// `y_backprop` (gradient and second-order ops).
    dy: Placed<T>,
    /// The third input of the Ex and second-order ops: `side_input`
    /// (`forward_training_ex`), the forward's Relu output `y` (`backward_training_ex`)
    /// or `grad_x_backprop` (second order); empty otherwise.
    extra: Placed<T>,
    /// `y` (forward), `x_backprop` (backward) or `grad_y_backprop` (second order).
    out: Placed<T>,
    /// The second output: `side_input_backprop` (`backward_training_ex`) or `grad_x`
    /// (second order); empty otherwise.
    out2: Placed<T>,
    scale: Vec<T::Stat>,
    /// Empty where the op takes no offset.
    offset: Vec<T::Stat>,
    /// Inputs: the population statistics (inference ops and second order, which in
    /// training does not read them) or the reserve spaces of the gradients (the
    /// driver's nominal statistics of x).
    mean: Vec<T::Stat>,
    variance: Vec<T::Stat>,
    /// Per-channel outputs: forward training's saved and running statistics, the
    /// gradients' scale_backprop and offset_backprop (in `stat_out[0..2]`), or second
    /// order's grad_scale (`stat_out[0]`). Second order's per-channel inputs
    /// grad_scale_backprop and grad_offset_backprop are `stat_out[2..4]`.
    stat_out: [Vec<T::Stat>; 4],
    /// The op the driver names the outputs by.
    driver_op: Op,
    /// The driver's reference on [`sample_channels`], from the inputs (made at setup).
    want: driver::Reference,
}

/// A tensor's elements placed `offset` bytes past a cache line (`--offset`), whatever
/// the allocator returned: a `Vec` with room for the shift, and the window from `at` to
/// its end. (Safe code only: a `Vec<T>` cannot be allocated with a larger alignment than
/// `T`'s.)
struct Placed<T> {
    buf: Vec<T>,
    at: usize,
}

impl<T: Copy + Default> Placed<T> {
    /// `data` at `offset` bytes past a 64-byte boundary (`offset` a multiple of the
    /// element size below [`LINE`]): moved where the allocator already put it there
    /// (and when empty), copied otherwise.
    fn new(data: Vec<T>, offset: usize) -> Self {
        if data.is_empty() || data.as_ptr() as usize % LINE == offset {
            return Placed { buf: data, at: 0 };
        }
        let mut p = Self::room(data.len(), offset);
        p.buf.extend_from_slice(&data);
        p
    }

    /// `len` default elements at `offset` bytes past a 64-byte boundary.
    fn zeroed(len: usize, offset: usize) -> Self {
        let mut p = Self::room(len, offset);
        p.buf.resize(p.at + len, T::default());
        p
    }

    /// An empty window at `offset` past a line, with room for `len` elements: the
    /// capacity is reserved first, so the buffer never moves once `at` is chosen.
    fn room(len: usize, offset: usize) -> Self {
        let size = size_of::<T>();
        let mut buf = Vec::with_capacity(len + 2 * LINE / size);
        let addr = buf.as_ptr() as usize;
        let at = ((LINE - addr % LINE) % LINE + offset) / size;
        buf.resize(at, T::default());
        Placed { buf, at }
    }
}

impl<T> std::ops::Deref for Placed<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.at..]
    }
}

impl<T> std::ops::DerefMut for Placed<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.at..]
    }
}

/// Takes the first input named one of `names` out of `inputs`, as a vector of `E`
/// (moved, not copied); empty when there is none.
fn take<E: Element>(inputs: &mut Vec<(&'static str, Tensor)>, names: &[&str]) -> Result<Vec<E>> {
    let Some(i) = inputs.iter().position(|(n, _)| names.contains(n)) else {
        return Ok(Vec::new());
    };
    let (name, t) = inputs.swap_remove(i);
    let dtype = t.dtype();
    let any: Box<dyn Any> = match t.into_parts().1 {
        TensorData::F16(v) => Box::new(v),
        TensorData::BF16(v) => Box::new(v),
        TensorData::F32(v) => Box::new(v),
        TensorData::F64(v) => Box::new(v),
    };
    any.downcast::<Vec<E>>().map(|v| *v).map_err(|_| {
        CliError::new(format!(
            "the driver's input {name} is {dtype}, expected {}",
            E::DTYPE
        ))
    })
}

impl<T: Element> Workload<T> {
    /// The driver's inputs for `case` (made once), its reference on the sampled
    /// channels, then the inputs moved into typed buffers and the outputs allocated.
    fn new(case: &Case) -> Result<Self> {
        let d = &case.driver;
        let problem = d.problem()?.with_isa(case.isa)?;
        let c = problem.channels();
        let mut inputs = d.inputs()?;
        let want = driver::reference(d.op, &d.named(&inputs), &d.attrs, Some(&sample_channels(c)))?;
        let extra = match case.op {
            BenchOp::ForwardTrainingEx => "side_input",
            BenchOp::BackwardTrainingEx => "y",
            _ => "grad_x_backprop",
        };
        let off = case.offset;
        let x = Placed::new(take(&mut inputs, &["x"])?, off);
        let dy = Placed::new(take(&mut inputs, &["y_backprop"])?, off);
        let extra = Placed::new(take(&mut inputs, &[extra])?, off);
        let scale = take(&mut inputs, &["scale"])?;
        let offset = take(&mut inputs, &["offset"])?;
        let mean = take(&mut inputs, &["mean", "reserve_space_1"])?;
        let variance = take(&mut inputs, &["variance", "reserve_space_2"])?;
        let mut stat_out: [Vec<T::Stat>; 4] = std::array::from_fn(|_| vec![T::Stat::ZERO; c]);
        if case.op.is_second_order() {
            stat_out[2] = take(&mut inputs, &["grad_scale_backprop"])?;
            stat_out[3] = take(&mut inputs, &["grad_offset_backprop"])?;
        }
        Ok(Workload {
            op: case.op,
            out: Placed::zeroed(problem.len(), off),
            out2: Placed::zeroed((case.op.outputs() - 1) * problem.len(), off),
            problem,
            x,
            dy,
            extra,
            scale,
            offset,
            mean,
            variance,
            stat_out,
            driver_op: d.op,
            want,
        })
    }

    /// One run of the op, through the typed layer, into the preallocated buffers.
    fn run_op(&mut self) -> fusedbn::Result<()> {
        let p = &self.problem;
        let [s0, s1, s2, s3] = &mut self.stat_out;
        let affine = Affine {
            scale: &self.scale,
            offset: &self.offset,
        };
        let stats = Statistics {
            mean: &self.mean,
            variance: &self.variance,
        };
        let inputs = GradInputs {
            y_backprop: &self.dy,
            x: &self.x,
        };
        match self.op {
            BenchOp::ForwardTraining | BenchOp::ForwardTrainingEx => {
                let epilogue = if self.op == BenchOp::ForwardTrainingEx {
                    Epilogue::relu(Some(&self.extra[..]))
                } else {
                    Epilogue::plain()
                };
                let mode = Forward::Training(TrainingStats {
                    saved: SavedStats {
                        mean: s0,
                        variance: s1,
                    },
                    running: Some(RunningStats {
                        mean: s2,
                        variance: s3,
                        factor: 1.0,
                    }),
                });
                p.forward(&self.x, affine, mode, epilogue, &mut self.out)
            }
            BenchOp::ForwardInference => p.forward(
                &self.x,
                affine,
                Forward::Inference(stats),
                Epilogue::plain(),
                &mut self.out,
            ),
            BenchOp::BackwardTraining
            | BenchOp::BackwardInference
            | BenchOp::BackwardTrainingEx => {
                let mode = if self.op == BenchOp::BackwardInference {
                    Backward::Inference(stats)
                } else {
                    Backward::Training(stats)
                };
                let epilogue = if self.op == BenchOp::BackwardTrainingEx {
                    GradEpilogue {
                        relu_output: Some(&self.extra),
                        side_input_backprop: Some(&mut self.out2),
                    }
                } else {
                    GradEpilogue::default()
                };
                let grads = Gradients {
                    x: &mut self.out,
                    scale: s0,
                    offset: s1,
                };
                p.backward(inputs, &self.scale, mode, epilogue, grads)
            }
            BenchOp::SecondOrderTraining | BenchOp::SecondOrderInference => p.second_order(
                SecondOrderInputs {
                    y_backprop: &self.dy,
                    x: &self.x,
                    scale: &self.scale,
                    reserve: stats,
                    grad_x_backprop: &self.extra,
                    grad_scale_backprop: s2,
                    grad_offset_backprop: s3,
                },
                if self.op == BenchOp::SecondOrderTraining {
                    Mode::Training
                } else {
                    Mode::Inference
                },
                SecondOrderGradients {
                    y_backprop: &mut self.out,
                    x: &mut self.out2,
                    scale: s0,
                },
            ),
        }
    }

    /// The baseline: moves the same bytes as the op with no arithmetic, on the same
    /// thread pool and with the library's task size. With k input and j output tensors
    /// (of x's size), the first j inputs are copied into the j outputs and the other
    /// k − j are read, folded into a checksum: forward `y ← x`; backward `dx ← dy` +
    /// read x; forward_training_ex `y ← x` + read side_input; backward_training_ex
    /// `dx ← dy`, `side_input_backprop ← x` + read y; second order
    /// `grad_y_backprop ← y_backprop`, `grad_x ← x` + read grad_x_backprop. Returns the
    /// checksum (0 when nothing is only read), for `black_box`.
    fn run_copy(&mut self) -> u64 {
        // The kernels' own test, so the copy splits as the op does.
        let parallel = uses_pool(self.x.len());
        // On the stack: the yardstick of a 2x8x8x32 op is a copy of about a
        // microsecond, which a heap allocation a call would inflate.
        let all: [&[T]; 3] = match self.op.inputs() {
            1 => [&self.x, &[], &[]],
            2 if self.op.reads_dy() => [&self.dy, &self.x, &[]],
            2 => [&self.x, &self.extra, &[]],
            _ => [&self.dy, &self.x, &self.extra],
        };
        let inputs = &all[..self.op.inputs().min(3)];
        let (copied, read) = inputs.split_at(self.op.outputs());
        let task = |i: usize, d0: &mut [T], d1: Option<&mut [T]>| -> u64 {
            let r = i * TASK..i * TASK + d0.len();
            d0.copy_from_slice(&copied[0][r.clone()]);
            if let Some(d1) = d1 {
                d1.copy_from_slice(&copied[1][r.clone()]);
            }
            read.iter()
                .fold(0, |a, s| a.wrapping_add(checksum(bytes_of(&s[r.clone()]))))
        };
        match (self.out2.is_empty(), parallel) {
            (true, true) => self
                .out
                .par_chunks_mut(TASK)
                .enumerate()
                .map(|(i, d0)| task(i, d0, None))
                .reduce(|| 0, u64::wrapping_add),
            (true, false) => self
                .out
                .chunks_mut(TASK)
                .enumerate()
                .map(|(i, d0)| task(i, d0, None))
                .fold(0, u64::wrapping_add),
            (false, true) => self
                .out
                .par_chunks_mut(TASK)
                .zip(self.out2.par_chunks_mut(TASK))
                .enumerate()
                .map(|(i, (d0, d1))| task(i, d0, Some(d1)))
                .reduce(|| 0, u64::wrapping_add),
            (false, false) => self
                .out
                .chunks_mut(TASK)
                .zip(self.out2.chunks_mut(TASK))
                .enumerate()
                .map(|(i, (d0, d1))| task(i, d0, Some(d1)))
                .fold(0, u64::wrapping_add),
        }
    }

    /// The last run's output `name` (of the driver's op), copied into a tensor; `None`
    /// for an output the typed layer does not compute in this mode (forward inference's
    /// statistics outputs, which the op only passes through) or a placeholder.
    fn output(&self, name: &str) -> fusedbn::Result<Option<Tensor>> {
        let full = |v: &[T]| Tensor::new(self.problem.shape().to_vec(), v.to_vec()).map(Some);
        let stat = |v: &[T::Stat]| Ok(Some(Tensor::vector(v.to_vec())));
        let [s0, s1, s2, s3] = &self.stat_out;
        let training_forward = matches!(
            self.op,
            BenchOp::ForwardTraining | BenchOp::ForwardTrainingEx
        );
        match name {
            "y" | "x_backprop" | "grad_y_backprop" => full(&self.out),
            "side_input_backprop" | "grad_x" => full(&self.out2),
            "scale_backprop" | "grad_scale" => stat(s0),
            "offset_backprop" => stat(s1),
            "reserve_space_1" if training_forward => stat(s0),
            "reserve_space_2" if training_forward => stat(s1),
            "batch_mean" if training_forward => stat(s2),
            "batch_variance" if training_forward => stat(s3),
            _ => Ok(None),
        }
    }

    /// Checks the last run against the driver's reference on [`sample_channels`], with
    /// the driver's tolerance policy ([`driver::check`]): every output the typed layer
    /// computed, and the op's placeholders empty.
    fn check(&self) -> Result<(), String> {
        self.report().map(|_| ()).map_err(|e| e.to_string())
    }

    /// [`Workload::check`]'s comparison, with the driver's report of each output.
    fn report(&self) -> fusedbn::Result<driver::Report> {
        let names = self.driver_op.output_names();
        let got = names
            .iter()
            .map(|n| self.output(n))
            .collect::<fusedbn::Result<Vec<_>>>()?;
        let mut want = self.want.clone();
        want.outputs.retain(|e| {
            e.placement == Placement::Placeholder
                || names
                    .iter()
                    .zip(&got)
                    .any(|(n, t)| *n == e.name && t.is_some())
        });
        let empty = Tensor::empty(<T::Stat as Element>::DTYPE);
        let tensors = got
            .into_iter()
            .map(|t| t.unwrap_or_else(|| empty.clone()))
            .collect();
        driver::check(&want, &Outputs::from_tensors(self.driver_op, tensors)?)
    }
}

/// Up to 4 channels: the first, the last and two in between.
fn sample_channels(c: usize) -> Vec<usize> {
    dedup(&[0, c / 3, 2 * c / 3, c.saturating_sub(1)])
}

/// The bytes of a slice of elements.
fn bytes_of<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: `Element` is sealed to f16, bf16, f32 and f64: plain data with no padding,
    // every byte initialized. `u8` has alignment 1 and the length is the slice's size.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// A cheap fold of every byte (wrapping sum of 8-byte words): a read of the memory
/// with as little arithmetic as possible.
///
/// 128 bytes an iteration into 16 independent sums (the same total: a wrapping sum
/// does not depend on the order). Word by word, the loop was 32 bytes an iteration and
/// its speed in cache hung on where the linker put it: the same source in two builds
/// of the library (Zen 4, NHWC 16x14x14x256 f32 backward inference, in L2) spent 20 %
/// and 10 % of the bench's samples in this read, and the copy's time moved by a fifth
/// (`perf annotate`: the slower loop straddled a 64-byte line of code).
fn checksum(b: &[u8]) -> u64 {
    const BLOCK: usize = 128;
    let blocks = b.chunks_exact(BLOCK);
    let words = blocks.remainder().chunks_exact(8);
    let word = |w: &[u8]| {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        u64::from_ne_bytes(a)
    };
    let tail = words
        .remainder()
        .iter()
        .fold(0u64, |a, &x| a.wrapping_add(u64::from(x)));
    let tail = words.map(word).fold(tail, u64::wrapping_add);
    let mut sums = [0u64; BLOCK / 8];
    for blk in blocks {
        for (s, w) in sums.iter_mut().zip(blk.chunks_exact(8)) {
            *s = s.wrapping_add(word(w));
        }
    }
    sums.iter().fold(tail, |a, &s| a.wrapping_add(s))
}

/// Prints the table or the JSON lines.
struct Report {
    json: bool,
    raw: bool,
    shape_width: usize,
}

impl Report {
    fn header(&self, plan: &Plan) {
        if self.json {
            return;
        }
        println!(
            "fusedbn bench: at least {} timed op/copy pairs per case (and {} s of timing); copy = \
             the same bytes moved with no arithmetic, on the same threads: of k input and j output \
             tensors, the first j inputs copied into the outputs and the rest read (forward: y <- x; \
             backward: dx <- dy + read x; forward_training_ex: y <- x + read side_input; \
             backward_training_ex: dx <- dy, side_input_backprop <- x + read y; second order: \
             grad_y_backprop <- y_backprop, grad_x <- x + read grad_x_backprop)",
            plan.runs,
            plan.min_time.as_secs_f64()
        );
        println!(
            "ms, copy ms: medians; op/copy: median over pairs of op_i/copy_i (robust to \
             bandwidth drift), then the pair ratios' quartiles"
        );
        println!(
            "{:<22}  {:<6}  {:<5}  {:<6}  {:>3}  {:<w$}  {:>9}  {:>7}  {:>9}  {:>7}  {:>11}  check",
            "op",
            "format",
            "dtype",
            "isa",
            "thr",
            "shape",
            "ms",
            "GB/s",
            "copy ms",
            "op/copy",
            "(p25-p75)",
            w = self.shape_width
        );
    }

    fn row(&self, case: &Case, threads: usize, m: &Measurement) {
        let check = if m.check.is_ok() { "ok" } else { "FAIL" };
        let (q1, q3) = m.copy_ratio_quartiles();
        if self.json {
            let mut line = serde_json::json!({
                "op": case.op.name(),
                "format": case.format.as_str(),
                "dtype": case.dtype.to_string(),
                "shape": case.shape,
                "threads": threads,
                "offset": case.offset,
                "levels": args_levels(case),
                "isa": m.isa.name(),
                "isa_requested": case.isa.name(),
                "pairs": m.op.len(),
                "bytes": m.bytes,
                "median_ms": m.median_ms(),
                "min_ms": m.min_ms(),
                "gbps": m.gbps(),
                "copy_ms": m.copy_ms(),
                "copy_gbps": m.copy_gbps(),
                "copy_ratio": m.copy_ratio(),
                "copy_ratio_p25": q1,
                "copy_ratio_p75": q3,
                "ratio_of_medians": m.ratio_of_medians(),
                "check": check,
            });
            if self.raw {
                line["pairs_op_ms"] = ms(&m.op).into();
                line["pairs_copy_ms"] = ms(&m.copy).into();
            }
            println!("{line}");
            return;
        }
        let mut s = String::new();
        let _ = write!(
            s,
            "{:<22}  {:<6}  {:<5}  {:<6}  {:>3}  {:<w$}  {:>9.3}  {:>7.2}  {:>9.3}  {:>7.2}  {:>11}  {check}",
            case.op.name(),
            case.format.as_str(),
            case.dtype.to_string(),
            m.isa.name(),
            threads,
            case.shape_str(),
            m.median_ms(),
            m.gbps(),
            m.copy_ms(),
            m.copy_ratio(),
            format!("({q1:.2}-{q3:.2})"),
            w = self.shape_width
        );
        println!("{s}");
    }
}

/// A progress bar on stderr, redrawn in place between cases; only when stderr is a
/// terminal. Each case's share of the bar is [`Plan::estimate`].
struct Progress {
    /// Each case's weight.
    weights: Vec<f64>,
    total: f64,
    start: Instant,
    enabled: bool,
    /// Characters a line may take (`$COLUMNS`, else 80), less one.
    width: usize,
}

impl Progress {
    const BAR: usize = 24;

    fn new(weights: Vec<f64>) -> Self {
        let width = std::env::var("COLUMNS")
            .ok()
            .and_then(|c| c.parse::<usize>().ok())
            .filter(|&c| c >= 20)
            .unwrap_or(80)
            - 1;
        Progress {
            total: weights.iter().sum::<f64>().max(f64::MIN_POSITIVE),
            weights,
            start: Instant::now(),
            enabled: std::io::stderr().is_terminal(),
            width,
        }
    }

    /// The line shown while case `i` runs.
    fn line(&self, i: usize, case: &Case) -> String {
        let done: f64 = self.weights[..i].iter().sum();
        let frac = done / self.total;
        let filled = ((frac * Self::BAR as f64).round() as usize).min(Self::BAR);
        let elapsed = self.start.elapsed().as_secs_f64();
        let eta = if done > 0.0 {
            format!(" eta {:.0}s", elapsed * (1.0 / frac - 1.0))
        } else {
            String::new()
        };
        let line = format!(
            "[{}{}] {}/{} {:.0}s{eta} {}",
            "#".repeat(filled),
            "-".repeat(Self::BAR - filled),
            i + 1,
            self.weights.len(),
            elapsed,
            case.label()
        );
        line.chars().take(self.width).collect()
    }

    fn show(&mut self, i: usize, case: &Case) {
        if self.enabled {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K{}", self.line(i, case));
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
    use fusedbn::tuning::PARALLEL_MIN;

    /// A case on x of logical shape `[N, spatial…, C]`.
    fn case(op: BenchOp, format: DataFormat, logical: Vec<usize>, dtype: DType) -> Case {
        Case::new(op, format, &logical, dtype, Isa::Scalar, 0, 0).unwrap()
    }

    /// The blocked read sums every byte as the plain word-by-word fold does, whatever
    /// the length (blocks, words and bytes left over).
    #[test]
    fn checksum_is_the_wrapping_sum_of_every_word_and_byte() {
        let bytes: Vec<u8> = (0..1000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for n in [0, 1, 7, 8, 9, 127, 128, 129, 135, 136, 300, 1000] {
            let b = &bytes[..n];
            let words = b.chunks_exact(8);
            let tail: u64 = words.remainder().iter().map(|&x| u64::from(x)).sum();
            let want = words
                .map(|w| u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
                .fold(tail, u64::wrapping_add);
            assert_eq!(checksum(b), want, "{n} bytes");
        }
    }

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
    fn medians_quantiles_and_samples() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let s = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&s, 0.25), 2.0);
        assert_eq!(quantile(&s, 0.75), 4.0);
        assert_eq!(quantile(&[1.0, 2.0], 0.25), 1.25);
        assert_eq!(sample_channels(1), [0]);
        assert_eq!(sample_channels(3), [0, 1, 2]);
        assert_eq!(sample_channels(64), [0, 21, 42, 63]);
    }

    #[test]
    fn copy_ratio_is_the_median_of_pair_ratios() {
        let d = |v: &[u64]| v.iter().map(|&m| Duration::from_millis(m)).collect();
        // The copy's speed halves midway (the machine's drift): each pair still says 2×,
        // while the ratio of medians is thrown off.
        let m = Measurement {
            op: d(&[20, 20, 20, 40, 40]),
            copy: d(&[10, 10, 10, 20, 20]),
            bytes: 1_000_000,
            isa: Isa::Scalar,
            check: Ok(()),
        };
        assert_eq!(m.copy_ratio(), 2.0);
        assert_eq!(m.copy_ratio_quartiles(), (2.0, 2.0));
        assert_eq!(m.ratio_of_medians(), 2.0);
        let m = Measurement {
            op: d(&[20, 20, 40, 40, 40]),
            copy: d(&[10, 10, 20, 20, 20]),
            ..m
        };
        assert_eq!(m.copy_ratio(), 2.0);
        assert_eq!(m.median_ms(), 40.0);
        assert_eq!(m.min_ms(), 20.0);
        assert_eq!(m.gbps(), 0.025);
    }

    #[test]
    fn isa_arguments() {
        assert_eq!(parse_isas(&[]).unwrap(), [Isa::default_isa()]);
        assert_eq!(
            parse_isas(&["scalar".into(), "SCALAR".into()]).unwrap(),
            [Isa::Scalar]
        );
        assert_eq!(parse_isas(&["all".into()]).unwrap(), Isa::supported());
        let e = parse_isas(&["sse9".into()]).unwrap_err().to_string();
        assert!(e.contains("sse9") && e.contains("avx512"), "{e}");
        for isa in Isa::ALL {
            let r = parse_isas(&[isa.name().into()]);
            assert_eq!(r.is_ok(), isa.is_supported(), "{isa}: {r:?}");
        }
        assert_eq!(effective_isa(DType::F64, Isa::Avx2), Isa::Scalar);
        assert_eq!(effective_isa(DType::BF16, Isa::Avx2), Isa::Avx2);
    }

    #[test]
    fn cases_cover_the_product() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            bench: BenchArgs,
        }
        let args = Cli::parse_from(["x"]).bench;
        let all = cases(&args, &[Isa::Scalar], 1).unwrap();
        assert_eq!(all.len(), 9 * 2 * 4);
        assert!(all.iter().all(|c| c.dtype == DType::F32));
        let args = Cli::parse_from([
            "x",
            "--shape",
            "2,3,4,5",
            "--op",
            "forward_inference,backward_inference",
            "--layout",
            "nchw",
            "--dtype",
            "f16",
            "--dtype",
            "bf16",
            "--threads",
            "1,2",
        ])
        .bench;
        let all = cases(&args, &[Isa::Scalar, Isa::Avx2], 2).unwrap();
        assert_eq!(all.len(), 2 * 2 * 2 * 2);
        assert!(all.iter().all(|c| c.shape == [2, 5, 3, 4]));
        assert_eq!(args.threads, [1, 2]);
        // f64 runs the portable kernels whatever the ISA: once, not once per ISA.
        let args = Cli::parse_from(["x", "--shape", "2,3,4,5", "--dtype", "f64,f32"]).bench;
        let all = cases(&args, &[Isa::Avx2, Isa::Scalar], 1).unwrap();
        let f64s = all.iter().filter(|c| c.dtype == DType::F64).count();
        assert_eq!((all.len() - f64s, f64s), (2 * 4 * 2, 2 * 4));
        // `all` is every op once, whatever else is named.
        let args = Cli::parse_from([
            "x",
            "--shape",
            "2,3,4,5",
            "--format",
            "nhwc",
            "--op",
            "second_order_training",
            "--op",
            "all,forward_training",
        ])
        .bench;
        let ops: Vec<BenchOp> = cases(&args, &[Isa::Scalar], 1)
            .unwrap()
            .iter()
            .map(|c| c.op)
            .collect();
        assert_eq!(ops.len(), BenchOp::ALL.len());
        assert_eq!(ops[0], BenchOp::SecondOrderTraining);
        assert!(BenchOp::ALL.iter().all(|op| ops.contains(op)));
        assert!(Cli::try_parse_from(["x", "--op", "second_order"]).is_err());
    }

    #[test]
    fn tensors_start_at_the_offset_asked_for() {
        fn check<T: Element>() {
            let data: Vec<T> = (0..1000)
                .map(|i| T::narrow(T::Stat::from_f64(i as f64)))
                .collect();
            for off in (0..LINE).step_by(8) {
                let p = Placed::new(data.clone(), off);
                assert_eq!(p.as_ptr() as usize % LINE, off, "{} +{off}", T::DTYPE);
                assert_eq!(p[..], data[..]);
            }
            assert!(Placed::<T>::new(Vec::new(), 16).is_empty());
            for off in [0, 16, 56] {
                let z = Placed::<T>::zeroed(1000, off);
                assert_eq!(z.as_ptr() as usize % LINE, off);
                assert!(z.len() == 1000 && z.iter().all(|v| *v == T::default()));
            }
        }
        check::<f32>();
        check::<f64>();
        check::<fusedbn::f16>();
        check::<fusedbn::bf16>();
        assert_eq!(parse_offset("16"), Ok(16));
        for bad in ["4", "64", "-8", "x"] {
            assert!(parse_offset(bad).is_err(), "{bad}");
        }
        // Every tensor of a case is placed, inputs and outputs, and the op still checks.
        for off in [0, 16, 56] {
            let mut c = case(
                BenchOp::SecondOrderTraining,
                DataFormat::Nchw,
                vec![2, 5, 7, 6],
                DType::F32,
            );
            c.offset = off;
            let mut w = Workload::<f32>::new(&c).unwrap();
            for t in [&w.x, &w.dy, &w.extra, &w.out, &w.out2] {
                assert_eq!(t.as_ptr() as usize % LINE, off);
            }
            w.run_op().unwrap();
            assert_eq!(w.check(), Ok(()), "+{off}");
            assert!(c.shape_str().ends_with(&format!("+{off}")) == (off != 0));
        }
    }

    #[test]
    fn the_copy_baseline_copies_and_reads() {
        let case = case(
            BenchOp::BackwardTraining,
            DataFormat::Nhwc,
            vec![1, 300, 300, 3],
            DType::F32,
        );
        let mut w = Workload::<f32>::new(&case).unwrap();
        w.run_copy();
        assert_eq!(w.out[..], w.dy[..]);
        assert_eq!(w.run_copy(), checksum(bytes_of(&w.x)));
        w.run_op().unwrap();
        assert_eq!(w.check(), Ok(()));
    }

    #[test]
    fn the_copy_baseline_of_the_ex_and_second_order_ops() {
        // k inputs, j outputs: the first j inputs are copied, the rest read.
        for (op, parallel) in [
            (BenchOp::ForwardTrainingEx, true),
            (BenchOp::BackwardTrainingEx, true),
            (BenchOp::SecondOrderTraining, true),
            (BenchOp::SecondOrderInference, false),
        ] {
            let shape = if parallel {
                vec![1, 300, 300, 3]
            } else {
                vec![1, 5, 5, 3]
            };
            let c = case(op, DataFormat::Nhwc, shape, DType::F32);
            let mut w = Workload::<f32>::new(&c).unwrap();
            assert_eq!(w.x.len() >= PARALLEL_MIN, parallel);
            let sum = w.run_copy();
            match op {
                BenchOp::ForwardTrainingEx => {
                    assert_eq!(w.out[..], w.x[..]);
                    assert!(w.out2.is_empty());
                }
                _ => {
                    assert_eq!(w.out[..], w.dy[..], "{op:?}");
                    assert_eq!(w.out2[..], w.x[..], "{op:?}");
                }
            }
            assert_eq!(sum, checksum(bytes_of(&w.extra)), "{op:?}");
            w.run_op().unwrap();
            assert_eq!(w.check(), Ok(()), "{op:?}");
        }
    }

    #[test]
    fn the_ex_gradient_is_masked() {
        let c = case(
            BenchOp::BackwardTrainingEx,
            DataFormat::Nchw,
            vec![2, 8, 8, 3],
            DType::F32,
        );
        let mut w = Workload::<f32>::new(&c).unwrap();
        w.run_op().unwrap();
        // The driver's forward output y (the mask: about 40 % not positive) masks a good
        // share of dy, and side_input_backprop is dy masked.
        let masked = w.extra.iter().filter(|&&v| v <= 0.0).count();
        assert!(
            masked > w.x.len() / 5 && masked < w.x.len() * 4 / 5,
            "{masked}"
        );
        let zeros = w.out2.iter().filter(|&&v| v == 0.0).count();
        assert!(zeros >= masked, "{zeros} < {masked}");
        for ((&g, &dy), &y) in w.out2.iter().zip(w.dy.iter()).zip(w.extra.iter()) {
            assert_eq!(g, if y > 0.0 { dy } else { 0.0 });
        }
        assert_eq!(w.check(), Ok(()));
    }

    #[test]
    fn half_precision_copies_its_own_bytes() {
        for op in BenchOp::ALL {
            let c = case(op, DataFormat::Nchw, vec![2, 40, 40, 3], DType::BF16);
            let m = measure::<fusedbn::bf16>(
                &c,
                Plan {
                    runs: 3,
                    min_time: Duration::ZERO,
                },
            )
            .unwrap();
            assert_eq!(m.bytes, (op.inputs() + op.outputs()) * 2 * 3 * 40 * 40 * 2);
            assert_eq!(m.bytes, c.bytes());
            assert_eq!((m.op.len(), m.copy.len()), (3, 3));
            assert_eq!(m.check, Ok(()), "{op:?}");
            let w = Workload::<fusedbn::bf16>::new(&c).unwrap();
            assert_eq!(std::mem::size_of_val(&w.out[..]), 2 * 3 * 40 * 40 * 2);
            assert_eq!(w.out2.len(), (op.outputs() - 1) * 3 * 40 * 40 * 2);
        }
    }

    #[test]
    fn the_check_covers_every_computed_output_and_can_fail() {
        for op in BenchOp::ALL {
            let c = case(op, DataFormat::Nhwc, vec![2, 5, 7, 6], DType::F32);
            let mut w = Workload::<f32>::new(&c).unwrap();
            w.run_op().unwrap();
            let names: Vec<&str> = w.report().unwrap().outputs.iter().map(|a| a.name).collect();
            let want: &[&str] = match op {
                BenchOp::ForwardTraining | BenchOp::ForwardTrainingEx => &[
                    "y",
                    "batch_mean",
                    "batch_variance",
                    "reserve_space_1",
                    "reserve_space_2",
                ],
                BenchOp::ForwardInference => &["y"],
                BenchOp::BackwardTraining | BenchOp::BackwardInference => {
                    &["x_backprop", "scale_backprop", "offset_backprop"]
                }
                BenchOp::BackwardTrainingEx => &[
                    "x_backprop",
                    "scale_backprop",
                    "offset_backprop",
                    "side_input_backprop",
                ],
                BenchOp::SecondOrderTraining | BenchOp::SecondOrderInference => {
                    &["grad_y_backprop", "grad_x", "grad_scale"]
                }
            };
            assert_eq!(names, want, "{op:?}");
            // One wrong element (in channel 0, always sampled) fails the check, and so
            // does one wrong statistic.
            let good = w.out[0];
            w.out[0] = good.widen() * 1.01 + 0.01;
            let e = w.check().unwrap_err();
            assert!(e.contains(want[0]), "{op:?}: {e}");
            w.out[0] = good;
            assert_eq!(w.check(), Ok(()), "{op:?}");
            let last = w.stat_out[0].len() - 1;
            w.stat_out[0][last] += 0.01 * w.stat_out[0][last].abs() + 0.01;
            if op != BenchOp::ForwardInference {
                assert!(w.check().is_err(), "{op:?}");
            }
        }
    }

    #[test]
    fn progress_lines_fit() {
        let c = case(
            BenchOp::BackwardInference,
            DataFormat::Ncdhw,
            vec![16, 1, 7, 7, 2048],
            DType::BF16,
        );
        let mut p = Progress::new(vec![1.0, 3.0]);
        p.width = 40;
        assert!(p.line(0, &c).starts_with("[------------------------] 1/2"));
        let l = p.line(1, &c);
        assert!(l.starts_with("[######------------------] 2/2"), "{l}");
        assert_eq!(l.chars().count(), 40);
    }
}
