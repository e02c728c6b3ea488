//! A disaggregated endpoint's decision for one request: a decoder serves it whole (`direct`),
//! or a prefill instance first (`disaggregated`), or the decoder serves it whole because no
//! prefill instance is routable (`fallback`). Below `RouteThreshold` (and for native bodies,
//! which are not parsed, a completions batch of several prompts, and every operation but chat
//! and completions) it is `direct`.
//! PROMPT_TOKENS decides at planning on the router's own count of the prompt
//! ([`super::count`]); UNCACHED_TOKENS needs the prompt's token ids and the decoders' KV index,
//! so it only counts at planning and decides in [`finish`]; a KV_AWARE prefill pool is ranked
//! by load until [`finish`] ranks it by its KV index.

use std::sync::Arc;

use http::{HeaderName, HeaderValue};
use switchyard_kv::{ChainKey, VariantIndex};
use switchyard_policy::hash::routing_key;
use switchyard_policy::openai::OpenAiRequest;
use switchyard_shared::{KvTransferProtocol, PrefillRoutingStrategy, ThresholdBasis};

use super::count::{Count, TokenCounters, count_prompt};
use super::planned::{Plan, PrefillHop};
use super::rank::{self, PrefillKey};
use super::target::{RoutingHeaders, Target};
use crate::headers::PROMPT_TOKENS;
use crate::observe::labels::RouteLabel;
use crate::operation::Operation;
use crate::routing::table::{Disaggregation, EndpointRoute};

/// What a disaggregated endpoint does with one request, as far as planning can tell.
#[derive(Debug)]
pub(super) struct Split {
    pub label: RouteLabel,
    pub explain: Vec<(HeaderName, HeaderValue)>,
    /// The prefill to do first (its `prefill_body` made with the engine's body).
    pub prefill_hop: Option<PrefillHop>,
    /// The token ids are needed to finish the plan: the decision itself (UNCACHED_TOKENS, with
    /// the router's own count), or the KV_AWARE prefill ranking.
    pub pending: Option<Pending>,
}

/// What [`finish`] does once the token ids are known (or known to be unavailable).
#[derive(Debug)]
pub(crate) struct Pending {
    /// UNCACHED_TOKENS: the prompt as the router counted it, for when the token ids cannot be
    /// had (then every token counts as uncached). Until the decision is made the plan reads
    /// `direct`.
    pub undecided: Option<Count>,
    /// What ranking the prefill pool needs besides the token ids.
    pub prefill_key: PrefillKey,
    /// LMCACHE_PD: the hops are made of the token ids.
    pub token_ids: bool,
}

/// Decides what planning can for a request to `target` (a disaggregated endpoint) on
/// `operation`: the count against the threshold, the prefill ranking. Draws one number from
/// `rng` when it ranks the prefill pool.
pub(super) fn split(
    target: &Target<'_>,
    operation: Operation,
    body: &[u8],
    counters: &TokenCounters,
    rng: &mut fastrand::Rng,
) -> Option<Split> {
    let endpoint = &target.endpoint;
    let pd = endpoint.disaggregation.as_ref()?;
    // Chat and completions prompts are counted against the threshold; every other operation
    // (and native bodies, which are not parsed) goes straight to a decoder.
    // A batch of completions prompts too: an engine hands off only its first prompt's KV.
    let Some(request) = target
        .openai
        .as_ref()
        .filter(|request| operation.is_generation() && !request.is_prompt_batch())
    else {
        return Some(Split {
            label: RouteLabel::Direct,
            explain: Vec::new(),
            prefill_hop: None,
            pending: None,
        });
    };
    let count = count_prompt(request, &counters.get(&pd.tokenizer), pd.threshold);
    let explain = vec![prompt_tokens_header(&count)];
    let lmcache_pd = pd.protocol == KvTransferProtocol::LmcachePd;
    // LMCACHE_PD carries a request through completions over token ids: only what that
    // carries losslessly goes this way.
    if lmcache_pd {
        let parsed = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body);
        let why = match &parsed {
            Ok(object) => {
                super::lmcache::carriable(object, operation == Operation::ChatCompletions)
            }
            Err(_) => Some("not a JSON object"),
        };
        if let Some(why) = why {
            tracing::debug!(why, "LMCACHE_PD cannot carry this request; it goes direct");
            return Some(Split {
                label: RouteLabel::Direct,
                explain,
                prefill_hop: None,
                pending: None,
            });
        }
    }
    let prefill = &endpoint.variants[pd.prefill];
    let decided = |label| Split {
        label,
        explain: explain.clone(),
        prefill_hop: None,
        pending: None,
    };
    if pd.basis == ThresholdBasis::UncachedTokens {
        return Some(Split {
            pending: Some(Pending {
                undecided: Some(count),
                prefill_key: prefill_key(endpoint, pd, &target.routing, request),
                token_ids: lmcache_pd,
            }),
            ..decided(RouteLabel::Direct)
        });
    }
    if count.tokens < pd.threshold {
        return Some(decided(RouteLabel::Direct));
    }
    if prefill.instances.is_empty() {
        return Some(decided(RouteLabel::Fallback));
    }
    let key = prefill_key(endpoint, pd, &target.routing, request);
    Some(Split {
        label: RouteLabel::Disaggregated,
        explain,
        prefill_hop: Some(PrefillHop {
            prefill: rank::prefill(prefill, pd, &key, rng.u64(..)),
            count,
            prefill_cached_tokens: Vec::new(),
            prefill_ranks: Vec::new(),
            prefill_body: None,
            token_ids: None,
        }),
        pending: (pd.prefill_strategy == PrefillRoutingStrategy::KvAware || lmcache_pd).then_some(
            Pending {
                undecided: None,
                prefill_key: key,
                token_ids: lmcache_pd,
            },
        ),
    })
}

/// What the prefill strategies read from the request: the session, and PREFIX_AWARE's key
/// (the prefix-aware id and the prefill variant's PrefixLength of the prompt).
fn prefill_key(
    endpoint: &EndpointRoute,
    pd: &Disaggregation,
    routing: &RoutingHeaders,
    request: &OpenAiRequest<'_>,
) -> PrefillKey {
    let prefix = match pd.prefill_strategy {
        PrefillRoutingStrategy::PrefixAware => {
            let id = routing.prefix_aware_id.as_deref().unwrap_or("").as_bytes();
            let length = endpoint.variants[pd.prefill].prefix_length;
            routing_key(id, request.prefix_text(length).as_bytes())
        }
        _ => 0,
    };
    PrefillKey {
        session: routing.session,
        prefix,
    }
}

fn prompt_tokens_header(count: &Count) -> (HeaderName, HeaderValue) {
    (
        PROMPT_TOKENS,
        HeaderValue::from_str(&count.header_text()).unwrap_or(HeaderValue::from_static("0")),
    )
}

/// What the KV indexes of a disaggregated endpoint's pools say (None: not read, or no engine
/// of the pool has published yet).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PoolIndexes<'a> {
    /// The decode pool's (UNCACHED_TOKENS).
    pub decode: Option<&'a VariantIndex>,
    /// The prefill pool's (KV_AWARE prefill).
    pub prefill: Option<&'a VariantIndex>,
}

/// Finishes a disaggregated `plan` as `pending` says with the prompt's token ids (`None`: they
/// could not be had, or no index needed them). CPU only.
///
/// UNCACHED_TOKENS: the prompt's tokens (the token ids' count; without them the router's own
/// count) minus the leading tokens the decoder that would serve the request directly (the
/// first of the decode ranking) holds by the decode pool's index (none without token ids or
/// index) decide: below the threshold `direct`, else `disaggregated` (or `fallback` with no
/// prefill instance). `x-switchyard-cached-tokens` then says what the serving decoder holds
/// whenever the index was read. A KV_AWARE prefill ranking is then made by `plan::kv` over the
/// prefill pool's index; without ids or index it stays LEAST_OUTSTANDING_REQUESTS'.
pub(crate) fn finish(
    mut plan: Plan,
    pending: Pending,
    tokens: Option<&[u32]>,
    chain: ChainKey<'_>,
    indexes: PoolIndexes<'_>,
    now_ms: u64,
    random: u64,
) -> Plan {
    let endpoint = Arc::clone(&plan.endpoint);
    let Some(pd) = endpoint.disaggregation.as_ref() else {
        return plan;
    };
    let prefill = &endpoint.variants[pd.prefill];
    if let Some(local_count) = pending.undecided {
        let decode = &endpoint.variants[pd.decode];
        let count = match tokens {
            Some(ids) => Count {
                tokens: ids.len(),
                complete: true,
            },
            None => local_count,
        };
        if let (Some(ids), Some(index)) = (tokens, indexes.decode)
            && let Some((found, ranks)) = super::kv::match_instances(
                decode,
                index,
                ids,
                chain,
                super::kv::params(decode),
                random,
            )
        {
            let block_size = found.block_size as u32;
            plan.cached_tokens = found
                .matched
                .iter()
                .map(|blocks| blocks * block_size)
                .collect();
            plan.data_parallel_ranks = ranks;
        }
        let cached = plan
            .ranking
            .order
            .first()
            .and_then(|&first| plan.cached_tokens.get(first))
            .map_or(0, |&cached| cached as usize);
        plan.explain = vec![prompt_tokens_header(&count)];
        plan.label = if count.tokens.saturating_sub(cached) < pd.threshold {
            RouteLabel::Direct
        } else if prefill.instances.is_empty() {
            RouteLabel::Fallback
        } else {
            plan.prefill_hop = Some(PrefillHop {
                prefill: rank::prefill(prefill, pd, &pending.prefill_key, random),
                count,
                prefill_cached_tokens: Vec::new(),
                prefill_ranks: Vec::new(),
                prefill_body: super::engine_body::prefill_body(&plan.body, pd.protocol, prefill),
                token_ids: None,
            });
            RouteLabel::Disaggregated
        };
    }
    if pd.prefill_strategy == PrefillRoutingStrategy::KvAware
        && let Some(disaggregated) = plan.prefill_hop.as_mut()
        && let (Some(ids), Some(index)) = (tokens, indexes.prefill)
    {
        let decision = super::kv::decide(prefill, Some(index), Some(ids), chain, now_ms, random);
        disaggregated.prefill = decision.ranking;
        disaggregated.prefill_cached_tokens = decision.cached_tokens_by_instance;
        disaggregated.prefill_ranks = decision.ranks_by_instance;
    }
    if pending.token_ids
        && let Some(disaggregated) = plan.prefill_hop.as_mut()
    {
        disaggregated.token_ids = tokens.map(<[u32]>::to_vec);
    }
    plan
}
