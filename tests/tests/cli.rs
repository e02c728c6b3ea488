//! The binaries as a user runs them: `switchyard up` and its printed curl, the admin CLI
//! against a real `switchyard-control` process, `--help`, exit codes, SIGTERM.

use std::process::Command;
use std::time::Duration;

use switchyard_tests::*;

fn run(binary: &str, args: &[&str]) -> std::process::Output {
    run_with(binary, args, None)
}

/// Runs `binary` with `args` and `$SWITCHYARD_CONTROL_PLANE` set to `control_plane` (unset
/// for `None`).
fn run_with(binary: &str, args: &[&str], control_plane: Option<&str>) -> std::process::Output {
    let mut command = Command::new(switchyard_tests::binary(binary));
    command.args(args);
    match control_plane {
        Some(url) => command.env("SWITCHYARD_CONTROL_PLANE", url),
        None => command.env_remove("SWITCHYARD_CONTROL_PLANE"),
    };
    command.output().expect("the binary runs")
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
    // Usage errors: exit 64, naming the flag (or the variable) that is wrong. Among them, TLS
    // to etcd: misused flags and unreadable files; and $SWITCHYARD_CONTROL_PLANE, which is a
    // default, not a flag: it does not conflict with --config (the file is what is wrong
    // there), and a bad value is named as the variable.
    let etcd = |args: &[&'static str]| [&["--store", "etcd"], args].concat();
    let refused: Vec<(&str, Vec<&str>, Option<&str>, &str)> = vec![
        (
            "switchyard",
            vec!["demo", "--no-such-flag"],
            None,
            "--no-such-flag",
        ),
        ("switchyard-control", etcd(&[]), None, "--etcd-endpoints"),
        (
            "switchyard-control",
            etcd(&[
                "--etcd-endpoints",
                "http://127.0.0.1:1",
                "--etcd-ca",
                "/ca.pem",
            ]),
            None,
            "--etcd-ca",
        ),
        (
            "switchyard-control",
            etcd(&[
                "--etcd-endpoints",
                "https://127.0.0.1:1",
                "--etcd-ca",
                "/nonexistent/ca.pem",
            ]),
            None,
            "--etcd-ca /nonexistent/ca.pem",
        ),
        (
            "switchyard-control",
            etcd(&["--etcd-endpoints", "https://127.0.0.1:1"]),
            None,
            "--etcd-ca",
        ),
        (
            "switchyard-control",
            etcd(&[
                "--etcd-endpoints",
                "https://127.0.0.1:1",
                "--etcd-cert",
                "/c.pem",
            ]),
            None,
            "--etcd-key",
        ),
        (
            "switchyard-router",
            vec!["--config", "/nonexistent.yaml"],
            None,
            "--config",
        ),
        (
            "switchyard-router",
            vec!["--config", "/nonexistent.yaml"],
            Some("http://127.0.0.1:1"),
            "--config /nonexistent.yaml",
        ),
        (
            "switchyard-router",
            vec![],
            Some("ftp://127.0.0.1:1"),
            "$SWITCHYARD_CONTROL_PLANE",
        ),
        (
            "switchyard-bench",
            vec!["compare", "--load-balance-factor", "0.5"],
            None,
            "--load-balance-factor",
        ),
        (
            "switchyard-bench",
            vec!["overhead", "--requests", "0"],
            None,
            "--requests",
        ),
    ];
    for (binary, args, control_plane, named) in refused {
        let bad = run_with(binary, &args, control_plane);
        let stderr = String::from_utf8_lossy(&bad.stderr);
        assert_eq!(bad.status.code(), Some(64), "{binary} {args:?}: {stderr}");
        assert!(stderr.contains(named), "{binary} {args:?}: {stderr}");
    }
}

/// One admin CLI call as a user types it, and what it must give: its exit code, texts its
/// stdout and its stderr must contain, and a check of its stdout.
struct Call<'a> {
    args: Vec<&'a str>,
    code: i32,
    stdout: &'a [&'a str],
    stderr: &'a [&'a str],
    check: fn(&str),
}

impl<'a> Call<'a> {
    fn new(args: &[&'a str], code: i32) -> Self {
        Self {
            args: args.to_vec(),
            code,
            stdout: &[],
            stderr: &[],
            check: |_| {},
        }
    }

    fn printing(self, stdout: &'a [&'a str]) -> Self {
        Self { stdout, ..self }
    }

    fn failing_with(self, stderr: &'a [&'a str]) -> Self {
        Self { stderr, ..self }
    }

    fn checked(self, check: fn(&str)) -> Self {
        Self { check, ..self }
    }
}

fn cli(control_plane: &str, args: &[&str]) -> (i32, String, String) {
    let output = Command::new(switchyard_tests::binary("switchyard"))
        .arg("--control-plane")
        .arg(control_plane)
        .args(args)
        .output()
        .expect("switchyard runs");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).expect("JSON output")
}

#[test]
fn the_admin_cli_works_as_a_user_types_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().to_str().expect("utf-8 path");
    let mut control =
        control_process(&["--data-dir", data_dir]).expect("switchyard-control starts");
    let variants = r#"[{"VariantName":"AllTraffic","ModelName":"m","InitialInstanceCount":3,"RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":10}}}]"#;
    // Switchyard's bounded-load extension is set through the CLI (boto3 would refuse it).
    let bounded = r#"[{"VariantName":"AllTraffic","ModelName":"m","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":16,"LoadBalanceFactor":1.25,"LoadBalanceSlack":2}}}]"#;
    let unbalanced = bounded.replace("1.25", "0.5");
    let create_config = |name, variants| {
        vec![
            "endpoint-config",
            "create",
            "--name",
            name,
            "--production-variants",
            variants,
        ]
    };
    let register = |extra: &[&'static str]| {
        let mut args = vec![
            "instance",
            "register",
            "--endpoint",
            "chat",
            "--variant",
            "AllTraffic",
        ];
        args.extend_from_slice(extra);
        args
    };
    let json_register =
        |extra: &[&'static str]| [&["--output", "json"][..], &register(extra)].concat();
    let calls = [
        Call::new(&create_config("chat-cfg", variants), 0)
            .printing(&["created endpoint config chat-cfg"]),
        Call::new(&["endpoint-config", "list"], 0)
            .printing(&["PREFIX_AWARE", "4096/10"])
            .checked(|out| {
                let header = out.lines().next().unwrap_or_default();
                assert!(
                    header.starts_with("NAME") && header.contains("STRATEGY"),
                    "{out}"
                );
            }),
        Call::new(&create_config("hot-cfg", bounded), 0),
        Call::new(
            &["--output", "json", "endpoint-config", "describe", "--name", "hot-cfg"],
            0,
        )
        .checked(|out| {
            let json = json(out);
            let prefix =
                &json["ProductionVariants"][0]["RoutingConfig"]["PrefixAwareRoutingConfig"];
            assert_eq!(prefix["LoadBalanceFactor"], 1.25, "{out}");
            assert_eq!(prefix["LoadBalanceSlack"], 2, "{out}");
        }),
        Call::new(&["endpoint-config", "list"], 0).printing(&["4096/16 load≤1.25×mean+2"]),
        Call::new(&create_config("x", &unbalanced), 64).failing_with(&["LoadBalanceFactor"]),
        Call::new(&["endpoint-config", "delete", "--name", "hot-cfg"], 0),
        // A rule broken locally: exit 64, field named.
        Call::new(
            &create_config(
                "x",
                r#"[{"VariantName":"v","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":{"PrefixLength":10,"ConcurrencyThreshold":10}}}]"#,
            ),
            64,
        )
        .failing_with(&["PrefixLength"]),
        Call::new(&create_config("x", "[{"), 64).failing_with(&["not valid JSON"]),
        Call::new(
            &["endpoint", "create", "--name", "chat", "--endpoint-config-name", "chat-cfg"],
            0,
        )
        .printing(&["InService"]),
        Call::new(
            &["--output", "json", "endpoint", "describe", "--name", "chat"],
            0,
        )
        .checked(|out| assert_eq!(json(out)["EndpointConfigName"], "chat-cfg")),
        Call::new(&register(&["--url", "http://127.0.0.1:9", "--id", "e1"]), 0)
            .printing(&["registered instance e1"]),
        Call::new(&["instance", "list"], 0).printing(&["e1", "http://127.0.0.1:9"]),
        // An engine that serves h2c says so at registration; the listing shows it.
        Call::new(
            &json_register(&["--url", "http://127.0.0.1:10", "--id", "e2", "--protocol", "h2c"]),
            0,
        )
        .printing(&["\"Protocol\": \"h2c\""]),
        Call::new(
            &register(&["--url", "http://127.0.0.1:11", "--protocol", "h3"]),
            64,
        )
        .failing_with(&["--protocol"]),
        // An engine that publishes vLLM KV-cache events says where at registration.
        Call::new(
            &json_register(&[
                "--url",
                "http://127.0.0.1:12",
                "--id",
                "e3",
                "--kv-events",
                "tcp://127.0.0.1:5557",
                "--kv-events-replay",
                "tcp://127.0.0.1:5558",
            ]),
            0,
        )
        .printing(&[
            "\"KvEvents\": \"tcp://127.0.0.1:5557\"",
            "\"KvEventsReplay\": \"tcp://127.0.0.1:5558\"",
        ]),
        Call::new(
            &register(&["--url", "http://127.0.0.1:13", "--kv-events", "tcp://*:5557"]),
            64,
        )
        .failing_with(&["--kv-events"]),
        // Errors from the server: readable, exit 1.
        Call::new(&["endpoint", "describe", "--name", "nope"], 1)
            .failing_with(&["not found: endpoint nope does not exist"]),
        Call::new(&["endpoint-config", "delete", "--name", "chat-cfg"], 1)
            .failing_with(&["used by endpoint chat"]),
    ];
    for call in calls {
        let (code, out, err) = cli(&control.url(), &call.args);
        let args = &call.args;
        assert_eq!(code, call.code, "{args:?}: {err}");
        for text in call.stdout {
            assert!(out.contains(text), "{args:?}: {text} not in {out}");
        }
        for text in call.stderr {
            assert!(err.contains(text), "{args:?}: {text} not in {err}");
        }
        (call.check)(&out);
    }

    // Unreachable control plane: says so.
    let refusing = RefusingPort::new().expect("a refusing port");
    let (code, _, err) = cli(&refusing.url(), &["endpoint", "list"]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot reach the control plane"), "{err}");

    control.terminate();
    let status = control
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

/// Runs `switchyard-bench` with `args` and `--json FILE`, which must succeed: its stdout and
/// its JSON report.
fn bench_report(args: &[&str]) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("report.json");
    let json_arg = json.to_str().expect("utf-8 path");
    let output = run("switchyard-bench", &[args, &["--json", json_arg]].concat());
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON report")).expect("JSON");
    (String::from_utf8_lossy(&output.stdout).into_owned(), report)
}

#[test]
fn a_bounded_load_comparison_runs_with_routers_as_processes() {
    let (_, report) = bench_report(&[
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
    ]);
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
}

#[test]
fn the_overhead_benchmark_runs_every_way_and_writes_its_report() {
    let (table, report) = bench_report(&[
        "overhead",
        "--quiet",
        "--requests",
        "40",
        "--concurrency",
        "2",
        "--duration",
        "0.3",
        "--tracing",
    ]);
    for line in [
        "through the router",
        "through a bare forwarder",
        "through a TCP relay",
    ] {
        assert!(table.contains(line), "{line} missing from:\n{table}");
    }
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
    // The router first: it routes to the simulator, which must still be up.
    let through_router = format!("{}/endpoints/chat/openai/v1/chat/completions", router.url());
    let direct = format!("{}/v1/chat/completions", sim.url());
    for (process, url, model, who) in [
        (&mut router, through_router, "chat", "router"),
        (&mut sim, direct, "sim", "simulator"),
    ] {
        let (mut response, first) = stream_under_way(&url, model, 60).await?;
        process.terminate();
        let rest = read_body(&mut response).await;
        anyhow::ensure!(
            !rest.broke,
            "the {who}'s stream broke: {first}{}",
            rest.text
        );
        let text = first + &rest.text;
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "the {who} cut the stream on SIGTERM: {text}"
        );
        let status = process.wait_exit(Duration::from_secs(30))?;
        assert!(status.success(), "{who} exit after SIGTERM: {status}");
    }
    Ok(())
}
