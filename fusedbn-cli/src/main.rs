//! `fusedbn`: run a fused batch-norm op on `.npy` files, or benchmark the library.
//!
//! This file is only the dispatch and the printing of errors; the command line and the
//! work are in the `fusedbn_cli` library ([`Cli`], [`run`], [`bench`]).

use std::process::ExitCode;

use clap::Parser;
use fusedbn_cli::{bench, run, Cli, Command};

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
            if !e.is_reported() {
                eprintln!("fusedbn: error: {e}");
            }
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
