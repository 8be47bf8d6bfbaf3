//! The Flex-primitive functions have the signatures and contracts of burn's
//! `ModuleOps` batch-norm methods: compared with burn's own implementation on Flex.

mod common;

use burn::backend::flex::FlexTensor;
use burn::backend::ops::ModuleOps;
use burn::backend::Flex;
use burn::tensor::{DType, TensorData};
use common::*;

fn flex(v: &[f64], shape: &[usize], dtype: DType) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(v.to_vec(), shape.to_vec()).convert_dtype(dtype))
}

fn vals(t: FlexTensor) -> Vec<f64> {
    t.into_data().convert::<f64>().try_to_vec::<f64>().unwrap()
}

#[test]
fn the_module_ops_functions_match_burns_flex_implementation() {
    // Function pointers of exactly ModuleOps' types.
    let train: fn(FlexTensor, FlexTensor, FlexTensor, f64) -> _ =
        fusedbn_burn::flex::batch_norm_train;
    let backward: fn(FlexTensor, FlexTensor, FlexTensor, FlexTensor, f64, FlexTensor) -> _ =
        fusedbn_burn::flex::batch_norm_train_backward;
    let burn_train: fn(FlexTensor, FlexTensor, FlexTensor, f64) -> _ =
        <Flex as ModuleOps<Flex>>::batch_norm_train;
    let burn_backward: fn(FlexTensor, FlexTensor, FlexTensor, FlexTensor, f64, FlexTensor) -> _ =
        <Flex as ModuleOps<Flex>>::batch_norm_train_backward;
    for dtype in [DType::F32, DType::F64] {
        let shape = [4, 3, 5, 2];
        let n = 120;
        let x = values(n, 1, 0.5, 2.0);
        let dy = values(n, 2, 0.0, 1.0);
        let p = Params::new(3, 3);
        let t = |v: &[f64]| flex(v, &[v.len()], dtype);
        let a = train(flex(&x, &shape, dtype), t(&p.gamma), t(&p.beta), 1e-5);
        let b = burn_train(flex(&x, &shape, dtype), t(&p.gamma), t(&p.beta), 1e-5);
        assert_eq!(a.mean.dtype(), dtype);
        let (ma, va) = (vals(a.mean.clone()), vals(a.variance.clone()));
        assert_close("output", &vals(a.output), &vals(b.output), 1e-5);
        assert_close("mean", &ma, &vals(b.mean), 1e-6);
        assert_close("variance", &va, &vals(b.variance), 1e-6);
        let ga = backward(
            flex(&x, &shape, dtype),
            t(&p.gamma),
            a.mean,
            a.variance,
            1e-5,
            flex(&dy, &shape, dtype),
        );
        let gb = burn_backward(
            flex(&x, &shape, dtype),
            t(&p.gamma),
            t(&ma),
            t(&va),
            1e-5,
            flex(&dy, &shape, dtype),
        );
        assert_close("x_grad", &vals(ga.x_grad), &vals(gb.x_grad), 1e-5);
        assert_close(
            "gamma_grad",
            &vals(ga.gamma_grad),
            &vals(gb.gamma_grad),
            1e-5,
        );
        assert_close("beta_grad", &vals(ga.beta_grad), &vals(gb.beta_grad), 1e-5);
        let ya = fusedbn_burn::flex::batch_norm(
            flex(&x, &shape, dtype),
            t(&p.gamma),
            t(&p.beta),
            t(&p.running_mean),
            t(&p.running_var),
            1e-5,
        );
        let yb = <Flex as ModuleOps<Flex>>::batch_norm(
            flex(&x, &shape, dtype),
            t(&p.gamma),
            t(&p.beta),
            t(&p.running_mean),
            t(&p.running_var),
            1e-5,
        );
        assert_close("inference", &vals(ya), &vals(yb), 1e-6);
    }
}
