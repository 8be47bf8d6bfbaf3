//! A small CNN trained on synthetic data twice from the same weights: once with
//! `burn::nn::BatchNorm`, once with `fusedbn_burn::BatchNorm` (the one-line
//! switch). Prints both loss trajectories and fails if they part by more than the
//! tolerance.
//!
//! ```sh
//! cargo run --release -p fusedbn-burn --example burn_train
//! ```

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};

const STEPS: usize = 300;
const BATCH: usize = 32;
const CLASSES: usize = 4;
const SIDE: usize = 8;
const WIDTH: usize = 8;

/// conv3x3 → batch norm → ReLU → conv3x3 → batch norm → ReLU → linear, with the
/// batch norm of the caller's choice.
macro_rules! net {
    ($name:ident, $bn:ty, $config:ty) => {
        #[derive(Module, Debug)]
        struct $name {
            conv1: Conv2d,
            bn1: $bn,
            conv2: Conv2d,
            bn2: $bn,
            head: Linear,
            relu: Relu,
        }

        impl $name {
            fn new(device: &Device) -> Self {
                let conv = |i, o| {
                    Conv2dConfig::new([i, o], [3, 3])
                        .with_padding(PaddingConfig2d::Same)
                        .init(device)
                };
                $name {
                    conv1: conv(1, WIDTH),
                    bn1: <$config>::new(WIDTH).init(device),
                    conv2: conv(WIDTH, WIDTH),
                    bn2: <$config>::new(WIDTH).init(device),
                    head: LinearConfig::new(WIDTH * SIDE * SIDE, CLASSES).init(device),
                    relu: Relu::new(),
                }
            }

            fn forward(&self, x: Tensor<4>) -> Tensor<2> {
                let x = self.relu.forward(self.bn1.forward(self.conv1.forward(x)));
                let x = self.relu.forward(self.bn2.forward(self.conv2.forward(x)));
                self.head.forward(x.flatten(1, 3))
            }
        }
    };
}

net!(BurnNet, burn::nn::BatchNorm, burn::nn::BatchNormConfig);
net!(
    FusedNet,
    fusedbn_burn::BatchNorm,
    fusedbn_burn::BatchNormConfig
);

/// A batch: class k is a bright quadrant k on noise, with a per-image offset.
fn batch(step: usize, device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
    let mut s = (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut rand = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f32 / (1u64 << 53) as f32
    };
    let mut x = Vec::with_capacity(BATCH * SIDE * SIDE);
    let mut y = Vec::with_capacity(BATCH);
    for _ in 0..BATCH {
        let class = (rand() * CLASSES as f32) as usize % CLASSES;
        let offset = rand() * 2.0 - 1.0;
        for r in 0..SIDE {
            for c in 0..SIDE {
                let quadrant = (r >= SIDE / 2) as usize * 2 + (c >= SIDE / 2) as usize;
                let signal = if quadrant == class { 1.0 } else { 0.0 };
                x.push(0.6 * signal + offset + 2.0 * (rand() - 0.5));
            }
        }
        y.push(class as i64);
    }
    (
        Tensor::from_data(TensorData::new(x, [BATCH, 1, SIDE, SIDE]), device),
        Tensor::from_data(TensorData::new(y, [BATCH]), device),
    )
}

macro_rules! train {
    ($model:expr, $device:expr) => {{
        let device = $device;
        let mut model = $model;
        let mut optim = SgdConfig::new().init();
        let loss_fn = CrossEntropyLossConfig::new().init(device);
        let mut losses = Vec::with_capacity(STEPS);
        let start = std::time::Instant::now();
        for step in 0..STEPS {
            let (x, y) = batch(step, device);
            let loss = loss_fn.forward(model.forward(x), y);
            losses.push(loss.clone().into_scalar::<f32>());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(0.05, model, grads);
        }
        (losses, start.elapsed(), model)
    }};
}

fn main() {
    let device = Device::flex().autodiff();
    device.seed(7);
    let fused = FusedNet::new(&device);
    // burn's network with the very same weights, through burn's record: the
    // batch norms' records have the same names.
    let theirs = BurnNet::new(&device).load_record(fused.clone().into_record());

    let (burn_losses, burn_time, _) = train!(theirs, &device);
    let (fused_losses, fused_time, _) = train!(fused, &device);

    println!("step  burn::nn::BatchNorm  fusedbn_burn::BatchNorm  |difference|");
    let mut worst = 0.0f32;
    for step in 0..STEPS {
        let (a, b) = (burn_losses[step], fused_losses[step]);
        let diff = (a - b).abs();
        worst = worst.max(diff / a.abs().max(1.0));
        if step % 25 == 0 || step == STEPS - 1 {
            println!("{step:>4}  {a:>19.6}  {b:>23.6}  {diff:>12.2e}");
        }
    }
    println!(
        "training time: burn {:.2?}, fusedbn {:.2?} ({STEPS} steps, batch {BATCH}, {WIDTH}x{SIDE}x{SIDE} activations)",
        burn_time, fused_time
    );
    // The two batch norms differ by f32 rounding (~1e-7 a step); SGD on noisy
    // data amplifies that over the steps, to ~1e-3 by the end.
    let tolerance = 5e-3;
    println!("largest difference / max(|loss|, 1): {worst:.2e} (tolerance {tolerance:.0e})");
    assert!(
        worst <= tolerance,
        "the loss trajectories part by {worst:.2e} > {tolerance:.0e}"
    );
    assert!(
        fused_losses[STEPS - 1] < 0.5 * fused_losses[0],
        "the network did not learn: loss {} -> {}",
        fused_losses[0],
        fused_losses[STEPS - 1]
    );
}

#[test]
fn loss_trajectories_match_burn_batch_norm() {
    main();
}
