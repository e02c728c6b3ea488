//! The KV index KV_AWARE routing reads: what the engines' KV-cache events say each instance
//! holds (docs/kv-events.md: engines, versions and fields). Pure data structures over decoded
//! events (no sockets, no runtime: the router's subscribers feed it), so it is unit-,
//! property- and bench-tested alone.
//!
//! - [`wire`]: vLLM's and SGLang's msgpack event batches (every layout they have used).
//! - [`index`]: per variant, which instance holds which chain of blocks (router-owned hashes
//!   over token ids), bounded per instance, with metrics.

mod block_hasher;
pub mod index;
pub mod wire;

pub use index::{
    ChainKey, Freshness, IndexCounters, IndexSettings, KvIndex, TokenMatch, VariantIndex,
};
