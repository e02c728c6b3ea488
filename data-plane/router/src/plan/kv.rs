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

/// A prompt's match against a variant's index, per instance. A data-parallel instance's
/// ranks are ranked among themselves by KV_AWARE's formula (`policy::kv::rank_kv` with
/// `params`: the blocks each rank holds against the requests this router has in flight on
/// it): the instance holds what the chosen rank holds, and that rank is named. Where the
/// formula chooses by load instead (no rank below the threshold holds a block, or the load
/// outweighs what it holds) no rank is named and the instance is credited with nothing: the
/// engine's own balancer, which sees every rank's load, picks. None before the block size is
/// known.
pub fn match_instances(
    variant: &VariantRoute,
    index: &VariantIndex,
    tokens: &[u32],
    chain: ChainKey<'_>,
    params: switchyard_policy::kv::KvParams,
    random: u64,
) -> Option<(TokenMatch, Vec<Option<u32>>)> {
    let count = variant.instances.len();
    let mut sources: Vec<InstanceId> = Vec::with_capacity(count);
    for instance in &variant.instances {
        if instance.data_parallel_ranks.is_empty() {
            sources.push(instance.id.clone());
        } else {
            sources.extend(instance.data_parallel_ranks.iter().cloned());
        }
    }
    let mut found = index.match_prompt(tokens, chain, &sources)?;
    let mut ranks = vec![None; count];
    if sources.len() == count {
        return Some((found, ranks));
    }
    let mut matched = Vec::with_capacity(count);
    let mut at = 0;
    for (position, instance) in variant.instances.iter().enumerate() {
        let size = instance.data_parallel_ranks.len();
        if size == 0 {
            matched.push(found.matched[at]);
            at += 1;
            continue;
        }
        let held = &found.matched[at..at + size];
        at += size;
        let loads = instance.cell.rank_load.loads(size);
        let ranking = switchyard_policy::kv::rank_kv(
            params,
            &instance.data_parallel_views,
            |rank| loads[rank],
            held,
            found.blocks,
            found.prefix_key,
            random,
        );
        match (ranking.route, ranking.order.first()) {
            (Some(Route::Kv), Some(&rank)) => {
                matched.push(held[rank]);
                ranks[position] = Some(rank as u32);
            }
            _ => matched.push(0),
        }
    }
    found.matched = matched;
    Some((found, ranks))
}

/// KV_AWARE's knobs for `variant`: its own KvAwareRoutingConfig, or the defaults (a
/// disaggregated pool ranked by another strategy).
pub fn params(variant: &VariantRoute) -> switchyard_policy::kv::KvParams {
    match variant.strategy {
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
    }
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
    let params = params(variant);
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
    let Some((found, ranks_by_instance)) =
        match_instances(variant, index, tokens, chain, params, random)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use switchyard_kv::wire::{BlockStored, EngineHash, EventBatch, KvEvent};
    use switchyard_kv::{IndexCounters, IndexSettings};

    /// A KV_AWARE endpoint of one data-parallel instance with `ranks` ranks.
    fn data_parallel(ranks: u32) -> Arc<crate::routing::table::EndpointRoute> {
        let yaml = format!(
            "Endpoints:\n  - EndpointName: chat\n    ProductionVariants:\n      - {{VariantName: v, RoutingConfig: {{RoutingStrategy: KV_AWARE}}}}\n    Instances:\n      - {{Url: 'http://127.0.0.1:9', InstanceId: e0, KvEvents: 'tcp://127.0.0.1:5557', KvEventsDataParallelSize: {ranks}}}\n"
        );
        Arc::clone(&crate::routing::membership::static_table(&yaml).endpoints["chat"])
    }

    /// `rank` of e0 holds the first `blocks` blocks of 2 tokens of `tokens`.
    fn hold(index: &VariantIndex, rank: u32, tokens: &[u32], blocks: usize) {
        let source = InstanceId::new("e0").unwrap().data_parallel_rank(rank);
        let stored = KvEvent::BlockStored(BlockStored {
            block_hashes: (0..blocks as u64)
                .map(|j| EngineHash(1000 * u64::from(rank) + j))
                .collect(),
            token_ids: tokens[..blocks * 2].to_vec(),
            block_size: 2,
            medium: Some("GPU".into()),
            ..BlockStored::default()
        });
        let batch = EventBatch {
            ts: 0.0,
            events: vec![stored],
            data_parallel_rank: Some(i64::from(rank)),
        };
        index.apply(
            &source,
            &batch,
            &IndexSettings::default(),
            &IndexCounters::default(),
        );
    }

    #[test]
    fn a_rank_holding_a_prefix_is_chosen_until_its_load_outweighs_what_it_holds() {
        let endpoint = data_parallel(4);
        let variant = &endpoint.variants[0];
        let index = VariantIndex::default();
        let tokens: Vec<u32> = (1..=41).collect(); // 20 full blocks, and one token more
        let shared: Vec<u32> = (1..=2).chain(500..539).collect(); // shares the first block
        hold(&index, 2, &tokens, 20);
        let params = params(variant);
        let choose = |prompt: &[u32]| {
            let (found, ranks) =
                match_instances(variant, &index, prompt, ChainKey::default(), params, 7).unwrap();
            (found.matched[0], ranks[0])
        };
        assert_eq!(choose(&tokens), (20, Some(2)), "the whole prompt's rank");
        let loads = &variant.instances[0].cell.rank_load;
        // One shared block does not outweigh one request in flight there: no rank is named,
        // and vLLM's balancer spreads the prompts that only share a preamble.
        loads.add(2);
        assert_eq!(choose(&shared), (0, None));
        // A whole prompt does, until the rank has ConcurrencyThreshold requests in flight.
        assert_eq!(choose(&tokens), (20, Some(2)));
        for _ in 1..params.concurrency_threshold {
            loads.add(2);
        }
        assert_eq!(choose(&tokens), (0, None));
        // A second rank holding it too takes over.
        hold(&index, 0, &tokens, 20);
        assert_eq!(choose(&tokens), (20, Some(0)));
        // A prompt no rank holds: no rank named.
        assert_eq!(choose(&(900..941).collect::<Vec<u32>>()), (0, None));
    }
}
