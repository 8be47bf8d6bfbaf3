//! Replays the committed fuzz regressions of the `npy` and `ops` targets on stable Rust:
//! every file under `fuzz/regressions/npy/` and `fuzz/regressions/ops/` through the same
//! checks the fuzz targets run (`fuzz/harness_lib.rs`). The `cli` target's regressions
//! are replayed by `fusedbn-cli/tests/fuzz_regressions.rs`. See `fuzz/README.md`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "../fuzz/harness_lib.rs"]
mod harness;

/// Far above what any input takes (microseconds), but well under a hang's minutes, even
/// in an unoptimized build on a busy machine.
const LIMIT: Duration = Duration::from_secs(10);

fn inputs(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: no regression inputs", dir.display());
    files
}

/// Runs `check` on every input of `target`; reports every input that panics or is slow.
fn replay(target: &str, check: fn(&[u8])) {
    let mut failures = Vec::new();
    for path in inputs(target) {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let start = Instant::now();
        let result = std::panic::catch_unwind(|| check(&data));
        let took = start.elapsed();
        if result.is_err() {
            failures.push(format!("{}: panicked", path.display()));
        } else if took > LIMIT {
            failures.push(format!("{}: took {took:?}", path.display()));
        }
    }
    assert!(failures.is_empty(), "{target}:\n{}", failures.join("\n"));
}

#[test]
fn npy_regressions() {
    replay("npy", harness::npy);
}

#[test]
fn ops_regressions() {
    replay("ops", harness::ops);
}
