//! Observability: OpenTelemetry traces through a real router to simulated engines and from
//! the control plane, received by an in-test OTLP/gRPC collector; an exporter pointed at a
//! dead collector; every metric of router and control plane exported and documented.

use std::collections::BTreeMap;
use std::time::Duration;

use switchyard_testkit::otlp_sink::{OtlpSink, ReceivedSpan};
use switchyard_tests::*;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// SpanKind in OTLP.
const SERVER: i32 = 2;
const CLIENT: i32 = 3;

/// A control plane on an embedded store with endpoint `chat` over `engines` simulated engines.
struct Fleet {
    _dir: tempfile::TempDir,
    control_plane: switchyard_control::ControlPlane,
    engines: Vec<switchyard_engine_sim::SimHandle>,
}

impl Fleet {
    async fn start(engines: usize) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let (control_plane, mut admin) = embedded_admin(dir.path()).await?;
        create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
        let sim = switchyard_engine_sim::SimConfig {
            time_scale: 0.01,
            ..Default::default()
        };
        let mut handles = Vec::new();
        for index in 0..engines {
            let engine = switchyard_engine_sim::spawn(sim.clone()).await?;
            register(&mut admin, "chat", &format!("engine-{index}"), &engine.url).await?;
            handles.push(engine);
        }
        Ok(Self {
            _dir: dir,
            control_plane,
            engines: handles,
        })
    }

    /// A router following the control plane, tracing to `otlp` when given.
    async fn router(
        &self,
        otlp: Option<String>,
        queue_spans: usize,
    ) -> anyhow::Result<switchyard_router::RouterHandle> {
        let mut config = switchyard_router::RouterConfig::with_control_plane(
            loopback_any(),
            vec![self.control_plane.url()],
        );
        config.worker_threads = Some(2);
        config.telemetry.otlp_endpoint = otlp;
        config.telemetry.otlp_queue_spans = queue_spans;
        let settings = config.validate().map_err(anyhow::Error::msg)?;
        let router = switchyard_router::RouterHandle::start(settings).await?;
        wait_for_router_instances(&router, "chat", self.engines.len()).await?;
        Ok(router)
    }

    /// The request an engine received with `x-request-id: id`.
    fn received(&self, id: &str) -> Option<switchyard_engine_sim::ReceivedRequest> {
        self.engines
            .iter()
            .flat_map(|engine| engine.received())
            .find(|request| request.header("x-request-id") == Some(id))
    }
}

/// A fleet of `engines` simulators, and a router over it exporting its spans to a fresh OTLP
/// sink (4,096 spans queued at most).
async fn traced_fleet(
    engines: usize,
) -> anyhow::Result<(OtlpSink, Fleet, switchyard_router::RouterHandle)> {
    let sink = OtlpSink::start(true).await?;
    let fleet = Fleet::start(engines).await?;
    let router = fleet.router(Some(sink.url()), 4096).await?;
    Ok((sink, fleet, router))
}

/// The client's `traceparent`: its trace [`CLIENT_TRACE`] and span [`CLIENT_SPAN`], sampled or
/// not.
fn client_traceparent(sampled: bool) -> String {
    let flags = if sampled { "01" } else { "00" };
    format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-{flags}")
}

async fn chat(router: &str, headers: &[(&str, &str)]) -> anyhow::Result<Reply> {
    http_post(
        &format!("{router}/endpoints/chat/openai/v1/chat/completions"),
        headers,
        chat_body("hello", 4, false),
    )
    .await
}

/// Waits for the spans of `trace_id` until `done` says they are all there.
async fn trace_spans(
    sink: &OtlpSink,
    what: &str,
    done: impl Fn(&[ReceivedSpan]) -> bool,
) -> anyhow::Result<Vec<ReceivedSpan>> {
    eventually(Duration::from_secs(15), what, || async {
        done(&sink.spans())
    })
    .await?;
    Ok(sink.spans())
}

fn server_span<'a>(spans: &'a [ReceivedSpan], request_id: &str) -> Option<&'a ReceivedSpan> {
    spans.iter().find(|span| {
        span.kind == SERVER && span.attribute("switchyard.request_id") == Some(request_id)
    })
}

fn children<'a>(spans: &'a [ReceivedSpan], parent: &ReceivedSpan) -> Vec<&'a ReceivedSpan> {
    spans
        .iter()
        .filter(|span| span.trace_id == parent.trace_id && span.parent_span_id == parent.span_id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_traced_from_the_clients_span_through_the_router_to_the_engine()
-> anyhow::Result<()> {
    let (sink, fleet, router) = traced_fleet(2).await?;
    let traceparent = client_traceparent(true);
    let reply = chat(
        &router.url(),
        &[
            ("traceparent", &traceparent),
            ("tracestate", "client=1"),
            ("x-request-id", "traced-1"),
        ],
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    // No traceparent: the router starts a trace of its own.
    let reply = chat(&router.url(), &[("x-request-id", "untraced-1")]).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);

    let spans = trace_spans(&sink, "both requests' spans", |spans| {
        [("traced-1"), ("untraced-1")].iter().all(|id| {
            server_span(spans, id).is_some_and(|server| {
                let children = children(spans, server);
                children.iter().any(|span| span.kind == CLIENT)
                    && children.iter().any(|span| span.name == "route")
            })
        })
    })
    .await?;

    // The client's trace, the router's server span under the client's span.
    let server = server_span(&spans, "traced-1").expect("server span");
    assert_eq!(server.service, "switchyard-router");
    assert_eq!(server.trace_id, CLIENT_TRACE);
    assert_eq!(server.parent_span_id, CLIENT_SPAN);
    let instance = reply_instance(&fleet, "traced-1");
    for (key, expected) in [
        ("switchyard.endpoint", Some("chat")),
        ("switchyard.variant", Some("AllTraffic")),
        ("switchyard.strategy", Some("RANDOM")),
        ("switchyard.route", Some("random")),
        ("switchyard.overflow", Some("false")),
        ("switchyard.instance", Some(instance.as_str())),
        ("gen_ai.request.model", Some("sim")),
        ("http.request.method", Some("POST")),
        ("http.response.status_code", Some("200")),
    ] {
        assert_eq!(server.attribute(key), expected, "{key} in {server:?}");
    }
    // One trace per request: every span of the client's trace hangs under this server span.
    let in_trace: Vec<_> = spans
        .iter()
        .filter(|span| span.trace_id == CLIENT_TRACE)
        .collect();
    assert!(
        in_trace
            .iter()
            .all(|span| span.span_id == server.span_id || span.parent_span_id == server.span_id),
        "{in_trace:#?}"
    );
    let under_server = children(&spans, server);
    let upstream: Vec<_> = under_server
        .iter()
        .filter(|span| span.kind == CLIENT)
        .collect();
    assert_eq!(upstream.len(), 1, "one attempt: {under_server:#?}");
    let upstream = upstream[0];
    assert_eq!(upstream.attribute("switchyard.hop"), Some("forward"));
    assert_eq!(
        upstream.attribute("switchyard.instance"),
        Some(instance.as_str())
    );
    assert_eq!(upstream.attribute("http.response.status_code"), Some("200"));

    // The engine's parent is the router's upstream span, not the client's span.
    let received = fleet.received("traced-1").expect("the engine got it");
    assert_eq!(
        received.header("traceparent"),
        Some(format!("00-{CLIENT_TRACE}-{}-01", upstream.span_id).as_str())
    );
    assert_eq!(received.header("tracestate"), Some("client=1"));

    // Without a traceparent: a new root trace, carried to the engine.
    let root = server_span(&spans, "untraced-1").expect("server span");
    assert!(root.parent_span_id.is_empty(), "{root:?}");
    assert_ne!(root.trace_id, CLIENT_TRACE);
    let received = fleet.received("untraced-1").expect("the engine got it");
    let upstream = children(&spans, root)
        .into_iter()
        .find(|span| span.kind == CLIENT)
        .expect("upstream span");
    assert_eq!(
        received.header("traceparent"),
        Some(format!("00-{}-{}-01", root.trace_id, upstream.span_id).as_str())
    );
    router.shutdown().await;
    Ok(())
}

/// The instance that served the request `id` (from the engines' records).
fn reply_instance(fleet: &Fleet, id: &str) -> String {
    fleet
        .engines
        .iter()
        .position(|engine| {
            engine
                .received()
                .iter()
                .any(|request| request.header("x-request-id") == Some(id))
        })
        .map(|index| format!("engine-{index}"))
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsampled_parent_is_honoured_and_nothing_is_exported() -> anyhow::Result<()> {
    let (sink, fleet, router) = traced_fleet(1).await?;
    let traceparent = client_traceparent(false);
    let reply = chat(
        &router.url(),
        &[("traceparent", &traceparent), ("x-request-id", "unsampled")],
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    // A sampled request after it: once its spans are in, the unsampled one's would be too.
    let reply = chat(&router.url(), &[("x-request-id", "sampled")]).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let spans = trace_spans(&sink, "the sampled request's spans", |spans| {
        server_span(spans, "sampled").is_some()
    })
    .await?;
    assert!(
        spans.iter().all(|span| span.trace_id != CLIENT_TRACE),
        "{spans:#?}"
    );
    // The engine still joins the client's trace, unsampled, under a router span.
    let received = fleet.received("unsampled").expect("the engine got it");
    let traceparent = received.header("traceparent").unwrap_or_default();
    assert!(
        traceparent.starts_with(&format!("00-{CLIENT_TRACE}-")) && traceparent.ends_with("-00"),
        "{traceparent}"
    );
    assert!(!traceparent.contains(CLIENT_SPAN), "{traceparent}");
    router.shutdown().await;
    Ok(())
}

/// Sends `count` chats with request ids `{prefix}-{index}`; each must answer 200.
async fn chats_all_ok(router: &str, prefix: &str, count: usize) -> anyhow::Result<()> {
    for index in 0..count {
        let id = format!("{prefix}-{index}");
        let reply = chat(router, &[("x-request-id", &id)]).await?;
        anyhow::ensure!(reply.status == 200, "{id}: {} {}", reply.status, reply.body);
    }
    Ok(())
}

/// Waits (15 s at most) until the router has counted at least `spans` dropped spans.
async fn dropped_at_least(router: &str, spans: f64) -> anyhow::Result<()> {
    eventually(Duration::from_secs(15), "drops to be counted", || async {
        metric(router, "switchyard_trace_spans_dropped_total")
            .await
            .is_some_and(|dropped| dropped >= spans)
    })
    .await
}

/// The router's exported-span count now.
async fn exported(router: &str) -> anyhow::Result<f64> {
    Metrics::scrape(router)
        .await?
        .value("switchyard_trace_spans_exported_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_collector_dead_every_request_succeeds_and_the_drops_are_counted()
-> anyhow::Result<()> {
    let fleet = Fleet::start(1).await?;
    // A port nothing listens on (held, so no other test takes it).
    let refusing = switchyard_tests::RefusingPort::new()?;
    let dead = refusing.url();
    let router = fleet.router(Some(dead), 8).await?;
    chats_all_ok(&router.url(), "dead", 40).await?;
    // 40 requests make 120 spans; none can be exported.
    dropped_at_least(&router.url(), 120.0).await?;
    assert_eq!(exported(&router.url()).await?, 0.0);
    router.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_collector_comes_back_spans_are_exported_again() -> anyhow::Result<()> {
    // While the collector cannot be reached the router makes no spans; that pause must end
    // by itself, with no span left to end it.
    let fleet = Fleet::start(1).await?;
    let port = switchyard_tests::RefusingPort::new()?;
    let router = fleet.router(Some(port.url()), 4096).await?;
    chats_all_ok(&router.url(), "away", 10).await?;
    dropped_at_least(&router.url(), 1.0).await?;
    // The collector starts on the address the router exports to.
    let sink = OtlpSink::start_on(port.listen()?, true)?;
    let mut sent = 0;
    eventually(
        Duration::from_secs(20),
        "spans of requests made after the collector came back",
        || {
            sent += 1;
            let id = format!("back-{sent}");
            let url = router.url();
            let sink = &sink;
            async move {
                let reply = chat(&url, &[("x-request-id", &id)]).await;
                assert!(reply.is_ok_and(|reply| reply.status == 200));
                sink.spans().iter().any(|span| {
                    span.attribute("switchyard.request_id")
                        .is_some_and(|id| id.starts_with("back-"))
                })
            }
        },
    )
    .await?;
    router.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_collector_hung_every_request_succeeds_and_the_drops_are_counted()
-> anyhow::Result<()> {
    let fleet = Fleet::start(1).await?;
    // A collector that accepts connections and never answers: the export in flight waits
    // out its deadline while the queue (8 spans) fills, and then every new span is dropped.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let hung = format!("http://{}", listener.local_addr()?);
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while held.len() < 64 {
            match listener.accept().await {
                Ok((socket, _)) => held.push(socket),
                Err(_) => break,
            }
        }
        std::future::pending::<()>().await;
    });
    let router = fleet.router(Some(hung), 8).await?;
    chats_all_ok(&router.url(), "hung", 40).await?;
    // 40 requests make 120 spans: at most the queue's 8 (the batch in flight counted in it)
    // can be waiting.
    dropped_at_least(&router.url(), 120.0 - 8.0).await?;
    assert_eq!(exported(&router.url()).await?, 0.0);
    router.shutdown().await;
    holder.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_headers_from_the_environment_go_with_every_export() -> anyhow::Result<()> {
    // Hosted collectors authenticate exports by header: OTEL_EXPORTER_OTLP_HEADERS, values
    // percent-encoded, as the OpenTelemetry SDKs read it.
    let sink = OtlpSink::start(true).await?;
    let engine = switchyard_engine_sim::spawn(switchyard_engine_sim::SimConfig {
        time_scale: 0.01,
        ..Default::default()
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let config = serde_json::json!({
        "Endpoints": [{
            "EndpointName": "chat",
            "ProductionVariants": serde_json::from_str::<serde_json::Value>(&variant_json("RANDOM", None))?,
            "Instances": [{"Url": engine.url, "InstanceId": "engine-0"}],
        }]
    });
    let path = dir.path().join("routes.json");
    std::fs::write(&path, config.to_string())?;
    let sink_url = sink.url();
    let router = Process::start_with_env(
        "switchyard-router",
        &[
            "--listen",
            "127.0.0.1:0",
            "--config",
            path.to_str().expect("utf-8 path"),
            "--otlp-endpoint",
            &sink_url,
        ],
        &[(
            "OTEL_EXPORTER_OTLP_HEADERS",
            "Authorization=Bearer%20secret-1,x-tenant=team-a",
        )],
        "router listening",
    )?;
    let reply = chat(&router.url(), &[("x-request-id", "with-headers")]).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    eventually(
        Duration::from_secs(15),
        "an export with the headers",
        || async {
            let metadata = sink.metadata();
            metadata.contains(&("authorization".to_owned(), "Bearer secret-1".to_owned()))
                && metadata.contains(&("x-tenant".to_owned(), "team-a".to_owned()))
        },
    )
    .await?;
    drop(router);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_rpc_gives_a_control_plane_span_under_the_callers() -> anyhow::Result<()> {
    let sink = OtlpSink::start(true).await?;
    let dir = tempfile::tempdir()?;
    let sink_url = sink.url();
    let data_dir = dir.path().to_str().expect("utf-8 path");
    let control = Process::start_with_env(
        "switchyard-control",
        &[
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--otlp-endpoint",
            &sink_url,
            "--data-dir",
            data_dir,
        ],
        &[("OTEL_SERVICE_NAME", "control-under-test")],
        "control plane listening",
    )?;
    let url = control.url();
    let result = async {
        let mut client = admin(&url).await?;
        let mut request =
            tonic::Request::new(config_request("traced", &variant_json("RANDOM", None)));
        request.metadata_mut().insert(
            "traceparent",
            format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01").parse()?,
        );
        client.create_endpoint_config(request).await?;
        let spans = trace_spans(&sink, "the admin RPC's span", |spans| {
            spans.iter().any(|span| {
                span.trace_id == CLIENT_TRACE && span.name.ends_with("CreateEndpointConfig")
            })
        })
        .await?;
        let rpc = spans
            .iter()
            .find(|span| {
                span.trace_id == CLIENT_TRACE && span.name.ends_with("CreateEndpointConfig")
            })
            .expect("rpc span");
        assert_eq!(rpc.service, "control-under-test");
        assert_eq!(rpc.parent_span_id, CLIENT_SPAN);
        assert_eq!(rpc.kind, SERVER);
        assert_eq!(rpc.attribute("rpc.system"), Some("grpc"));
        assert_eq!(rpc.attribute("rpc.grpc.status_code"), Some("OK"));
        // The store write it made is a child.
        let store: Vec<_> = spans
            .iter()
            .filter(|span| span.parent_span_id == rpc.span_id && span.name.starts_with("store "))
            .collect();
        assert!(!store.is_empty(), "{spans:#?}");
        anyhow::Ok(())
    }
    .await;
    drop(control);
    result
}

/// Checks the exposition with promtool's own parser and linter.
fn promtool_check_metrics(text: &str, component: &str) {
    use std::io::Write as _;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool runs (scripts/ensure-deps --for-tests installs Debian's prometheus)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write metrics");
    let output = child.wait_with_output().expect("promtool ends");
    assert!(
        output.status.success(),
        "promtool check metrics on the {component}'s /metrics:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// docs/metrics.md's table: name → (type, component).
fn documented() -> BTreeMap<String, (String, String)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md");
    let text = std::fs::read_to_string(&path).expect("docs/metrics.md");
    text.lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            // | `name` | type | labels | component | meaning |
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            name.starts_with("switchyard_").then(|| {
                (
                    name.to_owned(),
                    (
                        cells[2].to_owned(),
                        cells.get(4).copied().unwrap_or("").to_owned(),
                    ),
                )
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_is_documented_and_every_documented_metric_is_exported() -> anyhow::Result<()>
{
    let fleet = Fleet::start(2).await?;
    let router = fleet.router(None, 4096).await?;
    let router_metrics = format!("{}/metrics", router.url());
    let control_metrics = format!("http://{}/metrics", fleet.control_plane.metrics_addr);
    let (status, before_router) = http_get(&router_metrics).await?;
    assert_eq!(status, 200);
    let (status, before_control) = http_get(&control_metrics).await?;
    assert_eq!(status, 200);
    // Traffic and admin calls.
    for index in 0..5 {
        let reply = chat(&router.url(), &[("x-request-id", &format!("m-{index}"))]).await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let mut client = admin(&fleet.control_plane.url()).await?;
    client
        .list_endpoints(switchyard_proto::v1::ListEndpointsRequest::default())
        .await?;
    let (_, after_router) = http_get(&router_metrics).await?;
    let (_, after_control) = http_get(&control_metrics).await?;
    promtool_check_metrics(&after_router, "router");
    promtool_check_metrics(&after_control, "control plane");
    let (before_router, before_control) = (
        Metrics::parse(&before_router)?,
        Metrics::parse(&before_control)?,
    );
    let (after_router, after_control) = (
        Metrics::parse(&after_router)?,
        Metrics::parse(&after_control)?,
    );

    let documented = documented();
    let mut problems = Vec::new();
    for (component, page) in [("router", &after_router), ("control", &after_control)] {
        let exported = page.families();
        for (name, kind) in exported {
            match documented.get(name) {
                None => problems.push(format!(
                    "{component} exports {name}, not in docs/metrics.md"
                )),
                Some((documented_kind, documented_component)) => {
                    if documented_kind != kind {
                        problems.push(format!(
                            "{name}: exported as {kind}, documented as {documented_kind}"
                        ));
                    }
                    if documented_component != component && documented_component != "both" {
                        problems.push(format!(
                            "{name}: exported by the {component}, documented for {documented_component}"
                        ));
                    }
                }
            }
        }
        for (name, (_, documented_component)) in &documented {
            let here = documented_component == component || documented_component == "both";
            if here && !exported.contains_key(name) {
                problems.push(format!(
                    "docs/metrics.md lists {name} for the {component}; its /metrics lacks it"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // Counters move as requests flow.
    let moved = |before: &Metrics, after: &Metrics, name: &str| after.sum(name) > before.sum(name);
    for name in [
        "switchyard_router_requests_total",
        "switchyard_router_decision_seconds_count",
        "switchyard_router_upstream_header_seconds_count",
        "switchyard_router_upstream_ttft_seconds_count",
    ] {
        assert!(
            moved(&before_router, &after_router, name),
            "{name} did not move"
        );
    }
    for name in [
        "switchyard_control_admin_rpcs_total",
        "switchyard_control_admin_rpc_seconds_count",
    ] {
        assert!(
            moved(&before_control, &after_control, name),
            "{name} did not move"
        );
    }
    assert!(after_control.sum("switchyard_control_store_operation_seconds_count") > 0.0);
    assert_eq!(
        after_control.get("switchyard_control_connected_routers"),
        Some(1.0)
    );
    assert_eq!(after_control.get("switchyard_control_leader"), Some(1.0));
    assert_eq!(
        after_control.get(r#"switchyard_control_membership{kind="instance"}"#),
        Some(2.0)
    );
    let listed: Vec<&Sample> = after_control
        .named("switchyard_control_admin_rpcs_total")
        .collect();
    assert!(
        listed
            .iter()
            .any(|sample| sample.label("method") == Some("ListEndpoints")
                && sample.label("code") == Some("OK")),
        "{listed:?}"
    );
    router.shutdown().await;
    Ok(())
}

fn repo_file(path: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// Every PromQL expression of a Grafana dashboard (panels, nested rows included).
fn dashboard_expressions(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(panels: &serde_json::Value, out: &mut Vec<(String, String)>) {
        for panel in panels.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("").to_owned();
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push((title.clone(), expr.to_owned()));
                }
            }
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// Grafana's variables replaced by values PromQL accepts.
fn without_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
        .replace("${endpoint}", ".*")
        .replace("$endpoint", ".*")
}

#[test]
fn the_dashboards_promql_parses_and_names_only_documented_metrics() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&repo_file("deploy/grafana/switchyard.json")).expect("dashboard JSON");
    let expressions = dashboard_expressions(&dashboard);
    assert!(expressions.len() >= 20, "{expressions:?}");
    // promtool parses rules files: one recording rule per expression.
    let dir = tempfile::tempdir().expect("temp dir");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (index, (_, expr)) in expressions.iter().enumerate() {
        let expr = serde_json::to_string(&without_variables(expr)).expect("quoted");
        rules.push_str(&format!(
            "      - record: dashboard:expression_{index}\n        expr: {expr}\n"
        ));
    }
    let path = dir.path().join("dashboard.rules.yaml");
    std::fs::write(&path, &rules).expect("write rules");
    let output = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(&path)
        .output()
        .expect("promtool runs (scripts/ensure-deps --for-tests installs Debian's prometheus)");
    assert!(
        output.status.success(),
        "promtool check rules:\n{}{}\n{rules}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // Only documented names (histograms by their family).
    let documented = documented();
    let mut problems = Vec::new();
    for (title, expr) in &expressions {
        let mut rest = expr.as_str();
        while let Some(at) = rest.find("switchyard_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[at + name.len()..];
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    let base = name.strip_suffix(suffix)?;
                    documented
                        .get(base)
                        .is_some_and(|(kind, _)| kind == "histogram")
                        .then_some(base)
                })
                .unwrap_or(&name);
            if !documented.contains_key(family) {
                problems.push(format!(
                    "panel {title:?} uses {name}, not in docs/metrics.md"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The panels the dashboard is for.
    let titles: Vec<&str> = expressions
        .iter()
        .map(|(title, _)| title.as_str())
        .collect();
    for wanted in [
        "Traffic share per instance",
        "Fleet in-flight per instance",
        "Retries",
        "Ejected instances",
        "Sync lag",
    ] {
        assert!(titles.contains(&wanted), "no panel {wanted:?}");
    }
    assert!(
        titles
            .iter()
            .any(|title| title.starts_with("Route reasons"))
    );
}

#[test]
fn the_collector_example_receives_otlp_and_exports_traces() {
    let config: serde_yaml::Value =
        serde_yaml::from_str(&repo_file("deploy/otel-collector.yaml")).expect("collector YAML");
    let grpc = &config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"];
    assert_eq!(grpc.as_str(), Some("0.0.0.0:4317"));
    let traces = &config["service"]["pipelines"]["traces"];
    let names = |list: &serde_yaml::Value| -> Vec<String> {
        list.as_sequence()
            .into_iter()
            .flatten()
            .filter_map(|name| name.as_str().map(str::to_owned))
            .collect()
    };
    assert_eq!(names(&traces["receivers"]), ["otlp"]);
    let exporters = names(&traces["exporters"]);
    assert!(
        exporters.iter().any(|name| name.starts_with("otlp")),
        "{exporters:?}"
    );
    // Every component a pipeline names is defined.
    for (section, listed) in [
        ("receivers", names(&traces["receivers"])),
        ("processors", names(&traces["processors"])),
        ("exporters", exporters.clone()),
        ("extensions", names(&config["service"]["extensions"])),
    ] {
        for name in listed {
            assert!(
                config[section].get(name.as_str()).is_some(),
                "{section}.{name} is used but not defined"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switchyard_up_passes_its_otlp_endpoint_to_the_control_plane_and_routers()
-> anyhow::Result<()> {
    let sink = OtlpSink::start(true).await?;
    let sink_url = sink.url();
    let up = SwitchyardUp::start(1, &["--otlp-endpoint", &sink_url])?;
    eventually(
        Duration::from_secs(60),
        "switchyard up to route",
        || async {
            chat(&up.router, &[("x-request-id", "up-1")])
                .await
                .is_ok_and(|reply| reply.status == 200)
        },
    )
    .await?;
    trace_spans(
        &sink,
        "spans of the router and the control plane",
        |spans| {
            spans.iter().any(|span| span.service == "switchyard-router")
                && spans.iter().any(|span| {
                    span.service == "switchyard-control" && span.name.ends_with("RegisterInstance")
                })
        },
    )
    .await?;
    drop(up);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_about_a_request_carry_its_ids_and_no_colour_codes_off_a_terminal()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // One instance that refuses connections: the router logs the failure. The collector
    // refuses too (held ports: nobody else can take them meanwhile).
    let gone = RefusingPort::new()?;
    let collector = RefusingPort::new()?;
    let config = serde_json::json!({
        "Endpoints": [{
            "EndpointName": "chat",
            "ProductionVariants": serde_json::from_str::<serde_json::Value>(&variant_json("RANDOM", None))?,
            "Instances": [{"Url": gone.url(), "InstanceId": "gone"}],
        }]
    });
    let path = dir.path().join("routes.json");
    std::fs::write(&path, config.to_string())?;
    let log = dir.path().join("router.log");
    let mut child = std::process::Command::new(binary("switchyard-router"))
        .args(["--listen", "127.0.0.1:0"])
        .arg("--config")
        .arg(&path)
        .args(["--otlp-endpoint", &collector.url()])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let result = async {
        // The text log says where it listens: `router listening addr=127.0.0.1:PORT`.
        let mut router = String::new();
        eventually(
            Duration::from_secs(20),
            "the router's listening line",
            || {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let addr = text
                    .lines()
                    .find(|line| line.contains("router listening"))
                    .and_then(|line| {
                        line.split_whitespace()
                            .find_map(|word| word.strip_prefix("addr="))
                    })
                    .map(|addr| format!("http://{addr}"));
                let found = addr.is_some();
                if let Some(addr) = addr {
                    router = addr;
                }
                async move { found }
            },
        )
        .await?;
        eventually(
            Duration::from_secs(20),
            "the router to be ready",
            || async {
                http_get(&format!("{router}/readyz"))
                    .await
                    .is_ok_and(|(status, _)| status == 200)
            },
        )
        .await?;
        let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
        let reply = chat(
            &router,
            &[("traceparent", &traceparent), ("x-request-id", "logged-1")],
        )
        .await?;
        assert_eq!(reply.status, 503, "{}", reply.body);
        eventually(
            Duration::from_secs(10),
            "the failure's log line",
            || async { std::fs::read_to_string(&log).is_ok_and(|text| text.contains("logged-1")) },
        )
        .await?;
        let text = std::fs::read_to_string(&log)?;
        assert!(
            !text.contains('\u{1b}'),
            "colour codes in a log file:\n{text}"
        );
        let about: Vec<&str> = text.lines().filter(|line| line.contains("gone")).collect();
        assert!(!about.is_empty(), "{text}");
        for line in about {
            assert!(
                line.contains("request_id=\"logged-1\"") || line.contains("request_id=logged-1"),
                "{line}"
            );
            assert!(line.contains(&format!("trace_id={CLIENT_TRACE}")), "{line}");
        }
        anyhow::Ok(())
    }
    .await;
    let _ = child.kill();
    let _ = child.wait();
    result
}
