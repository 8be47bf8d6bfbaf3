//! Shared helpers: deterministic data, the two modules with the same parameters,
//! and comparisons.
#![allow(dead_code)]

use burn::module::{Param, RunningState};
use burn::tensor::{DType, Device, Tensor, TensorData};

/// Deterministic values in roughly [-1, 1) (a 64-bit LCG), shifted and scaled.
pub fn values(n: usize, seed: u64, shift: f64, scale: f64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            shift + scale * (2.0 * u - 1.0)
        })
        .collect()
}

/// A tensor of the given dtype holding `v` (rounded to the dtype).
pub fn tensor<const D: usize>(
    v: &[f64],
    shape: [usize; D],
    dtype: DType,
    device: &Device,
) -> Tensor<D> {
    Tensor::from_data(TensorData::new(v.to_vec(), shape), (device, dtype))
}

/// The tensor's values as f64.
pub fn to_f64<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.into_data().convert::<f64>().try_to_vec::<f64>().unwrap()
}

/// Parameters and running statistics for `c` channels.
pub struct Params {
    pub gamma: Vec<f64>,
    pub beta: Vec<f64>,
    pub running_mean: Vec<f64>,
    pub running_var: Vec<f64>,
}

impl Params {
    pub fn new(c: usize, seed: u64) -> Self {
        Params {
            gamma: values(c, seed, 1.0, 0.5),
            beta: values(c, seed + 1, 0.0, 0.5),
            running_mean: values(c, seed + 2, 0.0, 0.3),
            running_var: values(c, seed + 3, 1.0, 0.5),
        }
    }
}

/// burn's module with these parameters.
pub fn burn_bn(p: &Params, dtype: DType, device: &Device) -> burn::nn::BatchNorm {
    let c = p.gamma.len();
    let mut bn = burn::nn::BatchNormConfig::new(c).init(device);
    bn.gamma = Param::from_tensor(tensor(&p.gamma, [c], dtype, device));
    bn.beta = Param::from_tensor(tensor(&p.beta, [c], dtype, device));
    bn.running_mean = RunningState::new(tensor(&p.running_mean, [c], dtype, device));
    bn.running_var = RunningState::new(tensor(&p.running_var, [c], dtype, device));
    bn
}

/// Our module with these parameters.
pub fn fused_bn(p: &Params, dtype: DType, device: &Device) -> fusedbn_burn::BatchNorm {
    let c = p.gamma.len();
    let mut bn = fusedbn_burn::BatchNormConfig::new(c).init(device);
    bn.gamma = Param::from_tensor(tensor(&p.gamma, [c], dtype, device));
    bn.beta = Param::from_tensor(tensor(&p.beta, [c], dtype, device));
    bn.running_mean = RunningState::new(tensor(&p.running_mean, [c], dtype, device));
    bn.running_var = RunningState::new(tensor(&p.running_var, [c], dtype, device));
    bn
}

/// max |a − b| / max |b| (norm-wise relative error), asserted ≤ tol.
pub fn assert_close(what: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    let (i, err) = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .enumerate()
        .fold(
            (0, 0.0f64),
            |(bi, be), (i, e)| if e > be { (i, e) } else { (bi, be) },
        );
    let rel = err / scale;
    assert!(
        rel <= tol,
        "{what}: relative error {rel:.3e} > {tol:.1e} at {i}: {} vs {} (scale {scale:.3e})",
        a[i],
        b[i]
    );
}

/// The shapes every test runs: ranks 2 to 5.
pub fn shapes() -> Vec<Vec<usize>> {
    vec![
        vec![16, 5],
        vec![4, 3, 7],
        vec![3, 4, 5, 6],
        vec![2, 3, 2, 3, 4],
    ]
}
