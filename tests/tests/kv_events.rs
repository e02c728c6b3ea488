//! KV-cache events: the simulator's publisher against vLLM's own subscriber structures (Python
//! `msgspec` and `pyzmq`, as vLLM's example subscriber uses them), and the router's
//! subscribers and index against real simulators whose caches are filled and emptied by
//! requests sent straight to them.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_engine_sim::{KvEventsFormat, SimHandle};
use switchyard_tests::{
    RefusingPort, assert_repaired_without_rebuild, http_get, http_post, instance_ids, kv_sim,
    kv_sim_replaying_3_batches, kv_sims, place, place_after_lost_batches,
    place_past_the_replay_buffer, place_sharing_starts, test_python, three_small_kv_sims,
    wait_matched, words,
};
use tokio::io::{AsyncBufReadExt, BufReader};

async fn tokenize(sim: &SimHandle, prompt: &str) -> anyhow::Result<Vec<u64>> {
    let reply = http_post(
        &format!("{}/tokenize", sim.url),
        &[],
        json!({"model": "sim", "prompt": prompt}).to_string(),
    )
    .await?;
    anyhow::ensure!(reply.status == 200, "tokenize failed: {}", reply.body);
    let body = reply.json();
    assert_eq!(
        body["count"].as_u64(),
        Some(prompt.split(' ').count() as u64)
    );
    assert!(body["max_model_len"].as_u64().is_some(), "{body}");
    Ok(body["tokens"]
        .as_array()
        .expect("token ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect())
}

#[tokio::test]
async fn the_simulators_kv_events_decode_with_vllms_msgspec_structures() -> anyhow::Result<()> {
    for (format, layout) in [
        (KvEventsFormat::Array, "array"),
        (KvEventsFormat::Map, "map"),
    ] {
        // 20 blocks: each request below reserves 4 (50 prompt + 2 output tokens).
        let sim = switchyard_engine_sim::spawn(kv_sim(format, 20)).await?;
        let (status, info) = http_get(&format!("{}/sim/kv-events", sim.url)).await?;
        assert_eq!(status, 200, "{info}");
        let info: Value = serde_json::from_str(&info)?;
        let endpoint = sim.kv_events_endpoint().expect("bound");
        let replay = sim.kv_events_replay_endpoint().expect("bound");
        assert_eq!(info["endpoint"], endpoint.as_str());
        assert_eq!(info["replay_endpoint"], replay.as_str());
        assert!(!endpoint.ends_with(":0"), "port 0 resolved: {endpoint}");

        // Fill the cache (3 full blocks of 16 per prompt), evict the first prompt, reset.
        let first = words(0, 50);
        place(&sim, &first).await?;
        for round in 1..=8 {
            place(&sim, &words(round * 100, 50)).await?;
        }
        let reset = http_post(&format!("{}/reset_prefix_cache", sim.url), &[], "").await?;
        assert_eq!(reset.json()["reset"], true, "{}", reset.body);
        let first_tokens = tokenize(&sim, &first).await?;

        let mut child = tokio::process::Command::new(test_python())
            .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/kv_events_subscriber.py"))
            .args([&endpoint, &replay, layout])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let ready = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await??;
        assert_eq!(ready.as_deref(), Some("ready"));
        // The subscription is made before "ready"; libzmq may still be completing it, so send
        // requests (each stores new blocks) until the subscriber has its live message.
        let mut round = 100;
        let output = loop {
            place(&sim, &words(round * 100, 20)).await?;
            round += 1;
            if let Ok(line) =
                tokio::time::timeout(Duration::from_millis(200), lines.next_line()).await
            {
                break line?.expect("a JSON line");
            }
            anyhow::ensure!(round < 150, "no live message reached the Python subscriber");
        };
        let status = child.wait().await?;
        assert!(status.success(), "{layout}: subscriber failed");
        let decoded: Value = serde_json::from_str(&output)?;

        let replayed = decoded["replayed"].as_array().expect("replayed batches");
        let events: Vec<&Value> = replayed
            .iter()
            .enumerate()
            .flat_map(|(index, entry)| {
                assert_eq!(entry["seq"], index, "{layout}: sequence numbers from 0");
                assert_eq!(
                    entry["batch"]["data_parallel_rank"],
                    match format {
                        KvEventsFormat::Array => Value::Null, // not in the example's structure
                        KvEventsFormat::Map => json!(0),
                    }
                );
                entry["batch"]["events"].as_array().expect("events")
            })
            .collect();
        let stored = events[0];
        assert_eq!(stored["type"], "BlockStored", "{layout}: {stored}");
        assert_eq!(stored["parent_block_hash"], Value::Null);
        assert_eq!(stored["block_size"], 16);
        assert_eq!(stored["medium"], "GPU");
        assert_eq!(stored["lora_id"], Value::Null);
        let first_hashes = stored["block_hashes"].as_array().expect("hashes").clone();
        assert_eq!(
            first_hashes.len(),
            3,
            "{layout}: 50 tokens are 3 full blocks"
        );
        let token_ids: Vec<u64> = stored["token_ids"]
            .as_array()
            .expect("token ids")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(
            token_ids,
            first_tokens[..48],
            "{layout}: the ids /tokenize returns"
        );
        let removed: Vec<&Value> = events
            .iter()
            .filter(|event| event["type"] == "BlockRemoved")
            .flat_map(|event| event["block_hashes"].as_array().expect("hashes"))
            .collect();
        for hash in &first_hashes {
            assert!(removed.contains(&hash), "{layout}: {hash} evicted");
        }
        assert_eq!(events.last().expect("events")["type"], "AllBlocksCleared");
        if format == KvEventsFormat::Map {
            assert_eq!(stored["group_idx"], 0);
            assert_eq!(stored["extra_keys"], json!([null, null, null]));
        }
        let live = &decoded["live"];
        assert!(
            live["seq"].as_u64() >= Some(replayed.len() as u64),
            "{live}"
        );
        assert_eq!(live["topic"], "");
        assert_eq!(live["batch"]["events"][0]["type"], "BlockStored");
        sim.shutdown().await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The router's subscribers and index, against real simulators.
// ---------------------------------------------------------------------------------------------

use std::sync::Arc;

use arc_swap::ArcSwap;
use switchyard_kv::{Freshness, VariantIndex};
use switchyard_policy::kv::{KvParams, prefix_key, rank_kv};
use switchyard_policy::rank::{InstanceView, Route};
use switchyard_router::parts::{
    KvEvents, KvSettings, PromptKind, SubscriberSettings, TokenizeClient as Tokenizer,
    least_loaded, tokenize_body,
};
use switchyard_router::{LoadRegistry, RoutingTable, VariantRoute};
use switchyard_shared::{
    EndpointConfig, EndpointConfigName, EndpointName, HealthCheckConfig, Instance, InstanceId,
    KvEventsEndpoints, VariantName,
};
use switchyard_tests::eventually;

const WAIT: Duration = Duration::from_secs(10);

/// Quick probes, so staleness shows within a second.
fn settings() -> KvSettings {
    KvSettings {
        subscriber: SubscriberSettings {
            probe_interval: Duration::from_millis(100),
            reply_timeout: Duration::from_millis(300),
            stale_after_failures: 2,
            reconnect_delay: Duration::from_millis(50),
            ..SubscriberSettings::default()
        },
        ..KvSettings::default()
    }
}

/// A routing table with endpoint `chat`, one KV_AWARE variant, and the simulators as
/// instances `e0`, `e1`, … (with their KV-event endpoints).
fn kv_table(sims: &[&SimHandle], registry: &LoadRegistry) -> RoutingTable {
    let variants = switchyard_shared::sagemaker::parse_production_variants(
        r#"[{"VariantName":"AllTraffic","ModelName":"sim","RoutingConfig":{"RoutingStrategy":"KV_AWARE"}}]"#,
    )
    .expect("variants")
    .variants;
    let config = EndpointConfig {
        endpoint_config_name: EndpointConfigName::new("chat").expect("name"),
        production_variants: variants,
        health_check_config: HealthCheckConfig::default(),
        creation_time_ms: 0,
        disaggregation_config: None,
    };
    let instances: Vec<Instance> = sims
        .iter()
        .enumerate()
        .map(|(index, sim)| Instance {
            kv_events: Some(KvEventsEndpoints::single(
                &sim.kv_events_endpoint().expect("events on"),
                sim.kv_events_replay_endpoint().as_deref(),
            )),
            ..Instance::new(
                InstanceId::new(&format!("e{index}")).expect("id"),
                EndpointName::new("chat").expect("name"),
                VariantName::new("AllTraffic").expect("name"),
                sim.url.clone(),
            )
        })
        .collect();
    switchyard_router::parts::build_table(
        1,
        &[(EndpointName::new("chat").expect("name"), config)],
        &instances,
        registry,
    )
}

fn variant_route(table: &RoutingTable) -> &VariantRoute {
    &table.endpoints[&EndpointName::new("chat").expect("name")].variants[0]
}

/// The variant's index once its first engine has published.
async fn variant_index(events: &KvEvents) -> anyhow::Result<Arc<VariantIndex>> {
    let (endpoint, variant) = (EndpointName::new("chat")?, VariantName::new("AllTraffic")?);
    eventually(WAIT, "the variant's index", || {
        let found = events
            .index()
            .variant(&endpoint, &variant)
            .is_some_and(|index| index.block_size().is_some());
        async move { found }
    })
    .await?;
    Ok(events
        .index()
        .variant(&endpoint, &variant)
        .expect("the variant's index"))
}

/// The router's view of a completions prompt: its block hashes, from the token ids that the
/// least loaded instance's `/tokenize` returns (the request path's way).
async fn prompt_hashes(
    table: &RoutingTable,
    index: &VariantIndex,
    prompt: &str,
) -> anyhow::Result<Vec<u64>> {
    let variant = variant_route(table);
    let target = least_loaded(variant, 0).expect("an instance");
    let body = json!({"model": "sim", "prompt": prompt, "max_tokens": 2}).to_string();
    let tokens = Tokenizer::default()
        .tokenize(
            &variant.instances[target].url,
            tokenize_body(PromptKind::Completion, body.as_bytes())?,
        )
        .await?;
    Ok(index.request_hashes(&tokens).expect("block size known"))
}

/// Waits until the index says `matched` blocks of `hashes` for each instance.
async fn wait_index_matched(
    index: &VariantIndex,
    hashes: &[u64],
    instances: &[InstanceId],
    matched: &[u32],
) -> anyhow::Result<()> {
    wait_matched(
        "the index to reflect the engines",
        &matched.to_vec(),
        || index.matched_blocks(hashes, instances),
    )
    .await
}

fn kv_choice(matched: &[u32], blocks: u32, loads: &[u32], key: u64) -> (usize, Option<Route>) {
    let views: Vec<InstanceView> = (0..matched.len())
        .map(|index| InstanceView {
            id_hash: switchyard_policy::hash::instance_hash(&format!("e{index}")),
            weight: 1.0,
            available: true,
        })
        .collect();
    let params = KvParams {
        concurrency_threshold: 10,
        load_weight: 0.5,
    };
    let ranking = rank_kv(params, &views, |i| loads[i], matched, blocks, key, 7);
    (ranking.first().expect("a choice"), ranking.route)
}

/// What the request path decides for a completions body now (tokens from an engine's
/// `/tokenize`, matched blocks from the index, loads from the table's cells).
async fn decide_now(
    table: &ArcSwap<RoutingTable>,
    events: &KvEvents,
    body: &[u8],
) -> anyhow::Result<switchyard_router::parts::KvDecision> {
    decide_for(table, events, PromptKind::Completion, body).await
}

async fn decide_for(
    table: &ArcSwap<RoutingTable>,
    events: &KvEvents,
    kind: PromptKind,
    body: &[u8],
) -> anyhow::Result<switchyard_router::parts::KvDecision> {
    let table = table.load_full();
    let variant = variant_route(&table);
    let tokens =
        switchyard_router::parts::request_tokens(&Tokenizer::default(), variant, kind, body, 0)
            .await?;
    let index = events.index().variant(
        &EndpointName::new("chat")?,
        &VariantName::new("AllTraffic")?,
    );
    Ok(switchyard_router::parts::decide(
        variant,
        index.as_deref(),
        Some(&tokens),
        switchyard_kv::ChainKey::default(),
        0,
        7,
    ))
}

#[tokio::test]
async fn the_index_follows_prefixes_placed_and_evicted_on_the_simulators() -> anyhow::Result<()> {
    // 40 blocks each; a 200-token prompt (12 full blocks) + output reserves 13.
    let [a, b] = kv_sims([KvEventsFormat::Array, KvEventsFormat::Map], 40).await?;
    let registry = LoadRegistry::default();
    let table = Arc::new(ArcSwap::from_pointee(kv_table(&[&a, &b], &registry)));
    let stop = tokio_util::sync::CancellationToken::new();
    let events = KvEvents::start(Arc::clone(&table), settings(), stop.clone());
    let instances = instance_ids(&["e0", "e1"]);

    // The prefix is placed on e0 by a request sent straight to it, not through a router.
    let prompt = words(0, 200);
    place(&a, &prompt).await?;
    let index = variant_index(&events).await?;
    let hashes = prompt_hashes(&table.load(), &index, &prompt).await?;
    assert_eq!(hashes.len(), 12);
    wait_index_matched(&index, &hashes, &instances, &[12, 0]).await?;
    // The request path's decision, from the table's live cells: e0, 192 cached tokens.
    let request = json!({"model": "sim", "prompt": prompt, "max_tokens": 2}).to_string();
    let decision = decide_now(&table, &events, request.as_bytes()).await?;
    assert_eq!(decision.ranking.first(), Some(0));
    assert_eq!(decision.ranking.route, Some(Route::Kv));
    assert_eq!((decision.cached_tokens, decision.prompt_blocks), (192, 12));
    // A longer prompt with the same start matches its first 12 blocks.
    let longer = format!("{prompt} {}", words(5000, 40));
    let longer_hashes = prompt_hashes(&table.load(), &index, &longer).await?;
    assert_eq!(&index.matched_blocks(&longer_hashes, &instances), &[12, 0]);

    // e0 evicts it (other prompts fill its cache); e1 computes it.
    for round in 1..=4 {
        place(&a, &words(round * 1000, 200)).await?;
    }
    place(&b, &prompt).await?;
    wait_index_matched(&index, &hashes, &instances, &[0, 12]).await?;
    let decision = decide_now(&table, &events, request.as_bytes()).await?;
    assert_eq!(decision.ranking.first(), Some(1));
    assert_eq!(decision.ranking.route, Some(Route::Kv));
    // A saturated holder (10 in flight, the default threshold) loses to an idle non-holder.
    let current = table.load_full();
    let holder = &variant_route(&current).instances[1].cell;
    holder.local.store(10, std::sync::atomic::Ordering::Relaxed);
    let decision = decide_now(&table, &events, request.as_bytes()).await?;
    assert_eq!(decision.ranking.first(), Some(0));
    assert_eq!(decision.ranking.route, Some(Route::LeastOutstanding));
    assert_eq!(decision.cached_tokens, 0);
    holder.local.store(0, std::sync::atomic::Ordering::Relaxed);

    // A chat request: the tokens come from /tokenize with the messages (template applied),
    // and match what the engine stored for the same conversation.
    let chat = json!({"model": "sim", "max_tokens": 2, "messages": [
        {"role": "system", "content": words(9000, 100)},
        {"role": "user", "content": "hello"},
    ]})
    .to_string();
    let reply = http_post(&format!("{}/v1/chat/completions", b.url), &[], chat.clone()).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    eventually(WAIT, "the chat prompt on e1", || {
        let table = Arc::clone(&table);
        let chat = chat.clone();
        let events = &events;
        async move {
            decide_for(&table, events, PromptKind::Chat, chat.as_bytes())
                .await
                .is_ok_and(|decision| {
                    decision.ranking.first() == Some(1) && decision.cached_tokens >= 96
                })
        }
    })
    .await?;

    // An engine reset empties its entries.
    http_post(&format!("{}/reset_prefix_cache", b.url), &[], "").await?;
    wait_index_matched(&index, &hashes, &instances, &[0, 0]).await?;

    // An instance that leaves the table is dropped from the index.
    table.store(Arc::new(kv_table(&[&a], &registry)));
    eventually(WAIT, "e1 to leave the index", || {
        let gone = index.freshness(&instances[1]).is_none();
        async move { gone }
    })
    .await?;
    stop.cancel();
    events.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_dropped_sequence_is_repaired_by_replay_and_an_unrepairable_one_rebuilds()
-> anyhow::Result<()> {
    let sim = kv_sim_replaying_3_batches().await?;
    let registry = LoadRegistry::default();
    let table = Arc::new(ArcSwap::from_pointee(kv_table(&[&sim], &registry)));
    let stop = tokio_util::sync::CancellationToken::new();
    let events = KvEvents::start(Arc::clone(&table), settings(), stop.clone());
    let instances = instance_ids(&["e0"]);
    let counters = Arc::clone(&events.index().counters);
    place(&sim, &words(0, 40)).await?;
    let index = variant_index(&events).await?;

    // Two batches never reach the wire; the third shows the gap; replay fills it.
    let prompts = place_after_lost_batches(&sim, 2, 1..=3).await?;
    for prompt in &prompts {
        let hashes = prompt_hashes(&table.load(), &index, prompt).await?;
        wait_index_matched(&index, &hashes, &instances, &[2]).await?;
    }
    assert_repaired_without_rebuild(&counters.gaps_repaired, &counters.rebuilds);

    // Five lost batches, but the engine keeps only the last three: the entries are dropped
    // (a lost BlockRemoved would leave blocks the engine no longer has) and rebuilt from
    // the batches that follow.
    let lost = place_past_the_replay_buffer(&sim, &counters.rebuilds).await?;
    let old = prompt_hashes(&table.load(), &index, &prompts[0]).await?;
    assert_eq!(index.matched_blocks(&old, &instances), [0], "dropped");
    let last = prompt_hashes(&table.load(), &index, &lost[5]).await?;
    wait_index_matched(&index, &last, &instances, &[2]).await?;
    stop.cancel();
    events.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn an_instance_whose_events_stop_is_stale_until_they_return() -> anyhow::Result<()> {
    let [a, b] = kv_sims([KvEventsFormat::Map, KvEventsFormat::Map], 400).await?;
    let registry = LoadRegistry::default();
    let table = Arc::new(ArcSwap::from_pointee(kv_table(&[&a, &b], &registry)));
    let stop = tokio_util::sync::CancellationToken::new();
    let events = KvEvents::start(Arc::clone(&table), settings(), stop.clone());
    let instances = instance_ids(&["e0", "e1"]);
    let prompt = words(0, 40);
    place(&a, &prompt).await?;
    let index = variant_index(&events).await?;
    let hashes = prompt_hashes(&table.load(), &index, &prompt).await?;
    wait_index_matched(&index, &hashes, &instances, &[2, 0]).await?;

    // e0's publisher stalls: it stops answering, and after two failed probes its entries no
    // longer count (routing falls back to load for it).
    a.stall_kv_events(true);
    eventually(WAIT, "e0 marked stale", || {
        let stale = index.freshness(&instances[0]) == Some(Freshness::Stale);
        async move { stale }
    })
    .await?;
    assert_eq!(index.matched_blocks(&hashes, &instances), [0, 0]);
    assert_eq!(
        kv_choice(&[0, 0], 2, &[3, 1], prefix_key(&hashes)),
        (1, Some(Route::LeastOutstanding))
    );
    let (status, text) = http_get(&format!("{}/sim/kv-events", a.url)).await?;
    assert_eq!(status, 200);
    assert!(text.contains("\"stalled\":true"), "{text}");
    // Meanwhile e0 caches more; once its publisher resumes, the queued batches arrive in order.
    let later = words(7000, 40);
    place(&a, &later).await?;
    a.stall_kv_events(false);
    let later_hashes = prompt_hashes(&table.load(), &index, &later).await?;
    wait_index_matched(&index, &later_hashes, &instances, &[2, 0]).await?;
    wait_index_matched(&index, &hashes, &instances, &[2, 0]).await?;
    assert_eq!(index.freshness(&instances[0]), Some(Freshness::Live));

    // A killed engine goes stale too.
    b.killed().await;
    eventually(WAIT, "e1 marked stale", || {
        let stale = index.freshness(&instances[1]) == Some(Freshness::Stale);
        async move { stale }
    })
    .await?;
    stop.cancel();
    events.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn two_routers_fed_the_same_events_give_the_same_scores() -> anyhow::Result<()> {
    let sims = three_small_kv_sims().await?;
    let refs: Vec<&SimHandle> = sims.iter().collect();
    let registry = LoadRegistry::default();
    let table = Arc::new(ArcSwap::from_pointee(kv_table(&refs, &registry)));
    let stop = tokio_util::sync::CancellationToken::new();
    let first = KvEvents::start(Arc::clone(&table), settings(), stop.clone());
    // Prompts sharing starts of various lengths, spread over the engines; some evicted.
    let prompts = place_sharing_starts(&sims).await?;
    // The second router starts late: it learns the past from the replay buffers.
    let second = KvEvents::start(Arc::clone(&table), settings(), stop.clone());
    let (one, two) = (variant_index(&first).await?, variant_index(&second).await?);
    let instances = instance_ids(&["e0", "e1", "e2"]);
    for prompt in &prompts {
        let hashes = prompt_hashes(&table.load(), &one, prompt).await?;
        let expected = one.matched_blocks(&hashes, &instances);
        wait_index_matched(&two, &hashes, &instances, &expected).await?;
        let blocks = hashes.len() as u32;
        let key = prefix_key(&hashes);
        assert_eq!(
            kv_choice(&expected, blocks, &[1, 2, 0], key),
            kv_choice(
                &two.matched_blocks(&hashes, &instances),
                blocks,
                &[1, 2, 0],
                key
            )
        );
    }
    assert!(
        prompts.iter().enumerate().any(|(round, _)| round % 3 == 0),
        "sanity"
    );
    stop.cancel();
    first.shutdown().await;
    second.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn tokenize_failures_end_within_the_deadline_and_the_decision_falls_back_to_load()
-> anyhow::Result<()> {
    use switchyard_router::parts::TokenizeError;
    // An engine that accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let silent = format!("http://{}", listener.local_addr()?);
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let tokenizer = Tokenizer::new(Duration::from_millis(100));
    let body = bytes::Bytes::from_static(br#"{"prompt":"hello"}"#);
    let started = std::time::Instant::now();
    let err = tokenizer.tokenize(&silent, body.clone()).await.unwrap_err();
    assert!(matches!(err, TokenizeError::Timeout { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
    holder.abort();
    // Nobody listening (a port held bound, so no parallel test can take it meanwhile).
    let closed = RefusingPort::new()?;
    let err = tokenizer
        .tokenize(&closed.url(), body.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, TokenizeError::Request { .. }), "{err}");
    // An engine that refuses the request (unknown model: 404).
    let sim = switchyard_engine_sim::spawn(kv_sim(KvEventsFormat::Array, 100)).await?;
    let err = Tokenizer::default()
        .tokenize(
            &sim.url,
            bytes::Bytes::from_static(br#"{"model":"other","prompt":"x"}"#),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, TokenizeError::Status { status: 404, .. }),
        "{err}"
    );

    // Without token ids the decision is LEAST_OUTSTANDING_REQUESTS.
    let registry = LoadRegistry::default();
    let table = kv_table(&[&sim], &registry);
    let decision = switchyard_router::parts::decide(
        variant_route(&table),
        None,
        None,
        switchyard_kv::ChainKey::default(),
        0,
        1,
    );
    assert_eq!(decision.ranking.route, Some(Route::LeastOutstanding));
    assert_eq!(decision.cached_tokens, 0);
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn the_simulator_binary_reports_its_kv_event_ports_in_its_log_and_info_path()
-> anyhow::Result<()> {
    let mut child = tokio::process::Command::new(switchyard_tests::binary("switchyard-engine-sim"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--kv-events",
            "tcp://127.0.0.1:0",
            "--kv-events-replay",
            "tcp://127.0.0.1:0",
            "--kv-events-topic",
            "kv-events",
        ])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stderr.take().expect("piped")).lines();
    let (mut http, mut endpoint, mut replay) = (None, None, None);
    let read = async {
        while let Some(line) = lines.next_line().await? {
            let Ok(log) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            match log["message"].as_str() {
                Some("engine simulator listening") => {
                    http = log["addr"].as_str().map(str::to_owned)
                }
                Some("publishing KV-cache events") => {
                    endpoint = log["endpoint"].as_str().map(str::to_owned);
                    replay = log["replay"].as_str().map(str::to_owned);
                }
                _ => {}
            }
            if http.is_some() && endpoint.is_some() {
                break;
            }
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(20), read).await??;
    let (http, endpoint, replay) = (
        http.expect("the listening log line"),
        endpoint.expect("the KV events log line"),
        replay.expect("the replay endpoint"),
    );
    assert!(
        endpoint.starts_with("tcp://127.0.0.1:") && !endpoint.ends_with(":0"),
        "{endpoint}"
    );
    let (status, info) = http_get(&format!("http://{http}/sim/kv-events")).await?;
    assert_eq!(status, 200, "{info}");
    let info: Value = serde_json::from_str(&info)?;
    assert_eq!(info["endpoint"], endpoint.as_str());
    assert_eq!(info["replay_endpoint"], replay.as_str());
    assert_eq!(info["topic"], "kv-events");
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().expect("running").to_string()])
        .status();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await??;
    assert!(status.success(), "graceful exit on SIGTERM: {status}");
    Ok(())
}
