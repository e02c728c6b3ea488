//! The router under faults and overload, with simulated engines that misbehave on purpose:
//! the retry rule (no work sent twice), every deadline, every admission bound, and in-flight
//! counts back to zero after each case. Routers run from a static file (no control plane:
//! what is shown here is the router's own doing).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use switchyard_engine_sim::{SimConfig, SimHandle};
use switchyard_router::{RouterConfig, RouterHandle};
use switchyard_tests::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A router for endpoint `chat` (RANDOM) over `instances`: (id, url, weight), from a static
/// file, with `tune` applied to its flags.
async fn start_router(
    dir: &tempfile::TempDir,
    instances: &[(&str, &str, f64)],
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<RouterHandle> {
    let mut yaml = String::from(
        "Endpoints:\n  - EndpointName: chat\n    ProductionVariants:\n      - VariantName: AllTraffic\n        ModelName: sim\n    Instances:\n",
    );
    for (id, url, weight) in instances {
        yaml.push_str(&format!(
            "      - {{Url: \"{url}\", InstanceId: {id}, Weight: {weight}}}\n"
        ));
    }
    router_from_file(&dir.path().join("routes.yaml"), &yaml, tune).await
}

/// The instances of a router that prefers `id` at `url` (a million to one) to a healthy
/// simulator, `healthy`.
fn preferred_to_healthy<'a>(
    id: &'a str,
    url: &'a str,
    healthy: &'a SimHandle,
) -> [(&'a str, &'a str, f64); 2] {
    [
        (id, url, 1_000_000.0),
        ("healthy", healthy.url.as_str(), 1.0),
    ]
}

/// A chat request (`text`, `max_tokens`, not streamed) with `headers` to `router`'s endpoint
/// `chat`; `what` names it if it takes longer than a step may ([`bounded`]).
async fn chat(
    router: &RouterHandle,
    what: &str,
    headers: &[(&str, &str)],
    text: &str,
    max_tokens: u32,
) -> anyhow::Result<Reply> {
    let body = chat_body(text, max_tokens, false);
    bounded(what, http_post(&chat_url(router), headers, body)).await
}

/// Sends `rounds` chat requests (`r0`, `r1`, …, 2 tokens each) to `router` one after another
/// ([`chat`]) and asserts that each was answered 200; returns the answers.
async fn chats_in_turn(
    router: &RouterHandle,
    what: &str,
    rounds: usize,
) -> anyhow::Result<Vec<Reply>> {
    let mut replies = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let reply = chat(router, what, &[], &format!("r{round}"), 2).await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        replies.push(reply);
    }
    Ok(replies)
}

/// A SageMaker invocation of `body` with `headers` to `router`'s endpoint `chat`; `what` names
/// it if it takes longer than a step may ([`bounded`]).
async fn invoke(
    router: &RouterHandle,
    what: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> anyhow::Result<Reply> {
    bounded(
        what,
        http_post(&invocations_url(router), headers, body.to_owned()),
    )
    .await
}

fn request_ids(engine: &SimHandle) -> HashSet<String> {
    engine
        .received()
        .into_iter()
        .filter_map(|request| request.headers.get("x-request-id").cloned())
        .collect()
}

/// A simulator 50× faster than real time, misbehaving as `set` makes it (a fault rate at 1).
fn misbehaving(set: impl FnOnce(&mut SimConfig)) -> SimConfig {
    let mut config = fast();
    set(&mut config);
    config
}

/// Asserts that each of `counters` (a series, by its whole name and labels, and its value)
/// reads as given on `router`'s /metrics now.
async fn assert_counters(router: &RouterHandle, counters: &[(&str, f64)]) {
    for &(series, value) in counters {
        assert_eq!(metric(&router.url(), series).await, Some(value), "{series}");
    }
}

#[tokio::test]
async fn an_engine_that_dies_after_reading_gets_one_error_and_no_resend() -> anyhow::Result<()> {
    let dies =
        switchyard_engine_sim::spawn(misbehaving(|sim| sim.die_mid_stream_rate = 1.0)).await?;
    let healthy = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    // The dying engine is first choice for all but one in a million draws.
    let instances = preferred_to_healthy("dies", &dies.url, &healthy);
    let router = start_router(&dir, &instances, |config| config.eject_after_failures = 100).await?;
    for (round, stream) in [false, true, false, true].into_iter().enumerate() {
        let id = format!("dies-{round}");
        let body = chat_body("crash me", 8, stream);
        let mut response = bounded(
            "a request to a dying engine",
            post_streaming(&chat_url(&router), &[("x-request-id", &id)], body),
        )
        .await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let Body {
            text,
            broke: failed,
        } = read_body(&mut response).await;
        if stream {
            // The answer had begun (200, SSE): the events so far, then a final error event
            // saying it broke and a clean end, never [DONE].
            assert_eq!(status, 200);
            assert!(!failed, "the client's stream was cut: {text}");
            assert!(
                text.contains("\"delta\""),
                "no events before the break: {text}"
            );
            assert!(!text.contains("[DONE]"), "a cut stream completed: {text}");
            let last = text.trim_end().lines().last().unwrap_or_default();
            let event: serde_json::Value =
                serde_json::from_str(last.strip_prefix("data: ").unwrap_or(last))?;
            assert_eq!(event["error"]["code"], "upstream_reset", "{text}");
        } else {
            assert_eq!(status, 502, "{text}");
            assert!(headers.get("x-switchyard-instance").is_none());
            let json: serde_json::Value = serde_json::from_str(&text)?;
            assert_eq!(json["error"]["code"], "upstream_reset", "{text}");
        }
        assert!(
            request_ids(&dies).contains(&id),
            "the dying engine got {id}"
        );
        assert!(
            !request_ids(&healthy).contains(&id),
            "{id} was sent again to another engine"
        );
    }
    assert!(
        metric(
            &router.url(),
            "switchyard_router_errors_total{kind=\"upstream_reset\"}"
        )
        .await
        .is_some_and(|count| count >= 2.0)
    );
    settles(&router).await?;
    router.shutdown().await;

    // With --retry-after-send, one retry goes to the other engine, and says so.
    let router = start_router(&dir, &instances, |config| {
        config.eject_after_failures = 100;
        config.retry_after_send = true;
    })
    .await?;
    let reply = chat(
        &router,
        "a retried request",
        &[("x-request-id", "opt-in")],
        "crash me",
        4,
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-switchyard-route"), Some("retry-after-send"));
    assert_eq!(reply.header("x-switchyard-instance"), Some("healthy"));
    assert!(request_ids(&dies).contains("opt-in") && request_ids(&healthy).contains("opt-in"));
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn an_engine_refusing_connections_is_retried_elsewhere_then_ejected() -> anyhow::Result<()> {
    // A bound socket that never listens: connections to it are refused, and no other test
    // can take the port meanwhile.
    let refusing = RefusingPort::new()?;
    let refusing_url = refusing.url();
    let healthy = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let instances = preferred_to_healthy("refusing", &refusing_url, &healthy);
    let router = start_router(&dir, &instances, |config| config.eject_after_failures = 3).await?;
    let mut routes = Vec::new();
    for reply in chats_in_turn(&router, "a request past a refusing engine", 6).await? {
        assert_eq!(reply.header("x-switchyard-instance"), Some("healthy"));
        routes.push(reply.header("x-switchyard-route").unwrap_or("").to_owned());
    }
    // Three refusals, each retried; then the router ejected the instance itself (no control
    // plane here could have removed it) and went straight to the healthy one.
    assert_eq!(routes[..3], ["retry", "retry", "retry"], "{routes:?}");
    assert_eq!(routes[3..], ["random", "random", "random"], "{routes:?}");
    assert_counters(
        &router,
        &[(
            "switchyard_router_instance_ejected{endpoint=\"chat\",instance=\"refusing\"}",
            1.0,
        )],
    )
    .await;
    settles(&router).await?;
    Ok(())
}

/// Nothing reachable: the client is told so, with the last connection error, and when to try
/// again.
#[tokio::test]
async fn with_every_instance_refusing_the_client_gets_a_503_naming_the_error() -> anyhow::Result<()>
{
    let refusing = [RefusingPort::new()?, RefusingPort::new()?];
    let urls = [refusing[0].url(), refusing[1].url()];
    let dir = tempfile::tempdir()?;
    let instances = [("r0", urls[0].as_str(), 1.0), ("r1", urls[1].as_str(), 1.0)];
    let router = start_router(&dir, &instances, |_| {}).await?;
    let reply = chat(
        &router,
        "a request with nothing reachable",
        &[],
        "anyone?",
        2,
    )
    .await?;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(reply.header("retry-after"), Some("1"));
    let error = &reply.json()["error"];
    assert_eq!(error["code"], "upstream_unreachable", "{}", reply.body);
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("no instance of endpoint chat could be reached (last error: ")
            && message.to_ascii_lowercase().contains("connection refused"),
        "{message}"
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_hung_engine_gets_a_504_at_the_deadline_and_no_retry() -> anyhow::Result<()> {
    let hangs = switchyard_engine_sim::spawn(misbehaving(|sim| sim.hang_rate = 1.0)).await?;
    let healthy = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let instances = preferred_to_healthy("hangs", &hangs.url, &healthy);
    let router = start_router(&dir, &instances, |config| {
        config.upstream_header_timeout_seconds = 1;
        config.connect_timeout_ms = 500;
    })
    .await?;
    let started = Instant::now();
    let reply = invoke(
        &router,
        "a request to a hung engine",
        &[("x-request-id", "hung")],
        r#"{"prompt":"wait","max_tokens":2}"#,
    )
    .await?;
    // SageMaker's answer to a container that timed out: 424 ModelError, which boto3 does not
    // resend (it would resend a 504).
    assert_eq!(reply.status, 424, "{}", reply.body);
    assert_eq!(reply.json()["ErrorCode"], "ModelError", "{}", reply.body);
    assert_eq!(reply.json()["OriginalStatusCode"], 0, "{}", reply.body);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "answered early"
    );
    assert_eq!(reply.json()["ErrorCode"], "ModelError", "{}", reply.body);
    assert!(reply.body.contains("--upstream-header-timeout-seconds"));
    assert!(!request_ids(&healthy).contains("hung"), "sent twice");
    assert_counters(
        &router,
        &[
            ("switchyard_router_errors_total{kind=\"upstream_timeout\"}", 1.0),
            // A timeout is not a connection failure: the instance stays in rotation.
            (
                "switchyard_router_instance_ejected{endpoint=\"chat\",instance=\"hangs\"}",
                0.0,
            ),
            (
                "switchyard_router_upstream_errors_total{endpoint=\"chat\",instance=\"hangs\",kind=\"timeout\"}",
                1.0,
            ),
        ],
    )
    .await;
    settles(&router).await?;
    router.shutdown().await;

    // At the deadline the router drops the engine's connection, so the engine can stop
    // working on the request: an engine that reads the request and never answers sees the
    // connection close.
    let listener = tokio::net::TcpListener::bind(loopback_any()).await?;
    let silent_url = format!("http://{}", listener.local_addr()?);
    let closed = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await?;
        let mut seen = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let read = socket.read(&mut chunk).await?;
            if read == 0 {
                return anyhow::Ok(seen);
            }
            seen.extend_from_slice(&chunk[..read]);
        }
    });
    let router = start_router(&dir, &[("silent", silent_url.as_str(), 1.0)], |config| {
        config.upstream_header_timeout_seconds = 1;
        config.connect_timeout_ms = 500;
    })
    .await?;
    let reply = chat(&router, "a request to a silent engine", &[], "wait", 2).await?;
    assert_eq!(reply.status, 504, "{}", reply.body);
    // openai-python would resend a 504: the answer tells it not to.
    assert_eq!(reply.header("x-should-retry"), Some("false"));
    let seen = bounded("the engine's connection to close", closed).await??;
    assert!(
        String::from_utf8_lossy(&seen).starts_with("POST /v1/chat/completions"),
        "the engine got the request before the connection closed"
    );
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn a_stalled_answer_ends_at_the_idle_deadline() -> anyhow::Result<()> {
    let stalls =
        switchyard_engine_sim::spawn(misbehaving(|sim| sim.stall_mid_stream_rate = 1.0)).await?;
    let dir = tempfile::tempdir()?;
    let router = start_router(&dir, &[("stalls", stalls.url.as_str(), 1.0)], |config| {
        config.stream_idle_timeout_seconds = 1;
    })
    .await?;
    // A stream: two tokens, then the final error event, and no [DONE].
    let (status, _, frames) = bounded(
        "a stalled stream",
        http_post_frames(&chat_url(&router), &[], chat_body("tell me", 20, true)),
    )
    .await?;
    assert_eq!(status, 200);
    let text = frames_text(&frames);
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|event| !event.trim().is_empty())
        .collect();
    assert!(events.len() >= 2, "{text}");
    let last: serde_json::Value = serde_json::from_str(
        events
            .last()
            .and_then(|event| event.strip_prefix("data: "))
            .unwrap_or("null"),
    )?;
    assert_eq!(last["error"]["code"], "stream_idle_timeout", "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    let gap = frames[frames.len() - 1].0 - frames[frames.len() - 2].0;
    assert!(
        gap >= Duration::from_secs(1),
        "the error came after {gap:?}"
    );
    // A non-streaming answer whose body never comes is cut.
    let cut = chat(&router, "a stalled body", &[], "tell me", 20).await;
    assert!(cut.is_err(), "a stalled body arrived whole: {cut:?}");
    assert_counters(
        &router,
        &[
            ("switchyard_router_errors_total{kind=\"stream_idle_timeout\"}", 2.0),
            // Both are also counted against the instance.
            (
                "switchyard_router_upstream_errors_total{endpoint=\"chat\",instance=\"stalls\",kind=\"stream_idle\"}",
                2.0,
            ),
        ],
    )
    .await;
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn half_sent_headers_are_closed_while_others_are_served() -> anyhow::Result<()> {
    switchyard_process::raise_open_file_limit();
    let engine = switchyard_engine_sim::spawn(fast()).await?;
    let dir = tempfile::tempdir()?;
    let router = start_router(&dir, &[("only", engine.url.as_str(), 1.0)], |config| {
        config.client_header_timeout_seconds = 1;
    })
    .await?;
    // 1,000 slow sockets of three kinds: half an HTTP/1 head, nothing at all, and only the
    // HTTP/2 preface (hyper's HTTP/1 head deadline covers only the first kind).
    let mut slow = Vec::with_capacity(1000);
    for index in 0..1000 {
        let mut socket = tokio::net::TcpStream::connect(router.addr).await?;
        match index % 3 {
            0 => {
                socket
                    .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n")
                    .await?
            }
            1 => {}
            _ => {
                socket
                    .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                    .await?
            }
        }
        slow.push(socket);
    }
    let last_opened = Instant::now();
    // Other clients are served meanwhile.
    chats_in_turn(&router, "a request beside 1,000 slow sockets", 5).await?;
    // Every slow socket is closed by the router (`bounded` fails the test otherwise), and
    // not before its deadline: the last one opened is read first.
    for mut socket in slow.into_iter().rev() {
        let mut rest = Vec::new();
        // A reset is as good as an end of stream here: the router let go of the socket.
        let _ = bounded("a slow socket to be closed", socket.read_to_end(&mut rest)).await;
        assert!(
            last_opened.elapsed() >= Duration::from_millis(900),
            "a socket was closed {:?} after it was opened",
            last_opened.elapsed()
        );
    }
    eventually(
        Duration::from_secs(5),
        "the connections to be released",
        || async { router.admission().connections() <= 1 },
    )
    .await?;
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn over_the_limits_clients_get_503_with_retry_after() -> anyhow::Result<()> {
    let hangs = switchyard_engine_sim::spawn(misbehaving(|sim| sim.hang_rate = 1.0)).await?;
    let dir = tempfile::tempdir()?;
    let router = start_router(&dir, &[("hangs", hangs.url.as_str(), 1.0)], |config| {
        config.max_in_flight = 2;
        config.max_connections = 4;
        config.max_buffered_bytes = 7 << 20;
    })
    .await?;
    let url = chat_url(&router);
    // Two requests hang, one of them holding a 5 MiB body (the instance has not answered).
    let big = serde_json::json!({
        "model": "sim",
        "messages": [{"role": "user", "content": "x".repeat(5 << 20)}],
        "max_tokens": 1,
    })
    .to_string();
    let native_url = invocations_url(&router);
    let held = big.clone();
    let first = tokio::spawn(async move { http_post(&native_url, &[], held).await });
    eventually(
        Duration::from_secs(10),
        "the big body to be held",
        || async { router.admission().buffered_bytes() >= 5 << 20 },
    )
    .await?;
    // A second 5 MiB body does not fit in 7 MiB.
    let refused = bounded("an over-budget body", http_post(&url, &[], big)).await?;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.json()["error"]["code"], "overloaded");
    let second_url = url.clone();
    let second =
        tokio::spawn(async move { http_post(&second_url, &[], chat_body("wait", 1, false)).await });
    eventually(
        Duration::from_secs(10),
        "two requests in flight",
        || async { router.admission().in_flight() == 2 },
    )
    .await?;
    let refused = chat(&router, "a third request", &[], "x", 1).await?;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert!(refused.body.contains("--max-in-flight"), "{}", refused.body);
    for limit in ["in_flight", "buffered_bytes"] {
        let sample = format!("switchyard_router_admission_refused_total{{limit=\"{limit}\"}}");
        let refused = metric(&router.url(), &sample).await;
        assert!(refused.is_some_and(|count| count >= 1.0), "{limit}");
    }
    // Connections: two are busy with the hung requests; fill the rest, then one more.
    let mut idle = Vec::new();
    while router.admission().connections() < 4 {
        idle.push(tokio::net::TcpStream::connect(router.addr).await?);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut extra = tokio::net::TcpStream::connect(router.addr).await?;
    extra
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n")
        .await?;
    let mut answer = Vec::new();
    bounded(
        "the refusal of a connection",
        extra.read_to_end(&mut answer),
    )
    .await?;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    use switchyard_router::Limit;
    for limit in Limit::ALL {
        assert!(router.admission().refused(limit) >= 1, "{limit:?}");
    }
    // The hung requests end when their clients give up; every count returns to 0.
    first.abort();
    second.abort();
    drop(idle);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn an_engines_own_overload_answer_reaches_the_client() -> anyhow::Result<()> {
    // An engine that sheds load (as SGLang or TGI do with a full queue): 429 + Retry-After.
    let app = axum::Router::new().fallback(|| async {
        (
            http::StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "7")],
            r#"{"error":{"message":"queue full","type":"overloaded","param":null,"code":429}}"#,
        )
    });
    let (url, server) = stand_in(app).await?;
    let dir = tempfile::tempdir()?;
    let router = start_router(&dir, &[("busy", url.as_str(), 1.0)], |_| {}).await?;
    // OpenAI clients see the engine's answer unchanged.
    let reply = chat(&router, "an OpenAI request", &[], "hi", 1).await?;
    assert_eq!(reply.status, 429);
    assert_eq!(reply.header("retry-after"), Some("7"));
    assert_eq!(reply.json()["error"]["message"], "queue full");
    // SageMaker clients see 424 ModelError carrying the engine's status and Retry-After.
    let reply = invoke(&router, "a native request", &[], "{}").await?;
    assert_eq!(reply.status, 424);
    assert_eq!(reply.json()["ErrorCode"], "ModelError");
    assert_eq!(reply.json()["OriginalStatusCode"], 429);
    assert_eq!(reply.header("retry-after"), Some("7"));
    assert_eq!(
        reply.json()["Message"],
        r#"Received client error (429) from model with message "{"error":{"message":"queue full","type":"overloaded","param":null,"code":429}}""#
    );
    settles(&router).await?;
    server.abort();
    Ok(())
}

/// A container's error message reaches a SageMaker client cut at 64 KiB, however the container
/// frames it (here 7 chunks of 10,000 bytes).
#[tokio::test]
async fn a_long_container_error_message_is_cut_at_64_kib() -> anyhow::Result<()> {
    let app = axum::Router::new().fallback(|| async {
        let chunks =
            (0..7).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'x'; 10_000])));
        (
            http::StatusCode::INTERNAL_SERVER_ERROR,
            axum::body::Body::from_stream(futures::stream::iter(chunks)),
        )
    });
    let (url, server) = stand_in(app).await?;
    let dir = tempfile::tempdir()?;
    let router = start_router(&dir, &[("broken", url.as_str(), 1.0)], |_| {}).await?;
    let reply = invoke(&router, "a native request", &[], "{}").await?;
    assert_eq!(reply.status, 424);
    assert_eq!(reply.json()["OriginalStatusCode"], 500);
    let message = reply.json()["Message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let expected = format!(
        "Received server error (500) from model with message \"{}\"",
        "x".repeat(64 * 1024)
    );
    assert!(message == expected, "a message of {} bytes", message.len());
    settles(&router).await?;
    server.abort();
    Ok(())
}

#[tokio::test]
async fn clients_that_leave_or_stop_reading_release_everything() -> anyhow::Result<()> {
    let engine = switchyard_engine_sim::spawn(SimConfig {
        time_scale: 0.001,
        ..SimConfig::default()
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let router = start_router(&dir, &[("only", engine.url.as_str(), 1.0)], |config| {
        config.stream_idle_timeout_seconds = 1;
    })
    .await?;
    let client_gone = "switchyard_router_errors_total{kind=\"client_gone\"}";
    // Complete answers of every kind are not counted as clients gone.
    for stream in [false, true] {
        let (status, _, _) = bounded(
            "a complete answer",
            http_post_frames(&chat_url(&router), &[], chat_body("hi", 3, stream)),
        )
        .await?;
        assert_eq!(status, 200);
    }
    let reply = invoke(
        &router,
        "a native answer",
        &[],
        r#"{"prompt":"hi","max_tokens":2}"#,
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    settles(&router).await?;
    assert_eq!(metric(&router.url(), client_gone).await, Some(0.0));

    // A client that leaves mid-stream is counted once, and the engine stops the request.
    let slow = switchyard_engine_sim::spawn(real_time()).await?;
    let router = start_router(&dir, &[("slow", slow.url.as_str(), 1.0)], |_| {}).await?;
    let mut response = bounded(
        "a long stream to begin",
        post_streaming(&chat_url(&router), &[], chat_body("story", 200, true)),
    )
    .await?;
    bounded("the first frame", response.body_mut().frame()).await;
    drop(response);
    settles(&router).await?;
    eventually(
        Duration::from_secs(5),
        "client_gone to be counted",
        || async { metric(&router.url(), client_gone).await == Some(1.0) },
    )
    .await?;
    eventually(
        Duration::from_secs(5),
        "the engine to stop the request",
        || async { slow.stats().running == 0 },
    )
    .await?;

    // A client that stops reading a long answer (its socket fills up) is disconnected after
    // the idle deadline; its request and the engine's connection are released.
    let router = start_router(&dir, &[("only", engine.url.as_str(), 1.0)], |config| {
        config.stream_idle_timeout_seconds = 1;
    })
    .await?;
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_recv_buffer_size(4096)?;
    let mut socket = socket.connect(router.addr).await?;
    let body = chat_body("a very long story", 100_000, true);
    socket
        .write_all(
            format!(
                "POST /endpoints/chat/openai/v1/chat/completions HTTP/1.1\r\nHost: router\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await?;
    eventually(
        Duration::from_secs(10),
        "the answer to be under way",
        || async { router.in_flight() == 1 },
    )
    .await?;
    eventually(
        Duration::from_secs(20),
        "the stalled client to be disconnected",
        || async { router.admission().in_flight() == 0 && router.in_flight() == 0 },
    )
    .await?;
    assert_counters(
        &router,
        &[(
            "switchyard_router_errors_total{kind=\"client_stalled\"}",
            1.0,
        )],
    )
    .await;
    drop(socket);
    settles(&router).await?;
    Ok(())
}

#[tokio::test]
async fn an_http2_stream_refused_by_the_engine_is_retried_and_another_reset_is_not()
-> anyhow::Result<()> {
    for (reason, retried) in [
        (h2::Reason::REFUSED_STREAM, true),
        (h2::Reason::INTERNAL_ERROR, false),
    ] {
        // An h2c engine that resets every stream it receives with `reason`.
        let listener = tokio::net::TcpListener::bind(loopback_any()).await?;
        let resetting_url = format!("http://{}", listener.local_addr()?);
        let received = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = std::sync::Arc::clone(&received);
        let server = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let counter = std::sync::Arc::clone(&counter);
                tokio::spawn(async move {
                    let Ok(mut connection) = h2::server::handshake(socket).await else {
                        return;
                    };
                    while let Some(Ok((_request, mut respond))) = connection.accept().await {
                        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        respond.send_reset(reason);
                    }
                });
            }
        });
        let healthy = switchyard_engine_sim::spawn(fast()).await?;
        let dir = tempfile::tempdir()?;
        let instances = preferred_to_healthy("resets", &resetting_url, &healthy);
        let router = start_router(&dir, &instances, |config| {
            config.upstream_protocol = switchyard_router::UpstreamProtocol::H2c;
            config.eject_after_failures = 100;
        })
        .await?;
        let reply = chat(
            &router,
            "a request to a resetting engine",
            &[("x-request-id", "once")],
            "hi",
            2,
        )
        .await?;
        assert_eq!(received.load(std::sync::atomic::Ordering::SeqCst), 1);
        if retried {
            // The engine says it did not process the stream: safe elsewhere.
            assert_eq!(reply.status, 200, "{}", reply.body);
            assert_eq!(reply.header("x-switchyard-route"), Some("retry"));
            assert!(request_ids(&healthy).contains("once"));
        } else {
            assert_eq!(reply.status, 502, "{}", reply.body);
            assert!(!request_ids(&healthy).contains("once"), "sent twice");
        }
        settles(&router).await?;
        server.abort();
    }
    Ok(())
}
