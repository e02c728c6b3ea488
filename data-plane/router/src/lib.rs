//! Switchyard's data-plane router: a stateless HTTP server that routes OpenAI-compatible and
//! SageMaker-style requests to inference instances with the policy of `switchyard-policy`.
//!
//! A request's path, in file order: `server` (listeners, serving threads, routes, connection
//! admission), `connection` (one client connection and its deadlines) → `handle` (request admission, `body`, planning,
//! forwarding) → `plan` (CPU only: endpoint, variant, ranked candidates, body rewrite) →
//! `forward` (attempts under the retry rule and deadlines, the streamed answer, re-framed by
//! `eventstream` for SageMaker streams and by `response_ids` on the Responses paths). Around it:
//! `config` (flags → validated `Settings`), `admission` (bounds on connections, requests and
//! buffered bytes), `table` (the immutable routing snapshot and per-instance load cells),
//! `membership` (sync messages or a static file → table), `sync_client` (the control-plane
//! stream, load reports), `errors` (API-shaped errors), `metrics` (Prometheus), `trace` (OpenTelemetry spans).

pub mod admission;
pub mod body;
pub mod config;
pub mod connection;
pub mod disaggregated;
pub mod errors;
pub mod eventstream;
pub mod forward;
pub mod handle;
pub mod kv;
pub mod membership;
pub mod metrics;
pub mod plan;
pub mod response_ids;
pub mod server;
pub mod sync_client;
pub mod table;
pub mod tokenizer;
pub mod trace;

pub use config::{RouterConfig, Settings, Source, UpstreamProtocol};
pub use server::{RouterHandle, StartError};
