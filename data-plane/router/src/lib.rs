//! Switchyard's data-plane router: a stateless HTTP server that routes OpenAI-compatible and
//! SageMaker-style requests to inference instances with the policy of `switchyard-policy`.
//!
//! A request meets, in order: `server` (listeners, serving threads, routes, connection and
//! request admission) → `request` (the orchestrator of one request's phases: read the body,
//! plan, settle, queue, forward, respond) → `plan` (CPU only: endpoint, variant, ranked
//! candidates, the engine's body) → `forward` (attempts under the retry rule; prefill then
//! decode) → `respond` (the client's answer: headers, the streamed body, SageMaker's event
//! stream, response ids). Beside them: `config` (flags → `Settings`), `routing` (the table
//! requests read, and what keeps it current: membership, the control-plane stream), `kv`
//! (KV-cache event subscribers), `observe` (metrics, traces), `errors`, `headers`.

mod config;
mod errors;
mod forward;
mod headers;
mod kv;
mod observe;
mod operation;
mod plan;
mod request;
mod respond;
mod routing;
mod server;

pub use config::{RouterConfig, Settings, Source, UpstreamProtocol, parse_byte_size};
pub use routing::cells::{InstanceCell, LoadRegistry};
pub use routing::table::{EndpointRoute, InstanceRoute, RoutingTable, VariantRoute};
pub use server::admission::Limit;
pub use server::{RouterHandle, StartError};

/// The router's parts that work without its server, for the benchmarks and tests that drive
/// one alone: the control-plane stream and membership at fleet scale, the prompt counters of
/// disaggregated endpoints, the KV-event subscribers and token ids against real engines.
pub mod parts {
    pub use crate::kv::{KvEvents, KvSettings, SubscriberSettings};
    pub use crate::observe::metrics::SyncMetrics;
    pub use crate::plan::count::{Count, TokenCounter, TokenCounters, count_prompt};
    pub use crate::plan::kv::{KvDecision, decide};
    pub use crate::plan::tokens::{Kept, PromptKind, TokenizeError, kept, tokenize_body};
    pub use crate::request::tokenize::{TokenizeClient, least_loaded, request_tokens};
    pub use crate::routing::membership::Membership;
    pub use crate::routing::static_file::read_static_config;
    pub use crate::routing::sync_client::{SyncSettings, SyncTask, spawn as spawn_sync};
    pub use crate::routing::table::build as build_table;
}
