//! The library behind the `fusedbn` binary: the command line ([`Cli`], [`parse_args`]),
//! the validation `fusedbn run` does before it reads any file ([`validate_run`]), and
//! the subcommands ([`run`], [`bench`]).
//!
//! `src/main.rs` is only the dispatch and the printing of errors; keeping the parsing
//! here lets the fuzz target `fuzz/fuzz_targets/cli.rs` (and its regression test,
//! `tests/fuzz_regressions.rs`) drive it without spawning the binary.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use fusedbn::ops::{Attrs, Op};

pub mod bench;
pub mod error;
pub mod run;

pub use error::CliError;

/// TensorFlow-exact fused batch normalization on the CPU.
#[derive(Debug, Parser)]
#[command(name = "fusedbn", version, about, propagate_version = true)]
pub struct Cli {
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands of `fusedbn`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one TensorFlow fused batch-norm op on .npy inputs, writing one .npy per output.
    Run(run::RunArgs),
    /// Time the batch-norm passes against a plain memory copy of the same bytes.
    Bench(bench::BenchArgs),
}

/// Parses a command line (`args[0]` is the program name, as in [`std::env::args`]).
///
/// `--help` and `--version` come back as errors of kind
/// [`clap::error::ErrorKind::DisplayHelp`] / `DisplayVersion`, as clap reports them.
pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(args)
}

/// What [`validate_run`] returns: the op, its attributes and the `(input name, file)`
/// pairs in the order given.
pub type ValidatedRun = (Op, Attrs, Vec<(String, PathBuf)>);

/// Everything `fusedbn run` checks before it reads any file: the op name, the
/// `--attr KEY=VALUE` flags (onto TensorFlow's defaults) and the `--input NAME=FILE`
/// flags (names checked against the op's inputs, each given at most once).
/// No file is opened: a run that fails here has touched nothing.
pub fn validate_run(args: &run::RunArgs) -> Result<ValidatedRun, CliError> {
    let op: Op = args.op.parse()?;
    let attrs = run::parse_attrs(op, &args.attrs)?;
    let inputs = run::parse_inputs(op, &args.inputs)?;
    Ok((op, attrs, inputs))
}
