//! The overhead benchmark's report and its table.

use serde::Serialize;

use crate::output::Machine;
use crate::report::DecisionStats;
use crate::stats::Summary;

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
    #[serde(flatten)]
    pub latency: AddedLatency,
    pub throughput: Option<Throughput>,
    pub cpu_seconds: f64,
    pub requests_per_core_second: f64,
}

/// One path's latency against the direct path's, same rounds (alone: the TCP relay, the floor
/// of one more hop).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AddedLatency {
    pub latency_ms: Summary,
    /// This path's p50 − the direct path's, and p99.
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    /// Per round: this path − direct.
    pub paired_difference_ms: Summary,
}

impl AddedLatency {
    /// From the round-by-round samples of this path and of the direct one (ms).
    pub(crate) fn against(samples: &[f64], direct: &[f64]) -> Self {
        let latency_ms = Summary::of(samples);
        let direct_ms = Summary::of(direct);
        let differences: Vec<f64> = samples
            .iter()
            .zip(direct)
            .map(|(way, direct)| way - direct)
            .collect();
        Self {
            added_p50_ms: latency_ms.p50 - direct_ms.p50,
            added_p99_ms: latency_ms.p99 - direct_ms.p99,
            paired_difference_ms: Summary::of(&differences),
            latency_ms,
        }
    }
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
    pub tcp_relay: Option<AddedLatency>,
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
            out.push_str(&row(
                "through a bare forwarder",
                &forwarder.latency.latency_ms,
            ));
        }
        if let Some(relay) = &self.tcp_relay {
            out.push_str(&row("through a TCP relay", &relay.latency_ms));
        }
        if let Some(baseline) = &self.baseline_router {
            out.push_str(&row(
                "through the baseline router",
                &baseline.latency.latency_ms,
            ));
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
                forwarder.latency.added_p50_ms, forwarder.latency.added_p99_ms, p50, p99
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
                baseline.latency.added_p50_ms, baseline.latency.added_p99_ms, p50
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
