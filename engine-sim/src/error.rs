//! Why a simulator could not start or run.

use crate::config::ConfigError;

/// Why a simulator could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A bad configuration value; the message names the flag.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A KV-event socket could not be bound. The zeromq error is part of the message (not a
    /// `source`), so that an error chain shows it once.
    #[error("{flag} {endpoint}: cannot bind: {error}")]
    Bind {
        flag: &'static str,
        endpoint: String,
        error: zeromq::ZmqError,
    },
    #[error("socket error: {0}")]
    Io(#[source] std::io::Error),
    #[error("the engine task panicked")]
    EnginePanicked,
}
