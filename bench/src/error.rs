//! The error a bad flag or value makes: the command exits 64 with its message.

use std::error::Error;

/// A bad flag or value (exit 64). Its message, the wrapped error's, names the flag.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(Box<dyn Error + Send + Sync>);

impl UsageError {
    /// Any error or message: a benchmark's typed flag error, or a sentence.
    pub fn new(error: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self(error.into())
    }
}
