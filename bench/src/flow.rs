//! `switchyard-bench flow`: flow control (MaxInFlightPerInstance) under a burst, without the
//! cap and with it, in the same run, on the same engines: simulated ones, or engines already
//! running (`--engine-url`, e.g. a real vLLM).
//!
//! The engines batch at most `--cap` + `--headroom` requests (`--max-num-seqs`); the capped
//! arm's router caps each instance at `--cap` (MaxInFlightPerInstance) with `--headroom`
//! (FlowHeadroomPerInstance) more for urgent requests and ids below their fair share, so an
//! engine's own queue stays empty and what waits, waits in the router, in its order. The fleet's capacity is measured first (requests per
//! second, closed loop at engines × cap); then each arm gets the same open-loop schedule at
//! `--load` × capacity on average, in bursts (half of each second at twice that, half
//! idle): `--light-share` of the requests from a light fairness id (the body's `user`), the
//! rest from a heavy one; `--high-share` with priority -1 (the body's `priority`, read with
//! `--trust-flow-headers`), the rest 0. TTFT per class is compared with its value on an idle
//! fleet, measured first.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use serde::Serialize;
use switchyard_engine_sim::{SimConfig, SimHandle};
use switchyard_router::{RouterConfig, RouterHandle};

use crate::client::{HttpClient, Outcome, http_client, stream_request};
use crate::error::UsageError;
use crate::output::{Invocation, emit_json};
use crate::stats::Summary;

#[derive(Debug, Clone, clap::Args)]
pub struct FlowArgs {
    /// Simulated engines.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub engines: usize,
    /// An engine already running (for example a real vLLM started with `--max-num-seqs` =
    /// cap + headroom and `--served-model-name sim`), instead of simulated ones; repeat it
    /// per engine. Its `/metrics` must report `vllm:num_requests_running` and
    /// `vllm:num_requests_waiting`.
    #[arg(long = "engine-url", value_name = "URL")]
    pub engine_urls: Vec<String>,
    /// Requests each engine batches (its --max-num-seqs), and MaxInFlightPerInstance of the
    /// capped arm.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub cap: u32,
    /// FlowHeadroomPerInstance of the capped arm (0: none); the engines batch cap + this.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub headroom: u32,
    /// Output tokens per request.
    #[arg(long, default_value_t = 24, value_name = "TOKENS")]
    pub max_tokens: u32,
    /// Words added to every prompt (about a token each; every prompt still its own, nothing
    /// shared to cache). 0: a one-line question (about 15 tokens), whose TTFT is mostly the
    /// engine's step; chat prompts are usually hundreds to thousands of tokens.
    #[arg(long, default_value_t = 0, value_name = "WORDS")]
    pub prompt_words: u32,
    /// Seconds of load per arm.
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    pub seconds: u64,
    /// Offered load, as a multiple of the fleet's measured capacity.
    #[arg(long, default_value_t = 2.0, value_name = "X")]
    pub load: f64,
    /// Share of the requests from the light fairness id.
    #[arg(long, default_value_t = 0.1, value_name = "FRACTION")]
    pub light_share: f64,
    /// Share of the requests with high priority (-1).
    #[arg(long, default_value_t = 0.1, value_name = "FRACTION")]
    pub high_share: f64,
    /// The routers' --queue-timeout-seconds.
    #[arg(long, default_value_t = 5, value_name = "SECONDS")]
    pub queue_timeout_seconds: u64,
    /// Seed of the schedule.
    #[arg(long, default_value_t = 29)]
    pub seed: u64,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// TTFTs and answers of one class of requests in one arm.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClassReport {
    pub sent: usize,
    pub served: usize,
    /// 503 or 429 with `Retry-After`.
    pub refused: usize,
    /// Anything else: lost.
    pub lost: usize,
    pub ttft_ms: Summary,
    /// Time waited in the router's queue (`x-switchyard-queue-ms`; the capped arm only), so
    /// that the router's part of the TTFT is seen apart from the engine's.
    pub queue_ms: Summary,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmReport {
    pub name: String,
    pub light: ClassReport,
    pub heavy: ClassReport,
    pub high: ClassReport,
    pub low: ClassReport,
    /// Most requests one engine ran at once (`vllm:num_requests_running`, sampled every
    /// 20 ms), and most waiting in an engine's own queue (`vllm:num_requests_waiting`).
    pub engine_running_max: f64,
    pub engine_waiting_max: f64,
    pub seconds: f64,
    /// Examples of lost answers.
    pub lost_examples: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlowReport {
    #[serde(flatten)]
    pub invocation: Invocation,
    pub engines: usize,
    pub cap: u32,
    pub headroom: u32,
    pub max_tokens: u32,
    pub prompt_words: u32,
    pub capacity_rps: f64,
    pub offered_rps: f64,
    pub unloaded_ttft_ms: Summary,
    pub arms: Vec<ArmReport>,
    /// The targets, for the capped arm.
    pub targets: Vec<(String, bool)>,
}

impl FlowReport {
    pub fn table(&self) -> String {
        let mut out = format!(
            "\nflow control: {} engines batching {} each (cap {}, headroom {}), {} words added to each prompt, {} output tokens; capacity {:.1} req/s, offered {:.1} req/s in bursts\n  unloaded TTFT p50 {:.1} ms, p99 {:.1} ms\n",
            self.engines,
            self.cap + self.headroom,
            self.cap,
            self.headroom,
            self.prompt_words,
            self.max_tokens,
            self.capacity_rps,
            self.offered_rps,
            self.unloaded_ttft_ms.p50,
            self.unloaded_ttft_ms.p99
        );
        out.push_str("  arm        class  sent served refused lost  TTFT p50 ms  TTFT p99 ms  queue p50 ms  queue p99 ms\n");
        for arm in &self.arms {
            for (name, class) in [
                ("light", &arm.light),
                ("heavy", &arm.heavy),
                ("high", &arm.high),
                ("low", &arm.low),
            ] {
                out.push_str(&format!(
                    "  {:<10} {:<6} {:>4} {:>6} {:>7} {:>4} {:>12.1} {:>12.1} {:>13.1} {:>13.1}\n",
                    arm.name,
                    name,
                    class.sent,
                    class.served,
                    class.refused,
                    class.lost,
                    class.ttft_ms.p50,
                    class.ttft_ms.p99,
                    class.queue_ms.p50,
                    class.queue_ms.p99
                ));
            }
            out.push_str(&format!(
                "  {:<10} engines: at most {} running, {} waiting at once; {:.1} s\n",
                arm.name, arm.engine_running_max, arm.engine_waiting_max, arm.seconds
            ));
        }
        for (target, met) in &self.targets {
            out.push_str(&format!(
                "  {} {target}\n",
                if *met { "met    " } else { "NOT MET" }
            ));
        }
        out
    }
}

pub async fn flow(args: FlowArgs) -> anyhow::Result<FlowReport> {
    if args.engines == 0 || args.engines > 16 || args.engine_urls.len() > 16 {
        return Err(UsageError::new(
            "--engines must be within 1..=16, and so must the --engine-url count",
        )
        .into());
    }
    for url in &args.engine_urls {
        if url
            .parse::<http::Uri>()
            .map_or(true, |uri| uri.host().is_none())
        {
            return Err(UsageError::new(format!("--engine-url {url:?} is not an http URL")).into());
        }
    }
    if args.cap == 0 || args.cap > 256 {
        return Err(UsageError::new("--cap must be within 1..=256").into());
    }
    if args.headroom > 256 {
        return Err(UsageError::new("--headroom must be within 0..=256").into());
    }
    if !(0.0..=1.0).contains(&args.light_share) || !(0.0..=1.0).contains(&args.high_share) {
        return Err(UsageError::new("--light-share and --high-share are fractions").into());
    }
    if args.prompt_words > 100_000 {
        return Err(UsageError::new("--prompt-words must be within 0..=100000").into());
    }
    if !(0.1..=20.0).contains(&args.load) {
        return Err(UsageError::new("--load must be within 0.1..=20").into());
    }
    let mut sims: Vec<SimHandle> = Vec::new();
    if args.engine_urls.is_empty() {
        for _ in 0..args.engines {
            sims.push(
                switchyard_engine_sim::spawn(SimConfig {
                    max_num_seqs: (args.cap + args.headroom) as usize,
                    record_requests: 1,
                    ..SimConfig::default()
                })
                .await?,
            );
        }
    }
    let engines: Vec<String> = match args.engine_urls.as_slice() {
        [] => sims.iter().map(|sim| sim.url.clone()).collect(),
        urls => urls
            .iter()
            .map(|url| url.trim_end_matches('/').to_owned())
            .collect(),
    };
    let args = FlowArgs {
        engines: engines.len(),
        ..args
    };
    let dir = tempfile::Builder::new()
        .prefix("switchyard-flow-")
        .tempdir()?;
    let uncapped = start_router(&dir, "uncapped", None, &engines, &args).await?;
    let capped = start_router(&dir, "capped", Some(args.cap), &engines, &args).await?;
    let client = http_client();
    let url = |router: &RouterHandle| -> anyhow::Result<http::Uri> {
        Ok(format!("{}/endpoints/chat/openai/v1/chat/completions", router.url()).parse()?)
    };
    // An idle fleet's TTFT, one request at a time.
    let mut unloaded = Vec::new();
    for index in 0..30 {
        let outcome = request(&client, &url(&capped)?, &body(index, "light", 0, &args)).await;
        anyhow::ensure!(
            outcome.ok(),
            "an unloaded request failed: {:?}",
            outcome.error
        );
        unloaded.extend(outcome.ttft.map(|ttft| ttft.as_secs_f64() * 1000.0));
    }
    let unloaded_ttft_ms = Summary::of(&unloaded);
    // Capacity: closed loop at engines × cap.
    let capacity_rps = capacity(&client, &url(&capped)?, &args).await?;
    let offered_rps = capacity_rps * args.load;
    let schedule = schedule(&args, offered_rps);
    let mut arms = Vec::new();
    for (name, router) in [("uncapped", &uncapped), ("capped", &capped)] {
        idle(&engines).await?;
        arms.push(arm(name, &client, &url(router)?, &schedule, &engines, &args).await?);
    }
    let capped_arm = &arms[1];
    let bound = 2.0 * unloaded_ttft_ms.p99;
    let targets = vec![
        (
            "every light-id request served".to_owned(),
            capped_arm.light.served == capped_arm.light.sent,
        ),
        (
            format!(
                "light-id TTFT p99 {:.1} ms <= 2 x unloaded p99 ({bound:.1} ms)",
                capped_arm.light.ttft_ms.p99
            ),
            capped_arm.light.ttft_ms.p99 <= bound,
        ),
        (
            format!(
                "high-priority TTFT p99 {:.1} ms <= 2 x unloaded p99 ({bound:.1} ms)",
                capped_arm.high.ttft_ms.p99
            ),
            capped_arm.high.ttft_ms.p99 <= bound,
        ),
        (
            format!(
                "engine running <= cap + headroom ({} <= {}) and nothing waiting in an engine ({})",
                capped_arm.engine_running_max,
                args.cap + args.headroom,
                capped_arm.engine_waiting_max
            ),
            capped_arm.engine_running_max <= f64::from(args.cap + args.headroom)
                && capped_arm.engine_waiting_max == 0.0,
        ),
        (
            "no request lost (served, or refused with Retry-After)".to_owned(),
            [
                &capped_arm.light,
                &capped_arm.heavy,
                &capped_arm.high,
                &capped_arm.low,
            ]
            .iter()
            .all(|class| class.lost == 0),
        ),
    ];
    let report = FlowReport {
        invocation: Invocation::current("switchyard-bench".into()),
        engines: args.engines,
        cap: args.cap,
        headroom: args.headroom,
        max_tokens: args.max_tokens,
        prompt_words: args.prompt_words,
        capacity_rps,
        offered_rps,
        unloaded_ttft_ms,
        arms,
        targets,
    };
    uncapped.shutdown().await;
    capped.shutdown().await;
    emit_json(&report.table(), &report, args.json.as_deref())?;
    Ok(report)
}

async fn start_router(
    dir: &tempfile::TempDir,
    name: &str,
    cap: Option<u32>,
    engines: &[String],
    args: &FlowArgs,
) -> anyhow::Result<RouterHandle> {
    let cap_line = cap.map_or(String::new(), |cap| {
        let headroom = match args.headroom {
            0 => String::new(),
            headroom => format!("        FlowHeadroomPerInstance: {headroom}\n"),
        };
        format!("        MaxInFlightPerInstance: {cap}\n{headroom}")
    });
    let mut yaml = format!(
        "Endpoints:\n  - EndpointName: chat\n    ProductionVariants:\n      - VariantName: v\n        ModelName: sim\n{cap_line}        RoutingConfig: {{RoutingStrategy: LEAST_OUTSTANDING_REQUESTS}}\n    Instances:\n"
    );
    for (index, engine) in engines.iter().enumerate() {
        yaml.push_str(&format!(
            "      - {{Url: \"{engine}\", InstanceId: e{index}, VariantName: v}}\n"
        ));
    }
    let path = dir.path().join(format!("{name}.yaml"));
    std::fs::write(&path, yaml)?;
    let mut config =
        RouterConfig::with_control_plane(switchyard_cluster::loopback_any(), Vec::new());
    config.config = Some(path);
    config.trust_flow_headers = true;
    config.queue_timeout_seconds = args.queue_timeout_seconds;
    let settings = config.validate().map_err(|err| anyhow::anyhow!("{err}"))?;
    RouterHandle::start(settings)
        .await
        .context("starting a router")
}

/// A streamed chat body: a prompt of its own (no shared prefix), the fairness id in `user`,
/// the priority in `priority`.
fn body(index: usize, user: &str, priority: i32, args: &FlowArgs) -> Bytes {
    const FILLER: [&str; 8] = [
        "queue", "engine", "router", "batch", "token", "prefix", "cache", "stream",
    ];
    let mut content = format!("request {index} from {user}: tell me about flow control in routers");
    for word in 0..args.prompt_words as usize {
        content.push(' ');
        content.push_str(FILLER[(word * 5 + index) % FILLER.len()]);
    }
    Bytes::from(
        serde_json::json!({
            "model": "sim",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": args.max_tokens,
            "stream": true,
            "user": user,
            "priority": priority,
        })
        .to_string(),
    )
}

async fn request(client: &HttpClient, url: &http::Uri, body: &Bytes) -> Outcome {
    stream_request(client, url, body.clone(), Duration::from_secs(120)).await
}

async fn capacity(client: &HttpClient, url: &http::Uri, args: &FlowArgs) -> anyhow::Result<f64> {
    let concurrency = args.engines * args.cap as usize;
    let per_worker = 6;
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..concurrency {
        let (client, url) = (client.clone(), url.clone());
        let bodies: Vec<Bytes> = (0..per_worker)
            .map(|turn| body(10_000 + worker * per_worker + turn, "heavy", 0, args))
            .collect();
        workers.spawn(async move {
            for body in bodies {
                let outcome = request(&client, &url, &body).await;
                if !outcome.ok() {
                    return Err(anyhow::anyhow!("{:?}", outcome.error));
                }
            }
            Ok(())
        });
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    Ok((concurrency * per_worker) as f64 / started.elapsed().as_secs_f64())
}

/// One request of the schedule: when (from the start), whose, which priority.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    at: Duration,
    light: bool,
    high: bool,
}

/// Poisson arrivals at twice `rps` during the first half of each second, none in the
/// second half.
fn schedule(args: &FlowArgs, rps: f64) -> Vec<Arrival> {
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let burst_rps = 2.0 * rps;
    let mut arrivals = Vec::new();
    for second in 0..args.seconds {
        let mut at = 0.0f64;
        loop {
            at += -(1.0 - rng.f64()).ln() / burst_rps;
            if at >= 0.5 {
                break;
            }
            arrivals.push(Arrival {
                at: Duration::from_secs_f64(second as f64 + at),
                light: rng.f64() < args.light_share,
                high: rng.f64() < args.high_share,
            });
        }
    }
    arrivals
}

/// Waits until no engine runs or queues anything.
async fn idle(engines: &[String]) -> anyhow::Result<()> {
    let client = http_client();
    for _ in 0..600 {
        let mut busy = 0.0;
        for engine in engines {
            let (running, waiting) = load_at(&client, engine).await;
            busy += running + waiting;
        }
        if busy == 0.0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("the engines did not go idle within a minute")
}

async fn arm(
    name: &str,
    client: &HttpClient,
    url: &http::Uri,
    schedule: &[Arrival],
    engines: &[String],
    args: &FlowArgs,
) -> anyhow::Result<ArmReport> {
    let started = tokio::time::Instant::now();
    let mut requests = tokio::task::JoinSet::new();
    for (index, arrival) in schedule.iter().copied().enumerate() {
        let (client, url) = (client.clone(), url.clone());
        let body = body(
            index,
            if arrival.light { "light" } else { "heavy" },
            if arrival.high { -1 } else { 0 },
            args,
        );
        requests.spawn(async move {
            tokio::time::sleep_until(started + arrival.at).await;
            (arrival, request(&client, &url, &body).await)
        });
    }
    let watcher = {
        let client = client.clone();
        let urls = engines.to_vec();
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let (mut running_max, mut waiting_max) = (0.0f64, 0.0f64);
            loop {
                for url in &urls {
                    let (running, waiting) = load_at(&client, url).await;
                    running_max = running_max.max(running);
                    waiting_max = waiting_max.max(waiting);
                }
                tokio::select! {
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
            (running_max, waiting_max)
        });
        (stop, task)
    };
    let mut report = ArmReport {
        name: name.to_owned(),
        light: ClassReport::default(),
        heavy: ClassReport::default(),
        high: ClassReport::default(),
        low: ClassReport::default(),
        engine_running_max: 0.0,
        engine_waiting_max: 0.0,
        seconds: 0.0,
        lost_examples: Vec::new(),
    };
    let mut ttfts: [Vec<f64>; 4] = Default::default();
    let mut waits: [Vec<f64>; 4] = Default::default();
    while let Some(joined) = requests.join_next().await {
        let (arrival, outcome) = joined?;
        let refused = matches!(outcome.status, 429 | 503) && outcome.retry_after.is_some();
        let ttft = outcome
            .ttft
            .filter(|_| outcome.ok())
            .map(|ttft| ttft.as_secs_f64() * 1000.0);
        let classes = [
            (0, arrival.light),
            (1, !arrival.light),
            (2, arrival.high),
            (3, !arrival.high),
        ];
        for (class, member) in classes {
            if !member {
                continue;
            }
            let counts = match class {
                0 => &mut report.light,
                1 => &mut report.heavy,
                2 => &mut report.high,
                _ => &mut report.low,
            };
            counts.sent += 1;
            match (&ttft, refused) {
                (Some(ttft), _) => {
                    counts.served += 1;
                    ttfts[class].push(*ttft);
                    waits[class].extend(outcome.queue_ms);
                }
                (None, true) => counts.refused += 1,
                (None, false) => counts.lost += 1,
            }
        }
        if ttft.is_none() && !refused && report.lost_examples.len() < 5 {
            report
                .lost_examples
                .push(format!("{} {:?}", outcome.status, outcome.error));
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    let (stop, task) = watcher;
    let _ = stop.send(());
    let (running_max, waiting_max) = task.await?;
    report.engine_running_max = running_max;
    report.engine_waiting_max = waiting_max;
    for (class, (samples, waited)) in ttfts.iter().zip(&waits).enumerate() {
        let counts = match class {
            0 => &mut report.light,
            1 => &mut report.heavy,
            2 => &mut report.high,
            _ => &mut report.low,
        };
        counts.ttft_ms = Summary::of(samples);
        counts.queue_ms = Summary::of(waited);
    }
    Ok(report)
}

async fn load_at(client: &HttpClient, url: &str) -> (f64, f64) {
    let Ok(uri) = format!("{url}/metrics").parse::<http::Uri>() else {
        return (0.0, 0.0);
    };
    let Ok(Ok(response)) = tokio::time::timeout(Duration::from_secs(2), client.get(uri)).await
    else {
        return (0.0, 0.0);
    };
    let Ok(body) = http_body_util::BodyExt::collect(response.into_body()).await else {
        return (0.0, 0.0);
    };
    let samples = crate::scrape::parse(&String::from_utf8_lossy(&body.to_bytes()));
    (
        crate::scrape::total(&samples, "vllm:num_requests_running"),
        crate::scrape::total(&samples, "vllm:num_requests_waiting"),
    )
}
