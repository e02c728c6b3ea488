//! What a comparison runs: the documented presets, and the columns (arms) it compares.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use switchyard_engine_sim::SimConfig;

use crate::peer::Peer;
use crate::report::LoadBalanceSetting;
use crate::sim::{bench_sim, load_interval_for};
use crate::strategy::Strategy;
use crate::workload::{WorkloadError, WorkloadKind, WorkloadSpec};

/// One column of a comparison.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arm {
    /// A SageMaker strategy, as SageMaker defines it (PREFIX_AWARE without the extension).
    Strategy(Strategy),
    /// PREFIX_AWARE with Switchyard's bounded-load extension.
    Bounded(LoadBalanceSetting),
    /// A peer router in front of the same number of fresh simulated engines.
    Peer(Peer),
    /// KV_AWARE with a router tokenizer whose piece cache is off (every prompt tokenized
    /// whole): what the cache saves.
    KvNoPieceCache,
}

impl Arm {
    /// The column name: the strategy, `PREFIX_AWARE c=1.25 s=2`, or the peer.
    pub fn name(self) -> String {
        match self {
            Arm::Strategy(strategy) => strategy.as_str().to_owned(),
            Arm::Bounded(balance) => balance.column_name(),
            Arm::Peer(peer) => peer.name().to_owned(),
            Arm::KvNoPieceCache => format!("{} no piece cache", Strategy::KvAware.as_str()),
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
    /// both SGLang gateways (each skipped if not installed), with 1 and 4 routers. About 8
    /// minutes on 2 cores in a release build.
    Zipf,
    /// Hot prefixes as an independent load generator shaped them (issue 28, docs/benchmarks.md
    /// section 7): 7 engines at real speed, 400 streamed chat requests from 16 clients, each a
    /// system message holding one of 24 shared prefixes of 32,000 characters drawn with Zipf
    /// weights 1/rank and a distinct question, 16-token answers; PREFIX_AWARE with
    /// PrefixLength 4096 and ConcurrencyThreshold 16, with SageMaker's semantics and with
    /// LoadBalanceFactor 2 (slack 3), then both SGLang gateways, with 1 and 4 routers. About
    /// 2 minutes on 2 cores in a release build.
    #[value(name = "hot-prefixes")]
    HotPrefixes,
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
    /// `sglang-router`'s `smg` (default: found by [`Peer::find_binary`]).
    pub sglang_bin: Option<PathBuf>,
    /// The `smg` package's `smg` (default: found by [`Peer::find_binary`]).
    pub smg_bin: Option<PathBuf>,
    /// Run Switchyard's routers as processes of this executable (default: in this process).
    pub router_binary: Option<PathBuf>,
    /// With a `sim.tokenizer`: KV_AWARE runs a second time with its routers' piece cache off.
    pub kv_without_piece_cache: bool,
    /// The routers' `--tokenize-check-fraction` (None: the router's default).
    pub tokenize_check_fraction: Option<f64>,
    /// Router load reports and control-plane broadcasts (wall ms).
    pub load_interval_ms: u64,
    pub max_duration: Duration,
    pub request_timeout: Duration,
    pub progress: bool,
}

impl CompareSettings {
    /// The documented presets (docs/benchmarks.md explains each value).
    pub fn preset(preset: Preset) -> Self {
        let article = Self::article();
        match preset {
            Preset::Article => article,
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
                        max_tokens: 8,
                        ..article.workload
                    },
                    engines: 3,
                    router_counts: vec![1],
                    concurrency: 4,
                    // About six prefixes' worth of blocks per engine: RANDOM (every engine
                    // sees all twelve) thrashes, PREFIX_AWARE (four per engine on average) fits.
                    sim: bench_sim(time_scale, 160),
                    prefix_length: 1024,
                    concurrency_threshold: 8,
                    load_interval_ms: load_interval_for(time_scale),
                    max_duration: Duration::from_secs(60),
                    request_timeout: Duration::from_secs(30),
                    ..article
                }
            }
            Preset::Zipf => {
                let slack = switchyard_shared::DEFAULT_LOAD_BALANCE_SLACK;
                Self {
                    workload: WorkloadSpec {
                        requests: 4000,
                        prefixes: 32,
                        zipf: 1.1,
                        ..article.workload
                    },
                    strategies: vec![Strategy::PrefixAware],
                    // As high as 16 clients can reach: SageMaker's semantics never spill here.
                    concurrency_threshold: 16,
                    load_balance: [1.1, 1.25, 1.5, 2.0]
                        .into_iter()
                        .map(|factor| LoadBalanceSetting { factor, slack })
                        .collect(),
                    peers: vec![Peer::Sglang, Peer::Smg],
                    ..article
                }
            }
            Preset::HotPrefixes => {
                let time_scale = 1.0;
                Self {
                    workload: WorkloadSpec {
                        requests: 400,
                        prefixes: 24,
                        prefix_chars: Some(32_000),
                        zipf: 1.0,
                        max_tokens: 16,
                        ..article.workload
                    },
                    strategies: vec![Strategy::PrefixAware],
                    concurrency_threshold: 16,
                    load_balance: vec![LoadBalanceSetting {
                        factor: 2.0,
                        slack: switchyard_shared::DEFAULT_LOAD_BALANCE_SLACK,
                    }],
                    peers: vec![Peer::Sglang, Peer::Smg],
                    sim: bench_sim(time_scale, 79_000),
                    load_interval_ms: load_interval_for(time_scale),
                    ..article
                }
            }
        }
    }

    /// The article preset, which the others change.
    fn article() -> Self {
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
            smg_bin: None,
            router_binary: None,
            kv_without_piece_cache: false,
            tokenize_check_fraction: None,
            load_interval_ms: load_interval_for(time_scale),
            max_duration: Duration::from_secs(600),
            request_timeout: Duration::from_secs(120),
            progress: true,
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
            .chain(
                (self.kv_without_piece_cache
                    && self.sim.tokenizer.is_some()
                    && self.strategies.contains(&Strategy::KvAware))
                .then_some(Arm::KvNoPieceCache),
            )
            .chain(self.peers.iter().map(|peer| Arm::Peer(*peer)))
            .collect()
    }

    pub fn validate(&self) -> Result<(), SettingsError> {
        self.workload.validate()?;
        self.sim.validate()?;
        if self.engines == 0 {
            return Err(SettingsError::NoEngines);
        }
        if self.router_counts.is_empty() || self.router_counts.contains(&0) {
            return Err(SettingsError::RouterCounts);
        }
        if self.strategies.is_empty() && self.load_balance.is_empty() && self.peers.is_empty() {
            return Err(SettingsError::NoStrategy);
        }
        for balance in &self.load_balance {
            if !switchyard_shared::LOAD_BALANCE_FACTOR_RANGE.contains(&balance.factor) {
                return Err(SettingsError::LoadBalanceFactor(balance.factor));
            }
            if !switchyard_shared::LOAD_BALANCE_SLACK_RANGE.contains(&balance.slack) {
                return Err(SettingsError::LoadBalanceSlack(balance.slack));
            }
        }
        if self.concurrency == 0 {
            return Err(SettingsError::NoConcurrency);
        }
        if let Some(rate) = self.rate
            && !(rate.is_finite() && rate > 0.0)
        {
            return Err(SettingsError::Rate(rate));
        }
        if !(1024..=65536).contains(&self.prefix_length) {
            return Err(SettingsError::PrefixLength(self.prefix_length));
        }
        if !(1..=1024).contains(&self.concurrency_threshold) {
            return Err(SettingsError::ConcurrencyThreshold(
                self.concurrency_threshold,
            ));
        }
        Ok(())
    }
}

/// A comparison's settings or flags out of range; the message names the flag.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// The simulator's own check of its settings (its message).
    #[error(transparent)]
    Sim(#[from] switchyard_engine_sim::ConfigError),
    #[error("--engines must be at least 1")]
    NoEngines,
    #[error("--routers must list router counts of at least 1")]
    RouterCounts,
    #[error("--strategies must name at least one strategy")]
    NoStrategy,
    #[error("--load-balance-factor must be within 1-100, got {0}")]
    LoadBalanceFactor(f64),
    #[error("--load-balance-slack must be within 0-1024, got {0}")]
    LoadBalanceSlack(u32),
    #[error("--load-balance-slack needs --load-balance-factor")]
    SlackWithoutFactor,
    #[error("--concurrency must be at least 1")]
    NoConcurrency,
    #[error("--rate must be a positive number, got {0}")]
    Rate(f64),
    #[error("--prefix-length must be within 1024-65536, got {0}")]
    PrefixLength(u32),
    #[error("--concurrency-threshold must be within 1-1024, got {0}")]
    ConcurrencyThreshold(u32),
    #[error(
        "--router-processes: no switchyard-router next to this executable (build it: cargo build --release -p switchyard-router), or give --router-bin"
    )]
    NoRouterBinary,
    #[error("--router-bin {}: no such file", .0.display())]
    NoSuchRouterBinary(PathBuf),
    #[error("--max-duration must be positive, got {0}")]
    MaxDuration(f64),
    #[error("--tokenizer {}: no tokenizer.json in it", .0.display())]
    NoTokenizer(PathBuf),
    #[error("--tokenize-check-fraction must be within 0-1, got {0}")]
    TokenizeCheckFraction(f64),
}
