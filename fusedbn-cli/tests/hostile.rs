//! `fusedbn run` against hostile input and faults (issue 8): bad and lying `.npy`
//! files, every validation rule, usage errors, an output directory in the way, read-only
//! or full, and concurrent writers. Every failing case must exit with status 2, print
//! exactly one line `fusedbn: error: ...` on stderr and leave the output directory
//! exactly as it was (no file appeared, changed or vanished).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use fusedbn::{npy, Tensor};

/// The binary under test: this build's, or `FUSEDBN_BIN` (to run the suite against
/// another build, e.g. an older one to see which cases it fails).
fn bin() -> String {
    std::env::var("FUSEDBN_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_fusedbn").to_string())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Every entry under `dir` (recursively): its relative path and its contents (`None`
/// for a directory). A missing `dir` is an empty snapshot.
fn snapshot(dir: &Path) -> Snapshot {
    fn walk(root: &Path, dir: &Path, out: &mut Snapshot) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap_or(&p).to_path_buf();
            if p.is_dir() {
                out.insert(rel, None);
                walk(root, &p, out);
            } else {
                out.insert(rel, Some(std::fs::read(&p).unwrap_or_default()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Fails unless the directory's snapshot is `before`, listing both as names, sizes and
/// checksums (not bytes).
fn assert_unchanged(what: &str, before: &Snapshot, after: &Snapshot) {
    if before != after {
        let summary = |s: &Snapshot| -> Vec<String> {
            s.iter()
                .map(|(p, c)| match c {
                    None => format!("{}/", p.display()),
                    Some(b) => {
                        let h = b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
                            (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
                        });
                        format!("{} ({} bytes, {h:016x})", p.display(), b.len())
                    }
                })
                .collect()
        };
        panic!(
            "{what}: the out dir changed\nbefore: {:?}\nafter:  {:?}",
            summary(before),
            summary(after)
        );
    }
}

type Snapshot = BTreeMap<PathBuf, Option<Vec<u8>>>;

/// Checks the error contract of a finished run; returns the message.
fn assert_one_line_error(what: &str, o: &Output) -> String {
    let stderr = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{what}: stderr {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{what}: not one line: {stderr}");
    assert!(stderr.starts_with("fusedbn: error: "), "{what}: {stderr}");
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    assert!(o.stdout.is_empty(), "{what}: stdout {}", text(&o.stdout));
    stderr
}

/// A small valid FusedBatchNormV3 training problem in `dir`, NHWC `[1, 2, 2, 3]`;
/// `shift` changes x so that two runs give different outputs.
fn put_inputs(dir: &Path, shift: f32) {
    let x: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0 + shift).collect();
    npy::write(
        dir.join("x.npy"),
        &Tensor::new(vec![1, 2, 2, 3], x).unwrap(),
    )
    .unwrap();
    npy::write(
        dir.join("scale.npy"),
        &Tensor::vector(vec![1.0f32, 2.0, 0.5]),
    )
    .unwrap();
    npy::write(
        dir.join("offset.npy"),
        &Tensor::vector(vec![0.0f32, 0.1, -0.1]),
    )
    .unwrap();
}

fn forward_args(inputs: &Path, out: &Path) -> Vec<String> {
    let mut v = vec!["run".to_string(), "FusedBatchNormV3".into()];
    for n in ["x", "scale", "offset"] {
        v.push("--input".into());
        v.push(format!("{n}={}", inputs.join(format!("{n}.npy")).display()));
    }
    v.push("--out".into());
    v.push(out.display().to_string());
    v
}

fn run(args: &[String]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("the fusedbn binary runs")
}

/// A version 1.0 `.npy` file with the given header text and data.
fn npy_bytes(dict: &[u8], data: &[u8]) -> Vec<u8> {
    let mut header = dict.to_vec();
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(b' ');
    }
    header.push(b'\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(data);
    out
}

/// Bad `x.npy` files: each must be refused with one line, the out directory untouched.
#[test]
fn bad_and_lying_npy_files() {
    let tmp = tempfile::tempdir().unwrap();
    put_inputs(tmp.path(), 0.0);
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("y.npy"), b"earlier results").unwrap();
    let before = snapshot(&out);
    let f4 = |shape: &str| {
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}").into_bytes()
    };
    let mut cases: Vec<(String, Vec<u8>)> = vec![
        ("empty file".into(), vec![]),
        ("text".into(), b"not an npy file".to_vec()),
        ("magic only".into(), b"\x93NUMPY".to_vec()),
        ("version 9".into(), b"\x93NUMPY\x09\x00\x10\x00".to_vec()),
        (
            "int32".into(),
            npy_bytes(
                b"{'descr': '<i4', 'fortran_order': False, 'shape': (1, 1, 1, 3), }",
                &[0; 12],
            ),
        ),
        (
            "structured".into(),
            npy_bytes(
                b"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1, 1, 1, 3), }",
                &[0; 12],
            ),
        ),
        (
            "short data".into(),
            npy_bytes(&f4("(1, 2, 2, 3)"), &[0; 40]),
        ),
        (
            "trailing data".into(),
            npy_bytes(&f4("(1, 2, 2, 3)"), &[0; 52]),
        ),
        (
            "claims 2^40 elements".into(),
            npy_bytes(&f4("(1, 1024, 1024, 1048576)"), &[0; 48]),
        ),
        (
            "overflowing shape".into(),
            npy_bytes(&f4("(4294967296, 4294967296, 4294967296, 3)"), &[0; 48]),
        ),
        (
            "huge empty shape".into(),
            npy_bytes(&f4("(0, 8589934592, 8589934592, 3)"), &[]),
        ),
        (
            "negative dim".into(),
            npy_bytes(&f4("(1, -2, 2, 3)"), &[0; 48]),
        ),
        (
            "float dim".into(),
            npy_bytes(&f4("(1, 2.0, 2, 3)"), &[0; 48]),
        ),
        ("rank 3".into(), npy_bytes(&f4("(2, 2, 3)"), &[0; 48])),
        (
            "header length past the end".into(),
            b"\x93NUMPY\x01\x00\xff\xff{'descr'".to_vec(),
        ),
        ("header over the limit".into(), {
            let mut v = b"\x93NUMPY\x02\x00".to_vec();
            v.extend_from_slice(&(64u32 << 20).to_le_bytes());
            v
        }),
        (
            "non-UTF-8 header".into(),
            npy_bytes(
                b"{'descr': '<f4\xff', 'fortran_order': False, 'shape': (1,), }",
                &[0; 4],
            ),
        ),
        (
            "NUL in header".into(),
            npy_bytes(
                b"{'descr': '<f4', \0'fortran_order': False, 'shape': (1,), }",
                &[0; 4],
            ),
        ),
    ];
    // The hang: unclosed nesting, up to well past the depth that took minutes.
    for open in ["{", "[", "("] {
        for depth in [14, 40, 3000] {
            let dict = format!(
                "{{'descr': {}'<f4', 'fortran_order': False, 'shape': (1,), }}",
                open.repeat(depth)
            );
            cases.push((
                format!("{depth} unclosed {open}"),
                npy_bytes(dict.as_bytes(), &[0; 4]),
            ));
        }
    }
    for (what, bytes) in &cases {
        std::fs::write(tmp.path().join("x.npy"), bytes).unwrap();
        let msg = assert_one_line_error(what, &run(&forward_args(tmp.path(), &out)));
        assert!(
            msg.contains("input x") || msg.contains("shape"),
            "{what}: {msg}"
        );
        assert_unchanged(what, &before, &snapshot(&out));
    }
    // Inputs that are not regular files: a device, a directory, a missing path.
    for (what, path) in [
        ("/dev/zero", PathBuf::from("/dev/zero")),
        ("a directory", tmp.path().to_path_buf()),
        ("missing", tmp.path().join("missing.npy")),
    ] {
        if !path.exists() && what != "missing" {
            continue;
        }
        let mut args = forward_args(tmp.path(), &out);
        args[3] = format!("x={}", path.display());
        let msg = assert_one_line_error(what, &run(&args));
        assert!(msg.contains("input x"), "{what}: {msg}");
        assert_unchanged(what, &before, &snapshot(&out));
    }
}

/// Every validation rule of the op layer through the tool: status 2, one line, nothing
/// written.
#[test]
fn every_validation_rule_is_one_line_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    put_inputs(tmp.path(), 0.0);
    let p = |n: &str| tmp.path().join(n);
    npy::write(p("scale2.npy"), &Tensor::vector(vec![1.0f32, 2.0])).unwrap();
    npy::write(
        p("scale_f16.npy"),
        &Tensor::vector(vec![fusedbn::f16::ONE; 3]),
    )
    .unwrap();
    npy::write(
        p("matrix.npy"),
        &Tensor::new(vec![1, 3], vec![1.0f32; 3]).unwrap(),
    )
    .unwrap();
    let out = p("out");
    let base = forward_args(tmp.path(), &out);
    let with = |extra: &[&str]| {
        let mut v = base.clone();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let replace = |i: usize, value: String| {
        let mut v = base.clone();
        v[i] = value;
        v
    };
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("unknown op", replace(1, "FusedBatchNormV9".into())),
        (
            "scale of the wrong length",
            replace(5, format!("scale={}", p("scale2.npy").display())),
        ),
        (
            "scale of the wrong dtype",
            replace(5, format!("scale={}", p("scale_f16.npy").display())),
        ),
        (
            "scale of rank 2",
            replace(5, format!("scale={}", p("matrix.npy").display())),
        ),
        ("unknown input", with(&["--input", "bogus=x.npy"])),
        (
            "input twice",
            with(&["--input", &format!("x={}", p("x.npy").display())]),
        ),
        ("input without =", with(&["--input", "x"])),
        ("unknown attribute", with(&["--attr", "momentum=0.9"])),
        (
            "attribute twice",
            with(&["--attr", "epsilon=0.1", "--attr", "epsilon=0.2"]),
        ),
        ("bad epsilon", with(&["--attr", "epsilon=abc"])),
        // (Any f32 epsilon is TensorFlow's to accept, NaN and negative ones included.)
        (
            "epsilon out of f32 syntax",
            with(&["--attr", "epsilon=1e-4x"]),
        ),
        ("bad data_format", with(&["--attr", "data_format=HWCN"])),
        (
            "5-D format for 4-D x",
            with(&["--attr", "data_format=NDHWC"]),
        ),
        ("bad is_training", with(&["--attr", "is_training=maybe"])),
        (
            "factor out of range",
            with(&["--attr", "exponential_avg_factor=2"]),
        ),
        (
            "missing mean in inference",
            with(&["--attr", "is_training=false"]),
        ),
        ("unknown flag", with(&["--frobnicate"])),
        ("missing --out", base[..base.len() - 2].to_vec()),
    ];
    for (what, args) in cases {
        assert_one_line_error(what, &run(&args));
        assert!(!out.exists(), "{what}: created the out dir");
    }
    // Usage errors outside `run` are one line too.
    for args in [
        &[][..],
        &["nope"],
        &["bench", "--shape", "1,2"],
        &["bench", "--op", "nope"],
    ] {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        assert_one_line_error(&format!("{args:?}"), &run(&args));
    }
}

/// Issue 8, item 2: an output that cannot be written (a directory in the way) used to
/// overwrite `y.npy` and then delete it. Now the earlier results survive untouched.
#[test]
fn a_failed_run_leaves_earlier_results_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    put_inputs(tmp.path(), 0.0);
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    // Earlier results: a valid set from another x.
    let earlier = tmp.path().join("earlier");
    std::fs::create_dir(&earlier).unwrap();
    put_inputs(&earlier, 3.0);
    let o = run(&forward_args(&earlier, &out));
    assert!(o.status.success(), "{}", text(&o.stderr));
    // Every output in turn is blocked by a directory in its place.
    for blocked in [
        "y",
        "batch_mean",
        "batch_variance",
        "reserve_space_1",
        "reserve_space_3",
    ] {
        let target = out.join(format!("{blocked}.npy"));
        let saved = std::fs::read(&target).unwrap();
        std::fs::remove_file(&target).unwrap();
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("inside"), b"keep").unwrap();
        let before = snapshot(&out);
        let msg = assert_one_line_error(blocked, &run(&forward_args(tmp.path(), &out)));
        assert!(msg.contains(&format!("output {blocked}")), "{msg}");
        assert_unchanged(blocked, &before, &snapshot(&out));
        std::fs::remove_dir_all(&target).unwrap();
        std::fs::write(&target, saved).unwrap();
    }
    // A new nested --out that fails leaves no directory behind.
    let nested = tmp.path().join("a/b/c");
    std::fs::create_dir_all(&nested).unwrap();
    std::fs::create_dir(nested.join("y.npy")).unwrap();
    let o = run(&forward_args(tmp.path(), &nested));
    assert_one_line_error("nested", &o);
    assert!(nested.join("y.npy").is_dir());
}

/// Mounts a tmpfs of `size` at `dir`, or says why not (the test then skips): needs root
/// and a kernel that lets this sandbox mount.
fn mount_tmpfs(dir: &Path, opts: &str) -> bool {
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
        .arg(dir)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: cannot mount a tmpfs here (needs root and mount permission)");
    }
    ok
}

fn umount(dir: &Path) {
    let _ = Command::new("umount").arg(dir).status();
}

/// A full disk: the earlier, valid outputs stay valid and complete (before the fix a
/// previous run's `y.npy` was left truncated), and no temporary file is left behind.
#[test]
fn a_full_disk_leaves_earlier_results_valid() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    if !mount_tmpfs(&out, "size=64k") {
        return;
    }
    let result = std::panic::catch_unwind(|| {
        // Earlier results that fit, then a run whose outputs do not.
        let small = tmp.path().join("small");
        std::fs::create_dir(&small).unwrap();
        put_inputs(&small, 1.0);
        let o = run(&forward_args(&small, &out));
        assert!(o.status.success(), "{}", text(&o.stderr));
        let before = snapshot(&out);
        let big = tmp.path().join("big");
        std::fs::create_dir(&big).unwrap();
        put_inputs(&big, 0.0);
        let x: Vec<f32> = (0..3 * 16384).map(|i| (i % 7) as f32).collect();
        npy::write(
            big.join("x.npy"),
            &Tensor::new(vec![1, 1, 16384, 3], x).unwrap(),
        )
        .unwrap();
        let msg = assert_one_line_error("full disk", &run(&forward_args(&big, &out)));
        assert!(
            msg.contains("No space left") || msg.contains("space"),
            "{msg}"
        );
        assert_unchanged("full disk", &before, &snapshot(&out));
        let y = npy::read(out.join("y.npy")).expect("earlier y.npy still valid");
        assert_eq!(y.shape(), &[1, 2, 2, 3]);
    });
    umount(&out);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

/// A read-only directory (a read-only mount: root ignores permission bits).
#[test]
fn a_read_only_out_dir_is_refused_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    put_inputs(tmp.path(), 0.0);
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    if !mount_tmpfs(&out, "size=1m") {
        return;
    }
    let result = std::panic::catch_unwind(|| {
        std::fs::write(out.join("y.npy"), b"earlier").unwrap();
        let ro = Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(&out)
            .status()
            .is_ok_and(|s| s.success());
        if !ro {
            eprintln!("skipped: cannot remount read-only");
            return;
        }
        let before = snapshot(&out);
        assert_one_line_error("read-only", &run(&forward_args(tmp.path(), &out)));
        assert_unchanged("read-only", &before, &snapshot(&out));
    });
    umount(&out);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

/// Issue 8, item 3: simultaneous runs into one directory used to leave y from one run
/// beside the statistics of the other. Now the directory always holds one run's
/// complete set.
#[test]
fn concurrent_writers_never_mix_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let mut expected = Vec::new();
    for (dir, shift) in [(&a, 0.0), (&b, 5.0)] {
        std::fs::create_dir(dir).unwrap();
        put_inputs(dir, shift);
        let alone = dir.join("alone");
        let o = run(&forward_args(dir, &alone));
        assert!(o.status.success(), "{}", text(&o.stderr));
        expected.push(snapshot(&alone));
    }
    assert_ne!(expected[0], expected[1]);
    for round in 0..12 {
        let out = tmp.path().join(format!("shared{round}"));
        let children: Vec<_> = [&a, &b, &a, &b]
            .iter()
            .map(|dir| {
                Command::new(bin())
                    .args(forward_args(dir, &out))
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in children {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "round {round}: {}", text(&o.stderr));
        }
        let got = snapshot(&out);
        assert!(
            got == expected[0] || got == expected[1],
            "round {round}: the directory holds a mixed or partial set: {:?}",
            got.keys().collect::<Vec<_>>()
        );
    }
}
