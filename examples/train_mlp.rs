//! Trains a small classifier with the Keras-style batch-norm layer in the loop:
//!
//! ```text
//! x [N, 2] → dense (2 → 64, no bias) → BatchNorm + ReLU → dense (64 → 3) → softmax
//! ```
//!
//! on three interleaved spirals (synthetic, deterministic), with plain SGD. The inputs
//! are deliberately far from zero mean and unit scale (centred at (20, −8), spread ×6),
//! which batch normalization takes care of.
//!
//! Every 100 steps it prints the training loss and how far the layer's moving
//! statistics are from the true statistics of its input over the whole training set
//! (exact for a linear layer: mean `μₓ·W`, variance `wᵀΣₓw` per hidden unit). At the
//! end it evaluates on held-out data in inference mode (moving statistics), saves the
//! layer's weights as safetensors, and checks that a reloaded layer predicts the same.
//!
//! ```sh
//! cargo run --release --example train_mlp
//! ```

use std::error::Error;
use std::f64::consts::PI;

use fusedbn::layer::{BatchNorm, Forwarded};
use fusedbn::DataFormat;

const IN: usize = 2;
const HIDDEN: usize = 64;
const CLASSES: usize = 3;
const BATCH: usize = 64;
const STEPS: usize = 2000;
const REPORT_EVERY: usize = 100;
/// The learning rate decays along a cosine from this to 1% of it.
const LEARNING_RATE: f32 = 0.2;

/// SplitMix64: a tiny deterministic generator.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * PI * self.uniform()).cos()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize
    }
}

/// `n` points per class on three spirals, shifted and scaled: rows `[x0, x1]`, labels.
fn spirals(rng: &mut Rng, n: usize) -> (Vec<f32>, Vec<usize>) {
    let (mut x, mut labels) = (Vec::new(), Vec::new());
    for k in 0..CLASSES {
        for _ in 0..n {
            let t = rng.uniform();
            let angle = k as f64 * 2.0 * PI / CLASSES as f64 + 4.0 * t + 0.2 * rng.normal();
            x.push((20.0 + 6.0 * t * angle.sin()) as f32);
            x.push((-8.0 + 6.0 * t * angle.cos()) as f32);
            labels.push(k);
        }
    }
    (x, labels)
}

/// `a [n, k] · b [k, m]`.
fn matmul(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0.0; n * m];
    for i in 0..n {
        for p in 0..k {
            let a_ip = a[i * k + p];
            for j in 0..m {
                out[i * m + j] += a_ip * b[p * m + j];
            }
        }
    }
    out
}

/// `aᵀ [k, n] · b [n, m]` for `a [n, k]`.
fn matmul_tn(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0.0; k * m];
    for i in 0..n {
        for p in 0..k {
            let a_ip = a[i * k + p];
            for j in 0..m {
                out[p * m + j] += a_ip * b[i * m + j];
            }
        }
    }
    out
}

/// `a [n, m] · bᵀ` for `b [k, m]`: `[n, k]`.
fn matmul_nt(a: &[f32], b: &[f32], n: usize, m: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0; n * k];
    for i in 0..n {
        for p in 0..k {
            out[i * k + p] = (0..m).map(|j| a[i * m + j] * b[p * m + j]).sum();
        }
    }
    out
}

struct Mlp {
    w1: Vec<f32>, // [IN, HIDDEN]
    bn: BatchNorm,
    w2: Vec<f32>, // [HIDDEN, CLASSES]
    b2: Vec<f32>,
}

impl Mlp {
    fn new(rng: &mut Rng) -> Self {
        let mut init = |fan_in: usize, len: usize| -> Vec<f32> {
            let s = (2.0 / fan_in as f64).sqrt();
            (0..len).map(|_| (s * rng.normal()) as f32).collect()
        };
        Mlp {
            w1: init(IN, IN * HIDDEN),
            // A batch of feature vectors [N, HIDDEN] in NHWC is [N, 1, 1, HIDDEN].
            bn: BatchNorm::new(DataFormat::Nhwc, HIDDEN).with_relu(true),
            w2: init(HIDDEN, HIDDEN * CLASSES),
            b2: vec![0.0; CLASSES],
        }
    }

    fn logits(&self, a: &[f32], n: usize) -> Vec<f32> {
        let mut z = matmul(a, &self.w2, n, HIDDEN, CLASSES);
        for row in z.chunks_exact_mut(CLASSES) {
            row.iter_mut().zip(&self.b2).for_each(|(v, b)| *v += b);
        }
        z
    }

    /// Inference with the moving statistics: the logits.
    fn predict(&self, bn: &BatchNorm, x: &[f32], n: usize) -> Result<Vec<f32>, Box<dyn Error>> {
        let h = matmul(x, &self.w1, n, IN, HIDDEN);
        let a = bn.predict(&h, &[n, HIDDEN])?;
        Ok(self.logits(&a, n))
    }

    /// One SGD step on a batch; returns the batch loss and accuracy.
    fn train_step(
        &mut self,
        x: &[f32],
        labels: &[usize],
        lr: f32,
    ) -> Result<(f64, f64), Box<dyn Error>> {
        let n = labels.len();
        let h = matmul(x, &self.w1, n, IN, HIDDEN);
        let a = self.bn.forward(&h, &[n, HIDDEN], true)?;
        let z = self.logits(&a, n);
        let (loss, correct, dz) = softmax_cross_entropy(&z, labels);
        let dw2 = matmul_tn(&a, &dz, n, HIDDEN, CLASSES);
        let db2: Vec<f32> = (0..CLASSES)
            .map(|j| dz.iter().skip(j).step_by(CLASSES).sum())
            .collect();
        let da = matmul_nt(&dz, &self.w2, n, CLASSES, HIDDEN);
        let g = self.bn.backward(Forwarded { x: &h, y: &a }, &da)?;
        let dw1 = matmul_tn(x, &g.x, n, IN, HIDDEN);
        self.bn.apply_sgd(&g, lr)?;
        for (w, d) in [
            (&mut self.w1, &dw1),
            (&mut self.w2, &dw2),
            (&mut self.b2, &db2),
        ] {
            w.iter_mut().zip(d).for_each(|(w, d)| *w -= lr * d);
        }
        Ok((loss, correct as f64 / n as f64))
    }
}

/// Mean cross-entropy, the number of correct predictions, and d(loss)/d(logits).
fn softmax_cross_entropy(z: &[f32], labels: &[usize]) -> (f64, usize, Vec<f32>) {
    let n = labels.len();
    let (mut loss, mut correct, mut dz) = (0.0, 0, vec![0.0; z.len()]);
    for (i, &label) in labels.iter().enumerate() {
        let row = &z[i * CLASSES..(i + 1) * CLASSES];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let exp: Vec<f64> = row.iter().map(|&v| f64::from(v - max).exp()).collect();
        let sum: f64 = exp.iter().sum();
        loss -= (exp[label] / sum).ln();
        let best = (0..CLASSES).fold(0, |b, j| if row[j] > row[b] { j } else { b });
        correct += usize::from(best == label);
        for j in 0..CLASSES {
            let p = exp[j] / sum - if j == label { 1.0 } else { 0.0 };
            dz[i * CLASSES + j] = (p / n as f64) as f32;
        }
    }
    (loss / n as f64, correct, dz)
}

/// The mean and (population) covariance of the rows of `x [n, 2]`.
fn moments(x: &[f32]) -> ([f64; 2], [[f64; 2]; 2]) {
    let n = (x.len() / IN) as f64;
    let mut mu = [0.0; 2];
    for r in x.chunks_exact(IN) {
        mu[0] += f64::from(r[0]) / n;
        mu[1] += f64::from(r[1]) / n;
    }
    let mut cov = [[0.0; 2]; 2];
    for r in x.chunks_exact(IN) {
        let d = [f64::from(r[0]) - mu[0], f64::from(r[1]) - mu[1]];
        for i in 0..2 {
            for j in 0..2 {
                cov[i][j] += d[i] * d[j] / n;
            }
        }
    }
    (mu, cov)
}

/// How far the moving statistics are from the true statistics of the hidden
/// pre-activations `x·W1` over the training set: the largest |moving_mean − μ| / σ and
/// the largest |moving_variance / σ² − 1| over the hidden units.
fn stats_gap(mlp: &Mlp, mu: &[f64; 2], cov: &[[f64; 2]; 2]) -> (f64, f64) {
    let (mut mean_gap, mut var_gap) = (0f64, 0f64);
    for j in 0..HIDDEN {
        let w = [f64::from(mlp.w1[j]), f64::from(mlp.w1[HIDDEN + j])];
        let mean = mu[0] * w[0] + mu[1] * w[1];
        let var = (0..2)
            .map(|a| (0..2).map(|b| w[a] * cov[a][b] * w[b]).sum::<f64>())
            .sum::<f64>();
        let (mm, mv) = (
            f64::from(mlp.bn.moving_mean()[j]),
            f64::from(mlp.bn.moving_variance()[j]),
        );
        mean_gap = mean_gap.max((mm - mean).abs() / var.sqrt());
        var_gap = var_gap.max((mv / var - 1.0).abs());
    }
    (mean_gap, var_gap)
}

fn main() -> Result<(), Box<dyn Error>> {
    let start = std::time::Instant::now();
    let mut rng = Rng(2024);
    let (train_x, train_y) = spirals(&mut rng, 700);
    let (test_x, test_y) = spirals(&mut rng, 300);
    let (mu, cov) = moments(&train_x);
    let mut mlp = Mlp::new(&mut rng);
    println!(
        "3-class spirals: {} training and {} test points, inputs centred at ({:.1}, {:.1})",
        train_y.len(),
        test_y.len(),
        mu[0],
        mu[1]
    );
    println!(
        "MLP 2 → 64 → BatchNorm+ReLU (momentum 0.99) → 3; SGD, batch {BATCH}, lr {LEARNING_RATE} cosine-decayed"
    );
    println!("train: mean over the last {REPORT_EVERY} steps (batch statistics); test: inference with the moving statistics");
    println!("gaps: moving statistics vs the true mean μ and variance σ² of the layer's input over the training set,");
    println!("      largest over the 64 channels\n");
    println!(
        "{:>5}  {:>10}  {:>9}  {:>9}  {:>9}  {:>14}  {:>14}",
        "step", "train loss", "train acc", "test loss", "test acc", "|mm − μ|/σ", "|mv/σ² − 1|"
    );
    let (mut loss_sum, mut acc_sum, mut count) = (0.0, 0.0, 0);
    let (mut bx, mut by) = (vec![0.0f32; BATCH * IN], vec![0usize; BATCH]);
    for step in 0..=STEPS {
        if step % REPORT_EVERY == 0 {
            let (mean_gap, var_gap) = stats_gap(&mlp, &mu, &cov);
            let z = mlp.predict(&mlp.bn, &test_x, test_y.len())?;
            let (test_loss, test_correct, _) = softmax_cross_entropy(&z, &test_y);
            let test_acc = 100.0 * test_correct as f64 / test_y.len() as f64;
            let (train_loss, train_acc) = if count == 0 {
                ("—".to_string(), "—".to_string())
            } else {
                (
                    format!("{:.4}", loss_sum / count as f64),
                    format!("{:.1}%", 100.0 * acc_sum / count as f64),
                )
            };
            println!(
                "{step:>5}  {train_loss:>10}  {train_acc:>9}  {test_loss:>9.4}  {test_acc:>8.1}%  {mean_gap:>14.4}  {var_gap:>14.4}"
            );
            (loss_sum, acc_sum, count) = (0.0, 0.0, 0);
        }
        if step == STEPS {
            break;
        }
        for i in 0..BATCH {
            let k = rng.below(train_y.len());
            bx[i * IN..(i + 1) * IN].copy_from_slice(&train_x[k * IN..(k + 1) * IN]);
            by[i] = train_y[k];
        }
        let progress = step as f64 / STEPS as f64;
        let lr = LEARNING_RATE * (0.01 + 0.99 * 0.5 * (1.0 + (PI * progress).cos())) as f32;
        let (loss, acc) = mlp.train_step(&bx, &by, lr)?;
        (loss_sum, acc_sum, count) = (loss_sum + loss, acc_sum + acc, count + 1);
    }

    // Final evaluation in inference mode: the moving statistics, not the batch's.
    println!();
    let mut z = Vec::new();
    for (name, x, y) in [("train", &train_x, &train_y), ("test", &test_x, &test_y)] {
        z = mlp.predict(&mlp.bn, x, y.len())?;
        let (loss, correct, _) = softmax_cross_entropy(&z, y);
        println!(
            "{name:>5} (inference, moving statistics): loss {loss:.4}, accuracy {:.1}% ({correct}/{})",
            100.0 * correct as f64 / y.len() as f64,
            y.len()
        );
    }

    // Save the layer's weights under Keras' names and check a reloaded layer.
    let path = std::env::temp_dir().join(format!("train_mlp-{}.safetensors", std::process::id()));
    mlp.bn.save(&path)?;
    let mut reloaded = BatchNorm::new(DataFormat::Nhwc, HIDDEN).with_relu(true);
    let loaded = reloaded.load(&path);
    std::fs::remove_file(&path)?;
    loaded?;
    let same = mlp.predict(&reloaded, &test_x, test_y.len())? == z;
    println!(
        "saved gamma, beta, moving_mean, moving_variance ({} bytes of safetensors); reloaded layer predicts identically: {same}",
        mlp.bn.to_safetensors()?.len()
    );
    println!("total time {:.2} s", start.elapsed().as_secs_f64());
    if !same {
        return Err("the reloaded layer predicts differently".into());
    }
    Ok(())
}
