//! KV events as real engines publish them, through a real router: vLLM 0.32's and each SGLang
//! generation's structures and replay sockets (`tests/python/kv_publisher.py`, pyzmq and
//! msgspec), in front of simulators that answer the requests (their own events off). Each
//! case asserts what a client sees: the answer's `x-switchyard-instance`,
//! `x-switchyard-route` and `x-switchyard-cached-tokens`.
//!
//! The tests wait on the router's KV index only to know that the published events have
//! arrived; every decision checked is the router's own, on a request.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_engine_sim::SimHandle;
use switchyard_kv::{ChainKey, VariantIndex};
use switchyard_router::RouterHandle;
use switchyard_shared::InstanceId;
use switchyard_tests::{
    Metrics, Reply, eventually, fast, http_get, http_post, kv_variant_index, routed_choice,
    router_from_file, sim_tokens, test_python, wait_matched, wait_router_matched, words,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

const WAIT: Duration = Duration::from_secs(10);

/// One engine's KV-event publisher (`kv_publisher.py FLAVOR`).
struct Publisher {
    endpoint: String,
    replay: String,
    /// Data-parallel ranks (rank r on each port + r).
    ranks: u32,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    _child: Child,
}

impl Publisher {
    async fn spawn(flavor: &str) -> anyhow::Result<Self> {
        Self::spawn_ranks(flavor, 1).await
    }

    /// A data-parallel engine's `ranks` publishers, as vLLM binds them.
    async fn spawn_ranks(flavor: &str, ranks: u32) -> anyhow::Result<Self> {
        let mut child = tokio::process::Command::new(test_python())
            .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/kv_publisher.py"))
            .arg(flavor)
            .args(["--data-parallel-size", &ranks.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await??
            .ok_or_else(|| anyhow::anyhow!("the publisher printed nothing"))?;
        let info: Value = serde_json::from_str(&first)?;
        Ok(Self {
            endpoint: info["endpoint"].as_str().expect("endpoint").into(),
            replay: info["replay"].as_str().expect("replay").into(),
            ranks,
            stdin,
            lines,
            _child: child,
        })
    }

    async fn command(&mut self, command: Value) -> anyhow::Result<Value> {
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await?;
        self.stdin.flush().await?;
        let line = tokio::time::timeout(WAIT, self.lines.next_line())
            .await??
            .ok_or_else(|| anyhow::anyhow!("the publisher ended"))?;
        Ok(serde_json::from_str(&line)?)
    }

    /// Publishes one batch of `events`; returns its sequence number.
    async fn publish(&mut self, events: Vec<Value>) -> anyhow::Result<u64> {
        let answer = self.command(json!({"publish": events})).await?;
        Ok(answer["seq"].as_u64().expect("seq"))
    }

    /// Publishes one batch of `events` from data-parallel rank `rank`.
    async fn publish_rank(&mut self, rank: u32, events: Vec<Value>) -> anyhow::Result<u64> {
        let answer = self
            .command(json!({"publish": events, "rank": rank}))
            .await?;
        Ok(answer["seq"].as_u64().expect("seq"))
    }

    /// Puts a batch in the replay buffer without sending it live (a batch missed live).
    async fn buffer_only(&mut self, events: Vec<Value>) -> anyhow::Result<u64> {
        let answer = self
            .command(json!({"publish": events, "live": false}))
            .await?;
        Ok(answer["seq"].as_u64().expect("seq"))
    }

    async fn raw(&mut self, payload: &[u8]) -> anyhow::Result<u64> {
        let hex: String = payload.iter().map(|byte| format!("{byte:02x}")).collect();
        let answer = self.command(json!({ "raw": hex })).await?;
        Ok(answer["seq"].as_u64().expect("seq"))
    }

    /// A new run on the same ports: sequence from 0, an empty buffer.
    async fn restart(&mut self) -> anyhow::Result<()> {
        self.command(json!({"restart": true})).await?;
        Ok(())
    }
}

/// The engine hashes of `tokens`' full blocks: `base + j` for block `j` (an engine's own
/// hashes are opaque to the router; only their chaining matters).
fn hashes(tokens: &[u32], block_size: usize, base: u64) -> Vec<u64> {
    (0..(tokens.len() / block_size) as u64)
        .map(|j| base + j)
        .collect()
}

/// A BlockStored of all of `tokens`' full blocks from the root, as vLLM sends it after a
/// prefill (and again for every reuse under `kv_cache_report_mode` "full").
fn stored(tokens: &[u32], block_size: usize, base: u64) -> Value {
    let full = tokens.len() / block_size * block_size;
    json!({
        "type": "BlockStored",
        "block_hashes": hashes(tokens, block_size, base),
        "parent_block_hash": null,
        "token_ids": &tokens[..full],
        "block_size": block_size,
    })
}

/// One BlockRemoved per block, as vLLM sends them (one per evicted block).
fn removed_each(hashes: &[u64]) -> Vec<Value> {
    hashes
        .iter()
        .map(|hash| json!({"type": "BlockRemoved", "block_hashes": [hash]}))
        .collect()
}

fn with(mut event: Value, fields: Value) -> Value {
    for (key, value) in fields.as_object().expect("an object") {
        event[key] = value.clone();
    }
    event
}

/// A router from a static file routing endpoint `chat` (KV_AWARE) to `sims` as `e0`, `e1`,
/// …, following `publishers[i]` for `e{i}`, probing the replay sockets every 100 ms.
async fn router(
    dir: &std::path::Path,
    sims: &[&SimHandle],
    publishers: &[&Publisher],
) -> anyhow::Result<RouterHandle> {
    router_with(dir, sims, publishers, json!({})).await
}

/// [`router`] with more fields of the variant (its `LoraAdapters`).
async fn router_with(
    dir: &std::path::Path,
    sims: &[&SimHandle],
    publishers: &[&Publisher],
    variant_fields: Value,
) -> anyhow::Result<RouterHandle> {
    let instances: Vec<Value> = sims
        .iter()
        .zip(publishers)
        .enumerate()
        .map(|(index, (sim, publisher))| {
            let instance = json!({
                "Url": sim.url,
                "InstanceId": format!("e{index}"),
                "KvEvents": publisher.endpoint,
                "KvEventsReplay": publisher.replay,
            });
            match publisher.ranks {
                1 => instance,
                ranks => with(instance, json!({ "KvEventsDataParallelSize": ranks })),
            }
        })
        .collect();
    let variant = with(
        json!({"VariantName": "AllTraffic", "ModelName": "sim",
            "RoutingConfig": {"RoutingStrategy": "KV_AWARE"}}),
        variant_fields,
    );
    let file = json!({"Endpoints": [{
        "EndpointName": "chat",
        "ProductionVariants": [variant],
        "Instances": instances,
    }]});
    router_from_file(&dir.join("switchyard.json"), &file.to_string(), |config| {
        config.worker_threads = Some(2);
        config.kv.kv_events_probe_ms = 100;
    })
    .await
}

fn ids(count: usize) -> Vec<InstanceId> {
    (0..count)
        .map(|index| InstanceId::new(&format!("e{index}")).expect("an id"))
        .collect()
}

async fn index(router: &RouterHandle) -> anyhow::Result<Arc<VariantIndex>> {
    kv_variant_index(router, "chat", WAIT).await
}

/// The leading blocks of `tokens` that `index` says each of `sources` holds (a request's match
/// stops a token short of the end).
fn held_blocks(index: &VariantIndex, tokens: &[u32], sources: &[InstanceId]) -> Vec<u32> {
    index
        .request_hashes(tokens)
        .map(|hashes| index.matched_blocks(&hashes, sources))
        .unwrap_or_default()
}

/// Publishes `tokens`' full blocks from `e0` (`pa`) with the `fields` of a chain of its own
/// (a salt's or an adapter's extra keys) and plainly from `e1` (`pb`), and waits until the
/// router's index holds both: the plain chain on `e1` alone, the one of `key` on `e0` alone
/// (`what` names that wait). Returns the tokens of those full blocks.
async fn publish_keyed_and_plain(
    router: &RouterHandle,
    pa: &mut Publisher,
    pb: &mut Publisher,
    tokens: &[u32],
    fields: Value,
    key: ChainKey<'_>,
    what: &str,
) -> anyhow::Result<u32> {
    let blocks = (tokens.len() / 16) as u32;
    pa.publish(vec![with(stored(tokens, 16, 1), fields)])
        .await?;
    pb.publish(vec![stored(tokens, 16, 1)]).await?;
    wait_held(router, tokens, &[0, blocks]).await?;
    let index = index(router).await?;
    wait_matched(what, &vec![blocks, 0], || {
        index
            .match_prompt(tokens, key, &ids(2))
            .map(|found| found.matched)
            .unwrap_or_default()
    })
    .await?;
    Ok(blocks * 16)
}

/// Waits until the router's index says each instance holds `matched` leading blocks of
/// `tokens` (the events have arrived).
async fn wait_held(router: &RouterHandle, tokens: &[u32], matched: &[u32]) -> anyhow::Result<()> {
    wait_router_matched(router, tokens, &ids(matched.len()), matched).await
}

/// (instance, route, cached tokens) of `prompt` completed through the router.
async fn route(router: &RouterHandle, prompt: &str) -> anyhow::Result<(String, String, u32)> {
    route_with(router, prompt, json!({})).await
}

/// [`route`] with more body fields (a `cache_salt`).
async fn route_with(
    router: &RouterHandle,
    prompt: &str,
    fields: Value,
) -> anyhow::Result<(String, String, u32)> {
    let body = with(
        json!({"model": "sim", "prompt": prompt, "max_tokens": 2}),
        fields,
    );
    let reply: Reply = http_post(
        &format!("{}/endpoints/chat/openai/v1/completions", router.url()),
        &[],
        body.to_string(),
    )
    .await?;
    anyhow::ensure!(reply.status == 200, "routed request failed: {}", reply.body);
    let (instance, route, cached) = routed_choice(&reply);
    Ok((instance, route, cached.unwrap_or(0)))
}

async fn tokens(sim: &SimHandle, prompt: &str) -> anyhow::Result<Vec<u32>> {
    sim_tokens(sim, json!({"model": "sim", "prompt": prompt})).await
}

/// A prompt of `count` words (`words(0, count)`) and its token ids as `sim` counts them.
async fn prompt_and_tokens(sim: &SimHandle, count: usize) -> anyhow::Result<(String, Vec<u32>)> {
    let prompt = words(0, count);
    let tokens = tokens(sim, &prompt).await?;
    Ok((prompt, tokens))
}

/// Two simulators answering requests (their own KV events off).
async fn engines() -> anyhow::Result<(SimHandle, SimHandle)> {
    Ok((
        switchyard_engine_sim::spawn(fast()).await?,
        switchyard_engine_sim::spawn(fast()).await?,
    ))
}

/// Two vLLM 0.32 publishers, one for each of two engines.
async fn vllm_publishers() -> anyhow::Result<(Publisher, Publisher)> {
    Ok((
        Publisher::spawn("vllm-0.32").await?,
        Publisher::spawn("vllm-0.32").await?,
    ))
}

/// Two simulators answering requests ([`engines`]), a vLLM 0.32 publisher for each, and a
/// router following them as `e0` and `e1` ([`router`]): the folder of its static file, the
/// engines, their publishers, the router.
async fn vllm_pair() -> anyhow::Result<(
    tempfile::TempDir,
    SimHandle,
    SimHandle,
    Publisher,
    Publisher,
    RouterHandle,
)> {
    let dir = tempfile::tempdir()?;
    let (a, b) = engines().await?;
    let (pa, pb) = vllm_publishers().await?;
    let router = router(dir.path(), &[&a, &b], &[&pa, &pb]).await?;
    Ok((dir, a, b, pa, pb, router))
}

fn not_kv(choice: &(String, String, u32)) -> bool {
    choice.1 != "kv" && choice.2 == 0
}

#[tokio::test]
async fn vllm_reuse_reports_leave_no_phantom_blocks() -> anyhow::Result<()> {
    let (_dir, a, _b, mut pa, _pb, router) = vllm_pair().await?;
    let (prompt, prompt_tokens) = prompt_and_tokens(&a, 70).await?;
    let blocks = (prompt_tokens.len() / 16) as u32;
    assert!(blocks >= 4, "{} tokens", prompt_tokens.len());

    // A prefill, then three requests reusing the prefix under kv_cache_report_mode "full":
    // vLLM re-sends BlockStored for the reused blocks each time.
    for _ in 0..4 {
        pa.publish(vec![stored(&prompt_tokens, 16, 1000)]).await?;
    }
    wait_held(&router, &prompt_tokens, &[blocks, 0]).await?;
    assert_eq!(
        route(&router, &prompt).await?,
        ("e0".into(), "kv".into(), blocks * 16)
    );
    // The prefix is evicted: one BlockRemoved per block, as vLLM sends them.
    pa.publish(removed_each(&hashes(&prompt_tokens, 16, 1000)))
        .await?;
    wait_held(&router, &prompt_tokens, &[0, 0]).await?;
    let choice = route(&router, &prompt).await?;
    assert!(not_kv(&choice), "a phantom prefix: {choice:?}");
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn an_undecodable_batch_is_skipped_counted_and_never_replayed_in_a_loop() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let (a, b) = engines().await?;
    let (mut pa, pb) = vllm_publishers().await?;
    let first = words(0, 40);
    let first_tokens = tokens(&a, &first).await?;
    let second = words(500, 40);
    let second_tokens = tokens(&a, &second).await?;
    // In the buffer before the router comes (its start-up replay reads it), then live.
    pa.publish(vec![stored(&first_tokens, 16, 1)]).await?;
    pa.raw(&[0x93, 0xcb, 0x41]).await?; // a batch cut short
    let router = router(dir.path(), &[&a, &b], &[&pa, &pb]).await?;
    let held = (first_tokens.len() / 16) as u32;
    wait_held(&router, &first_tokens, &[held, 0]).await?;
    pa.raw(b"not msgpack at all").await?;
    // A readable batch with one unreadable event: the other events count.
    pa.publish(vec![
        json!({"as_is": {"type": "BlockStored", "block_hashes": "oops"}}),
        stored(&second_tokens, 16, 100),
    ])
    .await?;
    wait_held(&router, &second_tokens, &[held, 0]).await?;
    assert_eq!(
        route(&router, &first).await?,
        ("e0".into(), "kv".into(), held * 16)
    );
    assert_eq!(
        route(&router, &second).await?,
        ("e0".into(), "kv".into(), held * 16)
    );
    // Several probes later (each asks the replay socket from the next sequence number), the
    // poison batches are still counted once each and nothing was rebuilt.
    let probes_before = Metrics::scrape(&router.url())
        .await?
        .value("switchyard_kv_event_batches_total")?;
    pa.publish(vec![]).await?;
    eventually(WAIT, "the empty batch after the poison", || {
        let url = router.url();
        async move {
            Metrics::scrape(&url)
                .await
                .ok()
                .and_then(|metrics| metrics.get("switchyard_kv_event_batches_total"))
                .is_some_and(|batches| batches > probes_before)
        }
    })
    .await?;
    let metrics = Metrics::scrape(&router.url()).await?;
    let e0 = r#"{endpoint="chat",variant="AllTraffic",instance="e0"}"#;
    assert_eq!(
        metrics.value(&format!("switchyard_kv_undecodable_batches_total{e0}"))?,
        2.0
    );
    assert_eq!(
        metrics.value(&format!("switchyard_kv_malformed_events_total{e0}"))?,
        1.0
    );
    assert_eq!(metrics.value("switchyard_kv_rebuilds_total")?, 0.0);
    assert_eq!(
        metrics.value("switchyard_kv_gaps_repaired_total")?,
        0.0,
        "the start-up catch-up is no repair"
    );
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn an_engine_restart_drops_the_old_run_and_fetches_the_new_runs_missed_batches()
-> anyhow::Result<()> {
    // (live batches of the new run the router first sees, missed ones before them)
    for (new_run_missed, label) in [(1u64, "sequence backwards"), (4, "sequence past the old")] {
        let (_dir, a, _b, mut pa, _pb, router) = vllm_pair().await?;
        let old = words(0, 40);
        let old_tokens = tokens(&a, &old).await?;
        let new = words(900, 40);
        let new_tokens = tokens(&a, &new).await?;
        let blocks = (old_tokens.len() / 16) as u32;
        for round in 0..2 {
            pa.publish(vec![stored(&old_tokens, 16, 10 + round)])
                .await?;
        }
        wait_held(&router, &old_tokens, &[blocks, 0]).await?;

        pa.restart().await?;
        // The new run's first batches go out before the router's subscription is back.
        pa.buffer_only(vec![stored(&new_tokens, 16, 5000)]).await?;
        for _ in 1..new_run_missed {
            pa.buffer_only(vec![]).await?;
        }
        // Live from here: empty batches until the router follows the new run (the
        // subscription reconnects on its own schedule, and what it misses live is lost).
        let index = index(&router).await?;
        let e = ids(2);
        let follows_new_run = || {
            let held_new = index
                .match_tokens(&new_tokens, &e)
                .is_some_and(|found| found.matched == [blocks, 0]);
            let held_old = index
                .match_tokens(&old_tokens, &e)
                .is_some_and(|found| found.matched[0] > 0);
            held_new && !held_old
        };
        let mut live = 0;
        while !follows_new_run() {
            anyhow::ensure!(live < 100, "{label}: the router never followed the new run");
            pa.publish(vec![]).await?;
            live += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let choice = route(&router, &old).await?;
        assert!(
            not_kv(&choice),
            "{label}: the dead run's prefix: {choice:?}"
        );
        assert_eq!(
            route(&router, &new).await?,
            ("e0".into(), "kv".into(), blocks * 16),
            "{label}: the new run's batch missed live"
        );
        router.shutdown().await;
    }
    Ok(())
}

#[tokio::test]
async fn a_hybrid_model_is_routed_by_its_full_attention_group() -> anyhow::Result<()> {
    let (_dir, a, _b, mut pa, _pb, router) = vllm_pair().await?;
    let (prompt, prompt_tokens) = prompt_and_tokens(&a, 140).await?;
    let blocks = (prompt_tokens.len() / 64) as u32;
    assert!(blocks >= 2);
    let hashes = hashes(&prompt_tokens, 64, 1);
    // First a partial-block entry (hash-block granularity, 16 tokens), then group 0, a sliding
    // window, and group 1, full attention, store the prompt at 64-token blocks.
    let partial = json!({"type": "BlockStored", "block_hashes": [77], "parent_block_hash": null,
        "token_ids": &prompt_tokens[..16], "block_size": 16, "group_idx": 1});
    pa.publish(vec![
        partial,
        with(
            stored(&prompt_tokens, 64, 1),
            json!({"group_idx": 0, "kv_cache_spec_kind": "sliding_window",
                "kv_cache_spec_sliding_window": 64}),
        ),
        with(stored(&prompt_tokens, 64, 1), json!({"group_idx": 1})),
        with(
            stored(&prompt_tokens, 64, 1),
            json!({"group_idx": 2, "kv_cache_spec_kind": "mamba"}),
        ),
    ])
    .await?;
    // The window slides past the first block; the mamba state moves on.
    pa.publish(vec![
        json!({"type": "BlockRemoved", "block_hashes": [hashes[0]], "group_idx": 0}),
        json!({"type": "BlockRemoved", "block_hashes": &hashes, "group_idx": 2}),
    ])
    .await?;
    pa.publish(vec![]).await?;
    wait_held(&router, &prompt_tokens, &[blocks, 0]).await?;
    assert_eq!(index(&router).await?.block_size(), Some(64));
    assert_eq!(
        route(&router, &prompt).await?,
        ("e0".into(), "kv".into(), blocks * 64)
    );
    // The full-attention group's eviction is what counts.
    pa.publish(vec![
        json!({"type": "BlockRemoved", "block_hashes": [hashes[0]], "group_idx": 1}),
    ])
    .await?;
    wait_held(&router, &prompt_tokens, &[0, 0]).await?;
    assert!(not_kv(&route(&router, &prompt).await?));
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn every_sglang_generation_routes_at_page_size_1() -> anyhow::Result<()> {
    for flavor in ["sglang-0", "sglang-medium", "sglang-map", "sglang-0.5.23"] {
        let dir = tempfile::tempdir()?;
        let (a, b) = engines().await?;
        let (mut pa, mut pb) = (
            Publisher::spawn(flavor).await?,
            Publisher::spawn(flavor).await?,
        );
        let router = router(dir.path(), &[&a, &b], &[&pa, &pb]).await?;
        let plain = words(0, 30);
        let plain_tokens = tokens(&a, &plain).await?;
        let eagle = words(300, 30);
        let eagle_tokens = tokens(&a, &eagle).await?;
        let salted = words(600, 30);
        let salted_tokens = tokens(&a, &salted).await?;
        let n = plain_tokens.len() as u32;
        let mut events = vec![stored(&plain_tokens, 1, 1)];
        if flavor != "sglang-0" {
            // A salted prefix (BlockStoredWithMetadata, or cache_salt in the map) beside it:
            // it decodes, and a request without the salt is not sent there for it.
            events.push(with(
                stored(&salted_tokens, 1, 100),
                json!({"cache_salt": "tenant-a"}),
            ));
        }
        pa.publish(events).await?;
        // EAGLE's bigram pages on the other engine.
        pb.publish(vec![with(
            stored(&eagle_tokens, 1, 200),
            json!({"bigram": true}),
        )])
        .await?;
        wait_held(&router, &plain_tokens, &[n, 0]).await?;
        wait_held(&router, &eagle_tokens, &[0, eagle_tokens.len() as u32]).await?;
        assert_eq!(index(&router).await?.block_size(), Some(1), "{flavor}");
        // The engine computes the last prompt token again (SGLang as vLLM).
        assert_eq!(
            route(&router, &plain).await?,
            ("e0".into(), "kv".into(), n - 1),
            "{flavor}"
        );
        assert_eq!(
            route(&router, &eagle).await?,
            ("e1".into(), "kv".into(), eagle_tokens.len() as u32 - 1),
            "{flavor}"
        );
        let choice = route(&router, &salted).await?;
        assert!(
            not_kv(&choice),
            "{flavor}: salted blocks matched: {choice:?}"
        );
        if flavor != "sglang-0" {
            let salt = |salt: &str| json!({ "cache_salt": salt });
            assert_eq!(
                route_with(&router, &salted, salt("tenant-a")).await?,
                ("e0".into(), "kv".into(), salted_tokens.len() as u32 - 1),
                "{flavor}: the salted request"
            );
            let other = route_with(&router, &salted, salt("tenant-b")).await?;
            assert!(not_kv(&other), "{flavor}: another salt matched: {other:?}");
        }
        // An eviction, as SGLang sends it (one BlockRemoved per radix node).
        pa.publish(vec![json!({"type": "BlockRemoved",
            "block_hashes": hashes(&plain_tokens, 1, 1)})])
            .await?;
        wait_held(&router, &plain_tokens, &[0, 0]).await?;
        assert!(not_kv(&route(&router, &plain).await?), "{flavor}");
        let metrics = Metrics::scrape(&router.url()).await?;
        assert_eq!(metrics.sum("switchyard_kv_undecodable_batches_total"), 0.0);
        assert_eq!(metrics.sum("switchyard_kv_malformed_events_total"), 0.0);
        router.shutdown().await;
    }
    Ok(())
}

#[tokio::test]
async fn every_block_size_an_engine_publishes_is_routed_exactly() -> anyhow::Result<()> {
    let (a, b) = engines().await?;
    let (prompt, prompt_tokens) = prompt_and_tokens(&a, 600).await?;
    assert!(prompt_tokens.len() >= 512);
    for block_size in [1usize, 16, 32, 64, 128, 256] {
        let dir = tempfile::tempdir()?;
        let (mut pa, mut pb) = vllm_publishers().await?;
        let router = router(dir.path(), &[&a, &b], &[&pa, &pb]).await?;
        let blocks = (prompt_tokens.len() / block_size) as u32;
        // e0 holds the whole prompt; e1 its first half, in two chained events.
        pa.publish(vec![stored(&prompt_tokens, block_size, 1)])
            .await?;
        let half = prompt_tokens.len() / block_size / 2 * block_size;
        let first_quarter = half / block_size / 2 * block_size;
        pb.publish(vec![
            stored(&prompt_tokens[..first_quarter], block_size, 9000),
            json!({"type": "BlockStored",
                "block_hashes": (first_quarter / block_size..half / block_size).map(|j| 9000 + j as u64).collect::<Vec<_>>(),
                "parent_block_hash": if first_quarter == 0 { Value::Null } else { json!(9000 + first_quarter as u64 / block_size as u64 - 1) },
                "token_ids": &prompt_tokens[first_quarter..half], "block_size": block_size}),
        ])
        .await?;
        wait_held(
            &router,
            &prompt_tokens,
            &[blocks, (half / block_size) as u32],
        )
        .await?;
        // What the engine reuses: its blocks before the one holding the last prompt token.
        let reused = ((prompt_tokens.len() - 1) / block_size * block_size) as u32;
        assert_eq!(
            route(&router, &prompt).await?,
            ("e0".into(), "kv".into(), reused),
            "block size {block_size}"
        );
        router.shutdown().await;
    }
    Ok(())
}

#[tokio::test]
async fn a_salted_request_routes_to_the_prefix_cached_under_its_salt() -> anyhow::Result<()> {
    let (_dir, a, _b, mut pa, mut pb, router) = vllm_pair().await?;
    let (prompt, prompt_tokens) = prompt_and_tokens(&a, 70).await?;
    let blocks = prompt_tokens.len() / 16;
    // vLLM 0.32 publishes a request's cache_salt as its first block's extra key.
    let mut extra: Vec<Value> = vec![Value::Null; blocks];
    extra[0] = json!(["tenant-a"]);
    let salted = ChainKey {
        cache_salt: Some("tenant-a"),
        ..ChainKey::default()
    };
    let full = publish_keyed_and_plain(
        &router,
        &mut pa,
        &mut pb,
        &prompt_tokens,
        json!({ "extra_keys": extra }),
        salted,
        "the salted chain in the index",
    )
    .await?;
    assert_eq!(
        route_with(&router, &prompt, json!({"cache_salt": "tenant-a"})).await?,
        ("e0".into(), "kv".into(), full)
    );
    assert_eq!(
        route(&router, &prompt).await?,
        ("e1".into(), "kv".into(), full)
    );
    let other = route_with(&router, &prompt, json!({"cache_salt": "tenant-b"})).await?;
    assert!(not_kv(&other), "another tenant's salt: {other:?}");
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_request_for_a_lora_adapter_routes_to_the_adapters_prefix() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let lora = || switchyard_engine_sim::SimConfig {
        lora_modules: vec!["sql-lora=/adapters/sql".into()],
        ..fast()
    };
    let (a, b) = (
        switchyard_engine_sim::spawn(lora()).await?,
        switchyard_engine_sim::spawn(lora()).await?,
    );
    let (mut pa, mut pb) = vllm_publishers().await?;
    let router = router_with(
        dir.path(),
        &[&a, &b],
        &[&pa, &pb],
        json!({"LoraAdapters": ["sql-lora"]}),
    )
    .await?;
    let (prompt, prompt_tokens) = prompt_and_tokens(&a, 70).await?;
    let blocks = prompt_tokens.len() / 16;
    // vLLM 0.32 publishes an adapter's blocks with its lora_id and lora_name, and the name
    // first among every block's extra keys.
    let adapter_keys: Vec<Value> = vec![json!(["sql-lora"]); blocks];
    let adapter = ChainKey {
        lora_name: Some("sql-lora"),
        ..ChainKey::default()
    };
    let fields = json!({"lora_id": 1, "lora_name": "sql-lora", "extra_keys": adapter_keys});
    let full = publish_keyed_and_plain(
        &router,
        &mut pa,
        &mut pb,
        &prompt_tokens,
        fields,
        adapter,
        "the adapter's chain in the index",
    )
    .await?;
    assert_eq!(
        route_with(&router, &prompt, json!({"model": "sql-lora"})).await?,
        ("e0".into(), "kv".into(), full),
        "the adapter's request goes where the adapter's prefix is"
    );
    assert_eq!(
        route(&router, &prompt).await?,
        ("e1".into(), "kv".into(), full),
        "the base model's request goes where the base model's prefix is"
    );
    // A name the variant does not list is the ModelName's request, as before.
    assert_eq!(
        route_with(&router, &prompt, json!({"model": "other"})).await?,
        ("e1".into(), "kv".into(), full)
    );
    let models: Vec<Option<String>> = a
        .received()
        .iter()
        .chain(b.received().iter())
        .map(|request| request.model.clone())
        .collect();
    assert_eq!(
        models
            .iter()
            .filter(|model| model.as_deref() == Some("sql-lora"))
            .count(),
        1,
        "the adapter's name is kept upstream, every other becomes ModelName: {models:?}"
    );
    assert!(
        models
            .iter()
            .all(|model| matches!(model.as_deref(), Some("sql-lora" | "sim"))),
        "{models:?}"
    );
    // The adapter is a model of the router's /v1 paths too.
    let listed = http_get(&format!("{}/v1/models", router.url())).await?;
    assert!(listed.1.contains("\"sql-lora\""), "{}", listed.1);
    let plain = http_post(
        &format!("{}/v1/completions", router.url()),
        &[],
        json!({"model": "sql-lora", "prompt": prompt, "max_tokens": 2}).to_string(),
    )
    .await?;
    assert_eq!(plain.status, 200, "{}", plain.body);
    assert_eq!(plain.header("x-switchyard-instance"), Some("e0"));
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn an_engine_announcing_a_huge_frame_is_cut_off_and_the_router_keeps_serving()
-> anyhow::Result<()> {
    // zeromq would reserve what the frame header claims (2^40 bytes) and abort the router;
    // the frame guard cuts the connection at the header instead.
    let evil = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("tcp://{}", evil.local_addr()?);
    let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&connections);
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = evil.accept().await else {
                return;
            };
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
                greeting.extend_from_slice(b"NULL");
                greeting.resize(64, 0);
                greeting.push(0x06);
                greeting.extend_from_slice(&(1u64 << 40).to_be_bytes());
                let _ = socket.write_all(&greeting).await;
                // Held open: only the router can end it.
                let mut sink = [0u8; 1024];
                while matches!(tokio::io::AsyncReadExt::read(&mut socket, &mut sink).await, Ok(n) if n > 0)
                {
                }
            });
        }
    });
    let sim = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let file = json!({"Endpoints": [{
        "EndpointName": "chat",
        "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": "sim",
            "RoutingConfig": {"RoutingStrategy": "KV_AWARE"}}],
        "Instances": [{"Url": sim.url, "InstanceId": "e0", "KvEvents": endpoint}],
    }]});
    let router = router_from_file(
        &dir.path().join("switchyard.json"),
        &file.to_string(),
        |config| {
            config.worker_threads = Some(2);
        },
    )
    .await?;
    // Cut and dialled again: the router is alive and still following.
    eventually(
        WAIT,
        "the router to dial the engine again after the cut",
        || {
            let seen = connections.load(std::sync::atomic::Ordering::SeqCst);
            async move { seen >= 2 }
        },
    )
    .await?;
    let (instance, _, cached) = route(&router, &words(0, 40)).await?;
    assert_eq!((instance.as_str(), cached), ("e0", 0));
    router.shutdown().await;
    server.abort();
    Ok(())
}

#[tokio::test]
async fn a_data_parallel_engine_is_followed_per_rank_and_sent_to_the_rank_holding_the_prefix()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // e0 is a data-parallel server of 2 ranks (vLLM's --data-parallel-size 2: rank r publishes
    // on each port + r); e1 an engine of one.
    let a = switchyard_engine_sim::spawn(switchyard_engine_sim::SimConfig {
        data_parallel_size: 2,
        ..fast()
    })
    .await?;
    let b = switchyard_engine_sim::spawn(fast()).await?;
    let (mut pa, mut pb) = (
        Publisher::spawn_ranks("vllm-0.32", 2).await?,
        Publisher::spawn("vllm-0.32").await?,
    );
    let router = router(dir.path(), &[&a, &b], &[&pa, &pb]).await?;
    let (one, zero, other) = (words(0, 70), words(1, 70), words(2, 70));
    let (one_tokens, zero_tokens, other_tokens) = (
        tokens(&a, &one).await?,
        tokens(&a, &zero).await?,
        tokens(&a, &other).await?,
    );
    let full = |tokens: &[u32]| (tokens.len() / 16 * 16) as u32;
    // What a prompt whose blocks e0's `rank` holds gets: KV routing there, all of them cached.
    let on_e0_rank = |tokens: &[u32], rank: &str| {
        (
            "e0".to_owned(),
            "kv".to_owned(),
            full(tokens),
            Some(rank.to_owned()),
        )
    };
    pa.publish_rank(1, vec![stored(&one_tokens, 16, 1)]).await?;
    pa.publish_rank(0, vec![stored(&zero_tokens, 16, 100)])
        .await?;
    pb.publish(vec![stored(&other_tokens, 16, 1)]).await?;
    let index = index(&router).await?;
    let e0 = InstanceId::new("e0")?;
    let sources = [
        e0.data_parallel_rank(0),
        e0.data_parallel_rank(1),
        ids(2)[1].clone(),
    ];
    for (tokens, held) in [
        (&one_tokens, [0, 1, 0]),
        (&zero_tokens, [1, 0, 0]),
        (&other_tokens, [0, 0, 1]),
    ] {
        let blocks = (tokens.len() / 16) as u32;
        let want: Vec<u32> = held.iter().map(|&held| held * blocks).collect();
        wait_matched("each rank's events in the index", &want, || {
            held_blocks(&index, tokens, &sources)
        })
        .await?;
    }

    // (instance, route, cached tokens, rank on the answer, rank the engine received)
    let send = |prompt: String, client_rank: Option<&'static str>| {
        let router = router.url();
        async move {
            let headers: Vec<(&str, &str)> = client_rank
                .map(|rank| vec![("x-data-parallel-rank", rank)])
                .unwrap_or_default();
            let reply: Reply = http_post(
                &format!("{router}/endpoints/chat/openai/v1/completions"),
                &headers,
                json!({"model": "sim", "prompt": prompt, "max_tokens": 2}).to_string(),
            )
            .await?;
            anyhow::ensure!(reply.status == 200, "routed request failed: {}", reply.body);
            let (instance, route, cached) = routed_choice(&reply);
            let rank = reply
                .header("x-switchyard-data-parallel-rank")
                .map(str::to_owned);
            Ok::<_, anyhow::Error>((instance, route, cached.unwrap_or(0), rank))
        }
    };
    let last_rank = |sim: &SimHandle| {
        sim.received()
            .last()
            .and_then(|request| request.headers.get("x-data-parallel-rank").cloned())
    };
    assert_eq!(
        send(one.clone(), None).await?,
        on_e0_rank(&one_tokens, "1"),
        "the prefix rank 1 holds goes to e0's rank 1"
    );
    assert_eq!(
        last_rank(&a).as_deref(),
        Some("1"),
        "vLLM's header names the rank"
    );
    // A client's own rank is replaced by the router's.
    assert_eq!(
        send(zero.clone(), Some("1")).await?,
        on_e0_rank(&zero_tokens, "0")
    );
    assert_eq!(last_rank(&a).as_deref(), Some("0"));
    // An engine of one rank gets no rank; nor does a prompt no rank holds (vLLM's own
    // balancer picks), and a client's header never reaches the engine.
    assert_eq!(
        send(other.clone(), Some("7")).await?,
        ("e1".into(), "kv".into(), full(&other_tokens), None)
    );
    assert_eq!(last_rank(&b), None);
    for seed in 10..14 {
        let (instance, _, cached, rank) = send(words(seed, 70), Some("1")).await?;
        assert_eq!((cached, rank), (0, None), "{instance}");
        let sim = if instance == "e0" { &a } else { &b };
        assert_eq!(last_rank(sim), None, "{instance}");
    }
    // Each rank is its own stream: a restart of rank 1 drops rank 1's blocks only.
    pa.command(json!({"restart": true, "rank": 1})).await?;
    pa.publish_rank(1, vec![]).await?;
    eventually(WAIT, "rank 1's old run dropped", || {
        let held = held_blocks(&index, &one_tokens, &sources);
        async move { held.get(1) == Some(&0) }
    })
    .await?;
    assert_eq!(
        send(zero.clone(), None).await?,
        on_e0_rank(&zero_tokens, "0"),
        "rank 0's blocks outlive rank 1's restart"
    );
    // Each rank is an instance of the index's metrics.
    let metrics = Metrics::scrape(&router.url()).await?;
    let blocks = |instance: &str| {
        metrics.get(&format!(
            r#"switchyard_kv_index_blocks{{endpoint="chat",variant="AllTraffic",instance="{instance}"}}"#
        ))
    };
    assert_eq!(blocks("e0#dp0"), Some((zero_tokens.len() / 16) as f64));
    assert_eq!(blocks("e1"), Some((other_tokens.len() / 16) as f64));
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_rank_the_engine_does_not_have_is_sent_again_without_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Registered with 2 ranks, but the engine runs 1 (vLLM refuses rank 1 with a 400).
    let a = switchyard_engine_sim::spawn(fast()).await?;
    let mut pa = Publisher::spawn_ranks("vllm-0.32", 2).await?;
    let router = router(dir.path(), &[&a], &[&pa]).await?;
    let (prompt, prompt_tokens) = prompt_and_tokens(&a, 70).await?;
    pa.publish_rank(1, vec![stored(&prompt_tokens, 16, 1)])
        .await?;
    let index = index(&router).await?;
    let rank_1 = [InstanceId::new("e0")?.data_parallel_rank(1)];
    let blocks = (prompt_tokens.len() / 16) as u32;
    wait_matched("rank 1's events in the index", &vec![blocks], || {
        held_blocks(&index, &prompt_tokens, &rank_1)
    })
    .await?;
    let reply: Reply = http_post(
        &format!("{}/endpoints/chat/openai/v1/completions", router.url()),
        &[],
        json!({"model": "sim", "prompt": prompt, "max_tokens": 2}).to_string(),
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-switchyard-data-parallel-rank"), None);
    let ranks: Vec<Option<String>> = a
        .received()
        .iter()
        .map(|request| request.headers.get("x-data-parallel-rank").cloned())
        .collect();
    assert_eq!(
        ranks,
        [Some("1".to_owned()), None],
        "refused with rank 1, then served without a rank"
    );
    router.shutdown().await;
    Ok(())
}
