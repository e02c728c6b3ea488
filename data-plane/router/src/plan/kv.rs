//! KV_AWARE's ranking once the prompt's token ids are known: how many leading blocks of the
//! prompt each instance holds by the variant's KV index (`switchyard_kv`), weighed against load
//! (`policy::kv::rank_kv`). Pure: the index, the ids and the instances' load cells in, a
//! ranking out.

use switchyard_kv::{ChainKey, TokenMatch, VariantIndex};
use switchyard_policy::rank::{Route, Strategy};
use switchyard_shared::InstanceId;

use super::planned::Plan;
use crate::observe::labels::RouteLabel;
use crate::routing::table::VariantRoute;

/// A KV_AWARE decision for one request: the ranking, and what the first choice holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvDecision {
    pub ranking: switchyard_policy::Ranking,
    /// Leading prompt tokens the first choice holds (`x-switchyard-cached-tokens`).
    pub cached_tokens: u32,
    /// Full blocks of the prompt (0 when the decision fell back to load).
    pub prompt_blocks: u32,
    /// Leading prompt tokens each instance holds, by position in the variant's instances
    /// (empty when the decision fell back to load): what a retry's instance holds.
    pub cached_tokens_by_instance: Vec<u32>,
    /// A data-parallel instance's rank holding those tokens, by position (None: not data
    /// parallel, or no rank holds any; empty when the decision fell back to load).
    pub ranks_by_instance: Vec<Option<u32>>,
}

/// A prompt's match against a variant's index, per instance: a data-parallel instance holds
/// what its best rank holds, and that rank is named (ties between ranks broken by `random`;
/// None where no rank holds a block, so that the engine's own balancer picks). None before
/// the block size is known.
pub fn match_instances(
    variant: &VariantRoute,
    index: &VariantIndex,
    tokens: &[u32],
    chain: ChainKey<'_>,
    random: u64,
) -> Option<(TokenMatch, Vec<Option<u32>>)> {
    let count = variant.instances.len();
    let mut sources: Vec<InstanceId> = Vec::with_capacity(count);
    // (instance position, rank) of each source.
    let mut owners: Vec<(usize, Option<u32>)> = Vec::with_capacity(count);
    for (position, instance) in variant.instances.iter().enumerate() {
        if instance.data_parallel_ranks.is_empty() {
            sources.push(instance.id.clone());
            owners.push((position, None));
        } else {
            sources.extend(instance.data_parallel_ranks.iter().cloned());
            owners.extend(
                (0..instance.data_parallel_ranks.len() as u32).map(|r| (position, Some(r))),
            );
        }
    }
    let mut found = index.match_prompt(tokens, chain, &sources)?;
    let mut ranks = vec![None; count];
    if sources.len() == count {
        return Some((found, ranks));
    }
    let mut matched = vec![0u32; count];
    let mut ties = vec![0u64; count];
    let mut draw = random;
    for (&(position, rank), &held) in owners.iter().zip(&found.matched) {
        if held == 0 || held < matched[position] {
            continue;
        }
        if held > matched[position] {
            matched[position] = held;
            ties[position] = 0;
        }
        // One uniform choice among the ranks holding the most (reservoir sampling).
        ties[position] += 1;
        draw = draw
            .wrapping_mul(0x5851_F42D_4C95_7F2D)
            .wrapping_add(0x1405_7B7E_F767_814F);
        if (draw >> 33).is_multiple_of(ties[position]) {
            ranks[position] = rank;
        }
    }
    found.matched = matched;
    Some((found, ranks))
}

/// Prompts longer than this are matched against the index on a blocking thread: hashing and
/// walking 64 K tokens takes about 0.4 ms when one instance holds them all (STYLE habit 9).
pub const OFFLOAD_TOKENS: usize = 64 * 1024;

/// Ranks a KV_AWARE variant's instances (or a disaggregated endpoint's KV_AWARE prefill pool,
/// with the variant's KvAwareRoutingConfig if its own strategy is KV_AWARE, else the defaults)
/// for a request whose token ids are `tokens` (None: they could not be had), hashed under
/// `chain` (its LoRA adapter and `cache_salt`), from the
/// variant's index (None: no instance has published yet). Without tokens, index or a known
/// block size this is LEAST_OUTSTANDING_REQUESTS. Loads and
/// availability are read from the instances' cells; `random` breaks load ties.
pub fn decide(
    variant: &VariantRoute,
    index: Option<&VariantIndex>,
    tokens: Option<&[u32]>,
    chain: ChainKey<'_>,
    now_ms: u64,
    random: u64,
) -> KvDecision {
    let views = variant.current_views(now_ms);
    let load = |position: usize| variant.instances[position].cell.fleet_load();
    let params = match variant.strategy {
        Strategy::KvAware {
            concurrency_threshold,
            load_weight,
        } => switchyard_policy::kv::KvParams {
            concurrency_threshold,
            load_weight,
        },
        _ => switchyard_policy::kv::KvParams {
            concurrency_threshold: switchyard_shared::DEFAULT_KV_CONCURRENCY_THRESHOLD,
            load_weight: switchyard_shared::DEFAULT_KV_LOAD_WEIGHT,
        },
    };
    let by_load = || KvDecision {
        ranking: switchyard_policy::rank::rank(
            Strategy::LeastOutstandingRequests,
            &views,
            load,
            0,
            random,
        ),
        cached_tokens: 0,
        prompt_blocks: 0,
        cached_tokens_by_instance: Vec::new(),
        ranks_by_instance: Vec::new(),
    };
    let (Some(index), Some(tokens)) = (index, tokens) else {
        return by_load();
    };
    let Some((found, ranks_by_instance)) = match_instances(variant, index, tokens, chain, random)
    else {
        return by_load();
    };
    let ranking = switchyard_policy::kv::rank_kv(
        params,
        &views,
        load,
        &found.matched,
        found.blocks,
        found.prefix_key,
        random,
    );
    let block_size = found.block_size as u32;
    let cached_tokens_by_instance: Vec<u32> = found
        .matched
        .iter()
        .map(|blocks| blocks * block_size)
        .collect();
    KvDecision {
        cached_tokens: ranking
            .first()
            .map_or(0, |first| cached_tokens_by_instance[first]),
        ranking,
        prompt_blocks: found.blocks,
        cached_tokens_by_instance,
        ranks_by_instance,
    }
}

/// Ranks a KV_AWARE plan's variant by its KV `index` with the prompt's `tokens` (None: they
/// could not be had, and the plan is ranked by load as of now).
pub(crate) fn finish(
    plan: Plan,
    index: &VariantIndex,
    tokens: Option<&[u32]>,
    chain: ChainKey<'_>,
    now_ms: u64,
    random: u64,
) -> Plan {
    let decision = decide(
        plan.variant(),
        tokens.map(|_| index),
        tokens,
        chain,
        now_ms,
        random,
    );
    apply(plan, decision)
}

/// The plan ranked as `decision` says.
pub(crate) fn apply(mut plan: Plan, decision: KvDecision) -> Plan {
    plan.ranking = decision.ranking;
    plan.label = RouteLabel::from(plan.ranking.route.unwrap_or(Route::LeastOutstanding));
    plan.cached_tokens = decision.cached_tokens_by_instance;
    plan.data_parallel_ranks = decision.ranks_by_instance;
    plan
}
