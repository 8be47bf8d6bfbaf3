//! Replays the committed fuzz regressions of the `cli` target on stable Rust: every file
//! under `fuzz/regressions/cli/` through the same checks the fuzz target runs
//! (`fuzz/harness_cli.rs`: argument parsing and `validate_run`, no file touched). See
//! `fuzz/README.md`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "../../fuzz/harness_cli.rs"]
mod harness;

/// Far above what any input takes, but well under a hang's minutes, even in an
/// unoptimized build on a busy machine.
const LIMIT: Duration = Duration::from_secs(10);

fn inputs() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions/cli");
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

#[test]
fn cli_regressions() {
    let mut failures = Vec::new();
    for path in inputs() {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let start = Instant::now();
        let result = std::panic::catch_unwind(|| harness::cli(&data));
        let took = start.elapsed();
        if result.is_err() {
            failures.push(format!("{}: panicked", path.display()));
        } else if took > LIMIT {
            failures.push(format!("{}: took {took:?}", path.display()));
        }
    }
    assert!(failures.is_empty(), "cli:\n{}", failures.join("\n"));
}
