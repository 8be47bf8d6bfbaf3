//! Reading and writing [`Tensor`]s as NumPy `.npy` files.
//!
//! Four element types are supported, one per [`DType`]:
//!
//! | `.npy` descr            | [`DType`]      |
//! |-------------------------|----------------|
//! | `'<f4'` / `'>f4'`       | [`DType::F32`] |
//! | `'<f8'` / `'>f8'`       | [`DType::F64`] |
//! | `'<f2'` / `'>f2'`       | [`DType::F16`] |
//! | `'<V2'` / `'\|V2'`      | [`DType::BF16`] |
//!
//! bfloat16 has no native NumPy type; NumPy with `ml_dtypes` stores it as the raw two-byte
//! type `'<V2'` whose bytes are the little-endian bit pattern. Big-endian float files are
//! converted on reading, Fortran-order (column-major) files are reordered to row-major, and
//! rank-0 arrays (shape `()`) become tensors of shape `[]` with one element.
//!
//! Files are always written in C order and little-endian, with exactly the header NumPy's
//! `np.save` writes, so a tensor read from a file NumPy wrote is written back byte for byte.
//!
//! ```
//! use fusedbn::{npy, Tensor};
//! let t = Tensor::new(vec![2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
//! let bytes = npy::to_bytes(&t)?;
//! assert_eq!(npy::from_bytes(&bytes)?, t);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use npyz::{Endianness, FixedSizeBytes, NpyFile, NpyHeader, Order, TypeChar};

use crate::error::Error;
use crate::tensor::{numel, DType, Tensor, TensorData};

/// What the reader accepts, for error messages.
const ACCEPTED: &str = "expected '<f4', '<f8', '<f2' or bfloat16 ('<V2')";

/// Errors reading or writing `.npy` files (separate from the ops' [`Error`]).
///
/// Every message names the file when there is one, e.g.
/// `x.npy: unsupported element type '<i4': expected '<f4', '<f8', '<f2' or bfloat16 ('<V2')`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NpyError {
    /// The file could not be read or written.
    #[error("{}could not {action} the file: {source}", At(.path))]
    Io {
        /// The file, when there is one.
        path: Option<PathBuf>,
        /// `"read"` or `"write"`.
        action: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The bytes are not a well-formed `.npy` file (bad magic, unparsable header,
    /// truncated data, ...).
    #[error("{}not a valid .npy file: {reason}", At(.path))]
    Malformed {
        /// The file, when there is one.
        path: Option<PathBuf>,
        /// What is wrong with it.
        reason: String,
    },
    /// The file's element type is not one of the four supported ones.
    #[error("{}unsupported element type {descr}: {expected}", At(.path))]
    UnsupportedDType {
        /// The file, when there is one.
        path: Option<PathBuf>,
        /// The dtype as the header spells it, e.g. `'<i4'`.
        descr: String,
        /// What is accepted instead.
        expected: String,
    },
    /// The file's shape and data do not make a valid [`Tensor`].
    #[error("{}{source}", At(.path))]
    Tensor {
        /// The file, when there is one.
        path: Option<PathBuf>,
        /// The tensor error.
        #[source]
        source: Error,
    },
}

impl NpyError {
    /// The same error, naming `path` as the file it is about.
    fn at(mut self, file: &Path) -> Self {
        match &mut self {
            NpyError::Io { path, .. }
            | NpyError::Malformed { path, .. }
            | NpyError::UnsupportedDType { path, .. }
            | NpyError::Tensor { path, .. } => *path = Some(file.to_path_buf()),
        }
        self
    }

    fn malformed(reason: impl Into<String>) -> Self {
        NpyError::Malformed {
            path: None,
            reason: reason.into(),
        }
    }
}

/// Displays `"<path>: "`, or nothing without a path.
struct At<'a>(&'a Option<PathBuf>);

impl fmt::Display for At<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(p) => write!(f, "{}: ", p.display()),
            None => Ok(()),
        }
    }
}

/// Reads a `.npy` file into a tensor (see the [module docs](self) for the accepted types).
pub fn read(path: impl AsRef<Path>) -> Result<Tensor, NpyError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| NpyError::Io {
        path: Some(path.to_path_buf()),
        action: "read",
        source,
    })?;
    from_bytes(&bytes).map_err(|e| e.at(path))
}

/// Writes a tensor as a `.npy` file (C order, little-endian, NumPy's exact header).
///
/// The whole file is built in memory first, so an unrepresentable tensor leaves no file behind.
pub fn write(path: impl AsRef<Path>, t: &Tensor) -> Result<(), NpyError> {
    let path = path.as_ref();
    let bytes = to_bytes(t).map_err(|e| e.at(path))?;
    std::fs::write(path, bytes).map_err(|source| NpyError::Io {
        path: Some(path.to_path_buf()),
        action: "write",
        source,
    })
}

/// Parses the contents of a `.npy` file (what [`read`] does after reading the file).
pub fn from_bytes(bytes: &[u8]) -> Result<Tensor, NpyError> {
    precheck(bytes)?;

    let mut rest = bytes;
    let header = NpyHeader::from_reader(&mut rest).map_err(npyz_error)?;
    let npy_dtype = header.dtype();
    let dtype = element_type(&npy_dtype)?;

    let shape = header
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| {
            NpyError::malformed(format!("shape {:?} does not fit in memory", header.shape()))
        })?;
    let too_large = || NpyError::Tensor {
        path: None,
        source: Error::TooLarge {
            shape: shape.clone(),
        },
    };
    let count = numel(&shape).ok_or_else(too_large)?;
    let needed = count.checked_mul(dtype.size()).ok_or_else(too_large)?;
    if rest.len() != needed {
        let what = if rest.len() < needed {
            "only"
        } else {
            "trailing data:"
        };
        return Err(NpyError::malformed(format!(
            "shape {:?} of {} needs {} bytes of data, {} {} bytes follow the header",
            shape,
            npy_dtype.descr(),
            needed,
            what,
            rest.len()
        )));
    }

    let fortran = header.order() == Order::Fortran && shape.len() > 1;
    let npy = NpyFile::with_header(header, rest);
    let data = match dtype {
        DType::F32 => TensorData::F32(elements::<f32>(npy, &shape, fortran)?),
        DType::F64 => TensorData::F64(elements::<f64>(npy, &shape, fortran)?),
        DType::F16 => TensorData::F16(elements::<f16>(npy, &shape, fortran)?),
        DType::BF16 => {
            let raw = elements::<FixedSizeBytes<2>>(npy, &shape, fortran)?;
            TensorData::BF16(
                raw.into_iter()
                    .map(|b| bf16::from_bits(u16::from_le_bytes(b.0)))
                    .collect(),
            )
        }
    };
    Tensor::from_data(shape, data).map_err(|source| NpyError::Tensor { path: None, source })
}

/// Serializes a tensor as the bytes of a `.npy` file, identical to what NumPy's `np.save`
/// writes for the same array (bfloat16 as `'<V2'`, as NumPy with `ml_dtypes` does).
pub fn to_bytes(t: &Tensor) -> Result<Vec<u8>, NpyError> {
    let mut out = header(t.dtype(), t.shape())?;
    out.reserve(t.numel() * t.dtype().size());
    match t.data() {
        TensorData::F32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        TensorData::F64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        TensorData::F16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
        TensorData::BF16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
    }
    Ok(out)
}

/// The bytes NumPy's `np.save` writes before the data of a C-order array.
///
/// Written by hand rather than with `npyz::WriteOptions`: npyz spells the shape `(2, 3, )`
/// where NumPy writes `(2, 3)` (and `(5,)`, `()`), leaves out the spare spaces NumPy adds so the
/// shape can grow in place, and pads to 64 bytes slightly differently, so its files are valid
/// but not byte-identical to NumPy's. This mirrors `numpy.lib.format._write_array_header`.
fn header(dtype: DType, shape: &[usize]) -> Result<Vec<u8>, NpyError> {
    /// `numpy.lib.format.GROWTH_AXIS_MAX_DIGITS`.
    const GROWTH_AXIS_MAX_DIGITS: usize = 21;
    /// `numpy.lib.format.ARRAY_ALIGN`.
    const ARRAY_ALIGN: usize = 64;

    let descr = match dtype {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::F16 => "<f2",
        DType::BF16 => "<V2",
    };
    // Python's repr of the shape tuple.
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_repr = match dims.as_slice() {
        [] => "()".to_string(),
        [d] => format!("({d},)"),
        _ => format!("({})", dims.join(", ")),
    };
    let mut text =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_repr}, }}");
    if let Some(first) = dims.first() {
        let spare = GROWTH_AXIS_MAX_DIGITS.saturating_sub(first.len());
        text.push_str(&" ".repeat(spare));
    }

    // Version 1.0 (u16 header length) when it fits, else 2.0 (u32), as numpy chooses.
    let hlen = text.len() + 1; // with the final '\n'
    for (version, len_bytes) in [(1u8, 2usize), (2, 4)] {
        let prefix = 8 + len_bytes; // magic + version + header length
        let padded = hlen + (ARRAY_ALIGN - (prefix + hlen) % ARRAY_ALIGN);
        let len_field = match len_bytes {
            2 => u16::try_from(padded).ok().map(|n| n.to_le_bytes().to_vec()),
            _ => u32::try_from(padded).ok().map(|n| n.to_le_bytes().to_vec()),
        };
        let Some(len_field) = len_field else { continue };
        let mut out = Vec::with_capacity(prefix + padded);
        out.extend_from_slice(b"\x93NUMPY");
        out.extend_from_slice(&[version, 0]);
        out.extend_from_slice(&len_field);
        out.extend_from_slice(text.as_bytes());
        out.resize(prefix + padded - 1, b' ');
        out.push(b'\n');
        return Ok(out);
    }
    Err(NpyError::Io {
        path: None,
        action: "write",
        source: io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the .npy header for a rank-{} tensor is too long",
                shape.len()
            ),
        ),
    })
}

/// Maps the element type of a file to a [`DType`], or explains why it is not supported.
fn element_type(dtype: &npyz::DType) -> Result<DType, NpyError> {
    let unsupported = |expected: &str| NpyError::UnsupportedDType {
        path: None,
        descr: dtype.descr(),
        expected: expected.to_string(),
    };
    let npyz::DType::Plain(ts) = dtype else {
        return Err(unsupported(ACCEPTED));
    };
    match (ts.type_char(), ts.size_field(), ts.endianness()) {
        (TypeChar::Float, 2, _) => Ok(DType::F16),
        (TypeChar::Float, 4, _) => Ok(DType::F32),
        (TypeChar::Float, 8, _) => Ok(DType::F64),
        (TypeChar::RawData, 2, Endianness::Little | Endianness::Irrelevant) => Ok(DType::BF16),
        (TypeChar::RawData, 2, Endianness::Big) => Err(unsupported(
            "a big-endian raw 2-byte type is ambiguous; bfloat16 must be stored as '<V2' \
             (the little-endian bit pattern, as NumPy with ml_dtypes writes it)",
        )),
        _ => Err(unsupported(ACCEPTED)),
    }
}

/// Reads every element of `npy` as `T`, in C order.
fn elements<T: npyz::Deserialize + Copy>(
    npy: NpyFile<&[u8]>,
    shape: &[usize],
    fortran: bool,
) -> Result<Vec<T>, NpyError> {
    let data: Vec<T> = npy.into_vec().map_err(npyz_error)?;
    if !fortran {
        return Ok(data);
    }
    fortran_to_c(&data, shape).ok_or_else(|| {
        NpyError::malformed(format!(
            "{} elements do not fill shape {shape:?}",
            data.len()
        ))
    })
}

/// Reorders column-major (Fortran order) elements into row-major (C order), for any rank.
/// `None` when `data` does not have exactly the element count of `shape`.
fn fortran_to_c<T: Copy>(data: &[T], shape: &[usize]) -> Option<Vec<T>> {
    let n = numel(shape)?;
    if n != data.len() {
        return None;
    }
    if shape.len() < 2 || n == 0 {
        return Some(data.to_vec());
    }
    // In Fortran order axis k has stride shape[0] * ... * shape[k-1].
    let mut strides = Vec::with_capacity(shape.len());
    let mut stride = 1usize;
    for &d in shape {
        strides.push(stride);
        stride = stride.checked_mul(d)?;
    }
    // Walk the C-order multi-index (last axis fastest), tracking its Fortran offset.
    let mut index = vec![0usize; shape.len()];
    let mut offset = 0usize;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(*data.get(offset)?);
        for ((i, &s), &d) in index.iter_mut().zip(&strides).zip(shape).rev() {
            *i += 1;
            offset += s;
            if *i < d {
                break;
            }
            offset -= s * d;
            *i = 0;
        }
    }
    Some(out)
}

/// An error from npyz, which reads from memory, so it is always about the file's contents.
fn npyz_error(e: io::Error) -> NpyError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        NpyError::malformed("the file ends early")
    } else {
        NpyError::malformed(e.to_string())
    }
}

/// Checks what npyz does not: the header length against the file size (npyz allocates the
/// header buffer before reading it) and the shape's element count (npyz multiplies the
/// dimensions unchecked, which panics on overflow in debug builds). Everything else is left
/// to npyz, which parses the header with the same parser as here.
fn precheck(bytes: &[u8]) -> Result<(), NpyError> {
    if bytes.get(..6) != Some(b"\x93NUMPY".as_slice()) {
        return Err(NpyError::malformed(
            "it does not start with the .npy magic string \\x93NUMPY",
        ));
    }
    let version = (bytes.get(6).copied(), bytes.get(7).copied());
    let (len, start) = match version {
        (Some(1), Some(0)) => (
            bytes
                .get(8..10)
                .map(|b| usize::from(u16::from_le_bytes([b[0], b[1]]))),
            10usize,
        ),
        (Some(2 | 3), Some(0)) => (
            bytes
                .get(8..12)
                .and_then(|b| usize::try_from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])).ok()),
            12,
        ),
        (Some(major), Some(minor)) => {
            return Err(NpyError::malformed(format!(
                "unsupported format version {major}.{minor} (expected 1.0, 2.0 or 3.0)"
            )))
        }
        _ => return Err(NpyError::malformed("the file ends early")),
    };
    let Some(len) = len else {
        return Err(NpyError::malformed("the file ends early"));
    };
    let Some(text) = start.checked_add(len).and_then(|end| bytes.get(start..end)) else {
        return Err(NpyError::malformed(format!(
            "the header is {len} bytes long, but the file ends {} bytes after its start",
            bytes.len().saturating_sub(start)
        )));
    };

    // Find the shape; anything unexpected is left for npyz to report.
    let Ok(text) = std::str::from_utf8(text) else {
        return Ok(());
    };
    let Ok(py_literal::Value::Dict(items)) = text.trim_end().parse::<py_literal::Value>() else {
        return Ok(());
    };
    let shape = items.iter().find_map(|(k, v)| match (k, v) {
        (
            py_literal::Value::String(k),
            py_literal::Value::Tuple(s) | py_literal::Value::List(s),
        ) if k == "shape" => Some(s),
        _ => None,
    });
    let Some(shape) = shape else { return Ok(()) };
    let dims: Option<Vec<u64>> = shape
        .iter()
        .map(|d| match d {
            py_literal::Value::Integer(n) => u64::try_from(n).ok(),
            _ => None,
        })
        .collect();
    let Some(dims) = dims else { return Ok(()) };
    // npyz multiplies both left to right and right to left; every partial product must fit.
    fn fits<'a>(mut dims: impl Iterator<Item = &'a u64>) -> bool {
        dims.try_fold(1u64, |acc, &d| acc.checked_mul(d)).is_some()
    }
    if !fits(dims.iter()) || !fits(dims.iter().rev()) {
        return Err(NpyError::malformed(format!(
            "shape {dims:?} has more elements than fit in 64 bits"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built `.npy` file: `dict` is the header dict, `data` the raw data.
    fn npy_file(dict: &str, data: &[u8]) -> Vec<u8> {
        let mut text = dict.as_bytes().to_vec();
        while !(10 + text.len() + 1).is_multiple_of(64) {
            text.push(b' ');
        }
        text.push(b'\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(text.len() as u16).to_le_bytes());
        out.extend_from_slice(&text);
        out.extend_from_slice(data);
        out
    }

    fn round_trip(t: &Tensor) {
        let bytes = to_bytes(t).unwrap();
        assert_eq!(bytes.len() % 64, (t.numel() * t.dtype().size()) % 64);
        let back = from_bytes(&bytes).unwrap();
        assert_eq!(back.shape(), t.shape());
        assert_eq!(back.dtype(), t.dtype());
        // Compare bit patterns, so NaNs and signed zeros count.
        assert_eq!(bits(&back), bits(t));
    }

    fn bits(t: &Tensor) -> Vec<u64> {
        match t.data() {
            TensorData::F32(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
            TensorData::F64(v) => v.iter().map(|x| x.to_bits()).collect(),
            TensorData::F16(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
            TensorData::BF16(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
        }
    }

    fn all_dtypes(shape: &[usize], values: &[f64]) -> Vec<Tensor> {
        let s = shape.to_vec();
        vec![
            Tensor::new(s.clone(), values.iter().map(|&v| v as f32).collect()).unwrap(),
            Tensor::new(s.clone(), values.to_vec()).unwrap(),
            Tensor::new(
                s.clone(),
                values.iter().map(|&v| f16::from_f64(v)).collect(),
            )
            .unwrap(),
            Tensor::new(s, values.iter().map(|&v| bf16::from_f64(v)).collect()).unwrap(),
        ]
    }

    #[test]
    fn round_trips_every_dtype_and_rank() {
        let vals: Vec<f64> = (0..24).map(|i| i as f64 * 0.5 - 3.0).collect();
        for (shape, n) in [
            (vec![], 1),
            (vec![5], 5),
            (vec![2, 3], 6),
            (vec![2, 3, 4], 24),
            (vec![1, 2, 3, 2, 2], 24),
            (vec![0, 2, 3], 0),
            (vec![0], 0),
        ] {
            for t in all_dtypes(&shape, &vals[..n]) {
                round_trip(&t);
            }
        }
    }

    #[test]
    fn bf16_bit_patterns_are_preserved() {
        let patterns: Vec<u16> = vec![
            0x0000, 0x8000, 0x3f80, 0x7f80, 0xff80, 0x7fc1, 0xffff, 0x0001, 0x1234,
        ];
        let t = Tensor::new(
            vec![patterns.len()],
            patterns.iter().map(|&b| bf16::from_bits(b)).collect(),
        )
        .unwrap();
        let bytes = to_bytes(&t).unwrap();
        let data = &bytes[bytes.len() - 2 * patterns.len()..];
        let expected: Vec<u8> = patterns.iter().flat_map(|b| b.to_le_bytes()).collect();
        assert_eq!(data, expected.as_slice());
        let back = from_bytes(&bytes).unwrap();
        let got: Vec<u16> = back
            .as_slice::<bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, patterns);
        // '|V2' (how numpy spells a plain 2-byte void type) reads the same way.
        let file = npy_file(
            "{'descr': '|V2', 'fortran_order': False, 'shape': (2,), }",
            &[0x80, 0x3f, 0x00, 0xc0],
        );
        let t = from_bytes(&file).unwrap();
        assert_eq!(t.to_f64_vec(), vec![1.0, -2.0]);
    }

    #[test]
    fn header_matches_numpy() {
        // np.save(f, np.zeros((2, 3), ml_dtypes.bfloat16)), header only.
        let t = Tensor::new(vec![2, 3], vec![bf16::ZERO; 6]).unwrap();
        let bytes = to_bytes(&t).unwrap();
        let mut expected =
            b"\x93NUMPY\x01\x00v\x00{'descr': '<V2', 'fortran_order': False, 'shape': (2, 3), }"
                .to_vec();
        expected.resize(127, b' ');
        expected.push(b'\n');
        assert_eq!(&bytes[..128], expected.as_slice());
        // A rank-0 f64 scalar and a 1-D f16 vector.
        let t = Tensor::new(vec![], vec![1.5f64]).unwrap();
        let bytes = to_bytes(&t).unwrap();
        assert!(bytes.starts_with(
            b"\x93NUMPY\x01\x00v\x00{'descr': '<f8', 'fortran_order': False, 'shape': (), }  "
        ));
        assert_eq!(&bytes[128..], 1.5f64.to_le_bytes().as_slice());
        let t = Tensor::new(vec![5], vec![f16::ONE; 5]).unwrap();
        assert!(to_bytes(&t).unwrap().starts_with(
            b"\x93NUMPY\x01\x00v\x00{'descr': '<f2', 'fortran_order': False, 'shape': (5,), }  "
        ));
    }

    #[test]
    fn huge_rank_header_uses_version_2() {
        let shape = vec![1usize; 30000];
        let t = Tensor::new(shape.clone(), vec![2.0f32]).unwrap();
        let bytes = to_bytes(&t).unwrap();
        assert_eq!(&bytes[..8], b"\x93NUMPY\x02\x00");
        assert_eq!((bytes.len() - 4) % 64, 0);
        let back = from_bytes(&bytes).unwrap();
        assert_eq!(back.shape(), shape.as_slice());
    }

    #[test]
    fn fortran_to_c_reorders_any_rank() {
        assert_eq!(
            fortran_to_c(&[1, 4, 2, 5, 3, 6], &[2, 3]),
            Some(vec![1, 2, 3, 4, 5, 6])
        );
        assert_eq!(fortran_to_c(&[7], &[]), Some(vec![7]));
        assert_eq!(fortran_to_c::<i32>(&[], &[3, 0, 2]), Some(vec![]));
        assert_eq!(fortran_to_c(&[1, 2], &[3]), None);
        // Rank 4: the element at index (i, j, k, l) holds the number ijkl.
        let shape = [2usize, 3, 4, 2];
        let mut fortran = Vec::new();
        for l in 0..2 {
            for k in 0..4 {
                for j in 0..3 {
                    for i in 0..2 {
                        fortran.push(1000 * i + 100 * j + 10 * k + l);
                    }
                }
            }
        }
        let mut c = Vec::new();
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..4 {
                    for l in 0..2 {
                        c.push(1000 * i + 100 * j + 10 * k + l);
                    }
                }
            }
        }
        assert_eq!(fortran_to_c(&fortran, &shape), Some(c));
    }

    #[test]
    fn reads_fortran_order() {
        // np.asfortranarray([[1, 2, 3], [4, 5, 6]], '<f4')
        let data: Vec<u8> = [1f32, 4., 2., 5., 3., 6.]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let file = npy_file(
            "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
            &data,
        );
        let t = from_bytes(&file).unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.as_slice::<f32>().unwrap(), &[1., 2., 3., 4., 5., 6.]);
        // Rank 1 and rank 0 are the same in either order.
        let file = npy_file(
            "{'descr': '<f4', 'fortran_order': True, 'shape': (3,), }",
            &data[..12],
        );
        assert_eq!(
            from_bytes(&file).unwrap().as_slice::<f32>().unwrap(),
            &[1., 4., 2.]
        );
    }

    #[test]
    fn reads_big_endian() {
        let f4: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_be_bytes())
            .collect();
        let t = from_bytes(&npy_file(
            "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }",
            &f4,
        ))
        .unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap(), &[1.5, -2.0]);
        let f8: Vec<u8> = 0.1f64.to_be_bytes().to_vec();
        let t = from_bytes(&npy_file(
            "{'descr': '>f8', 'fortran_order': False, 'shape': (), }",
            &f8,
        ))
        .unwrap();
        assert_eq!(t.shape(), &[] as &[usize]);
        assert_eq!(t.as_slice::<f64>().unwrap(), &[0.1]);
        let f2: Vec<u8> = f16::from_f32(0.333).to_bits().to_be_bytes().to_vec();
        let t = from_bytes(&npy_file(
            "{'descr': '>f2', 'fortran_order': False, 'shape': (1, 1), }",
            &f2,
        ))
        .unwrap();
        assert_eq!(t.as_slice::<f16>().unwrap(), &[f16::from_f32(0.333)]);
        // Big-endian and Fortran order together.
        let data: Vec<u8> = [1f64, 3., 2., 4.]
            .iter()
            .flat_map(|x| x.to_be_bytes())
            .collect();
        let t = from_bytes(&npy_file(
            "{'descr': '>f8', 'fortran_order': True, 'shape': (2, 2), }",
            &data,
        ))
        .unwrap();
        assert_eq!(t.as_slice::<f64>().unwrap(), &[1., 2., 3., 4.]);
    }

    fn err(bytes: &[u8]) -> String {
        match from_bytes(bytes) {
            Ok(t) => panic!("expected an error, got {t:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn refuses_other_dtypes() {
        let msg = err(&npy_file(
            "{'descr': '<i4', 'fortran_order': False, 'shape': (1,), }",
            &[0; 4],
        ));
        assert_eq!(
            msg,
            "unsupported element type '<i4': expected '<f4', '<f8', '<f2' or bfloat16 ('<V2')"
        );
        for descr in [
            "'|b1'",
            "'<u2'",
            "'|V4'",
            "'<c8'",
            "'<f16'",
            "[('a', '<f4')]",
            "'|O'",
            "'<M8[ns]'",
            "'|S2'",
        ] {
            let file = npy_file(
                &format!("{{'descr': {descr}, 'fortran_order': False, 'shape': (1,), }}"),
                &[0; 16],
            );
            let msg = err(&file);
            assert!(
                msg.contains("unsupported element type") || msg.contains("not a valid"),
                "{descr}: {msg}"
            );
        }
        let msg = err(&npy_file(
            "{'descr': '>V2', 'fortran_order': False, 'shape': (1,), }",
            &[0; 2],
        ));
        assert!(msg.contains("'>V2'") && msg.contains("ambiguous"), "{msg}");
    }

    #[test]
    fn refuses_malformed_files() {
        let good = to_bytes(&Tensor::new(vec![2, 3], vec![1.0f32; 6]).unwrap()).unwrap();
        // Bad magic, and other short garbage.
        let mut bad = good.clone();
        bad[1] = b'X';
        assert!(err(&bad).contains("magic"));
        for junk in [
            &b""[..],
            b"\x93NUM",
            b"\x93NUMPY",
            b"\x93NUMPY\x01\x00",
            b"\x93NUMPY\x01\x00\xff",
            b"PK\x03\x04 zip",
        ] {
            assert!(err(junk).starts_with("not a valid .npy file"), "{junk:?}");
        }
        // Truncated anywhere, in the header or in the data.
        for cut in [9, 10, 60, 127, 128, 129, good.len() - 1] {
            assert!(
                err(&good[..cut]).starts_with("not a valid .npy file"),
                "cut at {cut}"
            );
        }
        assert!(err(&good[..good.len() - 4]).contains("needs 24 bytes of data, only 20"));
        // Trailing data.
        let mut long = good.clone();
        long.extend_from_slice(&[0; 4]);
        assert!(err(&long).contains("trailing data"));
        // Header says more elements than present, up to overflowing u64.
        for shape in [
            "(1000000000000,)",
            "(4294967296, 4294967296)",
            "(0, 4294967296, 4294967296)",
            "(4294967296, 4294967296, 0)",
            "(-1,)",
            "(1.5,)",
            "(100000000000000000000000,)",
        ] {
            let file = npy_file(
                &format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"),
                &[0; 8],
            );
            assert!(err(&file).starts_with("not a valid .npy file"), "{shape}");
        }
        // Garbage headers.
        for dict in [
            "",
            "{",
            "[1, 2]",
            "{'descr': '<f4'}",
            "{'descr': '<f4', 'fortran_order': 1, 'shape': (), }",
            "{'descr': '<f4', 'fortran_order': False, 'shape': 3, }",
            "((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((",
        ] {
            let file = npy_file(dict, &[0; 4]);
            assert!(err(&file).starts_with("not a valid .npy file"), "{dict}");
        }
        // Bad version, and a header length past the end of the file.
        let mut v = good.clone();
        v[6] = 9;
        assert!(err(&v).contains("version 9.0"));
        let mut v = good.clone();
        v[8] = 0xff;
        v[9] = 0xff;
        assert!(err(&v).contains("header is 65535 bytes long"));
    }

    #[test]
    fn never_panics_on_mutated_files() {
        // Every single-byte change and every truncation of a small valid file.
        let good = to_bytes(&Tensor::new(vec![2, 2], vec![bf16::ONE; 4]).unwrap()).unwrap();
        for i in 0..good.len() {
            for b in [0u8, b'(', b')', b'9', b',', b' ', 0xff, b'\'', b'T'] {
                let mut m = good.clone();
                m[i] = b;
                let _ = from_bytes(&m);
            }
            let _ = from_bytes(&good[..i]);
        }
    }

    #[test]
    fn errors_name_the_file() {
        let dir = std::env::temp_dir().join(format!("fusedbn-npy-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.npy");
        std::fs::write(
            &path,
            npy_file(
                "{'descr': '<i4', 'fortran_order': False, 'shape': (), }",
                &[0; 4],
            ),
        )
        .unwrap();
        let msg = read(&path).unwrap_err().to_string();
        assert_eq!(
            msg,
            format!(
                "{}: unsupported element type '<i4': {ACCEPTED}",
                path.display()
            )
        );
        let t = Tensor::new(vec![3], vec![1.0f32, 2.0, 3.0]).unwrap();
        write(&path, &t).unwrap();
        assert_eq!(read(&path).unwrap(), t);
        let missing = dir.join("missing.npy");
        let msg = read(&missing).unwrap_err().to_string();
        assert!(
            msg.starts_with(&format!("{}: could not read the file: ", missing.display())),
            "{msg}"
        );
        let msg = write(dir.join("no/such/dir.npy"), &t)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("could not write the file"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every `.npy` file under tests/fixtures (written by NumPy) parses, and all written in
    /// C order are written back byte for byte.
    #[test]
    fn numpy_fixtures_round_trip_byte_for_byte() {
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, out);
                } else if p.extension().is_some_and(|x| x == "npy") {
                    out.push(p);
                }
            }
        }
        let mut files = Vec::new();
        walk(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
            &mut files,
        );
        let (mut identical, mut fortran) = (0, 0);
        for f in &files {
            let t = read(f).unwrap_or_else(|e| panic!("{e}"));
            let original = std::fs::read(f).unwrap();
            let written = to_bytes(&t).unwrap();
            if original.windows(21).any(|w| w == b"'fortran_order': True") {
                fortran += 1;
                assert_eq!(from_bytes(&written).unwrap(), t, "{}", f.display());
            } else {
                assert!(
                    written == original,
                    "{}: not written back byte for byte",
                    f.display()
                );
                identical += 1;
            }
        }
        eprintln!(
            "{} fixtures: {identical} byte-identical, {fortran} in Fortran order",
            files.len()
        );
        // The reference input of SPEC section 8 is stored in Fortran order.
        let x = read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/v1_fwd_train_nhwc_f32_tfref/inputs/x.npy"),
        );
        if let Ok(x) = x {
            assert_eq!(x.shape(), &[1, 1, 6, 2]);
            assert_eq!(
                x.as_slice::<f32>().unwrap(),
                &[5., 5., 7., 7., 9., 9., 11., 11., 13., 13., 15., 15.]
            );
        }
    }
}
