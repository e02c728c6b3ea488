//! Why a simulator could not start or run.

use crate::config::ConfigError;
use crate::kv_events::KvEventsBindError;

/// Why a simulator could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A bad configuration value; the message names the flag.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A KV-event socket could not be bound; the message names the flag.
    #[error(transparent)]
    KvEventsBind(#[from] KvEventsBindError),
    #[error("--side-channel-host {host} --side-channel-port {port}: cannot listen there ({error})")]
    SideChannelBind {
        host: String,
        port: u16,
        #[source]
        error: std::io::Error,
    },
    #[error("--tokenizer: {0}")]
    Tokenizer(#[from] switchyard_tokenize::LoadError),
    #[error("socket error: {0}")]
    Io(#[source] std::io::Error),
    #[error("the engine task panicked")]
    EnginePanicked,
}
