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
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use half::{bf16, f16};

use crate::error::Error;
use crate::tensor::{numel, DType, Tensor, TensorData};

/// What the reader accepts, for error messages.
const ACCEPTED: &str = "expected '<f4', '<f8', '<f2' or bfloat16 ('<V2')";

/// The longest header the reader accepts, in bytes (NumPy's own reader refuses more than
/// 10 000 by default; this is larger so that every header [`write()`] produces, up to
/// rank ~300 000, reads back). The header is parsed in one linear pass, so even the
/// longest takes well under a millisecond.
pub const MAX_HEADER_BYTES: usize = 1 << 20;

/// The longest string (a key or the `descr`) a header may hold.
const MAX_STRING: usize = 64;

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
///
/// What it reads is bounded by what the file holds: the fixed prefix first, then a
/// header of at most [`MAX_HEADER_BYTES`], then exactly the data the header's shape
/// needs — checked against the size of a regular file before anything that size is
/// allocated; from a pipe or a device, the buffer grows only with the bytes that arrive
/// and reading stops one byte past the expected end (a stream that does not start with
/// the `.npy` magic, such as `/dev/zero`, is refused after 8 bytes).
pub fn read(path: impl AsRef<Path>) -> Result<Tensor, NpyError> {
    let path = path.as_ref();
    read_file(path).map_err(|e| e.at(path))
}

fn read_file(path: &Path) -> Result<Tensor, NpyError> {
    let io = |source: io::Error| NpyError::Io {
        path: None,
        action: "read",
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if meta.is_dir() {
        return Err(io(io::Error::other("it is a directory")));
    }
    let mut prefix = Vec::with_capacity(12);
    (&mut file).take(12).read_to_end(&mut prefix).map_err(io)?;
    let (start, header_len) = parse_prefix(&prefix)?;
    // The 12-byte prefix read may already hold the first bytes of the header. A
    // version-1 header shorter than those 2 bytes cannot be a valid dict (parse_header
    // refuses it), so bytes read past the header are never needed as data.
    let mut text = prefix.get(start..).unwrap_or_default().to_vec();
    let rest = header_len.saturating_sub(text.len());
    (&mut file)
        .take(rest as u64)
        .read_to_end(&mut text)
        .map_err(io)?;
    text.truncate(header_len);
    let header = parse_header(header_len, &text)?;
    let data_start = (start + header_len) as u64;
    let needed = header.data_bytes as u64;
    let mut data = Vec::new();
    if meta.is_file() {
        // The data must be exactly what the file still holds: refuse a lying header
        // before allocating for it.
        let have = meta.len().saturating_sub(data_start);
        if have != needed {
            return Err(header.wrong_length(usize::try_from(have).unwrap_or(usize::MAX)));
        }
        data.reserve_exact(header.data_bytes);
    }
    (&mut file)
        .take(needed + 1)
        .read_to_end(&mut data)
        .map_err(io)?;
    header.decode(&data)
}

/// Writes a tensor as a `.npy` file (C order, little-endian, NumPy's exact header).
///
/// The whole file is built in memory first, so an unrepresentable tensor leaves no file
/// behind. This writes `path` in place; for all-or-nothing replacement of existing
/// files, write to a temporary name in the same directory, sync and rename (as
/// `fusedbn run` does).
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
///
/// ```
/// use fusedbn::npy;
/// // A header with unclosed braces is refused at once, whatever its depth.
/// let mut file = b"\x93NUMPY\x01\x00\x76\x00{'descr': {{{{{{{{{{{{{{{{'<f4'".to_vec();
/// file.resize(10 + 0x76, b' ');
/// let err = npy::from_bytes(&file).unwrap_err().to_string();
/// assert!(err.starts_with("not a valid .npy file"), "{err}");
/// ```
pub fn from_bytes(bytes: &[u8]) -> Result<Tensor, NpyError> {
    let (start, header_len) = parse_prefix(bytes)?;
    let text = start
        .checked_add(header_len)
        .and_then(|end| bytes.get(start..end))
        .unwrap_or(&bytes[start.min(bytes.len())..]);
    let header = parse_header(header_len, text)?;
    header.decode(&bytes[start + text.len()..])
}

/// Checks the magic string and version and returns `(header start, header length)`.
fn parse_prefix(bytes: &[u8]) -> Result<(usize, usize), NpyError> {
    let early = || NpyError::malformed("the file ends early");
    let magic = b"\x93NUMPY";
    if bytes.len() < magic.len() {
        if magic.starts_with(bytes) {
            return Err(early());
        }
        return Err(NpyError::malformed(
            "it does not start with the .npy magic string \\x93NUMPY",
        ));
    }
    if &bytes[..6] != magic {
        return Err(NpyError::malformed(
            "it does not start with the .npy magic string \\x93NUMPY",
        ));
    }
    let (start, len) = match (bytes.get(6), bytes.get(7)) {
        (Some(1), Some(0)) => {
            let b = bytes.get(8..10).ok_or_else(early)?;
            (10, usize::from(u16::from_le_bytes([b[0], b[1]])))
        }
        (Some(2 | 3), Some(0)) => {
            let b = bytes.get(8..12).ok_or_else(early)?;
            let n = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            (12, usize::try_from(n).unwrap_or(usize::MAX))
        }
        (Some(major), Some(minor)) => {
            return Err(NpyError::malformed(format!(
                "unsupported format version {major}.{minor} (expected 1.0, 2.0 or 3.0)"
            )))
        }
        _ => return Err(early()),
    };
    if len > MAX_HEADER_BYTES {
        return Err(NpyError::malformed(format!(
            "the header is {len} bytes long, more than the {MAX_HEADER_BYTES} accepted"
        )));
    }
    Ok((start, len))
}

/// A parsed header: what the data that follows must be.
#[derive(Debug)]
struct Header {
    dtype: DType,
    descr: String,
    big_endian: bool,
    fortran: bool,
    shape: Vec<usize>,
    /// Bytes of data the shape needs.
    data_bytes: usize,
}

/// Parses the header text: a Python dict literal with exactly the keys `descr` (a type
/// string), `fortran_order` (`True`/`False`) and `shape` (a tuple of non-negative
/// integers), as NumPy writes it, followed by spaces and a newline. `header_len` is what
/// the prefix announced; a shorter `text` means the file ended inside the header.
///
/// Written by hand, not with a Python-literal parser (npyz uses `py_literal`, a
/// backtracking PEG parser whose time triples with each unclosed `{`): the grammar is
/// tiny and fixed, so one forward pass over at most [`MAX_HEADER_BYTES`] with no
/// recursion and no backtracking parses it, and anything else is refused where it
/// stops matching.
fn parse_header(header_len: usize, text: &[u8]) -> Result<Header, NpyError> {
    if text.len() < header_len {
        return Err(NpyError::malformed(format!(
            "the header is {header_len} bytes long, but the file ends {} bytes after its start",
            text.len()
        )));
    }
    let mut p = Cursor { text, at: 0 };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    p.skip_space();
    p.expect(b'{', "the header must be a dict '{...}'")?;
    loop {
        p.skip_space();
        if p.eat(b'}') {
            break;
        }
        let key = p.string("a key in quotes or '}'")?;
        p.skip_space();
        p.expect(b':', "':' after a key")?;
        p.skip_space();
        let duplicate = || NpyError::malformed(format!("the header repeats the key '{key}'"));
        match key.as_str() {
            "descr" => {
                if descr.is_some() {
                    return Err(duplicate());
                }
                if p.peek() == Some(b'[') {
                    return Err(NpyError::UnsupportedDType {
                        path: None,
                        descr: "a structured type (a list of fields)".into(),
                        expected: ACCEPTED.into(),
                    });
                }
                descr = Some(p.string("a type string such as '<f4'")?);
            }
            "fortran_order" => {
                if fortran.is_some() {
                    return Err(duplicate());
                }
                fortran = Some(if p.word(b"True") {
                    true
                } else if p.word(b"False") {
                    false
                } else {
                    return Err(p.unexpected("True or False for 'fortran_order'"));
                });
            }
            "shape" => {
                if shape.is_some() {
                    return Err(duplicate());
                }
                shape = Some(p.shape()?);
            }
            other => {
                return Err(NpyError::malformed(format!(
                    "unexpected key '{other}' in the header (expected 'descr', \
                     'fortran_order' and 'shape')"
                )))
            }
        }
        p.skip_space();
        if p.eat(b'}') {
            break;
        }
        p.expect(b',', "',' or '}' after a value")?;
    }
    p.skip_space();
    if p.at != text.len() {
        return Err(p.unexpected("only spaces and a newline after the header's dict"));
    }
    let missing = |k: &str| NpyError::malformed(format!("the header has no '{k}'"));
    let descr = descr.ok_or_else(|| missing("descr"))?;
    let fortran = fortran.ok_or_else(|| missing("fortran_order"))?;
    let shape = shape.ok_or_else(|| missing("shape"))?;
    let (dtype, big_endian) = element_type(&descr)?;
    let too_large = || {
        NpyError::malformed(format!(
            "shape {shape:?} has more elements than fit in memory"
        ))
    };
    let data_bytes = numel(&shape)
        .and_then(|n| n.checked_mul(dtype.size()))
        .filter(|&b| isize::try_from(b).is_ok())
        .ok_or_else(too_large)?;
    Ok(Header {
        dtype,
        descr: format!("'{descr}'"),
        big_endian,
        fortran: fortran && shape.len() > 1,
        shape,
        data_bytes,
    })
}

/// A forward-only reader over the header text.
struct Cursor<'a> {
    text: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn eat(&mut self, b: u8) -> bool {
        let hit = self.peek() == Some(b);
        self.at += usize::from(hit);
        hit
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace()) {
            self.at += 1;
        }
    }

    /// `word` here, not followed by a letter, digit or underscore.
    fn word(&mut self, word: &[u8]) -> bool {
        let end = self.at + word.len();
        let next = self.text.get(end).copied();
        if self.text.get(self.at..end) == Some(word)
            && !next.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            self.at = end;
            return true;
        }
        false
    }

    fn unexpected(&self, wanted: &str) -> NpyError {
        let found = match self.peek() {
            None => "the end of the header".to_string(),
            Some(b) if b.is_ascii_graphic() || b == b' ' => format!("'{}'", b as char),
            Some(b) => format!("byte 0x{b:02x}"),
        };
        NpyError::malformed(format!(
            "bad header: expected {wanted} at byte {}, found {found}",
            self.at
        ))
    }

    fn expect(&mut self, b: u8, wanted: &str) -> Result<(), NpyError> {
        if self.eat(b) {
            Ok(())
        } else {
            Err(self.unexpected(wanted))
        }
    }

    /// A quoted string of printable ASCII without escapes, at most [`MAX_STRING`] long.
    fn string(&mut self, wanted: &str) -> Result<String, NpyError> {
        let quote = match self.peek() {
            Some(q @ (b'\'' | b'"')) => q,
            _ => return Err(self.unexpected(wanted)),
        };
        self.at += 1;
        let start = self.at;
        while let Some(b) = self.peek() {
            if b == quote {
                let s = &self.text[start..self.at];
                self.at += 1;
                // Printable ASCII only (checked below), so this is valid UTF-8.
                return Ok(s.iter().map(|&b| b as char).collect());
            }
            if !(b.is_ascii_graphic() || b == b' ') || b == b'\\' || self.at - start >= MAX_STRING {
                return Err(self.unexpected(&format!(
                    "a string of at most {MAX_STRING} printable characters without escapes"
                )));
            }
            self.at += 1;
        }
        Err(self.unexpected("the closing quote"))
    }

    /// A tuple of non-negative integers: `()`, `(5,)`, `(2, 3)`, `(2, 3,)`; Python 2's
    /// `L` suffix is accepted.
    fn shape(&mut self) -> Result<Vec<usize>, NpyError> {
        self.expect(b'(', "a tuple '(...)' for 'shape'")?;
        let mut dims = Vec::new();
        let mut comma = false;
        loop {
            self.skip_space();
            if self.eat(b')') {
                break;
            }
            if !dims.is_empty() && !comma {
                return Err(self.unexpected("',' or ')' in the shape"));
            }
            let start = self.at;
            while self.peek().is_some_and(|b| b.is_ascii_digit()) {
                self.at += 1;
            }
            if self.at == start {
                return Err(self.unexpected("a non-negative integer in the shape"));
            }
            let digits = &self.text[start..self.at];
            let d = std::str::from_utf8(digits)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .and_then(|d| usize::try_from(d).ok())
                .ok_or_else(|| {
                    NpyError::malformed(format!(
                        "shape dimension {} does not fit in memory",
                        String::from_utf8_lossy(digits)
                    ))
                })?;
            self.eat(b'L');
            dims.push(d);
            self.skip_space();
            comma = self.eat(b',');
        }
        if dims.len() == 1 && !comma {
            // `(5)` is the integer 5 in Python, not a tuple.
            return Err(NpyError::malformed(
                "bad header: 'shape' must be a tuple, and a 1-tuple is written '(n,)'",
            ));
        }
        Ok(dims)
    }
}

impl Header {
    /// The error for a data section of `have` bytes where `data_bytes` are needed.
    fn wrong_length(&self, have: usize) -> NpyError {
        let what = if have < self.data_bytes {
            "only"
        } else {
            "trailing data:"
        };
        NpyError::malformed(format!(
            "shape {:?} of {} needs {} bytes of data, {} {} bytes follow the header",
            self.shape, self.descr, self.data_bytes, what, have
        ))
    }

    /// The tensor from the data section.
    fn decode(&self, data: &[u8]) -> Result<Tensor, NpyError> {
        if data.len() != self.data_bytes {
            return Err(self.wrong_length(data.len()));
        }
        let be = self.big_endian;
        let data = match self.dtype {
            DType::F32 => TensorData::F32(self.elements(data, |b: [u8; 4]| {
                f32::from_bits(if be {
                    u32::from_be_bytes(b)
                } else {
                    u32::from_le_bytes(b)
                })
            })),
            DType::F64 => TensorData::F64(self.elements(data, |b: [u8; 8]| {
                f64::from_bits(if be {
                    u64::from_be_bytes(b)
                } else {
                    u64::from_le_bytes(b)
                })
            })),
            DType::F16 => TensorData::F16(self.elements(data, |b: [u8; 2]| {
                f16::from_bits(if be {
                    u16::from_be_bytes(b)
                } else {
                    u16::from_le_bytes(b)
                })
            })),
            // bfloat16 is always the little-endian bit pattern (see `element_type`).
            DType::BF16 => TensorData::BF16(
                self.elements(data, |b: [u8; 2]| bf16::from_bits(u16::from_le_bytes(b))),
            ),
        };
        Tensor::from_data(self.shape.clone(), data)
            .map_err(|source| NpyError::Tensor { path: None, source })
    }

    /// Every element, in C order (`data` holds exactly `data_bytes`).
    fn elements<T: Copy, const N: usize>(&self, data: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        let v: Vec<T> = data
            .chunks_exact(N)
            .map(|c| {
                let mut b = [0u8; N];
                b.copy_from_slice(c);
                f(b)
            })
            .collect();
        if self.fortran {
            // `v` has exactly the shape's element count (checked in `decode`), so
            // `fortran_to_c` cannot return `None` here.
            fortran_to_c(&v, &self.shape).unwrap_or(v)
        } else {
            v
        }
    }
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

/// Maps a type string to a [`DType`] and whether the file is big-endian, or explains
/// why it is not supported.
fn element_type(descr: &str) -> Result<(DType, bool), NpyError> {
    let unsupported = |expected: &str| NpyError::UnsupportedDType {
        path: None,
        descr: format!("'{descr}'"),
        expected: expected.to_string(),
    };
    let (order, rest) = match descr.as_bytes().first() {
        Some(b'<' | b'>' | b'|' | b'=') => descr.split_at(1),
        _ => ("", descr),
    };
    // '=' is native order; every target this builds for is little-endian or says so here.
    let big = order == ">" || (order == "=" && cfg!(target_endian = "big"));
    match (rest, big) {
        ("f2", _) => Ok((DType::F16, big)),
        ("f4", _) => Ok((DType::F32, big)),
        ("f8", _) => Ok((DType::F64, big)),
        ("V2", false) => Ok((DType::BF16, false)),
        ("V2", true) => Err(unsupported(
            "a big-endian raw 2-byte type is ambiguous; bfloat16 must be stored as '<V2' \
             (the little-endian bit pattern, as NumPy with ml_dtypes writes it)",
        )),
        _ => Err(unsupported(ACCEPTED)),
    }
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

    /// Issue 8: a 132-byte header of unclosed braces took more than a minute with the
    /// backtracking Python-literal parser (time tripled per `{`). With the linear parser
    /// every depth up to the header limit is refused at once; before the fix this test
    /// did not finish.
    #[test]
    fn unclosed_nesting_is_refused_in_linear_time() {
        for open in ["{", "[", "(", "{'a': [", "{'descr': ("] {
            for depth in [10, 14, 30, 1000, 60_000] {
                let dict = format!(
                    "{{'descr': {}'<f4', 'fortran_order': False",
                    open.repeat(depth)
                );
                let mut file = b"\x93NUMPY\x02\x00".to_vec();
                file.extend_from_slice(&(dict.len() as u32).to_le_bytes());
                file.extend_from_slice(dict.as_bytes());
                let msg = err(&file);
                assert!(
                    msg.starts_with("not a valid .npy file")
                        || msg.starts_with("unsupported element type"),
                    "{open} x {depth}: {msg}"
                );
            }
        }
        // The issue's own 132-byte file.
        let mut file = b"\x93NUMPY\x01\x00\x7a\x00{'descr': {{{{{{{{{{{{{{'<f4', 'fortran_order': False, 'shape': (2,), }".to_vec();
        file.resize(132, b' ');
        assert!(err(&file).starts_with("not a valid .npy file"));
    }

    #[test]
    fn header_grammar_is_strict_and_bounded() {
        let ok = |dict: &str, data: &[u8]| from_bytes(&npy_file(dict, data));
        // Accepted spellings: double quotes, keys in any order, Python 2's `L`, no
        // trailing comma, a trailing comma in the tuple.
        for dict in [
            "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2,)}",
            "{'shape': (2L,), 'fortran_order': False, 'descr': '<f4'}",
            "{'descr':'<f4','fortran_order':False,'shape':(1, 2,),}",
            "  {'descr': '=f4', 'fortran_order': False, 'shape': (2,), }",
        ] {
            let t = ok(dict, &[0; 8]).unwrap_or_else(|e| panic!("{dict}: {e}"));
            assert_eq!(t.numel(), 2, "{dict}");
        }
        for (dict, why) in [
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2), }",
                "1-tuple",
            ),
            (
                "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}",
                "repeats",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}",
                "unexpected key",
            ),
            ("{'descr': '<f4', 'shape': (2,)}", "no 'fortran_order'"),
            (
                "{'descr': '<f4', 'fortran_order': Falsey, 'shape': (2,)}",
                "True or False",
            ),
            (
                "{'descr': '<f\\x34', 'fortran_order': False, 'shape': (2,)}",
                "without escapes",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk",
                "only spaces",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2 3)}",
                "',' or ')'",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}",
                "non-negative",
            ),
        ] {
            let msg = ok(dict, &[0; 8]).unwrap_err().to_string();
            assert!(msg.contains(why), "{dict}: {msg}");
        }
        let long = format!("'{}'", "x".repeat(MAX_STRING + 1));
        let msg = ok(&format!("{{{long}: 1}}"), &[]).unwrap_err().to_string();
        assert!(msg.contains("at most 64"), "{msg}");
        // A header longer than the limit is refused from its length field alone.
        let mut file = b"\x93NUMPY\x02\x00".to_vec();
        file.extend_from_slice(&((MAX_HEADER_BYTES + 1) as u32).to_le_bytes());
        assert!(err(&file).contains("more than the 1048576 accepted"));
    }

    /// A regular file whose header claims far more data than it holds is refused from
    /// its size before anything is allocated for the claim; a device is read only as far
    /// as its prefix.
    #[cfg(unix)]
    #[test]
    fn reading_is_bounded_by_the_file() {
        let dir = std::env::temp_dir().join(format!("fusedbn-npy-bound-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lying.npy");
        std::fs::write(
            &path,
            npy_file(
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }",
                &[0; 8],
            ),
        )
        .unwrap();
        let msg = read(&path).unwrap_err().to_string();
        assert!(
            msg.contains("needs 4398046511104 bytes of data, only 8"),
            "{msg}"
        );
        let msg = read("/dev/zero").unwrap_err().to_string();
        assert!(msg.contains("magic"), "{msg}");
        let msg = read(&dir).unwrap_err().to_string();
        assert!(msg.contains("could not read"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
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
