//! Flow control (MaxInFlightPerInstance): a router from a static file over simulated
//! engines. Requests past the cap wait in the router's queue and leave it by priority, then
//! in turn across fairness ids; an engine never gets more than the cap; timeout, overflow,
//! disconnect and SIGTERM while queued; clients' flow headers stripped unless trusted.
//!
//! Most cases hold the cap's slots with requests to an engine told to hang (accept, never
//! answer), so that what waits and what reaches the engine is exact; the holders' clients
//! then leave, which frees the slots, with the engine answering again.

use std::ops::RangeInclusive;
use std::time::Duration;

use switchyard_engine_sim::{InstanceRole, SimConfig, SimHandle};
use switchyard_router::{RouterConfig, RouterHandle};
use switchyard_tests::*;
use tokio::task::JoinHandle;

/// A router for endpoint `chat` (variant `v`, LEAST_OUTSTANDING_REQUESTS, ModelName `sim`)
/// with MaxInFlightPerInstance `cap` over `engines`, from a static file, `tune` applied to
/// its flags.
async fn start_router(
    dir: &tempfile::TempDir,
    cap: u32,
    engines: &[&SimHandle],
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<RouterHandle> {
    start_router_with(
        dir,
        &format!("MaxInFlightPerInstance: {cap}"),
        engines,
        tune,
    )
    .await
}

/// [`start_router`] with the variant's flow-control fields as given (`fields`, YAML).
async fn start_router_with(
    dir: &tempfile::TempDir,
    fields: &str,
    engines: &[&SimHandle],
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<RouterHandle> {
    let mut yaml = format!(
        "Endpoints:\n  - EndpointName: chat\n    ProductionVariants:\n      - VariantName: v\n        ModelName: sim\n        {fields}\n        RoutingConfig: {{RoutingStrategy: LEAST_OUTSTANDING_REQUESTS}}\n    Instances:\n"
    );
    for (index, engine) in engines.iter().enumerate() {
        yaml.push_str(&format!(
            "      - {{Url: \"{}\", InstanceId: e{index}, VariantName: v}}\n",
            engine.url
        ));
    }
    router_from_file(&dir.path().join("routes.yaml"), &yaml, tune).await
}

/// A simulated engine (50× real time) and a router over it ([`start_router`], MaxInFlightPerInstance
/// `cap`, `tune` applied): the engine, the folder of the router's file, the router.
async fn engine_and_router(
    cap: u32,
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<(SimHandle, tempfile::TempDir, RouterHandle)> {
    engine_and_router_with(&format!("MaxInFlightPerInstance: {cap}"), tune).await
}

/// [`engine_and_router`] with the variant's flow-control fields as given (`fields`, YAML).
async fn engine_and_router_with(
    fields: &str,
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<(SimHandle, tempfile::TempDir, RouterHandle)> {
    let engine = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let router = start_router_with(&dir, fields, &[&engine], tune).await?;
    Ok((engine, dir, router))
}

/// [`engine_and_router`] with the engine's `cap` slots held ([`hold_slots`]): the engine, the
/// folder of the router's file, the router, the holders.
async fn held_engine_and_router(
    cap: u32,
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<(SimHandle, tempfile::TempDir, RouterHandle, Vec<Pending>)> {
    let (engine, dir, router) = engine_and_router(cap, tune).await?;
    let holders = hold_slots(&router, &engine, cap as usize).await?;
    Ok((engine, dir, router, holders))
}

fn hanging(engine: &SimHandle, hang: bool) {
    engine.set_faults(switchyard_engine_sim::Faults {
        hang_rate: if hang { 1.0 } else { 0.0 },
        ..Default::default()
    });
}

/// A request in a task of its own; its client leaves when the task is aborted.
type Pending = JoinHandle<anyhow::Result<Reply>>;

/// A chat request (one token) through `router`, in a task of its own, with `headers`; its
/// body carries `extra` fields.
fn send(router: &RouterHandle, headers: &[(&str, &str)], extra: serde_json::Value) -> Pending {
    let url = chat_url(router);
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
        .collect();
    let mut body: serde_json::Value = serde_json::from_str(&chat_body("hello", 1, false)).unwrap();
    if let (Some(body), serde_json::Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
    tokio::spawn(async move {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        http_post(&url, &headers, body.to_string()).await
    })
}

/// [`send`] with `x-request-id: id` and nothing added to the body.
fn send_as(router: &RouterHandle, id: &str) -> Pending {
    send(router, &[("x-request-id", id)], serde_json::json!({}))
}

/// Waits for each of `tasks` (`what` names them if one hangs) and asserts that it was
/// answered 200; returns the answers, in order.
async fn all_answered(tasks: Vec<Pending>, what: &str) -> anyhow::Result<Vec<Reply>> {
    let mut replies = Vec::with_capacity(tasks.len());
    for task in tasks {
        let reply = bounded(what, task).await??;
        assert_eq!(reply.status, 200, "{}", reply.body);
        replies.push(reply);
    }
    Ok(replies)
}

/// Asserts that `reply` turned the client away for now: 503, to be tried again in a second.
fn assert_try_again(reply: &Reply) {
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(reply.header("retry-after"), Some("1"));
}

/// [`assert_try_again`], in OpenAI's error shape with the error code `code`.
fn assert_try_again_openai(reply: &Reply, code: &str) {
    assert_try_again(reply);
    assert_eq!(reply.json()["error"]["code"], code, "{}", reply.body);
}

/// Asserts that of the first `first` of `served` (request ids), the share of those starting
/// with `prefix` lies within `within`.
fn assert_share(served: &[String], first: usize, prefix: &str, within: RangeInclusive<f64>) {
    let count = served[..first]
        .iter()
        .filter(|id| id.starts_with(prefix))
        .count();
    let share = count as f64 / first as f64;
    assert!(
        within.contains(&share),
        "{prefix} share {share}: {served:?}"
    );
}

/// Holds `engine`'s one slot ([`hold_slots`]), then queues each backlog of `backlogs` in turn:
/// (fairness id, requests, the body field naming it), the requests `{id}-{index}`, each with
/// `headers` too. Frees the slot and waits for every answer; returns the ids in the order
/// `engine` served them.
async fn serve_backlogs(
    router: &RouterHandle,
    engine: &SimHandle,
    backlogs: &[(&str, usize, &str)],
    headers: &[(&str, &str)],
) -> anyhow::Result<Vec<String>> {
    let holders = hold_slots(router, engine, 1).await?;
    let mut tasks = Vec::new();
    for &(id, count, field) in backlogs {
        for index in 0..count {
            let request_id = format!("{id}-{index}");
            let mut request_headers = vec![("x-request-id", request_id.as_str())];
            request_headers.extend_from_slice(headers);
            tasks.push(send(
                router,
                &request_headers,
                serde_json::json!({ field: id }),
            ));
        }
        queued(router, tasks.len()).await?;
    }
    release(engine, holders);
    all_answered(tasks, "a queued request").await?;
    Ok(served_ids(engine))
}

/// Fills `cap` slots of `engine` with requests it never answers: the holders, whose
/// clients leave when aborted.
async fn hold_slots(
    router: &RouterHandle,
    engine: &SimHandle,
    cap: usize,
) -> anyhow::Result<Vec<Pending>> {
    hanging(engine, true);
    let before = engine.received().len();
    let holders: Vec<_> = (0..cap)
        .map(|index| send_as(router, &format!("holder-{index}")))
        .collect();
    received(engine, before + cap, "the holders to reach the engine").await?;
    Ok(holders)
}

/// Waits (10 s at most) until `check` holds (`what` names it if it never does).
async fn wait_until(what: &str, check: impl Fn() -> bool) -> anyhow::Result<()> {
    eventually(Duration::from_secs(10), what, || async { check() }).await
}

/// Waits until `engine` has received `count` requests in all.
async fn received(engine: &SimHandle, count: usize, what: &str) -> anyhow::Result<()> {
    wait_until(what, || engine.received().len() == count).await
}

/// Waits until `count` requests wait in the queue of `chat`/`v`.
async fn queued(router: &RouterHandle, count: usize) -> anyhow::Result<()> {
    queued_in(router, "chat", "v", count).await
}

/// Waits until `count` requests wait in the queue of `endpoint`/`variant`.
async fn queued_in(
    router: &RouterHandle,
    endpoint: &str,
    variant: &str,
    count: usize,
) -> anyhow::Result<()> {
    let what = format!("{count} requests queued for {endpoint}/{variant}");
    wait_until(&what, || router.queued(endpoint, variant) == count).await
}

/// The ids of the requests `engine` received, in arrival order, holders left out.
fn served_ids(engine: &SimHandle) -> Vec<String> {
    engine
        .received()
        .into_iter()
        .filter_map(|request| request.headers.get("x-request-id").cloned())
        .filter(|id| !id.starts_with("holder-"))
        .collect()
}

fn release(engine: &SimHandle, holders: Vec<Pending>) {
    hanging(engine, false);
    for holder in holders {
        holder.abort();
    }
}

async fn dropped(router: &RouterHandle, reason: &str) -> anyhow::Result<f64> {
    let metrics = Metrics::scrape(&router.url()).await?;
    Ok(metrics
        .named("switchyard_router_queue_dropped_total")
        .filter(|sample| sample.label("reason") == Some(reason))
        .map(|sample| sample.value)
        .sum())
}

#[tokio::test]
async fn past_the_cap_requests_wait_and_each_is_served_when_a_slot_frees() -> anyhow::Result<()> {
    let (engine, _dir, router, holders) = held_engine_and_router(2, |_| {}).await?;
    let waiting: Vec<_> = (0..3)
        .map(|index| send_as(&router, &format!("queued-{index}")))
        .collect();
    queued(&router, 3).await?;
    // Exactly the cap reached the engine; the rest wait in the router.
    assert_eq!(engine.received().len(), 2);
    let metrics = Metrics::scrape(&router.url()).await?;
    let length = metrics
        .named("switchyard_router_queue_length")
        .find(|sample| sample.label("priority") == Some("0"))
        .map(|sample| sample.value);
    assert_eq!(length, Some(3.0));
    let oldest = metrics
        .named("switchyard_router_queue_oldest_seconds")
        .next()
        .map(|sample| sample.value);
    assert!(oldest.is_some_and(|age| age >= 0.0), "{oldest:?}");
    // One holder's client leaves: its slot frees, and the queue drains through it one by one.
    hanging(&engine, false);
    let mut holders = holders.into_iter();
    holders.next().unwrap().abort();
    for reply in all_answered(waiting, "a queued request").await? {
        let waited: u64 = reply.header("x-switchyard-queue-ms").unwrap().parse()?;
        assert!(waited < 30_000, "{waited}");
    }
    assert_eq!(router.queued("chat", "v"), 0);
    assert_eq!(engine.received().len(), 5);
    for holder in holders {
        holder.abort();
    }
    settles(&router).await?;
    // Only inference waits: with every slot held, `/tokenize` goes straight to the engine.
    let holders = hold_slots(&router, &engine, 2).await?;
    let tokenized = http_post(
        &format!("{}/endpoints/chat/openai/tokenize", router.url()),
        &[],
        r#"{"model":"sim","prompt":"count me"}"#,
    )
    .await?;
    assert_eq!(tokenized.status, 200, "{}", tokenized.body);
    assert!(tokenized.header("x-switchyard-queue-ms").is_none());
    release(&engine, holders);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn under_load_no_engine_runs_more_than_the_cap() -> anyhow::Result<()> {
    const CAP: f64 = 2.0;
    // Real time: each answer takes tens of milliseconds, so requests overlap.
    let engines = [
        switchyard_engine_sim::spawn(real_time()).await?,
        switchyard_engine_sim::spawn(real_time()).await?,
    ];
    let dir = tempfile::tempdir()?;
    let router = start_router(&dir, CAP as u32, &[&engines[0], &engines[1]], |_| {}).await?;
    let url = chat_url(&router);
    let load: Vec<_> = (0..24)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { http_post(&url, &[], chat_body("load", 4, false)).await })
        })
        .collect();
    let mut most_running = [0.0f64; 2];
    let mut most_in_flight = 0.0f64;
    for _ in 0..2000 {
        if load.iter().all(JoinHandle::is_finished) {
            break;
        }
        for (index, engine) in engines.iter().enumerate() {
            let running = Metrics::scrape(&engine.url)
                .await?
                .sum("vllm:num_requests_running");
            most_running[index] = most_running[index].max(running);
        }
        let metrics = Metrics::scrape(&router.url()).await?;
        for sample in metrics.named("switchyard_router_in_flight") {
            most_in_flight = most_in_flight.max(sample.value);
        }
    }
    all_answered(load, "a request under load").await?;
    assert!(
        most_running.iter().all(|&running| running <= CAP),
        "engines ran {most_running:?} at once (cap {CAP})"
    );
    assert!(
        most_in_flight <= CAP,
        "{most_in_flight} in flight on one instance"
    );
    assert!(
        most_running.contains(&CAP),
        "the load never reached the cap: {most_running:?}"
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn the_queue_serves_lower_priorities_first_then_in_arrival_order() -> anyhow::Result<()> {
    let (engine, _dir, router, holders) =
        held_engine_and_router(1, |config| config.trust_flow_headers = true).await?;
    // Arrival: late-1 and late-2 (priority 5), urgent (header -1), body (body priority -5).
    let mut tasks = Vec::new();
    let cases: [(&str, Option<&str>, serde_json::Value); 4] = [
        ("late-1", Some("5"), serde_json::json!({})),
        ("late-2", Some("5"), serde_json::json!({})),
        ("urgent", Some("-1"), serde_json::json!({})),
        ("body", None, serde_json::json!({"priority": -5})),
    ];
    for (index, (id, priority, extra)) in cases.into_iter().enumerate() {
        let mut headers = vec![("x-request-id", id)];
        if let Some(priority) = priority {
            headers.push(("x-switchyard-priority", priority));
        }
        tasks.push(send(&router, &headers, extra));
        queued(&router, index + 1).await?;
    }
    release(&engine, holders);
    all_answered(tasks, "a queued request").await?;
    assert_eq!(served_ids(&engine), ["body", "urgent", "late-1", "late-2"]);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn the_headroom_serves_a_light_id_and_urgent_requests_past_a_heavy_ids_backlog()
-> anyhow::Result<()> {
    let (engine, _dir, router) = engine_and_router_with(
        "MaxInFlightPerInstance: 1\n        FlowHeadroomPerInstance: 1",
        |config| config.trust_flow_headers = true,
    )
    .await?;
    hanging(&engine, true);
    let heavy = |index: usize| {
        send(
            &router,
            &[("x-request-id", &format!("heavy-{index}"))],
            serde_json::json!({"user": "heavy"}),
        )
    };
    // The heavy id takes the capped slot; its next three wait: it took every slot so far.
    let mut tasks = vec![heavy(0)];
    wait_until("heavy-0 at the engine", || {
        served_ids(&engine) == ["heavy-0"]
    })
    .await?;
    for index in 1..4 {
        tasks.push(heavy(index));
    }
    queued(&router, 3).await?;
    // The light id took none of the slots: it starts at once, within the headroom.
    tasks.push(send(
        &router,
        &[("x-request-id", "light")],
        serde_json::json!({"user": "light"}),
    ));
    wait_until("the light request at the engine", || {
        served_ids(&engine) == ["heavy-0", "light"]
    })
    .await?;
    assert_eq!(router.queued("chat", "v"), 3);
    // Cap + headroom reached: an urgent request waits (the engine never gets a third).
    tasks.push(send(
        &router,
        &[("x-request-id", "urgent")],
        serde_json::json!({"user": "heavy", "priority": -1}),
    ));
    queued(&router, 4).await?;
    assert_eq!(served_ids(&engine).len(), 2);
    // The two at the engine leave (their clients go away): the urgent request goes first.
    hanging(&engine, false);
    let light = tasks.remove(4);
    for holder in [tasks.remove(0), light] {
        holder.abort();
    }
    all_answered(tasks, "a queued request").await?;
    let served = served_ids(&engine);
    assert_eq!(served[..3], ["heavy-0", "light", "urgent"], "{served:?}");
    let metrics = Metrics::scrape(&router.url()).await?;
    let grants: f64 = metrics
        .named("switchyard_router_queue_headroom_grants_total")
        .map(|sample| sample.value)
        .sum();
    assert!(grants >= 2.0, "headroom grants {grants}");
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn two_backlogged_fairness_ids_share_the_slots_evenly() -> anyhow::Result<()> {
    // Headers untrusted (the default): fairness ids come from the body, and a header naming
    // one shared id for everybody is stripped, not read.
    let (engine, _dir, router) = engine_and_router(1, |_| {}).await?;
    // The heavy id's 90 requests all arrive before the light id's 30.
    let served = serve_backlogs(
        &router,
        &engine,
        &[("heavy", 90, "safety_identifier"), ("light", 30, "user")],
        &[("x-switchyard-fairness-id", "everyone")],
    )
    .await?;
    assert_eq!(served.len(), 120);
    // While both were backlogged (the first 60 served), each had half.
    assert_share(&served, 60, "heavy-", 0.45..=0.55);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn fairness_weights_from_the_config_divide_the_turns() -> anyhow::Result<()> {
    let engine = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let yaml = format!(
        "Endpoints:\n  - EndpointName: chat\n    ProductionVariants:\n      - VariantName: v\n        ModelName: sim\n        MaxInFlightPerInstance: 1\n        FairnessWeights: {{gold: 3}}\n    Instances:\n      - {{Url: \"{}\", InstanceId: e0, VariantName: v}}\n",
        engine.url
    );
    let router = router_from_file(&dir.path().join("routes.yaml"), &yaml, |_| {}).await?;
    let backlogs = [("gold", 40, "user"), ("plain", 40, "user")];
    let served = serve_backlogs(&router, &engine, &backlogs, &[]).await?;
    // While both waited (the first 40 served), gold (weight 3) had three turns for each of
    // plain's (weight 1, not named): 75% ± 5%.
    assert_share(&served, 40, "gold-", 0.70..=0.80);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_full_queue_refuses_at_once_and_a_wait_ends_at_the_timeout() -> anyhow::Result<()> {
    let (engine, _dir, router, holders) = held_engine_and_router(1, |config| {
        config.max_queued_requests = 1;
        config.queue_timeout_seconds = 1;
    })
    .await?;
    let waiting = send(&router, &[], serde_json::json!({}));
    queued(&router, 1).await?;
    // Overflow, on the native path: SageMaker's error shape.
    let refused = http_post(&invocations_url(&router), &[], chat_body("x", 1, false)).await?;
    assert_try_again(&refused);
    assert_eq!(
        refused.json()["ErrorCode"],
        "ServiceUnavailable",
        "{}",
        refused.body
    );
    assert!(
        refused.body.contains("--max-queued-requests"),
        "{}",
        refused.body
    );
    // Timeout, on the OpenAI path: OpenAI's error shape.
    let timed_out = bounded("the queued request", waiting).await??;
    assert_try_again_openai(&timed_out, "queue_timeout");
    assert_eq!(router.queued("chat", "v"), 0);
    assert_eq!(dropped(&router, "overflow").await?, 1.0);
    assert_eq!(dropped(&router, "timeout").await?, 1.0);
    // Neither reached the engine.
    assert_eq!(engine.received().len(), 1);
    release(&engine, holders);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_client_that_goes_away_leaves_the_queue_at_once() -> anyhow::Result<()> {
    let (engine, _dir, router, holders) = held_engine_and_router(1, |_| {}).await?;
    let leaving = send_as(&router, "leaves");
    let staying = send_as(&router, "stays");
    queued(&router, 2).await?;
    leaving.abort();
    queued(&router, 1).await?;
    eventually(
        Duration::from_secs(10),
        "the disconnect counted",
        || async { dropped(&router, "disconnect").await.unwrap_or(0.0) == 1.0 },
    )
    .await?;
    release(&engine, holders);
    let reply = bounded("the request that stayed", staying).await??;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(served_ids(&engine), ["stays"]);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn after_sigterm_the_queue_is_served_within_the_grace_period_then_refused()
-> anyhow::Result<()> {
    let grace = |config: &mut RouterConfig| config.shutdown_grace_seconds = 4;
    // A slot frees during the grace period: the queued requests are served.
    let (engine, _dir, served) = engine_and_router(1, grace).await?;
    let holders = hold_slots(&served, &engine, 1).await?;
    let waiting: Vec<_> = (0..2)
        .map(|index| send_as(&served, &format!("drained-{index}")))
        .collect();
    queued(&served, 2).await?;
    served.shutdown_token().cancel();
    release(&engine, holders);
    all_answered(waiting, "a request queued at SIGTERM").await?;
    // No slot frees: after half the grace period the queue is answered 503.
    let dir = tempfile::tempdir()?;
    let refused = start_router(&dir, 1, &[&engine], grace).await?;
    let holders = hold_slots(&refused, &engine, 1).await?;
    let waiting = send(&refused, &[], serde_json::json!({}));
    queued(&refused, 1).await?;
    refused.shutdown_token().cancel();
    let reply = bounded("a request left in the queue", waiting).await??;
    assert_try_again_openai(&reply, "shutting_down");
    assert_eq!(dropped(&refused, "shutdown").await.unwrap_or(1.0), 1.0);
    release(&engine, holders);
    Ok(())
}

#[tokio::test]
async fn untrusted_flow_headers_are_stripped_and_trusted_ones_are_checked() -> anyhow::Result<()> {
    let (engine, _dir, untrusted) = engine_and_router(4, |_| {}).await?;
    let headers = [
        ("x-request-id", "untrusted"),
        ("x-switchyard-priority", "not-a-number"),
        ("x-switchyard-fairness-id", "someone"),
    ];
    let reply = http_post(&chat_url(&untrusted), &headers, chat_body("hi", 1, false)).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.header("x-switchyard-queue-ms").is_some());
    let seen = engine.received();
    let request = seen.last().unwrap();
    assert_eq!(
        request.headers.get("x-request-id").map(String::as_str),
        Some("untrusted")
    );
    assert!(
        !request.headers.contains_key("x-switchyard-priority")
            && !request.headers.contains_key("x-switchyard-fairness-id"),
        "{:?}",
        request.headers
    );
    // Trusted, they are read: a priority that is not an integer is refused, naming it.
    let dir = tempfile::tempdir()?;
    let trusted = start_router(&dir, 4, &[&engine], |config| {
        config.trust_flow_headers = true
    })
    .await?;
    let reply = http_post(&chat_url(&trusted), &headers, chat_body("hi", 1, false)).await?;
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(
        reply.body.contains("x-switchyard-priority"),
        "{}",
        reply.body
    );
    settles(&untrusted).await?;
    settles(&trusted).await?;
    Ok(())
}

#[tokio::test]
async fn the_cap_travels_from_the_admin_api_through_etcd_to_the_router() -> anyhow::Result<()> {
    let (_etcd, cp, mut admin) = etcd_admin("/flow/").await?;
    // Out of range: refused at the API, naming the field; nothing stored.
    let mut bad = config_request("bad", r#"[{"VariantName":"v","ModelName":"sim"}]"#);
    if let Some(config) = bad.endpoint_config.as_mut() {
        config.production_variants[0].max_in_flight_per_instance = Some(0);
    }
    let status = admin.create_endpoint_config(bad).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("ProductionVariants[0].MaxInFlightPerInstance"),
        "{}",
        status.message()
    );
    create_endpoint(
        &mut admin,
        "chat",
        r#"[{"VariantName":"v","ModelName":"sim","MaxInFlightPerInstance":3},
            {"VariantName":"w","ModelName":"sim","InitialVariantWeight":0}]"#,
    )
    .await?;
    let described = admin
        .describe_endpoint_config(switchyard_proto::v1::DescribeEndpointConfigRequest {
            name: "chat-cfg".into(),
        })
        .await?
        .into_inner();
    let variants = &described.production_variants;
    assert_eq!(variants[0].max_in_flight_per_instance, Some(3));
    assert_eq!(variants[1].max_in_flight_per_instance, None);
    let router = router(&[cp.url()]).await?;
    eventually(
        Duration::from_secs(15),
        "the router to have the endpoint",
        || async { router.table().endpoints.contains_key("chat") },
    )
    .await?;
    let table = router.table();
    let caps: Vec<Option<u32>> = table.endpoints["chat"]
        .variants
        .iter()
        .map(|variant| variant.max_in_flight_per_instance)
        .collect();
    assert_eq!(caps, [Some(3), None]);
    Ok(())
}

/// The other routers' in-flight count on instance `e0` of `chat`, as `router` knows it.
fn remote(router: &RouterHandle) -> u32 {
    let table = router.table();
    table
        .endpoints
        .get("chat")
        .and_then(|endpoint| endpoint.variants.first())
        .and_then(|variant| variant.instances.first())
        .map_or(0, |instance| {
            instance
                .cell
                .remote
                .load(std::sync::atomic::Ordering::Relaxed)
        })
}

#[tokio::test]
async fn the_cap_is_fleet_wide_across_routers_within_one_load_report_of_slack() -> anyhow::Result<()>
{
    const CAP: usize = 2;
    let engine = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let (cp, mut admin) = embedded_admin(dir.path()).await?;
    create_endpoint(
        &mut admin,
        "chat",
        &format!(
            r#"[{{"VariantName":"AllTraffic","ModelName":"sim","MaxInFlightPerInstance":{CAP}}}]"#
        ),
    )
    .await?;
    register(&mut admin, "chat", "e0", &engine.url).await?;
    let (first, second) = (router(&[cp.url()]).await?, router(&[cp.url()]).await?);
    for router in [&first, &second] {
        wait_for_router_instances(router, "chat", 1).await?;
    }
    // The first router fills the cap; once its load report reached the second, the second
    // holds its request back.
    let holders = hold_slots(&first, &engine, CAP).await?;
    wait_until("the first router's load at the second", || {
        remote(&second) == CAP as u32
    })
    .await?;
    let held_back = send_as(&second, "second");
    queued_in(&second, "chat", "AllTraffic", 1).await?;
    assert_eq!(engine.received().len(), CAP);
    // The first router's requests end; the report that says so wakes the second's queue.
    release(&engine, holders);
    let reply = bounded("the request held back", held_back).await??;
    assert_eq!(reply.status, 200, "{}", reply.body);
    settles(&first).await?;
    settles(&second).await?;
    wait_until("reports back at zero", || {
        remote(&first) == 0 && remote(&second) == 0
    })
    .await?;
    // The slack: routers that take slots within the same report interval each see only
    // their own, so a burst on both at once may put up to routers × cap on the engine.
    hanging(&engine, true);
    let before = engine.received().len();
    let burst: Vec<_> = (0..2 * CAP)
        .flat_map(|index| {
            [
                send_as(&first, &format!("burst-a{index}")),
                send_as(&second, &format!("burst-b{index}")),
            ]
        })
        .collect();
    wait_until("the burst to be placed or queued", || {
        let placed = engine.received().len() - before;
        placed + first.queued("chat", "AllTraffic") + second.queued("chat", "AllTraffic") == 4 * CAP
    })
    .await?;
    let placed = engine.received().len() - before;
    println!("burst on 2 routers at once, cap {CAP}: {placed} requests reached the engine");
    assert!((CAP..=2 * CAP).contains(&placed), "{placed}");
    release(&engine, burst);
    settles(&first).await?;
    settles(&second).await?;
    Ok(())
}

/// A router for disaggregated endpoint `pd` (RouteThreshold 100, NIXL) over one prefill and
/// one decode engine, each variant with MaxInFlightPerInstance 1.
async fn disaggregated_router(
    dir: &tempfile::TempDir,
    prefill: &SimHandle,
    decode: &SimHandle,
) -> anyhow::Result<RouterHandle> {
    let yaml = format!(
        "Endpoints:\n  - EndpointName: pd\n    ProductionVariants:\n      - {{VariantName: prefill, ModelName: sim, MaxInFlightPerInstance: 1}}\n      - {{VariantName: decode, ModelName: sim, MaxInFlightPerInstance: 1}}\n    DisaggregationConfig: {{PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 100}}\n    Instances:\n      - {{Url: \"{}\", InstanceId: p0, VariantName: prefill, Role: prefill}}\n      - {{Url: \"{}\", InstanceId: d0, VariantName: decode, Role: decode}}\n",
        prefill.url, decode.url
    );
    router_from_file(&dir.path().join("pd.yaml"), &yaml, |_| {}).await
}

/// A completion of about 300 tokens (past the threshold: prefill, then decode) through
/// `router`'s endpoint `pd`, in a task of its own.
fn send_long(router: &RouterHandle, id: &str) -> Pending {
    let url = format!("{}/endpoints/pd/openai/v1/completions", router.url());
    let prompt = format!("{id} {}", "hello ".repeat(300));
    let body = serde_json::json!({"model": "sim", "prompt": prompt, "max_tokens": 2}).to_string();
    let id = id.to_owned();
    tokio::spawn(async move { http_post(&url, &[("x-request-id", &id)], body).await })
}

/// Holds the one slot of `engine` (serving `variant` of `pd`) with a request it never answers
/// (`holder`) and sends `next` after it; waits until `engine` has received `received_then`
/// requests in all and `next` waits in `variant`'s queue. Returns both tasks.
async fn hold_then_queue(
    router: &RouterHandle,
    engine: &SimHandle,
    variant: &str,
    (holder, received_then): (&str, usize),
    next: &str,
) -> anyhow::Result<(Pending, Pending)> {
    hanging(engine, true);
    let holder = send_long(router, holder);
    received(
        engine,
        received_then,
        &format!("the holder at the {variant} engine"),
    )
    .await?;
    let next = send_long(router, next);
    queued_in(router, "pd", variant, 1).await?;
    Ok((holder, next))
}

#[tokio::test]
async fn under_disaggregation_each_variant_applies_its_own_cap() -> anyhow::Result<()> {
    let role = |role| SimConfig { role, ..fast() };
    let prefill = switchyard_engine_sim::spawn(role(InstanceRole::Prefill)).await?;
    let decode = switchyard_engine_sim::spawn(role(InstanceRole::Decode)).await?;
    let dir = tempfile::tempdir()?;
    let router = disaggregated_router(&dir, &prefill, &decode).await?;
    // The decoder holds its one slot: the next request is prefilled, then waits for it.
    let (holder, second) =
        hold_then_queue(&router, &decode, "decode", ("holder-decode", 1), "second").await?;
    assert_eq!(prefill.received().len(), 2, "both were prefilled");
    assert_eq!(decode.received().len(), 1, "the decoder's cap held");
    release(&decode, vec![holder]);
    let reply = bounded("the request that waited for a decoder", second).await??;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-switchyard-route"), Some("disaggregated"));
    assert!(reply.header("x-switchyard-decode-queue-ms").is_some());
    settles(&router).await?;
    // The prefill instance holds its one slot: the next request waits before its prefill.
    let (holder, third) =
        hold_then_queue(&router, &prefill, "prefill", ("holder-prefill", 3), "third").await?;
    assert_eq!(prefill.received().len(), 3, "the prefill cap held");
    release(&prefill, vec![holder]);
    let reply = bounded("the request that waited for a prefill", third).await??;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.header("x-switchyard-queue-ms").is_some());
    settles(&router).await?;
    Ok(())
}
