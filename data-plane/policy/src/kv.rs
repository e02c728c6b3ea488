//! KV_AWARE: the router's own block hashes over token ids, and the choice between instances
//! from how many leading blocks of the prompt each one holds (known from the engines' KV-cache
//! events) and how busy each one is.
//!
//! ## Block hashes (router-owned, golden-tested)
//!
//! Engines hash their blocks with their own function and seed (vLLM: `sha256` or Python's
//! `hash`, salted by `PYTHONHASHSEED`), so a router cannot recompute them. It keeps its own
//! chain over the token ids that every `BlockStored` event carries:
//!
//! - chain seed = `xxh3_64("switchyard-kv-v1")` for the base model, or
//!   `xxh3_64("switchyard-kv-v1" ‖ 0x00 ‖ LoRA name)` for blocks of a LoRA adapter;
//! - block hash = `xxh3_64_with_seed(u32_le(token ids of the block), parent hash)`, where the
//!   parent of the first block is the chain seed. Equal blocks after different prefixes hash
//!   differently, so "block `j` is held" means "the first `j + 1` blocks are held";
//! - a request's `cache_salt` (vLLM's request field; SGLang publishes salted blocks too)
//!   changes the parent of the chain's first block to [`salted_seed`]`(seed, salt)` =
//!   `xxh3_64_with_seed("switchyard-kv-salt-v1" ‖ 0x00 ‖ salt, seed)`, as vLLM mixes the salt
//!   into the first block's hash only (every later block follows from it);
//! - a block the engine hashed with other extra keys (multimodal inputs, prompt embeddings)
//!   gets [`unmatchable_block_hash`]: a request's plain token ids never reach it, nor its
//!   children.
//!
//! Only full blocks are hashed (a trailing partial block is never cached by the engine).
//!
//! ## The choice ([`rank_kv`])
//!
//! With `B` the request's full blocks, `m_i` the leading blocks instance `i` holds, `L_i` its
//! fleet-wide in-flight requests, `T` the `ConcurrencyThreshold` and `w` the `LoadWeight`:
//!
//! 1. The candidates are the available instances with `L_i < T`.
//! 2. If a candidate holds at least one block, candidates are ordered by
//!    `score_i = m_i / B − w · L_i / T` (best first; ties: lower load, then rendezvous order of
//!    the request's prefix key, so every router breaks them alike). The first is the choice:
//!    route `kv` when it holds blocks, else `least-outstanding` (a holder lost on load).
//! 3. Otherwise (nobody below the threshold holds the prompt's start) the order is
//!    LEAST_OUTSTANDING_REQUESTS', as SageMaker describes KV_AWARE.
//!
//! Instances not ranked in step 2 follow in LEAST_OUTSTANDING_REQUESTS order, so retries go to
//! the least loaded. `m_i / B` is the share of the prompt that skips prefill there; `L_i / T`
//! is how close the instance is to the point where it stops being preferred. With the default
//! `w = 0.5`, a holder of the whole prompt keeps winning against an idle non-holder until it
//! reaches the threshold, and a holder of a fifth of it loses once it runs `0.4 T` requests.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::hash::rendezvous_score;
use crate::rank::{InstanceView, Ranking, Route, Strategy, rank};

const CHAIN_DOMAIN: &[u8] = b"switchyard-kv-v1";
const SALT_DOMAIN: &[u8] = b"switchyard-kv-salt-v1";
/// Mixed into the parent of a block hashed with extra keys.
const UNMATCHABLE: u64 = 0x9e37_79b9_7f4a_7c15;
/// At most this many leading blocks form the prefix key that breaks score ties.
pub const PREFIX_KEY_BLOCKS: usize = 64;

/// The parent hash of a chain's first block: the base model's, or a LoRA adapter's.
pub fn chain_seed(lora_name: Option<&str>) -> u64 {
    match lora_name {
        None => xxh3_64(CHAIN_DOMAIN),
        Some(name) => {
            let mut bytes = Vec::with_capacity(CHAIN_DOMAIN.len() + 1 + name.len());
            bytes.extend_from_slice(CHAIN_DOMAIN);
            bytes.push(0);
            bytes.extend_from_slice(name.as_bytes());
            xxh3_64(&bytes)
        }
    }
}

/// The parent of a salted chain's first block: `seed` (the base model's or an adapter's) mixed
/// with the request's `cache_salt`.
pub fn salted_seed(seed: u64, salt: &str) -> u64 {
    let mut bytes = Vec::with_capacity(SALT_DOMAIN.len() + 1 + salt.len());
    bytes.extend_from_slice(SALT_DOMAIN);
    bytes.push(0);
    bytes.extend_from_slice(salt.as_bytes());
    xxh3_64_with_seed(&bytes, seed)
}

/// The router's hash of one full block after `parent`.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut bytes = [0u8; 4 * 64];
    if tokens.len() <= 64 {
        for (slot, token) in bytes.chunks_exact_mut(4).zip(tokens) {
            slot.copy_from_slice(&token.to_le_bytes());
        }
        return xxh3_64_with_seed(&bytes[..tokens.len() * 4], parent);
    }
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|token| token.to_le_bytes())
        .collect();
    xxh3_64_with_seed(&bytes, parent)
}

/// The hash of a block the engine hashed with extra keys: no plain token chain reaches it.
pub fn unmatchable_block_hash(parent: u64, tokens: &[u32]) -> u64 {
    block_hash(parent ^ UNMATCHABLE, tokens) ^ UNMATCHABLE
}

/// Appends the chained hashes of the full blocks of `tokens` (from `seed`) to `out`.
pub fn chain_hashes(seed: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    let block_size = block_size.max(1);
    out.reserve(tokens.len() / block_size);
    let mut parent = seed;
    for block in tokens.chunks_exact(block_size) {
        parent = block_hash(parent, block);
        out.push(parent);
    }
}

/// The key that breaks score ties: the hash of the first [`PREFIX_KEY_BLOCKS`] blocks (or of
/// all of them if fewer), so requests sharing a long start break ties alike on every router.
pub fn prefix_key(hashes: &[u64]) -> u64 {
    hashes
        .get(hashes.len().min(PREFIX_KEY_BLOCKS).wrapping_sub(1))
        .copied()
        .unwrap_or(0)
}

/// KV_AWARE's knobs (`KvAwareRoutingConfig`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvParams {
    pub concurrency_threshold: u32,
    pub load_weight: f64,
}

impl From<KvParams> for Strategy {
    fn from(params: KvParams) -> Self {
        Strategy::KvAware {
            concurrency_threshold: params.concurrency_threshold,
            load_weight: params.load_weight,
        }
    }
}

/// Ranks instances for a request of `total_blocks` full blocks, of which instance `i` holds
/// the first `matched_blocks[i]` (0 for an instance whose index is stale or unknown), by the
/// formula in the module documentation. `key` is [`prefix_key`], `random` breaks the ties of
/// the LEAST_OUTSTANDING_REQUESTS part. Pure: the caller counts load, retries and metrics.
pub fn rank_kv(
    params: KvParams,
    instances: &[InstanceView],
    load: impl Fn(usize) -> u32,
    matched_blocks: &[u32],
    total_blocks: u32,
    key: u64,
    random: u64,
) -> Ranking {
    let loads: Vec<u32> = (0..instances.len()).map(load).collect();
    let matched = |index: usize| matched_blocks.get(index).copied().unwrap_or(0);
    let threshold = params.concurrency_threshold.max(1);
    let candidates: Vec<usize> = (0..instances.len())
        .filter(|&index| instances[index].available && loads[index] < threshold)
        .collect();
    let least_outstanding = rank(
        Strategy::LeastOutstandingRequests,
        instances,
        |index| loads[index],
        key,
        random,
    );
    if !candidates.iter().any(|&index| matched(index) > 0) {
        return least_outstanding;
    }
    let blocks = f64::from(total_blocks.max(1));
    let score = |index: usize| {
        f64::from(matched(index)) / blocks
            - params.load_weight * f64::from(loads[index]) / f64::from(threshold)
    };
    let mut order = candidates;
    order.sort_by(|&a, &b| {
        score(b)
            .total_cmp(&score(a))
            .then(loads[a].cmp(&loads[b]))
            .then(
                rendezvous_score(key, instances[b].id_hash, instances[b].weight).total_cmp(
                    &rendezvous_score(key, instances[a].id_hash, instances[a].weight),
                ),
            )
            .then(a.cmp(&b))
    });
    let route = if matched(order[0]) > 0 {
        Route::Kv
    } else {
        Route::LeastOutstanding
    };
    let ranked = order.len();
    for index in least_outstanding.order {
        if !order[..ranked].contains(&index) {
            order.push(index);
        }
    }
    Ranking {
        order,
        route: Some(route),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rank::views;
    use proptest::prelude::{ProptestConfig, any, prop_assert, prop_assert_eq, proptest};

    const PARAMS: KvParams = KvParams {
        concurrency_threshold: 10,
        load_weight: 0.5,
    };

    /// Golden vectors: routers of different versions must hash blocks alike. Cross-checked
    /// with Python's `xxhash` package: `xxh3_64_intdigest(b"switchyard-kv-v1")` and
    /// `xxh3_64_intdigest(struct.pack("<4I", 1, 2, 3, 4), seed)`.
    #[test]
    fn golden_vectors() {
        let seed = chain_seed(None);
        assert_eq!(seed, xxh3_64(b"switchyard-kv-v1"));
        assert_eq!(seed, 0x3971_4a71_6ab1_c281);
        assert_eq!(block_hash(seed, &[1, 2, 3, 4]), 0x4354_4985_3e2b_203b);
        assert_ne!(chain_seed(Some("adapter")), seed);
        let mut hashes = Vec::new();
        chain_hashes(seed, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, &mut hashes);
        assert_eq!(hashes.len(), 2, "the partial block is not hashed");
        assert_eq!(hashes[0], block_hash(seed, &[1, 2, 3, 4]));
        assert_eq!(hashes[1], block_hash(hashes[0], &[5, 6, 7, 8]));
        assert_ne!(unmatchable_block_hash(seed, &[1, 2, 3, 4]), hashes[0]);
        assert_eq!(
            salted_seed(seed, "tenant-a"),
            GOLDEN_SALTED_SEED,
            "a salted chain: every router version must place it alike"
        );
        assert_eq!(
            salted_seed(seed, "tenant-a"),
            xxh3_64_with_seed(b"switchyard-kv-salt-v1\x00tenant-a", seed)
        );
        assert_ne!(salted_seed(seed, "tenant-b"), GOLDEN_SALTED_SEED);
        assert_eq!(
            unmatchable_block_hash(seed, &[1, 2, 3, 4]),
            GOLDEN_UNMATCHABLE,
            "a block hashed with extra keys: every router version must place it alike"
        );
        // Every block size an engine publishes (vLLM's --block-size, SGLang's page_size)
        // hashes the block's bytes, whichever path it takes.
        for size in [1usize, 16, 17, 18, 32, 63, 64, 65, 100, 128, 256] {
            let block: Vec<u32> = (0..size as u32).collect();
            let bytes: Vec<u8> = block.iter().flat_map(|token| token.to_le_bytes()).collect();
            assert_eq!(
                block_hash(7, &block),
                xxh3_64_with_seed(&bytes, 7),
                "{size}"
            );
        }
    }

    /// `salted_seed(chain_seed(None), "tenant-a")`, i.e. xxh3-64 of
    /// `b"switchyard-kv-salt-v1\x00tenant-a"` seeded with the base chain seed.
    const GOLDEN_SALTED_SEED: u64 = 0xb304_2616_f74d_5cf1;

    /// `unmatchable_block_hash(chain_seed(None), &[1, 2, 3, 4])`.
    const GOLDEN_UNMATCHABLE: u64 = 0xa0f0_3f26_5783_c290;

    #[test]
    fn prefix_key_covers_at_most_the_first_blocks() {
        assert_eq!(prefix_key(&[]), 0);
        assert_eq!(prefix_key(&[5, 6]), 6);
        let many: Vec<u64> = (0..100).collect();
        assert_eq!(prefix_key(&many), 63);
    }

    #[test]
    fn the_holder_wins_until_its_load_outweighs_its_match() {
        let instances = views(3);
        // Instance 1 holds all 10 blocks, instance 2 holds 2.
        let matched = [0, 10, 2];
        let ranking = rank_kv(PARAMS, &instances, |_| 0, &matched, 10, 1, 2);
        assert_eq!(ranking.first(), Some(1));
        assert_eq!(ranking.route, Some(Route::Kv));
        assert_eq!(ranking.order.len(), 3);
        // At 9 of 10 in flight the full holder still wins: 1 - 0.45 > 0.2.
        let ranking = rank_kv(PARAMS, &instances, |i| [0, 9, 0][i], &matched, 10, 1, 2);
        assert_eq!(ranking.first(), Some(1));
        // The partial holder at load 5 (0.2 - 0.25 < 0) loses to the idle non-holder.
        let ranking = rank_kv(PARAMS, &instances, |i| [0, 10, 5][i], &matched, 10, 1, 2);
        assert_eq!(ranking.first(), Some(0));
        assert_eq!(ranking.route, Some(Route::LeastOutstanding));
    }

    #[test]
    fn a_saturated_holder_loses_to_an_idle_non_holder() {
        let instances = views(2);
        let ranking = rank_kv(PARAMS, &instances, |i| [10, 0][i], &[10, 0], 10, 1, 2);
        assert_eq!(ranking.first(), Some(1));
        assert_eq!(ranking.route, Some(Route::LeastOutstanding));
        assert_eq!(ranking.order, vec![1, 0]);
    }

    #[test]
    fn no_holder_below_the_threshold_means_least_outstanding() {
        let instances = views(4);
        let loads = [3, 1, 2, 5];
        let ranking = rank_kv(PARAMS, &instances, |i| loads[i], &[0; 4], 10, 1, 2);
        let expected = rank(
            Strategy::LeastOutstandingRequests,
            &instances,
            |i| loads[i],
            1,
            2,
        );
        assert_eq!(ranking, expected);
        assert_eq!(ranking.order, vec![1, 2, 0, 3]);
        // Equal loads: exactly LEAST_OUTSTANDING_REQUESTS, whose ties follow the random draw
        // (not the prefix key, as scored ties do).
        for random in 0..32 {
            let ranking = rank_kv(PARAMS, &instances, |_| 2, &[0; 4], 10, 1, random);
            let expected = rank(
                Strategy::LeastOutstandingRequests,
                &instances,
                |_| 2,
                1,
                random,
            );
            assert_eq!(ranking, expected, "random {random}");
        }
    }

    #[test]
    fn ejected_holders_are_not_chosen_first() {
        let mut instances = views(2);
        instances[0].available = false;
        let ranking = rank_kv(PARAMS, &instances, |_| 0, &[8, 0], 8, 1, 2);
        assert_eq!(ranking.first(), Some(1));
        assert_eq!(ranking.order, vec![1, 0]);
    }

    #[test]
    fn equal_scores_break_ties_by_the_prefix_key_on_every_router() {
        let instances = views(6);
        let firsts: std::collections::HashSet<usize> = (0..50u64)
            .map(|key| {
                let a = rank_kv(PARAMS, &instances, |_| 0, &[4; 6], 4, key, 1)
                    .first()
                    .unwrap();
                let b = rank_kv(PARAMS, &instances, |_| 0, &[4; 6], 4, key, 99)
                    .first()
                    .unwrap();
                assert_eq!(a, b, "the random draw must not break score ties");
                a
            })
            .collect();
        assert!(firsts.len() > 3, "different prefixes spread: {firsts:?}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn every_instance_appears_once_and_the_choice_is_below_the_threshold_when_possible(
            loads in proptest::collection::vec(0u32..20, 1..20),
            matched in proptest::collection::vec(0u32..12, 20),
            key in any::<u64>(),
        ) {
            let instances = views(loads.len());
            let ranking = rank_kv(PARAMS, &instances, |i| loads[i], &matched, 12, key, 3);
            let mut sorted = ranking.order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..loads.len()).collect::<Vec<_>>());
            let first = ranking.first().unwrap();
            if loads.iter().any(|load| *load < 10) {
                prop_assert!(loads[first] < 10);
            }
            if ranking.route == Some(Route::Kv) {
                prop_assert!(matched[first] > 0);
            }
        }

        #[test]
        fn routers_with_the_same_view_choose_alike(
            loads in proptest::collection::vec(0u32..12, 2..12),
            matched in proptest::collection::vec(1u32..8, 12),
            key in any::<u64>(),
        ) {
            // Holders everywhere: the choice must not depend on the per-request draw.
            let instances = views(loads.len());
            let a = rank_kv(PARAMS, &instances, |i| loads[i], &matched, 8, key, 1);
            let b = rank_kv(PARAMS, &instances, |i| loads[i], &matched, 8, key, 2);
            if a.route == Some(Route::Kv) {
                prop_assert_eq!(a.first(), b.first());
            }
        }
    }
}
