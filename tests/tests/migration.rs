//! Request migration (a variant's MigrationLimit): a streamed answer whose engine dies midway
//! continues on another instance, spliced into the client's stream so that it reads as the
//! undisturbed answer; beyond the limit, the stream ends with a final error event.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard_engine_sim::{SimConfig, SimHandle};
use switchyard_router::RouterHandle;
use switchyard_tests::*;

/// A router for endpoint `chat` (RANDOM, `MigrationLimit: limit`) over `engines`: (id,
/// engine, weight), from a static file.
async fn start_router(
    dir: &tempfile::TempDir,
    limit: u32,
    engines: &[(&str, &SimHandle, f64)],
) -> anyhow::Result<RouterHandle> {
    start_tuned(dir, limit, engines, |_| {}).await
}

async fn start_tuned(
    dir: &tempfile::TempDir,
    limit: u32,
    engines: &[(&str, &SimHandle, f64)],
    tune: impl FnOnce(&mut switchyard_router::RouterConfig),
) -> anyhow::Result<RouterHandle> {
    let mut yaml = format!(
        "Endpoints:\n  - EndpointName: chat\n    ProductionVariants:\n      - VariantName: AllTraffic\n        ModelName: sim\n        MigrationLimit: {limit}\n    Instances:\n"
    );
    for (id, engine, weight) in engines {
        yaml.push_str(&format!(
            "      - {{Url: \"{}\", InstanceId: {id}, Weight: {weight}}}\n",
            engine.url
        ));
    }
    router_from_file(&dir.path().join("routes.yaml"), &yaml, tune).await
}

fn dying() -> SimConfig {
    Breaks::Dies.config()
}

/// How an engine's streams go wrong midway, and the instance id it is given.
#[derive(Clone, Copy)]
enum Breaks {
    /// The connection is cut (`dies`).
    Dies,
    /// An error event with code 500, then `[DONE]`, as vLLM's failing engine core (`failing`).
    Errors,
    /// No more tokens, the connection kept open (`stalls`).
    Stalls,
}

impl Breaks {
    fn id(self) -> &'static str {
        match self {
            Breaks::Dies => "dies",
            Breaks::Errors => "failing",
            Breaks::Stalls => "stalls",
        }
    }

    fn config(self) -> SimConfig {
        let mut config = fast();
        match self {
            Breaks::Dies => config.die_mid_stream_rate = 1.0,
            Breaks::Errors => config.error_mid_stream_rate = 1.0,
            Breaks::Stalls => config.stall_mid_stream_rate = 1.0,
        }
        config
    }
}

/// An engine whose streams break as `breaks` says (the first choice for all but one draw in a
/// million) and a healthy one, and a router allowing one move between them ([`start_tuned`]):
/// the folder of its static file, the two engines, the router.
async fn breaking_then_healthy(
    breaks: Breaks,
    tune: impl FnOnce(&mut switchyard_router::RouterConfig),
) -> anyhow::Result<(tempfile::TempDir, SimHandle, SimHandle, RouterHandle)> {
    let breaking = switchyard_engine_sim::spawn(breaks.config()).await?;
    let healthy = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let engines = [(breaks.id(), &breaking, 1e6), ("healthy", &healthy, 1.0)];
    let router = start_tuned(&dir, 1, &engines, tune).await?;
    Ok((dir, breaking, healthy, router))
}

/// A streamed answer as the client reads it.
struct Streamed {
    text: String,
    events: Vec<Value>,
    comments: Vec<String>,
    done: usize,
}

async fn stream(url: &str, body: Value) -> anyhow::Result<Streamed> {
    let mut response = bounded(
        "a streamed answer",
        post_streaming(url, &[], body.to_string()),
    )
    .await?;
    assert_eq!(response.status(), 200);
    let Body { text, broke } = bounded("its body", read_body(&mut response)).await;
    assert!(!broke, "the client's stream was cut: {text}");
    let mut streamed = Streamed {
        text: String::new(),
        events: Vec::new(),
        comments: Vec::new(),
        done: 0,
    };
    for line in sse_lines(&text)? {
        match line {
            SseLine::Comment(comment) => streamed.comments.push(comment),
            SseLine::Done => streamed.done += 1,
            SseLine::Event(event) => {
                streamed.text.push_str(choice_text(&event["choices"][0]));
                streamed.events.push(event);
            }
        }
    }
    Ok(streamed)
}

/// `body` (`path` an OpenAI API under `/v1`) streamed straight to `engine`, as model `sim`:
/// the undisturbed answer a migrated one must read as.
async fn straight_to(engine: &SimHandle, path: &str, body: &Value) -> anyhow::Result<Streamed> {
    let mut direct = body.clone();
    direct["model"] = json!("sim");
    stream(&format!("{}/v1/{path}", engine.url), direct).await
}

/// The two streaming APIs migration is checked on, each body asking for `max_tokens`: (path
/// under `/v1`, body).
fn both_apis(max_tokens: u32) -> [(&'static str, Value); 2] {
    [
        ("chat/completions", chat(max_tokens)),
        ("completions", completions(max_tokens)),
    ]
}

/// Streams `body` (`path` an OpenAI API under `/v1`) through `router`'s endpoint `chat` and
/// straight to `healthy`, and asserts that the migrated answer reads as the undisturbed one:
/// the same text, one `[DONE]`. Returns (migrated, undisturbed).
async fn migrated_and_undisturbed(
    router: &RouterHandle,
    healthy: &SimHandle,
    path: &str,
    body: Value,
) -> anyhow::Result<(Streamed, Streamed)> {
    let undisturbed = straight_to(healthy, path, &body).await?;
    let url = format!("{}/endpoints/chat/openai/v1/{path}", router.url());
    let migrated = stream(&url, body).await?;
    assert_eq!(migrated.text, undisturbed.text, "{path}");
    assert_eq!(migrated.done, 1, "{path}");
    Ok((migrated, undisturbed))
}

fn chat(max_tokens: u32) -> Value {
    json!({"model": "chat", "messages": [{"role": "user", "content": "tell me"}],
           "max_tokens": max_tokens, "stream": true, "stream_options": {"include_usage": true}})
}

fn completions(max_tokens: u32) -> Value {
    json!({"model": "chat", "prompt": "tell me", "max_tokens": max_tokens, "stream": true,
           "stream_options": {"include_usage": true}})
}

#[tokio::test]
async fn a_stream_whose_engine_dies_continues_elsewhere_as_if_undisturbed() -> anyhow::Result<()> {
    let (_dir, dies, healthy, router) = breaking_then_healthy(Breaks::Dies, |_| {}).await?;
    for (path, body) in both_apis(12) {
        let (migrated, undisturbed) =
            migrated_and_undisturbed(&router, &healthy, path, body).await?;
        assert_eq!(
            migrated.comments,
            ["switchyard migrated this answer from dies to healthy"],
            "{path}"
        );
        // One answer to the client: the first engine's id, created and model throughout, one
        // role chunk, and the usage of its own request.
        let first = &migrated.events[0];
        for event in &migrated.events {
            assert_eq!(event["id"], first["id"], "{path}: {event}");
            assert_eq!(event["created"], first["created"], "{path}");
            assert_eq!(event["model"], first["model"], "{path}");
        }
        let roles = (migrated.events.iter())
            .filter(|event| !event["choices"][0]["delta"]["role"].is_null())
            .count();
        assert_eq!(roles, usize::from(path == "chat/completions"), "{path}");
        let usage = |streamed: &Streamed| streamed.events.last().unwrap()["usage"].clone();
        assert_eq!(usage(&migrated), usage(&undisturbed), "{path}");
        // The continuous usage the router asked for stays out of the client's chunks: only
        // the last carries a usage, as vLLM sends them.
        for streamed in [&migrated, &undisturbed] {
            let (_, before_last) = streamed.events.split_last().unwrap();
            assert!(
                before_last.iter().all(|event| event.get("usage").is_none()),
                "{path}: {:?}",
                streamed.events
            );
        }
    }
    assert_eq!(dies.stats().responses_cut, 2);
    let metrics = Metrics::scrape(&router.url()).await?;
    assert_eq!(
        metrics.get(r#"switchyard_router_migrations_total{outcome="continued"}"#),
        Some(2.0)
    );
    // Counted on the instance whose answers broke.
    for (instance, count) in [("dies", 2.0), ("healthy", 0.0)] {
        let series = format!(
            r#"switchyard_router_instance_migrations_total{{endpoint="chat",instance="{instance}",outcome="continued"}}"#
        );
        assert_eq!(metrics.get(&series), Some(count), "{series}");
    }
    // A migrated answer's last engine body is read to its end: no client counted gone.
    assert_eq!(
        metrics.get(r#"switchyard_router_errors_total{kind="client_gone"}"#),
        Some(0.0)
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn an_engine_that_reports_its_own_failure_mid_stream_is_moved_from() -> anyhow::Result<()> {
    // vLLM's engine core failing under a request: a few tokens, then an error event with code
    // 500 and `[DONE]`.
    let (_dir, failing, healthy, router) = breaking_then_healthy(Breaks::Errors, |_| {}).await?;
    for (path, body) in both_apis(12) {
        let (migrated, _) = migrated_and_undisturbed(&router, &healthy, path, body).await?;
        assert!(
            migrated
                .events
                .iter()
                .all(|event| event.get("error").is_none()),
            "{path}: {:?}",
            migrated.events
        );
        assert_eq!(
            migrated.comments,
            ["switchyard migrated this answer from failing to healthy"],
            "{path}"
        );
    }
    assert_eq!(failing.stats().responses_errored, 2);

    // No move allowed: the client gets the engine's own error event, then `[DONE]`.
    let other = tempfile::tempdir()?;
    let unmoving = start_router(&other, 0, &[("failing", &failing, 1.0)]).await?;
    let failed = stream(&chat_url(&unmoving), chat(12)).await?;
    assert_eq!(failed.done, 1);
    let last = failed.events.last().unwrap();
    assert_eq!(last["error"]["code"], 500, "{last}");
    settles(&router).await?;
    settles(&unmoving).await?;
    Ok(())
}

#[tokio::test]
async fn beyond_the_limit_the_stream_ends_with_an_error_event() -> anyhow::Result<()> {
    let first = switchyard_engine_sim::spawn(dying()).await?;
    let second = switchyard_engine_sim::spawn(dying()).await?;
    let dir = tempfile::tempdir()?;
    let router = start_router(&dir, 1, &[("a", &first, 1.0), ("b", &second, 1.0)]).await?;
    let migrated = stream(&chat_url(&router), chat(12)).await?;
    assert_eq!(migrated.done, 0, "a broken answer completed");
    assert_eq!(migrated.comments.len(), 1, "{:?}", migrated.comments);
    let last = migrated.events.last().unwrap();
    assert_eq!(last["error"]["code"], "upstream_reset", "{last}");
    // Each engine died once: the answer moved once, then the limit was reached.
    assert_eq!(
        first.stats().responses_cut + second.stats().responses_cut,
        2
    );
    let metrics = Metrics::scrape(&router.url()).await?;
    for (outcome, count) in [("continued", 1.0), ("limit", 1.0), ("failed", 0.0)] {
        let series = format!(r#"switchyard_router_migrations_total{{outcome="{outcome}"}}"#);
        assert_eq!(metrics.get(&series), Some(count), "{series}");
    }
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn what_a_continuation_cannot_finish_is_not_moved() -> anyhow::Result<()> {
    let (_dir, _dies, healthy, router) = breaking_then_healthy(Breaks::Dies, |_| {}).await?;
    let mut body = chat(12);
    body["response_format"] = json!({"type": "json_object"});
    let broken = stream(&chat_url(&router), body).await?;
    assert!(broken.comments.is_empty(), "{:?}", broken.comments);
    assert_eq!(broken.done, 0);
    assert_eq!(
        broken.events.last().unwrap()["error"]["code"],
        "upstream_reset"
    );
    assert!(healthy.received().is_empty(), "a guided answer was moved");
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_stalled_stream_is_dropped_and_continued_elsewhere() -> anyhow::Result<()> {
    let (_dir, _stalls, healthy, router) = breaking_then_healthy(Breaks::Stalls, |config| {
        config.stream_idle_timeout_seconds = 1;
    })
    .await?;
    let (migrated, _) =
        migrated_and_undisturbed(&router, &healthy, "chat/completions", chat(10)).await?;
    assert_eq!(migrated.comments.len(), 1, "{:?}", migrated.comments);
    // The stalled answer counted against its instance, and its connection was let go: no
    // request is left in flight at either instance.
    assert_eq!(
        metric(&router.url(), r#"switchyard_router_upstream_errors_total{endpoint="chat",instance="stalls",kind="stream_idle"}"#).await,
        Some(1.0)
    );
    settles(&router).await?;
    Ok(())
}

/// The `openai` Python client reads a migrated stream as one answer, and a stream beyond the
/// limit as an APIError carrying the router's final error event.
#[tokio::test]
async fn the_openai_client_reads_a_migrated_stream() -> anyhow::Result<()> {
    let python = test_python();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/openai_stream.py");
    let (_dir, dies, healthy, moving) = breaking_then_healthy(Breaks::Dies, |_| {}).await?;
    let also_dies = switchyard_engine_sim::spawn(dying()).await?;
    let other = tempfile::tempdir()?;
    let stuck = start_router(&other, 1, &[("a", &dies, 1.0), ("b", &also_dies, 1.0)]).await?;
    let expected = straight_to(&healthy, "chat/completions", &chat(9))
        .await?
        .text;
    for (router, args) in [
        (&moving, vec!["complete", expected.as_str()]),
        (&stuck, vec!["broken"]),
    ] {
        let output = tokio::process::Command::new(&python)
            .arg(&script)
            .arg(format!("{}/v1", router.url()))
            .arg("9")
            .args(&args)
            .output()
            .await?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{args:?}:\n{stdout}\n{stderr}");
        assert!(stdout.contains("all ok"), "{stdout}\n{stderr}");
        settles(router).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_continuation_is_an_attempt_span_of_the_clients_request() -> anyhow::Result<()> {
    let sink = switchyard_testkit::otlp_sink::OtlpSink::start(true).await?;
    let otlp = sink.url();
    let (_dir, _dies, _healthy, router) = breaking_then_healthy(Breaks::Dies, |config| {
        config.telemetry.otlp_endpoint = Some(otlp)
    })
    .await?;
    let mut response = post_streaming(
        &format!("{}/endpoints/chat/openai/v1/chat/completions", router.url()),
        &[("x-request-id", "moved-1")],
        chat(12).to_string(),
    )
    .await?;
    assert_eq!(response.status(), 200);
    let body = read_body(&mut response).await;
    assert!(
        !body.broke && body.text.contains("migrated"),
        "{}",
        body.text
    );

    // The server span of the request, and under it one client span per attempt: the first
    // engine's, then the continuation's, marked with its move.
    let attempts = |spans: &[switchyard_testkit::otlp_sink::ReceivedSpan]| {
        let Some(server) = spans.iter().find(|span| {
            span.kind == 2 && span.attribute("switchyard.request_id") == Some("moved-1")
        }) else {
            return Vec::new();
        };
        let mut attempts: Vec<_> = spans
            .iter()
            .filter(|span| {
                span.kind == 3
                    && span.trace_id == server.trace_id
                    && span.parent_span_id == server.span_id
            })
            .map(|span| {
                (
                    span.attribute("switchyard.instance")
                        .unwrap_or("")
                        .to_owned(),
                    span.attribute("switchyard.migration").map(str::to_owned),
                )
            })
            .collect();
        attempts.sort();
        attempts
    };
    let wanted = vec![
        ("dies".to_owned(), None),
        ("healthy".to_owned(), Some("1".to_owned())),
    ];
    eventually(Duration::from_secs(15), "both attempts' spans", || {
        let got = attempts(&sink.spans()) == wanted;
        async move { got }
    })
    .await
    .map_err(|err| anyhow::anyhow!("{err}: {:?}", attempts(&sink.spans())))?;
    settles(&router).await?;
    Ok(())
}
