//! The router end to end: a real control plane on a real etcd, real routers, simulated
//! engines, all on loopback.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use switchyard_engine_sim::SimConfig;
use switchyard_proto::v1 as pb;
use switchyard_tests::*;

fn prefix_aware(threshold: u32) -> String {
    variant_json("PREFIX_AWARE", Some((1024, threshold)))
}

async fn instance_for(url: &str, headers: &[(&str, &str)], body: &str) -> anyhow::Result<String> {
    let reply = http_post(url, headers, body.to_owned()).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    Ok(reply
        .header("x-switchyard-instance")
        .expect("x-switchyard-instance header")
        .to_owned())
}

#[tokio::test]
async fn same_prefix_same_instance_through_two_routers_and_prefixes_spread() -> anyhow::Result<()> {
    let cluster = Cluster::start(4, 2, &prefix_aware(100), fast()).await?;
    let mut chosen = HashSet::new();
    for index in 0..24 {
        let body = chat_body(&prompt(&format!("customer-{index}"), 1500), 4, false);
        let first = instance_for(&chat_url(&cluster.routers()[0]), &[], &body).await?;
        let second = instance_for(&chat_url(&cluster.routers()[1]), &[], &body).await?;
        let again = instance_for(&chat_url(&cluster.routers()[0]), &[], &body).await?;
        assert_eq!(first, second, "both routers agree on prefix {index}");
        assert_eq!(first, again, "the same router is stable on prefix {index}");
        chosen.insert(first);
    }
    assert!(
        chosen.len() >= 3,
        "24 prefixes over 4 instances used only {chosen:?}"
    );
    // The engines saw their cached prefixes hit.
    let hits = prefix_cache_hits(cluster.engines());
    assert!(hits > 0, "repeated prefixes should hit the engines' caches");
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn prefix_aware_ids_split_identical_prompts() -> anyhow::Result<()> {
    let cluster = Cluster::start(4, 1, &prefix_aware(100), fast()).await?;
    let url = chat_url(&cluster.routers()[0]);
    let body = chat_body(&prompt("shared system prompt", 1500), 2, false);
    let mut by_header = HashSet::new();
    for tenant in 0..16 {
        let id = format!("tenant-{tenant}");
        let first = instance_for(&url, &[("x-amzn-sagemaker-prefix-aware-id", &id)], &body).await?;
        let again = instance_for(&url, &[("x-amzn-sagemaker-prefix-aware-id", &id)], &body).await?;
        assert_eq!(first, again, "one tenant stays on one instance");
        by_header.insert(first);
    }
    assert!(
        by_header.len() >= 2,
        "tenant ids should spread: {by_header:?}"
    );
    // prompt_cache_key in the body plays the same role.
    let mut by_key = HashSet::new();
    for tenant in 0..16 {
        let body = serde_json::json!({
            "model": "chat",
            "messages": [{"role": "user", "content": prompt("shared system prompt", 1500)}],
            "max_tokens": 2,
            "prompt_cache_key": format!("tenant-{tenant}"),
        })
        .to_string();
        by_key.insert(instance_for(&url, &[], &body).await?);
    }
    assert!(
        by_key.len() >= 2,
        "prompt_cache_key should spread: {by_key:?}"
    );
    cluster.wait_idle().await?;
    Ok(())
}

/// Both routers' answers (`via_a`, `via_b`) overflowed from `owner`, to the same instance.
/// Waits until `router_b` counts two requests in flight on `owner` fleet-wide (router A's,
/// from the control plane's load reports), then sends `short` through both routers and asserts
/// that each moves it off the owner (route `overflow`), to the same second choice (`verb`
/// says how, in the failure).
async fn both_overflow_alike(
    router_a: &switchyard_router::RouterHandle,
    router_b: &switchyard_router::RouterHandle,
    owner: &str,
    short: &str,
    verb: &str,
) -> anyhow::Result<()> {
    eventually(
        Duration::from_secs(5),
        "router B to see the owner's load",
        || async { fleet_in_flight(router_b, owner).await >= 2 },
    )
    .await?;
    let via_b = http_post(&chat_url(router_b), &[], short.to_owned()).await?;
    let via_a = http_post(&chat_url(router_a), &[], short.to_owned()).await?;
    for reply in [&via_a, &via_b] {
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-switchyard-route"), Some("overflow"));
        assert_ne!(reply.header("x-switchyard-instance"), Some(owner));
    }
    assert_eq!(
        via_a.header("x-switchyard-instance"),
        via_b.header("x-switchyard-instance"),
        "both routers {verb} to the same second choice"
    );
    Ok(())
}

/// A long stream of `body` through `router`, held open: the response, and the instance it
/// went to.
async fn hold_stream(
    router: &switchyard_router::RouterHandle,
    body: &str,
) -> anyhow::Result<(http::Response<hyper::body::Incoming>, String)> {
    let response = post_streaming(&chat_url(router), &[], body.to_owned()).await?;
    let instance = response
        .headers()
        .get("x-switchyard-instance")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Ok((response, instance))
}

/// `text` with every ASCII letter replaced by a Greek one (2 bytes in UTF-8 instead of 1).
fn greek(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            'a'..='x' => char::from_u32(0x3B1 + (c as u32 - 'a' as u32)).unwrap_or(c),
            other => other,
        })
        .collect()
}

/// The first `chars` characters of `text`.
fn first_chars(text: &str, chars: usize) -> String {
    text.chars().take(chars).collect()
}

#[tokio::test]
async fn a_prefix_is_its_first_prefix_length_characters_and_nothing_else() -> anyhow::Result<()> {
    // PrefixLength 1024. For 16 prompts: two bodies that share their first 1024 characters and
    // differ after them must go to the same instance (a router hashing the whole text would
    // split them), and a body that differs at character 1000 must, across the 16 prompts,
    // mostly go elsewhere (a router cutting the prefix shorter would keep it with the first).
    // Keys and ranking are deterministic hashes; with 4 instances a changed key keeps its
    // instance with probability 1/4, so at least 4 of 16 must move (P(fewer) ≈ 4·10⁻⁶ for
    // any hash). The OpenAI text is counted in characters: in Greek (2 bytes a letter),
    // character 1000 lies at byte ~1,900, past a prefix wrongly counted in bytes. The native
    // API counts bytes of the raw body.
    let cluster = Cluster::start(4, 1, &prefix_aware(100), fast()).await?;
    let router = &cluster.routers()[0];
    let native_url = invocations_url(router);
    let native_body = |text: &str| {
        format!(r#"{{"messages":[{{"role":"user","content":"{text}"}}],"max_tokens":1}}"#)
    };
    for script in ["latin", "greek", "native"] {
        let mut moved = 0;
        for index in 0..16 {
            let mut text = prompt(&format!("customer {index}"), 1200);
            if script == "greek" {
                text = greek(&text);
            }
            let (url, same_head, tails, changed) = if script == "native" {
                // Bytes of the body: the text's first bytes that fill the body's first 1024.
                let lead = native_body("").find("\"}]").expect("the text's place");
                let body_text = &text[..1024 - lead];
                let changed = format!("{}CHANGED{}", &body_text[..950], &body_text[957..]);
                (
                    native_url.clone(),
                    body_text.to_owned(),
                    [" ends one way", " and another, longer, way"],
                    changed,
                )
            } else {
                let head = first_chars(&text, 1024);
                let changed = format!(
                    "{}CHANGED{}",
                    first_chars(&head, 1000),
                    head.chars().skip(1007).collect::<String>()
                );
                (
                    chat_url(router),
                    head,
                    [" ends one way", " and another, longer, way"],
                    changed,
                )
            };
            let body = |text: String| {
                if script == "native" {
                    native_body(&text)
                } else {
                    chat_body(&text, 1, false)
                }
            };
            let first = instance_for(&url, &[], &body(format!("{same_head}{}", tails[0]))).await?;
            let second = instance_for(&url, &[], &body(format!("{same_head}{}", tails[1]))).await?;
            assert_eq!(
                first, second,
                "{script} prompt {index}: same first 1024, different ending, different instance"
            );
            let other = instance_for(&url, &[], &body(format!("{changed}{}", tails[0]))).await?;
            if other != first {
                moved += 1;
            }
        }
        assert!(
            moved >= 4,
            "{script}: only {moved} of 16 prompts changed inside the prefix moved"
        );
    }
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn liveness_answers_while_readiness_waits_for_state() -> anyhow::Result<()> {
    // A router whose control plane refuses connections has no routing state: not ready, but
    // alive (an orchestrator must not restart it for that).
    let refusing = RefusingPort::new()?;
    let waiting = router(&[refusing.url()]).await?;
    for (path, expected) in [("/ping", 200), ("/healthz", 200), ("/readyz", 503)] {
        let (status, body) = http_get(&format!("{}{path}", waiting.url())).await?;
        assert_eq!(status, expected, "{path}: {body}");
        if expected == 200 {
            assert_eq!(body.trim(), "ok", "{path}");
        }
    }
    let cluster = Cluster::start(1, 1, &variant_json("RANDOM", None), fast()).await?;
    for path in ["/ping", "/healthz", "/readyz"] {
        let (status, body) = http_get(&format!("{}{path}", cluster.routers()[0].url())).await?;
        assert_eq!(status, 200, "{path}: {body}");
    }
    Ok(())
}

#[tokio::test]
async fn a_local_ejection_ends_and_the_instance_gets_traffic_again() -> anyhow::Result<()> {
    // From a static file (no control plane to take the instance out): "back" refuses
    // connections until the router ejects it, then starts serving on the same port. Once the
    // ejection (2 s) is over, the router sends to it again.
    let up = switchyard_engine_sim::spawn(fast()).await?;
    let refusing = RefusingPort::new()?;
    let dir = tempfile::tempdir()?;
    let mut config = static_file_config(
        dir.path(),
        "        RoutingConfig: {RoutingStrategy: RANDOM}\n",
        &format!(
            "      - Url: {}\n        InstanceId: up\n      - Url: {}\n        InstanceId: back\n",
            up.url,
            refusing.url()
        ),
    )?;
    config.eject_after_failures = 3;
    config.eject_seconds = 2;
    let router = router_with(config).await?;
    let url = chat_url(&router);
    let ejected = || async {
        metric(
            &router.url(),
            r#"switchyard_router_instance_ejected{endpoint="chat",instance="back"}"#,
        )
        .await
    };
    let mut sent = 0;
    while ejected().await != Some(1.0) {
        assert!(sent < 200, "200 requests and \"back\" was never ejected");
        // Whatever the answer: how a refused connection is answered is not this test's.
        let _ = http_post(&url, &[], chat_body("hi", 1, false)).await?;
        sent += 1;
    }
    let back = switchyard_engine_sim::SimServer::new(fast())?;
    let stop = tokio_util::sync::CancellationToken::new();
    let serving = tokio::spawn(back.run(refusing.listen()?, stop.clone()));
    let reached = || async {
        http_post(&url, &[], chat_body("hi", 1, false))
            .await
            .is_ok_and(|reply| {
                reply.status == 200 && reply.header("x-switchyard-instance") == Some("back")
            })
    };
    eventually(
        Duration::from_secs(15),
        "\"back\" to get traffic again",
        reached,
    )
    .await?;
    assert_eq!(ejected().await, Some(0.0));
    stop.cancel();
    serving.await??;
    Ok(())
}

/// The fleet-wide in-flight count `router` has for `instance` of `chat`; 0 when its metrics
/// do not say.
async fn fleet_in_flight(router: &switchyard_router::RouterHandle, instance: &str) -> u32 {
    let series =
        format!("switchyard_router_fleet_in_flight{{endpoint=\"chat\",instance=\"{instance}\"}}");
    metric(&router.url(), &series).await.unwrap_or(0.0) as u32
}

#[tokio::test]
async fn a_hot_prefix_overflows_to_the_same_second_choice_on_both_routers() -> anyhow::Result<()> {
    // Slow engines so requests stay in flight while we look.
    let sim = real_time();
    let cluster = Cluster::start(4, 2, &prefix_aware(2), sim).await?;
    let hot = prompt("hot prefix", 1500);
    let short = chat_body(&hot, 1, false);
    let owner = instance_for(&chat_url(&cluster.routers()[0]), &[], &short).await?;
    cluster.wait_idle().await?;

    // Two long requests through router A put the owner at the threshold (2) fleet-wide.
    let long = chat_body(&hot, 400, true);
    let (router_a, router_b) = (&cluster.routers()[0], &cluster.routers()[1]);
    let mut holds = Vec::new();
    for _ in 0..2 {
        let (response, on) = hold_stream(router_a, &long).await?;
        assert_eq!(on, owner);
        holds.push(response);
    }
    // Router B learns the fleet-wide load from the control plane.
    both_overflow_alike(router_a, router_b, &owner, &short, "overflow").await?;
    drop(holds);
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn bounded_loads_spill_a_hot_prefix_long_before_the_threshold_and_both_routers_agree()
-> anyhow::Result<()> {
    // Slow engines so requests stay in flight while we look. ConcurrencyThreshold 100 is
    // never reached: only the bound ⌈1.0 × (L + 1) / 4⌉ + 1 moves requests.
    let sim = real_time();
    let variants = r#"[{"VariantName":"AllTraffic","ModelName":"sim","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
        "PrefixAwareRoutingConfig":{"PrefixLength":1024,"ConcurrencyThreshold":100,"LoadBalanceFactor":1.0,"LoadBalanceSlack":1}}}]"#;
    let cluster = Cluster::start(4, 2, variants, sim).await?;
    let (router_a, router_b) = (&cluster.routers()[0], &cluster.routers()[1]);
    let hot = prompt("hot prefix", 1500);
    let short = chat_body(&hot, 1, false);
    let owner = instance_for(&chat_url(router_a), &[], &short).await?;
    cluster.wait_idle().await?;

    let long = chat_body(&hot, 400, true);
    // One in flight (bound ⌈2/4⌉ + 1 = 2): the slack keeps a lightly loaded fleet on the owner.
    let (first, on) = hold_stream(router_a, &long).await?;
    assert_eq!(on, owner);
    let reply = http_post(&chat_url(router_a), &[], short.clone()).await?;
    assert_eq!(reply.header("x-switchyard-route"), Some("prefix"));
    let (second, on) = hold_stream(router_a, &long).await?;
    assert_eq!(on, owner);
    // Two in flight on the owner, none elsewhere: bound ⌈3/4⌉ + 1 = 2, so the prefix spills.
    // Neither router has sent anything to another instance, so both place the new copy alike:
    // on the second choice.
    both_overflow_alike(router_a, router_b, &owner, &short, "spill").await?;
    drop((first, second));
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn a_new_prefix_placed_by_one_router_is_sent_there_by_the_other() -> anyhow::Result<()> {
    // Slow engines so held streams stay in flight. Bound ⌈1.0 × (L + 1) / 4⌉ + 1; the
    // threshold is never reached.
    let sim = real_time();
    let variants = r#"[{"VariantName":"AllTraffic","ModelName":"sim","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
        "PrefixAwareRoutingConfig":{"PrefixLength":1024,"ConcurrencyThreshold":100,"LoadBalanceFactor":1.0,"LoadBalanceSlack":1}}}]"#;
    let cluster = Cluster::start(4, 2, variants, sim).await?;
    let (router_a, router_b) = (&cluster.routers()[0], &cluster.routers()[1]);
    // A session per instance: sessions stick to their instance whatever the prefix, and
    // place no prefix.
    let short = |text: &str| chat_body(text, 1, false);
    let mut sessions: HashMap<String, String> = HashMap::new();
    for index in 0..64 {
        let session = format!("pin-{index}");
        let on = instance_for(
            &chat_url(router_a),
            &[("x-amzn-sagemaker-session-id", &session)],
            &short("pinning"),
        )
        .await?;
        sessions.entry(on).or_insert(session);
        if sessions.len() == 4 {
            break;
        }
    }
    assert_eq!(sessions.len(), 4, "a session for every instance");
    cluster.wait_idle().await?;
    // Two streams held on three instances, none on the fourth: 6 in flight, bound 3, and
    // only the idle one within a request of the least loaded.
    let idle = sessions.keys().min().cloned().unwrap_or_default();
    let mut holds = Vec::new();
    for (instance, session) in &sessions {
        if *instance == idle {
            continue;
        }
        for _ in 0..2 {
            let response = post_streaming(
                &chat_url(router_a),
                &[("x-amzn-sagemaker-session-id", session)],
                chat_body(&prompt("held", 200), 400, true),
            )
            .await?;
            holds.push(response);
        }
    }
    // Router A places five new prefixes on the idle instance, whatever their owners.
    let prefixes: Vec<String> = (0..5)
        .map(|index| short(&prompt(&format!("new prefix {index}"), 1500)))
        .collect();
    for body in &prefixes {
        assert_eq!(instance_for(&chat_url(router_a), &[], body).await?, idle);
    }
    drop(holds);
    cluster.wait_idle().await?;
    // Router B learns the placements from the control plane and, on an idle fleet, sends
    // each prefix where router A put it (not to its owner, where a new key would go).
    let learned = "switchyard_router_key_placements_learned_total";
    eventually(
        Duration::from_secs(5),
        "router B to learn the placements",
        || async { metric(&router_b.url(), learned).await.unwrap_or(0.0) >= 5.0 },
    )
    .await?;
    for body in &prefixes {
        assert_eq!(instance_for(&chat_url(router_b), &[], body).await?, idle);
    }
    let announced = "switchyard_router_key_placements_announced_total";
    assert!(metric(&router_a.url(), announced).await.unwrap_or(0.0) >= 5.0);
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn least_outstanding_requests_sends_each_request_to_a_least_loaded_instance()
-> anyhow::Result<()> {
    // Streams are held open, so the router's in-flight counts are exactly what the test holds.
    // Every request must go to an instance with the fewest held. A random choice keeps to that
    // rule for 8 requests over 4 instances with probability (3/4·2/4·1/4)² ≈ 0.9%; after one
    // instance's two streams end, both next requests must go to it, which round robin does
    // not do.
    let sim = real_time();
    let cluster =
        Cluster::start(4, 1, &variant_json("LEAST_OUTSTANDING_REQUESTS", None), sim).await?;
    let url = chat_url(&cluster.routers()[0]);
    let mut held: HashMap<String, Vec<http::Response<hyper::body::Incoming>>> = (0..4)
        .map(|index| (format!("engine-{index}"), Vec::new()))
        .collect();
    async fn send_and_hold(
        url: &str,
        request: usize,
        held: &mut HashMap<String, Vec<http::Response<hyper::body::Incoming>>>,
    ) -> anyhow::Result<String> {
        let response = post_streaming(
            url,
            &[],
            chat_body(&format!("question {request}"), 2000, true),
        )
        .await?;
        assert_eq!(response.status(), 200);
        let instance = response
            .headers()
            .get("x-switchyard-instance")
            .expect("x-switchyard-instance")
            .to_str()?
            .to_owned();
        let fewest = held.values().map(Vec::len).min().unwrap_or(0);
        let loads: HashMap<&String, usize> = held
            .iter()
            .map(|(id, streams)| (id, streams.len()))
            .collect();
        assert_eq!(
            held[&instance].len(),
            fewest,
            "request {request} went to {instance} while held streams were {loads:?}"
        );
        held.get_mut(&instance)
            .expect("a known instance")
            .push(response);
        Ok(instance)
    }
    for request in 0..8 {
        send_and_hold(&url, request, &mut held).await?;
    }
    let router = &cluster.routers()[0];
    let freed = "engine-2".to_owned();
    held.get_mut(&freed).expect("engine-2").clear();
    eventually(
        Duration::from_secs(10),
        "engine-2's streams to end",
        || async { router.in_flight() == 6 },
    )
    .await?;
    for request in 8..10 {
        assert_eq!(send_and_hold(&url, request, &mut held).await?, freed);
    }
    drop(held);
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn a_strategy_switch_takes_effect_without_a_failed_request() -> anyhow::Result<()> {
    let cluster = Cluster::start(3, 1, &variant_json("RANDOM", None), fast()).await?;
    let url = chat_url(&cluster.routers()[0]);
    let mut admin = admin(cluster.control_plane_url()).await?;
    admin
        .create_endpoint_config(config_request("chat-prefix", &prefix_aware(50)))
        .await?;
    let stop = tokio_util::sync::CancellationToken::new();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let completed = || done.load(std::sync::atomic::Ordering::Relaxed);
    let mut workers = Vec::new();
    for worker in 0..4 {
        let url = url.clone();
        let stop = stop.clone();
        let done = std::sync::Arc::clone(&done);
        workers.push(tokio::spawn(async move {
            let mut routes = Vec::new();
            for round in 0..400 {
                if stop.is_cancelled() {
                    break;
                }
                let body = chat_body(
                    &prompt(&format!("w{worker} r{}", round % 5), 1200),
                    1,
                    false,
                );
                let reply = http_post(&url, &[], body).await.expect("router answers");
                assert_eq!(reply.status, 200, "{}", reply.body);
                routes.push(reply.header("x-switchyard-route").unwrap_or("").to_owned());
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            routes
        }));
    }
    eventually(Duration::from_secs(10), "traffic under RANDOM", || async {
        completed() >= 40
    })
    .await?;
    switch_endpoint_config(&mut admin, "chat", "chat-prefix").await?;
    let router = &cluster.routers()[0];
    eventually(
        Duration::from_secs(5),
        "the router to switch strategy",
        || async { router.table().endpoints["chat"].variants[0].prefix_length == 1024 },
    )
    .await?;
    let switched_at = completed();
    eventually(
        Duration::from_secs(10),
        "traffic under PREFIX_AWARE",
        || async { completed() >= switched_at + 40 },
    )
    .await?;
    stop.cancel();
    let mut routes = Vec::new();
    for worker in workers {
        routes.extend(worker.await?);
    }
    assert!(
        routes.iter().any(|route| route == "random"),
        "ran under RANDOM first"
    );
    assert_eq!(
        routes.last().map(String::as_str),
        Some("prefix"),
        "ends under PREFIX_AWARE"
    );
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn routing_continues_when_the_control_plane_and_etcd_die() -> anyhow::Result<()> {
    // A real control-plane process on a real etcd, both killed with SIGKILL. The router must
    // notice (its stream breaks), then keep routing on its last state through its reconnect
    // attempts (backoff 0.1, 0.2, 0.4, 0.8, 1.6 s: 4 s covers five of them), not just in the
    // first moment.
    let mut etcd = Etcd::start().await?;
    let mut control = etcd_control_process(&etcd, "/stability/")?;
    let mut admin = admin(&control.url()).await?;
    create_endpoint(&mut admin, "chat", &prefix_aware(10)).await?;
    let mut engines = Vec::new();
    for index in 0..2 {
        let engine = switchyard_engine_sim::spawn(fast()).await?;
        register(&mut admin, "chat", &format!("engine-{index}"), &engine.url).await?;
        engines.push(engine);
    }
    let router = router(&[control.url()]).await?;
    let instances = || routed_count(&router, "chat").unwrap_or(0);
    eventually(
        Duration::from_secs(10),
        "the router to see both engines",
        || async { instances() == 2 },
    )
    .await?;
    let url = chat_url(&router);
    let body = chat_body(&prompt("static stability", 1200), 2, false);
    let before = instance_for(&url, &[], &body).await?;

    control.kill();
    etcd.kill();
    eventually(Duration::from_secs(10), "the router to notice", || async {
        metric(&router.url(), "switchyard_router_control_plane_connected").await == Some(0.0)
    })
    .await?;
    let noticed = tokio::time::Instant::now();
    let mut requests = 0;
    while noticed.elapsed() < Duration::from_secs(4) {
        assert_eq!(
            instance_for(&url, &[], &body).await?,
            before,
            "{:?} after the control plane died",
            noticed.elapsed()
        );
        assert_eq!(instances(), 2, "membership changed without a control plane");
        requests += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(requests >= 20, "only {requests} requests in 4 s");
    let (status, _) = http_get(&format!("{}/readyz", router.url())).await?;
    assert_eq!(status, 200, "still ready on the last state");
    Ok(())
}

#[tokio::test]
async fn a_router_that_loses_its_stream_forgets_other_routers_load() -> anyhow::Result<()> {
    // Router B holds two streams on the only engine; router A learns of them from the control
    // plane. When the control plane dies (SIGKILL), A must stop counting B's requests (figures
    // it can no longer refresh), while B keeps counting its own.
    let dir = tempfile::tempdir()?;
    let mut control = control_process(&["--data-dir", dir.path().to_str().expect("utf-8")])?;
    let mut admin = admin(&control.url()).await?;
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    let engine = switchyard_engine_sim::spawn(real_time()).await?;
    register(&mut admin, "chat", "engine-0", &engine.url).await?;
    let (a, b) = (
        router(&[control.url()]).await?,
        router(&[control.url()]).await?,
    );
    for router in [&a, &b] {
        eventually(Duration::from_secs(10), "the routers to sync", || async {
            routed_count(router, "chat") == Some(1)
        })
        .await?;
    }
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(post_streaming(&chat_url(&b), &[], chat_body("long", 2000, true)).await?);
    }
    let fleet = |router: &switchyard_router::RouterHandle| {
        let url = router.url();
        async move {
            metric(
                &url,
                r#"switchyard_router_fleet_in_flight{endpoint="chat",instance="engine-0"}"#,
            )
            .await
            .unwrap_or(-1.0)
        }
    };
    eventually(
        Duration::from_secs(10),
        "router A to see B's load",
        || async { fleet(&a).await == 2.0 },
    )
    .await?;
    control.kill();
    eventually(
        Duration::from_secs(10),
        "router A to drop B's load",
        || async { fleet(&a).await == 0.0 },
    )
    .await?;
    assert_eq!(
        fleet(&b).await,
        2.0,
        "router B still counts its own requests"
    );
    drop(held);
    Ok(())
}

#[tokio::test]
async fn a_router_fails_over_across_its_control_plane_urls() -> anyhow::Result<()> {
    // --control-plane URL1,URL2,URL3: the first refuses connections, the second is a replica
    // that gets killed (SIGKILL), the third a replica on the same etcd. The router syncs from
    // the second, then follows the third.
    let (_etcd, mut first_replica, second_replica) = etcd_replica_pair("/failover/").await?;
    let refusing = RefusingPort::new()?;
    let router = router(&[refusing.url(), first_replica.url(), second_replica.url()]).await?;
    let mut admin = admin(&second_replica.url()).await?;
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    let knows = |id: &'static str| {
        let router = &router;
        move || async move {
            router
                .table()
                .endpoints
                .get("chat")
                .is_some_and(|endpoint| {
                    endpoint.variants[0]
                        .instances
                        .iter()
                        .any(|instance| instance.id.as_str() == id)
                })
        }
    };
    register(&mut admin, "chat", "before", "http://127.0.0.1:9").await?;
    eventually(
        Duration::from_secs(15),
        "the router to sync",
        knows("before"),
    )
    .await?;
    first_replica.kill();
    register(&mut admin, "chat", "after", "http://127.0.0.1:9").await?;
    eventually(
        Duration::from_secs(15),
        "the router to follow the other replica",
        knows("after"),
    )
    .await?;
    Ok(())
}

/// Killing an engine under load fails exactly the requests it held (a clear 502, never sent
/// to a second engine: it may have done the work) and nothing else: later requests that pick
/// it are refused a connection and retried elsewhere. The router's own ejection, with no
/// control plane to remove the instance, is shown in tests/faults.rs.
#[tokio::test]
async fn an_instance_killed_mid_load_fails_only_what_it_held() -> anyhow::Result<()> {
    let sim = SimConfig {
        time_scale: 0.1,
        ..SimConfig::default()
    };
    let cluster = Cluster::start(3, 1, &variant_json("RANDOM", None), sim).await?;
    let url = chat_url(&cluster.routers()[0]);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    const WORKERS: usize = 6;
    for worker in 0..WORKERS {
        let url = url.clone();
        let done = std::sync::Arc::clone(&done);
        tasks.push(tokio::spawn(async move {
            let mut replies = Vec::new();
            for round in 0..25 {
                let id = format!("w{worker}-r{round}");
                let body = chat_body(&id, 8, false);
                let reply = http_post(&url, &[("x-request-id", &id)], body)
                    .await
                    .expect("router answers");
                replies.push((id, reply));
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            replies
        }));
    }
    // Kill an engine once the load is well under way (requests are in flight on it).
    eventually(Duration::from_secs(10), "load to be under way", || async {
        done.load(std::sync::atomic::Ordering::Relaxed) >= 20
    })
    .await?;
    cluster.engines()[0].kill();
    let mut failed = Vec::new();
    let mut ok = 0;
    for task in tasks {
        for (id, reply) in task.await? {
            match reply.status {
                200 => ok += 1,
                502 => {
                    assert_eq!(
                        reply.json()["error"]["code"],
                        "upstream_reset",
                        "{}",
                        reply.body
                    );
                    failed.push(id);
                }
                status => panic!("{id}: a client saw {status}: {}", reply.body),
            }
        }
    }
    // At most one request per worker was in flight on the engine when it died.
    assert!(failed.len() <= WORKERS, "{failed:?}");
    assert_eq!(ok + failed.len(), WORKERS * 25);
    let ids_on = |engine: usize| -> HashSet<String> {
        cluster.engines()[engine]
            .received()
            .into_iter()
            .filter_map(|request| request.headers.get("x-request-id").cloned())
            .collect()
    };
    let others = [ids_on(1), ids_on(2)];
    // A failed request reached engine-0 or nothing at all (a connection the dying engine
    // closed as the request was written cannot be told apart from one that delivered it),
    // and never another engine.
    for id in &failed {
        assert!(
            others.iter().all(|ids| !ids.contains(id)),
            "{id} was sent again to another engine"
        );
    }
    // The dead instance is out of rotation: ejected by the router or removed by the
    // control plane's health checks, whichever came first.
    let router = &cluster.routers()[0];
    let metrics = Metrics::scrape(&router.url()).await?;
    let ejected = metrics
        .get(r#"switchyard_router_instance_ejected{endpoint="chat",instance="engine-0"}"#)
        == Some(1.0);
    let removed = router.table().endpoints["chat"].variants[0].instances.len() == 2;
    assert!(
        ejected || removed,
        "engine-0 still in rotation:\n{metrics:?}"
    );
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn streaming_arrives_incrementally_and_disconnects_cancel() -> anyhow::Result<()> {
    let sim = real_time();
    let cluster = Cluster::start(1, 1, &variant_json("RANDOM", None), sim).await?;
    let url = chat_url(&cluster.routers()[0]);
    let (status, headers, frames) =
        http_post_frames(&url, &[], chat_body("tell me a story", 20, true)).await?;
    assert_eq!(status, 200);
    assert!(
        headers
            .get("content-type")
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.starts_with("text/event-stream")),
        "{headers:?}"
    );
    let text = frames_text(&frames);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(
        frames.len() >= 10,
        "expected many chunks, got {}",
        frames.len()
    );
    // 20 tokens at ~14 ms each: the first chunk reaches the client long before the last is made.
    let first = frames.first().unwrap().0;
    let last = frames.last().unwrap().0;
    assert!(
        last.duration_since(first) >= Duration::from_millis(100),
        "chunks were buffered: all arrived within {:?}",
        last.duration_since(first)
    );

    // A client that goes away mid-stream frees the router's slot and the engine's.
    let mut response = post_streaming(&url, &[], chat_body("a long one", 2000, true)).await?;
    use http_body_util::BodyExt as _;
    let _ = response.body_mut().frame().await;
    assert_eq!(cluster.routers()[0].in_flight(), 1);
    drop(response);
    cluster.wait_idle().await?;
    let engine = &cluster.engines()[0];
    eventually(
        Duration::from_secs(5),
        "the engine to drop the request",
        || async { engine.stats().running == 0 },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn bad_input_gets_clear_errors_and_leaves_counts_exact() -> anyhow::Result<()> {
    let cluster = Cluster::start(1, 1, &prefix_aware(10), fast()).await?;
    let router = &cluster.routers()[0];
    let reply = http_post(&chat_url(router), &[], "{\"messages\": [").await?;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.json()["error"]["type"],
        "invalid_request_error",
        "{}",
        reply.body
    );

    let reply = http_post(&chat_url(router), &[], r#"{"messages":[],"stream":"yes"}"#).await?;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.json()["error"]["param"], "stream", "{}", reply.body);

    let huge = vec![b'x'; 6_291_457];
    let reply = http_post(&chat_url(router), &[], huge).await?;
    assert_eq!(reply.status, 413, "{}", reply.body);
    // The same without Content-Length (16 MiB chunked): the router finds out while reading,
    // reads the rest away, and the client gets the 413, not a broken pipe.
    let answer = chunked_post(router.addr, "/v1/chat/completions", 16, 1 << 20).await?;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // A client that waits for `100 Continue` (curl does, for large bodies) gets the 413 at
    // once instead of an invitation to upload 20 MB.
    let answer = expect_continue_post(router.addr, "/v1/chat/completions", 20_000_000).await?;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");

    let reply = http_post(
        &format!("{}/endpoints/nope/invocations", router.url()),
        &[],
        "{}",
    )
    .await?;
    assert_eq!(reply.status, 404);
    assert_eq!(
        reply.json()["ErrorCode"],
        "ValidationError",
        "{}",
        reply.body
    );
    assert!(reply.body.contains("nope"));

    let long_id = "x".repeat(65);
    for bad in [long_id.as_str(), "tab\there"] {
        let reply = http_post(
            &invocations_url(router),
            &[("x-amzn-sagemaker-prefix-aware-id", bad)],
            chat_body("hi", 1, false),
        )
        .await?;
        assert_eq!(reply.status, 400, "{bad}: {}", reply.body);
        assert!(reply.body.contains("prefix-aware-id"), "{}", reply.body);
    }

    let reply = http_post(
        &format!("{}/v1/chat/completions", router.url()),
        &[],
        r#"{"model":"unknown","messages":[]}"#,
    )
    .await?;
    assert_eq!(reply.status, 404);
    assert_eq!(
        reply.json()["error"]["code"],
        "model_not_found",
        "{}",
        reply.body
    );

    let reply = http_post(
        &chat_url(router),
        &[("x-amzn-sagemaker-target-variant", "Nope")],
        chat_body("hi", 1, false),
    )
    .await?;
    assert_eq!(reply.status, 400, "{}", reply.body);

    // Still serving everyone else.
    assert_eq!(
        http_post(&chat_url(router), &[], chat_body("hi", 1, false))
            .await?
            .status,
        200
    );
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn no_healthy_instance_is_a_clear_503() -> anyhow::Result<()> {
    let cluster = Cluster::start(1, 1, &variant_json("RANDOM", None), fast()).await?;
    cluster.engines()[0].kill();
    let router = &cluster.routers()[0];
    let reply = http_post(&chat_url(router), &[], chat_body("hi", 1, false)).await?;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(reply.json()["error"]["type"], "service_unavailable");
    let reply = http_post(&invocations_url(router), &[], chat_body("hi", 1, false)).await?;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(reply.json()["ErrorCode"], "ServiceUnavailable");
    // The control plane's probes take it out of the table too.
    eventually(
        Duration::from_secs(10),
        "the dead instance to leave the table",
        || async {
            router.table().endpoints["chat"].variants[0]
                .instances
                .is_empty()
        },
    )
    .await?;
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn plain_v1_paths_native_paths_and_model_names() -> anyhow::Result<()> {
    let cluster = Cluster::start(1, 1, &prefix_aware(10), fast()).await?;
    let router = &cluster.routers()[0];
    // The client names the endpoint; the engine sees the variant's ModelName ("sim").
    let reply = http_post(
        &format!("{}/v1/chat/completions", router.url()),
        &[(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )],
        chat_body("hello", 2, false),
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.header("x-amzn-invoked-production-variant"),
        Some("AllTraffic")
    );
    let received = cluster.engines()[0].received();
    let last = received.last().unwrap();
    assert_eq!(last.model.as_deref(), Some("sim"));
    assert_eq!(
        last.header("traceparent"),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert!(
        last.header("x-request-id").is_some(),
        "the router adds a request id"
    );
    let reply = http_post(
        &format!("{}/v1/completions", router.url()),
        &[],
        r#"{"model":"sim","prompt":"once upon a time","max_tokens":3}"#,
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);

    // Native: the body goes through byte for byte.
    let native = "{ \"messages\" : [ {\"role\":\"user\",\"content\":\"hi\"} ], \"model\":\"sim\", \"max_tokens\": 2 }";
    let reply = http_post(&invocations_url(router), &[], native).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let received = cluster.engines()[0].received();
    let last = received.last().unwrap();
    assert_eq!(last.path, "/invocations");
    assert_eq!(last.body_bytes, native.len());

    // An engine error on the native path is SageMaker's 424 ModelError.
    let reply = http_post(
        &invocations_url(router),
        &[],
        r#"{"model":"other","prompt":"x"}"#,
    )
    .await?;
    assert_eq!(reply.status, 424, "{}", reply.body);
    assert_eq!(reply.json()["ErrorCode"], "ModelError");

    let (status, models) = http_get(&format!("{}/v1/models", router.url())).await?;
    assert_eq!(status, 200);
    assert!(
        models.contains("\"chat\"") && models.contains("\"sim\""),
        "{models}"
    );
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn the_openai_python_client_works_against_the_router() -> anyhow::Result<()> {
    let python = test_python();
    let cluster = Cluster::start(2, 1, &prefix_aware(10), fast()).await?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/openai_client.py");
    let base_url = format!("{}/v1", cluster.routers()[0].url());
    let output = tokio::process::Command::new(&python)
        .arg(&script)
        .arg(&base_url)
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "openai client failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all ok"), "{stdout}\n{stderr}");
    cluster.wait_idle().await?;
    Ok(())
}

/// A router config that routes endpoint `chat` (one variant, AllTraffic, ModelName sim) from a
/// static YAML file written in `dir`: `variant` adds lines to the variant, `instances` is the
/// Instances list (YAML lines indented for it).
fn static_file_config(
    dir: &std::path::Path,
    variant: &str,
    instances: &str,
) -> anyhow::Result<switchyard_router::RouterConfig> {
    let path = dir.join("switchyard.yaml");
    std::fs::write(
        &path,
        format!(
            "Endpoints:\n  - EndpointName: chat\n    ProductionVariants:\n      - VariantName: AllTraffic\n        ModelName: sim\n{variant}    Instances:\n{instances}"
        ),
    )?;
    let mut config = switchyard_router::RouterConfig::with_control_plane(loopback_any(), vec![]);
    config.config = Some(path);
    Ok(config)
}

#[tokio::test]
async fn a_router_runs_from_a_static_file_over_http1_or_h2c() -> anyhow::Result<()> {
    let engine = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let mut config = static_file_config(
        dir.path(),
        "",
        &format!("      - Url: {}\n        InstanceId: only\n", engine.url),
    )?;
    let router = switchyard_router::RouterHandle::start(
        config.clone().validate().map_err(anyhow::Error::msg)?,
    )
    .await?;
    let reply = http_post(&chat_url(&router), &[], chat_body("hi", 1, false)).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-switchyard-instance"), Some("only"));
    assert_eq!(engine.received().last().unwrap().http_version, "HTTP/1.1");
    router.shutdown().await;

    // The same over h2c, for engines that speak HTTP/2 without TLS.
    config.upstream_protocol = switchyard_router::UpstreamProtocol::H2c;
    let router =
        switchyard_router::RouterHandle::start(config.validate().map_err(anyhow::Error::msg)?)
            .await?;
    for stream in [false, true] {
        let (status, _, frames) =
            http_post_frames(&chat_url(&router), &[], chat_body("hi", 3, stream)).await?;
        assert_eq!(status, 200);
        assert!(!frames.is_empty());
        assert_eq!(engine.received().last().unwrap().http_version, "HTTP/2.0");
    }
    router.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn shutdown_finishes_in_flight_streams() -> anyhow::Result<()> {
    let sim = real_time();
    let mut cluster = Cluster::start(1, 1, &variant_json("RANDOM", None), sim).await?;
    let router = cluster.take_router(0);
    let url = chat_url(&router);
    // A stream of 30 tokens (~0.4 s) is under way when the router is told to stop.
    let stream =
        tokio::spawn(
            async move { http_post_frames(&url, &[], chat_body("story", 30, true)).await },
        );
    eventually(Duration::from_secs(5), "the stream to start", || async {
        router.in_flight() == 1
    })
    .await?;
    let addr = router.addr;
    let stopping = tokio::spawn(router.shutdown());
    // The listener closes (no new connections) while the old stream finishes.
    assert!(
        listens_in_this_process(addr),
        "the router's listener is visible"
    );
    eventually(Duration::from_secs(5), "the listener to close", || async {
        !listens_in_this_process(addr)
    })
    .await?;
    let (status, _, frames) = stream.await??;
    assert_eq!(status, 200);
    let text = frames_text(&frames);
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "the stream was cut: {text}"
    );
    tokio::time::timeout(Duration::from_secs(10), stopping).await??;
    Ok(())
}

#[tokio::test]
async fn sessions_stick_and_variants_share_traffic_by_weight() -> anyhow::Result<()> {
    let cluster = Cluster::start(3, 1, &variant_json("RANDOM", None), fast()).await?;
    let url = chat_url(&cluster.routers()[0]);
    // X-Amzn-SageMaker-Session-Id pins a session to one instance whatever the prompt.
    for session in ["s-1", "s-2", "s-3"] {
        let mut seen = HashSet::new();
        for turn in 0..6 {
            let reply = http_post(
                &url,
                &[("x-amzn-sagemaker-session-id", session)],
                chat_body(&format!("turn {turn}"), 1, false),
            )
            .await?;
            assert_eq!(reply.header("x-switchyard-route"), Some("session"));
            seen.insert(
                reply
                    .header("x-switchyard-instance")
                    .unwrap_or("")
                    .to_owned(),
            );
        }
        assert_eq!(seen.len(), 1, "session {session} moved: {seen:?}");
    }

    // Two variants weighted 1:3; the target-variant header overrides the weights.
    let mut admin = admin(cluster.control_plane_url()).await?;
    let variants = r#"[{"VariantName":"Small","ModelName":"sim","InitialVariantWeight":1},
                       {"VariantName":"Large","ModelName":"sim","InitialVariantWeight":3}]"#;
    create_endpoint_from(
        &mut admin,
        "split",
        config_request("two-variants", variants),
    )
    .await?;
    for (index, variant) in ["Small", "Large"].iter().enumerate() {
        admin
            .register_instance(pb::RegisterInstanceRequest {
                endpoint_name: "split".into(),
                variant_name: (*variant).into(),
                url: cluster.engines()[index].url.clone(),
                id: format!("{variant}-0"),
                ..Default::default()
            })
            .await?;
    }
    let router = &cluster.routers()[0];
    eventually(
        Duration::from_secs(10),
        "the router to see both variants",
        || async {
            router
                .table()
                .endpoints
                .get("split")
                .is_some_and(|endpoint| {
                    endpoint
                        .variants
                        .iter()
                        .all(|variant| variant.instances.len() == 1)
                })
        },
    )
    .await?;
    let split_url = format!(
        "{}/endpoints/split/openai/v1/chat/completions",
        router.url()
    );
    let mut large = 0;
    let total = 400;
    for index in 0..total {
        let reply = http_post(&split_url, &[], chat_body(&format!("q{index}"), 1, false)).await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        if reply.header("x-amzn-invoked-production-variant") == Some("Large") {
            large += 1;
        }
    }
    // The router draws the variant per request: Large's count is Binomial(400, 0.75), sd
    // √(400·0.75·0.25)/400 ≈ 0.022 of the share. ±0.13 is 6 sd (a false alarm about once in
    // 500 million runs) and still fails an equal split (0.5) or inverted weights (0.25).
    let share = f64::from(large) / f64::from(total);
    assert!(
        (0.62..=0.88).contains(&share),
        "Large got {share:.2} of traffic, expected 0.75"
    );
    for _ in 0..10 {
        let reply = http_post(
            &split_url,
            &[("x-amzn-sagemaker-target-variant", "Small")],
            chat_body("targeted", 1, false),
        )
        .await?;
        assert_eq!(
            reply.header("x-amzn-invoked-production-variant"),
            Some("Small")
        );
    }
    cluster.wait_idle().await?;
    Ok(())
}

/// POSTs `chunks` chunks of `chunk_bytes` bytes with chunked transfer encoding over a raw
/// connection, then reads the answer until the connection closes or 10 s pass.
async fn chunked_post(
    addr: std::net::SocketAddr,
    path: &str,
    chunks: usize,
    chunk_bytes: usize,
) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await?;
    let chunk = vec![b' '; chunk_bytes];
    for _ in 0..chunks {
        stream
            .write_all(format!("{chunk_bytes:x}\r\n").as_bytes())
            .await?;
        stream.write_all(&chunk).await?;
        stream.write_all(b"\r\n").await?;
    }
    stream.write_all(b"0\r\n\r\n").await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await??;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

#[tokio::test]
async fn each_instance_is_reached_over_its_own_protocol() -> anyhow::Result<()> {
    // Through the control plane: engine-0 registered without a protocol (the router's
    // default, HTTP/1.1), a second engine registered with protocol h2c.
    let cluster = Cluster::start(1, 1, &variant_json("RANDOM", None), fast()).await?;
    let h2c_engine = switchyard_engine_sim::spawn(fast()).await?;
    let mut admin = admin(cluster.control_plane_url()).await?;
    let registered = admin
        .register_instance(pb::RegisterInstanceRequest {
            endpoint_name: "chat".into(),
            variant_name: "AllTraffic".into(),
            url: h2c_engine.url.clone(),
            id: "h2c-engine".into(),
            protocol: pb::InstanceProtocol::H2c as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(registered.protocol, pb::InstanceProtocol::H2c as i32);
    cluster.wait_for_instances(2).await?;
    let router = &cluster.routers()[0];
    let mut seen = HashSet::new();
    for _ in 0..40 {
        let reply = http_post(&chat_url(router), &[], chat_body("hi", 1, false)).await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        seen.insert(
            reply
                .header("x-switchyard-instance")
                .unwrap_or("")
                .to_owned(),
        );
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    let versions = |engine: &switchyard_engine_sim::SimHandle| -> HashSet<String> {
        engine
            .received()
            .into_iter()
            .map(|request| request.http_version)
            .collect()
    };
    assert_eq!(
        versions(&h2c_engine),
        HashSet::from(["HTTP/2.0".to_owned()])
    );
    assert_eq!(
        versions(&cluster.engines()[0]),
        HashSet::from(["HTTP/1.1".to_owned()])
    );
    cluster.wait_idle().await?;

    // From a static file, with h2c as the router's default: `Protocol: http1` wins for its
    // instance.
    let http1_engine = switchyard_engine_sim::spawn(fast()).await?;
    let default_engine = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let mut config = static_file_config(
        dir.path(),
        "        RoutingConfig: {RoutingStrategy: RANDOM}\n",
        &format!(
            "      - Url: {}\n        InstanceId: old\n        Protocol: http1\n      - Url: {}\n        InstanceId: new\n",
            http1_engine.url, default_engine.url
        ),
    )?;
    config.upstream_protocol = switchyard_router::UpstreamProtocol::H2c;
    let router =
        switchyard_router::RouterHandle::start(config.validate().map_err(anyhow::Error::msg)?)
            .await?;
    for _ in 0..40 {
        let reply = http_post(&chat_url(&router), &[], chat_body("hi", 1, false)).await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert_eq!(
        versions(&http1_engine),
        HashSet::from(["HTTP/1.1".to_owned()])
    );
    assert_eq!(
        versions(&default_engine),
        HashSet::from(["HTTP/2.0".to_owned()])
    );
    router.shutdown().await;
    Ok(())
}

/// Sends only the head of a POST with `Expect: 100-continue` and `Content-Length: length`,
/// and returns what the server answers first (within 3 s).
async fn expect_continue_post(
    addr: std::net::SocketAddr,
    path: &str,
    length: usize,
) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {length}\r\nexpect: 100-continue\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await?;
    let mut answer = vec![0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(3), stream.read(&mut answer)).await??;
    Ok(String::from_utf8_lossy(&answer[..read]).into_owned())
}

#[tokio::test]
async fn dropping_the_handle_stops_every_serving_thread() -> anyhow::Result<()> {
    let engine = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let mut config = static_file_config(dir.path(), "", &format!("      - Url: {}\n", engine.url))?;
    config.worker_threads = Some(3);
    let router =
        switchyard_router::RouterHandle::start(config.validate().map_err(anyhow::Error::msg)?)
            .await?;
    let addr = router.addr;
    let reply = http_post(&chat_url(&router), &[], chat_body("hi", 1, false)).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        listens_in_this_process(addr),
        "the router's listener is visible"
    );
    drop(router);
    // Every thread's copy of the listening socket closes.
    eventually(Duration::from_secs(10), "the port to close", || async {
        !listens_in_this_process(addr)
    })
    .await?;
    Ok(())
}
