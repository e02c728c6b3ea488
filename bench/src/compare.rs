//! `switchyard-bench compare` (and `switchyard demo`): the same trace through RANDOM,
//! LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE (SageMaker's semantics, and with Switchyard's
//! bounded-load extension for each `--load-balance-factor`) and KV_AWARE (the engines
//! publishing their KV-cache events), each on a fresh in-process
//! cluster (cold caches), and optionally through peer routers in front of fresh simulated
//! engines, with 1 and with several routers, side by side with the oracle bound.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use switchyard_engine_sim::SimConfig;

use crate::agreement::{KeyShares, sample_until};
use crate::child::default_router_bin;
use crate::client::{HttpClient, http_client};
use crate::error::UsageError;
use crate::oracle::{OracleBound, oracle_bound, prompt_blocks};
use crate::output::Machine;
use crate::peer::{Peer, PeerRouters};
use crate::report::{
    Check, DecisionStats, InstanceShare, KvStats, LoadBalanceSetting, Report, RunReport, RunStats,
    Setup, WorkloadSummary, percent,
};
use crate::run::{RunConfig, run};
use crate::scrape::{EngineCounters, Histogram, metrics_url, scrape};
use crate::sim::{bench_sim, load_interval_for};
use crate::strategy::Strategy;
use crate::workload::{Trace, TraceArgs, WorkloadKind, WorkloadSpec};
use switchyard_cluster::{
    ClusterSpec, ClusterTuning, LocalCluster, kv_aware_variants_json, prefix_aware_variants_json,
    variants_json,
};

/// One column of a comparison.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arm {
    /// A SageMaker strategy, as SageMaker defines it (PREFIX_AWARE without the extension).
    Strategy(Strategy),
    /// PREFIX_AWARE with Switchyard's bounded-load extension.
    Bounded(LoadBalanceSetting),
    /// A peer router in front of the same number of fresh simulated engines.
    Peer(Peer),
}

impl Arm {
    /// The column name: the strategy, `PREFIX_AWARE c=1.25 s=2`, or the peer.
    pub fn name(self) -> String {
        match self {
            Arm::Strategy(strategy) => strategy.as_str().to_owned(),
            Arm::Bounded(balance) => balance.column_name(),
            Arm::Peer(peer) => peer.name().to_owned(),
        }
    }
}

/// Documented starting points; every flag overrides one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
pub enum Preset {
    /// The article's experiment in miniature (docs/benchmarks.md): 7 engines (one p5 each),
    /// long context (2,000 requests over 300 shared prefixes of 8,000 tokens, 32 output
    /// tokens), 16 clients, time scale 0.25, PrefixLength 4096 and ConcurrencyThreshold 10,
    /// every strategy, 1 and 4 routers. About 4.5 minutes on 2 cores in a release build.
    Article,
    /// A smoke run in seconds: 3 engines with small caches, 48 requests over 12 prefixes of
    /// 400 tokens, 4 clients, time scale 0.1, 1 router.
    Quick,
    /// Hot prefixes (docs/benchmarks.md, section 7): 7 engines, 4,000 requests over 32 shared
    /// prefixes of 8,000 tokens whose popularity follows a Zipf law (exponent 1.1), 32 output
    /// tokens, 16 clients, time scale 0.25, ConcurrencyThreshold 16; PREFIX_AWARE with
    /// SageMaker's semantics, then with LoadBalanceFactor 1.1, 1.25, 1.5 and 2 (slack 3), then
    /// the SGLang gateway (skipped if `smg` is not installed), with 1 and 4 routers. About 8
    /// minutes on 2 cores in a release build.
    Zipf,
}

/// `switchyard-bench compare` / `switchyard demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Defaults to start from (see docs/benchmarks.md); the flags below override them.
    #[arg(long, value_enum, default_value = "article")]
    pub preset: Preset,
    /// Router counts to run, comma-separated (each strategy runs once per count).
    #[arg(long, value_delimiter = ',', value_name = "N,..")]
    pub routers: Option<Vec<usize>>,
    /// Simulated engines.
    #[arg(long, value_name = "N")]
    pub engines: Option<usize>,
    /// Strategies to compare, comma-separated; the first is the baseline.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "S,..")]
    pub strategies: Option<Vec<Strategy>>,
    /// Workload (docs/benchmarks.md). Another workload than the preset's starts from that
    /// workload's defaults, keeping the preset's --requests and --seed.
    #[arg(long, value_enum)]
    pub workload: Option<WorkloadKind>,
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Closed-loop clients (with --rate: the most sessions in flight).
    #[arg(long, value_name = "C")]
    pub concurrency: Option<usize>,
    /// Open loop: new sessions per second of model time (Poisson). Default: closed loop.
    #[arg(long, value_name = "PER_S")]
    pub rate: Option<f64>,
    /// Engines' clock: 0.25 runs four times faster than the modelled GPUs. Latencies are
    /// reported in model ms = wall ms / time scale.
    #[arg(long, value_name = "X")]
    pub time_scale: Option<f64>,
    /// KV-cache blocks per engine (16 tokens each; the simulator's default is one p5's).
    #[arg(long, value_name = "BLOCKS")]
    pub kv_cache_blocks: Option<usize>,
    /// PREFIX_AWARE PrefixLength (characters of message text).
    #[arg(long, value_name = "CHARS")]
    pub prefix_length: Option<u32>,
    /// PREFIX_AWARE's ConcurrencyThreshold (fleet-wide in-flight requests per instance), and
    /// KV_AWARE's (its KvAwareRoutingConfig; LoadWeight stays at its default, 0.5).
    #[arg(long, value_name = "N")]
    pub concurrency_threshold: Option<u32>,
    /// Also run PREFIX_AWARE with Switchyard's bounded-load extension, once per factor c
    /// (1-100, comma-separated): an instance takes a prefix only below
    /// min(ConcurrencyThreshold, ceil(c × (in flight + 1) / instances) + slack).
    #[arg(long, value_delimiter = ',', value_name = "C,..")]
    pub load_balance_factor: Option<Vec<f64>>,
    /// Additive slack s of the bounded-load runs (requests, 0-1024, comma-separated: each
    /// factor runs with each slack). Default: 3, the default of LoadBalanceSlack.
    #[arg(long, value_delimiter = ',', value_name = "S,..")]
    pub load_balance_slack: Option<Vec<u32>>,
    /// Peer routers to run in front of the same simulated engines, comma-separated (sglang:
    /// the SGLang model gateway, `smg launch --policy cache_aware`). A peer whose binary is
    /// not found is skipped with a note.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "PEER,..")]
    pub peers: Option<Vec<Peer>>,
    /// No peer runs (overrides the preset's).
    #[arg(long, conflicts_with = "peers")]
    pub no_peers: bool,
    /// The SGLang gateway's `smg` binary. Default: `smg` on PATH, else target/peers/bin/smg.
    #[arg(long, value_name = "FILE")]
    pub sglang_bin: Option<PathBuf>,
    /// Run each Switchyard router as its own process, as deployed and as the peers run (the
    /// fair setting beside a peer). Default: inside this process, where the benchmark can also
    /// sample how often several routers disagree.
    #[arg(long)]
    pub router_processes: bool,
    /// The switchyard-router executable for --router-processes. Default: next to this one.
    #[arg(long, value_name = "FILE", requires = "router_processes")]
    pub router_bin: Option<PathBuf>,
    /// Stop starting sessions after this many wall seconds per run.
    #[arg(long, value_name = "SECONDS")]
    pub max_duration: Option<f64>,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write an SVG chart (hit rate, TTFT p50, instance shares).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// No progress line.
    #[arg(long)]
    pub quiet: bool,
}

/// Everything a comparison needs, after presets and flags.
#[derive(Debug, Clone)]
pub struct CompareSettings {
    pub workload: WorkloadSpec,
    pub engines: usize,
    pub router_counts: Vec<usize>,
    pub strategies: Vec<Strategy>,
    pub concurrency: usize,
    /// Open loop: sessions per second of model time.
    pub rate: Option<f64>,
    pub sim: SimConfig,
    pub prefix_length: u32,
    pub concurrency_threshold: u32,
    /// PREFIX_AWARE runs with the bounded-load extension, after `strategies`.
    pub load_balance: Vec<LoadBalanceSetting>,
    /// Peer routers, after the bounded-load runs.
    pub peers: Vec<Peer>,
    /// `smg` (default: found on PATH or in target/peers/bin).
    pub sglang_bin: Option<PathBuf>,
    /// Run Switchyard's routers as processes of this executable (default: in this process).
    pub router_binary: Option<PathBuf>,
    /// Router load reports and control-plane broadcasts (wall ms).
    pub load_interval_ms: u64,
    pub max_duration: Duration,
    pub request_timeout: Duration,
    pub progress: bool,
}

impl CompareSettings {
    /// The documented presets (docs/benchmarks.md explains each value).
    pub fn preset(preset: Preset) -> Self {
        match preset {
            Preset::Article => {
                let time_scale = 0.25;
                Self {
                    workload: WorkloadSpec {
                        requests: 2000,
                        seed: 1,
                        prefixes: 300,
                        prefix_tokens: 8000,
                        zipf: 0.0,
                        max_tokens: 32,
                        ..WorkloadSpec::defaults(WorkloadKind::LongContext)
                    },
                    engines: 7,
                    router_counts: vec![1, 4],
                    strategies: Strategy::ALL.to_vec(),
                    concurrency: 16,
                    rate: None,
                    sim: bench_sim(time_scale, 79_000),
                    // The article's example configuration.
                    prefix_length: 4096,
                    concurrency_threshold: 10,
                    load_balance: Vec::new(),
                    peers: Vec::new(),
                    sglang_bin: None,
                    router_binary: None,
                    load_interval_ms: load_interval_for(time_scale),
                    max_duration: Duration::from_secs(600),
                    request_timeout: Duration::from_secs(120),
                    progress: true,
                }
            }
            Preset::Quick => {
                let time_scale = 0.1;
                Self {
                    workload: WorkloadSpec {
                        requests: 48,
                        // Seed 3 spreads the 12 prefixes 4/5/3 over the 3 engines (with so
                        // few keys, some seeds leave an engine without any).
                        seed: 3,
                        prefixes: 12,
                        prefix_tokens: 400,
                        zipf: 0.0,
                        max_tokens: 8,
                        ..WorkloadSpec::defaults(WorkloadKind::LongContext)
                    },
                    engines: 3,
                    router_counts: vec![1],
                    strategies: Strategy::ALL.to_vec(),
                    concurrency: 4,
                    rate: None,
                    // About six prefixes' worth of blocks per engine: RANDOM (every engine
                    // sees all twelve) thrashes, PREFIX_AWARE (four per engine on average) fits.
                    sim: bench_sim(time_scale, 160),
                    prefix_length: 1024,
                    concurrency_threshold: 8,
                    load_balance: Vec::new(),
                    peers: Vec::new(),
                    sglang_bin: None,
                    router_binary: None,
                    load_interval_ms: load_interval_for(time_scale),
                    max_duration: Duration::from_secs(60),
                    request_timeout: Duration::from_secs(30),
                    progress: true,
                }
            }
            Preset::Zipf => {
                let time_scale = 0.25;
                let slack = switchyard_shared::DEFAULT_LOAD_BALANCE_SLACK;
                Self {
                    workload: WorkloadSpec {
                        requests: 4000,
                        seed: 1,
                        prefixes: 32,
                        prefix_tokens: 8000,
                        zipf: 1.1,
                        max_tokens: 32,
                        ..WorkloadSpec::defaults(WorkloadKind::LongContext)
                    },
                    engines: 7,
                    router_counts: vec![1, 4],
                    strategies: vec![Strategy::PrefixAware],
                    concurrency: 16,
                    rate: None,
                    sim: bench_sim(time_scale, 79_000),
                    prefix_length: 4096,
                    // As high as 16 clients can reach: SageMaker's semantics never spill here.
                    concurrency_threshold: 16,
                    load_balance: [1.1, 1.25, 1.5, 2.0]
                        .into_iter()
                        .map(|factor| LoadBalanceSetting { factor, slack })
                        .collect(),
                    peers: vec![Peer::Sglang],
                    sglang_bin: None,
                    router_binary: None,
                    load_interval_ms: load_interval_for(time_scale),
                    max_duration: Duration::from_secs(600),
                    request_timeout: Duration::from_secs(120),
                    progress: true,
                }
            }
        }
    }

    pub fn time_scale(&self) -> f64 {
        self.sim.time_scale
    }

    /// Every column, in run order: the strategies, the bounded-load runs, the peers.
    pub fn arms(&self) -> Vec<Arm> {
        self.strategies
            .iter()
            .map(|strategy| Arm::Strategy(*strategy))
            .chain(
                self.load_balance
                    .iter()
                    .map(|balance| Arm::Bounded(*balance)),
            )
            .chain(self.peers.iter().map(|peer| Arm::Peer(*peer)))
            .collect()
    }

    pub fn validate(&self) -> Result<(), String> {
        self.workload.validate()?;
        self.sim.validate()?;
        if self.engines == 0 {
            return Err("--engines must be at least 1".into());
        }
        if self.router_counts.is_empty() || self.router_counts.contains(&0) {
            return Err("--routers must list router counts of at least 1".into());
        }
        if self.strategies.is_empty() && self.load_balance.is_empty() && self.peers.is_empty() {
            return Err("--strategies must name at least one strategy".into());
        }
        for balance in &self.load_balance {
            if !switchyard_shared::LOAD_BALANCE_FACTOR_RANGE.contains(&balance.factor) {
                return Err(format!(
                    "--load-balance-factor must be within 1-100, got {}",
                    balance.factor
                ));
            }
            if !switchyard_shared::LOAD_BALANCE_SLACK_RANGE.contains(&balance.slack) {
                return Err(format!(
                    "--load-balance-slack must be within 0-1024, got {}",
                    balance.slack
                ));
            }
        }
        if self.concurrency == 0 {
            return Err("--concurrency must be at least 1".into());
        }
        if let Some(rate) = self.rate
            && !(rate.is_finite() && rate > 0.0)
        {
            return Err(format!("--rate must be a positive number, got {rate}"));
        }
        if !(1024..=65536).contains(&self.prefix_length) {
            return Err(format!(
                "--prefix-length must be within 1024-65536, got {}",
                self.prefix_length
            ));
        }
        if !(1..=1024).contains(&self.concurrency_threshold) {
            return Err(format!(
                "--concurrency-threshold must be within 1-1024, got {}",
                self.concurrency_threshold
            ));
        }
        Ok(())
    }
}

impl DemoArgs {
    /// The preset with every given flag applied, validated (the error names the flag).
    pub fn settings(&self) -> Result<CompareSettings, String> {
        let mut settings = CompareSettings::preset(self.preset);
        if let Some(kind) = self.workload
            && kind != settings.workload.kind
        {
            let defaults = WorkloadSpec::defaults(kind);
            settings.workload = WorkloadSpec {
                requests: settings.workload.requests,
                seed: settings.workload.seed,
                ..defaults
            };
        }
        let workload = &mut settings.workload;
        self.trace.apply(workload);
        if let Some(routers) = &self.routers {
            settings.router_counts = routers.clone();
        }
        if let Some(engines) = self.engines {
            settings.engines = engines;
        }
        if let Some(strategies) = &self.strategies {
            settings.strategies = strategies.clone();
        }
        if let Some(concurrency) = self.concurrency {
            settings.concurrency = concurrency;
        }
        if self.rate.is_some() {
            settings.rate = self.rate;
        }
        if let Some(time_scale) = self.time_scale {
            settings.sim.time_scale = time_scale;
            settings.load_interval_ms = load_interval_for(time_scale);
        }
        if let Some(blocks) = self.kv_cache_blocks {
            settings.sim.kv_cache_blocks = blocks;
        }
        if let Some(length) = self.prefix_length {
            settings.prefix_length = length;
        }
        if let Some(threshold) = self.concurrency_threshold {
            settings.concurrency_threshold = threshold;
        }
        match (&self.load_balance_factor, &self.load_balance_slack) {
            (None, Some(_)) if settings.load_balance.is_empty() => {
                return Err("--load-balance-slack needs --load-balance-factor".into());
            }
            (factors, slacks) if factors.is_some() || slacks.is_some() => {
                let factors: Vec<f64> = match factors {
                    Some(factors) => factors.clone(),
                    None => settings.load_balance.iter().map(|b| b.factor).collect(),
                };
                let slacks = slacks
                    .clone()
                    .unwrap_or_else(|| vec![switchyard_shared::DEFAULT_LOAD_BALANCE_SLACK]);
                settings.load_balance = factors
                    .iter()
                    .flat_map(|&factor| {
                        slacks
                            .iter()
                            .map(move |&slack| LoadBalanceSetting { factor, slack })
                    })
                    .collect();
            }
            _ => {}
        }
        if let Some(peers) = &self.peers {
            settings.peers = peers.clone();
        }
        if self.no_peers {
            settings.peers.clear();
        }
        if self.sglang_bin.is_some() {
            settings.sglang_bin = self.sglang_bin.clone();
        }
        if self.router_processes {
            let binary = self
                .router_bin
                .clone()
                .or_else(default_router_bin)
                .ok_or_else(|| {
                    "--router-processes: no switchyard-router next to this executable (build it: cargo build --release -p switchyard-router), or give --router-bin".to_owned()
                })?;
            if !binary.is_file() {
                return Err(format!("--router-bin {}: no such file", binary.display()));
            }
            settings.router_binary = Some(binary);
        }
        if let Some(seconds) = self.max_duration {
            if !(seconds.is_finite() && seconds > 0.0) {
                return Err(format!("--max-duration must be positive, got {seconds}"));
            }
            settings.max_duration = Duration::from_secs_f64(seconds);
        }
        settings.progress = !self.quiet;
        settings.validate()?;
        Ok(settings)
    }
}

/// Runs the comparison `args` describes, prints the table, writes the JSON and SVG files.
pub async fn demo(args: DemoArgs) -> anyhow::Result<Report> {
    let settings = args.settings().map_err(UsageError)?;
    let report = compare(&settings).await?;
    report.emit(args.json.as_deref(), args.svg.as_deref())?;
    Ok(report)
}

/// Generates the trace and its oracle bound, then runs every (router count, strategy) on a
/// fresh cluster.
pub async fn compare(settings: &CompareSettings) -> anyhow::Result<Report> {
    settings.validate().map_err(UsageError)?;
    let time_scale = settings.time_scale();
    let spec = settings.workload.clone();
    let concurrency = settings.concurrency;
    let capacity = (settings.engines * settings.sim.kv_cache_blocks) as u64;
    let block_size = settings.sim.block_size;
    if settings.progress {
        eprintln!("generating the {} trace and its oracle bound…", spec.kind);
    }
    let (trace, oracle, workload) =
        tokio::task::spawn_blocking(move || prepare(&spec, concurrency, capacity, block_size))
            .await
            .context("trace generation failed")??;
    let trace = Arc::new(trace);
    let client = http_client();

    let keys = Arc::new(trace_key_shares(
        &trace,
        "bench",
        settings.prefix_length as usize,
    ));
    let mut notes = Vec::new();
    if let Some(binary) = &settings.router_binary {
        notes.push(format!(
            "Switchyard's routers ran as processes of {} (--router-processes): no disagreement sampling",
            binary.display()
        ));
    }
    let mut arms = settings.arms();
    arms.retain(|arm| match arm {
        Arm::Peer(peer) if peer_binary(settings, *peer).is_none() => {
            let note = format!(
                "{}: skipped, `{}` not found (install it: {}; or give --sglang-bin)",
                peer.name(),
                peer.binary_name(),
                peer.install_hint()
            );
            if settings.progress {
                eprintln!("{note}");
            }
            notes.push(note);
            false
        }
        _ => true,
    });
    let mut runs = Vec::new();
    for &routers in &settings.router_counts {
        for &arm in &arms {
            let label = format!(
                "{} · {routers} router{}",
                arm.name(),
                if routers == 1 { "" } else { "s" }
            );
            // Boxed: a run is a large future.
            let run = match arm {
                Arm::Peer(peer) => {
                    Box::pin(run_peer(
                        settings, peer, routers, &label, &trace, &oracle, &client,
                    ))
                    .await
                }
                Arm::Strategy(_) | Arm::Bounded(_) => {
                    Box::pin(run_one(
                        settings, arm, routers, &label, &trace, &oracle, &keys, &client,
                    ))
                    .await
                }
            }
            .with_context(|| format!("run {label}"))?;
            runs.push(run);
        }
    }
    // Each router group is compared with its first column.
    for routers in &settings.router_counts {
        let base = runs.iter().find(|run| run.routers == *routers).cloned();
        let group = runs.iter().filter(|run| run.routers == *routers).count();
        if let Some(base) = base
            && group > 1
        {
            for run in runs.iter_mut().filter(|run| run.routers == *routers) {
                run.compare_to(&base);
            }
        }
    }

    let mut report = Report {
        tool: "switchyard-bench".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        mode: "compare".into(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: Machine::current(),
        workload,
        time_scale,
        concurrency: settings.concurrency,
        rate: settings.rate,
        setup: Some(Setup {
            engines: settings.engines,
            kv_cache_blocks: settings.sim.kv_cache_blocks,
            block_size: settings.sim.block_size,
            prefill_tokens_per_s: settings.sim.prefill_tokens_per_s,
            prefix_length: settings.prefix_length,
            concurrency_threshold: settings.concurrency_threshold,
            load_interval_ms: settings.load_interval_ms,
        }),
        oracle: Some(oracle),
        runs,
        prefix_owner_shares: Vec::new(),
        checks: Vec::new(),
        notes,
    };
    if settings.strategies.contains(&Strategy::PrefixAware) || !settings.load_balance.is_empty() {
        report.prefix_owner_shares = prefix_owner_shares(
            &trace,
            "bench",
            settings.prefix_length as usize,
            settings.engines,
        );
    }
    report.checks = checks(&report, settings.engines);
    report
        .checks
        .extend(hot_prefix_checks(&report, settings.engines));
    for run in &report.runs {
        if run
            .instances_routable_at_end
            .iter()
            .any(|&count| count != settings.engines)
        {
            report.notes.push(format!(
                "{}: routers saw {:?} of {} instances at the end (health checks failed?)",
                run.label, run.instances_routable_at_end, settings.engines
            ));
        }
        if !run.stats.complete {
            report.notes.push(format!(
                "{}: the time limit stopped the run after {} of {} requests",
                run.label, run.stats.requests, report.workload.spec.requests
            ));
        }
    }
    Ok(report)
}

/// The share of the trace's requests whose prefix each instance `engine-0..N` owns in
/// PREFIX_AWARE's rendezvous order (the placement before any overflow), computed with the
/// router's own prefix extraction, routing key and ranking.
pub fn prefix_owner_shares(
    trace: &Trace,
    model: &str,
    prefix_length: usize,
    engines: usize,
) -> Vec<InstanceShare> {
    use switchyard_policy::hash::instance_hash;
    use switchyard_policy::rank::{InstanceView, rendezvous_order};
    let ids: Vec<String> = (0..engines)
        .map(|index| format!("engine-{index}"))
        .collect();
    let views: Vec<InstanceView> = ids
        .iter()
        .map(|id| InstanceView {
            id_hash: instance_hash(id),
            weight: 1.0,
            available: true,
        })
        .collect();
    let mut owned = vec![0.0f64; engines];
    let mut order = Vec::with_capacity(engines);
    for (key, share) in trace_key_shares(trace, model, prefix_length).0 {
        if let Some(owner) = rendezvous_order(&views, key, &mut order) {
            owned[owner] += share;
        }
    }
    let requests = trace.request_count() as f64;
    ids.into_iter()
        .zip(owned)
        .map(|(instance, share)| InstanceShare {
            instance,
            requests: (share * requests).round() as u64,
            share,
        })
        .collect()
}

/// The trace's PREFIX_AWARE routing keys (no prefix-aware id), each with its share of the
/// requests, computed with the router's own prefix extraction and key.
pub fn trace_key_shares(trace: &Trace, model: &str, prefix_length: usize) -> KeyShares {
    use switchyard_policy::hash::routing_key;
    use switchyard_policy::openai::OpenAiRequest;
    let mut counts: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    for request in trace.requests() {
        let body = request.body(model);
        let Ok(parsed) = OpenAiRequest::parse(&body) else {
            continue;
        };
        let key = routing_key(b"", parsed.prefix_text(prefix_length).as_bytes());
        *counts.entry(key).or_default() += 1;
    }
    let total = counts.values().sum::<u64>().max(1) as f64;
    KeyShares(
        counts
            .into_iter()
            .map(|(key, count)| (key, count as f64 / total))
            .collect(),
    )
}

/// Generates the trace, tokenizes it in nominal order, and computes the oracle bound.
pub fn prepare(
    spec: &WorkloadSpec,
    concurrency: usize,
    capacity_blocks: u64,
    block_size: usize,
) -> anyhow::Result<(Trace, OracleBound, WorkloadSummary)> {
    let trace = Trace::generate(spec).map_err(UsageError)?;
    let texts: Vec<String> = trace
        .nominal_order(concurrency)
        .into_iter()
        .map(|request| request.prompt_text())
        .collect();
    let prompts = prompt_blocks(&texts, block_size);
    let oracle = oracle_bound(&prompts, capacity_blocks, block_size);
    let requests = trace.request_count();
    let workload = WorkloadSummary {
        spec: spec.clone(),
        sessions: trace.sessions.len(),
        prompt_tokens: oracle.prompt_tokens,
        mean_prompt_tokens: oracle.prompt_tokens as f64 / requests.max(1) as f64,
    };
    Ok((trace, oracle, workload))
}

async fn scrape_engines(client: &HttpClient, urls: &[String]) -> anyhow::Result<EngineCounters> {
    let mut total = EngineCounters::default();
    for url in urls {
        let samples = scrape(client, &metrics_url(url)).await?;
        total.add(&EngineCounters::from_samples(&samples));
    }
    Ok(total)
}

/// The routers' histograms, summed: decision time, and KV_AWARE's `/tokenize` round trip.
#[derive(Debug, Default)]
struct RouterHistograms {
    decision: Histogram,
    tokenize: Histogram,
}

impl RouterHistograms {
    fn since(&self, before: &Self) -> Self {
        Self {
            decision: self.decision.since(&before.decision),
            tokenize: self.tokenize.since(&before.tokenize),
        }
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
    }
    Ok(total)
}

/// The `smg` (or other peer) binary to run, if there is one.
fn peer_binary(settings: &CompareSettings, peer: Peer) -> Option<std::path::PathBuf> {
    match peer {
        Peer::Sglang => peer.find_binary(settings.sglang_bin.as_deref()),
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
        Arm::Strategy(Strategy::KvAware) => kv_aware_variants_json(settings.concurrency_threshold),
        Arm::Strategy(strategy) => variants_json(strategy.as_str(), None),
        Arm::Peer(_) => String::new(),
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_one(
    settings: &CompareSettings,
    arm: Arm,
    routers: usize,
    label: &str,
    trace: &Arc<Trace>,
    oracle: &OracleBound,
    keys: &KeyShares,
    client: &HttpClient,
) -> anyhow::Result<RunReport> {
    let mut sim = settings.sim.clone();
    if arm == Arm::Strategy(Strategy::KvAware) {
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
        ..ClusterTuning::default()
    };
    let cluster = LocalCluster::start_with(spec, tuning).await?;
    // Boxed: the run and the sampler side by side make a large future.
    let result = Box::pin(measure(
        settings, arm, routers, label, trace, oracle, keys, client, &cluster,
    ))
    .await;
    cluster.shutdown().await;
    result
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    settings: &CompareSettings,
    arm: Arm,
    routers: usize,
    label: &str,
    trace: &Arc<Trace>,
    oracle: &OracleBound,
    keys: &KeyShares,
    client: &HttpClient,
    cluster: &LocalCluster,
) -> anyhow::Result<RunReport> {
    let time_scale = settings.time_scale();
    let engines_before = scrape_engines(client, &cluster.engine_urls).await?;
    let decisions_before = scrape_routers(client, &cluster.router_urls).await?;
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
    let config = RunConfig {
        targets,
        model: cluster.endpoint.clone(),
        concurrency: settings.concurrency,
        rate: settings.rate.map(|rate| rate / time_scale),
        seed: settings.workload.seed,
        request_timeout: settings.request_timeout,
        max_duration: settings.max_duration,
        label: label.to_owned(),
        progress: settings.progress,
    };
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
        let output = run(Arc::clone(trace), config, client.clone()).await;
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
    let mut stats = RunStats::from_output(&output, time_scale);
    stats.include_idle_instances(&cluster.instance_ids());
    let kv_from_usage = KvStats::from_usage(&stats, Some(oracle));
    let report = RunReport {
        label: label.to_owned(),
        strategy: match arm {
            Arm::Strategy(strategy) => Some(strategy.as_str().to_owned()),
            Arm::Bounded(_) => Some(Strategy::PrefixAware.as_str().to_owned()),
            Arm::Peer(_) => None,
        },
        load_balance: match arm {
            Arm::Bounded(balance) => Some(balance),
            _ => None,
        },
        peer: None,
        routers,
        kv: Some(KvStats::from_engines(&engines, Some(oracle))),
        kv_from_usage,
        router_decision: DecisionStats::from_histogram(&decisions.decision),
        kv_tokenize: (decisions.tokenize.count > 0.0)
            .then(|| DecisionStats::from_histogram(&decisions.tokenize))
            .flatten(),
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
async fn run_peer(
    settings: &CompareSettings,
    peer: Peer,
    routers: usize,
    label: &str,
    trace: &Arc<Trace>,
    oracle: &OracleBound,
    client: &HttpClient,
) -> anyhow::Result<RunReport> {
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
    let result = match PeerRouters::start(peer, &binary, routers, &engine_urls, client).await {
        Ok(peers) => {
            let result = measure_peer(
                settings,
                peer,
                routers,
                label,
                trace,
                oracle,
                client,
                &peers.urls,
                &engine_urls,
            )
            .await;
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

#[allow(clippy::too_many_arguments)]
async fn measure_peer(
    settings: &CompareSettings,
    peer: Peer,
    routers: usize,
    label: &str,
    trace: &Arc<Trace>,
    oracle: &OracleBound,
    client: &HttpClient,
    router_urls: &[String],
    engine_urls: &[String],
) -> anyhow::Result<RunReport> {
    let time_scale = settings.time_scale();
    let per_engine_before = scrape_each(client, engine_urls).await?;
    let targets = router_urls
        .iter()
        .map(|url| format!("{url}/v1/chat/completions").parse::<http::Uri>())
        .collect::<Result<Vec<_>, _>>()?;
    let config = RunConfig {
        targets,
        model: settings.sim.served_model_name.clone(),
        concurrency: settings.concurrency,
        rate: settings.rate.map(|rate| rate / time_scale),
        seed: settings.workload.seed,
        request_timeout: settings.request_timeout,
        max_duration: settings.max_duration,
        label: label.to_owned(),
        progress: settings.progress,
    };
    let output = run(Arc::clone(trace), config, client.clone()).await?;
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
    let report = RunReport {
        label: label.to_owned(),
        strategy: None,
        load_balance: None,
        peer: Some(peer.name().to_owned()),
        routers,
        kv: Some(KvStats::from_engines(&engines, Some(oracle))),
        kv_from_usage: KvStats::from_usage(&stats, Some(oracle)),
        router_decision: None,
        kv_tokenize: None,
        versus_baseline: None,
        instances_routable_at_end: Vec::new(),
        disagreement: None,
        stats,
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

/// The product targets (PRODUCT.md), checked on the PREFIX_AWARE runs: hit rate against the
/// oracle and TTFT against RANDOM for long shared prefixes (the long-context workload),
/// instance shares and 1 vs several routers for any workload.
pub fn checks(report: &Report, engines: usize) -> Vec<Check> {
    let mut checks = Vec::new();
    let long_context = report.workload.spec.kind == WorkloadKind::LongContext;
    let prefix_runs: Vec<&RunReport> = report
        .runs
        .iter()
        .filter(|run| {
            run.strategy.as_deref() == Some(Strategy::PrefixAware.as_str())
                && run.load_balance.is_none()
        })
        .collect();
    for run in &prefix_runs {
        let routers = format!(
            "{} router{}",
            run.routers,
            if run.routers == 1 { "" } else { "s" }
        );
        if let Some(fraction) = run.kv.and_then(|kv| kv.fraction_of_oracle)
            && long_context
        {
            checks.push(Check {
                what: format!("PREFIX_AWARE hit rate / oracle, {routers}"),
                target: ">= 90%".into(),
                measured: percent(fraction),
                pass: fraction >= 0.9,
            });
        }
        if let Some(change) = run
            .versus_baseline
            .as_ref()
            .and_then(|versus| versus.ttft_p50_change)
            && run
                .versus_baseline
                .as_ref()
                .is_some_and(|versus| versus.baseline != run.label)
            && long_context
        {
            checks.push(Check {
                what: format!("TTFT p50 change vs RANDOM, {routers}"),
                target: "<= -77%".into(),
                measured: format!("{:+.1}%", change * 100.0),
                pass: change <= -0.77,
            });
        }
        if let Some((min, max)) = run.stats.share_range() {
            let even = 1.0 / engines as f64;
            let off = (min - even).abs().max((max - even).abs());
            checks.push(Check {
                what: format!("PREFIX_AWARE instance shares, {routers}"),
                target: format!("within 1 point of {}", percent(even)),
                measured: format!("{}-{}", percent(min), percent(max)),
                pass: off <= 0.01,
            });
        }
    }
    if let (Some(first), Some(last)) = (prefix_runs.first(), prefix_runs.last())
        && first.routers != last.routers
        && let (Some(one), Some(many)) = (first.hit_rate(), last.hit_rate())
    {
        checks.push(Check {
            what: format!(
                "PREFIX_AWARE hit rate, {} routers vs {}",
                last.routers, first.routers
            ),
            target: "no drop (within 1 point)".into(),
            measured: format!("{} vs {}", percent(many), percent(one)),
            pass: many >= one - 0.01,
        });
    }
    checks.extend(kv_aware_checks(report));
    checks
}

/// KV_AWARE's targets (issue 10), on any workload: hit rate ≥ 95% of the oracle with every
/// router count, and several routers no worse than one (within 1 point).
pub fn kv_aware_checks(report: &Report) -> Vec<Check> {
    let mut checks = Vec::new();
    let kv_runs: Vec<&RunReport> = report
        .runs
        .iter()
        .filter(|run| run.strategy.as_deref() == Some(Strategy::KvAware.as_str()))
        .collect();
    for run in &kv_runs {
        if let Some(fraction) = run.kv.and_then(|kv| kv.fraction_of_oracle) {
            checks.push(Check {
                what: format!(
                    "KV_AWARE hit rate / oracle, {} router{}",
                    run.routers,
                    if run.routers == 1 { "" } else { "s" }
                ),
                target: ">= 95%".into(),
                measured: percent(fraction),
                pass: fraction >= 0.95,
            });
        }
    }
    if let (Some(first), Some(last)) = (kv_runs.first(), kv_runs.last())
        && first.routers != last.routers
        && let (Some(one), Some(many)) = (first.hit_rate(), last.hit_rate())
    {
        checks.push(Check {
            what: format!(
                "KV_AWARE hit rate, {} routers vs {}",
                last.routers, first.routers
            ),
            target: "no drop (within 1 point)".into(),
            measured: format!("{} vs {}", percent(many), percent(one)),
            pass: many >= one - 0.01,
        });
    }
    checks
}

/// The hot-prefix targets (PRODUCT.md, issue 12), checked on the bounded-load runs against
/// plain PREFIX_AWARE and the SGLang gateway of the same router count: with 1 router,
/// throughput at least the gateway's, hit rate within 2 points of plain PREFIX_AWARE, and the
/// least used instance at least half a fair share; with several, hit rate ≥ 90% of the oracle.
pub fn hot_prefix_checks(report: &Report, engines: usize) -> Vec<Check> {
    let mut checks = Vec::new();
    for routers in report.router_groups() {
        let group: Vec<&RunReport> = report
            .runs
            .iter()
            .filter(|run| run.routers == routers)
            .collect();
        let plain = group.iter().find(|run| {
            run.strategy.as_deref() == Some(Strategy::PrefixAware.as_str())
                && run.load_balance.is_none()
        });
        let peer = group
            .iter()
            .find(|run| run.peer.as_deref() == Some(Peer::Sglang.name()));
        for run in group.iter().filter(|run| run.load_balance.is_some()) {
            let name = run.column();
            let routers_text = format!("{routers} router{}", if routers == 1 { "" } else { "s" });
            if routers == 1 {
                if let Some(peer) = peer {
                    let (ours, theirs) = (
                        run.stats.requests_per_s_wall,
                        peer.stats.requests_per_s_wall,
                    );
                    checks.push(Check {
                        what: format!("{name} throughput vs the SGLang gateway, {routers_text}"),
                        target: ">= 100%".into(),
                        measured: percent(ours / theirs.max(f64::MIN_POSITIVE)),
                        pass: ours >= theirs,
                    });
                }
                if let (Some(plain), Some(hit)) = (plain, run.hit_rate())
                    && let Some(plain_hit) = plain.hit_rate()
                {
                    checks.push(Check {
                        what: format!("{name} hit rate vs plain PREFIX_AWARE, {routers_text}"),
                        target: "within 2 points".into(),
                        measured: format!("{} vs {}", percent(hit), percent(plain_hit)),
                        pass: hit >= plain_hit - 0.02,
                    });
                }
                if let Some((min, _)) = run.stats.share_range() {
                    let half_fair = 0.5 / engines as f64;
                    checks.push(Check {
                        what: format!("{name} least used instance's share, {routers_text}"),
                        target: format!(">= half a fair share ({})", percent(half_fair)),
                        measured: percent(min),
                        pass: min >= half_fair,
                    });
                }
            } else if let Some(fraction) = run.kv.and_then(|kv| kv.fraction_of_oracle) {
                checks.push(Check {
                    what: format!("{name} hit rate / oracle, {routers_text}"),
                    target: ">= 90%".into(),
                    measured: percent(fraction),
                    pass: fraction >= 0.9,
                });
            }
        }
    }
    checks
}
