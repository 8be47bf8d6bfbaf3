//! `fusedbn run`: one TensorFlow op over `.npy` files.
//!
//! Everything is validated and computed in memory before the first byte is written,
//! and the outputs are written all or nothing (see [`write_outputs`]): on any failure
//! the output directory is left exactly as it was.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use clap::Args;
use fusedbn::ops::{Attrs, Inputs, Op, Outputs};
use fusedbn::{driver, npy, DataFormat, Tensor};

use crate::error::{CliError, Result};

/// Arguments of `fusedbn run`.
#[derive(Debug, Args)]
#[command(
    after_help = short_help(),
    after_long_help = long_help(),
)]
pub struct RunArgs {
    /// The TensorFlow op name (listed below)
    #[arg(value_name = "OP")]
    pub op: String,

    /// An input tensor: TensorFlow's input name and a .npy file (repeatable).
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    pub inputs: Vec<String>,

    /// An attribute: epsilon, data_format, is_training, exponential_avg_factor (repeatable).
    #[arg(long = "attr", value_name = "KEY=VALUE")]
    pub attrs: Vec<String>,

    /// Directory for the outputs, one <output_name>.npy each (created if missing).
    /// Optional with --check.
    #[arg(long, value_name = "DIR", required_unless_present = "check")]
    pub out: Option<PathBuf>,

    /// Compare every output with the f64 reference (the library's driver: SPEC §7's
    /// tolerance, scaled to the size of the terms) and print how closely each agrees;
    /// on a value out of tolerance, fail and write nothing.
    #[arg(long)]
    pub check: bool,

    /// Run the op synchronized across the ranks of an MPI job (`mpirun -n N fusedbn run
    /// ... --sync mpi`; needs a build with the `mpi` feature): training ops use the
    /// statistics of the whole batch, every rank's shard; `{rank}` in an input path or
    /// in --out is replaced by the rank's number.
    #[arg(long, value_name = "BACKEND")]
    pub sync: Option<SyncBackend>,
}

/// `--sync` backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SyncBackend {
    /// MPI (OpenMPI), through the `mpi` cargo feature.
    Mpi,
}

/// The error of `--sync mpi` in a build without the `mpi` feature.
pub const NO_MPI: &str = "--sync mpi: this fusedbn was built without MPI support; \
build it with `cargo build --release -p fusedbn-cli --features mpi` (needs OpenMPI) and start it with mpirun";

/// Runs `fusedbn run`.
pub fn run(args: &RunArgs) -> Result<()> {
    match args.sync {
        None => run_local(args),
        Some(SyncBackend::Mpi) => run_mpi(args),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(args: &RunArgs) -> Result<()> {
    crate::validate_run(args)?;
    Err(CliError::new(NO_MPI))
}

/// `--sync mpi`: this rank's shard, synchronized with the other ranks of the MPI job.
/// Every local failure before the op (a file that cannot be read) still takes part in
/// the op's agreement check, so that the other ranks fail instead of waiting.
#[cfg(feature = "mpi")]
fn run_mpi(args: &RunArgs) -> Result<()> {
    use fusedbn::sync::{mpi, Mpi};
    let (op, attrs, inputs) = crate::validate_run(args)?;
    if args.check {
        return Err(CliError::new(
            "--check cannot be combined with --sync (the reference would see only this rank's shard)",
        ));
    }
    let universe = mpi::initialize()
        .ok_or_else(|| CliError::new("--sync mpi: MPI was already initialized"))?;
    let comm = Mpi::new(universe.world());
    let result = run_rank(args, op, &attrs, &inputs, &comm);
    // Every rank prints its own error, then waits at a barrier before any rank exits:
    // Open MPI kills the remaining ranks as soon as one exits non-zero, and a rank
    // killed before it printed would leave the user without its reason. A rank that
    // succeeded waits there too (its peers may still be reporting).
    if let Err(e) = &result {
        eprintln!("fusedbn: error: {e}");
    }
    mpi::collective::CommunicatorCollectives::barrier(&universe.world());
    result.map_err(CliError::reported)
}

/// One rank's part of `--sync mpi`: read this rank's shard, run the op synchronized
/// through `comm`, write this rank's outputs.
#[cfg(feature = "mpi")]
fn run_rank(
    args: &RunArgs,
    op: Op,
    attrs: &Attrs,
    inputs: &[(String, PathBuf)],
    comm: &fusedbn::sync::Mpi<fusedbn::sync::mpi::topology::SimpleCommunicator>,
) -> Result<()> {
    use fusedbn::sync::{fail_step, Collective};
    let (rank, size) = (comm.rank(), comm.size());
    let at = |e: CliError| CliError::new(format!("rank {rank} of {size}: {e}"));
    let subst = |p: &Path| PathBuf::from(p.to_string_lossy().replace("{rank}", &rank.to_string()));
    let out = args.out.as_deref().map(subst);
    let read = || -> Result<Vec<Tensor>> {
        if let Some(o) = args.out.as_deref() {
            if size > 1 && !o.to_string_lossy().contains("{rank}") {
                return Err(CliError::new(format!(
                    "--out {}: with --sync and {size} ranks it must contain {{rank}} (every rank writes its own shard's outputs)",
                    o.display()
                )));
            }
        }
        if let Some(o) = out.as_deref().filter(|o| o.exists() && !o.is_dir()) {
            return Err(CliError::new(format!(
                "--out {}: exists and is not a directory",
                o.display()
            )));
        }
        inputs
            .iter()
            .map(|(name, path)| {
                let path = subst(path);
                npy::read(&path)
                    .map_err(|e| CliError::new(format!("input {name} ({}): {e}", path.display())))
            })
            .collect()
    };
    let tensors = match read() {
        Ok(t) => t,
        Err(e) => {
            let _ = fail_step(
                comm,
                fusedbn::Error::Collective {
                    reason: e.to_string(),
                },
            );
            return Err(at(e));
        }
    };
    let mut named = Inputs::new();
    for ((name, _), t) in inputs.iter().zip(&tensors) {
        named.insert(name, t);
    }
    let outputs = op.run_sync(&named, attrs, comm).map_err(|e| at(e.into()))?;
    match &out {
        Some(out) => write_outputs(out, &outputs).map_err(at),
        None => Ok(()),
    }
}

fn run_local(args: &RunArgs) -> Result<()> {
    let (op, attrs, inputs) = crate::validate_run(args)?;
    if let Some(out) = args.out.as_deref().filter(|o| o.exists() && !o.is_dir()) {
        return Err(CliError::new(format!(
            "--out {}: exists and is not a directory",
            out.display()
        )));
    }
    let tensors = inputs
        .iter()
        .map(|(name, path)| {
            npy::read(path).map_err(|e| CliError::new(format!("input {name}: {e}")))
        })
        .collect::<Result<Vec<Tensor>>>()?;
    let mut named = Inputs::new();
    for ((name, _), t) in inputs.iter().zip(&tensors) {
        named.insert(name, t);
    }
    let outputs = op.run(&named, &attrs)?;
    if args.check {
        let want = driver::reference(op, &named, &attrs, None)?;
        let report =
            driver::check(&want, &outputs).map_err(|e| CliError::new(format!("--check: {e}")))?;
        println!(
            "{op}: every output within tolerance of the f64 reference (worst {:.3} of the tolerance)",
            report.worst()
        );
        println!("{report}");
    }
    match &args.out {
        Some(out) => write_outputs(out, &outputs),
        None => Ok(()),
    }
}

/// Splits `KEY=VALUE`; `what` names the flag for the error message.
fn split_pair<'a>(what: &str, meta: &str, s: &'a str) -> Result<(&'a str, &'a str)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k, v)),
        _ => Err(CliError::new(format!("{what} {s:?}: expected {meta}"))),
    }
}

/// Parses `--attr KEY=VALUE` flags onto TensorFlow's defaults.
pub(crate) fn parse_attrs(op: Op, flags: &[String]) -> Result<Attrs> {
    let mut attrs = Attrs::new();
    let mut seen = HashSet::new();
    for flag in flags {
        let (key, value) = split_pair("--attr", "KEY=VALUE", flag)?;
        if !op.attr_names().contains(&key) {
            return Err(CliError::new(format!(
                "{op} has no attribute {key:?}: its attributes are {}",
                op.attr_names().join(", ")
            )));
        }
        if !seen.insert(key) {
            return Err(CliError::new(format!(
                "attribute {key} given more than once"
            )));
        }
        attrs.set(key, value)?;
    }
    Ok(attrs)
}

/// Parses `--input NAME=FILE` flags; names are checked against the op's inputs here so
/// that a misspelt name is reported before any file is read.
pub(crate) fn parse_inputs(op: Op, flags: &[String]) -> Result<Vec<(String, PathBuf)>> {
    let mut out: Vec<(String, PathBuf)> = Vec::new();
    for flag in flags {
        let (name, path) = split_pair("--input", "NAME=FILE.npy", flag)?;
        if !op.input_names().contains(&name) {
            return Err(fusedbn::Error::UnknownInput {
                op: op.name().into(),
                name: name.into(),
                expected: op.input_names().join(", "),
            }
            .into());
        }
        if out.iter().any(|(n, _)| n == name) {
            return Err(CliError::new(format!("input {name} given more than once")));
        }
        out.push((name.to_string(), PathBuf::from(path)));
    }
    Ok(out)
}

/// Writes every output as `dir/<name>.npy`, all or nothing.
///
/// 1. `dir` (and missing parents) are created, and an advisory lock is taken on it
///    (`flock` on the directory itself, so no lock file appears), which serializes runs
///    into the same directory: a second run waits, so the directory never holds one
///    run's `y` beside another's statistics.
/// 2. Every target that exists must be a regular file (a directory in the way is
///    reported before anything is written).
/// 3. Every output is written to a new temporary file in `dir` (`.fusedbn-tmp-…`) and
///    synced; any failure (a full disk, a read-only directory) removes the temporary
///    files and leaves the existing files untouched.
/// 4. Existing targets are hard-linked to backups, the temporary files are renamed
///    into place, and the directory is synced. If a rename fails, the files already
///    renamed are put back from the backups (or removed if they are new).
///
/// On failure the directory is as it was (directories this call created are removed
/// again); on success every output is complete.
fn write_outputs(dir: &Path, outputs: &Outputs) -> Result<()> {
    let created = create_dirs(dir)?;
    let result = lock_dir(dir).and_then(|_lock| write_locked(dir, outputs));
    if result.is_err() {
        for d in created.iter().rev() {
            let _ = fs::remove_dir(d);
        }
    }
    result
}

/// The lock on the output directory; released when dropped (or when the process ends).
struct DirLock(#[allow(dead_code)] fs::File);

#[cfg(unix)]
fn lock_dir(dir: &Path) -> Result<DirLock> {
    let f = fs::File::open(dir).map_err(|e| {
        CliError::new(format!(
            "--out {}: could not open the directory: {e}",
            dir.display()
        ))
    })?;
    f.lock().map_err(|e| {
        CliError::new(format!(
            "--out {}: could not lock the directory: {e}",
            dir.display()
        ))
    })?;
    Ok(DirLock(f))
}

/// Without `flock` on directories, a lock file beside the outputs (left in place).
#[cfg(not(unix))]
fn lock_dir(dir: &Path) -> Result<DirLock> {
    let path = dir.join(".fusedbn.lock");
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| {
            CliError::new(format!(
                "{}: could not create the lock file: {e}",
                path.display()
            ))
        })?;
    f.lock()
        .map_err(|e| CliError::new(format!("{}: could not lock: {e}", path.display())))?;
    Ok(DirLock(f))
}

/// A file this run created that is removed again unless `keep` is called.
struct Scratch(Option<PathBuf>);

impl Scratch {
    fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new(""))
    }

    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

/// A fresh name in `dir` that no other file has (created exclusively, empty).
fn scratch(dir: &Path, stem: &str) -> std::io::Result<(Scratch, fs::File)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = dir.join(format!(
            ".fusedbn-tmp-{stem}-{}-{n}-{nanos}",
            std::process::id()
        ));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(f) => return Ok((Scratch(Some(path)), f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

fn write_locked(dir: &Path, outputs: &Outputs) -> Result<()> {
    use std::io::Write as _;
    let targets: Vec<(&str, PathBuf)> = outputs
        .names()
        .map(|n| (n, dir.join(format!("{n}.npy"))))
        .collect();
    for (name, path) in &targets {
        match fs::symlink_metadata(path) {
            Ok(m) if !m.is_file() => {
                return Err(CliError::new(format!(
                    "output {name}: {} exists and is not a regular file",
                    path.display()
                )))
            }
            _ => {}
        }
    }
    // 3. Every output complete and synced under a temporary name.
    let mut temps = Vec::new();
    for (name, t) in outputs.iter() {
        let fail = |e: &dyn std::fmt::Display| CliError::new(format!("output {name}: {e}"));
        let bytes = npy::to_bytes(t).map_err(|e| fail(&e))?;
        let (tmp, mut f) = scratch(dir, name).map_err(|e| {
            fail(&format!(
                "could not create a file in {}: {e}",
                dir.display()
            ))
        })?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(|e| fail(&format!("could not write {}: {e}", tmp.path().display())))?;
        temps.push(tmp);
    }
    // 4. Backups of the files about to be replaced, then the renames.
    let mut backups: Vec<Option<Scratch>> = Vec::new();
    for (name, path) in &targets {
        if fs::symlink_metadata(path).is_err() {
            backups.push(None);
            continue;
        }
        let (b, _) = scratch(dir, &format!("{name}-old")).map_err(|e| {
            CliError::new(format!(
                "output {name}: could not back up {}: {e}",
                path.display()
            ))
        })?;
        // A hard link is instant and leaves the target in place; where links are not
        // supported, a copy.
        let _ = fs::remove_file(b.path());
        fs::hard_link(path, b.path())
            .or_else(|_| fs::copy(path, b.path()).map(|_| ()))
            .map_err(|e| {
                CliError::new(format!(
                    "output {name}: could not back up {}: {e}",
                    path.display()
                ))
            })?;
        backups.push(Some(b));
    }
    for (i, ((name, path), tmp)) in targets.iter().zip(&temps).enumerate() {
        if let Err(e) = fs::rename(tmp.path(), path) {
            // Put back what was already replaced.
            for ((_, done), backup) in targets[..i].iter().zip(&backups) {
                match backup {
                    Some(b) => {
                        let _ = fs::rename(b.path(), done);
                    }
                    None => {
                        let _ = fs::remove_file(done);
                    }
                }
            }
            return Err(CliError::new(format!(
                "output {name}: could not move the new file into place at {}: {e}",
                path.display()
            )));
        }
    }
    // Renamed: the temporary names are gone already.
    for t in temps {
        t.keep();
    }
    sync_dir(dir);
    drop(backups); // removes the old versions
    Ok(())
}

/// Makes the renames durable (best effort: not every platform can sync a directory).
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}

/// Creates `dir` and any missing parents; returns the directories it created,
/// outermost first.
fn create_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut missing = Vec::new();
    let mut p = Some(dir);
    while let Some(d) = p {
        if d.as_os_str().is_empty() || d.exists() {
            break;
        }
        missing.push(d.to_path_buf());
        p = d.parent();
    }
    missing.reverse();
    if let Err(e) = fs::create_dir_all(dir) {
        for d in missing.iter().rev() {
            let _ = fs::remove_dir(d);
        }
        return Err(CliError::new(format!(
            "--out {}: could not create the directory: {e}",
            dir.display()
        )));
    }
    Ok(missing)
}

const EXAMPLE: &str = "fusedbn run FusedBatchNormV3 --input x=x.npy --input scale=scale.npy \
--input offset=offset.npy --attr epsilon=0.001 --attr data_format=NCHW --out out/";

/// `fusedbn run -h`: the op names and a pointer to `--help`.
fn short_help() -> String {
    let names: Vec<&str> = Op::ALL.iter().map(|op| op.name()).collect();
    format!(
        "Ops: {}\n\nExample: {EXAMPLE}\n\nRun `fusedbn run --help` for every op's inputs, outputs and attributes.",
        names.join(", ")
    )
}

/// The default of attribute `name`, read from [`Attrs::default`].
fn attr_default(name: &str, a: &Attrs) -> String {
    match name {
        "epsilon" => a.epsilon.to_string(),
        "data_format" => a.data_format.to_string(),
        "is_training" => a.is_training.to_string(),
        "exponential_avg_factor" => a.exponential_avg_factor.to_string(),
        "activation_mode" => a.activation_mode.to_string(),
        _ => "(none)".to_string(),
    }
}

/// The values attribute `name` accepts.
fn attr_values(name: &str) -> String {
    match name {
        "data_format" => DataFormat::ALL.map(DataFormat::as_str).join(" | "),
        "is_training" => "true | false".to_string(),
        "activation_mode" => "Identity | Relu".to_string(),
        _ => "a decimal number".to_string(),
    }
}

/// `fusedbn run --help`: every op with its inputs, outputs, attributes, element types
/// and formats, generated from the library's tables.
pub fn long_help() -> String {
    let mut s = String::from(
        "Ops (give each input as --input NAME=FILE.npy; every output is written as DIR/<output>.npy):\n",
    );
    for op in Op::ALL {
        let dtypes: Vec<String> = op.dtypes().iter().map(|d| d.to_string()).collect();
        let formats: Vec<&str> = op.formats().iter().map(|f| f.as_str()).collect();
        let _ = writeln!(s, "\n  {op}");
        let _ = writeln!(s, "    inputs:      {}", op.input_names().join(", "));
        let _ = writeln!(s, "    outputs:     {}", op.output_names().join(", "));
        let _ = writeln!(s, "    attrs:       {}", op.attr_names().join(", "));
        let _ = writeln!(s, "    x dtypes:    {}", dtypes.join(", "));
        let _ = writeln!(s, "    data_format: {}", formats.join(", "));
    }
    let defaults = Attrs::default();
    let mut names: Vec<&str> = Vec::new();
    for op in Op::ALL {
        for &a in op.attr_names() {
            if !names.contains(&a) {
                names.push(a);
            }
        }
    }
    s.push_str("\nAttributes (--attr KEY=VALUE):\n");
    for name in names {
        let only: Vec<&str> = Op::ALL
            .iter()
            .filter(|op| op.attr_names().contains(&name))
            .map(|op| op.name())
            .collect();
        let scope = if only.len() == Op::ALL.len() {
            String::new()
        } else {
            format!(" (only {})", only.join(", "))
        };
        let _ = writeln!(
            s,
            "  {name} = {}: default {}{scope}",
            attr_values(name),
            attr_default(name, &defaults)
        );
    }
    s.push_str(
        "\nInputs the op does not read in the requested mode may be left out: mean and variance\n\
         in training with exponential_avg_factor = 1, and reserve_space_3 of FusedBatchNormGradV3.\n\
         scale, offset, mean, variance and the reserve spaces are f32 (f64 when x is f64).\n\
         \n\
         .npy element types: f32 '<f4', f64 '<f8', f16 '<f2'; bfloat16 files are the ones\n\
         numpy + ml_dtypes writes, dtype '<V2' (the raw 16-bit pattern, little-endian).\n\
         \n\
         Invalid input prints one line `fusedbn: error: ...` on stderr, exits with status 2\n\
         and writes nothing.\n\
         \n\
         --sync mpi (a build with the mpi feature, started by mpirun): each rank runs the op on its\n\
         shard of the batch (split along N; shards may be uneven or empty); {rank} in an input path\n\
         or in --out becomes the rank's number. Training forward and gradient ops (V1-V3, Ex) use\n\
         the statistics and gradient sums of the whole batch: y / x_backprop are the rank's shard,\n\
         the per-channel outputs are global and identical on every rank. Inference ops run locally.\n\
         Example: mpirun -n 3 fusedbn run FusedBatchNormV3 --sync mpi --input x=shard{rank}.npy\n\
         --input scale=scale.npy --input offset=offset.npy --out out{rank}\n",
    );
    let _ = write!(s, "\nExample:\n  {EXAMPLE}");
    s
}
