//! LMCACHE_PD (current LMCache's PD protocol) end to end: routers in front of simulated
//! LMCache PD senders (prefill) and receivers (decode) that hand the KV cache over their own
//! ZMQ sockets and notify the router's notice socket, as LMCache's PD backend does. Two
//! routers share one notice address (the prefillers name router A's): router B's notices
//! reach A and are relayed.

use std::net::TcpListener;

use serde_json::{Value, json};
use switchyard_engine_sim::{InstanceRole, SimConfig, SimHandle};
use switchyard_router::RouterHandle;
use switchyard_tests::*;

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `setup` (which takes its ports with [`free_port`] and binds them later: the notice socket,
/// the receivers) tried again, up to 5 times, while another test took one of its ports in
/// between.
async fn with_free_ports<T, F>(mut setup: impl FnMut() -> F) -> anyhow::Result<T>
where
    F: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut attempt = 1;
    loop {
        match setup().await {
            Err(err) if attempt < 5 && format!("{err:#}").contains("Address already in use") => {
                attempt += 1;
            }
            done => return done,
        }
    }
}

const CONFIG: &str = "{PrefillVariantName: prefill, DecodeVariantName: decode, KvTransferProtocol: LMCACHE_PD, RouteThreshold: 16, PrefillTimeoutSeconds: 2}";

struct Fleet {
    prefill: Vec<SimHandle>,
    decode: Vec<SimHandle>,
    /// Each decoder's alloc port.
    alloc: Vec<u16>,
}

/// Two LMCache PD senders notifying `proxy`, two receivers.
async fn fleet(proxy: &str, drop_notices: bool) -> anyhow::Result<Fleet> {
    fleet_with(proxy, drop_notices, false).await
}

/// [`fleet`], the senders' first token ending each answer if `first_token_stops`.
async fn fleet_with(
    proxy: &str,
    drop_notices: bool,
    first_token_stops: bool,
) -> anyhow::Result<Fleet> {
    fleet_of(proxy, drop_notices, first_token_stops, 0.0).await
}

/// [`fleet_with`], the receivers failing `load_fail_rate` of their loads of pushed KV (with
/// vLLM's default kv_load_failure_policy, "fail": the request fails).
async fn fleet_of(
    proxy: &str,
    drop_notices: bool,
    first_token_stops: bool,
    load_fail_rate: f64,
) -> anyhow::Result<Fleet> {
    let mut fleet = Fleet {
        prefill: Vec::new(),
        decode: Vec::new(),
        alloc: Vec::new(),
    };
    for _ in 0..2 {
        let port = free_port()?;
        fleet.decode.push(
            switchyard_engine_sim::spawn(SimConfig {
                role: InstanceRole::Decode,
                time_scale: 0.002,
                lmcache_receiver_alloc_ports: vec![port],
                kv_pull_fail_rate: load_fail_rate,
                ..SimConfig::default()
            })
            .await?,
        );
        fleet.alloc.push(port);
        fleet.prefill.push(
            switchyard_engine_sim::spawn(SimConfig {
                role: InstanceRole::Prefill,
                time_scale: 0.002,
                lmcache_pd_proxy: Some(proxy.to_owned()),
                lmcache_drop_notices: drop_notices,
                lmcache_first_token_stops: first_token_stops,
                ..SimConfig::default()
            })
            .await?,
        );
    }
    Ok(fleet)
}

/// What the decoders register as their LMCache receivers.
#[derive(Clone, Copy)]
enum Receivers {
    /// Each its own receiver (host, init and alloc ports).
    Registered,
    /// The same, with `BufferTokens` this small.
    Buffer(u32),
    /// None at all.
    Absent,
}

/// A router over `fleet` (its first `prefillers` prefill engines and first `decoders` decode
/// engines, registered as `receivers` says) with its notice socket at `notice_port` (None: no
/// notice socket).
async fn router_over(
    dir: &tempfile::TempDir,
    name: &str,
    fleet: &Fleet,
    (prefillers, decoders): (usize, usize),
    receivers: Receivers,
    notice_port: Option<u16>,
) -> anyhow::Result<RouterHandle> {
    let mut instances = String::new();
    for (index, sim) in fleet.prefill.iter().take(prefillers).enumerate() {
        instances.push_str(&format!(
            "      - {{Url: \"{}\", InstanceId: p{index}, VariantName: prefill, Role: prefill}}\n",
            sim.url
        ));
    }
    for (index, sim) in fleet.decode.iter().take(decoders).enumerate() {
        let (init, alloc) = (fleet.alloc[index] + 1, fleet.alloc[index]);
        let receiver = match receivers {
            Receivers::Registered => format!(
                ", LmcacheReceiver: {{Host: 127.0.0.1, InitPorts: [{init}], AllocPorts: [{alloc}]}}"
            ),
            Receivers::Buffer(tokens) => format!(
                ", LmcacheReceiver: {{Host: 127.0.0.1, InitPorts: [{init}], AllocPorts: [{alloc}], BufferTokens: {tokens}}}"
            ),
            Receivers::Absent => String::new(),
        };
        instances.push_str(&format!(
            "      - {{Url: \"{}\", InstanceId: d{index}, VariantName: decode, Role: decode{receiver}}}\n",
            sim.url
        ));
    }
    let yaml = format!(
        "Endpoints:\n  - EndpointName: pd\n    ProductionVariants:\n      - {{VariantName: prefill, ModelName: sim}}\n      - {{VariantName: decode, ModelName: sim}}\n    DisaggregationConfig: {CONFIG}\n    Instances:\n{instances}"
    );
    router_from_file(&dir.path().join(format!("{name}.yaml")), &yaml, |config| {
        config.lmcache_notice_bind = notice_port.map(|port| format!("tcp://127.0.0.1:{port}"));
        // These tests assert which way a request went; on a loaded 2-core CI machine a
        // connection to a simulator once took past the default 2 s and the request was retried
        // elsewhere (`route: retry`). Connection failures are tested elsewhere.
        config.connect_timeout_ms = 10_000;
    })
    .await
}

/// A router over the whole `fleet` with its notice socket at `notice_port`.
async fn router(
    dir: &tempfile::TempDir,
    name: &str,
    fleet: &Fleet,
    notice_port: u16,
) -> anyhow::Result<RouterHandle> {
    let pools = (fleet.prefill.len(), fleet.decode.len());
    router_over(
        dir,
        name,
        fleet,
        pools,
        Receivers::Registered,
        Some(notice_port),
    )
    .await
}

/// A fleet ([`fleet_with`]) notifying a router `a` over all of it ([`router`]) on a free port:
/// the fleet, the folder of the router's static file, the router.
async fn fleet_and_router(
    drop_notices: bool,
    first_token_stops: bool,
) -> anyhow::Result<(Fleet, tempfile::TempDir, RouterHandle)> {
    with_free_ports(|| async {
        let port = free_port()?;
        let proxy = format!("tcp://127.0.0.1:{port}");
        let fleet = fleet_with(&proxy, drop_notices, first_token_stops).await?;
        let dir = tempfile::tempdir()?;
        let router = router(&dir, "a", &fleet, port).await?;
        Ok((fleet, dir, router))
    })
    .await
}

/// A fleet ([`fleet_of`], its receivers failing `load_fail_rate` of their loads) notifying a
/// router over its first `pools` engines (prefill, decode), the decoders registered as
/// `receivers` says: the fleet, the folder of the router's file, the router, its notice port.
async fn fleet_and_router_of(
    pools: (usize, usize),
    receivers: Receivers,
    load_fail_rate: f64,
) -> anyhow::Result<(Fleet, tempfile::TempDir, RouterHandle, u16)> {
    with_free_ports(|| async {
        let port = free_port()?;
        let proxy = format!("tcp://127.0.0.1:{port}");
        let fleet = fleet_of(&proxy, false, false, load_fail_rate).await?;
        let dir = tempfile::tempdir()?;
        let router = router_over(&dir, "a", &fleet, pools, receivers, Some(port)).await?;
        Ok((fleet, dir, router, port))
    })
    .await
}

/// Asserts that `router`'s metric `series` reads `expected`.
async fn assert_metric(router: &RouterHandle, series: &str, expected: f64) {
    assert_eq!(
        metric(&router.url(), series).await,
        Some(expected),
        "{series}"
    );
}

/// The requests `sims` received with `x-request-id: id`.
fn received_as(sims: &[SimHandle], id: &str) -> Vec<switchyard_engine_sim::ReceivedRequest> {
    sims.iter()
        .flat_map(SimHandle::received)
        .filter(|request| request.header("x-request-id") == Some(id))
        .collect()
}

/// Posts `body` to `url` (`what` names it if it hangs), asserts that it was answered 200 by
/// way of `route` (`x-switchyard-route`), and returns the answer.
async fn post_routed(url: &str, body: &Value, what: &str, route: &str) -> anyhow::Result<Reply> {
    let reply = bounded(what, http_post(url, &[], body.to_string())).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-switchyard-route"), Some(route));
    Ok(reply)
}

fn prompt(seed: &str) -> String {
    format!("{seed} {}", vec!["hello"; 40].join(" "))
}

/// The text an undisturbed simulator answers with `tokens` tokens (a colocated run).
async fn colocated_text(
    sim: &SimHandle,
    chat: bool,
    body: &Value,
    tokens: u32,
) -> anyhow::Result<String> {
    let mut body = body.clone();
    body["stream"] = json!(false);
    body["max_tokens"] = json!(tokens);
    body["model"] = json!("sim");
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let reply = bounded(
        "a colocated answer",
        http_post(&format!("{}{path}", sim.url), &[], body.to_string()),
    )
    .await?;
    anyhow::ensure!(reply.status == 200, "{}", reply.body);
    let value: Value = serde_json::from_str(&reply.body)?;
    Ok(text_of(&value, chat))
}

fn text_of(value: &Value, chat: bool) -> String {
    if chat {
        value["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    } else {
        value["choices"][0]["text"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }
}

/// The text and the usage of a streamed answer; every event parsed, `[DONE]` once.
fn streamed(body: &str, chat: bool) -> (String, Option<Value>) {
    let mut text = String::new();
    let mut usage = None;
    let mut done = 0;
    for event in body.split("\n\n").filter(|event| !event.trim().is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an event: {event:?}"));
        if data == "[DONE]" {
            done += 1;
            continue;
        }
        let value: Value = serde_json::from_str(data).unwrap();
        assert!(value.get("error").is_none(), "{data}");
        if let Some(choice) = value["choices"].get(0) {
            let piece = if chat {
                &choice["delta"]["content"]
            } else {
                &choice["text"]
            };
            text.push_str(piece.as_str().unwrap_or(""));
            assert_eq!(
                value["object"],
                if chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                }
            );
        }
        if value.get("usage").is_some_and(|usage| !usage.is_null()) {
            usage = Some(value["usage"].clone());
        }
    }
    assert_eq!(done, 1, "{body}");
    (text, usage)
}

#[tokio::test]
async fn each_request_is_prefilled_for_its_decoder_and_notified_through_either_router()
-> anyhow::Result<()> {
    let (fleet, _dir, (router_a, port_a), (router_b, port_b)) = with_free_ports(|| async {
        let (port_a, port_b) = (free_port()?, free_port()?);
        let fleet = fleet(&format!("tcp://127.0.0.1:{port_a}"), false).await?;
        let dir = tempfile::tempdir()?;
        let router_a = router(&dir, "a", &fleet, port_a).await?;
        let router_b = router(&dir, "b", &fleet, port_b).await?;
        Ok((fleet, dir, (router_a, port_a), (router_b, port_b)))
    })
    .await?;
    let mut served = std::collections::BTreeSet::new();
    let (mut through_b, mut rounds) = (0, 0);
    // Each router, chat or not, streamed or not; the idle decoders tie, so which one serves is
    // a coin toss: go on (bounded) until both took part.
    for round in 1..=40 {
        if round > 8 && served.len() == 4 {
            break;
        }
        let combination = (round - 1) % 8;
        let router = if combination < 4 {
            &router_a
        } else {
            &router_b
        };
        let (chat, stream) = (combination % 4 < 2, combination % 2 == 1);
        through_b += usize::from(combination >= 4);
        rounds += 1;
        let seed = format!("round{round}");
        let mut body = if chat {
            json!({"model": "pd", "messages": [{"role": "user", "content": prompt(&seed)}], "max_tokens": 6})
        } else {
            json!({"model": "pd", "prompt": prompt(&seed), "max_tokens": 6})
        };
        let expected = colocated_text(&fleet.decode[0], chat, &body, 6).await?;
        body["stream"] = json!(stream);
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let path = if chat {
            "v1/chat/completions"
        } else {
            "v1/completions"
        };
        let url = format!("{}/endpoints/pd/openai/{path}", router.url());
        let id = format!("lmpd-{round}");
        let reply = bounded(
            "an LMCACHE_PD request",
            http_post(&url, &[("x-request-id", &id)], body.to_string()),
        )
        .await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(
            reply.header("x-switchyard-route"),
            Some("disaggregated"),
            "round {round}"
        );
        let decoder = reply
            .header("x-switchyard-instance")
            .unwrap_or("")
            .to_owned();
        served.insert(decoder.clone());
        served.insert(
            reply
                .header("x-switchyard-prefill-instance")
                .unwrap_or("")
                .to_owned(),
        );
        let (text, usage) = if stream {
            streamed(&reply.body, chat)
        } else {
            let value: Value = serde_json::from_str(&reply.body)?;
            assert_eq!(
                value["object"],
                if chat {
                    "chat.completion"
                } else {
                    "text_completion"
                }
            );
            (text_of(&value, chat), Some(value["usage"].clone()))
        };
        assert_eq!(
            text, expected,
            "round {round}: the first token and the decoder's rest"
        );
        let usage = usage.expect("usage");
        assert_eq!(usage["completion_tokens"], 6, "round {round}: {usage}");
        // The prefiller got the ids and the spec naming the decoder's receiver.
        let prefilled = received_as(&fleet.prefill, &id);
        assert_eq!(prefilled.len(), 1, "round {round}");
        let decoder_index: usize = decoder.trim_start_matches('d').parse()?;
        let spec = &prefilled[0]
            .kv_transfer
            .as_ref()
            .expect("kv_transfer_params")["disagg_spec"];
        assert_eq!(
            spec["receiver_alloc_port"],
            json!([fleet.alloc[decoder_index]]),
            "round {round}"
        );
        assert!(spec["req_id"].as_str().unwrap_or("").ends_with(&format!(
            "@127.0.0.1:{}",
            if std::ptr::eq(router, &router_a) {
                port_a
            } else {
                port_b
            }
        )));
        // The decoder found the prompt's blocks in its cache (pushed, not computed).
        let decoded = received_as(&fleet.decode[decoder_index..=decoder_index], &id);
        assert_eq!(decoded.len(), 1, "round {round}");
    }
    // 2P2D: both prefillers and both decoders took part.
    assert_eq!(
        served.iter().map(String::as_str).collect::<Vec<_>>(),
        ["d0", "d1", "p0", "p1"]
    );
    let hits = prefix_cache_hits(&fleet.decode);
    assert!(
        hits >= rounds * 32,
        "decoders recomputed pushed prompts: {hits} cached tokens"
    );
    // Router B's notices reached A and were relayed.
    let relayed = metric(
        &router_a.url(),
        "switchyard_router_lmcache_notices_total{outcome=\"relayed\"}",
    )
    .await;
    assert_eq!(relayed, Some(through_b as f64));
    let matched_b = metric(
        &router_b.url(),
        "switchyard_router_lmcache_notices_total{outcome=\"matched\"}",
    )
    .await;
    assert_eq!(matched_b, Some(through_b as f64));
    for router in [&router_a, &router_b] {
        assert_eq!(
            metric(
                &router.url(),
                "switchyard_router_disaggregation_fallbacks_total{reason=\"notice_timeout\"}"
            )
            .await,
            Some(0.0)
        );
        settles(router).await?;
    }
    Ok(())
}

#[tokio::test]
async fn without_a_notice_in_time_the_decoder_computes_what_it_lacks() -> anyhow::Result<()> {
    let (fleet, _dir, router) = fleet_and_router(true, false).await?;
    let body = json!({"model": "pd", "prompt": prompt("late"), "max_tokens": 4});
    let expected = colocated_text(&fleet.decode[0], false, &body, 4).await?;
    let url = format!("{}/endpoints/pd/openai/v1/completions", router.url());
    let reply = post_routed(&url, &body, "an LMCACHE_PD request", "fallback").await?;
    let value: Value = serde_json::from_str(&reply.body)?;
    assert_eq!(text_of(&value, false), expected);
    assert_eq!(
        metric(
            &router.url(),
            "switchyard_router_disaggregation_fallbacks_total{reason=\"notice_timeout\"}"
        )
        .await,
        Some(1.0)
    );
    // A budget of one token goes direct: the prefill alone would answer it and leave the KV
    // it pushed unclaimed in the decoder's buffer.
    let one = json!({"model": "pd", "prompt": prompt("one"), "max_tokens": 1, "stream": true});
    post_routed(&url, &one, "a one-token request", "direct").await?;
    // A PD sender refuses a request without disagg_spec, as LMCache's async backend fails.
    let mut bare = body.clone();
    bare["model"] = json!("sim");
    let bare = bounded(
        "a bare prefill",
        http_post(
            &format!("{}/v1/completions", fleet.prefill[0].url),
            &[],
            bare.to_string(),
        ),
    )
    .await?;
    assert_eq!(bare.status, 500, "{}", bare.body);
    assert!(bare.body.contains("disagg_spec"), "{}", bare.body);
    // A chat request completions cannot carry (tools) goes direct.
    let tools = json!({"model": "pd", "messages": [{"role": "user", "content": prompt("tools")}], "max_tokens": 2,
                       "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]});
    let chat = format!("{}/endpoints/pd/openai/v1/chat/completions", router.url());
    post_routed(&chat, &tools, "a chat with tools", "direct").await?;
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_router_without_a_notice_socket_leaves_lmcache_pd_to_the_decoders() -> anyhow::Result<()>
{
    let fleet = fleet("tcp://127.0.0.1:1", false).await?;
    let dir = tempfile::tempdir()?;
    let router = router_over(&dir, "pd", &fleet, (1, 2), Receivers::Registered, None).await?;
    let body = json!({"model": "pd", "prompt": prompt("alone"), "max_tokens": 3});
    let url = format!("{}/endpoints/pd/openai/v1/completions", router.url());
    post_routed(&url, &body, "a request", "fallback").await?;
    assert_eq!(
        metric(
            &router.url(),
            "switchyard_router_disaggregation_fallbacks_total{reason=\"no_notice_socket\"}"
        )
        .await,
        Some(1.0)
    );
    assert!(
        fleet.prefill[0].received().is_empty(),
        "nothing prefilled for nothing"
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn the_openai_python_client_reads_lmcache_pd_answers() -> anyhow::Result<()> {
    let (fleet, _dir, router) = fleet_and_router(false, false).await?;
    let body = json!({"model": "pd", "prompt": "x", "max_tokens": 6});
    let expected = colocated_text(&fleet.decode[0], false, &body, 6).await?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/openai_lmcache.py");
    let base_url = format!("{}/endpoints/pd/openai/v1", router.url());
    let output = bounded_for(
        std::time::Duration::from_secs(60),
        "the openai client",
        tokio::process::Command::new(test_python())
            .arg(&script)
            .args([base_url.as_str(), "pd", expected.as_str()])
            .kill_on_drop(true)
            .output(),
    )
    .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("all ok"),
        "{stdout}\n{stderr}"
    );
    assert_eq!(
        metric(
            &router.url(),
            "switchyard_router_disaggregation_requests_total{path=\"disaggregated\"}"
        )
        .await,
        Some(4.0)
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_first_token_that_ends_the_answer_is_the_answer_and_the_decoder_claims_the_hand_off()
-> anyhow::Result<()> {
    let (fleet, _dir, router) = fleet_and_router(false, true).await?;
    let url = format!("{}/endpoints/pd/openai/v1/chat/completions", router.url());
    for stream in [false, true] {
        let id = format!("stops-{stream}");
        let body = json!({"model": "pd", "messages": [{"role": "user", "content": prompt(&id)}], "max_tokens": 8, "stream": stream});
        let reply = bounded(
            "a request",
            http_post(&url, &[("x-request-id", &id)], body.to_string()),
        )
        .await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
        let prefill = reply
            .header("x-switchyard-instance")
            .unwrap_or("")
            .to_owned();
        assert!(
            prefill.starts_with('p'),
            "the prefill instance answered: {prefill}"
        );
        let text = if stream {
            assert!(
                reply.body.contains("\"finish_reason\":\"stop\""),
                "{}",
                reply.body
            );
            streamed(&reply.body, true).0
        } else {
            let value: Value = serde_json::from_str(&reply.body)?;
            assert_eq!(value["choices"][0]["finish_reason"], "stop");
            assert_eq!(value["usage"]["completion_tokens"], 1);
            text_of(&value, true)
        };
        let one = json!({"model": "pd", "prompt": "x", "max_tokens": 1});
        assert_eq!(
            text,
            colocated_text(&fleet.decode[0], false, &one, 1).await?
        );
        // The decoder took the pushed KV out of its buffer (a completion, not streamed).
        let claims = received_as(&fleet.decode, &id);
        assert_eq!(claims.len(), 1, "one claim of the hand-off");
        assert!(!claims[0].stream);
        assert_eq!(claims[0].path, "/v1/completions");
    }
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_notice_sender_announcing_a_huge_frame_is_cut_off_and_notices_still_arrive()
-> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_fleet, _dir, router, port) =
        fleet_and_router_of((2, 2), Receivers::Registered, 0.0).await?;
    // zeromq would reserve what the header claims (2^40 bytes) and abort the router; the
    // frame guard in front of the notice socket cuts this connection at the header instead.
    let mut forged = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    greeting.extend_from_slice(b"NULL");
    greeting.resize(64, 0);
    greeting.push(0x06);
    greeting.extend_from_slice(&(1u64 << 40).to_be_bytes());
    forged.write_all(&greeting).await?;
    let mut sink = vec![0u8; 4096];
    let cut = bounded("the forged connection to be cut", async {
        loop {
            match forged.read(&mut sink).await {
                Ok(0) | Err(_) => return anyhow::Ok(()),
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        cut.is_ok(),
        "the router kept a connection announcing 2^40 bytes"
    );
    // The prefillers' notices still arrive.
    let url = format!("{}/endpoints/pd/openai/v1/chat/completions", router.url());
    let body = json!({"model": "pd", "messages": [{"role": "user", "content": prompt("after")}], "max_tokens": 6});
    post_routed(&url, &body, "a request after the cut", "disaggregated").await?;
    assert_metric(
        &router,
        "switchyard_router_lmcache_notices_total{outcome=\"matched\"}",
        1.0,
    )
    .await;
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_chat_request_without_a_budget_goes_to_a_decoder_directly() -> anyhow::Result<()> {
    // Chat runs to the end of sequence; a decode over completions would stop at vLLM's
    // completions default (16 tokens) and cut the answer short.
    let (fleet, _dir, router) = fleet_and_router(false, false).await?;
    let url = format!("{}/endpoints/pd/openai/v1/chat/completions", router.url());
    let absent = json!({"model": "pd", "messages": [{"role": "user", "content": prompt("open")}]});
    post_routed(&url, &absent, "a request without a budget", "direct").await?;
    let null = json!({"model": "pd", "messages": [{"role": "user", "content": prompt("open")}], "max_tokens": null});
    post_routed(&url, &null, "a request with a null budget", "direct").await?;
    assert!(
        fleet.prefill.iter().all(|sim| sim.received().is_empty()),
        "nothing prefilled"
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn one_prefiller_and_one_decoder_serve_chat_and_completions_streamed_or_not()
-> anyhow::Result<()> {
    let (fleet, _dir, router, _) = fleet_and_router_of((1, 1), Receivers::Registered, 0.0).await?;
    for chat in [true, false] {
        for stream in [false, true] {
            let seed = format!("one-{chat}-{stream}");
            let mut body = if chat {
                json!({"model": "pd", "messages": [{"role": "user", "content": prompt(&seed)}], "max_tokens": 5})
            } else {
                json!({"model": "pd", "prompt": prompt(&seed), "max_tokens": 5})
            };
            let expected = colocated_text(&fleet.decode[1], chat, &body, 5).await?;
            body["stream"] = json!(stream);
            let path = if chat {
                "chat/completions"
            } else {
                "completions"
            };
            let url = format!("{}/endpoints/pd/openai/v1/{path}", router.url());
            let reply = post_routed(&url, &body, "a 1P1D request", "disaggregated").await?;
            assert_eq!(reply.header("x-switchyard-instance"), Some("d0"));
            assert_eq!(reply.header("x-switchyard-prefill-instance"), Some("p0"));
            let text = if stream {
                streamed(&reply.body, chat).0
            } else {
                text_of(&serde_json::from_str(&reply.body)?, chat)
            };
            assert_eq!(text, expected, "chat {chat} stream {stream}");
        }
    }
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_prefill_answer_without_its_first_token_is_served_by_the_decoder_whole()
-> anyhow::Result<()> {
    // Prefill engines that are no LMCache PD senders answer without `first_tok`.
    let (_fleet, _dir, router) = with_free_ports(|| async {
        let port = free_port()?;
        let mut fleet = fleet(&format!("tcp://127.0.0.1:{port}"), false).await?;
        fleet.prefill = vec![
            switchyard_engine_sim::spawn(SimConfig {
                role: InstanceRole::Prefill,
                time_scale: 0.002,
                ..SimConfig::default()
            })
            .await?,
        ];
        let dir = tempfile::tempdir()?;
        let router =
            router_over(&dir, "a", &fleet, (1, 2), Receivers::Registered, Some(port)).await?;
        Ok((fleet, dir, router))
    })
    .await?;
    let url = format!("{}/endpoints/pd/openai/v1/completions", router.url());
    let body = json!({"model": "pd", "prompt": prompt("plain"), "max_tokens": 4});
    post_routed(&url, &body, "a request", "fallback").await?;
    assert_metric(
        &router,
        "switchyard_router_disaggregation_fallbacks_total{reason=\"bad_handoff\"}",
        1.0,
    )
    .await;
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn decoders_without_a_receiver_or_room_in_it_serve_the_request_whole() -> anyhow::Result<()> {
    let fleet = with_free_ports(|| async {
        let port = free_port()?;
        fleet(&format!("tcp://127.0.0.1:{port}"), false).await
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let body = json!({"model": "pd", "prompt": prompt("whole"), "max_tokens": 4});
    for (receivers, reason) in [
        (Receivers::Absent, "no_receiver"),
        // The prompt alone (about 45 tokens) is more than the buffer holds.
        (Receivers::Buffer(16), "handoff_cap"),
    ] {
        let router = with_free_ports(|| async {
            router_over(&dir, reason, &fleet, (2, 2), receivers, Some(free_port()?)).await
        })
        .await?;
        let url = format!("{}/endpoints/pd/openai/v1/completions", router.url());
        post_routed(&url, &body, reason, "fallback").await?;
        assert_metric(
            &router,
            &format!("switchyard_router_disaggregation_fallbacks_total{{reason=\"{reason}\"}}"),
            1.0,
        )
        .await;
        settles(&router).await?;
    }
    assert!(
        fleet.prefill.iter().all(|sim| sim.received().is_empty()),
        "nothing prefilled"
    );
    Ok(())
}

#[tokio::test]
async fn notices_for_no_request_and_messages_that_are_no_notice_are_counted_and_dropped()
-> anyhow::Result<()> {
    let (_fleet, _dir, router, notice_port) =
        fleet_and_router_of((2, 2), Receivers::Registered, 0.0).await?;
    // A ProxyNotif for an id no router made, then a message that is no ProxyNotif, pushed as
    // LMCache's PD backend pushes (pyzmq, msgspec).
    let script = r#"
import sys, zmq, msgspec
class ProxyNotif(msgspec.Struct, tag=True):
    req_id: str
context = zmq.Context()
socket = context.socket(zmq.PUSH)
socket.connect(sys.argv[1])
socket.send(msgspec.msgpack.encode(ProxyNotif(req_id="not-a-switchyard-id")))
socket.send(b"\x90")
socket.close(linger=5000)
# Only terminating the context waits for the linger: at interpreter exit pyzmq skips that,
# and messages still queued behind the connection's handshake would be lost.
context.term()
"#;
    let output = bounded_for(
        std::time::Duration::from_secs(30),
        "the notice sender",
        tokio::process::Command::new(test_python())
            .args(["-c", script, &format!("tcp://127.0.0.1:{notice_port}")])
            .kill_on_drop(true)
            .output(),
    )
    .await?;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for outcome in ["unknown", "undecodable"] {
        let series = format!("switchyard_router_lmcache_notices_total{{outcome=\"{outcome}\"}}");
        let url = router.url();
        eventually(std::time::Duration::from_secs(10), &series, || {
            let (url, series) = (url.clone(), series.clone());
            async move { metric(&url, &series).await == Some(1.0) }
        })
        .await?;
    }
    // The requests of the fleet are still served the disaggregated way.
    let url = format!("{}/endpoints/pd/openai/v1/completions", router.url());
    let body = json!({"model": "pd", "prompt": prompt("still"), "max_tokens": 4});
    post_routed(&url, &body, "a request after them", "disaggregated").await?;
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_decoder_that_fails_to_load_the_pushed_kv_gets_the_clients_request_instead()
-> anyhow::Result<()> {
    let (fleet, _dir, router, _) = fleet_and_router_of((2, 2), Receivers::Registered, 1.0).await?;
    let mut round = 0;
    for chat in [true, false] {
        for stream in [false, true] {
            round += 1;
            let id = format!("refused-{round}");
            let body = if chat {
                json!({"model": "pd", "messages": [{"role": "user", "content": prompt(&id)}], "max_tokens": 4, "stream": stream})
            } else {
                json!({"model": "pd", "prompt": prompt(&id), "max_tokens": 4, "stream": stream})
            };
            let path = if chat {
                "chat/completions"
            } else {
                "completions"
            };
            let url = format!("{}/endpoints/pd/openai/v1/{path}", router.url());
            let reply = bounded(
                "a refused LMCACHE_PD decode",
                http_post(&url, &[("x-request-id", &id)], body.to_string()),
            )
            .await?;
            assert_eq!(reply.status, 200, "{id}: {}", reply.body);
            assert_eq!(reply.header("x-switchyard-route"), Some("fallback"), "{id}");
            assert!(!reply.body.contains("\"error\""), "{id}: {}", reply.body);
            let text = if stream {
                streamed(&reply.body, chat).0
            } else {
                text_of(&serde_json::from_str(&reply.body)?, chat)
            };
            assert!(!text.is_empty(), "{id}: {}", reply.body);
            // The same decoder twice: the ids (refused), then the client's own request.
            let decoded = received_as(&fleet.decode, &id);
            assert_eq!(decoded.len(), 2, "{id}");
            let expected_path = if chat {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            assert_eq!(decoded[0].path, "/v1/completions", "{id}");
            assert_eq!(decoded[1].path, expected_path, "{id}");
        }
    }
    assert_metric(
        &router,
        "switchyard_router_disaggregation_fallbacks_total{reason=\"decode_refused_handoff\"}",
        4.0,
    )
    .await;
    settles(&router).await?;
    Ok(())
}
