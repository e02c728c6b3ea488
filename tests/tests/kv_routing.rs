//! KV_AWARE through a real router: prefixes are placed on the simulators and evicted there by
//! requests sent straight to them (never through the router, so a router that only remembered
//! its own dispatches could not pass), and the router's choice is read from its answers'
//! `x-switchyard-instance`, `x-switchyard-route` and `x-switchyard-cached-tokens`.
//!
//! The tests wait on the router's KV index (`RouterHandle::kv_index`) only to know when the
//! engines' events have arrived; every decision checked is the router's own, on a request.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_engine_sim::{Faults, KvEventsFormat, SimConfig, SimHandle};
use switchyard_kv::{Freshness, VariantIndex};
use switchyard_router::RouterHandle;
use switchyard_shared::InstanceId;
use switchyard_testkit::http::header_text;
use switchyard_tests::{
    Metrics, Reply, assert_repaired_without_rebuild, eventually, http_post, instance_ids,
    invocations_url, kv_instances, kv_sim, kv_sim_replaying_3_batches, kv_sims, kv_variant_index,
    place, place_after_lost_batches, place_past_the_replay_buffer, place_sharing_starts,
    post_streaming, routed_choice, routed_count, router_from_file, sim_tokens, three_small_kv_sims,
    wait_router_matched, words,
};

const WAIT: Duration = Duration::from_secs(10);

fn completion(prompt: &str) -> String {
    json!({"model": "sim", "prompt": prompt, "max_tokens": 2}).to_string()
}

async fn prompt_tokens(sim: &SimHandle, prompt: &str) -> anyhow::Result<Vec<u32>> {
    sim_tokens(sim, json!({"model": "sim", "prompt": prompt})).await
}

/// A completion of `prompt` through the router (endpoint `chat`).
async fn route(router: &RouterHandle, prompt: &str) -> anyhow::Result<Reply> {
    route_body(router, completion(prompt)).await
}

/// A completions `body` through the router (endpoint `chat`), answered 200.
async fn route_body(router: &RouterHandle, body: String) -> anyhow::Result<Reply> {
    let reply = http_post(
        &format!("{}/endpoints/chat/openai/v1/completions", router.url()),
        &[],
        body,
    )
    .await?;
    anyhow::ensure!(reply.status == 200, "routed request failed: {}", reply.body);
    Ok(reply)
}

/// The router's index of `chat`/`AllTraffic`, once an engine of it has published.
async fn variant_index(router: &RouterHandle) -> anyhow::Result<Arc<VariantIndex>> {
    kv_variant_index(router, "chat", WAIT).await
}

/// [`wait_router_matched`] for `prompt`'s tokens, as `sim` counts them.
async fn wait_prompt_matched(
    router: &RouterHandle,
    sim: &SimHandle,
    prompt: &str,
    instances: &[InstanceId],
    matched: &[u32],
) -> anyhow::Result<()> {
    let tokens = prompt_tokens(sim, prompt).await?;
    wait_router_matched(router, &tokens, instances, matched).await
}

/// A router from a static file routing endpoint `chat` (KV_AWARE, `kv_config` the
/// KvAwareRoutingConfig JSON or empty) to the simulators as `e0`, `e1`, …, with quick probes
/// (100 ms) of their replay sockets and a `/tokenize` deadline of `tokenize_timeout_ms`.
async fn static_router(
    dir: &std::path::Path,
    sims: &[&SimHandle],
    kv_config: Value,
    tokenize_timeout_ms: u64,
) -> anyhow::Result<RouterHandle> {
    static_router_probing(dir, sims, kv_config, tokenize_timeout_ms, 100).await
}

/// [`static_router`] probing the replay sockets every `probe_ms`.
async fn static_router_probing(
    dir: &std::path::Path,
    sims: &[&SimHandle],
    kv_config: Value,
    tokenize_timeout_ms: u64,
    probe_ms: u64,
) -> anyhow::Result<RouterHandle> {
    static_router_with(dir, sims, kv_config, |config| {
        config.kv.kv_events_probe_ms = probe_ms;
        config.kv.kv_tokenize_timeout_ms = tokenize_timeout_ms;
    })
    .await
}

/// A router over `sims` from a static file, its configuration adjusted by `adjust`.
async fn static_router_with(
    dir: &std::path::Path,
    sims: &[&SimHandle],
    kv_config: Value,
    adjust: impl FnOnce(&mut switchyard_router::RouterConfig),
) -> anyhow::Result<RouterHandle> {
    let mut routing = json!({"RoutingStrategy": "KV_AWARE"});
    if !kv_config.is_null() {
        routing["KvAwareRoutingConfig"] = kv_config;
    }
    let file = json!({"Endpoints": [{
        "EndpointName": "chat",
        "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": "sim", "RoutingConfig": routing}],
        "Instances": kv_instances(sims),
    }]});
    router_from_file(&dir.join("switchyard.json"), &file.to_string(), |config| {
        config.worker_threads = Some(2);
        adjust(config);
    })
    .await
}

#[tokio::test]
async fn the_router_sends_a_prompt_to_the_instance_holding_it_and_follows_its_eviction()
-> anyhow::Result<()> {
    // Through the control plane: the instances declare their KV-event sockets at registration.
    let dir = tempfile::tempdir()?;
    let (control_plane, mut admin) = switchyard_tests::embedded_admin(dir.path()).await?;
    switchyard_tests::create_endpoint(
        &mut admin,
        "chat",
        r#"[{"VariantName":"AllTraffic","ModelName":"sim","RoutingConfig":{"RoutingStrategy":"KV_AWARE"}}]"#,
    )
    .await?;
    // 40 blocks each; a 200-token prompt (12 full blocks) and its output reserve 13.
    let [a, b] = kv_sims([KvEventsFormat::Array, KvEventsFormat::Map], 40).await?;
    for (id, sim) in [("engine-0", &a), ("engine-1", &b)] {
        admin
            .register_instance(switchyard_proto::v1::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "AllTraffic".into(),
                url: sim.url.clone(),
                id: id.into(),
                kv_events_endpoint: sim.kv_events_endpoint().expect("events on"),
                kv_events_replay_endpoint: sim.kv_events_replay_endpoint().unwrap_or_default(),
                ..Default::default()
            })
            .await?;
    }
    let router = switchyard_tests::router(&[control_plane.url()]).await?;
    eventually(WAIT, "the router to route to both engines", || {
        let routable = routed_count(&router, "chat") == Some(2);
        async move { routable }
    })
    .await?;
    let instances = instance_ids(&["engine-0", "engine-1"]);

    // The prefix is placed on engine-0 by a request sent straight to it.
    let prompt = words(0, 200);
    place(&a, &prompt).await?;
    let prompt_ids = prompt_tokens(&a, &prompt).await?;
    wait_router_matched(&router, &prompt_ids, &instances, &[12, 0]).await?;
    for _ in 0..3 {
        let reply = route(&router, &prompt).await?;
        assert_eq!(
            routed_choice(&reply),
            ("engine-0".into(), "kv".into(), Some(192)),
            "12 blocks of 16 tokens"
        );
    }
    // A longer prompt with the same start goes there too, for its first 12 blocks.
    let longer = format!("{prompt} {}", words(5000, 40));
    assert_eq!(
        routed_choice(&route(&router, &longer).await?),
        ("engine-0".into(), "kv".into(), Some(192))
    );

    // A chat request: its token ids come from /tokenize with the messages (template applied),
    // and match what engine-1 stored for the same conversation.
    let chat = json!({"model": "sim", "max_tokens": 2, "messages": [
        {"role": "system", "content": words(9000, 100)},
        {"role": "user", "content": "hello"},
    ]});
    let reply = http_post(
        &format!("{}/v1/chat/completions", b.url),
        &[],
        chat.to_string(),
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let mut template_fields = chat.clone();
    template_fields
        .as_object_mut()
        .expect("object")
        .remove("max_tokens");
    let chat_ids = sim_tokens(&b, template_fields).await?;
    let chat_blocks = (chat_ids.len() / 16) as u32;
    wait_router_matched(&router, &chat_ids, &instances, &[0, chat_blocks]).await?;
    let mut via_router = chat.clone();
    via_router["model"] = json!("chat");
    let reply = http_post(
        &format!("{}/v1/chat/completions", router.url()),
        &[],
        via_router.to_string(),
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        routed_choice(&reply),
        ("engine-1".into(), "kv".into(), Some(chat_blocks * 16))
    );

    // engine-0 evicts the prefix (other prompts, sent straight to it, fill its cache) and
    // engine-1 computes it: the router follows.
    for round in 1..=4 {
        place(&a, &words(round * 1000, 200)).await?;
    }
    place(&b, &prompt).await?;
    wait_router_matched(&router, &prompt_ids, &instances, &[0, 12]).await?;
    assert_eq!(
        routed_choice(&route(&router, &prompt).await?),
        ("engine-1".into(), "kv".into(), Some(192))
    );
    // A native invocation with a `prompt` is tokenized as a completion.
    let reply = http_post(&invocations_url(&router), &[], completion(&prompt)).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        routed_choice(&reply),
        ("engine-1".into(), "kv".into(), Some(192))
    );
    // One with no prompt to tokenize is routed by load, and counted.
    let reply = http_post(
        &invocations_url(&router),
        &[],
        r#"{"inputs": "not an OpenAI body"}"#,
    )
    .await?;
    assert_eq!(
        reply.header("x-switchyard-route"),
        Some("least-outstanding")
    );
    assert_eq!(reply.header("x-switchyard-cached-tokens"), None);
    assert_eq!(router.metrics().kv_tokenize_failures("input"), 1);

    // The round trips and the index are in /metrics.
    let metrics = Metrics::scrape(&router.url()).await?;
    for (series, at_least) in [
        ("switchyard_router_kv_tokenize_seconds_count", 7.0),
        (
            r#"switchyard_kv_index_blocks{endpoint="chat",variant="AllTraffic",instance="engine-1"}"#,
            12.0,
        ),
        (
            r#"switchyard_router_requests_total{endpoint="chat",instance="engine-1",route="kv"}"#,
            3.0,
        ),
    ] {
        assert!(metrics.value(series)? >= at_least, "{series}");
    }
    router.shutdown().await;
    control_plane.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn a_dropped_event_sequence_is_repaired_by_replay_before_the_router_chooses()
-> anyhow::Result<()> {
    // engine e0 keeps its last 3 batches for replay.
    let a = kv_sim_replaying_3_batches().await?;
    let b = switchyard_engine_sim::spawn(kv_sim(KvEventsFormat::Map, 400)).await?;
    let dir = tempfile::tempdir()?;
    // No periodic probe of the replay socket during the test (the longest interval allowed,
    // 60 s): a probe asks for the batches from the next one expected, so one landing between
    // the lost batches and the next live one would fill the gap before the live stream shows
    // it (not counted as a repaired gap), and one landing among the five lost batches below
    // would repair the first two of them and leave a gap the buffer still covers (no
    // rebuild). The gaps here must be found by the live stream.
    let router = static_router_probing(dir.path(), &[&a, &b], Value::Null, 250, 60_000).await?;
    let instances = instance_ids(&["e0", "e1"]);
    let first = words(0, 40);
    place(&a, &first).await?;
    wait_prompt_matched(&router, &a, &first, &instances, &[2, 0]).await?;

    // Two batches never reach the wire; the third shows the gap; replay fills it.
    let prompts = place_after_lost_batches(&a, 2, 1..=3).await?;
    for prompt in &prompts {
        wait_prompt_matched(&router, &a, prompt, &instances, &[2, 0]).await?;
        assert_eq!(
            routed_choice(&route(&router, prompt).await?),
            ("e0".into(), "kv".into(), Some(32))
        );
    }
    let counters = &router.kv_index().counters;
    assert_repaired_without_rebuild(&counters.gaps_repaired, &counters.rebuilds);

    // Five lost batches, but e0 keeps only three: its entries are dropped and rebuilt from the
    // batches that follow. Meanwhile what it held before routes by load, not to a guess.
    let lost = place_past_the_replay_buffer(&a, &counters.rebuilds).await?;
    wait_prompt_matched(&router, &a, &first, &instances, &[0, 0]).await?;
    let (_, route_taken, cached) = routed_choice(&route(&router, &first).await?);
    assert_eq!(
        (route_taken.as_str(), cached),
        ("least-outstanding", Some(0))
    );
    let last = &lost[5];
    wait_prompt_matched(&router, &a, last, &instances, &[2, 0]).await?;
    assert_eq!(
        routed_choice(&route(&router, last).await?),
        ("e0".into(), "kv".into(), Some(32))
    );
    let metrics = Metrics::scrape(&router.url()).await?;
    assert!(metrics.value("switchyard_kv_rebuilds_total")? >= 1.0);
    // Prompts this short never pass the first 32 blocks: the walk cache's counters are there.
    assert_eq!(metrics.value("switchyard_kv_walked_instances_total")?, 0.0);
    assert_eq!(
        metrics.value("switchyard_kv_walk_checkpoint_starts_total")?,
        0.0
    );
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn an_instance_whose_events_stop_is_routed_by_load_until_they_return() -> anyhow::Result<()> {
    let [a, b] = kv_sims([KvEventsFormat::Map, KvEventsFormat::Array], 400).await?;
    let dir = tempfile::tempdir()?;
    let router = static_router(dir.path(), &[&a, &b], Value::Null, 250).await?;
    let instances = instance_ids(&["e0", "e1"]);
    let prompt = words(0, 200);
    place(&a, &prompt).await?;
    let prompt_ids = prompt_tokens(&a, &prompt).await?;
    wait_router_matched(&router, &prompt_ids, &instances, &[12, 0]).await?;

    // e0's publisher stalls: after two unanswered probes of its replay socket its entries no
    // longer count, and its prompt is routed by load, answered as usual.
    a.stall_kv_events(true);
    let index = variant_index(&router).await?;
    eventually(WAIT, "e0 marked stale", || {
        let stale = index.freshness(&instances[0]) == Some(Freshness::Stale);
        async move { stale }
    })
    .await?;
    assert_eq!(
        Metrics::scrape(&router.url())
            .await?
            .value("switchyard_kv_stale_instances")?,
        1.0
    );
    let reply = route(&router, &prompt).await?;
    let (went_to, route_taken, cached) = routed_choice(&reply);
    assert_eq!(
        (route_taken.as_str(), cached),
        ("least-outstanding", Some(0))
    );

    // Its publisher resumes: the queued batches arrive and KV routing returns.
    a.stall_kv_events(false);
    eventually(WAIT, "e0 live again", || {
        let live = index.freshness(&instances[0]) == Some(Freshness::Live);
        async move { live }
    })
    .await?;
    let expected = if went_to == "e1" { [12, 12] } else { [12, 0] };
    wait_router_matched(&router, &prompt_ids, &instances, &expected).await?;
    let (_, route_taken, cached) = routed_choice(&route(&router, &prompt).await?);
    assert_eq!((route_taken.as_str(), cached), ("kv", Some(192)));

    // A killed engine goes stale too; the other keeps serving.
    b.killed().await;
    eventually(WAIT, "e1 marked stale", || {
        let stale = index.freshness(&instances[1]) == Some(Freshness::Stale);
        async move { stale }
    })
    .await?;
    assert_eq!(
        routed_choice(&route(&router, &prompt).await?),
        ("e0".into(), "kv".into(), Some(192))
    );
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_prompt_of_whole_blocks_claims_only_what_the_engine_reuses() -> anyhow::Result<()> {
    // vLLM computes a prompt's last token again: of a prompt of exactly 12 blocks it reuses
    // 11 (seen on vLLM 0.32: 640 cached tokens for a 768-token prompt, where the router said
    // 768). The router's claim and the decision agree with the engine's own count.
    let [a, b] = kv_sims([KvEventsFormat::Map, KvEventsFormat::Map], 100).await?;
    let dir = tempfile::tempdir()?;
    let router = static_router(dir.path(), &[&a, &b], Value::Null, 1000).await?;
    let instances = instance_ids(&["e0", "e1"]);
    let ids: Vec<u32> = (1000..1192).collect();
    let body = json!({"model": "sim", "prompt": ids, "max_tokens": 2});
    let placed = http_post(&format!("{}/v1/completions", a.url), &[], body.to_string()).await?;
    assert_eq!(placed.status, 200, "{}", placed.body);
    wait_router_matched(&router, &ids, &instances, &[12, 0]).await?;
    let reply = route_body(&router, body.to_string()).await?;
    assert_eq!(routed_choice(&reply), ("e0".into(), "kv".into(), Some(176)));
    assert_eq!(
        reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        176,
        "the engine's own count"
    );
    // One token more: all 12 blocks are reused.
    let longer: Vec<u32> = (1000..1193).collect();
    let reply = route_body(
        &router,
        json!({"model": "sim", "prompt": longer, "max_tokens": 2}).to_string(),
    )
    .await?;
    assert_eq!(routed_choice(&reply), ("e0".into(), "kv".into(), Some(192)));
    assert_eq!(
        reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        192
    );
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_saturated_holder_loses_to_an_idle_non_holder() -> anyhow::Result<()> {
    // Real time, so that streams stay in flight; ConcurrencyThreshold 2.
    let real_time = |format| SimConfig {
        time_scale: 1.0,
        ..kv_sim(format, 400)
    };
    let a = switchyard_engine_sim::spawn(real_time(KvEventsFormat::Array)).await?;
    let b = switchyard_engine_sim::spawn(real_time(KvEventsFormat::Map)).await?;
    let dir = tempfile::tempdir()?;
    let router = static_router(
        dir.path(),
        &[&a, &b],
        json!({"ConcurrencyThreshold": 2}),
        250,
    )
    .await?;
    let instances = instance_ids(&["e0", "e1"]);
    let prompt = words(0, 200);
    place(&a, &prompt).await?;
    wait_prompt_matched(&router, &a, &prompt, &instances, &[12, 0]).await?;

    // Two long streams of the prompt: the holder takes both (its score, 1 − 0.5 × load / 2,
    // stays above the idle non-holder's 0 while it is below the threshold).
    let stream =
        json!({"model": "sim", "prompt": prompt, "max_tokens": 1000, "stream": true}).to_string();
    let url = format!("{}/endpoints/chat/openai/v1/completions", router.url());
    let mut streams = Vec::new();
    for _ in 0..2 {
        let response = post_streaming(&url, &[], stream.clone()).await?;
        assert_eq!(response.status(), 200);
        let header = |name: &str| header_text(response.headers(), name);
        assert_eq!(header("x-switchyard-instance"), Some("e0"));
        assert_eq!(header("x-switchyard-route"), Some("kv"));
        streams.push(response);
    }
    // At the threshold the holder is no candidate: the idle non-holder gets the request.
    assert_eq!(
        routed_choice(&route(&router, &prompt).await?),
        ("e1".into(), "least-outstanding".into(), Some(0))
    );
    drop(streams);
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn two_routers_that_applied_the_same_events_make_the_same_choice() -> anyhow::Result<()> {
    let sims = three_small_kv_sims().await?;
    let refs: Vec<&SimHandle> = sims.iter().collect();
    let dir = tempfile::tempdir()?;
    let first = static_router(dir.path(), &refs, Value::Null, 250).await?;
    // Prompts sharing starts of various lengths, spread over the engines; some evicted.
    let prompts = place_sharing_starts(&sims).await?;
    // The second router starts late: it learns the past from the engines' replay buffers.
    let second = static_router(dir.path(), &refs, Value::Null, 250).await?;
    let instances = instance_ids(&["e0", "e1", "e2"]);
    let (one, two) = (variant_index(&first).await?, variant_index(&second).await?);
    let mut kv_routes = 0;
    for prompt in &prompts {
        let prompt_ids = prompt_tokens(&sims[0], prompt).await?;
        let holds = |index: &VariantIndex| {
            index
                .match_tokens(&prompt_ids, &instances)
                .map(|found| found.matched)
        };
        // Both have applied the same events (the requests below may add some: wait again).
        eventually(WAIT, "both routers' indexes to agree", || {
            let agree = holds(&one) == holds(&two);
            async move { agree }
        })
        .await?;
        let (one_choice, two_choice) = (
            routed_choice(&route(&first, prompt).await?),
            routed_choice(&route(&second, prompt).await?),
        );
        assert_eq!(one_choice.0, two_choice.0, "{prompt}");
        assert_eq!(one_choice.1, two_choice.1, "{prompt}");
        // The first request may have made its instance hold more of the prompt.
        assert!(
            two_choice.2 >= one_choice.2,
            "{one_choice:?} {two_choice:?}"
        );
        kv_routes += usize::from(one_choice.1 == "kv");
    }
    assert!(
        kv_routes >= 6,
        "most prompts are held somewhere: {kv_routes}"
    );
    first.shutdown().await;
    second.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn with_tokenize_failing_or_hanging_requests_are_still_served_by_load() -> anyhow::Result<()>
{
    // e0 is asked first (least loaded, first in the table). Its /tokenize hangs, then fails:
    // two failures in a row pause it (for a minute here, so that nothing below depends on
    // timing). e1 is asked next, fails twice, and is paused too. Then no instance is asked.
    let [a, b] = kv_sims([KvEventsFormat::Array, KvEventsFormat::Map], 400).await?;
    let dir = tempfile::tempdir()?;
    let router = static_router_with(dir.path(), &[&a, &b], Value::Null, |config| {
        config.kv.kv_events_probe_ms = 100;
        config.kv.kv_tokenize_timeout_ms = 100;
        config.kv.kv_tokenize_pause_ms = 60_000;
    })
    .await?;
    let instances = instance_ids(&["e0", "e1"]);
    let prompt = words(0, 200);
    place(&a, &prompt).await?;
    wait_prompt_matched(&router, &a, &prompt, &instances, &[12, 0]).await?;

    let fail = Faults {
        tokenize_fail_rate: 1.0,
        ..Faults::default()
    };
    a.set_faults(Faults {
        tokenize_hang_rate: 1.0,
        ..Faults::default()
    });
    b.set_faults(fail);
    for (reason, count) in [
        ("timeout", 1),
        ("status", 1),
        ("status", 2),
        ("status", 3),
        ("backoff", 1),
    ] {
        let reply = route(&router, &prompt).await?;
        assert_eq!(
            reply.header("x-switchyard-route"),
            Some("least-outstanding")
        );
        assert_eq!(reply.header("x-switchyard-cached-tokens"), None);
        a.set_faults(fail);
        assert_eq!(
            router.metrics().kv_tokenize_failures(reason),
            count,
            "{reason}"
        );
        assert_eq!(
            Metrics::scrape(&router.url()).await?.value(&format!(
                r#"switchyard_router_kv_tokenize_failures_total{{reason="{reason}"}}"#
            ))?,
            count as f64
        );
    }
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_paused_tokenizer_is_tried_again_and_kv_routing_returns() -> anyhow::Result<()> {
    let [a] = kv_sims([KvEventsFormat::Array], 400).await?;
    let dir = tempfile::tempdir()?;
    let router = static_router_with(dir.path(), &[&a], Value::Null, |config| {
        config.kv.kv_events_probe_ms = 100;
        config.kv.kv_tokenize_pause_ms = 100;
    })
    .await?;
    let prompt = words(0, 200);
    place(&a, &prompt).await?;
    wait_prompt_matched(&router, &a, &prompt, &instance_ids(&["e0"]), &[12]).await?;
    a.set_faults(Faults {
        tokenize_fail_rate: 1.0,
        ..Faults::default()
    });
    for _ in 0..2 {
        let reply = route(&router, &prompt).await?;
        assert_eq!(
            reply.header("x-switchyard-route"),
            Some("least-outstanding")
        );
    }
    assert_eq!(router.metrics().kv_tokenize_failures("status"), 2);
    // The tokenizer is back: once the pause (100 ms) has ended, one request tries it, and KV
    // routing returns.
    a.set_faults(Faults::default());
    eventually(WAIT, "KV routing after the pause", || async {
        route(&router, &prompt)
            .await
            .is_ok_and(|reply| routed_choice(&reply).1 == "kv")
    })
    .await?;
    let (_, route_taken, cached) = routed_choice(&route(&router, &prompt).await?);
    assert_eq!((route_taken.as_str(), cached), ("kv", Some(192)));
    assert_eq!(router.metrics().kv_tokenize_failures("status"), 2);
    router.shutdown().await;
    Ok(())
}

/// A Responses follow-up goes to the instance that stores the response it continues, whatever
/// the KV index says: the other instance would not know its `previous_response_id`.
#[tokio::test]
async fn a_responses_follow_up_sticks_to_the_instance_storing_its_response() -> anyhow::Result<()> {
    let sims = kv_sims([KvEventsFormat::Array, KvEventsFormat::Map], 400).await?;
    let refs: Vec<&SimHandle> = sims.iter().collect();
    let dir = tempfile::tempdir()?;
    let router = static_router(dir.path(), &refs, Value::Null, 250).await?;
    // Both engines have published: the KV stage is live for the variant.
    let prompt = words(0, 64);
    for sim in &sims {
        place(sim, &prompt).await?;
    }
    wait_router_matched(
        &router,
        &prompt_tokens(&sims[0], &prompt).await?,
        &instance_ids(&["e0", "e1"]),
        &[4, 4],
    )
    .await?;
    let responses = format!("{}/endpoints/chat/openai/v1/responses", router.url());
    let reply = http_post(
        &responses,
        &[],
        json!({"model": "sim", "input": prompt, "max_output_tokens": 2}).to_string(),
    )
    .await?;
    anyhow::ensure!(reply.status == 200, "{}", reply.body);
    let id = reply.json()["id"].as_str().unwrap_or_default().to_owned();
    let holder = reply
        .header("x-switchyard-instance")
        .unwrap_or("")
        .to_owned();
    for round in 0..6 {
        let follow_up = json!({
            "model": "sim",
            "input": format!("{prompt} and then {round}"),
            "previous_response_id": id,
            "max_output_tokens": 2,
        });
        let reply = http_post(&responses, &[], follow_up.to_string()).await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(
            (
                reply.header("x-switchyard-instance"),
                reply.header("x-switchyard-route")
            ),
            (Some(holder.as_str()), Some("response")),
            "follow-up {round}"
        );
    }
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn the_simulators_reuse_reports_leave_no_phantom_blocks() -> anyhow::Result<()> {
    // vLLM 0.32's kv_cache_report_mode "full": every request re-sends BlockStored for the
    // prefix it reuses; the eviction sends one BlockRemoved per block.
    let dir = tempfile::tempdir()?;
    // 20 blocks each; a 50-word prompt is 3 full blocks and reserves 4.
    let [a, b] = kv_sims([KvEventsFormat::Map, KvEventsFormat::Map], 20).await?;
    let router = static_router(dir.path(), &[&a, &b], Value::Null, 250).await?;
    let instances = instance_ids(&["e0", "e1"]);
    let prompt = words(0, 50);
    for _ in 0..4 {
        let reply = http_post(
            &format!("{}/v1/completions", a.url),
            &[],
            json!({"model": "sim", "prompt": prompt, "max_tokens": 2,
                "vllm_xargs": {"kv_cache_report_mode": "full"}})
            .to_string(),
        )
        .await?;
        anyhow::ensure!(reply.status == 200, "{}", reply.body);
    }
    wait_prompt_matched(&router, &a, &prompt, &instances, &[3, 0]).await?;
    assert_eq!(
        routed_choice(&route(&router, &prompt).await?),
        ("e0".into(), "kv".into(), Some(48))
    );
    // Other prompts evict it from e0 (LRU); the router must not keep claiming it.
    for round in 1..=8 {
        place(&a, &words(round * 100, 50)).await?;
    }
    wait_prompt_matched(&router, &a, &prompt, &instances, &[0, 0]).await?;
    let (_, route_label, cached) = routed_choice(&route(&router, &prompt).await?);
    assert_eq!(
        (route_label.as_str(), cached),
        ("least-outstanding", Some(0))
    );
    router.shutdown().await;
    Ok(())
}
