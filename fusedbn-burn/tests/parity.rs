//! Parity with `burn::nn::BatchNorm` on the same parameters: outputs, every
//! gradient through burn's autodiff from a scalar loss, running statistics, train
//! and eval, ranks 2 to 5, f32 and f64; f16/bf16 against the f32 path on the same
//! rounded inputs; channels-last views; gradient checkpointing.

mod common;

use burn::module::{Module, Param};
use burn::tensor::{DType, Device, Tensor};
use common::*;

/// One training step of a module: (y, dx, dgamma, dbeta) from the loss sum(w·y).
type Step = [Vec<f64>; 4];

trait Bn {
    fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D>;
    fn gamma(&self) -> Tensor<1>;
    fn beta(&self) -> Tensor<1>;
    fn running(&self) -> [Vec<f64>; 2];
}

impl Bn for burn::nn::BatchNorm {
    fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        burn::nn::BatchNorm::forward(self, x)
    }
    fn gamma(&self) -> Tensor<1> {
        self.gamma.val()
    }
    fn beta(&self) -> Tensor<1> {
        self.beta.val()
    }
    fn running(&self) -> [Vec<f64>; 2] {
        [
            to_f64(self.running_mean.value_sync()),
            to_f64(self.running_var.value_sync()),
        ]
    }
}

impl Bn for fusedbn_burn::BatchNorm {
    fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        fusedbn_burn::BatchNorm::forward(self, x)
    }
    fn gamma(&self) -> Tensor<1> {
        self.gamma.val()
    }
    fn beta(&self) -> Tensor<1> {
        self.beta.val()
    }
    fn running(&self) -> [Vec<f64>; 2] {
        [
            to_f64(self.running_mean.value_sync()),
            to_f64(self.running_var.value_sync()),
        ]
    }
}

fn step<const D: usize>(
    bn: &impl Bn,
    x: &[f64],
    w: &[f64],
    shape: [usize; D],
    dtype: DType,
    device: &Device,
) -> Step {
    let x = tensor(x, shape, dtype, device).require_grad();
    let w = tensor(w, shape, dtype, device);
    let y = bn.forward(x.clone());
    let grads = (y.clone() * w).sum().backward();
    let grad = |t: &Tensor<1>| to_f64(t.grad(&grads).expect("a parameter gradient"));
    [
        to_f64(y),
        to_f64(x.grad(&grads).expect("x's gradient")),
        grad(&bn.gamma()),
        grad(&bn.beta()),
    ]
}

const NAMES: [&str; 4] = ["y", "dx", "dgamma", "dbeta"];

/// Train two steps, then evaluate, with both modules; compare everything.
fn parity<const D: usize>(shape: [usize; D], dtype: DType, tol: f64) {
    let device = Device::flex().autodiff();
    let n: usize = shape.iter().product();
    let c = shape[1];
    let p = Params::new(c, 7);
    let theirs = burn_bn(&p, dtype, &device);
    let ours = fused_bn(&p, dtype, &device);
    let at = |what: &str| format!("{dtype:?} {shape:?} {what}");
    assert!(fusedbn_burn::is_fused(&tensor(
        &[0.0; 1],
        [1],
        dtype,
        &device
    )));
    for s in 0..2 {
        let x = values(n, 100 + s, 0.5, 2.0);
        let w = values(n, 200 + s, 0.0, 1.0);
        let a = step(&ours, &x, &w, shape, dtype, &device);
        let b = step(&theirs, &x, &w, shape, dtype, &device);
        for k in 0..4 {
            assert_close(
                &at(&format!("train step {s} {}", NAMES[k])),
                &a[k],
                &b[k],
                tol,
            );
        }
        let (ra, rb) = (ours.running(), theirs.running());
        assert_close(&at("running_mean"), &ra[0], &rb[0], tol);
        assert_close(&at("running_var"), &ra[1], &rb[1], tol);
    }
    // Eval on a plain device (burn's `valid`), and the inference path on the
    // autodiff device with training off, gradients included.
    let x = values(n, 300, 0.5, 2.0);
    let plain = Device::flex();
    let ya = to_f64(ours.valid().forward(tensor(&x, shape, dtype, &plain)));
    let yb = to_f64(theirs.valid().forward(tensor(&x, shape, dtype, &plain)));
    assert_close(&at("eval y"), &ya, &yb, tol);
    let mut ours = ours;
    let mut theirs = theirs;
    ours.training = Param::from_bool(false);
    theirs.training = Param::from_bool(false);
    let w = values(n, 400, 0.0, 1.0);
    let a = step(&ours, &x, &w, shape, dtype, &device);
    let b = step(&theirs, &x, &w, shape, dtype, &device);
    for k in 0..4 {
        assert_close(&at(&format!("inference {}", NAMES[k])), &a[k], &b[k], tol);
    }
}

macro_rules! every_rank {
    ($dtype:expr, $tol:expr) => {
        parity([16, 5], $dtype, $tol);
        parity([4, 3, 7], $dtype, $tol);
        parity([3, 4, 5, 6], $dtype, $tol);
        parity([2, 3, 2, 3, 4], $dtype, $tol);
        parity([2, 8, 64, 64], $dtype, $tol); // large enough for the parallel kernels
    };
}

#[test]
fn f32_matches_burn_in_every_rank() {
    every_rank!(DType::F32, 1e-5);
}

#[test]
fn f64_matches_burn_in_every_rank() {
    every_rank!(DType::F64, 1e-12);
}

/// Half precision against our own f32 path on the same rounded inputs and
/// parameters: the kernels compute in f32 and round once.
fn half<const D: usize>(shape: [usize; D], dtype: DType, tol: f64) {
    let device = Device::flex().autodiff();
    let n: usize = shape.iter().product();
    let c = shape[1];
    let round = |v: Vec<f64>| to_f64(tensor(&v, [v.len()], dtype, &Device::flex()));
    let mut p = Params::new(c, 11);
    p.gamma = round(p.gamma);
    p.beta = round(p.beta);
    p.running_mean = round(p.running_mean);
    p.running_var = round(p.running_var);
    let x = round(values(n, 500, 0.5, 2.0));
    let w = round(values(n, 600, 0.0, 1.0));
    let low = fused_bn(&p, dtype, &device);
    let wide = fused_bn(&p, DType::F32, &device);
    let a = step(&low, &x, &w, shape, dtype, &device);
    let b = step(&wide, &x, &w, shape, DType::F32, &device);
    assert_eq!(low.gamma.val().dtype(), dtype);
    for k in 0..4 {
        assert_close(
            &format!("{dtype:?} {shape:?} {}", NAMES[k]),
            &a[k],
            &b[k],
            tol,
        );
    }
    // Running statistics: the update runs in the module's dtype, as burn's.
    let (ra, rb) = (low.running(), wide.running());
    assert_close("running_mean", &ra[0], &rb[0], tol);
    assert_close("running_var", &ra[1], &rb[1], tol);
}

#[test]
fn f16_and_bf16_match_the_f32_path() {
    // f16 keeps 11 significant bits, bf16 8: each output is rounded once, the
    // parameter gradients are f32 sums rounded once, dy = w is exact.
    for (dtype, tol) in [(DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        half([32, 4], dtype, tol);
        half([4, 3, 7], dtype, tol);
        half([3, 4, 5, 6], dtype, tol);
        half([2, 3, 2, 3, 4], dtype, tol);
    }
}

#[test]
fn a_channels_last_view_gives_the_contiguous_results() {
    // x stored as [N, H, W, C] and seen as [N, C, H, W] through a permutation: the
    // kernels run on the buffer as it is.
    let device = Device::flex().autodiff();
    let (n, c, h, w) = (3, 6, 5, 4);
    let p = Params::new(c, 3);
    let ours = fused_bn(&p, DType::F32, &device);
    let theirs = burn_bn(&p, DType::F32, &device);
    let xv = values(n * h * w * c, 42, 0.5, 2.0);
    let wv = values(n * c * h * w, 43, 0.0, 1.0);
    let run = |bn: &dyn Fn(Tensor<4>) -> Tensor<4>| {
        let x = tensor(&xv, [n, h, w, c], DType::F32, &device).require_grad();
        let y = bn(x.clone().permute([0, 3, 1, 2]));
        let grads = (y.clone() * tensor(&wv, [n, c, h, w], DType::F32, &device))
            .sum()
            .backward();
        (to_f64(y), to_f64(x.grad(&grads).unwrap()))
    };
    let (ya, dxa) = run(&|x| ours.forward(x));
    let (yb, dxb) = run(&|x| theirs.forward(x));
    assert_close("channels-last y", &ya, &yb, 1e-5);
    assert_close("channels-last dx", &dxa, &dxb, 1e-5);
}

#[test]
fn trains_under_gradient_checkpointing() {
    let device = Device::flex().autodiff().gradient_checkpointing();
    let shape = [4, 3, 5, 5];
    let p = Params::new(3, 5);
    let x = values(300, 1, 0.5, 2.0);
    let w = values(300, 2, 0.0, 1.0);
    let a = step(
        &fused_bn(&p, DType::F32, &device),
        &x,
        &w,
        shape,
        DType::F32,
        &device,
    );
    let b = step(
        &burn_bn(&p, DType::F32, &device),
        &x,
        &w,
        shape,
        DType::F32,
        &device,
    );
    for k in 0..4 {
        assert_close(NAMES[k], &a[k], &b[k], 1e-5);
    }
}

#[test]
fn frozen_module_keeps_its_running_statistics() {
    let device = Device::flex().autodiff();
    let p = Params::new(3, 9);
    let bn = fused_bn(&p, DType::F32, &device).freeze();
    let before = bn.running();
    let _ = bn.forward(tensor(
        &values(24, 3, 1.0, 1.0),
        [8, 3],
        DType::F32,
        &device,
    ));
    assert_eq!(bn.running(), before);
}

#[test]
fn the_functional_forms_match_burns() {
    let device = Device::flex();
    let shape = [4, 3, 5];
    let x = values(60, 8, 0.5, 2.0);
    let p = Params::new(3, 1);
    let t = |v: &[f64]| tensor(v, [v.len()], DType::F32, &device);
    let a = fusedbn_burn::batch_norm_train(
        tensor(&x, shape, DType::F32, &device),
        t(&p.gamma),
        t(&p.beta),
        1e-3,
    );
    let b = burn::tensor::module::batch_norm_train(
        tensor(&x, shape, DType::F32, &device),
        t(&p.gamma),
        t(&p.beta),
        1e-3,
    );
    assert_close("output", &to_f64(a.output), &to_f64(b.output), 1e-5);
    assert_close("mean", &to_f64(a.mean), &to_f64(b.mean), 1e-6);
    assert_close("variance", &to_f64(a.variance), &to_f64(b.variance), 1e-6);
    let a = fusedbn_burn::batch_norm(
        tensor(&x, shape, DType::F32, &device),
        t(&p.gamma),
        t(&p.beta),
        t(&p.running_mean),
        t(&p.running_var),
        1e-3,
    );
    let b = burn::tensor::module::batch_norm(
        tensor(&x, shape, DType::F32, &device),
        t(&p.gamma),
        t(&p.beta),
        t(&p.running_mean),
        t(&p.running_var),
        1e-3,
    );
    assert_close("inference", &to_f64(a), &to_f64(b), 1e-6);
}
