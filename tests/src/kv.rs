//! KV_AWARE routing as the KV tests drive it: simulators publishing KV events, the static
//! file's instances that follow them, the router's KV index of endpoint `chat` (variant
//! `AllTraffic`) waited on, and the choice a routed answer's headers report.

use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_engine_sim::{KvEventsFormat, SimHandle};
use switchyard_router::RouterHandle;
use switchyard_shared::{EndpointName, InstanceId, VariantName};
use switchyard_testkit::{Reply, eventually, wait_matched};

use crate::{kv_sim, place, words};

/// How long the helpers here wait for the router's KV index.
const KV_WAIT: Duration = Duration::from_secs(10);

/// One simulator per format of `formats`, each publishing KV events ([`kv_sim`]) with
/// `kv_cache_blocks` blocks of KV cache.
pub async fn kv_sims<const N: usize>(
    formats: [KvEventsFormat; N],
    kv_cache_blocks: usize,
) -> anyhow::Result<[SimHandle; N]> {
    let mut sims = Vec::with_capacity(N);
    for format in formats {
        sims.push(switchyard_engine_sim::spawn(kv_sim(format, kv_cache_blocks)).await?);
    }
    Ok(sims
        .try_into()
        .unwrap_or_else(|_| unreachable!("one simulator per format")))
}

/// A simulator publishing KV events in the array layout ([`kv_sim`], 400 blocks) that keeps only
/// its last 3 batches for replay: [`place_past_the_replay_buffer`] loses more than that.
pub async fn kv_sim_replaying_3_batches() -> anyhow::Result<SimHandle> {
    let mut config = kv_sim(KvEventsFormat::Array, 400);
    config.kv_events_replay_buffer = 3;
    Ok(switchyard_engine_sim::spawn(config).await?)
}

/// Three simulators publishing KV events (array, map and array layouts) with small caches (60
/// blocks), for prompts sharing starts ([`crate::place_sharing_starts`]) some of which they
/// evict: what two routers following the same engines must agree on.
pub async fn three_small_kv_sims() -> anyhow::Result<[SimHandle; 3]> {
    use KvEventsFormat::{Array, Map};
    kv_sims([Array, Map, Array], 60).await
}

/// The `Instances` of a static routing file for `sims`, as `e0`, `e1`, …, each following
/// its simulator's KV events and replay sockets.
pub fn kv_instances(sims: &[&SimHandle]) -> Vec<Value> {
    sims.iter()
        .enumerate()
        .map(|(index, sim)| {
            json!({
                "Url": sim.url,
                "InstanceId": format!("e{index}"),
                "KvEvents": sim.kv_events_endpoint(),
                "KvEventsReplay": sim.kv_events_replay_endpoint(),
            })
        })
        .collect()
}

/// Loses `sim`'s next `lost` KV-event batches before they reach the wire, then places
/// ([`place`]) a 40-word prompt for each of `rounds` (`words(round * 1000, 40)`): the events
/// of those that follow the lost batches show the gap. Returns the prompts placed.
pub async fn place_after_lost_batches(
    sim: &SimHandle,
    lost: u64,
    rounds: RangeInclusive<usize>,
) -> anyhow::Result<Vec<String>> {
    sim.drop_kv_event_batches(lost);
    let prompts: Vec<String> = rounds.map(|round| words(round * 1000, 40)).collect();
    for prompt in &prompts {
        place(sim, prompt).await?;
    }
    Ok(prompts)
}

/// Asserts that a KV index (its counters `gaps_repaired` and `rebuilds`) repaired a gap in an
/// engine's events from the engine's replay socket, without dropping and rebuilding entries.
pub fn assert_repaired_without_rebuild(gaps_repaired: &AtomicU64, rebuilds: &AtomicU64) {
    assert!(gaps_repaired.load(Ordering::Relaxed) > 0, "no gap repaired");
    assert_eq!(rebuilds.load(Ordering::Relaxed), 0, "entries rebuilt");
}

/// Opens a gap in `sim`'s KV events wider than its replay buffer keeps (3 batches,
/// [`kv_sim_replaying_3_batches`]): loses 5
/// batches and places 6 prompts after them ([`place_after_lost_batches`], rounds 10 to 15),
/// then waits until the KV index following `sim` (`rebuilds`, its counter) has dropped and
/// rebuilt entries. Returns the prompts placed.
pub async fn place_past_the_replay_buffer(
    sim: &SimHandle,
    rebuilds: &AtomicU64,
) -> anyhow::Result<Vec<String>> {
    let prompts = place_after_lost_batches(sim, 5, 10..=15).await?;
    eventually(KV_WAIT, "a rebuild", || {
        let rebuilt = rebuilds.load(Ordering::Relaxed) > 0;
        async move { rebuilt }
    })
    .await?;
    Ok(prompts)
}

/// `router`'s KV index of `endpoint`'s variant `AllTraffic`, once an engine of it has published
/// ([`wait_kv_index`], at most `limit`).
pub async fn kv_variant_index(
    router: &RouterHandle,
    endpoint: &str,
    limit: Duration,
) -> anyhow::Result<std::sync::Arc<switchyard_kv::VariantIndex>> {
    wait_kv_index(router, endpoint, limit).await?;
    let (endpoint, variant) = (
        EndpointName::new(endpoint)?,
        VariantName::new("AllTraffic")?,
    );
    router
        .kv_index()
        .variant(&endpoint, &variant)
        .ok_or_else(|| anyhow::anyhow!("no KV index of {endpoint}"))
}

/// Waits (at most `limit`) until `router`'s KV index of `endpoint`'s variant `AllTraffic` has
/// heard from an engine (it knows the block size).
pub async fn wait_kv_index(
    router: &RouterHandle,
    endpoint: &str,
    limit: Duration,
) -> anyhow::Result<()> {
    let (endpoint, variant) = (
        EndpointName::new(endpoint)?,
        VariantName::new("AllTraffic")?,
    );
    eventually(
        limit,
        &format!("the router's KV index of {endpoint}"),
        || {
            let ready = router
                .kv_index()
                .variant(&endpoint, &variant)
                .is_some_and(|index| index.block_size().is_some());
            async move { ready }
        },
    )
    .await
}

/// Waits until `router`'s KV index of `chat` says each of `instances` holds `matched` leading
/// blocks of `tokens` (the engines' events have arrived). What the index holds: a request's
/// match stops a token short of the end.
pub async fn wait_router_matched(
    router: &RouterHandle,
    tokens: &[u32],
    instances: &[InstanceId],
    matched: &[u32],
) -> anyhow::Result<()> {
    wait_kv_index(router, "chat", KV_WAIT).await?;
    let index = router
        .kv_index()
        .variant(
            &EndpointName::new("chat")?,
            &VariantName::new("AllTraffic")?,
        )
        .expect("the variant's index");
    wait_matched(
        "the router's index to reflect the engines",
        &matched.to_vec(),
        || {
            index
                .request_hashes(tokens)
                .map(|hashes| index.matched_blocks(&hashes, instances))
                .unwrap_or_default()
        },
    )
    .await
}

/// (instance, route, cached tokens) of a routed answer, from its `x-switchyard-instance`,
/// `x-switchyard-route` and `x-switchyard-cached-tokens` (`""` and `None` when missing).
pub fn routed_choice(reply: &Reply) -> (String, String, Option<u32>) {
    (
        reply.header("x-switchyard-instance").unwrap_or("").into(),
        reply.header("x-switchyard-route").unwrap_or("").into(),
        reply
            .header("x-switchyard-cached-tokens")
            .and_then(|value| value.parse().ok()),
    )
}
