//! The error type: every failure names the argument, what was expected and what was found.

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong. No input makes the library panic, and when an
/// operation returns an error it has written nothing to its outputs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An input or output does not meet the op's contract (SPEC §4).
    #[error("{arg}: expected {expected}, found {found}")]
    InvalidArgument {
        /// The argument, by TensorFlow's name (`x`, `scale`, `reserve_space_1`, ...).
        arg: String,
        /// What the op needs.
        expected: String,
        /// What it was given.
        found: String,
    },
    /// A `data_format` string that is not one of the four formats.
    #[error("data_format: expected one of NHWC, NCHW, NDHWC, NCDHW, found {found:?}")]
    UnknownDataFormat {
        /// The string given.
        found: String,
    },
    /// An op name that is not one of the supported TensorFlow ops.
    #[error("unknown op {found:?}: expected one of {expected}")]
    UnknownOp {
        /// The name given.
        found: String,
        /// The supported names.
        expected: String,
    },
    /// An input name the op does not have.
    #[error("{op} has no input named {name:?}: its inputs are {expected}")]
    UnknownInput {
        /// The op.
        op: String,
        /// The name given.
        name: String,
        /// The op's input names.
        expected: String,
    },
    /// A required input was not given.
    #[error("{op}: missing input {name:?} ({why})")]
    MissingInput {
        /// The op.
        op: String,
        /// The missing input.
        name: String,
        /// Why it is needed.
        why: String,
    },
    /// An attribute that does not exist or has a bad value.
    #[error("attribute {name}: expected {expected}, found {found:?}")]
    InvalidAttr {
        /// The attribute.
        name: String,
        /// What it accepts.
        expected: String,
        /// The value given.
        found: String,
    },
    /// A tensor's element count does not match its shape.
    #[error("tensor of shape {shape:?} needs {expected} elements, found {found}")]
    DataLength {
        /// The shape.
        shape: Vec<usize>,
        /// Its element count.
        expected: usize,
        /// The number of elements given.
        found: usize,
    },
    /// A shape whose element count (or, for an empty tensor, the product of its nonzero
    /// dimensions) does not fit in `usize`.
    #[error("tensor of shape {shape:?} has more elements than fit in memory")]
    TooLarge {
        /// The shape.
        shape: Vec<usize>,
    },
    /// A synchronized call across ranks failed on this rank because of another rank
    /// (its inputs were rejected, or the ranks disagree on the problem), or the
    /// transport failed ([`crate::sync`]).
    #[error("synchronized batch norm: {reason}")]
    Collective {
        /// What went wrong, naming the ranks.
        reason: String,
    },
    /// The GPU backend could not run: no driver or device, a failed compile, launch or
    /// copy (feature `cuda`).
    #[error("CUDA: {what}")]
    Device {
        /// What failed.
        what: String,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub(crate) fn arg(arg: &str, expected: impl Into<String>, found: impl Into<String>) -> Self {
        Error::InvalidArgument {
            arg: arg.to_string(),
            expected: expected.into(),
            found: found.into(),
        }
    }
}
