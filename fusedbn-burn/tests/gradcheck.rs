//! The gradients through burn's autodiff against central finite differences of the
//! loss, in f64, training and inference.

mod common;

use burn::module::Param;
use burn::tensor::{DType, Device, Tensor};
use common::*;

/// sum(w · bn(x)) with the given parameters, as f64.
fn loss(
    x: &[f64],
    gamma: &[f64],
    beta: &[f64],
    w: &[f64],
    shape: [usize; 3],
    training: bool,
) -> f64 {
    let device = Device::flex().autodiff();
    let c = shape[1];
    let mut p = Params::new(c, 4);
    p.gamma = gamma.to_vec();
    p.beta = beta.to_vec();
    let mut bn = fused_bn(&p, DType::F64, &device);
    bn.training = Param::from_bool(training);
    let y = bn.forward(tensor(x, shape, DType::F64, &device));
    to_f64((y * tensor(w, shape, DType::F64, &device)).sum())[0]
}

fn check(training: bool) {
    let shape = [3, 2, 4];
    let n = 24;
    let device = Device::flex().autodiff();
    let x = values(n, 31, 0.3, 1.5);
    let w = values(n, 32, 0.0, 1.0);
    let p = Params::new(2, 4);
    let mut bn = fused_bn(&p, DType::F64, &device);
    bn.training = Param::from_bool(training);
    let xt = tensor(&x, shape, DType::F64, &device).require_grad();
    let grads = (bn.forward(xt.clone()) * tensor(&w, shape, DType::F64, &device))
        .sum()
        .backward();
    let analytic: Vec<Vec<f64>> = vec![
        to_f64(xt.grad(&grads).unwrap()),
        to_f64(bn.gamma.val().grad(&grads).unwrap()),
        to_f64(bn.beta.val().grad(&grads).unwrap()),
    ];
    let h = 1e-6;
    for (k, name) in ["x", "gamma", "beta"].into_iter().enumerate() {
        let len = [n, 2, 2][k];
        let numeric: Vec<f64> = (0..len)
            .map(|i| {
                let at = |d: f64| {
                    let (mut xx, mut g, mut b) = (x.clone(), p.gamma.clone(), p.beta.clone());
                    [&mut xx, &mut g, &mut b][k][i] += d;
                    loss(&xx, &g, &b, &w, shape, training)
                };
                (at(h) - at(-h)) / (2.0 * h)
            })
            .collect();
        assert_close(
            &format!("training={training} d{name}"),
            &analytic[k],
            &numeric,
            1e-7,
        );
    }
}

#[test]
fn training_gradients_match_finite_differences_in_f64() {
    check(true);
}

#[test]
fn inference_gradients_match_finite_differences_in_f64() {
    check(false);
}

#[test]
fn a_constant_output_gradient_gives_no_input_gradient() {
    // Training batch norm's output is invariant to a shift of x per channel, so a
    // constant dy has no effect on x.
    let device = Device::flex().autodiff();
    let bn = fusedbn_burn::BatchNormConfig::new(3).init(&device);
    let x =
        Tensor::<3>::from_floats([[[1.0, 2.0], [3.0, 5.0], [0.0, 1.0]]], &device).require_grad();
    let grads = bn.forward(x.clone()).sum().backward();
    let dx = to_f64(x.grad(&grads).unwrap());
    assert!(dx.iter().all(|g| g.abs() < 1e-6), "{dx:?}");
}

/// A double backward through the op panics with the message the crate documents, as
/// burn's own batch norm does: on the backend type `Autodiff<Autodiff<Flex>>`, the only
/// way to one in burn 0.22 (its `Tensor` API does not nest autodiff).
#[test]
#[should_panic(expected = "the batch-norm gradient is not differentiable")]
fn a_double_backward_panics_with_the_documented_message() {
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::{Autodiff, AutodiffBackend, Flex, FlexDevice, TensorData};
    use fusedbn_burn::FusedBatchNormBackend;
    type B2 = Autodiff<Autodiff<Flex>>;
    let leaf = |v: Vec<f32>, shape: Vec<usize>| {
        let t = B2::float_from_data(TensorData::new(v, shape), &FlexDevice);
        B2::float_set_require_grad(t, true)
    };
    let x = leaf(
        (0..24).map(|i| (i % 7) as f32 * 0.3).collect(),
        vec![2, 3, 4],
    );
    let (gamma, beta) = (leaf(vec![1.0; 3], vec![3]), leaf(vec![0.0; 3], vec![3]));
    let (y, _, _) = B2::fusedbn_train(x, gamma, beta, 1e-5);
    let loss = B2::float_sum(B2::float_mul(y.clone(), y));
    let _ = <B2 as AutodiffBackend>::backward(loss);
}
