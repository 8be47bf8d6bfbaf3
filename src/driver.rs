//! The driver: one description of a problem that the benchmark, the tests and
//! `fusedbn run --check` all speak, in the manner of oneDNN's benchdnn.
//!
//! - [`Case`]: an op, its attributes, the shape of `x` (given in logical
//!   `N, spatial…, C` order), the element type and how to fill the inputs;
//!   [`Case::inputs`] makes them (deterministic, in parallel), [`Case::run`] runs the
//!   op, [`Case::bytes`] says how many bytes the op must move at least.
//! - [`reference()`]: every output of any op in `f64`, from the op's named inputs, by the
//!   plain loops of [`crate::reference`] — for all channels or a sample of them (each
//!   channel's results depend only on that channel's data, so a sampled channel is
//!   checked exactly as in the whole tensor).
//! - [`check`]: the one tolerance policy (below), output by output.
//!
//! # Tolerance
//!
//! An output value `got` passes against the reference `want` when
//!
//! `|got − want| ≤ rel · scale + 2 · eps(T) · max(|want|, tiny(T))`
//!
//! where `T` is the output's element type (one rounding of T may separate the two;
//! `tiny(T)`, its smallest normal number, keeps that allowance at the spacing of T's
//! subnormals, where a rounding's error no longer shrinks with the value),
//! `rel` is `1e-4` when the statistics are `f32` (SPEC §7) and `1e-8` for `f64`, and
//! `scale` is the size of the terms the result is computed from, per output: the
//! largest `|want|`, or larger where the result is a difference of larger terms — the
//! data's standard deviation for a mean, `Σ|dy|` for `Σdy`, `|k1|·max|dy| + |k2|·max|x−μ|`
//! for `dx = (dy − dȳ)·k1 + (x − μ)·k2`. A sum kept too long in `f32` misses this by
//! orders of magnitude; correct rounding never comes near it. NaN must meet NaN.
//!
//! ```
//! use fusedbn::driver::{check, reference, Case, Fill};
//! use fusedbn::{ops::Op, DType, DataFormat};
//! let case = Case::new(Op::FusedBatchNormGradV3, DataFormat::Nchw, &[2, 5, 7, 3], DType::BF16)?
//!     .training(false)
//!     .fill(Fill::Constant { dy: 0.1 });
//! let inputs = case.inputs()?;
//! let outputs = case.run(&inputs)?;
//! let want = reference(case.op, &case.named(&inputs), &case.attrs, None)?;
//! let report = check(&want, &outputs)?;
//! assert!(report.worst() <= 1.0);
//! # Ok::<(), fusedbn::Error>(())
//! ```

use std::fmt;
use std::ops::Range;

use rayon::prelude::*;

use crate::batch_norm::Problem;
use crate::batch_norm::{
    Activation, Affine, Backward, GradInputs, Mode, SecondOrderInputs, Statistics,
};
use crate::element::{Element, Real};
use crate::error::{Error, Result};
use crate::format::DataFormat;
use crate::kernels::simd::Isa;
use crate::kernels::Geometry;
use crate::ops::{Attrs, Inputs, Op, Outputs};
use crate::reference as refr;
use crate::tensor::{DType, Tensor, TensorData};
use half::{bf16, f16};

/// How [`Case::inputs`] fills the tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum Fill {
    /// `x` normal around `mean` (plus a little per channel) with standard deviation
    /// `std`; the gradients standard normal plus a small offset.
    Random {
        /// Centre of `x`.
        mean: f64,
        /// Spread of `x`.
        std: f64,
    },
    /// `x` as in `Random { mean: 0, std: 1 }`; `y_backprop` (and the second-order
    /// upstream gradient) the constant `dy` everywhere — the case where a long `f32` sum
    /// drifts furthest.
    Constant {
        /// The value of every gradient element.
        dy: f64,
    },
    /// `x` as in the default `Random`, plus `step·n` in batch item `n`: images at
    /// different levels, as a batch's activations often are (no tile of a channel
    /// then has the mean of the channel's first pixels); the gradients as `Random`.
    Levels {
        /// The offset of each batch item from the one before.
        step: f64,
    },
}

impl Default for Fill {
    fn default() -> Self {
        Fill::Random {
            mean: 0.5,
            std: 1.5,
        }
    }
}

/// One op on one problem. Shapes are given in logical order `[N, spatial…, C]`
/// (the order `fusedbn bench --shape` takes) and laid out in the format's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// The op.
    pub op: Op,
    /// Its attributes (the data format among them).
    pub attrs: Attrs,
    /// The shape of `x` in the format's own axis order.
    pub shape: Vec<usize>,
    /// The element type of `x`.
    pub dtype: DType,
    /// How the inputs are filled.
    pub fill: Fill,
    /// For the Ex forward op: give a `side_input`.
    pub side_input: bool,
    /// Seed of the input generator.
    pub seed: u64,
    /// The instruction set [`Case::run`] runs the kernels with (default: the best this
    /// CPU has, or `FUSEDBN_ISA`).
    pub isa: Isa,
}

/// `[N, spatial…, C]` laid out in `format`'s axis order.
pub fn layout(format: DataFormat, logical: &[usize]) -> Result<Vec<usize>> {
    if logical.len() != format.rank() {
        return Err(Error::arg(
            "shape",
            format!(
                "{} dimensions N,{}C for {format}",
                format.rank(),
                if format.rank() == 5 { "D,H,W," } else { "H,W," }
            ),
            format!("{logical:?}"),
        ));
    }
    let (n, rest) = logical.split_at(1);
    let (spatial, c) = rest.split_at(rest.len() - 1);
    Ok(if format.is_channels_last() {
        logical.to_vec()
    } else {
        [n, c, spatial].concat()
    })
}

impl Case {
    /// A case with TensorFlow's default attributes in `format`, x of logical shape
    /// `[N, spatial…, C]`, the default fill and an Identity activation.
    pub fn new(op: Op, format: DataFormat, logical: &[usize], dtype: DType) -> Result<Self> {
        let shape = layout(format, logical)?;
        Problem::new(format, &shape)?;
        Ok(Case {
            op,
            attrs: Attrs::new().data_format(format),
            shape,
            dtype,
            fill: Fill::default(),
            side_input: false,
            seed: 1,
            isa: Isa::default_isa(),
        })
    }

    /// Sets `is_training`.
    pub fn training(mut self, t: bool) -> Self {
        self.attrs.is_training = t;
        self
    }

    /// Sets the fill.
    pub fn fill(mut self, f: Fill) -> Self {
        self.fill = f;
        self
    }

    /// Ex ops: a side input (forward) and a ReLU (both directions).
    pub fn ex(mut self, side_input: bool, relu: bool) -> Self {
        self.side_input = side_input;
        self.attrs.activation_mode = if relu {
            Activation::Relu
        } else {
            Activation::Identity
        };
        self
    }

    /// Sets `exponential_avg_factor`.
    pub fn factor(mut self, f: f32) -> Self {
        self.attrs.exponential_avg_factor = f;
        self
    }

    /// Sets the seed.
    pub fn seed(mut self, s: u64) -> Self {
        self.seed = s;
        self
    }

    /// Sets the instruction set of [`Case::run`] (checked when it runs: an ISA this CPU
    /// lacks makes `run` fail).
    pub fn isa(mut self, isa: Isa) -> Self {
        self.isa = isa;
        self
    }

    /// The problem (format, shape, epsilon).
    pub fn problem(&self) -> Result<Problem> {
        Ok(Problem::new(self.attrs.data_format, &self.shape)?.with_epsilon(self.attrs.epsilon))
    }

    /// The least number of bytes the op must move: each full-size input read once and
    /// each full-size output written once (what a copy of the same bytes moves).
    pub fn bytes(&self) -> usize {
        let (reads, writes) = self.full_size_io();
        (reads + writes) * self.elements() * self.dtype.size()
    }

    /// Full-size tensors read and written: `(reads, writes)`.
    pub fn full_size_io(&self) -> (usize, usize) {
        let relu = self.attrs.activation_mode == Activation::Relu && self.op.is_ex();
        if self.op.is_second_order() {
            (3, 2)
        } else if self.op.is_gradient() {
            let side = usize::from(self.op.is_ex());
            (2 + usize::from(relu), 1 + side)
        } else {
            (1 + usize::from(self.side_input && self.op.is_ex()), 1)
        }
    }

    /// Elements of `x`.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The op's inputs, named as TensorFlow names them, made deterministically from the
    /// fill and the seed. Statistics that a gradient takes are the fill's nominal
    /// per-channel mean and variance.
    pub fn inputs(&self) -> Result<Vec<(&'static str, Tensor)>> {
        let p = self.problem()?;
        let g = *p.geometry();
        let c = p.channels();
        let u = if self.dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let ((mean, std), step) = match self.fill {
            Fill::Random { mean, std } => ((mean, std), 0.0),
            Fill::Constant { .. } => ((0.0, 1.0), 0.0),
            Fill::Levels { step } => match Fill::default() {
                Fill::Random { mean, std } => ((mean, std), step),
                _ => ((0.5, 1.5), step),
            },
        };
        let centre = |ch: usize| mean + std * 0.25 * ((ch % 5) as f64 - 2.0);
        let spread = |ch: usize| std * (1.0 + 0.125 * (ch % 3) as f64);
        let constant = match self.fill {
            Fill::Constant { dy } => Some(dy),
            Fill::Random { .. } | Fill::Levels { .. } => None,
        };
        // The batch item of element `i` (N is the outermost axis in every format).
        let per_item = g.len() / self.shape.first().copied().unwrap_or(1).max(1);
        let level = |i: usize| step * (i / per_item.max(1)) as f64;
        let seed = self.seed;
        let full = |stream: u64, f: &(dyn Fn(usize, usize, f64) -> f64 + Sync)| -> Result<Tensor> {
            let at = |ch, i| f(ch, i, normal(seed, stream, i));
            generate(self.dtype, self.shape.clone(), &g, &at)
        };
        // A per-channel vector: the geometry of `c` channels of one element.
        let vector = |f: &(dyn Fn(usize) -> f64 + Sync)| {
            generate(u, vec![c], &Geometry::new(1, c, 1), &|ch, _| f(ch))
        };
        let gradient = |ch: usize, z: f64| constant.unwrap_or(0.1 + 0.9 * z + 0.05 * ch as f64);
        let mut out = Vec::new();
        for &name in self.op.input_names() {
            let t = match name {
                "x" => full(1, &|ch, i, z| centre(ch) + spread(ch) * z + level(i))?,
                "y_backprop" => full(2, &|ch, _, z| gradient(ch, z))?,
                "grad_x_backprop" => full(3, &|ch, _, z| gradient(ch, z))?,
                "side_input" if self.side_input => full(4, &|_, _, z| 0.5 * z)?,
                "side_input" => continue,
                // The forward output of a ReLU: about 60 % positive (the gradient's mask).
                "y" => full(5, &|_, _, z| 0.25 + z)?,
                "scale" => vector(&|ch| 0.5 + 0.125 * (ch % 7) as f64)?,
                "offset" => vector(&|ch| 0.1 * (ch % 5) as f64 - 0.2)?,
                "mean" | "reserve_space_1" => vector(&centre)?,
                "variance" | "reserve_space_2" => vector(&|ch| spread(ch) * spread(ch))?,
                "reserve_space_3" => Tensor::empty(u),
                "grad_scale_backprop" => vector(&|ch| 0.3 - 0.1 * (ch % 4) as f64)?,
                "grad_offset_backprop" => vector(&|ch| 0.2 * (ch % 3) as f64 - 0.1)?,
                other => {
                    return Err(Error::arg(
                        "input",
                        "an input name the driver knows",
                        other.to_string(),
                    ))
                }
            };
            out.push((name, t));
        }
        Ok(out)
    }

    /// The inputs as the op layer takes them.
    pub fn named<'a>(&self, inputs: &'a [(&'static str, Tensor)]) -> Inputs<'a> {
        let mut named = Inputs::new();
        for (n, t) in inputs {
            named.insert(n, t);
        }
        named
    }

    /// Runs the op on `inputs` (from [`Case::inputs`]) with [`Case::isa`]'s kernels.
    pub fn run(&self, inputs: &[(&'static str, Tensor)]) -> Result<Outputs> {
        self.op
            .run_with_isa(&self.named(inputs), &self.attrs, self.isa)
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {:?} {} {}",
            self.op,
            self.attrs.data_format,
            self.shape,
            self.dtype,
            if self.attrs.is_training {
                "training"
            } else {
                "inference"
            }
        )?;
        if self.op.is_ex() {
            write!(
                f,
                " side={} act={}",
                self.side_input,
                self.attrs.activation_mode.as_str()
            )?;
        }
        write!(f, " {:?} seed={} isa={}", self.fill, self.seed, self.isa)
    }
}

/// A deterministic, roughly standard normal value for element `i` of stream `stream`:
/// the sum of four 16-bit uniforms from one splitmix64 hash (Irwin–Hall, mean 0,
/// variance 1, within ±3.47), independent of evaluation order and cheap enough for
/// tensors of 10^8 elements.
fn normal(seed: u64, stream: u64, i: usize) -> f64 {
    let mut z = (i as u64) ^ seed.rotate_left(32) ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let sum = (z & 0xFFFF) + ((z >> 16) & 0xFFFF) + ((z >> 32) & 0xFFFF) + (z >> 48);
    (sum as f64 / 65536.0 - 2.0) * 3f64.sqrt()
}

/// A tensor of `dtype` and geometry `g` from `f(channel, i)` for its element `i`
/// (rounded to nearest even), made in parallel: walked a run of a channel at a time,
/// so no element's channel is found by division.
fn generate(
    dtype: DType,
    shape: Vec<usize>,
    g: &Geometry,
    f: &(dyn Fn(usize, usize) -> f64 + Sync),
) -> Result<Tensor> {
    fn go<T: Element>(g: &Geometry, f: &(dyn Fn(usize, usize) -> f64 + Sync)) -> Vec<T> {
        let n = g.len();
        let row = g.channels * g.inner;
        let mut out = vec![T::narrow(T::Stat::from_f64(0.0)); n];
        if n == 0 {
            return out;
        }
        // Tasks of whole rows (every channel's run of one outer index), at least 16 K
        // elements where rows are short.
        let rows = (1usize << 14).div_ceil(row).max(1);
        out.par_chunks_mut(row * rows)
            .enumerate()
            .for_each(|(t, chunk)| {
                let mut i = t * row * rows;
                for r in chunk.chunks_mut(row) {
                    for (ch, run) in r.chunks_mut(g.inner).enumerate() {
                        for o in run {
                            *o = T::narrow(T::Stat::from_f64(f(ch, i)));
                            i += 1;
                        }
                    }
                }
            });
        out
    }
    let data = match dtype {
        DType::F16 => TensorData::F16(go(g, f)),
        DType::BF16 => TensorData::BF16(go(g, f)),
        DType::F32 => TensorData::F32(go(g, f)),
        DType::F64 => TensorData::F64(go(g, f)),
    };
    Tensor::from_data(shape, data)
}

/// Where an output's expected values sit.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// The shape of `x`: the elements of the checked channels, channel by channel, each
    /// in storage order.
    Elementwise,
    /// One value per checked channel.
    PerChannel,
    /// TensorFlow's empty placeholder output.
    Placeholder,
}

/// The reference values of one output.
#[derive(Clone, Debug, PartialEq)]
pub struct Expected {
    /// The output's name.
    pub name: &'static str,
    /// Where the values sit.
    pub placement: Placement,
    /// The values (see [`Placement`]).
    pub values: Vec<f64>,
    /// The size of the terms the output is computed from (see the module docs).
    pub scale: f64,
    /// What rounding the batch mean to the statistics type can change the output by
    /// (the kernels, like TensorFlow's, centre `x` on the rounded mean): added to the
    /// tolerance; 0 where no computed mean is involved.
    pub floor: f64,
}

/// The reference outputs of an op and where they sit.
#[derive(Clone, Debug, PartialEq)]
pub struct Reference {
    /// The geometry of `x`.
    pub geometry: Geometry,
    /// The channels checked, in order.
    pub channels: Vec<usize>,
    /// The statistics type (`f32`, or `f64` for `f64` data): sets the tolerance.
    pub stat_dtype: DType,
    /// One entry per output, in the op's order.
    pub outputs: Vec<Expected>,
}

/// Storage indices of channel `c`'s elements at outer indices `outer`, in order: one
/// range per outer index.
fn runs(g: &Geometry, c: usize, outer: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let (inner, stride) = (g.inner, g.channels * g.inner);
    outer.map(move |o| {
        let base = o * stride + c * inner;
        base..base + inner
    })
}

/// The values of channel `c` of a full-size input, widened.
fn gather(t: &Tensor, g: &Geometry, c: usize) -> Vec<f64> {
    fn go<T: Element>(v: &[T], g: &Geometry, c: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(g.per_channel());
        if g.inner == 1 {
            // Channels-last: one element a pixel, `channels` apart.
            let all = v.get(c..).unwrap_or_default();
            out.extend(
                all.iter()
                    .step_by(g.channels.max(1))
                    .map(|e| e.widen().to_f64()),
            );
            return out;
        }
        for run in runs(g, c, 0..g.outer) {
            out.extend(v[run].iter().map(|e| e.widen().to_f64()));
        }
        out
    }
    match t.data() {
        TensorData::F16(v) => go(v, g, c),
        TensorData::BF16(v) => go(v, g, c),
        TensorData::F32(v) => go(v, g, c),
        TensorData::F64(v) => go(v, g, c),
    }
}

/// One channel's part of one output: output index, values, scale, floor.
type Piece = (usize, Vec<f64>, f64, f64);

/// The reference outputs of `op` on `inputs` with `attrs`, for every channel or only
/// `channels`. The inputs must be valid for the op (run the op first: it validates);
/// a missing input or a wrong length is an error here too, never a panic.
pub fn reference(
    op: Op,
    inputs: &Inputs<'_>,
    attrs: &Attrs,
    channels: Option<&[usize]>,
) -> Result<Reference> {
    let get = |name: &str| {
        inputs.get(name).ok_or_else(|| Error::MissingInput {
            op: op.name().into(),
            name: name.into(),
            why: "needed by the reference".into(),
        })
    };
    let x = get("x")?;
    let p = Problem::new(attrs.data_format, x.shape())?;
    let g = *p.geometry();
    let c = p.channels();
    let channels: Vec<usize> = match channels {
        Some(list) => list.to_vec(),
        None => (0..c).collect(),
    };
    if let Some(&bad) = channels.iter().find(|&&ch| ch >= c) {
        return Err(Error::arg(
            "channel",
            format!("a channel below {c}"),
            bad.to_string(),
        ));
    }
    let full = |name: &str| -> Result<Option<&Tensor>> {
        match inputs.get(name) {
            Some(t) if t.numel() != x.numel() => Err(Error::arg(
                name,
                format!("{} elements (the size of x)", x.numel()),
                t.numel().to_string(),
            )),
            t => Ok(t),
        }
    };
    let vector = |name: &str| -> Result<Option<Vec<f64>>> {
        match inputs.get(name) {
            Some(t) if t.numel() != c => Err(Error::arg(
                name,
                format!("{c} elements (the channel count of x)"),
                t.numel().to_string(),
            )),
            Some(t) => Ok(Some(t.to_f64_vec())),
            None => Ok(None),
        }
    };
    let need = |v: Option<Vec<f64>>, name: &str| {
        v.ok_or_else(|| Error::MissingInput {
            op: op.name().into(),
            name: name.into(),
            why: "needed by the reference".into(),
        })
    };
    let eps = f64::from(attrs.epsilon);
    let relu = op.is_ex() && attrs.activation_mode == Activation::Relu;
    let stat_dtype = if x.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let names = op.output_names();
    let idx = |n: &str| names.iter().position(|m| *m == n);
    // One channel at a time (in parallel), as a channel-local problem: the channel's M
    // values as NHWC [M, 1, 1, 1].
    let one = |ch: usize| -> Result<Vec<Piece>> {
        let mut outs = Vec::new();
        let xs = gather(x, &g, ch);
        let m = xs.len();
        let cp = Problem::new(DataFormat::Nhwc, &[m, 1, 1, 1])?.with_epsilon(attrs.epsilon);
        let at = |v: &[f64]| vec![v[ch]];
        let mut put = |name: &str, v: &[f64], scale: f64, floor: f64| {
            if let Some(i) = idx(name) {
                outs.push((i, v.to_vec(), scale, floor));
            }
        };
        let u_eps = 2.0 * stat_dtype.epsilon();
        let max_abs = |v: &[f64]| {
            v.iter()
                .filter(|a| a.is_finite())
                .fold(0f64, |m, a| m.max(a.abs()))
        };
        let sum_abs = |v: &[f64]| v.iter().map(|a| a.abs()).sum::<f64>();
        if !op.is_gradient() {
            let scale = need(vector("scale")?, "scale")?;
            let offset = need(vector("offset")?, "offset")?;
            let side = full("side_input")?.map(|t| gather(t, &g, ch));
            // Training with factor 1 reads no running statistics (TensorFlow passes
            // empty ones): ignore them, as the op does.
            let (mean, var) = if attrs.is_training && attrs.exponential_avg_factor == 1.0 {
                (None, None)
            } else {
                (vector("mean")?, vector("variance")?)
            };
            let (sc, of) = (at(&scale), at(&offset));
            let affine = Affine {
                scale: &sc,
                offset: &of,
            };
            let f = if attrs.is_training {
                let (mi, vi) = (
                    mean.as_deref().map_or(vec![0.0], at),
                    var.as_deref().map_or(vec![0.0], at),
                );
                let running = Statistics {
                    mean: &mi,
                    variance: &vi,
                };
                let mode = refr::ForwardMode::Training {
                    running: Some(running),
                    factor: f64::from(attrs.exponential_avg_factor),
                };
                refr::forward(&cp, &xs, affine, mode)
            } else {
                let (mi, vi) = (need(mean, "mean")?, need(var, "variance")?);
                let (mi, vi) = (at(&mi), at(&vi));
                let stats = Statistics {
                    mean: &mi,
                    variance: &vi,
                };
                refr::forward(&cp, &xs, affine, refr::ForwardMode::Inference(stats))
            };
            let act = if op.is_ex() { relu } else { false };
            let y = refr::epilogue(&f.y, side.as_deref(), act);
            let mu = f.reserve_space_1[0];
            let a = scale[ch] / (f.reserve_space_2[0] + eps).sqrt();
            let y_scale = xs.iter().map(|v| ((v - mu) * a).abs()).fold(0f64, f64::max)
                + offset[ch].abs()
                + side.as_deref().map_or(0.0, max_abs);
            let std = f.reserve_space_2[0].abs().sqrt();
            let mean_rounding = if attrs.is_training {
                u_eps * (mu * a).abs()
            } else {
                0.0
            };
            put("y", &y, y_scale.max(max_abs(&y)), mean_rounding);
            put("batch_mean", &f.batch_mean, std, 0.0);
            put("reserve_space_1", &f.reserve_space_1, std, 0.0);
            put(
                "batch_variance",
                &f.batch_variance,
                max_abs(&f.batch_variance),
                0.0,
            );
            put(
                "reserve_space_2",
                &f.reserve_space_2,
                max_abs(&f.reserve_space_2),
                0.0,
            );
        } else if op.is_second_order() {
            let g_in = gather(
                full("y_backprop")?.ok_or_else(|| missing(op, "y_backprop"))?,
                &g,
                ch,
            );
            let ga = gather(
                full("grad_x_backprop")?.ok_or_else(|| missing(op, "grad_x_backprop"))?,
                &g,
                ch,
            );
            let scale = need(vector("scale")?, "scale")?;
            let rs1 = need(vector("reserve_space_1")?, "reserve_space_1")?;
            let rs2 = need(vector("reserve_space_2")?, "reserve_space_2")?;
            let gs = need(vector("grad_scale_backprop")?, "grad_scale_backprop")?;
            let go = need(vector("grad_offset_backprop")?, "grad_offset_backprop")?;
            let (sc1, m1, v1, gs1, go1) = (at(&scale), at(&rs1), at(&rs2), at(&gs), at(&go));
            let inputs = SecondOrderInputs {
                y_backprop: &g_in,
                x: &xs,
                scale: &sc1,
                reserve: Statistics {
                    mean: &m1,
                    variance: &v1,
                },
                grad_x_backprop: &ga,
                grad_scale_backprop: &gs1,
                grad_offset_backprop: &go1,
            };
            let mode = if attrs.is_training {
                Mode::Training
            } else {
                Mode::Inference
            };
            let r = refr::second_order(&cp, inputs, mode);
            let sc = second_order_scales(inputs, eps, attrs.is_training);
            let mean_rounding = |k: f64| if attrs.is_training { u_eps * k } else { 0.0 };
            put(
                "grad_y_backprop",
                &r.grad_y_backprop,
                sc[0].max(max_abs(&r.grad_y_backprop)),
                mean_rounding(sc[3]),
            );
            put(
                "grad_x",
                &r.grad_x,
                sc[1].max(max_abs(&r.grad_x)),
                mean_rounding(sc[4]),
            );
            put(
                "grad_scale",
                &r.grad_scale,
                sc[2].max(max_abs(&r.grad_scale)),
                0.0,
            );
        } else {
            let mut dy = gather(
                full("y_backprop")?.ok_or_else(|| missing(op, "y_backprop"))?,
                &g,
                ch,
            );
            let scale = need(vector("scale")?, "scale")?;
            let rs1 = need(vector("reserve_space_1")?, "reserve_space_1")?;
            let rs2 = need(vector("reserve_space_2")?, "reserve_space_2")?;
            if relu {
                let y = gather(full("y")?.ok_or_else(|| missing(op, "y"))?, &g, ch);
                dy = refr::relu_mask(&dy, &y);
            }
            let (sc1, m1, v1) = (at(&scale), at(&rs1), at(&rs2));
            let stats = Statistics {
                mean: &m1,
                variance: &v1,
            };
            let mode = if attrs.is_training {
                Backward::Training(stats)
            } else {
                Backward::Inference(stats)
            };
            let inputs = GradInputs {
                y_backprop: &dy,
                x: &xs,
            };
            let r = refr::backward(&cp, inputs, &sc1, mode);
            let rr = 1.0 / (rs2[ch] + eps).sqrt();
            let k1 = (scale[ch] * rr).abs();
            let xc_max = xs.iter().map(|v| (v - rs1[ch]).abs()).fold(0f64, f64::max);
            let dy_max = max_abs(&dy);
            let dx_scale = if attrs.is_training {
                let mf = m.max(1) as f64;
                let dm = r.offset_backprop[0].abs() / mf;
                let k2 = k1
                    * rr
                    * rr
                    * sum_abs(
                        &dy.iter()
                            .zip(&xs)
                            .map(|(d, v)| d * (v - rs1[ch]))
                            .collect::<Vec<_>>(),
                    )
                    / mf;
                k1 * (dy_max + dm) + k2 * xc_max
            } else {
                k1 * dy_max
            };
            let sdx: f64 = dy
                .iter()
                .zip(&xs)
                .map(|(d, v)| (d * (v - rs1[ch])).abs())
                .sum();
            put(
                "x_backprop",
                &r.x_backprop,
                dx_scale.max(max_abs(&r.x_backprop)),
                0.0,
            );
            put("scale_backprop", &r.scale_backprop, rr * sdx, 0.0);
            put("offset_backprop", &r.offset_backprop, sum_abs(&dy), 0.0);
            put("side_input_backprop", &dy, dy_max, 0.0);
        }
        Ok(outs)
    };
    let per: Vec<Vec<Piece>> = channels
        .par_iter()
        .map(|&ch| one(ch))
        .collect::<Result<_>>()?;
    let mut values: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let mut scales = vec![(0f64, 0f64); names.len()];
    for (i, v, scale, floor) in per.into_iter().flatten() {
        values[i].extend(v);
        scales[i] = (scales[i].0.max(scale), scales[i].1.max(floor));
    }
    let outputs = names
        .iter()
        .zip(values.into_iter().zip(scales))
        .map(|(&name, (values, (scale, floor)))| {
            let placement = match name {
                "y" | "x_backprop" | "side_input_backprop" | "grad_y_backprop" | "grad_x" => {
                    Placement::Elementwise
                }
                "reserve_space_3" | "reserve_space_4" | "reserve_space_5" => Placement::Placeholder,
                _ if op.is_gradient() && !op.is_second_order() && name.starts_with("reserve") => {
                    Placement::Placeholder
                }
                _ => Placement::PerChannel,
            };
            Expected {
                name,
                placement,
                values,
                scale,
                floor,
            }
        })
        .collect();
    Ok(Reference {
        geometry: g,
        channels,
        stat_dtype,
        outputs,
    })
}

fn missing(op: Op, name: &str) -> Error {
    Error::MissingInput {
        op: op.name().into(),
        name: name.into(),
        why: "needed by the reference".into(),
    }
}

/// The term sizes of the three second-order outputs of one channel: the same formulas
/// as [`crate::reference::second_order`] with every term taken by its absolute value,
/// then (training) the effect of a rounded mean on grad_y and grad_x, per unit of rounding.
fn second_order_scales(inputs: SecondOrderInputs<'_, f64>, eps: f64, training: bool) -> [f64; 5] {
    // One channel: the per-channel inputs hold one value each.
    let (g, x, ga) = (inputs.y_backprop, inputs.x, inputs.grad_x_backprop);
    let first = |v: &[f64]| v.first().copied().unwrap_or(0.0);
    let (sc, rs1, rs2) = (
        first(inputs.scale),
        first(inputs.reserve.mean),
        first(inputs.reserve.variance),
    );
    let (gs, go) = (
        first(inputs.grad_scale_backprop),
        first(inputs.grad_offset_backprop),
    );
    let m = x.len().max(1) as f64;
    let (mu, var) = if training {
        let mu = x.iter().sum::<f64>() / m;
        (mu, x.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / m)
    } else {
        (rs1, rs2)
    };
    let (sc, gs, go) = (sc.abs(), gs.abs(), go.abs());
    let r = 1.0 / (var + eps).sqrt();
    let xh: Vec<f64> = x.iter().map(|v| (v - mu) * r).collect();
    let mean = |f: &dyn Fn(usize) -> f64| (0..x.len()).map(f).sum::<f64>() / m;
    let max = |f: &dyn Fn(usize) -> f64| (0..x.len()).map(f).fold(0f64, f64::max);
    let (gbar, abar) = (mean(&|i| g[i]), mean(&|i| ga[i]));
    // Sums of absolute terms: a computed mean of products is off by about
    // eps·mean|product|, however small the exact mean (a constant g has s2 = 0).
    let s2 = mean(&|i| (g[i] * xh[i]).abs());
    let t = mean(&|i| (ga[i] * xh[i]).abs());
    let k = mean(&|i| (ga[i] * (g[i] - gbar)).abs() + (ga[i] * gbar).abs());
    let xm = max(&|i| xh[i].abs());
    // Differences from the means: the terms' size, not the (possibly 0) difference.
    let gm = max(&|i| g[i].abs()) + gbar.abs();
    let am = max(&|i| ga[i].abs()) + abar.abs();
    if training {
        let gy = sc * r * (max(&|i| ga[i].abs()) + abar.abs() + xm * t) + gs * xm + go;
        let gx =
            sc * r * r * (xm * (k + 3.0 * s2 * t) + gm * t + am * s2) + gs * r * (gm + xm * s2);
        let gsc = r
            * (0..x.len())
                .map(|i| (ga[i] * (g[i] - gbar)).abs() + (ga[i] * xh[i] * s2).abs())
                .sum::<f64>();
        // Coefficients of x̂ in grad_y and grad_x, times |μ|·r: the effect of rounding μ.
        let (cy, cx) = (
            sc * r * t + gs,
            sc * r * r * (k + 3.0 * s2 * t) + gs * r * s2,
        );
        [gy, gx, gsc, cy * mu.abs() * r, cx * mu.abs() * r]
    } else {
        let gy = sc * r * max(&|i| ga[i].abs()) + gs * r * max(&|i| (x[i] - mu).abs()) + go;
        let gx = gs * r * max(&|i| g[i].abs());
        let gsc = r * (0..x.len()).map(|i| (ga[i] * g[i]).abs()).sum::<f64>();
        [gy, gx, gsc, 0.0, 0.0]
    }
}

/// How closely one output agreed with the reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Agreement {
    /// The output's name.
    pub name: &'static str,
    /// Values compared.
    pub compared: usize,
    /// Values bit-identical to the reference rounded to the output's type.
    pub exact: usize,
    /// The largest `|got − want| / tolerance` (≤ 1 passes).
    pub worst: f64,
    /// Largest `|got − want|` relative to the output's scale.
    pub max_rel: f64,
}

/// The agreement of every output.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// One per compared output, in the op's order.
    pub outputs: Vec<Agreement>,
}

impl Report {
    /// The largest error in units of the tolerance over all outputs (≤ 1 passes).
    pub fn worst(&self) -> f64 {
        self.outputs.iter().map(|a| a.worst).fold(0.0, f64::max)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.outputs.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(
                f,
                "{:<22} {:>10} values, {:>6.2} % exact, max error {:.2e} of scale, {:.3} of tolerance",
                a.name,
                a.compared,
                if a.compared == 0 {
                    100.0
                } else {
                    100.0 * a.exact as f64 / a.compared as f64
                },
                a.max_rel,
                a.worst
            )?;
        }
        Ok(())
    }
}

/// The relative part of the tolerance for statistics of type `u`.
pub fn relative_tolerance(u: DType) -> f64 {
    if u == DType::F64 {
        // The f64 reference's own plain sums are only this good at M = 10^6 and
        // |mean| / std = 1e4.
        1e-8
    } else {
        1e-4
    }
}

/// Compares `outputs` with the reference under the one tolerance policy (module docs).
/// Fails with the first value out of tolerance (channel-major: in channel order;
/// channels-last: in blocks of pixels, each block channel by channel), naming the
/// output, the element (its channel and storage index) and both values.
pub fn check(want: &Reference, outputs: &Outputs) -> Result<Report> {
    let g = &want.geometry;
    // A `Reference`'s fields are public: one edited into an impossible state (a channel
    // past C, a geometry whose size overflows) is an error here, not an index out of
    // bounds in the loops below.
    let size = g
        .outer
        .checked_mul(g.channels)
        .and_then(|n| n.checked_mul(g.inner));
    if size.is_none() {
        return Err(Error::arg(
            "reference",
            "a geometry whose size fits in usize",
            format!("{g:?}"),
        ));
    }
    if let Some(&c) = want.channels.iter().find(|&&c| c >= g.channels) {
        return Err(Error::arg(
            "reference",
            format!("channels below {}", g.channels),
            format!("channel {c}"),
        ));
    }
    let rel = relative_tolerance(want.stat_dtype);
    let mut report = Report {
        outputs: Vec::new(),
    };
    for e in &want.outputs {
        let got = outputs
            .get(e.name)
            .ok_or_else(|| Error::arg("outputs", format!("an output named {}", e.name), "none"))?;
        let fail =
            |what: String| Error::arg(e.name, "values within tolerance of the f64 reference", what);
        if e.placement == Placement::Placeholder {
            if got.numel() != 0 {
                return Err(fail(format!("{} elements in a placeholder", got.numel())));
            }
            continue;
        }
        let per_channel = e.placement == Placement::PerChannel;
        let expected_len = if per_channel { g.channels } else { g.len() };
        let per = if per_channel { 1 } else { g.per_channel() };
        if got.numel() != expected_len || want.channels.len() * per != e.values.len() {
            return Err(fail(format!(
                "{} elements, expected {expected_len}",
                got.numel()
            )));
        }
        let dtype = got.dtype();
        let policy = Policy {
            dtype,
            ulp: 2.0 * dtype.epsilon(),
            tiny: smallest_normal(dtype),
            rel,
            scale: e.scale,
            floor: e.floor,
        };
        // Only the compared elements are widened (a sample of channels of a tensor of
        // 2^31 elements must not need 16 GiB of f64). The loop is compiled once per
        // element type (`tally`), in parallel where there are many values: tasks of
        // one channel and a block of rows (channel-major), or of a block of pixels
        // and every checked channel (channels-last, so that the block's lines are
        // read once, not once a channel).
        let nk = want.channels.len();
        let outer = g.outer;
        let tasks: Vec<(Range<usize>, Range<usize>)> = if per_channel {
            vec![(0..nk, 0..1)]
        } else if g.inner == 1 {
            let b = ((1usize << 15) / nk.max(1)).max(64);
            (0..outer)
                .step_by(b)
                .map(|o| (0..nk, o..(o + b).min(outer)))
                .collect()
        } else {
            let b = ((1usize << 16) / g.inner.max(1)).max(1);
            (0..nk)
                .flat_map(|k| {
                    (0..outer)
                        .step_by(b)
                        .map(move |o| (k..k + 1, o..(o + b).min(outer)))
                })
                .collect()
        };
        let one = |(ks, os): (Range<usize>, Range<usize>)| -> std::result::Result<Tally, String> {
            let part = Part {
                g,
                channels: &want.channels,
                ks,
                os,
                values: &e.values,
                per,
                per_channel,
            };
            match got.data() {
                TensorData::F16(v) => tally(v, &part, &policy),
                TensorData::BF16(v) => tally(v, &part, &policy),
                TensorData::F32(v) => tally(v, &part, &policy),
                TensorData::F64(v) => tally(v, &part, &policy),
            }
        };
        let tallies: Vec<_> = if e.values.len() >= 1 << 16 {
            tasks.into_par_iter().map(one).collect()
        } else {
            tasks.into_iter().map(one).collect()
        };
        let mut a = Agreement {
            name: e.name,
            compared: 0,
            exact: 0,
            worst: 0.0,
            max_rel: 0.0,
        };
        let mut max_err = 0f64;
        // The first failure in task order.
        for t in tallies {
            let t = t.map_err(fail)?;
            a.compared += t.compared;
            a.exact += t.exact;
            a.worst = a.worst.max(t.worst);
            max_err = max_err.max(t.max_err);
        }
        // max(err / scale) = max(err) / scale: division by a positive constant keeps
        // the order, and rounds monotonically.
        if e.scale > 0.0 {
            a.max_rel = max_err / e.scale;
        }
        report.outputs.push(a);
    }
    Ok(report)
}

/// The tolerance of one output (module docs): `rel · scale + ulp · max(|want|, tiny) +
/// floor`.
struct Policy {
    dtype: DType,
    ulp: f64,
    tiny: f64,
    rel: f64,
    scale: f64,
    floor: f64,
}

/// One task's agreement with the reference.
#[derive(Default)]
struct Tally {
    compared: usize,
    exact: usize,
    worst: f64,
    max_err: f64,
}

/// The values one task of [`check`] compares: channels `ks` of `channels` (indices
/// into the reference's list), outer indices `os`.
struct Part<'a> {
    g: &'a Geometry,
    channels: &'a [usize],
    ks: Range<usize>,
    os: Range<usize>,
    /// The reference's values of the output, channel after channel.
    values: &'a [f64],
    /// Values per channel in `values`.
    per: usize,
    per_channel: bool,
}

/// Compares the values of `v` in `part` (one value a channel where `per_channel`, else
/// elements in storage order) with the reference's; the error names the first value
/// out of tolerance (its channel and storage index, both values, the tolerance).
///
/// No division per value: the ratio to the tolerance is computed only where it may
/// raise the worst so far, and only an error above the tolerance can fail (most of the
/// large-scale tests' time went to the check while it divided twice per value through
/// an out-of-line closure, a channel at a time over channels-last tensors).
fn tally<T: Element>(v: &[T], part: &Part<'_>, p: &Policy) -> std::result::Result<Tally, String> {
    let mut t = Tally::default();
    let base = p.rel * p.scale + p.floor;
    let mut judge = |c: usize, i: usize, v: f64, w: f64| -> std::result::Result<(), String> {
        t.compared += 1;
        if w.is_nan() || v.is_nan() {
            if w.is_nan() && v.is_nan() {
                t.exact += 1;
                return Ok(());
            }
            return Err(format!("channel {c}, element {i}: got {v}, expected {w}"));
        }
        let err = (v - w).abs();
        let wa = w.abs().max(p.tiny);
        // `v` is `w` rounded to the output's type: equal, or within a spacing of `w`
        // (the bound only spares the rounding where it cannot hold).
        if v == w {
            t.exact += 1;
            return Ok(()); // Infinities too, whose difference is NaN.
        }
        if err <= p.ulp * wa && v == round_to(p.dtype, w) {
            t.exact += 1;
        }
        let tol = base + p.ulp * wa;
        t.max_err = t.max_err.max(err);
        // Only an error above `worst · tol` can raise the worst ratio, and only one
        // above `tol` can fail; an error that is not finite (an infinity against a
        // finite value or the other infinity) takes the division too: its infinite or
        // NaN ratio fails.
        if err > t.worst * tol || !err.is_finite() {
            let ratio = if tol > 0.0 { err / tol } else { f64::INFINITY };
            t.worst = t.worst.max(ratio);
            if ratio.is_nan() || ratio > 1.0 {
                return Err(format!(
                    "channel {c}, element {i}: got {v}, expected {w} (error {err:.3e}, tolerance {tol:.3e}: {:e}·{:.3e} + {:e}·max(|expected|, {:e}) + {:.3e})",
                    p.rel, p.scale, p.ulp, p.tiny, p.floor
                ));
            }
        }
        Ok(())
    };
    let inner = part.g.inner;
    for k in part.ks.clone() {
        let c = part.channels[k];
        if part.per_channel {
            if let Some(&w) = part.values.get(k) {
                judge(c, c, v[c].widen().to_f64(), w)?;
            }
            continue;
        }
        for (o, run) in part.os.clone().zip(runs(part.g, c, part.os.clone())) {
            let wants = &part.values[k * part.per + o * inner..][..inner];
            let first = run.start;
            for (j, (x, &w)) in v[run].iter().zip(wants).enumerate() {
                judge(c, first + j, x.widen().to_f64(), w)?;
            }
        }
    }
    Ok(t)
}

/// The smallest positive normal number of `d`: below it the spacing of `d` is fixed
/// (`2 · eps · tiny`), so one rounding may cost that much however small the value.
/// (An f16 `x_backprop` of 1.016e-5 is stored to a step of 2^-24 = 6e-8.)
fn smallest_normal(d: DType) -> f64 {
    match d {
        DType::F16 => 2f64.powi(-14),
        DType::BF16 => 2f64.powi(-126),
        DType::F32 => f64::from(f32::MIN_POSITIVE),
        DType::F64 => f64::MIN_POSITIVE,
    }
}

#[inline]
fn round_to(d: DType, v: f64) -> f64 {
    match d {
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        DType::F64 => v,
    }
}
