//! The oracle bound: the highest KV-cache hit rate any placement of a trace's requests on a
//! fleet could reach, computed offline from the trace with the simulator's own tokenizer,
//! chat template and block hashes.
//!
//! ## Definitions
//!
//! A prompt of `n` tokens has `floor(n / B)` full blocks (B = 16, vLLM's block size), each
//! identified by its chained hash (equal hash ⇔ equal prefix up to the block's end). Like
//! vLLM, an engine takes at most `n − 1` prompt tokens from its cache, so only the first
//! `floor((n − 1) / B)` blocks are *eligible* to hit; every full block is computed and cached
//! when missed, eligible or not. The hit rate is cached tokens / prompt tokens
//! (`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`).
//!
//! Two bounds, both true upper bounds on the hit tokens of any placement:
//!
//! 1. **Compulsory** (any order, any capacity): each distinct block must be computed once in
//!    the fleet before anyone can hit it. A block referenced `e` times as eligible and `f` times
//!    as not eligible can hit at most `e − 1` times if `f = 0` (its first use, whichever it is,
//!    misses) and `e` times otherwise (a non-eligible use could come first and compute it).
//! 2. **Capacity** (requests looked up in the trace's nominal order): the fleet's caches
//!    together hold at most `engines × kv_cache_blocks` blocks, and the union of their
//!    contents behaves like one cache of that size whose blocks enter only when a request
//!    computes them. Belady's MIN (evict the block used farthest in the future, or do not
//!    keep a block whose next use is farther than all others) gives the most hits any such
//!    cache can have on the sequence of every full-block use, eligible or not; eligible hits
//!    are at most that.
//!
//! The bound is `B × min(compulsory, capacity)` tokens. It is generous to the oracle: it
//! counts a block as a hit even if an earlier block of the same prompt missed (an engine
//! needs the whole leading run), ignores the blocks that running requests pin, and lets
//! every request see every block in the fleet as if on its own engine. When the fleet's
//! cache holds the whole working set, both bounds agree and the order does not matter.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use serde::Serialize;

/// What the oracle needs of one prompt: its token count and the hashes of its full blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptBlocks {
    pub tokens: u32,
    pub hashes: Vec<u64>,
}

impl PromptBlocks {
    /// Tokenizes `prompt_text` with the simulator's tokenizer and hashes its full blocks.
    pub fn from_text(prompt_text: &str, block_size: usize) -> Self {
        Self::from_tokens(&switchyard_engine_sim::tokenize(prompt_text), block_size)
    }

    pub fn from_tokens(tokens: &[u32], block_size: usize) -> Self {
        Self {
            tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            hashes: switchyard_engine_sim::cache::block_hashes(tokens, block_size.max(1)),
        }
    }

    /// Leading blocks that may hit: at most `tokens − 1` tokens come from the cache.
    pub fn eligible_blocks(&self, block_size: usize) -> usize {
        (self.tokens.saturating_sub(1) as usize / block_size.max(1)).min(self.hashes.len())
    }
}

/// The oracle bound of a trace on a fleet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct OracleBound {
    pub prompt_tokens: u64,
    pub block_size: usize,
    /// engines × kv_cache_blocks.
    pub capacity_blocks: u64,
    /// Distinct full blocks in the trace (its working set).
    pub distinct_blocks: u64,
    /// Hit tokens allowed by compulsory misses alone.
    pub compulsory_hit_tokens: u64,
    /// Hit tokens of Belady's MIN on the fleet's total capacity.
    pub capacity_hit_tokens: u64,
    /// min of the two.
    pub hit_tokens: u64,
    /// hit_tokens / prompt_tokens.
    pub hit_rate: f64,
}

/// Computes the bound for `prompts` in their nominal order.
pub fn oracle_bound(
    prompts: &[PromptBlocks],
    capacity_blocks: u64,
    block_size: usize,
) -> OracleBound {
    let block_size = block_size.max(1);
    let prompt_tokens: u64 = prompts.iter().map(|prompt| u64::from(prompt.tokens)).sum();

    // Compulsory: per block, (eligible uses, non-eligible uses).
    let mut uses: HashMap<u64, (u64, u64)> = HashMap::new();
    for prompt in prompts {
        let eligible = prompt.eligible_blocks(block_size);
        for (index, hash) in prompt.hashes.iter().enumerate() {
            let entry = uses.entry(*hash).or_default();
            if index < eligible {
                entry.0 += 1;
            } else {
                entry.1 += 1;
            }
        }
    }
    let compulsory_blocks: u64 = uses
        .values()
        .map(|&(eligible, other)| {
            if other == 0 {
                eligible.saturating_sub(1)
            } else {
                eligible
            }
        })
        .sum();

    let references: Vec<u64> = prompts
        .iter()
        .flat_map(|prompt| prompt.hashes.iter().copied())
        .collect();
    let capacity_blocks_hit = belady_hits(&references, capacity_blocks);

    let hit_blocks = compulsory_blocks.min(capacity_blocks_hit);
    let hit_tokens = hit_blocks * block_size as u64;
    OracleBound {
        prompt_tokens,
        block_size,
        capacity_blocks,
        distinct_blocks: uses.len() as u64,
        compulsory_hit_tokens: compulsory_blocks * block_size as u64,
        capacity_hit_tokens: capacity_blocks_hit * block_size as u64,
        hit_tokens,
        hit_rate: if prompt_tokens == 0 {
            0.0
        } else {
            hit_tokens as f64 / prompt_tokens as f64
        },
    }
}

/// Hits of Belady's MIN with bypass on `references` with a cache of `capacity` items.
pub fn belady_hits(references: &[u64], capacity: u64) -> u64 {
    const NEVER: usize = usize::MAX;
    if capacity == 0 {
        return 0;
    }
    // next_use[i]: the index of the next reference to references[i], or NEVER.
    let mut next_use = vec![NEVER; references.len()];
    let mut seen: HashMap<u64, usize> = HashMap::with_capacity(references.len() / 4);
    for (index, hash) in references.iter().enumerate().rev() {
        if let Some(next) = seen.insert(*hash, index) {
            next_use[index] = next;
        }
    }
    drop(seen);

    // The cache: block -> its next use; a max-heap of (next use, block) with stale entries
    // skipped lazily.
    let mut cached: HashMap<u64, usize> = HashMap::new();
    let mut farthest: BinaryHeap<(usize, Reverse<u64>)> = BinaryHeap::new();
    let mut hits = 0;
    for (index, hash) in references.iter().enumerate() {
        let next = next_use[index];
        if let Some(slot) = cached.get_mut(hash) {
            hits += 1;
            *slot = next;
            farthest.push((next, Reverse(*hash)));
            continue;
        }
        if next == NEVER {
            continue; // never used again: not worth a slot
        }
        if cached.len() as u64 >= capacity {
            // Evict the cached block used farthest in the future, unless this one is farther.
            while let Some(&(use_at, Reverse(victim))) = farthest.peek() {
                if cached.get(&victim) != Some(&use_at) {
                    farthest.pop(); // stale
                    continue;
                }
                if use_at > next {
                    farthest.pop();
                    cached.remove(&victim);
                }
                break;
            }
            if cached.len() as u64 >= capacity {
                continue; // bypass: every cached block is needed sooner
            }
        }
        cached.insert(*hash, next);
        farthest.push((next, Reverse(*hash)));
    }
    hits
}

/// Tokenizes and hashes `prompt_texts` on all cores (tokenizing a long trace takes a while).
pub fn prompt_blocks(prompt_texts: &[String], block_size: usize) -> Vec<PromptBlocks> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .max(1);
    let chunk = prompt_texts.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = prompt_texts
            .chunks(chunk)
            .map(|texts| {
                scope.spawn(move || {
                    texts
                        .iter()
                        .map(|text| PromptBlocks::from_text(text, block_size))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|handle| handle.join().unwrap_or_default())
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prompts as token ids; block size 4 keeps the hand arithmetic short.
    fn prompts(token_lists: &[&[u32]]) -> Vec<PromptBlocks> {
        token_lists
            .iter()
            .map(|tokens| PromptBlocks::from_tokens(tokens, 4))
            .collect()
    }

    #[test]
    fn identical_prompts_hit_every_eligible_block_after_the_first() {
        // 9 tokens: 2 full blocks, both eligible (at most 8 tokens from cache).
        let trace = prompts(&[&[1, 2, 3, 4, 5, 6, 7, 8, 9], &[1, 2, 3, 4, 5, 6, 7, 8, 9]]);
        let bound = oracle_bound(&trace, 100, 4);
        assert_eq!(bound.prompt_tokens, 18);
        assert_eq!(bound.distinct_blocks, 2);
        assert_eq!(bound.compulsory_hit_tokens, 8);
        assert_eq!(bound.capacity_hit_tokens, 8);
        assert_eq!(bound.hit_tokens, 8);
        assert!((bound.hit_rate - 8.0 / 18.0).abs() < 1e-12);
    }

    #[test]
    fn the_last_token_is_always_computed() {
        // 8 tokens: 2 full blocks but only the first is eligible (7 tokens at most).
        let trace = prompts(&[&[1, 2, 3, 4, 5, 6, 7, 8], &[1, 2, 3, 4, 5, 6, 7, 8]]);
        let bound = oracle_bound(&trace, 100, 4);
        assert_eq!(bound.compulsory_hit_tokens, 4);
        assert_eq!(bound.hit_tokens, 4);
        // A longer prompt after it can hit both: the first computed (and cached) block 2.
        let trace = prompts(&[&[1, 2, 3, 4, 5, 6, 7, 8], &[1, 2, 3, 4, 5, 6, 7, 8, 9]]);
        let bound = oracle_bound(&trace, 100, 4);
        assert_eq!(bound.compulsory_hit_tokens, 8);
        assert_eq!(bound.hit_tokens, 8);
        // Short prompts never hit.
        let trace = prompts(&[&[1, 2, 3, 4], &[1, 2, 3, 4], &[1, 2, 3]]);
        assert_eq!(oracle_bound(&trace, 100, 4).hit_tokens, 0);
    }

    #[test]
    fn blocks_chain_so_a_different_start_shares_nothing() {
        let trace = prompts(&[&[1, 2, 3, 4, 5, 6, 7, 8, 9], &[0, 2, 3, 4, 5, 6, 7, 8, 9]]);
        let bound = oracle_bound(&trace, 100, 4);
        assert_eq!(bound.distinct_blocks, 4);
        assert_eq!(bound.hit_tokens, 0);
    }

    #[test]
    fn capacity_caps_the_bound() {
        // Two prefixes of one block each, alternating: A B A B A B.
        let a: &[u32] = &[1, 1, 1, 1, 9];
        let b: &[u32] = &[2, 2, 2, 2, 9];
        let trace = prompts(&[a, b, a, b, a, b]);
        let unlimited = oracle_bound(&trace, 2, 4);
        assert_eq!(unlimited.compulsory_hit_tokens, 16); // 4 hits
        assert_eq!(unlimited.hit_tokens, 16);
        // One slot: MIN keeps A (next use sooner), bypasses B: A hits twice.
        let tight = oracle_bound(&trace, 1, 4);
        assert_eq!(tight.capacity_hit_tokens, 8);
        assert_eq!(tight.hit_tokens, 8);
        assert_eq!(oracle_bound(&trace, 0, 4).hit_tokens, 0);
    }

    #[test]
    fn belady_beats_or_ties_lru_on_a_cyclic_pattern() {
        // Cycle of 3 over 2 slots: LRU never hits, MIN hits about half the time.
        let references: Vec<u64> = (0..30).map(|i| i % 3).collect();
        let hits = belady_hits(&references, 2);
        assert!(hits >= 13, "{hits}");
        assert_eq!(belady_hits(&references, 3), 27);
    }

    #[test]
    fn the_simulators_block_rule_matches() {
        // A 17-token prompt can hit 16 (one block of 16); a 16-token one cannot hit.
        let tokens: Vec<u32> = (0..17).collect();
        let prompt = PromptBlocks::from_tokens(&tokens, 16);
        assert_eq!(prompt.hashes.len(), 1);
        assert_eq!(prompt.eligible_blocks(16), 1);
        let prompt = PromptBlocks::from_tokens(&tokens[..16], 16);
        assert_eq!(prompt.eligible_blocks(16), 0);
    }
}
