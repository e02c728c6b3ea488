//! `switchyard-bench --target URL --endpoint E --workload W`: drives an existing router (or,
//! with `--direct`, engines) and reports what the client measured, the engines' KV-cache
//! hit rate (with `--engine-metrics`) and the oracle bound of the trace.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use crate::client::http_client;
use crate::error::UsageError;
use crate::output::{Machine, command_line};
use crate::prepare::prepare;
use crate::report::emit::OutputArgs;
use crate::report::{KvStats, Report, RunReport, RunStats};
use crate::run::{RunConfig, run};
use crate::scrape::{EngineCounters, metrics_url, scrape};
use crate::workload::{TraceArgs, WorkloadError, WorkloadKind, WorkloadSpec};

/// Flags of the default command.
#[derive(Debug, Clone, clap::Args)]
pub struct DriveArgs {
    /// Router base URL(s), comma-separated; requests are spread over them round-robin.
    #[arg(long, value_delimiter = ',', value_name = "URL,..")]
    pub target: Vec<String>,
    /// Endpoint to call: POST {target}/endpoints/{endpoint}/openai/v1/chat/completions.
    #[arg(long, value_name = "E")]
    pub endpoint: Option<String>,
    /// The targets are engines, not routers: POST {target}/v1/chat/completions.
    #[arg(long)]
    pub direct: bool,
    /// The body's `model`. Default: the endpoint name (the router rewrites it to the
    /// variant's ModelName); with --direct, `sim`.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// Workload (docs/benchmarks.md): each has its documented defaults, which the flags
    /// below override.
    #[arg(long, value_enum, default_value = "long-context")]
    pub workload: WorkloadKind,
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Closed-loop clients (with --rate: the most sessions in flight).
    #[arg(long, default_value_t = 8, value_name = "C")]
    pub concurrency: usize,
    /// Open loop: new sessions per second of model time (Poisson). Default: closed loop.
    #[arg(long, value_name = "PER_S")]
    pub rate: Option<f64>,
    /// Engines' base URLs (or /metrics URLs), comma-separated: the hit rate is computed from
    /// the deltas of their vllm:prefix_cache_hits_total and vllm:prefix_cache_queries_total.
    /// Without it, from the answers' usage.prompt_tokens_details.cached_tokens.
    #[arg(long, value_delimiter = ',', value_name = "URL,..")]
    pub engine_metrics: Vec<String>,
    /// Engines behind the target, for the oracle's capacity. Default: the number of
    /// --engine-metrics URLs, else 1.
    #[arg(long, value_name = "N")]
    pub engines: Option<usize>,
    /// KV-cache blocks per engine, for the oracle's capacity (the simulator's default).
    #[arg(long, default_value_t = 79_000, value_name = "BLOCKS")]
    pub kv_cache_blocks: usize,
    /// The engines' --time-scale, to report model ms (= wall ms / X) beside wall ms.
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    pub time_scale: f64,
    /// Stop starting sessions after this many seconds.
    #[arg(long, default_value_t = 3600.0, value_name = "SECONDS")]
    pub max_duration: f64,
    /// Give up on a request after this many seconds.
    #[arg(long, default_value_t = 300.0, value_name = "SECONDS")]
    pub timeout: f64,
    #[command(flatten)]
    pub output: OutputArgs,
}

impl DriveArgs {
    fn workload(&self) -> Result<WorkloadSpec, WorkloadError> {
        let mut spec = WorkloadSpec::defaults(self.workload);
        self.trace.apply(&mut spec);
        spec.validate()?;
        Ok(spec)
    }

    /// Validated target URLs and body model.
    fn targets(&self) -> Result<(Vec<http::Uri>, String), DriveError> {
        if self.target.is_empty() {
            return Err(DriveError::NoTarget);
        }
        let endpoint = match (&self.endpoint, self.direct) {
            (Some(endpoint), _) => endpoint.clone(),
            (None, true) => String::new(),
            (None, false) => return Err(DriveError::NoEndpoint),
        };
        let model = self.model.clone().unwrap_or_else(|| {
            if self.direct {
                "sim".into()
            } else {
                endpoint.clone()
            }
        });
        let mut targets = Vec::new();
        for base in &self.target {
            let base = base.trim_end_matches('/');
            if !(base.starts_with("http://") || base.starts_with("https://")) {
                return Err(DriveError::Scheme(base.to_owned()));
            }
            let url = if self.direct {
                format!("{base}/v1/chat/completions")
            } else {
                format!("{base}/endpoints/{endpoint}/openai/v1/chat/completions")
            };
            let target = url.parse::<http::Uri>().map_err(|reason| DriveError::Uri {
                base: base.to_owned(),
                reason,
            })?;
            targets.push(target);
        }
        Ok((targets, model))
    }

    pub fn validate(&self) -> Result<(), DriveError> {
        self.workload()?;
        self.targets()?;
        if self.concurrency == 0 {
            return Err(DriveError::NoConcurrency);
        }
        for (flag, value) in [
            ("--time-scale", self.time_scale),
            ("--max-duration", self.max_duration),
            ("--timeout", self.timeout),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(DriveError::NotPositive { flag, value });
            }
        }
        if let Some(rate) = self.rate
            && !(rate.is_finite() && rate > 0.0)
        {
            return Err(DriveError::NotPositive {
                flag: "--rate",
                value: rate,
            });
        }
        Ok(())
    }
}

/// A flag of the default command out of range; the message names the flag.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error("--target URL is required (or use the compare or overhead command)")]
    NoTarget,
    #[error("--endpoint E is required with --target")]
    NoEndpoint,
    #[error("--target {0:?} must start with http://")]
    Scheme(String),
    #[error("--target {base:?}: {reason}")]
    Uri {
        base: String,
        reason: http::uri::InvalidUri,
    },
    #[error("--concurrency must be at least 1")]
    NoConcurrency,
    #[error("{flag} must be a positive number, got {value}")]
    NotPositive { flag: &'static str, value: f64 },
}

/// Runs the trace against the targets, prints the table, writes the files.
pub async fn drive(args: DriveArgs) -> anyhow::Result<Report> {
    args.validate().map_err(UsageError::new)?;
    let spec = args.workload().map_err(UsageError::new)?;
    let (targets, model) = args.targets().map_err(UsageError::new)?;
    let engines = args.engines.unwrap_or(args.engine_metrics.len().max(1));
    let capacity = (engines * args.kv_cache_blocks) as u64;
    let concurrency = args.concurrency;
    let prepared_spec = spec.clone();
    let (trace, oracle, workload) = tokio::task::spawn_blocking(move || {
        prepare(&prepared_spec, concurrency, capacity, 16, None)
    })
    .await
    .context("trace generation failed")??;
    let client = http_client();
    let metrics: Vec<String> = args
        .engine_metrics
        .iter()
        .map(|url| metrics_url(url))
        .collect();
    let before = scrape_all(&client, &metrics).await?;
    let label = if args.direct { "direct" } else { "router" }.to_owned();
    let output = run(
        Arc::new(trace),
        RunConfig {
            targets,
            model,
            concurrency,
            rate: args.rate.map(|rate| rate / args.time_scale),
            seed: spec.seed,
            request_timeout: Duration::from_secs_f64(args.timeout),
            max_duration: Duration::from_secs_f64(args.max_duration),
            label: label.clone(),
            progress: !args.output.quiet,
        },
        client.clone(),
    )
    .await?;
    let after = scrape_all(&client, &metrics).await?;
    let stats = RunStats::from_output(&output, args.time_scale);
    let kv =
        (!metrics.is_empty()).then(|| KvStats::from_engines(&after.since(&before), Some(&oracle)));
    let kv_from_usage = KvStats::from_usage(&stats, Some(&oracle));
    let mut notes = vec![format!(
        "oracle capacity assumes {engines} engine(s) × {} KV blocks (--engines, --kv-cache-blocks)",
        args.kv_cache_blocks
    )];
    if metrics.is_empty() {
        notes.push("no --engine-metrics: the hit rate comes from the answers' usage".into());
    }
    let report = Report {
        tool: "switchyard-bench".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        mode: "drive".into(),
        command: command_line(),
        machine: Machine::current(),
        workload,
        time_scale: args.time_scale,
        concurrency,
        rate: args.rate,
        setup: None,
        oracle: Some(oracle),
        runs: vec![RunReport {
            kv,
            kv_from_usage,
            ..RunReport::client_side(label, args.target.len(), stats)
        }],
        prefix_owner_shares: Vec::new(),
        checks: Vec::new(),
        notes,
    };
    report.emit(&args.output)?;
    Ok(report)
}

async fn scrape_all(
    client: &crate::client::HttpClient,
    urls: &[String],
) -> anyhow::Result<EngineCounters> {
    let mut total = EngineCounters::default();
    for url in urls {
        let samples = scrape(client, url)
            .await
            .with_context(|| format!("--engine-metrics {url}"))?;
        total.add(&EngineCounters::from_samples(&samples));
    }
    Ok(total)
}
