//! The benchmark report of `compare` and of a driven router: per-run statistics, the
//! comparison against a baseline strategy and the product-target checks; `table` prints it,
//! [`svg`] draws it, [`emit`] writes it.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::oracle::OracleBound;
use crate::output::Machine;
use crate::run::RunOutput;
use crate::scrape::{EngineCounters, Histogram};
use crate::stats::{Latency, relative_change};
use crate::workload::{RequestClass, WorkloadSpec};

pub mod emit;
pub mod svg;
mod table;

/// PREFIX_AWARE's bounded-load extension as one comparison column ran it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LoadBalanceSetting {
    /// LoadBalanceFactor c.
    pub factor: f64,
    /// LoadBalanceSlack s.
    pub slack: u32,
}

impl LoadBalanceSetting {
    pub fn column_name(self) -> String {
        format!("PREFIX_AWARE c={} s={}", self.factor, self.slack)
    }
}

/// Requests one instance served.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InstanceShare {
    pub instance: String,
    pub requests: u64,
    /// Of the successful requests that named an instance.
    pub share: f64,
}

/// Latencies of one request class (mixed workload).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassStats {
    pub requests: usize,
    pub ttft: Latency,
    pub itl: Latency,
    pub e2e: Latency,
}

/// What the client measured in one run. Latencies: `wall_ms` on the wall clock, `model_ms`
/// = wall / time scale (the modelled GPU server's time; equal when the time scale is 1).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunStats {
    pub requests: usize,
    pub ok: usize,
    pub errors: usize,
    pub first_error: Option<String>,
    /// False if the time limit cut the run short.
    pub complete: bool,
    pub wall_seconds: f64,
    pub ttft: Latency,
    pub itl: Latency,
    pub e2e: Latency,
    pub requests_per_s_wall: f64,
    pub requests_per_s_model: f64,
    pub output_tokens_per_s_model: f64,
    pub instance_shares: Vec<InstanceShare>,
    /// Requests by `x-switchyard-route`.
    pub routes: BTreeMap<String, u64>,
    /// From each answer's `usage`: prompt tokens and `prompt_tokens_details.cached_tokens`.
    pub usage_prompt_tokens: u64,
    pub usage_cached_tokens: u64,
    /// Per request class, when the workload mixes long and short prompts.
    pub classes: BTreeMap<String, ClassStats>,
}

impl RunStats {
    pub fn from_output(output: &RunOutput, time_scale: f64) -> Self {
        let ok: Vec<_> = output
            .measured
            .iter()
            .filter(|item| item.outcome.ok())
            .collect();
        let errors = output.measured.len() - ok.len();
        let ms = |duration: std::time::Duration| duration.as_secs_f64() * 1e3;
        let latencies = |items: &[&crate::run::Measured]| {
            let ttft: Vec<f64> = items
                .iter()
                .filter_map(|item| item.outcome.ttft.map(ms))
                .collect();
            let itl: Vec<f64> = items
                .iter()
                .flat_map(|item| item.outcome.itl.iter().copied().map(ms))
                .collect();
            let e2e: Vec<f64> = items.iter().map(|item| ms(item.outcome.e2e)).collect();
            (
                Latency::of(&ttft, time_scale),
                Latency::of(&itl, time_scale),
                Latency::of(&e2e, time_scale),
            )
        };
        let (ttft, itl, e2e) = latencies(&ok);

        let mut by_instance: BTreeMap<String, u64> = BTreeMap::new();
        let mut routes: BTreeMap<String, u64> = BTreeMap::new();
        for item in &ok {
            if let Some(instance) = &item.outcome.instance {
                *by_instance.entry(instance.clone()).or_default() += 1;
            }
            if let Some(route) = &item.outcome.route {
                *routes.entry(route.clone()).or_default() += 1;
            }
        }
        let named: u64 = by_instance.values().sum();
        let mut instance_shares: Vec<InstanceShare> = by_instance
            .into_iter()
            .map(|(instance, requests)| InstanceShare {
                share: requests as f64 / named.max(1) as f64,
                instance,
                requests,
            })
            .collect();
        instance_shares.sort_by_key(|share| natural_key(&share.instance));

        let mut classes = BTreeMap::new();
        let long: Vec<_> = ok
            .iter()
            .copied()
            .filter(|item| item.class == RequestClass::Long)
            .collect();
        let short: Vec<_> = ok
            .iter()
            .copied()
            .filter(|item| item.class == RequestClass::Short)
            .collect();
        if !long.is_empty() && !short.is_empty() {
            for (name, items) in [("long", long), ("short", short)] {
                let (ttft, itl, e2e) = latencies(&items);
                classes.insert(
                    name.to_owned(),
                    ClassStats {
                        requests: items.len(),
                        ttft,
                        itl,
                        e2e,
                    },
                );
            }
        }

        let wall_seconds = output.wall.as_secs_f64();
        let output_tokens: u64 = ok
            .iter()
            .map(|item| u64::from(item.outcome.output_tokens()))
            .sum();
        let per_second = |count: f64| {
            if wall_seconds > 0.0 {
                count / wall_seconds
            } else {
                0.0
            }
        };
        Self {
            requests: output.measured.len(),
            ok: ok.len(),
            errors,
            first_error: output
                .measured
                .iter()
                .find_map(|item| item.outcome.error.clone()),
            complete: output.complete,
            wall_seconds,
            ttft,
            itl,
            e2e,
            requests_per_s_wall: per_second(ok.len() as f64),
            requests_per_s_model: per_second(ok.len() as f64) * time_scale,
            output_tokens_per_s_model: per_second(output_tokens as f64) * time_scale,
            instance_shares,
            routes,
            usage_prompt_tokens: ok
                .iter()
                .filter_map(|item| item.outcome.prompt_tokens)
                .map(u64::from)
                .sum(),
            usage_cached_tokens: ok
                .iter()
                .filter_map(|item| item.outcome.cached_tokens)
                .map(u64::from)
                .sum(),
            classes,
        }
    }

    /// Adds a zero share for every instance in `ids` that served nothing (an idle instance
    /// names itself in no answer).
    pub fn include_idle_instances(&mut self, ids: &[String]) {
        for id in ids {
            if !self
                .instance_shares
                .iter()
                .any(|share| &share.instance == id)
            {
                self.instance_shares.push(InstanceShare {
                    instance: id.clone(),
                    requests: 0,
                    share: 0.0,
                });
            }
        }
        self.instance_shares
            .sort_by_key(|share| natural_key(&share.instance));
    }

    /// (smallest, largest) instance share.
    pub fn share_range(&self) -> Option<(f64, f64)> {
        let shares = self.instance_shares.iter().map(|share| share.share);
        let min = shares.clone().reduce(f64::min)?;
        let max = shares.reduce(f64::max)?;
        Some((min, max))
    }
}

/// "engine-10" after "engine-9".
fn natural_key(text: &str) -> (String, u64) {
    let digits = text.len() - text.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, number) = text.split_at(text.len() - digits);
    (stem.to_owned(), number.parse().unwrap_or(0))
}

/// KV-cache hit rate of a run, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KvStats {
    pub hit_rate: f64,
    pub hit_tokens: f64,
    pub query_tokens: f64,
    /// `engine-metrics` (vllm:prefix_cache_* deltas) or `usage` (cached_tokens of answers).
    pub source: &'static str,
    /// hit_rate / the oracle's.
    pub fraction_of_oracle: Option<f64>,
}

impl KvStats {
    pub fn from_engines(counters: &EngineCounters, oracle: Option<&OracleBound>) -> Self {
        Self::new(
            counters.prefix_cache_hits,
            counters.prefix_cache_queries,
            "engine-metrics",
            oracle,
        )
    }

    pub fn from_usage(stats: &RunStats, oracle: Option<&OracleBound>) -> Option<Self> {
        (stats.usage_prompt_tokens > 0).then(|| {
            Self::new(
                stats.usage_cached_tokens as f64,
                stats.usage_prompt_tokens as f64,
                "usage",
                oracle,
            )
        })
    }

    fn new(hits: f64, queries: f64, source: &'static str, oracle: Option<&OracleBound>) -> Self {
        let hit_rate = if queries > 0.0 { hits / queries } else { 0.0 };
        Self {
            hit_rate,
            hit_tokens: hits,
            query_tokens: queries,
            source,
            fraction_of_oracle: oracle
                .filter(|oracle| oracle.hit_rate > 0.0)
                .map(|oracle| hit_rate / oracle.hit_rate),
        }
    }
}

/// The routers' own `switchyard_router_decision_seconds` (arrival to routing decision, body
/// read and parsed), summed over routers, in milliseconds (bucket-interpolated quantiles).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DecisionStats {
    pub count: f64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl DecisionStats {
    pub fn from_histogram(histogram: &Histogram) -> Option<Self> {
        Some(Self {
            count: histogram.count,
            mean_ms: histogram.mean()? * 1e3,
            p50_ms: histogram.quantile(0.5)? * 1e3,
            p99_ms: histogram.quantile(0.99)? * 1e3,
        })
    }
}

impl DecisionStats {
    /// Exact quantiles of `samples_ms` (None when empty).
    pub fn from_samples(samples_ms: &[f64]) -> Option<Self> {
        let mut sorted = samples_ms.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Self {
            count: sorted.len() as f64,
            mean_ms: sorted.iter().sum::<f64>() / sorted.len().max(1) as f64,
            p50_ms: crate::stats::percentile(&sorted, 0.5)?,
            p99_ms: crate::stats::percentile(&sorted, 0.99)?,
        })
    }
}

/// What routing cost the routers, from each answer's `x-switchyard-decision-us` and the
/// router processes' CPU time: requests whose prefix that router had routed before apart from
/// first-seen ones (a KV_AWARE router tokenizes a first-seen prefix whole, then keeps its
/// pieces' ids).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct RouterCost {
    /// Every answer's decision time (exact, not bucketed).
    pub decision: Option<DecisionStats>,
    /// Requests whose shared prefix the same router had decided for an earlier request before
    /// this one was sent (or whose session's previous turn it served).
    pub decision_seen_before: Option<DecisionStats>,
    /// The others: the first request of a prefix at each router.
    pub decision_first_seen: Option<DecisionStats>,
    /// The router processes' CPU time (user + system) over the run, per request answered
    /// (`--router-processes` only).
    pub cpu_ms_per_request: Option<f64>,
    /// KV_AWARE with a router tokenizer: its `/tokenize` calls to engines.
    pub tokenize_calls: Option<TokenizeCalls>,
}

/// A router tokenizer's `/tokenize` calls to engines, answered or failed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TokenizeCalls {
    /// Needed for routing (the router could not compute the ids).
    pub routing: f64,
    /// Checks of the router's ids (`--tokenize-check-fraction`).
    pub checks: f64,
}

/// A run against the baseline run of the same group (RANDOM): relative changes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Versus {
    pub baseline: String,
    pub ttft_p50_change: Option<f64>,
    pub ttft_p90_change: Option<f64>,
    pub ttft_p99_change: Option<f64>,
    pub e2e_p50_change: Option<f64>,
    pub throughput_change: Option<f64>,
    /// Hit rate minus the baseline's, in points (0–1).
    pub hit_rate_change: Option<f64>,
}

/// One measured run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    pub label: String,
    /// Routing strategy of the endpoint (compare), or `None` for an existing or peer router.
    pub strategy: Option<String>,
    /// PREFIX_AWARE's bounded-load extension, if the run used it.
    pub load_balance: Option<LoadBalanceSetting>,
    /// The peer router (compare), e.g. `SGLang cache_aware`.
    pub peer: Option<String>,
    pub routers: usize,
    #[serde(flatten)]
    pub stats: RunStats,
    pub kv: Option<KvStats>,
    pub kv_from_usage: Option<KvStats>,
    pub router_decision: Option<DecisionStats>,
    /// KV_AWARE: the routers' `/tokenize` round trips to the engines
    /// (`switchyard_router_kv_tokenize_seconds`).
    pub kv_tokenize: Option<DecisionStats>,
    /// Switchyard's routers: decision time per request, split by prefix seen or not, and CPU.
    pub router_cost: Option<RouterCost>,
    pub versus_baseline: Option<Versus>,
    /// Instances the routers saw at the end (a drop means one was marked unhealthy).
    pub instances_routable_at_end: Vec<usize>,
    /// Several PREFIX_AWARE routers: how often they would have chosen differently.
    pub disagreement: Option<crate::agreement::Disagreement>,
}

impl RunReport {
    /// A run measured from the client side only (the target or a peer router): no strategy,
    /// no KV statistics yet, no router-side decision times or costs, no comparison.
    pub fn client_side(label: String, routers: usize, stats: RunStats) -> Self {
        Self {
            label,
            strategy: None,
            load_balance: None,
            peer: None,
            routers,
            stats,
            kv: None,
            kv_from_usage: None,
            router_decision: None,
            kv_tokenize: None,
            router_cost: None,
            versus_baseline: None,
            instances_routable_at_end: Vec::new(),
            disagreement: None,
        }
    }

    /// The column name: the strategy (with its load balance), the peer, or the label.
    pub fn column(&self) -> String {
        if let Some(balance) = self.load_balance {
            return balance.column_name();
        }
        // A run's label starts with its arm's name (`KV_AWARE no piece cache · 1 router`).
        let arm = self.label.split(" · ").next();
        self.strategy
            .as_ref()
            .map(|strategy| match arm {
                Some(arm) if arm.starts_with(strategy.as_str()) => arm.to_owned(),
                _ => strategy.clone(),
            })
            .or_else(|| self.peer.clone())
            .unwrap_or_else(|| self.label.clone())
    }

    pub fn hit_rate(&self) -> Option<f64> {
        self.kv.or(self.kv_from_usage).map(|kv| kv.hit_rate)
    }

    /// Fills `versus_baseline` against `baseline`.
    pub fn compare_to(&mut self, baseline: &RunReport) {
        let change = |base: f64, new: f64| relative_change(base, new);
        self.versus_baseline = Some(Versus {
            baseline: baseline.label.clone(),
            ttft_p50_change: change(baseline.stats.ttft.wall_ms.p50, self.stats.ttft.wall_ms.p50),
            ttft_p90_change: change(baseline.stats.ttft.wall_ms.p90, self.stats.ttft.wall_ms.p90),
            ttft_p99_change: change(baseline.stats.ttft.wall_ms.p99, self.stats.ttft.wall_ms.p99),
            e2e_p50_change: change(baseline.stats.e2e.wall_ms.p50, self.stats.e2e.wall_ms.p50),
            throughput_change: change(
                baseline.stats.requests_per_s_wall,
                self.stats.requests_per_s_wall,
            ),
            hit_rate_change: match (self.hit_rate(), baseline.hit_rate()) {
                (Some(new), Some(base)) => Some(new - base),
                _ => None,
            },
        });
    }
}

/// A product target checked against this run's numbers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub what: String,
    pub target: String,
    pub measured: String,
    pub pass: bool,
}

/// The workload as run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkloadSummary {
    #[serde(flatten)]
    pub spec: WorkloadSpec,
    pub sessions: usize,
    /// By the simulator's tokenizer and chat template.
    pub prompt_tokens: u64,
    pub mean_prompt_tokens: f64,
}

/// The engines and routing configuration of a self-contained run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Setup {
    pub engines: usize,
    pub kv_cache_blocks: usize,
    pub block_size: usize,
    pub prefill_tokens_per_s: f64,
    /// Simulated engines' fixed cost of a step, model ms.
    pub step_overhead_ms: f64,
    /// Simulated engines' read of the weights, paid by every step that runs the model
    /// (before 46235ae only by steps that decoded), model ms.
    pub weights_ms_per_step: f64,
    pub prefix_length: u32,
    pub concurrency_threshold: u32,
    /// Router load reports and control-plane load broadcasts, wall ms.
    pub load_interval_ms: u64,
}

/// Everything one invocation measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub tool: String,
    pub version: String,
    /// `compare`, or `drive` (an existing router).
    pub mode: String,
    pub command: String,
    pub machine: Machine,
    pub workload: WorkloadSummary,
    /// Engines' clock scale: model ms = wall ms / time_scale.
    pub time_scale: f64,
    /// Closed-loop clients (or the open loop's cap on sessions in flight).
    pub concurrency: usize,
    /// Open loop: sessions per second of model time.
    pub rate: Option<f64>,
    pub setup: Option<Setup>,
    pub oracle: Option<OracleBound>,
    pub runs: Vec<RunReport>,
    /// PREFIX_AWARE placement before overflow: each instance's share of the requests whose
    /// prefix it owns in rendezvous order (the key imbalance any consistent placement has).
    pub prefix_owner_shares: Vec<InstanceShare>,
    pub checks: Vec<Check>,
    pub notes: Vec<String>,
}

impl Report {
    /// Router counts, in run order.
    pub fn router_groups(&self) -> Vec<usize> {
        let mut groups: Vec<usize> = Vec::new();
        for run in &self.runs {
            if !groups.contains(&run.routers) {
                groups.push(run.routers);
            }
        }
        groups
    }
}

pub fn percent(fraction: f64) -> String {
    format!("{:.1}%", fraction * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order_of_instance_ids() {
        let mut ids = vec!["engine-10", "engine-2", "engine-1", "other"];
        ids.sort_by_key(|id| natural_key(id));
        assert_eq!(ids, ["engine-1", "engine-2", "engine-10", "other"]);
    }
}
