//! `switchyard-engine-sim`: a simulated vLLM instance (Llama-3.1-70B-class on 8×H100) that
//! speaks vLLM's real HTTP protocol, so that pointing Switchyard at a real vLLM is only a
//! configuration change. Used by integration tests, by `switchyard up` (several simulators in
//! one process through [`spawn`]) and by the benchmarks.
//!
//! What it models (see the crate README for the numbers and where they come from):
//! - a **prefix cache** like vLLM's: 16-token blocks with chained hashes, LRU eviction,
//!   blocks of running requests pinned ([`cache`]);
//! - a **continuous-batching engine** with chunked prefill whose step time depends on the
//!   prefill tokens and the decodes in the step, so TTFT, ITL and prefill/decode interference
//!   come out of the model ([`engine`]), run in real time scaled by `--time-scale`;
//! - **NixlConnector disaggregation** as strict as vLLM 0.32: `kv_transfer_params` on prefill
//!   and decode requests (one block list per KV-cache group, the internal request id, the
//!   side channel a listener of its own), a hand-off pulled once, `kv_load_failure_policy`;
//! - **faults**: errors, hangs, connections dying mid-stream, a killed instance;
//! - **KV-cache events** in vLLM's wire format (ZMQ PUB + replay ROUTER, msgpack), from the
//!   prefix cache's real stores and evictions.
//!
//! Code map: `config` (the flags, and the engine model's parameters read from them),
//! [`tokenizer`] (the token-count approximation and chat template), [`cache`],
//! `kv_events` (the publisher),
//! [`engine`] (pure scheduler and time model; it knows no flags), `driver` (the engine task
//! and virtual clock), `api` (HTTP handlers and the state they share) and `openai` (wire
//! format), `metrics`, `server` (builds that state; accept loop, shutdown, [`SimHandle`]),
//! `error` ([`SimError`]).

pub mod cache;
mod config;
mod driver;
pub mod engine;
mod error;
mod faults;
mod handoff;
mod kv_events;
mod lmcache_pd;
mod metrics;
mod nixl;
mod openai;
mod records;
mod reply;
mod sampling;
mod server;
pub mod tokenizer;

mod api;

pub use config::{ConfigError, KvLoadFailurePolicy, SimConfig};
pub use error::SimError;
pub use faults::{FaultRateError, Faults};
pub use kv_events::{KvEventsBindError, KvEventsFormat};
pub use metrics::SimStats;
pub use records::ReceivedRequest;
pub use server::{SimHandle, SimServer, spawn};
pub use switchyard_shared::InstanceRole;
pub use tokenizer::{chat_prompt_text, count_tokens, tokenize};
