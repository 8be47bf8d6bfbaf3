//! A small CNN trained on synthetic data twice from the same initial weights: once with
//! candle-nn's `BatchNorm`, once with fusedbn-candle's (the one-line switch). Prints both
//! loss trajectories and fails if they part by more than a tolerance.
//!
//! ```text
//! cargo run --release -p fusedbn-candle --example candle_train
//! ```
//!
//! `cargo test` runs it too (a test at the bottom, `test = true` in Cargo.toml).

use std::time::Instant;

use candle_core::{DType, Device, Module, ModuleT, Result, Tensor, D};
use candle_nn::{
    conv2d, linear, BatchNormConfig, Conv2d, Conv2dConfig, Linear, Optimizer, VarBuilder, VarMap,
    SGD,
};

const STEPS: usize = 300;
const BATCH: usize = 16;
const CLASSES: usize = 4;

/// conv → BN → ReLU → conv → BN → ReLU → global average pool → linear, generic in the
/// batch-norm layer.
struct Net<B> {
    c1: Conv2d,
    bn1: B,
    c2: Conv2d,
    bn2: B,
    fc: Linear,
}

type MakeBn<B> = fn(usize, BatchNormConfig, VarBuilder) -> Result<B>;

impl<B: ModuleT> Net<B> {
    fn new(vb: VarBuilder, bn: MakeBn<B>) -> Result<Self> {
        let cfg = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        let bcfg = BatchNormConfig::default();
        Ok(Net {
            c1: conv2d(3, 8, 3, cfg, vb.pp("c1"))?,
            bn1: bn(8, bcfg, vb.pp("bn1"))?,
            c2: conv2d(8, 16, 3, cfg, vb.pp("c2"))?,
            bn2: bn(16, bcfg, vb.pp("bn2"))?,
            fc: linear(16, CLASSES, vb.pp("fc"))?,
        })
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let x = self.bn1.forward_t(&self.c1.forward(x)?, train)?.relu()?;
        let x = self.bn2.forward_t(&self.c2.forward(&x)?, train)?.relu()?;
        self.fc.forward(&x.mean(D::Minus1)?.mean(D::Minus1)?)
    }
}

/// Deterministic synthetic data: class k puts a bump of height 1 in channel k % 3, in
/// quadrant k, on top of uniform noise.
fn data(n: usize, seed: u64) -> Result<(Tensor, Tensor)> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f32 / (1u64 << 53) as f32
    };
    let (h, w) = (8, 8);
    let mut x = vec![0f32; n * 3 * h * w];
    let mut y = vec![0u32; n];
    for i in 0..n {
        let k = (next() * CLASSES as f32) as usize % CLASSES;
        y[i] = k as u32;
        for c in 0..3 {
            for r in 0..h {
                for q in 0..w {
                    let bump =
                        c == k % 3 && (r < h / 2) == (k < 2) && (q < w / 2) == k.is_multiple_of(2);
                    x[((i * 3 + c) * h + r) * w + q] =
                        next() * 2.0 - 1.0 + if bump { 1.0 } else { 0.0 };
                }
            }
        }
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(x, (n, 3, h, w), &dev)?,
        Tensor::from_vec(y, n, &dev)?,
    ))
}

/// Trains for `steps` and returns the loss at every step and the held-out accuracy.
fn train<B: ModuleT>(varmap: &VarMap, net: &Net<B>, steps: usize) -> Result<(Vec<f32>, f32)> {
    let mut opt = SGD::new(varmap.all_vars(), 0.1)?;
    let mut losses = Vec::with_capacity(steps);
    for step in 0..steps {
        let (x, y) = data(BATCH, 1000 + step as u64)?;
        let loss = candle_nn::loss::cross_entropy(&net.forward(&x, true)?, &y)?;
        opt.backward_step(&loss)?;
        losses.push(loss.to_scalar::<f32>()?);
    }
    let (x, y) = data(512, 7)?;
    let pred = net.forward(&x, false)?.argmax(D::Minus1)?;
    let acc = pred
        .eq(&y)?
        .to_dtype(DType::F32)?
        .mean_all()?
        .to_scalar::<f32>()?;
    Ok((losses, acc))
}

/// Seeded initial weights for the convolutions and the linear layer: weights uniform in
/// ±√(6/fan_in) (the spread of candle's Kaiming init), biases in ±1/√fan_in. candle's
/// own initializers draw from an unseeded generator, and the two trajectories' worst
/// difference depended on the draw: 15 runs gave 2.8e-7 … 2.6e-4, and one run of the
/// test 2.3e-3, past the tolerance. With fixed weights the test sees one trajectory.
fn seed_weights(vm: &VarMap) -> Result<()> {
    let data = vm.data().lock().unwrap();
    let mut names: Vec<String> = data.keys().cloned().collect();
    names.sort();
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    for name in names {
        let Some(layer) = ["c1.", "c2.", "fc."]
            .into_iter()
            .find(|p| name.starts_with(p))
        else {
            continue;
        };
        let weight = data[&format!("{layer}weight")].as_tensor().clone();
        let fan_in: usize = weight.dims()[1..].iter().product();
        let bound = if name.ends_with("weight") {
            (6.0 / fan_in as f32).sqrt()
        } else {
            1.0 / (fan_in as f32).sqrt()
        };
        let var = &data[&name];
        let values: Vec<f32> = (0..var.as_tensor().elem_count())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0) * bound
            })
            .collect();
        var.set(&Tensor::from_vec(
            values,
            var.as_tensor().shape(),
            &Device::Cpu,
        )?)?;
    }
    Ok(())
}

/// Both runs from the same initial weights: the worst relative difference of the losses.
fn compare(steps: usize, print: bool) -> Result<f32> {
    let dev = Device::Cpu;
    let (vm_a, vm_b) = (VarMap::new(), VarMap::new());
    let theirs = Net::new(
        VarBuilder::from_varmap(&vm_a, DType::F32, &dev),
        candle_nn::batch_norm,
    )?;
    let ours = Net::new(
        VarBuilder::from_varmap(&vm_b, DType::F32, &dev),
        fusedbn_candle::batch_norm,
    )?;
    seed_weights(&vm_a)?;
    // The same names in both: copy candle-nn's initial weights into ours.
    {
        let (a, b) = (vm_a.data().lock().unwrap(), vm_b.data().lock().unwrap());
        assert_eq!(a.len(), b.len());
        for (name, v) in a.iter() {
            b[name].set(v.as_tensor())?;
        }
    }
    let t = Instant::now();
    let (la, acc_a) = train(&vm_a, &theirs, steps)?;
    let ta = t.elapsed();
    let t = Instant::now();
    let (lb, acc_b) = train(&vm_b, &ours, steps)?;
    let tb = t.elapsed();
    let mut worst = 0f32;
    if print {
        println!("step  candle-nn BatchNorm  fusedbn-candle BatchNorm  rel. diff");
    }
    for (i, (a, b)) in la.iter().zip(&lb).enumerate() {
        let d = (a - b).abs() / a.abs().max(1e-6);
        worst = worst.max(d);
        if print && (i % 25 == 0 || i + 1 == steps) {
            println!("{i:4}  {a:19.6}  {b:24.6}  {d:9.2e}");
        }
    }
    if print {
        println!("held-out accuracy: candle-nn {acc_a:.3}, fusedbn-candle {acc_b:.3}");
        println!("training time: candle-nn {ta:.2?}, fusedbn-candle {tb:.2?}");
        println!("worst relative loss difference over {steps} steps: {worst:.2e}");
    }
    Ok(worst)
}

/// How far the trajectories may part: f32 rounding differences between the two
/// formulas grow through 300 SGD steps, but stay far below the loss's own changes.
const TOLERANCE: f32 = 1e-3;

fn main() -> Result<()> {
    let worst = compare(STEPS, true)?;
    if worst > TOLERANCE {
        candle_core::bail!("the loss trajectories differ by {worst:e} > {TOLERANCE:e}");
    }
    Ok(())
}

#[test]
fn loss_trajectories_match_candle_nn() -> Result<()> {
    let worst = compare(STEPS, false)?;
    assert!(worst <= TOLERANCE, "relative difference {worst:e}");
    Ok(())
}
