//! The simulator's counters and gauges, exposed as vLLM v1 Prometheus metrics on `/metrics`
//! and as [`SimStats`] to in-process callers.
//!
//! Latency histograms are in **model time**: wall-clock durations divided by `--time-scale`,
//! so a run at `--time-scale 0.01` reports the latencies the modelled GPU server would have.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use switchyard_process::metrics::{Histogram, TextEncoder};

use crate::engine::Counters;

/// vLLM's `time_to_first_token_seconds` buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `inter_token_latency_seconds` buckets.
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request latency buckets.
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A snapshot of one simulated engine's counters (tokens unless named otherwise).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SimStats {
    /// Inference requests received (chat, completions, invocations), valid or not.
    pub requests_received: u64,
    /// Requests that ran to completion (vLLM's `request_success_total`).
    pub requests_completed: u64,
    /// Requests dropped because the client went away.
    pub requests_aborted: u64,
    /// Requests answered 500 by fault injection.
    pub requests_failed: u64,
    /// Requests left hanging by fault injection.
    pub requests_hung: u64,
    /// Responses cut off by fault injection (die mid-stream).
    pub responses_cut: u64,
    /// Responses left stalled, connection open, by fault injection (stall mid-stream).
    pub responses_stalled: u64,
    /// Streamed responses ended by fault injection with vLLM's error event (error mid-stream).
    pub responses_errored: u64,
    /// Decode requests whose hand-off did not check out (the prompt was recomputed).
    pub kv_pull_failures: u64,
    /// LMCache pushes received from prefill engines.
    pub kv_pushes_received: u64,
    /// Requests in the batch now.
    pub running: u64,
    /// Requests queued now (including those waiting for a KV transfer).
    pub waiting: u64,
    /// Fraction of KV blocks held by running requests, 0–1.
    pub kv_cache_usage: f64,
    /// Blocks in the prefix-cache table (pinned or evictable).
    pub cached_blocks: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Prompt tokens whose KV was pulled from a remote prefill engine.
    pub kv_transfer_tokens: u64,
    /// Prompt tokens actually prefilled here (neither cached nor transferred).
    pub prefill_tokens_computed: u64,
    /// Prefill-only requests answered with `kv_transfer_params` for a remote decoder.
    pub kv_handoffs: u64,
    /// KV-cache event batches published (`--kv-events`).
    #[serde(default)]
    pub kv_event_batches_published: u64,
    /// KV-cache event batches lost because the publisher's queue was full.
    #[serde(default)]
    pub kv_event_batches_lost: u64,
}

impl SimStats {
    /// Prefix-cache hit rate in tokens (0 before any query).
    pub fn prefix_cache_hit_rate(&self) -> f64 {
        if self.prefix_cache_queries == 0 {
            0.0
        } else {
            self.prefix_cache_hits as f64 / self.prefix_cache_queries as f64
        }
    }
}

/// Live metrics shared by the HTTP handlers (request counts) and the engine driver (the rest).
#[derive(Debug)]
pub(crate) struct Metrics {
    pub requests_received: AtomicU64,
    pub requests_completed: AtomicU64,
    pub requests_aborted: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_hung: AtomicU64,
    pub responses_cut: AtomicU64,
    pub responses_stalled: AtomicU64,
    pub responses_errored: AtomicU64,
    /// Decode requests whose hand-off did not check out (the prompt was recomputed).
    pub kv_pull_failures: AtomicU64,
    /// LMCache pushes received from prefill engines.
    pub kv_pushes_received: AtomicU64,
    pub kv_handoffs: AtomicU64,
    pub kv_event_batches_published: AtomicU64,
    pub kv_event_batches_lost: AtomicU64,
    running: AtomicU64,
    waiting: AtomicU64,
    kv_cache_usage_bits: AtomicU64,
    cached_blocks: AtomicU64,
    prefix_cache_queries: AtomicU64,
    prefix_cache_hits: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    kv_transfer_tokens: AtomicU64,
    prefill_tokens_computed: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
}

/// The engine state the driver publishes after every step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineGauges {
    pub running: usize,
    pub waiting: usize,
    pub kv_cache_usage: f64,
    pub cached_blocks: usize,
    pub counters: Counters,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests_received: AtomicU64::new(0),
            requests_completed: AtomicU64::new(0),
            requests_aborted: AtomicU64::new(0),
            requests_failed: AtomicU64::new(0),
            requests_hung: AtomicU64::new(0),
            responses_cut: AtomicU64::new(0),
            responses_stalled: AtomicU64::new(0),
            responses_errored: AtomicU64::new(0),
            kv_pull_failures: AtomicU64::new(0),
            kv_pushes_received: AtomicU64::new(0),
            kv_handoffs: AtomicU64::new(0),
            kv_event_batches_published: AtomicU64::new(0),
            kv_event_batches_lost: AtomicU64::new(0),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_cache_usage_bits: AtomicU64::new(0f64.to_bits()),
            cached_blocks: AtomicU64::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            kv_transfer_tokens: AtomicU64::new(0),
            prefill_tokens_computed: AtomicU64::new(0),
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            e2e_request_latency: Histogram::new(E2E_BUCKETS),
        }
    }
}

fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

impl Metrics {
    pub(crate) fn increment(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn publish(&self, gauges: EngineGauges) {
        let store = |target: &AtomicU64, value: u64| target.store(value, Ordering::Relaxed);
        store(&self.running, gauges.running as u64);
        store(&self.waiting, gauges.waiting as u64);
        store(&self.kv_cache_usage_bits, gauges.kv_cache_usage.to_bits());
        store(&self.cached_blocks, gauges.cached_blocks as u64);
        let counters = gauges.counters;
        store(&self.prefix_cache_queries, counters.prefix_cache_queries);
        store(&self.prefix_cache_hits, counters.prefix_cache_hits);
        store(&self.prompt_tokens, counters.prompt_tokens);
        store(&self.generation_tokens, counters.generation_tokens);
        store(&self.kv_transfer_tokens, counters.transferred_tokens);
        store(
            &self.prefill_tokens_computed,
            counters.prefill_tokens_computed,
        );
    }

    pub(crate) fn stats(&self) -> SimStats {
        SimStats {
            requests_received: load(&self.requests_received),
            requests_completed: load(&self.requests_completed),
            requests_aborted: load(&self.requests_aborted),
            requests_failed: load(&self.requests_failed),
            requests_hung: load(&self.requests_hung),
            responses_cut: load(&self.responses_cut),
            responses_stalled: load(&self.responses_stalled),
            responses_errored: load(&self.responses_errored),
            kv_pull_failures: load(&self.kv_pull_failures),
            kv_pushes_received: load(&self.kv_pushes_received),
            running: load(&self.running),
            waiting: load(&self.waiting),
            kv_cache_usage: f64::from_bits(load(&self.kv_cache_usage_bits)),
            cached_blocks: load(&self.cached_blocks),
            prefix_cache_queries: load(&self.prefix_cache_queries),
            prefix_cache_hits: load(&self.prefix_cache_hits),
            prompt_tokens: load(&self.prompt_tokens),
            generation_tokens: load(&self.generation_tokens),
            kv_transfer_tokens: load(&self.kv_transfer_tokens),
            prefill_tokens_computed: load(&self.prefill_tokens_computed),
            kv_handoffs: load(&self.kv_handoffs),
            kv_event_batches_published: load(&self.kv_event_batches_published),
            kv_event_batches_lost: load(&self.kv_event_batches_lost),
        }
    }

    /// Prometheus text with vLLM v1 metric names, each labelled `model_name`.
    pub(crate) fn render(&self, model_name: &str) -> String {
        let stats = self.stats();
        let labels = [("model_name", model_name)];
        let mut out = TextEncoder::new();
        let gauges = [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                stats.running as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                stats.waiting as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                stats.kv_cache_usage,
            ),
        ];
        for (name, help, value) in gauges {
            out.family(name, "gauge", help).sample(name, &labels, value);
        }
        let counters = [
            (
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                stats.prefix_cache_hits,
            ),
            (
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
                stats.prompt_tokens,
            ),
            (
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
                stats.generation_tokens,
            ),
        ];
        for (name, help, value) in counters {
            out.family(name, "counter", help)
                .sample(name, &labels, value as f64);
        }
        let success = "vllm:request_success_total";
        out.family(
            success,
            "counter",
            "Count of successfully processed requests.",
        );
        for (reason, value) in [
            ("stop", 0),
            ("length", stats.requests_completed),
            ("abort", stats.requests_aborted),
        ] {
            out.sample(
                success,
                &[("model_name", model_name), ("finished_reason", reason)],
                value as f64,
            );
        }
        let histograms = [
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds (model time).",
                &self.time_to_first_token,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds (model time).",
                &self.inter_token_latency,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of end to end request latency in seconds (model time).",
                &self.e2e_request_latency,
            ),
        ];
        for (name, help, histogram) in histograms {
            out.family(name, "histogram", help);
            out.histogram(name, &labels, histogram);
        }
        out.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_with_the_model_label() {
        let metrics = Metrics::default();
        metrics.publish(EngineGauges {
            running: 2,
            waiting: 1,
            kv_cache_usage: 0.25,
            cached_blocks: 10,
            counters: Counters {
                prefix_cache_queries: 100,
                prefix_cache_hits: 48,
                ..Counters::default()
            },
        });
        metrics.time_to_first_token.observe(0.2);
        let text = metrics.render("sim");
        for line in [
            "vllm:num_requests_running{model_name=\"sim\"} 2\n",
            "vllm:num_requests_waiting{model_name=\"sim\"} 1\n",
            "vllm:kv_cache_usage_perc{model_name=\"sim\"} 0.25\n",
            "vllm:prefix_cache_queries_total{model_name=\"sim\"} 100\n",
            "vllm:prefix_cache_hits_total{model_name=\"sim\"} 48\n",
            "vllm:request_success_total{model_name=\"sim\",finished_reason=\"length\"} 0\n",
            "vllm:time_to_first_token_seconds_count{model_name=\"sim\"} 1\n",
            "vllm:inter_token_latency_seconds_bucket{model_name=\"sim\",le=\"+Inf\"} 0\n",
            "vllm:e2e_request_latency_seconds_sum{model_name=\"sim\"} 0\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!((metrics.stats().prefix_cache_hit_rate() - 0.48).abs() < 1e-9);
    }
}
