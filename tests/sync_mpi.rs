//! The checks of `tests/sync.rs` under `mpirun -n 2`, `-n 3` and `-n 4` (feature
//! `mpi`; OpenMPI on loopback). The launcher test re-runs this test binary under
//! `mpirun` with only the worker test selected; every rank checks the world size it
//! was told to expect (a binary started by another vendor's `mpirun` runs as N
//! separate one-rank worlds and would otherwise pass), runs the checks, and writes a
//! marker file; the launcher checks mpirun's exit status and the N markers, and kills
//! a run that exceeds its time limit.
#![cfg(feature = "mpi")]

#[path = "common/sync_cases.rs"]
mod sync_cases;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fusedbn::sync::mpi::traits::Communicator as _;
use fusedbn::sync::{mpi, Collective, Mpi};

const WORKER: &str = "mpi_worker";
/// Per launch: generous for 4 ranks oversubscribed on 2 cores.
const LIMIT: Duration = Duration::from_secs(300);

/// Runs this test binary's worker under `mpirun -n ranks`; returns its output on
/// failure.
pub fn launch(ranks: usize, test: &str, extra_env: &[(&str, &str)]) -> Result<(), String> {
    let dir =
        std::env::temp_dir().join(format!("fusedbn-mpi-{}-{ranks}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("mpirun");
    cmd.arg("-n")
        .arg(ranks.to_string())
        .arg(&exe)
        .args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FUSEDBN_MPI_RANKS", ranks.to_string())
        .env("FUSEDBN_MPI_MARKERS", &dir)
        // Root in a container, more ranks than cores, loopback only (MPI.md).
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_MCA_btl", "self,vader")
        .env("OMPI_MCA_oob_tcp_if_include", "lo")
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().map_err(|e| {
        format!("could not start mpirun ({e}): install OpenMPI (scripts/test.sh does it)")
    })?;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let markers = (0..ranks).filter(|r| marker(&dir, *r).exists()).count();
    let _ = std::fs::remove_dir_all(&dir);
    match status {
        None => Err(format!("mpirun -n {ranks} exceeded {LIMIT:?}:\n{text}")),
        Some(s) if !s.success() => Err(format!("mpirun -n {ranks} failed ({s}):\n{text}")),
        Some(_) if markers != ranks => Err(format!(
            "mpirun -n {ranks}: {markers} of {ranks} ranks finished:\n{text}"
        )),
        Some(_) => {
            print!("{text}");
            Ok(())
        }
    }
}

fn marker(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.ok"))
}

#[test]
fn under_mpirun_with_2_3_and_4_ranks() {
    for ranks in [2, 3, 4] {
        let t = Instant::now();
        launch(ranks, WORKER, &[]).unwrap_or_else(|e| panic!("{e}"));
        println!("mpirun -n {ranks}: {:.1} s", t.elapsed().as_secs_f64());
    }
}

/// One rank of a launch (ignored: only run by `launch`, under mpirun).
#[test]
#[ignore = "run under mpirun by under_mpirun_with_2_3_and_4_ranks"]
fn mpi_worker() {
    let expected: usize = std::env::var("FUSEDBN_MPI_RANKS")
        .expect("FUSEDBN_MPI_RANKS: run by the launcher test")
        .parse()
        .unwrap();
    let dir = PathBuf::from(std::env::var("FUSEDBN_MPI_MARKERS").unwrap());
    let universe = mpi::initialize().expect("MPI initialized twice");
    let comm = Mpi::new(universe.world());
    assert_eq!(
        comm.size(),
        expected,
        "world size {} instead of {expected}: is mpirun from the MPI this binary links?",
        comm.size()
    );
    match sync_cases::all(&comm) {
        Ok(summary) => println!("{summary}"),
        Err(e) => {
            eprintln!("{e}");
            // Abort every rank now (the others may wait in a collective).
            universe.world().abort(1);
        }
    }
    std::fs::write(marker(&dir, comm.rank()), b"ok").unwrap();
}
