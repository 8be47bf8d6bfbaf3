//! `fusedbn run --sync mpi`. Without the `mpi` feature: a one-line error, status 2.
//! With it: `mpirun -n 3` over uneven shards (one empty) of a batch, forward and
//! gradient, against the unsynchronized run on the whole batch; a rank whose shard file
//! is missing makes every rank fail (no hang).

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_fusedbn");

#[cfg(not(feature = "mpi"))]
#[test]
fn sync_mpi_without_the_feature_is_a_clear_error() {
    let o = Command::new(BIN)
        .args(["run", "FusedBatchNormV3", "--sync", "mpi", "--out", "never"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("built without MPI support") && err.contains("--features mpi"),
        "{err}"
    );
    assert!(!std::path::Path::new("never").exists());
    // An unknown backend is a usage error.
    let o = Command::new(BIN)
        .args([
            "run",
            "FusedBatchNormV3",
            "--sync",
            "nccl",
            "--out",
            "never",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
}

#[cfg(feature = "mpi")]
mod with_mpi {
    use super::*;
    use fusedbn::{npy, Tensor};
    use std::path::Path;
    use std::time::{Duration, Instant};

    /// `mpirun -n ranks fusedbn args...` with a time limit; (success, output).
    fn mpirun(ranks: usize, args: &[String]) -> (bool, String) {
        let mut child = Command::new("mpirun")
            .arg("-n")
            .arg(ranks.to_string())
            .arg(BIN)
            .args(args)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
            .env("OMPI_MCA_btl", "self,vader")
            .env("OMPI_MCA_oob_tcp_if_include", "lo")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("mpirun runs (install OpenMPI: scripts/test.sh)");
        let start = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                panic!("mpirun -n {ranks} {args:?} hung");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let o = child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        (o.status.success(), text)
    }

    fn v(x: &[&str]) -> Vec<String> {
        x.iter().map(|s| s.to_string()).collect()
    }

    fn read(p: &Path) -> Vec<f64> {
        npy::read(p).unwrap().to_f64_vec()
    }

    #[test]
    fn three_ranks_match_one_process_on_the_whole_batch() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let (c, hw) = (3usize, 8usize);
        let split = [2usize, 0, 3];
        let n: usize = split.iter().sum();
        let x: Vec<f32> = (0..n * hw * c)
            .map(|i| 100.0 + ((i * 37) % 11) as f32 * 0.5)
            .collect();
        let dy: Vec<f32> = (0..n * hw * c)
            .map(|i| ((i * 13) % 7) as f32 - 3.0)
            .collect();
        let shape = |k: usize| vec![k, 2, 4, c];
        npy::write(d.join("x.npy"), &Tensor::new(shape(n), x.clone()).unwrap()).unwrap();
        npy::write(
            d.join("dy.npy"),
            &Tensor::new(shape(n), dy.clone()).unwrap(),
        )
        .unwrap();
        let mut start = 0;
        for (r, &k) in split.iter().enumerate() {
            let range = start..start + k * hw * c;
            start = range.end;
            for (name, data) in [("x", &x), ("dy", &dy)] {
                let t = Tensor::new(shape(k), data[range.clone()].to_vec()).unwrap();
                npy::write(d.join(format!("{name}{r}.npy")), &t).unwrap();
            }
        }
        npy::write(d.join("scale.npy"), &Tensor::vector(vec![1.0f32, 2.0, 0.5])).unwrap();
        npy::write(
            d.join("offset.npy"),
            &Tensor::vector(vec![0.0f32, 1.0, -1.0]),
        )
        .unwrap();
        let p = |s: &str| d.join(s).display().to_string();
        let fwd = |x: &str, out: &str| {
            v(&[
                "run",
                "FusedBatchNormV3",
                "--input",
                &format!("x={}", p(x)),
                "--input",
                &format!("scale={}", p("scale.npy")),
                "--input",
                &format!("offset={}", p("offset.npy")),
                "--out",
                &p(out),
            ])
        };
        let whole = Command::new(BIN)
            .args(fwd("x.npy", "whole"))
            .output()
            .unwrap();
        assert!(whole.status.success());
        let mut args = fwd("x{rank}.npy", "out{rank}");
        args.extend(v(&["--sync", "mpi"]));
        let (ok, text) = mpirun(3, &args);
        assert!(ok, "{text}");
        let mut start = 0;
        for (r, &k) in split.iter().enumerate() {
            let out = d.join(format!("out{r}"));
            for name in [
                "batch_mean",
                "batch_variance",
                "reserve_space_1",
                "reserve_space_2",
            ] {
                let (a, b) = (
                    read(&d.join("whole").join(format!("{name}.npy"))),
                    read(&out.join(format!("{name}.npy"))),
                );
                for (u, w) in a.iter().zip(&b) {
                    assert!(
                        (u - w).abs() <= 1e-5 * u.abs().max(1.0),
                        "rank {r} {name}: {a:?} vs {b:?}"
                    );
                }
                // Identical on every rank.
                assert_eq!(b, read(&d.join("out0").join(format!("{name}.npy"))));
            }
            let y = read(&out.join("y.npy"));
            let yw = read(&d.join("whole/y.npy"));
            assert_eq!(y.len(), k * hw * c);
            for (i, (u, w)) in yw[start..start + y.len()].iter().zip(&y).enumerate() {
                assert!((u - w).abs() <= 1e-5, "rank {r} y[{i}]: {u} vs {w}");
            }
            start += y.len();
        }
        // The gradient, with the synchronized forward's reserve spaces.
        let grad = |dy: &str, x: &str, rs: &str, out: &str| {
            v(&[
                "run",
                "FusedBatchNormGradV3",
                "--input",
                &format!("y_backprop={}", p(dy)),
                "--input",
                &format!("x={}", p(x)),
                "--input",
                &format!("scale={}", p("scale.npy")),
                "--input",
                &format!("reserve_space_1={}/reserve_space_1.npy", p(rs)),
                "--input",
                &format!("reserve_space_2={}/reserve_space_2.npy", p(rs)),
                "--out",
                &p(out),
            ])
        };
        let whole = Command::new(BIN)
            .args(grad("dy.npy", "x.npy", "whole", "gwhole"))
            .output()
            .unwrap();
        assert!(whole.status.success());
        let mut args = grad("dy{rank}.npy", "x{rank}.npy", "out{rank}", "g{rank}");
        args.extend(v(&["--sync", "mpi"]));
        let (ok, text) = mpirun(3, &args);
        assert!(ok, "{text}");
        for r in 0..3 {
            for name in ["scale_backprop", "offset_backprop"] {
                let a = read(&d.join("gwhole").join(format!("{name}.npy")));
                let b = read(&d.join(format!("g{r}")).join(format!("{name}.npy")));
                for (u, w) in a.iter().zip(&b) {
                    assert!(
                        (u - w).abs() <= 1e-4 * u.abs().max(10.0),
                        "rank {r} {name}: {a:?} vs {b:?}"
                    );
                }
            }
        }
        // A missing shard on one rank: every rank fails, nothing hangs.
        std::fs::remove_file(d.join("x2.npy")).unwrap();
        let mut args = fwd("x{rank}.npy", "bad{rank}");
        args.extend(v(&["--sync", "mpi"]));
        let (ok, text) = mpirun(3, &args);
        assert!(!ok, "{text}");
        assert!(text.contains("rank 2 of 3: input x"), "{text}");
        // Every other rank says why it stopped: each prints its error before a barrier
        // that no rank passes until all have printed (Open MPI kills the remaining
        // ranks as soon as the first exits non-zero).
        for r in 0..2 {
            assert!(
                text.contains(&format!(
                    "rank {r} of 3: synchronized batch norm: rank 2 of 3 rejected its inputs"
                )),
                "{text}"
            );
        }
        assert!(!d.join("bad0").exists() && !d.join("bad2").exists());
    }
}
