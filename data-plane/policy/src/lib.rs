//! Switchyard's routing policy: pure code over a membership snapshot, with no I/O, no async
//! runtime and no network types, so it can be unit-, property- and bench-tested alone.
//!
//! - [`prefix`]: the routing prefix of a native body (first `PrefixLength` bytes).
//! - [`openai`]: what routing needs from an OpenAI body, and its prefix text rule.
//! - [`hash`]: the stable routing key and rendezvous hashes (xxh3-64, golden-tested).
//! - [`rank`]: PREFIX_AWARE (and its bounded-load extension), LEAST_OUTSTANDING_REQUESTS,
//!   RANDOM, sticky sessions, and the variant choice. Every function returns ranked
//!   candidates; the caller retries and counts.
//! - [`kv`]: KV_AWARE: the router's block hashes over token ids and the ranking from matched
//!   blocks and load.

pub mod hash;
pub mod kv;
pub mod openai;
pub mod prefix;
pub mod rank;

pub use rank::{InstanceView, LoadBalance, Ranking, Route, Strategy};
