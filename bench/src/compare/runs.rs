//! One column of a comparison on fresh engines: a cluster of Switchyard routers, or a peer
//! router, driven with the trace and measured.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use super::settings::{Arm, CompareSettings};
use crate::agreement::{KeyShares, sample_until};
use crate::client::HttpClient;
use crate::oracle::OracleBound;
use crate::peer::{Peer, PeerRouters};
use crate::report::{
    DecisionStats, InstanceShare, KvStats, LoadBalanceSetting, RouterCost, RunReport, RunStats,
    TokenizeCalls, percent,
};
use crate::run::{RunConfig, RunOutput, run};
use crate::scrape::{EngineCounters, Histogram, metrics_url, scrape};
use crate::strategy::Strategy;
use crate::workload::Trace;
use switchyard_cluster::{
    ClusterSpec, ClusterTuning, LocalCluster, kv_aware_variants_json_with,
    prefix_aware_variants_json, variants_json,
};

/// The engines' counters, summed.
async fn scrape_engines(client: &HttpClient, urls: &[String]) -> anyhow::Result<EngineCounters> {
    let mut total = EngineCounters::default();
    for counters in scrape_each(client, urls).await? {
        total.add(&counters);
    }
    Ok(total)
}

/// The routers' histograms, summed: decision time, and KV_AWARE's `/tokenize` round trip
/// (answered ones); the round trips that failed; and the checks of a router tokenizer's ids
/// among them (answered, failed).
#[derive(Debug, Default)]
struct RouterHistograms {
    decision: Histogram,
    tokenize: Histogram,
    tokenize_failures: f64,
    checks_answered: f64,
    checks_failed: f64,
}

impl RouterHistograms {
    fn since(&self, before: &Self) -> Self {
        Self {
            decision: self.decision.since(&before.decision),
            tokenize: self.tokenize.since(&before.tokenize),
            tokenize_failures: self.tokenize_failures - before.tokenize_failures,
            checks_answered: self.checks_answered - before.checks_answered,
            checks_failed: self.checks_failed - before.checks_failed,
        }
    }

    /// `/tokenize` calls to engines that routing needed (answered or not): all of them less
    /// the checks.
    fn routing_calls(&self) -> f64 {
        (self.tokenize.count - self.checks_answered).max(0.0)
            + (self.tokenize_failures - self.checks_failed).max(0.0)
    }
}

async fn scrape_routers(client: &HttpClient, urls: &[String]) -> anyhow::Result<RouterHistograms> {
    let mut total = RouterHistograms::default();
    for url in urls {
        let samples = scrape(client, &metrics_url(url)).await?;
        if let Some(histogram) =
            Histogram::from_samples(&samples, "switchyard_router_decision_seconds")
        {
            total.decision.add(&histogram);
        }
        if let Some(histogram) =
            Histogram::from_samples(&samples, "switchyard_router_kv_tokenize_seconds")
        {
            total.tokenize.add(&histogram);
        }
        total.tokenize_failures +=
            crate::scrape::total(&samples, "switchyard_router_kv_tokenize_failures_total");
        for sample in samples
            .iter()
            .filter(|sample| sample.name == "switchyard_router_local_tokenize_checks_total")
        {
            match sample.label("outcome") {
                Some("failed") => total.checks_failed += sample.value,
                _ => total.checks_answered += sample.value,
            }
        }
    }
    Ok(total)
}

/// Decision times from the answers' `x-switchyard-decision-us`, split by whether the router
/// that took the request had seen its prefix before it arrived: an earlier request with the
/// same shared prefix (`group`) had been decided by that router before this one was sent (one
/// still being tokenized when this one came does not count: the router had not seen it yet),
/// or the session's previous turn went to that router.
fn decision_split(
    trace: &Trace,
    output: &RunOutput,
) -> (
    Option<DecisionStats>,
    Option<DecisionStats>,
    Option<DecisionStats>,
) {
    let mut order: Vec<&crate::run::Measured> = output.measured.iter().collect();
    order.sort_by_key(|measured| measured.sent);
    // (router, group) -> the earliest time a request of it had been decided.
    let mut decided: std::collections::HashMap<(usize, u32), Duration> =
        std::collections::HashMap::new();
    let mut last_turn_target = std::collections::HashMap::new();
    let (mut all, mut seen, mut first) = (Vec::new(), Vec::new(), Vec::new());
    for measured in order {
        let request = &trace.sessions[measured.session].requests[measured.turn];
        let group = request.group.map(|group| (measured.target, group));
        let group_seen = group
            .and_then(|key| decided.get(&key))
            .is_some_and(|at| *at <= measured.sent);
        let turn_seen =
            measured.turn > 0 && last_turn_target.get(&measured.session) == Some(&measured.target);
        last_turn_target.insert(measured.session, measured.target);
        let Some(us) = measured.outcome.decision_us else {
            continue;
        };
        if let Some(key) = group {
            let at = measured.sent + Duration::from_micros(us);
            decided
                .entry(key)
                .and_modify(|earliest| *earliest = (*earliest).min(at))
                .or_insert(at);
        }
        let ms = us as f64 / 1e3;
        all.push(ms);
        if group_seen || turn_seen {
            seen.push(ms);
        } else {
            first.push(ms);
        }
    }
    (
        DecisionStats::from_samples(&all),
        DecisionStats::from_samples(&seen),
        DecisionStats::from_samples(&first),
    )
}

/// Waits until every router has loaded the tokenizer `name` (they start loading it when the
/// routing state names it), so no request of the run is tokenized by an engine meanwhile.
async fn wait_tokenizer_usable(
    client: &HttpClient,
    router_urls: &[String],
    name: &str,
) -> anyhow::Result<()> {
    let line = format!("switchyard_router_local_tokenizer_usable{{tokenizer=\"{name}\"}} 1");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    for url in router_urls {
        loop {
            let samples = scrape(client, &metrics_url(url)).await?;
            let usable = samples.iter().any(|sample| {
                sample.name == "switchyard_router_local_tokenizer_usable"
                    && sample.value == 1.0
                    && sample.label("tokenizer") == Some(name)
            });
            if usable {
                break;
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "router {url}: the tokenizer {name} was not loaded within 120 s ({line})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// CPU seconds (user + system) of the router processes, summed.
fn routers_cpu_seconds(cluster: &LocalCluster) -> Option<f64> {
    let pids = cluster.router_pids();
    if pids.is_empty() {
        return None;
    }
    pids.iter()
        .map(|pid| crate::procfs::process_cpu_seconds(&pid.to_string()))
        .sum()
}

/// The `smg` (or other peer) binary to run, if there is one.
pub fn peer_binary(settings: &CompareSettings, peer: Peer) -> Option<std::path::PathBuf> {
    match peer {
        Peer::Sglang => peer.find_binary(settings.sglang_bin.as_deref()),
        Peer::Smg => peer.find_binary(settings.smg_bin.as_deref()),
    }
}

/// A ProductionVariants JSON of `arm` (a strategy, or PREFIX_AWARE with the extension;
/// KV_AWARE with the same ConcurrencyThreshold as PREFIX_AWARE).
fn arm_variants_json(settings: &CompareSettings, arm: Arm) -> String {
    let prefix = |balance: Option<LoadBalanceSetting>| {
        let mut config = switchyard_shared::PrefixAwareRoutingConfig::sagemaker(
            settings.prefix_length,
            settings.concurrency_threshold,
        );
        if let Some(balance) = balance {
            config.load_balance_factor = Some(balance.factor);
            config.load_balance_slack = Some(balance.slack);
        }
        config
    };
    match arm {
        Arm::Strategy(Strategy::PrefixAware) => prefix_aware_variants_json(&prefix(None)),
        Arm::Bounded(balance) => prefix_aware_variants_json(&prefix(Some(balance))),
        Arm::Strategy(Strategy::KvAware) | Arm::KvNoPieceCache => kv_aware_variants_json_with(
            settings.concurrency_threshold,
            tokenizer_name(settings).as_deref(),
        ),
        Arm::Strategy(strategy) => variants_json(strategy.as_str(), None),
        Arm::Peer(_) => String::new(),
    }
}

/// The simulator's `--tokenizer` folder's name, which the KV_AWARE routers load from its parent.
fn tokenizer_name(settings: &CompareSettings) -> Option<String> {
    let folder = settings.sim.tokenizer.as_ref()?;
    Some(folder.file_name()?.to_string_lossy().into_owned())
}

/// One run of a comparison: its settings, router count and label, and what every run shares.
pub struct Column<'a> {
    pub settings: &'a CompareSettings,
    pub routers: usize,
    pub label: &'a str,
    pub trace: &'a Arc<Trace>,
    pub oracle: &'a OracleBound,
    pub client: &'a HttpClient,
}

impl Column<'_> {
    /// Sends the trace to `targets` (spread round-robin) with `model` in every body.
    async fn run(&self, targets: Vec<http::Uri>, model: String) -> anyhow::Result<RunOutput> {
        let settings = self.settings;
        let config = RunConfig {
            targets,
            model,
            concurrency: settings.concurrency,
            rate: settings.rate.map(|rate| rate / settings.time_scale()),
            seed: settings.workload.seed,
            request_timeout: settings.request_timeout,
            max_duration: settings.max_duration,
            label: self.label.to_owned(),
            progress: settings.progress,
        };
        run(Arc::clone(self.trace), config, self.client.clone()).await
    }
}

/// Switchyard's routers (a strategy, or PREFIX_AWARE with the extension) on a fresh cluster.
pub async fn run_one(column: &Column<'_>, arm: Arm, keys: &KeyShares) -> anyhow::Result<RunReport> {
    let (settings, routers) = (column.settings, column.routers);
    let mut sim = settings.sim.clone();
    let kv_aware = matches!(arm, Arm::Strategy(Strategy::KvAware) | Arm::KvNoPieceCache);
    if kv_aware {
        // The engines publish their KV-cache events; the routers follow them.
        sim.kv_events = Some("tcp://127.0.0.1:0".into());
        sim.kv_events_replay = Some("tcp://127.0.0.1:0".into());
    }
    let spec = ClusterSpec {
        engines: settings.engines,
        routers,
        endpoint: "bench".into(),
        variants_json: arm_variants_json(settings, arm),
        sim,
        ..ClusterSpec::default()
    };
    let tuning = ClusterTuning {
        load_interval_ms: settings.load_interval_ms,
        router_binary: settings.router_binary.clone(),
        router_tokenizer_dir: settings
            .sim
            .tokenizer
            .as_ref()
            .and_then(|folder| folder.parent())
            .map(std::path::Path::to_path_buf),
        router_tokenize_check_fraction: settings.tokenize_check_fraction,
        router_tokenize_cache_bytes: (arm == Arm::KvNoPieceCache).then_some(0),
        router_decision_header: true,
        ..ClusterTuning::default()
    };
    let cluster = LocalCluster::start_with(spec, tuning).await?;
    if kv_aware && let Some(name) = tokenizer_name(settings) {
        wait_tokenizer_usable(column.client, &cluster.router_urls, &name).await?;
    }
    // Boxed: the run and the sampler side by side make a large future.
    let result = Box::pin(measure(column, arm, keys, &cluster)).await;
    cluster.shutdown().await;
    result
}

async fn measure(
    column: &Column<'_>,
    arm: Arm,
    keys: &KeyShares,
    cluster: &LocalCluster,
) -> anyhow::Result<RunReport> {
    let (settings, oracle, client) = (column.settings, column.oracle, column.client);
    let time_scale = settings.time_scale();
    let engines_before = scrape_engines(client, &cluster.engine_urls).await?;
    let decisions_before = scrape_routers(client, &cluster.router_urls).await?;
    let cpu_before = routers_cpu_seconds(cluster);
    let targets = cluster
        .router_urls
        .iter()
        .map(|url| {
            format!(
                "{url}/endpoints/{}/openai/v1/chat/completions",
                cluster.endpoint
            )
            .parse::<http::Uri>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    // With several PREFIX_AWARE routers, how often they would disagree, sampled during the run.
    let prefix_aware = matches!(arm, Arm::Strategy(Strategy::PrefixAware) | Arm::Bounded(_));
    let stop_sampling = tokio_util::sync::CancellationToken::new();
    let sampling = async {
        if prefix_aware {
            let interval = Duration::from_millis(5);
            sample_until(
                cluster.routers(),
                &cluster.endpoint,
                keys,
                interval,
                stop_sampling.clone(),
            )
            .await
        } else {
            None
        }
    };
    let running = async {
        let output = column.run(targets, cluster.endpoint.clone()).await;
        stop_sampling.cancel();
        output
    };
    let (output, disagreement) = tokio::join!(running, sampling);
    let output = output?;
    // Every answer is complete when the client has it; the routers' counts follow at once.
    let settle = std::time::Instant::now();
    while cluster.in_flight() > 0 && settle.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let engines = scrape_engines(client, &cluster.engine_urls)
        .await?
        .since(&engines_before);
    let decisions = scrape_routers(client, &cluster.router_urls)
        .await?
        .since(&decisions_before);
    let cpu = routers_cpu_seconds(cluster)
        .zip(cpu_before)
        .map(|(after, before)| after - before);
    let (decision, decision_seen_before, decision_first_seen) =
        decision_split(column.trace, &output);
    let mut stats = RunStats::from_output(&output, time_scale);
    stats.include_idle_instances(&cluster.instance_ids());
    let kv_from_usage = KvStats::from_usage(&stats, Some(oracle));
    let report = RunReport {
        label: column.label.to_owned(),
        strategy: match arm {
            Arm::Strategy(strategy) => Some(strategy.as_str().to_owned()),
            Arm::Bounded(_) => Some(Strategy::PrefixAware.as_str().to_owned()),
            Arm::KvNoPieceCache => Some(Strategy::KvAware.as_str().to_owned()),
            Arm::Peer(_) => None,
        },
        load_balance: match arm {
            Arm::Bounded(balance) => Some(balance),
            _ => None,
        },
        peer: None,
        routers: column.routers,
        kv: Some(KvStats::from_engines(&engines, Some(oracle))),
        kv_from_usage,
        router_decision: DecisionStats::from_histogram(&decisions.decision),
        kv_tokenize: (decisions.tokenize.count > 0.0)
            .then(|| DecisionStats::from_histogram(&decisions.tokenize))
            .flatten(),
        router_cost: Some(RouterCost {
            decision,
            decision_seen_before,
            decision_first_seen,
            cpu_ms_per_request: cpu.map(|seconds| seconds * 1e3 / stats.ok.max(1) as f64),
            tokenize_calls: (matches!(arm, Arm::Strategy(Strategy::KvAware) | Arm::KvNoPieceCache)
                && tokenizer_name(settings).is_some())
            .then(|| TokenizeCalls {
                routing: decisions.routing_calls(),
                checks: decisions.checks_answered + decisions.checks_failed,
            }),
        }),
        versus_baseline: None,
        instances_routable_at_end: cluster.routable_instances(),
        disagreement,
        stats,
    };
    progress_line(settings, &report);
    Ok(report)
}

fn progress_line(settings: &CompareSettings, report: &RunReport) {
    if settings.progress {
        eprintln!(
            "{}: hit rate {}, TTFT p50 {:.1} model ms, {:.2} req/s (model), shares {}, {} errors, {:.1} s",
            report.label,
            report.hit_rate().map_or_else(|| "-".into(), percent),
            report.stats.ttft.model_ms.p50,
            report.stats.requests_per_s_model,
            report.stats.share_range().map_or_else(
                || "-".into(),
                |(min, max)| format!("{}-{}", percent(min), percent(max))
            ),
            report.stats.errors,
            report.stats.wall_seconds
        );
    }
}

/// A peer router (`routers` processes) in front of fresh simulated engines, driven with the
/// same trace. Shares come from the engines' own request counters (peers send no
/// `x-switchyard-instance`).
pub async fn run_peer(column: &Column<'_>, peer: Peer) -> anyhow::Result<RunReport> {
    let (settings, client) = (column.settings, column.client);
    let binary = peer_binary(settings, peer)
        .with_context(|| format!("`{}` not found", peer.binary_name()))?;
    let mut engines = Vec::with_capacity(settings.engines);
    for _ in 0..settings.engines {
        engines.push(
            switchyard_engine_sim::spawn(settings.sim.clone())
                .await
                .context("cannot start a simulated engine")?,
        );
    }
    let engine_urls: Vec<String> = engines.iter().map(|engine| engine.url.clone()).collect();
    let result = match PeerRouters::start(peer, &binary, column.routers, &engine_urls, client).await
    {
        Ok(peers) => {
            let result = measure_peer(column, peer, &peers.urls, &engine_urls).await;
            peers.shutdown().await;
            result
        }
        Err(err) => Err(err),
    };
    for engine in engines {
        engine.shutdown().await;
    }
    result
}

async fn measure_peer(
    column: &Column<'_>,
    peer: Peer,
    router_urls: &[String],
    engine_urls: &[String],
) -> anyhow::Result<RunReport> {
    let (settings, oracle, client) = (column.settings, column.oracle, column.client);
    let time_scale = settings.time_scale();
    let per_engine_before = scrape_each(client, engine_urls).await?;
    let targets = router_urls
        .iter()
        .map(|url| format!("{url}/v1/chat/completions").parse::<http::Uri>())
        .collect::<Result<Vec<_>, _>>()?;
    let output = column
        .run(targets, settings.sim.served_model_name.clone())
        .await?;
    let per_engine: Vec<EngineCounters> = scrape_each(client, engine_urls)
        .await?
        .iter()
        .zip(&per_engine_before)
        .map(|(after, before)| after.since(before))
        .collect();
    let mut engines = EngineCounters::default();
    for counters in &per_engine {
        engines.add(counters);
    }
    let mut stats = RunStats::from_output(&output, time_scale);
    let served: f64 = per_engine
        .iter()
        .map(|counters| counters.requests_success)
        .sum();
    stats.instance_shares = per_engine
        .iter()
        .enumerate()
        .map(|(index, counters)| InstanceShare {
            instance: format!("engine-{index}"),
            requests: counters.requests_success.round() as u64,
            share: counters.requests_success / served.max(1.0),
        })
        .collect();
    let kv_from_usage = KvStats::from_usage(&stats, Some(oracle));
    let report = RunReport {
        peer: Some(peer.name().to_owned()),
        kv: Some(KvStats::from_engines(&engines, Some(oracle))),
        kv_from_usage,
        ..RunReport::client_side(column.label.to_owned(), column.routers, stats)
    };
    progress_line(settings, &report);
    Ok(report)
}

async fn scrape_each(client: &HttpClient, urls: &[String]) -> anyhow::Result<Vec<EngineCounters>> {
    let mut each = Vec::with_capacity(urls.len());
    for url in urls {
        let samples = scrape(client, &metrics_url(url)).await?;
        each.push(EngineCounters::from_samples(&samples));
    }
    Ok(each)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Outcome;
    use crate::run::Measured;
    use crate::workload::{RequestClass, Session, TraceRequest, WorkloadKind, WorkloadSpec};

    fn request(group: Option<u32>) -> TraceRequest {
        TraceRequest {
            messages: Vec::new(),
            max_tokens: 1,
            class: RequestClass::Long,
            group,
        }
    }

    fn measured(session: usize, turn: usize, target: usize, sent_ms: u64, us: u64) -> Measured {
        Measured {
            session,
            turn,
            class: RequestClass::Long,
            target,
            sent: Duration::from_millis(sent_ms),
            outcome: Outcome {
                decision_us: Some(us),
                ..Outcome::default()
            },
        }
    }

    #[test]
    fn a_prefix_counts_as_seen_once_a_request_of_it_was_decided_by_that_router() {
        let trace = Trace {
            spec: WorkloadSpec::defaults(WorkloadKind::LongContext),
            sessions: vec![
                Session {
                    requests: vec![request(Some(7))],
                },
                Session {
                    requests: vec![request(Some(7))],
                },
                Session {
                    requests: vec![request(Some(7))],
                },
                Session {
                    requests: vec![request(Some(7))],
                },
                Session {
                    requests: vec![request(None), request(None)],
                },
            ],
        };
        let output = RunOutput {
            measured: vec![
                // Decided at 5 ms.
                measured(0, 0, 0, 0, 5_000),
                // Sent while the first was still being decided: not seen yet.
                measured(1, 0, 0, 1, 3_000),
                // After: seen.
                measured(2, 0, 0, 10, 100),
                // Another router: not seen there.
                measured(3, 0, 1, 11, 4_000),
                // A session's second turn at the router of its first.
                measured(4, 0, 1, 20, 2_000),
                measured(4, 1, 1, 30, 200),
            ],
            wall: Duration::from_secs(1),
            complete: true,
        };
        let (all, seen, first) = decision_split(&trace, &output);
        assert_eq!(all.unwrap().count, 6.0);
        let seen = seen.unwrap();
        assert_eq!(seen.count, 2.0);
        // The third request (0.1 ms) and the second turn (0.2 ms).
        assert!((seen.mean_ms - 0.15).abs() < 1e-9, "{seen:?}");
        assert_eq!(first.unwrap().count, 4.0);
    }
}
