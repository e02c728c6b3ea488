//! `switchyard-bench compare`'s flags, applied over a preset.

use std::path::PathBuf;
use std::time::Duration;

use super::settings::{CompareSettings, Preset, SettingsError};
use crate::child::default_router_bin;
use crate::flags::set;
use crate::peer::Peer;
use crate::report::LoadBalanceSetting;
use crate::report::emit::OutputArgs;
use crate::sim::load_interval_for;
use crate::strategy::Strategy;
use crate::workload::{TraceArgs, WorkloadKind, WorkloadSpec};

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
    /// the SGLang model gateway of PyPI's `sglang-router` 0.3.2; smg: PyPI's `smg` 1.13.0;
    /// both `smg launch --policy cache_aware`). A peer whose binary is not found is skipped
    /// with a note.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "PEER,..")]
    pub peers: Option<Vec<Peer>>,
    /// No peer runs (overrides the preset's).
    #[arg(long, conflicts_with = "peers")]
    pub no_peers: bool,
    /// `sglang-router`'s `smg` binary. Default: the first `smg` whose --version says
    /// `sgl-model-gateway`, in target/peers-sglang/bin, on PATH, or in target/peers/bin.
    #[arg(long, value_name = "FILE")]
    pub sglang_bin: Option<PathBuf>,
    /// The `smg` package's binary. Default: the first `smg` whose --version says `smg`, in
    /// target/peers-smg/bin, on PATH, or in target/peers/bin.
    #[arg(long, value_name = "FILE")]
    pub smg_bin: Option<PathBuf>,
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
    /// A model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja): the
    /// simulated engines serve its real tokenizer, the oracle counts with it, and KV_AWARE's
    /// routers compute token ids with it (KvAwareRoutingConfig.Tokenizer) instead of asking
    /// the engines' /tokenize.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// With --tokenizer: run KV_AWARE once more with its routers' piece cache off
    /// (--tokenize-cache-bytes 0), to show what the cache saves in decision time and CPU.
    #[arg(long, requires = "tokenizer")]
    pub also_without_piece_cache: bool,
    /// The routers' --tokenize-check-fraction: the share of locally tokenized requests also
    /// sent to an engine's /tokenize as a check. Default: the router's (0.01).
    #[arg(long, value_name = "FRACTION")]
    pub tokenize_check_fraction: Option<f64>,
    #[command(flatten)]
    pub output: OutputArgs,
}

impl DemoArgs {
    /// The preset with every given flag applied, validated (the error names the flag).
    pub fn settings(&self) -> Result<CompareSettings, SettingsError> {
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
        self.trace.apply(&mut settings.workload);
        set(&mut settings.router_counts, self.routers.clone());
        set(&mut settings.engines, self.engines);
        set(&mut settings.strategies, self.strategies.clone());
        set(&mut settings.concurrency, self.concurrency);
        if self.rate.is_some() {
            settings.rate = self.rate;
        }
        if let Some(time_scale) = self.time_scale {
            settings.sim.time_scale = time_scale;
            settings.load_interval_ms = load_interval_for(time_scale);
        }
        set(&mut settings.sim.kv_cache_blocks, self.kv_cache_blocks);
        set(&mut settings.prefix_length, self.prefix_length);
        set(
            &mut settings.concurrency_threshold,
            self.concurrency_threshold,
        );
        match (&self.load_balance_factor, &self.load_balance_slack) {
            (None, Some(_)) if settings.load_balance.is_empty() => {
                return Err(SettingsError::SlackWithoutFactor);
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
        set(&mut settings.peers, self.peers.clone());
        if self.no_peers {
            settings.peers.clear();
        }
        if self.sglang_bin.is_some() {
            settings.sglang_bin = self.sglang_bin.clone();
        }
        if self.smg_bin.is_some() {
            settings.smg_bin = self.smg_bin.clone();
        }
        if self.router_processes {
            let binary = self
                .router_bin
                .clone()
                .or_else(default_router_bin)
                .ok_or(SettingsError::NoRouterBinary)?;
            if !binary.is_file() {
                return Err(SettingsError::NoSuchRouterBinary(binary));
            }
            settings.router_binary = Some(binary);
        }
        if let Some(seconds) = self.max_duration {
            if !(seconds.is_finite() && seconds > 0.0) {
                return Err(SettingsError::MaxDuration(seconds));
            }
            settings.max_duration = Duration::from_secs_f64(seconds);
        }
        if let Some(folder) = &self.tokenizer {
            if !folder.join("tokenizer.json").is_file() {
                return Err(SettingsError::NoTokenizer(folder.clone()));
            }
            settings.sim.tokenizer = Some(folder.clone());
        }
        settings.kv_without_piece_cache = self.also_without_piece_cache;
        if let Some(fraction) = self.tokenize_check_fraction {
            if !(0.0..=1.0).contains(&fraction) {
                return Err(SettingsError::TokenizeCheckFraction(fraction));
            }
            settings.tokenize_check_fraction = Some(fraction);
        }
        settings.progress = !self.output.quiet;
        settings.validate()?;
        Ok(settings)
    }
}
