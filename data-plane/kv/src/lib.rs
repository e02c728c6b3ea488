//! The KV index KV_AWARE routing reads: what the engines' KV-cache events say each instance
//! holds. Pure data structures over decoded events (no sockets, no runtime: the router's
//! subscribers feed it), so it is unit-, property- and bench-tested alone.
//!
//! - [`wire`]: vLLM's msgpack event batches (both layouts vLLM has used).
//! - [`index`]: per variant, which instance holds which chain of blocks (router-owned hashes
//!   over token ids), bounded per instance, with metrics.

pub mod index;
pub mod wire;

pub use index::{Freshness, IndexCounters, IndexSettings, KvIndex, TokenMatch, VariantIndex};
