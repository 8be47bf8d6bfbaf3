//! `npy::from_bytes` on arbitrary bytes; see `fuzz/harness_lib.rs` for the checks.
#![no_main]

#[allow(dead_code)]
#[path = "../harness_lib.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::npy(data));
