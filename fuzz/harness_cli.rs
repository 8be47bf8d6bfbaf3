//! The checks behind the `cli` fuzz target, in plain stable Rust.
//!
//! Included with `#[path]` by `fuzz/fuzz_targets/cli.rs` (libFuzzer, nightly) and by
//! `fusedbn-cli/tests/fuzz_regressions.rs` (stable), which replays every input committed
//! under `fuzz/regressions/cli/`. Nothing here reads or writes a file or runs the bench.

use fusedbn_cli::{parse_args, validate_run, Command};

/// The command line of `fusedbn` from arbitrary bytes: split on NUL into arguments (as
/// UTF-8, invalid sequences replaced), after the program name `fusedbn`.
///
/// Parsing must not panic; a clap error (usage, `--help`, `--version`) must render. For
/// `run`, [`validate_run`] (op name, `--attr` and `--input` flags: everything before the
/// first file is opened) must not panic either; its error is one line, and what it
/// accepts is consistent: the op's name as given, one input per `--input` flag, each a
/// distinct input name of the op.
pub fn cli(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut args = vec!["fusedbn".to_string()];
    if !text.is_empty() {
        args.extend(text.split('\0').map(str::to_string));
    }
    let cli = match parse_args(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.kind();
            let _ = e.render().to_string();
            return;
        }
    };
    let Command::Run(run) = &cli.command else {
        return;
    };
    match validate_run(run) {
        Ok((op, _attrs, inputs)) => {
            assert_eq!(op.name(), run.op, "the op is the one named");
            assert_eq!(inputs.len(), run.inputs.len(), "one input per --input flag");
            for (i, (name, _)) in inputs.iter().enumerate() {
                assert!(
                    op.input_names().contains(&name.as_str()),
                    "{op}: {name} is not one of its inputs"
                );
                assert!(
                    inputs[..i].iter().all(|(n, _)| n != name),
                    "{op}: input {name} accepted twice"
                );
            }
            for flag in &run.attrs {
                let key = flag.split_once('=').map_or(flag.as_str(), |(k, _)| k);
                assert!(
                    op.attr_names().contains(&key),
                    "{op}: accepted attribute {key:?}, which it does not have"
                );
            }
        }
        Err(e) => {
            let message = e.to_string();
            assert!(
                !message.contains(['\n', '\r']),
                "an error message is not one line: {message:?}"
            );
        }
    }
}
