//! `fusedbn`'s argument and attribute parsing on arbitrary command lines; see
//! `fuzz/harness_cli.rs` for the checks.
#![no_main]

#[path = "../harness_cli.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::cli(data));
