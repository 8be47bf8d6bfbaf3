//! The binary's error: a one-line message, printed by `main` as `fusedbn: error: ...`.

use std::fmt;

/// A user-facing error message (always a single line).
#[derive(Debug)]
pub struct CliError(String);

impl CliError {
    /// An error with this message; line breaks are folded so it prints as one line.
    pub fn new(msg: impl Into<String>) -> Self {
        let msg: String = msg.into();
        if msg.contains(['\n', '\r']) {
            let parts: Vec<&str> = msg
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            CliError(parts.join("; "))
        } else {
            CliError(msg)
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

// `CliError` itself is not a `std::error::Error`, so every error type converts into it
// with `?` (the library's `Error`, `npy::NpyError`, `io::Error`, ...).
impl<E: std::error::Error> From<E> for CliError {
    fn from(e: E) -> Self {
        CliError::new(e.to_string())
    }
}

/// Result alias for the binary.
pub type Result<T, E = CliError> = std::result::Result<T, E>;
