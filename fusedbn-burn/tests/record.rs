//! Records: what `burn::nn::BatchNorm` saves loads into ours, and back; the
//! conversions share the parameters.

mod common;

use burn::module::Module;
use burn::store::ModuleRecord;
use burn::tensor::{DType, Device};
use common::*;

fn state(
    gamma: &burn::module::Param<burn::tensor::Tensor<1>>,
    beta: &burn::module::Param<burn::tensor::Tensor<1>>,
    m: &burn::module::RunningState<burn::tensor::Tensor<1>>,
    v: &burn::module::RunningState<burn::tensor::Tensor<1>>,
) -> [Vec<f64>; 4] {
    [
        to_f64(gamma.val()),
        to_f64(beta.val()),
        to_f64(m.value()),
        to_f64(v.value()),
    ]
}

#[test]
fn a_record_saved_by_burns_module_loads_into_ours_and_back() {
    let device = Device::flex();
    let p = Params::new(6, 21);
    let theirs = burn_bn(&p, DType::F32, &device);
    let expected = state(
        &theirs.gamma,
        &theirs.beta,
        &theirs.running_mean,
        &theirs.running_var,
    );

    // Through bytes and through a file, as burn's record system writes them.
    let bytes = theirs.clone().into_record().into_bytes().unwrap();
    let ours = fusedbn_burn::BatchNormConfig::new(6)
        .init(&device)
        .load_record(ModuleRecord::from_bytes(bytes).unwrap());
    assert_eq!(
        state(
            &ours.gamma,
            &ours.beta,
            &ours.running_mean,
            &ours.running_var
        ),
        expected
    );

    let dir = std::env::temp_dir().join(format!("fusedbn-burn-record-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bn.bpk");
    ours.save_file(&path).unwrap();
    let back = burn::nn::BatchNormConfig::new(6)
        .init(&device)
        .load_file(&path);
    // (the loaded tensors read the file lazily: compare before removing it)
    assert_eq!(
        state(
            &back.gamma,
            &back.beta,
            &back.running_mean,
            &back.running_var
        ),
        expected
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn conversions_keep_parameters_and_their_ids() {
    let device = Device::flex().autodiff();
    let theirs = burn_bn(&Params::new(4, 2), DType::F32, &device);
    let ids = (theirs.gamma.id, theirs.beta.id);
    let settings = (theirs.momentum, theirs.epsilon);
    let ours = fusedbn_burn::BatchNorm::from(theirs);
    assert_eq!((ours.gamma.id, ours.beta.id), ids);
    assert_eq!((ours.momentum, ours.epsilon), settings);
    let back: burn::nn::BatchNorm = ours.into();
    assert_eq!((back.gamma.id, back.beta.id), ids);
    let config: fusedbn_burn::BatchNormConfig =
        burn::nn::BatchNormConfig::new(4).with_momentum(0.3).into();
    assert_eq!(
        (config.num_features, config.momentum, config.epsilon),
        (4, 0.3, 1e-5)
    );
}
