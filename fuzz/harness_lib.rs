//! The checks behind the `npy` and `ops` fuzz targets, in plain stable Rust.
//!
//! Included with `#[path]` by `fuzz/fuzz_targets/{npy,ops}.rs` (libFuzzer, nightly) and by
//! `tests/fuzz_regressions.rs` (stable), which replays every input committed under
//! `fuzz/regressions/{npy,ops}/`. Each function takes the raw fuzz bytes and panics if,
//! and only if, the library broke a promise.

use fusedbn::ops::{Attrs, Inputs, Op};
use fusedbn::{batch_norm::Activation, bf16, f16, npy, DType, DataFormat, Tensor, TensorData};

/// `npy::from_bytes` on arbitrary bytes: never panics (an error is fine, and its message
/// must format); a tensor it accepts is consistent, and `npy::to_bytes` of it reads back
/// bit for bit (NaN payloads included), and writes back to the same bytes.
pub fn npy(data: &[u8]) {
    let t = match npy::from_bytes(data) {
        Ok(t) => t,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert_eq!(
        Some(t.data().len()),
        t.shape().iter().try_fold(1usize, |n, &d| n.checked_mul(d)),
        "shape {:?} and element count disagree",
        t.shape()
    );
    assert_eq!(t.dtype(), t.data().dtype());
    let bytes = npy::to_bytes(&t)
        .unwrap_or_else(|e| panic!("to_bytes refused a tensor from_bytes accepted: {e}"));
    let back = npy::from_bytes(&bytes)
        .unwrap_or_else(|e| panic!("from_bytes refused what to_bytes wrote: {e}"));
    assert_eq!(back.shape(), t.shape());
    assert_eq!(back.dtype(), t.dtype());
    assert!(
        bits(&back) == bits(&t),
        "the data changed on the round trip"
    );
    let again = npy::to_bytes(&back).expect("to_bytes of the re-read tensor");
    assert!(again == bytes, "to_bytes is not deterministic");
}

/// The bit patterns of a tensor's elements (so that NaNs compare equal to themselves).
fn bits(t: &Tensor) -> Vec<u64> {
    match t.data() {
        TensorData::F16(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
        TensorData::BF16(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
        TensorData::F32(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
        TensorData::F64(v) => v.iter().map(|x| x.to_bits()).collect(),
    }
}

/// Reads the fuzz bytes front to back; past the end every read is 0.
struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A float attribute: a special value (NaN, ±inf, ±0, negative, huge, tiny,
    /// subnormal), a typical one, or any bit pattern.
    fn attr_f32(&mut self) -> f32 {
        const SPECIAL: [f32; 14] = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            -1.0,
            1.0,
            0.5,
            1e-3,
            1e-4,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            -1e-3,
        ];
        let b = self.u8();
        match b {
            0..=127 => SPECIAL[usize::from(b) % SPECIAL.len()],
            128..=191 => f32::from(b - 128) / 32.0,
            _ => f32::from_bits(self.u32()),
        }
    }

    /// One element value, as f64 before the conversion to the tensor's type, or the raw
    /// bits of that type.
    fn element(&mut self, dtype: DType) -> Value {
        const SPECIAL: [f64; 16] = [
            f64::NAN,
            -f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.0,
            -0.0,
            1e30,
            -1e30,
            65504.0,
            -65504.0,
            3.4e38,
            -3.4e38,
            1e-40,
            1e300,
            -1e300,
            1e-310,
        ];
        let b = self.u8();
        match b {
            0..=31 => Value::F64(SPECIAL[usize::from(b) % SPECIAL.len()]),
            32..=239 => Value::F64((f64::from(b) - 136.0) / 8.0),
            _ => Value::Bits(match dtype {
                DType::F16 | DType::BF16 => u64::from(self.u16()),
                DType::F32 => u64::from(self.u32()),
                DType::F64 => self.u64(),
            }),
        }
    }
}

enum Value {
    F64(f64),
    Bits(u64),
}

/// Tensors are kept to at most this many elements, so that one execution is fast.
const MAX_ELEMENTS: usize = 256;

/// The inputs that have `x`'s shape and element type when they are well formed; every
/// other input is a per-channel vector in the statistics type.
const X_SIZED_INPUTS: &[&str] = &["x", "y_backprop", "side_input", "y", "grad_x_backprop"];
/// The outputs with `x`'s shape and element type.
const X_SIZED_OUTPUTS: &[&str] = &[
    "y",
    "x_backprop",
    "side_input_backprop",
    "grad_y_backprop",
    "grad_x",
];
/// TensorFlow's placeholder outputs: empty vectors in the statistics type.
const EMPTY_OUTPUTS: &[&str] = &["reserve_space_3", "reserve_space_4", "reserve_space_5"];

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// A small shape: rank 0-5, dims 0-5, at most [`MAX_ELEMENTS`] elements.
fn arbitrary_shape(b: &mut Bytes) -> Vec<usize> {
    let rank = usize::from(b.u8() % 6);
    let mut shape = Vec::with_capacity(rank);
    let mut n = 1usize;
    for _ in 0..rank {
        let mut d = usize::from(b.u8() % 6);
        if let Some(max) = MAX_ELEMENTS.checked_div(n) {
            d = d.min(max);
        }
        n *= d;
        shape.push(d);
    }
    shape
}

fn make_tensor(b: &mut Bytes, shape: Vec<usize>, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    assert!(n <= MAX_ELEMENTS);
    let mut f64s = Vec::with_capacity(n);
    let mut raws = Vec::with_capacity(n);
    for _ in 0..n {
        match b.element(dtype) {
            Value::F64(v) => {
                f64s.push(v);
                raws.push(None);
            }
            Value::Bits(bits) => {
                f64s.push(0.0);
                raws.push(Some(bits));
            }
        }
    }
    // Truncating casts on purpose: the bits were read at the type's width.
    let data = match dtype {
        DType::F32 => TensorData::F32(
            f64s.iter()
                .zip(&raws)
                .map(|(&v, r)| r.map_or(v as f32, |r| f32::from_bits(r as u32)))
                .collect(),
        ),
        DType::F64 => TensorData::F64(
            f64s.iter()
                .zip(&raws)
                .map(|(&v, r)| r.map_or(v, f64::from_bits))
                .collect(),
        ),
        DType::F16 => TensorData::F16(
            f64s.iter()
                .zip(&raws)
                .map(|(&v, r)| r.map_or(f16::from_f64(v), |r| f16::from_bits(r as u16)))
                .collect(),
        ),
        DType::BF16 => TensorData::BF16(
            f64s.iter()
                .zip(&raws)
                .map(|(&v, r)| r.map_or(bf16::from_f64(v), |r| bf16::from_bits(r as u16)))
                .collect(),
        ),
    };
    Tensor::from_data(shape, data).expect("the element count matches the shape")
}

fn stat_dtype(x: DType) -> DType {
    if x == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The op layer on an arbitrary op, attributes and inputs.
///
/// The bytes choose the op (from `Op::ALL`), every attribute (epsilon and
/// exponential_avg_factor among NaN, ±inf, negative, huge, subnormal and any bit
/// pattern; all four data formats, both modes, both activations), a shape and element
/// type for `x`, and then for each of the op's inputs: omitted, well formed (`x`'s shape
/// or a vector of its channel count, in the matching type) or an arbitrary small shape
/// and any of the four element types; element values include NaN, ±inf, huge, subnormal
/// and arbitrary bit patterns. Most cases are thus errors, and a good share get through
/// validation to the kernels.
///
/// `Op::run` must not panic; when it succeeds, the outputs must be exactly the op's
/// output names in order, the `x`-sized ones with `x`'s shape and type, the
/// placeholders empty, and the rest vectors of one element per channel in the
/// statistics type.
pub fn ops(data: &[u8]) {
    let mut b = Bytes { data, pos: 0 };
    let op = Op::ALL[usize::from(b.u8()) % Op::ALL.len()];
    let flags = b.u8();
    let attrs = Attrs {
        epsilon: b.attr_f32(),
        data_format: DataFormat::ALL[usize::from(flags & 3)],
        is_training: flags & 4 != 0,
        exponential_avg_factor: b.attr_f32(),
        activation_mode: if flags & 8 != 0 {
            Activation::Relu
        } else {
            Activation::Identity
        },
    };
    // A well-formed x for the data format (or sometimes for the other rank), from which
    // the well-formed shapes of the other inputs follow.
    let rank = if flags & 16 != 0 {
        9 - attrs.data_format.rank()
    } else {
        attrs.data_format.rank()
    };
    let mut x_shape = Vec::with_capacity(rank);
    let mut n = 1usize;
    for _ in 0..rank {
        // Mostly non-empty dims (1-4); 0 sometimes.
        let mut d = usize::from(b.u8() % 5);
        if d == 0 && flags & 32 == 0 {
            d = 1;
        }
        if let Some(max) = MAX_ELEMENTS.checked_div(n) {
            d = d.min(max);
        }
        n *= d;
        x_shape.push(d);
    }
    let x_dtype = DTYPES[usize::from(b.u8()) % DTYPES.len()];
    let channels = x_shape
        .get(attrs.data_format.channel_axis())
        .copied()
        .unwrap_or(1);

    let mut tensors: Vec<(&str, Tensor)> = Vec::new();
    for &name in op.input_names() {
        let choice = b.u8();
        let x_sized = X_SIZED_INPUTS.contains(&name);
        let (shape, dtype) = match choice % 8 {
            0 => continue, // omitted
            1 => (
                arbitrary_shape(&mut b),
                DTYPES[usize::from(choice >> 3) % 4],
            ),
            2 if x_sized => (x_shape.clone(), DTYPES[usize::from(choice >> 3) % 4]),
            2 if name == "reserve_space_3" => (Vec::new(), stat_dtype(x_dtype)),
            2 => (vec![channels], DTYPES[usize::from(choice >> 3) % 4]),
            _ if x_sized => (x_shape.clone(), x_dtype),
            _ => (vec![channels], stat_dtype(x_dtype)),
        };
        let t = make_tensor(&mut b, shape, dtype);
        tensors.push((name, t));
    }
    let mut inputs = Inputs::new();
    for (name, t) in &tensors {
        inputs.insert(name, t);
    }

    let outputs = match op.run(&inputs, &attrs) {
        Ok(out) => out,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let x = inputs.get("x").expect("an op that succeeded had an x");
    let c = x.shape()[attrs.data_format.channel_axis()];
    let u = stat_dtype(x.dtype());
    let names: Vec<&str> = outputs.names().collect();
    assert_eq!(names, op.output_names(), "{op}: output names");
    for (name, t) in outputs.iter() {
        let what = format!("{op} output {name} (x {:?} {})", x.shape(), x.dtype());
        assert_eq!(
            Some(t.data().len()),
            t.shape().iter().try_fold(1usize, |n, &d| n.checked_mul(d)),
            "{what}: shape {:?} and element count disagree",
            t.shape()
        );
        if X_SIZED_OUTPUTS.contains(&name) {
            assert_eq!(t.shape(), x.shape(), "{what}: shape");
            assert_eq!(t.dtype(), x.dtype(), "{what}: dtype");
        } else if EMPTY_OUTPUTS.contains(&name) {
            assert_eq!(t.shape(), [0], "{what}: shape");
            assert_eq!(t.dtype(), u, "{what}: dtype");
        } else {
            assert_eq!(t.shape(), [c], "{what}: shape");
            assert_eq!(t.dtype(), u, "{what}: dtype");
        }
    }
}
