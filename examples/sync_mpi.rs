//! Data-parallel training with a synchronized batch norm over MPI:
//!
//! ```text
//! x [N, 8] → dense (8 → 16, no bias) → BatchNorm + ReLU (synchronized) → dense (16 → 1) → MSE
//! ```
//!
//! Each step's batch of 64 samples is split **unevenly** across the ranks (rank r gets a
//! share proportional to r + 1). The batch norm normalizes every shard with the
//! statistics of the whole batch; its `gamma`/`beta` gradients come out global; the
//! dense layers' gradients are summed with one all-reduce. Rank 0 prints every rank's
//! loss per step and, at the end, compares the moving statistics (identical bits on
//! every rank) with a single process training the same model on the whole batches.
//!
//! With `--bench`, it instead times synchronized training steps of one batch-norm layer
//! on a `[8, 28, 28, 64]` f32 shard per rank, split into local compute and
//! communication (the time inside the collectives, waiting for slower ranks included).
//!
//! ```sh
//! cargo build --release --features mpi --example sync_mpi
//! mpirun -n 4 target/release/examples/sync_mpi
//! mpirun -n 4 target/release/examples/sync_mpi --bench
//! ```
//!
//! As root, with more ranks than cores, on loopback only (OpenMPI):
//! `OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
//! OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader
//! OMPI_MCA_oob_tcp_if_include=lo`.

use std::error::Error;
use std::time::{Duration, Instant};

use fusedbn::batch_norm::{
    Affine, Epilogue, GradEpilogue, GradInputs, Gradients, SavedStats, Statistics, TrainingStats,
};
use fusedbn::layer::{BatchNorm, Forwarded};
use fusedbn::sync::{mpi, Collective, Mpi, Timed};
use fusedbn::{DataFormat, Problem};

const IN: usize = 8;
const HIDDEN: usize = 16;
const BATCH: usize = 64;
const STEPS: usize = 5;
const LR: f32 = 0.05;

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Step `step`'s whole batch (every rank makes the same): inputs far from zero mean,
/// and a target that depends on them nonlinearly.
fn batch(step: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = Rng(1000 + step as u64);
    let x: Vec<f32> = (0..BATCH * IN)
        .map(|i| 50.0 + (i % IN) as f32 * 3.0 + 4.0 * (rng.uniform() - 0.5))
        .collect();
    let t = x
        .chunks(IN)
        .map(|r| ((r[0] - 50.0) * (r[1] - 53.0)).tanh() + 0.1 * (r[2] - 56.0))
        .collect();
    (x, t)
}

/// The samples of each rank: shares proportional to rank + 1.
fn shards(size: usize) -> Vec<std::ops::Range<usize>> {
    let total: usize = (1..=size).sum();
    let mut start = 0;
    (0..size)
        .map(|r| {
            let end = if r + 1 == size {
                BATCH
            } else {
                start + BATCH * (r + 1) / total
            };
            let range = start..end;
            start = end;
            range
        })
        .collect()
}

/// A step's summed loss and the dense layers' gradients.
type StepResult = (f64, Vec<f32>, Vec<f32>);

/// The model: two dense layers around a batch norm.
#[derive(Clone)]
struct Model {
    w1: Vec<f32>, // [IN, HIDDEN]
    bn: BatchNorm,
    w2: Vec<f32>, // [HIDDEN]
}

impl Model {
    fn new() -> Self {
        let mut rng = Rng(7);
        Model {
            w1: (0..IN * HIDDEN).map(|_| rng.uniform() - 0.5).collect(),
            bn: BatchNorm::new(DataFormat::Nhwc, HIDDEN)
                .with_momentum(0.9)
                .with_relu(true),
            w2: (0..HIDDEN).map(|_| rng.uniform() - 0.5).collect(),
        }
    }

    /// One training step on `x`/`t` (a shard of `global_n` samples), with the batch
    /// norm synchronized over `comm` when given; returns this shard's summed loss and
    /// the dense layers' gradients (to be summed over the ranks).
    fn step(
        &mut self,
        comm: Option<&dyn Collective>,
        x: &[f32],
        t: &[f32],
        global_n: usize,
    ) -> Result<StepResult, Box<dyn Error>> {
        let n = t.len();
        let mut h = vec![0.0f32; n * HIDDEN];
        for i in 0..n {
            for j in 0..HIDDEN {
                h[i * HIDDEN + j] = (0..IN)
                    .map(|k| x[i * IN + k] * self.w1[k * HIDDEN + j])
                    .sum();
            }
        }
        let shape = [n, HIDDEN];
        let z = match comm {
            Some(c) => self.bn.synchronized(c).forward(&h, &shape, true)?,
            None => self.bn.forward(&h, &shape, true)?,
        };
        let pred: Vec<f32> = z
            .chunks(HIDDEN)
            .map(|r| r.iter().zip(&self.w2).map(|(a, b)| a * b).sum())
            .collect();
        let mut loss = 0.0f64;
        let mut dz = vec![0.0f32; n * HIDDEN];
        let mut dw2 = vec![0.0f32; HIDDEN];
        for i in 0..n {
            let e = pred[i] - t[i];
            loss += 0.5 * f64::from(e) * f64::from(e);
            let d = e / global_n as f32;
            for j in 0..HIDDEN {
                dz[i * HIDDEN + j] = d * self.w2[j];
                dw2[j] += d * z[i * HIDDEN + j];
            }
        }
        let fwd = Forwarded { x: &h, y: &z };
        let grads_bn = match comm {
            Some(c) => self.bn.synchronized(c).backward(fwd, &dz)?,
            None => self.bn.backward(fwd, &dz)?,
        };
        // gamma and beta: the gradients are already global.
        self.bn.apply_sgd(&grads_bn, LR)?;
        let mut dw1 = vec![0.0f32; IN * HIDDEN];
        for i in 0..n {
            for k in 0..IN {
                for j in 0..HIDDEN {
                    dw1[k * HIDDEN + j] += x[i * IN + k] * grads_bn.x[i * HIDDEN + j];
                }
            }
        }
        Ok((loss, dw1, dw2))
    }

    fn update(&mut self, dw1: &[f32], dw2: &[f32]) {
        for (w, g) in self.w1.iter_mut().zip(dw1) {
            *w -= LR * 1e-3 * g;
        }
        for (w, g) in self.w2.iter_mut().zip(dw2) {
            *w -= LR * g;
        }
    }
}

fn train(comm: &Timed<Mpi<mpi::topology::SimpleCommunicator>>) -> Result<(), Box<dyn Error>> {
    let (rank, size) = (comm.rank(), comm.size());
    let my = shards(size)[rank].clone();
    let mut model = Model::new();
    let mut single = Model::new(); // rank 0: one process on the whole batch
    if rank == 0 {
        let sizes: Vec<usize> = shards(size).iter().map(|r| r.len()).collect();
        println!("{size} ranks, batch of {BATCH} split {sizes:?}");
    }
    for step in 0..STEPS {
        let (x, t) = batch(step);
        let (loss, dw1, dw2) = model.step(
            Some(comm),
            &x[my.start * IN..my.end * IN],
            &t[my.clone()],
            BATCH,
        )?;
        // The dense layers' gradients: one all-reduce (sum) over the ranks.
        let mut g: Vec<f64> = dw1.iter().chain(&dw2).map(|&v| f64::from(v)).collect();
        comm.all_reduce_sum(&mut g)?;
        let g: Vec<f32> = g.iter().map(|&v| v as f32).collect();
        model.update(&g[..IN * HIDDEN], &g[IN * HIDDEN..]);
        let losses = comm.all_gather(&[loss / my.len().max(1) as f64])?;
        if rank == 0 {
            let (l1, s1, s2) = single.step(None, &x, &t, BATCH)?;
            single.update(&s1, &s2);
            let per_rank: Vec<String> = losses.iter().map(|l| format!("{l:.4}")).collect();
            println!(
                "step {step}: loss per rank [{}], whole batch {:.4} (one process: {:.4})",
                per_rank.join(", "),
                losses
                    .iter()
                    .zip(shards(size))
                    .map(|(l, r)| l * r.len() as f64)
                    .sum::<f64>()
                    / BATCH as f64,
                l1 / BATCH as f64
            );
        }
    }
    // The moving statistics: the same bits on every rank...
    let mine: Vec<f64> = model
        .bn
        .moving_mean()
        .iter()
        .chain(model.bn.moving_variance())
        .map(|&v| f64::from(v))
        .collect();
    let all = comm.all_gather(&mine)?;
    let identical = all.chunks(mine.len()).all(|r| r == &mine[..]);
    if rank == 0 {
        // ...and equal to one process training on the whole batches.
        let rel = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(u, v)| ((u - v) / v.abs().max(1e-6)).abs())
                .fold(0.0f32, f32::max)
        };
        println!(
            "moving statistics identical on all {size} ranks: {identical}; vs one process on the whole batch: \
             mean max rel. diff {:.1e}, variance {:.1e}",
            rel(model.bn.moving_mean(), single.bn.moving_mean()),
            rel(model.bn.moving_variance(), single.bn.moving_variance())
        );
        println!(
            "moving_mean[..4] = {:?}, moving_variance[..4] = {:?}",
            &model.bn.moving_mean()[..4],
            &model.bn.moving_variance()[..4]
        );
    }
    if !identical {
        return Err("moving statistics differ between ranks".into());
    }
    Ok(())
}

/// Times synchronized training steps of one batch norm on a `[8, 28, 28, 64]` shard
/// per rank (f32, NHWC): local compute and communication per step, the median of 30
/// steps, the slowest rank.
fn bench(comm: &Timed<Mpi<mpi::topology::SimpleCommunicator>>) -> Result<(), Box<dyn Error>> {
    let (rank, size) = (comm.rank(), comm.size());
    let p = Problem::new(DataFormat::Nhwc, &[8, 28, 28, 64])?;
    let c = p.channels();
    let mut rng = Rng(rank as u64);
    let x: Vec<f32> = (0..p.len()).map(|_| 10.0 + rng.uniform()).collect();
    let dy: Vec<f32> = (0..p.len()).map(|_| rng.uniform() - 0.5).collect();
    let (scale, offset) = (vec![1.0f32; c], vec![0.0f32; c]);
    let (mut y, mut dx) = (vec![0.0f32; p.len()], vec![0.0f32; p.len()]);
    let (mut mean, mut var, mut ds, mut db) = (
        vec![0.0f32; c],
        vec![0.0f32; c],
        vec![0.0f32; c],
        vec![0.0f32; c],
    );
    let mut rows = Vec::new();
    for i in 0..35 {
        comm.reset();
        let t = Instant::now();
        p.forward_sync(
            comm,
            &x,
            Affine {
                scale: &scale,
                offset: &offset,
            },
            TrainingStats {
                saved: SavedStats {
                    mean: &mut mean,
                    variance: &mut var,
                },
                running: None,
            },
            Epilogue::plain(),
            &mut y,
        )?;
        p.backward_sync(
            comm,
            GradInputs {
                y_backprop: &dy,
                x: &x,
            },
            &scale,
            Statistics {
                mean: &mean,
                variance: &var,
            },
            GradEpilogue::default(),
            Gradients {
                x: &mut dx,
                scale: &mut ds,
                offset: &mut db,
            },
        )?;
        let total = t.elapsed();
        if i >= 5 {
            rows.push((total, comm.elapsed(), comm.calls()));
        }
    }
    let med = |f: &dyn Fn(&(Duration, Duration, u64)) -> f64| {
        let mut v: Vec<f64> = rows.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let total = med(&|r| r.0.as_secs_f64() * 1e3);
    let comm_ms = med(&|r| r.1.as_secs_f64() * 1e3);
    let compute = med(&|r| (r.0 - r.1).as_secs_f64() * 1e3);
    let all = comm.all_gather(&[total, compute, comm_ms])?;
    if rank == 0 {
        let worst = |k: usize| all.chunks(3).map(|r| r[k]).fold(0.0, f64::max);
        println!(
            "| {size} | {:.2} | {:.2} | {:.2} | {} |",
            worst(0),
            worst(1),
            worst(2),
            rows[0].2
        );
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let universe = mpi::initialize().ok_or("MPI was already initialized")?;
    let comm = Timed::new(Mpi::new(universe.world()));
    if std::env::args().any(|a| a == "--bench") {
        bench(&comm)
    } else {
        train(&comm)
    }
}
