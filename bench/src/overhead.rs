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

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde::Serialize;

use crate::client::{HttpClient, http_client};
use crate::compare::{Strategy, UsageError, bench_sim};
use crate::peer::free_port;
use crate::report::{DecisionStats, Machine};
use crate::scrape::{Histogram, scrape};
use crate::stats::Summary;
use switchyard_cluster::variants_json;

#[derive(Debug, Clone, clap::Args)]
pub struct OverheadArgs {
    /// Rounds in the latency phase: one request each way (direct, through the router, the
    /// bare proxy and the TCP relay), in rotating order.
    #[arg(long, default_value_t = 2000, value_name = "N")]
    pub requests: usize,
    /// Closed-loop clients in the throughput phase.
    #[arg(long, default_value_t = 16, value_name = "C")]
    pub concurrency: usize,
    /// Seconds of each throughput phase (direct, through the router, through the bare proxy).
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub duration: f64,
    /// The endpoint's routing strategy (PREFIX_AWARE does the most work per request).
    #[arg(long, value_enum, default_value = "PREFIX_AWARE")]
    pub strategy: Strategy,
    /// The switchyard-router executable. Default: next to this one (target/release or
    /// target/debug: build it with `cargo build --release -p switchyard-router`).
    #[arg(long, value_name = "FILE")]
    pub router_bin: Option<PathBuf>,
    /// A second switchyard-router executable (say, built from an earlier commit) measured
    /// the same way, interleaved in the same rounds: a before/after comparison free of the
    /// machine's drift between runs.
    #[arg(long, value_name = "FILE")]
    pub baseline_router_bin: Option<PathBuf>,
    /// Where the simulated engine runs: its own process (as a real engine does, so the direct
    /// path pays the same process wake-ups a deployment does), or inside this one, beside
    /// the client.
    #[arg(long, value_enum, default_value = "process")]
    pub engine: EnginePlacement,
    /// The switchyard-engine-sim executable for `--engine process`. Default: next to this one.
    #[arg(long, value_name = "FILE")]
    pub engine_bin: Option<PathBuf>,
    /// The engine's clock scale: tiny, so that it answers at once.
    #[arg(long, default_value_t = 1e-6, value_name = "X")]
    pub time_scale: f64,
    /// Also measure tracing, interleaved in the same rounds: the router with its OTLP
    /// exporter pointed at a dead collector, and with every request traced (100% sampling)
    /// to an OTLP sink in this process that accepts every span; both against the router with
    /// tracing off.
    #[arg(long)]
    pub tracing: bool,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// No progress messages.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EnginePlacement {
    Process,
    InProcess,
}

impl OverheadArgs {
    pub fn validate(&self) -> Result<(), String> {
        if self.requests == 0 {
            return Err("--requests must be at least 1".into());
        }
        if self.concurrency == 0 {
            return Err("--concurrency must be at least 1".into());
        }
        if !(self.duration.is_finite() && self.duration > 0.0) {
            return Err(format!(
                "--duration must be positive, got {}",
                self.duration
            ));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(format!(
                "--time-scale must be positive, got {}",
                self.time_scale
            ));
        }
        Ok(())
    }
}

/// Closed-loop throughput of one path.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Throughput {
    pub requests: u64,
    pub errors: u64,
    pub seconds: f64,
    pub requests_per_s: f64,
}

/// Another proxy measured like the router (the bare forwarder: what one more hop costs here;
/// or a baseline router executable).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProxyBaseline {
    pub latency_ms: Summary,
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    pub paired_difference_ms: Summary,
    pub throughput: Option<Throughput>,
    pub cpu_seconds: f64,
    pub requests_per_core_second: f64,
}

/// The TCP relay measured like the router (latency only): the floor of one more hop.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RelayBaseline {
    pub latency_ms: Summary,
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    pub paired_difference_ms: Summary,
}

/// One tracing mode of the router against the router with tracing off, same rounds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TracingMode {
    /// `dead-collector` or `sampled-100pct`.
    pub mode: String,
    pub latency_ms: Summary,
    /// This mode's p50 − the untraced router's p50.
    pub added_p50_ms: f64,
    /// This mode's p50 / the untraced router's p50.
    pub p50_ratio: f64,
    pub throughput: Throughput,
    /// This mode's requests/s / the untraced router's.
    pub throughput_ratio: f64,
    /// 1 − throughput_ratio.
    pub throughput_cost: f64,
    pub cpu_seconds: f64,
    /// Requests per second of the router process's CPU (serving and export threads), and
    /// that over the untraced router's: the cost on a machine whose cores are not shared
    /// with the load generator, the engine and the collector.
    pub requests_per_core_second: f64,
    pub per_core_ratio: f64,
    /// Latency-phase errors (requests that did not answer 200).
    pub latency_errors: u64,
    pub spans_exported: f64,
    pub spans_dropped: f64,
}

/// The overhead benchmark's results (wall-clock milliseconds).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OverheadReport {
    pub tool: String,
    pub version: String,
    pub command: String,
    pub machine: Machine,
    pub strategy: String,
    /// `process` or `in-process` (see `--engine`).
    pub engine: String,
    pub body_bytes: usize,
    /// Rounds of one request each way (direct, router, forwarder), order rotating.
    pub rounds: usize,
    pub direct_ms: Summary,
    pub router_ms: Summary,
    /// router p50 − direct p50, and so on.
    pub added_p50_ms: f64,
    pub added_p90_ms: f64,
    pub added_p99_ms: f64,
    pub added_mean_ms: f64,
    /// Per round: router − direct.
    pub paired_difference_ms: Summary,
    /// The same through a bare reverse proxy (no parsing, no routing).
    pub forwarder: Option<ProxyBaseline>,
    /// The same through `--baseline-router-bin`.
    pub baseline_router: Option<ProxyBaseline>,
    /// router p50 − baseline router p50 (negative: this router is faster).
    pub router_vs_baseline_p50_ms: Option<f64>,
    /// router p50 − forwarder p50: the router's cost beyond one more hop.
    pub router_vs_forwarder_p50_ms: Option<f64>,
    pub router_vs_forwarder_p99_ms: Option<f64>,
    /// The same through a TCP relay (no HTTP parsing at all).
    pub tcp_relay: Option<RelayBaseline>,
    pub concurrency: usize,
    pub direct_throughput: Throughput,
    pub router_throughput: Throughput,
    /// Router process CPU (user + system) during its throughput phase.
    pub router_cpu_seconds: f64,
    /// Router throughput requests / router CPU seconds.
    pub router_requests_per_core_second: f64,
    /// This process (client and engine) CPU during the router phase, for context.
    pub bench_cpu_seconds: f64,
    /// The router's own switchyard_router_decision_seconds over the whole run.
    pub router_decision: Option<DecisionStats>,
    /// `--tracing`: the dead-collector and 100%-sampled routers against the untraced one.
    pub tracing: Vec<TracingMode>,
    /// `--tracing`: the untraced router's throughput and CPU in the interleaved slices the
    /// tracing modes are compared with.
    pub tracing_untraced_throughput: Option<Throughput>,
    pub tracing_untraced_cpu_seconds: Option<f64>,
    /// Spans the in-process OTLP sink received.
    pub otlp_sink_spans: Option<u64>,
    /// KV_AWARE: the router's `/tokenize` round trips (switchyard_router_kv_tokenize_seconds).
    pub kv_tokenize: Option<DecisionStats>,
    pub notes: Vec<String>,
}

impl OverheadReport {
    pub fn table(&self) -> String {
        let row = |name: &str, summary: &Summary| {
            format!(
                "  {name:<26} p50 {:>7.3}   p90 {:>7.3}   p99 {:>7.3}   mean {:>7.3} ms\n",
                summary.p50, summary.p90, summary.p99, summary.mean
            )
        };
        let mut out = format!(
            "\nrouter overhead: {} rounds of small non-streaming chat requests ({} bytes, max_tokens 1), one each way in rotating order, {} endpoint, wall clock\n",
            self.rounds, self.body_bytes, self.strategy
        );
        out.push_str(&row("direct to engine", &self.direct_ms));
        out.push_str(&row("through the router", &self.router_ms));
        if let Some(forwarder) = &self.forwarder {
            out.push_str(&row("through a bare forwarder", &forwarder.latency_ms));
        }
        if let Some(relay) = &self.tcp_relay {
            out.push_str(&row("through a TCP relay", &relay.latency_ms));
        }
        if let Some(baseline) = &self.baseline_router {
            out.push_str(&row("through the baseline router", &baseline.latency_ms));
        }
        out.push_str(&row(
            "router - direct, per round",
            &self.paired_difference_ms,
        ));
        out.push_str(&format!(
            "  added by the router:     p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms (router percentile - direct percentile; targets p50 <= 0.1, p99 <= 0.5)\n",
            self.added_p50_ms, self.added_p90_ms, self.added_p99_ms
        ));
        if let (Some(forwarder), Some(p50), Some(p99)) = (
            &self.forwarder,
            self.router_vs_forwarder_p50_ms,
            self.router_vs_forwarder_p99_ms,
        ) {
            out.push_str(&format!(
                "  added by a bare forwarder: p50 {:.3} ms, p99 {:.3} ms; the router beyond that hop: p50 {:.3} ms, p99 {:.3} ms\n",
                forwarder.added_p50_ms, forwarder.added_p99_ms, p50, p99
            ));
        }
        if let Some(relay) = &self.tcp_relay {
            out.push_str(&format!(
                "  added by a TCP relay (no HTTP, the floor of one more user-space hop here): p50 {:.3} ms, p99 {:.3} ms\n",
                relay.added_p50_ms, relay.added_p99_ms
            ));
        }
        if let (Some(baseline), Some(p50)) = (&self.baseline_router, self.router_vs_baseline_p50_ms)
        {
            out.push_str(&format!(
                "  added by the baseline router: p50 {:.3} ms, p99 {:.3} ms; this router minus the baseline: p50 {:+.3} ms\n",
                baseline.added_p50_ms, baseline.added_p99_ms, p50
            ));
        }
        if let Some(decision) = &self.router_decision {
            out.push_str(&format!(
                "  router's own decision time (arrival to choice, body read and parsed): p50 {:.3} ms, p99 {:.3} ms (histogram buckets)\n",
                decision.p50_ms, decision.p99_ms
            ));
        }
        if let Some(tokenize) = &self.kv_tokenize {
            out.push_str(&format!(
                "  of which KV_AWARE's /tokenize round trip to the engine: p50 {:.3} ms, p99 {:.3} ms (histogram buckets)\n",
                tokenize.p50_ms, tokenize.p99_ms
            ));
        }
        out.push_str(&format!(
            "\nthroughput, {} closed-loop clients:\n  direct to engine          {:>8.0} req/s ({} errors)\n  through the router        {:>8.0} req/s ({} errors), router CPU {:.2} s: {:.0} requests per core-second\n",
            self.concurrency,
            self.direct_throughput.requests_per_s,
            self.direct_throughput.errors,
            self.router_throughput.requests_per_s,
            self.router_throughput.errors,
            self.router_cpu_seconds,
            self.router_requests_per_core_second,
        ));
        if let Some(forwarder) = &self.forwarder
            && let Some(throughput) = &forwarder.throughput
        {
            out.push_str(&format!(
                "  through a bare forwarder  {:>8.0} req/s ({} errors), forwarder CPU {:.2} s: {:.0} requests per core-second\n",
                throughput.requests_per_s, throughput.errors, forwarder.cpu_seconds, forwarder.requests_per_core_second
            ));
        }
        if let Some(baseline) = &self.baseline_router
            && let Some(throughput) = &baseline.throughput
        {
            out.push_str(&format!(
                "  through the baseline router {:>6.0} req/s ({} errors), its CPU {:.2} s: {:.0} requests per core-second\n",
                throughput.requests_per_s, throughput.errors, baseline.cpu_seconds, baseline.requests_per_core_second
            ));
        }
        if !self.tracing.is_empty() {
            out.push_str(&format!(
                "\ntracing, against the router with tracing off ({}: p50 {:.3} ms, {:.0} req/s), same rounds:\n",
                "untraced",
                self.router_ms.p50,
                self.tracing_untraced_throughput
                    .unwrap_or(self.router_throughput)
                    .requests_per_s
            ));
            for mode in &self.tracing {
                out.push_str(&format!(
                    "  {:<16} p50 {:>7.3} ms ({:+.3} ms, x{:.3})  p99 {:>7.3} ms  {:>8.0} req/s (x{:.3}, cost {:.1}%)  {:.0} req per core-second (x{:.3})  errors {}+{}  spans exported {:.0}, dropped {:.0}\n",
                    mode.mode,
                    mode.latency_ms.p50,
                    mode.added_p50_ms,
                    mode.p50_ratio,
                    mode.latency_ms.p99,
                    mode.throughput.requests_per_s,
                    mode.throughput_ratio,
                    mode.throughput_cost * 100.0,
                    mode.requests_per_core_second,
                    mode.per_core_ratio,
                    mode.latency_errors,
                    mode.throughput.errors,
                    mode.spans_exported,
                    mode.spans_dropped,
                ));
            }
            if let Some(spans) = self.otlp_sink_spans {
                out.push_str(&format!(
                    "  the in-process OTLP sink received {spans} spans\n"
                ));
            }
            out.push_str("  targets: dead collector p50 within 5% and no errors; 100% sampled: throughput cost < 10%, p50 added < 0.02 ms\n");
        }
        for note in &self.notes {
            out.push_str(&format!("note: {note}\n"));
        }
        out
    }
}

/// The router executable next to the current one.
pub fn default_router_bin() -> Option<PathBuf> {
    sibling_bin("switchyard-router")
}

/// An executable of this workspace next to the current one.
pub(crate) fn sibling_bin(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let mut dir = exe.parent()?.to_path_buf();
    // Tests and examples run from target/{profile}/deps.
    if dir.ends_with("deps") {
        dir.pop();
    }
    let candidate = dir.join(name);
    candidate.is_file().then_some(candidate)
}

/// The simulated engine, in its own process or in this one.
enum Engine {
    Process(ChildServer),
    InProcess(switchyard_engine_sim::SimHandle),
}

/// Where an engine publishes its KV-cache events.
#[derive(Debug, Clone, serde::Deserialize)]
struct KvSockets {
    #[serde(rename = "endpoint")]
    publisher: String,
    #[serde(rename = "replay_endpoint")]
    replay: String,
}

impl Engine {
    /// Starts the engine; for KV_AWARE it publishes KV events on free loopback ports.
    async fn start(args: &OverheadArgs, client: &HttpClient) -> anyhow::Result<Self> {
        let kv_events = args.strategy == Strategy::KvAware;
        match args.engine {
            EnginePlacement::InProcess => {
                let mut sim = bench_sim(args.time_scale, 79_000);
                sim.step_overhead_ms = 0.0;
                if kv_events {
                    sim.kv_events = Some("tcp://127.0.0.1:0".into());
                    sim.kv_events_replay = Some("tcp://127.0.0.1:0".into());
                }
                Ok(Self::InProcess(switchyard_engine_sim::spawn(sim).await?))
            }
            EnginePlacement::Process => {
                let binary = match &args.engine_bin {
                    Some(path) => path.clone(),
                    None => sibling_bin("switchyard-engine-sim").ok_or_else(|| {
                        UsageError(
                            "switchyard-engine-sim is not next to this executable: build it (cargo build --release -p switchyard-engine-sim), pass --engine-bin, or use --engine in-process".into(),
                        )
                    })?,
                };
                let time_scale = args.time_scale.to_string();
                let args = |listen: &str| -> Vec<std::ffi::OsString> {
                    let mut args: Vec<std::ffi::OsString> = [
                        "--listen",
                        listen,
                        "--time-scale",
                        &time_scale,
                        "--step-overhead-ms",
                        "0",
                        "--record-requests",
                        "16",
                    ]
                    .into_iter()
                    .map(Into::into)
                    .collect();
                    if kv_events {
                        for flag in ["--kv-events", "--kv-events-replay"] {
                            args.push(flag.into());
                            args.push("tcp://127.0.0.1:0".into());
                        }
                    }
                    args
                };
                Ok(Self::Process(
                    start_child(&binary, &args, "/health", client).await?,
                ))
            }
        }
    }

    fn url(&self) -> &str {
        match self {
            Self::Process(child) => &child.url,
            Self::InProcess(sim) => &sim.url,
        }
    }

    /// Where it publishes KV events (ports resolved), if it does.
    async fn kv_sockets(&self, client: &HttpClient) -> anyhow::Result<Option<KvSockets>> {
        match self {
            Self::InProcess(sim) => Ok(sim.kv_events_endpoint().map(|publisher| KvSockets {
                publisher,
                replay: sim.kv_events_replay_endpoint().unwrap_or_default(),
            })),
            Self::Process(child) => {
                let url = format!("{}/sim/kv-events", child.url);
                if get_status(client, &url).await != Some(200) {
                    return Ok(None);
                }
                let text = crate::scrape::get_text(client, &url).await?;
                Ok(Some(serde_json::from_str(&text)?))
            }
        }
    }

    async fn shutdown(self) {
        if let Self::InProcess(sim) = self {
            sim.shutdown().await;
        }
    }
}

/// A child process serving HTTP on 127.0.0.1 (a router or the bare forwarder), killed on
/// drop.
pub(crate) struct ChildServer {
    _child: tokio::process::Child,
    pub(crate) pid: u32,
    pub(crate) url: String,
}

/// The loopback port process `pid` listens on: a listening socket of /proc/PID/net/tcp whose
/// inode is one of the process's file descriptors. Read from the process itself, so a port
/// taken by anyone else is never mistaken for its own.
fn listening_port(pid: u32) -> Option<u16> {
    let sockets: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy();
            let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?;
            Some(inode.to_owned())
        })
        .collect();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).ok()?;
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
        if *state != "0A" || !sockets.iter().any(|socket| socket == inode) {
            return None;
        }
        u16::from_str_radix(local.rsplit(':').next()?, 16).ok()
    })
}

/// Starts `binary` with `args(listen address)` on `127.0.0.1:0`, learns the port it bound
/// from /proc, and waits until GET `ready_path` answers 200 (10 s at most).
pub(crate) async fn start_child(
    binary: &Path,
    args: &dyn Fn(&str) -> Vec<std::ffi::OsString>,
    ready_path: &str,
    client: &HttpClient,
) -> anyhow::Result<ChildServer> {
    let mut child = tokio::process::Command::new(binary)
        .args(args("127.0.0.1:0"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start {}", binary.display()))?;
    let pid = child.id().context("the process exited at once")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut url = None;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            bail!("{} exited with {status}", binary.display());
        }
        if url.is_none() {
            url = listening_port(pid).map(|port| format!("http://127.0.0.1:{port}"));
        }
        if let Some(url) = &url
            && get_status(client, &format!("{url}{ready_path}")).await == Some(200)
        {
            return Ok(ChildServer {
                _child: child,
                pid,
                url: url.clone(),
            });
        }
        if Instant::now() >= deadline {
            let _ = child.kill().await;
            bail!("{} was not ready within 10 s", binary.display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A router process routing endpoint `bench` to the engine from a static config file, with
/// `extra` flags.
pub(crate) async fn start_router(
    binary: &Path,
    config_dir: &Path,
    engine_url: &str,
    strategy: Strategy,
    extra: &[&str],
    client: &HttpClient,
) -> anyhow::Result<ChildServer> {
    start_router_with(
        binary, config_dir, engine_url, None, strategy, extra, client,
    )
    .await
}

/// [`start_router`], the engine declaring its KV-event sockets (KV_AWARE) if given.
async fn start_router_with(
    binary: &Path,
    config_dir: &Path,
    engine_url: &str,
    kv_events: Option<&KvSockets>,
    strategy: Strategy,
    extra: &[&str],
    client: &HttpClient,
) -> anyhow::Result<ChildServer> {
    let prefix = (strategy == Strategy::PrefixAware).then_some((1024, 1024));
    let variants: serde_json::Value =
        serde_json::from_str(&variants_json(strategy.as_str(), prefix))?;
    let mut instance = serde_json::json!({"Url": engine_url, "InstanceId": "engine-0"});
    if let Some(sockets) = kv_events {
        instance["KvEvents"] = sockets.publisher.clone().into();
        instance["KvEventsReplay"] = sockets.replay.clone().into();
    }
    let config = serde_json::json!({
        "Endpoints": [{
            "EndpointName": "bench",
            "ProductionVariants": variants,
            "Instances": [instance],
        }]
    });
    let path = config_dir.join("router.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
    let args = |listen: &str| -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = vec![
            "--listen".into(),
            listen.into(),
            "--config".into(),
            path.clone().into_os_string(),
        ];
        args.extend(extra.iter().map(Into::into));
        args
    };
    start_child(binary, &args, "/readyz", client).await
}

/// KV_AWARE: one prompt of several blocks sent straight to the engine, so that it publishes
/// (until an engine has, the router does not ask it to tokenize), then a wait until the router
/// has applied that batch. From then on every request through the router makes its `/tokenize`
/// round trip (the measured prompt is shorter than a block: it matches nothing and is routed
/// by load, so the round trip is the whole difference).
async fn kv_warm_up(
    engine_url: &str,
    router: &ChildServer,
    client: &HttpClient,
) -> anyhow::Result<()> {
    let words: Vec<String> = (0..64).map(|index| format!("w{index}")).collect();
    let body = serde_json::json!({"model": "sim", "prompt": words.join(" "), "max_tokens": 1});
    post_once(
        client,
        &format!("{engine_url}/v1/completions").parse()?,
        &Bytes::from(body.to_string()),
    )
    .await
    .map_err(anyhow::Error::msg)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let applied = scrape(client, &format!("{}/metrics", router.url))
            .await
            .ok()
            .and_then(|samples| {
                samples
                    .iter()
                    .find(|sample| sample.name == "switchyard_kv_event_batches_total")
                    .map(|sample| sample.value)
            })
            .unwrap_or(0.0);
        if applied >= 1.0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("the router applied no KV event of the engine within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// This executable's bare forwarder (`switchyard-bench forward`) in front of the engine,
/// when this executable is switchyard-bench.
async fn start_forwarder(
    engine_url: &str,
    mode: &str,
    client: &HttpClient,
) -> Option<anyhow::Result<ChildServer>> {
    let exe = std::env::current_exe().ok()?;
    let name = exe.file_name()?.to_str()?;
    if !name.starts_with("switchyard-bench") {
        return None;
    }
    let args = |listen: &str| -> Vec<std::ffi::OsString> {
        vec![
            "forward".into(),
            "--listen".into(),
            listen.into(),
            "--upstream".into(),
            engine_url.into(),
            "--mode".into(),
            mode.into(),
        ]
    };
    // Both baselines pass the engine's /health through.
    Some(start_child(&exe, &args, "/health", client).await)
}

async fn get_status(client: &HttpClient, url: &str) -> Option<u16> {
    let request = http::Request::get(url).body(Full::new(Bytes::new())).ok()?;
    let response = tokio::time::timeout(Duration::from_secs(2), client.request(request))
        .await
        .ok()?
        .ok()?;
    let status = response.status().as_u16();
    let _ = response.into_body().collect().await;
    Some(status)
}

/// One non-streaming POST read to its end; its wall time, or why it failed.
async fn post_once(client: &HttpClient, url: &http::Uri, body: &Bytes) -> Result<Duration, String> {
    let started = Instant::now();
    let request = http::Request::post(url.clone())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body.clone()))
        .map_err(|err| err.to_string())?;
    let response = tokio::time::timeout(Duration::from_secs(10), client.request(request))
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|err| err.to_string())?;
    let status = response.status();
    response
        .into_body()
        .collect()
        .await
        .map_err(|err| err.to_string())?;
    if !status.is_success() {
        return Err(format!("status {status}"));
    }
    Ok(started.elapsed())
}

/// (user + system) CPU seconds of a process, from /proc/PID/stat.
pub fn process_cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks_per_second())
}

fn clock_ticks_per_second() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|output| String::from_utf8(output.stdout).ok())
            .and_then(|text| text.trim().parse().ok())
            .filter(|ticks: &f64| *ticks > 0.0)
            .unwrap_or(100.0)
    })
}

async fn closed_loop(
    client: &HttpClient,
    url: &http::Uri,
    body: &Bytes,
    concurrency: usize,
    duration: Duration,
) -> Throughput {
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        let (done, errors) = (Arc::clone(&done), Arc::clone(&errors));
        tasks.spawn(async move {
            while Instant::now() < deadline {
                match post_once(&client, &url, &body).await {
                    Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                    Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                };
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let seconds = started.elapsed().as_secs_f64();
    let requests = done.load(Ordering::Relaxed);
    Throughput {
        requests,
        errors: errors.load(Ordering::Relaxed),
        seconds,
        requests_per_s: requests as f64 / seconds.max(1e-9),
    }
}

/// Runs the overhead benchmark and prints its table (and writes the JSON file).
pub async fn overhead(args: OverheadArgs) -> anyhow::Result<OverheadReport> {
    args.validate().map_err(UsageError)?;
    let binary = match &args.router_bin {
        Some(path) => path.clone(),
        None => default_router_bin().ok_or_else(|| {
            UsageError(
                "switchyard-router is not next to this executable: build it (cargo build --release -p switchyard-router) or pass --router-bin".into(),
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
        let router = start_router_with(
            &binary,
            config_dir.path(),
            &engine_url,
            kv_sockets.as_ref(),
            args.strategy,
            &[],
            &client,
        )
        .await?;
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
                start_router_with(
                    binary,
                    config_dir.path(),
                    &engine_url,
                    kv_sockets.as_ref(),
                    args.strategy,
                    &[],
                    &client,
                )
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
    crate::report::print_stdout(&report.table());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(report)
}

/// One way to reach the engine.
struct Path3 {
    name: &'static str,
    url: http::Uri,
    samples: Vec<f64>,
}

/// The baseline processes (absent when this executable is not switchyard-bench).
struct Baselines<'a> {
    forwarder: Option<&'a ChildServer>,
    relay: Option<&'a ChildServer>,
    /// `--baseline-router-bin`.
    router: Option<&'a ChildServer>,
    /// `--tracing`: routers with tracing on, by mode.
    traced: Vec<(&'static str, &'a ChildServer)>,
}

async fn measure(
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
    let per_core = |throughput: &Throughput, cpu: f64| {
        if cpu > 0.0 {
            throughput.requests as f64 / cpu
        } else {
            0.0
        }
    };
    let pair = |index: usize| -> Vec<f64> {
        paths[index]
            .samples
            .iter()
            .zip(&paths[0].samples)
            .map(|(way, direct)| way - direct)
            .collect()
    };
    let router_differences = pair(1);
    let index_of = |name: &str| paths.iter().position(|path| path.name == name);
    let baseline = |name: &str, load: Option<(Throughput, f64, f64)>| {
        index_of(name).map(|index| {
            let latency_ms = Summary::of(&paths[index].samples);
            ProxyBaseline {
                added_p50_ms: latency_ms.p50 - direct_ms.p50,
                added_p99_ms: latency_ms.p99 - direct_ms.p99,
                paired_difference_ms: Summary::of(&pair(index)),
                latency_ms,
                throughput: load.map(|load| load.0),
                cpu_seconds: load.map_or(0.0, |load| load.1),
                requests_per_core_second: load.map_or(0.0, |load| per_core(&load.0, load.1)),
            }
        })
    };
    let tcp_relay = index_of("relay").map(|index| {
        let latency_ms = Summary::of(&paths[index].samples);
        RelayBaseline {
            added_p50_ms: latency_ms.p50 - direct_ms.p50,
            added_p99_ms: latency_ms.p99 - direct_ms.p99,
            paired_difference_ms: Summary::of(&pair(index)),
            latency_ms,
        }
    });

    let duration = Duration::from_secs_f64(args.duration);
    say(&format!(
        "throughput: {} clients for {:.0} s direct…",
        args.concurrency, args.duration
    ));
    let direct_throughput =
        closed_loop(client, &paths[0].url, &body, args.concurrency, duration).await;
    say(&format!(
        "throughput: {} clients for {:.0} s through the router…",
        args.concurrency, args.duration
    ));
    let (router_throughput, router_cpu, bench_cpu) = loaded(
        client,
        &paths[1].url,
        &body,
        args.concurrency,
        duration,
        router.pid,
    )
    .await?;
    let forwarder_index = index_of("forwarder");
    let forwarder_load = match forwarder.zip(forwarder_index) {
        Some((forwarder, index)) => {
            say(&format!(
                "throughput: {} clients for {:.0} s through the bare forwarder…",
                args.concurrency, args.duration
            ));
            Some(
                loaded(
                    client,
                    &paths[index].url,
                    &body,
                    args.concurrency,
                    duration,
                    forwarder.pid,
                )
                .await?,
            )
        }
        None => None,
    };
    let baseline_router_load = match baselines.router.zip(index_of("baseline-router")) {
        Some((server, index)) => {
            say(&format!(
                "throughput: {} clients for {:.0} s through the baseline router…",
                args.concurrency, args.duration
            ));
            Some(
                loaded(
                    client,
                    &paths[index].url,
                    &body,
                    args.concurrency,
                    duration,
                    server.pid,
                )
                .await?,
            )
        }
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
        let counter = |name: &str| {
            samples
                .iter()
                .filter(|sample| sample.name == name)
                .map(|sample| sample.value)
                .sum::<f64>()
        };
        let latency_ms = Summary::of(&paths[*index].samples);
        let throughput_ratio = if untraced_throughput.requests_per_s > 0.0 {
            throughput.requests_per_s / untraced_throughput.requests_per_s
        } else {
            0.0
        };
        tracing.push(TracingMode {
            mode: (*mode).to_owned(),
            added_p50_ms: latency_ms.p50 - router_ms.p50,
            p50_ratio: if router_ms.p50 > 0.0 {
                latency_ms.p50 / router_ms.p50
            } else {
                0.0
            },
            latency_ms,
            throughput,
            throughput_ratio,
            throughput_cost: 1.0 - throughput_ratio,
            cpu_seconds: cpu,
            requests_per_core_second: per_core(&throughput, cpu),
            per_core_ratio: match per_core(&untraced_throughput, untraced_cpu) {
                untraced if untraced > 0.0 => per_core(&throughput, cpu) / untraced,
                _ => 0.0,
            },
            // The latency phase stops at the first failed request.
            latency_errors: 0,
            spans_exported: counter("switchyard_trace_spans_exported_total"),
            spans_dropped: counter("switchyard_trace_spans_dropped_total"),
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
        command: std::env::args().collect::<Vec<_>>().join(" "),
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
        paired_difference_ms: Summary::of(&router_differences),
        direct_ms,
        router_ms,
        router_vs_forwarder_p50_ms: forwarder
            .as_ref()
            .map(|forwarder| router_ms.p50 - forwarder.latency_ms.p50),
        router_vs_forwarder_p99_ms: forwarder
            .as_ref()
            .map(|forwarder| router_ms.p99 - forwarder.latency_ms.p99),
        forwarder,
        router_vs_baseline_p50_ms: baseline_router
            .as_ref()
            .map(|baseline| router_ms.p50 - baseline.latency_ms.p50),
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

/// A closed loop through a proxy process, with that process's CPU seconds and this one's.
/// Slices each tracing comparison's throughput phase is cut into.
const TRACING_SLICES: usize = 10;

/// Closed-loop load on each target in turn, [`TRACING_SLICES`] rounds (the order rotating),
/// `duration` per target in all, after one warm-up slice each: each target's summed
/// throughput and CPU seconds.
async fn interleaved(
    client: &HttpClient,
    targets: &[(&http::Uri, u32)],
    body: &Bytes,
    concurrency: usize,
    duration: Duration,
) -> anyhow::Result<Vec<(Throughput, f64)>> {
    let slice = duration / TRACING_SLICES as u32;
    let mut totals: Vec<(Throughput, f64)> = targets
        .iter()
        .map(|_| {
            (
                Throughput {
                    requests: 0,
                    errors: 0,
                    seconds: 0.0,
                    requests_per_s: 0.0,
                },
                0.0,
            )
        })
        .collect();
    // One slice each first, not counted: a process's first seconds under load (its
    // allocator growing, its pools filling) are slower, and the untraced router has just had
    // its own throughput phase while the traced ones have not.
    for &(url, pid) in targets {
        loaded(client, url, body, concurrency, slice, pid).await?;
    }
    for round in 0..TRACING_SLICES {
        for turn in 0..targets.len() {
            let at = (round + turn) % targets.len();
            let (url, pid) = targets[at];
            let (throughput, cpu, _) = loaded(client, url, body, concurrency, slice, pid).await?;
            let total = &mut totals[at];
            total.0.requests += throughput.requests;
            total.0.errors += throughput.errors;
            total.0.seconds += throughput.seconds;
            total.1 += cpu;
        }
    }
    for (throughput, _) in &mut totals {
        if throughput.seconds > 0.0 {
            throughput.requests_per_s = throughput.requests as f64 / throughput.seconds;
        }
    }
    Ok(totals)
}

async fn loaded(
    client: &HttpClient,
    url: &http::Uri,
    body: &Bytes,
    concurrency: usize,
    duration: Duration,
    pid: u32,
) -> anyhow::Result<(Throughput, f64, f64)> {
    let pid = pid.to_string();
    let before = process_cpu_seconds(&pid).context("cannot read the proxy's CPU time")?;
    let bench_before = process_cpu_seconds("self").unwrap_or(0.0);
    let throughput = closed_loop(client, url, body, concurrency, duration).await;
    let cpu = process_cpu_seconds(&pid).context("cannot read the proxy's CPU time")? - before;
    let bench = process_cpu_seconds("self").unwrap_or(0.0) - bench_before;
    if throughput.requests == 0 {
        bail!("no request went through {url} in the throughput phase");
    }
    Ok((throughput, cpu, bench))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU time of the calling thread, from the scheduler's own nanosecond count (a second,
    /// independent reading of what `process_cpu_seconds` reads in clock ticks).
    fn thread_cpu_seconds() -> f64 {
        let schedstat = std::fs::read_to_string("/proc/thread-self/schedstat")
            .expect("/proc/thread-self/schedstat");
        let nanoseconds: f64 = schedstat
            .split_whitespace()
            .next()
            .and_then(|field| field.parse().ok())
            .expect("sum_exec_runtime");
        nanoseconds / 1e9
    }

    #[test]
    fn reads_this_process_cpu_time() {
        // This thread burns 0.3 s of CPU while the process's other threads idle: the
        // process's CPU time must grow by as much, within the clock-tick rounding of both
        // readings (10 ms each) and 10% for the idle threads' wake-ups. However busy the
        // machine, thread CPU time is what the thread got, so the bound holds under load.
        let process_before = process_cpu_seconds("self").expect("/proc/self/stat");
        let thread_before = thread_cpu_seconds();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut spin = 0u64;
        while thread_cpu_seconds() - thread_before < 0.3 {
            assert!(std::time::Instant::now() < deadline, "no CPU in 60 s");
            for _ in 0..100_000 {
                spin = std::hint::black_box(spin.wrapping_mul(31).wrapping_add(7));
            }
        }
        let thread = thread_cpu_seconds() - thread_before;
        let process = process_cpu_seconds("self").expect("/proc/self/stat") - process_before;
        assert!(
            (process - thread).abs() <= 0.02 + 0.1 * thread,
            "process CPU grew {process:.3} s while this thread alone used {thread:.3} s"
        );
    }
}
