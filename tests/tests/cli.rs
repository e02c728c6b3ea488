//! The binaries as a user runs them: `switchyard up` and its printed curl, the admin CLI
//! against a real `switchyard-control` process, `--help`, exit codes, SIGTERM.

use std::process::Command;
use std::time::Duration;

use switchyard_tests::*;

fn run(binary: &str, args: &[&str]) -> std::process::Output {
    Command::new(switchyard_tests::binary(binary))
        .args(args)
        .env_remove("SWITCHYARD_CONTROL_PLANE")
        .output()
        .expect("the binary runs")
}

#[test]
fn every_binary_explains_itself_and_refuses_bad_flags_with_64() {
    for binary in [
        "switchyard",
        "switchyard-control",
        "switchyard-router",
        "switchyard-engine-sim",
        "switchyard-bench",
    ] {
        let help = run(binary, &["--help"]);
        assert!(help.status.success(), "{binary} --help failed");
        assert!(
            String::from_utf8_lossy(&help.stdout).contains("Usage"),
            "{binary}"
        );
        let bad = run(binary, &["--no-such-flag"]);
        assert_eq!(bad.status.code(), Some(64), "{binary} with a bad flag");
        assert!(
            String::from_utf8_lossy(&bad.stderr).contains("--no-such-flag"),
            "{binary}"
        );
    }
    // `switchyard demo` is `switchyard-bench compare`: its flags, its help, its exit codes.
    let help = run("switchyard", &["demo", "--help"]);
    assert!(help.status.success(), "switchyard demo --help failed");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("--preset") && text.contains("--strategies"),
        "{text}"
    );
    let bad = run("switchyard", &["demo", "--no-such-flag"]);
    assert_eq!(
        bad.status.code(),
        Some(64),
        "switchyard demo with a bad flag"
    );
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--no-such-flag"));
    let bad = run("switchyard-control", &["--store", "etcd"]);
    assert_eq!(bad.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--etcd-endpoints"));
    // TLS to etcd: misused flags and unreadable files are usage errors naming the flag.
    for (args, named) in [
        (
            &[
                "--etcd-endpoints",
                "http://127.0.0.1:1",
                "--etcd-ca",
                "/ca.pem",
            ][..],
            "--etcd-ca",
        ),
        (
            &[
                "--etcd-endpoints",
                "https://127.0.0.1:1",
                "--etcd-ca",
                "/nonexistent/ca.pem",
            ],
            "--etcd-ca /nonexistent/ca.pem",
        ),
        (&["--etcd-endpoints", "https://127.0.0.1:1"], "--etcd-ca"),
        (
            &[
                "--etcd-endpoints",
                "https://127.0.0.1:1",
                "--etcd-cert",
                "/c.pem",
            ],
            "--etcd-key",
        ),
    ] {
        let bad = run("switchyard-control", &[&["--store", "etcd"], args].concat());
        let stderr = String::from_utf8_lossy(&bad.stderr);
        assert_eq!(bad.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
    }
    let bad = run("switchyard-router", &["--config", "/nonexistent.yaml"]);
    assert_eq!(bad.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--config"));
    // $SWITCHYARD_CONTROL_PLANE is a default, not a flag: it does not conflict with --config
    // (the file is what is wrong here), and a bad value is named as the variable.
    let router = |env: &str, args: &[&str]| {
        Command::new(switchyard_tests::binary("switchyard-router"))
            .args(args)
            .env("SWITCHYARD_CONTROL_PLANE", env)
            .output()
            .expect("the router runs")
    };
    let bad = router("http://127.0.0.1:1", &["--config", "/nonexistent.yaml"]);
    assert_eq!(bad.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("--config /nonexistent.yaml"), "{stderr}");
    let bad = router("ftp://127.0.0.1:1", &[]);
    assert_eq!(bad.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("$SWITCHYARD_CONTROL_PLANE"), "{stderr}");
}

/// A `switchyard-control` process on an embedded store in a temporary directory.
struct ControlProcess {
    process: Process,
    url: String,
    _dir: tempfile::TempDir,
}

fn control_process() -> ControlProcess {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().to_str().expect("utf-8 path").to_owned();
    let process = Process::start(
        "switchyard-control",
        &[
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
            &data_dir,
        ],
        "control plane listening",
    )
    .expect("switchyard-control starts");
    ControlProcess {
        url: process.url(),
        process,
        _dir: dir,
    }
}

fn cli(control: &ControlProcess, args: &[&str]) -> (i32, String, String) {
    let output = Command::new(switchyard_tests::binary("switchyard"))
        .arg("--control-plane")
        .arg(&control.url)
        .args(args)
        .output()
        .expect("switchyard runs");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn the_admin_cli_works_as_a_user_types_it() {
    let mut control = control_process();
    let variants = r#"[{"VariantName":"AllTraffic","ModelName":"m","InitialInstanceCount":3,"RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":10}}}]"#;
    let (code, out, err) = cli(
        &control,
        &[
            "endpoint-config",
            "create",
            "--name",
            "chat-cfg",
            "--production-variants",
            variants,
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("created endpoint config chat-cfg"), "{out}");

    let (code, out, _) = cli(&control, &["endpoint-config", "list"]);
    assert_eq!(code, 0);
    let header = out.lines().next().unwrap_or_default();
    assert!(
        header.starts_with("NAME") && header.contains("STRATEGY"),
        "{out}"
    );
    assert!(
        out.contains("PREFIX_AWARE") && out.contains("4096/10"),
        "{out}"
    );

    // Switchyard's bounded-load extension is set through the CLI (boto3 would refuse it).
    let bounded = r#"[{"VariantName":"AllTraffic","ModelName":"m","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":16,"LoadBalanceFactor":1.25,"LoadBalanceSlack":2}}}]"#;
    let (code, _, err) = cli(
        &control,
        &[
            "endpoint-config",
            "create",
            "--name",
            "hot-cfg",
            "--production-variants",
            bounded,
        ],
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = cli(
        &control,
        &[
            "--output",
            "json",
            "endpoint-config",
            "describe",
            "--name",
            "hot-cfg",
        ],
    );
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON output");
    let prefix = &json["ProductionVariants"][0]["RoutingConfig"]["PrefixAwareRoutingConfig"];
    assert_eq!(prefix["LoadBalanceFactor"], 1.25, "{out}");
    assert_eq!(prefix["LoadBalanceSlack"], 2, "{out}");
    let (_, out, _) = cli(&control, &["endpoint-config", "list"]);
    assert!(out.contains("4096/16 load≤1.25×mean+2"), "{out}");
    let (code, _, err) = cli(
        &control,
        &[
            "endpoint-config",
            "create",
            "--name",
            "x",
            "--production-variants",
            &bounded.replace("1.25", "0.5"),
        ],
    );
    assert_eq!(code, 64);
    assert!(err.contains("LoadBalanceFactor"), "{err}");
    let (code, _, _) = cli(
        &control,
        &["endpoint-config", "delete", "--name", "hot-cfg"],
    );
    assert_eq!(code, 0);

    // A rule broken locally: exit 64, field named.
    let (code, _, err) = cli(
        &control,
        &[
            "endpoint-config",
            "create",
            "--name",
            "x",
            "--production-variants",
            r#"[{"VariantName":"v","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":{"PrefixLength":10,"ConcurrencyThreshold":10}}}]"#,
        ],
    );
    assert_eq!(code, 64);
    assert!(err.contains("PrefixLength"), "{err}");
    let (code, _, err) = cli(
        &control,
        &[
            "endpoint-config",
            "create",
            "--name",
            "x",
            "--production-variants",
            "[{",
        ],
    );
    assert_eq!(code, 64);
    assert!(err.contains("not valid JSON"), "{err}");

    let (code, out, err) = cli(
        &control,
        &[
            "endpoint",
            "create",
            "--name",
            "chat",
            "--endpoint-config-name",
            "chat-cfg",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("InService"), "{out}");
    let (code, out, _) = cli(
        &control,
        &["--output", "json", "endpoint", "describe", "--name", "chat"],
    );
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON output");
    assert_eq!(json["EndpointConfigName"], "chat-cfg");

    let (code, out, err) = cli(
        &control,
        &[
            "instance",
            "register",
            "--endpoint",
            "chat",
            "--variant",
            "AllTraffic",
            "--url",
            "http://127.0.0.1:9",
            "--id",
            "e1",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("registered instance e1"), "{out}");
    let (code, out, _) = cli(&control, &["instance", "list"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("e1") && out.contains("http://127.0.0.1:9"),
        "{out}"
    );
    // An engine that serves h2c says so at registration; the listing shows it.
    let (code, out, err) = cli(
        &control,
        &[
            "--output",
            "json",
            "instance",
            "register",
            "--endpoint",
            "chat",
            "--variant",
            "AllTraffic",
            "--url",
            "http://127.0.0.1:10",
            "--id",
            "e2",
            "--protocol",
            "h2c",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"Protocol\": \"h2c\""), "{out}");
    let (code, _, err) = cli(
        &control,
        &[
            "instance",
            "register",
            "--endpoint",
            "chat",
            "--variant",
            "AllTraffic",
            "--url",
            "http://127.0.0.1:11",
            "--protocol",
            "h3",
        ],
    );
    assert_eq!(code, 64);
    assert!(err.contains("--protocol"), "{err}");
    // An engine that publishes vLLM KV-cache events says where at registration.
    let (code, out, err) = cli(
        &control,
        &[
            "--output",
            "json",
            "instance",
            "register",
            "--endpoint",
            "chat",
            "--variant",
            "AllTraffic",
            "--url",
            "http://127.0.0.1:12",
            "--id",
            "e3",
            "--kv-events",
            "tcp://127.0.0.1:5557",
            "--kv-events-replay",
            "tcp://127.0.0.1:5558",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("\"KvEvents\": \"tcp://127.0.0.1:5557\"")
            && out.contains("\"KvEventsReplay\": \"tcp://127.0.0.1:5558\""),
        "{out}"
    );
    let (code, _, err) = cli(
        &control,
        &[
            "instance",
            "register",
            "--endpoint",
            "chat",
            "--variant",
            "AllTraffic",
            "--url",
            "http://127.0.0.1:13",
            "--kv-events",
            "tcp://*:5557",
        ],
    );
    assert_eq!(code, 64);
    assert!(err.contains("--kv-events"), "{err}");

    // Errors from the server: readable, exit 1.
    let (code, _, err) = cli(&control, &["endpoint", "describe", "--name", "nope"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("not found: endpoint nope does not exist"),
        "{err}"
    );
    let (code, _, err) = cli(
        &control,
        &["endpoint-config", "delete", "--name", "chat-cfg"],
    );
    assert_eq!(code, 1);
    assert!(err.contains("used by endpoint chat"), "{err}");

    // Unreachable control plane: says so.
    let refusing = RefusingPort::new().expect("a refusing port");
    let output = Command::new(switchyard_tests::binary("switchyard"))
        .args(["--control-plane", &refusing.url(), "endpoint", "list"])
        .output()
        .expect("switchyard runs");
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot reach the control plane"));

    control.process.terminate();
    let status = control
        .process
        .wait_exit(Duration::from_secs(30))
        .expect("exit after SIGTERM");
    assert!(status.success(), "graceful exit on SIGTERM: {status}");
}

#[test]
fn switchyard_up_starts_a_cluster_whose_printed_curl_works() {
    let mut up = switchyard_tests::SwitchyardUp::start(2, &[]).expect("switchyard up starts");
    let curl = up.curl.clone();
    let output = Command::new("sh")
        .arg("-c")
        .arg(&curl)
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.starts_with("HTTP/1.1 200"), "{curl}\n{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("x-switchyard-instance: engine-"),
        "{text}"
    );
    assert!(text.contains("chat.completion"), "{text}");
    assert!(
        up.terminate().expect("exit after SIGTERM").success(),
        "switchyard up exits cleanly on SIGTERM"
    );
}

#[test]
fn a_bounded_load_comparison_runs_with_routers_as_processes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("compare.json");
    let json_arg = json.to_str().expect("utf-8 path");
    let output = run(
        "switchyard-bench",
        &[
            "compare",
            "--preset",
            "quick",
            "--quiet",
            "--strategies",
            "PREFIX_AWARE",
            "--load-balance-factor",
            "1.25",
            "--load-balance-slack",
            "0",
            "--router-processes",
            "--peers",
            "sglang",
            "--sglang-bin",
            "/nonexistent/smg",
            "--json",
            json_arg,
        ],
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON report")).expect("JSON");
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(
        runs.len(),
        2,
        "PREFIX_AWARE twice; the missing peer skipped"
    );
    assert_eq!(runs[1]["load_balance"]["factor"], 1.25, "{report}");
    assert_eq!(runs[1]["load_balance"]["slack"], 0, "{report}");
    for run in runs {
        assert_eq!(run["errors"], 0, "{run}");
        assert_eq!(run["instance_shares"].as_array().map(Vec::len), Some(3));
    }
    let notes = report["notes"].to_string();
    assert!(notes.contains("ran as processes"), "{notes}");
    assert!(notes.contains("skipped"), "{notes}");

    let bad = run(
        "switchyard-bench",
        &["compare", "--load-balance-factor", "0.5"],
    );
    assert_eq!(bad.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--load-balance-factor"));
}

#[test]
fn the_overhead_benchmark_runs_every_way_and_writes_its_report() {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("overhead.json");
    let json_arg = json.to_str().expect("utf-8 path");
    let output = run(
        "switchyard-bench",
        &[
            "overhead",
            "--quiet",
            "--requests",
            "40",
            "--concurrency",
            "2",
            "--duration",
            "0.3",
            "--tracing",
            "--json",
            json_arg,
        ],
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8_lossy(&output.stdout);
    for line in [
        "through the router",
        "through a bare forwarder",
        "through a TCP relay",
    ] {
        assert!(table.contains(line), "{line} missing from:\n{table}");
    }
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON report")).expect("JSON");
    assert_eq!(report["engine"], "process");
    assert_eq!(report["rounds"], 40);
    for way in [
        &report["direct_ms"],
        &report["router_ms"],
        &report["forwarder"]["latency_ms"],
        &report["tcp_relay"]["latency_ms"],
    ] {
        assert!(way["p50"].as_f64().expect("p50") > 0.0, "{report}");
    }
    assert_eq!(report["router_throughput"]["errors"], 0, "{report}");
    assert!(
        report["router_requests_per_core_second"]
            .as_f64()
            .expect("rate")
            > 0.0
    );
    // --tracing: a router exporting to a dead collector, one tracing every request.
    let modes = report["tracing"].as_array().expect("tracing modes");
    let mode = |name: &str| {
        modes
            .iter()
            .find(|mode| mode["mode"] == name)
            .unwrap_or_else(|| panic!("no {name} in {report}"))
    };
    let dead = mode("dead-collector");
    assert_eq!(dead["throughput"]["errors"], 0, "{report}");
    assert!(
        dead["spans_dropped"].as_f64().expect("drops") > 0.0,
        "{report}"
    );
    assert_eq!(dead["spans_exported"], 0.0, "{report}");
    let sampled = mode("sampled-100pct");
    assert_eq!(sampled["throughput"]["errors"], 0, "{report}");
    assert!(sampled["latency_ms"]["p50"].as_f64().expect("p50") > 0.0);
    assert!(
        report["otlp_sink_spans"].as_u64().expect("sink spans") > 0,
        "{report}"
    );
    assert!(table.contains("dead-collector"), "{table}");

    let bad = run("switchyard-bench", &["overhead", "--requests", "0"]);
    assert_eq!(bad.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--requests"));
}

/// Reads the rest of a streamed response (bounded), returning its text.
async fn read_rest(mut response: http::Response<hyper::body::Incoming>) -> anyhow::Result<String> {
    use http_body_util::BodyExt as _;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(frame) = response.body_mut().frame().await {
            if let Ok(data) = frame?.into_data() {
                text.push_str(&String::from_utf8_lossy(&data));
            }
        }
        anyhow::Ok(())
    })
    .await??;
    Ok(text)
}

/// Starts a stream of `tokens` tokens from model `model` at `url`, and waits for its first
/// frame.
async fn stream_under_way(
    url: &str,
    model: &str,
    tokens: u32,
) -> anyhow::Result<(http::Response<hyper::body::Incoming>, String)> {
    use http_body_util::BodyExt as _;
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "a story"}],
        "max_tokens": tokens,
        "stream": true,
    });
    let mut response = post_streaming(url, &[], body.to_string()).await?;
    assert_eq!(response.status(), 200);
    let first = tokio::time::timeout(Duration::from_secs(10), response.body_mut().frame())
        .await?
        .expect("a first frame")?;
    let first = String::from_utf8_lossy(&first.into_data().unwrap_or_default()).into_owned();
    Ok((response, first))
}

#[tokio::test]
async fn sigterm_lets_router_and_simulator_processes_finish_their_streams() -> anyhow::Result<()> {
    // Real processes: an engine simulator and a router routing to it from a static file. Each
    // gets SIGTERM while a stream (~60 tokens at 14 ms) is under way through it: the stream
    // must end complete ([DONE]) and the process exit 0.
    let mut sim = Process::start(
        "switchyard-engine-sim",
        &["--listen", "127.0.0.1:0", "--time-scale", "1"],
        "engine simulator listening",
    )?;
    let dir = tempfile::tempdir()?;
    let routes = dir.path().join("routes.yaml");
    std::fs::write(
        &routes,
        format!(
            "Endpoints:\n  - EndpointName: chat\n    ProductionVariants:\n      - VariantName: AllTraffic\n        ModelName: sim\n    Instances:\n      - Url: {}\n",
            sim.url()
        ),
    )?;
    let mut router = Process::start(
        "switchyard-router",
        &[
            "--listen",
            "127.0.0.1:0",
            "--config",
            routes.to_str().expect("utf-8 path"),
        ],
        "router listening",
    )?;
    let through_router = format!("{}/endpoints/chat/openai/v1/chat/completions", router.url());
    let (response, first) = stream_under_way(&through_router, "chat", 60).await?;
    router.terminate();
    let text = first + &read_rest(response).await?;
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "the router cut the stream on SIGTERM: {text}"
    );
    let status = router.wait_exit(Duration::from_secs(30))?;
    assert!(status.success(), "router exit after SIGTERM: {status}");

    let direct = format!("{}/v1/chat/completions", sim.url());
    let (response, first) = stream_under_way(&direct, "sim", 60).await?;
    sim.terminate();
    let text = first + &read_rest(response).await?;
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "the simulator cut the stream on SIGTERM: {text}"
    );
    let status = sim.wait_exit(Duration::from_secs(30))?;
    assert!(status.success(), "simulator exit after SIGTERM: {status}");
    Ok(())
}
