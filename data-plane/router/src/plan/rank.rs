//! In what order a pool's instances are tried: a variant by its RoutingStrategy, a
//! disaggregated endpoint's decoders and prefill pool by theirs (`policy::rank`, with fleet-wide
//! load read from the instances' cells). KV_AWARE ranks by load here; `plan::kv` ranks by the
//! KV index once the prompt's token ids are known.

use switchyard_policy::hash::routing_key;
use switchyard_policy::openai::{OpenAiRequest, TextRule};
use switchyard_policy::prefix::native;
use switchyard_policy::rank::{self, Route, Strategy};
use switchyard_shared::{DecodeRoutingStrategy, PrefillRoutingStrategy};

use super::target::RoutingHeaders;
use crate::routing::table::{Disaggregation, VariantRoute};

/// What the prefill strategies read from the request, kept for a decision made later.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PrefillKey {
    /// SESSION: the session's key.
    pub(super) session: Option<u64>,
    /// PREFIX_AWARE: the routing key of the prefix (0 for the other strategies).
    pub(super) prefix: u64,
}

/// Ranks the variant's instances: a session sticks to its instance; PREFIX_AWARE hashes the
/// prefix-aware id and the prefix; the other strategies read load and `random` (KV_AWARE as
/// LEAST_OUTSTANDING_REQUESTS, until `plan::kv` ranks it by the KV index). With the ranking,
/// PREFIX_AWARE's routing key.
pub(super) fn variant(
    variant: &VariantRoute,
    routing: &RoutingHeaders,
    openai: Option<(&OpenAiRequest<'_>, TextRule)>,
    body: &[u8],
    random: u64,
) -> (rank::Ranking, Option<u64>) {
    let views = variant.current_views(switchyard_process::clock::unix_ms());
    let load = |index: usize| variant.instances[index].cell.fleet_load();
    match (routing.session, variant.strategy) {
        (Some(session), _) => (rank::session(&views, session), None),
        (None, Strategy::PrefixAware { .. }) => {
            let id = routing.prefix_aware_id.as_deref().unwrap_or("").as_bytes();
            let key = match openai {
                Some((request, rule)) => routing_key(
                    id,
                    request
                        .prefix_text_for(rule, variant.prefix_length)
                        .as_bytes(),
                ),
                None => routing_key(id, native(body, variant.prefix_length)),
            };
            (variant.rank_prefix(&views, key), Some(key))
        }
        (None, strategy) => (rank::rank(strategy, &views, load, 0, random), None),
    }
}

/// Ranks the decode pool by the configured strategy (its own PREFIX_AWARE config when asked).
pub(super) fn decoders(
    variant: &VariantRoute,
    strategy: DecodeRoutingStrategy,
    routing: &RoutingHeaders,
    openai: Option<(&OpenAiRequest<'_>, TextRule)>,
    body: &[u8],
    random: u64,
) -> rank::Ranking {
    match strategy {
        DecodeRoutingStrategy::LeastOutstandingRequests => {
            by_strategy(variant, Strategy::LeastOutstandingRequests, random)
        }
        DecodeRoutingStrategy::Random => by_strategy(variant, Strategy::Random, random),
        DecodeRoutingStrategy::PrefixAware => {
            let without_session = RoutingHeaders {
                prefix_aware_id: routing.prefix_aware_id.clone(),
                session: None,
                target_variant: None,
            };
            self::variant(variant, &without_session, openai, body, random).0
        }
    }
}

/// Ranks the prefill pool by the configured strategy (KV_AWARE as LEAST_OUTSTANDING_REQUESTS,
/// until `plan::kv` ranks it by the pool's KV index).
pub(super) fn prefill(
    variant: &VariantRoute,
    pd: &Disaggregation,
    key: &PrefillKey,
    random: u64,
) -> rank::Ranking {
    let views = variant.current_views(switchyard_process::clock::unix_ms());
    let load = |index: usize| variant.instances[index].cell.fleet_load();
    let round_robin = || {
        let turn = pd
            .next_prefill
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        round_robin(&views, turn)
    };
    match pd.prefill_strategy {
        PrefillRoutingStrategy::RoundRobin => round_robin(),
        PrefillRoutingStrategy::Session => match key.session {
            Some(session) => rank::session(&views, session),
            None => round_robin(),
        },
        PrefillRoutingStrategy::PrefixAware => variant.rank_prefix(&views, key.prefix),
        PrefillRoutingStrategy::KvAware => {
            rank::rank(Strategy::LeastOutstandingRequests, &views, load, 0, random)
        }
    }
}

/// `strategy` (one that reads load and `random`, not a key) over the variant as of now.
fn by_strategy(variant: &VariantRoute, strategy: Strategy, random: u64) -> rank::Ranking {
    let views = variant.current_views(switchyard_process::clock::unix_ms());
    let load = |index: usize| variant.instances[index].cell.fleet_load();
    rank::rank(strategy, &views, load, 0, random)
}

/// Round robin over the available instances (then the ejected ones), starting at `turn`.
fn round_robin(views: &[rank::InstanceView], turn: usize) -> rank::Ranking {
    let count = views.len().max(1);
    let start = turn % count;
    let rotated = (0..views.len()).map(|offset| (start + offset) % count);
    let (mut order, ejected): (Vec<usize>, Vec<usize>) =
        rotated.partition(|&index| views[index].available);
    order.extend(ejected);
    rank::Ranking {
        order,
        route: Some(Route::Random),
    }
}
