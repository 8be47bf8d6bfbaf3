//! The `fusedbn` binary end to end: every golden fixture through `fusedbn run`, the
//! error contract (status 2, one line, nothing written), `--help`, and `fusedbn bench`.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use fusedbn::f16;
use fusedbn::ops::Op;
use fusedbn::{npy, Tensor};

const BIN: &str = env!("CARGO_BIN_EXE_fusedbn");

fn fusedbn(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("the fusedbn binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The names of the files directly in `dir`.
fn listing(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .expect("out dir is readable")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

#[test]
fn every_fixture_through_the_binary() {
    let cases = common::cases();
    let tmp = tempfile::tempdir().expect("temp dir");
    let mut failures = Vec::new();
    for case in &cases {
        let out = tmp.path().join(&case.name);
        let mut cmd = Command::new(BIN);
        cmd.arg("run").arg(case.op.name());
        for (name, path) in &case.inputs {
            cmd.arg("--input").arg(format!("{name}={}", path.display()));
        }
        for (k, v) in &case.attr_strings {
            cmd.arg("--attr").arg(format!("{k}={v}"));
        }
        cmd.arg("--out").arg(&out);
        let o = cmd.output().expect("the fusedbn binary runs");
        if !o.status.success() {
            failures.push(format!(
                "{}: exit {:?}: {}",
                case.name,
                o.status.code(),
                text(&o.stderr).trim()
            ));
            continue;
        }
        assert!(
            o.stderr.is_empty(),
            "{}: stderr {}",
            case.name,
            text(&o.stderr)
        );
        let want: BTreeSet<String> = case
            .op
            .output_names()
            .iter()
            .map(|n| format!("{n}.npy"))
            .collect();
        let got = listing(&out);
        if got != want {
            failures.push(format!(
                "{}: out dir holds {got:?}, expected {want:?}",
                case.name
            ));
            continue;
        }
        for (name, path) in &case.expected {
            let expected = npy::read(path).expect("fixture output reads");
            let got = match npy::read(out.join(format!("{name}.npy"))) {
                Ok(t) => t,
                Err(e) => {
                    failures.push(format!("{}: {e}", case.name));
                    continue;
                }
            };
            if let Err(e) = common::compare(name, &got, &expected) {
                failures.push(format!("{}: {e}", case.name));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} fixtures failed through the binary:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Files for the error cases: a small valid forward problem plus broken variants.
struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Self {
        let f = Files {
            dir: tempfile::tempdir().expect("temp dir"),
        };
        let x: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
        f.put("x.npy", &Tensor::new(vec![1, 2, 2, 3], x.clone()).unwrap());
        f.put("scale.npy", &Tensor::vector(vec![1.0f32, 2.0, 0.5]));
        f.put("offset.npy", &Tensor::vector(vec![0.0f32, 0.1, -0.1]));
        f.put("scale2.npy", &Tensor::vector(vec![1.0f32, 2.0]));
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        f.put("x_f16.npy", &Tensor::new(vec![1, 2, 2, 3], xh).unwrap());
        std::fs::write(f.path("garbage.npy"), b"this is not an npy file\n").unwrap();
        std::fs::write(
            f.path("int.npy"),
            npy_bytes(
                "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }",
                &[0; 12],
            ),
        )
        .unwrap();
        f
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn put(&self, name: &str, t: &Tensor) {
        npy::write(self.path(name), t).expect("writes test input");
    }

    /// `name=<dir>/file`.
    fn input(&self, name: &str, file: &str) -> String {
        format!("{name}={}", self.path(file).display())
    }
}

/// A version 1.0 `.npy` file with the given header dict and data bytes.
fn npy_bytes(dict: &str, data: &[u8]) -> Vec<u8> {
    let mut header = dict.to_string();
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Runs `fusedbn run <args> --out <fresh dir>` and checks the error contract; returns
/// the message.
fn run_fails(args: &[String]) -> String {
    let tmp = tempfile::tempdir().expect("temp dir");
    let out = tmp.path().join("out");
    let mut cmd = Command::new(BIN);
    cmd.arg("run").args(args).arg("--out").arg(&out);
    let o = cmd.output().expect("the fusedbn binary runs");
    let stderr = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: stderr {stderr}");
    assert_eq!(
        stderr.lines().count(),
        1,
        "{args:?}: not one line: {stderr}"
    );
    assert!(stderr.starts_with("fusedbn: error: "), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(o.stdout.is_empty(), "{args:?}: stdout {}", text(&o.stdout));
    assert!(!out.exists(), "{args:?}: created the --out dir");
    stderr
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A forward inference call with `x` from `x_file` and a valid scale/offset, and
/// `extra` flags.
fn forward(f: &Files, op: &str, x_file: &str, scale_file: &str, extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        op.to_string(),
        "--input".into(),
        f.input("x", x_file),
        "--input".into(),
        f.input("scale", scale_file),
        "--input".into(),
        f.input("offset", "offset.npy"),
    ];
    v.extend(strings(extra));
    v
}

#[test]
fn the_inputs_of_the_error_cases_are_valid() {
    // Sanity: the valid variant of the error cases succeeds, so each failure below is
    // caused by the one thing it changes.
    let f = Files::new();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a/b");
    let mut args = forward(&f, "FusedBatchNormV3", "x.npy", "scale.npy", &[]);
    args.extend(strings(&["--attr", "epsilon=0.001", "--out"]));
    args.push(out.display().to_string());
    let o = Command::new(BIN).arg("run").args(&args).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        listing(&out).len(),
        Op::FusedBatchNormV3.output_names().len()
    );
}

#[test]
fn error_unknown_op() {
    let msg = run_fails(&strings(&["FusedBatchNormV4"]));
    assert!(msg.contains("FusedBatchNormV4"), "{msg}");
}

#[test]
fn error_unknown_input_name() {
    let f = Files::new();
    let msg = run_fails(&forward(
        &f,
        "FusedBatchNorm",
        "x.npy",
        "scale.npy",
        &["--input", &f.input("gamma", "scale.npy")],
    ));
    assert!(msg.contains("gamma"), "{msg}");
}

#[test]
fn error_missing_required_input() {
    // Inference needs mean and variance.
    let f = Files::new();
    let msg = run_fails(&forward(
        &f,
        "FusedBatchNorm",
        "x.npy",
        "scale.npy",
        &["--attr", "is_training=false"],
    ));
    assert!(msg.contains("mean"), "{msg}");
}

#[test]
fn error_bad_attr_values() {
    let f = Files::new();
    for attr in [
        "is_training=maybe",
        "data_format=NCWH",
        "epsilon=abc",
        "epsilon",
        "exponential_avg_factor=",
    ] {
        let msg = run_fails(&forward(
            &f,
            "FusedBatchNormV3",
            "x.npy",
            "scale.npy",
            &["--attr", attr],
        ));
        let key = attr.split('=').next().unwrap();
        assert!(msg.contains(key), "{attr}: {msg}");
    }
}

#[test]
fn error_unknown_attr() {
    let f = Files::new();
    let msg = run_fails(&forward(
        &f,
        "FusedBatchNormV3",
        "x.npy",
        "scale.npy",
        &["--attr", "momentum=0.9"],
    ));
    assert!(msg.contains("momentum"), "{msg}");
}

#[test]
fn error_exponential_avg_factor_on_a_gradient_op() {
    let msg = run_fails(&strings(&[
        "FusedBatchNormGradV3",
        "--attr",
        "exponential_avg_factor=0.5",
    ]));
    assert!(msg.contains("exponential_avg_factor"), "{msg}");
}

#[test]
fn error_duplicates() {
    let f = Files::new();
    let msg = run_fails(&forward(
        &f,
        "FusedBatchNorm",
        "x.npy",
        "scale.npy",
        &["--input", &f.input("x", "x.npy")],
    ));
    assert!(msg.contains("more than once"), "{msg}");
    let msg = run_fails(&forward(
        &f,
        "FusedBatchNorm",
        "x.npy",
        "scale.npy",
        &["--attr", "epsilon=0.1", "--attr", "epsilon=0.1"],
    ));
    assert!(msg.contains("more than once"), "{msg}");
}

#[test]
fn error_unreadable_files() {
    let f = Files::new();
    for (file, words) in [
        ("does_not_exist.npy", "could not read"),
        ("garbage.npy", "not a valid .npy file"),
        ("int.npy", "'<i4'"),
    ] {
        let msg = run_fails(&forward(&f, "FusedBatchNorm", file, "scale.npy", &[]));
        assert!(msg.contains(words) && msg.contains(file), "{file}: {msg}");
    }
}

#[test]
fn error_spec_violations() {
    let f = Files::new();
    // §4 rule 3: scale has 2 elements, x has 3 channels.
    let msg = run_fails(&forward(&f, "FusedBatchNorm", "x.npy", "scale2.npy", &[]));
    assert!(msg.contains("scale"), "{msg}");
    // §4 rule 7: V1 is f32 only.
    let msg = run_fails(&forward(
        &f,
        "FusedBatchNorm",
        "x_f16.npy",
        "scale.npy",
        &[],
    ));
    assert!(msg.contains("f16"), "{msg}");
    // The 4-D op with a 5-D format.
    let msg = run_fails(&forward(
        &f,
        "FusedBatchNormV2",
        "x.npy",
        "scale.npy",
        &["--attr", "data_format=NDHWC"],
    ));
    assert!(msg.contains("data_format"), "{msg}");
}

#[test]
fn an_existing_out_dir_stays_empty_on_error() {
    let f = Files::new();
    let tmp = tempfile::tempdir().unwrap();
    let mut args = forward(&f, "FusedBatchNorm", "x.npy", "scale2.npy", &["--out"]);
    args.push(tmp.path().display().to_string());
    let o = Command::new(BIN).arg("run").args(&args).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(listing(tmp.path()).is_empty());
}

#[test]
fn a_failed_write_removes_what_was_written() {
    // `batch_mean.npy` is a directory, so writing it fails after `y.npy` was written.
    let f = Files::new();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir(tmp.path().join("batch_mean.npy")).unwrap();
    let mut args = forward(&f, "FusedBatchNorm", "x.npy", "scale.npy", &["--out"]);
    args.push(tmp.path().display().to_string());
    let o = Command::new(BIN).arg("run").args(&args).output().unwrap();
    let stderr = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("fusedbn: error: output batch_mean"),
        "{stderr}"
    );
    assert_eq!(
        listing(tmp.path()),
        BTreeSet::from(["batch_mean.npy".to_string()])
    );
}

#[test]
fn usage_errors_do_not_panic() {
    for args in [
        &["run"][..],
        &["run", "FusedBatchNorm"],
        &["bench", "--runs", "0"],
        &["bench", "--min-time", "-1"],
        &["bench", "--raw"],
        &["bench", "--dtype", "f8"],
        &["nope"],
    ] {
        let o = fusedbn(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(!text(&o.stderr).contains("panicked"), "{args:?}");
    }
}

#[test]
fn run_help_lists_every_op_and_input() {
    let o = fusedbn(&["run", "--help"]);
    assert!(o.status.success());
    let help = text(&o.stdout);
    for op in Op::ALL {
        assert!(help.contains(op.name()), "{op} missing from:\n{help}");
        for name in op
            .input_names()
            .iter()
            .chain(op.output_names())
            .chain(op.attr_names())
        {
            assert!(help.contains(name), "{name} missing from:\n{help}");
        }
    }
    assert!(help.contains("'<V2'"), "{help}");
    assert!(help.contains("0.0001"), "{help}");
}

const BENCH_SMALL: [&str; 12] = [
    "bench",
    "--quick",
    "--runs",
    "1",
    "--min-time",
    "0",
    "--shape",
    "2,5,5,3",
    "--format",
    "NHWC",
    "--format",
    "NCHW",
];

/// The names `--isa` accepts.
const ISAS: [&str; 3] = ["scalar", "avx2", "avx512"];

#[test]
fn bench_prints_a_checked_table() {
    let o = fusedbn(&BENCH_SMALL);
    let stdout = text(&o.stdout);
    assert!(o.status.success(), "{stdout}\n{}", text(&o.stderr));
    let rows: Vec<&str> = stdout.lines().filter(|l| l.contains("2x")).collect();
    // All four ops by default, in both formats.
    assert_eq!(rows.len(), 8, "{stdout}");
    for op in [
        "forward_training",
        "forward_inference",
        "backward_training",
        "backward_inference",
    ] {
        assert_eq!(
            rows.iter().filter(|r| r.starts_with(op)).count(),
            2,
            "{stdout}"
        );
    }
    for row in rows {
        assert!(row.ends_with(" ok"), "{row}");
    }
    assert!(
        stdout.contains("2x5x5x3") && stdout.contains("2x3x5x5"),
        "{stdout}"
    );
}

#[test]
fn bench_json_lines() {
    let mut args = BENCH_SMALL.to_vec();
    args.extend([
        "--op",
        "backward_inference",
        "--op",
        "forward_training",
        "--dtype",
        "bf16",
        "--isa",
        "scalar",
        "--json",
    ]);
    let o = fusedbn(&args);
    let stdout = text(&o.stdout);
    assert!(o.status.success(), "{stdout}\n{}", text(&o.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    for line in lines {
        let j: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        for key in [
            "op",
            "format",
            "dtype",
            "shape",
            "threads",
            "isa",
            "median_ms",
            "gbps",
            "copy_ratio",
        ] {
            assert!(j.get(key).is_some(), "{key} missing from {line}");
        }
        assert_eq!(j["dtype"], "bf16");
        assert_eq!(j["isa"], "scalar");
        assert_eq!(j["check"], "ok");
        assert_eq!(j["shape"].as_array().map(Vec::len), Some(4));
    }
}

#[test]
fn bench_ex_and_second_order_ops() {
    let o = fusedbn(&[
        "bench",
        "--quick",
        "--runs",
        "1",
        "--shape",
        "2,5,5,3",
        "--op",
        "forward_training_ex",
        "--op",
        "backward_training_ex",
        "--op",
        "second_order_training",
        "--json",
    ]);
    let stdout = text(&o.stdout);
    assert!(o.status.success(), "{stdout}\n{}", text(&o.stderr));
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    // Three ops in NHWC and NCHW.
    assert_eq!(lines.len(), 3 * 2, "{stdout}");
    for j in &lines {
        for key in [
            "op",
            "format",
            "dtype",
            "shape",
            "threads",
            "isa",
            "pairs",
            "bytes",
            "median_ms",
            "gbps",
            "copy_ms",
            "copy_gbps",
            "copy_ratio",
            "copy_ratio_p25",
            "copy_ratio_p75",
            "ratio_of_medians",
            "check",
        ] {
            assert!(j.get(key).is_some(), "{key} missing from {j}");
        }
        assert_eq!(j["check"], "ok", "{j}");
        // Bytes moved: forward_training_ex reads x and side_input and writes y; the
        // other two read 3 tensors and write 2.
        let tensors = if j["op"] == "forward_training_ex" {
            3
        } else {
            5
        };
        assert_eq!(j["bytes"], tensors * 2 * 5 * 5 * 3 * 4, "{j}");
    }
    for op in [
        "forward_training_ex",
        "backward_training_ex",
        "second_order_training",
    ] {
        assert_eq!(lines.iter().filter(|j| j["op"] == op).count(), 2, "{op}");
    }
    // `--op all`: every op, and the default stays the four plain ones.
    let mut args = BENCH_SMALL.to_vec();
    args.extend(["--op", "all", "--json"]);
    let o = fusedbn(&args);
    let stdout = text(&o.stdout);
    assert!(o.status.success(), "{stdout}\n{}", text(&o.stderr));
    let ops: BTreeSet<String> = stdout
        .lines()
        .map(|l| {
            let j: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            assert_eq!(j["check"], "ok", "{j}");
            j["op"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(ops.len(), 8, "{ops:?}");
    assert!(ops.contains("second_order_inference"), "{ops:?}");
}

/// `--json` lines of a small bench run with these extra arguments (status 0 asserted).
fn bench_json(extra: &[&str]) -> Vec<serde_json::Value> {
    let mut args = BENCH_SMALL.to_vec();
    args.extend(["--op", "forward_training", "--json"]);
    args.extend(extra);
    let o = fusedbn(&args);
    let stdout = text(&o.stdout);
    assert!(
        o.status.success(),
        "{args:?}: {stdout}\n{}",
        text(&o.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[test]
fn bench_isa_scalar_and_the_default() {
    let lines = bench_json(&["--isa", "scalar"]);
    assert_eq!(lines.len(), 2);
    for j in &lines {
        assert_eq!(j["isa"], "scalar");
        assert_eq!(j["check"], "ok");
    }
    // Without --isa: the CPU's best (or FUSEDBN_ISA), named in every line.
    for j in bench_json(&[]) {
        let isa = j["isa"].as_str().expect("isa is a string");
        assert!(ISAS.contains(&isa), "{j}");
    }
    // f64 runs the portable kernels whatever was asked for, and says so.
    for j in bench_json(&["--dtype", "f64"]) {
        assert_eq!(j["isa"], "scalar", "{j}");
    }
}

#[test]
fn bench_every_supported_isa_dtype_and_thread_count() {
    let lines = bench_json(&["--isa", "all", "--dtype", "f16,f32", "--threads", "1,2"]);
    let isas: BTreeSet<String> = lines
        .iter()
        .map(|j| j["isa"].as_str().unwrap().to_string())
        .collect();
    assert!(isas.contains("scalar"), "{isas:?}");
    assert_eq!(lines.len(), 2 * 2 * 2 * isas.len());
    for j in &lines {
        assert_eq!(j["check"], "ok", "{j}");
        let threads = j["threads"].as_u64().unwrap();
        assert!(threads == 1 || threads == 2, "{j}");
        assert!(j["pairs"].as_u64().unwrap() >= 1, "{j}");
        let bytes = j["bytes"].as_u64().unwrap();
        let size = if j["dtype"] == "f16" { 2 } else { 4 };
        assert_eq!(bytes, 2 * 2 * 5 * 5 * 3 * size, "{j}");
    }
}

#[test]
fn bench_rejects_an_unknown_isa_in_one_line() {
    for args in [
        &["bench", "--isa", "sse9"][..],
        &["bench", "--isa", "scalar,sse9", "--json"],
    ] {
        let o = fusedbn(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(o.stdout.is_empty(), "{args:?}: {}", text(&o.stdout));
        let stderr = text(&o.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.starts_with("fusedbn: error: --isa") && stderr.contains("sse9"),
            "{stderr}"
        );
        for name in ISAS {
            assert!(stderr.contains(name), "{stderr}");
        }
    }
}

#[test]
fn bench_rejects_an_isa_this_cpu_lacks() {
    // Nothing to check on a CPU that has every ISA.
    let lacking: Vec<&str> = ISAS
        .into_iter()
        .filter(|&name| {
            let isa: fusedbn::Isa = name.parse().unwrap();
            !isa.is_supported()
        })
        .collect();
    for name in lacking {
        let o = fusedbn(&["bench", "--isa", name]);
        assert_eq!(o.status.code(), Some(2), "{name}");
        let stderr = text(&o.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains("does not support"), "{stderr}");
    }
}

/// `fusedbn run --check` on every golden case: the op's outputs agree with the f64
/// reference under the driver's tolerance, and nothing is written without `--out`.
#[test]
fn check_agrees_with_the_reference_on_every_fixture() {
    let cases = common::cases();
    let mut failures = Vec::new();
    for case in &cases {
        let mut cmd = Command::new(BIN);
        cmd.arg("run").arg(case.op.name()).arg("--check");
        for (name, path) in &case.inputs {
            cmd.arg("--input").arg(format!("{name}={}", path.display()));
        }
        for (k, v) in &case.attr_strings {
            cmd.arg("--attr").arg(format!("{k}={v}"));
        }
        let o = cmd.output().expect("the fusedbn binary runs");
        let stdout = text(&o.stdout);
        if !o.status.success() || !stdout.contains("within tolerance of the f64 reference") {
            failures.push(format!(
                "{}: {}{}",
                case.name,
                stdout.trim(),
                text(&o.stderr).trim()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
