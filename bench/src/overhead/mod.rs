//! `switchyard-bench overhead`: the latency the router adds, and requests per second per core
//! of router CPU, measured against baselines in the same run.
//!
//! One simulated engine runs with a near-zero time model (it answers at once), in a process of
//! its own as vLLM would be (`--engine in-process` puts it beside the client instead); a
//! `switchyard-router` runs as a separate process from a static config, so its CPU time can
//! be read from `/proc/PID/stat`; so do two baselines (`forward`): a bare HTTP reverse
//! proxy, the cost of one more HTTP hop on this machine, and a TCP relay that copies bytes
//! without reading HTTP at all, the floor of any user-space proxy here. Then:
//!
//! 1. **Latency**: one client sends small non-streaming chat requests (`max_tokens` 1) on
//!    keep-alive connections, one each way per round (direct, router, bare proxy, TCP relay)
//!    in rotating order. Added latency = router percentile − direct percentile; the per-round differences
//!    are summarised too.
//! 2. **Throughput**: `concurrency` closed-loop clients for `duration` seconds each way.
//!    Requests per core-second = requests / (the proxy process's utime + stime).

use anyhow::Context as _;

use crate::child::{default_router_bin, free_port, start_router, start_router_with};
use crate::client::http_client;
use crate::error::UsageError;
use crate::output::emit_json;

mod args;
mod load;
mod measure;
mod processes;
mod report;

pub use args::{EnginePlacement, OverheadArgs, OverheadArgsError};
pub use report::{AddedLatency, OverheadReport, ProxyBaseline, Throughput, TracingMode};

use measure::{Baselines, measure};
use processes::{Engine, kv_warm_up, start_forwarder};

/// Runs the overhead benchmark and prints its table (and writes the JSON file).
pub async fn overhead(args: OverheadArgs) -> anyhow::Result<OverheadReport> {
    args.validate().map_err(UsageError::new)?;
    let binary = match &args.router_bin {
        Some(path) => path.clone(),
        None => default_router_bin().ok_or_else(|| {
            UsageError::new(
                "switchyard-router is not next to this executable: build it (cargo build --release -p switchyard-router) or pass --router-bin",
            )
        })?,
    };
    let client = http_client();
    let engine = Engine::start(&args, &client).await?;
    let engine_url = engine.url().to_owned();
    let config_dir = tempfile::Builder::new()
        .prefix("switchyard-overhead-")
        .tempdir()?;
    let result = async {
        let kv_sockets = engine.kv_sockets(&client).await?;
        // A router executable in front of the engine (its KV-event sockets declared), untraced.
        let untraced = async |binary: &std::path::Path| {
            let (dir, sockets) = (config_dir.path(), kv_sockets.as_ref());
            start_router_with(
                binary,
                dir,
                &engine_url,
                sockets,
                args.strategy,
                &[],
                &client,
            )
            .await
        };
        let router = untraced(&binary).await?;
        if kv_sockets.is_some() {
            kv_warm_up(&engine_url, &router, &client).await?;
        }
        let forwarder = match start_forwarder(&engine_url, "http", &client).await {
            Some(started) => Some(started?),
            None => None,
        };
        let relay = match start_forwarder(&engine_url, "tcp", &client).await {
            Some(started) => Some(started?),
            None => None,
        };
        let baseline_router = match &args.baseline_router_bin {
            Some(binary) => Some(
                untraced(binary)
                    .await
                    .with_context(|| format!("--baseline-router-bin {}", binary.display()))?,
            ),
            None => None,
        };
        // Tracing modes: a port nothing listens on, and a sink here that takes every span.
        let sink = match args.tracing {
            true => Some(switchyard_testkit::otlp_sink::OtlpSink::start(false).await?),
            false => None,
        };
        let mut traced = Vec::new();
        if let Some(sink) = &sink {
            let dead = format!("http://127.0.0.1:{}", free_port()?);
            for (mode, endpoint) in [("dead-collector", dead), ("sampled-100pct", sink.url())] {
                let flags = ["--otlp-endpoint", endpoint.as_str()];
                let server = start_router(
                    &binary,
                    config_dir.path(),
                    &engine_url,
                    args.strategy,
                    &flags,
                    &client,
                )
                .await
                .with_context(|| format!("router with tracing ({mode})"))?;
                traced.push((mode, server));
            }
        }
        let baselines = Baselines {
            forwarder: forwarder.as_ref(),
            relay: relay.as_ref(),
            router: baseline_router.as_ref(),
            traced: traced
                .iter()
                .map(|(mode, server)| (*mode, server))
                .collect(),
        };
        let mut report = measure(&args, &engine_url, &router, baselines, &client).await?;
        report.otlp_sink_spans = sink
            .as_ref()
            .map(switchyard_testkit::otlp_sink::OtlpSink::count);
        anyhow::Ok(report)
    }
    .await;
    engine.shutdown().await;
    let report = result?;
    emit_json(&report.table(), &report, args.json.as_deref())?;
    Ok(report)
}
