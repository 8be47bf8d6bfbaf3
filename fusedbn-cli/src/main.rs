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
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
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

/// `--help` and `--version` print as clap prints them (status 0); a usage error (an
/// unknown flag, a missing `--out`, ...) prints one line on stderr, as every other bad
/// input does: clap's first line and where to look, status 2.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    let message = if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        "a command is required: run or bench".to_string()
    } else {
        // clap's message is its lines up to the usage or a tip, e.g. "the following
        // required arguments were not provided:" and the next line naming them.
        let rendered = e.render().to_string();
        let lines: Vec<&str> = rendered
            .lines()
            .map(str::trim)
            .take_while(|l| {
                !l.starts_with("Usage:") && !l.starts_with("tip:") && !l.starts_with("For more")
            })
            .filter(|l| !l.is_empty())
            .collect();
        let text = lines.join(" ");
        let text = text
            .strip_prefix("error:")
            .unwrap_or(&text)
            .trim()
            .to_string();
        if text.is_empty() {
            "invalid arguments".to_string()
        } else {
            text
        }
    };
    eprintln!("fusedbn: error: {message} (see `fusedbn --help`)");
    ExitCode::from(EXIT_INVALID)
}
