//! In what order a pool's instances are tried: a variant by its RoutingStrategy, a
//! disaggregated endpoint's decoders and prefill pool by theirs (`policy::rank`, with fleet-wide
//! load read from the instances' cells). KV_AWARE ranks by load here; `plan::kv` ranks by the
//! KV index once the prompt's token ids are known.

use switchyard_policy::hash::routing_key;
use switchyard_policy::openai::{OpenAiRequest, TextRule};
use switchyard_policy::prefix::native;
use switchyard_policy::rank::{self, Route, Strategy};
use switchyard_shared::{DecodeRoutingStrategy, PrefillRoutingStrategy};

use super::target::{Destination, RoutingHeaders, Target};
use crate::errors::ApiError;
use crate::operation::Operation;
use crate::routing::table::{Disaggregation, VariantRoute};

/// What the prefill strategies read from the request, kept for a decision made later.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PrefillKey {
    /// SESSION: the session's key.
    pub(super) session: Option<u64>,
    /// PREFIX_AWARE: the routing key of the prefix (0 for the other strategies).
    pub(super) prefix: u64,
}

/// The pool that serves a request to `target` on `operation`, ranked: (variant index, ranking,
/// PREFIX_AWARE's routing key). A stored response's or a follow-up's holder is the only
/// candidate; a variant is ranked by its strategy; a disaggregated endpoint's decoders by
/// theirs (503 if the decode pool has no instance). Draws one number from `rng`, but for a
/// holder.
pub(super) fn serving(
    target: &Target<'_>,
    operation: Operation,
    body: &[u8],
    rng: &mut fastrand::Rng,
) -> Result<(usize, rank::Ranking, Option<u64>), ApiError> {
    let endpoint = &target.endpoint;
    // The pool, the session it sticks to, the decoders' strategy on a disaggregated endpoint,
    // and the parsed body its prefix is read from.
    let (pool, session, decode_strategy, openai) = match &target.destination {
        Destination::Stored {
            variant, instance, ..
        }
        | Destination::FollowUp {
            variant, instance, ..
        } => return Ok((*variant, rank::affinity(*instance), None)),
        Destination::Variant(index) => {
            (*index, target.routing.session, None, target.openai.as_ref())
        }
        Destination::Disaggregated => {
            let pd = endpoint
                .disaggregation
                .as_ref()
                .expect("a disaggregated destination has a disaggregation");
            let decode = &endpoint.variants[pd.decode];
            if decode.instances.is_empty() {
                return Err(ApiError::unavailable(format!(
                    "the decode variant {} of endpoint {} has no healthy instance",
                    decode.name, endpoint.name
                )));
            }
            // Decoders ignore the session; only chat and completions are read for their
            // PREFIX_AWARE key, as for the threshold (other bodies by their first bytes).
            let counted = target.openai.as_ref().filter(|_| operation.is_generation());
            (pd.decode, None, Some(pd.decode_strategy), counted)
        }
    };
    let variant = &endpoint.variants[pool];
    let reads_prefix = session.is_none()
        && matches!(variant.strategy, Strategy::PrefixAware { .. })
        && decode_strategy.is_none_or(|strategy| strategy == DecodeRoutingStrategy::PrefixAware);
    let key = reads_prefix.then(|| {
        let rule = operation.text_rule();
        prefix_key(
            variant,
            &target.routing,
            openai.map(|request| (request, rule)),
            body,
        )
    });
    let random = rng.u64(..);
    Ok(match decode_strategy {
        None => (pool, by_variant(variant, session, key, random), key),
        Some(strategy) => (pool, decoders(variant, strategy, key, random), None),
    })
}

/// PREFIX_AWARE's routing key: the prefix-aware id and the variant's PrefixLength of the
/// prompt (an OpenAI body's text by its API's rule, a native body's first bytes).
fn prefix_key(
    variant: &VariantRoute,
    routing: &RoutingHeaders,
    openai: Option<(&OpenAiRequest<'_>, TextRule)>,
    body: &[u8],
) -> u64 {
    let id = routing.prefix_aware_id.as_deref().unwrap_or("").as_bytes();
    match openai {
        Some((request, rule)) => routing_key(
            id,
            request
                .prefix_text_for(rule, variant.prefix_length)
                .as_bytes(),
        ),
        None => routing_key(id, native(body, variant.prefix_length)),
    }
}

/// Ranks the variant's instances: a session sticks to its instance; PREFIX_AWARE ranks the
/// prefix's `key`; the other strategies read load and `random` (KV_AWARE as
/// LEAST_OUTSTANDING_REQUESTS, until `plan::kv` ranks it by the KV index).
fn by_variant(
    variant: &VariantRoute,
    session: Option<u64>,
    key: Option<u64>,
    random: u64,
) -> rank::Ranking {
    let views = variant.current_views(switchyard_process::clock::unix_ms());
    let load = |index: usize| variant.instances[index].cell.fleet_load();
    match (session, variant.strategy) {
        (Some(session), _) => rank::session(&views, session),
        (None, Strategy::PrefixAware { .. }) => {
            variant.rank_prefix(&views, key.unwrap_or_default())
        }
        (None, strategy) => rank::rank(strategy, &views, load, 0, random),
    }
}

/// Ranks the decode pool by the configured strategy (its own PREFIX_AWARE config when asked,
/// with the prefix's `key`).
fn decoders(
    variant: &VariantRoute,
    strategy: DecodeRoutingStrategy,
    key: Option<u64>,
    random: u64,
) -> rank::Ranking {
    match strategy {
        DecodeRoutingStrategy::LeastOutstandingRequests => {
            by_strategy(variant, Strategy::LeastOutstandingRequests, random)
        }
        DecodeRoutingStrategy::Random => by_strategy(variant, Strategy::Random, random),
        DecodeRoutingStrategy::PrefixAware => by_variant(variant, None, key, random),
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
