//! fusedbn_burn::BatchNorm against burn::nn::BatchNorm on Flex: training forward,
//! training forward + backward through burn's autodiff, and inference forward.
//!
//! ```sh
//! cargo run --release -p fusedbn-burn --example burn_bench            # 16x64x56x56 f32
//! cargo run --release -p fusedbn-burn --example burn_bench -- 8,32,28,28 bf16
//! ```
//!
//! Forward + backward runs `bn(x).backward()` (burn seeds the gradient with
//! ones) and reads `x`'s gradient. Every row ends by reading its result back, so
//! nothing is left pending. Medians of 9 runs after 2 warm-up runs, the two
//! modules interleaved.

use std::time::{Duration, Instant};

use burn::module::{Module, RunningState};
use burn::tensor::{DType, Device, Tensor, TensorData};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Median time of `f` over 9 runs after 2 warm-ups, interleaved with the other
/// closures of the same row (so machine noise hits all alike).
fn time_rows(fs: &mut [&mut dyn FnMut()]) -> Vec<Duration> {
    let mut times = vec![Vec::new(); fs.len()];
    for round in 0..11 {
        for (i, f) in fs.iter_mut().enumerate() {
            let start = Instant::now();
            f();
            if round >= 2 {
                times[i].push(start.elapsed());
            }
        }
    }
    times.into_iter().map(median).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let shape: Vec<usize> = args
        .first()
        .map(|s| {
            s.split(',')
                .map(|d| d.parse().expect("a shape like 16,64,56,56"))
                .collect()
        })
        .unwrap_or_else(|| vec![16, 64, 56, 56]);
    assert_eq!(shape.len(), 4, "the shape is N,C,H,W");
    let dtype = match args.get(1).map(String::as_str).unwrap_or("f32") {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        other => panic!("dtype is f32, f64, f16 or bf16, not {other}"),
    };
    let shape: [usize; 4] = shape.try_into().unwrap();
    let (n, c) = (shape.iter().product::<usize>(), shape[1]);
    let device = Device::flex().autodiff();
    let plain = Device::flex();
    let data = |seed: u32, device: &Device| {
        let v: Vec<f32> = (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32
                    / (1 << 24) as f32
                    - 0.5
            })
            .collect();
        Tensor::<4>::from_data(TensorData::new(v, shape), (device, dtype))
    };
    let x = data(1, &device);
    let x_plain = data(1, &plain);
    let cast = |bn: burn::nn::BatchNorm| {
        let to = |t: Tensor<1>| t.cast(burn::tensor::FloatDType::from(dtype)).detach();
        let mut bn = bn;
        bn.gamma = bn.gamma.map(|t| to(t).require_grad());
        bn.beta = bn.beta.map(|t| to(t).require_grad());
        bn.running_mean = RunningState::new(to(bn.running_mean.value()));
        bn.running_var = RunningState::new(to(bn.running_var.value()));
        bn
    };
    let theirs = cast(burn::nn::BatchNormConfig::new(c).init(&device));
    let ours = fusedbn_burn::BatchNorm::from(cast(burn::nn::BatchNormConfig::new(c).init(&device)));

    println!(
        "shape {shape:?} {dtype:?}, Flex backend, {} threads",
        std::thread::available_parallelism().map_or(1, |p| p.get())
    );
    println!(
        "{:<44} {:>12} {:>12} {:>8}",
        "", "burn ms", "fusedbn ms", "speedup"
    );
    let row = |name: &str, b: Duration, f: Duration| {
        println!(
            "{name:<44} {:>12.2} {:>12.2} {:>7.1}x",
            ms(b),
            ms(f),
            ms(b) / ms(f)
        );
    };

    let sync = |t: Tensor<4>| {
        let _ = t.into_data();
    };
    let t = time_rows(&mut [&mut || sync(theirs.forward(x.clone())), &mut || {
        sync(ours.forward(x.clone()))
    }]);
    row("training forward (autodiff device)", t[0], t[1]);

    // Backward from y itself (burn seeds it with ones): the batch norm's forward
    // and backward and nothing else.
    let step = |f: &dyn Fn(Tensor<4>) -> Tensor<4>| {
        let x = x.clone().require_grad();
        let grads = f(x.clone()).backward();
        let _ = x.grad(&grads).unwrap().into_data();
    };
    let t = time_rows(&mut [&mut || step(&|x| theirs.forward(x)), &mut || {
        step(&|x| ours.forward(x))
    }]);
    row("training forward + backward (autodiff)", t[0], t[1]);

    let (theirs, ours) = (theirs.valid(), ours.valid());
    let t = time_rows(
        &mut [&mut || sync(theirs.forward(x_plain.clone())), &mut || {
            sync(ours.forward(x_plain.clone()))
        }],
    );
    row("inference forward (plain device)", t[0], t[1]);
}
