//! `fusedbn`: run a fused batch-norm op on `.npy` files, or benchmark the library.
//!
//! This file is only the command line and the dispatch; the work is in [`run`] and
//! [`bench`].

mod bench;
mod error;
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// TensorFlow-exact fused batch normalization on the CPU.
#[derive(Debug, Parser)]
#[command(name = "fusedbn", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one TensorFlow fused batch-norm op on .npy inputs, writing one .npy per output.
    Run(run::RunArgs),
    /// Time the batch-norm passes against a plain memory copy of the same bytes.
    Bench(bench::BenchArgs),
}

/// Exit status for invalid input (as clap uses for usage errors).
const EXIT_INVALID: u8 = 2;

fn main() -> ExitCode {
    // Usage errors (unknown flags, a missing --out, ...) are clap's: its message, status 2.
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Bench(args) => bench::bench(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fusedbn: error: {e}");
            ExitCode::from(EXIT_INVALID)
        }
    }
}
