//! Shared by the fixture tests of the library and of the binary: loading the golden
//! TensorFlow fixtures under `tests/fixtures/` and comparing outputs with tolerances.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use fusedbn::ops::{Attrs, Op};
use fusedbn::{DType, Tensor};

/// One fixture: an op, its attributes, input files and expected output files.
pub struct Case {
    pub name: String,
    pub op: Op,
    pub attrs: Attrs,
    /// Every attribute as `(name, value)` strings, as the CLI takes them.
    pub attr_strings: Vec<(String, String)>,
    pub inputs: Vec<(String, PathBuf)>,
    pub expected: Vec<(String, PathBuf)>,
}

/// `tests/<name>` at the workspace root (the library crate is the root; the CLI crate
/// is one level below it), or under `FUSEDBN_FIXTURES_ROOT` when set (test binaries run
/// on another machine, such as a lent GPU's, where the build's path does not exist).
pub fn fixtures_dir(name: &str) -> PathBuf {
    if let Some(root) = std::env::var_os("FUSEDBN_FIXTURES_ROOT") {
        return PathBuf::from(root).join("tests").join(name);
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = if here.join("tests/fixtures").is_dir() {
        here.to_path_buf()
    } else {
        here.join("..")
    };
    root.join("tests").join(name)
}

/// Every golden case: `tests/fixtures` (the six base ops) and `tests/fixtures_ex` (the
/// Ex and second-order ops), sorted by name.
pub fn cases() -> Vec<Case> {
    let base = cases_in("fixtures", |_| true);
    assert!(
        base.len() >= 100,
        "expected the committed fixtures, found {}",
        base.len()
    );
    let ex = cases_in("fixtures_ex", |_| true);
    assert!(
        ex.len() >= 90,
        "expected the committed Ex fixtures, found {}",
        ex.len()
    );
    base.into_iter().chain(ex).collect()
}

/// The cases under `tests/<dir>` whose op name passes `keep`, sorted by name.
pub fn cases_in(dir: &str, keep: impl Fn(&str) -> bool) -> Vec<Case> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_dir(dir))
        .unwrap_or_else(|e| panic!("tests/{dir}: {e}"))
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.join("case.json").is_file())
        .filter(|p| {
            let text = std::fs::read_to_string(p.join("case.json")).expect("case.json");
            let j: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
            keep(j["op"].as_str().expect("op"))
        })
        .collect();
    dirs.sort();
    dirs.iter().map(|d| load(d)).collect()
}

fn load(dir: &Path) -> Case {
    let text = std::fs::read_to_string(dir.join("case.json")).expect("case.json");
    let j: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let op: Op = j["op"].as_str().expect("op").parse().expect("known op");
    let mut attrs = Attrs::new();
    let mut attr_strings = Vec::new();
    for (k, v) in j["attrs"].as_object().expect("attrs") {
        let s = match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        attrs.set(k, &s).expect("valid attr");
        attr_strings.push((k.clone(), s));
    }
    let list = |key: &str, sub: &str| -> Vec<(String, PathBuf)> {
        j[key]
            .as_array()
            .expect("list")
            .iter()
            .map(|n| {
                let n = n.as_str().expect("name").to_string();
                let p = dir.join(sub).join(format!("{n}.npy"));
                (n, p)
            })
            .collect()
    };
    Case {
        name: dir.file_name().unwrap().to_string_lossy().into_owned(),
        op,
        attrs,
        attr_strings,
        inputs: list("inputs", "inputs"),
        expected: list("expected", "expected"),
    }
}

/// Unit roundoff of a data type.
pub fn eps(d: DType) -> f64 {
    d.epsilon()
}

/// Checks `got` against TensorFlow's `expected`: same dtype and shape, NaN where
/// TensorFlow has NaN, the same infinity where it has one, and every other element within
/// `rel·max|expected| + 2·eps(T)·|expected|` where `rel` is 1e-4 for f32 data
/// (SPEC §7) — so half outputs may differ from TF's by one rounding of T.
pub fn compare(what: &str, got: &Tensor, expected: &Tensor) -> Result<(), String> {
    if got.dtype() != expected.dtype() {
        return Err(format!(
            "{what}: dtype {} != expected {}",
            got.dtype(),
            expected.dtype()
        ));
    }
    if got.shape() != expected.shape() {
        return Err(format!(
            "{what}: shape {:?} != expected {:?}",
            got.shape(),
            expected.shape()
        ));
    }
    let (g, e) = (got.to_f64_vec(), expected.to_f64_vec());
    let scale = e
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f64, |m, v| m.max(v.abs()));
    let ulp = 2.0 * eps(got.dtype());
    for (i, (a, b)) in g.iter().zip(&e).enumerate() {
        if b.is_nan() {
            if !a.is_nan() {
                return Err(format!("{what}[{i}]: got {a}, expected NaN"));
            }
            continue;
        }
        // An infinity must be the same infinity. Through the tolerance below (infinite
        // where either value is) an opposite infinity, or one against a finite value,
        // passed, and the same infinity failed (its difference is NaN).
        if a.is_infinite() || b.is_infinite() {
            if a != b {
                return Err(format!("{what}[{i}]: got {a}, expected {b}"));
            }
            continue;
        }
        let tol = 1e-4 * scale + ulp * b.abs().max(a.abs());
        let within = (a - b).abs() <= tol; // false for NaN
        if !within {
            return Err(format!(
                "{what}[{i}]: got {a}, expected {b} (tolerance {tol:.3e})"
            ));
        }
    }
    Ok(())
}

/// A small deterministic generator for test data (splitmix64 + Box-Muller).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}
