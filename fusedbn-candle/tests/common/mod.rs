//! Helpers shared by the parity tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};

pub const DEV: Device = Device::Cpu;

/// `max |a − b| / max |b|`, in f64.
pub fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let diff = a.iter().zip(&b).fold(0f64, |m, (x, y)| {
        if (x - y).is_nan() {
            f64::INFINITY
        } else {
            m.max((x - y).abs())
        }
    });
    Ok(diff / scale)
}

/// Asserts `rel(a, b) <= tol`, naming what is compared.
pub fn close(what: &str, a: &Tensor, b: &Tensor, tol: f64) -> Result<()> {
    let r = rel(a, b)?;
    assert!(r <= tol, "{what}: relative difference {r:e} > {tol:e}");
    Ok(())
}

/// Every element of `a` (a half type) within `ulps` roundings (of relative size `unit`)
/// of `b` (the f32 path), plus a floor of as many roundings of `floor·max|b|` (for
/// values near zero, or results of a cancellation).
pub fn close_half(
    what: &str,
    a: &Tensor,
    b: &Tensor,
    unit: f64,
    ulps: f64,
    floor: f64,
) -> Result<()> {
    let a = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let tol = ulps * unit * (y.abs() + floor * scale);
        assert!(
            (x - y).abs() <= tol,
            "{what}[{i}]: {x} vs {y} (tolerance {tol:e})"
        );
    }
    Ok(())
}

/// A deterministic pseudo-random tensor (xorshift), values in `[lo, hi)`.
pub fn rand(shape: &[usize], lo: f64, hi: f64, seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect();
    Tensor::from_vec(v, shape, &DEV)
}

/// A fresh variable holding a copy of `t` in `dtype`.
pub fn var(t: &Tensor, dtype: DType) -> Result<Var> {
    // `make_var` copies into a fresh contiguous buffer.
    Var::from_tensor(&t.to_dtype(dtype)?)
}

/// The permutation from `[N, C, *]` to `[N, *, C]` and back.
pub fn perms(rank: usize) -> (Vec<usize>, Vec<usize>) {
    let to_last: Vec<usize> = [0].into_iter().chain(2..rank).chain([1]).collect();
    let to_first: Vec<usize> = [0, rank - 1].into_iter().chain(1..rank - 1).collect();
    (to_last, to_first)
}

/// `[N, C, *]` as candle-nn takes it, from its `[N, *, C]` buffer: a permuted view of
/// channels-last memory.
pub fn channels_last_view(buffer: &Tensor) -> Result<Tensor> {
    let (_, to_first) = perms(buffer.rank());
    buffer.permute(to_first.as_slice())
}

/// True when `t` (`[N, C, *]`) is a view of contiguous channels-last memory.
pub fn is_channels_last(t: &Tensor) -> Result<bool> {
    let (to_last, _) = perms(t.rank());
    Ok(t.permute(to_last.as_slice())?.is_contiguous())
}
