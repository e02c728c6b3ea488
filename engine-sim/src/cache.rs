//! A KV block pool with a prefix cache, modelled on vLLM V1's `KVCacheManager`.
//!
//! The pool has a fixed number of blocks (`--kv-cache-blocks`). A running request holds
//! blocks in two ways:
//!
//! - **cached blocks**: full prompt blocks registered in the hash table. Several requests may
//!   share one; a block held by a running request is pinned (never evicted);
//! - **private blocks**: the rest of its reservation (blocks not computed yet, the partial last
//!   prompt block, room for generated tokens). When prefill fills a block, the request
//!   [`commit`](PrefixCache::commit)s it: the private block becomes a cached one.
//!
//! When the last holder of a cached block releases it, the block stays in the table as
//! evictable, in LRU order; allocation evicts the least recently released first. Like vLLM, a
//! request releases its blocks tail first, so the end of a sequence is evicted before its start.
//!
//! Block hashes chain: block `i`'s hash is `xxh3_64_with_seed(token ids of block i, hash of
//! block i-1)`, with seed 0 for the first block (token ids as little-endian `u32`s), or, for a
//! request of a LoRA adapter, a seed made from the adapter's name (vLLM keys an adapter's
//! blocks by its name, so they never serve the base model or another adapter). Equal block
//! contents after different prefixes therefore hash differently. Only full blocks are hashed.
//!
//! With [`record_events`](PrefixCache::record_events) on, every change to the table is logged
//! as vLLM's KV-cache events describe it: blocks entering the table ([`CacheEvent::Stored`],
//! runs of consecutive blocks of one sequence with their parent and token ids), blocks evicted
//! ([`CacheEvent::Removed`]) and a reset ([`CacheEvent::Cleared`]).

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// A LoRA adapter a request runs under (`--lora-modules`): vLLM's `lora_int_id` (1-based, in
/// the order the adapters were given) and `lora_name`, which its KV events carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lora {
    pub id: u32,
    pub name: Arc<str>,
}

/// The chained hashes of the full blocks of `tokens` (a trailing partial block has none).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    block_hashes_under(None, tokens, block_size)
}

/// [`block_hashes`] of a request under `lora` (None: the base model).
pub fn block_hashes_under(lora: Option<&Lora>, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let block_size = block_size.max(1);
    let mut hashes = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = lora.map_or(0, |lora| xxh3_64(lora.name.as_bytes()) | 1);
    let mut bytes = Vec::with_capacity(block_size * 4);
    for block in tokens.chunks_exact(block_size) {
        bytes.clear();
        for token in block {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        parent = xxh3_64_with_seed(&bytes, parent);
        hashes.push(parent);
    }
    hashes
}

/// A change to the prefix-cache table, as vLLM's KV-cache events report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Consecutive blocks of one sequence entered the table: `hashes[i]` holds
    /// `tokens[i * block_size..(i + 1) * block_size]`; `parent` is the hash of the block before
    /// the first (None: the first is the sequence's first block).
    Stored {
        parent: Option<u64>,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
        /// The adapter the blocks were computed under (None: the base model).
        lora: Option<Lora>,
    },
    /// Blocks evicted from the table.
    Removed { hashes: Vec<u64> },
    /// Every block left the table.
    Cleared,
}

#[derive(Debug)]
struct CachedBlock {
    /// Running requests holding this block; 0 means evictable.
    holders: u32,
    /// Position in the LRU order while evictable.
    lru_tick: u64,
}

/// The block pool and its prefix-cache table. Pure data structure: no clock, no I/O.
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    table: HashMap<u64, CachedBlock>,
    /// Evictable cached blocks by release order (oldest first).
    lru: BTreeMap<u64, u64>,
    next_tick: u64,
    /// Cached blocks with at least one holder.
    pinned: usize,
    /// Blocks reserved by running requests and not (yet) in the table.
    private: usize,
    /// The event log, while recording.
    events: Option<Vec<CacheEvent>>,
}

impl PrefixCache {
    pub fn new(capacity_blocks: usize) -> Self {
        Self {
            capacity: capacity_blocks,
            table: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            pinned: 0,
            private: 0,
            events: None,
        }
    }

    /// Starts (or stops) logging table changes as [`CacheEvent`]s.
    pub fn record_events(&mut self, on: bool) {
        self.events = on.then(Vec::new);
    }

    pub fn recording_events(&self) -> bool {
        self.events.is_some()
    }

    /// The events logged since the last call (none when not recording).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn log(&mut self, event: CacheEvent) {
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    /// Logs that blocks of one sequence entered the table (see [`CacheEvent::Stored`]).
    pub fn log_stored(
        &mut self,
        parent: Option<u64>,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
        lora: Option<Lora>,
    ) {
        if !hashes.is_empty() {
            self.log(CacheEvent::Stored {
                parent,
                hashes,
                tokens,
                lora,
            });
        }
    }

    /// Empties the table, like vLLM's `reset_prefix_cache`: only when no running request holds
    /// a block (returns false, changing nothing, otherwise).
    pub fn reset(&mut self) -> bool {
        if self.pinned > 0 || self.private > 0 {
            return false;
        }
        self.table.clear();
        self.lru.clear();
        self.log(CacheEvent::Cleared);
        true
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks held by running requests (pinned cached blocks plus private blocks).
    pub fn used_blocks(&self) -> usize {
        self.pinned + self.private
    }

    /// Blocks whose contents are in the table (pinned or evictable).
    pub fn cached_blocks(&self) -> usize {
        self.table.len()
    }

    /// Fraction of the pool held by running requests, 0–1 (vLLM's `kv_cache_usage_perc`:
    /// evictable cached blocks count as free).
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            return 0.0;
        }
        self.used_blocks() as f64 / self.capacity as f64
    }

    /// How many of `hashes`, from the first, are in the table.
    pub fn longest_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|hash| self.table.contains_key(hash))
            .count()
    }

    /// Whether [`admit`](Self::admit) would succeed: `hits` (a run found by
    /// [`longest_prefix`](Self::longest_prefix)) get pinned and `new_blocks` more fit, after
    /// evicting other unpinned blocks if needed.
    pub fn can_admit(&self, hits: &[u64], new_blocks: usize) -> bool {
        let unpinned_hits = hits
            .iter()
            .filter(|hash| self.table.get(hash).is_some_and(|block| block.holders == 0))
            .count();
        let committed = self.pinned + unpinned_hits + self.private;
        self.capacity.saturating_sub(committed) >= new_blocks
    }

    /// Pins `hits` for a new request and reserves `new_blocks` private blocks, evicting the
    /// least recently released blocks if the pool is full. Returns false (changing nothing)
    /// when they do not fit.
    pub fn admit(&mut self, hits: &[u64], new_blocks: usize) -> bool {
        if !self.can_admit(hits, new_blocks) {
            return false;
        }
        for hash in hits {
            self.pin(*hash);
        }
        self.reserve(new_blocks);
        true
    }

    /// Registers one newly computed full block of a running request: one of its private
    /// blocks becomes the cached block `hash`, which the request now holds. If the table
    /// already has `hash` (another request computed it), the request shares that one and its
    /// private block goes back to the pool. Returns true when `hash` is new to the table (the
    /// caller logs it with [`log_stored`](Self::log_stored)).
    pub fn commit(&mut self, hash: u64) -> bool {
        debug_assert!(self.private > 0, "commit without a reserved block");
        self.private = self.private.saturating_sub(1);
        match self.table.entry(hash) {
            Entry::Occupied(_) => {
                self.pin(hash);
                false
            }
            Entry::Vacant(vacant) => {
                vacant.insert(CachedBlock {
                    holders: 1,
                    lru_tick: 0,
                });
                self.pinned += 1;
                true
            }
        }
    }

    /// Releases a finished (or aborted) request's blocks: `held` are its cached blocks in
    /// sequence order, `private` its remaining private blocks. Cached blocks are released tail
    /// first, so a sequence's last blocks are the first evicted.
    pub fn release(&mut self, held: &[u64], private: usize) {
        self.private = self.private.saturating_sub(private);
        for hash in held.iter().rev() {
            let Some(block) = self.table.get_mut(hash) else {
                continue;
            };
            block.holders = block.holders.saturating_sub(1);
            if block.holders == 0 {
                block.lru_tick = self.next_tick;
                self.lru.insert(self.next_tick, *hash);
                self.next_tick += 1;
                self.pinned -= 1;
            }
        }
    }

    fn pin(&mut self, hash: u64) {
        let Some(block) = self.table.get_mut(&hash) else {
            return;
        };
        if block.holders == 0 {
            self.lru.remove(&block.lru_tick);
            self.pinned += 1;
        }
        block.holders += 1;
    }

    /// Reserves `blocks` private blocks, evicting LRU blocks as needed. The caller checked
    /// that they fit.
    fn reserve(&mut self, blocks: usize) {
        let free = self.capacity - self.pinned - self.private - self.lru.len();
        let mut evicted = Vec::new();
        for _ in free..blocks {
            let Some((_, hash)) = self.lru.pop_first() else {
                break;
            };
            self.table.remove(&hash);
            evicted.push(hash);
        }
        self.private += blocks;
        if !evicted.is_empty() {
            self.log(CacheEvent::Removed { hashes: evicted });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    /// Admits a request for `hashes`, commits the blocks it misses, and releases it.
    fn run_request(cache: &mut PrefixCache, hashes: &[u64]) -> usize {
        let hits = cache.longest_prefix(hashes);
        assert!(cache.admit(&hashes[..hits], hashes.len() - hits));
        for hash in &hashes[hits..] {
            cache.commit(*hash);
        }
        cache.release(hashes, 0);
        hits
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert_eq!(block_hashes(&tokens(0..15), 16).len(), 0);
        assert_eq!(block_hashes(&tokens(0..16), 16).len(), 1);
        assert_eq!(block_hashes(&tokens(0..17), 16).len(), 1);
        assert_eq!(block_hashes(&tokens(0..32), 16).len(), 2);
        assert_eq!(
            block_hashes(&tokens(0..17), 16),
            block_hashes(&tokens(0..16), 16)
        );
    }

    #[test]
    fn hashes_chain_the_parent_block() {
        let a: Vec<u32> = tokens(0..16).into_iter().chain(tokens(100..116)).collect();
        let b: Vec<u32> = tokens(50..66).into_iter().chain(tokens(100..116)).collect();
        let (a, b) = (block_hashes(&a, 16), block_hashes(&b, 16));
        // The second blocks hold the same tokens after different first blocks.
        assert_ne!(a[1], b[1]);

        let mut cache = PrefixCache::new(100);
        run_request(&mut cache, &a);
        assert_eq!(cache.longest_prefix(&a), 2);
        assert_eq!(cache.longest_prefix(&b), 0);
    }

    #[test]
    fn repeated_prefix_hits_and_divergence_stops_the_run() {
        let mut cache = PrefixCache::new(100);
        let first = block_hashes(&tokens(0..64), 16);
        assert_eq!(run_request(&mut cache, &first), 0);
        assert_eq!(run_request(&mut cache, &first), 4);
        let mut diverging = tokens(0..64);
        diverging[40] = 9999;
        let diverging = block_hashes(&diverging, 16);
        assert_eq!(cache.longest_prefix(&diverging), 2);
        assert_eq!(cache.cached_blocks(), 4);
        assert_eq!(cache.used_blocks(), 0);
    }

    #[test]
    fn evicts_least_recently_released_tail_first() {
        let mut cache = PrefixCache::new(3);
        let a = block_hashes(&tokens(0..32), 16);
        let b = block_hashes(&tokens(1000..1016), 16);
        run_request(&mut cache, &a); // releases a[1] then a[0]
        run_request(&mut cache, &b);
        assert_eq!(cache.cached_blocks(), 3);

        // One new block: the oldest release, a's tail block, goes.
        assert!(cache.admit(&[], 1));
        assert_eq!(cache.longest_prefix(&a), 1);
        assert_eq!(cache.longest_prefix(&b), 1);
        cache.release(&[], 1);

        // Hitting a[0] pins it; the next eviction takes b.
        assert!(cache.admit(&a[..1], 2));
        assert_eq!(cache.longest_prefix(&b), 0);
        assert_eq!(cache.longest_prefix(&a), 1);
        assert_eq!(cache.used_blocks(), 3);
        assert!((cache.usage() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn pinned_blocks_are_never_evicted() {
        let mut cache = PrefixCache::new(4);
        let a = block_hashes(&tokens(0..48), 16);
        assert!(cache.admit(&[], 3));
        for hash in &a {
            cache.commit(*hash);
        }
        // a is still running: only one block is free and nothing is evictable.
        assert!(!cache.can_admit(&[], 2));
        assert!(!cache.admit(&[], 2));
        assert!(cache.admit(&[], 1));
        assert_eq!(cache.longest_prefix(&a), 3);
        cache.release(&a, 0);
        cache.release(&[], 1);
        assert!(cache.admit(&[], 4));
        assert_eq!(cache.cached_blocks(), 0);
    }

    #[test]
    fn evictions_and_resets_are_logged_while_recording() {
        let mut cache = PrefixCache::new(2);
        let a = block_hashes(&tokens(0..32), 16);
        run_request(&mut cache, &a);
        assert!(cache.take_events().is_empty(), "not recording");
        cache.record_events(true);
        // The two cached blocks are evicted tail first for a new one.
        assert!(cache.admit(&[], 2));
        assert!(!cache.reset(), "a running request holds blocks");
        cache.release(&[], 2);
        assert!(cache.reset());
        assert_eq!(
            cache.take_events(),
            vec![
                CacheEvent::Removed {
                    hashes: vec![a[1], a[0]]
                },
                CacheEvent::Cleared
            ]
        );
        assert!(cache.take_events().is_empty());
    }

    #[test]
    fn shared_blocks_stay_pinned_until_the_last_holder_releases() {
        let mut cache = PrefixCache::new(2);
        let a = block_hashes(&tokens(0..16), 16);
        assert!(cache.admit(&[], 1));
        cache.commit(a[0]);
        assert!(cache.admit(&a, 0));
        cache.release(&a, 0);
        assert!(!cache.admit(&[], 2));
        cache.release(&a, 0);
        assert!(cache.admit(&[], 2));
    }

    #[test]
    fn committing_a_block_another_request_computed_shares_it() {
        let mut cache = PrefixCache::new(4);
        let a = block_hashes(&tokens(0..16), 16);
        // Two requests with the same prompt admitted before either computed it.
        assert!(cache.admit(&[], 1));
        assert!(cache.admit(&[], 1));
        cache.commit(a[0]);
        cache.commit(a[0]);
        assert_eq!(cache.used_blocks(), 1);
        assert_eq!(cache.cached_blocks(), 1);
        cache.release(&a, 0);
        cache.release(&a, 0);
        assert_eq!(cache.used_blocks(), 0);
        assert_eq!(cache.longest_prefix(&a), 1);
    }
}
