//! `switchyard-bench dpd`: disaggregated prefill/decode against colocated engines, in the shape
//! of the source article's benchmark (`seeds/002_*`: fixed-length long prompts and 256 output
//! tokens at concurrency 8, 16 and 32, DPD 1P1D against a colocated baseline).
//!
//! For each topology `PpDd` two fresh in-process clusters run side by side (control plane on
//! an embedded store, one router, simulated engines): **colocated**, `p + d` engines of role
//! both behind one LEAST_OUTSTANDING_REQUESTS variant, and **DPD**, `p` prefill and `d` decode
//! engines behind a disaggregated endpoint (`RouteThreshold`, ROUND_ROBIN prefill, least
//! outstanding decode, NIXL hand-offs). Every load runs on the colocated cluster, then on the
//! DPD one, with the same trace, so each ratio compares two runs made one after the other.
//!
//! Prompts are single user messages of common English words, each exactly one token both for
//! the router's tokenizer (cl100k_base, with its leading space) and for the simulator's, so the
//! router decides on the count the engines work on. Every long prompt is checked before the
//! run to count at least 1.25 × the threshold with the router's own counting code
//! (`plan::count_prompt`), and every answer's decision headers are checked after it: long
//! prompts `x-switchyard-route: disaggregated` with `x-switchyard-prompt-tokens` at or past
//! the threshold, short ones `direct`.
//!
//! TPOT is per request, (e2e − TTFT) / (output tokens − 1); ITL is every gap between two
//! streamed tokens. Latencies are in model ms (wall ms / time scale), throughput in output
//! tokens per model second.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use switchyard_engine_sim::SimConfig;
use switchyard_policy::openai::OpenAiRequest;
use switchyard_router::plan::count_prompt;
use switchyard_router::tokenizer::{Tokenizer, Tokenizers};

use crate::client::{HttpClient, http_client};
use crate::error::UsageError;
use crate::output::Machine;
use crate::report::RunStats;
use crate::report::svg::{Bar, escape};
use crate::run::{RunConfig, RunOutput, run};
use crate::stats::{Latency, relative_change};
use crate::workload::{
    Message, RequestClass, Role, Session, Text, Trace, TraceRequest, WorkloadKind, WorkloadSpec,
};
use switchyard_cluster::{ClusterDisaggregation, ClusterSpec, ClusterTuning, LocalCluster};

/// The smallest long prompt, as a multiple of the threshold (the issue's acceptance rule).
pub const MIN_LONG_FACTOR: f64 = 1.25;

#[derive(Debug, Clone, clap::Args)]
pub struct DpdArgs {
    /// A smoke run of a few seconds: 1P1D only, concurrency 4, a mixed load at 4, 2 requests
    /// per client, 32 output tokens (flags given explicitly still win).
    #[arg(long)]
    pub quick: bool,
    /// Topologies, each `<P>P<D>D` (prefill and decode engines), compared with a colocated
    /// fleet of P + D engines. Default: 1P1D,2P1D,2P2D.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub topologies: Option<Vec<String>>,
    /// Client concurrencies (closed loop) of the long-prompt loads. Default: 8,16,32.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub concurrency: Option<Vec<usize>>,
    /// Engines of the colocated baseline. Default: as many as the topology has (P + D); 1
    /// with 1P1D is the article's own baseline (one node against DPD's two).
    #[arg(long, value_name = "N")]
    pub colocated_engines: Option<usize>,
    /// Concurrency of the mixed long/short load; 0 leaves it out. Default: 16.
    #[arg(long, value_name = "N")]
    pub mixed_concurrency: Option<usize>,
    /// Fraction of long prompts in the mixed load (the rest: 64–900 tokens).
    #[arg(long, default_value_t = 0.5, value_name = "F")]
    pub long_fraction: f64,
    /// The disaggregated endpoint's RouteThreshold, in tokens (as the router counts them).
    #[arg(long, default_value_t = 4096, value_name = "TOKENS")]
    pub threshold: u32,
    /// Tokens of each long prompt as the router counts them (cl100k_base); at least 1.25 ×
    /// the threshold. Default: 1.27 × the threshold (5,202 for 4,096).
    #[arg(long, value_name = "TOKENS")]
    pub long_tokens: Option<u32>,
    /// Output tokens per request. Default: 256 (quick: 32).
    #[arg(long, value_name = "TOKENS")]
    pub output_tokens: Option<u32>,
    /// Requests in each run per client (a run sends this × its concurrency). Default: 6
    /// (quick: 2).
    #[arg(long, value_name = "N")]
    pub requests_per_client: Option<usize>,
    /// The simulated engines' clock: 0.25 runs four times faster than the modelled GPUs.
    #[arg(long, default_value_t = 0.25, value_name = "X")]
    pub time_scale: f64,
    /// Seed of the prompts.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub seed: u64,
    /// A request that has not finished after this many wall seconds counts as failed.
    #[arg(long, default_value_t = 120, value_name = "SECONDS")]
    pub request_timeout_seconds: u64,
    /// No progress line on stderr.
    #[arg(long)]
    pub no_progress: bool,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the chart (changes against colocated) as SVG.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
}

/// `P` prefill and `D` decode engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Topology {
    pub prefill: usize,
    pub decode: usize,
}

impl Topology {
    /// `1P1D`, `2p1d`, …
    pub fn parse(text: &str) -> Result<Self, String> {
        let upper = text.trim().to_ascii_uppercase();
        let parsed = upper.strip_suffix('D').and_then(|rest| {
            let (prefill, decode) = rest.split_once('P')?;
            Some((prefill.parse().ok()?, decode.parse().ok()?))
        });
        match parsed {
            Some((prefill, decode)) if (1..=8).contains(&prefill) && (1..=8).contains(&decode) => {
                Ok(Self { prefill, decode })
            }
            _ => Err(format!(
                "--topologies: {text:?} is not <P>P<D>D with 1 to 8 engines of each role (e.g. 2P1D)"
            )),
        }
    }

    pub fn engines(self) -> usize {
        self.prefill + self.decode
    }

    pub fn name(self) -> String {
        format!("{}P{}D", self.prefill, self.decode)
    }
}

/// One load: a closed loop of `concurrency` clients over `long_fraction` long prompts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Load {
    pub name: String,
    pub concurrency: usize,
    pub long_fraction: f64,
    pub requests: usize,
}

/// Everything a `dpd` run is made from.
#[derive(Debug, Clone)]
pub struct DpdSettings {
    pub topologies: Vec<Topology>,
    /// `None`: as many as each topology.
    pub colocated_engines: Option<usize>,
    pub loads: Vec<Load>,
    pub threshold: u32,
    pub long_tokens: u32,
    pub output_tokens: u32,
    pub time_scale: f64,
    pub seed: u64,
    pub request_timeout: Duration,
    pub progress: bool,
}

impl DpdSettings {
    pub fn from_args(args: &DpdArgs) -> Result<Self, UsageError> {
        let quick = args.quick;
        let topologies = match &args.topologies {
            Some(list) => list
                .iter()
                .map(|text| Topology::parse(text))
                .collect::<Result<Vec<_>, _>>()
                .map_err(UsageError)?,
            None if quick => vec![Topology {
                prefill: 1,
                decode: 1,
            }],
            None => ["1P1D", "2P1D", "2P2D"]
                .iter()
                .map(|text| Topology::parse(text).map_err(UsageError))
                .collect::<Result<Vec<_>, _>>()?,
        };
        let concurrency = args
            .concurrency
            .clone()
            .unwrap_or_else(|| if quick { vec![4] } else { vec![8, 16, 32] });
        let mixed = args.mixed_concurrency.unwrap_or(if quick { 4 } else { 16 });
        let per_client = args
            .requests_per_client
            .unwrap_or(if quick { 2 } else { 6 });
        if per_client == 0 || per_client > 1000 {
            return Err(UsageError(
                "--requests-per-client must be within 1..=1000".into(),
            ));
        }
        if concurrency.iter().any(|&c| c == 0 || c > 512) || mixed > 512 {
            return Err(UsageError(
                "--concurrency and --mixed-concurrency must be within 1..=512".into(),
            ));
        }
        if !(args.long_fraction > 0.0 && args.long_fraction < 1.0) {
            return Err(UsageError(
                "--long-fraction must be strictly between 0 and 1".into(),
            ));
        }
        let mut loads: Vec<Load> = concurrency
            .iter()
            .map(|&c| Load {
                name: format!("long c={c}"),
                concurrency: c,
                long_fraction: 1.0,
                requests: c * per_client,
            })
            .collect();
        if mixed > 0 {
            loads.push(Load {
                name: format!("mixed c={mixed}"),
                concurrency: mixed,
                long_fraction: args.long_fraction,
                requests: mixed * per_client,
            });
        }
        if loads.is_empty() || topologies.is_empty() {
            return Err(UsageError("nothing to run: no load or no topology".into()));
        }
        if args.threshold < 64 || args.threshold > 100_000 {
            return Err(UsageError(
                "--threshold must be within 64..=100000 tokens".into(),
            ));
        }
        let minimum = (f64::from(args.threshold) * MIN_LONG_FACTOR).ceil() as u32;
        let long_tokens = args
            .long_tokens
            .unwrap_or((f64::from(args.threshold) * 1.27).ceil() as u32);
        if long_tokens < minimum || long_tokens > 120_000 {
            return Err(UsageError(format!(
                "--long-tokens must be within {minimum}..=120000 (at least 1.25 × --threshold)"
            )));
        }
        let output_tokens = args.output_tokens.unwrap_or(if quick { 32 } else { 256 });
        if !(2..=4096).contains(&output_tokens) {
            return Err(UsageError("--output-tokens must be within 2..=4096".into()));
        }
        if !(args.time_scale > 0.0 && args.time_scale <= 10.0) {
            return Err(UsageError("--time-scale must be within (0, 10]".into()));
        }
        if args.request_timeout_seconds == 0 {
            return Err(UsageError(
                "--request-timeout-seconds must be at least 1".into(),
            ));
        }
        if args
            .colocated_engines
            .is_some_and(|engines| !(1..=16).contains(&engines))
        {
            return Err(UsageError(
                "--colocated-engines must be within 1..=16".into(),
            ));
        }
        Ok(Self {
            topologies,
            colocated_engines: args.colocated_engines,
            loads,
            threshold: args.threshold,
            long_tokens,
            output_tokens,
            time_scale: args.time_scale,
            seed: args.seed,
            request_timeout: Duration::from_secs(args.request_timeout_seconds),
            progress: !args.no_progress,
        })
    }
}

/// Did the router decide as intended (DPD arms only)?
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DecisionCheck {
    pub long: usize,
    /// Long prompts answered with `x-switchyard-route: disaggregated` and a prompt count at
    /// or past the threshold.
    pub long_disaggregated: usize,
    pub short: usize,
    /// Short prompts answered `direct` with a count below the threshold.
    pub short_direct: usize,
    /// The smallest `x-switchyard-prompt-tokens` of a long prompt (`N+`: counting stopped).
    pub min_long_header: Option<String>,
}

impl DecisionCheck {
    pub fn holds(&self) -> bool {
        self.long == self.long_disaggregated && self.short == self.short_direct
    }

    fn of(output: &RunOutput, threshold: u32) -> Self {
        let mut check = Self::default();
        let mut min_long: Option<(u32, String)> = None;
        for item in output.measured.iter().filter(|item| item.outcome.ok()) {
            let header = item.outcome.router_prompt_tokens.as_deref();
            let counted = header.and_then(|text| text.trim_end_matches('+').parse::<u32>().ok());
            let route = item.outcome.route.as_deref();
            match item.class {
                RequestClass::Long => {
                    check.long += 1;
                    if route == Some("disaggregated") && counted.is_some_and(|n| n >= threshold) {
                        check.long_disaggregated += 1;
                    }
                    if let (Some(n), Some(text)) = (counted, header)
                        && min_long.as_ref().is_none_or(|(least, _)| n < *least)
                    {
                        min_long = Some((n, text.to_owned()));
                    }
                }
                RequestClass::Short => {
                    check.short += 1;
                    if route == Some("direct") && counted.is_some_and(|n| n < threshold) {
                        check.short_direct += 1;
                    }
                }
            }
        }
        check.min_long_header = min_long.map(|(_, text)| text);
        check
    }
}

/// One arm (colocated or DPD) on one load.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmReport {
    pub stats: RunStats,
    /// Per request: (e2e − TTFT) / (output tokens − 1).
    pub tpot: Latency,
    /// DPD arms: the router's decisions checked against the prompts.
    pub decisions: Option<DecisionCheck>,
}

/// Relative changes of DPD against colocated (negative: DPD lower).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Changes {
    pub tpot_p50: Option<f64>,
    pub itl_p50: Option<f64>,
    pub itl_p99: Option<f64>,
    pub ttft_p50: Option<f64>,
    pub e2e_p50: Option<f64>,
    pub e2e_p99: Option<f64>,
    pub throughput: Option<f64>,
}

impl Changes {
    fn of(colocated: &ArmReport, dpd: &ArmReport) -> Self {
        let (a, b) = (&colocated.stats, &dpd.stats);
        Self {
            tpot_p50: relative_change(colocated.tpot.model_ms.p50, dpd.tpot.model_ms.p50),
            itl_p50: relative_change(a.itl.model_ms.p50, b.itl.model_ms.p50),
            itl_p99: relative_change(a.itl.model_ms.p99, b.itl.model_ms.p99),
            ttft_p50: relative_change(a.ttft.model_ms.p50, b.ttft.model_ms.p50),
            e2e_p50: relative_change(a.e2e.model_ms.p50, b.e2e.model_ms.p50),
            e2e_p99: relative_change(a.e2e.model_ms.p99, b.e2e.model_ms.p99),
            throughput: relative_change(a.output_tokens_per_s_model, b.output_tokens_per_s_model),
        }
    }
}

/// One topology on one load: both arms and the changes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DpdPoint {
    pub topology: Topology,
    /// Engines of the colocated baseline.
    pub colocated_engines: usize,
    pub load: Load,
    pub colocated: ArmReport,
    pub dpd: ArmReport,
    pub change: Changes,
}

/// The prompts as both sides count them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PromptCounts {
    /// Smallest long prompt by the router's count (cl100k_base, chat overhead included).
    pub long_router_min: usize,
    /// Smallest long prompt by the simulator's tokenizer and chat template.
    pub long_engine_min: usize,
    /// Largest short prompt by the router's count.
    pub short_router_max: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DpdReport {
    pub tool: String,
    pub command: String,
    pub machine: Machine,
    pub threshold: u32,
    pub long_tokens: u32,
    pub output_tokens: u32,
    pub time_scale: f64,
    pub prompts: PromptCounts,
    pub points: Vec<DpdPoint>,
    pub seconds: f64,
    pub notes: Vec<String>,
}

/// Common English words: each, with a leading space, is one cl100k_base token (checked at
/// start; words that are not are dropped) and one token of the simulator (≤ 6 letters).
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other", "its", "may",
    "these", "what", "them", "than", "some", "him", "time", "into", "only", "do", "could", "new",
    "about", "two", "first", "then", "also", "after", "any", "like", "well", "our", "between",
    "used", "many", "over", "such", "where", "most", "very", "state", "years", "those", "must",
    "while", "people", "could", "great", "world", "water", "house", "light", "small", "large",
    "place", "point", "order", "number", "group", "system", "line", "part", "day", "way", "work",
    "life", "hand", "home", "city", "road", "river", "field", "table", "green", "blue", "red",
    "black", "white", "long", "short", "high", "low", "early", "late", "open", "close", "read",
    "write", "data", "model", "token", "cache", "route", "serve", "power", "music", "paper",
    "market", "stone", "tree", "bird", "sound", "color", "story",
];

/// The vocabulary: [`WORDS`] that are one token for both tokenizers.
fn vocabulary(tokenizer: &Tokenizer) -> Vec<String> {
    let mut words: Vec<String> = WORDS
        .iter()
        .filter(|word| {
            let spaced = format!(" {word}");
            tokenizer.count(&spaced) == 1 && switchyard_engine_sim::count_tokens(&spaced) == 1
        })
        .map(|word| (*word).to_owned())
        .collect();
    words.sort();
    words.dedup();
    words
}

/// `words` words after `header`, drawn from the vocabulary.
fn text(rng: &mut fastrand::Rng, vocabulary: &[String], header: &str, words: usize) -> String {
    let mut text = String::with_capacity(header.len() + words * 6);
    text.push_str(header);
    for _ in 0..words {
        text.push(' ');
        text.push_str(&vocabulary[rng.usize(..vocabulary.len())]);
    }
    text
}

fn request(content: String, output_tokens: u32, class: RequestClass) -> TraceRequest {
    TraceRequest {
        messages: vec![Message {
            role: Role::User,
            parts: vec![Text::new(content)],
        }],
        max_tokens: output_tokens,
        class,
        group: None,
    }
}

/// The router's full count of a request's prompt (no early stop).
fn router_count(request: &TraceRequest, tokenizer: &Tokenizer) -> anyhow::Result<usize> {
    let body = request.body("bench");
    let parsed = OpenAiRequest::parse(&body).map_err(|err| anyhow::anyhow!("{err:?}"))?;
    Ok(count_prompt(&parsed, tokenizer, usize::MAX).tokens)
}

/// The trace of load number `index`: every prompt distinct from its first block on (the
/// header names the load and the request), long prompts of `long_tokens` as the router counts
/// them, short ones of 64–900.
fn trace(
    settings: &DpdSettings,
    index: usize,
    load: &Load,
    tokenizer: &Tokenizer,
    vocabulary: &[String],
    counts: &mut Option<PromptCounts>,
) -> anyhow::Result<Trace> {
    let mut rng = fastrand::Rng::with_seed(settings.seed ^ (index as u64).wrapping_mul(0x9e37));
    let mut sessions = Vec::with_capacity(load.requests);
    for number in 0..load.requests {
        let header = format!("Load {index} request {number}.");
        let long = load.long_fraction >= 1.0 || rng.f64() < load.long_fraction;
        let request = if long {
            // Each vocabulary word is one router token; the header and the chat overhead are
            // counted, then topped up until the count is reached.
            let base = router_count(&request(header.clone(), 1, RequestClass::Long), tokenizer)?;
            let mut words = (settings.long_tokens as usize).saturating_sub(base);
            loop {
                let candidate = request(
                    text(&mut rng, vocabulary, &header, words),
                    settings.output_tokens,
                    RequestClass::Long,
                );
                let counted = router_count(&candidate, tokenizer)?;
                if counted >= settings.long_tokens as usize || words > 200_000 {
                    let engine = switchyard_engine_sim::count_tokens(&candidate.prompt_text());
                    let entry = counts.get_or_insert(PromptCounts {
                        long_router_min: counted,
                        long_engine_min: engine,
                        short_router_max: None,
                    });
                    entry.long_router_min = entry.long_router_min.min(counted);
                    entry.long_engine_min = entry.long_engine_min.min(engine);
                    break candidate;
                }
                words += settings.long_tokens as usize - counted;
            }
        } else {
            let words = rng.usize(64..=900);
            let candidate = request(
                text(&mut rng, vocabulary, &header, words),
                settings.output_tokens,
                RequestClass::Short,
            );
            let counted = router_count(&candidate, tokenizer)?;
            if let Some(entry) = counts.as_mut() {
                entry.short_router_max = Some(entry.short_router_max.unwrap_or(0).max(counted));
            }
            candidate
        };
        sessions.push(Session {
            requests: vec![request],
        });
    }
    let mut spec = WorkloadSpec::defaults(WorkloadKind::Mixed);
    spec.requests = load.requests;
    spec.seed = settings.seed;
    spec.max_tokens = settings.output_tokens;
    spec.long_fraction = load.long_fraction;
    spec.prefixes = 0;
    Ok(Trace { spec, sessions })
}

fn colocated_spec(settings: &DpdSettings, topology: Topology) -> ClusterSpec {
    ClusterSpec {
        engines: settings.colocated_engines.unwrap_or(topology.engines()),
        routers: 1,
        endpoint: "colocated".into(),
        variants_json: switchyard_cluster::variants_json("LEAST_OUTSTANDING_REQUESTS", None),
        sim: sim_config(settings),
        ..ClusterSpec::default()
    }
}

fn dpd_spec(settings: &DpdSettings, topology: Topology) -> ClusterSpec {
    let variants = serde_json::json!([
        {"VariantName": "prefill", "ModelName": "sim", "InitialInstanceCount": topology.prefill},
        {"VariantName": "decode", "ModelName": "sim", "InitialInstanceCount": topology.decode},
    ]);
    let disaggregation = serde_json::json!({
        "PrefillVariantName": "prefill",
        "DecodeVariantName": "decode",
        "RouteThreshold": settings.threshold,
        "PrefillRoutingStrategy": "ROUND_ROBIN",
        "DecodeRoutingStrategy": "LEAST_OUTSTANDING_REQUESTS",
        "KvTransferProtocol": "NIXL",
    });
    ClusterSpec {
        engines: topology.engines(),
        routers: 1,
        endpoint: "dpd".into(),
        variants_json: variants.to_string(),
        sim: sim_config(settings),
        disaggregation: Some(ClusterDisaggregation {
            config_json: disaggregation.to_string(),
            prefill_engines: topology.prefill,
        }),
        ..ClusterSpec::default()
    }
}

/// The simulator's defaults (one ml.p5.48xlarge serving a 70 B model each) on the scaled
/// clock.
fn sim_config(settings: &DpdSettings) -> SimConfig {
    SimConfig {
        time_scale: settings.time_scale,
        ..SimConfig::default()
    }
}

fn tuning(settings: &DpdSettings) -> ClusterTuning {
    ClusterTuning {
        // The 100 ms default, on the scaled clock.
        load_interval_ms: ((100.0 * settings.time_scale).round() as u64).clamp(10, 100),
        ..ClusterTuning::default()
    }
}

async fn measure(
    settings: &DpdSettings,
    cluster: &LocalCluster,
    trace: &Arc<Trace>,
    load: &Load,
    label: String,
    client: &HttpClient,
    disaggregated: bool,
) -> anyhow::Result<ArmReport> {
    let url = cluster
        .router_urls
        .first()
        .context("the cluster has no router")?;
    let target = format!(
        "{url}/endpoints/{}/openai/v1/chat/completions",
        cluster.endpoint
    )
    .parse::<http::Uri>()?;
    let config = RunConfig {
        targets: vec![target],
        model: cluster.endpoint.clone(),
        concurrency: load.concurrency,
        rate: None,
        seed: settings.seed,
        request_timeout: settings.request_timeout,
        max_duration: Duration::from_secs(3600),
        label,
        progress: settings.progress,
    };
    let output = run(Arc::clone(trace), config, client.clone()).await?;
    // The next run starts on idle engines.
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.in_flight() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stats = RunStats::from_output(&output, settings.time_scale);
    let tpot_wall_ms: Vec<f64> = output
        .measured
        .iter()
        .filter(|item| item.outcome.ok())
        .filter_map(|item| {
            let ttft = item.outcome.ttft?;
            let tokens = item.outcome.output_tokens();
            (tokens > 1).then(|| {
                (item.outcome.e2e.saturating_sub(ttft)).as_secs_f64() * 1e3 / f64::from(tokens - 1)
            })
        })
        .collect();
    Ok(ArmReport {
        stats,
        tpot: Latency::of(&tpot_wall_ms, settings.time_scale),
        decisions: disaggregated.then(|| DecisionCheck::of(&output, settings.threshold)),
    })
}

/// Runs every topology on every load, colocated then DPD.
pub async fn dpd_compare(settings: &DpdSettings) -> anyhow::Result<DpdReport> {
    let started = Instant::now();
    let tokenizers = Tokenizers::new(None);
    let tokenizer = tokenizers.get(switchyard_shared::disaggregation::DEFAULT_TOKENIZER);
    let words = vocabulary(&tokenizer);
    anyhow::ensure!(
        words.len() >= 64,
        "only {} one-token words for the prompts",
        words.len()
    );
    let mut counts = None;
    let mut traces = Vec::with_capacity(settings.loads.len());
    for (index, load) in settings.loads.iter().enumerate() {
        let trace = trace(settings, index, load, &tokenizer, &words, &mut counts)?;
        traces.push(Arc::new(trace));
    }
    let prompts = counts.context("no long prompt in any load")?;
    let minimum = (f64::from(settings.threshold) * MIN_LONG_FACTOR).ceil() as usize;
    anyhow::ensure!(
        prompts.long_router_min >= minimum,
        "a long prompt counts {} tokens for the router, under 1.25 × the threshold ({minimum})",
        prompts.long_router_min
    );

    let client = http_client();
    let mut points = Vec::new();
    let mut notes = Vec::new();
    for &topology in &settings.topologies {
        let colocated =
            LocalCluster::start_with(colocated_spec(settings, topology), tuning(settings))
                .await
                .context("cannot start the colocated cluster")?;
        let disaggregated =
            match LocalCluster::start_with(dpd_spec(settings, topology), tuning(settings)).await {
                Ok(cluster) => cluster,
                Err(err) => {
                    colocated.shutdown().await;
                    return Err(err.context("cannot start the disaggregated cluster"));
                }
            };
        let mut result = Ok(());
        for (load, trace) in settings.loads.iter().zip(&traces) {
            let name = topology.name();
            let colocated_arm = Box::pin(measure(
                settings,
                &colocated,
                trace,
                load,
                format!("{name} {} colocated", load.name),
                &client,
                false,
            ))
            .await;
            let dpd_arm = Box::pin(measure(
                settings,
                &disaggregated,
                trace,
                load,
                format!("{name} {} DPD", load.name),
                &client,
                true,
            ))
            .await;
            match (colocated_arm, dpd_arm) {
                (Ok(colocated), Ok(dpd)) => {
                    if let Some(check) = &dpd.decisions
                        && !check.holds()
                    {
                        notes.push(format!(
                            "{name} {}: {} of {} long prompts disaggregated, {} of {} short direct",
                            load.name,
                            check.long_disaggregated,
                            check.long,
                            check.short_direct,
                            check.short
                        ));
                    }
                    points.push(DpdPoint {
                        topology,
                        colocated_engines: settings.colocated_engines.unwrap_or(topology.engines()),
                        load: load.clone(),
                        change: Changes::of(&colocated, &dpd),
                        colocated,
                        dpd,
                    });
                }
                (Err(err), _) | (_, Err(err)) => {
                    result = Err(err);
                    break;
                }
            }
        }
        colocated.shutdown().await;
        disaggregated.shutdown().await;
        result?;
    }
    Ok(DpdReport {
        tool: format!("switchyard-bench {}", env!("CARGO_PKG_VERSION")),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: Machine::current(),
        threshold: settings.threshold,
        long_tokens: settings.long_tokens,
        output_tokens: settings.output_tokens,
        time_scale: settings.time_scale,
        prompts,
        points,
        seconds: started.elapsed().as_secs_f64(),
        notes,
    })
}

fn engines(count: usize) -> String {
    format!("{count} engine{}", if count == 1 { "" } else { "s" })
}

fn signed(change: Option<f64>) -> String {
    change.map_or_else(
        || "n/a".into(),
        |value| {
            format!(
                "{}{:.0}%",
                if value >= 0.0 { "+" } else { "−" },
                value.abs() * 100.0
            )
        },
    )
}

impl DpdReport {
    /// The Markdown table of docs/benchmarks.md: colocated → DPD (change) per point.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\ndpd: long prompts {} tokens as the router counts them (smallest {}, {:.2} × the {} threshold; {} for the engines), {} output tokens, time scale {}; latencies in model ms, throughput in output tokens per model second; colocated → DPD (change)\n",
            self.long_tokens,
            self.prompts.long_router_min,
            self.prompts.long_router_min as f64 / f64::from(self.threshold),
            self.threshold,
            self.prompts.long_engine_min,
            self.output_tokens,
            self.time_scale,
        );
        let _ = writeln!(
            out,
            "| topology | load | TPOT p50 | ITL p50 / p99 | TTFT p50 | e2e p50 | e2e p99 | throughput |"
        );
        let _ = writeln!(
            out,
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        for point in &self.points {
            let (a, b) = (&point.colocated, &point.dpd);
            let pair = |x: f64, y: f64, change: Option<f64>| {
                format!("{x:.1} → {y:.1} ({})", signed(change))
            };
            let change = &point.change;
            let _ = writeln!(
                out,
                "| {} vs {} | {} | {} | {:.1} / {:.0} → {:.1} / {:.0} ({} / {}) | {} | {} | {} | {:.0} → {:.0} ({}) |",
                point.topology.name(),
                engines(point.colocated_engines),
                point.load.name,
                pair(a.tpot.model_ms.p50, b.tpot.model_ms.p50, change.tpot_p50),
                a.stats.itl.model_ms.p50,
                a.stats.itl.model_ms.p99,
                b.stats.itl.model_ms.p50,
                b.stats.itl.model_ms.p99,
                signed(change.itl_p50),
                signed(change.itl_p99),
                pair(
                    a.stats.ttft.model_ms.p50,
                    b.stats.ttft.model_ms.p50,
                    change.ttft_p50
                ),
                pair(
                    a.stats.e2e.model_ms.p50,
                    b.stats.e2e.model_ms.p50,
                    change.e2e_p50
                ),
                pair(
                    a.stats.e2e.model_ms.p99,
                    b.stats.e2e.model_ms.p99,
                    change.e2e_p99
                ),
                a.stats.output_tokens_per_s_model,
                b.stats.output_tokens_per_s_model,
                signed(change.throughput),
            );
        }
        let errors: usize = self
            .points
            .iter()
            .map(|point| point.colocated.stats.errors + point.dpd.stats.errors)
            .sum();
        let decided = self
            .points
            .iter()
            .filter_map(|point| point.dpd.decisions.as_ref())
            .all(DecisionCheck::holds);
        let _ = writeln!(
            out,
            "\n{} failed requests; router decisions {} (long → disaggregated at ≥ threshold, short → direct); smallest long-prompt header {}; took {:.0} s",
            errors,
            if decided {
                "as intended"
            } else {
                "NOT as intended"
            },
            self.points
                .iter()
                .filter_map(|point| point.dpd.decisions.as_ref()?.min_long_header.clone())
                .next()
                .unwrap_or_else(|| "n/a".into()),
            self.seconds,
        );
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        if let Some(mixed) = self
            .points
            .iter()
            .find(|point| !point.colocated.stats.classes.is_empty())
        {
            let _ = writeln!(
                out,
                "\nmixed load, per class ({}): TTFT p50 / ITL p99 colocated → DPD",
                mixed.topology.name()
            );
            for (class, colocated) in &mixed.colocated.stats.classes {
                if let Some(dpd) = mixed.dpd.stats.classes.get(class) {
                    let _ = writeln!(
                        out,
                        "  {class} ({} requests): TTFT {:.1} → {:.1} ms, ITL p99 {:.1} → {:.1} ms",
                        colocated.requests,
                        colocated.ttft.model_ms.p50,
                        dpd.ttft.model_ms.p50,
                        colocated.itl.model_ms.p99,
                        dpd.itl.model_ms.p99
                    );
                }
            }
        }
        out
    }
}

/// `switchyard-bench dpd`.
pub async fn dpd(args: DpdArgs) -> anyhow::Result<DpdReport> {
    let settings = DpdSettings::from_args(&args)?;
    let report = dpd_compare(&settings).await?;
    crate::output::print_stdout(&report.table());
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, render_chart(&report))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let errors: usize = report
        .points
        .iter()
        .map(|point| point.colocated.stats.errors + point.dpd.stats.errors)
        .sum();
    anyhow::ensure!(errors == 0, "{errors} requests failed");
    anyhow::ensure!(
        report.notes.is_empty(),
        "the router did not decide as intended: {:?}",
        report.notes
    );
    Ok(report)
}

/// One panel of [`render_chart`]: a bar per point, up or down from a zero line, on an axis
/// symmetric about 0 in steps of 25%.
fn change_panel(out: &mut String, (x, y): (f64, f64), width: f64, title: &str, bars: &[Bar]) {
    const HEIGHT: f64 = 200.0;
    let largest = bars
        .iter()
        .map(|bar| bar.value.abs())
        .fold(0.25_f64, f64::max);
    let top = (largest / 0.25).ceil() * 0.25;
    let scale = |value: f64| y + HEIGHT / 2.0 - (value / top).clamp(-1.0, 1.0) * HEIGHT / 2.0;
    let _ = writeln!(
        out,
        r#"<text x="{x:.1}" y="{:.1}" class="title">{}</text>"#,
        y - 14.0,
        escape(title)
    );
    let ticks = (top / 0.25).round() as i32;
    for tick in -ticks..=ticks {
        let value = 0.25 * f64::from(tick);
        let line_y = scale(value);
        let stroke = if tick == 0 { "#444" } else { "#e4e4e4" };
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{line_y:.1}" x2="{:.1}" y2="{line_y:.1}" stroke="{stroke}"/><text x="{:.1}" y="{:.1}" class="axis" text-anchor="end">{:+.0}%</text>"##,
            x + width,
            x - 6.0,
            line_y + 4.0,
            value * 100.0
        );
    }
    let slot = width / bars.len().max(1) as f64;
    let bar_width = (slot * 0.7).min(40.0);
    for (index, bar) in bars.iter().enumerate() {
        let center = x + slot * (index as f64 + 0.5);
        let (zero, end) = (scale(0.0), scale(bar.value));
        let _ = writeln!(
            out,
            r#"<rect x="{:.1}" y="{:.1}" width="{bar_width:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
            center - bar_width / 2.0,
            zero.min(end),
            (zero - end).abs(),
            bar.color,
            escape(&bar.label.replace('\n', " ")),
            escape(&bar.text)
        );
        let text_y = if bar.value >= 0.0 {
            end - 4.0
        } else {
            end + 11.0
        };
        let _ = writeln!(
            out,
            r#"<text x="{center:.1}" y="{text_y:.1}" class="value" text-anchor="middle">{}</text>"#,
            escape(&bar.text)
        );
        for (line, text) in bar.label.lines().enumerate() {
            let _ = writeln!(
                out,
                r#"<text x="{center:.1}" y="{:.1}" class="label" text-anchor="middle">{}</text>"#,
                y + HEIGHT + 14.0 + 11.0 * line as f64,
                escape(text)
            );
        }
    }
}

/// The `dpd` chart: DPD's change against colocated (same engine count, same run) in TPOT p50,
/// output throughput, TTFT p50 and e2e p50, a bar per topology and load.
pub fn render_chart(report: &DpdReport) -> String {
    const PALETTE: [&str; 4] = ["#1f66c2", "#3c8d5a", "#e3902b", "#8e44ad"];
    let mut topologies: Vec<String> = Vec::new();
    for point in &report.points {
        let name = point.topology.name();
        if !topologies.contains(&name) {
            topologies.push(name);
        }
    }
    let panel_width = (44.0 * report.points.len() as f64).max(300.0);
    let width = 2.0 * panel_width + 200.0;
    let height = 640.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">"#
    );
    out.push_str(
        "<style>.title{font-size:14px;font-weight:bold}.axis{font-size:10px;fill:#555}.label{font-size:9px;fill:#333}.value{font-size:10px;fill:#111}.head{font-size:16px;font-weight:bold}.sub{font-size:11px;fill:#555}</style>\n",
    );
    out.push_str(r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    out.push('\n');
    let _ = writeln!(
        out,
        r#"<text x="20" y="26" class="head">switchyard-bench dpd: disaggregated prefill/decode vs colocated (same engine count)</text>"#
    );
    let _ = writeln!(
        out,
        r#"<text x="20" y="44" class="sub">long prompts {} router tokens (threshold {}), {} output tokens, simulated engines, time scale {}; change of DPD against colocated measured in the same run</text>"#,
        report.long_tokens, report.threshold, report.output_tokens, report.time_scale
    );
    let bars = |value: &dyn Fn(&Changes) -> Option<f64>| -> Vec<Bar> {
        report
            .points
            .iter()
            .map(|point| {
                let change = value(&point.change).unwrap_or(0.0);
                let topology = point.topology.name();
                let color_index = topologies
                    .iter()
                    .position(|name| *name == topology)
                    .unwrap_or(0);
                Bar {
                    label: format!("{topology}\n{}", point.load.name.replace(" c=", "\nc=")),
                    value: change,
                    text: format!("{:+.0}%", change * 100.0),
                    color: PALETTE[color_index % PALETTE.len()],
                }
            })
            .collect()
    };
    let panels: [(&str, Vec<Bar>); 4] = [
        ("TPOT p50 (lower is better)", bars(&|c| c.tpot_p50)),
        (
            "Output throughput (higher is better)",
            bars(&|c| c.throughput),
        ),
        ("TTFT p50 (lower is better)", bars(&|c| c.ttft_p50)),
        ("e2e latency p50 (lower is better)", bars(&|c| c.e2e_p50)),
    ];
    for (index, (title, bars)) in panels.iter().enumerate() {
        let x = 70.0 + (index % 2) as f64 * (panel_width + 90.0);
        let y = 90.0 + (index / 2) as f64 * 290.0;
        change_panel(&mut out, (x, y), panel_width, title, bars);
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topologies_parse_and_bad_ones_name_the_flag() {
        assert_eq!(
            Topology::parse("2p1d"),
            Ok(Topology {
                prefill: 2,
                decode: 1
            })
        );
        assert_eq!(Topology::parse("1P1D").unwrap().engines(), 2);
        for bad in ["", "1P", "P1D", "0P1D", "1P9D", "xPyD"] {
            assert!(
                Topology::parse(bad).unwrap_err().contains("--topologies"),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_vocabulary_is_one_token_for_both_tokenizers() {
        let tokenizers = Tokenizers::new(None);
        let tokenizer = tokenizers.get("cl100k_base");
        let words = vocabulary(&tokenizer);
        assert!(words.len() >= 64, "{}", words.len());
        let mut rng = fastrand::Rng::with_seed(1);
        let text = text(&mut rng, &words, "Load 0 request 0.", 500);
        let header = tokenizer.count("Load 0 request 0.");
        assert_eq!(tokenizer.count(&text), header + 500);
    }
}
