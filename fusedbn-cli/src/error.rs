//! The binary's error: a one-line message, printed by `main` as `fusedbn: error: ...`.

use std::fmt;

/// A user-facing error message (always a single line).
#[derive(Debug)]
pub struct CliError {
    msg: String,
    reported: bool,
}

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
            CliError::from_line(parts.join("; "))
        } else {
            CliError::from_line(msg)
        }
    }

    fn from_line(msg: String) -> Self {
        CliError {
            msg,
            reported: false,
        }
    }

    /// The same error, marked as already printed (by an MPI rank, which must print
    /// before the job's barrier: Open MPI kills the other ranks as soon as one exits
    /// non-zero, so an error printed after that could be lost).
    pub fn reported(self) -> Self {
        CliError {
            reported: true,
            ..self
        }
    }

    /// Whether the error was already printed; `main` then only sets the exit status.
    pub fn is_reported(&self) -> bool {
        self.reported
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
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
