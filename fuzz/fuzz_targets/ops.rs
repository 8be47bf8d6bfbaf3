//! The op layer on arbitrary ops, attributes and small tensors; see
//! `fuzz/harness_lib.rs` for the decoding and the checks.
#![no_main]

#[allow(dead_code)]
#[path = "../harness_lib.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::ops(data));
