//! The measurement itself: the latency rounds over every path, then the throughput phases.

use std::time::Duration;

use bytes::Bytes;

use super::args::{EnginePlacement, OverheadArgs};
use super::load::{TRACING_SLICES, closed_loop, interleaved, loaded, post_once};
use super::report::{AddedLatency, OverheadReport, ProxyBaseline, Throughput, TracingMode};
use crate::child::ChildServer;
use crate::client::HttpClient;
use crate::output::{Machine, command_line};
use crate::report::DecisionStats;
use crate::scrape::{Histogram, scrape, total};
use crate::stats::Summary;

/// One way to reach the engine.
struct Path3 {
    name: &'static str,
    url: http::Uri,
    samples: Vec<f64>,
}

/// The baseline processes (absent when this executable is not switchyard-bench).
pub struct Baselines<'a> {
    pub forwarder: Option<&'a ChildServer>,
    pub relay: Option<&'a ChildServer>,
    /// `--baseline-router-bin`.
    pub router: Option<&'a ChildServer>,
    /// `--tracing`: routers with tracing on, by mode.
    pub traced: Vec<(&'static str, &'a ChildServer)>,
}

pub async fn measure(
    args: &OverheadArgs,
    engine_url: &str,
    router: &ChildServer,
    baselines: Baselines<'_>,
    client: &HttpClient,
) -> anyhow::Result<OverheadReport> {
    let forwarder = baselines.forwarder;
    let say = |message: &str| {
        if !args.quiet {
            eprintln!("{message}");
        }
    };
    // The same bytes every way: the model is the engine's, so the router forwards unchanged.
    let body = Bytes::from(
        serde_json::json!({
            "model": "sim",
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            "max_tokens": 1,
        })
        .to_string(),
    );
    let mut paths = vec![
        Path3 {
            name: "direct",
            url: format!("{engine_url}/v1/chat/completions").parse()?,
            samples: Vec::with_capacity(args.requests),
        },
        Path3 {
            name: "router",
            url: format!("{}/endpoints/bench/openai/v1/chat/completions", router.url).parse()?,
            samples: Vec::with_capacity(args.requests),
        },
    ];
    for (name, server) in [("forwarder", forwarder), ("relay", baselines.relay)] {
        if let Some(server) = server {
            paths.push(Path3 {
                name,
                url: format!("{}/v1/chat/completions", server.url).parse()?,
                samples: Vec::with_capacity(args.requests),
            });
        }
    }
    for (mode, server) in &baselines.traced {
        paths.push(Path3 {
            name: mode,
            url: format!("{}/endpoints/bench/openai/v1/chat/completions", server.url).parse()?,
            samples: Vec::with_capacity(args.requests),
        });
    }
    if let Some(server) = baselines.router {
        paths.push(Path3 {
            name: "baseline-router",
            url: format!("{}/endpoints/bench/openai/v1/chat/completions", server.url).parse()?,
            samples: Vec::with_capacity(args.requests),
        });
    }

    say("warming up…");
    for _ in 0..200 {
        for path in &paths {
            post_once(client, &path.url, &body)
                .await
                .map_err(|err| anyhow::anyhow!("{}: {err}", path.name))?;
        }
    }
    say(&format!(
        "latency: {} rounds, one request each way…",
        args.requests
    ));
    let ways = paths.len();
    for round in 0..args.requests {
        // Rotate the order so that no way always follows another.
        for step in 0..ways {
            let path = &mut paths[(round + step) % ways];
            let took = post_once(client, &path.url, &body)
                .await
                .map_err(|err| anyhow::anyhow!("{}: {err}", path.name))?;
            path.samples.push(took.as_secs_f64() * 1e3);
        }
    }
    let direct_ms = Summary::of(&paths[0].samples);
    let router_ms = Summary::of(&paths[1].samples);
    let per_core = |throughput: &Throughput, cpu: f64| ratio(throughput.requests as f64, cpu);
    let added = |index: usize| AddedLatency::against(&paths[index].samples, &paths[0].samples);
    let router_added = added(1);
    let index_of = |name: &str| paths.iter().position(|path| path.name == name);
    let baseline = |name: &str, load: Option<(Throughput, f64, f64)>| {
        index_of(name).map(|index| ProxyBaseline {
            latency: added(index),
            throughput: load.map(|load| load.0),
            cpu_seconds: load.map_or(0.0, |load| load.1),
            requests_per_core_second: load.map_or(0.0, |load| per_core(&load.0, load.1)),
        })
    };
    let tcp_relay = index_of("relay").map(added);

    let duration = Duration::from_secs_f64(args.duration);
    say(&format!(
        "throughput: {} clients for {:.0} s direct…",
        args.concurrency, args.duration
    ));
    let direct_throughput =
        closed_loop(client, &paths[0].url, &body, args.concurrency, duration).await;
    // One proxy's throughput phase: its closed loop, its CPU seconds and this process's.
    let through = async |what: &str, index: usize, server: &ChildServer| {
        say(&format!(
            "throughput: {} clients for {:.0} s through {what}…",
            args.concurrency, args.duration
        ));
        let url = &paths[index].url;
        loaded(client, url, &body, args.concurrency, duration, server.pid).await
    };
    let (router_throughput, router_cpu, bench_cpu) = through("the router", 1, router).await?;
    let forwarder_load = match forwarder.zip(index_of("forwarder")) {
        Some((server, index)) => Some(through("the bare forwarder", index, server).await?),
        None => None,
    };
    let baseline_router_load = match baselines.router.zip(index_of("baseline-router")) {
        Some((server, index)) => Some(through("the baseline router", index, server).await?),
        None => None,
    };
    let mut tracing = Vec::new();
    // Tracing modes against the untraced router in interleaved slices (the machine's speed
    // drifts by more than the differences measured across whole phases run one after another).
    let traced: Vec<(&str, usize, &ChildServer)> = baselines
        .traced
        .iter()
        .filter_map(|(mode, server)| Some((*mode, index_of(mode)?, *server)))
        .collect();
    let (untraced_interleaved, traced_interleaved) = if traced.is_empty() {
        (None, Vec::new())
    } else {
        say(&format!(
            "throughput: {} clients, the untraced router and each tracing mode in turn, {TRACING_SLICES} slices of {:.1} s each…",
            args.concurrency,
            args.duration / TRACING_SLICES as f64
        ));
        let mut targets = vec![(&paths[1].url, router.pid)];
        targets.extend(
            traced
                .iter()
                .map(|(_, index, server)| (&paths[*index].url, server.pid)),
        );
        let mut totals = interleaved(client, &targets, &body, args.concurrency, duration).await?;
        let untraced = totals.remove(0);
        (Some(untraced), totals)
    };
    let (untraced_throughput, untraced_cpu) =
        untraced_interleaved.unwrap_or((router_throughput, router_cpu));
    for ((mode, index, server), (throughput, cpu)) in traced.iter().zip(traced_interleaved) {
        let samples = scrape(client, &format!("{}/metrics", server.url))
            .await
            .unwrap_or_default();
        let latency_ms = Summary::of(&paths[*index].samples);
        let throughput_ratio = ratio(
            throughput.requests_per_s,
            untraced_throughput.requests_per_s,
        );
        tracing.push(TracingMode {
            mode: (*mode).to_owned(),
            added_p50_ms: latency_ms.p50 - router_ms.p50,
            p50_ratio: ratio(latency_ms.p50, router_ms.p50),
            latency_ms,
            throughput,
            throughput_ratio,
            throughput_cost: 1.0 - throughput_ratio,
            cpu_seconds: cpu,
            requests_per_core_second: per_core(&throughput, cpu),
            per_core_ratio: ratio(
                per_core(&throughput, cpu),
                per_core(&untraced_throughput, untraced_cpu),
            ),
            // The latency phase stops at the first failed request.
            latency_errors: 0,
            spans_exported: total(&samples, "switchyard_trace_spans_exported_total"),
            spans_dropped: total(&samples, "switchyard_trace_spans_dropped_total"),
        });
    }
    let forwarder = baseline("forwarder", forwarder_load);
    let baseline_router = baseline("baseline-router", baseline_router_load);
    let router_samples = scrape(client, &format!("{}/metrics", router.url))
        .await
        .ok();
    let histogram = |name: &str| {
        router_samples
            .as_ref()
            .and_then(|samples| Histogram::from_samples(samples, name))
            .filter(|histogram| histogram.count > 0.0)
            .and_then(|histogram| DecisionStats::from_histogram(&histogram))
    };
    let decision = histogram("switchyard_router_decision_seconds");
    let kv_tokenize = histogram("switchyard_router_kv_tokenize_seconds");

    let machine = Machine::current();
    let mut notes = vec![
        match args.engine {
            EnginePlacement::Process => "the client runs in this process; the engine, the router and the baselines each in their own; all share this machine's cores",
            EnginePlacement::InProcess => "the client and the engine run in this process (so the direct path wakes no other process), the router and the baselines in their own; all share this machine's cores",
        }
        .to_owned(),
        "a routing decision alone is measured by `cargo bench -p switchyard-policy` (criterion)".to_owned(),
    ];
    if baselines.forwarder.is_none() {
        notes.push(
            "no bare-forwarder baseline: it runs only from the switchyard-bench executable".into(),
        );
    }
    if machine.cpus <= 2 {
        notes.push(format!(
            "{} CPUs: in the throughput phases the client and engine compete with the proxy for them",
            machine.cpus
        ));
    }
    Ok(OverheadReport {
        tool: "switchyard-bench".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        command: command_line(),
        machine,
        strategy: args.strategy.as_str().into(),
        engine: match args.engine {
            EnginePlacement::Process => "process",
            EnginePlacement::InProcess => "in-process",
        }
        .into(),
        body_bytes: body.len(),
        rounds: args.requests,
        added_p50_ms: router_ms.p50 - direct_ms.p50,
        added_p90_ms: router_ms.p90 - direct_ms.p90,
        added_p99_ms: router_ms.p99 - direct_ms.p99,
        added_mean_ms: router_ms.mean - direct_ms.mean,
        paired_difference_ms: router_added.paired_difference_ms,
        direct_ms,
        router_ms,
        router_vs_forwarder_p50_ms: forwarder
            .as_ref()
            .map(|forwarder| router_ms.p50 - forwarder.latency.latency_ms.p50),
        router_vs_forwarder_p99_ms: forwarder
            .as_ref()
            .map(|forwarder| router_ms.p99 - forwarder.latency.latency_ms.p99),
        forwarder,
        router_vs_baseline_p50_ms: baseline_router
            .as_ref()
            .map(|baseline| router_ms.p50 - baseline.latency.latency_ms.p50),
        baseline_router,
        tcp_relay,
        concurrency: args.concurrency,
        direct_throughput,
        router_throughput,
        router_cpu_seconds: router_cpu,
        router_requests_per_core_second: per_core(&router_throughput, router_cpu),
        bench_cpu_seconds: bench_cpu,
        router_decision: decision,
        tracing,
        tracing_untraced_throughput: untraced_interleaved.map(|(throughput, _)| throughput),
        tracing_untraced_cpu_seconds: untraced_interleaved.map(|(_, cpu)| cpu),
        otlp_sink_spans: None,
        kv_tokenize,
        notes,
    })
}

/// `value / base`, or 0 when `base` is not positive (nothing measured).
fn ratio(value: f64, base: f64) -> f64 {
    if base > 0.0 { value / base } else { 0.0 }
}
